//! L4 data plane of the mock cloud.
//!
//! The API server hands the data plane the complete desired set of load balancers after
//! every change (and once at start-up, from the store); the data plane converges to it:
//! proxy-mode listeners on `VIP:port` forwarding TCP and UDP to healthy backends, or
//! passthrough kernel routes for the VIP over healthy backends, with health checks. A load
//! balancer has a VIP per IP family (IPv4, IPv6 or both); each VIP serves the backends and
//! source ranges of its own family.
//!
//! Proxy mode is served by our own listeners or, with `DataPlaneKind::Haproxy`, by a real
//! HAProxy (module `haproxy`).
//!
//! With `announce`, the VIPs this edge can forward are written into a kernel table that a
//! BGP speaker exports (module `announce`), and withdrawn before the data plane stops.
//!
//! In the L2 mode the edge that owns a VIP holds it on the clients' network and announces
//! it by gratuitous ARP (module `l2`; who owns which VIP is the caller's to decide, from
//! [`DataPlane::offers`]).
//!
//! With `passthrough.maglev`, passthrough flows are steered to nodes by a Maglev table that
//! every edge computes alike (module `maglev`), so a flow keeps its node when the router
//! moves it to another edge.
//!
//! Layout: `plan`, `routes`, `maglev`, `announce::offered` and `haproxy::render` decide
//! (pure functions of the desired set and the observed health); `tcp`, `udp`, `health`,
//! `command`, `steering`, `haproxy`, `announce::Announcer` and `dataplane` do (sockets,
//! probes, `ip`, `nft`, HAProxy).

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

mod announce;
mod command;
mod config;
mod dataplane;
mod error;
mod failure;
mod haproxy;
mod health;
mod l2;
mod maglev;
mod metrics;
mod plan;
mod routes;
mod splice;
mod steering;
mod tcp;
mod udp;

pub use announce::AnnounceConfig;
pub use config::{
    DataPlaneConfig, DataPlaneKind, HaproxySettings, MaglevConfig, PassthroughConfig,
};
pub use dataplane::DataPlane;
pub use error::DataPlaneError;
pub use failure::{LbFailure, LbFailureReason, Unrenderable};
pub use haproxy::HaproxyError;
pub use l2::{L2Config, L2Device};

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
    /// At most one per IP family. Each VIP forwards to (or routes over) the backends of
    /// its own family.
    pub vips: Vec<IpAddr>,
    pub mode: Mode,
    pub listeners: Vec<Listener>,
    /// Of any family; a backend of a family without a VIP is not used.
    pub backends: Vec<IpAddr>,
    /// Each range applies to the VIP of its family; a VIP whose family has no range here
    /// takes every source (as kube-proxy reads `loadBalancerSourceRanges` per family).
    pub source_ranges: Vec<IpNet>,
}

/// Whether `a` and `b` are of one IP family.
pub(crate) fn same_family(a: IpAddr, b: IpAddr) -> bool {
    a.is_ipv4() == b.is_ipv4()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendHealth {
    /// Not checked yet.
    Unknown,
    Healthy,
    Unhealthy,
}
