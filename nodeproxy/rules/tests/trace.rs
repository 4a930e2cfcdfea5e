//! The tracer over the rules of every scenario: where a packet goes on node-a
//! (198.18.0.11, pods 10.244.1.0/24) and what becomes of it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;

use common::ip;
use tandem_common::Protocol;
use tandem_proxy_rules::build;
use tandem_proxy_rules::chains::endpoint_chain;
use tandem_proxy_rules::model::{IpMode, ProxyState};
use tandem_proxy_rules::ruleset::Table;
use tandem_proxy_rules::trace::{Entry, Hop, Packet, Route, Trace, TraceRequest, Verdict, trace};

const NODE_IP: &str = "198.18.0.11";
const ALLOWED_CLIENT: &str = "203.0.113.7";
const DISALLOWED_CLIENT: &str = "192.0.2.99";
const POD_ON_NODE: &str = "10.244.1.20";

fn tcp(src: &str, dst: &str, port: u16) -> Packet {
    Packet {
        src: ip(src),
        dst: ip(dst),
        protocol: Protocol::Tcp,
        dst_port: port,
    }
}

fn run(state: &ProxyState, packet: Packet, entry: Entry, local: &[&str]) -> Trace {
    let request = TraceRequest::new(packet, entry, local.iter().map(|a| ip(a)));
    trace(&build(state, &common::node_a()), &request).unwrap()
}

fn from_outside(state: &ProxyState, packet: Packet) -> Trace {
    run(state, packet, Entry::FromOutside, &[NODE_IP])
}

fn dnat_targets(trace: &Trace) -> BTreeSet<String> {
    trace
        .outcomes
        .iter()
        .map(|o| o.dnat.expect("DNATed").to_string())
        .collect()
}

fn walked_chains(trace: &Trace, outcome: usize) -> Vec<String> {
    trace.outcomes[outcome]
        .hops
        .iter()
        .filter_map(|hop| match hop {
            Hop::Rule { table, chain, .. } => Some(format!("{}/{chain}", table.as_str())),
            Hop::Route { .. } => None,
        })
        .collect()
}

fn assert_total_probability(trace: &Trace) {
    let total: f64 = trace.outcomes.iter().map(|o| o.probability).sum();
    assert!(
        (total - 1.0).abs() < 1e-6,
        "probabilities sum to {total}\n{trace}"
    );
}

#[test]
fn allowed_source_to_lb_ip_is_dnated_to_both_endpoints_and_masqueraded() {
    let traced = from_outside(
        &common::reference_state(),
        tcp(ALLOWED_CLIENT, "198.51.100.20", 80),
    );
    assert_eq!(traced.outcomes.len(), 2, "{traced}");
    assert_total_probability(&traced);
    assert_eq!(
        dnat_targets(&traced),
        BTreeSet::from(["10.244.1.5:80".into(), "10.244.2.7:80".into()])
    );
    for (i, outcome) in traced.outcomes.iter().enumerate() {
        assert!((outcome.probability - 0.5).abs() < 1e-9);
        assert!(outcome.masqueraded, "{traced}");
        assert_eq!(outcome.route, Route::Forward);
        assert_eq!(
            outcome.verdict,
            Verdict::Accept {
                table: Table::Filter,
                chain: "KUBE-FORWARD".into()
            }
        );
        let chains = walked_chains(&traced, i);
        for expected in [
            "nat/KUBE-SERVICES",
            "nat/KUBE-FW-6IM33IEVEEV7U3GP",
            "nat/KUBE-MARK-MASQ",
            "nat/KUBE-SVC-6IM33IEVEEV7U3GP",
            "nat/KUBE-POSTROUTING",
        ] {
            assert!(
                chains.iter().any(|c| c == expected),
                "{expected} not walked:\n{traced}"
            );
        }
    }
}

#[test]
fn disallowed_source_to_non_local_lb_ip_is_dropped_in_forward() {
    let traced = from_outside(
        &common::reference_state(),
        tcp(DISALLOWED_CLIENT, "198.51.100.20", 80),
    );
    assert_eq!(traced.outcomes.len(), 1, "{traced}");
    let outcome = &traced.outcomes[0];
    assert_eq!(outcome.dnat, None);
    assert_eq!(outcome.route, Route::Forward);
    assert_eq!(
        outcome.verdict,
        Verdict::Drop {
            table: Table::Filter,
            chain: "KUBE-PROXY-FIREWALL".into()
        }
    );
    let chains = walked_chains(&traced, 0);
    assert!(
        chains.contains(&"nat/KUBE-MARK-DROP".to_owned()),
        "{traced}"
    );
    assert!(chains.contains(&"filter/FORWARD".to_owned()), "{traced}");
    assert!(!chains.iter().any(|c| c.contains("KUBE-SVC-")), "{traced}");
}

#[test]
fn disallowed_source_to_local_lb_ip_is_dropped_in_input() {
    let traced = run(
        &common::reference_state(),
        tcp(DISALLOWED_CLIENT, "198.51.100.20", 80),
        Entry::FromOutside,
        &[NODE_IP, "198.51.100.20"],
    );
    let outcome = &traced.outcomes[0];
    assert_eq!(outcome.route, Route::LocalDelivery);
    assert_eq!(
        outcome.verdict,
        Verdict::Drop {
            table: Table::Filter,
            chain: "KUBE-PROXY-FIREWALL".into()
        }
    );
    assert!(walked_chains(&traced, 0).contains(&"filter/INPUT".to_owned()));
}

#[test]
fn node_port_spreads_over_all_endpoints_with_snat() {
    let traced = from_outside(
        &common::nodeport_state(),
        tcp(ALLOWED_CLIENT, NODE_IP, 30080),
    );
    assert_eq!(traced.outcomes.len(), 3, "{traced}");
    assert_total_probability(&traced);
    for outcome in &traced.outcomes {
        assert!((outcome.probability - 1.0 / 3.0).abs() < 1e-6, "{traced}");
        assert!(outcome.masqueraded);
        assert_eq!(outcome.route, Route::Forward);
    }
    assert!(walked_chains(&traced, 0).contains(&"nat/KUBE-NODEPORTS".to_owned()));
    // Not a node address: no node port.
    let elsewhere = from_outside(
        &common::nodeport_state(),
        tcp(ALLOWED_CLIENT, "198.18.0.99", 30080),
    );
    assert_eq!(elsewhere.outcomes[0].dnat, None);
}

#[test]
fn cluster_ip_masquerades_only_off_cluster_sources() {
    let state = common::nodeport_state();
    let from_pod = from_outside(&state, tcp(POD_ON_NODE, "10.96.0.10", 80));
    assert!(
        from_pod
            .outcomes
            .iter()
            .all(|o| !o.masqueraded && o.dnat.is_some()),
        "{from_pod}"
    );
    let from_other_node = from_outside(&state, tcp("198.18.0.12", "10.96.0.10", 80));
    assert!(
        from_other_node.outcomes.iter().all(|o| o.masqueraded),
        "{from_other_node}"
    );
    let wrong_port = from_outside(&state, tcp(POD_ON_NODE, "10.96.0.10", 81));
    assert_eq!(wrong_port.outcomes[0].dnat, None);
}

#[test]
fn host_process_to_cluster_ip_goes_through_nat_output() {
    let traced = run(
        &common::nodeport_state(),
        tcp(NODE_IP, "10.96.0.10", 80),
        Entry::Local,
        &[NODE_IP],
    );
    assert_eq!(traced.outcomes.len(), 3);
    assert!(traced.outcomes.iter().all(|o| o.masqueraded), "{traced}");
    assert!(walked_chains(&traced, 0).contains(&"nat/OUTPUT".to_owned()));
}

#[test]
fn lb_without_source_ranges_lets_everyone_through() {
    let traced = from_outside(
        &common::lb_open_state(),
        tcp(DISALLOWED_CLIENT, "198.51.100.10", 80),
    );
    assert_eq!(traced.outcomes.len(), 2, "{traced}");
    assert!(
        traced
            .outcomes
            .iter()
            .all(|o| o.masqueraded && o.dnat.is_some())
    );
}

#[test]
fn lb_ip_in_proxy_mode_is_not_short_cut() {
    let mut state = common::lb_open_state();
    state.edit_services(|svc| svc.load_balancer_ingress[0].ip_mode = IpMode::Proxy);
    let traced = from_outside(&state, tcp(ALLOWED_CLIENT, "198.51.100.10", 80));
    assert_eq!(traced.outcomes.len(), 1);
    assert_eq!(traced.outcomes[0].dnat, None);
    assert_eq!(traced.outcomes[0].verdict, Verdict::Pass);
}

#[test]
fn external_traffic_policy_local_keeps_the_client_ip_and_stays_on_node() {
    let state = common::etp_local_state(true);
    for packet in [
        tcp(ALLOWED_CLIENT, "198.51.100.11", 80),
        tcp(ALLOWED_CLIENT, NODE_IP, 30082),
    ] {
        let traced = from_outside(&state, packet);
        assert_total_probability(&traced);
        assert_eq!(
            dnat_targets(&traced),
            BTreeSet::from(["10.244.1.5:80".into(), "10.244.1.6:80".into()]),
            "{traced}"
        );
        assert!(traced.outcomes.iter().all(|o| !o.masqueraded), "{traced}");
    }
    // Pods short-cut to the Service chain: all endpoints, including the remote one.
    let from_pod = from_outside(&state, tcp(POD_ON_NODE, NODE_IP, 30082));
    assert_eq!(dnat_targets(&from_pod).len(), 3, "{from_pod}");
    // The health-check node port is accepted.
    let health = from_outside(&state, tcp(ALLOWED_CLIENT, NODE_IP, 32000));
    assert_eq!(
        health.outcomes[0].verdict,
        Verdict::Accept {
            table: Table::Filter,
            chain: "KUBE-NODEPORTS".into()
        }
    );
}

#[test]
fn external_traffic_policy_local_without_local_endpoints_drops() {
    let state = common::etp_local_state(false);
    for packet in [
        tcp(ALLOWED_CLIENT, "198.51.100.11", 80),
        tcp(ALLOWED_CLIENT, NODE_IP, 30082),
    ] {
        let traced = from_outside(&state, packet);
        assert_eq!(traced.outcomes.len(), 1, "{traced}");
        assert_eq!(
            traced.outcomes[0].verdict,
            Verdict::Drop {
                table: Table::Filter,
                chain: "KUBE-PROXY-FIREWALL".into()
            }
        );
        assert!(
            traced.to_string().contains("has no local endpoints"),
            "{traced}"
        );
    }
}

#[test]
fn session_affinity_pins_a_known_client() {
    let state = common::affinity_state();
    let packet = tcp(ALLOWED_CLIENT, "198.51.100.12", 80);
    assert_eq!(from_outside(&state, packet).outcomes.len(), 2);
    let pinned: SocketAddr = "10.244.2.7:80".parse().unwrap();
    let mut request = TraceRequest::new(packet, Entry::FromOutside, [ip(NODE_IP)]);
    request
        .recent_lists
        .insert(endpoint_chain(&common::sticky(), Protocol::Tcp, pinned));
    let traced = trace(&build(&state, &common::node_a()), &request).unwrap();
    assert_eq!(traced.outcomes.len(), 1, "{traced}");
    assert_eq!(traced.outcomes[0].dnat, Some(pinned));
    assert!((traced.outcomes[0].probability - 1.0).abs() < 1e-12);
}

#[test]
fn services_without_endpoints_reject_everywhere() {
    let state = common::no_endpoints_state();
    let cases = [
        (tcp(POD_ON_NODE, "10.96.0.14", 80), "KUBE-SERVICES"),
        (
            tcp(ALLOWED_CLIENT, NODE_IP, 30084),
            "KUBE-EXTERNAL-SERVICES",
        ),
        (
            tcp(ALLOWED_CLIENT, "198.51.100.13", 80),
            "KUBE-EXTERNAL-SERVICES",
        ),
        (
            tcp(ALLOWED_CLIENT, "192.0.2.50", 80),
            "KUBE-EXTERNAL-SERVICES",
        ),
    ];
    for (packet, chain) in cases {
        let traced = from_outside(&state, packet);
        assert_eq!(traced.outcomes.len(), 1);
        assert_eq!(
            traced.outcomes[0].verdict,
            Verdict::Reject {
                table: Table::Filter,
                chain: chain.into()
            },
            "{traced}"
        );
    }
}

#[test]
fn external_ips_are_dnated_and_masqueraded() {
    let traced = from_outside(
        &common::external_ips_state(),
        tcp(ALLOWED_CLIENT, "192.0.2.11", 8080),
    );
    assert_eq!(
        dnat_targets(&traced),
        BTreeSet::from(["10.244.1.5:80".into()])
    );
    assert!(traced.outcomes[0].masqueraded);
}

#[test]
fn udp_and_sctp_match_their_own_protocol_only() {
    let udp = Packet {
        protocol: Protocol::Udp,
        ..tcp(POD_ON_NODE, "10.96.0.53", 53)
    };
    let traced = from_outside(&common::udp_state(), udp);
    assert_eq!(
        dnat_targets(&traced),
        BTreeSet::from(["10.244.1.9:5353".into(), "10.244.2.9:5353".into()])
    );
    let not_udp = from_outside(&common::udp_state(), tcp(POD_ON_NODE, "10.96.0.53", 53));
    assert_eq!(not_udp.outcomes[0].dnat, None);
    let sctp = Packet {
        protocol: Protocol::Sctp,
        ..tcp(POD_ON_NODE, "10.96.0.17", 3868)
    };
    assert_eq!(
        dnat_targets(&from_outside(&common::sctp_state(), sctp)),
        BTreeSet::from(["10.244.1.5:3868".into()])
    );
}

#[test]
fn each_port_of_a_multi_port_service_has_its_own_endpoints() {
    let state = common::multi_port_state();
    let https = from_outside(&state, tcp(ALLOWED_CLIENT, "198.51.100.14", 443));
    assert_eq!(
        dnat_targets(&https),
        BTreeSet::from(["10.244.1.5:8443".into(), "10.244.2.7:8443".into()])
    );
    let http = from_outside(&state, tcp(ALLOWED_CLIENT, NODE_IP, 30085));
    assert_eq!(
        dnat_targets(&http),
        BTreeSet::from(["10.244.1.5:8080".into(), "10.244.2.7:8080".into()])
    );
}

#[test]
fn trace_serializes_and_displays() {
    let traced = from_outside(
        &common::reference_state(),
        tcp(DISALLOWED_CLIENT, "198.51.100.20", 80),
    );
    let json = serde_json::to_value(&traced).unwrap();
    assert_eq!(json["outcomes"][0]["verdict"]["kind"], "drop");
    assert_eq!(
        json["outcomes"][0]["verdict"]["chain"],
        "KUBE-PROXY-FIREWALL"
    );
    let back: Trace = serde_json::from_value(json).unwrap();
    assert_eq!(back, traced);
    let text = traced.to_string();
    assert!(
        text.starts_with("192.0.2.99 -> 198.51.100.20:80/tcp (from outside)\n"),
        "{text}"
    );
    assert!(
        text.contains("DROP by filter KUBE-PROXY-FIREWALL"),
        "{text}"
    );
    assert!(text.contains("  nat KUBE-FW-6IM33IEVEEV7U3GP: -m comment --comment \"default/nginx-service:http loadbalancer IP\" -j KUBE-MARK-DROP"), "{text}");
}

#[test]
fn readable_trace_of_the_reference_lb() {
    let state = common::reference_state();
    let allowed = from_outside(&state, tcp(ALLOWED_CLIENT, "198.51.100.20", 80));
    let disallowed = from_outside(&state, tcp(DISALLOWED_CLIENT, "198.51.100.20", 80));
    insta::assert_snapshot!("trace_reference_lb", format!("{allowed}\n{disallowed}"));
}

#[test]
fn host_process_to_its_own_port_loops_back_through_input() {
    let state = common::etp_local_state(true);
    let health = run(
        &state,
        tcp(NODE_IP, NODE_IP, 32000),
        Entry::Local,
        &[NODE_IP],
    );
    assert_eq!(health.outcomes.len(), 1);
    let outcome = &health.outcomes[0];
    assert_eq!(outcome.route, Route::LocalDelivery);
    assert_eq!(
        outcome.verdict,
        Verdict::Accept {
            table: Table::Filter,
            chain: "KUBE-NODEPORTS".into()
        },
        "{health}"
    );
    let chains = walked_chains(&health, 0);
    assert!(chains.contains(&"filter/OUTPUT".to_owned()), "{health}");
    assert!(chains.contains(&"filter/INPUT".to_owned()), "{health}");
    // The node's own node-port traffic (ETP Local) is masqueraded from loopback only.
    let node_port = run(
        &state,
        tcp("127.0.0.1", "127.0.0.1", 30082),
        Entry::Local,
        &[NODE_IP],
    );
    assert!(
        node_port
            .outcomes
            .iter()
            .all(|o| o.masqueraded && o.dnat.is_some()),
        "{node_port}"
    );
}

#[test]
fn internal_traffic_policy_local_keeps_cluster_ip_traffic_on_the_node() {
    let state = common::itp_local_state();
    // From a pod and from the node itself: only the local endpoint, through KUBE-SVL.
    let from_pod = from_outside(&state, tcp(POD_ON_NODE, "10.96.0.18", 80));
    let from_node = run(
        &state,
        tcp(NODE_IP, "10.96.0.18", 80),
        Entry::Local,
        &[NODE_IP],
    );
    for traced in [&from_pod, &from_node] {
        assert_eq!(
            dnat_targets(traced),
            BTreeSet::from(["10.244.1.5:80".into()]),
            "{traced}"
        );
        assert!(
            walked_chains(traced, 0)
                .iter()
                .any(|chain| chain.starts_with("nat/KUBE-SVL-")),
            "{traced}"
        );
    }
    assert!(!from_pod.outcomes[0].masqueraded, "{from_pod}");
    // An off-cluster client routed to the cluster IP is masqueraded, as for KUBE-SVC.
    let off_cluster = from_outside(&state, tcp(ALLOWED_CLIENT, "10.96.0.18", 80));
    assert_eq!(dnat_targets(&off_cluster).len(), 1, "{off_cluster}");
    assert!(off_cluster.outcomes[0].masqueraded, "{off_cluster}");
    // The external paths keep externalTrafficPolicy Cluster: every endpoint.
    for packet in [
        tcp(ALLOWED_CLIENT, "198.51.100.15", 80),
        tcp(ALLOWED_CLIENT, NODE_IP, 30087),
    ] {
        let traced = from_outside(&state, packet);
        assert_total_probability(&traced);
        assert_eq!(
            dnat_targets(&traced),
            BTreeSet::from(["10.244.1.5:80".into(), "10.244.2.7:80".into()]),
            "{traced}"
        );
    }
}

#[test]
fn internal_traffic_policy_local_without_local_endpoints_drops_the_cluster_ip() {
    let traced = from_outside(
        &common::itp_local_state(),
        tcp(POD_ON_NODE, "10.96.0.19", 80),
    );
    assert_eq!(traced.outcomes.len(), 1, "{traced}");
    assert_eq!(
        traced.outcomes[0].verdict,
        Verdict::Drop {
            table: Table::Filter,
            chain: "KUBE-SERVICES".into()
        }
    );
    assert!(
        traced.to_string().contains("has no local endpoints"),
        "{traced}"
    );
}

#[test]
fn internal_traffic_policy_local_falls_back_to_a_serving_terminating_local_endpoint() {
    // node-b has a ready endpoint, node-a only a terminating one: node-a keeps using it.
    let traced = from_outside(
        &common::itp_local_state(),
        tcp(POD_ON_NODE, "10.96.0.20", 80),
    );
    assert_eq!(
        dnat_targets(&traced),
        BTreeSet::from(["10.244.1.9:80".into()]),
        "{traced}"
    );
}
