//! Random cluster states for property tests: up to six Service ports with distinct names,
//! cluster IPs and node ports, and every feature the rules depend on.

use std::net::Ipv4Addr;

use proptest::prelude::*;
use tandem_common::{IpFamily, Protocol};
use tandem_proxy_rules::model::{
    Endpoint, Hints, IpMode, LoadBalancerIngress, ProxyState, ServicePort, ServicePortName,
};

pub fn protocol() -> impl Strategy<Value = Protocol> {
    prop_oneof![
        Just(Protocol::Tcp),
        Just(Protocol::Udp),
        Just(Protocol::Sctp)
    ]
}

pub fn endpoint() -> impl Strategy<Value = Endpoint> {
    (
        1u8..3,
        1u8..6,
        prop_oneof![Just(80u16), Just(81)],
        prop::bool::weighted(0.8),
        prop::bool::weighted(0.7),
        prop::bool::weighted(0.1),
        0usize..3,
        // Topology hints: none mostly, else for one of two zones, some with node hints.
        0usize..6,
    )
        .prop_map(
            |(subnet, host, port, ready, serving, terminating, node, hints)| Endpoint {
                ip: Ipv4Addr::new(10, 244, subnet, host).into(),
                port,
                ready,
                serving,
                terminating,
                node_name: [Some("node-a".to_owned()), Some("node-b".to_owned()), None][node]
                    .clone(),
                hints: match hints {
                    0..=2 => None,
                    3 => Hints::of(["zone-a"], Vec::<String>::new()),
                    4 => Hints::of(["zone-b"], Vec::<String>::new()),
                    _ => Hints::of(["zone-a"], ["node-a"]),
                },
            },
        )
}

/// A Service port and its endpoints; identity fields are filled in by [`state`].
pub fn service() -> impl Strategy<Value = (ServicePort, Vec<Endpoint>)> {
    let ingress = (1u8..4, prop::bool::weighted(0.8)).prop_map(|(host, vip)| LoadBalancerIngress {
        ip: Ipv4Addr::new(198, 51, 100, host).into(),
        ip_mode: if vip { IpMode::Vip } else { IpMode::Proxy },
    });
    let ranges = prop::collection::vec(
        // The last holds node-a's IP (allowFromNode).
        prop_oneof![
            Just("203.0.113.0/24"),
            Just("192.0.2.128/25"),
            Just("198.18.0.0/24")
        ],
        0..3,
    );
    (
        (
            protocol(),
            prop::bool::weighted(0.9),
            prop::option::of(Just(())),
            prop::collection::vec(1u8..3, 0..3),
        ),
        (
            prop::collection::vec(ingress, 0..3),
            ranges,
            prop::option::of(1u32..20_000),
            any::<bool>(),
            any::<bool>(),
        ),
        prop::collection::vec(endpoint(), 0..6),
    )
        .prop_map(
            |(
                (protocol, has_cluster_ip, node_port, external),
                (ingress, ranges, affinity, local, internal_local),
                endpoints,
            )| {
                let service = ServicePort {
                    name: super::port_name("ns", "placeholder", ""),
                    protocol,
                    cluster_ip: has_cluster_ip.then_some(Ipv4Addr::UNSPECIFIED.into()),
                    port: 0,
                    node_port: node_port.map(|()| 0),
                    external_ips: external
                        .into_iter()
                        .map(|h| Ipv4Addr::new(192, 0, 2, h).into())
                        .collect(),
                    load_balancer_ingress: ingress,
                    load_balancer_source_ranges: ranges
                        .into_iter()
                        .map(|r| r.parse().unwrap())
                        .collect(),
                    session_affinity_timeout: affinity,
                    external_traffic_policy_local: local,
                    health_check_node_port: local.then_some(0),
                    internal_traffic_policy_local: internal_local,
                };
                (service, endpoints)
            },
        )
}

pub const MAX_PORTS: usize = 6;

/// The name of the i-th generated Service port.
pub fn port_name(i: usize) -> ServicePortName {
    ServicePortName {
        namespace: ["a", "b"][i % 2].into(),
        name: format!("svc{}", i / 2),
        port: if i.is_multiple_of(3) {
            String::new()
        } else {
            format!("p{i}")
        },
    }
}

/// Up to six Service ports with distinct names, cluster IPs and ports.
pub fn state() -> impl Strategy<Value = ProxyState> {
    let port = (service(), prop::bool::weighted(0.3));
    prop::collection::vec(port, 0..MAX_PORTS).prop_map(|services| {
        let mut state = ProxyState::new(IpFamily::V4);
        for (i, ((mut service, endpoints), common_port)) in services.into_iter().enumerate() {
            let index = u8::try_from(i).unwrap();
            let index16 = u16::from(index);
            service.name = port_name(i);
            service.cluster_ip = service
                .cluster_ip
                .map(|_| Ipv4Addr::new(10, 96, 0, 10 + index).into());
            // Ports in common make Services that list the same external or LB IP
            // compete for it, as a misconfigured cluster can.
            service.port = if common_port { 8000 } else { 8000 + index16 };
            service.node_port = service.node_port.map(|_| 30000 + index16);
            service.health_check_node_port =
                service.health_check_node_port.map(|_| 32000 + index16);
            state.insert_endpoints(service.name.clone(), endpoints);
            state.insert_service(service);
        }
        state
    })
}
