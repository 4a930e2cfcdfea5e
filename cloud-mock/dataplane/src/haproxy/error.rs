//! What can go wrong driving HAProxy, by what failed. Cloneable (the I/O errors are
//! shared), because one failure is reported for every load balancer it left unserved.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, thiserror::Error)]
pub enum HaproxyError {
    #[error("cannot write HAProxy's file {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: Arc<io::Error>,
    },
    #[error("cannot run HAProxy ({program}): {source}")]
    Spawn {
        program: PathBuf,
        #[source]
        source: Arc<io::Error>,
    },
    #[error("`haproxy -c` refused the configuration (the running one stays): {message}")]
    ConfigRefused { message: String },
    /// HAProxy counted the reload as failed: its new worker did not start (a port it
    /// cannot bind, say); the old worker serves on.
    #[error("HAProxy's reload failed (the running configuration stays); its log says why")]
    ReloadFailed,
    #[error("HAProxy had no new worker {0:?} after its start or reload: it did not finish")]
    NoNewWorker(Duration),
    #[error("HAProxy's master CLI at {socket} did not answer: {source}")]
    MasterUnreachable {
        socket: PathBuf,
        #[source]
        source: Arc<io::Error>,
    },
    #[error("HAProxy's runtime API at {socket} did not answer: {source}")]
    RuntimeUnreachable {
        socket: PathBuf,
        #[source]
        source: Arc<io::Error>,
    },
    #[error("HAProxy's state directory {0} is too long for its Unix sockets' addresses")]
    PathTooLong(PathBuf),
    /// The configuration names the state directory's files unquoted, in sample
    /// expressions too (`map_ip(PATH)`), where quotes, spaces, commas and parentheses
    /// would be read as syntax.
    #[error(
        "HAProxy's state directory {0} has characters its configuration would misread (only A-Z, a-z, 0-9 and / . _ - are passed)"
    )]
    PathNotPlain(PathBuf),
}
