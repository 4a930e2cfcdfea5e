//! Observed state in, the ruleset of table `ip tandem` (`ip6 tandem` for an IPv6 node)
//! out: kube-proxy's nftables layout.
//!
//! Fixed objects: base chains that only jump into ours, the dispatch chains, five shared
//! verdict maps keyed by what a packet is addressed to (`service-ips`,
//! `service-nodeports`, `firewall-ips`, `no-endpoint-services`, `no-endpoint-nodeports`)
//! and the `hairpin-endpoints` set. Each Service port adds elements to those and to an
//! endpoint map it shares with other ports (its range of `endpoints-tcp-N`, see
//! [`super::slots`]), and owns its chains (`service-…`, `external-…`, `local-…`,
//! `firewall-…`), so one port's change touches only its own objects and its own
//! elements: the map lookups cost the same with ten Services or ten thousand.
//!
//! Where kube-proxy gives every endpoint a chain and picks one with `numgen random mod N
//! vmap`, a port here DNATs straight from a map of bucket runs to endpoints (see
//! [`tandem_nftables::BUCKETS`]), and hairpin traffic is found in postrouting by its
//! `saddr . daddr` pair. So adding or removing an endpoint changes map elements only. That
//! matters for the kernel: a transaction that adds a rule with a jump, a goto or a NAT
//! statement, or a map element that jumps, makes nf_tables re-validate every chain
//! reachable from the table's base chains, whose cost grows with the number of Services;
//! element changes skip that. Session affinity still needs kube-proxy's per-endpoint
//! chains and `affinity-…` sets, so Services with it keep that layout.
//!
//! Health-check node ports need no rule here: our base chains accept by policy, and an
//! `accept` in our table could not overrule another table's `drop` anyway (the iptables
//! mode's ACCEPT in filter INPUT has no nftables equivalent).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use data_encoding::BASE32;
use ipnet::IpNet;
use sha2::{Digest, Sha256};
use tandem_common::Protocol;
use tandem_nftables::{
    BUCKETS, BaseChain, Chain, ChainType, DispatchKey, Hook, Key, KeyType, MASQUERADE_MARK, Match,
    Rule, Ruleset, Set, SetSpec, Statement, Value, Verdict,
};

use super::slots::{BucketSlot, BucketSlots, Spread};
use crate::model::{
    Endpoint, NodeConfig, NodePortAddresses, ProxyState, ServicePort, ServicePortName, overlaps,
    sorted_unique,
};
use crate::topology::{PortPaths, UsableEndpoint, usable_endpoints};

pub const FILTER_PREROUTING_PRE_DNAT: &str = "filter-prerouting-pre-dnat";
pub const FILTER_OUTPUT_PRE_DNAT: &str = "filter-output-pre-dnat";
pub const FILTER_INPUT: &str = "filter-input";
pub const FILTER_FORWARD: &str = "filter-forward";
pub const FILTER_OUTPUT: &str = "filter-output";
/// After DNAT in the output hook: the node's own connections to cluster IPs that no
/// Service port DNATed.
pub const FILTER_OUTPUT_POST_DNAT: &str = "filter-output-post-dnat";
pub const NAT_PREROUTING: &str = "nat-prerouting";
pub const NAT_OUTPUT: &str = "nat-output";
pub const NAT_POSTROUTING: &str = "nat-postrouting";

/// Drops new connections to LB IPs from outside their `loadBalancerSourceRanges`.
pub const FIREWALL_CHECK: &str = "firewall-check";
/// Rejects (or drops) new connections to Service IPs without usable endpoints.
pub const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
/// Rejects (or drops) new connections to node ports without usable endpoints.
pub const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
/// After DNAT: rejects new connections to a cluster IP on a port it does not serve, drops
/// those to an address of the Service CIDRs no Service holds.
pub const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
pub const REJECT_CHAIN: &str = "reject-chain";
pub const MARK_FOR_MASQUERADE: &str = "mark-for-masquerade";
pub const MASQUERADING: &str = "masquerading";
/// nat: dispatches Service IPs, then node ports.
pub const SERVICES: &str = "services";
pub const NODEPORTS: &str = "nodeports";

/// Cluster, external and LB IPs (`ip . proto . port`) → `goto service-…`/`external-…`.
pub const SERVICE_IPS: &str = "service-ips";
/// Node ports (`proto . port`) → `goto external-…`.
pub const SERVICE_NODEPORTS: &str = "service-nodeports";
/// LB IPs with source ranges → `goto firewall-…`.
pub const FIREWALL_IPS: &str = "firewall-ips";
/// Service IPs without usable endpoints → `goto reject-chain` or `drop`.
pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
/// Node ports without usable endpoints → `goto reject-chain`.
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
/// `endpoint . endpoint` for every endpoint: a connection from an endpoint DNATed back to
/// itself (hairpin) is masqueraded, or the endpoint would answer itself directly.
pub const HAIRPIN_ENDPOINTS: &str = "hairpin-endpoints";
/// Every cluster IP: a connection still addressed to one after DNAT matched no port.
pub const CLUSTER_IPS: &str = "cluster-ips";

/// The sets every Service port may add elements to, with their declarations.
pub const SHARED_SETS: [(&str, SetSpec); 7] = [
    (
        SERVICE_IPS,
        SetSpec::VerdictMap(KeyType::AddressProtocolPort),
    ),
    (
        FIREWALL_IPS,
        SetSpec::VerdictMap(KeyType::AddressProtocolPort),
    ),
    (
        NO_ENDPOINT_SERVICES,
        SetSpec::VerdictMap(KeyType::AddressProtocolPort),
    ),
    (
        SERVICE_NODEPORTS,
        SetSpec::VerdictMap(KeyType::ProtocolPort),
    ),
    (
        NO_ENDPOINT_NODEPORTS,
        SetSpec::VerdictMap(KeyType::ProtocolPort),
    ),
    (HAIRPIN_ENDPOINTS, SetSpec::AddressPairs),
    (CLUSTER_IPS, SetSpec::Addresses),
];

/// Whether a shared set holds members (the key alone) that several ports may claim
/// alike: the ports of one Service share its endpoints' hairpin pairs and its cluster IP.
pub fn is_member_set(set: &str) -> bool {
    set == HAIRPIN_ENDPOINTS || set == CLUSTER_IPS
}

/// What one Service port adds to the ruleset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortObjects {
    /// Its own chains.
    pub chains: BTreeMap<String, Chain>,
    /// Its own sets (session affinity's index maps and affinity sets).
    pub sets: BTreeMap<String, Set>,
    /// Its elements in the [`SHARED_SETS`]: `(set, key, value)`.
    pub elements: Vec<(&'static str, Key, Value)>,
    /// Its runs of buckets, in the endpoint map of its [`BucketSlot`]: `(map, runs)`,
    /// the runs as a set holding only them.
    pub buckets: Option<(String, Set)>,
}

/// The complete ruleset of our table of the node's family on a fresh start: slots given out in name
/// order ([`BucketSlots::in_name_order`]).
pub fn build(state: &ProxyState, node: &NodeConfig) -> Ruleset {
    build_with_slots(state, node, &BucketSlots::in_name_order(state))
}

/// The complete ruleset with the given slots: the fixed objects, then every Service
/// port's objects in [`ServicePortName`] order. Headless Services, and ports without a
/// slot, get nothing.
pub fn build_with_slots(state: &ProxyState, node: &NodeConfig, slots: &BucketSlots) -> Ruleset {
    debug_assert_eq!(state.family(), node.family, "a state of the node's family");
    let mut ruleset = fixed_objects(node);
    for service in state.services().values() {
        let Some(slot) = slots.get(&service.name) else {
            continue;
        };
        install(
            &mut ruleset,
            port_objects(service, state.endpoints_of(&service.name), node, slot),
        );
    }
    ruleset
}

/// Puts one port's objects into `ruleset` (whose shared sets must exist). A key another
/// port already holds (two Services listing the same external IP and port) stays with
/// that port, the first in name order: a map holds one verdict per key, and the
/// incremental ruleset resolves such conflicts the same way.
fn install(ruleset: &mut Ruleset, objects: PortObjects) {
    ruleset.chains.extend(objects.chains);
    ruleset.sets.extend(objects.sets);
    for (set, key, value) in objects.elements {
        if let Some(set) = ruleset.sets.get_mut(set) {
            set.elements.entry(key).or_insert(value);
        }
    }
    if let Some((map, runs)) = objects.buckets {
        merge_into(ruleset, map, runs);
    }
}

/// Adds `part`'s elements to the set `name` of `ruleset`, declaring it when missing.
pub fn merge_into(ruleset: &mut Ruleset, name: String, part: Set) {
    let set = ruleset
        .sets
        .entry(name)
        .or_insert_with(|| Set::with_spec(part.spec));
    if set.elements.is_empty() {
        // Built in bulk, a map's nodes are full; grown by inserts in key order, as `part`
        // was, they stay half empty: 10 MiB more at a first sync of 10,000 ports.
        set.elements = part.elements.into_iter().collect();
    } else {
        set.elements.extend(part.elements);
    }
}

/// The objects that exist whatever the Services are; the node's settings shape the node
/// port dispatch and the cluster-IP check.
pub fn fixed_objects(node: &NodeConfig) -> Ruleset {
    let mut ruleset = Ruleset::empty(node.family);
    let base = |chain_type, hook, priority, rules| Chain {
        base: Some(BaseChain {
            chain_type,
            hook,
            priority,
        }),
        rules,
    };
    let new_then = |chain: &str| Rule::when(vec![Match::ConnectionNew], jump(chain));
    let chains = [
        (
            FILTER_PREROUTING_PRE_DNAT,
            base(
                ChainType::Filter,
                Hook::Prerouting,
                -110,
                vec![new_then(FIREWALL_CHECK)],
            ),
        ),
        (
            FILTER_OUTPUT_PRE_DNAT,
            base(
                ChainType::Filter,
                Hook::Output,
                -110,
                vec![new_then(FIREWALL_CHECK)],
            ),
        ),
        (
            FILTER_INPUT,
            base(
                ChainType::Filter,
                Hook::Input,
                -110,
                vec![
                    new_then(NODEPORT_ENDPOINTS_CHECK),
                    new_then(SERVICE_ENDPOINTS_CHECK),
                ],
            ),
        ),
        (
            FILTER_FORWARD,
            base(
                ChainType::Filter,
                Hook::Forward,
                -110,
                vec![
                    new_then(SERVICE_ENDPOINTS_CHECK),
                    new_then(CLUSTER_IPS_CHECK),
                ],
            ),
        ),
        (
            FILTER_OUTPUT,
            base(
                ChainType::Filter,
                Hook::Output,
                -110,
                vec![new_then(SERVICE_ENDPOINTS_CHECK)],
            ),
        ),
        (
            FILTER_OUTPUT_POST_DNAT,
            base(
                ChainType::Filter,
                Hook::Output,
                -90,
                vec![new_then(CLUSTER_IPS_CHECK)],
            ),
        ),
        (
            NAT_PREROUTING,
            base(
                ChainType::Nat,
                Hook::Prerouting,
                -100,
                vec![Rule::always(jump(SERVICES))],
            ),
        ),
        (
            NAT_OUTPUT,
            base(
                ChainType::Nat,
                Hook::Output,
                -100,
                vec![Rule::always(jump(SERVICES))],
            ),
        ),
        (
            NAT_POSTROUTING,
            base(
                ChainType::Nat,
                Hook::Postrouting,
                100,
                vec![Rule::always(jump(MASQUERADING))],
            ),
        ),
        (
            FIREWALL_CHECK,
            chain(vec![Rule::always(dispatch(
                DispatchKey::AddressProtocolPort,
                FIREWALL_IPS,
            ))]),
        ),
        (
            SERVICE_ENDPOINTS_CHECK,
            chain(vec![Rule::always(dispatch(
                DispatchKey::AddressProtocolPort,
                NO_ENDPOINT_SERVICES,
            ))]),
        ),
        (
            NODEPORT_ENDPOINTS_CHECK,
            chain(
                node_port_addresses(node)
                    .into_iter()
                    .map(|to_node_port| {
                        Rule::when(
                            to_node_port,
                            dispatch(DispatchKey::ProtocolPort, NO_ENDPOINT_NODEPORTS),
                        )
                    })
                    .collect(),
            ),
        ),
        (CLUSTER_IPS_CHECK, cluster_ips_check(node)),
        (REJECT_CHAIN, chain(vec![Rule::always(Statement::Reject)])),
        (
            MARK_FOR_MASQUERADE,
            chain(vec![Rule::always(Statement::SetMark(MASQUERADE_MARK))]),
        ),
        (
            MASQUERADING,
            chain(vec![
                // A pod reaching itself through a Service: only DNATed connections, as
                // the iptables mode marks them in the endpoint chain, so a host process
                // talking to its own address is left alone.
                Rule::when(
                    vec![
                        Match::ConnectionDnat,
                        Match::AddressPairInSet(HAIRPIN_ENDPOINTS.to_owned()),
                    ],
                    jump(MARK_FOR_MASQUERADE),
                ),
                Rule::when(
                    vec![Match::Mark {
                        bit: MASQUERADE_MARK,
                        set: false,
                    }],
                    Statement::Return,
                ),
                // Clear the mark so a packet that traverses the stack again is not
                // re-masqueraded.
                Rule::always(Statement::ToggleMark(MASQUERADE_MARK)),
                Rule::always(Statement::Masquerade),
            ]),
        ),
        (
            SERVICES,
            chain(
                std::iter::once(Rule::always(dispatch(
                    DispatchKey::AddressProtocolPort,
                    SERVICE_IPS,
                )))
                .chain(
                    node_port_addresses(node)
                        .into_iter()
                        .map(|to_node_port| Rule::when(to_node_port, jump(NODEPORTS))),
                )
                .collect(),
            ),
        ),
        (
            NODEPORTS,
            chain(vec![Rule::always(dispatch(
                DispatchKey::ProtocolPort,
                SERVICE_NODEPORTS,
            ))]),
        ),
    ];
    for (name, chain) in chains {
        ruleset.chains.insert(name.to_owned(), chain);
    }
    for (name, spec) in SHARED_SETS {
        ruleset.sets.insert(name.to_owned(), Set::with_spec(spec));
    }
    ruleset
}

fn chain(rules: Vec<Rule>) -> Chain {
    Chain { base: None, rules }
}

/// The matches of each rule that lets a packet on to the node ports: to a local address,
/// never a loopback one (as kube-proxy's nftables mode: no route_localnet), and inside
/// one of the `--nodeport-addresses` CIDRs when given. kube-proxy keeps the node's
/// addresses inside those CIDRs in a set (`nodeport-ips`) it fills at each full sync; the
/// CIDR with `fib daddr type local` is the same set of addresses and follows address
/// changes without a sync.
fn node_port_addresses(node: &NodeConfig) -> Vec<Vec<Match>> {
    let loopback = node.loopback();
    let not_loopback = Match::DestinationAddress {
        net: loopback,
        negated: true,
    };
    match &node.node_port_addresses {
        NodePortAddresses::All => vec![vec![Match::DestinationLocal, not_loopback]],
        NodePortAddresses::Cidrs(cidrs) => cidrs
            .iter()
            .filter(|cidr| node.family.holds(cidr.addr()) && !loopback.contains(*cidr))
            .map(|&cidr| {
                let mut matches = vec![Match::DestinationAddress {
                    net: cidr,
                    negated: false,
                }];
                if overlaps(cidr, loopback) {
                    matches.push(not_loopback.clone());
                }
                matches.push(Match::DestinationLocal);
                matches
            })
            .collect(),
    }
}

/// kube-proxy's `cluster-ips-check`, run after DNAT: a new connection still addressed to
/// a cluster IP matched none of its ports and is rejected, so the client fails at once;
/// one to an address of the Service CIDRs that no Service holds is dropped. The only
/// fixed chain that follows a value which changes while the proxy runs (the Service
/// CIDRs, from ServiceCIDR objects): [`super::incremental::IncrementalRuleset`] rewrites
/// it alone when they change.
pub fn cluster_ips_check(node: &NodeConfig) -> Chain {
    let mut rules = vec![
        Rule::when(
            vec![Match::DestinationInSet(CLUSTER_IPS.to_owned())],
            Statement::Reject,
        )
        .with_comment("Reject traffic to invalid ports of ClusterIPs"),
    ];
    for cidr in node
        .service_cidrs
        .iter()
        .filter(|cidr| node.family.holds(cidr.addr()))
    {
        let to_service_cidr = Match::DestinationAddress {
            net: cidr.trunc(),
            negated: false,
        };
        rules.push(
            Rule::when(vec![to_service_cidr], Statement::Drop)
                .with_comment("Drop traffic to unallocated ClusterIPs"),
        );
    }
    chain(rules)
}

fn jump(chain: &str) -> Statement {
    Statement::Jump(chain.to_owned())
}

fn goto(chain: &str) -> Statement {
    Statement::Goto(chain.to_owned())
}

fn dispatch(key: DispatchKey, map: &str) -> Statement {
    Statement::Dispatch {
        key,
        map: map.to_owned(),
    }
}

fn host(addr: IpAddr) -> IpNet {
    IpNet::from(addr)
}

/// kube-proxy's `servicePortChainNameBase`: `namespace/name/protocol/portname`. Its parts
/// cannot hold `/`, so the base is unambiguous.
pub fn port_name_base(name: &ServicePortName, protocol: Protocol) -> String {
    format!(
        "{}/{}/{}/{}",
        name.namespace,
        name.name,
        protocol.as_str(),
        name.port
    )
}

/// kube-proxy's `servicePortEndpointChainNameBase`: the port's base, `__`, `ip/port`;
/// an IPv6 address's colons become dots, as a chain name cannot hold them.
pub fn endpoint_name_base(
    name: &ServicePortName,
    protocol: Protocol,
    endpoint: SocketAddr,
) -> String {
    format!(
        "{}__{}/{}",
        port_name_base(name, protocol),
        endpoint.ip().to_string().replace(':', "."),
        endpoint.port()
    )
}

/// kube-proxy's `hashAndTruncate`: the first 8 characters of base32(sha256(base)), `-`,
/// the base. kube-proxy truncates beyond 256 characters; Kubernetes name limits keep
/// every base of ours under 200, so nothing is ever cut.
pub fn hash_and_truncate(base: &str) -> String {
    let encoded = BASE32.encode(&Sha256::digest(base.as_bytes()));
    format!("{}-{base}", &encoded[..8])
}

/// The names of one Service port's own objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortNames {
    /// Spreads over the cluster-wide endpoints (externalTrafficPolicy Cluster paths, and
    /// the cluster IP with internalTrafficPolicy Cluster).
    pub service: String,
    /// Spreads over this node's endpoints (either traffic policy Local).
    pub local: String,
    /// Where LB IPs, external IPs and the node port lead.
    pub external: String,
    /// loadBalancerSourceRanges.
    pub firewall: String,
    /// With session affinity: `numgen` index → endpoint chain, for
    /// [`PortNames::service`] and [`PortNames::local`].
    pub endpoints_map: String,
    pub local_endpoints_map: String,
}

impl PortNames {
    pub fn of(name: &ServicePortName, protocol: Protocol) -> Self {
        let hashed = hash_and_truncate(&port_name_base(name, protocol));
        Self {
            service: format!("service-{hashed}"),
            local: format!("local-{hashed}"),
            external: format!("external-{hashed}"),
            firewall: format!("firewall-{hashed}"),
            endpoints_map: format!("endpoints-{hashed}"),
            local_endpoints_map: format!("local-endpoints-{hashed}"),
        }
    }
}

/// `endpoint-…`: DNATs to one endpoint of a Service port.
pub fn endpoint_chain(name: &ServicePortName, protocol: Protocol, ep: SocketAddr) -> String {
    format!(
        "endpoint-{}",
        hash_and_truncate(&endpoint_name_base(name, protocol, ep))
    )
}

/// `affinity-…`: the clients recently sent to one endpoint (session affinity).
pub fn affinity_set(name: &ServicePortName, protocol: Protocol, ep: SocketAddr) -> String {
    format!(
        "affinity-{}",
        hash_and_truncate(&endpoint_name_base(name, protocol, ep))
    )
}

/// The objects of one Service port alone; [`build`] is [`fixed_objects`] plus these for
/// every port. `svc` and `endpoints` (all of the port's endpoints) are a port of a
/// [`ProxyState`] of the node's family, which holds that family's addresses only; which
/// endpoints are used is the iptables mode's decision (ready ones, else serving
/// terminating ones; this node's for Local).
pub fn port_objects(
    svc: &ServicePort,
    endpoints: &[Endpoint],
    node: &NodeConfig,
    slot: BucketSlot,
) -> PortObjects {
    let mut out = PortObjects::default();
    let Some(cluster_ip) = svc.cluster_ip else {
        return out; // headless: DNS only, no proxying
    };
    let port = Port::new(
        svc,
        cluster_ip,
        &usable_endpoints(endpoints, node),
        node,
        slot,
    );
    let proto = svc.protocol;
    let ip_key = |ip: IpAddr| Key::AddressProtocolPort(ip, proto, svc.port);
    out.elements
        .push((CLUSTER_IPS, Key::Address(cluster_ip), Value::Member));
    // External IPs and LB IPs, each once (a Service may list an address in both).
    let external_ips = sorted_unique(&[&port.external_ips[..], &port.paths.vip_ingress].concat());

    if !port.has_endpoints {
        let reject = Value::from(Verdict::Goto(REJECT_CHAIN.to_owned()));
        for ip in std::iter::once(cluster_ip).chain(external_ips) {
            out.elements
                .push((NO_ENDPOINT_SERVICES, ip_key(ip), reject.clone()));
        }
        if let Some(node_port) = svc.node_port {
            out.elements.push((
                NO_ENDPOINT_NODEPORTS,
                Key::ProtocolPort(proto, node_port),
                reject,
            ));
        }
        return out;
    }

    for ep in &port.endpoints {
        let ip = ep.addr.ip();
        out.elements
            .push((HAIRPIN_ENDPOINTS, Key::SelfPair(ip), Value::Member));
        port.add_endpoint_chain(&mut out, ep);
    }
    let cluster: Vec<&PortEndpoint> = port.endpoints.iter().filter(|ep| ep.cluster).collect();
    let local: Vec<&PortEndpoint> = port.endpoints.iter().filter(|ep| ep.local).collect();
    if port.paths.uses_cluster {
        let mut rules = Vec::new();
        if !port.paths.internal_local {
            rules.extend(port.cluster_ip_masquerade());
        }
        port.add_dispatch(&mut out, Spread::Cluster, rules, &cluster);
    }
    if port.paths.uses_local && !local.is_empty() {
        let mut rules = Vec::new();
        if port.paths.internal_local {
            rules.extend(port.cluster_ip_masquerade());
        }
        port.add_dispatch(&mut out, Spread::Local, rules, &local);
    }

    // The cluster IP. internalTrafficPolicy Local without a local endpoint drops, as the
    // iptables mode does: the Service has endpoints, just none this node may use.
    let internal = if !port.paths.internal_local {
        Verdict::Goto(port.names.service.clone())
    } else if local.is_empty() {
        Verdict::Drop
    } else {
        Verdict::Goto(port.names.local.clone())
    };
    let map = if internal == Verdict::Drop {
        NO_ENDPOINT_SERVICES
    } else {
        SERVICE_IPS
    };
    out.elements
        .push((map, ip_key(cluster_ip), internal.into()));

    if !port.paths.external {
        return out;
    }
    out.chains.insert(
        port.names.external.clone(),
        chain(port.external_rules(!local.is_empty())),
    );
    let external = Value::from(Verdict::Goto(port.names.external.clone()));
    for ip in external_ips {
        out.elements
            .push((SERVICE_IPS, ip_key(ip), external.clone()));
    }
    if let Some(node_port) = svc.node_port {
        out.elements.push((
            SERVICE_NODEPORTS,
            Key::ProtocolPort(proto, node_port),
            external,
        ));
    }
    if !port.source_ranges.is_empty() && !port.paths.vip_ingress.is_empty() {
        // allowFromNode: the node's own connections looped back to it come from the LB IP.
        let from_node = node
            .allows_from_node(&svc.load_balancer_source_ranges)
            .then_some(&port.paths.vip_ingress)
            .into_iter()
            .flatten()
            .map(|ip| host(*ip));
        let allowed: Vec<IpNet> = port
            .source_ranges
            .iter()
            .copied()
            .chain(from_node)
            .collect();
        let mut rules: Vec<Rule> = allowed
            .iter()
            .map(|range| {
                Rule::when(
                    vec![Match::SourceAddress {
                        net: *range,
                        negated: false,
                    }],
                    Statement::Return,
                )
            })
            .collect();
        rules.push(
            Rule::always(Statement::Drop)
                .with_comment(format!("{} loadBalancerSourceRanges", svc.name)),
        );
        out.chains.insert(port.names.firewall.clone(), chain(rules));
        let firewall = Value::from(Verdict::Goto(port.names.firewall.clone()));
        for &ip in &port.paths.vip_ingress {
            out.elements
                .push((FIREWALL_IPS, ip_key(ip), firewall.clone()));
        }
    }
    out
}

/// The [`BUCKETS`] from `offset` on, split into `count` runs as equal as can be, in order.
fn bucket_runs(count: usize, offset: u32) -> impl Iterator<Item = Key> {
    // More endpoints than buckets cannot be: the extra ones would get none.
    let count = u64::try_from(count)
        .unwrap_or(u64::MAX)
        .clamp(1, u64::from(BUCKETS));
    let boundary = move |i: u64| u32::try_from(i * u64::from(BUCKETS) / count).unwrap_or(BUCKETS);
    (0..count).map(move |i| Key::Buckets {
        first: offset + boundary(i),
        last: offset + boundary(i + 1) - 1,
    })
}

/// A usable endpoint of one Service port.
struct PortEndpoint {
    addr: SocketAddr,
    cluster: bool,
    local: bool,
}

/// Everything one (non-headless) Service port's objects are derived from; the same
/// decisions as the iptables mode's `PortContext`.
struct Port<'a> {
    svc: &'a ServicePort,
    cluster_ip: IpAddr,
    names: PortNames,
    slot: BucketSlot,
    /// Endpoints some chain of this port spreads over.
    endpoints: Vec<PortEndpoint>,
    external_ips: Vec<IpAddr>,
    source_ranges: Vec<IpNet>,
    /// Which paths exist: `service-…` exists when the cluster-wide set is used, `local-…`
    /// when this node's is (and holds an endpoint).
    paths: PortPaths,
    /// Any usable endpoint in the cluster; without one, every address rejects.
    has_endpoints: bool,
    /// kube-proxy's `IfLocalNFT()` / `IfNotLocalNFT()` for this family (none without
    /// detection).
    if_local: Option<Match>,
    if_not_local: Option<Match>,
    /// `--masquerade-all`.
    masquerade_all: bool,
}

impl<'a> Port<'a> {
    fn new(
        svc: &'a ServicePort,
        cluster_ip: IpAddr,
        usable: &[UsableEndpoint],
        node: &NodeConfig,
        slot: BucketSlot,
    ) -> Self {
        let paths = PortPaths::of(svc);
        Self {
            svc,
            cluster_ip,
            names: PortNames::of(&svc.name, svc.protocol),
            slot,
            endpoints: usable
                .iter()
                .filter(|ep| paths.spreads_over(ep))
                .map(|ep| PortEndpoint {
                    addr: ep.addr,
                    cluster: ep.cluster,
                    local: ep.local,
                })
                .collect(),
            external_ips: sorted_unique(&svc.external_ips),
            source_ranges: sorted_unique(&svc.load_balancer_source_ranges),
            paths,
            has_endpoints: usable.iter().any(|ep| ep.cluster),
            if_local: node.local_detector.nft(node.family, false),
            if_not_local: node.local_detector.nft(node.family, true),
            masquerade_all: node.masquerade_all,
        }
    }

    /// `ip daddr CIP P dport PORT ip saddr != CIDR jump mark-for-masquerade`: off-cluster
    /// clients reaching a cluster IP (by a static route) may be sent to another node. With
    /// `--masquerade-all`, without the source match: every client.
    fn cluster_ip_masquerade(&self) -> Option<Rule> {
        let mut matches = vec![
            Match::DestinationAddress {
                net: host(self.cluster_ip),
                negated: false,
            },
            Match::DestinationPort {
                protocol: self.svc.protocol,
                port: self.svc.port,
            },
        ];
        if !self.masquerade_all {
            matches.push(self.if_not_local.clone()?);
        }
        Some(Rule::when(matches, jump(MARK_FOR_MASQUERADE)))
    }

    /// `endpoint-…` (session affinity only): remember the client, DNAT.
    fn add_endpoint_chain(&self, out: &mut PortObjects, ep: &PortEndpoint) {
        let Some(timeout) = self.svc.session_affinity_timeout else {
            return;
        };
        let affinity = self.affinity_set(ep);
        out.sets.insert(affinity.clone(), Set::dynamic(timeout));
        let rules = vec![
            Rule::always(Statement::AddSourceToSet(affinity)),
            Rule::when(
                vec![Match::Protocol(self.svc.protocol)],
                Statement::Dnat(ep.addr),
            ),
        ];
        out.chains.insert(self.endpoint_chain(ep), chain(rules));
    }

    fn endpoint_chain(&self, ep: &PortEndpoint) -> String {
        endpoint_chain(&self.svc.name, self.svc.protocol, ep.addr)
    }

    fn affinity_set(&self, ep: &PortEndpoint) -> String {
        affinity_set(&self.svc.name, self.svc.protocol, ep.addr)
    }

    /// The chain of `spread` (`service-…` or `local-…`), spreading over `targets` (never
    /// empty): a random DNAT through the port's range of buckets, or with session
    /// affinity kube-proxy's affinity checks and then one `goto`, or a random pick of an
    /// endpoint chain.
    fn add_dispatch(
        &self,
        out: &mut PortObjects,
        spread: Spread,
        mut rules: Vec<Rule>,
        targets: &[&PortEndpoint],
    ) {
        let (chain_name, map) = match spread {
            Spread::Cluster => (&self.names.service, &self.names.endpoints_map),
            Spread::Local => (&self.names.local, &self.names.local_endpoints_map),
        };
        if self.svc.session_affinity_timeout.is_none() {
            let offset = self.slot.offset(spread);
            let (_, runs) = out.buckets.get_or_insert_with(|| {
                (
                    self.slot.map(),
                    Set::with_spec(SetSpec::EndpointMap(self.svc.protocol)),
                )
            });
            for (buckets, ep) in bucket_runs(targets.len(), offset).zip(targets) {
                runs.elements.insert(buckets, Value::Endpoint(ep.addr));
            }
            rules.push(Rule::when(
                vec![Match::Protocol(self.svc.protocol)],
                Statement::RandomDnat {
                    map: self.slot.map(),
                    offset,
                },
            ));
            out.chains.insert(chain_name.clone(), chain(rules));
            return;
        }
        for ep in targets {
            rules.push(Rule::when(
                vec![Match::SourceInSet(self.affinity_set(ep))],
                goto(&self.endpoint_chain(ep)),
            ));
        }
        match targets {
            [only] => rules.push(Rule::always(goto(&self.endpoint_chain(only)))),
            _ => {
                let mut set = Set::verdict_map(KeyType::Index);
                for (index, ep) in (0u32..).zip(targets) {
                    set.elements.insert(
                        Key::Index(index),
                        Verdict::Goto(self.endpoint_chain(ep)).into(),
                    );
                }
                rules.push(Rule::always(Statement::RandomDispatch {
                    modulus: u32::try_from(targets.len()).unwrap_or(u32::MAX),
                    map: map.to_owned(),
                }));
                out.sets.insert(map.to_owned(), set);
            }
        }
        out.chains.insert(chain_name.to_owned(), chain(rules));
    }

    /// `external-…`. Policy Cluster: masquerade (pods reaching an external IP keep their
    /// address, as in the iptables mode), then the Service chain. Policy Local: pods and
    /// the node itself short-cut to the Service chain (the node masqueraded), everyone
    /// else goes to this node's endpoints, or is dropped without any.
    fn external_rules(&self, has_local: bool) -> Vec<Rule> {
        let names = &self.names;
        let mut rules = Vec::new();
        if !self.paths.local_policy {
            if let Some(from_pods) = &self.if_local {
                for &ip in &self.external_ips {
                    let to_ip = Match::DestinationAddress {
                        net: host(ip),
                        negated: false,
                    };
                    rules.push(Rule::when(
                        vec![to_ip, from_pods.clone()],
                        goto(&names.service),
                    ));
                }
            }
            rules.push(Rule::always(jump(MARK_FOR_MASQUERADE)));
            rules.push(Rule::always(goto(&names.service)));
            return rules;
        }
        if let Some(from_pods) = &self.if_local {
            rules.push(
                Rule::when(vec![from_pods.clone()], goto(&names.service))
                    .with_comment("short-circuit pod traffic to the cluster-wide endpoints"),
            );
        }
        rules.push(Rule::when(
            vec![Match::SourceLocal],
            jump(MARK_FOR_MASQUERADE),
        ));
        rules.push(Rule::when(vec![Match::SourceLocal], goto(&names.service)));
        rules.push(if has_local {
            Rule::always(goto(&names.local))
        } else {
            Rule::always(Statement::Drop)
                .with_comment(format!("{} has no local endpoints", self.svc.name))
        });
        rules
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::nft::slots::PORTS_PER_ENDPOINT_MAP;
    use std::net::Ipv4Addr;

    fn name(namespace: &str, service: &str, port: &str) -> ServicePortName {
        ServicePortName {
            namespace: namespace.into(),
            name: service.into(),
            port: port.into(),
        }
    }

    pub(crate) fn node() -> NodeConfig {
        NodeConfig::new("node-a", Some("10.244.0.0/16".parse().unwrap()))
    }

    /// `ns1/svc1:p80`, TCP port 80, nothing else set.
    pub(crate) fn service(cluster_ip: Option<Ipv4Addr>) -> ServicePort {
        ServicePort {
            name: name("ns1", "svc1", "p80"),
            protocol: Protocol::Tcp,
            cluster_ip: cluster_ip.map(IpAddr::V4),
            port: 80,
            node_port: None,
            external_ips: vec![],
            load_balancer_ingress: vec![],
            load_balancer_source_ranges: vec![],
            session_affinity_timeout: None,
            external_traffic_policy_local: false,
            health_check_node_port: None,
            internal_traffic_policy_local: false,
        }
    }

    /// The second slot of the second TCP map: its buckets start at `2 * BUCKETS`.
    pub(crate) fn slot() -> BucketSlot {
        BucketSlot {
            protocol: Protocol::Tcp,
            index: PORTS_PER_ENDPOINT_MAP + 1,
        }
    }

    /// A ready endpoint `10.180.0.LAST:80` on `node`.
    pub(crate) fn endpoint(last: u8, node: &str) -> Endpoint {
        Endpoint {
            ip: Ipv4Addr::new(10, 180, 0, last).into(),
            port: 80,
            ready: true,
            serving: true,
            terminating: false,
            node_name: Some(node.into()),
            hints: None,
        }
    }

    #[test]
    fn names_match_kube_proxys_nftables_mode() {
        // From kube-proxy's own nftables proxier tests.
        let svc1 = name("ns1", "svc1", "p80");
        assert_eq!(
            PortNames::of(&svc1, Protocol::Tcp).service,
            "service-ULMVA6XW-ns1/svc1/tcp/p80"
        );
        assert_eq!(
            endpoint_chain(&svc1, Protocol::Tcp, "10.180.0.1:80".parse().unwrap()),
            "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        );
        let svc2 = name("ns2", "svc2", "p80");
        assert_eq!(
            PortNames::of(&svc2, Protocol::Tcp).external,
            "external-42NFTM6N-ns2/svc2/tcp/p80"
        );
        assert_eq!(
            endpoint_chain(&svc2, Protocol::Tcp, "10.180.0.2:80".parse().unwrap()),
            "endpoint-SGOXE6O3-ns2/svc2/tcp/p80__10.180.0.2/80"
        );
    }

    #[test]
    fn headless_services_get_nothing() {
        let objects = port_objects(&service(None), &[endpoint(1, "node-a")], &node(), slot());
        assert_eq!(objects, PortObjects::default());
    }

    #[test]
    fn endpoints_share_the_buckets_of_one_dnat_map_and_every_endpoint_is_a_hairpin_pair() {
        let svc = service(Some(Ipv4Addr::new(172, 30, 0, 41)));
        let names = PortNames::of(&svc.name, svc.protocol);
        let objects = port_objects(
            &svc,
            &[
                endpoint(1, "node-b"),
                endpoint(2, "node-b"),
                endpoint(3, "node-a"),
            ],
            &node(),
            slot(),
        );
        assert_eq!(
            objects.chains.keys().collect::<Vec<_>>(),
            vec![&names.service],
            "no endpoint chains without session affinity"
        );
        let last = objects.chains[&names.service].rules.last().unwrap();
        let offset = 2 * BUCKETS;
        assert_eq!(
            last.statement,
            Statement::RandomDnat {
                map: "endpoints-tcp-1".into(),
                offset
            }
        );
        assert!(objects.sets.is_empty(), "the map is shared, not the port's");
        let (map, runs) = objects.buckets.as_ref().unwrap();
        assert_eq!(map, "endpoints-tcp-1");
        let runs: Vec<(&Key, &Value)> = runs.elements.iter().collect();
        let endpoint_value =
            |last: u8| Value::Endpoint(SocketAddr::new(Ipv4Addr::new(10, 180, 0, last).into(), 80));
        assert_eq!(
            runs,
            vec![
                (
                    &Key::Buckets {
                        first: offset,
                        last: offset + 240_239
                    },
                    &endpoint_value(1)
                ),
                (
                    &Key::Buckets {
                        first: offset + 240_240,
                        last: offset + 480_479
                    },
                    &endpoint_value(2)
                ),
                (
                    &Key::Buckets {
                        first: offset + 480_480,
                        last: offset + BUCKETS - 1
                    },
                    &endpoint_value(3)
                ),
            ]
        );
        let hairpins: Vec<&Key> = objects
            .elements
            .iter()
            .filter(|(set, ..)| *set == HAIRPIN_ENDPOINTS)
            .map(|(_, key, _)| key)
            .collect();
        assert_eq!(hairpins.len(), 3);
        assert!(hairpins.contains(&&Key::SelfPair(Ipv4Addr::new(10, 180, 0, 2).into())));
    }

    #[test]
    fn bucket_runs_cover_every_bucket_once_and_differ_by_at_most_one() {
        for count in [1, 2, 3, 7, 16, 17, 1000] {
            let runs: Vec<(u32, u32)> = bucket_runs(count, 0)
                .map(|key| match key {
                    Key::Buckets { first, last } => (first, last),
                    other => panic!("{other:?}"),
                })
                .collect();
            assert_eq!(runs.len(), count);
            assert_eq!(runs[0].0, 0);
            assert_eq!(runs[count - 1].1, BUCKETS - 1);
            assert!(runs.windows(2).all(|pair| pair[0].1 + 1 == pair[1].0));
            let sizes: Vec<u32> = runs.iter().map(|(first, last)| last - first + 1).collect();
            let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(max - min <= 1, "{count}: {min}..{max}");
        }
    }

    #[test]
    fn session_affinity_keeps_kube_proxys_endpoint_chains() {
        let svc = ServicePort {
            session_affinity_timeout: Some(10800),
            ..service(Some(Ipv4Addr::new(172, 30, 0, 41)))
        };
        let names = PortNames::of(&svc.name, svc.protocol);
        let one = port_objects(&svc, &[endpoint(1, "node-b")], &node(), slot());
        let last = one.chains[&names.service].rules.last().unwrap();
        assert_eq!(
            last.statement,
            Statement::Goto("endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80".into())
        );
        let two = port_objects(
            &svc,
            &[endpoint(1, "node-b"), endpoint(2, "node-b")],
            &node(),
            slot(),
        );
        assert_eq!(two.sets[&names.endpoints_map].elements.len(), 2);
        let last = two.chains[&names.service].rules.last().unwrap();
        assert_eq!(
            last.statement,
            Statement::RandomDispatch {
                modulus: 2,
                map: names.endpoints_map.clone()
            }
        );
    }

    #[test]
    fn without_endpoints_every_address_rejects_and_nothing_else_exists() {
        let svc = ServicePort {
            node_port: Some(30080),
            external_ips: vec![Ipv4Addr::new(192, 0, 2, 1).into()],
            ..service(Some(Ipv4Addr::new(172, 30, 0, 41)))
        };
        let objects = port_objects(&svc, &[], &node(), slot());
        assert!(objects.chains.is_empty() && objects.sets.is_empty());
        let reject = Value::from(Verdict::Goto(REJECT_CHAIN.into()));
        assert_eq!(
            objects.elements,
            vec![
                (
                    CLUSTER_IPS,
                    Key::Address(Ipv4Addr::new(172, 30, 0, 41).into()),
                    Value::Member
                ),
                (
                    NO_ENDPOINT_SERVICES,
                    Key::AddressProtocolPort(
                        Ipv4Addr::new(172, 30, 0, 41).into(),
                        Protocol::Tcp,
                        80
                    ),
                    reject.clone()
                ),
                (
                    NO_ENDPOINT_SERVICES,
                    Key::AddressProtocolPort(Ipv4Addr::new(192, 0, 2, 1).into(), Protocol::Tcp, 80),
                    reject.clone()
                ),
                (
                    NO_ENDPOINT_NODEPORTS,
                    Key::ProtocolPort(Protocol::Tcp, 30080),
                    reject
                ),
            ]
        );
    }

    #[test]
    fn external_policy_local_without_local_endpoints_drops_after_the_short_cuts() {
        let svc = ServicePort {
            node_port: Some(30080),
            external_traffic_policy_local: true,
            ..service(Some(Ipv4Addr::new(172, 30, 0, 41)))
        };
        let names = PortNames::of(&svc.name, svc.protocol);
        let objects = port_objects(&svc, &[endpoint(1, "node-b")], &node(), slot());
        let external = &objects.chains[&names.external].rules;
        assert_eq!(external.len(), 4);
        assert_eq!(
            external[0].statement,
            Statement::Goto(names.service.clone())
        );
        assert_eq!(external[3].statement, Statement::Drop);
        assert!(!objects.chains.contains_key(&names.local));
    }
}
