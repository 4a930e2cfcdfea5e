//! The HTTP edge: routing of Kubernetes API paths, bearer-token auth, request decoding,
//! JSON/Table responses and streaming watches. Semantics live in the store.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderMap, Method, StatusCode, Uri};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use crate::discovery;
use crate::patch::PatchType;
use crate::protobuf::{self, DecodeError};
use crate::resources::{self, ResourceType};
use crate::selector::{FieldSelector, LabelSelector, Selectors};
use crate::status::ApiError;
use crate::store::{
    Change, ChangeType, Preconditions, Store, Subresource, WatchFrom, WatchMessage, to_view,
};
use crate::table::{self, IncludeObject};

/// Shared state of the HTTP handlers.
pub struct AppState {
    pub store: Arc<Store>,
    pub token: String,
    /// Ends open watches on shutdown.
    pub shutdown: CancellationToken,
    pub bookmark_interval: Duration,
    /// `host:port` advertised in `/api`.
    pub server_address: String,
}

/// What a request path names.
#[derive(Debug, PartialEq, Eq)]
pub enum Target {
    Version,
    CoreVersions,
    GroupList,
    Group(String),
    ResourceList {
        group: String,
        version: String,
    },
    Collection {
        rt: &'static ResourceType,
        namespace: Option<String>,
    },
    Object {
        rt: &'static ResourceType,
        namespace: Option<String>,
        name: String,
        sub: Subresource,
    },
    Compact,
    OpenApiRoot,
    OpenApiGroupVersion(String),
}

/// Maps a URL path to what it names; `None` is a 404.
pub fn parse_path(path: &str) -> Option<Target> {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match segments.as_slice() {
        ["version"] => Some(Target::Version),
        ["api"] => Some(Target::CoreVersions),
        ["apis"] => Some(Target::GroupList),
        ["_tandem", "compact"] => Some(Target::Compact),
        ["openapi", "v3"] => Some(Target::OpenApiRoot),
        ["openapi", "v3", rest @ ..] => Some(Target::OpenApiGroupVersion(rest.join("/"))),
        ["apis", group] => Some(Target::Group((*group).to_string())),
        ["api", version] => Some(Target::ResourceList {
            group: String::new(),
            version: (*version).to_string(),
        }),
        ["apis", group, version] => Some(Target::ResourceList {
            group: (*group).to_string(),
            version: (*version).to_string(),
        }),
        ["api", version, rest @ ..] => resource_path("", version, rest),
        ["apis", group, version, rest @ ..] => resource_path(group, version, rest),
        _ => None,
    }
}

fn object_target(
    rt: &'static ResourceType,
    namespace: Option<String>,
    tail: &[&str],
) -> Option<Target> {
    match tail {
        [] => Some(Target::Collection { rt, namespace }),
        [name] => Some(Target::Object {
            rt,
            namespace,
            name: (*name).to_string(),
            sub: Subresource::Main,
        }),
        [name, "status"] if rt.has_status => Some(Target::Object {
            rt,
            namespace,
            name: (*name).to_string(),
            sub: Subresource::Status,
        }),
        _ => None,
    }
}

fn resource_path(group: &str, version: &str, rest: &[&str]) -> Option<Target> {
    if let ["namespaces", namespace, plural, tail @ ..] = rest
        && let Some(rt) = resources::find(group, version, plural).filter(|rt| rt.namespaced)
    {
        return object_target(rt, Some((*namespace).to_string()), tail);
    }
    let [plural, tail @ ..] = rest else {
        return None;
    };
    let rt = resources::find(group, version, plural)?;
    if rt.namespaced {
        // All-namespace lists and watches only.
        return tail.is_empty().then_some(Target::Collection {
            rt,
            namespace: None,
        });
    }
    object_target(rt, None, tail)
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new().fallback(handle).with_state(state)
}

fn json_response(code: StatusCode, body: &Value) -> Response {
    (code, [(CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

fn error_response(error: &ApiError) -> Response {
    let code = StatusCode::from_u16(error.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(code, &error.to_status())
}

fn authorized(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| given.trim() == token)
}

#[tracing::instrument(skip_all, fields(%method, path = uri.path()))]
async fn handle(
    State(app): State<Arc<AppState>>,
    method: Method,
    uri: Uri,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if matches!(uri.path(), "/healthz" | "/livez" | "/readyz") {
        return (StatusCode::OK, "ok").into_response();
    }
    if !authorized(&headers, &app.token) {
        return error_response(&ApiError::unauthorized());
    }
    match route(&app, &method, uri.path(), &query, &headers, body).await {
        Ok(response) => response,
        Err(error) => {
            tracing::debug!(code = error.code, reason = error.reason, message = %error.message, "request failed");
            error_response(&error)
        }
    }
}

fn header(headers: &HeaderMap, name: http::header::HeaderName) -> &str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

/// Decodes an object sent to `rt`: JSON, or protobuf (what client-go's typed clients,
/// e.g. `kubectl create namespace`, send) for the kinds [`protobuf::KINDS`].
fn parse_object(rt: &ResourceType, headers: &HeaderMap, body: &[u8]) -> Result<Value, ApiError> {
    if protobuf::is_protobuf(header(headers, CONTENT_TYPE)) {
        return protobuf::decode(rt, body).map_err(|e| match e {
            DecodeError::UnsupportedKind(_) => ApiError::unreadable_body(e.to_string()),
            _ => ApiError::bad_request(format!("cannot decode request body: {e}")),
        });
    }
    parse_json(headers, body)
}

/// Decodes a JSON request body. Other encodings (CBOR, protobuf where no object is
/// expected) are refused with 415 rather than misread.
fn parse_json(headers: &HeaderMap, body: &[u8]) -> Result<Value, ApiError> {
    let content_type = header(headers, CONTENT_TYPE);
    if content_type.contains("protobuf") || content_type.contains("cbor") {
        return Err(ApiError::unsupported_media_type(content_type));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("cannot decode request body as JSON: {e}")))
}

fn selectors(query: &HashMap<String, String>) -> Result<Selectors, ApiError> {
    let labels = LabelSelector::parse(query.get("labelSelector").map_or("", String::as_str))
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let fields = FieldSelector::parse(query.get("fieldSelector").map_or("", String::as_str))
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(Selectors { labels, fields })
}

/// Where a write goes: the live store, or for a dry run (`dryRun=All`) a scratch copy that
/// runs the same checks, defaulting and allocation and is then dropped.
struct Write<'a> {
    app: &'a AppState,
    store: Arc<Store>,
    dry: bool,
}

impl<'a> Write<'a> {
    /// `dryRun` values come from the query and, for deletes, from DeleteOptions; `All` is
    /// the one value Kubernetes defines.
    fn new<'v>(
        app: &'a AppState,
        query: &'v HashMap<String, String>,
        more: impl IntoIterator<Item = &'v str>,
    ) -> Result<Self, ApiError> {
        let mut dry = false;
        let values = query.get("dryRun").map(String::as_str).into_iter();
        for value in values.chain(more).filter(|v| !v.is_empty()) {
            if value != "All" {
                return Err(ApiError::bad_request(format!(
                    "invalid dry run value {value:?}: the only supported value is \"All\""
                )));
            }
            dry = true;
        }
        let store = if dry {
            Arc::new(app.store.scratch()?)
        } else {
            app.store.clone()
        };
        Ok(Self { app, store, dry })
    }

    /// The object to answer with. A dry run's carries the resourceVersion the live object
    /// has (none for an object that does not exist), as nothing was written.
    fn answer(&self, rt: &ResourceType, namespace: Option<&str>, mut object: Value) -> Value {
        if !self.dry {
            return object;
        }
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        let live_version = self
            .app
            .store
            .get(rt, namespace, name)
            .ok()
            .and_then(|live| {
                live["metadata"]["resourceVersion"]
                    .as_str()
                    .map(str::to_string)
            });
        if let Some(meta) = object["metadata"].as_object_mut() {
            match live_version {
                Some(version) => meta.insert("resourceVersion".into(), json!(version)),
                None => meta.remove("resourceVersion"),
            };
        }
        object
    }
}

/// How objects are rendered, as the `Accept` header asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Full,
    /// Server-side printing (kubectl get).
    Table(IncludeObject),
    /// `PartialObjectMetadata` (kube-rs `list_metadata` / `metadata_watcher`).
    Metadata,
}

fn shape(headers: &HeaderMap, query: &HashMap<String, String>) -> Shape {
    let accept = header(headers, ACCEPT);
    let first = accept.split(',').next().unwrap_or_default();
    if table::wants_table(accept) {
        Shape::Table(IncludeObject::parse(
            query.get("includeObject").map(String::as_str),
        ))
    } else if first.contains("as=PartialObjectMetadata") && first.contains("g=meta.k8s.io") {
        Shape::Metadata
    } else {
        Shape::Full
    }
}

impl Shape {
    fn object(self, rt: &ResourceType, obj: Value) -> Value {
        match self {
            Shape::Full => obj,
            Shape::Metadata => table::partial_metadata(&obj),
            Shape::Table(include) => {
                let rv = obj["metadata"]["resourceVersion"]
                    .as_str()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or_default();
                table::table(rt, &[obj], rv, None, include, jiff::Timestamp::now())
            }
        }
    }
}

async fn route(
    app: &Arc<AppState>,
    method: &Method,
    path: &str,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let target = parse_path(path).ok_or_else(ApiError::path_not_found)?;
    let ok = |v: Value| Ok(json_response(StatusCode::OK, &v));
    match (method, target) {
        (&Method::GET, Target::Version) => ok(discovery::version()),
        (&Method::GET, Target::CoreVersions) => ok(discovery::core_versions(&app.server_address)),
        (&Method::GET, Target::GroupList) => ok(discovery::group_list()),
        (&Method::GET, Target::Group(group)) => {
            ok(discovery::api_group(&group).ok_or_else(ApiError::path_not_found)?)
        }
        (&Method::GET, Target::ResourceList { group, version }) => {
            ok(discovery::resource_list(&group, &version).ok_or_else(ApiError::path_not_found)?)
        }
        (&Method::GET, Target::OpenApiRoot) => ok(discovery::openapi_v3_root()),
        (&Method::GET, Target::OpenApiGroupVersion(path)) => {
            ok(discovery::openapi_v3_group_version(&path).ok_or_else(ApiError::path_not_found)?)
        }
        (&Method::POST, Target::Compact) => {
            let rv = app.store.compact()?;
            tracing::info!(resource_version = rv, "history compacted on request");
            ok(json!({"resourceVersion": rv.to_string()}))
        }
        (&Method::GET, Target::Collection { rt, namespace }) => {
            let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
            if watching {
                watch(app, rt, namespace, query, shape(headers, query))
            } else {
                list(app, rt, namespace.as_deref(), query, shape(headers, query))
            }
        }
        (&Method::POST, Target::Collection { rt, namespace }) => {
            let write = Write::new(app, query, [])?;
            if rt.namespaced && namespace.is_none() {
                return Err(ApiError::method_not_allowed("POST"));
            }
            let object = parse_object(rt, headers, &body)?;
            let created = write.store.create(rt, namespace.as_deref(), object)?;
            let created = write.answer(rt, namespace.as_deref(), created);
            tracing::debug!(
                resource = rt.plural,
                name = created["metadata"]["name"].as_str(),
                dry_run = write.dry,
                "created"
            );
            Ok(json_response(StatusCode::CREATED, &created))
        }
        (&Method::DELETE, Target::Collection { rt, namespace }) => {
            let write = Write::new(app, query, [])?;
            let page =
                write
                    .store
                    .list(rt, namespace.as_deref(), &selectors(query)?, None, None)?;
            let mut deleted = Vec::new();
            for item in page.items {
                let name = item["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let ns = item["metadata"]["namespace"].as_str().map(str::to_string);
                match write
                    .store
                    .delete(rt, ns.as_deref(), &name, &Preconditions::default())
                {
                    Ok(obj) => deleted.push(write.answer(rt, ns.as_deref(), obj)),
                    Err(e) if e.code == 404 => {}
                    Err(e) => return Err(e),
                }
            }
            ok(list_body(rt, deleted, app.store.resource_version()?, None))
        }
        (
            &Method::GET,
            Target::Object {
                rt,
                namespace,
                name,
                ..
            },
        ) => {
            let obj = app.store.get(rt, namespace.as_deref(), &name)?;
            ok(shape(headers, query).object(rt, obj))
        }
        (
            &Method::PUT,
            Target::Object {
                rt,
                namespace,
                name,
                sub,
            },
        ) => {
            let write = Write::new(app, query, [])?;
            let object = parse_object(rt, headers, &body)?;
            let updated = write
                .store
                .update(rt, namespace.as_deref(), &name, object, sub)?;
            ok(write.answer(rt, namespace.as_deref(), updated))
        }
        (
            &Method::PATCH,
            Target::Object {
                rt,
                namespace,
                name,
                sub,
            },
        ) => {
            let write = Write::new(app, query, [])?;
            let content_type = header(headers, CONTENT_TYPE);
            let patch_type = PatchType::from_content_type(content_type)
                .ok_or_else(|| ApiError::unsupported_media_type(content_type))?;
            let (obj, created) =
                write
                    .store
                    .patch(rt, namespace.as_deref(), &name, patch_type, &body, sub)?;
            let obj = write.answer(rt, namespace.as_deref(), obj);
            Ok(json_response(
                if created {
                    StatusCode::CREATED
                } else {
                    StatusCode::OK
                },
                &obj,
            ))
        }
        (
            &Method::DELETE,
            Target::Object {
                rt,
                namespace,
                name,
                sub: Subresource::Main,
            },
        ) => {
            let options = if body.is_empty() {
                json!({})
            } else {
                parse_json(headers, &body)?
            };
            let in_options = options["dryRun"].as_array().into_iter().flatten();
            let write = Write::new(app, query, in_options.filter_map(Value::as_str))?;
            let preconditions = Preconditions {
                uid: options["preconditions"]["uid"].as_str().map(str::to_string),
                resource_version: options["preconditions"]["resourceVersion"]
                    .as_str()
                    .map(str::to_string),
            };
            let deleted = write
                .store
                .delete(rt, namespace.as_deref(), &name, &preconditions)?;
            ok(write.answer(rt, namespace.as_deref(), deleted))
        }
        (method, _) => Err(ApiError::method_not_allowed(method.as_str())),
    }
}

fn list_body(
    rt: &ResourceType,
    items: Vec<Value>,
    resource_version: u64,
    continue_token: Option<&str>,
) -> Value {
    let mut metadata = json!({"resourceVersion": resource_version.to_string()});
    if let (Some(token), Some(map)) = (continue_token, metadata.as_object_mut()) {
        map.insert("continue".into(), json!(token));
    }
    json!({"kind": format!("{}List", rt.kind), "apiVersion": rt.api_version(), "metadata": metadata, "items": items})
}

fn list(
    app: &AppState,
    rt: &'static ResourceType,
    namespace: Option<&str>,
    query: &HashMap<String, String>,
    shape: Shape,
) -> Result<Response, ApiError> {
    let limit = match query.get("limit").filter(|l| !l.is_empty()) {
        Some(l) => Some(
            l.parse::<usize>()
                .map_err(|_| ApiError::bad_request(format!("invalid limit {l:?}")))?,
        ),
        None => None,
    };
    let page = app.store.list(
        rt,
        namespace,
        &selectors(query)?,
        limit,
        query.get("continue").map(String::as_str),
    )?;
    let continue_token = page.continue_token.as_deref();
    let body = match shape {
        Shape::Table(include) => table::table(
            rt,
            &page.items,
            page.resource_version,
            continue_token,
            include,
            jiff::Timestamp::now(),
        ),
        Shape::Full => list_body(rt, page.items, page.resource_version, continue_token),
        Shape::Metadata => {
            let items = page.items.iter().map(table::partial_metadata).collect();
            let mut list = list_body(rt, items, page.resource_version, continue_token);
            if let Some(map) = list.as_object_mut() {
                map.insert("kind".into(), json!("PartialObjectMetadataList"));
                map.insert("apiVersion".into(), json!("meta.k8s.io/v1"));
            }
            list
        }
    };
    Ok(json_response(StatusCode::OK, &body))
}

/// Everything a running watch needs to render and filter events.
struct WatchSpec {
    rt: &'static ResourceType,
    namespace: Option<String>,
    selectors: Selectors,
    shape: Shape,
    bookmarks: bool,
    send_initial_events: bool,
    timeout: Duration,
}

fn streaming_response(rx: mpsc::Receiver<Bytes>) -> Response {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error_response(&ApiError::internal("building the watch response")))
}

fn event_line(event_type: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": event_type, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn watch(
    app: &Arc<AppState>,
    rt: &'static ResourceType,
    namespace: Option<String>,
    query: &HashMap<String, String>,
    shape: Shape,
) -> Result<Response, ApiError> {
    let flag = |name: &str| matches!(query.get(name).map(String::as_str), Some("true" | "1"));
    let from = match query.get("resourceVersion").map(String::as_str) {
        None | Some("" | "0") => WatchFrom::Now,
        Some(rv) => WatchFrom::After(
            rv.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?,
        ),
    };
    let timeout = match query.get("timeoutSeconds") {
        Some(t) => Duration::from_secs(
            t.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds {t:?}")))?,
        ),
        None => Duration::from_secs(1800),
    };
    let spec = WatchSpec {
        rt,
        selectors: selectors(query)?,
        shape,
        bookmarks: flag("allowWatchBookmarks"),
        send_initial_events: flag("sendInitialEvents"),
        timeout,
        namespace,
    };
    let (tx, rx) = mpsc::channel(256);
    match app.store.watch(
        rt,
        spec.namespace.as_deref(),
        from,
        spec.send_initial_events,
    ) {
        Ok(start) => {
            let app = app.clone();
            tokio::spawn(async move { run_watch(&app, spec, start, tx).await });
        }
        // As the real server: a 200 stream carrying one ERROR event, so clients relist.
        Err(error) if error.code == 410 => {
            let line = event_line("ERROR", &error.to_status());
            tokio::spawn(async move { tx.send(line).await });
        }
        Err(error) => return Err(error),
    }
    Ok(streaming_response(rx))
}

impl WatchSpec {
    fn render(&self, event_type: &str, view: Value) -> Bytes {
        event_line(event_type, &self.shape.object(self.rt, view))
    }

    fn bookmark(&self, resource_version: u64, initial_events_end: bool) -> Bytes {
        let mut metadata = json!({"resourceVersion": resource_version.to_string()});
        if initial_events_end && let Some(map) = metadata.as_object_mut() {
            map.insert(
                "annotations".into(),
                json!({"k8s.io/initial-events-end": "true"}),
            );
        }
        event_line(
            "BOOKMARK",
            &json!({"kind": self.rt.kind, "apiVersion": self.rt.api_version(), "metadata": metadata}),
        )
    }

    /// The event this watcher sees for a change, if any: selectors turn a MODIFIED that
    /// enters the selection into ADDED and one that leaves it into DELETED.
    fn event_for(&self, change: &Change) -> Option<Bytes> {
        if self
            .namespace
            .as_deref()
            .is_some_and(|ns| self.rt.namespaced && change.namespace != ns)
        {
            return None;
        }
        let view = to_view(self.rt, &change.object);
        let now_matches = self.selectors.matches(&view);
        let before_matches = match (&change.previous, change.change_type) {
            (_, ChangeType::Added) => false,
            // Without selectors there is nothing to enter or leave; skip the conversion.
            _ if self.selectors.is_empty() => true,
            (Some(previous), _) => self.selectors.matches(&to_view(self.rt, previous)),
            (None, _) => now_matches,
        };
        let event_type = match (change.change_type, before_matches, now_matches) {
            (ChangeType::Added, _, true) | (ChangeType::Modified, false, true) => ChangeType::Added,
            (ChangeType::Modified, true, true) => ChangeType::Modified,
            (ChangeType::Modified, true, false)
            | (ChangeType::Deleted, true, _)
            | (ChangeType::Deleted, _, true) => ChangeType::Deleted,
            _ => return None,
        };
        Some(self.render(event_type.as_str(), view))
    }
}

async fn run_watch(
    app: &AppState,
    spec: WatchSpec,
    start: crate::store::WatchStart,
    tx: mpsc::Sender<Bytes>,
) {
    let mut receiver = start.receiver;
    for object in &start.initial {
        let view = to_view(spec.rt, object);
        if spec.selectors.matches(&view) && tx.send(spec.render("ADDED", view)).await.is_err() {
            return;
        }
    }
    if spec.send_initial_events
        && tx
            .send(spec.bookmark(start.resource_version, true))
            .await
            .is_err()
    {
        return;
    }
    for change in &start.backlog {
        if let Some(line) = spec.event_for(change)
            && tx.send(line).await.is_err()
        {
            return;
        }
    }
    let deadline = tokio::time::sleep(spec.timeout);
    tokio::pin!(deadline);
    let mut ticker = tokio::time::interval(app.bookmark_interval);
    ticker.tick().await;
    loop {
        tokio::select! {
            () = tx.closed() => return,
            () = app.shutdown.cancelled() => return,
            () = &mut deadline => {
                if spec.bookmarks && let Some(line) = quiet_bookmark(app, &spec, &receiver) {
                    let _ = tx.send(line).await;
                }
                return;
            }
            _ = ticker.tick(), if spec.bookmarks => {
                if let Some(line) = quiet_bookmark(app, &spec, &receiver)
                    && tx.send(line).await.is_err()
                {
                    return;
                }
            }
            message = receiver.recv() => match message {
                Ok(WatchMessage::Change(change)) => {
                    if let Some(line) = spec.event_for(&change)
                        && tx.send(line).await.is_err()
                    {
                        return;
                    }
                }
                // Compaction ends watches; a lagging watcher is cut off as the real
                // server does with slow consumers; either way the client re-watches.
                Ok(WatchMessage::Compacted) | Err(broadcast::error::RecvError::Lagged(_) | broadcast::error::RecvError::Closed) => return,
            },
        }
    }
}

/// A bookmark at the newest resourceVersion, only when nothing is queued for this watcher
/// (the version is read first, so every change up to it has been delivered).
fn quiet_bookmark(
    app: &AppState,
    spec: &WatchSpec,
    receiver: &broadcast::Receiver<WatchMessage>,
) -> Option<Bytes> {
    let rv = app.store.resource_version().ok()?;
    receiver.is_empty().then(|| spec.bookmark(rv, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{EVENTS_V1, LEASES, NAMESPACES, NODES, SERVICES};

    #[test]
    fn paths_map_to_targets() {
        assert_eq!(
            parse_path("/api/v1/namespaces/default/services"),
            Some(Target::Collection {
                rt: SERVICES,
                namespace: Some("default".into())
            })
        );
        assert_eq!(
            parse_path("/api/v1/services"),
            Some(Target::Collection {
                rt: SERVICES,
                namespace: None
            })
        );
        assert_eq!(
            parse_path("/api/v1/namespaces/default/services/web/status"),
            Some(Target::Object {
                rt: SERVICES,
                namespace: Some("default".into()),
                name: "web".into(),
                sub: Subresource::Status
            })
        );
        assert_eq!(
            parse_path("/api/v1/nodes/n1/status"),
            Some(Target::Object {
                rt: NODES,
                namespace: None,
                name: "n1".into(),
                sub: Subresource::Status
            })
        );
        assert_eq!(
            parse_path("/api/v1/namespaces/kube-system"),
            Some(Target::Object {
                rt: NAMESPACES,
                namespace: None,
                name: "kube-system".into(),
                sub: Subresource::Main
            })
        );
        assert_eq!(
            parse_path("/api/v1/namespaces"),
            Some(Target::Collection {
                rt: NAMESPACES,
                namespace: None
            })
        );
        assert_eq!(
            parse_path("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/n1"),
            Some(Target::Object {
                rt: LEASES,
                namespace: Some("kube-node-lease".into()),
                name: "n1".into(),
                sub: Subresource::Main
            })
        );
        assert_eq!(
            parse_path("/apis/events.k8s.io/v1/events"),
            Some(Target::Collection {
                rt: EVENTS_V1,
                namespace: None
            })
        );
        assert_eq!(
            parse_path("/apis/coordination.k8s.io/v1/namespaces/x/leases/n1/status"),
            None
        );
        assert_eq!(parse_path("/api/v1/services/web"), None);
        assert_eq!(parse_path("/api/v1/pods"), None);
        assert_eq!(parse_path("/apis/apps"), Some(Target::Group("apps".into())));
        assert_eq!(parse_path("/_tandem/compact"), Some(Target::Compact));
    }

    #[test]
    fn bearer_token_is_checked() {
        let mut headers = HeaderMap::new();
        assert!(!authorized(&headers, "s3cret"));
        headers.insert(AUTHORIZATION, "Bearer wrong".parse().unwrap());
        assert!(!authorized(&headers, "s3cret"));
        headers.insert(AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert!(authorized(&headers, "s3cret"));
    }
}
