//! Real packets through the rules the node proxy programs, in the virtual cluster of
//! `tandem-netlab`: a load-balancer IP routed unchanged to a node (passthrough mode, the
//! LB IP is not a local address there). Root only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

use common::*;
use tandem_common::{IpFamily, Protocol};
use tandem_netlab::Topology;
use tandem_nodeproxy::datapath::iptables::Syncer;
use tandem_nodeproxy::datapath::iptables::backend::Backend;
use tandem_nodeproxy::datapath::iptables::restore::RestoreMode;

const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);
const POD_PORT: u16 = 8080;
const LB: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(LB_IP, 80));

/// Packets and bytes counters of the rules of `chain` whose text contains `target`.
fn packets(
    netns: &tandem_netlab::Netns,
    backend: Backend,
    table: &str,
    chain: &str,
    target: &str,
) -> u64 {
    let listing = netns
        .exec_checked([
            backend.iptables(),
            "-t",
            table,
            "-L",
            chain,
            "-v",
            "-n",
            "-x",
        ])
        .unwrap();
    listing
        .lines()
        .filter(|l| l.contains(target))
        .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// A TCP server in a pod echoing each line prefixed with the client address it sees;
/// serves the `connections` expected client connections, at most ten lines each.
fn tcp_pod(pod: &tandem_netlab::Pod, connections: usize) {
    let listener = pod
        .netns
        .run_in_thread(|| TcpListener::bind(("0.0.0.0", POD_PORT)))
        .unwrap()
        .unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(connections) {
            let Ok(stream) = stream else { break };
            std::thread::spawn(move || {
                let peer = stream
                    .peer_addr()
                    .map(|p| p.ip().to_string())
                    .unwrap_or_default();
                let mut writer = stream.try_clone().unwrap();
                for line in BufReader::new(stream).lines().take(10) {
                    let Ok(line) = line else { break };
                    if writer
                        .write_all(format!("{peer} {line}\n").as_bytes())
                        .is_err()
                    {
                        break;
                    }
                }
            });
        }
    });
}

/// A connection to `to` made from inside `netns` (the socket stays there).
fn connect(netns: &tandem_netlab::Netns, to: SocketAddr) -> std::io::Result<TcpStream> {
    netns
        .run_in_thread(move || {
            let stream = TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
            stream.set_read_timeout(Some(Duration::from_secs(2)))?;
            Ok(stream)
        })
        .unwrap()
}

/// Send one line and read the pod's answer: `<address the pod saw> <line>`.
fn round_trip(stream: &mut TcpStream, line: &str) -> String {
    stream.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut answer = String::new();
    reader.read_line(&mut answer).unwrap();
    answer.trim_end().to_owned()
}

/// The virtual cluster of one test, without echo servers; `None` (the test is skipped)
/// unless running as root.
fn topology(nodes: usize, pods_per_node: &[u32]) -> Option<Topology> {
    if !is_root() {
        eprintln!("skipped: needs root");
        return None;
    }
    let topo = Topology::builder()
        .nodes(nodes)
        .pods_per_node(pods_per_node)
        .without_echo()
        .handle_signals(false)
        .build()
        .unwrap();
    Some(topo)
}

/// A full sync by a new syncer on the node; returns the restore modes it used.
fn sync_on(
    node: &tandem_netlab::Node,
    backend: Backend,
    ruleset: &tandem_proxy_rules::ruleset::Ruleset,
) -> Vec<RestoreMode> {
    let ruleset = ruleset.clone();
    node.netns
        .run_in_thread(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let done = runtime
                .block_on(Syncer::new(backend).sync(&ruleset))
                .unwrap();
            done.into_iter().map(|t| t.mode).collect()
        })
        .unwrap()
}

#[test]
fn lb_ip_reaches_a_pod_from_an_allowed_source_and_is_dropped_on_the_node_otherwise() {
    let Some(topo) = topology(1, &[1]) else {
        return;
    };
    let node = topo.node(1).unwrap();
    let pod = topo.pods_on(1).next().unwrap();

    tcp_pod(pod, 1);

    let state = reference_state(vec![endpoint(pod.ip.octets(), POD_PORT, &node.name)]);
    let ruleset = tandem_proxy_rules::build(&state, &node_named(&node.name));
    let backend = Backend::Nft;
    sync_on(node, backend, &ruleset);
    // Passthrough: the edge routes the LB IP to the node unchanged.
    route_via(&topo.edge().netns, LB_IP, node.ip);

    let mut allowed =
        connect(&topo.client_in_range().netns, LB).expect("allowed client gets through");
    let answer = round_trip(&mut allowed, "first");
    let (seen_by_pod, echoed) = answer.split_once(' ').unwrap();
    assert_eq!(echoed, "first");
    // KUBE-FW marks for masquerade: the pod sees the node, not the client.
    assert_ne!(seen_by_pod, topo.client_in_range().ip.to_string());

    // A restarted node proxy (nothing remembered: a full write of the tables) keeps the
    // established connection working, also when the table is replaced in flush mode.
    assert_eq!(
        sync_on(node, backend, &ruleset),
        vec![RestoreMode::Flush; 2]
    );
    assert_eq!(
        round_trip(&mut allowed, "after restart"),
        format!("{seen_by_pod} after restart")
    );

    let dropped_before = packets(
        &node.netns,
        backend,
        "filter",
        "KUBE-PROXY-FIREWALL",
        "DROP",
    );
    let error = connect(&topo.client_out_of_range().netns, LB)
        .expect_err("disallowed client must not connect");
    assert!(
        matches!(
            error.kind(),
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
        ),
        "dropped silently, not rejected: {error}"
    );
    assert!(
        packets(
            &node.netns,
            backend,
            "nat",
            "KUBE-FW-6IM33IEVEEV7U3GP",
            "KUBE-MARK-DROP"
        ) >= 1
    );
    assert!(
        packets(
            &node.netns,
            backend,
            "filter",
            "KUBE-PROXY-FIREWALL",
            "DROP"
        ) > dropped_before,
        "the FORWARD hook of KUBE-PROXY-FIREWALL dropped the SYN"
    );
}

/// A UDP server in a pod answering every datagram with `name`; ends after `limit` requests
/// or 20 s of silence.
fn udp_pod(pod: &tandem_netlab::Pod, name: &'static str, limit: usize) {
    let socket = pod
        .netns
        .run_in_thread(|| UdpSocket::bind(("0.0.0.0", POD_PORT)))
        .unwrap()
        .unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    std::thread::spawn(move || {
        let mut buffer = [0u8; 64];
        for _ in 0..limit {
            let Ok((_, from)) = socket.recv_from(&mut buffer) else {
                break;
            };
            let _ = socket.send_to(name.as_bytes(), from);
        }
    });
}

#[test]
fn udp_through_a_service_follows_an_endpoint_replacement() {
    let Some(topo) = topology(1, &[2]) else {
        return;
    };
    let node = topo.node(1).unwrap();
    let pods: Vec<_> = topo.pods_on(1).collect();
    udp_pod(pods[0], "old", 10);
    udp_pod(pods[1], "new", 10);

    let udp_state = |pod: &tandem_netlab::Pod| {
        let mut state = reference_state(vec![endpoint(pod.ip.octets(), POD_PORT, &node.name)]);
        state.edit_services(|service| {
            service.protocol = Protocol::Udp;
        });
        state
    };
    let (before, after) = (udp_state(pods[0]), udp_state(pods[1]));
    let config = node_named(&node.name);
    let (rules_before, rules_after) = (
        tandem_proxy_rules::build(&before, &config),
        tandem_proxy_rules::build(&after, &config),
    );
    let backend = Backend::Nft;
    let syncer = node
        .netns
        .run_in_thread(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let mut syncer = Syncer::new(backend);
            runtime.block_on(syncer.sync(&rules_before)).unwrap();
            syncer
        })
        .unwrap();
    route_via(&topo.edge().netns, LB_IP, node.ip);

    // One client socket (one conntrack entry) for the whole test.
    let client = topo
        .client_in_range()
        .netns
        .run_in_thread(|| UdpSocket::bind(("0.0.0.0", 0)))
        .unwrap()
        .unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let ask = || {
        client.send_to(b"who", (LB_IP, 80)).unwrap();
        let mut buffer = [0u8; 64];
        let (n, _) = client.recv_from(&mut buffer).unwrap();
        String::from_utf8_lossy(&buffer[..n]).into_owned()
    };
    assert_eq!(ask(), "old");

    // The endpoint is replaced: new rules plus the stale-flow deletion, as a sync does.
    node.netns
        .run_in_thread(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let mut syncer = syncer;
            runtime.block_on(async {
                syncer.sync(&rules_after).await.unwrap();
                assert_eq!(
                    tandem_nodeproxy::conntrack::clear_stale(&before, &after, IpFamily::V4).await,
                    0
                );
            });
        })
        .unwrap();
    // The same client socket (same flow) now reaches the new pod, though the old one still
    // answers. (On this machine's kernel the NATed entry is already gone after the rule
    // change, so this does not isolate the deletion; kernel.rs checks its commands.)
    assert_eq!(ask(), "new");
}

#[test]
fn node_port_from_outside_reaches_a_pod_on_another_node_masqueraded() {
    let Some(topo) = topology(2, &[0, 1]) else {
        return;
    };
    let (node1, node2) = (topo.node(1).unwrap(), topo.node(2).unwrap());
    let pod = topo.pods_on(2).next().unwrap();
    tcp_pod(pod, 1);
    let state = reference_state(vec![endpoint(pod.ip.octets(), POD_PORT, &node2.name)]);
    let ruleset = tandem_proxy_rules::build(&state, &node_named(&node1.name));
    sync_on(node1, Backend::Nft, &ruleset);

    // NodePorts have no source ranges: the client outside them gets through too.
    let client = topo.client_out_of_range();
    let mut stream =
        connect(&client.netns, SocketAddr::from((node1.ip, 30166))).expect("node port reachable");
    let answer = round_trip(&mut stream, "hello");
    // Masqueraded on node 1: the pod on node 2 sees node 1's address, not the client's.
    assert_eq!(answer, format!("{} hello", node1.ip));
    assert_ne!(node1.ip, client.ip);
}

#[test]
fn connections_survive_a_rolling_update_of_the_only_local_pod() {
    let Some(topo) = topology(2, &[1, 1]) else {
        return;
    };
    let (node1, node2) = (topo.node(1).unwrap(), topo.node(2).unwrap());
    let (old, new) = (
        topo.pods_on(1).next().unwrap(),
        topo.pods_on(2).next().unwrap(),
    );
    tcp_pod(old, 3);
    tcp_pod(new, 1);
    let local_state = |endpoints| {
        let mut state = reference_state(endpoints);
        state.edit_services(|service| {
            service.external_traffic_policy_local = true;
        });
        state
    };
    let config = node_named(&node1.name);
    let backend = Backend::Nft;
    let old_ready = endpoint(old.ip.octets(), POD_PORT, &node1.name);
    let new_ready = endpoint(new.ip.octets(), POD_PORT, &node2.name);
    sync_on(
        node1,
        backend,
        &tandem_proxy_rules::build(&local_state(vec![old_ready.clone()]), &config),
    );
    // Passthrough: the edge routes the LB IP to node 1, the node with the local pod.
    route_via(&topo.edge().netns, LB_IP, node1.ip);
    let client = topo.client_in_range();
    let mut established = connect(&client.netns, LB).expect("the local pod answers");
    // externalTrafficPolicy Local: the pod sees the client itself.
    assert_eq!(
        round_trip(&mut established, "before"),
        format!("{} before", client.ip)
    );

    // The rolling update: the old pod terminates (still serving), the new one is ready
    // on another node. Node 1's health check now fails, but until the load balancer
    // notices, new connections keep arriving here.
    let terminating = tandem_proxy_rules::model::Endpoint {
        ready: false,
        serving: true,
        terminating: true,
        ..old_ready
    };
    sync_on(
        node1,
        backend,
        &tandem_proxy_rules::build(&local_state(vec![terminating, new_ready.clone()]), &config),
    );
    assert_eq!(
        round_trip(&mut established, "during"),
        format!("{} during", client.ip),
        "the established connection survives"
    );
    let mut arriving = connect(&client.netns, LB)
        .expect("a new connection is served by the terminating local pod, not dropped");
    assert_eq!(
        round_trip(&mut arriving, "late"),
        format!("{} late", client.ip)
    );

    // The old pod is gone: with no local endpoint left, node 1 drops new connections.
    sync_on(
        node1,
        backend,
        &tandem_proxy_rules::build(&local_state(vec![new_ready]), &config),
    );
    connect(&client.netns, LB).expect_err("no local endpoint: dropped");
}

/// One UDP request from a new socket (a new flow) in `netns`, connected to `to` so that
/// only an answer from `to` itself counts; an error when the send fails or nothing answers
/// within a second.
fn ask_udp(netns: &tandem_netlab::Netns, to: SocketAddr) -> std::io::Result<String> {
    let socket = netns
        .run_in_thread(|| UdpSocket::bind(("0.0.0.0", 0)))
        .unwrap()
        .unwrap();
    socket.connect(to).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    socket.send(b"who")?;
    let mut buffer = [0u8; 64];
    let n = socket.recv(&mut buffer)?;
    Ok(String::from_utf8_lossy(&buffer[..n]).into_owned())
}

#[test]
fn internal_traffic_policy_local_keeps_cluster_ip_traffic_on_the_node() {
    const REQUESTS: usize = 20;
    let Some(topo) = topology(2, &[2, 1]) else {
        return;
    };
    let (node1, node2) = (topo.node(1).unwrap(), topo.node(2).unwrap());
    let on_node1: Vec<_> = topo.pods_on(1).collect();
    let (local_pod, client_pod) = (on_node1[0], on_node1[1]);
    let remote_pod = topo.pods_on(2).next().unwrap();
    // From the pod and the node, twice (ready, then terminating).
    udp_pod(local_pod, "local", 4 * REQUESTS);
    udp_pod(remote_pod, "remote", REQUESTS);
    let itp_local_state = |endpoints| {
        let mut state = reference_state(endpoints);
        state.edit_services(|service| {
            service.protocol = Protocol::Udp;
            service.internal_traffic_policy_local = true;
        });
        state
    };
    let config = node_named(&node1.name);
    let backend = Backend::Nft;
    let local_ready = endpoint(local_pod.ip.octets(), POD_PORT, &node1.name);
    let remote_ready = endpoint(remote_pod.ip.octets(), POD_PORT, &node2.name);
    let cluster_ip = SocketAddr::from((Ipv4Addr::new(10, 43, 35, 197), 80));
    let sync = |endpoints| {
        let state = itp_local_state(endpoints);
        sync_on(node1, backend, &tandem_proxy_rules::build(&state, &config));
        // As the node proxy does after a sync (conntrack.rs): a UDP flow's entry would
        // keep its old endpoint, and a request whose random source port an earlier one
        // used went to node 1's pod after it had left (ECONNREFUSED, 1 CI run in many).
        // conntrack exits 1 when it deleted nothing.
        let _ = node1.netns.exec([
            "conntrack",
            "-D",
            "-p",
            "udp",
            "--orig-dst",
            &cluster_ip.ip().to_string(),
        ]);
    };
    let answers = |netns: &tandem_netlab::Netns| -> Vec<String> {
        (0..REQUESTS)
            .map(|_| ask_udp(netns, cluster_ip).unwrap())
            .collect()
    };
    let all_local = vec!["local".to_owned(); REQUESTS];

    // Endpoints on both nodes: from a pod and from node 1 itself, every request stays on
    // node 1 (with policy Cluster, 20 in a row would all be local once in a million).
    sync(vec![local_ready.clone(), remote_ready.clone()]);
    assert_eq!(answers(&client_pod.netns), all_local, "from a pod");
    assert_eq!(answers(&node1.netns), all_local, "from the node");

    // The rolling update: node 1's pod terminates but still serves, and keeps the traffic.
    let terminating = tandem_proxy_rules::model::Endpoint {
        ready: false,
        serving: true,
        terminating: true,
        ..local_ready
    };
    sync(vec![terminating, remote_ready.clone()]);
    assert_eq!(
        answers(&client_pod.netns),
        all_local,
        "terminating, from a pod"
    );
    assert_eq!(
        answers(&node1.netns),
        all_local,
        "terminating, from the node"
    );

    // Node 1 has no endpoint left: its cluster IP is dropped, by the rule that says so,
    // while the node port (externalTrafficPolicy Cluster) still reaches node 2's pod.
    sync(vec![remote_ready]);
    let dropped_before = packets(&node1.netns, backend, "filter", "KUBE-SERVICES", "DROP");
    let from_pod = ask_udp(&client_pod.netns, cluster_ip).expect_err("dropped");
    assert!(
        matches!(
            from_pod.kind(),
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
        ),
        "dropped silently in FORWARD, not rejected: {from_pod}"
    );
    // Dropped in OUTPUT: the node's own sender is told so at once.
    let from_node = ask_udp(&node1.netns, cluster_ip).expect_err("dropped");
    assert_eq!(from_node.kind(), std::io::ErrorKind::PermissionDenied);
    assert_eq!(
        packets(&node1.netns, backend, "filter", "KUBE-SERVICES", "DROP"),
        dropped_before + 2,
        "both requests were dropped by the 'has no local endpoints' rule"
    );
    assert_eq!(
        ask_udp(
            &topo.client_out_of_range().netns,
            SocketAddr::from((node1.ip, 30166))
        )
        .unwrap(),
        "remote"
    );
}

#[test]
fn the_drop_fallback_drops_with_and_without_the_kubelets_chains() {
    for with_kubelet in [false, true] {
        let Some(topo) = topology(1, &[1]) else {
            return;
        };
        let node = topo.node(1).unwrap();
        let pod = topo.pods_on(1).next().unwrap();
        tcp_pod(pod, 1);
        let backend = Backend::Nft;
        if with_kubelet {
            node.netns
                .run_in_thread(move || install_kubelet_chains(backend))
                .unwrap();
        }
        let state = reference_state(vec![endpoint(pod.ip.octets(), POD_PORT, &node.name)]);
        // Without counters: packets of the topology may cross the kubelet's jumps meanwhile
        // (tests/kubelet.rs compares counters, on a node that carries no traffic).
        let kubelet_before = node
            .netns
            .run_in_thread(move || without_counters(&kubelet_lines(backend)));
        sync_on(
            node,
            backend,
            &tandem_proxy_rules::build(&state, &node_named(&node.name)),
        );
        if with_kubelet {
            assert_eq!(
                node.netns
                    .run_in_thread(move || without_counters(&kubelet_lines(backend)))
                    .unwrap(),
                kubelet_before.unwrap(),
                "the sync changed the kubelet's chains"
            );
        }
        route_via(&topo.edge().netns, LB_IP, node.ip);
        let mut allowed = connect(&topo.client_in_range().netns, LB)
            .unwrap_or_else(|e| panic!("kubelet {with_kubelet}: allowed client: {e}"));
        assert!(round_trip(&mut allowed, "hello").ends_with(" hello"));

        let dropped = || {
            packets(
                &node.netns,
                backend,
                "filter",
                "KUBE-PROXY-FIREWALL",
                "DROP",
            )
        };
        let before = dropped();
        // Passthrough: forwarded to the pod, dropped in FORWARD (no kubelet chain hooks it).
        let error = connect(&topo.client_out_of_range().netns, LB)
            .expect_err("a client outside the source ranges must not connect");
        assert!(
            matches!(
                error.kind(),
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
            ),
            "kubelet {with_kubelet}: dropped silently: {error}"
        );
        // From the node itself (its address is outside the ranges too): dropped in OUTPUT.
        let error = connect(&node.netns, LB).expect_err("the node is outside the ranges");
        assert!(
            matches!(
                error.kind(),
                std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::WouldBlock
                    | std::io::ErrorKind::PermissionDenied
            ),
            "kubelet {with_kubelet}: from the node: {error}"
        );
        assert!(
            dropped() >= before + 2,
            "kubelet {with_kubelet}: KUBE-PROXY-FIREWALL dropped {} packets",
            dropped() - before
        );
    }
}
