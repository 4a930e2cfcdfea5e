//! A node where nothing changes: the CPU the real `tandem-nodeproxy` spends per hour with
//! its rules in place, in each data path, against kube-proxy v1.21.2 (the binary
//! `TANDEM_KUBE_PROXY` names) given the same cluster on the same machine; and the time from
//! someone else's change to our rules (the jump from the nat prerouting hook deleted) to
//! its repair.
//!
//! Each run is a fresh namespace, an in-process API server stand-in loaded with the
//! cluster, and the proxy started against it. After its first sync and a settling pause,
//! its CPU time (its own and its waited-for children's, such as `iptables-restore`) is read
//! from `/proc` across a window. Where the full check is hourly (the nf_tables backends),
//! the window holds none, so a second run with the full check due every few seconds
//! measures one check's CPU, which is added once per hour (on a node where nothing is
//! committed and nothing changes, the check after the first finds that and is skipped);
//! on iptables-legacy and for kube-proxy the window holds their periodic work as it is.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tandem_common::IpFamily;
use tandem_netlab::RunPrefix;
use tandem_nodeproxy::datapath::iptables::backend::{Backend, Tools};

use super::cluster::{self, Cluster, Scale};
use super::kube_proxy;
use super::rss::{self, DataPathFlags, HEALTHZ, METRICS};
use crate::cpu::cpu_seconds;

/// What is measured, and how long each part may take.
#[derive(Debug, Clone, Copy)]
pub struct IdlePlan {
    pub window: Duration,
    /// After the first sync, before the window: the start-up's read-backs end.
    pub settle: Duration,
    /// The full check's period in the run that measures one.
    pub full_check_period: Duration,
    /// For the first sync (kube-proxy v1.21 takes minutes at 10,000 Services).
    pub timeout: Duration,
}

/// One proxy at one scale.
#[derive(Debug, Clone)]
pub struct IdleResult {
    /// CPU seconds per hour on the idle node.
    pub cpu_per_hour: f64,
    /// How that was made up, for the notes.
    pub how: String,
    /// Someone else's change → the sync that wrote the repair ended.
    pub repair: Option<Duration>,
}

/// The proxy measured.
#[derive(Debug, Clone)]
pub enum Proxy {
    Tandem {
        binary: PathBuf,
        data_path: DataPathFlags,
    },
    KubeProxy(PathBuf),
}

impl Proxy {
    /// True where the kernel announces ruleset changes, so the full check is hourly.
    fn announced(&self) -> bool {
        matches!(
            self,
            Proxy::Tandem {
                data_path: DataPathFlags::Nftables | DataPathFlags::Iptables(Backend::Nft),
                ..
            }
        )
    }
}

/// What one run of a proxy showed.
struct Window {
    /// CPU seconds spent from the start to the end of the first sync.
    to_first_sync: f64,
    /// CPU seconds spent across the window.
    cpu: f64,
    window: Duration,
    /// Full checks (Tandem) or syncs (kube-proxy) that ended in the window.
    full_checks: u64,
    /// Full checks that were due in the window and skipped: nothing was committed to
    /// any table and no change taken since the one before (Tandem, nf_tables backends).
    skipped_checks: u64,
    repair: Option<Duration>,
}

/// `proxy` against `scale`: CPU per hour on the idle node and, for Tandem, the repair time.
pub fn measure(
    prefix: &RunPrefix,
    proxy: &Proxy,
    scale: Scale,
    plan: IdlePlan,
) -> anyhow::Result<IdleResult> {
    let cluster = cluster::generate(scale)?;
    let tandem = matches!(proxy, Proxy::Tandem { .. });
    let steady = run(prefix, proxy, &cluster, &[], plan, tandem)?;
    let rate = steady.cpu / steady.window.as_secs_f64();
    if let Proxy::KubeProxy(_) = proxy {
        // Its sync runner resyncs everything at least hourly, and its canary check every
        // --sync-period asks for a resync only when the canary is gone: one full sync an
        // hour, whose CPU its first one stands for.
        return Ok(IdleResult {
            cpu_per_hour: rate * 3600.0 + steady.to_first_sync,
            how: format!(
                "{:.2} s of CPU in {:.0?} ({} syncs among them), and {:.2} s for the hourly \
                 resync of everything (the CPU of its first sync)",
                steady.cpu, steady.window, steady.full_checks, steady.to_first_sync
            ),
            repair: None,
        });
    }
    if !proxy.announced() {
        return Ok(IdleResult {
            cpu_per_hour: rate * 3600.0,
            how: format!(
                "{:.2} s of CPU in {:.0?}, {} periodic full checks among them",
                steady.cpu, steady.window, steady.full_checks
            ),
            repair: steady.repair,
        });
    }
    let period = tandem_common::GoDuration(plan.full_check_period).to_string();
    let checking = run(
        prefix,
        proxy,
        &cluster,
        &["--sync-period", &period, "--drift-check-period", &period],
        plan,
        false,
    )?;
    let due = checking.full_checks + checking.skipped_checks;
    if due == 0 {
        bail!("no full check was due in {:?}", checking.window);
    }
    let per_check = (checking.cpu - rate * checking.window.as_secs_f64()).max(0.0) / due as f64;
    Ok(IdleResult {
        cpu_per_hour: rate * 3600.0 + per_check,
        how: format!(
            "{:.2} s of CPU in {:.0?} without a full check, and {per_check:.2} s per full check \
             (hourly; measured over {due} due with one every {period}: {} ran, {} skipped as \
             nothing was committed to any table and no change taken since the one before)",
            steady.cpu, steady.window, checking.full_checks, checking.skipped_checks
        ),
        repair: steady.repair,
    })
}

/// One run in a fresh namespace: start, first sync, settle, the window, then (with
/// `repair`) someone else's change.
fn run(
    prefix: &RunPrefix,
    proxy: &Proxy,
    cluster: &Cluster,
    extra: &[&str],
    plan: IdlePlan,
    repair: bool,
) -> anyhow::Result<Window> {
    let (proxy, cluster) = (proxy.clone(), cluster.clone());
    let extra: Vec<String> = extra.iter().map(|arg| (*arg).to_owned()).collect();
    rss::in_fresh_netns(prefix, move |dir| async move {
        run_against_stand_in(&proxy, &cluster, &extra, &dir, plan, repair).await
    })
}

async fn run_against_stand_in(
    proxy: &Proxy,
    cluster: &Cluster,
    extra: &[String],
    workdir: &Path,
    plan: IdlePlan,
    repair: bool,
) -> anyhow::Result<Window> {
    let (stand_in, log) = rss::StandIn::start(Some(cluster), workdir).await?;
    let mut command = match proxy {
        Proxy::Tandem { binary, data_path } => {
            let mut command = tokio::process::Command::new(binary);
            command
                .arg("--kubeconfig")
                .arg(&stand_in.kubeconfig)
                .args(["--node-name", cluster::NODE_NAME])
                .args(["--cluster-cidr", &cluster::cluster_cidr(cluster.plans)])
                .args(data_path.args())
                .args(["--healthz-bind-address", &HEALTHZ.to_string()])
                .args(["--metrics-bind-address", &METRICS.to_string()])
                .args(extra)
                .env("RUST_LOG", "info");
            command
        }
        Proxy::KubeProxy(binary) => kube_proxy::command(binary, &stand_in.kubeconfig, cluster),
    };
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .kill_on_drop(true)
        .spawn()
        .context("starting the proxy")?;
    let pid = child.id().context("the proxy exited at once")?;
    let started = Instant::now();
    let measured = async {
        rss::wait_for(
            &mut child,
            started,
            plan.timeout,
            "a first sync",
            async || synced(proxy).await,
        )
        .await?;
        let to_first_sync = cpu_seconds(pid)?;
        tokio::time::sleep(plan.settle).await;
        let (cpu_before, (checks_before, skipped_before)) =
            (cpu_seconds(pid)?, full_checks(proxy).await);
        let window_start = Instant::now();
        tokio::time::sleep(plan.window).await;
        let (cpu_after, (checks_after, skipped_after)) =
            (cpu_seconds(pid)?, full_checks(proxy).await);
        let window = window_start.elapsed();
        let repair = match (repair, proxy) {
            (true, Proxy::Tandem { data_path, .. }) => {
                Some(repair_time(&mut child, *data_path, plan.timeout).await?)
            }
            _ => None,
        };
        anyhow::Ok(Window {
            to_first_sync,
            cpu: cpu_after - cpu_before,
            window,
            full_checks: checks_after.saturating_sub(checks_before),
            skipped_checks: skipped_after.saturating_sub(skipped_before),
            repair,
        })
    }
    .await;
    stand_in.finish(child, measured, "proxy log tail").await
}

/// True once the proxy's first sync ended: Tandem's `/healthz` answers 200 only then;
/// kube-proxy v1.21's answers 200 before, so its sync counter tells.
async fn synced(proxy: &Proxy) -> bool {
    match proxy {
        Proxy::Tandem { .. } => rss::healthz_status().await == Some(200),
        Proxy::KubeProxy(_) => kube_proxy::syncs().await.0 > 0,
    }
}

/// Tandem's full checks run and skipped, or kube-proxy's syncs (each a full one in
/// v1.21), so far.
async fn full_checks(proxy: &Proxy) -> (u64, u64) {
    match proxy {
        Proxy::Tandem { .. } => {
            let page = rss::get(METRICS, "/metrics").await.unwrap_or_default();
            (
                rss::sample(&page, rss::PERIODIC_SYNCS).unwrap_or(0),
                rss::sample(&page, SKIPPED_FULL_CHECKS).unwrap_or(0),
            )
        }
        Proxy::KubeProxy(_) => (kube_proxy::syncs().await.0, 0),
    }
}

/// Full checks the node proxy found nothing to check for.
const SKIPPED_FULL_CHECKS: &str = "tandem_nodeproxy_sync_full_checks_skipped_total";

/// Deletes the jump from the nat prerouting hook into the Service dispatch, as someone
/// else would, and waits for the sync that writes it back: the repair counter goes up,
/// then a sync ends after it.
async fn repair_time(
    child: &mut tokio::process::Child,
    data_path: DataPathFlags,
    timeout: Duration,
) -> anyhow::Result<Duration> {
    let page = rss::get(METRICS, "/metrics").await.unwrap_or_default();
    let (repairs_before, syncs_before) = (repairs(&page), successful_syncs(&page));
    let (program, args): (&str, Vec<String>) = match data_path {
        DataPathFlags::Iptables(backend) => (
            Tools::new(backend, IpFamily::V4).iptables(),
            tandem_nodeproxy::datapath::iptables::base_jump_deletion(
                tandem_proxy_rules::ruleset::Table::Nat,
                "PREROUTING",
            )
            .context("no base jump in nat PREROUTING")?,
        ),
        DataPathFlags::Nftables => (
            "nft",
            ["flush", "chain", "ip", "tandem", "nat-prerouting"]
                .map(str::to_owned)
                .to_vec(),
        ),
    };
    let output = tokio::process::Command::new(program)
        .args(&args)
        .output()
        .await
        .with_context(|| format!("running {program}"))?;
    if !output.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let changed = Instant::now();
    let mut found = false;
    rss::wait_for(child, changed, timeout, "the repair", async || {
        let page = rss::get(METRICS, "/metrics").await.unwrap_or_default();
        found |= repairs(&page) > repairs_before;
        found && successful_syncs(&page) > syncs_before
    })
    .await
}

/// Every object the node proxy repaired so far.
fn repairs(page: &str) -> u64 {
    page.lines()
        .filter(|line| line.starts_with("tandem_nodeproxy_sync_repairs_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

fn successful_syncs(page: &str) -> u64 {
    rss::sample(
        page,
        "tandem_nodeproxy_sync_proxy_rules_total{result=\"Success\"}",
    )
    .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repairs_add_every_object() {
        let page = "tandem_nodeproxy_sync_repairs_total{object=\"Chain\"} 2\n\
                    tandem_nodeproxy_sync_repairs_total{object=\"Jump\"} 1\n\
                    tandem_nodeproxy_sync_readback_failures_total 4\n";
        assert_eq!(repairs(page), 3);
    }
}
