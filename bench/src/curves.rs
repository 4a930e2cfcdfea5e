//! The scale curves (issue 27): the cost of one endpoint added against the number of
//! Services in every data path, and the controller's time to ingress against the number of
//! Services created at once, drawn as SVG files beside the report. The points are the node
//! proxy's and the controller's own measurements run at more sizes ([`nodeproxy::sweep`],
//! [`controller::sweep`]).

mod plot;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::BenchOptions;
use crate::controller::{self, IngressPoint};
use crate::nodeproxy::{self, ModeCurve, ServiceKind, thousands};
use crate::report::{Figure, Row, Section, Value};
use plot::{Plot, Series};

/// The report's block this run writes and replaces (see [`crate::report::splice`]).
pub const BLOCK: &str = "scale curves";
const CHANGE_FILE: &str = "nodeproxy-endpoint-added.svg";
const INGRESS_FILE: &str = "controller-time-to-ingress.svg";
/// From this 1-minute load average on, the note calls the 2-core machine loaded.
const LOADED: f64 = 1.0;

/// How the sweep ran, for the section's notes.
#[derive(Debug, Clone, PartialEq)]
struct RunFacts {
    took: Duration,
    /// The 1-minute load average before and after.
    load: [Option<f64>; 2],
    quick: bool,
}

/// Runs both sweeps, writes the SVGs into `plots` (a folder relative to `report_dir`) and
/// returns the section that shows them.
pub fn run(options: &BenchOptions, report_dir: &Path, plots: &Path) -> anyhow::Result<Section> {
    let started = Instant::now();
    let load_before = load_average();
    let modes = nodeproxy::sweep(options).context("node proxy sweep")?;
    let ingress = controller::sweep(options).context("controller sweep")?;
    let facts = RunFacts {
        took: started.elapsed(),
        load: [load_before, load_average()],
        quick: options.quick,
    };
    let dir = report_dir.join(plots);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (file, plot) in [
        (CHANGE_FILE, change_plot(&modes)),
        (INGRESS_FILE, ingress_plot(&ingress)),
    ] {
        let path = dir.join(file);
        std::fs::write(&path, plot::svg(&plot)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(section(&modes, &ingress, plots, &facts))
}

fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn kind_name(kind: ServiceKind) -> &'static str {
    match kind {
        ServiceKind::LoadBalancer => "LoadBalancer",
        ServiceKind::ClusterIp => "ClusterIP",
    }
}

/// Milliseconds per endpoint added against Services: a line per data path and Service
/// kind, solid for LoadBalancer Services and dashed for ClusterIP ones.
fn change_plot(modes: &[ModeCurve]) -> Plot {
    let colors = [plot::BLUE, plot::ORANGE, plot::GREEN];
    let mut series = Vec::new();
    for (mode, color) in modes.iter().zip(colors.into_iter().cycle()) {
        for kind in [ServiceKind::LoadBalancer, ServiceKind::ClusterIp] {
            let points: Vec<(f64, f64)> = mode
                .points
                .iter()
                .filter(|p| p.scale.kind == kind)
                .map(|p| (p.scale.services as f64, p.ours.as_secs_f64() * 1000.0))
                .collect();
            if points.is_empty() {
                continue;
            }
            series.push(Series {
                label: format!("{}, {}", mode.mode, kind_name(kind)),
                color,
                dashed: kind == ServiceKind::ClusterIp,
                points,
            });
        }
    }
    Plot {
        title: "Node proxy: one endpoint added".into(),
        x_label: "Services (10 endpoints each)".into(),
        y_label: "event seen → rules applied (ms)".into(),
        series,
    }
}

/// Seconds to ingress against Services created at once: p50, p99, the last one, and the
/// ideal (dashed).
fn ingress_plot(points: &[IngressPoint]) -> Plot {
    let line = |label: &str, color, dashed, value: fn(&IngressPoint) -> Duration| Series {
        label: label.into(),
        color,
        dashed,
        points: points
            .iter()
            .map(|p| (p.scale.services as f64, value(p).as_secs_f64()))
            .collect(),
    };
    Plot {
        title: "Controller: time to ingress".into(),
        x_label: "LoadBalancer Services created at once".into(),
        y_label: "create → ingress IP seen (s)".into(),
        series: vec![
            line("p50", plot::BLUE, false, |p| p.p50),
            line("p99", plot::ORANGE, false, |p| p.p99),
            line("all of them", plot::GREEN, false, |p| p.all),
            line("ideal for all of them", plot::GREY, true, |p| p.ideal),
        ],
    }
}

fn section(
    modes: &[ModeCurve],
    ingress: &[IngressPoint],
    plots: &Path,
    facts: &RunFacts,
) -> Section {
    let seconds = |d: Duration| Value::Seconds(d.as_secs_f64());
    let mut rows = Vec::new();
    for mode in modes {
        for point in &mode.points {
            rows.push(Row {
                what: format!(
                    "one endpoint added, {}, {} (median of {})",
                    mode.mode,
                    point.scale.label(),
                    point.changes
                ),
                ours: seconds(point.ours),
                limit: Some((mode.limit.to_owned(), seconds(point.limit))),
                target: None,
            });
        }
    }
    for point in ingress {
        let n = thousands(point.scale.services);
        rows.push(Row {
            what: format!("{n} Services created at once: all have an ingress IP"),
            ours: seconds(point.all),
            limit: Some(("ideal".into(), seconds(point.ideal))),
            target: None,
        });
        for (name, value) in [("p50", point.p50), ("p99", point.p99)] {
            rows.push(Row {
                what: format!("{n} Services created at once: time to ingress {name}"),
                ours: seconds(value),
                limit: None,
                target: None,
            });
        }
    }
    let setup = ingress.first().map(|p| p.scale);
    let figure = |file: &str, title: &str, caption: String| Figure {
        path: format!("{}/{file}", plots.display()),
        title: title.into(),
        caption,
    };
    let figures = vec![
        figure(
            CHANGE_FILE,
            "One endpoint added against the number of Services, per data path",
            "One endpoint added to a Service's EndpointSlice, from the watch event reaching the \
             node proxy to the rules applied: one `iptables-restore --noflush` of the changed \
             chains in the iptables modes, one netlink transaction in the nftables mode. Each \
             point is the median of the endpoints added after a first sync of the whole cluster \
             into a fresh network namespace; both axes logarithmic. Solid: LoadBalancer \
             Services (up to 2,700: the default node port range holds 2,768); dashed: \
             ClusterIP Services."
                .into(),
        ),
        figure(
            INGRESS_FILE,
            "Time to ingress against the number of LoadBalancer Services created at once",
            match setup {
                Some(scale) => format!(
                    "LoadBalancer Services created at once against the API server stand-in, \
                     the real controller (`--concurrency {}`) and cloud-mock ({} ms latency on \
                     every load-balancer call, {} ms provisioning): from each Service's create \
                     to a watch seeing its ingress IP (p50, p99) and until the last one had \
                     it, against the ideal the latency and the concurrency allow; each size a \
                     run of its own, both axes logarithmic.",
                    scale.concurrency,
                    scale.cloud_latency.as_millis(),
                    scale.provisioning_delay.as_millis()
                ),
                None => "No controller run.".into(),
            },
        ),
    ];
    let mut notes = vec![
        "The points are the measurements of the sections above, run at more sizes by the same \
         code: the node proxy benchmark's endpoint changes, with the limit beside each (a raw \
         restore of the same payload, or the same netlink batch sent again), and the \
         controller benchmark's create phase."
            .to_owned(),
        machine_note(facts),
        format!(
            "Reproduce (as root): `cargo build --release --workspace --bins && sudo \
             target/release/tandem-bench curves` rewrites this section in place and the SVGs in \
             `{}/`.",
            plots.display()
        ),
    ];
    if facts.quick {
        notes.push("`--quick`: small sizes only; the numbers mean little.".into());
    }
    Section {
        title: "Scale curves".into(),
        figures,
        rows,
        notes,
    }
}

fn machine_note(facts: &RunFacts) -> String {
    let load = |value: Option<f64>| value.map_or_else(|| "?".to_owned(), |v| format!("{v:.1}"));
    let loaded = facts.load.iter().flatten().any(|&v| v >= LOADED);
    format!(
        "Took {}, on {}: load average (1 min) {} at the start and {} at the end.{}",
        match facts.took.as_secs() {
            seconds @ 0..=119 => format!("{seconds} s"),
            seconds => format!("{} minutes", seconds / 60),
        },
        if loaded {
            "a machine shared with other builds"
        } else {
            "an otherwise idle machine"
        },
        load(facts.load[0]),
        load(facts.load[1]),
        if loaded {
            " Limits were measured in the same moments, so the ratios hold; the absolute \
             times are slower than on an idle machine, and the sections above come from \
             other runs."
        } else {
            ""
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodeproxy::{CurvePoint, Scale};

    fn ms(value: u64) -> Duration {
        Duration::from_millis(value)
    }

    fn modes() -> Vec<ModeCurve> {
        let point = |kind, services, ours| CurvePoint {
            scale: Scale {
                kind,
                services,
                endpoints: 10,
                dual_stack: false,
            },
            ours: ms(ours),
            limit: ms(ours),
            changes: 5,
        };
        vec![ModeCurve {
            mode: "iptables, nf_tables".into(),
            limit: "raw iptables-restore of the same payload",
            points: vec![
                point(ServiceKind::LoadBalancer, 100, 20),
                point(ServiceKind::LoadBalancer, 2_700, 140),
                point(ServiceKind::ClusterIp, 10_000, 450),
            ],
        }]
    }

    fn facts(load: f64) -> RunFacts {
        RunFacts {
            took: Duration::from_secs(600),
            load: [Some(0.2), Some(load)],
            quick: false,
        }
    }

    #[test]
    fn each_data_path_gets_a_solid_and_a_dashed_line() {
        let plot = change_plot(&modes());
        let lines: Vec<(&str, bool, usize)> = plot
            .series
            .iter()
            .map(|s| (s.label.as_str(), s.dashed, s.points.len()))
            .collect();
        assert_eq!(
            lines,
            [
                ("iptables, nf_tables, LoadBalancer", false, 2),
                ("iptables, nf_tables, ClusterIP", true, 1)
            ]
        );
        assert_eq!(plot.series[1].points, [(10_000.0, 450.0)]);
    }

    #[test]
    fn the_section_shows_both_figures_every_point_and_how_it_ran() {
        let scale = controller::Scale {
            services: 300,
            concurrency: 16,
            cloud_latency: ms(20),
            provisioning_delay: ms(200),
            node_debounce: ms(200),
            initial_nodes: 3,
        };
        let ingress = [IngressPoint {
            scale,
            p50: ms(300),
            p99: ms(900),
            all: ms(1_000),
            ideal: ms(750),
        }];
        let loaded = section(&modes(), &ingress, Path::new("docs/bench"), &facts(3.5));
        let paths: Vec<&str> = loaded.figures.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "docs/bench/nodeproxy-endpoint-added.svg",
                "docs/bench/controller-time-to-ingress.svg"
            ]
        );
        assert!(loaded.figures[1].caption.contains("`--concurrency 16`"));
        // Three node proxy points, three rows per controller size.
        assert_eq!(loaded.rows.len(), 6);
        assert!(
            loaded.rows[2]
                .what
                .contains("10,000 ClusterIP × 10 (median of 5)")
        );
        assert!(
            loaded
                .notes
                .iter()
                .any(|n| n.contains("shared with other builds") && n.contains("3.5 at the end"))
        );
        let idle = section(&modes(), &ingress, Path::new("docs/bench"), &facts(0.4));
        assert!(idle.notes.iter().any(|n| n.contains("otherwise idle")));
    }
}
