//! What the lab asks of the cluster (a LoadBalancer Service over some pods) and what it
//! makes of the answers (how requests spread over nodes and pods). Pure: no I/O here.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tandem_netlab::{EchoReply, IpFamily, Node};

use crate::rules;

/// The annotation that picks the load balancer's mode in the mock cloud.
pub const MODE_ANNOTATION: &str = "service.beta.kubernetes.io/mockcloud-load-balancer-mode";
/// The annotation that picks the address pool.
pub const POOL_ANNOTATION: &str = "service.beta.kubernetes.io/mockcloud-load-balancer-address-pool";
/// The name of a lab Service's TCP port (its UDP port is `udp`).
pub const HTTP_PORT_NAME: &str = "http";
/// The annotation whose value lets Services share one address.
pub const SHARED_IP_ANNOTATION: &str =
    "service.beta.kubernetes.io/mockcloud-load-balancer-allow-shared-ip";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LbMode {
    /// The cloud proxies `VIP:port` to `nodeIP:nodePort`.
    Proxy,
    /// The cloud routes the VIP to nodes; nodes take it with KUBE-FW.
    Passthrough,
}

impl LbMode {
    pub fn as_str(self) -> &'static str {
        match self {
            LbMode::Proxy => "proxy",
            LbMode::Passthrough => "passthrough",
        }
    }
}

/// A LoadBalancer Service the lab creates, and the pods behind it.
#[derive(Debug, Clone)]
pub struct ServicePlan {
    pub namespace: String,
    pub name: String,
    pub mode: LbMode,
    pub port: u16,
    /// The pods' port (the echo serves HTTP and UDP on it).
    pub target_port: u16,
    pub external_traffic_policy_local: bool,
    pub source_ranges: Vec<String>,
    /// `spec.allocateLoadBalancerNodePorts`: false asks for a LoadBalancer without
    /// NodePorts, which only the passthrough mode can serve.
    pub allocate_node_ports: bool,
    /// `spec.loadBalancerIP`.
    pub load_balancer_ip: Option<Ipv4Addr>,
    /// `spec.ipFamilies`; empty leaves them to the API server (the policy's defaults).
    pub ip_families: Vec<IpFamily>,
    /// `spec.ipFamilyPolicy` (`SingleStack`, `PreferDualStack`, `RequireDualStack`); the
    /// API server's default (`SingleStack`) when `None`.
    pub ip_family_policy: Option<String>,
    /// Annotations besides the mode's (pool, sharing key).
    pub annotations: BTreeMap<String, String>,
    /// Names of the pods (topology pods) that serve it.
    pub pods: Vec<String>,
}

impl ServicePlan {
    pub fn new(name: &str, mode: LbMode) -> Self {
        Self {
            namespace: "default".to_owned(),
            name: name.to_owned(),
            mode,
            port: 80,
            target_port: tandem_netlab::echo::DEFAULT_ECHO_PORT,
            external_traffic_policy_local: false,
            source_ranges: Vec::new(),
            allocate_node_ports: true,
            load_balancer_ip: None,
            ip_families: Vec::new(),
            ip_family_policy: None,
            annotations: BTreeMap::new(),
            pods: Vec::new(),
        }
    }

    /// The selectorless Service: one TCP and one UDP port, both served by the pod echo.
    pub fn service(&self) -> Service {
        self.service_with_udp(true)
    }

    /// [`Self::service`], with its UDP port only when `udp`.
    pub fn service_with_udp(&self, udp: bool) -> Service {
        let port = |name: &str, protocol: &str| ServicePort {
            name: Some(name.to_owned()),
            protocol: Some(protocol.to_owned()),
            port: i32::from(self.port),
            target_port: Some(IntOrString::Int(i32::from(self.target_port))),
            ..ServicePort::default()
        };
        Service {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: Some(self.namespace.clone()),
                annotations: Some(
                    self.annotations
                        .clone()
                        .into_iter()
                        .chain([(MODE_ANNOTATION.to_owned(), self.mode.as_str().to_owned())])
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                type_: Some("LoadBalancer".to_owned()),
                ports: Some(if udp {
                    vec![port(HTTP_PORT_NAME, "TCP"), port("udp", "UDP")]
                } else {
                    vec![port(HTTP_PORT_NAME, "TCP")]
                }),
                external_traffic_policy: Some(
                    if self.external_traffic_policy_local {
                        "Local"
                    } else {
                        "Cluster"
                    }
                    .to_owned(),
                ),
                load_balancer_source_ranges: (!self.source_ranges.is_empty())
                    .then(|| self.source_ranges.clone()),
                allocate_load_balancer_node_ports: (!self.allocate_node_ports).then_some(false),
                load_balancer_ip: self.load_balancer_ip.map(|ip| ip.to_string()),
                ip_families: (!self.ip_families.is_empty()).then(|| {
                    self.ip_families
                        .iter()
                        .map(|f| f.as_str().to_owned())
                        .collect()
                }),
                ip_family_policy: self.ip_family_policy.clone(),
                ..ServiceSpec::default()
            }),
            status: None,
        }
    }

    /// The TCP port, as the node proxies name it in their rules.
    pub fn http_port(&self) -> rules::ServicePort {
        rules::ServicePort {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            port: HTTP_PORT_NAME.to_owned(),
        }
    }
}

/// How a batch of requests went: answers by pod and by the source address the pods saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Spread {
    pub sent: usize,
    pub failed: usize,
    pub errors: BTreeMap<String, usize>,
    pub by_pod: BTreeMap<String, usize>,
    /// The source the pod saw: a node's name when the node masqueraded, else the address.
    pub by_seen_source: BTreeMap<String, usize>,
}

impl Spread {
    pub fn from_replies(replies: &[Result<EchoReply, String>], nodes: &[Node]) -> Self {
        let mut spread = Spread {
            sent: replies.len(),
            ..Spread::default()
        };
        for reply in replies {
            match reply {
                Ok(r) => {
                    *spread.by_pod.entry(r.pod.clone()).or_default() += 1;
                    *spread
                        .by_seen_source
                        .entry(source_label(r.client.ip(), nodes))
                        .or_default() += 1;
                }
                Err(e) => {
                    spread.failed += 1;
                    *spread.errors.entry(e.clone()).or_default() += 1;
                }
            }
        }
        spread
    }

    pub fn succeeded(&self) -> usize {
        self.sent - self.failed
    }

    /// Nodes that took requests, as seen by the pods (masqueraded sources only).
    pub fn nodes_seen<'a>(&'a self, nodes: &'a [Node]) -> impl Iterator<Item = &'a str> {
        self.by_seen_source
            .keys()
            .map(String::as_str)
            .filter(|k| nodes.iter().any(|n| n.name == *k))
    }
}

fn source_label(ip: IpAddr, nodes: &[Node]) -> String {
    nodes
        .iter()
        .find(|n| n.ip_of(IpFamily::of(ip)) == Some(ip) || node_owns_pod_gateway(n, ip))
        .map(|n| n.name.clone())
        .unwrap_or_else(|| ip.to_string())
}

/// A node masquerading towards a local pod uses its cni0 address (the pod CIDR's first).
fn node_owns_pod_gateway(node: &Node, ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(ip) => {
            node.pod_cidr.contains(&ip) && u32::from(ip) == u32::from(node.pod_cidr.network()) + 1
        }
        IpAddr::V6(ip) => tandem_netlab::addr::v6::pod_gateway(node.index).ok() == Some(ip),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_netlab::Netns;

    fn node(index: usize) -> Node {
        Node {
            index,
            name: format!("node-{index}"),
            netns: Netns::attach(format!("t-n{index}")),
            ip: Ipv4Addr::new(198, 18, 0, 10 + index as u8),
            pod_cidr: format!("10.244.{index}.0/24").parse().unwrap(),
            ip6: None,
        }
    }

    fn reply(pod: &str, client: &str) -> Result<EchoReply, String> {
        Ok(EchoReply {
            pod: pod.to_owned(),
            client: client.parse().unwrap(),
            node: None,
        })
    }

    #[test]
    fn spread_names_masquerading_nodes_and_keeps_client_addresses() {
        let nodes = [node(1), node(2)];
        let replies = [
            reply("n1p1", "198.18.0.11:4000"),
            reply("n1p1", "10.244.1.1:4001"),
            reply("n2p1", "203.0.113.10:4002"),
            Err("timed out".to_owned()),
        ];
        let spread = Spread::from_replies(&replies, &nodes);
        assert_eq!(spread.sent, 4);
        assert_eq!(spread.failed, 1);
        assert_eq!(spread.by_pod["n1p1"], 2);
        assert_eq!(spread.by_seen_source["node-1"], 2);
        assert_eq!(spread.by_seen_source["203.0.113.10"], 1);
        assert_eq!(
            spread.nodes_seen(&nodes).collect::<Vec<_>>(),
            vec!["node-1"]
        );
    }

    #[test]
    fn ipv6_sources_name_the_node_that_masqueraded() {
        let dual = |index| Node {
            ip6: Some(tandem_netlab::addr::v6::node_ip(index).unwrap()),
            ..node(index)
        };
        let nodes = [dual(1), dual(2)];
        let replies = [
            reply("n1p1", "[2001:db8:18::12]:4000"),
            reply("n1p1", "[fd00:10:244:1::1]:4001"),
            reply("n2p1", "[2001:db8:203::10]:4002"),
        ];
        let spread = Spread::from_replies(&replies, &nodes);
        assert_eq!(spread.by_seen_source["node-2"], 1);
        assert_eq!(spread.by_seen_source["node-1"], 1);
        assert_eq!(spread.by_seen_source["2001:db8:203::10"], 1);
    }

    #[test]
    fn families_are_left_to_the_server_unless_the_plan_names_them() {
        let mut plan = ServicePlan::new("web", LbMode::Proxy);
        let spec = plan.service().spec.unwrap();
        assert!(spec.ip_families.is_none() && spec.ip_family_policy.is_none());
        plan.ip_families = vec![IpFamily::V6, IpFamily::V4];
        plan.ip_family_policy = Some("RequireDualStack".to_owned());
        let spec = plan.service().spec.unwrap();
        assert_eq!(spec.ip_families.unwrap(), ["IPv6", "IPv4"]);
        assert_eq!(spec.ip_family_policy.as_deref(), Some("RequireDualStack"));
    }

    #[test]
    fn service_is_selectorless_load_balancer_with_tcp_and_udp() {
        let mut plan = ServicePlan::new("web", LbMode::Passthrough);
        plan.source_ranges = vec!["203.0.113.0/24".to_owned()];
        plan.external_traffic_policy_local = true;
        plan.load_balancer_ip = Some(Ipv4Addr::new(198, 51, 100, 77));
        plan.annotations
            .insert(SHARED_IP_ANNOTATION.to_owned(), "pair".to_owned());
        let svc = plan.service();
        let spec = svc.spec.unwrap();
        assert_eq!(spec.type_.as_deref(), Some("LoadBalancer"));
        assert!(spec.selector.is_none());
        assert_eq!(spec.external_traffic_policy.as_deref(), Some("Local"));
        assert_eq!(spec.ports.unwrap().len(), 2);
        assert_eq!(spec.load_balancer_ip.as_deref(), Some("198.51.100.77"));
        let annotations = svc.metadata.annotations.unwrap();
        assert_eq!(annotations[MODE_ANNOTATION], "passthrough");
        assert_eq!(annotations[SHARED_IP_ANNOTATION], "pair");
    }
}
