//! kube-proxy (the binary `TANDEM_KUBE_PROXY` names; CI's is v1.21.2) given the cluster
//! the node proxy's rows are measured at, on the same iptables backend: its first sync and
//! one endpoint added, beside ours.
//!
//! Each run is a fresh namespace with the API server stand-in loaded with the cluster, as
//! for the node proxy's peak RSS. kube-proxy runs `iptables`, `iptables-save` and
//! `iptables-restore` from `PATH`: a directory of links to the backend's own binaries comes
//! first in it, as the distribution's alternatives would point them. Its durations are its
//! own metrics (`kubeproxy_sync_proxy_rules_duration_seconds`: the whole `syncProxyRules`,
//! the restore included, the listing from the API server not); the endpoint added is also
//! timed from the API write to the end of the sync that applied it.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use tandem_apiserver::resources::ENDPOINT_SLICES;
use tandem_apiserver::store::Subresource;
use tandem_common::IpFamily;
use tandem_netlab::RunPrefix;
use tandem_nodeproxy::datapath::iptables::backend::{Backend, Tools};

use super::cluster::{self, Cluster};
use super::rss::{self, HEALTHZ, METRICS};

/// Where the metrics series of its syncs start.
const SYNC_SERIES: &str = "kubeproxy_sync_proxy_rules_duration_seconds";
/// Its periodic resync, pushed out of the way of the one change measured.
const SYNC_PERIOD: &str = "1h";
/// After its first sync, before the change: past its --iptables-min-sync-period (1 s).
const QUIET: Duration = Duration::from_secs(2);

/// What one run of kube-proxy showed.
#[derive(Debug, Clone, Copy)]
pub struct KubeProxyRun {
    /// Its own first sync.
    pub first_sync: Duration,
    /// One endpoint added: the slice written to the API server → the sync ended.
    pub endpoint_added: Duration,
    /// That sync's own duration.
    pub endpoint_sync: Duration,
}

/// kube-proxy in iptables mode against the stand-in at `kubeconfig`, for `cluster`, with
/// the flags that leave the machine alone (no conntrack sysctl written).
pub fn command(binary: &Path, kubeconfig: &Path, cluster: &Cluster) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(binary);
    command
        .args(tandem_k3s::kube_proxy_args(
            kubeconfig,
            cluster::NODE_NAME,
            &cluster::cluster_cidr(cluster.plans),
        ))
        // The stand-in speaks JSON.
        .args(["--kube-api-content-type", "application/json"])
        .args(["--healthz-bind-address", &HEALTHZ.to_string()])
        .args(["--metrics-bind-address", &METRICS.to_string()]);
    command
}

/// Its syncs so far and their total duration, from its metrics (zero before it serves).
pub async fn syncs() -> (u64, Duration) {
    let page = rss::get(METRICS, "/metrics").await.unwrap_or_default();
    let count = rss::sample(&page, &format!("{SYNC_SERIES}_count")).unwrap_or(0);
    let sum: f64 = rss::sample(&page, &format!("{SYNC_SERIES}_sum")).unwrap_or(0.0);
    (count, Duration::from_secs_f64(sum.max(0.0)))
}

/// One run of `binary` on `backend` against `cluster`.
pub fn measure(
    prefix: &RunPrefix,
    binary: &Path,
    backend: Backend,
    cluster: Cluster,
    timeout: Duration,
) -> anyhow::Result<KubeProxyRun> {
    let binary = binary.to_path_buf();
    rss::in_fresh_netns(prefix, move |dir| async move {
        run(&binary, backend, cluster, &dir, timeout).await
    })
}

async fn run(
    binary: &Path,
    backend: Backend,
    mut cluster: Cluster,
    workdir: &Path,
    timeout: Duration,
) -> anyhow::Result<KubeProxyRun> {
    let (stand_in, log) = rss::StandIn::start(Some(&cluster), workdir).await?;
    let tools = backend_tools(backend, &workdir.join("bin"))?;
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut child = command(binary, &stand_in.kubeconfig, &cluster)
        .args(["--iptables-sync-period", SYNC_PERIOD])
        .env(
            "PATH",
            std::env::join_paths(std::iter::once(tools).chain(std::env::split_paths(&path)))?,
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .kill_on_drop(true)
        .spawn()
        .context("starting kube-proxy")?;
    let measured = async {
        rss::wait_for(
            &mut child,
            Instant::now(),
            timeout,
            "a first sync",
            async || syncs().await.0 > 0,
        )
        .await?;
        let (_, first_sync) = syncs().await;
        tokio::time::sleep(QUIET).await;
        let (count_before, sum_before) = syncs().await;
        let index = cluster.changed_service(0);
        cluster.add_endpoint(index, 0);
        let slice = cluster.slices.get(index).context("no slice to change")?;
        let name = slice.metadata.name.clone().unwrap_or_default();
        let written = Instant::now();
        stand_in.server.store().update(
            ENDPOINT_SLICES,
            Some(cluster::NAMESPACE),
            &name,
            serde_json::to_value(slice)?,
            Subresource::Main,
        )?;
        let endpoint_added = rss::wait_for(
            &mut child,
            written,
            timeout,
            "the endpoint's sync",
            async || syncs().await.0 > count_before,
        )
        .await?;
        let (count_after, sum_after) = syncs().await;
        anyhow::ensure!(
            count_after == count_before + 1,
            "{} syncs for one endpoint added",
            count_after - count_before
        );
        anyhow::Ok(KubeProxyRun {
            first_sync,
            endpoint_added,
            endpoint_sync: sum_after.saturating_sub(sum_before),
        })
    }
    .await;
    stand_in
        .finish(child, measured, "kube-proxy's log tail")
        .await
}

/// A directory of links named as kube-proxy calls them (`iptables`, `ip6tables` and their
/// `-save` and `-restore`) to `backend`'s own binaries.
fn backend_tools(backend: Backend, dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for family in [IpFamily::V4, IpFamily::V6] {
        let tools = Tools::new(backend, family);
        let plain = match family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        for (name, target) in [
            (plain.to_owned(), tools.iptables()),
            (format!("{plain}-save"), tools.save()),
            (format!("{plain}-restore"), tools.restore()),
        ] {
            let target = which(target).with_context(|| format!("{target} is not installed"))?;
            std::os::unix::fs::symlink(&target, dir.join(&name))
                .with_context(|| format!("linking {name} to {}", target.display()))?;
        }
    }
    Ok(dir.to_path_buf())
}

/// `program` found in `PATH` or the sbin directories.
fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// How `binary` names itself (`kube-proxy --version`: `Kubernetes v1.21.2`), as
/// `kube-proxy v1.21.2`.
pub fn version(binary: &Path) -> anyhow::Result<String> {
    let output = std::process::Command::new(binary)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", binary.display()))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let version = text
        .split_whitespace()
        .find(|word| word.starts_with('v'))
        .with_context(|| format!("{} --version printed {text:?}", binary.display()))?;
    Ok(format!("kube-proxy {version}"))
}
