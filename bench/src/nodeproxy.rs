//! Benchmark: node proxy sync (issues 8, 17 and 14).
//!
//! For each iptables backend and each scale, in fresh network namespaces: the first sync
//! through the node proxy's real change tracker, incremental rule builder and `Syncer`
//! against a raw `iptables-restore` of the same payload into another fresh namespace; one
//! endpoint added and removed (an EndpointSlice watch event fed to the tracker) against a
//! raw restore of the same changed-chain payload, with our own time per change and, at the
//! headline scale, the network programming latency over 100 changes; and the peak RSS of
//! the real `tandem-nodeproxy` binary against the API server stand-in.
//!
//! Then the same scales in nftables mode (`nft`), each figure against the kernel's own part
//! (the same netlink batch sent alone) and `nft -f` of the same transaction, plus the
//! first-packet latency with 10,000 Services in the table.

mod cluster;
mod kernel;
mod nft;
mod nft_summary;
mod rss;
mod summary;

use std::time::Duration;

use anyhow::Context;
use tandem_common::ProxyMode;
use tandem_netlab::RunPrefix;
use tandem_nodeproxy::backend::Backend;

use crate::BenchOptions;
use crate::report::Section;
use cluster::{Scale, ServiceKind};
use rss::DataPathFlags;
use summary::{BackendResult, RssResult, ScaleResult};

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
    /// At least this many add/remove pairs per run (a change is cheap next to a restore).
    min_rounds: usize,
    /// The table the first-packet latency is measured through (its last Service the target).
    first_packet_scale: Scale,
    first_packet_rounds: usize,
    connects_per_round: usize,
    rss_scale: Scale,
}

fn plan(quick: bool) -> Plan {
    let lb = |services| Scale {
        kind: ServiceKind::LoadBalancer,
        services,
        endpoints: 10,
    };
    let cip = |services| Scale {
        kind: ServiceKind::ClusterIp,
        services,
        endpoints: 10,
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
                min_rounds: 2,
                first_packet_scale: cip(300),
                first_packet_rounds: 2,
                connects_per_round: 50,
                rss_scale: cip(300),
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
            min_rounds: 10,
            first_packet_scale: cip(10_000),
            first_packet_rounds: 6,
            connects_per_round: 500,
            rss_scale: cip(10_000),
        },
    }
}

pub fn run(options: &BenchOptions) -> anyhow::Result<Vec<Section>> {
    anyhow::ensure!(
        nix::unistd::Uid::effective().is_root(),
        "the node proxy benchmark needs root (network namespaces, iptables, nftables)"
    );
    if let Err(error) = tandem_netlab::remove_stale_namespaces() {
        tracing::warn!(%error, "cannot remove namespaces of dead runs");
    }
    let binary = tandem_lab::binaries::locate("tandem-nodeproxy")?;
    let plan = plan(options.quick);
    let prefix = RunPrefix::next_for_this_process();
    let wanted = |mode: ProxyMode| options.proxy_mode.is_none_or(|only| only == mode);
    let mut sections = Vec::new();
    if wanted(ProxyMode::Iptables) {
        let backends = kernel::available_backends();
        anyhow::ensure!(!backends.is_empty(), "no iptables-restore found");
        let mut results = Vec::new();
        for backend in backends {
            let mut scales = Vec::new();
            for planned in &plan.scales {
                scales.push(
                    measure_scale(&prefix, backend, planned)
                        .with_context(|| format!("{backend}, {}", planned.scale.label()))?,
                );
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
        sections.extend(summary::sections(&results));
    }
    if wanted(ProxyMode::Nftables) {
        sections.push(nft_summary::section(&measure_nftables(
            &prefix, &binary, &plan,
        )?));
    }
    Ok(sections)
}

fn measure_nftables(
    prefix: &RunPrefix,
    binary: &std::path::Path,
    plan: &Plan,
) -> anyhow::Result<nft_summary::NftResult> {
    let mut scales = Vec::new();
    for planned in &plan.scales {
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
            let measure_run = || nft::measure_sync(prefix, generated.clone(), rounds);
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
    })
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
        // The nftables mode's targets name 10,000 Services.
        assert_eq!(full.nftables.first_packet_scale.services, 10_000);
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
            for p in &plan.scales {
                cluster::generate(p.scale).unwrap();
            }
            cluster::generate(plan.nftables.first_packet_scale).unwrap();
        }
    }
}
