//! The nftables mode against the iptables mode: for every scenario and for random cluster
//! states, the same packets meet the same fates (DNAT targets with their probabilities,
//! masquerading, route, delivered/dropped/rejected) through both rulesets; the per-port
//! incremental ruleset equals the full build, and its transactions, applied in order (in
//! memory, and as root by `nft -f` in fresh network namespaces), rebuild it; and the whole
//! ruleset as nft text, for review.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use common::generate::{MAX_PORTS, port_name, state};
use common::ip;
use common::netns::{Netns, is_root};
use proptest::prelude::*;
use tandem_common::{IpFamily, Protocol};
use tandem_nftables::{
    Key, Op, Ruleset, Statement, Transaction, Value, Verdict as MapVerdict, render,
};
use tandem_proxy_rules::chains::endpoint_chain;
use tandem_proxy_rules::model::{
    Endpoint, IpMode, LocalDetector, NodeConfig, ProxyState, ServicePort, ServicePortName,
};
use tandem_proxy_rules::nft::incremental::IncrementalRuleset;
use tandem_proxy_rules::nft::layout::{self, affinity_set};
use tandem_proxy_rules::nft::slots::BucketSlots;
use tandem_proxy_rules::nft::trace::trace as nft_trace;
use tandem_proxy_rules::trace::{Entry, Packet, Route, Trace, TraceRequest, Verdict, trace};

/// The addresses the cases use, in one family: node-a's, a client inside the source
/// ranges and one outside them, a pod on node-a, and an address of the node network
/// that is no node's.
struct Addresses {
    node: &'static str,
    allowed_client: &'static str,
    disallowed_client: &'static str,
    pod_on_node: &'static str,
    not_a_node: &'static str,
}

const V4: Addresses = Addresses {
    node: "198.18.0.11",
    allowed_client: "203.0.113.7",
    disallowed_client: "192.0.2.99",
    pod_on_node: "10.244.1.20",
    not_a_node: "198.18.0.99",
};

/// Within the IPv6 reference state's ranges (`common::dual_stack_reference_state_v6`).
const V6: Addresses = Addresses {
    node: "2001:db8:18::11",
    allowed_client: "2001:db8:203::7",
    disallowed_client: "2001:db8:204::9",
    pod_on_node: "fd00:10:244:1::20",
    not_a_node: "2001:db8:18::99",
};

const NODE_IP: &str = V4.node;
const ALLOWED_CLIENT: &str = V4.allowed_client;
const DISALLOWED_CLIENT: &str = V4.disallowed_client;

/// One packet to trace through both modes: `pinned` is an endpoint the client already
/// has session affinity to.
#[derive(Debug, Clone)]
struct Case {
    packet: Packet,
    entry: Entry,
    local: Vec<IpAddr>,
    pinned: Option<(ServicePortName, SocketAddr)>,
}

fn case(protocol: Protocol, src: &str, dst: IpAddr, port: u16, entry: Entry) -> Case {
    Case {
        packet: Packet {
            src: ip(src),
            dst,
            protocol,
            dst_port: port,
        },
        entry,
        local: Vec::new(),
        pinned: None,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fate {
    Delivered,
    Dropped,
    Rejected,
}

/// What a packet's outcomes amount to, by (DNAT, masqueraded, delivered locally, fate),
/// with the summed probability of each; for a dropped or rejected packet, the fate alone.
type Summary = BTreeMap<(Option<SocketAddr>, bool, bool, Fate), f64>;

fn summary(trace: &Trace) -> Summary {
    let mut out = Summary::new();
    for outcome in &trace.outcomes {
        let fate = match outcome.verdict {
            Verdict::Pass | Verdict::Accept { .. } => Fate::Delivered,
            Verdict::Drop { .. } => Fate::Dropped,
            Verdict::Reject { .. } => Fate::Rejected,
        };
        // Where a stopped packet would have gone is of no consequence: the iptables mode
        // may DNAT a packet it has marked for dropping, the nftables mode drops at once.
        let key = if fate == Fate::Delivered {
            (
                outcome.dnat,
                outcome.masqueraded,
                outcome.route == Route::LocalDelivery,
                fate,
            )
        } else {
            (None, false, false, fate)
        };
        *out.entry(key).or_default() += outcome.probability;
    }
    out
}

fn same_fates(iptables: &Trace, nft: &Trace) -> bool {
    let (a, b) = (summary(iptables), summary(nft));
    a.len() == b.len()
        && a.iter()
            .zip(&b)
            .all(|((ka, pa), (kb, pb))| ka == kb && (pa - pb).abs() < 1e-6)
}

/// Traces every case of `state` through both modes' rulesets on `node` and asserts the
/// same fates.
fn assert_same_fates(state: &ProxyState, node: &NodeConfig) {
    assert_same_fates_at(state, node, &V4);
}

fn assert_same_fates_at(state: &ProxyState, node: &NodeConfig, at: &Addresses) {
    let iptables_rules = tandem_proxy_rules::build(state, node);
    let nft_rules = layout::build(state, node);
    for case in cases(state, at) {
        let mut request = TraceRequest::new(case.packet, case.entry, case.local.iter().copied());
        let mut nft_request = request.clone();
        if let Some((name, ep)) = &case.pinned {
            let protocol = state.services()[name].protocol;
            request
                .recent_lists
                .insert(endpoint_chain(name, protocol, *ep));
            nft_request
                .recent_lists
                .insert(affinity_set(name, protocol, *ep));
        }
        let iptables = trace(&iptables_rules, &request).unwrap();
        let nft = nft_trace(&nft_rules, &nft_request).unwrap();
        if let Some(fate) = cluster_ips_check(state, node, &iptables) {
            // Where the nftables mode departs on purpose (kube-proxy's cluster-ips-check):
            // the iptables mode keeps v1.21's fate, forwarding the packet as it is.
            let only = |fate| Summary::from([((None, false, false, fate), 1.0)]);
            assert_eq!(summary(&iptables), only(Fate::Delivered), "{iptables}");
            assert_eq!(summary(&nft), only(fate), "{nft}");
            continue;
        }
        assert!(
            same_fates(&iptables, &nft),
            "iptables:\n{iptables}\nnftables:\n{nft}"
        );
    }
}

/// The fate the nftables mode's `cluster-ips-check` gives a packet the iptables mode lets
/// through untranslated: rejected to a cluster IP (a port it does not serve), dropped to
/// the rest of the Service CIDRs. `None` for every other packet.
fn cluster_ips_check(state: &ProxyState, node: &NodeConfig, iptables: &Trace) -> Option<Fate> {
    let untranslated = iptables
        .outcomes
        .iter()
        .all(|o| o.dnat.is_none() && !o.verdict.stops_packet());
    let dst = iptables.request.packet.dst;
    if !untranslated || iptables.request.is_local(dst) {
        return None;
    }
    if state
        .services()
        .values()
        .any(|svc| svc.cluster_ip == Some(dst))
    {
        Some(Fate::Rejected)
    } else if node.service_cidrs.iter().any(|cidr| cidr.contains(&dst)) {
        Some(Fate::Dropped)
    } else {
        None
    }
}

/// The Service ports that capture each external address (`ip . protocol . port`), as
/// whether each has a usable endpoint.
type ExternalClaims = BTreeMap<(IpAddr, Protocol, u16), Vec<bool>>;

fn external_claims(state: &ProxyState) -> ExternalClaims {
    let mut claims = ExternalClaims::new();
    for (name, svc) in state.services() {
        if svc.cluster_ip.is_none() {
            continue;
        }
        let usable = state
            .endpoints_of(name)
            .iter()
            .any(|ep| ep.is_ready() || ep.is_serving_terminating());
        let vips = svc
            .load_balancer_ingress
            .iter()
            .filter(|ingress| ingress.ip_mode == IpMode::Vip)
            .map(|ingress| &ingress.ip);
        let addresses: BTreeSet<IpAddr> = svc.external_ips.iter().chain(vips).copied().collect();
        for addr in addresses {
            claims
                .entry((addr, svc.protocol, svc.port))
                .or_default()
                .push(usable);
        }
    }
    claims
}

/// The packets that exercise every path of every Service port of `state`.
fn cases(state: &ProxyState, at: &Addresses) -> Vec<Case> {
    let mut cases = Vec::new();
    let (node, pod_on_node, allowed, disallowed) = (
        at.node,
        at.pod_on_node,
        at.allowed_client,
        at.disallowed_client,
    );
    let node_ip = ip(node);
    let claims = external_claims(state);
    for (name, svc) in state.services() {
        let proto = svc.protocol;
        let endpoints = state.endpoints_of(name);
        if let Some(cip) = svc.cluster_ip {
            for src in [pod_on_node, allowed] {
                cases.push(case(proto, src, cip, svc.port, Entry::FromOutside));
            }
            cases.push(case(proto, node, cip, svc.port, Entry::Local));
            cases.push(case(
                proto,
                pod_on_node,
                cip,
                svc.port + 1,
                Entry::FromOutside,
            ));
            let other = if proto == Protocol::Udp {
                Protocol::Tcp
            } else {
                Protocol::Udp
            };
            cases.push(case(other, pod_on_node, cip, svc.port, Entry::FromOutside));
            if let Some(ep) = endpoints.first() {
                // Hairpin: an endpoint reaching its own Service.
                let src = ep.ip.to_string();
                cases.push(case(proto, &src, cip, svc.port, Entry::FromOutside));
                // The endpoint reaching its own address, not through the Service: no
                // DNAT, so no masquerade either.
                cases.push(case(proto, &src, ep.ip, ep.port, Entry::FromOutside));
                if svc.session_affinity_timeout.is_some() {
                    let mut pinned = case(proto, allowed, cip, svc.port, Entry::FromOutside);
                    pinned.pinned = Some((name.clone(), SocketAddr::new(ep.ip, ep.port)));
                    cases.push(pinned);
                }
            }
        }
        let external = svc
            .external_ips
            .iter()
            .chain(svc.load_balancer_ingress.iter().map(|ingress| &ingress.ip));
        for addr in external.copied() {
            let claimants = claims
                .get(&(addr, proto, svc.port))
                .map_or(&[][..], Vec::as_slice);
            if claimants.len() > 1 {
                // Ports that list the same address resolve it differently in detail in
                // the two modes (the nftables mode gives each map's key to the first).
                continue;
            }
            // The LB IP as its own source: the node's connection looped back to it.
            let looped = addr.to_string();
            for src in [allowed, disallowed, pod_on_node, &looped] {
                cases.push(case(proto, src, addr, svc.port, Entry::FromOutside));
                // The LB IP assigned to the node itself: INPUT instead of FORWARD.
                let mut local = case(proto, src, addr, svc.port, Entry::FromOutside);
                local.local.push(addr);
                cases.push(local);
            }
            // The iptables mode lets the node's own connections to an external address
            // without endpoints through; the nftables mode rejects them (see below).
            if !claimants.contains(&false) {
                cases.push(case(proto, node, addr, svc.port, Entry::Local));
            }
            if let (Some(_), Some(ep)) = (svc.session_affinity_timeout, endpoints.first()) {
                let mut pinned = case(proto, allowed, addr, svc.port, Entry::FromOutside);
                pinned.pinned = Some((name.clone(), SocketAddr::new(ep.ip, ep.port)));
                cases.push(pinned);
            }
        }
        if let Some(node_port) = svc.node_port {
            for src in [allowed, pod_on_node] {
                cases.push(case(proto, src, node_ip, node_port, Entry::FromOutside));
            }
            cases.push(case(proto, node, node_ip, node_port, Entry::Local));
            // Not a node address: no node port.
            cases.push(case(
                proto,
                allowed,
                ip(at.not_a_node),
                node_port,
                Entry::FromOutside,
            ));
        }
        if let Some(health) = svc.health_check_node_port {
            cases.push(case(
                Protocol::Tcp,
                allowed,
                node_ip,
                health,
                Entry::FromOutside,
            ));
            cases.push(case(Protocol::Tcp, node, node_ip, health, Entry::Local));
        }
    }
    // Every case runs on node-a, whatever else is local.
    for case in &mut cases {
        case.local.push(node_ip);
    }
    cases
}

#[test]
fn every_scenario_meets_the_same_fates_in_both_modes() {
    for (name, state) in common::scenarios() {
        assert!(!cases(&state, &V4).is_empty(), "{name}");
        assert_same_fates(&state, &common::node_a());
    }
}

#[test]
fn the_ipv6_reference_state_meets_the_same_fates_in_both_modes() {
    let state = common::dual_stack_reference_state_v6();
    let node = common::node_a_v6();
    assert!(cases(&state, &V6).len() > 20);
    assert_same_fates_at(&state, &node, &V6);
    // The cases reach endpoints: the LB IP from inside the ranges is DNATed to IPv6 pods.
    let mut lb = case(
        Protocol::Tcp,
        V6.allowed_client,
        ip("2001:db8:51:100::20"),
        80,
        Entry::FromOutside,
    );
    lb.local.push(ip(V6.node));
    let request = TraceRequest::new(lb.packet, lb.entry, lb.local);
    let traced = nft_trace(&layout::build(&state, &node), &request).unwrap();
    assert!(
        traced
            .outcomes
            .iter()
            .all(|o| o.dnat.is_some_and(|to| to.is_ipv6())),
        "{traced}"
    );
    // The IPv6 table is of its family, and holds IPv6 addresses only.
    let table = layout::build(&state, &node);
    assert_eq!(table.family, IpFamily::V6);
    let text = render::transaction(&Transaction::replace_all(&table));
    assert!(text.contains("add table ip6 tandem"));
    assert!(
        text.contains("2001:db8:51:100::20 . tcp . 80 : goto firewall-"),
        "{text}"
    );
    assert!(
        !text.contains("ipv4_addr") && !text.contains(" ip saddr"),
        "{text}"
    );
}

/// `(chain, target)` of every jump and goto, in rules and in map elements.
fn references(ruleset: &Ruleset) -> Vec<(String, String)> {
    let mut refs = Vec::new();
    for (name, chain) in &ruleset.chains {
        for rule in &chain.rules {
            if let Statement::Jump(target) | Statement::Goto(target) = &rule.statement {
                refs.push((name.clone(), target.clone()));
            }
        }
    }
    for (name, set) in &ruleset.sets {
        for value in set.elements.values() {
            if let Value::Verdict(MapVerdict::Goto(target)) = value {
                refs.push((format!("@{name}"), target.clone()));
            }
        }
    }
    refs
}

/// The sets a ruleset's rules use.
fn used_sets(ruleset: &Ruleset) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    for chain in ruleset.chains.values() {
        for rule in &chain.rules {
            match &rule.statement {
                Statement::Dispatch { map, .. }
                | Statement::RandomDispatch { map, .. }
                | Statement::RandomDnat { map, .. } => {
                    used.insert(map.clone());
                }
                Statement::AddSourceToSet(set) => {
                    used.insert(set.clone());
                }
                _ => {}
            }
            for m in &rule.matches {
                if let tandem_nftables::Match::SourceInSet(set)
                | tandem_nftables::Match::AddressPairInSet(set)
                | tandem_nftables::Match::DestinationInSet(set) = m
                {
                    used.insert(set.clone());
                }
            }
        }
    }
    used
}

/// Applies `tx` as the kernel would, refusing what the kernel refuses: a duplicate or
/// overlapping element, a missing object, deleting a chain or set that is still referenced.
fn apply(ruleset: &mut Ruleset, tx: &Transaction) {
    for op in &tx.ops {
        match op {
            Op::AddTable => {}
            Op::DeleteTable => *ruleset = Ruleset::default(),
            Op::AddChain { name, base } => {
                let chain = ruleset.chains.entry(name.clone()).or_default();
                chain.base = *base;
            }
            Op::FlushChain(name) => ruleset.chains.get_mut(name).unwrap().rules.clear(),
            Op::DeleteChain(name) => {
                assert!(ruleset.chains[name].rules.is_empty(), "{name} not empty");
                let referrers: Vec<_> = references(ruleset)
                    .into_iter()
                    .filter(|(_, target)| target == name)
                    .collect();
                assert!(referrers.is_empty(), "{name} still used by {referrers:?}");
                ruleset.chains.remove(name);
            }
            Op::AddRule { chain, rule } => ruleset
                .chains
                .get_mut(chain)
                .unwrap()
                .rules
                .push(rule.clone()),
            Op::AddSet { name, spec } => {
                let old = ruleset.sets.insert(
                    name.clone(),
                    tandem_nftables::Set {
                        spec: *spec,
                        elements: BTreeMap::new(),
                    },
                );
                assert!(
                    old.is_none_or(|old| old.spec == *spec),
                    "{name} re-declared"
                );
            }
            Op::DeleteSet(name) => {
                assert!(!used_sets(ruleset).contains(name), "{name} still used");
                ruleset.sets.remove(name).unwrap();
            }
            Op::AddElements { set, elements } => {
                let set_elements = &mut ruleset.sets.get_mut(set).unwrap().elements;
                for (key, value) in elements {
                    if let Value::Verdict(MapVerdict::Goto(target)) = value {
                        assert!(ruleset.chains.contains_key(target), "{target} missing");
                    }
                    if let Key::Buckets { first, last } = key {
                        let overlapping = set_elements.keys().any(|other| {
                            matches!(other, Key::Buckets { first: f, last: l } if f <= last && first <= l)
                        });
                        assert!(!overlapping, "{set}: {key:?} overlaps");
                    }
                    assert!(
                        set_elements.insert(*key, value.clone()).is_none(),
                        "{set}: {key:?} exists"
                    );
                }
            }
            Op::FlushSet(set) => ruleset.sets.get_mut(set).unwrap().elements.clear(),
            Op::DeleteElements { set, keys } => {
                let set_elements = &mut ruleset.sets.get_mut(set).unwrap().elements;
                for key in keys {
                    assert!(set_elements.remove(key).is_some(), "{set}: {key:?} missing");
                }
            }
        }
    }
}

proptest! {
    #[test]
    fn random_states_meet_the_same_fates_in_both_modes(state in state()) {
        // With and without --cluster-cidr, and with every flag that applies to both.
        let without_cidr = NodeConfig { local_detector: LocalDetector::None, ..common::node_a() };
        for node in [common::node_a(), without_cidr, common::node_with_flags()] {
            assert_same_fates(&state, &node);
        }
    }

    #[test]
    fn every_reference_resolves_and_every_port_object_is_used(state in state()) {
        let ruleset = layout::build(&state, &common::node_a());
        let refs = references(&ruleset);
        for (from, target) in &refs {
            prop_assert!(ruleset.chains.contains_key(target), "{from} -> undeclared {target}");
        }
        let used = used_sets(&ruleset);
        for set in &used {
            prop_assert!(ruleset.sets.contains_key(set), "undeclared set {set}");
        }
        // A port that loses an address to another (both list it) keeps unused objects.
        // Shared hairpin pairs hold the same member for every claimant: no loss there.
        let mut claims = BTreeSet::new();
        let slots = BucketSlots::in_name_order(&state);
        let contested = state.services().values().any(|svc| {
            let slot = slots.get(&svc.name).expect("every port has a slot");
            let objects = layout::port_objects(svc, state.endpoints_of(&svc.name), &common::node_a(), slot);
            objects
                .elements
                .iter()
                .filter(|(map, _, _)| !layout::is_member_set(map))
                .any(|(map, key, _)| !claims.insert((*map, *key)))
        });
        if contested {
            return Ok(());
        }
        let fixed = layout::fixed_objects(&common::node_a());
        for name in ruleset.chains.keys().filter(|name| !fixed.chains.contains_key(*name)) {
            prop_assert!(refs.iter().any(|(_, target)| target == name), "{name} unused");
        }
        for name in ruleset.sets.keys().filter(|name| !fixed.sets.contains_key(*name)) {
            prop_assert!(used.contains(name), "set {name} unused");
        }
    }

    /// After every step the incremental ruleset equals the full build, and applying each
    /// step's transaction to the previous ruleset gives it too.
    #[test]
    fn the_incremental_ruleset_and_its_transactions_follow_the_full_build(
        states in prop::collection::vec(state(), 1..6),
        touch_all in any::<bool>(),
    ) {
        let node = common::node_a();
        let mut incremental = IncrementalRuleset::new(node.clone());
        let mut kernel = Ruleset::default();
        apply(&mut kernel, &Transaction::replace_all(incremental.ruleset()));
        let names: Vec<ServicePortName> = (0..MAX_PORTS).map(port_name).collect();
        let mut previous = ProxyState::new(IpFamily::V4);
        for state in &states {
            // Every name, or only those whose port or endpoints differ.
            let touched: Vec<&ServicePortName> = names
                .iter()
                .filter(|name| {
                    touch_all
                        || previous.services().get(*name) != state.services().get(*name)
                        || previous.endpoints().get(*name) != state.endpoints().get(*name)
                })
                .collect();
            let tx = incremental.update(state, touched);
            let full = layout::build_with_slots(state, &node, incremental.slots());
            prop_assert_eq!(incremental.ruleset(), &full);
            apply(&mut kernel, &tx);
            prop_assert_eq!(&kernel, &full);
            // Nothing changed, nothing to do.
            prop_assert!(incremental.update(state, &names).is_empty());
            previous = state.clone();
        }
    }
}

#[test]
fn one_endpoint_added_touches_only_its_port() {
    let node = common::node_a();
    let mut state = common::nodeport_state();
    state.extend(common::lb_open_state());
    let mut incremental = IncrementalRuleset::new(node.clone());
    incremental.update(&state, state.services().keys());
    let mut endpoints = state.endpoints_of(&common::web()).to_vec();
    endpoints.push(common::ready("10.244.2.9", 8080, "node-b"));
    state.insert_endpoints(common::web(), endpoints);
    let tx = incremental.update(&state, [&common::web()]);
    let text = render::transaction(&tx);
    // Elements only: the port's runs of buckets move and the new endpoint's hairpin pair
    // joins. No chain, no rule, no verdict (those make the kernel validate the table),
    // no other port.
    assert!(
        tx.ops
            .iter()
            .all(|op| matches!(op, Op::AddElements { .. } | Op::DeleteElements { .. })),
        "{text}"
    );
    assert!(text.contains("add element ip tandem endpoints-"), "{text}");
    assert!(
        text.contains("add element ip tandem hairpin-endpoints { 10.244.2.9 . 10.244.2.9 }"),
        "{text}"
    );
    assert!(
        !text.contains("service-ips") && !text.contains("open"),
        "{text}"
    );
    assert_eq!(incremental.ruleset(), &layout::build(&state, &node));
}

#[test]
fn node_ports_are_not_served_on_loopback() {
    // As kube-proxy's nftables mode: the iptables mode DNATs 127.0.0.1:30082.
    let state = common::etp_local_state(true);
    let request = TraceRequest::new(
        Packet {
            src: ip("127.0.0.1"),
            dst: ip("127.0.0.1"),
            protocol: Protocol::Tcp,
            dst_port: 30082,
        },
        Entry::Local,
        [ip(NODE_IP)],
    );
    let traced = nft_trace(&layout::build(&state, &common::node_a()), &request).unwrap();
    assert_eq!(traced.outcomes.len(), 1, "{traced}");
    assert_eq!(traced.outcomes[0].dnat, None, "{traced}");
}

#[test]
fn the_nodes_own_connections_to_external_addresses_without_endpoints_are_rejected() {
    // The iptables mode checks external addresses in INPUT and FORWARD only.
    let state = common::no_endpoints_state();
    for dst in ["198.51.100.13", "192.0.2.50"] {
        let request = TraceRequest::new(
            Packet {
                src: ip(NODE_IP),
                dst: ip(dst),
                protocol: Protocol::Tcp,
                dst_port: 80,
            },
            Entry::Local,
            [ip(NODE_IP)],
        );
        let traced = nft_trace(&layout::build(&state, &common::node_a()), &request).unwrap();
        assert!(
            matches!(&traced.outcomes[0].verdict, Verdict::Reject { chain, .. } if chain == "reject-chain"),
            "{traced}"
        );
    }
}

#[test]
fn source_ranges_drop_before_dnat_in_prerouting() {
    let traced = nft_trace(
        &layout::build(&common::reference_state(), &common::node_a()),
        &TraceRequest::new(
            Packet {
                src: ip(DISALLOWED_CLIENT),
                dst: ip("198.51.100.20"),
                protocol: Protocol::Tcp,
                dst_port: 80,
            },
            Entry::FromOutside,
            [ip(NODE_IP)],
        ),
    )
    .unwrap();
    assert_eq!(traced.outcomes.len(), 1, "{traced}");
    let text = traced.to_string();
    assert!(
        text.contains("filter filter-prerouting-pre-dnat: ct state new jump firewall-check"),
        "{text}"
    );
    assert!(
        matches!(&traced.outcomes[0].verdict, Verdict::Drop { chain, .. } if chain.starts_with("firewall-")),
        "{text}"
    );
    assert!(!text.contains("nat "), "{text}");
}

/// Every feature in one state: the scenarios that do not share names or addresses.
fn every_feature() -> ProxyState {
    let mut state = ProxyState::new(IpFamily::V4);
    for part in [
        common::reference_state(),
        common::etp_local_state(true),
        common::affinity_state(),
        common::no_endpoints_state(),
        common::external_ips_state(),
        common::udp_state(),
        common::itp_local_state(),
    ] {
        state.extend(part);
    }
    state
}

#[test]
fn readable_trace_of_the_reference_lb() {
    let ruleset = layout::build(&common::reference_state(), &common::node_a());
    let traces: Vec<String> = [ALLOWED_CLIENT, DISALLOWED_CLIENT]
        .into_iter()
        .map(|src| {
            let packet = Packet {
                src: ip(src),
                dst: ip("198.51.100.20"),
                protocol: Protocol::Tcp,
                dst_port: 80,
            };
            let request = TraceRequest::new(packet, Entry::FromOutside, [ip(NODE_IP)]);
            nft_trace(&ruleset, &request).unwrap().to_string()
        })
        .collect();
    insta::assert_snapshot!("nft_trace_reference_lb", traces.join("\n"));
}

#[test]
fn ruleset_as_nft_text() {
    let ruleset = layout::build(&every_feature(), &common::node_a());
    insta::assert_snapshot!(
        "nft_every_feature",
        render::transaction(&Transaction::replace_all(&ruleset))
    );
}

/// Table `ip tandem` as the kernel lists it (`nft -j`), without handles and with set
/// elements sorted: two tables with the same content compare equal however they were
/// built up.
fn kernel_table(netns: &Netns) -> BTreeMap<String, serde_json::Value> {
    let listing = netns.run("nft", &["-j", "list", "table", "ip", "tandem"], "");
    let listing: serde_json::Value = serde_json::from_str(&listing).unwrap();
    let mut objects = BTreeMap::new();
    let mut rules: BTreeMap<String, Vec<serde_json::Value>> = BTreeMap::new();
    for object in listing["nftables"].as_array().unwrap() {
        let Some((kind, body)) = object.as_object().unwrap().iter().next() else {
            continue;
        };
        let mut body = body.clone();
        body.as_object_mut().unwrap().remove("handle");
        let name = body["name"].as_str().unwrap_or_default().to_owned();
        match kind.as_str() {
            "rule" => rules
                .entry(body["chain"].as_str().unwrap().to_owned())
                .or_default()
                .push(body["expr"].clone()),
            "set" | "map" => {
                if let Some(serde_json::Value::Array(elements)) = body.get_mut("elem") {
                    elements.sort_by_key(|element| element.to_string());
                }
                objects.insert(format!("{kind} {name}"), body);
            }
            _ => {
                objects.insert(format!("{kind} {name}"), body);
            }
        }
    }
    for (chain, exprs) in rules {
        objects.insert(format!("rules {chain}"), serde_json::Value::Array(exprs));
    }
    objects
}

fn nft_apply(netns: &Netns, tx: &Transaction) {
    if !tx.is_empty() {
        netns.run("nft", &["-f", "-"], &render::transaction(tx));
    }
}

/// The steps of the kernel test: every feature, then one change of each kind.
fn kernel_steps() -> Vec<ProxyState> {
    let mut steps = vec![every_feature()];
    let mut next = |change: &dyn Fn(&mut ProxyState)| {
        let mut state = steps.last().unwrap().clone();
        change(&mut state);
        steps.push(state);
    };
    let nginx = common::nginx_http();
    // An endpoint added (2 → 3), then two removed (3 → 1: the endpoint map goes away).
    // Changes the endpoints of the port `name`.
    let change_endpoints =
        |s: &mut ProxyState, name: &ServicePortName, change: &dyn Fn(&mut Vec<Endpoint>)| {
            let mut endpoints = s.endpoints_of(name).to_vec();
            change(&mut endpoints);
            s.insert_endpoints(name.clone(), endpoints);
        };
    next(&|s| {
        change_endpoints(s, &nginx, &|endpoints| {
            endpoints.push(common::ready("10.244.2.9", 80, "node-b"))
        })
    });
    next(&|s| change_endpoints(s, &nginx, &|endpoints| endpoints.truncate(1)));
    // The affinity timeout changes: the sets are declared anew.
    next(&|s| {
        let mut sticky = s.services()[&common::sticky()].clone();
        sticky.session_affinity_timeout = Some(60);
        s.insert_service(sticky);
    });
    // externalTrafficPolicy Local loses its local endpoints; a Service loses all.
    next(&|s| {
        change_endpoints(s, &common::local_lb(), &|endpoints| {
            endpoints.retain(|ep| ep.node_name.as_deref() != Some("node-a"))
        })
    });
    next(&|s| change_endpoints(s, &common::dns(), &|endpoints| endpoints.clear()));
    // And back: an endpoint map declared anew (1 → 2), rejecting addresses dispatched again.
    next(&|s| {
        change_endpoints(s, &nginx, &|endpoints| {
            endpoints.push(common::ready("10.244.2.10", 80, "node-b"))
        })
    });
    next(&|s| {
        let dns = common::udp_state().endpoints_of(&common::dns()).to_vec();
        s.insert_endpoints(common::dns(), dns)
    });
    // A Service deleted, then everything.
    next(&|s| {
        s.remove(&common::ext());
    });
    next(&|s| *s = ProxyState::new(IpFamily::V4));
    steps
}

#[test]
fn the_kernel_takes_every_transaction_and_ends_with_the_full_builds_table() {
    if !is_root() {
        eprintln!("skipped: needs root for network namespaces");
        return;
    }
    let node = common::node_a();
    let (incremental_ns, full_ns) = (Netns::create("nftinc"), Netns::create("nftfull"));
    let mut incremental = IncrementalRuleset::new(node.clone());
    nft_apply(
        &incremental_ns,
        &Transaction::replace_all(incremental.ruleset()),
    );
    let steps = kernel_steps();
    let names: BTreeSet<ServicePortName> = steps
        .iter()
        .flat_map(|state| state.services().keys().cloned())
        .collect();
    for (i, state) in steps.iter().enumerate() {
        nft_apply(&incremental_ns, &incremental.update(state, &names));
        let full = layout::build_with_slots(state, &node, incremental.slots());
        nft_apply(&full_ns, &Transaction::replace_all(&full));
        let table = kernel_table(&incremental_ns);
        assert!(table.len() > 20, "step {i}: {table:?}");
        assert_eq!(table, kernel_table(&full_ns), "step {i}");
    }
    nft_apply(&full_ns, &Transaction::delete_all(IpFamily::V4));
    let tables = full_ns.run("nft", &["list", "tables"], "");
    assert!(!tables.contains("tandem"), "{tables}");
}

#[test]
fn an_address_two_ports_list_goes_to_the_first_in_name_order_whichever_changes() {
    let node = common::node_a();
    let listing = |name: ServicePortName, cluster_ip: &str, endpoint: &str| {
        let svc = ServicePort {
            external_ips: vec![ip("192.0.2.10")],
            ..common::cluster_ip_service(name.clone(), Protocol::Tcp, cluster_ip, 80)
        };
        (svc, vec![common::ready(endpoint, 80, "node-b")])
    };
    let (first, second) = (
        common::port_name("a", "first", ""),
        common::port_name("b", "second", ""),
    );
    let set = |state: &mut ProxyState, (svc, endpoints): (ServicePort, Vec<Endpoint>)| {
        state.insert_endpoints(svc.name.clone(), endpoints);
        state.insert_service(svc);
    };
    let mut steps: Vec<(ProxyState, &ServicePortName)> = Vec::new();
    let mut state = ProxyState::new(IpFamily::V4);
    set(
        &mut state,
        listing(second.clone(), "10.96.0.2", "10.244.2.2"),
    );
    steps.push((state.clone(), &second));
    // The first arrives: it takes the address from the second, which is not touched.
    set(
        &mut state,
        listing(first.clone(), "10.96.0.1", "10.244.1.1"),
    );
    steps.push((state.clone(), &first));
    // The second changes: the address stays with the first.
    set(
        &mut state,
        listing(second.clone(), "10.96.0.2", "10.244.2.3"),
    );
    steps.push((state.clone(), &second));
    // The first goes: the second gets the address back.
    state.remove(&first);
    steps.push((state.clone(), &first));
    state.remove(&second);
    steps.push((state.clone(), &second));

    let mut incremental = IncrementalRuleset::new(node.clone());
    let mut kernel = Ruleset::default();
    apply(
        &mut kernel,
        &Transaction::replace_all(incremental.ruleset()),
    );
    for (i, (state, touched)) in steps.iter().enumerate() {
        let tx = incremental.update(state, [*touched]);
        let full = layout::build_with_slots(state, &node, incremental.slots());
        assert_eq!(incremental.ruleset(), &full, "step {i}");
        apply(&mut kernel, &tx);
        assert_eq!(kernel, full, "step {i}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// As above, over random steps: every transaction is accepted by the kernel, and the
    /// table it leaves is the full build's.
    #[test]
    fn the_kernel_takes_random_steps(states in prop::collection::vec(state(), 1..4)) {
        if !is_root() {
            return Ok(());
        }
        let node = common::node_a();
        let (incremental_ns, full_ns) = (Netns::create("nftrin"), Netns::create("nftrfu"));
        let mut incremental = IncrementalRuleset::new(node.clone());
        nft_apply(&incremental_ns, &Transaction::replace_all(incremental.ruleset()));
        let names: Vec<ServicePortName> = (0..MAX_PORTS).map(port_name).collect();
        for state in &states {
            nft_apply(&incremental_ns, &incremental.update(state, &names));
            nft_apply(&full_ns, &Transaction::replace_all(&layout::build_with_slots(state, &node, incremental.slots())));
            prop_assert_eq!(kernel_table(&incremental_ns), kernel_table(&full_ns));
        }
    }
}
