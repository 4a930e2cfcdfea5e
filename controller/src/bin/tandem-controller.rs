//! `tandem-controller`: flags, logging, signals; everything else lives in the library.

use anyhow::Context as _;
use clap::Parser;
use tandem_controller::cli::Args;
use tandem_controller::runtime;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tandem_common::init_logging(args.log_format);
    let client = tandem_common::kube_client(args.kubeconfig.as_deref()).await?;
    let token = runtime::read_token(&args.cloud_token_file).await?;
    let cancel = CancellationToken::new();
    tandem_common::cancel_on_shutdown_signal(cancel.clone());
    runtime::run(client, args.settings(token), cancel)
        .await
        .context("controller stopped")
}
