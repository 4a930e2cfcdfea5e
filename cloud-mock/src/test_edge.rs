//! An edge on 127.0.0.1 started from its real flags, for tests here and in other crates
//! (feature `test-support`): no data plane, one VIP pool, the tokens of a token file.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;

use clap::Parser;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::cli::Args;
use crate::server::serve_on;

/// Starts an edge keeping its data in `data_dir` and accepting the tokens of
/// `token_file` (`--token-file`), until `cancel`; its URL.
///
/// # Panics
/// When the flags are refused or loopback cannot be bound: a broken test setup.
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub async fn serve_token_file(
    data_dir: &Path,
    token_file: &Path,
    cancel: CancellationToken,
) -> String {
    let args = Args::try_parse_from([
        "cloud-mock".as_ref(),
        "--data-dir".as_ref(),
        data_dir.as_os_str(),
        "--token-file".as_ref(),
        token_file.as_os_str(),
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
