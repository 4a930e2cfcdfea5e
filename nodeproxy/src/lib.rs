//! Node proxy runtime: watches Services, EndpointSlices and its Node, and programs the data
//! path computed by `tandem-proxy-rules`: the kube-proxy v1.21 iptables chains, or one
//! nftables table of our own (`--proxy-mode nftables`).
//!
//! Pure parts ([`convert`]: API objects → model, [`change_tracker`], [`restore`]:
//! iptables-restore payloads, [`drift`]: what a read-back of the kernel found changed,
//! [`backend::detect`], [`conntrack::deletions`]) decide;
//! [`iptables`] (runs iptables and iptables-restore), [`datapath`] (either mode behind one
//! interface; nftables transactions go to the kernel through `tandem-nftables`),
//! [`conntrack`] (the `conntrack` tool, and the reconciler over ctnetlink),
//! [`healthcheck`] and [`proxier`] (the watches and the sync loop) do the I/O.

pub mod backend;
pub mod change_tracker;
pub mod cli;
pub mod conntrack;
pub mod convert;
pub mod datapath;
pub mod drift;
pub mod healthcheck;
pub mod iptables;
pub mod metrics;
pub mod proxier;
pub mod restore;
pub mod ruleset_events;
