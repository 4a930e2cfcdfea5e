//! A real cluster of three nodes (`tandem_k3s::cluster`): a k3s server and two k3s agents,
//! each a real kubelet with containerd and runc pods in a network namespace of its own on
//! one node network (tandem_netlab's topology: nodes 198.18.0.11-13, pod subnets
//! 10.244.1-3.0/24 routed to their nodes; outside client c1 at 203.0.113.10).
//!
//! What one node cannot show, with real pods placed on each node, checked for each proxy
//! on every node in turn: kube-proxy v1.21.2 (`TANDEM_KUBE_PROXY`, the reference; reported
//! skipped without it), then Tandem's node proxy in iptables mode, then in nftables mode,
//! each one cleaned away before the next:
//! - a pod on node 1 reaching a Service whose endpoints are on nodes 2 and 3 through its
//!   cluster IP, every endpoint answering, and seeing the client pod's own address (the
//!   source kept through a cluster IP from another node's pod, which upstream's e2e test
//!   skips on one node), and through the NodePort of node 3;
//! - hairpin on every node: a pod reaching a Service whose only endpoint is itself;
//! - `internalTrafficPolicy: Local`: a pod is served by its own node's endpoint only, and
//!   not at all where its node has none;
//! - `externalTrafficPolicy: Local` from outside: only the node with the endpoint answers
//!   its NodePort, with the client's own address, and the health check node port says
//!   which node has one (200) and which not (503).
//! - a node failing: node 3's cable cut while node 1 requests a Service with endpoints on
//!   nodes 2 and 3. The node lifecycle controller marks it NotReady after the grace
//!   configured here (12 s, heartbeats every 2 s), which takes its pod's endpoint out: the
//!   proxy must follow within 3 s, so that no request fails after that, and must take the
//!   endpoint back once the cable is mended, failing nothing then either.
//!
//! Then the chart on the same cluster, as a user installs it, with the mock cloud in the
//! topology's edge, and day-2 work under traffic through the edge (`chart.rs`).
//!
//! Needs root, `TANDEM_K3S` naming a k3s binary, the workspace's binaries built (`cargo
//! build --workspace --bins`), Debian's containerd (its runc shim), runc,
//! containernetworking-plugins, busybox-static, conntrack, iptables, nftables, curl,
//! buildah, podman and mmdebstrap (the images), python3-venv (Helm from its PyPI wheel).
//! Without `--ignored` it is reported skipped; asked for without `TANDEM_K3S`, it fails.
//!
//! Run: `TANDEM_K3S=/path/to/k3s cargo test -p tandem-k3s --test cluster -- --ignored --nocapture`
//! (`TANDEM_K3S_IMAGES=local` skips rebuilding the chart's images; logs under
//! `target/tmp/k3s-cluster/` until the next run).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

mod chart;

use anyhow::{Context, Result, anyhow, bail, ensure};
use tandem_k3s::chart::{Binaries, Kube, SavedImages, install_helm, save_images};
use tandem_k3s::cluster::{ClusterConfig, K3sCluster};
use tandem_k3s::node::{K3sNode, checked};
use tandem_k3s::{CLUSTER_CIDR, SERVICE_CIDR, wait_for};
use tandem_netlab::{ChildGuard, Netns};

const NODES: usize = 3;
/// `internalTrafficPolicy` is alpha in v1.21: the API server drops the field without it.
const FEATURE_GATES: &str = "ServiceInternalTrafficPolicy=true";
/// Requests through each way in: enough for every endpoint to answer.
const REQUESTS: usize = 12;
/// The node lifecycle controller's `--node-monitor-grace-period`: a node silent this long
/// is NotReady.
const NOT_READY_GRACE: Duration = Duration::from_secs(12);
/// How long a proxy may take from its start until it serves the cluster's Services.
const SERVES_WITHIN: Duration = Duration::from_secs(60);

#[test]
#[ignore = "needs a real k3s: TANDEM_K3S=/path/to/k3s cargo test -p tandem-k3s --test cluster -- --ignored"]
fn a_real_cluster_of_three_nodes_serves_across_nodes() -> Result<()> {
    let k3s = tandem_k3s::k3s_for_test("real-cluster test")?;
    let base = Path::new(env!("CARGO_TARGET_TMPDIR")).join("k3s-cluster");
    let work = base.join("work");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let bins = Binaries::locate()?;
    let helm = install_helm(&repo, Path::new(env!("CARGO_TARGET_TMPDIR")))?;
    let SavedImages {
        archives: images, ..
    } = save_images(&repo, &work.join("images"))?;
    let topology = tandem_k3s::cluster::topology(NODES)?;
    // Heartbeats every 2 s, so that the short grace above stays several of them: the lease
    // is renewed every quarter of its duration. The lease duration has no flag.
    let kubelet_config = work.join("kubelet.yaml");
    std::fs::write(
        &kubelet_config,
        "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n\
         nodeStatusUpdateFrequency: 2s\nnodeLeaseDurationSeconds: 8\n",
    )?;
    let (cluster, took) = K3sCluster::start(ClusterConfig {
        k3s,
        nodes: topology.nodes().to_vec(),
        bridge: "cni0".to_owned(),
        cluster_cidr: CLUSTER_CIDR.parse()?,
        service_cidr: SERVICE_CIDR.parse()?,
        images,
        // The proxies under test serve the Services, one after another.
        server_args: vec![
            "--disable-kube-proxy".to_owned(),
            format!("--kube-apiserver-arg=feature-gates={FEATURE_GATES}"),
            format!(
                "--kube-controller-manager-arg=node-monitor-grace-period={}s",
                NOT_READY_GRACE.as_secs()
            ),
            "--kube-controller-manager-arg=node-monitor-period=1s".to_owned(),
        ],
        kubelet_args: vec![format!("config={}", kubelet_config.display())],
        base_dir: base.clone(),
    })?;
    eprintln!(
        "{NODES} nodes Ready {took:.1?} after the server started; logs: {}",
        base.display()
    );
    let pods = start_workloads(&cluster, &work)?;
    let client = topology.client_in_range();

    let mut proxies: Vec<(String, Proxy)> = Vec::new();
    match tandem_k3s::kube_proxy_binary() {
        Some(binary) => proxies.push((
            "kube-proxy v1.21 (iptables)".to_owned(),
            Proxy::KubeProxy(binary),
        )),
        None => eprintln!(
            "SKIPPED: the reference run of kube-proxy ({} names no kube-proxy binary)",
            tandem_k3s::KUBE_PROXY_ENV
        ),
    }
    for mode in ["iptables", "nftables"] {
        proxies.push((
            format!("Tandem's node proxy, {mode} mode"),
            Proxy::Tandem {
                binary: bins.nodeproxy.clone(),
                mode,
            },
        ));
    }
    let mut failed = Vec::new();
    for (name, proxy) in &proxies {
        eprintln!("=== {name} on every node");
        let running = proxy.start_everywhere(&cluster, &work)?;
        let mut checks = across_nodes(&cluster, &pods, &client.netns, client.ip);
        checks.push((
            "node 3's link cut, then mended, under requests from node 1: only requests before its endpoint left failed, none after it came back",
            node_failure(&cluster, &topology, &pods),
        ));
        drop(running);
        for (check, result) in checks {
            match result {
                Ok(()) => eprintln!("ok   {check}"),
                Err(e) => {
                    eprintln!("FAIL {check}: {e:#}");
                    failed.push(format!("{name}: {check}: {e:#}"));
                }
            }
        }
        proxy.clean_everywhere(&cluster)?;
    }
    eprintln!("=== the chart on every node");
    let run = chart::ChartRun {
        cluster: &cluster,
        topology: &topology,
        bins: &bins,
        helm: &helm,
        chart: &repo.join("charts/tandem"),
        work: &work,
    };
    for (check, result) in chart::scenarios(&run) {
        match result {
            Ok(()) => eprintln!("ok   {check}"),
            Err(e) => {
                eprintln!("FAIL {check}: {e:#}");
                failed.push(format!("the chart: {check}: {e:#}"));
            }
        }
    }
    drop(cluster);
    ensure!(
        failed.is_empty(),
        "{} check(s) failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
    let _ = std::fs::remove_dir_all(&work);
    Ok(())
}

/// The cluster's pods: by name, their node and address.
struct Pods(Vec<(String, String, String)>);

impl Pods {
    fn ip(&self, pod: &str) -> Result<&str> {
        self.0
            .iter()
            .find(|(name, ..)| name == pod)
            .map(|(_, _, ip)| ip.as_str())
            .with_context(|| format!("no pod {pod}"))
    }
}

/// Applies [`workloads`] and waits until every pod is Ready on its node, with an address
/// of its node's pod subnet.
fn start_workloads(cluster: &K3sCluster, work: &Path) -> Result<Pods> {
    let server = cluster.server();
    let names: Vec<&str> = cluster.nodes().iter().map(K3sNode::name).collect();
    let kube = Kube { node: server, work };
    kube.wait_default_service_account()?;
    kube.apply("workloads.yaml", &workloads(&names))?;
    let want = NODES + 1;
    let pods = wait_for(
        "every pod Ready on its node",
        Duration::from_secs(120),
        || {
            let out = server.kubectl([
            "get",
            "pods",
            "-o",
            r#"jsonpath={range .items[*]}{.metadata.name} {.spec.nodeName} {.status.podIP} {.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}"#,
        ])?;
            let ready: Vec<(String, String, String)> = out
                .lines()
                .filter_map(
                    |line| match line.split_whitespace().collect::<Vec<_>>()[..] {
                        [pod, node, ip, "True"] => {
                            Some((pod.to_owned(), node.to_owned(), ip.to_owned()))
                        }
                        _ => None,
                    },
                )
                .collect();
            Ok((ready.len() == want)
                .then_some(ready)
                .ok_or_else(|| anyhow!("pods:\n{out}")))
        },
    )?;
    for (pod, node, ip) in &pods {
        let on = cluster
            .nodes()
            .iter()
            .find(|n| n.name() == node)
            .with_context(|| format!("{pod} runs on {node}, no node of the cluster"))?;
        ensure!(
            ip.parse::<std::net::Ipv4Addr>()
                .is_ok_and(|ip| on.pod_subnet().contains(&ip)),
            "{pod} on {node} has {ip}, outside the node's pod subnet {}",
            on.pod_subnet()
        );
    }
    Ok(Pods(pods))
}

/// A proxy of every node's Services.
enum Proxy {
    KubeProxy(PathBuf),
    Tandem { binary: PathBuf, mode: &'static str },
}

impl Proxy {
    fn args(&self, node: &K3sNode) -> Vec<OsString> {
        match self {
            Self::KubeProxy(_) => {
                let mut args = tandem_k3s::kube_proxy_args(
                    &node.kube_proxy_kubeconfig(),
                    node.name(),
                    CLUSTER_CIDR,
                );
                args.push(format!("--feature-gates={FEATURE_GATES}").into());
                args
            }
            Self::Tandem { mode, .. } => [
                format!("--kubeconfig={}", node.kubeconfig().display()),
                format!("--node-name={}", node.name()),
                format!("--cluster-cidr={CLUSTER_CIDR}"),
                format!("--proxy-mode={mode}"),
                format!("--healthz-bind-address={}:10256", node.ip()),
            ]
            .map(OsString::from)
            .to_vec(),
        }
    }

    fn binary(&self) -> &Path {
        match self {
            Self::KubeProxy(binary) | Self::Tandem { binary, .. } => binary,
        }
    }

    /// Starts it on every node, in the node's own mount namespace (the kubelet's xtables
    /// lock); each is killed when the returned guards drop.
    fn start_everywhere(&self, cluster: &K3sCluster, work: &Path) -> Result<Vec<ChildGuard>> {
        let mut running = Vec::new();
        for node in cluster.nodes() {
            let name = match self {
                Self::KubeProxy(_) => "kube-proxy".to_owned(),
                Self::Tandem { mode, .. } => format!("tandem-nodeproxy-{mode}"),
            };
            let log = std::fs::File::create(work.join(format!("{name}-{}.log", node.name())))?;
            let mut cmd = node.command_in_node(self.binary())?;
            cmd.args(self.args(node))
                .stdout(log.try_clone()?)
                .stderr(log);
            running.push(ChildGuard::spawn(cmd)?);
        }
        Ok(running)
    }

    /// Removes what it wrote on every node (`--cleanup`), so the next proxy starts clean:
    /// no Service chain may be left.
    fn clean_everywhere(&self, cluster: &K3sCluster) -> Result<()> {
        for node in cluster.nodes() {
            let mut cmd = node.command_in_node(self.binary())?;
            match self {
                // Its exit status says nothing here: it also removes IPVS's ipsets, and
                // fails where no `ipset` is installed, after its iptables rules are gone.
                Self::KubeProxy(_) => {
                    cmd.arg("--cleanup").stdin(Stdio::null());
                    tandem_k3s::node::run(&mut cmd)?;
                }
                Self::Tandem { mode, .. } => {
                    cmd.arg(format!("--proxy-mode={mode}"))
                        .arg("--cleanup")
                        .stdin(Stdio::null());
                    checked(cmd).with_context(|| format!("cleaning up on {}", node.name()))?;
                }
            }
            let mut save = node.command_in_node("iptables-save")?;
            save.stdin(Stdio::null());
            let rules = checked(save)?;
            ensure!(
                !rules.contains(":KUBE-SERVICES") && !rules.contains(":KUBE-SVC-"),
                "Service chains left on {} after cleanup:\n{rules}",
                node.name()
            );
        }
        Ok(())
    }
}

/// The checks one node cannot make, each with its outcome. The first waits for the proxy
/// to serve.
fn across_nodes(
    cluster: &K3sCluster,
    pods: &Pods,
    client: &Netns,
    client_ip: std::net::Ipv4Addr,
) -> Vec<(&'static str, Result<()>)> {
    let server = cluster.server();
    let nodes = cluster.nodes();
    let service = |name: &str, field: &str| -> Result<String> {
        Ok(server
            .kubectl(["get", "service", name, "-o", &format!("jsonpath={field}")])?
            .trim()
            .to_owned())
    };
    let mut out = Vec::new();
    out.push((
        "a pod on node 1 reaches the endpoints on nodes 2 and 3 through the cluster IP, keeping its address",
        (|| {
            let cluster_ip = service("remote", "{.spec.clusterIP}")?;
            wait_for("the proxy serves the cluster IP", SERVES_WITHIN, || {
                Ok(request_from_pod(server, "client", &cluster_ip, 80).map(drop))
            })?;
            let client_pod = pods.ip("client")?;
            let answered = answers(REQUESTS, || {
                let (pod, seen) = request_from_pod(server, "client", &cluster_ip, 80)?;
                ensure!(
                    seen == client_pod,
                    "the echo saw {seen}, not the client pod's {client_pod}"
                );
                Ok(pod)
            })?;
            ensure!(
                answered == BTreeSet::from(["echo-2".to_owned(), "echo-3".to_owned()]),
                "answered by {answered:?}"
            );
            Ok(())
        })(),
    ));
    out.push((
        "a pod on node 1 reaches them through the NodePort of node 3",
        (|| {
            let port: u16 = service("remote", "{.spec.ports[0].nodePort}")?.parse()?;
            let third = nodes[NODES - 1].ip().to_string();
            let answered = answers(REQUESTS, || {
                Ok(request_from_pod(server, "client", &third, port)?.0)
            })?;
            ensure!(answered.len() == 2, "answered by {answered:?}");
            Ok(())
        })(),
    ));
    out.push((
        "hairpin on every node: a pod reaches a Service whose only endpoint is itself",
        (|| {
            for index in 1..=NODES {
                let pod = format!("echo-{index}");
                let cluster_ip = service(&format!("self-{index}"), "{.spec.clusterIP}")?;
                let (answered, _) = request_from_pod(server, &pod, &cluster_ip, 80)
                    .with_context(|| format!("{pod} through self-{index}"))?;
                ensure!(
                    answered == pod,
                    "{pod} through self-{index}: answered by {answered}"
                );
            }
            Ok(())
        })(),
    ));
    out.push((
        "internalTrafficPolicy Local: a pod is served by its own node's endpoint, and not at all on a node without one",
        (|| {
            let cluster_ip = service("itp-local", "{.spec.clusterIP}")?;
            let policy = service("itp-local", "{.spec.internalTrafficPolicy}")?;
            ensure!(policy == "Local", "the API server kept internalTrafficPolicy {policy:?}");
            for pod in ["echo-2", "echo-3"] {
                let answered = answers(4, || Ok(request_from_pod(server, pod, &cluster_ip, 80)?.0))?;
                ensure!(
                    answered == BTreeSet::from([pod.to_owned()]),
                    "{pod} answered by {answered:?}"
                );
            }
            match request_from_pod(server, "client", &cluster_ip, 80) {
                Ok(answer) => bail!("the client pod on node 1 was answered by {answer:?}"),
                Err(_) => Ok(()),
            }
        })(),
    ));
    out.push((
        "externalTrafficPolicy Local from outside: only node 2's NodePort answers, with the client's address; its health check port says 200, the others 503",
        (|| {
            let port = service("etp-local", "{.spec.ports[0].nodePort}")?;
            let health = service("etp-local", "{.spec.healthCheckNodePort}")?;
            for node in nodes {
                let url = format!("http://{}:{port}/cgi-bin/echo", node.ip());
                let reply = curl(client, &["--max-time", "2", &url]);
                let code = curl(
                    client,
                    &["--max-time", "2", "-o", "/dev/null", "-w", "%{http_code}", &format!("http://{}:{health}/", node.ip())],
                )?;
                if node.name() == nodes[1].name() {
                    let reply = reply.with_context(|| url.clone())?;
                    ensure!(
                        reply.contains("pod=echo-2") && reply.contains(&client_ip.to_string()),
                        "{url} answered {reply:?}, not echo-2 seeing {client_ip}"
                    );
                    ensure!(code == "200", "{}'s health check answered {code}", node.name());
                } else {
                    ensure!(reply.is_err(), "{url} answered {reply:?}: it has no local endpoint");
                    ensure!(code == "503", "{}'s health check answered {code}", node.name());
                }
            }
            Ok(())
        })(),
    ));
    out
}

/// Cuts node 3's cable (its switch port down) while node 1 requests the `remote` Service
/// (endpoints on nodes 2 and 3) through its cluster IP, one request after another, then
/// mends it. The node lifecycle controller marks node 3 NotReady after the grace, which
/// takes its pod's endpoint out; the proxy must follow, and must take it back in when
/// node 3 returns. Requests sent to node 3's endpoint before it left fail, as they do
/// with kube-proxy.
fn node_failure(
    cluster: &K3sCluster,
    topology: &tandem_netlab::Topology,
    pods: &Pods,
) -> Result<()> {
    let server = cluster.server();
    let lost = &cluster.nodes()[NODES - 1];
    let lost_pod = pods.ip(&format!("echo-{NODES}"))?.to_owned();
    let cluster_ip = server
        .kubectl([
            "get",
            "service",
            "remote",
            "-o",
            "jsonpath={.spec.clusterIP}",
        ])?
        .trim()
        .to_owned();
    let cable = |state| cable(topology, NODES, state);
    let requests = Requests::start(
        &cluster.nodes()[0],
        &format!("http://{cluster_ip}/cgi-bin/echo"),
    );
    std::thread::sleep(Duration::from_secs(2));
    let cut_at = requests.clock.ms();
    cable("down")?;
    let outcome = (|| -> Result<(u64, u64, u64, u64)> {
        let not_ready = wait_not_ready(server, lost, requests.clock)?;
        let gone = wait_for(
            "its endpoint out of the Service",
            Duration::from_secs(30),
            || {
                Ok(
                    match ready_endpoints(server, "remote")?.contains(&lost_pod) {
                        false => Ok(requests.clock.ms()),
                        true => Err(anyhow!("{lost_pod} still ready")),
                    },
                )
            },
        )?;
        std::thread::sleep(Duration::from_secs(3));
        cable("up")?;
        let mended_at = requests.clock.ms();
        let back = wait_for("its endpoint back in", Duration::from_secs(60), || {
            Ok(
                match ready_endpoints(server, "remote")?.contains(&lost_pod) {
                    true => Ok(requests.clock.ms()),
                    false => Err(anyhow!("{lost_pod} not ready yet")),
                },
            )
        })?;
        std::thread::sleep(Duration::from_secs(3));
        Ok((not_ready, gone, mended_at, back))
    })();
    // Mended whatever happened, so that the next proxy meets a whole cluster.
    let mended = cable("up");
    let sent = requests.stop();
    let (not_ready, gone, mended_at, back) = outcome?;
    mended?;
    let failed: Vec<u64> = sent
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(at, _)| *at)
        .collect();
    let (window, late) = failed_outside_cut(&failed, cut_at, gone, REQUEST_TIMEOUT_MS);
    let last_failed = failed.last().copied().unwrap_or(cut_at);
    eprintln!(
        "  node 3's link cut: NotReady {:.1}s after (grace {NOT_READY_GRACE:?}), its endpoint out {:.1}s after, the last failed request sent {:.1}s after that; {} of {} requests failed; mended: the endpoint back {:.1}s after",
        secs(not_ready - cut_at),
        secs(gone - cut_at),
        secs(last_failed.saturating_sub(gone)),
        failed.len(),
        sent.len(),
        secs(back - mended_at),
    );
    ensure!(
        late.is_empty(),
        "{} requests failed outside the cut's window ({:.1}s to {:.1}s: from a request's time limit before the cut to {PROXY_FOLLOWS_WITHIN_MS} ms after the endpoint left), the first at {:?} ms",
        late.len(),
        secs(*window.start()),
        secs(*window.end()),
        &late[..late.len().min(10)]
    );
    Ok(())
}

/// Sets node `node`'s cable, its switch port, `up` or `down`.
fn cable(topology: &tandem_netlab::Topology, node: usize, state: &str) -> Result<()> {
    let port = tandem_netlab::plan::ifname::node_port(node);
    topology
        .switch()
        .exec_checked(["ip", "link", "set", &port, state])?;
    Ok(())
}

/// Each request's time limit, in milliseconds.
const REQUEST_TIMEOUT_MS: u64 = 1_000;
/// How long a proxy may take to follow an endpoint change, in milliseconds: its minimum
/// sync period (1 s, Tandem's and kube-proxy's), a sync, and a request's time limit.
const PROXY_FOLLOWS_WITHIN_MS: u64 = 3_000;

/// Milliseconds since it started: the one clock a scenario's steps and its requests are
/// timed on.
#[derive(Debug, Clone, Copy)]
struct Clock(Instant);

impl Clock {
    fn start() -> Self {
        Self(Instant::now())
    }

    fn ms(self) -> u64 {
        u64::try_from(self.0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// When `node`, cut off, was NotReady on `clock` (the node lifecycle controller's grace).
fn wait_not_ready(server: &K3sNode, node: &K3sNode, clock: Clock) -> Result<u64> {
    wait_for(
        &format!("{} NotReady", node.name()),
        NOT_READY_GRACE * 3,
        || {
            Ok(match node_ready(server, node.name())? {
                false => Ok(clock.ms()),
                true => Err(anyhow!("still Ready")),
            })
        },
    )
}

/// When a request of a node's cut may fail: from a request's limit (`in_flight_ms`) before
/// the cut, as one in flight then may, until [`PROXY_FOLLOWS_WITHIN_MS`] after its endpoint
/// left; and the failures in `failed_at` outside that window.
fn failed_outside_cut(
    failed_at: &[u64],
    cut: u64,
    gone: u64,
    in_flight_ms: u64,
) -> (std::ops::RangeInclusive<u64>, Vec<u64>) {
    let window = cut.saturating_sub(in_flight_ms)..=gone + PROXY_FOLLOWS_WITHIN_MS;
    let late = failed_at
        .iter()
        .copied()
        .filter(|at| !window.contains(at))
        .collect();
    (window, late)
}

fn secs(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

/// Whether the Node's Ready condition is True.
fn node_ready(server: &K3sNode, node: &str) -> Result<bool> {
    let status = server.kubectl([
        "get",
        "node",
        node,
        "-o",
        r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
    ])?;
    Ok(status.trim() == "True")
}

/// The addresses of the Service's ready endpoints, as its EndpointSlices say.
fn ready_endpoints(server: &K3sNode, service: &str) -> Result<BTreeSet<String>> {
    let out = server.kubectl([
        "get",
        "endpointslices",
        "-l",
        &format!("kubernetes.io/service-name={service}"),
        "-o",
        r#"jsonpath={range .items[*].endpoints[*]}{.addresses[0]} {.conditions.ready}{"\n"}{end}"#,
    ])?;
    Ok(out
        .lines()
        .filter_map(|line| line.strip_suffix(" true"))
        .map(str::to_owned)
        .collect())
}

/// Requests one after another from a node's own network namespace (`curl`, each within
/// [`REQUEST_TIMEOUT_MS`]), each recorded with when it was sent and whether it was
/// answered, until stopped.
struct Requests {
    clock: Clock,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(u64, bool)>>,
}

impl Requests {
    fn start(node: &K3sNode, url: &str) -> Self {
        let clock = Clock::start();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (flag, url) = (stop.clone(), url.to_owned());
        let mut requests = Vec::new();
        let make = {
            let netns = node.netns().clone();
            move || {
                let mut cmd = netns.command("curl");
                cmd.args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time"])
                    .arg(secs(REQUEST_TIMEOUT_MS).to_string())
                    .arg(&url)
                    .stdin(Stdio::null());
                cmd
            }
        };
        let thread = std::thread::spawn(move || {
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let at = clock.ms();
                let ok = make().output().is_ok_and(|out| out.stdout == b"200");
                requests.push((at, ok));
            }
            requests
        });
        Self {
            clock,
            stop,
            thread,
        }
    }

    /// Stops and returns every request: when it was sent (ms from the start), and whether
    /// it was answered.
    fn stop(self) -> Vec<(u64, bool)> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The set of what `count` calls of `request` returned.
fn answers(count: usize, mut request: impl FnMut() -> Result<String>) -> Result<BTreeSet<String>> {
    let mut answered = BTreeSet::new();
    for _ in 0..count {
        answered.insert(request()?);
    }
    Ok(answered)
}

/// One GET of the echo at `host:port` from `pod`: the pod that answered and the client
/// address it saw.
fn request_from_pod(
    server: &K3sNode,
    pod: &str,
    host: &str,
    port: u16,
) -> Result<(String, String)> {
    let started = Instant::now();
    let out = server.kubectl([
        "exec",
        pod,
        "--",
        "sh",
        "-c",
        // Static busybox's wget crashes (glibc's NSS): a request through nc.
        &format!(r"printf 'GET /cgi-bin/echo HTTP/1.0\r\n\r\n' | nc -w 2 {host} {port}"),
    ])?;
    let answer = out
        .lines()
        .find(|line| line.starts_with("pod="))
        .with_context(|| {
            format!(
                "{pod} to {host}:{port}: no answer after {:.1?} ({out:?})",
                started.elapsed()
            )
        })?;
    parse_echo(answer)
}

/// `pod=NAME client=ADDRESS`, as the echo answers; busybox httpd listens on IPv6 and names
/// an IPv4 client `[::ffff:A.B.C.D]`.
fn parse_echo(answer: &str) -> Result<(String, String)> {
    let field = |key: &str| {
        answer
            .split_whitespace()
            .find_map(|f| f.strip_prefix(key))
            .with_context(|| format!("no {key} in {answer:?}"))
    };
    let seen = field("client=")?
        .trim_matches(['[', ']'])
        .trim_start_matches("::ffff:");
    Ok((field("pod=")?.to_owned(), seen.to_owned()))
}

/// `curl -s ARGS` from `netns`; its output.
fn curl(netns: &Netns, args: &[&str]) -> Result<String> {
    let mut argv = vec!["curl", "-s"];
    argv.extend_from_slice(args);
    Ok(netns.exec_checked(argv)?)
}

/// An echo pod on every node (`echo-N`, with a Service `self-N` over it alone), a client
/// pod on the first, and the Services the checks use: `remote` over the echo pods of
/// nodes 2 and 3, `itp-local` over the same with `internalTrafficPolicy: Local`, and
/// `etp-local` over node 2's alone with `externalTrafficPolicy: Local`.
fn workloads(nodes: &[&str]) -> String {
    let pod = |name: &str, node: &str, labels: &str, extra: &str| {
        format!(
            r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: default
  labels: {{{labels}}}
spec:
  nodeName: {node}
  # busybox as PID 1 ignores SIGTERM.
  terminationGracePeriodSeconds: 1
  containers:
    - name: {name}
      image: localhost/tandem-echo:1
      imagePullPolicy: Never{extra}
---
"#
        )
    };
    let service = |name: &str, selector: &str, spec: &str| {
        format!(
            r#"apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
spec:
  selector: {{{selector}}}{spec}
  ports:
    - {{name: http, port: 80, targetPort: 8080}}
---
"#
        )
    };
    let mut out = pod(
        "client",
        nodes[0],
        "app: client",
        "\n      command: [/bin/sleep, \"3600\"]",
    );
    for (index, node) in nodes.iter().enumerate() {
        let n = index + 1;
        let remote = if n > 1 { ", remote: \"true\"" } else { "" };
        out.push_str(&pod(
            &format!("echo-{n}"),
            node,
            &format!("app: echo, pod: echo-{n}{remote}"),
            "\n      readinessProbe: {tcpSocket: {port: 8080}, periodSeconds: 1}",
        ));
        out.push_str(&service(
            &format!("self-{n}"),
            &format!("pod: echo-{n}"),
            "",
        ));
    }
    out.push_str(&service("remote", "remote: \"true\"", "\n  type: NodePort"));
    out.push_str(&service(
        "itp-local",
        "remote: \"true\"",
        "\n  internalTrafficPolicy: Local",
    ));
    out.push_str(&service(
        "etp-local",
        "pod: echo-2",
        "\n  type: LoadBalancer\n  externalTrafficPolicy: Local",
    ));
    out
}
