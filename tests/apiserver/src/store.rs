//! The object store: every served object as JSON, one global resourceVersion, a bounded
//! change history per storage for watches, and the write semantics of kube-apiserver
//! (optimistic concurrency, status subresources, generation, finalizers, Service
//! allocation). All writes run under one lock, so allocation and resourceVersions are
//! race-free; nothing in here does I/O.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Value, json};
use tokio::sync::broadcast;

use crate::endpoint_slice_v1beta1;
use crate::events;
use crate::patch::{self, PatchError, PatchType};
use crate::resources::{self, ResourceType, Storage, View};
use crate::selector::Selectors;
use crate::service::{self, Allocator, PortRange, ServiceCidrs};
use crate::service_cidr;
use crate::status::{ApiError, FieldError};

/// `(namespace, name)`; the namespace is empty for cluster-scoped objects.
pub type ObjectKey = (String, String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeType {
    Added,
    Modified,
    Deleted,
}

impl ChangeType {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeType::Added => "ADDED",
            ChangeType::Modified => "MODIFIED",
            ChangeType::Deleted => "DELETED",
        }
    }
}

/// One committed write, as kept in the history and sent to watchers (storage shape).
#[derive(Debug)]
pub struct Change {
    pub resource_version: u64,
    pub change_type: ChangeType,
    pub namespace: String,
    pub object: Arc<Value>,
    /// The object before the write; lets selector-filtered watches turn a MODIFIED that
    /// leaves the selection into DELETED, as the real watch cache does.
    pub previous: Option<Arc<Value>>,
}

#[derive(Debug, Clone)]
pub enum WatchMessage {
    Change(Arc<Change>),
    /// History was compacted: open watches end, so clients re-watch and get 410.
    Compacted,
}

/// Where a watch starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchFrom {
    /// `resourceVersion` unset or `0`: synthetic ADDED for the current state, then changes.
    Now,
    /// Every change after this resourceVersion.
    After(u64),
}

/// What a new watch needs: the backlog and a subscription taken atomically under the lock.
#[derive(Debug)]
pub struct WatchStart {
    pub initial: Vec<Arc<Value>>,
    pub backlog: Vec<Arc<Change>>,
    pub receiver: broadcast::Receiver<WatchMessage>,
    pub resource_version: u64,
}

/// One page of a list (view shape).
#[derive(Debug)]
pub struct ListPage {
    pub items: Vec<Value>,
    pub resource_version: u64,
    pub continue_token: Option<String>,
}

/// Which part of an object a write targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subresource {
    Main,
    Status,
}

/// Preconditions of a delete (`DeleteOptions.preconditions`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Preconditions {
    pub uid: Option<String>,
    pub resource_version: Option<String>,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// `--service-cluster-ip-range`: one CIDR, or one per family (dual-stack).
    pub service_cidrs: ServiceCidrs,
    pub node_port_range: PortRange,
    /// Changes kept per storage for watches that resume from an older resourceVersion.
    pub watch_cache_size: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            service_cidrs: ServiceCidrs::default(),
            node_port_range: PortRange::default(),
            watch_cache_size: 1000,
        }
    }
}

struct Table {
    objects: BTreeMap<ObjectKey, Arc<Value>>,
    history: VecDeque<Arc<Change>>,
    /// Watches from before this resourceVersion get 410 Gone.
    compacted: u64,
    sender: broadcast::Sender<WatchMessage>,
}

struct State {
    resource_version: u64,
    tables: BTreeMap<Storage, Table>,
    allocator: Allocator,
}

impl State {
    fn table(&mut self, storage: Storage) -> Result<&mut Table, ApiError> {
        self.tables
            .get_mut(&storage)
            .ok_or_else(|| ApiError::internal(format!("no table for {storage:?}")))
    }

    fn get(&self, storage: Storage, key: &ObjectKey) -> Option<Arc<Value>> {
        self.tables
            .get(&storage)
            .and_then(|t| t.objects.get(key))
            .cloned()
    }
}

pub struct Store {
    state: Mutex<State>,
    history_limit: usize,
}

/// Namespaces that exist from the start, as on a fresh cluster.
pub const INITIAL_NAMESPACES: [&str; 4] =
    ["default", "kube-system", "kube-public", "kube-node-lease"];

fn now() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

fn meta_str<'a>(obj: &'a Value, key: &str) -> Option<&'a str> {
    obj["metadata"][key].as_str().filter(|s| !s.is_empty())
}

fn metadata_mut(obj: &mut Value) -> &mut serde_json::Map<String, Value> {
    if !obj.is_object() {
        *obj = json!({});
    }
    let Value::Object(root) = obj else {
        unreachable!("the object was just made a map")
    };
    let meta = root.entry("metadata").or_insert_with(|| json!({}));
    if !meta.is_object() {
        *meta = json!({});
    }
    let Value::Object(meta) = meta else {
        unreachable!("metadata was just made a map")
    };
    meta
}

fn finalizers(obj: &Value) -> Vec<&str> {
    obj["metadata"]["finalizers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

fn is_dns1123_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| char::from(ALPHABET[rand::random_range(0..ALPHABET.len())]))
        .collect()
}

/// Storage shape → the shape `rt` serves.
pub fn to_view(rt: &ResourceType, stored: &Value) -> Value {
    match rt.view {
        View::Native => stored.clone(),
        View::EventsV1 => events::core_to_v1(stored),
        View::EndpointSlicesV1beta1 => endpoint_slice_v1beta1::v1_to_v1beta1(stored),
    }
}

fn from_view(rt: &ResourceType, body: Value) -> Result<Value, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    for (field, expected) in [
        ("apiVersion", rt.api_version()),
        ("kind", rt.kind.to_string()),
    ] {
        if let Some(got) = body[field].as_str()
            && !got.is_empty()
            && got != expected
        {
            return Err(ApiError::bad_request(format!(
                "the {field} of the object ({got}) does not match the expected {expected}"
            )));
        }
    }
    let mut stored = match rt.view {
        View::Native => body,
        View::EventsV1 => events::v1_to_core(&body),
        View::EndpointSlicesV1beta1 => endpoint_slice_v1beta1::v1beta1_to_v1(&body),
    };
    if let Some(map) = stored.as_object_mut() {
        let storage_rt = storage_resource(rt);
        map.insert("apiVersion".into(), json!(storage_rt.api_version()));
        map.insert("kind".into(), json!(storage_rt.kind));
    }
    Ok(stored)
}

/// The resource whose shape a storage keeps.
fn storage_resource(rt: &ResourceType) -> &'static ResourceType {
    match rt.storage {
        Storage::Events => resources::EVENTS,
        Storage::Namespaces => resources::NAMESPACES,
        Storage::Services => resources::SERVICES,
        Storage::Nodes => resources::NODES,
        Storage::EndpointSlices => resources::ENDPOINT_SLICES,
        Storage::Leases => resources::LEASES,
        Storage::ServiceCidrs => resources::SERVICE_CIDRS,
    }
}

fn invalid(rt: &ResourceType, name: &str, causes: Vec<FieldError>) -> ApiError {
    ApiError::invalid(rt, name, &causes)
}

/// `continue` tokens: the list's resourceVersion and the last key served.
fn encode_continue(resource_version: u64, key: &ObjectKey) -> String {
    let raw = json!([resource_version, key.0, key.1]).to_string();
    data_encoding::BASE64URL_NOPAD.encode(raw.as_bytes())
}

fn decode_continue(token: &str) -> Result<(u64, ObjectKey), ApiError> {
    let bad = || ApiError::bad_request(format!("invalid continue token {token:?}"));
    let raw = data_encoding::BASE64URL_NOPAD
        .decode(token.as_bytes())
        .map_err(|_| bad())?;
    let (rv, ns, name): (u64, String, String) = serde_json::from_slice(&raw).map_err(|_| bad())?;
    Ok((rv, (ns, name)))
}

impl Store {
    pub fn new(config: &StoreConfig) -> Self {
        let capacity = config.watch_cache_size.max(1024);
        let tables = Storage::ALL
            .iter()
            .map(|s| {
                let (sender, _) = broadcast::channel(capacity);
                (
                    *s,
                    Table {
                        objects: BTreeMap::new(),
                        history: VecDeque::new(),
                        compacted: 0,
                        sender,
                    },
                )
            })
            .collect();
        let store = Self {
            state: Mutex::new(State {
                resource_version: 0,
                tables,
                allocator: Allocator::new(
                    config.service_cidrs.clone(),
                    config.node_port_range.clone(),
                ),
            }),
            history_limit: config.watch_cache_size.max(1),
        };
        if let Ok(mut state) = store.state.lock() {
            for name in INITIAL_NAMESPACES {
                let ns =
                    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}});
                if let Err(error) = store.create_locked(&mut state, resources::NAMESPACES, None, ns)
                {
                    tracing::error!(namespace = name, %error, "creating an initial namespace failed");
                }
            }
            // As kube-apiserver (1.33+) does: its own Service CIDRs as the default
            // ServiceCIDR, `kubernetes`, which node proxies read instead of a flag.
            let cidrs: Vec<String> = config
                .service_cidrs
                .cidrs()
                .iter()
                .map(ToString::to_string)
                .collect();
            let default = json!({
                "apiVersion": "networking.k8s.io/v1",
                "kind": "ServiceCIDR",
                "metadata": {"name": "kubernetes"},
                "spec": {"cidrs": cidrs},
            });
            if let Err(error) =
                store.create_locked(&mut state, resources::SERVICE_CIDRS, None, default)
            {
                tracing::error!(%error, "creating the default ServiceCIDR failed");
            }
        }
        store
    }

    /// A copy of the current state for a dry run (`?dryRun=All`) to write to: the same
    /// objects, allocations and resourceVersion, with change channels nobody watches and no
    /// history, so the write runs every check and allocation of a real one and then leaves
    /// no trace. Copying is linear in the number of objects, which a stand-in can afford.
    pub fn scratch(&self) -> Result<Store, ApiError> {
        let state = self.lock()?;
        let tables = state
            .tables
            .iter()
            .map(|(storage, table)| {
                let (sender, _) = broadcast::channel(1);
                let copy = Table {
                    objects: table.objects.clone(),
                    history: VecDeque::new(),
                    compacted: state.resource_version,
                    sender,
                };
                (*storage, copy)
            })
            .collect();
        Ok(Store {
            state: Mutex::new(State {
                resource_version: state.resource_version,
                tables,
                allocator: state.allocator.clone(),
            }),
            history_limit: 1,
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, ApiError> {
        self.state
            .lock()
            .map_err(|_| ApiError::internal("store lock poisoned"))
    }

    /// The newest resourceVersion handed out.
    pub fn resource_version(&self) -> Result<u64, ApiError> {
        Ok(self.lock()?.resource_version)
    }

    fn key(rt: &ResourceType, namespace: Option<&str>, name: &str) -> ObjectKey {
        let ns = if rt.namespaced {
            namespace.unwrap_or_default()
        } else {
            ""
        };
        (ns.to_string(), name.to_string())
    }

    pub fn get(
        &self,
        rt: &ResourceType,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        let state = self.lock()?;
        let stored = state
            .get(rt.storage, &Self::key(rt, namespace, name))
            .ok_or_else(|| ApiError::not_found(rt, name))?;
        Ok(to_view(rt, &stored))
    }

    /// Lists objects in one namespace (or all) that match `selectors`, `limit` at a time.
    pub fn list(
        &self,
        rt: &ResourceType,
        namespace: Option<&str>,
        selectors: &Selectors,
        limit: Option<usize>,
        continue_token: Option<&str>,
    ) -> Result<ListPage, ApiError> {
        let state = self.lock()?;
        let (resource_version, start) = match continue_token.filter(|t| !t.is_empty()) {
            Some(token) => {
                let (rv, key) = decode_continue(token)?;
                (rv, Bound::Excluded(key))
            }
            None => (state.resource_version, Bound::Unbounded),
        };
        let table = state
            .tables
            .get(&rt.storage)
            .ok_or_else(|| ApiError::internal("missing table"))?;
        let ns = namespace.filter(|_| rt.namespaced);
        let start = match (start, ns) {
            (Bound::Unbounded, Some(ns)) => Bound::Included((ns.to_string(), String::new())),
            (other, _) => other,
        };
        let mut items = Vec::new();
        let mut last_key = None;
        let mut continue_token = None;
        for (key, stored) in table.objects.range((start, Bound::Unbounded)) {
            if ns.is_some_and(|ns| key.0 != ns) {
                break;
            }
            let view = to_view(rt, stored);
            if !selectors.matches(&view) {
                continue;
            }
            if limit.is_some_and(|l| l > 0 && items.len() >= l) {
                continue_token = last_key.map(|k| encode_continue(resource_version, k));
                break;
            }
            items.push(view);
            last_key = Some(key);
        }
        Ok(ListPage {
            items,
            resource_version,
            continue_token,
        })
    }

    pub fn create(
        &self,
        rt: &ResourceType,
        namespace: Option<&str>,
        body: Value,
    ) -> Result<Value, ApiError> {
        let mut state = self.lock()?;
        let stored = from_view(rt, body)?;
        let created = self.create_locked(&mut state, rt, namespace, stored)?;
        Ok(to_view(rt, &created))
    }

    fn create_locked(
        &self,
        state: &mut State,
        rt: &ResourceType,
        namespace: Option<&str>,
        mut obj: Value,
    ) -> Result<Arc<Value>, ApiError> {
        let meta = metadata_mut(&mut obj);
        let name = match meta
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
        {
            Some(name) => name.to_string(),
            None => match meta
                .get("generateName")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
            {
                Some(prefix) => format!("{prefix}{}", random_suffix()),
                None => {
                    return Err(invalid(
                        rt,
                        "",
                        vec![FieldError::required(
                            "metadata.name",
                            "name or generateName is required",
                        )],
                    ));
                }
            },
        };
        if !is_dns1123_subdomain(&name) {
            return Err(invalid(
                rt,
                &name,
                vec![FieldError::invalid(
                    "metadata.name",
                    name.as_str(),
                    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                )],
            ));
        }
        meta.insert("name".into(), json!(name));
        if rt.namespaced {
            let url_ns = namespace.unwrap_or_default();
            let body_ns = meta
                .get("namespace")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if !body_ns.is_empty() && body_ns != url_ns {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            meta.insert("namespace".into(), json!(url_ns));
            let ns_key = (String::new(), url_ns.to_string());
            match state.get(Storage::Namespaces, &ns_key) {
                None => return Err(ApiError::namespace_not_found(url_ns)),
                Some(ns) if ns["metadata"].get("deletionTimestamp").is_some() => {
                    return Err(ApiError::namespace_terminating(rt, &name, url_ns));
                }
                Some(_) => {}
            }
        } else {
            meta.remove("namespace");
        }
        meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
        meta.insert("creationTimestamp".into(), json!(now()));
        for key in [
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "resourceVersion",
            "selfLink",
            "managedFields",
        ] {
            meta.remove(key);
        }
        if rt.has_generation {
            meta.insert("generation".into(), json!(1));
        } else {
            meta.remove("generation");
        }
        let key = Self::key(rt, namespace, &name);
        if state.get(rt.storage, &key).is_some() {
            return Err(ApiError::already_exists(rt, &name));
        }
        match rt.storage {
            Storage::Services => {
                if let Some(map) = obj.as_object_mut() {
                    map.insert("status".into(), json!({"loadBalancer": {}}));
                }
                service::prepare_create(&mut obj, &mut state.allocator)
                    .map_err(|e| invalid(rt, &name, e))?;
            }
            Storage::Namespaces => {
                if let Some(map) = obj.as_object_mut() {
                    map.insert("spec".into(), json!({"finalizers": ["kubernetes"]}));
                    map.insert("status".into(), json!({"phase": "Active"}));
                }
                let labels = metadata_mut(&mut obj)
                    .entry("labels")
                    .or_insert_with(|| json!({}));
                if let Some(labels) = labels.as_object_mut() {
                    labels.insert("kubernetes.io/metadata.name".into(), json!(name));
                }
            }
            Storage::ServiceCidrs => {
                service_cidr::prepare_create(&mut obj, &now())
                    .map_err(|e| invalid(rt, &name, e))?;
            }
            _ => {}
        }
        Ok(self.commit(state, rt.storage, key, Some(obj), ChangeType::Added))
    }

    /// Replaces an object (PUT), or its status for `Subresource::Status`.
    pub fn update(
        &self,
        rt: &ResourceType,
        namespace: Option<&str>,
        name: &str,
        body: Value,
        sub: Subresource,
    ) -> Result<Value, ApiError> {
        let new = from_view(rt, body)?;
        if let Some(body_name) = meta_str(&new, "name")
            && body_name != name
        {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({name})"
            )));
        }
        let mut state = self.lock()?;
        let key = Self::key(rt, namespace, name);
        let current = state
            .get(rt.storage, &key)
            .ok_or_else(|| ApiError::not_found(rt, name))?;
        let updated = self.update_locked(&mut state, rt, key, &current, new, sub)?;
        Ok(to_view(rt, &updated))
    }

    /// Patches an object. Server-side apply creates a missing object; returns whether it did.
    pub fn patch(
        &self,
        rt: &ResourceType,
        namespace: Option<&str>,
        name: &str,
        patch_type: PatchType,
        body: &[u8],
        sub: Subresource,
    ) -> Result<(Value, bool), ApiError> {
        let mut state = self.lock()?;
        let key = Self::key(rt, namespace, name);
        let Some(current) = state.get(rt.storage, &key) else {
            if patch_type == PatchType::Apply && sub == Subresource::Main {
                let mut obj: Value = serde_json::from_slice(body).map_err(|e| {
                    ApiError::bad_request(format!("apply patch body must be JSON: {e}"))
                })?;
                metadata_mut(&mut obj).insert("name".into(), json!(name));
                let stored = from_view(rt, obj)?;
                let created = self.create_locked(&mut state, rt, namespace, stored)?;
                return Ok((to_view(rt, &created), true));
            }
            return Err(ApiError::not_found(rt, name));
        };
        // A merge patch that clears the resourceVersion asks for an update without one,
        // which kube-apiserver refuses (leaving it out is what makes a patch unconditional).
        if patch_type == PatchType::Merge
            && let Ok(sent) = serde_json::from_slice::<Value>(body)
            && let Some(rv) = sent["metadata"].get("resourceVersion")
            && (rv.is_null() || rv == "")
        {
            return Err(invalid(
                rt,
                name,
                vec![FieldError::invalid(
                    "metadata.resourceVersion",
                    "",
                    "must be specified for an update",
                )],
            ));
        }
        let patched =
            patch::apply(&to_view(rt, &current), patch_type, body, rt).map_err(|e| match e {
                PatchError::Malformed(_) => ApiError::bad_request(e.to_string()),
                PatchError::NotApplicable(_) => ApiError::unprocessable(e.to_string()),
            })?;
        let new = from_view(rt, patched)?;
        let updated = self.update_locked(&mut state, rt, key, &current, new, sub)?;
        Ok((to_view(rt, &updated), false))
    }

    fn update_locked(
        &self,
        state: &mut State,
        rt: &ResourceType,
        key: ObjectKey,
        current: &Arc<Value>,
        mut new: Value,
        sub: Subresource,
    ) -> Result<Arc<Value>, ApiError> {
        let name = key.1.clone();
        if let Some(rv) = meta_str(&new, "resourceVersion")
            && Some(rv) != meta_str(current, "resourceVersion")
        {
            return Err(ApiError::conflict(rt, &name));
        }
        if sub == Subresource::Status {
            let status = new.get("status").cloned();
            new = (**current).clone();
            if let Some(map) = new.as_object_mut() {
                match status {
                    Some(status) => map.insert("status".into(), status),
                    None => map.remove("status"),
                };
            }
        } else {
            let kept: Vec<(String, Value)> = [
                "name",
                "namespace",
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
                "resourceVersion",
            ]
            .iter()
            .filter_map(|k| {
                current["metadata"]
                    .get(*k)
                    .map(|v| (k.to_string(), v.clone()))
            })
            .collect();
            let meta = metadata_mut(&mut new);
            for k in [
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
                "managedFields",
                "selfLink",
            ] {
                meta.remove(k);
            }
            meta.extend(kept);
            if (rt.has_status || rt.storage == Storage::Namespaces)
                && let Some(map) = new.as_object_mut()
            {
                match current.get("status") {
                    Some(status) => map.insert("status".into(), status.clone()),
                    None => map.remove("status"),
                };
            }
        }
        let deleting = current["metadata"].get("deletionTimestamp").is_some();
        if deleting {
            let old = finalizers(current);
            if let Some(added) = finalizers(&new).into_iter().find(|f| !old.contains(f)) {
                return Err(invalid(
                    rt,
                    &name,
                    vec![FieldError::forbidden(
                        "metadata.finalizers",
                        format!(
                            "no new finalizers can be added if the object is being deleted, found new finalizers [\"{added}\"]"
                        ),
                    )],
                ));
            }
        }
        if sub == Subresource::Main && rt.storage == Storage::Services {
            service::prepare_update(current, &mut new, &mut state.allocator)
                .map_err(|e| invalid(rt, &name, e))?;
        }
        if sub == Subresource::Main && rt.storage == Storage::ServiceCidrs {
            service_cidr::validate_update(current, &new).map_err(|e| invalid(rt, &name, e))?;
        }
        if rt.has_generation && sub == Subresource::Main && new.get("spec") != current.get("spec") {
            let generation = current["metadata"]["generation"].as_u64().unwrap_or(0) + 1;
            metadata_mut(&mut new).insert("generation".into(), json!(generation));
        }
        if new == **current {
            return Ok(current.clone());
        }
        if deleting && finalizers(&new).is_empty() {
            return self.final_delete(state, rt, key, new);
        }
        Ok(self.commit(state, rt.storage, key, Some(new), ChangeType::Modified))
    }

    /// Deletes an object: with finalizers it only gets a deletionTimestamp.
    pub fn delete(
        &self,
        rt: &ResourceType,
        namespace: Option<&str>,
        name: &str,
        preconditions: &Preconditions,
    ) -> Result<Value, ApiError> {
        let mut state = self.lock()?;
        let key = Self::key(rt, namespace, name);
        let current = state
            .get(rt.storage, &key)
            .ok_or_else(|| ApiError::not_found(rt, name))?;
        if let Some(uid) = &preconditions.uid
            && meta_str(&current, "uid") != Some(uid.as_str())
        {
            return Err(ApiError::precondition_failed(
                rt,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    meta_str(&current, "uid").unwrap_or_default()
                ),
            ));
        }
        if let Some(rv) = &preconditions.resource_version
            && meta_str(&current, "resourceVersion") != Some(rv.as_str())
        {
            return Err(ApiError::precondition_failed(
                rt,
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                    meta_str(&current, "resourceVersion").unwrap_or_default()
                ),
            ));
        }
        let deleted = self.delete_locked(&mut state, rt, key, &current)?;
        Ok(to_view(rt, &deleted))
    }

    fn delete_locked(
        &self,
        state: &mut State,
        rt: &ResourceType,
        key: ObjectKey,
        current: &Arc<Value>,
    ) -> Result<Arc<Value>, ApiError> {
        if rt.storage == Storage::Namespaces {
            return self.delete_namespace(state, key, current);
        }
        if finalizers(current).is_empty() {
            return self.final_delete(state, rt, key, (**current).clone());
        }
        if current["metadata"].get("deletionTimestamp").is_some() {
            return Ok(current.clone());
        }
        let mut marked = (**current).clone();
        let meta = metadata_mut(&mut marked);
        meta.insert("deletionTimestamp".into(), json!(now()));
        meta.insert("deletionGracePeriodSeconds".into(), json!(0));
        Ok(self.commit(state, rt.storage, key, Some(marked), ChangeType::Modified))
    }

    /// Marks a namespace Terminating, deletes its content, and removes it once empty.
    fn delete_namespace(
        &self,
        state: &mut State,
        key: ObjectKey,
        current: &Arc<Value>,
    ) -> Result<Arc<Value>, ApiError> {
        let namespace = key.1.clone();
        let mut marked = (**current).clone();
        if marked["metadata"].get("deletionTimestamp").is_none() {
            let meta = metadata_mut(&mut marked);
            meta.insert("deletionTimestamp".into(), json!(now()));
            meta.insert("deletionGracePeriodSeconds".into(), json!(0));
            if let Some(map) = marked.as_object_mut() {
                map.insert("status".into(), json!({"phase": "Terminating"}));
            }
            marked = (*self.commit(
                state,
                Storage::Namespaces,
                key.clone(),
                Some(marked),
                ChangeType::Modified,
            ))
            .clone();
        }
        for rt in resources::ALL
            .iter()
            .filter(|rt| rt.namespaced && rt.view == View::Native)
        {
            let contained: Vec<(ObjectKey, Arc<Value>)> = state
                .tables
                .get(&rt.storage)
                .map(|t| {
                    t.objects
                        .range((namespace.clone(), String::new())..)
                        .take_while(|(k, _)| k.0 == namespace)
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect()
                })
                .unwrap_or_default();
            for (k, obj) in contained {
                self.delete_locked(state, rt, k, &obj)?;
            }
        }
        let remaining = state
            .get(Storage::Namespaces, &key)
            .map_or(marked, |v| (*v).clone());
        self.remove_namespace_if_done(state, &namespace)?;
        Ok(Arc::new(remaining))
    }

    fn remove_namespace_if_done(&self, state: &mut State, namespace: &str) -> Result<(), ApiError> {
        let key = (String::new(), namespace.to_string());
        let Some(ns) = state.get(Storage::Namespaces, &key) else {
            return Ok(());
        };
        if ns["metadata"].get("deletionTimestamp").is_none() || !finalizers(&ns).is_empty() {
            return Ok(());
        }
        let empty = state
            .tables
            .iter()
            .filter(|(s, _)| **s != Storage::Namespaces)
            .all(|(_, t)| {
                t.objects
                    .range((namespace.to_string(), String::new())..)
                    .next()
                    .is_none_or(|(k, _)| k.0 != namespace)
            });
        if empty {
            self.commit(state, Storage::Namespaces, key, None, ChangeType::Deleted);
        }
        Ok(())
    }

    fn final_delete(
        &self,
        state: &mut State,
        rt: &ResourceType,
        key: ObjectKey,
        last: Value,
    ) -> Result<Arc<Value>, ApiError> {
        if rt.storage == Storage::Services {
            service::release(&last, &mut state.allocator);
        }
        let namespace = key.0.clone();
        let table = state.table(rt.storage)?;
        table.objects.insert(key.clone(), Arc::new(last));
        let deleted = self.commit(state, rt.storage, key, None, ChangeType::Deleted);
        if rt.namespaced {
            self.remove_namespace_if_done(state, &namespace)?;
        }
        Ok(deleted)
    }

    /// Writes one change: bumps the resourceVersion, stores or removes the object, records
    /// the change and tells the watchers. For DELETED, the object stored under `key` is
    /// the final state sent to watchers.
    fn commit(
        &self,
        state: &mut State,
        storage: Storage,
        key: ObjectKey,
        new: Option<Value>,
        change_type: ChangeType,
    ) -> Arc<Value> {
        state.resource_version += 1;
        let rv = state.resource_version;
        let Some(table) = state.tables.get_mut(&storage) else {
            return Arc::new(Value::Null);
        };
        let previous = table.objects.get(&key).cloned();
        let mut object = match new {
            Some(obj) => obj,
            None => previous.as_deref().cloned().unwrap_or(Value::Null),
        };
        metadata_mut(&mut object).insert("resourceVersion".into(), json!(rv.to_string()));
        let object = Arc::new(object);
        if change_type == ChangeType::Deleted {
            table.objects.remove(&key);
        } else {
            table.objects.insert(key.clone(), object.clone());
        }
        let change = Arc::new(Change {
            resource_version: rv,
            change_type,
            namespace: key.0,
            object: object.clone(),
            previous: if change_type == ChangeType::Added {
                None
            } else {
                previous
            },
        });
        table.history.push_back(change.clone());
        while table.history.len() > self.history_limit {
            if let Some(old) = table.history.pop_front() {
                table.compacted = old.resource_version;
            }
        }
        // No receivers is fine: nobody is watching this storage.
        let _ = table.sender.send(WatchMessage::Change(change));
        object
    }

    /// Starts a watch: the backlog since `from` (or the current state) plus a live
    /// subscription, taken together so that no change is lost or sent twice.
    pub fn watch(
        &self,
        rt: &ResourceType,
        namespace: Option<&str>,
        from: WatchFrom,
        send_initial_events: bool,
    ) -> Result<WatchStart, ApiError> {
        let mut state = self.lock()?;
        let resource_version = state.resource_version;
        let ns = namespace.filter(|_| rt.namespaced);
        let table = state.table(rt.storage)?;
        let receiver = table.sender.subscribe();
        let in_scope = |k: &ObjectKey| ns.is_none_or(|ns| k.0 == ns);
        let current = |table: &Table| -> Vec<Arc<Value>> {
            table
                .objects
                .iter()
                .filter(|(k, _)| in_scope(k))
                .map(|(_, v)| v.clone())
                .collect()
        };
        let (initial, backlog) = match from {
            WatchFrom::Now => (current(table), Vec::new()),
            WatchFrom::After(rv) => {
                if rv < table.compacted {
                    return Err(ApiError::expired(format!(
                        "too old resource version: {rv} ({})",
                        table.compacted
                    )));
                }
                let start = table.history.partition_point(|c| c.resource_version <= rv);
                let backlog = table
                    .history
                    .range(start..)
                    .filter(|c| ns.is_none_or(|ns| c.namespace == ns))
                    .cloned()
                    .collect();
                (
                    if send_initial_events {
                        current(table)
                    } else {
                        Vec::new()
                    },
                    backlog,
                )
            }
        };
        Ok(WatchStart {
            initial,
            backlog,
            receiver,
            resource_version,
        })
    }

    /// Forgets all history and ends every open watch: a client resuming from any earlier
    /// resourceVersion gets 410 Gone and must relist.
    pub fn compact(&self) -> Result<u64, ApiError> {
        let mut state = self.lock()?;
        state.resource_version += 1;
        let rv = state.resource_version;
        for table in state.tables.values_mut() {
            table.history.clear();
            table.compacted = rv;
            let _ = table.sender.send(WatchMessage::Compacted);
        }
        Ok(rv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{LEASES, NAMESPACES, SERVICES};

    fn store() -> Store {
        Store::new(&StoreConfig {
            watch_cache_size: 5,
            ..StoreConfig::default()
        })
    }

    fn lease(name: &str) -> Value {
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name, "labels": {"app": name}}, "spec": {"holderIdentity": "a"}})
    }

    #[test]
    fn create_get_update_with_conflicts() {
        let s = store();
        let created = s.create(LEASES, Some("default"), lease("l1")).unwrap();
        assert!(created["metadata"]["uid"].is_string());
        let rv = created["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(
            s.create(LEASES, Some("default"), lease("l1"))
                .unwrap_err()
                .reason,
            "AlreadyExists"
        );
        assert_eq!(
            s.create(LEASES, Some("nope"), lease("l2"))
                .unwrap_err()
                .code,
            404
        );

        let mut changed = created.clone();
        changed["spec"]["holderIdentity"] = json!("b");
        let updated = s
            .update(
                LEASES,
                Some("default"),
                "l1",
                changed.clone(),
                Subresource::Main,
            )
            .unwrap();
        assert_ne!(updated["metadata"]["resourceVersion"], json!(rv));
        let stale = s
            .update(LEASES, Some("default"), "l1", changed, Subresource::Main)
            .unwrap_err();
        assert_eq!((stale.code, stale.reason), (409, "Conflict"));
        assert_eq!(
            s.get(LEASES, Some("default"), "l1").unwrap()["spec"]["holderIdentity"],
            "b"
        );
    }

    #[test]
    fn noop_update_keeps_resource_version() {
        let s = store();
        let created = s.create(LEASES, Some("default"), lease("l1")).unwrap();
        let same = s
            .update(
                LEASES,
                Some("default"),
                "l1",
                created.clone(),
                Subresource::Main,
            )
            .unwrap();
        assert_eq!(
            same["metadata"]["resourceVersion"],
            created["metadata"]["resourceVersion"]
        );
    }

    #[test]
    fn status_and_main_writes_are_separate_and_generation_follows_spec() {
        let s = store();
        let svc = json!({"metadata": {"name": "web"}, "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}, "status": {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}});
        let created = s.create(SERVICES, Some("default"), svc).unwrap();
        assert_eq!(
            created["status"],
            json!({"loadBalancer": {}}),
            "status is not settable on create"
        );
        assert_eq!(created["metadata"]["generation"], 1);

        let status = br#"{"status":{"loadBalancer":{"ingress":[{"ip":"198.51.100.7"}]}},"spec":{"type":"ClusterIP"}}"#;
        let (patched, _) = s
            .patch(
                SERVICES,
                Some("default"),
                "web",
                PatchType::Merge,
                status,
                Subresource::Status,
            )
            .unwrap();
        assert_eq!(
            patched["status"]["loadBalancer"]["ingress"][0]["ip"],
            "198.51.100.7"
        );
        assert_eq!(patched["spec"]["type"], "LoadBalancer");
        assert_eq!(patched["metadata"]["generation"], 1);

        let main = br#"{"status":{"loadBalancer":{}},"metadata":{"labels":{"a":"b"}}}"#;
        let (patched, _) = s
            .patch(
                SERVICES,
                Some("default"),
                "web",
                PatchType::Merge,
                main,
                Subresource::Main,
            )
            .unwrap();
        assert_eq!(
            patched["status"]["loadBalancer"]["ingress"][0]["ip"],
            "198.51.100.7"
        );
        assert_eq!(
            patched["metadata"]["generation"], 1,
            "label changes do not bump generation"
        );

        let spec = br#"{"spec":{"sessionAffinity":"ClientIP"}}"#;
        let (patched, _) = s
            .patch(
                SERVICES,
                Some("default"),
                "web",
                PatchType::Merge,
                spec,
                Subresource::Main,
            )
            .unwrap();
        assert_eq!(patched["metadata"]["generation"], 2);
    }

    #[test]
    fn finalizers_hold_deletion_until_removed() {
        let s = store();
        let mut l = lease("l1");
        l["metadata"]["finalizers"] = json!(["example.com/x"]);
        s.create(LEASES, Some("default"), l).unwrap();
        let marked = s
            .delete(LEASES, Some("default"), "l1", &Preconditions::default())
            .unwrap();
        assert!(marked["metadata"]["deletionTimestamp"].is_string());
        assert!(s.get(LEASES, Some("default"), "l1").is_ok());
        let add = br#"{"metadata":{"finalizers":["example.com/x","example.com/y"]}}"#;
        assert_eq!(
            s.patch(
                LEASES,
                Some("default"),
                "l1",
                PatchType::Merge,
                add,
                Subresource::Main
            )
            .unwrap_err()
            .code,
            422
        );
        let start = s
            .watch(
                LEASES,
                Some("default"),
                WatchFrom::After(s.resource_version().unwrap()),
                false,
            )
            .unwrap();
        let mut receiver = start.receiver;
        s.patch(
            LEASES,
            Some("default"),
            "l1",
            PatchType::Merge,
            br#"{"metadata":{"finalizers":null}}"#,
            Subresource::Main,
        )
        .unwrap();
        assert_eq!(s.get(LEASES, Some("default"), "l1").unwrap_err().code, 404);
        match receiver.try_recv().unwrap() {
            WatchMessage::Change(c) => assert_eq!(c.change_type, ChangeType::Deleted),
            WatchMessage::Compacted => panic!("unexpected compaction"),
        }
    }

    #[test]
    fn watch_history_is_bounded_and_compaction_expires_old_versions() {
        let s = store();
        let start_rv = s.resource_version().unwrap();
        for i in 0..3 {
            s.create(LEASES, Some("default"), lease(&format!("l{i}")))
                .unwrap();
        }
        let w = s
            .watch(LEASES, Some("default"), WatchFrom::After(start_rv), false)
            .unwrap();
        assert_eq!(w.backlog.len(), 3);
        for i in 3..10 {
            s.create(LEASES, Some("default"), lease(&format!("l{i}")))
                .unwrap();
        }
        assert_eq!(
            s.watch(LEASES, None, WatchFrom::After(start_rv), false)
                .unwrap_err()
                .code,
            410
        );
        let recent = s.resource_version().unwrap() - 2;
        assert_eq!(
            s.watch(LEASES, None, WatchFrom::After(recent), false)
                .unwrap()
                .backlog
                .len(),
            2
        );
        let rv = s.compact().unwrap();
        assert_eq!(
            s.watch(LEASES, None, WatchFrom::After(recent), false)
                .unwrap_err()
                .reason,
            "Expired"
        );
        assert!(s.watch(LEASES, None, WatchFrom::After(rv), false).is_ok());
        assert_eq!(
            s.watch(LEASES, None, WatchFrom::Now, false)
                .unwrap()
                .initial
                .len(),
            10
        );
    }

    #[test]
    fn list_pages_with_continue_and_selectors() {
        let s = store();
        for i in 0..7 {
            s.create(LEASES, Some("default"), lease(&format!("l{i}")))
                .unwrap();
        }
        s.create(LEASES, Some("kube-system"), lease("other"))
            .unwrap();
        let all = Selectors::default();
        let first = s
            .list(LEASES, Some("default"), &all, Some(3), None)
            .unwrap();
        assert_eq!(first.items.len(), 3);
        let second = s
            .list(
                LEASES,
                Some("default"),
                &all,
                Some(3),
                first.continue_token.as_deref(),
            )
            .unwrap();
        let third = s
            .list(
                LEASES,
                Some("default"),
                &all,
                Some(3),
                second.continue_token.as_deref(),
            )
            .unwrap();
        assert_eq!(third.items.len(), 1);
        assert!(third.continue_token.is_none());
        assert_eq!(second.resource_version, first.resource_version);
        assert_eq!(
            s.list(LEASES, None, &all, None, None).unwrap().items.len(),
            8
        );
        let selectors = Selectors {
            labels: crate::selector::LabelSelector::parse("app in (l1,other)").unwrap(),
            ..Selectors::default()
        };
        assert_eq!(
            s.list(LEASES, None, &selectors, None, None)
                .unwrap()
                .items
                .len(),
            2
        );
        assert_eq!(
            s.list(LEASES, None, &all, None, Some("junk"))
                .unwrap_err()
                .code,
            400
        );
    }

    #[test]
    fn namespace_deletion_removes_content_and_frees_allocations() {
        let s = store();
        s.create(NAMESPACES, None, json!({"metadata": {"name": "team"}}))
            .unwrap();
        let svc = json!({"metadata": {"name": "web"}, "spec": {"type": "NodePort", "ports": [{"port": 80, "nodePort": 30100}]}});
        s.create(SERVICES, Some("team"), svc.clone()).unwrap();
        s.delete(NAMESPACES, None, "team", &Preconditions::default())
            .unwrap();
        assert_eq!(s.get(NAMESPACES, None, "team").unwrap_err().code, 404);
        s.create(SERVICES, Some("default"), svc).unwrap();
    }

    #[test]
    fn apply_patch_creates_then_merges() {
        let s = store();
        let body = br#"{"apiVersion":"coordination.k8s.io/v1","kind":"Lease","spec":{"holderIdentity":"me"}}"#;
        let (created, was_created) = s
            .patch(
                LEASES,
                Some("default"),
                "l",
                PatchType::Apply,
                body,
                Subresource::Main,
            )
            .unwrap();
        assert!(was_created);
        assert_eq!(created["metadata"]["name"], "l");
        let (_, was_created) = s
            .patch(
                LEASES,
                Some("default"),
                "l",
                PatchType::Apply,
                br#"{"spec":{"leaseTransitions":1}}"#,
                Subresource::Main,
            )
            .unwrap();
        assert!(!was_created);
        let got = s.get(LEASES, Some("default"), "l").unwrap();
        assert_eq!(
            got["spec"],
            json!({"holderIdentity": "me", "leaseTransitions": 1})
        );
        assert_eq!(
            s.patch(
                LEASES,
                Some("default"),
                "x",
                PatchType::Merge,
                b"{}",
                Subresource::Main
            )
            .unwrap_err()
            .code,
            404
        );
    }
}
