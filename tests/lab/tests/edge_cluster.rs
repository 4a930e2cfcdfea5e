//! An edge cluster that survives losing a host (issue 42): three edges behind a router,
//! their state in a 3-member etcd, in the lab (`tandem-lab --edges 3`), with real BIRD,
//! real etcd and real packets.
//!
//! With `--announce bgp` a proxy-mode and a passthrough-mode Service carry client traffic
//! (`tandem-traffic`: 20 new connections a second each, and one long-lived connection
//! each) through every scenario in turn:
//!
//! | scenario | target |
//! |---|---|
//! | the edge holding the long-lived proxy-mode connection killed (SIGKILL: its host gone), then started again | every VIP answers again (the router drops the edge) within 1 s; the long-lived passthrough connection kept; only connections that were in flight to the dead edge fail |
//! | another edge's link to the router taken down, then up | the same, by BFD |
//! | an edge cut off from etcd but not from the router | 0 failed, both long-lived kept; that edge refuses writes with 503, the others take them |
//! | the etcd leader killed, then started again | 0 failed, both long-lived kept; writes succeed after |
//! | every edge drained (SIGTERM) and started again, one after another | 0 failed new connections; the long-lived passthrough connection kept |
//! | every edge restarted at once | failures counted; every VIP answers again; no load balancer lost |
//!
//! Through all of them no acknowledged write is lost: the cloud holds the same load
//! balancers, with the same VIPs, before and after.
//!
//! With `--announce l2` one edge owns each VIP: its host is lost, then another owner is cut
//! off from etcd, while the test looks at every edge's addresses every 20 ms: never two
//! owners, and another edge answers for the VIP within its lease. A passthrough Service is
//! refused there, with the reason on the Service: the owner takes the VIP's packets itself.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use tandem_lab::edges::Announce;
use tandem_lab::harness;
use tandem_lab::lab::{Lab, ServedService};
use tandem_lab::outcome::{self, Outcome};
use tandem_lab::scenario::{LbMode, ServicePlan};
use tandem_lab::traffic::{Summary, Traffic};

/// Edges of the cluster.
const EDGES: usize = 3;
/// How soon every VIP must answer again after an edge is lost, as the router sees it.
const ROUTED_AROUND_WITHIN: Duration = Duration::from_secs(1);
/// What `tandem-traffic` gives one exchange: a connection in flight to a dead edge fails
/// after this.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(1);
/// Traffic goes on this long after a disruption, so that late failures count too.
const SETTLE: Duration = Duration::from_secs(2);
/// A new Service must answer within this.
const SERVED_WITHIN: Duration = Duration::from_secs(60);
/// A restarted edge must announce every VIP again within this.
const BACK_WITHIN: Duration = Duration::from_secs(30);

const KILLED: &str = "the edge holding the long-lived proxy connection killed (SIGKILL)";
const LINK_DOWN: &str = "another edge's link to the router down, then up";
const CUT_FROM_ETCD: &str = "an edge cut off from etcd, not from the router";
const ETCD_LEADER: &str = "the etcd leader killed, then started again";
const ROLLED: &str = "every edge drained (SIGTERM) and started, one after another";
const ALL_RESTARTED: &str = "every edge restarted at once";

fn lab_options(announce: Announce) -> tandem_lab::LabOptions {
    let mut options = harness::options_from_env(&[2, 2, 0]).unwrap();
    options.edges = EDGES;
    options.announce = announce;
    options
}

#[test]
fn an_edge_cluster_announcing_by_bgp_survives_losing_any_edge() {
    harness::run(lab_options(Announce::Bgp), |mut lab| async move {
        let started = Instant::now();
        let services = lab
            .create_served_services(
                "edges",
                &[LbMode::Proxy, LbMode::Passthrough],
                SERVED_WITHIN,
            )
            .await
            .unwrap();
        let before = lab.load_balancer_vips().await.unwrap();
        let mut outcomes = Vec::new();
        let mut record = |name: &'static str, result: Result<Outcome>| {
            let outcome = result.unwrap_or_else(|e| Outcome::could_not_run(name, &e));
            eprintln!("{}", outcome.describe());
            outcomes.push(outcome);
        };
        let killed = kill_the_edge_of_the_long_lived_connection(&mut lab, &services).await;
        let killed_edge = killed.as_ref().map(|(_, edge)| *edge).unwrap_or(1);
        record(KILLED, killed.map(|(outcome, _)| outcome));
        record(
            LINK_DOWN,
            take_a_link_down(&mut lab, &services, killed_edge % EDGES + 1).await,
        );
        record(
            CUT_FROM_ETCD,
            cut_an_edge_from_etcd(&mut lab, &services).await,
        );
        record(ETCD_LEADER, kill_the_etcd_leader(&mut lab, &services).await);
        record(ROLLED, roll_every_edge(&mut lab, &services).await);
        record(ALL_RESTARTED, restart_every_edge(&mut lab, &services).await);

        let after = lab.load_balancer_vips().await.unwrap();
        let title = format!(
            "Failed requests through an edge cluster of {EDGES} edges announcing by BGP, node \
             proxies in {} mode (20 new connections a second per Service, one long-lived \
             connection each; the whole run {:.0?})",
            lab.proxy_mode,
            started.elapsed()
        );
        println!("{}", outcome::table(&title, &outcomes));
        let mut missed: Vec<String> = outcomes
            .iter()
            .flat_map(|o| o.missed.iter().map(move |m| format!("{}: {m}", o.scenario)))
            .collect();
        if before != after {
            missed.push(format!(
                "no acknowledged write lost: the load balancers were {before:?}, then {after:?}"
            ));
        }
        assert!(
            missed.is_empty(),
            "{} edge-cluster target(s) missed:\n{}",
            missed.len(),
            missed.join("\n")
        );
        lab
    })
    .unwrap();
}

#[test]
fn an_edge_cluster_announcing_by_l2_keeps_one_owner_per_vip() {
    harness::run(lab_options(Announce::L2), |mut lab| async move {
        let services = lab
            .create_served_services("edges", &[LbMode::Proxy], SERVED_WITHIN)
            .await
            .unwrap();
        let vip = services[0].vip;

        // The owner of a VIP takes its packets itself: a passthrough Service is refused,
        // on the Service, with the reason.
        let passthrough = ServicePlan::new("edges-l2-passthrough", LbMode::Passthrough);
        lab.create_service(&passthrough).await.unwrap();
        let message = lab
            .wait_for_refusal(&passthrough, "UnsupportedByProvider", SERVED_WITHIN)
            .await
            .unwrap();
        assert!(message.contains("BGP mode"), "{message}");

        // The owner's host is gone (its processes killed, its cables cut): another edge
        // claims the VIP once the owner's lease expires, and answers ARP for it. The lost
        // edge, started again, gives up the VIP its kernel still held.
        let owner = one_owner(&lab, vip).unwrap();
        let traffic = lab
            .start_traffic_through(&services, "l2-lost")
            .await
            .unwrap();
        let watch = lab.edges.l2_looks().watch(vip, Some(owner));
        let lost = Instant::now();
        lab.edges.lose_host(owner).unwrap();
        let taken_over = lab
            .edges
            .wait_l2_owner_other_than(vip, owner)
            .await
            .unwrap();
        let took = lost.elapsed();
        tokio::time::sleep(SETTLE).await;
        let summaries = Traffic::stop_all(traffic).await.unwrap();
        let most = watch.stop().await;
        println!(
            "L2, owner edge {owner}'s host lost: edge {taken_over} owns {vip} {took:.2?} after; \
             at most {most} owner(s) at once among those reachable; {}",
            summaries[0].describe()
        );
        assert_eq!(most, 1, "two reachable edges held {vip} at once");
        lab.edges.start_edge(owner).await.unwrap();
        let started_again = Instant::now();
        while lab.edges.l2_owners(vip).unwrap() != [taken_over] {
            assert!(
                started_again.elapsed() < Duration::from_secs(5),
                "edge {owner} started again, and {vip}'s owners are {:?}",
                lab.edges.l2_owners(vip)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        // The new owner cut off from etcd gives the VIP up within one lease period, before
        // another edge can claim it: never two owners, and the VIP answers again.
        let cut = one_owner(&lab, vip).unwrap();
        let traffic = lab
            .start_traffic_through(&services, "l2-cut")
            .await
            .unwrap();
        let watch = lab.edges.l2_looks().watch(vip, None);
        let cut_at = Instant::now();
        lab.edges.cut_from_etcd(cut, true).unwrap();
        let taken_over = lab.edges.wait_l2_owner_other_than(vip, cut).await.unwrap();
        let took = cut_at.elapsed();
        tokio::time::sleep(SETTLE).await;
        let summaries = Traffic::stop_all(traffic).await.unwrap();
        let most = watch.stop().await;
        lab.edges.cut_from_etcd(cut, false).unwrap();
        println!(
            "L2, owner edge {cut} cut from etcd: edge {taken_over} owns {vip} {took:.2?} after; \
             at most {most} owner(s) at once; {}",
            summaries[0].describe()
        );
        assert_eq!(most, 1, "two edges held {vip} at once");
        lab
    })
    .unwrap();
}

/// Waits until the router has `hops` next hops for every Service's VIP.
async fn wait_for_hops(
    lab: &Lab,
    services: &[ServedService],
    hops: usize,
    within: Duration,
) -> Result<Duration> {
    let vips: Vec<IpAddr> = services.iter().map(|s| s.vip).collect();
    lab.edges
        .wait_next_hops(&lab.topology, &vips, hops, within)
        .await
}

/// Checks what an unplanned edge loss may cost: every failure began before the router
/// dropped the edge, as an exchange in flight to it (`routed_at` after the loss), and the
/// long-lived passthrough connection was kept (every edge sends its flow to one node).
fn check_edge_loss(
    outcome: &mut Outcome,
    summaries: &[Summary],
    lost_at_ms: u64,
    routed_at: Duration,
) {
    outcome.check(
        routed_at <= ROUTED_AROUND_WITHIN,
        format!(
            "every VIP routed around the lost edge within {ROUTED_AROUND_WITHIN:?}: {routed_at:.2?}"
        ),
    );
    let routed_ms = lost_at_ms + u64::try_from(routed_at.as_millis()).unwrap_or(u64::MAX);
    let slack_ms = u64::try_from((EXCHANGE_TIMEOUT + Duration::from_millis(200)).as_millis())
        .unwrap_or(u64::MAX);
    for summary in summaries {
        let late: Vec<_> = summary
            .failures
            .iter()
            .filter(|f| f.at_ms + slack_ms < lost_at_ms || f.at_ms > routed_ms)
            .collect();
        outcome.check(
            late.is_empty(),
            format!(
                "only exchanges in flight to the lost edge failed (lost at {lost_at_ms} ms, routed \
                 around at {routed_ms} ms): {late:?}"
            ),
        );
    }
    check_passthrough_long_lived(outcome, summaries);
}

/// The long-lived passthrough connection kept: every edge sends its flow to one node.
fn check_passthrough_long_lived(outcome: &mut Outcome, summaries: &[Summary]) {
    if let Some(passthrough) = summaries.get(1) {
        outcome.check(
            passthrough.long_lived_kept(),
            format!(
                "the long-lived passthrough connection kept: {}",
                passthrough.describe()
            ),
        );
    }
}

fn ms_since(traffic: &[Traffic]) -> u64 {
    traffic.first().map_or(0, |t| {
        u64::try_from(t.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    })
}

/// Kills the edge that holds the long-lived proxy-mode connection: that connection is
/// lost with its edge, and nothing else may be.
async fn kill_the_edge_of_the_long_lived_connection(
    lab: &mut Lab,
    services: &[ServedService],
) -> Result<(Outcome, usize)> {
    let started = Instant::now();
    let mut outcome = Outcome::new(KILLED, false).with_target(
        "routed around within 1 s; only exchanges to the dead edge failed; passthrough long-lived kept",
    );
    let traffic = lab.start_traffic_through(services, "killed").await?;
    let holding = lab.edges_holding_long_lived(&services[0]).await?;
    let edge = *holding
        .keys()
        .next()
        .context("no edge holds the long-lived proxy-mode connection")?;
    let lost_at_ms = ms_since(&traffic);
    lab.edges.kill_edge(edge)?;
    let routed = wait_for_hops(lab, services, EDGES - 1, Duration::from_secs(10)).await?;
    tokio::time::sleep(SETTLE).await;
    let summaries = Traffic::stop_all(traffic).await?;
    check_edge_loss(&mut outcome, &summaries, lost_at_ms, routed);
    outcome.note(format!(
        "edge {edge} killed; the router dropped it {routed:.2?} after"
    ));
    lab.edges.start_edge(edge).await?;
    let back = wait_for_hops(lab, services, EDGES, BACK_WITHIN).await?;
    outcome.note(format!(
        "edge {edge} started again: announcing {back:.2?} after it served"
    ));
    Ok((outcome.finish(summaries, started), edge))
}

/// Takes edge `edge`'s link to the router down, then up again, under traffic: only BFD
/// tells the router. The router's resilient ECMP moves no flow of another edge either way,
/// so a long-lived proxy-mode connection on another edge is kept.
async fn take_a_link_down(
    lab: &mut Lab,
    services: &[ServedService],
    edge: usize,
) -> Result<Outcome> {
    let started = Instant::now();
    let mut outcome = Outcome::new(LINK_DOWN, false).with_target(
        "routed around within 1 s by BFD; only exchanges to that edge failed, also when it came back; long-lived connections on other edges kept",
    );
    let traffic = lab.start_traffic_through(services, "link-down").await?;
    let holding = lab.edges_holding_long_lived(&services[0]).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lost_at_ms = ms_since(&traffic);
    lab.edges.set_uplink(edge, false)?;
    let routed = wait_for_hops(lab, services, EDGES - 1, Duration::from_secs(10)).await;
    if routed.is_ok() {
        tokio::time::sleep(SETTLE).await;
    }
    lab.edges.set_uplink(edge, true)?;
    let back = wait_for_hops(lab, services, EDGES, BACK_WITHIN).await;
    if back.is_ok() {
        tokio::time::sleep(SETTLE).await;
    }
    let summaries = Traffic::stop_all(traffic).await;
    let (routed, back, summaries) = (routed?, back?, summaries?);
    check_edge_loss(&mut outcome, &summaries, lost_at_ms, routed);
    if !holding.contains_key(&edge) {
        outcome.check(
            summaries[0].long_lived_kept(),
            format!(
                "the long-lived proxy-mode connection, on edge {holding:?}, kept: {}",
                summaries[0].describe()
            ),
        );
    }
    outcome.note(format!(
        "edge {edge}'s link down: the router dropped it {routed:.2?} after; up again: back {back:.2?} after"
    ));
    Ok(outcome.finish(summaries, started))
}

/// A node pool written through edge `edge`'s API alone: what that edge answered.
async fn write_through(
    lab: &Lab,
    edge: usize,
    name: &str,
) -> Result<Result<(), cloud_mock_sdk::Error>> {
    let spec = cloud_mock_sdk::NodePoolSpec::default();
    Ok(lab
        .edge_client(edge)?
        .put_node_pool(name, &spec, None)
        .await
        .map(drop))
}

/// Cuts edge 1 off from etcd: it goes on serving what it has, refuses writes with a clear
/// error, and the other edges take them.
async fn cut_an_edge_from_etcd(lab: &mut Lab, services: &[ServedService]) -> Result<Outcome> {
    let started = Instant::now();
    let mut outcome = Outcome::new(CUT_FROM_ETCD, true);
    let traffic = lab.start_traffic_through(services, "cut-from-etcd").await?;
    lab.edges.cut_from_etcd(1, true)?;
    // Its etcd client notices within its request timeout.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let refused = write_through(lab, 1, "cut-edge-write").await?;
    let taken = write_through(lab, 2, "other-edge-write").await?;
    tokio::time::sleep(SETTLE).await;
    lab.edges.cut_from_etcd(1, false)?;
    let summaries = Traffic::stop_all(traffic).await?;
    match &refused {
        Err(error @ cloud_mock_sdk::Error::Unavailable { .. }) => {
            outcome.note(format!("the cut edge refused a write: {error}"));
        }
        other => outcome.check(
            false,
            format!("the cut edge refuses writes with 503: {other:?}"),
        ),
    }
    outcome.check(
        taken.is_ok(),
        format!("another edge takes writes: {taken:?}"),
    );
    Ok(outcome.finish(summaries, started))
}

/// Kills the etcd leader: the members elect another, the edges go on, writes succeed.
async fn kill_the_etcd_leader(lab: &mut Lab, services: &[ServedService]) -> Result<Outcome> {
    let started = Instant::now();
    let mut outcome = Outcome::new(ETCD_LEADER, true);
    let traffic = lab.start_traffic_through(services, "etcd-leader").await?;
    let leader = lab
        .edges
        .etcd_leader()
        .await?
        .context("no etcd member leads")?;
    lab.edges.kill_etcd_member(leader)?;
    let elected = Instant::now();
    let new_leader = loop {
        if let Some(member) = lab.edges.etcd_leader().await? {
            break member;
        }
        ensure!(
            elected.elapsed() < Duration::from_secs(15),
            "no etcd leader 15 s after the old one was killed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let elected = elected.elapsed();
    let mut written = None;
    for attempt in 0..50 {
        match write_through(lab, 1 + attempt % EDGES, "after-leader-killed").await? {
            Ok(()) => {
                written = Some(attempt);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    outcome.check(
        written.is_some(),
        "a write succeeds after the leader was killed",
    );
    tokio::time::sleep(SETTLE).await;
    let summaries = Traffic::stop_all(traffic).await?;
    lab.edges.start_etcd_member(leader)?;
    lab.edges.wait_etcd_healthy().await?;
    outcome.note(format!(
        "etcd member {leader} led and was killed; member {new_leader} led {elected:.2?} after"
    ));
    Ok(outcome.finish(summaries, started))
}

/// Every edge drained and started again in turn, as a rolling upgrade does.
async fn roll_every_edge(lab: &mut Lab, services: &[ServedService]) -> Result<Outcome> {
    let started = Instant::now();
    let mut outcome = Outcome::new(ROLLED, false)
        .with_target("0 failed new connections; passthrough long-lived kept");
    let traffic = lab.start_traffic_through(services, "rolled").await?;
    let mut drains = Vec::new();
    for edge in 1..=EDGES {
        drains.push(lab.edges.stop_edge(edge).await?);
        lab.edges.start_edge(edge).await?;
        wait_for_hops(lab, services, EDGES, BACK_WITHIN).await?;
    }
    tokio::time::sleep(SETTLE).await;
    let summaries = Traffic::stop_all(traffic).await?;
    for summary in &summaries {
        outcome.check(
            summary.failed() == 0,
            format!("0 failed new connections: {}", summary.describe()),
        );
    }
    check_passthrough_long_lived(&mut outcome, &summaries);
    outcome.note(format!(
        "each edge from SIGTERM to stopped (its drain): {}",
        drains
            .iter()
            .map(|d| format!("{:.2}s", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    Ok(outcome.finish(summaries, started))
}

/// Every edge stopped at once and started again: the VIPs answer again from the state
/// in etcd.
async fn restart_every_edge(lab: &mut Lab, services: &[ServedService]) -> Result<Outcome> {
    let started = Instant::now();
    let mut outcome =
        Outcome::new(ALL_RESTARTED, false).with_target("counted; every VIP answers again");
    let traffic = lab.start_traffic_through(services, "all-restarted").await?;
    let restart = Instant::now();
    for edge in 1..=EDGES {
        lab.edges.kill_edge(edge)?;
    }
    for edge in 1..=EDGES {
        lab.edges.start_edge(edge).await?;
    }
    let hops = wait_for_hops(lab, services, EDGES, BACK_WITHIN).await;
    let answering = restart.elapsed();
    outcome.check(
        hops.is_ok(),
        format!("every edge announces every VIP again: {hops:?}"),
    );
    for service in services {
        let served = lab.serve_within(service.vip, Duration::from_secs(10)).await;
        outcome.check(
            served.is_ok(),
            format!("{} answers again: {served:?}", service.vip),
        );
    }
    tokio::time::sleep(SETTLE).await;
    let summaries = Traffic::stop_all(traffic).await?;
    outcome.note(format!(
        "every edge killed and started: every VIP announced by all {EDGES} edges {answering:.2?} after"
    ));
    Ok(outcome.finish(summaries, started))
}

/// The one edge that owns `vip` in the L2 mode.
fn one_owner(lab: &Lab, vip: IpAddr) -> Result<usize> {
    match lab.edges.l2_owners(vip)?.as_slice() {
        [owner] => Ok(*owner),
        owners => bail!("{vip} has the owners {owners:?}, not one"),
    }
}
