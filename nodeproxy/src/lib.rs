//! Node proxy runtime: watches Services, EndpointSlices and its Node, and programs the data
//! path computed by `tandem-proxy-rules`: the kube-proxy v1.21 iptables chains, or one
//! nftables table of our own (`--proxy-mode nftables`).
//!
//! Observe: the watches of [`observe`] feed the Services and EndpointSlices into a change
//! tracker per IP family, through a pure conversion to the rules' model. Decide: `tandem-proxy-rules` builds the rules. Act: a [`datapath`] per family,
//! either mode laid out alike (state, executor, read-back), with [`conntrack`] clean-up,
//! driven by the sync loop in [`proxier`]; [`healthcheck`] serves the node's and the
//! Services' health, [`metrics`] what it all did, and [`runtime`] wires it together.

pub mod cli;
pub mod conntrack;
pub mod datapath;
pub mod healthcheck;
pub mod metrics;
pub mod observe;
pub mod permissions;
pub mod proxier;
pub mod runtime;
