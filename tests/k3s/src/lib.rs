//! A real Kubernetes for the test suite, from a k3s binary the user names.
//!
//! Nothing here is tied to one release: `TANDEM_K3S` names any k3s binary (CI unpacks
//! v1.21.2, the oldest release Tandem supports). Without it the real-cluster tests report
//! themselves skipped, never passed. `TANDEM_KUBE_PROXY` names a kube-proxy binary, whose
//! own rules are the node proxy's reference data (`tests/dual_stack.rs`).

pub mod control_plane;
pub mod docs;
pub mod node;

use std::path::PathBuf;

/// The environment variable naming the k3s binary.
pub const K3S_ENV: &str = "TANDEM_K3S";
/// The environment variable naming the kube-proxy binary.
pub const KUBE_PROXY_ENV: &str = "TANDEM_KUBE_PROXY";

/// The k3s binary named by [`K3S_ENV`], if set and present.
pub fn k3s_binary() -> Option<PathBuf> {
    binary_named_by(K3S_ENV)
}

/// The kube-proxy binary named by [`KUBE_PROXY_ENV`], if set and present.
pub fn kube_proxy_binary() -> Option<PathBuf> {
    binary_named_by(KUBE_PROXY_ENV)
}

fn binary_named_by(var: &str) -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os(var)?);
    path.is_file().then_some(path)
}
