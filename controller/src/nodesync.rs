//! Node sync: when the eligible node set changes, bring every LB to it, debounced across
//! Services (a rolling node upgrade becomes a few updates, not one per node per Service).
//!
//! With a provider that has node pools, the LBs reference the cluster's pool and a node
//! change is one pool write, whatever the number of LBs (as GCE's instance groups shared
//! by every LB of a cluster); the pool is claimed at start, checked at the drift-repair
//! period and written again at once when an LB finds it missing. Without node pools each
//! LB carries its backends, and each Service goes through the same observe → decide → act
//! as a reconcile, with bounded concurrency: one read and one backend update per LB.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::{ObjectRef, Store};
use tandem_common::IpFamily;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::nodes::{NodeSet, eligible_backends};
use crate::plan::{Ownership, has_finalizer, ownership};
use crate::provider::{
    ClusterId, DesiredNodePool, LoadBalancerProvider, ObservedNodePool, ProviderError,
};
use crate::ratelimit::service_backoff;
use crate::reconcile::{Context, ReconcileError, sync_service};
use crate::spec::ClassFilter;

/// What to do about the cluster's node pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolWrite {
    /// It already is what we want.
    InStep,
    /// Write it; conditional on this version when it exists.
    Write { version: Option<u64> },
}

/// Decides the node-pool write: nothing when `observed` already is `desired`; a refusal when
/// another cluster claimed the pool (its `kube-system` UID differs from ours: two clusters
/// were given one cluster id); else a write over what was observed. A pool without a
/// cluster UID (written by an earlier controller) is ours to claim.
pub fn plan_node_pool(
    observed: Option<&ObservedNodePool>,
    desired: &DesiredNodePool,
) -> Result<PoolWrite, ProviderError> {
    let Some(observed) = observed else {
        return Ok(PoolWrite::Write { version: None });
    };
    if let Some(claimed_by) = observed.cluster_uid()
        && claimed_by != desired.cluster_uid
    {
        return Err(ProviderError::ForeignNodePool {
            name: observed.name.clone(),
            claimed_by: claimed_by.to_owned(),
            ours: desired.cluster_uid.clone(),
        });
    }
    if observed.matches(desired) {
        Ok(PoolWrite::InStep)
    } else {
        Ok(PoolWrite::Write {
            version: Some(observed.version),
        })
    }
}

/// Writes of the pool that may meet a concurrent change before this one gives up for now.
const POOL_CONFLICT_RETRIES: u32 = 3;

/// The cluster's node pool as node sync keeps it, with what the cloud last said of it, so
/// that a node change costs the one write.
#[derive(Debug, Clone)]
pub struct NodePoolKeeper {
    name: String,
    cluster_id: ClusterId,
    cluster_uid: String,
    observed: Option<ObservedNodePool>,
}

impl NodePoolKeeper {
    pub fn new(name: String, cluster_id: ClusterId, cluster_uid: String) -> Self {
        Self {
            name,
            cluster_id,
            cluster_uid,
            observed: None,
        }
    }

    fn desired(&self, backends: &BTreeSet<IpAddr>) -> DesiredNodePool {
        DesiredNodePool {
            name: self.name.clone(),
            cluster_id: self.cluster_id.clone(),
            cluster_uid: self.cluster_uid.clone(),
            backends: backends.clone(),
        }
    }

    /// Forgets what the cloud said: the next sync reads the pool first (the drift check, or
    /// an LB that found the pool missing).
    pub fn forget(&mut self) {
        self.observed = None;
    }

    /// Brings the pool to `backends`: one write when what the cloud last said is still
    /// true, a read and a write when it is not known or changed meanwhile.
    pub async fn sync<P: LoadBalancerProvider>(
        &mut self,
        provider: &P,
        backends: &BTreeSet<IpAddr>,
    ) -> Result<(), ProviderError> {
        let desired = self.desired(backends);
        let mut conflicts = 0;
        loop {
            if self.observed.is_none() {
                self.observed = provider.get_node_pool(&self.name).await?;
            }
            let version = match plan_node_pool(self.observed.as_ref(), &desired)? {
                PoolWrite::InStep => return Ok(()),
                PoolWrite::Write { version } => version,
            };
            match provider.put_node_pool(&desired, version).await {
                Ok(written) => {
                    self.observed = Some(written);
                    return Ok(());
                }
                Err(ProviderError::Conflict { .. }) if conflicts < POOL_CONFLICT_RETRIES => {
                    conflicts += 1;
                    self.observed = None;
                }
                Err(error) => {
                    self.observed = None;
                    return Err(error);
                }
            }
        }
    }

    /// Claims and fills the pool before the first reconcile, retrying transient failures
    /// with backoff until `cancel`; a pool another cluster claimed is refused at once.
    pub async fn claim<P: LoadBalancerProvider>(
        &mut self,
        provider: &P,
        backends: &BTreeSet<IpAddr>,
        cancel: &CancellationToken,
    ) -> Result<(), ProviderError> {
        let mut failures = 0;
        loop {
            match self.sync(provider, backends).await {
                Ok(()) => {
                    tracing::info!(pool = %self.name, nodes = backends.len(), "node pool claimed");
                    return Ok(());
                }
                Err(error) if error.is_permanent() => return Err(error),
                Err(error) => {
                    failures += 1;
                    let delay = service_backoff(failures);
                    tracing::warn!(pool = %self.name, %error, ?delay, "cannot claim the node pool yet; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }
}

/// The families of `backends`: a family appearing or vanishing changes whether LBs of
/// that family are available, which their Services report.
fn families(backends: &BTreeSet<IpAddr>) -> BTreeSet<IpFamily> {
    backends.iter().copied().map(IpFamily::of).collect()
}

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
/// `debounce`) brings the LBs to the eligible set if it differs from the last one pushed:
/// through `pool` when the provider has node pools, else LB by LB. Services whose sync
/// failed, or whose availability changed with the pool, are sent to `retry` for a
/// reconcile.
#[allow(clippy::too_many_arguments)]
pub async fn run<P: LoadBalancerProvider>(
    ctx: Arc<Context<P>>,
    mut pool: Option<NodePoolKeeper>,
    mut node_changes: watch::Receiver<u64>,
    services: Store<Service>,
    debounce: Duration,
    concurrency: usize,
    retry: mpsc::UnboundedSender<ObjectRef<Service>>,
    cancel: CancellationToken,
) {
    // The baseline: the start-up ensure of every Service (and the pool's claim) read the
    // same store.
    let baseline = eligible_backends(ctx.nodes.state().iter().map(Arc::as_ref));
    let mut synced_families = families(&baseline);
    let mut synced = NodeSet::default();
    synced.record(baseline);
    node_changes.mark_unchanged();
    let mut dirty_since: Option<Instant> = None;
    let mut deadline: Option<Instant> = None;
    let mut pool_failures = 0;
    // Set by the drift check and by an LB that found the pool missing.
    let mut recheck = false;
    let mut drift_check = tokio::time::interval_at(Instant::now() + ctx.resync, ctx.resync);
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
                continue;
            }
            // The pool's drift check, or an LB found it missing: read it again and repair.
            _ = drift_check.tick(), if pool.is_some() => recheck = true,
            _ = ctx.node_pool_missing.notified(), if pool.is_some() => recheck = true,
            _ = sleep_until_opt(deadline) => {}
        }
        deadline = None;
        let started = dirty_since.take().unwrap_or_else(Instant::now);
        let current = eligible_backends(ctx.nodes.state().iter().map(Arc::as_ref));
        let Some(keeper) = pool.as_mut() else {
            if synced.differs(&current) {
                sync_each_load_balancer(&ctx, &services, &current, concurrency, &retry).await;
                synced.record(current);
                ctx.metrics
                    .node_sync_latency
                    .observe(started.elapsed().as_secs_f64());
            }
            continue;
        };
        // Nodes change all the time (status heartbeats) without the set changing: that
        // costs the cloud nothing. Only a check reads the pool again.
        if !synced.differs(&current) {
            if !std::mem::take(&mut recheck) {
                continue;
            }
            keeper.forget();
        }
        match keeper.sync(&ctx.provider, &current).await {
            Ok(()) => {
                pool_failures = 0;
                let now_families = families(&current);
                if now_families != synced_families {
                    // Their conditions and Events say whether the LB reaches any node.
                    for svc in services_to_sync(&services.state(), &ctx.classes) {
                        let _ = retry.send(ObjectRef::from_obj(svc.as_ref()));
                    }
                    synced_families = now_families;
                }
                if synced.differs(&current) {
                    tracing::info!(nodes = current.len(), "node set changed; node pool updated");
                    synced.record(current);
                    ctx.metrics
                        .node_sync_latency
                        .observe(started.elapsed().as_secs_f64());
                }
            }
            Err(error) => {
                pool_failures += 1;
                let delay = service_backoff(pool_failures);
                tracing::warn!(%error, ?delay, "node pool update failed; retrying");
                recheck = true;
                dirty_since = Some(started);
                deadline = Some(Instant::now() + delay);
            }
        }
    }
}

/// Without node pools: every LB brought to the node set through its Service's sync.
async fn sync_each_load_balancer<P: LoadBalancerProvider>(
    ctx: &Arc<Context<P>>,
    services: &Store<Service>,
    current: &BTreeSet<IpAddr>,
    concurrency: usize,
    retry: &mpsc::UnboundedSender<ObjectRef<Service>>,
) {
    let targets = services_to_sync(&services.state(), &ctx.classes);
    tracing::info!(
        nodes = current.len(),
        services = targets.len(),
        "node set changed; updating load balancers"
    );
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
            // The receiver only goes away at shutdown. Failed Services are repaired by
            // their reconcile, which reads the same set.
            let _ = retry.send(ObjectRef::from_obj(svc.as_ref()));
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
    use crate::fake::{Call, FakeProvider};
    use crate::plan::FINALIZER;
    use crate::provider::TAG_CLUSTER_UID;
    use crate::spec::tests::service;
    use kube::ResourceExt;

    fn ips(list: &[&str]) -> BTreeSet<IpAddr> {
        list.iter().map(|ip| ip.parse().unwrap()).collect()
    }

    fn keeper() -> NodePoolKeeper {
        let cluster: ClusterId = "c1".parse().unwrap();
        NodePoolKeeper::new(cluster.node_pool_name(), cluster, "uid-1".into())
    }

    #[test]
    fn the_pool_is_written_when_absent_or_different_and_refused_when_another_cluster_holds_it() {
        let desired = keeper().desired(&ips(&["198.18.0.11"]));
        assert_eq!(
            plan_node_pool(None, &desired),
            Ok(PoolWrite::Write { version: None })
        );
        let observed = |uid: Option<&str>, backends: &[&str]| ObservedNodePool {
            name: desired.name.clone(),
            version: 7,
            tags: match uid {
                Some(_) => desired.tags(),
                // Written by an earlier controller: the cluster id alone.
                None => desired
                    .tags()
                    .into_iter()
                    .filter(|(k, _)| k != TAG_CLUSTER_UID)
                    .collect(),
            }
            .into_iter()
            .map(|(k, v)| match (k.as_str(), uid) {
                (TAG_CLUSTER_UID, Some(uid)) => (k, uid.to_owned()),
                _ => (k, v),
            })
            .collect(),
            backends: ips(backends),
            load_balancers: 3,
        };
        let same = observed(Some("uid-1"), &["198.18.0.11"]);
        assert_eq!(plan_node_pool(Some(&same), &desired), Ok(PoolWrite::InStep));
        let moved = observed(Some("uid-1"), &["198.18.0.12"]);
        assert_eq!(
            plan_node_pool(Some(&moved), &desired),
            Ok(PoolWrite::Write { version: Some(7) })
        );
        let unclaimed = observed(None, &["198.18.0.11"]);
        assert_eq!(
            plan_node_pool(Some(&unclaimed), &desired),
            Ok(PoolWrite::Write { version: Some(7) })
        );
        let foreign = observed(Some("uid-2"), &["198.18.0.11"]);
        let refused = plan_node_pool(Some(&foreign), &desired).unwrap_err();
        assert!(
            matches!(&refused, ProviderError::ForeignNodePool { claimed_by, .. } if claimed_by == "uid-2"),
            "{refused:?}"
        );
        assert!(refused.is_permanent());
        assert!(refused.to_string().contains("--cluster-id"), "{refused}");
    }

    #[tokio::test]
    async fn a_node_change_is_one_pool_write_and_a_pool_changed_behind_our_back_is_read_again() {
        let cloud = FakeProvider::new(true);
        let mut pool = keeper();
        let cancel = CancellationToken::new();
        pool.claim(&cloud, &ips(&["198.18.0.11"]), &cancel)
            .await
            .unwrap();
        let name = pool.name.clone();
        assert_eq!(
            cloud.take_calls(),
            [
                Call::GetNodePool { name: name.clone() },
                Call::PutNodePool { name: name.clone() }
            ]
        );
        // What the cloud said is still true: the write alone.
        pool.sync(&cloud, &ips(&["198.18.0.11", "198.18.0.12"]))
            .await
            .unwrap();
        assert_eq!(
            cloud.take_calls(),
            [Call::PutNodePool { name: name.clone() }]
        );
        pool.sync(&cloud, &ips(&["198.18.0.11", "198.18.0.12"]))
            .await
            .unwrap();
        assert_eq!(cloud.take_calls(), [], "in step: no call");
        // Someone else wrote it: the conditional write meets a conflict, reads, writes.
        let mut other = pool.desired(&ips(&["198.18.0.99"]));
        other.cluster_uid = "uid-1".into();
        cloud.put_node_pool(&other, None).await.unwrap();
        cloud.take_calls();
        pool.sync(&cloud, &ips(&["198.18.0.11"])).await.unwrap();
        assert_eq!(
            cloud.take_calls(),
            [
                Call::PutNodePool { name: name.clone() },
                Call::GetNodePool { name: name.clone() },
                Call::PutNodePool { name: name.clone() }
            ]
        );
        assert_eq!(cloud.node_pools()[0].backends, ips(&["198.18.0.11"]));
        // Deleted behind our back: after `forget`, read and written again.
        cloud.remove_node_pool(&name);
        pool.forget();
        pool.sync(&cloud, &ips(&["198.18.0.11"])).await.unwrap();
        assert_eq!(cloud.node_pools().len(), 1);
    }

    #[tokio::test]
    async fn a_pool_another_cluster_claimed_is_refused_at_once() {
        let cloud = FakeProvider::new(true);
        let mut theirs = keeper();
        theirs.cluster_uid = "uid-2".into();
        theirs
            .claim(&cloud, &ips(&["198.18.0.50"]), &CancellationToken::new())
            .await
            .unwrap();
        let refused = keeper()
            .claim(&cloud, &ips(&["198.18.0.11"]), &CancellationToken::new())
            .await
            .unwrap_err();
        assert!(
            matches!(refused, ProviderError::ForeignNodePool { .. }),
            "{refused:?}"
        );
        assert_eq!(
            cloud.node_pools()[0].backends,
            ips(&["198.18.0.50"]),
            "not touched"
        );
    }

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
