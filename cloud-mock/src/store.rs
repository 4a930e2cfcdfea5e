//! The persistent store: load balancers, VIP allocations and idempotency keys in one redb
//! file. Every write is one transaction, committed durably (fsync) before it returns, so
//! an acknowledged change survives a crash.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cloud_mock_sdk::{LoadBalancerSpec, State};
use ipnet::Ipv4Net;
use redb::{Database, ReadableDatabase, ReadableTable, Table, TableDefinition};

use crate::model::StoredLoadBalancer;
use crate::validate::vip_in_pool;

/// id → JSON of [`StoredLoadBalancer`].
const LOAD_BALANCERS: TableDefinition<&str, &[u8]> = TableDefinition::new("load_balancers");
/// VIP (as u32) → id of the load balancer holding it.
const VIPS: TableDefinition<u32, &str> = TableDefinition::new("vips");
/// Idempotency-Key of a create → id of the load balancer it made.
const IDEMPOTENCY_KEYS: TableDefinition<&str, &str> = TableDefinition::new("idempotency_keys");

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
    #[error("stored load balancer {id} cannot be decoded: {source}")]
    Corrupt {
        id: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("encoding load balancer: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("load balancer {id} not found")]
    NotFound { id: String },
    #[error("VIP {vip} is already allocated to load balancer {holder}")]
    VipTaken { vip: Ipv4Addr, holder: String },
    #[error("the VIP pool {pool} has no free address left")]
    PoolExhausted { pool: Ipv4Net },
    #[error("load balancer {id} is at version {current}, not {expected}")]
    VersionMismatch {
        id: String,
        current: u64,
        expected: u64,
    },
    #[error("load balancer {id} is being deleted")]
    Deleting { id: String },
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

/// Handle on the database; clones share it.
#[derive(Clone)]
pub struct Store {
    db: Arc<Database>,
    pool: Ipv4Net,
}

impl Store {
    /// Opens (or creates) `data_dir/cloud-mock.redb`, handing out VIPs from `pool`.
    pub fn open(data_dir: &Path, pool: Ipv4Net) -> Result<Self, StoreError> {
        let path = data_dir.join("cloud-mock.redb");
        let open = || -> Result<Database, redb::Error> {
            std::fs::create_dir_all(data_dir)?;
            let db = Database::create(&path)?;
            // Create the tables so that readers never meet a missing one.
            let txn = db.begin_write()?;
            txn.open_table(LOAD_BALANCERS)?;
            txn.open_table(VIPS)?;
            txn.open_table(IDEMPOTENCY_KEYS)?;
            txn.commit()?;
            Ok(db)
        };
        let db = open().map_err(|source| StoreError::Open {
            path: path.clone(),
            source: Box::new(source),
        })?;
        Ok(Self {
            db: Arc::new(db),
            pool,
        })
    }

    pub fn pool(&self) -> Ipv4Net {
        self.pool
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
        let mut all = Vec::new();
        for entry in table.iter().map_err(db_error)? {
            let (key, value) = entry.map_err(db_error)?;
            all.push(decode(key.value(), value.value())?);
        }
        Ok(all)
    }

    /// Creates a load balancer from a validated `spec`, allocating its VIP (the requested
    /// one, or the lowest free one). With an `idempotency_key` already used, returns the
    /// load balancer that key created instead.
    pub fn create(
        &self,
        spec: &LoadBalancerSpec,
        idempotency_key: Option<&str>,
        now_ms: u64,
    ) -> Result<Created, StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        let created = {
            let mut lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
            let mut vips = txn.open_table(VIPS).map_err(db_error)?;
            let mut keys = txn.open_table(IDEMPOTENCY_KEYS).map_err(db_error)?;
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
            let vip = match spec.vip {
                Some(requested) => {
                    if let Some(holder) = vip_holder(&vips, requested)? {
                        return Err(StoreError::VipTaken {
                            vip: requested,
                            holder,
                        });
                    }
                    requested
                }
                None => first_free_vip(self.pool, |candidate| {
                    vips.get(u32::from(candidate))
                        .map(|holder| holder.is_some())
                        .map_err(db_error)
                })?
                .ok_or(StoreError::PoolExhausted { pool: self.pool })?,
            };
            let id = loop {
                let candidate = new_id();
                if lbs.get(candidate.as_str()).map_err(db_error)?.is_none() {
                    break candidate;
                }
            };
            let mut spec = spec.clone();
            spec.vip = Some(vip);
            let lb = StoredLoadBalancer {
                id: id.clone(),
                spec,
                state: State::Provisioning,
                version: 1,
                state_since_ms: now_ms,
                idempotency_key: idempotency_key.map(str::to_owned),
            };
            write_lb(&mut lbs, &lb)?;
            vips.insert(u32::from(vip), id.as_str()).map_err(db_error)?;
            if let Some(key) = idempotency_key {
                keys.insert(key, id.as_str()).map_err(db_error)?;
            }
            lb
        };
        txn.commit().map_err(db_error)?;
        Ok(Created {
            load_balancer: created,
            is_new: true,
        })
    }

    /// Replaces the spec of `id` if it is at `expected_version`. A spec without a VIP keeps
    /// the allocated one; another VIP moves the allocation. An unchanged spec changes
    /// nothing (not even the version).
    pub fn update(
        &self,
        id: &str,
        spec: &LoadBalancerSpec,
        expected_version: u64,
    ) -> Result<StoredLoadBalancer, StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        let updated = {
            let mut lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
            let mut vips = txn.open_table(VIPS).map_err(db_error)?;
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
            let current_vip = lb.vip();
            let mut desired = spec.clone();
            desired.vip = spec.vip.or(current_vip);
            if desired == lb.spec {
                return Ok(lb);
            }
            if let Some(new_vip) = desired.vip
                && desired.vip != current_vip
            {
                if let Some(holder) = vip_holder(&vips, new_vip)? {
                    return Err(StoreError::VipTaken {
                        vip: new_vip,
                        holder,
                    });
                }
                if let Some(old) = current_vip {
                    vips.remove(u32::from(old)).map_err(db_error)?;
                }
                vips.insert(u32::from(new_vip), id).map_err(db_error)?;
            }
            lb.spec = desired;
            lb.version += 1;
            write_lb(&mut lbs, &lb)?;
            lb
        };
        txn.commit().map_err(db_error)?;
        Ok(updated)
    }

    /// Starts deleting `id`; `None` when there is no such load balancer. Deleting one that
    /// is already being deleted changes nothing.
    pub fn mark_deleting(
        &self,
        id: &str,
        now_ms: u64,
    ) -> Result<Option<StoredLoadBalancer>, StoreError> {
        self.transition(
            id,
            &[State::Provisioning, State::Active],
            State::Deleting,
            now_ms,
        )
    }

    /// Moves `id` from provisioning to active; `None` when it is gone or in another state.
    pub fn mark_active(
        &self,
        id: &str,
        now_ms: u64,
    ) -> Result<Option<StoredLoadBalancer>, StoreError> {
        self.transition(id, &[State::Provisioning], State::Active, now_ms)
    }

    fn transition(
        &self,
        id: &str,
        from: &[State],
        to: State,
        now_ms: u64,
    ) -> Result<Option<StoredLoadBalancer>, StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        let result = {
            let mut lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
            let Some(mut lb) = read_lb(&lbs, id)? else {
                return Ok(None);
            };
            if !from.contains(&lb.state) {
                return Ok((lb.state == to).then_some(lb));
            }
            lb.state = to;
            lb.state_since_ms = now_ms;
            write_lb(&mut lbs, &lb)?;
            lb
        };
        txn.commit().map_err(db_error)?;
        Ok(Some(result))
    }

    /// Removes a load balancer that finished deleting, freeing its VIP and idempotency key.
    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        {
            let mut lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
            let mut vips = txn.open_table(VIPS).map_err(db_error)?;
            let mut keys = txn.open_table(IDEMPOTENCY_KEYS).map_err(db_error)?;
            let Some(lb) = read_lb(&lbs, id)? else {
                return Ok(());
            };
            lbs.remove(id).map_err(db_error)?;
            if let Some(vip) = lb.vip()
                && vip_holder(&vips, vip)?.as_deref() == Some(id)
            {
                vips.remove(u32::from(vip)).map_err(db_error)?;
            }
            if let Some(key) = &lb.idempotency_key {
                keys.remove(key.as_str()).map_err(db_error)?;
            }
        }
        txn.commit().map_err(db_error)?;
        Ok(())
    }
}

/// The lowest address of `pool` that may be a VIP and is not taken.
pub fn first_free_vip<E>(
    pool: Ipv4Net,
    mut is_taken: impl FnMut(Ipv4Addr) -> Result<bool, E>,
) -> Result<Option<Ipv4Addr>, E> {
    for candidate in pool.hosts() {
        if vip_in_pool(candidate, pool) && !is_taken(candidate)? {
            return Ok(Some(candidate));
        }
    }
    Ok(None)
}

fn new_id() -> String {
    format!("lb-{:08x}", rand::random::<u32>())
}

fn vip_holder(
    vips: &Table<'_, u32, &'static str>,
    vip: Ipv4Addr,
) -> Result<Option<String>, StoreError> {
    Ok(vips
        .get(u32::from(vip))
        .map_err(db_error)?
        .map(|holder| holder.value().to_owned()))
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
    let bytes = serde_json::to_vec(lb).map_err(StoreError::Encode)?;
    table
        .insert(lb.id.as_str(), bytes.as_slice())
        .map_err(db_error)?;
    Ok(())
}

fn decode(id: &str, bytes: &[u8]) -> Result<StoredLoadBalancer, StoreError> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Corrupt {
        id: id.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;
    use crate::model::tests::spec;
    use crate::testutil::TempDir;

    fn pool() -> Ipv4Net {
        "127.77.0.0/29".parse().unwrap()
    }

    #[test]
    fn lowest_free_vip_skips_taken_and_edge_addresses() {
        let taken = [Ipv4Addr::new(127, 77, 0, 1), Ipv4Addr::new(127, 77, 0, 3)];
        let free = first_free_vip::<Infallible>(pool(), |ip| Ok(taken.contains(&ip)));
        assert_eq!(free, Ok(Some(Ipv4Addr::new(127, 77, 0, 2))));
        let none = first_free_vip::<Infallible>(pool(), |_| Ok(true));
        assert_eq!(none, Ok(None));
    }

    #[test]
    fn create_allocates_and_persists_across_reopen() {
        let dir = TempDir::new("store-reopen");
        let store = Store::open(dir.path(), pool()).unwrap();
        let first = store.create(&spec("a"), Some("key-a"), 10).unwrap();
        assert!(first.is_new);
        let lb = first.load_balancer;
        assert_eq!(lb.vip(), Some(Ipv4Addr::new(127, 77, 0, 1)));
        assert_eq!(lb.state, State::Provisioning);
        assert_eq!(lb.version, 1);
        assert!(lb.id.starts_with("lb-") && lb.id.len() == 11);
        drop(store);

        let store = Store::open(dir.path(), pool()).unwrap();
        assert_eq!(store.get(&lb.id).unwrap(), Some(lb.clone()));
        let again = store.create(&spec("other"), Some("key-a"), 20).unwrap();
        assert!(!again.is_new);
        assert_eq!(again.load_balancer, lb);
        let second = store.create(&spec("b"), None, 20).unwrap().load_balancer;
        assert_eq!(second.vip(), Some(Ipv4Addr::new(127, 77, 0, 2)));
        assert_eq!(store.list().unwrap().len(), 2);
    }

    #[test]
    fn requested_vip_taken_and_pool_exhaustion_are_refused() {
        let dir = TempDir::new("store-vips");
        let store = Store::open(dir.path(), pool()).unwrap();
        let mut wanted = spec("a");
        wanted.vip = Some(Ipv4Addr::new(127, 77, 0, 5));
        let holder = store.create(&wanted, None, 0).unwrap().load_balancer;
        assert!(matches!(
            store.create(&wanted, None, 0),
            Err(StoreError::VipTaken { holder: h, .. }) if h == holder.id
        ));
        // A /29 has six usable VIPs; one is taken by the request above.
        for _ in 0..5 {
            store.create(&spec("x"), None, 0).unwrap();
        }
        assert!(matches!(
            store.create(&spec("x"), None, 0),
            Err(StoreError::PoolExhausted { .. })
        ));
    }

    #[test]
    fn update_checks_version_and_moves_the_vip() {
        let dir = TempDir::new("store-update");
        let store = Store::open(dir.path(), pool()).unwrap();
        let lb = store.create(&spec("a"), None, 0).unwrap().load_balancer;
        let mut changed = spec("a");
        changed.backends.pop();
        assert!(matches!(
            store.update(&lb.id, &changed, 7),
            Err(StoreError::VersionMismatch {
                current: 1,
                expected: 7,
                ..
            })
        ));
        let updated = store.update(&lb.id, &changed, 1).unwrap();
        assert_eq!(updated.version, 2);
        assert_eq!(updated.vip(), lb.vip());
        let unchanged = store.update(&lb.id, &changed, 2).unwrap();
        assert_eq!(unchanged.version, 2);

        changed.vip = Some(Ipv4Addr::new(127, 77, 0, 6));
        let moved = store.update(&lb.id, &changed, 2).unwrap();
        assert_eq!(moved.vip(), Some(Ipv4Addr::new(127, 77, 0, 6)));
        // The old VIP is free again: the next create gets it.
        let next = store.create(&spec("b"), None, 0).unwrap().load_balancer;
        assert_eq!(next.vip(), lb.vip());
        assert!(matches!(
            store.update("lb-missing", &changed, 1),
            Err(StoreError::NotFound { .. })
        ));
    }

    #[test]
    fn delete_lifecycle_frees_vip_and_key() {
        let dir = TempDir::new("store-delete");
        let store = Store::open(dir.path(), pool()).unwrap();
        let lb = store
            .create(&spec("a"), Some("k"), 0)
            .unwrap()
            .load_balancer;
        let active = store.mark_active(&lb.id, 5).unwrap().unwrap();
        assert_eq!((active.state, active.state_since_ms), (State::Active, 5));
        let deleting = store.mark_deleting(&lb.id, 9).unwrap().unwrap();
        assert_eq!(deleting.state, State::Deleting);
        assert_eq!(
            store
                .mark_deleting(&lb.id, 50)
                .unwrap()
                .unwrap()
                .state_since_ms,
            9
        );
        assert!(store.mark_active(&lb.id, 60).unwrap().is_none());
        assert!(matches!(
            store.update(&lb.id, &spec("a"), 1),
            Err(StoreError::Deleting { .. })
        ));
        store.remove(&lb.id).unwrap();
        assert_eq!(store.get(&lb.id).unwrap(), None);
        assert_eq!(store.mark_deleting(&lb.id, 70).unwrap(), None);
        let fresh = store.create(&spec("a"), Some("k"), 0).unwrap();
        assert!(fresh.is_new);
        assert_eq!(fresh.load_balancer.vip(), lb.vip());
    }
}
