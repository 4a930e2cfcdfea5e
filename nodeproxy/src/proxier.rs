//! Wiring: reflectors on Services, EndpointSlices and this node's Node feed a sync loop
//! that coalesces changes (`--min-sync-period`), resyncs periodically (`--sync-period`)
//! and applies the ruleset, health-check servers and conntrack clean-up.

use std::collections::HashSet;
use std::fmt::Debug;
use std::sync::Arc;
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
use tandem_proxy_rules::model::{NodeConfig, ProxyState};
use tandem_proxy_rules::ruleset::Ruleset;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::conntrack;
use crate::healthcheck::{NodeHealth, ServiceHealthServers};
use crate::k8s;
use crate::metrics::{Metrics, SyncLabels, SyncResult, TableLabel, TableLabels};
use crate::sync::{SyncError, Syncer};

#[derive(Debug, Clone)]
pub struct ProxierConfig {
    pub node: NodeConfig,
    pub sync_period: Duration,
    pub min_sync_period: Duration,
}

/// The observed cluster: reflector stores, kept current by [`Proxier::watch`].
#[derive(Clone)]
pub struct Observed {
    pub services: Store<Service>,
    pub slices: Store<EndpointSlice>,
    pub node: Store<Node>,
}

impl Observed {
    /// The state the rules are built from, plus the values that had to be left out.
    pub fn conversion(&self) -> k8s::Conversion {
        let services = self.services.state();
        let slices = self.slices.state();
        k8s::proxy_state(
            services.iter().map(AsRef::as_ref),
            slices.iter().map(AsRef::as_ref),
        )
    }

    pub fn node_draining(&self) -> bool {
        self.node
            .state()
            .iter()
            .any(|node| k8s::node_is_draining(node))
    }
}

/// Start the reflectors; `dirty` is notified on every change. The returned future runs
/// them until `shutdown`.
pub fn watch(
    client: Client,
    node_name: &str,
    dirty: Arc<Notify>,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> (Observed, impl Future<Output = ()> + use<>) {
    let (services, services_writer) = reflector::store();
    let (slices, slices_writer) = reflector::store();
    let (node, node_writer) = reflector::store();
    let service_events = reflector::reflector(
        services_writer,
        watcher(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
        ),
    );
    let slice_events = reflector::reflector(
        slices_writer,
        watcher(
            Api::<EndpointSlice>::all(client.clone()),
            watcher::Config::default().labels(k8s::SERVICE_NAME_LABEL),
        ),
    );
    let node_events = reflector::reflector(
        node_writer,
        watcher(
            Api::<Node>::all(client),
            watcher::Config::default().fields(&format!("metadata.name={node_name}")),
        ),
    );
    let endpoints_changes = metrics.endpoints_changes.clone();
    let run = {
        let dirty = Arc::clone(&dirty);
        async move {
            let on_slice = move || {
                endpoints_changes.inc();
            };
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = drive(service_events, Arc::clone(&dirty), || {}) => {}
                () = drive(slice_events, Arc::clone(&dirty), on_slice) => {}
                () = drive(node_events, dirty, || {}) => {}
            }
        }
    };
    (
        Observed {
            services,
            slices,
            node,
        },
        run,
    )
}

/// Consume one watch stream, marking the proxier dirty on every event; watch errors are
/// retried with kube-runtime's default backoff.
async fn drive<K, S>(events: S, dirty: Arc<Notify>, on_event: impl Fn())
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let events = events.default_backoff();
    futures::pin_mut!(events);
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::InitApply(_) | watcher::Event::Init) => {}
            Ok(_) => {
                on_event();
                dirty.notify_one();
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
    pub syncer: Syncer,
    pub metrics: Metrics,
    pub node_health: Arc<NodeHealth>,
    pub health_servers: ServiceHealthServers,
    /// Skipped values already logged, so each is warned about once, not every sync.
    reported: HashSet<k8s::Skipped>,
    /// The state of the previous successful sync, for conntrack clean-up.
    previous: ProxyState,
}

impl Proxier {
    pub fn new(
        config: ProxierConfig,
        syncer: Syncer,
        metrics: Metrics,
        node_health: Arc<NodeHealth>,
        health_servers: ServiceHealthServers,
    ) -> Self {
        Self {
            config,
            syncer,
            metrics,
            node_health,
            health_servers,
            reported: HashSet::new(),
            previous: ProxyState::default(),
        }
    }

    /// Run until `shutdown`: wait for the first full list of every watch, then sync on
    /// change (at most once per `min_sync_period`) and every `sync_period`. Rules stay in
    /// place on shutdown, as with kube-proxy, so traffic keeps flowing across restarts.
    pub async fn run(
        mut self,
        observed: Observed,
        dirty: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        let ready = async {
            observed.services.wait_until_ready().await?;
            observed.slices.wait_until_ready().await?;
            observed.node.wait_until_ready().await
        };
        tokio::select! {
            () = shutdown.cancelled() => return,
            result = ready => if let Err(error) = result {
                tracing::error!(%error, "watches ended before their first list");
                return;
            },
        }
        tracing::info!("initial lists received; syncing");
        let mut last_sync = Instant::now() - self.config.min_sync_period;
        let mut next_periodic = Instant::now();
        let mut failures = 0u32;
        loop {
            let periodic = tokio::select! {
                () = shutdown.cancelled() => return,
                () = dirty.notified() => false,
                () = tokio::time::sleep_until(next_periodic) => true,
            };
            // Coalesce bursts: changes arriving while we wait are folded into this sync.
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep_until(last_sync + retry_delay(&self.config, failures)) => {}
            }
            if periodic {
                next_periodic = Instant::now() + self.config.sync_period;
                if let Err(error) = self.syncer.canaries_present().await {
                    tracing::warn!(%error, "checking canary chains");
                }
            }
            last_sync = Instant::now();
            if self.sync_once(&observed).await {
                failures = 0;
            } else {
                // Try again, backing off; the failed tables are rewritten in full.
                failures = failures.saturating_add(1);
                dirty.notify_one();
            }
        }
    }

    /// One sync: build, apply, then the health-check servers and conntrack. Returns false
    /// when applying the rules failed.
    #[tracing::instrument(skip_all)]
    pub async fn sync_once(&mut self, observed: &Observed) -> bool {
        let started = std::time::Instant::now();
        let conversion = observed.conversion();
        self.report_skipped(&conversion.skipped);
        let state = conversion.state;
        let ruleset = tandem_proxy_rules::build(&state, &self.config.node);
        self.node_health.set_draining(observed.node_draining());
        let applied = self.apply(&ruleset).await;
        self.health_servers
            .update(health_check_services(&state, &self.config.node))
            .await;
        if applied {
            conntrack::clear_stale(&self.previous, &state).await;
            self.previous = state;
            self.node_health.record_sync(Timestamp::now());
            self.metrics
                .last_sync_timestamp
                .set(Timestamp::now().as_millisecond() as f64 / 1000.0);
        }
        let elapsed = started.elapsed();
        self.metrics.sync_duration.observe(elapsed.as_secs_f64());
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
            applied,
            "sync done"
        );
        applied
    }

    async fn apply(&mut self, ruleset: &Ruleset) -> bool {
        for table in crate::sync::TABLES {
            let labels = TableLabels {
                table: table.into(),
            };
            let rules = ruleset.table(table);
            self.metrics
                .chains
                .get_or_create(&labels)
                .set(rules.chains.len() as i64);
            self.metrics
                .rules
                .get_or_create(&labels)
                .set(rules.chains.values().map(Vec::len).sum::<usize>() as i64);
        }
        match self.syncer.sync(ruleset).await {
            Ok(tables) => {
                for done in tables {
                    tracing::info!(
                        table = done.table.as_str(),
                        full = done.full,
                        mode = ?done.mode,
                        chains_written = done.written_chains,
                        chains_deleted = done.deleted_chains,
                        rules = done.rules,
                        elapsed_ms = done.elapsed.as_millis() as u64,
                        "iptables-restore applied"
                    );
                }
                true
            }
            Err(error) => {
                if let SyncError::Restore { table, .. } = &error
                    && let Some(table) = TableLabel::from_name(table)
                {
                    self.metrics
                        .restore_failures
                        .get_or_create(&TableLabels { table })
                        .inc();
                }
                tracing::error!(%error, "applying iptables rules failed; the table is rewritten in full next sync");
                false
            }
        }
    }

    fn report_skipped(&mut self, skipped: &[k8s::Skipped]) {
        let current: HashSet<k8s::Skipped> = skipped.iter().cloned().collect();
        for value in current.difference(&self.reported) {
            tracing::warn!(%value, "invalid value left out of the rules");
            self.metrics.skipped_values.inc();
        }
        self.reported = current;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_syncs_back_off_up_to_the_sync_period() {
        let config = ProxierConfig {
            node: NodeConfig {
                node_name: "n".into(),
                cluster_cidr: None,
            },
            sync_period: Duration::from_secs(30),
            min_sync_period: Duration::from_secs(1),
        };
        let delays: Vec<u64> = (0..8).map(|f| retry_delay(&config, f).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(retry_delay(&config, u32::MAX), Duration::from_secs(30));
    }
}
