//! Running a lab from a test: the environment that picks the API server, the images and
//! the proxy mode, one lab at a time, on a thread of its own inside the control-plane
//! namespace.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use clap::ValueEnum;
use tandem_common::ProxyMode;

use crate::images::Images;
use crate::lab::{EdgeDataPlane, Lab, LabOptions};

/// Set to a kubeconfig to run against that (real) API server instead of the stand-in:
/// `TANDEM_E2E_KUBECONFIG=~/.kube/config cargo test -p tandem-lab --test e2e`.
pub const REAL_API_SERVER_ENV: &str = "TANDEM_E2E_KUBECONFIG";
/// Set to an image registry prefix to run the components from the images
/// `scripts/images.sh` built (`TANDEM_E2E_IMAGES=localhost/tandem`); a missing image then
/// fails the test, never falls back to the binaries.
pub const IMAGES_ENV: &str = "TANDEM_E2E_IMAGES";
/// The node proxies' `--proxy-mode` (`iptables`, the default, or `nftables`): CI runs the
/// data-path tests in both.
pub const PROXY_MODE_ENV: &str = "TANDEM_E2E_PROXY_MODE";

/// What serves the edge's proxy-mode load balancers (`proxy`, the default, or `haproxy`):
/// CI runs the proxy-mode tests through both.
pub const EDGE_DATAPLANE_ENV: &str = "TANDEM_E2E_EDGE_DATAPLANE";

/// Labs of one test binary run one at a time, so that the machine's cores are not shared by
/// several clusters.
static ONE_LAB_AT_A_TIME: Mutex<()> = Mutex::new(());

/// An IPv4 lab with `pods_per_node`, on the API server, images, proxy mode and edge data
/// plane the environment names.
pub fn options_from_env(pods_per_node: &[u32]) -> Result<LabOptions> {
    let proxy_mode = match std::env::var(PROXY_MODE_ENV) {
        Ok(value) => ProxyMode::from_str(&value, true)
            .map_err(|e| anyhow!("{PROXY_MODE_ENV}={value}: {e}"))?,
        Err(_) => ProxyMode::default(),
    };
    let edge_dataplane = match std::env::var(EDGE_DATAPLANE_ENV) {
        Ok(value) => EdgeDataPlane::from_str(&value, true)
            .map_err(|e| anyhow!("{EDGE_DATAPLANE_ENV}={value}: {e}"))?,
        Err(_) => EdgeDataPlane::default(),
    };
    Ok(LabOptions {
        nodes: pods_per_node.len(),
        pods_per_node: pods_per_node.to_vec(),
        api_server: std::env::var_os(REAL_API_SERVER_ENV).map(PathBuf::from),
        images: std::env::var(IMAGES_ENV).ok().map(Images::new),
        proxy_mode,
        edge_dataplane,
        ..LabOptions::default()
    })
}

/// Builds the lab of `options`, runs `body` on it inside the control-plane namespace, and
/// shuts it down. A panic in `body` goes on in the caller's thread.
pub fn run<F, Fut>(options: LabOptions, body: F) -> Result<()>
where
    F: FnOnce(Lab) -> Fut + Send + 'static,
    Fut: Future<Output = Lab>,
{
    let _serial = ONE_LAB_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The lab's thread moves into the control-plane namespace and its runtime's threads are
    // born there; the caller's thread stays where it was.
    let lab_thread = std::thread::spawn(move || -> Result<()> {
        let prepared = Lab::prepare(&options)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("building the lab's runtime")?;
        runtime.block_on(async {
            let start = Instant::now();
            let progress =
                |what: &str| eprintln!("[{:>5.1}s] {what}", start.elapsed().as_secs_f64());
            let lab = Lab::start(prepared, options, &progress).await?;
            body(lab).await.shutdown().await
        })
    });
    match lab_thread.join() {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}
