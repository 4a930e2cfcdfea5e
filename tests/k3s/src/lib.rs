//! A real Kubernetes for the test suite, from a k3s binary the user names.
//!
//! Nothing here is tied to one release: `TANDEM_K3S` names any k3s binary (CI unpacks
//! v1.21.2, the oldest release Tandem supports). Without it the real-cluster tests report
//! themselves skipped, never passed. `TANDEM_KUBE_PROXY` names a kube-proxy binary, whose
//! own rules are the node proxy's reference data (`tests/dual_stack.rs`).

pub mod chart;
pub mod cluster;
pub mod control_plane;
pub mod docs;
pub mod node;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The pod network of every cluster here: k3s's default.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The Service network of every cluster here: k3s's default.
pub const SERVICE_CIDR: &str = "10.43.0.0/16";

/// The environment variable naming the k3s binary.
pub const K3S_ENV: &str = "TANDEM_K3S";
/// The environment variable naming the kube-proxy binary.
pub const KUBE_PROXY_ENV: &str = "TANDEM_KUBE_PROXY";

/// The k3s binary named by [`K3S_ENV`], if set and present.
pub fn k3s_binary() -> Option<PathBuf> {
    binary_named_by(K3S_ENV)
}

/// What a real-cluster test needs before anything else: the k3s binary [`K3S_ENV`] names,
/// and root (network namespaces, cgroups, mounts); `test` says which test asks.
pub fn k3s_for_test(test: &str) -> anyhow::Result<PathBuf> {
    let k3s = k3s_binary()
        .ok_or_else(|| anyhow::anyhow!("{K3S_ENV} must name a k3s binary for the {test}"))?;
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "the {test} needs root (network namespaces, cgroups, mounts)"
    );
    Ok(k3s)
}

/// The kube-proxy binary named by [`KUBE_PROXY_ENV`], if set and present.
pub fn kube_proxy_binary() -> Option<PathBuf> {
    binary_named_by(KUBE_PROXY_ENV)
}

/// kube-proxy's arguments in iptables mode, as every run of it here starts: `kubeconfig`,
/// the node it serves (`hostname`), the cluster's pod CIDRs (comma-separated) and the
/// conntrack flags that leave the machine alone (no conntrack sysctl written). The caller
/// adds what is its own.
pub fn kube_proxy_args(kubeconfig: &Path, hostname: &str, cluster_cidr: &str) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec!["--kubeconfig".into(), kubeconfig.into()];
    args.extend(
        [
            "--proxy-mode",
            "iptables",
            "--hostname-override",
            hostname,
            "--cluster-cidr",
            cluster_cidr,
            "--conntrack-max-per-core",
            "0",
            "--conntrack-tcp-timeout-established",
            "0s",
            "--conntrack-tcp-timeout-close-wait",
            "0s",
        ]
        .map(OsString::from),
    );
    args
}

fn binary_named_by(var: &str) -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os(var)?);
    path.is_file().then_some(path)
}

/// Polls `f` every half second until it answers `Ok(Ok(value))`, for at most `timeout`;
/// `Ok(Err(why))` is "not yet", and an outer `Err` ends the wait at once.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> anyhow::Result<anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        match f()? {
            Ok(v) => return Ok(v),
            Err(why) if Instant::now() > deadline => {
                anyhow::bail!("{what}: not within {timeout:?}; last: {why:#}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}
