//! The conntrack reconciler against the kernel: UDP entries made by real packets through
//! the node proxy's rules (and some inserted with `conntrack -I`), judged after an
//! endpoint change whose own deletions were skipped, as when a packet races the sync;
//! and TCP black holes (entries of SYNs that met no rules) among other TCP entries.
//! Root only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::time::Duration;

use common::*;
use prometheus_client::registry::Registry;
use tandem_common::ProxyMode;
use tandem_common::{IpFamily, Protocol};
use tandem_nftables::ctnetlink::{self, Conntrack, Flow};
use tandem_nodeproxy::conntrack::{Reconciled, reconcile, reconcile_blocking};
use tandem_nodeproxy::datapath;
use tandem_nodeproxy::datapath::iptables::backend::BackendChoice;
use tandem_nodeproxy::metrics::{FamilyLabels, Metrics};
use tandem_proxy_rules::conntrack::ServingEndpoints;
use tandem_proxy_rules::model::{Endpoint, NodeConfig, ProxyState};

const POD_PORT: u16 = 8080;
/// The reference state's nginx Service, made UDP (with an IPv6 cluster IP for IPv6).
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 43, 35, 197);
const CLUSTER_IP_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0xc5);
const SERVICE_PORT: u16 = 80;
const NODE_PORT: u16 = 30166;

fn service(family: IpFamily) -> SocketAddr {
    match family {
        IpFamily::V4 => SocketAddr::from((CLUSTER_IP, SERVICE_PORT)),
        IpFamily::V6 => SocketAddr::from((CLUSTER_IP_V6, SERVICE_PORT)),
    }
}

fn unspecified(family: IpFamily) -> IpAddr {
    match family {
        IpFamily::V4 => Ipv4Addr::UNSPECIFIED.into(),
        IpFamily::V6 => Ipv6Addr::UNSPECIFIED.into(),
    }
}

/// A UDP server in a pod answering every datagram of `family` with `name` and the
/// datagram, until 20 s of silence.
fn udp_pod(pod: &tandem_netlab::Pod, family: IpFamily, name: &'static str) {
    let socket = pod
        .netns
        .run_in_thread(move || UdpSocket::bind((unspecified(family), POD_PORT)))
        .unwrap()
        .unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    std::thread::spawn(move || {
        let mut buffer = [0u8; 64];
        while let Ok((n, from)) = socket.recv_from(&mut buffer) {
            let answer = [name.as_bytes(), b" ", &buffer[..n]].concat();
            let _ = socket.send_to(&answer, from);
        }
    });
}

/// A client socket in `netns` connected to the Service of `family` (its flow is one
/// conntrack entry for the whole test).
fn client(netns: &tandem_netlab::Netns, family: IpFamily) -> UdpSocket {
    let socket = netns
        .run_in_thread(move || UdpSocket::bind((unspecified(family), 0)))
        .unwrap()
        .unwrap();
    socket.connect(service(family)).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    socket
}

/// One request and the name of the pod that answers it. A request without an answer is
/// sent again a few times, as new IPv6 links take a moment (neighbour discovery); each
/// carries a number of its own, so a late answer to an earlier one is not taken for it.
fn ask(socket: &UdpSocket) -> String {
    static REQUESTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut buffer = [0u8; 64];
    for _ in 0..5 {
        let request = REQUESTS
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .to_string();
        socket.send(request.as_bytes()).unwrap();
        while let Ok(n) = socket.recv(&mut buffer) {
            let answer = String::from_utf8_lossy(&buffer[..n]).into_owned();
            if let Some((name, echoed)) = answer.split_once(' ')
                && echoed == request
            {
                return name.to_owned();
            }
        }
    }
    panic!("no answer from {:?}", socket.peer_addr());
}

/// The reference nginx Service over UDP in `family` (in IPv6 with a cluster IP of it
/// only, the state of IPv6 dropping its other addresses), with `endpoints`.
fn udp_state(family: IpFamily, endpoints: Vec<Endpoint>) -> ProxyState {
    let reference = reference_state(Vec::new());
    let nginx = reference
        .services()
        .values()
        .filter(|service| service.port == SERVICE_PORT)
        .map(|service| {
            let mut service = service.clone();
            service.protocol = Protocol::Udp;
            if family == IpFamily::V6 {
                service.cluster_ip = Some(CLUSTER_IP_V6.into());
            }
            service
        });
    let nginx_endpoints = (spn("default", "nginx-service", "http"), endpoints);
    ProxyState::from_entries(family, nginx, [nginx_endpoints])
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
    let service = socket.peer_addr().unwrap();
    entries
        .iter()
        .filter(|flow| {
            flow.original.source.port() == source && flow.original.destination == service
        })
        .map(|flow| flow.reply.source)
        .collect()
}

fn reconciles_udp_entries_of_a_removed_endpoint(mode: ProxyMode, family: IpFamily) {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let mut topology = tandem_netlab::Topology::builder()
        .nodes(1)
        .pods_per_node(&[3])
        .without_echo()
        .handle_signals(false);
    if family == IpFamily::V6 {
        topology = topology.ipv6();
    }
    let topo = topology.build().unwrap();
    let node = topo.node(1).unwrap();
    let pods: Vec<_> = topo.pods_on(1).collect();
    let (old, new, client_pod) = (pods[0], pods[1], pods[2]);
    udp_pod(old, family, "old");
    udp_pod(new, family, "new");
    let ip_of = |ip: Ipv4Addr, ip6: Option<Ipv6Addr>| -> IpAddr {
        match family {
            IpFamily::V4 => ip.into(),
            IpFamily::V6 => ip6.expect("a dual-stack topology").into(),
        }
    };
    let (node_ip, client_ip, old_ip, new_ip) = (
        ip_of(node.ip, node.ip6),
        ip_of(client_pod.ip, client_pod.ip6),
        ip_of(old.ip, old.ip6),
        ip_of(new.ip, new.ip6),
    );
    let endpoint_at = |ip: IpAddr| Endpoint {
        ip,
        ..endpoint([0, 0, 0, 0], POD_PORT, &node.name)
    };
    let (before, after) = (
        udp_state(family, vec![endpoint_at(old_ip)]),
        udp_state(family, vec![endpoint_at(new_ip)]),
    );
    let (stale_client, serving_client) = (
        client(&client_pod.netns, family),
        client(&client_pod.netns, family),
    );
    let mut config = node_named(&node.name);
    if family == IpFamily::V6 {
        config = NodeConfig {
            family,
            ..NodeConfig::new(&node.name, Some("fd00:10:244::/48".parse().unwrap()))
        };
    }

    block_on_in(&node.netns, move || async move {
        let metrics = Metrics::register(&mut Registry::default());
        let mut path = datapath::start(mode, BackendChoice::Auto, config)
            .await
            .unwrap();
        let ports = before.services().keys().cloned().collect();
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
        let entries = udp_entries(family);
        assert_eq!(from_client(&entries, &stale_client), [old_pod]);
        let node_port_entries = |entries: &[Flow]| {
            entries
                .iter()
                .filter(|flow| flow.original.destination == SocketAddr::from((node_ip, NODE_PORT)))
                .count()
        };
        assert_eq!(node_port_entries(&entries), 1);

        let done = reconcile(ServingEndpoints::of(&after), family, &metrics)
            .await
            .expect("reconciled");
        assert_eq!(
            (done.deleted, done.failed),
            (2, 0),
            "{mode} {family}: {done:?} of {entries:#?}"
        );
        let deleted = |metrics: &Metrics| {
            metrics
                .conntrack_reconciler_deleted
                .get_or_create(&FamilyLabels::of(family))
                .get()
        };
        assert_eq!(deleted(&metrics), 2);
        let entries = udp_entries(family);
        assert_eq!(from_client(&entries, &stale_client), []);
        assert_eq!(node_port_entries(&entries), 0);
        let new_pod = SocketAddr::from((new_ip, POD_PORT));
        assert_eq!(from_client(&entries, &serving_client), [new_pod]);

        // The stale client's next datagram goes through the new rules; nothing is left
        // to delete.
        assert_eq!(ask(&stale_client), "new");
        assert_eq!(ask(&serving_client), "new");
        let again = reconcile(ServingEndpoints::of(&after), family, &metrics).await;
        assert_eq!(again.map(|done| done.deleted), Some(0));
        assert_eq!(deleted(&metrics), 2);
    });
}

#[test]
fn nftables_mode_reconciles_udp_entries_of_a_removed_endpoint() {
    reconciles_udp_entries_of_a_removed_endpoint(ProxyMode::Nftables, IpFamily::V4);
}

#[test]
fn iptables_mode_reconciles_udp_entries_of_a_removed_endpoint() {
    reconciles_udp_entries_of_a_removed_endpoint(ProxyMode::Iptables, IpFamily::V4);
}

#[test]
fn nftables_mode_reconciles_ipv6_udp_entries_of_a_removed_endpoint() {
    reconciles_udp_entries_of_a_removed_endpoint(ProxyMode::Nftables, IpFamily::V6);
}

#[test]
fn iptables_mode_reconciles_ipv6_udp_entries_of_a_removed_endpoint() {
    reconciles_udp_entries_of_a_removed_endpoint(ProxyMode::Iptables, IpFamily::V6);
}

/// Inserts a UDP (or `protocol`) entry `client:4000 -> service` answered by `reply`.
fn insert(protocol: &str, client: &str, service: SocketAddr, reply: SocketAddr) {
    let tcp_state: &[&str] = if protocol == "tcp" {
        &["--state", "ESTABLISHED"]
    } else {
        &[]
    };
    insert_with(protocol, client, service, reply, tcp_state);
}

/// Inserts an entry `client:4000 -> service` whose reply comes from `reply`, with
/// `extra` arguments of `conntrack -I` (a TCP state, status bits).
fn insert_with(
    protocol: &str,
    client: &str,
    service: SocketAddr,
    reply: SocketAddr,
    extra: &[&str],
) {
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
    args.extend(extra.iter().map(|arg| (*arg).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run("conntrack", &args);
}

/// A SYN that met no rules left an entry without DNAT that nothing answered: deleted once
/// the Service port serves. A DNATed SYN not yet answered, and an answered entry, stay.
#[test]
fn tcp_black_holes_of_a_serving_service_port_are_deleted_and_nothing_else() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    in_fresh_netns(|_| async {
        let service: SocketAddr = "10.43.35.197:80".parse().unwrap();
        let endpoint_address: SocketAddr = "10.244.1.5:80".parse().unwrap();
        // Not DNATed, unanswered: the black hole.
        insert_with(
            "tcp",
            "10.244.0.9",
            service,
            service,
            &["--state", "SYN_SENT"],
        );
        // DNATed, not answered yet: a connection being opened.
        insert_with(
            "tcp",
            "10.244.0.10",
            service,
            endpoint_address,
            &["--state", "SYN_SENT"],
        );
        // Not DNATed but answered (the node itself answered): not a black hole.
        insert_with(
            "tcp",
            "10.244.0.11",
            service,
            service,
            &["--state", "ESTABLISHED", "-u", "SEEN_REPLY"],
        );
        let tcp_clients = || {
            let listing = run("conntrack", &["-L", "-p", "tcp"]);
            ["10.244.0.9", "10.244.0.10", "10.244.0.11"]
                .into_iter()
                .filter(|client| listing.contains(&format!("src={client} ")))
                .collect::<Vec<_>>()
        };
        assert_eq!(tcp_clients().len(), 3);

        // Without a serving endpoint the Service port's entries are not read.
        let idle = reconcile_blocking(
            IpFamily::V4,
            &ServingEndpoints::of(&reference_state(vec![])),
        )
        .unwrap();
        assert_eq!((idle.listed, idle.deleted), (0, 0));

        let state = reference_state(vec![endpoint([10, 244, 1, 5], 80, "node-a")]);
        let done = reconcile_blocking(IpFamily::V4, &ServingEndpoints::of(&state)).unwrap();
        // The answered entry is not listed: filtered by status.
        assert_eq!(
            done,
            Reconciled {
                listed: 2,
                deleted: 1,
                ..Reconciled::default()
            }
        );
        assert_eq!(tcp_clients(), ["10.244.0.10", "10.244.0.11"]);
    });
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

        let mut state = ProxyState::new(IpFamily::V6);
        let mut dns = udp_state(IpFamily::V6, vec![])
            .services()
            .values()
            .next()
            .unwrap()
            .clone();
        dns.cluster_ip = Some(service.ip());
        dns.port = service.port();
        dns.node_port = None;
        dns.load_balancer_ingress.clear();
        let endpoint = Endpoint {
            ip: serving.ip(),
            port: serving.port(),
            ..endpoint([0, 0, 0, 0], 0, "node-a")
        };
        state.insert_endpoints(dns.name.clone(), vec![endpoint]);
        state.insert_service(dns);

        let serving_endpoints = ServingEndpoints::of(&state);
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
        // The IPv4 reconciler with no IPv4 Services has nothing to judge, and reads nothing.
        let done = reconcile_blocking(IpFamily::V4, &ServingEndpoints::default()).unwrap();
        assert_eq!((done.listed, done.deleted), (0, 0));
    });
}
