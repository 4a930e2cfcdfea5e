//! `tandem-controller`: flags, logging, signals; everything else lives in the library.

use anyhow::Context as _;
use clap::Parser;
use tandem_controller::cli::{Args, LogFormat};
use tandem_controller::runtime;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    match args.log_format {
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init(),
        LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).init(),
    }
    let client = runtime::kube_client(args.kubeconfig.as_deref()).await?;
    let token = runtime::read_token(&args.cloud_token_file).await?;
    let cancel = CancellationToken::new();
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let on_signal = cancel.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = sigterm.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupt: shutting down"),
        }
        on_signal.cancel();
    });
    runtime::run(client, args.settings(token), cancel)
        .await
        .context("controller stopped")
}
