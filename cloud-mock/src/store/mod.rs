//! The persistent store: load balancers, VIP allocations, idempotency keys and node pools.
//!
//! Two backends keep them: an embedded redb file for a single edge ([`redb`]), or etcd for
//! a cluster of edges ([`etcd`]). Either way the whole store is held in memory
//! ([`state::State`]), every read is served from there, and every write is one
//! transaction, decided in memory against that state ([`txn::Txn`], with the address
//! logic in [`address`]) and then committed by the backend: only a committed change is
//! applied and acknowledged.

mod address;
mod embedded;
pub mod etcd;
mod state;
#[cfg(test)]
mod tests;
mod txn;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard};

use cloud_mock_sdk::families::LoadBalancerSpec;
use cloud_mock_sdk::{IpFamily, Mode, NodePoolSpec, Pool, Protocol, State as LbState};
use ipnet::IpNet;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use address::first_free_vip;
pub use etcd::EtcdSettings;

use self::embedded::RedbBackend;
use self::etcd::EtcdBackend;
use self::state::{Change, State};
use self::txn::Txn;
use crate::model::{StoredLoadBalancer, StoredNodePool};
use crate::pools::{VipPools, pool_size};
use crate::tenants::{Refusal, Tenant};
use crate::validate::Placement;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("opening the database {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: Box<::redb::Error>,
    },
    #[error("database: {0}")]
    Database(#[source] Box<::redb::Error>),
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
    #[error("{what} needs the etcd store (--store etcd)")]
    NeedsEtcd { what: &'static str },
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
    /// etcd could not be reached or did not answer in time: nothing is acknowledged, and
    /// the write may be retried (a create with its Idempotency-Key).
    #[error("the store (etcd) is unavailable: {message}")]
    Unavailable { message: String },
    /// Other edges kept winning the race for the store: retry.
    #[error("the store was changed by other edges {attempts} times during this write; retry")]
    Contended { attempts: u32 },
    #[error(
        "the store holds a record that cannot be decoded ({key}: {message}); writes are refused until it is repaired"
    )]
    Poisoned { key: String, message: String },
    #[error("etcd: {0}")]
    Etcd(String),
    /// What the caller's tenant may not do (a quota reached).
    #[error(transparent)]
    Refused(#[from] Refusal),
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
    pub load_balancers: Vec<Arc<StoredLoadBalancer>>,
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

/// Where the store keeps its records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSettings {
    /// The embedded database in the data directory: one edge.
    Redb,
    /// An etcd cluster, shared by every edge of an edge cluster.
    Etcd(EtcdSettings),
}

/// The state every call reads, with the revision of the backend it reflects.
pub(crate) struct Cached {
    pub state: State,
    /// etcd: the revision applied and the one of the last write (the guard every write
    /// compares). Zero for redb.
    pub applied_revision: i64,
    pub guard_revision: i64,
    /// etcd: keys whose value cannot be decoded, with why; writes wait for their repair.
    pub poisoned: BTreeMap<String, String>,
}

impl Cached {
    pub fn empty(state: State) -> Self {
        Self {
            state,
            applied_revision: 0,
            guard_revision: 0,
            poisoned: BTreeMap::new(),
        }
    }
}

/// What the backends and the tasks that feed them share: the cached state and the counter
/// that moves with each change applied to it.
pub(crate) struct Shared {
    cached: RwLock<Cached>,
    changed: watch::Sender<u64>,
}

impl Shared {
    fn new(state: State) -> Self {
        Self {
            cached: RwLock::new(Cached::empty(state)),
            changed: watch::channel(0).0,
        }
    }

    pub fn read(&self) -> RwLockReadGuard<'_, Cached> {
        self.cached.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies a committed change (`f` on the cache), then tells the subscribers.
    pub fn update(&self, f: impl FnOnce(&mut Cached) -> bool) {
        let changed = {
            let mut cached = self.cached.write().unwrap_or_else(PoisonError::into_inner);
            f(&mut cached)
        };
        if changed {
            self.changed
                .send_modify(|moves| *moves = moves.wrapping_add(1));
        }
    }
}

enum Backend {
    /// The database, and the lock that makes its writers take turns (decide, commit,
    /// apply), as redb lets one write transaction run at a time.
    Redb(Mutex<RedbBackend>),
    Etcd(Box<EtcdBackend>),
}

struct Inner {
    pools: VipPools,
    shared: Arc<Shared>,
    backend: Backend,
    /// Whether this edge runs the work that must happen once (the lifecycle's transitions).
    leader: watch::Receiver<bool>,
}

/// Handle on the store; clones share it.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

impl Store {
    /// Opens the store `settings` names: the redb file in `data_dir`, or etcd. An etcd
    /// store keeps watching (and campaigning for leadership) until `cancel`.
    pub async fn open(
        settings: &StoreSettings,
        data_dir: &Path,
        pools: VipPools,
        cancel: CancellationToken,
    ) -> Result<Self, StoreError> {
        match settings {
            StoreSettings::Redb => {
                let data_dir = data_dir.to_owned();
                tokio::task::spawn_blocking(move || Self::open_redb(&data_dir, pools))
                    .await
                    .map_err(|err| StoreError::Task(err.to_string()))?
            }
            StoreSettings::Etcd(etcd) => Self::open_etcd(etcd, pools, cancel).await,
        }
    }

    /// Opens (or creates) the redb store in `data_dir`, handing out VIPs from `pools`.
    pub fn open_redb(data_dir: &Path, pools: VipPools) -> Result<Self, StoreError> {
        let (db, records) = RedbBackend::open(data_dir)?;
        let state = State::loaded(pools.iter().map(|(_, cidr)| cidr), records);
        let (_, leader) = watch::channel(true);
        Ok(Self {
            inner: Arc::new(Inner {
                pools,
                shared: Arc::new(Shared::new(state)),
                backend: Backend::Redb(Mutex::new(db)),
                leader,
            }),
        })
    }

    /// Connects to etcd, lists the store and watches it from there on.
    pub async fn open_etcd(
        settings: &EtcdSettings,
        pools: VipPools,
        cancel: CancellationToken,
    ) -> Result<Self, StoreError> {
        let cidrs: Vec<IpNet> = pools.iter().map(|(_, cidr)| cidr).collect();
        let shared = Arc::new(Shared::new(State::new(cidrs.clone())));
        let (backend, leader) = EtcdBackend::open(settings, cidrs, shared.clone(), cancel).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                pools,
                shared,
                backend: Backend::Etcd(Box::new(backend)),
                leader,
            }),
        })
    }

    pub fn pools(&self) -> &VipPools {
        &self.inner.pools
    }

    /// Moves with every change applied: this edge's writes, and on etcd every other's.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.shared.changed.subscribe()
    }

    /// True while this edge should run the work that must happen once: always with redb,
    /// with etcd while it holds the election's lease.
    pub fn leadership(&self) -> watch::Receiver<bool> {
        self.inner.leader.clone()
    }

    fn state(&self) -> RwLockReadGuard<'_, Cached> {
        self.inner.shared.read()
    }

    /// Every pool (one entry per name and family) with the number of its addresses in use.
    pub fn pool_use(&self) -> Vec<Pool> {
        let cached = self.state();
        self.inner
            .pools
            .iter()
            .map(|(name, cidr)| Pool {
                name: name.to_owned(),
                family: IpFamily::of_net(&cidr),
                cidr,
                size: pool_size(cidr),
                allocated: cached.state.held_in(cidr).count() as u64,
            })
            .collect()
    }

    /// The load balancer `id`, shared with the store: held reads take it again on every
    /// change of the store.
    pub fn get(&self, id: &str) -> Option<Arc<StoredLoadBalancer>> {
        self.state().state.shared_load_balancer(id).cloned()
    }

    /// Every load balancer, ordered by id.
    pub fn list(&self) -> Vec<StoredLoadBalancer> {
        self.state().state.load_balancers().cloned().collect()
    }

    /// Every load balancer and node pool, as of one moment.
    pub fn snapshot(&self) -> Snapshot {
        let cached = self.state();
        Snapshot {
            load_balancers: cached.state.shared_load_balancers().cloned().collect(),
            node_pools: cached.state.node_pools().clone(),
        }
    }

    /// The node pool `name` with the load balancers referencing it; `None` when absent.
    pub fn get_node_pool(&self, name: &str) -> Option<(StoredNodePool, Vec<String>)> {
        let cached = self.state();
        let pool = cached.state.node_pool(name)?.clone();
        let ids = cached.state.referencing(name).map(str::to_owned).collect();
        Some((pool, ids))
    }

    /// The node pool `name` alone (what an LB naming it resolves against).
    pub fn node_pool(&self, name: &str) -> Option<StoredNodePool> {
        self.state().state.node_pool(name).cloned()
    }

    /// Every node pool, by name, with the load balancers referencing it.
    pub fn list_node_pools(&self) -> Vec<(StoredNodePool, Vec<String>)> {
        let cached = self.state();
        cached
            .state
            .node_pools()
            .values()
            .map(|pool| {
                let ids = cached
                    .state
                    .referencing(&pool.name)
                    .map(str::to_owned)
                    .collect();
                (pool.clone(), ids)
            })
            .collect()
    }

    /// Runs `decide` as one transaction and commits what it wrote; nothing when it fails.
    /// The etcd backend may run it again when another edge wrote first.
    async fn write<T: Send + 'static>(
        &self,
        decide: impl Fn(&mut Txn<'_>) -> Result<T, StoreError> + Send + Sync + 'static,
    ) -> Result<T, StoreError> {
        match &self.inner.backend {
            Backend::Redb(_) => {
                let store = self.clone();
                tokio::task::spawn_blocking(move || store.write_redb(&decide))
                    .await
                    .map_err(|err| StoreError::Task(err.to_string()))?
            }
            Backend::Etcd(etcd) => {
                etcd.write(&self.inner.shared, &self.inner.pools, &decide)
                    .await
            }
        }
    }

    /// The redb write: decide, commit durably, then apply, one writer at a time.
    fn write_redb<T>(
        &self,
        decide: &impl Fn(&mut Txn<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let Backend::Redb(db) = &self.inner.backend else {
            return Err(StoreError::Task("not a redb store".into()));
        };
        let db = db.lock().unwrap_or_else(PoisonError::into_inner);
        let (result, change) = {
            let cached = self.state();
            let mut txn = Txn::new(&cached.state, &self.inner.pools);
            let result = decide(&mut txn)?;
            (result, txn.into_change())
        };
        if !change.is_empty() {
            db.commit(&change)?;
            self.inner.shared.update(|cached| {
                cached.state.apply(change);
                true
            });
        }
        Ok(result)
    }

    /// Creates a load balancer from a validated `spec` placed by `placement`, for
    /// `tenant` if one (see [`Txn::create`]).
    pub async fn create(
        &self,
        spec: LoadBalancerSpec,
        placement: Placement,
        requested_id: Option<String>,
        idempotency_key: Option<String>,
        tenant: Option<Arc<Tenant>>,
        now_ms: u64,
    ) -> Result<Created, StoreError> {
        self.write(move |txn| {
            txn.create(
                &spec,
                &placement,
                requested_id.as_deref(),
                idempotency_key.as_deref(),
                tenant.as_deref(),
                now_ms,
            )
        })
        .await
    }

    /// Replaces the spec of `id` if it is at `expected_version`, for `tenant` if one
    /// (see [`Txn::update`]).
    pub async fn update(
        &self,
        id: String,
        spec: LoadBalancerSpec,
        placement: Placement,
        expected_version: u64,
        tenant: Option<Arc<Tenant>>,
    ) -> Result<StoredLoadBalancer, StoreError> {
        self.write(move |txn| {
            txn.update(&id, &spec, &placement, expected_version, tenant.as_deref())
        })
        .await
    }

    /// Starts deleting `id`; `None` when there is no such load balancer. Deleting one that
    /// is already being deleted changes nothing.
    pub async fn mark_deleting(
        &self,
        id: String,
        now_ms: u64,
    ) -> Result<Option<Transition>, StoreError> {
        self.write(move |txn| {
            Ok(txn.transition(
                &id,
                &[LbState::Provisioning, LbState::Active],
                LbState::Deleting,
                now_ms,
            ))
        })
        .await
    }

    /// Moves each of `ids` that is still provisioning to active, in as few transactions as
    /// the backend allows (one fsync however many are due on redb); the number moved.
    pub async fn mark_active(&self, ids: Vec<String>, now_ms: u64) -> Result<usize, StoreError> {
        let mut moved = 0;
        for chunk in ids.chunks(self.max_records_per_write()) {
            let chunk = chunk.to_vec();
            moved += self
                .write(move |txn| {
                    let changed = chunk
                        .iter()
                        .filter_map(|id| {
                            txn.transition(id, &[LbState::Provisioning], LbState::Active, now_ms)
                        })
                        .filter(|transition| transition.changed)
                        .count();
                    Ok(changed)
                })
                .await?;
        }
        Ok(moved)
    }

    /// Removes a load balancer that finished deleting, freeing its idempotency key and its
    /// VIP (a shared VIP with the last of its sharers).
    pub async fn remove(&self, id: String) -> Result<(), StoreError> {
        self.write(move |txn| {
            txn.remove(&id);
            Ok(())
        })
        .await
    }

    /// Creates or replaces the node pool `name` (see [`Txn::put_node_pool`]).
    pub async fn put_node_pool(
        &self,
        name: String,
        spec: NodePoolSpec,
        if_match: Option<u64>,
    ) -> Result<NodePoolWrite, StoreError> {
        self.write(move |txn| txn.put_node_pool(&name, &spec, if_match))
            .await
    }

    /// Deletes the node pool `name` (see [`Txn::delete_node_pool`]).
    pub async fn delete_node_pool(&self, name: String) -> Result<bool, StoreError> {
        self.write(move |txn| txn.delete_node_pool(&name)).await
    }

    fn max_records_per_write(&self) -> usize {
        match &self.inner.backend {
            Backend::Redb(_) => usize::MAX,
            Backend::Etcd(_) => etcd::MAX_RECORDS_PER_TXN,
        }
    }

    /// Every record, to copy into another store.
    fn records(&self) -> Change {
        self.state().state.records()
    }
}
