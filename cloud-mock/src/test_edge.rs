//! An edge on 127.0.0.1 started from its real flags, for tests here and in other crates
//! (feature `test-support`): no data plane, one VIP pool, the credentials of a token or
//! tenants file.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;

use clap::Parser;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use cloud_mock_dataplane::{DataPlaneConfig, DataPlaneKind};

use crate::Settings;
use crate::cli::Args;
use crate::credentials::TokenSource;
use crate::server::serve_on;
use crate::store::StoreSettings;

/// The settings of an edge of the API alone (no data plane), on redb in `data_dir`, with
/// fault injection on and no provisioning delay.
///
/// # Panics
/// When `vip_pools` is no valid pool list: a broken test setup.
#[allow(clippy::expect_used)]
pub fn api_only(data_dir: &Path, token: TokenSource, vip_pools: &str) -> Settings {
    Settings {
        data_dir: data_dir.to_path_buf(),
        store: StoreSettings::Redb,
        token,
        vip_pools: vip_pools.parse().expect("the VIP pools"),
        provisioning_delay: std::time::Duration::ZERO,
        fault_injection: true,
        l2: None,
        dataplane: DataPlaneConfig {
            mode: DataPlaneKind::None,
            ..DataPlaneConfig::default()
        },
    }
}

/// The router of an app made from `settings`, its lifecycle task running until `cancel`:
/// an edge to drive in-process (tower `oneshot`), without a socket.
///
/// # Panics
/// When the app cannot start: a broken test setup.
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub async fn router(settings: &Settings, cancel: &CancellationToken) -> axum::Router {
    let crate::App {
        router, lifecycle, ..
    } = crate::App::new(settings, cancel.clone())
        .await
        .expect("the app starts");
    tokio::spawn(lifecycle.run(cancel.clone()));
    router
}

/// Starts an edge keeping its data in `data_dir` and accepting the credentials of `file`
/// given as `flag` (`--token-file`, `--tenants-file`), until `cancel`; its URL.
///
/// # Panics
/// When the flags are refused or loopback cannot be bound: a broken test setup.
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub async fn serve(data_dir: &Path, flag: &str, file: &Path, cancel: CancellationToken) -> String {
    let args = Args::try_parse_from([
        "cloud-mock".as_ref(),
        "--data-dir".as_ref(),
        data_dir.as_os_str(),
        flag.as_ref(),
        file.as_os_str(),
        "--vip-pool".as_ref(),
        "127.77.0.0/24".as_ref(),
        "--dataplane".as_ref(),
        "none".as_ref(),
    ])
    .expect("the edge's flags");
    let settings = args.settings().expect("the edge's settings");
    let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        .await
        .expect("a port on loopback");
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { serve_on(&settings, listener, None, cancel).await.unwrap() });
    url
}
