//! What the store keeps per load balancer, and the pure mappings to the API's wire type
//! and to the data plane's desired state.

use std::net::IpAddr;

use cloud_mock_dataplane as dataplane;
use cloud_mock_sdk::families::{BackendStatus, LoadBalancer, LoadBalancerSpec};
use cloud_mock_sdk::{BackendHealth, HealthCheckProtocol, Mode, Protocol, State};
use serde::{Deserialize, Serialize};

/// One load balancer as persisted. Records written before IP families decode as IPv4
/// load balancers: the spec's serde defaults fill `ipFamilies` with `["IPv4"]`, and their
/// IPv4 backends and ranges read as addresses of any family.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredLoadBalancer {
    pub id: String,
    /// The desired state with the allocated VIPs in `address.vips` (family order) and the
    /// IPv4 one, if any, in `vip`.
    pub spec: LoadBalancerSpec,
    pub state: State,
    pub version: u64,
    /// Unix time in milliseconds when `state` was entered; lifecycle delays count from it.
    pub state_since_ms: u64,
    /// The create's `Idempotency-Key`, released together with the load balancer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

impl StoredLoadBalancer {
    /// The allocated VIPs, in family order. Records from before `vips` was stored hold
    /// their one VIP in `vip` alone.
    pub fn vips(&self) -> Vec<IpAddr> {
        if self.spec.address.vips.is_empty() {
            self.spec.vip.map(IpAddr::V4).into_iter().collect()
        } else {
            self.spec.address.vips.clone()
        }
    }
}

/// The API answer for `stored`, with per-backend health from `observed` (what the data
/// plane reports; backends it does not report are `unknown`).
pub fn to_wire(stored: &StoredLoadBalancer, observed: &[(IpAddr, BackendHealth)]) -> LoadBalancer {
    let health = stored
        .spec
        .backends
        .iter()
        .map(|backend| BackendStatus {
            ip: backend.ip,
            health: observed
                .iter()
                .find(|(ip, _)| *ip == backend.ip)
                .map_or(BackendHealth::Unknown, |(_, health)| *health),
        })
        .collect();
    LoadBalancer {
        id: stored.id.clone(),
        spec: stored.spec.clone(),
        state: stored.state,
        version: stored.version,
        health,
    }
}

/// The data plane's desired state for `stored`; `None` for a load balancer being deleted
/// (or, which the store never produces, one without a VIP).
pub fn to_dataplane(stored: &StoredLoadBalancer) -> Option<dataplane::LoadBalancer> {
    let vips = stored.vips();
    if stored.state == State::Deleting || vips.is_empty() {
        return None;
    }
    let spec = &stored.spec;
    Some(dataplane::LoadBalancer {
        id: stored.id.clone(),
        vips,
        mode: match spec.mode {
            Mode::Proxy => dataplane::Mode::Proxy,
            Mode::Passthrough => dataplane::Mode::Passthrough,
        },
        listeners: spec
            .listeners
            .iter()
            .map(|listener| dataplane::Listener {
                protocol: match listener.protocol {
                    Protocol::Tcp => dataplane::Protocol::Tcp,
                    Protocol::Udp => dataplane::Protocol::Udp,
                },
                port: listener.port,
                backend_port: listener.backend_port,
                health_check: listener
                    .health_check
                    .as_ref()
                    .map(|check| match check.protocol {
                        HealthCheckProtocol::Tcp => {
                            dataplane::HealthCheck::Tcp { port: check.port }
                        }
                        HealthCheckProtocol::Http => dataplane::HealthCheck::Http {
                            port: check.port,
                            path: check.path.clone().unwrap_or_else(|| "/".to_owned()),
                        },
                    }),
            })
            .collect(),
        backends: spec.backends.iter().map(|backend| backend.ip).collect(),
        source_ranges: spec.source_ranges.clone(),
    })
}

/// Maps the data plane's health to the API's.
pub fn wire_health(health: dataplane::BackendHealth) -> BackendHealth {
    match health {
        dataplane::BackendHealth::Unknown => BackendHealth::Unknown,
        dataplane::BackendHealth::Healthy => BackendHealth::Healthy,
        dataplane::BackendHealth::Unhealthy => BackendHealth::Unhealthy,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;
    use std::net::Ipv4Addr;

    use cloud_mock_sdk::families::{Backend, DEFAULT_IP_FAMILIES};
    use cloud_mock_sdk::{HealthCheck, Listener};

    use super::*;

    pub(crate) fn spec(name: &str) -> LoadBalancerSpec {
        LoadBalancerSpec {
            name: name.into(),
            tags: BTreeMap::from([("cluster".into(), "c1".into())]),
            mode: Mode::Proxy,
            ip_families: DEFAULT_IP_FAMILIES.to_vec(),
            vip: None,
            listeners: vec![
                Listener {
                    protocol: Protocol::Tcp,
                    port: 80,
                    backend_port: 30080,
                    health_check: Some(HealthCheck {
                        protocol: HealthCheckProtocol::Http,
                        port: 32000,
                        path: Some("/healthz".into()),
                    }),
                },
                Listener {
                    protocol: Protocol::Udp,
                    port: 53,
                    backend_port: 30053,
                    health_check: Some(HealthCheck {
                        protocol: HealthCheckProtocol::Tcp,
                        port: 32001,
                        path: None,
                    }),
                },
            ],
            backends: vec![
                Backend {
                    ip: Ipv4Addr::new(198, 18, 0, 11).into(),
                },
                Backend {
                    ip: Ipv4Addr::new(198, 18, 0, 12).into(),
                },
            ],
            node_pool: None,
            source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
            address: cloud_mock_sdk::AddressRequest::default(),
        }
    }

    fn stored(state: State) -> StoredLoadBalancer {
        let mut spec = spec("a");
        spec.vip = Some(Ipv4Addr::new(127, 77, 0, 9));
        spec.address.vips = vec![Ipv4Addr::new(127, 77, 0, 9).into()];
        StoredLoadBalancer {
            id: "lb-00000001".into(),
            spec,
            state,
            version: 3,
            state_since_ms: 0,
            idempotency_key: None,
        }
    }

    #[test]
    fn dataplane_gets_every_listener_backend_and_range() {
        let lb = to_dataplane(&stored(State::Active)).unwrap();
        assert_eq!(lb.id, "lb-00000001");
        assert_eq!(lb.vips, vec![IpAddr::from([127, 77, 0, 9])]);
        assert_eq!(lb.mode, dataplane::Mode::Proxy);
        assert_eq!(
            lb.listeners,
            vec![
                dataplane::Listener {
                    protocol: dataplane::Protocol::Tcp,
                    port: 80,
                    backend_port: 30080,
                    health_check: Some(dataplane::HealthCheck::Http {
                        port: 32000,
                        path: "/healthz".into()
                    }),
                },
                dataplane::Listener {
                    protocol: dataplane::Protocol::Udp,
                    port: 53,
                    backend_port: 30053,
                    health_check: Some(dataplane::HealthCheck::Tcp { port: 32001 }),
                },
            ]
        );
        assert_eq!(
            lb.backends,
            vec![
                IpAddr::from([198, 18, 0, 11]),
                IpAddr::from([198, 18, 0, 12])
            ]
        );
        assert_eq!(lb.source_ranges, vec!["203.0.113.0/24".parse().unwrap()]);
    }

    #[test]
    fn deleting_load_balancers_leave_the_data_plane() {
        assert!(to_dataplane(&stored(State::Provisioning)).is_some());
        assert!(to_dataplane(&stored(State::Deleting)).is_none());
    }

    #[test]
    fn wire_health_lists_every_backend_in_order() {
        let observed = [(IpAddr::from([198, 18, 0, 12]), BackendHealth::Unhealthy)];
        let lb = to_wire(&stored(State::Active), &observed);
        assert_eq!(
            lb.health,
            vec![
                BackendStatus {
                    ip: Ipv4Addr::new(198, 18, 0, 11).into(),
                    health: BackendHealth::Unknown
                },
                BackendStatus {
                    ip: Ipv4Addr::new(198, 18, 0, 12).into(),
                    health: BackendHealth::Unhealthy
                },
            ]
        );
        assert_eq!(lb.version, 3);
        assert_eq!(lb.spec.vip, Some(Ipv4Addr::new(127, 77, 0, 9)));
    }

    #[test]
    fn a_record_of_the_ipv4_only_version_loads_as_an_ipv4_load_balancer() {
        // Written by the previous version: no ipFamilies, IPv4 types throughout.
        let old = r#"{"id": "lb-0000000a", "spec": {"name": "a", "tags": {}, "mode": "passthrough",
          "vip": "198.51.100.3", "listeners": [{"protocol": "TCP", "port": 80, "backendPort": 30080}],
          "backends": [{"ip": "198.18.0.11"}], "sourceRanges": ["203.0.113.0/24"],
          "pool": "default", "vips": ["198.51.100.3"]},
          "state": "active", "version": 4, "stateSinceMs": 17}"#;
        let stored: StoredLoadBalancer = serde_json::from_str(old).unwrap();
        assert_eq!(stored.spec.ip_families, DEFAULT_IP_FAMILIES.to_vec());
        assert_eq!(stored.vips(), vec![IpAddr::from([198, 51, 100, 3])]);
        let lb = to_dataplane(&stored).unwrap();
        assert_eq!(lb.backends, vec![IpAddr::from([198, 18, 0, 11])]);
        assert_eq!(lb.source_ranges, vec!["203.0.113.0/24".parse().unwrap()]);
        // Older still: the VIP in `vip` alone.
        let oldest = old.replace(r#", "vips": ["198.51.100.3"]"#, "");
        let stored: StoredLoadBalancer = serde_json::from_str(&oldest).unwrap();
        assert_eq!(stored.vips(), vec![IpAddr::from([198, 51, 100, 3])]);
    }

    #[test]
    fn a_dual_stack_load_balancer_reaches_the_data_plane_whole() {
        let mut dual = stored(State::Active);
        dual.spec.ip_families = vec![
            cloud_mock_sdk::IpFamily::Ipv6,
            cloud_mock_sdk::IpFamily::Ipv4,
        ];
        let v6: IpAddr = "2001:db8:51:100::1".parse().unwrap();
        dual.spec.address.vips.insert(0, v6);
        dual.spec.backends.push(Backend {
            ip: "2001:db8:18::11".parse().unwrap(),
        });
        dual.spec
            .source_ranges
            .push("2001:db8:203::/64".parse().unwrap());
        let lb = to_dataplane(&dual).unwrap();
        assert_eq!(lb.vips, vec![v6, IpAddr::from([127, 77, 0, 9])]);
        assert_eq!(lb.backends.len(), 3);
        assert_eq!(lb.source_ranges.len(), 2);
        let wire = to_wire(&dual, &[]);
        assert_eq!(wire.health.len(), 3);
        assert_eq!(wire.spec.vip, Some(Ipv4Addr::new(127, 77, 0, 9)));
    }
}
