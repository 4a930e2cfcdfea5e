//! Do: a proxy-mode UDP listener with a per-client flow table, so each client's datagrams
//! go to one backend and the backend's replies go back to that client from the VIP.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use crate::Protocol;
use crate::metrics::{ActiveGuard, Metrics, Outcome};
use crate::plan::{source_allowed, try_order};
use crate::tcp::ListenerContext;

/// Largest UDP payload.
const MAX_DATAGRAM: usize = 65_535;

#[derive(Debug, Clone, Copy)]
pub(crate) struct FlowSettings {
    pub idle_timeout: Duration,
    pub max_sessions: usize,
}

/// One client flow: its own upstream socket, connected to the chosen backend.
#[derive(Debug, Clone)]
struct Session {
    backend: SocketAddr,
    upstream: Arc<UdpSocket>,
    last_seen: Arc<LastSeen>,
    cancel: CancellationToken,
}

type Sessions = Arc<Mutex<HashMap<SocketAddr, Session>>>;

/// Milliseconds since the listener started at which a flow last carried a datagram.
#[derive(Debug)]
struct LastSeen {
    epoch: Instant,
    millis: AtomicU64,
}

impl LastSeen {
    fn new(epoch: Instant) -> Self {
        let seen = Self {
            epoch,
            millis: AtomicU64::new(0),
        };
        seen.touch();
        seen
    }

    fn touch(&self) {
        let millis = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.millis.store(millis, Ordering::Relaxed);
    }

    fn idle_for(&self) -> Duration {
        let now = self.epoch.elapsed();
        now.saturating_sub(Duration::from_millis(self.millis.load(Ordering::Relaxed)))
    }
}

/// Relays until cancelled, then waits for its flows (cancelled too) to end.
pub(crate) async fn serve_udp(
    socket: UdpSocket,
    context: ListenerContext,
    flows: FlowSettings,
    cancel: CancellationToken,
) {
    let socket = Arc::new(socket);
    let sessions: Sessions = Arc::default();
    let relays = TaskTracker::new();
    let epoch = Instant::now();
    let mut buffer = vec![0_u8; MAX_DATAGRAM];
    let mut turn: usize = 0;
    loop {
        let received = tokio::select! {
            () = cancel.cancelled() => break,
            received = socket.recv_from(&mut buffer) => received,
        };
        let (length, peer) = match received {
            Ok(received) => received,
            Err(error) => {
                debug!(%error, "receive failed");
                continue;
            }
        };
        let route = Arc::clone(&context.route.borrow());
        if !source_allowed(&route.source_ranges, peer.ip()) {
            context.metrics.connection(Protocol::Udp, Outcome::Denied);
            continue;
        }
        let serving = context
            .health
            .serving(&route.backends, route.health_check.as_ref());
        let existing = current_session(&sessions, peer, &serving, route.backend_port);
        let upstream = match existing {
            Some(upstream) => upstream,
            None => {
                if serving.is_empty() {
                    context
                        .metrics
                        .connection(Protocol::Udp, Outcome::NoBackend);
                    continue;
                }
                if lock(&sessions).len() >= flows.max_sessions {
                    context
                        .metrics
                        .connection(Protocol::Udp, Outcome::TableFull);
                    continue;
                }
                let Some(index) = try_order(serving.len(), turn).next() else {
                    continue;
                };
                turn = turn.wrapping_add(1);
                let backend = SocketAddr::new(serving[index], route.backend_port);
                let upstream = match open_upstream(backend).await {
                    Ok(upstream) => Arc::new(upstream),
                    Err(error) => {
                        debug!(%backend, %error, "cannot open the upstream socket");
                        context
                            .metrics
                            .connection(Protocol::Udp, Outcome::BackendError);
                        continue;
                    }
                };
                let session = Session {
                    backend,
                    upstream: Arc::clone(&upstream),
                    last_seen: Arc::new(LastSeen::new(epoch)),
                    cancel: cancel.child_token(),
                };
                lock(&sessions).insert(peer, session.clone());
                context
                    .metrics
                    .connection(Protocol::Udp, Outcome::Forwarded);
                relays.spawn(relay_replies(
                    peer,
                    session,
                    Arc::clone(&socket),
                    Arc::clone(&sessions),
                    flows.idle_timeout,
                    context.metrics.clone(),
                    context.metrics.open(Protocol::Udp),
                ));
                upstream
            }
        };
        match upstream.send(&buffer[..length]).await {
            Ok(sent) => context.metrics.bytes(Protocol::Udp, sent as u64, 0),
            Err(error) => debug!(%peer, %error, "send to backend failed"),
        }
    }
    relays.close();
    relays.wait().await;
}

/// The flow's upstream socket if the flow exists and its backend still serves and is
/// current; a stale flow is ended so that the client gets a serving backend.
fn current_session(
    sessions: &Sessions,
    peer: SocketAddr,
    serving: &[IpAddr],
    backend_port: u16,
) -> Option<Arc<UdpSocket>> {
    let mut sessions = lock(sessions);
    let session = sessions.get(&peer)?;
    if serving.contains(&session.backend.ip()) && session.backend.port() == backend_port {
        session.last_seen.touch();
        return Some(Arc::clone(&session.upstream));
    }
    if let Some(stale) = sessions.remove(&peer) {
        stale.cancel.cancel();
    }
    None
}

async fn open_upstream(backend: SocketAddr) -> io::Result<UdpSocket> {
    let any: IpAddr = match backend {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let upstream = UdpSocket::bind((any, 0)).await?;
    upstream.connect(backend).await?;
    Ok(upstream)
}

/// Sends the backend's datagrams back to `peer` until the flow idles out or is ended.
async fn relay_replies(
    peer: SocketAddr,
    session: Session,
    listener: Arc<UdpSocket>,
    sessions: Sessions,
    idle_timeout: Duration,
    metrics: Metrics,
    _active: ActiveGuard,
) {
    let mut buffer = vec![0_u8; MAX_DATAGRAM];
    loop {
        let idle_for = session.last_seen.idle_for();
        if idle_for >= idle_timeout {
            break;
        }
        tokio::select! {
            () = session.cancel.cancelled() => break,
            () = tokio::time::sleep(idle_timeout - idle_for) => {}
            received = session.upstream.recv(&mut buffer) => match received {
                Ok(length) => {
                    session.last_seen.touch();
                    match listener.send_to(&buffer[..length], peer).await {
                        Ok(sent) => metrics.bytes(Protocol::Udp, 0, sent as u64),
                        Err(error) => debug!(%peer, %error, "send to client failed"),
                    }
                }
                // An ICMP error for an earlier datagram (backend port closed): the flow
                // lives on until it idles out or health checks move it.
                Err(error) => debug!(backend = %session.backend, %error, "backend receive failed"),
            },
        }
    }
    let mut sessions = lock(&sessions);
    if sessions
        .get(&peer)
        .is_some_and(|current| Arc::ptr_eq(&current.upstream, &session.upstream))
    {
        sessions.remove(&peer);
    }
}

fn lock(sessions: &Sessions) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Session>> {
    sessions.lock().unwrap_or_else(PoisonError::into_inner)
}
