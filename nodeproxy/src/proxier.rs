//! Wiring: reflectors on Services, EndpointSlices and this node's Node feed a sync loop
//! that coalesces changes (`--min-sync-period`), resyncs periodically (`--sync-period`)
//! and applies the ruleset, health-check servers and conntrack clean-up.

use std::collections::HashSet;
use std::fmt::Debug;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tandem_proxy_rules::health::health_check_services;
use tandem_proxy_rules::model::NodeConfig;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::change_tracker::{self, ChangeTracker, Changes, SharedTracker};
use crate::conntrack;
use crate::convert;
use crate::datapath::{DataPath, ReadBack};
use crate::healthcheck::{NodeHealth, ServiceHealthServers};
use crate::metrics::{Metrics, SyncLabels, SyncResult};

#[derive(Debug, Clone)]
pub struct ProxierConfig {
    pub node: NodeConfig,
    pub sync_period: Duration,
    pub min_sync_period: Duration,
}

/// The observed cluster, kept current by [`watch`]: Services and EndpointSlices in the
/// change tracker, this node's Node in a reflector store.
#[derive(Clone)]
pub struct Observed {
    pub tracker: SharedTracker,
    pub node: Store<Node>,
}

impl Observed {
    /// The state of every Service and EndpointSlice held, joined from scratch, plus the
    /// values left out; joined after the tracker lock is released, so the watches are
    /// not held up.
    pub fn joined(&self) -> convert::Conversion {
        let snapshot = change_tracker::lock(&self.tracker).snapshot();
        snapshot.joined()
    }

    pub fn node_draining(&self) -> bool {
        self.node
            .state()
            .iter()
            .any(|node| convert::node_is_draining(node))
    }

    /// Wait until every watch delivered its first full list (or `shutdown`); false when
    /// the watches ended first.
    pub async fn wait_until_listed(&self, dirty: &Notify) -> bool {
        if self.node.wait_until_ready().await.is_err() {
            return false;
        }
        loop {
            // Register before checking, so a list finished in between is not missed.
            let notified = dirty.notified();
            if change_tracker::lock(&self.tracker).listed() {
                // The permit this wait may have consumed stands for changes to sync.
                dirty.notify_one();
                return true;
            }
            notified.await;
        }
    }
}

/// Start the watches; `dirty` is notified whenever a change waits for a sync. The
/// returned future runs them until `shutdown`. As kube-proxy does, Services another proxy
/// owns (`service.kubernetes.io/service-proxy-name`) and headless ones are not watched.
pub fn watch(
    client: Client,
    node_name: &str,
    dirty: Arc<Notify>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> (Observed, impl Future<Output = ()> + use<>) {
    let tracker: SharedTracker = Arc::new(Mutex::new(ChangeTracker::default()));
    let (node, node_writer) = reflector::store();
    let service_events = watcher(
        Api::<Service>::all(client.clone()),
        watcher::Config::default().labels(&convert::service_selector()),
    );
    let slice_events = watcher(
        Api::<EndpointSlice>::all(client.clone()),
        watcher::Config::default().labels(&convert::slice_selector()),
    );
    let node_events = reflector::reflector(
        node_writer,
        watcher(
            Api::<Node>::all(client),
            watcher::Config::default().fields(&format!("metadata.name={node_name}")),
        ),
    );
    let run = {
        let dirty = Arc::clone(&dirty);
        let tracker = Arc::clone(&tracker);
        async move {
            let on_service = {
                let tracker = Arc::clone(&tracker);
                move |event| change_tracker::lock(&tracker).record_service(event)
            };
            let on_slice = move |event| {
                let changed = change_tracker::lock(&tracker).record_slice(event);
                if changed {
                    metrics.endpoints_changes.inc();
                }
                changed
            };
            // The Node only feeds /healthz, which each sync refreshes.
            let on_node = |event: watcher::Event<Node>| {
                !matches!(event, watcher::Event::Init | watcher::Event::InitApply(_))
            };
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = drive(service_events, Arc::clone(&dirty), on_service) => {}
                () = drive(slice_events, Arc::clone(&dirty), on_slice) => {}
                () = drive(node_events, dirty, on_node) => {}
            }
        }
    };
    (Observed { tracker, node }, run)
}

/// This node's primary IP from its Node object, read once at start as kube-proxy reads
/// it (a change needs a restart, as there). A failing API server is asked again for a
/// while; a Node that does not exist or has no IPv4 address gives `None`, logged: the LB
/// IPs are then never allowed as their own sources, and `primary` node ports are served
/// on every address.
pub async fn node_ip(client: Client, node_name: &str) -> Option<Ipv4Addr> {
    const ATTEMPTS: u32 = 5;
    let nodes = Api::<Node>::all(client);
    for attempt in 1..=ATTEMPTS {
        match nodes.get_opt(node_name).await {
            Ok(Some(node)) => {
                let ip = convert::node_primary_ip(&node);
                if ip.is_none() {
                    tracing::warn!(node_name, "the Node has no IPv4 InternalIP or ExternalIP");
                }
                return ip;
            }
            Ok(None) => {
                tracing::warn!(node_name, "no Node of this name: its IP is unknown");
                return None;
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
    None
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

/// How long after the previous sync the next may start: the min sync period, doubled
/// per consecutive failure up to the sync period, so a rule the kernel keeps rejecting
/// does not turn into a full rewrite every second.
pub fn retry_delay(config: &ProxierConfig, failures: u32) -> Duration {
    let backoff = config
        .min_sync_period
        .saturating_mul(1u32.checked_shl(failures.min(16)).unwrap_or(u32::MAX));
    backoff.min(config.sync_period.max(config.min_sync_period))
}

/// The sync loop and what it drives.
pub struct Proxier {
    pub config: ProxierConfig,
    /// The desired rules, kept current one changed Service port at a time, and their writer.
    pub datapath: DataPath,
    pub metrics: Metrics,
    pub node_health: Arc<NodeHealth>,
    pub health_servers: ServiceHealthServers,
    /// Skipped values already logged, so each is warned about once, not every sync.
    reported: HashSet<convert::Skipped>,
    /// Changes taken but not applied yet (the apply failed): their conntrack clean-up and
    /// latency wait for the next successful sync.
    unapplied: Option<Changes>,
}

impl Proxier {
    pub fn new(
        config: ProxierConfig,
        datapath: DataPath,
        metrics: Metrics,
        node_health: Arc<NodeHealth>,
        health_servers: ServiceHealthServers,
    ) -> Self {
        // From here on the gauges follow the syncs that change something.
        datapath.record_size(&metrics);
        Self {
            config,
            datapath,
            metrics,
            node_health,
            health_servers,
            reported: HashSet::new(),
            unapplied: None,
        }
    }

    /// Run until `shutdown`: wait for the first full list of every watch, then sync on
    /// change (at most once per `min_sync_period`) and every `sync_period`, when the
    /// incremental ruleset is also checked against a full rebuild and the kernel's rules
    /// are read back, beside the loop, to repair what someone else changed (as kube-proxy
    /// v1.21's rewrite of everything each period did). Rules stay in place on shutdown, as
    /// with kube-proxy, so traffic keeps flowing across restarts.
    pub async fn run(
        mut self,
        observed: Observed,
        dirty: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        tokio::select! {
            () = shutdown.cancelled() => return,
            listed = observed.wait_until_listed(&dirty) => if !listed {
                tracing::error!("watches ended before their first list");
                return;
            },
        }
        tracing::info!("initial lists received; syncing");
        let mut last_sync = Instant::now() - self.config.min_sync_period;
        // The first periodic sync comes one period after the first sync.
        let mut next_periodic = Instant::now() + self.config.sync_period;
        let mut failures = 0u32;
        // At most one read-back at a time; a period that finds one still running skips.
        let mut read_back: Option<JoinHandle<ReadBack>> = None;
        loop {
            let periodic = tokio::select! {
                () = shutdown.cancelled() => return,
                () = dirty.notified() => false,
                () = tokio::time::sleep_until(next_periodic) => true,
                done = async {
                    match read_back.as_mut() {
                        Some(task) => task.await,
                        None => std::future::pending().await,
                    }
                }, if read_back.is_some() => {
                    read_back = None;
                    match done {
                        Ok(read) => {
                            if self.datapath.take_read_back(read, &self.metrics) > 0 {
                                // Repaired by the next sync, as soon as one may run.
                                dirty.notify_one();
                            }
                        }
                        Err(error) => tracing::warn!(%error, "the read-back task failed"),
                    }
                    if self.datapath.wants_read_back() {
                        read_back = Some(self.datapath.start_read_back());
                    }
                    continue;
                }
            };
            // Coalesce bursts: changes arriving while we wait are folded into this sync.
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep_until(last_sync + retry_delay(&self.config, failures)) => {}
            }
            if periodic {
                next_periodic = Instant::now() + self.config.sync_period;
            }
            last_sync = Instant::now();
            if self.sync_once(&observed, periodic).await {
                failures = 0;
            } else {
                // Try again, backing off; the failed tables are rewritten in full.
                failures = failures.saturating_add(1);
                dirty.notify_one();
            }
            if (periodic || self.datapath.wants_read_back()) && read_back.is_none() {
                read_back = Some(self.datapath.start_read_back());
            }
        }
    }

    /// One sync: take the changes, rebuild the changed Service ports, apply the chains
    /// that differ, then the health-check servers and conntrack. With `full_check`, the
    /// incremental ruleset is compared with a full rebuild first. Returns false when
    /// applying the rules failed.
    #[tracing::instrument(skip_all)]
    pub async fn sync_once(&mut self, observed: &Observed, full_check: bool) -> bool {
        let started = std::time::Instant::now();
        // The check's objects are taken under the same lock as the changes, so the full
        // rebuild sees exactly what the incremental state now reflects.
        let (changes, snapshot) = {
            let mut tracker = change_tracker::lock(&observed.tracker);
            (tracker.take(), full_check.then(|| tracker.snapshot()))
        };
        self.report_skipped(&changes.skipped);
        let mut changed = self.datapath.update(&changes.current, &changes.ports);
        if let Some(snapshot) = snapshot {
            changed += self.check_against_full_rebuild(observed, &snapshot);
        }
        let ports = changes.ports.len();
        let changes = match self.unapplied.take() {
            Some(mut earlier) => {
                earlier.merge(changes);
                earlier
            }
            None => changes,
        };
        self.node_health.set_draining(observed.node_draining());
        if changed > 0 {
            self.datapath.record_size(&self.metrics);
        }
        let applied = self.datapath.apply(&self.metrics).await;
        // Only a changed port or a divergence (found by a periodic sync) alters the
        // tracker's state the health-check Services come from; periodic syncs also retry
        // ports that could not be bound.
        if ports > 0 || full_check {
            let health_services = {
                let tracker = change_tracker::lock(&observed.tracker);
                health_check_services(tracker.state(), &self.config.node)
            };
            self.health_servers.update(health_services).await;
        }
        if applied {
            if let Some(seen) = changes.first_slice_change {
                self.metrics
                    .network_programming
                    .observe(seen.elapsed().as_secs_f64());
            }
            conntrack::clear_stale(&changes.previous, &changes.current, self.config.node.family)
                .await;
            self.node_health.record_sync(Timestamp::now());
            self.metrics
                .last_sync_timestamp
                .set(Timestamp::now().as_millisecond() as f64 / 1000.0);
        } else {
            self.unapplied = Some(changes);
        }
        let elapsed = started.elapsed();
        self.metrics.sync_duration.observe(elapsed.as_secs_f64());
        if full_check {
            self.metrics
                .sync_full_duration
                .observe(elapsed.as_secs_f64());
        }
        let result = if applied {
            SyncResult::Success
        } else {
            SyncResult::Error
        };
        self.metrics
            .syncs
            .get_or_create(&SyncLabels { result })
            .inc();
        tracing::debug!(
            elapsed_ms = elapsed.as_millis() as u64,
            ports,
            changed,
            applied,
            "sync done"
        );
        applied
    }

    /// The safety net: a join and build from scratch of every entry in `snapshot`,
    /// compared with the incremental state and rules. A difference is a bug in the change
    /// tracking: it is logged and counted, and the rebuild replaces both the incremental
    /// rules and the tracker's state. Returns how many chains or objects differed.
    fn check_against_full_rebuild(
        &mut self,
        observed: &Observed,
        snapshot: &change_tracker::Snapshot,
    ) -> usize {
        let conversion = snapshot.joined();
        let Some(differing) = self
            .datapath
            .check_against_full_rebuild(&self.config.node, &conversion.state)
        else {
            return 0;
        };
        self.metrics.sync_divergence.inc();
        change_tracker::lock(&observed.tracker).replace_state(conversion.state);
        differing
    }

    /// Warns once about each value left out (they come again whenever their object
    /// changes).
    fn report_skipped(&mut self, skipped: &[convert::Skipped]) {
        for value in skipped {
            if self.reported.insert(value.clone()) {
                tracing::warn!(%value, "invalid value left out of the rules");
                self.metrics.skipped_values.inc();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_syncs_back_off_up_to_the_sync_period() {
        let config = ProxierConfig {
            node: NodeConfig::new("n", None),
            sync_period: Duration::from_secs(30),
            min_sync_period: Duration::from_secs(1),
        };
        let delays: Vec<u64> = (0..8).map(|f| retry_delay(&config, f).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(retry_delay(&config, u32::MAX), Duration::from_secs(30));
    }
}
