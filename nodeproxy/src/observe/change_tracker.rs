//! What changed since the last sync, as kube-proxy's ServiceChangeTracker and
//! EndpointsChangeTracker record it: every watch event marks the Service ports of the
//! object's previous and current version, merged until the next sync takes them; only
//! those ports are joined again. Backend-neutral: it yields [`ProxyState`] entries,
//! not rules.
//!
//! The tracker is the node proxy's only store of Services and EndpointSlices. It keeps
//! each object converted ([`ServiceEntry`], [`SliceEntry`]), not the object, which takes
//! about four times the memory. A full join of the very entries the incremental state
//! came from is at hand for the periodic consistency check.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Resource;
use kube::runtime::watcher::Event;
use tandem_common::{IpFamily, Protocol};
use tandem_proxy_rules::model::{ProxyState, ServicePort, ServicePortName};

use crate::observe::convert::{self, ObjectKey, ServiceEntry, Skipped, SliceEntry, object_key};

/// The Service ports that changed since the previous [`ChangeTracker::take`], with their
/// entries then and now (ports that are not in a state have no entry there).
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// No change yet, of the proxier of `family`.
    fn new(family: IpFamily) -> Self {
        Self {
            ports: BTreeSet::new(),
            previous: ProxyState::new(family),
            current: ProxyState::new(family),
            skipped: Vec::new(),
            first_slice_change: None,
        }
    }

    /// Folds in the changes taken after these (when these could not be applied): each
    /// port keeps its earliest previous entry and gets its latest current one.
    pub fn merge(&mut self, mut later: Changes) {
        for name in &later.ports {
            if self.ports.insert(name.clone()) {
                later.previous.move_port(name, &mut self.previous);
            }
            self.current.remove(name);
        }
        self.current.extend(later.current);
        self.skipped.extend(later.skipped);
        self.first_slice_change = self.first_slice_change.or(later.first_slice_change);
    }

    /// Drops the current entries of the ports that are UDP neither before nor now. Once
    /// the rules are rebuilt, only the stale-flow cleanup
    /// ([`tandem_proxy_rules::conntrack::stale_udp_deletions`]) and a later
    /// [`Changes::merge`] read them, and neither needs those: a first sync's changes hold
    /// every endpoint once more, while the whole table is written.
    pub fn drop_current_not_udp(&mut self) {
        let udp = |service: Option<&ServicePort>| {
            service.is_some_and(|service| service.protocol == Protocol::Udp)
        };
        let previous = self.previous.services();
        self.current
            .retain(|name, service| udp(service) || udp(previous.get(name)));
    }
}

/// What is kept of one kind's objects, converted, and the relist in progress, if any.
#[derive(Debug)]
struct Objects<V> {
    by_key: HashMap<ObjectKey, Arc<V>>,
    /// Keys seen since a relist started (`Init`), to drop the others at `InitDone`.
    relisting: Option<HashSet<ObjectKey>>,
    listed: bool,
}

impl<V> Default for Objects<V> {
    fn default() -> Self {
        Self {
            by_key: HashMap::new(),
            relisting: None,
            listed: false,
        }
    }
}

/// An object's entry before and after one event (`None`: absent).
struct Replaced<V> {
    key: ObjectKey,
    previous: Option<Arc<V>>,
    current: Option<Arc<V>>,
}

impl<V> Objects<V> {
    /// Applies a watch event, keeping of each object what `convert` makes of it; returns
    /// the entries it replaced.
    fn record<K: Resource>(
        &mut self,
        event: Event<K>,
        convert: impl Fn(&K) -> V,
    ) -> Vec<Replaced<V>> {
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
                vec![self.put(key, convert(&object))]
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
                    .map(|key| Replaced {
                        previous: self.by_key.remove(&key),
                        current: None,
                        key,
                    })
                    .collect()
            }
            Event::Apply(object) => {
                let key = object_key(object.meta());
                vec![self.put(key, convert(&object))]
            }
            Event::Delete(object) => {
                let key = object_key(object.meta());
                vec![Replaced {
                    previous: self.by_key.remove(&key),
                    current: None,
                    key,
                }]
            }
        }
    }

    fn put(&mut self, key: ObjectKey, entry: V) -> Replaced<V> {
        let entry = Arc::new(entry);
        Replaced {
            previous: self.by_key.insert(key.clone(), Arc::clone(&entry)),
            current: Some(entry),
            key,
        }
    }
}

/// The watched Services and EndpointSlices (converted as they arrive, for one IP family),
/// the state joined from them as of the last [`take`](ChangeTracker::take), and the
/// Service ports changed since.
#[derive(Debug)]
pub struct ChangeTracker {
    family: IpFamily,
    services: Objects<ServiceEntry>,
    slices: Objects<SliceEntry>,
    /// Slice names by the `(namespace, Service name)` their label points to, sorted: a
    /// Service has a few, and a set per Service took most of 4 MiB at 10,000 Services.
    slices_by_service: HashMap<ObjectKey, Vec<String>>,
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
    /// The tracker of the proxier of `family`.
    pub fn new(family: IpFamily) -> Self {
        Self {
            family,
            services: Objects::default(),
            slices: Objects::default(),
            slices_by_service: HashMap::new(),
            state: ProxyState::new(family),
            changed: BTreeSet::new(),
            first_slice_change: None,
        }
    }

    /// True once both watches delivered their first full list.
    pub fn listed(&self) -> bool {
        self.services.listed && self.slices.listed
    }

    /// Records a Service watch event; true when it changed a Service port or finished a list.
    pub fn record_service(&mut self, event: Event<Service>) -> bool {
        let finishes_list = matches!(event, Event::InitDone);
        let before = self.changed.len();
        let family = self.family;
        let convert = |service: &Service| ServiceEntry::of(service, family);
        for replaced in self.services.record(event, convert) {
            for entry in replaced.previous.iter().chain(&replaced.current) {
                self.changed
                    .extend(entry.ports.iter().map(|port| port.name.clone()));
            }
        }
        finishes_list || self.changed.len() != before
    }

    /// Records an EndpointSlice watch event; true when it changed a Service port's
    /// endpoints or finished a list.
    pub fn record_slice(&mut self, event: Event<EndpointSlice>) -> bool {
        let finishes_list = matches!(event, Event::InitDone);
        let before = self.changed.len();
        let family = self.family;
        let convert = |slice: &EndpointSlice| SliceEntry::of(slice, family);
        for Replaced {
            key,
            previous,
            current,
        } in self.slices.record(event, convert)
        {
            if let Some(service) = previous.as_ref().and_then(|entry| entry.service.as_ref()) {
                self.index_slice(service, &key, false);
            }
            if let Some(service) = current.as_ref().and_then(|entry| entry.service.as_ref()) {
                self.index_slice(service, &key, true);
            }
            // A port whose endpoints differ has some in one of the two versions.
            for entry in previous.iter().chain(&current) {
                self.changed.extend(entry.served_ports().cloned());
            }
        }
        let changed = self.changed.len() != before;
        if changed {
            self.first_slice_change.get_or_insert_with(Instant::now);
        }
        finishes_list || changed
    }

    fn index_slice(&mut self, service: &ObjectKey, (_, slice): &ObjectKey, present: bool) {
        if present {
            let names = self.slices_by_service.entry(service.clone()).or_default();
            if let Err(at) = names.binary_search(slice) {
                names.insert(at, slice.clone());
            }
        } else if let Some(names) = self.slices_by_service.get_mut(service) {
            if let Ok(at) = names.binary_search(slice) {
                names.remove(at);
            }
            if names.is_empty() {
                self.slices_by_service.remove(service);
            }
        }
    }

    /// Joins the changed Service ports again and hands them over; the next call reports
    /// only what changes after this one.
    pub fn take(&mut self) -> Changes {
        let ports = std::mem::take(&mut self.changed);
        let mut changes = Changes {
            first_slice_change: self.first_slice_change.take(),
            ..Changes::new(self.family)
        };
        for name in &ports {
            self.state.move_port(name, &mut changes.previous);
        }
        // Each changed Service once, however many of its ports changed.
        let services: BTreeSet<ObjectKey> = ports
            .iter()
            .map(|name| (name.namespace.clone(), name.name.clone()))
            .collect();
        for key in services {
            let Some(service) = self.services.by_key.get(&key) else {
                continue;
            };
            let slices: Vec<&SliceEntry> = self
                .slices_by_service
                .get(&key)
                .into_iter()
                .flatten()
                .filter_map(|slice| self.slices.by_key.get(&(key.0.clone(), slice.clone())))
                .map(AsRef::as_ref)
                .collect();
            changes.skipped.extend(service.skipped.iter().cloned());
            for slice in &slices {
                changes.skipped.extend(slice.skipped.iter().cloned());
            }
            for port in service
                .ports
                .iter()
                .filter(|port| ports.contains(&port.name))
            {
                let endpoints = convert::port_endpoints(&port.name, slices.iter().copied());
                self.state.insert_service(port.clone());
                self.state.insert_endpoints(port.name.clone(), endpoints);
            }
        }
        let state = &mut self.state;
        if ports.len() > state.services().len() / 2 {
            // Most ports joined again (a first sync): the maps grew by inserts in key
            // order, which leaves their nodes half empty; built again in bulk they are full.
            state.compact();
        }
        // Copied after the state is complete, so the copies lie together: freed once the
        // rules are rebuilt (`Changes::drop_current_not_udp`), they leave one hole the
        // rules' netlink batch can take, not a scatter of small ones. Built in bulk too.
        changes.current = ProxyState::from_entries(
            state.family(),
            ports
                .iter()
                .filter_map(|name| state.services().get(name).cloned()),
            ports
                .iter()
                .filter_map(|name| Some((name.clone(), state.endpoints().get(name)?.clone()))),
        );
        changes.ports = ports;
        changes
    }

    /// Marks every Service port with a zone-hinted endpoint as changed, so the next
    /// [`take`](Self::take) hands it over again: the node's zone changed, and the
    /// endpoints such ports use may with it. Ports without zone hints do not depend on
    /// the zone and stay as they are. Returns how many ports it marked.
    pub fn mark_zone_hinted(&mut self) -> usize {
        let hinted = self
            .state
            .endpoints()
            .iter()
            .filter(|(_, endpoints)| endpoints.iter().any(|ep| !ep.zone_hints().is_empty()))
            .map(|(name, _)| name.clone());
        let before = self.changed.len();
        self.changed.extend(hinted);
        self.changed.len() - before
    }

    /// The state as of the last [`take`](Self::take).
    pub fn state(&self) -> &ProxyState {
        &self.state
    }

    /// The entries held now, cheap to take (reference counts only), so the lock is not
    /// held while they are joined.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            family: self.family,
            services: self.services.by_key.values().cloned().collect(),
            slices: self.slices.by_key.values().cloned().collect(),
        }
    }

    /// Replaces the state with a full join (of a [`snapshot`](Self::snapshot)) after the
    /// incremental one diverged, so health checks and the next changes' `previous` start
    /// from what the rebuilt rules hold. Ports changed since the snapshot are still
    /// marked, and the next [`take`](Self::take) joins them again.
    pub fn replace_state(&mut self, state: ProxyState) {
        debug_assert_eq!(
            state.family(),
            self.family,
            "a state of the tracker's family"
        );
        self.state = state;
    }
}

/// The converted Services and EndpointSlices held at one moment.
#[derive(Debug, Clone)]
pub struct Snapshot {
    family: IpFamily,
    services: Vec<Arc<ServiceEntry>>,
    slices: Vec<Arc<SliceEntry>>,
}

impl Snapshot {
    /// The state of every entry joined from scratch, independent of the change tracking.
    pub fn joined(&self) -> convert::Conversion {
        convert::join(
            self.services.iter().map(AsRef::as_ref),
            self.slices.iter().map(AsRef::as_ref),
            self.family,
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
            ip: std::net::Ipv4Addr::new(10, 244, 1, last).into(),
            port: 80,
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
            hints: None,
        }]
    }

    fn changes(port: &str, previous: Option<u8>, current: Option<u8>) -> Changes {
        let mut out = Changes::new(IpFamily::V4);
        out.ports.insert(name(port));
        if let Some(last) = previous {
            out.previous.insert_endpoints(name(port), endpoints(last));
        }
        if let Some(last) = current {
            out.current.insert_endpoints(name(port), endpoints(last));
        }
        out
    }

    #[test]
    fn a_zone_change_marks_only_the_ports_with_zone_hints() {
        let service = |name: &str| -> Service {
            serde_json::from_value(serde_json::json!({
                "metadata": {"namespace": "default", "name": name},
                "spec": {"clusterIP": "10.96.0.1", "ports": [{"name": "http", "port": 80}]},
            }))
            .unwrap()
        };
        let slice = |service: &str, hints: serde_json::Value| -> EndpointSlice {
            serde_json::from_value(serde_json::json!({
                "metadata": {"namespace": "default", "name": format!("{service}-1"),
                    "labels": {convert::SERVICE_NAME_LABEL: service}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080}],
                "endpoints": [{"addresses": ["10.244.1.5"], "hints": hints}],
            }))
            .unwrap()
        };
        let mut tracker = ChangeTracker::new(IpFamily::V4);
        for name in ["zoned", "plain"] {
            tracker.record_service(Event::Apply(service(name)));
        }
        tracker.record_slice(Event::Apply(slice(
            "zoned",
            serde_json::json!({"forZones": [{"name": "zone-a"}]}),
        )));
        tracker.record_slice(Event::Apply(slice("plain", serde_json::json!({}))));
        assert_eq!(tracker.take().ports.len(), 2);
        assert_eq!(tracker.mark_zone_hinted(), 1);
        let again = tracker.take();
        assert_eq!(
            again.ports,
            [ServicePortName {
                namespace: "default".into(),
                name: "zoned".into(),
                port: "http".into(),
            }]
            .into()
        );
        // Re-joined, not changed: nothing for conntrack to clean up.
        assert_eq!(again.previous, again.current);
    }

    #[test]
    fn dropping_the_ports_udp_neither_before_nor_now_leaves_the_same_stale_flows() {
        use tandem_proxy_rules::conntrack::stale_udp_deletions;
        use tandem_proxy_rules::model::ServicePort;

        let service = |port: &str, protocol, ip: u8| ServicePort {
            name: name(port),
            protocol,
            cluster_ip: Some(std::net::Ipv4Addr::new(10, 96, 0, ip).into()),
            port: 53,
            node_port: Some(30053),
            external_ips: vec![],
            load_balancer_ingress: vec![],
            load_balancer_source_ranges: vec![],
            session_affinity_timeout: None,
            external_traffic_policy_local: false,
            health_check_node_port: None,
            internal_traffic_policy_local: false,
        };
        let (tcp, udp) = (Protocol::Tcp, Protocol::Udp);
        // (port, before, after): protocol, cluster IP and endpoint of each version.
        let versions = [
            ("tcp-only", Some((tcp, 1, 1)), Some((tcp, 1, 2))),
            ("udp-to-tcp", Some((udp, 2, 1)), Some((tcp, 2, 2))),
            ("tcp-to-udp", Some((tcp, 3, 1)), Some((udp, 3, 2))),
            ("udp-moved", Some((udp, 4, 1)), Some((udp, 5, 2))),
            ("udp-new", None, Some((udp, 6, 1))),
            ("tcp-new", None, Some((tcp, 7, 1))),
            ("udp-gone", Some((udp, 8, 1)), None),
        ];
        let mut changes = Changes::new(IpFamily::V4);
        for (port, before, after) in versions {
            changes.ports.insert(name(port));
            for (state, version) in [
                (&mut changes.previous, before),
                (&mut changes.current, after),
            ] {
                if let Some((protocol, ip, endpoint)) = version {
                    state.insert_service(service(port, protocol, ip));
                    state.insert_endpoints(name(port), endpoints(endpoint));
                }
            }
        }
        let expected = stale_udp_deletions(&changes.previous, &changes.current);
        assert!(!expected.is_empty());
        changes.drop_current_not_udp();
        assert_eq!(
            changes
                .current
                .services()
                .keys()
                .map(|n| n.port.as_str())
                .collect::<Vec<_>>(),
            ["tcp-to-udp", "udp-moved", "udp-new", "udp-to-tcp"]
        );
        assert_eq!(
            stale_udp_deletions(&changes.previous, &changes.current),
            expected
        );
    }

    #[test]
    fn merged_changes_keep_the_earliest_previous_and_the_latest_current() {
        let mut earlier = changes("http", Some(1), Some(2));
        earlier.merge(changes("http", Some(2), None));
        earlier.merge(changes("dns", None, Some(7)));
        assert_eq!(earlier.ports, [name("dns"), name("http")].into());
        assert_eq!(earlier.previous.endpoints()[&name("http")], endpoints(1));
        assert!(!earlier.current.endpoints().contains_key(&name("http")));
        assert!(!earlier.previous.endpoints().contains_key(&name("dns")));
        assert_eq!(earlier.current.endpoints()[&name("dns")], endpoints(7));
    }
}
