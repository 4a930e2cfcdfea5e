//! EndpointSlices → the endpoints of the Service ports they name, and one Service port's
//! endpoints joined over all the slices of its Service, as kube-proxy's
//! `endpointslicecache.go` keeps and merges them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::discovery::v1::{EndpointHints, EndpointSlice};
use tandem_common::IpFamily;
use tandem_proxy_rules::model::{Endpoint, Hints, ServicePortName};

use super::service::service_selector;
use super::{ObjectKey, Skipped, positive_port};

/// Label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The label selector of the EndpointSlice watch: slices of Services we proxy.
pub fn slice_selector() -> String {
    format!("{},{SERVICE_NAME_LABEL}", service_selector())
}

/// What the node proxy keeps of one EndpointSlice: the Service its label names, the
/// Service ports it names with the port their endpoints listen on, its endpoints (once,
/// whatever the number of ports), and the values left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SliceEntry {
    pub service: Option<ObjectKey>,
    ports: Vec<(ServicePortName, u16)>,
    endpoints: Vec<SliceEndpoint>,
    pub skipped: Vec<Skipped>,
}

/// An endpoint of a slice, before a port is given to it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SliceEndpoint {
    ip: IpAddr,
    ready: bool,
    serving: bool,
    terminating: bool,
    node_name: Option<String>,
    hints: Option<Arc<Hints>>,
}

impl SliceEndpoint {
    fn at(&self, port: u16) -> Endpoint {
        Endpoint {
            ip: self.ip,
            port,
            ready: self.ready,
            serving: self.serving,
            terminating: self.terminating,
            node_name: self.node_name.clone(),
            hints: self.hints.clone(),
        }
    }
}

impl SliceEntry {
    /// The slice as the proxier of `family` sees it: without endpoints unless its
    /// `addressType` is that family.
    pub fn of(slice: &EndpointSlice, family: IpFamily) -> Self {
        let service = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get(SERVICE_NAME_LABEL))
            .map(|service| {
                let namespace = slice.metadata.namespace.clone().unwrap_or_default();
                (namespace, service.clone())
            });
        let Some((namespace, service_name)) = service
            .as_ref()
            .filter(|_| slice.address_type == family.as_str())
        else {
            // No Service, or a slice of the other family or of FQDNs: nothing this
            // family's rules can use.
            return Self {
                service,
                ..Self::default()
            };
        };
        let id = format!(
            "{namespace}/{}",
            slice.metadata.name.as_deref().unwrap_or_default()
        );
        let mut skipped = Vec::new();
        let mut skip = |field: &'static str, value: &str, reason: &'static str| {
            skipped.push(Skipped::SliceValue {
                slice: id.clone(),
                field,
                value: value.to_owned(),
                reason,
            });
        };
        let mut ports = Vec::new();
        for port in slice.ports.iter().flatten() {
            let Some(target) = port.port.and_then(positive_port) else {
                skip(
                    "ports.port",
                    &format!("{:?}", port.port),
                    "not a port number",
                );
                continue;
            };
            let name = ServicePortName {
                namespace: namespace.clone(),
                name: service_name.clone(),
                port: port.name.clone().unwrap_or_default(),
            };
            ports.push((name, target));
        }
        let mut endpoints = Vec::new();
        for endpoint in &slice.endpoints {
            // kube-proxy uses the first address; the API allows only one for IPv4 slices.
            let Some(address) = endpoint.addresses.first() else {
                continue;
            };
            let Some(ip) = address
                .trim()
                .parse::<IpAddr>()
                .ok()
                .filter(|ip| family.holds(*ip))
            else {
                skip(
                    "endpoints.addresses",
                    address,
                    "not an address of the slice's addressType",
                );
                continue;
            };
            let conditions = endpoint.conditions.as_ref();
            let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
            endpoints.push(SliceEndpoint {
                ip,
                ready,
                serving: conditions.and_then(|c| c.serving).unwrap_or(ready),
                terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
                node_name: endpoint.node_name.clone(),
                hints: endpoint_hints(endpoint.hints.as_ref()),
            });
        }
        Self {
            service,
            ports,
            endpoints,
            skipped,
        }
    }

    /// The Service ports this slice gives endpoints to (none when it has no endpoints).
    pub fn served_ports(&self) -> impl Iterator<Item = &ServicePortName> {
        let served = if self.endpoints.is_empty() {
            &[][..]
        } else {
            &self.ports[..]
        };
        served.iter().map(|(name, _)| name)
    }

    /// This slice's endpoints of one Service port.
    fn endpoints_of<'a>(
        &'a self,
        name: &'a ServicePortName,
    ) -> impl Iterator<Item = Endpoint> + 'a {
        self.ports
            .iter()
            .filter(move |(port, _)| port == name)
            .flat_map(|(_, target)| self.endpoints.iter().map(|endpoint| endpoint.at(*target)))
    }
}

/// An endpoint's `hints.forZones[].name` and `hints.forNodes[].name`, as kube-proxy keeps
/// them: as sets, `None` when there are neither.
fn endpoint_hints(hints: Option<&EndpointHints>) -> Option<Arc<Hints>> {
    let hints = hints?;
    Hints::of(
        hints
            .for_zones
            .iter()
            .flatten()
            .map(|zone| zone.name.clone()),
        hints
            .for_nodes
            .iter()
            .flatten()
            .map(|node| node.name.clone()),
    )
}

/// One Service port's endpoints from the slices of its Service, joined (empty: none).
pub fn port_endpoints<'a>(
    name: &ServicePortName,
    slices: impl IntoIterator<Item = &'a SliceEntry>,
) -> Vec<Endpoint> {
    join_endpoints(
        slices
            .into_iter()
            .flat_map(|slice| slice.endpoints_of(name)),
    )
}

/// One Service port's endpoints from all of its slices, in a fixed order. The same
/// endpoint may sit in two slices while the EndpointSlice controller moves it; one entry
/// per address is kept, preferring the one that is ready.
pub fn join_endpoints(all: impl IntoIterator<Item = Endpoint>) -> Vec<Endpoint> {
    let set: BTreeSet<Endpoint> = all.into_iter().collect();
    let mut by_address: BTreeMap<(IpAddr, u16), Endpoint> = BTreeMap::new();
    for endpoint in set {
        let key = (endpoint.ip, endpoint.port);
        let better = match by_address.get(&key) {
            None => true,
            Some(old) => endpoint.is_ready() && !old.is_ready(),
        };
        if better {
            by_address.insert(key, endpoint);
        }
    }
    by_address.into_values().collect()
}

// The tests convert through `state::proxy_state`, which uses this file: in a file of their
// own, not inline, so that the files form no circle.
#[cfg(test)]
mod tests;
