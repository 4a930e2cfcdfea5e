//! Switching a node between the iptables and the nftables mode, and `--cleanup`, against
//! real netfilter in a fresh network namespace: each mode's first sync removes the other's
//! rules, so nothing stale stays behind. Also each mode's periodic full-rebuild check
//! after Services come and go, and its read-back of the kernel while rules change. Root
//! only (skipped with a message otherwise).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::process::Command;

use common::*;
use prometheus_client::registry::Registry;
use tandem_common::ProxyMode;
use tandem_nodeproxy::datapath::iptables::backend::{Backend, BackendChoice};
use tandem_nodeproxy::datapath::{self, DataPath};
use tandem_nodeproxy::metrics::Metrics;

/// KUBE-* lines in the filter and nat tables of every iptables backend present.
fn iptables_lines() -> usize {
    backends()
        .into_iter()
        .map(|backend| {
            let tables = format!("{}{}", save(backend, "filter"), save(backend, "nat"));
            lines_with(&tables, "KUBE-").len()
        })
        .sum()
}

fn has_our_table() -> bool {
    let out = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|line| line.trim() == "table ip tandem")
}

async fn start_and_sync(mode: ProxyMode, metrics: &Metrics) -> DataPath {
    let state = reference_state(reference_endpoints());
    let ports: BTreeSet<_> = state.services().keys().cloned().collect();
    let mut path = datapath::start(mode, BackendChoice::Auto, node())
        .await
        .unwrap();
    assert!(!path.update(&state, &ports).is_empty());
    assert!(path.apply(metrics).await, "{mode} sync failed");
    path
}

#[test]
fn switching_modes_and_cleanup_leave_no_rules_of_the_other_mode() {
    if !is_root() || Command::new("nft").arg("--version").output().is_err() {
        eprintln!("skipped: needs root and the nft command");
        return;
    }
    in_fresh_netns(|_| async {
        let metrics = Metrics::register(&mut Registry::default());

        start_and_sync(ProxyMode::Iptables, &metrics).await;
        assert!(iptables_lines() > 0);
        assert!(!has_our_table());

        start_and_sync(ProxyMode::Nftables, &metrics).await;
        assert_eq!(
            iptables_lines(),
            0,
            "iptables-mode rules left in nftables mode"
        );
        assert!(has_our_table());

        start_and_sync(ProxyMode::Iptables, &metrics).await;
        assert!(iptables_lines() > 0);
        assert!(!has_our_table(), "table ip tandem left in iptables mode");

        start_and_sync(ProxyMode::Nftables, &metrics).await;
        datapath::cleanup(BackendChoice::Auto).await.unwrap();
        assert_eq!(iptables_lines(), 0);
        assert!(!has_our_table(), "--cleanup left table ip tandem");
    });
}

#[test]
fn the_full_rebuild_check_finds_nothing_after_services_come_and_go() {
    if !is_root() || Command::new("nft").arg("--version").output().is_err() {
        eprintln!("skipped: needs root and the nft command");
        return;
    }
    in_fresh_netns(|_| async {
        let metrics = Metrics::register(&mut Registry::default());
        for mode in [ProxyMode::Iptables, ProxyMode::Nftables] {
            let mut path = start_and_sync(mode, &metrics).await;
            // default/kubernetes leaves and a Service named after nginx-service comes: in
            // nftables mode it takes the freed bucket slot, where a start from nothing, in
            // name order, would place it after nginx-service.
            let mut state = reference_state(reference_endpoints());
            let gone = spn("default", "kubernetes", "https");
            let nginx = spn("default", "nginx-service", "http");
            let mut zeta = state.services()[&nginx].clone();
            zeta.name = spn("default", "zeta", "http");
            zeta.cluster_ip = Some(std::net::Ipv4Addr::new(10, 43, 9, 9).into());
            zeta.node_port = Some(30999);
            zeta.load_balancer_ingress.clear();
            state.remove(&gone);
            state.insert_service(zeta.clone());
            state.insert_endpoints(zeta.name.clone(), reference_endpoints());
            let churned: BTreeSet<_> = [gone, zeta.name].into();
            assert!(!path.update(&state, &churned).is_empty());
            assert!(path.apply(&metrics).await, "{mode} sync failed");
            assert_eq!(
                path.check_against_full_rebuild(&node(), &state),
                None,
                "{mode}: the rebuild differs"
            );
        }
        datapath::cleanup(BackendChoice::Auto).await.unwrap();
    });
}

#[test]
fn an_endpoint_change_written_after_a_read_back_began_is_not_taken_for_drift() {
    if !is_root() || Command::new("nft").arg("--version").output().is_err() {
        eprintln!("skipped: needs root and the nft command");
        return;
    }
    let configs = [
        (ProxyMode::Iptables, BackendChoice::Nft),
        (ProxyMode::Iptables, BackendChoice::Legacy),
        (ProxyMode::Nftables, BackendChoice::Auto),
    ];
    for (mode, backend) in configs {
        in_fresh_netns(move |_| async move {
            let metrics = Metrics::register(&mut Registry::default());
            let state = reference_state(reference_endpoints());
            let ports: BTreeSet<_> = state.services().keys().cloned().collect();
            let mut path = datapath::start(mode, backend, node()).await.unwrap();
            path.update(&state, &ports);
            assert!(path.apply(&metrics).await);
            let read = path.start_read_back(None).await.unwrap();
            assert_eq!(
                path.take_read_back(read, &metrics),
                0,
                "{mode}: drift after the first sync"
            );

            // A read-back begins and reads the kernel; an endpoint moves before the read
            // is compared: the new rules go in, and the read, which predates them, leaves
            // their chains and sets out instead of taking them for drift.
            let read = path.start_read_back(None).await.unwrap();
            let mut moved = state.clone();
            let nginx = spn("default", "nginx-service", "http");
            let mut endpoints = moved.endpoints_of(&nginx).to_vec();
            endpoints[1] = endpoint([10, 244, 3, 9], 80, "node-c");
            moved.insert_endpoints(nginx.clone(), endpoints);
            path.update(&moved, &[nginx].into());
            assert!(path.apply(&metrics).await);
            assert_eq!(
                path.take_read_back(read, &metrics),
                0,
                "{mode} {backend:?}: the change taken for drift"
            );
            let rules = match mode {
                ProxyMode::Iptables => {
                    let backend = match backend {
                        BackendChoice::Legacy => Backend::Legacy,
                        _ => Backend::Nft,
                    };
                    save(backend, "nat")
                }
                ProxyMode::Nftables => run("nft", &["list", "table", "ip", "tandem"]),
            };
            assert!(
                rules.contains("10.244.3.9") && !rules.contains("10.244.2.7"),
                "{rules}"
            );
            // The next read-back compares them, and finds them as written.
            let read = path.start_read_back(None).await.unwrap();
            assert_eq!(path.take_read_back(read, &metrics), 0);
            datapath::cleanup(backend).await.unwrap();
        });
    }
}
