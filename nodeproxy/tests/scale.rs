//! Scale benchmark (ignored by default; root): 2,700 LoadBalancer Services × 10 endpoints in
//! a fresh namespace per backend. Prints our first sync and a one-endpoint incremental sync
//! next to a raw `iptables-restore` of the same payload in the same run (the physical
//! limit), and checks the kernel ended up with every chain.
//!
//! `cargo test -p tandem-nodeproxy --test scale -- --ignored --nocapture`

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tandem_nodeproxy::backend::Backend;
use tandem_nodeproxy::iptables::Syncer;
use tandem_nodeproxy::restore::{self, RestoreMode, TableInspection};
use tandem_proxy_rules::model::{IpMode, LoadBalancerIngress, Protocol, ProxyState, ServicePort};

const SERVICES: usize = 2_700;
const ENDPOINTS: usize = 10;

fn big_state() -> ProxyState {
    let mut state = ProxyState::default();
    for i in 0..SERVICES {
        let name = spn("scale", &format!("svc-{i}"), "http");
        let (hi, lo) = ((i / 250) as u8, (i % 250) as u8 + 1);
        state.services.insert(
            name.clone(),
            ServicePort {
                name: name.clone(),
                protocol: Protocol::Tcp,
                cluster_ip: Some(Ipv4Addr::new(10, 96, hi, lo)),
                port: 80,
                node_port: Some(30_000 + i as u16),
                external_ips: vec![],
                load_balancer_ingress: vec![LoadBalancerIngress {
                    ip: Ipv4Addr::new(198, 51, 100 + hi, lo),
                    ip_mode: IpMode::Vip,
                }],
                load_balancer_source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
                session_affinity_timeout: None,
                external_traffic_policy_local: false,
                health_check_node_port: None,
                internal_traffic_policy_local: false,
            },
        );
        let endpoints = (0..ENDPOINTS)
            .map(|e| {
                let n = i * ENDPOINTS + e;
                endpoint(
                    [
                        10,
                        244 + (n / 62_500) as u8,
                        ((n / 250) % 250) as u8,
                        (n % 250) as u8 + 1,
                    ],
                    80,
                    "node-b",
                )
            })
            .collect();
        state.endpoints.insert(name, endpoints);
    }
    state
}

/// Seconds a raw `iptables-restore` of `text` takes in the current namespace.
fn raw_restore(backend: Backend, text: &str, noflush: bool) -> Duration {
    let started = Instant::now();
    let mut child = Command::new(backend.restore())
        .args(if noflush { &["--noflush"][..] } else { &[][..] })
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success());
    started.elapsed()
}

#[test]
#[ignore = "benchmark: minutes of CPU; run by hand with --ignored --nocapture"]
fn first_and_incremental_sync_at_2700_services() {
    assert!(is_root(), "needs root");
    let before = big_state();
    let mut after = before.clone();
    let changed = spn("scale", "svc-1234", "http");
    after.endpoints.get_mut(&changed).unwrap()[3] = endpoint([10, 250, 0, 1], 80, "node-c");
    let desired_before = tandem_proxy_rules::build(&before, &node());
    let build_started = Instant::now();
    let desired_after = tandem_proxy_rules::build(&after, &node());
    let build = build_started.elapsed();
    let nat_rules: usize = desired_before.nat.chains.values().map(Vec::len).sum();
    println!(
        "ruleset: {} nat chains, {nat_rules} nat rules; build {build:?}",
        desired_before.nat.chains.len()
    );

    for backend in backends() {
        let (db, da) = (desired_before.clone(), desired_after.clone());
        in_fresh_netns(move |_| async move {
            let mut syncer = Syncer::new(backend);
            let started = Instant::now();
            let done = syncer.sync(&db).await.unwrap();
            let first = started.elapsed();
            assert!(done.iter().all(|t| t.mode == RestoreMode::Flush));

            let started = Instant::now();
            let done = syncer.sync(&da).await.unwrap();
            let incremental = started.elapsed();
            assert_eq!(done.len(), 1);
            assert_eq!((done[0].written_chains, done[0].deleted_chains), (2, 1));
            let increment_payload = done[0].payload.clone();

            // Same payload, raw, for the ratio; restore the old state first (noflush) so the
            // raw run does the same work into the same full table.
            let undo = restore::between("nat", &da.nat, &db.nat).unwrap();
            raw_restore(backend, &undo.text, true);
            let raw_incremental = raw_restore(backend, &increment_payload, true);

            // A restart: nothing known, the table full of our own chains.
            let started = Instant::now();
            let done = Syncer::new(backend).sync(&da).await.unwrap();
            let restart = started.elapsed();
            assert!(done.iter().all(|t| t.full && t.mode == RestoreMode::Flush));
            println!("{backend}: restart sync into the full table {restart:?}");

            let started = Instant::now();
            let saved = save(backend, "nat");
            let save_time = started.elapsed();
            assert_eq!(
                saved.lines().filter(|l| l.starts_with(":KUBE-")).count(),
                db.nat.chains.len() + 1,
                "every chain (plus the canary) in the kernel"
            );
            println!(
                "{backend}: first sync {first:?}; one-endpoint sync {incremental:?} \
                 (raw restore of its payload {raw_incremental:?}, ratio {:.2}); iptables-save {save_time:?}",
                incremental.as_secs_f64() / raw_incremental.as_secs_f64()
            );
        });
        // The physical limit of the first sync: a raw flush-mode restore of the same text
        // into an empty namespace; and, for contrast, the --noflush write (legacy only: on
        // nf_tables it takes minutes).
        let flush_text =
            restore::full("nat", &TableInspection::default(), &desired_before.nat).text;
        let text = flush_text.clone();
        in_fresh_netns(move |_| async move {
            let raw = raw_restore(backend, &text, false);
            println!("{backend}: raw flush-mode restore of the nat payload {raw:?}");
        });
        if backend == Backend::Legacy {
            in_fresh_netns(move |_| async move {
                let raw = raw_restore(backend, &flush_text, true);
                println!(
                    "{backend}: raw --noflush restore of the same payload into an empty table {raw:?}"
                );
            });
        }
    }
}
