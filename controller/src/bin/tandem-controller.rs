//! `tandem-controller`: flags, logging, signals; everything else lives in the library.

use anyhow::Context as _;
use clap::Parser;
use tandem_controller::cli::{Args, Command};
use tandem_controller::{release, runtime};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tandem_common::init_logging(args.log_format);
    let client = tandem_common::kube_client(args.kubeconfig.as_deref()).await?;
    let settings = args.settings(args.cloud_config().await?)?;
    if let Some(Command::ReleaseLoadBalancers(release_args)) = &args.command {
        return release::run(client, &settings, release_args)
            .await
            .context("release-load-balancers");
    }
    let cancel = CancellationToken::new();
    tandem_common::cancel_on_shutdown_signal(cancel.clone());
    runtime::run(client, settings, cancel)
        .await
        .context("controller stopped")
}
