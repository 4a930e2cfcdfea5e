//! The cluster one scale stands for, as the API objects the node proxy watches (pure).
//!
//! Addresses: cluster IPs from 10.96.0.0/16 (the design's range), node ports from the
//! default range, LB ingress IPs from 198.19.0.0/16 and endpoints from 10.128.0.0/9.
//! The last two leave the design's address plan (a /24 VIP pool and /24 pod ranges) because
//! 2,700 VIPs and 100,000 endpoints do not fit in it; these rules only sit in the
//! namespace's tables, no packet is ever sent to them.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use k8s_openapi::api::core::v1::{
    LoadBalancerIngress, LoadBalancerStatus, Node, NodeAddress, NodeStatus, Service, ServicePort,
    ServiceSpec, ServiceStatus,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tandem_nodeproxy::convert::SERVICE_NAME_LABEL;
use tandem_proxy_rules::model::NodeConfig;

/// The Kubernetes namespace every generated object lives in.
pub const NAMESPACE: &str = "bench";
/// The node the node proxy runs as.
pub const NODE_NAME: &str = "bench-node";
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const PORT_NAME: &str = "http";
const SERVICE_PORT: i32 = 80;
pub const TARGET_PORT: i32 = 8080;
/// The default node port range, 30000-32767.
const FIRST_NODE_PORT: i32 = 30_000;
pub const NODE_PORTS: usize = 2_768;
const CLUSTER_IPS: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 96, 0, 0), 16);
const INGRESS_IPS: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(198, 19, 0, 0), 16);
/// Endpoints of the generated Services; also the cluster CIDR the node proxy is given.
const POD_IPS: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 128, 0, 0), 9);
/// Endpoints the incremental rounds add, outside every generated one.
const ADDED_IPS: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 127, 0, 0), 16);
/// A source range on every LoadBalancer Service, as in the kube-proxy reference dump in
/// `nodeproxy/rules/tests/data/` (KUBE-FW rules).
const SOURCE_RANGE: &str = "203.0.113.0/24";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServiceKind {
    LoadBalancer,
    ClusterIp,
}

/// How many Services of which kind, with how many endpoints each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scale {
    pub kind: ServiceKind,
    pub services: usize,
    pub endpoints: usize,
}

impl Scale {
    /// `2,700 LoadBalancer × 10`.
    pub fn label(&self) -> String {
        let kind = match self.kind {
            ServiceKind::LoadBalancer => "LoadBalancer",
            ServiceKind::ClusterIp => "ClusterIP",
        };
        format!(
            "{} {kind} × {}",
            thousands(self.services),
            thousands(self.endpoints)
        )
    }
}

/// `2700` → `2,700`.
pub fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScaleError {
    #[error(
        "{0} LoadBalancer Services need more node ports than the default range holds ({NODE_PORTS})"
    )]
    NodePorts(usize),
    #[error("{0} Services do not fit in the cluster IP range {CLUSTER_IPS}")]
    ClusterIps(usize),
    #[error("{0} endpoints do not fit in {POD_IPS}")]
    Endpoints(usize),
}

/// The Services (allocated and, for LoadBalancers, with an ingress IP) and one
/// EndpointSlice per Service, in the same order.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
}

/// The `n`-th address of `net` after its network address.
fn nth(net: Ipv4Net, n: usize) -> Ipv4Addr {
    let offset = u32::try_from(n).unwrap_or(u32::MAX);
    Ipv4Addr::from(u32::from(net.network()).saturating_add(offset))
}

/// Usable host addresses of `net` after the network address (the broadcast one excluded).
fn capacity(net: Ipv4Net) -> usize {
    net.hosts().count()
}

pub fn generate(scale: Scale) -> Result<Cluster, ScaleError> {
    if scale.kind == ServiceKind::LoadBalancer && scale.services > NODE_PORTS {
        return Err(ScaleError::NodePorts(scale.services));
    }
    if scale.services >= capacity(CLUSTER_IPS) || scale.services >= capacity(INGRESS_IPS) {
        return Err(ScaleError::ClusterIps(scale.services));
    }
    let total_endpoints = scale.services.saturating_mul(scale.endpoints);
    if total_endpoints >= capacity(POD_IPS) {
        return Err(ScaleError::Endpoints(total_endpoints));
    }
    let services = (0..scale.services)
        .map(|i| service(scale.kind, i))
        .collect();
    let slices = (0..scale.services)
        .map(|i| {
            let endpoints = (0..scale.endpoints)
                .map(|e| endpoint(nth(POD_IPS, i * scale.endpoints + e + 1)))
                .collect();
            slice(i, endpoints)
        })
        .collect();
    Ok(Cluster { services, slices })
}

fn service_name(index: usize) -> String {
    format!("svc-{index}")
}

fn service(kind: ServiceKind, index: usize) -> Service {
    let load_balancer = kind == ServiceKind::LoadBalancer;
    let node_port = i32::try_from(index)
        .ok()
        .and_then(|i| i.checked_add(FIRST_NODE_PORT));
    Service {
        metadata: ObjectMeta {
            namespace: Some(NAMESPACE.into()),
            name: Some(service_name(index)),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            type_: Some(
                if load_balancer {
                    "LoadBalancer"
                } else {
                    "ClusterIP"
                }
                .into(),
            ),
            cluster_ip: Some(nth(CLUSTER_IPS, index + 1).to_string()),
            ports: Some(vec![ServicePort {
                name: Some(PORT_NAME.into()),
                protocol: Some("TCP".into()),
                port: SERVICE_PORT,
                target_port: Some(IntOrString::Int(TARGET_PORT)),
                node_port: node_port.filter(|_| load_balancer),
                ..ServicePort::default()
            }]),
            selector: Some(BTreeMap::from([("app".into(), service_name(index))])),
            load_balancer_source_ranges: load_balancer.then(|| vec![SOURCE_RANGE.into()]),
            external_traffic_policy: load_balancer.then(|| "Cluster".into()),
            ..ServiceSpec::default()
        }),
        status: load_balancer.then(|| ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(vec![LoadBalancerIngress {
                    ip: Some(nth(INGRESS_IPS, index + 1).to_string()),
                    ip_mode: Some("VIP".into()),
                    ..LoadBalancerIngress::default()
                }]),
            }),
            ..ServiceStatus::default()
        }),
    }
}

fn endpoint(ip: Ipv4Addr) -> Endpoint {
    Endpoint {
        addresses: vec![ip.to_string()],
        conditions: Some(EndpointConditions {
            ready: Some(true),
            serving: Some(true),
            terminating: Some(false),
        }),
        node_name: Some(NODE_NAME.into()),
        ..Endpoint::default()
    }
}

fn slice(index: usize, endpoints: Vec<Endpoint>) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            namespace: Some(NAMESPACE.into()),
            name: Some(format!("{}-slice", service_name(index))),
            labels: Some(BTreeMap::from([(
                SERVICE_NAME_LABEL.into(),
                service_name(index),
            )])),
            ..ObjectMeta::default()
        },
        address_type: "IPv4".into(),
        endpoints,
        ports: Some(vec![EndpointPort {
            name: Some(PORT_NAME.into()),
            port: Some(TARGET_PORT),
            protocol: Some("TCP".into()),
            ..EndpointPort::default()
        }]),
    }
}

impl Cluster {
    /// The Service an incremental round changes: spread over the cluster, never the same
    /// one twice in a row.
    pub fn changed_service(&self, round: usize) -> usize {
        // A prime step visits every index before repeating when it does not divide the count.
        round.wrapping_mul(7_919) % self.slices.len().max(1)
    }

    /// Adds endpoint number `round` of the extra range to the slice at `index`.
    pub fn add_endpoint(&mut self, index: usize, round: usize) {
        if let Some(slice) = self.slices.get_mut(index) {
            slice.endpoints.push(endpoint(nth(ADDED_IPS, round + 1)));
        }
    }

    /// Removes the last endpoint of the slice at `index` (the one `add_endpoint` added).
    pub fn remove_last_endpoint(&mut self, index: usize) {
        if let Some(slice) = self.slices.get_mut(index) {
            slice.endpoints.pop();
        }
    }
}

/// The Node object of [`NODE_NAME`].
pub fn node() -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(NODE_NAME.into()),
            ..ObjectMeta::default()
        },
        status: Some(NodeStatus {
            addresses: Some(vec![NodeAddress {
                type_: "InternalIP".into(),
                address: NODE_IP.to_string(),
            }]),
            ..NodeStatus::default()
        }),
        ..Node::default()
    }
}

/// What the node proxy is told about its node.
pub fn node_config() -> NodeConfig {
    NodeConfig::new(NODE_NAME, Some(POD_IPS.into()))
}

/// `--cluster-cidr` for the node proxy binary.
pub fn cluster_cidr() -> Ipv4Net {
    POD_IPS
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_nodeproxy::convert::proxy_state;
    use tandem_proxy_rules::model::IpFamily;

    fn scale(kind: ServiceKind, services: usize, endpoints: usize) -> Scale {
        Scale {
            kind,
            services,
            endpoints,
        }
    }

    #[test]
    fn load_balancers_convert_to_services_with_every_endpoint() {
        let cluster = generate(scale(ServiceKind::LoadBalancer, 30, 4)).unwrap();
        let conversion = proxy_state(&cluster.services, &cluster.slices, IpFamily::V4);
        assert!(conversion.skipped.is_empty(), "{:?}", conversion.skipped);
        assert_eq!(conversion.state.services.len(), 30);
        assert!(conversion.state.endpoints.values().all(|e| e.len() == 4));
        let node_ports: std::collections::BTreeSet<_> = conversion
            .state
            .services
            .values()
            .map(|s| s.node_port.unwrap())
            .collect();
        assert_eq!(node_ports.len(), 30);
        assert!(conversion.state.services.values().all(
            |s| s.load_balancer_ingress.len() == 1 && s.load_balancer_source_ranges.len() == 1
        ));
        let all_endpoints: std::collections::BTreeSet<_> = conversion
            .state
            .endpoints
            .values()
            .flatten()
            .map(|e| e.ip)
            .collect();
        assert_eq!(all_endpoints.len(), 120, "endpoint addresses are distinct");
    }

    #[test]
    fn cluster_ip_services_have_no_node_ports_or_ingress() {
        let cluster = generate(scale(ServiceKind::ClusterIp, 5, 2)).unwrap();
        let state = proxy_state(&cluster.services, &cluster.slices, IpFamily::V4).state;
        assert_eq!(state.services.len(), 5);
        assert!(state.services.values().all(|s| s.node_port.is_none()
            && s.load_balancer_ingress.is_empty()
            && s.cluster_ip.is_some()));
    }

    #[test]
    fn scales_beyond_the_ranges_are_refused() {
        assert_eq!(
            generate(scale(ServiceKind::LoadBalancer, NODE_PORTS + 1, 1)),
            Err(ScaleError::NodePorts(NODE_PORTS + 1))
        );
        assert!(generate(scale(ServiceKind::LoadBalancer, NODE_PORTS, 1)).is_ok());
        assert_eq!(
            generate(scale(ServiceKind::ClusterIp, 70_000, 1)),
            Err(ScaleError::ClusterIps(70_000))
        );
        assert_eq!(
            generate(scale(ServiceKind::ClusterIp, 60_000, 200)),
            Err(ScaleError::Endpoints(12_000_000))
        );
    }

    #[test]
    fn an_added_endpoint_shows_up_and_removing_it_restores_the_state() {
        let original = generate(scale(ServiceKind::LoadBalancer, 10, 3)).unwrap();
        let mut cluster = original.clone();
        let index = cluster.changed_service(3);
        cluster.add_endpoint(index, 3);
        let before = proxy_state(&original.services, &original.slices, IpFamily::V4).state;
        let after = proxy_state(&cluster.services, &cluster.slices, IpFamily::V4).state;
        let changed: Vec<_> = after
            .endpoints
            .iter()
            .filter(|(name, e)| before.endpoints.get(*name) != Some(e))
            .collect();
        assert_eq!(changed.len(), 1);
        assert_eq!(changed[0].1.len(), 4);
        cluster.remove_last_endpoint(index);
        assert_eq!(cluster, original);
    }

    #[test]
    fn consecutive_rounds_change_different_services() {
        let cluster = generate(scale(ServiceKind::ClusterIp, 2_700, 1)).unwrap();
        let picked: std::collections::BTreeSet<_> =
            (0..10).map(|r| cluster.changed_service(r)).collect();
        assert_eq!(picked.len(), 10);
    }

    #[test]
    fn labels_read_like_the_issue() {
        assert_eq!(
            scale(ServiceKind::LoadBalancer, 2_700, 10).label(),
            "2,700 LoadBalancer × 10"
        );
        assert_eq!(
            scale(ServiceKind::ClusterIp, 10_000, 10).label(),
            "10,000 ClusterIP × 10"
        );
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000_000), "1,000,000");
    }
}
