//! The Service reconciler: the thin layer that performs what the pure modules decide.
//!
//! Order of effects per Service: finalizer (before any cloud call) → cloud ensure → LB id
//! annotation (right after create) → Events → status (only when it differs).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use serde_json::json;

use crate::metrics::Metrics;
use crate::nodes::eligible_backends;
use crate::predicate::{
    EnsurePlan, EventDecision, EventReason, event_after, events_before, plan_ensure,
};
use crate::provider::{
    ClusterId, LoadBalancerLookup, LoadBalancerPhase, LoadBalancerProvider, ProviderError,
};
use crate::ratelimit::service_backoff;
use crate::spec::{
    ANNOTATION_LB_ID, ClassFilter, SpecError, desired_load_balancer, is_being_deleted,
    is_load_balancer, owner_of, persisted_id,
};
use crate::status::{ConditionReason, DesiredCondition, IngressUpdate, ingress_for, status_patch};

/// The finalizer of the upstream service controller: our LB outlives no Service.
pub const FINALIZER: &str = "service.kubernetes.io/load-balancer-cleanup";

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("cloud: {0}")]
    Provider(#[from] ProviderError),
    #[error("invalid Service: {0}")]
    Spec(#[from] SpecError),
    #[error("kubernetes API {action}: {source}")]
    Kube {
        action: &'static str,
        #[source]
        source: kube::Error,
    },
}

impl ReconcileError {
    pub fn category(&self) -> &'static str {
        match self {
            ReconcileError::Provider(e) => e.category(),
            ReconcileError::Spec(e) => e.category(),
            ReconcileError::Kube { .. } => "kubernetes",
        }
    }
}

fn kube_err(action: &'static str) -> impl FnOnce(kube::Error) -> ReconcileError {
    move |source| ReconcileError::Kube { action, source }
}

/// Shared state of all reconciles.
pub struct Context<P> {
    pub client: kube::Client,
    pub provider: P,
    pub cluster_id: ClusterId,
    pub classes: ClassFilter,
    pub nodes: Store<Node>,
    pub recorder: Recorder,
    pub metrics: Metrics,
    /// Re-ensure period of every Service: the drift-repair backstop.
    pub resync: Duration,
    /// How often to look again while an LB is provisioning.
    pub provisioning_poll: Duration,
    failures: Mutex<HashMap<ObjectRef<Service>, u32>>,
}

impl<P: LoadBalancerProvider> Context<P> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: kube::Client,
        provider: P,
        cluster_id: ClusterId,
        classes: ClassFilter,
        nodes: Store<Node>,
        recorder: Recorder,
        metrics: Metrics,
        resync: Duration,
    ) -> Self {
        Self {
            client,
            provider,
            cluster_id,
            classes,
            nodes,
            recorder,
            metrics,
            resync,
            provisioning_poll: Duration::from_secs(1),
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Records an Event; failures are logged, never fatal (Events are best effort).
    pub async fn publish(&self, svc: &Service, decision: &EventDecision) {
        let event = Event {
            type_: if decision.reason.is_warning() {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: decision.reason.as_str().into(),
            note: Some(decision.message.clone()),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, &svc.object_ref(&())).await {
            tracing::warn!(%error, reason = decision.reason.as_str(), "cannot record event");
        }
    }

    fn record_failure(&self, svc: &Service) -> u32 {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let count = failures.entry(ObjectRef::from_obj(svc)).or_insert(0);
        *count = count.saturating_add(1);
        *count
    }

    fn clear_failures(&self, svc: &Service) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.remove(&ObjectRef::from_obj(svc));
    }
}

fn has_finalizer(svc: &Service) -> bool {
    svc.finalizers().iter().any(|f| f == FINALIZER)
}

fn api(client: &kube::Client, svc: &Service) -> Api<Service> {
    Api::namespaced(client.clone(), &svc.namespace().unwrap_or_default())
}

/// Merge patch that carries the resourceVersion, so a concurrent change makes it fail (409)
/// instead of silently dropping someone else's finalizer.
async fn set_finalizers(
    client: &kube::Client,
    svc: &Service,
    finalizers: Vec<String>,
    clear_id: bool,
) -> Result<(), ReconcileError> {
    let mut metadata = json!({
        "finalizers": finalizers,
        "resourceVersion": svc.resource_version(),
    });
    if clear_id && persisted_id(svc).is_some() {
        metadata["annotations"] = json!({ ANNOTATION_LB_ID: null });
    }
    api(client, svc)
        .patch(
            &svc.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": metadata })),
        )
        .await
        .map_err(kube_err("patch finalizers"))?;
    Ok(())
}

async fn patch_status(
    client: &kube::Client,
    svc: &Service,
    ingress: &IngressUpdate,
    condition: Option<&DesiredCondition>,
) -> Result<bool, ReconcileError> {
    let Some(patch) = status_patch(svc, ingress, condition, Timestamp::now()) else {
        return Ok(false);
    };
    api(client, svc)
        .patch_status(
            &svc.name_any(),
            &PatchParams::default(),
            &Patch::Merge(patch),
        )
        .await
        .map_err(kube_err("patch status"))?;
    Ok(true)
}

/// Reconciles one Service. Only Services of our class are ever written to.
pub async fn reconcile<P: LoadBalancerProvider>(
    svc: Arc<Service>,
    ctx: Arc<Context<P>>,
) -> Result<Action, ReconcileError> {
    if !ctx.classes.class_is_ours(&svc) {
        return Ok(Action::await_change());
    }
    let wants_lb = is_load_balancer(&svc) && !is_being_deleted(&svc);
    let result = if wants_lb {
        ensure(&svc, &ctx).await
    } else if has_finalizer(&svc) {
        cleanup(&svc, &ctx).await
    } else {
        Ok(Action::await_change())
    };
    ctx.metrics
        .reconciled(result.as_ref().map(drop).map_err(ReconcileError::category));
    if result.is_ok() {
        ctx.clear_failures(&svc);
    }
    result
}

/// Per-Service exponential backoff, 5 s → 300 s.
pub fn error_policy<P: LoadBalancerProvider>(
    svc: Arc<Service>,
    error: &ReconcileError,
    ctx: Arc<Context<P>>,
) -> Action {
    let failures = ctx.record_failure(&svc);
    let delay = service_backoff(failures);
    tracing::warn!(service = %ObjectRef::from_obj(svc.as_ref()), %error, failures, ?delay, "reconcile failed");
    Action::requeue(delay)
}

#[tracing::instrument(skip_all, fields(service = %ObjectRef::from_obj(svc)))]
async fn ensure<P: LoadBalancerProvider>(
    svc: &Service,
    ctx: &Context<P>,
) -> Result<Action, ReconcileError> {
    let backends = eligible_backends(ctx.nodes.state().iter().map(Arc::as_ref));
    let desired = match desired_load_balancer(svc, &ctx.cluster_id, backends) {
        Ok(desired) => desired,
        Err(error) => {
            // No cloud call until the Service changes; the retry only re-reports.
            ctx.publish(
                svc,
                &EventDecision::new(
                    EventReason::SyncLoadBalancerFailed,
                    format!("Error syncing load balancer: {error}"),
                ),
            )
            .await;
            let condition = DesiredCondition {
                reason: ConditionReason::InvalidConfiguration,
                message: error.to_string(),
            };
            patch_status(&ctx.client, svc, &IngressUpdate::Keep, Some(&condition)).await?;
            return Err(error.into());
        }
    };
    if !has_finalizer(svc) {
        let mut finalizers = svc.finalizers().to_vec();
        finalizers.push(FINALIZER.to_owned());
        set_finalizers(&ctx.client, svc, finalizers, false).await?;
    }
    if desired.backends.is_empty() {
        ctx.publish(
            svc,
            &EventDecision::new(
                EventReason::UnAvailableLoadBalancer,
                "There are no available nodes for LoadBalancer",
            ),
        )
        .await;
    }
    let known_id = persisted_id(svc).map(str::to_owned);
    let lookup = LoadBalancerLookup {
        known_id: known_id.clone(),
        owner: desired.owner.clone(),
    };
    let outcome = async {
        let observed = ctx.provider.get(&lookup).await?;
        let drift = observed
            .as_ref()
            .map(|o| o.drift(&desired))
            .unwrap_or_default();
        let plan = plan_ensure(observed.as_ref(), &drift);
        if let Some(event) = events_before(&plan) {
            ctx.publish(svc, &event).await;
        }
        let result = match (&plan, observed) {
            (EnsurePlan::InSync, Some(lb)) => Ok(lb),
            (EnsurePlan::UpdateBackends, _) => {
                ctx.provider
                    .update_backends(&lookup, &desired.backends)
                    .await
            }
            _ => ctx.provider.ensure(&desired, known_id.as_deref()).await,
        };
        Ok::<_, ProviderError>((plan, result))
    }
    .await;
    let (plan, result) = match outcome {
        Ok(planned) => planned,
        Err(error) => (
            EnsurePlan::Ensure {
                reason: String::new(),
            },
            Err(error),
        ),
    };
    let lb = match result {
        Ok(lb) => lb,
        Err(error) => {
            let message = error.to_string();
            if let Some(event) = event_after(&plan, Err(&message)) {
                ctx.publish(svc, &event).await;
            }
            let reason = match error {
                ProviderError::IpUnavailable { .. } => ConditionReason::VipUnavailable,
                ProviderError::Invalid { .. } => ConditionReason::InvalidConfiguration,
                _ => ConditionReason::CloudError,
            };
            let condition = DesiredCondition { reason, message };
            // A status write failing here must not hide the cloud error.
            if let Err(status_error) =
                patch_status(&ctx.client, svc, &IngressUpdate::Keep, Some(&condition)).await
            {
                tracing::warn!(%status_error, "cannot report cloud error in status");
            }
            return Err(error.into());
        }
    };
    if persisted_id(svc) != Some(lb.id.as_str()) {
        let patch = json!({ "metadata": { "annotations": { ANNOTATION_LB_ID: lb.id } } });
        api(&ctx.client, svc)
            .patch(
                &svc.name_any(),
                &PatchParams::default(),
                &Patch::Merge(patch),
            )
            .await
            .map_err(kube_err("persist load balancer id"))?;
    }
    if let Some(event) = event_after(&plan, Ok(())) {
        ctx.publish(svc, &event).await;
    }
    let (ingress, condition, next) = match (lb.phase, lb.vip) {
        (LoadBalancerPhase::Active, Some(vip)) => {
            let condition = if desired.backends.is_empty() {
                DesiredCondition {
                    reason: ConditionReason::NoEligibleNodes,
                    message: "no node is eligible to receive traffic".into(),
                }
            } else {
                DesiredCondition {
                    reason: ConditionReason::Ready,
                    message: format!("load balancer {} serves {vip}", lb.id),
                }
            };
            (
                IngressUpdate::Set(ingress_for(vip, &desired)),
                condition,
                Action::requeue(ctx.resync),
            )
        }
        _ => (
            IngressUpdate::Keep,
            DesiredCondition {
                reason: ConditionReason::Provisioning,
                message: format!("load balancer {} is provisioning", lb.id),
            },
            Action::requeue(ctx.provisioning_poll),
        ),
    };
    let first_ingress = matches!(ingress, IngressUpdate::Set(_))
        && svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|l| l.ingress.as_ref())
            .is_none_or(Vec::is_empty);
    if patch_status(&ctx.client, svc, &ingress, Some(&condition)).await?
        && first_ingress
        && let Some(created) = svc.creation_timestamp()
    {
        let elapsed = Timestamp::now().duration_since(created.0);
        ctx.metrics
            .provisioned_after(Duration::try_from(elapsed).unwrap_or_default());
    }
    Ok(next)
}

#[tracing::instrument(skip_all, fields(service = %ObjectRef::from_obj(svc)))]
async fn cleanup<P: LoadBalancerProvider>(
    svc: &Service,
    ctx: &Context<P>,
) -> Result<Action, ReconcileError> {
    let owner = owner_of(svc, &ctx.cluster_id)?;
    ctx.publish(
        svc,
        &EventDecision::new(EventReason::DeletingLoadBalancer, "Deleting load balancer"),
    )
    .await;
    let lookup = LoadBalancerLookup {
        known_id: persisted_id(svc).map(str::to_owned),
        owner,
    };
    let deleted = match ctx.provider.delete(&lookup).await {
        // The persisted id names an LB that is not ours: never touch it, but still delete
        // what our name and tags find.
        Err(ProviderError::ForeignLoadBalancer { id }) => {
            tracing::warn!(%id, "persisted id names a foreign load balancer; ignoring it");
            ctx.provider
                .delete(&LoadBalancerLookup {
                    known_id: None,
                    ..lookup
                })
                .await
        }
        other => other,
    };
    if let Err(error) = deleted {
        ctx.publish(
            svc,
            &EventDecision::new(
                EventReason::DeleteLoadBalancerFailed,
                format!("Error deleting load balancer: {error}"),
            ),
        )
        .await;
        return Err(error.into());
    }
    ctx.publish(
        svc,
        &EventDecision::new(EventReason::DeletedLoadBalancer, "Deleted load balancer"),
    )
    .await;
    if !is_being_deleted(svc) {
        patch_status(&ctx.client, svc, &IngressUpdate::Clear, None).await?;
    }
    let finalizers = svc
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect();
    set_finalizers(&ctx.client, svc, finalizers, !is_being_deleted(svc)).await?;
    Ok(Action::await_change())
}
