//! `tandem-controller`: the providers it ships, flags, logging, signals; everything else
//! lives in the library.

use anyhow::Context as _;
use tandem_controller::cli::{Args, Command};
use tandem_controller::registry::Providers;
use tandem_controller::{release, runtime};
use tokio_util::sync::CancellationToken;

/// Every provider this binary can run with, one line each (docs/providers.md); the first
/// is the default of `--cloud-provider`.
const PROVIDERS: Providers = Providers::new(&[tandem_provider_mockcloud::REGISTRATION]);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse_for(&PROVIDERS);
    tandem_common::init_logging(args.log_format);
    let client = tandem_common::kube_client(args.kubeconfig.as_deref()).await?;
    let provider = PROVIDERS.find(&args.cloud_provider)?;
    let settings = args.settings(provider, args.cloud_config(provider).await?);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_providers_do_not_clash_and_the_command_line_is_valid() {
        PROVIDERS.check().unwrap();
        Args::command_for(&PROVIDERS).debug_assert();
    }
}
