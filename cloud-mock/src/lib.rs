//! Mock cloud: load-balancer REST API, embedded store and a real L4 data plane.
//!
//! Layout: `validate`, `model`, `faults`, `lifecycle::plan_transitions` and the parsing
//! helpers in `api`/`extract` decide (pure, unit-tested); `store` (redb), `lifecycle`
//! (the one task driving the data plane) and `api` (axum) do; `credentials` holds the
//! accepted tokens and re-reads a token or tenants file; `tenants` says what each tenant
//! may touch; `server` wires them.

pub mod api;
pub mod cli;
pub mod credentials;
mod error;
#[cfg(feature = "test-support")]
pub mod etcd_cluster;
mod extract;
pub mod faults;
pub mod l2;
pub mod lifecycle;
mod metrics;
pub mod model;
pub mod openapi;
pub mod pools;
pub mod server;
pub mod store;
pub mod tenants;
#[cfg(feature = "test-support")]
pub mod test_edge;
#[cfg(any(test, feature = "test-support"))]
pub mod testutil;
pub mod validate;

pub use api::{OPENAPI_YAML, routes};
pub use server::{App, ServeError, Settings, serve};
