//! Node sync: when the eligible node set changes, bring every LB to it — once per LB per
//! change, debounced across Services (a rolling node upgrade becomes a few updates, not
//! one per node per Service), with bounded concurrency. Each Service goes through the same
//! observe → decide → act as a reconcile, so a node change costs one read and one backend
//! update per LB, and an LB that drifted otherwise is repaired on the way.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::nodes::{NodeSet, eligible_backends};
use crate::plan::{Ownership, has_finalizer, ownership};
use crate::provider::LoadBalancerProvider;
use crate::reconcile::{Context, ReconcileError, sync_service};
use crate::spec::ClassFilter;

/// The Services whose LBs follow the node set: ours to ensure, and already holding our
/// finalizer (so an LB may exist; the others get the node set with their first ensure).
pub fn services_to_sync(services: &[Arc<Service>], classes: &ClassFilter) -> Vec<Arc<Service>> {
    services
        .iter()
        .filter(|s| ownership(s, classes) == Ownership::Ensure && has_finalizer(s))
        .cloned()
        .collect()
}

/// Runs until `cancel`: after each burst of node changes (`node_changes` ticks; quiet for
/// `debounce`) syncs every LB if the eligible set differs from the last one pushed.
/// Services whose sync failed are sent to `retry` for a reconcile with backoff.
pub async fn run<P: LoadBalancerProvider>(
    ctx: Arc<Context<P>>,
    mut node_changes: watch::Receiver<u64>,
    services: Store<Service>,
    debounce: Duration,
    concurrency: usize,
    retry: mpsc::UnboundedSender<ObjectRef<Service>>,
    cancel: CancellationToken,
) {
    // The baseline: the start-up ensure of every Service reads the same store.
    let mut synced = NodeSet::default();
    synced.record(eligible_backends(ctx.nodes.state().iter().map(Arc::as_ref)));
    node_changes.mark_unchanged();
    let mut dirty_since: Option<Instant> = None;
    let mut deadline: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = node_changes.changed() => {
                if changed.is_err() {
                    return;
                }
                let now = Instant::now();
                let first = *dirty_since.get_or_insert(now);
                // Wait for a quiet `debounce`, but never longer than ten of them.
                deadline = Some((now + debounce).min(first + debounce * 10));
            }
            _ = sleep_until_opt(deadline) => {
                deadline = None;
                let Some(started) = dirty_since.take() else { continue };
                let current = eligible_backends(ctx.nodes.state().iter().map(Arc::as_ref));
                if !synced.differs(&current) {
                    continue;
                }
                let targets = services_to_sync(&services.state(), &ctx.classes);
                tracing::info!(nodes = current.len(), services = targets.len(), "node set changed; updating load balancers");
                let results: Vec<(Arc<Service>, Result<_, ReconcileError>)> = futures::stream::iter(targets)
                    .map(|svc| {
                        let ctx = ctx.clone();
                        async move {
                            let result = sync_service(&svc, &ctx).await;
                            (svc, result)
                        }
                    })
                    .buffer_unordered(concurrency.max(1))
                    .collect()
                    .await;
                for (svc, result) in &results {
                    if let Err(error) = result {
                        tracing::warn!(service = %ObjectRef::from_obj(svc.as_ref()), %error, "node sync failed; reconciling");
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::FINALIZER;
    use crate::spec::tests::service;
    use kube::ResourceExt;

    #[test]
    fn only_services_to_ensure_that_may_have_an_lb_follow_the_nodes() {
        let classes = ClassFilter {
            class: "ours".into(),
            claim_unclassed: false,
        };
        let make = |name: &str, class: Option<&str>, lb: bool, finalizer: bool| {
            let mut svc = service(name);
            let spec = svc.spec.as_mut().unwrap();
            spec.load_balancer_class = class.map(str::to_owned);
            if !lb {
                spec.type_ = Some("ClusterIP".into());
            }
            if finalizer {
                svc.metadata.finalizers = Some(vec![FINALIZER.into()]);
            }
            Arc::new(svc)
        };
        let services = vec![
            make("served", Some("ours"), true, true),
            make("not-yet-created", Some("ours"), true, false),
            // Switched to ClusterIP: its class went with the type; cleanup, not node sync.
            make("leaving", None, false, true),
            make("unclassed", None, true, true),
            make("theirs", Some("theirs"), true, false),
        ];
        let names: Vec<String> = services_to_sync(&services, &classes)
            .iter()
            .map(|s| s.name_any())
            .collect();
        assert_eq!(names, vec!["served"]);
    }
}
