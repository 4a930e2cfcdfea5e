//! The pure address logic of the store, the same for every backend: where a new VIP is
//! searched for, which load balancers may share one, and what a stored spec records of
//! its placement. It reads the store through [`Holdings`] and never writes.

use std::collections::BTreeSet;
use std::net::IpAddr;

use cloud_mock_sdk::Protocol;
use cloud_mock_sdk::families::LoadBalancerSpec;
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::StoreError;
use crate::model::StoredLoadBalancer;
use crate::pools::vip_in_pool;
use crate::tenants::Tenant;

/// What the address logic reads of the store (a transaction's view of it).
pub(crate) trait Holdings {
    fn lb(&self, id: &str) -> Option<StoredLoadBalancer>;
    /// The holders of `vip` (none: empty).
    fn holders(&self, vip: IpAddr) -> VipHolders;
    /// Every held VIP in `cidr` with its holders, lowest first.
    fn held_in(&self, cidr: IpNet) -> Vec<(IpAddr, VipHolders)>;
    /// The lowest free VIP of `cidr`.
    fn first_free(&self, cidr: IpNet) -> Option<IpAddr>;
}

/// The load balancers on one VIP: one, or several with the same sharing key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct VipHolders {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing_key: Option<String>,
    pub ids: BTreeSet<String>,
}

/// The lowest address of `pool` from `floor` on (every VIP below it is taken) that may be
/// a VIP and is not taken. An IPv6 pool is scanned from its start too: the scan ends
/// after at most one more address than are taken, however large the pool.
pub fn first_free_vip(
    pool: IpNet,
    floor: Option<IpAddr>,
    is_taken: impl Fn(IpAddr) -> bool,
) -> Option<IpAddr> {
    let mut candidates = pool.hosts();
    if let (Some(floor), Some(first)) = (floor, pool.hosts().next()) {
        // Ranges skip in O(1); skipping the floor's predecessors leaves it next.
        let skip = ordinal(floor).saturating_sub(ordinal(first));
        if let Some(before_floor) = skip.checked_sub(1) {
            candidates.nth(usize::try_from(before_floor).unwrap_or(usize::MAX));
        }
    }
    candidates.find(|&candidate| vip_in_pool(candidate, pool) && !is_taken(candidate))
}

/// The address as a number, to count the addresses between two of one family.
fn ordinal(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// A new load balancer id of the store's choosing.
pub(crate) fn new_id() -> String {
    format!("lb-{:08x}", rand::random::<u32>())
}

/// The spec as stored: the assigned VIPs in `vips` (family order) and the IPv4 one in
/// `vip`, the pool named.
pub(crate) fn assigned(spec: &LoadBalancerSpec, vips: &[IpAddr], pool: &str) -> LoadBalancerSpec {
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
pub(crate) fn place(
    txn: &impl Holdings,
    id: &str,
    spec: &LoadBalancerSpec,
    pool: &str,
    cidr: IpNet,
    requested: Option<IpAddr>,
) -> Result<IpAddr, StoreError> {
    if let Some(vip) = requested {
        check_sharing(txn, vip, &txn.holders(vip), id, spec)?;
        return Ok(vip);
    }
    if spec.address.sharing_key.is_some() {
        for (vip, sharers) in txn.held_in(cidr) {
            if sharers.sharing_key == spec.address.sharing_key
                && may_share(txn, vip, &sharers, id, spec)?
            {
                return Ok(vip);
            }
        }
    }
    txn.first_free(cidr)
        .ok_or_else(|| StoreError::PoolExhausted {
            pool: pool.to_owned(),
            cidr,
        })
}

/// [`check_sharing`] as a yes or no: a refusal means "look elsewhere", while a decoding
/// error is no answer.
pub(crate) fn may_share(
    txn: &impl Holdings,
    vip: IpAddr,
    sharers: &VipHolders,
    id: &str,
    spec: &LoadBalancerSpec,
) -> Result<bool, StoreError> {
    match check_sharing(txn, vip, sharers, id, spec) {
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
/// all of them carry the same sharing key, belong to the same cluster, use the same mode
/// and serve none of its (protocol, port) pairs.
fn check_sharing(
    txn: &impl Holdings,
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
        let Some(other) = txn.lb(holder) else {
            continue;
        };
        // A sharing key is a cluster's own (as MetalLB's): so two tenants, whose clusters
        // differ, never meet on one VIP.
        if Tenant::cluster_of(&other.spec.tags) != Tenant::cluster_of(&spec.tags) {
            return Err(StoreError::VipTaken {
                vip,
                holder: holder.clone(),
            });
        }
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

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn pool() -> IpNet {
        "127.77.0.0/29".parse().unwrap()
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, 77, 0, last))
    }

    #[test]
    fn lowest_free_vip_skips_taken_and_edge_addresses() {
        let taken = [ip(1), ip(3)];
        assert_eq!(
            first_free_vip(pool(), None, |ip| taken.contains(&ip)),
            Some(ip(2))
        );
        assert_eq!(first_free_vip(pool(), None, |_| true), None);
        let v6: IpNet = "2001:db8:51:100::/64".parse().unwrap();
        let taken6: IpAddr = "2001:db8:51:100::1".parse().unwrap();
        assert_eq!(
            first_free_vip(v6, None, |ip| ip == taken6),
            Some("2001:db8:51:100::2".parse().unwrap()),
            "not the subnet-router anycast address, not a taken one"
        );
    }

    #[test]
    fn the_search_starts_at_the_floor() {
        let read = std::cell::RefCell::new(Vec::new());
        let from_floor = first_free_vip(pool(), Some(ip(3)), |candidate| {
            read.borrow_mut().push(candidate);
            candidate == ip(3)
        });
        assert_eq!(from_floor, Some(ip(4)));
        assert_eq!(*read.borrow(), [ip(3), ip(4)], "ip(1) and ip(2) not read");
        assert_eq!(
            first_free_vip(pool(), Some(ip(7)), |_| false),
            None,
            "the broadcast address is no VIP"
        );
    }
}
