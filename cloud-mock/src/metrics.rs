//! The API server's own Prometheus metrics (the data plane registers its own beside them).

use cloud_mock_sdk::State;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    /// The route template (`/v1/loadbalancers/{id}`) or `unmatched`: bounded.
    route: String,
    method: &'static str,
    status: u16,
}

/// A tenant of the tenants file: bounded by that file.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabels {
    tenant: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// What a node-pool write (PUT or DELETE) came to: a bounded label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodePoolWrite {
    Created,
    Replaced,
    /// The content it had already: nothing written.
    Unchanged,
    Deleted,
    /// Refused: invalid, stale If-Match, in use, absent.
    Refused,
    /// The store failed.
    Failed,
}

impl NodePoolWrite {
    const fn label(self) -> &'static str {
        match self {
            Self::Created => "created",
            Self::Replaced => "replaced",
            Self::Unchanged => "unchanged",
            Self::Deleted => "deleted",
            Self::Refused => "refused",
            Self::Failed => "failed",
        }
    }
}

/// What came of a change of the token file: a bounded label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenFileReload {
    /// Its tokens replaced the ones accepted before.
    Applied,
    /// Refused (the last good tokens stay): the file could not be read,
    Unreadable,
    /// held no token,
    Empty,
    /// or had a line that is neither a token nor a hash.
    Invalid,
}

impl TokenFileReload {
    const fn label(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Unreadable => "unreadable",
            Self::Empty => "empty",
            Self::Invalid => "invalid",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

/// Clones share the same series.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    requests: Family<RequestLabels, Counter>,
    load_balancers: Family<StateLabels, Gauge>,
    node_pool_writes: Family<OutcomeLabels, Counter>,
    token_file_reloads: Family<OutcomeLabels, Counter>,
    tokens: Gauge,
    rate_limited: Family<TenantLabels, Counter>,
}

pub const STATES: [State; 3] = [State::Provisioning, State::Active, State::Deleting];

fn state_name(state: State) -> &'static str {
    match state {
        State::Provisioning => "provisioning",
        State::Active => "active",
        State::Deleting => "deleting",
    }
}

/// A bounded label for an HTTP method.
fn method_name(method: &http::Method) -> &'static str {
    match *method {
        http::Method::GET => "GET",
        http::Method::HEAD => "HEAD",
        http::Method::POST => "POST",
        http::Method::PUT => "PUT",
        http::Method::PATCH => "PATCH",
        http::Method::DELETE => "DELETE",
        http::Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

impl Metrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "cloud_mock_http_requests",
            "API requests by route template, method and status",
            self.requests.clone(),
        );
        registry.register(
            "cloud_mock_load_balancers",
            "Load balancers by lifecycle state",
            self.load_balancers.clone(),
        );
        registry.register(
            "cloud_mock_node_pool_writes",
            "Node-pool writes (PUT and DELETE) by outcome",
            self.node_pool_writes.clone(),
        );
        registry.register(
            "cloud_mock_token_file_reloads",
            "Changes of --token-file or --tenants-file by outcome (refused ones keep the tokens read last)",
            self.token_file_reloads.clone(),
        );
        registry.register(
            "cloud_mock_tokens",
            "Bearer tokens the API accepts (two during a rotation)",
            self.tokens.clone(),
        );
        registry.register(
            "cloud_mock_rate_limited_requests",
            "Requests refused with 429 because their tenant was over its rate limit",
            self.rate_limited.clone(),
        );
    }

    pub fn token_file_reload(&self, outcome: TokenFileReload) {
        self.token_file_reloads
            .get_or_create(&OutcomeLabels {
                outcome: outcome.label(),
            })
            .inc();
    }

    pub fn rate_limited(&self, tenant: &str) {
        self.rate_limited
            .get_or_create(&TenantLabels {
                tenant: tenant.to_owned(),
            })
            .inc();
    }

    pub fn set_tokens(&self, count: usize) {
        self.tokens.set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    pub fn node_pool_write(&self, outcome: NodePoolWrite) {
        self.node_pool_writes
            .get_or_create(&OutcomeLabels {
                outcome: outcome.label(),
            })
            .inc();
    }

    pub fn request(&self, route: &str, method: &http::Method, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                route: route.to_owned(),
                method: method_name(method),
                status,
            })
            .inc();
    }

    /// Sets the per-state gauge from `counts` (in the order of [`STATES`]).
    pub fn set_load_balancers(&self, counts: [i64; 3]) {
        for (state, count) in STATES.into_iter().zip(counts) {
            self.load_balancers
                .get_or_create(&StateLabels {
                    state: state_name(state),
                })
                .set(count);
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;

    #[test]
    fn series_are_exposed_with_bounded_labels() {
        let metrics = Metrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        metrics.request("/v1/loadbalancers", &http::Method::POST, 201);
        metrics.request(
            "unmatched",
            &http::Method::from_bytes(b"BREW").unwrap(),
            404,
        );
        metrics.set_load_balancers([2, 1, 0]);
        metrics.node_pool_write(NodePoolWrite::Replaced);
        metrics.token_file_reload(TokenFileReload::Empty);
        metrics.set_tokens(2);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        assert!(text.contains(
            r#"cloud_mock_http_requests_total{route="/v1/loadbalancers",method="POST",status="201"} 1"#
        ));
        assert!(text.contains(r#"method="other",status="404"} 1"#));
        assert!(text.contains(r#"cloud_mock_load_balancers{state="provisioning"} 2"#));
        assert!(text.contains(r#"cloud_mock_load_balancers{state="deleting"} 0"#));
        assert!(text.contains(r#"cloud_mock_node_pool_writes_total{outcome="replaced"} 1"#));
        assert!(text.contains(r#"cloud_mock_token_file_reloads_total{outcome="empty"} 1"#));
        assert!(text.contains("cloud_mock_tokens 2"));
    }
}
