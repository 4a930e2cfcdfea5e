//! The IPv4 view of a load balancer, the crate root's types since before IP families: it
//! reads the whole load balancer ([`crate::families`]) and keeps its IPv4 half.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use ipnet::{IpNet, Ipv4Net};
use serde::{Deserialize, Deserializer, Serialize};

use crate::families;
use crate::types::{AddressRequest, BackendHealth, Listener, Mode, State};

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
    let all = Vec::<families::Backend>::deserialize(deserializer)?;
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
    let all = Vec::<families::BackendStatus>::deserialize(deserializer)?;
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendStatus {
    pub ip: Ipv4Addr,
    pub health: BackendHealth,
}

/// The answer to a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadBalancerList {
    pub items: Vec<LoadBalancer>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::families::tests::DUAL;
    use crate::types::{HealthCheck, HealthCheckProtocol, Protocol};

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
    fn the_ipv4_view_reads_a_dual_stack_answer() {
        let lb: LoadBalancer = serde_json::from_str(DUAL).unwrap();
        assert_eq!(lb.vip(), Some(Ipv4Addr::new(198, 51, 100, 7)));
        assert_eq!(
            lb.spec.backends,
            vec![Backend {
                ip: Ipv4Addr::new(198, 18, 0, 11)
            }]
        );
        assert_eq!(
            lb.spec.source_ranges,
            vec!["203.0.113.0/24".parse().unwrap()]
        );
        assert_eq!(lb.health.len(), 1);
        assert_eq!(
            lb.spec.address.vips.len(),
            2,
            "vips were of any family already"
        );
    }
}
