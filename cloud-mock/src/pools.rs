//! Named VIP pools: `NAME=CIDR` (a bare CIDR is the pool `default`), by name. A name may
//! be given twice, once with an IPv4 and once with an IPv6 CIDR: a load balancer in that
//! pool may then have a VIP of each family. No two CIDRs overlap.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::str::FromStr;

use cloud_mock_sdk::IpFamily;
use ipnet::IpNet;
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
    #[error("VIP pool {name} is given twice for {family} (a name takes one CIDR per IP family)")]
    Duplicate { name: String, family: IpFamily },
    #[error("VIP pools {a} and {b} overlap")]
    Overlap { a: String, b: String },
    #[error("at least one VIP pool is needed")]
    Empty,
}

/// One `--vip-pool` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VipPool {
    pub name: String,
    pub cidr: IpNet,
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
        let cidr = cidr.parse::<IpNet>().map_err(|err| PoolsError::Syntax {
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

/// Every pool, by name and family; no two CIDRs overlap.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VipPools(BTreeMap<String, BTreeMap<IpFamily, IpNet>>);

impl VipPools {
    pub fn new(pools: impl IntoIterator<Item = VipPool>) -> Result<Self, PoolsError> {
        let mut by_name: BTreeMap<String, BTreeMap<IpFamily, IpNet>> = BTreeMap::new();
        for pool in pools {
            let family = IpFamily::of_net(&pool.cidr);
            let taken = by_name.iter().find_map(|(name, cidrs)| {
                cidrs
                    .values()
                    .any(|cidr| cidr.contains(&pool.cidr) || pool.cidr.contains(cidr))
                    .then_some(name)
            });
            if let Some(other) = taken {
                return Err(if *other == pool.name {
                    PoolsError::Duplicate {
                        name: pool.name,
                        family,
                    }
                } else {
                    PoolsError::Overlap {
                        a: other.clone(),
                        b: pool.name,
                    }
                });
            }
            let cidrs = by_name.entry(pool.name.clone()).or_default();
            if cidrs.insert(family, pool.cidr).is_some() {
                return Err(PoolsError::Duplicate {
                    name: pool.name,
                    family,
                });
            }
        }
        if by_name.is_empty() {
            return Err(PoolsError::Empty);
        }
        Ok(Self(by_name))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    /// The CIDR of pool `name` for `family`, if the pool has that family.
    pub fn cidr(&self, name: &str, family: IpFamily) -> Option<IpNet> {
        self.0.get(name)?.get(&family).copied()
    }

    /// The pool `vip` may be handed out from, if any.
    pub fn pool_of(&self, vip: IpAddr) -> Option<(&str, IpNet)> {
        self.iter().find(|(_, cidr)| vip_in_pool(vip, *cidr))
    }

    /// Every (name, CIDR), by name, IPv4 before IPv6.
    pub fn iter(&self) -> impl Iterator<Item = (&str, IpNet)> {
        self.0
            .iter()
            .flat_map(|(name, cidrs)| cidrs.values().map(move |cidr| (name.as_str(), *cidr)))
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

/// True when `vip` may be handed out from `pool`: not its IPv4 network and broadcast
/// addresses (for pools larger than /31), nor its IPv6 subnet-router anycast address
/// (the all-zero host part, for pools larger than /127).
pub fn vip_in_pool(vip: IpAddr, pool: IpNet) -> bool {
    match pool {
        IpNet::V4(pool) => {
            let IpAddr::V4(vip) = vip else {
                return false;
            };
            pool.contains(&vip)
                && (pool.prefix_len() >= 31 || (vip != pool.network() && vip != pool.broadcast()))
        }
        IpNet::V6(pool) => {
            let IpAddr::V6(vip) = vip else {
                return false;
            };
            pool.contains(&vip) && (pool.prefix_len() >= 127 || vip != pool.network())
        }
    }
}

/// How many addresses `pool` can hand out; `u64::MAX` for IPv6 pools of /64 or more.
pub fn pool_size(pool: IpNet) -> u64 {
    let host_bits = u32::from(pool.max_prefix_len() - pool.prefix_len());
    let reserved = match pool {
        IpNet::V4(_) if host_bits > 1 => 2,
        IpNet::V6(_) if host_bits > 1 => 1,
        _ => 0,
    };
    match 1_u64.checked_shl(host_bits) {
        Some(all) if host_bits < 64 => all - reserved,
        _ => u64::MAX,
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        Ipv4Addr::new(a, b, c, d).into()
    }

    #[test]
    fn bare_cidr_is_the_default_pool_and_names_are_labels() {
        let pool: VipPool = "198.51.100.9/24".parse().unwrap();
        assert_eq!(pool.name, "default");
        assert_eq!(pool.cidr, "198.51.100.0/24".parse().unwrap());
        let named: VipPool = "blue=203.0.113.0/28".parse().unwrap();
        assert_eq!(named.name, "blue");
        let v6: VipPool = "blue=2001:db8:51:100::9/64".parse().unwrap();
        assert_eq!(v6.cidr, "2001:db8:51:100::/64".parse().unwrap());
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
        assert_eq!(
            pools.cidr("blue", IpFamily::Ipv4),
            Some("10.1.0.0/30".parse().unwrap())
        );
        assert_eq!(pools.cidr("blue", IpFamily::Ipv6), None);
        assert!(pools.contains("blue") && !pools.contains("red"));
        assert_eq!(
            pools.pool_of(v4(10, 1, 0, 2)).map(|(name, _)| name),
            Some("blue")
        );
        assert_eq!(pools.pool_of(v4(10, 1, 0, 3)), None, "broadcast");
        assert_eq!(pools.to_string(), "blue=10.1.0.0/30,default=10.0.0.0/24");
        assert!(matches!(
            "10.0.0.0/24,red=10.0.0.128/25".parse::<VipPools>(),
            Err(PoolsError::Overlap { .. })
        ));
        assert!(matches!(
            "a=10.0.0.0/24,a=10.2.0.0/24".parse::<VipPools>(),
            Err(PoolsError::Duplicate {
                family: IpFamily::Ipv4,
                ..
            })
        ));
        assert_eq!("".parse::<VipPools>(), Err(PoolsError::Empty));
    }

    #[test]
    fn a_name_takes_one_cidr_per_family() {
        let pools: VipPools = "198.51.100.0/24,2001:db8:51:100::/64,v6only=2001:db8:51:200::/120"
            .parse()
            .unwrap();
        assert_eq!(
            pools.cidr(DEFAULT_POOL, IpFamily::Ipv6),
            Some("2001:db8:51:100::/64".parse().unwrap())
        );
        assert_eq!(pools.cidr("v6only", IpFamily::Ipv4), None);
        assert_eq!(
            pools.pool_of("2001:db8:51:200::5".parse().unwrap()),
            Some(("v6only", "2001:db8:51:200::/120".parse().unwrap()))
        );
        assert_eq!(
            pools.pool_of("2001:db8:51:200::".parse().unwrap()),
            None,
            "the subnet-router anycast address"
        );
        assert_eq!(
            pools.to_string(),
            "default=198.51.100.0/24,default=2001:db8:51:100::/64,v6only=2001:db8:51:200::/120"
        );
        assert!(matches!(
            "a=2001:db8::/64,a=2001:db9::/64".parse::<VipPools>(),
            Err(PoolsError::Duplicate {
                family: IpFamily::Ipv6,
                ..
            })
        ));
        assert!(matches!(
            "a=2001:db8::/64,b=2001:db8::/96".parse::<VipPools>(),
            Err(PoolsError::Overlap { .. })
        ));
    }

    #[test]
    fn sizes_leave_out_network_broadcast_and_anycast() {
        assert_eq!(pool_size("10.0.0.0/29".parse().unwrap()), 6);
        assert_eq!(pool_size("10.0.0.0/31".parse().unwrap()), 2);
        assert_eq!(pool_size("10.0.0.7/32".parse().unwrap()), 1);
        assert_eq!(pool_size("2001:db8::/120".parse().unwrap()), 255);
        assert_eq!(pool_size("2001:db8::/127".parse().unwrap()), 2);
        assert_eq!(pool_size("2001:db8::1/128".parse().unwrap()), 1);
        assert_eq!(pool_size("2001:db8::/64".parse().unwrap()), u64::MAX);
        assert_eq!(pool_size("2001:db8::/48".parse().unwrap()), u64::MAX);
        assert!(!vip_in_pool(
            v4(10, 0, 0, 1),
            "2001:db8::/64".parse().unwrap()
        ));
    }
}
