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
}

impl Path {
    pub const ALL: [Path; 6] = [
        Path::Direct,
        Path::Passthrough,
        Path::Proxy,
        Path::Haproxy,
        Path::DirectIpv6,
        Path::PassthroughIpv6,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Path::Direct => "direct route to the pod, no NAT",
            Path::Passthrough => "passthrough VIP → node DNAT",
            Path::Proxy => "proxy-mode VIP (cloud-mock) → NodePort",
            Path::Haproxy => "haproxy TCP → NodePort",
            Path::DirectIpv6 => "IPv6 direct route to the pod, no NAT",
            Path::PassthroughIpv6 => "IPv6 passthrough VIP → node DNAT",
        }
    }

    /// `ALL` rotated by `round`, so that no path always runs first (or last) in a round.
    pub fn order_for_round(round: usize) -> [Path; 6] {
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

    let throughput_rows: Vec<Row> = [
        row(
            format!("throughput, {}", Path::Passthrough.label()),
            throughput(Path::Passthrough),
            Path::Direct,
            throughput(Path::Direct),
            Some(Target::RatioAtLeast(PASSTHROUGH_VS_DIRECT)),
        ),
        row(
            format!("throughput, {}", Path::PassthroughIpv6.label()),
            throughput(Path::PassthroughIpv6),
            Path::DirectIpv6,
            throughput(Path::DirectIpv6),
            Some(Target::RatioAtLeast(PASSTHROUGH_VS_DIRECT)),
        ),
        row(
            format!("throughput, {}", Path::Proxy.label()),
            throughput(Path::Proxy),
            Path::Haproxy,
            throughput(Path::Haproxy),
            Some(Target::RatioAtLeast(PROXY_VS_HAPROXY)),
        ),
        row(
            format!("throughput, {}", Path::Proxy.label()),
            throughput(Path::Proxy),
            Path::Direct,
            throughput(Path::Direct),
            None,
        ),
        row(
            format!("throughput, {} (the peer)", Path::Haproxy.label()),
            throughput(Path::Haproxy),
            Path::Direct,
            throughput(Path::Direct),
            None,
        ),
    ]
    .into_iter()
    .flatten()
    .collect();

    let mut latency_rows = Vec::new();
    for p in [50.0, 99.0] {
        latency_rows.extend(row(
            format!("p{p} request, {}", Path::Passthrough.label()),
            latency(Path::Passthrough, p),
            Path::Direct,
            latency(Path::Direct, p),
            Some(Target::RatioAtMost(PASSTHROUGH_LATENCY_VS_DIRECT)),
        ));
        latency_rows.extend(row(
            format!("p{p} request, {}", Path::PassthroughIpv6.label()),
            latency(Path::PassthroughIpv6, p),
            Path::DirectIpv6,
            latency(Path::DirectIpv6, p),
            Some(Target::RatioAtMost(PASSTHROUGH_LATENCY_VS_DIRECT)),
        ));
        latency_rows.extend(row(
            format!("p{p} request, {}", Path::Proxy.label()),
            latency(Path::Proxy, p),
            Path::Haproxy,
            latency(Path::Haproxy, p),
            Some(Target::RatioAtMost(PROXY_VS_HAPROXY)),
        ));
        latency_rows.extend(row(
            format!("p{p} request, {} (the peer)", Path::Haproxy.label()),
            latency(Path::Haproxy, p),
            Path::Direct,
            latency(Path::Direct, p),
            None,
        ));
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

    vec![
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
    ]
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
        let firsts: Vec<Path> = (0..6).map(|r| Path::order_for_round(r)[0]).collect();
        assert_eq!(firsts, Path::ALL);
        assert_eq!(Path::order_for_round(6), Path::ALL);
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
