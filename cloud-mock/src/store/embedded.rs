//! The embedded backend: one redb file, for a single edge. The whole store is read into
//! memory at open; every change is one write transaction, committed durably (fsync)
//! before it is applied in memory and acknowledged, so an acknowledged change survives a
//! crash, and a refused one leaves nothing behind.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition, TableHandle};

use super::StoreError;
use super::address::VipHolders;
use super::state::Change;
use crate::model::{StoredLoadBalancer, StoredNodePool};

/// The database's file in the data directory.
pub(crate) const FILE_NAME: &str = "cloud-mock.redb";

/// id → JSON of [`StoredLoadBalancer`].
pub(super) const LOAD_BALANCERS: TableDefinition<&str, &[u8]> =
    TableDefinition::new("load_balancers");
/// IPv4 VIP (as u32) → JSON of the [`VipHolders`] sharing it.
pub(super) const VIP_HOLDERS: TableDefinition<u32, &[u8]> = TableDefinition::new("vip_holders");
/// IPv6 VIP (as u128) → JSON of the [`VipHolders`] sharing it. A table of its own, so
/// that the IPv4 one of earlier versions stays as it was.
pub(super) const VIP6_HOLDERS: TableDefinition<u128, &[u8]> = TableDefinition::new("vip6_holders");
/// Idempotency-Key of a create → id of the load balancer it made.
pub(super) const IDEMPOTENCY_KEYS: TableDefinition<&str, &str> =
    TableDefinition::new("idempotency_keys");
/// Node pool name → JSON of [`StoredNodePool`].
pub(super) const NODE_POOLS: TableDefinition<&str, &[u8]> = TableDefinition::new("node_pools");
/// The index of node-pool references that earlier versions kept on disk. It is derived
/// in memory now; the table is dropped at open, so that an earlier version opening the
/// file again rebuilds it from the specs (as it does for a file from before the index)
/// instead of trusting a stale one.
const NODE_POOL_REFERENCES: &str = "node_pool_references";

fn db_error(err: impl Into<redb::Error>) -> StoreError {
    StoreError::Database(Box::new(err.into()))
}

/// The open database.
pub(crate) struct RedbBackend {
    db: Database,
}

impl RedbBackend {
    /// Opens (or creates) `data_dir/cloud-mock.redb` and reads every record.
    pub fn open(data_dir: &Path) -> Result<(Self, Change), StoreError> {
        let path = data_dir.join(FILE_NAME);
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
            let stale_index = txn
                .list_tables()?
                .find(|table| table.name() == NODE_POOL_REFERENCES);
            if let Some(index) = stale_index {
                txn.delete_table(index)?;
            }
            txn.commit()?;
            Ok(db)
        };
        let db = open().map_err(|source| StoreError::Open {
            path: path.clone(),
            source: Box::new(source),
        })?;
        let backend = Self { db };
        let records = backend.read_all()?;
        Ok((backend, records))
    }

    /// Every record, as one change into an empty store.
    fn read_all(&self) -> Result<Change, StoreError> {
        let txn = self.db.begin_read().map_err(db_error)?;
        let mut records = Change::default();
        for entry in txn
            .open_table(LOAD_BALANCERS)
            .map_err(db_error)?
            .iter()
            .map_err(db_error)?
        {
            let (id, bytes) = entry.map_err(db_error)?;
            let id = id.value().to_owned();
            let lb: StoredLoadBalancer = decode(bytes.value(), || format!("load balancer {id}"))?;
            records.load_balancers.insert(id, Some(lb));
        }
        for entry in txn
            .open_table(VIP_HOLDERS)
            .map_err(db_error)?
            .iter()
            .map_err(db_error)?
        {
            let (vip, bytes) = entry.map_err(db_error)?;
            let vip = IpAddr::V4(Ipv4Addr::from(vip.value()));
            let holders: VipHolders = decode(bytes.value(), || format!("holders of VIP {vip}"))?;
            records.holders.insert(vip, Some(holders));
        }
        for entry in txn
            .open_table(VIP6_HOLDERS)
            .map_err(db_error)?
            .iter()
            .map_err(db_error)?
        {
            let (vip, bytes) = entry.map_err(db_error)?;
            let vip = IpAddr::V6(Ipv6Addr::from(vip.value()));
            let holders: VipHolders = decode(bytes.value(), || format!("holders of VIP {vip}"))?;
            records.holders.insert(vip, Some(holders));
        }
        for entry in txn
            .open_table(IDEMPOTENCY_KEYS)
            .map_err(db_error)?
            .iter()
            .map_err(db_error)?
        {
            let (key, id) = entry.map_err(db_error)?;
            records
                .idempotency_keys
                .insert(key.value().to_owned(), Some(id.value().to_owned()));
        }
        for entry in txn
            .open_table(NODE_POOLS)
            .map_err(db_error)?
            .iter()
            .map_err(db_error)?
        {
            let (name, bytes) = entry.map_err(db_error)?;
            let name = name.value().to_owned();
            let pool: StoredNodePool = decode(bytes.value(), || format!("node pool {name}"))?;
            records.node_pools.insert(name, Some(pool));
        }
        Ok(records)
    }

    /// Writes `change` in one durable transaction.
    pub fn commit(&self, change: &Change) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        {
            let mut lbs = txn.open_table(LOAD_BALANCERS).map_err(db_error)?;
            for (id, lb) in &change.load_balancers {
                match lb {
                    Some(lb) => drop(
                        lbs.insert(id.as_str(), encode(lb, "load balancer")?.as_slice())
                            .map_err(db_error)?,
                    ),
                    None => drop(lbs.remove(id.as_str()).map_err(db_error)?),
                }
            }
            let mut v4 = txn.open_table(VIP_HOLDERS).map_err(db_error)?;
            let mut v6 = txn.open_table(VIP6_HOLDERS).map_err(db_error)?;
            for (vip, holders) in &change.holders {
                let bytes = holders
                    .as_ref()
                    .map(|holders| encode(holders, "VIP holders"))
                    .transpose()?;
                match (vip, bytes) {
                    (IpAddr::V4(v), Some(bytes)) => drop(
                        v4.insert(u32::from(*v), bytes.as_slice())
                            .map_err(db_error)?,
                    ),
                    (IpAddr::V4(v), None) => drop(v4.remove(u32::from(*v)).map_err(db_error)?),
                    (IpAddr::V6(v), Some(bytes)) => drop(
                        v6.insert(u128::from(*v), bytes.as_slice())
                            .map_err(db_error)?,
                    ),
                    (IpAddr::V6(v), None) => drop(v6.remove(u128::from(*v)).map_err(db_error)?),
                }
            }
            let mut keys = txn.open_table(IDEMPOTENCY_KEYS).map_err(db_error)?;
            for (key, id) in &change.idempotency_keys {
                match id {
                    Some(id) => drop(keys.insert(key.as_str(), id.as_str()).map_err(db_error)?),
                    None => drop(keys.remove(key.as_str()).map_err(db_error)?),
                }
            }
            let mut pools = txn.open_table(NODE_POOLS).map_err(db_error)?;
            for (name, pool) in &change.node_pools {
                match pool {
                    Some(pool) => drop(
                        pools
                            .insert(name.as_str(), encode(pool, "node pool")?.as_slice())
                            .map_err(db_error)?,
                    ),
                    None => drop(pools.remove(name.as_str()).map_err(db_error)?),
                }
            }
        }
        txn.commit().map_err(db_error)
    }
}

/// The JSON of a record, as every backend stores it.
pub(crate) fn encode(
    value: &impl serde::Serialize,
    what: &'static str,
) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|source| StoreError::Encode { what, source })
}

/// A record from its JSON; `what` names it in the error.
pub(crate) fn decode<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    what: impl FnOnce() -> String,
) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Corrupt {
        what: what(),
        source,
    })
}
