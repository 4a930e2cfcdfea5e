//! Benchmark: an edge cluster losing edges under traffic, in the lab (`tandem-lab --edges
//! 3`: three edges behind a BIRD router, a 3-member etcd, Maglev steering), each figure
//! against its target in the same run:
//! - edges lost one after another, a SIGKILL of every process and a cut cable in turn,
//!   each while long-lived connections run through a proxy-mode and a passthrough
//!   Service: the time until the router routes every VIP around the lost edge, the
//!   passthrough connections lost (every edge sends a flow to one node), and the
//!   proxy-mode connections lost against those that the lost edge held;
//! - every edge drained and started again in turn under traffic: failed new connections;
//! - the load balancers and their VIPs before and after all of it;
//! - in the L2 mode, the owner of a VIP cut off from etcd: the most edges holding it at
//!   once, and the time until another edge does.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use tandem_lab::edges::Announce;
use tandem_lab::lab::ServedService;
use tandem_lab::traffic::{Summary, Traffic, TrafficArgs};
use tandem_lab::{Lab, LabOptions, LbMode};

use crate::BenchOptions;
use crate::report::{Row, Section, Target, Value};

const EDGES: usize = 3;
/// A new Service must answer within this.
const SERVED_WITHIN: Duration = Duration::from_secs(60);
/// A restarted edge must be announced again within this.
const BACK_WITHIN: Duration = Duration::from_secs(30);
/// Traffic goes on this long after a loss, so that late breaks count too.
const SETTLE: Duration = Duration::from_secs(2);

/// How much the run measures.
struct Scale {
    /// Edges lost one after another.
    losses: usize,
    /// Long-lived connections per Service during each loss.
    long_lived: usize,
}

impl Scale {
    fn for_options(options: &BenchOptions) -> Self {
        if options.quick {
            Self {
                losses: 2,
                long_lived: 3,
            }
        } else {
            Self {
                losses: 9,
                long_lived: 8,
            }
        }
    }
}

/// Runs `body` on a lab of `announce`, in a thread of its own inside the lab's
/// control-plane namespace.
fn with_lab<T: Send + 'static>(
    announce: Announce,
    body: impl for<'a> FnOnce(&'a mut Lab) -> futures::future::BoxFuture<'a, Result<T>> + Send + 'static,
) -> Result<T> {
    std::thread::Builder::new()
        .name("edge-cluster-bench".to_owned())
        .spawn(move || -> Result<T> {
            let options = LabOptions {
                cluster_id: "bench".to_owned(),
                edges: EDGES,
                announce,
                ..LabOptions::default()
            };
            let prepared = Lab::prepare(&options)?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .context("building the tokio runtime")?;
            runtime.block_on(async {
                let progress = |what: &str| eprintln!("[edge cluster] {what}");
                let mut lab = Lab::start(prepared, options, &progress).await?;
                let result = body(&mut lab).await;
                lab.shutdown().await?;
                result
            })
        })
        .context("starting the edge cluster benchmark thread")?
        .join()
        .map_err(|_| anyhow!("the edge cluster benchmark thread panicked"))?
}

pub fn run(options: &BenchOptions) -> Result<Section> {
    let scale = Scale::for_options(options);
    let mut rows = with_lab(Announce::Bgp, move |lab| {
        Box::pin(async move { losses(lab, &scale).await })
    })?;
    rows.extend(with_lab(Announce::L2, |lab| Box::pin(l2_partition(lab)))?);
    Ok(Section {
        title: "Edge cluster: losing an edge under traffic".to_owned(),
        figures: Vec::new(),
        rows,
        notes: vec![
            "The lab with three edges behind a router (BIRD 2, resilient ECMP with an L4 hash, BFD 3 × 100 ms, no \
             graceful restart), their state in a 3-member etcd, passthrough flows steered by Maglev; iptables node proxies, the \
             edges' own listeners. Edges are lost one after another, a SIGKILL of its cloud-mock and BIRD and a cut \
             cable (its switch port down: only BFD can tell) in turn, each while long-lived connections exchange a \
             message a second through a proxy-mode and a passthrough Service beside 1 new connection a second each; \
             the lost edge is started (or plugged in) again before the next."
                .to_owned(),
            "Routed around: from the loss until the router has no route left through the lost edge for either VIP. \
             Proxy-mode connections end where they are proxied: those the lost edge held are lost with it. The \
             router installs BIRD's routes as resilient nexthop groups (128 buckets, 5 s idle timer; \
             tests/lab/src/resilient_ecmp.rs), so a lost next hop moves only its own flows: a hash-threshold multipath \
             route, as BIRD and FRR install it, would move some flows between the remaining edges too, and end \
             those as well."
                .to_owned(),
            "Flows moved by one node joining or leaving the Maglev table (16,381 slots), measured in \
             cloud-mock/dataplane/tests/maglev.rs and its unit tests: the node's own share (1/N) and under 1 % more up \
             to 20 nodes (3 → 2 nodes 0.04 % more, 10 → 9 0.36 %, 20 → 19 0.66 %)."
                .to_owned(),
        ],
    })
}

/// Long-lived connections (each with 1 new connection a second beside) through each of
/// `services`, `count` per Service, in Service order.
async fn start_long_lived(
    lab: &Lab,
    services: &[ServedService],
    count: usize,
    scenario: &str,
) -> Result<Vec<Vec<Traffic>>> {
    let mut all = Vec::new();
    for service in services {
        let mut args = TrafficArgs::new(std::net::SocketAddr::new(service.vip, service.plan.port));
        args.rate = 1;
        let mut traffic = Vec::new();
        for n in 0..count {
            let name = format!("{scenario}-{}-{n}", service.plan.mode.as_str());
            traffic.push(
                lab.start_traffic(lab.topology.client_in_range(), &args, &name)
                    .await?,
            );
        }
        all.push(traffic);
    }
    Ok(all)
}

async fn stop_long_lived(all: Vec<Vec<Traffic>>) -> Result<Vec<Vec<Summary>>> {
    let mut summaries = Vec::new();
    for traffic in all {
        summaries.push(Traffic::stop_all(traffic).await?);
    }
    Ok(summaries)
}

fn broken(summaries: &[Summary]) -> usize {
    summaries.iter().filter(|s| !s.long_lived_kept()).count()
}

async fn losses(lab: &mut Lab, scale: &Scale) -> Result<Vec<Row>> {
    let services = lab
        .create_served_services(
            "bench-edges",
            &[LbMode::Proxy, LbMode::Passthrough],
            SERVED_WITHIN,
        )
        .await?;
    let vips: Vec<IpAddr> = services.iter().map(|s| s.vip).collect();
    let before = lab.load_balancer_vips().await?;
    let mut routed = Vec::new();
    let (mut proxy_lost, mut proxy_on_lost_edge, mut passthrough_lost) = (0, 0, 0);
    for loss in 0..scale.losses {
        let edge = loss % EDGES + 1;
        let cable = loss % 2 == 1;
        let traffic = start_long_lived(lab, &services, scale.long_lived, "loss").await?;
        let held = lab.edges_holding_long_lived(&services[0]).await?;
        let lost_at = Instant::now();
        if cable {
            lab.edges.set_uplink(edge, false)?;
        } else {
            lab.edges.kill_edge(edge)?;
        }
        let around = lab
            .edges
            .wait_next_hops(&lab.topology, &vips, EDGES - 1, Duration::from_secs(10))
            .await;
        let took = lost_at.elapsed();
        tokio::time::sleep(SETTLE).await;
        let summaries = stop_long_lived(traffic).await?;
        if cable {
            lab.edges.set_uplink(edge, true)?;
        } else {
            lab.edges.start_edge(edge).await?;
        }
        around?;
        routed.push(took);
        proxy_lost += broken(&summaries[0]);
        proxy_on_lost_edge += held.get(&edge).copied().unwrap_or(0);
        passthrough_lost += broken(&summaries[1]);
        eprintln!(
            "[edge cluster] edge {edge} {}: routed around after {took:.2?}; long-lived lost: \
             proxy {} (the edge held {}), passthrough {}",
            if cable { "cable cut" } else { "killed" },
            broken(&summaries[0]),
            held.get(&edge).copied().unwrap_or(0),
            broken(&summaries[1])
        );
        lab.edges
            .wait_next_hops(&lab.topology, &vips, EDGES, BACK_WITHIN)
            .await?;
    }

    // A rolling upgrade: every edge drained and started again, one after another.
    let traffic = lab.start_traffic_through(&services, "bench-roll").await?;
    for edge in 1..=EDGES {
        lab.edges.stop_edge(edge).await?;
        lab.edges.start_edge(edge).await?;
        lab.edges
            .wait_next_hops(&lab.topology, &vips, EDGES, BACK_WITHIN)
            .await?;
    }
    tokio::time::sleep(SETTLE).await;
    let rolled = Traffic::stop_all(traffic).await?;
    let roll_failed: usize = rolled.iter().map(Summary::failed).sum();
    let roll_sent: u64 = rolled.iter().map(|s| s.sent).sum();
    let after = lab.load_balancer_vips().await?;
    let lost_writes = before
        .iter()
        .filter(|(id, vip)| after.get(*id) != Some(vip))
        .count();

    routed.sort();
    let losses = routed.len();
    let p99 = routed
        .get((losses * 99).div_ceil(100).saturating_sub(1))
        .copied()
        .unwrap_or_default();
    let connections = losses * scale.long_lived;
    Ok(vec![
        Row {
            what: format!(
                "every VIP routed around a lost edge, p99 of {losses} losses (kill -9 and cut cable in turn)"
            ),
            ours: Value::Seconds(p99.as_secs_f64()),
            limit: None,
            target: Some(Target::AtMost(Value::Seconds(1.0))),
        },
        Row {
            what: format!(
                "established passthrough connections lost with an edge, of {connections}"
            ),
            ours: Value::Count(passthrough_lost as f64),
            limit: None,
            target: Some(Target::AtMost(Value::Count(0.0))),
        },
        Row {
            what: format!("established proxy-mode connections lost with an edge, of {connections}"),
            ours: Value::Count(proxy_lost as f64),
            limit: Some((
                "those the lost edge held".to_owned(),
                Value::Count(proxy_on_lost_edge as f64),
            )),
            target: Some(Target::RatioAtMost(1.0)),
        },
        Row {
            what: format!(
                "failed new connections through a roll of every edge (drain, start), of {roll_sent}"
            ),
            ours: Value::Count(roll_failed as f64),
            limit: None,
            target: Some(Target::AtMost(Value::Count(0.0))),
        },
        Row {
            what: format!(
                "load balancers lost or changed across all of it, of {}",
                before.len()
            ),
            ours: Value::Count(lost_writes as f64),
            limit: None,
            target: Some(Target::AtMost(Value::Count(0.0))),
        },
    ])
}

/// The L2 mode: the owner of a proxy-mode VIP cut off from etcd.
async fn l2_partition(lab: &mut Lab) -> Result<Vec<Row>> {
    let services = lab
        .create_served_services("bench-l2", &[LbMode::Proxy], SERVED_WITHIN)
        .await?;
    let vip = services[0].vip;
    let owner = match lab.edges.l2_owners(vip)?.as_slice() {
        [owner] => *owner,
        owners => anyhow::bail!("{vip} has the owners {owners:?}, not one"),
    };
    let watch = lab.edges.l2_looks().watch(vip, None);
    let cut_at = Instant::now();
    lab.edges.cut_from_etcd(owner, true)?;
    let mut given_up = None;
    while given_up.is_none() && cut_at.elapsed() < Duration::from_secs(10) {
        if !lab.edges.l2_owners(vip)?.contains(&owner) {
            given_up = Some(cut_at.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let taken_over = lab.edges.wait_l2_owner_other_than(vip, owner).await;
    let took = cut_at.elapsed();
    tokio::time::sleep(SETTLE).await;
    let most = watch.stop().await;
    lab.edges.cut_from_etcd(owner, false)?;
    taken_over?;
    Ok(vec![
        Row {
            what: "L2 mode: edges holding one VIP at once beyond one, its owner cut off from etcd (every 20 ms)"
                .to_owned(),
            ours: Value::Count(most.saturating_sub(1) as f64),
            limit: None,
            target: Some(Target::AtMost(Value::Count(0.0))),
        },
        Row {
            what: "L2 mode: the owner cut off from etcd gives the VIP up, within one lease (3 s)".to_owned(),
            ours: Value::Seconds(given_up.unwrap_or(Duration::from_secs(10)).as_secs_f64()),
            limit: None,
            target: Some(Target::AtMost(Value::Seconds(3.0))),
        },
        Row {
            what: "L2 mode: another edge holds the VIP after its owner was cut off from etcd".to_owned(),
            ours: Value::Seconds(took.as_secs_f64()),
            limit: None,
            target: None,
        },
    ])
}
