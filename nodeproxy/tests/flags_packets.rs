//! Real packets through the rules the data path of each mode programs (`datapath::start`,
//! as the node proxy does) for kube-proxy's flags and the node's own IP, in the virtual
//! cluster of `tandem-netlab`: allowFromNode, `--masquerade-all`, `--nodeport-addresses`,
//! `--iptables-localhost-nodeports`, and the nftables mode's check of cluster IPs. Every
//! address and rule lives in the test's namespaces. Root only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use common::*;
use tandem_common::ProxyMode;
use tandem_netlab::{EchoClient, EchoReply, Topology};
use tandem_proxy_rules::model::{NodeConfig, NodePortAddresses, ProxyState};

const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 43, 35, 197);
const NODE_PORT: u16 = 30166;
/// A second address on the node's uplink, as of a second NIC.
const SECOND_ADDRESS: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 211);
const MODES: [ProxyMode; 2] = [ProxyMode::Iptables, ProxyMode::Nftables];

/// A cluster whose pods run the echo; `None` (the test is skipped) unless root.
fn cluster(pods: u32) -> Option<Topology> {
    if !is_root() {
        eprintln!("skipped: needs root");
        return None;
    }
    Some(
        Topology::builder()
            .nodes(1)
            .pods_per_node(&[pods])
            .handle_signals(false)
            .build()
            .unwrap(),
    )
}

/// node-1 as the node proxy sees it: its IP known, as from its Node object.
fn config(node: &tandem_netlab::Node) -> NodeConfig {
    NodeConfig {
        node_ip: Some(node.ip.into()),
        ..node_named(&node.name)
    }
}

/// The reference LoadBalancer (LB IP, node port 30166, cluster IP 10.43.35.197:80) with
/// `pod` as its endpoint on the echo's port, and `ranges` as its source ranges.
fn lb(topo: &Topology, pod: &tandem_netlab::Pod, ranges: &[&str]) -> ProxyState {
    let mut state = reference_state(vec![endpoint(
        pod.ip.octets(),
        topo.echo_http_port(),
        &pod.node_name,
    )]);
    state.edit_services(|svc| {
        if !svc.load_balancer_source_ranges.is_empty() {
            svc.load_balancer_source_ranges = ranges.iter().map(|r| r.parse().unwrap()).collect();
        }
    });
    state
}

fn client() -> EchoClient {
    EchoClient::locate()
        .unwrap()
        .with_timeout(Duration::from_secs(2))
}

/// An HTTP GET to `address:port` from `netns`, and how long it took.
fn get(
    netns: &tandem_netlab::Netns,
    address: Ipv4Addr,
    port: u16,
) -> (Result<EchoReply, String>, Duration) {
    let started = Instant::now();
    let reply = client()
        .http_get(netns, &format!("http://{address}:{port}/"))
        .map_err(|e| e.to_string());
    (reply, started.elapsed())
}

/// Refused at once (a reset or ICMP port unreachable), not left to time out.
fn assert_refused(outcome: (Result<EchoReply, String>, Duration), what: &str) {
    let (reply, took) = outcome;
    assert!(reply.is_err(), "{what}: answered {reply:?}");
    assert!(
        took < Duration::from_millis(1500),
        "{what}: timed out, not refused"
    );
}

/// Dropped: the attempt runs into the client's timeout.
fn assert_dropped(outcome: (Result<EchoReply, String>, Duration), what: &str) {
    let (reply, took) = outcome;
    assert!(reply.is_err(), "{what}: answered {reply:?}");
    assert!(
        took >= Duration::from_millis(1500),
        "{what}: refused, not dropped"
    );
}

#[test]
fn the_node_reaches_its_own_lb_ip_looped_back_when_a_source_range_holds_it() {
    let Some(topo) = cluster(1) else {
        return;
    };
    let node = topo.node(1).unwrap();
    let pod = topo.pods_on(1).next().unwrap();
    // An `ip route` to the VIP makes it local: the node's connection to it leaves and
    // comes back with the LB IP as its source.
    node.netns
        .exec_checked([
            "ip",
            "route",
            "add",
            "local",
            &format!("{LB_IP}/32"),
            "dev",
            "lo",
        ])
        .unwrap();
    let with_node = lb(&topo, pod, &["203.0.113.0/24", "198.18.0.0/24"]);
    let without_node = lb(&topo, pod, &["203.0.113.0/24"]);
    for mode in MODES {
        program(node, mode, config(node), &with_node);
        let (reply, _) = get(&node.netns, LB_IP, 80);
        assert_eq!(reply.expect("let in").pod, pod.name, "{mode}");

        program(node, mode, config(node), &without_node);
        let (reply, _) = get(&node.netns, LB_IP, 80);
        assert!(
            reply.is_err(),
            "{mode}: the node is outside the ranges: {reply:?}"
        );
    }
}

#[test]
fn masquerade_all_hides_pods_reaching_a_cluster_ip() {
    let Some(topo) = cluster(2) else {
        return;
    };
    let node = topo.node(1).unwrap();
    let mut pods = topo.pods_on(1);
    let (client_pod, server) = (pods.next().unwrap(), pods.next().unwrap());
    let state = lb(&topo, server, &["203.0.113.0/24"]);
    let gateway = topo.pod_network().gateway(node.index).unwrap();
    for mode in MODES {
        for masquerade_all in [false, true] {
            let settings = NodeConfig {
                masquerade_all,
                ..config(node)
            };
            program(node, mode, settings, &state);
            let (reply, _) = get(&client_pod.netns, CLUSTER_IP, 80);
            let seen = reply.expect("answered").client.ip();
            let expected = if masquerade_all {
                gateway
            } else {
                client_pod.ip
            };
            assert_eq!(seen, expected, "{mode} masquerade_all={masquerade_all}");
        }
    }
}

#[test]
fn node_ports_answer_only_on_the_given_addresses() {
    let Some(topo) = cluster(1) else {
        return;
    };
    let node = topo.node(1).unwrap();
    let pod = topo.pods_on(1).next().unwrap();
    node.netns
        .exec_checked([
            "ip",
            "addr",
            "add",
            &format!("{SECOND_ADDRESS}/24"),
            "dev",
            "eth0",
        ])
        .unwrap();
    let state = lb(&topo, pod, &["203.0.113.0/24"]);
    let outside = &topo.client_in_range().netns;
    for mode in MODES {
        // `primary` resolves to the node's IP.
        let primary = NodeConfig {
            node_port_addresses: NodePortAddresses::from_cidrs(&[IpAddr::V4(node.ip).into()]),
            ..config(node)
        };
        program(node, mode, primary, &state);
        let (reply, _) = get(outside, node.ip, NODE_PORT);
        assert_eq!(reply.expect("served").pod, pod.name, "{mode}");
        assert_refused(
            get(outside, SECOND_ADDRESS, NODE_PORT),
            &format!("{mode}: second address"),
        );

        // Every address (the iptables mode's default).
        program(node, mode, config(node), &state);
        for address in [node.ip, SECOND_ADDRESS] {
            let (reply, _) = get(outside, address, NODE_PORT);
            assert_eq!(reply.expect("served").pod, pod.name, "{mode} {address}");
        }
    }
}

#[test]
fn localhost_node_ports_follow_the_flag_in_the_iptables_mode_and_never_in_nftables() {
    let Some(topo) = cluster(1) else {
        return;
    };
    let node = topo.node(1).unwrap();
    let pod = topo.pods_on(1).next().unwrap();
    let state = lb(&topo, pod, &["203.0.113.0/24"]);
    let localhost = Ipv4Addr::LOCALHOST;
    let route_localnet = || {
        node.netns
            .exec_checked(["cat", "/proc/sys/net/ipv4/conf/all/route_localnet"])
            .unwrap()
            .trim()
            .to_owned()
    };

    let off = NodeConfig {
        localhost_node_ports: false,
        ..config(node)
    };
    program(node, ProxyMode::Iptables, off.clone(), &state);
    assert_eq!(route_localnet(), "0", "not needed, not set");
    assert_refused(get(&node.netns, localhost, NODE_PORT), "iptables, off");
    let (reply, _) = get(&node.netns, node.ip, NODE_PORT);
    assert_eq!(reply.expect("the node's IP still serves").pod, pod.name);

    program(node, ProxyMode::Iptables, config(node), &state);
    assert_eq!(route_localnet(), "1");
    let (reply, _) = get(&node.netns, localhost, NODE_PORT);
    assert_eq!(reply.expect("v1.21 serves localhost").pod, pod.name);

    for settings in [config(node), off] {
        program(node, ProxyMode::Nftables, settings, &state);
        assert_refused(get(&node.netns, localhost, NODE_PORT), "nftables");
    }
}

#[test]
fn the_nftables_mode_rejects_unserved_cluster_ip_ports_and_drops_unallocated_addresses() {
    let Some(topo) = cluster(2) else {
        return;
    };
    let node = topo.node(1).unwrap();
    let mut pods = topo.pods_on(1);
    let (client_pod, server) = (pods.next().unwrap(), pods.next().unwrap());
    let state = lb(&topo, server, &["203.0.113.0/24"]);
    // An unallocated address of the Service CIDR that would answer if forwarded: the
    // server pod holds it, and the node routes it there.
    let unallocated = Ipv4Addr::new(10, 43, 200, 1);
    server
        .netns
        .exec_checked([
            "ip",
            "addr",
            "add",
            &format!("{unallocated}/32"),
            "dev",
            "lo",
        ])
        .unwrap();
    route_via(&node.netns, unallocated, server.ip);
    let echo = topo.echo_http_port();
    let with_cidr = NodeConfig {
        service_cidrs: vec!["10.43.0.0/16".parse().unwrap()],
        ..config(node)
    };

    program(node, ProxyMode::Nftables, with_cidr.clone(), &state);
    let (reply, _) = get(&client_pod.netns, CLUSTER_IP, 80);
    assert_eq!(reply.expect("the served port").pod, server.name);
    assert_refused(
        get(&client_pod.netns, CLUSTER_IP, 81),
        "a port the cluster IP does not serve",
    );
    assert_refused(get(&node.netns, CLUSTER_IP, 81), "the same from the node");
    assert_dropped(
        get(&client_pod.netns, unallocated, echo),
        "an unallocated cluster IP",
    );

    // Without the Service CIDR, and in the iptables mode (v1.21), it is forwarded.
    for (mode, settings) in [
        (ProxyMode::Nftables, config(node)),
        (ProxyMode::Iptables, with_cidr),
    ] {
        program(node, mode, settings, &state);
        let (reply, _) = get(&client_pod.netns, unallocated, echo);
        assert_eq!(reply.expect("forwarded").pod, server.name, "{mode}");
    }
}
