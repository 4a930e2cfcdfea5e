//! Sends [`Transaction`]s to the kernel over a `NETLINK_NETFILTER` socket: one batch,
//! one send, then the kernel's answers. Blocking; callers on an async runtime use
//! `spawn_blocking`.
//!
//! The kernel processes a batch inside the send call and aborts all of it when any
//! message fails, so a rejected transaction leaves the previous ruleset in place. No
//! message asks an ACK: the kernel answers every failing message (and a failed commit,
//! against the batch begin) whether asked or not, and has queued those answers before
//! the send returns, so an empty answer queue means committed, as `nft` relies on too.
//! (An ACK of the batch end would confirm it only on kernels from 6.10 on.)

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd};

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};
use nix::sys::socket::{MsgFlags, NetlinkAddr, sendmsg, setsockopt, sockopt};
use tandem_common::IpFamily;

use crate::digest::{self, ChainDigest, SetDigest, TableDigest};
use crate::encode::{self, Batch, EncodeError};
use crate::render;
use crate::transaction::{Op, Transaction};

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// The answer to a dump of a table that does not exist.
const ENOENT: i32 = 2;
/// Set on the messages of a dump during which the ruleset changed.
const NLM_F_DUMP_INTR: u16 = 0x10;
/// The nfgenmsg header after each netlink header.
pub(crate) const NFGENMSG_LEN: usize = 4;
/// How often a dump the ruleset changed under is tried again before giving up.
const DUMP_ATTEMPTS: usize = 3;
// Attributes of dump requests.
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_GEN_ID: u16 = 1;
const NLM_F_CAPPED: u16 = 0x100;
const NLM_F_ACK_TLVS: u16 = 0x200;
const NLMSGERR_ATTR_MSG: u16 = 1;
pub(crate) const NLMSG_HEADER_LEN: usize = 16;

/// Room for the kernel's answers: a few bytes per error (the request is not echoed).
const RECEIVE_BUFFER_BYTES: usize = 4 << 20;
/// Headroom above the batch size for the send buffer (the kernel wants a little more
/// than the message itself).
const SEND_BUFFER_HEADROOM: usize = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("opening the nftables netlink socket: {0}")]
    Open(#[source] io::Error),
    #[error(transparent)]
    Encode(#[from] EncodeError),
    #[error("sizing the netlink socket buffers to {bytes} bytes: {source}")]
    Buffer {
        bytes: usize,
        #[source]
        source: nix::Error,
    },
    #[error("sending a batch of {bytes} bytes: {source}")]
    Send {
        bytes: usize,
        #[source]
        source: io::Error,
    },
    #[error("reading the kernel's answer: {0}")]
    Receive(#[source] io::Error),
    #[error("the kernel's answer is malformed: {0}")]
    Malformed(&'static str),
    /// A message of the batch failed; the whole transaction was aborted.
    #[error("operation {index} `{operation}` rejected: {errno}{}", detail(.message))]
    Rejected {
        index: usize,
        operation: String,
        errno: io::Error,
        message: Option<String>,
    },
    /// Every message was accepted but the commit failed (e.g. chain validation);
    /// nothing changed.
    #[error("the transaction failed to commit: {errno}{}", detail(.message))]
    Commit {
        errno: io::Error,
        message: Option<String>,
    },
    #[error("listing {what}: {errno}")]
    Dump { what: String, errno: io::Error },
    /// The ruleset kept changing while it was listed.
    #[error("listing {what}: the ruleset changed {DUMP_ATTEMPTS} times while it was read")]
    Interrupted { what: String },
}

impl KernelError {
    /// A rejection of [`Netlink::send_batch`] with its operation named: `op_at` gives the
    /// operation of an index (of the family `family`).
    pub fn naming_operation(
        self,
        op_at: impl FnOnce(usize) -> Option<Op>,
        family: IpFamily,
    ) -> Self {
        match self {
            KernelError::Rejected {
                index,
                errno,
                message,
                ..
            } => KernelError::Rejected {
                index,
                operation: op_at(index)
                    .map(|op| render::operation(&op, family))
                    .unwrap_or_default(),
                errno,
                message,
            },
            other => other,
        }
    }
}

fn detail(message: &Option<String>) -> String {
    message
        .as_deref()
        .map(|m| format!(" ({m})"))
        .unwrap_or_default()
}

/// A netlink socket to nf_tables in the network namespace it was opened in.
pub struct Netlink {
    socket: Socket,
    next_seq: u32,
    send_buffer: usize,
    /// The family of the tables it reads: `ip`, or `ip6` for IPv6 (ours or iptables-nft's).
    read_family: IpFamily,
}

impl Netlink {
    /// Reads tables of `family` from now on (`ip6 tandem` or `ip6 nat` rather than `ip …`).
    pub fn reading(mut self, family: IpFamily) -> Self {
        self.read_family = family;
        self
    }

    /// Opens the socket in the calling thread's network namespace.
    pub fn open() -> Result<Self, KernelError> {
        let mut socket = Socket::new(NETLINK_NETFILTER).map_err(KernelError::Open)?;
        socket.bind_auto().map_err(KernelError::Open)?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .map_err(KernelError::Open)?;
        // Errors come back with the kernel's reason and without the request echoed.
        socket.set_ext_ack(true).map_err(KernelError::Open)?;
        socket.set_cap_ack(true).map_err(KernelError::Open)?;
        setsockopt(&socket.as_fd(), sockopt::RcvBufForce, &RECEIVE_BUFFER_BYTES).map_err(
            |source| KernelError::Buffer {
                bytes: RECEIVE_BUFFER_BYTES,
                source,
            },
        )?;
        // Start numbering somewhere unlikely to match answers a previous owner of the
        // port id left behind.
        let next_seq = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|elapsed| elapsed.as_secs() as u32)
            .unwrap_or(1);
        Ok(Self {
            socket,
            next_seq,
            send_buffer: 0,
            read_family: IpFamily::V4,
        })
    }

    /// The socket's netlink port, which the kernel's announcements of its changes carry
    /// ([`crate::monitor`]).
    pub fn port(&self) -> io::Result<u32> {
        let mut address = SocketAddr::new(0, 0);
        self.socket.get_address(&mut address)?;
        Ok(address.port_number())
    }

    /// Applies `tx` atomically: all of it, or (on error) none of it.
    pub fn apply(&mut self, tx: &Transaction) -> Result<(), KernelError> {
        if tx.is_empty() {
            return Ok(());
        }
        let batch = self.encode(tx)?;
        self.send(tx, &batch)
    }

    /// Encodes `tx` as the next batch of this socket.
    pub fn encode(&self, tx: &Transaction) -> Result<Batch, KernelError> {
        Ok(encode::batch(tx, self.next_seq)?)
    }

    /// Encodes the operations `ops` on our table of `family` as the next batch of this
    /// socket, each as it comes ([`encode::batch_of`]).
    pub fn encode_ops<O: Borrow<Op>>(
        &self,
        family: IpFamily,
        ops: impl IntoIterator<Item = O>,
    ) -> Result<Batch, KernelError> {
        Ok(encode::batch_of(family, ops, self.next_seq)?)
    }

    /// Sends `batch`, encoded from `tx`, and reads the outcome: the kernel's part of
    /// [`Netlink::apply`] (apart so that the benchmark can time it alone, and send the same
    /// bytes again).
    pub fn send(&mut self, tx: &Transaction, batch: &Batch) -> Result<(), KernelError> {
        self.send_batch(batch)
            .map_err(|error| error.naming_operation(|index| tx.ops.get(index).cloned(), tx.family))
    }

    /// [`Netlink::send`] for a batch whose operations are not kept
    /// ([`Netlink::encode_ops`]): a rejected operation is known by its index alone, with
    /// an empty `operation` for the caller to fill in ([`KernelError::naming_operation`]).
    pub fn send_batch(&mut self, batch: &Batch) -> Result<(), KernelError> {
        self.next_seq = batch.end_seq().wrapping_add(1);
        let bytes = batch.byte_len();
        self.ensure_send_buffer(bytes)?;
        // One sendmsg: the kernel takes a batch as one buffer, whatever the iovecs.
        let iov: Vec<IoSlice<'_>> = batch.chunks().iter().map(|c| IoSlice::new(c)).collect();
        let sent =
            sendmsg::<NetlinkAddr>(self.socket.as_raw_fd(), &iov, &[], MsgFlags::empty(), None)
                .map_err(|errno| KernelError::Send {
                    bytes,
                    source: errno.into(),
                })?;
        if sent != bytes {
            return Err(KernelError::Send {
                bytes,
                source: io::Error::new(io::ErrorKind::WriteZero, format!("sent {sent} bytes")),
            });
        }
        self.await_outcome(batch)
    }

    /// A single send needs the whole batch to fit the socket's send buffer.
    fn ensure_send_buffer(&mut self, batch_bytes: usize) -> Result<(), KernelError> {
        let wanted = batch_bytes + SEND_BUFFER_HEADROOM;
        if wanted > self.send_buffer {
            setsockopt(&self.socket.as_fd(), sockopt::SndBufForce, &wanted).map_err(|source| {
                KernelError::Buffer {
                    bytes: wanted,
                    source,
                }
            })?;
            self.send_buffer = wanted;
        }
        Ok(())
    }

    /// Reads the kernel's answers, all queued before the send returned, without
    /// blocking: none means committed; otherwise the first error says why not.
    fn await_outcome(&self, batch: &Batch) -> Result<(), KernelError> {
        let mut first_error: Option<KernelError> = None;
        let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
        loop {
            buf.clear();
            match self.socket.recv(&mut buf, MsgFlags::MSG_DONTWAIT.bits()) {
                Ok(_) => {}
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
                Err(err) => return Err(first_error.unwrap_or(KernelError::Receive(err))),
            }
            for answer in answers(&buf)? {
                if answer.errno == 0 || first_error.is_some() {
                    continue;
                }
                let errno = io::Error::from_raw_os_error(answer.errno);
                first_error = Some(match batch.op_index(answer.seq) {
                    Some(index) => KernelError::Rejected {
                        index,
                        operation: String::new(),
                        errno,
                        message: answer.message,
                    },
                    None => KernelError::Commit {
                        errno,
                        message: answer.message,
                    },
                });
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Netlink {
    /// What table `TABLE` of the read family holds (`ip tandem`, or one of iptables-nft's
    /// tables such as `ip nat` or `ip6 nat`), as digests; an absent table reads as empty. With `elements`, also its
    /// sets' elements (not those packets fill). A dump that the ruleset changed under is
    /// read again, a few times.
    pub fn read_table(&mut self, table: &str, elements: bool) -> Result<TableDigest, KernelError> {
        match self.read_existing_table(table, elements) {
            Err(error) if is_absent(&error) => Ok(TableDigest::default()),
            read => read,
        }
    }

    fn read_existing_table(
        &mut self,
        table: &str,
        elements: bool,
    ) -> Result<TableDigest, KernelError> {
        let chains = self.read_chains(table)?;
        // One dump per chain: the kernel resumes a dump of a whole table by walking it
        // from the start again, so that dump costs the square of the rules (7 s for the
        // 100,000 rules of 2,700 iptables-nft Services, against 0.7 s chain by chain).
        let rules = self.read_rules(table, chains.keys().map(String::as_str))?;
        let mut digest = TableDigest::default();
        for ((name, declaration), (_, rules)) in chains.iter().zip(rules) {
            digest.chains.insert(
                name.clone(),
                ChainDigest {
                    declaration: *declaration,
                    rules,
                },
            );
        }
        let mut sets = Vec::new();
        self.dump_retried(
            encode::NFT_MSG_GETSET,
            table,
            |w| w.string(NFTA_SET_TABLE, table),
            |message| {
                sets.extend(digest::listed_set(message, table));
            },
        )?;
        for (name, declaration, dynamic) in sets {
            let mut set = SetDigest {
                declaration,
                ..SetDigest::default()
            };
            if elements && !dynamic {
                let what = format!("{table} set {name}");
                self.dump_retried(
                    encode::NFT_MSG_GETSETELEM,
                    &what,
                    |w| {
                        w.string(NFTA_SET_ELEM_LIST_TABLE, table);
                        w.string(NFTA_SET_ELEM_LIST_SET, &name);
                    },
                    |message| {
                        for entry in digest::listed_elements(message) {
                            set.add_element(entry);
                        }
                    },
                )?;
            }
            digest.sets.insert(name, set);
        }
        Ok(digest)
    }

    /// The chains of table `TABLE` (of the read family), each with the digest of its declaration (the kernel
    /// dumps the chains of every table: the others are left out here).
    pub fn read_chains(&mut self, table: &str) -> Result<BTreeMap<String, u64>, KernelError> {
        let mut chains = BTreeMap::new();
        let listed = self.dump_retried(
            encode::NFT_MSG_GETCHAIN,
            table,
            |w| w.string(NFTA_CHAIN_TABLE, table),
            |message| chains.extend(digest::listed_chain(message, table)),
        );
        match listed {
            Err(error) if is_absent(&error) => Ok(BTreeMap::new()),
            listed => listed.map(|()| chains),
        }
    }

    /// The chain names of each of `tables` (of the read family), from one dump: the kernel
    /// dumps the chains of every table of the family whatever table is asked for, so a
    /// dump per table would read them all again each time. A table that does not exist
    /// has none.
    pub fn read_chain_names(
        &mut self,
        tables: &[&str],
    ) -> Result<BTreeMap<String, BTreeSet<String>>, KernelError> {
        let mut names: BTreeMap<String, BTreeSet<String>> = tables
            .iter()
            .map(|table| ((*table).to_owned(), BTreeSet::new()))
            .collect();
        self.dump_retried(
            encode::NFT_MSG_GETCHAIN,
            "the chains",
            |_| {},
            |message| {
                for (table, chains) in &mut names {
                    if let Some((chain, _)) = digest::listed_chain(message, table) {
                        chains.insert(chain);
                    }
                }
            },
        )?;
        Ok(names)
    }

    /// The rules of the given chains of table `TABLE` (of the read family), one small dump per chain (a
    /// chain that does not exist reads as empty).
    pub fn read_rules<'a>(
        &mut self,
        table: &str,
        chains: impl IntoIterator<Item = &'a str>,
    ) -> Result<Vec<(&'a str, Vec<u64>)>, KernelError> {
        chains
            .into_iter()
            .map(|chain| {
                let mut rules = Vec::new();
                self.dump_retried(
                    encode::NFT_MSG_GETRULE,
                    chain,
                    |w| {
                        w.string(NFTA_RULE_TABLE, table);
                        w.string(NFTA_RULE_CHAIN, chain);
                    },
                    |message| rules.extend(digest::listed_rule(message).map(|(_, r)| r)),
                )?;
                Ok((chain, rules))
            })
            .collect()
    }

    /// The ruleset's generation in this socket's network namespace. The kernel counts
    /// every committed change of any table of any family, so a generation read twice
    /// with the same value proves that nothing was committed in between: what a read-back
    /// of every rule would show, in one small request.
    pub fn generation(&mut self) -> Result<u32, KernelError> {
        let seq = self.request(encode::generation_request)?;
        self.answers(seq, "the ruleset generation", 1 << 12, |kind, _, body| {
            if kind != (encode::NFNL_SUBSYS_NFTABLES << 8) | encode::NFT_MSG_NEWGEN {
                return Ok(None);
            }
            digest::find(body, NFTA_GEN_ID)
                .and_then(|id| id.try_into().ok())
                .map(|id| Some(u32::from_be_bytes(id)))
                .ok_or(KernelError::Malformed("a generation without its id"))
        })
    }

    /// Sends the request `message` builds for the next sequence number; returns that
    /// number, which its answers carry.
    fn request(&mut self, message: impl FnOnce(u32) -> Vec<u8>) -> Result<u32, KernelError> {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let message = message(seq);
        self.socket
            .send(&message, 0)
            .map_err(|source| KernelError::Send {
                bytes: message.len(),
                source,
            })?;
        Ok(seq)
    }

    /// [`Netlink::dump`], again from the start while the ruleset changes under it.
    fn dump_retried(
        &mut self,
        kind: u16,
        what: &str,
        request: impl Fn(&mut encode::Writer),
        mut each: impl FnMut(&[u8]),
    ) -> Result<(), KernelError> {
        // Messages of an interrupted attempt are kept until the dump completes whole.
        for _ in 0..DUMP_ATTEMPTS {
            let mut messages: Vec<Vec<u8>> = Vec::new();
            if self.dump(kind, what, &request, |m| messages.push(m.to_vec()))? {
                messages.iter().for_each(|m| each(m));
                return Ok(());
            }
        }
        Err(KernelError::Interrupted {
            what: what.to_owned(),
        })
    }

    /// Sends one dump request and hands the attributes of each message of the answer to
    /// `each`. Returns false when the ruleset changed during the dump (the answer may have
    /// skipped or repeated objects).
    fn dump(
        &mut self,
        kind: u16,
        what: &str,
        request: &impl Fn(&mut encode::Writer),
        mut each: impl FnMut(&[u8]),
    ) -> Result<bool, KernelError> {
        let family = self.read_family;
        let seq = self.request(|seq| encode::dump_request(kind, seq, family, request))?;
        let mut consistent = true;
        self.answers(seq, what, DUMP_BUFFER_BYTES, |kind, flags, body| {
            consistent &= flags & NLM_F_DUMP_INTR == 0;
            if kind == NLMSG_DONE {
                return Ok(Some(consistent));
            }
            each(body);
            Ok(None)
        })
    }

    /// Reads the answers to request `seq` (for `what`, as an error names it), `buffer`
    /// bytes a datagram, handing each message's kind, flags and attributes to `handle`
    /// until it returns a result. An error answer ends it as [`KernelError::Dump`].
    fn answers<R>(
        &mut self,
        seq: u32,
        what: &str,
        buffer: usize,
        mut handle: impl FnMut(u16, u16, &[u8]) -> Result<Option<R>, KernelError>,
    ) -> Result<R, KernelError> {
        let mut buf: Vec<u8> = Vec::with_capacity(buffer);
        loop {
            buf.clear();
            self.socket
                .recv(&mut buf, 0)
                .map_err(KernelError::Receive)?;
            for message in messages(&buf)? {
                // Answers to an earlier request that was given up.
                if read_u32(message, 8)? != seq {
                    continue;
                }
                let (kind, flags) = (read_u16(message, 4)?, read_u16(message, 6)?);
                if kind == NLMSG_ERROR {
                    let answer = error_answer(message, flags)?;
                    return Err(KernelError::Dump {
                        what: what.to_owned(),
                        errno: io::Error::from_raw_os_error(answer.errno),
                    });
                }
                let body = message
                    .get(NLMSG_HEADER_LEN + NFGENMSG_LEN..)
                    .unwrap_or_default();
                if let Some(done) = handle(kind, flags, body)? {
                    return Ok(done);
                }
            }
        }
    }
}

/// The kernel's answer to a dump of a table (or set) that does not exist.
fn is_absent(error: &KernelError) -> bool {
    matches!(error, KernelError::Dump { errno, .. } if errno.raw_os_error() == Some(ENOENT))
}

/// Room for one datagram of a dump (the kernel fills at most 32 KiB per read).
const DUMP_BUFFER_BYTES: usize = 256 << 10;

/// One `NLMSG_ERROR` answer: `errno` 0 is an ACK.
pub(crate) struct Answer {
    pub(crate) seq: u32,
    pub(crate) errno: i32,
    pub(crate) message: Option<String>,
}

/// The netlink messages of one datagram, each whole (header included).
pub(crate) fn messages(buf: &[u8]) -> Result<Vec<&[u8]>, KernelError> {
    let mut found = Vec::new();
    let mut rest = buf;
    while rest.len() >= NLMSG_HEADER_LEN {
        let len = read_u32(rest, 0)? as usize;
        if len < NLMSG_HEADER_LEN || len > rest.len() {
            return Err(KernelError::Malformed("message length"));
        }
        found.push(&rest[..len]);
        rest = rest.get((len + 3) & !3..).unwrap_or_default();
    }
    Ok(found)
}

fn answers(buf: &[u8]) -> Result<Vec<Answer>, KernelError> {
    let mut found = Vec::new();
    for message in messages(buf)? {
        if read_u16(message, 4)? == NLMSG_ERROR {
            found.push(error_answer(message, read_u16(message, 6)?)?);
        }
    }
    Ok(found)
}

/// `struct nlmsgerr` (error, then the request's header, or the whole request when not
/// capped) and, with extended ACKs, attributes such as the kernel's message.
pub(crate) fn error_answer(message: &[u8], flags: u16) -> Result<Answer, KernelError> {
    let body = &message[NLMSG_HEADER_LEN..];
    let error = read_u32(body, 0)? as i32;
    let request = body.get(4..).ok_or(KernelError::Malformed("short error"))?;
    let seq = read_u32(request, 8)?;
    let request_len = if flags & NLM_F_CAPPED != 0 {
        NLMSG_HEADER_LEN
    } else {
        read_u32(request, 0)? as usize
    };
    let mut text = None;
    if flags & NLM_F_ACK_TLVS != 0 {
        let mut tlvs = request.get((request_len + 3) & !3..).unwrap_or_default();
        while tlvs.len() >= 4 {
            let len = usize::from(read_u16(tlvs, 0)?);
            let kind = read_u16(tlvs, 2)?;
            if len < 4 || len > tlvs.len() {
                break;
            }
            if kind == NLMSGERR_ATTR_MSG {
                let value = &tlvs[4..len];
                let value = value.strip_suffix(&[0]).unwrap_or(value);
                text = Some(String::from_utf8_lossy(value).into_owned());
            }
            tlvs = tlvs.get((len + 3) & !3..).unwrap_or_default();
        }
    }
    Ok(Answer {
        seq,
        errno: error.wrapping_neg(),
        message: text,
    })
}

pub(crate) fn read_u32(bytes: &[u8], at: usize) -> Result<u32, KernelError> {
    bytes
        .get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_ne_bytes)
        .ok_or(KernelError::Malformed("truncated"))
}

pub(crate) fn read_u16(bytes: &[u8], at: usize) -> Result<u16, KernelError> {
    bytes
        .get(at..at + 2)
        .and_then(|b| b.try_into().ok())
        .map(u16::from_ne_bytes)
        .ok_or(KernelError::Malformed("truncated"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error answer as the kernel writes it with capped, extended ACKs.
    fn error_message(errno: i32, request_seq: u32, text: &str) -> Vec<u8> {
        let mut tlv = Vec::new();
        let value_len = text.len() + 1;
        tlv.extend_from_slice(&((4 + value_len) as u16).to_ne_bytes());
        tlv.extend_from_slice(&NLMSGERR_ATTR_MSG.to_ne_bytes());
        tlv.extend_from_slice(text.as_bytes());
        tlv.push(0);
        while tlv.len() % 4 != 0 {
            tlv.push(0);
        }
        let mut body = (-errno).to_ne_bytes().to_vec();
        // The request's header: length, type, flags, seq, port id.
        body.extend_from_slice(&200u32.to_ne_bytes());
        body.extend_from_slice(&0x0a06u16.to_ne_bytes());
        body.extend_from_slice(&0x0c01u16.to_ne_bytes());
        body.extend_from_slice(&request_seq.to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        body.extend_from_slice(&tlv);
        let mut message = ((NLMSG_HEADER_LEN + body.len()) as u32)
            .to_ne_bytes()
            .to_vec();
        message.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        message.extend_from_slice(&(NLM_F_CAPPED | NLM_F_ACK_TLVS).to_ne_bytes());
        message.extend_from_slice(&7u32.to_ne_bytes());
        message.extend_from_slice(&0u32.to_ne_bytes());
        message.extend_from_slice(&body);
        message
    }

    #[test]
    fn error_answers_carry_the_request_seq_errno_and_message() {
        let mut datagram = error_message(22, 42, "unknown chain");
        datagram.extend(error_message(2, 43, "x"));
        let found = answers(&datagram).unwrap();
        assert_eq!(found.len(), 2);
        assert_eq!(
            (found[0].seq, found[0].errno, found[0].message.as_deref()),
            (42, 22, Some("unknown chain"))
        );
        assert_eq!((found[1].seq, found[1].errno), (43, 2));
    }

    #[test]
    fn a_truncated_answer_is_an_error_not_a_panic() {
        let datagram = error_message(22, 42, "unknown chain");
        assert!(answers(&datagram[..datagram.len() - 8]).is_err());
        assert!(answers(&datagram[..20]).is_err());
    }
}
