//! Which conntrack entries turn stale when Services and endpoints change. UDP, as
//! kube-proxy decides it: UDP has no connection end, so without the deletion a client
//! keeps sending to a removed pod (or to the REJECT of a Service that had no endpoints).
//! TCP, beyond kube-proxy: the black holes a SYN leaves when it meets no rules.
//!
//! Two parts: [`stale_udp_deletions`], the deletions a change calls for (kube-proxy
//! v1.21, run after each sync), and [`ServingEndpoints`], kube-proxy 1.32's periodic
//! reconciler, which judges the entries the kernel holds against the current state and so
//! also catches those a deletion missed (an entry made by a packet that raced a sync).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tandem_common::{IpFamily, Protocol};

use crate::model::{IpMode, ProxyState, ServicePort, ServicePortName};

/// One `conntrack -D` to run after the new rules are in place.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ConntrackDeletion {
    /// Every UDP flow to a Service IP (cluster, external or load-balancer IP).
    ServiceIp { ip: IpAddr },
    /// Every UDP flow to a node port.
    NodePort { port: u16 },
    /// UDP flows to a Service IP that were DNATed to a removed endpoint.
    ServiceIpToEndpoint {
        service_ip: IpAddr,
        endpoint_ip: IpAddr,
    },
    /// UDP flows to a node port that were DNATed to a removed endpoint.
    NodePortToEndpoint { port: u16, endpoint_ip: IpAddr },
}

impl ConntrackDeletion {
    /// The arguments of the `conntrack` command that performs it in the proxier of
    /// `family` (kube-proxy's: `-f ipv6` last for IPv6).
    pub fn conntrack_args(&self, family: IpFamily) -> Vec<String> {
        let args: Vec<String> = match self {
            Self::ServiceIp { ip } => vec!["-D".into(), "--orig-dst".into(), ip.to_string()],
            Self::NodePort { port } => vec![
                "-D".into(),
                "-p".into(),
                "udp".into(),
                "--dport".into(),
                port.to_string(),
            ],
            Self::ServiceIpToEndpoint {
                service_ip,
                endpoint_ip,
            } => vec![
                "-D".into(),
                "--orig-dst".into(),
                service_ip.to_string(),
                "--dst-nat".into(),
                endpoint_ip.to_string(),
            ],
            Self::NodePortToEndpoint { port, endpoint_ip } => vec![
                "-D".into(),
                "-p".into(),
                "udp".into(),
                "--dport".into(),
                port.to_string(),
                "--dst-nat".into(),
                endpoint_ip.to_string(),
            ],
        };
        let mut args = match self {
            Self::ServiceIp { .. } | Self::ServiceIpToEndpoint { .. } => {
                [args, vec!["-p".into(), "udp".into()]].concat()
            }
            Self::NodePort { .. } | Self::NodePortToEndpoint { .. } => args,
        };
        if family == IpFamily::V6 {
            args.extend(["-f".into(), "ipv6".into()]);
        }
        args
    }
}

/// The deletions for going from `previous` to `current`, sorted and without duplicates:
/// - a UDP endpoint that stopped serving or went away: its flows from each Service IP and the node
///   port;
/// - a UDP Service port that goes from no serving endpoints to some: all flows to its IPs
///   and node port (they were answered by REJECT and would stay that way);
/// - a UDP Service port that is gone or changed its cluster IP: flows to the old cluster IP.
pub fn stale_udp_deletions(previous: &ProxyState, current: &ProxyState) -> Vec<ConntrackDeletion> {
    let mut deletions = BTreeSet::new();
    for (name, old_service) in previous.services() {
        if old_service.protocol != Protocol::Udp {
            continue;
        }
        let Some(old_ip) = old_service.cluster_ip else {
            continue;
        };
        let new_ip = current.services().get(name).and_then(|svc| svc.cluster_ip);
        if new_ip != Some(old_ip) {
            deletions.insert(ConntrackDeletion::ServiceIp { ip: old_ip });
        }
    }
    let names: BTreeSet<&ServicePortName> = previous
        .services()
        .keys()
        .chain(current.services().keys())
        .collect();
    for name in names {
        let Some(service) = current
            .services()
            .get(name)
            .or_else(|| previous.services().get(name))
        else {
            continue;
        };
        if service.protocol != Protocol::Udp || service.cluster_ip.is_none() {
            continue;
        }
        let before = serving_endpoints(previous, name);
        let after = serving_endpoints(current, name);
        for &(endpoint_ip, _) in before.difference(&after) {
            if let Some(node_port) = service.node_port {
                deletions.insert(ConntrackDeletion::NodePortToEndpoint {
                    port: node_port,
                    endpoint_ip,
                });
            }
            for service_ip in service_ips(service) {
                deletions.insert(ConntrackDeletion::ServiceIpToEndpoint {
                    service_ip,
                    endpoint_ip,
                });
            }
        }
        if before.is_empty() && !after.is_empty() && current.services().contains_key(name) {
            deletions.extend(service_ips(service).map(|ip| ConntrackDeletion::ServiceIp { ip }));
            if let Some(port) = service.node_port {
                deletions.insert(ConntrackDeletion::NodePort { port });
            }
        }
    }
    deletions.into_iter().collect()
}

/// (ip, port) of the serving endpoints of a Service port, as kube-proxy counts them for
/// stale flows: a terminating endpoint that still serves may still get traffic (KEP-1669
/// fallback), so its flows stay until it stops serving or goes away.
fn serving_endpoints(state: &ProxyState, name: &ServicePortName) -> BTreeSet<(IpAddr, u16)> {
    state
        .endpoints()
        .get(name)
        .into_iter()
        .flatten()
        .filter(|ep| ep.serving)
        .map(|ep| (ep.ip, ep.port))
        .collect()
}

/// Whether a Service port has an endpoint that serves (as [`serving_endpoints`] counts).
fn has_serving_endpoint(state: &ProxyState, name: &ServicePortName) -> bool {
    state
        .endpoints()
        .get(name)
        .is_some_and(|endpoints| endpoints.iter().any(|ep| ep.serving))
}

/// The IPs the node DNATs for a Service port: cluster IP, external IPs, VIP-mode LB IPs.
fn service_ips(service: &ServicePort) -> impl Iterator<Item = IpAddr> + '_ {
    let lb_ips = service
        .load_balancer_ingress
        .iter()
        .filter(|lb| lb.ip_mode == IpMode::Vip)
        .map(|lb| lb.ip);
    service
        .cluster_ip
        .into_iter()
        .chain(service.external_ips.iter().copied())
        .chain(lb_ips)
}

/// A conntrack entry as the reconciler judges it: where its first packet was sent (the
/// Service IP and port, or a node port), where answers come from (the endpoint a DNAT
/// chose; the original destination itself when nothing was DNATed), and whether any came.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConntrackFlow {
    /// The IANA protocol number (see [`Protocol::number`]).
    pub protocol: u8,
    pub original_destination: SocketAddr,
    pub reply_source: SocketAddr,
    /// A packet came back the reply way (conntrack's `SEEN_REPLY`).
    pub replied: bool,
}

/// The Service ports that have serving endpoints, by the frontends that reach them (the
/// cluster IP, external IPs and VIP-mode load-balancer IPs, each with the port, and the
/// node port): what the reconciler judges each entry of the kernel's table by.
///
/// UDP, as kube-proxy's `CleanStaleEntries` (`pkg/proxy/conntrack/cleanup.go`, 1.32 on)
/// keeps it: the serving endpoints of each frontend; a Service port without serving
/// endpoints is left alone (its entries go when the first endpoint comes, by
/// [`stale_udp_deletions`]); traffic policies, topology and terminating do not count, only
/// `serving`, so that UDP flows last as TCP connections do; a node port matches an entry
/// whatever its original destination address.
///
/// TCP: the frontends of the Service IPs only. A SYN that reached the node before its
/// rules (a Service port just given endpoints, a node proxy not yet synced, rules someone
/// else flushed) leaves an entry without DNAT, and every later SYN of that source port
/// (the client's own retransmissions, or a new connection that picks the port again)
/// follows it, untranslated, for as long as SYNs keep coming (kubernetes#48719, #101607;
/// kube-proxy leaves them). Such an entry never carried a connection (nothing answered
/// through it), so deleting it breaks none; an answered or DNATed TCP entry is never
/// judged stale here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServingEndpoints {
    udp_by_frontend: BTreeMap<SocketAddr, Arc<BTreeSet<SocketAddr>>>,
    udp_by_node_port: BTreeMap<u16, Arc<BTreeSet<SocketAddr>>>,
    /// Not node ports: a SYN to a node port that meets no rules reaches the node's own
    /// stack, which answers it (a reset), so its entry is no black hole.
    tcp_frontends: BTreeSet<SocketAddr>,
}

impl ServingEndpoints {
    /// The UDP and TCP Service ports of `state`.
    pub fn of(state: &ProxyState) -> Self {
        Self::of_protocols(state, true)
    }

    /// The UDP Service ports of `state` only: no TCP entry is judged stale.
    pub fn udp_of(state: &ProxyState) -> Self {
        Self::of_protocols(state, false)
    }

    fn of_protocols(state: &ProxyState, tcp: bool) -> Self {
        let mut serving = Self::default();
        for (name, service) in state.services() {
            if service.cluster_ip.is_none() {
                continue;
            }
            let frontends = service_ips(service).map(|ip| SocketAddr::new(ip, service.port));
            match service.protocol {
                Protocol::Udp => {
                    let endpoints: BTreeSet<SocketAddr> = serving_endpoints(state, name)
                        .into_iter()
                        .map(|(ip, port)| SocketAddr::new(ip, port))
                        .collect();
                    if endpoints.is_empty() {
                        continue;
                    }
                    let endpoints = Arc::new(endpoints);
                    for frontend in frontends {
                        serving
                            .udp_by_frontend
                            .insert(frontend, Arc::clone(&endpoints));
                    }
                    if let Some(node_port) = service.node_port {
                        serving.udp_by_node_port.insert(node_port, endpoints);
                    }
                }
                Protocol::Tcp if tcp && has_serving_endpoint(state, name) => {
                    serving.tcp_frontends.extend(frontends);
                }
                Protocol::Tcp | Protocol::Sctp => {}
            }
        }
        serving
    }

    /// Whether some UDP Service port has a serving endpoint: else no UDP entry can be
    /// stale, and the kernel's UDP entries need not be read.
    pub fn has_udp(&self) -> bool {
        !self.udp_by_frontend.is_empty() || !self.udp_by_node_port.is_empty()
    }

    /// Whether some TCP Service port has a serving endpoint (see [`Self::has_udp`]).
    pub fn has_tcp(&self) -> bool {
        !self.tcp_frontends.is_empty()
    }

    /// True when `flow` is stale: for UDP, an entry to a Service IP and port, or to a node
    /// port, of a Service port with serving endpoints, whose reply source is not a serving
    /// endpoint (a removed or non-serving endpoint, an endpoint's old port, or no DNAT at
    /// all); for TCP, an entry to a Service IP and port of such a Service port that was not
    /// DNATed and that nothing answered.
    pub fn is_stale(&self, flow: &ConntrackFlow) -> bool {
        let destination = flow.original_destination;
        if flow.protocol == Protocol::Udp.number() {
            let not_serving =
                |endpoints: &Arc<BTreeSet<SocketAddr>>| !endpoints.contains(&flow.reply_source);
            self.udp_by_frontend
                .get(&destination)
                .is_some_and(not_serving)
                || self
                    .udp_by_node_port
                    .get(&destination.port())
                    .is_some_and(not_serving)
        } else if flow.protocol == Protocol::Tcp.number() {
            !flow.replied
                && flow.reply_source == destination
                && self.tcp_frontends.contains(&destination)
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::{Endpoint, LoadBalancerIngress};

    fn dns_name() -> ServicePortName {
        ServicePortName {
            namespace: "kube-system".into(),
            name: "dns".into(),
            port: "dns".into(),
        }
    }

    fn dns(protocol: Protocol) -> ServicePort {
        ServicePort {
            name: dns_name(),
            protocol,
            cluster_ip: Some(Ipv4Addr::new(10, 96, 0, 53).into()),
            port: 53,
            node_port: Some(30053),
            external_ips: vec![Ipv4Addr::new(192, 0, 2, 53).into()],
            load_balancer_ingress: vec![
                LoadBalancerIngress {
                    ip: Ipv4Addr::new(198, 51, 100, 53).into(),
                    ip_mode: IpMode::Vip,
                },
                LoadBalancerIngress {
                    ip: Ipv4Addr::new(198, 51, 100, 54).into(),
                    ip_mode: IpMode::Proxy,
                },
            ],
            load_balancer_source_ranges: vec![],
            session_affinity_timeout: None,
            external_traffic_policy_local: false,
            health_check_node_port: None,
            internal_traffic_policy_local: false,
        }
    }

    fn ep(last: u8) -> Endpoint {
        Endpoint {
            ip: Ipv4Addr::new(10, 244, 1, last).into(),
            port: 5353,
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
            hints: None,
        }
    }

    fn state(service: Option<ServicePort>, endpoints: Vec<Endpoint>) -> ProxyState {
        let mut state = ProxyState::new(IpFamily::V4);
        if let Some(service) = service {
            state.insert_service(service);
        }
        state.insert_endpoints(dns_name(), endpoints);
        state
    }

    fn ip(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        IpAddr::from([a, b, c, d])
    }

    #[test]
    fn removed_udp_endpoint_clears_its_flows_from_every_service_ip() {
        let before = state(Some(dns(Protocol::Udp)), vec![ep(5), ep(6)]);
        let after = state(
            Some(dns(Protocol::Udp)),
            vec![
                ep(6),
                Endpoint {
                    terminating: true,
                    ..ep(7)
                },
            ],
        );
        let endpoint_ip = ip(10, 244, 1, 5);
        assert_eq!(
            stale_udp_deletions(&before, &after),
            [
                ConntrackDeletion::ServiceIpToEndpoint {
                    service_ip: ip(10, 96, 0, 53),
                    endpoint_ip
                },
                ConntrackDeletion::ServiceIpToEndpoint {
                    service_ip: ip(192, 0, 2, 53),
                    endpoint_ip
                },
                ConntrackDeletion::ServiceIpToEndpoint {
                    service_ip: ip(198, 51, 100, 53),
                    endpoint_ip
                },
                ConntrackDeletion::NodePortToEndpoint {
                    port: 30053,
                    endpoint_ip
                },
            ]
        );
    }

    #[test]
    fn endpoint_turning_not_ready_is_stale_too() {
        let before = state(Some(dns(Protocol::Udp)), vec![ep(5), ep(6)]);
        let after = state(
            Some(dns(Protocol::Udp)),
            vec![
                Endpoint {
                    ready: false,
                    serving: false,
                    ..ep(5)
                },
                ep(6),
            ],
        );
        assert_eq!(stale_udp_deletions(&before, &after).len(), 4);
    }

    #[test]
    fn terminating_endpoint_that_still_serves_keeps_its_flows_until_it_stops() {
        let before = state(Some(dns(Protocol::Udp)), vec![ep(5)]);
        let terminating = Endpoint {
            ready: false,
            terminating: true,
            ..ep(5)
        };
        let during = state(Some(dns(Protocol::Udp)), vec![terminating.clone()]);
        assert_eq!(stale_udp_deletions(&before, &during), []);
        let stopped = state(
            Some(dns(Protocol::Udp)),
            vec![Endpoint {
                serving: false,
                ..terminating
            }],
        );
        assert_eq!(stale_udp_deletions(&during, &stopped).len(), 4);
    }

    #[test]
    fn first_endpoint_clears_flows_to_the_service() {
        let before = state(Some(dns(Protocol::Udp)), vec![]);
        let after = state(Some(dns(Protocol::Udp)), vec![ep(5)]);
        assert_eq!(
            stale_udp_deletions(&before, &after),
            [
                ConntrackDeletion::ServiceIp {
                    ip: ip(10, 96, 0, 53)
                },
                ConntrackDeletion::ServiceIp {
                    ip: ip(192, 0, 2, 53)
                },
                ConntrackDeletion::ServiceIp {
                    ip: ip(198, 51, 100, 53)
                },
                ConntrackDeletion::NodePort { port: 30053 },
            ]
        );
    }

    #[test]
    fn removed_udp_service_clears_its_cluster_ip() {
        let before = state(Some(dns(Protocol::Udp)), vec![]);
        let after = state(None, vec![]);
        assert_eq!(
            stale_udp_deletions(&before, &after),
            [ConntrackDeletion::ServiceIp {
                ip: ip(10, 96, 0, 53)
            }]
        );
    }

    #[test]
    fn tcp_and_unchanged_udp_need_nothing() {
        let tcp_before = state(Some(dns(Protocol::Tcp)), vec![ep(5)]);
        assert!(
            stale_udp_deletions(&tcp_before, &state(Some(dns(Protocol::Tcp)), vec![])).is_empty()
        );
        let udp = state(Some(dns(Protocol::Udp)), vec![ep(5)]);
        assert!(stale_udp_deletions(&udp, &udp).is_empty());
    }

    #[test]
    fn conntrack_arguments_are_kube_proxys() {
        let endpoint_ip = ip(10, 244, 1, 5);
        let cases = [
            (
                ConntrackDeletion::ServiceIp {
                    ip: ip(10, 96, 0, 53),
                },
                "-D --orig-dst 10.96.0.53 -p udp",
            ),
            (
                ConntrackDeletion::NodePort { port: 30053 },
                "-D -p udp --dport 30053",
            ),
            (
                ConntrackDeletion::ServiceIpToEndpoint {
                    service_ip: ip(10, 96, 0, 53),
                    endpoint_ip,
                },
                "-D --orig-dst 10.96.0.53 --dst-nat 10.244.1.5 -p udp",
            ),
            (
                ConntrackDeletion::NodePortToEndpoint {
                    port: 30053,
                    endpoint_ip,
                },
                "-D -p udp --dport 30053 --dst-nat 10.244.1.5",
            ),
        ];
        for (deletion, args) in cases {
            assert_eq!(deletion.conntrack_args(IpFamily::V4).join(" "), args);
        }
        // kube-proxy's IPv6 proxier adds the family last.
        let v6 = ConntrackDeletion::ServiceIpToEndpoint {
            service_ip: "fd00:10:96::53".parse().unwrap(),
            endpoint_ip: "fd00:10:244:1::5".parse().unwrap(),
        };
        assert_eq!(
            v6.conntrack_args(IpFamily::V6).join(" "),
            "-D --orig-dst fd00:10:96::53 --dst-nat fd00:10:244:1::5 -p udp -f ipv6"
        );
        let node_port = ConntrackDeletion::NodePort { port: 30053 };
        assert_eq!(
            node_port.conntrack_args(IpFamily::V6).join(" "),
            "-D -p udp --dport 30053 -f ipv6"
        );
    }
}

/// kube-proxy's `cleanup_test.go`, ported: the same Service, endpoints and entries.
#[cfg(test)]
mod reconciler_tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::{Endpoint, LoadBalancerIngress};

    const CLUSTER_IP: [u8; 4] = [172, 30, 1, 1];
    const EXTERNAL_IP: [u8; 4] = [192, 168, 99, 100];
    const LOAD_BALANCER_IP: [u8; 4] = [1, 2, 3, 4];
    const SERVING_ENDPOINT: [u8; 4] = [10, 240, 0, 4];
    const NON_SERVING_ENDPOINT: [u8; 4] = [10, 240, 1, 5];
    const DELETED_ENDPOINT: [u8; 4] = [10, 240, 2, 6];
    /// Where entries to the node port were sent (kube-proxy matches any address).
    const NODE_IP: [u8; 4] = [192, 168, 1, 10];
    /// An endpoint that changed its port but not its IP.
    const OLD_ENDPOINT_PORT: u16 = 8080;
    const ENDPOINT_PORT: u16 = 9090;
    const SERVICE_PORT: u16 = 8000;
    const NODE_PORT: u16 = 32000;
    /// Entries to the Service IPs at a port that is no Service's: not ours.
    const NON_SERVICE_PORT: u16 = 3000;
    const TCP: u8 = 6;
    const UDP: u8 = 17;
    const SCTP: u8 = 132;

    fn name(port: &str) -> ServicePortName {
        ServicePortName {
            namespace: "test".into(),
            name: "cleanup-test".into(),
            port: port.into(),
        }
    }

    fn service(port: &str, protocol: Protocol, node_port: Option<u16>) -> ServicePort {
        ServicePort {
            name: name(port),
            protocol,
            cluster_ip: Some(CLUSTER_IP.into()),
            port: SERVICE_PORT,
            node_port,
            external_ips: vec![EXTERNAL_IP.into()],
            load_balancer_ingress: vec![LoadBalancerIngress {
                ip: LOAD_BALANCER_IP.into(),
                ip_mode: IpMode::Vip,
            }],
            load_balancer_source_ranges: vec![],
            session_affinity_timeout: None,
            external_traffic_policy_local: false,
            health_check_node_port: None,
            internal_traffic_policy_local: false,
        }
    }

    fn endpoints() -> Vec<Endpoint> {
        let endpoint = |ip: [u8; 4], serving| Endpoint {
            ip: Ipv4Addr::from(ip).into(),
            port: ENDPOINT_PORT,
            ready: serving,
            serving,
            terminating: false,
            node_name: None,
            hints: None,
        };
        vec![
            endpoint(SERVING_ENDPOINT, true),
            endpoint(NON_SERVING_ENDPOINT, false),
        ]
    }

    /// The Service of `TestCleanStaleEntries`: one port per protocol, the same numbers.
    fn state() -> ProxyState {
        let mut state = ProxyState::new(IpFamily::V4);
        for service in [
            service("test-tcp", Protocol::Tcp, None),
            service("test-udp", Protocol::Udp, Some(NODE_PORT)),
            service("test-sctp", Protocol::Sctp, Some(NODE_PORT)),
        ] {
            state.insert_endpoints(service.name.clone(), endpoints());
            state.insert_service(service);
        }
        state
    }

    fn flow(
        destination: [u8; 4],
        port: u16,
        reply: [u8; 4],
        reply_port: u16,
        protocol: u8,
    ) -> ConntrackFlow {
        ConntrackFlow {
            protocol,
            original_destination: SocketAddr::new(destination.into(), port),
            reply_source: SocketAddr::new(reply.into(), reply_port),
            // kube-proxy's table is of answered entries.
            replied: true,
        }
    }

    /// Returns the entries left after the reconciler and how many it deleted.
    fn reconcile(
        state: &ProxyState,
        entries: &[ConntrackFlow],
    ) -> (BTreeSet<ConntrackFlow>, usize) {
        let serving = ServingEndpoints::of(state);
        let (stale, left): (Vec<&ConntrackFlow>, Vec<&ConntrackFlow>) =
            entries.iter().partition(|flow| serving.is_stale(flow));
        (left.into_iter().copied().collect(), stale.len())
    }

    #[test]
    fn clean_stale_entries() {
        let mut before = Vec::new();
        let mut after = BTreeSet::new();
        // An endpoint that changed its port: its entries under the old port go.
        for destination in [CLUSTER_IP, LOAD_BALANCER_IP, EXTERNAL_IP] {
            before.push(flow(
                destination,
                SERVICE_PORT,
                SERVING_ENDPOINT,
                OLD_ENDPOINT_PORT,
                UDP,
            ));
        }
        // 3 endpoints x 3 protocols x (3 Service IPs x 2 ports + the node port).
        for dnat in [SERVING_ENDPOINT, NON_SERVING_ENDPOINT, DELETED_ENDPOINT] {
            for protocol in [TCP, UDP, SCTP] {
                for destination in [CLUSTER_IP, LOAD_BALANCER_IP, EXTERNAL_IP] {
                    for port in [SERVICE_PORT, NON_SERVICE_PORT] {
                        let entry = flow(destination, port, dnat, ENDPOINT_PORT, protocol);
                        before.push(entry);
                        if !(protocol == UDP && port == SERVICE_PORT && dnat != SERVING_ENDPOINT) {
                            after.insert(entry);
                        }
                    }
                }
                let entry = flow(NODE_IP, NODE_PORT, dnat, ENDPOINT_PORT, protocol);
                before.push(entry);
                if !(protocol == UDP && dnat != SERVING_ENDPOINT) {
                    after.insert(entry);
                }
            }
        }
        // Entries that were not DNATed (no REJECT for a Service without endpoints, then):
        // the reply comes from the Service IP itself.
        for ip in [CLUSTER_IP, LOAD_BALANCER_IP, EXTERNAL_IP] {
            for port in [SERVICE_PORT, NON_SERVICE_PORT] {
                let entry = flow(ip, port, ip, port, UDP);
                before.push(entry);
                if port != SERVICE_PORT {
                    after.insert(entry);
                }
            }
        }
        assert_eq!(before.len(), 72);
        let (left, deleted) = reconcile(&state(), &before);
        assert_eq!(left, after);
        assert_eq!(deleted, 14);
    }

    #[test]
    fn service_without_endpoints() {
        let mut state = state();
        state.edit_endpoints(|_, endpoints| endpoints.clear());
        let entries = [
            flow(
                EXTERNAL_IP,
                SERVICE_PORT,
                SERVING_ENDPOINT,
                ENDPOINT_PORT,
                UDP,
            ),
            flow(
                EXTERNAL_IP,
                SERVICE_PORT,
                DELETED_ENDPOINT,
                ENDPOINT_PORT,
                UDP,
            ),
        ];
        assert!(!ServingEndpoints::of(&state).has_udp());
        assert_eq!(reconcile(&state, &entries).1, 0);
        // Only non-serving endpoints count as none.
        let mut state = self::state();
        state.edit_endpoints(|_, endpoints| endpoints.retain(|ep| !ep.serving));
        assert_eq!(reconcile(&state, &entries).1, 0);
    }

    #[test]
    fn only_the_stale_entries_of_many_go() {
        // kube-proxy's performance case, smaller: entries to every port of the external
        // IP, all DNATed to a deleted endpoint; only those to the Service port are stale.
        let mut state = ProxyState::new(IpFamily::V4);
        let udp = service("test-udp", Protocol::Udp, None);
        state.insert_endpoints(udp.name.clone(), endpoints());
        state.insert_service(udp);
        let mut entries = vec![
            flow(
                EXTERNAL_IP,
                SERVICE_PORT,
                SERVING_ENDPOINT,
                ENDPOINT_PORT,
                UDP,
            ),
            flow(
                EXTERNAL_IP,
                SERVICE_PORT,
                DELETED_ENDPOINT,
                ENDPOINT_PORT,
                UDP,
            ),
        ];
        entries.extend(
            (1..=u16::MAX)
                .map(|port| flow(EXTERNAL_IP, port, DELETED_ENDPOINT, ENDPOINT_PORT, UDP)),
        );
        let (left, deleted) = reconcile(&state, &entries);
        // The one given, and the same entry among the many.
        assert_eq!(deleted, 2);
        assert!(left.contains(&entries[0]));
    }

    #[test]
    fn terminating_endpoints_that_serve_keep_their_flows_and_proxy_mode_lb_ips_are_not_ours() {
        let mut state = state();
        state.edit_endpoints(|_, endpoints| {
            endpoints[0].ready = false;
            endpoints[0].terminating = true;
        });
        state.edit_services(|service| service.load_balancer_ingress[0].ip_mode = IpMode::Proxy);
        let entries = [
            flow(
                CLUSTER_IP,
                SERVICE_PORT,
                SERVING_ENDPOINT,
                ENDPOINT_PORT,
                UDP,
            ),
            flow(
                LOAD_BALANCER_IP,
                SERVICE_PORT,
                DELETED_ENDPOINT,
                ENDPOINT_PORT,
                UDP,
            ),
        ];
        assert_eq!(reconcile(&state, &entries).1, 0);
    }

    #[test]
    fn ipv6_entries_are_judged_alike() {
        let mut state = ProxyState::new(IpFamily::V6);
        let mut udp = service("dns", Protocol::Udp, Some(30053));
        udp.cluster_ip = Some("fd00:10:96::a".parse().unwrap());
        udp.external_ips.clear();
        udp.load_balancer_ingress.clear();
        let serving = Endpoint {
            ip: "fd00:10:244:1::5".parse().unwrap(),
            ..endpoints()[0].clone()
        };
        state.insert_endpoints(udp.name.clone(), vec![serving]);
        state.insert_service(udp);
        let v6 = |destination: &str, reply: &str| ConntrackFlow {
            protocol: UDP,
            original_destination: destination.parse().unwrap(),
            reply_source: reply.parse().unwrap(),
            replied: true,
        };
        let serving = ServingEndpoints::of(&state);
        assert!(!serving.is_stale(&v6("[fd00:10:96::a]:8000", "[fd00:10:244:1::5]:9090")));
        assert!(serving.is_stale(&v6("[fd00:10:96::a]:8000", "[fd00:10:244:1::6]:9090")));
        assert!(serving.is_stale(&v6("[fd00::1]:30053", "[fd00:10:244:1::6]:9090")));
        assert!(!serving.is_stale(&v6("[fd00::1]:30054", "[fd00:10:244:1::6]:9090")));
    }

    #[test]
    fn a_tcp_entry_is_stale_only_as_a_black_hole_of_a_served_frontend() {
        let state = state();
        let serving = ServingEndpoints::of(&state);
        assert!(serving.has_tcp());
        assert!(!ServingEndpoints::udp_of(&state).has_tcp());
        let unanswered =
            |destination: [u8; 4], port: u16, reply: [u8; 4], reply_port: u16| ConntrackFlow {
                replied: false,
                ..flow(destination, port, reply, reply_port, TCP)
            };
        // Not DNATed, never answered: every Service IP of a Service port with serving
        // endpoints.
        for (destination, port) in [
            (CLUSTER_IP, SERVICE_PORT),
            (EXTERNAL_IP, SERVICE_PORT),
            (LOAD_BALANCER_IP, SERVICE_PORT),
        ] {
            assert!(
                serving.is_stale(&unanswered(destination, port, destination, port)),
                "{destination:?}:{port}"
            );
        }
        // DNATed (even to an endpoint gone since), answered, to no Service port, or to a
        // node port (the node answers those itself): kept.
        for kept in [
            unanswered(CLUSTER_IP, SERVICE_PORT, DELETED_ENDPOINT, ENDPOINT_PORT),
            unanswered(NODE_IP, NODE_PORT, NODE_IP, NODE_PORT),
            flow(CLUSTER_IP, SERVICE_PORT, CLUSTER_IP, SERVICE_PORT, TCP),
            unanswered(CLUSTER_IP, NON_SERVICE_PORT, CLUSTER_IP, NON_SERVICE_PORT),
        ] {
            assert!(!serving.is_stale(&kept), "{kept:?}");
        }
        // A Service port without serving endpoints: its black holes wait for its first.
        let mut without = state.clone();
        without.edit_endpoints(|_, endpoints| endpoints.clear());
        assert!(!ServingEndpoints::of(&without).is_stale(&unanswered(
            CLUSTER_IP,
            SERVICE_PORT,
            CLUSTER_IP,
            SERVICE_PORT
        )));
    }
}
