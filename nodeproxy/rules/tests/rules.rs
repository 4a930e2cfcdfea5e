//! Table-driven checks of single features of `build`, stated as the rules they must (or
//! must not) produce; the full texts are in the snapshot tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{ip, vip};
use tandem_common::{IpFamily, Protocol};
use tandem_proxy_rules::build;
use tandem_proxy_rules::chains::{endpoint_chain, firewall_chain, service_chain};
use tandem_proxy_rules::model::{Endpoint, IpMode, LoadBalancerIngress, NodeConfig, ProxyState};
use tandem_proxy_rules::ruleset::{Ruleset, Table};

fn rules_of(ruleset: &Ruleset, table: Table, chain: &str) -> Vec<String> {
    ruleset
        .table(table)
        .chains
        .get(chain)
        .cloned()
        .unwrap_or_default()
}

fn all_rules(ruleset: &Ruleset) -> Vec<String> {
    [Table::Filter, Table::Nat]
        .into_iter()
        .flat_map(|t| {
            ruleset
                .table(t)
                .chains
                .iter()
                .flat_map(|(c, rules)| rules.iter().map(move |r| format!("{c} {r}")))
        })
        .collect()
}

#[test]
fn feature_rules() {
    struct Case {
        what: &'static str,
        state: ProxyState,
        table: Table,
        chain: String,
        present: &'static [&'static str],
        absent: &'static [&'static str],
    }
    let sticky_svc = service_chain(&common::sticky(), Protocol::Tcp);
    let sticky_sep = endpoint_chain(
        &common::sticky(),
        Protocol::Tcp,
        "10.244.2.7:80".parse().unwrap(),
    );
    let cases = [
        Case {
            what: "affinity: recent check in the Service chain",
            state: common::affinity_state(),
            table: Table::Nat,
            chain: sticky_svc,
            present: &["-m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-"],
            absent: &[],
        },
        Case {
            what: "affinity: recent set before DNAT",
            state: common::affinity_state(),
            table: Table::Nat,
            chain: sticky_sep,
            present: &[
                "-m recent --set --name KUBE-SEP-",
                " --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.2.7:80",
            ],
            absent: &[],
        },
        Case {
            what: "SCTP gets its own protocol match",
            state: common::sctp_state(),
            table: Table::Nat,
            chain: "KUBE-SERVICES".into(),
            present: &[
                "-d 10.96.0.17/32 -p sctp -m comment --comment \"s7/sig:sctp cluster IP\" -m sctp --dport 3868 -j KUBE-SVC-",
            ],
            absent: &[],
        },
        Case {
            what: "UDP node port",
            state: common::udp_state(),
            table: Table::Nat,
            chain: "KUBE-NODEPORTS".into(),
            present: &[
                "-p udp -m comment --comment \"kube-system/dns:dns\" -m udp --dport 30053 -j KUBE-MARK-MASQ",
            ],
            absent: &[],
        },
        Case {
            what: "not-ready and terminating endpoints are not used",
            state: common::no_endpoints_state(),
            table: Table::Filter,
            chain: "KUBE-SERVICES".into(),
            present: &[
                "-d 10.96.0.14/32 -p tcp -m comment --comment \"s4/empty:http has no endpoints\" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable",
            ],
            absent: &[],
        },
        Case {
            what: "no endpoints: node port rejected where it is local",
            state: common::no_endpoints_state(),
            table: Table::Filter,
            chain: "KUBE-EXTERNAL-SERVICES".into(),
            present: &[
                "-p tcp -m comment --comment \"s4/empty:http has no endpoints\" -m addrtype --dst-type LOCAL -m tcp --dport 30084 -j REJECT",
                "-d 192.0.2.50/32 -p tcp",
                "-d 198.51.100.13/32 -p tcp",
            ],
            absent: &[],
        },
        Case {
            what: "ETP Local: loopback node-port clients are masqueraded",
            state: common::etp_local_state(true),
            table: Table::Nat,
            chain: "KUBE-NODEPORTS".into(),
            present: &[
                "-s 127.0.0.0/8 -p tcp -m comment --comment \"s2/local:http\" -m tcp --dport 30082 -j KUBE-MARK-MASQ",
            ],
            absent: &[],
        },
        Case {
            what: "ETP Local: no masquerade in the FW chain",
            state: common::etp_local_state(true),
            table: Table::Nat,
            chain: firewall_chain(&common::local_lb(), Protocol::Tcp),
            present: &["-j KUBE-XLB-"],
            absent: &["-j KUBE-MARK-MASQ"],
        },
        Case {
            what: "external IPs masquerade off-cluster clients",
            state: common::external_ips_state(),
            table: Table::Nat,
            chain: "KUBE-SERVICES".into(),
            present: &[
                "! -s 10.244.0.0/16 -d 192.0.2.10/32 -p tcp -m comment --comment \"s5/ext:http external IP\" -m tcp --dport 8080 -j KUBE-MARK-MASQ",
            ],
            absent: &[],
        },
    ];
    for case in cases {
        let ruleset = build(&case.state, &common::node_a());
        let rules = rules_of(&ruleset, case.table, &case.chain).join("\n");
        for needle in case.present {
            assert!(
                rules.contains(needle),
                "{}: {needle:?} not in {}:\n{rules}",
                case.what,
                case.chain
            );
        }
        for needle in case.absent {
            assert!(
                !rules.contains(needle),
                "{}: {needle:?} in {}:\n{rules}",
                case.what,
                case.chain
            );
        }
    }
}

#[test]
fn headless_services_get_no_rules() {
    let mut state = common::nodeport_state();
    state.edit_services(|svc| svc.cluster_ip = None);
    let ruleset = build(&state, &common::node_a());
    assert!(
        !all_rules(&ruleset).iter().any(|r| r.contains("s1/web")),
        "{ruleset:#?}"
    );
    assert_eq!(
        ruleset,
        build(&ProxyState::new(IpFamily::V4), &common::node_a())
    );
}

#[test]
fn proxy_mode_ingress_is_left_to_the_node_port() {
    let mut state = common::lb_open_state();
    state.edit_services(|svc| {
        svc.load_balancer_ingress.push(LoadBalancerIngress {
            ip: ip("198.51.100.99"),
            ip_mode: IpMode::Proxy,
        })
    });
    let ruleset = build(&state, &common::node_a());
    let text = all_rules(&ruleset).join("\n");
    assert!(text.contains("-d 198.51.100.10/32"));
    assert!(!text.contains("198.51.100.99"), "{text}");
    assert!(text.contains("--dport 30081 -j KUBE-SVC-"));
}

#[test]
fn several_ingress_ips_share_one_firewall_chain() {
    let mut state = common::reference_state();
    let mut nginx = state.services()[&common::nginx_http()].clone();
    nginx.load_balancer_ingress.push(vip("198.51.100.21"));
    state.insert_service(nginx);
    let ruleset = build(&state, &common::node_a());
    let fw = firewall_chain(&common::nginx_http(), Protocol::Tcp);
    let jumps = rules_of(&ruleset, Table::Nat, "KUBE-SERVICES")
        .iter()
        .filter(|r| r.ends_with(&fw))
        .count();
    assert_eq!(jumps, 2);
    assert_eq!(rules_of(&ruleset, Table::Nat, &fw).len(), 3);
}

#[test]
fn without_cluster_cidr_there_is_no_local_traffic_detection() {
    let node = NodeConfig::new("node-a", None);
    let external = build(&common::external_ips_state(), &node);
    let services = rules_of(&external, Table::Nat, "KUBE-SERVICES").join("\n");
    assert!(!services.contains("! -s"), "{services}");
    assert!(services.contains("-d 192.0.2.10/32 -p tcp -m comment --comment \"s5/ext:http external IP\" -m tcp --dport 8080 -j KUBE-MARK-MASQ"));
    assert!(
        !services.contains("cluster IP\" -m tcp --dport 8080 -j KUBE-MARK-MASQ"),
        "{services}"
    );
    let local = build(&common::etp_local_state(true), &node);
    assert!(!all_rules(&local).join("\n").contains("Redirect pods"));
}

#[test]
fn duplicate_endpoints_from_two_slices_get_one_chain() {
    let mut state = common::lb_open_state();
    let mut endpoints: Vec<Endpoint> = state.endpoints_of(&common::open_lb()).to_vec();
    endpoints.push(common::ready("10.244.1.5", 80, "node-a"));
    state.insert_endpoints(common::open_lb(), endpoints);
    let ruleset = build(&state, &common::node_a());
    assert_eq!(ruleset, build(&common::lb_open_state(), &common::node_a()));
}

#[test]
fn source_ranges_are_normalised_like_iptables_does() {
    let mut state = common::reference_state();
    let mut nginx = state.services()[&common::nginx_http()].clone();
    nginx.load_balancer_source_ranges = vec![
        "203.0.113.77/24".parse().unwrap(),
        "203.0.113.0/24".parse().unwrap(),
    ];
    state.insert_service(nginx);
    let ruleset = build(&state, &common::node_a());
    assert_eq!(
        ruleset,
        build(&common::reference_state(), &common::node_a())
    );
}
