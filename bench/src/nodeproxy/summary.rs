//! Measurements → report sections (pure): medians, rows with their limits and targets,
//! and notes that say where the time went and why a target was missed.

use std::time::Duration;

use tandem_nodeproxy::datapath::iptables::backend::Backend;

use super::cluster::{Scale, ServiceKind, thousands};
use super::kernel::{Incremental, SyncRun};
use super::kube_proxy::KubeProxyRun;
use super::rss::{self, RssRun};
use crate::controller::quantile;
use crate::report::{Row, Section, Target, Value};

/// Our overhead over a raw restore of the same first-sync payload.
const FIRST_SYNC_RATIO: f64 = 1.5;
/// An incremental sync against a raw restore of only the changed chains.
const INCREMENTAL_RATIO: f64 = 1.2;
/// Our own time per change (tracking, build, diff; the restore process excluded).
const OWN_SECONDS: f64 = 0.005;
const RSS_MIB: f64 = 200.0;
/// The issue's target for nftables mode: peak RSS at 10,000 ClusterIP Services × 10 at
/// most 150 MiB. Only that mode is measured at that scale.
const NFTABLES_RSS: (Scale, f64) = (
    Scale {
        kind: ServiceKind::ClusterIp,
        services: 10_000,
        endpoints: 10,
        dual_stack: false,
    },
    150.0,
);

/// The peak RSS bound of a scale: [`NFTABLES_RSS`] at its scale, [`RSS_MIB`] otherwise.
fn rss_mib(scale: Scale) -> f64 {
    match NFTABLES_RSS {
        (nftables, bound) if nftables == scale => bound,
        _ => RSS_MIB,
    }
}

/// Absolute target for one change at the headline scale: on nf_tables the raw restore
/// alone is ~144 ms (iptables-nft reads the table first); legacy has only the ratio.
fn incremental_seconds(backend: Backend) -> Option<f64> {
    match backend {
        Backend::Nft => Some(0.170),
        Backend::Legacy => None,
    }
}

/// Absolute first-sync target at the headline scale (2,700 LoadBalancer × 10).
fn first_sync_seconds(backend: Backend) -> f64 {
    match backend {
        Backend::Nft => 5.0,
        Backend::Legacy => 1.5,
    }
}

/// Every measurement of one scale on one backend.
#[derive(Debug, Clone)]
pub struct ScaleResult {
    pub scale: Scale,
    /// The scale the absolute targets name.
    pub headline: bool,
    pub runs: Vec<SyncRun>,
    /// Raw restores of each run's first-sync payload into a fresh namespace.
    pub raw_first: Vec<Duration>,
    /// kube-proxy given the same cluster on the same backend, where it was run.
    pub kube_proxy: Option<KubeProxyResult>,
}

/// kube-proxy's run beside ours, or why there is none.
#[derive(Debug, Clone)]
pub struct KubeProxyResult {
    /// As it names itself (`kube-proxy --version`).
    pub version: String,
    pub run: Result<KubeProxyRun, String>,
}

#[derive(Debug, Clone)]
pub struct RssResult {
    pub scale: Scale,
    pub loaded: RssRun,
    pub empty: RssRun,
}

#[derive(Debug, Clone)]
pub struct BackendResult {
    pub backend: Backend,
    pub scales: Vec<ScaleResult>,
    pub rss: Option<RssResult>,
}

/// The middle value (the mean of the two middle ones for an even count); zero when empty.
pub fn median(values: &[Duration]) -> Duration {
    let mut sorted = values.to_vec();
    sorted.sort();
    match sorted.len() {
        0 => Duration::ZERO,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2,
    }
}

pub(super) fn seconds(d: Duration) -> Value {
    Value::Seconds(d.as_secs_f64())
}

pub(super) fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1e6)
}

pub(super) fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

pub(super) fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

pub fn sections(results: &[BackendResult]) -> Vec<Section> {
    results.iter().map(backend_section).collect()
}

fn backend_section(result: &BackendResult) -> Section {
    let backend = result.backend;
    let mut section = Section {
        title: format!("Node proxy sync — {backend} ({})", backend.restore()),
        ..Section::default()
    };
    for scale in &result.scales {
        scale_rows(backend, scale, &mut section);
    }
    if let Some(rss) = &result.rss {
        let (row, note) = rss_row(rss);
        section.rows.push(row);
        section.notes.push(note);
    }
    let missed: Vec<&Row> = section
        .rows
        .iter()
        .filter(|r| r.met() == Some(false))
        .collect();
    if !missed.is_empty() {
        let names: Vec<&str> = missed.iter().map(|r| r.what.as_str()).collect();
        section.notes.push(format!(
            "MISSED on {backend}: {}. The breakdowns above say where the time goes.",
            names.join("; ")
        ));
    }
    if !result.scales.iter().any(|scale| scale.kube_proxy.is_some()) {
        section
            .notes
            .push("kube-proxy not measured: TANDEM_KUBE_PROXY names no binary.".into());
    }
    section
}

/// p50 and p99 of the network programming latency over `latencies` (not empty).
pub(super) fn latency_rows(label: &str, latencies: &[Duration]) -> Vec<Row> {
    [("p50", 0.5), ("p99", 0.99)]
        .into_iter()
        .map(|(name, q)| Row {
            what: format!(
                "network programming latency {name}, {label} (EndpointSlice change seen → rules applied, {} changes)",
                latencies.len()
            ),
            ours: seconds(quantile(latencies, q).unwrap_or_default()),
            limit: None,
            target: None,
        })
        .collect()
}

/// The peak RSS row and the note on how it was measured.
pub(super) fn rss_row(rss: &RssResult) -> (Row, String) {
    let row = Row {
        what: format!("peak RSS of tandem-nodeproxy, {}", rss.scale.label()),
        ours: Value::MiB(rss.loaded.peak_mib),
        limit: Some((
            "the same binary, empty cluster".into(),
            Value::MiB(rss.empty.peak_mib),
        )),
        target: Some(Target::AtMost(Value::MiB(rss_mib(rss.scale)))),
    };
    let note = format!(
        "Peak RSS is VmHWM of the real binary after its first sync (its /healthz answered 200) \
         and the periodic sync after it, which compares the rules with a full rebuild (sync period \
         {}), against the API server stand-in in the same namespace; from start to first sync it \
         took {} ({} with an empty cluster), listing every Service and EndpointSlice over HTTPS \
         included, and the periodic sync ended {} later.",
        rss::SYNC_PERIOD,
        secs(rss.loaded.to_first_sync),
        secs(rss.empty.to_first_sync),
        secs(rss.loaded.to_periodic_sync)
    );
    (row, note)
}

fn scale_rows(backend: Backend, result: &ScaleResult, section: &mut Section) {
    let label = result.scale.label();
    let Some(example) = result.runs.first() else {
        section
            .notes
            .push(format!("{label}: no run completed, nothing to report."));
        return;
    };
    let totals: Vec<Duration> = result.runs.iter().map(|r| r.first.total).collect();
    let ours = median(&totals);
    let raw = median(&result.raw_first);
    let raw_limit = (
        "raw iptables-restore of the same payload, fresh netns".to_owned(),
        seconds(raw),
    );
    section.rows.push(Row {
        what: format!("first sync, {label} (convert + build + apply)"),
        ours: seconds(ours),
        limit: Some(raw_limit.clone()),
        target: Some(Target::RatioAtMost(FIRST_SYNC_RATIO)),
    });
    if result.headline {
        section.rows.push(Row {
            what: format!("first sync, {label}, absolute"),
            ours: seconds(ours),
            limit: Some(raw_limit),
            target: Some(Target::AtMost(Value::Seconds(first_sync_seconds(backend)))),
        });
    }
    let convert_build = median(
        &result
            .runs
            .iter()
            .map(|r| r.first.convert_build)
            .collect::<Vec<_>>(),
    );
    let restores: Vec<String> = example
        .first
        .written
        .restores
        .iter()
        .map(|(table, elapsed)| format!("{} {}", table.as_str(), secs(*elapsed)))
        .collect();
    section.notes.push(format!(
        "{label}: ruleset of {} chains and {} rules ({} payload); first sync median of {} {} = \
         convert + build {} + restores ({}, first run) + the rest (inspecting the empty tables, the \
         canary, process spawns); raw restore median {}.",
        thousands(example.first.written.chains),
        thousands(example.first.written.rules),
        mib(example.first.written.text.len()),
        plural(totals.len(), "run"),
        secs(ours),
        secs(convert_build),
        restores.join(", "),
        secs(raw),
    ));
    let added: Vec<Incremental> = result.runs.iter().flat_map(|r| r.added.clone()).collect();
    let removed: Vec<Incremental> = result.runs.iter().flat_map(|r| r.removed.clone()).collect();
    for (event, changes) in [("added", &added), ("removed", &removed)] {
        if changes.is_empty() {
            continue;
        }
        incremental_rows(backend, &label, event, result.headline, changes, section);
    }
    let all: Vec<Incremental> = added.iter().chain(&removed).copied().collect();
    if all.is_empty() {
        return;
    }
    let own: Vec<Duration> = all.iter().map(|c| c.own).collect();
    section.rows.push(Row {
        what: format!(
            "our own time per change, {label} (tracking + build + diff, restore process excluded)"
        ),
        ours: seconds(median(&own)),
        limit: None,
        target: Some(Target::AtMost(Value::Seconds(OWN_SECONDS))),
    });
    if result.headline {
        let latencies: Vec<Duration> = all.iter().map(|c| c.ours).collect();
        section.rows.extend(latency_rows(&label, &latencies));
    }
    if let Some(kube_proxy) = &result.kube_proxy {
        let added = median(&added.iter().map(|c| c.ours).collect::<Vec<_>>());
        kube_proxy_rows(&label, ours, added, kube_proxy, section);
    }
}

/// Our first sync and one endpoint added against kube-proxy's, same cluster and backend.
fn kube_proxy_rows(
    label: &str,
    first_sync: Duration,
    endpoint_added: Duration,
    kube_proxy: &KubeProxyResult,
    section: &mut Section,
) {
    let version = &kube_proxy.version;
    let run = match &kube_proxy.run {
        Ok(run) => run,
        Err(reason) => {
            section
                .notes
                .push(format!("{version}, {label}: not measured: {reason}."));
            return;
        }
    };
    section.rows.push(Row {
        what: format!("first sync, {label}, beside kube-proxy"),
        ours: seconds(first_sync),
        limit: Some((
            format!("{version}: its own first sync, same cluster and backend"),
            seconds(run.first_sync),
        )),
        target: None,
    });
    section.rows.push(Row {
        what: format!("one endpoint added, {label}, beside kube-proxy"),
        ours: seconds(endpoint_added),
        limit: Some((
            format!("{version}: the slice written → its sync ended"),
            seconds(run.endpoint_added),
        )),
        target: None,
    });
    section.notes.push(format!(
        "{version}, {label} (iptables mode, this backend's binaries first in its PATH, against \
         the API server stand-in in a fresh namespace): first sync {} by its own metric \
         (syncProxyRules, the restore included, the listing not); one endpoint added {} from \
         the slice written to the end of its sync, of which the sync itself {} (it rewrites \
         every chain of the nat table each time).",
        secs(run.first_sync),
        ms(run.endpoint_added),
        ms(run.endpoint_sync),
    ));
}

fn incremental_rows(
    backend: Backend,
    label: &str,
    event: &str,
    headline: bool,
    changes: &[Incremental],
    section: &mut Section,
) {
    let ours = median(&changes.iter().map(|c| c.ours).collect::<Vec<_>>());
    let raw = median(&changes.iter().map(|c| c.raw).collect::<Vec<_>>());
    let track_build = median(&changes.iter().map(|c| c.track_build).collect::<Vec<_>>());
    let own = median(&changes.iter().map(|c| c.own).collect::<Vec<_>>());
    let limit = (
        "raw restore of the same changed-chain payload".to_owned(),
        seconds(raw),
    );
    section.rows.push(Row {
        what: format!("one endpoint {event}, {label} (event seen → restore returned)"),
        ours: seconds(ours),
        limit: Some(limit.clone()),
        target: Some(Target::RatioAtMost(INCREMENTAL_RATIO)),
    });
    if let Some(target) = incremental_seconds(backend).filter(|_| headline) {
        section.rows.push(Row {
            what: format!("one endpoint {event}, {label}, absolute"),
            ours: seconds(ours),
            limit: Some(limit),
            target: Some(Target::AtMost(Value::Seconds(target))),
        });
    }
    let first = changes[0];
    section.notes.push(format!(
        "{label}, endpoint {event}: median of {} {} = tracking + build of the changed Service \
         port {} + diff, payload and restore {} (our own part of it, the restore process \
         excluded: {}); each wrote {} and deleted {} (the node proxy's --min-sync-period, 1 s by \
         default, may hold a change back after a recent sync; not counted).",
        plural(changes.len(), "change"),
        ms(ours),
        ms(track_build),
        ms(ours.saturating_sub(track_build)),
        ms(own),
        plural(first.written_chains, "chain"),
        first.deleted_chains,
    ));
}

pub(super) fn plural(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("{n} {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

pub(super) fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodeproxy::cluster::ServiceKind;
    use crate::nodeproxy::kernel::{FirstSync, Written};
    use tandem_nodeproxy::datapath::iptables::restore::RestoreMode;
    use tandem_proxy_rules::ruleset::Table;

    fn d(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[]), Duration::ZERO);
        assert_eq!(median(&[d(5)]), d(5));
        assert_eq!(median(&[d(9), d(1), d(5)]), d(5));
        assert_eq!(median(&[d(4), d(1), d(2), d(100)]), d(3));
    }

    fn run(total: u64, incremental: u64, raw_incremental: u64) -> SyncRun {
        let change = Incremental {
            track_build: d(incremental / 4),
            ours: d(incremental),
            own: d(incremental) / 10,
            raw: d(raw_incremental),
            written_chains: 2,
            deleted_chains: 0,
        };
        SyncRun {
            first: FirstSync {
                convert_build: d(total / 4),
                total: d(total),
                written: Written {
                    text: "*nat\nCOMMIT\n".into(),
                    mode: RestoreMode::Flush,
                    chains: 10,
                    rules: 20,
                    deleted_chains: 0,
                    restores: vec![(Table::Nat, d(total / 2))],
                },
            },
            added: vec![change],
            removed: vec![change],
        }
    }

    fn scale(services: usize) -> Scale {
        Scale {
            kind: ServiceKind::LoadBalancer,
            services,
            endpoints: 10,
            dual_stack: false,
        }
    }

    #[test]
    fn the_nftables_scale_has_the_issues_rss_bound() {
        let run = |peak_mib| RssRun {
            peak_mib,
            to_first_sync: d(1),
            to_periodic_sync: d(1),
        };
        let met = |scale, peak_mib| {
            let rss = RssResult {
                scale,
                loaded: run(peak_mib),
                empty: run(12.0),
            };
            rss_row(&rss).0.met()
        };
        assert_eq!(met(NFTABLES_RSS.0, 150.0), Some(true));
        assert_eq!(met(NFTABLES_RSS.0, 160.0), Some(false));
        assert_eq!(met(scale(2_700), 160.0), Some(true));
    }

    #[test]
    fn headline_scale_gets_absolute_targets_and_misses_are_named() {
        let result = BackendResult {
            backend: Backend::Nft,
            scales: vec![
                ScaleResult {
                    scale: scale(1_000),
                    headline: false,
                    runs: vec![run(500, 34, 30)],
                    raw_first: vec![d(400)],
                    kube_proxy: None,
                },
                ScaleResult {
                    scale: scale(2_700),
                    headline: true,
                    runs: vec![
                        run(2_000, 200, 50),
                        run(1_800, 180, 60),
                        run(1_900, 190, 70),
                    ],
                    raw_first: vec![d(1_000), d(1_200), d(1_100)],
                    kube_proxy: Some(KubeProxyResult {
                        version: "kube-proxy v1.21.2".into(),
                        run: Ok(KubeProxyRun {
                            first_sync: d(120_000),
                            endpoint_added: d(2_500),
                            endpoint_sync: d(2_400),
                        }),
                    }),
                },
            ],
            rss: Some(RssResult {
                scale: scale(2_700),
                loaded: RssRun {
                    peak_mib: 150.0,
                    to_first_sync: d(3_000),
                    to_periodic_sync: d(3_000),
                },
                empty: RssRun {
                    peak_mib: 12.0,
                    to_first_sync: d(100),
                    to_periodic_sync: d(100),
                },
            }),
        };
        let section = &sections(&[result])[0];
        let verdicts: Vec<(&str, Option<bool>)> = section
            .rows
            .iter()
            .map(|r| (r.what.as_str(), r.met()))
            .collect();
        let own = "our own time per change";
        let npl = "network programming latency";
        assert_eq!(
            verdicts,
            vec![
                (
                    "first sync, 1,000 LoadBalancer × 10 (convert + build + apply)",
                    Some(true)
                ),
                // 34 ms over 30 ms: 1.13×.
                (
                    "one endpoint added, 1,000 LoadBalancer × 10 (event seen → restore returned)",
                    Some(true)
                ),
                (
                    "one endpoint removed, 1,000 LoadBalancer × 10 (event seen → restore returned)",
                    Some(true)
                ),
                (
                    "our own time per change, 1,000 LoadBalancer × 10 (tracking + build + diff, restore process excluded)",
                    Some(true)
                ),
                // 1.9 s over 1.1 s: 1.73×, but within nf_tables' 5 s.
                (
                    "first sync, 2,700 LoadBalancer × 10 (convert + build + apply)",
                    Some(false)
                ),
                ("first sync, 2,700 LoadBalancer × 10, absolute", Some(true)),
                // 190 ms over 60 ms, and over 170 ms.
                (
                    "one endpoint added, 2,700 LoadBalancer × 10 (event seen → restore returned)",
                    Some(false)
                ),
                (
                    "one endpoint added, 2,700 LoadBalancer × 10, absolute",
                    Some(false)
                ),
                (
                    "one endpoint removed, 2,700 LoadBalancer × 10 (event seen → restore returned)",
                    Some(false)
                ),
                (
                    "one endpoint removed, 2,700 LoadBalancer × 10, absolute",
                    Some(false)
                ),
                (
                    "our own time per change, 2,700 LoadBalancer × 10 (tracking + build + diff, restore process excluded)",
                    Some(false)
                ),
                (
                    "network programming latency p50, 2,700 LoadBalancer × 10 (EndpointSlice change seen → rules applied, 6 changes)",
                    None
                ),
                (
                    "network programming latency p99, 2,700 LoadBalancer × 10 (EndpointSlice change seen → rules applied, 6 changes)",
                    None
                ),
                (
                    "first sync, 2,700 LoadBalancer × 10, beside kube-proxy",
                    None
                ),
                (
                    "one endpoint added, 2,700 LoadBalancer × 10, beside kube-proxy",
                    None
                ),
                (
                    "peak RSS of tandem-nodeproxy, 2,700 LoadBalancer × 10",
                    Some(true)
                ),
            ]
        );
        let row = |what: &str| {
            section
                .rows
                .iter()
                .find(|r| r.what.starts_with(what))
                .unwrap()
        };
        assert!((row("first sync, 2,700").ours.number() - 1.9).abs() < 1e-9);
        assert!((row(own).ours.number() - 0.0034).abs() < 1e-9);
        // p50 and p99 of 180, 180, 190, 190, 200, 200 ms.
        assert!((row(&format!("{npl} p50")).ours.number() - 0.190).abs() < 1e-9);
        assert!((row(&format!("{npl} p99")).ours.number() - 0.200).abs() < 1e-9);
        assert!(
            section
                .notes
                .iter()
                .any(|n| n.starts_with("MISSED on nf_tables")
                    && n.contains("one endpoint added, 2,700 LoadBalancer × 10, absolute"))
        );
        // Ours against kube-proxy's: 1.9 s against 120 s, 190 ms against 2.5 s.
        let kube_proxy = row("first sync, 2,700 LoadBalancer × 10, beside kube-proxy");
        assert!((kube_proxy.limit.as_ref().unwrap().1.number() - 120.0).abs() < 1e-9);
        assert!(
            section
                .notes
                .iter()
                .any(|n| n.starts_with("kube-proxy v1.21.2, 2,700") && n.contains("2400.0 ms"))
        );
    }

    #[test]
    fn a_scale_without_runs_says_so() {
        let result = BackendResult {
            backend: Backend::Nft,
            scales: vec![ScaleResult {
                scale: scale(10),
                headline: true,
                runs: vec![],
                raw_first: vec![],
                kube_proxy: None,
            }],
            rss: None,
        };
        let section = &sections(&[result])[0];
        assert!(section.rows.is_empty());
        assert!(section.notes[0].contains("no run completed"));
        assert!(
            section
                .notes
                .iter()
                .any(|n| n.contains("TANDEM_KUBE_PROXY names no binary"))
        );
    }

    #[test]
    fn a_kube_proxy_that_did_not_finish_is_named_not_tabled() {
        let mut scale_result = ScaleResult {
            scale: scale(10),
            headline: true,
            runs: vec![run(500, 34, 30)],
            raw_first: vec![d(400)],
            kube_proxy: Some(KubeProxyResult {
                version: "kube-proxy v1.21.2".into(),
                run: Err("a first sync did not come within 900s".into()),
            }),
        };
        let mut section = Section::default();
        scale_rows(Backend::Legacy, &scale_result, &mut section);
        assert!(!section.rows.iter().any(|r| r.what.contains("kube-proxy")));
        assert!(section.notes.iter().any(|n| n
            == "kube-proxy v1.21.2, 10 LoadBalancer × 10: not measured: a first sync did not come within 900s."));
        scale_result.kube_proxy = None;
        let mut section = Section::default();
        scale_rows(Backend::Legacy, &scale_result, &mut section);
        assert!(!section.notes.iter().any(|n| n.contains("kube-proxy")));
    }
}
