//! A real Kubernetes for the test suite, from a k3s binary the user names.
//!
//! Nothing here is tied to one release: `TANDEM_K3S` names any k3s binary (CI unpacks
//! v1.21.2, the oldest release Tandem supports). Without it the real-cluster tests report
//! themselves skipped, never passed.

pub mod control_plane;
pub mod node;

use std::path::PathBuf;

/// The environment variable naming the k3s binary.
pub const K3S_ENV: &str = "TANDEM_K3S";

/// The k3s binary named by [`K3S_ENV`], if set and present.
pub fn k3s_binary() -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os(K3S_ENV)?);
    path.is_file().then_some(path)
}
