//! The decision of one reconcile, as a pure function of what was observed.
//!
//! [`ownership`] says whether a Service is ours to ensure, ours to clean up, or not ours;
//! [`plan_ensure`] and [`plan_cleanup`] turn the observation (Service, desired LB, the LB
//! the cloud reported) into a [`Plan`]: the finalizer change, the Events before the cloud
//! call, the one cloud call, and — through [`Plan::settle`], given the call's result — the
//! LB-id annotation, the Events after it, the status (ingress + condition) and when to look
//! again. `reconcile` performs it in a fixed order; node sync and drift repair use the same.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;

use crate::provider::{
    Capabilities, DesiredLoadBalancer, Drift, IpFamily, LoadBalancerLookup, LoadBalancerPhase,
    ObservedLoadBalancer, ProviderError, Unsupported,
};
use crate::spec::{
    AnnotationKeys, ClassFilter, SpecError, is_being_deleted, is_load_balancer, owner_of,
};
use crate::status::{
    CONDITION_TYPE, ConditionReason, DesiredCondition, IngressUpdate, ingress_for,
};

/// The finalizer of the upstream service controller: our LB outlives no Service.
pub const FINALIZER: &str = "service.kubernetes.io/load-balancer-cleanup";

pub fn has_finalizer(svc: &Service) -> bool {
    svc.finalizers().iter().any(|f| f == FINALIZER)
}

/// The Service's finalizers with ours taken out: what a cleanup writes back.
pub fn finalizers_without_ours(svc: &Service) -> Vec<String> {
    svc.finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect()
}

/// What this controller is to do with a Service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// Ours, of type LoadBalancer and not being deleted: its LB must exist and match.
    Ensure,
    /// Carries our finalizer but no longer wants an LB (deleted, type changed, or its class
    /// no longer names us): delete the LB, then drop the finalizer.
    Cleanup,
    /// Not ours: never written to, never sent to the cloud.
    Ignore,
}

/// The finalizer decides before the class does: the API server clears
/// `spec.loadBalancerClass` when the type leaves LoadBalancer, so a Service holding our
/// finalizer stays ours until cleanup has removed it, whatever its class says now.
pub fn ownership(svc: &Service, classes: &ClassFilter) -> Ownership {
    if is_load_balancer(svc) && !is_being_deleted(svc) && classes.class_is_ours(svc) {
        Ownership::Ensure
    } else if has_finalizer(svc) {
        Ownership::Cleanup
    } else {
        Ownership::Ignore
    }
}

/// Whether the cloud may hold an LB for this Service. The finalizer is written before the
/// first cloud call and the id and condition after it, so a Service with none of them was
/// never sent to the cloud: its create needs no lookup.
pub fn may_have_load_balancer(svc: &Service, keys: &AnnotationKeys) -> bool {
    has_finalizer(svc)
        || keys.persisted_id(svc).is_some()
        || svc
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == CONDITION_TYPE))
}

/// What the reconcile learnt of the Service's LB before deciding. One exists per
/// reconcile, so the variants stay unboxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Seen {
    /// Not asked: [`may_have_load_balancer`] is false, or the Service is invalid.
    NotAsked,
    Found(ObservedLoadBalancer),
    /// Asked, and the cloud has none.
    Missing,
    /// Asking failed.
    Failed(ProviderError),
}

/// The one cloud call of a reconcile. One exists per reconcile, never in bulk, so the
/// variants stay unboxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum CloudAction {
    None,
    Create {
        desired: DesiredLoadBalancer,
        replaces: Option<String>,
    },
    Update {
        current: ObservedLoadBalancer,
        desired: DesiredLoadBalancer,
    },
    Delete(LoadBalancerLookup),
}

/// Why a Service cannot have the LB it asks for, known before any cloud call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// It needs what its provider's LBs cannot do ([`Capabilities`]).
    #[error("the {provider} provider's load balancers have {need}")]
    Unsupported {
        provider: &'static str,
        need: Unsupported,
    },
}

/// The LB a Service needs, if it is valid and its provider can make it.
pub fn servable(
    desired: Result<DesiredLoadBalancer, SpecError>,
    provider: &'static str,
    capabilities: Capabilities,
) -> Result<DesiredLoadBalancer, Refusal> {
    let desired = desired?;
    capabilities
        .check(&desired)
        .map_err(|need| Refusal::Unsupported { provider, need })?;
    Ok(desired)
}

/// Why a plan ends in an error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("cloud: {0}")]
    Provider(#[from] ProviderError),
    #[error("invalid Service: {0}")]
    Spec(SpecError),
    #[error("unsupported: {0}")]
    Unsupported(Refusal),
}

impl From<Refusal> for PlanError {
    fn from(refusal: Refusal) -> Self {
        match refusal {
            Refusal::Spec(error) => PlanError::Spec(error),
            unsupported @ Refusal::Unsupported { .. } => PlanError::Unsupported(unsupported),
        }
    }
}

impl PlanError {
    pub fn category(&self) -> &'static str {
        match self {
            PlanError::Provider(e) => e.category(),
            PlanError::Spec(e) => e.category(),
            PlanError::Unsupported(_) => "unsupported",
        }
    }
}

/// When to reconcile the Service again after a successful plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// The LB serves: look again at the drift-repair period.
    Resync,
    /// The LB is provisioning: look again soon.
    Poll,
    /// Nothing to do until the Service changes.
    AwaitChange,
}

/// What kind of write the plan makes; decides the Events and what success means.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
enum Intent {
    Ignore,
    Refused(Refusal),
    Unobservable(ProviderError),
    InSync(ObservedLoadBalancer, DesiredLoadBalancer),
    Create(DesiredLoadBalancer),
    /// Only the node set moved (Events `UpdatedLoadBalancer`).
    UpdateBackends(DesiredLoadBalancer),
    /// Other fields drifted (Events `EnsuringLoadBalancer` → `EnsuredLoadBalancer`).
    Repair(DesiredLoadBalancer),
    Cleanup {
        being_deleted: bool,
    },
}

/// The whole decision of one reconcile.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub add_finalizer: bool,
    pub events_before: Vec<EventDecision>,
    pub cloud: CloudAction,
    intent: Intent,
    /// The LB id persisted on the Service when the plan was made.
    known_id: Option<String>,
}

/// The writes that follow the cloud call, given its result.
#[derive(Debug, Clone, PartialEq)]
pub struct Settled {
    /// The LB id to persist on the Service (right after create, or when it changed).
    pub persist_id: Option<String>,
    pub events: Vec<EventDecision>,
    /// `None`: leave the status alone.
    pub status: Option<(IngressUpdate, Option<DesiredCondition>)>,
    /// Cleanup done: drop the finalizer and the LB-id annotation.
    pub remove_finalizer: bool,
    pub outcome: Result<Next, PlanError>,
}

/// The families of the LB whose VIPs reach no node, as a phrase ("IPv6", "IPv4 or IPv6");
/// `None` when every VIP has backends.
fn families_without_nodes(desired: &DesiredLoadBalancer) -> Option<String> {
    let missing = desired.families_without_backends();
    (!missing.is_empty()).then(|| {
        missing
            .iter()
            .map(IpFamily::to_string)
            .collect::<Vec<_>>()
            .join(" or ")
    })
}

/// The Warning of a cloud call made while a VIP of the LB reaches no node: upstream's words
/// when no node at all is eligible, else naming the family without nodes.
fn unavailable_event(desired: &DesiredLoadBalancer) -> Option<EventDecision> {
    let families = families_without_nodes(desired)?;
    let message = if desired.backends.is_empty() {
        "There are no available nodes for LoadBalancer".to_owned()
    } else {
        format!("There are no available nodes with an {families} address for LoadBalancer")
    };
    Some(EventDecision::new(
        EventReason::UnAvailableLoadBalancer,
        message,
    ))
}

fn failure_condition(error: &ProviderError) -> DesiredCondition {
    let reason = match error {
        ProviderError::AddressRefused { refusal, .. } => ConditionReason::AddressRefused(*refusal),
        ProviderError::Invalid { .. } => ConditionReason::InvalidConfiguration,
        ProviderError::Unsupported { .. } => ConditionReason::Unsupported,
        _ => ConditionReason::CloudError,
    };
    DesiredCondition {
        reason,
        message: error.to_string(),
    }
}

/// Decides the reconcile of a Service that wants an LB: `desired` is what it needs (or
/// why it cannot have one), `seen` what the cloud has.
pub fn plan_ensure(
    svc: &Service,
    keys: &AnnotationKeys,
    desired: Result<DesiredLoadBalancer, Refusal>,
    seen: Seen,
) -> Plan {
    let known_id = keys.persisted_id(svc).map(str::to_owned);
    let desired = match desired {
        Ok(desired) => desired,
        Err(refusal) => {
            return Plan {
                // No cloud call will follow, so no finalizer is needed for it.
                add_finalizer: false,
                events_before: Vec::new(),
                cloud: CloudAction::None,
                intent: Intent::Refused(refusal),
                known_id,
            };
        }
    };
    let add_finalizer = !has_finalizer(svc);
    let unavailable = unavailable_event(&desired);
    let (intent, cloud) = match seen {
        Seen::Failed(error) => (Intent::Unobservable(error), CloudAction::None),
        Seen::NotAsked | Seen::Missing => (
            Intent::Create(desired.clone()),
            CloudAction::Create {
                replaces: known_id.clone(),
                desired,
            },
        ),
        Seen::Found(current) => match current.drift(&desired).as_slice() {
            [] => (Intent::InSync(current, desired), CloudAction::None),
            [Drift::Backends] => (
                Intent::UpdateBackends(desired.clone()),
                CloudAction::Update { current, desired },
            ),
            _ => (
                Intent::Repair(desired.clone()),
                CloudAction::Update { current, desired },
            ),
        },
    };
    let mut events_before = Vec::new();
    if matches!(intent, Intent::Create(_) | Intent::Repair(_)) {
        events_before.push(EventDecision::new(
            EventReason::EnsuringLoadBalancer,
            "Ensuring load balancer",
        ));
    }
    if let Some(unavailable) = unavailable
        && cloud != CloudAction::None
    {
        events_before.push(unavailable);
    }
    Plan {
        add_finalizer,
        events_before,
        cloud,
        intent,
        known_id,
    }
}

/// Decides the cleanup of a Service that holds our finalizer but wants no LB.
pub fn plan_cleanup(
    svc: &Service,
    keys: &AnnotationKeys,
    cluster_id: &crate::provider::ClusterId,
) -> Plan {
    let known_id = keys.persisted_id(svc).map(str::to_owned);
    match owner_of(svc, cluster_id) {
        Ok(owner) => Plan {
            add_finalizer: false,
            events_before: vec![EventDecision::new(
                EventReason::DeletingLoadBalancer,
                "Deleting load balancer",
            )],
            cloud: CloudAction::Delete(LoadBalancerLookup {
                known_id: known_id.clone(),
                owner,
            }),
            intent: Intent::Cleanup {
                being_deleted: is_being_deleted(svc),
            },
            known_id,
        },
        Err(error) => Plan {
            add_finalizer: false,
            events_before: Vec::new(),
            cloud: CloudAction::None,
            intent: Intent::Refused(error.into()),
            known_id,
        },
    }
}

/// The plan for a Service that is not ours: nothing at all.
pub fn plan_nothing() -> Plan {
    Plan {
        add_finalizer: false,
        events_before: Vec::new(),
        cloud: CloudAction::None,
        intent: Intent::Ignore,
        known_id: None,
    }
}

impl Plan {
    /// The writes after the cloud call: `result` is the LB the call returned (for a
    /// delete, the LB the cloud still lists as being deleted, `None` once it is gone), or
    /// `None` when the plan made no call.
    pub fn settle(&self, result: Result<Option<ObservedLoadBalancer>, ProviderError>) -> Settled {
        let nothing = Settled {
            persist_id: None,
            events: Vec::new(),
            status: None,
            remove_finalizer: false,
            outcome: Ok(Next::AwaitChange),
        };
        match &self.intent {
            Intent::Ignore => nothing,
            Intent::Refused(error) => Settled {
                events: vec![EventDecision::new(
                    EventReason::SyncLoadBalancerFailed,
                    format!("Error syncing load balancer: {error}"),
                )],
                status: Some((
                    IngressUpdate::Keep,
                    Some(DesiredCondition {
                        reason: match error {
                            Refusal::Spec(_) => ConditionReason::InvalidConfiguration,
                            Refusal::Unsupported { .. } => ConditionReason::Unsupported,
                        },
                        message: error.to_string(),
                    }),
                )),
                outcome: Err(error.clone().into()),
                ..nothing
            },
            Intent::Unobservable(error) => self.failed(error.clone(), false),
            Intent::Cleanup { being_deleted } => match result {
                // The finalizer stays until the cloud no longer lists the LB.
                Ok(Some(deleting)) => {
                    tracing::debug!(id = %deleting.id, "load balancer still being deleted");
                    Settled {
                        outcome: Ok(Next::Poll),
                        ..nothing
                    }
                }
                Ok(None) => Settled {
                    events: vec![EventDecision::new(
                        EventReason::DeletedLoadBalancer,
                        "Deleted load balancer",
                    )],
                    // A Service being deleted needs no status; one that stays loses ours.
                    status: (!being_deleted).then_some((IngressUpdate::Clear, None)),
                    remove_finalizer: true,
                    ..nothing
                },
                Err(error) => Settled {
                    events: vec![EventDecision::new(
                        EventReason::DeleteLoadBalancerFailed,
                        format!("Error deleting load balancer: {error}"),
                    )],
                    outcome: Err(error.into()),
                    ..nothing
                },
            },
            Intent::InSync(current, desired) => {
                // The plan made no call: what it observed is the result.
                self.served(Some(current.clone()), desired)
            }
            Intent::Create(desired) | Intent::Repair(desired) | Intent::UpdateBackends(desired) => {
                match result {
                    Ok(lb) => {
                        let mut settled = self.served(lb, desired);
                        settled.events.insert(0, self.success_event());
                        settled
                    }
                    Err(error) => self.failed(error, true),
                }
            }
        }
    }

    fn success_event(&self) -> EventDecision {
        match self.intent {
            Intent::UpdateBackends(_) => EventDecision::new(
                EventReason::UpdatedLoadBalancer,
                "Updated load balancer with new hosts",
            ),
            _ => EventDecision::new(EventReason::EnsuredLoadBalancer, "Ensured load balancer"),
        }
    }

    fn failed(&self, error: ProviderError, wrote: bool) -> Settled {
        let event = match (&self.intent, wrote) {
            (Intent::UpdateBackends(_), true) => EventDecision::new(
                EventReason::UpdateLoadBalancerFailed,
                format!("Error updating load balancer with new hosts: {error}"),
            ),
            _ => EventDecision::new(
                EventReason::SyncLoadBalancerFailed,
                format!("Error syncing load balancer: {error}"),
            ),
        };
        Settled {
            persist_id: None,
            events: vec![event],
            status: Some((IngressUpdate::Keep, Some(failure_condition(&error)))),
            remove_finalizer: false,
            outcome: Err(error.into()),
        }
    }

    /// Status and id for an LB the cloud holds now.
    fn served(&self, lb: Option<ObservedLoadBalancer>, desired: &DesiredLoadBalancer) -> Settled {
        let Some(lb) = lb else {
            // A create or update always answers with the LB; treat silence as a cloud fault.
            return self.failed(
                ProviderError::Unavailable {
                    operation: crate::provider::Operation::Get,
                    message: "the cloud answered without a load balancer".into(),
                },
                true,
            );
        };
        let persist_id = (self.known_id.as_deref() != Some(lb.id.as_str())).then(|| lb.id.clone());
        // An LB known by a hostname needs no VIP of every family; it lists those it has.
        let vips = match (&lb.hostname, lb.vips_of(&desired.ip_families)) {
            (Some(_), Err(_)) => Ok(lb
                .vips
                .iter()
                .copied()
                .filter(|vip| desired.ip_families.contains(&IpFamily::of(vip)))
                .collect()),
            (_, vips) => vips,
        };
        let (ingress, condition, next) = match (lb.phase, vips) {
            (LoadBalancerPhase::Active, Ok(vips)) => {
                let condition = match families_without_nodes(desired) {
                    Some(families) => DesiredCondition {
                        reason: ConditionReason::NoEligibleNodes,
                        message: format!("no eligible node has an {families} address"),
                    },
                    None => DesiredCondition {
                        reason: ConditionReason::Ready,
                        message: format!(
                            "load balancer {} serves {}",
                            lb.id,
                            vips.iter()
                                .map(IpAddr::to_string)
                                .chain(lb.hostname.clone())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    },
                };
                (
                    IngressUpdate::Set(ingress_for(&vips, lb.hostname.as_deref(), desired)),
                    condition,
                    Next::Resync,
                )
            }
            // The cloud makes every family's VIP or none: one missing is a cloud fault.
            (LoadBalancerPhase::Active, Err(family)) => {
                return self.failed(
                    ProviderError::Unavailable {
                        operation: crate::provider::Operation::Get,
                        message: format!(
                            "the cloud answered load balancer {} without an {family} address",
                            lb.id
                        ),
                    },
                    true,
                );
            }
            _ => (
                IngressUpdate::Keep,
                DesiredCondition {
                    reason: ConditionReason::Provisioning,
                    message: format!("load balancer {} is provisioning", lb.id),
                },
                Next::Poll,
            ),
        };
        Settled {
            persist_id,
            events: Vec::new(),
            status: Some((ingress, Some(condition))),
            remove_finalizer: false,
            outcome: Ok(next),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::tests::observed_from;
    use crate::spec::tests::{KEYS, service};
    use crate::spec::{WithoutNodePorts, desired_load_balancer};
    use std::collections::BTreeSet;
    use std::net::Ipv4Addr;

    fn classes(claim_unclassed: bool) -> ClassFilter {
        ClassFilter {
            class: "ours".into(),
            claim_unclassed,
        }
    }

    fn with(edit: impl FnOnce(&mut Service)) -> Service {
        let mut svc = service("web");
        edit(&mut svc);
        svc
    }

    fn finalized(svc: &mut Service) {
        svc.metadata.finalizers = Some(vec![FINALIZER.into()]);
    }

    #[test]
    fn the_finalizer_decides_before_the_class() {
        let deleted = |s: &mut Service| {
            s.metadata.deletion_timestamp = Some(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
            )
        };
        let cluster_ip =
            |s: &mut Service| s.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        let class = |c: &str| {
            let c = c.to_owned();
            move |s: &mut Service| s.spec.as_mut().unwrap().load_balancer_class = Some(c)
        };
        let rows: Vec<(&str, Service, bool, Ownership)> = vec![
            (
                "unclassed, claimed",
                service("web"),
                true,
                Ownership::Ensure,
            ),
            (
                "unclassed, not claimed",
                service("web"),
                false,
                Ownership::Ignore,
            ),
            ("our class", with(class("ours")), false, Ownership::Ensure),
            (
                "other class",
                with(class("theirs")),
                true,
                Ownership::Ignore,
            ),
            (
                "other class with our finalizer",
                with(|s| {
                    class("theirs")(s);
                    finalized(s)
                }),
                true,
                Ownership::Cleanup,
            ),
            (
                // The leak: the class went with the type.
                "switched to ClusterIP, class cleared, not claimed",
                with(|s| {
                    cluster_ip(s);
                    finalized(s)
                }),
                false,
                Ownership::Cleanup,
            ),
            (
                "ClusterIP, never ours",
                with(cluster_ip),
                true,
                Ownership::Ignore,
            ),
            (
                "deleted with our finalizer",
                with(|s| {
                    deleted(s);
                    finalized(s)
                }),
                true,
                Ownership::Cleanup,
            ),
            (
                "deleted, no finalizer",
                with(deleted),
                true,
                Ownership::Ignore,
            ),
        ];
        for (name, svc, claim, want) in rows {
            assert_eq!(ownership(&svc, &classes(claim)), want, "{name}");
        }
    }

    #[test]
    fn only_a_service_never_sent_to_the_cloud_skips_the_lookup() {
        assert!(!may_have_load_balancer(&service("web"), &KEYS));
        assert!(may_have_load_balancer(&with(finalized), &KEYS));
        assert!(may_have_load_balancer(
            &with(|s| {
                s.metadata.annotations = Some([(KEYS.lb_id.clone(), "lb-1".to_owned())].into())
            }),
            &KEYS
        ));
    }

    fn desired(svc: &Service, nodes: &[u8]) -> DesiredLoadBalancer {
        let backends: BTreeSet<IpAddr> = nodes
            .iter()
            .map(|n| IpAddr::V4(Ipv4Addr::new(198, 18, 0, *n)))
            .collect();
        desired_load_balancer(
            svc,
            &KEYS,
            &"c".parse().unwrap(),
            backends,
            WithoutNodePorts::Passthrough,
            None,
        )
        .unwrap()
    }

    #[test]
    fn what_the_provider_cannot_do_is_refused_before_any_cloud_call() {
        let svc = with(finalized);
        let d = desired(&svc, &[11]);
        let no_proxy = Capabilities {
            proxy: false,
            ..Capabilities::ALL
        };
        let refused = servable(Ok(d.clone()), "edge", no_proxy);
        assert_eq!(
            refused,
            Err(Refusal::Unsupported {
                provider: "edge",
                need: Unsupported::Mode(crate::provider::LoadBalancerMode::Proxy)
            })
        );
        let plan = plan_ensure(&svc, &KEYS, refused, Seen::NotAsked);
        assert_eq!(
            (plan.cloud.clone(), plan.add_finalizer),
            (CloudAction::None, false)
        );
        let settled = plan.settle(Ok(None));
        let (ingress, condition) = settled.status.unwrap();
        assert_eq!(ingress, IngressUpdate::Keep);
        let condition = condition.unwrap();
        assert_eq!(condition.reason, ConditionReason::Unsupported);
        assert_eq!(
            condition.message,
            "the edge provider's load balancers have no proxy mode"
        );
        assert_eq!(
            settled.events[0].reason,
            EventReason::SyncLoadBalancerFailed
        );
        let error = settled.outcome.unwrap_err();
        assert_eq!(error.category(), "unsupported");
        assert_eq!(servable(Ok(d.clone()), "edge", Capabilities::ALL), Ok(d));
    }

    #[test]
    fn an_lb_known_by_a_hostname_alone_is_served() {
        let svc = with(finalized);
        let d = desired(&svc, &[11]);
        let mut lb = observed_from(&d);
        lb.vips.clear();
        lb.hostname = Some("lb-1.example.net".into());
        let settled = plan_ensure(&svc, &KEYS, Ok(d), Seen::Found(lb.clone())).settle(Ok(None));
        let (IngressUpdate::Set(ingress), Some(condition)) = settled.status.unwrap() else {
            panic!("no ingress");
        };
        assert_eq!(ingress[0].hostname.as_deref(), Some("lb-1.example.net"));
        assert_eq!(ingress[0].ip, None);
        assert_eq!(condition.reason, ConditionReason::Ready);
        assert!(condition.message.ends_with("serves lb-1.example.net"));
        // Without a hostname, a missing VIP is still a cloud fault.
        lb.hostname = None;
        let d = desired(&svc, &[11]);
        let settled = plan_ensure(&svc, &KEYS, Ok(d), Seen::Found(lb)).settle(Ok(None));
        assert!(settled.outcome.is_err());
    }

    #[test]
    fn a_new_address_or_pool_updates_the_same_load_balancer() {
        let svc = with(finalized);
        let d = desired(&svc, &[11]);
        let lb = observed_from(&d);
        for change in [
            |d: &mut DesiredLoadBalancer| {
                d.address.requested = vec![Ipv4Addr::new(198, 51, 100, 42).into()]
            },
            |d: &mut DesiredLoadBalancer| d.address.pool = Some("blue".into()),
            |d: &mut DesiredLoadBalancer| d.address.sharing_key = Some("dns".into()),
        ] {
            let mut moved = d.clone();
            change(&mut moved);
            let plan = plan_ensure(&svc, &KEYS, Ok(moved.clone()), Seen::Found(lb.clone()));
            assert_eq!(
                plan.cloud,
                CloudAction::Update {
                    current: lb.clone(),
                    desired: moved
                }
            );
        }
    }

    #[test]
    fn an_address_refusal_is_its_own_reason_and_permanent() {
        let svc = with(finalized);
        let d = desired(&svc, &[11]);
        let plan = plan_ensure(&svc, &KEYS, Ok(d), Seen::Missing);
        let refused = ProviderError::AddressRefused {
            refusal: crate::provider::AddressRefusal::PortConflict,
            message: "TCP port 53 of 198.51.100.7 is served by lb-2".into(),
        };
        let settled = plan.settle(Err(refused.clone()));
        let (ingress, condition) = settled.status.unwrap();
        assert_eq!(ingress, IngressUpdate::Keep);
        assert_eq!(
            condition.unwrap().reason.as_str(),
            "SharedAddressPortConflict"
        );
        assert_eq!(
            settled.events[0].reason,
            EventReason::SyncLoadBalancerFailed
        );
        assert!(
            settled.events[0]
                .message
                .contains("TCP port 53 of 198.51.100.7")
        );
        assert_eq!(settled.persist_id, None);
        assert_eq!(settled.outcome, Err(PlanError::Provider(refused)));
    }

    #[test]
    fn one_cloud_call_chosen_by_what_was_seen() {
        let svc = with(finalized);
        let d = desired(&svc, &[11]);
        let create = plan_ensure(&service("web"), &KEYS, Ok(d.clone()), Seen::NotAsked);
        assert!(create.add_finalizer);
        assert!(matches!(
            create.cloud,
            CloudAction::Create { replaces: None, .. }
        ));
        let in_sync = plan_ensure(&svc, &KEYS, Ok(d.clone()), Seen::Found(observed_from(&d)));
        assert_eq!(in_sync.cloud, CloudAction::None);
        assert!(!in_sync.add_finalizer && in_sync.events_before.is_empty());
        let settled = in_sync.settle(Ok(None));
        assert_eq!(settled.outcome, Ok(Next::Resync));
        assert_eq!(settled.persist_id.as_deref(), Some("lb-1"));
        // One more node: an update of the LB as observed, at its version.
        let moved = desired(&svc, &[11, 12]);
        let update = plan_ensure(
            &svc,
            &KEYS,
            Ok(moved.clone()),
            Seen::Found(observed_from(&d)),
        );
        match &update.cloud {
            CloudAction::Update { current, desired } => {
                assert_eq!((current.version, desired), (1, &moved));
            }
            other => panic!("{other:?}"),
        }
        let reasons: Vec<_> = update
            .settle(Ok(Some(observed_from(&moved))))
            .events
            .iter()
            .map(|e| e.reason)
            .collect();
        assert_eq!(reasons, vec![EventReason::UpdatedLoadBalancer]);
        // No node at all: still ensured, and said so.
        let none = desired(&svc, &[]);
        let empty = plan_ensure(
            &svc,
            &KEYS,
            Ok(none.clone()),
            Seen::Found(observed_from(&d)),
        );
        assert!(
            empty
                .events_before
                .iter()
                .any(|e| e.reason == EventReason::UnAvailableLoadBalancer)
        );
        let settled = empty.settle(Ok(Some(observed_from(&none))));
        assert_eq!(
            settled.status.and_then(|(_, c)| c).map(|c| c.reason),
            Some(ConditionReason::NoEligibleNodes)
        );
    }

    fn dual_stack(svc: &Service, backends: &[&str]) -> DesiredLoadBalancer {
        let mut svc = svc.clone();
        svc.spec.as_mut().unwrap().ip_families = Some(vec!["IPv6".into(), "IPv4".into()]);
        desired_load_balancer(
            &svc,
            &KEYS,
            &"c".parse().unwrap(),
            backends.iter().map(|b| b.parse().unwrap()).collect(),
            WithoutNodePorts::Passthrough,
            None,
        )
        .unwrap()
    }

    fn ingress_ips(settled: &Settled) -> Vec<String> {
        match &settled.status {
            Some((IngressUpdate::Set(ingress), _)) => {
                ingress.iter().filter_map(|i| i.ip.clone()).collect()
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_dual_stack_lb_is_served_per_family_in_the_services_order() {
        let svc = with(finalized);
        let d = dual_stack(&svc, &["198.18.0.11", "2001:db8:18::11"]);
        let settled = plan_ensure(&svc, &KEYS, Ok(d.clone()), Seen::Found(observed_from(&d)))
            .settle(Ok(None));
        assert_eq!(
            ingress_ips(&settled),
            ["2001:db8:51:100::7", "198.51.100.7"]
        );
        let condition = settled.status.unwrap().1.unwrap();
        assert_eq!(condition.reason, ConditionReason::Ready);
        assert!(
            condition
                .message
                .contains("2001:db8:51:100::7, 198.51.100.7")
        );
        // Upgraded from IPv4 alone: the same LB is updated, and serves both afterwards.
        let single = desired(&svc, &[11]);
        let upgrade = plan_ensure(
            &svc,
            &KEYS,
            Ok(d.clone()),
            Seen::Found(observed_from(&single)),
        );
        assert!(
            matches!(&upgrade.cloud, CloudAction::Update { current, .. } if current.id == "lb-1")
        );
        let settled = upgrade.settle(Ok(Some(observed_from(&d))));
        assert_eq!(settled.events[0].reason, EventReason::EnsuredLoadBalancer);
        assert_eq!(ingress_ips(&settled).len(), 2);
    }

    #[test]
    fn a_family_without_nodes_is_named_and_its_vip_still_reported() {
        let svc = with(finalized);
        let d = dual_stack(&svc, &["198.18.0.11"]);
        let plan = plan_ensure(&svc, &KEYS, Ok(d.clone()), Seen::Missing);
        let warning = plan
            .events_before
            .iter()
            .find(|e| e.reason == EventReason::UnAvailableLoadBalancer)
            .unwrap();
        assert_eq!(
            warning.message,
            "There are no available nodes with an IPv6 address for LoadBalancer"
        );
        let settled = plan.settle(Ok(Some(observed_from(&d))));
        assert_eq!(ingress_ips(&settled).len(), 2);
        let condition = settled.status.unwrap().1.unwrap();
        assert_eq!(
            (condition.reason, condition.message.as_str()),
            (
                ConditionReason::NoEligibleNodes,
                "no eligible node has an IPv6 address"
            )
        );
        let none = dual_stack(&svc, &[]);
        let plan = plan_ensure(&svc, &KEYS, Ok(none), Seen::Missing);
        assert_eq!(
            plan.events_before[1].message,
            "There are no available nodes for LoadBalancer"
        );
    }

    #[test]
    fn a_pool_lacking_a_family_refuses_the_upgrade_and_keeps_what_serves() {
        let svc = with(finalized);
        let single = desired(&svc, &[11]);
        let d = dual_stack(&svc, &["198.18.0.11", "2001:db8:18::11"]);
        let plan = plan_ensure(&svc, &KEYS, Ok(d), Seen::Found(observed_from(&single)));
        let refused = ProviderError::AddressRefused {
            refusal: crate::provider::AddressRefusal::PoolLacksFamily,
            message: "the VIP pool default has no IPv6 addresses".into(),
        };
        let settled = plan.settle(Err(refused.clone()));
        let (ingress, condition) = settled.status.unwrap();
        assert_eq!(ingress, IngressUpdate::Keep);
        assert_eq!(condition.unwrap().reason.as_str(), "AddressPoolLacksFamily");
        assert!(settled.events[0].message.contains("no IPv6 addresses"));
        assert_eq!(settled.outcome, Err(PlanError::Provider(refused)));
    }

    #[test]
    fn what_the_cloud_cannot_serve_is_unsupported_with_its_message_and_permanent() {
        let svc = with(finalized);
        let d = desired(&svc, &[11]);
        let plan = plan_ensure(&svc, &KEYS, Ok(d), Seen::Missing);
        let refused = ProviderError::Unsupported {
            operation: crate::provider::Operation::Create,
            message: "UDP port 53 cannot be served".into(),
        };
        let settled = plan.settle(Err(refused.clone()));
        let (ingress, condition) = settled.status.unwrap();
        assert_eq!(ingress, IngressUpdate::Keep);
        let condition = condition.unwrap();
        assert_eq!(condition.reason.as_str(), "UnsupportedByProvider");
        assert!(condition.message.contains("UDP port 53"), "{condition:?}");
        assert_eq!(settled.events.len(), 1, "{:?}", settled.events);
        assert_eq!(
            settled.events[0].reason,
            EventReason::SyncLoadBalancerFailed
        );
        assert!(settled.events[0].message.contains("UDP port 53"));
        assert_eq!(settled.outcome, Err(PlanError::Provider(refused.clone())));
        assert!(refused.is_permanent(), "waits for the Service to change");
    }

    #[test]
    fn an_active_lb_without_a_vip_of_a_family_is_a_cloud_fault() {
        let svc = with(finalized);
        let d = dual_stack(&svc, &["198.18.0.11", "2001:db8:18::11"]);
        let mut half = observed_from(&d);
        half.vips.retain(IpAddr::is_ipv4);
        let settled =
            plan_ensure(&svc, &KEYS, Ok(d), Seen::Found(half.clone())).settle(Ok(Some(half)));
        let (ingress, condition) = settled.status.unwrap();
        assert_eq!(ingress, IngressUpdate::Keep);
        assert_eq!(condition.unwrap().reason, ConditionReason::CloudError);
        assert!(matches!(
            settled.outcome,
            Err(PlanError::Provider(ProviderError::Unavailable { .. }))
        ));
    }

    #[test]
    fn cleanup_removes_the_finalizer_only_after_the_lb_is_gone() {
        let svc = with(|s| {
            finalized(s);
            s.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        });
        let plan = plan_cleanup(&svc, &KEYS, &"c".parse().unwrap());
        assert!(matches!(plan.cloud, CloudAction::Delete(_)));
        let done = plan.settle(Ok(None));
        assert!(done.remove_finalizer);
        assert_eq!(done.status, Some((IngressUpdate::Clear, None)));
        let failed = plan.settle(Err(ProviderError::Unavailable {
            operation: crate::provider::Operation::Delete,
            message: "down".into(),
        }));
        assert!(!failed.remove_finalizer && failed.outcome.is_err());
        assert_eq!(
            failed.events[0].reason,
            EventReason::DeleteLoadBalancerFailed
        );
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
}
