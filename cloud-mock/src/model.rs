//! What the store keeps per load balancer and per node pool, and the pure mappings to the
//! API's wire types and to the data plane's desired state. A load balancer on a node pool
//! is resolved here, against the pool's members, so that the data planes never hear of
//! pools: a pool change is a backend change of every load balancer on it.

use std::net::IpAddr;

use cloud_mock_dataplane as dataplane;
use cloud_mock_sdk::families::{BackendStatus, LoadBalancer, LoadBalancerSpec};
use cloud_mock_sdk::{
    BackendHealth, HealthCheckProtocol, IpFamily, Mode, NodePool, NodePoolSpec, Protocol, State,
};
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

/// One node pool as persisted: its spec with the backends in address order (a pool is a
/// set, so the same members in another order are the same pool).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredNodePool {
    pub name: String,
    pub spec: NodePoolSpec,
    pub version: u64,
}

/// The API answer for `pool`, referenced by the load balancers `load_balancers`.
pub fn node_pool_to_wire(pool: &StoredNodePool, load_balancers: Vec<String>) -> NodePool {
    NodePool {
        name: pool.name.clone(),
        tags: pool.spec.tags.clone(),
        backends: pool.spec.backends.clone(),
        version: pool.version,
        load_balancers,
    }
}

/// The backends `stored` forwards to: its own, or, on a node pool, the members of
/// `node_pool` (the pool it names) of its families. A pool that is missing, which the
/// store never lets happen, leaves it without backends.
pub fn backend_ips(stored: &StoredLoadBalancer, node_pool: Option<&StoredNodePool>) -> Vec<IpAddr> {
    let spec = &stored.spec;
    if spec.node_pool.is_none() {
        return spec.backends.iter().map(|backend| backend.ip).collect();
    }
    node_pool
        .into_iter()
        .flat_map(|pool| &pool.spec.backends)
        .map(|backend| backend.ip)
        .filter(|ip| spec.ip_families.contains(&IpFamily::of(ip)))
        .collect()
}

/// The API answer for `stored` (on `node_pool`, if it names one), with per-backend health
/// from `observed` (what the data plane reports; backends it does not report are
/// `unknown`). On a node pool, `health` lists the pool's members with this load balancer's
/// health of each, while `backends` stays as sent: empty.
pub fn to_wire(
    stored: &StoredLoadBalancer,
    node_pool: Option<&StoredNodePool>,
    observed: &[(IpAddr, BackendHealth)],
) -> LoadBalancer {
    let health = backend_ips(stored, node_pool)
        .into_iter()
        .map(|ip| BackendStatus {
            ip,
            health: observed
                .iter()
                .find(|(seen, _)| *seen == ip)
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

/// The data plane's desired state for `stored` (on `node_pool`, if it names one); `None`
/// for a load balancer being deleted (or, which the store never produces, one without a
/// VIP).
pub fn to_dataplane(
    stored: &StoredLoadBalancer,
    node_pool: Option<&StoredNodePool>,
) -> Option<dataplane::LoadBalancer> {
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
        backends: backend_ips(stored, node_pool),
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
        let lb = to_dataplane(&stored(State::Active), None).unwrap();
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
        assert!(to_dataplane(&stored(State::Provisioning), None).is_some());
        assert!(to_dataplane(&stored(State::Deleting), None).is_none());
    }

    #[test]
    fn wire_health_lists_every_backend_in_order() {
        let observed = [(IpAddr::from([198, 18, 0, 12]), BackendHealth::Unhealthy)];
        let lb = to_wire(&stored(State::Active), None, &observed);
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
        let lb = to_dataplane(&stored, None).unwrap();
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
        let lb = to_dataplane(&dual, None).unwrap();
        assert_eq!(lb.vips, vec![v6, IpAddr::from([127, 77, 0, 9])]);
        assert_eq!(lb.backends.len(), 3);
        assert_eq!(lb.source_ranges.len(), 2);
        let wire = to_wire(&dual, None, &[]);
        assert_eq!(wire.health.len(), 3);
        assert_eq!(wire.spec.vip, Some(Ipv4Addr::new(127, 77, 0, 9)));
    }

    fn node_pool(members: &[&str]) -> StoredNodePool {
        StoredNodePool {
            name: "c1-nodes".into(),
            spec: NodePoolSpec {
                tags: BTreeMap::new(),
                backends: members
                    .iter()
                    .map(|ip| Backend {
                        ip: ip.parse().unwrap(),
                    })
                    .collect(),
            },
            version: 2,
        }
    }

    #[test]
    fn a_load_balancer_on_a_node_pool_gets_the_members_of_its_families() {
        let mut on_pool = stored(State::Active);
        on_pool.spec.backends.clear();
        on_pool.spec.node_pool = Some("c1-nodes".into());
        let pool = node_pool(&["198.18.0.21", "2001:db8:18::21", "198.18.0.22"]);
        let lb = to_dataplane(&on_pool, Some(&pool)).unwrap();
        assert_eq!(
            lb.backends,
            vec![
                IpAddr::from([198, 18, 0, 21]),
                IpAddr::from([198, 18, 0, 22])
            ],
            "an IPv4 load balancer leaves the IPv6 member out"
        );
        let observed = [(IpAddr::from([198, 18, 0, 22]), BackendHealth::Healthy)];
        let wire = to_wire(&on_pool, Some(&pool), &observed);
        assert!(wire.spec.backends.is_empty(), "backends stay as sent");
        assert_eq!(wire.spec.node_pool.as_deref(), Some("c1-nodes"));
        assert_eq!(
            wire.health
                .iter()
                .map(|status| (status.ip.to_string(), status.health))
                .collect::<Vec<_>>(),
            vec![
                ("198.18.0.21".to_owned(), BackendHealth::Unknown),
                ("198.18.0.22".to_owned(), BackendHealth::Healthy)
            ]
        );
        // A pool that is gone (the store never lets that happen) serves nothing.
        assert!(to_dataplane(&on_pool, None).unwrap().backends.is_empty());
        // Its own backends are ignored while a pool is named, and the pool while not.
        on_pool.spec.node_pool = None;
        assert!(backend_ips(&on_pool, Some(&pool)).is_empty());

        let answer = node_pool_to_wire(&pool, vec!["lb-00000001".into()]);
        assert_eq!(answer.version, 2);
        assert_eq!(answer.backends.len(), 3);
        assert_eq!(answer.load_balancers, vec!["lb-00000001".to_owned()]);
    }
}
