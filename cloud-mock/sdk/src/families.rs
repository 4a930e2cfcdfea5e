//! The whole load balancer, of any IP family: IPv4, IPv6 or both (dual-stack).
//!
//! The crate root's [`crate::LoadBalancerSpec`] and [`crate::LoadBalancer`] are the IPv4
//! view of the same JSON, kept unchanged for clients written before IP families. These
//! types add `ipFamilies` and take backends, source ranges and health of either family;
//! [`crate::Client::families`] sends and reads them.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::types::{AddressRequest, BackendHealth, IpFamily, Listener, Mode, State};

/// The families a load balancer that names none gets: what every client before IP
/// families meant.
pub const DEFAULT_IP_FAMILIES: [IpFamily; 1] = [IpFamily::Ipv4];

fn default_ip_families() -> Vec<IpFamily> {
    DEFAULT_IP_FAMILIES.to_vec()
}

/// The desired state of a load balancer: the body of a create or an update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerSpec {
    pub name: String,
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    pub mode: Mode,
    /// The families of its VIPs, one VIP per family, in this order (Kubernetes'
    /// `ipFamilies`); `["IPv4"]` when absent.
    #[serde(default = "default_ip_families")]
    pub ip_families: Vec<IpFamily>,
    /// The requested IPv4 VIP (or `address.vips` holds it); in an answer, the assigned
    /// IPv4 VIP. Kept for clients that predate IP families.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vip: Option<Ipv4Addr>,
    pub listeners: Vec<Listener>,
    /// Backends of each family the load balancer has: each VIP forwards to (or routes
    /// over) the backends of its own family.
    pub backends: Vec<Backend>,
    /// The node pool whose members are the backends (`backends` is then empty): each VIP
    /// uses the pool's members of its own family. See [`crate::NodePool`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_pool: Option<String>,
    /// Client CIDRs allowed to reach the VIP of their family. A VIP whose family has no
    /// range here is open to every source, as kube-proxy reads `loadBalancerSourceRanges`.
    #[serde(default)]
    pub source_ranges: Vec<IpNet>,
    /// Where the VIPs come from: pool, requested addresses, sharing.
    #[serde(flatten)]
    pub address: AddressRequest,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Backend {
    pub ip: IpAddr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendStatus {
    pub ip: IpAddr,
    pub health: BackendHealth,
}

/// A load balancer as the cloud reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancer {
    /// Assigned by the cloud, like `lb-3f9a2c1e`.
    pub id: String,
    /// The desired state; `spec.address.vips` are the assigned VIPs, in the order of
    /// `spec.ip_families`.
    #[serde(flatten)]
    pub spec: LoadBalancerSpec,
    pub state: State,
    /// Increases by one with every accepted change of the spec; send it as `If-Match`.
    pub version: u64,
    /// One entry per backend.
    #[serde(default)]
    pub health: Vec<BackendStatus>,
}

impl LoadBalancer {
    /// The assigned VIPs, in family order.
    pub fn vips(&self) -> &[IpAddr] {
        &self.spec.address.vips
    }

    /// The assigned VIP of `family`, if the load balancer has that family.
    pub fn vip_of(&self, family: IpFamily) -> Option<IpAddr> {
        self.vips()
            .iter()
            .copied()
            .find(|vip| IpFamily::of(vip) == family)
    }
}

/// The answer to a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadBalancerList {
    pub items: Vec<LoadBalancer>,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::types::Protocol;

    /// A dual-stack load balancer as the cloud answers it.
    pub(crate) const DUAL: &str = r#"{"id": "lb-1", "name": "x", "mode": "proxy",
      "ipFamilies": ["IPv6", "IPv4"], "vip": "198.51.100.7",
      "vips": ["2001:db8:51:100::7", "198.51.100.7"],
      "listeners": [{"protocol": "TCP", "port": 80, "backendPort": 30080}],
      "backends": [{"ip": "198.18.0.11"}, {"ip": "2001:db8:18::11"}],
      "sourceRanges": ["203.0.113.0/24", "2001:db8:203::/64"],
      "state": "active", "version": 2,
      "health": [{"ip": "198.18.0.11", "health": "healthy"},
                 {"ip": "2001:db8:18::11", "health": "unhealthy"}]}"#;

    #[test]
    fn families_default_to_ipv4_and_round_trip() {
        let body = r#"{"name": "x", "mode": "proxy", "listeners": [], "backends": []}"#;
        let spec: LoadBalancerSpec = serde_json::from_str(body).unwrap();
        assert_eq!(spec.ip_families, vec![IpFamily::Ipv4]);
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["ipFamilies"], serde_json::json!(["IPv4"]));

        let lb: LoadBalancer = serde_json::from_str(DUAL).unwrap();
        assert_eq!(lb.spec.ip_families, vec![IpFamily::Ipv6, IpFamily::Ipv4]);
        assert_eq!(
            lb.vip_of(IpFamily::Ipv6),
            Some("2001:db8:51:100::7".parse().unwrap())
        );
        assert_eq!(lb.spec.listeners[0].protocol, Protocol::Tcp);
        assert_eq!(lb.spec.source_ranges.len(), 2);
        assert_eq!(lb.health[1].health, BackendHealth::Unhealthy);
        let back: LoadBalancer =
            serde_json::from_value(serde_json::to_value(&lb).unwrap()).unwrap();
        assert_eq!(back, lb);
    }
}
