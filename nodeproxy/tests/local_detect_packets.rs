//! Real packets through the rules each mode's data path programs for each
//! `--detect-local-mode`, in the virtual cluster of `tandem-netlab` (pods on the node's
//! `cni0` bridge, host side `vethN`): a pod on the node reaching a cluster IP keeps its
//! address, a client outside the cluster routed to the cluster IP is masqueraded; a
//! detector that does not describe the pod (another node's CIDR, another bridge) makes the
//! pod's connection masqueraded too, so the match is what decides. Root only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::Ipv4Addr;
use std::time::Duration;

use common::*;
use ipnet::IpNet;
use tandem_common::ProxyMode;
use tandem_netlab::{EchoClient, Topology};
use tandem_proxy_rules::model::{LocalDetector, NodeConfig};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 43, 35, 197);
const MODES: [ProxyMode; 2] = [ProxyMode::Iptables, ProxyMode::Nftables];

/// The source address the server saw for a GET to the cluster IP from `netns`.
fn seen_from(netns: &tandem_netlab::Netns) -> Ipv4Addr {
    let reply = EchoClient::locate()
        .unwrap()
        .with_timeout(Duration::from_secs(2))
        .http_get(netns, &format!("http://{CLUSTER_IP}:80/"))
        .unwrap_or_else(|e| panic!("no answer from {}: {e}", netns.name()));
    match reply.client.ip() {
        std::net::IpAddr::V4(ip) => ip,
        other => panic!("an IPv6 client {other}"),
    }
}

#[test]
fn pods_keep_their_address_and_outside_clients_are_masqueraded_under_each_mode() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let topo = Topology::builder()
        .nodes(1)
        .pods_per_node(&[2])
        .handle_signals(false)
        .build()
        .unwrap();
    let node = topo.node(1).unwrap();
    let mut pods = topo.pods_on(1);
    let (client_pod, server) = (pods.next().unwrap(), pods.next().unwrap());
    let state = reference_state(vec![endpoint(
        server.ip.octets(),
        topo.echo_http_port(),
        &server.node_name,
    )]);
    let gateway = topo.pod_network().gateway(node.index).unwrap();
    let node_cidr = IpNet::V4(topo.pod_network().node_cidr(node.index).unwrap());
    assert!(node_cidr.contains(&std::net::IpAddr::V4(client_pod.ip)));
    // A client outside the cluster, routed to the cluster IP through the node.
    let outside = &topo.edge().netns;
    route_via(outside, CLUSTER_IP, node.ip);
    assert_ne!(topo.edge().node_network_ip, gateway);

    let bridge = |name: &str| LocalDetector::BridgeInterface(name.parse().unwrap());
    let prefix = |name: &str| LocalDetector::InterfaceNamePrefix(name.parse().unwrap());
    let describes_the_pod = [
        LocalDetector::ClusterCidr("10.244.0.0/16".parse().unwrap()),
        LocalDetector::NodeCidr(node_cidr),
        bridge("cni0"),
        prefix("cni"),
    ];
    let misses_the_pod = [
        LocalDetector::NodeCidr("10.244.200.0/24".parse().unwrap()),
        bridge("cni9"),
        prefix("veth"),
    ];
    let config = |detector: &LocalDetector| NodeConfig {
        node_ip: Some(node.ip.into()),
        local_detector: detector.clone(),
        ..node_named(&node.name)
    };
    for mode in MODES {
        for detector in describes_the_pod.clone() {
            program(node, mode, config(&detector), &state);
            let at = format!("{mode} {detector:?}");
            assert_eq!(seen_from(&client_pod.netns), client_pod.ip, "{at}: the pod");
            assert_eq!(seen_from(outside), gateway, "{at}: outside");
        }
        // The pod's packets come in on cni0 (routed by the bridge's address), never on
        // its veth: a detector by another bridge, prefix or node CIDR masquerades it.
        for detector in misses_the_pod.clone() {
            program(node, mode, config(&detector), &state);
            assert_eq!(
                seen_from(&client_pod.netns),
                gateway,
                "{mode} {detector:?}: the pod"
            );
        }
    }
}
