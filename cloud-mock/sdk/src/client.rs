//! The HTTP client: one method per API call, with timeouts, retries, failover between the
//! edges that serve one API, and typed errors.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderValue, RETRY_AFTER};
use reqwest::{Method, RequestBuilder, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::{self, PemObject};

use crate::error::{EdgeFailure, Error, TlsError};
use crate::identity::{ClientIdentity, ReloadingIdentity};
use crate::ipv4::{LoadBalancer, LoadBalancerList, LoadBalancerSpec};
use crate::types::{ErrorBody, Faults, Pool, PoolList};
use crate::{ListFilter, NodePool, NodePoolList, NodePoolSpec, families};

/// Header that makes a create idempotent: a repeated create with the same key returns the
/// load balancer the first one made.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

/// The longest a read of a provisioning load balancer is held by the server
/// (`GET /v1/loadbalancers/{id}?waitMs=`).
pub const MAX_PROVISIONING_WAIT: Duration = Duration::from_secs(30);

/// The longest a connection to an edge may take (the TLS handshake included) before the
/// next edge is tried, when it is shorter than the timeout. A live edge answers in
/// milliseconds; the host of a dead one may drop the SYN without a word, and a call should
/// not spend its whole timeout there first.
const EDGE_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Timeouts and retry policy of a [`Client`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// Bound on one HTTP attempt, connect included.
    pub timeout: Duration,
    /// Retries after the first attempt for retryable errors (429, 503, transport).
    pub max_retries: u32,
    /// Backoff before the first retry; doubles for each further one.
    pub initial_backoff: Duration,
    /// Cap of the doubling backoff (a server's `Retry-After` is honoured even when longer).
    pub max_backoff: Duration,
    /// PEM certificates of the CAs an `https` server's certificate must chain to (as
    /// `curl --cacert`); none: the platform's trusted roots. Unused for `http` URLs.
    pub root_certificates: Option<String>,
    /// The certificate shown to an `https` server that asks for one (mutual TLS).
    pub client_identity: Option<ClientIdentity>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            max_retries: 4,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(10),
            root_certificates: None,
            client_identity: None,
        }
    }
}

/// The TLS client configuration: TLS 1.2 or 1.3 with the ring provider (given here, so no
/// process-wide provider is needed), trusting the CAs of `roots_pem` or else the
/// platform's roots, and showing `identity` to a server that asks for a certificate.
fn tls_config(
    roots_pem: Option<&str>,
    identity: Option<&ClientIdentity>,
) -> Result<rustls::ClientConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match roots_pem {
        Some(pem) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                roots.add(cert.map_err(TlsError::RootCertificates)?)?;
            }
            if roots.is_empty() {
                return Err(TlsError::RootCertificates(pem::Error::NoItemsFound));
            }
            builder.with_root_certificates(roots)
        }
        None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(rustls_platform_verifier::Verifier::new(
                provider.clone(),
            )?)),
    };
    match identity {
        Some(identity) => {
            let resolver = ReloadingIdentity::load(identity, provider)?;
            let mut config = builder.with_client_cert_resolver(Arc::new(resolver));
            // A resumed session shows the server the certificate of its first handshake,
            // not a renewed one; connections are pooled, so full handshakes are few.
            config.resumption = rustls::client::Resumption::disabled();
            Ok(config)
        }
        None => Ok(builder.with_no_client_auth()),
    }
}

/// Typed client of the cloud-mock load-balancer API, served by one edge or by several
/// edges of one API (an edge cluster). Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    http: reqwest::Client,
    /// The base URL of each edge, in the order given.
    edges: Vec<Url>,
    /// The edge that took the last connection, where every call starts.
    current_edge: AtomicUsize,
    /// `Bearer TOKEN`, replaced by [`Client::set_token`] when the token is rotated.
    authorization: RwLock<HeaderValue>,
    options: ClientOptions,
}

/// A request that reached the point of being sent to an edge.
struct Sent {
    outcome: Result<reqwest::Response, reqwest::Error>,
    /// Whether sending it again is safe although its bytes may have reached the server.
    resendable: bool,
}

impl Client {
    /// A client of the API at `base_url` (like `http://127.0.0.1:8080`), sending `token` as
    /// a bearer token.
    pub fn new(
        base_url: &str,
        token: impl Into<String>,
        options: ClientOptions,
    ) -> Result<Self, Error> {
        Self::with_edges(&[base_url], token, options)
    }

    /// A client of the API that each of `base_urls` serves (the edges of one edge cluster,
    /// with one store behind them). A call goes to the edge that took the last one; when it
    /// cannot connect there it goes to the next edge, and so on, before any retry: nothing
    /// was sent, so this is safe for every call.
    pub fn with_edges(
        base_urls: &[&str],
        token: impl Into<String>,
        options: ClientOptions,
    ) -> Result<Self, Error> {
        if base_urls.is_empty() {
            return Err(Error::Invalid {
                code: None,
                message: "no base URL: the client needs an edge".to_owned(),
            });
        }
        let edges = base_urls
            .iter()
            .map(|base_url| parse_base_url(base_url))
            .collect::<Result<Vec<_>, _>>()?;
        let tls = tls_config(
            options.root_certificates.as_deref(),
            options.client_identity.as_ref(),
        )?;
        let http = reqwest::Client::builder()
            .timeout(options.timeout)
            .connect_timeout(options.timeout.min(EDGE_CONNECT_TIMEOUT))
            .tls_backend_preconfigured(tls)
            .build()
            .map_err(Error::Transport)?;
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                edges,
                current_edge: AtomicUsize::new(0),
                authorization: RwLock::new(authorization(&token.into())?),
                options,
            }),
        })
    }

    /// Sends `token` from the next call on, in this client and its clones (a rotated
    /// token, with no new client and no connection lost).
    pub fn set_token(&self, token: &str) -> Result<(), Error> {
        let authorization = authorization(token)?;
        *self
            .inner
            .authorization
            .write()
            .unwrap_or_else(PoisonError::into_inner) = authorization;
        Ok(())
    }

    /// Creates a load balancer. `idempotency_key` makes retries and repeats safe: the
    /// server answers a repeated key with the load balancer the first create made.
    #[tracing::instrument(skip(self, spec), fields(name = %spec.name))]
    pub async fn create_load_balancer(
        &self,
        spec: &LoadBalancerSpec,
        idempotency_key: &str,
    ) -> Result<LoadBalancer, Error> {
        self.create(spec, idempotency_key, None).await
    }

    /// The load balancer `id`; [`Error::NotFound`] when there is none.
    #[tracing::instrument(skip(self))]
    pub async fn get_load_balancer(&self, id: &str) -> Result<LoadBalancer, Error> {
        self.get(id).await
    }

    /// The load balancer `id` once it is no longer provisioning, or as it is after `wait`
    /// (at most [`MAX_PROVISIONING_WAIT`]): one call however long provisioning takes.
    #[tracing::instrument(skip(self))]
    pub async fn get_load_balancer_provisioned(
        &self,
        id: &str,
        wait: Duration,
    ) -> Result<LoadBalancer, Error> {
        self.get_provisioned(id, wait).await
    }

    /// Every load balancer that carries all of `filter.tags` and, if given, `filter.name`.
    #[tracing::instrument(skip(self))]
    pub async fn list_load_balancers(
        &self,
        filter: &ListFilter,
    ) -> Result<Vec<LoadBalancer>, Error> {
        let list: LoadBalancerList = self.list(filter).await?;
        Ok(list.items)
    }

    /// Replaces the desired state of `id`, if its version is still `if_match_version`
    /// ([`Error::Conflict`] otherwise: read it again and retry).
    #[tracing::instrument(skip(self, spec))]
    pub async fn update_load_balancer(
        &self,
        id: &str,
        spec: &LoadBalancerSpec,
        if_match_version: u64,
    ) -> Result<LoadBalancer, Error> {
        self.update(id, spec, if_match_version).await
    }

    /// The same calls with the whole load balancer, of any IP family
    /// ([`families::LoadBalancerSpec`]).
    pub fn families(&self) -> FamiliesClient<'_> {
        FamiliesClient { client: self }
    }

    /// A create, under the id `id` when the client chooses it.
    async fn create<T: DeserializeOwned>(
        &self,
        spec: &impl Serialize,
        idempotency_key: &str,
        id: Option<&str>,
    ) -> Result<T, Error> {
        let query: Vec<(&str, &str)> = id.map(|id| ("loadBalancerId", id)).into_iter().collect();
        self.call(Method::POST, &["v1", "loadbalancers"], |request| {
            request
                .query(&query)
                .header(IDEMPOTENCY_KEY, idempotency_key)
                .json(spec)
        })
        .await
    }

    async fn get<T: DeserializeOwned>(&self, id: &str) -> Result<T, Error> {
        self.call(Method::GET, &["v1", "loadbalancers", id], |request| request)
            .await
    }

    /// [`Client::get`], held by the server while the LB provisions, up to `wait`; each
    /// attempt may take that much longer than the timeout.
    async fn get_provisioned<T: DeserializeOwned>(
        &self,
        id: &str,
        wait: Duration,
    ) -> Result<T, Error> {
        let wait = wait.min(MAX_PROVISIONING_WAIT);
        let query = [("waitMs", wait.as_millis().to_string())];
        let timeout = self.inner.options.timeout.saturating_add(wait);
        self.call(Method::GET, &["v1", "loadbalancers", id], |request| {
            request.query(&query).timeout(timeout)
        })
        .await
    }

    async fn list<T: DeserializeOwned>(&self, filter: &ListFilter) -> Result<T, Error> {
        let query = filter.query_pairs();
        self.call(Method::GET, &["v1", "loadbalancers"], |request| {
            request.query(&query)
        })
        .await
    }

    async fn update<T: DeserializeOwned>(
        &self,
        id: &str,
        spec: &impl Serialize,
        if_match_version: u64,
    ) -> Result<T, Error> {
        let version = if_match_version.to_string();
        self.call(Method::PUT, &["v1", "loadbalancers", id], |request| {
            request
                .header(reqwest::header::IF_MATCH, version.as_str())
                .json(spec)
        })
        .await
    }

    /// Deletes `id`; succeeds when it is already gone.
    #[tracing::instrument(skip(self))]
    pub async fn delete_load_balancer(&self, id: &str) -> Result<(), Error> {
        match self
            .execute(Method::DELETE, &["v1", "loadbalancers", id], |request| {
                request
            })
            .await
        {
            Ok(_) | Err(Error::NotFound { .. }) => Ok(()),
            Err(err) => Err(err),
        }
    }

    /// The VIP pools, by name.
    #[tracing::instrument(skip(self))]
    pub async fn list_pools(&self) -> Result<Vec<Pool>, Error> {
        let list: PoolList = self
            .call(Method::GET, &["v1", "pools"], |request| request)
            .await?;
        Ok(list.items)
    }

    /// Creates or replaces the node pool `name`. With `if_match` the pool must still be at
    /// that version ([`Error::Conflict`] with code `version-mismatch` otherwise); without it
    /// the spec replaces whatever is there. Sending the pool's current content changes
    /// nothing (same version).
    #[tracing::instrument(skip(self, spec), fields(backends = spec.backends.len()))]
    pub async fn put_node_pool(
        &self,
        name: &str,
        spec: &NodePoolSpec,
        if_match: Option<u64>,
    ) -> Result<NodePool, Error> {
        let version = if_match.map(|version| version.to_string());
        self.call(Method::PUT, &["v1", "nodepools", name], |request| {
            let request = request.json(spec);
            match &version {
                Some(version) => request.header(reqwest::header::IF_MATCH, version.as_str()),
                None => request,
            }
        })
        .await
    }

    /// The node pool `name`; [`Error::NotFound`] when there is none.
    #[tracing::instrument(skip(self))]
    pub async fn get_node_pool(&self, name: &str) -> Result<NodePool, Error> {
        self.call(Method::GET, &["v1", "nodepools", name], |request| request)
            .await
    }

    /// Every node pool that carries all of `filter.tags` and, if given, is named
    /// `filter.name`.
    #[tracing::instrument(skip(self))]
    pub async fn list_node_pools(&self, filter: &ListFilter) -> Result<Vec<NodePool>, Error> {
        let query = filter.query_pairs();
        let list: NodePoolList = self
            .call(Method::GET, &["v1", "nodepools"], |request| {
                request.query(&query)
            })
            .await?;
        Ok(list.items)
    }

    /// Deletes the node pool `name`: [`Error::Conflict`] with code `node-pool-in-use`
    /// while a load balancer references it, [`Error::NotFound`] when there is none (a
    /// retry after a lost answer sees that too).
    #[tracing::instrument(skip(self))]
    pub async fn delete_node_pool(&self, name: &str) -> Result<(), Error> {
        self.execute(Method::DELETE, &["v1", "nodepools", name], |request| {
            request
        })
        .await
        .map(drop)
    }

    /// Sets the faults the server injects (tests only). [`Faults::default`] clears them.
    #[tracing::instrument(skip(self))]
    pub async fn set_faults(&self, faults: &Faults) -> Result<(), Error> {
        self.execute(Method::PUT, &["v1", "admin", "faults"], |request| {
            request.json(faults)
        })
        .await
        .map(drop)
    }

    /// The URL of `segments` below the edge `base`.
    fn url(base: &Url, segments: &[&str]) -> Result<Url, Error> {
        let mut url = base.clone();
        url.path_segments_mut()
            .map_err(|()| Error::Invalid {
                code: None,
                message: format!("base URL {base} cannot take a path"),
            })?
            .pop_if_empty()
            .extend(segments);
        Ok(url)
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        segments: &[&str],
        build: impl Fn(RequestBuilder) -> RequestBuilder,
    ) -> Result<T, Error> {
        let body = self.execute(method, segments, build).await?;
        serde_json::from_slice(&body).map_err(Error::Decode)
    }

    /// Sends the `method` request of `segments` that `build` completes, retrying retryable
    /// failures with backoff, and returns the body of the first successful answer. Once a
    /// request may have reached a server, it is sent again only when that is safe: its
    /// method is idempotent (every one but POST here), or it carries an `Idempotency-Key`
    /// or an `If-Match`, which make the server answer a repeat as it did the first.
    async fn execute(
        &self,
        method: Method,
        segments: &[&str],
        build: impl Fn(RequestBuilder) -> RequestBuilder,
    ) -> Result<Vec<u8>, Error> {
        let options = &self.inner.options;
        let mut attempt = 0;
        loop {
            let error = match self.send(&method, segments, &build).await {
                // No edge took the connection: nothing reached a server.
                Err(unsent) => unsent,
                Ok(sent) => {
                    let error = match sent.outcome {
                        Ok(response) => match answer(response).await {
                            Ok(body) => return Ok(body),
                            Err(error) => error,
                        },
                        Err(error) => Error::Transport(error),
                    };
                    if !sent.resendable {
                        return Err(error);
                    }
                    error
                }
            };
            if !error.is_retryable() || attempt >= options.max_retries {
                return Err(error);
            }
            let delay = retry_delay(options, attempt, &error, rand::random::<f64>());
            tracing::debug!(%error, attempt, ?delay, "retrying cloud API call");
            tokio::time::sleep(delay).await;
            attempt += 1;
        }
    }

    /// One attempt: the request sent to the current edge or, when that edge does not take
    /// the connection, to each next one in turn; the first that takes it becomes the
    /// current edge. `Err` when none takes it (nothing was sent): with one edge, its
    /// [`Error::Transport`]; with several, [`Error::Unreachable`].
    async fn send(
        &self,
        method: &Method,
        segments: &[&str],
        build: &impl Fn(RequestBuilder) -> RequestBuilder,
    ) -> Result<Sent, Error> {
        let edges = &self.inner.edges;
        let current = self.inner.current_edge.load(Ordering::Relaxed);
        let mut refused = Vec::new();
        let authorization = self
            .inner
            .authorization
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for offset in 0..edges.len() {
            let index = (current + offset) % edges.len();
            let edge = &edges[index];
            let request = build(
                self.inner
                    .http
                    .request(method.clone(), Self::url(edge, segments)?)
                    .header(AUTHORIZATION, authorization.clone()),
            )
            .build()
            .map_err(|error| Error::Invalid {
                code: None,
                message: format!("the request cannot be built: {error}"),
            })?;
            let resendable = resendable(&request);
            match self.inner.http.execute(request).await {
                Err(error) if error.is_connect() => {
                    tracing::debug!(%edge, %error, "cloud edge refused the connection");
                    refused.push(EdgeFailure {
                        edge: edge.to_string(),
                        error,
                    });
                }
                outcome => {
                    if index != current {
                        self.inner.current_edge.store(index, Ordering::Relaxed);
                        let unreachable: Vec<&str> = refused
                            .iter()
                            .map(|failure| failure.edge.as_str())
                            .collect();
                        tracing::warn!(%edge, ?unreachable, "cloud API calls go to another edge");
                    }
                    return Ok(Sent {
                        outcome,
                        resendable,
                    });
                }
            }
        }
        Err(match refused.len() {
            1 => Error::Transport(refused.remove(0).error),
            _ => Error::Unreachable(refused),
        })
    }
}

/// The `Authorization` header of `token`, marked sensitive so that no debug output shows it.
fn authorization(token: &str) -> Result<HeaderValue, Error> {
    let mut value =
        HeaderValue::try_from(format!("Bearer {token}")).map_err(|_| Error::Invalid {
            code: None,
            message: "the token has characters an HTTP header cannot carry".to_owned(),
        })?;
    value.set_sensitive(true);
    Ok(value)
}

/// The body of a successful answer, or the typed error of another.
async fn answer(response: reqwest::Response) -> Result<Vec<u8>, Error> {
    let status = response.status();
    let retry_after = retry_after(response.headers());
    let body = response.bytes().await.map_err(Error::Transport)?;
    if status.is_success() {
        Ok(body.to_vec())
    } else {
        Err(error_from_response(status, retry_after, &body))
    }
}

/// Whether `request` may be sent again after its bytes may have reached the server: its
/// method is idempotent, or its `Idempotency-Key` or `If-Match` makes the server answer a
/// repeat as it answered the first.
fn resendable(request: &reqwest::Request) -> bool {
    request.method().is_idempotent()
        || request.headers().contains_key(IDEMPOTENCY_KEY)
        || request.headers().contains_key(reqwest::header::IF_MATCH)
}

/// A base URL as given: an `http` or `https` URL that can take a path.
fn parse_base_url(base_url: &str) -> Result<Url, Error> {
    let parsed = Url::parse(base_url).map_err(|err| Error::Invalid {
        code: None,
        message: format!("base URL {base_url:?}: {err}"),
    })?;
    if parsed.cannot_be_a_base() || !matches!(parsed.scheme(), "http" | "https") {
        return Err(Error::Invalid {
            code: None,
            message: format!("base URL {parsed} is not an http(s) URL"),
        });
    }
    Ok(parsed)
}

/// The load-balancer calls of a [`Client`] with the whole load balancer, of any IP family
/// (from [`Client::families`]); the same retries, timeouts and errors.
#[derive(Debug, Clone, Copy)]
pub struct FamiliesClient<'a> {
    client: &'a Client,
}

impl FamiliesClient<'_> {
    /// Creates a load balancer; see [`Client::create_load_balancer`].
    #[tracing::instrument(skip(self, spec), fields(name = %spec.name))]
    pub async fn create_load_balancer(
        &self,
        spec: &families::LoadBalancerSpec,
        idempotency_key: &str,
    ) -> Result<families::LoadBalancer, Error> {
        self.client.create(spec, idempotency_key, None).await
    }

    /// Creates a load balancer under the id `id`, chosen by the caller so it can record
    /// the id before it asks. A retry with the same `idempotency_key` answers the LB the
    /// first made; [`Error::Conflict`] (`id-taken`) when another create holds the id.
    #[tracing::instrument(skip(self, spec), fields(name = %spec.name))]
    pub async fn create_load_balancer_as(
        &self,
        id: &str,
        spec: &families::LoadBalancerSpec,
        idempotency_key: &str,
    ) -> Result<families::LoadBalancer, Error> {
        self.client.create(spec, idempotency_key, Some(id)).await
    }

    /// The load balancer `id`; [`Error::NotFound`] when there is none.
    #[tracing::instrument(skip(self))]
    pub async fn get_load_balancer(&self, id: &str) -> Result<families::LoadBalancer, Error> {
        self.client.get(id).await
    }

    /// The load balancer `id` once it is no longer provisioning; see
    /// [`Client::get_load_balancer_provisioned`].
    #[tracing::instrument(skip(self))]
    pub async fn get_load_balancer_provisioned(
        &self,
        id: &str,
        wait: Duration,
    ) -> Result<families::LoadBalancer, Error> {
        self.client.get_provisioned(id, wait).await
    }

    /// Every load balancer that carries all of `filter.tags` and, if given, `filter.name`.
    #[tracing::instrument(skip(self))]
    pub async fn list_load_balancers(
        &self,
        filter: &ListFilter,
    ) -> Result<Vec<families::LoadBalancer>, Error> {
        let list: families::LoadBalancerList = self.client.list(filter).await?;
        Ok(list.items)
    }

    /// Replaces the desired state of `id`; see [`Client::update_load_balancer`].
    #[tracing::instrument(skip(self, spec))]
    pub async fn update_load_balancer(
        &self,
        id: &str,
        spec: &families::LoadBalancerSpec,
        if_match_version: u64,
    ) -> Result<families::LoadBalancer, Error> {
        self.client.update(id, spec, if_match_version).await
    }
}

fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?;
    value.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// The typed error for a non-success answer.
pub(crate) fn error_from_response(
    status: StatusCode,
    retry_after: Option<Duration>,
    body: &[u8],
) -> Error {
    let (code, detail) = match serde_json::from_slice::<ErrorBody>(body) {
        Ok(parsed) => (Some(parsed.error.code), parsed.error.message),
        Err(_) => (
            None,
            format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            ),
        ),
    };
    let message = crate::error::coded(&code, &detail);
    match status {
        StatusCode::UNAUTHORIZED => Error::Unauthorized,
        // A known credential that may not do this: not a token to rotate.
        StatusCode::FORBIDDEN => Error::Forbidden {
            code,
            message: detail,
        },
        StatusCode::NOT_FOUND => Error::NotFound { message },
        StatusCode::CONFLICT | StatusCode::PRECONDITION_FAILED => Error::Conflict {
            code,
            message: detail,
        },
        StatusCode::TOO_MANY_REQUESTS => Error::RateLimited {
            retry_after: retry_after.unwrap_or(Duration::from_secs(1)),
        },
        status if status.is_server_error() || status == StatusCode::REQUEST_TIMEOUT => {
            Error::Unavailable { message }
        }
        _ => Error::Invalid {
            code,
            message: detail,
        },
    }
}

/// How long to wait before retry number `attempt + 1`: the server's `Retry-After` when it
/// sent one, else exponential backoff with jitter (`jitter` in 0..1 picks a point in the
/// upper half of the step, so concurrent clients spread out).
pub(crate) fn retry_delay(
    options: &ClientOptions,
    attempt: u32,
    error: &Error,
    jitter: f64,
) -> Duration {
    if let Error::RateLimited { retry_after } = error {
        return *retry_after;
    }
    let step = options
        .initial_backoff
        .saturating_mul(2u32.saturating_pow(attempt))
        .min(options.max_backoff);
    step / 2 + step.mul_f64(jitter.clamp(0.0, 1.0) / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> ClientOptions {
        ClientOptions {
            timeout: Duration::from_secs(1),
            max_retries: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(500),
            ..ClientOptions::default()
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let unavailable = Error::Unavailable {
            message: "x".into(),
        };
        let full = |attempt| retry_delay(&options(), attempt, &unavailable, 1.0);
        assert_eq!(full(0), Duration::from_millis(100));
        assert_eq!(full(1), Duration::from_millis(200));
        assert_eq!(full(2), Duration::from_millis(400));
        assert_eq!(full(3), Duration::from_millis(500));
        assert_eq!(full(40), Duration::from_millis(500));
        assert_eq!(
            retry_delay(&options(), 1, &unavailable, 0.0),
            Duration::from_millis(100)
        );
    }

    #[test]
    fn retry_after_wins_over_backoff() {
        let limited = Error::RateLimited {
            retry_after: Duration::from_secs(2),
        };
        assert_eq!(
            retry_delay(&options(), 0, &limited, 0.3),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn statuses_map_to_typed_errors() {
        let body = br#"{"error": {"code": "vip-taken", "message": "127.77.0.9 is in use"}}"#;
        match error_from_response(StatusCode::CONFLICT, None, body) {
            Error::Conflict { code, message } => {
                assert_eq!(code.as_deref(), Some("vip-taken"));
                assert_eq!(message, "127.77.0.9 is in use");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            error_from_response(StatusCode::PRECONDITION_FAILED, None, b"{}"),
            Error::Conflict { .. }
        ));
        assert!(matches!(
            error_from_response(StatusCode::UNAUTHORIZED, None, b""),
            Error::Unauthorized
        ));
        let quota = br#"{"error": {"code": "quota-exceeded", "message": "tenant \"team-a\" reached its quota of 5 load balancers (quota loadBalancers)"}}"#;
        match error_from_response(StatusCode::FORBIDDEN, None, quota) {
            forbidden @ Error::Forbidden { .. } => {
                assert_eq!(forbidden.code(), Some("quota-exceeded"));
                assert_eq!(
                    forbidden.to_string(),
                    r#"forbidden: quota-exceeded: tenant "team-a" reached its quota of 5 load balancers (quota loadBalancers)"#
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        // A 403 without the cloud's JSON is still forbidden, never unauthorized.
        match error_from_response(StatusCode::FORBIDDEN, None, b"nope") {
            Error::Forbidden { code, message } => {
                assert_eq!(code, None);
                assert_eq!(message, "HTTP 403 Forbidden: nope");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            error_from_response(StatusCode::NOT_FOUND, None, b"not json"),
            Error::NotFound { .. }
        ));
        assert!(matches!(
            error_from_response(StatusCode::BAD_REQUEST, None, b""),
            Error::Invalid { .. }
        ));
        assert!(matches!(
            error_from_response(StatusCode::SERVICE_UNAVAILABLE, None, b""),
            Error::Unavailable { .. }
        ));
        match error_from_response(
            StatusCode::TOO_MANY_REQUESTS,
            Some(Duration::from_secs(3)),
            b"",
        ) {
            Error::RateLimited { retry_after } => assert_eq!(retry_after, Duration::from_secs(3)),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn retry_after_header_is_read_in_seconds() {
        let mut headers = HeaderMap::new();
        assert_eq!(retry_after(&headers), None);
        headers.insert(RETRY_AFTER, "7".parse().unwrap());
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(7)));
        headers.insert(RETRY_AFTER, "soon".parse().unwrap());
        assert_eq!(retry_after(&headers), None);
    }

    #[test]
    fn urls_escape_ids_and_keep_a_base_path() {
        let base = parse_base_url("http://127.0.0.1:9/prefix/").unwrap();
        assert_eq!(
            Client::url(&base, &["v1", "loadbalancers", "a/b"])
                .unwrap()
                .as_str(),
            "http://127.0.0.1:9/prefix/v1/loadbalancers/a%2Fb"
        );
        assert!(Client::new("not a url", "t", options()).is_err());
        assert!(Client::new("ftp://x", "t", options()).is_err());
    }

    #[test]
    fn a_token_is_sent_as_a_sensitive_bearer_header() {
        let client = Client::new("http://127.0.0.1:9", "first", options()).unwrap();
        let sent = || {
            client
                .inner
                .authorization
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        };
        assert_eq!(sent(), "Bearer first");
        assert!(sent().is_sensitive());
        client.clone().set_token("second").unwrap();
        assert_eq!(sent(), "Bearer second", "clones share the token");
        assert!(matches!(
            client.set_token("bad\ntoken"),
            Err(Error::Invalid { .. })
        ));
        assert_eq!(sent(), "Bearer second", "a refused token changes nothing");
        assert!(!format!("{client:?}").contains("second"));
    }

    #[test]
    fn only_a_request_a_repeat_cannot_harm_is_sent_again() {
        let url = Url::parse("http://127.0.0.1:9/v1/loadbalancers").unwrap();
        let request = |method: Method, header: Option<&'static str>| {
            let mut request = reqwest::Request::new(method, url.clone());
            if let Some(name) = header {
                request.headers_mut().insert(name, "1".parse().unwrap());
            }
            request
        };
        assert!(!resendable(&request(Method::POST, None)));
        assert!(resendable(&request(Method::POST, Some(IDEMPOTENCY_KEY))));
        assert!(resendable(&request(Method::POST, Some("if-match"))));
        for idempotent in [Method::GET, Method::PUT, Method::DELETE] {
            assert!(resendable(&request(idempotent, None)));
        }
    }

    #[test]
    fn root_certificates_must_be_pem_certificates() {
        let with_roots = |pem: &str| ClientOptions {
            root_certificates: Some(pem.to_owned()),
            ..options()
        };
        for bad in [
            "",
            "not PEM",
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
            "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
        ] {
            let refused = Client::new("https://127.0.0.1:9", "t", with_roots(bad));
            assert!(
                matches!(refused, Err(Error::Tls(TlsError::RootCertificates(_)))),
                "{bad:?}: {refused:?}"
            );
        }
        // Without roots of its own the client trusts the platform's, for http and https.
        assert!(Client::new("https://127.0.0.1:9", "t", options()).is_ok());
    }
}
