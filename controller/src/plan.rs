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

    fn cluster() -> ClusterId {
        "c".parse().unwrap()
    }

    fn with(edit: impl FnOnce(&mut Service)) -> Service {
        let mut svc = service("web");
        edit(&mut svc);
        svc
    }

    fn finalized(svc: &mut Service) {
        svc.metadata.finalizers = Some(vec![FINALIZER.into()]);
    }

    /// Served earlier: our finalizer and the id of `observed_from`'s LB.
    fn served(svc: &mut Service) {
        finalized(svc);
        svc.metadata.annotations = Some([(KEYS.lb_id.clone(), "lb-1".to_owned())].into());
    }

    fn deleted(svc: &mut Service) {
        svc.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
        );
    }

    fn now() -> Timestamp {
        Timestamp::from_second(1_000).unwrap()
    }

    /// The observation of a Service ours to ensure: `desired` what it needs, `seen` what
    /// the cloud holds.
    fn observed(
        svc: &Service,
        desired: Result<DesiredLoadBalancer, Refusal>,
        seen: Seen,
    ) -> Observation<'_> {
        Observation {
            svc,
            ownership: Ownership::Ensure,
            lookup: lookup_of(svc, &KEYS, &cluster()),
            desired: Some(desired),
            seen,
            planned_id: None,
        }
    }

    fn plan(svc: &Service, desired: Result<DesiredLoadBalancer, Refusal>, seen: Seen) -> Plan<'_> {
        decide(observed(svc, desired, seen), &KEYS)
    }

    fn settle(
        plan: &Plan<'_>,
        result: Result<Option<ObservedLoadBalancer>, ProviderError>,
    ) -> Settled {
        plan.settle(result, IngressFields::ALL, now())
    }

    /// The reason and message of the condition the status write sets.
    fn condition(settled: &Settled) -> Option<(String, String)> {
        let sent = &settled.status.as_ref()?.body["status"]["conditions"][0];
        Some((
            sent["reason"].as_str()?.to_owned(),
            sent["message"].as_str()?.to_owned(),
        ))
    }

    fn reason(settled: &Settled) -> Option<String> {
        condition(settled).map(|(reason, _)| reason)
    }

    /// Whether the status write leaves the ingress as it is.
    fn keeps_ingress(settled: &Settled) -> bool {
        settled.status.as_ref().is_some_and(|w| w.ingress.is_none())
    }

    fn ingress_ips(settled: &Settled) -> Vec<String> {
        match settled.status.as_ref().and_then(|w| w.ingress.as_ref()) {
            Some(ingress) => ingress.iter().filter_map(|i| i.ip.clone()).collect(),
            None => panic!("no ingress written: {settled:?}"),
        }
    }

    /// The LB id the settled writes persist.
    fn persisted(settled: &Settled) -> Option<String> {
        let patch = settled.persist_id.as_ref()?;
        patch.metadata["annotations"][&KEYS.lb_id]
            .as_str()
            .map(str::to_owned)
    }

    fn reasons(events: &[EventDecision]) -> Vec<EventReason> {
        events.iter().map(|e| e.reason).collect()
    }

    #[test]
    fn the_finalizer_decides_before_the_class() {
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
        let may_have = |svc: &Service| {
            may_have_load_balancer(svc, &lookup_of(svc, &KEYS, &cluster()).unwrap())
        };
        assert!(!may_have(&service("web")));
        assert!(may_have(&with(finalized)));
        assert!(may_have(&with(|s| {
            s.metadata.annotations = Some([(KEYS.lb_id.clone(), "lb-1".to_owned())].into())
        })));
    }

    #[test]
    fn one_lookup_names_the_persisted_id_and_the_owner() {
        let lookup = lookup_of(&with(served), &KEYS, &cluster()).unwrap();
        assert_eq!(lookup.known_id.as_deref(), Some("lb-1"));
        assert_eq!(
            (lookup.owner.name.as_str(), lookup.owner.uid.as_str()),
            ("web", "uid-web")
        );
        let nameless = with(|s| s.metadata.uid = None);
        assert_eq!(
            lookup_of(&nameless, &KEYS, &cluster()),
            Err(SpecError::MissingMetadata("uid"))
        );
    }

    fn desired(svc: &Service, nodes: &[u8]) -> DesiredLoadBalancer {
        let backends: BTreeSet<IpAddr> = nodes
            .iter()
            .map(|n| IpAddr::V4(Ipv4Addr::new(198, 18, 0, *n)))
            .collect();
        desired_load_balancer(
            svc,
            &KEYS,
            owner_of(svc, &cluster()).unwrap(),
            backends,
            WithoutNodePorts::Passthrough,
            None,
        )
        .unwrap()
    }

    /// One row of the decision: an observation, the cloud's answer, and every write.
    struct Case {
        name: &'static str,
        svc: Service,
        ownership: Ownership,
        desired: Option<Result<DesiredLoadBalancer, Refusal>>,
        seen: Seen,
        /// What the plan's cloud call answers.
        answer: Result<Option<ObservedLoadBalancer>, ProviderError>,
        // Expected:
        add_finalizer: bool,
        before: &'static [EventReason],
        cloud: &'static str,
        persist_id: bool,
        after: &'static [EventReason],
        /// Whether a status write is made, and the reason of the condition it sets.
        status: Option<Option<&'static str>>,
        first_ingress: bool,
        /// `Some(drops the id annotation)` when the finalizer is removed.
        remove_finalizer: Option<bool>,
        /// `Err(category)`.
        outcome: Result<Next, &'static str>,
    }

    fn cloud_kind(action: &CloudAction) -> &'static str {
        match action {
            CloudAction::None => "none",
            CloudAction::Create { .. } => "create",
            CloudAction::Update { .. } => "update",
            CloudAction::Delete(_) => "delete",
        }
    }

    /// The Service `svc` after `settled`'s status write, as the API server applies it.
    fn written(svc: &Service, settled: &Settled) -> Service {
        match &settled.status {
            Some(write) => crate::status::tests::apply(svc, write),
            None => svc.clone(),
        }
    }

    #[test]
    fn decision_table() {
        use EventReason::*;
        let new = service("web");
        let d = desired(&new, &[11]);
        let active = observed_from(&d);
        let provisioning = ObservedLoadBalancer {
            phase: LoadBalancerPhase::Provisioning,
            vips: Vec::new(),
            ..active.clone()
        };
        // Served and in sync, its status written by an earlier settle.
        let finalized_svc = with(served);
        let status_written = written(
            &finalized_svc,
            &settle(
                &plan(&finalized_svc, Ok(d.clone()), Seen::Found(active.clone())),
                Ok(None),
            ),
        );
        let down = ProviderError::Unavailable {
            operation: crate::provider::Operation::Create,
            message: "down".into(),
        };
        let base = |name, svc: &Service| Case {
            name,
            svc: svc.clone(),
            ownership: Ownership::Ensure,
            desired: Some(Ok(d.clone())),
            seen: Seen::NotAsked,
            answer: Ok(None),
            add_finalizer: false,
            before: &[],
            cloud: "none",
            persist_id: false,
            after: &[],
            status: None,
            first_ingress: false,
            remove_finalizer: None,
            outcome: Ok(Next::AwaitChange),
        };
        let cases = vec![
            Case {
                answer: Ok(Some(active.clone())),
                add_finalizer: true,
                before: &[EnsuringLoadBalancer],
                cloud: "create",
                persist_id: true,
                after: &[EnsuredLoadBalancer],
                status: Some(Some("LoadBalancerActive")),
                first_ingress: true,
                outcome: Ok(Next::Resync),
                ..base("new, created active", &new)
            },
            Case {
                // The poll writes the condition if it is still provisioning then.
                answer: Ok(Some(provisioning.clone())),
                add_finalizer: true,
                before: &[EnsuringLoadBalancer],
                cloud: "create",
                persist_id: true,
                after: &[EnsuredLoadBalancer],
                outcome: Ok(Next::Provisioning(Box::new(provisioning.clone()))),
                ..base("new, created provisioning: no status yet", &new)
            },
            Case {
                seen: Seen::Found(provisioning.clone()),
                status: Some(Some("Provisioning")),
                outcome: Ok(Next::Provisioning(Box::new(provisioning.clone()))),
                ..base("polled, still provisioning", &finalized_svc)
            },
            Case {
                seen: Seen::Found(active.clone()),
                status: Some(Some("LoadBalancerActive")),
                first_ingress: true,
                outcome: Ok(Next::Resync),
                ..base("polled, active", &finalized_svc)
            },
            Case {
                seen: Seen::Found(active.clone()),
                outcome: Ok(Next::Resync),
                ..base("in sync, status as it should be: no write", &status_written)
            },
            Case {
                seen: Seen::Found(active.clone()),
                desired: Some(Ok(desired(&new, &[11, 12]))),
                answer: Ok(Some(observed_from(&desired(&new, &[11, 12])))),
                cloud: "update",
                after: &[UpdatedLoadBalancer],
                outcome: Ok(Next::Resync),
                ..base(
                    "a node added: one update, nothing else written",
                    &status_written,
                )
            },
            Case {
                seen: Seen::Missing,
                answer: Err(down.clone()),
                before: &[EnsuringLoadBalancer],
                cloud: "create",
                after: &[SyncLoadBalancerFailed],
                status: Some(Some("CloudError")),
                outcome: Err("unavailable"),
                ..base("vanished, the create fails", &finalized_svc)
            },
            Case {
                seen: Seen::Failed(down.clone()),
                after: &[SyncLoadBalancerFailed],
                status: Some(Some("CloudError")),
                outcome: Err("unavailable"),
                ..base("the read fails: no call", &finalized_svc)
            },
            Case {
                desired: Some(Err(Refusal::Spec(SpecError::NoPorts))),
                after: &[SyncLoadBalancerFailed],
                status: Some(Some("InvalidConfiguration")),
                outcome: Err("invalid_configuration"),
                ..base("invalid: no finalizer, no call", &new)
            },
            Case {
                ownership: Ownership::Cleanup,
                desired: None,
                before: &[DeletingLoadBalancer],
                cloud: "delete",
                after: &[DeletedLoadBalancer],
                remove_finalizer: Some(false),
                ..base("deleted: the finalizer goes, the id with the Service", &{
                    let mut svc = status_written.clone();
                    deleted(&mut svc);
                    svc
                })
            },
            Case {
                ownership: Ownership::Cleanup,
                desired: None,
                before: &[DeletingLoadBalancer],
                cloud: "delete",
                after: &[DeletedLoadBalancer],
                status: Some(None),
                remove_finalizer: Some(true),
                ..base("switched to ClusterIP: status, finalizer and id go", &{
                    let mut svc = status_written.clone();
                    svc.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
                    svc
                })
            },
            Case {
                ownership: Ownership::Cleanup,
                desired: None,
                answer: Ok(Some(ObservedLoadBalancer {
                    phase: LoadBalancerPhase::Deleting,
                    ..active.clone()
                })),
                before: &[DeletingLoadBalancer],
                cloud: "delete",
                outcome: Ok(Next::Poll),
                ..base("still being deleted: the finalizer waits", &{
                    let mut svc = finalized_svc.clone();
                    deleted(&mut svc);
                    svc
                })
            },
            Case {
                ownership: Ownership::Ignore,
                desired: None,
                ..base("not ours: nothing", &new)
            },
        ];
        for case in cases {
            let plan = decide(
                Observation {
                    svc: &case.svc,
                    ownership: case.ownership,
                    lookup: lookup_of(&case.svc, &KEYS, &cluster()),
                    desired: case.desired.clone(),
                    seen: case.seen.clone(),
                    planned_id: None,
                },
                &KEYS,
            );
            let settled = settle(&plan, case.answer.clone());
            let name = case.name;
            assert_eq!(plan.add_finalizer.is_some(), case.add_finalizer, "{name}");
            assert_eq!(reasons(&plan.events_before), case.before, "{name}");
            assert_eq!(cloud_kind(&plan.cloud), case.cloud, "{name}");
            assert_eq!(settled.persist_id.is_some(), case.persist_id, "{name}");
            assert_eq!(reasons(&settled.events), case.after, "{name}");
            assert_eq!(
                settled.status.as_ref().map(|_| reason(&settled)),
                case.status.map(|r| r.map(str::to_owned)),
                "{name}"
            );
            assert_eq!(settled.first_ingress, case.first_ingress, "{name}");
            assert_eq!(
                settled
                    .remove_finalizer
                    .as_ref()
                    .map(|p| p.metadata.get("annotations").is_some()),
                case.remove_finalizer,
                "{name}"
            );
            assert_eq!(
                settled.outcome.as_ref().map_err(PlanError::category),
                case.outcome.as_ref().map_err(|c| *c),
                "{name}"
            );
        }
    }

    #[test]
    fn the_metadata_patches_are_finished() {
        let mut svc = service("web");
        svc.metadata.finalizers = Some(vec!["example.com/other".into()]);
        let d = desired(&svc, &[11]);
        let create = plan(&svc, Ok(d.clone()), Seen::NotAsked);
        assert_eq!(
            create.add_finalizer,
            Some(MetadataPatch {
                action: "add finalizer",
                metadata: json!({ "finalizers": ["example.com/other", FINALIZER] }),
                guarded: true,
            })
        );
        let settled = settle(&create, Ok(Some(observed_from(&d))));
        assert_eq!(
            settled.persist_id,
            Some(MetadataPatch {
                action: "persist load balancer id",
                metadata: json!({ "annotations": { KEYS.lb_id.as_str(): "lb-1" } }),
                guarded: false,
            })
        );
        // A type switched away: the other writer's finalizer stays, ours and the id go.
        let mut switched = svc.clone();
        served(&mut switched);
        switched.metadata.finalizers = Some(vec!["example.com/other".into(), FINALIZER.into()]);
        switched.spec.as_mut().unwrap().type_ = Some("NodePort".into());
        let cleanup = decide(
            Observation {
                svc: &switched,
                ownership: Ownership::Cleanup,
                lookup: lookup_of(&switched, &KEYS, &cluster()),
                desired: None,
                seen: Seen::NotAsked,
                planned_id: None,
            },
            &KEYS,
        );
        assert_eq!(
            cleanup.cloud,
            CloudAction::Delete(lookup_of(&switched, &KEYS, &cluster()).unwrap())
        );
        assert_eq!(
            settle(&cleanup, Ok(None)).remove_finalizer,
            Some(MetadataPatch {
                action: "remove finalizer",
                metadata: json!({
                    "finalizers": ["example.com/other"],
                    "annotations": { KEYS.lb_id.as_str(): null },
                }),
                guarded: true,
            })
        );
    }

    /// A provider whose cloud takes the client's id: the id goes with the finalizer, before
    /// the create, and needs no patch after it unless the cloud answered another LB.
    #[test]
    fn a_planned_id_is_persisted_with_the_finalizer() {
        let svc = service("web");
        let d = desired(&svc, &[11]);
        fn planned<'a>(svc: &'a Service, d: &DesiredLoadBalancer, seen: Seen) -> Plan<'a> {
            decide(
                Observation {
                    planned_id: Some("lb-1".to_owned()),
                    ..observed(svc, Ok(d.clone()), seen)
                },
                &KEYS,
            )
        }
        let create = planned(&svc, &d, Seen::NotAsked);
        assert_eq!(
            create.add_finalizer,
            Some(MetadataPatch {
                action: "add finalizer and load balancer id",
                metadata: json!({
                    "finalizers": [FINALIZER],
                    "annotations": { KEYS.lb_id.as_str(): "lb-1" },
                }),
                guarded: true,
            })
        );
        assert_eq!(
            create.cloud,
            CloudAction::Create {
                desired: d.clone(),
                replaces: None
            }
        );
        let answered = observed_from(&d);
        assert_eq!(answered.id, "lb-1");
        assert_eq!(settle(&create, Ok(Some(answered.clone()))).persist_id, None);
        // A key that replayed an earlier create answers that LB: its id is persisted.
        let other = ObservedLoadBalancer {
            id: "lb-0".into(),
            ..answered
        };
        assert_eq!(
            persisted(&settle(&create, Ok(Some(other)))).as_deref(),
            Some("lb-0")
        );
        // A Service that holds the finalizer already (its LB vanished) keeps the id patch
        // after the create: there is no earlier write to carry it.
        let holding = with(finalized);
        let again = planned(&holding, &d, Seen::Missing);
        assert_eq!(again.add_finalizer, None);
        assert_eq!(
            persisted(&settle(&again, Ok(Some(observed_from(&d))))).as_deref(),
            Some("lb-1")
        );
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
        let plan = plan(&svc, refused, Seen::NotAsked);
        assert_eq!(
            (plan.cloud.clone(), plan.add_finalizer.is_some()),
            (CloudAction::None, false)
        );
        let settled = settle(&plan, Ok(None));
        assert!(keeps_ingress(&settled));
        assert_eq!(
            condition(&settled),
            Some((
                ConditionReason::Unsupported.as_str().to_owned(),
                "the edge provider's load balancers have no proxy mode".to_owned()
            ))
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
        let settled = settle(&plan(&svc, Ok(d), Seen::Found(lb.clone())), Ok(None));
        let ingress = settled.status.as_ref().and_then(|w| w.ingress.clone());
        let ingress = ingress.expect("an ingress");
        assert_eq!(ingress[0].hostname.as_deref(), Some("lb-1.example.net"));
        assert_eq!(ingress[0].ip, None);
        let (reason, message) = condition(&settled).unwrap();
        assert_eq!(reason, ConditionReason::Ready.as_str());
        assert!(message.ends_with("serves lb-1.example.net"));
        assert!(settled.first_ingress);
        // Without a hostname, a missing VIP is still a cloud fault.
        lb.hostname = None;
        let d = desired(&svc, &[11]);
        let settled = settle(&plan(&svc, Ok(d), Seen::Found(lb)), Ok(None));
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
            let plan = plan(&svc, Ok(moved.clone()), Seen::Found(lb.clone()));
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
        let plan = plan(&svc, Ok(d), Seen::Missing);
        let refused = ProviderError::AddressRefused {
            refusal: crate::provider::AddressRefusal::PortConflict,
            message: "TCP port 53 of 198.51.100.7 is served by lb-2".into(),
        };
        let settled = settle(&plan, Err(refused.clone()));
        assert!(keeps_ingress(&settled));
        assert_eq!(
            reason(&settled).as_deref(),
            Some("SharedAddressPortConflict")
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
        let new = service("web");
        let create = plan(&new, Ok(d.clone()), Seen::NotAsked);
        assert!(create.add_finalizer.is_some());
        assert!(matches!(
            create.cloud,
            CloudAction::Create { replaces: None, .. }
        ));
        let in_sync = plan(&svc, Ok(d.clone()), Seen::Found(observed_from(&d)));
        assert_eq!(in_sync.cloud, CloudAction::None);
        assert!(in_sync.add_finalizer.is_none() && in_sync.events_before.is_empty());
        let settled = settle(&in_sync, Ok(None));
        assert_eq!(settled.outcome, Ok(Next::Resync));
        assert_eq!(persisted(&settled).as_deref(), Some("lb-1"));
        // One more node: an update of the LB as observed, at its version.
        let moved = desired(&svc, &[11, 12]);
        let update = plan(&svc, Ok(moved.clone()), Seen::Found(observed_from(&d)));
        match &update.cloud {
            CloudAction::Update { current, desired } => {
                assert_eq!((current.version, desired), (1, &moved));
            }
            other => panic!("{other:?}"),
        }
        let settled = settle(&update, Ok(Some(observed_from(&moved))));
        assert_eq!(
            reasons(&settled.events),
            vec![EventReason::UpdatedLoadBalancer]
        );
        // No node at all: still ensured, and said so.
        let none = desired(&svc, &[]);
        let empty = plan(&svc, Ok(none.clone()), Seen::Found(observed_from(&d)));
        assert!(
            empty
                .events_before
                .iter()
                .any(|e| e.reason == EventReason::UnAvailableLoadBalancer)
        );
        let settled = settle(&empty, Ok(Some(observed_from(&none))));
        assert_eq!(
            reason(&settled).as_deref(),
            Some(ConditionReason::NoEligibleNodes.as_str())
        );
    }

    fn dual_stack(svc: &Service, backends: &[&str]) -> DesiredLoadBalancer {
        let mut svc = svc.clone();
        svc.spec.as_mut().unwrap().ip_families = Some(vec!["IPv6".into(), "IPv4".into()]);
        desired_load_balancer(
            &svc,
            &KEYS,
            owner_of(&svc, &cluster()).unwrap(),
            backends.iter().map(|b| b.parse().unwrap()).collect(),
            WithoutNodePorts::Passthrough,
            None,
        )
        .unwrap()
    }

    #[test]
    fn a_dual_stack_lb_is_served_per_family_in_the_services_order() {
        let svc = with(finalized);
        let d = dual_stack(&svc, &["198.18.0.11", "2001:db8:18::11"]);
        let settled = settle(
            &plan(&svc, Ok(d.clone()), Seen::Found(observed_from(&d))),
            Ok(None),
        );
        assert_eq!(
            ingress_ips(&settled),
            ["2001:db8:51:100::7", "198.51.100.7"]
        );
        let (reason, message) = condition(&settled).unwrap();
        assert_eq!(reason, ConditionReason::Ready.as_str());
        assert!(message.contains("2001:db8:51:100::7, 198.51.100.7"));
        // Upgraded from IPv4 alone: the same LB is updated, and serves both afterwards.
        let single = desired(&svc, &[11]);
        let upgrade = plan(&svc, Ok(d.clone()), Seen::Found(observed_from(&single)));
        assert!(
            matches!(&upgrade.cloud, CloudAction::Update { current, .. } if current.id == "lb-1")
        );
        let settled = settle(&upgrade, Ok(Some(observed_from(&d))));
        assert_eq!(settled.events[0].reason, EventReason::EnsuredLoadBalancer);
        assert_eq!(ingress_ips(&settled).len(), 2);
    }

    #[test]
    fn a_family_without_nodes_is_named_and_its_vip_still_reported() {
        let svc = with(finalized);
        let d = dual_stack(&svc, &["198.18.0.11"]);
        let first = plan(&svc, Ok(d.clone()), Seen::Missing);
        let warning = first
            .events_before
            .iter()
            .find(|e| e.reason == EventReason::UnAvailableLoadBalancer)
            .unwrap();
        assert_eq!(
            warning.message,
            "There are no available nodes with an IPv6 address for LoadBalancer"
        );
        let settled = settle(&first, Ok(Some(observed_from(&d))));
        assert_eq!(ingress_ips(&settled).len(), 2);
        assert_eq!(
            condition(&settled),
            Some((
                ConditionReason::NoEligibleNodes.as_str().to_owned(),
                "no eligible node has an IPv6 address".to_owned()
            ))
        );
        let none = dual_stack(&svc, &[]);
        let nothing = plan(&svc, Ok(none), Seen::Missing);
        assert_eq!(
            nothing.events_before[1].message,
            "There are no available nodes for LoadBalancer"
        );
    }

    #[test]
    fn a_pool_lacking_a_family_refuses_the_upgrade_and_keeps_what_serves() {
        let svc = with(finalized);
        let single = desired(&svc, &[11]);
        let d = dual_stack(&svc, &["198.18.0.11", "2001:db8:18::11"]);
        let plan = plan(&svc, Ok(d), Seen::Found(observed_from(&single)));
        let refused = ProviderError::AddressRefused {
            refusal: crate::provider::AddressRefusal::PoolLacksFamily,
            message: "the VIP pool default has no IPv6 addresses".into(),
        };
        let settled = settle(&plan, Err(refused.clone()));
        assert!(keeps_ingress(&settled));
        assert_eq!(reason(&settled).as_deref(), Some("AddressPoolLacksFamily"));
        assert!(settled.events[0].message.contains("no IPv6 addresses"));
        assert_eq!(settled.outcome, Err(PlanError::Provider(refused)));
    }

    #[test]
    fn what_the_cloud_cannot_serve_is_unsupported_with_its_message_and_permanent() {
        let svc = with(finalized);
        let d = desired(&svc, &[11]);
        let plan = plan(&svc, Ok(d), Seen::Missing);
        let refused = ProviderError::Unsupported {
            operation: crate::provider::Operation::Create,
            message: "UDP port 53 cannot be served".into(),
        };
        let settled = settle(&plan, Err(refused.clone()));
        assert!(keeps_ingress(&settled));
        let (reason, message) = condition(&settled).unwrap();
        assert_eq!(reason, "UnsupportedByProvider");
        assert!(message.contains("UDP port 53"), "{message}");
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
        let settled = settle(
            &plan(&svc, Ok(d), Seen::Found(half.clone())),
            Ok(Some(half)),
        );
        assert!(keeps_ingress(&settled));
        assert_eq!(
            reason(&settled).as_deref(),
            Some(ConditionReason::CloudError.as_str())
        );
        assert!(matches!(
            settled.outcome,
            Err(PlanError::Provider(ProviderError::Unavailable { .. }))
        ));
    }

    #[test]
    fn cleanup_removes_the_finalizer_only_after_the_lb_is_gone() {
        let svc = with(|s| {
            served(s);
            s.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        });
        let plan = decide(
            Observation {
                svc: &svc,
                ownership: ownership(&svc, &classes(true)),
                lookup: lookup_of(&svc, &KEYS, &cluster()),
                desired: None,
                seen: Seen::NotAsked,
                planned_id: None,
            },
            &KEYS,
        );
        assert!(matches!(plan.cloud, CloudAction::Delete(_)));
        let done = settle(&plan, Ok(None));
        assert!(done.remove_finalizer.is_some());
        // Nothing of ours in the status, so nothing to clear.
        assert_eq!(done.status, None);
        let failed = settle(
            &plan,
            Err(ProviderError::Unavailable {
                operation: crate::provider::Operation::Delete,
                message: "down".into(),
            }),
        );
        assert!(failed.remove_finalizer.is_none() && failed.outcome.is_err());
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
