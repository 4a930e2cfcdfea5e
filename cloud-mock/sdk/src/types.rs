//! Wire types of the cloud-mock API (JSON, camelCase as Kubernetes writes it) that both views
//! of a load balancer share ([`crate::ipv4`], [`crate::families`]), and those of pools,
//! faults and errors.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// An IP address family, as Kubernetes spells it in `ipFamilies`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum IpFamily {
    #[serde(rename = "IPv4")]
    Ipv4,
    #[serde(rename = "IPv6")]
    Ipv6,
}

impl IpFamily {
    pub const fn of(ip: &IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self::Ipv4,
            IpAddr::V6(_) => Self::Ipv6,
        }
    }

    pub const fn of_net(net: &IpNet) -> Self {
        match net {
            IpNet::V4(_) => Self::Ipv4,
            IpNet::V6(_) => Self::Ipv6,
        }
    }
}

impl std::fmt::Display for IpFamily {
    /// As the API spells it: `IPv4`, `IPv6`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Ipv4 => "IPv4",
            Self::Ipv6 => "IPv6",
        })
    }
}

/// How a load balancer's VIP is chosen. Every field is optional: the default takes the
/// lowest free address of the pool `default`, for this load balancer alone.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AddressRequest {
    /// The VIP pool to allocate from (`default` when absent). In an answer, the pool the
    /// VIP belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Requested VIPs, at most one per IP family; the IPv4 one may equally be sent as
    /// `vip`. In an answer, the assigned VIPs, in the order of the load balancer's
    /// `ipFamilies`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vips: Vec<IpAddr>,
    /// Load balancers with the same key may share a VIP when their (protocol, port) sets
    /// do not overlap (MetalLB's `allow-shared-ip`); without a key the VIP is exclusive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing_key: Option<String>,
}

/// A VIP pool as the cloud reports it: one entry per name and family (a pool name may
/// have one CIDR of each family).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pool {
    pub name: String,
    pub family: IpFamily,
    pub cidr: IpNet,
    /// Addresses the pool can hand out (at most 2^64 - 1: a larger IPv6 pool says that).
    pub size: u64,
    /// Addresses held by at least one load balancer.
    pub allocated: u64,
}

/// The answer to a pool list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolList {
    pub items: Vec<Pool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The cloud terminates the connection on `vip:port` and opens one to `backend:backendPort`.
    Proxy,
    /// The cloud routes packets for the VIP to a healthy backend unchanged.
    Passthrough,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Listener {
    pub protocol: Protocol,
    pub port: u16,
    pub backend_port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheck>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    Tcp,
    Udp,
}

impl std::fmt::Display for Protocol {
    /// As the API spells it: `TCP`, `UDP`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthCheck {
    pub protocol: HealthCheckProtocol,
    pub port: u16,
    /// Request path of an HTTP check; absent for TCP checks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum HealthCheckProtocol {
    Tcp,
    Http,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Provisioning,
    Active,
    Deleting,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendHealth {
    /// Not checked yet, or the listener has no health check configured.
    Unknown,
    Healthy,
    Unhealthy,
}

/// Faults the server injects into the load-balancer API, for tests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Faults {
    /// Share of requests, 0.0 to 1.0, answered with 503.
    #[serde(default)]
    pub error_rate: f64,
    /// Added to every request before it is handled.
    #[serde(default)]
    pub latency_ms: u64,
    /// Token bucket: requests beyond this rate are answered 429 with `Retry-After`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit_per_second: Option<u32>,
    /// Share of committed changes (creates, updates, deletes that changed something),
    /// 0.0 to 1.0, whose answer is then lost as `lostAnswer` says.
    #[serde(default)]
    pub lost_answer_rate: f64,
    #[serde(default)]
    pub lost_answer: LostAnswer,
}

/// How the answer to a committed change is lost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LostAnswer {
    /// 503, as if the change had not been made.
    #[default]
    Unavailable,
    /// The connection closes in the middle of the answer.
    Reset,
    /// No answer for a minute (past any client timeout), then the connection closes.
    Hang,
}

/// The JSON error body: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_use_camel_case() {
        let faults = Faults {
            error_rate: 0.5,
            latency_ms: 20,
            rate_limit_per_second: Some(3),
            lost_answer_rate: 0.25,
            lost_answer: LostAnswer::Reset,
        };
        let json = serde_json::to_value(&faults).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"errorRate": 0.5, "latencyMs": 20, "rateLimitPerSecond": 3,
                "lostAnswerRate": 0.25, "lostAnswer": "reset"})
        );
        let cleared: Faults = serde_json::from_str("{}").unwrap();
        assert_eq!(cleared, Faults::default());
    }
}
