//! `cloud-mock`: flags, logging, signals; the server is in the library. `cloud-mock
//! copy-store ...` copies an embedded store into etcd instead.

use anyhow::Context;
use clap::Parser;
use cloud_mock::cli::{Args, COPY_STORE, CopyStoreArgs};
use cloud_mock::pools::VipPools;
use cloud_mock::store::{Store, etcd};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut argv: Vec<_> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|word| word == COPY_STORE) {
        argv.remove(1);
        return copy_store(CopyStoreArgs::parse_from(argv)).await;
    }
    let args = Args::parse_from(argv);
    tandem_common::init_logging(args.log_format);
    // One shutdown path for the server, the lifecycle task and the data plane.
    let cancel = CancellationToken::new();
    tandem_common::cancel_on_shutdown_signal(cancel.clone());
    let settings = args.settings().context("invalid --vip-pool")?;
    cloud_mock::serve(&settings, args.listen, args.tls().as_ref(), cancel)
        .await
        .context("cloud-mock failed")
}

async fn copy_store(args: CopyStoreArgs) -> anyhow::Result<()> {
    tandem_common::init_logging(Default::default());
    let data_dir = &args.data_dir;
    let from = Store::open_redb(data_dir, VipPools::default())
        .with_context(|| format!("opening the store in {}", data_dir.display()))?;
    let copied = etcd::copy_into(&from, &args.etcd.settings())
        .await
        .context("copying the store into etcd")?;
    tracing::info!(records = copied, "store copied into etcd");
    Ok(())
}
