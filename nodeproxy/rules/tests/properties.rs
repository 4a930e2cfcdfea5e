//! Properties of `build` over random cluster states: every jump lands in a declared chain,
//! no per-Service chain is left unreferenced, output does not depend on input order, and
//! the traced endpoint probabilities of every Service sum to 1 over exactly its endpoints,
//! and the per-port incremental ruleset equals the full build after every change.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::generate::{MAX_PORTS, port_name, state};

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use proptest::prelude::*;
use tandem_common::IpFamily;
use tandem_proxy_rules::build;
use tandem_proxy_rules::chains::PER_SERVICE_PREFIXES;
use tandem_proxy_rules::incremental::IncrementalRuleset;
use tandem_proxy_rules::model::{Endpoint, NodeConfig, ProxyState, ServicePortName};
use tandem_proxy_rules::ruleset::{BASE_JUMPS, ChangedChains, Ruleset, Table};
use tandem_proxy_rules::trace::{Entry, Packet, TraceRequest, Verdict, trace};

const TERMINAL_TARGETS: &[&str] = &[
    "ACCEPT",
    "DROP",
    "REJECT",
    "RETURN",
    "MARK",
    "DNAT",
    "MASQUERADE",
];

/// `(table, chain, target)` of every `-j` to a chain of ours, including the base jumps.
fn jumps(ruleset: &Ruleset) -> Vec<(Table, String, String)> {
    let mut jumps = Vec::new();
    for table in [Table::Filter, Table::Nat] {
        for (chain, rules) in &ruleset.table(table).chains {
            for rule in rules {
                let target = rule
                    .split(" -j ")
                    .nth(1)
                    .or_else(|| rule.strip_prefix("-j "))
                    .unwrap();
                let target = target.split_whitespace().next().unwrap();
                if !TERMINAL_TARGETS.contains(&target) {
                    jumps.push((table, chain.clone(), target.to_owned()));
                }
            }
        }
    }
    for jump in BASE_JUMPS {
        let target = jump.rule.rsplit(" ").next().unwrap();
        jumps.push((jump.table, jump.builtin_chain.to_owned(), target.to_owned()));
    }
    jumps
}

fn reversed_lists(state: &ProxyState) -> ProxyState {
    let mut state = state.clone();
    state.edit_services(|service| {
        service.external_ips.reverse();
        service.load_balancer_ingress.reverse();
        service.load_balancer_source_ranges.reverse();
    });
    state.edit_endpoints(|_, endpoints| endpoints.reverse());
    state
}

/// Of the endpoints `on` keeps: the ready ones, or the serving terminating ones when none is
/// ready (KEP-1669).
fn usable(
    state: &ProxyState,
    name: &ServicePortName,
    on: impl Fn(&Endpoint) -> bool,
) -> BTreeSet<SocketAddr> {
    let endpoints: Vec<&Endpoint> = state
        .endpoints_of(name)
        .iter()
        .filter(|ep| on(ep))
        .collect();
    let any_ready = endpoints.iter().any(|ep| ep.is_ready());
    endpoints
        .iter()
        .filter(|ep| {
            if any_ready {
                ep.is_ready()
            } else {
                ep.is_serving_terminating()
            }
        })
        .filter(|ep| ep.ip.is_ipv4())
        .map(|ep| SocketAddr::new(ep.ip, ep.port))
        .collect()
}

/// The cluster-wide set on `node` as kube-proxy's `CategorizeEndpoints` picks it: the
/// ready endpoints, narrowed to those hinted for the node when every ready one has node
/// hints and one is for it, else to those hinted for its zone when every ready one has
/// zone hints and one is for it; the serving terminating ones when none is ready.
fn cluster_wide(
    state: &ProxyState,
    name: &ServicePortName,
    node: &NodeConfig,
) -> BTreeSet<SocketAddr> {
    let ready: Vec<&Endpoint> = state
        .endpoints_of(name)
        .iter()
        .filter(|ep| ep.is_ready())
        .collect();
    if ready.is_empty() {
        return usable(state, name, |_| true);
    }
    let zone = node.zone.clone().unwrap_or_default();
    let narrowing = |hints: fn(&Endpoint) -> &[String], to: &String| {
        ready.iter().all(|ep| !hints(ep).is_empty())
            && ready.iter().any(|ep| hints(ep).contains(to))
    };
    let kept: Vec<&&Endpoint> = if narrowing(Endpoint::node_hints, &node.node_name) {
        ready
            .iter()
            .filter(|ep| ep.node_hints().contains(&node.node_name))
            .collect()
    } else if narrowing(Endpoint::zone_hints, &zone) {
        ready
            .iter()
            .filter(|ep| ep.zone_hints().contains(&zone))
            .collect()
    } else {
        ready.iter().collect()
    };
    kept.iter()
        .map(|ep| SocketAddr::new(ep.ip, ep.port))
        .collect()
}

proptest! {
    #[test]
    fn every_jump_target_is_declared_and_every_service_chain_is_used(state in state()) {
        let ruleset = build(&state, &common::node_a());
        let jumps = jumps(&ruleset);
        for (table, chain, target) in &jumps {
            prop_assert!(
                ruleset.table(*table).chains.contains_key(target),
                "{} {chain} jumps to undeclared {target}", table.as_str()
            );
        }
        for table in [Table::Filter, Table::Nat] {
            for chain in ruleset.table(table).chains.keys() {
                if PER_SERVICE_PREFIXES.iter().any(|prefix| chain.starts_with(prefix)) {
                    prop_assert!(
                        jumps.iter().any(|(t, _, target)| *t == table && target == chain),
                        "{chain} is declared but nothing jumps to it"
                    );
                }
            }
        }
    }

    #[test]
    fn output_does_not_depend_on_input_order(state in state()) {
        prop_assert_eq!(build(&state, &common::node_a()), build(&reversed_lists(&state), &common::node_a()));
    }

    #[test]
    fn every_service_spreads_over_exactly_its_endpoints(state in state()) {
        let node = common::node_a();
        let ruleset = build(&state, &node);
        for (name, service) in state.services() {
            let Some(cluster_ip) = service.cluster_ip.filter(IpAddr::is_ipv4) else { continue };
            let packet = Packet { src: Ipv4Addr::new(10, 244, 1, 200).into(), dst: cluster_ip, protocol: service.protocol, dst_port: service.port };
            let traced = trace(&ruleset, &TraceRequest::new(packet, Entry::FromOutside, [Ipv4Addr::new(198, 18, 0, 11).into()])).unwrap();
            let anywhere = cluster_wide(&state, name, &node);
            // internalTrafficPolicy Local: this node's endpoints only, dropped without any.
            let expected = if service.internal_traffic_policy_local {
                usable(&state, name, |ep| ep.node_name.as_deref() == Some(node.node_name.as_str()))
            } else {
                anywhere.clone()
            };
            if expected.is_empty() {
                let chain = "KUBE-SERVICES".to_owned();
                let verdict = if anywhere.is_empty() {
                    Verdict::Reject { table: Table::Filter, chain }
                } else {
                    Verdict::Drop { table: Table::Filter, chain }
                };
                prop_assert_eq!(traced.outcomes.len(), 1);
                prop_assert_eq!(&traced.outcomes[0].verdict, &verdict);
                continue;
            }
            let total: f64 = traced.outcomes.iter().map(|o| o.probability).sum();
            prop_assert!((total - 1.0).abs() < 1e-6, "probabilities sum to {}", total);
            let reached: BTreeSet<SocketAddr> = traced.outcomes.iter().map(|o| o.dnat.unwrap()).collect();
            prop_assert_eq!(&reached, &expected);
            for outcome in &traced.outcomes {
                let share = 1.0 / expected.len() as f64;
                prop_assert!((outcome.probability - share).abs() < 1e-6, "uneven share {}", outcome.probability);
            }
        }
    }
}

proptest! {
    /// The per-port incremental ruleset equals the full build after every step, and the
    /// chains it reports are exactly those that differ.
    #[test]
    fn the_incremental_ruleset_follows_the_full_build(states in prop::collection::vec(state(), 1..5)) {
        let node = common::node_a();
        let mut incremental = IncrementalRuleset::new(node.clone());
        let mut previous = build(&ProxyState::new(IpFamily::V4), &node);
        // Every name a generated state can hold: those that were and those that are.
        let names: Vec<ServicePortName> = (0..MAX_PORTS).map(port_name).collect();
        for state in &states {
            let changed = incremental.update(state, &names);
            let full = build(state, &node);
            prop_assert_eq!(incremental.ruleset(), &full);
            prop_assert_eq!(changed, ChangedChains::between(&previous, &full));
            previous = full;
        }
    }
}
