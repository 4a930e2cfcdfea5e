//! Pure core of the node proxy: observed Services and endpoints in, the kube-proxy v1.21
//! iptables ruleset (or the nftables ruleset of [`nft`]) out, plus a packet tracer over
//! either. No kube, no tokio, no I/O.
//!
//! - [`model`]: what the runtime observes (its input), [`ruleset`]: the desired iptables
//!   state (its output) and the fixed [`ruleset::BASE_JUMPS`];
//! - [`rules::build`]: the whole ruleset, in the text `iptables-save` prints;
//! - [`incremental::IncrementalRuleset`]: the same ruleset kept current one Service port
//!   at a time, reporting the chains a change touched;
//! - [`chains`]: kube-proxy's chain names;
//! - [`trace::trace`]: where a packet goes through that ruleset, and its fate;
//! - [`health::health_check_services`]: the health-check node port servers and answers;
//! - [`conntrack::stale_udp_deletions`]: UDP conntrack entries to delete after a change,
//!   and [`conntrack::ServingEndpoints`]: which entries of the kernel's table are stale
//!   (kube-proxy 1.32's periodic reconciler);
//! - [`topology::choose_endpoints`]: which endpoints a Service port uses on this node
//!   (kube-proxy's `CategorizeEndpoints`: readiness, topology hints, traffic policies);
//! - [`nft`]: the nftables mode: its layout, its per-port transactions and its tracer.

pub mod chains;
pub mod conntrack;
pub mod health;
pub mod incremental;
pub mod model;
pub mod nft;
pub mod rules;
pub mod ruleset;
pub mod topology;
pub mod trace;

pub use rules::build;
