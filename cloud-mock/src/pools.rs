//! Named VIP pools: `NAME=CIDR` (a bare CIDR is the pool `default`), disjoint, by name.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::str::FromStr;

use ipnet::Ipv4Net;
use tandem_common::is_dns1123_label;

/// The pool a load balancer gets when it names none.
pub const DEFAULT_POOL: &str = "default";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolsError {
    #[error("VIP pool {text:?}: expected CIDR or NAME=CIDR ({reason})")]
    Syntax { text: String, reason: String },
    #[error(
        "VIP pool name {name:?}: 1 to 63 lowercase letters, digits and '-', starting and ending with a letter or digit"
    )]
    Name { name: String },
    #[error("VIP pool {name} is given twice")]
    Duplicate { name: String },
    #[error("VIP pools {a} and {b} overlap")]
    Overlap { a: String, b: String },
    #[error("at least one VIP pool is needed")]
    Empty,
}

/// One `--vip-pool` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VipPool {
    pub name: String,
    pub cidr: Ipv4Net,
}

impl FromStr for VipPool {
    type Err = PoolsError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (name, cidr) = match text.split_once('=') {
            Some((name, cidr)) => (name.trim(), cidr.trim()),
            None => (DEFAULT_POOL, text.trim()),
        };
        if !is_dns1123_label(name) {
            return Err(PoolsError::Name {
                name: name.to_owned(),
            });
        }
        let cidr = cidr.parse::<Ipv4Net>().map_err(|err| PoolsError::Syntax {
            text: text.to_owned(),
            reason: err.to_string(),
        })?;
        Ok(Self {
            name: name.to_owned(),
            // 198.51.100.7/24 means the pool 198.51.100.0/24.
            cidr: cidr.trunc(),
        })
    }
}

/// Every pool, by name; no two overlap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VipPools(BTreeMap<String, Ipv4Net>);

impl VipPools {
    pub fn new(pools: impl IntoIterator<Item = VipPool>) -> Result<Self, PoolsError> {
        let mut by_name: BTreeMap<String, Ipv4Net> = BTreeMap::new();
        for pool in pools {
            if let Some((other, _)) = by_name
                .iter()
                .find(|(_, cidr)| cidr.contains(&pool.cidr) || pool.cidr.contains(*cidr))
            {
                return Err(if *other == pool.name {
                    PoolsError::Duplicate { name: pool.name }
                } else {
                    PoolsError::Overlap {
                        a: other.clone(),
                        b: pool.name,
                    }
                });
            }
            if by_name.insert(pool.name.clone(), pool.cidr).is_some() {
                return Err(PoolsError::Duplicate { name: pool.name });
            }
        }
        if by_name.is_empty() {
            return Err(PoolsError::Empty);
        }
        Ok(Self(by_name))
    }

    pub fn get(&self, name: &str) -> Option<Ipv4Net> {
        self.0.get(name).copied()
    }

    /// The pool `vip` may be handed out from, if any.
    pub fn pool_of(&self, vip: Ipv4Addr) -> Option<(&str, Ipv4Net)> {
        self.0
            .iter()
            .find(|(_, cidr)| vip_in_pool(vip, **cidr))
            .map(|(name, cidr)| (name.as_str(), *cidr))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, Ipv4Net)> {
        self.0.iter().map(|(name, cidr)| (name.as_str(), *cidr))
    }
}

impl FromStr for VipPools {
    type Err = PoolsError;

    /// Comma-separated pools, as the environment variable carries them.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::new(
            text.split(',')
                .filter(|part| !part.trim().is_empty())
                .map(str::parse)
                .collect::<Result<Vec<VipPool>, _>>()?,
        )
    }
}

impl std::fmt::Display for VipPools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .iter()
            .map(|(name, cidr)| format!("{name}={cidr}"))
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// True when `vip` may be handed out from `pool` (its network and broadcast addresses
/// may not, for pools larger than /31).
pub fn vip_in_pool(vip: Ipv4Addr, pool: Ipv4Net) -> bool {
    pool.contains(&vip)
        && (pool.prefix_len() >= 31 || (vip != pool.network() && vip != pool.broadcast()))
}

/// How many addresses `pool` can hand out.
pub fn pool_size(pool: Ipv4Net) -> u64 {
    let all = 1_u64 << (32 - u32::from(pool.prefix_len()));
    if pool.prefix_len() >= 31 {
        all
    } else {
        all - 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_cidr_is_the_default_pool_and_names_are_labels() {
        let pool: VipPool = "198.51.100.9/24".parse().unwrap();
        assert_eq!(pool.name, "default");
        assert_eq!(pool.cidr, "198.51.100.0/24".parse().unwrap());
        let named: VipPool = "blue=203.0.113.0/28".parse().unwrap();
        assert_eq!(named.name, "blue");
        assert!(matches!(
            "Blue=203.0.113.0/28".parse::<VipPool>(),
            Err(PoolsError::Name { .. })
        ));
        assert!(matches!(
            "blue=nonsense".parse::<VipPool>(),
            Err(PoolsError::Syntax { .. })
        ));
    }

    #[test]
    fn pools_are_disjoint_and_unique() {
        let pools: VipPools = "10.0.0.0/24,blue=10.1.0.0/30".parse().unwrap();
        assert_eq!(pools.get("blue"), Some("10.1.0.0/30".parse().unwrap()));
        assert_eq!(
            pools
                .pool_of(Ipv4Addr::new(10, 1, 0, 2))
                .map(|(name, _)| name),
            Some("blue")
        );
        assert_eq!(pools.pool_of(Ipv4Addr::new(10, 1, 0, 3)), None, "broadcast");
        assert_eq!(pools.to_string(), "blue=10.1.0.0/30,default=10.0.0.0/24");
        assert!(matches!(
            "10.0.0.0/24,red=10.0.0.128/25".parse::<VipPools>(),
            Err(PoolsError::Overlap { .. })
        ));
        assert!(matches!(
            "a=10.0.0.0/24,a=10.2.0.0/24".parse::<VipPools>(),
            Err(PoolsError::Duplicate { .. })
        ));
        assert_eq!("".parse::<VipPools>(), Err(PoolsError::Empty));
    }

    #[test]
    fn sizes_leave_out_network_and_broadcast() {
        assert_eq!(pool_size("10.0.0.0/29".parse().unwrap()), 6);
        assert_eq!(pool_size("10.0.0.0/31".parse().unwrap()), 2);
        assert_eq!(pool_size("10.0.0.7/32".parse().unwrap()), 1);
    }
}
