//! `tandem-bench`: runs the benchmarks, prints their tables and writes BENCHMARKS.md.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use tandem_bench::report::{Section, markdown, marked, splice};
use tandem_bench::{BenchOptions, controller, curves, dataplane, nodeproxy};

#[derive(Parser, Debug)]
#[command(
    name = "tandem-bench",
    version,
    about = "Tandem's benchmarks: ratios to limits measured in the same run"
)]
struct Cli {
    /// Which benchmarks to run.
    #[arg(value_enum, default_value_t = Which::All)]
    which: Which,
    /// Small scales, to check that the benchmarks run (numbers are not meaningful).
    #[arg(long, env = "TANDEM_BENCH_QUICK")]
    quick: bool,
    /// The node proxy benchmark measures only this data path (both by default).
    #[arg(long, env = "TANDEM_BENCH_PROXY_MODE", value_enum)]
    proxy_mode: Option<tandem_common::ProxyMode>,
    /// Where to write the report. `dataplane` or `curves` alone replaces only its own block
    /// in it.
    #[arg(long, env = "TANDEM_BENCH_OUT", default_value = "BENCHMARKS.md")]
    out: PathBuf,
    /// Where the scale curves' SVG files go, relative to the report's folder.
    #[arg(long, env = "TANDEM_BENCH_PLOTS", default_value = "docs/bench")]
    plots: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    All,
    Nodeproxy,
    Controller,
    Dataplane,
    /// The scale curves: the node proxy and the controller at more sizes, drawn as SVG.
    Curves,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let options = BenchOptions {
        quick: cli.quick,
        proxy_mode: cli.proxy_mode,
    };
    let mut sections: Vec<Section> = Vec::new();
    let wanted = |w: Which| cli.which == Which::All || cli.which == w;
    // One at a time: they must not share the machine's cores with each other.
    if wanted(Which::Nodeproxy) {
        sections.extend(nodeproxy::run(&options).context("node proxy benchmark")?);
    }
    if wanted(Which::Controller) {
        sections.extend(controller::run(&options).context("controller benchmark")?);
    }
    // The data plane's sections are one block of the report, which a run of `dataplane`
    // alone replaces.
    let data_plane = if wanted(Which::Dataplane) {
        let tables: Vec<String> = dataplane::run(&options)
            .context("data plane benchmark")?
            .iter()
            .map(markdown)
            .collect();
        Some(tables.join("\n"))
    } else {
        None
    };
    let curves = if wanted(Which::Curves) {
        let report_dir = cli.out.parent().unwrap_or(Path::new("."));
        let section =
            curves::run(&options, report_dir, &cli.plots).context("scale curves benchmark")?;
        Some(markdown(&section))
    } else {
        None
    };
    let tables: Vec<String> = sections.iter().map(markdown).collect();
    for table in tables.iter().chain(&data_plane).chain(&curves) {
        println!("{table}");
    }
    let block = match (cli.which, &data_plane, &curves) {
        (Which::Dataplane, Some(body), _) => Some((dataplane::BLOCK, body)),
        (Which::Curves, _, Some(body)) => Some((curves::BLOCK, body)),
        _ => None,
    };
    if let Some((name, body)) = block {
        // The other sections come from other runs: only this block is replaced.
        let existing = match std::fs::read_to_string(&cli.out) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(error) => {
                return Err(error).with_context(|| format!("reading {}", cli.out.display()));
            }
        };
        std::fs::write(&cli.out, splice(&existing, name, body))
            .with_context(|| format!("writing {}", cli.out.display()))?;
        println!("wrote its block into {}", cli.out.display());
        return Ok(());
    }
    let tables: Vec<String> = tables
        .into_iter()
        .chain(data_plane.map(|d| marked(dataplane::BLOCK, &d)))
        .chain(curves.map(|c| marked(curves::BLOCK, &c)))
        .collect();
    let report = format!(
        "# Benchmarks\n\nEvery figure is compared with a limit measured in the same run on the same machine.\n\n\
         Machine: {}\n\nReproduce (as root): `cargo build --release --workspace --bins && sudo target/release/tandem-bench {}{}{}`\n\n{}",
        machine(),
        format!("{:?}", cli.which).to_lowercase(),
        cli.proxy_mode
            .map(|mode| format!(" --proxy-mode {}", mode.as_str()))
            .unwrap_or_default(),
        if cli.quick { " --quick" } else { "" },
        tables.join("\n")
    );
    std::fs::write(&cli.out, report).with_context(|| format!("writing {}", cli.out.display()))?;
    println!("wrote {}", cli.out.display());
    Ok(())
}

/// CPU count, kernel, iptables version and date, as the report's header.
fn machine() -> String {
    let run = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_else(|| "?".to_owned())
    };
    format!(
        "{} CPUs, {} RAM, kernel {}, {}, {}",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        run("sh", &["-c", "free -g | awk '/Mem:/{print $2\" GiB\"}'"]),
        run("uname", &["-r"]),
        run("iptables", &["--version"]),
        run("date", &["-u", "+%Y-%m-%d"]),
    )
}
