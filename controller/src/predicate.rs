//! Change detection and Event decisions.
//!
//! A Service is re-ensured when anything the LB depends on changes: type, ports, source
//! ranges, session affinity, requested IP, externalIPs, UID, externalTrafficPolicy,
//! healthCheckNodePort, IP families, class, any annotation, or its deletion/finalizers.
//! Labels, status and EndpointSlices do not count.

use std::hash::{DefaultHasher, Hash, Hasher};

use k8s_openapi::api::core::v1::Service;
use serde_json::json;

use crate::provider::{Drift, ObservedLoadBalancer};

/// A hash of every field that can require a cloud call; used as the kube-runtime
/// predicate so status writes and label edits do not wake the reconciler.
pub fn reensure_fingerprint(svc: &Service) -> u64 {
    let spec = svc.spec.as_ref();
    let relevant = json!({
        "type": spec.and_then(|s| s.type_.as_ref()),
        "ports": spec.and_then(|s| s.ports.as_ref()),
        "sourceRanges": spec.and_then(|s| s.load_balancer_source_ranges.as_ref()),
        "sessionAffinity": spec.and_then(|s| s.session_affinity.as_ref()),
        "sessionAffinityConfig": spec.and_then(|s| s.session_affinity_config.as_ref()),
        "loadBalancerIP": spec.and_then(|s| s.load_balancer_ip.as_ref()),
        "externalIPs": spec.and_then(|s| s.external_ips.as_ref()),
        "externalTrafficPolicy": spec.and_then(|s| s.external_traffic_policy.as_ref()),
        "healthCheckNodePort": spec.and_then(|s| s.health_check_node_port),
        "ipFamilies": spec.and_then(|s| s.ip_families.as_ref()),
        "ipFamilyPolicy": spec.and_then(|s| s.ip_family_policy.as_ref()),
        "loadBalancerClass": spec.and_then(|s| s.load_balancer_class.as_ref()),
        "uid": svc.metadata.uid.as_ref(),
        "annotations": svc.metadata.annotations.as_ref(),
        "deletionTimestamp": svc.metadata.deletion_timestamp.as_ref(),
        "finalizers": svc.metadata.finalizers.as_ref(),
    });
    let mut hasher = DefaultHasher::new();
    relevant.to_string().hash(&mut hasher);
    hasher.finish()
}

pub fn needs_reensure(old: &Service, new: &Service) -> bool {
    reensure_fingerprint(old) != reensure_fingerprint(new)
}

/// The nine Event reasons of the upstream service controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventReason {
    EnsuringLoadBalancer,
    EnsuredLoadBalancer,
    SyncLoadBalancerFailed,
    DeletingLoadBalancer,
    DeletedLoadBalancer,
    DeleteLoadBalancerFailed,
    UpdatedLoadBalancer,
    UpdateLoadBalancerFailed,
    UnAvailableLoadBalancer,
}

impl EventReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EventReason::EnsuringLoadBalancer => "EnsuringLoadBalancer",
            EventReason::EnsuredLoadBalancer => "EnsuredLoadBalancer",
            EventReason::SyncLoadBalancerFailed => "SyncLoadBalancerFailed",
            EventReason::DeletingLoadBalancer => "DeletingLoadBalancer",
            EventReason::DeletedLoadBalancer => "DeletedLoadBalancer",
            EventReason::DeleteLoadBalancerFailed => "DeleteLoadBalancerFailed",
            EventReason::UpdatedLoadBalancer => "UpdatedLoadBalancer",
            EventReason::UpdateLoadBalancerFailed => "UpdateLoadBalancerFailed",
            EventReason::UnAvailableLoadBalancer => "UnAvailableLoadBalancer",
        }
    }

    pub fn is_warning(self) -> bool {
        matches!(
            self,
            EventReason::SyncLoadBalancerFailed
                | EventReason::DeleteLoadBalancerFailed
                | EventReason::UpdateLoadBalancerFailed
                | EventReason::UnAvailableLoadBalancer
        )
    }
}

/// An Event to record on the Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventDecision {
    pub reason: EventReason,
    pub message: String,
}

impl EventDecision {
    pub fn new(reason: EventReason, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }
}

/// What a reconcile has to do with the cloud, given what it observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnsurePlan {
    /// The LB matches; nothing to write.
    InSync,
    /// Only the node set moved: a backends-only update (Events `UpdatedLoadBalancer`).
    UpdateBackends,
    /// Create, or repair other fields (Events `EnsuringLoadBalancer` → `EnsuredLoadBalancer`).
    Ensure { reason: String },
}

pub fn plan_ensure(observed: Option<&ObservedLoadBalancer>, drift: &[Drift]) -> EnsurePlan {
    match observed {
        None => EnsurePlan::Ensure {
            reason: "load balancer does not exist".into(),
        },
        Some(_) if drift.is_empty() => EnsurePlan::InSync,
        Some(_) if drift == [Drift::Backends] => EnsurePlan::UpdateBackends,
        Some(_) => EnsurePlan::Ensure {
            reason: format!(
                "load balancer differs in {}",
                drift
                    .iter()
                    .map(|d| format!("{d:?}").to_lowercase())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
    }
}

/// The Events to record before a cloud write, by plan.
pub fn events_before(plan: &EnsurePlan) -> Option<EventDecision> {
    match plan {
        EnsurePlan::Ensure { .. } => Some(EventDecision::new(
            EventReason::EnsuringLoadBalancer,
            "Ensuring load balancer",
        )),
        EnsurePlan::InSync | EnsurePlan::UpdateBackends => None,
    }
}

/// The Event for the result of a cloud write, by plan.
pub fn event_after(plan: &EnsurePlan, result: Result<(), &str>) -> Option<EventDecision> {
    match (plan, result) {
        (EnsurePlan::InSync, _) => None,
        (EnsurePlan::Ensure { .. }, Ok(())) => Some(EventDecision::new(
            EventReason::EnsuredLoadBalancer,
            "Ensured load balancer",
        )),
        (EnsurePlan::Ensure { .. }, Err(e)) => Some(EventDecision::new(
            EventReason::SyncLoadBalancerFailed,
            format!("Error syncing load balancer: {e}"),
        )),
        (EnsurePlan::UpdateBackends, Ok(())) => Some(EventDecision::new(
            EventReason::UpdatedLoadBalancer,
            "Updated load balancer with new hosts",
        )),
        (EnsurePlan::UpdateBackends, Err(e)) => Some(EventDecision::new(
            EventReason::UpdateLoadBalancerFailed,
            format!("Error updating load balancer with new hosts: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::tests::service;
    use k8s_openapi::api::core::v1::{LoadBalancerIngress, LoadBalancerStatus, ServiceStatus};
    use std::collections::BTreeMap;

    type Edit = fn(&mut Service);

    #[test]
    fn relevant_changes_trigger_reensure() {
        let edits: [(&str, Edit); 13] = [
            ("type", |s| {
                s.spec.as_mut().unwrap().type_ = Some("ClusterIP".into())
            }),
            ("ports", |s| {
                s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 81
            }),
            ("nodePort", |s| {
                s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].node_port = Some(30081)
            }),
            ("sourceRanges", |s| {
                s.spec.as_mut().unwrap().load_balancer_source_ranges =
                    Some(vec!["1.0.0.0/8".into()])
            }),
            ("affinity", |s| {
                s.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into())
            }),
            ("lbIP", |s| {
                s.spec.as_mut().unwrap().load_balancer_ip = Some("1.2.3.4".into())
            }),
            ("externalIPs", |s| {
                s.spec.as_mut().unwrap().external_ips = Some(vec!["1.2.3.4".into()])
            }),
            ("uid", |s| s.metadata.uid = Some("other".into())),
            ("etp", |s| {
                s.spec.as_mut().unwrap().external_traffic_policy = Some("Local".into())
            }),
            ("hcnp", |s| {
                s.spec.as_mut().unwrap().health_check_node_port = Some(31000)
            }),
            ("families", |s| {
                s.spec.as_mut().unwrap().ip_families = Some(vec!["IPv4".into()])
            }),
            ("annotation", |s| {
                s.metadata.annotations = Some(BTreeMap::from([("any/thing".into(), "x".into())]))
            }),
            ("deletion", |s| {
                s.metadata.deletion_timestamp =
                    Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                        jiff::Timestamp::UNIX_EPOCH,
                    ))
            }),
        ];
        let base = service("web");
        for (name, edit) in edits {
            let mut changed = base.clone();
            edit(&mut changed);
            assert!(needs_reensure(&base, &changed), "{name} should trigger");
        }
    }

    #[test]
    fn labels_and_status_do_not_trigger() {
        let base = service("web");
        let mut changed = base.clone();
        changed.metadata.labels = Some(BTreeMap::from([("app".into(), "x".into())]));
        changed.metadata.resource_version = Some("99".into());
        changed.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(vec![LoadBalancerIngress {
                    ip: Some("1.1.1.1".into()),
                    ..Default::default()
                }]),
            }),
            conditions: None,
        });
        assert!(!needs_reensure(&base, &changed));
    }

    #[test]
    fn nine_reasons_with_types() {
        let all = [
            EventReason::EnsuringLoadBalancer,
            EventReason::EnsuredLoadBalancer,
            EventReason::SyncLoadBalancerFailed,
            EventReason::DeletingLoadBalancer,
            EventReason::DeletedLoadBalancer,
            EventReason::DeleteLoadBalancerFailed,
            EventReason::UpdatedLoadBalancer,
            EventReason::UpdateLoadBalancerFailed,
            EventReason::UnAvailableLoadBalancer,
        ];
        let names: std::collections::BTreeSet<_> = all.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), 9);
        assert_eq!(all.iter().filter(|r| r.is_warning()).count(), 4);
    }

    #[test]
    fn plans_and_events() {
        assert!(matches!(plan_ensure(None, &[]), EnsurePlan::Ensure { .. }));
        let observed = ObservedLoadBalancer {
            id: "x".into(),
            name: "n".into(),
            owner: None,
            phase: crate::provider::LoadBalancerPhase::Active,
            vip: None,
            mode: crate::provider::LoadBalancerMode::Proxy,
            listeners: vec![],
            backends: Default::default(),
            source_ranges: vec![],
        };
        assert_eq!(plan_ensure(Some(&observed), &[]), EnsurePlan::InSync);
        let backends = plan_ensure(Some(&observed), &[Drift::Backends]);
        assert_eq!(backends, EnsurePlan::UpdateBackends);
        let full = plan_ensure(Some(&observed), &[Drift::Backends, Drift::Listeners]);
        assert_eq!(
            full,
            EnsurePlan::Ensure {
                reason: "load balancer differs in backends, listeners".into()
            }
        );
        assert_eq!(events_before(&backends), None);
        assert_eq!(
            events_before(&full).unwrap().reason,
            EventReason::EnsuringLoadBalancer
        );
        assert_eq!(
            event_after(&full, Err("boom")).unwrap().reason,
            EventReason::SyncLoadBalancerFailed
        );
        assert_eq!(
            event_after(&backends, Ok(())).unwrap().reason,
            EventReason::UpdatedLoadBalancer
        );
        assert_eq!(
            event_after(&backends, Err("x")).unwrap().reason,
            EventReason::UpdateLoadBalancerFailed
        );
        assert_eq!(event_after(&EnsurePlan::InSync, Ok(())), None);
    }
}
