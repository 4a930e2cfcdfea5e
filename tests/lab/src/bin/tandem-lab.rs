//! `tandem-lab`: a virtual cluster with a LoadBalancer Service reachable from an outside
//! client, through the cloud's load balancer and the node proxy.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tandem_common::ProxyMode;
use tandem_lab::edges::Announce;
use tandem_lab::images::Images;
use tandem_lab::lab::{EdgeDataPlane, Lab, LabOptions};
use tandem_lab::report;
use tandem_lab::scenario::{LbMode, ServicePlan};
use tandem_netlab::addr;
use tandem_netlab::{ClusterFamilies, Host, IpFamily, Node, PodNetwork};

#[derive(Parser, Debug)]
#[command(
    name = "tandem-lab",
    version,
    about = "Tandem's lab: LoadBalancer Services on a virtual cluster of network namespaces"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Nodes in the virtual cluster (pods run on the first two).
    #[arg(long, global = true, env = "TANDEM_LAB_NODES", default_value_t = 3)]
    nodes: usize,
    /// Run against this real API server (its kubeconfig) instead of the stand-in: it is
    /// relayed into the lab, the lab registers its Nodes there and removes what it wrote.
    #[arg(long, global = true, env = "TANDEM_LAB_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// The cluster's pod CIDR: node N's pods get its N-th /24, and the Nodes are registered
    /// with that podCIDR. With --kubeconfig it must lie inside the API server's cluster CIDR
    /// (kube-controller-manager's --cluster-cidr): its node-IPAM controller refuses Nodes
    /// whose podCIDR is outside it. A /16 or wider.
    #[arg(long, global = true, env = "TANDEM_LAB_POD_CIDR", default_value_t = PodNetwork::DEFAULT)]
    pod_cidr: PodNetwork,
    /// Run the mock cloud, the controller and the node proxies as podman containers from
    /// the images `scripts/images.sh` built, tagged REGISTRY/NAME:VERSION.
    #[arg(
        long,
        global = true,
        env = "TANDEM_LAB_IMAGES",
        value_name = "REGISTRY"
    )]
    images: Option<String>,
    /// The node proxies' data path: kube-proxy v1.21's iptables chains, or one nftables
    /// table (`ip tandem`) written through netlink.
    #[arg(long, global = true, env = "TANDEM_LAB_PROXY_MODE", value_enum, default_value_t = ProxyMode::Iptables)]
    proxy_mode: ProxyMode,
    /// What serves the cloud edge's proxy-mode load balancers: the mock cloud's own
    /// listeners, or a real HAProxy it drives (TCP only; needs Debian's haproxy).
    #[arg(long, global = true, env = "TANDEM_LAB_EDGE_DATAPLANE", value_enum, default_value_t = EdgeDataPlane::Proxy)]
    edge_dataplane: EdgeDataPlane,
    /// The cluster's IP families: `ipv6` and `dual` give every link, node, pod and client
    /// an IPv6 address too, register the Nodes with an InternalIP and a pod CIDR per family,
    /// give the stand-in a Service CIDR per family, the cloud's pools IPv6 addresses and the
    /// node proxies a proxier per family. With `dual` the demo's Services are dual-stack.
    #[arg(long, global = true, env = "TANDEM_LAB_IP_FAMILY", value_enum, default_value_t = ClusterFamilies::Ipv4)]
    ip_family: ClusterFamilies,
    /// Cloud edges. More than one make an edge cluster behind a router (BIRD): a 3-member
    /// etcd holds their state and every edge serves the API and the VIPs (IPv4 only;
    /// needs Debian's etcd-server, bird2 and arping).
    #[arg(long, global = true, env = "TANDEM_LAB_EDGES", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=addr::MAX_EDGES as i64))]
    edges: u16,
    /// How an edge cluster announces its VIPs to the router: BGP with BFD from every edge
    /// (ECMP), or one owner per VIP answering ARP (l2).
    #[arg(long, global = true, env = "TANDEM_LAB_ANNOUNCE", value_enum, default_value_t = Announce::Bgp)]
    announce: Announce,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Build the lab, show a LoadBalancer Service working in both LB modes, tear it down.
    Demo,
    /// Build the lab and keep it running in the background (see `status`, `down`).
    Up,
    /// Stop a lab started with `up`.
    Down,
    /// Show the lab started with `up` and the commands to poke at it.
    Status,
    /// The background process behind `up` (not for direct use).
    #[command(hide = true)]
    Serve,
}

/// What `up` leaves for `status` and `down`.
#[derive(Debug, Serialize, Deserialize)]
struct LabState {
    pid: u32,
    prefix: String,
    run_dir: PathBuf,
    kubeconfig: PathBuf,
    control_plane: String,
    client_in_range: String,
    client_out_of_range: String,
    nodes: Vec<String>,
    /// The edges' namespaces: one, or an edge cluster's.
    edges: Vec<String>,
    /// The router's namespace in front of an edge cluster.
    router: Option<String>,
    /// An edge cluster's etcd members' namespaces.
    etcd: Vec<String>,
    /// (name, its ingress addresses comma-separated)
    services: Vec<(String, String)>,
}

const STATE_FILE: &str = "/run/tandem-lab.json";

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    match cli.command {
        Command::Demo => with_lab(&cli, |lab| Box::pin(demo(lab))),
        Command::Serve => {
            // `down` ends a served lab with SIGTERM: that is its normal end.
            let served = with_lab(&cli, |lab| Box::pin(serve(lab)));
            let _ = std::fs::remove_file(STATE_FILE);
            match served {
                Err(e) if e.is::<Interrupted>() => Ok(()),
                other => other,
            }
        }
        Command::Up => up(&cli),
        Command::Down => down(),
        Command::Status => status(),
    }
}

fn require_root() -> Result<()> {
    if !nix::unistd::Uid::effective().is_root() {
        bail!("the lab creates network namespaces: run it as root (sudo)");
    }
    Ok(())
}

/// The programs a lab of these options runs, with the Debian package of each: all the
/// missing ones are named before anything is built, not one at a time halfway through.
fn require_programs(cli: &Cli) -> Result<()> {
    let mut needed = vec![("ip", "iproute2"), ("conntrack", "conntrack")];
    if cli.images.is_none() {
        // The node proxies run on the host, with its iptables (in nftables mode too: they
        // remove the iptables mode's rules); from images they bring their own.
        needed.push(("iptables-restore", "iptables"));
        if cli.ip_family != ClusterFamilies::Ipv4 {
            needed.push(("ip6tables-restore", "iptables"));
        }
        if cli.edge_dataplane == EdgeDataPlane::Haproxy {
            needed.push(("haproxy", "haproxy"));
        }
    } else {
        needed.push(("podman", "podman"));
    }
    if matches!(cli.command, Command::Demo) {
        needed.push(("kubectl", "kubectl"));
    }
    if cli.edges > 1 {
        // The edge cluster's own processes run on the host, from images too.
        needed.extend([("etcd", "etcd-server"), ("nft", "nftables")]);
        needed.push(match cli.announce {
            Announce::Bgp => ("bird", "bird2"),
            Announce::L2 => ("arping", "arping"),
        });
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let missing: Vec<_> = needed
        .into_iter()
        .filter(|(program, _)| !std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
        .collect();
    if !missing.is_empty() {
        let programs: Vec<_> = missing.iter().map(|(program, _)| *program).collect();
        let mut packages: Vec<_> = missing.iter().map(|(_, package)| *package).collect();
        packages.sort_unstable();
        packages.dedup();
        bail!(
            "the lab runs programs that are not on PATH: {} (Debian: apt-get install {})",
            programs.join(", "),
            packages.join(" ")
        );
    }
    Ok(())
}

type LabFuture<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + 'a>>;

/// Builds the lab, runs `body` on it, and tears it down (also when `body` fails).
fn with_lab(cli: &Cli, body: impl for<'a> FnOnce(&'a mut Lab) -> LabFuture<'a>) -> Result<()> {
    require_root()?;
    require_programs(cli)?;
    let start = Instant::now();
    let progress = move |what: &str| println!("[{:>5.1}s] {what}", start.elapsed().as_secs_f64());
    let options = LabOptions {
        nodes: cli.nodes,
        pods_per_node: pods_per_node(cli.nodes),
        api_server: cli.kubeconfig.clone(),
        pod_network: cli.pod_cidr,
        images: cli.images.clone().map(Images::new),
        proxy_mode: cli.proxy_mode,
        edge_dataplane: cli.edge_dataplane,
        ip_family: cli.ip_family,
        edges: usize::from(cli.edges),
        announce: cli.announce,
        ..LabOptions::default()
    };
    progress("building the virtual cluster (network namespaces, bridges, veth pairs, pods)");
    let prepared = Lab::prepare(&options)?;
    // The runtime is built after entering the control-plane namespace: its threads are there.
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        let mut lab = tokio::select! {
            lab = Lab::start(prepared, options, &progress) => lab?,
            signal = tandem_common::shutdown_signal() => return Err(Interrupted(signal).into()),
        };
        let result = tokio::select! {
            result = body(&mut lab) => result,
            signal = tandem_common::shutdown_signal() => Err(Interrupted(signal).into()),
        };
        progress("tearing down: stopping processes, removing namespaces");
        lab.keep_run_dir = result.is_err();
        let shutdown = lab.shutdown().await;
        result.and(shutdown)
    })
}

#[derive(Debug, thiserror::Error)]
#[error("interrupted by {0}")]
struct Interrupted(&'static str);

fn pods_per_node(nodes: usize) -> Vec<u32> {
    (0..nodes).map(|i| if i < 2 { 2 } else { 0 }).collect()
}

async fn demo(lab: &mut Lab) -> Result<()> {
    let all_pods: Vec<String> = lab.topology.pods().iter().map(|p| p.name.clone()).collect();
    let client = lab.topology.client_in_range().clone();
    let outsider = lab.topology.client_out_of_range().clone();
    let node = lab.topology.nodes()[0].clone();
    let families = lab.ip_family.families();

    section("1. proxy mode: the cloud proxies VIP:80 to nodeIP:nodePort; nodes DNAT to pods");
    let mut proxy = ServicePlan::new("web", LbMode::Proxy);
    proxy.pods = all_pods.clone();
    in_every_family(&mut proxy, lab.ip_family);
    lab.create_service(&proxy).await?;
    let vips = lab
        .wait_for_ingresses(&proxy, families.len(), Duration::from_secs(60))
        .await?;
    show_service_and_lb(lab, &proxy).await?;
    for &vip in &vips {
        let from = address(&client, vip)?;
        let target = SocketAddr::new(vip, proxy.port);
        let http = lab.http_requests(&client, vip, proxy.port, 60).await?;
        show_spread(&format!("60 HTTP requests from {from} to {target}"), &http);
        if lab.serves_udp(LbMode::Proxy) {
            let udp = lab.udp_requests(&client, vip, proxy.port, 20).await?;
            show_spread(&format!("20 UDP requests from {from} to {target}"), &udp);
        } else {
            println!(
                "(no UDP in proxy mode: the {} edge proxies TCP only)",
                lab.edge_dataplane.as_str()
            );
        }
    }
    let node_port =
        node_port(&lab.service(&proxy).await?).context("the Service has no nodePort")?;
    let family = families[0];
    let node_ip = node
        .ip_of(family)
        .context("the node has no address of the family")?;
    let title = format!(
        "a request from the cloud to {}",
        SocketAddr::new(node_ip, node_port)
    );
    show_trace(lab, &node, &title, edge_ip(lab, family), node_ip, node_port).await?;

    section("2. passthrough mode: the cloud routes the VIP to nodes; nodes take it with KUBE-FW");
    let mut direct = ServicePlan::new("web-direct", LbMode::Passthrough);
    direct.pods = all_pods;
    in_every_family(&mut direct, lab.ip_family);
    direct.source_ranges = families
        .iter()
        .map(|family| match family {
            IpFamily::V4 => addr::CLIENT_NETWORK_IN_RANGE.to_string(),
            IpFamily::V6 => addr::v6::CLIENT_NETWORK_IN_RANGE.to_string(),
        })
        .collect();
    lab.create_service(&direct).await?;
    let vips = lab
        .wait_for_ingresses(&direct, families.len(), Duration::from_secs(60))
        .await?;
    show_service_and_lb(lab, &direct).await?;
    for &vip in &vips {
        let target = SocketAddr::new(vip, direct.port);
        let (from, outside) = (address(&client, vip)?, address(&outsider, vip)?);
        let allowed = lab.http_requests(&client, vip, direct.port, 40).await?;
        show_spread(
            &format!("40 HTTP requests from {from} to {target} (inside loadBalancerSourceRanges)"),
            &allowed,
        );
        let denied = lab.http_requests(&outsider, vip, direct.port, 5).await?;
        show_spread(
            &format!(
                "5 HTTP requests from {outside} to {target} (outside loadBalancerSourceRanges)"
            ),
            &denied,
        );
        show_trace(lab, &node, "the allowed client", from, vip, direct.port).await?;
        show_trace(
            lab,
            &node,
            "the client outside the source ranges",
            outside,
            vip,
            direct.port,
        )
        .await?;
    }
    Ok(())
}

/// On a dual-stack lab the demo's Services ask for both families (a VIP each).
fn in_every_family(plan: &mut ServicePlan, families: ClusterFamilies) {
    if families == ClusterFamilies::Dual {
        plan.ip_family_policy = Some("RequireDualStack".to_owned());
    }
}

/// The client's address of the VIP's family: where its requests come from.
fn address(client: &Host, vip: IpAddr) -> Result<IpAddr> {
    client
        .ip_of(IpFamily::of(vip))
        .with_context(|| format!("the client has no address of {vip}'s family"))
}

/// The cloud edge's address on the node network: where proxied requests come from.
fn edge_ip(lab: &Lab, family: IpFamily) -> IpAddr {
    match family {
        IpFamily::V4 => lab.topology.edge().node_network_ip.into(),
        IpFamily::V6 => addr::v6::EDGE_NODE_IP.into(),
    }
}

fn show_spread(title: &str, spread: &tandem_lab::scenario::Spread) {
    println!("{}", report::spread(title, spread));
}

async fn show_trace(
    lab: &Lab,
    node: &Node,
    title: &str,
    src: IpAddr,
    dst: IpAddr,
    port: u16,
) -> Result<()> {
    let rules = match (lab.proxy_mode, IpFamily::of(dst)) {
        (ProxyMode::Iptables, IpFamily::V4) => "KUBE-* chains",
        (ProxyMode::Iptables, IpFamily::V6) => "KUBE-* chains (ip6tables)",
        (ProxyMode::Nftables, IpFamily::V4) => "table ip tandem",
        (ProxyMode::Nftables, IpFamily::V6) => "table ip6 tandem",
    };
    println!(
        "{rules} on {} for {title} (tandem-nodeproxy trace):",
        node.name
    );
    println!(
        "{}",
        report::condensed_trace(&lab.trace(node, src, dst, port).await?)
    );
    Ok(())
}

async fn show_service_and_lb(lab: &Lab, plan: &ServicePlan) -> Result<()> {
    println!("$ kubectl get svc {}", plan.name);
    let out = lab
        .topology
        .control_plane()
        .netns
        .exec_async([
            "kubectl",
            "--kubeconfig",
            &lab.kubeconfig.to_string_lossy(),
            "get",
            "svc",
            &plan.name,
        ])
        .await?;
    print!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let svc = lab.service(plan).await?;
    let id = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("service.beta.kubernetes.io/mockcloud-load-balancer-id"))
        .context("the controller wrote no load-balancer id annotation")?;
    let lb = lab
        .cloud
        .families()
        .get_load_balancer(id)
        .await
        .map_err(|e| anyhow::anyhow!("reading {id} from the cloud: {e}"))?;
    println!("the load balancer in the cloud ({}):", lab.cloud_url);
    println!("{}", report::load_balancer(&lb));
    Ok(())
}

fn node_port(svc: &k8s_openapi::api::core::v1::Service) -> Option<u16> {
    let port = svc
        .spec
        .as_ref()?
        .ports
        .as_ref()?
        .iter()
        .find(|p| p.protocol.as_deref() == Some("TCP"))?;
    u16::try_from(port.node_port?).ok()
}

fn section(title: &str) {
    println!("\n=== {title}\n");
}

async fn serve(lab: &mut Lab) -> Result<()> {
    let mut plan = ServicePlan::new("web", LbMode::Proxy);
    plan.pods = lab.topology.pods().iter().map(|p| p.name.clone()).collect();
    in_every_family(&mut plan, lab.ip_family);
    lab.create_service(&plan).await?;
    let vips = lab
        .wait_for_ingresses(
            &plan,
            lab.ip_family.families().len(),
            Duration::from_secs(60),
        )
        .await
        .unwrap_or_default();
    let state = LabState {
        pid: std::process::id(),
        prefix: lab.topology.prefix().to_owned(),
        run_dir: lab.run_dir.clone(),
        kubeconfig: lab.kubeconfig.clone(),
        control_plane: lab.topology.control_plane().netns.name().to_owned(),
        client_in_range: lab.topology.client_in_range().netns.name().to_owned(),
        client_out_of_range: lab.topology.client_out_of_range().netns.name().to_owned(),
        nodes: lab
            .topology
            .nodes()
            .iter()
            .map(|n| n.netns.name().to_owned())
            .collect(),
        edges: names(lab.topology.edges().iter().map(|e| &e.netns)),
        router: lab.topology.router().map(|r| r.netns.name().to_owned()),
        etcd: names(lab.topology.etcd().iter().map(|m| &m.netns)),
        services: vec![(
            plan.name.clone(),
            vips.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
        )],
    };
    std::fs::write(STATE_FILE, serde_json::to_vec_pretty(&state)?)
        .context("writing the lab state file")?;
    // Runs until `down` (SIGTERM) or Ctrl-C; with_lab tears the lab down.
    std::future::pending().await
}

fn names<'a>(namespaces: impl Iterator<Item = &'a tandem_netlab::Netns>) -> Vec<String> {
    namespaces.map(|n| n.name().to_owned()).collect()
}

fn read_state() -> Result<LabState> {
    let bytes = std::fs::read(STATE_FILE).with_context(|| {
        format!("no running lab ({STATE_FILE} missing): start one with `tandem-lab up`")
    })?;
    serde_json::from_slice(&bytes).context("reading the lab state")
}

fn up(cli: &Cli) -> Result<()> {
    require_root()?;
    require_programs(cli)?;
    if let Ok(state) = read_state() {
        if kill(Pid::from_raw(state.pid as i32), None).is_ok() {
            bail!(
                "a lab is already running (pid {}); `tandem-lab down` stops it",
                state.pid
            );
        }
        let _ = std::fs::remove_file(STATE_FILE);
    }
    let exe = std::env::current_exe()?;
    let log = std::env::temp_dir().join("tandem-lab-up.log");
    let out = std::fs::File::create(&log)?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["serve", "--nodes", &cli.nodes.to_string()]);
    cmd.arg("--pod-cidr").arg(cli.pod_cidr.to_string());
    cmd.arg("--proxy-mode").arg(cli.proxy_mode.as_str());
    cmd.arg("--edge-dataplane").arg(cli.edge_dataplane.as_str());
    cmd.arg("--edges").arg(cli.edges.to_string());
    cmd.arg("--announce").arg(cli.announce.as_str());
    if let Some(family) = cli.ip_family.to_possible_value() {
        cmd.arg("--ip-family").arg(family.get_name());
    }
    if let Some(kubeconfig) = &cli.kubeconfig {
        cmd.arg("--kubeconfig").arg(kubeconfig);
    }
    if let Some(registry) = &cli.images {
        cmd.arg("--images").arg(registry);
    }
    cmd.stdin(std::process::Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().context("starting the lab in the background")?;
    println!(
        "starting the lab in the background (progress in {})",
        log.display()
    );
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(180) {
        if let Some(status) = child.try_wait()? {
            bail!(
                "the lab failed to start ({status}):\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        if let Ok(state) = read_state() {
            print_usage(&state);
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    bail!(
        "the lab did not come up within 180 s; see {}",
        log.display()
    )
}

fn down() -> Result<()> {
    let state = read_state()?;
    let pid = Pid::from_raw(state.pid as i32);
    kill(pid, Signal::SIGTERM).with_context(|| format!("stopping the lab (pid {})", state.pid))?;
    let start = Instant::now();
    while kill(pid, None).is_ok() && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(200));
    }
    println!("lab {} stopped; namespaces removed", state.prefix);
    Ok(())
}

fn status() -> Result<()> {
    let state = read_state()?;
    let alive = kill(Pid::from_raw(state.pid as i32), None).is_ok();
    println!(
        "lab {} (pid {}, {})",
        state.prefix,
        state.pid,
        if alive { "running" } else { "NOT running" }
    );
    print_usage(&state);
    Ok(())
}

fn print_usage(state: &LabState) {
    let kc = state.kubeconfig.display();
    println!(
        "\nThe lab is up. Everything runs in network namespaces named {}*:",
        state.prefix
    );
    for (name, vip) in &state.services {
        println!("  Service default/{name}, LoadBalancer ingress {vip}");
    }
    println!("  edges: {}", state.edges.join(", "));
    if let Some(router) = &state.router {
        println!("  router: {router}; etcd: {}", state.etcd.join(", "));
        println!("the router's routes to the VIPs (ECMP over the edges):");
        println!("  ip -n {router} route show root 198.51.100.0/24");
        println!(
            "  birdc -s {} show protocols",
            state.run_dir.join("bird-router.ctl").display()
        );
    }
    println!("\nkubectl (from the control-plane namespace):");
    println!(
        "  ip netns exec {} kubectl --kubeconfig {kc} get svc,nodes",
        state.control_plane
    );
    println!(
        "  ip netns exec {} kubectl --kubeconfig {kc} create service loadbalancer mine --tcp=80:8080",
        state.control_plane
    );
    if let Some((_, vips)) = state.services.first() {
        println!("a request from the outside client (inside the source ranges):");
        let echo = tandem_lab::binaries::locate("tandem-echo")
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "tandem-echo".to_owned());
        for vip in vips.split(',').filter_map(|vip| vip.parse::<IpAddr>().ok()) {
            println!(
                "  ip netns exec {} {echo} get http://{}/",
                state.client_in_range,
                SocketAddr::new(vip, 80)
            );
        }
    }
    println!("the node proxy's rules on a node:");
    if let Some(node) = state.nodes.first() {
        println!("  ip netns exec {node} iptables -t nat -S | grep KUBE-");
    }
    println!("logs: {}/logs", state.run_dir.display());
    println!("stop it: tandem-lab down");
}
