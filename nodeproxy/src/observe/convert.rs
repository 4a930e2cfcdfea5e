//! Kubernetes objects → [`ProxyState`]: pure conversion, no I/O.
//!
//! One IP family at a time, as kube-proxy's proxier per family sees the cluster: a Service
//! has rules in a family only with a cluster IP of it, and brings along only its external
//! IPs, LB ingress IPs and source ranges of that family (the [`ProxyState`] of the family
//! drops the others); an EndpointSlice counts only in the family of its `addressType`.
//! Values of the other family are the other proxier's, not errors.
//!
//! Bad values (an unparsable CIDR, a port out of range) never abort the conversion: the
//! offending value is left out and reported as a [`Skipped`] entry, so one bad Service
//! never breaks the rules of the others.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, Service, ServicePort as K8sServicePort};
use k8s_openapi::api::discovery::v1::{EndpointHints, EndpointSlice};
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tandem_common::{IpFamily, Protocol};
use tandem_proxy_rules::model::{
    Endpoint, Hints, IpMode, LoadBalancerIngress, ProxyState, ServicePort, ServicePortName,
};

/// Label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Services (and their EndpointSlices) carrying this label belong to another proxy.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// Set by the EndpointSlice controller on the slices of headless Services.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";

/// The label selector of the Service watch, as kube-proxy's: no Service another proxy
/// owns, no headless one. A label added to a live Service makes the API server send a
/// DELETED event for it, a label removed an ADDED one.
pub fn service_selector() -> String {
    format!("!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}")
}

/// The label selector of the EndpointSlice watch: slices of Services we proxy.
pub fn slice_selector() -> String {
    format!("{},{SERVICE_NAME_LABEL}", service_selector())
}

/// kube-proxy's default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_TIMEOUT_SECONDS: u32 = 10_800;

/// A value left out of the state, with where it came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Skipped {
    #[error("Service {service}: {field} value {value:?} ignored: {reason}")]
    ServiceValue {
        service: String,
        field: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("EndpointSlice {slice}: {field} value {value:?} ignored: {reason}")]
    SliceValue {
        slice: String,
        field: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("ServiceCIDR {service_cidr}: spec.cidrs value {value:?} ignored: not a CIDR")]
    ServiceCidrValue { service_cidr: String, value: String },
}

/// The converted state plus everything that was left out of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conversion {
    pub state: ProxyState,
    pub skipped: Vec<Skipped>,
}

/// What the node proxy keeps of one Service: its ports, converted, and the values left
/// out of them. Kept instead of the object itself, which is several times larger.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceEntry {
    pub ports: Vec<ServicePort>,
    pub skipped: Vec<Skipped>,
}

impl ServiceEntry {
    /// The Service as the proxier of `family` sees it (its external IPs and source ranges
    /// of every family: the state of `family` keeps its own).
    pub fn of(service: &Service, family: IpFamily) -> Self {
        let mut skipped = Vec::new();
        let ports = service_ports(service, family, &mut skipped);
        Self { ports, skipped }
    }
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

/// Build the view of the cluster of the proxier of `family` from the Services and
/// EndpointSlices it sees.
pub fn proxy_state<'a>(
    services: impl IntoIterator<Item = &'a Service>,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    family: IpFamily,
) -> Conversion {
    let services: Vec<ServiceEntry> = services
        .into_iter()
        .map(|service| ServiceEntry::of(service, family))
        .collect();
    let slices: Vec<SliceEntry> = slices
        .into_iter()
        .map(|slice| SliceEntry::of(slice, family))
        .collect();
    join(&services, &slices, family)
}

/// The state of `family` of all converted Services and EndpointSlices: each Service port
/// with the endpoints its Service's slices give it.
pub fn join<'a>(
    services: impl IntoIterator<Item = &'a ServiceEntry>,
    slices: impl IntoIterator<Item = &'a SliceEntry>,
    family: IpFamily,
) -> Conversion {
    let mut slices_of: HashMap<&ObjectKey, Vec<&SliceEntry>> = HashMap::new();
    let mut slices_skipped = Vec::new();
    for slice in slices {
        slices_skipped.extend(slice.skipped.iter().cloned());
        if let Some(service) = &slice.service {
            slices_of.entry(service).or_default().push(slice);
        }
    }
    let mut out = Conversion {
        state: ProxyState::new(family),
        skipped: Vec::new(),
    };
    for service in services {
        out.skipped.extend(service.skipped.iter().cloned());
        for port in &service.ports {
            let key = (port.name.namespace.clone(), port.name.name.clone());
            let endpoints = port_endpoints(
                &port.name,
                slices_of.get(&key).into_iter().flatten().copied(),
            );
            out.state.insert_endpoints(port.name.clone(), endpoints);
            out.state.insert_service(port.clone());
        }
    }
    out.skipped.extend(slices_skipped);
    out
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

/// The label that names a node's zone, which endpoint zone hints are matched against.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Every CIDR of every ServiceCIDR object, of both families (each proxier keeps its own,
/// [`tandem_proxy_rules::model::service_cidrs_of`]), whatever the object's status, as
/// kube-proxy's ServiceCIDR handler passes them on; plus the values that are not CIDRs
/// (the API server validates them, so only a server that does not would send one).
pub fn service_cidrs<'a>(
    objects: impl IntoIterator<Item = &'a ServiceCIDR>,
) -> (Vec<IpNet>, Vec<Skipped>) {
    let mut cidrs = Vec::new();
    let mut skipped = Vec::new();
    for object in objects {
        let values = object
            .spec
            .iter()
            .flat_map(|spec| spec.cidrs.iter().flatten());
        for value in values {
            match value.parse::<IpNet>() {
                Ok(cidr) => cidrs.push(cidr),
                Err(_) => skipped.push(Skipped::ServiceCidrValue {
                    service_cidr: object.metadata.name.clone().unwrap_or_default(),
                    value: value.clone(),
                }),
            }
        }
    }
    (cidrs, skipped)
}

/// The node's zone: its `topology.kubernetes.io/zone` label, `None` without one. Read at
/// every sync (a change re-chooses the endpoints of hinted Service ports), as kube-proxy
/// follows the label through its Node topology handler.
pub fn node_zone(node: &Node) -> Option<String> {
    node.metadata.labels.as_ref()?.get(ZONE_LABEL).cloned()
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

/// `(namespace, name)` of a watched object.
pub type ObjectKey = (String, String);

/// The [`ObjectKey`] of an object from its metadata.
pub(crate) fn object_key(meta: &ObjectMeta) -> ObjectKey {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// The Service ports of one Service in `family` (none for headless and ExternalName
/// Services, and none without a cluster IP of that family).
fn service_ports(
    service: &Service,
    family: IpFamily,
    skipped: &mut Vec<Skipped>,
) -> Vec<ServicePort> {
    let (namespace, name) = object_key(&service.metadata);
    let id = format!("{namespace}/{name}");
    let Some(spec) = service.spec.as_ref() else {
        return Vec::new();
    };
    let service_type = spec.type_.as_deref().unwrap_or("ClusterIP");
    if service_type == "ExternalName" {
        return Vec::new();
    }
    let mut skip = |field: &'static str, value: &str, reason: &'static str| {
        skipped.push(Skipped::ServiceValue {
            service: id.clone(),
            field,
            value: value.to_owned(),
            reason,
        });
    };

    let Some(cluster_ip) = cluster_ip_of(
        family,
        spec.cluster_ip.as_deref(),
        spec.cluster_ips.as_deref(),
    ) else {
        // Headless, not yet allocated, or of the other family only: this proxier writes
        // nothing for it.
        if let Some(value) = spec.cluster_ip.as_deref()
            && !value.is_empty()
            && value != "None"
            && value.parse::<IpAddr>().is_err()
        {
            skip("spec.clusterIP", value, "not an IP address");
        }
        return Vec::new();
    };

    let is_node_port = matches!(service_type, "NodePort" | "LoadBalancer");
    let is_load_balancer = service_type == "LoadBalancer";

    let external_ips = spec
        .external_ips
        .iter()
        .flatten()
        .filter_map(|value| match value.trim().parse::<IpAddr>() {
            Ok(ip) => Some(ip),
            Err(_) => {
                skip("spec.externalIPs", value, "not an IP address");
                None
            }
        })
        .collect::<Vec<_>>();

    let load_balancer_ingress = if is_load_balancer {
        service
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|ingress| {
                // Hostname-only ingress entries have nothing for iptables to match.
                let value = ingress.ip.as_deref()?;
                let ip = match value.trim().parse::<IpAddr>() {
                    Ok(ip) if family.holds(ip) => ip,
                    // The other proxier's, and so is a bad ipMode of it to report.
                    Ok(_) => return None,
                    Err(_) => {
                        skip("status.loadBalancer.ingress.ip", value, "not an IP address");
                        return None;
                    }
                };
                let ip_mode = match ingress.ip_mode.as_deref() {
                    Some("Proxy") => IpMode::Proxy,
                    None | Some("VIP") => IpMode::Vip,
                    Some(other) => {
                        skip(
                            "status.loadBalancer.ingress.ipMode",
                            other,
                            "unknown mode, using VIP",
                        );
                        IpMode::Vip
                    }
                };
                Some(LoadBalancerIngress { ip, ip_mode })
            })
            .collect()
    } else {
        Vec::new()
    };

    let load_balancer_source_ranges = if is_load_balancer {
        spec.load_balancer_source_ranges
            .iter()
            .flatten()
            .filter_map(|value| match value.trim().parse::<IpNet>() {
                Ok(net) => Some(net),
                Err(_) => {
                    skip("spec.loadBalancerSourceRanges", value, "not a CIDR");
                    None
                }
            })
            .collect()
    } else {
        Vec::new()
    };

    let session_affinity_timeout = match spec.session_affinity.as_deref() {
        Some("ClientIP") => {
            let configured = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            Some(match configured {
                None => DEFAULT_AFFINITY_TIMEOUT_SECONDS,
                Some(seconds) => match u32::try_from(seconds) {
                    Ok(seconds) if seconds > 0 => seconds,
                    _ => {
                        skip(
                            "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                            &seconds.to_string(),
                            "not a positive number, using the default",
                        );
                        DEFAULT_AFFINITY_TIMEOUT_SECONDS
                    }
                },
            })
        }
        _ => None,
    };

    let external_traffic_policy_local =
        is_node_port && spec.external_traffic_policy.as_deref() == Some("Local");
    let health_check_node_port = if external_traffic_policy_local && is_load_balancer {
        match spec.health_check_node_port.map(u16::try_from) {
            None => None,
            Some(Ok(port)) if port > 0 => Some(port),
            Some(_) => {
                skip(
                    "spec.healthCheckNodePort",
                    &format!("{:?}", spec.health_check_node_port),
                    "not a port number",
                );
                None
            }
        }
    } else {
        None
    };

    // Applies to every Service with a cluster IP, whatever its type (KEP-2086).
    let internal_traffic_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");

    let mut ports = Vec::new();
    for port in spec.ports.iter().flatten() {
        let port_name = port.name.clone().unwrap_or_default();
        let Some(protocol) = parse_protocol(port.protocol.as_deref()) else {
            skip(
                "spec.ports.protocol",
                port.protocol.as_deref().unwrap_or_default(),
                "unknown protocol",
            );
            continue;
        };
        let Some(service_port) = positive_port(port.port) else {
            skip(
                "spec.ports.port",
                &port.port.to_string(),
                "not a port number",
            );
            continue;
        };
        let node_port = node_port(port, is_node_port, &mut skip);
        ports.push(ServicePort {
            name: ServicePortName {
                namespace: namespace.clone(),
                name: name.clone(),
                port: port_name,
            },
            protocol,
            cluster_ip: Some(cluster_ip),
            port: service_port,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ingress: load_balancer_ingress.clone(),
            load_balancer_source_ranges: load_balancer_source_ranges.clone(),
            session_affinity_timeout,
            external_traffic_policy_local,
            health_check_node_port,
            internal_traffic_policy_local,
        });
    }
    ports
}

fn node_port(
    port: &K8sServicePort,
    is_node_port: bool,
    skip: &mut impl FnMut(&'static str, &str, &'static str),
) -> Option<u16> {
    if !is_node_port {
        return None;
    }
    let value = port.node_port?;
    let parsed = positive_port(value);
    if parsed.is_none() {
        skip(
            "spec.ports.nodePort",
            &value.to_string(),
            "not a port number",
        );
    }
    parsed
}

/// The Service's cluster IP of `family`: `clusterIP` when it is of that family, else the
/// entry of that family in `clusterIPs` (the secondary family of a dual-stack Service).
fn cluster_ip_of(
    family: IpFamily,
    cluster_ip: Option<&str>,
    cluster_ips: Option<&[String]>,
) -> Option<IpAddr> {
    cluster_ip
        .into_iter()
        .chain(cluster_ips.into_iter().flatten().map(String::as_str))
        .filter_map(|value| value.trim().parse::<IpAddr>().ok())
        .find(|ip| family.holds(*ip))
}

fn parse_protocol(value: Option<&str>) -> Option<Protocol> {
    match value {
        None | Some("TCP") => Some(Protocol::Tcp),
        Some("UDP") => Some(Protocol::Udp),
        Some("SCTP") => Some(Protocol::Sctp),
        Some(_) => None,
    }
}

fn positive_port(value: i32) -> Option<u16> {
    u16::try_from(value).ok().filter(|port| *port > 0)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use k8s_openapi::api::core::v1::{
        ClientIPConfig, LoadBalancerIngress as K8sIngress, LoadBalancerStatus, NodeSpec,
        ServiceSpec, ServiceStatus, SessionAffinityConfig,
    };
    use k8s_openapi::api::discovery::v1::{
        Endpoint as K8sEndpoint, EndpointConditions, EndpointPort,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn meta(namespace: &str, name: &str) -> ObjectMeta {
        ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            ..Default::default()
        }
    }

    fn port(
        name: Option<&str>,
        protocol: &str,
        port: i32,
        node_port: Option<i32>,
    ) -> K8sServicePort {
        K8sServicePort {
            name: name.map(Into::into),
            protocol: Some(protocol.into()),
            port,
            node_port,
            ..Default::default()
        }
    }

    /// The Service of the kube-proxy reference dump (`nodeproxy/rules/tests/data/`).
    fn nginx() -> Service {
        Service {
            metadata: meta("default", "nginx-service"),
            spec: Some(ServiceSpec {
                type_: Some("LoadBalancer".into()),
                cluster_ip: Some("10.43.35.197".into()),
                cluster_ips: Some(vec!["10.43.35.197".into()]),
                ports: Some(vec![port(Some("http"), "TCP", 80, Some(30166))]),
                load_balancer_source_ranges: Some(vec!["203.0.113.0/24".into()]),
                external_traffic_policy: Some("Cluster".into()),
                session_affinity: Some("None".into()),
                ..Default::default()
            }),
            status: Some(ServiceStatus {
                load_balancer: Some(LoadBalancerStatus {
                    ingress: Some(vec![K8sIngress {
                        ip: Some("198.51.100.20".into()),
                        ..Default::default()
                    }]),
                }),
                ..Default::default()
            }),
        }
    }

    fn endpoint(
        ip: &str,
        node: &str,
        ready: Option<bool>,
        terminating: Option<bool>,
    ) -> K8sEndpoint {
        K8sEndpoint {
            addresses: vec![ip.into()],
            conditions: Some(EndpointConditions {
                ready,
                serving: ready,
                terminating,
            }),
            node_name: Some(node.into()),
            ..Default::default()
        }
    }

    fn slice(
        name: &str,
        service: &str,
        ports: &[(Option<&str>, i32)],
        endpoints: Vec<K8sEndpoint>,
    ) -> EndpointSlice {
        let mut metadata = meta("default", name);
        metadata.labels = Some([(SERVICE_NAME_LABEL.to_owned(), service.to_owned())].into());
        EndpointSlice {
            metadata,
            address_type: "IPv4".into(),
            endpoints,
            ports: Some(
                ports
                    .iter()
                    .map(|(name, port)| EndpointPort {
                        name: name.map(Into::into),
                        port: Some(*port),
                        protocol: Some("TCP".into()),
                        ..Default::default()
                    })
                    .collect(),
            ),
        }
    }

    fn spn(name: &str, port: &str) -> ServicePortName {
        ServicePortName {
            namespace: "default".into(),
            name: name.into(),
            port: port.into(),
        }
    }

    #[test]
    fn reference_service_converts_to_the_reference_state() {
        let services = [nginx()];
        let slices = [slice(
            "nginx-abc",
            "nginx-service",
            &[(Some("http"), 80)],
            vec![
                endpoint("10.244.1.5", "node-a", Some(true), None),
                endpoint("10.244.2.7", "node-b", None, None),
            ],
        )];
        let out = proxy_state(&services, &slices, IpFamily::V4);
        assert_eq!(out.skipped, vec![]);
        let name = spn("nginx-service", "http");
        let port = &out.state.services()[&name];
        assert_eq!(port.protocol, Protocol::Tcp);
        assert_eq!(port.cluster_ip, Some(Ipv4Addr::new(10, 43, 35, 197).into()));
        assert_eq!(port.port, 80);
        assert_eq!(port.node_port, Some(30166));
        assert_eq!(
            port.load_balancer_ingress,
            vec![LoadBalancerIngress {
                ip: Ipv4Addr::new(198, 51, 100, 20).into(),
                ip_mode: IpMode::Vip
            }]
        );
        assert_eq!(
            port.load_balancer_source_ranges,
            vec!["203.0.113.0/24".parse::<IpNet>().unwrap()]
        );
        assert_eq!(port.session_affinity_timeout, None);
        assert!(!port.external_traffic_policy_local);
        let endpoints = &out.state.endpoints()[&name];
        assert_eq!(endpoints.len(), 2);
        assert!(
            endpoints
                .iter()
                .all(|e| e.ready && !e.terminating && e.port == 80)
        );
        assert_eq!(endpoints[0].node_name.as_deref(), Some("node-a"));
    }

    #[test]
    fn bad_values_are_skipped_and_reported_without_losing_the_rest() {
        let mut service = nginx();
        let spec = service.spec.as_mut().unwrap();
        spec.load_balancer_source_ranges = Some(vec![
            "nonsense".into(),
            "203.0.113.9/24".into(),
            "2001:db8::/32".into(),
        ]);
        spec.external_ips = Some(vec!["1.2.3.4".into(), "1.2.3".into()]);
        spec.ports = Some(vec![
            port(Some("http"), "TCP", 80, Some(30166)),
            port(Some("bad"), "ICMP", 81, None),
            port(Some("huge"), "TCP", 70000, None),
        ]);
        let out = proxy_state([&service], [], IpFamily::V4);
        assert_eq!(out.state.services().len(), 1);
        let port = &out.state.services()[&spn("nginx-service", "http")];
        // Host bits are cleared, as the kernel would store the range.
        assert_eq!(
            port.load_balancer_source_ranges,
            vec!["203.0.113.0/24".parse::<IpNet>().unwrap()]
        );
        assert_eq!(port.external_ips, vec![IpAddr::from([1, 2, 3, 4])]);
        let fields: Vec<_> = out
            .skipped
            .iter()
            .map(|s| match s {
                Skipped::ServiceValue { field, .. } => *field,
                Skipped::SliceValue { field, .. } => *field,
                Skipped::ServiceCidrValue { .. } => "spec.cidrs",
            })
            .collect();
        // The IPv6 range is the IPv6 proxier's, not an error.
        assert_eq!(
            fields,
            vec![
                "spec.externalIPs",
                "spec.loadBalancerSourceRanges",
                "spec.ports.protocol",
                "spec.ports.port"
            ]
        );
    }

    /// The dual-stack reference Service (`nodeproxy/rules/tests/data/`), as each family's
    /// proxier sees it: its cluster IP, ingress IP, source range, external IP and
    /// EndpointSlice of that family only, and nothing reported as skipped.
    #[test]
    fn each_family_sees_its_own_half_of_a_dual_stack_service() {
        let mut service = nginx();
        let spec = service.spec.as_mut().unwrap();
        spec.ip_families = Some(vec!["IPv4".into(), "IPv6".into()]);
        spec.cluster_ips = Some(vec!["10.43.35.197".into(), "fd00:10:96::197".into()]);
        spec.load_balancer_source_ranges =
            Some(vec!["203.0.113.0/24".into(), "2001:db8:203::/64".into()]);
        spec.external_ips = Some(vec!["2001:db8:1::1".into(), "192.0.2.1".into()]);
        let status = service.status.as_mut().unwrap();
        status.load_balancer.as_mut().unwrap().ingress = Some(
            ["198.51.100.20", "2001:db8:51:100::20"]
                .map(|ip| K8sIngress {
                    ip: Some(ip.into()),
                    ..Default::default()
                })
                .to_vec(),
        );
        let v4_slice = slice(
            "nginx-v4",
            "nginx-service",
            &[(Some("http"), 80)],
            vec![endpoint("10.244.1.5", "node-a", Some(true), None)],
        );
        let mut v6_slice = slice(
            "nginx-v6",
            "nginx-service",
            &[(Some("http"), 80)],
            vec![endpoint("fd00:10:244:1::5", "node-a", Some(true), None)],
        );
        v6_slice.address_type = "IPv6".into();
        let name = spn("nginx-service", "http");
        for (family, cluster_ip, ingress, range, external, endpoint) in [
            (
                IpFamily::V4,
                "10.43.35.197",
                "198.51.100.20",
                "203.0.113.0/24",
                "192.0.2.1",
                "10.244.1.5",
            ),
            (
                IpFamily::V6,
                "fd00:10:96::197",
                "2001:db8:51:100::20",
                "2001:db8:203::/64",
                "2001:db8:1::1",
                "fd00:10:244:1::5",
            ),
        ] {
            let out = proxy_state([&service], [&v4_slice, &v6_slice], family);
            assert!(out.skipped.is_empty(), "{family}: {:?}", out.skipped);
            let port = &out.state.services()[&name];
            assert_eq!(
                port.cluster_ip,
                Some(cluster_ip.parse().unwrap()),
                "{family}"
            );
            let ingress_ips: Vec<IpAddr> =
                port.load_balancer_ingress.iter().map(|i| i.ip).collect();
            assert_eq!(
                ingress_ips,
                [ingress.parse::<IpAddr>().unwrap()],
                "{family}"
            );
            assert_eq!(
                port.load_balancer_source_ranges,
                [range.parse::<IpNet>().unwrap()],
                "{family}"
            );
            assert_eq!(port.external_ips, [external.parse::<IpAddr>().unwrap()]);
            let endpoints: Vec<IpAddr> =
                out.state.endpoints()[&name].iter().map(|e| e.ip).collect();
            assert_eq!(endpoints, [endpoint.parse::<IpAddr>().unwrap()], "{family}");
        }
        // An IPv4-only Service has no IPv6 rules at all.
        let out = proxy_state([&nginx()], [&v4_slice], IpFamily::V6);
        assert!(out.state.services().is_empty() && out.skipped.is_empty());
    }

    #[test]
    fn headless_external_name_and_ipv6_services_get_no_ports() {
        let mut headless = nginx();
        headless.spec.as_mut().unwrap().cluster_ip = Some("None".into());
        headless.spec.as_mut().unwrap().cluster_ips = Some(vec!["None".into()]);
        let mut v6 = nginx();
        v6.metadata.name = Some("v6".into());
        v6.spec.as_mut().unwrap().cluster_ip = Some("fd00::1".into());
        v6.spec.as_mut().unwrap().cluster_ips = Some(vec!["fd00::1".into()]);
        let mut external = nginx();
        external.metadata.name = Some("ext".into());
        external.spec.as_mut().unwrap().type_ = Some("ExternalName".into());
        let out = proxy_state([&headless, &v6, &external], [], IpFamily::V4);
        assert!(out.state.services().is_empty());
        assert!(out.skipped.is_empty());
    }

    #[test]
    fn dual_stack_with_ipv6_primary_uses_the_ipv4_cluster_ip() {
        let mut service = nginx();
        service.spec.as_mut().unwrap().cluster_ip = Some("fd00::1".into());
        service.spec.as_mut().unwrap().cluster_ips =
            Some(vec!["fd00::1".into(), "10.43.0.9".into()]);
        let out = proxy_state([&service], [], IpFamily::V4);
        assert_eq!(
            out.state.services()[&spn("nginx-service", "http")].cluster_ip,
            Some(IpAddr::from([10, 43, 0, 9]))
        );
    }

    #[test]
    fn session_affinity_timeout_defaults_and_is_read() {
        let mut service = nginx();
        service.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into());
        let out = proxy_state([&service], [], IpFamily::V4);
        assert_eq!(
            out.state.services()[&spn("nginx-service", "http")].session_affinity_timeout,
            Some(10_800)
        );
        service.spec.as_mut().unwrap().session_affinity_config = Some(SessionAffinityConfig {
            client_ip: Some(ClientIPConfig {
                timeout_seconds: Some(60),
            }),
        });
        let out = proxy_state([&service], [], IpFamily::V4);
        assert_eq!(
            out.state.services()[&spn("nginx-service", "http")].session_affinity_timeout,
            Some(60)
        );
    }

    #[test]
    fn local_policy_only_for_node_port_and_load_balancer_services() {
        let mut lb = nginx();
        lb.spec.as_mut().unwrap().external_traffic_policy = Some("Local".into());
        lb.spec.as_mut().unwrap().health_check_node_port = Some(32000);
        let mut cluster_ip = lb.clone();
        cluster_ip.metadata.name = Some("plain".into());
        cluster_ip.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        let out = proxy_state([&lb, &cluster_ip], [], IpFamily::V4);
        let lb_port = &out.state.services()[&spn("nginx-service", "http")];
        assert!(lb_port.external_traffic_policy_local);
        assert_eq!(lb_port.health_check_node_port, Some(32000));
        let plain = &out.state.services()[&spn("plain", "http")];
        assert!(!plain.external_traffic_policy_local);
        assert_eq!(plain.health_check_node_port, None);
        assert_eq!(plain.node_port, None);
        assert!(plain.load_balancer_ingress.is_empty());
        assert!(plain.load_balancer_source_ranges.is_empty());
    }

    #[test]
    fn internal_traffic_policy_local_applies_to_every_type() {
        let mut lb = nginx();
        lb.spec.as_mut().unwrap().internal_traffic_policy = Some("Local".into());
        let mut cluster_ip = lb.clone();
        cluster_ip.metadata.name = Some("plain".into());
        cluster_ip.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        let mut default = nginx();
        default.metadata.name = Some("default".into());
        default.spec.as_mut().unwrap().internal_traffic_policy = Some("Cluster".into());
        let out = proxy_state([&lb, &cluster_ip, &default], [], IpFamily::V4);
        let itp_local =
            |name| out.state.services()[&spn(name, "http")].internal_traffic_policy_local;
        assert!(itp_local("nginx-service"));
        assert!(itp_local("plain"));
        assert!(!itp_local("default"));
        assert!(!out.state.services()[&spn("nginx-service", "http")].external_traffic_policy_local);
    }

    #[test]
    fn proxy_ip_mode_is_read() {
        let mut service = nginx();
        service
            .status
            .as_mut()
            .unwrap()
            .load_balancer
            .as_mut()
            .unwrap()
            .ingress
            .as_mut()
            .unwrap()[0]
            .ip_mode = Some("Proxy".into());
        let out = proxy_state([&service], [], IpFamily::V4);
        assert_eq!(
            out.state.services()[&spn("nginx-service", "http")].load_balancer_ingress[0].ip_mode,
            IpMode::Proxy
        );
    }

    #[test]
    fn endpoints_join_slices_resolve_ports_by_name_and_keep_conditions() {
        let mut service = nginx();
        service.spec.as_mut().unwrap().ports = Some(vec![
            port(Some("http"), "TCP", 80, Some(30166)),
            port(Some("metrics"), "TCP", 9000, Some(30167)),
        ]);
        let slices = [
            slice(
                "a",
                "nginx-service",
                &[(Some("http"), 8080), (Some("metrics"), 9090)],
                vec![endpoint("10.244.1.5", "node-a", Some(true), Some(false))],
            ),
            slice(
                "b",
                "nginx-service",
                &[(Some("metrics"), 9090), (Some("http"), 8080)],
                vec![
                    endpoint("10.244.2.7", "node-b", Some(false), Some(true)),
                    // Also in slice "a", not ready here: the ready copy wins.
                    endpoint("10.244.1.5", "node-a", Some(false), Some(false)),
                ],
            ),
            // A slice of another Service and an unlabelled slice contribute nothing here.
            slice(
                "c",
                "other",
                &[(Some("http"), 1)],
                vec![endpoint("10.244.3.3", "node-c", None, None)],
            ),
        ];
        let mut unlabelled = slices[0].clone();
        unlabelled.metadata.labels = None;
        let out = proxy_state([&service], slices.iter().chain([&unlabelled]), IpFamily::V4);
        let http = &out.state.endpoints()[&spn("nginx-service", "http")];
        assert_eq!(http.len(), 2);
        assert_eq!(
            (http[0].ip, http[0].port, http[0].ready, http[0].terminating),
            (IpAddr::from([10, 244, 1, 5]), 8080, true, false)
        );
        assert_eq!(
            (http[1].ip, http[1].ready, http[1].terminating),
            (IpAddr::from([10, 244, 2, 7]), false, true)
        );
        let metrics = &out.state.endpoints()[&spn("nginx-service", "metrics")];
        assert!(metrics.iter().all(|e| e.port == 9090));
        assert_eq!(out.state.endpoints().len(), 2);
    }

    #[test]
    fn endpoint_hints_and_the_node_zone_are_read_as_sets() {
        use k8s_openapi::api::discovery::v1::{ForNode, ForZone};
        let zone = |name: &str| ForZone { name: name.into() };
        let mut hinted = endpoint("10.244.1.5", "node-a", Some(true), Some(false));
        hinted.hints = Some(EndpointHints {
            for_zones: Some(vec![zone("zone-b"), zone("zone-a"), zone("zone-b")]),
            for_nodes: Some(vec![ForNode {
                name: "node-a".into(),
            }]),
        });
        let mut empty = endpoint("10.244.1.6", "node-a", Some(true), Some(false));
        empty.hints = Some(EndpointHints::default());
        let plain = endpoint("10.244.1.7", "node-a", Some(true), Some(false));
        let slices = [slice(
            "a",
            "nginx-service",
            &[(Some("http"), 8080)],
            vec![hinted, empty, plain],
        )];
        let out = proxy_state([&nginx()], &slices, IpFamily::V4);
        let http = &out.state.endpoints()[&spn("nginx-service", "http")];
        assert_eq!(http[0].zone_hints(), ["zone-a", "zone-b"]);
        assert_eq!(http[0].node_hints(), ["node-a"]);
        // Empty hints are no hints: kube-proxy counts the names.
        assert_eq!(
            (http[1].hints.as_ref(), http[2].hints.as_ref()),
            (None, None)
        );

        let mut node = Node::default();
        assert_eq!(node_zone(&node), None);
        node.metadata.labels = Some([(ZONE_LABEL.to_owned(), "us-east-1a".to_owned())].into());
        assert_eq!(node_zone(&node).as_deref(), Some("us-east-1a"));
    }

    #[test]
    fn a_slice_keeps_its_endpoints_once_and_gives_each_port_its_target() {
        let ports = [(Some("http"), 8080), (Some("metrics"), 9090)];
        let two = slice(
            "a",
            "nginx-service",
            &ports,
            vec![
                endpoint("10.244.1.5", "node-a", None, None),
                endpoint("10.244.2.7", "node-b", None, None),
            ],
        );
        let entry = SliceEntry::of(&two, IpFamily::V4);
        assert_eq!(entry.endpoints.len(), 2);
        let served: Vec<&str> = entry.served_ports().map(|n| n.port.as_str()).collect();
        assert_eq!(served, ["http", "metrics"]);
        let metrics = port_endpoints(&spn("nginx-service", "metrics"), [&entry]);
        let targets: Vec<(IpAddr, u16)> = metrics.iter().map(|e| (e.ip, e.port)).collect();
        assert_eq!(
            targets,
            [
                (IpAddr::from([10, 244, 1, 5]), 9090),
                (IpAddr::from([10, 244, 2, 7]), 9090)
            ]
        );
        // Without endpoints a slice serves no port: its changes touch nothing.
        let empty = SliceEntry::of(&slice("b", "nginx-service", &ports, vec![]), IpFamily::V4);
        assert_eq!(empty.served_ports().count(), 0);
    }

    #[test]
    fn unnamed_ports_match_unnamed_slice_ports() {
        let mut service = nginx();
        service.spec.as_mut().unwrap().ports = Some(vec![port(None, "UDP", 53, None)]);
        let mut s = slice(
            "a",
            "nginx-service",
            &[(None, 5353)],
            vec![endpoint("10.244.1.5", "node-a", None, None)],
        );
        s.endpoints.push(K8sEndpoint {
            addresses: vec!["junk".into()],
            ..Default::default()
        });
        let out = proxy_state([&service], [&s], IpFamily::V4);
        let name = spn("nginx-service", "");
        assert_eq!(out.state.services()[&name].protocol, Protocol::Udp);
        assert_eq!(out.state.endpoints()[&name][0].port, 5353);
        assert_eq!(out.skipped.len(), 1);
    }

    #[test]
    fn node_addresses_are_the_internal_and_external_ones_and_each_family_has_its_primary() {
        use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};
        let address = |type_: &str, address: &str| NodeAddress {
            type_: type_.into(),
            address: address.into(),
        };
        let node = Node {
            status: Some(NodeStatus {
                addresses: Some(vec![
                    address("InternalIP", "198.18.0.11"),
                    address("Hostname", "node-a"),
                    address("ExternalIP", "203.0.113.50"),
                    address("InternalIP", "fd00::11"),
                ]),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            node_addresses(&node),
            ["198.18.0.11", "203.0.113.50", "fd00::11"].map(|ip| ip.parse::<IpAddr>().unwrap())
        );
        assert_eq!(
            node_primary_ip(&node, IpFamily::V4),
            Some(IpAddr::from([198, 18, 0, 11]))
        );
        assert_eq!(
            node_primary_ip(&node, IpFamily::V6),
            Some("fd00::11".parse().unwrap())
        );
        let external_only = Node {
            status: Some(NodeStatus {
                addresses: Some(vec![
                    address("InternalIP", "fd00::11"),
                    address("ExternalIP", "203.0.113.50"),
                ]),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            node_primary_ip(&external_only, IpFamily::V4),
            Some(IpAddr::from([203, 0, 113, 50]))
        );
        assert_eq!(node_primary_ip(&Node::default(), IpFamily::V4), None);
    }

    #[test]
    fn the_pod_cidr_of_each_family_is_the_first_of_spec_pod_cidrs() {
        let node = |cidrs: &[&str], single: Option<&str>| Node {
            spec: Some(NodeSpec {
                pod_cidrs: Some(cidrs.iter().map(|c| (*c).to_owned()).collect()),
                pod_cidr: single.map(str::to_owned),
                ..Default::default()
            }),
            ..Default::default()
        };
        let dual = node(&["10.244.3.0/24", "bogus", "fd00:10:244:3::1/64"], None);
        assert_eq!(
            NodeFacts::of(&dual, IpFamily::V4).pod_cidr,
            Some("10.244.3.0/24".parse().unwrap())
        );
        // Truncated to the network, as the rules write it.
        assert_eq!(
            node_pod_cidr(&dual, IpFamily::V6),
            Some("fd00:10:244:3::/64".parse().unwrap())
        );
        // The single spec.podCIDR of older clusters, and none of a family.
        let old = node(&[], Some("10.244.4.0/24"));
        assert_eq!(
            node_pod_cidr(&old, IpFamily::V4),
            Some("10.244.4.0/24".parse().unwrap())
        );
        assert_eq!(node_pod_cidr(&old, IpFamily::V6), None);
        assert_eq!(node_pod_cidr(&Node::default(), IpFamily::V4), None);
    }

    #[test]
    fn service_cidrs_of_every_object_whatever_its_status_and_bad_values_reported() {
        let object = |name: &str, cidrs: serde_json::Value, status: serde_json::Value| {
            serde_json::from_value::<ServiceCIDR>(serde_json::json!({
                "metadata": {"name": name},
                "spec": {"cidrs": cidrs},
                "status": status,
            }))
            .unwrap()
        };
        let objects = [
            object(
                "kubernetes",
                serde_json::json!(["10.96.0.0/16", "fd00:96::/112"]),
                serde_json::json!({"conditions": [{"type": "Ready", "status": "True",
                    "reason": "", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
            ),
            // Not Ready (overlapping), or being deleted: kube-proxy still counts it.
            object(
                "extra",
                serde_json::json!(["10.97.0.0/16", "bogus"]),
                serde_json::json!({}),
            ),
        ];
        let (cidrs, skipped) = service_cidrs(&objects);
        let expected: Vec<IpNet> = ["10.96.0.0/16", "fd00:96::/112", "10.97.0.0/16"]
            .iter()
            .map(|c| c.parse().unwrap())
            .collect();
        assert_eq!(cidrs, expected);
        assert_eq!(
            skipped,
            [Skipped::ServiceCidrValue {
                service_cidr: "extra".into(),
                value: "bogus".into()
            }]
        );
    }
}
