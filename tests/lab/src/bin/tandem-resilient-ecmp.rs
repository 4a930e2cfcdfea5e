//! `tandem-resilient-ecmp`: the lab router's resilient ECMP, run in the router's network
//! namespace beside its BGP speaker (see `tandem_lab::resilient_ecmp`).

use clap::Parser;
use tandem_lab::resilient_ecmp::{self, GroupSettings};

#[derive(Debug, Parser)]
#[command(
    name = "tandem-resilient-ecmp",
    about = "Mirrors the BGP speaker's routes of one kernel table into resilient nexthop groups in the main table"
)]
struct Args {
    /// The kernel table the BGP speaker writes its routes into.
    #[arg(long)]
    source_table: u32,
    /// Buckets per group.
    #[arg(long, default_value_t = 128)]
    buckets: u16,
    /// A bucket no packet hit for this many seconds may go to a next hop that joined.
    #[arg(long, default_value_t = 5)]
    idle_timer_seconds: u32,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tandem_common::init_logging(tandem_common::LogFormat::Text);
    resilient_ecmp::run(
        args.source_table,
        GroupSettings {
            buckets: args.buckets,
            idle_timer_seconds: args.idle_timer_seconds,
        },
    )
}
