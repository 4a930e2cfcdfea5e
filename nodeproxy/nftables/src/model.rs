//! The ruleset of table `ip tandem` (or `ip6 tandem`), as typed values.
//!
//! Each variant is one construct of the nft language with one fixed meaning; its doc
//! comment gives the nft text it stands for. [`crate::render`] writes exactly that text and
//! [`crate::encode`] the netlink expressions `nft` itself would send for it, so a ruleset
//! programmed either way lists the same (`nft list table ip tandem`).

use std::collections::{BTreeMap, BTreeSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use tandem_common::{IpFamily, Protocol};

/// Our table's name: `table ip tandem`, and `table ip6 tandem` for IPv6.
pub const TABLE: &str = "tandem";

/// The masquerade bit of the packet mark, as in the iptables mode (`0x4000`).
pub const MASQUERADE_MARK: u32 = 0x4000;

/// The range `numgen random mod BUCKETS` draws from to pick an endpoint: each endpoint of
/// an [`SetSpec::EndpointMap`] owns an equal run of buckets ([`Key::Buckets`]). The
/// modulus stays fixed, so adding or removing an endpoint only rewrites map elements,
/// never the rule. 720720 is the least common multiple of 1 to 16: up to 16 endpoints
/// share it exactly, and more are off by at most one bucket (0.00014% of the traffic).
pub const BUCKETS: u32 = 720_720;

/// How nft names a family and our table in it.
pub trait NftFamily {
    /// The nftables family: `ip` or `ip6`.
    fn nft_family(self) -> &'static str;

    /// Our table of this family, as nft names it: `ip tandem` or `ip6 tandem`.
    fn nft_table(self) -> String;
}

impl NftFamily for IpFamily {
    fn nft_family(self) -> &'static str {
        match self {
            Self::V4 => "ip",
            Self::V6 => "ip6",
        }
    }

    fn nft_table(self) -> String {
        format!("{} {TABLE}", self.nft_family())
    }
}

/// A netfilter hook of the `ip` family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

impl Hook {
    pub fn as_str(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Input => "input",
            Hook::Forward => "forward",
            Hook::Output => "output",
            Hook::Postrouting => "postrouting",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ChainType {
    Filter,
    Nat,
}

impl ChainType {
    pub fn as_str(self) -> &'static str {
        match self {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
        }
    }
}

/// What makes a chain a base chain: `type nat hook prerouting priority -100; policy accept;`.
/// Our base chains always accept by policy: they only add to what the host does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BaseChain {
    pub chain_type: ChainType,
    pub hook: Hook,
    /// Numeric priority (`dstnat` is -100, `srcnat` 100, `filter` 0).
    pub priority: i32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Chain {
    pub base: Option<BaseChain>,
    pub rules: Vec<Rule>,
}

/// One rule: every match must hold, then the statement runs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    pub matches: Vec<Match>,
    pub statement: Statement,
    /// `comment "…"` (rule user data), for the reader of `nft list`.
    pub comment: Option<String>,
}

impl Rule {
    /// A rule with no matches.
    pub fn always(statement: Statement) -> Self {
        Self {
            matches: Vec::new(),
            statement,
            comment: None,
        }
    }

    pub fn when(matches: Vec<Match>, statement: Statement) -> Self {
        Self {
            matches,
            statement,
            comment: None,
        }
    }

    pub fn with_comment(mut self, comment: impl Into<String>) -> Self {
        self.comment = Some(comment.into());
        self
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Match {
    /// `ip saddr 10.244.0.0/16`, or `ip saddr != 10.244.0.0/16` when negated; a host
    /// prefix is written as the bare address (`ip6 saddr` in `ip6 tandem`).
    SourceAddress { net: IpNet, negated: bool },
    /// `ip daddr 10.96.0.10` (same forms as [`Match::SourceAddress`]).
    DestinationAddress { net: IpNet, negated: bool },
    /// `meta l4proto tcp`.
    Protocol(Protocol),
    /// `tcp dport 80` (also matches the protocol).
    DestinationPort { protocol: Protocol, port: u16 },
    /// `ct state new`.
    ConnectionNew,
    /// `ct status dnat`: the connection's destination was translated (by a Service's
    /// DNAT).
    ConnectionDnat,
    /// `fib daddr type local`: the destination is one of this node's addresses.
    DestinationLocal,
    /// `fib saddr type local`: the source is one of this node's addresses.
    SourceLocal,
    /// `meta mark & 0x00004000 == 0x00004000` (`set`) or `meta mark & 0x00004000 == 0`.
    Mark { bit: u32, set: bool },
    /// `ip saddr @name`: the source is in a set of [`KeyType::Address`].
    SourceInSet(String),
    /// `ip saddr . ip daddr @name`: the address pair is in a set of
    /// [`KeyType::AddressPair`].
    AddressPairInSet(String),
    /// `ip daddr @name`: the destination is in a set of [`SetSpec::Addresses`].
    DestinationInSet(String),
    /// `iifname "cni0"`, `iifname "veth*"` when `prefix` (the name's start), with `!=` when
    /// negated. A packet made on the node has no input interface: it matches only the
    /// negated form. The name is 1 to 15 bytes without `"` or `*`.
    InputInterface {
        name: String,
        prefix: bool,
        negated: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Statement {
    /// `jump name`.
    Jump(String),
    /// `goto name`.
    Goto(String),
    /// `return`.
    Return,
    /// `accept`.
    Accept,
    /// `drop`.
    Drop,
    /// `reject` (ICMP port unreachable, as iptables' REJECT).
    Reject,
    /// `ip daddr . meta l4proto . th dport vmap @name` for [`DispatchKey::AddressProtocolPort`],
    /// `meta l4proto . th dport vmap @name` for [`DispatchKey::ProtocolPort`].
    Dispatch { key: DispatchKey, map: String },
    /// `numgen random mod N vmap @name`: picks one of N elements `0 … N-1` at random.
    RandomDispatch { modulus: u32, map: String },
    /// `dnat ip to numgen random mod 720720 offset OFFSET map @name` ([`BUCKETS`]): DNATs
    /// to the endpoint of an [`SetSpec::EndpointMap`] owning a random bucket of
    /// `offset .. offset + BUCKETS` (many spreads share one map, each in its own range).
    /// Rules put a [`Match::Protocol`] first, as for [`Statement::Dnat`].
    RandomDnat { map: String, offset: u32 },
    /// `meta mark set meta mark | 0x00004000`.
    SetMark(u32),
    /// `meta mark set meta mark ^ 0x00004000` (clears a bit known to be set).
    ToggleMark(u32),
    /// `masquerade fully-random`.
    Masquerade,
    /// `dnat to 10.244.1.2:8080` (`dnat to [fd00::2]:8080`); rules put a
    /// [`Match::Protocol`] first, since a port mapping needs a known transport protocol.
    Dnat(SocketAddr),
    /// `update @name { ip saddr }`: adds (or refreshes) the source in a dynamic set.
    AddSourceToSet(String),
}

/// The packet fields a dispatch map is looked up with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DispatchKey {
    AddressProtocolPort,
    ProtocolPort,
}

/// A set's key, with the nft type it is declared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KeyType {
    /// `type ipv4_addr . inet_proto . inet_service` (destination address, protocol, port;
    /// `ipv6_addr` in `ip6 tandem`, and so for every address below).
    AddressProtocolPort,
    /// `type inet_proto . inet_service`.
    ProtocolPort,
    /// `typeof numgen random mod 1`: the index [`Statement::RandomDispatch`] draws.
    Index,
    /// `type ipv4_addr`.
    Address,
    /// `type ipv4_addr . ipv4_addr` (source, destination).
    AddressPair,
}

impl From<DispatchKey> for KeyType {
    fn from(key: DispatchKey) -> Self {
        match key {
            DispatchKey::AddressProtocolPort => KeyType::AddressProtocolPort,
            DispatchKey::ProtocolPort => KeyType::ProtocolPort,
        }
    }
}

/// One element's key; its variant must match the set's [`KeyType`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Key {
    /// `10.96.0.10 . tcp . 80`.
    AddressProtocolPort(IpAddr, Protocol, u16),
    /// `tcp . 30080`.
    ProtocolPort(Protocol, u16),
    /// `3`.
    Index(u32),
    /// `10.244.1.2`.
    Address(IpAddr),
    /// `10.244.1.2 . 10.244.1.2`: an address paired with itself, the only pairs the node
    /// proxy writes (an endpoint reaching itself, a hairpin). One address rather than two
    /// keeps a key at 20 bytes, not 36: there are hundreds of thousands of keys.
    SelfPair(IpAddr),
    /// `0-72071`: the buckets `first ..= last` of an [`SetSpec::EndpointMap`].
    Buckets { first: u32, last: u32 },
}

/// The verdict a map element holds.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    Drop,
    Goto(String),
}

/// What an element maps its key to; the variant follows the set's [`SetSpec`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Value {
    /// An element of a [`SetSpec::AddressPairs`] or [`SetSpec::Addresses`] set: the key
    /// alone.
    Member,
    /// In a [`SetSpec::VerdictMap`].
    Verdict(Verdict),
    /// In a [`SetSpec::EndpointMap`]: `10.244.1.2 . 8080`.
    Endpoint(SocketAddr),
}

impl From<Verdict> for Value {
    fn from(verdict: Verdict) -> Self {
        Value::Verdict(verdict)
    }
}

/// How a set is declared (everything but its elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetSpec {
    /// `map name { type KEY : verdict; }`: elements are written by the node proxy.
    VerdictMap(KeyType),
    /// `map name { typeof numgen random mod 1 : ip daddr . tcp dport; flags interval; }`:
    /// runs of buckets ([`Key::Buckets`]) → endpoint, for [`Statement::RandomDnat`].
    EndpointMap(Protocol),
    /// `set name { type ipv4_addr . ipv4_addr; }`: elements are written by the node proxy.
    AddressPairs,
    /// `set name { type ipv4_addr; }`: elements are written by the node proxy.
    Addresses,
    /// `set name { type ipv4_addr; flags dynamic,timeout; timeout 10800s; }`: elements are
    /// added by the packet path ([`Statement::AddSourceToSet`]) and expire.
    Dynamic { timeout_seconds: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Set {
    pub spec: SetSpec,
    /// Always empty for [`SetSpec::Dynamic`].
    pub elements: BTreeMap<Key, Value>,
}

impl Set {
    pub fn verdict_map(key: KeyType) -> Self {
        Self::with_spec(SetSpec::VerdictMap(key))
    }

    pub fn with_spec(spec: SetSpec) -> Self {
        Self {
            spec,
            elements: BTreeMap::new(),
        }
    }

    pub fn dynamic(timeout_seconds: u32) -> Self {
        Self::with_spec(SetSpec::Dynamic { timeout_seconds })
    }
}

/// Everything in table `ip tandem` (`ip6 tandem` for [`IpFamily::V6`]). Chains and sets
/// have separate name spaces, as in nftables.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ruleset {
    /// The table's family; every address in it is of this family.
    pub family: IpFamily,
    pub chains: BTreeMap<String, Chain>,
    pub sets: BTreeMap<String, Set>,
}

impl Ruleset {
    /// An empty table of `family`.
    pub fn empty(family: IpFamily) -> Self {
        Self {
            family,
            ..Self::default()
        }
    }

    pub fn rule_count(&self) -> usize {
        self.chains.values().map(|chain| chain.rules.len()).sum()
    }

    pub fn element_count(&self) -> usize {
        self.sets.values().map(|set| set.elements.len()).sum()
    }
}

/// A digest of every chain and set of a ruleset, by name: what is needed to tell which
/// objects another ruleset has differently without keeping this one (its name and eight
/// bytes per object). Two objects with the same digest are taken as equal: a 64-bit
/// hash makes a false match among tens of thousands of objects vanishingly unlikely.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    chains: BTreeMap<String, u64>,
    sets: BTreeMap<String, u64>,
}

impl Fingerprint {
    pub fn of(ruleset: &Ruleset) -> Self {
        fn digests<T: Hash>(objects: &BTreeMap<String, T>) -> BTreeMap<String, u64> {
            objects
                .iter()
                .map(|(name, object)| {
                    let mut hasher = DefaultHasher::new();
                    object.hash(&mut hasher);
                    (name.clone(), hasher.finish())
                })
                .collect()
        }
        Self {
            chains: digests(&ruleset.chains),
            sets: digests(&ruleset.sets),
        }
    }

    /// The chains and then the sets that differ between the two (present in one only, or
    /// different), each in name order.
    pub fn differing<'a>(&'a self, other: &'a Self) -> Vec<&'a str> {
        fn differing<'a>(
            one: &'a BTreeMap<String, u64>,
            other: &'a BTreeMap<String, u64>,
        ) -> impl Iterator<Item = &'a str> {
            let names: BTreeSet<&String> = one.keys().chain(other.keys()).collect();
            names
                .into_iter()
                .filter(|name| one.get(*name) != other.get(*name))
                .map(String::as_str)
        }
        differing(&self.chains, &other.chains)
            .chain(differing(&self.sets, &other.sets))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ruleset(rules: Vec<Rule>, element: Option<(Key, Value)>) -> Ruleset {
        let mut map = Set::verdict_map(KeyType::Index);
        map.elements.extend(element);
        Ruleset {
            family: IpFamily::V4,
            chains: [("c".to_owned(), Chain { base: None, rules })].into(),
            sets: [("m".to_owned(), map)].into(),
        }
    }

    #[test]
    fn fingerprints_name_the_objects_that_differ() {
        let accept = vec![Rule::always(Statement::Accept)];
        let element = (Key::Index(0), Verdict::Goto("c".into()).into());
        let base = Fingerprint::of(&ruleset(accept.clone(), Some(element.clone())));
        assert!(base.differing(&base.clone()).is_empty());

        let other_rule =
            Fingerprint::of(&ruleset(vec![Rule::always(Statement::Drop)], Some(element)));
        assert_eq!(base.differing(&other_rule), ["c"]);
        let no_element = Fingerprint::of(&ruleset(accept.clone(), None));
        assert_eq!(base.differing(&no_element), ["m"]);
        let mut extra = ruleset(accept, None);
        extra.chains.insert("d".into(), Chain::default());
        assert_eq!(no_element.differing(&Fingerprint::of(&extra)), ["d"]);
    }
}
