//! The persistent store: load balancers, VIP allocations, idempotency keys and node pools
//! in one redb file. Every write is one transaction, committed durably (fsync) before it returns, so
//! an acknowledged change survives a crash, and a refused one leaves nothing behind.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use cloud_mock_sdk::families::LoadBalancerSpec;
use cloud_mock_sdk::{IpFamily, Mode, NodePoolSpec, Pool, Protocol, State};
use ipnet::IpNet;
use redb::{Database, ReadableDatabase, ReadableTable, Table, TableDefinition, TableHandle};
use serde::{Deserialize, Serialize};

use crate::model::{StoredLoadBalancer, StoredNodePool};
use crate::pools::{DEFAULT_POOL, VipPools, pool_size, vip_in_pool};
use crate::validate::Placement;

/// id → JSON of [`StoredLoadBalancer`].
const LOAD_BALANCERS: TableDefinition<&str, &[u8]> = TableDefinition::new("load_balancers");
/// IPv4 VIP (as u32) → JSON of the [`VipHolders`] sharing it.
const VIP_HOLDERS: TableDefinition<u32, &[u8]> = TableDefinition::new("vip_holders");
/// IPv6 VIP (as u128) → JSON of the [`VipHolders`] sharing it. A table of its own, so
/// that the IPv4 one of earlier versions stays as it was.
const VIP6_HOLDERS: TableDefinition<u128, &[u8]> = TableDefinition::new("vip6_holders");
/// Idempotency-Key of a create → id of the load balancer it made.
const IDEMPOTENCY_KEYS: TableDefinition<&str, &str> = TableDefinition::new("idempotency_keys");
/// Node pool name → JSON of [`StoredNodePool`]. Which load balancers reference a pool is
/// their specs' fact, indexed in [`NODE_POOL_REFERENCES`]; a write of either kind checks
/// the other in the same transaction, and redb has one writer at a time, so an LB never
/// references a pool a concurrent delete removed.
const NODE_POOLS: TableDefinition<&str, &[u8]> = TableDefinition::new("node_pools");
/// `pool NUL id` of every load balancer whose spec names a node pool: written in the
/// transaction that writes the spec, so a pool's read, write or delete reads its own load
/// balancers instead of decoding every one. Built from the specs when a store written
/// before it is opened.
const NODE_POOL_REFERENCES: TableDefinition<&str, ()> =
    TableDefinition::new("node_pool_references");

/// The load balancers on one VIP: one, or several with the same sharing key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct VipHolders {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sharing_key: Option<String>,
    ids: BTreeSet<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("opening the database {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: Box<redb::Error>,
    },
    #[error("database: {0}")]
    Database(#[source] Box<redb::Error>),
    #[error("stored {what} cannot be decoded: {source}")]
    Corrupt {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("encoding {what}: {source}")]
    Encode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("load balancer {id} not found")]
    NotFound { id: String },
    #[error("load balancer id {id} is taken (by a create with another Idempotency-Key)")]
    IdTaken { id: String },
    #[error(
        "VIP {vip} is held by load balancer {holder} (share it by giving both the same sharingKey)"
    )]
    VipTaken { vip: IpAddr, holder: String },
    #[error(
        "VIP {vip} is shared under key {key:?}, but {protocol} port {port} is already served there by load balancer {holder}"
    )]
    PortConflict {
        vip: IpAddr,
        key: String,
        protocol: Protocol,
        port: u16,
        holder: String,
    },
    #[error(
        "VIP {vip} is shared under key {key:?} by {holder}, a {holder_mode:?}-mode load balancer; sharers must use one mode"
    )]
    SharingModeMismatch {
        vip: IpAddr,
        key: String,
        holder: String,
        holder_mode: Mode,
    },
    #[error("the VIP pool {pool} ({cidr}) has no free address left")]
    PoolExhausted { pool: String, cidr: IpNet },
    #[error("there is no VIP pool named {pool}")]
    UnknownPool { pool: String },
    #[error("the VIP pool {pool} has no {family} addresses (ipFamilies asks for {family})")]
    PoolLacksFamily { pool: String, family: IpFamily },
    #[error("load balancer {id} is at version {current}, not {expected}")]
    VersionMismatch {
        id: String,
        current: u64,
        expected: u64,
    },
    #[error("load balancer {id} is being deleted")]
    Deleting { id: String },
    #[error("nodePool: there is no node pool named {name}")]
    UnknownNodePool { name: String },
    #[error("node pool {name} is referenced by load balancers {}", load_balancers.join(", "))]
    NodePoolInUse {
        name: String,
        load_balancers: Vec<String>,
    },
    #[error("node pool {name} is {}, not at version {expected}", current.map_or_else(|| "absent".to_owned(), |v| format!("at version {v}")))]
    NodePoolVersionMismatch {
        name: String,
        current: Option<u64>,
        expected: u64,
    },
    #[error("background task failed: {0}")]
    Task(String),
}

fn db_error(err: impl Into<redb::Error>) -> StoreError {
    StoreError::Database(Box::new(err.into()))
}

/// What a create did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Created {
    pub load_balancer: StoredLoadBalancer,
    /// False when the idempotency key named an existing load balancer, which is returned.
    pub is_new: bool,
}

/// What a state transition found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub load_balancer: StoredLoadBalancer,
    /// False when the load balancer was already in the target state: nothing was written.
    pub changed: bool,
}

/// What a node-pool write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    Created,
    Replaced,
    /// The pool had that content already: nothing was written, the version stays.
    Unchanged,
}

/// A node pool written (or found unchanged), with the load balancers referencing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePoolWrite {
    pub node_pool: StoredNodePool,
    pub load_balancers: Vec<String>,
    pub written: Written,
}

/// Every load balancer and node pool, read in one transaction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub load_balancers: Vec<StoredLoadBalancer>,
    pub node_pools: BTreeMap<String, StoredNodePool>,
}

impl Snapshot {
    /// The node pool `lb` names, if it names one.
    pub fn node_pool_of(&self, lb: &StoredLoadBalancer) -> Option<&StoredNodePool> {
        lb.spec
            .node_pool
            .as_ref()
            .and_then(|name| self.node_pools.get(name))
    }
}

/// Handle on the database; clones share it.
#[derive(Clone)]
pub struct Store {
    db: Arc<Database>,
    pools: Arc<VipPools>,
    floors: Arc<VipFloors>,
}

impl Store {
    /// Opens (or creates) `data_dir/cloud-mock.redb`, handing out VIPs from `pools`.
    pub fn open(data_dir: &Path, pools: VipPools) -> Result<Self, StoreError> {
        let path = data_dir.join("cloud-mock.redb");
        let open = || -> Result<Database, redb::Error> {
            std::fs::create_dir_all(data_dir)?;
            let db = Database::create(&path)?;
            // Create the tables so that readers never meet a missing one.
            let txn = db.begin_write()?;
            txn.open_table(LOAD_BALANCERS)?;
            txn.open_table(VIP_HOLDERS)?;
            txn.open_table(VIP6_HOLDERS)?;
            txn.open_table(IDEMPOTENCY_KEYS)?;
            txn.open_table(NODE_POOLS)?;
            txn.commit()?;
            Ok(db)
        };
        let db = open().map_err(|source| StoreError::Open {
            path: path.clone(),
            source: Box::new(source),
        })?;
        index_node_pool_references(&db)?;
        Ok(Self {
            db: Arc::new(db),
            pools: Arc::new(pools),
            floors: Arc::default(),
        })
    }

    pub fn pools(&self) -> &VipPools {
        &self.pools
    }

    /// Every pool (one entry per name and family) with the number of its addresses in use.
    pub fn pool_use(&self) -> Result<Vec<Pool>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let holders = Holders {
            v4: txn.open_table(VIP_HOLDERS).map_err(db_error)?,
            v6: txn.open_table(VIP6_HOLDERS).map_err(db_error)?,
        };
        self.pools
            .iter()
            .map(|(name, cidr)| {
                Ok(Pool {
                    name: name.to_owned(),
                    family: IpFamily::of_net(&cidr),
                    cidr,
                    size: pool_size(cidr),
                    allocated: holders.held_in(cidr)?.len() as u64,
                })
            })
            .collect()
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

    /// Runs the blocking store call `f` off the async runtime.
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|err| StoreError::Task(err.to_string()))?
    }

    pub fn get(&self, id: &str) -> Result<Option<StoredLoadBalancer>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
        read_lb(&table, id)
    }

    /// Every load balancer, ordered by id.
    pub fn list(&self) -> Result<Vec<StoredLoadBalancer>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let table = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
        read_all_lbs(&table)
    }

    /// Every load balancer and node pool, as of one moment.
    pub fn snapshot(&self) -> Result<Snapshot, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
        let pools = txn.open_table(NODE_POOLS).map_err(db_error)?;
        let node_pools = read_all_node_pools(&pools)?
            .into_iter()
            .map(|pool| (pool.name.clone(), pool))
            .collect();
        Ok(Snapshot {
            load_balancers: read_all_lbs(&lbs)?,
            node_pools,
        })
    }

    /// The node pool `name` with the load balancers referencing it; `None` when absent.
    pub fn get_node_pool(
        &self,
        name: &str,
    ) -> Result<Option<(StoredNodePool, Vec<String>)>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let references = txn.open_table(NODE_POOL_REFERENCES).map_err(db_error)?;
        let pools = txn.open_table(NODE_POOLS).map_err(db_error)?;
        let Some(pool) = read_node_pool(&pools, name)? else {
            return Ok(None);
        };
        Ok(Some((pool, referencing(&references, name)?)))
    }

    /// The node pool `name` alone (what an LB naming it resolves against).
    pub fn node_pool(&self, name: &str) -> Result<Option<StoredNodePool>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let pools = txn.open_table(NODE_POOLS).map_err(db_error)?;
        read_node_pool(&pools, name)
    }

    /// Every node pool, by name, with the load balancers referencing it.
    pub fn list_node_pools(&self) -> Result<Vec<(StoredNodePool, Vec<String>)>, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let references = txn.open_table(NODE_POOL_REFERENCES).map_err(db_error)?;
        let pools = txn.open_table(NODE_POOLS).map_err(db_error)?;
        read_all_node_pools(&pools)?
            .into_iter()
            .map(|pool| {
                let ids = referencing(&references, &pool.name)?;
                Ok((pool, ids))
            })
            .collect()
    }

    /// Creates or replaces the node pool `name` with a validated `spec` (its backends kept
    /// in address order: a pool is a set). With `if_match`, the pool must exist at that
    /// version, unless it has that content already: that changes nothing, not even the
    /// version.
    pub fn put_node_pool(
        &self,
        name: &str,
        spec: &NodePoolSpec,
        if_match: Option<u64>,
    ) -> Result<NodePoolWrite, StoreError> {
        let mut wanted = spec.clone();
        wanted.backends.sort_unstable();
        let txn = self.db.begin_write().map_err(db_error)?;
        let write = {
            let references = txn.open_table(NODE_POOL_REFERENCES).map_err(db_error)?;
            let mut pools = txn.open_table(NODE_POOLS).map_err(db_error)?;
            let current = read_node_pool(&pools, name)?;
            let load_balancers = referencing(&references, name)?;
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
            let (node_pool, written) = match current {
                Some(pool) => (
                    StoredNodePool {
                        name: name.to_owned(),
                        spec: wanted,
                        version: pool.version + 1,
                    },
                    Written::Replaced,
                ),
                None => (
                    StoredNodePool {
                        name: name.to_owned(),
                        spec: wanted,
                        version: 1,
                    },
                    Written::Created,
                ),
            };
            let bytes = serde_json::to_vec(&node_pool).map_err(|source| StoreError::Encode {
                what: "node pool",
                source,
            })?;
            pools.insert(name, bytes.as_slice()).map_err(db_error)?;
            NodePoolWrite {
                node_pool,
                load_balancers,
                written,
            }
        };
        txn.commit().map_err(db_error)?;
        Ok(write)
    }

    /// Deletes the node pool `name`: false when there is none, refused while a load
    /// balancer that is not removed yet (being deleted counts) references it.
    pub fn delete_node_pool(&self, name: &str) -> Result<bool, StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        {
            let references = txn.open_table(NODE_POOL_REFERENCES).map_err(db_error)?;
            let mut pools = txn.open_table(NODE_POOLS).map_err(db_error)?;
            if read_node_pool(&pools, name)?.is_none() {
                return Ok(false);
            }
            let load_balancers = referencing(&references, name)?;
            if !load_balancers.is_empty() {
                return Err(StoreError::NodePoolInUse {
                    name: name.to_owned(),
                    load_balancers,
                });
            }
            pools.remove(name).map_err(db_error)?;
        }
        txn.commit().map_err(db_error)?;
        Ok(true)
    }

    /// Creates a load balancer from a validated `spec` placed by `placement`, allocating
    /// a VIP per family (see [`place`]), all or none, under `requested_id` (validated) or
    /// an id of the store's choosing. With an `idempotency_key` already used, returns the
    /// load balancer that key created instead.
    pub fn create(
        &self,
        spec: &LoadBalancerSpec,
        placement: &Placement,
        requested_id: Option<&str>,
        idempotency_key: Option<&str>,
        now_ms: u64,
    ) -> Result<Created, StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        let mut floors = self.floors.begin();
        let created = {
            let mut lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
            let mut holders = Holders {
                v4: txn.open_table(VIP_HOLDERS).map_err(db_error)?,
                v6: txn.open_table(VIP6_HOLDERS).map_err(db_error)?,
            };
            let mut keys = txn.open_table(IDEMPOTENCY_KEYS).map_err(db_error)?;
            let pools = txn.open_table(NODE_POOLS).map_err(db_error)?;
            let mut references = txn.open_table(NODE_POOL_REFERENCES).map_err(db_error)?;
            if let Some(key) = idempotency_key {
                let known = keys
                    .get(key)
                    .map_err(db_error)?
                    .map(|id| id.value().to_owned());
                if let Some(id) = known
                    && let Some(existing) = read_lb(&lbs, &id)?
                {
                    return Ok(Created {
                        load_balancer: existing,
                        is_new: false,
                    });
                }
            }
            check_node_pool(&pools, spec)?;
            let id = match requested_id {
                Some(id) if lbs.get(id).map_err(db_error)?.is_some() => {
                    return Err(StoreError::IdTaken { id: id.to_owned() });
                }
                Some(id) => id.to_owned(),
                None => loop {
                    let candidate = new_id();
                    if lbs.get(candidate.as_str()).map_err(db_error)?.is_none() {
                        break candidate;
                    }
                },
            };
            let pool = placement.pool.as_deref().unwrap_or(DEFAULT_POOL);
            let mut vips = Vec::with_capacity(placement.vips.len());
            for wanted in &placement.vips {
                let cidr = self.cidr(pool, wanted.family)?;
                vips.push(place(
                    &lbs,
                    &holders,
                    &mut floors,
                    &id,
                    spec,
                    pool,
                    cidr,
                    wanted.requested,
                )?);
            }
            let lb = StoredLoadBalancer {
                id: id.clone(),
                spec: assigned(spec, &vips, pool),
                state: State::Provisioning,
                version: 1,
                state_since_ms: now_ms,
                idempotency_key: idempotency_key.map(str::to_owned),
            };
            write_lb(&mut lbs, &lb)?;
            move_reference(&mut references, &id, None, lb.spec.node_pool.as_deref())?;
            for &vip in &vips {
                holders.hold(vip, &id, spec.address.sharing_key.as_deref())?;
            }
            if let Some(key) = idempotency_key {
                keys.insert(key, id.as_str()).map_err(db_error)?;
            }
            lb
        };
        txn.commit().map_err(db_error)?;
        floors.commit();
        Ok(Created {
            load_balancer: created,
            is_new: true,
        })
    }

    /// Replaces the spec of `id` if it is at `expected_version`. A family that requests no
    /// VIP keeps its allocated one (if it lies in the pool the spec names); another VIP or
    /// pool moves the allocation, a new family allocates one and a family left out frees
    /// its VIP, within this one load balancer. An unchanged spec changes nothing (not
    /// even the version).
    pub fn update(
        &self,
        id: &str,
        spec: &LoadBalancerSpec,
        placement: &Placement,
        expected_version: u64,
    ) -> Result<StoredLoadBalancer, StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        let mut floors = self.floors.begin();
        let updated = {
            let mut lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
            let mut holders = Holders {
                v4: txn.open_table(VIP_HOLDERS).map_err(db_error)?,
                v6: txn.open_table(VIP6_HOLDERS).map_err(db_error)?,
            };
            let mut lb =
                read_lb(&lbs, id)?.ok_or_else(|| StoreError::NotFound { id: id.into() })?;
            if lb.state == State::Deleting {
                return Err(StoreError::Deleting { id: id.into() });
            }
            if lb.version != expected_version {
                return Err(StoreError::VersionMismatch {
                    id: id.into(),
                    current: lb.version,
                    expected: expected_version,
                });
            }
            check_node_pool(&txn.open_table(NODE_POOLS).map_err(db_error)?, spec)?;
            let current_vips = lb.vips();
            // Records written before pools existed name none: theirs is the default pool.
            let current_pool = lb
                .spec
                .address
                .pool
                .clone()
                .unwrap_or_else(|| DEFAULT_POOL.to_owned());
            let pool = placement.pool.as_deref().unwrap_or(&current_pool);
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
                            if may_share(&lbs, vip, &holders.get(vip)?, id, spec)? {
                                kept = Some(vip);
                                break;
                            }
                        }
                        kept
                    }
                };
                vips.push(place(
                    &lbs,
                    &holders,
                    &mut floors,
                    id,
                    spec,
                    pool,
                    cidr,
                    requested,
                )?);
            }
            let desired = assigned(spec, &vips, pool);
            if desired == lb.spec {
                return Ok(lb);
            }
            for &old in &current_vips {
                if holders.release(old, id)? {
                    floors.released(old);
                }
            }
            for &vip in &vips {
                holders.hold(vip, id, spec.address.sharing_key.as_deref())?;
            }
            move_reference(
                &mut txn.open_table(NODE_POOL_REFERENCES).map_err(db_error)?,
                id,
                lb.spec.node_pool.as_deref(),
                desired.node_pool.as_deref(),
            )?;
            lb.spec = desired;
            lb.version += 1;
            write_lb(&mut lbs, &lb)?;
            lb
        };
        txn.commit().map_err(db_error)?;
        floors.commit();
        Ok(updated)
    }

    /// Starts deleting `id`; `None` when there is no such load balancer. Deleting one that
    /// is already being deleted changes nothing.
    pub fn mark_deleting(&self, id: &str, now_ms: u64) -> Result<Option<Transition>, StoreError> {
        self.transition(
            id,
            &[State::Provisioning, State::Active],
            State::Deleting,
            now_ms,
        )
    }

    /// Moves each of `ids` that is still provisioning to active, in one transaction (one
    /// fsync however many are due); the number moved.
    pub fn mark_active(&self, ids: &[String], now_ms: u64) -> Result<usize, StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        let mut moved = 0;
        {
            let mut lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
            for id in ids {
                let moved_one =
                    transition_in(&mut lbs, id, &[State::Provisioning], State::Active, now_ms)?;
                moved += usize::from(moved_one.is_some_and(|t| t.changed));
            }
        }
        txn.commit().map_err(db_error)?;
        Ok(moved)
    }

    fn transition(
        &self,
        id: &str,
        from: &[State],
        to: State,
        now_ms: u64,
    ) -> Result<Option<Transition>, StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        let result = {
            let mut lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
            transition_in(&mut lbs, id, from, to, now_ms)?
        };
        txn.commit().map_err(db_error)?;
        Ok(result)
    }

    /// Removes a load balancer that finished deleting, freeing its idempotency key and its
    /// VIP (a shared VIP with the last of its sharers).
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        let mut floors = self.floors.begin();
        {
            let mut lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
            let mut holders = Holders {
                v4: txn.open_table(VIP_HOLDERS).map_err(db_error)?,
                v6: txn.open_table(VIP6_HOLDERS).map_err(db_error)?,
            };
            let mut keys = txn.open_table(IDEMPOTENCY_KEYS).map_err(db_error)?;
            let Some(lb) = read_lb(&lbs, id)? else {
                return Ok(());
            };
            lbs.remove(id).map_err(db_error)?;
            move_reference(
                &mut txn.open_table(NODE_POOL_REFERENCES).map_err(db_error)?,
                id,
                lb.spec.node_pool.as_deref(),
                None,
            )?;
            for vip in lb.vips() {
                if holders.release(vip, id)? {
                    floors.released(vip);
                }
            }
            if let Some(key) = &lb.idempotency_key {
                keys.remove(key.as_str()).map_err(db_error)?;
            }
        }
        txn.commit().map_err(db_error)?;
        floors.commit();
        Ok(())
    }
}

/// Moves `id` from one of `from` to `to` within a write transaction; `None` when it is
/// gone, or in another state than `to`.
fn transition_in(
    lbs: &mut Table<'_, &'static str, &'static [u8]>,
    id: &str,
    from: &[State],
    to: State,
    now_ms: u64,
) -> Result<Option<Transition>, StoreError> {
    let Some(mut lb) = read_lb(lbs, id)? else {
        return Ok(None);
    };
    if !from.contains(&lb.state) {
        return Ok((lb.state == to).then_some(Transition {
            load_balancer: lb,
            changed: false,
        }));
    }
    lb.state = to;
    lb.state_since_ms = now_ms;
    write_lb(lbs, &lb)?;
    Ok(Some(Transition {
        load_balancer: lb,
        changed: true,
    }))
}

/// The lowest address of `pool` from `floor` on (every VIP below it is taken) that may be
/// a VIP and is not taken. An IPv6 pool is scanned from its start too: the scan ends
/// after at most one more address than are taken, however large the pool.
pub fn first_free_vip<E>(
    pool: IpNet,
    floor: Option<IpAddr>,
    mut is_taken: impl FnMut(IpAddr) -> Result<bool, E>,
) -> Result<Option<IpAddr>, E> {
    let mut candidates = pool.hosts();
    if let (Some(floor), Some(first)) = (floor, pool.hosts().next()) {
        // Ranges skip in O(1); skipping the floor's predecessors leaves it next.
        let skip = ordinal(floor).saturating_sub(ordinal(first));
        if let Some(before_floor) = skip.checked_sub(1) {
            candidates.nth(usize::try_from(before_floor).unwrap_or(usize::MAX));
        }
    }
    for candidate in candidates {
        if vip_in_pool(candidate, pool) && !is_taken(candidate)? {
            return Ok(Some(candidate));
        }
    }
    Ok(None)
}

/// The address as a number, to count the addresses between two of one family.
fn ordinal(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// Per pool CIDR, an address below which every VIP of the CIDR is taken: where the search
/// for a free one starts, so a create reads a VIP or two instead of one per VIP already
/// handed out (quadratic in the number of LBs). Kept in memory (a restart searches from
/// the start once).
#[derive(Debug, Default)]
struct VipFloors(Mutex<HashMap<IpNet, IpAddr>>);

impl VipFloors {
    /// The floors as one write transaction sees them. Call it after `begin_write`: the
    /// lock is then held through the commit, so no other transaction releases a VIP
    /// between this one's search and its raising of the floor.
    fn begin(&self) -> FloorsTxn<'_> {
        FloorsTxn {
            floors: self.0.lock().unwrap_or_else(|e| e.into_inner()),
            found: HashMap::new(),
            released: Vec::new(),
        }
    }
}

/// What one write transaction learnt about the floors; applied only when it commits.
struct FloorsTxn<'a> {
    floors: MutexGuard<'a, HashMap<IpNet, IpAddr>>,
    /// Per CIDR, the VIP a search from the floor took (all below it are taken).
    found: HashMap<IpNet, IpAddr>,
    released: Vec<IpAddr>,
}

impl FloorsTxn<'_> {
    fn floor(&self, cidr: IpNet) -> Option<IpAddr> {
        self.found
            .get(&cidr)
            .or_else(|| self.floors.get(&cidr))
            .copied()
    }

    fn found(&mut self, cidr: IpNet, vip: IpAddr) {
        self.found.insert(cidr, vip);
    }

    fn released(&mut self, vip: IpAddr) {
        self.released.push(vip);
    }

    /// Raises the floors to what the searches took, then lowers each below every VIP this
    /// transaction freed.
    fn commit(mut self) {
        for (cidr, vip) in std::mem::take(&mut self.found) {
            self.floors.insert(cidr, vip);
        }
        for vip in std::mem::take(&mut self.released) {
            for (cidr, floor) in self.floors.iter_mut() {
                if cidr.contains(&vip) && vip < *floor {
                    *floor = vip;
                }
            }
        }
    }
}

fn new_id() -> String {
    format!("lb-{:08x}", rand::random::<u32>())
}

/// The spec as stored: the assigned VIPs in `vips` (family order) and the IPv4 one in
/// `vip`, the pool named.
fn assigned(spec: &LoadBalancerSpec, vips: &[IpAddr], pool: &str) -> LoadBalancerSpec {
    let mut stored = spec.clone();
    stored.vip = vips.iter().find_map(|vip| match vip {
        IpAddr::V4(v4) => Some(*v4),
        IpAddr::V6(_) => None,
    });
    stored.address.vips = vips.to_vec();
    stored.address.pool = Some(pool.to_owned());
    stored
}

/// The VIP load balancer `id` with `spec` gets from `cidr` (one family of `pool`):
/// `requested` if it is free or may be shared; without a request, an address its sharing
/// key already holds in the CIDR where it fits (as MetalLB shares), else the lowest free
/// one. Each family shares on its own.
#[allow(clippy::too_many_arguments)]
fn place<T4, T6>(
    lbs: &impl ReadableTable<&'static str, &'static [u8]>,
    holders: &Holders<T4, T6>,
    floors: &mut FloorsTxn<'_>,
    id: &str,
    spec: &LoadBalancerSpec,
    pool: &str,
    cidr: IpNet,
    requested: Option<IpAddr>,
) -> Result<IpAddr, StoreError>
where
    T4: ReadableTable<u32, &'static [u8]>,
    T6: ReadableTable<u128, &'static [u8]>,
{
    if let Some(vip) = requested {
        let sharers = holders.get(vip)?;
        check_sharing(lbs, vip, &sharers, id, spec)?;
        return Ok(vip);
    }
    if spec.address.sharing_key.is_some() {
        for (vip, sharers) in holders.held_in(cidr)? {
            if sharers.sharing_key != spec.address.sharing_key {
                continue;
            }
            if may_share(lbs, vip, &sharers, id, spec)? {
                return Ok(vip);
            }
        }
    }
    let vip = first_free_vip(cidr, floors.floor(cidr), |candidate| {
        holders.is_held(candidate)
    })?
    .ok_or_else(|| StoreError::PoolExhausted {
        pool: pool.to_owned(),
        cidr,
    })?;
    floors.found(cidr, vip);
    Ok(vip)
}

/// [`check_sharing`] as a yes or no: a refusal means "look elsewhere", while a database
/// or decoding error is no answer.
fn may_share(
    lbs: &impl ReadableTable<&'static str, &'static [u8]>,
    vip: IpAddr,
    sharers: &VipHolders,
    id: &str,
    spec: &LoadBalancerSpec,
) -> Result<bool, StoreError> {
    match check_sharing(lbs, vip, sharers, id, spec) {
        Ok(()) => Ok(true),
        Err(
            StoreError::VipTaken { .. }
            | StoreError::PortConflict { .. }
            | StoreError::SharingModeMismatch { .. },
        ) => Ok(false),
        Err(err) => Err(err),
    }
}

/// Whether `id` with `spec` may hold `vip` beside `sharers`: nobody else holds it, or
/// all of them carry the same sharing key, use the same mode and serve none of its
/// (protocol, port) pairs.
fn check_sharing(
    lbs: &impl ReadableTable<&'static str, &'static [u8]>,
    vip: IpAddr,
    sharers: &VipHolders,
    id: &str,
    spec: &LoadBalancerSpec,
) -> Result<(), StoreError> {
    let Some(first_other) = sharers.ids.iter().find(|holder| *holder != id) else {
        return Ok(());
    };
    let key = match (&spec.address.sharing_key, &sharers.sharing_key) {
        (Some(mine), Some(theirs)) if mine == theirs => mine,
        _ => {
            return Err(StoreError::VipTaken {
                vip,
                holder: first_other.clone(),
            });
        }
    };
    let ports: BTreeSet<(Protocol, u16)> = spec
        .listeners
        .iter()
        .map(|listener| (listener.protocol, listener.port))
        .collect();
    for holder in sharers.ids.iter().filter(|holder| *holder != id) {
        let Some(other) = read_lb(lbs, holder)? else {
            continue;
        };
        if other.spec.mode != spec.mode {
            return Err(StoreError::SharingModeMismatch {
                vip,
                key: key.clone(),
                holder: holder.clone(),
                holder_mode: other.spec.mode,
            });
        }
        if let Some(clash) = other
            .spec
            .listeners
            .iter()
            .find(|listener| ports.contains(&(listener.protocol, listener.port)))
        {
            return Err(StoreError::PortConflict {
                vip,
                key: key.clone(),
                protocol: clash.protocol,
                port: clash.port,
                holder: holder.clone(),
            });
        }
    }
    Ok(())
}

/// The holders of every VIP: one table per family, keyed by the address as a number.
struct Holders<T4, T6> {
    v4: T4,
    v6: T6,
}

impl<T4, T6> Holders<T4, T6>
where
    T4: ReadableTable<u32, &'static [u8]>,
    T6: ReadableTable<u128, &'static [u8]>,
{
    fn get(&self, vip: IpAddr) -> Result<VipHolders, StoreError> {
        let value = match vip {
            IpAddr::V4(v4) => self.v4.get(u32::from(v4)).map_err(db_error)?,
            IpAddr::V6(v6) => self.v6.get(u128::from(v6)).map_err(db_error)?,
        };
        value.map_or(Ok(VipHolders::default()), |value| {
            decode_holders(vip, value.value())
        })
    }

    fn is_held(&self, vip: IpAddr) -> Result<bool, StoreError> {
        let held = match vip {
            IpAddr::V4(v4) => self.v4.get(u32::from(v4)).map_err(db_error)?.is_some(),
            IpAddr::V6(v6) => self.v6.get(u128::from(v6)).map_err(db_error)?.is_some(),
        };
        Ok(held)
    }

    /// Every held VIP in `cidr` with its holders, lowest first.
    fn held_in(&self, cidr: IpNet) -> Result<Vec<(IpAddr, VipHolders)>, StoreError> {
        let mut held = Vec::new();
        match cidr {
            IpNet::V4(cidr) => {
                let range = u32::from(cidr.network())..=u32::from(cidr.broadcast());
                for entry in self.v4.range(range).map_err(db_error)? {
                    let (vip, value) = entry.map_err(db_error)?;
                    let vip = IpAddr::V4(Ipv4Addr::from(vip.value()));
                    held.push((vip, decode_holders(vip, value.value())?));
                }
            }
            IpNet::V6(cidr) => {
                let range = u128::from(cidr.network())..=u128::from(cidr.broadcast());
                for entry in self.v6.range(range).map_err(db_error)? {
                    let (vip, value) = entry.map_err(db_error)?;
                    let vip = IpAddr::V6(Ipv6Addr::from(vip.value()));
                    held.push((vip, decode_holders(vip, value.value())?));
                }
            }
        }
        Ok(held)
    }
}

impl Holders<Table<'_, u32, &'static [u8]>, Table<'_, u128, &'static [u8]>> {
    fn write(&mut self, vip: IpAddr, sharers: &VipHolders) -> Result<(), StoreError> {
        if sharers.ids.is_empty() {
            match vip {
                IpAddr::V4(v4) => drop(self.v4.remove(u32::from(v4)).map_err(db_error)?),
                IpAddr::V6(v6) => drop(self.v6.remove(u128::from(v6)).map_err(db_error)?),
            }
            return Ok(());
        }
        let bytes = serde_json::to_vec(sharers).map_err(|source| StoreError::Encode {
            what: "VIP holders",
            source,
        })?;
        match vip {
            IpAddr::V4(v4) => drop(
                self.v4
                    .insert(u32::from(v4), bytes.as_slice())
                    .map_err(db_error)?,
            ),
            IpAddr::V6(v6) => drop(
                self.v6
                    .insert(u128::from(v6), bytes.as_slice())
                    .map_err(db_error)?,
            ),
        }
        Ok(())
    }

    /// Adds `id` to the holders of `vip` (checked with [`check_sharing`] before).
    fn hold(&mut self, vip: IpAddr, id: &str, sharing_key: Option<&str>) -> Result<(), StoreError> {
        let mut sharers = self.get(vip)?;
        sharers.ids.insert(id.to_owned());
        sharers.sharing_key = sharing_key.map(str::to_owned);
        self.write(vip, &sharers)
    }

    /// Removes `id` from the holders of `vip`; the last one frees it (`true`).
    fn release(&mut self, vip: IpAddr, id: &str) -> Result<bool, StoreError> {
        let mut sharers = self.get(vip)?;
        if sharers.ids.remove(id) {
            self.write(vip, &sharers)?;
        }
        Ok(sharers.ids.is_empty())
    }
}

/// Refuses a spec that names a node pool the store does not have.
fn check_node_pool(
    pools: &impl ReadableTable<&'static str, &'static [u8]>,
    spec: &LoadBalancerSpec,
) -> Result<(), StoreError> {
    match &spec.node_pool {
        Some(name) if pools.get(name.as_str()).map_err(db_error)?.is_none() => {
            Err(StoreError::UnknownNodePool { name: name.clone() })
        }
        _ => Ok(()),
    }
}

/// Ids of the load balancers (being deleted too) that reference node pool `name`.
fn referencing(
    references: &impl ReadableTable<&'static str, ()>,
    name: &str,
) -> Result<Vec<String>, StoreError> {
    let (start, end) = (format!("{name}\0"), format!("{name}\u{1}"));
    let mut ids = Vec::new();
    for entry in references
        .range(start.as_str()..end.as_str())
        .map_err(db_error)?
    {
        let (key, _) = entry.map_err(db_error)?;
        ids.push(key.value()[start.len()..].to_owned());
    }
    Ok(ids)
}

/// Moves `id`'s entry in the index of node-pool references from pool `from` to `to`.
fn move_reference(
    references: &mut Table<'_, &'static str, ()>,
    id: &str,
    from: Option<&str>,
    to: Option<&str>,
) -> Result<(), StoreError> {
    if from == to {
        return Ok(());
    }
    if let Some(pool) = from {
        references
            .remove(format!("{pool}\0{id}").as_str())
            .map_err(db_error)?;
    }
    if let Some(pool) = to {
        references
            .insert(format!("{pool}\0{id}").as_str(), ())
            .map_err(db_error)?;
    }
    Ok(())
}

/// Creates the index of node-pool references from the specs, in a store written before
/// it existed.
fn index_node_pool_references(db: &Database) -> Result<(), StoreError> {
    let txn = db.begin_write().map_err(db_error)?;
    let indexed = txn
        .list_tables()
        .map_err(db_error)?
        .any(|table| table.name() == NODE_POOL_REFERENCES.name());
    if indexed {
        return Ok(());
    }
    {
        let lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
        let mut references = txn.open_table(NODE_POOL_REFERENCES).map_err(db_error)?;
        for lb in read_all_lbs(&lbs)? {
            move_reference(&mut references, &lb.id, None, lb.spec.node_pool.as_deref())?;
        }
    }
    txn.commit().map_err(db_error)
}

fn read_all_node_pools(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
) -> Result<Vec<StoredNodePool>, StoreError> {
    read_all(table, decode_node_pool)
}

fn read_all_lbs(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
) -> Result<Vec<StoredLoadBalancer>, StoreError> {
    read_all(table, decode)
}

/// Every entry of `table`, each decoded by its key.
fn read_all<T>(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
    decode: impl Fn(&str, &[u8]) -> Result<T, StoreError>,
) -> Result<Vec<T>, StoreError> {
    let mut all = Vec::new();
    for entry in table.iter().map_err(db_error)? {
        let (key, value) = entry.map_err(db_error)?;
        all.push(decode(key.value(), value.value())?);
    }
    Ok(all)
}

fn read_node_pool(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
    name: &str,
) -> Result<Option<StoredNodePool>, StoreError> {
    table
        .get(name)
        .map_err(db_error)?
        .map(|value| decode_node_pool(name, value.value()))
        .transpose()
}

fn decode_node_pool(name: &str, bytes: &[u8]) -> Result<StoredNodePool, StoreError> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Corrupt {
        what: format!("node pool {name}"),
        source,
    })
}

fn decode_holders(vip: IpAddr, bytes: &[u8]) -> Result<VipHolders, StoreError> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Corrupt {
        what: format!("holders of VIP {vip}"),
        source,
    })
}

fn read_lb(
    table: &impl ReadableTable<&'static str, &'static [u8]>,
    id: &str,
) -> Result<Option<StoredLoadBalancer>, StoreError> {
    table
        .get(id)
        .map_err(db_error)?
        .map(|value| decode(id, value.value()))
        .transpose()
}

fn write_lb(
    table: &mut Table<'_, &'static str, &'static [u8]>,
    lb: &StoredLoadBalancer,
) -> Result<(), StoreError> {
    let bytes = serde_json::to_vec(lb).map_err(|source| StoreError::Encode {
        what: "load balancer",
        source,
    })?;
    table
        .insert(lb.id.as_str(), bytes.as_slice())
        .map_err(db_error)?;
    Ok(())
}

fn decode(id: &str, bytes: &[u8]) -> Result<StoredLoadBalancer, StoreError> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Corrupt {
        what: format!("load balancer {id}"),
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use cloud_mock_sdk::Listener;

    use super::*;
    use crate::model::tests::spec;
    use crate::testutil::TempDir;
    use crate::validate::validate_spec;

    fn pool() -> IpNet {
        "127.77.0.0/29".parse().unwrap()
    }

    fn pools() -> VipPools {
        "127.77.0.0/29,blue=127.78.0.0/30".parse().unwrap()
    }

    fn open(dir: &TempDir) -> Store {
        Store::open(dir.path(), pools()).unwrap()
    }

    /// Creates `spec` as the API does: validated, then placed.
    fn create(
        store: &Store,
        spec: &LoadBalancerSpec,
        key: Option<&str>,
    ) -> Result<Created, StoreError> {
        create_as(store, spec, None, key)
    }

    /// [`create`] under an id the client chose.
    fn create_as(
        store: &Store,
        spec: &LoadBalancerSpec,
        id: Option<&str>,
        key: Option<&str>,
    ) -> Result<Created, StoreError> {
        let placement = validate_spec(spec, store.pools()).unwrap();
        store.create(spec, &placement, id, key, 0)
    }

    fn update(
        store: &Store,
        id: &str,
        spec: &LoadBalancerSpec,
        version: u64,
    ) -> Result<StoredLoadBalancer, StoreError> {
        let placement = validate_spec(spec, store.pools()).unwrap();
        store.update(id, spec, &placement, version)
    }

    fn ip(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(127, 77, 0, last)
    }

    /// A load balancer named `name` sharing under `key`, serving TCP `ports`.
    fn sharer(name: &str, key: &str, ports: &[u16]) -> LoadBalancerSpec {
        let mut s = spec(name);
        s.address.sharing_key = Some(key.into());
        let template = s.listeners[0].clone();
        s.listeners = ports
            .iter()
            .map(|&port| Listener {
                port,
                ..template.clone()
            })
            .collect();
        s
    }

    #[test]
    fn lowest_free_vip_skips_taken_and_edge_addresses() {
        let taken = [IpAddr::V4(ip(1)), IpAddr::V4(ip(3))];
        let free = first_free_vip::<Infallible>(pool(), None, |ip| Ok(taken.contains(&ip)));
        assert_eq!(free, Ok(Some(IpAddr::V4(ip(2)))));
        let none = first_free_vip::<Infallible>(pool(), None, |_| Ok(true));
        assert_eq!(none, Ok(None));
        let v6: IpNet = "2001:db8:51:100::/64".parse().unwrap();
        let taken6: IpAddr = "2001:db8:51:100::1".parse().unwrap();
        assert_eq!(
            first_free_vip::<Infallible>(v6, None, |ip| Ok(ip == taken6)),
            Ok(Some("2001:db8:51:100::2".parse().unwrap())),
            "not the subnet-router anycast address, not a taken one"
        );
    }

    #[test]
    fn the_search_starts_at_the_floor() {
        let taken = [IpAddr::V4(ip(3))];
        let from_floor = first_free_vip::<Infallible>(pool(), Some(IpAddr::V4(ip(3))), |ip| {
            Ok(taken.contains(&ip))
        });
        assert_eq!(
            from_floor,
            Ok(Some(IpAddr::V4(ip(4)))),
            "ip(1) and ip(2) not read"
        );
        let past_the_end =
            first_free_vip::<Infallible>(pool(), Some(IpAddr::V4(ip(7))), |_| Ok(false));
        assert_eq!(past_the_end, Ok(None), "the broadcast address is no VIP");
    }

    #[test]
    fn a_freed_vip_is_handed_out_first_again() {
        let dir = TempDir::new("store-floor");
        let store = open(&dir);
        let vip_of = |created: &Created| created.load_balancer.spec.vip;
        let lbs: Vec<Created> = ["a", "b", "c"]
            .iter()
            .map(|name| create(&store, &spec(name), None).unwrap())
            .collect();
        assert_eq!(
            lbs.iter().map(vip_of).collect::<Vec<_>>(),
            [1, 2, 3].map(|n| Some(ip(n)))
        );
        let second = &lbs[1].load_balancer.id;
        store.mark_deleting(second, 0).unwrap();
        store.remove(second).unwrap();
        assert_eq!(
            vip_of(&create(&store, &spec("d"), None).unwrap()),
            Some(ip(2))
        );
        assert_eq!(
            vip_of(&create(&store, &spec("e"), None).unwrap()),
            Some(ip(4))
        );
    }

    #[test]
    fn create_allocates_and_persists_across_reopen() {
        let dir = TempDir::new("store-reopen");
        let store = open(&dir);
        let first = create(&store, &spec("a"), Some("key-a")).unwrap();
        assert!(first.is_new);
        let lb = first.load_balancer;
        assert_eq!(lb.spec.vip, Some(Ipv4Addr::new(127, 77, 0, 1)));
        assert_eq!(lb.state, State::Provisioning);
        assert_eq!(lb.spec.address.pool.as_deref(), Some("default"));
        assert_eq!(lb.spec.address.vips, vec![IpAddr::V4(ip(1))]);
        assert_eq!(lb.version, 1);
        assert!(lb.id.starts_with("lb-") && lb.id.len() == 11);
        drop(store);

        let store = open(&dir);
        assert_eq!(store.get(&lb.id).unwrap(), Some(lb.clone()));
        let again = create(&store, &spec("other"), Some("key-a")).unwrap();
        assert!(!again.is_new);
        assert_eq!(again.load_balancer, lb);
        let second = create(&store, &spec("b"), None).unwrap().load_balancer;
        assert_eq!(second.spec.vip, Some(Ipv4Addr::new(127, 77, 0, 2)));
        assert_eq!(store.list().unwrap().len(), 2);
    }

    #[test]
    fn requested_vip_taken_and_pool_exhaustion_are_refused() {
        let dir = TempDir::new("store-vips");
        let store = open(&dir);
        let mut wanted = spec("a");
        wanted.vip = Some(Ipv4Addr::new(127, 77, 0, 5));
        let holder = create(&store, &wanted, None).unwrap().load_balancer;
        assert!(matches!(
            create(&store, &wanted, None),
            Err(StoreError::VipTaken { holder: h, .. }) if h == holder.id
        ));
        // A /29 has six usable VIPs; one is taken by the request above.
        for _ in 0..5 {
            create(&store, &spec("x"), None).unwrap();
        }
        assert!(matches!(
            create(&store, &spec("x"), None),
            Err(StoreError::PoolExhausted { pool, .. }) if pool == "default"
        ));
        assert_eq!(
            store.list().unwrap().len(),
            6,
            "the refused creates left nothing"
        );
        let used = store.pool_use().unwrap();
        assert_eq!(
            used.iter()
                .map(|p| (p.name.as_str(), p.size, p.allocated))
                .collect::<Vec<_>>(),
            vec![("blue", 2, 0), ("default", 6, 6)]
        );
    }

    #[test]
    fn named_pools_hand_out_their_own_addresses() {
        let dir = TempDir::new("store-pools");
        let store = open(&dir);
        let mut blue = spec("b");
        blue.address.pool = Some("blue".into());
        let first = create(&store, &blue, None).unwrap().load_balancer;
        assert_eq!(first.spec.vip, Some(Ipv4Addr::new(127, 78, 0, 1)));
        assert_eq!(first.spec.address.pool.as_deref(), Some("blue"));
        create(&store, &blue, None).unwrap();
        assert!(matches!(
            create(&store, &blue, None),
            Err(StoreError::PoolExhausted { pool, .. }) if pool == "blue"
        ));
        // Moving the first one to the default pool frees its blue address.
        let moved = update(&store, &first.id, &spec("b"), 1).unwrap();
        assert_eq!(
            moved.spec.vip,
            Some(Ipv4Addr::new(127, 78, 0, 1)),
            "no pool named: it stays"
        );
        let mut to_default = spec("b");
        to_default.address.pool = Some("default".into());
        let moved = update(&store, &first.id, &to_default, 1).unwrap();
        assert_eq!(moved.spec.vip, Some(ip(1)));
        assert_eq!(moved.spec.address.pool.as_deref(), Some("default"));
        assert_eq!(
            create(&store, &blue, None).unwrap().load_balancer.spec.vip,
            Some(Ipv4Addr::new(127, 78, 0, 1))
        );
    }

    #[test]
    fn sharers_with_one_key_and_disjoint_ports_share_until_the_last_goes() {
        let dir = TempDir::new("store-share");
        let store = open(&dir);
        let web = create(&store, &sharer("web", "k", &[80, 443]), None)
            .unwrap()
            .load_balancer;
        // Without a requested address, the key's VIP is reused where the ports fit.
        let dns = create(&store, &sharer("dns", "k", &[53]), None)
            .unwrap()
            .load_balancer;
        assert_eq!(dns.spec.vip, web.spec.vip);
        let clash = create(&store, &sharer("alt", "k", &[443]), None)
            .unwrap()
            .load_balancer;
        assert_ne!(
            clash.spec.vip, web.spec.vip,
            "an unrequested clash gets its own address"
        );

        let mut requested = sharer("alt2", "k", &[443, 8443]);
        requested.vip = web.spec.vip;
        assert!(matches!(
            create(&store, &requested, None),
            Err(StoreError::PortConflict { port: 443, holder, .. }) if holder == web.id
        ));
        let mut other_key = sharer("x", "other", &[9000]);
        other_key.vip = web.spec.vip;
        assert!(matches!(
            create(&store, &other_key, None),
            Err(StoreError::VipTaken { .. })
        ));
        let mut no_key = spec("y");
        no_key.vip = web.spec.vip;
        assert!(matches!(
            create(&store, &no_key, None),
            Err(StoreError::VipTaken { .. })
        ));
        let mut passthrough = sharer("p", "k", &[9001]);
        passthrough.vip = web.spec.vip;
        passthrough.mode = cloud_mock_sdk::Mode::Passthrough;
        assert!(matches!(
            create(&store, &passthrough, None),
            Err(StoreError::SharingModeMismatch { .. })
        ));
        // An update may not grow into a sharer's port either.
        let mut dns_grows = sharer("dns", "k", &[53, 80]);
        dns_grows.vip = dns.spec.vip;
        assert!(matches!(
            update(&store, &dns.id, &dns_grows, 1),
            Err(StoreError::PortConflict { port: 80, .. })
        ));

        for lb in [&web, &dns] {
            store.mark_deleting(&lb.id, 1).unwrap();
        }
        store.remove(&web.id).unwrap();
        let mut newcomer = spec("z");
        newcomer.vip = web.spec.vip;
        assert!(
            matches!(create(&store, &newcomer, None), Err(StoreError::VipTaken { holder, .. }) if holder == dns.id),
            "the VIP stays with its last sharer"
        );
        store.remove(&dns.id).unwrap();
        assert_eq!(
            create(&store, &newcomer, None)
                .unwrap()
                .load_balancer
                .spec
                .vip,
            web.spec.vip
        );
    }

    #[test]
    fn a_sharer_whose_key_goes_or_changes_moves_and_a_lone_holder_stays() {
        let dir = TempDir::new("store-share-rekey");
        let store = open(&dir);
        let web = create(&store, &sharer("web", "k", &[80]), None)
            .unwrap()
            .load_balancer;
        let dns = create(&store, &sharer("dns", "k", &[53]), None)
            .unwrap()
            .load_balancer;
        assert_eq!(dns.spec.vip, web.spec.vip);

        // The key removed while web still shares: dns gets a fresh address.
        let mut unkeyed = sharer("dns", "k", &[53]);
        unkeyed.address.sharing_key = None;
        let moved = update(&store, &dns.id, &unkeyed, dns.version).unwrap();
        assert_ne!(moved.spec.vip, web.spec.vip);

        // Another key: it moves again only if someone else holds its address under
        // another key; alone on its address, it keeps it.
        let rekeyed = update(&store, &dns.id, &sharer("dns", "j", &[53]), moved.version).unwrap();
        assert_eq!(
            rekeyed.spec.vip, moved.spec.vip,
            "a lone holder keeps its address"
        );

        // web changes its key while alone on its address: it stays there too.
        let web_rekeyed = update(&store, &web.id, &sharer("web", "j", &[80]), web.version).unwrap();
        assert_eq!(web_rekeyed.spec.vip, web.spec.vip);
    }

    #[test]
    fn a_corrupt_sharer_fails_the_create_instead_of_taking_a_fresh_address() {
        let dir = TempDir::new("store-corrupt-sharer");
        let store = open(&dir);
        let web = create(&store, &sharer("web", "k", &[80]), None)
            .unwrap()
            .load_balancer;
        let txn = store.db.begin_write().unwrap();
        txn.open_table(LOAD_BALANCERS)
            .unwrap()
            .insert(web.id.as_str(), b"not json".as_slice())
            .unwrap();
        txn.commit().unwrap();
        assert!(matches!(
            create(&store, &sharer("dns", "k", &[53]), None),
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[test]
    fn a_record_from_before_pools_updates_in_the_default_pool() {
        let dir = TempDir::new("store-no-pool");
        let store = open(&dir);
        let mut lb = create(&store, &spec("a"), None).unwrap().load_balancer;
        lb.spec.address.pool = None;
        let txn = store.db.begin_write().unwrap();
        write_lb(&mut txn.open_table(LOAD_BALANCERS).unwrap(), &lb).unwrap();
        txn.commit().unwrap();
        let mut changed = spec("a");
        changed.backends.pop();
        let updated = update(&store, &lb.id, &changed, 1).unwrap();
        assert_eq!(updated.spec.address.pool.as_deref(), Some(DEFAULT_POOL));
        assert_eq!(updated.spec.vip, lb.spec.vip);
    }

    #[test]
    fn update_checks_version_and_moves_the_vip() {
        let dir = TempDir::new("store-update");
        let store = open(&dir);
        let lb = create(&store, &spec("a"), None).unwrap().load_balancer;
        let mut changed = spec("a");
        changed.backends.pop();
        assert!(matches!(
            update(&store, &lb.id, &changed, 7),
            Err(StoreError::VersionMismatch {
                current: 1,
                expected: 7,
                ..
            })
        ));
        let updated = update(&store, &lb.id, &changed, 1).unwrap();
        assert_eq!(updated.version, 2);
        assert_eq!(updated.spec.vip, lb.spec.vip);
        let unchanged = update(&store, &lb.id, &changed, 2).unwrap();
        assert_eq!(unchanged.version, 2);

        changed.vip = Some(Ipv4Addr::new(127, 77, 0, 6));
        let moved = update(&store, &lb.id, &changed, 2).unwrap();
        assert_eq!(moved.spec.vip, Some(Ipv4Addr::new(127, 77, 0, 6)));
        // The old VIP is free again: the next create gets it.
        let next = create(&store, &spec("b"), None).unwrap().load_balancer;
        assert_eq!(next.spec.vip, lb.spec.vip);
        assert!(matches!(
            update(&store, "lb-missing", &changed, 1),
            Err(StoreError::NotFound { .. })
        ));
    }

    #[test]
    fn delete_lifecycle_frees_vip_and_key() {
        let dir = TempDir::new("store-delete");
        let store = open(&dir);
        let lb = create(&store, &spec("a"), Some("k")).unwrap().load_balancer;
        assert_eq!(
            store.mark_active(std::slice::from_ref(&lb.id), 5).unwrap(),
            1
        );
        let active = store.get(&lb.id).unwrap().unwrap();
        assert_eq!((active.state, active.state_since_ms), (State::Active, 5));
        let deleting = store.mark_deleting(&lb.id, 9).unwrap().unwrap();
        assert!(deleting.changed);
        assert_eq!(deleting.load_balancer.state, State::Deleting);
        // A second delete, even within the same millisecond, changes nothing.
        for now in [9, 50] {
            let again = store.mark_deleting(&lb.id, now).unwrap().unwrap();
            assert!(!again.changed);
            assert_eq!(again.load_balancer.state_since_ms, 9);
        }
        assert_eq!(
            store.mark_active(std::slice::from_ref(&lb.id), 60).unwrap(),
            0
        );
        assert!(matches!(
            update(&store, &lb.id, &spec("a"), 1),
            Err(StoreError::Deleting { .. })
        ));
        store.remove(&lb.id).unwrap();
        assert_eq!(store.get(&lb.id).unwrap(), None);
        assert_eq!(store.mark_deleting(&lb.id, 70).unwrap(), None);
        let fresh = create(&store, &spec("a"), Some("k")).unwrap();
        assert!(fresh.is_new);
        assert_eq!(fresh.load_balancer.spec.vip, lb.spec.vip);
    }

    #[test]
    fn a_client_chosen_id_is_used_once_and_its_key_replays_it() {
        let dir = TempDir::new("store-chosen-id");
        let store = open(&dir);
        let first = create_as(&store, &spec("a"), Some("web-1"), Some("k1")).unwrap();
        assert!(first.is_new);
        assert_eq!(first.load_balancer.id, "web-1");
        // A retry of the same create answers the same LB.
        let replay = create_as(&store, &spec("a"), Some("web-1"), Some("k1")).unwrap();
        assert!(!replay.is_new);
        assert_eq!(replay.load_balancer.id, "web-1");
        // Another create may not take the id, with another key or none.
        for key in [Some("k2"), None] {
            assert!(matches!(
                create_as(&store, &spec("b"), Some("web-1"), key),
                Err(StoreError::IdTaken { id }) if id == "web-1"
            ));
        }
        // Refused whole: the VIP the second create would have had is still free.
        let other = create(&store, &spec("b"), Some("k2")).unwrap();
        assert_eq!(
            other.load_balancer.spec.vip,
            Some(Ipv4Addr::new(127, 77, 0, 2))
        );
    }

    fn dual_pools() -> VipPools {
        "127.77.0.0/29,2001:db8:51:100::/125,blue=127.78.0.0/30,v6=2001:db8:51:200::/126"
            .parse()
            .unwrap()
    }

    fn v6(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    /// `spec` of these families, with backends of those families only.
    fn of_families(mut s: LoadBalancerSpec, families: &[IpFamily]) -> LoadBalancerSpec {
        s.ip_families = families.to_vec();
        s.backends.extend(
            ["2001:db8:18::11", "2001:db8:18::12"]
                .map(|ip| cloud_mock_sdk::families::Backend { ip: v6(ip) }),
        );
        s.backends
            .retain(|backend| families.contains(&IpFamily::of(&backend.ip)));
        s
    }

    fn dual(name: &str) -> LoadBalancerSpec {
        of_families(spec(name), &[IpFamily::Ipv6, IpFamily::Ipv4])
    }

    fn only6(name: &str) -> LoadBalancerSpec {
        of_families(spec(name), &[IpFamily::Ipv6])
    }

    fn allocated(store: &Store) -> Vec<(String, IpFamily, u64)> {
        store
            .pool_use()
            .unwrap()
            .into_iter()
            .map(|p| (p.name, p.family, p.allocated))
            .collect()
    }

    #[test]
    fn each_family_gets_its_vip_in_order_and_frees_it() {
        let dir = TempDir::new("store-dual");
        let store = Store::open(dir.path(), dual_pools()).unwrap();
        let lb = create(&store, &dual("a"), None).unwrap().load_balancer;
        assert_eq!(
            lb.spec.address.vips,
            vec![v6("2001:db8:51:100::1"), IpAddr::V4(ip(1))]
        );
        assert_eq!(lb.spec.vip, Some(ip(1)), "vip stays the IPv4 one");
        let b = create(&store, &only6("b"), None).unwrap().load_balancer;
        assert_eq!(b.vips(), vec![v6("2001:db8:51:100::2")]);
        assert_eq!(b.spec.vip, None);
        assert_eq!(
            allocated(&store),
            vec![
                ("blue".to_owned(), IpFamily::Ipv4, 0),
                ("default".to_owned(), IpFamily::Ipv4, 1),
                ("default".to_owned(), IpFamily::Ipv6, 2),
                ("v6".to_owned(), IpFamily::Ipv6, 0),
            ]
        );
        for id in [&lb.id, &b.id] {
            store.mark_deleting(id, 1).unwrap();
            store.remove(id).unwrap();
        }
        assert!(allocated(&store).iter().all(|(_, _, n)| *n == 0));
    }

    #[test]
    fn one_exhausted_family_refuses_the_whole_load_balancer() {
        let dir = TempDir::new("store-dual-exhausted");
        let store = Store::open(dir.path(), dual_pools()).unwrap();
        let mut in_v6 = only6("x");
        in_v6.address.pool = Some("v6".into());
        for _ in 0..3 {
            create(&store, &in_v6, None).unwrap();
        }
        assert!(matches!(
            create(&store, &in_v6, None),
            Err(StoreError::PoolExhausted { pool, .. }) if pool == "v6"
        ));
        // The default pool's IPv6 CIDR is full: a dual-stack create takes no IPv4 either.
        let filler = only6("f");
        for _ in 0..7 {
            create(&store, &filler, None).unwrap();
        }
        let before = store.list().unwrap().len();
        assert!(matches!(
            create(&store, &dual("z"), None),
            Err(StoreError::PoolExhausted {
                cidr: IpNet::V6(_),
                ..
            })
        ));
        assert_eq!(store.list().unwrap().len(), before, "nothing half made");
        assert!(
            allocated(&store).contains(&("default".to_owned(), IpFamily::Ipv4, 0)),
            "no IPv4 address was taken"
        );
    }

    #[test]
    fn sharing_keys_share_per_family() {
        let dir = TempDir::new("store-dual-share");
        let store = Store::open(dir.path(), dual_pools()).unwrap();
        let web = of_families(sharer("web", "k", &[80]), &[IpFamily::Ipv4, IpFamily::Ipv6]);
        let web = create(&store, &web, None).unwrap().load_balancer;
        let dns = of_families(sharer("dns", "k", &[53]), &[IpFamily::Ipv6, IpFamily::Ipv4]);
        let dns = create(&store, &dns, None).unwrap().load_balancer;
        assert_eq!(
            dns.vips(),
            vec![web.vips()[1], web.vips()[0]],
            "both addresses shared, in the sharer's own order"
        );
        // An IPv4-only sharer shares the IPv4 address.
        let v4_only = create(&store, &sharer("ntp", "k", &[123]), None)
            .unwrap()
            .load_balancer;
        assert_eq!(v4_only.vips(), vec![web.vips()[0]]);
        // A port clash in one family: its own addresses, in both.
        let clash = of_families(sharer("alt", "k", &[80]), &[IpFamily::Ipv6]);
        let clash = create(&store, &clash, None).unwrap().load_balancer;
        assert_ne!(clash.vips()[0], web.vips()[1]);
        // Requesting the shared IPv6 address without the key is refused.
        let mut taker = only6("t");
        taker.address.vips = vec![web.vips()[1]];
        assert!(matches!(
            create(&store, &taker, None),
            Err(StoreError::VipTaken { vip, .. }) if vip == web.vips()[1]
        ));
        for lb in [&web, &dns, &v4_only] {
            store.mark_deleting(&lb.id, 1).unwrap();
            store.remove(&lb.id).unwrap();
        }
        assert_eq!(
            create(&store, &taker, None).unwrap().load_balancer.vips(),
            vec![v6("2001:db8:51:100::1")],
            "freed with the last sharer"
        );
    }

    #[test]
    fn updates_add_drop_and_reorder_families_keeping_addresses() {
        let dir = TempDir::new("store-dual-update");
        let store = Store::open(dir.path(), dual_pools()).unwrap();
        let lb = create(&store, &spec("a"), None).unwrap().load_balancer;
        assert_eq!(lb.vips(), vec![IpAddr::V4(ip(1))]);
        let mut both = of_families(spec("a"), &[IpFamily::Ipv4, IpFamily::Ipv6]);
        let grown = update(&store, &lb.id, &both, 1).unwrap();
        assert_eq!(
            grown.vips(),
            vec![IpAddr::V4(ip(1)), v6("2001:db8:51:100::1")],
            "the IPv4 address stays"
        );
        both.ip_families.reverse();
        let reordered = update(&store, &lb.id, &both, 2).unwrap();
        assert_eq!(
            reordered.vips(),
            vec![v6("2001:db8:51:100::1"), IpAddr::V4(ip(1))]
        );
        let shrunk = update(&store, &lb.id, &only6("a"), 3).unwrap();
        assert_eq!(shrunk.vips(), vec![v6("2001:db8:51:100::1")]);
        assert_eq!(shrunk.spec.vip, None);
        assert_eq!(
            create(&store, &spec("b"), None)
                .unwrap()
                .load_balancer
                .vips(),
            vec![IpAddr::V4(ip(1))],
            "the dropped family's address is free again"
        );

        // In a pool without IPv6, an update that adds IPv6 is refused and changes nothing.
        let mut blue = spec("c");
        blue.address.pool = Some("blue".into());
        let c = create(&store, &blue, None).unwrap().load_balancer;
        let grow = of_families(spec("c"), &[IpFamily::Ipv4, IpFamily::Ipv6]);
        assert!(matches!(
            update(&store, &c.id, &grow, 1),
            Err(StoreError::PoolLacksFamily { pool, family: IpFamily::Ipv6 }) if pool == "blue"
        ));
        assert_eq!(store.get(&c.id).unwrap(), Some(c));
    }

    #[test]
    fn a_database_of_the_ipv4_only_version_opens_and_serves() {
        let dir = TempDir::new("store-upgrade");
        // What the previous version wrote: its three tables, an IPv4 LB and its holder.
        {
            let db = Database::create(dir.path().join("cloud-mock.redb")).unwrap();
            let txn = db.begin_write().unwrap();
            let record = r#"{"id": "lb-0000000a", "spec": {"name": "old", "tags": {}, "mode": "proxy",
              "vip": "127.77.0.3", "listeners": [{"protocol": "TCP", "port": 80, "backendPort": 30080}],
              "backends": [{"ip": "198.18.0.11"}], "sourceRanges": ["203.0.113.0/24"],
              "pool": "default", "vips": ["127.77.0.3"]},
              "state": "active", "version": 2, "stateSinceMs": 5}"#;
            txn.open_table(LOAD_BALANCERS)
                .unwrap()
                .insert("lb-0000000a", record.as_bytes())
                .unwrap();
            txn.open_table(VIP_HOLDERS)
                .unwrap()
                .insert(u32::from(ip(3)), br#"{"ids": ["lb-0000000a"]}"#.as_slice())
                .unwrap();
            txn.open_table(IDEMPOTENCY_KEYS).unwrap();
            txn.commit().unwrap();
        }
        let store = Store::open(dir.path(), dual_pools()).unwrap();
        let old = store.get("lb-0000000a").unwrap().unwrap();
        assert_eq!(old.spec.ip_families, vec![IpFamily::Ipv4]);
        assert_eq!(old.vips(), vec![IpAddr::V4(ip(3))]);
        // Its address stays taken, and it can grow an IPv6 VIP.
        assert_ne!(
            create(&store, &spec("new"), None)
                .unwrap()
                .load_balancer
                .vips(),
            vec![IpAddr::V4(ip(3))]
        );
        let grown = of_families(old.spec.clone(), &[IpFamily::Ipv4, IpFamily::Ipv6]);
        let grown = update(&store, &old.id, &grown, 2).unwrap();
        assert_eq!(
            grown.vips(),
            vec![IpAddr::V4(ip(3)), v6("2001:db8:51:100::1")]
        );
    }

    fn members(ips: &[&str]) -> NodePoolSpec {
        NodePoolSpec {
            tags: std::collections::BTreeMap::from([("cluster".into(), "c1".into())]),
            backends: ips
                .iter()
                .map(|ip| cloud_mock_sdk::families::Backend {
                    ip: ip.parse().unwrap(),
                })
                .collect(),
        }
    }

    fn on_pool(name: &str, node_pool: &str) -> LoadBalancerSpec {
        let mut s = spec(name);
        s.backends.clear();
        s.node_pool = Some(node_pool.into());
        s
    }

    #[test]
    fn node_pools_are_created_replaced_left_alone_and_kept_across_reopen() {
        let dir = TempDir::new("store-node-pools");
        let store = open(&dir);
        let created = store
            .put_node_pool("c1", &members(&["10.0.0.2", "10.0.0.1"]), None)
            .unwrap();
        assert_eq!(created.written, Written::Created);
        assert_eq!(created.node_pool.version, 1);
        assert_eq!(
            created.node_pool.spec,
            members(&["10.0.0.1", "10.0.0.2"]),
            "kept in address order"
        );
        // The same set in another order, with a stale or no If-Match: nothing changes.
        for if_match in [None, Some(1), Some(7)] {
            let same = store
                .put_node_pool("c1", &members(&["10.0.0.1", "10.0.0.2"]), if_match)
                .unwrap();
            assert_eq!(same.written, Written::Unchanged, "{if_match:?}");
            assert_eq!(same.node_pool, created.node_pool);
        }
        let replaced = store
            .put_node_pool("c1", &members(&["10.0.0.1", "10.0.0.3"]), Some(1))
            .unwrap();
        assert_eq!(replaced.written, Written::Replaced);
        assert_eq!(replaced.node_pool.version, 2);
        assert!(matches!(
            store.put_node_pool("c1", &members(&["10.0.0.4"]), Some(1)),
            Err(StoreError::NodePoolVersionMismatch {
                current: Some(2),
                expected: 1,
                ..
            })
        ));
        assert!(matches!(
            store.put_node_pool("c2", &members(&[]), Some(1)),
            Err(StoreError::NodePoolVersionMismatch { current: None, .. })
        ));
        assert_eq!(
            store.node_pool("c2").unwrap(),
            None,
            "a refused write makes nothing"
        );
        drop(store);

        let store = open(&dir);
        let (kept, users) = store.get_node_pool("c1").unwrap().unwrap();
        assert_eq!(kept, replaced.node_pool);
        assert!(users.is_empty());
        assert!(store.delete_node_pool("c1").unwrap());
        assert!(
            !store.delete_node_pool("c1").unwrap(),
            "absent the second time"
        );
        assert_eq!(store.get_node_pool("c1").unwrap(), None);
    }

    #[test]
    fn a_store_from_before_the_reference_index_gets_it_at_open() {
        let dir = TempDir::new("store-node-pool-index");
        let store = open(&dir);
        store
            .put_node_pool("c1", &members(&["10.0.0.1"]), None)
            .unwrap();
        let a = create(&store, &on_pool("a", "c1"), None)
            .unwrap()
            .load_balancer;
        create(&store, &spec("b"), None).unwrap();
        let txn = store.db.begin_write().unwrap();
        assert!(txn.delete_table(NODE_POOL_REFERENCES).unwrap());
        txn.commit().unwrap();
        drop(store);

        let store = open(&dir);
        let (_, users) = store.get_node_pool("c1").unwrap().unwrap();
        assert_eq!(users, vec![a.id], "indexed from the specs");
    }

    #[test]
    fn a_node_pool_is_held_by_its_load_balancers_until_they_are_removed() {
        let dir = TempDir::new("store-node-pool-use");
        let store = open(&dir);
        assert!(matches!(
            create(&store, &on_pool("a", "c1"), None),
            Err(StoreError::UnknownNodePool { name }) if name == "c1"
        ));
        assert!(
            store.list().unwrap().is_empty(),
            "the refused create made nothing"
        );
        store
            .put_node_pool("c1", &members(&["10.0.0.1"]), None)
            .unwrap();
        store.put_node_pool("other", &members(&[]), None).unwrap();
        let a = create(&store, &on_pool("a", "c1"), None)
            .unwrap()
            .load_balancer;
        let b = create(&store, &spec("b"), None).unwrap().load_balancer;
        // An update may move an LB onto a pool that exists, not onto one that does not.
        assert!(matches!(
            update(&store, &b.id, &on_pool("b", "nope"), 1),
            Err(StoreError::UnknownNodePool { .. })
        ));
        update(&store, &b.id, &on_pool("b", "c1"), 1).unwrap();
        let listed = store.list_node_pools().unwrap();
        let users: Vec<(&str, usize)> = listed
            .iter()
            .map(|(pool, ids)| (pool.name.as_str(), ids.len()))
            .collect();
        assert_eq!(users, vec![("c1", 2), ("other", 0)]);
        let snapshot = store.snapshot().unwrap();
        let resolved = snapshot
            .load_balancers
            .iter()
            .filter_map(|lb| snapshot.node_pool_of(lb))
            .count();
        assert_eq!(resolved, 2);

        let in_use = |store: &Store| match store.delete_node_pool("c1") {
            Err(StoreError::NodePoolInUse { load_balancers, .. }) => load_balancers,
            other => panic!("expected node-pool-in-use, got {other:?}"),
        };
        let mut both = vec![a.id.clone(), b.id.clone()];
        both.sort();
        assert_eq!(in_use(&store), both);
        update(&store, &b.id, &spec("b"), 2).unwrap();
        // Being deleted still holds it: the data plane may still serve the LB.
        store.mark_deleting(&a.id, 0).unwrap();
        assert_eq!(in_use(&store), vec![a.id.clone()]);
        store.remove(&a.id).unwrap();
        assert!(store.delete_node_pool("c1").unwrap());
    }
}
