//! The packet tracer over table `ip tandem` (or `ip6 tandem`): which base chains, rules and map elements a
//! new connection's first packet walks through on this node, and what becomes of it.
//!
//! Hooks run in netfilter order (prerouting, then input or forward after the routing
//! decision, or output, then postrouting), the base chains of one hook by priority (name
//! breaks ties). Every [`Match`] and [`Statement`] of the model is evaluated with the
//! meaning [`tandem_nftables::render`] gives it; `numgen random` forks the walk, one branch
//! per element with probability 1/N, and a random DNAT one branch per endpoint with its
//! share of the buckets. Requests and outcomes are [`crate::trace`]'s, with
//! the chain type (filter or nat) in the place of the iptables table, and the `affinity-…`
//! sets as the lists that already hold the client.

use tandem_nftables::{
    BUCKETS, Chain, ChainType, DispatchKey, Hook, Key, Match, Rule, Ruleset, Statement, Value,
    Verdict as MapVerdict, render,
};

use crate::ruleset::Table;
use crate::trace::{
    Entry, Hop, MAX_DEPTH, Outcome, Packet, Route, Trace, TraceError, TraceRequest, Verdict,
};

/// Traces `request` through `ruleset`. A jump to a missing chain or a lookup in a missing
/// set on the packet's way is an error, never a guess.
pub fn trace(ruleset: &Ruleset, request: &TraceRequest) -> Result<Trace, TraceError> {
    let tracer = Tracer { ruleset, request };
    let start = Walk {
        packet: request.packet,
        mark: 0,
        probability: 1.0,
        hops: Vec::new(),
        dnat: None,
        masqueraded: false,
        accepted: None,
    };
    let outcomes = tracer
        .walk_hooks(start)?
        .into_iter()
        .map(|(walk, verdict, route)| Outcome {
            probability: walk.probability,
            dnat: walk.dnat,
            masqueraded: walk.masqueraded,
            route,
            verdict: match (verdict, walk.accepted) {
                (Verdict::Pass, Some((table, chain))) => Verdict::Accept { table, chain },
                (verdict, _) => verdict,
            },
            hops: walk.hops,
        })
        .collect();
    Ok(Trace {
        request: request.clone(),
        outcomes,
    })
}

#[derive(Debug, Clone)]
struct Walk {
    packet: Packet,
    mark: u32,
    probability: f64,
    hops: Vec<Hop>,
    dnat: Option<std::net::SocketAddr>,
    masqueraded: bool,
    /// The last filter chain that accepted the packet explicitly.
    accepted: Option<(Table, String)>,
}

/// How a chain walk ended.
#[derive(Debug, Clone, PartialEq)]
enum Flow {
    /// Fell off the end or hit `return`: the caller continues.
    Continue,
    /// `accept` or a NAT statement: this base chain is done, the next one runs.
    Accept,
    Drop(String),
    Reject(String),
}

struct Tracer<'a> {
    ruleset: &'a Ruleset,
    request: &'a TraceRequest,
}

fn table_of(chain_type: ChainType) -> Table {
    match chain_type {
        ChainType::Filter => Table::Filter,
        ChainType::Nat => Table::Nat,
    }
}

impl Tracer<'_> {
    fn route(&self, walk: &Walk) -> Route {
        if self.request.is_local(walk.packet.dst) {
            Route::LocalDelivery
        } else {
            Route::Forward
        }
    }

    /// The hooks in kernel order for the entry point. A packet stopped before routing
    /// reports the route its destination would have taken.
    fn walk_hooks(&self, start: Walk) -> Result<Vec<(Walk, Verdict, Route)>, TraceError> {
        let first = match self.request.entry {
            Entry::FromOutside => Hook::Prerouting,
            Entry::Local => Hook::Output,
        };
        let mut finished = Vec::new();
        for (mut walk, verdict) in self.walk_hook(first, start)? {
            let route = self.route(&walk);
            if verdict != Verdict::Pass {
                finished.push((walk, verdict, route));
                continue;
            }
            walk.hops.push(Hop::Route {
                route,
                dst: walk.packet.dst,
            });
            let next = match (self.request.entry, route) {
                (Entry::FromOutside, Route::LocalDelivery) => vec![Hook::Input],
                (Entry::FromOutside, Route::Forward) => vec![Hook::Forward, Hook::Postrouting],
                (Entry::Local, Route::Forward) => vec![Hook::Postrouting],
                // Looped back to ourselves: delivered through input as well.
                (Entry::Local, Route::LocalDelivery) => vec![Hook::Postrouting, Hook::Input],
            };
            let mut live = vec![walk];
            for hook in next {
                let mut passed = Vec::new();
                for walk in live {
                    for (walk, verdict) in self.walk_hook(hook, walk)? {
                        if verdict == Verdict::Pass {
                            passed.push(walk);
                        } else {
                            finished.push((walk, verdict, route));
                        }
                    }
                }
                live = passed;
            }
            finished.extend(live.into_iter().map(|walk| (walk, Verdict::Pass, route)));
        }
        Ok(finished)
    }

    /// Every base chain on `hook`, by priority: a drop or reject ends the packet.
    fn walk_hook(&self, hook: Hook, walk: Walk) -> Result<Vec<(Walk, Verdict)>, TraceError> {
        let mut bases: Vec<(i32, &str, ChainType, &Chain)> = self
            .ruleset
            .chains
            .iter()
            .filter_map(|(name, chain)| {
                let base = chain.base.filter(|base| base.hook == hook)?;
                Some((base.priority, name.as_str(), base.chain_type, chain))
            })
            .collect();
        bases.sort_by_key(|&(priority, name, ..)| (priority, name));
        let mut live = vec![walk];
        let mut finished = Vec::new();
        for (_, name, chain_type, chain) in bases {
            let table = table_of(chain_type);
            let mut next = Vec::new();
            for walk in live {
                for (walk, flow) in self.walk_chain(table, name, chain, walk, 0)? {
                    match flow {
                        Flow::Continue | Flow::Accept => next.push(walk),
                        Flow::Drop(chain) => finished.push((walk, Verdict::Drop { table, chain })),
                        Flow::Reject(chain) => {
                            finished.push((walk, Verdict::Reject { table, chain }))
                        }
                    }
                }
            }
            live = next;
        }
        finished.extend(live.into_iter().map(|walk| (walk, Verdict::Pass)));
        Ok(finished)
    }

    fn walk_chain(
        &self,
        table: Table,
        name: &str,
        chain: &Chain,
        walk: Walk,
        depth: usize,
    ) -> Result<Vec<(Walk, Flow)>, TraceError> {
        if depth > MAX_DEPTH {
            return Err(TraceError::TooDeep {
                table: table.as_str(),
                chain: name.to_owned(),
            });
        }
        let mut live = vec![walk];
        let mut done = Vec::new();
        for rule in &chain.rules {
            let mut next = Vec::new();
            for mut walk in live {
                if !self.matches(table, name, rule, &walk)? {
                    next.push(walk);
                    continue;
                }
                walk.hops.push(Hop::Rule {
                    table,
                    chain: name.to_owned(),
                    rule: render::rule(rule, self.ruleset.family),
                });
                for (walk, step) in self.execute(table, name, &rule.statement, walk, depth)? {
                    match step {
                        Step::Next => next.push(walk),
                        Step::Done(flow) => done.push((walk, flow)),
                    }
                }
            }
            live = next;
        }
        done.extend(live.into_iter().map(|walk| (walk, Flow::Continue)));
        Ok(done)
    }

    fn matches(
        &self,
        table: Table,
        chain: &str,
        rule: &Rule,
        walk: &Walk,
    ) -> Result<bool, TraceError> {
        let packet = &walk.packet;
        for m in &rule.matches {
            let matched = match m {
                Match::SourceAddress { net, negated } => net.contains(&packet.src) != *negated,
                Match::DestinationAddress { net, negated } => net.contains(&packet.dst) != *negated,
                Match::Protocol(protocol) => packet.protocol == *protocol,
                Match::DestinationPort { protocol, port } => {
                    packet.protocol == *protocol && packet.dst_port == *port
                }
                // The tracer follows the first packet of a connection.
                Match::ConnectionNew => true,
                Match::ConnectionDnat => walk.dnat.is_some(),
                Match::DestinationLocal => self.request.is_local(packet.dst),
                Match::SourceLocal => self.request.is_local(packet.src),
                Match::Mark { bit, set: true } => walk.mark & bit == *bit,
                Match::Mark { bit, set: false } => walk.mark & bit == 0,
                Match::SourceInSet(set) => {
                    self.set(table, chain, set)?;
                    self.request.recent_lists.contains(set)
                }
                // The set holds addresses paired with themselves only.
                Match::AddressPairInSet(set) => {
                    let pairs = &self.set(table, chain, set)?.elements;
                    packet.src == packet.dst && pairs.contains_key(&Key::SelfPair(packet.src))
                }
                Match::InputInterface {
                    name,
                    prefix,
                    negated,
                } => {
                    let named = |iif: &str| match prefix {
                        true => iif.starts_with(name.as_str()),
                        false => iif == name,
                    };
                    self.request.in_interface().is_some_and(named) != *negated
                }
                Match::DestinationInSet(set) => self
                    .set(table, chain, set)?
                    .elements
                    .contains_key(&Key::Address(packet.dst)),
            };
            if !matched {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn set(
        &self,
        table: Table,
        chain: &str,
        set: &str,
    ) -> Result<&tandem_nftables::Set, TraceError> {
        self.ruleset
            .sets
            .get(set)
            .ok_or_else(|| TraceError::UndeclaredSet {
                table: table.as_str(),
                chain: chain.to_owned(),
                set: set.to_owned(),
            })
    }

    /// Runs a matched rule's statement: the walks that go on to the next rule, and those
    /// whose chain is done.
    fn execute(
        &self,
        table: Table,
        chain: &str,
        statement: &Statement,
        mut walk: Walk,
        depth: usize,
    ) -> Result<Vec<(Walk, Step)>, TraceError> {
        let done = |walk, flow| Ok(vec![(walk, Step::Done(flow))]);
        match statement {
            Statement::Jump(target) => self.call(table, chain, target, walk, depth, false),
            Statement::Goto(target) => self.call(table, chain, target, walk, depth, true),
            Statement::Return => done(walk, Flow::Continue),
            Statement::Accept => {
                if table == Table::Filter {
                    walk.accepted = Some((table, chain.to_owned()));
                }
                done(walk, Flow::Accept)
            }
            Statement::Drop => done(walk, Flow::Drop(chain.to_owned())),
            Statement::Reject => done(walk, Flow::Reject(chain.to_owned())),
            Statement::Dispatch { key, map } => {
                let p = walk.packet;
                let key = match key {
                    DispatchKey::AddressProtocolPort => {
                        Key::AddressProtocolPort(p.dst, p.protocol, p.dst_port)
                    }
                    DispatchKey::ProtocolPort => Key::ProtocolPort(p.protocol, p.dst_port),
                };
                match self.set(table, chain, map)?.elements.get(&key) {
                    Some(Value::Verdict(verdict)) => {
                        self.map_verdict(table, chain, verdict, walk, depth)
                    }
                    _ => Ok(vec![(walk, Step::Next)]),
                }
            }
            Statement::RandomDispatch { modulus, map } => {
                let elements = &self.set(table, chain, map)?.elements;
                let share = 1.0 / f64::from((*modulus).max(1));
                let mut out = Vec::new();
                for index in 0..*modulus {
                    let mut branch = walk.clone();
                    branch.probability *= share;
                    match elements.get(&Key::Index(index)) {
                        Some(Value::Verdict(verdict)) => {
                            out.extend(self.map_verdict(table, chain, verdict, branch, depth)?)
                        }
                        _ => out.push((branch, Step::Next)),
                    }
                }
                Ok(out)
            }
            Statement::RandomDnat { map, offset } => {
                // One branch per endpoint, weighted by its buckets within the rule's range
                // (the map holds other spreads' ranges too); buckets no element holds find
                // no endpoint and go on to the next rule.
                let range_last = offset.saturating_add(BUCKETS - 1);
                let mut out = Vec::new();
                let mut unowned = BUCKETS;
                for (key, value) in &self.set(table, chain, map)?.elements {
                    let (Key::Buckets { first, last }, Value::Endpoint(to)) = (key, value) else {
                        continue;
                    };
                    let (first, last) = ((*first).max(*offset), (*last).min(range_last));
                    if first > last {
                        continue;
                    }
                    let owned = last - first + 1;
                    unowned = unowned.saturating_sub(owned);
                    let mut branch = walk.clone();
                    branch.probability *= f64::from(owned) / f64::from(BUCKETS);
                    out.push((dnat(branch, *to), Step::Done(Flow::Accept)));
                }
                if unowned > 0 {
                    let mut rest = walk;
                    rest.probability *= f64::from(unowned) / f64::from(BUCKETS);
                    out.push((rest, Step::Next));
                }
                Ok(out)
            }
            Statement::SetMark(bit) => {
                walk.mark |= bit;
                Ok(vec![(walk, Step::Next)])
            }
            Statement::ToggleMark(bit) => {
                walk.mark ^= bit;
                Ok(vec![(walk, Step::Next)])
            }
            Statement::Masquerade => {
                walk.masqueraded = true;
                done(walk, Flow::Accept)
            }
            Statement::Dnat(to) => done(dnat(walk, *to), Flow::Accept),
            Statement::AddSourceToSet(set) => {
                self.set(table, chain, set)?;
                Ok(vec![(walk, Step::Next)])
            }
        }
    }

    fn map_verdict(
        &self,
        table: Table,
        chain: &str,
        verdict: &MapVerdict,
        walk: Walk,
        depth: usize,
    ) -> Result<Vec<(Walk, Step)>, TraceError> {
        match verdict {
            MapVerdict::Drop => Ok(vec![(walk, Step::Done(Flow::Drop(chain.to_owned())))]),
            MapVerdict::Goto(target) => self.call(table, chain, target, walk, depth, true),
        }
    }

    /// `jump` continues here after the target returns; `goto` returns to our caller.
    fn call(
        &self,
        table: Table,
        from: &str,
        target: &str,
        walk: Walk,
        depth: usize,
        goto: bool,
    ) -> Result<Vec<(Walk, Step)>, TraceError> {
        let Some(chain) = self.ruleset.chains.get(target) else {
            return Err(TraceError::UndeclaredChain {
                table: table.as_str(),
                from: from.to_owned(),
                chain: target.to_owned(),
            });
        };
        Ok(self
            .walk_chain(table, target, chain, walk, depth + 1)?
            .into_iter()
            .map(|(walk, flow)| match flow {
                Flow::Continue if !goto => (walk, Step::Next),
                flow => (walk, Step::Done(flow)),
            })
            .collect())
    }
}

fn dnat(mut walk: Walk, to: std::net::SocketAddr) -> Walk {
    walk.dnat = Some(to);
    walk.packet.dst = to.ip();
    walk.packet.dst_port = to.port();
    walk
}

/// After one rule: go on with the next rule, or the chain is done.
enum Step {
    Next,
    Done(Flow),
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use tandem_nftables::BaseChain;

    use super::*;

    fn request() -> TraceRequest {
        let packet = Packet {
            src: Ipv4Addr::new(192, 0, 2, 1).into(),
            dst: Ipv4Addr::new(192, 0, 2, 2).into(),
            protocol: tandem_common::Protocol::Tcp,
            dst_port: 1,
        };
        TraceRequest::new(packet, Entry::FromOutside, [])
    }

    fn ruleset(chains: Vec<(&str, Chain)>) -> Ruleset {
        Ruleset {
            family: tandem_common::IpFamily::V4,
            chains: chains
                .into_iter()
                .map(|(name, chain)| (name.to_owned(), chain))
                .collect(),
            sets: Default::default(),
        }
    }

    fn base(rules: Vec<Rule>) -> Chain {
        Chain {
            base: Some(BaseChain {
                chain_type: ChainType::Filter,
                hook: Hook::Prerouting,
                priority: 0,
            }),
            rules,
        }
    }

    fn chain(rules: Vec<Rule>) -> Chain {
        Chain { base: None, rules }
    }

    #[test]
    fn goto_returns_to_the_caller_of_its_chain_and_jump_to_the_next_rule() {
        let mark = |bit| Rule::always(Statement::SetMark(bit));
        let rs = ruleset(vec![
            (
                "base",
                base(vec![
                    Rule::always(Statement::Jump("a".into())),
                    Rule::when(vec![Match::Mark { bit: 2, set: true }], Statement::Drop),
                    Rule::always(Statement::Reject),
                ]),
            ),
            (
                "a",
                chain(vec![Rule::always(Statement::Goto("b".into())), mark(2)]),
            ),
            ("b", chain(vec![mark(1)])),
        ]);
        // b returns past the rest of a (no mark 2): the reject, not the drop.
        let traced = trace(&rs, &request()).unwrap();
        assert_eq!(
            traced.outcomes[0].verdict,
            Verdict::Reject {
                table: Table::Filter,
                chain: "base".into()
            }
        );
    }

    #[test]
    fn a_jump_to_a_missing_chain_is_an_error() {
        let rs = ruleset(vec![(
            "base",
            base(vec![Rule::always(Statement::Goto("service-x".into()))]),
        )]);
        let err = trace(&rs, &request()).unwrap_err();
        assert!(matches!(err, TraceError::UndeclaredChain { .. }), "{err}");
    }

    #[test]
    fn a_lookup_in_a_missing_set_is_an_error() {
        let rs = ruleset(vec![(
            "base",
            base(vec![Rule::always(Statement::Dispatch {
                key: DispatchKey::AddressProtocolPort,
                map: "service-ips".into(),
            })]),
        )]);
        let err = trace(&rs, &request()).unwrap_err();
        assert!(matches!(err, TraceError::UndeclaredSet { .. }), "{err}");
    }
}
