//! Shared fixtures: the reference API state and small builders for scenario states.
#![allow(dead_code)] // each test binary uses a different subset

use std::net::IpAddr;

pub mod generate;
pub mod netns;

use tandem_common::{IpFamily, Protocol};
use tandem_proxy_rules::model::{
    Endpoint, IpMode, LoadBalancerIngress, NodeConfig, NodePortAddresses, ProxyState, ServicePort,
    ServicePortName,
};

/// An address of either family.
pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

pub fn port_name(namespace: &str, name: &str, port: &str) -> ServicePortName {
    ServicePortName {
        namespace: namespace.into(),
        name: name.into(),
        port: port.into(),
    }
}

/// A ClusterIP Service port with nothing else set.
pub fn cluster_ip_service(
    name: ServicePortName,
    protocol: Protocol,
    cluster_ip: &str,
    port: u16,
) -> ServicePort {
    ServicePort {
        name,
        protocol,
        cluster_ip: Some(ip(cluster_ip)),
        port,
        node_port: None,
        external_ips: vec![],
        load_balancer_ingress: vec![],
        load_balancer_source_ranges: vec![],
        session_affinity_timeout: None,
        external_traffic_policy_local: false,
        health_check_node_port: None,
        internal_traffic_policy_local: false,
    }
}

pub fn vip(ip: &str) -> LoadBalancerIngress {
    LoadBalancerIngress {
        ip: self::ip(ip),
        ip_mode: IpMode::Vip,
    }
}

pub fn ready(ip: &str, port: u16, node: &str) -> Endpoint {
    Endpoint {
        ip: self::ip(ip),
        port,
        ready: true,
        serving: true,
        terminating: false,
        node_name: Some(node.into()),
        hints: None,
    }
}

/// node-a, in zone `zone-a` (which the generated endpoints' hints name, beside `zone-b`).
pub fn node_a() -> NodeConfig {
    NodeConfig {
        zone: Some("zone-a".to_owned()),
        ..NodeConfig::new("node-a", Some("10.244.0.0/16".parse().unwrap()))
    }
}

/// node-a (198.18.0.11, inside the source range 198.18.0.0/24 some tests' Services
/// have) with every flag both modes share: `--masquerade-all`, `--nodeport-addresses
/// 198.18.0.0/24`, `--iptables-localhost-nodeports=false`, and the Service CIDR
/// 10.96.0.0/16.
pub fn node_with_flags() -> NodeConfig {
    NodeConfig {
        node_ip: Some(ip("198.18.0.11")),
        masquerade_all: true,
        node_port_addresses: NodePortAddresses::from_cidrs(&["198.18.0.0/24".parse().unwrap()]),
        localhost_node_ports: false,
        service_cidrs: vec!["10.96.0.0/16".parse().unwrap()],
        ..node_a()
    }
}

/// The IPv4 state of these Service ports and endpoints.
pub fn state_of(
    services: Vec<ServicePort>,
    endpoints: Vec<(ServicePortName, Vec<Endpoint>)>,
) -> ProxyState {
    ProxyState::from_entries(IpFamily::V4, services, endpoints)
}

pub fn nginx_http() -> ServicePortName {
    port_name("default", "nginx-service", "http")
}

/// The API state the reference dump was made from (`tests/data/REFERENCE-README.md`).
pub fn reference_state() -> ProxyState {
    let kubernetes = cluster_ip_service(
        port_name("default", "kubernetes", "https"),
        Protocol::Tcp,
        "10.43.0.1",
        443,
    );
    let nginx = ServicePort {
        node_port: Some(30166),
        load_balancer_ingress: vec![vip("198.51.100.20")],
        load_balancer_source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
        ..cluster_ip_service(nginx_http(), Protocol::Tcp, "10.43.35.197", 80)
    };
    state_of(
        vec![kubernetes, nginx],
        vec![(
            nginx_http(),
            vec![
                ready("10.244.1.5", 80, "node-a"),
                ready("10.244.2.7", 80, "node-b"),
            ],
        )],
    )
}

/// The reference dump: kube-proxy v1.21.2's own rules for [`reference_state`]
/// (`tests/data/`, with a README on how it was made).
pub const REFERENCE_DUMP: &str =
    include_str!("../data/kube-proxy-v1.21-loadbalancer-sourceranges.iptables");

/// kube-proxy v1.21.2's `ip6tables` rules for the dual-stack reference state
/// ([`dual_stack_reference_state_v6`] is its IPv6 half).
pub const REFERENCE_DUMP_DUAL_STACK_V6: &str =
    include_str!("../data/kube-proxy-v1.21-dualstack.ip6tables");

/// Named states covering every feature; snapshot, trace and kernel tests share them.
pub fn scenarios() -> Vec<(&'static str, ProxyState)> {
    vec![
        ("reference", reference_state()),
        ("nodeport", nodeport_state()),
        ("lb_open", lb_open_state()),
        ("etp_local", etp_local_state(true)),
        ("etp_local_no_local_endpoints", etp_local_state(false)),
        ("affinity", affinity_state()),
        ("no_endpoints", no_endpoints_state()),
        ("external_ips", external_ips_state()),
        ("udp", udp_state()),
        ("multi_port", multi_port_state()),
        ("sctp", sctp_state()),
        ("itp_local", itp_local_state()),
    ]
}

pub fn web() -> ServicePortName {
    port_name("s1", "web", "")
}

/// NodePort Service, unnamed port, three endpoints (one on this node).
pub fn nodeport_state() -> ProxyState {
    let svc = ServicePort {
        node_port: Some(30080),
        ..cluster_ip_service(web(), Protocol::Tcp, "10.96.0.10", 80)
    };
    state_of(
        vec![svc],
        vec![(
            web(),
            vec![
                ready("10.244.1.5", 8080, "node-a"),
                ready("10.244.2.7", 8080, "node-b"),
                ready("10.244.2.8", 8080, "node-b"),
            ],
        )],
    )
}

pub fn open_lb() -> ServicePortName {
    port_name("s1", "open", "http")
}

/// LoadBalancer without source ranges.
pub fn lb_open_state() -> ProxyState {
    let svc = ServicePort {
        node_port: Some(30081),
        load_balancer_ingress: vec![vip("198.51.100.10")],
        ..cluster_ip_service(open_lb(), Protocol::Tcp, "10.96.0.11", 80)
    };
    state_of(
        vec![svc],
        vec![(
            open_lb(),
            vec![
                ready("10.244.1.5", 80, "node-a"),
                ready("10.244.2.7", 80, "node-b"),
            ],
        )],
    )
}

pub fn local_lb() -> ServicePortName {
    port_name("s2", "local", "http")
}

/// externalTrafficPolicy Local with source ranges; with or without endpoints on node-a.
pub fn etp_local_state(with_local_endpoints: bool) -> ProxyState {
    let svc = ServicePort {
        node_port: Some(30082),
        load_balancer_ingress: vec![vip("198.51.100.11")],
        load_balancer_source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
        external_traffic_policy_local: true,
        health_check_node_port: Some(32000),
        ..cluster_ip_service(local_lb(), Protocol::Tcp, "10.96.0.12", 80)
    };
    let mut endpoints = vec![ready("10.244.2.7", 80, "node-b")];
    if with_local_endpoints {
        endpoints.extend([
            ready("10.244.1.5", 80, "node-a"),
            ready("10.244.1.6", 80, "node-a"),
        ]);
    }
    state_of(vec![svc], vec![(local_lb(), endpoints)])
}

pub fn sticky() -> ServicePortName {
    port_name("s3", "sticky", "http")
}

/// sessionAffinity ClientIP (timeout 10800 s) on a LoadBalancer Service.
pub fn affinity_state() -> ProxyState {
    let svc = ServicePort {
        node_port: Some(30083),
        load_balancer_ingress: vec![vip("198.51.100.12")],
        session_affinity_timeout: Some(10800),
        ..cluster_ip_service(sticky(), Protocol::Tcp, "10.96.0.13", 80)
    };
    state_of(
        vec![svc],
        vec![(
            sticky(),
            vec![
                ready("10.244.1.5", 80, "node-a"),
                ready("10.244.2.7", 80, "node-b"),
            ],
        )],
    )
}

pub fn empty() -> ServicePortName {
    port_name("s4", "empty", "http")
}

/// A LoadBalancer Service whose only endpoints are not ready or terminating.
pub fn no_endpoints_state() -> ProxyState {
    let svc = ServicePort {
        node_port: Some(30084),
        external_ips: vec![ip("192.0.2.50")],
        load_balancer_ingress: vec![vip("198.51.100.13")],
        ..cluster_ip_service(empty(), Protocol::Tcp, "10.96.0.14", 80)
    };
    let not_ready = Endpoint {
        ready: false,
        ..ready("10.244.1.5", 80, "node-a")
    };
    // Terminating and no longer serving: not even the KEP-1669 fallback uses it.
    let terminating = Endpoint {
        ready: false,
        serving: false,
        terminating: true,
        ..ready("10.244.2.7", 80, "node-b")
    };
    state_of(vec![svc], vec![(empty(), vec![not_ready, terminating])])
}

pub fn ext() -> ServicePortName {
    port_name("s5", "ext", "http")
}

/// externalIPs on a ClusterIP Service.
pub fn external_ips_state() -> ProxyState {
    let svc = ServicePort {
        external_ips: vec![ip("192.0.2.10"), ip("192.0.2.11")],
        ..cluster_ip_service(ext(), Protocol::Tcp, "10.96.0.15", 8080)
    };
    state_of(
        vec![svc],
        vec![(ext(), vec![ready("10.244.1.5", 80, "node-a")])],
    )
}

pub fn dns() -> ServicePortName {
    port_name("kube-system", "dns", "dns")
}

/// UDP NodePort Service.
pub fn udp_state() -> ProxyState {
    let svc = ServicePort {
        node_port: Some(30053),
        ..cluster_ip_service(dns(), Protocol::Udp, "10.96.0.53", 53)
    };
    state_of(
        vec![svc],
        vec![(
            dns(),
            vec![
                ready("10.244.1.9", 5353, "node-a"),
                ready("10.244.2.9", 5353, "node-b"),
            ],
        )],
    )
}

pub fn multi_http() -> ServicePortName {
    port_name("s6", "multi", "http")
}

pub fn multi_https() -> ServicePortName {
    port_name("s6", "multi", "https")
}

/// One LoadBalancer Service with two ports (different target ports).
pub fn multi_port_state() -> ProxyState {
    let base = ServicePort {
        load_balancer_ingress: vec![vip("198.51.100.14")],
        ..cluster_ip_service(multi_http(), Protocol::Tcp, "10.96.0.16", 80)
    };
    let http = ServicePort {
        node_port: Some(30085),
        ..base.clone()
    };
    let https = ServicePort {
        name: multi_https(),
        port: 443,
        node_port: Some(30086),
        ..base
    };
    state_of(
        vec![http, https],
        vec![
            (
                multi_http(),
                vec![
                    ready("10.244.1.5", 8080, "node-a"),
                    ready("10.244.2.7", 8080, "node-b"),
                ],
            ),
            (
                multi_https(),
                vec![
                    ready("10.244.1.5", 8443, "node-a"),
                    ready("10.244.2.7", 8443, "node-b"),
                ],
            ),
        ],
    )
}

pub fn sig() -> ServicePortName {
    port_name("s7", "sig", "sctp")
}

/// SCTP ClusterIP Service.
pub fn sctp_state() -> ProxyState {
    let svc = cluster_ip_service(sig(), Protocol::Sctp, "10.96.0.17", 3868);
    state_of(
        vec![svc],
        vec![(sig(), vec![ready("10.244.1.5", 3868, "node-a")])],
    )
}

pub fn itp_lb() -> ServicePortName {
    port_name("s8", "itp-lb", "http")
}

pub fn itp_remote() -> ServicePortName {
    port_name("s8", "itp-remote", "")
}

pub fn itp_rolling() -> ServicePortName {
    port_name("s8", "itp-rolling", "")
}

/// internalTrafficPolicy Local on node-a: a LoadBalancer Service with endpoints on both
/// nodes (its external paths stay Cluster), a ClusterIP Service whose only endpoint is on
/// node-b, and one whose only local endpoint is terminating while node-b has a ready one.
pub fn itp_local_state() -> ProxyState {
    let itp_local = |name, cluster_ip| ServicePort {
        internal_traffic_policy_local: true,
        ..cluster_ip_service(name, Protocol::Tcp, cluster_ip, 80)
    };
    let lb = ServicePort {
        node_port: Some(30087),
        load_balancer_ingress: vec![vip("198.51.100.15")],
        ..itp_local(itp_lb(), "10.96.0.18")
    };
    let terminating = Endpoint {
        ready: false,
        terminating: true,
        ..ready("10.244.1.9", 80, "node-a")
    };
    state_of(
        vec![
            lb,
            itp_local(itp_remote(), "10.96.0.19"),
            itp_local(itp_rolling(), "10.96.0.20"),
        ],
        vec![
            (
                itp_lb(),
                vec![
                    ready("10.244.1.5", 80, "node-a"),
                    ready("10.244.2.7", 80, "node-b"),
                ],
            ),
            (itp_remote(), vec![ready("10.244.2.8", 80, "node-b")]),
            (
                itp_rolling(),
                vec![terminating, ready("10.244.2.9", 80, "node-b")],
            ),
        ],
    )
}

/// The IPv6 proxier's view of the dual-stack reference state
/// (`tests/data/REFERENCE-README.md`): the IPv6 cluster IPs, ingress IPs, source ranges
/// and EndpointSlices; `default/kubernetes` is IPv4 only.
pub fn dual_stack_reference_state_v6() -> ProxyState {
    let nginx = ServicePort {
        node_port: Some(30166),
        load_balancer_ingress: vec![vip("2001:db8:51:100::20")],
        load_balancer_source_ranges: vec!["2001:db8:203::/64".parse().unwrap()],
        ..cluster_ip_service(nginx_http(), Protocol::Tcp, "fd00:10:96::197", 80)
    };
    let echo_http = port_name("default", "echo-v6", "http");
    let echo = ServicePort {
        node_port: Some(30380),
        load_balancer_ingress: vec![vip("2001:db8:51:100::21")],
        external_traffic_policy_local: true,
        health_check_node_port: Some(30381),
        ..cluster_ip_service(echo_http.clone(), Protocol::Tcp, "fd00:10:96::80", 80)
    };
    let empty = ServicePort {
        node_port: Some(30480),
        load_balancer_ingress: vec![vip("2001:db8:51:100::22")],
        ..cluster_ip_service(
            port_name("default", "empty-v6", "http"),
            Protocol::Tcp,
            "fd00:10:96::81",
            80,
        )
    };
    ProxyState::from_entries(
        IpFamily::V6,
        vec![nginx, echo, empty],
        vec![
            (
                nginx_http(),
                vec![
                    ready("fd00:10:244:1::5", 80, "node-a"),
                    ready("fd00:10:244:2::7", 80, "node-b"),
                ],
            ),
            (
                echo_http,
                vec![
                    ready("fd00:10:244:1::8", 8080, "node-a"),
                    ready("fd00:10:244:2::9", 8080, "node-b"),
                ],
            ),
        ],
    )
}

/// node-a's IPv6 proxier in the dual-stack reference: `--cluster-cidr`'s IPv6 half.
pub fn node_a_v6() -> NodeConfig {
    NodeConfig {
        family: IpFamily::V6,
        node_ip: Some(ip("2001:db8:18::11")),
        ..NodeConfig::new("node-a", Some("fd00:10:244::/56".parse().unwrap()))
    }
}
