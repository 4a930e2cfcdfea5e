use std::net::IpAddr;

use k8s_openapi::api::core::v1::{ClientIPConfig, SessionAffinityConfig};

use super::*;
use crate::observe::convert::fixtures::{nginx, port, spn};
use crate::observe::convert::state::proxy_state;

#[test]
fn bad_values_are_skipped_and_reported_without_losing_the_rest() {
    let mut service = nginx();
    let spec = service.spec.as_mut().unwrap();
    spec.load_balancer_source_ranges = Some(vec![
        "nonsense".into(),
        "203.0.113.9/24".into(),
        "2001:db8::/32".into(),
    ]);
    spec.external_ips = Some(vec!["1.2.3.4".into(), "1.2.3".into()]);
    spec.ports = Some(vec![
        port(Some("http"), "TCP", 80, Some(30166)),
        port(Some("bad"), "ICMP", 81, None),
        port(Some("huge"), "TCP", 70000, None),
    ]);
    let out = proxy_state([&service], [], IpFamily::V4);
    assert_eq!(out.state.services().len(), 1);
    let port = &out.state.services()[&spn("nginx-service", "http")];
    // Host bits are cleared, as the kernel would store the range.
    assert_eq!(
        port.load_balancer_source_ranges,
        vec!["203.0.113.0/24".parse::<IpNet>().unwrap()]
    );
    assert_eq!(port.external_ips, vec![IpAddr::from([1, 2, 3, 4])]);
    let fields: Vec<_> = out
        .skipped
        .iter()
        .map(|s| match s {
            Skipped::ServiceValue { field, .. } => *field,
            Skipped::SliceValue { field, .. } => *field,
            Skipped::ServiceCidrValue { .. } => "spec.cidrs",
        })
        .collect();
    // The IPv6 range is the IPv6 proxier's, not an error.
    assert_eq!(
        fields,
        vec![
            "spec.externalIPs",
            "spec.loadBalancerSourceRanges",
            "spec.ports.protocol",
            "spec.ports.port"
        ]
    );
}

#[test]
fn headless_external_name_and_ipv6_services_get_no_ports() {
    let mut headless = nginx();
    headless.spec.as_mut().unwrap().cluster_ip = Some("None".into());
    headless.spec.as_mut().unwrap().cluster_ips = Some(vec!["None".into()]);
    let mut v6 = nginx();
    v6.metadata.name = Some("v6".into());
    v6.spec.as_mut().unwrap().cluster_ip = Some("fd00::1".into());
    v6.spec.as_mut().unwrap().cluster_ips = Some(vec!["fd00::1".into()]);
    let mut external = nginx();
    external.metadata.name = Some("ext".into());
    external.spec.as_mut().unwrap().type_ = Some("ExternalName".into());
    let out = proxy_state([&headless, &v6, &external], [], IpFamily::V4);
    assert!(out.state.services().is_empty());
    assert!(out.skipped.is_empty());
}

#[test]
fn dual_stack_with_ipv6_primary_uses_the_ipv4_cluster_ip() {
    let mut service = nginx();
    service.spec.as_mut().unwrap().cluster_ip = Some("fd00::1".into());
    service.spec.as_mut().unwrap().cluster_ips = Some(vec!["fd00::1".into(), "10.43.0.9".into()]);
    let out = proxy_state([&service], [], IpFamily::V4);
    assert_eq!(
        out.state.services()[&spn("nginx-service", "http")].cluster_ip,
        Some(IpAddr::from([10, 43, 0, 9]))
    );
}

#[test]
fn session_affinity_timeout_defaults_and_is_read() {
    let mut service = nginx();
    service.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into());
    let out = proxy_state([&service], [], IpFamily::V4);
    assert_eq!(
        out.state.services()[&spn("nginx-service", "http")].session_affinity_timeout,
        Some(10_800)
    );
    service.spec.as_mut().unwrap().session_affinity_config = Some(SessionAffinityConfig {
        client_ip: Some(ClientIPConfig {
            timeout_seconds: Some(60),
        }),
    });
    let out = proxy_state([&service], [], IpFamily::V4);
    assert_eq!(
        out.state.services()[&spn("nginx-service", "http")].session_affinity_timeout,
        Some(60)
    );
}

#[test]
fn local_policy_only_for_node_port_and_load_balancer_services() {
    let mut lb = nginx();
    lb.spec.as_mut().unwrap().external_traffic_policy = Some("Local".into());
    lb.spec.as_mut().unwrap().health_check_node_port = Some(32000);
    let mut cluster_ip = lb.clone();
    cluster_ip.metadata.name = Some("plain".into());
    cluster_ip.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
    let out = proxy_state([&lb, &cluster_ip], [], IpFamily::V4);
    let lb_port = &out.state.services()[&spn("nginx-service", "http")];
    assert!(lb_port.external_traffic_policy_local);
    assert_eq!(lb_port.health_check_node_port, Some(32000));
    let plain = &out.state.services()[&spn("plain", "http")];
    assert!(!plain.external_traffic_policy_local);
    assert_eq!(plain.health_check_node_port, None);
    assert_eq!(plain.node_port, None);
    assert!(plain.load_balancer_ingress.is_empty());
    assert!(plain.load_balancer_source_ranges.is_empty());
}

#[test]
fn internal_traffic_policy_local_applies_to_every_type() {
    let mut lb = nginx();
    lb.spec.as_mut().unwrap().internal_traffic_policy = Some("Local".into());
    let mut cluster_ip = lb.clone();
    cluster_ip.metadata.name = Some("plain".into());
    cluster_ip.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
    let mut default = nginx();
    default.metadata.name = Some("default".into());
    default.spec.as_mut().unwrap().internal_traffic_policy = Some("Cluster".into());
    let out = proxy_state([&lb, &cluster_ip, &default], [], IpFamily::V4);
    let itp_local = |name| out.state.services()[&spn(name, "http")].internal_traffic_policy_local;
    assert!(itp_local("nginx-service"));
    assert!(itp_local("plain"));
    assert!(!itp_local("default"));
    assert!(!out.state.services()[&spn("nginx-service", "http")].external_traffic_policy_local);
}

#[test]
fn proxy_ip_mode_is_read() {
    let mut service = nginx();
    service
        .status
        .as_mut()
        .unwrap()
        .load_balancer
        .as_mut()
        .unwrap()
        .ingress
        .as_mut()
        .unwrap()[0]
        .ip_mode = Some("Proxy".into());
    let out = proxy_state([&service], [], IpFamily::V4);
    assert_eq!(
        out.state.services()[&spn("nginx-service", "http")].load_balancer_ingress[0].ip_mode,
        IpMode::Proxy
    );
}
