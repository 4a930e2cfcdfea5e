//! The sync loop: the changes [`crate::observe`] took in are coalesced
//! (`--min-sync-period`) and applied by each family's data path, with a periodic resync
//! (`--sync-period`), the health-check servers and the conntrack clean-up.
//!
//! As kube-proxy's dual-stack "meta proxier", a proxier per IP family of the cluster: each
//! has its own change tracker, fed the same watch events, and its own data path
//! (`iptables` or `ip6tables`). One loop syncs them in turn; a family whose objects did
//! not change has nothing to write. The health-check servers and `/healthz` are shared.
//!
//! The node's settings (its zone, and in the nftables mode the Service CIDRs of the
//! ServiceCIDR objects) are read again at every sync.

use std::collections::HashSet;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use jiff::Timestamp;
use tandem_nftables::kernel::Netlink;
use tandem_proxy_rules::conntrack::ServingEndpoints;
use tandem_proxy_rules::health::{health_check_services, merge_families};
use tandem_proxy_rules::model::NodeConfig;
use tokio::sync::Notify;
use tokio::task::{AbortHandle, JoinHandle};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::conntrack;
use crate::datapath::events::{self, DriftAlarm, Suspicion};
use crate::datapath::{DataPath, DataPathSize, ReadBack, RulesChanged};
use crate::healthcheck::{NodeHealth, ServiceHealthServers};
use crate::metrics::{Metrics, SyncLabels, SyncResult};
use crate::observe::change_tracker::{self, Changes, SharedTracker};
use crate::observe::convert;
use crate::observe::{NodeSettings, Observed};

#[derive(Debug, Clone)]
pub struct ProxierConfig {
    pub sync_period: Duration,
    pub min_sync_period: Duration,
    /// How often every family's rules are read back and compared with a full rebuild
    /// where the kernel announces ruleset changes; without announcements (iptables-legacy)
    /// that is done every `sync_period`.
    pub drift_check_period: Duration,
}

/// Why a sync runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncReason {
    /// Watched objects changed, or a read-back found something to repair.
    Change,
    /// The sync period passed: health-check ports that could not be bound are tried again.
    Period,
    /// The drift check is due: the incremental rules are also compared with a full rebuild
    /// (and every family's rules are read back beside the loop).
    FullCheck,
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

/// The proxier of one IP family: its settings, its rules and their writer, and the changes
/// it took but could not apply yet (their conntrack clean-up and latency wait for its
/// next successful sync).
pub struct FamilyProxier {
    pub node: NodeConfig,
    pub datapath: DataPath,
    unapplied: Option<Changes>,
    /// The kernel announced someone else's change to this family's rules: read them back
    /// (where it says, or everywhere) as soon as no read-back is running.
    drift_suspected: Option<Suspicion>,
}

impl FamilyProxier {
    pub fn new(node: NodeConfig, datapath: DataPath) -> Self {
        Self {
            node,
            datapath,
            unapplied: None,
            drift_suspected: None,
        }
    }

    /// The node's zone is now `zone`: when it changed, the data path chooses endpoints by
    /// the new one, and the ports with zone-hinted endpoints are rebuilt by the next
    /// [`FamilyProxier::sync`] (kube-proxy resyncs on a topology label change too).
    fn follow_zone(&mut self, zone: Option<&str>, tracker: &SharedTracker) {
        if self.node.zone.as_deref() == zone {
            return;
        }
        let zone = zone.map(str::to_owned);
        let ports = change_tracker::lock(tracker).mark_zone_hinted();
        tracing::info!(
            family = %self.node.family,
            from = ?self.node.zone,
            to = ?zone,
            ports,
            "the node's zone label is read anew; the endpoints of zone-hinted Service ports are chosen by it"
        );
        self.node.zone = zone.clone();
        self.datapath.set_zone(zone);
    }

    /// The family's Service CIDRs are now `of_family` (unchanged with `None`: the flag's
    /// stay): when they changed, the data path rewrites its cluster-IP check. Returns what
    /// that changed.
    fn follow_service_cidrs(&mut self, of_family: Option<Vec<IpNet>>) -> RulesChanged {
        let Some(of_family) = of_family.filter(|cidrs| *cidrs != self.node.service_cidrs) else {
            return RulesChanged::default();
        };
        tracing::info!(
            family = %self.node.family,
            from = ?self.node.service_cidrs,
            to = ?of_family,
            "the Service CIDRs are read anew from the ServiceCIDR objects; unallocated cluster IPs are dropped in them"
        );
        self.node.service_cidrs = of_family.clone();
        self.datapath.set_service_cidrs(of_family)
    }

    /// This family's part of a sync: take its changes, rebuild the changed Service ports
    /// (checked against a full rebuild with `full_check`), apply what differs, then clean
    /// up conntrack (the change's deletions, then the reconciler's pass over the kernel's
    /// UDP entries). Returns what it did.
    async fn sync(
        &mut self,
        tracker: &SharedTracker,
        settings: &NodeSettings,
        reason: SyncReason,
        metrics: &Metrics,
        skipped: &mut Vec<convert::Skipped>,
    ) -> FamilySync {
        let full_check = reason == SyncReason::FullCheck;
        self.follow_zone(settings.zone(), tracker);
        let mut changed = self.follow_service_cidrs(settings.service_cidrs_of(self.node.family));
        // The check's objects are taken under the same lock as the changes, so the full
        // rebuild sees exactly what the incremental state now reflects.
        let (changes, snapshot) = {
            let mut tracker = change_tracker::lock(tracker);
            (tracker.take(), full_check.then(|| tracker.snapshot()))
        };
        skipped.extend(changes.skipped.iter().cloned());
        changed += self.datapath.update(&changes.current, &changes.ports);
        let diverged = match snapshot {
            Some(snapshot) => self.check_against_full_rebuild(tracker, &snapshot, metrics),
            None => 0,
        };
        let ports = changes.ports.len();
        let mut changes = match self.unapplied.take() {
            Some(mut earlier) => {
                earlier.merge(changes);
                earlier
            }
            None => changes,
        };
        changes.drop_current_not_udp();
        let applied = self.datapath.apply(metrics).await;
        if applied {
            if let Some(seen) = changes.first_slice_change {
                metrics
                    .network_programming
                    .observe(seen.elapsed().as_secs_f64());
            }
            conntrack::clear_stale(&changes.previous, &changes.current, self.node.family).await;
            // From what the rules now hold: every change taken from the tracker is applied.
            // TCP black holes come only from rules that were missing, so an idle node's
            // periodic sync does not look for them: a change, a repair (a change sync) or
            // a start does.
            let serving = {
                let tracker = change_tracker::lock(tracker);
                match reason {
                    SyncReason::Period => ServingEndpoints::udp_of(tracker.state()),
                    SyncReason::Change | SyncReason::FullCheck => {
                        ServingEndpoints::of(tracker.state())
                    }
                }
            };
            conntrack::reconcile(serving, self.node.family, metrics).await;
        } else {
            self.unapplied = Some(changes);
        }
        FamilySync {
            ports,
            changed,
            diverged,
            applied,
        }
    }

    /// The safety net: a join and build from scratch of every entry in `snapshot`,
    /// compared with the incremental state and rules. A difference is a bug in the change
    /// tracking: it is logged and counted, and the rebuild replaces both the incremental
    /// rules and the tracker's state. Returns how many chains or objects differed.
    fn check_against_full_rebuild(
        &mut self,
        tracker: &SharedTracker,
        snapshot: &change_tracker::Snapshot,
        metrics: &Metrics,
    ) -> usize {
        let conversion = snapshot.joined();
        let Some(differing) = self
            .datapath
            .check_against_full_rebuild(&self.node, &conversion.state)
        else {
            return 0;
        };
        metrics.sync_divergence.inc();
        change_tracker::lock(tracker).replace_state(conversion.state);
        differing
    }
}

/// What one family's part of a sync did.
struct FamilySync {
    /// Service ports changed.
    ports: usize,
    /// What the change left for the apply to write.
    changed: RulesChanged,
    /// Chains (iptables) or objects (nftables) a full check found differing from a full
    /// rebuild, which then replaced the incremental rules.
    diverged: usize,
    applied: bool,
}

/// The sync loop and what it drives.
pub struct Proxier {
    pub config: ProxierConfig,
    /// One per IP family of the cluster, IPv4's first.
    pub families: Vec<FamilyProxier>,
    pub metrics: Metrics,
    pub node_health: Arc<NodeHealth>,
    pub health_servers: ServiceHealthServers,
    /// Skipped values already logged, so each is warned about once, not every sync.
    reported: HashSet<convert::Skipped>,
    /// A sync took a changed Service port since the last full check: the next one has a
    /// new incremental state to compare with a full rebuild.
    changes_since_full_check: bool,
}

/// The nf_tables ruleset generation of the node ([`Netlink::generation`]); `None` when it
/// cannot be read, which makes the next full check run.
async fn ruleset_generation() -> Option<u32> {
    let read = tokio::task::spawn_blocking(|| Netlink::open()?.generation()).await;
    match read {
        Ok(Ok(generation)) => Some(generation),
        Ok(Err(error)) => {
            tracing::warn!(%error, "cannot read the ruleset generation; the full check runs");
            None
        }
        Err(error) => {
            tracing::warn!(%error, "the ruleset generation task failed; the full check runs");
            None
        }
    }
}

/// The read-backs of one round, each family's on a task of its own.
struct ReadBacks {
    /// Collects them, one per family (`None`: not read this time).
    collected: JoinHandle<Vec<Option<ReadBack>>>,
    /// The families' reading tasks.
    reading: Vec<AbortHandle>,
}

impl ReadBacks {
    /// Ends the round unfinished: its reads stop where they are (a child such as
    /// `iptables-save` is killed) and nothing is compared.
    fn give_up(self) {
        for read in &self.reading {
            read.abort();
        }
        self.collected.abort();
    }
}

/// The most rounds of read-backs given up in a row for changes: a node whose changes never
/// pause still reads its rules back, at most that many changes later.
const MAX_READ_BACK_YIELDS: u32 = 2;

/// Whether the sync for a change gives up the read-backs in flight, to start them again
/// after it. Where the kernel announces nothing (iptables-legacy), a read-back is the
/// periodic one, and a change must not wait behind it: the kernel serialises reading and
/// replacing a legacy table, so an endpoint change that met an `iptables-save` of 10,000
/// Services took 30 % longer. Where changes are announced (`announced`), a read-back looks
/// where someone else changed our rules, and it goes on.
fn yields_to_change(reason: SyncReason, announced: bool, yielded_in_a_row: u32) -> bool {
    reason == SyncReason::Change && !announced && yielded_in_a_row < MAX_READ_BACK_YIELDS
}

impl Proxier {
    pub fn new(
        config: ProxierConfig,
        families: Vec<FamilyProxier>,
        metrics: Metrics,
        node_health: Arc<NodeHealth>,
        health_servers: ServiceHealthServers,
    ) -> Self {
        let proxier = Self {
            config,
            families,
            metrics,
            node_health,
            health_servers,
            reported: HashSet::new(),
            changes_since_full_check: false,
        };
        // From here on the gauges follow the syncs that change something.
        proxier.record_size();
        proxier
    }

    /// Run until `shutdown`: wait for the first full list of every watch, then sync on
    /// change (at most once per `min_sync_period`) and every `sync_period`. What someone
    /// else changed in our rules is repaired (as kube-proxy v1.21's rewrite of everything
    /// each period did) from read-backs of the kernel beside the loop: on the nf_tables
    /// backends the kernel announces each change, so a family is read back as soon as
    /// someone else changed its rules, and everything only every `drift_check_period`;
    /// on iptables-legacy everything every `sync_period`. Those full checks also compare
    /// the incremental ruleset with a full rebuild. Rules stay in place on shutdown, as
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
        let alarm = self.start_drift_alarm();
        let full_check_period = match alarm {
            Some(_) => self.config.drift_check_period,
            None => self.config.sync_period,
        };
        let now = Instant::now();
        let mut last_sync = now - self.config.min_sync_period;
        // The first periodic sync comes one period after the first sync.
        let mut next_periodic = now + self.config.sync_period;
        let mut next_full_check = now + full_check_period;
        // The kernel's ruleset generation when the last full check's read-backs began (on
        // the nf_tables backends): found again with no change taken since, nothing was
        // committed to any table and nothing new computed, so there is nothing to check.
        let mut checked_generation: Option<u32> = None;
        let mut failures = 0u32;
        // At most one round of read-backs at a time; a period that finds one still
        // running skips.
        let mut read_back: Option<ReadBacks> = None;
        // A round given up for a change's sync ([`yields_to_change`]) is owed: it starts
        // again after that sync. How many were given up in a row.
        let mut owed_read_back = false;
        let mut yielded_in_a_row = 0u32;
        loop {
            let reason = tokio::select! {
                () = shutdown.cancelled() => return,
                () = dirty.notified() => SyncReason::Change,
                () = tokio::time::sleep_until(next_periodic) => {
                    if Instant::now() >= next_full_check {
                        SyncReason::FullCheck
                    } else {
                        SyncReason::Period
                    }
                }
                () = async {
                    match alarm.as_deref() {
                        Some(alarm) => alarm.raised().await,
                        None => std::future::pending().await,
                    }
                } => {
                    if let Some(alarm) = alarm.as_deref() {
                        for family in &mut self.families {
                            if let Some(suspicion) = alarm.take(family.node.family) {
                                family
                                    .drift_suspected
                                    .get_or_insert_default()
                                    .merge(suspicion);
                            }
                        }
                    }
                    if read_back.is_none() && self.wants_read_back() {
                        read_back = Some(self.start_read_backs(false));
                    }
                    continue;
                }
                done = async {
                    match read_back.as_mut() {
                        Some(round) => (&mut round.collected).await,
                        None => std::future::pending().await,
                    }
                }, if read_back.is_some() => {
                    read_back = None;
                    yielded_in_a_row = 0;
                    match done {
                        Ok(reads) => {
                            if self.take_read_backs(reads) > 0 {
                                // Repaired by the next sync, as soon as one may run.
                                dirty.notify_one();
                            }
                        }
                        Err(error) => tracing::warn!(%error, "the read-back task failed"),
                    }
                    if self.wants_read_back() {
                        read_back = Some(self.start_read_backs(false));
                    }
                    continue;
                }
            };
            // Coalesce bursts: changes arriving while we wait are folded into this sync.
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep_until(last_sync + retry_delay(&self.config, failures)) => {}
            }
            let now = Instant::now();
            if reason != SyncReason::Change {
                next_periodic = now + self.config.sync_period;
            }
            if reason == SyncReason::FullCheck {
                next_full_check = now + full_check_period;
            }
            let reason = match reason {
                SyncReason::FullCheck
                    if alarm.is_some()
                        && !self.changes_since_full_check
                        && checked_generation.is_some()
                        && ruleset_generation().await == checked_generation =>
                {
                    tracing::debug!(
                        generation = checked_generation,
                        "full check skipped: no table was changed and no change taken since the last"
                    );
                    self.metrics.full_checks_skipped.inc();
                    SyncReason::Period
                }
                reason => reason,
            };
            if let Some(round) =
                read_back.take_if(|_| yields_to_change(reason, alarm.is_some(), yielded_in_a_row))
            {
                round.give_up();
                owed_read_back = true;
                yielded_in_a_row += 1;
                self.metrics.readback_yields.inc();
                tracing::debug!(
                    in_a_row = yielded_in_a_row,
                    "the read-back gives way to a change; it starts again after the sync"
                );
            }
            last_sync = now;
            if self.sync_once(&observed, reason).await {
                failures = 0;
            } else {
                // Try again, backing off; the failed tables are rewritten in full.
                failures = failures.saturating_add(1);
                dirty.notify_one();
            }
            let full_check = reason == SyncReason::FullCheck;
            let everything = full_check || owed_read_back;
            if (everything || self.wants_read_back()) && read_back.is_none() {
                if full_check && alarm.is_some() {
                    checked_generation = ruleset_generation().await;
                }
                owed_read_back = false;
                read_back = Some(self.start_read_backs(everything));
            }
        }
    }

    /// Listens to the kernel's announcements of ruleset changes for the families whose
    /// data path is on an nf_tables backend (all or none: one backend serves both).
    /// `None` without any, or when the socket cannot be opened: every family is then read
    /// back every sync period.
    fn start_drift_alarm(&self) -> Option<Arc<DriftAlarm>> {
        let watched: Option<Vec<_>> = self
            .families
            .iter()
            .map(|family| Some((family.node.family, family.datapath.written()?)))
            .collect();
        let watched = watched.filter(|watched| !watched.is_empty())?;
        match events::start(watched, self.metrics.clone()) {
            Ok(alarm) => {
                tracing::info!(
                    period = ?self.config.drift_check_period,
                    "someone else's changes to our rules are learned from the kernel's announcements; everything is read back once per drift check period"
                );
                Some(alarm)
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen to ruleset announcements; reading every rule back each sync period instead");
                None
            }
        }
    }

    /// True when a family's read-back should start now rather than at the next period.
    fn wants_read_back(&self) -> bool {
        self.families
            .iter()
            .any(|f| f.drift_suspected.is_some() || f.datapath.wants_read_back())
    }

    /// Starts reading back the rules of every family (`all`), or of those that want it
    /// now, each on a task of its own; the returned task collects them. A family read
    /// back only for an announced change is read where the change was, when the
    /// announcements name the place.
    fn start_read_backs(&mut self, all: bool) -> ReadBacks {
        let reads: Vec<Option<JoinHandle<ReadBack>>> = self
            .families
            .iter_mut()
            .map(|family| {
                let suspected = family.drift_suspected.take();
                let everywhere = all || family.datapath.wants_read_back();
                let only = match suspected {
                    _ if everywhere => None,
                    None => return None,
                    Some(suspicion) if suspicion.everywhere => None,
                    Some(suspicion) => Some(suspicion.chains),
                };
                Some(family.datapath.start_read_back(only))
            })
            .collect();
        let reading = reads
            .iter()
            .flatten()
            .map(JoinHandle::abort_handle)
            .collect();
        let collected = tokio::spawn(async move {
            let mut done = Vec::with_capacity(reads.len());
            for read in reads {
                done.push(match read {
                    Some(task) => task
                        .await
                        .inspect_err(|error| tracing::warn!(%error, "the read-back task failed"))
                        .ok(),
                    None => None,
                });
            }
            done
        });
        ReadBacks { collected, reading }
    }

    /// Compares each finished read-back with what its family wrote; returns how many
    /// objects are to be repaired.
    fn take_read_backs(&mut self, reads: Vec<Option<ReadBack>>) -> usize {
        self.families
            .iter_mut()
            .zip(reads)
            .filter_map(|(family, read)| Some(family.datapath.take_read_back(read?, &self.metrics)))
            .sum()
    }

    /// One sync: each family's part in turn (take its changes, rebuild the changed Service
    /// ports, apply the chains that differ, clean up conntrack), then the health-check
    /// servers. For a full check, each incremental ruleset is compared with a full
    /// rebuild first. Returns false when applying some family's rules failed.
    #[tracing::instrument(skip_all)]
    pub async fn sync_once(&mut self, observed: &Observed, reason: SyncReason) -> bool {
        let full_check = reason == SyncReason::FullCheck;
        let started = std::time::Instant::now();
        let (mut ports, mut changed, mut diverged, mut applied) =
            (0, RulesChanged::default(), 0, true);
        let mut settings = observed.node_settings();
        let mut skipped = std::mem::take(&mut settings.skipped);
        for family in &mut self.families {
            let Some(tracker) = observed.trackers.get(&family.node.family) else {
                continue;
            };
            let done = family
                .sync(tracker, &settings, reason, &self.metrics, &mut skipped)
                .await;
            ports += done.ports;
            changed += done.changed;
            diverged += done.diverged;
            applied &= done.applied;
        }
        self.report_skipped(&skipped);
        // A full check compares every change taken so far; any sync for a change (a
        // Service, a slice, the Node, a ServiceCIDR) may have taken one.
        self.changes_since_full_check = !full_check
            && (self.changes_since_full_check || reason == SyncReason::Change || ports > 0);
        if !changed.is_empty() || diverged > 0 {
            self.record_size();
        }
        self.node_health.set_draining(observed.node_draining());
        // Only a changed port or a divergence (found by a full check) alters the trackers'
        // state the health-check Services come from; periodic syncs also retry ports that
        // could not be bound.
        if ports > 0 || reason != SyncReason::Change {
            let health_services = merge_families(self.families.iter().filter_map(|family| {
                let tracker = observed.trackers.get(&family.node.family)?;
                Some(health_check_services(
                    change_tracker::lock(tracker).state(),
                    &family.node,
                ))
            }));
            self.health_servers.update(health_services).await;
        }
        if applied {
            self.node_health.record_sync(Timestamp::now());
            self.metrics
                .last_sync_timestamp
                .set(Timestamp::now().as_millisecond() as f64 / 1000.0);
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
            chains = changed.chains,
            operations = changed.operations,
            ports_rebuilt = changed.ports_rebuilt,
            diverged,
            applied,
            "sync done"
        );
        applied
    }

    /// The size gauges: the rules of every family together.
    fn record_size(&self) {
        let size = self
            .families
            .iter()
            .map(|family| family.datapath.size())
            .fold(DataPathSize::default(), |total, size| total + size);
        size.record(&self.metrics);
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
    fn only_an_unannounced_read_back_gives_way_to_a_change_and_not_forever() {
        use SyncReason::{Change, FullCheck, Period};
        assert!(yields_to_change(Change, false, 0));
        assert!(yields_to_change(Change, false, MAX_READ_BACK_YIELDS - 1));
        assert!(!yields_to_change(Change, false, MAX_READ_BACK_YIELDS));
        assert!(
            !yields_to_change(Change, true, 0),
            "a suspected change is read"
        );
        for reason in [Period, FullCheck] {
            assert!(!yields_to_change(reason, false, 0), "{reason:?}");
        }
    }

    #[test]
    fn failed_syncs_back_off_up_to_the_sync_period() {
        let config = ProxierConfig {
            sync_period: Duration::from_secs(30),
            min_sync_period: Duration::from_secs(1),
            drift_check_period: Duration::from_secs(3600),
        };
        let delays: Vec<u64> = (0..8).map(|f| retry_delay(&config, f).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(retry_delay(&config, u32::MAX), Duration::from_secs(30));
    }
}
