//! Scale benchmark (ignored by default; root): 2,700 LoadBalancer Services × 10 endpoints in
//! a fresh namespace per backend. Prints our first sync and a one-endpoint incremental sync
//! next to a raw `iptables-restore` of the same payload in the same run (the physical
//! limit), and checks the kernel ended up with every chain.
//!
//! `cargo test -p tandem-nodeproxy --test scale -- --ignored --nocapture`
//!
//! Also the periodic read-back of the kernel's rules in every data path, at 2,700 and
//! 10,000 Services ([`read_back_cost_and_endpoint_changes_during_it`]).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use std::collections::BTreeSet;

use common::*;
use prometheus_client::registry::Registry;
use tandem_common::ProxyMode;
use tandem_common::{IpFamily, Protocol};
use tandem_nodeproxy::datapath::iptables::Syncer;
use tandem_nodeproxy::datapath::iptables::backend::{Backend, BackendChoice};
use tandem_nodeproxy::datapath::iptables::restore::{self, RestoreMode, TableInspection};
use tandem_nodeproxy::datapath::{self, DataPath};
use tandem_nodeproxy::metrics::Metrics;
use tandem_proxy_rules::model::{
    IpMode, LoadBalancerIngress, ProxyState, ServicePort, ServicePortName,
};

const SERVICES: usize = 2_700;
const ENDPOINTS: usize = 10;

fn big_state() -> ProxyState {
    state_of(SERVICES, true)
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
    let mut endpoints = after.endpoints_of(&changed).to_vec();
    endpoints[3] = endpoint([10, 250, 0, 1], 80, "node-c");
    after.insert_endpoints(changed.clone(), endpoints);
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

/// `services` Services × `ENDPOINTS` endpoints: LoadBalancers as [`big_state`] makes
/// them, or ClusterIP only.
fn state_of(services: usize, load_balancers: bool) -> ProxyState {
    let mut state = ProxyState::new(IpFamily::V4);
    for i in 0..services {
        let name = spn("scale", &format!("svc-{i}"), "http");
        let (hi, lo) = ((i / 250) as u8, (i % 250) as u8 + 1);
        state.insert_service(ServicePort {
            name: name.clone(),
            protocol: Protocol::Tcp,
            cluster_ip: Some(Ipv4Addr::new(10, 96, hi, lo).into()),
            port: 80,
            node_port: load_balancers.then_some(30_000 + i as u16),
            external_ips: vec![],
            load_balancer_ingress: if load_balancers {
                vec![LoadBalancerIngress {
                    ip: Ipv4Addr::new(198, 51, 100 + hi, lo).into(),
                    ip_mode: IpMode::Vip,
                }]
            } else {
                vec![]
            },
            load_balancer_source_ranges: if load_balancers {
                vec!["203.0.113.0/24".parse().unwrap()]
            } else {
                vec![]
            },
            session_affinity_timeout: None,
            external_traffic_policy_local: false,
            health_check_node_port: None,
            internal_traffic_policy_local: false,
        });
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
        state.insert_endpoints(name, endpoints);
    }
    state
}

/// Runs `body` on a multi-threaded runtime (two workers, as the binary has on this
/// machine) inside a fresh namespace, deleted afterwards.
fn in_fresh_netns_multi<F, Fut>(body: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let netns = Netns::new();
    let name = netns.name.clone();
    let joined = std::thread::spawn(move || {
        let file = std::fs::File::open(format!("/run/netns/{name}")).unwrap();
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(body());
    })
    .join();
    drop(netns);
    if let Err(panic) = joined {
        std::panic::resume_unwind(panic);
    }
}

/// CPU time of this process and of its children so far.
fn cpu_time() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    [UsageWho::RUSAGE_SELF, UsageWho::RUSAGE_CHILDREN]
        .into_iter()
        .map(|who| {
            let usage = getrusage(who).unwrap();
            let micros = |t: nix::sys::time::TimeVal| {
                Duration::from_micros(t.tv_sec() as u64 * 1_000_000 + t.tv_usec() as u64)
            };
            micros(usage.user_time()) + micros(usage.system_time())
        })
        .sum()
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

/// The state with one endpoint of `changed` moved to another address (`round` picks it).
fn with_moved_endpoint(state: &ProxyState, changed: &ServicePortName, round: usize) -> ProxyState {
    let mut moved = state.clone();
    let mut endpoints = moved.endpoints_of(changed).to_vec();
    endpoints[3] = endpoint(
        [10, 250, (round / 250) as u8, (round % 250) as u8 + 1],
        80,
        "node-c",
    );
    moved.insert_endpoints(changed.clone(), endpoints);
    moved
}

/// The periodic read-back (issue 27, scenario 6) in every data path at 2,700 LoadBalancer
/// Services × 10 endpoints and 10,000 ClusterIP Services × 10: its wall time, CPU time
/// (this process and the processes it runs), the comparison in the sync loop, and the
/// latency of endpoint changes applied while it runs against those without one. Each
/// read-back must find nothing to repair, also with the changes made during it.
///
/// `cargo test --release -p tandem-nodeproxy --test scale -- --ignored --nocapture read_back`
#[test]
#[ignore = "benchmark: minutes of CPU; run by hand with --ignored --nocapture"]
fn read_back_cost_and_endpoint_changes_during_it() {
    assert!(is_root(), "needs root");
    let sizes: Vec<(usize, bool, &str)> = vec![
        (2_700, true, "2,700 LoadBalancer × 10"),
        (10_000, false, "10,000 ClusterIP × 10"),
    ];
    let modes: Vec<(ProxyMode, BackendChoice, &str)> = vec![
        (ProxyMode::Iptables, BackendChoice::Nft, "iptables-nft"),
        (
            ProxyMode::Iptables,
            BackendChoice::Legacy,
            "iptables-legacy",
        ),
        (ProxyMode::Nftables, BackendChoice::Auto, "nftables mode"),
    ];
    for (services, load_balancers, size) in sizes {
        let state = state_of(services, load_balancers);
        for (mode, backend, label) in modes.clone() {
            let state = state.clone();
            in_fresh_netns_multi(move || async move {
                let metrics = Metrics::register(&mut Registry::default());
                let mut path = datapath::start(mode, backend, node()).await.unwrap();
                let all: BTreeSet<_> = state.services().keys().cloned().collect();
                path.update(&state, &all);
                let started = Instant::now();
                assert!(path.apply(&metrics).await);
                let first_sync = started.elapsed();

                // The read-back alone, three times.
                let mut walls = Vec::new();
                let mut cpus = Vec::new();
                let mut compares = Vec::new();
                for _ in 0..3 {
                    let cpu = cpu_time();
                    let read = path.start_read_back(None).await.unwrap();
                    cpus.push(cpu_time() - cpu);
                    walls.push(read.elapsed);
                    let started = Instant::now();
                    assert_eq!(
                        path.take_read_back(read, &metrics),
                        0,
                        "{label}: drift found"
                    );
                    compares.push(started.elapsed());
                }

                // One endpoint moving, without and with a read-back running.
                let changed = spn("scale", "svc-1234", "http");
                let ports: BTreeSet<_> = [changed.clone()].into();
                let mut round = 0;
                let mut change = async |path: &mut DataPath| {
                    round += 1;
                    let moved = with_moved_endpoint(&state, &changed, round);
                    let started = Instant::now();
                    path.update(&moved, &ports);
                    assert!(path.apply(&metrics).await);
                    started.elapsed()
                };
                let mut quiet = Vec::new();
                for _ in 0..7 {
                    quiet.push(change(&mut path).await);
                }
                // Changes start one after the other while five read-backs run.
                let mut during = Vec::new();
                for _ in 0..5 {
                    let task = path.start_read_back(None);
                    while !task.is_finished() {
                        during.push(change(&mut path).await);
                    }
                    let read = task.await.unwrap();
                    assert_eq!(
                        path.take_read_back(read, &metrics),
                        0,
                        "{label}: the chains written during the read-back were compared"
                    );
                }
                // What the sync loop does where nothing is announced (iptables-legacy): a
                // change gives the read-back in flight up, and it starts again after.
                let mut given_way = Vec::new();
                for _ in 0..5 {
                    let task = path.start_read_back(None);
                    tokio::time::sleep(walls[0] / 4).await;
                    let started = Instant::now();
                    task.abort();
                    change(&mut path).await;
                    given_way.push(started.elapsed());
                    let read = path.start_read_back(None).await.unwrap();
                    assert_eq!(
                        path.take_read_back(read, &metrics),
                        0,
                        "{label}: after giving way"
                    );
                }
                println!(
                    "{size}, {label}: the read-back given up for a change: the change took median {:.2?} max {:.2?} over 5",
                    median(given_way.clone()),
                    given_way.iter().max().copied().unwrap_or_default(),
                );
                println!(
                    "{size}, {label}: first sync {first_sync:.2?}; read-back wall {:.2?} (median of 3; {:.2?}..{:.2?}), CPU {:.2?}, comparison in the loop {:.2?}; \
                     endpoint change median {:.2?} without a read-back, median {:.2?} max {:.2?} over {} changes during five",
                    median(walls.clone()),
                    walls.iter().min().unwrap(),
                    walls.iter().max().unwrap(),
                    median(cpus),
                    median(compares),
                    median(quiet),
                    median(during.clone()),
                    during.iter().max().copied().unwrap_or_default(),
                    during.len(),
                );
            });
        }
    }
}
