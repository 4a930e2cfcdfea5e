//! The node proxy's nftables ruleset as typed values, and the two ways to program it.
//!
//! - [`model`]: one table of our own (`ip tandem`): chains of typed rules, sets and maps.
//!   Only what the node proxy writes is modelled, so every value has one meaning that the
//!   packet tracer, the nft text and the netlink encoding agree on.
//! - [`Transaction`]: the ordered operations of one atomic change;
//! - [`render`]: a transaction (or the whole ruleset) as `nft -f` text, for people and
//!   for the `nft` command;
//! - [`encode`] and [`kernel`]: the same transaction as one nfnetlink batch, sent straight
//!   to the kernel, which is what the node proxy does on its hot path;
//! - [`ctnetlink`]: the kernel's conntrack table over the same kind of socket: list the
//!   entries of a family and protocol, delete one (the node proxy's stale-UDP reconciler);
//! - [`digest`]: a table reduced to digests per chain and set, from the model or as the
//!   kernel lists it ([`kernel::Netlink::read_table`]), to find what someone else changed;
//! - [`monitor`]: the kernel's announcements of every ruleset change, with the netlink
//!   port that made it, to learn of someone else's change without reading anything back.
//!
//! [`kernel`], [`ctnetlink`] and [`monitor`], the crate's only I/O (netlink sockets, with
//! netlink-sys and nix), come with the `netlink` feature (on by default), and so do the
//! parts of [`digest`] and [`encode`] only they use (the readers of a listing, the dump and
//! generation requests). Without it the crate is the pure model and its encodings, as
//! `tandem-proxy-rules` takes it.

#[cfg(feature = "netlink")]
pub mod ctnetlink;
pub mod digest;
pub mod encode;
#[cfg(feature = "netlink")]
pub mod kernel;
pub mod model;
#[cfg(feature = "netlink")]
pub mod monitor;
pub mod render;
pub mod transaction;

pub use model::*;
pub use transaction::{Drift, Op, TableDrift, Transaction, Written};
