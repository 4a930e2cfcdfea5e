//! Node sync: when the eligible node set changes, push the new backends to every LB —
//! once per LB per change, debounced across Services (a rolling node upgrade becomes a few
//! updates, not one per node per Service), with bounded concurrency.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::nodes::{NodeSet, eligible_backends};
use crate::predicate::{EventDecision, EventReason};
use crate::provider::{LoadBalancerLookup, LoadBalancerProvider, ProviderError};
use crate::reconcile::{Context, FINALIZER};
use crate::spec::{is_being_deleted, is_load_balancer, owner_of, persisted_id};

/// The Services whose LBs follow the node set: ours, of type LoadBalancer, not being
/// deleted, and already holding our finalizer (so an LB may exist).
pub fn services_to_sync<P>(services: &[Arc<Service>], ctx: &Context<P>) -> Vec<Arc<Service>> {
    services
        .iter()
        .filter(|s| {
            ctx.classes.class_is_ours(s)
                && is_load_balancer(s)
                && !is_being_deleted(s)
                && s.finalizers().iter().any(|f| f == FINALIZER)
        })
        .cloned()
        .collect()
}

async fn sync_one<P: LoadBalancerProvider>(
    ctx: &Context<P>,
    svc: &Service,
    backends: &BTreeSet<Ipv4Addr>,
) -> Result<(), ProviderError> {
    let owner = owner_of(svc, &ctx.cluster_id).map_err(|e| ProviderError::Invalid {
        operation: crate::provider::Operation::Update,
        message: e.to_string(),
    })?;
    let lookup = LoadBalancerLookup {
        known_id: persisted_id(svc).map(str::to_owned),
        owner,
    };
    let result = ctx
        .provider
        .update_backends(&lookup, backends)
        .await
        .map(drop);
    let event = match &result {
        Ok(()) => EventDecision::new(
            EventReason::UpdatedLoadBalancer,
            "Updated load balancer with new hosts",
        ),
        Err(e) => EventDecision::new(
            EventReason::UpdateLoadBalancerFailed,
            format!("Error updating load balancer with new hosts: {e}"),
        ),
    };
    ctx.publish(svc, &event).await;
    if backends.is_empty() {
        ctx.publish(
            svc,
            &EventDecision::new(
                EventReason::UnAvailableLoadBalancer,
                "There are no available nodes for LoadBalancer",
            ),
        )
        .await;
    }
    result
}

/// Runs until `cancel`: drives the node watch stream (which feeds `ctx.nodes`), and after
/// each burst of node changes (quiet for `debounce`) updates all LBs if the set differs.
/// Services whose update failed are sent to `retry` for a full reconcile.
pub async fn run<P: LoadBalancerProvider>(
    ctx: Arc<Context<P>>,
    node_events: impl Stream<Item = Result<watcher::Event<Node>, watcher::Error>> + Send,
    services: Store<Service>,
    debounce: Duration,
    concurrency: usize,
    retry: mpsc::UnboundedSender<ObjectRef<Service>>,
    cancel: CancellationToken,
) {
    let mut node_events = std::pin::pin!(node_events);
    let mut synced = NodeSet::default();
    let mut dirty_since: Option<Instant> = None;
    let mut deadline: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            event = node_events.next() => match event {
                // The first complete list is the baseline: the start-up ensure of every
                // Service reads the same store, so nothing needs pushing yet.
                Some(Ok(watcher::Event::InitDone)) if synced == NodeSet::default() => {
                    synced.record(eligible_backends(ctx.nodes.state().iter().map(Arc::as_ref)));
                }
                Some(Ok(watcher::Event::Init | watcher::Event::InitApply(_))) => {}
                Some(Ok(_)) => {
                    let now = Instant::now();
                    let first = *dirty_since.get_or_insert(now);
                    // Wait for a quiet `debounce`, but never longer than ten of them.
                    deadline = Some((now + debounce).min(first + debounce * 10));
                }
                Some(Err(error)) => tracing::warn!(%error, "node watch error"),
                None => return,
            },
            _ = sleep_until_opt(deadline) => {
                deadline = None;
                let Some(started) = dirty_since.take() else { continue };
                let current = eligible_backends(ctx.nodes.state().iter().map(Arc::as_ref));
                if !synced.differs(&current) {
                    continue;
                }
                let targets = services_to_sync(&services.state(), &ctx);
                tracing::info!(nodes = current.len(), services = targets.len(), "node set changed; updating load balancers");
                let results: Vec<(Arc<Service>, Result<(), ProviderError>)> = futures::stream::iter(targets)
                    .map(|svc| {
                        let ctx = ctx.clone();
                        let current = current.clone();
                        async move {
                            let result = sync_one(&ctx, &svc, &current).await;
                            (svc, result)
                        }
                    })
                    .buffer_unordered(concurrency.max(1))
                    .collect()
                    .await;
                for (svc, result) in &results {
                    if let Err(error) = result {
                        tracing::warn!(service = %ObjectRef::from_obj(svc.as_ref()), %error, "backend update failed; reconciling");
                        // The receiver only goes away at shutdown.
                        let _ = retry.send(ObjectRef::from_obj(svc.as_ref()));
                    }
                }
                // Failed Services are repaired by their reconcile, which reads the same set.
                synced.record(current);
                ctx.metrics.node_sync_latency.observe(started.elapsed().as_secs_f64());
            }
        }
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
