//! Do: a proxy-mode TCP listener.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::Protocol;
use crate::health::HealthTable;
use crate::metrics::{Metrics, Outcome};
use crate::plan::{ListenerRoute, source_allowed, try_order};
use crate::splice::forward_both_ways;

/// TCP keep-alive on both sides of a proxied connection: a connection whose other end is
/// gone without a word (a client whose flow the routers' ECMP moved to another edge when
/// one left, which reset it there; a client or node that vanished) is probed once idle
/// for 30 s and closed within 30 s more, instead of being held open forever.
fn keepalive() -> socket2::TcpKeepalive {
    socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10))
        .with_retries(3)
}

/// What a listener task needs besides its socket.
#[derive(Debug, Clone)]
pub(crate) struct ListenerContext {
    pub route: watch::Receiver<Arc<ListenerRoute>>,
    pub health: HealthTable,
    pub metrics: Metrics,
    pub connect_timeout: Duration,
}

/// Accepts until cancelled, then waits for its connections (cancelled too) to end.
/// New connections go round-robin over the backends serving at accept time (the healthy
/// ones, or all when none is).
pub(crate) async fn serve_tcp(
    listener: TcpListener,
    context: ListenerContext,
    cancel: CancellationToken,
) {
    let connections = TaskTracker::new();
    let mut turn: usize = 0;
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (client, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors and the like: back off instead of spinning.
                warn!(%error, "accept failed");
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_millis(50)) => continue,
                }
            }
        };
        let route = Arc::clone(&context.route.borrow());
        if !source_allowed(&route.source_ranges, peer.ip()) {
            debug!(lb = %route.lb_id, %peer, "client outside the source ranges");
            context.metrics.connection(Protocol::Tcp, Outcome::Denied);
            reset(client);
            continue;
        }
        let serving = context
            .health
            .serving(&route.backends, route.health_check.as_ref());
        if serving.is_empty() {
            debug!(lb = %route.lb_id, %peer, "no backend");
            context
                .metrics
                .connection(Protocol::Tcp, Outcome::NoBackend);
            reset(client);
            continue;
        }
        let order: Vec<SocketAddr> = try_order(serving.len(), turn)
            .map(|i| SocketAddr::new(serving[i], route.backend_port))
            .collect();
        turn = turn.wrapping_add(1);
        connections.spawn(forward(
            client,
            order,
            context.connect_timeout,
            context.metrics.clone(),
            cancel.clone(),
        ));
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Connects to the first backend of `order` that answers and copies both ways until
/// either side closes or the listener goes.
async fn forward(
    client: TcpStream,
    order: Vec<SocketAddr>,
    connect_timeout: Duration,
    metrics: Metrics,
    cancel: CancellationToken,
) {
    let mut upstream = None;
    for backend in order {
        let attempt = tokio::select! {
            () = cancel.cancelled() => return,
            attempt = tokio::time::timeout(connect_timeout, TcpStream::connect(backend)) => attempt,
        };
        match attempt {
            Ok(Ok(stream)) => {
                upstream = Some(stream);
                break;
            }
            Ok(Err(error)) => debug!(%backend, %error, "backend refused, trying the next"),
            Err(_) => debug!(%backend, "backend connect timed out, trying the next"),
        }
    }
    let Some(upstream) = upstream else {
        metrics.connection(Protocol::Tcp, Outcome::BackendError);
        reset(client);
        return;
    };
    metrics.connection(Protocol::Tcp, Outcome::Forwarded);
    let _active = metrics.open(Protocol::Tcp);
    for stream in [&client, &upstream] {
        if let Err(error) = stream.set_nodelay(true) {
            debug!(%error, "cannot set TCP_NODELAY");
        }
        if let Err(error) = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive()) {
            debug!(%error, "cannot set TCP keep-alive");
        }
    }
    tokio::select! {
        () = cancel.cancelled() => {}
        copied = forward_both_ways(&client, &upstream) => match copied {
            Ok((to_backend, to_client)) => {
                metrics.bytes(Protocol::Tcp, to_backend.total(), to_client.total());
            }
            Err(error) => debug!(%error, "connection ended with an error"),
        },
    }
}

/// Closes with RST (zero linger) so a refused client learns at once.
fn reset(stream: TcpStream) {
    if let Err(error) = stream.set_zero_linger() {
        debug!(%error, "cannot set SO_LINGER 0");
    }
}
