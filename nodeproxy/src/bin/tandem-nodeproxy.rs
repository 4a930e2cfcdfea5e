//! `tandem-nodeproxy`: flags and logging; everything else lives in the library.

use clap::Parser;
use tandem_nodeproxy::cli::Cli;
use tandem_nodeproxy::runtime;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tandem_common::init_logging(cli.log_format);
    Ok(runtime::main(cli).await?)
}
