//! The nftables mode: the same Services and endpoints as the iptables mode, as the
//! ruleset of our own table `ip tandem` (kube-proxy's nftables layout, v1.31+).
//!
//! - [`layout::build`]: the whole ruleset; [`layout::port_objects`]: one Service port's
//!   share of it;
//! - [`slots::BucketSlots`]: which range of which shared endpoint map each port's
//!   buckets occupy;
//! - [`incremental::IncrementalRuleset`]: the ruleset kept current one Service port at a
//!   time, each change as one [`tandem_nftables::Transaction`] whose size follows the
//!   change, not the cluster;
//! - [`trace::trace`]: where a packet goes through that ruleset, with the request and
//!   outcome types of the iptables tracer ([`crate::trace`]).
//!
//! What happens to a packet is the iptables mode's ([`crate::rules`]): the same endpoint
//! choice, traffic policies, masquerading, source ranges, REJECT and DROP. The places where
//! the two differ on purpose are noted where they are made.

pub mod incremental;
pub mod layout;
pub mod slots;
pub mod trace;

pub use layout::build;
