//! Fresh network namespaces for kernel tests (root only), and helpers to read iptables in
//! them. Each test body runs on its own thread that has entered the namespace, so every
//! process it spawns (iptables, conntrack) acts inside the namespace only.

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs::File;
use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use nix::sched::{CloneFlags, setns};
use tandem_common::{IpFamily, Protocol};
use tandem_nodeproxy::datapath::iptables::backend::Backend;
use tandem_proxy_rules::model::{
    Endpoint, IpMode, LoadBalancerIngress, NodeConfig, ProxyState, ServicePort, ServicePortName,
};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A network namespace named `tdm<pid>-<n>`, deleted on drop (also when a test panics).
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new() -> Self {
        let name = format!(
            "tdm{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let status = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap();
        assert!(status.success(), "ip netns add {name}");
        Self { name }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// The backends whose binaries exist on this machine.
pub fn backends() -> Vec<Backend> {
    [Backend::Nft, Backend::Legacy]
        .into_iter()
        .filter(|b| Command::new(b.iptables()).arg("--version").output().is_ok())
        .collect()
}

/// True when running as root (kernel tests are skipped otherwise, with a message).
pub fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// Run `body` on a new thread inside a fresh namespace with a current-thread tokio
/// runtime; the namespace is deleted afterwards, a panic in `body` fails the caller.
pub fn in_fresh_netns<F, Fut>(body: F)
where
    F: FnOnce(String) -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let netns = Netns::new();
    let name = netns.name.clone();
    let joined = std::thread::spawn(move || {
        let file = File::open(format!("/run/netns/{name}")).unwrap();
        setns(&file, CloneFlags::CLONE_NEWNET).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(body(name));
    })
    .join();
    drop(netns);
    if let Err(panic) = joined {
        std::panic::resume_unwind(panic);
    }
}

/// Run an iptables-family command in the current namespace; panics on failure.
pub fn run(program: &str, args: &[&str]) -> String {
    let output = Command::new(program).args(args).output().unwrap();
    assert!(
        output.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// `iptables-save -t TABLE` without comments and counters, so two kernels' outputs compare.
pub fn save(backend: Backend, table: &str) -> String {
    normalize(&run(backend.save(), &["-t", table]))
}

pub fn normalize(save: &str) -> String {
    save.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match (l.starts_with(':'), l.rfind(" [")) {
            (true, Some(i)) => &l[..i],
            _ => l,
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Lines of a save output that mention a chain.
pub fn lines_with(save: &str, needle: &str) -> Vec<String> {
    save.lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}

pub fn node() -> NodeConfig {
    node_named("node-a")
}

/// The node proxy's view of node `name` in the test cluster (pods in 10.244.0.0/16).
pub fn node_named(name: &str) -> NodeConfig {
    NodeConfig::new(name, Some("10.244.0.0/16".parse().unwrap()))
}

pub fn spn(namespace: &str, name: &str, port: &str) -> ServicePortName {
    ServicePortName {
        namespace: namespace.into(),
        name: name.into(),
        port: port.into(),
    }
}

pub fn endpoint(ip: [u8; 4], port: u16, node: &str) -> Endpoint {
    Endpoint {
        ip: Ipv4Addr::from(ip).into(),
        port,
        ready: true,
        serving: true,
        terminating: false,
        node_name: Some(node.into()),
        hints: None,
    }
}

/// The API state of the kube-proxy reference dump (`nodeproxy/rules/tests/data/`):
/// default/kubernetes without endpoints and the nginx LoadBalancer Service with source
/// ranges and the given endpoints.
pub fn reference_state(endpoints: Vec<Endpoint>) -> ProxyState {
    let kubernetes = ServicePort {
        name: spn("default", "kubernetes", "https"),
        protocol: Protocol::Tcp,
        cluster_ip: Some(Ipv4Addr::new(10, 43, 0, 1).into()),
        port: 443,
        node_port: None,
        external_ips: vec![],
        load_balancer_ingress: vec![],
        load_balancer_source_ranges: vec![],
        session_affinity_timeout: None,
        external_traffic_policy_local: false,
        health_check_node_port: None,
        internal_traffic_policy_local: false,
    };
    let nginx = ServicePort {
        name: spn("default", "nginx-service", "http"),
        protocol: Protocol::Tcp,
        cluster_ip: Some(Ipv4Addr::new(10, 43, 35, 197).into()),
        port: 80,
        node_port: Some(30166),
        external_ips: vec![],
        load_balancer_ingress: vec![LoadBalancerIngress {
            ip: Ipv4Addr::new(198, 51, 100, 20).into(),
            ip_mode: IpMode::Vip,
        }],
        load_balancer_source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
        session_affinity_timeout: None,
        external_traffic_policy_local: false,
        health_check_node_port: None,
        internal_traffic_policy_local: false,
    };
    let nginx_endpoints = (nginx.name.clone(), endpoints);
    ProxyState::from_entries(IpFamily::V4, [kubernetes, nginx], [nginx_endpoints])
}

pub fn reference_endpoints() -> Vec<Endpoint> {
    vec![
        endpoint([10, 244, 1, 5], 80, "node-a"),
        endpoint([10, 244, 2, 7], 80, "node-b"),
    ]
}

/// What the kubelet v1.21 writes at start (`tests/data/`, with a note on its source).
pub const KUBELET_V1_21: &str = include_str!("../data/kubelet-v1.21.iptables");

/// The counters every kubelet rule is loaded with: a rule flushed and written again, even
/// with the same text, comes back with zero counters, so a rewrite shows in the comparison.
const KUBELET_COUNTERS: &str = "[7:420]";

/// Loads the kubelet v1.21's chains into the current namespace's `backend`, as the kubelet
/// leaves them, each rule with [`KUBELET_COUNTERS`].
pub fn install_kubelet_chains(backend: Backend) {
    use std::io::Write as _;
    let text: String = KUBELET_V1_21
        .lines()
        .map(|line| match line.starts_with("-A ") {
            true => format!("{KUBELET_COUNTERS} {line}\n"),
            false => format!("{line}\n"),
        })
        .collect();
    let mut child = Command::new(backend.restore())
        .args(["--noflush", "--counters"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    assert!(
        child.wait().unwrap().success(),
        "loading the kubelet's chains"
    );
}

/// Routes `dst` via `gateway` in `netns` (e.g. the edge sending an LB IP to a node
/// unchanged, as a passthrough load balancer does).
pub fn route_via(netns: &tandem_netlab::Netns, dst: Ipv4Addr, gateway: Ipv4Addr) {
    netns
        .exec_checked([
            "ip",
            "route",
            "add",
            &format!("{dst}/32"),
            "via",
            &gateway.to_string(),
        ])
        .unwrap_or_else(|e| panic!("route {dst} via {gateway} in {}: {e}", netns.name()));
}

/// `lines` without the packet and byte counters `iptables-save -c` puts before each rule:
/// for comparisons on a node that carries traffic meanwhile.
pub fn without_counters(lines: &str) -> String {
    lines
        .lines()
        .map(|line| {
            line.split_once("] ")
                .filter(|_| line.starts_with('['))
                .map_or(line, |(_, rule)| rule)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The kubelet's lines of `iptables-save -c` of mangle, filter and nat, as the kernel prints
/// them: the declarations of its chains, their rules and its jumps from the built-in chains,
/// with counters. A chain or rule of the kubelet that went, moved or was rewritten changes it.
pub fn kubelet_lines(backend: Backend) -> String {
    let mut out = String::new();
    for table in ["mangle", "filter", "nat"] {
        let (chains, jumps) = kubelet_fixture(table);
        let _ = writeln!(out, "*{table}");
        for line in run(backend.save(), &["-c", "-t", table]).lines() {
            let rule = line
                .split_once("] ")
                .filter(|_| line.starts_with('['))
                .map(|(_, rule)| rule);
            let keep = match (line.strip_prefix(':'), rule) {
                (Some(declaration), _) => declaration
                    .split_whitespace()
                    .next()
                    .is_some_and(|c| chains.contains(c)),
                (None, Some(rule)) => {
                    jumps.contains(rule)
                        || rule
                            .strip_prefix("-A ")
                            .and_then(|r| r.split_whitespace().next())
                            .is_some_and(|c| chains.contains(c))
                }
                (None, None) => false,
            };
            if keep {
                let _ = writeln!(out, "{line}");
            }
        }
    }
    out
}

/// The kubelet's chains in one table of the fixture, and its jumps from built-in chains.
fn kubelet_fixture(table: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut chains = BTreeSet::new();
    let mut rules = Vec::new();
    let mut in_table = false;
    for line in KUBELET_V1_21.lines() {
        if let Some(name) = line.strip_prefix('*') {
            in_table = name == table;
        } else if !in_table {
            continue;
        } else if let Some(declaration) = line.strip_prefix(':') {
            chains.extend(declaration.split_whitespace().next().map(str::to_owned));
        } else if line.starts_with("-A ") {
            rules.push(line.to_owned());
        }
    }
    // Rules of the kubelet's own chains are matched by their chain.
    let jumps = rules
        .into_iter()
        .filter(|line| {
            let chain = line.split_whitespace().nth(1).unwrap_or_default();
            !chains.contains(chain)
        })
        .collect();
    (chains, jumps)
}

/// Starts the node proxy binary against the API server of `kubeconfig` as node `node_name`,
/// with the health and metrics ports on 127.0.0.1 and the pod CIDR 10.244.0.0/16, plus
/// `extra` flags; killed when dropped.
pub fn start_node_proxy(
    kubeconfig: &str,
    node_name: &str,
    extra: &[&str],
) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem-nodeproxy"))
        .args(["--kubeconfig", kubeconfig, "--node-name", node_name])
        .args(["--cluster-cidr", "10.244.0.0/16"])
        .args(["--healthz-bind-address", "127.0.0.1:10256"])
        .args(["--metrics-bind-address", "127.0.0.1:10249"])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// Stops a node proxy with SIGTERM; it must exit cleanly within ten seconds.
pub async fn terminate(mut proxy: tokio::process::Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(proxy.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(10), proxy.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
}

/// A TCP server in a pod's namespace: each connection, with the client's address and the
/// pod's name, goes to `serve` on a thread of its own, until the server is dropped.
pub struct PodServer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl PodServer {
    /// Listens on `bind` (`0.0.0.0`, or `::` for both families) at `port`.
    pub fn start(
        pod: &tandem_netlab::Pod,
        bind: std::net::IpAddr,
        port: u16,
        serve: fn(std::net::TcpStream, std::net::SocketAddr, &str),
    ) -> Self {
        use std::sync::atomic::AtomicBool;
        let listener = pod
            .netns
            .run_in_thread(move || std::net::TcpListener::bind((bind, port)))
            .unwrap()
            .unwrap();
        listener.set_nonblocking(true).unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (name, stopped) = (pod.name.clone(), std::sync::Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let Ok((stream, peer)) = listener.accept() else {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    continue;
                };
                let name = name.clone();
                std::thread::spawn(move || {
                    stream.set_nonblocking(false).unwrap();
                    serve(stream, peer, &name);
                });
            }
        });
        Self { stop }
    }
}

impl Drop for PodServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Runs the future `body` makes to its end on a runtime of two threads inside `netns`.
pub fn block_on_in<F, Fut>(netns: &tandem_netlab::Netns, body: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    netns
        .run_in_thread(move || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap()
                .block_on(body())
        })
        .unwrap();
}

/// Starts the data path of `mode` on `node` with `config` (as the node proxy does:
/// removing the other mode's rules, setting route_localnet where it serves localhost node
/// ports) and syncs `state`; what it wrote then reads back without drift (no rewrite every
/// period).
pub fn program(
    node: &tandem_netlab::Node,
    mode: tandem_common::ProxyMode,
    config: NodeConfig,
    state: &ProxyState,
) {
    use prometheus_client::registry::Registry;
    use tandem_nodeproxy::datapath;
    use tandem_nodeproxy::datapath::iptables::backend::BackendChoice;
    use tandem_nodeproxy::metrics::Metrics;

    let state = state.clone();
    node.netns
        .run_in_thread(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let metrics = Metrics::register(&mut Registry::default());
                let mut path = datapath::start(mode, BackendChoice::Auto, config)
                    .await
                    .unwrap();
                let ports: BTreeSet<_> = state.services().keys().cloned().collect();
                path.update(&state, &ports);
                assert!(path.apply(&metrics).await, "{mode} sync failed");
                if path.wants_read_back() {
                    // iptables-nft takes its digests from the first read-back.
                    let read = path.start_read_back(None).await.unwrap();
                    path.take_read_back(read, &metrics);
                }
                let read = path.start_read_back(None).await.unwrap();
                assert_eq!(path.take_read_back(read, &metrics), 0, "{mode}: drift");
            });
        })
        .unwrap();
}
