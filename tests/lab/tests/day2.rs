//! Day 2: what clients see while Tandem's node proxies are restarted and switched between
//! proxy modes, while it loses its controller leader or its API server, and while someone
//! else flushes or edits a node's rules (issue 27).
//!
//! One lab (three nodes, two controller replicas electing a leader, node proxies with a
//! 10 s `--sync-period`) runs every scenario in turn, in the proxy mode the run asks for
//! (`TANDEM_E2E_PROXY_MODE`, see `tandem_lab::harness`). During each, `tandem-traffic`
//! sends client traffic through a proxy-mode and a passthrough-mode Service at once: 20
//! new connections a second each, and one long-lived connection each that exchanges a
//! message every second. Every scenario runs even when an earlier one missed its target;
//! the table of failed requests per scenario and LB mode is printed at the end, then the
//! missed targets fail the test.
//!
//! | scenario | target |
//! |---|---|
//! | every node proxy restarted (SIGTERM, started again), one node after another | 0 failed, long-lived kept |
//! | one node's proxy switched to the other proxy mode and back | 0 failed, long-lived kept, never a sample with neither mode's rules, the old mode's rules gone after |
//! | the controller's leader killed (SIGKILL) | 0 failed, long-lived kept, the other replica takes the Lease, a Service created then is served |
//! | the API server unreachable for 60 s (its packets dropped), then back | 0 failed, long-lived kept, a Service created after is served |
//! | a node proxy killed (SIGKILL), its rules flushed while it is down, started again | the rules back within 1 s of its start (failures counted) |
//! | one DNAT rule (iptables) or endpoint map element (nftables) of each Service deleted under a running node proxy | back within one `--sync-period` (failures counted) |
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use nix::sys::signal::Signal;
use tandem_common::ProxyMode;
use tandem_lab::harness;
use tandem_lab::lab::{Lab, ServedService, controller_leads, node_rules};
use tandem_lab::outcome::{self, Outcome};
use tandem_lab::rules::{self, ServicePort};
use tandem_lab::scenario::{LbMode, ServicePlan};
use tandem_lab::traffic::Traffic;
use tandem_netlab::{IpFamily, Netns};
use tokio_util::sync::CancellationToken;

/// The node proxies' `--sync-period`: drift must be repaired within it.
const SYNC_PERIOD: Duration = Duration::from_secs(10);
/// How long traffic goes on after a disruption, so that late failures are counted too;
/// also the pause between two nodes' restarts (the cloud's health checks, 2 probes 1 s
/// apart, see a restarted node healthy again).
const SETTLE: Duration = Duration::from_secs(2);
/// How long the API server is unreachable.
const API_OUTAGE: Duration = Duration::from_secs(60);
/// A node proxy started on a node without its rules must have them back within this.
const RULES_RESTORED_WITHIN: Duration = Duration::from_secs(1);
/// Slack on top of one sync period for a repair to be seen: the sync itself and the 200 ms
/// between two looks at the node's rules.
const REPAIR_SLACK: Duration = Duration::from_secs(2);
/// The controller's Lease lasts 15 s (its default, as the chart runs it); a standby takes
/// it over within that and a retry.
const TAKEOVER_WITHIN: Duration = Duration::from_secs(25);
/// How long after the API server is back two leading controller replicas are watched for.
const LEADERS_SETTLE_WITHIN: Duration = Duration::from_secs(30);
/// A Service created after a disruption must be served within this.
const NEW_SERVICE_SERVED_WITHIN: Duration = Duration::from_secs(60);

#[test]
fn day_two_operations_fail_no_requests() {
    let mut options = harness::options_from_env(&[2, 2, 0]).unwrap();
    options.controller_replicas = 2;
    options.sync_period = Some(SYNC_PERIOD);
    harness::run(options, |mut lab| async move {
        let started = Instant::now();
        // In LB mode order (proxy, passthrough), both over every pod.
        let services = lab
            .create_served_services(
                "day2",
                &[LbMode::Proxy, LbMode::Passthrough],
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        let mut outcomes = Vec::new();
        let mut record = |name: &'static str, result: Result<Outcome>| {
            let outcome = result.unwrap_or_else(|e| Outcome::could_not_run(name, &e));
            eprintln!("{}", outcome.describe());
            outcomes.push(outcome);
        };
        record(RESTART, restart_every_node_proxy(&mut lab, &services).await);
        record(
            MODE_SWITCH,
            switch_proxy_mode_and_back(&mut lab, &services).await,
        );
        record(
            LEADER_KILLED,
            kill_the_controller_leader(&mut lab, &services).await,
        );
        record(
            API_OUTAGE_NAME,
            lose_the_api_server(&mut lab, &services).await,
        );
        record(
            KILLED_AND_FLUSHED,
            kill_and_flush_a_node_proxy(&mut lab, &services).await,
        );
        record(DRIFT, repair_deleted_rules(&mut lab, &services).await);

        let title = format!(
            "Failed requests during day-2 operations, node proxies in {} mode \
             (20 new connections a second per Service, one long-lived connection each; \
             the whole run {:.0?})",
            lab.proxy_mode,
            started.elapsed()
        );
        println!("{}", outcome::table(&title, &outcomes));
        let missed: Vec<String> = outcomes
            .iter()
            .flat_map(|o| o.missed.iter().map(move |m| format!("{}: {m}", o.scenario)))
            .collect();
        assert!(
            missed.is_empty(),
            "{} day-2 target(s) missed:\n{}",
            missed.len(),
            missed.join("\n")
        );
        lab
    })
    .unwrap();
}

const RESTART: &str = "every node proxy restarted (SIGTERM, started again)";
const MODE_SWITCH: &str = "a node proxy switched to the other proxy mode and back";
const LEADER_KILLED: &str = "the controller's leader killed (SIGKILL)";
const API_OUTAGE_NAME: &str = "the API server unreachable for 60 s";
const KILLED_AND_FLUSHED: &str = "a node proxy killed (SIGKILL), its rules flushed, started";
const DRIFT: &str = "a DNAT rule / map element of each Service deleted";

fn all_pods(lab: &Lab) -> Vec<String> {
    lab.topology.pods().iter().map(|p| p.name.clone()).collect()
}

/// Creates a proxy-mode Service over every pod; says how long until it had its ingress IP
/// (the controller's part) and until it answered (the node proxies').
async fn create_and_serve(lab: &Lab, name: &str) -> Result<String> {
    let start = Instant::now();
    let mut plan = ServicePlan::new(name, LbMode::Proxy);
    plan.pods = all_pods(lab);
    lab.create_service(&plan).await?;
    let vip = lab
        .wait_for_ingress(&plan, NEW_SERVICE_SERVED_WITHIN)
        .await?;
    let ingress = start.elapsed();
    lab.serve_within(
        vip,
        NEW_SERVICE_SERVED_WITHIN.saturating_sub(start.elapsed()),
    )
    .await?;
    Ok(format!(
        "its ingress IP after {:.1}s, answering after {:.1}s",
        ingress.as_secs_f64(),
        start.elapsed().as_secs_f64()
    ))
}

/// Every node proxy restarted, one node after another, as a DaemonSet's rolling update
/// does (it waits for each node's readiness, `/healthz`, before the next).
async fn restart_every_node_proxy(lab: &mut Lab, services: &[ServedService]) -> Result<Outcome> {
    let started = Instant::now();
    let mut outcome = Outcome::new(RESTART, true);
    let traffic = lab.start_traffic_through(services, "restart").await?;
    let mode = lab.proxy_mode;
    let mut downtimes = Vec::new();
    for index in 0..lab.topology.nodes().len() {
        downtimes.push(lab.restart_node_proxy(index, mode).await?);
        tokio::time::sleep(SETTLE).await;
    }
    outcome.note(format!(
        "each node from SIGTERM to /healthz 200 again: {}",
        durations(&downtimes)
    ));
    Ok(outcome.finish(Traffic::stop_all(traffic).await?, started))
}

fn durations(all: &[Duration]) -> String {
    all.iter()
        .map(|d| format!("{:.2}s", d.as_secs_f64()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn other_mode(mode: ProxyMode) -> ProxyMode {
    match mode {
        ProxyMode::Iptables => ProxyMode::Nftables,
        ProxyMode::Nftables => ProxyMode::Iptables,
    }
}

/// Each Service's TCP port and its endpoints.
fn ports(lab: &Lab, services: &[ServedService]) -> Result<Vec<(ServicePort, Vec<SocketAddrV4>)>> {
    services
        .iter()
        .map(|s| Ok((s.plan.http_port(), lab.endpoints_of(&s.plan)?)))
        .collect()
}

/// Whether a listing of `mode` serves every port.
fn all_programmed(
    mode: ProxyMode,
    listing: &str,
    ports: &[(ServicePort, Vec<SocketAddrV4>)],
) -> bool {
    ports
        .iter()
        .all(|(port, endpoints)| rules::programmed(mode, listing, port, endpoints))
}

/// One look at a node during a mode switch: whether each mode's rules served every port.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Duration,
    old: bool,
    new: bool,
}

/// Looks at `node`'s rules of both modes, over and over (the old mode's first, so that a
/// switch that installs the new rules before removing the old ones never shows a sample
/// with neither), from before the switch until `switched` fires and the node then holds
/// only the new mode's rules (or 5 s more have passed).
async fn sample_switch(
    node: Netns,
    old: ProxyMode,
    new: ProxyMode,
    ports: Vec<(ServicePort, Vec<SocketAddrV4>)>,
    switched: CancellationToken,
) -> Result<Vec<Sample>> {
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut switched_at = None;
    loop {
        let old_rules = all_programmed(old, &node_rules(&node, old, IpFamily::V4).await?, &ports);
        let new_rules = all_programmed(new, &node_rules(&node, new, IpFamily::V4).await?, &ports);
        samples.push(Sample {
            at: start.elapsed(),
            old: old_rules,
            new: new_rules,
        });
        if switched.is_cancelled() {
            let since = *switched_at.get_or_insert_with(Instant::now);
            if (new_rules && !old_rules) || since.elapsed() > Duration::from_secs(5) {
                return Ok(samples);
            }
        }
    }
}

/// What the samples of one switch show, for the report: when the new rules came and the
/// old went, and every stretch with neither.
struct SwitchSamples {
    summary: String,
    gaps: Vec<(Duration, Duration)>,
    old_gone_at_end: bool,
}

fn read_samples(samples: &[Sample]) -> SwitchSamples {
    let mut gaps = Vec::new();
    let mut gap_start = None;
    let mut last_with_rules = Duration::ZERO;
    for sample in samples {
        if sample.old || sample.new {
            if let Some(first) = gap_start.take() {
                // The rules were missing from some moment after the last sample with
                // rules until some moment before this one.
                gaps.push((first, sample.at.saturating_sub(last_with_rules)));
            }
            last_with_rules = sample.at;
        } else {
            gap_start.get_or_insert(sample.at);
        }
    }
    if let Some(first) = gap_start {
        let end = samples.last().map_or(first, |s| s.at);
        gaps.push((first, end.saturating_sub(last_with_rules)));
    }
    let first = |f: fn(&Sample) -> bool| {
        samples
            .iter()
            .find(|s| f(s))
            .map_or("never".to_owned(), |s| {
                format!("{:.2}s", s.at.as_secs_f64())
            })
    };
    let span = samples.last().map_or(Duration::ZERO, |s| s.at);
    SwitchSamples {
        summary: format!(
            "{} samples over {:.1}s (one every {:.0} ms): the new mode's rules from {}, the old mode's gone from {}",
            samples.len(),
            span.as_secs_f64(),
            span.as_secs_f64() * 1000.0 / samples.len().max(1) as f64,
            first(|s| s.new),
            first(|s| !s.old),
        ),
        gaps,
        old_gone_at_end: samples.last().is_some_and(|s| !s.old && s.new),
    }
}

/// Node 1's proxy restarted in the other proxy mode and then back, while its rules are
/// sampled to show whether a moment ever came with neither mode's rules.
async fn switch_proxy_mode_and_back(lab: &mut Lab, services: &[ServedService]) -> Result<Outcome> {
    let started = Instant::now();
    let mut outcome = Outcome::new(MODE_SWITCH, true);
    let ports = ports(lab, services)?;
    let node = lab.topology.nodes()[0].netns.clone();
    let original = lab.node_proxy_mode(0)?;
    let traffic = lab.start_traffic_through(services, "mode-switch").await?;
    for (old, new) in [
        (original, other_mode(original)),
        (other_mode(original), original),
    ] {
        let switched = CancellationToken::new();
        let sampler = tokio::spawn(sample_switch(
            node.clone(),
            old,
            new,
            ports.clone(),
            switched.clone(),
        ));
        // A first sample before the node proxy stops.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let restart = lab.restart_node_proxy(0, new).await;
        switched.cancel();
        let samples = sampler.await.context("the rule sampler")??;
        restart?;
        let read = read_samples(&samples);
        outcome.note(format!("{old} -> {new}: {}", read.summary));
        for (at, length) in &read.gaps {
            outcome.note(format!(
                "{old} -> {new}: neither mode's rules from {:.2}s, for up to {:.0} ms",
                at.as_secs_f64(),
                length.as_secs_f64() * 1000.0
            ));
        }
        outcome.check(
            read.gaps.is_empty(),
            format!("{old} -> {new}: never a moment without rules (the new mode's installed before the old mode's are removed)"),
        );
        outcome.check(
            read.old_gone_at_end,
            format!("{old} -> {new}: only the new mode's rules left after the switch"),
        );
        tokio::time::sleep(SETTLE).await;
    }
    Ok(outcome.finish(Traffic::stop_all(traffic).await?, started))
}

/// The controller's leader killed: the standby takes the Lease over and a Service created
/// after the kill is served. The Deployment's replacement replica starts afterwards.
async fn kill_the_controller_leader(lab: &mut Lab, services: &[ServedService]) -> Result<Outcome> {
    let started = Instant::now();
    let mut outcome = Outcome::new(LEADER_KILLED, true);
    let traffic = lab.start_traffic_through(services, "leader-killed").await?;
    let replicas = lab.controller_replicas();
    let leader = lab
        .controller_leader()
        .await?
        .context("no controller replica holds the Lease")?;
    let standby: Vec<String> = replicas.into_iter().filter(|r| *r != leader).collect();
    ensure!(
        !standby.is_empty(),
        "no standby replica runs beside {leader}"
    );
    let killed = Instant::now();
    lab.stop_controller(&leader, Signal::SIGKILL).await?;
    let holder = loop {
        let holder = lab.controller_leader().await?;
        if holder.as_ref().is_some_and(|h| *h != leader) || killed.elapsed() > TAKEOVER_WITHIN {
            break holder;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    outcome.note(format!(
        "{leader} killed; the Lease held by {holder:?} {:.1}s later (Lease duration 15 s)",
        killed.elapsed().as_secs_f64()
    ));
    outcome.check(
        holder.as_ref().is_some_and(|h| standby.contains(h)),
        format!("the standby ({standby:?}) takes the Lease within {TAKEOVER_WITHIN:?}: {holder:?}"),
    );
    match create_and_serve(lab, "after-leader-kill").await {
        Ok(served) => outcome.note(format!("a Service created after the takeover: {served}")),
        Err(e) => outcome.check(
            false,
            format!("a Service created after the kill is served: {e:#}"),
        ),
    }
    let replacement = lab.start_controller_replica().await?;
    outcome.note(format!("replacement replica {replacement} started"));
    tokio::time::sleep(SETTLE).await;
    Ok(outcome.finish(Traffic::stop_all(traffic).await?, started))
}

/// The API server unreachable from the whole lab for 60 s, then back; a Service created
/// after that must be served, and at no moment may two controller replicas lead.
async fn lose_the_api_server(lab: &mut Lab, services: &[ServedService]) -> Result<Outcome> {
    let started = Instant::now();
    let mut outcome = Outcome::new(API_OUTAGE_NAME, true);
    let traffic = lab.start_traffic_through(services, "api-outage").await?;
    let before = lab.controller_replicas();
    let settled = CancellationToken::new();
    let leaders = tokio::spawn(sample_leaders(
        lab.controller_metrics_addresses(),
        settled.clone(),
        Instant::now() + API_OUTAGE + LEADERS_SETTLE_WITHIN,
    ));
    let outage = lab.block_api_server().await?;
    tokio::time::sleep(API_OUTAGE).await;
    outage.end().await?;
    match create_and_serve(lab, "after-api-outage").await {
        Ok(served) => outcome.note(format!(
            "a Service created once the API server was back: {served}"
        )),
        Err(e) => outcome.check(
            false,
            format!("a Service created after the outage is served: {e:#}"),
        ),
    }
    settled.cancel();
    let leaders = leaders.await.context("the leader sampler")?;
    let most = leaders.iter().map(|(_, l)| l.len()).max().unwrap_or(0);
    let doubled: Vec<&(Duration, Vec<String>)> =
        leaders.iter().filter(|(_, l)| l.len() > 1).collect();
    match (doubled.first(), doubled.last()) {
        (Some((first, who)), Some((last, _))) => outcome.note(format!(
            "{who:?} led at once from {:.1}s to {:.1}s after the outage began ({} samples, one every 0.5 s)",
            first.as_secs_f64(),
            last.as_secs_f64(),
            leaders.len()
        )),
        _ => outcome.note(format!(
            "never more than {most} replica leading ({} samples, one every 0.5 s)",
            leaders.len()
        )),
    }
    outcome.check(
        most <= 1,
        "at no moment two controller replicas leading (a leader that cannot renew its Lease stops writing before another may take it)",
    );
    let after = lab.controller_replicas();
    outcome.note(format!(
        "controller replicas before {before:?}, after {after:?}, the Lease held by {:?}",
        lab.controller_leader().await?
    ));
    // A replica that left (it lost the Lease) is replaced, as its Deployment would.
    for _ in after.len()..before.len() {
        let replacement = lab.start_controller_replica().await?;
        outcome.note(format!("replacement replica {replacement} started"));
    }
    tokio::time::sleep(SETTLE).await;
    Ok(outcome.finish(Traffic::stop_all(traffic).await?, started))
}

/// Which controller replicas say they lead (their leader gauge), every half second, until
/// `settled` fires and at most one leads, or `deadline` passes. A replica whose metrics do
/// not answer (it exited) counts as not leading.
async fn sample_leaders(
    replicas: Vec<(String, SocketAddr)>,
    settled: CancellationToken,
    deadline: Instant,
) -> Vec<(Duration, Vec<String>)> {
    let start = Instant::now();
    let mut samples = Vec::new();
    loop {
        let mut leading = Vec::new();
        for (identity, metrics) in &replicas {
            if controller_leads(*metrics).await.unwrap_or(false) {
                leading.push(identity.clone());
            }
        }
        let done = (settled.is_cancelled() && leading.len() <= 1) || Instant::now() > deadline;
        samples.push((start.elapsed(), leading));
        if done {
            return samples;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Node 1's proxy killed and its rules flushed by someone else while it is down; once
/// started again it must restore them within a second. Failures while it is down are
/// counted.
async fn kill_and_flush_a_node_proxy(lab: &mut Lab, services: &[ServedService]) -> Result<Outcome> {
    let started = Instant::now();
    let mut outcome = Outcome::new(KILLED_AND_FLUSHED, false);
    let ports = ports(lab, services)?;
    let node = lab.topology.nodes()[0].netns.clone();
    let mode = lab.node_proxy_mode(0)?;
    let traffic = lab
        .start_traffic_through(services, "killed-and-flushed")
        .await?;
    lab.stop_node_proxy(0, Signal::SIGKILL).await?;
    let flush: &[&str] = match mode {
        ProxyMode::Iptables => &["iptables", "-w", "-t", "nat", "-F"],
        ProxyMode::Nftables => &["nft", "delete", "table", "ip", "tandem"],
    };
    let out = node.exec_async(flush.iter().copied()).await?;
    ensure!(
        out.status.success(),
        "{}: {}",
        flush.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        !all_programmed(mode, &node_rules(&node, mode, IpFamily::V4).await?, &ports),
        "the node still serves the Services after `{}`",
        flush.join(" ")
    );
    // The node goes without rules (and without a node proxy) for a while.
    tokio::time::sleep(SETTLE).await;
    let spawned = lab.start_node_proxy(0, mode)?;
    let restored = loop {
        if all_programmed(mode, &node_rules(&node, mode, IpFamily::V4).await?, &ports) {
            break Some(spawned.elapsed());
        }
        if spawned.elapsed() > Duration::from_secs(20) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    outcome.note(format!(
        "`{}`; the rules back {} after the node proxy was started",
        flush.join(" "),
        restored.map_or("not within 20 s".to_owned(), |d| format!(
            "{:.0} ms",
            d.as_secs_f64() * 1000.0
        ))
    ));
    outcome.check(
        restored.is_some_and(|d| d <= RULES_RESTORED_WITHIN),
        format!("the rules back within {RULES_RESTORED_WITHIN:?} of the start: {restored:?}"),
    );
    lab.wait_node_proxy_healthy(0).await?;
    tokio::time::sleep(SETTLE).await;
    Ok(outcome.finish(Traffic::stop_all(traffic).await?, started))
}

/// One thing deleted from a node's rules: how to find whether it is back.
struct Deleted {
    port: ServicePort,
    endpoint: SocketAddrV4,
}

impl Deleted {
    fn present(&self, mode: ProxyMode, listing: &str) -> bool {
        match mode {
            ProxyMode::Iptables => {
                rules::endpoint_dnat_rule(listing, &self.port, self.endpoint).is_some()
            }
            ProxyMode::Nftables => {
                rules::endpoint_map_element(listing, &self.port, self.endpoint).is_some()
            }
        }
    }
}

/// Under a running node proxy, one endpoint's DNAT rule (iptables: `iptables -t nat -D`)
/// or map element (nftables: `nft delete element`) of each Service deleted: it must be
/// back within one `--sync-period`. Failures until then are counted.
async fn repair_deleted_rules(lab: &mut Lab, services: &[ServedService]) -> Result<Outcome> {
    let started = Instant::now();
    let mut outcome = Outcome::new(DRIFT, false);
    let node = lab.topology.nodes()[0].netns.clone();
    let mode = lab.node_proxy_mode(0)?;
    let traffic = lab.start_traffic_through(services, "drift").await?;
    let listing = node_rules(&node, mode, IpFamily::V4).await?;
    let mut deleted = Vec::new();
    for (port, endpoints) in ports(lab, services)? {
        let (endpoint, command) = match mode {
            ProxyMode::Iptables => {
                // The endpoint connections fall back to: without its DNAT they fail (the
                // others' missing DNAT rules would send them on to the next endpoint).
                let endpoint = rules::last_endpoint(&listing, &port)
                    .with_context(|| format!("no KUBE-SVC chain of {port:?}"))?;
                let rule = rules::endpoint_dnat_rule(&listing, &port, endpoint)
                    .with_context(|| format!("no DNAT rule of {port:?} to {endpoint}"))?;
                // The rule as `-S` prints it, quoted for a shell.
                let command = vec![
                    "sh".to_owned(),
                    "-c".to_owned(),
                    format!("iptables -w -t nat {}", rule.replacen("-A ", "-D ", 1)),
                ];
                (endpoint, command)
            }
            ProxyMode::Nftables => {
                let endpoint = *endpoints.first().context("a Service without endpoints")?;
                let element = rules::endpoint_map_element(&listing, &port, endpoint)
                    .with_context(|| format!("no map element of {port:?} for {endpoint}"))?;
                (endpoint, element.delete_command())
            }
        };
        let out = node.exec_async(&command).await?;
        ensure!(
            out.status.success(),
            "{}: {}",
            command.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        outcome.note(format!("deleted: {}", command.join(" ")));
        deleted.push(Deleted { port, endpoint });
    }
    let deleted_at = Instant::now();
    // Not checked that they are gone now (each deletion succeeded): on the nf_tables
    // backends the kernel announces the change and the node proxy may have written them
    // back already.
    let limit = SYNC_PERIOD * 2 + REPAIR_SLACK;
    let repaired = loop {
        let listing = node_rules(&node, mode, IpFamily::V4).await?;
        if deleted.iter().all(|d| d.present(mode, &listing)) {
            break Some(deleted_at.elapsed());
        }
        if deleted_at.elapsed() > limit {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    outcome.note(format!(
        "repaired {} after the deletion (--sync-period {SYNC_PERIOD:?})",
        repaired.map_or(format!("not within {limit:?}"), |d| format!(
            "{:.1}s",
            d.as_secs_f64()
        ))
    ));
    outcome.check(
        repaired.is_some_and(|d| d <= SYNC_PERIOD + REPAIR_SLACK),
        format!("back within one --sync-period ({SYNC_PERIOD:?}): {repaired:?}"),
    );
    tokio::time::sleep(SETTLE).await;
    Ok(outcome.finish(Traffic::stop_all(traffic).await?, started))
}
