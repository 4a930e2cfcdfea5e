//! `/metrics` (Prometheus text), `/healthz` and `/readyz`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::get;
use prometheus_client::registry::Registry;

#[derive(Clone)]
struct AppState {
    registry: Arc<Registry>,
    ready: Arc<AtomicBool>,
}

async fn metrics(State(state): State<AppState>) -> Response {
    tandem_common::http::metrics_response(&state.registry)
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<AppState>) -> (StatusCode, &'static str) {
    if state.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

/// One router serving all three paths (both listeners use it).
pub fn router(registry: Arc<Registry>, ready: Arc<AtomicBool>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AppState { registry, ready })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::{Body, to_bytes};
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get_path(router: Router, path: &str) -> (StatusCode, String) {
        let response = router
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let body = to_bytes(response.into_body(), 1 << 20).await.unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn health_ready_and_metrics() {
        let mut registry = Registry::default();
        let metrics = crate::metrics::Metrics::register(&mut registry);
        metrics.reconciled(Ok(()));
        let ready = Arc::new(AtomicBool::new(false));
        let app = router(Arc::new(registry), ready.clone());
        assert_eq!(get_path(app.clone(), "/healthz").await.0, StatusCode::OK);
        assert_eq!(
            get_path(app.clone(), "/readyz").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        ready.store(true, Ordering::Release);
        assert_eq!(get_path(app.clone(), "/readyz").await.0, StatusCode::OK);
        let (status, body) = get_path(app, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("tandem_controller_reconciles_total{result=\"success\"} 1"));
    }
}
