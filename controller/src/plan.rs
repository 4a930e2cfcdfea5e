//! The decision of one reconcile, as a pure, synchronous function of what was observed.
//!
//! A reconcile reads once: [`Observation`] holds whether the Service is ours
//! ([`ownership`]), its owner and persisted LB id (the one [`LoadBalancerLookup`],
//! [`lookup_of`]), the LB it needs and what the cloud holds. [`decide`] turns that into a
//! [`Plan`] of finished writes: the finalizer patch, the Events before the cloud call, the
//! one cloud call; [`Plan::settle`], given the call's result, finishes the rest ([`Settled`]:
//! the LB-id patch, the Events after it, the status write, the finalizer removal) and when
//! to look again. `reconcile` performs them in a fixed order and decides nothing; node sync
//! and drift repair go through the same.

use std::net::IpAddr;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use serde_json::{Value, json};
use tandem_common::IpFamily;

use crate::provider::{
    Capabilities, ClusterId, DesiredLoadBalancer, Drift, LoadBalancerLookup, LoadBalancerPhase,
    ObservedLoadBalancer, ProviderError, Unsupported,
};
use crate::spec::{
    AnnotationKeys, ClassFilter, SpecError, is_being_deleted, is_load_balancer, owner_of,
};
use crate::status::{
    CONDITION_TYPE, ConditionReason, DesiredCondition, IngressFields, IngressUpdate, StatusWrite,
    current_ingress, ingress_for, status_write,
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

/// Where the cloud keeps a Service's LB: under the id persisted on the Service, else under
/// its owner. Every path that reads or deletes a Service's LB (reconcile, cleanup, the
/// uninstall hook) builds its lookup here; `Err` when the Service cannot name its owner.
pub fn lookup_of(
    svc: &Service,
    keys: &AnnotationKeys,
    cluster_id: &ClusterId,
) -> Result<LoadBalancerLookup, SpecError> {
    Ok(LoadBalancerLookup {
        known_id: keys.persisted_id(svc).map(str::to_owned),
        owner: owner_of(svc, cluster_id)?,
    })
}

/// Whether the cloud may hold an LB for this Service. The finalizer is written before the
/// first cloud call and the id and condition after it, so a Service with none of them was
/// never sent to the cloud: its create needs no lookup.
pub fn may_have_load_balancer(svc: &Service, lookup: &LoadBalancerLookup) -> bool {
    has_finalizer(svc)
        || lookup.known_id.is_some()
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

/// Everything one reconcile reads, read once: the input of [`decide`].
#[derive(Debug, Clone, PartialEq)]
pub struct Observation<'a> {
    /// The Service as read: the finalizers and status every write starts from.
    pub svc: &'a Service,
    pub ownership: Ownership,
    /// Its owner and persisted LB id (`Err`: it cannot name its owner).
    pub lookup: Result<LoadBalancerLookup, SpecError>,
    /// What a Service to ensure needs: the LB (its owner, the eligible backends of its
    /// families, its address pool, its own or the one its Namespace or the controller
    /// names) or why it cannot have one. `Some` exactly when `ownership` is `Ensure`.
    pub desired: Option<Result<DesiredLoadBalancer, Refusal>>,
    /// What the cloud holds, asked only of a valid Service that may have an LB.
    pub seen: Seen,
    /// The id a create would give the LB, when the provider lets the client choose it
    /// ([`crate::provider::LoadBalancerProvider::planned_id`]); asked only when the cloud
    /// was found to have none.
    pub planned_id: Option<String>,
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

/// A finished merge patch of the Service's metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct MetadataPatch {
    /// What it does, as a failure names it.
    pub action: &'static str,
    /// The patch's `metadata`.
    pub metadata: Value,
    /// Must fail (409) on a concurrent change: finalizer lists are written whole, so they
    /// are, lest someone else's finalizer be dropped. The act sends it with the
    /// resourceVersion its last write answered.
    pub guarded: bool,
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
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// The LB serves: look again at the drift-repair period.
    Resync,
    /// The LB is provisioning: look again once it is active (see
    /// [`crate::provisioning`]), or soon.
    Provisioning(Box<ObservedLoadBalancer>),
    /// The LB is still being deleted: look again soon.
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

/// The whole decision of one reconcile: the writes before the cloud call, the call, and
/// (through [`Plan::settle`]) the writes after it.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan<'a> {
    /// The Service as observed.
    svc: &'a Service,
    /// The key of the LB-id annotation.
    lb_id_key: &'a str,
    /// Our finalizer, added before the cloud call.
    pub add_finalizer: Option<MetadataPatch>,
    pub events_before: Vec<EventDecision>,
    pub cloud: CloudAction,
    intent: Intent,
    /// The LB id persisted on the Service: as observed, or as `add_finalizer` writes it.
    known_id: Option<String>,
}

/// The writes that follow the cloud call, finished, given its result.
#[derive(Debug, Clone, PartialEq)]
pub struct Settled {
    /// The LB id persisted on the Service (right after create, or when it changed).
    pub persist_id: Option<MetadataPatch>,
    pub events: Vec<EventDecision>,
    /// `None`: the status already reads as it should, or is left alone.
    pub status: Option<StatusWrite>,
    /// The status write gives the Service its first ingress (the provisioning time).
    pub first_ingress: bool,
    /// Cleanup done: our finalizer (and the LB-id annotation of a Service that stays)
    /// removed.
    pub remove_finalizer: Option<MetadataPatch>,
    pub outcome: Result<Next, PlanError>,
}

/// What follows the cloud call, before it is made into writes.
struct Verdict {
    persist_id: Option<String>,
    events: Vec<EventDecision>,
    /// `None`: leave the status alone.
    status: Option<(IngressUpdate, Option<DesiredCondition>)>,
    remove_finalizer: bool,
    outcome: Result<Next, PlanError>,
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
        ProviderError::QuotaExceeded { .. } => ConditionReason::QuotaExceeded,
        ProviderError::Forbidden { .. } => ConditionReason::CloudForbidden,
        _ => ConditionReason::CloudError,
    };
    DesiredCondition {
        reason,
        message: error.to_string(),
    }
}

/// Decides the reconcile of the observed Service: pure, and the same for a reconcile, node
/// sync and drift repair. `keys` names the LB-id annotation the writes set or remove.
pub fn decide<'a>(observation: Observation<'a>, keys: &'a AnnotationKeys) -> Plan<'a> {
    let Observation {
        svc,
        ownership,
        lookup,
        desired,
        seen,
        planned_id,
    } = observation;
    let nothing = Plan {
        svc,
        lb_id_key: &keys.lb_id,
        add_finalizer: None,
        events_before: Vec::new(),
        cloud: CloudAction::None,
        intent: Intent::Ignore,
        known_id: None,
    };
    match (ownership, desired) {
        (Ownership::Ensure, Some(desired)) => {
            plan_ensure(nothing, lookup, desired, seen, planned_id)
        }
        (Ownership::Cleanup, _) => plan_cleanup(nothing, lookup),
        // Not ours (or an observation of nothing to ensure): no write at all.
        _ => nothing,
    }
}

/// A Service that wants an LB: `desired` is what it needs (or why it cannot have one),
/// `seen` what the cloud has, `planned_id` the id a create would give it.
fn plan_ensure<'a>(
    base: Plan<'a>,
    lookup: Result<LoadBalancerLookup, SpecError>,
    desired: Result<DesiredLoadBalancer, Refusal>,
    seen: Seen,
    planned_id: Option<String>,
) -> Plan<'a> {
    let mut known_id = lookup.ok().and_then(|lookup| lookup.known_id);
    let desired = match desired {
        Ok(desired) => desired,
        // No cloud call will follow, so no finalizer is needed for it.
        Err(refusal) => {
            return Plan {
                intent: Intent::Refused(refusal),
                known_id,
                ..base
            };
        }
    };
    let svc = base.svc;
    let mut add_finalizer = (!has_finalizer(svc)).then(|| {
        let mut finalizers = svc.finalizers().to_vec();
        finalizers.push(FINALIZER.to_owned());
        MetadataPatch {
            action: "add finalizer",
            metadata: json!({ "finalizers": finalizers }),
            guarded: true,
        }
    });
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
    // A create whose id is known before it is made persists that id with the finalizer:
    // one patch instead of two, and still before the cloud call.
    if let (Intent::Create(_), Some(patch), Some(id)) = (&intent, &mut add_finalizer, planned_id)
        && known_id.as_ref() != Some(&id)
    {
        patch.action = "add finalizer and load balancer id";
        patch.metadata["annotations"] = json!({ base.lb_id_key: id });
        known_id = Some(id);
    }
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
        ..base
    }
}

/// A Service that holds our finalizer but wants no LB: its LB deleted through `lookup`.
fn plan_cleanup(base: Plan<'_>, lookup: Result<LoadBalancerLookup, SpecError>) -> Plan<'_> {
    match lookup {
        Ok(lookup) => Plan {
            events_before: vec![EventDecision::new(
                EventReason::DeletingLoadBalancer,
                "Deleting load balancer",
            )],
            known_id: lookup.known_id.clone(),
            cloud: CloudAction::Delete(lookup),
            intent: Intent::Cleanup {
                being_deleted: is_being_deleted(base.svc),
            },
            ..base
        },
        Err(error) => Plan {
            intent: Intent::Refused(error.into()),
            ..base
        },
    }
}

impl Plan<'_> {
    /// The writes after the cloud call, finished: `result` is the LB the call returned (for
    /// a delete, the LB the cloud still lists as being deleted, `None` once it is gone), or
    /// `None` when the plan made no call; `fields` are the ingress fields the API server
    /// keeps and `now` the time a condition that flips is stamped with.
    pub fn settle(
        &self,
        result: Result<Option<ObservedLoadBalancer>, ProviderError>,
        fields: IngressFields,
        now: Timestamp,
    ) -> Settled {
        let verdict = self.verdict(result);
        let status = verdict.status.and_then(|(ingress, condition)| {
            status_write(self.svc, &ingress, condition.as_ref(), fields, now)
        });
        let first_ingress = current_ingress(self.svc).is_empty()
            && status
                .as_ref()
                .and_then(|write| write.ingress.as_ref())
                .is_some_and(|ingress| !ingress.is_empty());
        Settled {
            persist_id: verdict.persist_id.map(|id| MetadataPatch {
                action: "persist load balancer id",
                metadata: json!({ "annotations": { self.lb_id_key: id } }),
                guarded: false,
            }),
            events: verdict.events,
            status,
            first_ingress,
            remove_finalizer: verdict.remove_finalizer.then(|| self.finalizer_removal()),
            outcome: verdict.outcome,
        }
    }

    /// Our finalizer out, and with it the LB-id annotation of a Service that stays (its
    /// type or class changed): it no longer has that LB. A Service being deleted goes with
    /// its annotations.
    fn finalizer_removal(&self) -> MetadataPatch {
        let mut metadata = json!({ "finalizers": finalizers_without_ours(self.svc) });
        let stays = !matches!(
            self.intent,
            Intent::Cleanup {
                being_deleted: true
            }
        );
        if self.known_id.is_some() && stays {
            metadata["annotations"] = json!({ self.lb_id_key: null });
        }
        MetadataPatch {
            action: "remove finalizer",
            metadata,
            guarded: true,
        }
    }

    fn verdict(&self, result: Result<Option<ObservedLoadBalancer>, ProviderError>) -> Verdict {
        let nothing = Verdict {
            persist_id: None,
            events: Vec::new(),
            status: None,
            remove_finalizer: false,
            outcome: Ok(Next::AwaitChange),
        };
        match &self.intent {
            Intent::Ignore => nothing,
            Intent::Refused(error) => Verdict {
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
                    Verdict {
                        outcome: Ok(Next::Poll),
                        ..nothing
                    }
                }
                Ok(None) => Verdict {
                    events: vec![EventDecision::new(
                        EventReason::DeletedLoadBalancer,
                        "Deleted load balancer",
                    )],
                    // A Service being deleted needs no status; one that stays loses ours.
                    status: (!being_deleted).then_some((IngressUpdate::Clear, None)),
                    remove_finalizer: true,
                    ..nothing
                },
                Err(error) => Verdict {
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
                self.served(Some(current.clone()), desired, false)
            }
            Intent::Create(desired) | Intent::Repair(desired) | Intent::UpdateBackends(desired) => {
                match result {
                    Ok(lb) => {
                        let mut verdict = self.served(lb, desired, true);
                        verdict.events.insert(0, self.success_event());
                        verdict
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

    fn failed(&self, error: ProviderError, wrote: bool) -> Verdict {
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
        Verdict {
            persist_id: None,
            events: vec![event],
            status: Some((IngressUpdate::Keep, Some(failure_condition(&error)))),
            remove_finalizer: false,
            outcome: Err(error.into()),
        }
    }

    /// Status and id for an LB the cloud holds now: `answered` when it is the answer of
    /// the create or update just made, not an LB observed in sync.
    fn served(
        &self,
        lb: Option<ObservedLoadBalancer>,
        desired: &DesiredLoadBalancer,
        answered: bool,
    ) -> Verdict {
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
                .filter(|vip| desired.ip_families.contains(&IpFamily::of(*vip)))
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
                Next::Provisioning(Box::new(lb)),
            ),
        };
        // An LB the cloud just accepted is usually active by the next look, so its
        // Provisioning condition is written only if that look finds it still provisioning:
        // a status write fewer per create, and the ingress is still the first status the
        // Service gets.
        let provisioning_just_accepted = answered && matches!(next, Next::Provisioning(_));
        Verdict {
            persist_id,
            events: Vec::new(),
            status: (!provisioning_just_accepted).then_some((ingress, Some(condition))),
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
mod tests;
