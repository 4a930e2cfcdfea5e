use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::LoadBalancerIngress as K8sIngress;
use tandem_common::Protocol;
use tandem_proxy_rules::model::{IpMode, LoadBalancerIngress};

use super::*;
use crate::observe::convert::fixtures::{endpoint, nginx, slice, spn};

#[test]
fn reference_service_converts_to_the_reference_state() {
    let services = [nginx()];
    let slices = [slice(
        "nginx-abc",
        "nginx-service",
        &[(Some("http"), 80)],
        vec![
            endpoint("10.244.1.5", "node-a", Some(true), None),
            endpoint("10.244.2.7", "node-b", None, None),
        ],
    )];
    let out = proxy_state(&services, &slices, IpFamily::V4);
    assert_eq!(out.skipped, vec![]);
    let name = spn("nginx-service", "http");
    let port = &out.state.services()[&name];
    assert_eq!(port.protocol, Protocol::Tcp);
    assert_eq!(port.cluster_ip, Some(Ipv4Addr::new(10, 43, 35, 197).into()));
    assert_eq!(port.port, 80);
    assert_eq!(port.node_port, Some(30166));
    assert_eq!(
        port.load_balancer_ingress,
        vec![LoadBalancerIngress {
            ip: Ipv4Addr::new(198, 51, 100, 20).into(),
            ip_mode: IpMode::Vip
        }]
    );
    assert_eq!(
        port.load_balancer_source_ranges,
        vec!["203.0.113.0/24".parse::<IpNet>().unwrap()]
    );
    assert_eq!(port.session_affinity_timeout, None);
    assert!(!port.external_traffic_policy_local);
    let endpoints = &out.state.endpoints()[&name];
    assert_eq!(endpoints.len(), 2);
    assert!(
        endpoints
            .iter()
            .all(|e| e.ready && !e.terminating && e.port == 80)
    );
    assert_eq!(endpoints[0].node_name.as_deref(), Some("node-a"));
}

/// The dual-stack reference Service (`nodeproxy/rules/tests/data/`), as each family's
/// proxier sees it: its cluster IP, ingress IP, source range, external IP and
/// EndpointSlice of that family only, and nothing reported as skipped.
#[test]
fn each_family_sees_its_own_half_of_a_dual_stack_service() {
    let mut service = nginx();
    let spec = service.spec.as_mut().unwrap();
    spec.ip_families = Some(vec!["IPv4".into(), "IPv6".into()]);
    spec.cluster_ips = Some(vec!["10.43.35.197".into(), "fd00:10:96::197".into()]);
    spec.load_balancer_source_ranges =
        Some(vec!["203.0.113.0/24".into(), "2001:db8:203::/64".into()]);
    spec.external_ips = Some(vec!["2001:db8:1::1".into(), "192.0.2.1".into()]);
    let status = service.status.as_mut().unwrap();
    status.load_balancer.as_mut().unwrap().ingress = Some(
        ["198.51.100.20", "2001:db8:51:100::20"]
            .map(|ip| K8sIngress {
                ip: Some(ip.into()),
                ..Default::default()
            })
            .to_vec(),
    );
    let v4_slice = slice(
        "nginx-v4",
        "nginx-service",
        &[(Some("http"), 80)],
        vec![endpoint("10.244.1.5", "node-a", Some(true), None)],
    );
    let mut v6_slice = slice(
        "nginx-v6",
        "nginx-service",
        &[(Some("http"), 80)],
        vec![endpoint("fd00:10:244:1::5", "node-a", Some(true), None)],
    );
    v6_slice.address_type = "IPv6".into();
    let name = spn("nginx-service", "http");
    for (family, cluster_ip, ingress, range, external, endpoint) in [
        (
            IpFamily::V4,
            "10.43.35.197",
            "198.51.100.20",
            "203.0.113.0/24",
            "192.0.2.1",
            "10.244.1.5",
        ),
        (
            IpFamily::V6,
            "fd00:10:96::197",
            "2001:db8:51:100::20",
            "2001:db8:203::/64",
            "2001:db8:1::1",
            "fd00:10:244:1::5",
        ),
    ] {
        let out = proxy_state([&service], [&v4_slice, &v6_slice], family);
        assert!(out.skipped.is_empty(), "{family}: {:?}", out.skipped);
        let port = &out.state.services()[&name];
        assert_eq!(
            port.cluster_ip,
            Some(cluster_ip.parse().unwrap()),
            "{family}"
        );
        let ingress_ips: Vec<IpAddr> = port.load_balancer_ingress.iter().map(|i| i.ip).collect();
        assert_eq!(
            ingress_ips,
            [ingress.parse::<IpAddr>().unwrap()],
            "{family}"
        );
        assert_eq!(
            port.load_balancer_source_ranges,
            [range.parse::<IpNet>().unwrap()],
            "{family}"
        );
        assert_eq!(port.external_ips, [external.parse::<IpAddr>().unwrap()]);
        let endpoints: Vec<IpAddr> = out.state.endpoints()[&name].iter().map(|e| e.ip).collect();
        assert_eq!(endpoints, [endpoint.parse::<IpAddr>().unwrap()], "{family}");
    }
    // An IPv4-only Service has no IPv6 rules at all.
    let out = proxy_state([&nginx()], [&v4_slice], IpFamily::V6);
    assert!(out.state.services().is_empty() && out.skipped.is_empty());
}
