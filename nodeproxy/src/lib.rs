//! Node proxy runtime: watches Services, EndpointSlices and its Node, and programs the
//! kube-proxy v1.21 iptables data path computed by `tandem-proxy-rules`.
//!
//! Pure parts ([`convert`]: API objects → model, [`change_tracker`], [`restore`]:
//! iptables-restore payloads, [`backend::detect`], [`conntrack::deletions`]) decide;
//! [`iptables`] (runs iptables and iptables-restore), [`conntrack`], [`healthcheck`] and
//! [`proxier`] (the watches and the sync loop) do the I/O.

pub mod backend;
pub mod change_tracker;
pub mod cli;
pub mod conntrack;
pub mod convert;
pub mod healthcheck;
pub mod iptables;
pub mod metrics;
pub mod proxier;
pub mod restore;
