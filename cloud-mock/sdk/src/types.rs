//! Wire types of the cloud-mock API (JSON, camelCase as Kubernetes writes it).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use ipnet::{IpNet, Ipv4Net};
use serde::{Deserialize, Deserializer, Serialize};

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

/// The desired state of a load balancer: the body of a create or an update, seen as an
/// IPv4-only client sees it. It sends no `ipFamilies` (so it asks for IPv4 alone), and
/// reading an answer it keeps the IPv4 entries of `backends`, `sourceRanges` and `health`
/// only, so that it can read any load balancer. [`crate::families::LoadBalancerSpec`] is
/// the whole spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerSpec {
    pub name: String,
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    pub mode: Mode,
    /// Requested VIP on create or update; in an answer, the assigned VIP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vip: Option<Ipv4Addr>,
    pub listeners: Vec<Listener>,
    #[serde(deserialize_with = "ipv4_backends")]
    pub backends: Vec<Backend>,
    /// The node pool whose members are the backends (`backends` is then empty); see
    /// [`crate::NodePool`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_pool: Option<String>,
    /// Client CIDRs allowed to reach the VIP; empty allows every source.
    #[serde(default, deserialize_with = "ipv4_nets")]
    pub source_ranges: Vec<Ipv4Net>,
    /// Where the VIP comes from: pool, requested addresses, sharing.
    #[serde(flatten)]
    pub address: AddressRequest,
}

/// The IPv4 entries of a list of backends of any family.
fn ipv4_backends<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<Backend>, D::Error> {
    let all = Vec::<crate::families::Backend>::deserialize(deserializer)?;
    Ok(all
        .into_iter()
        .filter_map(|backend| match backend.ip {
            IpAddr::V4(ip) => Some(Backend { ip }),
            IpAddr::V6(_) => None,
        })
        .collect())
}

fn ipv4_nets<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<Ipv4Net>, D::Error> {
    let all = Vec::<IpNet>::deserialize(deserializer)?;
    Ok(all
        .into_iter()
        .filter_map(|net| match net {
            IpNet::V4(net) => Some(net),
            IpNet::V6(_) => None,
        })
        .collect())
}

fn ipv4_health<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<BackendStatus>, D::Error> {
    let all = Vec::<crate::families::BackendStatus>::deserialize(deserializer)?;
    Ok(all
        .into_iter()
        .filter_map(|status| match status.ip {
            IpAddr::V4(ip) => Some(BackendStatus {
                ip,
                health: status.health,
            }),
            IpAddr::V6(_) => None,
        })
        .collect())
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Backend {
    pub ip: Ipv4Addr,
}

/// A load balancer as the cloud reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancer {
    /// Assigned by the cloud, like `lb-3f9a2c1e`.
    pub id: String,
    /// The desired state; `spec.vip` is the assigned IPv4 VIP.
    #[serde(flatten)]
    pub spec: LoadBalancerSpec,
    pub state: State,
    /// Increases by one with every accepted change of the spec; send it as `If-Match`.
    pub version: u64,
    /// One entry per (IPv4) backend.
    #[serde(default, deserialize_with = "ipv4_health")]
    pub health: Vec<BackendStatus>,
}

impl LoadBalancer {
    /// The assigned IPv4 VIP (present in the cloud's answers unless the load balancer has
    /// IPv6 alone).
    pub fn vip(&self) -> Option<Ipv4Addr> {
        self.spec.vip
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Provisioning,
    Active,
    Deleting,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendStatus {
    pub ip: Ipv4Addr,
    pub health: BackendHealth,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendHealth {
    /// Not checked yet, or the listener has no health check configured.
    Unknown,
    Healthy,
    Unhealthy,
}

/// The answer to a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadBalancerList {
    pub items: Vec<LoadBalancer>,
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

    fn example_spec() -> LoadBalancerSpec {
        LoadBalancerSpec {
            name: "a1b2".into(),
            tags: BTreeMap::from([("cluster".into(), "c1".into())]),
            mode: Mode::Proxy,
            vip: Some(Ipv4Addr::new(127, 77, 0, 9)),
            listeners: vec![Listener {
                protocol: Protocol::Tcp,
                port: 80,
                backend_port: 30080,
                health_check: Some(HealthCheck {
                    protocol: HealthCheckProtocol::Http,
                    port: 32000,
                    path: Some("/healthz".into()),
                }),
            }],
            backends: vec![Backend {
                ip: Ipv4Addr::new(198, 18, 0, 11),
            }],
            node_pool: None,
            source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
            address: AddressRequest::default(),
        }
    }

    #[test]
    fn spec_parses_the_documented_create_body() {
        let body = r#"{"name": "a1b2", "tags": {"cluster": "c1"}, "mode": "proxy", "vip": "127.77.0.9",
          "listeners": [{"protocol": "TCP", "port": 80, "backendPort": 30080,
          "healthCheck": {"protocol": "HTTP", "port": 32000, "path": "/healthz"}}],
          "backends": [{"ip": "198.18.0.11"}], "sourceRanges": ["203.0.113.0/24"]}"#;
        let spec: LoadBalancerSpec = serde_json::from_str(body).unwrap();
        assert_eq!(spec, example_spec());
    }

    #[test]
    fn optional_fields_may_be_left_out() {
        let body = r#"{"name": "x", "mode": "passthrough", "listeners": [{"protocol": "UDP", "port": 53, "backendPort": 30053}], "backends": []}"#;
        let spec: LoadBalancerSpec = serde_json::from_str(body).unwrap();
        assert_eq!(spec.mode, Mode::Passthrough);
        assert!(spec.tags.is_empty() && spec.source_ranges.is_empty() && spec.vip.is_none());
        assert_eq!(spec.listeners[0].protocol, Protocol::Udp);
        assert_eq!(spec.listeners[0].health_check, None);
    }

    #[test]
    fn load_balancer_flattens_its_spec_and_round_trips() {
        let lb = LoadBalancer {
            id: "lb-3f9a2c1e".into(),
            spec: example_spec(),
            state: State::Provisioning,
            version: 1,
            health: vec![BackendStatus {
                ip: Ipv4Addr::new(198, 18, 0, 11),
                health: BackendHealth::Unknown,
            }],
        };
        let json = serde_json::to_value(&lb).unwrap();
        assert_eq!(json["id"], "lb-3f9a2c1e");
        assert_eq!(json["vip"], "127.77.0.9");
        assert_eq!(json["state"], "provisioning");
        assert_eq!(json["listeners"][0]["backendPort"], 30080);
        assert_eq!(json["health"][0]["health"], "unknown");
        assert_eq!(json["sourceRanges"][0], "203.0.113.0/24");
        let back: LoadBalancer = serde_json::from_value(json).unwrap();
        assert_eq!(back, lb);
    }

    #[test]
    fn address_request_is_flat_and_optional() {
        let body = r#"{"name": "x", "mode": "proxy", "listeners": [], "backends": [],
          "pool": "blue", "vips": ["198.51.100.7", "2001:db8::7"], "sharingKey": "dns"}"#;
        let spec: LoadBalancerSpec = serde_json::from_str(body).unwrap();
        assert_eq!(
            spec.address,
            AddressRequest {
                pool: Some("blue".into()),
                vips: vec![
                    "198.51.100.7".parse().unwrap(),
                    "2001:db8::7".parse().unwrap()
                ],
                sharing_key: Some("dns".into()),
            }
        );
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["sharingKey"], "dns");
        assert_eq!(json["vips"][1], "2001:db8::7");
        let plain = serde_json::to_value(example_spec()).unwrap();
        assert!(plain.get("pool").is_none() && plain.get("vips").is_none());
    }

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
