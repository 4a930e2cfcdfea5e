//! The cluster one scale stands for, as the API objects the node proxy watches (pure).
//!
//! Addresses: cluster IPs from 10.96.0.0/16 (the design's range), node ports from the
//! default range, LB ingress IPs from 198.19.0.0/16 and endpoints from 10.128.0.0/9.
//! The last two leave the design's address plan (a /24 VIP pool and /24 pod ranges) because
//! 2,700 VIPs and 100,000 endpoints do not fit in it; these rules only sit in the
//! namespace's tables, no packet is ever sent to them. A dual-stack cluster's Services get
//! an IPv6 address of each kind as well ([`V6`], wider ranges than IPv4's) and a second
//! EndpointSlice each, of IPv6 endpoints.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use k8s_openapi::api::core::v1::{
    LoadBalancerIngress, LoadBalancerStatus, Node, NodeAddress, NodeStatus, Service, ServicePort,
    ServiceSpec, ServiceStatus,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tandem_common::IpFamily;
use tandem_nodeproxy::observe::convert::SERVICE_NAME_LABEL;
use tandem_proxy_rules::model::NodeConfig;

/// The Kubernetes namespace every generated object lives in.
pub const NAMESPACE: &str = "bench";
/// The node the node proxy runs as.
pub const NODE_NAME: &str = "bench-node";
const PORT_NAME: &str = "http";
const SERVICE_PORT: i32 = 80;
pub const TARGET_PORT: i32 = 8080;
/// The default node port range, 30000-32767.
const FIRST_NODE_PORT: i32 = 30_000;
pub const NODE_PORTS: usize = 2_768;

/// The addresses of one family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressPlan {
    pub family: IpFamily,
    pub node_ip: IpAddr,
    cluster_ips: IpNet,
    ingress_ips: IpNet,
    /// Endpoints of the generated Services; also the cluster CIDR the node proxy is given.
    pod_ips: IpNet,
    /// Endpoints the incremental rounds add, outside every generated one.
    added_ips: IpNet,
    /// A source range on every LoadBalancer Service, as in the kube-proxy reference dump
    /// in `nodeproxy/rules/tests/data/` (KUBE-FW rules).
    source_range: &'static str,
}

const fn v4(net: [u8; 4], len: u8) -> IpNet {
    IpNet::V4(Ipv4Net::new_assert(
        Ipv4Addr::new(net[0], net[1], net[2], net[3]),
        len,
    ))
}

const fn v6(net: [u16; 3], len: u8) -> IpNet {
    IpNet::V6(Ipv6Net::new_assert(
        Ipv6Addr::new(net[0], net[1], net[2], 0, 0, 0, 0, 0),
        len,
    ))
}

pub const V4: AddressPlan = AddressPlan {
    family: IpFamily::V4,
    node_ip: IpAddr::V4(Ipv4Addr::new(198, 18, 0, 11)),
    cluster_ips: v4([10, 96, 0, 0], 16),
    ingress_ips: v4([198, 19, 0, 0], 16),
    pod_ips: v4([10, 128, 0, 0], 9),
    added_ips: v4([10, 127, 0, 0], 16),
    source_range: "203.0.113.0/24",
};

/// Every range wider than its IPv4 counterpart, so a scale IPv4 holds fits.
pub const V6: AddressPlan = AddressPlan {
    family: IpFamily::V6,
    node_ip: IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0x18, 0, 0, 0, 0, 0x11)),
    cluster_ips: v6([0xfd00, 0x10, 0x96], 108),
    ingress_ips: v6([0x2001, 0xdb8, 0x19], 104),
    pod_ips: v6([0xfd00, 0x10, 0x128], 96),
    added_ips: v6([0xfd00, 0x10, 0x127], 112),
    source_range: "2001:db8:203::/64",
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServiceKind {
    LoadBalancer,
    ClusterIp,
}

/// How many Services of which kind, with how many endpoints each (per family).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scale {
    pub kind: ServiceKind,
    pub services: usize,
    pub endpoints: usize,
    /// IPv4 and IPv6, or IPv4 alone.
    pub dual_stack: bool,
}

impl Scale {
    /// `2,700 LoadBalancer × 10`, `2,700 dual-stack LoadBalancer × 10`.
    pub fn label(&self) -> String {
        let kind = match self.kind {
            ServiceKind::LoadBalancer => "LoadBalancer",
            ServiceKind::ClusterIp => "ClusterIP",
        };
        let stack = if self.dual_stack { "dual-stack " } else { "" };
        format!(
            "{} {stack}{kind} × {}",
            thousands(self.services),
            thousands(self.endpoints)
        )
    }

    /// The address plans of its families, IPv4 first.
    pub fn plans(&self) -> &'static [AddressPlan] {
        if self.dual_stack { &[V4, V6] } else { &[V4] }
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
    #[error("{0} Services do not fit in the cluster IP range {range}", range = V4.cluster_ips)]
    ClusterIps(usize),
    #[error("{0} endpoints do not fit in {range}", range = V4.pod_ips)]
    Endpoints(usize),
}

/// The Services (allocated and, for LoadBalancers, with an ingress IP of each family) and
/// an EndpointSlice per Service and family: every IPv4 slice in Service order, then every
/// IPv6 one.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
    pub plans: &'static [AddressPlan],
}

/// The `n`-th address of `net` after its network address.
fn nth(net: IpNet, n: usize) -> IpAddr {
    match net {
        IpNet::V4(net) => {
            let offset = u32::try_from(n).unwrap_or(u32::MAX);
            Ipv4Addr::from(u32::from(net.network()).saturating_add(offset)).into()
        }
        IpNet::V6(net) => {
            let offset = u128::try_from(n).unwrap_or(u128::MAX);
            Ipv6Addr::from(u128::from(net.network()).saturating_add(offset)).into()
        }
    }
}

/// Usable host addresses of `net` after the network address (the broadcast one
/// excluded), at most `usize::MAX`.
fn capacity(net: IpNet) -> usize {
    let host_bits = u32::from(net.max_prefix_len() - net.prefix_len());
    1usize
        .checked_shl(host_bits)
        .map_or(usize::MAX, |all| all.saturating_sub(2))
}

pub fn generate(scale: Scale) -> Result<Cluster, ScaleError> {
    if scale.kind == ServiceKind::LoadBalancer && scale.services > NODE_PORTS {
        return Err(ScaleError::NodePorts(scale.services));
    }
    // The IPv4 ranges are the narrower ones.
    if scale.services >= capacity(V4.cluster_ips) || scale.services >= capacity(V4.ingress_ips) {
        return Err(ScaleError::ClusterIps(scale.services));
    }
    let total_endpoints = scale.services.saturating_mul(scale.endpoints);
    if total_endpoints >= capacity(V4.pod_ips) {
        return Err(ScaleError::Endpoints(total_endpoints));
    }
    let plans = scale.plans();
    let services = (0..scale.services)
        .map(|i| service(scale.kind, i, plans))
        .collect();
    let slices = plans
        .iter()
        .flat_map(|plan| {
            (0..scale.services).map(move |i| {
                let endpoints = (0..scale.endpoints)
                    .map(|e| endpoint(nth(plan.pod_ips, i * scale.endpoints + e + 1)))
                    .collect();
                slice(i, plan.family, endpoints)
            })
        })
        .collect();
    Ok(Cluster {
        services,
        slices,
        plans,
    })
}

fn service_name(index: usize) -> String {
    format!("svc-{index}")
}

fn service(kind: ServiceKind, index: usize, plans: &[AddressPlan]) -> Service {
    let load_balancer = kind == ServiceKind::LoadBalancer;
    let each = |f: &dyn Fn(&AddressPlan) -> String| plans.iter().map(f).collect::<Vec<_>>();
    let cluster_ips = each(&|plan| nth(plan.cluster_ips, index + 1).to_string());
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
            cluster_ip: cluster_ips.first().cloned(),
            cluster_ips: Some(cluster_ips),
            ip_families: Some(each(&|plan| plan.family.as_str().to_owned())),
            ip_family_policy: Some(
                if plans.len() > 1 {
                    "RequireDualStack"
                } else {
                    "SingleStack"
                }
                .into(),
            ),
            ports: Some(vec![ServicePort {
                name: Some(PORT_NAME.into()),
                protocol: Some("TCP".into()),
                port: SERVICE_PORT,
                target_port: Some(IntOrString::Int(TARGET_PORT)),
                node_port: node_port.filter(|_| load_balancer),
                ..ServicePort::default()
            }]),
            selector: Some(BTreeMap::from([("app".into(), service_name(index))])),
            load_balancer_source_ranges: load_balancer
                .then(|| each(&|plan| plan.source_range.to_owned())),
            external_traffic_policy: load_balancer.then(|| "Cluster".into()),
            ..ServiceSpec::default()
        }),
        status: load_balancer.then(|| ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(
                    plans
                        .iter()
                        .map(|plan| LoadBalancerIngress {
                            ip: Some(nth(plan.ingress_ips, index + 1).to_string()),
                            ip_mode: Some("VIP".into()),
                            ..LoadBalancerIngress::default()
                        })
                        .collect(),
                ),
            }),
            ..ServiceStatus::default()
        }),
    }
}

fn endpoint(ip: IpAddr) -> Endpoint {
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

fn slice(index: usize, family: IpFamily, endpoints: Vec<Endpoint>) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            namespace: Some(NAMESPACE.into()),
            name: Some(format!(
                "{}-{}",
                service_name(index),
                family.as_str().to_lowercase()
            )),
            labels: Some(BTreeMap::from([(
                SERVICE_NAME_LABEL.into(),
                service_name(index),
            )])),
            ..ObjectMeta::default()
        },
        address_type: family.as_str().into(),
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
    /// The slice an incremental round changes: spread over the cluster, never the same
    /// one twice in a row; of the last family (IPv6 in a dual-stack cluster).
    pub fn changed_service(&self, round: usize) -> usize {
        let per_family = self.services.len().max(1);
        let last_family = self.slices.len().saturating_sub(per_family);
        // A prime step visits every index before repeating when it does not divide the count.
        last_family + round.wrapping_mul(7_919) % per_family
    }

    /// The family of the slice at `index`.
    pub fn family_of(&self, index: usize) -> IpFamily {
        let per_family = self.services.len().max(1);
        self.plans
            .get(index / per_family)
            .map_or(IpFamily::V4, |plan| plan.family)
    }

    /// Adds endpoint number `round` of the extra range of its family to the slice at
    /// `index`.
    pub fn add_endpoint(&mut self, index: usize, round: usize) {
        let family = self.family_of(index);
        let Some(plan) = self.plans.iter().find(|plan| plan.family == family) else {
            return;
        };
        if let Some(slice) = self.slices.get_mut(index) {
            slice
                .endpoints
                .push(endpoint(nth(plan.added_ips, round + 1)));
        }
    }

    /// Removes the last endpoint of the slice at `index` (the one `add_endpoint` added).
    pub fn remove_last_endpoint(&mut self, index: usize) {
        if let Some(slice) = self.slices.get_mut(index) {
            slice.endpoints.pop();
        }
    }
}

/// The Node object of [`NODE_NAME`], with an InternalIP of each family of `plans`.
pub fn node(plans: &[AddressPlan]) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(NODE_NAME.into()),
            ..ObjectMeta::default()
        },
        status: Some(NodeStatus {
            addresses: Some(
                plans
                    .iter()
                    .map(|plan| NodeAddress {
                        type_: "InternalIP".into(),
                        address: plan.node_ip.to_string(),
                    })
                    .collect(),
            ),
            ..NodeStatus::default()
        }),
        ..Node::default()
    }
}

/// `--cluster-cidr` for the node proxy binary: a CIDR per family of `plans`.
pub fn cluster_cidr(plans: &[AddressPlan]) -> String {
    let cidrs: Vec<String> = plans.iter().map(|plan| plan.pod_ips.to_string()).collect();
    cidrs.join(",")
}

impl AddressPlan {
    /// What the node proxy's proxier of this family is told about its node.
    pub fn node_config(&self) -> NodeConfig {
        NodeConfig {
            family: self.family,
            ..NodeConfig::new(NODE_NAME, Some(self.pod_ips))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_common::IpFamily;
    use tandem_nodeproxy::observe::convert::proxy_state;

    fn scale(kind: ServiceKind, services: usize, endpoints: usize) -> Scale {
        Scale {
            kind,
            services,
            endpoints,
            dual_stack: false,
        }
    }

    #[test]
    fn load_balancers_convert_to_services_with_every_endpoint() {
        let cluster = generate(scale(ServiceKind::LoadBalancer, 30, 4)).unwrap();
        let conversion = proxy_state(&cluster.services, &cluster.slices, IpFamily::V4);
        assert!(conversion.skipped.is_empty(), "{:?}", conversion.skipped);
        assert_eq!(conversion.state.services().len(), 30);
        assert!(conversion.state.endpoints().values().all(|e| e.len() == 4));
        let node_ports: std::collections::BTreeSet<_> = conversion
            .state
            .services()
            .values()
            .map(|s| s.node_port.unwrap())
            .collect();
        assert_eq!(node_ports.len(), 30);
        assert!(conversion.state.services().values().all(
            |s| s.load_balancer_ingress.len() == 1 && s.load_balancer_source_ranges.len() == 1
        ));
        let all_endpoints: std::collections::BTreeSet<_> = conversion
            .state
            .endpoints()
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
        assert_eq!(state.services().len(), 5);
        assert!(state.services().values().all(|s| s.node_port.is_none()
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
            .endpoints()
            .iter()
            .filter(|(name, e)| before.endpoints().get(*name) != Some(e))
            .collect();
        assert_eq!(changed.len(), 1);
        assert_eq!(changed[0].1.len(), 4);
        cluster.remove_last_endpoint(index);
        assert_eq!(cluster, original);
    }

    #[test]
    fn a_dual_stack_cluster_has_both_families_and_changes_its_ipv6_slices() {
        let scale = Scale {
            dual_stack: true,
            ..scale(ServiceKind::LoadBalancer, 20, 3)
        };
        assert_eq!(scale.label(), "20 dual-stack LoadBalancer × 3");
        let mut cluster = generate(scale).unwrap();
        assert_eq!(cluster.slices.len(), 40);
        for family in [IpFamily::V4, IpFamily::V6] {
            let conversion = proxy_state(&cluster.services, &cluster.slices, family);
            assert!(conversion.skipped.is_empty(), "{:?}", conversion.skipped);
            let state = conversion.state;
            assert_eq!(state.services().len(), 20);
            assert!(state.services().values().all(|s| {
                s.cluster_ip.is_some_and(|ip| family.holds(ip))
                    && s.load_balancer_ingress.len() == 1
                    && family.holds(s.load_balancer_ingress[0].ip)
                    && s.load_balancer_source_ranges.len() == 1
            }));
            assert!(
                state
                    .endpoints()
                    .values()
                    .flatten()
                    .all(|e| family.holds(e.ip))
            );
            assert_eq!(state.endpoints().values().flatten().count(), 60);
        }
        let node = node(cluster.plans);
        assert_eq!(node.status.unwrap().addresses.unwrap().len(), 2);
        assert_eq!(cluster_cidr(cluster.plans), "10.128.0.0/9,fd00:10:128::/96");
        // The rounds change IPv6 slices, with IPv6 endpoints.
        for round in 0..5 {
            let index = cluster.changed_service(round);
            assert_eq!(cluster.family_of(index), IpFamily::V6);
            cluster.add_endpoint(index, round);
            let added = cluster.slices[index].endpoints.last().unwrap();
            assert!(added.addresses[0].starts_with("fd00:10:127::"), "{added:?}");
            cluster.remove_last_endpoint(index);
        }
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
