//! What changed since the last sync, as kube-proxy's ServiceChangeTracker and
//! EndpointsChangeTracker record it: every watch event marks the Service ports of the
//! object's previous and current version, merged until the next sync takes them; only
//! those ports are converted again. Backend-neutral: it yields [`ProxyState`] entries,
//! not rules.
//!
//! The tracker also holds the watched objects themselves (it is the node proxy's only
//! store of Services and EndpointSlices), so a full conversion of the very objects the
//! incremental state came from is at hand for the periodic consistency check.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Resource;
use kube::runtime::watcher::Event;
use tandem_proxy_rules::model::{ProxyState, ServicePort, ServicePortName};

use crate::convert::{self, ObjectKey, Skipped, object_key};

/// The Service ports that changed since the previous [`ChangeTracker::take`], with their
/// entries then and now (ports that are not in a state have no entry there).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    pub ports: BTreeSet<ServicePortName>,
    pub previous: ProxyState,
    pub current: ProxyState,
    /// Values left out while converting the changed objects.
    pub skipped: Vec<Skipped>,
    /// When the watch delivered the first EndpointSlice change among these, for the
    /// network programming latency.
    pub first_slice_change: Option<Instant>,
}

impl Changes {
    /// Folds in the changes taken after these (when these could not be applied): each
    /// port keeps its earliest previous entry and gets its latest current one.
    pub fn merge(&mut self, later: Changes) {
        for name in &later.ports {
            if self.ports.insert(name.clone()) {
                if let Some(service) = later.previous.services.get(name) {
                    self.previous.services.insert(name.clone(), service.clone());
                }
                if let Some(endpoints) = later.previous.endpoints.get(name) {
                    self.previous
                        .endpoints
                        .insert(name.clone(), endpoints.clone());
                }
            }
            self.current.services.remove(name);
            self.current.endpoints.remove(name);
        }
        self.current.services.extend(later.current.services);
        self.current.endpoints.extend(later.current.endpoints);
        self.skipped.extend(later.skipped);
        self.first_slice_change = self.first_slice_change.or(later.first_slice_change);
    }
}

/// One kind's objects and the relist in progress, if any.
#[derive(Debug)]
struct Objects<K> {
    by_key: HashMap<ObjectKey, Arc<K>>,
    /// Keys seen since a relist started (`Init`), to drop the others at `InitDone`.
    relisting: Option<HashSet<ObjectKey>>,
    listed: bool,
}

impl<K> Default for Objects<K> {
    fn default() -> Self {
        Self {
            by_key: HashMap::new(),
            relisting: None,
            listed: false,
        }
    }
}

/// An object's version before and after one event (`None`: absent).
type Replaced<K> = (Option<Arc<K>>, Option<Arc<K>>);

impl<K: Resource> Objects<K> {
    /// Applies a watch event; returns the objects it replaced.
    fn record(&mut self, event: Event<K>) -> Vec<Replaced<K>> {
        match event {
            Event::Init => {
                self.relisting = Some(HashSet::new());
                Vec::new()
            }
            Event::InitApply(object) => {
                let key = object_key(object.meta());
                if let Some(seen) = &mut self.relisting {
                    seen.insert(key.clone());
                }
                vec![self.put(key, object)]
            }
            Event::InitDone => {
                self.listed = true;
                let Some(seen) = self.relisting.take() else {
                    return Vec::new();
                };
                let gone: Vec<ObjectKey> = self
                    .by_key
                    .keys()
                    .filter(|key| !seen.contains(*key))
                    .cloned()
                    .collect();
                gone.into_iter()
                    .map(|key| (self.by_key.remove(&key), None))
                    .collect()
            }
            Event::Apply(object) => {
                let key = object_key(object.meta());
                vec![self.put(key, object)]
            }
            Event::Delete(object) => {
                vec![(self.by_key.remove(&object_key(object.meta())), None)]
            }
        }
    }

    fn put(&mut self, key: ObjectKey, object: K) -> Replaced<K> {
        let object = Arc::new(object);
        (self.by_key.insert(key, Arc::clone(&object)), Some(object))
    }
}

/// The watched Services and EndpointSlices, the state converted from them as of the last
/// [`take`](ChangeTracker::take), and the Service ports changed since.
#[derive(Debug, Default)]
pub struct ChangeTracker {
    services: Objects<Service>,
    slices: Objects<EndpointSlice>,
    /// Slice names by the `(namespace, Service name)` their label points to.
    slices_by_service: HashMap<ObjectKey, BTreeSet<String>>,
    state: ProxyState,
    changed: BTreeSet<ServicePortName>,
    first_slice_change: Option<Instant>,
}

/// The tracker as the watch tasks and the sync loop share it.
pub type SharedTracker = Arc<Mutex<ChangeTracker>>;

/// Locks the tracker; a panic elsewhere while holding it leaves data that is still
/// consistent per event, so the lock is taken over rather than propagated.
pub fn lock(tracker: &SharedTracker) -> MutexGuard<'_, ChangeTracker> {
    tracker.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ChangeTracker {
    /// True once both watches delivered their first full list.
    pub fn listed(&self) -> bool {
        self.services.listed && self.slices.listed
    }

    /// Records a Service watch event; true when it changed a Service port or finished a list.
    pub fn record_service(&mut self, event: Event<Service>) -> bool {
        let finishes_list = matches!(event, Event::InitDone);
        let before = self.changed.len();
        for (previous, current) in self.services.record(event) {
            for service in previous.iter().chain(&current) {
                let ports = convert::service_ports(service, &mut Vec::new());
                self.changed.extend(ports.into_iter().map(|port| port.name));
            }
        }
        finishes_list || self.changed.len() != before
    }

    /// Records an EndpointSlice watch event; true when it changed a Service port's
    /// endpoints or finished a list.
    pub fn record_slice(&mut self, event: Event<EndpointSlice>) -> bool {
        let finishes_list = matches!(event, Event::InitDone);
        let before = self.changed.len();
        for (previous, current) in self.slices.record(event) {
            if let Some(slice) = &previous {
                self.index_slice(slice, false);
            }
            if let Some(slice) = &current {
                self.index_slice(slice, true);
            }
            // A port whose endpoints differ has some in one of the two versions.
            for slice in previous.iter().chain(&current) {
                let endpoints = convert::slice_endpoints(slice, &mut Vec::new());
                self.changed
                    .extend(endpoints.into_iter().map(|(name, _)| name));
            }
        }
        let changed = self.changed.len() != before;
        if changed {
            self.first_slice_change.get_or_insert_with(Instant::now);
        }
        finishes_list || changed
    }

    fn index_slice(&mut self, slice: &EndpointSlice, present: bool) {
        let Some(service) = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get(convert::SERVICE_NAME_LABEL))
        else {
            return;
        };
        let (namespace, name) = object_key(&slice.metadata);
        let service_key = (namespace, service.clone());
        if present {
            self.slices_by_service
                .entry(service_key)
                .or_default()
                .insert(name);
        } else if let Some(names) = self.slices_by_service.get_mut(&service_key) {
            names.remove(&name);
            if names.is_empty() {
                self.slices_by_service.remove(&service_key);
            }
        }
    }

    /// Converts the changed Service ports again and hands them over; the next call
    /// reports only what changes after this one.
    pub fn take(&mut self) -> Changes {
        let ports = std::mem::take(&mut self.changed);
        let mut changes = Changes {
            first_slice_change: self.first_slice_change.take(),
            ..Changes::default()
        };
        // Each changed Service is converted once, however many of its ports changed.
        let mut converted: HashMap<ObjectKey, Vec<ServicePort>> = HashMap::new();
        for name in &ports {
            let previous = (
                self.state.services.remove(name),
                self.state.endpoints.remove(name),
            );
            if let Some(service) = previous.0 {
                changes.previous.services.insert(name.clone(), service);
            }
            if let Some(endpoints) = previous.1 {
                changes.previous.endpoints.insert(name.clone(), endpoints);
            }
            let service_key = (name.namespace.clone(), name.name.clone());
            let service_ports = converted.entry(service_key.clone()).or_insert_with(|| {
                self.services
                    .by_key
                    .get(&service_key)
                    .map(|service| convert::service_ports(service, &mut changes.skipped))
                    .unwrap_or_default()
            });
            let Some(port) = service_ports.iter().find(|port| port.name == *name) else {
                continue;
            };
            let slices = self
                .slices_by_service
                .get(&service_key)
                .into_iter()
                .flatten()
                .filter_map(|slice| {
                    self.slices
                        .by_key
                        .get(&(name.namespace.clone(), slice.clone()))
                });
            let mut endpoints = Vec::new();
            for slice in slices {
                let of_slice = convert::slice_endpoints(slice, &mut changes.skipped);
                endpoints.extend(
                    of_slice
                        .into_iter()
                        .filter(|(port_name, _)| port_name == name)
                        .map(|(_, endpoint)| endpoint),
                );
            }
            let endpoints = convert::join_endpoints(endpoints);
            self.state.services.insert(name.clone(), port.clone());
            changes.current.services.insert(name.clone(), port.clone());
            if !endpoints.is_empty() {
                self.state.endpoints.insert(name.clone(), endpoints.clone());
                changes.current.endpoints.insert(name.clone(), endpoints);
            }
        }
        changes.ports = ports;
        changes
    }

    /// The state as of the last [`take`](Self::take).
    pub fn state(&self) -> &ProxyState {
        &self.state
    }

    /// The objects held now, cheap to take (reference counts only), so the lock is not
    /// held while they are converted.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            services: self.services.by_key.values().cloned().collect(),
            slices: self.slices.by_key.values().cloned().collect(),
        }
    }

    /// Replaces the state with a full conversion (of a [`snapshot`](Self::snapshot)) after
    /// the incremental one diverged, so health checks and the next changes' `previous`
    /// start from what the rebuilt rules hold. Ports changed since the snapshot are still
    /// marked, and the next [`take`](Self::take) converts them again.
    pub fn replace_state(&mut self, state: ProxyState) {
        self.state = state;
    }
}

/// The Services and EndpointSlices held at one moment.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    services: Vec<Arc<Service>>,
    slices: Vec<Arc<EndpointSlice>>,
}

impl Snapshot {
    /// A full conversion of every object, independent of the change tracking.
    pub fn conversion(&self) -> convert::Conversion {
        convert::proxy_state(
            self.services.iter().map(AsRef::as_ref),
            self.slices.iter().map(AsRef::as_ref),
        )
    }
}

#[cfg(test)]
mod tests {
    use tandem_proxy_rules::model::Endpoint;

    use super::*;

    fn name(port: &str) -> ServicePortName {
        ServicePortName {
            namespace: "default".into(),
            name: "web".into(),
            port: port.into(),
        }
    }

    fn endpoints(last: u8) -> Vec<Endpoint> {
        vec![Endpoint {
            ip: std::net::Ipv4Addr::new(10, 244, 1, last),
            port: 80,
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
        }]
    }

    fn changes(port: &str, previous: Option<u8>, current: Option<u8>) -> Changes {
        let mut out = Changes::default();
        out.ports.insert(name(port));
        if let Some(last) = previous {
            out.previous.endpoints.insert(name(port), endpoints(last));
        }
        if let Some(last) = current {
            out.current.endpoints.insert(name(port), endpoints(last));
        }
        out
    }

    #[test]
    fn merged_changes_keep_the_earliest_previous_and_the_latest_current() {
        let mut earlier = changes("http", Some(1), Some(2));
        earlier.merge(changes("http", Some(2), None));
        earlier.merge(changes("dns", None, Some(7)));
        assert_eq!(earlier.ports, [name("dns"), name("http")].into());
        assert_eq!(earlier.previous.endpoints[&name("http")], endpoints(1));
        assert!(!earlier.current.endpoints.contains_key(&name("http")));
        assert!(!earlier.previous.endpoints.contains_key(&name("dns")));
        assert_eq!(earlier.current.endpoints[&name("dns")], endpoints(7));
    }
}
