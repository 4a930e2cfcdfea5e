#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The L2 announcement mode with a real 3-member etcd (Debian's etcd, on loopback) and
//! real ARP (root only; every host a network namespace of this test, removed at the end):
//!
//! ```text
//! client 10.88.0.10 ── switch ──┬── edge 1 10.88.0.1 ┐ each with the VIP on lo and a
//!                               ├── edge 2 10.88.0.2 ├ listener that greets with its name
//!                               └── edge 3 10.88.0.3 ┘
//! ```
//!
//! Each edge's owner runs in this test's process (its etcd client on loopback, one member
//! each) and changes its edge through `ip`, `arping` and `sysctl` run inside the edge's
//! namespace. The test samples which edges hold the VIP on their device every 20 ms: never
//! two, not when the owner is cut off from etcd, nor when it stops.

#[path = "../dataplane/tests/support/mod.rs"]
mod support;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cloud_mock::etcd_cluster::EtcdCluster;
use cloud_mock::l2::{L2Owner, LEASE_TTL};
use cloud_mock::store::EtcdSettings;
use cloud_mock_dataplane::{L2Config, L2Device};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use support::netns::{self, bind_in, block_on_in_netns, ip, is_root};
use support::{greet_on, tcp_hello};

const VIP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 40);
const EDGES: [&str; 3] = ["e1", "e2", "e3"];

struct Hosts {
    namespaces: netns::Namespaces,
    dir: PathBuf,
}

impl Hosts {
    fn name(&self, host: &str) -> String {
        self.namespaces.name(host)
    }

    fn all() -> [&'static str; 5] {
        ["s", "c", "e1", "e2", "e3"]
    }

    fn create() -> Self {
        let namespaces = netns::Namespaces::create("l2", &Self::all());
        let dir = std::env::temp_dir().join(namespaces.name("files"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let hosts = Self { namespaces, dir };
        let switch = hosts.name("s");
        netns::switch(&switch);
        for (host, address) in [
            ("c", "10.88.0.10"),
            ("e1", "10.88.0.1"),
            ("e2", "10.88.0.2"),
            ("e3", "10.88.0.3"),
        ] {
            netns::plug(
                &switch,
                &format!("p{host}"),
                &hosts.name(host),
                &format!("{address}/24"),
            );
        }
        // The client reaches the VIP on its own network, as a router's interface would.
        ip(&[
            "-n",
            &hosts.name("c"),
            "route",
            "add",
            &format!("{VIP}/32"),
            "dev",
            "eth0",
        ]);
        for edge in EDGES {
            ip(&[
                "-n",
                &hosts.name(edge),
                "addr",
                "add",
                &format!("{VIP}/32"),
                "dev",
                "lo",
            ]);
        }
        hosts
    }

    /// A program that runs `program` inside `host`'s namespace: how an owner in this
    /// process changes its edge.
    fn wrapper(&self, host: &str, program: &str) -> PathBuf {
        let path = self.dir.join(format!("{host}-{program}"));
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\nexec ip netns exec {} {program} \"$@\"\n",
                self.name(host)
            ),
        )
        .unwrap();
        let mut permissions = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o755);
        std::fs::set_permissions(&path, permissions).unwrap();
        path
    }

    fn holders(&self) -> BTreeSet<&'static str> {
        holders(&EDGES.map(|edge| self.name(edge)))
    }
}

/// The edges (`e1` to `e3`, in the namespaces `edges`) that hold the VIP on their device
/// now.
fn holders(edges: &[String; 3]) -> BTreeSet<&'static str> {
    EDGES
        .into_iter()
        .zip(edges)
        .filter(|(_, namespace)| {
            let output = Command::new("ip")
                .args([
                    "-n",
                    namespace.as_str(),
                    "-4",
                    "addr",
                    "show",
                    "dev",
                    "eth0",
                ])
                .output()
                .unwrap();
            String::from_utf8_lossy(&output.stdout).contains(&format!("{VIP}/32"))
        })
        .map(|(edge, _)| edge)
        .collect()
}

impl Drop for Hosts {
    // The namespaces go with their guard.
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn owner(
    hosts: &Hosts,
    index: usize,
    endpoint: &str,
    offers: watch::Receiver<BTreeSet<IpAddr>>,
) -> L2Owner {
    let edge = EDGES[index];
    let settings = EtcdSettings {
        endpoints: vec![endpoint.to_owned()],
        prefix: "/l2-test".to_owned(),
        tls: None,
        user: None,
        edge_name: edge.to_owned(),
    };
    let device = L2Device::new(L2Config {
        device: "eth0".to_owned(),
        ip_program: hosts.wrapper(edge, "ip"),
        arping_program: hosts.wrapper(edge, "arping"),
        sysctl_program: hosts.wrapper(edge, "sysctl"),
        vip_ranges: vec![ipnet::IpNet::from(IpAddr::V4(VIP))],
    });
    L2Owner::new(settings, device, offers)
}

/// The edge that greets the client now, through ARP as the client resolves it.
fn answering(hosts: &Hosts) -> Option<String> {
    let mut answer = None;
    block_on_in_netns(&hosts.name("c"), || async {
        if let Ok(Ok((_, name))) = tokio::time::timeout(
            Duration::from_millis(500),
            tcp_hello(None, IpAddr::V4(VIP), 80),
        )
        .await
        {
            answer = Some(name);
        }
    });
    answer
}

/// Waits until exactly one edge holds the VIP; which one.
fn one_holder(hosts: &Hosts, within: Duration) -> &'static str {
    let started = Instant::now();
    loop {
        let holders = hosts.holders();
        if holders.len() == 1 {
            return holders.into_iter().next().unwrap();
        }
        assert!(started.elapsed() < within, "no single owner: {holders:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_answered_by(hosts: &Hosts, edge: &str, within: Duration) -> Duration {
    let started = Instant::now();
    while answering(hosts).as_deref() != Some(edge) {
        assert!(
            started.elapsed() < within,
            "the client is not answered by {edge}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_edge_answers_for_a_vip_and_gives_it_up_when_cut_off_from_etcd() {
    if !is_root() {
        return;
    }
    assert!(
        Command::new("arping").arg("--help").output().is_ok(),
        "install Debian's arping (bash .ci/run does)"
    );
    let mut cluster = EtcdCluster::start(3).await;
    let endpoints = cluster.endpoints();
    let hosts = Hosts::create();
    let servers: Vec<_> = EDGES
        .iter()
        .map(|&edge| {
            greet_on(
                tokio::net::TcpListener::from_std(bind_in(&hosts.name(edge), VIP, 80)).unwrap(),
                edge,
            )
        })
        .collect();
    let (_offer, offers) = watch::channel(BTreeSet::from([IpAddr::V4(VIP)]));
    let cancels: Vec<CancellationToken> = EDGES.iter().map(|_| CancellationToken::new()).collect();
    let tasks: Vec<_> = (0..EDGES.len())
        .map(|index| {
            tokio::spawn(
                owner(&hosts, index, &endpoints[index], offers.clone()).run(cancels[index].clone()),
            )
        })
        .collect();

    // Sampled throughout: never two holders.
    let watching = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (watching, edges) = (watching.clone(), EDGES.map(|edge| hosts.name(edge)));
        std::thread::spawn(move || {
            let mut most = 0;
            while watching.load(Ordering::Relaxed) {
                most = most.max(holders(&edges).len());
                std::thread::sleep(Duration::from_millis(20));
            }
            most
        })
    };

    let first = tokio::task::block_in_place(|| one_holder(&hosts, Duration::from_secs(15)));
    tokio::task::block_in_place(|| wait_answered_by(&hosts, first, Duration::from_secs(5)));

    // The owner's etcd member goes: the owner is cut off from etcd, the others are not.
    let index = EDGES.iter().position(|edge| *edge == first).unwrap();
    let cut = Instant::now();
    cluster.stop_member(index);
    let given_up = tokio::task::block_in_place(|| {
        while hosts.holders().contains(first) {
            assert!(
                cut.elapsed() < Duration::from_secs(10),
                "{first} keeps the VIP cut off"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        cut.elapsed()
    });
    let second = tokio::task::block_in_place(|| one_holder(&hosts, Duration::from_secs(15)));
    let taken_over = cut.elapsed();
    let answered =
        tokio::task::block_in_place(|| wait_answered_by(&hosts, second, Duration::from_secs(5)));
    println!(
        "owner {first} cut off from etcd: gave the VIP up after {given_up:?}, {second} held it after {taken_over:?}, \
         the client answered by it {answered:?} later"
    );
    assert!(
        given_up <= LEASE_TTL,
        "given up within one lease period: {given_up:?}"
    );
    assert_ne!(first, second);

    // A planned stop: the owner gives the VIP up and revokes its lease; another takes it
    // within a round or two.
    let index = EDGES.iter().position(|edge| *edge == second).unwrap();
    let stopped = Instant::now();
    cancels[index].cancel();
    let third = tokio::task::block_in_place(|| {
        loop {
            let holders = hosts.holders();
            if holders.len() == 1 && !holders.contains(second) {
                return holders.into_iter().next().unwrap();
            }
            assert!(
                stopped.elapsed() < Duration::from_secs(10),
                "nobody took over from {second}: {holders:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let handed_over = stopped.elapsed();
    tokio::task::block_in_place(|| wait_answered_by(&hosts, third, Duration::from_secs(5)));
    println!("owner {second} stopped: {third} held the VIP after {handed_over:?}");
    assert!(
        handed_over < LEASE_TTL,
        "a stop hands over before the lease would expire"
    );

    watching.store(false, Ordering::Relaxed);
    let most = sampler.join().unwrap();
    assert_eq!(most, 1, "never two edges hold the VIP");
    for cancel in &cancels {
        cancel.cancel();
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert!(hosts.holders().is_empty(), "stopped owners hold nothing");
    drop(servers);
}
