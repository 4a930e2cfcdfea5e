//! What the health-check node ports of externalTrafficPolicy Local Services answer: the
//! load balancer sends a Service's traffic only to nodes with ready local endpoints.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::model::{NodeConfig, ProxyState};

/// Headers kube-proxy sets on every health-check answer.
pub const RESPONSE_HEADERS: &[(&str, &str)] = &[
    ("Content-Type", "application/json"),
    ("X-Content-Type-Options", "nosniff"),
];

/// One health-check server to run: a Service with externalTrafficPolicy Local and its
/// `healthCheckNodePort`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HealthCheckService {
    pub namespace: String,
    pub name: String,
    pub port: u16,
    /// Distinct IPs of ready, non-terminating endpoints of the Service on this node.
    pub local_endpoints: usize,
}

/// One entry per Service (not per Service port) with externalTrafficPolicy Local and a
/// health-check node port, sorted by namespace and name.
pub fn health_check_services(state: &ProxyState, node: &NodeConfig) -> Vec<HealthCheckService> {
    let mut services: BTreeMap<(&str, &str), (u16, BTreeSet<IpAddr>)> = BTreeMap::new();
    for svc in state.services().values() {
        let Some(port) = svc
            .health_check_node_port
            .filter(|_| svc.external_traffic_policy_local)
        else {
            continue;
        };
        let entry = services
            .entry((svc.name.namespace.as_str(), svc.name.name.as_str()))
            .or_insert_with(|| (port, BTreeSet::new()));
        let local_ready = state
            .endpoints()
            .get(&svc.name)
            .into_iter()
            .flatten()
            .filter(|ep| ep.is_ready() && ep.node_name.as_deref() == Some(node.node_name.as_str()));
        entry.1.extend(local_ready.map(|ep| ep.ip));
    }
    services
        .into_iter()
        .map(|((namespace, name), (port, ips))| HealthCheckService {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            port,
            local_endpoints: ips.len(),
        })
        .collect()
}

impl HealthCheckService {
    /// 200 when this node has a ready local endpoint, 503 otherwise.
    pub fn status_code(&self) -> u16 {
        if self.local_endpoints > 0 { 200 } else { 503 }
    }

    /// The body, e.g. `{"service": {"namespace": "s2", "name": "local"}, "localEndpoints": 2}`:
    /// kube-proxy's fields and order, on one line (kube-proxy indents the same JSON over
    /// several lines).
    pub fn response_body(&self) -> String {
        format!(
            r#"{{"service": {{"namespace": {}, "name": {}}}, "localEndpoints": {}}}"#,
            json_string(&self.namespace),
            json_string(&self.name),
            self.local_endpoints
        )
    }
}

fn json_string(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

/// The health-check Services of the proxiers of both families as one list: a Service of
/// both families has one health-check node port, and its servers answer for both. A pod
/// has an address of each family, so its local endpoints are counted in one family, the
/// one with more.
pub fn merge_families(
    families: impl IntoIterator<Item = Vec<HealthCheckService>>,
) -> Vec<HealthCheckService> {
    let mut merged: BTreeMap<(String, String), HealthCheckService> = BTreeMap::new();
    for service in families.into_iter().flatten() {
        let key = (service.namespace.clone(), service.name.clone());
        match merged.get_mut(&key) {
            Some(seen) => seen.local_endpoints = seen.local_endpoints.max(service.local_endpoints),
            None => {
                merged.insert(key, service);
            }
        }
    }
    merged.into_values().collect()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use tandem_common::{IpFamily, Protocol};

    use super::*;
    use crate::model::{Endpoint, ServicePort, ServicePortName};

    fn port(name: &str, port: &str, local: bool, health: Option<u16>) -> ServicePort {
        ServicePort {
            name: ServicePortName {
                namespace: "s2".into(),
                name: name.into(),
                port: port.into(),
            },
            protocol: Protocol::Tcp,
            cluster_ip: Some(Ipv4Addr::new(10, 96, 0, 12).into()),
            port: 80,
            node_port: Some(30082),
            external_ips: vec![],
            load_balancer_ingress: vec![],
            load_balancer_source_ranges: vec![],
            session_affinity_timeout: None,
            external_traffic_policy_local: local,
            health_check_node_port: health,
            internal_traffic_policy_local: false,
        }
    }

    fn ep(last: u8, port: u16, node: &str, ready: bool, terminating: bool) -> Endpoint {
        Endpoint {
            ip: Ipv4Addr::new(10, 244, 1, last).into(),
            port,
            ready,
            serving: ready,
            terminating,
            node_name: Some(node.into()),
            hints: None,
        }
    }

    fn node() -> NodeConfig {
        NodeConfig::new("node-a", None)
    }

    #[test]
    fn counts_distinct_ready_local_ips_across_ports() {
        let http = port("local", "http", true, Some(32000));
        let https = port("local", "https", true, Some(32000));
        let mut state = ProxyState::new(IpFamily::V4);
        state.insert_endpoints(
            http.name.clone(),
            vec![
                ep(5, 80, "node-a", true, false),
                ep(6, 80, "node-a", true, false),
                ep(7, 80, "node-b", true, false),
            ],
        );
        state.insert_endpoints(
            https.name.clone(),
            vec![
                ep(5, 443, "node-a", true, false),
                ep(8, 443, "node-a", false, false),
                ep(9, 443, "node-a", true, true),
            ],
        );
        state.insert_service(http);
        state.insert_service(https);
        let services = health_check_services(&state, &node());
        assert_eq!(
            services,
            [HealthCheckService {
                namespace: "s2".into(),
                name: "local".into(),
                port: 32000,
                local_endpoints: 2
            }]
        );
        assert_eq!(services[0].status_code(), 200);
        assert_eq!(
            services[0].response_body(),
            r#"{"service": {"namespace": "s2", "name": "local"}, "localEndpoints": 2}"#
        );
    }

    #[test]
    fn no_local_endpoints_is_503_and_cluster_policy_gets_no_server() {
        let mut state = ProxyState::new(IpFamily::V4);
        let local = port("local", "", true, Some(32001));
        let cluster = port("cluster", "", false, None);
        state.insert_endpoints(local.name.clone(), vec![ep(7, 80, "node-b", true, false)]);
        state.insert_service(local);
        state.insert_service(cluster);
        let services = health_check_services(&state, &node());
        assert_eq!(services.len(), 1);
        assert_eq!(services[0].local_endpoints, 0);
        assert_eq!(services[0].status_code(), 503);
        assert_eq!(
            services[0].response_body(),
            r#"{"service": {"namespace": "s2", "name": "local"}, "localEndpoints": 0}"#
        );
    }

    #[test]
    fn body_is_valid_json_for_any_name() {
        let svc = HealthCheckService {
            namespace: "a\"b".into(),
            name: "c\\d".into(),
            port: 1,
            local_endpoints: 3,
        };
        let parsed: serde_json::Value = serde_json::from_str(&svc.response_body()).unwrap();
        assert_eq!(parsed["service"]["namespace"], "a\"b");
        assert_eq!(parsed["service"]["name"], "c\\d");
        assert_eq!(parsed["localEndpoints"], 3);
    }

    #[test]
    fn the_families_of_a_service_share_one_server_counting_pods_once() {
        let service = |name: &str, port, local_endpoints| HealthCheckService {
            namespace: "default".into(),
            name: name.into(),
            port,
            local_endpoints,
        };
        let merged = merge_families([
            vec![service("echo", 30381, 2), service("v4-only", 30382, 1)],
            vec![service("echo", 30381, 2), service("v6-only", 30383, 0)],
        ]);
        assert_eq!(
            merged,
            [
                service("echo", 30381, 2),
                service("v4-only", 30382, 1),
                service("v6-only", 30383, 0)
            ]
        );
    }
}
