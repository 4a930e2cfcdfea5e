//! A real Kubernetes node: `k3s server` with its own kubelet and containerd, running runc
//! pods, inside a network namespace the caller built (e.g. a `tandem_netlab` node).
//!
//! Nothing of it touches the machine outside that namespace and a run directory:
//!
//! * k3s runs under `nsenter --net=NS -- unshare --mount --propagation slave` (not `ip
//!   netns exec`, which remounts `/sys` and loses the cgroup mounts the kubelet needs);
//!   `node/start.sh` then mounts a tmpfs on `/run`, overlays on `/var/lib` and `/etc` and a
//!   directory on `/var/log`, all backed by the run directory and private to that mount
//!   namespace;
//! * the global sysctls the kubelet wants (`kernel.panic`, `vm.overcommit_memory`, ...) are
//!   files bound read-only over their `/proc/sys` entries there, so the machine's own
//!   values are never written;
//! * its pods live in one cgroup subtree per hierarchy, `/tandem-k3s-<pid>x<seq>`
//!   (`--kubelet-arg=cgroup-root`), so stopping kills exactly them;
//! * nothing is pulled: the pause image and every other image are docker archives in
//!   `DATA/agent/images/`, which k3s imports at start.
//!
//! [`K3sNode::stop`] (also on drop, so on failures and panics) stops k3s, kills the pods'
//! processes through their cgroups, then containerd and the shims left in the namespace,
//! removes the cgroup subtrees and the run directory's data. [`remove_stale`] does the same
//! for the leftovers of runs whose process died.

use std::ffi::OsStr;
use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tandem_netlab::{ChildGuard, NetlabError, Netns, Recipients};

const START_SCRIPT: &str = include_str!("../node/start.sh");
const CONTAINERD_TEMPLATE: &str = include_str!("../node/containerd-config.toml.tmpl");
const CNI_CONFLIST: &str = include_str!("../node/cni.conflist");
const TEST_IMAGES_SCRIPT: &str = include_str!("../node/test-images.sh");

/// The pod sandbox image; `node/test-images.sh` builds it (nothing can be pulled).
pub const PAUSE_IMAGE: &str = "localhost/pause:3.5";

/// Where the cgroup hierarchies are mounted (cgroup v1: one directory per hierarchy).
const CGROUP_MOUNT: &str = "/sys/fs/cgroup";
/// Name head of this crate's cgroup subtrees and run directories: `tandem-k3s-<pid>x<seq>`.
const TAG_HEAD: &str = "tandem-k3s-";

/// The global sysctls kubelet v1.21 sets (`setupKernelTunables`) and the values it wants.
/// Bound over `/proc/sys` in the node's mount namespace, they read as wanted and the
/// kubelet writes nothing.
const KUBELET_SYSCTLS: [(&str, &str); 6] = [
    ("kernel.panic", "10"),
    ("kernel.panic_on_oops", "1"),
    ("vm.overcommit_memory", "1"),
    ("vm.panic_on_oom", "0"),
    ("kernel.keys.root_maxkeys", "1000000"),
    ("kernel.keys.root_maxbytes", "25000000"),
];

/// k3s runs these from `PATH` by name when it has no data bundle: links to the k3s binary
/// first in `PATH`, or it would pick the distribution's containerd.
const K3S_APPLETS: [&str; 4] = ["containerd", "kubectl", "ctr", "crictl"];

/// How long k3s gets to stop after SIGTERM before everything is killed.
const STOP_GRACE: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Netlab(#[from] NetlabError),
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("k3s exited ({status}) before node {node} was Ready; last lines of {log}:\n{tail}")]
    Exited {
        node: String,
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error("node {node} was not {wanted} (last seen: {last}); last lines of {log}:\n{tail}")]
    NotReady {
        node: String,
        /// What the node was not, and for how long it was waited for.
        wanted: String,
        last: String,
        log: PathBuf,
        tail: String,
    },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> NodeError {
    let context = context.into();
    move |source| NodeError::Io { context, source }
}

/// The secret a cluster's agents join its server with (`--token` of both).
const CLUSTER_TOKEN: &str = "tandem-k3s-cluster";
/// The API server's port on the server node.
const API_PORT: u16 = 6443;

/// What a node runs.
#[derive(Debug, Clone)]
pub enum NodeRole {
    /// `k3s server`: the API server, controller-manager and scheduler beside its own
    /// kubelet; it writes the admin kubeconfig.
    Server,
    /// `k3s agent`: a kubelet and containerd that join the server at `server`, which must
    /// be running (its admin kubeconfig, `server_kubeconfig`, is written).
    Agent {
        server: Ipv4Addr,
        server_kubeconfig: PathBuf,
    },
}

/// What node to start, and where.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The k3s binary (any release; [`crate::k3s_binary`]).
    pub k3s: PathBuf,
    /// The node's network namespace: it must have `ip` on an interface and a default route.
    pub netns: Netns,
    /// The Kubernetes Node name.
    pub name: String,
    /// A cluster's server, or one of its agents.
    pub role: NodeRole,
    /// The node's address: API server, kubelet and NodePorts.
    pub ip: Ipv4Addr,
    /// The node's pod subnet, handed out by the CNI bridge plugin (host-local IPAM); its
    /// first address is the bridge's, the pods' gateway.
    pub pod_subnet: Ipv4Net,
    /// The pod bridge; an existing bridge of that name (with the gateway address) is used.
    pub bridge: String,
    /// The API server's `--cluster-cidr`; it must contain `pod_subnet` (an agent's is the
    /// server's).
    pub cluster_cidr: Ipv4Net,
    /// The API server's `--service-cidr` (not used by an agent).
    pub service_cidr: Ipv4Net,
    /// Docker archives imported into containerd at start; one must hold [`PAUSE_IMAGE`].
    pub images: Vec<PathBuf>,
    /// More `k3s server` (or `k3s agent`) arguments, e.g. `--disable-kube-proxy` (a
    /// server's; its agents follow it).
    pub extra_args: Vec<String>,
    /// Parent of the run directories (`<base>/tandem-k3s-<pid>x<seq>`); a dead run's
    /// directory here is removed by [`K3sNode::start`].
    pub base_dir: PathBuf,
}

/// A running k3s node; dropping it stops everything ([`K3sNode::stop`]).
#[derive(Debug)]
pub struct K3sNode {
    config: NodeConfig,
    tag: String,
    run_dir: PathBuf,
    bin_dir: PathBuf,
    kubeconfig: PathBuf,
    log: PathBuf,
    k3s: Option<ChildGuard>,
    started: Instant,
}

impl K3sNode {
    /// Removes the leftovers of dead runs, prepares the run directory and the cgroup
    /// subtrees, and starts k3s. It returns once k3s runs; see [`K3sNode::wait_ready`].
    pub fn start(config: NodeConfig) -> Result<Self, NodeError> {
        remove_stale(&config.base_dir);
        static SEQUENCE: AtomicU32 = AtomicU32::new(1);
        let tag = format!(
            "{TAG_HEAD}{}x{}",
            std::process::id(),
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        );
        let run_dir = config.base_dir.join(&tag);
        let data = run_dir.join("data");
        let bin_dir = run_dir.join("bin");
        let cni_dir = run_dir.join("cni");
        let images = data.join("agent/images");
        let containerd_dir = data.join("agent/etc/containerd");
        let sysctl_dir = run_dir.join("sysctl");
        for dir in [&bin_dir, &cni_dir, &images, &containerd_dir, &sysctl_dir] {
            fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        }
        let mut node = Self {
            kubeconfig: run_dir.join("kubeconfig.yaml"),
            log: run_dir.join("k3s.log"),
            bin_dir,
            run_dir,
            tag,
            config,
            k3s: None,
            started: Instant::now(),
        };
        // From here on a failure drops `node`, which removes what was made so far.
        node.write_files(&data, &cni_dir, &images, &containerd_dir, &sysctl_dir)?;
        create_cgroups(&node.tag)?;
        node.masquerade_outbound()?;
        node.spawn(&data)?;
        Ok(node)
    }

    fn write_files(
        &self,
        data: &Path,
        cni_dir: &Path,
        images: &Path,
        containerd_dir: &Path,
        sysctl_dir: &Path,
    ) -> Result<(), NodeError> {
        let write = |path: PathBuf, text: &str| {
            fs::write(&path, text).map_err(io(format!("writing {}", path.display())))
        };
        write(self.run_dir.join("start.sh"), START_SCRIPT)?;
        write(
            containerd_dir.join("config.toml.tmpl"),
            &containerd_config(data, cni_dir),
        )?;
        write(
            cni_dir.join("10-tandem-k3s.conflist"),
            &cni_conflist(&self.config.bridge, self.config.pod_subnet, data),
        )?;
        for (key, value) in KUBELET_SYSCTLS {
            write(sysctl_dir.join(key), &format!("{value}\n"))?;
        }
        for applet in K3S_APPLETS {
            let link = self.bin_dir.join(applet);
            std::os::unix::fs::symlink(&self.config.k3s, &link)
                .map_err(io(format!("linking {}", link.display())))?;
        }
        if let NodeRole::Agent {
            server,
            server_kubeconfig,
        } = &self.config.role
        {
            // The server's admin kubeconfig names its API server as 127.0.0.1, which is
            // the server's own namespace only: here it is the server's address.
            let admin = fs::read_to_string(server_kubeconfig)
                .map_err(io(format!("reading {}", server_kubeconfig.display())))?;
            write(
                self.kubeconfig.clone(),
                &admin.replace(
                    &format!("https://127.0.0.1:{API_PORT}"),
                    &format!("https://{server}:{API_PORT}"),
                ),
            )?;
        }
        for archive in &self.config.images {
            let name = archive.file_name().unwrap_or(OsStr::new("image.tar"));
            let target = images.join(name);
            // A hard link costs nothing; across file systems the archive is copied.
            if fs::hard_link(archive, &target).is_err() {
                fs::copy(archive, &target).map_err(io(format!("copying {}", archive.display())))?;
            }
        }
        Ok(())
    }

    /// Pods reaching out of the cluster leave with the node's address, as flannel's
    /// masquerade has it: outside networks route no pod addresses (the cloud edge refuses
    /// them). Traffic to the cluster's other pods keeps its source, which the bridge
    /// plugin's own `ipMasq` would not (it spares only the node's own subnet).
    fn masquerade_outbound(&self) -> Result<(), NodeError> {
        let c = &self.config;
        let (subnet, cluster) = (c.pod_subnet.trunc().to_string(), c.cluster_cidr.to_string());
        let rule = [
            "POSTROUTING",
            "-s",
            &subnet,
            "!",
            "-d",
            &cluster,
            "-m",
            "comment",
            "--comment",
            "tandem-k3s: pods reaching out of the cluster",
            "-j",
            "MASQUERADE",
        ];
        let exists = c
            .netns
            .exec_checked([["iptables", "-w", "-t", "nat", "-C"].as_slice(), &rule].concat())
            .is_ok();
        if !exists {
            c.netns
                .exec_checked([["iptables", "-w", "-t", "nat", "-A"].as_slice(), &rule].concat())?;
        }
        Ok(())
    }

    fn spawn(&mut self, data: &Path) -> Result<(), NodeError> {
        let c = &self.config;
        let max_open_files =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
                .map(|(_, hard)| hard)
                .unwrap_or(1 << 16);
        let kubelet = |arg: &str| format!("--kubelet-arg={arg}");
        let flexvolume = data.join("flexvolume");
        let mut args = match &c.role {
            NodeRole::Server => vec![
                "server".to_owned(),
                format!("--write-kubeconfig={}", self.kubeconfig.display()),
                format!("--advertise-address={}", c.ip),
                format!("--cluster-cidr={}", c.cluster_cidr),
                format!("--service-cidr={}", c.service_cidr),
                // The CNI configuration above is the pod network; k3s's own add-ons would
                // need images from the internet. Agents take these from the server.
                "--flannel-backend=none".to_owned(),
                "--disable-network-policy".to_owned(),
                "--disable-cloud-controller".to_owned(),
                "--disable=traefik,servicelb,metrics-server,local-storage,coredns".to_owned(),
                format!(
                    "--kube-controller-manager-arg=flex-volume-plugin-dir={}",
                    flexvolume.display()
                ),
            ],
            NodeRole::Agent { server, .. } => vec![
                "agent".to_owned(),
                format!("--server=https://{server}:{API_PORT}"),
            ],
        };
        args.extend([
            format!("--token={CLUSTER_TOKEN}"),
            format!("--data-dir={}", data.display()),
            format!("--node-name={}", c.name),
            format!("--node-ip={}", c.ip),
            format!("--pause-image={PAUSE_IMAGE}"),
            kubelet(&format!("root-dir={}", data.join("kubelet").display())),
            kubelet(&format!("volume-plugin-dir={}", flexvolume.display())),
            kubelet("cgroup-driver=cgroupfs"),
            kubelet(&format!("cgroup-root=/{}", self.tag)),
            kubelet("fail-swap-on=false"),
            // The kubelet raises its limit to this and fails when it may not.
            kubelet(&format!("max-open-files={max_open_files}")),
            // A build machine's disk may be nearly full: the test's pods must not be
            // evicted for it, and the eviction manager must not reclaim space by deleting
            // the preloaded images (they cannot be pulled back; CI once lost the pause
            // image so). "0%" switches a signal off; each of k3s's own disk thresholds is
            // overridden here, as the kubelet merges repeated --eviction-hard flags.
            kubelet(
                "eviction-hard=imagefs.available<0%,nodefs.available<0%,\
                 imagefs.inodesFree<0%,nodefs.inodesFree<0%",
            ),
            kubelet("image-gc-high-threshold=100"),
        ]);
        args.extend(c.extra_args.iter().cloned());

        let log =
            fs::File::create(&self.log).map_err(io(format!("creating {}", self.log.display())))?;
        let log_err = log.try_clone().map_err(io("duplicating the log file"))?;
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", c.netns.name()))
            .args([
                "--",
                "unshare",
                "--mount",
                "--propagation",
                "slave",
                "--",
                "/bin/sh",
            ])
            .arg(self.run_dir.join("start.sh"))
            .arg(&self.run_dir)
            .arg(&c.k3s)
            .args(&args)
            .env("PATH", self.path_env())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        self.started = Instant::now();
        self.k3s = Some(ChildGuard::spawn(cmd)?);
        Ok(())
    }

    fn path_env(&self) -> std::ffi::OsString {
        let mut path = self.bin_dir.clone().into_os_string();
        path.push(":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
        path
    }

    /// The Node name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The node's address.
    pub fn ip(&self) -> Ipv4Addr {
        self.config.ip
    }

    /// The node's pod subnet.
    pub fn pod_subnet(&self) -> Ipv4Net {
        self.config.pod_subnet
    }

    /// The node's network namespace.
    pub fn netns(&self) -> &Netns {
        &self.config.netns
    }

    /// k3s's log (API server, kubelet and containerd in one).
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of k3s's log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }

    /// The admin kubeconfig; its server is reachable inside the node's namespace.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The kubeconfig k3s writes for a kube-proxy of the node (also with
    /// `--disable-kube-proxy`); its server is reachable inside the node's namespace.
    pub fn kube_proxy_kubeconfig(&self) -> PathBuf {
        self.run_dir.join("data/agent/kubeproxy.kubeconfig")
    }

    /// `program` inside the node's network namespace (and the host's mount namespace),
    /// with `KUBECONFIG` naming the admin kubeconfig (its server, `127.0.0.1:6443`, is
    /// reachable only there) set and `kubectl`/`ctr` first in `PATH`: for kubectl and helm.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", self.config.netns.name()))
            .arg("--")
            .arg(program)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("PATH", self.path_env())
            .stdin(Stdio::null());
        cmd
    }

    /// `program` in k3s's own network and mount namespaces: it sees the node's `/run`
    /// (the xtables lock the kubelet and the node proxy take, containerd's socket).
    pub fn command_in_node(&self, program: impl AsRef<OsStr>) -> Result<Command, NodeError> {
        let pid = self
            .k3s
            .as_ref()
            .map(ChildGuard::pid)
            .ok_or_else(|| NodeError::Io {
                context: "entering the node's mount namespace".to_owned(),
                source: std::io::Error::other("k3s is not running"),
            })?;
        let mut cmd = Command::new("nsenter");
        cmd.args(["-t", &pid.to_string(), "-m", "-n", "--"])
            .arg(program)
            .env("PATH", self.path_env())
            .stdin(Stdio::null());
        Ok(cmd)
    }

    /// Runs `kubectl ARGS` against the node and returns its stdout; a failure carries
    /// stderr.
    pub fn kubectl<I, S>(&self, args: I) -> Result<String, NodeError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.command(self.bin_dir.join("kubectl"));
        cmd.args(args);
        checked(cmd)
    }

    /// Waits until the Node reports Ready. The run directory is always new, so a Ready
    /// condition cannot be stale status of an earlier run.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<Duration, NodeError> {
        self.wait_for_node(
            "Ready",
            r#"{.status.conditions[?(@.type=="Ready")].status}"#,
            |status| status == "True",
            timeout,
        )
        .map(|_| self.started.elapsed())
    }

    /// Waits until the kubelet has registered the Node.
    pub fn wait_registered(&mut self, timeout: Duration) -> Result<(), NodeError> {
        let name = self.config.name.clone();
        self.wait_for_node(
            "registered",
            "{.metadata.name}",
            |registered| registered == name,
            timeout,
        )
        .map(drop)
    }

    /// Waits until the Node's field at `jsonpath` is `accepted`; returns it.
    fn wait_for_node(
        &mut self,
        wanted: &'static str,
        jsonpath: &str,
        accepted: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> Result<String, NodeError> {
        let deadline = Instant::now() + timeout;
        let mut last = "no kubeconfig yet".to_owned();
        loop {
            if let Some(guard) = self.k3s.as_mut()
                && let Some(status) = guard.try_wait()?
            {
                return Err(NodeError::Exited {
                    node: self.config.name.clone(),
                    status: status.to_string(),
                    log: self.log.clone(),
                    tail: self.log_tail(30),
                });
            }
            if self.kubeconfig.exists() {
                match self.kubectl([
                    "get",
                    "node",
                    &self.config.name,
                    "-o",
                    &format!("jsonpath={jsonpath}"),
                ]) {
                    Ok(value) if accepted(value.trim()) => return Ok(value.trim().to_owned()),
                    Ok(value) => last = format!("{jsonpath} = {:?}", value.trim()),
                    Err(e) => last = e.to_string(),
                }
            }
            if Instant::now() > deadline {
                return Err(NodeError::NotReady {
                    node: self.config.name.clone(),
                    wanted: format!("{wanted} within {timeout:?}"),
                    last,
                    log: self.log.clone(),
                    tail: self.log_tail(30),
                });
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Stops k3s (SIGTERM, then SIGKILL), kills the pods through their cgroups and every
    /// process left in the node's network namespace (containerd, shims), removes the
    /// cgroup subtrees and the run directory's data; the logs stay. Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut guard) = self.k3s.take() {
            if guard.signal(Signal::SIGTERM, Recipients::Group).is_ok() {
                let deadline = Instant::now() + STOP_GRACE;
                while Instant::now() < deadline && matches!(guard.try_wait(), Ok(None)) {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
            // Dropping the guard kills what is left of k3s's process group.
            drop(guard);
        }
        kill_cgroups(&self.tag);
        kill_netns_processes(self.config.netns.name());
        remove_cgroups(&self.tag);
        for data in ["data", "overlay", "cni", "bin"] {
            let dir = self.run_dir.join(data);
            if let Err(e) = fs::remove_dir_all(&dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot remove");
            }
        }
    }
}

impl Drop for K3sNode {
    fn drop(&mut self) {
        self.stop();
    }
}

/// k3s's containerd configuration template for a node whose data directory is `data`.
fn containerd_config(data: &Path, cni_dir: &Path) -> String {
    CONTAINERD_TEMPLATE
        .replace("@DATA_DIR@", &data.to_string_lossy())
        .replace("@PAUSE_IMAGE@", PAUSE_IMAGE)
        .replace("@CNI_CONF_DIR@", &cni_dir.to_string_lossy())
}

/// The CNI configuration: a bridge with host-local addresses from `subnet`, whose first
/// address is the bridge's (masquerading: [`K3sNode::masquerade_outbound`]).
fn cni_conflist(bridge: &str, subnet: Ipv4Net, data: &Path) -> String {
    let gateway = subnet.hosts().next().unwrap_or(subnet.addr());
    CNI_CONFLIST
        .replace("@BRIDGE@", bridge)
        .replace("@POD_SUBNET@", &subnet.trunc().to_string())
        .replace("@POD_GATEWAY@", &gateway.to_string())
        .replace("@DATA_DIR@", &data.to_string_lossy())
}

/// Builds the test images (`node/test-images.sh`: the pause image and the busybox echo)
/// and saves them as docker archives into `dir`; returns their paths.
pub fn build_test_images(dir: &Path) -> Result<Vec<PathBuf>, NodeError> {
    fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    let mut cmd = Command::new("bash");
    cmd.args(["-c", TEST_IMAGES_SCRIPT, "test-images.sh"])
        .arg(dir);
    Ok(checked(cmd)?.lines().map(PathBuf::from).collect())
}

/// Runs `cmd`; its stdout on success, [`NodeError::Command`] with stderr otherwise.
pub fn checked(mut cmd: Command) -> Result<String, NodeError> {
    let output = run(&mut cmd)?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(NodeError::Command {
            command: describe(&cmd),
            status: output.status.to_string(),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

/// Runs `cmd` to completion, whatever its exit status.
pub fn run(cmd: &mut Command) -> Result<Output, NodeError> {
    cmd.output()
        .map_err(io(format!("running `{}`", describe(cmd))))
}

/// A command line for messages.
pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(OsStr::to_string_lossy)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The last `lines` lines of a text file (empty if unreadable).
pub fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The pid in a name `tandem-k3s-<pid>...` (a node's `<pid>x<seq>`, or a test's own
/// directory named with [`run_name`]).
fn tag_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(TAG_HEAD)?;
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// `tandem-k3s-<pid>-<what>`: a directory of this process under a node's `base_dir`, which
/// [`remove_stale`] removes once this process is dead.
pub fn run_name(what: &str) -> String {
    format!("{TAG_HEAD}{}-{what}", std::process::id())
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The cgroup hierarchies: every directory under `/sys/fs/cgroup`.
fn hierarchies() -> Vec<PathBuf> {
    fs::read_dir(CGROUP_MOUNT)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.is_dir() && !p.is_symlink())
                .collect()
        })
        .unwrap_or_default()
}

/// `/tandem-k3s-...` in every hierarchy; cpuset needs its cpus and mems set before a task
/// may join, so they are copied from the root.
fn create_cgroups(tag: &str) -> Result<(), NodeError> {
    for hierarchy in hierarchies() {
        let dir = hierarchy.join(tag);
        fs::create_dir_all(&dir).map_err(io(format!("creating cgroup {}", dir.display())))?;
        for file in ["cpuset.cpus", "cpuset.mems"] {
            let parent = hierarchy.join(file);
            if let Ok(value) = fs::read_to_string(&parent) {
                fs::write(dir.join(file), value.trim())
                    .map_err(io(format!("writing {}", dir.join(file).display())))?;
            }
        }
    }
    Ok(())
}

/// Every cgroup directory below (and including) `dir`, deepest first.
fn cgroup_tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            if path.is_dir() {
                out.extend(cgroup_tree(&path));
            }
        }
    }
    out.push(dir.to_path_buf());
    out
}

/// SIGKILLs every process in the `tag` subtrees until none is left (or 10 s passed): the
/// pods, host-network ones included.
fn kill_cgroups(tag: &str) {
    let own = std::process::id();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut found = false;
        for hierarchy in hierarchies() {
            for dir in cgroup_tree(&hierarchy.join(tag)) {
                let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                for pid in procs
                    .split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok())
                {
                    if pid == own {
                        continue;
                    }
                    found = true;
                    if let Ok(raw) = i32::try_from(pid) {
                        let _ = kill(Pid::from_raw(raw), Signal::SIGKILL);
                    }
                }
            }
        }
        if !found || Instant::now() > deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// SIGKILLs every process in network namespace `netns` (containerd and its shims stay
/// there after k3s is gone).
fn kill_netns_processes(netns: &str) {
    let own = std::process::id();
    let Ok(out) = Command::new("ip").args(["netns", "pids", netns]).output() else {
        return;
    };
    for pid in String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
    {
        if u32::try_from(pid).ok() != Some(own) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// Removes the `tag` subtrees, deepest first; a cgroup whose last task is still exiting
/// refuses for a moment, so each is retried.
fn remove_cgroups(tag: &str) {
    for hierarchy in hierarchies() {
        let root = hierarchy.join(tag);
        if !root.exists() {
            continue;
        }
        for dir in cgroup_tree(&root) {
            let mut tries = 0;
            while let Err(e) = fs::remove_dir(&dir) {
                tries += 1;
                if e.kind() == std::io::ErrorKind::NotFound || tries > 50 {
                    if tries > 50 {
                        tracing::warn!(dir = %dir.display(), error = %e, "cannot remove cgroup");
                    }
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Removes what runs whose process died left behind: first their `tandem_netlab`
/// namespaces with everything inside (k3s, containerd, the shims: else the kubelet would
/// start the pods again), then their pods' processes and cgroup subtrees, and their run
/// directories under `base_dir`.
pub fn remove_stale(base_dir: &Path) {
    if let Err(e) = tandem_netlab::remove_stale_namespaces() {
        tracing::warn!(error = %e, "cannot remove the namespaces of dead runs");
    }
    let dead = |name: &str| tag_pid(name).is_some_and(|pid| !alive(pid));
    let mut tags = std::collections::BTreeSet::new();
    for hierarchy in hierarchies() {
        if let Ok(entries) = fs::read_dir(&hierarchy) {
            for entry in entries.filter_map(Result::ok) {
                let name = entry.file_name().to_string_lossy().into_owned();
                if dead(&name) {
                    tags.insert(name);
                }
            }
        }
    }
    for tag in &tags {
        tracing::info!(%tag, "removing the pods and cgroups of a dead run");
        kill_cgroups(tag);
        remove_cgroups(tag);
    }
    if let Ok(entries) = fs::read_dir(base_dir) {
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if dead(&name) {
                tracing::info!(dir = %entry.path().display(), "removing the run directory of a dead run");
                let _ = fs::remove_dir_all(entry.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_name_their_process() {
        assert_eq!(tag_pid("tandem-k3s-4242x3"), Some(4242));
        assert_eq!(tag_pid("tandem-k3s-4242-test"), Some(4242));
        assert_eq!(tag_pid("tandem-k3s-x3"), None);
        assert_eq!(tag_pid("kubepods"), None);
    }

    #[test]
    fn the_templates_have_every_placeholder_filled() {
        let data = Path::new("/run-dir/data");
        let config = containerd_config(data, Path::new("/run-dir/cni"));
        assert!(!config.contains('@'), "{config}");
        assert!(config.contains(r#"conf_dir = "/run-dir/cni""#), "{config}");
        let subnet: Ipv4Net = "10.244.1.0/24".parse().unwrap();
        let conflist = cni_conflist("cni0", subnet, data);
        assert!(!conflist.contains('@'), "{conflist}");
        let json: serde_json::Value = serde_json::from_str(&conflist).unwrap();
        let range = &json["plugins"][0]["ipam"]["ranges"][0][0];
        assert_eq!(range["subnet"], "10.244.1.0/24");
        assert_eq!(range["gateway"], "10.244.1.1");
    }
}
