//! Cloud-provider LoadBalancer controller for Kubernetes Services.
//!
//! Decide: [`plan`] (the whole decision of a reconcile), [`spec`], [`nodes`], [`status`],
//! [`triggers`] and [`ratelimit`] are pure functions of observed state. Do: [`reconcile`],
//! [`provisioning`], [`nodesync`], [`gc`], [`runtime`] (the Kubernetes edge and wiring).
//! The cloud is behind the [`provider::LoadBalancerProvider`] trait: each provider is a
//! crate of its own (the mock cloud's is `tandem-provider-mockcloud`), and the binary
//! registers them ([`registry`]); this crate depends on none (`fake` is an in-memory one,
//! built for tests only).

pub mod cli;
#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(any(test, feature = "test-support"))]
pub mod fake;
pub mod gc;
pub mod http;
pub mod metrics;
pub mod nodes;
pub mod nodesync;
pub mod permissions;
pub mod plan;
pub mod provider;
pub mod provisioning;
pub mod ratelimit;
pub mod reconcile;
pub mod registry;
pub mod release;
pub mod runtime;
pub mod spec;
pub mod status;
pub mod triggers;

/// docs/providers.md: rustdoc compiles and runs its Rust examples (the in-memory provider
/// and the conformance kit on it), so the guide cannot drift from the trait.
#[cfg(doctest)]
#[doc = include_str!("../../docs/providers.md")]
pub struct ProvidersGuide;
