//! The reference API state must produce exactly the rules kube-proxy v1.21.2 installed for
//! it (`tests/data/`, an `iptables-save` dump), byte for byte, plus the KUBE-MARK-DROP rule
//! that the kubelet v1.21 installs (and we ensure where it is missing) and our
//! KUBE-PROXY-FIREWALL, which drops what KUBE-MARK-DROP marked.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;

use tandem_proxy_rules::build;
use tandem_proxy_rules::ruleset::{BASE_JUMPS, Ruleset, Table};

const BUILTIN_CHAINS: &[&str] = &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// One table of an `iptables-save` dump: declared chains, each with its rules in order.
fn parse_dump(dump: &str, table: &str) -> BTreeMap<String, Vec<String>> {
    let mut chains = BTreeMap::new();
    let mut in_table = false;
    for line in dump.lines() {
        if let Some(name) = line.strip_prefix('*') {
            in_table = name == table;
        } else if !in_table || line == "COMMIT" || line.starts_with('#') {
            continue;
        } else if let Some(decl) = line.strip_prefix(':') {
            let chain = decl.split_whitespace().next().unwrap();
            chains.entry(chain.to_owned()).or_insert_with(Vec::new);
        } else {
            let rest = line
                .strip_prefix("-A ")
                .unwrap_or_else(|| panic!("unexpected line {line:?}"));
            let (chain, rule) = rest.split_once(' ').unwrap();
            chains.get_mut(chain).unwrap().push(rule.to_owned());
        }
    }
    chains
}

#[test]
fn reference_state_produces_the_reference_rules() {
    let ours = build(&common::reference_state(), &common::node_a());
    assert_reference_rules(&ours, common::REFERENCE_DUMP, |_| {});
}

/// The IPv6 proxier, against what kube-proxy v1.21.2's dual-stack proxier wrote in
/// `ip6tables` for the same Services (`/128` hosts, `[address]:port` DNATs and endpoint
/// hashes, `icmp6-port-unreachable`, `::1/128` for node ports of eTP Local). kube-proxy
/// adds the Services to the shared chains in Go's map order, so each chain's runs of
/// per-Service rules are sorted by Service on both sides.
#[test]
fn ipv6_reference_state_produces_the_ip6tables_reference_rules() {
    let ours = build(
        &common::dual_stack_reference_state_v6(),
        &common::node_a_v6(),
    );
    assert_reference_rules(&ours, common::REFERENCE_DUMP_DUAL_STACK_V6, |chain| {
        sort_service_runs(chain)
    });
}

/// Our filter and nat chains equal those of `dump` (after `canonical` on each chain of
/// both), but for the KUBE-MARK-DROP rule and KUBE-PROXY-FIREWALL that a host without a
/// kubelet lacks and we write.
fn assert_reference_rules(ours: &Ruleset, dump: &str, canonical: impl Fn(&mut Vec<String>)) {
    for (table, ours) in [("filter", &ours.filter.chains), ("nat", &ours.nat.chains)] {
        let mut reference = parse_dump(dump, table);
        reference.remove("KUBE-PROXY-CANARY"); // the runtime's canary, not part of the ruleset
        for builtin in BUILTIN_CHAINS {
            reference.remove(*builtin);
        }
        let mut ours = ours.clone();
        // Missing from the reference on purpose (no kubelet on that host): ours has them.
        match table {
            "filter" => {
                let firewall = ours.remove("KUBE-PROXY-FIREWALL").unwrap();
                assert_eq!(
                    firewall,
                    [
                        "-m comment --comment \"kubernetes firewall for dropping marked packets\" -m mark --mark 0x8000/0x8000 -j DROP"
                    ]
                );
            }
            _ => {
                let mark_drop = std::mem::take(ours.get_mut("KUBE-MARK-DROP").unwrap());
                assert_eq!(mark_drop, ["-j MARK --set-xmark 0x8000/0x8000"]);
            }
        }
        ours.values_mut().for_each(&canonical);
        reference.values_mut().for_each(&canonical);
        assert_eq!(ours, reference, "{table} table differs from the reference");
    }
}

/// Each run of consecutive rules naming a Service port in their comment, sorted by that
/// name (stable: each Service's own rules keep their order).
fn sort_service_runs(rules: &mut [String]) {
    let service = |rule: &String| {
        let comment = rule.split("--comment \"").nth(1)?;
        let name = comment.split(['"', ' ']).next()?;
        name.contains('/').then(|| name.to_owned())
    };
    let mut start = 0;
    while start < rules.len() {
        let run = rules[start..]
            .iter()
            .take_while(|rule| service(rule).is_some())
            .count();
        rules[start..start + run].sort_by_key(service);
        start += run.max(1);
    }
}

#[test]
fn base_jumps_are_the_reference_jumps_plus_the_load_balancer_firewall() {
    let lb_firewall = "-m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL";
    for (table, name) in [(Table::Filter, "filter"), (Table::Nat, "nat")] {
        let reference = parse_dump(common::REFERENCE_DUMP, name);
        for builtin in BUILTIN_CHAINS {
            let ours: Vec<&str> = BASE_JUMPS
                .iter()
                .filter(|jump| jump.table == table && jump.builtin_chain == *builtin)
                .map(|jump| jump.rule)
                .filter(|rule| *rule != lb_firewall)
                .collect();
            let theirs: Vec<&str> = reference
                .get(*builtin)
                .map(|rules| rules.iter().map(String::as_str).collect())
                .unwrap_or_default();
            assert_eq!(ours, theirs, "{name} {builtin}");
        }
    }
    let firewall_hooks: Vec<&str> = BASE_JUMPS
        .iter()
        .filter(|jump| jump.rule == lb_firewall)
        .map(|jump| jump.builtin_chain)
        .collect();
    assert_eq!(firewall_hooks, ["INPUT", "FORWARD", "OUTPUT"]);
    // Only the POSTROUTING jump is the kubelet's too.
    let shared: Vec<&str> = BASE_JUMPS
        .iter()
        .filter(|jump| jump.shared)
        .map(|jump| jump.builtin_chain)
        .collect();
    assert_eq!(shared, ["POSTROUTING"]);
}

#[test]
fn restore_payload_lists_the_reference_rules_in_save_layout() {
    let ours = build(&common::reference_state(), &common::node_a());
    let nat = ours.restore_payload(Table::Nat);
    // Every KUBE-* line the kernel printed (other than the canary) is in our payload verbatim.
    let mut in_nat = false;
    for line in common::REFERENCE_DUMP.lines() {
        if let Some(name) = line.strip_prefix('*') {
            in_nat = name == "nat";
        }
        let ours_line = line.starts_with(":KUBE-") || line.starts_with("-A KUBE-");
        if in_nat && ours_line && !line.contains("KUBE-PROXY-CANARY") {
            assert!(
                nat.lines().any(|l| l == line),
                "missing from our payload: {line}"
            );
        }
    }
    assert!(nat.starts_with("*nat\n") && nat.ends_with("COMMIT\n"));
}
