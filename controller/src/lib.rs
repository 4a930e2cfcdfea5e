//! Cloud-provider LoadBalancer controller for Kubernetes Services.
//!
//! Decide: [`plan`] (the whole decision of a reconcile), [`spec`], [`nodes`], [`status`],
//! [`triggers`] and [`ratelimit`] are pure functions of observed state. Do: [`mockcloud`]
//! (the cloud edge, behind the [`provider::LoadBalancerProvider`] trait; `fake` is its
//! in-memory double, built for tests only) and [`reconcile`], [`nodesync`], [`gc`], [`runtime`] (the Kubernetes
//! edge and wiring).

pub mod cli;
#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(any(test, feature = "test-support"))]
pub mod fake;
pub mod gc;
pub mod http;
pub mod metrics;
pub mod mockcloud;
pub mod nodes;
pub mod nodesync;
pub mod plan;
pub mod provider;
pub mod ratelimit;
pub mod reconcile;
pub mod registry;
pub mod release;
pub mod runtime;
pub mod spec;
pub mod status;
pub mod triggers;
