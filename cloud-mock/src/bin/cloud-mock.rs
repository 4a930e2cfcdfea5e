//! `cloud-mock`: flags, logging, signals; the server is in the library.

use anyhow::Context;
use clap::Parser;
use cloud_mock::cli::Args;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tandem_common::init_logging(args.log_format);
    // One shutdown path for the server, the lifecycle task and the data plane.
    let cancel = CancellationToken::new();
    tandem_common::cancel_on_shutdown_signal(cancel.clone());
    let settings = args.settings().context("invalid --vip-pool")?;
    cloud_mock::serve(&settings, args.listen, args.tls().as_ref(), cancel)
        .await
        .context("cloud-mock failed")
}
