//! The kernel's announcements of nf_tables changes: every committed change to any table
//! (ours, iptables-nft's, anyone's) is sent to the `NFNLGRP_NFTABLES` netlink group, one
//! message per object, the way `nft monitor` shows them. Each message carries the netlink
//! port of the socket that sent the change, which tells our own writes from anyone else's
//! without reading the ruleset back. Blocking, as [`crate::kernel`].

use std::collections::BTreeSet;
use std::os::fd::AsFd;

use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};
use nix::sys::socket::{setsockopt, sockopt};
use tandem_common::IpFamily;

use crate::digest::{find, string};
use crate::encode::{
    NFNL_SUBSYS_NFTABLES, NFPROTO_IPV4, NFPROTO_IPV6, NFT_MSG_DELCHAIN, NFT_MSG_DELRULE,
    NFT_MSG_DELSET, NFT_MSG_DELSETELEM, NFT_MSG_DELTABLE, NFT_MSG_NEWCHAIN, NFT_MSG_NEWRULE,
    NFT_MSG_NEWSET, NFT_MSG_NEWSETELEM, NFT_MSG_NEWTABLE,
};
use crate::kernel::{self, KernelError, NFGENMSG_LEN, NLMSG_HEADER_LEN, read_u16, read_u32};

/// `NFNLGRP_NFTABLES` in `linux/netfilter/nfnetlink.h`.
const NFNLGRP_NFTABLES: u32 = 7;
/// Room for the announcements of a large write of our own, which arrive together: a queue
/// that overflows loses events, and then every table must be suspected
/// ([`Announcement::Lost`]).
const RECEIVE_BUFFER_BYTES: usize = 16 << 20;
const ENOBUFS: i32 = 105;

// The rest of `enum nf_tables_msg_types` that announces a change (the others are in
// `encode`).
const NFT_MSG_NEWOBJ: u16 = 18;
const NFT_MSG_DELOBJ: u16 = 20;
const NFT_MSG_NEWFLOWTABLE: u16 = 22;
const NFT_MSG_DELFLOWTABLE: u16 = 24;
// Since Linux 6.3: a deletion that does not fail when the object is gone.
const NFT_MSG_DESTROYTABLE: u16 = 26;
const NFT_MSG_DESTROYCHAIN: u16 = 27;
const NFT_MSG_DESTROYRULE: u16 = 28;
const NFT_MSG_DESTROYSET: u16 = 29;
const NFT_MSG_DESTROYSETELEM: u16 = 30;
const NFT_MSG_DESTROYOBJ: u16 = 31;
const NFT_MSG_DESTROYFLOWTABLE: u16 = 32;

/// The table attribute, the first of every object's message (`NFTA_TABLE_NAME`,
/// `NFTA_CHAIN_TABLE`, `NFTA_RULE_TABLE`, `NFTA_SET_TABLE`, ...).
const NFTA_OBJECT_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_CHAIN_NAME: u16 = 3;

/// What kind of object a change touched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Object {
    Table,
    Chain,
    Rule,
    /// A set or map, or its elements.
    Set,
    /// Stateful objects and flowtables.
    Other,
}

/// One change the kernel announced, reduced to what tells whose and where.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Change {
    /// The netlink port of the socket that sent the change.
    pub port: u32,
    pub family: IpFamily,
    pub table: String,
    /// The chain, for a chain or a rule.
    pub chain: Option<String>,
    pub object: Object,
    /// Added or replaced (false), or removed (true).
    pub removal: bool,
}

/// What one read from the group brought.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Announcement {
    /// The changes of one datagram, each once, in tables of the `ip` and `ip6` families.
    Changes(BTreeSet<Change>),
    /// The socket's queue overflowed: changes were announced that nobody will read.
    Lost,
}

/// A socket subscribed to the announcements in the network namespace it was opened in.
pub struct Monitor {
    socket: Socket,
    buf: Vec<u8>,
}

impl Monitor {
    /// Opens the socket in the calling thread's network namespace.
    pub fn open() -> Result<Self, KernelError> {
        let mut socket = Socket::new(NETLINK_NETFILTER).map_err(KernelError::Open)?;
        socket.bind_auto().map_err(KernelError::Open)?;
        setsockopt(&socket.as_fd(), sockopt::RcvBufForce, &RECEIVE_BUFFER_BYTES).map_err(
            |source| KernelError::Buffer {
                bytes: RECEIVE_BUFFER_BYTES,
                source,
            },
        )?;
        socket
            .add_membership(NFNLGRP_NFTABLES)
            .map_err(KernelError::Open)?;
        Ok(Self {
            socket,
            buf: Vec::with_capacity(1 << 16),
        })
    }

    /// Waits for the next datagram of announcements.
    pub fn receive(&mut self) -> Result<Announcement, KernelError> {
        self.buf.clear();
        match self.socket.recv(&mut self.buf, 0) {
            Ok(_) => Ok(Announcement::Changes(changes(&self.buf)?)),
            Err(error) if error.raw_os_error() == Some(ENOBUFS) => Ok(Announcement::Lost),
            Err(error) => Err(KernelError::Receive(error)),
        }
    }
}

/// The changes announced in one datagram; other messages (the generation that ends each
/// commit, other families and subsystems) are left out.
pub fn changes(buf: &[u8]) -> Result<BTreeSet<Change>, KernelError> {
    let mut found = BTreeSet::new();
    for message in kernel::messages(buf)? {
        if let Some(change) = change(message)? {
            found.insert(change);
        }
    }
    Ok(found)
}

fn change(message: &[u8]) -> Result<Option<Change>, KernelError> {
    let kind = read_u16(message, 4)?;
    if kind >> 8 != NFNL_SUBSYS_NFTABLES {
        return Ok(None);
    }
    let (object, removal) = match kind & 0xff {
        NFT_MSG_NEWTABLE => (Object::Table, false),
        NFT_MSG_DELTABLE | NFT_MSG_DESTROYTABLE => (Object::Table, true),
        NFT_MSG_NEWCHAIN => (Object::Chain, false),
        NFT_MSG_DELCHAIN | NFT_MSG_DESTROYCHAIN => (Object::Chain, true),
        NFT_MSG_NEWRULE => (Object::Rule, false),
        NFT_MSG_DELRULE | NFT_MSG_DESTROYRULE => (Object::Rule, true),
        NFT_MSG_NEWSET | NFT_MSG_NEWSETELEM => (Object::Set, false),
        NFT_MSG_DELSET | NFT_MSG_DELSETELEM | NFT_MSG_DESTROYSET | NFT_MSG_DESTROYSETELEM => {
            (Object::Set, true)
        }
        NFT_MSG_NEWOBJ | NFT_MSG_NEWFLOWTABLE => (Object::Other, false),
        NFT_MSG_DELOBJ | NFT_MSG_DELFLOWTABLE | NFT_MSG_DESTROYOBJ | NFT_MSG_DESTROYFLOWTABLE => {
            (Object::Other, true)
        }
        _ => return Ok(None),
    };
    let family = match message.get(NLMSG_HEADER_LEN) {
        Some(&NFPROTO_IPV4) => IpFamily::V4,
        Some(&NFPROTO_IPV6) => IpFamily::V6,
        Some(_) => return Ok(None),
        None => return Err(KernelError::Malformed("announcement without nfgenmsg")),
    };
    let body = message
        .get(NLMSG_HEADER_LEN + NFGENMSG_LEN..)
        .unwrap_or_default();
    let Some(table) = find(body, NFTA_OBJECT_TABLE).map(string) else {
        return Ok(None);
    };
    let chain = match object {
        Object::Chain => find(body, NFTA_CHAIN_NAME).map(string),
        Object::Rule => find(body, NFTA_RULE_CHAIN).map(string),
        _ => None,
    };
    Ok(Some(Change {
        port: read_u32(message, 12)?,
        family,
        table,
        chain,
        object,
        removal,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::Writer;

    /// An announcement as the kernel frames it.
    fn announcement(kind: u16, nfproto: u8, port: u32, attributes: &[(u16, &str)]) -> Vec<u8> {
        let mut w = Writer::default();
        w.message((NFNL_SUBSYS_NFTABLES << 8) | kind, 0, 7, nfproto, 0, |w| {
            for (attribute, value) in attributes {
                w.string(*attribute, value);
            }
        });
        w.buf[12..16].copy_from_slice(&port.to_ne_bytes());
        w.buf
    }

    #[test]
    fn rule_and_element_changes_name_their_port_table_and_chain() {
        let mut datagram = announcement(
            NFT_MSG_DELRULE,
            NFPROTO_IPV4,
            4242,
            &[(NFTA_OBJECT_TABLE, "nat"), (NFTA_RULE_CHAIN, "PREROUTING")],
        );
        datagram.extend(announcement(
            NFT_MSG_NEWSETELEM,
            NFPROTO_IPV6,
            7,
            &[(NFTA_OBJECT_TABLE, "tandem"), (2, "endpoints-tcp-0")],
        ));
        // The same element again, and the generation that ends the commit.
        datagram.extend(announcement(
            NFT_MSG_NEWSETELEM,
            NFPROTO_IPV6,
            7,
            &[(NFTA_OBJECT_TABLE, "tandem"), (2, "endpoints-tcp-1")],
        ));
        datagram.extend(announcement(15, 0, 7, &[]));
        let found: Vec<Change> = changes(&datagram).unwrap().into_iter().collect();
        assert_eq!(
            found,
            [
                Change {
                    port: 7,
                    family: IpFamily::V6,
                    table: "tandem".into(),
                    chain: None,
                    object: Object::Set,
                    removal: false,
                },
                Change {
                    port: 4242,
                    family: IpFamily::V4,
                    table: "nat".into(),
                    chain: Some("PREROUTING".into()),
                    object: Object::Rule,
                    removal: true,
                },
            ]
        );
    }

    #[test]
    fn other_families_and_subsystems_are_left_out() {
        let mut datagram = announcement(NFT_MSG_NEWRULE, 1, 1, &[(NFTA_OBJECT_TABLE, "inet")]);
        let mut conntrack = announcement(NFT_MSG_NEWRULE, NFPROTO_IPV4, 1, &[]);
        conntrack[4..6].copy_from_slice(&(1u16 << 8).to_ne_bytes());
        datagram.extend(conntrack);
        assert!(changes(&datagram).unwrap().is_empty());
    }

    #[test]
    fn a_truncated_datagram_is_an_error_not_a_panic() {
        let datagram = announcement(
            NFT_MSG_DELCHAIN,
            NFPROTO_IPV4,
            1,
            &[
                (NFTA_OBJECT_TABLE, "nat"),
                (NFTA_CHAIN_NAME, "KUBE-SERVICES"),
            ],
        );
        for cut in 1..datagram.len() {
            let _ = changes(&datagram[..cut]);
        }
        assert!(changes(&datagram[..20]).is_err());
    }
}
