//! Node proxy runtime: watches Services, EndpointSlices and its Node, and programs the
//! kube-proxy v1.21 iptables data path computed by `tandem-proxy-rules`.
//!
//! Pure parts ([`k8s`], [`change_tracker`], [`restore`], [`backend::detect`],
//! [`conntrack::deletions`]) decide; [`sync`], [`conntrack`], [`healthcheck`] and [`proxier`] do the I/O.

pub mod backend;
pub mod change_tracker;
pub mod cli;
pub mod conntrack;
pub mod healthcheck;
pub mod k8s;
pub mod metrics;
pub mod proxier;
pub mod restore;
pub mod sync;
