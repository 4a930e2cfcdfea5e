//! The nftables ruleset kept up to date one Service port at a time: a sync rebuilds only
//! the ports that changed and returns the one transaction that brings the kernel from the
//! previous ruleset to the new one. Its cost follows the change, not the cluster: only the
//! touched ports' own chains and sets are compared, and their elements in the shared maps
//! are diffed against what those ports held, never against the whole map.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use tandem_nftables::{Key, Match, Rule, Ruleset, Set, Statement, Transaction, Value};

use super::layout::{self, PortObjects, SHARED_SETS, is_member_set, merge_into, port_objects};
use super::slots::BucketSlots;
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
        Statement::Dispatch { map, .. }
        | Statement::RandomDispatch { map, .. }
        | Statement::RandomDnat { map, .. } => Some(map),
        Statement::AddSourceToSet(set) => Some(set),
        _ => None,
    };
    let in_matches = rule.matches.iter().filter_map(|m| match m {
        Match::SourceInSet(set) | Match::AddressPairInSet(set) | Match::DestinationInSet(set) => {
            Some(set)
        }
        _ => None,
    });
    in_statement.into_iter().chain(in_matches)
}

/// An element of a shared set: `(set, key)`.
type ElementKey = (&'static str, Key);

/// What the ruleset holds of one Service port.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PortShare {
    chains: Vec<String>,
    sets: Vec<String>,
    /// The elements it claims in the shared sets (it holds those it wins).
    elements: Vec<(&'static str, Key, Value)>,
    /// Its runs of buckets: the endpoint map and their keys (its own; no other port's
    /// slot overlaps).
    buckets: Option<(String, Vec<Key>)>,
}

/// A port's objects, its elements taken out into the share of the ruleset it claims.
fn claimed_by(mut objects: PortObjects) -> (PortObjects, PortShare) {
    let mut elements = std::mem::take(&mut objects.elements);
    // Kept for as long as the port is: without the room its growth left, a quarter less
    // at 10 endpoints.
    elements.shrink_to_fit();
    let share = PortShare {
        chains: objects.chains.keys().cloned().collect(),
        sets: objects.sets.keys().cloned().collect(),
        elements,
        buckets: objects
            .buckets
            .as_ref()
            .map(|(map, runs)| (map.clone(), runs.elements.keys().copied().collect())),
    };
    (objects, share)
}

impl PortShare {
    fn value(&self, (set, key): ElementKey) -> Option<&Value> {
        self.elements
            .iter()
            .find(|(s, k, _)| *s == set && *k == key)
            .map(|(_, _, value)| value)
    }
}

/// What one update touches: the named chains and sets as the ruleset held them and as
/// rebuilt.
struct Touched {
    before: Ruleset,
    after: Ruleset,
    chains: BTreeSet<String>,
    sets: BTreeSet<String>,
}

impl Touched {
    fn transaction(&mut self) -> Transaction {
        force_rewrite_of_redeclared_set_users(&mut self.before, &self.after);
        let chains: BTreeSet<&str> = self.chains.iter().map(String::as_str).collect();
        let sets: BTreeSet<&str> = self.sets.iter().map(String::as_str).collect();
        Transaction::between(&self.before, &self.after, &chains, &sets)
    }
}

/// The desired ruleset of table `ip tandem`, updated per Service port.
#[derive(Debug, Clone)]
pub struct IncrementalRuleset {
    node: NodeConfig,
    ruleset: Ruleset,
    ports: BTreeMap<ServicePortName, PortShare>,
    slots: BucketSlots,
    /// Map elements more than one port claims (two Services listing the same external IP
    /// and port), with every claimant: the first in name order holds it, as in
    /// [`layout::build`]. Only conflicts are indexed, so the common case costs nothing.
    contested: BTreeMap<ElementKey, BTreeSet<ServicePortName>>,
    /// How many ports claim each member of a member set ([`layout::is_member_set`]) that
    /// more than one port claims (the ports of one Service share its endpoints' hairpin
    /// pairs and its cluster IP; the sets' key types differ, so a key names its set). Every
    /// claimant holds the same member, so a count is all it takes: sets of claimants took
    /// 39 MiB at 5,000 two-port Services.
    shared_pairs: BTreeMap<Key, usize>,
}

impl IncrementalRuleset {
    /// The objects of Service port `name` of `state`, in the bucket slot it holds (given
    /// one if it is new), with its elements taken out as the share it claims; `None` when
    /// `state` has no such port.
    fn claimed_port(
        &mut self,
        state: &ProxyState,
        name: &ServicePortName,
    ) -> Option<(PortObjects, PortShare)> {
        let svc = state.services().get(name)?;
        let slot = self.slots.assign(name, svc.protocol);
        Some(claimed_by(port_objects(
            svc,
            state.endpoints_of(name),
            &self.node,
            slot,
        )))
    }

    /// The ruleset of a cluster without Services: the fixed objects only. The kernel gets
    /// it (or any later [`IncrementalRuleset::ruleset`]) whole with
    /// [`Transaction::replace_all`]; [`IncrementalRuleset::update`]s go from there.
    pub fn new(node: NodeConfig) -> Self {
        Self {
            ruleset: layout::fixed_objects(&node),
            node,
            ports: BTreeMap::new(),
            slots: BucketSlots::default(),
            contested: BTreeMap::new(),
            shared_pairs: BTreeMap::new(),
        }
    }

    pub fn ruleset(&self) -> &Ruleset {
        &self.ruleset
    }

    /// The node's zone changed: later updates choose endpoints by the new one. Only ports
    /// whose endpoints carry zone hints depend on it; the caller updates those.
    pub fn set_zone(&mut self, zone: Option<String>) {
        self.node.zone = zone;
    }

    /// The node's Service CIDRs are now `cidrs` (of this family, as
    /// [`crate::model::service_cidrs_of`] gives them): `cluster-ips-check` is rebuilt, and
    /// the returned transaction rewrites that chain alone (empty when they did not change).
    /// No port depends on them.
    pub fn set_service_cidrs(&mut self, cidrs: Vec<IpNet>) -> Transaction {
        if self.node.service_cidrs == cidrs {
            return Transaction::default();
        }
        self.node.service_cidrs = cidrs;
        let name = layout::CLUSTER_IPS_CHECK;
        let mut before = Ruleset::empty(self.ruleset.family);
        let mut after = Ruleset::empty(self.ruleset.family);
        let rebuilt = layout::cluster_ips_check(&self.node);
        after.chains.insert(name.to_owned(), rebuilt.clone());
        if let Some(held) = self.ruleset.chains.insert(name.to_owned(), rebuilt) {
            before.chains.insert(name.to_owned(), held);
        }
        Transaction::between(&before, &after, &BTreeSet::from([name]), &BTreeSet::new())
    }

    /// The slots the ports hold: [`layout::build_with_slots`] with these and the same
    /// state is [`IncrementalRuleset::ruleset`].
    pub fn slots(&self) -> &BucketSlots {
        &self.slots
    }

    /// Builds every port of `state` anew from nothing, each in the slot it holds (ports
    /// keep their slots for life, so after churn a fresh start's name order would place
    /// them elsewhere). The result equals the ruleset before unless the change tracking
    /// missed something. The old ruleset goes first, so the two never take memory at once.
    pub fn rebuild(&mut self, state: &ProxyState) {
        let mut slots = std::mem::take(&mut self.slots);
        slots.retain(|name| state.services().contains_key(name));
        *self = Self {
            slots,
            ..Self::new(self.node.clone())
        };
        self.update_without_transaction(state, state.services().keys());
    }

    /// Rebuilds the given Service ports from `state` (a port `state` no longer has is
    /// removed) and returns the transaction from the previous ruleset to the new one:
    /// empty when nothing changed.
    pub fn update<'a>(
        &mut self,
        state: &ProxyState,
        ports: impl IntoIterator<Item = &'a ServicePortName>,
    ) -> Transaction {
        let mut touched = self.rebuild_ports(state, ports);
        let tx = touched.transaction();
        self.absorb(touched.after);
        tx
    }

    /// [`IncrementalRuleset::update`] for a ruleset the kernel gets whole
    /// ([`Transaction::replace_all`]) or never (a rebuild to compare with): the same
    /// change without the transaction, which at a first sync copies every rule and
    /// element once more.
    pub fn update_without_transaction<'a>(
        &mut self,
        state: &ProxyState,
        ports: impl IntoIterator<Item = &'a ServicePortName>,
    ) {
        if self.ports.is_empty() {
            self.build_ports(state, ports);
            return;
        }
        let touched = self.rebuild_ports(state, ports);
        self.absorb(touched.after);
    }

    /// [`IncrementalRuleset::update_without_transaction`] of a ruleset that holds no port
    /// (a first sync, a rebuild): each port's objects go straight into the ruleset, in
    /// name order, so the first claimant of an element holds it as in
    /// [`IncrementalRuleset::rebuild_ports`], without the copy of every element and the
    /// index of its claimants that a change builds (a third of the first sync's peak
    /// memory at 10,000 ports).
    fn build_ports<'a>(
        &mut self,
        state: &ProxyState,
        ports: impl IntoIterator<Item = &'a ServicePortName>,
    ) {
        let names: BTreeSet<&ServicePortName> = ports.into_iter().collect();
        // Released before any is given out, as a change does, so the same slots are reused.
        for &name in &names {
            if !state.services().contains_key(name) {
                self.slots.release(name);
            }
        }
        for name in names {
            let Some((
                PortObjects {
                    chains,
                    sets,
                    buckets,
                    ..
                },
                share,
            )) = self.claimed_port(state, name)
            else {
                continue;
            };
            self.ruleset.chains.extend(chains);
            for (set, part) in sets.into_iter().chain(buckets) {
                merge_into(&mut self.ruleset, set, part);
            }
            for &(set, key, ref value) in &share.elements {
                let Some(held) = self.ruleset.sets.get_mut(set) else {
                    continue;
                };
                if let Entry::Vacant(vacant) = held.elements.entry(key) {
                    vacant.insert(value.clone());
                } else if is_member_set(set) {
                    // Counted per claim, as a change counts them.
                    *self.shared_pairs.entry(key).or_insert(1) += 1;
                } else if let Some(claimants) = self.contested.get_mut(&(set, key)) {
                    claimants.insert(name.clone());
                } else {
                    // Held by an earlier port, or by this one's own earlier claim.
                    let mut claimants: BTreeSet<ServicePortName> =
                        self.claimants((set, key)).into_iter().collect();
                    if !claimants.is_empty() {
                        claimants.insert(name.clone());
                        self.contested.insert((set, key), claimants);
                    }
                }
            }
            if share != PortShare::default() {
                self.ports.insert(name.clone(), share);
            }
        }
        // Filled port by port, a map's nodes are left a third to a half empty; built
        // again in bulk they are full (the maps hold most of a large ruleset).
        for set in self.ruleset.sets.values_mut() {
            set.elements = std::mem::take(&mut set.elements).into_iter().collect();
        }
        self.ruleset.chains = std::mem::take(&mut self.ruleset.chains)
            .into_iter()
            .collect();
        self.ports = std::mem::take(&mut self.ports).into_iter().collect();
    }

    /// Takes the given ports' objects out of the ruleset and builds them anew: both
    /// versions of what they touch, for the transaction between them. The new version is
    /// not in the ruleset yet ([`IncrementalRuleset::absorb`]).
    fn rebuild_ports<'a>(
        &mut self,
        state: &ProxyState,
        ports: impl IntoIterator<Item = &'a ServicePortName>,
    ) -> Touched {
        // The touched objects only: before as the ruleset held them, after as rebuilt.
        // Both declare the shared maps, holding only the touched elements.
        let mut before = Ruleset::empty(self.ruleset.family);
        let mut after = Ruleset::empty(self.ruleset.family);
        for (name, spec) in SHARED_SETS {
            before.sets.insert(name.to_owned(), Set::with_spec(spec));
            after.sets.insert(name.to_owned(), Set::with_spec(spec));
        }
        let mut chains = BTreeSet::new();
        let mut sets: BTreeSet<String> = SHARED_SETS
            .iter()
            .map(|(name, _)| (*name).to_owned())
            .collect();
        let names: BTreeSet<&ServicePortName> = ports.into_iter().collect();

        // Out with the touched ports' old shares and their claims.
        // Per element, how many touched ports held it.
        let mut released: BTreeMap<ElementKey, usize> = BTreeMap::new();
        let mut bucket_maps = BTreeSet::new();
        for &name in &names {
            if !state.services().contains_key(name) {
                self.slots.release(name);
            }
            let Some(old) = self.ports.remove(name) else {
                continue;
            };
            self.take_own(&old, &mut before);
            if let Some((map, keys)) = old.buckets {
                self.take_buckets(&map, &keys, &mut before);
                bucket_maps.insert(map);
            }
            chains.extend(old.chains);
            sets.extend(old.sets);
            for (map, key, _) in old.elements {
                if let Some(claimants) = self.contested.get_mut(&(map, key)) {
                    claimants.remove(name);
                }
                *released.entry((map, key)).or_default() += 1;
            }
        }
        // In with the new ones. Per element, the touched ports claiming it, in name order
        // (as `names` is); borrowed, as nearly every element has one claimant (a set of
        // owned names per element took 100 MiB at the first sync of 10,000 ports).
        let mut claimed: BTreeMap<ElementKey, Vec<&ServicePortName>> = BTreeMap::new();
        for &name in &names {
            let Some((
                PortObjects {
                    chains: own_chains,
                    sets: own_sets,
                    buckets,
                    ..
                },
                share,
            )) = self.claimed_port(state, name)
            else {
                continue;
            };
            if let Some((map, runs)) = buckets {
                bucket_maps.insert(map.clone());
                merge_into(&mut after, map, runs);
            }
            chains.extend(share.chains.iter().cloned());
            sets.extend(share.sets.iter().cloned());
            after.chains.extend(own_chains);
            after.sets.extend(own_sets);
            for (map, key, _) in &share.elements {
                claimed.entry((*map, *key)).or_default().push(name);
            }
            if share != PortShare::default() {
                self.ports.insert(name.clone(), share);
            }
        }
        // Every element a touched port held or claims goes to its first claimant.
        let touched: BTreeSet<ElementKey> =
            released.keys().chain(claimed.keys()).copied().collect();
        for element in touched {
            let (map, key) = element;
            let current = self
                .ruleset
                .sets
                .get_mut(map)
                .and_then(|set| set.elements.remove(&key));
            let touched_claimants = claimed.remove(&element).unwrap_or_default();
            if is_member_set(map) {
                // Claimed while any port claims it; the count goes on where more than one does.
                let held = self
                    .shared_pairs
                    .remove(&key)
                    .unwrap_or(usize::from(current.is_some()));
                let left = held.saturating_sub(released.get(&element).copied().unwrap_or(0))
                    + touched_claimants.len();
                if let (Some(value), Some(set)) = (current, before.sets.get_mut(map)) {
                    set.elements.insert(key, value);
                }
                if let (true, Some(set)) = (left > 0, after.sets.get_mut(map)) {
                    set.elements.insert(key, Value::Member);
                }
                if left > 1 {
                    self.shared_pairs.insert(key, left);
                }
                continue;
            }
            let others: BTreeSet<ServicePortName> =
                if let Some(others) = self.contested.remove(&element) {
                    others
                } else if current.is_some() && !released.contains_key(&element) {
                    // A new conflict: the holder is a port this update did not touch.
                    self.claimants(element).into_iter().collect()
                } else {
                    BTreeSet::new()
                };
            if let (Some(value), Some(set)) = (current, before.sets.get_mut(map)) {
                set.elements.insert(key, value);
            }
            let first = touched_claimants
                .first()
                .copied()
                .into_iter()
                .chain(others.first())
                .min();
            let winner = first
                .and_then(|name| self.ports.get(name))
                .and_then(|share| share.value(element));
            if let (Some(value), Some(set)) = (winner, after.sets.get_mut(map)) {
                set.elements.insert(key, value.clone());
            }
            if touched_claimants.len() + others.len() > 1 {
                let mut claimants = others;
                claimants.extend(touched_claimants.into_iter().cloned());
                if claimants.len() > 1 {
                    self.contested.insert(element, claimants);
                }
            }
        }

        // An endpoint map is declared while some port has buckets in it: `before` declares
        // the touched maps that exist, `after` those that will hold anything (the
        // untouched ports' runs, still in the ruleset, or the touched ports' new ones).
        for map in &bucket_maps {
            let Some(held) = self.ruleset.sets.get(map) else {
                continue;
            };
            let spec = held.spec;
            before
                .sets
                .entry(map.clone())
                .or_insert_with(|| Set::with_spec(spec));
            if !held.elements.is_empty() {
                after
                    .sets
                    .entry(map.clone())
                    .or_insert_with(|| Set::with_spec(spec));
            } else if !after.sets.contains_key(map) {
                self.ruleset.sets.remove(map);
            }
        }
        sets.extend(bucket_maps);
        Touched {
            before,
            after,
            chains,
            sets,
        }
    }

    /// Puts the rebuilt objects in. The touched ports' own sets were taken out, so a set
    /// still here is shared: it gets the new elements; every other set comes in whole.
    fn absorb(&mut self, rebuilt: Ruleset) {
        let Ruleset { chains, sets, .. } = rebuilt;
        self.ruleset.chains.extend(chains);
        for (name, set) in sets {
            merge_into(&mut self.ruleset, name, set);
        }
    }

    /// Every port claiming an element: a search through all ports, made only when an
    /// element held by one gets a second claimant.
    fn claimants(&self, element: ElementKey) -> Vec<ServicePortName> {
        self.ports
            .iter()
            .filter(|(_, share)| share.value(element).is_some())
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Moves a port's runs of buckets out of the endpoint map `map` into `into`'s copy.
    fn take_buckets(&mut self, map: &str, keys: &[Key], into: &mut Ruleset) {
        let Some(held) = self.ruleset.sets.get_mut(map) else {
            return;
        };
        let runs = into
            .sets
            .entry(map.to_owned())
            .or_insert_with(|| Set::with_spec(held.spec));
        for key in keys {
            if let Some(value) = held.elements.remove(key) {
                runs.elements.insert(*key, value);
            }
        }
    }

    /// Moves a port's own chains and sets out of the ruleset into `into`.
    fn take_own(&mut self, share: &PortShare, into: &mut Ruleset) {
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
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use tandem_common::IpFamily;
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
        ProxyState::from_entries(
            IpFamily::V4,
            [service],
            [(name, vec![endpoint(1, "node-b")])],
        )
    }

    #[test]
    fn a_ruleset_built_from_nothing_holds_what_the_same_change_would() {
        let external = Ipv4Addr::new(192, 0, 2, 7).into();
        let port = |service: &str, port: &str, ip: u8, endpoints: &[u8]| {
            let service = ServicePort {
                name: ServicePortName {
                    namespace: "default".into(),
                    name: service.into(),
                    port: port.into(),
                },
                external_ips: vec![external],
                ..super::layout::tests::service(Some(Ipv4Addr::new(10, 96, 0, ip)))
            };
            let endpoints: Vec<_> = endpoints.iter().map(|&n| endpoint(n, "node-b")).collect();
            (service, endpoints)
        };
        // Three ports claim the same external IP and port; two ports of one Service
        // share its cluster IP and their endpoints' hairpin pairs; one is gone.
        let mut state = ProxyState::new(IpFamily::V4);
        for (service, endpoints) in [
            port("a", "http", 1, &[1, 2]),
            port("b", "http", 2, &[3]),
            port("b", "dns", 2, &[3, 4]),
            port("c", "http", 3, &[]),
        ] {
            state.insert_endpoints(service.name.clone(), endpoints);
            state.insert_service(service);
        }
        let gone = ServicePortName {
            namespace: "default".into(),
            name: "d".into(),
            port: "http".into(),
        };
        let names: Vec<&ServicePortName> = state
            .services()
            .keys()
            .chain(std::iter::once(&gone))
            .collect();
        let mut built = IncrementalRuleset::new(node());
        built.update_without_transaction(&state, names.iter().copied());
        let mut changed = IncrementalRuleset::new(node());
        changed.update(&state, names.iter().copied());
        let parts = |r: &IncrementalRuleset| {
            (
                r.ruleset.clone(),
                r.ports.clone(),
                r.slots.clone(),
                r.contested.clone(),
                r.shared_pairs.clone(),
            )
        };
        assert!(!built.contested.is_empty() && !built.shared_pairs.is_empty());
        assert_eq!(parts(&built), parts(&changed));
        // And the next change finds the same claims in both.
        let first = state.services().keys().next().unwrap().clone();
        state.remove(&first);
        assert_eq!(
            built.update(&state, [&first]),
            changed.update(&state, [&first])
        );
        assert_eq!(parts(&built), parts(&changed));
    }

    #[test]
    fn a_rebuild_after_churn_keeps_the_slots_the_ports_hold() {
        let mut incremental = IncrementalRuleset::new(node());
        let port = |name: &str| ServicePort {
            name: ServicePortName {
                namespace: "default".into(),
                name: name.into(),
                port: "http".into(),
            },
            ..service(Some(Ipv4Addr::new(10, 96, 0, 1)))
        };
        let with = |names: &[&str]| {
            ProxyState::from_entries(IpFamily::V4, names.iter().map(|name| port(name)), [])
        };
        let first = with(&["a", "b"]);
        incremental.update(&first, first.services().keys());
        // "a" leaves and "z" takes its slot, 0, where name order would put it last.
        let churned = with(&["b", "z"]);
        let touched = [port("a").name, port("z").name];
        incremental.update(&churned, &touched);
        assert_ne!(incremental.slots(), &BucketSlots::in_name_order(&churned));
        let mut rebuilt = incremental.clone();
        rebuilt.rebuild(&churned);
        assert_eq!(rebuilt.ruleset(), incremental.ruleset());
        assert_eq!(rebuilt.slots(), incremental.slots());
    }

    #[test]
    fn a_hairpin_pair_stays_while_any_port_claims_it() {
        let port = |number: u16| ServicePort {
            name: ServicePortName {
                namespace: "default".into(),
                name: "web".into(),
                port: format!("p{number}"),
            },
            port: number,
            ..service(Some(Ipv4Addr::new(10, 96, 0, 1)))
        };
        let with = |numbers: &[u16]| {
            ProxyState::from_entries(
                IpFamily::V4,
                numbers.iter().map(|n| port(*n)),
                numbers
                    .iter()
                    .map(|n| (port(*n).name, vec![endpoint(1, "node-a")])),
            )
        };
        let pair = Key::SelfPair(Ipv4Addr::new(10, 180, 0, 1).into());
        let held = |rules: &IncrementalRuleset| {
            rules.ruleset().sets[layout::HAIRPIN_ENDPOINTS]
                .elements
                .contains_key(&pair)
        };
        let mut incremental = IncrementalRuleset::new(node());
        let three = with(&[80, 81, 82]);
        incremental.update(&three, three.services().keys());
        // The ports of one Service leave one at a time; the pair goes with the last.
        for (left, gone) in [(&[81u16, 82][..], 80u16), (&[82], 81), (&[], 82)] {
            let state = with(left);
            incremental.update(&state, [&port(gone).name]);
            assert_eq!(held(&incremental), !left.is_empty(), "{left:?} left");
            assert_eq!(
                incremental.ruleset(),
                &layout::build_with_slots(&state, &node(), incremental.slots())
            );
        }
    }

    #[test]
    fn changed_service_cidrs_rewrite_the_cluster_ips_check_alone() {
        let state = state(10);
        let mut incremental = IncrementalRuleset::new(node());
        incremental.update(&state, state.services().keys());
        let cidrs =
            |list: &[&str]| -> Vec<IpNet> { list.iter().map(|c| c.parse().unwrap()).collect() };
        for list in [
            &["10.96.0.0/16"][..],
            &["10.96.0.0/16", "10.97.0.0/16"],
            &["10.96.0.0/16"],
            &[],
        ] {
            let tx = incremental.set_service_cidrs(cidrs(list));
            // A flush of the chain and its rules written again: one drop rule per CIDR
            // after the reject, nothing else touched.
            assert_eq!(tx.ops[0], Op::FlushChain(layout::CLUSTER_IPS_CHECK.into()));
            assert_eq!(tx.ops.len(), 2 + list.len(), "{tx:?}");
            assert!(tx.ops[1..].iter().all(
                |op| matches!(op, Op::AddRule { chain, .. } if chain == layout::CLUSTER_IPS_CHECK)
            ));
            let node = NodeConfig {
                service_cidrs: cidrs(list),
                ..node()
            };
            assert_eq!(incremental.ruleset(), &layout::build(&state, &node));
            // A full rebuild (the periodic check) keeps them.
            let mut rebuilt = incremental.clone();
            rebuilt.rebuild(&state);
            assert_eq!(rebuilt.ruleset(), incremental.ruleset());
        }
        assert!(incremental.set_service_cidrs(Vec::new()).is_empty());
    }

    #[test]
    fn a_changed_affinity_timeout_rewrites_the_chains_that_use_the_set() {
        let mut incremental = IncrementalRuleset::new(node());
        let names: Vec<ServicePortName> = state(10).services().keys().cloned().collect();
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
