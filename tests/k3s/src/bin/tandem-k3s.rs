//! `tandem-k3s control-plane [-- CMD ARGS…]`: a real k3s control plane for the
//! end-to-end suites, around a command. `tandem-k3s cluster [--nodes N] [-- CMD ARGS…]`:
//! a real cluster of N nodes (a server and agents, `tandem_k3s::cluster`) on the lab's
//! node network, around a command run in the server node's network namespace.
//!
//! With a command, it runs it with `TANDEM_E2E_KUBECONFIG` and `KUBECONFIG` naming the
//! control plane (or the cluster), tears everything down (also on SIGINT/SIGTERM) and
//! exits with the command's status. Without one, it prints the kubeconfig (and, for a
//! cluster, how to reach it) and keeps everything until interrupted. Without a k3s binary
//! it says the suite is skipped and exits 0 without running the command: nothing reports
//! a pass it did not earn.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use tandem_k3s::K3S_ENV;
use tandem_k3s::cluster::{ClusterConfig, K3sCluster};
use tandem_k3s::control_plane::{ClusterFamilies, ControlPlane, ControlPlaneOptions, cidr_list};
use tandem_k3s::node::build_test_images;
use tandem_netlab::Topology;
use tokio::signal::unix::{SignalKind, signal};

/// The variable the end-to-end suites read a real API server's kubeconfig from.
const E2E_KUBECONFIG_ENV: &str = "TANDEM_E2E_KUBECONFIG";
/// How long the command gets to end after the signal that stops us is passed on.
const COMMAND_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Parser)]
#[command(name = "tandem-k3s", version, about = "A real k3s for the test suites")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A k3s control plane (API server, controller-manager, scheduler; no kubelet) in a
    /// network namespace, its API server relayed to 127.0.0.1 here.
    ControlPlane(ControlPlaneArgs),
    /// A real cluster: `k3s server` on node 1 and `k3s agent` on the others, each a kubelet
    /// with containerd and runc pods in the lab topology's node namespaces, with its outside
    /// clients; the test images (pause, busybox echo) imported on every node.
    Cluster(ClusterArgs),
}

#[derive(Debug, clap::Args)]
struct ClusterArgs {
    /// The k3s binary (any release); unset: nothing runs.
    #[arg(long, env = K3S_ENV)]
    k3s: Option<PathBuf>,
    /// Nodes, the server's included.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=9))]
    nodes: u8,
    /// More docker archives every node imports (e.g. the chart's images).
    #[arg(long = "image")]
    images: Vec<PathBuf>,
    /// More `k3s server` arguments, e.g. `--disable-kube-proxy` (the agents follow).
    #[arg(long = "server-arg", allow_hyphen_values = true)]
    server_args: Vec<String>,
    /// Where the nodes keep their data and logs.
    #[arg(long, default_value = "/var/tmp/tandem-k3s-cluster")]
    dir: PathBuf,
    /// The command to run in the server node's network namespace; without one, keep the
    /// cluster up until interrupted.
    #[arg(last = true)]
    command: Vec<String>,
}

#[derive(Debug, clap::Args)]
struct ControlPlaneArgs {
    /// The k3s binary (any release); unset: the real-cluster suite is skipped.
    #[arg(long, env = K3S_ENV)]
    k3s: Option<PathBuf>,
    /// Seconds k3s may take to become ready.
    #[arg(long, env = "TANDEM_K3S_READY_TIMEOUT", default_value_t = 120)]
    ready_timeout: u64,
    /// The API server's --feature-gates; default: the gates the suites need on the
    /// binary's Kubernetes version (a dual-stack cluster's gate is added either way).
    #[arg(long, env = "TANDEM_K3S_FEATURE_GATES")]
    feature_gates: Option<String>,
    /// The cluster's IP families: `dual` adds an IPv6 cluster CIDR and Service CIDR to the
    /// IPv4 ones, IPv4 staying primary (the ready message names the Service CIDRs).
    #[arg(long, env = "TANDEM_K3S_IP_FAMILY", value_enum, default_value_t)]
    ip_family: ClusterFamilies,
    /// The command to run against the control plane; without one, keep it up until
    /// interrupted.
    #[arg(last = true)]
    command: Vec<String>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // kube-client logs every refused /readyz probe of the start-up as an error.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_client=off")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tandem-k3s: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tandem-k3s: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::ControlPlane(args) => control_plane(args).await,
        Command::Cluster(args) => cluster(args).await,
    }
}

/// What ended the wait for the command (or for an interrupt).
enum Ended {
    Command(std::process::ExitStatus),
    Signal(SignalKind),
}

async fn control_plane(args: ControlPlaneArgs) -> Result<ExitCode> {
    let Some(k3s) = args.k3s else {
        println!("real-cluster suite skipped: {K3S_ENV} is not set");
        return Ok(ExitCode::SUCCESS);
    };
    if !k3s.is_file() {
        bail!("k3s binary {} ({K3S_ENV}) does not exist", k3s.display());
    }
    let options = ControlPlaneOptions {
        ready_timeout: Duration::from_secs(args.ready_timeout),
        feature_gates: args.feature_gates,
        ..ControlPlaneOptions::new(args.ip_family)
    };
    let mut interrupt = signal(SignalKind::interrupt()).context("handling SIGINT")?;
    let mut terminate = signal(SignalKind::terminate()).context("handling SIGTERM")?;
    let started = std::time::Instant::now();
    // An interrupt while starting drops the half-started control plane, which removes it.
    let plane = tokio::select! {
        plane = ControlPlane::start(&k3s, &options) => plane
            .with_context(|| format!("starting the k3s control plane from {}", k3s.display()))?,
        _ = interrupt.recv() => return Ok(ExitCode::from(130)),
        _ = terminate.recv() => return Ok(ExitCode::from(143)),
    };
    let (major, minor) = plane.version();
    eprintln!(
        "tandem-k3s: k3s v{major}.{minor} control plane ready in {:.1}s at https://{} \
         (namespace {}, service CIDRs {})",
        started.elapsed().as_secs_f64(),
        plane.api_addr(),
        plane.netns().name(),
        cidr_list(&options.service_cidrs)
    );
    let ended = if args.command.is_empty() {
        println!("export KUBECONFIG={}", plane.kubeconfig().display());
        println!("# Ctrl-C stops the control plane and removes everything.");
        tokio::select! {
            _ = interrupt.recv() => Ok(Ended::Signal(SignalKind::interrupt())),
            _ = terminate.recv() => Ok(Ended::Signal(SignalKind::terminate())),
        }
    } else {
        let (program, rest) = args.command.split_first().context("empty command")?;
        let mut command = std::process::Command::new(program);
        command
            .args(rest)
            .env(E2E_KUBECONFIG_ENV, plane.kubeconfig())
            .env("KUBECONFIG", plane.kubeconfig());
        run_command(command, &mut interrupt, &mut terminate).await
    };
    let failed = matches!(&ended, Ok(Ended::Command(status)) if !status.success());
    if failed {
        eprintln!(
            "--- last lines of the k3s log ---\n{}\n---",
            plane.log_tail(30)
        );
    }
    // Stopping waits for k3s to exit: off the runtime's worker threads.
    tokio::task::spawn_blocking(move || plane.stop())
        .await
        .context("stopping the control plane")?;
    Ok(match ended? {
        Ended::Command(status) => exit_code(status),
        Ended::Signal(kind) => {
            ExitCode::from(128u8.saturating_add(u8::try_from(kind.as_raw_value()).unwrap_or(0)))
        }
    })
}

async fn cluster(args: ClusterArgs) -> Result<ExitCode> {
    let Some(k3s) = args.k3s else {
        println!("real cluster skipped: {K3S_ENV} is not set");
        return Ok(ExitCode::SUCCESS);
    };
    if !k3s.is_file() {
        bail!("k3s binary {} ({K3S_ENV}) does not exist", k3s.display());
    }
    let mut interrupt = signal(SignalKind::interrupt()).context("handling SIGINT")?;
    let mut terminate = signal(SignalKind::terminate()).context("handling SIGTERM")?;
    let nodes = usize::from(args.nodes);
    let dir = args.dir.clone();
    // Blocking work (namespaces, k3s starting) off the runtime's worker threads. Whatever
    // started is removed when the values drop, also when starting fails.
    let started = tokio::task::spawn_blocking(move || -> Result<(Topology, K3sCluster)> {
        let mut images = build_test_images(&dir.join("images"))?;
        images.extend(args.images);
        let topology = tandem_k3s::cluster::topology(nodes)?;
        let (cluster, took) = K3sCluster::start(ClusterConfig {
            k3s,
            nodes: topology.nodes().to_vec(),
            bridge: "cni0".to_owned(),
            cluster_cidr: topology.pod_network().cidr(),
            service_cidr: tandem_k3s::SERVICE_CIDR.parse()?,
            images,
            server_args: args.server_args,
            kubelet_args: Vec::new(),
            base_dir: dir,
        })?;
        eprintln!("tandem-k3s: {nodes} nodes Ready in {took:.1?}");
        Ok((topology, cluster))
    });
    let (topology, cluster) = tokio::select! {
        started = started => started.context("starting the cluster")??,
        _ = interrupt.recv() => return Ok(ExitCode::from(130)),
        _ = terminate.recv() => return Ok(ExitCode::from(143)),
    };
    let server = cluster.server();
    let ended = if args.command.is_empty() {
        println!("# The API server answers inside the server node's namespace:");
        println!(
            "nsenter --net=/run/netns/{} kubectl --kubeconfig {} get nodes -o wide",
            server.netns().name(),
            server.kubeconfig().display()
        );
        println!(
            "# Outside clients: {} and {}. Ctrl-C stops the cluster and removes everything.",
            topology.client_in_range().netns.name(),
            topology.client_out_of_range().netns.name()
        );
        tokio::select! {
            _ = interrupt.recv() => Ok(Ended::Signal(SignalKind::interrupt())),
            _ = terminate.recv() => Ok(Ended::Signal(SignalKind::terminate())),
        }
    } else {
        let (program, rest) = args.command.split_first().context("empty command")?;
        let mut command = server.command(program);
        command
            .args(rest)
            .env(E2E_KUBECONFIG_ENV, server.kubeconfig());
        run_command(command, &mut interrupt, &mut terminate).await
    };
    tokio::task::spawn_blocking(move || {
        drop(cluster);
        drop(topology);
    })
    .await
    .context("stopping the cluster")?;
    Ok(match ended? {
        Ended::Command(status) => exit_code(status),
        Ended::Signal(kind) => {
            ExitCode::from(128u8.saturating_add(u8::try_from(kind.as_raw_value()).unwrap_or(0)))
        }
    })
}

/// Runs `command`; a signal to us is passed on to it.
async fn run_command(
    command: std::process::Command,
    interrupt: &mut tokio::signal::unix::Signal,
    terminate: &mut tokio::signal::unix::Signal,
) -> Result<Ended> {
    let program = command.get_program().to_string_lossy().into_owned();
    let mut child = tokio::process::Command::from(command)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {program}"))?;
    let received = tokio::select! {
        status = child.wait() => {
            return Ok(Ended::Command(status.with_context(|| format!("waiting for {program}"))?));
        }
        _ = interrupt.recv() => SignalKind::interrupt(),
        _ = terminate.recv() => SignalKind::terminate(),
    };
    if let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) {
        let forwarded = nix::sys::signal::Signal::try_from(received.as_raw_value())
            .unwrap_or(nix::sys::signal::Signal::SIGTERM);
        // It may have ended already: nothing to pass on then.
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), forwarded);
    }
    if tokio::time::timeout(COMMAND_GRACE, child.wait())
        .await
        .is_err()
    {
        eprintln!("tandem-k3s: {program} did not end within {COMMAND_GRACE:?}; killing it");
    }
    Ok(Ended::Signal(received))
}

/// The command's exit status as ours (128 + signal when a signal ended it).
fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        (None, Some(signal)) => {
            ExitCode::from(128u8.saturating_add(u8::try_from(signal).unwrap_or(0)))
        }
        (None, None) => ExitCode::FAILURE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cli_definition_is_valid() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn the_command_follows_the_double_dash() {
        let cli = Cli::try_parse_from([
            "tandem-k3s",
            "control-plane",
            "--k3s",
            "/opt/k3s",
            "--",
            "cargo",
            "test",
            "--",
            "--test-threads=1",
        ])
        .unwrap();
        let Command::ControlPlane(args) = cli.command else {
            panic!("not control-plane");
        };
        assert_eq!(args.k3s.as_deref(), Some(std::path::Path::new("/opt/k3s")));
        assert_eq!(args.ip_family, ClusterFamilies::Ipv4);
        assert_eq!(args.command, ["cargo", "test", "--", "--test-threads=1"]);
    }

    #[test]
    fn a_cluster_takes_its_nodes_server_arguments_and_command() {
        let cli = Cli::try_parse_from([
            "tandem-k3s",
            "cluster",
            "--nodes",
            "4",
            "--server-arg",
            "--disable-kube-proxy",
            "--",
            "kubectl",
            "get",
            "nodes",
        ])
        .unwrap();
        let Command::Cluster(args) = cli.command else {
            panic!("not cluster");
        };
        assert_eq!(args.nodes, 4);
        assert_eq!(args.server_args, ["--disable-kube-proxy"]);
        assert_eq!(args.command, ["kubectl", "get", "nodes"]);
        assert!(Cli::try_parse_from(["tandem-k3s", "cluster", "--nodes", "0"]).is_err());
    }

    #[test]
    fn the_ip_family_picks_a_dual_stack_cluster() {
        let cli =
            Cli::try_parse_from(["tandem-k3s", "control-plane", "--ip-family", "dual"]).unwrap();
        let Command::ControlPlane(args) = cli.command else {
            panic!("not control-plane");
        };
        assert_eq!(args.ip_family, ClusterFamilies::Dual);
        assert!(
            Cli::try_parse_from(["tandem-k3s", "control-plane", "--ip-family", "ipv5"]).is_err()
        );
    }
}
