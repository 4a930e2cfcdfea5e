//! A real Kubernetes control plane (`k3s server --disable-agent`: API server,
//! controller-manager, scheduler; no kubelet) in a network namespace of its own.
//!
//! * Namespace `tdm<pid>x<seq>-k3s` (netlab's scheme): a later run's stale cleanup removes
//!   it, and the processes in it, when this process is gone. Only `lo` is up: k3s binds
//!   127.0.0.1 there and needs no route.
//! * k3s runs in a private mount namespace (`ip netns exec` makes one) with an overlay on
//!   `/etc`, because as root it links `/etc/rancher/k3s/k3s.yaml` to the kubeconfig it
//!   writes; the controller-manager's flex-volume directory goes to the data dir. So
//!   nothing is written on the host outside the run directory.
//! * The API server is reached from the caller's namespace through a TCP relay whose
//!   listening socket (127.0.0.1, a free port) is made in the caller's namespace and whose
//!   upstream sockets are made by a thread that entered the k3s namespace: no packet
//!   crosses namespaces, and k3s's own certificate (its SANs hold 127.0.0.1) verifies.
//! * IPv4 only by default; [`ClusterFamilies::Dual`] makes it dual-stack (IPv4 primary):
//!   a cluster CIDR and a Service CIDR per family, and the `IPv6DualStack` gate where the
//!   release needs it.
//! * [`ControlPlane::stop`] (or, as a fallback, drop) ends k3s with SIGTERM, then SIGKILL,
//!   kills whatever is left in the namespace and removes it and the run directory.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ipnet::{IpNet, Ipv6Net};
use kube::config::{KubeConfigOptions, Kubeconfig};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tandem_netlab::{Netns, RunPrefix, owner_pid};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Where k3s's API server listens inside its namespace.
const API_PORT: u16 = 6443;
/// How long k3s gets to exit after SIGTERM (it takes about 2 s).
const STOP_GRACE: Duration = Duration::from_secs(15);
/// Lines of the k3s log quoted in errors.
const LOG_TAIL_LINES: usize = 40;

/// Errors of starting and stopping the control plane.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    #[error("cannot read the k3s version from `{binary} --version` output {output:?}")]
    Version { binary: String, output: String },
    #[error("cannot start `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    CommandFailed {
        command: String,
        status: ExitStatus,
        stderr: String,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("k3s exited ({status}) before it was ready; log {log}:\n{tail}")]
    Exited {
        status: ExitStatus,
        log: String,
        tail: String,
    },
    #[error("k3s was not ready within {within:?} ({last}); log {log}:\n{tail}")]
    NotReady {
        within: Duration,
        last: String,
        log: String,
        tail: String,
    },
    #[error("kubeconfig {path}: {reason}")]
    Kubeconfig { path: String, reason: String },
    #[error(transparent)]
    Netlab(#[from] tandem_netlab::NetlabError),
}

type Result<T, E = ControlPlaneError> = std::result::Result<T, E>;

/// The IPv6 pod network of a dual-stack control plane: the lab's IPv6 plan gives node N the
/// pods `fd00:10:244:N::/64`, and the node-IPAM controller refuses Nodes whose pod CIDRs lie
/// outside the cluster CIDRs.
pub const CLUSTER_CIDR_V6: Ipv6Net =
    Ipv6Net::new_assert(Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0), 56);
/// The IPv6 Service CIDR of a dual-stack control plane (a /112, the widest
/// kube-apiserver v1.21 takes for IPv6).
pub const SERVICE_CIDR_V6: Ipv6Net =
    Ipv6Net::new_assert(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0), 112);

/// The IP families of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ClusterFamilies {
    /// IPv4 only.
    #[default]
    Ipv4,
    /// IPv4 and IPv6, IPv4 first: a Service that names no family gets IPv4.
    Dual,
}

/// How to run the control plane. The defaults fit the lab (tests/netlab/src/addr.rs): its
/// pod CIDR must lie inside the cluster CIDR, or the node-IPAM controller refuses its
/// Nodes.
#[derive(Debug, Clone)]
pub struct ControlPlaneOptions {
    /// `--cluster-cidr`: one CIDR per family, the primary family first.
    pub cluster_cidrs: Vec<IpNet>,
    /// `--service-cidr`: one CIDR per family, in the same order.
    pub service_cidrs: Vec<IpNet>,
    /// The API server's `--feature-gates`; `None` picks what the suites need for the
    /// binary's version (see [`feature_gates_for`]). The dual-stack gate is added to
    /// either where the cluster has two families (see [`dual_stack_gate_for`]).
    pub feature_gates: Option<String>,
    /// How long start-up may take before it is an error.
    pub ready_timeout: Duration,
}

impl ControlPlaneOptions {
    /// The lab's CIDRs for the families, with the other options at their defaults.
    pub fn new(families: ClusterFamilies) -> Self {
        let mut cluster_cidrs = vec![IpNet::V4(tandem_netlab::PodNetwork::DEFAULT.cidr())];
        let mut service_cidrs = vec![IpNet::V4(tandem_netlab::addr::SERVICE_CIDR)];
        if families == ClusterFamilies::Dual {
            cluster_cidrs.push(IpNet::V6(CLUSTER_CIDR_V6));
            service_cidrs.push(IpNet::V6(SERVICE_CIDR_V6));
        }
        Self {
            cluster_cidrs,
            service_cidrs,
            feature_gates: None,
            // About 10 s on an idle machine; much more while the suite builds beside it.
            ready_timeout: Duration::from_secs(120),
        }
    }

    /// Whether the Service CIDRs hold both families.
    pub fn dual_stack(&self) -> bool {
        self.service_cidrs.iter().any(|c| matches!(c, IpNet::V4(_)))
            && self.service_cidrs.iter().any(|c| matches!(c, IpNet::V6(_)))
    }
}

impl Default for ControlPlaneOptions {
    fn default() -> Self {
        Self::new(ClusterFamilies::default())
    }
}

/// `major.minor` of a `k3s --version` first line, e.g. `k3s version v1.21.2+k3s1 (5a67e8dc)`.
pub fn parse_version(output: &str) -> Option<(u32, u32)> {
    let version = output
        .split_whitespace()
        .filter_map(|word| word.strip_prefix('v'))
        .find(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))?;
    let mut parts = version.split(['.', '+', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// The API server feature gates the suites need on Kubernetes `1.minor`: what is alpha
/// there and off by default. A gate is never named where it is gone (a removed gate stops
/// the API server).
pub fn feature_gates_for(minor: u32) -> Vec<&'static str> {
    let mut gates = Vec::new();
    // Beta, on by default, from 1.22.
    if minor <= 21 {
        gates.extend([
            "ServiceLoadBalancerClass=true",
            "ServiceLBNodePortControl=true",
        ]);
    }
    // Beta, on by default, from 1.24.
    if minor <= 23 {
        gates.push("MixedProtocolLBService=true");
    }
    gates
}

/// The gate a dual-stack cluster needs in the API server and the controller-manager on
/// Kubernetes `1.minor`: `IPv6DualStack` until it is GA in 1.23 (beta and on by default in
/// 1.21 and 1.22, where k3s's and upstream's dual-stack instructions still name it). Never
/// named from 1.23 on: locked there, and gone from 1.25 (a removed gate stops the server).
pub fn dual_stack_gate_for(minor: u32) -> Option<&'static str> {
    (minor <= 22).then_some("IPv6DualStack=true")
}

/// `major.minor` of the k3s binary.
pub fn k3s_version(k3s: &Path) -> Result<(u32, u32)> {
    let mut cmd = Command::new(k3s);
    cmd.arg("--version");
    let output = run_checked(cmd)?;
    parse_version(&output).ok_or_else(|| ControlPlaneError::Version {
        binary: k3s.display().to_string(),
        output,
    })
}

/// The `k3s server` arguments for a run directory and the binary's Kubernetes `1.minor`.
fn server_args(dir: &Path, options: &ControlPlaneOptions, minor: u32) -> Vec<String> {
    let data = dir.join("data");
    let mut args: Vec<String> = [
        "server",
        "--disable-agent",
        "--disable=traefik,servicelb,metrics-server,local-storage,coredns",
        "--disable-cloud-controller",
        "--disable-network-policy",
        // No agent, so no flannel; k3s v1.21 also refuses dual-stack CIDRs unless it is off.
        "--flannel-backend=none",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        "--node-ip=127.0.0.1",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    args.extend([
        format!("--https-listen-port={API_PORT}"),
        format!("--data-dir={}", data.display()),
        format!("--write-kubeconfig={}", k3s_kubeconfig(dir).display()),
        format!("--cluster-cidr={}", cidr_list(&options.cluster_cidrs)),
        format!("--service-cidr={}", cidr_list(&options.service_cidrs)),
        // Its default is under /usr/libexec, which it would create on the host.
        format!(
            "--kube-controller-manager-arg=flex-volume-plugin-dir={}",
            data.join("flexvolume").display()
        ),
    ]);
    let dual_stack_gate = options
        .dual_stack()
        .then(|| dual_stack_gate_for(minor))
        .flatten();
    let suite_gates = options
        .feature_gates
        .clone()
        .unwrap_or_else(|| feature_gates_for(minor).join(","));
    let api_gates: Vec<&str> = [suite_gates.as_str()]
        .into_iter()
        .chain(dual_stack_gate)
        .filter(|gates| !gates.is_empty())
        .collect();
    if !api_gates.is_empty() {
        args.push(format!(
            "--kube-apiserver-arg=feature-gates={}",
            api_gates.join(",")
        ));
    }
    if let Some(gate) = dual_stack_gate {
        args.push(format!(
            "--kube-controller-manager-arg=feature-gates={gate}"
        ));
    }
    args
}

/// CIDRs as a flag value: comma-separated, in order.
pub fn cidr_list(cidrs: &[IpNet]) -> String {
    cidrs
        .iter()
        .map(IpNet::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The kubeconfig k3s writes: it names 127.0.0.1:6443 inside the k3s namespace.
fn k3s_kubeconfig(dir: &Path) -> PathBuf {
    dir.join("k3s-kubeconfig.yaml")
}

/// A running k3s control plane.
#[derive(Debug)]
pub struct ControlPlane {
    netns: OwnedNetns,
    dir: PathBuf,
    kubeconfig: PathBuf,
    log: PathBuf,
    api: SocketAddr,
    version: (u32, u32),
    k3s: Option<Child>,
    relay: Option<RelayThread>,
    /// Set once torn down, so drop after [`ControlPlane::stop`] does nothing.
    stopped: bool,
}

impl ControlPlane {
    /// Starts k3s from `k3s` and returns once its API server is ready (`/readyz`) through
    /// the relay. The relay listens in the namespace of the runtime's threads (normally the
    /// root one), where the clients are. Needs a Tokio runtime.
    pub async fn start(k3s: &Path, options: &ControlPlaneOptions) -> Result<Self> {
        let started = Instant::now();
        let (k3s, launch_options) = (k3s.to_path_buf(), options.clone());
        // Commands and the wait for k3s's version: off the runtime's worker threads.
        let mut plane = tokio::task::spawn_blocking(move || Self::launch(&k3s, &launch_options))
            .await
            .map_err(|e| ControlPlaneError::Io {
                context: "starting k3s".into(),
                source: std::io::Error::other(e),
            })??;
        if let Err(e) = plane.wait_ready(options.ready_timeout).await {
            // Stopping waits for k3s to exit.
            let _ = tokio::task::spawn_blocking(move || plane.stop()).await;
            return Err(e);
        }
        tracing::info!(
            netns = %plane.netns.netns().name(),
            api = %plane.api,
            version = ?plane.version,
            elapsed = ?started.elapsed(),
            "k3s control plane ready"
        );
        Ok(plane)
    }

    /// The namespace, k3s and the relay, not yet waited for.
    fn launch(k3s: &Path, options: &ControlPlaneOptions) -> Result<Self> {
        remove_stale();
        let version = k3s_version(k3s)?;
        let netns = OwnedNetns::create("k3s")?;
        let dir = std::env::temp_dir().join(netns.netns().name());
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        // From here on drop cleans up whatever part exists.
        let mut plane = Self {
            netns,
            kubeconfig: dir.join("kubeconfig.yaml"),
            log: dir.join("k3s.log"),
            dir,
            api: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            version,
            k3s: None,
            relay: None,
            stopped: false,
        };
        plane.spawn_k3s(k3s, options)?;
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .map_err(io("binding the API relay on 127.0.0.1".into()))?;
        plane.api = listener
            .local_addr()
            .map_err(io("reading the API relay's address".into()))?;
        plane.relay = Some(RelayThread::start(
            plane.netns.netns(),
            listener,
            SocketAddr::from((Ipv4Addr::LOCALHOST, API_PORT)),
        )?);
        Ok(plane)
    }

    /// `ip netns exec NS sh -c 'mount overlay on /etc; exec k3s server …'`, in its own
    /// process group, logging to the run directory.
    fn spawn_k3s(&mut self, k3s: &Path, options: &ControlPlaneOptions) -> Result<()> {
        let upper = self.dir.join("etc-upper");
        let work = self.dir.join("etc-work");
        for d in [&upper, &work] {
            std::fs::create_dir_all(d).map_err(io(format!("creating {}", d.display())))?;
        }
        let log = std::fs::File::create(&self.log)
            .map_err(io(format!("creating {}", self.log.display())))?;
        let log_err = log
            .try_clone()
            .map_err(io(format!("opening {}", self.log.display())))?;
        let mut cmd = self.netns.netns().command("sh");
        cmd.arg("-c")
            .arg(
                "mount -t overlay overlay -o \"lowerdir=/etc,upperdir=$1,workdir=$2\" /etc \
                 && shift 2 && exec \"$@\"",
            )
            .arg("sh")
            .arg(&upper)
            .arg(&work)
            .arg(k3s)
            .args(server_args(&self.dir, options, self.version.1))
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err));
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd.spawn().map_err(|source| ControlPlaneError::Spawn {
            command: describe(&cmd),
            source,
        })?;
        tracing::debug!(pid = child.id(), log = %self.log.display(), "k3s started");
        self.k3s = Some(child);
        Ok(())
    }

    /// Waits for k3s's kubeconfig, writes the relayed one, then polls `/readyz`.
    async fn wait_ready(&mut self, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.k3s_exit_status()? {
                return Err(ControlPlaneError::Exited {
                    status,
                    log: self.log.display().to_string(),
                    tail: self.log_tail(LOG_TAIL_LINES),
                });
            }
            let last = match self.check_ready().await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if Instant::now() > deadline {
                return Err(ControlPlaneError::NotReady {
                    within,
                    last,
                    log: self.log.display().to_string(),
                    tail: self.log_tail(LOG_TAIL_LINES),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// One readiness probe; the reason it failed, for the timeout message.
    async fn check_ready(&self) -> Result<(), String> {
        if !self.kubeconfig.exists() {
            let original = k3s_kubeconfig(&self.dir);
            if !original.exists() {
                return Err("no kubeconfig written yet".into());
            }
            write_relayed_kubeconfig(&original, &self.kubeconfig, self.api)
                .map_err(|e| e.to_string())?;
        }
        let client = self.client().await.map_err(|e| e.to_string())?;
        let request = kube::core::Request::new("")
            .get("readyz", &kube::core::params::GetParams::default())
            .map_err(|e| e.to_string())?;
        let body = client
            .request_text(request)
            .await
            .map_err(|e| e.to_string())?;
        if body.trim() == "ok" {
            Ok(())
        } else {
            Err(format!("/readyz answered {body:?}"))
        }
    }

    fn k3s_exit_status(&mut self) -> Result<Option<ExitStatus>> {
        match self.k3s.as_mut() {
            Some(child) => child.try_wait().map_err(io("waiting for k3s".into())),
            None => Ok(None),
        }
    }

    /// A cluster-admin client of the API server, through the relay.
    pub async fn client(&self) -> Result<kube::Client> {
        let bad = |reason: String| ControlPlaneError::Kubeconfig {
            path: self.kubeconfig.display().to_string(),
            reason,
        };
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig).map_err(|e| bad(e.to_string()))?;
        let config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|e| bad(e.to_string()))?;
        kube::Client::try_from(config).map_err(|e| bad(e.to_string()))
    }

    /// A kubeconfig (cluster-admin) for the API server, as reached through the relay.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Where the relay listens (127.0.0.1 in the caller's namespace).
    pub fn api_addr(&self) -> SocketAddr {
        self.api
    }

    /// The Kubernetes `(major, minor)` version of the k3s binary.
    pub fn version(&self) -> (u32, u32) {
        self.version
    }

    /// The network namespace k3s runs in.
    pub fn netns(&self) -> &Netns {
        self.netns.netns()
    }

    /// k3s's log file (removed with the run directory on stop).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of k3s's log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(lines).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// Stops k3s (SIGTERM, then SIGKILL after a grace period) and removes the relay, the
    /// namespace and the run directory. Blocks for up to the grace period: call it from a
    /// blocking context (e.g. `spawn_blocking`) in async code.
    pub fn stop(mut self) {
        self.teardown();
    }

    fn teardown(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        if let Some(relay) = self.relay.take() {
            relay.stop();
        }
        if let Some(child) = self.k3s.take() {
            stop_child(child);
        }
        self.netns.remove();
        if let Err(e) = std::fs::remove_dir_all(&self.dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove the run directory");
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// SIGTERM to k3s's process group, SIGKILL if it outlives the grace period; reaps it.
fn stop_child(mut child: Child) {
    // The child leads its own group (process_group(0)); pids fit in i32 on Linux.
    let group = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    if let Err(e) = killpg(group, Signal::SIGTERM) {
        tracing::debug!(error = %e, "SIGTERM to k3s");
    }
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline {
        match child.try_wait() {
            Ok(Some(status)) => {
                tracing::debug!(%status, "k3s stopped");
                return;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => {
                tracing::warn!(error = %e, "waiting for k3s");
                break;
            }
        }
    }
    tracing::warn!("k3s ignored SIGTERM; killing it");
    if let Err(e) = killpg(group, Signal::SIGKILL) {
        tracing::debug!(error = %e, "SIGKILL to k3s");
    }
    if let Err(e) = child.wait() {
        tracing::warn!(error = %e, "cannot reap k3s");
    }
}

/// A network namespace made by this process, `tdm<pid>x<seq>-<role>` (netlab's scheme, so a
/// later run removes it should this process die first), with `lo` up. Dropping it kills
/// whatever runs inside and deletes it.
#[derive(Debug)]
pub struct OwnedNetns {
    netns: Netns,
    removed: bool,
}

impl OwnedNetns {
    /// `ip netns add tdm<pid>x<seq>-<role>`, then `lo` up.
    pub fn create(role: &str) -> Result<Self> {
        let name = format!("{}-{role}", RunPrefix::next_for_this_process());
        let mut add = Command::new("ip");
        add.args(["netns", "add", &name]);
        run_checked(add)?;
        // From here on drop deletes it.
        let owned = Self {
            netns: Netns::attach(name),
            removed: false,
        };
        owned
            .netns
            .exec_checked(["ip", "link", "set", "lo", "up"])?;
        Ok(owned)
    }

    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// Kills every process left inside (only this run's: the namespace is ours) and deletes
    /// the namespace, with every rule and socket in it. Best effort; done once (also on
    /// drop).
    pub fn remove(&mut self) {
        if std::mem::replace(&mut self.removed, true) {
            return;
        }
        tandem_netlab::remove_netns(self.netns.name());
    }
}

impl Drop for OwnedNetns {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Removes what runs of dead processes left: their namespaces (netlab's cleanup kills the
/// processes inside) and their run directories.
fn remove_stale() {
    if let Err(e) = tandem_netlab::remove_stale_namespaces() {
        tracing::warn!(error = %e, "cannot remove namespaces of dead runs");
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let dead = name.ends_with("-k3s")
            && owner_pid(&name).is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
        if dead {
            tracing::info!(dir = %entry.path().display(), "removing the run directory of a dead run");
            if let Err(e) = std::fs::remove_dir_all(entry.path()) {
                tracing::warn!(dir = %entry.path().display(), error = %e, "cannot remove");
            }
        }
    }
}

/// k3s's kubeconfig with every cluster's server replaced by the relay. Written as JSON (a
/// subset of YAML that kubectl and kube-rs read).
fn write_relayed_kubeconfig(original: &Path, out: &Path, relay: SocketAddr) -> Result<()> {
    let bad = |reason: String| ControlPlaneError::Kubeconfig {
        path: original.display().to_string(),
        reason,
    };
    let mut kubeconfig = Kubeconfig::read_from(original).map_err(|e| bad(e.to_string()))?;
    if kubeconfig.clusters.is_empty() {
        return Err(bad("no clusters".into()));
    }
    for cluster in kubeconfig
        .clusters
        .iter_mut()
        .filter_map(|c| c.cluster.as_mut())
    {
        cluster.server = Some(format!("https://{relay}"));
    }
    // Written whole under another name first: a reader never sees half a file.
    let partial = out.with_extension("partial");
    tandem_netlab::write_kubeconfig(&partial, &kubeconfig).map_err(|e| bad(e.to_string()))?;
    std::fs::rename(&partial, out).map_err(io(format!("writing {}", out.display())))
}

/// The relay: a thread inside the k3s namespace running a current-thread runtime, so every
/// upstream socket is made there, serving a listener made in the caller's namespace.
#[derive(Debug)]
struct RelayThread {
    cancel: CancellationToken,
    thread: Option<JoinHandle<()>>,
}

impl RelayThread {
    fn start(netns: &Netns, listener: std::net::TcpListener, upstream: SocketAddr) -> Result<Self> {
        listener
            .set_nonblocking(true)
            .map_err(io("making the relay listener non-blocking".into()))?;
        let path = format!("/run/netns/{}", netns.name());
        let ns_file = std::fs::File::open(&path).map_err(io(format!("opening {path}")))?;
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("relay-{}", netns.name()))
            .spawn(move || {
                let setup = nix::sched::setns(&ns_file, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(|e| std::io::Error::other(format!("entering the namespace: {e}")))
                    .and_then(|()| {
                        tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                    });
                let runtime = match setup {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        // A closed receiver only means start gave up waiting.
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                runtime.block_on(async move {
                    match TcpListener::from_std(listener) {
                        Ok(listener) => {
                            let _ = ready_tx.send(Ok(()));
                            accept_loop(listener, upstream, stop).await;
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                });
            })
            .map_err(io("starting the relay thread".into()))?;
        let relay = Self {
            cancel,
            thread: Some(thread),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(relay),
            Ok(Err(e)) => Err(ControlPlaneError::Io {
                context: "starting the API relay".into(),
                source: e,
            }),
            Err(_) => Err(ControlPlaneError::Io {
                context: "starting the API relay".into(),
                source: std::io::Error::other("the relay thread ended"),
            }),
        }
    }

    /// Closes the listener and every relayed connection, and joins the thread.
    fn stop(mut self) {
        self.cancel.cancel();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::warn!("the API relay thread panicked");
        }
    }
}

impl Drop for RelayThread {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, cancel: CancellationToken) {
    let tasks = tokio_util::task::TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((inbound, peer)) => {
                let cancel = cancel.clone();
                tasks.spawn(async move {
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        result = relay_connection(inbound, upstream) => {
                            if let Err(e) = result {
                                tracing::debug!(%peer, error = %e, "relayed connection ended");
                            }
                        }
                    }
                });
            }
            // Running out of descriptors must not end the relay: the next accept may work.
            Err(e) => {
                tracing::warn!(error = %e, "relay accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    tasks.close();
    tasks.wait().await;
}

async fn relay_connection(mut inbound: TcpStream, upstream: SocketAddr) -> std::io::Result<()> {
    // Made on this thread, so inside the k3s namespace.
    let mut outbound = TcpStream::connect(upstream).await?;
    // Both legs carry many small API requests and watch events.
    inbound.set_nodelay(true)?;
    outbound.set_nodelay(true)?;
    tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await?;
    Ok(())
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> ControlPlaneError {
    move |source| ControlPlaneError::Io { context, source }
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs a command to completion: its stdout, or an error carrying its stderr.
fn run_checked(mut cmd: Command) -> Result<String> {
    cmd.stdin(Stdio::null());
    let output = cmd.output().map_err(|source| ControlPlaneError::Spawn {
        command: describe(&cmd),
        source,
    })?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(ControlPlaneError::CommandFailed {
            command: describe(&cmd),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_k3s_output() {
        assert_eq!(
            parse_version("k3s version v1.21.2+k3s1 (5a67e8dc)\ngo version go1.19.8\n"),
            Some((1, 21))
        );
        assert_eq!(
            parse_version("k3s version v1.30.4-rc1+k3s1 (x)"),
            Some((1, 30))
        );
        assert_eq!(parse_version("k3s version unknown"), None);
        assert_eq!(parse_version(""), None);
    }

    #[test]
    fn gates_are_named_only_where_they_are_off_and_still_exist() {
        assert_eq!(
            feature_gates_for(21),
            [
                "ServiceLoadBalancerClass=true",
                "ServiceLBNodePortControl=true",
                "MixedProtocolLBService=true"
            ]
        );
        assert_eq!(feature_gates_for(23), ["MixedProtocolLBService=true"]);
        assert!(feature_gates_for(24).is_empty());
        assert!(feature_gates_for(34).is_empty());
    }

    /// Whether `args` holds exactly `wanted`.
    fn has(args: &[String], wanted: &str) -> bool {
        args.iter().any(|a| a == wanted)
    }

    #[test]
    fn server_args_keep_everything_in_the_run_directory() {
        let dir = Path::new("/tmp/tdm1x1-k3s");
        let options = ControlPlaneOptions {
            feature_gates: Some("A=true".into()),
            ..ControlPlaneOptions::default()
        };
        let args = server_args(dir, &options, 21);
        assert_eq!(args[..2], ["server", "--disable-agent"]);
        for wanted in [
            "--data-dir=/tmp/tdm1x1-k3s/data",
            "--write-kubeconfig=/tmp/tdm1x1-k3s/k3s-kubeconfig.yaml",
            "--cluster-cidr=10.244.0.0/16",
            "--service-cidr=10.96.0.0/16",
            "--kube-controller-manager-arg=flex-volume-plugin-dir=/tmp/tdm1x1-k3s/data/flexvolume",
            "--kube-apiserver-arg=feature-gates=A=true",
        ] {
            assert!(has(&args, wanted), "{wanted} missing: {args:?}");
        }
        let none = ControlPlaneOptions {
            feature_gates: Some(String::new()),
            ..ControlPlaneOptions::default()
        };
        let none = server_args(dir, &none, 21);
        assert!(
            !none.iter().any(|a| a.contains("feature-gates")),
            "{none:?}"
        );
    }

    #[test]
    fn the_suites_gates_follow_the_version() {
        let dir = Path::new("/tmp/tdm1x1-k3s");
        let options = ControlPlaneOptions::default();
        assert!(!options.dual_stack());
        let args = server_args(dir, &options, 21);
        assert!(has(
            &args,
            "--kube-apiserver-arg=feature-gates=ServiceLoadBalancerClass=true,\
             ServiceLBNodePortControl=true,MixedProtocolLBService=true"
        ));
        assert!(
            !args.iter().any(|a| a.contains("IPv6DualStack")),
            "{args:?}"
        );
        let args = server_args(dir, &options, 24);
        assert!(
            !args.iter().any(|a| a.contains("feature-gates")),
            "{args:?}"
        );
    }

    #[test]
    fn a_dual_stack_cluster_has_a_cidr_per_family_and_the_gate_where_it_exists() {
        let dir = Path::new("/tmp/tdm1x1-k3s");
        let dual = ControlPlaneOptions::new(ClusterFamilies::Dual);
        assert!(dual.dual_stack());
        let args = server_args(dir, &dual, 21);
        for wanted in [
            "--cluster-cidr=10.244.0.0/16,fd00:10:244::/56",
            "--service-cidr=10.96.0.0/16,fd00:10:96::/112",
            "--flannel-backend=none",
            "--kube-apiserver-arg=feature-gates=ServiceLoadBalancerClass=true,\
             ServiceLBNodePortControl=true,MixedProtocolLBService=true,IPv6DualStack=true",
            "--kube-controller-manager-arg=feature-gates=IPv6DualStack=true",
        ] {
            assert!(has(&args, wanted), "{wanted} missing: {args:?}");
        }
        // Given gates replace the suite's, never the cluster's.
        let given = ControlPlaneOptions {
            feature_gates: Some(String::new()),
            ..dual.clone()
        };
        assert!(has(
            &server_args(dir, &given, 22),
            "--kube-apiserver-arg=feature-gates=IPv6DualStack=true"
        ));
        for minor in [23, 25, 34] {
            let args = server_args(dir, &dual, minor);
            assert!(
                !args.iter().any(|a| a.contains("IPv6DualStack")),
                "{args:?}"
            );
            assert!(has(&args, "--service-cidr=10.96.0.0/16,fd00:10:96::/112"));
        }
    }

    #[test]
    fn run_directories_follow_the_netlab_naming() {
        let name = format!("{}-k3s", RunPrefix::new(4242, 3));
        assert_eq!(owner_pid(&name), Some(4242));
    }

    #[test]
    fn the_relayed_kubeconfig_names_the_relay() {
        let dir = std::env::temp_dir().join(format!("tdm-k3s-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let original = dir.join("in.yaml");
        std::fs::write(
            &original,
            "apiVersion: v1\nkind: Config\ncurrent-context: default\n\
             clusters:\n- name: default\n  cluster:\n    server: https://127.0.0.1:6443\n    certificate-authority-data: Q0E=\n\
             contexts:\n- name: default\n  context: {cluster: default, user: default}\n\
             users:\n- name: default\n  user: {token: t}\n",
        )
        .unwrap();
        let out = dir.join("out.yaml");
        write_relayed_kubeconfig(&original, &out, "127.0.0.1:40001".parse().unwrap()).unwrap();
        let back = Kubeconfig::read_from(&out).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let cluster = back.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://127.0.0.1:40001"));
        assert_eq!(cluster.certificate_authority_data.as_deref(), Some("Q0E="));
    }
}
