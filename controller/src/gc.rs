//! Orphan collection: LBs tagged with our cluster id whose Service no longer wants one, and
//! node pools tagged with it that are not the cluster's pool and no LB references (left by
//! an earlier naming of the pool). Nothing of other clusters is ever listed, let alone
//! deleted.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::runtime::reflector::Store;
use tokio_util::sync::CancellationToken;

use crate::plan::{Ownership, ownership};
use crate::provider::{
    LoadBalancerPhase, LoadBalancerProvider, ObservedLoadBalancer, ObservedNodePool, ProviderError,
};
use crate::reconcile::Context;
use crate::spec::ClassFilter;

/// UIDs of Services that may own an LB: ours to ensure, or holding our finalizer (their
/// cleanup is the reconciler's job, whatever their class says now).
pub fn live_owner_uids(services: &[Arc<Service>], classes: &ClassFilter) -> BTreeSet<String> {
    services
        .iter()
        .filter(|s| ownership(s, classes) != Ownership::Ignore)
        .filter_map(|s| s.uid())
        .collect()
}

/// The LBs to delete: owned by this cluster, and their Service is gone.
pub fn orphans<'a>(
    lbs: &'a [ObservedLoadBalancer],
    live: &BTreeSet<String>,
) -> Vec<&'a ObservedLoadBalancer> {
    lbs.iter()
        .filter(|lb| lb.phase != LoadBalancerPhase::Deleting)
        .filter(|lb| lb.owner.as_ref().is_some_and(|o| !live.contains(&o.uid)))
        .collect()
}

/// The node pools to delete: not the cluster's own pool (`ours`), and no LB references
/// them.
pub fn orphaned_node_pools<'a>(
    pools: &'a [ObservedNodePool],
    ours: Option<&str>,
) -> Vec<&'a ObservedNodePool> {
    pools
        .iter()
        .filter(|pool| Some(pool.name.as_str()) != ours && pool.load_balancers == 0)
        .collect()
}

async fn collect_node_pools<P: LoadBalancerProvider>(
    ctx: &Context<P>,
) -> Result<usize, ProviderError> {
    if !ctx.provider.capabilities().node_pools {
        return Ok(0);
    }
    let pools = ctx.provider.list_owned_node_pools(&ctx.cluster_id).await?;
    let mut collected = 0;
    for pool in orphaned_node_pools(&pools, ctx.node_pool.as_deref()) {
        tracing::info!(pool = %pool.name, "deleting orphaned node pool");
        match ctx.provider.delete_node_pool(&pool.name).await {
            Ok(()) => collected += 1,
            // An LB took it up since the list: not an orphan after all.
            Err(ProviderError::NodePoolInUse { .. }) => {}
            Err(error) => return Err(error),
        }
    }
    Ok(collected)
}

async fn collect_once<P: LoadBalancerProvider>(
    ctx: &Context<P>,
    services: &Store<Service>,
) -> Result<usize, ProviderError> {
    let lbs = ctx.provider.list_owned(&ctx.cluster_id).await?;
    // Read the store after listing: a Service created meanwhile is then already visible.
    let live = live_owner_uids(&services.state(), &ctx.classes);
    tracing::debug!(owned = lbs.len(), live = live.len(), "orphan collection");
    let mut collected = 0;
    for lb in orphans(&lbs, &live) {
        let Some(lookup) = lb.lookup() else {
            continue;
        };
        if lookup.owner.cluster_id != ctx.cluster_id {
            continue;
        }
        tracing::info!(id = %lb.id, service = %lookup.owner.display_name(), "deleting orphaned load balancer");
        ctx.provider.delete(&lookup).await?;
        ctx.metrics.orphans_collected.inc();
        collected += 1;
    }
    Ok(collected)
}

/// Waits until the store holds a complete list. `Store::wait_until_ready` wakes only the
/// most recent of several concurrent waiters (the controller waits on the same store), so
/// poll it again now and then; the readiness it memoizes is seen by the next poll.
pub async fn wait_ready<K>(store: &Store<K>) -> bool
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    loop {
        if let Ok(ready) =
            tokio::time::timeout(Duration::from_millis(250), store.wait_until_ready()).await
        {
            return ready.is_ok();
        }
    }
}

/// Collects orphans every `period` until `cancel`; the store must be ready first, or every
/// LB would look orphaned.
pub async fn run<P: LoadBalancerProvider>(
    ctx: Arc<Context<P>>,
    services: Store<Service>,
    period: Duration,
    cancel: CancellationToken,
) {
    tokio::select! {
        _ = cancel.cancelled() => return,
        ready = wait_ready(&services) => if !ready { return },
    }
    tracing::debug!(?period, "orphan collection started");
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticker.tick() => {
                match collect_once(&ctx, &services).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(collected = n, "orphan collection done"),
                    Err(error) => tracing::warn!(%error, "orphan collection failed; retrying next period"),
                }
                match collect_node_pools(&ctx).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(collected = n, "orphaned node pools deleted"),
                    Err(error) => tracing::warn!(%error, "node pool collection failed; retrying next period"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_pools_other_than_ours_that_no_lb_references_are_orphans() {
        let pool = |name: &str, load_balancers| ObservedNodePool {
            name: name.into(),
            version: 1,
            tags: Default::default(),
            backends: Default::default(),
            load_balancers,
        };
        let pools = [pool("ours", 0), pool("old", 0), pool("old-in-use", 2)];
        let names = |found: Vec<&ObservedNodePool>| -> Vec<String> {
            found.into_iter().map(|p| p.name.clone()).collect()
        };
        assert_eq!(names(orphaned_node_pools(&pools, Some("ours"))), ["old"]);
        // Without a pool of its own, every one that no LB references is an orphan.
        assert_eq!(names(orphaned_node_pools(&pools, None)), ["ours", "old"]);
    }
    use crate::provider::{LoadBalancerMode, LoadBalancerPhase, Owner};
    use crate::spec::tests::service;

    fn lb(uid: &str) -> ObservedLoadBalancer {
        ObservedLoadBalancer {
            id: format!("lb-{uid}"),
            version: 1,
            name: uid.into(),
            owner: Some(Owner {
                cluster_id: "c".parse().unwrap(),
                namespace: "default".into(),
                name: uid.into(),
                uid: uid.into(),
            }),
            phase: LoadBalancerPhase::Active,
            ip_families: vec![],
            vips: vec![],
            hostname: None,
            pool: None,
            sharing_key: None,
            mode: LoadBalancerMode::Proxy,
            listeners: vec![],
            backends: Default::default(),
            node_pool: None,
            source_ranges: vec![],
        }
    }

    #[test]
    fn orphans_are_lbs_without_a_live_service() {
        let classes = ClassFilter {
            class: "x".into(),
            claim_unclassed: true,
        };
        let mut cluster_ip = service("b");
        cluster_ip.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        let mut other_class = service("c");
        other_class.spec.as_mut().unwrap().load_balancer_class = Some("y".into());
        // Switched to ClusterIP, so the API server cleared its class; our finalizer says
        // its LB is still ours to clean up.
        let mut leaving = service("d");
        leaving.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        leaving.metadata.finalizers = Some(vec![crate::plan::FINALIZER.into()]);
        let services = vec![
            Arc::new(service("a")),
            Arc::new(cluster_ip),
            Arc::new(other_class),
            Arc::new(leaving),
        ];
        let live = live_owner_uids(&services, &classes);
        assert_eq!(
            live,
            BTreeSet::from(["uid-a".to_string(), "uid-d".to_string()])
        );
        let mut untagged = lb("uid-z");
        untagged.owner = None;
        let lbs = vec![lb("uid-a"), lb("uid-b"), lb("uid-gone"), untagged];
        let ids: Vec<&str> = orphans(&lbs, &live).iter().map(|l| l.id.as_str()).collect();
        assert_eq!(ids, vec!["lb-uid-b", "lb-uid-gone"]);
    }
}
