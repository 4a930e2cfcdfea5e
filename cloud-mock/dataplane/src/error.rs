use std::fmt;
use std::io;

use crate::failure::LbFailure;

#[derive(Debug, thiserror::Error)]
pub enum DataPlaneError {
    /// Everything else converged; these load balancers are (partly) not realised. The next
    /// `apply` retries them.
    #[error("{} load balancer(s) not realised: {}", failures.len(), LbFailures(failures))]
    Incomplete { failures: Vec<LbFailure> },
    #[error("the data plane is shut down")]
    ShutDown,
}

/// A failed `ip` (or other helper) command, with what it printed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("cannot run `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
}

impl CommandError {
    pub(crate) fn stderr(&self) -> &str {
        match self {
            Self::Spawn { .. } => "",
            Self::Failed { stderr, .. } => stderr,
        }
    }
}

/// Why the device towards a gateway is not known.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DeviceError {
    #[error(transparent)]
    Command(#[from] CommandError),
    #[error("no device towards {gateway} in `ip route get`: {output:?}")]
    NoDevice {
        gateway: std::net::IpAddr,
        output: String,
    },
}

struct LbFailures<'a>(&'a [LbFailure]);

impl fmt::Display for LbFailures<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, failure) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{failure}")?;
        }
        Ok(())
    }
}
