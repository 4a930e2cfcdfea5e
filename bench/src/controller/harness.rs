//! The doing half: starts the three components, drives the two phases, reads counters.
//! Child processes are killed by PID when their handles drop (also on error or panic).

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use cloud_mock_sdk as sdk;
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{
    Event, Node, NodeAddress, NodeCondition, NodeStatus, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use serde_json::json;
use tandem_controller::provider::{TAG_CLUSTER_ID, TAG_SERVICE_UID};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::cpu::CpuTimes;
use crate::nodeproxy::rss::vm_hwm_kib;

use super::{
    CreateCpu, LB_COLLECTION, LB_ITEM, Measured, RouteCounts, Scale, cloud_calls, counts_delta,
    parse_request_counts,
};

const CLOUD_TOKEN: &str = "bench-cloud-token";
/// VIPs are only bookkeeping here (no data plane): a loopback range large enough for the
/// largest run (10,000 Services).
const VIP_POOL: &str = "127.77.0.0/16";
/// The stand-in's `--service-node-port-range`: every LoadBalancer Service takes a node
/// port, and the default range (30000-32767) holds 2,768.
const NODE_PORT_RANGE: &str = "20000-32767";
const CLUSTER_ID: &str = "bench";
const NAMESPACE: &str = "default";
/// Bound on each phase, so a broken controller ends the run instead of hanging it.
const PHASE_TIMEOUT: Duration = Duration::from_secs(300);
/// Quiet time after a phase before counters are read, so late calls are counted too.
const SETTLE: Duration = Duration::from_secs(1);
/// Creates in flight at once when "creating at once".
const CREATE_PARALLELISM: usize = 32;
/// How often the node phase sends a GET of one LB to see the node appear behind it.
const SENTINEL_POLL: Duration = Duration::from_millis(5);
/// Calls of each kind timed by the cloud probe.
const PROBE_CALLS: usize = 20;

/// A scratch directory removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> anyhow::Result<Self> {
        let path = std::env::temp_dir().join(format!("tdm-bench-ctl-{}", std::process::id()));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?)
}

/// Spawns `program` with its output in `log`; the child is killed when dropped.
fn spawn_logged(program: &Path, args: &[String], log: &Path) -> anyhow::Result<Child> {
    let file = std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    Command::new(program)
        .args(args)
        .env_remove("KUBECONFIG")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::from(file.try_clone()?))
        .stderr(Stdio::from(file))
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", program.display()))
}

/// `GET path` on loopback: status code and body.
async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    Ok(tandem_netlab::http::get(addr, path, Duration::from_secs(10)).await?)
}

/// Polls `addr` + `path` until it answers 200, failing if `child` exits or time runs out.
async fn wait_ok(
    child: &mut Child,
    addr: SocketAddr,
    path: &str,
    log: &Path,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((200, _)) = http_get(addr, path).await {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            let tail = std::fs::read_to_string(log).unwrap_or_default();
            bail!("process exited ({status}) before {path} answered; log:\n{tail}");
        }
        if Instant::now() > deadline {
            bail!("{addr}{path} did not answer 200 within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the cloud has had no call but the harness's own for [`SETTLE`].
async fn wait_quiet(cloud: SocketAddr) -> anyhow::Result<()> {
    let deadline = Instant::now() + PHASE_TIMEOUT;
    let mut last = cloud_calls(&cloud_counts(cloud).await?);
    let mut still_since = Instant::now();
    while still_since.elapsed() < SETTLE {
        if Instant::now() > deadline {
            bail!("the cloud's request counters still moved after {PHASE_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = cloud_calls(&cloud_counts(cloud).await?);
        if now != last {
            last = now;
            still_since = Instant::now();
        }
    }
    Ok(())
}

async fn cloud_counts(cloud: SocketAddr) -> anyhow::Result<RouteCounts> {
    let (status, body) = http_get(cloud, "/metrics").await?;
    if status != 200 {
        bail!("cloud-mock /metrics answered {status}");
    }
    Ok(parse_request_counts(&body))
}

fn node(name: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The InternalIP of the node numbered `index`.
fn node_ip(index: usize) -> anyhow::Result<Ipv4Addr> {
    let host = u8::try_from(11 + index).context("more nodes than 198.18.0.11-255 hold")?;
    Ok(Ipv4Addr::new(198, 18, 0, host))
}

/// Registers a Ready node with an InternalIP, as a kubelet would.
async fn add_node(nodes: &Api<Node>, index: usize) -> anyhow::Result<()> {
    let name = format!("bench-node-{index}");
    nodes.create(&PostParams::default(), &node(&name)).await?;
    let status = NodeStatus {
        addresses: Some(vec![NodeAddress {
            type_: "InternalIP".into(),
            address: node_ip(index)?.to_string(),
        }]),
        conditions: Some(vec![NodeCondition {
            type_: "Ready".into(),
            status: "True".into(),
            ..Default::default()
        }]),
        ..Default::default()
    };
    nodes
        .patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await?;
    Ok(())
}

fn service(name: &str) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NAMESPACE.into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            selector: Some([("app".to_owned(), name.to_owned())].into()),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                target_port: Some(IntOrString::Int(8080)),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn has_ingress_ip(svc: &Service) -> bool {
    svc.status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .is_some_and(|ingress| ingress.iter().any(|i| i.ip.is_some()))
}

/// Watches Services until `expected` have an ingress IP; the instant each was first seen.
/// Sends on `ready` once the initial list is done, so no change is missed.
async fn watch_ingress(
    services: Api<Service>,
    expected: usize,
    ready: tokio::sync::oneshot::Sender<()>,
) -> anyhow::Result<HashMap<String, Instant>> {
    let mut seen = HashMap::new();
    let mut ready = Some(ready);
    let mut events =
        std::pin::pin!(watcher(services, watcher::Config::default()).default_backoff());
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            // The watcher resumes by itself (with backoff); a transient error loses nothing.
            Err(error) => {
                tracing::warn!(%error, "Service watch error");
                continue;
            }
        };
        match event {
            watcher::Event::Apply(svc) | watcher::Event::InitApply(svc) => {
                if has_ingress_ip(&svc) {
                    let name = svc.metadata.name.clone().unwrap_or_default();
                    seen.entry(name).or_insert_with(Instant::now);
                }
            }
            watcher::Event::InitDone => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(());
                }
            }
            watcher::Event::Delete(_) | watcher::Event::Init => {}
        }
        if seen.len() >= expected {
            return Ok(seen);
        }
    }
    bail!(
        "the Service watch ended after {} of {expected} ingress IPs",
        seen.len()
    )
}

/// Runs both phases against fresh components and returns the raw measurements.
pub async fn measure(scale: &Scale) -> anyhow::Result<Measured> {
    let controller_bin = tandem_lab::binaries::locate("tandem-controller")?;
    let cloud_bin = tandem_lab::binaries::locate("cloud-mock")?;
    let scratch = ScratchDir::new()?;
    let dir = scratch.0.as_path();

    let api = tandem_apiserver::spawn(tandem_apiserver::ServerConfig {
        // Room for every change of both phases, so no watch is sent 410 Gone mid-run.
        store: tandem_apiserver::StoreConfig {
            watch_cache_size: scale.services * 20 + 1000,
            node_port_range: NODE_PORT_RANGE
                .parse()
                .map_err(|e| anyhow::anyhow!("node port range {NODE_PORT_RANGE}: {e}"))?,
            ..Default::default()
        },
        ..Default::default()
    })
    .await?;
    let client = api.client().await?;
    let kubeconfig = dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).await?;

    let cloud_addr = free_port()?;
    let cloud_log = dir.join("cloud-mock.log");
    let cloud_data = dir.join("cloud-data");
    let mut cloud = spawn_logged(
        &cloud_bin,
        &[
            "--listen".into(),
            cloud_addr.to_string(),
            "--data-dir".into(),
            cloud_data.display().to_string(),
            "--token".into(),
            CLOUD_TOKEN.into(),
            "--vip-pool".into(),
            VIP_POOL.into(),
            "--dataplane".into(),
            "none".into(),
            "--provisioning-delay".into(),
            format!("{}ms", scale.provisioning_delay.as_millis()),
            "--fault-injection".into(),
        ],
        &cloud_log,
    )?;
    wait_ok(&mut cloud, cloud_addr, "/healthz", &cloud_log).await?;
    let cloud_client = sdk::Client::new(
        &format!("http://{cloud_addr}"),
        CLOUD_TOKEN,
        sdk::ClientOptions::default(),
    )?;
    cloud_client
        .set_faults(&sdk::Faults {
            latency_ms: u64::try_from(scale.cloud_latency.as_millis())?,
            ..Default::default()
        })
        .await?;

    let nodes: Api<Node> = Api::all(client.clone());
    for index in 0..scale.initial_nodes {
        add_node(&nodes, index).await?;
    }

    let token_file = dir.join("cloud-token");
    std::fs::write(&token_file, CLOUD_TOKEN)?;
    let controller_addr = free_port()?;
    let controller_log = dir.join("controller.log");
    let mut controller = spawn_logged(
        &controller_bin,
        &[
            "--kubeconfig".into(),
            kubeconfig.display().to_string(),
            "--cloud-url".into(),
            format!("http://{cloud_addr}"),
            "--cloud-token-file".into(),
            token_file.display().to_string(),
            "--cluster-id".into(),
            CLUSTER_ID.into(),
            "--metrics-bind-address".into(),
            controller_addr.to_string(),
            "--health-bind-address".into(),
            controller_addr.to_string(),
            "--concurrency".into(),
            scale.concurrency.to_string(),
            "--cloud-rate".into(),
            "100000".into(),
            "--cloud-burst".into(),
            "100000".into(),
            "--cloud-timeout-seconds".into(),
            "30".into(),
            "--node-debounce-ms".into(),
            scale.node_debounce.as_millis().to_string(),
        ],
        &controller_log,
    )?;
    wait_ok(&mut controller, controller_addr, "/readyz", &controller_log).await?;
    // Ready is not done: its start-up calls (orphan collection, the node pool's claim) are
    // no Service's, and must not be counted on the create path.
    wait_quiet(cloud_addr).await?;

    let services: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);
    let events: Api<Event> = Api::namespaced(client.clone(), NAMESPACE);
    let store = api.store().clone();
    let resource_version = || {
        store
            .resource_version()
            .map_err(|e| anyhow::anyhow!("reading the stand-in's resourceVersion: {e:?}"))
    };

    // Phase 1: every Service created at once.
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let watch = tokio::spawn(watch_ingress(services.clone(), scale.services, ready_tx));
    ready_rx
        .await
        .context("the Service watch ended before its initial list")?;
    let counts_before = cloud_counts(cloud_addr).await?;
    let rv_before = resource_version()?;
    let events_before = events.list(&ListParams::default()).await?.items.len();
    let names: Vec<String> = (0..scale.services).map(|i| format!("svc-{i:04}")).collect();
    let cpu_before = cpu_split(&controller, &cloud)?;
    let burst_start = Instant::now();
    let created: Vec<(String, Instant)> = futures::stream::iter(names.iter().cloned())
        .map(|name| {
            let services = services.clone();
            async move {
                let sent = Instant::now();
                services
                    .create(&PostParams::default(), &service(&name))
                    .await
                    .with_context(|| format!("creating Service {name}"))?;
                Ok::<_, anyhow::Error>((name, sent))
            }
        })
        .buffer_unordered(CREATE_PARALLELISM)
        .try_collect()
        .await?;
    let seen = tokio::time::timeout(PHASE_TIMEOUT, watch)
        .await
        .with_context(|| {
            format!(
                "not every Service had an ingress IP within {PHASE_TIMEOUT:?}; controller log: {}",
                controller_log.display()
            )
        })???;
    let cpu_after = cpu_split(&controller, &cloud)?;
    let last_ingress = seen.values().max().copied().unwrap_or(burst_start);
    let time_to_ingress = created
        .iter()
        .filter_map(|(name, sent)| Some(seen.get(name)?.duration_since(*sent)))
        .collect();
    tokio::time::sleep(SETTLE).await;
    let create_cloud_calls = counts_delta(&counts_before, &cloud_counts(cloud_addr).await?);
    let writes = resource_version()?.saturating_sub(rv_before);
    let create_api_writes = writes.saturating_sub(scale.services as u64);
    let create_events = events
        .list(&ListParams::default())
        .await?
        .items
        .len()
        .saturating_sub(events_before) as u64;

    // Phase 1b: on every Service, writes that change nothing its LB depends on — a label
    // and another writer's status condition, what the controller's own finalizer, id and
    // status writes look like to its watch. None may reach the cloud.
    let counts_before = cloud_counts(cloud_addr).await?;
    futures::stream::iter(names.iter().cloned())
        .map(|name| {
            let services = services.clone();
            async move {
                services
                    .patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(
                            json!({ "metadata": { "labels": { "bench/touched": "yes" } } }),
                        ),
                    )
                    .await
                    .with_context(|| format!("labelling Service {name}"))?;
                services
                    .patch_status(
                        &name,
                        &PatchParams::apply("tandem-bench").force(),
                        &Patch::Apply(json!({
                            "apiVersion": "v1",
                            "kind": "Service",
                            "metadata": { "name": name, "namespace": NAMESPACE },
                            "status": { "conditions": [{
                                "type": "example.com/Probed",
                                "status": "True",
                                "reason": "Bench",
                                "message": "",
                                "lastTransitionTime": "2026-01-01T00:00:00Z",
                            }] },
                        })),
                    )
                    .await
                    .with_context(|| format!("writing another condition on Service {name}"))?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(CREATE_PARALLELISM)
        .try_collect::<Vec<()>>()
        .await?;
    tokio::time::sleep(SETTLE * 2).await;
    let unrelated_writes_cloud_calls =
        counts_delta(&counts_before, &cloud_counts(cloud_addr).await?);

    // Phase 2: one node added; every LB must serve it, through one node-pool write.
    // The harness reads with retries off, so each of its reads is one request to take out
    // of the counts.
    let poller = sdk::Client::new(
        &format!("http://{cloud_addr}"),
        CLOUD_TOKEN,
        sdk::ClientOptions {
            max_retries: 0,
            ..sdk::ClientOptions::default()
        },
    )?;
    let new_node_ip = node_ip(scale.initial_nodes)?;
    let sentinel = cloud_client
        .list_load_balancers(&sdk::ListFilter::default())
        .await?
        .into_iter()
        .next()
        .context("the cloud holds no load balancer")?
        .id;
    let counts_before = cloud_counts(cloud_addr).await?;
    let node_start = Instant::now();
    add_node(&nodes, scale.initial_nodes).await?;
    let served = wait_until_served(
        &poller,
        &sentinel,
        new_node_ip,
        scale.services,
        node_start + PHASE_TIMEOUT,
    )
    .await
    .with_context(|| format!("controller log: {}", controller_log.display()))?;
    tokio::time::sleep(scale.node_debounce + SETTLE).await;
    let own_reads = RouteCounts::from([
        (
            (LB_ITEM.to_owned(), "GET".to_owned()),
            f64::from(served.gets),
        ),
        (
            (LB_COLLECTION.to_owned(), "GET".to_owned()),
            f64::from(served.lists),
        ),
    ]);
    let node_add_cloud_calls = counts_delta(
        &own_reads,
        &counts_delta(&counts_before, &cloud_counts(cloud_addr).await?),
    );
    let lbs_with_new_node = lbs_serving(
        &cloud_client
            .list_load_balancers(&sdk::ListFilter::default())
            .await?,
        new_node_ip,
    );
    let controller_peak_rss_mib = peak_rss_mib(&controller).await?;

    // The cloud's own cost per call with every LB stored, with the controller stopped so
    // nothing else is queued: what the controller's calls cost it, apart from the latency.
    drop(controller);
    let (cloud_get_mean, cloud_list_mean) = probe_cloud_calls(&cloud_client).await?;
    drop(cloud);
    api.shutdown().await?;
    Ok(Measured {
        create_total: last_ingress.duration_since(burst_start),
        time_to_ingress,
        create_cloud_calls,
        create_api_writes,
        create_events,
        unrelated_writes_cloud_calls,
        node_add_first_served: served.first.duration_since(node_start),
        node_add_served: served.every.duration_since(node_start),
        node_add_list_time: served.list_time,
        node_add_cloud_calls,
        lbs_with_new_node,
        controller_peak_rss_mib,
        cloud_get_mean,
        cloud_list_mean,
        create_cpu: CreateCpu {
            controller: cpu_after[0] - cpu_before[0],
            cloud: cpu_after[1] - cpu_before[1],
            apiserver_and_harness: cpu_after[2] - cpu_before[2],
            cores: std::thread::available_parallelism().map_or(1, usize::from),
        },
    })
}

/// CPU seconds used so far by the controller, by cloud-mock, and by this process (the API
/// server stand-in and the harness), each apart, read at one moment.
fn cpu_split(controller: &Child, cloud: &Child) -> anyhow::Result<[f64; 3]> {
    let times = CpuTimes::read()?;
    let of = |child: &Child, what: &str| {
        times.seconds(child.id().with_context(|| format!("{what} has exited"))?)
    };
    let (controller, cloud) = (of(controller, "the controller")?, of(cloud, "cloud-mock")?);
    // This process's tree holds both children.
    let all = times.seconds(std::process::id())?;
    Ok([controller, cloud, (all - controller - cloud).max(0.0)])
}

/// LBs of `lbs` whose backends include `ip`: the cloud's `health` list names each backend
/// an LB forwards to, the node pool's members for an LB on the pool.
fn lbs_serving(lbs: &[sdk::LoadBalancer], ip: Ipv4Addr) -> usize {
    lbs.iter()
        .filter(|lb| lb.health.iter().any(|backend| backend.ip == ip))
        .count()
}

/// When the cloud's API showed an added node, and what it took to see.
struct Served {
    /// The arrival of the first answer in which one LB (the sentinel) served the node.
    first: Instant,
    /// The arrival of the first list in which every LB served it.
    every: Instant,
    /// The harness's own reads: GETs of the sentinel and lists.
    gets: u32,
    lists: u32,
    /// How long the last list took: how late `every` may be after the fact.
    list_time: Duration,
}

/// Watches for `ip` behind the LBs: GETs of the `sentinel` LB, one sent every
/// [`SENTINEL_POLL`] (a few in flight), until it serves the node, then lists of every LB
/// until all `expected` do. One LB's GET is cheap and answers ~[`SENTINEL_POLL`] after the
/// change; a list of every LB is what shows all of them, and costs in proportion to their
/// number (its time is returned), so it is sent only once the node can be seen at all.
async fn wait_until_served(
    client: &sdk::Client,
    sentinel: &str,
    ip: Ipv4Addr,
    expected: usize,
    deadline: Instant,
) -> anyhow::Result<Served> {
    let mut tick = tokio::time::interval(SENTINEL_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut in_flight = futures::stream::FuturesUnordered::new();
    let mut gets = 0;
    let first = loop {
        tokio::select! {
            _ = tick.tick() => {
                gets += 1;
                in_flight.push(async {
                    let lb = client.get_load_balancer(sentinel).await;
                    (lb, Instant::now())
                });
            }
            Some((lb, answered)) = in_flight.next() => {
                if lb?.health.iter().any(|backend| backend.ip == ip) {
                    break answered;
                }
                if answered > deadline {
                    bail!("the LB {sentinel} did not serve the new node {ip} within {PHASE_TIMEOUT:?}");
                }
            }
        }
    };
    let mut lists = 0;
    let (every, list_time) = loop {
        let sent = Instant::now();
        let lbs = client
            .list_load_balancers(&sdk::ListFilter::default())
            .await?;
        let answered = Instant::now();
        lists += 1;
        let serving = lbs_serving(&lbs, ip);
        if serving >= expected {
            break (answered, answered.duration_since(sent));
        }
        if answered > deadline {
            bail!("{serving} of {expected} LBs served the new node {ip} within {PHASE_TIMEOUT:?}");
        }
    };
    // Every GET sent reaches the cloud's counter: wait for them, so the count is exact.
    while let Some((lb, _)) = in_flight.next().await {
        lb?;
    }
    Ok(Served {
        first,
        every,
        gets,
        lists,
        list_time,
    })
}

/// The peak resident set (VmHWM) of the running `child`, in MiB.
async fn peak_rss_mib(child: &Child) -> anyhow::Result<f64> {
    let pid = child.id().context("the controller has exited")?;
    let status = tokio::fs::read_to_string(format!("/proc/{pid}/status"))
        .await
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let kib = vm_hwm_kib(&status).context("no VmHWM in the controller's /proc status")?;
    Ok(kib as f64 / 1024.0)
}

/// Mean time of a GET by id and of a LIST by the controller's lookup filter (cluster id
/// and Service UID tags, and the name), each over up to [`PROBE_CALLS`] LBs in sequence.
async fn probe_cloud_calls(client: &sdk::Client) -> anyhow::Result<(Duration, Duration)> {
    let stored = client
        .list_load_balancers(&sdk::ListFilter::default())
        .await?;
    let probed: Vec<&sdk::LoadBalancer> = stored.iter().take(PROBE_CALLS).collect();
    if probed.is_empty() {
        bail!("the cloud holds no load balancer to probe");
    }
    let mut get_total = Duration::ZERO;
    let mut list_total = Duration::ZERO;
    for lb in &probed {
        let start = Instant::now();
        client.get_load_balancer(&lb.id).await?;
        get_total += start.elapsed();
        let filter = sdk::ListFilter {
            tags: [TAG_CLUSTER_ID, TAG_SERVICE_UID]
                .into_iter()
                .filter_map(|tag| Some((tag.to_owned(), lb.spec.tags.get(tag)?.clone())))
                .collect(),
            name: Some(lb.spec.name.clone()),
        };
        let start = Instant::now();
        let found = client.list_load_balancers(&filter).await?;
        list_total += start.elapsed();
        if found.len() != 1 {
            bail!("the lookup filter of {} matched {} LBs", lb.id, found.len());
        }
    }
    let count = u32::try_from(probed.len())?;
    Ok((get_total / count, list_total / count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vip_pool_and_the_node_ports_hold_the_largest_curve_run() {
        let largest = super::super::curve_sizes(false)
            .iter()
            .max()
            .copied()
            .unwrap();
        let pool: ipnet::Ipv4Net = VIP_POOL.parse().unwrap();
        assert!(pool.hosts().count() >= largest);
        let ports: tandem_apiserver::PortRange = NODE_PORT_RANGE.parse().unwrap();
        assert!(ports.0.len() >= largest);
    }
}
