//! The Service reconciler: observe → decide ([`crate::plan`]) → act. Observe reads once
//! (the Service's ownership, owner, persisted id, desired LB and the cloud's LB); the
//! decision is pure; act performs its finished writes and decides nothing.
//!
//! Order of effects per Service, always: finalizer added (before any cloud call) → Events
//! before → the one cloud call → LB id annotation (right after create) → Events after →
//! status → finalizer and id removed (after a successful cleanup).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{LoadBalancerIngress, Namespace, Node, ObjectReference, Service};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::nodes::eligible_backends;
use crate::plan::{
    CloudAction, EventDecision, MetadataPatch, Next, Observation, Ownership, Plan, PlanError, Seen,
    decide, lookup_of, may_have_load_balancer, ownership, servable,
};
use crate::provider::{
    ClusterId, DesiredLoadBalancer, LoadBalancerProvider, ObservedLoadBalancer, ProviderError,
    delete_ours,
};
use crate::provisioning::{self, ProvisioningWaits};
use crate::ratelimit::{PERMANENT_ERROR_RETRY, service_backoff};
use crate::spec::{AnnotationKeys, ClassFilter, WithoutNodePorts, desired_load_balancer};
use crate::status::{IngressFields, StatusWrite, current_ingress};

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Plan(#[from] PlanError),
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
            ReconcileError::Plan(e) => e.category(),
            ReconcileError::Kube { .. } => "kubernetes",
        }
    }

    /// Retrying soon would fail the same way: the Service, its Namespace or the cloud has
    /// to change first.
    pub fn is_permanent(&self) -> bool {
        match self {
            ReconcileError::Plan(PlanError::Provider(e)) => e.is_permanent(),
            ReconcileError::Plan(PlanError::Spec(_) | PlanError::Unsupported(_)) => true,
            ReconcileError::Kube { .. } => false,
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
    /// The provider's annotations.
    pub keys: AnnotationKeys,
    pub cluster_id: ClusterId,
    pub classes: ClassFilter,
    pub without_node_ports: WithoutNodePorts,
    /// The pool of Services whose Service and Namespace name none (`None`: the cloud's).
    pub default_pool: Option<String>,
    pub nodes: Store<Node>,
    /// For the address pool a Namespace names for its Services.
    pub namespaces: Store<Namespace>,
    pub recorder: Recorder,
    pub metrics: Metrics,
    /// Re-ensure period of every Service: the drift-repair backstop.
    pub resync: Duration,
    /// The cluster's node pool its LBs reference, when the provider has node pools (see
    /// [`crate::nodesync`]); `None`: each LB carries its backends.
    pub node_pool: Option<String>,
    /// Told when an LB found the node pool missing (deleted behind our back): node sync
    /// writes it again at once.
    pub node_pool_missing: tokio::sync::Notify,
    /// How long to wait before reading a provisioning LB again when its provisioning is
    /// not waited out ([`crate::provisioning`]), and a deleting one.
    pub provisioning_poll: Duration,
    pub(crate) provisioning: Arc<ProvisioningWaits>,
    /// The ingress fields the API server keeps: guessed from its version, corrected by
    /// what each status write returns.
    ingress_fields: Mutex<IngressFields>,
    failures: Mutex<HashMap<ObjectRef<Service>, u32>>,
}

/// The parts [`Context::new`] builds a [`Context`] from, by name. Each becomes the field of
/// the same name, but `ingress_fields` (only the first guess: status writes correct it) and
/// `wake` (starts a reconcile of a Service whose held read answered, see
/// [`crate::provisioning`]).
pub struct ContextParts<P> {
    pub client: kube::Client,
    pub provider: P,
    pub cluster_id: ClusterId,
    pub classes: ClassFilter,
    pub without_node_ports: WithoutNodePorts,
    pub default_pool: Option<String>,
    pub nodes: Store<Node>,
    pub namespaces: Store<Namespace>,
    pub recorder: Recorder,
    pub metrics: Metrics,
    pub resync: Duration,
    pub ingress_fields: IngressFields,
    pub wake: mpsc::UnboundedSender<ObjectRef<Service>>,
}

impl<P: LoadBalancerProvider> Context<P> {
    pub fn new(parts: ContextParts<P>) -> Self {
        let ContextParts {
            client,
            provider,
            cluster_id,
            classes,
            without_node_ports,
            default_pool,
            nodes,
            namespaces,
            recorder,
            metrics,
            resync,
            ingress_fields,
            wake,
        } = parts;
        Self {
            client,
            keys: AnnotationKeys::of(provider.profile()),
            node_pool: provider
                .capabilities()
                .node_pools
                .then(|| cluster_id.node_pool_name()),
            node_pool_missing: tokio::sync::Notify::new(),
            provider,
            cluster_id,
            classes,
            without_node_ports,
            default_pool,
            nodes,
            namespaces,
            recorder,
            metrics,
            resync,
            provisioning_poll: Duration::from_secs(2),
            provisioning: Arc::new(ProvisioningWaits::new(wake)),
            ingress_fields: Mutex::new(ingress_fields),
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Records an Event; failures are logged, never fatal (Events are best effort).
    async fn publish(&self, reference: &ObjectReference, decision: &EventDecision) {
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
        if let Err(error) = self.recorder.publish(&event, reference).await {
            tracing::warn!(%error, reason = decision.reason.as_str(), "cannot record event");
        }
    }

    fn record_failure(&self, svc: &Service) -> u32 {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let count = failures.entry(ObjectRef::from_obj(svc)).or_insert(0);
        *count = count.saturating_add(1);
        *count
    }

    /// The pool the Service's Namespace names, else the controller's default.
    fn inherited_pool(&self, svc: &Service) -> Option<String> {
        let namespace = svc
            .namespace()
            .and_then(|ns| self.namespaces.get(&ObjectRef::new(&ns)));
        namespace
            .as_deref()
            .and_then(|ns| self.keys.namespace_pool(ns))
            .map(str::to_owned)
            .or_else(|| self.default_pool.clone())
    }

    fn ingress_fields(&self) -> IngressFields {
        *self
            .ingress_fields
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Learns from a written Service which ingress fields the server drops.
    fn learn_ingress_fields(&self, sent: &[LoadBalancerIngress], written: &Service) {
        let mut fields = self
            .ingress_fields
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let learned = fields.learn(sent, current_ingress(written));
        if learned != *fields {
            tracing::info!(
                ip_mode = learned.ip_mode,
                ports = learned.ports,
                "the API server drops status.loadBalancer.ingress fields; writing only those it keeps"
            );
            *fields = learned;
        }
    }

    fn clear_failures(&self, svc: &Service) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.remove(&ObjectRef::from_obj(svc));
    }
}

/// The Service the act writes to. Its reference (what Events name) carries the
/// resourceVersion of the last write's answer, so a guarded patch after it fails only on
/// someone else's change.
struct Target {
    api: Api<Service>,
    name: String,
    reference: ObjectReference,
}

impl Target {
    fn new(client: &kube::Client, svc: &Service) -> Self {
        // `object_ref` leaves the resourceVersion out; the first guarded patch needs the
        // observed one (a real API server refuses a merge patch that clears it).
        let mut reference = svc.object_ref(&());
        reference.resource_version = svc.resource_version();
        Self {
            api: Api::namespaced(client.clone(), &svc.namespace().unwrap_or_default()),
            name: svc.name_any(),
            reference,
        }
    }

    async fn patch(&mut self, patch: &MetadataPatch) -> Result<(), ReconcileError> {
        let mut metadata = patch.metadata.clone();
        if patch.guarded {
            metadata["resourceVersion"] = json!(self.reference.resource_version);
        }
        let written = self
            .api
            .patch(
                &self.name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "metadata": metadata })),
            )
            .await
            .map_err(kube_err(patch.action))?;
        self.reference.resource_version = written.resource_version();
        Ok(())
    }

    async fn write_status(&mut self, write: &StatusWrite) -> Result<Service, ReconcileError> {
        let written = self
            .api
            .patch_status(
                &self.name,
                &PatchParams::default(),
                &Patch::Strategic(&write.body),
            )
            .await
            .map_err(kube_err("patch status"))?;
        self.reference.resource_version = written.resource_version();
        Ok(written)
    }
}

/// Observe: everything the decision needs, read once; the LB is asked of the cloud (the
/// reconcile's one read) only when the Service is valid and may have one.
async fn observe<'a, P: LoadBalancerProvider>(
    svc: &'a Service,
    ownership: Ownership,
    ctx: &Context<P>,
) -> Observation<'a> {
    let lookup = lookup_of(svc, &ctx.keys, &ctx.cluster_id);
    let desired = (ownership == Ownership::Ensure).then(|| {
        let owner = lookup.as_ref().map_err(Clone::clone)?.owner.clone();
        let backends = eligible_backends(ctx.nodes.state().iter().map(Arc::as_ref));
        let inherited_pool = ctx.inherited_pool(svc);
        servable(
            desired_load_balancer(
                svc,
                &ctx.keys,
                owner,
                backends,
                ctx.without_node_ports,
                inherited_pool.as_deref(),
            )
            .map(|desired| DesiredLoadBalancer {
                node_pool: ctx.node_pool.clone(),
                ..desired
            }),
            ctx.provider.profile().name,
            ctx.provider.capabilities(),
        )
    });
    let seen = match (&desired, &lookup) {
        (Some(Ok(_)), Ok(lookup)) if may_have_load_balancer(svc, lookup) => {
            // A held read that just saw the LB leave provisioning was this read.
            let waited = ctx
                .provisioning
                .take(&ObjectRef::from_obj(svc), &lookup.owner);
            match waited {
                Some(lb) => Seen::Found(lb),
                None => match ctx.provider.get(lookup).await {
                    Ok(Some(lb)) => Seen::Found(lb),
                    Ok(None) => Seen::Missing,
                    Err(error) => Seen::Failed(error),
                },
            }
        }
        _ => Seen::NotAsked,
    };
    let planned_id = match (&seen, &desired, &lookup) {
        (Seen::NotAsked | Seen::Missing, Some(Ok(desired)), Ok(lookup)) => {
            ctx.provider.planned_id(desired, lookup.known_id.as_deref())
        }
        _ => None,
    };
    Observation {
        svc,
        ownership,
        lookup,
        desired,
        seen,
        planned_id,
    }
}

/// The cloud call of a plan.
async fn call_cloud<P: LoadBalancerProvider>(
    action: &CloudAction,
    ctx: &Context<P>,
) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
    match action {
        CloudAction::None => Ok(None),
        CloudAction::Create { desired, replaces } => ctx
            .provider
            .create(desired, replaces.as_deref())
            .await
            .map(Some),
        CloudAction::Update { current, desired } => {
            ctx.provider.update(current, desired).await.map(Some)
        }
        CloudAction::Delete(lookup) => delete_ours(&ctx.provider, lookup).await,
    }
}

/// Act: performs `plan` in the fixed order, deciding nothing. A failed write stops the
/// sequence; the retry decides again from what it observes then.
async fn act<P: LoadBalancerProvider>(
    svc: &Service,
    plan: &Plan<'_>,
    ctx: &Context<P>,
) -> Result<Next, ReconcileError> {
    let mut target = Target::new(&ctx.client, svc);
    if let Some(patch) = &plan.add_finalizer {
        target.patch(patch).await?;
    }
    for event in &plan.events_before {
        ctx.publish(&target.reference, event).await;
    }
    let result = call_cloud(&plan.cloud, ctx).await;
    let settled = plan.settle(result, ctx.ingress_fields(), Timestamp::now());
    if let Some(patch) = &settled.persist_id {
        target.patch(patch).await?;
    }
    for event in &settled.events {
        ctx.publish(&target.reference, event).await;
    }
    if let Some(write) = &settled.status {
        match target.write_status(write).await {
            Ok(written) => {
                if let Some(sent) = &write.ingress {
                    ctx.learn_ingress_fields(sent, &written);
                }
                if settled.first_ingress
                    && let Some(created) = svc.creation_timestamp()
                {
                    let elapsed = Timestamp::now().duration_since(created.0);
                    ctx.metrics
                        .provisioned_after(Duration::try_from(elapsed).unwrap_or_default());
                }
            }
            // A status write failing must not hide the error the status reports.
            Err(error) if settled.outcome.is_err() => {
                tracing::warn!(%error, "cannot report the failure in status");
            }
            Err(error) => return Err(error),
        }
    }
    if let Some(patch) = &settled.remove_finalizer {
        target.patch(patch).await?;
    }
    Ok(settled.outcome?)
}

/// Observe → decide → act for one Service; also what node sync and drift repair run.
pub async fn sync_service<P: LoadBalancerProvider>(
    svc: &Service,
    ctx: &Context<P>,
) -> Result<Next, ReconcileError> {
    sync(svc, ownership(svc, &ctx.classes), ctx).await
}

/// Observe → decide → act, with the Service's ownership already known.
#[tracing::instrument(skip_all, fields(service = %ObjectRef::from_obj(svc)))]
async fn sync<P: LoadBalancerProvider>(
    svc: &Service,
    ownership: Ownership,
    ctx: &Context<P>,
) -> Result<Next, ReconcileError> {
    let observation = observe(svc, ownership, ctx).await;
    let plan = decide(observation, &ctx.keys);
    act(svc, &plan, ctx).await
}

/// The kube-runtime reconciler.
pub async fn reconcile<P: LoadBalancerProvider>(
    svc: Arc<Service>,
    ctx: Arc<Context<P>>,
) -> Result<Action, ReconcileError> {
    let ownership = ownership(&svc, &ctx.classes);
    if ownership == Ownership::Ignore {
        return Ok(Action::await_change());
    }
    let result = sync(&svc, ownership, &ctx).await;
    ctx.metrics
        .reconciled(result.as_ref().map(drop).map_err(ReconcileError::category));
    if result.is_ok() {
        ctx.clear_failures(&svc);
    }
    result.map(|next| match next {
        Next::Resync => Action::requeue(ctx.resync),
        Next::Provisioning(lb) => {
            if wait_out_provisioning(&ctx, ObjectRef::from_obj(svc.as_ref()), *lb) {
                // The held read's answer starts the next reconcile; this is the backstop.
                Action::requeue(provisioning::HELD_READ + ctx.provisioning_poll)
            } else {
                Action::requeue(ctx.provisioning_poll)
            }
        }
        Next::Poll => Action::requeue(ctx.provisioning_poll),
        Next::AwaitChange => Action::await_change(),
    })
}

/// Waits out the provisioning of `lb`, `svc`'s LB, with a read the cloud holds
/// ([`crate::provisioning`]); `false` when it cannot (the provider holds no reads, or too
/// many are held), so the caller polls.
fn wait_out_provisioning<P: LoadBalancerProvider>(
    ctx: &Arc<Context<P>>,
    svc: ObjectRef<Service>,
    lb: ObservedLoadBalancer,
) -> bool {
    if !ctx.provider.capabilities().waits_out_provisioning {
        return false;
    }
    let id = lb.id.clone();
    let reader = ctx.clone();
    ctx.provisioning.wait_out(svc, &id, async move {
        reader
            .provider
            .await_provisioned(&lb, provisioning::HELD_READ)
            .await
    })
}

/// Per-Service exponential backoff, 5 s → 300 s; a permanent error waits for a change,
/// with [`PERMANENT_ERROR_RETRY`] as the backstop, so it never storms the cloud.
pub fn error_policy<P: LoadBalancerProvider>(
    svc: Arc<Service>,
    error: &ReconcileError,
    ctx: Arc<Context<P>>,
) -> Action {
    let failures = ctx.record_failure(&svc);
    if let ReconcileError::Plan(PlanError::Provider(ProviderError::NodePoolMissing { .. })) = error
    {
        ctx.node_pool_missing.notify_one();
    }
    let delay = if error.is_permanent() {
        PERMANENT_ERROR_RETRY
    } else {
        service_backoff(failures)
    };
    tracing::warn!(service = %ObjectRef::from_obj(svc.as_ref()), %error, failures, ?delay, "reconcile failed");
    Action::requeue(delay)
}
