//! One atomic change of table `ip tandem` (or `ip6 tandem`): the operations in the order the kernel needs
//! them, so every reference names an object that exists at that point of the batch and
//! nothing is deleted while still referenced.

use std::collections::{BTreeMap, BTreeSet};

use tandem_common::IpFamily;

use crate::model::{BaseChain, Chain, Key, Rule, Ruleset, Set, SetSpec, Value};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `add table ip tandem` (no error when it exists).
    AddTable,
    /// `delete table ip tandem`, with everything in it.
    DeleteTable,
    /// `add chain ip tandem NAME` (no error when it exists).
    AddChain {
        name: String,
        base: Option<BaseChain>,
    },
    /// `flush chain ip tandem NAME`: removes its rules.
    FlushChain(String),
    /// `delete chain ip tandem NAME` (it must be empty and unreferenced).
    DeleteChain(String),
    /// `add rule ip tandem CHAIN …`: appends.
    AddRule {
        chain: String,
        rule: Rule,
    },
    AddSet {
        name: String,
        spec: SetSpec,
    },
    DeleteSet(String),
    /// `flush set ip tandem NAME`: removes its elements.
    FlushSet(String),
    AddElements {
        set: String,
        elements: Vec<(Key, Value)>,
    },
    DeleteElements {
        set: String,
        keys: Vec<Key>,
    },
}

/// Operations on the table of one family, applied all or nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transaction {
    pub family: IpFamily,
    pub ops: Vec<Op>,
}

/// The chains and sets a transaction writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Written {
    /// The whole table (it was deleted, so everything in it is written anew).
    pub table: bool,
    pub chains: BTreeSet<String>,
    pub sets: BTreeSet<String>,
}

impl Written {
    pub fn merge(&mut self, other: Written) {
        self.table |= other.table;
        self.chains.extend(other.chains);
        self.sets.extend(other.sets);
    }
}

/// How a chain or set in the kernel differs from what was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Drift {
    /// Written, not in the kernel.
    Missing,
    /// In the kernel, never written (or since removed).
    Unexpected,
    /// Declared differently (a chain's hook, priority or policy; a set's type or flags).
    Declaration,
    /// A chain's rules or a set's elements differ.
    Content,
}

/// The chains and sets of a table that differ from what was written, by name: found from
/// digests by [`TableDrift::between`], mended by [`Transaction::repair`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableDrift {
    pub chains: BTreeMap<String, Drift>,
    pub sets: BTreeMap<String, Drift>,
}

impl TableDrift {
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty() && self.sets.is_empty()
    }
}

impl Transaction {
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Replaces whatever our table of the ruleset's family holds (or creates it) with
    /// `ruleset`.
    pub fn replace_all(ruleset: &Ruleset) -> Self {
        Self {
            family: ruleset.family,
            ops: Self::replace_all_ops(ruleset).collect(),
        }
    }

    /// The operations of [`Transaction::replace_all`], each made when it is reached: the
    /// node proxy encodes them as they come, as all of them at once copied every rule and
    /// element of the table, the largest allocation of a first sync.
    ///
    /// They are [`Transaction::between`] an empty table and `ruleset`, after the table is
    /// emptied: chains declared, then sets (dynamic ones last), elements added and rules
    /// written, each in name order.
    pub fn replace_all_ops(ruleset: &Ruleset) -> impl Iterator<Item = Op> + '_ {
        let is_dynamic = |set: &Set| matches!(set.spec, SetSpec::Dynamic { .. });
        let declare_sets = |dynamic: bool| {
            ruleset
                .sets
                .iter()
                .filter(move |(_, set)| is_dynamic(set) == dynamic)
                .map(|(name, set)| Op::AddSet {
                    name: name.clone(),
                    spec: set.spec,
                })
        };
        [Op::AddTable, Op::DeleteTable, Op::AddTable]
            .into_iter()
            .chain(ruleset.chains.iter().map(|(name, chain)| Op::AddChain {
                name: name.clone(),
                base: chain.base,
            }))
            .chain(declare_sets(false))
            .chain(declare_sets(true))
            .chain(
                ruleset
                    .sets
                    .iter()
                    .filter_map(|(name, set)| elements_of(name, set)),
            )
            .chain(
                ruleset
                    .chains
                    .iter()
                    .flat_map(|(name, chain)| rules_of(name, chain)),
            )
    }

    /// What the operations write.
    pub fn written(&self) -> Written {
        let mut written = Written::default();
        for op in &self.ops {
            match op {
                Op::AddTable => {}
                Op::DeleteTable => written.table = true,
                Op::AddChain { name, .. } | Op::FlushChain(name) | Op::DeleteChain(name) => {
                    written.chains.insert(name.clone());
                }
                Op::AddRule { chain, .. } => {
                    written.chains.insert(chain.clone());
                }
                Op::AddSet { name, .. } | Op::DeleteSet(name) | Op::FlushSet(name) => {
                    written.sets.insert(name.clone());
                }
                Op::AddElements { set, .. } | Op::DeleteElements { set, .. } => {
                    written.sets.insert(set.clone());
                }
            }
        }
        written
    }

    /// Brings the chains and sets `drift` names back to what `ruleset` holds, whatever the
    /// kernel made of them, in the order of [`Transaction::between`]: missing chains
    /// first, sets and chains emptied, unexpected or re-declared ones deleted, then sets
    /// declared, elements added and rules written. Starts with [`Op::AddTable`], in case
    /// the table itself went.
    pub fn repair(ruleset: &Ruleset, drift: &TableDrift) -> Self {
        fn named<'a>(objects: &'a BTreeMap<String, Drift>, wanted: &[Drift]) -> Vec<&'a str> {
            objects
                .iter()
                .filter(|(_, drift)| wanted.contains(drift))
                .map(|(name, _)| name.as_str())
                .collect()
        }
        let chains = |wanted: &[Drift]| named(&drift.chains, wanted);
        let sets = |wanted: &[Drift]| named(&drift.sets, wanted);
        let mut ops = vec![Op::AddTable];
        for name in chains(&[Drift::Missing]) {
            if let Some(chain) = ruleset.chains.get(name) {
                ops.push(Op::AddChain {
                    name: name.to_owned(),
                    base: chain.base,
                });
            }
        }
        ops.extend(
            sets(&[Drift::Content])
                .into_iter()
                .map(|name| Op::FlushSet(name.to_owned())),
        );
        let emptied = [Drift::Content, Drift::Declaration, Drift::Unexpected];
        ops.extend(
            chains(&emptied)
                .into_iter()
                .map(|name| Op::FlushChain(name.to_owned())),
        );
        let deleted = [Drift::Declaration, Drift::Unexpected];
        ops.extend(
            sets(&deleted)
                .into_iter()
                .map(|name| Op::DeleteSet(name.to_owned())),
        );
        ops.extend(
            chains(&deleted)
                .into_iter()
                .map(|name| Op::DeleteChain(name.to_owned())),
        );
        let mut declared = sets(&[Drift::Missing, Drift::Declaration]);
        declared.sort_by_key(|name| {
            ruleset
                .sets
                .get(*name)
                .is_some_and(|set| matches!(set.spec, SetSpec::Dynamic { .. }))
        });
        for name in declared {
            if let Some(set) = ruleset.sets.get(name) {
                ops.push(Op::AddSet {
                    name: name.to_owned(),
                    spec: set.spec,
                });
            }
        }
        for name in chains(&[Drift::Declaration]) {
            if let Some(chain) = ruleset.chains.get(name) {
                ops.push(Op::AddChain {
                    name: name.to_owned(),
                    base: chain.base,
                });
            }
        }
        for name in sets(&[Drift::Missing, Drift::Declaration, Drift::Content]) {
            ops.extend(
                ruleset
                    .sets
                    .get(name)
                    .and_then(|set| elements_of(name, set)),
            );
        }
        for name in chains(&[Drift::Missing, Drift::Declaration, Drift::Content]) {
            if let Some(chain) = ruleset.chains.get(name) {
                ops.extend(rules_of(name, chain));
            }
        }
        Self {
            family: ruleset.family,
            ops,
        }
    }

    /// Removes our table of `family` (after [`Op::AddTable`], so a missing table is no
    /// error).
    pub fn delete_all(family: IpFamily) -> Self {
        Self {
            family,
            ops: vec![Op::AddTable, Op::DeleteTable],
        }
    }

    /// The operations that turn `old` into `new` (of the same family), looking only at the named chains and
    /// sets: everything else must be equal in both. The names must include every chain
    /// that references a named set whose declaration changed.
    ///
    /// Order: new chains (empty) first, then stale elements out, changed and removed
    /// chains flushed, removed (or re-declared) sets and removed chains deleted, then
    /// sets declared, elements added and rules written last.
    ///
    /// Sets are declared in name order, but dynamic sets after all others: the kernel finds
    /// a set by walking the table's sets in the order they were declared, comparing names,
    /// so the maps an endpoint change writes to should not sit behind the many
    /// per-endpoint sets of session affinity.
    pub fn between(
        old: &Ruleset,
        new: &Ruleset,
        chains: &BTreeSet<&str>,
        sets: &BTreeSet<&str>,
    ) -> Self {
        let mut add_chains = Vec::new();
        let mut flush_chains = Vec::new();
        let mut delete_chains = Vec::new();
        let mut add_rules = Vec::new();
        for &name in chains {
            let (before, after) = (old.chains.get(name), new.chains.get(name));
            match (before, after) {
                (None, None) => {}
                (Some(_), None) => {
                    flush_chains.push(Op::FlushChain(name.to_owned()));
                    delete_chains.push(Op::DeleteChain(name.to_owned()));
                }
                (None, Some(chain)) => {
                    add_chains.push(Op::AddChain {
                        name: name.to_owned(),
                        base: chain.base,
                    });
                    add_rules.extend(rules_of(name, chain));
                }
                (Some(before), Some(after)) => {
                    if before.base != after.base {
                        // A hook cannot be changed in place: the chain is made anew.
                        flush_chains.push(Op::FlushChain(name.to_owned()));
                        delete_chains.push(Op::DeleteChain(name.to_owned()));
                        add_rules.push(Op::AddChain {
                            name: name.to_owned(),
                            base: after.base,
                        });
                        add_rules.extend(rules_of(name, after));
                    } else if before.rules != after.rules {
                        flush_chains.push(Op::FlushChain(name.to_owned()));
                        add_rules.extend(rules_of(name, after));
                    }
                }
            }
        }

        let mut delete_elements = Vec::new();
        let mut delete_sets = Vec::new();
        let mut add_sets = Vec::new();
        let mut add_elements = Vec::new();
        for &name in sets {
            match (old.sets.get(name), new.sets.get(name)) {
                (None, None) => {}
                (Some(_), None) => delete_sets.push(Op::DeleteSet(name.to_owned())),
                (None, Some(set)) => {
                    add_sets.push(Op::AddSet {
                        name: name.to_owned(),
                        spec: set.spec,
                    });
                    add_elements.extend(elements_of(name, set));
                }
                (Some(before), Some(after)) if before.spec != after.spec => {
                    delete_sets.push(Op::DeleteSet(name.to_owned()));
                    add_sets.push(Op::AddSet {
                        name: name.to_owned(),
                        spec: after.spec,
                    });
                    add_elements.extend(elements_of(name, after));
                }
                (Some(before), Some(after)) => {
                    let stale: Vec<Key> = before
                        .elements
                        .iter()
                        .filter(|(key, value)| after.elements.get(key) != Some(value))
                        .map(|(key, _)| *key)
                        .collect();
                    let fresh: Vec<(Key, Value)> = after
                        .elements
                        .iter()
                        .filter(|(key, value)| before.elements.get(key) != Some(value))
                        .map(|(key, value)| (*key, value.clone()))
                        .collect();
                    if !stale.is_empty() {
                        delete_elements.push(Op::DeleteElements {
                            set: name.to_owned(),
                            keys: stale,
                        });
                    }
                    if !fresh.is_empty() {
                        add_elements.push(Op::AddElements {
                            set: name.to_owned(),
                            elements: fresh,
                        });
                    }
                }
            }
        }

        add_sets.sort_by_key(|op| {
            matches!(
                op,
                Op::AddSet {
                    spec: SetSpec::Dynamic { .. },
                    ..
                }
            )
        });
        // Moved, not cloned: a first sync's operations carry every map element, and a
        // copy of them would be the node proxy's largest allocation at its peak.
        let ops = [
            add_chains,
            delete_elements,
            flush_chains,
            delete_sets,
            delete_chains,
            add_sets,
            add_elements,
            add_rules,
        ]
        .into_iter()
        .flatten()
        .collect();
        Self {
            family: new.family,
            ops,
        }
    }
}

fn rules_of<'a>(name: &'a str, chain: &'a Chain) -> impl Iterator<Item = Op> + 'a {
    chain.rules.iter().map(move |rule| Op::AddRule {
        chain: name.to_owned(),
        rule: rule.clone(),
    })
}

fn elements_of(name: &str, set: &Set) -> Option<Op> {
    (!set.elements.is_empty()).then(|| Op::AddElements {
        set: name.to_owned(),
        elements: set
            .elements
            .iter()
            .map(|(key, value)| (*key, value.clone()))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{KeyType, Statement, Verdict};

    fn ruleset(endpoint: Option<&str>) -> Ruleset {
        let mut rs = Ruleset::default();
        let mut map = Set::verdict_map(KeyType::Index);
        if let Some(ep) = endpoint {
            rs.chains.insert(
                ep.to_owned(),
                Chain {
                    base: None,
                    rules: vec![Rule::always(Statement::Return)],
                },
            );
            map.elements
                .insert(Key::Index(0), Verdict::Goto(ep.to_owned()).into());
        }
        rs.sets.insert("m".into(), map);
        rs
    }

    #[test]
    fn a_replaced_chain_is_created_before_and_deleted_after_the_element_swap() {
        let (old, new) = (ruleset(Some("a")), ruleset(Some("b")));
        let chains = BTreeSet::from(["a", "b"]);
        let sets = BTreeSet::from(["m"]);
        let tx = Transaction::between(&old, &new, &chains, &sets);
        let position = |wanted: &Op| tx.ops.iter().position(|op| op == wanted).unwrap();
        let add_b = position(&Op::AddChain {
            name: "b".into(),
            base: None,
        });
        let del_elem = position(&Op::DeleteElements {
            set: "m".into(),
            keys: vec![Key::Index(0)],
        });
        let del_a = position(&Op::DeleteChain("a".into()));
        let add_elem = position(&Op::AddElements {
            set: "m".into(),
            elements: vec![(Key::Index(0), Verdict::Goto("b".into()).into())],
        });
        assert!(add_b < add_elem && del_elem < del_a && del_elem < add_elem);
    }

    #[test]
    fn dynamic_sets_are_declared_after_the_others() {
        let mut rs = Ruleset::default();
        rs.sets.insert("a-dynamic".into(), Set::dynamic(10));
        rs.sets
            .insert("b-map".into(), Set::verdict_map(KeyType::Index));
        let tx = Transaction::replace_all(&rs);
        let declared: Vec<&str> = tx
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::AddSet { name, .. } => Some(name.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(declared, ["b-map", "a-dynamic"]);
    }

    #[test]
    fn a_transaction_says_what_it_writes() {
        let tx = Transaction::between(
            &ruleset(Some("a")),
            &ruleset(Some("b")),
            &BTreeSet::from(["a", "b"]),
            &BTreeSet::from(["m"]),
        );
        let written = tx.written();
        assert!(!written.table);
        assert_eq!(written.chains, BTreeSet::from(["a".into(), "b".into()]));
        assert_eq!(written.sets, BTreeSet::from(["m".into()]));
        assert!(Transaction::replace_all(&ruleset(None)).written().table);
    }

    #[test]
    fn a_repair_declares_before_it_fills_and_empties_before_it_deletes() {
        let rs = ruleset(Some("a"));
        let drift = TableDrift {
            chains: [
                ("a".to_owned(), Drift::Missing),
                ("x".to_owned(), Drift::Unexpected),
            ]
            .into(),
            sets: [("m".to_owned(), Drift::Content)].into(),
        };
        let tx = Transaction::repair(&rs, &drift);
        assert_eq!(
            tx.ops,
            vec![
                Op::AddTable,
                Op::AddChain {
                    name: "a".into(),
                    base: None
                },
                Op::FlushSet("m".into()),
                Op::FlushChain("x".into()),
                Op::DeleteChain("x".into()),
                Op::AddElements {
                    set: "m".into(),
                    elements: vec![(Key::Index(0), Verdict::Goto("a".into()).into())],
                },
                Op::AddRule {
                    chain: "a".into(),
                    rule: Rule::always(Statement::Return),
                },
            ]
        );
    }

    #[test]
    fn a_replacement_empties_the_table_then_writes_what_between_writes_from_nothing() {
        let mut rs = ruleset(Some("a"));
        rs.sets.insert("a-dynamic".into(), Set::dynamic(10));
        rs.sets
            .insert("empty".into(), Set::verdict_map(KeyType::Index));
        rs.chains.insert(
            "base".into(),
            Chain {
                base: Some(BaseChain {
                    chain_type: crate::model::ChainType::Nat,
                    hook: crate::model::Hook::Output,
                    priority: -100,
                }),
                rules: vec![Rule::always(Statement::Jump("a".into()))],
            },
        );
        let chains: BTreeSet<&str> = rs.chains.keys().map(String::as_str).collect();
        let sets: BTreeSet<&str> = rs.sets.keys().map(String::as_str).collect();
        let from_nothing = Transaction::between(&Ruleset::default(), &rs, &chains, &sets);
        let mut expected = vec![Op::AddTable, Op::DeleteTable, Op::AddTable];
        expected.extend(from_nothing.ops);
        assert_eq!(Transaction::replace_all(&rs).ops, expected);
    }

    #[test]
    fn equal_rulesets_need_no_operation() {
        let rs = ruleset(Some("a"));
        let chains = BTreeSet::from(["a"]);
        let sets = BTreeSet::from(["m"]);
        assert!(Transaction::between(&rs, &rs, &chains, &sets).is_empty());
    }
}
