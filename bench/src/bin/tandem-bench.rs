//! `tandem-bench`: runs the benchmarks, prints their tables and writes BENCHMARKS.md.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use tandem_bench::report::machine::Machine;
use tandem_bench::report::{
    Block, HEADER_BLOCK, Run, block_body, header, markdown, splice, summary,
};
use tandem_bench::{BenchOptions, controller, curves, dataplane, edgecluster, nodeproxy};

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
    /// Where to write the report. A run replaces only its own blocks in it (and the header
    /// and the summary), leaving the other blocks and the hand-kept text as they are.
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
    /// The edge cluster: its store on a real 3-member etcd (create latency against redb,
    /// VIPs handed out twice, writes lost through a killed etcd leader, leadership taken
    /// over), then the lab's edge cluster losing edges under traffic (BGP with BFD, and
    /// the L2 mode)
    EdgeCluster,
    /// A node where nothing changes: the node proxy's CPU per hour against kube-proxy
    /// v1.21.2 (TANDEM_KUBE_PROXY), and the repair of someone else's change.
    Idle,
    /// No benchmark: the report's summary made again from its tables (after a hand edit).
    Summary,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    if cli.which == Which::Summary {
        let document = read_report(&cli.out)?;
        return write_report(&cli.out, &with_summary(&document)?);
    }
    let options = BenchOptions {
        quick: cli.quick,
        proxy_mode: cli.proxy_mode,
    };
    let mut blocks: Vec<Block> = Vec::new();
    let wanted = |w: Which| cli.which == Which::All || cli.which == w;
    // One at a time: they must not share the machine's cores with each other.
    if wanted(Which::Nodeproxy) {
        blocks.extend(nodeproxy::run(&options).context("node proxy benchmark")?);
    }
    if wanted(Which::Idle) {
        blocks.push(nodeproxy::idle(&options).context("idle node benchmark")?);
    }
    if wanted(Which::Controller) {
        blocks.push(Block {
            name: controller::BLOCK,
            sections: controller::run(&options).context("controller benchmark")?,
        });
    }
    if wanted(Which::Dataplane) {
        blocks.push(Block {
            name: dataplane::BLOCK,
            sections: dataplane::run(&options).context("data plane benchmark")?,
        });
    }
    if wanted(Which::EdgeCluster) {
        blocks.push(Block {
            name: edgecluster::BLOCK,
            sections: edgecluster::run(&options).context("edge cluster benchmark")?,
        });
    }
    if wanted(Which::Curves) {
        let report_dir = cli.out.parent().unwrap_or(Path::new("."));
        let section =
            curves::run(&options, report_dir, &cli.plots).context("scale curves benchmark")?;
        blocks.push(Block {
            name: curves::BLOCK,
            sections: vec![section],
        });
    }
    for section in blocks.iter().flat_map(|b| &b.sections) {
        println!("{}", markdown(section));
    }
    let machine = Machine::probe();
    let run = Run {
        date: jiff::Timestamp::now().strftime("%Y-%m-%d").to_string(),
        command: command_line(&cli),
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        kernel: machine.kernel.clone(),
    };
    // Only this run's blocks are replaced: the others come from other runs, and the text
    // between them is kept by hand. In a new file the header and the summary come first.
    let mut document = read_report(&cli.out)?;
    document = splice(&document, HEADER_BLOCK, &header(&machine))?;
    if tandem_bench::report::block(&document, summary::BLOCK)?.is_none() {
        document = splice(&document, summary::BLOCK, "## Summary")?;
    }
    for block in &blocks {
        document = splice(&document, block.name, &block_body(&run, &block.sections))?;
    }
    write_report(&cli.out, &with_summary(&document)?)
}

/// The document with its summary made again from its tables, so that the summary agrees
/// with every block, this run's and the earlier ones'.
fn with_summary(document: &str) -> Result<String> {
    let made = summary::summary(document).context("making the summary from the tables")?;
    Ok(splice(document, summary::BLOCK, &made)?)
}

/// The report as it is, or nothing when there is none yet.
fn read_report(path: &Path) -> Result<String> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(error) => Err(error).with_context(|| format!("reading {}", path.display())),
    }
}

fn write_report(path: &Path, document: &str) -> Result<()> {
    std::fs::write(path, document).with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// The command as a reader would type it again.
fn command_line(cli: &Cli) -> String {
    let which = cli.which.to_possible_value().map_or_else(
        || format!("{:?}", cli.which),
        |value| value.get_name().to_owned(),
    );
    let mut command = format!("tandem-bench {which}");
    if let Some(mode) = cli.proxy_mode {
        command.push_str(&format!(" --proxy-mode {}", mode.as_str()));
    }
    if cli.quick {
        command.push_str(" --quick");
    }
    command
}
