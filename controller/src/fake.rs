//! `FakeProvider`: an in-memory cloud behind [`LoadBalancerProvider`], for in-process tests
//! of reconcile (like the fake cloud of k8s.io/cloud-provider's service controller tests).
//! It records every call, can fail the next call of an operation with a given error,
//! creates LBs either provisioning or already active, gives them a VIP per IP family,
//! refuses, all or nothing, an LB of a family its pool lacks, and keeps node pools whose
//! members the LBs referencing them show as their backends.

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tandem_common::IpFamily;

use crate::provider::{
    AddressRefusal, Capabilities, ClusterId, DesiredLoadBalancer, DesiredNodePool,
    LoadBalancerLookup, LoadBalancerPhase, LoadBalancerProvider, ObservedLoadBalancer,
    ObservedNodePool, Operation, Profile, ProviderError,
};
use crate::registry::{DynProvider, Registration};

/// The fake's own annotations and class, so tests prove nothing is fixed to the mock cloud's.
pub const PROFILE: Profile = Profile {
    name: "fake",
    annotation_prefix: "fake.tandem.io/load-balancer-",
    default_class: "tandem.io/fake",
};

/// The fake as a binary registers a provider: a new, empty fake, whatever the configuration.
pub const REGISTRATION: Registration = Registration {
    profile: &PROFILE,
    build: |_, _| Ok(DynProvider::new(FakeProvider::new(false))),
    from_url_flags: None,
};

/// The pool of an LB that names none, as in the mock cloud.
const DEFAULT_POOL: &str = "default";

/// A call as the fake saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Get { known_id: Option<String> },
    AwaitProvisioned { id: String },
    Create { replaces: Option<String> },
    Update { id: String },
    Delete { known_id: Option<String> },
    ListOwned,
    GetNodePool { name: String },
    PutNodePool { name: String },
    ListNodePools,
    DeleteNodePool { name: String },
}

#[derive(Debug, Default)]
struct State {
    lbs: BTreeMap<String, ObservedLoadBalancer>,
    calls: Vec<Call>,
    failures: Vec<(Operation, VecDeque<ProviderError>)>,
    next_id: u32,
    create_active: bool,
    /// Deleted LBs stay `Deleting` until [`FakeProvider::finish_deletes`], as in a cloud
    /// that deletes asynchronously.
    delete_async: bool,
    /// The families of pools that lack one; any other pool has both.
    pool_families: BTreeMap<String, Vec<IpFamily>>,
    capabilities: Option<Capabilities>,
    /// The LB each create request made, so a repeated request answers the same LB (the
    /// mock cloud's `Idempotency-Key`).
    requests: BTreeMap<String, String>,
    /// Given to every LB created from now on.
    hostname: Option<Hostnames>,
    /// Every call answers `RateLimited`, as a cloud over its rate limit.
    throttled: bool,
    /// Creates make their LB and answer `Unavailable`, as a cloud whose answer was lost.
    lose_create_answers: bool,
    node_pools: BTreeMap<String, ObservedNodePool>,
    /// Creates take the id the client planned ([`FakeProvider::set_client_ids`]).
    client_ids: bool,
}

/// How the fake names its LBs by DNS (see [`FakeProvider::set_hostnames`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hostnames {
    /// A hostname beside the VIPs.
    Beside,
    /// A hostname and no VIP, as an AWS NLB.
    Instead,
}

/// Cheap to clone: clones share one cloud.
#[derive(Debug, Clone, Default)]
pub struct FakeProvider(Arc<Mutex<State>>);

impl FakeProvider {
    /// A cloud whose new LBs are `Active` at once (`true`) or stay `Provisioning`.
    pub fn new(create_active: bool) -> Self {
        let fake = Self::default();
        fake.state().create_active = create_active;
        fake
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not hide the calls from the next assertion.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes the next call of `operation` fail with `error` (queued in order).
    pub fn fail_next(&self, operation: Operation, error: ProviderError) {
        let mut state = self.state();
        match state.failures.iter_mut().find(|(op, _)| *op == operation) {
            Some((_, queue)) => queue.push_back(error),
            None => state.failures.push((operation, VecDeque::from([error]))),
        }
    }

    /// Every call from now on answers `RateLimited` (one second), or none does.
    pub fn set_throttled(&self, throttled: bool) {
        self.state().throttled = throttled;
    }

    /// Creates from now on make their LB and then answer `Unavailable`, as when the
    /// cloud's answer is lost; or they answer again.
    pub fn set_lose_create_answers(&self, lose: bool) {
        self.state().lose_create_answers = lose;
    }

    /// Whether creates from now on take the id the controller planned
    /// ([`LoadBalancerProvider::planned_id`]), as the mock cloud's do, or one the fake
    /// chooses.
    pub fn set_client_ids(&self, client_ids: bool) {
        self.state().client_ids = client_ids;
    }

    /// Puts an LB into the cloud as it is (e.g. one changed behind the controller's back).
    pub fn insert(&self, lb: ObservedLoadBalancer) {
        self.state().lbs.insert(lb.id.clone(), lb);
    }

    /// Takes an LB out of the cloud behind the controller's back.
    pub fn remove(&self, id: &str) {
        self.state().lbs.remove(id);
    }

    /// Whether LBs created from now on are `Active` at once or `Provisioning`.
    pub fn set_create_active(&self, active: bool) {
        self.state().create_active = active;
    }

    /// Whether deletes finish at once or leave the LB `Deleting` until
    /// [`Self::finish_deletes`].
    pub fn set_delete_async(&self, delete_async: bool) {
        self.state().delete_async = delete_async;
    }

    /// Gives `pool` (`default`: the pool of LBs that name none) addresses of `families`
    /// only: an LB asking it for another family is refused.
    pub fn set_pool_families(&self, pool: &str, families: &[IpFamily]) {
        self.state()
            .pool_families
            .insert(pool.to_owned(), families.to_vec());
    }

    /// What the fake's LBs can do (all of it unless set).
    pub fn set_capabilities(&self, capabilities: Capabilities) {
        self.state().capabilities = Some(capabilities);
    }

    /// LBs created from now on get the hostname `<id>.lb.example.net`, beside their VIPs
    /// or instead of them; `None`: VIPs alone.
    pub fn set_hostnames(&self, hostnames: Option<Hostnames>) {
        self.state().hostname = hostnames;
    }

    /// The cloud finishes every pending delete.
    pub fn finish_deletes(&self) {
        self.state()
            .lbs
            .retain(|_, lb| lb.phase != LoadBalancerPhase::Deleting);
    }

    /// Every call so far, in order; `take` empties the record.
    pub fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut self.state().calls)
    }

    pub fn load_balancers(&self) -> Vec<ObservedLoadBalancer> {
        let state = self.state();
        state.lbs.values().map(|lb| state.resolved(lb)).collect()
    }

    pub fn node_pools(&self) -> Vec<ObservedNodePool> {
        self.state().node_pools.values().cloned().collect()
    }

    /// Takes a node pool out of the cloud behind the controller's back.
    pub fn remove_node_pool(&self, name: &str) {
        self.state().node_pools.remove(name);
    }

    fn begin(
        &self,
        call: Call,
        operation: Operation,
    ) -> Result<MutexGuard<'_, State>, ProviderError> {
        let mut state = self.state();
        state.calls.push(call);
        if state.throttled {
            return Err(ProviderError::RateLimited {
                operation,
                retry_after: Duration::from_secs(1),
            });
        }
        let injected = state
            .failures
            .iter_mut()
            .find(|(op, _)| *op == operation)
            .and_then(|(_, queue)| queue.pop_front());
        match injected {
            Some(error) => Err(error),
            None => Ok(state),
        }
    }
}

impl State {
    /// `lb` as the cloud reports it: on a node pool, its backends are the pool's members
    /// of its families.
    fn resolved(&self, lb: &ObservedLoadBalancer) -> ObservedLoadBalancer {
        let mut lb = lb.clone();
        if let Some(pool) = lb
            .node_pool
            .as_ref()
            .and_then(|name| self.node_pools.get(name))
        {
            lb.backends = pool
                .backends
                .iter()
                .copied()
                .filter(|ip| lb.ip_families.contains(&IpFamily::of(*ip)))
                .collect();
        }
        lb
    }

    /// The backends `desired` asks for: its own, or nothing while it names a pool (whose
    /// members [`Self::resolved`] shows); `NodePoolMissing` for a pool the cloud lacks.
    fn backends_of(
        &self,
        desired: &DesiredLoadBalancer,
    ) -> Result<std::collections::BTreeSet<IpAddr>, ProviderError> {
        match &desired.node_pool {
            None => Ok(desired.backends.clone()),
            Some(name) if self.node_pools.contains_key(name) => Ok(Default::default()),
            Some(name) => Err(ProviderError::NodePoolMissing {
                message: format!("no node pool {name}"),
            }),
        }
    }

    /// How many LBs reference the pool `name`.
    fn pool_users(&self, name: &str) -> usize {
        self.lbs
            .values()
            .filter(|lb| lb.node_pool.as_deref() == Some(name))
            .count()
    }

    /// Refuses `desired` in `pool` when the pool lacks one of its families.
    fn check_pool(&self, desired: &DesiredLoadBalancer, pool: &str) -> Result<(), ProviderError> {
        let Some(has) = self.pool_families.get(pool) else {
            return Ok(());
        };
        match desired.ip_families.iter().find(|f| !has.contains(f)) {
            Some(missing) => Err(ProviderError::AddressRefused {
                refusal: AddressRefusal::PoolLacksFamily,
                message: format!(
                    "the VIP pool {pool} has no {missing} addresses (ipFamilies asks for {missing})"
                ),
            }),
            None => Ok(()),
        }
    }

    /// An address of `family` for the `n`th allocation.
    fn fresh_vip(family: IpFamily, n: u32) -> IpAddr {
        let host = u8::try_from(n % 250).unwrap_or(0) + 1;
        match family {
            IpFamily::V4 => Ipv4Addr::new(198, 51, 100, host).into(),
            IpFamily::V6 => Ipv6Addr::new(0x2001, 0xdb8, 0x51, 0x100, 0, 0, 0, host.into()).into(),
        }
    }

    /// One VIP per family of `desired`, in its order: the requested one, else the one in
    /// `current`, else a fresh one.
    fn place(&mut self, desired: &DesiredLoadBalancer, current: &[IpAddr]) -> Vec<IpAddr> {
        self.next_id += 1;
        let n = self.next_id;
        desired
            .ip_families
            .iter()
            .map(|family| {
                desired
                    .address
                    .requested_of(*family)
                    .or_else(|| {
                        current
                            .iter()
                            .copied()
                            .find(|v| IpFamily::of(*v) == *family)
                    })
                    .unwrap_or_else(|| Self::fresh_vip(*family, n))
            })
            .collect()
    }
}

/// The LB of `lookup`, being deleted or not.
fn find(
    state: &State,
    lookup: &LoadBalancerLookup,
) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
    if let Some(id) = &lookup.known_id
        && let Some(lb) = state.lbs.get(id)
    {
        if !lb.is_owned_by_cluster(&lookup.owner.cluster_id) {
            return Err(ProviderError::ForeignLoadBalancer { id: id.clone() });
        }
        if lb.owner.as_ref().is_some_and(|o| o.uid == lookup.owner.uid) {
            return Ok(Some(state.resolved(lb)));
        }
    }
    Ok(state
        .lbs
        .values()
        .find(|lb| lb.owner.as_ref() == Some(&lookup.owner))
        .map(|lb| state.resolved(lb)))
}

/// What identifies a create: a repeated request answers the LB the first made.
fn create_request(desired: &DesiredLoadBalancer, replaces: Option<&str>) -> String {
    format!("{desired:?} replacing {replaces:?}")
}

/// The id a client names the LB of `request` by (a digest, as the mock cloud's provider's).
fn client_id(request: &str) -> String {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same request gives the same id within a run.
    let mut hasher = std::hash::DefaultHasher::new();
    request.hash(&mut hasher);
    format!("lb-{:016x}", hasher.finish())
}

impl LoadBalancerProvider for FakeProvider {
    fn profile(&self) -> &'static Profile {
        &PROFILE
    }

    fn capabilities(&self) -> Capabilities {
        self.state().capabilities.unwrap_or(Capabilities::ALL)
    }

    fn planned_id(&self, desired: &DesiredLoadBalancer, replaces: Option<&str>) -> Option<String> {
        self.state()
            .client_ids
            .then(|| client_id(&create_request(desired, replaces)))
    }

    async fn get(
        &self,
        lookup: &LoadBalancerLookup,
    ) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
        let state = self.begin(
            Call::Get {
                known_id: lookup.known_id.clone(),
            },
            Operation::Get,
        )?;
        Ok(find(&state, lookup)?.filter(|lb| lb.phase != LoadBalancerPhase::Deleting))
    }

    /// Answers once a test has made the LB active (or removed it), or after `within`.
    async fn await_provisioned(
        &self,
        lb: &ObservedLoadBalancer,
        within: Duration,
    ) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
        drop(self.begin(
            Call::AwaitProvisioned { id: lb.id.clone() },
            Operation::AwaitProvisioned,
        )?);
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let now = {
                let state = self.state();
                state
                    .lbs
                    .get(&lb.id)
                    .filter(|now| now.phase != LoadBalancerPhase::Deleting)
                    .map(|now| state.resolved(now))
            };
            let provisioning = now
                .as_ref()
                .is_some_and(|now| now.phase == LoadBalancerPhase::Provisioning);
            if !provisioning || tokio::time::Instant::now() >= deadline {
                return Ok(now);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn create(
        &self,
        desired: &DesiredLoadBalancer,
        replaces: Option<&str>,
    ) -> Result<ObservedLoadBalancer, ProviderError> {
        let mut state = self.begin(
            Call::Create {
                replaces: replaces.map(str::to_owned),
            },
            Operation::Create,
        )?;
        let request = create_request(desired, replaces);
        if let Some(lb) = state
            .requests
            .get(&request)
            .and_then(|id| state.lbs.get(id))
        {
            return Ok(state.resolved(lb));
        }
        state.check_pool(
            desired,
            desired.address.pool.as_deref().unwrap_or(DEFAULT_POOL),
        )?;
        let id = if state.client_ids {
            let id = client_id(&request);
            if state.lbs.contains_key(&id) {
                return Err(ProviderError::Conflict {
                    operation: Operation::Create,
                    id,
                });
            }
            Some(id)
        } else {
            None
        };
        let backends = state.backends_of(desired)?;
        let mut vips = state.place(desired, &[]);
        let id = id.unwrap_or_else(|| format!("lb-{}", state.next_id));
        let hostname = state.hostname.map(|how| {
            if how == Hostnames::Instead {
                vips.clear();
            }
            format!("{id}.lb.example.net")
        });
        let lb = ObservedLoadBalancer {
            id,
            hostname,
            version: 1,
            name: desired.name(),
            owner: Some(desired.owner.clone()),
            phase: if state.create_active {
                LoadBalancerPhase::Active
            } else {
                LoadBalancerPhase::Provisioning
            },
            ip_families: desired.ip_families.clone(),
            vips,
            pool: desired.address.pool.clone(),
            sharing_key: desired.address.sharing_key.clone(),
            mode: desired.mode,
            listeners: desired.listeners.clone(),
            backends,
            node_pool: desired.node_pool.clone(),
            source_ranges: desired.source_ranges.clone(),
        };
        state.lbs.insert(lb.id.clone(), lb.clone());
        state.requests.insert(request, lb.id.clone());
        if state.lose_create_answers {
            return Err(ProviderError::Unavailable {
                operation: Operation::Create,
                message: "the answer was lost".to_owned(),
            });
        }
        Ok(state.resolved(&lb))
    }

    async fn update(
        &self,
        current: &ObservedLoadBalancer,
        desired: &DesiredLoadBalancer,
    ) -> Result<ObservedLoadBalancer, ProviderError> {
        let mut state = self.begin(
            Call::Update {
                id: current.id.clone(),
            },
            Operation::Update,
        )?;
        let Some(found) = state.lbs.get(&current.id) else {
            return Err(ProviderError::NotFound {
                id: current.id.clone(),
            });
        };
        if found.version != current.version {
            return Err(ProviderError::Conflict {
                operation: Operation::Update,
                id: current.id.clone(),
            });
        }
        let pool = desired
            .address
            .pool
            .clone()
            .or_else(|| found.pool.clone())
            .unwrap_or_else(|| DEFAULT_POOL.to_owned());
        let kept = found.vips.clone();
        let hostname_only = found.hostname.is_some() && kept.is_empty();
        state.check_pool(desired, &pool)?;
        let backends = state.backends_of(desired)?;
        let vips = if hostname_only {
            kept
        } else {
            state.place(desired, &kept)
        };
        let Some(lb) = state.lbs.get_mut(&current.id) else {
            return Err(ProviderError::NotFound {
                id: current.id.clone(),
            });
        };
        lb.version += 1;
        lb.owner = Some(desired.owner.clone());
        lb.mode = desired.mode;
        lb.ip_families = desired.ip_families.clone();
        lb.vips = vips;
        if desired.address.pool.is_some() {
            lb.pool = desired.address.pool.clone();
        }
        lb.sharing_key = desired.address.sharing_key.clone();
        lb.listeners = desired.listeners.clone();
        lb.backends = backends;
        lb.node_pool = desired.node_pool.clone();
        lb.source_ranges = desired.source_ranges.clone();
        let lb = lb.clone();
        Ok(state.resolved(&lb))
    }

    async fn delete(
        &self,
        lookup: &LoadBalancerLookup,
    ) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
        let mut state = self.begin(
            Call::Delete {
                known_id: lookup.known_id.clone(),
            },
            Operation::Delete,
        )?;
        let Some(lb) = find(&state, lookup)? else {
            return Ok(None);
        };
        if !state.delete_async {
            state.lbs.remove(&lb.id);
            return Ok(None);
        }
        let deleting = ObservedLoadBalancer {
            phase: LoadBalancerPhase::Deleting,
            ..lb
        };
        state.lbs.insert(deleting.id.clone(), deleting.clone());
        Ok(Some(deleting))
    }

    async fn list_owned(
        &self,
        cluster_id: &ClusterId,
    ) -> Result<Vec<ObservedLoadBalancer>, ProviderError> {
        let state = self.begin(Call::ListOwned, Operation::List)?;
        Ok(state
            .lbs
            .values()
            .filter(|lb| lb.is_owned_by_cluster(cluster_id))
            .map(|lb| state.resolved(lb))
            .collect())
    }

    async fn get_node_pool(&self, name: &str) -> Result<Option<ObservedNodePool>, ProviderError> {
        let state = self.begin(
            Call::GetNodePool {
                name: name.to_owned(),
            },
            Operation::GetNodePool,
        )?;
        Ok(state.node_pools.get(name).map(|pool| ObservedNodePool {
            load_balancers: state.pool_users(name),
            ..pool.clone()
        }))
    }

    async fn put_node_pool(
        &self,
        desired: &DesiredNodePool,
        version: Option<u64>,
    ) -> Result<ObservedNodePool, ProviderError> {
        let mut state = self.begin(
            Call::PutNodePool {
                name: desired.name.clone(),
            },
            Operation::PutNodePool,
        )?;
        let current = state.node_pools.get(&desired.name);
        if version.is_some() && current.map(|pool| pool.version) != version {
            return Err(ProviderError::Conflict {
                operation: Operation::PutNodePool,
                id: desired.name.clone(),
            });
        }
        let unchanged = current.is_some_and(|pool| pool.matches(desired));
        let pool = ObservedNodePool {
            name: desired.name.clone(),
            version: match current {
                Some(pool) if unchanged => pool.version,
                Some(pool) => pool.version + 1,
                None => 1,
            },
            tags: desired.tags(),
            backends: desired.backends.clone(),
            load_balancers: state.pool_users(&desired.name),
        };
        state.node_pools.insert(pool.name.clone(), pool.clone());
        Ok(pool)
    }

    async fn list_owned_node_pools(
        &self,
        cluster_id: &ClusterId,
    ) -> Result<Vec<ObservedNodePool>, ProviderError> {
        let state = self.begin(Call::ListNodePools, Operation::ListNodePools)?;
        Ok(state
            .node_pools
            .values()
            .filter(|pool| pool.is_owned_by_cluster(cluster_id))
            .map(|pool| ObservedNodePool {
                load_balancers: state.pool_users(&pool.name),
                ..pool.clone()
            })
            .collect())
    }

    async fn delete_node_pool(&self, name: &str) -> Result<(), ProviderError> {
        let mut state = self.begin(
            Call::DeleteNodePool {
                name: name.to_owned(),
            },
            Operation::DeleteNodePool,
        )?;
        if state.pool_users(name) > 0 {
            return Err(ProviderError::NodePoolInUse {
                name: name.to_owned(),
            });
        }
        state.node_pools.remove(name);
        Ok(())
    }
}
