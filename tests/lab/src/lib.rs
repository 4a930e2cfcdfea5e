//! The Tandem lab: a virtual cluster (network namespaces, see `tandem-netlab`) running the
//! API server stand-in, the mock cloud, the controller and a node proxy per node, with a
//! LoadBalancer Service reachable from outside clients through both balancers.
//!
//! The lab process itself works from inside the control-plane namespace (see
//! [`netns::enter`]): every packet it sends stays inside the virtual cluster.

pub mod binaries;
pub mod bridge;
pub mod components;
pub mod edges;
pub mod harness;
pub mod images;
pub mod lab;
pub mod launcher;
pub mod netns;
pub mod outcome;
pub mod report;
pub mod resilient_ecmp;
pub mod rules;
pub mod scenario;
pub mod traffic;

pub use lab::{Lab, LabOptions, Prepared};
pub use scenario::{LbMode, ServicePlan};
