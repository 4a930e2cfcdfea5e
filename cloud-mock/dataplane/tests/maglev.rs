//! Kernel test (root only): passthrough flows steered by Maglev keep their node on
//! whichever edge they arrive, and through a node joining. Every host is a network
//! namespace of this test on one switch (a bridge in a namespace of its own), deleted at the
//! end, also on failure:
//!
//! ```text
//! client 10.77.0.10 ─┐            ┌─ node 10.77.0.11 ┐
//! edge 1 10.77.0.1  ─┼── switch ──┼─ node 10.77.0.12 ├ each with the VIP on lo, greeting
//! edge 2 10.77.0.2  ─┘            ├─ node 10.77.0.13 │ with its own name
//!                                 └─ node 10.77.0.14 ┘ (joins later)
//! ```
//!
//! The client routes the VIP through edge 1, then through edge 2, as a router does when
//! edge 1 dies; the nodes answer the client directly. Each edge runs its own data plane
//! with Maglev steering and no shared state.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use cloud_mock_dataplane::{
    DataPlane, DataPlaneConfig, LoadBalancer, MaglevConfig, Mode, PassthroughConfig, Protocol,
};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::mpsc;

use support::netns::{self, bind_in, block_on_in_netns, in_netns, ip, is_root};
use support::{greet_on, listener, read_line};

const VIP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 5);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 10);
const EDGES: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 77, 0, 1), Ipv4Addr::new(10, 77, 0, 2)];
const NODES: [Ipv4Addr; 4] = [
    Ipv4Addr::new(10, 77, 0, 11),
    Ipv4Addr::new(10, 77, 0, 12),
    Ipv4Addr::new(10, 77, 0, 13),
    Ipv4Addr::new(10, 77, 0, 14),
];
const NODE_NAMES: [&str; 4] = ["n1", "n2", "n3", "n4"];
/// Client ports of the short flows: the same 5-tuples through each edge.
const FLOWS: std::ops::Range<u16> = 41000..41300;
/// Client ports of flows sent through edge 1 before a node joins and through edge 2
/// (which has never seen them) after: what the lookup table alone moves.
const FRESH: std::ops::Range<u16> = 43000..43300;
/// Client ports of the long-lived connections.
const LONG_LIVED: std::ops::Range<u16> = 42000..42030;

/// The test's hosts, deleted on drop.
struct Hosts {
    namespaces: netns::Namespaces,
}

impl Hosts {
    fn name(&self, host: &str) -> String {
        self.namespaces.name(host)
    }

    fn all() -> Vec<&'static str> {
        ["s", "c", "e1", "e2"]
            .into_iter()
            .chain(NODE_NAMES)
            .collect()
    }

    fn create() -> Self {
        let hosts = Self {
            namespaces: netns::Namespaces::create("mgl", &Self::all()),
        };
        for host in Self::all() {
            // The edges forward out of the port packets came in on: no redirects, which
            // would send the client around them.
            hosts.sysctl(host, "net.ipv4.conf.default.send_redirects=0");
            hosts.sysctl(host, "net.ipv4.conf.all.send_redirects=0");
            hosts.sysctl(host, "net.ipv4.conf.default.accept_redirects=0");
            hosts.sysctl(host, "net.ipv4.conf.all.accept_redirects=0");
        }
        let switch = hosts.name("s");
        netns::switch(&switch);
        let addresses = [("c", CLIENT), ("e1", EDGES[0]), ("e2", EDGES[1])]
            .into_iter()
            .chain(NODE_NAMES.into_iter().zip(NODES));
        for (host, address) in addresses {
            netns::plug(
                &switch,
                &format!("p{host}"),
                &hosts.name(host),
                &format!("{address}/24"),
            );
        }
        for node in NODE_NAMES {
            ip(&[
                "-n",
                &hosts.name(node),
                "addr",
                "add",
                &format!("{VIP}/32"),
                "dev",
                "lo",
            ]);
        }
        for edge in ["e1", "e2"] {
            hosts.sysctl(edge, "net.ipv4.ip_forward=1");
        }
        hosts
    }

    fn sysctl(&self, host: &str, setting: &str) {
        let done = Command::new("ip")
            .args(["netns", "exec", &self.name(host), "sysctl", "-qw", setting])
            .status()
            .unwrap();
        assert!(done.success(), "{setting} in {host}");
    }

    /// The client's route to the VIP leads through `edge` (0 or 1).
    fn route_through(&self, edge: usize) {
        let via = EDGES[edge].to_string();
        ip(&[
            "-n",
            &self.name("c"),
            "route",
            "replace",
            &format!("{VIP}/32"),
            "via",
            &via,
        ]);
    }

    /// Takes `host`'s port of the switch `down` (its cable cut) or `up`.
    fn switch_port(&self, host: &str, state: &str) {
        let port = format!("p{host}");
        ip(&["-n", &self.name("s"), "link", "set", &port, state]);
    }

    /// Whether `host`'s nftables table holds `text`.
    fn nft_has(&self, host: &str, text: &str) -> bool {
        let output = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.name(host),
                "nft",
                "list",
                "table",
                "inet",
                "tandem_maglev",
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&output.stdout).contains(text)
    }
}

/// One edge: a data plane on a runtime of its own inside the edge's namespace, given new
/// desired sets through a channel; shut down (its routes and steering removed) on drop.
struct Edge {
    desired: Option<mpsc::UnboundedSender<Vec<LoadBalancer>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Edge {
    fn start(netns: String) -> Self {
        let (sender, mut receiver) = mpsc::unbounded_channel::<Vec<LoadBalancer>>();
        let thread = std::thread::spawn(move || {
            block_on_in_netns(&netns, || async move {
                let dataplane = DataPlane::new(DataPlaneConfig {
                    health_interval: Duration::from_millis(100),
                    passthrough: PassthroughConfig {
                        maglev: Some(MaglevConfig::default()),
                        ..PassthroughConfig::default()
                    },
                    ..DataPlaneConfig::default()
                });
                while let Some(desired) = receiver.recv().await {
                    dataplane.apply(desired).await.unwrap();
                }
                dataplane.shutdown().await;
            });
        });
        Self {
            desired: Some(sender),
            thread: Some(thread),
        }
    }

    fn apply(&self, nodes: &[Ipv4Addr]) {
        let lb = LoadBalancer {
            id: "lb-maglev".to_owned(),
            vips: vec![VIP.into()],
            mode: Mode::Passthrough,
            listeners: vec![listener(Protocol::Tcp, 80, 80, None)],
            backends: nodes.iter().map(|&node| node.into()).collect(),
            source_ranges: vec![],
        };
        self.desired.as_ref().unwrap().send(vec![lb]).unwrap();
    }
}

impl Drop for Edge {
    fn drop(&mut self) {
        self.desired = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A connection from `CLIENT:port` to the VIP, and the name of the node that greeted it.
async fn connect(port: u16) -> std::io::Result<(TcpStream, String)> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(SocketAddr::new(CLIENT.into(), port))?;
    let mut stream = tokio::time::timeout(
        Duration::from_secs(2),
        socket.connect(SocketAddr::new(VIP.into(), 80)),
    )
    .await
    .map_err(|_| std::io::Error::other("connect timed out"))??;
    let name = read_line(&mut stream).await?;
    Ok((stream, name))
}

/// The node of each short flow, each closed with a reset so that its 5-tuple is free again.
fn flows(hosts: &Hosts, ports: std::ops::Range<u16>) -> BTreeMap<u16, String> {
    let mut nodes = BTreeMap::new();
    block_on_in_netns(&hosts.name("c"), || async {
        for port in ports {
            match connect(port).await {
                Ok((stream, name)) => {
                    stream.set_zero_linger().unwrap();
                    drop(stream);
                    nodes.insert(port, name);
                }
                Err(error) => {
                    nodes.insert(port, format!("failed: {error}"));
                }
            }
        }
    });
    nodes
}

/// Whether each long-lived connection still answers on its node: an echo comes back.
async fn still_answer(connections: &mut [(TcpStream, String)]) -> usize {
    let mut broken = 0;
    for (stream, _) in connections.iter_mut() {
        let echoed = async {
            stream.write_all(b"ping\n").await?;
            read_line(stream).await
        };
        if !matches!(echoed.await, Ok(ref line) if line == "ping") {
            broken += 1;
        }
    }
    broken
}

fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let started = std::time::Instant::now();
    while !condition() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn flows_keep_their_node_across_edges_and_through_a_node_joining() {
    if !is_root() {
        return;
    }
    let hosts = Hosts::create();
    let listeners: Vec<std::net::TcpListener> = NODE_NAMES
        .iter()
        .map(|node| bind_in(&hosts.name(node), VIP, 80))
        .collect();
    // The nodes' servers run on a runtime of their own; their sockets live in the nodes.
    let (stop_nodes, stopped) = tokio::sync::oneshot::channel::<()>();
    let switch = hosts.name("s");
    let nodes_thread = std::thread::spawn(move || {
        in_netns(&switch, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async move {
                    let _servers: Vec<_> = listeners
                        .into_iter()
                        .zip(NODE_NAMES)
                        .map(|(listener, name)| {
                            greet_on(tokio::net::TcpListener::from_std(listener).unwrap(), name)
                        })
                        .collect();
                    let _ = stopped.await;
                });
        });
    });
    let edges = [Edge::start(hosts.name("e1")), Edge::start(hosts.name("e2"))];
    for edge in &edges {
        edge.apply(&NODES[..3]);
    }
    for edge in ["e1", "e2"] {
        wait_until("both edges steering", || {
            hosts.nft_has(edge, "jump nodes_0")
        });
    }

    // The same flows through each edge land on the same nodes, spread over all three.
    hosts.route_through(0);
    let through_first = flows(&hosts, FLOWS);
    let fresh_before = flows(&hosts, FRESH);
    hosts.route_through(1);
    let through_second = flows(&hosts, FLOWS);
    let differing = FLOWS
        .filter(|port| through_first[port] != through_second[port])
        .count();
    let mut spread: BTreeMap<&str, usize> = BTreeMap::new();
    for name in through_first.values() {
        *spread.entry(name.as_str()).or_default() += 1;
    }
    println!(
        "{} flows through two edges: {differing} on another node; spread {spread:?}",
        FLOWS.len()
    );
    assert_eq!(differing, 0, "every edge sends a flow to the same node");
    assert_eq!(spread.len(), 3, "flows spread over every node: {spread:?}");

    // Long-lived connections made through edge 1 go on through edge 2 once edge 1 is gone
    // (its port cut, as when its host dies), then through node 4 joining on both edges.
    hosts.route_through(0);
    let client = hosts.name("c");
    let mut broken = (0, 0);
    block_on_in_netns(&client, || async {
        let mut connections = Vec::new();
        for port in LONG_LIVED {
            connections.push(connect(port).await.unwrap());
        }
        assert_eq!(still_answer(&mut connections).await, 0);
        hosts.switch_port("e1", "down");
        hosts.route_through(1);
        broken.0 = still_answer(&mut connections).await;
        for edge in &edges {
            edge.apply(&NODES);
        }
        // Both edges steer over four nodes: node 4's mark (its table, 0x7a03) is live.
        for edge in ["e1", "e2"] {
            let started = std::time::Instant::now();
            while !hosts.nft_has(edge, "198.51.100.5 . 0x00007a03") {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "{edge} steers to node 4"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        broken.1 = still_answer(&mut connections).await;
    });
    println!(
        "{} long-lived connections: {} broken when their edge died, {} when a node joined",
        LONG_LIVED.len(),
        broken.0,
        broken.1
    );
    assert_eq!(broken, (0, 0));

    // Flows edge 2 has not seen, after the join: about a quarter moved, each to the node
    // that joined; the flows it remembers stay where they were.
    let fresh_after = flows(&hosts, FRESH);
    let remembered = flows(&hosts, FLOWS);
    let kept = FLOWS
        .filter(|port| through_second[port] == remembered[port])
        .count();
    assert_eq!(kept, FLOWS.len(), "flows edge 2 remembers keep their nodes");
    let moved: Vec<&String> = FRESH
        .filter(|port| fresh_before[port] != fresh_after[port])
        .map(|port| &fresh_after[&port])
        .collect();
    let share = moved.len() as f64 / FRESH.len() as f64;
    println!(
        "a fourth node joined: {:.3} of new flows moved (1/N = 0.25)",
        share
    );
    assert!(
        moved.iter().all(|node| *node == "n4"),
        "flows move only to the node that joined: {moved:?}"
    );
    assert!((0.15..=0.35).contains(&share), "{share:.3} of flows moved");
    hosts.switch_port("e1", "up");
    drop(edges);
    for edge in ["e1", "e2"] {
        assert!(!hosts.nft_has(edge, "steer"), "{edge} removed its steering");
        let rules = ip(&["-n", &hosts.name(edge), "rule", "show"]);
        assert!(
            !rules.contains("fwmark"),
            "{edge} removed its rules: {rules}"
        );
    }
    let _ = stop_nodes.send(());
    nodes_thread.join().unwrap();
}
