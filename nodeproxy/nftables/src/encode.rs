//! A [`Transaction`] as one nfnetlink batch: the messages `nft` 1.0.6 sends for the
//! rendered text (same expressions, registers, set declarations and user data), so a
//! ruleset written this way lists exactly as one written by `nft -f` (pure; no I/O).
//!
//! Constants are those of `linux/netfilter/nf_tables.h`, `linux/netfilter/nfnetlink.h`
//! and libnftnl's user-data TLVs. Integers in attributes are big-endian; register data
//! keeps the byte order of the packet field (network order for addresses and ports, host
//! order for marks, conntrack state, fib results and `numgen` indexes).

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use tandem_common::{IpFamily, Protocol};

use crate::model::{
    BUCKETS, BaseChain, ChainType, DispatchKey, Hook, Key, KeyType, Match, Rule, SetSpec,
    Statement, TABLE, Value, Verdict,
};
use crate::transaction::{Op, Transaction};

// Netlink and nfnetlink framing.
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_CREATE: u16 = 0x400;
const NLM_F_APPEND: u16 = 0x800;
const NLA_F_NESTED: u16 = 0x8000;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
pub(crate) const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFPROTO_UNSPEC: u8 = 0;
pub(crate) const NFPROTO_IPV4: u8 = 2;
pub(crate) const NFPROTO_IPV6: u8 = 10;

// Message types (`enum nf_tables_msg_types`).
pub(crate) const NFT_MSG_NEWTABLE: u16 = 0;
pub(crate) const NFT_MSG_DELTABLE: u16 = 2;
pub(crate) const NFT_MSG_NEWCHAIN: u16 = 3;
pub(crate) const NFT_MSG_DELCHAIN: u16 = 5;
pub(crate) const NFT_MSG_NEWRULE: u16 = 6;
pub(crate) const NFT_MSG_DELRULE: u16 = 8;
pub(crate) const NFT_MSG_NEWSET: u16 = 9;
pub(crate) const NFT_MSG_DELSET: u16 = 11;
pub(crate) const NFT_MSG_NEWSETELEM: u16 = 12;
pub(crate) const NFT_MSG_DELSETELEM: u16 = 14;
#[cfg(feature = "netlink")]
pub(crate) const NFT_MSG_NEWGEN: u16 = 15;
#[cfg(feature = "netlink")]
pub(crate) const NFT_MSG_GETGEN: u16 = 16;
/// Dump requests: the message types that read chains, rules, sets and elements.
#[cfg(feature = "netlink")]
pub(crate) const NFT_MSG_GETCHAIN: u16 = 4;
#[cfg(feature = "netlink")]
pub(crate) const NFT_MSG_GETRULE: u16 = 7;
#[cfg(feature = "netlink")]
pub(crate) const NFT_MSG_GETSET: u16 = 10;
#[cfg(feature = "netlink")]
pub(crate) const NFT_MSG_GETSETELEM: u16 = 13;
#[cfg(feature = "netlink")]
const NLM_F_DUMP: u16 = 0x300;

// Attributes of tables, chains, rules, sets and element lists.
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_FLAGS: u16 = 3;
const NFTA_SET_KEY_TYPE: u16 = 4;
const NFTA_SET_KEY_LEN: u16 = 5;
const NFTA_SET_DATA_TYPE: u16 = 6;
const NFTA_SET_DATA_LEN: u16 = 7;
const NFTA_SET_ID: u16 = 10;
const NFTA_SET_TIMEOUT: u16 = 11;
const NFTA_SET_USERDATA: u16 = 13;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_SET_ELEM_LIST_SET_ID: u16 = 4;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_SET_ELEM_FLAGS: u16 = 3;
/// An interval's end: the first key past it.
const NFT_SET_ELEM_INTERVAL_END: u32 = 0x1;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;

// Set flags and data types.
const NFT_SET_INTERVAL: u32 = 0x4;
const NFT_SET_MAP: u32 = 0x8;
const NFT_SET_TIMEOUT: u32 = 0x10;
const NFT_SET_EVAL: u32 = 0x20;
const NFT_DATA_VERDICT: u32 = 0xffff_ff00;
/// nft's data types (`enum datatypes`), concatenated 6 bits each for a concat key.
const TYPE_INTEGER: u32 = 4;
const TYPE_IPADDR: u32 = 7;
const TYPE_IP6ADDR: u32 = 8;
const TYPE_INET_PROTOCOL: u32 = 12;
const TYPE_INET_SERVICE: u32 = 13;
const CONCAT_TYPE_BITS: u32 = 6;

// libnftnl user data: a TLV list (u8 type, u8 length, value).
const NFTNL_UDATA_RULE_COMMENT: u8 = 0;
const NFTNL_UDATA_SET_KEYBYTEORDER: u8 = 0;
const NFTNL_UDATA_SET_DATABYTEORDER: u8 = 1;
const NFTNL_UDATA_SET_KEY_TYPEOF: u8 = 3;
const NFTNL_UDATA_SET_DATA_TYPEOF: u8 = 4;
const NFTNL_UDATA_SET_DATA_INTERVAL: u8 = 6;
const NFTNL_UDATA_SET_TYPEOF_EXPR: u8 = 0;
const NFTNL_UDATA_SET_TYPEOF_DATA: u8 = 1;
const NFTNL_UDATA_NUMGEN_TYPE: u8 = 0;
const NFTNL_UDATA_NUMGEN_MODULUS: u8 = 1;
const NFTNL_UDATA_NUMGEN_OFFSET: u8 = 2;
const NFTNL_UDATA_PAYLOAD_DESC: u8 = 0;
const NFTNL_UDATA_PAYLOAD_TYPE: u8 = 1;
/// nft's expression kinds as its typeof user data names them (`numgen` for an index
/// key, `verdict` for map data, `payload` fields of a concatenation); a concatenation
/// declared by `type` gets the concatenation kind with no data.
const NFT_EXPR_KIND_NUMGEN: u32 = 0x17;
const NFT_EXPR_KIND_VERDICT: u32 = 0x01;
const NFT_EXPR_KIND_CONCAT: u32 = 0x0d;
const NFT_EXPR_KIND_PAYLOAD: u32 = 0x07;
/// nft's protocol descriptions and header fields (`ip daddr`, `tcp dport`) in typeof
/// user data.
const PROTO_DESC_UDP: u32 = 6;
const PROTO_DESC_TCP: u32 = 8;
const PROTO_DESC_SCTP: u32 = 10;
const PROTO_DESC_IP: u32 = 12;
const PROTO_DESC_IP6: u32 = 13;
const IPHDR_DADDR: u32 = 12;
const IP6HDR_DADDR: u32 = 9;
const TRANSPORT_HDR_DPORT: u32 = 2;
const BYTEORDER_UNKNOWN: u32 = 0;
const BYTEORDER_HOST: u32 = 1;
const BYTEORDER_BIG_ENDIAN: u32 = 2;

// Registers: the verdict register, the 16-byte registers and the first 32-bit one (the
// 32-bit registers share the 16-byte ones' storage, four to one).
const NFT_REG_VERDICT: u32 = 0;
const NFT_REG_1: u32 = 1;
const NFT_REG_2: u32 = 2;
const NFT_REG32_00: u32 = 8;

// Verdict codes.
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
const NFT_JUMP: u32 = -3i32 as u32;
const NFT_GOTO: u32 = -4i32 as u32;
const NFT_RETURN: u32 = -5i32 as u32;

// Expression attributes.
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
const NFTA_BITWISE_SREG: u16 = 1;
const NFTA_BITWISE_DREG: u16 = 2;
const NFTA_BITWISE_LEN: u16 = 3;
const NFTA_BITWISE_MASK: u16 = 4;
const NFTA_BITWISE_XOR: u16 = 5;
const NFTA_BITWISE_OP: u16 = 6;
const NFT_BITWISE_BOOL: u32 = 0;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFTA_META_SREG: u16 = 3;
const NFT_META_MARK: u32 = 3;
const NFT_META_L4PROTO: u32 = 16;
const NFT_META_IIFNAME: u32 = 6;
/// `IFNAMSIZ`: an interface name with its NUL padding, as `meta iifname` loads it.
const IFNAMSIZ: usize = 16;
const NFTA_CT_DREG: u16 = 1;
const NFTA_CT_KEY: u16 = 2;
const NFT_CT_STATE: u32 = 0;
const NFT_CT_STATUS: u32 = 2;
const IP_CT_NEW_BIT: u32 = 1 << 3;
const IPS_DST_NAT: u32 = 1 << 5;
const NFTA_FIB_DREG: u16 = 1;
const NFTA_FIB_RESULT: u16 = 2;
const NFTA_FIB_FLAGS: u16 = 3;
const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
const NFTA_FIB_F_SADDR: u32 = 1;
const NFTA_FIB_F_DADDR: u32 = 2;
const RTN_LOCAL: u32 = 2;
const NFTA_LOOKUP_SET: u16 = 1;
const NFTA_LOOKUP_SREG: u16 = 2;
const NFTA_LOOKUP_DREG: u16 = 3;
const NFTA_LOOKUP_SET_ID: u16 = 4;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_NG_DREG: u16 = 1;
const NFTA_NG_MODULUS: u16 = 2;
const NFTA_NG_TYPE: u16 = 3;
const NFTA_NG_OFFSET: u16 = 4;
const NFT_NG_RANDOM: u32 = 1;
const NFTA_BYTEORDER_SREG: u16 = 1;
const NFTA_BYTEORDER_DREG: u16 = 2;
const NFTA_BYTEORDER_OP: u16 = 3;
const NFTA_BYTEORDER_LEN: u16 = 4;
const NFTA_BYTEORDER_SIZE: u16 = 5;
const NFT_BYTEORDER_HTON: u32 = 1;
const NFTA_NAT_TYPE: u16 = 1;
const NFTA_NAT_FAMILY: u16 = 2;
const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
const NFTA_NAT_FLAGS: u16 = 7;
const NFT_NAT_DNAT: u32 = 1;
const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 0x2;
const NFTA_MASQ_FLAGS: u16 = 1;
const NF_NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 0x10;
const NFTA_REJECT_TYPE: u16 = 1;
const NFTA_REJECT_ICMP_CODE: u16 = 2;
const NFT_REJECT_ICMP_UNREACH: u32 = 0;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMPV6_PORT_UNREACH: u8 = 4;
const NFTA_DYNSET_SET_NAME: u16 = 1;
const NFTA_DYNSET_SET_ID: u16 = 2;
const NFTA_DYNSET_OP: u16 = 3;
const NFTA_DYNSET_SREG_KEY: u16 = 4;
const NFT_DYNSET_OP_UPDATE: u32 = 1;

const TRANSPORT_DPORT_OFFSET: u32 = 2;

/// What the encoding of each family differs in.
#[derive(Debug, Clone, Copy)]
struct Family {
    nfproto: u8,
    /// nft's address data type.
    address_type: u32,
    address_len: u32,
    saddr_offset: u32,
    daddr_offset: u32,
    /// `ip daddr` or `ip6 daddr` in typeof user data.
    daddr_typeof: (u32, u32),
    port_unreachable: u8,
}

impl Family {
    fn of(family: IpFamily) -> Self {
        match family {
            IpFamily::V4 => Self {
                nfproto: NFPROTO_IPV4,
                address_type: TYPE_IPADDR,
                address_len: 4,
                saddr_offset: 12,
                daddr_offset: 16,
                daddr_typeof: (PROTO_DESC_IP, IPHDR_DADDR),
                port_unreachable: ICMP_PORT_UNREACH,
            },
            IpFamily::V6 => Self {
                nfproto: NFPROTO_IPV6,
                address_type: TYPE_IP6ADDR,
                address_len: 16,
                saddr_offset: 8,
                daddr_offset: 24,
                daddr_typeof: (PROTO_DESC_IP6, IP6HDR_DADDR),
                port_unreachable: ICMPV6_PORT_UNREACH,
            },
        }
    }

    /// The address's 32-bit words in a concatenation: the register of the field after it.
    fn address_words(self) -> u32 {
        self.address_len / 4
    }
}

/// The register a concatenation's field lands in when `words` 32-bit words precede it,
/// named as nft names it: a 16-byte register where one starts there, else a 32-bit one.
fn concat_register(words: u32) -> u32 {
    if words.is_multiple_of(4) {
        NFT_REG_1 + words / 4
    } else {
        NFT_REG32_00 + words
    }
}

/// The batch is built in buffers of this size, each holding whole messages and sent
/// together in one `sendmsg` (an iovec each): no single allocation as large as a whole
/// first sync (tens of MB), and no copying as it grows.
const CHUNK_BYTES: usize = 1 << 20;

/// A buffer is full once less than this is left: more than the messages the node proxy
/// writes take (element messages are cut at 32 KiB), so the message that ends a buffer
/// does not make it grow, which would double its size for a few bytes.
const MESSAGE_HEADROOM: usize = 64 * 1024;

/// Element messages stay well below the 64 KiB a netlink attribute can hold: the
/// elements of one [`Op::AddElements`] are split over as many messages as needed.
const ELEMENTS_PER_MESSAGE_BYTES: usize = 32 * 1024;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EncodeError {
    #[error(
        "operation {index} `{operation}` does not fit its netlink attribute (64 KiB, or 254 bytes for a comment)"
    )]
    TooLarge { index: usize, operation: String },
}

/// One encoded batch and which operation each of its messages performs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The batch's bytes in order, split between messages.
    chunks: Vec<Vec<u8>>,
    first_seq: u32,
    /// The operation index of message `first_seq + 1 + i`.
    message_ops: Vec<usize>,
}

impl Batch {
    /// Everything to send, in order, in one `sendmsg`.
    pub fn chunks(&self) -> &[Vec<u8>] {
        &self.chunks
    }

    /// The batch's size in bytes.
    pub fn byte_len(&self) -> usize {
        self.chunks.iter().map(Vec::len).sum()
    }

    /// The sequence number of the batch-begin message; a commit failure is reported
    /// against it.
    pub fn begin_seq(&self) -> u32 {
        self.first_seq
    }

    /// The sequence number of the batch-end message.
    pub fn end_seq(&self) -> u32 {
        self.first_seq
            .wrapping_add(1)
            .wrapping_add(self.message_ops.len() as u32)
    }

    /// The index (in [`Transaction::ops`]) of the operation message `seq` belongs to.
    pub fn op_index(&self, seq: u32) -> Option<usize> {
        let offset = seq.wrapping_sub(self.first_seq).checked_sub(1)?;
        self.message_ops.get(offset as usize).copied()
    }

    /// How many messages between batch begin and end.
    pub fn message_count(&self) -> usize {
        self.message_ops.len()
    }
}

/// `tx` as one batch whose messages are numbered from `first_seq` (the batch begin).
pub fn batch(tx: &Transaction, first_seq: u32) -> Result<Batch, EncodeError> {
    batch_of(tx.family, &tx.ops, first_seq)
}

/// The operations `ops` on our table of `family` as one batch, as [`batch`]: each is
/// encoded as it comes, so they need not all be held at once
/// ([`Transaction::replace_all_ops`]).
pub fn batch_of<O: Borrow<Op>>(
    family: IpFamily,
    ops: impl IntoIterator<Item = O>,
    first_seq: u32,
) -> Result<Batch, EncodeError> {
    let mut encoder = Encoder {
        family: Family::of(family),
        out: Writer::default(),
        chunks: Vec::new(),
        seq: first_seq,
        message_ops: Vec::new(),
        set_ids: BTreeMap::new(),
        last_set_id: 0,
    };
    encoder.batch_marker(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST);
    for (index, op) in ops.into_iter().enumerate() {
        let op = op.borrow();
        encoder.op(index, op);
        if encoder.out.overflow {
            return Err(EncodeError::TooLarge {
                index,
                operation: crate::render::operation(op, family),
            });
        }
    }
    encoder.batch_marker(NFNL_MSG_BATCH_END, NLM_F_REQUEST);
    encoder.chunks.push(encoder.out.buf);
    Ok(Batch {
        chunks: encoder.chunks,
        first_seq,
        message_ops: encoder.message_ops,
    })
}

/// A dump request for `kind` (one of the `NFT_MSG_GET…` types) in the tables of
/// `family` (`ip` or `ip6`), with the attributes `body` writes (the table, and a chain or
/// set to narrow it to).
#[cfg(feature = "netlink")]
pub(crate) fn dump_request(
    kind: u16,
    seq: u32,
    family: IpFamily,
    body: impl FnOnce(&mut Writer),
) -> Vec<u8> {
    let mut w = Writer::default();
    w.message(
        (NFNL_SUBSYS_NFTABLES << 8) | kind,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        Family::of(family).nfproto,
        0,
        body,
    );
    w.buf
}

/// A request for the ruleset's generation (`NFT_MSG_GETGEN`), answered with one
/// `NFT_MSG_NEWGEN` message.
#[cfg(feature = "netlink")]
pub(crate) fn generation_request(seq: u32) -> Vec<u8> {
    let mut w = Writer::default();
    w.message(
        (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN,
        NLM_F_REQUEST,
        seq,
        NFPROTO_UNSPEC,
        0,
        |_| {},
    );
    w.buf
}

/// A netlink byte buffer with nested attributes.
#[derive(Default)]
pub(crate) struct Writer {
    pub(crate) buf: Vec<u8>,
    /// Set when an attribute outgrew its 16-bit length.
    overflow: bool,
}

impl Writer {
    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    pub(crate) fn attr(&mut self, kind: u16, value: &[u8]) {
        let len = 4 + value.len();
        self.overflow |= len > usize::from(u16::MAX);
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(value);
        self.pad();
    }

    fn u32(&mut self, kind: u16, value: u32) {
        self.attr(kind, &value.to_be_bytes());
    }

    pub(crate) fn string(&mut self, kind: u16, value: &str) {
        let mut bytes = Vec::with_capacity(value.len() + 1);
        bytes.extend_from_slice(value.as_bytes());
        bytes.push(0);
        self.attr(kind, &bytes);
    }

    pub(crate) fn nest(&mut self, kind: u16, body: impl FnOnce(&mut Self)) {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0; 4]);
        body(self);
        let len = self.buf.len() - start;
        self.overflow |= len > usize::from(u16::MAX);
        self.buf[start..start + 2].copy_from_slice(&(len as u16).to_ne_bytes());
        self.buf[start + 2..start + 4].copy_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    }

    /// One message: netlink header, nfgenmsg, then the attributes `body` writes.
    pub(crate) fn message(
        &mut self,
        kind: u16,
        flags: u16,
        seq: u32,
        family: u8,
        res_id: u16,
        body: impl FnOnce(&mut Self),
    ) {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0; 4]);
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.push(family);
        self.buf.push(0); // NFNETLINK_V0
        self.buf.extend_from_slice(&res_id.to_be_bytes());
        body(self);
        let len = (self.buf.len() - start) as u32;
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }
}

struct Encoder {
    family: Family,
    /// The chunk being written.
    out: Writer,
    /// Full chunks.
    chunks: Vec<Vec<u8>>,
    seq: u32,
    message_ops: Vec<usize>,
    /// Sets declared in this batch, by name: references to them carry the id too, as
    /// nft's do.
    set_ids: BTreeMap<String, u32>,
    /// Set ids are unique within the batch, counting from 1 as nft does.
    last_set_id: u32,
}

impl Encoder {
    fn batch_marker(&mut self, kind: u16, flags: u16) {
        let seq = self.seq;
        self.out.message(
            kind,
            flags,
            seq,
            NFPROTO_UNSPEC,
            NFNL_SUBSYS_NFTABLES,
            |_| {},
        );
        self.seq = self.seq.wrapping_add(1);
        self.seal_full_chunk();
    }

    /// Starts a new chunk once the current one is full (between messages).
    fn seal_full_chunk(&mut self) {
        if self.out.buf.len() + MESSAGE_HEADROOM > CHUNK_BYTES {
            let full = std::mem::replace(&mut self.out.buf, Vec::with_capacity(CHUNK_BYTES));
            self.chunks.push(full);
        }
    }

    fn message(&mut self, index: usize, kind: u16, flags: u16, body: impl FnOnce(&mut Writer)) {
        let seq = self.seq;
        self.out.message(
            (NFNL_SUBSYS_NFTABLES << 8) | kind,
            NLM_F_REQUEST | flags,
            seq,
            self.family.nfproto,
            0,
            body,
        );
        self.message_ops.push(index);
        self.seq = self.seq.wrapping_add(1);
        self.seal_full_chunk();
    }

    fn op(&mut self, index: usize, op: &Op) {
        match op {
            Op::AddTable => self.message(index, NFT_MSG_NEWTABLE, 0, |w| {
                w.string(NFTA_TABLE_NAME, TABLE);
                w.u32(NFTA_TABLE_FLAGS, 0);
            }),
            Op::DeleteTable => {
                self.set_ids.clear();
                self.message(index, NFT_MSG_DELTABLE, 0, |w| {
                    w.string(NFTA_TABLE_NAME, TABLE)
                })
            }
            Op::AddChain { name, base } => {
                self.message(index, NFT_MSG_NEWCHAIN, NLM_F_CREATE, |w| {
                    w.string(NFTA_CHAIN_TABLE, TABLE);
                    w.string(NFTA_CHAIN_NAME, name);
                    if let Some(base) = base {
                        base_chain(w, base);
                    }
                })
            }
            Op::FlushChain(name) => self.message(index, NFT_MSG_DELRULE, 0, |w| {
                w.string(NFTA_RULE_TABLE, TABLE);
                w.string(NFTA_RULE_CHAIN, name);
            }),
            Op::DeleteChain(name) => self.message(index, NFT_MSG_DELCHAIN, 0, |w| {
                w.string(NFTA_CHAIN_TABLE, TABLE);
                w.string(NFTA_CHAIN_NAME, name);
            }),
            Op::AddRule { chain, rule } => {
                let mut body = Writer::default();
                rule_body(&mut body, rule, &self.set_ids, self.family);
                self.message(index, NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, |w| {
                    w.string(NFTA_RULE_TABLE, TABLE);
                    w.string(NFTA_RULE_CHAIN, chain);
                    w.buf.extend_from_slice(&body.buf);
                    w.overflow |= body.overflow;
                })
            }
            Op::AddSet { name, spec } => {
                self.last_set_id += 1;
                let id = self.last_set_id;
                self.set_ids.insert(name.clone(), id);
                let family = self.family;
                self.message(index, NFT_MSG_NEWSET, NLM_F_CREATE, |w| {
                    set_declaration(w, name, *spec, id, family)
                })
            }
            Op::DeleteSet(name) => {
                self.set_ids.remove(name);
                self.message(index, NFT_MSG_DELSET, 0, |w| {
                    w.string(NFTA_SET_TABLE, TABLE);
                    w.string(NFTA_SET_NAME, name);
                })
            }
            Op::AddElements { set, elements } => {
                let id = self.set_ids.get(set).copied();
                let encoded: Vec<Vec<u8>> = elements
                    .iter()
                    .flat_map(|(key, value)| element(key, Some(value)))
                    .collect();
                self.element_messages(index, NFT_MSG_NEWSETELEM, NLM_F_CREATE, set, id, &encoded);
            }
            Op::FlushSet(name) => self.message(index, NFT_MSG_DELSETELEM, 0, |w| {
                w.string(NFTA_SET_ELEM_LIST_TABLE, TABLE);
                w.string(NFTA_SET_ELEM_LIST_SET, name);
            }),
            Op::DeleteElements { set, keys } => {
                let encoded: Vec<Vec<u8>> =
                    keys.iter().flat_map(|key| element(key, None)).collect();
                self.element_messages(index, NFT_MSG_DELSETELEM, 0, set, None, &encoded);
            }
        }
    }

    /// Element-list messages, each holding as many elements (their encoded attributes)
    /// as fit; like libnftnl, the list numbers its entries 1, 2, … (the kernel reads
    /// them in order, whatever their type).
    fn element_messages(
        &mut self,
        index: usize,
        kind: u16,
        flags: u16,
        set: &str,
        set_id: Option<u32>,
        elements: &[Vec<u8>],
    ) {
        let mut rest = elements;
        while !rest.is_empty() {
            let mut bytes = 0;
            let count = rest
                .iter()
                .take_while(|element| {
                    bytes += 4 + element.len();
                    bytes <= ELEMENTS_PER_MESSAGE_BYTES
                })
                .count()
                .max(1);
            let (chunk, tail) = rest.split_at(count);
            rest = tail;
            self.message(index, kind, flags, |w| {
                w.string(NFTA_SET_ELEM_LIST_TABLE, TABLE);
                w.string(NFTA_SET_ELEM_LIST_SET, set);
                if let Some(id) = set_id {
                    w.u32(NFTA_SET_ELEM_LIST_SET_ID, id);
                }
                w.nest(NFTA_SET_ELEM_LIST_ELEMENTS, |w| {
                    for (position, element) in (1..).zip(chunk) {
                        w.nest(position, |w| w.buf.extend_from_slice(element));
                    }
                });
            });
        }
    }
}

/// A rule's attributes after its table and chain: its expressions and its comment.
fn rule_body(w: &mut Writer, rule: &Rule, set_ids: &BTreeMap<String, u32>, family: Family) {
    w.nest(NFTA_RULE_EXPRESSIONS, |w| {
        rule_expressions(w, rule, set_ids, family)
    });
    if let Some(comment) = &rule.comment {
        // A user-data TLV holds at most 255 bytes (NUL included).
        w.overflow |= comment.len() >= usize::from(u8::MAX);
        let mut udata = Vec::new();
        udata_string(&mut udata, NFTNL_UDATA_RULE_COMMENT, comment);
        w.attr(NFTA_RULE_USERDATA, &udata);
    }
}

/// The attributes of the messages that create what the model describes, as the kernel
/// reads them: what [`crate::digest`] compares with what the kernel lists.
pub(crate) mod attributes {
    use std::collections::BTreeMap;

    use tandem_common::IpFamily;

    use super::{Family, Writer, base_chain, rule_body, set_declaration};
    use crate::model::{BaseChain, Key, Rule, SetSpec, Value};

    /// A chain's hook, type and policy (none for a regular chain).
    pub(crate) fn chain(base: Option<&BaseChain>) -> Vec<u8> {
        let mut w = Writer::default();
        if let Some(base) = base {
            base_chain(&mut w, base);
        }
        w.buf
    }

    /// A rule's expressions and comment in a table of `family`; the sets it names are
    /// not declared alongside.
    pub(crate) fn rule(rule: &Rule, family: IpFamily) -> Vec<u8> {
        let mut w = Writer::default();
        rule_body(&mut w, rule, &BTreeMap::new(), Family::of(family));
        w.buf
    }

    /// A set's declaration in a table of `family`.
    pub(crate) fn set(name: &str, spec: SetSpec, family: IpFamily) -> Vec<u8> {
        let mut w = Writer::default();
        set_declaration(&mut w, name, spec, 0, Family::of(family));
        w.buf
    }

    /// The entries of one element (two for a run of buckets).
    pub(crate) fn element(key: &Key, value: &Value) -> Vec<Vec<u8>> {
        super::element(key, Some(value))
    }
}

fn base_chain(w: &mut Writer, base: &BaseChain) {
    let chain_type = match base.chain_type {
        ChainType::Filter => "filter",
        ChainType::Nat => "nat",
    };
    let hook = match base.hook {
        Hook::Prerouting => 0,
        Hook::Input => 1,
        Hook::Forward => 2,
        Hook::Output => 3,
        Hook::Postrouting => 4,
    };
    w.string(NFTA_CHAIN_TYPE, chain_type);
    w.u32(NFTA_CHAIN_POLICY, NF_ACCEPT);
    w.nest(NFTA_CHAIN_HOOK, |w| {
        w.u32(NFTA_HOOK_HOOKNUM, hook);
        w.u32(NFTA_HOOK_PRIORITY, base.priority as u32);
    });
}

fn set_declaration(w: &mut Writer, name: &str, spec: SetSpec, id: u32, family: Family) {
    w.string(NFTA_SET_TABLE, TABLE);
    w.string(NFTA_SET_NAME, name);
    let mut udata = Vec::new();
    match spec {
        SetSpec::VerdictMap(key) => {
            let (key_type, key_len) = key_type_and_len(key, family);
            w.u32(NFTA_SET_FLAGS, NFT_SET_MAP);
            w.u32(NFTA_SET_KEY_TYPE, key_type);
            w.u32(NFTA_SET_KEY_LEN, key_len);
            w.u32(NFTA_SET_DATA_TYPE, NFT_DATA_VERDICT);
            w.u32(NFTA_SET_DATA_LEN, 0);
            w.u32(NFTA_SET_ID, id);
            map_user_data(&mut udata, key);
        }
        SetSpec::EndpointMap(protocol) => {
            w.u32(NFTA_SET_FLAGS, NFT_SET_INTERVAL | NFT_SET_MAP);
            w.u32(NFTA_SET_KEY_TYPE, TYPE_INTEGER);
            w.u32(NFTA_SET_KEY_LEN, 4);
            w.u32(
                NFTA_SET_DATA_TYPE,
                concat_type(&[family.address_type, TYPE_INET_SERVICE]),
            );
            w.u32(NFTA_SET_DATA_LEN, family.address_len + 4);
            w.u32(NFTA_SET_ID, id);
            udata_u32(&mut udata, NFTNL_UDATA_SET_KEYBYTEORDER, BYTEORDER_HOST);
            udata_u32(&mut udata, NFTNL_UDATA_SET_DATABYTEORDER, BYTEORDER_UNKNOWN);
            udata_raw(&mut udata, NFTNL_UDATA_SET_KEY_TYPEOF, &numgen_typeof());
            udata_raw(
                &mut udata,
                NFTNL_UDATA_SET_DATA_TYPEOF,
                &endpoint_typeof(protocol, family),
            );
            udata_u32(&mut udata, NFTNL_UDATA_SET_DATA_INTERVAL, 0);
        }
        SetSpec::AddressPairs => {
            let (key_type, key_len) = key_type_and_len(KeyType::AddressPair, family);
            w.u32(NFTA_SET_FLAGS, 0);
            w.u32(NFTA_SET_KEY_TYPE, key_type);
            w.u32(NFTA_SET_KEY_LEN, key_len);
            w.u32(NFTA_SET_ID, id);
            udata_u32(&mut udata, NFTNL_UDATA_SET_KEYBYTEORDER, BYTEORDER_UNKNOWN);
            udata_raw(
                &mut udata,
                NFTNL_UDATA_SET_KEY_TYPEOF,
                &typeof_entry(NFT_EXPR_KIND_CONCAT, &[]),
            );
        }
        SetSpec::Addresses => {
            w.u32(NFTA_SET_FLAGS, 0);
            w.u32(NFTA_SET_KEY_TYPE, family.address_type);
            w.u32(NFTA_SET_KEY_LEN, family.address_len);
            w.u32(NFTA_SET_ID, id);
            udata_u32(
                &mut udata,
                NFTNL_UDATA_SET_KEYBYTEORDER,
                BYTEORDER_BIG_ENDIAN,
            );
        }
        SetSpec::Dynamic { timeout_seconds } => {
            w.u32(NFTA_SET_FLAGS, NFT_SET_TIMEOUT | NFT_SET_EVAL);
            w.u32(NFTA_SET_KEY_TYPE, family.address_type);
            w.u32(NFTA_SET_KEY_LEN, family.address_len);
            w.u32(NFTA_SET_ID, id);
            w.attr(
                NFTA_SET_TIMEOUT,
                &(u64::from(timeout_seconds) * 1000).to_be_bytes(),
            );
            udata_u32(
                &mut udata,
                NFTNL_UDATA_SET_KEYBYTEORDER,
                BYTEORDER_BIG_ENDIAN,
            );
        }
    }
    w.attr(NFTA_SET_USERDATA, &udata);
}

/// nft's key type (concatenations pack one type per 6 bits) and the key length (each
/// field of a concatenation padded to 4 bytes).
fn key_type_and_len(key: KeyType, family: Family) -> (u32, u32) {
    let (address, len) = (family.address_type, family.address_len);
    match key {
        KeyType::AddressProtocolPort => (
            concat_type(&[address, TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]),
            len + 8,
        ),
        KeyType::ProtocolPort => (concat_type(&[TYPE_INET_PROTOCOL, TYPE_INET_SERVICE]), 8),
        KeyType::Index => (TYPE_INTEGER, 4),
        KeyType::Address => (address, len),
        KeyType::AddressPair => (concat_type(&[address, address]), 2 * len),
    }
}

fn concat_type(types: &[u32]) -> u32 {
    types
        .iter()
        .fold(0, |acc, field| (acc << CONCAT_TYPE_BITS) | field)
}

/// A typeof entry: an expression kind and that expression's own user data.
fn typeof_entry(kind: u32, data: &[u8]) -> Vec<u8> {
    let mut entry = Vec::new();
    udata_u32(&mut entry, NFTNL_UDATA_SET_TYPEOF_EXPR, kind);
    udata_raw(&mut entry, NFTNL_UDATA_SET_TYPEOF_DATA, data);
    entry
}

/// `typeof numgen random mod 1`.
fn numgen_typeof() -> Vec<u8> {
    let mut numgen = Vec::new();
    udata_u32(&mut numgen, NFTNL_UDATA_NUMGEN_TYPE, NFT_NG_RANDOM);
    udata_u32(&mut numgen, NFTNL_UDATA_NUMGEN_MODULUS, 1);
    udata_u32(&mut numgen, NFTNL_UDATA_NUMGEN_OFFSET, 0);
    typeof_entry(NFT_EXPR_KIND_NUMGEN, &numgen)
}

/// `typeof ip daddr . tcp dport` (`ip6 daddr` for IPv6; the protocol's own port field,
/// so nft accepts the map after a `meta l4proto` match of that protocol).
fn endpoint_typeof(protocol: Protocol, family: Family) -> Vec<u8> {
    let field = |desc: u32, field: u32| {
        let mut payload = Vec::new();
        udata_u32(&mut payload, NFTNL_UDATA_PAYLOAD_DESC, desc);
        udata_u32(&mut payload, NFTNL_UDATA_PAYLOAD_TYPE, field);
        typeof_entry(NFT_EXPR_KIND_PAYLOAD, &payload)
    };
    let transport = match protocol {
        Protocol::Tcp => PROTO_DESC_TCP,
        Protocol::Udp => PROTO_DESC_UDP,
        Protocol::Sctp => PROTO_DESC_SCTP,
    };
    let mut fields = Vec::new();
    let (desc, daddr) = family.daddr_typeof;
    udata_raw(&mut fields, 0, &field(desc, daddr));
    udata_raw(&mut fields, 1, &field(transport, TRANSPORT_HDR_DPORT));
    typeof_entry(NFT_EXPR_KIND_CONCAT, &fields)
}

/// The user data nft 1.0.6 attaches to a verdict map: the key's byte order, the
/// data's, the `typeof` expressions (`numgen random mod 1` for an index key: that is
/// how `nft list` knows to print it), and "data is no interval".
fn map_user_data(udata: &mut Vec<u8>, key: KeyType) {
    match key {
        KeyType::AddressProtocolPort
        | KeyType::ProtocolPort
        | KeyType::Address
        | KeyType::AddressPair => {
            let byteorder = if key == KeyType::Address {
                BYTEORDER_BIG_ENDIAN
            } else {
                BYTEORDER_UNKNOWN
            };
            udata_u32(udata, NFTNL_UDATA_SET_KEYBYTEORDER, byteorder);
            udata_u32(udata, NFTNL_UDATA_SET_DATABYTEORDER, BYTEORDER_UNKNOWN);
            if key != KeyType::Address {
                udata_raw(
                    udata,
                    NFTNL_UDATA_SET_KEY_TYPEOF,
                    &typeof_entry(NFT_EXPR_KIND_CONCAT, &[]),
                );
            }
        }
        KeyType::Index => {
            udata_u32(udata, NFTNL_UDATA_SET_KEYBYTEORDER, BYTEORDER_HOST);
            udata_u32(udata, NFTNL_UDATA_SET_DATABYTEORDER, BYTEORDER_UNKNOWN);
            udata_raw(udata, NFTNL_UDATA_SET_KEY_TYPEOF, &numgen_typeof());
            udata_raw(
                udata,
                NFTNL_UDATA_SET_DATA_TYPEOF,
                &typeof_entry(NFT_EXPR_KIND_VERDICT, &[]),
            );
        }
    }
    udata_u32(udata, NFTNL_UDATA_SET_DATA_INTERVAL, 0);
}

fn udata_raw(udata: &mut Vec<u8>, kind: u8, value: &[u8]) {
    udata.push(kind);
    // Values are short constants or a comment, which nft caps at 128 bytes.
    udata.push(value.len().min(usize::from(u8::MAX)) as u8);
    udata.extend_from_slice(&value[..value.len().min(usize::from(u8::MAX))]);
}

/// libnftnl stores integers in user data in host order.
fn udata_u32(udata: &mut Vec<u8>, kind: u8, value: u32) {
    udata_raw(udata, kind, &value.to_ne_bytes());
}

fn udata_string(udata: &mut Vec<u8>, kind: u8, value: &str) {
    let mut bytes = value.as_bytes().to_vec();
    bytes.push(0);
    udata_raw(udata, kind, &bytes);
}

/// Key bytes as they sit in the registers: concatenated fields padded to 4 bytes.
fn key_bytes(key: &Key) -> Vec<u8> {
    match key {
        Key::AddressProtocolPort(addr, protocol, port) => {
            let mut bytes = octets(addr);
            bytes.extend_from_slice(&[protocol.number(), 0, 0, 0]);
            bytes.extend_from_slice(&port.to_be_bytes());
            bytes.extend_from_slice(&[0, 0]);
            bytes
        }
        Key::ProtocolPort(protocol, port) => {
            let mut bytes = vec![protocol.number(), 0, 0, 0];
            bytes.extend_from_slice(&port.to_be_bytes());
            bytes.extend_from_slice(&[0, 0]);
            bytes
        }
        // `numgen` writes its result in host order.
        Key::Index(index) => index.to_ne_bytes().to_vec(),
        Key::Address(addr) => octets(addr),
        Key::SelfPair(ip) => [octets(ip), octets(ip)].concat(),
        // Interval keys are compared as bytes: the rule turns the bucket big-endian.
        Key::Buckets { first, .. } => first.to_be_bytes().to_vec(),
    }
}

/// One element's netlink entries, with its value when added. A run of buckets is two
/// entries, as nft sends it: its first key, and the end marker on the key after it.
fn element(key: &Key, value: Option<&Value>) -> Vec<Vec<u8>> {
    let mut start = Writer::default();
    start.nest(NFTA_SET_ELEM_KEY, |w| {
        w.attr(NFTA_DATA_VALUE, &key_bytes(key))
    });
    match value {
        None | Some(Value::Member) => {}
        Some(Value::Verdict(verdict)) => {
            start.nest(NFTA_SET_ELEM_DATA, |w| verdict_data(w, verdict))
        }
        Some(Value::Endpoint(endpoint)) => start.nest(NFTA_SET_ELEM_DATA, |w| {
            w.attr(NFTA_DATA_VALUE, &endpoint_bytes(endpoint))
        }),
    }
    let Key::Buckets { last, .. } = key else {
        return vec![start.buf];
    };
    let mut end = Writer::default();
    end.u32(NFTA_SET_ELEM_FLAGS, NFT_SET_ELEM_INTERVAL_END);
    end.nest(NFTA_SET_ELEM_KEY, |w| {
        w.attr(NFTA_DATA_VALUE, &last.saturating_add(1).to_be_bytes())
    });
    vec![start.buf, end.buf]
}

/// An address in network order: 4 or 16 bytes.
fn octets(addr: &IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(addr) => addr.octets().to_vec(),
        IpAddr::V6(addr) => addr.octets().to_vec(),
    }
}

/// `10.244.1.2 . 8080` in registers: the address, then the port padded to 4 bytes.
fn endpoint_bytes(endpoint: &SocketAddr) -> Vec<u8> {
    let mut bytes = octets(&endpoint.ip());
    bytes.extend_from_slice(&endpoint.port().to_be_bytes());
    bytes.extend_from_slice(&[0, 0]);
    bytes
}

fn verdict_data(w: &mut Writer, verdict: &Verdict) {
    match verdict {
        Verdict::Drop => verdict_attr(w, NF_DROP, None),
        Verdict::Goto(chain) => verdict_attr(w, NFT_GOTO, Some(chain)),
    }
}

fn verdict_attr(w: &mut Writer, code: u32, chain: Option<&str>) {
    w.nest(NFTA_DATA_VERDICT, |w| {
        w.u32(NFTA_VERDICT_CODE, code);
        if let Some(chain) = chain {
            w.string(NFTA_VERDICT_CHAIN, chain);
        }
    });
}

fn rule_expressions(w: &mut Writer, rule: &Rule, set_ids: &BTreeMap<String, u32>, family: Family) {
    let mut e = Expressions { w, set_ids, family };
    for m in &rule.matches {
        e.condition(m);
    }
    e.statement(&rule.statement);
}

struct Expressions<'a> {
    w: &'a mut Writer,
    set_ids: &'a BTreeMap<String, u32>,
    family: Family,
}

impl Expressions<'_> {
    fn expr(&mut self, name: &str, body: impl FnOnce(&mut Writer)) {
        self.w.nest(NFTA_LIST_ELEM, |w| {
            w.string(NFTA_EXPR_NAME, name);
            w.nest(NFTA_EXPR_DATA, body);
        });
    }

    fn payload(&mut self, dreg: u32, base: u32, offset: u32, len: u32) {
        self.expr("payload", |w| {
            w.u32(NFTA_PAYLOAD_DREG, dreg);
            w.u32(NFTA_PAYLOAD_BASE, base);
            w.u32(NFTA_PAYLOAD_OFFSET, offset);
            w.u32(NFTA_PAYLOAD_LEN, len);
        });
    }

    fn cmp(&mut self, op: u32, value: &[u8]) {
        self.expr("cmp", |w| {
            w.u32(NFTA_CMP_SREG, NFT_REG_1);
            w.u32(NFTA_CMP_OP, op);
            w.nest(NFTA_CMP_DATA, |w| w.attr(NFTA_DATA_VALUE, value));
        });
    }

    /// `reg1 = (reg1 & mask) ^ xor`; nft 1.0.6 names the boolean operation only for
    /// `meta mark` expressions.
    fn bitwise(&mut self, mask: &[u8], xor: &[u8], with_op: bool) {
        self.expr("bitwise", |w| {
            w.u32(NFTA_BITWISE_SREG, NFT_REG_1);
            w.u32(NFTA_BITWISE_DREG, NFT_REG_1);
            if with_op {
                w.u32(NFTA_BITWISE_OP, NFT_BITWISE_BOOL);
            }
            w.u32(NFTA_BITWISE_LEN, mask.len() as u32);
            w.nest(NFTA_BITWISE_MASK, |w| w.attr(NFTA_DATA_VALUE, mask));
            w.nest(NFTA_BITWISE_XOR, |w| w.attr(NFTA_DATA_VALUE, xor));
        });
    }

    fn meta_load(&mut self, key: u32, dreg: u32) {
        self.expr("meta", |w| {
            w.u32(NFTA_META_KEY, key);
            w.u32(NFTA_META_DREG, dreg);
        });
    }

    fn immediate_data(&mut self, dreg: u32, value: &[u8]) {
        self.expr("immediate", |w| {
            w.u32(NFTA_IMMEDIATE_DREG, dreg);
            w.nest(NFTA_IMMEDIATE_DATA, |w| w.attr(NFTA_DATA_VALUE, value));
        });
    }

    fn immediate_verdict(&mut self, code: u32, chain: Option<&str>) {
        self.expr("immediate", |w| {
            w.u32(NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT);
            w.nest(NFTA_IMMEDIATE_DATA, |w| verdict_attr(w, code, chain));
        });
    }

    /// `@set` lookup of register 1; a map's value goes to `dreg` (the verdict register
    /// applies it).
    fn lookup(&mut self, set: &str, dreg: Option<u32>) {
        let id = self.set_ids.get(set).copied();
        self.expr("lookup", |w| {
            w.u32(NFTA_LOOKUP_SREG, NFT_REG_1);
            if let Some(dreg) = dreg {
                w.u32(NFTA_LOOKUP_DREG, dreg);
            }
            w.string(NFTA_LOOKUP_SET, set);
            if let Some(id) = id {
                w.u32(NFTA_LOOKUP_SET_ID, id);
            }
        });
    }

    fn protocol(&mut self, protocol: tandem_common::Protocol) {
        self.meta_load(NFT_META_L4PROTO, NFT_REG_1);
        self.cmp(NFT_CMP_EQ, &[protocol.number()]);
    }

    fn address(&mut self, offset: u32, net: &IpNet, negated: bool) {
        let op = if negated { NFT_CMP_NEQ } else { NFT_CMP_EQ };
        let prefix = u32::from(net.prefix_len());
        let addr = octets(&net.trunc().addr());
        let full = self.family.address_len;
        if prefix == full * 8 {
            self.payload(NFT_REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, full);
            self.cmp(op, &octets(&net.addr()));
        } else if prefix > 0 && prefix % 8 == 0 {
            // A byte-aligned prefix loads just its bytes.
            let len = prefix / 8;
            self.payload(NFT_REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
            self.cmp(op, &addr[..len as usize]);
        } else {
            self.payload(NFT_REG_1, NFT_PAYLOAD_NETWORK_HEADER, offset, full);
            self.bitwise(&octets(&net.netmask()), &vec![0; full as usize], false);
            self.cmp(op, &addr);
        }
    }

    /// The source or destination address, whole, into `dreg`.
    fn load_address(&mut self, dreg: u32, offset: u32) {
        let len = self.family.address_len;
        self.payload(dreg, NFT_PAYLOAD_NETWORK_HEADER, offset, len);
    }

    fn mark_bitwise(&mut self, mask: u32, xor: u32) {
        self.meta_load(NFT_META_MARK, NFT_REG_1);
        self.bitwise(&mask.to_ne_bytes(), &xor.to_ne_bytes(), true);
    }

    fn condition(&mut self, m: &Match) {
        match m {
            Match::SourceAddress { net, negated } => {
                self.address(self.family.saddr_offset, net, *negated)
            }
            Match::DestinationAddress { net, negated } => {
                self.address(self.family.daddr_offset, net, *negated)
            }
            Match::Protocol(protocol) => self.protocol(*protocol),
            Match::DestinationPort { protocol, port } => {
                self.protocol(*protocol);
                self.payload(
                    NFT_REG_1,
                    NFT_PAYLOAD_TRANSPORT_HEADER,
                    TRANSPORT_DPORT_OFFSET,
                    2,
                );
                self.cmp(NFT_CMP_EQ, &port.to_be_bytes());
            }
            Match::ConnectionNew => self.ct_bit(NFT_CT_STATE, IP_CT_NEW_BIT),
            Match::ConnectionDnat => self.ct_bit(NFT_CT_STATUS, IPS_DST_NAT),
            Match::DestinationLocal => self.fib_local(NFTA_FIB_F_DADDR),
            Match::SourceLocal => self.fib_local(NFTA_FIB_F_SADDR),
            Match::Mark { bit, set } => {
                self.mark_bitwise(*bit, 0);
                let wanted = if *set { *bit } else { 0 };
                self.cmp(NFT_CMP_EQ, &wanted.to_ne_bytes());
            }
            Match::SourceInSet(set) => {
                self.load_address(NFT_REG_1, self.family.saddr_offset);
                self.lookup(set, None);
            }
            Match::DestinationInSet(set) => {
                self.load_address(NFT_REG_1, self.family.daddr_offset);
                self.lookup(set, None);
            }
            Match::AddressPairInSet(set) => {
                let after_source = concat_register(self.family.address_words());
                self.load_address(NFT_REG_1, self.family.saddr_offset);
                self.load_address(after_source, self.family.daddr_offset);
                self.lookup(set, None);
            }
            Match::InputInterface {
                name,
                prefix,
                negated,
            } => {
                // As nft writes it: the whole name NUL-padded to IFNAMSIZ, or for a
                // wildcard just the prefix's bytes (a shorter compare).
                self.meta_load(NFT_META_IIFNAME, NFT_REG_1);
                let mut value = name.as_bytes().to_vec();
                if !*prefix {
                    value.resize(IFNAMSIZ, 0);
                }
                let op = if *negated { NFT_CMP_NEQ } else { NFT_CMP_EQ };
                self.cmp(op, &value);
            }
        }
    }

    /// `ct KEY BIT`: a bit of the connection's state or status is set.
    fn ct_bit(&mut self, key: u32, bit: u32) {
        self.expr("ct", |w| {
            w.u32(NFTA_CT_KEY, key);
            w.u32(NFTA_CT_DREG, NFT_REG_1);
        });
        self.bitwise(&bit.to_ne_bytes(), &[0; 4], false);
        self.cmp(NFT_CMP_NEQ, &[0; 4]);
    }

    fn fib_local(&mut self, flags: u32) {
        self.expr("fib", |w| {
            w.u32(NFTA_FIB_FLAGS, flags);
            w.u32(NFTA_FIB_RESULT, NFT_FIB_RESULT_ADDRTYPE);
            w.u32(NFTA_FIB_DREG, NFT_REG_1);
        });
        self.cmp(NFT_CMP_EQ, &RTN_LOCAL.to_ne_bytes());
    }

    fn statement(&mut self, s: &Statement) {
        match s {
            Statement::Jump(chain) => self.immediate_verdict(NFT_JUMP, Some(chain)),
            Statement::Goto(chain) => self.immediate_verdict(NFT_GOTO, Some(chain)),
            Statement::Return => self.immediate_verdict(NFT_RETURN, None),
            Statement::Accept => self.immediate_verdict(NF_ACCEPT, None),
            Statement::Drop => self.immediate_verdict(NF_DROP, None),
            Statement::Reject => {
                let code = self.family.port_unreachable;
                self.expr("reject", |w| {
                    w.u32(NFTA_REJECT_TYPE, NFT_REJECT_ICMP_UNREACH);
                    w.attr(NFTA_REJECT_ICMP_CODE, &[code]);
                })
            }
            Statement::Dispatch { key, map } => {
                // The first field goes to register 1, the next ones to the registers
                // after it, as nft lays out a concatenation.
                let port_reg = match key {
                    DispatchKey::AddressProtocolPort => {
                        let words = self.family.address_words();
                        self.load_address(NFT_REG_1, self.family.daddr_offset);
                        self.meta_load(NFT_META_L4PROTO, concat_register(words));
                        concat_register(words + 1)
                    }
                    DispatchKey::ProtocolPort => {
                        self.meta_load(NFT_META_L4PROTO, NFT_REG_1);
                        concat_register(1)
                    }
                };
                self.payload(
                    port_reg,
                    NFT_PAYLOAD_TRANSPORT_HEADER,
                    TRANSPORT_DPORT_OFFSET,
                    2,
                );
                self.lookup(map, Some(NFT_REG_VERDICT));
            }
            Statement::RandomDispatch { modulus, map } => {
                self.numgen_random(*modulus, 0);
                self.lookup(map, Some(NFT_REG_VERDICT));
            }
            Statement::RandomDnat { map, offset } => {
                self.numgen_random(BUCKETS, *offset);
                self.expr("byteorder", |w| {
                    w.u32(NFTA_BYTEORDER_SREG, NFT_REG_1);
                    w.u32(NFTA_BYTEORDER_DREG, NFT_REG_1);
                    w.u32(NFTA_BYTEORDER_OP, NFT_BYTEORDER_HTON);
                    w.u32(NFTA_BYTEORDER_LEN, 4);
                    w.u32(NFTA_BYTEORDER_SIZE, 4);
                });
                // The endpoint's address lands in register 1, its port in the register
                // after it; nat sets "port given" itself when it has a port.
                self.lookup(map, Some(NFT_REG_1));
                let (nfproto, port_reg) = (
                    self.family.nfproto,
                    concat_register(self.family.address_words()),
                );
                self.expr("nat", |w| {
                    w.u32(NFTA_NAT_TYPE, NFT_NAT_DNAT);
                    w.u32(NFTA_NAT_FAMILY, u32::from(nfproto));
                    w.u32(NFTA_NAT_REG_ADDR_MIN, NFT_REG_1);
                    w.u32(NFTA_NAT_REG_PROTO_MIN, port_reg);
                });
            }
            Statement::SetMark(bit) => {
                self.mark_bitwise(!*bit, *bit);
                self.meta_set_mark();
            }
            Statement::ToggleMark(bit) => {
                self.mark_bitwise(u32::MAX, *bit);
                self.meta_set_mark();
            }
            Statement::Masquerade => self.expr("masq", |w| {
                w.u32(NFTA_MASQ_FLAGS, NF_NAT_RANGE_PROTO_RANDOM_FULLY)
            }),
            Statement::Dnat(to) => self.dnat(to),
            Statement::AddSourceToSet(set) => {
                let id = self.set_ids.get(set).copied();
                self.load_address(NFT_REG_1, self.family.saddr_offset);
                self.expr("dynset", |w| {
                    w.u32(NFTA_DYNSET_SREG_KEY, NFT_REG_1);
                    w.u32(NFTA_DYNSET_OP, NFT_DYNSET_OP_UPDATE);
                    w.string(NFTA_DYNSET_SET_NAME, set);
                    if let Some(id) = id {
                        w.u32(NFTA_DYNSET_SET_ID, id);
                    }
                });
            }
        }
    }

    fn numgen_random(&mut self, modulus: u32, offset: u32) {
        self.expr("numgen", |w| {
            w.u32(NFTA_NG_DREG, NFT_REG_1);
            w.u32(NFTA_NG_MODULUS, modulus);
            w.u32(NFTA_NG_TYPE, NFT_NG_RANDOM);
            w.u32(NFTA_NG_OFFSET, offset);
        });
    }

    fn meta_set_mark(&mut self) {
        self.expr("meta", |w| {
            w.u32(NFTA_META_KEY, NFT_META_MARK);
            w.u32(NFTA_META_SREG, NFT_REG_1);
        });
    }

    fn dnat(&mut self, to: &SocketAddr) {
        self.immediate_data(NFT_REG_1, &octets(&to.ip()));
        self.immediate_data(NFT_REG_2, &to.port().to_be_bytes());
        let nfproto = self.family.nfproto;
        self.expr("nat", |w| {
            w.u32(NFTA_NAT_TYPE, NFT_NAT_DNAT);
            w.u32(NFTA_NAT_FAMILY, u32::from(nfproto));
            w.u32(NFTA_NAT_REG_ADDR_MIN, NFT_REG_1);
            w.u32(NFTA_NAT_REG_PROTO_MIN, NFT_REG_2);
            w.u32(NFTA_NAT_FLAGS, NF_NAT_RANGE_PROTO_SPECIFIED);
        });
    }
}
