//! Which endpoints of a Service port this node sends to, and why: kube-proxy's
//! `CategorizeEndpoints` (`pkg/proxy/topology.go`, as of 1.34 with PreferSameNode).
//!
//! [`choose_endpoints`] is the one decision; the iptables rules ([`crate::rules`]) and the
//! nftables layout ([`crate::nft::layout`]) both spread over what it returns, and
//! `tandem-nodeproxy trace` prints its [`EndpointChoice`].
//!
//! As in kube-proxy, the topology mode follows the hints themselves, not the Service's
//! `trafficDistribution` or `topology-mode` annotation: the EndpointSlice controller
//! writes hints only where those ask for them, and removes them (all at once) when it
//! cannot keep them balanced. So a node narrows its cluster-wide set only when the hints
//! are complete and say something about it:
//!
//! - PreferSameNode: every ready endpoint has node hints (`hints.forNodes`) and one is for
//!   this node: the endpoints hinted for this node;
//! - else PreferSameZone: every ready endpoint has zone hints (`hints.forZones`) and one is
//!   for this node's `topology.kubernetes.io/zone`: the endpoints hinted for that zone;
//! - else every ready endpoint.
//!
//! Without a ready endpoint anywhere the serving terminating ones stand in, hints unused.
//! The Local set (either traffic policy Local) never looks at hints: it is this node's
//! endpoints already.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Write as _};
use std::net::{IpAddr, SocketAddr};

use crate::model::{Endpoint, IpMode, NodeConfig, ProxyState, ServicePort, sorted_unique};
use crate::trace::TraceRequest;

/// How the hints narrow this node's cluster-wide endpoint set (kube-proxy's topology mode
/// with the reason it logs when it does not apply).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// PreferSameNode: the endpoints hinted for this node (its name).
    SameNode(String),
    /// PreferSameZone: the endpoints hinted for this node's zone.
    SameZone(String),
    /// Every ready endpoint; why the hints did not narrow them.
    All(Unnarrowed),
    /// No endpoint is ready: hints are not looked at, the serving terminating endpoints
    /// stand in (KEP-1669).
    NoReadyEndpoints,
}

/// Why a node with ready endpoints uses all of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unnarrowed {
    /// No ready endpoint has a zone hint: the Service asks for no topology (or the
    /// controller removed its hints).
    NoHints,
    /// Some ready endpoints have zone hints, others none (a slice written before the
    /// hints, or by another controller): kube-proxy trusts incomplete hints nowhere.
    MissingZoneHints,
    /// The hints are complete but the node has no `topology.kubernetes.io/zone` label.
    NodeWithoutZone,
    /// The hints are complete but none is for this node's zone.
    NoEndpointForZone(String),
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Topology::SameNode(node) => write!(f, "topology: node {node} hints"),
            Topology::SameZone(zone) => write!(f, "topology: zone {zone} hints"),
            Topology::All(Unnarrowed::NoHints) => f.write_str("no topology hints: all endpoints"),
            Topology::All(Unnarrowed::MissingZoneHints) => {
                f.write_str("hints incomplete: all endpoints")
            }
            Topology::All(Unnarrowed::NodeWithoutZone) => f.write_str(
                "hints ignored, the node has no topology.kubernetes.io/zone label: all endpoints",
            ),
            Topology::All(Unnarrowed::NoEndpointForZone(zone)) => {
                write!(f, "no endpoint hinted for zone {zone}: all endpoints")
            }
            Topology::NoReadyEndpoints => {
                f.write_str("no ready endpoint: serving terminating endpoints, hints unused")
            }
        }
    }
}

impl Topology {
    /// kube-proxy's `topologyModeFromHints`: the mode the ready endpoints' hints allow on
    /// this node. The zone is the node's label, `""` when it has none, as kube-proxy reads
    /// it from its label map.
    pub fn of(endpoints: &[Endpoint], node: &NodeConfig) -> Self {
        let zone = node.zone.as_deref().unwrap_or_default();
        let mut any_ready = false;
        let (mut all_node_hints, mut for_node) = (true, false);
        let (mut all_zone_hints, mut any_zone_hints, mut for_zone) = (true, false, false);
        for ep in endpoints.iter().filter(|ep| ep.is_ready()) {
            any_ready = true;
            match ep.hints.as_deref() {
                Some(hints) if !hints.nodes.is_empty() => {
                    for_node |= hints.for_node(&node.node_name);
                }
                _ => all_node_hints = false,
            }
            match ep.hints.as_deref() {
                Some(hints) if !hints.zones.is_empty() => {
                    any_zone_hints = true;
                    for_zone |= hints.for_zone(zone);
                }
                _ => all_zone_hints = false,
            }
        }
        if !any_ready {
            return Topology::NoReadyEndpoints;
        }
        // PreferSameNode is beta and on by default from 1.34 (the
        // PreferSameTrafficDistribution gate); node hints for other nodes only fall
        // through to the zone hints, which the controller writes beside them.
        if all_node_hints && for_node {
            return Topology::SameNode(node.node_name.clone());
        }
        match () {
            () if all_zone_hints && for_zone => Topology::SameZone(zone.to_owned()),
            () if all_zone_hints && zone.is_empty() => Topology::All(Unnarrowed::NodeWithoutZone),
            () if all_zone_hints => Topology::All(Unnarrowed::NoEndpointForZone(zone.to_owned())),
            () if any_zone_hints => Topology::All(Unnarrowed::MissingZoneHints),
            () => Topology::All(Unnarrowed::NoHints),
        }
    }

    /// kube-proxy's `availableForTopology`: whether a ready endpoint is in the narrowed
    /// set (no fallback here: the fallback is in choosing the mode).
    pub fn admits(&self, ep: &Endpoint) -> bool {
        match self {
            Topology::SameNode(node) => ep.hints.as_deref().is_some_and(|h| h.for_node(node)),
            Topology::SameZone(zone) => ep.hints.as_deref().is_some_and(|h| h.for_zone(zone)),
            Topology::All(_) | Topology::NoReadyEndpoints => true,
        }
    }
}

/// An endpoint that gets traffic: from anywhere (`cluster`, after topology), through a
/// Local traffic policy (`local`: externalTrafficPolicy for external paths,
/// internalTrafficPolicy for the cluster IP), or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsableEndpoint {
    pub addr: SocketAddr,
    pub cluster: bool,
    pub local: bool,
}

/// What [`choose_endpoints`] decided for one Service port on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointChoice {
    pub topology: Topology,
    /// The endpoints that get traffic, de-duplicated (an endpoint can appear in two
    /// EndpointSlices while they are being rebalanced) and ordered as kube-proxy orders
    /// them: by their `ip:port` text.
    pub endpoints: Vec<UsableEndpoint>,
    /// How many endpoints the cluster-wide set was chosen from: the ready ones, or the
    /// serving terminating ones when none is ready.
    pub candidates: usize,
}

impl EndpointChoice {
    /// The size of the cluster-wide set.
    pub fn cluster(&self) -> usize {
        self.endpoints.iter().filter(|ep| ep.cluster).count()
    }

    /// The size of this node's set (traffic policy Local).
    pub fn local(&self) -> usize {
        self.endpoints.iter().filter(|ep| ep.local).count()
    }
}

/// "topology: zone us-east-1a hints, 2 of 4 endpoints".
impl fmt::Display for EndpointChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.candidates == 0 {
            return f.write_str("no ready or serving terminating endpoint: rejected");
        }
        write!(
            f,
            "{}, {} of {} endpoints",
            self.topology,
            self.cluster(),
            self.candidates
        )
    }
}

/// Which paths of a Service port exist and which endpoint sets they spread over: the
/// decisions the iptables and the nftables mode make alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PortPaths {
    /// Ingress IPs the node captures: `ipMode: Proxy` ones are reached through node
    /// ports only (KEP-1860), so the node must not short-cut them.
    pub(crate) vip_ingress: Vec<IpAddr>,
    /// Reachable other than by the cluster IP: a node port, external or LB IPs.
    pub(crate) external: bool,
    /// externalTrafficPolicy Local, where it applies: to node ports, external and LB IPs
    /// (the API refuses Local on a Service that has none of them).
    pub(crate) local_policy: bool,
    /// internalTrafficPolicy Local: the cluster IP leads to this node's endpoints only.
    pub(crate) internal_local: bool,
    /// The cluster-wide endpoint set is used: by the cluster IP (internalTrafficPolicy
    /// Cluster) or by the external paths, whose Cluster policy or Local short-cuts need
    /// it. kube-proxy's `UsesClusterEndpoints`.
    pub(crate) uses_cluster: bool,
    /// This node's endpoint set is used (either policy Local): `UsesLocalEndpoints`.
    pub(crate) uses_local: bool,
}

impl PortPaths {
    pub(crate) fn of(svc: &ServicePort) -> Self {
        let vip_ingress: Vec<IpAddr> = svc
            .load_balancer_ingress
            .iter()
            .filter(|ingress| ingress.ip_mode == IpMode::Vip)
            .map(|ingress| ingress.ip)
            .collect();
        let vip_ingress = sorted_unique(&vip_ingress);
        let external =
            svc.node_port.is_some() || !svc.external_ips.is_empty() || !vip_ingress.is_empty();
        let local_policy = svc.external_traffic_policy_local && external;
        let internal_local = svc.internal_traffic_policy_local;
        Self {
            vip_ingress,
            external,
            local_policy,
            internal_local,
            uses_cluster: !internal_local || external,
            uses_local: local_policy || internal_local,
        }
    }

    /// Whether a set the port uses holds `ep`: endpoints of an unused set get no chain.
    pub(crate) fn spreads_over(&self, ep: &UsableEndpoint) -> bool {
        (self.uses_cluster && ep.cluster) || (self.uses_local && ep.local)
    }
}

/// kube-proxy's `CategorizeEndpoints` for one Service port on this node: the cluster-wide
/// set is the ready endpoints the [`Topology`] admits, or, when none is ready anywhere,
/// the serving terminating ones; the local set (either traffic policy Local) is this
/// node's ready endpoints, or, when it has none, its serving terminating ones, so
/// connections survive a rolling update of the only local pod while the health check
/// already sends new ones elsewhere. Both sets are returned for every port; which a port
/// uses is its traffic policies' business ([`PortPaths`]).
pub fn choose_endpoints(endpoints: &[Endpoint], node: &NodeConfig) -> EndpointChoice {
    let topology = Topology::of(endpoints, node);
    let is_local = |ep: &Endpoint| ep.node_name.as_deref() == Some(node.node_name.as_str());
    let any_ready = topology != Topology::NoReadyEndpoints;
    let any_local_ready = endpoints.iter().any(|ep| ep.is_ready() && is_local(ep));
    let usable_if = |ep: &Endpoint, ready_exist: bool| {
        if ready_exist {
            ep.is_ready()
        } else {
            ep.is_serving_terminating()
        }
    };
    let mut candidates = BTreeSet::new();
    let mut usable: BTreeMap<String, UsableEndpoint> = BTreeMap::new();
    for ep in endpoints {
        let addr = SocketAddr::new(ep.ip, ep.port);
        let candidate = usable_if(ep, any_ready);
        if candidate {
            candidates.insert(addr);
        }
        let cluster = candidate && topology.admits(ep);
        let local = is_local(ep) && usable_if(ep, any_local_ready);
        if !cluster && !local {
            continue;
        }
        let entry = usable.entry(addr.to_string()).or_insert(UsableEndpoint {
            addr,
            cluster: false,
            local: false,
        });
        entry.cluster |= cluster;
        entry.local |= local;
    }
    EndpointChoice {
        topology,
        endpoints: usable.into_values().collect(),
        candidates: candidates.len(),
    }
}

/// For `tandem-nodeproxy trace`: which endpoints each Service port the traced packet is
/// addressed to uses on this node, and why, one line a port: "default/web:http:
/// topology: zone us-east-1a hints, 2 of 4 endpoints". A port is addressed by its cluster
/// IP, an external or LB IP, or its node port on an address of the node, each with its
/// port number and protocol.
pub fn explain(state: &ProxyState, node: &NodeConfig, request: &TraceRequest) -> Vec<String> {
    let packet = &request.packet;
    let addressed = |svc: &ServicePort| {
        let by_ip = svc.port == packet.dst_port
            && (svc.cluster_ip == Some(packet.dst)
                || svc.external_ips.contains(&packet.dst)
                || svc
                    .load_balancer_ingress
                    .iter()
                    .any(|ingress| ingress.ip == packet.dst));
        let by_node_port = svc.node_port == Some(packet.dst_port) && request.is_local(packet.dst);
        svc.protocol == packet.protocol && svc.cluster_ip.is_some() && (by_ip || by_node_port)
    };
    state
        .services()
        .values()
        .filter(|svc| addressed(svc))
        .map(|svc| {
            let choice = choose_endpoints(state.endpoints_of(&svc.name), node);
            let paths = PortPaths::of(svc);
            let mut line = format!("{}: {choice}", svc.name);
            if paths.uses_local {
                let _ = write!(
                    line,
                    "; traffic policy Local: {} endpoints on this node, hints not used",
                    choice.local()
                );
            }
            line
        })
        .collect()
}

/// The endpoints of [`choose_endpoints`], for the layouts.
pub(crate) fn usable_endpoints(endpoints: &[Endpoint], node: &NodeConfig) -> Vec<UsableEndpoint> {
    choose_endpoints(endpoints, node).endpoints
}

#[cfg(test)]
mod tests;
