//! Root only: every scenario's ruleset (with the base jumps) is loaded into a fresh network
//! namespace with `iptables-restore`, on the nf_tables and on the legacy backend, and
//! `iptables-save` must print back exactly our rule texts, in our order. This proves the
//! kernel accepts everything `build` emits and that the desired ruleset can be compared
//! with the kernel's text without normalising.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::netns::{Netns, is_root};

use std::collections::BTreeMap;

use tandem_proxy_rules::build;
use tandem_proxy_rules::ruleset::{BASE_JUMPS, Ruleset, Table};

/// A flush-mode payload of one table: our chains plus the base jumps, in order.
fn payload(ruleset: &Ruleset, table: Table) -> String {
    let ours = ruleset.restore_payload(table);
    let body = ours.strip_suffix("COMMIT\n").unwrap();
    let mut text = body.to_owned();
    for jump in BASE_JUMPS.iter().filter(|jump| jump.table == table) {
        text.push_str(&format!("-A {} {}\n", jump.builtin_chain, jump.rule));
    }
    text + "COMMIT\n"
}

/// `chain -> rules` of one table of `iptables-save` output, leaving out empty built-ins.
fn saved_rules(save: &str) -> BTreeMap<String, Vec<String>> {
    let mut chains: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in save.lines() {
        if let Some(decl) = line.strip_prefix(':') {
            let chain = decl.split_whitespace().next().unwrap();
            if chain.starts_with("KUBE-") {
                chains.entry(chain.to_owned()).or_default();
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let (chain, rule) = rule.split_once(' ').unwrap();
            chains
                .entry(chain.to_owned())
                .or_default()
                .push(rule.to_owned());
        }
    }
    chains
}

fn expected_rules(ruleset: &Ruleset, table: Table) -> BTreeMap<String, Vec<String>> {
    let mut chains = ruleset.table(table).chains.clone();
    for jump in BASE_JUMPS.iter().filter(|jump| jump.table == table) {
        chains
            .entry(jump.builtin_chain.to_owned())
            .or_default()
            .push(jump.rule.to_owned());
    }
    chains
}

fn round_trip_every_scenario(restore: &str, save: &str, suffix: &str) {
    if !is_root() {
        eprintln!("skipped: needs root for network namespaces");
        return;
    }
    let netns = Netns::create(suffix);
    for (name, state) in common::scenarios() {
        let ruleset = build(&state, &common::node_a());
        for table in [Table::Filter, Table::Nat] {
            // Flush mode is fine here: the namespace is ours alone.
            netns.run(restore, &[], &payload(&ruleset, table));
            let saved = netns.run(save, &["-t", table.as_str()], "");
            assert_eq!(
                saved_rules(&saved),
                expected_rules(&ruleset, table),
                "{name}: {} table differs after {restore}",
                table.as_str()
            );
        }
    }
}

#[test]
fn kernel_prints_back_our_exact_rules_nf_tables() {
    round_trip_every_scenario("iptables-nft-restore", "iptables-nft-save", "nft");
}

#[test]
fn kernel_prints_back_our_exact_rules_legacy() {
    round_trip_every_scenario("iptables-legacy-restore", "iptables-legacy-save", "leg");
}
