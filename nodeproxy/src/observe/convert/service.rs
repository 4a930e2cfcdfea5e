//! Services → their [`ServicePort`]s in one family, as kube-proxy's `serviceport.go`
//! makes them: one per port of a Service with a cluster IP of that family.

use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Service, ServicePort as K8sServicePort};
use tandem_common::{IpFamily, Protocol};
use tandem_proxy_rules::model::{IpMode, LoadBalancerIngress, ServicePort, ServicePortName};

use super::{Skipped, object_key, positive_port};

/// Services (and their EndpointSlices) carrying this label belong to another proxy.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// Set by the EndpointSlice controller on the slices of headless Services.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";

/// The label selector of the Service watch, as kube-proxy's: no Service another proxy
/// owns, no headless one. A label added to a live Service makes the API server send a
/// DELETED event for it, a label removed an ADDED one.
pub fn service_selector() -> String {
    format!("!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}")
}

/// kube-proxy's default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_TIMEOUT_SECONDS: u32 = 10_800;

/// What the node proxy keeps of one Service: its ports, converted, and the values left
/// out of them. Kept instead of the object itself, which is several times larger.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceEntry {
    pub ports: Vec<ServicePort>,
    pub skipped: Vec<Skipped>,
}

impl ServiceEntry {
    /// The Service as the proxier of `family` sees it (its external IPs and source ranges
    /// of every family: the state of `family` keeps its own).
    pub fn of(service: &Service, family: IpFamily) -> Self {
        let mut skipped = Vec::new();
        let ports = service_ports(service, family, &mut skipped);
        Self { ports, skipped }
    }
}

/// The Service ports of one Service in `family` (none for headless and ExternalName
/// Services, and none without a cluster IP of that family).
fn service_ports(
    service: &Service,
    family: IpFamily,
    skipped: &mut Vec<Skipped>,
) -> Vec<ServicePort> {
    let (namespace, name) = object_key(&service.metadata);
    let id = format!("{namespace}/{name}");
    let Some(spec) = service.spec.as_ref() else {
        return Vec::new();
    };
    let service_type = spec.type_.as_deref().unwrap_or("ClusterIP");
    if service_type == "ExternalName" {
        return Vec::new();
    }
    let mut skip = |field: &'static str, value: &str, reason: &'static str| {
        skipped.push(Skipped::ServiceValue {
            service: id.clone(),
            field,
            value: value.to_owned(),
            reason,
        });
    };

    let Some(cluster_ip) = cluster_ip_of(
        family,
        spec.cluster_ip.as_deref(),
        spec.cluster_ips.as_deref(),
    ) else {
        // Headless, not yet allocated, or of the other family only: this proxier writes
        // nothing for it.
        if let Some(value) = spec.cluster_ip.as_deref()
            && !value.is_empty()
            && value != "None"
            && value.parse::<IpAddr>().is_err()
        {
            skip("spec.clusterIP", value, "not an IP address");
        }
        return Vec::new();
    };

    let is_node_port = matches!(service_type, "NodePort" | "LoadBalancer");
    let is_load_balancer = service_type == "LoadBalancer";

    let external_ips = spec
        .external_ips
        .iter()
        .flatten()
        .filter_map(|value| match value.trim().parse::<IpAddr>() {
            Ok(ip) => Some(ip),
            Err(_) => {
                skip("spec.externalIPs", value, "not an IP address");
                None
            }
        })
        .collect::<Vec<_>>();

    let load_balancer_ingress = if is_load_balancer {
        service
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|ingress| {
                // Hostname-only ingress entries have nothing for iptables to match.
                let value = ingress.ip.as_deref()?;
                let ip = match value.trim().parse::<IpAddr>() {
                    Ok(ip) if family.holds(ip) => ip,
                    // The other proxier's, and so is a bad ipMode of it to report.
                    Ok(_) => return None,
                    Err(_) => {
                        skip("status.loadBalancer.ingress.ip", value, "not an IP address");
                        return None;
                    }
                };
                let ip_mode = match ingress.ip_mode.as_deref() {
                    Some("Proxy") => IpMode::Proxy,
                    None | Some("VIP") => IpMode::Vip,
                    Some(other) => {
                        skip(
                            "status.loadBalancer.ingress.ipMode",
                            other,
                            "unknown mode, using VIP",
                        );
                        IpMode::Vip
                    }
                };
                Some(LoadBalancerIngress { ip, ip_mode })
            })
            .collect()
    } else {
        Vec::new()
    };

    let load_balancer_source_ranges = if is_load_balancer {
        spec.load_balancer_source_ranges
            .iter()
            .flatten()
            .filter_map(|value| match value.trim().parse::<IpNet>() {
                Ok(net) => Some(net),
                Err(_) => {
                    skip("spec.loadBalancerSourceRanges", value, "not a CIDR");
                    None
                }
            })
            .collect()
    } else {
        Vec::new()
    };

    let session_affinity_timeout = match spec.session_affinity.as_deref() {
        Some("ClientIP") => {
            let configured = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            Some(match configured {
                None => DEFAULT_AFFINITY_TIMEOUT_SECONDS,
                Some(seconds) => match u32::try_from(seconds) {
                    Ok(seconds) if seconds > 0 => seconds,
                    _ => {
                        skip(
                            "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                            &seconds.to_string(),
                            "not a positive number, using the default",
                        );
                        DEFAULT_AFFINITY_TIMEOUT_SECONDS
                    }
                },
            })
        }
        _ => None,
    };

    let external_traffic_policy_local =
        is_node_port && spec.external_traffic_policy.as_deref() == Some("Local");
    let health_check_node_port = if external_traffic_policy_local && is_load_balancer {
        match spec.health_check_node_port.map(u16::try_from) {
            None => None,
            Some(Ok(port)) if port > 0 => Some(port),
            Some(_) => {
                skip(
                    "spec.healthCheckNodePort",
                    &format!("{:?}", spec.health_check_node_port),
                    "not a port number",
                );
                None
            }
        }
    } else {
        None
    };

    // Applies to every Service with a cluster IP, whatever its type (KEP-2086).
    let internal_traffic_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");

    let mut ports = Vec::new();
    for port in spec.ports.iter().flatten() {
        let port_name = port.name.clone().unwrap_or_default();
        let Some(protocol) = parse_protocol(port.protocol.as_deref()) else {
            skip(
                "spec.ports.protocol",
                port.protocol.as_deref().unwrap_or_default(),
                "unknown protocol",
            );
            continue;
        };
        let Some(service_port) = positive_port(port.port) else {
            skip(
                "spec.ports.port",
                &port.port.to_string(),
                "not a port number",
            );
            continue;
        };
        let node_port = node_port(port, is_node_port, &mut skip);
        ports.push(ServicePort {
            name: ServicePortName {
                namespace: namespace.clone(),
                name: name.clone(),
                port: port_name,
            },
            protocol,
            cluster_ip: Some(cluster_ip),
            port: service_port,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ingress: load_balancer_ingress.clone(),
            load_balancer_source_ranges: load_balancer_source_ranges.clone(),
            session_affinity_timeout,
            external_traffic_policy_local,
            health_check_node_port,
            internal_traffic_policy_local,
        });
    }
    ports
}

fn node_port(
    port: &K8sServicePort,
    is_node_port: bool,
    skip: &mut impl FnMut(&'static str, &str, &'static str),
) -> Option<u16> {
    if !is_node_port {
        return None;
    }
    let value = port.node_port?;
    let parsed = positive_port(value);
    if parsed.is_none() {
        skip(
            "spec.ports.nodePort",
            &value.to_string(),
            "not a port number",
        );
    }
    parsed
}

/// The Service's cluster IP of `family`: `clusterIP` when it is of that family, else the
/// entry of that family in `clusterIPs` (the secondary family of a dual-stack Service).
fn cluster_ip_of(
    family: IpFamily,
    cluster_ip: Option<&str>,
    cluster_ips: Option<&[String]>,
) -> Option<IpAddr> {
    cluster_ip
        .into_iter()
        .chain(cluster_ips.into_iter().flatten().map(String::as_str))
        .filter_map(|value| value.trim().parse::<IpAddr>().ok())
        .find(|ip| family.holds(*ip))
}

fn parse_protocol(value: Option<&str>) -> Option<Protocol> {
    match value {
        None | Some("TCP") => Some(Protocol::Tcp),
        Some("UDP") => Some(Protocol::Udp),
        Some("SCTP") => Some(Protocol::Sctp),
        Some(_) => None,
    }
}

// The tests convert through `state::proxy_state`, which uses this file: in a file of their
// own, not inline, so that the files form no circle.
#[cfg(test)]
mod tests;
