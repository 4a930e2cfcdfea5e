//! Benchmark: the controller against the API server stand-in (in process) and cloud-mock
//! (its binary, no data plane, 20 ms injected latency), running the real
//! `tandem-controller` binary. Every address is on 127.0.0.1; no packet leaves loopback.
//!
//! Measured: N LoadBalancer Services created at once (time until all have an ingress IP,
//! p50/p99 time-to-ingress, cloud calls and API writes per Service), then one node added
//! (backend updates and time). Each time is compared with the ideal the cloud's latency and
//! the configured concurrency allow. [`sweep`] runs the same at more sizes: the points of
//! the time-to-ingress curve.

mod harness;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;

use crate::BenchOptions;
use crate::report::{Row, Section, Target, Value};

/// Latency injected into every cloud load-balancer call (the issue's 20 ms).
const CLOUD_LATENCY: Duration = Duration::from_millis(20);
/// The controller's `--concurrency`.
const CONCURRENCY: u16 = 16;
/// Time a new LB stays provisioning in the cloud: the cloud's own floor per Service.
const PROVISIONING_DELAY: Duration = Duration::from_millis(200);
/// The controller's node debounce: a configured wait before backends are updated.
const NODE_DEBOUNCE: Duration = Duration::from_millis(200);
/// Nodes registered before the Services; one more is added in the second phase.
const INITIAL_NODES: usize = 3;
/// The create path's budget of cloud calls per Service (issue 13): the POST and one read.
const CREATE_CALLS_TARGET: f64 = 2.0;
/// The least a node add needs per LB: one backend update.
const NODE_ADD_CALLS_MIN: f64 = 1.0;
/// Cloud route templates of the load-balancer API (cloud-mock's `route` label).
const LB_COLLECTION: &str = "/v1/loadbalancers";
const LB_ITEM: &str = "/v1/loadbalancers/{id}";

/// The report's block of the controller's section.
pub const BLOCK: &str = "controller";

pub fn run(options: &BenchOptions) -> anyhow::Result<Vec<Section>> {
    let scale = Scale::for_options(options);
    let measured = runtime()?.block_on(harness::measure(&scale))?;
    Ok(vec![sections(&scale, &measured)])
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the benchmark's tokio runtime")
}

/// How many Services the time-to-ingress curve creates at once, run by run.
fn curve_sizes(quick: bool) -> &'static [usize] {
    if quick {
        &[20, 50]
    } else {
        &[100, 300, 1_000, 2_700, 10_000]
    }
}

/// One point of the time-to-ingress curve: `scale.services` created at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IngressPoint {
    pub scale: Scale,
    pub p50: Duration,
    pub p99: Duration,
    /// Until the last Service had its ingress IP.
    pub all: Duration,
    /// The fastest the cloud's latency and the concurrency allow for all of them.
    pub ideal: Duration,
}

/// The benchmark's runs at every size of the curve, one after another.
pub fn sweep(options: &BenchOptions) -> anyhow::Result<Vec<IngressPoint>> {
    let runtime = runtime()?;
    curve_sizes(options.quick)
        .iter()
        .map(|&services| {
            let scale = Scale {
                services,
                ..Scale::for_options(options)
            };
            eprintln!("scale curves: controller, {services} Services");
            let measured = runtime
                .block_on(harness::measure(&scale))
                .with_context(|| format!("controller, {services} Services"))?;
            let at = |q| {
                quantile(&measured.time_to_ingress, q)
                    .with_context(|| format!("no time to ingress measured at {services} Services"))
            };
            Ok(IngressPoint {
                scale,
                p50: at(0.5)?,
                p99: at(0.99)?,
                all: measured.create_total,
                ideal: create_ideal(&scale),
            })
        })
        .collect()
}

/// What one run is sized and configured as.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    pub services: usize,
    pub concurrency: u16,
    pub cloud_latency: Duration,
    pub provisioning_delay: Duration,
    pub node_debounce: Duration,
    pub initial_nodes: usize,
}

impl Scale {
    fn for_options(options: &BenchOptions) -> Self {
        Self {
            services: if options.quick { 50 } else { 1000 },
            concurrency: CONCURRENCY,
            cloud_latency: CLOUD_LATENCY,
            provisioning_delay: PROVISIONING_DELAY,
            node_debounce: NODE_DEBOUNCE,
            initial_nodes: INITIAL_NODES,
        }
    }
}

/// Counter values by (route, method), summed over statuses.
pub type RouteCounts = BTreeMap<(String, String), f64>;

/// Everything the harness measured; [`sections`] turns it into rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    /// From the first create sent until the watch saw the last ingress IP.
    pub create_total: Duration,
    /// Per Service: from its create request until the watch saw its ingress IP.
    pub time_to_ingress: Vec<Duration>,
    /// Cloud LB-API requests made while the Services were created, by route and method.
    pub create_cloud_calls: RouteCounts,
    /// API server writes (resourceVersion increments) during the create phase, our own
    /// Service creates excluded.
    pub create_api_writes: u64,
    /// Events among those writes.
    pub create_events: u64,
    /// Cloud LB-API requests after a label and another writer's condition were written to
    /// every Service (nothing its LB depends on).
    pub unrelated_writes_cloud_calls: RouteCounts,
    /// From the node's create until the cloud had answered one PUT per LB.
    pub node_add_total: Duration,
    /// Cloud LB-API requests after the node add, counted once things were quiet again.
    pub node_add_cloud_calls: RouteCounts,
    /// LBs whose backends include the added node at the end.
    pub lbs_with_new_node: usize,
    /// The cloud's mean answer time, all LBs stored and nothing else running, for a GET by
    /// id and for the LIST by tags the controller looks LBs up with.
    pub cloud_get_mean: Duration,
    pub cloud_list_mean: Duration,
}

/// Parses Prometheus text and sums `cloud_mock_http_requests_total` by (route, method).
pub fn parse_request_counts(text: &str) -> RouteCounts {
    let mut counts = RouteCounts::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("cloud_mock_http_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        let (Some(route), Some(method)) = (label(labels, "route"), label(labels, "method")) else {
            continue;
        };
        *counts
            .entry((route.to_owned(), method.to_owned()))
            .or_default() += value;
    }
    counts
}

/// The value of `name="..."` in a Prometheus label set (values here contain no quotes).
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let start = labels.find(&format!("{name}=\""))? + name.len() + 2;
    let len = labels[start..].find('"')?;
    Some(&labels[start..start + len])
}

/// `after − before`, dropping series that did not move.
pub fn counts_delta(before: &RouteCounts, after: &RouteCounts) -> RouteCounts {
    after
        .iter()
        .map(|(key, value)| (key.clone(), value - before.get(key).copied().unwrap_or(0.0)))
        .filter(|(_, delta)| *delta > 0.0)
        .collect()
}

/// Calls to the load-balancer API (the routes injected latency applies to).
pub fn load_balancer_calls(counts: &RouteCounts) -> f64 {
    counts
        .iter()
        .filter(|((route, _), _)| route == LB_COLLECTION || route == LB_ITEM)
        // Folded from +0.0: an empty f64 sum is -0.0, which would print as "-0".
        .fold(0.0, |total, (_, value)| total + value)
}

pub fn calls_of(counts: &RouteCounts, route: &str, method: &str) -> f64 {
    counts
        .get(&(route.to_owned(), method.to_owned()))
        .copied()
        .unwrap_or(0.0)
}

/// The `q`-quantile (0..=1) by the nearest-rank method; None when empty.
pub fn quantile(samples: &[Duration], q: f64) -> Option<Duration> {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len().max(1)) - 1).copied()
}

/// The fastest the cloud allows for `services` LBs needing `calls_per_service` calls of
/// `latency` each, `concurrency` at a time: the calls' total spread over the workers, and
/// never less than one Service's own path (`floor` plus its calls in sequence).
pub fn ideal(
    services: usize,
    calls_per_service: f64,
    latency: Duration,
    concurrency: u16,
    floor: Duration,
) -> Duration {
    let per_service = latency.mul_f64(calls_per_service);
    let spread = per_service.mul_f64(services as f64 / f64::from(concurrency.max(1)));
    spread.max(floor + per_service)
}

fn breakdown(counts: &RouteCounts, services: usize) -> String {
    counts
        .iter()
        .filter(|((route, _), _)| route == LB_COLLECTION || route == LB_ITEM)
        .map(|((route, method), value)| format!("{method} {route} {:.2}", value / services as f64))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The ideal time until every Service of `scale` has an ingress IP.
fn create_ideal(scale: &Scale) -> Duration {
    ideal(
        scale.services,
        CREATE_CALLS_TARGET,
        scale.cloud_latency,
        scale.concurrency,
        scale.provisioning_delay,
    )
}

/// The report of one run: rows with their ideals and targets, notes on method and misses.
pub fn sections(scale: &Scale, m: &Measured) -> Section {
    let n = scale.services;
    let create_calls = load_balancer_calls(&m.create_cloud_calls) / n as f64;
    let create_ideal = create_ideal(scale);
    let node_calls = load_balancer_calls(&m.node_add_cloud_calls) / n as f64;
    let node_ideal = ideal(
        n,
        NODE_ADD_CALLS_MIN,
        scale.cloud_latency,
        scale.concurrency,
        scale.node_debounce,
    );
    let puts = calls_of(&m.node_add_cloud_calls, LB_ITEM, "PUT");
    let latency_ms = scale.cloud_latency.as_millis();
    let ideal_note = format!(
        "ideal = max(Services × calls per Service × {latency_ms} ms ÷ concurrency {}, one \
         Service alone: its calls in sequence + the cloud's {} ms provisioning delay (create) \
         or the configured {} ms node debounce (node add)), with the calls a Service needs, \
         not the ones we made: {CREATE_CALLS_TARGET} on the create path (the target's \
         budget) and {NODE_ADD_CALLS_MIN} backend update per LB on a node add; so extra \
         calls show in the time ratios too",
        scale.concurrency,
        scale.provisioning_delay.as_millis(),
        scale.node_debounce.as_millis()
    );
    let mut rows = vec![
        Row {
            what: format!("{n} Services created at once: all have an ingress IP"),
            ours: Value::Seconds(m.create_total.as_secs_f64()),
            limit: Some(("ideal".into(), Value::Seconds(create_ideal.as_secs_f64()))),
            target: None,
        },
        Row {
            what: "cloud calls per Service, create path".into(),
            ours: Value::Count(create_calls),
            limit: None,
            target: Some(Target::AtMost(Value::Count(CREATE_CALLS_TARGET))),
        },
        Row {
            what: "API server writes per Service, create path".into(),
            ours: Value::Count(m.create_api_writes as f64 / n as f64),
            limit: None,
            target: None,
        },
        Row {
            what: format!(
                "cloud calls after a label + another writer's condition on all {n} Services"
            ),
            ours: Value::Count(load_balancer_calls(&m.unrelated_writes_cloud_calls)),
            limit: None,
            target: Some(Target::AtMost(Value::Count(0.0))),
        },
    ];
    let single_path = scale.provisioning_delay + scale.cloud_latency.mul_f64(CREATE_CALLS_TARGET);
    for (label, q) in [("p50", 0.5), ("p99", 0.99)] {
        if let Some(value) = quantile(&m.time_to_ingress, q) {
            rows.push(Row {
                what: format!("time-to-ingress {label} (create → watch sees ingress)"),
                ours: Value::Seconds(value.as_secs_f64()),
                limit: Some((
                    "one Service's own path".into(),
                    Value::Seconds(single_path.as_secs_f64()),
                )),
                target: None,
            });
        }
    }
    rows.extend([
        Row {
            what: format!("node added: all {n} LBs updated"),
            ours: Value::Seconds(m.node_add_total.as_secs_f64()),
            limit: Some(("ideal".into(), Value::Seconds(node_ideal.as_secs_f64()))),
            target: None,
        },
        Row {
            what: "node added: backend updates (PUT) per LB".into(),
            ours: Value::Count(puts / n as f64),
            limit: Some(("exactly one".into(), Value::Count(1.0))),
            target: Some(Target::RatioAtMost(1.0)),
        },
        Row {
            what: "node added: cloud calls per LB".into(),
            ours: Value::Count(node_calls),
            limit: Some(("one PUT".into(), Value::Count(1.0))),
            target: None,
        },
    ]);
    let injected = Some((
        "injected latency".to_owned(),
        Value::Seconds(scale.cloud_latency.as_secs_f64()),
    ));
    for (what, mean) in [
        ("GET by id", m.cloud_get_mean),
        ("LIST by tags (the controller's lookup)", m.cloud_list_mean),
    ] {
        rows.push(Row {
            what: format!("cloud-mock alone, {n} LBs stored: one {what}"),
            ours: Value::Seconds(mean.as_secs_f64()),
            limit: injected.clone(),
            target: None,
        });
    }
    let mut notes = vec![
        format!(
            "Setup: API server stand-in in process, cloud-mock binary with `--dataplane none`, \
             {latency_ms} ms injected latency on every LB call, {} ms provisioning delay; \
             real `tandem-controller` with `--concurrency {}`, cloud token bucket opened wide \
             (`--cloud-rate 100000 --cloud-burst 100000`) so the bucket is not what is \
             measured; {} nodes, then one more.",
            scale.provisioning_delay.as_millis(),
            scale.concurrency,
            scale.initial_nodes
        ),
        ideal_note,
        format!(
            "Create-path cloud calls per Service by route: {}.",
            breakdown(&m.create_cloud_calls, n)
        ),
        format!(
            "Node-add cloud calls per LB by route: {}.",
            breakdown(&m.node_add_cloud_calls, n)
        ),
        format!(
            "API server requests: the stand-in counts no requests, so writes are counted as \
             resourceVersion increments (every create/update/patch/delete of any kind, our \
             own {n} creates subtracted); {:.2} of the {:.2} writes per Service are Events. \
             Reads (the controller's watches and any GET) are not counted.",
            m.create_events as f64 / n as f64,
            m.create_api_writes as f64 / n as f64
        ),
    ];
    if puts as usize != n || m.lbs_with_new_node != n {
        notes.push(format!(
            "MISSED: after the node add the cloud saw {puts} backend PUTs for {n} LBs and \
             {} of {n} LBs list the new node; exactly one update per LB was expected.",
            m.lbs_with_new_node
        ));
    }
    if create_calls > CREATE_CALLS_TARGET {
        notes.push(format!(
            "MISSED: {create_calls:.2} cloud calls per Service on the create path (target ≤ \
             {CREATE_CALLS_TARGET}: the POST and one read of the provisioning LB)."
        ));
    }
    let unrelated = load_balancer_calls(&m.unrelated_writes_cloud_calls);
    if unrelated > 0.0 {
        notes.push(format!(
            "MISSED: {unrelated} cloud calls after writes that change nothing an LB depends \
             on ({}); such writes must not wake the reconciler.",
            breakdown(&m.unrelated_writes_cloud_calls, 1)
        ));
    }
    Section {
        title: format!("Controller: {n} LoadBalancer Services, {latency_ms} ms cloud latency"),
        rows,
        notes,
        ..Section::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: &str = r#"# HELP cloud_mock_http_requests API requests by route template, method and status
# TYPE cloud_mock_http_requests counter
cloud_mock_http_requests_total{route="/v1/loadbalancers",method="POST",status="201"} 10
cloud_mock_http_requests_total{route="/v1/loadbalancers",method="POST",status="503"} 2
cloud_mock_http_requests_total{route="/v1/loadbalancers/{id}",method="GET",status="200"} 7
cloud_mock_http_requests_total{route="/v1/admin/faults",method="PUT",status="200"} 1
cloud_mock_load_balancers{state="active"} 10
"#;

    #[test]
    fn request_counts_sum_statuses_and_keep_routes_apart() {
        let counts = parse_request_counts(METRICS);
        assert_eq!(calls_of(&counts, LB_COLLECTION, "POST"), 12.0);
        assert_eq!(calls_of(&counts, LB_ITEM, "GET"), 7.0);
        assert_eq!(calls_of(&counts, "/v1/admin/faults", "PUT"), 1.0);
        assert_eq!(
            load_balancer_calls(&counts),
            19.0,
            "admin calls are not LB calls"
        );
    }

    #[test]
    fn delta_drops_series_that_did_not_move() {
        let before = parse_request_counts(METRICS);
        let after = parse_request_counts(&METRICS.replace("} 7", "} 9"));
        let delta = counts_delta(&before, &after);
        assert_eq!(delta.len(), 1);
        assert_eq!(calls_of(&delta, LB_ITEM, "GET"), 2.0);
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let samples: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        assert_eq!(quantile(&samples, 0.5), Some(Duration::from_millis(50)));
        assert_eq!(quantile(&samples, 0.99), Some(Duration::from_millis(99)));
        assert_eq!(
            quantile(&samples[..1], 0.99),
            Some(Duration::from_millis(100))
        );
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn ideal_is_the_spread_or_one_services_path() {
        let ms = Duration::from_millis;
        // 1000 × 3 × 20 ms ÷ 16 = 3.75 s.
        assert_eq!(ideal(1000, 3.0, ms(20), 16, ms(200)), ms(3750));
        // Two Services: the provisioning floor plus one path dominates.
        assert_eq!(ideal(2, 3.0, ms(20), 16, ms(200)), ms(260));
    }

    fn measured(puts: f64, on_new_node: usize) -> Measured {
        let item = |method: &str| (LB_ITEM.to_owned(), method.to_owned());
        Measured {
            create_total: Duration::from_secs(8),
            time_to_ingress: vec![Duration::from_secs(1), Duration::from_secs(2)],
            create_cloud_calls: RouteCounts::from([
                ((LB_COLLECTION.to_owned(), "POST".to_owned()), 2.0),
                ((LB_COLLECTION.to_owned(), "GET".to_owned()), 2.0),
                (item("GET"), 4.0),
            ]),
            create_api_writes: 10,
            create_events: 4,
            unrelated_writes_cloud_calls: RouteCounts::new(),
            node_add_total: Duration::from_secs(1),
            node_add_cloud_calls: RouteCounts::from([(item("PUT"), puts), (item("GET"), 2.0)]),
            lbs_with_new_node: on_new_node,
            cloud_get_mean: Duration::from_millis(21),
            cloud_list_mean: Duration::from_millis(60),
        }
    }

    fn scale() -> Scale {
        Scale {
            services: 2,
            ..Scale::for_options(&BenchOptions {
                quick: true,
                ..BenchOptions::default()
            })
        }
    }

    #[test]
    fn rows_hold_calls_to_their_targets_and_note_misses() {
        let section = sections(&scale(), &measured(2.0, 2));
        // The ideal counts the calls a Service needs (2), not the 4 made: 200 ms + 2 × 20 ms.
        assert_eq!(
            section.rows[0].limit,
            Some(("ideal".into(), Value::Seconds(0.24)))
        );
        let calls = section
            .rows
            .iter()
            .find(|r| r.what.starts_with("cloud calls per Service"));
        assert_eq!(calls.map(|r| r.ours), Some(Value::Count(4.0)));
        assert_eq!(calls.and_then(Row::met), Some(false));
        let puts = section.rows.iter().find(|r| r.what.contains("(PUT)"));
        assert_eq!(puts.and_then(Row::met), Some(true));
        assert!(
            section
                .notes
                .iter()
                .any(|n| n.contains("4.00 cloud calls per Service"))
        );
        assert!(!section.notes.iter().any(|n| n.contains("backend PUTs")));
        let quiet = section
            .rows
            .iter()
            .find(|r| r.what.contains("another writer"));
        assert_eq!(quiet.and_then(Row::met), Some(true));
        let mut woken = measured(2.0, 2);
        woken.unrelated_writes_cloud_calls =
            RouteCounts::from([((LB_ITEM.to_owned(), "GET".to_owned()), 2.0)]);
        let woken = sections(&scale(), &woken);
        let quiet = woken
            .rows
            .iter()
            .find(|r| r.what.contains("another writer"));
        assert_eq!(quiet.and_then(Row::met), Some(false));
        assert!(woken.notes.iter().any(|n| n.contains("must not wake")));

        let doubled = sections(&scale(), &measured(4.0, 2));
        let puts = doubled.rows.iter().find(|r| r.what.contains("(PUT)"));
        assert_eq!(puts.and_then(Row::met), Some(false));
        assert!(
            doubled
                .notes
                .iter()
                .any(|n| n.contains("4 backend PUTs for 2 LBs"))
        );
        let missing = sections(&scale(), &measured(2.0, 1));
        assert!(missing.notes.iter().any(|n| n.contains("1 of 2 LBs")));
    }
}
