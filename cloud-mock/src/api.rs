//! The HTTP API: a route table (also the source of truth the OpenAPI check compares with),
//! the handlers, and the auth, fault-injection, metrics and audit middleware.
//!
//! Every call is scoped to its caller's tenant (see [`crate::tenants`]): another tenant's
//! load balancer or node pool answers 404, exactly as one that does not exist.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use axum::Json;
use axum::Router;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{
    ConnectInfo, DefaultBodyLimit, Extension, MatchedPath, Path, Query, Request, State,
};
use axum::handler::Handler;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter, on};
use cloud_mock_dataplane::DataPlane;
use cloud_mock_sdk::families::{LoadBalancer, LoadBalancerList, LoadBalancerSpec};
use cloud_mock_sdk::{
    Faults, ListFilter, LostAnswer, NodePool, NodePoolList, NodePoolSpec, PoolList,
};
use http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tandem_common::is_dns1123_label;
use tandem_common::tls::{ClientName, PeerCertificate};

use crate::credentials::{Caller, CredentialSet, Credentials};
use crate::error::{ApiError, ErrorCode};
use crate::extract::{JsonBody, MAX_BODY_BYTES};
use crate::faults::{FaultState, MAX_LATENCY_MS, Verdict, validate_faults};
use crate::lifecycle::now_ms;
use crate::metrics::{Metrics, NodePoolWrite};
use crate::model::{StoredLoadBalancer, StoredNodePool, node_pool_to_wire, to_wire, wire_health};
use crate::store::{Store, Transition, Written};
use crate::validate::{validate_node_pool, validate_served, validate_spec};

/// The OpenAPI document of this API, served at `/openapi.yaml`.
pub const OPENAPI_YAML: &str = include_str!("../openapi.yaml");

const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// Everything the handlers share.
#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub dataplane: DataPlane,
    /// Injected faults, when the edge was started with them (`--fault-injection`); without,
    /// no route takes this lock and `/v1/admin/faults` does not exist.
    pub faults: Option<Arc<Mutex<FaultState>>>,
    pub metrics: Metrics,
    pub registry: Arc<Registry>,
    pub credentials: Credentials,
    /// Whether passthrough load balancers can be served: not in the L2 mode, whose owner
    /// of a VIP takes the VIP's packets itself.
    pub serves_passthrough: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Get,
    Post,
    Put,
    Delete,
}

impl Verb {
    pub fn method(self) -> Method {
        match self {
            Verb::Get => Method::GET,
            Verb::Post => Method::POST,
            Verb::Put => Method::PUT,
            Verb::Delete => Method::DELETE,
        }
    }

    fn filter(self) -> MethodFilter {
        match self {
            Verb::Get => MethodFilter::GET,
            Verb::Post => MethodFilter::POST,
            Verb::Put => MethodFilter::PUT,
            Verb::Delete => MethodFilter::DELETE,
        }
    }
}

/// Who may call a route, and whether injected faults apply to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Public,
    /// Bearer token required, scoped to its tenant; injected faults apply (the
    /// load-balancer and node-pool API).
    TokenWithFaults,
    /// An admin's bearer token required (or the one of an edge without tenants); served
    /// only with fault injection on (setting the faults).
    FaultAdmin,
}

pub struct Route {
    pub path: &'static str,
    pub verb: Verb,
    pub access: Access,
    handler: MethodRouter<AppState>,
}

fn route<H, T>(path: &'static str, verb: Verb, access: Access, handler: H) -> Route
where
    H: Handler<T, AppState>,
    T: 'static,
{
    Route {
        path,
        verb,
        access,
        handler: on(verb.filter(), handler),
    }
}

/// Every route of the API: the router is built from this table, and the OpenAPI test
/// compares it with `openapi.yaml`.
pub fn routes() -> Vec<Route> {
    use Access::{FaultAdmin, Public, TokenWithFaults};
    use Verb::{Delete, Get, Post, Put};
    vec![
        route("/healthz", Get, Public, healthz),
        route("/metrics", Get, Public, metrics),
        route("/openapi.yaml", Get, Public, openapi),
        route(
            "/v1/loadbalancers",
            Get,
            TokenWithFaults,
            list_load_balancers,
        ),
        route(
            "/v1/loadbalancers",
            Post,
            TokenWithFaults,
            create_load_balancer,
        ),
        route(
            "/v1/loadbalancers/{id}",
            Get,
            TokenWithFaults,
            get_load_balancer,
        ),
        route(
            "/v1/loadbalancers/{id}",
            Put,
            TokenWithFaults,
            update_load_balancer,
        ),
        route(
            "/v1/loadbalancers/{id}",
            Delete,
            TokenWithFaults,
            delete_load_balancer,
        ),
        route("/v1/pools", Get, TokenWithFaults, list_pools),
        route("/v1/nodepools", Get, TokenWithFaults, list_node_pools),
        route("/v1/nodepools/{name}", Get, TokenWithFaults, get_node_pool),
        route("/v1/nodepools/{name}", Put, TokenWithFaults, put_node_pool),
        route(
            "/v1/nodepools/{name}",
            Delete,
            TokenWithFaults,
            delete_node_pool,
        ),
        route("/v1/admin/faults", Get, FaultAdmin, get_faults),
        route("/v1/admin/faults", Put, FaultAdmin, set_faults),
    ]
}

pub fn router(state: AppState) -> Router {
    let mut router = Router::new();
    for Route {
        path,
        access,
        handler,
        ..
    } in routes()
    {
        let faults = state.faults.is_some();
        let token = middleware::from_fn_with_state(state.clone(), require_token);
        let handler = match access {
            Access::Public => handler,
            Access::FaultAdmin if !faults => continue,
            Access::FaultAdmin => handler
                .route_layer(middleware::from_fn(require_admin))
                .route_layer(token),
            Access::TokenWithFaults if !faults => handler.route_layer(token),
            Access::TokenWithFaults => handler
                .route_layer(middleware::from_fn_with_state(state.clone(), inject_faults))
                .route_layer(token),
        };
        router = router.route(path, handler);
    }
    router
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            record_request,
        ))
        .with_state(state)
}

async fn no_route(method: Method, uri: http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "no-route",
        format!("no route for {method} {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}

/// The header that names a request in logs: the client's, or one the edge makes.
const REQUEST_ID: &str = "x-request-id";

/// The client's request id if it is a sane one (1 to 128 visible characters), else a new
/// one.
fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(REQUEST_ID)
        .and_then(|value| value.to_str().ok())
        .filter(|id| !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| format!("{:016x}", rand::random::<u64>()), str::to_owned)
}

/// Counts every request and writes the audit log: one line for every write (any method
/// but the safe ones: GET, HEAD, OPTIONS, TRACE), whoever sent it and however it ended,
/// under the tracing target `audit`. The request id goes back in the answer.
async fn record_request(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |path| path.as_str().to_owned());
    let method = request.method().clone();
    // Reads change nothing: only a write's path is kept, for its audit line.
    let path = (!method.is_safe()).then(|| request.uri().path().to_owned());
    let id = request_id(request.headers());
    let mut response = next.run(request).await;
    let status = response.status();
    state.metrics.request(&route, &method, status.as_u16());
    if let Some(path) = path {
        let caller = response.extensions().get::<Caller>();
        // A create names its object in Location; the other writes in their path.
        let object = response
            .headers()
            .get(header::LOCATION)
            .and_then(|value| value.to_str().ok())
            .unwrap_or(&path);
        tracing::info!(
            target: "audit",
            request_id = %id,
            tenant = caller.map_or("-", Caller::name),
            credential = caller.map_or("-", |caller| &*caller.credential),
            operation = %format_args!("{method} {route}"),
            object = object.strip_prefix("/v1/").unwrap_or(object),
            status = status.as_u16(),
            result = response.extensions().get::<ErrorCode>().map_or("ok", |code| code.0),
            "audit"
        );
    }
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID, value);
    }
    response
}

/// The caller whose bearer token the request carries, or else whose verified client
/// certificate its connection showed (the tenant of its common name). Both together must
/// name one tenant.
fn authenticate(
    headers: &HeaderMap,
    client: Option<&ClientName>,
    credentials: &CredentialSet,
) -> Option<Caller> {
    let Some(authorization) = headers.get(header::AUTHORIZATION) else {
        return client.and_then(|client| credentials.certificate(client));
    };
    let caller = authorization
        .to_str()
        .ok()
        .and_then(|value| value.strip_prefix("Bearer "))
        .and_then(|given| credentials.accepts(given.trim()))?;
    match (caller.tenant(), client) {
        (Some(tenant), Some(client)) if tenant.name != client.common_name => None,
        _ => Some(caller),
    }
}

/// Lets through a request with a valid bearer token or client certificate, within its
/// tenant's rate limit, and hands its [`Caller`] to the handler (and, on the answer, to
/// the audit log).
async fn require_token(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let client = request
        .extensions()
        .get::<ConnectInfo<PeerCertificate>>()
        .and_then(|ConnectInfo(PeerCertificate(client))| client.as_ref());
    let caller = authenticate(request.headers(), client, &state.credentials.current());
    let Some(caller) = caller else {
        let mut response = ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid bearer token (Authorization: Bearer TOKEN) or client certificate is required",
        )
        .into_response();
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"cloud-mock\""),
        );
        return response;
    };
    let mut response = match caller.tenant().map(|tenant| tenant.admit()) {
        Some(Err(wait)) => {
            state.metrics.rate_limited(caller.name());
            // Whole seconds, rounded up: a client that waits that long is let through.
            let retry_after_secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            ApiError {
                retry_after_secs: Some(retry_after_secs),
                ..ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate-limited",
                    format!(
                        "tenant {:?} is over its rate limit; retry after {retry_after_secs} s",
                        caller.name()
                    ),
                )
            }
            .into_response()
        }
        _ => {
            request.extensions_mut().insert(caller.clone());
            next.run(request).await
        }
    };
    response.extensions_mut().insert(caller);
    response
}

/// Lets through only an admin (after [`require_token`]).
async fn require_admin(
    Extension(caller): Extension<Caller>,
    request: Request,
    next: Next,
) -> Response {
    if caller.may_administer() {
        return next.run(request).await;
    }
    ApiError::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        format!(
            "tenant {:?} may not manage the edge: this takes an admin credential",
            caller.name()
        ),
    )
    .into_response()
}

/// Whether `caller` sees an object with `tags`.
fn visible(caller: &Caller, tags: &BTreeMap<String, String>) -> bool {
    caller.tenant().is_none_or(|tenant| tenant.owns(tags))
}

/// Refuses a write of an object with `tags` that would not be `caller`'s.
fn check_writable(caller: &Caller, tags: &BTreeMap<String, String>) -> Result<(), ApiError> {
    match caller.tenant() {
        Some(tenant) => Ok(tenant.check_cluster(tags)?),
        None => Ok(()),
    }
}

/// The load balancer `id`, if `caller` may see it.
fn visible_lb(state: &AppState, caller: &Caller, id: &str) -> Option<Arc<StoredLoadBalancer>> {
    state
        .store
        .get(id)
        .filter(|lb| visible(caller, &lb.spec.tags))
}

fn lb_not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("load balancer {id} not found"))
}

/// Refuses a spec naming a node pool that `caller` may not see, as one that does not exist.
fn check_node_pool_visible(
    state: &AppState,
    caller: &Caller,
    spec: &LoadBalancerSpec,
) -> Result<(), ApiError> {
    match &spec.node_pool {
        Some(name)
            if state
                .store
                .node_pool(name)
                .is_some_and(|pool| !visible(caller, &pool.spec.tags)) =>
        {
            Err(crate::store::StoreError::UnknownNodePool { name: name.clone() }.into())
        }
        _ => Ok(()),
    }
}

/// The idempotency key as the store keeps it: a tenant's keys are its own, so another's
/// same key neither replays nor reveals its load balancer.
fn scoped_key(caller: &Caller, key: Option<String>) -> Option<String> {
    match caller.tenant() {
        Some(tenant) => key.map(|key| format!("{}/{key}", tenant.name)),
        None => key,
    }
}

async fn inject_faults(State(state): State<AppState>, request: Request, next: Next) -> Response {
    // Layered only when fault injection is on.
    let Some(faults) = state.faults.clone() else {
        return next.run(request).await;
    };
    let verdict = faults
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .admit(Instant::now(), rand::random::<f64>());
    match verdict {
        Verdict::RateLimited { retry_after_secs } => ApiError {
            retry_after_secs: Some(retry_after_secs),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate-limited",
                format!("rate limit exceeded; retry after {retry_after_secs} s"),
            )
        }
        .into_response(),
        Verdict::Proceed { latency, fail } => {
            if !latency.is_zero() {
                tokio::time::sleep(latency).await;
            }
            if fail {
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "injected fault: the cloud is temporarily unavailable",
                )
                .into_response()
            } else {
                let response = next.run(request).await;
                if response.extensions().get::<Committed>().is_none() {
                    return response;
                }
                let lost = faults
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .lose_answer(rand::random::<f64>());
                match lost {
                    None => response,
                    Some(how) => lose_answer(how).await,
                }
            }
        }
    }
}

/// Marks an answer to a request that committed a change (what a lost answer hides).
#[derive(Debug, Clone, Copy)]
struct Committed;

fn committed(mut response: Response) -> Response {
    response.extensions_mut().insert(Committed);
    response
}

/// The answer a client gets instead of the one to its committed change.
async fn lose_answer(how: LostAnswer) -> Response {
    tracing::info!(
        ?how,
        "injected fault: losing the answer to a committed change"
    );
    match how {
        LostAnswer::Unavailable => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "injected fault: the cloud is temporarily unavailable",
        )
        .into_response(),
        LostAnswer::Hang => {
            tokio::time::sleep(std::time::Duration::from_millis(MAX_LATENCY_MS)).await;
            connection_reset()
        }
        LostAnswer::Reset => connection_reset(),
    }
}

/// An answer whose body fails at once: the server closes the connection mid-answer.
fn connection_reset() -> Response {
    let failing = futures::stream::once(async {
        Err::<axum::body::Bytes, std::io::Error>(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        ))
    });
    Response::new(axum::body::Body::from_stream(failing))
}

async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &state.registry).map_err(|err| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("encoding metrics: {err}"),
        )
    })?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/yaml")], OPENAPI_YAML).into_response()
}

/// The API answer for `stored` (on `node_pool`, the pool it names, if any), with the
/// data plane's current backend health.
fn answer(
    state: &AppState,
    stored: &StoredLoadBalancer,
    node_pool: Option<&StoredNodePool>,
) -> LoadBalancer {
    let observed: Vec<_> = state
        .dataplane
        .backend_health(&stored.id)
        .into_iter()
        .map(|(ip, health)| (ip, wire_health(health)))
        .collect();
    to_wire(stored, node_pool, &observed)
}

/// [`answer`] for one load balancer, reading the node pool it names (as it is now).
fn answer_one(state: &AppState, stored: &StoredLoadBalancer) -> LoadBalancer {
    let node_pool = stored
        .spec
        .node_pool
        .as_ref()
        .and_then(|name| state.store.node_pool(name));
    answer(state, stored, node_pool.as_ref())
}

fn etag(version: u64) -> (header::HeaderName, String) {
    (header::ETAG, format!("\"{version}\""))
}

fn path_id(path: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    path.map(|Path(id)| id)
        .map_err(|rejection| ApiError::bad_request("invalid-path", rejection.body_text()))
}

/// Parses the list query: `name=N` at most once, `tag=KEY=VALUE` any number of times.
pub fn parse_list_filter(pairs: &[(String, String)]) -> Result<ListFilter, ApiError> {
    let mut filter = ListFilter::default();
    for (key, value) in pairs {
        match key.as_str() {
            "name" if filter.name.is_none() => filter.name = Some(value.clone()),
            "name" => {
                return Err(ApiError::bad_request(
                    "invalid-query",
                    "name may be given once",
                ));
            }
            "tag" => {
                let Some((tag, tag_value)) = value.split_once('=') else {
                    return Err(ApiError::bad_request(
                        "invalid-query",
                        format!("tag filter {value:?} must look like KEY=VALUE"),
                    ));
                };
                filter.tags.insert(tag.to_owned(), tag_value.to_owned());
            }
            other => {
                return Err(ApiError::bad_request(
                    "invalid-query",
                    format!("unknown query parameter {other:?}; use name and tag"),
                ));
            }
        }
    }
    Ok(filter)
}

/// True when `lb` passes `filter`.
pub fn matches_filter(lb: &StoredLoadBalancer, filter: &ListFilter) -> bool {
    passes(filter, &lb.spec.name, &lb.spec.tags)
}

/// True when something named `name` with `tags` passes `filter`.
fn passes(filter: &ListFilter, name: &str, tags: &BTreeMap<String, String>) -> bool {
    filter.name.as_ref().is_none_or(|wanted| wanted == name)
        && filter
            .tags
            .iter()
            .all(|(key, value)| tags.get(key) == Some(value))
}

async fn list_load_balancers(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Json<LoadBalancerList>, ApiError> {
    let Query(pairs) =
        query.map_err(|rejection| ApiError::bad_request("invalid-query", rejection.body_text()))?;
    let filter = parse_list_filter(&pairs)?;
    let all = state.store.snapshot();
    let items = all
        .load_balancers
        .iter()
        .filter(|lb| visible(&caller, &lb.spec.tags) && matches_filter(lb, &filter))
        .map(|lb| answer(&state, lb, all.node_pool_of(lb)))
        .collect();
    Ok(Json(LoadBalancerList { items }))
}

/// The `Idempotency-Key` header, if sent.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(cloud_mock_sdk::IDEMPOTENCY_KEY) else {
        return Ok(None);
    };
    match value.to_str() {
        Ok(key) if !key.is_empty() && key.len() <= MAX_IDEMPOTENCY_KEY_LEN => {
            Ok(Some(key.to_owned()))
        }
        _ => Err(ApiError::bad_request(
            "invalid-header",
            format!(
                "Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} visible ASCII characters"
            ),
        )),
    }
}

/// The version in `If-Match` (`3` or `"3"`); required on updates.
pub fn if_match_version(headers: &HeaderMap) -> Result<u64, ApiError> {
    if_match(headers)?.ok_or_else(|| {
        ApiError::new(
            StatusCode::PRECONDITION_REQUIRED,
            "precondition-required",
            "an update needs If-Match with the version it was based on",
        )
    })
}

/// The version in `If-Match` (`3` or `"3"`), if sent.
pub fn if_match(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    let Some(value) = headers.get(header::IF_MATCH) else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .map(|text| text.trim().trim_matches('"'))
        .and_then(|text| text.parse::<u64>().ok())
        .map(Some)
        .ok_or_else(|| {
            ApiError::bad_request(
                "invalid-header",
                "If-Match must be the version, a whole number",
            )
        })
}

/// The query of a create.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateQuery {
    /// The id the client chose for the load balancer (as AIP-133's `{resource}_id`), so
    /// it can record the id before it asks; the store chooses one when absent.
    load_balancer_id: Option<String>,
}

async fn create_load_balancer(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    query: Result<Query<CreateQuery>, QueryRejection>,
    JsonBody(spec): JsonBody<LoadBalancerSpec>,
) -> Result<Response, ApiError> {
    let Query(CreateQuery { load_balancer_id }) =
        query.map_err(|rejection| ApiError::bad_request("invalid-query", rejection.body_text()))?;
    if let Some(id) = &load_balancer_id
        && !is_dns1123_label(id)
    {
        return Err(ApiError::bad_request(
            "invalid-query",
            format!("loadBalancerId {id:?} is not a DNS label (a-z, 0-9 and '-', at most 63)"),
        ));
    }
    let key = scoped_key(&caller, idempotency_key(&headers)?);
    check_writable(&caller, &spec.tags)?;
    let placement = validate_spec(&spec, state.store.pools())?;
    validate_served(
        &spec,
        state.dataplane.proxies_udp(),
        state.serves_passthrough,
    )?;
    check_node_pool_visible(&state, &caller, &spec)?;
    let now = now_ms();
    let tenant = caller.tenant().cloned();
    let created = state
        .store
        .create(spec, placement, load_balancer_id, key, tenant, now)
        .await?;
    let lb = created.load_balancer;
    if created.is_new {
        tracing::info!(lb = %lb.id, vips = ?lb.vips(), name = %lb.spec.name, "load balancer created");
    }
    let location = format!("/v1/loadbalancers/{}", lb.id);
    let mut response = (
        StatusCode::CREATED,
        [etag(lb.version), (header::LOCATION, location)],
        Json(answer_one(&state, &lb)),
    )
        .into_response();
    if !created.is_new {
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
        return Ok(response);
    }
    Ok(committed(response))
}

/// The query of a read by id.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GetQuery {
    /// Hold the answer while the load balancer is provisioning, up to this long.
    #[serde(default)]
    wait_ms: u64,
}

async fn get_load_balancer(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    path: Result<Path<String>, PathRejection>,
    query: Result<Query<GetQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let id = path_id(path)?;
    let Query(GetQuery { wait_ms }) =
        query.map_err(|rejection| ApiError::bad_request("invalid-query", rejection.body_text()))?;
    let wait = std::time::Duration::from_millis(wait_ms);
    if wait > cloud_mock_sdk::MAX_PROVISIONING_WAIT {
        return Err(ApiError::bad_request(
            "invalid-query",
            format!(
                "waitMs {wait_ms} is longer than the {} ms a read may be held",
                cloud_mock_sdk::MAX_PROVISIONING_WAIT.as_millis()
            ),
        ));
    }
    let deadline = tokio::time::Instant::now() + wait;
    // Subscribed before the first read, so a change between a read and the wait wakes it.
    let mut moved = state.store.subscribe();
    let lb = loop {
        let lb = visible_lb(&state, &caller, &id).ok_or_else(|| lb_not_found(&id))?;
        if lb.state != cloud_mock_sdk::State::Provisioning
            || tokio::time::Instant::now() >= deadline
        {
            break lb;
        }
        match tokio::time::timeout_at(deadline, moved.changed()).await {
            // The store changed, or the wait is over: read again and answer if this one
            // is done or out of time.
            Ok(Ok(())) | Err(_) => {}
            // The store is gone (shutting down): answer as it is.
            Ok(Err(_)) => break lb,
        }
    };
    Ok(([etag(lb.version)], Json(answer_one(&state, &lb))).into_response())
}

async fn update_load_balancer(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    path: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    JsonBody(spec): JsonBody<LoadBalancerSpec>,
) -> Result<Response, ApiError> {
    let id = path_id(path)?;
    visible_lb(&state, &caller, &id).ok_or_else(|| lb_not_found(&id))?;
    let version = if_match_version(&headers)?;
    check_writable(&caller, &spec.tags)?;
    let placement = validate_spec(&spec, state.store.pools())?;
    validate_served(
        &spec,
        state.dataplane.proxies_udp(),
        state.serves_passthrough,
    )?;
    check_node_pool_visible(&state, &caller, &spec)?;
    let lb = state
        .store
        .update(id, spec, placement, version, caller.tenant().cloned())
        .await?;
    let response = ([etag(lb.version)], Json(answer_one(&state, &lb))).into_response();
    if lb.version == version {
        return Ok(response);
    }
    tracing::info!(lb = %lb.id, version = lb.version, "load balancer updated");
    Ok(committed(response))
}

async fn delete_load_balancer(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let id = path_id(path)?;
    if state
        .store
        .get(&id)
        .is_some_and(|lb| !visible(&caller, &lb.spec.tags))
    {
        // Another tenant's: answered as one that is gone.
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    let now = now_ms();
    let deleting = state.store.mark_deleting(id, now).await?;
    Ok(match deleting {
        // Deleting one already being deleted commits nothing.
        Some(Transition {
            load_balancer: lb,
            changed: false,
        }) => (StatusCode::ACCEPTED, Json(answer_one(&state, &lb))).into_response(),
        Some(Transition {
            load_balancer: lb,
            changed: true,
        }) => {
            tracing::info!(lb = %lb.id, "load balancer deleting");
            committed((StatusCode::ACCEPTED, Json(answer_one(&state, &lb))).into_response())
        }
        None => StatusCode::NO_CONTENT.into_response(),
    })
}

async fn list_pools(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<PoolList>, ApiError> {
    let mut items = state.store.pool_use();
    if let Some(tenant) = caller.tenant() {
        items.retain(|pool| tenant.pools.contains(&pool.name));
    }
    Ok(Json(PoolList { items }))
}

async fn list_node_pools(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Result<Json<NodePoolList>, ApiError> {
    let Query(pairs) =
        query.map_err(|rejection| ApiError::bad_request("invalid-query", rejection.body_text()))?;
    let filter = parse_list_filter(&pairs)?;
    let all = state.store.list_node_pools();
    let items = all
        .into_iter()
        .filter(|(pool, _)| {
            visible(&caller, &pool.spec.tags) && passes(&filter, &pool.name, &pool.spec.tags)
        })
        .map(|(pool, load_balancers)| node_pool_to_wire(&pool, load_balancers))
        .collect();
    Ok(Json(NodePoolList { items }))
}

fn node_pool_not_found(name: &str) -> ApiError {
    ApiError::not_found(format!("node pool {name} not found"))
}

async fn get_node_pool(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = path_id(path)?;
    let (pool, load_balancers) = state
        .store
        .get_node_pool(&name)
        .filter(|(pool, _)| visible(&caller, &pool.spec.tags))
        .ok_or_else(|| node_pool_not_found(&name))?;
    let body: NodePool = node_pool_to_wire(&pool, load_balancers);
    Ok(([etag(pool.version)], Json(body)).into_response())
}

/// The metric outcome of a refused or failed node-pool write.
fn unwritten(error: &ApiError) -> NodePoolWrite {
    if error.status.is_server_error() {
        NodePoolWrite::Failed
    } else {
        NodePoolWrite::Refused
    }
}

async fn put_node_pool(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    path: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    JsonBody(spec): JsonBody<NodePoolSpec>,
) -> Result<Response, ApiError> {
    let outcome = write_node_pool(&state, &caller, path, &headers, spec).await;
    state.metrics.node_pool_write(match &outcome {
        Ok((written, _)) => *written,
        Err(error) => unwritten(error),
    });
    outcome.map(|(_, response)| response)
}

async fn write_node_pool(
    state: &AppState,
    caller: &Caller,
    path: Result<Path<String>, PathRejection>,
    headers: &HeaderMap,
    spec: NodePoolSpec,
) -> Result<(NodePoolWrite, Response), ApiError> {
    let name = path_id(path)?;
    let if_match = if_match(headers)?;
    check_writable(caller, &spec.tags)?;
    validate_node_pool(&name, &spec)?;
    if let Some(existing) = state.store.node_pool(&name)
        && !visible(caller, &existing.spec.tags)
    {
        // Names are the edge's, not a tenant's: say only that this one is taken.
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "name-taken",
            format!("node pool name {name} is taken; choose another"),
        ));
    }
    let write = state.store.put_node_pool(name, spec, if_match).await?;
    let pool = &write.node_pool;
    let (status, outcome) = match write.written {
        Written::Created => (StatusCode::CREATED, NodePoolWrite::Created),
        Written::Replaced => (StatusCode::OK, NodePoolWrite::Replaced),
        Written::Unchanged => (StatusCode::OK, NodePoolWrite::Unchanged),
    };
    let location = format!("/v1/nodepools/{}", pool.name);
    let response = (
        status,
        [etag(pool.version), (header::LOCATION, location)],
        Json(node_pool_to_wire(pool, write.load_balancers.clone())),
    )
        .into_response();
    if write.written == Written::Unchanged {
        return Ok((outcome, response));
    }
    tracing::info!(
        node_pool = %pool.name,
        version = pool.version,
        backends = pool.spec.backends.len(),
        load_balancers = write.load_balancers.len(),
        "node pool written"
    );
    Ok((outcome, committed(response)))
}

async fn delete_node_pool(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let outcome = remove_node_pool(&state, &caller, path).await;
    state.metrics.node_pool_write(match &outcome {
        Ok(_) => NodePoolWrite::Deleted,
        Err(error) => unwritten(error),
    });
    outcome
}

async fn remove_node_pool(
    state: &AppState,
    caller: &Caller,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    let name = path_id(path)?;
    if state
        .store
        .node_pool(&name)
        .is_some_and(|pool| !visible(caller, &pool.spec.tags))
    {
        return Err(node_pool_not_found(&name));
    }
    let deleted = state.store.delete_node_pool(name.clone()).await?;
    if !deleted {
        return Err(node_pool_not_found(&name));
    }
    tracing::info!(node_pool = %name, "node pool deleted");
    Ok(committed(StatusCode::NO_CONTENT.into_response()))
}

/// The fault state of an edge with fault injection on (its routes exist only then).
fn fault_state(state: &AppState) -> Result<&Arc<Mutex<FaultState>>, ApiError> {
    state.faults.as_ref().ok_or_else(|| {
        ApiError::not_found("fault injection is off on this edge (--fault-injection)")
    })
}

async fn get_faults(State(state): State<AppState>) -> Result<Json<Faults>, ApiError> {
    Ok(Json(
        fault_state(&state)?
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .faults()
            .clone(),
    ))
}

async fn set_faults(
    State(state): State<AppState>,
    JsonBody(faults): JsonBody<Faults>,
) -> Result<Json<Faults>, ApiError> {
    validate_faults(&faults).map_err(|err| {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid", err.to_string())
    })?;
    tracing::info!(?faults, "fault injection set");
    fault_state(&state)?
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .set(faults.clone(), Instant::now());
    Ok(Json(faults))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_filter_parses_name_and_tags() {
        let pairs = vec![
            ("name".to_string(), "web".to_string()),
            ("tag".to_string(), "cluster=c1".to_string()),
            ("tag".to_string(), "expr=a=b".to_string()),
        ];
        let filter = parse_list_filter(&pairs).unwrap();
        assert_eq!(filter.name.as_deref(), Some("web"));
        assert_eq!(filter.tags.get("cluster").map(String::as_str), Some("c1"));
        assert_eq!(filter.tags.get("expr").map(String::as_str), Some("a=b"));

        let bad = [("tag".to_string(), "novalue".to_string())];
        assert_eq!(parse_list_filter(&bad).unwrap_err().code, "invalid-query");
        let unknown = [("colour".to_string(), "red".to_string())];
        assert_eq!(
            parse_list_filter(&unknown).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }

    #[test]
    fn if_match_takes_plain_and_quoted_versions() {
        let mut headers = HeaderMap::new();
        assert_eq!(
            if_match_version(&headers).unwrap_err().status,
            StatusCode::PRECONDITION_REQUIRED
        );
        headers.insert(header::IF_MATCH, "7".parse().unwrap());
        assert_eq!(if_match_version(&headers).unwrap(), 7);
        headers.insert(header::IF_MATCH, "\"8\"".parse().unwrap());
        assert_eq!(if_match_version(&headers).unwrap(), 8);
        headers.insert(header::IF_MATCH, "*".parse().unwrap());
        assert_eq!(
            if_match_version(&headers).unwrap_err().code,
            "invalid-header"
        );
    }

    #[test]
    fn bearer_token_must_match_exactly() {
        let tokens = CredentialSet::single("s3cret");
        let mut headers = HeaderMap::new();
        assert!(authenticate(&headers, None, &tokens).is_none());
        headers.insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert!(authenticate(&headers, None, &tokens).is_some());
        headers.insert(header::AUTHORIZATION, "Bearer s3cre".parse().unwrap());
        assert!(authenticate(&headers, None, &tokens).is_none());
        headers.insert(header::AUTHORIZATION, "Basic s3cret".parse().unwrap());
        assert!(authenticate(&headers, None, &tokens).is_none());
    }

    #[test]
    fn a_request_keeps_a_sane_id_of_its_own() {
        let mut headers = HeaderMap::new();
        assert_eq!(request_id(&headers).len(), 16);
        headers.insert(REQUEST_ID, "req-42".parse().unwrap());
        assert_eq!(request_id(&headers), "req-42");
        headers.insert(REQUEST_ID, "two words".parse().unwrap());
        assert_ne!(request_id(&headers), "two words");
    }
}
