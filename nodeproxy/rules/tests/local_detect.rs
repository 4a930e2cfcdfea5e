//! `--detect-local-mode`: the rule text each local-traffic detector gives in both layouts,
//! as kube-proxy's `LocalTrafficDetector` writes it (`IfNotLocal()` on the cluster-IP and
//! external-IP masquerade rules, `IfLocal()` on the KUBE-XLB short-cut for pods), and the
//! fates the tracers give a pod's and an outside client's packet under each.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;

use common::ip;
use tandem_common::Protocol;
use tandem_nftables::{Transaction, render};
use tandem_proxy_rules::model::{LocalDetector, NodeConfig, ProxyState};
use tandem_proxy_rules::nft::layout;
use tandem_proxy_rules::ruleset::Table;
use tandem_proxy_rules::trace::{Entry, Outcome, Packet, Trace, TraceRequest, Verdict, trace};

const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// node-a's `spec.podCIDRs`: its pods (10.244.1.5, 10.244.1.6) are in it, node-b's
/// (10.244.2.7) are not.
const NODE_CIDR: &str = "10.244.1.0/24";

fn detectors() -> Vec<(&'static str, LocalDetector)> {
    vec![
        (
            "ClusterCIDR",
            LocalDetector::ClusterCidr(CLUSTER_CIDR.parse().unwrap()),
        ),
        (
            "NodeCIDR",
            LocalDetector::NodeCidr(NODE_CIDR.parse().unwrap()),
        ),
        (
            "BridgeInterface",
            LocalDetector::BridgeInterface("cni0".parse().unwrap()),
        ),
        (
            "InterfaceNamePrefix",
            LocalDetector::InterfaceNamePrefix("veth".parse().unwrap()),
        ),
        ("none", LocalDetector::None),
    ]
}

fn node(detector: &LocalDetector) -> NodeConfig {
    NodeConfig {
        local_detector: detector.clone(),
        ..common::node_a()
    }
}

/// An externalTrafficPolicy Local LoadBalancer open to every source (cluster IP
/// 10.96.0.12:80, LB IP 198.51.100.11, endpoints on node-a and node-b) and a ClusterIP
/// Service with external IPs (10.96.0.15:8080, 192.0.2.10 and 192.0.2.11).
fn state() -> ProxyState {
    let mut state = common::etp_local_state(true);
    state.edit_services(|svc| svc.load_balancer_source_ranges.clear());
    state.extend(common::external_ips_state());
    state
}

fn iptables_nat(detector: &LocalDetector) -> String {
    tandem_proxy_rules::build(&state(), &node(detector)).restore_payload(Table::Nat)
}

fn nft_text(detector: &LocalDetector) -> String {
    render::transaction(&Transaction::replace_all(&layout::build(
        &state(),
        &node(detector),
    )))
}

/// The iptables rules that carry the detector, exactly as kube-proxy writes them.
fn iptables_golden(detector: &str) -> Vec<String> {
    let svc = "-A KUBE-SERVICES";
    let xlb = "-A KUBE-XLB-DPUFXEK3OPQ7WVSQ";
    let (not_local, local) = match detector {
        "ClusterCIDR" => ("! -s 10.244.0.0/16", "-s 10.244.0.0/16"),
        "NodeCIDR" => ("! -s 10.244.1.0/24", "-s 10.244.1.0/24"),
        "BridgeInterface" => ("! -i cni0", "-i cni0"),
        "InterfaceNamePrefix" => ("! -i veth+", "-i veth+"),
        _ => unreachable!(),
    };
    // `iptables-save` order: source, destination, input interface, protocol.
    let to = |dst: &str| match not_local.contains("-s") {
        true => format!("{not_local} -d {dst}"),
        false => format!("-d {dst} {not_local}"),
    };
    vec![
        format!(
            "{svc} {} -p tcp -m comment --comment \"s2/local:http cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ",
            to("10.96.0.12/32")
        ),
        format!(
            "{svc} {} -p tcp -m comment --comment \"s5/ext:http cluster IP\" -m tcp --dport 8080 -j KUBE-MARK-MASQ",
            to("10.96.0.15/32")
        ),
        format!(
            "{svc} {} -p tcp -m comment --comment \"s5/ext:http external IP\" -m tcp --dport 8080 -j KUBE-MARK-MASQ",
            to("192.0.2.10/32")
        ),
        format!(
            "{xlb} {local} -m comment --comment \"Redirect pods trying to reach external loadbalancer VIP to clusterIP\" -j KUBE-SVC-DPUFXEK3OPQ7WVSQ"
        ),
    ]
}

/// The ClusterCIDR payload with its detector's matches rewritten for `detector`, moved to
/// where `iptables-save` puts an input interface; `None` drops them as kube-proxy's no-op
/// detector does (no cluster-IP masquerade rule, no KUBE-XLB short-cut, external IPs
/// masqueraded for every source).
fn rewritten(cluster_cidr_payload: &str, detector: &LocalDetector) -> String {
    let mut out = String::new();
    for line in cluster_cidr_payload.lines() {
        let mut tokens: Vec<String> = line.split(' ').map(str::to_owned).collect();
        let at = tokens
            .windows(2)
            .position(|pair| pair[0] == "-s" && pair[1] == CLUSTER_CIDR);
        let Some(at) = at else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let negated = at > 0 && tokens[at - 1] == "!";
        let start = if negated { at - 1 } else { at };
        tokens.drain(start..at + 2);
        match detector {
            LocalDetector::None if tokens[1] == "KUBE-SERVICES" && line.contains("cluster IP") => {
                continue;
            }
            LocalDetector::None if !negated => continue,
            LocalDetector::None => {}
            other => {
                let text = other.iptables(negated).unwrap();
                let mut insert_at = 2;
                if tokens.get(2).map(String::as_str) == Some("-d") {
                    insert_at = 4;
                }
                if matches!(
                    other,
                    LocalDetector::ClusterCidr(_) | LocalDetector::NodeCidr(_)
                ) {
                    insert_at = 2;
                }
                tokens.insert(insert_at, text);
            }
        }
        out.push_str(&tokens.join(" "));
        out.push('\n');
    }
    out
}

#[test]
fn iptables_rules_carry_each_detector_as_kube_proxy_writes_it() {
    let reference = iptables_nat(&detectors()[0].1);
    for (name, detector) in detectors() {
        let payload = iptables_nat(&detector);
        if name != "none" {
            for rule in iptables_golden(name) {
                assert!(
                    payload.lines().any(|line| line == rule),
                    "{name}: no rule\n{rule}\nin\n{payload}"
                );
            }
        } else {
            assert!(!payload.contains("Redirect pods"), "{payload}");
            assert!(!payload.contains("cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ"));
        }
        // Nothing else differs from the ClusterCIDR rules.
        assert_eq!(payload, rewritten(&reference, &detector), "{name}");
    }
}

/// The nftables matches of each detector, in the order the layout writes them.
fn nft_golden(detector: &str) -> (&'static str, &'static str) {
    match detector {
        "ClusterCIDR" => ("ip saddr != 10.244.0.0/16", "ip saddr 10.244.0.0/16"),
        "NodeCIDR" => ("ip saddr != 10.244.1.0/24", "ip saddr 10.244.1.0/24"),
        "BridgeInterface" => ("iifname != \"cni0\"", "iifname \"cni0\""),
        "InterfaceNamePrefix" => ("iifname != \"veth*\"", "iifname \"veth*\""),
        _ => unreachable!(),
    }
}

#[test]
fn nftables_rules_carry_each_detector_as_kube_proxy_writes_it() {
    let reference = nft_text(&detectors()[0].1);
    for (name, detector) in detectors().into_iter().filter(|(name, _)| *name != "none") {
        let text = nft_text(&detector);
        let (not_local, local) = nft_golden(name);
        for rule in [
            format!("ip daddr 10.96.0.12 tcp dport 80 {not_local} jump mark-for-masquerade"),
            format!("{local} goto service-"),
            format!("ip daddr 192.0.2.10 {local} goto service-"),
        ] {
            assert!(text.contains(&rule), "{name}: no {rule:?} in\n{text}");
        }
        // Nothing else differs from the ClusterCIDR table.
        let expected = reference
            .replace("ip saddr != 10.244.0.0/16", not_local)
            .replace("ip saddr 10.244.0.0/16", local);
        assert_eq!(text, expected, "{name}");
    }
    let none = nft_text(&LocalDetector::None);
    assert!(!none.contains("saddr 10.244") && !none.contains("saddr != 10.244"));
    assert!(!none.contains("iifname"), "{none}");
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Iptables,
    Nftables,
}

/// What became of a packet: its DNAT targets (none if it was stopped) and whether it was
/// masqueraded.
#[derive(Debug, PartialEq, Eq)]
struct Fate {
    dnat: BTreeSet<SocketAddr>,
    masqueraded: bool,
}

fn fate(trace: &Trace) -> Fate {
    let passed = |o: &&Outcome| matches!(o.verdict, Verdict::Pass | Verdict::Accept { .. });
    let passing: Vec<&Outcome> = trace.outcomes.iter().filter(passed).collect();
    Fate {
        dnat: passing.iter().filter_map(|o| o.dnat).collect(),
        masqueraded: !passing.is_empty() && passing.iter().all(|o| o.masqueraded),
    }
}

fn traced(
    mode: Mode,
    detector: &LocalDetector,
    src: &str,
    iif: &str,
    dst: &str,
    port: u16,
) -> Fate {
    let packet = Packet {
        src: ip(src),
        dst: ip(dst),
        protocol: Protocol::Tcp,
        dst_port: port,
    };
    let request =
        TraceRequest::new(packet, Entry::FromOutside, [ip("198.18.0.11")]).on_interface(iif);
    let (state, node) = (state(), node(detector));
    let trace = match mode {
        Mode::Iptables => trace(&tandem_proxy_rules::build(&state, &node), &request).unwrap(),
        Mode::Nftables => {
            tandem_proxy_rules::nft::trace::trace(&layout::build(&state, &node), &request).unwrap()
        }
    };
    fate(&trace)
}

#[test]
fn the_tracers_follow_each_detector() {
    let all: BTreeSet<SocketAddr> = ["10.244.1.5:80", "10.244.1.6:80", "10.244.2.7:80"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    let on_node: BTreeSet<SocketAddr> = ["10.244.1.5:80", "10.244.1.6:80"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    // A pod on node-a (10.244.1.9, behind the bridge cni0 on its veth) and a client
    // outside the cluster (192.168.7.50, on eth0).
    let pod_iif = |name: &str| {
        if name == "BridgeInterface" {
            "cni0"
        } else {
            "vethab12"
        }
    };
    for mode in [Mode::Iptables, Mode::Nftables] {
        for (name, detector) in detectors().into_iter().filter(|(n, _)| *n != "none") {
            let pod = |dst, port| traced(mode, &detector, "10.244.1.9", pod_iif(name), dst, port);
            let outside = |dst, port| traced(mode, &detector, "192.168.7.50", "eth0", dst, port);
            let at = format!("{mode:?} {name}");
            // The cluster IP: the pod keeps its address, the outside client does not.
            let from_pod = pod("10.96.0.12", 80);
            assert!(
                !from_pod.masqueraded && from_pod.dnat == all,
                "{at}: {from_pod:?}"
            );
            let from_outside = outside("10.96.0.12", 80);
            assert!(
                from_outside.masqueraded && from_outside.dnat == all,
                "{at}: {from_outside:?}"
            );
            // The eTP Local LB IP: the pod short-cuts to every endpoint, the outside
            // client goes to this node's endpoints only, keeping its address.
            let from_pod = pod("198.51.100.11", 80);
            assert_eq!(from_pod.dnat, all, "{at}");
            let from_outside = outside("198.51.100.11", 80);
            assert!(
                !from_outside.masqueraded && from_outside.dnat == on_node,
                "{at}: {from_outside:?}"
            );
        }
        // A node-b pod's address is in the cluster CIDR but not node-a's pod CIDR.
        let node_cidr = LocalDetector::NodeCidr(NODE_CIDR.parse().unwrap());
        let from_node_b = traced(
            mode,
            &node_cidr,
            "10.244.2.9",
            "flannel.1",
            "10.96.0.12",
            80,
        );
        assert!(from_node_b.masqueraded, "{mode:?}");
        // A packet of a pod on another bridge is not local to BridgeInterface cni0.
        let bridge = LocalDetector::BridgeInterface("cni0".parse().unwrap());
        let other_bridge = traced(mode, &bridge, "10.244.1.9", "docker0", "10.96.0.12", 80);
        assert!(other_bridge.masqueraded, "{mode:?}");
        let prefix = LocalDetector::InterfaceNamePrefix("veth".parse().unwrap());
        let not_veth = traced(mode, &prefix, "10.244.1.9", "cni0", "10.96.0.12", 80);
        assert!(not_veth.masqueraded, "{mode:?}");
    }
}

/// The IPv6 proxier: a CIDR detector of its family (`! -s fd00:10:244:1::/64`,
/// `ip6 saddr != …`), the interface detectors as in IPv4.
#[test]
fn the_ipv6_proxier_writes_the_same_detectors() {
    let state = common::dual_stack_reference_state_v6();
    let v6 = |detector: LocalDetector| NodeConfig {
        local_detector: detector,
        ..common::node_a_v6()
    };
    for (detector, iptables, nft) in [
        (
            LocalDetector::NodeCidr("fd00:10:244:1::/64".parse().unwrap()),
            "! -s fd00:10:244:1::/64 -d ",
            "ip6 saddr != fd00:10:244:1::/64 jump mark-for-masquerade",
        ),
        (
            LocalDetector::BridgeInterface("cni0".parse().unwrap()),
            "/128 ! -i cni0 -p tcp",
            "iifname != \"cni0\" jump mark-for-masquerade",
        ),
    ] {
        let node = v6(detector);
        let payload = tandem_proxy_rules::build(&state, &node).restore_payload(Table::Nat);
        assert!(payload.contains(iptables), "no {iptables:?} in\n{payload}");
        assert!(!payload.contains("fd00:10:244::/56"), "{payload}");
        let text = render::transaction(&Transaction::replace_all(&layout::build(&state, &node)));
        assert!(text.contains(nft), "no {nft:?} in\n{text}");
        assert!(!text.contains("fd00:10:244::/56"), "{text}");
    }
}
