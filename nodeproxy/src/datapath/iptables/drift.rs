//! Drift in the iptables mode: what the periodic read-back found in a table, compared with
//! what the node proxy last wrote there (pure).
//!
//! Chains of our own are compared rule by rule through a digest per rule: of the rule's
//! text on the legacy backend (`iptables-save` prints exactly the text we write), of its
//! nf_tables form on the nf_tables backend (recorded right after each write, since only
//! the kernel knows the form iptables-nft gave it). Built-in chains are shared with
//! everyone, so in them only our base jumps are looked for; the chains we share with the
//! kubelet only need to hold our rules.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hasher};

use tandem_proxy_rules::ruleset::{BASE_JUMPS, BaseJump, Table, TableRules};

use crate::datapath::iptables::restore::{self, CANARY_CHAIN, TableInspection};

/// The digest of a rule's `iptables-save` text (after `-A CHAIN `).
pub fn rule_digest(rule: &str) -> u64 {
    let mut h = DefaultHasher::new();
    h.write(rule.as_bytes());
    h.finish()
}

/// The digests of each of `chains`' rules, in order.
pub fn chain_digests<'a>(
    chains: impl IntoIterator<Item = (&'a String, &'a Vec<String>)>,
) -> BTreeMap<String, Vec<u64>> {
    chains
        .into_iter()
        .map(|(chain, rules)| {
            (
                chain.clone(),
                rules.iter().map(|rule| rule_digest(rule)).collect(),
            )
        })
        .collect()
}

/// True for the chains compared rule by rule: ours, but not the canary (always empty) nor
/// the chains shared with the kubelet.
pub fn is_compared_chain(table: &str, chain: &str) -> bool {
    restore::is_owned_chain(chain)
        && chain != CANARY_CHAIN
        && !restore::is_shared_chain(table, chain)
}

/// The chain of a restore line (`-N CHAIN`, `-A CHAIN rule`).
fn chain_of(line: &str) -> Option<&str> {
    line.split_whitespace().nth(1)
}

/// What a read-back found in one table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableReadBack {
    /// Built-in chains with their rules, every chain's name, the shared chains' rules.
    pub inspection: TableInspection,
    /// A digest per rule of each compared chain the kernel holds ([`is_compared_chain`]).
    pub chains: BTreeMap<String, Vec<u64>>,
}

impl TableReadBack {
    /// From `iptables-save -t TABLE` output.
    pub fn from_save(save: &str, table: &str) -> Self {
        let mut chains: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        let mut in_table = false;
        for line in save.lines() {
            if let Some(name) = line.strip_prefix('*') {
                in_table = name == table;
            } else if !in_table {
                continue;
            } else if let Some(declaration) = line.strip_prefix(':') {
                let chain = declaration.split_whitespace().next().unwrap_or_default();
                if is_compared_chain(table, chain) {
                    chains.entry(chain.to_owned()).or_default();
                }
            } else if let Some(rest) = line.strip_prefix("-A ") {
                let (chain, rule) = rest.split_once(' ').unwrap_or((rest, ""));
                if let Some(rules) = chains.get_mut(chain) {
                    rules.push(rule_digest(rule));
                }
            }
        }
        Self {
            inspection: restore::parse_save(save, table),
            chains,
        }
    }
}

/// How one chain of ours differs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChainDrift {
    /// The chain is gone.
    pub absent: bool,
    /// Positions of our rules the kernel lacks.
    pub missing: Vec<usize>,
    /// How many rules the kernel holds that we did not write.
    pub unexpected: usize,
}

/// What differs in one table from what was written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableDrift {
    /// Our canary chain went: someone deleted our chains wholesale; the table is written
    /// in full.
    pub canary_missing: bool,
    /// Chains of ours to write again.
    pub chains: BTreeMap<String, ChainDrift>,
    /// Chains named as ours that we did not write: deleted.
    pub unexpected: BTreeSet<String>,
    /// Base jumps no built-in chain holds any more.
    pub jumps: Vec<&'static BaseJump>,
    /// `-N`/`-A` lines that give the shared chains our rules again.
    pub shared: Vec<String>,
}

impl TableDrift {
    pub fn is_empty(&self) -> bool {
        !self.canary_missing
            && self.chains.is_empty()
            && self.unexpected.is_empty()
            && self.jumps.is_empty()
            && self.shared.is_empty()
    }

    /// `read` against `written` (the digests of what was last written to each chain)
    /// and `desired` (for the shared chains), leaving out the chains `skip` names (written
    /// since the read began: the next read checks them).
    pub fn between(
        table: Table,
        written: &BTreeMap<String, Vec<u64>>,
        desired: &TableRules,
        read: &TableReadBack,
        skip: impl Fn(&str) -> bool,
    ) -> Self {
        let name = table.as_str();
        let canary_missing = !read.inspection.user_chains.contains(CANARY_CHAIN);
        let chains = written
            .iter()
            .filter(|(chain, _)| !skip(chain))
            .filter_map(|(chain, ours)| {
                let drift = match read.chains.get(chain) {
                    None => ChainDrift {
                        absent: true,
                        missing: (0..ours.len()).collect(),
                        unexpected: 0,
                    },
                    Some(kernel) if kernel == ours => return None,
                    Some(kernel) => rule_diff(ours, kernel),
                };
                Some((chain.clone(), drift))
            })
            .collect();
        let unexpected = read
            .chains
            .keys()
            .filter(|chain| !written.contains_key(*chain) && !skip(chain))
            .cloned()
            .collect();
        // Built-in and shared chains left out of the read (or written since it began) are
        // not judged: their rules were not listed.
        let jumps = BASE_JUMPS
            .iter()
            .filter(|jump| jump.table == table && !skip(jump.builtin_chain))
            .filter(|jump| {
                !read.inspection.builtins.iter().any(|(chain, _, rules)| {
                    chain == jump.builtin_chain && rules.iter().any(|r| r == jump.rule)
                })
            })
            .collect();
        let shared = restore::ensure_shared(name, &read.inspection, desired)
            .into_iter()
            .filter(|line| chain_of(line).is_none_or(|chain| !skip(chain)))
            .collect();
        Self {
            canary_missing,
            chains,
            unexpected,
            jumps,
            shared,
        }
    }

    /// The shared chains [`TableDrift::shared`] completes.
    pub fn shared_chains(&self) -> BTreeSet<&str> {
        self.shared
            .iter()
            .filter_map(|line| chain_of(line))
            .collect()
    }

    /// The restore lines that put the missing base jumps back at the top of their
    /// built-in chains, in [`BASE_JUMPS`] order, and complete the shared chains.
    pub fn ensure_lines(&self) -> Vec<String> {
        let mut lines = self.shared.clone();
        lines.extend(
            self.jumps
                .iter()
                .rev()
                .map(|jump| format!("-I {} 1 {}", jump.builtin_chain, jump.rule)),
        );
        lines
    }
}

/// Our rules the kernel lacks (by position) and how many of its rules we did not write.
fn rule_diff(ours: &[u64], kernel: &[u64]) -> ChainDrift {
    let mut held: HashMap<u64, usize> = HashMap::new();
    for digest in kernel {
        *held.entry(*digest).or_default() += 1;
    }
    let missing = ours
        .iter()
        .enumerate()
        .filter(|(_, digest)| match held.get_mut(*digest) {
            Some(count) if *count > 0 => {
                *count -= 1;
                false
            }
            _ => true,
        })
        .map(|(position, _)| position)
        .collect();
    ChainDrift {
        absent: false,
        missing,
        unexpected: held.values().sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAVE: &str = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SEP-A - [0:0]\n:KUBE-SVC-A - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\n:DOCKER - [0:0]\n\
        -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
        -A KUBE-SEP-A -p tcp -m tcp -j DNAT --to-destination 10.244.1.5:80\n\
        -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n\
        -A DOCKER -j RETURN\nCOMMIT\n";

    fn written(chains: &[(&str, &[&str])]) -> BTreeMap<String, Vec<u64>> {
        chains
            .iter()
            .map(|(chain, rules)| {
                (
                    (*chain).to_owned(),
                    rules.iter().map(|rule| rule_digest(rule)).collect(),
                )
            })
            .collect()
    }

    fn desired() -> TableRules {
        TableRules {
            chains: [(
                "KUBE-MARK-MASQ".to_owned(),
                vec!["-j MARK --set-xmark 0x4000/0x4000".to_owned()],
            )]
            .into(),
        }
    }

    #[test]
    fn only_our_chains_are_read_rule_by_rule() {
        let read = TableReadBack::from_save(SAVE, "nat");
        assert_eq!(
            read.chains.keys().collect::<Vec<_>>(),
            ["KUBE-SEP-A", "KUBE-SVC-A"]
        );
        assert_eq!(
            read.chains["KUBE-SEP-A"],
            [rule_digest(
                "-p tcp -m tcp -j DNAT --to-destination 10.244.1.5:80"
            )]
        );
        assert!(read.chains["KUBE-SVC-A"].is_empty());
    }

    #[test]
    fn a_table_as_written_has_no_drift() {
        let read = TableReadBack::from_save(SAVE, "nat");
        let ours = written(&[
            (
                "KUBE-SEP-A",
                &["-p tcp -m tcp -j DNAT --to-destination 10.244.1.5:80"],
            ),
            ("KUBE-SVC-A", &[]),
        ]);
        let mut drift = TableDrift::between(Table::Nat, &ours, &desired(), &read, |_| false);
        // Only the nat base jumps this save lacks.
        assert_eq!(drift.jumps.len(), 2);
        drift.jumps.clear();
        assert!(drift.is_empty(), "{drift:?}");
    }

    #[test]
    fn deleted_changed_and_foreign_rules_and_chains_are_found() {
        let read = TableReadBack::from_save(SAVE, "nat");
        let ours = written(&[
            (
                "KUBE-SEP-A",
                &[
                    "-j KUBE-MARK-MASQ",
                    "-p tcp -m tcp -j DNAT --to-destination 10.244.1.6:80",
                ],
            ),
            ("KUBE-SEP-B", &["-j KUBE-MARK-MASQ"]),
        ]);
        let drift = TableDrift::between(Table::Nat, &ours, &desired(), &read, |_| false);
        assert_eq!(
            drift.chains["KUBE-SEP-A"],
            ChainDrift {
                absent: false,
                missing: vec![0, 1],
                unexpected: 1
            }
        );
        assert!(drift.chains["KUBE-SEP-B"].absent);
        assert_eq!(drift.unexpected, ["KUBE-SVC-A".to_owned()].into());
        assert!(!drift.canary_missing);
        // What was written since the read began is left for the next one.
        let later = TableDrift::between(Table::Nat, &ours, &desired(), &read, |chain| {
            chain != "KUBE-SEP-B"
        });
        assert_eq!(later.chains.keys().collect::<Vec<_>>(), ["KUBE-SEP-B"]);
        assert!(later.unexpected.is_empty());
    }

    #[test]
    fn missing_jumps_and_shared_rules_are_put_back_at_the_top() {
        let save = "*nat\n:PREROUTING ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
            -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\nCOMMIT\n";
        let read = TableReadBack::from_save(save, "nat");
        let drift = TableDrift::between(Table::Nat, &BTreeMap::new(), &desired(), &read, |_| false);
        assert!(drift.canary_missing);
        assert_eq!(
            drift.ensure_lines(),
            [
                "-N KUBE-MARK-MASQ",
                "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000",
                "-I POSTROUTING 1 -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING",
                "-I PREROUTING 1 -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
            ]
        );
        // A read scoped to PREROUTING (an announced removal there) judges only it.
        let scoped = TableDrift::between(Table::Nat, &BTreeMap::new(), &desired(), &read, |c| {
            c != "PREROUTING"
        });
        assert_eq!(
            scoped.ensure_lines(),
            [
                "-I PREROUTING 1 -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
            ]
        );
    }
}
