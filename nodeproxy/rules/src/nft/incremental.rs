//! The nftables ruleset kept up to date one Service port at a time: a sync rebuilds only
//! the ports that changed and returns the one transaction that brings the kernel from the
//! previous ruleset to the new one. Its cost follows the change, not the cluster: only the
//! touched ports' own chains and sets are compared, and their elements in the shared maps
//! are diffed against what those ports held, never against the whole map.

use std::collections::{BTreeMap, BTreeSet};

use tandem_nftables::{Key, Match, Rule, Ruleset, Set, Statement, Transaction};

use super::layout::{self, PortObjects, SHARED_MAPS, port_objects};
use crate::model::{NodeConfig, ProxyState, ServicePortName};

/// A set whose declaration changes (an affinity timeout) is deleted and declared anew,
/// which the kernel refuses while a rule still names it: the chains that name it must be
/// flushed first and written again, even where their rules stay the same. Emptying their
/// old copy makes [`Transaction::between`] do exactly that.
fn force_rewrite_of_redeclared_set_users(before: &mut Ruleset, after: &Ruleset) {
    let redeclared: BTreeSet<&String> = after
        .sets
        .iter()
        .filter(|(name, set)| {
            before
                .sets
                .get(*name)
                .is_some_and(|old| old.spec != set.spec)
        })
        .map(|(name, _)| name)
        .collect();
    if redeclared.is_empty() {
        return;
    }
    for (name, chain) in &after.chains {
        let uses = chain
            .rules
            .iter()
            .any(|rule| rule_sets(rule).any(|set| redeclared.contains(set)));
        if let (true, Some(old)) = (uses, before.chains.get_mut(name)) {
            old.rules.clear();
        }
    }
}

/// The sets a rule names.
fn rule_sets(rule: &Rule) -> impl Iterator<Item = &String> {
    let in_statement = match &rule.statement {
        Statement::Dispatch { map, .. } | Statement::RandomDispatch { map, .. } => Some(map),
        Statement::AddSourceToSet(set) => Some(set),
        _ => None,
    };
    let in_matches = rule.matches.iter().filter_map(|m| match m {
        Match::SourceInSet(set) => Some(set),
        _ => None,
    });
    in_statement.into_iter().chain(in_matches)
}

/// What the ruleset holds of one Service port.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PortShare {
    chains: Vec<String>,
    sets: Vec<String>,
    /// Its elements in the shared maps: `(map, key)`.
    elements: Vec<(&'static str, Key)>,
}

impl PortShare {
    fn of(objects: &PortObjects) -> Self {
        Self {
            chains: objects.chains.keys().cloned().collect(),
            sets: objects.sets.keys().cloned().collect(),
            elements: objects
                .elements
                .iter()
                .map(|(map, key, _)| (*map, *key))
                .collect(),
        }
    }
}

/// The desired ruleset of table `ip tandem`, updated per Service port.
#[derive(Debug, Clone)]
pub struct IncrementalRuleset {
    node: NodeConfig,
    ruleset: Ruleset,
    ports: BTreeMap<ServicePortName, PortShare>,
}

impl IncrementalRuleset {
    /// The ruleset of a cluster without Services: the fixed objects only. The kernel gets
    /// it (or any later [`IncrementalRuleset::ruleset`]) whole with
    /// [`Transaction::replace_all`]; [`IncrementalRuleset::update`]s go from there.
    pub fn new(node: NodeConfig) -> Self {
        Self {
            node,
            ruleset: layout::fixed_objects(),
            ports: BTreeMap::new(),
        }
    }

    pub fn ruleset(&self) -> &Ruleset {
        &self.ruleset
    }

    /// Rebuilds the given Service ports from `state` (a port `state` no longer has is
    /// removed) and returns the transaction from the previous ruleset to the new one:
    /// empty when nothing changed.
    pub fn update<'a>(
        &mut self,
        state: &ProxyState,
        ports: impl IntoIterator<Item = &'a ServicePortName>,
    ) -> Transaction {
        // The touched objects only: before as the ruleset held them, after as rebuilt.
        // Both declare the shared maps, holding only the touched ports' elements.
        let mut before = Ruleset::default();
        let mut after = Ruleset::default();
        for (name, key) in SHARED_MAPS {
            before.sets.insert(name.to_owned(), Set::verdict_map(key));
            after.sets.insert(name.to_owned(), Set::verdict_map(key));
        }
        let mut chains = BTreeSet::new();
        let mut sets: BTreeSet<String> = SHARED_MAPS
            .iter()
            .map(|(name, _)| (*name).to_owned())
            .collect();
        let names: BTreeSet<&ServicePortName> = ports.into_iter().collect();
        for name in names {
            let old = self.ports.remove(name).unwrap_or_default();
            self.take(&old, &mut before);
            let new = state
                .services
                .get(name)
                .map(|svc| port_objects(svc, state.endpoints_of(name), &self.node))
                .unwrap_or_default();
            let share = PortShare::of(&new);
            chains.extend(old.chains.iter().chain(&share.chains).cloned());
            sets.extend(old.sets.iter().chain(&share.sets).cloned());
            layout::install(&mut after, new);
            if share != PortShare::default() {
                self.ports.insert(name.clone(), share);
            }
        }
        force_rewrite_of_redeclared_set_users(&mut before, &after);
        let chain_names: BTreeSet<&str> = chains.iter().map(String::as_str).collect();
        let set_names: BTreeSet<&str> = sets.iter().map(String::as_str).collect();
        let tx = Transaction::between(&before, &after, &chain_names, &set_names);

        let Ruleset {
            chains: new_chains,
            sets: mut new_sets,
        } = after;
        self.ruleset.chains.extend(new_chains);
        for (name, _) in SHARED_MAPS {
            let (Some(elements), Some(map)) =
                (new_sets.remove(name), self.ruleset.sets.get_mut(name))
            else {
                continue;
            };
            map.elements.extend(elements.elements);
        }
        self.ruleset.sets.extend(new_sets);
        tx
    }

    /// Moves what the ruleset holds of a port into `into`.
    fn take(&mut self, share: &PortShare, into: &mut Ruleset) {
        for name in &share.chains {
            if let Some(chain) = self.ruleset.chains.remove(name) {
                into.chains.insert(name.clone(), chain);
            }
        }
        for name in &share.sets {
            if let Some(set) = self.ruleset.sets.remove(name) {
                into.sets.insert(name.clone(), set);
            }
        }
        for (map, key) in &share.elements {
            let verdict = self
                .ruleset
                .sets
                .get_mut(*map)
                .and_then(|set| set.elements.remove(key));
            if let (Some(verdict), Some(set)) = (verdict, into.sets.get_mut(*map)) {
                set.elements.insert(*key, verdict);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use tandem_nftables::Op;

    use super::*;
    use crate::model::ServicePort;
    use crate::nft::layout::tests::{endpoint, node, service};

    fn state(affinity_timeout: u32) -> ProxyState {
        let service = ServicePort {
            session_affinity_timeout: Some(affinity_timeout),
            ..service(Some(Ipv4Addr::new(10, 96, 0, 1)))
        };
        let name = service.name.clone();
        ProxyState {
            endpoints: [(name.clone(), vec![endpoint(1, "node-b")])].into(),
            services: [(name, service)].into(),
        }
    }

    #[test]
    fn a_changed_affinity_timeout_rewrites_the_chains_that_use_the_set() {
        let mut incremental = IncrementalRuleset::new(node());
        let names: Vec<ServicePortName> = state(10).services.into_keys().collect();
        incremental.update(&state(10), &names);
        let tx = incremental.update(&state(20), &names);
        let position = |wanted: &dyn Fn(&Op) -> bool| tx.ops.iter().position(wanted).unwrap();
        let delete_set =
            position(&|op| matches!(op, Op::DeleteSet(set) if set.starts_with("affinity-")));
        // Both the endpoint chain (update @set) and the service chain (ip saddr @set).
        for prefix in ["endpoint-", "service-"] {
            let flush = position(&|op| matches!(op, Op::FlushChain(c) if c.starts_with(prefix)));
            let rewrite = position(
                &|op| matches!(op, Op::AddRule { chain, .. } if chain.starts_with(prefix)),
            );
            assert!(flush < delete_set && delete_set < rewrite, "{tx:?}");
        }
        assert_eq!(incremental.ruleset(), &layout::build(&state(20), &node()));
    }
}
