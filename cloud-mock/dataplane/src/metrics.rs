//! Data-plane metrics. Labels are bounded sets (protocol, outcome, direction, result):
//! never load balancer ids or addresses.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::{HealthCheck, Protocol};

/// What became of a new TCP connection or UDP flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Forwarded,
    /// The client is outside the load balancer's source ranges.
    Denied,
    /// No backend is healthy.
    NoBackend,
    /// Every healthy backend refused or timed out.
    BackendError,
    /// The UDP flow table of the listener is full.
    TableFull,
}

impl Outcome {
    const fn as_str(self) -> &'static str {
        match self {
            Self::Forwarded => "forwarded",
            Self::Denied => "denied",
            Self::NoBackend => "no_backend",
            Self::BackendError => "backend_error",
            Self::TableFull => "table_full",
        }
    }
}

/// Why HAProxy was reloaded (decided by `haproxy::layout` and the HAProxy driver).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReloadReason {
    /// A listener on a port (of a family) that no frontend binds yet.
    NewFrontend,
    /// A listener with no empty backend of its kind left.
    NoSpareBackend,
    /// An HAProxy that an earlier run of the edge left running, whose sections this run
    /// does not know.
    Adopted,
    /// HAProxy refused a runtime command: the file holds the wanted state, a reload makes it so.
    RuntimeRefused,
}

impl ReloadReason {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::NewFrontend => "new_frontend",
            Self::NoSpareBackend => "no_spare_backend",
            Self::Adopted => "adopted",
            Self::RuntimeRefused => "runtime_refused",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ConnectionLabels {
    protocol: &'static str,
    outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BytesLabels {
    protocol: &'static str,
    /// `in`: client to backend; `out`: backend to client.
    direction: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ProtocolLabels {
    protocol: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct HealthCheckLabels {
    check: &'static str,
    result: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// Cheap to clone: every field shares its storage.
#[derive(Debug, Clone, Default)]
pub(crate) struct Metrics {
    connections: Family<ConnectionLabels, Counter>,
    bytes: Family<BytesLabels, Counter>,
    active: Family<ProtocolLabels, Gauge>,
    health_checks: Family<HealthCheckLabels, Counter>,
    route_changes: Family<ResultLabels, Counter>,
    haproxy_reloads: Family<ResultLabels, Counter>,
    haproxy_reload_reasons: Family<ReasonLabels, Counter>,
    haproxy_runtime_commands: Family<ResultLabels, Counter>,
    haproxy_restarts: Counter,
}

impl Metrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "cloud_mock_dataplane_connections",
            "New TCP connections and UDP flows by protocol and outcome (refused UDP counts datagrams)",
            self.connections.clone(),
        );
        registry.register(
            "cloud_mock_dataplane_bytes",
            "Payload bytes forwarded (in: client to backend, out: backend to client); TCP counts at connection end",
            self.bytes.clone(),
        );
        registry.register(
            "cloud_mock_dataplane_active_connections",
            "Open TCP connections and tracked UDP flows",
            self.active.clone(),
        );
        registry.register(
            "cloud_mock_dataplane_health_checks",
            "Health probes by check kind and result",
            self.health_checks.clone(),
        );
        registry.register(
            "cloud_mock_dataplane_route_changes",
            "Passthrough kernel route changes by result",
            self.route_changes.clone(),
        );
        registry.register(
            "cloud_mock_haproxy_reloads",
            "HAProxy reloads by result",
            self.haproxy_reloads.clone(),
        );
        registry.register(
            "cloud_mock_haproxy_reload_reasons",
            "HAProxy reloads by what needed them: new_frontend (a port not bound yet), no_spare_backend, adopted (an earlier edge's HAProxy), runtime_refused",
            self.haproxy_reload_reasons.clone(),
        );
        registry.register(
            "cloud_mock_haproxy_runtime_commands",
            "HAProxy runtime API server changes by result (a refused one falls back to a reload)",
            self.haproxy_runtime_commands.clone(),
        );
        registry.register(
            "cloud_mock_haproxy_restarts",
            "Times HAProxy exited on its own and was started again",
            self.haproxy_restarts.clone(),
        );
    }

    pub fn connection(&self, protocol: Protocol, outcome: Outcome) {
        self.connections
            .get_or_create(&ConnectionLabels {
                protocol: protocol.as_str(),
                outcome: outcome.as_str(),
            })
            .inc();
    }

    pub fn bytes(&self, protocol: Protocol, client_to_backend: u64, backend_to_client: u64) {
        for (direction, count) in [("in", client_to_backend), ("out", backend_to_client)] {
            if count > 0 {
                self.bytes
                    .get_or_create(&BytesLabels {
                        protocol: protocol.as_str(),
                        direction,
                    })
                    .inc_by(count);
            }
        }
    }

    /// Counts one open connection or flow until the guard drops.
    pub fn open(&self, protocol: Protocol) -> ActiveGuard {
        let gauge = self
            .active
            .get_or_create(&ProtocolLabels {
                protocol: protocol.as_str(),
            })
            .clone();
        gauge.inc();
        ActiveGuard(gauge)
    }

    pub fn health_check(&self, check: &HealthCheck, passed: bool) {
        let check = match check {
            HealthCheck::Tcp { .. } => "tcp",
            HealthCheck::Http { .. } => "http",
        };
        let result = if passed { "pass" } else { "fail" };
        self.health_checks
            .get_or_create(&HealthCheckLabels { check, result })
            .inc();
    }

    pub fn route_change(&self, succeeded: bool) {
        count_result(&self.route_changes, succeeded);
    }

    pub fn haproxy_reload(&self, reason: ReloadReason, succeeded: bool) {
        count_result(&self.haproxy_reloads, succeeded);
        self.haproxy_reload_reasons
            .get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            })
            .inc();
    }

    pub fn haproxy_runtime_command(&self, succeeded: bool) {
        count_result(&self.haproxy_runtime_commands, succeeded);
    }

    pub fn haproxy_restart(&self) {
        self.haproxy_restarts.inc();
    }
}

fn count_result(family: &Family<ResultLabels, Counter>, succeeded: bool) {
    let result = if succeeded { "ok" } else { "error" };
    family.get_or_create(&ResultLabels { result }).inc();
}

#[derive(Debug)]
pub(crate) struct ActiveGuard(Gauge);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;

    #[test]
    fn exposition_has_bounded_labels_and_live_gauges() {
        let metrics = Metrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        metrics.connection(Protocol::Tcp, Outcome::Denied);
        metrics.bytes(Protocol::Udp, 10, 0);
        let guard = metrics.open(Protocol::Tcp);
        let _other = metrics.open(Protocol::Tcp);
        drop(guard);
        metrics.health_check(&HealthCheck::Tcp { port: 1 }, false);
        metrics.haproxy_reload(ReloadReason::NewFrontend, true);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        assert!(text.contains(
            r#"cloud_mock_dataplane_connections_total{protocol="tcp",outcome="denied"} 1"#
        ));
        assert!(
            text.contains(r#"cloud_mock_dataplane_bytes_total{protocol="udp",direction="in"} 10"#)
        );
        assert!(
            !text.contains(r#"direction="out""#),
            "zero counts are not created"
        );
        assert!(text.contains(r#"cloud_mock_dataplane_active_connections{protocol="tcp"} 1"#));
        assert!(
            text.contains(
                r#"cloud_mock_dataplane_health_checks_total{check="tcp",result="fail"} 1"#
            )
        );
        assert!(text.contains(r#"cloud_mock_haproxy_reloads_total{result="ok"} 1"#));
        assert!(
            text.contains(r#"cloud_mock_haproxy_reload_reasons_total{reason="new_frontend"} 1"#)
        );
    }
}
