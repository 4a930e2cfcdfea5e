use std::net::IpAddr;

use k8s_openapi::api::discovery::v1::Endpoint as K8sEndpoint;
use tandem_common::Protocol;

use super::*;
use crate::observe::convert::fixtures::{endpoint, nginx, port, slice, spn};
use crate::observe::convert::state::proxy_state;

#[test]
fn endpoints_join_slices_resolve_ports_by_name_and_keep_conditions() {
    let mut service = nginx();
    service.spec.as_mut().unwrap().ports = Some(vec![
        port(Some("http"), "TCP", 80, Some(30166)),
        port(Some("metrics"), "TCP", 9000, Some(30167)),
    ]);
    let slices = [
        slice(
            "a",
            "nginx-service",
            &[(Some("http"), 8080), (Some("metrics"), 9090)],
            vec![endpoint("10.244.1.5", "node-a", Some(true), Some(false))],
        ),
        slice(
            "b",
            "nginx-service",
            &[(Some("metrics"), 9090), (Some("http"), 8080)],
            vec![
                endpoint("10.244.2.7", "node-b", Some(false), Some(true)),
                // Also in slice "a", not ready here: the ready copy wins.
                endpoint("10.244.1.5", "node-a", Some(false), Some(false)),
            ],
        ),
        // A slice of another Service and an unlabelled slice contribute nothing here.
        slice(
            "c",
            "other",
            &[(Some("http"), 1)],
            vec![endpoint("10.244.3.3", "node-c", None, None)],
        ),
    ];
    let mut unlabelled = slices[0].clone();
    unlabelled.metadata.labels = None;
    let out = proxy_state([&service], slices.iter().chain([&unlabelled]), IpFamily::V4);
    let http = &out.state.endpoints()[&spn("nginx-service", "http")];
    assert_eq!(http.len(), 2);
    assert_eq!(
        (http[0].ip, http[0].port, http[0].ready, http[0].terminating),
        (IpAddr::from([10, 244, 1, 5]), 8080, true, false)
    );
    assert_eq!(
        (http[1].ip, http[1].ready, http[1].terminating),
        (IpAddr::from([10, 244, 2, 7]), false, true)
    );
    let metrics = &out.state.endpoints()[&spn("nginx-service", "metrics")];
    assert!(metrics.iter().all(|e| e.port == 9090));
    assert_eq!(out.state.endpoints().len(), 2);
}

#[test]
fn endpoint_hints_are_read_as_sets() {
    use k8s_openapi::api::discovery::v1::{ForNode, ForZone};
    let zone = |name: &str| ForZone { name: name.into() };
    let mut hinted = endpoint("10.244.1.5", "node-a", Some(true), Some(false));
    hinted.hints = Some(EndpointHints {
        for_zones: Some(vec![zone("zone-b"), zone("zone-a"), zone("zone-b")]),
        for_nodes: Some(vec![ForNode {
            name: "node-a".into(),
        }]),
    });
    let mut empty = endpoint("10.244.1.6", "node-a", Some(true), Some(false));
    empty.hints = Some(EndpointHints::default());
    let plain = endpoint("10.244.1.7", "node-a", Some(true), Some(false));
    let slices = [slice(
        "a",
        "nginx-service",
        &[(Some("http"), 8080)],
        vec![hinted, empty, plain],
    )];
    let out = proxy_state([&nginx()], &slices, IpFamily::V4);
    let http = &out.state.endpoints()[&spn("nginx-service", "http")];
    assert_eq!(http[0].zone_hints(), ["zone-a", "zone-b"]);
    assert_eq!(http[0].node_hints(), ["node-a"]);
    // Empty hints are no hints: kube-proxy counts the names.
    assert_eq!(
        (http[1].hints.as_ref(), http[2].hints.as_ref()),
        (None, None)
    );
}

#[test]
fn a_slice_keeps_its_endpoints_once_and_gives_each_port_its_target() {
    let ports = [(Some("http"), 8080), (Some("metrics"), 9090)];
    let two = slice(
        "a",
        "nginx-service",
        &ports,
        vec![
            endpoint("10.244.1.5", "node-a", None, None),
            endpoint("10.244.2.7", "node-b", None, None),
        ],
    );
    let entry = SliceEntry::of(&two, IpFamily::V4);
    assert_eq!(entry.endpoints.len(), 2);
    let served: Vec<&str> = entry.served_ports().map(|n| n.port.as_str()).collect();
    assert_eq!(served, ["http", "metrics"]);
    let metrics = port_endpoints(&spn("nginx-service", "metrics"), [&entry]);
    let targets: Vec<(IpAddr, u16)> = metrics.iter().map(|e| (e.ip, e.port)).collect();
    assert_eq!(
        targets,
        [
            (IpAddr::from([10, 244, 1, 5]), 9090),
            (IpAddr::from([10, 244, 2, 7]), 9090)
        ]
    );
    // Without endpoints a slice serves no port: its changes touch nothing.
    let empty = SliceEntry::of(&slice("b", "nginx-service", &ports, vec![]), IpFamily::V4);
    assert_eq!(empty.served_ports().count(), 0);
}

#[test]
fn unnamed_ports_match_unnamed_slice_ports() {
    let mut service = nginx();
    service.spec.as_mut().unwrap().ports = Some(vec![port(None, "UDP", 53, None)]);
    let mut s = slice(
        "a",
        "nginx-service",
        &[(None, 5353)],
        vec![endpoint("10.244.1.5", "node-a", None, None)],
    );
    s.endpoints.push(K8sEndpoint {
        addresses: vec!["junk".into()],
        ..Default::default()
    });
    let out = proxy_state([&service], [&s], IpFamily::V4);
    let name = spn("nginx-service", "");
    assert_eq!(out.state.services()[&name].protocol, Protocol::Udp);
    assert_eq!(out.state.endpoints()[&name][0].port, 5353);
    assert_eq!(out.skipped.len(), 1);
}
