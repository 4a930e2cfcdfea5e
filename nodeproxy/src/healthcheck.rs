//! HTTP health endpoints: the node's `/healthz` that load balancers probe and `/livez`
//! for the kubelet's liveness probe (kube-proxy's `ProxierHealthServer`), and one server
//! per externalTrafficPolicy=Local Service on its `healthCheckNodePort`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use jiff::Timestamp;
use serde::Serialize;
use tandem_proxy_rules::health::HealthCheckService;
use tokio_util::sync::CancellationToken;

/// What `/healthz` answers from: the last successful sync and whether the node is leaving.
#[derive(Debug)]
pub struct NodeHealth {
    /// A sync older than this makes the node unhealthy.
    stale_after: Duration,
    inner: Mutex<NodeHealthInner>,
}

#[derive(Debug, Default)]
struct NodeHealthInner {
    last_synced: Option<Timestamp>,
    draining: bool,
}

/// kube-proxy's `/healthz` body.
#[derive(Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HealthzBody {
    pub last_updated: String,
    pub current_time: String,
}

impl NodeHealth {
    pub fn new(stale_after: Duration) -> Self {
        Self {
            stale_after,
            inner: Mutex::default(),
        }
    }

    pub fn record_sync(&self, at: Timestamp) {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last_synced = Some(at);
    }

    /// The Node is being deleted or tainted for deletion (KEP-3836): report unhealthy so
    /// load balancers drain this node.
    pub fn set_draining(&self, draining: bool) {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .draining = draining;
    }

    /// The status and body `/healthz` returns at `now`: 503 when syncs are stale or the
    /// node is draining, so load balancers stop sending it new connections.
    pub fn answer(&self, now: Timestamp) -> (StatusCode, HealthzBody) {
        self.answer_for(now, true)
    }

    /// The status and body `/livez` returns at `now`: the process's own health, whether
    /// syncs keep succeeding, unaffected by draining (KEP-3836), so a liveness probe does
    /// not restart the proxy of a node that is being drained.
    pub fn liveness(&self, now: Timestamp) -> (StatusCode, HealthzBody) {
        self.answer_for(now, false)
    }

    fn answer_for(&self, now: Timestamp, drain_counts: bool) -> (StatusCode, HealthzBody) {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let fresh = inner
            .last_synced
            .is_some_and(|at| now.duration_since(at).unsigned_abs().le(&self.stale_after));
        let status = if fresh && !(drain_counts && inner.draining) {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        let body = HealthzBody {
            last_updated: inner.last_synced.map(|t| t.to_string()).unwrap_or_default(),
            current_time: now.to_string(),
        };
        (status, body)
    }
}

/// `GET /healthz` and `GET /livez`.
pub fn healthz_router(health: Arc<NodeHealth>) -> Router {
    Router::new()
        .route(
            "/healthz",
            get(|State(health): State<Arc<NodeHealth>>| async move {
                let (status, body) = health.answer(Timestamp::now());
                json_response(status, &body)
            }),
        )
        .route(
            "/livez",
            get(|State(health): State<Arc<NodeHealth>>| async move {
                let (status, body) = health.liveness(Timestamp::now());
                json_response(status, &body)
            }),
        )
        .with_state(health)
}

fn json_response(status: StatusCode, body: &impl Serialize) -> Response {
    match serde_json::to_string(body) {
        Ok(text) => (
            status,
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            ],
            text,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

type HealthTable = Arc<RwLock<BTreeMap<u16, HealthCheckService>>>;

/// 200/503 with kube-proxy's body, both decided by the core crate.
fn service_answer(service: &HealthCheckService) -> Response {
    let status =
        StatusCode::from_u16(service.status_code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        service.response_body(),
    )
        .into_response()
}

/// Router of one health-check port: every path answers for the Service on that port.
fn service_router(port: u16, table: HealthTable) -> Router {
    let handler = move || {
        let table = Arc::clone(&table);
        async move {
            let entry = table
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&port)
                .cloned();
            match entry {
                Some(service) => service_answer(&service),
                None => StatusCode::NOT_FOUND.into_response(),
            }
        }
    };
    Router::new().fallback(handler)
}

/// The per-Service health-check servers: started when a port appears, stopped when it goes.
#[derive(Debug)]
pub struct ServiceHealthServers {
    bind_ip: IpAddr,
    table: HealthTable,
    running: BTreeMap<u16, CancellationToken>,
    shutdown: CancellationToken,
}

impl ServiceHealthServers {
    /// Servers listen on `bind_ip` (all addresses of the node: `0.0.0.0`) and stop when
    /// `shutdown` is cancelled.
    pub fn new(bind_ip: IpAddr, shutdown: CancellationToken) -> Self {
        Self {
            bind_ip,
            table: Arc::default(),
            running: BTreeMap::new(),
            shutdown,
        }
    }

    /// Ports with a running server.
    pub fn ports(&self) -> Vec<u16> {
        self.running.keys().copied().collect()
    }

    /// Serve exactly `services` (from
    /// [`tandem_proxy_rules::health::health_check_services`]). A port that cannot be bound
    /// is logged and tried again at the next update.
    pub async fn update(&mut self, services: Vec<HealthCheckService>) {
        let wanted: BTreeMap<u16, HealthCheckService> =
            services.into_iter().map(|s| (s.port, s)).collect();
        let gone: Vec<u16> = self
            .running
            .keys()
            .filter(|port| !wanted.contains_key(port))
            .copied()
            .collect();
        for port in gone {
            if let Some(token) = self.running.remove(&port) {
                tracing::info!(port, "stopping health-check server");
                token.cancel();
            }
        }
        let new: Vec<u16> = wanted
            .keys()
            .filter(|port| !self.running.contains_key(port))
            .copied()
            .collect();
        *self.table.write().unwrap_or_else(PoisonError::into_inner) = wanted;
        for port in new {
            let address = SocketAddr::new(self.bind_ip, port);
            let listener = match tokio::net::TcpListener::bind(address).await {
                Ok(listener) => listener,
                Err(error) => {
                    tracing::warn!(%address, %error, "cannot bind health-check port");
                    continue;
                }
            };
            tracing::info!(%address, "serving health-check port");
            let token = self.shutdown.child_token();
            let stop = token.clone();
            let app = service_router(port, Arc::clone(&self.table));
            tokio::spawn(async move {
                let served = axum::serve(listener, app)
                    .with_graceful_shutdown(stop.cancelled_owned())
                    .await;
                if let Err(error) = served {
                    tracing::warn!(port, %error, "health-check server ended");
                }
            });
            self.running.insert(port, token);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    fn local_service(port: u16, local_endpoints: usize) -> HealthCheckService {
        HealthCheckService {
            namespace: "s2".into(),
            name: "local".into(),
            port,
            local_endpoints,
        }
    }

    async fn body_of(response: Response) -> (StatusCode, String) {
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn healthz_is_ok_only_while_syncs_are_fresh_and_the_node_stays() {
        let health = Arc::new(NodeHealth::new(Duration::from_secs(60)));
        let request = || Request::get("/healthz").body(Body::empty()).unwrap();
        let router = healthz_router(Arc::clone(&health));
        let (status, _) = body_of(router.clone().oneshot(request()).await.unwrap()).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "never synced");

        let synced: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        health.record_sync(Timestamp::now());
        let (status, body) = body_of(router.clone().oneshot(request()).await.unwrap()).await;
        assert_eq!(status, StatusCode::OK);
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(json["lastUpdated"].as_str().unwrap().ends_with('Z'));
        assert!(json["currentTime"].is_string());

        health.record_sync(synced);
        let later = synced + Duration::from_secs(61);
        assert_eq!(
            health.answer(later).0,
            StatusCode::SERVICE_UNAVAILABLE,
            "stale"
        );
        assert_eq!(
            health.answer(synced + Duration::from_secs(59)).0,
            StatusCode::OK
        );
        assert_eq!(
            health.answer(synced).1,
            HealthzBody {
                last_updated: "2026-01-01T00:00:00Z".into(),
                current_time: "2026-01-01T00:00:00Z".into()
            }
        );

        health.set_draining(true);
        assert_eq!(
            health.answer(synced).0,
            StatusCode::SERVICE_UNAVAILABLE,
            "draining"
        );
        assert_eq!(
            health.liveness(synced).0,
            StatusCode::OK,
            "alive while draining"
        );
        assert_eq!(
            health.liveness(later).0,
            StatusCode::SERVICE_UNAVAILABLE,
            "stale"
        );
        health.record_sync(Timestamp::now());
        let livez = Request::get("/livez").body(Body::empty()).unwrap();
        let (status, _) = body_of(router.clone().oneshot(livez).await.unwrap()).await;
        assert_eq!(status, StatusCode::OK);
        let (status, _) = body_of(router.oneshot(request()).await.unwrap()).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[tokio::test]
    async fn service_health_answers_with_kube_proxy_body() {
        let table: HealthTable = Arc::default();
        table
            .write()
            .unwrap()
            .insert(32000, local_service(32000, 2));
        let router = service_router(32000, Arc::clone(&table));
        let (status, body) = body_of(
            router
                .clone()
                .oneshot(Request::get("/").body(Body::empty()).unwrap())
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            body,
            r#"{"service": {"namespace": "s2", "name": "local"}, "localEndpoints": 2}"#
        );
        table
            .write()
            .unwrap()
            .get_mut(&32000)
            .unwrap()
            .local_endpoints = 0;
        let (status, body) = body_of(
            router
                .oneshot(Request::get("/healthz").body(Body::empty()).unwrap())
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body,
            r#"{"service": {"namespace": "s2", "name": "local"}, "localEndpoints": 0}"#
        );
    }

    #[tokio::test]
    async fn servers_start_and_stop_with_their_services() {
        let shutdown = CancellationToken::new();
        let mut servers = ServiceHealthServers::new(IpAddr::from([127, 0, 0, 1]), shutdown.clone());
        // Let the OS pick a free port, then hand it to the manager.
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        };
        servers.update(vec![local_service(port, 1)]).await;
        assert_eq!(servers.ports(), vec![port]);
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(reply.contains(r#""localEndpoints": 1"#), "{reply}");

        servers.update(Vec::new()).await;
        assert!(servers.ports().is_empty());
        // The listener closes once the server has shut down.
        let mut refused = false;
        for _ in 0..50 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
            {
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(refused, "server still listening after its Service went");
        shutdown.cancel();
    }
}
