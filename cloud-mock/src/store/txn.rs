//! One write transaction, decided in memory: the reads see the state as it was with this
//! transaction's own writes on top, and the writes collect into the [`Change`] that the
//! backend then commits. The operations of the store (create, update, the lifecycle's
//! transitions, node pools) are written here once, for every backend, as pure functions
//! of the state they read.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use cloud_mock_sdk::families::LoadBalancerSpec;
use cloud_mock_sdk::{IpFamily, NodePoolSpec, State as LbState};
use ipnet::IpNet;

use super::address::{Holdings, VipHolders, assigned, first_free_vip, may_share, new_id, place};
use super::state::{Change, State};
use super::{Created, NodePoolWrite, StoreError, Transition, Written};
use crate::model::{StoredLoadBalancer, StoredNodePool};
use crate::pools::{DEFAULT_POOL, VipPools, vip_in_pool};
use crate::tenants::Tenant;
use crate::validate::Placement;

/// Reads of `base` with the writes made so far on top.
pub(crate) struct Txn<'a> {
    base: &'a State,
    pools: &'a VipPools,
    change: Change,
}

impl Holdings for Txn<'_> {
    fn lb(&self, id: &str) -> Option<StoredLoadBalancer> {
        match self.change.load_balancers.get(id) {
            Some(written) => written.clone(),
            None => self.base.load_balancer(id).cloned(),
        }
    }

    fn holders(&self, vip: IpAddr) -> VipHolders {
        match self.change.holders.get(&vip) {
            Some(written) => written.clone().unwrap_or_default(),
            None => self.base.holders(vip).cloned().unwrap_or_default(),
        }
    }

    fn held_in(&self, cidr: IpNet) -> Vec<(IpAddr, VipHolders)> {
        let mut held: BTreeMap<IpAddr, VipHolders> = self
            .base
            .held_in(cidr)
            .map(|(vip, holders)| (vip, holders.clone()))
            .collect();
        for (vip, written) in self.change.holders.range(cidr.network()..=cidr.broadcast()) {
            match written.as_ref().filter(|h| !h.ids.is_empty()) {
                Some(holders) => drop(held.insert(*vip, holders.clone())),
                None => drop(held.remove(vip)),
            }
        }
        held.into_iter().collect()
    }

    fn first_free(&self, cidr: IpNet) -> Option<IpAddr> {
        first_free_vip(cidr, self.base.floor(cidr), |vip| self.is_held(vip))
    }
}

impl<'a> Txn<'a> {
    pub fn new(base: &'a State, pools: &'a VipPools) -> Self {
        Self {
            base,
            pools,
            change: Change::default(),
        }
    }

    /// What the transaction wrote.
    pub fn into_change(self) -> Change {
        self.change
    }

    fn is_held(&self, vip: IpAddr) -> bool {
        match self.change.holders.get(&vip) {
            Some(written) => written.as_ref().is_some_and(|h| !h.ids.is_empty()),
            None => self.base.holders(vip).is_some(),
        }
    }

    fn idempotency_key(&self, key: &str) -> Option<String> {
        match self.change.idempotency_keys.get(key) {
            Some(written) => written.clone(),
            None => self.base.idempotency_key(key).map(str::to_owned),
        }
    }

    fn node_pool(&self, name: &str) -> Option<StoredNodePool> {
        match self.change.node_pools.get(name) {
            Some(written) => written.clone(),
            None => self.base.node_pool(name).cloned(),
        }
    }

    /// Ids of the load balancers (being deleted too) that reference node pool `name`.
    fn referencing(&self, name: &str) -> Vec<String> {
        let mut ids: BTreeSet<String> = self.base.referencing(name).map(str::to_owned).collect();
        for (id, written) in &self.change.load_balancers {
            let names_it = written
                .as_ref()
                .is_some_and(|lb| lb.spec.node_pool.as_deref() == Some(name));
            if names_it {
                ids.insert(id.clone());
            } else {
                ids.remove(id);
            }
        }
        ids.into_iter().collect()
    }

    fn put_lb(&mut self, lb: StoredLoadBalancer) {
        self.change.load_balancers.insert(lb.id.clone(), Some(lb));
    }

    fn put_holders(&mut self, vip: IpAddr, holders: VipHolders) {
        let value = (!holders.ids.is_empty()).then_some(holders);
        self.change.holders.insert(vip, value);
    }

    /// Adds `id` to the holders of `vip` (checked for sharing before).
    fn hold(&mut self, vip: IpAddr, id: &str, sharing_key: Option<&str>) {
        let mut sharers = self.holders(vip);
        sharers.ids.insert(id.to_owned());
        sharers.sharing_key = sharing_key.map(str::to_owned);
        self.put_holders(vip, sharers);
    }

    /// Removes `id` from the holders of `vip`.
    fn release(&mut self, vip: IpAddr, id: &str) {
        let mut sharers = self.holders(vip);
        if sharers.ids.remove(id) {
            self.put_holders(vip, sharers);
        }
    }

    /// The CIDR of pool `name` for `family`, or why there is none.
    fn cidr(&self, name: &str, family: IpFamily) -> Result<IpNet, StoreError> {
        if !self.pools.contains(name) {
            return Err(StoreError::UnknownPool {
                pool: name.to_owned(),
            });
        }
        self.pools
            .cidr(name, family)
            .ok_or_else(|| StoreError::PoolLacksFamily {
                pool: name.to_owned(),
                family,
            })
    }

    /// Calls `visit` with every load balancer of `tenant`, as this transaction sees them.
    fn for_each_of(&self, tenant: &Tenant, mut visit: impl FnMut(&StoredLoadBalancer)) {
        for lb in self.base.load_balancers() {
            if !self.change.load_balancers.contains_key(&lb.id) && tenant.owns(&lb.spec.tags) {
                visit(lb);
            }
        }
        for lb in self.change.load_balancers.values().flatten() {
            if tenant.owns(&lb.spec.tags) {
                visit(lb);
            }
        }
    }

    /// The distinct VIPs of `pool` that `tenant`'s load balancers hold.
    fn vips_of(&self, tenant: &Tenant, pool: &str) -> BTreeSet<IpAddr> {
        let mut vips = BTreeSet::new();
        self.for_each_of(tenant, |lb| {
            if lb.spec.address.pool.as_deref().unwrap_or(DEFAULT_POOL) == pool {
                vips.extend(lb.vips());
            }
        });
        vips
    }

    /// Refuses a write that took `tenant` past its VIP quota of `pool`, held `before` it:
    /// a tenant over a quota lowered since may still change what holds no new VIP.
    fn check_vip_quota(
        &self,
        tenant: &Tenant,
        pool: &str,
        before: &BTreeSet<IpAddr>,
    ) -> Result<(), StoreError> {
        let after = self.vips_of(tenant, pool);
        if after.is_subset(before) {
            return Ok(());
        }
        Ok(tenant.check_vips(pool, after.len() as u64)?)
    }

    /// Refuses a spec that names a node pool the store does not have.
    fn check_node_pool(&self, spec: &LoadBalancerSpec) -> Result<(), StoreError> {
        match &spec.node_pool {
            Some(name) if self.node_pool(name).is_none() => {
                Err(StoreError::UnknownNodePool { name: name.clone() })
            }
            _ => Ok(()),
        }
    }

    /// Creates a load balancer from a validated `spec` placed by `placement`, allocating
    /// a VIP per family (see [`place`]), all or none, under `requested_id` (validated) or
    /// an id of the store's choosing. With an `idempotency_key` already used, returns the
    /// load balancer that key created instead. For a `tenant`, within its pools and quotas.
    pub fn create(
        &mut self,
        spec: &LoadBalancerSpec,
        placement: &Placement,
        requested_id: Option<&str>,
        idempotency_key: Option<&str>,
        tenant: Option<&Tenant>,
        now_ms: u64,
    ) -> Result<Created, StoreError> {
        if let Some(existing) = idempotency_key
            .and_then(|key| self.idempotency_key(key))
            .and_then(|id| self.lb(&id))
        {
            return Ok(Created {
                load_balancer: existing,
                is_new: false,
            });
        }
        self.check_node_pool(spec)?;
        let id = match requested_id {
            Some(id) if self.lb(id).is_some() => {
                return Err(StoreError::IdTaken { id: id.to_owned() });
            }
            Some(id) => id.to_owned(),
            None => loop {
                let candidate = new_id();
                if self.lb(&candidate).is_none() {
                    break candidate;
                }
            },
        };
        let pool = placement.pool.as_deref().unwrap_or(DEFAULT_POOL);
        let before = match tenant {
            Some(tenant) => {
                tenant.check_pool(pool)?;
                let mut held = 0;
                self.for_each_of(tenant, |_| held += 1);
                tenant.check_load_balancers(held + 1)?;
                self.vips_of(tenant, pool)
            }
            None => BTreeSet::new(),
        };
        let mut vips = Vec::with_capacity(placement.vips.len());
        for wanted in &placement.vips {
            let cidr = self.cidr(pool, wanted.family)?;
            vips.push(place(self, &id, spec, pool, cidr, wanted.requested)?);
        }
        let lb = StoredLoadBalancer {
            id: id.clone(),
            spec: assigned(spec, &vips, pool),
            state: LbState::Provisioning,
            version: 1,
            state_since_ms: now_ms,
            idempotency_key: idempotency_key.map(str::to_owned),
        };
        self.put_lb(lb.clone());
        for &vip in &vips {
            self.hold(vip, &id, spec.address.sharing_key.as_deref());
        }
        if let Some(key) = idempotency_key {
            self.change
                .idempotency_keys
                .insert(key.to_owned(), Some(id.clone()));
        }
        if let Some(tenant) = tenant {
            self.check_vip_quota(tenant, pool, &before)?;
        }
        Ok(Created {
            load_balancer: lb,
            is_new: true,
        })
    }

    /// Replaces the spec of `id` if it is at `expected_version`. A family that requests no
    /// VIP keeps its allocated one (if it lies in the pool the spec names); another VIP or
    /// pool moves the allocation, a new family allocates one and a family left out frees
    /// its VIP, within this one load balancer. An unchanged spec changes nothing (not
    /// even the version).
    pub fn update(
        &mut self,
        id: &str,
        spec: &LoadBalancerSpec,
        placement: &Placement,
        expected_version: u64,
        tenant: Option<&Tenant>,
    ) -> Result<StoredLoadBalancer, StoreError> {
        let mut lb = self
            .lb(id)
            .ok_or_else(|| StoreError::NotFound { id: id.into() })?;
        if lb.state == LbState::Deleting {
            return Err(StoreError::Deleting { id: id.into() });
        }
        if lb.version != expected_version {
            return Err(StoreError::VersionMismatch {
                id: id.into(),
                current: lb.version,
                expected: expected_version,
            });
        }
        self.check_node_pool(spec)?;
        let current_vips = lb.vips();
        // Records written before pools existed name none: theirs is the default pool.
        let current_pool = lb
            .spec
            .address
            .pool
            .clone()
            .unwrap_or_else(|| DEFAULT_POOL.to_owned());
        let pool = placement.pool.as_deref().unwrap_or(&current_pool);
        let before = match tenant {
            Some(tenant) => {
                tenant.check_pool(pool)?;
                self.vips_of(tenant, pool)
            }
            None => BTreeSet::new(),
        };
        let mut vips = Vec::with_capacity(placement.vips.len());
        for wanted in &placement.vips {
            let cidr = self.cidr(pool, wanted.family)?;
            // No address asked for: the current one stays while it fits the pool and
            // the LB may still hold it. A sharing key removed or changed while others
            // share the address may not: the LB moves, as MetalLB re-allocates.
            let requested = match wanted.requested {
                Some(vip) => Some(vip),
                None => {
                    let mut kept = None;
                    for &vip in current_vips.iter().filter(|&&vip| vip_in_pool(vip, cidr)) {
                        if may_share(self, vip, &self.holders(vip), id, spec)? {
                            kept = Some(vip);
                            break;
                        }
                    }
                    kept
                }
            };
            vips.push(place(self, id, spec, pool, cidr, requested)?);
        }
        let desired = assigned(spec, &vips, pool);
        if desired == lb.spec {
            return Ok(lb);
        }
        for &old in &current_vips {
            self.release(old, id);
        }
        for &vip in &vips {
            self.hold(vip, id, spec.address.sharing_key.as_deref());
        }
        lb.spec = desired;
        lb.version += 1;
        self.put_lb(lb.clone());
        if let Some(tenant) = tenant {
            self.check_vip_quota(tenant, pool, &before)?;
        }
        Ok(lb)
    }

    /// Moves `id` from one of `from` to `to`; `None` when it is gone, or in another state
    /// than `to`.
    pub fn transition(
        &mut self,
        id: &str,
        from: &[LbState],
        to: LbState,
        now_ms: u64,
    ) -> Option<Transition> {
        let mut lb = self.lb(id)?;
        if !from.contains(&lb.state) {
            return (lb.state == to).then_some(Transition {
                load_balancer: lb,
                changed: false,
            });
        }
        lb.state = to;
        lb.state_since_ms = now_ms;
        self.put_lb(lb.clone());
        Some(Transition {
            load_balancer: lb,
            changed: true,
        })
    }

    /// Removes a load balancer that finished deleting, freeing its idempotency key and its
    /// VIP (a shared VIP with the last of its sharers).
    pub fn remove(&mut self, id: &str) {
        let Some(lb) = self.lb(id) else {
            return;
        };
        self.change.load_balancers.insert(id.to_owned(), None);
        for vip in lb.vips() {
            self.release(vip, id);
        }
        if let Some(key) = lb.idempotency_key {
            self.change.idempotency_keys.insert(key, None);
        }
    }

    /// Creates or replaces the node pool `name` with a validated `spec` (its backends kept
    /// in address order: a pool is a set). With `if_match`, the pool must exist at that
    /// version, unless it has that content already: that changes nothing, not even the
    /// version.
    pub fn put_node_pool(
        &mut self,
        name: &str,
        spec: &NodePoolSpec,
        if_match: Option<u64>,
    ) -> Result<NodePoolWrite, StoreError> {
        let mut wanted = spec.clone();
        wanted.backends.sort_unstable();
        let current = self.node_pool(name);
        let load_balancers = self.referencing(name);
        // The content the pool has already is no change, whatever If-Match says: a
        // retry after a lost answer (its If-Match now stale) converges instead of
        // failing, and no one's update is lost by writing nothing.
        if let Some(pool) = current.as_ref().filter(|pool| pool.spec == wanted) {
            return Ok(NodePoolWrite {
                node_pool: pool.clone(),
                load_balancers,
                written: Written::Unchanged,
            });
        }
        let current_version = current.as_ref().map(|pool| pool.version);
        if let Some(expected) = if_match
            && current_version != Some(expected)
        {
            return Err(StoreError::NodePoolVersionMismatch {
                name: name.to_owned(),
                current: current_version,
                expected,
            });
        }
        let (version, written) = match current_version {
            Some(version) => (version + 1, Written::Replaced),
            None => (1, Written::Created),
        };
        let node_pool = StoredNodePool {
            name: name.to_owned(),
            spec: wanted,
            version,
        };
        self.change
            .node_pools
            .insert(name.to_owned(), Some(node_pool.clone()));
        Ok(NodePoolWrite {
            node_pool,
            load_balancers,
            written,
        })
    }

    /// Deletes the node pool `name`: false when there is none, refused while a load
    /// balancer that is not removed yet (being deleted counts) references it.
    pub fn delete_node_pool(&mut self, name: &str) -> Result<bool, StoreError> {
        if self.node_pool(name).is_none() {
            return Ok(false);
        }
        let load_balancers = self.referencing(name);
        if !load_balancers.is_empty() {
            return Err(StoreError::NodePoolInUse {
                name: name.to_owned(),
                load_balancers,
            });
        }
        self.change.node_pools.insert(name.to_owned(), None);
        Ok(true)
    }
}
