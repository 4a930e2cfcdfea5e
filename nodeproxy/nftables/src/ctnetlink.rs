//! The kernel's connection tracking table over ctnetlink, the conntrack subsystem of
//! `NETLINK_NETFILTER` (what the `conntrack` tool speaks): list the entries of one family
//! and protocol, and delete one entry by its original tuple. Blocking, as [`crate::kernel`];
//! it shares that module's framing and the [`encode`](crate::encode) attribute writer.
//!
//! Constants are those of `linux/netfilter/nfnetlink_conntrack.h`. Addresses and ports
//! are in network order; `CTA_FILTER`'s flags, as every `NLA_U32` there, in host order.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_NETFILTER};
use tandem_common::IpFamily;

use crate::digest::attributes;
use crate::encode::Writer;
use crate::kernel::{self, NFGENMSG_LEN, NLMSG_HEADER_LEN, error_answer, read_u16, read_u32};

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_DUMP_INTR: u16 = 0x10;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const ENOENT: i32 = 2;
const EINVAL: i32 = 22;
const EOPNOTSUPP: i32 = 95;

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;

// `enum ctattr_type`.
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
const CTA_ID: u16 = 12;
const CTA_ZONE: u16 = 18;
const CTA_FILTER: u16 = 25;
const CTA_STATUS_MASK: u16 = 26;
// `enum ctattr_tuple`, `enum ctattr_ip`, `enum ctattr_l4proto`.
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
// `enum ctattr_filter` and its flags.
const CTA_FILTER_ORIG_FLAGS: u16 = 1;
const CTA_FILTER_FLAG_CTA_PROTO_NUM: u32 = 1 << 3;

/// Room for one datagram of a dump (the kernel fills at most 32 KiB per read).
const DUMP_BUFFER_BYTES: usize = 256 << 10;

/// The IP protocol number of UDP.
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_TCP: u8 = 6;

/// An entry's status bit set once a packet came back the reply way (`IPS_SEEN_REPLY`).
const IPS_SEEN_REPLY: u32 = 1 << 1;

#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error("opening the conntrack netlink socket: {0}")]
    Open(#[source] io::Error),
    #[error("sending a conntrack request: {0}")]
    Send(#[source] io::Error),
    #[error("reading the kernel's conntrack answer: {0}")]
    Receive(#[source] io::Error),
    #[error("the kernel's conntrack answer is malformed: {0}")]
    Malformed(&'static str),
    #[error("listing the {family} conntrack entries: {errno}")]
    List { family: IpFamily, errno: io::Error },
    #[error("deleting the conntrack entry {flow}: {errno}")]
    Delete { flow: String, errno: io::Error },
}

/// The shared framing helpers fail only on truncated messages.
impl From<crate::kernel::KernelError> for ConntrackError {
    fn from(error: crate::kernel::KernelError) -> Self {
        match error {
            crate::kernel::KernelError::Malformed(what) => Self::Malformed(what),
            _ => Self::Malformed("unreadable"),
        }
    }
}

/// One direction of an entry: where its packets come from and go to (ports 0 for
/// protocols without ports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tuple {
    pub source: SocketAddr,
    pub destination: SocketAddr,
}

/// A conntrack entry: its original tuple (as the first packet was sent), its reply tuple
/// (as answers come back: a DNATed entry's reply source is the endpoint), its zone and
/// the kernel's id of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Flow {
    pub protocol: u8,
    pub original: Tuple,
    pub reply: Tuple,
    pub zone: u16,
    /// Sent back with a deletion, so that only this very entry goes (not one made
    /// afterwards with the same tuple).
    pub id: Option<u32>,
    /// The kernel's status bits (`IPS_*`).
    pub status: u32,
}

impl Flow {
    /// Whether a packet ever came back the reply way.
    pub fn replied(&self) -> bool {
        self.status & IPS_SEEN_REPLY != 0
    }
}

impl std::fmt::Display for Flow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "proto {} {} -> {} (reply {} -> {})",
            self.protocol,
            self.original.source,
            self.original.destination,
            self.reply.source,
            self.reply.destination
        )
    }
}

/// The entries of one family and protocol.
#[derive(Debug, Default)]
pub struct Listing {
    pub flows: Vec<Flow>,
    /// The table changed during the dump: some entries may be missing or repeated.
    pub interrupted: bool,
}

/// A ctnetlink socket in the network namespace it was opened in.
pub struct Conntrack {
    socket: Socket,
    next_seq: u32,
    /// False once the kernel refused `CTA_FILTER` (before 5.8): the protocol is then
    /// filtered here only.
    kernel_filter: bool,
}

impl Conntrack {
    /// Opens the socket in the calling thread's network namespace.
    pub fn open() -> Result<Self, ConntrackError> {
        let mut socket = Socket::new(NETLINK_NETFILTER).map_err(ConntrackError::Open)?;
        socket.bind_auto().map_err(ConntrackError::Open)?;
        socket
            .connect(&NetlinkAddr::new(0, 0))
            .map_err(ConntrackError::Open)?;
        socket.set_ext_ack(true).map_err(ConntrackError::Open)?;
        socket.set_cap_ack(true).map_err(ConntrackError::Open)?;
        let next_seq = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|elapsed| elapsed.as_secs() as u32)
            .unwrap_or(1);
        Ok(Self {
            socket,
            next_seq,
            kernel_filter: true,
        })
    }

    /// Every entry of `family` and `protocol`: the kernel filters by family, and by
    /// protocol where it knows `CTA_FILTER` (from 5.8; a kernel that refuses it is asked
    /// again without, and the protocol is filtered here).
    pub fn list(&mut self, family: IpFamily, protocol: u8) -> Result<Listing, ConntrackError> {
        self.list_where(family, protocol, false)
    }

    /// The entries of `family` and `protocol` that nothing ever answered: as [`Self::list`],
    /// and the kernel also leaves out the answered ones where it filters by status
    /// (`CTA_STATUS_MASK`, in Linux 6.1 already; an older kernel ignores the filter, and
    /// they are left out here).
    pub fn list_unreplied(
        &mut self,
        family: IpFamily,
        protocol: u8,
    ) -> Result<Listing, ConntrackError> {
        self.list_where(family, protocol, true)
    }

    fn list_where(
        &mut self,
        family: IpFamily,
        protocol: u8,
        unreplied: bool,
    ) -> Result<Listing, ConntrackError> {
        if self.kernel_filter {
            match self.dump(family, Some(protocol), unreplied) {
                Err(ConntrackError::List { errno, .. })
                    if matches!(errno.raw_os_error(), Some(EINVAL | EOPNOTSUPP)) =>
                {
                    self.kernel_filter = false;
                }
                listed => return listed,
            }
        }
        self.dump(family, None, unreplied).map(|mut listing| {
            listing.flows.retain(|flow| flow.protocol == protocol);
            listing
        })
    }

    fn dump(
        &mut self,
        family: IpFamily,
        protocol: Option<u8>,
        unreplied: bool,
    ) -> Result<Listing, ConntrackError> {
        let seq = self.take_seq();
        let request = dump_request(seq, family, protocol, unreplied);
        self.socket
            .send(&request, 0)
            .map_err(ConntrackError::Send)?;
        let mut listing = Listing::default();
        let mut buf: Vec<u8> = Vec::with_capacity(DUMP_BUFFER_BYTES);
        loop {
            buf.clear();
            self.socket
                .recv(&mut buf, 0)
                .map_err(ConntrackError::Receive)?;
            for (message, kind, flags) in messages(&buf, seq)? {
                listing.interrupted |= flags & NLM_F_DUMP_INTR != 0;
                match kind {
                    NLMSG_DONE => return Ok(listing),
                    NLMSG_ERROR => {
                        let answer = error_answer(message, flags)?;
                        return Err(ConntrackError::List {
                            family,
                            errno: io::Error::from_raw_os_error(answer.errno),
                        });
                    }
                    _ => {
                        let flow = parse_flow(message)?;
                        if let Some(flow) = flow.filter(|flow| {
                            IpFamily::of(flow.original.destination.ip()) == family
                                && protocol.is_none_or(|p| p == flow.protocol)
                                && !(unreplied && flow.replied())
                        }) {
                            listing.flows.push(flow);
                        }
                    }
                }
            }
        }
    }

    /// Deletes `flow` (matched by its original tuple, zone and id). Returns false when
    /// the kernel has no such entry any more (it expired, or was deleted meanwhile).
    pub fn delete(&mut self, flow: &Flow) -> Result<bool, ConntrackError> {
        let seq = self.take_seq();
        let request = delete_request(seq, flow);
        self.socket
            .send(&request, 0)
            .map_err(ConntrackError::Send)?;
        let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
        loop {
            buf.clear();
            self.socket
                .recv(&mut buf, 0)
                .map_err(ConntrackError::Receive)?;
            for (message, kind, flags) in messages(&buf, seq)? {
                if kind != NLMSG_ERROR {
                    continue;
                }
                return match error_answer(message, flags)?.errno {
                    0 => Ok(true),
                    ENOENT => Ok(false),
                    errno => Err(ConntrackError::Delete {
                        flow: flow.to_string(),
                        errno: io::Error::from_raw_os_error(errno),
                    }),
                };
            }
        }
    }

    fn take_seq(&mut self) -> u32 {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        seq
    }
}

fn nfproto(family: IpFamily) -> u8 {
    match family {
        IpFamily::V4 => AF_INET,
        IpFamily::V6 => AF_INET6,
    }
}

/// `IPCTNL_MSG_CT_GET` with `NLM_F_DUMP` for `family`, narrowed to `protocol` by
/// `CTA_FILTER` (the protocol number goes in an original tuple without addresses), and
/// with `unreplied` to the entries without `IPS_SEEN_REPLY` (`CTA_STATUS` under
/// `CTA_STATUS_MASK`).
fn dump_request(seq: u32, family: IpFamily, protocol: Option<u8>, unreplied: bool) -> Vec<u8> {
    let mut w = Writer::default();
    w.message(
        (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        nfproto(family),
        0,
        |w| {
            if let Some(protocol) = protocol {
                w.nest(CTA_TUPLE_ORIG, |w| {
                    w.nest(CTA_TUPLE_PROTO, |w| w.attr(CTA_PROTO_NUM, &[protocol]));
                });
                w.nest(CTA_FILTER, |w| {
                    w.attr(
                        CTA_FILTER_ORIG_FLAGS,
                        &CTA_FILTER_FLAG_CTA_PROTO_NUM.to_ne_bytes(),
                    );
                });
            }
            if unreplied {
                w.attr(CTA_STATUS, &0u32.to_be_bytes());
                w.attr(CTA_STATUS_MASK, &IPS_SEEN_REPLY.to_be_bytes());
            }
        },
    );
    w.buf
}

/// `IPCTNL_MSG_CT_DELETE` of one entry. It always carries the original tuple: a delete
/// without one flushes the whole table.
fn delete_request(seq: u32, flow: &Flow) -> Vec<u8> {
    let mut w = Writer::default();
    w.message(
        (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        nfproto(IpFamily::of(flow.original.destination.ip())),
        0,
        |w| {
            w.nest(CTA_TUPLE_ORIG, |w| tuple(w, flow.protocol, &flow.original));
            if flow.zone != 0 {
                w.attr(CTA_ZONE, &flow.zone.to_be_bytes());
            }
            if let Some(id) = flow.id {
                w.attr(CTA_ID, &id.to_be_bytes());
            }
        },
    );
    w.buf
}

fn tuple(w: &mut Writer, protocol: u8, tuple: &Tuple) {
    w.nest(CTA_TUPLE_IP, |w| {
        match (tuple.source.ip(), tuple.destination.ip()) {
            (IpAddr::V4(source), IpAddr::V4(destination)) => {
                w.attr(CTA_IP_V4_SRC, &source.octets());
                w.attr(CTA_IP_V4_DST, &destination.octets());
            }
            (source, destination) => {
                w.attr(CTA_IP_V6_SRC, &v6(source).octets());
                w.attr(CTA_IP_V6_DST, &v6(destination).octets());
            }
        }
    });
    w.nest(CTA_TUPLE_PROTO, |w| {
        w.attr(CTA_PROTO_NUM, &[protocol]);
        w.attr(CTA_PROTO_SRC_PORT, &tuple.source.port().to_be_bytes());
        w.attr(CTA_PROTO_DST_PORT, &tuple.destination.port().to_be_bytes());
    });
}

fn v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(ip) => ip.to_ipv6_mapped(),
        IpAddr::V6(ip) => ip,
    }
}

/// One message of an answer: the whole message, its type and its flags.
type Message<'a> = (&'a [u8], u16, u16);

/// The messages of one datagram answering request `seq`.
fn messages(buf: &[u8], seq: u32) -> Result<Vec<Message<'_>>, ConntrackError> {
    let mut found = Vec::new();
    for message in kernel::messages(buf)? {
        // Answers to an earlier request that was given up.
        if read_u32(message, 8)? != seq {
            continue;
        }
        found.push((message, read_u16(message, 4)?, read_u16(message, 6)?));
    }
    Ok(found)
}

/// One entry of a dump (`None`: without both tuples, which the kernel always sends).
fn parse_flow(message: &[u8]) -> Result<Option<Flow>, ConntrackError> {
    let body = message
        .get(NLMSG_HEADER_LEN + NFGENMSG_LEN..)
        .ok_or(ConntrackError::Malformed("short message"))?;
    let (mut original, mut reply, mut zone, mut id, mut status) = (None, None, 0, None, 0);
    for (kind, value) in attributes(body) {
        match kind {
            CTA_TUPLE_ORIG => original = parse_tuple(value),
            CTA_TUPLE_REPLY => reply = parse_tuple(value),
            CTA_STATUS => status = value.try_into().map_or(0, u32::from_be_bytes),
            CTA_ZONE => zone = be_u16(value).unwrap_or(0),
            CTA_ID => id = value.try_into().ok().map(u32::from_be_bytes),
            _ => {}
        }
    }
    Ok(original
        .zip(reply)
        .map(|((protocol, original), (_, reply))| Flow {
            protocol,
            original,
            reply,
            zone,
            id,
            status,
        }))
}

fn be_u16(value: &[u8]) -> Option<u16> {
    value.try_into().ok().map(u16::from_be_bytes)
}

/// A `CTA_TUPLE_*` nest: its protocol number and addresses.
fn parse_tuple(bytes: &[u8]) -> Option<(u8, Tuple)> {
    let (mut source, mut destination) = (None, None);
    let (mut protocol, mut source_port, mut destination_port) = (None, 0, 0);
    for (kind, value) in attributes(bytes) {
        match kind {
            CTA_TUPLE_IP => {
                for (kind, value) in attributes(value) {
                    let ip = match value.len() {
                        4 => <[u8; 4]>::try_from(value).map(|o| IpAddr::from(Ipv4Addr::from(o))),
                        _ => <[u8; 16]>::try_from(value).map(|o| IpAddr::from(Ipv6Addr::from(o))),
                    };
                    match kind {
                        CTA_IP_V4_SRC | CTA_IP_V6_SRC => source = ip.ok(),
                        CTA_IP_V4_DST | CTA_IP_V6_DST => destination = ip.ok(),
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (kind, value) in attributes(value) {
                    match kind {
                        CTA_PROTO_NUM => protocol = value.first().copied(),
                        CTA_PROTO_SRC_PORT => source_port = be_u16(value).unwrap_or(0),
                        CTA_PROTO_DST_PORT => destination_port = be_u16(value).unwrap_or(0),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some((
        protocol?,
        Tuple {
            source: SocketAddr::new(source?, source_port),
            destination: SocketAddr::new(destination?, destination_port),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(orig: (&str, &str), reply: (&str, &str)) -> Flow {
        Flow {
            protocol: IPPROTO_UDP,
            original: Tuple {
                source: orig.0.parse().unwrap(),
                destination: orig.1.parse().unwrap(),
            },
            reply: Tuple {
                source: reply.0.parse().unwrap(),
                destination: reply.1.parse().unwrap(),
            },
            zone: 0,
            id: Some(0xdead_beef),
            status: 0,
        }
    }

    /// An entry as the kernel dumps it: both tuples (and the id) after the headers.
    fn dump_message(flow: &Flow, seq: u32) -> Vec<u8> {
        let mut w = Writer::default();
        w.message(
            NFNL_SUBSYS_CTNETLINK << 8, // IPCTNL_MSG_CT_NEW
            0x2,                        // NLM_F_MULTI
            seq,
            AF_INET,
            0,
            |w| {
                w.nest(CTA_TUPLE_ORIG, |w| tuple(w, flow.protocol, &flow.original));
                w.nest(CTA_TUPLE_REPLY, |w| tuple(w, flow.protocol, &flow.reply));
                w.attr(CTA_STATUS, &flow.status.to_be_bytes());
                w.attr(CTA_ID, &flow.id.unwrap().to_be_bytes());
                if flow.zone != 0 {
                    w.attr(CTA_ZONE, &flow.zone.to_be_bytes());
                }
            },
        );
        w.buf
    }

    #[test]
    fn a_dumped_entry_parses_back_to_its_tuples() {
        for flow in [
            flow(
                ("10.244.0.9:4000", "10.96.0.10:53"),
                ("10.244.1.5:5353", "10.244.0.9:4000"),
            ),
            Flow {
                zone: 7,
                // IPS_SEEN_REPLY, IPS_ASSURED, IPS_CONFIRMED, IPS_DST_NAT_DONE.
                status: 0x10e,
                ..flow(
                    ("[fd00::9]:4000", "[fd00:96::10]:53"),
                    ("[fd00:244::5]:5353", "[fd00::9]:4000"),
                )
            },
        ] {
            let mut datagram = dump_message(&flow, 9);
            // An answer to an earlier request is skipped.
            datagram.extend(dump_message(&flow, 8));
            let found = messages(&datagram, 9).unwrap();
            assert_eq!(found.len(), 1);
            assert_eq!(parse_flow(found[0].0).unwrap(), Some(flow));
        }
    }

    #[test]
    fn a_deletion_names_the_original_tuple_zone_and_id() {
        let flow = Flow {
            zone: 3,
            ..flow(
                ("10.244.0.9:4000", "10.96.0.10:53"),
                ("10.244.1.5:5353", "10.244.0.9:4000"),
            )
        };
        let request = delete_request(5, &flow);
        assert_eq!(read_u16(&request, 4).unwrap(), 0x0102);
        assert_eq!(read_u16(&request, 6).unwrap(), NLM_F_REQUEST | NLM_F_ACK);
        assert_eq!(request[NLMSG_HEADER_LEN], AF_INET);
        let attrs: Vec<(u16, &[u8])> =
            attributes(&request[NLMSG_HEADER_LEN + NFGENMSG_LEN..]).collect();
        let kinds: Vec<u16> = attrs.iter().map(|(kind, _)| *kind).collect();
        // Never without the original tuple: that would flush the table.
        assert_eq!(kinds, [CTA_TUPLE_ORIG, CTA_ZONE, CTA_ID]);
        assert_eq!(parse_tuple(attrs[0].1), Some((IPPROTO_UDP, flow.original)));
        assert_eq!(attrs[1].1, &3u16.to_be_bytes());
        assert_eq!(attrs[2].1, &0xdead_beefu32.to_be_bytes());
    }

    #[test]
    fn a_dump_request_filters_by_family_and_protocol() {
        let request = dump_request(1, IpFamily::V6, Some(IPPROTO_UDP), false);
        assert_eq!(read_u16(&request, 6).unwrap(), NLM_F_REQUEST | NLM_F_DUMP);
        assert_eq!(request[NLMSG_HEADER_LEN], AF_INET6);
        let attrs: Vec<(u16, &[u8])> =
            attributes(&request[NLMSG_HEADER_LEN + NFGENMSG_LEN..]).collect();
        assert_eq!(attrs.len(), 2);
        assert_eq!(attrs[1].0, CTA_FILTER);
        assert_eq!(
            attributes(attrs[1].1).collect::<Vec<_>>(),
            [(CTA_FILTER_ORIG_FLAGS, &8u32.to_ne_bytes()[..])]
        );
        let unfiltered = dump_request(1, IpFamily::V4, None, false);
        assert_eq!(unfiltered.len(), NLMSG_HEADER_LEN + NFGENMSG_LEN);
    }

    #[test]
    fn an_unreplied_dump_asks_for_entries_without_seen_reply() {
        let request = dump_request(1, IpFamily::V4, Some(IPPROTO_TCP), true);
        let attrs: Vec<(u16, &[u8])> =
            attributes(&request[NLMSG_HEADER_LEN + NFGENMSG_LEN..]).collect();
        let kinds: Vec<u16> = attrs.iter().map(|(kind, _)| *kind).collect();
        assert_eq!(
            kinds,
            [CTA_TUPLE_ORIG, CTA_FILTER, CTA_STATUS, CTA_STATUS_MASK]
        );
        assert_eq!(attrs[2].1, &0u32.to_be_bytes());
        assert_eq!(attrs[3].1, &2u32.to_be_bytes());
    }

    #[test]
    fn replied_reads_the_seen_reply_bit() {
        let unanswered = flow(("10.0.0.1:1", "10.0.0.2:2"), ("10.0.0.2:2", "10.0.0.1:1"));
        assert!(!unanswered.replied());
        assert!(
            Flow {
                status: IPS_SEEN_REPLY,
                ..unanswered
            }
            .replied()
        );
    }
}
