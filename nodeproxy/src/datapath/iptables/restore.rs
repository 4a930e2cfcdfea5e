//! `iptables-restore` payloads: pure functions from what is applied and what is desired to
//! the text one restore call takes.
//!
//! Two kinds of payload exist because of the cost model of iptables-nft (1.8.9): a
//! `--noflush` restore looks every chain up one by one, so writing a 138k-line ruleset into
//! an empty table that way takes tens of seconds (39 s measured, >120 s on a busy machine),
//! while a flush-mode restore of the same text replaces the table in ~2-3 s. Flush mode
//! wipes the whole table though, so it is only used for a full write when an inspection of
//! the table (at start-up or after losing track; see `Syncer::inspect` for how it stays
//! cheap) shows nothing in it but built-in chains holding only our base jumps and chains we
//! own. The write is one transaction, so established connections (conntrack) are
//! unaffected. Everything else — the steady state, and full writes into tables shared with
//! others — uses `--noflush` and touches only our chains.
//!
//! Declaring a chain in a `--noflush` payload flushes it, so the chains the kubelet may hold
//! too ([`SHARED_CHAINS`]) are never declared there: a full write creates them with `-N`
//! when missing and appends (`-A`) only the rules they lack.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use tandem_proxy_rules::chains::{self, PER_SERVICE_PREFIXES};
use tandem_proxy_rules::ruleset::{BASE_JUMPS, BaseJump, SHARED_CHAINS, TableRules};

/// Chain the node proxy creates (empty) in mangle, nat and filter to notice when someone
/// flushes a table behind its back, as kube-proxy does.
pub const CANARY_CHAIN: &str = "KUBE-PROXY-CANARY";

/// The kubelet's canary chain (mangle, nat and filter): a table holding it is the kubelet's
/// too, and so may be the [`SHARED_CHAINS`] in it.
pub const KUBELET_CANARY_CHAIN: &str = "KUBE-KUBELET-CANARY";

/// The kubelet's filter chain, which node proxies before `KUBE-PROXY-FIREWALL` wrote too.
pub const KUBELET_FIREWALL_CHAIN: &str = "KUBE-FIREWALL";

/// The jump those node proxies put first in INPUT, FORWARD and OUTPUT; the kubelet v1.21
/// writes the same one into INPUT and OUTPUT, never into FORWARD.
const OLD_FIREWALL_JUMP: &str = "-j KUBE-FIREWALL";

/// The only rule those node proxies wrote into `KUBE-FIREWALL` (the kubelet v1.21 writes
/// it too, and its localnet guard after it).
const OLD_FIREWALL_RULE: &str = "-m comment --comment \"kubernetes firewall for dropping marked packets\" -m mark --mark 0x8000/0x8000 -j DROP";

/// Fixed-name chains the node proxy owns. Per-Service chains are recognised by prefix. Not
/// the kubelet's `KUBE-FIREWALL`, nor the [`SHARED_CHAINS`].
const OWNED_CHAINS: &[&str] = &[
    chains::KUBE_SERVICES,
    chains::KUBE_EXTERNAL_SERVICES,
    chains::KUBE_NODEPORTS,
    chains::KUBE_FORWARD,
    chains::KUBE_PROXY_FIREWALL,
    CANARY_CHAIN,
];

/// True for every chain name the node proxy alone creates and deletes.
pub fn is_owned_chain(name: &str) -> bool {
    OWNED_CHAINS.contains(&name) || PER_SERVICE_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// True for a chain of [`SHARED_CHAINS`] in `table`: ensured, never rewritten.
pub fn is_shared_chain(table: &str, name: &str) -> bool {
    SHARED_CHAINS
        .iter()
        .any(|(t, chain)| t.as_str() == table && *chain == name)
}

/// The built-in chains of a table, in the order `iptables-save` prints them.
pub fn builtin_chains(table: &str) -> &'static [&'static str] {
    match table {
        "nat" => &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"],
        "filter" => &["INPUT", "FORWARD", "OUTPUT"],
        "mangle" => &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
        _ => &[],
    }
}

/// Whether a restore replaces the whole table or only the chains it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreMode {
    Flush,
    NoFlush,
}

/// One restore call's input for one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    pub mode: RestoreMode,
    pub text: String,
    /// Chains written (declared and filled), our base-jump-carrying built-ins excluded.
    pub written_chains: usize,
    pub deleted_chains: usize,
    /// `-A` lines in the payload.
    pub rules: usize,
    /// The chains it writes or deletes, by name.
    pub chains: BTreeSet<String>,
}

/// The payload that takes a table from `applied` to `desired`, where only the chains
/// named in `candidates` may differ: declares and rewrites those whose rules differ,
/// deletes those that went away, or `None` when nothing changed. Declaring an existing
/// chain in `--noflush` mode flushes it; deleted chains are flushed too and removed with
/// `-X` after all rewritten chains, so nothing jumps to them any more by the time they go
/// (all in one transaction). `ensure` lines (repairs of built-in and shared chains) go
/// first.
pub fn incremental(
    table: &str,
    applied: &TableRules,
    desired: &TableRules,
    candidates: &BTreeSet<String>,
    ensure: &[String],
) -> Option<Payload> {
    // Shared chains never change (fixed rules) and must never be declared: skipped.
    let candidates: Vec<&String> = candidates
        .iter()
        .filter(|name| !is_shared_chain(table, name))
        .collect();
    let changed: Vec<&String> = candidates
        .iter()
        .copied()
        .filter(|name| {
            desired
                .chains
                .get(*name)
                .is_some_and(|rules| applied.chains.get(*name) != Some(rules))
        })
        .collect();
    let deleted: Vec<&String> = candidates
        .iter()
        .copied()
        .filter(|name| applied.chains.contains_key(*name) && !desired.chains.contains_key(*name))
        .collect();
    if changed.is_empty() && deleted.is_empty() && ensure.is_empty() {
        return None;
    }
    Some(noflush_payload(table, desired, ensure, &changed, &deleted))
}

/// [`incremental`] with every chain of either table as a candidate: a full comparison.
pub fn between(table: &str, applied: &TableRules, desired: &TableRules) -> Option<Payload> {
    let every_chain: BTreeSet<String> = applied
        .chains
        .keys()
        .chain(desired.chains.keys())
        .cloned()
        .collect();
    incremental(table, applied, desired, &every_chain, &[])
}

/// `ensure` lines (`-N`, `-A`) go first, so that the written chains' jumps find them.
fn noflush_payload(
    table: &str,
    desired: &TableRules,
    ensure: &[String],
    write: &[&String],
    delete: &[&String],
) -> Payload {
    let mut text = format!("*{table}\n");
    let mut rules = 0;
    for line in ensure {
        let _ = writeln!(text, "{line}");
        rules += usize::from(line.starts_with("-A "));
    }
    for chain in write.iter().chain(delete) {
        let _ = writeln!(text, ":{chain} - [0:0]");
    }
    for chain in write {
        for rule in desired.chains.get(*chain).into_iter().flatten() {
            let _ = writeln!(text, "-A {chain} {rule}");
            rules += 1;
        }
    }
    for chain in delete {
        let _ = writeln!(text, "-X {chain}");
    }
    text.push_str("COMMIT\n");
    Payload {
        mode: RestoreMode::NoFlush,
        text,
        written_chains: write.len(),
        deleted_chains: delete.len(),
        rules,
        chains: write.iter().chain(delete).map(|c| (*c).clone()).collect(),
    }
}

/// What an `iptables-save -t TABLE` showed: built-in chains with their policy and rules,
/// the names of all user-defined chains, and the rules of the shared chains.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableInspection {
    /// (chain, policy, rules as `iptables-save` prints them after `-A CHAIN `).
    pub builtins: Vec<(String, String, Vec<String>)>,
    pub user_chains: BTreeSet<String>,
    /// The rules of the [`SHARED_CHAINS`] present, as `iptables-save` prints them.
    pub shared: BTreeMap<String, Vec<String>>,
    /// filter: the rules of [`KUBELET_FIREWALL_CHAIN`], when present.
    pub kubelet_firewall: Vec<String>,
}

impl TableInspection {
    /// The kubelet's canary is in the table: the shared chains and jumps may be its.
    pub fn has_kubelet(&self) -> bool {
        self.user_chains.contains(KUBELET_CANARY_CHAIN)
    }
}

/// Parse `iptables-save` output for one table (the other tables' sections are ignored).
pub fn parse_save(text: &str, table: &str) -> TableInspection {
    let mut out = TableInspection::default();
    let mut in_table = false;
    let builtins = builtin_chains(table);
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('*') {
            in_table = name == table;
            continue;
        }
        if !in_table {
            continue;
        }
        if let Some(declaration) = line.strip_prefix(':') {
            let mut parts = declaration.split_whitespace();
            let (Some(chain), Some(policy)) = (parts.next(), parts.next()) else {
                continue;
            };
            if builtins.contains(&chain) {
                out.builtins
                    .push((chain.to_owned(), policy.to_owned(), Vec::new()));
            } else {
                out.user_chains.insert(chain.to_owned());
            }
        } else if let Some(rest) = line.strip_prefix("-A ") {
            let (chain, rule) = rest.split_once(' ').unwrap_or((rest, ""));
            if let Some(entry) = out.builtins.iter_mut().find(|(c, _, _)| c == chain) {
                entry.2.push(rule.to_owned());
            } else if is_shared_chain(table, chain) {
                out.shared
                    .entry(chain.to_owned())
                    .or_default()
                    .push(rule.to_owned());
            } else if table == "filter" && chain == KUBELET_FIREWALL_CHAIN {
                out.kubelet_firewall.push(rule.to_owned());
            }
        }
    }
    out
}

/// Chain names of one table in `nft list chains ip` output (iptables-nft keeps each
/// iptables table as an nftables table of the same name in family `ip`).
pub fn parse_nft_chains(listing: &str, table: &str) -> BTreeSet<String> {
    let mut chains = BTreeSet::new();
    let mut in_table = false;
    for line in listing.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("table ip ") {
            in_table = rest.trim_end_matches('{').trim().trim_matches('"') == table;
        } else if line.starts_with("table ") {
            in_table = false;
        } else if in_table && let Some(rest) = line.strip_prefix("chain ") {
            chains.insert(
                rest.trim_end_matches('{')
                    .trim()
                    .trim_matches('"')
                    .to_owned(),
            );
        }
    }
    chains
}

/// `iptables -S CHAIN` output (`-P CHAIN POLICY` / `-A CHAIN rule`) as `iptables-save`
/// lines, for [`parse_save`].
pub fn chain_listing_as_save(listing: &str) -> String {
    let mut out = String::new();
    for line in listing.lines() {
        if let Some(rest) = line.strip_prefix("-P ") {
            let _ = writeln!(out, ":{rest} [0:0]");
        } else if line.starts_with("-A ") {
            let _ = writeln!(out, "{line}");
        }
    }
    out
}

/// The base jumps of `table`, in the order they must stand in each built-in chain.
fn base_jumps(table: &str) -> impl Iterator<Item = (&'static str, &'static str)> + '_ {
    BASE_JUMPS
        .iter()
        .filter(move |jump| jump.table.as_str() == table)
        .map(|jump| (jump.builtin_chain, jump.rule))
}

/// True when a flush-mode restore of the table loses nothing that is not ours: every user
/// chain is one we own or a shared one (no kubelet's canary, so no kubelet, is there), and
/// the built-in chains hold nothing but our base jumps.
pub fn holds_only_ours(table: &str, inspection: &TableInspection) -> bool {
    let jumps: Vec<_> = base_jumps(table).collect();
    inspection
        .user_chains
        .iter()
        .all(|c| is_owned_chain(c) || is_shared_chain(table, c))
        && inspection.builtins.iter().all(|(chain, _, rules)| {
            rules
                .iter()
                .all(|rule| jumps.contains(&(chain.as_str(), rule.as_str())))
        })
}

/// The payload that writes the whole desired table when what is applied is unknown (first
/// sync, after a failure, after someone flushed our chains).
///
/// With a table that holds only what is ours this is a flush-mode restore that also writes
/// the built-in chains (keeping their policies) with our base jumps in order. Otherwise it
/// is a `--noflush` restore of all desired chains but the shared ones, which it only
/// ensures ([`ensure_shared`]); it also deletes the chains we own but no longer want (found
/// by the inspection). The caller then ensures the base jumps itself.
pub fn full(table: &str, inspection: &TableInspection, desired: &TableRules) -> Payload {
    if holds_only_ours(table, inspection) {
        return flush_payload(table, inspection, desired);
    }
    let write: Vec<&String> = desired
        .chains
        .keys()
        .filter(|c| !is_shared_chain(table, c))
        .collect();
    let stale: Vec<&String> = inspection
        .user_chains
        .iter()
        .filter(|c| is_owned_chain(c) && !desired.chains.contains_key(*c))
        .collect();
    let ensure = ensure_shared(table, inspection, desired);
    noflush_payload(table, desired, &ensure, &write, &stale)
}

/// Restore lines that give every desired shared chain at least its desired rules without
/// touching what it holds: `-N` for a missing chain, `-A` for each rule it lacks. On a node
/// with the kubelet v1.21 there is nothing to do: its rules are ours, byte for byte.
pub fn ensure_shared(
    table: &str,
    inspection: &TableInspection,
    desired: &TableRules,
) -> Vec<String> {
    let mut lines = Vec::new();
    for (chain, rules) in desired
        .chains
        .iter()
        .filter(|(c, _)| is_shared_chain(table, c))
    {
        if !inspection.user_chains.contains(chain) {
            lines.push(format!("-N {chain}"));
        }
        let present = inspection.shared.get(chain).map_or(&[][..], Vec::as_slice);
        for rule in rules.iter().filter(|rule| !present.contains(rule)) {
            lines.push(format!("-A {chain} {rule}"));
        }
    }
    lines
}

fn flush_payload(table: &str, inspection: &TableInspection, desired: &TableRules) -> Payload {
    let mut text = format!("*{table}\n");
    for builtin in builtin_chains(table) {
        let policy = inspection
            .builtins
            .iter()
            .find(|(chain, _, _)| chain == builtin)
            .map_or("ACCEPT", |(_, policy, _)| policy.as_str());
        let _ = writeln!(text, ":{builtin} {policy} [0:0]");
    }
    for chain in desired.chains.keys() {
        let _ = writeln!(text, ":{chain} - [0:0]");
    }
    let mut rules = 0;
    for (builtin, rule) in base_jumps(table) {
        let _ = writeln!(text, "-A {builtin} {rule}");
        rules += 1;
    }
    for (chain, chain_rules) in &desired.chains {
        for rule in chain_rules {
            let _ = writeln!(text, "-A {chain} {rule}");
            rules += 1;
        }
    }
    text.push_str("COMMIT\n");
    Payload {
        mode: RestoreMode::Flush,
        text,
        written_chains: desired.chains.len(),
        deleted_chains: 0,
        rules,
        chains: desired.chains.keys().cloned().collect(),
    }
}

/// What `--cleanup` removes from one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cleanup {
    /// Base jumps to delete (every copy), before the chains.
    pub jumps: Vec<&'static BaseJump>,
    /// The `--noflush` payload that flushes and deletes the chains, or `None` for none.
    pub payload: Option<String>,
}

/// Everything of ours in the table: our chains and base jumps, and the shared chains and
/// jumps too where no kubelet is (then we made them); where the kubelet is, they stay,
/// since the kubelet v1.21 puts them back only when its canary goes.
pub fn cleanup(table: &str, inspection: &TableInspection) -> Cleanup {
    let kubelet = inspection.has_kubelet();
    let jumps = BASE_JUMPS
        .iter()
        .filter(|jump| jump.table.as_str() == table && !(jump.shared && kubelet))
        .collect();
    let chains: Vec<&String> = inspection
        .user_chains
        .iter()
        .filter(|c| is_owned_chain(c) || (!kubelet && is_shared_chain(table, c)))
        .collect();
    let payload = (!chains.is_empty())
        .then(|| noflush_payload(table, &TableRules::default(), &[], &[], &chains).text);
    Cleanup { jumps, payload }
}

/// What node proxies before `KUBE-PROXY-FIREWALL` left in the filter table that is
/// certainly theirs, to remove at start-up and by `--cleanup`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OldFirewall {
    /// `(built-in chain, rule)` jumps to delete (every copy), before the chain.
    pub jumps: Vec<(&'static str, &'static str)>,
    /// The `--noflush` payload that deletes their `KUBE-FIREWALL`, or `None` to keep it.
    pub payload: Option<String>,
}

impl OldFirewall {
    pub fn is_empty(&self) -> bool {
        self.jumps.is_empty() && self.payload.is_none()
    }
}

/// Those versions jumped to `KUBE-FIREWALL` from FORWARD, which the kubelet never does:
/// that jump goes wherever it is. Where no kubelet is (no canary in filter) they also
/// created `KUBE-FIREWALL` and its INPUT and OUTPUT jumps: those go too, when the chain
/// holds nothing but the rule they wrote (anything else was written by someone else).
pub fn old_firewall(table: &str, inspection: &TableInspection) -> OldFirewall {
    let mut out = OldFirewall::default();
    if table != "filter" {
        return out;
    }
    let jumps_from = |builtin: &str| {
        inspection.builtins.iter().any(|(chain, _, rules)| {
            chain == builtin && rules.iter().any(|r| r == OLD_FIREWALL_JUMP)
        })
    };
    if jumps_from("FORWARD") {
        out.jumps.push(("FORWARD", OLD_FIREWALL_JUMP));
    }
    let ours = inspection.user_chains.contains(KUBELET_FIREWALL_CHAIN)
        && !inspection.has_kubelet()
        && inspection
            .kubelet_firewall
            .iter()
            .all(|rule| rule == OLD_FIREWALL_RULE);
    if ours {
        for builtin in ["INPUT", "OUTPUT"] {
            if jumps_from(builtin) {
                out.jumps.push((builtin, OLD_FIREWALL_JUMP));
            }
        }
        let chain = KUBELET_FIREWALL_CHAIN.to_owned();
        out.payload =
            Some(noflush_payload(table, &TableRules::default(), &[], &[], &[&chain]).text);
    }
    out
}

/// The payload line an `iptables-restore` error message blames, if it names one.
/// iptables 1.8 says `iptables-restore: line 7 failed` or `Error occurred at line: 7`.
pub fn failing_line(stderr: &str) -> Option<usize> {
    for line in stderr.lines() {
        if let Some(rest) = line.split("line ").nth(1)
            && let Some(number) = rest.strip_suffix(" failed")
            && let Ok(n) = number.trim().parse()
        {
            return Some(n);
        }
        if let Some(rest) = line.split("Error occurred at line:").nth(1)
            && let Ok(n) = rest.trim().parse()
        {
            return Some(n);
        }
    }
    None
}

/// Lines `line - radius ..= line + radius` of the payload (1-based, as iptables counts),
/// numbered, with the failing one marked.
pub fn context_lines(payload: &str, line: usize, radius: usize) -> String {
    let first = line.saturating_sub(radius).max(1);
    let mut out = String::new();
    for (index, text) in payload.lines().enumerate() {
        let number = index + 1;
        if number >= first && number <= line + radius {
            let marker = if number == line { ">" } else { " " };
            let _ = writeln!(out, "{marker}{number:6} {text}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_proxy_rules::ruleset::Table;

    fn rules(chains: &[(&str, &[&str])]) -> TableRules {
        TableRules {
            chains: chains
                .iter()
                .map(|(name, rules)| {
                    (
                        (*name).to_owned(),
                        rules.iter().map(|r| (*r).to_owned()).collect(),
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn unchanged_table_needs_no_restore() {
        let t = rules(&[("KUBE-SERVICES", &["-j RETURN"]), ("KUBE-SVC-A", &[])]);
        assert_eq!(between("nat", &t, &t), None);
    }

    #[test]
    fn only_changed_chains_are_written_and_gone_ones_deleted_last() {
        let applied = rules(&[
            (
                "KUBE-SERVICES",
                &[
                    "-d 10.96.0.1/32 -j KUBE-SVC-A",
                    "-d 10.96.0.2/32 -j KUBE-SVC-B",
                ],
            ),
            ("KUBE-SVC-A", &["-j KUBE-SEP-A1"]),
            ("KUBE-SEP-A1", &["-j DNAT --to-destination 10.244.1.5:80"]),
            ("KUBE-SVC-B", &["-j KUBE-SEP-B1"]),
            ("KUBE-SEP-B1", &["-j DNAT --to-destination 10.244.1.6:80"]),
        ]);
        let desired = rules(&[
            ("KUBE-SERVICES", &["-d 10.96.0.1/32 -j KUBE-SVC-A"]),
            (
                "KUBE-SVC-A",
                &[
                    "-m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-A1",
                    "-j KUBE-SEP-A2",
                ],
            ),
            ("KUBE-SEP-A1", &["-j DNAT --to-destination 10.244.1.5:80"]),
            ("KUBE-SEP-A2", &["-j DNAT --to-destination 10.244.2.5:80"]),
        ]);
        let payload = between("nat", &applied, &desired).unwrap();
        assert_eq!(payload.mode, RestoreMode::NoFlush);
        assert_eq!(
            payload.text,
            "*nat\n\
             :KUBE-SEP-A2 - [0:0]\n\
             :KUBE-SERVICES - [0:0]\n\
             :KUBE-SVC-A - [0:0]\n\
             :KUBE-SEP-B1 - [0:0]\n\
             :KUBE-SVC-B - [0:0]\n\
             -A KUBE-SEP-A2 -j DNAT --to-destination 10.244.2.5:80\n\
             -A KUBE-SERVICES -d 10.96.0.1/32 -j KUBE-SVC-A\n\
             -A KUBE-SVC-A -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-A1\n\
             -A KUBE-SVC-A -j KUBE-SEP-A2\n\
             -X KUBE-SEP-B1\n\
             -X KUBE-SVC-B\n\
             COMMIT\n"
        );
        assert_eq!(
            (
                payload.written_chains,
                payload.deleted_chains,
                payload.rules
            ),
            (3, 2, 4)
        );
    }

    #[test]
    fn a_chain_emptied_is_rewritten_empty() {
        let applied = rules(&[("KUBE-NODEPORTS", &["-p tcp -j KUBE-SVC-A"])]);
        let desired = rules(&[("KUBE-NODEPORTS", &[])]);
        let payload = between("nat", &applied, &desired).unwrap();
        assert_eq!(payload.text, "*nat\n:KUBE-NODEPORTS - [0:0]\nCOMMIT\n");
    }

    const SAVE: &str = "# Generated by iptables-save v1.8.9 (nf_tables)\n\
        *mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n\
        *filter\n\
        :INPUT ACCEPT [0:0]\n:FORWARD DROP [12:345]\n:OUTPUT ACCEPT [0:0]\n\
        :KUBE-PROXY-FIREWALL - [0:0]\n:KUBE-SVC-OLD - [0:0]\n\
        -A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
        -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
        -A KUBE-PROXY-FIREWALL -m mark --mark 0x8000/0x8000 -j DROP\n\
        COMMIT\n";

    /// The kubelet v1.21's chains (see the file's note).
    const KUBELET: &str = include_str!("../../../tests/data/kubelet-v1.21.iptables");
    const LB_FIREWALL_JUMP: &str = "-m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL";

    #[test]
    fn save_output_is_parsed_per_table() {
        let inspection = parse_save(SAVE, "filter");
        assert_eq!(
            inspection.builtins,
            vec![
                (
                    "INPUT".to_owned(),
                    "ACCEPT".to_owned(),
                    vec![LB_FIREWALL_JUMP.to_owned()]
                ),
                (
                    "FORWARD".to_owned(),
                    "DROP".to_owned(),
                    vec![
                        "-m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD"
                            .to_owned()
                    ]
                ),
                ("OUTPUT".to_owned(), "ACCEPT".to_owned(), vec![]),
            ]
        );
        assert_eq!(
            inspection.user_chains,
            ["KUBE-PROXY-FIREWALL".to_owned(), "KUBE-SVC-OLD".to_owned()].into()
        );
        assert_eq!(
            parse_save(SAVE, "mangle").user_chains,
            [CANARY_CHAIN.to_owned()].into()
        );
        assert_eq!(parse_save(SAVE, "nat"), TableInspection::default());
    }

    #[test]
    fn a_table_of_our_own_is_written_in_flush_mode_keeping_policies() {
        let inspection = parse_save(SAVE, "filter");
        assert!(holds_only_ours("filter", &inspection));
        let desired = rules(&[(
            "KUBE-PROXY-FIREWALL",
            &["-m mark --mark 0x8000/0x8000 -j DROP"],
        )]);
        let payload = full("filter", &inspection, &desired);
        assert_eq!(payload.mode, RestoreMode::Flush);
        let expected_head = format!(
            "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n:KUBE-PROXY-FIREWALL - [0:0]\n-A INPUT {LB_FIREWALL_JUMP}\n"
        );
        assert!(payload.text.starts_with(&expected_head), "{}", payload.text);
        // Every filter base jump is in it, in BASE_JUMPS order, then our rules.
        let jump_lines: Vec<_> = payload
            .text
            .lines()
            .filter(|l| {
                l.starts_with("-A INPUT")
                    || l.starts_with("-A FORWARD")
                    || l.starts_with("-A OUTPUT")
            })
            .collect();
        let expected: Vec<_> = BASE_JUMPS
            .iter()
            .filter(|j| j.table == Table::Filter)
            .map(|j| format!("-A {} {}", j.builtin_chain, j.rule))
            .collect();
        assert_eq!(jump_lines, expected);
        assert!(
            payload
                .text
                .ends_with("-A KUBE-PROXY-FIREWALL -m mark --mark 0x8000/0x8000 -j DROP\nCOMMIT\n")
        );
        // The stale KUBE-SVC-OLD disappears with the flush.
        assert!(!payload.text.contains("KUBE-SVC-OLD"));
    }

    #[test]
    fn an_empty_table_is_written_in_flush_mode_with_default_policies() {
        let payload = full(
            "nat",
            &TableInspection::default(),
            &rules(&[("KUBE-SERVICES", &[])]),
        );
        assert_eq!(payload.mode, RestoreMode::Flush);
        assert!(payload.text.starts_with("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n"));
    }

    #[test]
    fn a_shared_table_is_written_without_flush_and_our_stale_chains_go() {
        for foreign in [
            "*filter\n:INPUT ACCEPT [0:0]\n:DOCKER - [0:0]\n:KUBE-SVC-OLD - [0:0]\nCOMMIT\n",
            "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-SVC-OLD - [0:0]\n-A INPUT -s 1.2.3.4/32 -j DROP\nCOMMIT\n",
            "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-SVC-OLD - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n",
        ] {
            let inspection = parse_save(foreign, "filter");
            assert!(!holds_only_ours("filter", &inspection));
            let payload = full(
                "filter",
                &inspection,
                &rules(&[("KUBE-PROXY-FIREWALL", &["-j DROP"])]),
            );
            assert_eq!(payload.mode, RestoreMode::NoFlush);
            assert_eq!(
                payload.text,
                "*filter\n:KUBE-PROXY-FIREWALL - [0:0]\n:KUBE-SVC-OLD - [0:0]\n-A KUBE-PROXY-FIREWALL -j DROP\n-X KUBE-SVC-OLD\nCOMMIT\n"
            );
        }
    }

    #[test]
    fn ownership_is_by_name() {
        for ours in [
            "KUBE-SERVICES",
            "KUBE-SVC-6IM33IEVEEV7U3GP",
            "KUBE-SEP-X",
            "KUBE-FW-X",
            "KUBE-XLB-X",
            "KUBE-SVL-X",
            "KUBE-PROXY-FIREWALL",
            CANARY_CHAIN,
        ] {
            assert!(is_owned_chain(ours), "{ours}");
        }
        // The kubelet's, and those it may share with us.
        for foreign in [
            "DOCKER",
            "KUBE-KUBELET-CANARY",
            "KUBE-IPTABLES-HINT",
            "KUBE-FIREWALL",
            "KUBE-MARK-DROP",
            "KUBE-MARK-MASQ",
            "KUBE-POSTROUTING",
            "KUBE-SERVICES-X",
            "CILIUM_INPUT",
            "INPUT",
        ] {
            assert!(!is_owned_chain(foreign), "{foreign}");
        }
    }

    #[test]
    fn nft_chain_listings_are_parsed_per_table() {
        let listing = "table ip filter {\n\tchain INPUT {\n\t\ttype filter hook input priority filter; policy accept;\n\t}\n\tchain KUBE-FIREWALL {\n\t}\n}\ntable ip nat {\n\tchain PREROUTING {\n\t\ttype nat hook prerouting priority dstnat; policy accept;\n\t}\n\tchain KUBE-SVC-X {\n\t}\n\tchain \"weird name\" {\n\t}\n}\ntable ip6 nat {\n\tchain OTHER {\n\t}\n}\n";
        assert_eq!(
            parse_nft_chains(listing, "nat"),
            [
                "PREROUTING".to_owned(),
                "KUBE-SVC-X".to_owned(),
                "weird name".to_owned()
            ]
            .into()
        );
        assert_eq!(
            parse_nft_chains(listing, "filter"),
            ["INPUT".to_owned(), "KUBE-FIREWALL".to_owned()].into()
        );
        assert!(parse_nft_chains(listing, "mangle").is_empty());
    }

    #[test]
    fn chain_listings_become_save_lines() {
        let listing = "-P FORWARD DROP\n-A FORWARD -j KUBE-FIREWALL\n";
        let save = format!("*filter\n{}", chain_listing_as_save(listing));
        assert_eq!(
            parse_save(&save, "filter").builtins,
            vec![(
                "FORWARD".to_owned(),
                "DROP".to_owned(),
                vec!["-j KUBE-FIREWALL".to_owned()]
            )]
        );
    }

    #[test]
    fn cleanup_removes_only_our_chains() {
        let inspection = parse_save(
            "*filter\n:INPUT ACCEPT [0:0]\n:DOCKER - [0:0]\n:KUBE-FIREWALL - [0:0]\n:KUBE-PROXY-FIREWALL - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n",
            "filter",
        );
        let plan = cleanup("filter", &inspection);
        assert_eq!(
            plan.payload.unwrap(),
            "*filter\n:KUBE-PROXY-CANARY - [0:0]\n:KUBE-PROXY-FIREWALL - [0:0]\n-X KUBE-PROXY-CANARY\n-X KUBE-PROXY-FIREWALL\nCOMMIT\n"
        );
        assert_eq!(plan.jumps.len(), 9);
        assert_eq!(cleanup("nat", &TableInspection::default()).payload, None);
    }

    /// The kubelet's chains plus ours, as a table looks after a sync on a kubelet's node.
    fn kubelet_table_with_ours(table: &str) -> TableInspection {
        let ours = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-A - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\n\
            -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\nCOMMIT\n\
            *filter\n:KUBE-SERVICES - [0:0]\n:KUBE-PROXY-FIREWALL - [0:0]\nCOMMIT\n";
        let mut inspection = parse_save(KUBELET, table);
        let extra = parse_save(ours, table);
        inspection.user_chains.extend(extra.user_chains);
        inspection
    }

    #[test]
    fn on_a_kubelets_node_the_shared_chains_are_neither_declared_nor_touched() {
        let nat = parse_save(KUBELET, "nat");
        assert!(nat.has_kubelet());
        assert!(!holds_only_ours("nat", &nat));
        assert_eq!(nat.shared.len(), 3);
        let desired = rules(&[
            ("KUBE-SERVICES", &["-j KUBE-MARK-MASQ"]),
            ("KUBE-MARK-DROP", &["-j MARK --set-xmark 0x8000/0x8000"]),
            ("KUBE-MARK-MASQ", &["-j MARK --set-xmark 0x4000/0x4000"]),
            (
                "KUBE-POSTROUTING",
                &[
                    "-m mark ! --mark 0x4000/0x4000 -j RETURN",
                    "-j MARK --set-xmark 0x4000/0x0",
                    "-m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully",
                ],
            ),
        ]);
        // The kubelet v1.21's rules are ours byte for byte: nothing to ensure.
        assert_eq!(ensure_shared("nat", &nat, &desired), Vec::<String>::new());
        let payload = full("nat", &nat, &desired);
        assert_eq!(payload.mode, RestoreMode::NoFlush);
        assert_eq!(
            payload.text,
            "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j KUBE-MARK-MASQ\nCOMMIT\n"
        );
        // Nor does an incremental sync declare them, even if they seemed to differ.
        let payload = between("nat", &TableRules::default(), &desired).unwrap();
        assert_eq!(
            payload.text,
            "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j KUBE-MARK-MASQ\nCOMMIT\n"
        );

        let filter = parse_save(KUBELET, "filter");
        let payload = full(
            "filter",
            &filter,
            &rules(&[("KUBE-PROXY-FIREWALL", &["-j DROP"])]),
        );
        assert_eq!(payload.mode, RestoreMode::NoFlush);
        assert!(!payload.text.contains("KUBE-FIREWALL"), "{}", payload.text);
    }

    #[test]
    fn missing_shared_chains_are_created_and_incomplete_ones_completed() {
        let desired = rules(&[
            ("KUBE-MARK-DROP", &["-j MARK --set-xmark 0x8000/0x8000"]),
            ("KUBE-POSTROUTING", &["-j A", "-j B"]),
        ]);
        let inspection = parse_save(
            "*nat\n:DOCKER - [0:0]\n:KUBE-POSTROUTING - [0:0]\n-A KUBE-POSTROUTING -j A\nCOMMIT\n",
            "nat",
        );
        let payload = full("nat", &inspection, &desired);
        assert_eq!(payload.mode, RestoreMode::NoFlush);
        assert_eq!(
            payload.text,
            "*nat\n-N KUBE-MARK-DROP\n-A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000\n-A KUBE-POSTROUTING -j B\nCOMMIT\n"
        );
        assert_eq!(payload.rules, 2);
        // Without anything foreign the flush-mode write holds them whole.
        let payload = full("nat", &TableInspection::default(), &desired);
        assert_eq!(payload.mode, RestoreMode::Flush);
        assert!(payload.text.contains(":KUBE-MARK-DROP - [0:0]\n"));
    }

    #[test]
    fn cleanup_leaves_the_shared_chains_and_jumps_where_the_kubelet_is() {
        let plan = cleanup("nat", &kubelet_table_with_ours("nat"));
        assert_eq!(
            plan.payload.unwrap(),
            "*nat\n:KUBE-PROXY-CANARY - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-A - [0:0]\n-X KUBE-PROXY-CANARY\n-X KUBE-SERVICES\n-X KUBE-SVC-A\nCOMMIT\n"
        );
        assert!(plan.jumps.iter().all(|jump| !jump.shared));
        assert_eq!(plan.jumps.len(), 2);
        let plan = cleanup("filter", &kubelet_table_with_ours("filter"));
        assert!(!plan.payload.unwrap().contains("KUBE-FIREWALL -"));
        assert!(
            cleanup("mangle", &parse_save(KUBELET, "mangle"))
                .payload
                .is_none()
        );

        // Without the kubelet we made them: they go.
        let mut alone = kubelet_table_with_ours("nat");
        alone.user_chains.remove(KUBELET_CANARY_CHAIN);
        let plan = cleanup("nat", &alone);
        let payload = plan.payload.unwrap();
        for chain in ["KUBE-MARK-DROP", "KUBE-MARK-MASQ", "KUBE-POSTROUTING"] {
            assert!(payload.contains(&format!("-X {chain}\n")), "{payload}");
        }
        assert_eq!(plan.jumps.len(), 3);
    }

    /// A filter table after an older node proxy: its `-j KUBE-FIREWALL` jumps from INPUT,
    /// FORWARD and OUTPUT and the drop rule, with the kubelet's canary or without.
    fn old_version_filter(kubelet: bool, extra_rule: Option<&str>) -> TableInspection {
        let mut save = String::from(
            "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n",
        );
        if kubelet {
            save.push_str(":KUBE-KUBELET-CANARY - [0:0]\n");
        }
        for builtin in ["INPUT", "FORWARD", "OUTPUT"] {
            save.push_str(&format!("-A {builtin} {OLD_FIREWALL_JUMP}\n"));
        }
        save.push_str(&format!("-A KUBE-FIREWALL {OLD_FIREWALL_RULE}\n"));
        if let Some(rule) = extra_rule {
            save.push_str(&format!("-A KUBE-FIREWALL {rule}\n"));
        }
        save.push_str("COMMIT\n");
        parse_save(&save, "filter")
    }

    #[test]
    fn an_older_versions_kube_firewall_goes_only_where_it_is_certainly_ours() {
        // Without the kubelet: the chain and all three jumps.
        let alone = old_firewall("filter", &old_version_filter(false, None));
        assert_eq!(
            alone.jumps,
            vec![
                ("FORWARD", OLD_FIREWALL_JUMP),
                ("INPUT", OLD_FIREWALL_JUMP),
                ("OUTPUT", OLD_FIREWALL_JUMP)
            ]
        );
        assert_eq!(
            alone.payload.as_deref(),
            Some("*filter\n:KUBE-FIREWALL - [0:0]\n-X KUBE-FIREWALL\nCOMMIT\n")
        );
        // With the kubelet: only the FORWARD jump, which the kubelet never writes.
        let kubelet = old_firewall("filter", &old_version_filter(true, None));
        assert_eq!(kubelet.jumps, vec![("FORWARD", OLD_FIREWALL_JUMP)]);
        assert_eq!(kubelet.payload, None);
        // A chain holding a rule the old version never wrote is someone else's.
        let guard = "! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment \"block incoming localnet connections\" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP";
        let foreign = old_firewall("filter", &old_version_filter(false, Some(guard)));
        assert_eq!(foreign.jumps, vec![("FORWARD", OLD_FIREWALL_JUMP)]);
        assert_eq!(foreign.payload, None);
        // Nothing old, or another table: nothing to do.
        let clean = parse_save("*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n", "filter");
        assert!(old_firewall("filter", &clean).is_empty());
        assert!(old_firewall("nat", &old_version_filter(false, None)).is_empty());
    }

    #[test]
    fn failing_lines_are_found_in_both_message_styles() {
        assert_eq!(failing_line("iptables-restore: line 7 failed\n"), Some(7));
        assert_eq!(
            failing_line(
                "iptables-nft-restore v1.8.9 (nf_tables): unknown option \"--bogus\"\nError occurred at line: 12\nTry `iptables-restore -h' for more information.\n"
            ),
            Some(12)
        );
        assert_eq!(
            failing_line("Another app is currently holding the xtables lock.\n"),
            None
        );
    }

    #[test]
    fn context_shows_numbered_lines_around_the_failure() {
        let payload = "a\nb\nc\nd\ne\n";
        assert_eq!(
            context_lines(payload, 2, 1),
            "      1 a\n>     2 b\n      3 c\n"
        );
        assert_eq!(context_lines(payload, 5, 1), "      4 d\n>     5 e\n");
    }
}

#[cfg(test)]
mod properties {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// What `iptables-restore --noflush` does to a table's chains for our payloads:
    /// declaring a chain creates or flushes it, `-A` appends, `-X` deletes.
    fn apply(mut table: TableRules, payload: &str) -> TableRules {
        for line in payload.lines() {
            if let Some(declaration) = line.strip_prefix(':') {
                let chain = declaration.split_whitespace().next().unwrap().to_owned();
                table.chains.insert(chain, Vec::new());
            } else if let Some(rest) = line.strip_prefix("-A ") {
                let (chain, rule) = rest.split_once(' ').unwrap();
                table.chains.get_mut(chain).unwrap().push(rule.to_owned());
            } else if let Some(chain) = line.strip_prefix("-X ") {
                table.chains.remove(chain);
            }
        }
        table
    }

    fn table() -> impl Strategy<Value = TableRules> {
        prop::collection::btree_map(
            "KUBE-(SVC|SEP)-[A-D]",
            prop::collection::vec("-j [A-C]", 0..3),
            0..6,
        )
        .prop_map(|chains: BTreeMap<String, Vec<String>>| TableRules { chains })
    }

    proptest! {
        #[test]
        fn an_incremental_payload_takes_applied_to_desired(applied in table(), desired in table()) {
            match between("nat", &applied, &desired) {
                None => prop_assert_eq!(&applied, &desired),
                Some(payload) => {
                    prop_assert_eq!(apply(applied.clone(), &payload.text), desired.clone());
                    // Unchanged chains are never touched.
                    for (chain, rules) in &applied.chains {
                        if desired.chains.get(chain) == Some(rules) {
                            let declaration = format!(":{chain} ");
                            prop_assert!(!payload.text.contains(&declaration));
                        }
                    }
                }
            }
        }

        #[test]
        fn a_full_payload_writes_desired_over_any_table_of_ours(existing in table(), desired in table()) {
            let inspection = TableInspection {
                user_chains: existing.chains.keys().cloned().collect(),
                ..TableInspection::default()
            };
            let payload = full("nat", &inspection, &desired);
            prop_assert_eq!(payload.mode, RestoreMode::Flush);
            let ours = apply(TableRules::default(), &payload.text);
            for (chain, rules) in &desired.chains {
                prop_assert_eq!(ours.chains.get(chain), Some(rules));
            }
        }
    }
}
