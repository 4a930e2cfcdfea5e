//! The conformance kit: one suite that any [`LoadBalancerProvider`] must pass, written
//! once (as `csi-sanity` is for CSI drivers). The controller's tests run it against the
//! mock-cloud provider on a real cloud-mock and against the fake; a provider of your own
//! runs it with the `conformance` feature:
//!
//! ```ignore
//! tandem_controller::conformance::run(&my_provider, &Kit::new("conformance".parse()?)).await?;
//! ```
//!
//! It checks create (under the id the provider planned, if it plans one), get by id and by
//! owner, a create repeated as after a lost answer,
//! update, an update from a stale version (a conflict), an address refusal that makes
//! nothing, list_owned, a foreign cluster's lookup, and delete until gone. It makes LBs
//! for the owners of its own cluster id and deletes them again.
//!
//! [`run_with_faults`] adds what only a misbehaving cloud shows, for a cloud whose test can
//! make it misbehave ([`CloudFaults`]): under a rate limit a provider answers or says
//! `RateLimited` with the cloud's wait, never another error and never a second LB; and a
//! create whose answer was lost after the cloud made the LB, asked again, gives that LB.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::IpAddr;
use std::time::Duration;

use tandem_common::IpFamily;

use crate::provider::{
    AddressRequest, ClusterId, DesiredLoadBalancer, DesiredNodePool, HealthCheck,
    HealthCheckProtocol, Listener, LoadBalancerLookup, LoadBalancerMode, LoadBalancerPhase,
    LoadBalancerProvider, ObservedLoadBalancer, Owner, Protocol, ProviderError,
};
use crate::spec::HEALTHZ_PATH;

/// What the suite asks of the cloud.
#[derive(Debug, Clone)]
pub struct Kit {
    pub cluster_id: ClusterId,
    /// Node addresses to use as backends (nothing needs to listen there).
    pub backends: Vec<IpAddr>,
    /// A pool name the cloud refuses.
    pub refused_pool: String,
    /// How long an LB may take to become active, and to go.
    pub patience: Duration,
}

impl Kit {
    pub fn new(cluster_id: ClusterId) -> Self {
        Self {
            cluster_id,
            backends: vec![
                IpAddr::from([198, 18, 0, 11]),
                IpAddr::from([198, 18, 0, 12]),
            ],
            refused_pool: "conformance-no-such-pool".into(),
            patience: Duration::from_secs(30),
        }
    }

    fn desired(&self, uid: &str) -> DesiredLoadBalancer {
        DesiredLoadBalancer {
            owner: Owner {
                cluster_id: self.cluster_id.clone(),
                namespace: "conformance".into(),
                name: uid.into(),
                uid: format!("00000000-0000-4000-8000-{uid:0>12}"),
            },
            mode: LoadBalancerMode::Proxy,
            ip_families: vec![IpFamily::V4],
            address: AddressRequest::default(),
            listeners: vec![Listener {
                protocol: Protocol::Tcp,
                port: 80,
                backend_port: 30080,
                health_check: Some(HealthCheck {
                    protocol: HealthCheckProtocol::Http,
                    port: tandem_common::NODE_HEALTHZ_PORT,
                    path: Some(HEALTHZ_PATH.into()),
                }),
            }],
            backends: self.backends.iter().copied().take(1).collect(),
            node_pool: None,
            source_ranges: vec![],
        }
    }
}

/// How the kit makes a provider's cloud misbehave; a provider's own test implements it for
/// its cloud (the mock cloud's fault injection, the fake's switches).
pub trait CloudFaults {
    /// From now on the cloud answers calls beyond a low rate with "slow down" (HTTP 429
    /// with `Retry-After`, or the cloud's equivalent).
    fn throttle(&self) -> impl Future<Output = ()> + Send;
    /// From now on the cloud makes every change it is asked for and loses the answer: the
    /// caller sees a failure although the change was made.
    fn lose_answers(&self) -> impl Future<Output = ()> + Send;
    /// Back to answering everything.
    fn heal(&self) -> impl Future<Output = ()> + Send;
}

/// [`run`], then the checks that need the cloud to misbehave.
pub async fn run_with_faults<P: LoadBalancerProvider, F: CloudFaults>(
    provider: &P,
    kit: &Kit,
    faults: &F,
) -> Result<(), Failure> {
    run(provider, kit).await?;
    let throttled = kit.desired("3");
    let result = rate_limited(provider, kit, faults, &throttled).await;
    faults.heal().await;
    let cleanup = until_gone(provider, kit, &lookup(&throttled, None)).await;
    result.and(cleanup)?;
    let lost = kit.desired("4");
    let result = lost_answer(provider, faults, &lost).await;
    faults.heal().await;
    let cleanup = until_gone(provider, kit, &lookup(&lost, None)).await;
    result.and(cleanup)
}

/// Creates under a rate limit: each answers the LB or `RateLimited` with a wait, and all
/// of them together make one LB at most.
async fn rate_limited<P: LoadBalancerProvider, F: CloudFaults>(
    provider: &P,
    kit: &Kit,
    faults: &F,
    desired: &DesiredLoadBalancer,
) -> Result<(), Failure> {
    faults.throttle().await;
    let mut made = BTreeSet::new();
    for _ in 0..3 {
        match provider.create(desired, None).await {
            Ok(lb) => {
                made.insert(lb.id);
            }
            Err(ProviderError::RateLimited { retry_after, .. }) if !retry_after.is_zero() => {}
            Err(e) => {
                return fail(
                    "rate limit",
                    format!("want the LB or RateLimited with a wait, got {e:?}"),
                );
            }
        }
    }
    faults.heal().await;
    let listed = provider
        .list_owned(&kit.cluster_id)
        .await
        .or_else(|e| fail("rate limit", e.to_string()))?;
    let owned = listed
        .iter()
        .filter(|lb| lb.owner.as_ref() == Some(&desired.owner))
        .count();
    if made.len() > 1 || owned > 1 {
        return fail(
            "rate limit",
            format!("one request made {owned} LBs ({made:?} answered)"),
        );
    }
    Ok(())
}

/// A create whose answer is lost after the cloud made the LB: asked again (as the
/// controller's next pass does), it answers that LB; never a second one.
async fn lost_answer<P: LoadBalancerProvider, F: CloudFaults>(
    provider: &P,
    faults: &F,
    desired: &DesiredLoadBalancer,
) -> Result<(), Failure> {
    faults.lose_answers().await;
    let first = provider.create(desired, None).await;
    faults.heal().await;
    let again = provider
        .create(desired, None)
        .await
        .or_else(|e| fail("lost answer", format!("the repeated create failed: {e}")))?;
    if let Ok(first) = first
        && first.id != again.id
    {
        return fail(
            "lost answer",
            format!("answered {} and then {}", first.id, again.id),
        );
    }
    let listed = provider
        .list_owned(&desired.owner.cluster_id)
        .await
        .or_else(|e| fail("lost answer", e.to_string()))?;
    let owned: Vec<&str> = listed
        .iter()
        .filter(|lb| lb.owner.as_ref() == Some(&desired.owner))
        .map(|lb| lb.id.as_str())
        .collect();
    if owned != [again.id.as_str()] {
        return fail(
            "lost answer",
            format!(
                "the cloud holds {owned:?} for one Service, want [{}]",
                again.id
            ),
        );
    }
    Ok(())
}

/// The first check a provider failed.
#[derive(Debug, thiserror::Error)]
#[error("conformance: {check}: {problem}")]
pub struct Failure {
    pub check: &'static str,
    pub problem: String,
}

fn fail<T>(check: &'static str, problem: impl Into<String>) -> Result<T, Failure> {
    Err(Failure {
        check,
        problem: problem.into(),
    })
}

fn lookup(desired: &DesiredLoadBalancer, known_id: Option<&str>) -> LoadBalancerLookup {
    LoadBalancerLookup {
        known_id: known_id.map(str::to_owned),
        owner: desired.owner.clone(),
    }
}

/// Runs every check against `provider`; the LBs it made are deleted also when a check fails
/// after they were made.
pub async fn run<P: LoadBalancerProvider>(provider: &P, kit: &Kit) -> Result<(), Failure> {
    let desired = kit.desired("1");
    let result = lifecycle(provider, kit, &desired).await;
    if result.is_err() {
        let _ = provider.delete(&lookup(&desired, None)).await;
    }
    result?;
    refusal(provider, kit).await?;
    if provider.capabilities().node_pools {
        node_pool(provider, kit).await?;
    }
    Ok(())
}

/// The cluster's node pool the kit writes.
fn kit_pool(kit: &Kit, backends: &[IpAddr]) -> DesiredNodePool {
    DesiredNodePool {
        name: kit.cluster_id.node_pool_name(),
        cluster_id: kit.cluster_id.clone(),
        cluster_uid: "conformance-cluster-uid".into(),
        backends: backends.iter().copied().collect(),
    }
}

/// Node pools (capability `node_pools`): written, written again unchanged without a new
/// version, refused from a stale version, followed by the LBs that reference it, kept
/// while referenced, and gone when deleted. The pool and its LB are deleted also when a
/// check fails.
async fn node_pool<P: LoadBalancerProvider>(provider: &P, kit: &Kit) -> Result<(), Failure> {
    let mut desired = kit.desired("5");
    desired.node_pool = Some(kit.cluster_id.node_pool_name());
    let result = node_pool_checks(provider, kit, &desired).await;
    let lb_gone = until_gone(provider, kit, &lookup(&desired, None)).await;
    let pool_gone = provider
        .delete_node_pool(&kit.cluster_id.node_pool_name())
        .await
        .or_else(|e| fail("node pool delete", e.to_string()));
    result.and(lb_gone).and(pool_gone)?;
    match provider
        .get_node_pool(&kit.cluster_id.node_pool_name())
        .await
    {
        Ok(None) => {}
        other => return fail("node pool delete", format!("want nothing, got {other:?}")),
    }
    match provider
        .delete_node_pool(&kit.cluster_id.node_pool_name())
        .await
    {
        Ok(()) => Ok(()),
        other => fail(
            "node pool delete",
            format!("deleting a missing pool: want Ok, got {other:?}"),
        ),
    }
}

async fn node_pool_checks<P: LoadBalancerProvider>(
    provider: &P,
    kit: &Kit,
    desired: &DesiredLoadBalancer,
) -> Result<(), Failure> {
    // An LB may not name a pool the cloud lacks.
    match provider.create(desired, None).await {
        Err(ProviderError::NodePoolMissing { .. }) => {}
        other => {
            return fail(
                "node pool missing",
                format!("an LB naming no existing pool: want NodePoolMissing, got {other:?}"),
            );
        }
    }
    let first = kit_pool(kit, &kit.backends[..1]);
    let written = provider
        .put_node_pool(&first, None)
        .await
        .or_else(|e| fail("node pool write", e.to_string()))?;
    if !written.matches(&first) {
        return fail("node pool write", format!("answered {written:?}"));
    }
    let again = provider
        .put_node_pool(&first, Some(written.version))
        .await
        .or_else(|e| fail("node pool write", e.to_string()))?;
    if again.version != written.version {
        return fail(
            "node pool write",
            "writing the same pool again made a new version",
        );
    }
    let created = provider
        .create(desired, None)
        .await
        .or_else(|e| fail("node pool LB", e.to_string()))?;
    let active = until_active(provider, kit, desired, &created.id).await?;
    if active.node_pool != desired.node_pool || active.backends != first.backends {
        return fail(
            "node pool LB",
            format!(
                "the LB references {:?} with backends {:?}, want {:?} with {:?}",
                active.node_pool, active.backends, desired.node_pool, first.backends
            ),
        );
    }
    // One write of the pool moves every LB that references it.
    let second = kit_pool(kit, &kit.backends);
    let moved = provider
        .put_node_pool(&second, Some(written.version))
        .await
        .or_else(|e| fail("node pool write", e.to_string()))?;
    match provider.put_node_pool(&first, Some(written.version)).await {
        Err(ProviderError::Conflict { .. }) => {}
        other => {
            return fail(
                "node pool stale write",
                format!("want Conflict, got {other:?}"),
            );
        }
    }
    let followed = provider
        .get(&lookup(desired, Some(&created.id)))
        .await
        .or_else(|e| fail("node pool LB", e.to_string()))?;
    if followed.as_ref().map(|lb| &lb.backends) != Some(&second.backends) {
        return fail(
            "node pool LB",
            format!(
                "after the pool write the LB has {followed:?}, want the backends {:?}",
                second.backends
            ),
        );
    }
    let listed = provider
        .list_owned_node_pools(&kit.cluster_id)
        .await
        .or_else(|e| fail("node pool list", e.to_string()))?;
    if !listed
        .iter()
        .any(|pool| pool.name == moved.name && pool.load_balancers == 1)
    {
        return fail(
            "node pool list",
            format!("want the pool with its one LB, listed {listed:?}"),
        );
    }
    match provider.delete_node_pool(&moved.name).await {
        Err(ProviderError::NodePoolInUse { .. }) => Ok(()),
        other => fail(
            "node pool in use",
            format!("deleting a referenced pool: want NodePoolInUse, got {other:?}"),
        ),
    }
}

async fn lifecycle<P: LoadBalancerProvider>(
    provider: &P,
    kit: &Kit,
    desired: &DesiredLoadBalancer,
) -> Result<(), Failure> {
    let created = provider
        .create(desired, None)
        .await
        .or_else(|e| fail("create", e.to_string()))?;
    if created.owner.as_ref() != Some(&desired.owner) {
        return fail("create", "the LB does not report its owner from its tags");
    }
    // An id planned before the create is the id it made: the controller persisted it.
    if let Some(planned) = provider.planned_id(desired, None)
        && planned != created.id
    {
        return fail(
            "planned id",
            format!("planned {planned}, the create made {}", created.id),
        );
    }
    if provider.capabilities().waits_out_provisioning {
        match provider.await_provisioned(&created, kit.patience).await {
            Ok(Some(lb)) if lb.id == created.id && lb.phase == LoadBalancerPhase::Active => {}
            Ok(Some(lb)) => {
                return fail(
                    "await provisioned",
                    format!(
                        "answered {} {:?} after waiting up to {:?}",
                        lb.id, lb.phase, kit.patience
                    ),
                );
            }
            Ok(None) => return fail("await provisioned", "the created LB is not found"),
            Err(e) => return fail("await provisioned", e.to_string()),
        }
    }
    let active = until_active(provider, kit, desired, &created.id).await?;
    if !active.drift(desired).is_empty() {
        return fail("create", format!("drifted: {:?}", active.drift(desired)));
    }
    // A create repeated after a lost answer is the same request: the same LB.
    let again = provider
        .create(desired, None)
        .await
        .or_else(|e| fail("repeated create", e.to_string()))?;
    if again.id != created.id {
        return fail("repeated create", format!("made a second LB {}", again.id));
    }
    let by_owner = provider
        .get(&lookup(desired, None))
        .await
        .or_else(|e| fail("get by owner", e.to_string()))?;
    if by_owner.map(|lb| lb.id) != Some(created.id.clone()) {
        return fail("get by owner", "did not find the LB by name and tags");
    }

    let mut moved = desired.clone();
    moved.backends = kit.backends.iter().copied().collect::<BTreeSet<_>>();
    let updated = provider
        .update(&active, &moved)
        .await
        .or_else(|e| fail("update", e.to_string()))?;
    if !updated.drift(&moved).is_empty() || updated.version == active.version {
        return fail(
            "update",
            format!(
                "drift {:?}, version {} after {}",
                updated.drift(&moved),
                updated.version,
                active.version
            ),
        );
    }
    // From a stale version: converge anyway (after a re-read) or say Conflict.
    match provider.update(&active, desired).await {
        Ok(lb) if lb.drift(desired).is_empty() => {}
        Ok(lb) => return fail("stale update", format!("drifted: {:?}", lb.drift(desired))),
        Err(ProviderError::Conflict { .. }) => {}
        Err(e) => {
            return fail(
                "stale update",
                format!("neither converged nor Conflict: {e}"),
            );
        }
    }

    let listed = provider
        .list_owned(&kit.cluster_id)
        .await
        .or_else(|e| fail("list_owned", e.to_string()))?;
    if !listed.iter().any(|lb| lb.id == created.id) {
        return fail("list_owned", "the LB is not listed for its cluster");
    }
    let other: ClusterId = "conformance-other"
        .parse()
        .or_else(|e: crate::provider::InvalidClusterId| fail("list_owned", e.to_string()))?;
    let foreign_listed = provider
        .list_owned(&other)
        .await
        .or_else(|e| fail("list_owned", e.to_string()))?;
    if foreign_listed.iter().any(|lb| lb.id == created.id) {
        return fail("list_owned", "the LB is listed for another cluster");
    }
    let mut foreign = lookup(desired, Some(&created.id));
    foreign.owner.cluster_id = other;
    match provider.get(&foreign).await {
        Err(ProviderError::ForeignLoadBalancer { .. }) => {}
        other => {
            return fail(
                "foreign id",
                format!("want ForeignLoadBalancer, got {other:?}"),
            );
        }
    }

    until_gone(provider, kit, &lookup(desired, Some(&created.id))).await?;
    match provider.get(&lookup(desired, Some(&created.id))).await {
        Ok(None) => {}
        other => return fail("get after delete", format!("want nothing, got {other:?}")),
    }
    match provider.delete(&lookup(desired, Some(&created.id))).await {
        Ok(None) => Ok(()),
        other => fail(
            "delete of a missing LB",
            format!("want Ok(None), got {other:?}"),
        ),
    }
}

/// An address the cloud cannot give is refused as such, and nothing is made.
async fn refusal<P: LoadBalancerProvider>(provider: &P, kit: &Kit) -> Result<(), Failure> {
    let mut desired = kit.desired("2");
    desired.address.pool = Some(kit.refused_pool.clone());
    match provider.create(&desired, None).await {
        Err(ProviderError::AddressRefused { .. }) => {}
        other => {
            let _ = provider.delete(&lookup(&desired, None)).await;
            return fail("refusal", format!("want AddressRefused, got {other:?}"));
        }
    }
    match provider.get(&lookup(&desired, None)).await {
        Ok(None) => Ok(()),
        other => fail("refusal", format!("a refused create made {other:?}")),
    }
}

async fn until_active<P: LoadBalancerProvider>(
    provider: &P,
    kit: &Kit,
    desired: &DesiredLoadBalancer,
    id: &str,
) -> Result<ObservedLoadBalancer, Failure> {
    let deadline = tokio::time::Instant::now() + kit.patience;
    loop {
        match provider.get(&lookup(desired, Some(id))).await {
            Ok(Some(lb)) if lb.phase == LoadBalancerPhase::Active => return Ok(lb),
            Ok(Some(_)) => {}
            Ok(None) => return fail("get by id", "the created LB is not found"),
            Err(e) => return fail("get by id", e.to_string()),
        }
        if tokio::time::Instant::now() > deadline {
            return fail("create", "the LB never became active");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `delete` answers the LB while the cloud still lists it, then nothing.
async fn until_gone<P: LoadBalancerProvider>(
    provider: &P,
    kit: &Kit,
    lookup: &LoadBalancerLookup,
) -> Result<(), Failure> {
    let deadline = tokio::time::Instant::now() + kit.patience;
    loop {
        match provider.delete(lookup).await {
            Ok(None) => return Ok(()),
            Ok(Some(lb)) if lb.phase == LoadBalancerPhase::Deleting => {}
            Ok(Some(lb)) => {
                return fail("delete", format!("answered {:?}, not Deleting", lb.phase));
            }
            Err(e) => return fail("delete", e.to_string()),
        }
        if tokio::time::Instant::now() > deadline {
            return fail("delete", "the LB was never gone");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
