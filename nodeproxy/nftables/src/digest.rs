//! What a table holds, reduced to digests: per chain its declaration and one digest per
//! rule, per set its declaration and the multiset of its elements. Two tables with the
//! same digests do the same to packets; a chain or set whose digests differ names what
//! someone else changed.
//!
//! The kernel lists an object with attributes of its own beside those it was given
//! (handles, use counts, packet counters, and registers and flags it derives from the
//! others). So each object is reduced to the attributes that say what it does, in a fixed
//! order, with all-zero values left out (an absent attribute means zero), and both sides go
//! through the same reduction: the kernel's listing ([`crate::kernel::Netlink::read_table`])
//! and the messages the encoder sends for the model ([`TableDigest::of`]). An expression
//! the reduction does not know keeps all its attributes, so a rule someone replaced with a
//! foreign one never matches ours.

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hasher};

use tandem_common::IpFamily;

use crate::encode::attributes;
use crate::model::{Chain, Ruleset, Set, SetSpec};
use crate::transaction::{Drift, TableDrift};

/// One chain: its declaration (hook, priority, type and policy of a base chain) and a
/// digest per rule, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChainDigest {
    pub declaration: u64,
    pub rules: Vec<u64>,
}

impl ChainDigest {
    /// The digest of `chain` in our table of `family`.
    pub fn of(chain: &Chain, family: IpFamily) -> Self {
        Self {
            declaration: chain_declaration(&attributes::chain(chain.base.as_ref())),
            rules: chain
                .rules
                .iter()
                .map(|rule| rule_digest(&attributes::rule(rule, family)))
                .collect(),
        }
    }
}

/// One set: its declaration and its elements, counted and summed over a digest each, so
/// that the order the kernel lists them in does not matter. The elements of a dynamic
/// set (filled by packets) are left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetDigest {
    pub declaration: u64,
    pub elements: usize,
    pub content: u64,
}

impl SetDigest {
    /// The digest of set `name` in our table of `family`.
    pub fn of(name: &str, set: &Set, family: IpFamily) -> Self {
        let mut digest = Self {
            declaration: set_declaration(&attributes::set(name, set.spec, family)).0,
            ..Self::default()
        };
        if !matches!(set.spec, SetSpec::Dynamic { .. }) {
            for (key, value) in &set.elements {
                for entry in attributes::element(key, value) {
                    digest.add_element(&entry);
                }
            }
        }
        digest
    }

    /// Counts in one element entry (its attributes).
    pub(crate) fn add_element(&mut self, entry: &[u8]) {
        let mut h = DefaultHasher::new();
        reduce(&mut h, entry, ELEMENT);
        self.elements += 1;
        self.content = self.content.wrapping_add(h.finish());
    }
}

/// Every chain and set of a table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableDigest {
    pub chains: BTreeMap<String, ChainDigest>,
    pub sets: BTreeMap<String, SetDigest>,
}

impl TableDigest {
    pub fn of(ruleset: &Ruleset) -> Self {
        Self {
            chains: ruleset
                .chains
                .iter()
                .map(|(name, chain)| (name.clone(), ChainDigest::of(chain, ruleset.family)))
                .collect(),
            sets: ruleset
                .sets
                .iter()
                .map(|(name, set)| (name.clone(), SetDigest::of(name, set, ruleset.family)))
                .collect(),
        }
    }
}

// Drift is found here, from digests; `Transaction::repair` mends it without knowing of
// digests, so the drift types live in `transaction`, below this module.
impl TableDrift {
    /// How the kernel's `kernel` differs from `written`, leaving out the chains and sets
    /// `skip` names (written again since the kernel was read: the next read checks them).
    pub fn between(
        written: &TableDigest,
        kernel: &TableDigest,
        skip: impl Fn(ObjectKind, &str) -> bool,
    ) -> Self {
        let chains = drift_of(&written.chains, &kernel.chains, |w, k| {
            (w.declaration != k.declaration)
                .then_some(Drift::Declaration)
                .or((w.rules != k.rules).then_some(Drift::Content))
        });
        let sets = drift_of(&written.sets, &kernel.sets, |w, k| {
            (w.declaration != k.declaration)
                .then_some(Drift::Declaration)
                .or((w.elements != k.elements || w.content != k.content).then_some(Drift::Content))
        });
        Self {
            chains: chains
                .into_iter()
                .filter(|(name, _)| !skip(ObjectKind::Chain, name))
                .collect(),
            sets: sets
                .into_iter()
                .filter(|(name, _)| !skip(ObjectKind::Set, name))
                .collect(),
        }
    }
}

/// Chains and sets have names of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectKind {
    Chain,
    Set,
}

fn drift_of<T>(
    written: &BTreeMap<String, T>,
    kernel: &BTreeMap<String, T>,
    differs: impl Fn(&T, &T) -> Option<Drift>,
) -> BTreeMap<String, Drift> {
    let missing = written
        .iter()
        .filter_map(|(name, w)| match kernel.get(name) {
            None => Some((name.clone(), Drift::Missing)),
            Some(k) => differs(w, k).map(|drift| (name.clone(), drift)),
        });
    let unexpected = kernel
        .keys()
        .filter(|name| !written.contains_key(*name))
        .map(|name| (name.clone(), Drift::Unexpected));
    missing.chain(unexpected).collect()
}

// Attributes (`linux/netfilter/nf_tables.h`) the reduction reads.
#[cfg(feature = "netlink")]
const NFTA_CHAIN_TABLE: u16 = 1;
#[cfg(feature = "netlink")]
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
#[cfg(feature = "netlink")]
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
#[cfg(feature = "netlink")]
const NFTA_SET_TABLE: u16 = 1;
#[cfg(feature = "netlink")]
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_FLAGS: u16 = 3;
#[cfg(feature = "netlink")]
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
/// A set that packets fill (`update @set`): its elements are not ours to compare.
const NFT_SET_EVAL: u32 = 0x20;
/// Flags the kernel adds to a `nat` expression from the registers it was given.
const NF_NAT_RANGE_MAP_IPS: u32 = 0x1;
const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 0x2;

/// How one attribute is reduced.
#[derive(Clone, Copy)]
enum Part {
    /// Its bytes (left out when all zero).
    Value,
    /// A big-endian u32 without the given bits (left out when zero).
    FlagsWithout(u32),
    /// Nested attributes, reduced by their own schema.
    Nested(Schema),
}

/// The attributes that matter, in the order they are hashed.
type Schema = &'static [(u16, Part)];

use Part::{FlagsWithout, Nested, Value};

/// `NFTA_DATA_*`: a value, or a verdict (code and chain).
const DATA: Part = Nested(&[(1, Value), (2, Nested(&[(1, Value), (2, Value)]))]);
const CHAIN_DECLARATION: Schema = &[
    (NFTA_CHAIN_HOOK, Nested(&[(1, Value), (2, Value)])),
    (NFTA_CHAIN_POLICY, Value),
    (NFTA_CHAIN_TYPE, Value),
];
/// Flags, key and data types, timeout and user data; not the data length, which the
/// kernel sets for a verdict map itself.
const SET_DECLARATION: Schema = &[
    (NFTA_SET_FLAGS, Value),
    (4, Value),
    (5, Value),
    (6, Value),
    (11, Value),
    (13, Value),
];
/// Key, data, flags (an interval's end) and the end of a ranged key.
const ELEMENT: Schema = &[(1, DATA), (2, DATA), (3, Value), (10, DATA)];

/// The attributes of each expression that say what it does: what `nft` sends, without
/// set ids (not listed back), the registers and flags the kernel derives for `nat`, and
/// the counters, which move with every packet.
fn expression_schema(name: &[u8]) -> Option<Schema> {
    Some(match name {
        b"payload" => &[
            (1, Value),
            (2, Value),
            (3, Value),
            (4, Value),
            (5, Value),
            (6, Value),
            (7, Value),
            (8, Value),
        ],
        b"cmp" => &[(1, Value), (2, Value), (3, DATA)],
        b"bitwise" => &[
            (1, Value),
            (2, Value),
            (3, Value),
            (4, DATA),
            (5, DATA),
            (6, Value),
            (7, DATA),
        ],
        b"meta" | b"fib" => &[(1, Value), (2, Value), (3, Value)],
        b"ct" => &[(1, Value), (2, Value), (3, Value), (4, Value)],
        b"lookup" => &[(1, Value), (2, Value), (3, Value), (5, Value)],
        b"immediate" => &[(1, Value), (2, DATA)],
        b"numgen" => &[(1, Value), (2, Value), (3, Value), (4, Value)],
        b"byteorder" => &[(1, Value), (2, Value), (3, Value), (4, Value), (5, Value)],
        b"nat" => &[
            (1, Value),
            (2, Value),
            (3, Value),
            (5, Value),
            (
                7,
                FlagsWithout(NF_NAT_RANGE_MAP_IPS | NF_NAT_RANGE_PROTO_SPECIFIED),
            ),
        ],
        b"masq" => &[(1, Value), (2, Value), (3, Value)],
        b"reject" => &[(1, Value), (2, Value)],
        b"dynset" => &[
            (1, Value),
            (3, Value),
            (4, Value),
            (5, Value),
            (6, Value),
            (8, Value),
        ],
        b"counter" => &[],
        _ => return None,
    })
}

/// Netlink attributes: `(type without the nested and byte-order flags, value)`; stops at
/// the first malformed one.
pub(crate) fn attributes(bytes: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        let header = rest.get(..4)?;
        let len = usize::from(u16::from_ne_bytes([header[0], header[1]]));
        let kind = u16::from_ne_bytes([header[2], header[3]]) & 0x3fff;
        let value = rest.get(4..len)?;
        rest = rest.get((len + 3) & !3..).unwrap_or_default();
        Some((kind, value))
    })
}

/// The first attribute of `kind`.
pub(crate) fn find(bytes: &[u8], kind: u16) -> Option<&[u8]> {
    attributes(bytes).find(|(k, _)| *k == kind).map(|(_, v)| v)
}

/// A string attribute without its NUL.
#[cfg(feature = "netlink")]
pub(crate) fn string(value: &[u8]) -> String {
    let value = value.strip_suffix(&[0]).unwrap_or(value);
    String::from_utf8_lossy(value).into_owned()
}

fn reduce(h: &mut DefaultHasher, bytes: &[u8], schema: Schema) {
    for &(kind, part) in schema {
        let Some(value) = find(bytes, kind) else {
            continue;
        };
        match part {
            Value if value.iter().all(|b| *b == 0) => {}
            Value => {
                h.write_u16(kind);
                h.write_usize(value.len());
                h.write(value);
            }
            FlagsWithout(derived) => {
                let flags = value
                    .get(..4)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u32::from_be_bytes)
                    & !derived;
                if flags != 0 {
                    h.write_u16(kind);
                    h.write_u32(flags);
                }
            }
            Nested(inner) => {
                h.write_u16(kind);
                reduce(h, value, inner);
                h.write_u8(0xff);
            }
        }
    }
}

/// A chain's declaration from its attributes (a listed chain, or ours as sent).
pub(crate) fn chain_declaration(bytes: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    reduce(&mut h, bytes, CHAIN_DECLARATION);
    h.finish()
}

/// A listed chain of `table` (a dump of chains lists every table's): its name and
/// declaration.
#[cfg(feature = "netlink")]
pub(crate) fn listed_chain(bytes: &[u8], table: &str) -> Option<(String, u64)> {
    if find(bytes, NFTA_CHAIN_TABLE)? != with_nul(table).as_slice() {
        return None;
    }
    let name = string(find(bytes, NFTA_CHAIN_NAME)?);
    Some((name, chain_declaration(bytes)))
}

#[cfg(feature = "netlink")]
fn with_nul(name: &str) -> Vec<u8> {
    let mut bytes = name.as_bytes().to_vec();
    bytes.push(0);
    bytes
}

/// A rule from its attributes: its expressions, each reduced by its schema, then its
/// user data (the comment).
pub(crate) fn rule_digest(bytes: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    for (_, expression) in attributes(find(bytes, NFTA_RULE_EXPRESSIONS).unwrap_or_default()) {
        let name = find(expression, NFTA_EXPR_NAME).unwrap_or_default();
        let data = find(expression, NFTA_EXPR_DATA).unwrap_or_default();
        h.write_usize(name.len());
        h.write(name);
        match expression_schema(name.strip_suffix(&[0]).unwrap_or(name)) {
            Some(schema) => reduce(&mut h, data, schema),
            None => {
                for (kind, value) in attributes(data) {
                    h.write_u16(kind);
                    h.write_usize(value.len());
                    h.write(value);
                }
            }
        }
    }
    if let Some(userdata) = find(bytes, NFTA_RULE_USERDATA) {
        h.write_usize(userdata.len());
        h.write(userdata);
    }
    h.finish()
}

/// A listed rule: its chain and digest.
#[cfg(feature = "netlink")]
pub(crate) fn listed_rule(bytes: &[u8]) -> Option<(String, u64)> {
    let chain = string(find(bytes, NFTA_RULE_CHAIN)?);
    Some((chain, rule_digest(bytes)))
}

/// A set's declaration, and whether packets fill it.
pub(crate) fn set_declaration(bytes: &[u8]) -> (u64, bool) {
    let mut h = DefaultHasher::new();
    reduce(&mut h, bytes, SET_DECLARATION);
    let flags = find(bytes, NFTA_SET_FLAGS)
        .and_then(|b| b.get(..4)?.try_into().ok())
        .map_or(0, u32::from_be_bytes);
    (h.finish(), flags & NFT_SET_EVAL != 0)
}

/// A listed set of `table`: its name, declaration and whether packets fill it.
#[cfg(feature = "netlink")]
pub(crate) fn listed_set(bytes: &[u8], table: &str) -> Option<(String, u64, bool)> {
    if find(bytes, NFTA_SET_TABLE)? != with_nul(table).as_slice() {
        return None;
    }
    let name = string(find(bytes, NFTA_SET_NAME)?);
    let (declaration, dynamic) = set_declaration(bytes);
    Some((name, declaration, dynamic))
}

/// The element entries of one listed element message.
#[cfg(feature = "netlink")]
pub(crate) fn listed_elements(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    attributes(find(bytes, NFTA_SET_ELEM_LIST_ELEMENTS).unwrap_or_default()).map(|(_, e)| e)
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddr};

    use tandem_common::Protocol;

    use super::*;
    use crate::model::{Key, KeyType, Match, Rule, Statement, Value as ElementValue};

    fn dnat(port: u16) -> Rule {
        Rule::when(
            vec![Match::Protocol(Protocol::Tcp)],
            Statement::Dnat(SocketAddr::new(Ipv4Addr::new(10, 244, 1, 2).into(), port)),
        )
    }

    #[test]
    fn attributes_are_read_with_their_padding_and_without_flag_bits() {
        // A 1-byte value padded to 4, then a nested (flag 0x8000) one.
        let bytes = [5, 0, 1, 0, 7, 0, 0, 0, 8, 0, 2, 0x80, 1, 2, 3, 4];
        let read: Vec<(u16, &[u8])> = attributes(&bytes).collect();
        assert_eq!(read, vec![(1, &[7][..]), (2, &[1, 2, 3, 4][..])]);
        // A length past the end stops the walk instead of panicking.
        assert_eq!(attributes(&[200, 0, 1, 0, 0]).count(), 0);
    }

    #[test]
    fn a_rule_digest_follows_what_the_rule_does() {
        let digest = |rule: &Rule| rule_digest(&attributes::rule(rule, IpFamily::V4));
        assert_eq!(digest(&dnat(80)), digest(&dnat(80)));
        assert_ne!(digest(&dnat(80)), digest(&dnat(81)));
        assert_ne!(
            digest(&dnat(80)),
            digest(&dnat(80).with_comment("a comment"))
        );
    }

    #[test]
    fn derived_nat_flags_and_zero_values_do_not_count() {
        let mut h = DefaultHasher::new();
        reduce(&mut h, &[], expression_schema(b"nat").unwrap_or_default());
        let empty = h.finish();
        // FLAGS = MAP_IPS | PROTO_SPECIFIED, and a zero REG_PROTO_MIN.
        let derived = [8, 0, 7, 0, 0, 0, 0, 3, 8, 0, 5, 0, 0, 0, 0, 0];
        let mut h = DefaultHasher::new();
        reduce(
            &mut h,
            &derived,
            expression_schema(b"nat").unwrap_or_default(),
        );
        assert_eq!(h.finish(), empty);
        // Any other flag counts.
        let persistent = [8, 0, 7, 0, 0, 0, 0, 0x0b];
        let mut h = DefaultHasher::new();
        reduce(
            &mut h,
            &persistent,
            expression_schema(b"nat").unwrap_or_default(),
        );
        assert_ne!(h.finish(), empty);
    }

    #[test]
    fn drift_names_what_is_missing_unexpected_or_different() {
        let mut map = Set::verdict_map(KeyType::Index);
        map.elements
            .insert(Key::Index(0), ElementValue::Verdict(crate::Verdict::Drop));
        let written = Ruleset {
            family: IpFamily::V4,
            chains: [
                ("a".to_owned(), Chain::default()),
                (
                    "b".to_owned(),
                    Chain {
                        base: None,
                        rules: vec![dnat(80)],
                    },
                ),
            ]
            .into(),
            sets: [("m".to_owned(), map.clone())].into(),
        };
        let mut kernel = written.clone();
        kernel.chains.remove("a");
        kernel.chains.insert("c".to_owned(), Chain::default());
        if let Some(chain) = kernel.chains.get_mut("b") {
            chain.rules.push(dnat(81));
        }
        if let Some(set) = kernel.sets.get_mut("m") {
            set.elements.clear();
        }
        let drift = TableDrift::between(
            &TableDigest::of(&written),
            &TableDigest::of(&kernel),
            |_, _| false,
        );
        assert_eq!(
            drift.chains,
            [
                ("a".to_owned(), Drift::Missing),
                ("b".to_owned(), Drift::Content),
                ("c".to_owned(), Drift::Unexpected)
            ]
            .into()
        );
        assert_eq!(drift.sets, [("m".to_owned(), Drift::Content)].into());
        // What was written since the kernel was read is left for the next read.
        let later = TableDrift::between(
            &TableDigest::of(&written),
            &TableDigest::of(&kernel),
            |kind, name| kind == ObjectKind::Set || name == "b",
        );
        assert_eq!(later.chains.len(), 2);
        assert!(later.sets.is_empty());
        assert!(
            TableDrift::between(
                &TableDigest::of(&written),
                &TableDigest::of(&written),
                |_, _| false
            )
            .is_empty()
        );
    }
}
