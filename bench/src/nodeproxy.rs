//! Benchmark: node proxy sync (issues 8, 17 and 14).
//!
//! For each iptables backend and each scale, in fresh network namespaces: the first sync
//! through the node proxy's real change tracker, incremental rule builder and `Syncer`
//! against a raw `iptables-restore` of the same payload into another fresh namespace; one
//! endpoint added and removed (an EndpointSlice watch event fed to the tracker) against a
//! raw restore of the same changed-chain payload, with our own time per change and, at the
//! headline scale, the network programming latency over 100 changes, and kube-proxy's
//! first sync and one endpoint added beside ours where `TANDEM_KUBE_PROXY` names it
//! (`kube_proxy`); and the peak RSS of the real `tandem-nodeproxy` binary against the API
//! server stand-in.
//!
//! Then the same scales in nftables mode (`nft`), each figure against the kernel's own part
//! (the same netlink batch sent alone) and `nft -f` of the same transaction, plus the
//! first-packet latency with 10,000 Services in the table.
//!
//! [`sweep`] measures one endpoint added at more sizes, in every data path, with the same
//! code: the points of the scale curves; [`idle`] what a node where nothing changes costs,
//! against kube-proxy v1.21.2.

mod cluster;
mod idle;
mod kernel;
mod kube_proxy;
mod nft;
mod nft_summary;
pub(crate) mod rss;
mod summary;

use std::time::Duration;

use anyhow::Context;
use tandem_common::ProxyMode;
use tandem_netlab::RunPrefix;
use tandem_nodeproxy::datapath::iptables::backend::Backend;

use crate::BenchOptions;
use crate::report::{Block, Row, Section, Target, Value};
pub use cluster::{Scale, ServiceKind, thousands};
use rss::DataPathFlags;
use summary::{BackendResult, RssResult, ScaleResult, median};

/// One scale to measure and how often.
#[derive(Debug, Clone, Copy)]
struct Planned {
    scale: Scale,
    headline: bool,
    /// First syncs (each with its raw restore), for a median.
    repetitions: usize,
    /// Endpoint add/remove pairs after each first sync.
    rounds: usize,
}

#[derive(Debug, Clone)]
struct Plan {
    scales: Vec<Planned>,
    rss_scale: Scale,
    rss_timeout: Duration,
    nftables: NftPlan,
}

/// What the nftables mode measures beyond the shared scales.
#[derive(Debug, Clone)]
struct NftPlan {
    /// Dual-stack clusters: both tables written, the changes made to `ip6 tandem`.
    dual_stack: Vec<Planned>,
    /// At least this many add/remove pairs per run (a change is cheap next to a restore).
    min_rounds: usize,
    /// The table the first-packet latency is measured through (its last Service the target).
    first_packet_scale: Scale,
    first_packet_rounds: usize,
    connects_per_round: usize,
    rss_scale: Scale,
    /// The first rounds whose changes also go through `nft -f` (seconds each at 10,000
    /// Services).
    nft_cli_rounds: usize,
}

fn plan(quick: bool) -> Plan {
    let dual = |services| Scale {
        dual_stack: true,
        ..lb(services)
    };
    let planned = |scale, headline, repetitions, rounds| Planned {
        scale,
        headline,
        repetitions,
        rounds,
    };
    if quick {
        return Plan {
            scales: vec![planned(lb(100), true, 1, 2), planned(cip(300), false, 1, 1)],
            rss_scale: lb(100),
            rss_timeout: Duration::from_secs(60),
            nftables: NftPlan {
                dual_stack: vec![planned(dual(100), false, 1, 2)],
                min_rounds: 2,
                first_packet_scale: cip(300),
                first_packet_rounds: 2,
                connects_per_round: 50,
                rss_scale: cip(300),
                nft_cli_rounds: 3,
            },
        };
    }
    Plan {
        scales: vec![
            planned(lb(1_000), false, 3, 3),
            // 2 runs × 25 rounds × (added + removed): the 100 changes of the latency rows.
            planned(lb(2_700), true, 2, 25),
            planned(cip(10_000), false, 2, 3),
        ],
        rss_scale: lb(2_700),
        rss_timeout: Duration::from_secs(300),
        nftables: NftPlan {
            dual_stack: vec![planned(dual(2_700), false, 2, 25)],
            min_rounds: 10,
            first_packet_scale: cip(10_000),
            first_packet_rounds: 6,
            connects_per_round: 500,
            rss_scale: cip(10_000),
            nft_cli_rounds: 3,
        },
    }
}

/// Root, and no namespaces left by dead runs: what every measurement here starts from.
fn start() -> anyhow::Result<RunPrefix> {
    anyhow::ensure!(
        nix::unistd::Uid::effective().is_root(),
        "the node proxy benchmark needs root (network namespaces, iptables, nftables)"
    );
    if let Err(error) = tandem_netlab::remove_stale_namespaces() {
        tracing::warn!(%error, "cannot remove namespaces of dead runs");
    }
    Ok(RunPrefix::next_for_this_process())
}

fn iptables_backends() -> anyhow::Result<Vec<Backend>> {
    let backends = kernel::available_backends();
    anyhow::ensure!(!backends.is_empty(), "no iptables-restore found");
    Ok(backends)
}

/// The report's block of the iptables mode's sections (both backends), replaced by a run
/// that measures that mode.
pub const IPTABLES_BLOCK: &str = "node proxy, iptables mode";
/// The report's block of the nftables mode's section.
pub const NFTABLES_BLOCK: &str = "node proxy, nftables mode";

/// A block per proxy mode measured, so that `--proxy-mode` replaces only its own.
pub fn run(options: &BenchOptions) -> anyhow::Result<Vec<Block>> {
    let prefix = start()?;
    let binary = tandem_lab::binaries::locate("tandem-nodeproxy")?;
    let plan = plan(options.quick);
    let mut blocks = Vec::new();
    if options.measures(ProxyMode::Iptables) {
        let kube_proxy = tandem_k3s::kube_proxy_binary()
            .map(|binary| {
                let version = kube_proxy::version(&binary)?;
                anyhow::Ok((binary, version))
            })
            .transpose()?;
        let mut results = Vec::new();
        for backend in iptables_backends()? {
            let mut scales = Vec::new();
            for planned in &plan.scales {
                let mut measured = measure_scale(&prefix, backend, planned)
                    .with_context(|| format!("{backend}, {}", planned.scale.label()))?;
                // kube-proxy beside ours at the headline scale; reported, not fatal.
                if let (true, Some((binary, version))) = (planned.headline, &kube_proxy) {
                    eprintln!(
                        "node proxy: {version}, {backend}, {}",
                        planned.scale.label()
                    );
                    let run = kube_proxy::measure(
                        &prefix,
                        binary,
                        backend,
                        cluster::generate(planned.scale)?,
                        plan.rss_timeout.max(Duration::from_secs(900)),
                    );
                    measured.kube_proxy = Some(summary::KubeProxyResult {
                        version: version.clone(),
                        run: run.map_err(|error| format!("{:#}", error.root_cause())),
                    });
                }
                scales.push(measured);
            }
            let data_path = DataPathFlags::Iptables(backend);
            let rss = measure_rss(
                &prefix,
                data_path,
                &binary,
                plan.rss_scale,
                plan.rss_timeout,
            )
            .with_context(|| format!("{backend}, peak RSS"))?;
            results.push(BackendResult {
                backend,
                scales,
                rss: Some(rss),
            });
        }
        blocks.push(Block {
            name: IPTABLES_BLOCK,
            sections: summary::sections(&results),
        });
    }
    if options.measures(ProxyMode::Nftables) {
        blocks.push(Block {
            name: NFTABLES_BLOCK,
            sections: vec![nft_summary::section(&measure_nftables(
                &prefix, &binary, &plan,
            )?)],
        });
    }
    Ok(blocks)
}

fn measure_nftables(
    prefix: &RunPrefix,
    binary: &std::path::Path,
    plan: &Plan,
) -> anyhow::Result<nft_summary::NftResult> {
    let mut scales = Vec::new();
    for planned in plan.scales.iter().chain(&plan.nftables.dual_stack) {
        let label = planned.scale.label();
        let generated = cluster::generate(planned.scale)?;
        let rounds = planned.rounds.max(plan.nftables.min_rounds);
        let (mut runs, mut limits) = (Vec::new(), Vec::new());
        for repetition in 0..planned.repetitions {
            eprintln!(
                "node proxy: nftables, {label}, run {}/{}",
                repetition + 1,
                planned.repetitions
            );
            // Alternate which goes first, so a drift in the machine's load hits both alike.
            let measure_run = || {
                nft::measure_sync(
                    prefix,
                    generated.clone(),
                    rounds,
                    plan.nftables.nft_cli_rounds,
                )
            };
            let measure_limits = || nft::measure_first_limits(prefix, &generated);
            if repetition % 2 == 0 {
                runs.push(measure_run()?);
                limits.push(measure_limits()?);
            } else {
                limits.push(measure_limits()?);
                runs.push(measure_run()?);
            }
        }
        scales.push(nft_summary::ScaleResult {
            scale: planned.scale,
            headline: planned.headline,
            runs,
            limits,
        });
    }
    let nft_plan = &plan.nftables;
    eprintln!(
        "node proxy: nftables, first-packet latency through {}",
        nft_plan.first_packet_scale.label()
    );
    let first_packet = nft::measure_first_packet(
        prefix,
        &cluster::generate(nft_plan.first_packet_scale)?,
        nft_plan.first_packet_rounds,
        nft_plan.connects_per_round,
    )
    .context("nftables, first-packet latency")?;
    let rss = measure_rss(
        prefix,
        DataPathFlags::Nftables,
        binary,
        nft_plan.rss_scale,
        plan.rss_timeout,
    )
    .context("nftables, peak RSS")?;
    Ok(nft_summary::NftResult {
        scales,
        first_packet: Some(first_packet),
        rss: Some(rss),
    })
}

fn measure_scale(
    prefix: &RunPrefix,
    backend: Backend,
    planned: &Planned,
) -> anyhow::Result<ScaleResult> {
    let generated = cluster::generate(planned.scale)?;
    let mut runs = Vec::new();
    let mut raw_first = Vec::new();
    for repetition in 0..planned.repetitions {
        eprintln!(
            "node proxy: {backend}, {}, run {}/{}",
            planned.scale.label(),
            repetition + 1,
            planned.repetitions
        );
        // Alternate which goes first, so a drift in the machine's load hits both alike.
        let ours_first = repetition % 2 == 0;
        let (run, raw) = if ours_first {
            let run = kernel::measure_sync(prefix, backend, generated.clone(), planned.rounds)?;
            let raw = kernel::measure_raw_first(prefix, backend, &run.first.written)?;
            (run, raw)
        } else {
            // The payload does not depend on the run: take it from a previous one.
            let payload = runs
                .last()
                .map(|r: &kernel::SyncRun| r.first.written.clone())
                .context("no earlier run to take the payload from")?;
            let raw = kernel::measure_raw_first(prefix, backend, &payload)?;
            let run = kernel::measure_sync(prefix, backend, generated.clone(), planned.rounds)?;
            anyhow::ensure!(
                run.first.written.text == payload.text,
                "two first syncs of the same cluster wrote different payloads"
            );
            (run, raw)
        };
        runs.push(run);
        raw_first.push(raw);
    }
    Ok(ScaleResult {
        scale: planned.scale,
        headline: planned.headline,
        runs,
        raw_first,
        kube_proxy: None,
    })
}

/// The sizes of the scale curves: LoadBalancer Services as far as the default node port
/// range allows, ClusterIP Services on to 10,000.
fn curve_scales(quick: bool) -> Vec<Scale> {
    let (load_balancers, cluster_ips): (&[usize], &[usize]) = if quick {
        (&[30, 100], &[30, 100, 300])
    } else {
        (&[100, 300, 1_000, 2_700], &[100, 300, 1_000, 2_700, 10_000])
    };
    let scales = |kind, sizes: &[usize]| {
        sizes
            .iter()
            .map(move |&services| Scale {
                kind,
                services,
                endpoints: 10,
                dual_stack: false,
            })
            .collect::<Vec<_>>()
    };
    [
        scales(ServiceKind::LoadBalancer, load_balancers),
        scales(ServiceKind::ClusterIp, cluster_ips),
    ]
    .concat()
}

/// Endpoint add/remove pairs at each size of the curves; the adds' median is the point.
fn curve_rounds(quick: bool) -> usize {
    if quick { 2 } else { 5 }
}

/// One point of a scale curve: one endpoint added at `scale` (event seen → rules applied,
/// the median of the rounds), and the limit measured beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CurvePoint {
    pub scale: Scale,
    pub ours: Duration,
    pub limit: Duration,
    /// How many endpoints were added.
    pub changes: usize,
}

/// The points of one data path.
#[derive(Debug, Clone, PartialEq)]
pub struct ModeCurve {
    /// `iptables, nf_tables`, `iptables, legacy` or `nftables`.
    pub mode: String,
    /// What the limit is.
    pub limit: &'static str,
    pub points: Vec<CurvePoint>,
}

/// The cost of one endpoint added at every size of the curves, in each data path asked
/// for: a first sync of the whole cluster in a fresh namespace, then the rounds, through
/// the same measurements as the tables.
pub fn sweep(options: &BenchOptions) -> anyhow::Result<Vec<ModeCurve>> {
    let prefix = start()?;
    let scales = curve_scales(options.quick);
    let rounds = curve_rounds(options.quick);
    let point = |scale: Scale, added: Vec<(Duration, Duration)>| {
        let (ours, limits): (Vec<Duration>, Vec<Duration>) = added.into_iter().unzip();
        CurvePoint {
            scale,
            ours: median(&ours),
            limit: median(&limits),
            changes: ours.len(),
        }
    };
    let mut curves = Vec::new();
    if options.measures(ProxyMode::Iptables) {
        for backend in iptables_backends()? {
            let mut points = Vec::new();
            for &scale in &scales {
                eprintln!("scale curves: iptables, {backend}, {}", scale.label());
                let run = kernel::measure_sync(&prefix, backend, cluster::generate(scale)?, rounds)
                    .with_context(|| format!("{backend}, {}", scale.label()))?;
                points.push(point(
                    scale,
                    run.added.iter().map(|c| (c.ours, c.raw)).collect(),
                ));
            }
            curves.push(ModeCurve {
                mode: format!("iptables, {backend}"),
                limit: "raw iptables-restore of the same payload",
                points,
            });
        }
    }
    if options.measures(ProxyMode::Nftables) {
        let mut points = Vec::new();
        for &scale in &scales {
            eprintln!("scale curves: nftables, {}", scale.label());
            let run = nft::measure_sync(&prefix, cluster::generate(scale)?, rounds, 0)
                .with_context(|| format!("nftables, {}", scale.label()))?;
            points.push(point(
                scale,
                run.added.iter().map(|c| (c.ours, c.raw)).collect(),
            ));
        }
        curves.push(ModeCurve {
            mode: "nftables".into(),
            limit: "the kernel alone: the same batch sent again",
            points,
        });
    }
    Ok(curves)
}

/// The report's block of the idle node's section.
pub const IDLE_BLOCK: &str = "node proxy, idle node";
/// CPU on an idle node where the kernel announces ruleset changes: 0.1 % of a core.
const IDLE_CPU_PER_HOUR: f64 = 3.6;
/// Someone else's change repaired, where the kernel announces it.
const ANNOUNCED_REPAIR: Duration = Duration::from_secs(1);

/// The idle node: every data path (and kube-proxy v1.21.2 when `TANDEM_KUBE_PROXY` names
/// it) at 2,700 LoadBalancer and 10,000 ClusterIP Services.
pub fn idle(options: &BenchOptions) -> anyhow::Result<Block> {
    let prefix = start()?;
    let binary = tandem_lab::binaries::locate("tandem-nodeproxy")?;
    let (scales, plan) = if options.quick {
        let scales = vec![lb(100), cip(300)];
        let plan = idle::IdlePlan {
            window: Duration::from_secs(5),
            settle: Duration::from_secs(1),
            full_check_period: Duration::from_secs(2),
            timeout: Duration::from_secs(120),
        };
        (scales, plan)
    } else {
        let scales = vec![lb(2_700), cip(10_000)];
        let plan = idle::IdlePlan {
            window: Duration::from_secs(60),
            settle: Duration::from_secs(20),
            full_check_period: Duration::from_secs(10),
            timeout: Duration::from_secs(900),
        };
        (scales, plan)
    };
    let kube_proxy = tandem_k3s::kube_proxy_binary();
    let mut data_paths: Vec<DataPathFlags> = iptables_backends()?
        .into_iter()
        .map(DataPathFlags::Iptables)
        .collect();
    data_paths.push(DataPathFlags::Nftables);
    let mut section = Section {
        title: "Node proxy on an idle node: CPU per hour, repair of someone else's change".into(),
        ..Section::default()
    };
    for scale in scales {
        let label = scale.label();
        let baseline = match &kube_proxy {
            Some(binary) => {
                eprintln!("idle node: kube-proxy v1.21, {label}");
                let proxy = idle::Proxy::KubeProxy(binary.clone());
                // Reported, not fatal: kube-proxy v1.21 may not finish a first sync of
                // 10,000 Services in time.
                match idle::measure(&prefix, &proxy, scale, plan) {
                    Ok(result) => {
                        section.notes.push(format!(
                            "kube-proxy v1.21.2 (iptables mode on iptables-nft, default flags: \
                             a canary check every --sync-period of 30 s, everything resynced \
                             hourly), {label}: {}.",
                            result.how
                        ));
                        Some(result.cpu_per_hour)
                    }
                    Err(error) => {
                        section.notes.push(format!(
                            "kube-proxy v1.21.2, {label}: not measured: {}.",
                            error.root_cause()
                        ));
                        None
                    }
                }
            }
            None => None,
        };
        for &data_path in &data_paths {
            let name = data_path_name(data_path);
            eprintln!("idle node: {name}, {label}");
            let proxy = idle::Proxy::Tandem {
                binary: binary.clone(),
                data_path,
            };
            let result = idle::measure(&prefix, &proxy, scale, plan)
                .with_context(|| format!("{name}, {label}"))?;
            let announced = data_path != DataPathFlags::Iptables(Backend::Legacy);
            section.rows.push(Row {
                what: format!("CPU per hour on an idle node, {name}, {label}"),
                ours: Value::Seconds(result.cpu_per_hour),
                limit: baseline.map(|cpu| {
                    (
                        "kube-proxy v1.21.2, same cluster".to_owned(),
                        Value::Seconds(cpu),
                    )
                }),
                target: announced.then_some(Target::AtMost(Value::Seconds(IDLE_CPU_PER_HOUR))),
            });
            if let Some(repair) = result.repair {
                section.rows.push(Row {
                    what: format!("someone else's change repaired, {name}, {label} (nat prerouting jump deleted → the sync writing it back ended)"),
                    ours: Value::Seconds(repair.as_secs_f64()),
                    limit: None,
                    target: announced.then_some(Target::AtMost(Value::Seconds(ANNOUNCED_REPAIR.as_secs_f64()))),
                });
            }
            section
                .notes
                .push(format!("{name}, {label}: {}.", result.how));
        }
        if kube_proxy.is_none() {
            section
                .notes
                .push("kube-proxy not measured: TANDEM_KUBE_PROXY names no binary.".into());
        }
    }
    section.notes.push(format!(
        "Method: the real binaries, each in a fresh namespace against the API server stand-in \
         with the cluster loaded, default flags; CPU is that of the process and every \
         descendant (iptables-restore, iptables-save; finished or still running) from /proc, \
         over {:?} after the first sync and {:?} of settling. On the nf_tables backends the \
         full check (every rule read back, the rules compared with a full rebuild) is hourly \
         and not in the window: its CPU is measured in a second run with one every {:?}, and \
         added once per hour; kube-proxy's hourly resync is added as the CPU of its first \
         sync. iptables-legacy announces no change: its node proxy reads its rules back \
         every --sync-period (30 s), where the repair is found.",
        plan.window, plan.settle, plan.full_check_period
    ));
    Ok(Block {
        name: IDLE_BLOCK,
        sections: vec![section],
    })
}

fn data_path_name(data_path: DataPathFlags) -> &'static str {
    match data_path {
        DataPathFlags::Iptables(Backend::Nft) => "iptables-nft",
        DataPathFlags::Iptables(Backend::Legacy) => "iptables-legacy",
        DataPathFlags::Nftables => "nftables mode",
    }
}

fn lb(services: usize) -> Scale {
    Scale {
        kind: ServiceKind::LoadBalancer,
        services,
        endpoints: 10,
        dual_stack: false,
    }
}

fn cip(services: usize) -> Scale {
    Scale {
        kind: ServiceKind::ClusterIp,
        services,
        endpoints: 10,
        dual_stack: false,
    }
}

fn measure_rss(
    prefix: &RunPrefix,
    data_path: DataPathFlags,
    binary: &std::path::Path,
    scale: Scale,
    timeout: Duration,
) -> anyhow::Result<RssResult> {
    eprintln!("node proxy: {data_path:?}, peak RSS at {}", scale.label());
    let empty = rss::measure(prefix, data_path, binary, None, timeout)?;
    let loaded = rss::measure(
        prefix,
        data_path,
        binary,
        Some(cluster::generate(scale)?),
        timeout,
    )?;
    Ok(RssResult {
        scale,
        loaded,
        empty,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_full_plan_covers_the_issue_and_quick_every_path() {
        let full = plan(false);
        let labels: Vec<String> = full.scales.iter().map(|p| p.scale.label()).collect();
        assert_eq!(
            labels,
            [
                "1,000 LoadBalancer × 10",
                "2,700 LoadBalancer × 10",
                "10,000 ClusterIP × 10"
            ]
        );
        let headline: Vec<_> = full.scales.iter().filter(|p| p.headline).collect();
        assert_eq!(headline.len(), 1);
        assert_eq!(headline[0].scale.services, 2_700);
        assert_eq!(full.rss_scale.services, 2_700);
        // The nftables mode's targets name 10,000 Services, and 2,700 dual-stack ones.
        assert_eq!(full.nftables.first_packet_scale.services, 10_000);
        let dual: Vec<String> = full
            .nftables
            .dual_stack
            .iter()
            .map(|p| p.scale.label())
            .collect();
        assert_eq!(dual, ["2,700 dual-stack LoadBalancer × 10"]);
        assert_eq!(full.nftables.rss_scale.services, 10_000);
        for plan in [full, plan(true)] {
            assert!(
                plan.scales
                    .iter()
                    .all(|p| p.repetitions >= 1 && p.rounds >= 1)
            );
            assert!(plan.scales.iter().any(|p| p.headline));
            assert!(
                plan.scales
                    .iter()
                    .any(|p| p.scale.kind == ServiceKind::ClusterIp)
            );
            for p in plan.scales.iter().chain(&plan.nftables.dual_stack) {
                cluster::generate(p.scale).unwrap();
            }
            cluster::generate(plan.nftables.first_packet_scale).unwrap();
        }
    }

    #[test]
    fn the_curves_reach_10_000_services_and_every_size_fits() {
        for quick in [false, true] {
            let scales = curve_scales(quick);
            for kind in [ServiceKind::LoadBalancer, ServiceKind::ClusterIp] {
                let sizes: Vec<usize> = scales
                    .iter()
                    .filter(|s| s.kind == kind)
                    .map(|s| s.services)
                    .collect();
                assert!(sizes.len() >= 2 && sizes.is_sorted(), "{kind:?}: {sizes:?}");
            }
            for scale in scales {
                cluster::generate(scale).unwrap();
            }
        }
        let largest = curve_scales(false).iter().map(|s| s.services).max();
        assert_eq!(largest, Some(10_000));
    }
}
