//! Serving a component's HTTP endpoints (metrics, health) and the Prometheus `/metrics`
//! answer, written once for the controller and the node proxy (the mock cloud's API server
//! answers its own `/metrics` route beside its JSON API).

use std::net::SocketAddr;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The OpenMetrics text format, as Prometheus scrapes it.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `/metrics` answer: every metric of `registry` in the OpenMetrics text format.
pub fn metrics_response(registry: &Registry) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, registry) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)],
            body,
        )
            .into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "cannot encode metrics").into_response(),
    }
}

/// Binds `addr` now, so a bad or taken address fails start-up, then serves `router` until
/// `shutdown` is cancelled.
pub async fn serve_http(
    addr: SocketAddr,
    router: Router,
    shutdown: CancellationToken,
) -> std::io::Result<JoinHandle<std::io::Result<()>>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving HTTP");
    Ok(tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
    }))
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;

    use super::*;

    #[tokio::test]
    async fn metrics_are_encoded_and_served_until_shutdown() {
        let mut registry = Registry::default();
        let counter: Counter = Counter::default();
        registry.register("probes", "Probes seen", counter.clone());
        counter.inc();
        let response = metrics_response(&registry);
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            OPENMETRICS_CONTENT_TYPE
        );
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        assert!(
            String::from_utf8_lossy(&body).contains("probes_total 1"),
            "{body:?}"
        );

        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        assert!(
            serve_http(addr, Router::new(), shutdown.clone())
                .await
                .is_err(),
            "a taken address fails at once"
        );
        drop(taken);
        let server = serve_http(addr, Router::new(), shutdown.clone())
            .await
            .unwrap();
        shutdown.cancel();
        server.await.unwrap().unwrap();
    }
}
