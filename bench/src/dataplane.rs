//! Benchmark: the data plane, client → VIP → node → pod in the virtual cluster.
//!
//! One dual-stack lab (one node, one pod, so every path crosses the same hops) with four
//! LoadBalancer Services: an echo and an iperf3 Service in each LB mode, the passthrough
//! ones dual-stack. Each path is measured against its limit in the same run: passthrough
//! (over IPv4 and over IPv6) against the client routed straight to the pod with no NAT in
//! the same family, proxy mode against Debian's haproxy in TCP mode doing the cloud's job
//! (edge → nodeIP:nodePort), and the two cloud edges, the lab's own and a second one
//! running HAProxy (`cloud-mock --dataplane haproxy`), against the client sent straight
//! to the NodePort. Then each edge gets load balancers created one after another while
//! one of its load balancers carries steady traffic.

mod analysis;
mod edge;
mod probe;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path as FsPath, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use tandem_lab::{Lab, LabOptions, LbMode, Prepared, ServicePlan};
use tandem_netlab::{ChildGuard, ClusterFamilies, IpFamily, Netns};

use crate::BenchOptions;
use crate::report::Section;
use analysis::{Edge, Measurements, Path, PathMeasurement};

/// The report's block that holds the data plane's sections (replaced by a run of
/// `tandem-bench dataplane` alone).
pub const BLOCK: &str = "data plane";
/// iperf3's default port, used as the Service port and the pod's port alike.
const IPERF_PORT: u16 = 5201;
/// The echo Services' port (the pods' echo listens on the lab's echo port).
const ECHO_SERVICE_PORT: u16 = 80;
/// Where haproxy listens in the cloud edge: a pool address the cloud hands out last
/// (it allocates lowest-free first and this run asks for four VIPs).
const HAPROXY_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 254);
/// Bound on one request of the latency runs, connect included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a path may take to start working after its LB is reported ready.
const READY_BOUND: Duration = Duration::from_secs(30);
/// Tools the benchmark runs, and the Debian package of each.
const TOOLS: [(&str, &str); 2] = [("iperf3", "iperf3"), ("haproxy", "haproxy")];

/// How much the run measures.
#[derive(Debug, Clone, Copy)]
struct Scale {
    transfer_seconds: u32,
    rounds: usize,
    requests: u32,
    /// Load balancers created on each edge under steady traffic.
    churn: usize,
}

impl Scale {
    fn for_options(options: &BenchOptions) -> Self {
        if options.quick {
            Self {
                transfer_seconds: 1,
                rounds: 1,
                requests: 100,
                churn: 10,
            }
        } else {
            Self {
                transfer_seconds: 5,
                rounds: 3,
                requests: 1000,
                churn: 100,
            }
        }
    }
}

pub fn run(options: &BenchOptions) -> Result<Vec<Section>> {
    ensure_tools()?;
    let scale = Scale::for_options(options);
    let haproxy_version = haproxy_version();
    // Building the lab moves the calling thread into the lab's control-plane namespace:
    // a thread of its own, with the runtime built there after the move.
    let measurements = std::thread::Builder::new()
        .name("dataplane-bench".to_owned())
        .spawn(move || -> Result<Measurements> {
            let lab_options = LabOptions {
                nodes: 1,
                pods_per_node: vec![1],
                cluster_id: "bench".to_owned(),
                ip_family: ClusterFamilies::Dual,
                ..LabOptions::default()
            };
            let prepared = Lab::prepare(&lab_options)?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .context("building the tokio runtime")?;
            runtime.block_on(measure(prepared, lab_options, scale, haproxy_version))
        })
        .context("starting the data plane benchmark thread")?
        .join()
        .map_err(|_| anyhow!("the data plane benchmark thread panicked"))??;
    Ok(analysis::sections(&measurements))
}

/// Installs iperf3 and haproxy with apt-get when they are missing.
fn ensure_tools() -> Result<()> {
    let missing: Vec<&str> = TOOLS
        .iter()
        .filter(|(binary, _)| !on_path(binary))
        .map(|(_, package)| *package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("[dataplane] installing {}", missing.join(" "));
    let status = Command::new("apt-get")
        .args(["install", "-y", "-q"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .status()
        .context("running apt-get")?;
    if !status.success() {
        bail!(
            "apt-get install {} failed ({status}); install them by hand",
            missing.join(" ")
        );
    }
    match TOOLS.iter().find(|(binary, _)| !on_path(binary)) {
        Some((binary, _)) => bail!("{binary} is still not on PATH after apt-get install"),
        None => Ok(()),
    }
}

fn haproxy_version() -> String {
    Command::new("haproxy")
        .arg("-v")
        .output()
        .ok()
        .and_then(|out| {
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.lines().next().map(|line| line.trim().to_owned())
        })
        .unwrap_or_else(|| "haproxy (version unknown)".to_owned())
}

fn on_path(binary: &str) -> bool {
    let dirs = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&dirs)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .any(|dir| dir.join(binary).is_file())
}

async fn measure(
    prepared: Prepared,
    options: LabOptions,
    scale: Scale,
    haproxy_version: String,
) -> Result<Measurements> {
    let start = Instant::now();
    let progress = move |what: &str| {
        eprintln!("[dataplane {:>5.1}s] {what}", start.elapsed().as_secs_f64());
    };
    let mut lab = Lab::start(prepared, options, &progress).await?;
    let result = measure_in(&lab, scale, haproxy_version, &progress).await;
    if result.is_err() {
        lab.keep_run_dir = true;
    }
    result
}

async fn measure_in(
    lab: &Lab,
    scale: Scale,
    haproxy_version: String,
    progress: &dyn Fn(&str),
) -> Result<Measurements> {
    let pod = lab
        .topology
        .pods()
        .first()
        .context("the lab has no pod")?
        .clone();
    let node = lab
        .topology
        .nodes()
        .first()
        .context("the lab has no node")?
        .clone();
    let logs = lab.run_dir.join("logs");

    progress("starting iperf3 -s in the pod");
    let _iperf_server = start_iperf_server(&pod.netns, &logs.join("iperf3-server.log")).await?;

    progress("creating the echo and iperf3 Services in both LB modes");
    let echo_port = lab.topology.echo_http_port();
    let plan = |name: &str, mode: LbMode, port: u16, target_port: u16| {
        let mut plan = ServicePlan::new(name, mode);
        plan.port = port;
        plan.target_port = target_port;
        plan.pods = vec![pod.name.clone()];
        if mode == LbMode::Passthrough {
            plan.ip_family_policy = Some("RequireDualStack".to_owned());
        }
        plan
    };
    let echo_proxy = plan("echo-proxy", LbMode::Proxy, ECHO_SERVICE_PORT, echo_port);
    let echo_pass = plan(
        "echo-pass",
        LbMode::Passthrough,
        ECHO_SERVICE_PORT,
        echo_port,
    );
    let iperf_proxy = plan("iperf-proxy", LbMode::Proxy, IPERF_PORT, IPERF_PORT);
    let iperf_pass = plan("iperf-pass", LbMode::Passthrough, IPERF_PORT, IPERF_PORT);
    let plans = [&echo_proxy, &echo_pass, &iperf_proxy, &iperf_pass];
    for plan in plans {
        lab.create_service(plan).await?;
    }
    let mut vips = BTreeMap::new();
    for plan in plans {
        let families = if plan.ip_family_policy.is_some() {
            2
        } else {
            1
        };
        let ips = lab
            .wait_for_ingresses(plan, families, Duration::from_secs(60))
            .await?;
        vips.insert(plan.name.clone(), ips);
    }
    let vip = |plan: &ServicePlan, family: IpFamily| -> Result<IpAddr> {
        vips.get(&plan.name)
            .into_iter()
            .flatten()
            .copied()
            .find(|ip| IpFamily::of(*ip) == family)
            .with_context(|| format!("{} has no {family:?} VIP", plan.name))
    };
    let pod_ip6 = pod
        .ip6
        .context("the dual-stack lab's pod has no IPv6 address")?;
    let node_ip6 = node
        .ip6
        .context("the dual-stack lab's node has no IPv6 address")?;

    progress("starting haproxy (TCP mode) in the cloud edge");
    let edge = lab.topology.edge().netns.clone();
    let haproxy_echo = SocketAddrV4::new(HAPROXY_IP, ECHO_SERVICE_PORT);
    let haproxy_iperf = SocketAddrV4::new(HAPROXY_IP, IPERF_PORT);
    let forwards = [
        (
            haproxy_echo,
            SocketAddrV4::new(node.ip, node_port(lab, &echo_proxy).await?),
        ),
        (
            haproxy_iperf,
            SocketAddrV4::new(node.ip, node_port(lab, &iperf_proxy).await?),
        ),
    ];
    let _haproxy = start_haproxy(
        &edge,
        &analysis::haproxy_config(&forwards),
        &lab.run_dir,
        haproxy_echo,
    )
    .await?;
    let [(_, node_port_echo), (_, node_port_iperf)] = forwards;

    progress("starting the HAProxy edge (cloud-mock --dataplane haproxy) beside the lab's own");
    let haproxy_edge = edge::HaproxyEdge::start(lab).await?;
    let own_vip = |plan: &ServicePlan, port: u16| -> Result<SocketAddr> {
        Ok(SocketAddr::new(vip(plan, IpFamily::V4)?, port))
    };
    // The controller's load balancers on the own edge: the HAProxy edge's get the same
    // listeners, backend (nodeIP:nodePort) and health check.
    let echo_lb =
        edge::load_balancer_at(&lab.cloud, own_vip(&echo_proxy, ECHO_SERVICE_PORT)?).await?;
    let iperf_lb = edge::load_balancer_at(&lab.cloud, own_vip(&iperf_proxy, IPERF_PORT)?).await?;
    let (_, haproxy_edge_echo) = edge::create(
        &haproxy_edge.client,
        &edge::copy_of(&echo_lb, "bench-echo", Edge::Haproxy),
    )
    .await?;
    let (_, haproxy_edge_iperf) = edge::create(
        &haproxy_edge.client,
        &edge::copy_of(&iperf_lb, "bench-iperf", Edge::Haproxy),
    )
    .await?;

    let bench = Bench {
        client: lab.topology.client_in_range().netns.clone(),
        edge,
        pod_routes: BTreeMap::from([
            (Path::Direct, format!("{} via {}", node.pod_cidr, node.ip)),
            (Path::DirectIpv6, format!("{pod_ip6}/128 via {node_ip6}")),
        ]),
        echo: BTreeMap::from([
            (Path::Direct, SocketAddr::new(pod.ip.into(), echo_port)),
            (
                Path::Passthrough,
                SocketAddr::new(vip(&echo_pass, IpFamily::V4)?, ECHO_SERVICE_PORT),
            ),
            (
                Path::Proxy,
                SocketAddr::new(vip(&echo_proxy, IpFamily::V4)?, ECHO_SERVICE_PORT),
            ),
            (Path::Haproxy, haproxy_echo.into()),
            (Path::DirectIpv6, SocketAddr::new(pod_ip6.into(), echo_port)),
            (
                Path::PassthroughIpv6,
                SocketAddr::new(vip(&echo_pass, IpFamily::V6)?, ECHO_SERVICE_PORT),
            ),
            (Path::HaproxyEdge, haproxy_edge_echo),
            (Path::NodePort, node_port_echo.into()),
        ]),
        iperf: BTreeMap::from([
            (Path::Direct, SocketAddr::new(pod.ip.into(), IPERF_PORT)),
            (
                Path::Passthrough,
                SocketAddr::new(vip(&iperf_pass, IpFamily::V4)?, IPERF_PORT),
            ),
            (
                Path::Proxy,
                SocketAddr::new(vip(&iperf_proxy, IpFamily::V4)?, IPERF_PORT),
            ),
            (Path::Haproxy, haproxy_iperf.into()),
            (
                Path::DirectIpv6,
                SocketAddr::new(pod_ip6.into(), IPERF_PORT),
            ),
            (
                Path::PassthroughIpv6,
                SocketAddr::new(vip(&iperf_pass, IpFamily::V6)?, IPERF_PORT),
            ),
            (Path::HaproxyEdge, haproxy_edge_iperf),
            (Path::NodePort, node_port_iperf.into()),
        ]),
    };

    progress("waiting until every path answers (and warming it up)");
    for path in Path::ALL {
        bench.until_ready(path).await?;
    }

    let load_before = load_average();
    let mut paths: BTreeMap<Path, PathMeasurement> = BTreeMap::new();
    let request_chunks = analysis::split(scale.requests, scale.rounds);
    for (round, requests) in request_chunks.iter().enumerate() {
        for path in Path::order_for_round(round) {
            progress(&format!(
                "round {}/{}: {} — {} s transfer, {requests} requests",
                round + 1,
                request_chunks.len(),
                path.label(),
                scale.transfer_seconds
            ));
            let entry = paths.entry(path).or_default();
            entry
                .throughput
                .push(bench.throughput(path, scale.transfer_seconds).await?);
            let times = bench.requests(path, *requests).await?;
            if times.gave_up {
                bail!(
                    "{}: requests stopped working: {:?}",
                    path.label(),
                    times.failures
                );
            }
            entry.latency_rounds.push(times.latencies);
            for (error, n) in times.failures {
                *entry.failures.entry(error).or_default() += n;
            }
        }
    }
    let mut churn = BTreeMap::new();
    for (which, cloud, steady) in [
        (
            Edge::Own,
            &lab.cloud,
            own_vip(&echo_proxy, ECHO_SERVICE_PORT)?,
        ),
        (Edge::Haproxy, &haproxy_edge.client, haproxy_edge_echo),
    ] {
        progress(&format!(
            "{}: {} load balancers created one after another, steady requests to {steady}",
            which.label(),
            scale.churn
        ));
        let reloads_before = match which {
            Edge::Haproxy => Some(haproxy_edge.reloads().await?),
            Edge::Own => None,
        };
        let mut measured = edge::churn(which, cloud, &bench.client, &echo_lb, steady, scale.churn)
            .await
            .with_context(|| format!("load-balancer churn on the {}", which.label()))?;
        if let Some(before) = reloads_before {
            measured.reloads = Some(analysis::Reloads {
                before,
                after: haproxy_edge.reloads().await?,
            });
        }
        churn.insert(which, measured);
    }
    Ok(Measurements {
        churn,
        paths,
        transfer_seconds: scale.transfer_seconds,
        rounds: request_chunks.len(),
        requests: scale.requests,
        load_before,
        load_after: load_average(),
        haproxy_version,
    })
}

/// Where each path's traffic goes, from the outside client.
struct Bench {
    client: Netns,
    edge: Netns,
    /// The edge routes that make the pod reachable directly, by direct path (the reference
    /// paths only).
    pod_routes: BTreeMap<Path, String>,
    echo: BTreeMap<Path, SocketAddr>,
    iperf: BTreeMap<Path, SocketAddr>,
}

impl Bench {
    fn target(map: &BTreeMap<Path, SocketAddr>, path: Path) -> Result<SocketAddr> {
        map.get(&path)
            .copied()
            .with_context(|| format!("no target for {}", path.label()))
    }

    /// One iperf3 transfer over `path`, in bit/s.
    async fn throughput(&self, path: Path, seconds: u32) -> Result<f64> {
        let target = Self::target(&self.iperf, path)?;
        self.on_path(path, self.iperf3(target, seconds))
            .await
            .with_context(|| format!("iperf3 over the {}", path.label()))
    }

    /// `count` timed requests over `path`.
    async fn requests(&self, path: Path, count: u32) -> Result<probe::RequestTimes> {
        let target = Self::target(&self.echo, path)?;
        let client = self.client.clone();
        let timed = async move {
            tokio::task::spawn_blocking(move || {
                client.run_in_thread(move || probe::time_requests(target, count, REQUEST_TIMEOUT))
            })
            .await
            .context("the request thread panicked")?
            .context("running requests in the client namespace")
        };
        self.on_path(path, timed)
            .await
            .with_context(|| format!("requests over the {}", path.label()))
    }

    /// Runs `work`; for a direct path with the edge routing the pod to the node for just
    /// that long (the lab normally forbids reaching pods from outside).
    async fn on_path<T>(
        &self,
        path: Path,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let Some(route) = self.pod_routes.get(&path) else {
            return work.await;
        };
        self.edge_route("add", route).await?;
        let result = work.await;
        let removed = self.edge_route("del", route).await;
        let value = result?;
        removed?;
        Ok(value)
    }

    async fn edge_route(&self, verb: &str, route: &str) -> Result<()> {
        let mut argv = vec!["ip", "route", verb];
        argv.extend(route.split_whitespace());
        let out = self.edge.exec_async(&argv).await?;
        if !out.status.success() {
            bail!(
                "{} in the edge: {}",
                argv.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    async fn iperf3(&self, target: SocketAddr, seconds: u32) -> Result<f64> {
        let mut cmd = self.client.tokio_command("iperf3");
        cmd.args([
            "-c".to_owned(),
            target.ip().to_string(),
            "-p".to_owned(),
            target.port().to_string(),
            "-t".to_owned(),
            seconds.to_string(),
            "--connect-timeout".to_owned(),
            "3000".to_owned(),
            "-J".to_owned(),
        ])
        .stdin(Stdio::null());
        let bound = Duration::from_secs(u64::from(seconds) + 20);
        let out = tokio::time::timeout(bound, cmd.output())
            .await
            .with_context(|| format!("iperf3 to {target} still running after {bound:?}"))?
            .context("running iperf3 in the client namespace")?;
        analysis::iperf_throughput(&String::from_utf8_lossy(&out.stdout)).with_context(|| {
            format!(
                "iperf3 to {target} ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )
        })
    }

    /// Waits until `path` answers requests and carries a short transfer, bounded.
    async fn until_ready(&self, path: Path) -> Result<()> {
        let start = Instant::now();
        loop {
            let attempt = async {
                let times = self.requests(path, 20).await?;
                if !times.failures.is_empty() {
                    bail!("failed requests: {:?}", times.failures);
                }
                self.throughput(path, 1).await.map(drop)
            };
            match attempt.await {
                Ok(()) => return Ok(()),
                Err(e) if start.elapsed() > READY_BOUND => {
                    return Err(e.context(format!(
                        "the {} did not work within {READY_BOUND:?}",
                        path.label()
                    )));
                }
                Err(e) => {
                    tracing::debug!(path = path.label(), error = %format!("{e:#}"), "not ready yet")
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

async fn node_port(lab: &Lab, plan: &ServicePlan) -> Result<u16> {
    let service = lab.service(plan).await?;
    service
        .spec
        .and_then(|spec| spec.ports)
        .into_iter()
        .flatten()
        .find(|port| port.protocol.as_deref() == Some("TCP"))
        .and_then(|port| port.node_port)
        .and_then(|p| u16::try_from(p).ok())
        .with_context(|| format!("Service {} has no TCP nodePort", plan.name))
}

/// `iperf3 -s` in the pod, its output in `log`; returns once it listens.
async fn start_iperf_server(pod: &Netns, log: &FsPath) -> Result<ChildGuard> {
    let out = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = pod.command("iperf3");
    cmd.args(["-s", "-p", &IPERF_PORT.to_string(), "--forceflush"])
        .stdin(Stdio::null())
        .stdout(out.try_clone().context("duplicating the log file")?)
        .stderr(out);
    let mut guard = ChildGuard::spawn(cmd)?;
    let start = Instant::now();
    loop {
        let text = tokio::fs::read_to_string(log).await.unwrap_or_default();
        if text.contains("Server listening") {
            return Ok(guard);
        }
        if let Some(status) = guard.try_wait()? {
            bail!("iperf3 -s exited ({status}): {}", text.trim());
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("iperf3 -s did not listen within 10 s: {}", text.trim());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// haproxy in the foreground in the edge, on [`HAPROXY_IP`] (added to the edge's `lo`,
/// which goes with the lab); returns once `probe` accepts.
async fn start_haproxy(
    edge: &Netns,
    config: &str,
    run_dir: &FsPath,
    probe: SocketAddrV4,
) -> Result<ChildGuard> {
    let config_path: PathBuf = run_dir.join("haproxy.cfg");
    tokio::fs::write(&config_path, config)
        .await
        .with_context(|| format!("writing {}", config_path.display()))?;
    let address = format!("{HAPROXY_IP}/32");
    let out = edge
        .exec_async(["ip", "addr", "add", address.as_str(), "dev", "lo"])
        .await?;
    if !out.status.success() {
        bail!(
            "adding {address} to the edge: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let log = run_dir.join("logs").join("haproxy.log");
    let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = edge.command("haproxy");
    cmd.arg("-db")
        .arg("-f")
        .arg(&config_path)
        .stdin(Stdio::null())
        .stdout(out.try_clone().context("duplicating the log file")?)
        .stderr(out);
    let mut haproxy = ChildGuard::spawn(cmd)?;
    let start = Instant::now();
    loop {
        if let Some(status) = haproxy.try_wait()? {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            bail!("haproxy exited ({status}): {}", text.trim());
        }
        // The lab process lives in the control-plane namespace, which routes to the edge.
        if tokio::time::timeout(
            Duration::from_millis(500),
            tokio::net::TcpStream::connect(probe),
        )
        .await
        .is_ok_and(|connected| connected.is_ok())
        {
            return Ok(haproxy);
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("haproxy did not listen on {probe} within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|e| format!("unknown ({e})"))
}
