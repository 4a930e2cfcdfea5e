//! The store's records in memory, with the indexes derived from them, and the change a
//! transaction makes to them. Every backend keeps one [`State`]: loaded at open, read by
//! every call, and changed only by applying a [`Change`] its backend has committed (redb:
//! the write transaction; etcd: the watch, for this edge's writes and every other edge's).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::address::{VipHolders, first_free_vip};
use crate::model::{StoredLoadBalancer, StoredNodePool};

/// What one transaction writes: per record, its new value or `None` for a deletion.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Change {
    pub load_balancers: BTreeMap<String, Option<StoredLoadBalancer>>,
    pub holders: BTreeMap<IpAddr, Option<VipHolders>>,
    /// Idempotency-Key of a create → id of the load balancer it made.
    pub idempotency_keys: BTreeMap<String, Option<String>>,
    pub node_pools: BTreeMap<String, Option<StoredNodePool>>,
}

impl Change {
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of records it writes or deletes.
    pub fn len(&self) -> usize {
        self.load_balancers.len()
            + self.holders.len()
            + self.idempotency_keys.len()
            + self.node_pools.len()
    }

    /// Adds `other`'s writes, which come after this change's.
    pub fn extend(&mut self, other: Change) {
        self.load_balancers.extend(other.load_balancers);
        self.holders.extend(other.holders);
        self.idempotency_keys.extend(other.idempotency_keys);
        self.node_pools.extend(other.node_pools);
    }
}

/// Every record of the store, and what is derived from them.
#[derive(Debug, Clone, Default)]
pub(crate) struct State {
    /// Shared, so that a snapshot of every load balancer (each lifecycle pass, each
    /// list) copies pointers, not records: at 10,000 that copy was an eighth of
    /// cloud-mock's CPU under a create burst.
    load_balancers: BTreeMap<String, Arc<StoredLoadBalancer>>,
    holders: BTreeMap<IpAddr, VipHolders>,
    idempotency_keys: BTreeMap<String, String>,
    node_pools: BTreeMap<String, StoredNodePool>,
    /// `(node pool, load balancer id)` of every load balancer whose spec names a pool.
    references: BTreeSet<(String, String)>,
    /// The pools' CIDRs, each with its floor: an address below which every VIP of the CIDR
    /// is held, so that a search for a free one starts there instead of reading every VIP
    /// already handed out (quadratic in the number of load balancers).
    floors: BTreeMap<IpNet, Option<IpAddr>>,
}

impl State {
    /// An empty state whose VIP searches cover `cidrs`.
    pub fn new(cidrs: impl IntoIterator<Item = IpNet>) -> Self {
        Self {
            floors: cidrs.into_iter().map(|cidr| (cidr, None)).collect(),
            ..Self::default()
        }
    }

    /// The state holding `records` (a whole store, as read at open or after a relist).
    pub fn loaded(cidrs: impl IntoIterator<Item = IpNet>, records: Change) -> Self {
        let mut state = Self::new(cidrs);
        state.apply(records);
        state
    }

    pub fn load_balancer(&self, id: &str) -> Option<&StoredLoadBalancer> {
        self.load_balancers.get(id).map(AsRef::as_ref)
    }

    pub fn load_balancers(&self) -> impl Iterator<Item = &StoredLoadBalancer> {
        self.load_balancers.values().map(AsRef::as_ref)
    }

    pub fn shared_load_balancer(&self, id: &str) -> Option<&Arc<StoredLoadBalancer>> {
        self.load_balancers.get(id)
    }

    /// Every load balancer, shared with the state.
    pub fn shared_load_balancers(&self) -> impl Iterator<Item = &Arc<StoredLoadBalancer>> {
        self.load_balancers.values()
    }

    pub fn holders(&self, vip: IpAddr) -> Option<&VipHolders> {
        self.holders.get(&vip)
    }

    /// Every held VIP in `cidr` with its holders, lowest first.
    pub fn held_in(&self, cidr: IpNet) -> impl Iterator<Item = (IpAddr, &VipHolders)> {
        self.holders
            .range(cidr.network()..=cidr.broadcast())
            .map(|(vip, holders)| (*vip, holders))
    }

    pub fn idempotency_key(&self, key: &str) -> Option<&str> {
        self.idempotency_keys.get(key).map(String::as_str)
    }

    pub fn node_pool(&self, name: &str) -> Option<&StoredNodePool> {
        self.node_pools.get(name)
    }

    pub fn node_pools(&self) -> &BTreeMap<String, StoredNodePool> {
        &self.node_pools
    }

    /// Ids of the load balancers (being deleted too) that reference node pool `name`.
    pub fn referencing(&self, name: &str) -> impl Iterator<Item = &str> {
        self.references
            .range((name.to_owned(), String::new())..)
            .take_while(move |(pool, _)| pool == name)
            .map(|(_, id)| id.as_str())
    }

    /// Where the search for a free VIP of `cidr` may start.
    pub fn floor(&self, cidr: IpNet) -> Option<IpAddr> {
        self.floors.get(&cidr).copied().flatten()
    }

    /// Every record, as a change that writes them all into an empty store.
    pub fn records(&self) -> Change {
        Change {
            load_balancers: self
                .load_balancers
                .iter()
                .map(|(id, lb)| (id.clone(), Some(StoredLoadBalancer::clone(lb))))
                .collect(),
            holders: self
                .holders
                .iter()
                .map(|(vip, holders)| (*vip, Some(holders.clone())))
                .collect(),
            idempotency_keys: self
                .idempotency_keys
                .iter()
                .map(|(key, id)| (key.clone(), Some(id.clone())))
                .collect(),
            node_pools: self
                .node_pools
                .iter()
                .map(|(name, pool)| (name.clone(), Some(pool.clone())))
                .collect(),
        }
    }

    /// Applies a committed `change`, keeping the indexes with it.
    pub fn apply(&mut self, change: Change) {
        for (id, lb) in change.load_balancers {
            let old = match lb {
                Some(lb) => {
                    if let Some(pool) = &lb.spec.node_pool {
                        self.references.insert((pool.clone(), id.clone()));
                    }
                    self.load_balancers.insert(id.clone(), Arc::new(lb))
                }
                None => self.load_balancers.remove(&id),
            };
            let old_pool = old.and_then(|old| old.spec.node_pool.clone());
            let new_pool = self
                .load_balancers
                .get(&id)
                .and_then(|lb| lb.spec.node_pool.as_ref());
            if let Some(old_pool) = old_pool
                && new_pool != Some(&old_pool)
            {
                self.references.remove(&(old_pool, id));
            }
        }
        let mut freed = Vec::new();
        for (vip, holders) in change.holders {
            match holders.filter(|holders| !holders.ids.is_empty()) {
                Some(holders) => drop(self.holders.insert(vip, holders)),
                None => {
                    if self.holders.remove(&vip).is_some() {
                        freed.push(vip);
                    }
                }
            }
        }
        for (key, id) in change.idempotency_keys {
            match id {
                Some(id) => drop(self.idempotency_keys.insert(key, id)),
                None => drop(self.idempotency_keys.remove(&key)),
            }
        }
        for (name, pool) in change.node_pools {
            match pool {
                Some(pool) => drop(self.node_pools.insert(name, pool)),
                None => drop(self.node_pools.remove(&name)),
            }
        }
        self.move_floors(&freed);
    }

    /// Lowers each floor below the VIPs `freed`, then raises it past the VIPs now held.
    fn move_floors(&mut self, freed: &[IpAddr]) {
        let holders = &self.holders;
        for (cidr, floor) in &mut self.floors {
            for vip in freed.iter().filter(|vip| cidr.contains(*vip)) {
                if floor.is_none_or(|floor| *vip < floor) {
                    *floor = Some(*vip);
                }
            }
            let start = *floor;
            if let Some(free) = first_free_vip(*cidr, start, |vip| holders.contains_key(&vip)) {
                *floor = Some(free);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::spec;

    fn holders(id: &str) -> Option<VipHolders> {
        Some(VipHolders {
            sharing_key: None,
            ids: BTreeSet::from([id.to_owned()]),
        })
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 77, 0, last])
    }

    #[test]
    fn floors_follow_what_is_held_and_freed() {
        let cidr: IpNet = "127.77.0.0/29".parse().unwrap();
        let mut state = State::new([cidr]);
        let hold = |vips: &[(u8, Option<VipHolders>)]| Change {
            holders: vips
                .iter()
                .map(|(last, h)| (ip(*last), h.clone()))
                .collect(),
            ..Change::default()
        };
        state.apply(hold(&[
            (1, holders("a")),
            (2, holders("b")),
            (4, holders("d")),
        ]));
        assert_eq!(state.floor(cidr), Some(ip(3)));
        state.apply(hold(&[(3, holders("c"))]));
        assert_eq!(state.floor(cidr), Some(ip(5)), "past every held VIP");
        state.apply(hold(&[(2, None)]));
        assert_eq!(state.floor(cidr), Some(ip(2)), "a freed VIP lowers it");
    }

    #[test]
    fn references_follow_the_specs() {
        let mut state = State::default();
        let on_pool = |id: &str, pool: Option<&str>| {
            let mut lb = StoredLoadBalancer {
                id: id.into(),
                spec: spec(id),
                state: cloud_mock_sdk::State::Active,
                version: 1,
                state_since_ms: 0,
                idempotency_key: None,
            };
            lb.spec.node_pool = pool.map(str::to_owned);
            Change {
                load_balancers: BTreeMap::from([(id.to_owned(), Some(lb))]),
                ..Change::default()
            }
        };
        state.apply(on_pool("a", Some("p1")));
        state.apply(on_pool("b", Some("p1")));
        assert_eq!(state.referencing("p1").collect::<Vec<_>>(), ["a", "b"]);
        state.apply(on_pool("a", Some("p2")));
        state.apply(on_pool("b", None));
        assert_eq!(state.referencing("p1").count(), 0);
        assert_eq!(state.referencing("p2").collect::<Vec<_>>(), ["a"]);
        state.apply(Change {
            load_balancers: BTreeMap::from([("a".to_owned(), None)]),
            ..Change::default()
        });
        assert_eq!(state.referencing("p2").count(), 0);
    }
}
