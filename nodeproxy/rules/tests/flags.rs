//! The node settings kube-proxy's flags and its own node IP give, packet in, fate out, in
//! both modes: allowFromNode, `--masquerade-all`, `--nodeport-addresses`,
//! `--iptables-localhost-nodeports`, and the nftables mode's `cluster-ips-check`. node-a is
//! 198.18.0.11 (and 192.168.7.11 on a second interface), its pods 10.244.1.0/24.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;

use common::ip;
use tandem_common::Protocol;
use tandem_proxy_rules::model::{LocalDetector, NodeConfig, NodePortAddresses, ProxyState};
use tandem_proxy_rules::nft::layout;
use tandem_proxy_rules::trace::{Entry, Packet, Trace, TraceRequest, Verdict, trace};

const NODE_IP: &str = "198.18.0.11";
const SECOND_NIC: &str = "192.168.7.11";
const LB_IP: &str = "198.51.100.20";
const POD_ON_NODE: &str = "10.244.1.20";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Iptables,
    Nftables,
}

const MODES: [Mode; 2] = [Mode::Iptables, Mode::Nftables];

fn tcp(src: &str, dst: &str, port: u16) -> Packet {
    Packet {
        src: ip(src),
        dst: ip(dst),
        protocol: Protocol::Tcp,
        dst_port: port,
    }
}

fn run(mode: Mode, state: &ProxyState, node: &NodeConfig, request: &TraceRequest) -> Trace {
    match mode {
        Mode::Iptables => trace(&tandem_proxy_rules::build(state, node), request).unwrap(),
        Mode::Nftables => {
            tandem_proxy_rules::nft::trace::trace(&layout::build(state, node), request).unwrap()
        }
    }
}

fn traced(
    mode: Mode,
    state: &ProxyState,
    node: &NodeConfig,
    packet: Packet,
    entry: Entry,
) -> Trace {
    let request = TraceRequest::new(packet, entry, [ip(NODE_IP), ip(SECOND_NIC)]);
    run(mode, state, node, &request)
}

/// What became of the packet, the same in every outcome: its DNAT targets (empty for
/// none), whether it was masqueraded, and whether it was dropped or rejected.
#[derive(Debug, PartialEq, Eq)]
struct Fate {
    dnat: BTreeSet<SocketAddr>,
    masqueraded: bool,
    stopped: Option<&'static str>,
}

fn fate(trace: &Trace) -> Fate {
    let stopped = |verdict: &Verdict| match verdict {
        Verdict::Drop { .. } => Some("drop"),
        Verdict::Reject { .. } => Some("reject"),
        Verdict::Pass | Verdict::Accept { .. } => None,
    };
    let first = &trace.outcomes[0];
    for outcome in &trace.outcomes {
        assert_eq!(
            stopped(&outcome.verdict),
            stopped(&first.verdict),
            "{trace}"
        );
        assert_eq!(outcome.masqueraded, first.masqueraded, "{trace}");
    }
    let stopped = stopped(&first.verdict);
    Fate {
        dnat: if stopped.is_some() {
            BTreeSet::new()
        } else {
            trace.outcomes.iter().filter_map(|o| o.dnat).collect()
        },
        masqueraded: first.masqueraded && stopped.is_none(),
        stopped,
    }
}

fn endpoints() -> BTreeSet<SocketAddr> {
    BTreeSet::from([
        "10.244.1.5:80".parse().unwrap(),
        "10.244.2.7:80".parse().unwrap(),
    ])
}

fn delivered(masqueraded: bool) -> Fate {
    Fate {
        dnat: endpoints(),
        masqueraded,
        stopped: None,
    }
}

fn untranslated() -> Fate {
    Fate {
        dnat: BTreeSet::new(),
        masqueraded: false,
        stopped: None,
    }
}

fn stopped(how: &'static str) -> Fate {
    Fate {
        dnat: BTreeSet::new(),
        masqueraded: false,
        stopped: Some(how),
    }
}

/// The reference LoadBalancer (LB IP 198.51.100.20, node port 30166, cluster IP
/// 10.43.35.197:80) with `ranges` as its loadBalancerSourceRanges.
fn lb_with_ranges(ranges: &[&str]) -> ProxyState {
    let mut state = common::reference_state();
    state.edit_services(|svc| {
        if !svc.load_balancer_source_ranges.is_empty() {
            svc.load_balancer_source_ranges = ranges.iter().map(|r| r.parse().unwrap()).collect();
        }
    });
    state
}

fn node(node_ip: Option<&str>) -> NodeConfig {
    NodeConfig {
        node_ip: node_ip.map(ip),
        ..common::node_a()
    }
}

#[test]
fn a_source_range_holding_the_node_lets_the_lb_ip_in_as_its_own_source() {
    // kube-proxy's TestLoadBalancer, "same node to LB1, SNATted to LB1": the node reaches
    // the LB IP and the packet comes back to it with the LB IP as source.
    let with_node = lb_with_ranges(&["203.0.113.0/24", "198.18.0.0/24"]);
    let without_node = lb_with_ranges(&["203.0.113.0/24"]);
    let looped = tcp(LB_IP, LB_IP, 80);
    for mode in MODES {
        let lets_in = |state: &ProxyState, node_ip| {
            fate(&traced(
                mode,
                state,
                &node(node_ip),
                looped,
                Entry::FromOutside,
            ))
        };
        assert_eq!(
            lets_in(&with_node, Some(NODE_IP)),
            delivered(true),
            "{mode:?}"
        );
        // The LB IP routed to the node as a local address (`ip route add local`).
        let request = TraceRequest::new(looped, Entry::Local, [ip(NODE_IP), ip(LB_IP)]);
        let local = run(mode, &with_node, &node(Some(NODE_IP)), &request);
        assert_eq!(fate(&local), delivered(true), "{mode:?}");
        // A range without the node's IP, or an unknown node IP: dropped, as before.
        assert_eq!(
            lets_in(&without_node, Some(NODE_IP)),
            stopped("drop"),
            "{mode:?}"
        );
        assert_eq!(lets_in(&with_node, None), stopped("drop"), "{mode:?}");
        // Other sources are judged by the ranges alone.
        let outsider = tcp("192.0.2.99", LB_IP, 80);
        let fate_of = fate(&traced(
            mode,
            &with_node,
            &node(Some(NODE_IP)),
            outsider,
            Entry::FromOutside,
        ));
        assert_eq!(fate_of, stopped("drop"), "{mode:?}");
    }
}

#[test]
fn the_iptables_rule_for_the_lb_ip_as_source_is_kube_proxys() {
    let ruleset = tandem_proxy_rules::build(
        &lb_with_ranges(&["203.0.113.0/24", "198.18.0.0/24"]),
        &node(Some(NODE_IP)),
    );
    let firewall = &ruleset.nat.chains["KUBE-FW-6IM33IEVEEV7U3GP"];
    let comment = "-m comment --comment \"default/nginx-service:http loadbalancer IP\"";
    assert_eq!(
        firewall,
        &[
            format!("{comment} -j KUBE-MARK-MASQ"),
            format!("-s 198.18.0.0/24 {comment} -j KUBE-SVC-6IM33IEVEEV7U3GP"),
            format!("-s 203.0.113.0/24 {comment} -j KUBE-SVC-6IM33IEVEEV7U3GP"),
            format!("-s 198.51.100.20/32 {comment} -j KUBE-SVC-6IM33IEVEEV7U3GP"),
            format!("{comment} -j KUBE-MARK-DROP"),
        ]
    );
}

#[test]
fn masquerade_all_masquerades_pods_reaching_a_cluster_ip() {
    let state = common::reference_state();
    let from_pod = tcp(POD_ON_NODE, "10.43.35.197", 80);
    for mode in MODES {
        let masqueraded = |masquerade_all| {
            let node = NodeConfig {
                masquerade_all,
                ..common::node_a()
            };
            fate(&traced(mode, &state, &node, from_pod, Entry::FromOutside)).masqueraded
        };
        assert!(!masqueraded(false), "{mode:?}");
        assert!(masqueraded(true), "{mode:?}");
        // Also without --cluster-cidr, where nothing else masquerades cluster-IP traffic.
        let node = NodeConfig {
            masquerade_all: true,
            local_detector: LocalDetector::None,
            ..common::node_a()
        };
        let traced = traced(mode, &state, &node, from_pod, Entry::FromOutside);
        assert_eq!(fate(&traced), delivered(true), "{mode:?}");
    }
}

#[test]
fn node_ports_are_served_only_on_the_given_addresses() {
    let state = common::reference_state();
    let only_first_nic = NodeConfig {
        node_port_addresses: NodePortAddresses::from_cidrs(&["198.18.0.0/24".parse().unwrap()]),
        ..common::node_a()
    };
    for mode in MODES {
        let to = |node: &NodeConfig, address| {
            let packet = tcp("203.0.113.7", address, 30166);
            fate(&traced(mode, &state, node, packet, Entry::FromOutside))
        };
        assert_eq!(to(&only_first_nic, NODE_IP), delivered(true), "{mode:?}");
        assert_eq!(to(&only_first_nic, SECOND_NIC), untranslated(), "{mode:?}");
        // Without the flag, every address of the node.
        assert_eq!(
            to(&common::node_a(), SECOND_NIC),
            delivered(true),
            "{mode:?}"
        );
        // 0.0.0.0/0 means every address, as in kube-proxy.
        let all = NodeConfig {
            node_port_addresses: NodePortAddresses::from_cidrs(&["0.0.0.0/0".parse().unwrap()]),
            ..common::node_a()
        };
        assert_eq!(all.node_port_addresses, NodePortAddresses::All);
    }
}

#[test]
fn localhost_node_ports_are_served_in_the_iptables_mode_unless_turned_off() {
    let state = common::reference_state();
    let from_node = tcp("127.0.0.1", "127.0.0.1", 30166);
    let localhost = |mode, localhost_node_ports, node_port_addresses| {
        let node = NodeConfig {
            localhost_node_ports,
            node_port_addresses,
            ..common::node_a()
        };
        fate(&traced(mode, &state, &node, from_node, Entry::Local))
    };
    let all = || NodePortAddresses::All;
    let with_loopback = || {
        NodePortAddresses::from_cidrs(&[
            "0.0.0.0/1".parse().unwrap(),
            "198.18.0.0/24".parse().unwrap(),
        ])
    };
    // v1.21's default: DNATed (and masqueraded: a loopback source cannot leave the node).
    assert_eq!(localhost(Mode::Iptables, true, all()), delivered(true));
    assert_eq!(
        localhost(Mode::Iptables, true, with_loopback()),
        delivered(true)
    );
    assert_eq!(localhost(Mode::Iptables, false, all()), untranslated());
    assert_eq!(
        localhost(Mode::Iptables, false, with_loopback()),
        untranslated()
    );
    // The nftables mode never serves them, as kube-proxy's.
    for on in [true, false] {
        assert_eq!(localhost(Mode::Nftables, on, all()), untranslated());
        assert_eq!(
            localhost(Mode::Nftables, on, with_loopback()),
            untranslated()
        );
    }
    // The node's own address still works with localhost node ports off.
    let off = NodeConfig {
        localhost_node_ports: false,
        ..common::node_a()
    };
    for mode in MODES {
        let packet = tcp(NODE_IP, NODE_IP, 30166);
        assert_eq!(
            fate(&traced(mode, &state, &off, packet, Entry::Local)),
            delivered(true)
        );
    }
}

#[test]
fn the_nftables_mode_rejects_unserved_ports_of_cluster_ips_and_drops_unallocated_ones() {
    let state = common::reference_state();
    let node = NodeConfig {
        service_cidrs: vec!["10.43.0.0/16".parse().unwrap()],
        ..common::node_a()
    };
    let cases = [
        // A port the cluster IP does not serve: rejected, so the client fails at once.
        (tcp(POD_ON_NODE, "10.43.35.197", 81), stopped("reject")),
        // An address of the Service CIDR no Service holds: dropped.
        (tcp(POD_ON_NODE, "10.43.200.1", 80), stopped("drop")),
        // The port it serves still reaches the endpoints; the empty Service still rejects.
        (tcp(POD_ON_NODE, "10.43.35.197", 80), delivered(false)),
        (tcp(POD_ON_NODE, "10.43.0.1", 443), stopped("reject")),
        // Outside the Service CIDR nothing changes.
        (tcp(POD_ON_NODE, "10.44.0.1", 80), untranslated()),
    ];
    for (packet, expected) in cases {
        let nft = traced(Mode::Nftables, &state, &node, packet, Entry::FromOutside);
        assert_eq!(fate(&nft), expected, "{nft}");
        // From the node itself, after DNAT in the output hook.
        let own = TraceRequest::new(
            Packet {
                src: ip(NODE_IP),
                ..packet
            },
            Entry::Local,
            [ip(NODE_IP)],
        );
        let own = run(Mode::Nftables, &state, &node, &own);
        let masqueraded_from_node = Fate {
            masqueraded: false,
            ..fate(&own)
        };
        assert_eq!(masqueraded_from_node, expected, "{own}");
    }
    // Without a Service CIDR, an unallocated address is left alone (kube-proxy with no
    // ServiceCIDR known); the iptables mode keeps v1.21's fates throughout.
    let unallocated = tcp(POD_ON_NODE, "10.43.200.1", 80);
    let plain = traced(
        Mode::Nftables,
        &state,
        &common::node_a(),
        unallocated,
        Entry::FromOutside,
    );
    assert_eq!(fate(&plain), untranslated());
    for packet in [tcp(POD_ON_NODE, "10.43.35.197", 81), unallocated] {
        let iptables = traced(Mode::Iptables, &state, &node, packet, Entry::FromOutside);
        assert_eq!(fate(&iptables), untranslated(), "{iptables}");
    }
}

#[test]
fn the_cluster_ips_check_follows_the_service_cidrs_as_they_change() {
    use tandem_proxy_rules::model::service_cidrs_of;
    use tandem_proxy_rules::nft::incremental::IncrementalRuleset;

    let state = common::reference_state();
    let in_first = tcp(POD_ON_NODE, "10.43.200.1", 80);
    let in_second = tcp(POD_ON_NODE, "10.97.3.4", 80);
    let fates = |rules: &IncrementalRuleset| {
        [in_first, in_second].map(|packet| {
            let request = TraceRequest::new(packet, Entry::FromOutside, [ip(NODE_IP)]);
            fate(&tandem_proxy_rules::nft::trace::trace(rules.ruleset(), &request).unwrap())
        })
    };
    let node = common::node_a();
    let mut rules = IncrementalRuleset::new(node.clone());
    rules.update(&state, state.services().keys());
    // ServiceCIDR objects of both families, as the node proxy reads them: the IPv4
    // proxier keeps its own, and a CIDR two objects name counts once.
    let cidrs = |list: &[&str]| -> Vec<ipnet::IpNet> {
        service_cidrs_of(node.family, list.iter().map(|c| c.parse().unwrap()))
    };
    let steps = [
        (
            vec!["10.43.0.0/16", "fd00:43::/112"],
            [stopped("drop"), untranslated()],
        ),
        (
            vec!["10.43.0.0/16", "10.97.0.0/16", "10.43.0.0/16"],
            [stopped("drop"), stopped("drop")],
        ),
        (vec!["10.43.0.0/16"], [stopped("drop"), untranslated()]),
        // No ServiceCIDR object at all: nothing is dropped (kube-proxy's empty list).
        (vec![], [untranslated(), untranslated()]),
    ];
    for (objects, expected) in steps {
        let cidrs = cidrs(&objects);
        let tx = rules.set_service_cidrs(cidrs.clone());
        assert!(!tx.is_empty(), "{objects:?}");
        assert_eq!(fates(&rules), expected, "{objects:?}");
        // The same as a fresh start with those CIDRs.
        let fresh = NodeConfig {
            service_cidrs: cidrs.clone(),
            ..node.clone()
        };
        assert_eq!(
            rules.ruleset(),
            &layout::build_with_slots(&state, &fresh, rules.slots())
        );
        // Unchanged CIDRs write nothing.
        assert!(rules.set_service_cidrs(cidrs).is_empty());
    }
}
