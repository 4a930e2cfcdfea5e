//! The conntrack reconciler against the kernel: UDP entries made by real packets through
//! the node proxy's rules (and some inserted with `conntrack -I`), judged after an
//! endpoint change whose own deletions were skipped, as when a packet races the sync.
//! Root only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::time::Duration;

use common::*;
use prometheus_client::registry::Registry;
use tandem_common::ProxyMode;
use tandem_nftables::ctnetlink::{self, Conntrack, Flow};
use tandem_nodeproxy::backend::BackendChoice;
use tandem_nodeproxy::conntrack::{Reconciled, reconcile, reconcile_blocking};
use tandem_nodeproxy::datapath;
use tandem_nodeproxy::metrics::{FamilyLabels, Metrics};
use tandem_proxy_rules::conntrack::ServingUdpEndpoints;
use tandem_proxy_rules::model::{Endpoint, IpFamily, Protocol, ProxyState};

const POD_PORT: u16 = 8080;
/// The reference state's nginx Service, made UDP.
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 43, 35, 197);
const SERVICE: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(CLUSTER_IP, 80));
const NODE_PORT: u16 = 30166;

/// A UDP server in a pod answering every datagram with `name`, until 20 s of silence.
fn udp_pod(pod: &tandem_netlab::Pod, name: &'static str) {
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
        while let Ok((_, from)) = socket.recv_from(&mut buffer) {
            let _ = socket.send_to(name.as_bytes(), from);
        }
    });
}

/// A client socket in `netns` (its flow is one conntrack entry for the whole test).
fn client(netns: &tandem_netlab::Netns) -> UdpSocket {
    let socket = netns
        .run_in_thread(|| UdpSocket::bind(("0.0.0.0", 0)))
        .unwrap()
        .unwrap();
    socket.connect(SERVICE).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    socket
}

fn ask(socket: &UdpSocket) -> String {
    socket.send(b"who").unwrap();
    let mut buffer = [0u8; 64];
    let n = socket.recv(&mut buffer).unwrap();
    String::from_utf8_lossy(&buffer[..n]).into_owned()
}

fn udp_state(endpoints: Vec<Endpoint>) -> ProxyState {
    let mut state = reference_state(endpoints);
    for service in state.services.values_mut() {
        service.protocol = Protocol::Udp;
    }
    state
}

/// The UDP entries of `family` the kernel holds now (in the calling thread's namespace).
fn udp_entries(family: IpFamily) -> Vec<Flow> {
    Conntrack::open()
        .unwrap()
        .list(family, ctnetlink::IPPROTO_UDP)
        .unwrap()
        .flows
}

fn from_client(entries: &[Flow], socket: &UdpSocket) -> Vec<SocketAddr> {
    let source = socket.local_addr().unwrap().port();
    entries
        .iter()
        .filter(|flow| {
            flow.original.source.port() == source && flow.original.destination == SERVICE
        })
        .map(|flow| flow.reply.source)
        .collect()
}

fn reconciles_udp_entries_of_a_removed_endpoint(mode: ProxyMode) {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let topo = tandem_netlab::Topology::builder()
        .nodes(1)
        .pods_per_node(&[3])
        .without_echo()
        .handle_signals(false)
        .build()
        .unwrap();
    let node = topo.node(1).unwrap();
    let pods: Vec<_> = topo.pods_on(1).collect();
    let (old, new, client_pod) = (pods[0], pods[1], pods[2]);
    udp_pod(old, "old");
    udp_pod(new, "new");
    let endpoint_of = |pod: &tandem_netlab::Pod| endpoint(pod.ip.octets(), POD_PORT, &node.name);
    let (before, after) = (
        udp_state(vec![endpoint_of(old)]),
        udp_state(vec![endpoint_of(new)]),
    );
    let (stale_client, serving_client) = (client(&client_pod.netns), client(&client_pod.netns));
    let config = node_named(&node.name);
    let (node_ip, client_ip, old_ip, new_ip) = (node.ip, client_pod.ip, old.ip, new.ip);

    block_on_in(&node.netns, move || async move {
        let metrics = Metrics::register(&mut Registry::default());
        let mut path = datapath::start(mode, BackendChoice::Auto, config)
            .await
            .unwrap();
        let ports = before.services.keys().cloned().collect();
        path.update(&before, &ports);
        assert!(path.apply(&metrics).await, "{mode}: first sync");
        assert_eq!(ask(&stale_client), "old");

        // The endpoint is replaced, and the change's own deletions do not run: the entry
        // the stale client made keeps sending it to the old pod.
        path.update(&after, &ports);
        assert!(path.apply(&metrics).await, "{mode}: second sync");
        assert_eq!(
            ask(&stale_client),
            "old",
            "{mode}: the entry outlives the rules"
        );
        assert_eq!(ask(&serving_client), "new");
        // And one to the node port, DNATed to the old pod, as conntrack -I makes it.
        run(
            "conntrack",
            &[
                "-I",
                "-p",
                "udp",
                "-s",
                &client_ip.to_string(),
                "-d",
                &node_ip.to_string(),
                "--sport",
                "4000",
                "--dport",
                &NODE_PORT.to_string(),
                "-r",
                &old_ip.to_string(),
                "-q",
                &client_ip.to_string(),
                "--reply-port-src",
                &POD_PORT.to_string(),
                "--reply-port-dst",
                "4000",
                "-t",
                "120",
            ],
        );
        let old_pod = SocketAddr::from((old_ip, POD_PORT));
        let entries = udp_entries(IpFamily::V4);
        assert_eq!(from_client(&entries, &stale_client), [old_pod]);
        let node_port_entries = |entries: &[Flow]| {
            entries
                .iter()
                .filter(|flow| flow.original.destination == SocketAddr::from((node_ip, NODE_PORT)))
                .count()
        };
        assert_eq!(node_port_entries(&entries), 1);

        let done = reconcile(ServingUdpEndpoints::of(&after), IpFamily::V4, &metrics)
            .await
            .expect("reconciled");
        assert_eq!(
            (done.deleted, done.failed),
            (2, 0),
            "{mode}: {done:?} of {entries:#?}"
        );
        let deleted = |metrics: &Metrics| {
            metrics
                .conntrack_reconciler_deleted
                .get_or_create(&FamilyLabels::of(IpFamily::V4))
                .get()
        };
        assert_eq!(deleted(&metrics), 2);
        let entries = udp_entries(IpFamily::V4);
        assert_eq!(from_client(&entries, &stale_client), []);
        assert_eq!(node_port_entries(&entries), 0);
        let new_pod = SocketAddr::from((new_ip, POD_PORT));
        assert_eq!(from_client(&entries, &serving_client), [new_pod]);

        // The stale client's next datagram goes through the new rules; nothing is left
        // to delete.
        assert_eq!(ask(&stale_client), "new");
        assert_eq!(ask(&serving_client), "new");
        let again = reconcile(ServingUdpEndpoints::of(&after), IpFamily::V4, &metrics).await;
        assert_eq!(again.map(|done| done.deleted), Some(0));
        assert_eq!(deleted(&metrics), 2);
    });
}

#[test]
fn nftables_mode_reconciles_udp_entries_of_a_removed_endpoint() {
    reconciles_udp_entries_of_a_removed_endpoint(ProxyMode::Nftables);
}

#[test]
fn iptables_mode_reconciles_udp_entries_of_a_removed_endpoint() {
    reconciles_udp_entries_of_a_removed_endpoint(ProxyMode::Iptables);
}

/// Inserts a UDP (or `protocol`) entry `client:4000 -> service` answered by `reply`.
fn insert(protocol: &str, client: &str, service: SocketAddr, reply: SocketAddr) {
    let mut args = vec![
        "-I".to_owned(),
        "-p".into(),
        protocol.into(),
        "-s".into(),
        client.into(),
        "-d".into(),
        service.ip().to_string(),
        "--sport".into(),
        "4000".into(),
        "--dport".into(),
        service.port().to_string(),
        "-r".into(),
        reply.ip().to_string(),
        "-q".into(),
        client.into(),
        "--reply-port-src".into(),
        reply.port().to_string(),
        "--reply-port-dst".into(),
        "4000".into(),
        "-t".into(),
        "120".into(),
    ];
    if protocol == "tcp" {
        args.extend(["--state".into(), "ESTABLISHED".into()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run("conntrack", &args);
}

#[test]
fn ipv6_entries_are_reconciled_and_other_families_and_protocols_left_alone() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    in_fresh_netns(|_| async {
        let service: SocketAddr = "[fd00:43::10]:53".parse().unwrap();
        let serving: SocketAddr = "[fd00:244::5]:5353".parse().unwrap();
        let removed: SocketAddr = "[fd00:244::6]:5353".parse().unwrap();
        let v4_service: SocketAddr = "10.43.0.10:53".parse().unwrap();
        let v4_removed: SocketAddr = "10.244.1.6:5353".parse().unwrap();
        insert("udp", "fd00::9", service, serving);
        insert("udp", "fd00::a", service, removed);
        insert("tcp", "fd00::b", service, removed);
        insert("udp", "10.244.0.9", v4_service, v4_removed);

        let mut state = ProxyState::default();
        let mut dns = udp_state(vec![]).services.into_values().next().unwrap();
        dns.cluster_ip = Some(service.ip());
        dns.port = service.port();
        dns.node_port = None;
        dns.load_balancer_ingress.clear();
        let endpoint = Endpoint {
            ip: serving.ip(),
            port: serving.port(),
            ..endpoint([0, 0, 0, 0], 0, "node-a")
        };
        state.endpoints.insert(dns.name.clone(), vec![endpoint]);
        state.services.insert(dns.name.clone(), dns);

        let serving_endpoints = ServingUdpEndpoints::of(&state);
        let done = reconcile_blocking(IpFamily::V6, &serving_endpoints).unwrap();
        assert_eq!(
            done,
            Reconciled {
                listed: 2,
                deleted: 1,
                ..Reconciled::default()
            }
        );
        let left = udp_entries(IpFamily::V6);
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].reply.source, serving);
        // The TCP entry and the IPv4 one are not the IPv6 reconciler's.
        let tcp = run("conntrack", &["-L", "-f", "ipv6", "-p", "tcp"]);
        assert!(tcp.contains("src=fd00::b"), "{tcp}");
        assert_eq!(udp_entries(IpFamily::V4).len(), 1);
        // The IPv4 reconciler with no IPv4 Services has nothing to judge.
        let done = reconcile_blocking(IpFamily::V4, &ServingUdpEndpoints::default()).unwrap();
        assert_eq!((done.listed, done.deleted), (1, 0));
    });
}
