//! This node's Node → what its proxiers read of it: its zone, its addresses, and the
//! primary IP and pod CIDR of each family.

use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use tandem_common::IpFamily;

/// The label that names a node's zone, which endpoint zone hints are matched against.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// The node's zone: its `topology.kubernetes.io/zone` label, `None` without one. Read at
/// every sync (a change re-chooses the endpoints of hinted Service ports), as kube-proxy
/// follows the label through its Node topology handler.
pub fn node_zone(node: &Node) -> Option<String> {
    node.metadata.labels.as_ref()?.get(ZONE_LABEL).cloned()
}

/// What a sync reads of this node's Node: its zone ([`node_zone`]) and whether it is
/// leaving (the `/healthz` answer, [`tandem_common::node_is_leaving`]). The kubelet's
/// status writes, every `nodeStatusUpdateFrequency`, change neither.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncedNodeFields {
    pub zone: Option<String>,
    pub leaving: bool,
}

impl SyncedNodeFields {
    pub fn of(node: &Node) -> Self {
        Self {
            zone: node_zone(node),
            leaving: tandem_common::node_is_leaving(node),
        }
    }
}

/// The node's addresses from `status.addresses` (InternalIP and ExternalIP): what
/// `-m addrtype --dst-type LOCAL` matches on it.
pub fn node_addresses(node: &Node) -> Vec<IpAddr> {
    node.status
        .as_ref()
        .and_then(|status| status.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| matches!(a.type_.as_str(), "InternalIP" | "ExternalIP"))
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

/// The node's primary address of `family` as kube-proxy detects it: the first InternalIP,
/// else the first ExternalIP, of that family in `status.addresses`.
pub fn node_primary_ip(node: &Node, family: IpFamily) -> Option<IpAddr> {
    let addresses = node
        .status
        .as_ref()
        .and_then(|status| status.addresses.as_ref())?;
    ["InternalIP", "ExternalIP"].into_iter().find_map(|kind| {
        addresses
            .iter()
            .filter(|a| a.type_ == kind)
            .filter_map(|a| a.address.parse().ok())
            .find(|ip| family.holds(*ip))
    })
}

/// What the proxier of one family reads from its Node at start (a change needs a restart,
/// as in kube-proxy).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// [`node_primary_ip`].
    pub ip: Option<IpAddr>,
    /// [`node_pod_cidr`]: `--detect-local-mode NodeCIDR`'s CIDR.
    pub pod_cidr: Option<IpNet>,
}

impl NodeFacts {
    pub fn of(node: &Node, family: IpFamily) -> Self {
        Self {
            ip: node_primary_ip(node, family),
            pod_cidr: node_pod_cidr(node, family),
        }
    }
}

/// The node's pod CIDR of `family`: the first of `spec.podCIDRs` (else `spec.podCIDR`) of
/// that family, as kube-proxy's `NodeCIDR` detector takes it; unparsable entries are
/// skipped.
pub fn node_pod_cidr(node: &Node, family: IpFamily) -> Option<IpNet> {
    let spec = node.spec.as_ref()?;
    spec.pod_cidrs
        .iter()
        .flatten()
        .chain(spec.pod_cidr.as_ref())
        .filter_map(|cidr| cidr.parse::<IpNet>().ok())
        .find(|cidr| family.holds(cidr.addr()))
        .map(|cidr| cidr.trunc())
}

#[cfg(test)]
mod tests;
