//! Which UDP conntrack entries turn stale when Services and endpoints change, as
//! kube-proxy decides it. UDP has no connection end: without the deletion, a client keeps
//! sending to a removed pod (or to the REJECT of a Service that had no endpoints).

use std::collections::BTreeSet;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::model::{IpFamily, IpMode, Protocol, ProxyState, ServicePort, ServicePortName};

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
    for (name, old_service) in &previous.services {
        if old_service.protocol != Protocol::Udp {
            continue;
        }
        let Some(old_ip) = old_service.cluster_ip else {
            continue;
        };
        let new_ip = current.services.get(name).and_then(|svc| svc.cluster_ip);
        if new_ip != Some(old_ip) {
            deletions.insert(ConntrackDeletion::ServiceIp { ip: old_ip });
        }
    }
    let names: BTreeSet<&ServicePortName> = previous
        .services
        .keys()
        .chain(current.services.keys())
        .collect();
    for name in names {
        let Some(service) = current
            .services
            .get(name)
            .or_else(|| previous.services.get(name))
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
        if before.is_empty() && !after.is_empty() && current.services.contains_key(name) {
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
        .endpoints
        .get(name)
        .into_iter()
        .flatten()
        .filter(|ep| ep.serving)
        .map(|ep| (ep.ip, ep.port))
        .collect()
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
        let mut state = ProxyState::default();
        if let Some(service) = service {
            state.services.insert(service.name.clone(), service);
        }
        state.endpoints.insert(dns_name(), endpoints);
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
