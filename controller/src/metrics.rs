//! Prometheus metrics of the controller. Every label is bounded: results, error categories
//! and cloud operations, never object names or error messages.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::provider::Operation;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CategoryLabels {
    pub category: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CloudCallLabels {
    pub operation: &'static str,
    pub outcome: &'static str,
}

/// Cloud-call counters; cloned into every provider.
#[derive(Debug, Clone, Default)]
pub struct CloudMetrics {
    calls: Family<CloudCallLabels, Counter>,
}

impl CloudMetrics {
    /// `outcome` is `success` or an error category.
    pub fn record(&self, operation: Operation, outcome: &'static str) {
        self.calls
            .get_or_create(&CloudCallLabels {
                operation: operation.as_str(),
                outcome,
            })
            .inc();
    }
}

#[derive(Debug, Clone)]
pub struct Metrics {
    pub reconciles: Family<ResultLabels, Counter>,
    pub errors: Family<CategoryLabels, Counter>,
    pub cloud: CloudMetrics,
    pub time_to_provision: Histogram,
    pub node_sync_latency: Histogram,
    pub orphans_collected: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            reconciles: Family::default(),
            errors: Family::default(),
            cloud: CloudMetrics::default(),
            // 0.25 s .. ~17 min.
            time_to_provision: Histogram::new(exponential_buckets(0.25, 2.0, 13)),
            // 10 ms .. ~80 s.
            node_sync_latency: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            orphans_collected: Counter::default(),
        }
    }
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        let sub = registry.sub_registry_with_prefix("tandem_controller");
        sub.register(
            "reconciles",
            "Service reconciles by result",
            metrics.reconciles.clone(),
        );
        sub.register(
            "reconcile_errors",
            "Failed Service reconciles by error category",
            metrics.errors.clone(),
        );
        sub.register(
            "cloud_calls",
            "Cloud API calls by operation and outcome",
            metrics.cloud.calls.clone(),
        );
        sub.register(
            "time_to_provision_seconds",
            "From Service creation to its load balancer serving",
            metrics.time_to_provision.clone(),
        );
        sub.register(
            "node_sync_latency_seconds",
            "From a node-set change to every load balancer updated",
            metrics.node_sync_latency.clone(),
        );
        sub.register(
            "orphans_collected",
            "Load balancers of this cluster deleted because their Service is gone",
            metrics.orphans_collected.clone(),
        );
        metrics
    }

    pub fn reconciled(&self, result: Result<(), &'static str>) {
        match result {
            Ok(()) => {
                self.reconciles
                    .get_or_create(&ResultLabels { result: "success" })
                    .inc();
            }
            Err(category) => {
                self.reconciles
                    .get_or_create(&ResultLabels { result: "error" })
                    .inc();
                self.errors
                    .get_or_create(&CategoryLabels { category })
                    .inc();
            }
        }
    }

    pub fn provisioned_after(&self, elapsed: Duration) {
        self.time_to_provision.observe(elapsed.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    #[test]
    fn metrics_encode_with_bounded_labels() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        m.reconciled(Ok(()));
        m.reconciled(Err("unavailable"));
        m.cloud.record(Operation::Create, "success");
        m.provisioned_after(Duration::from_secs(3));
        m.node_sync_latency.observe(0.2);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for needle in [
            "tandem_controller_reconciles_total{result=\"success\"} 1",
            "tandem_controller_reconcile_errors_total{category=\"unavailable\"} 1",
            "tandem_controller_cloud_calls_total{operation=\"create\",outcome=\"success\"} 1",
            "tandem_controller_time_to_provision_seconds_count 1",
            "tandem_controller_node_sync_latency_seconds_count 1",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
