//! Real packets through the nftables layout (`tandem_proxy_rules::nft`), loaded with
//! `nft -f` into a node of the `tandem-netlab` virtual cluster: a load-balancer IP routed
//! unchanged to the node (passthrough: not a local address there), its source ranges, its
//! node port, both traffic policies Local, session affinity, hairpin, rejection. Root only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::Write as _;
use std::net::{Ipv4Addr, TcpListener};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use tandem_netlab::{EchoClient, Topology};
use tandem_nftables::{Transaction, render};
use tandem_proxy_rules::model::ProxyState;
use tandem_proxy_rules::nft::layout;

const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);

/// A cluster whose pods run the echo; `None` (the test is skipped) unless root.
fn cluster(nodes: usize, pods_per_node: &[u32]) -> Option<Topology> {
    if !is_root() {
        eprintln!("skipped: needs root");
        return None;
    }
    let topo = Topology::builder()
        .nodes(nodes)
        .pods_per_node(pods_per_node)
        .handle_signals(false)
        .build()
        .unwrap();
    // Passthrough: the edge routes the LB IP to node 1 unchanged.
    let node = topo.node(1).unwrap();
    route_via(&topo.edge().netns, LB_IP, node.ip);
    Some(topo)
}

/// Replaces table `ip tandem` on `node` with the layout of `state` for it, as one
/// `nft -f` transaction.
fn load(node: &tandem_netlab::Node, state: &ProxyState) {
    let ruleset = layout::build(state, &node_named(&node.name));
    let mut child = node
        .netns
        .command("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let text = render::transaction(&Transaction::replace_all(&ruleset));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success(), "nft -f refused:\n{text}");
}

/// The reference LoadBalancer Service (source range 203.0.113.0/24, node port 30166)
/// with the given pods as endpoints, on the echo's port.
fn lb_state(topo: &Topology, pods: &[&tandem_netlab::Pod]) -> ProxyState {
    let port = topo.echo_http_port();
    reference_state(
        pods.iter()
            .map(|pod| endpoint(pod.ip.octets(), port, &pod.node_name))
            .collect(),
    )
}

fn client() -> EchoClient {
    EchoClient::locate()
        .unwrap()
        .with_timeout(Duration::from_secs(2))
}

#[test]
fn lb_ip_reaches_a_pod_masqueraded_from_an_allowed_source_and_is_dropped_otherwise() {
    let Some(topo) = cluster(1, &[1]) else {
        return;
    };
    let node = topo.node(1).unwrap();
    let pod = topo.pods_on(1).next().unwrap();
    load(node, &lb_state(&topo, &[pod]));

    let url = format!("http://{LB_IP}:80/");
    let reply = client()
        .http_get(&topo.client_in_range().netns, &url)
        .expect("allowed client gets through");
    assert_eq!(reply.pod, pod.name);
    // externalTrafficPolicy Cluster: the pod sees the node (its address towards the pod,
    // the pod network's gateway), not the client.
    let gateway = topo.pod_network().gateway(node.index).unwrap();
    assert_eq!(reply.client.ip(), gateway);
    // Outside the source ranges: dropped, so the connection attempt runs into the
    // client's timeout (a reject would refuse it at once, forwarding would reach the pod).
    let started = Instant::now();
    let refused = client().http_get(&topo.client_out_of_range().netns, &url);
    assert!(refused.is_err(), "disallowed client got {refused:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "refused, not dropped"
    );
}

#[test]
fn node_port_reaches_a_pod_on_another_node_masqueraded() {
    let Some(topo) = cluster(2, &[0, 1]) else {
        return;
    };
    let node1 = topo.node(1).unwrap();
    let pod = topo.pods_on(2).next().unwrap();
    load(node1, &lb_state(&topo, &[pod]));
    // Node ports have no source ranges: the client outside them gets through too.
    let reply = client()
        .http_get(
            &topo.client_out_of_range().netns,
            &format!("http://{}:30166/", node1.ip),
        )
        .expect("node port reachable");
    assert_eq!(reply.pod, pod.name);
    assert_eq!(reply.client.ip(), node1.ip);
}

#[test]
fn external_traffic_policy_local_keeps_the_client_address() {
    let Some(topo) = cluster(2, &[1, 1]) else {
        return;
    };
    let node1 = topo.node(1).unwrap();
    let local = topo.pods_on(1).next().unwrap();
    let remote = topo.pods_on(2).next().unwrap();
    let mut state = lb_state(&topo, &[local, remote]);
    state.edit_services(|svc| {
        svc.external_traffic_policy_local = true;
    });
    load(node1, &state);
    let allowed = topo.client_in_range();
    for url in [
        format!("http://{LB_IP}:80/"),
        format!("http://{}:30166/", node1.ip),
    ] {
        // Only the local pod, and it sees the client itself.
        for _ in 0..4 {
            let reply = client().http_get(&allowed.netns, &url).unwrap();
            assert_eq!(reply.pod, local.name, "{url}");
            assert_eq!(reply.client.ip(), allowed.ip, "{url}");
        }
    }
}

#[test]
fn session_affinity_keeps_a_client_on_one_pod() {
    let Some(topo) = cluster(2, &[1, 1]) else {
        return;
    };
    let node1 = topo.node(1).unwrap();
    let pods: Vec<_> = topo.pods().iter().collect();
    let mut state = lb_state(&topo, &pods);
    state.edit_services(|svc| {
        svc.session_affinity_timeout = Some(60);
    });
    load(node1, &state);
    let url = format!("http://{LB_IP}:80/");
    let first = client()
        .http_get(&topo.client_in_range().netns, &url)
        .unwrap();
    for _ in 0..8 {
        let reply = client()
            .http_get(&topo.client_in_range().netns, &url)
            .unwrap();
        assert_eq!(reply.pod, first.pod);
    }
}

#[test]
fn a_pod_reaching_its_own_service_is_masqueraded() {
    let Some(topo) = cluster(1, &[1]) else {
        return;
    };
    let node = topo.node(1).unwrap();
    let pod = topo.pods_on(1).next().unwrap();
    load(node, &lb_state(&topo, &[pod]));
    // Hairpin: without the masquerade the pod would answer itself directly and the
    // connection would never complete.
    let reply = client()
        .http_get(&pod.netns, "http://10.43.35.197:80/")
        .expect("hairpin connection");
    assert_eq!(reply.pod, pod.name);
    let gateway = topo.pod_network().gateway(node.index).unwrap();
    assert_eq!(reply.client.ip(), gateway);
}

#[test]
fn a_service_without_endpoints_is_rejected_before_reaching_the_node() {
    let Some(topo) = cluster(1, &[0]) else {
        return;
    };
    let node = topo.node(1).unwrap();
    load(node, &lb_state(&topo, &[]));
    // Something of the node's own listens on the node port and on port 80 of the LB IP
    // (local here): without the reject, connections would reach it and hang there.
    node.netns
        .exec_checked(["ip", "addr", "add", &format!("{LB_IP}/32"), "dev", "lo"])
        .unwrap();
    let _listeners: Vec<TcpListener> = [80, 30166]
        .into_iter()
        .map(|port| {
            node.netns
                .run_in_thread(move || TcpListener::bind(("0.0.0.0", port)))
                .unwrap()
                .unwrap()
        })
        .collect();
    for url in [
        format!("http://{LB_IP}:80/"),
        format!("http://{}:30166/", node.ip),
    ] {
        let started = Instant::now();
        let refused = client().http_get(&topo.client_in_range().netns, &url);
        assert!(refused.is_err(), "{url}: {refused:?}");
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "{url}: not rejected"
        );
    }
}

#[test]
fn external_traffic_policy_local_without_a_local_pod_drops_outsiders_but_not_the_node() {
    let Some(topo) = cluster(2, &[0, 1]) else {
        return;
    };
    let node1 = topo.node(1).unwrap();
    let remote = topo.pods_on(2).next().unwrap();
    let mut state = lb_state(&topo, &[remote]);
    state.edit_services(|svc| {
        svc.external_traffic_policy_local = true;
        // The node's own address is no allowed source of the reference ranges.
        svc.load_balancer_source_ranges.clear();
    });
    load(node1, &state);
    let url = format!("http://{LB_IP}:80/");
    let started = Instant::now();
    let dropped = client().http_get(&topo.client_in_range().netns, &url);
    assert!(dropped.is_err(), "{dropped:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "not dropped"
    );
    // The node itself short-cuts to the cluster-wide endpoints.
    let reply = client().http_get(&node1.netns, &url).unwrap();
    assert_eq!(reply.pod, remote.name);
}

#[test]
fn internal_traffic_policy_local_keeps_cluster_ip_traffic_on_the_node() {
    let Some(topo) = cluster(2, &[2, 1]) else {
        return;
    };
    let node1 = topo.node(1).unwrap();
    let pods: Vec<_> = topo.pods().iter().collect();
    let mut state = lb_state(&topo, &pods);
    state.edit_services(|svc| {
        svc.internal_traffic_policy_local = true;
    });
    load(node1, &state);
    let local: Vec<&str> = topo.pods_on(1).map(|pod| pod.name.as_str()).collect();
    let from = topo.pods_on(1).next().unwrap();
    for _ in 0..8 {
        let reply = client()
            .http_get(&from.netns, "http://10.43.35.197:80/")
            .unwrap();
        assert!(local.contains(&reply.pod.as_str()), "{}", reply.pod);
    }
}
