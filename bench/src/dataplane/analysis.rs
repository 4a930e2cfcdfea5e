//! Decide: what the data-plane measurements are worth (pure, no I/O): iperf3's JSON,
//! percentiles, haproxy's configuration, and the report's rows against their limits.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddrV4;
use std::time::Duration;

use crate::controller::quantile;
use crate::report::{Row, Section, Target, Value};

/// Passthrough must carry at least this share of the direct route's throughput (issue 8).
pub const PASSTHROUGH_VS_DIRECT: f64 = 0.9;
/// Proxy mode must carry at least as much as haproxy in its place (issue 8).
pub const PROXY_VS_HAPROXY: f64 = 1.0;
/// The latency form of the passthrough target: 0.9× the speed is 1/0.9 the time.
pub const PASSTHROUGH_LATENCY_VS_DIRECT: f64 = 1.11;
/// Edge churn: how long a new load balancer may take to answer before it counts as never.
pub const CHURN_ANSWER_BOUND: Duration = Duration::from_secs(30);
/// Edge churn: how often a new load balancer is tried until it answers.
pub const CHURN_TRY_EVERY: Duration = Duration::from_millis(5);
/// Edge churn: bound on one try of a new load balancer. A SYN to a VIP not served yet gets
/// no answer and the kernel would resend it only after a second: short tries keep the
/// resolution near this bound plus [`CHURN_TRY_EVERY`].
pub const CHURN_TRY_TIMEOUT: Duration = Duration::from_millis(20);
/// Edge churn: one steady request per this long, at most.
pub const STEADY_PACE: Duration = Duration::from_millis(5);
/// Edge churn: bound on one steady request, connect included.
pub const STEADY_TIMEOUT: Duration = Duration::from_secs(2);
/// Added to every listener port of the HAProxy edge's load balancers. HAProxy binds each
/// port on every address of the namespace (so that a new VIP needs no new bind), which
/// the kernel refuses beside the own edge's listeners on the same port in the same
/// namespace; the hops are the same on any port.
pub const HAPROXY_EDGE_PORT_SHIFT: u16 = 10_000;
/// Edge churn: p99 of create → first answer on the HAProxy edge, at most (issue 45: a new
/// load balancer on a port it binds already takes no reload).
pub const HAPROXY_EDGE_CREATE_TO_ANSWER: Duration = Duration::from_millis(50);

/// A way from the outside client to the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Path {
    /// Routed straight to the pod, no NAT: the limit.
    Direct,
    /// Passthrough VIP: the cloud routes the VIP to the node, which DNATs it (KUBE-FW).
    Passthrough,
    /// Proxy-mode VIP: the mock cloud's L4 proxy to nodeIP:nodePort, then node DNAT.
    Proxy,
    /// Debian's haproxy in TCP mode in the cloud edge to nodeIP:nodePort: proxy mode's peer.
    Haproxy,
    /// [`Path::Direct`] over IPv6: the pod's IPv6 address routed straight, no NAT.
    DirectIpv6,
    /// [`Path::Passthrough`] over IPv6: the dual-stack Service's IPv6 VIP.
    PassthroughIpv6,
    /// A proxy-mode VIP of a second cloud edge, `cloud-mock --dataplane haproxy`, whose
    /// load balancer has the same listeners and backends (nodeIP:nodePort) as the
    /// controller's on the lab's own edge: HAProxy as the edge, driven through its API.
    HaproxyEdge,
    /// The client to nodeIP:nodePort, routed by the edge: the proxy paths' hops without a
    /// proxy (node DNAT only).
    NodePort,
}

impl Path {
    pub const ALL: [Path; 8] = [
        Path::Direct,
        Path::Passthrough,
        Path::Proxy,
        Path::Haproxy,
        Path::DirectIpv6,
        Path::PassthroughIpv6,
        Path::HaproxyEdge,
        Path::NodePort,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Path::Direct => "direct route to the pod, no NAT",
            Path::Passthrough => "passthrough VIP → node DNAT",
            Path::Proxy => "proxy-mode VIP (own edge) → NodePort",
            Path::Haproxy => "standalone haproxy TCP → NodePort",
            Path::DirectIpv6 => "IPv6 direct route to the pod, no NAT",
            Path::PassthroughIpv6 => "IPv6 passthrough VIP → node DNAT",
            Path::HaproxyEdge => "proxy-mode VIP (HAProxy edge) → NodePort",
            Path::NodePort => "direct to the NodePort",
        }
    }

    /// `ALL` rotated by `round`, so that no path always runs first (or last) in a round.
    pub fn order_for_round(round: usize) -> [Path; 8] {
        let mut order = Path::ALL;
        let len = order.len();
        order.rotate_left(round % len);
        order
    }
}

/// What one path measured over the whole run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PathMeasurement {
    /// Receiver-side throughput of each round's transfer, bit/s.
    pub throughput: Vec<f64>,
    /// Time of each successful request, one list per round.
    pub latency_rounds: Vec<Vec<Duration>>,
    /// Failed requests, by error.
    pub failures: BTreeMap<String, usize>,
}

impl PathMeasurement {
    /// Every successful request's time, all rounds together.
    pub fn latencies(&self) -> Vec<Duration> {
        self.latency_rounds.concat()
    }
}

/// Everything the run measured, and how.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Measurements {
    pub paths: BTreeMap<Path, PathMeasurement>,
    pub transfer_seconds: u32,
    pub rounds: usize,
    pub requests: u32,
    /// `/proc/loadavg` before and after: how busy the shared machine was.
    pub load_before: String,
    pub load_after: String,
    /// `haproxy -v`'s first line.
    pub haproxy_version: String,
    /// The load-balancer churn on each edge, under steady traffic.
    pub churn: BTreeMap<Edge, ChurnMeasurement>,
}

/// A cloud edge the run drives: the lab's own, and the HAProxy one beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Edge {
    /// The lab's cloud-mock, `--dataplane proxy`: its own listeners.
    Own,
    /// A second cloud-mock in the same edge namespace, `--dataplane haproxy`.
    Haproxy,
}

impl Edge {
    pub const ALL: [Edge; 2] = [Edge::Own, Edge::Haproxy];

    pub fn label(self) -> &'static str {
        match self {
            Edge::Own => "own proxy edge",
            Edge::Haproxy => "HAProxy edge",
        }
    }
}

/// Load balancers created one after another on one edge while another of its load
/// balancers carries steady traffic.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChurnMeasurement {
    /// Creates asked for.
    pub asked: usize,
    /// From each create call to the first answered request on the new VIP, for those that
    /// answered within the bound.
    pub create_to_traffic: Vec<Duration>,
    /// Created load balancers that did not answer within the bound.
    pub never_answered: usize,
    /// Creates the API refused, by error.
    pub create_errors: BTreeMap<String, usize>,
    /// The steady load balancer's requests: times of the answered ones, failures by error.
    pub steady_latencies: Vec<Duration>,
    pub steady_failures: BTreeMap<String, usize>,
    /// How long the creates took, first to last answer.
    pub elapsed: Duration,
    /// The HAProxy edge's reloads around the churn (none for the own edge).
    pub reloads: Option<Reloads>,
}

/// An HAProxy edge's reloads by reason (`new_frontend`, …), before and after the churn.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reloads {
    pub before: BTreeMap<String, u64>,
    pub after: BTreeMap<String, u64>,
}

impl Reloads {
    /// Reloads during the churn, by reason.
    pub fn during(&self) -> BTreeMap<String, u64> {
        self.after
            .iter()
            .map(|(reason, n)| {
                let before = self.before.get(reason).copied().unwrap_or(0);
                (reason.clone(), n.saturating_sub(before))
            })
            .collect()
    }
}

/// `counts` as `reason: n, …`, or `none`.
fn by_reason(counts: &BTreeMap<String, u64>) -> String {
    if counts.values().all(|n| *n == 0) {
        return "none".to_owned();
    }
    counts
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(reason, n)| format!("{reason}: {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl ChurnMeasurement {
    pub fn steady_failed(&self) -> usize {
        self.steady_failures.values().sum()
    }

    pub fn steady_sent(&self) -> usize {
        self.steady_latencies.len() + self.steady_failed()
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum IperfError {
    #[error("iperf3 output is not JSON ({0}): {1:?}")]
    NotJson(String, String),
    #[error("iperf3 failed: {0}")]
    Failed(String),
    #[error("iperf3 output has no end.sum_received.bits_per_second")]
    NoResult,
}

/// The receiver-side throughput (bit/s) of an `iperf3 -J` client run.
pub fn iperf_throughput(json: &str) -> Result<f64, IperfError> {
    let value: serde_json::Value = serde_json::from_str(json).map_err(|e| {
        let head: String = json.chars().take(200).collect();
        IperfError::NotJson(e.to_string(), head)
    })?;
    if let Some(error) = value.get("error").and_then(serde_json::Value::as_str) {
        return Err(IperfError::Failed(error.to_owned()));
    }
    value
        .pointer("/end/sum_received/bits_per_second")
        .and_then(serde_json::Value::as_f64)
        .filter(|bps| *bps > 0.0)
        .ok_or(IperfError::NoResult)
}

/// Median of unsorted numbers (the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_unstable_by(f64::total_cmp);
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// `total` split into `parts` near-equal chunks (the first ones one larger), none empty.
pub fn split(total: u32, parts: usize) -> Vec<u32> {
    let parts = u32::try_from(parts.max(1))
        .unwrap_or(u32::MAX)
        .min(total.max(1));
    (0..parts)
        .map(|i| total / parts + u32::from(i < total % parts))
        .collect()
}

/// haproxy in TCP mode, one `listen` section per (bind, server) pair, with Debian's
/// default timeouts and nothing tuned: the configuration a user would start from.
pub fn haproxy_config(forwards: &[(SocketAddrV4, SocketAddrV4)]) -> String {
    let mut config = String::from(
        "global\n    maxconn 4096\n\ndefaults\n    mode tcp\n    timeout connect 5s\n    timeout client 50s\n    timeout server 50s\n",
    );
    for (i, (bind, server)) in forwards.iter().enumerate() {
        let _ = write!(
            config,
            "\nlisten fwd{i}\n    bind {bind}\n    server node {server}\n"
        );
    }
    config
}

/// One figure of the data-plane sections: a path against the limit it is compared with
/// in the same run, and the targets of its throughput (at least) and latency (at most).
struct Comparison {
    path: Path,
    limit: Path,
    throughput: Option<f64>,
    latency: Option<f64>,
}

impl Comparison {
    const fn new(path: Path, limit: Path) -> Self {
        Self {
            path,
            limit,
            throughput: None,
            latency: None,
        }
    }

    const fn held_to(self, throughput: f64, latency: f64) -> Self {
        Self {
            throughput: Some(throughput),
            latency: Some(latency),
            ..self
        }
    }

    fn suffix(&self) -> &'static str {
        if self.path == Path::Haproxy {
            " (the peer)"
        } else {
            ""
        }
    }
}

/// Every comparison, in the report's order.
const COMPARISONS: [Comparison; 8] = [
    Comparison::new(Path::Passthrough, Path::Direct)
        .held_to(PASSTHROUGH_VS_DIRECT, PASSTHROUGH_LATENCY_VS_DIRECT),
    Comparison::new(Path::PassthroughIpv6, Path::DirectIpv6)
        .held_to(PASSTHROUGH_VS_DIRECT, PASSTHROUGH_LATENCY_VS_DIRECT),
    Comparison::new(Path::Proxy, Path::Haproxy).held_to(PROXY_VS_HAPROXY, PROXY_VS_HAPROXY),
    Comparison::new(Path::Proxy, Path::Direct),
    Comparison::new(Path::Haproxy, Path::Direct),
    Comparison::new(Path::HaproxyEdge, Path::NodePort),
    Comparison::new(Path::Proxy, Path::NodePort),
    Comparison::new(Path::Proxy, Path::HaproxyEdge),
];

fn gbit(bits_per_second: f64) -> Value {
    Value::GbitPerSecond(bits_per_second / 1e9)
}

fn seconds(duration: Duration) -> Value {
    Value::Seconds(duration.as_secs_f64())
}

/// The report: a throughput and a latency section, each figure against its same-run limit.
pub fn sections(m: &Measurements) -> Vec<Section> {
    let throughput = |path: Path| {
        m.paths
            .get(&path)
            .and_then(|p| median(&p.throughput))
            .map(gbit)
    };
    let latency = |path: Path, p: f64| {
        m.paths
            .get(&path)
            .and_then(|pm| quantile(&pm.latencies(), p / 100.0))
            .map(seconds)
    };
    let row = |what: String,
               ours: Option<Value>,
               limit: Path,
               limit_value: Option<Value>,
               target: Option<Target>| {
        ours.map(|ours| Row {
            what,
            ours,
            limit: limit_value.map(|v| (limit.label().to_owned(), v)),
            target,
        })
    };

    let throughput_rows: Vec<Row> = COMPARISONS
        .iter()
        .filter_map(|c| {
            row(
                format!("throughput, {}{}", c.path.label(), c.suffix()),
                throughput(c.path),
                c.limit,
                throughput(c.limit),
                c.throughput.map(Target::RatioAtLeast),
            )
        })
        .collect();
    let mut latency_rows = Vec::new();
    for p in [50.0, 99.0] {
        latency_rows.extend(COMPARISONS.iter().filter_map(|c| {
            row(
                format!("p{p} request, {}{}", c.path.label(), c.suffix()),
                latency(c.path, p),
                c.limit,
                latency(c.limit, p),
                c.latency.map(Target::RatioAtMost),
            )
        }));
    }

    let mut throughput_notes = vec![format!(
        "Method: one node, one pod, so every path has the same hops (client → edge → node → pod) and differs only in NAT/proxying; the lab is dual-stack, and the passthrough Services are dual-stack, so the IPv6 paths cross the same hops over IPv6. One TCP stream, `iperf3 -c … -t {}` from the outside client `c1`, server in the pod; receiver-side rate; median of {} rounds, the paths interleaved in a rotating order. Direct: a route to the pod range (IPv6: the pod's address) added in the edge for that measurement only.",
        m.transfer_seconds, m.rounds
    )];
    for path in Path::ALL {
        if let Some(pm) = m.paths.get(&path) {
            let rounds: Vec<String> = pm
                .throughput
                .iter()
                .map(|bps| format!("{:.2}", bps / 1e9))
                .collect();
            throughput_notes.push(format!(
                "{}: rounds {} Gbit/s.",
                path.label(),
                rounds.join(", ")
            ));
        }
    }
    throughput_notes.push(format!(
        "The peer: {}, `mode tcp` with default threads and no tuning (no splicing), one `listen` per port in the cloud edge on another VIP.",
        m.haproxy_version
    ));
    throughput_notes.push(
        "The HAProxy edge: a second `cloud-mock --dataplane haproxy` in the lab's edge namespace (its own store, API port and VIP pool, its VIPs on the edge's VIP interface as the lab's cloud puts them), its load balancers created through the SDK with the listeners, backend (the node's IP and the Service's NodePort) and health check the controller gave the own edge's, so both edges cross the same hops. Direct to the NodePort: the client to the node's IP and the same NodePort, routed by the edge (no proxy, node DNAT).".to_owned(),
    );
    throughput_notes.push(format!(
        "Machine load (/proc/loadavg) before: {}; after: {}. Other benchmarks may share the cores.",
        m.load_before, m.load_after
    ));
    throughput_notes.extend(misses(&throughput_rows));

    let mut latency_notes = vec![format!(
        "Method: {} HTTP GETs per path to the pod echo from the outside client, one after another, each on a new TCP connection (connect + request + reply + close, so conntrack/NAT set-up and, through a proxy, its upstream connect are inside every sample); nearest-rank percentiles. The latency targets are the throughput targets inverted (1/{PASSTHROUGH_VS_DIRECT} ≈ {PASSTHROUGH_LATENCY_VS_DIRECT}).",
        m.requests
    )];
    for path in Path::ALL {
        let Some(pm) = m.paths.get(&path) else {
            continue;
        };
        let latencies = pm.latencies();
        if let (Some(p50), Some(p99)) = (quantile(&latencies, 0.50), quantile(&latencies, 0.99)) {
            latency_notes.push(format!(
                "{}: p50 {} µs, p99 {} µs over {} requests; per round p50 {} µs, p99 {} µs.",
                path.label(),
                p50.as_micros(),
                p99.as_micros(),
                latencies.len(),
                per_round(&pm.latency_rounds, 50.0),
                per_round(&pm.latency_rounds, 99.0)
            ));
        }
        if !pm.failures.is_empty() {
            let failed: Vec<String> = pm
                .failures
                .iter()
                .map(|(error, n)| format!("{n}× {error}"))
                .collect();
            latency_notes.push(format!(
                "{}: failed requests (not in the percentiles): {}.",
                path.label(),
                failed.join("; ")
            ));
        }
    }
    if let (Some(passthrough), Some(direct)) = (
        latency(Path::Passthrough, 50.0),
        latency(Path::Direct, 50.0),
    ) {
        latency_notes.push(format!(
            "Every sample opens a new connection, so passthrough pays the node's NAT set-up on each (a conntrack entry, the first packet's walk KUBE-SERVICES → KUBE-FW → KUBE-SVC → KUBE-SEP, MASQUERADE): {:+.0} µs at p50 over direct in this run; a long transfer pays it once (see the throughput section). p99 of sequential requests on shared cores mostly measures scheduling delays: compare the per-round figures above.",
            (passthrough.number() - direct.number()) * 1e6
        ));
    }
    latency_notes.extend(misses(&latency_rows));

    let mut sections = vec![
        Section {
            title: "Data plane: throughput of one TCP stream, client → VIP → node → pod".to_owned(),
            rows: throughput_rows,
            notes: throughput_notes,
            ..Section::default()
        },
        Section {
            title: "Data plane: latency of small requests, client → VIP → node → pod".to_owned(),
            rows: latency_rows,
            notes: latency_notes,
            ..Section::default()
        },
    ];
    if !m.churn.is_empty() {
        sections.push(churn_section(m));
    }
    sections
}

/// The edges compared under load-balancer churn: failed steady requests (target 0) and
/// create → traffic times, the HAProxy edge's against the own edge's.
fn churn_section(m: &Measurements) -> Section {
    let asked = m.churn.values().map(|c| c.asked).max().unwrap_or(0);
    let own = m.churn.get(&Edge::Own);
    let mut rows = Vec::new();
    for edge in Edge::ALL {
        let Some(churn) = m.churn.get(&edge) else {
            continue;
        };
        rows.push(Row {
            what: format!(
                "failed requests on a steady LB while {} LBs are created, {}",
                churn.asked,
                edge.label()
            ),
            ours: Value::Count(churn.steady_failed() as f64),
            limit: None,
            target: Some(Target::AtMost(Value::Count(0.0))),
        });
        for (name, q) in [("p50", 0.50), ("p99", 0.99), ("max", 1.0)] {
            let Some(ours) = quantile(&churn.create_to_traffic, q) else {
                continue;
            };
            let limit = match edge {
                Edge::Haproxy => own
                    .and_then(|own| quantile(&own.create_to_traffic, q))
                    .map(|d| (Edge::Own.label().to_owned(), seconds(d))),
                Edge::Own => None,
            };
            let target = (edge == Edge::Haproxy && name == "p99")
                .then_some(Target::AtMost(seconds(HAPROXY_EDGE_CREATE_TO_ANSWER)));
            rows.push(Row {
                what: format!(
                    "{name} create → first answer on the new LB, {}",
                    edge.label()
                ),
                ours: seconds(ours),
                limit,
                target,
            });
        }
        if let Some(reloads) = &churn.reloads {
            rows.push(Row {
                what: format!(
                    "HAProxy reloads while {} LBs are created on a port it binds, {}",
                    churn.asked,
                    edge.label()
                ),
                ours: Value::Count(reloads.during().values().sum::<u64>() as f64),
                limit: None,
                target: Some(Target::AtMost(Value::Count(0.0))),
            });
        }
    }
    let mut notes = vec![format!(
        "Method: on each edge in turn, {asked} proxy-mode load balancers created one after another through the edge's API (cloud_mock_sdk), each with the listener (TCP 80), backend (the node's IP and the echo Service's NodePort) and health check the controller gave the echo Service's load balancer; the next create starts once the last one answered (or its bound of {} s passed). Create → first answer: from the create call to the first HTTP request from the outside client `c1` to the new VIP that is answered, tried every {} ms, each on a new connection bounded by {} ms (so the resolution is about {} ms). Meanwhile the client sends the edge's echo load balancer (created before) one request every {} ms on a new connection, each bounded by {} ms. On the HAProxy edge (its listener ports shifted by {}: HAProxy binds each port on every address of the namespace, which the kernel refuses beside the own edge's listeners on the same port) a new load balancer on a port HAProxy binds already is an entry of that port's VIP map, servers in an empty backend made ahead and its source ranges, all through the runtime API; only a port not bound yet, or no empty backend left, takes a reload. Both edges hold new load balancers provisioning for 200 ms (`--provisioning-delay=200ms`), which does not hold back the data plane.",
        CHURN_ANSWER_BOUND.as_secs(),
        CHURN_TRY_EVERY.as_millis(),
        CHURN_TRY_TIMEOUT.as_millis(),
        (CHURN_TRY_TIMEOUT + CHURN_TRY_EVERY).as_millis(),
        STEADY_PACE.as_millis(),
        STEADY_TIMEOUT.as_millis(),
        HAPROXY_EDGE_PORT_SHIFT,
    )];
    for edge in Edge::ALL {
        let Some(churn) = m.churn.get(&edge) else {
            continue;
        };
        let mut line = format!(
            "{}: {} of {} steady requests failed; {} of {} LBs answered, in {:.1} s for all",
            edge.label(),
            churn.steady_failed(),
            churn.steady_sent(),
            churn.create_to_traffic.len(),
            churn.asked,
            churn.elapsed.as_secs_f64(),
        );
        if let (Some(p50), Some(p99)) = (
            quantile(&churn.steady_latencies, 0.50),
            quantile(&churn.steady_latencies, 0.99),
        ) {
            let _ = write!(
                line,
                "; steady requests p50 {} µs, p99 {} µs",
                p50.as_micros(),
                p99.as_micros()
            );
        }
        line.push('.');
        notes.push(line);
        if let Some(reloads) = &churn.reloads {
            notes.push(format!(
                "{}: HAProxy reloads by reason (`cloud_mock_haproxy_reload_reasons_total`) before the churn, for its first two load balancers and their ports: {}; during the churn: {}.",
                edge.label(),
                by_reason(&reloads.before),
                by_reason(&reloads.during())
            ));
        }
        if churn.never_answered > 0 {
            notes.push(format!(
                "{}: {} new LBs did not answer within {} s.",
                edge.label(),
                churn.never_answered,
                CHURN_ANSWER_BOUND.as_secs()
            ));
        }
        if !churn.create_errors.is_empty() || !churn.steady_failures.is_empty() {
            let errors: Vec<String> = churn
                .create_errors
                .iter()
                .map(|(error, n)| format!("{n}× create refused: {error}"))
                .chain(
                    churn
                        .steady_failures
                        .iter()
                        .map(|(error, n)| format!("{n}× steady request: {error}")),
                )
                .collect();
            notes.push(format!("{}: {}.", edge.label(), errors.join("; ")));
        }
    }
    notes.push(format!(
        "Machine load (/proc/loadavg) before the data-plane run: {}; after: {}. Other processes may share the cores.",
        m.load_before, m.load_after
    ));
    notes.extend(misses(&rows));
    Section {
        title: format!(
            "Cloud edges: {asked} load balancers created one after another under steady traffic"
        ),
        rows,
        notes,
        ..Section::default()
    }
}

/// The `p` percentile of each round in µs, as `a / b / c`: shows the run-to-run spread.
fn per_round(rounds: &[Vec<Duration>], p: f64) -> String {
    rounds
        .iter()
        .filter_map(|round| quantile(round, p / 100.0))
        .map(|d| d.as_micros().to_string())
        .collect::<Vec<_>>()
        .join(" / ")
}

/// A note for every row that misses its target, with its ratio.
fn misses(rows: &[Row]) -> Vec<String> {
    rows.iter()
        .filter(|r| r.met() == Some(false))
        .map(|r| {
            format!(
                "MISSED: {} at {:.2}× of {}.",
                r.what,
                r.ratio().unwrap_or(f64::NAN),
                r.limit
                    .as_ref()
                    .map_or("its limit", |(what, _)| what.as_str())
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn iperf_json_gives_the_receiver_rate_or_its_error() {
        let ok = r#"{"start":{},"end":{"sum_sent":{"bits_per_second":2e10},"sum_received":{"bits_per_second":1.5e10}}}"#;
        assert_eq!(iperf_throughput(ok), Ok(1.5e10));
        let failed = r#"{"start":{},"intervals":[],"end":{},"error":"unable to connect to server: Connection refused"}"#;
        assert_eq!(
            iperf_throughput(failed),
            Err(IperfError::Failed(
                "unable to connect to server: Connection refused".to_owned()
            ))
        );
        assert_eq!(
            iperf_throughput(r#"{"end":{"sum_received":{"bits_per_second":0}}}"#),
            Err(IperfError::NoResult)
        );
        assert!(matches!(
            iperf_throughput("iperf3: error"),
            Err(IperfError::NotJson(..))
        ));
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn requests_are_split_over_rounds_without_losing_any() {
        assert_eq!(split(1000, 3), vec![334, 333, 333]);
        assert_eq!(split(100, 1), vec![100]);
        assert_eq!(split(2, 5), vec![1, 1]);
        assert_eq!(split(10, 0), vec![10]);
    }

    #[test]
    fn every_path_leads_one_round_in_turn() {
        let firsts: Vec<Path> = (0..8).map(|r| Path::order_for_round(r)[0]).collect();
        assert_eq!(firsts, Path::ALL);
        assert_eq!(Path::order_for_round(8), Path::ALL);
    }

    #[test]
    fn haproxy_gets_one_tcp_listener_per_forward() {
        let config = haproxy_config(&[
            (
                "198.51.100.254:80".parse().unwrap(),
                "198.18.0.11:30080".parse().unwrap(),
            ),
            (
                "198.51.100.254:5201".parse().unwrap(),
                "198.18.0.11:30201".parse().unwrap(),
            ),
        ]);
        assert!(config.contains("mode tcp"), "{config}");
        assert!(config.contains(
            "listen fwd0\n    bind 198.51.100.254:80\n    server node 198.18.0.11:30080\n"
        ));
        assert!(config.contains(
            "listen fwd1\n    bind 198.51.100.254:5201\n    server node 198.18.0.11:30201\n"
        ));
    }

    fn measured(throughput_gbit: f64, latency_ms: u64) -> PathMeasurement {
        PathMeasurement {
            throughput: vec![throughput_gbit * 1e9],
            latency_rounds: vec![vec![ms(latency_ms); 10]],
            failures: BTreeMap::new(),
        }
    }

    #[test]
    fn rows_compare_passthrough_with_direct_and_proxy_with_haproxy() {
        let m = Measurements {
            paths: BTreeMap::from([
                (Path::Direct, measured(10.0, 1)),
                (Path::Passthrough, measured(9.5, 1)),
                (Path::Proxy, measured(4.0, 4)),
                (Path::Haproxy, measured(8.0, 2)),
            ]),
            transfer_seconds: 5,
            rounds: 1,
            requests: 10,
            load_before: "1.0".into(),
            load_after: "1.1".into(),
            haproxy_version: "HAProxy version 2.6.12".into(),
            churn: BTreeMap::new(),
        };
        let sections = sections(&m);
        assert_eq!(sections.len(), 2);
        let rows = &sections[0].rows;
        assert_eq!(rows[0].ratio(), Some(0.95));
        assert_eq!(rows[0].met(), Some(true));
        assert_eq!(rows[1].ratio(), Some(0.5));
        assert_eq!(rows[1].met(), Some(false));
        assert!(
            sections[0]
                .notes
                .iter()
                .any(|n| n.starts_with("MISSED: throughput, proxy-mode")),
            "{:?}",
            sections[0].notes
        );
        assert!(
            sections[1].notes.iter().any(|n| n.contains(
                "p50 4000 µs, p99 4000 µs over 10 requests; per round p50 4000 µs, p99 4000 µs"
            )),
            "{:?}",
            sections[1].notes
        );
        let latency = &sections[1].rows;
        assert_eq!(latency[1].ratio(), Some(2.0));
        assert_eq!(latency[1].met(), Some(false));
        assert_eq!(latency[0].met(), Some(true));
    }

    #[test]
    fn churn_rows_hold_failures_to_zero_and_compare_the_haproxy_edge_with_the_own() {
        let churn = |failed: usize, took_ms: u64| ChurnMeasurement {
            asked: 3,
            create_to_traffic: vec![ms(took_ms), ms(took_ms), ms(2 * took_ms)],
            steady_latencies: vec![ms(1); 10],
            steady_failures: if failed == 0 {
                BTreeMap::new()
            } else {
                BTreeMap::from([("connect: refused".to_owned(), failed)])
            },
            elapsed: ms(5 * took_ms),
            ..ChurnMeasurement::default()
        };
        let counts = |pairs: &[(&str, u64)]| -> BTreeMap<String, u64> {
            pairs.iter().map(|(r, n)| ((*r).to_owned(), *n)).collect()
        };
        let haproxy = ChurnMeasurement {
            reloads: Some(Reloads {
                before: counts(&[("new_frontend", 2)]),
                after: counts(&[("new_frontend", 2), ("no_spare_backend", 1)]),
            }),
            ..churn(2, 300)
        };
        let m = Measurements {
            churn: BTreeMap::from([(Edge::Own, churn(0, 100)), (Edge::Haproxy, haproxy)]),
            ..Measurements::default()
        };
        let sections = sections(&m);
        assert_eq!(sections.len(), 3);
        let section = &sections[2];
        let rows: Vec<(&str, Option<bool>, Option<f64>)> = section
            .rows
            .iter()
            .map(|r| {
                (
                    r.what.as_str(),
                    r.met(),
                    r.ratio().map(|x| (x * 100.0).round() / 100.0),
                )
            })
            .collect();
        assert_eq!(
            rows,
            vec![
                (
                    "failed requests on a steady LB while 3 LBs are created, own proxy edge",
                    Some(true),
                    None
                ),
                (
                    "p50 create → first answer on the new LB, own proxy edge",
                    None,
                    None
                ),
                (
                    "p99 create → first answer on the new LB, own proxy edge",
                    None,
                    None
                ),
                (
                    "max create → first answer on the new LB, own proxy edge",
                    None,
                    None
                ),
                (
                    "failed requests on a steady LB while 3 LBs are created, HAProxy edge",
                    Some(false),
                    None
                ),
                (
                    "p50 create → first answer on the new LB, HAProxy edge",
                    None,
                    Some(3.0)
                ),
                (
                    "p99 create → first answer on the new LB, HAProxy edge",
                    Some(false),
                    Some(3.0)
                ),
                (
                    "max create → first answer on the new LB, HAProxy edge",
                    None,
                    Some(3.0)
                ),
                (
                    "HAProxy reloads while 3 LBs are created on a port it binds, HAProxy edge",
                    Some(false),
                    None
                ),
            ]
        );
        assert!(
            section
                .notes
                .iter()
                .any(|n| n == "HAProxy edge: 2 of 12 steady requests failed; 3 of 3 LBs answered, in 1.5 s for all; steady requests p50 1000 µs, p99 1000 µs."),
            "{:?}",
            section.notes
        );
        assert!(
            section
                .notes
                .iter()
                .any(|n| n == "HAProxy edge: 2× steady request: connect: refused.")
        );
        assert!(
            section.notes.iter().any(|n| n.ends_with(
                "before the churn, for its first two load balancers and their ports: new_frontend: 2; during the churn: no_spare_backend: 1."
            )),
            "{:?}",
            section.notes
        );
    }

    #[test]
    fn a_path_without_numbers_leaves_its_rows_out_and_failures_are_noted() {
        let mut proxy = measured(4.0, 4);
        proxy.failures.insert("connect: timed out".into(), 2);
        let m = Measurements {
            paths: BTreeMap::from([(Path::Proxy, proxy)]),
            ..Measurements::default()
        };
        let sections = sections(&m);
        assert!(sections[0].rows.iter().all(|r| r.limit.is_none()));
        assert!(
            sections[1]
                .notes
                .iter()
                .any(|n| n.contains("2× connect: timed out"))
        );
    }
}
