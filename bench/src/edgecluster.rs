//! Benchmark: the edge cluster's store, on a real 3-member etcd cluster (Debian's etcd on
//! loopback), each figure against its limit in the same run:
//! - creates through the store on etcd against the same creates on the embedded redb
//!   store, in interleaved rounds so that both meet the same noise, and against etcd's
//!   own commit of a transaction of the same shape (the floor any etcd store has);
//! - creates on two edges at once (each on a member of its own) for more load balancers
//!   than the pool has VIPs: VIPs handed out twice;
//! - creates with Idempotency-Keys on two edges while the etcd leader is killed, each sent
//!   again with its key when refused (as the controller does): acknowledged creates lost,
//!   and load balancers made twice for one key;
//! - the leading edge stopped: the time until another edge leads;
//! - then, in the lab, edges lost under traffic (module `failover`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use cloud_mock::etcd_cluster::EtcdCluster;
use cloud_mock::pools::VipPools;
use cloud_mock::store::{EtcdSettings, Store, StoreError};
use cloud_mock::validate::validate_spec;
use cloud_mock_sdk::families::LoadBalancerSpec;
use tokio_util::sync::CancellationToken;

use crate::BenchOptions;
use crate::report::{Row, Section, Target, Value};

mod failover;

/// The report's block of this benchmark.
pub const BLOCK: &str = "edge cluster";

/// About the size of one load balancer's record in the store (a listener, a backend, a
/// VIP, tags and timestamps as JSON).
const LOAD_BALANCER_RECORD_BYTES: usize = 600;

/// How much the run measures.
struct Scale {
    /// Creates per store and round of the latency comparison.
    creates: usize,
    rounds: usize,
    /// Creates on the two edges at once (more than the race pool's VIPs).
    racing: usize,
    /// Creates through the etcd leader's death.
    through_kill: usize,
}

impl Scale {
    fn for_options(options: &BenchOptions) -> Self {
        if options.quick {
            Self {
                creates: 30,
                rounds: 1,
                racing: 80,
                through_kill: 20,
            }
        } else {
            Self {
                creates: 200,
                rounds: 3,
                racing: 300,
                through_kill: 100,
            }
        }
    }
}

pub fn run(options: &BenchOptions) -> Result<Vec<Section>> {
    let scale = Scale::for_options(options);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let store = runtime.block_on(measure(&scale))?;
    Ok(vec![store, failover::run(options)?])
}

fn spec(name: &str) -> Result<LoadBalancerSpec> {
    serde_json::from_value(serde_json::json!({
        "name": name,
        "tags": {"cluster": "bench"},
        "mode": "proxy",
        "listeners": [{"protocol": "TCP", "port": 80, "backendPort": 30080}],
        "backends": [{"ip": "198.18.0.11"}],
    }))
    .context("the benchmark's spec")
}

async fn create(
    store: &Store,
    name: &str,
    key: Option<String>,
) -> Result<Result<String, StoreError>> {
    let spec = spec(name)?;
    let placement = validate_spec(&spec, store.pools()).map_err(|error| anyhow!("{error}"))?;
    Ok(store
        .create(spec, placement, None, key, None, 0)
        .await
        .map(|created| created.load_balancer.id))
}

fn settings(endpoints: Vec<String>, edge: &str, prefix: &str) -> EtcdSettings {
    EtcdSettings {
        endpoints,
        prefix: prefix.to_owned(),
        tls: None,
        user: None,
        edge_name: edge.to_owned(),
    }
}

/// Removes every load balancer of `store`.
async fn empty(store: &Store) -> Result<()> {
    for lb in store.list() {
        store.mark_deleting(lb.id.clone(), 0).await?;
        store.remove(lb.id).await?;
    }
    Ok(())
}

/// The latency of `count` creates one after another.
async fn latencies(
    store: &Store,
    round: usize,
    count: usize,
    into: &mut Vec<Duration>,
) -> Result<()> {
    for n in 0..count {
        let started = Instant::now();
        create(
            store,
            &format!("r{round}-{n}"),
            Some(format!("r{round}-{n}")),
        )
        .await??;
        into.push(started.elapsed());
    }
    empty(store).await
}

/// The latency of `count` transactions shaped as a create's: a compare of the guard key's
/// revision, then the load balancer, its VIP's holders, its key and the guard put.
async fn commit_latencies(
    client: &mut etcd_client::KvClient,
    round: usize,
    count: usize,
    into: &mut Vec<Duration>,
) -> Result<()> {
    use etcd_client::{Compare, CompareOp, Txn, TxnOp};
    let guard = format!("/bench-commit/{round}/guard");
    let record = "x".repeat(LOAD_BALANCER_RECORD_BYTES);
    let mut revision = 0;
    for n in 0..count {
        let started = Instant::now();
        let txn = Txn::new()
            .when([Compare::mod_revision(
                guard.clone(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([
                TxnOp::put(
                    format!("/bench-commit/{round}/lb/{n}"),
                    record.clone(),
                    None,
                ),
                TxnOp::put(format!("/bench-commit/{round}/vip/{n}"), "[\"lb\"]", None),
                TxnOp::put(format!("/bench-commit/{round}/key/{n}"), "lb", None),
                TxnOp::put(guard.clone(), format!("bench/{n}"), None),
            ]);
        let response = client.txn(txn).await.context("an etcd transaction")?;
        if !response.succeeded() {
            bail!("the benchmark's own guard moved");
        }
        revision = response.header().map_or(0, |header| header.revision());
        into.push(started.elapsed());
    }
    Ok(())
}

fn percentile(sorted: &[Duration], fraction: f64) -> f64 {
    let index =
        ((sorted.len() as f64 * fraction).ceil() as usize).clamp(1, sorted.len().max(1)) - 1;
    sorted.get(index).map_or(0.0, Duration::as_secs_f64)
}

async fn measure(scale: &Scale) -> Result<Section> {
    let cluster = EtcdCluster::start(3).await;
    let endpoints = cluster.endpoints();
    let pools: VipPools = "198.51.100.0/22".parse().context("the pool")?;
    let cancel = CancellationToken::new();
    let dir = std::env::temp_dir().join(format!("tandem-bench-edge-{}", std::process::id()));
    let redb = Store::open_redb(&dir, pools.clone())?;
    let etcd = Store::open_etcd(
        &settings(endpoints.clone(), "bench", "/bench-latency"),
        pools,
        cancel.clone(),
    )
    .await?;
    let mut raw = etcd_client::Client::connect(endpoints.clone(), None)
        .await
        .context("connecting to etcd")?
        .kv_client();
    let (mut on_redb, mut on_etcd, mut commits) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..scale.rounds {
        latencies(&redb, round, scale.creates, &mut on_redb).await?;
        latencies(&etcd, round, scale.creates, &mut on_etcd).await?;
        commit_latencies(&mut raw, round, scale.creates, &mut commits).await?;
    }
    drop(redb);
    let _ = std::fs::remove_dir_all(&dir);
    on_redb.sort();
    on_etcd.sort();
    commits.sort();
    let latency_row = |label: &str, fraction: f64| Row {
        what: format!(
            "create latency {label}, etcd store (3 members), {} creates",
            on_etcd.len()
        ),
        ours: Value::Seconds(percentile(&on_etcd, fraction)),
        limit: Some((
            "the redb store, same run".to_owned(),
            Value::Seconds(percentile(&on_redb, fraction)),
        )),
        target: Some(Target::RatioAtMost(1.5)),
    };
    let overhead_row = |label: &str, fraction: f64| Row {
        what: format!("create latency {label}, etcd store, against etcd's own commit"),
        ours: Value::Seconds(percentile(&on_etcd, fraction)),
        limit: Some((
            "one etcd transaction of a create's shape, same run".to_owned(),
            Value::Seconds(percentile(&commits, fraction)),
        )),
        target: Some(Target::RatioAtMost(1.2)),
    };
    let mut rows = vec![
        latency_row("p50", 0.5),
        latency_row("p99", 0.99),
        overhead_row("p50", 0.5),
        overhead_row("p99", 0.99),
    ];

    // Two edges, each on a member of its own, racing for a /24.
    let race_pools: VipPools = "198.51.101.0/24".parse().context("the race pool")?;
    let (cancel_a, cancel_b) = (CancellationToken::new(), CancellationToken::new());
    let a = Store::open_etcd(
        &settings(vec![endpoints[0].clone()], "a", "/bench-race"),
        race_pools.clone(),
        cancel_a.clone(),
    )
    .await?;
    let b = Store::open_etcd(
        &settings(vec![endpoints[1].clone()], "b", "/bench-race"),
        race_pools,
        cancel_b.clone(),
    )
    .await?;
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..scale.racing {
        let store = if n % 2 == 0 { a.clone() } else { b.clone() };
        tasks.spawn(async move { create(&store, &format!("race-{n}"), None).await });
        while tasks.len() >= 16 {
            tasks.join_next().await;
        }
    }
    while tasks.join_next().await.is_some() {}
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.list() != b.list() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let raced = a.list();
    let vips: BTreeSet<IpAddr> = raced.iter().flat_map(|lb| lb.vips()).collect();
    rows.push(Row {
        what: format!(
            "VIPs handed out twice, {} creates on two edges at once for {} VIPs",
            scale.racing,
            raced.len()
        ),
        ours: Value::Count((raced.len() - vips.len()) as f64),
        limit: None,
        target: Some(Target::AtMost(Value::Count(0.0))),
    });

    // Creates through the etcd leader's death on two edges that know every member, each
    // sent again with its key when refused.
    let kill_pools: VipPools = "198.51.102.0/24".parse().context("the pool")?;
    let c = Store::open_etcd(
        &settings(endpoints.clone(), "c", "/bench-kill"),
        kill_pools.clone(),
        cancel.clone(),
    )
    .await?;
    let d = Store::open_etcd(
        &settings(endpoints.clone(), "d", "/bench-kill"),
        kill_pools,
        cancel.clone(),
    )
    .await?;
    let mut cluster = cluster;
    let mut tasks = tokio::task::JoinSet::new();
    let mut acknowledged = BTreeMap::new();
    let mut killed = None;
    for n in 0..scale.through_kill {
        let store = if n % 2 == 0 { c.clone() } else { d.clone() };
        tasks.spawn(async move {
            let key = format!("kill-{n}");
            for _ in 0..100 {
                match create(&store, &key, Some(key.clone())).await? {
                    Ok(id) => return Ok((key, id)),
                    Err(StoreError::Unavailable { .. }) => {}
                    Err(other) => bail!("{key}: {other}"),
                }
            }
            bail!("{key}: refused 100 times")
        });
        if n == scale.through_kill / 4 {
            let leader = cluster.leader(2).await;
            cluster.stop_member(leader);
            killed = Some(leader);
        }
        while tasks.len() >= 4 {
            if let Some(done) = tasks.join_next().await {
                let (key, id) = done??;
                acknowledged.insert(key, id);
            }
        }
    }
    while let Some(done) = tasks.join_next().await {
        let (key, id) = done??;
        acknowledged.insert(key, id);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let kept = c.list();
    let lost = acknowledged
        .values()
        .filter(|id| !kept.iter().any(|lb| &lb.id == *id))
        .count();
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    for lb in &kept {
        if let Some(key) = lb
            .idempotency_key
            .as_deref()
            .filter(|key| key.starts_with("kill-"))
        {
            *per_key.entry(key).or_default() += 1;
        }
    }
    let twice = per_key.values().filter(|&&count| count > 1).count();
    rows.push(Row {
        what: format!(
            "acknowledged creates lost, {} creates through a killed etcd leader",
            scale.through_kill
        ),
        ours: Value::Count(lost as f64),
        limit: None,
        target: Some(Target::AtMost(Value::Count(0.0))),
    });
    rows.push(Row {
        what: "load balancers made twice for one Idempotency-Key through it".to_owned(),
        ours: Value::Count(twice as f64),
        limit: None,
        target: Some(Target::AtMost(Value::Count(0.0))),
    });

    // The leading edge of the race stops; the other takes over, on a whole etcd again:
    // the killed member may have been the only one a race edge knows, which then
    // campaigns again within its backoff (at most 3 s).
    if let Some(member) = killed {
        cluster.start_member(member);
        cluster.wait_healthy().await;
        tokio::time::sleep(Duration::from_secs(4)).await;
    }
    let (lead_a, lead_b) = (a.leadership(), b.leadership());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !*lead_a.borrow() && !*lead_b.borrow() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let follower = match (*lead_a.borrow(), *lead_b.borrow()) {
        (true, false) => {
            cancel_a.cancel();
            lead_b.clone()
        }
        (false, true) => {
            cancel_b.cancel();
            lead_a.clone()
        }
        leads => bail!("exactly one edge must lead, not {leads:?}"),
    };
    let stopped = Instant::now();
    while !*follower.borrow() && stopped.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    rows.push(Row {
        what: "leadership taken over after the leading edge stopped".to_owned(),
        ours: Value::Seconds(stopped.elapsed().as_secs_f64()),
        limit: None,
        target: Some(Target::AtMost(Value::Seconds(3.0))),
    });
    cancel.cancel();
    cancel_a.cancel();
    cancel_b.cancel();
    Ok(Section {
        title: "Edge cluster: the store on etcd".to_owned(),
        figures: Vec::new(),
        rows,
        notes: vec![
            "Creates through the store's interface on one edge, one after another, each with an Idempotency-Key; \
             redb and etcd rounds interleaved. etcd is a 3-member cluster of Debian's etcd 3.4 on loopback of this machine, \
             its data on the same disk as redb's. An etcd commit is a raft round: the leader's and a follower's \
             WAL fsync (here on one disk) and two gRPC hops, where redb's is one fsync; the rows against etcd's own \
             commit of a transaction of the same shape show what the store adds above that floor."
                .to_owned(),
            "Leadership: the leader's lease is revoked when it stops; within one lease period (3 s) when it dies."
                .to_owned(),
        ],
    })
}
