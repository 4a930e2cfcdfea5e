//! Prometheus metrics of the controller. Every label is bounded: results, error categories
//! and cloud operations, never object names or error messages.

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::Store;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::plan::{Ownership, ownership};
use crate::provider::Operation;
use crate::spec::ClassFilter;
use crate::status::{CONDITION_TYPE, current_ingress};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CategoryLabels {
    pub category: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: &'static str,
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
    /// 1 while this replica holds the Lease (or runs without leader election).
    pub leader: Gauge,
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
            leader: Gauge::default(),
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
        sub.register(
            "leader_election_master_status",
            "1 while this replica is the leader that writes, 0 while it stands by",
            metrics.leader.clone(),
        );
        metrics
    }

    /// Registers the gauges read from the Service cache at each scrape.
    pub fn register_services(
        registry: &mut Registry,
        services: Store<Service>,
        classes: ClassFilter,
    ) {
        registry
            .sub_registry_with_prefix("tandem_controller")
            .register_collector(Box::new(ServiceStates { services, classes }));
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

/// Our LoadBalancer Services, served and pending.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct ServiceCounts {
    pub served: i64,
    pub pending: i64,
    /// How long the longest-pending Service has waited for its ingress (0 with none).
    pub longest_pending_seconds: f64,
}

/// Counts our Services (those the controller ensures). A pending one has no ingress; it
/// has waited since its `LoadBalancerReady` condition turned `False`, else since it was
/// created.
pub fn count_services<'a>(
    services: impl IntoIterator<Item = &'a Service>,
    classes: &ClassFilter,
    now: Timestamp,
) -> ServiceCounts {
    let mut counts = ServiceCounts::default();
    for svc in services {
        if ownership(svc, classes) != Ownership::Ensure {
            continue;
        }
        if !current_ingress(svc).is_empty() {
            counts.served += 1;
            continue;
        }
        counts.pending += 1;
        let not_ready_since = svc
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|c| {
                c.iter()
                    .find(|c| c.type_ == CONDITION_TYPE && c.status == "False")
            })
            .map(|c| c.last_transition_time.0)
            .or_else(|| svc.metadata.creation_timestamp.as_ref().map(|t| t.0));
        if let Some(since) = not_ready_since {
            let waited = now.duration_since(since).as_secs_f64().max(0.0);
            counts.longest_pending_seconds = counts.longest_pending_seconds.max(waited);
        }
    }
    counts
}

/// The Service gauges, computed from the watch cache when scraped (every replica has it
/// warm, so a standby reports the same as the leader).
#[derive(Debug)]
struct ServiceStates {
    services: Store<Service>,
    classes: ClassFilter,
}

impl Collector for ServiceStates {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let services = self.services.state();
        let counts = count_services(
            services.iter().map(AsRef::as_ref),
            &self.classes,
            Timestamp::now(),
        );
        let mut family = encoder.encode_descriptor(
            "load_balancer_services",
            "LoadBalancer Services of this controller by state (served: with an ingress; pending: without)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (state, count) in [("served", counts.served), ("pending", counts.pending)] {
            ConstGauge::new(count).encode(family.encode_family(&StateLabels { state })?)?;
        }
        let longest = ConstGauge::new(counts.longest_pending_seconds);
        longest.encode(encoder.encode_descriptor(
            "longest_pending_service_seconds",
            "How long the Service pending longest has waited for its ingress",
            None,
            longest.metric_type(),
        )?)?;
        Ok(())
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
        m.leader.set(1);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for needle in [
            "tandem_controller_reconciles_total{result=\"success\"} 1",
            "tandem_controller_reconcile_errors_total{category=\"unavailable\"} 1",
            "tandem_controller_cloud_calls_total{operation=\"create\",outcome=\"success\"} 1",
            "tandem_controller_time_to_provision_seconds_count 1",
            "tandem_controller_node_sync_latency_seconds_count 1",
            "tandem_controller_leader_election_master_status 1",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }

    fn lb(name: &str, created: i64) -> Service {
        let mut svc = crate::spec::tests::service(name);
        svc.metadata.creation_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                Timestamp::from_second(created).unwrap(),
            ));
        svc
    }

    #[test]
    fn services_are_counted_served_and_pending_with_the_longest_wait() {
        use k8s_openapi::api::core::v1::{LoadBalancerIngress, LoadBalancerStatus, ServiceStatus};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
        let classes = ClassFilter {
            class: "tandem.io/mockcloud".into(),
            claim_unclassed: true,
        };
        let mut served = lb("served", 0);
        served.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(vec![LoadBalancerIngress {
                    ip: Some("198.51.100.1".into()),
                    ..Default::default()
                }]),
            }),
            conditions: None,
        });
        let new = lb("new", 900);
        // Created long ago, pending since its condition turned False at 400.
        let mut lost = lb("lost", 100);
        lost.status = Some(ServiceStatus {
            load_balancer: None,
            conditions: Some(vec![Condition {
                type_: CONDITION_TYPE.into(),
                status: "False".into(),
                reason: "CloudError".into(),
                message: String::new(),
                observed_generation: None,
                last_transition_time: Time(Timestamp::from_second(400).unwrap()),
            }]),
        });
        let mut other = lb("cluster-ip", 0);
        other.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        let counts = count_services(
            [&served, &new, &lost, &other],
            &classes,
            Timestamp::from_second(1000).unwrap(),
        );
        assert_eq!(
            counts,
            ServiceCounts {
                served: 1,
                pending: 2,
                longest_pending_seconds: 600.0
            }
        );
    }

    #[test]
    fn service_gauges_encode_from_the_cache() {
        let (services, mut writer) = kube::runtime::reflector::store::<Service>();
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(lb("a", 0)));
        let mut registry = Registry::default();
        Metrics::register_services(
            &mut registry,
            services,
            ClassFilter {
                class: "tandem.io/mockcloud".into(),
                claim_unclassed: true,
            },
        );
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for needle in [
            "tandem_controller_load_balancer_services{state=\"pending\"} 1",
            "tandem_controller_load_balancer_services{state=\"served\"} 0",
            "# TYPE tandem_controller_longest_pending_service_seconds gauge",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
