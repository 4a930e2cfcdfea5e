//! What the store keeps per load balancer, and the pure mappings to the API's wire type
//! and to the data plane's desired state.

use std::net::Ipv4Addr;

use cloud_mock_dataplane as dataplane;
use cloud_mock_sdk::{
    BackendHealth, BackendStatus, HealthCheckProtocol, LoadBalancer, LoadBalancerSpec, Mode,
    Protocol, State,
};
use serde::{Deserialize, Serialize};

/// One load balancer as persisted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredLoadBalancer {
    pub id: String,
    /// The desired state with `vip` always set to the allocated VIP.
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
    /// The allocated VIP.
    pub fn vip(&self) -> Option<Ipv4Addr> {
        self.spec.vip
    }
}

/// The API answer for `stored`, with per-backend health from `observed` (what the data
/// plane reports; backends it does not report are `unknown`).
pub fn to_wire(
    stored: &StoredLoadBalancer,
    observed: &[(Ipv4Addr, BackendHealth)],
) -> LoadBalancer {
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
    if stored.state == State::Deleting {
        return None;
    }
    let spec = &stored.spec;
    Some(dataplane::LoadBalancer {
        id: stored.id.clone(),
        vip: spec.vip?,
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

    use cloud_mock_sdk::{Backend, HealthCheck, Listener};

    use super::*;

    pub(crate) fn spec(name: &str) -> LoadBalancerSpec {
        LoadBalancerSpec {
            name: name.into(),
            tags: BTreeMap::from([("cluster".into(), "c1".into())]),
            mode: Mode::Proxy,
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
                    ip: Ipv4Addr::new(198, 18, 0, 11),
                },
                Backend {
                    ip: Ipv4Addr::new(198, 18, 0, 12),
                },
            ],
            source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
            address: cloud_mock_sdk::AddressRequest::default(),
        }
    }

    fn stored(state: State) -> StoredLoadBalancer {
        let mut spec = spec("a");
        spec.vip = Some(Ipv4Addr::new(127, 77, 0, 9));
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
        assert_eq!(lb.vip, Ipv4Addr::new(127, 77, 0, 9));
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
            vec![Ipv4Addr::new(198, 18, 0, 11), Ipv4Addr::new(198, 18, 0, 12)]
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
        let observed = [(Ipv4Addr::new(198, 18, 0, 12), BackendHealth::Unhealthy)];
        let lb = to_wire(&stored(State::Active), &observed);
        assert_eq!(
            lb.health,
            vec![
                BackendStatus {
                    ip: Ipv4Addr::new(198, 18, 0, 11),
                    health: BackendHealth::Unknown
                },
                BackendStatus {
                    ip: Ipv4Addr::new(198, 18, 0, 12),
                    health: BackendHealth::Unhealthy
                },
            ]
        );
        assert_eq!(lb.version, 3);
        assert_eq!(lb.spec.vip, Some(Ipv4Addr::new(127, 77, 0, 9)));
    }
}
