//! The node proxy's Prometheus metrics and the `/metrics` router.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use axum::Router;
use axum::routing::get;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tandem_common::IpFamily;
use tandem_proxy_rules::ruleset::Table;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
pub enum TableLabel {
    Filter,
    Nat,
    Mangle,
}

impl TableLabel {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "filter" => Some(TableLabel::Filter),
            "nat" => Some(TableLabel::Nat),
            "mangle" => Some(TableLabel::Mangle),
            _ => None,
        }
    }
}

impl From<Table> for TableLabel {
    fn from(table: Table) -> Self {
        match table {
            Table::Filter => TableLabel::Filter,
            Table::Nat => TableLabel::Nat,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct TableLabels {
    pub table: TableLabel,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
pub enum SyncResult {
    Success,
    Error,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SyncLabels {
    pub result: SyncResult,
}

/// What a repair of drift wrote again: a chain (iptables: one of ours, or a shared one
/// lacking our rules; nftables: a chain of table ip tandem), a set or map of table ip
/// tandem, a jump from a built-in chain, or a whole table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
pub enum RepairedObject {
    Chain,
    Set,
    Jump,
    Table,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RepairLabels {
    pub object: RepairedObject,
}

/// kube-proxy's `ip_family` label values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
pub enum FamilyLabel {
    IPv4,
    IPv6,
}

impl From<IpFamily> for FamilyLabel {
    fn from(family: IpFamily) -> Self {
        match family {
            IpFamily::V4 => FamilyLabel::IPv4,
            IpFamily::V6 => FamilyLabel::IPv6,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct FamilyLabels {
    pub ip_family: FamilyLabel,
}

impl FamilyLabels {
    pub fn of(family: IpFamily) -> Self {
        Self {
            ip_family: family.into(),
        }
    }
}

/// Everything the node proxy counts. Labels are bounded enums, never object names.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub sync_duration: Histogram,
    /// The periodic syncs, which also compare the rules with a full rebuild (kube-proxy's
    /// sync_full_proxy_rules_duration_seconds).
    pub sync_full_duration: Histogram,
    pub syncs: Family<SyncLabels, Counter>,
    pub restore_failures: Family<TableLabels, Counter>,
    pub rules: Family<TableLabels, Gauge>,
    pub chains: Family<TableLabels, Gauge>,
    pub last_sync_timestamp: Gauge<f64, AtomicU64>,
    pub endpoints_changes: Counter,
    pub skipped_values: Counter,
    /// Full rebuilds that found the incremental ruleset different: must stay 0.
    pub sync_divergence: Counter,
    /// EndpointSlice change seen → its rules applied (kube-proxy's
    /// network_programming_duration_seconds, measured from when the watch delivered it).
    pub network_programming: Histogram,
    pub nftables_failures: Counter,
    pub nftables_chains: Gauge,
    pub nftables_rules: Gauge,
    pub nftables_elements: Gauge,
    /// Changes someone else made to our rules, as the kernel announced them (nf_tables
    /// backends); each starts a read-back of that family at once.
    pub foreign_ruleset_changes: Counter,
    /// Full checks with nothing to check: no commit to any table and no change taken
    /// since the last one (nf_tables backends).
    pub full_checks_skipped: Counter,
    /// Objects someone else changed, found by a read-back and written again.
    pub sync_repairs: Family<RepairLabels, Counter>,
    /// The periodic read-back of the kernel, beside the sync loop.
    pub readback_duration: Histogram,
    pub readback_failures: Counter,
    /// Read-backs given up for a change's sync, and started again after it
    /// (iptables-legacy).
    pub readback_yields: Counter,
    /// Stale UDP conntrack entries the reconciler deleted (kube-proxy's
    /// conntrack_reconciler_deleted_entries_total).
    pub conntrack_reconciler_deleted: Family<FamilyLabels, Counter>,
    /// One run of the reconciler (kube-proxy's conntrack_reconciler_sync_duration_seconds).
    pub conntrack_reconciler_duration: Family<FamilyLabels, Histogram, fn() -> Histogram>,
    /// Runs that could not list the table, and deletions the kernel refused.
    pub conntrack_reconciler_failures: Family<FamilyLabels, Counter>,
}

/// A histogram of durations from 1 ms to about 65 s.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            sync_duration: seconds_histogram(),
            sync_full_duration: seconds_histogram(),
            syncs: Family::default(),
            restore_failures: Family::default(),
            rules: Family::default(),
            chains: Family::default(),
            last_sync_timestamp: Gauge::default(),
            endpoints_changes: Counter::default(),
            skipped_values: Counter::default(),
            sync_divergence: Counter::default(),
            network_programming: seconds_histogram(),
            nftables_failures: Counter::default(),
            nftables_chains: Gauge::default(),
            nftables_rules: Gauge::default(),
            nftables_elements: Gauge::default(),
            sync_repairs: Family::default(),
            readback_duration: seconds_histogram(),
            readback_failures: Counter::default(),
            readback_yields: Counter::default(),
            foreign_ruleset_changes: Counter::default(),
            full_checks_skipped: Counter::default(),
            conntrack_reconciler_deleted: Family::default(),
            conntrack_reconciler_duration: Family::new_with_constructor(seconds_histogram),
            conntrack_reconciler_failures: Family::default(),
        };
        let registry = registry.sub_registry_with_prefix("tandem_nodeproxy");
        registry.register(
            "sync_proxy_rules_duration_seconds",
            "Duration of one sync of the proxy rules",
            metrics.sync_duration.clone(),
        );
        registry.register(
            "sync_full_proxy_rules_duration_seconds",
            "Duration of one periodic sync, which also compares the rules with a full rebuild",
            metrics.sync_full_duration.clone(),
        );
        registry.register(
            "sync_proxy_rules",
            "Syncs of the proxy rules by result",
            metrics.syncs.clone(),
        );
        registry.register(
            "iptables_restore_failures",
            "iptables-restore runs that failed",
            metrics.restore_failures.clone(),
        );
        registry.register(
            "iptables_rules",
            "Rules programmed in our chains",
            metrics.rules.clone(),
        );
        registry.register(
            "iptables_chains",
            "Chains programmed",
            metrics.chains.clone(),
        );
        registry.register(
            "sync_proxy_rules_last_timestamp_seconds",
            "Unix time of the last successful sync",
            metrics.last_sync_timestamp.clone(),
        );
        registry.register(
            "endpoints_changes",
            "EndpointSlice changes seen",
            metrics.endpoints_changes.clone(),
        );
        registry.register(
            "skipped_values",
            "Invalid Service or EndpointSlice values left out of the rules",
            metrics.skipped_values.clone(),
        );
        registry.register(
            "sync_divergence",
            "Periodic full rebuilds that found the incrementally kept ruleset different",
            metrics.sync_divergence.clone(),
        );
        registry.register(
            "network_programming_duration_seconds",
            "From an EndpointSlice change reaching the node proxy to its rules being applied",
            metrics.network_programming.clone(),
        );
        registry.register(
            "nftables_transaction_failures",
            "nftables transactions the kernel refused (nftables mode)",
            metrics.nftables_failures.clone(),
        );
        registry.register(
            "nftables_chains",
            "Chains in table ip tandem (nftables mode)",
            metrics.nftables_chains.clone(),
        );
        registry.register(
            "nftables_rules",
            "Rules in table ip tandem (nftables mode)",
            metrics.nftables_rules.clone(),
        );
        registry.register(
            "sync_repairs",
            "Chains, sets, base jumps and tables someone else changed, found by the periodic read-back of the kernel and written again",
            metrics.sync_repairs.clone(),
        );
        registry.register(
            "sync_readback_duration_seconds",
            "Duration of the periodic read-back of our rules from the kernel (beside the sync loop)",
            metrics.readback_duration.clone(),
        );
        registry.register(
            "sync_readback_failures",
            "Periodic read-backs of our rules that failed",
            metrics.readback_failures.clone(),
        );
        registry.register(
            "sync_readback_yields",
            "Read-backs given up for a change's sync and started again after it (iptables-legacy)",
            metrics.readback_yields.clone(),
        );
        registry.register(
            "sync_foreign_ruleset_changes",
            "Changes someone else made to our rules, announced by the kernel (nf_tables backends)",
            metrics.foreign_ruleset_changes.clone(),
        );
        registry.register(
            "sync_full_checks_skipped",
            "Full checks skipped: nothing committed to any table and no change taken since the last (nf_tables backends)",
            metrics.full_checks_skipped.clone(),
        );
        registry.register(
            "nftables_set_elements",
            "Map and set elements written to table ip tandem (nftables mode)",
            metrics.nftables_elements.clone(),
        );
        registry.register(
            "conntrack_reconciler_deleted_entries",
            "Stale UDP conntrack entries and TCP black holes deleted by the conntrack reconciler",
            metrics.conntrack_reconciler_deleted.clone(),
        );
        registry.register(
            "conntrack_reconciler_sync_duration_seconds",
            "Duration of one run of the conntrack reconciler",
            metrics.conntrack_reconciler_duration.clone(),
        );
        registry.register(
            "conntrack_reconciler_failures",
            "Conntrack reconciler runs that could not list the table, and entry deletions the kernel refused",
            metrics.conntrack_reconciler_failures.clone(),
        );
        metrics
    }
}

/// `GET /metrics` in the OpenMetrics text format.
pub fn router(registry: Arc<Registry>) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let registry = Arc::clone(&registry);
            async move { tandem_common::http::metrics_response(&registry) }
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use tower::ServiceExt;

    #[tokio::test]
    async fn metrics_are_served_with_their_names() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics.sync_duration.observe(0.25);
        metrics
            .syncs
            .get_or_create(&SyncLabels {
                result: SyncResult::Error,
            })
            .inc();
        metrics
            .rules
            .get_or_create(&TableLabels {
                table: Table::Nat.into(),
            })
            .set(42);
        metrics
            .conntrack_reconciler_deleted
            .get_or_create(&FamilyLabels::of(IpFamily::V6))
            .inc_by(3);
        let response = router(Arc::new(registry))
            .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        let text = String::from_utf8(body.to_vec()).unwrap();
        assert!(
            text.contains("tandem_nodeproxy_sync_proxy_rules_duration_seconds_count 1"),
            "{text}"
        );
        assert!(
            text.contains("tandem_nodeproxy_sync_proxy_rules_total{result=\"Error\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("tandem_nodeproxy_iptables_rules{table=\"Nat\"} 42"),
            "{text}"
        );
        assert!(
            text.contains(
                "tandem_nodeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv6\"} 3"
            ),
            "{text}"
        );
    }
}
