//! Do: a second cloud edge, `cloud-mock --dataplane haproxy`, beside the lab's own in the
//! lab's edge namespace, and load-balancer churn on an edge under steady traffic. Every
//! request comes from the outside client's namespace; the API calls from the lab's
//! control-plane namespace, which routes to the edge.

use std::collections::BTreeMap;
use std::net::{SocketAddr, SocketAddrV4};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cloud_mock_sdk::{
    AddressRequest, Client, ClientOptions, Listener, LoadBalancer, LoadBalancerSpec, Protocol,
};
use tandem_lab::Lab;
use tandem_lab::binaries;
use tandem_netlab::{ChildGuard, Netns};

use super::analysis::{
    CHURN_ANSWER_BOUND, CHURN_TRY_EVERY, CHURN_TRY_TIMEOUT, ChurnMeasurement, Edge,
    HAPROXY_EDGE_PORT_SHIFT, STEADY_PACE, STEADY_TIMEOUT,
};
use super::probe;

/// The HAProxy edge's API port, beside the lab's cloud (8080) on the edge's node-network
/// address.
const HAPROXY_EDGE_PORT: u16 = 8081;
/// The HAProxy edge's VIP pool: the lab's pool `blue`, which no Service of this benchmark
/// asks for, so the lab's cloud hands none of it out. It allocates lowest-free first and
/// needs 2 + the churn's addresses, well below the standalone haproxy's .254.
const HAPROXY_EDGE_POOL: &str = "default=198.51.100.128/25";
/// How long the HAProxy edge may take to serve its API.
const START_BOUND: Duration = Duration::from_secs(20);
/// Bound on the whole churn of one edge, whatever the per-LB bounds add up to.
const CHURN_BOUND: Duration = Duration::from_secs(600);
/// Steady traffic before the first create and after the last answer.
const STEADY_MARGIN: Duration = Duration::from_secs(1);
/// Tag on every load balancer the benchmark creates itself.
const TAG: (&str, &str) = ("tandem-bench", "dataplane");
/// The HAProxy edge's reloads by reason, as its `/metrics` names them.
const RELOAD_REASONS: &str = "cloud_mock_haproxy_reload_reasons_total";

/// `cloud-mock --dataplane haproxy` in the lab's edge namespace; killed (with the HAProxy
/// it runs, in its process group) when dropped.
pub struct HaproxyEdge {
    _process: ChildGuard,
    pub client: Client,
    /// Its API (and `/metrics`).
    listen: SocketAddr,
}

impl HaproxyEdge {
    /// Starts it with its own store under the run directory, its own API port and pool,
    /// VIP addresses on the edge's VIP interface as the lab's cloud adds them, and the lab
    /// cloud's provisioning delay; returns once its API answers.
    pub async fn start(lab: &Lab) -> Result<Self> {
        let edge = lab.topology.edge();
        let listen = SocketAddr::from((edge.node_network_ip, HAPROXY_EDGE_PORT));
        let data_dir = lab.run_dir.join("haproxy-edge");
        std::fs::create_dir_all(&data_dir)
            .with_context(|| format!("creating {}", data_dir.display()))?;
        let token = format!("bench-{}", lab.topology.prefix());
        let log = lab.run_dir.join("logs").join("haproxy-edge.log");
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = edge.netns.command(binaries::locate("cloud-mock")?);
        cmd.arg(format!("--listen={listen}"))
            .arg(format!("--data-dir={}", data_dir.display()))
            .arg(format!("--token={token}"))
            .arg(format!("--vip-pool={HAPROXY_EDGE_POOL}"))
            .args(["--dataplane=haproxy", "--manage-vip-addresses"])
            .arg(format!("--vip-device={}", edge.vip_interface))
            .arg("--provisioning-delay=200ms")
            .stdin(Stdio::null())
            .stdout(out.try_clone().context("duplicating the log file")?)
            .stderr(out);
        let mut process = ChildGuard::spawn(cmd)?;
        let start = Instant::now();
        loop {
            if let Some(status) = process.try_wait()? {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                bail!("the HAProxy edge exited ({status}): {}", text.trim());
            }
            if tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(listen),
            )
            .await
            .is_ok_and(|connected| connected.is_ok())
            {
                break;
            }
            if start.elapsed() > START_BOUND {
                bail!(
                    "the HAProxy edge did not serve {listen} within {START_BOUND:?} (see {})",
                    log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let client = Client::new(&format!("http://{listen}"), token, ClientOptions::default())
            .context("the HAProxy edge's client")?;
        Ok(Self {
            _process: process,
            client,
            listen,
        })
    }

    /// Its HAProxy's reloads so far, by reason.
    pub async fn reloads(&self) -> Result<BTreeMap<String, u64>> {
        let (status, page) = tandem_netlab::http::get(self.listen, "/metrics", START_BOUND)
            .await
            .context("reading the HAProxy edge's /metrics")?;
        if status != 200 {
            bail!("the HAProxy edge's /metrics answered {status}");
        }
        Ok(reloads_by_reason(&page))
    }
}

/// The `RELOAD_REASONS` counters of a metrics page, by reason.
fn reloads_by_reason(page: &str) -> BTreeMap<String, u64> {
    page.lines()
        .filter_map(|line| {
            let rest = line
                .strip_prefix(RELOAD_REASONS)?
                .strip_prefix("{reason=\"")?;
            let (reason, count) = rest.split_once("\"} ")?;
            Some((reason.to_owned(), count.trim().parse().ok()?))
        })
        .collect()
}

/// The load balancer of `cloud` whose VIP is `vip`: the one the controller made, with the
/// IPv4 members of the node pool it references as its backends (the controller's LBs
/// carry none of their own), so that a copy on another edge needs no pool.
pub async fn load_balancer_at(cloud: &Client, vip: SocketAddr) -> Result<LoadBalancer> {
    let all = cloud
        .list_load_balancers(&Default::default())
        .await
        .context("listing the own edge's load balancers")?;
    let mut lb = all
        .into_iter()
        .find(|lb| {
            lb.vip()
                .is_some_and(|ip| std::net::IpAddr::V4(ip) == vip.ip())
        })
        .with_context(|| format!("the own edge has no load balancer at {vip}"))?;
    if let Some(pool) = lb.spec.node_pool.take() {
        let members = cloud
            .get_node_pool(&pool)
            .await
            .with_context(|| format!("reading node pool {pool}"))?;
        lb.spec.backends = members
            .backends
            .iter()
            .filter_map(|member| match member.ip {
                std::net::IpAddr::V4(ip) => Some(cloud_mock_sdk::Backend { ip }),
                std::net::IpAddr::V6(_) => None,
            })
            .collect();
    }
    Ok(lb)
}

/// `template`'s TCP listeners (an HAProxy edge refuses UDP in proxy mode; the lab's
/// Services have both), backends and source ranges under another name and the benchmark's
/// tag, with a VIP of `edge`'s default pool; on the HAProxy edge the listener ports are
/// shifted by [`HAPROXY_EDGE_PORT_SHIFT`].
pub fn copy_of(template: &LoadBalancer, name: &str, edge: Edge) -> LoadBalancerSpec {
    let shift = match edge {
        Edge::Own => 0,
        Edge::Haproxy => HAPROXY_EDGE_PORT_SHIFT,
    };
    LoadBalancerSpec {
        name: name.to_owned(),
        tags: BTreeMap::from([(TAG.0.to_owned(), TAG.1.to_owned())]),
        mode: template.spec.mode,
        vip: None,
        listeners: template
            .spec
            .listeners
            .iter()
            .filter(|listener| listener.protocol == Protocol::Tcp)
            .map(|listener| Listener {
                port: listener.port.saturating_add(shift),
                ..listener.clone()
            })
            .collect(),
        backends: template.spec.backends.clone(),
        node_pool: None,
        source_ranges: template.spec.source_ranges.clone(),
        address: AddressRequest::default(),
    }
}

/// Creates `spec` on `cloud` and returns its VIP at the first listener's port.
pub async fn create(cloud: &Client, spec: &LoadBalancerSpec) -> Result<(String, SocketAddr)> {
    let lb = cloud
        .create_load_balancer(spec, &spec.name)
        .await
        .with_context(|| format!("creating {}", spec.name))?;
    let vip = lb
        .vip()
        .with_context(|| format!("{} has no IPv4 VIP", lb.id))?;
    let port = spec
        .listeners
        .first()
        .map(|l| l.port)
        .with_context(|| format!("{} has no listener", spec.name))?;
    Ok((lb.id, SocketAddrV4::new(vip, port).into()))
}

/// `count` load balancers like `template` created on `cloud` one after another, each
/// once the one before answered, while the client sends `steady` paced requests; the
/// created ones are deleted afterwards, also when the run fails.
pub async fn churn(
    edge: Edge,
    cloud: &Client,
    client: &Netns,
    template: &LoadBalancer,
    steady: SocketAddr,
    count: usize,
) -> Result<ChurnMeasurement> {
    let stop = Arc::new(AtomicBool::new(false));
    let steady_task = {
        let stop = Arc::clone(&stop);
        let client = client.clone();
        let max_time = CHURN_BOUND + 2 * STEADY_MARGIN;
        let max_count = u32::try_from(max_time.as_millis() / STEADY_PACE.as_millis().max(1))
            .unwrap_or(u32::MAX);
        tokio::task::spawn_blocking(move || {
            client.run_in_thread(move || {
                probe::requests_until(
                    steady,
                    &stop,
                    STEADY_PACE,
                    max_count,
                    max_time,
                    STEADY_TIMEOUT,
                )
            })
        })
    };
    tokio::time::sleep(STEADY_MARGIN).await;
    let mut created = Vec::new();
    let mut m = ChurnMeasurement {
        asked: count,
        ..ChurnMeasurement::default()
    };
    let result = create_all(edge, cloud, client, template, count, &mut created, &mut m).await;
    tokio::time::sleep(STEADY_MARGIN).await;
    stop.store(true, Ordering::Relaxed);
    let steady_times = steady_task.await;
    delete_all(cloud, &created).await;
    result?;
    let times = steady_times
        .context("the steady request thread panicked")?
        .context("running steady requests in the client namespace")?;
    m.steady_latencies = times.latencies;
    m.steady_failures = times.failures;
    Ok(m)
}

async fn create_all(
    edge: Edge,
    cloud: &Client,
    client: &Netns,
    template: &LoadBalancer,
    count: usize,
    created: &mut Vec<String>,
    m: &mut ChurnMeasurement,
) -> Result<()> {
    let slug = match edge {
        Edge::Own => "own",
        Edge::Haproxy => "haproxy",
    };
    let start = Instant::now();
    for i in 0..count {
        if start.elapsed() > CHURN_BOUND {
            bail!(
                "{}: {i} of {count} load balancers created in {CHURN_BOUND:?}, the bound",
                edge.label()
            );
        }
        let spec = copy_of(template, &format!("bench-churn-{slug}-{i}"), edge);
        let since = Instant::now();
        let target = match create(cloud, &spec).await {
            Ok((id, target)) => {
                created.push(id);
                target
            }
            Err(e) => {
                *m.create_errors.entry(format!("{e:#}")).or_default() += 1;
                continue;
            }
        };
        let client = client.clone();
        let answered = tokio::task::spawn_blocking(move || {
            client.run_in_thread(move || {
                probe::first_answer(
                    target,
                    since,
                    CHURN_TRY_EVERY,
                    CHURN_ANSWER_BOUND,
                    CHURN_TRY_TIMEOUT,
                )
            })
        })
        .await
        .context("the probing thread panicked")?
        .context("probing in the client namespace")?;
        match answered {
            Some(took) => m.create_to_traffic.push(took),
            None => m.never_answered += 1,
        }
    }
    m.elapsed = start.elapsed();
    Ok(())
}

/// Deletes `ids` from `cloud`, logging (not failing on) a refusal: cleanup.
async fn delete_all(cloud: &Client, ids: &[String]) {
    for id in ids {
        if let Err(e) = cloud.delete_load_balancer(id).await {
            tracing::warn!(id, error = %e, "cannot delete a churn load balancer");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reloads_are_read_by_reason_from_the_metrics_page() {
        let page = "# HELP cloud_mock_haproxy_reload_reasons HAProxy reloads by what needed them\n\
            cloud_mock_haproxy_reload_reasons_total{reason=\"new_frontend\"} 2\n\
            cloud_mock_haproxy_reload_reasons_total{reason=\"no_spare_backend\"} 1\n\
            cloud_mock_haproxy_reloads_total{result=\"ok\"} 3\n";
        assert_eq!(
            reloads_by_reason(page),
            BTreeMap::from([
                ("new_frontend".to_owned(), 2),
                ("no_spare_backend".to_owned(), 1)
            ])
        );
    }
}
