//! Cloud-provider LoadBalancer controller for Kubernetes Services.
//!
//! Decide: [`spec`], [`nodes`], [`status`], [`predicate`] and [`ratelimit`] are pure
//! functions of observed state. Do: [`mockcloud`] (the cloud edge, behind the
//! [`provider::LoadBalancerProvider`] trait) and [`reconcile`], [`nodesync`], [`gc`],
//! [`runtime`] (the Kubernetes edge and wiring).

pub mod cli;
pub mod gc;
pub mod http;
pub mod metrics;
pub mod mockcloud;
pub mod nodes;
pub mod nodesync;
pub mod predicate;
pub mod provider;
pub mod ratelimit;
pub mod reconcile;
pub mod release;
pub mod runtime;
pub mod spec;
pub mod status;
