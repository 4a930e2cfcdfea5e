//! Why the data plane does not realise a load balancer: what the plan rejects (a conflict
//! with another load balancer) and what realising it met (a bind, an address, HAProxy).
//! The plan's and the realisation's output, which [`crate::DataPlaneError`] reports.

use std::io;
use std::net::{IpAddr, SocketAddr};

use crate::Protocol;
use crate::haproxy::error::HaproxyError;

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
    Unrenderable(#[from] Unrenderable),
    /// HAProxy did not take the load balancer's sections: what failed, by kind.
    #[error(transparent)]
    Haproxy(HaproxyError),
}

/// Why a listener cannot be given to HAProxy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unrenderable {
    #[error("id {0:?} is not of the form HAProxy names take ([A-Za-z0-9-], 1 to 64)")]
    Id(String),
    #[error("health-check path {0:?} has characters the HAProxy edge does not pass on")]
    Path(String),
}
