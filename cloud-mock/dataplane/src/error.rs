use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};

use crate::Protocol;

#[derive(Debug, thiserror::Error)]
pub enum DataPlaneError {
    /// Everything else converged; these load balancers are (partly) not realised. The next
    /// `apply` retries them.
    #[error("{} load balancer(s) not realised: {}", failures.len(), LbFailures(failures))]
    Incomplete { failures: Vec<LbFailure> },
    #[error("the data plane is shut down")]
    ShutDown,
}

/// Why one load balancer is not (fully) realised.
#[derive(Debug, thiserror::Error)]
#[error("load balancer {lb_id}: {reason}")]
pub struct LbFailure {
    pub lb_id: String,
    #[source]
    pub reason: LbFailureReason,
}

#[derive(Debug, thiserror::Error)]
pub enum LbFailureReason {
    #[error("id given twice in the desired set")]
    DuplicateId,
    #[error("{protocol} listener on port {port} is given twice")]
    DuplicateListener { protocol: Protocol, port: u16 },
    /// `addr` is the VIP and port (an IPv6 one bracketed).
    #[error("{protocol} {addr} is already served by load balancer {other}")]
    ListenerTaken {
        protocol: Protocol,
        addr: SocketAddr,
        other: String,
    },
    #[error("VIP {vip} is already used by load balancer {other} in the other mode")]
    VipTaken { vip: IpAddr, other: String },
    #[error("binding {protocol} {addr}: {source}")]
    Bind {
        protocol: Protocol,
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("adding VIP address {vip}: {detail}")]
    AddVip { vip: IpAddr, detail: String },
    #[error("{protocol} listener on port {port}: this data plane serves TCP only")]
    ProtocolUnsupported { protocol: Protocol, port: u16 },
    #[error("{0}")]
    Unrenderable(#[from] crate::haproxy::Unrenderable),
    #[error("{0}")]
    Haproxy(String),
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
