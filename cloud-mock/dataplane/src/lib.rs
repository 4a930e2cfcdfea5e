//! L4 data plane of the mock cloud.
//!
//! The API server hands the data plane the complete desired set of load balancers after
//! every change (and once at start-up, from the store); the data plane converges to it:
//! proxy-mode listeners on `VIP:port` forwarding TCP and UDP to healthy backends, or
//! passthrough kernel routes for the VIP over healthy backends, with health checks.
//!
//! Layout: `plan` and `routes` decide (pure functions of the desired set and the observed
//! health); `tcp`, `udp`, `health`, `command` and `dataplane` do (sockets, probes, `ip`).

use std::fmt;
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

mod command;
mod config;
mod dataplane;
mod error;
mod health;
mod metrics;
mod plan;
mod routes;
mod splice;
mod tcp;
mod udp;

pub use config::{DataPlaneConfig, DataPlaneKind, PassthroughConfig};
pub use dataplane::DataPlane;
pub use error::{DataPlaneError, LbFailure, LbFailureReason};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    Proxy,
    Passthrough,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    /// Lower-case name, as used in metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HealthCheck {
    /// Healthy when a TCP connection to `backend:port` succeeds.
    Tcp { port: u16 },
    /// Healthy when `GET path` on `backend:port` answers 200.
    Http { port: u16, path: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Listener {
    pub protocol: Protocol,
    pub port: u16,
    pub backend_port: u16,
    pub health_check: Option<HealthCheck>,
}

/// One load balancer as the data plane must realise it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LoadBalancer {
    pub id: String,
    pub vip: Ipv4Addr,
    pub mode: Mode,
    pub listeners: Vec<Listener>,
    pub backends: Vec<Ipv4Addr>,
    /// Empty means every source is allowed.
    pub source_ranges: Vec<Ipv4Net>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendHealth {
    /// Not checked yet.
    Unknown,
    Healthy,
    Unhealthy,
}
