//! Observe: reflectors and watches on Services, EndpointSlices, this node's Node and,
//! where they are served, ServiceCIDR objects, feeding a [`change_tracker`] per IP family
//! through [`convert`] (the API objects as the rules' model, pure). The sync loop and
//! `trace` both read the cluster from here.

pub mod change_tracker;
pub mod convert;

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tandem_common::IpFamily;
use tandem_proxy_rules::model::{NodeConfig, service_cidrs_of};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use self::change_tracker::{ChangeTracker, SharedTracker};
use crate::metrics::Metrics;

/// The observed cluster, kept current by [`watch`]: Services and EndpointSlices in a
/// change tracker per IP family, this node's Node in a reflector store, and the
/// ServiceCIDR objects in another when they are watched.
#[derive(Clone)]
pub struct Observed {
    pub trackers: BTreeMap<IpFamily, SharedTracker>,
    pub node: Store<Node>,
    /// `None`: not watched (the iptables mode, or a server without the API), the Service
    /// CIDRs stay `--service-cluster-ip-range`'s.
    pub service_cidrs: Option<Store<ServiceCIDR>>,
}

impl Observed {
    /// The state of every Service and EndpointSlice held in `family`, joined from
    /// scratch, plus the values left out (`None`: that family is not watched); joined
    /// after the tracker lock is released, so the watches are not held up.
    pub fn joined(&self, family: IpFamily) -> Option<convert::Conversion> {
        let snapshot = change_tracker::lock(self.trackers.get(&family)?).snapshot();
        Some(snapshot.joined())
    }

    /// The settings the node's own objects give its proxiers now: the Node's zone label
    /// and the ServiceCIDR objects' CIDRs. The sync loop and `trace` both take them from
    /// here, so a trace sees the rules a sync writes.
    pub fn node_settings(&self) -> NodeSettings {
        let zone = self.synced_node_fields().and_then(|fields| fields.zone);
        let (service_cidrs, skipped) = match &self.service_cidrs {
            Some(store) => {
                let objects = store.state();
                let (cidrs, skipped) = convert::service_cidrs(objects.iter().map(AsRef::as_ref));
                (Some(cidrs), skipped)
            }
            None => (None, Vec::new()),
        };
        NodeSettings {
            zone,
            service_cidrs,
            skipped,
        }
    }

    pub fn node_draining(&self) -> bool {
        self.synced_node_fields()
            .is_some_and(|fields| fields.leaving)
    }

    /// What a sync reads of this node's Node, from the store; `None`: no Node.
    fn synced_node_fields(&self) -> Option<convert::SyncedNodeFields> {
        self.node
            .state()
            .first()
            .map(|node| convert::SyncedNodeFields::of(node))
    }

    /// Wait until every watch delivered its first full list (or `shutdown`); false when
    /// the watches ended first.
    pub async fn wait_until_listed(&self, dirty: &Notify) -> bool {
        if self.node.wait_until_ready().await.is_err() {
            return false;
        }
        if let Some(service_cidrs) = &self.service_cidrs
            && service_cidrs.wait_until_ready().await.is_err()
        {
            return false;
        }
        loop {
            // Register before checking, so a list finished in between is not missed.
            let notified = dirty.notified();
            if self
                .trackers
                .values()
                .all(|tracker| change_tracker::lock(tracker).listed())
            {
                // The permit this wait may have consumed stands for changes to sync.
                dirty.notify_one();
                return true;
            }
            notified.await;
        }
    }
}

/// What the node's own objects say of its proxiers' settings (see
/// [`Observed::node_settings`]).
#[derive(Debug, Clone)]
pub struct NodeSettings {
    /// The Node's `topology.kubernetes.io/zone` label.
    zone: Option<String>,
    /// Every ServiceCIDR object's CIDRs, of both families; `None`: not watched, the
    /// Service CIDRs stay `--service-cluster-ip-range`'s.
    service_cidrs: Option<Vec<IpNet>>,
    /// The ServiceCIDR values that are not CIDRs.
    pub skipped: Vec<convert::Skipped>,
}

impl NodeSettings {
    /// The node's zone.
    pub fn zone(&self) -> Option<&str> {
        self.zone.as_deref()
    }

    /// The Service CIDRs of `family` where ServiceCIDR objects are watched (they replace
    /// the flag, as kube-proxy's nftables mode knows no other source); `None` where the
    /// flag's stay.
    pub fn service_cidrs_of(&self, family: IpFamily) -> Option<Vec<IpNet>> {
        let cidrs = self.service_cidrs.as_ref()?;
        Some(service_cidrs_of(family, cidrs.iter().copied()))
    }

    /// A proxier's `node` as these settings make it (see [`Self::zone`] and
    /// [`Self::service_cidrs_of`]).
    pub fn applied_to(&self, node: &NodeConfig) -> NodeConfig {
        let mut node = node.clone();
        node.zone.clone_from(&self.zone);
        if let Some(cidrs) = self.service_cidrs_of(node.family) {
            node.service_cidrs = cidrs;
        }
        node
    }
}

/// Services and EndpointSlices per page of a list. A page is held whole, its JSON and its
/// objects, while its objects are converted, in the heap of the watch's thread; the
/// pages of kube's default size (500) left 6 MiB more of those heaps resident at 10,000
/// Services.
const LIST_PAGE_SIZE: u32 = 100;

/// Start the watches, feeding a change tracker for each of `families`; `dirty` is
/// notified whenever a change waits for a sync. The returned future runs them until
/// `shutdown`. As kube-proxy does, Services another proxy owns
/// (`service.kubernetes.io/service-proxy-name`) and headless ones are not watched.
/// ServiceCIDR objects are watched with `service_cidrs` (see [`serves_service_cidrs`]).
pub fn watch(
    client: Client,
    node_name: &str,
    families: &[IpFamily],
    service_cidrs: bool,
    dirty: Arc<Notify>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> (Observed, impl Future<Output = ()> + use<>) {
    let trackers: BTreeMap<IpFamily, SharedTracker> = families
        .iter()
        .map(|&family| (family, Arc::new(Mutex::new(ChangeTracker::new(family)))))
        .collect();
    let (node, node_writer) = reflector::store();
    let service_events = watcher(
        Api::<Service>::all(client.clone()),
        watcher::Config::default()
            .labels(&convert::service_selector())
            .page_size(LIST_PAGE_SIZE),
    );
    let slice_events = watcher(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default()
            .labels(&convert::slice_selector())
            .page_size(LIST_PAGE_SIZE),
    );
    let node_events = reflector::reflector(
        node_writer,
        watcher(
            Api::<Node>::all(client.clone()),
            watcher::Config::default().fields(&format!("metadata.name={node_name}")),
        ),
    );
    let (cidr_store, cidr_events) = if service_cidrs {
        let (store, writer) = reflector::store();
        let events = reflector::reflector(
            writer,
            watcher(Api::<ServiceCIDR>::all(client), watcher::Config::default()),
        );
        (Some(store), Some(events))
    } else {
        (None, None)
    };
    let run = {
        let dirty = Arc::clone(&dirty);
        let trackers = trackers.clone();
        async move {
            let on_service = {
                let trackers = trackers.clone();
                move |event| record_in_every_family(&trackers, event, ChangeTracker::record_service)
            };
            let on_slice = move |event| {
                let changed = record_in_every_family(&trackers, event, ChangeTracker::record_slice);
                if changed {
                    metrics.endpoints_changes.inc();
                }
                changed
            };
            let mut node_changes = NodeChanges::default();
            let on_node = move |event| node_changes.record(event);
            // The same for the ServiceCIDRs: each sync reads the reflector's CIDRs again.
            let on_service_cidr = |event: watcher::Event<ServiceCIDR>| {
                !matches!(event, watcher::Event::Init | watcher::Event::InitApply(_))
            };
            let service_cidrs = {
                let dirty = Arc::clone(&dirty);
                async move {
                    match cidr_events {
                        Some(events) => drive(events, dirty, on_service_cidr).await,
                        None => std::future::pending().await,
                    }
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = drive(service_events, Arc::clone(&dirty), on_service) => {}
                () = drive(slice_events, Arc::clone(&dirty), on_slice) => {}
                () = service_cidrs => {}
                () = drive(node_events, dirty, on_node) => {}
            }
        }
    };
    (
        Observed {
            trackers,
            node,
            service_cidrs: cidr_store,
        },
        run,
    )
}

/// Which events of this node's Node change what a sync reads of it
/// ([`convert::SyncedNodeFields`]). Only those start a sync, as kube-proxy's node handler
/// syncs only for changed labels: the kubelet writes the Node's status every few seconds,
/// and a sync for each would hold the next endpoint change back by the min sync period.
#[derive(Debug, Default)]
struct NodeChanges {
    /// What the last event left in the store; `None`: no Node.
    current: Option<convert::SyncedNodeFields>,
    /// What a relist in progress found; the store takes it at `InitDone`.
    relisted: Option<convert::SyncedNodeFields>,
}

impl NodeChanges {
    /// True when `event` changed what a sync reads.
    fn record(&mut self, event: watcher::Event<Node>) -> bool {
        let now = match event {
            watcher::Event::Init => {
                self.relisted = None;
                return false;
            }
            watcher::Event::InitApply(node) => {
                self.relisted = Some(convert::SyncedNodeFields::of(&node));
                return false;
            }
            watcher::Event::InitDone => self.relisted.take(),
            watcher::Event::Apply(node) => Some(convert::SyncedNodeFields::of(&node)),
            watcher::Event::Delete(_) => None,
        };
        let changed = now != self.current;
        self.current = now;
        changed
    }
}

/// Hands `event` to the tracker of every family (a copy to all but the last, so a node
/// proxy of one family copies nothing); true when it changed something in any.
fn record_in_every_family<E: Clone>(
    trackers: &BTreeMap<IpFamily, SharedTracker>,
    event: E,
    record: impl Fn(&mut ChangeTracker, E) -> bool,
) -> bool {
    let mut others = trackers.values();
    let Some(last) = others.next_back() else {
        return false;
    };
    let mut changed = false;
    for tracker in others {
        changed |= record(&mut change_tracker::lock(tracker), event.clone());
    }
    record(&mut change_tracker::lock(last), event) || changed
}

/// Whether the API server serves `networking.k8s.io/v1` ServiceCIDRs (Kubernetes 1.33 and
/// later, where kube-proxy's MultiCIDRServiceAllocator gate is on by default; kube-proxy
/// watches them when its gate is on), asked once at start: a server upgraded under a
/// running proxy is followed after a restart. A failing server is asked again for a
/// while; when it keeps failing, the answer is no and `--service-cluster-ip-range` stays.
pub async fn serves_service_cidrs(client: &Client) -> bool {
    const ATTEMPTS: u32 = 5;
    for attempt in 1..=ATTEMPTS {
        match client
            .list_api_group_resources("networking.k8s.io/v1")
            .await
        {
            Ok(served) => return served.resources.iter().any(|r| r.name == "servicecidrs"),
            // No such group version at all (an old server, or one without networking).
            Err(kube::Error::Api(status)) if status.code == 404 => return false,
            Err(error) if attempt < ATTEMPTS => {
                tracing::warn!(%error, attempt, "discovering networking.k8s.io/v1 failed; retrying");
                tokio::time::sleep(Duration::from_secs(u64::from(attempt))).await;
            }
            Err(error) => {
                tracing::warn!(%error, "discovering networking.k8s.io/v1 failed: ServiceCIDRs are not watched, --service-cluster-ip-range stays");
            }
        }
    }
    false
}

/// This node's primary IP and pod CIDR of each of `families` from its Node object, read
/// once at start as kube-proxy reads them (a change needs a restart, as there). A failing
/// API server is asked again for a while; a Node that does not exist or has no address of
/// a family gives `None` for it, logged: the LB IPs are then never allowed as their own
/// sources, and `primary` node ports are served on every address.
pub async fn node_facts(
    client: Client,
    node_name: &str,
    families: &[IpFamily],
) -> BTreeMap<IpFamily, convert::NodeFacts> {
    const ATTEMPTS: u32 = 5;
    let unknown = || {
        families
            .iter()
            .map(|&family| (family, convert::NodeFacts::default()))
            .collect()
    };
    let nodes = Api::<Node>::all(client);
    for attempt in 1..=ATTEMPTS {
        match nodes.get_opt(node_name).await {
            Ok(Some(node)) => {
                let facts = families
                    .iter()
                    .map(|&family| (family, convert::NodeFacts::of(&node, family)))
                    .collect::<BTreeMap<_, _>>();
                for (family, facts) in &facts {
                    if facts.ip.is_none() {
                        tracing::warn!(node_name, %family, "the Node has no InternalIP or ExternalIP of this family");
                    }
                }
                return facts;
            }
            Ok(None) => {
                tracing::warn!(node_name, "no Node of this name: its IP is unknown");
                return unknown();
            }
            Err(error) if attempt < ATTEMPTS => {
                tracing::warn!(node_name, %error, attempt, "reading the Node failed; retrying");
                tokio::time::sleep(Duration::from_secs(u64::from(attempt))).await;
            }
            Err(error) => {
                tracing::warn!(node_name, %error, "reading the Node failed: its IP is unknown");
            }
        }
    }
    unknown()
}

/// Consume one watch stream, handing each event to `record` and notifying `dirty` when it
/// says something changed; watch errors are retried with kube-runtime's default backoff.
async fn drive<K, S>(
    events: S,
    dirty: Arc<Notify>,
    mut record: impl FnMut(watcher::Event<K>) -> bool,
) where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let events = events.default_backoff();
    futures::pin_mut!(events);
    while let Some(event) = events.next().await {
        match event {
            Ok(event) => {
                if record(event) {
                    dirty.notify_one();
                }
            }
            Err(error) => {
                tracing::warn!(kind = K::kind(&()).as_ref(), %error, "watch failed; retrying")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeSpec, NodeStatus, Taint};
    use kube::api::ObjectMeta;

    use super::*;

    fn node(zone: Option<&str>, taints: &[&str], heartbeat: &str) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("node-1".into()),
                labels: zone.map(|zone| [(convert::ZONE_LABEL.to_owned(), zone.to_owned())].into()),
                resource_version: Some(heartbeat.into()),
                ..ObjectMeta::default()
            },
            spec: Some(NodeSpec {
                taints: Some(
                    taints
                        .iter()
                        .map(|key| Taint {
                            key: (*key).into(),
                            effect: "NoSchedule".into(),
                            ..Taint::default()
                        })
                        .collect(),
                ),
                ..NodeSpec::default()
            }),
            status: Some(NodeStatus::default()),
        }
    }

    #[test]
    fn only_a_change_of_the_zone_or_of_leaving_starts_a_sync() {
        let mut changes = NodeChanges::default();
        let leaving = tandem_common::TAINT_TO_BE_DELETED_BY_CLUSTER_AUTOSCALER;
        assert!(!changes.record(watcher::Event::Init));
        assert!(!changes.record(watcher::Event::InitApply(node(Some("a"), &[], "1"))));
        assert!(changes.record(watcher::Event::InitDone), "the first list");
        // The kubelet's status writes, and taints that do not make it leave.
        assert!(!changes.record(watcher::Event::Apply(node(Some("a"), &[], "2"))));
        let cordoned = node(Some("a"), &["node.kubernetes.io/unschedulable"], "3");
        assert!(!changes.record(watcher::Event::Apply(cordoned)));
        assert!(changes.record(watcher::Event::Apply(node(Some("b"), &[], "4"))));
        assert!(changes.record(watcher::Event::Apply(node(Some("b"), &[leaving], "5"))));
        // A relist that finds the same Node changes nothing; one that finds none does.
        assert!(!changes.record(watcher::Event::Init));
        assert!(!changes.record(watcher::Event::InitApply(node(Some("b"), &[leaving], "6"))));
        assert!(!changes.record(watcher::Event::InitDone));
        assert!(!changes.record(watcher::Event::Init));
        assert!(changes.record(watcher::Event::InitDone));
        assert!(changes.record(watcher::Event::Apply(node(None, &[], "7"))));
        assert!(changes.record(watcher::Event::Delete(node(None, &[], "8"))));
    }

    /// A client whose server answers every request with `status` and `body`.
    fn answering(status: u16, body: serde_json::Value) -> Client {
        let service = tower::service_fn(move |_: axum::http::Request<kube::client::Body>| {
            let body = body.to_string().into_bytes();
            async move {
                axum::http::Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(kube::client::Body::from(body))
            }
        });
        Client::new(service, "default")
    }

    fn resource_list(names: &[&str]) -> serde_json::Value {
        let resources: Vec<serde_json::Value> = names
            .iter()
            .map(|name| {
                serde_json::json!({"name": name, "singularName": "", "namespaced": false,
                    "kind": "X", "verbs": ["get", "list", "watch"]})
            })
            .collect();
        serde_json::json!({"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": "networking.k8s.io/v1", "resources": resources})
    }

    #[tokio::test]
    async fn service_cidrs_are_watched_only_where_discovery_lists_them() {
        let served = answering(200, resource_list(&["servicecidrs", "servicecidrs/status"]));
        assert!(serves_service_cidrs(&served).await);
        // k3s v1.21's networking.k8s.io/v1: no ServiceCIDRs, the flag stays.
        let k3s_v1_21 = answering(
            200,
            resource_list(&[
                "ingressclasses",
                "ingresses",
                "ingresses/status",
                "networkpolicies",
            ]),
        );
        assert!(!serves_service_cidrs(&k3s_v1_21).await);
        let not_found = serde_json::json!({"kind": "Status", "apiVersion": "v1",
            "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"});
        assert!(!serves_service_cidrs(&answering(404, not_found)).await);
    }
}
