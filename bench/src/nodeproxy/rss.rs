//! Peak RSS of the real `tandem-nodeproxy` binary: in a fresh namespace, against an
//! in-process API server stand-in bound on the namespace's loopback and loaded with the
//! cluster, through its first sync (its `/healthz` answers 200) and the periodic sync
//! after it, which compares the rules with a full rebuild; then VmHWM.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};
use tandem_apiserver::resources::{ENDPOINT_SLICES, NAMESPACES, NODES, SERVICES};
use tandem_apiserver::store::{Store, Subresource};
use tandem_apiserver::{RunningServer, ServerConfig, spawn};
use tandem_common::ProxyMode;
use tandem_netlab::RunPrefix;
use tandem_nodeproxy::datapath::iptables::backend::Backend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::cluster::{self, Cluster};
use super::kernel::FreshNetns;

pub(super) const HEALTHZ: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 10256);
pub(super) const METRICS: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 10249);
const POLL: Duration = Duration::from_millis(50);
/// Short, so the periodic sync and its full-rebuild check come soon after the first sync.
pub(super) const SYNC_PERIOD: &str = "2s";
/// How many periodic syncs ended, as `/metrics` names it.
pub(super) const PERIODIC_SYNCS: &str =
    "tandem_nodeproxy_sync_full_proxy_rules_duration_seconds_count";

/// What one run of the binary showed.
#[derive(Debug, Clone, Copy)]
pub struct RssRun {
    pub peak_mib: f64,
    /// From spawning the process to its `/healthz` answering 200 (list + first sync).
    pub to_first_sync: Duration,
    /// From the first sync to the end of the periodic sync after it.
    pub to_periodic_sync: Duration,
}

/// The data path the binary is started with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPathFlags {
    Iptables(Backend),
    Nftables,
}

impl DataPathFlags {
    pub(super) fn args(self) -> Vec<&'static str> {
        match self {
            DataPathFlags::Iptables(backend) => {
                let backend = match backend {
                    Backend::Nft => "nft",
                    Backend::Legacy => "legacy",
                };
                let mode = ProxyMode::Iptables.as_str();
                vec!["--proxy-mode", mode, "--iptables-backend", backend]
            }
            DataPathFlags::Nftables => vec!["--proxy-mode", ProxyMode::Nftables.as_str()],
        }
    }
}

/// Run `binary` against `cluster` (an empty cluster for `None`) in a fresh namespace.
pub fn measure(
    prefix: &RunPrefix,
    data_path: DataPathFlags,
    binary: &Path,
    cluster: Option<Cluster>,
    timeout: Duration,
) -> anyhow::Result<RssRun> {
    let binary = binary.to_path_buf();
    in_fresh_netns(prefix, move |dir| {
        run_against_stand_in(data_path, binary, cluster, dir, timeout)
    })
}

/// Runs `body` in a fresh namespace with its loopback up, handing it a work directory
/// that is removed afterwards.
pub(super) fn in_fresh_netns<T, F, Fut>(prefix: &RunPrefix, body: F) -> anyhow::Result<T>
where
    T: Send + 'static,
    F: FnOnce(PathBuf) -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let netns = FreshNetns::create(prefix)?;
    netns.exec_checked(&["ip", "link", "set", "lo", "up"])?;
    let workdir = std::env::temp_dir().join(netns.name());
    std::fs::create_dir_all(&workdir).with_context(|| format!("creating {}", workdir.display()))?;
    let dir = workdir.clone();
    let result = netns.run(move || body(dir));
    if let Err(error) = std::fs::remove_dir_all(&workdir) {
        tracing::warn!(dir = %workdir.display(), %error, "cannot remove the work directory");
    }
    result
}

/// The API server stand-in loaded with a cluster, its kubeconfig, and the log file of the
/// proxy under test in the work directory.
pub(super) struct StandIn {
    pub server: RunningServer,
    pub kubeconfig: PathBuf,
    log_path: PathBuf,
}

impl StandIn {
    /// The stand-in, and the log file for the proxy's stderr.
    pub async fn start(
        cluster: Option<&Cluster>,
        workdir: &Path,
    ) -> anyhow::Result<(Self, std::fs::File)> {
        let server = spawn(ServerConfig::default())
            .await
            .context("starting the API server stand-in")?;
        load(server.store(), cluster)?;
        let kubeconfig = workdir.join("kubeconfig");
        server.write_kubeconfig(&kubeconfig).await?;
        let log_path = workdir.join("proxy.log");
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let stand_in = Self {
            server,
            kubeconfig,
            log_path,
        };
        Ok((stand_in, log))
    }

    /// Stops the proxy (`child`) and the stand-in, then hands back what was measured; an
    /// error gets the tail of the proxy's log, headed `heading`.
    pub async fn finish<T>(
        self,
        mut child: tokio::process::Child,
        measured: anyhow::Result<T>,
        heading: &str,
    ) -> anyhow::Result<T> {
        child.start_kill()?;
        child.wait().await?;
        self.server.shutdown().await?;
        measured.map_err(|error| {
            let tail = tandem_k3s::node::tail(&self.log_path, 20);
            error.context(format!("{heading}:\n{tail}"))
        })
    }
}

async fn run_against_stand_in(
    data_path: DataPathFlags,
    binary: PathBuf,
    cluster: Option<Cluster>,
    workdir: PathBuf,
    timeout: Duration,
) -> anyhow::Result<RssRun> {
    let (stand_in, log) = StandIn::start(cluster.as_ref(), &workdir).await?;
    let plans = cluster
        .as_ref()
        .map_or(&[cluster::V4][..], |cluster| cluster.plans);
    let started = Instant::now();
    let mut child = tokio::process::Command::new(&binary)
        .arg("--kubeconfig")
        .arg(&stand_in.kubeconfig)
        .args(["--node-name", cluster::NODE_NAME])
        .args(["--cluster-cidr", &cluster::cluster_cidr(plans)])
        .args(data_path.args())
        // The full check (a rebuild beside the rules) is the peak: due every period here.
        .args([
            "--sync-period",
            SYNC_PERIOD,
            "--drift-check-period",
            SYNC_PERIOD,
        ])
        .args(["--healthz-bind-address", &HEALTHZ.to_string()])
        .args(["--metrics-bind-address", &METRICS.to_string()])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let pid = child.id().context("the node proxy exited at once")?;
    let synced = async {
        let first = wait_for(&mut child, started, timeout, "a first sync", async || {
            healthz_status().await == Some(200)
        })
        .await?;
        let periodic = wait_for(
            &mut child,
            started,
            timeout,
            "a periodic sync",
            async || periodic_syncs().await.is_some_and(|syncs| syncs >= 1),
        )
        .await?;
        anyhow::Ok((first, periodic - first))
    }
    .await;
    // Read before stopping it: /proc/PID goes with the process.
    let status = tokio::fs::read_to_string(format!("/proc/{pid}/status")).await;
    let (to_first_sync, to_periodic_sync) = stand_in
        .finish(child, synced, "node proxy log tail")
        .await?;
    let status = status.context("reading the node proxy's /proc status")?;
    let peak_kib = vm_hwm_kib(&status).context("no VmHWM in /proc/PID/status")?;
    Ok(RssRun {
        peak_mib: peak_kib as f64 / 1024.0,
        to_first_sync,
        to_periodic_sync,
    })
}

/// Polls `done` until it says yes; returns the time since `started`. Fails when the child
/// exits or `timeout` (counted from `started`) passes first.
pub(super) async fn wait_for(
    child: &mut tokio::process::Child,
    started: Instant,
    timeout: Duration,
    what: &str,
    mut done: impl AsyncFnMut() -> bool,
) -> anyhow::Result<Duration> {
    loop {
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("the node proxy exited ({status}) before {what}");
        }
        if started.elapsed() > timeout {
            anyhow::bail!("{what} did not come within {timeout:?}");
        }
        if done().await {
            return Ok(started.elapsed());
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Put the namespace, the node, the Services (with their LB status) and the slices in.
fn load(store: &Store, cluster: Option<&Cluster>) -> anyhow::Result<()> {
    store.create(
        NAMESPACES,
        None,
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": cluster::NAMESPACE}}),
    )?;
    let plans = cluster.map_or(&[cluster::V4][..], |cluster| cluster.plans);
    store.create(NODES, None, serde_json::to_value(cluster::node(plans))?)?;
    let Some(cluster) = cluster else {
        return Ok(());
    };
    for service in &cluster.services {
        let body = serde_json::to_value(service)?;
        let created = store.create(SERVICES, Some(cluster::NAMESPACE), body.clone())?;
        if let Some(status) = body.get("status").filter(|s| !s.is_null()) {
            let name = created["metadata"]["name"].as_str().unwrap_or_default();
            let mut with_status = created.clone();
            with_status["status"] = status.clone();
            store.update(
                SERVICES,
                Some(cluster::NAMESPACE),
                name,
                with_status,
                Subresource::Status,
            )?;
        }
    }
    for slice in &cluster.slices {
        let body: Value = serde_json::to_value(slice)?;
        store.create(ENDPOINT_SLICES, Some(cluster::NAMESPACE), body)?;
    }
    Ok(())
}

/// The status code `GET /healthz` answers with, or `None` when nothing answers yet.
pub(super) async fn healthz_status() -> Option<u16> {
    status_code(&get(HEALTHZ, "/healthz").await?)
}

/// How many periodic syncs ended, from `/metrics`.
async fn periodic_syncs() -> Option<u64> {
    sample(&get(METRICS, "/metrics").await?, PERIODIC_SYNCS)
}

/// The whole response to `GET path`, or `None` when nothing answers.
pub(super) async fn get(address: SocketAddr, path: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut response))
        .await
        .ok()?
        .ok()?;
    Some(String::from_utf8_lossy(&response).into_owned())
}

/// The value of the sample `series` (name and labels, as exposed) in a metrics page.
pub(super) fn sample<T: std::str::FromStr>(page: &str, series: &str) -> Option<T> {
    page.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))?
        .trim()
        .parse()
        .ok()
}

/// The code of an HTTP status line (`HTTP/1.1 200 OK`).
fn status_code(response: &str) -> Option<u16> {
    let line = response.lines().next()?;
    let mut parts = line.split_whitespace();
    parts.next().filter(|v| v.starts_with("HTTP/"))?;
    parts.next()?.parse().ok()
}

/// `VmHWM:   123456 kB` → 123456.
pub(crate) fn vm_hwm_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_parse() {
        assert_eq!(
            status_code("HTTP/1.1 200 OK\r\ncontent-type: x\r\n\r\n{}"),
            Some(200)
        );
        assert_eq!(
            status_code("HTTP/1.0 503 Service Unavailable\r\n"),
            Some(503)
        );
        assert_eq!(status_code("garbage 200"), None);
        assert_eq!(status_code(""), None);
    }

    #[test]
    fn samples_are_read_by_series() {
        let page = "tandem_nodeproxy_sync_full_proxy_rules_duration_seconds_sum 0.5\n\
            tandem_nodeproxy_sync_full_proxy_rules_duration_seconds_count 3\n\
            tandem_nodeproxy_sync_full_proxy_rules_duration_seconds_bucket{le=\"0.001\"} 0\n";
        assert_eq!(sample(page, PERIODIC_SYNCS), Some(3));
        assert_eq!(sample::<u64>("", PERIODIC_SYNCS), None);
    }

    #[test]
    fn peak_rss_comes_from_vm_hwm() {
        let status = "Name:\ttandem-nodeproxy\nVmPeak:\t  999999 kB\nVmHWM:\t   81234 kB\nVmRSS:\t   70000 kB\n";
        assert_eq!(vm_hwm_kib(status), Some(81_234));
        assert_eq!(vm_hwm_kib("VmRSS:\t 1 kB\n"), None);
    }

    #[test]
    fn the_stand_in_accepts_the_generated_cluster_with_its_allocations() {
        let scale = cluster::Scale {
            kind: cluster::ServiceKind::LoadBalancer,
            services: 20,
            endpoints: 3,
            dual_stack: false,
        };
        let generated = cluster::generate(scale).unwrap();
        let store = Store::new(&tandem_apiserver::StoreConfig::default());
        load(&store, Some(&generated)).unwrap();
        let services = store
            .list(
                SERVICES,
                Some(cluster::NAMESPACE),
                &Default::default(),
                None,
                None,
            )
            .unwrap()
            .items;
        let typed: Vec<k8s_openapi::api::core::v1::Service> = services
            .into_iter()
            .map(|s| serde_json::from_value(s).unwrap())
            .collect();
        let slices: Vec<k8s_openapi::api::discovery::v1::EndpointSlice> = store
            .list(
                ENDPOINT_SLICES,
                Some(cluster::NAMESPACE),
                &Default::default(),
                None,
                None,
            )
            .unwrap()
            .items
            .into_iter()
            .map(|s| serde_json::from_value(s).unwrap())
            .collect();
        // What the binary will see converts to exactly what the in-process sync builds from.
        let served = tandem_nodeproxy::observe::convert::proxy_state(
            &typed,
            &slices,
            tandem_common::IpFamily::V4,
        );
        let direct = tandem_nodeproxy::observe::convert::proxy_state(
            &generated.services,
            &generated.slices,
            tandem_common::IpFamily::V4,
        );
        assert!(served.skipped.is_empty(), "{:?}", served.skipped);
        assert_eq!(served.state, direct.state);
    }
}
