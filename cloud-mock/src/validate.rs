//! Semantic checks of a load-balancer spec and of a node-pool spec (types and ranges of
//! the JSON are checked by deserialisation already), and where an LB's VIPs are to come
//! from.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use cloud_mock_sdk::families::{Backend, LoadBalancerSpec};
use cloud_mock_sdk::{HealthCheckProtocol, IpFamily, Mode, NodePoolSpec, Protocol};
use ipnet::IpNet;

use crate::pools::{VipPools, vip_in_pool};
use tandem_common::is_dns1123_label;

pub const MAX_NAME_LEN: usize = 253;
pub const MAX_TAGS: usize = 64;
pub const MAX_TAG_KEY_LEN: usize = 128;
pub const MAX_TAG_VALUE_LEN: usize = 256;
pub const MAX_LISTENERS: usize = 100;
pub const MAX_BACKENDS: usize = 1000;
/// A node pool holds a cluster's nodes: more than one LB's backends ever are.
pub const MAX_NODE_POOL_BACKENDS: usize = 5000;
pub const MAX_SOURCE_RANGES: usize = 100;
pub const MAX_PATH_LEN: usize = 1024;
pub const MAX_SHARING_KEY_LEN: usize = 253;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    #[error("vip: {vip} is outside every VIP pool")]
    VipOutsidePools { vip: IpAddr },
    #[error("vip: {vip} is outside the VIP pool {pool} ({cidr})")]
    VipOutsidePool {
        vip: IpAddr,
        pool: String,
        cidr: IpNet,
    },
    #[error(
        "vips: {vip} is in the VIP pool {pool}, {other} in {other_pool}; the VIPs of one load balancer come from one pool"
    )]
    VipsInTwoPools {
        vip: IpAddr,
        pool: String,
        other: IpAddr,
        other_pool: String,
    },
    #[error("pool: there is no VIP pool named {pool}")]
    UnknownPool { pool: String },
    #[error("pool: the VIP pool {pool} has no {family} addresses (ipFamilies asks for {family})")]
    PoolLacksFamily { pool: String, family: IpFamily },
    #[error(
        "backends: a load balancer on node pool {node_pool} takes its backends from the pool; send backends empty"
    )]
    BackendsAndNodePool { node_pool: String },
    #[error(
        "listeners[{index}]: this cloud's proxy-mode load balancers serve TCP only; UDP port {port} cannot be served (passthrough mode routes UDP)"
    )]
    UdpUnserved { index: usize, port: u16 },
    #[error(
        "mode: this edge announces its VIPs in the L2 mode, where the VIP's owner takes its packets itself, so it serves proxy-mode load balancers only; passthrough needs the BGP mode (--announce-table)"
    )]
    PassthroughUnserved,
}

/// Refuses what the data plane cannot serve: UDP listeners of proxy-mode load balancers
/// when it proxies TCP only (HAProxy), and passthrough load balancers without
/// `serves_passthrough` (the L2 mode).
pub fn validate_served(
    spec: &LoadBalancerSpec,
    proxies_udp: bool,
    serves_passthrough: bool,
) -> Result<(), SpecError> {
    if spec.mode == Mode::Passthrough && !serves_passthrough {
        return Err(SpecError::PassthroughUnserved);
    }
    if proxies_udp || spec.mode != Mode::Proxy {
        return Ok(());
    }
    match spec
        .listeners
        .iter()
        .enumerate()
        .find(|(_, listener)| listener.protocol == Protocol::Udp)
    {
        Some((index, listener)) => Err(SpecError::UdpUnserved {
            index,
            port: listener.port,
        }),
        None => Ok(()),
    }
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> SpecError {
    SpecError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Where a valid spec's VIPs come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The pool named, or the one holding the requested VIPs, which has every family
    /// asked for; `None` when the spec names neither (a create then takes the default
    /// pool, an update keeps its pool).
    pub pool: Option<String>,
    /// One entry per family asked for, in the spec's order, with the VIP requested for it.
    pub vips: Vec<FamilyVip>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FamilyVip {
    pub family: IpFamily,
    pub requested: Option<IpAddr>,
}

/// Checks everything about `spec` that its types do not, first problem first, and
/// resolves its pool and requested VIP against `pools`.
pub fn validate_spec(spec: &LoadBalancerSpec, pools: &VipPools) -> Result<Placement, SpecError> {
    validate_text("name", &spec.name, 1, MAX_NAME_LEN)?;
    validate_tags(&spec.tags)?;
    if let Some(key) = &spec.address.sharing_key {
        validate_text("sharingKey", key, 1, MAX_SHARING_KEY_LEN)?;
    }
    let placement = placement(spec, pools)?;
    if spec.listeners.len() > MAX_LISTENERS {
        return Err(invalid(
            "listeners",
            format!("at most {MAX_LISTENERS} listeners"),
        ));
    }
    let mut seen_listeners = BTreeSet::new();
    for (index, listener) in spec.listeners.iter().enumerate() {
        let field = format!("listeners[{index}]");
        if listener.port == 0 {
            return Err(invalid(
                format!("{field}.port"),
                "must be between 1 and 65535",
            ));
        }
        if listener.backend_port == 0 {
            return Err(invalid(
                format!("{field}.backendPort"),
                "must be between 1 and 65535",
            ));
        }
        if !seen_listeners.insert((listener.protocol, listener.port)) {
            return Err(invalid(
                format!("{field}.port"),
                format!(
                    "another {:?} listener already uses port {}",
                    listener.protocol, listener.port
                ),
            ));
        }
        if let Some(check) = &listener.health_check {
            let field = format!("{field}.healthCheck");
            if check.port == 0 {
                return Err(invalid(
                    format!("{field}.port"),
                    "must be between 1 and 65535",
                ));
            }
            match (check.protocol, &check.path) {
                (HealthCheckProtocol::Http, Some(path)) => {
                    validate_text(&format!("{field}.path"), path, 1, MAX_PATH_LEN)?;
                    if !path.starts_with('/') || path.contains(char::is_whitespace) {
                        return Err(invalid(
                            format!("{field}.path"),
                            "must start with '/' and contain no whitespace",
                        ));
                    }
                }
                (HealthCheckProtocol::Http, None) => {
                    return Err(invalid(
                        format!("{field}.path"),
                        "required for an HTTP health check",
                    ));
                }
                (HealthCheckProtocol::Tcp, Some(_)) => {
                    return Err(invalid(
                        format!("{field}.path"),
                        "only an HTTP health check has a path",
                    ));
                }
                (HealthCheckProtocol::Tcp, None) => {}
            }
        }
    }
    if let Some(node_pool) = &spec.node_pool {
        validate_node_pool_name("nodePool", node_pool)?;
        if !spec.backends.is_empty() {
            return Err(SpecError::BackendsAndNodePool {
                node_pool: node_pool.clone(),
            });
        }
    }
    let families: BTreeSet<IpFamily> = spec.ip_families.iter().copied().collect();
    validate_backends(&spec.backends, MAX_BACKENDS, Some(&families))?;
    if spec.source_ranges.len() > MAX_SOURCE_RANGES {
        return Err(invalid(
            "sourceRanges",
            format!("at most {MAX_SOURCE_RANGES} ranges"),
        ));
    }
    Ok(placement)
}

/// The families asked for, the requested VIPs (from `vip` and `vips`, which must agree:
/// one address per family, of a family asked for) and the pool they come from: the named
/// one, which must hold them, or the one that holds them, which must have every family.
fn placement(spec: &LoadBalancerSpec, pools: &VipPools) -> Result<Placement, SpecError> {
    let families = &spec.ip_families;
    if families.is_empty() || families.len() > 2 {
        return Err(invalid(
            "ipFamilies",
            "one or two families: IPv4, IPv6, or both in the order of their VIPs",
        ));
    }
    if families.len() == 2 && families[0] == families[1] {
        return Err(invalid(
            "ipFamilies",
            format!("{} is given twice", families[0]),
        ));
    }
    let mut vips: Vec<FamilyVip> = families
        .iter()
        .map(|&family| FamilyVip {
            family,
            requested: None,
        })
        .collect();
    let asked = spec
        .vip
        .map(IpAddr::V4)
        .into_iter()
        .chain(spec.address.vips.iter().copied());
    for vip in asked {
        let family = IpFamily::of(&vip);
        let Some(slot) = vips.iter_mut().find(|slot| slot.family == family) else {
            return Err(invalid(
                "vips",
                format!("{vip} is an {family} address, but ipFamilies has no {family}"),
            ));
        };
        match slot.requested {
            Some(earlier) if earlier != vip => {
                return Err(invalid(
                    "vips",
                    format!("{earlier} and {vip}: at most one address per IP family"),
                ));
            }
            _ => slot.requested = Some(vip),
        }
    }
    let named = match &spec.address.pool {
        Some(name) => {
            if !is_dns1123_label(name) {
                return Err(invalid("pool", format!("{name:?} is not a pool name")));
            }
            if !pools.contains(name) {
                return Err(SpecError::UnknownPool { pool: name.clone() });
            }
            Some(name.clone())
        }
        None => None,
    };
    let mut pool = named;
    let mut placed: Option<IpAddr> = None;
    for vip in vips.iter().filter_map(|slot| slot.requested) {
        match &pool {
            Some(name) => {
                let family = IpFamily::of(&vip);
                let cidr = pools.cidr(name, family);
                if cidr.is_some_and(|cidr| vip_in_pool(vip, cidr)) {
                    continue;
                }
                // A pool found from an earlier VIP: say where this one lies instead.
                if let (Some(other), Some((its_pool, _))) = (placed, pools.pool_of(vip)) {
                    return Err(SpecError::VipsInTwoPools {
                        vip,
                        pool: its_pool.to_owned(),
                        other,
                        other_pool: name.clone(),
                    });
                }
                let cidr = cidr.ok_or_else(|| SpecError::PoolLacksFamily {
                    pool: name.clone(),
                    family,
                })?;
                return Err(SpecError::VipOutsidePool {
                    vip,
                    pool: name.clone(),
                    cidr,
                });
            }
            None => {
                let (name, _) = pools
                    .pool_of(vip)
                    .ok_or(SpecError::VipOutsidePools { vip })?;
                pool = Some(name.to_owned());
                placed = Some(vip);
            }
        }
    }
    if let Some(name) = &pool
        && let Some(slot) = vips
            .iter()
            .find(|slot| pools.cidr(name, slot.family).is_none())
    {
        return Err(SpecError::PoolLacksFamily {
            pool: name.clone(),
            family: slot.family,
        });
    }
    Ok(Placement { pool, vips })
}

/// Checks a node pool's name (a DNS label, as VIP pool names) and spec: its tags as an
/// LB's, at most [`MAX_NODE_POOL_BACKENDS`] unicast backends of either family, each once.
pub fn validate_node_pool(name: &str, spec: &NodePoolSpec) -> Result<(), SpecError> {
    validate_node_pool_name("name", name)?;
    validate_tags(&spec.tags)?;
    validate_backends(&spec.backends, MAX_NODE_POOL_BACKENDS, None)
}

fn validate_node_pool_name(field: &str, name: &str) -> Result<(), SpecError> {
    if is_dns1123_label(name) {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("{name:?} is not a node pool name (a DNS label: a-z, 0-9 and '-', at most 63)"),
        ))
    }
}

fn validate_tags(tags: &BTreeMap<String, String>) -> Result<(), SpecError> {
    if tags.len() > MAX_TAGS {
        return Err(invalid("tags", format!("at most {MAX_TAGS} tags")));
    }
    for (key, value) in tags {
        validate_text("tags", key, 1, MAX_TAG_KEY_LEN)?;
        if key.contains('=') {
            return Err(invalid(
                format!("tags.{key}"),
                "a tag key may not contain '='",
            ));
        }
        validate_text(&format!("tags.{key}"), value, 0, MAX_TAG_VALUE_LEN)?;
    }
    Ok(())
}

/// At most `max` unicast backends, each once, and, given `families`, of those families.
fn validate_backends(
    backends: &[Backend],
    max: usize,
    families: Option<&BTreeSet<IpFamily>>,
) -> Result<(), SpecError> {
    if backends.len() > max {
        return Err(invalid("backends", format!("at most {max} backends")));
    }
    let mut seen_backends = BTreeSet::new();
    for (index, backend) in backends.iter().enumerate() {
        let ip = backend.ip;
        let broadcast = matches!(ip, IpAddr::V4(v4) if v4.is_broadcast());
        if ip.is_unspecified() || broadcast || ip.is_multicast() {
            return Err(invalid(
                format!("backends[{index}].ip"),
                format!("{ip} is not a unicast address"),
            ));
        }
        let family = IpFamily::of(&ip);
        if families.is_some_and(|families| !families.contains(&family)) {
            return Err(invalid(
                format!("backends[{index}].ip"),
                format!("{ip} is an {family} address, but ipFamilies has no {family}"),
            ));
        }
        if !seen_backends.insert(ip) {
            return Err(invalid(
                format!("backends[{index}].ip"),
                format!("{ip} is listed twice"),
            ));
        }
    }
    Ok(())
}

fn validate_text(field: &str, text: &str, min: usize, max: usize) -> Result<(), SpecError> {
    let len = text.chars().count();
    if len < min || len > max {
        return Err(invalid(
            field,
            format!("must be {min} to {max} characters long, not {len}"),
        ));
    }
    if text.chars().any(char::is_control) {
        return Err(invalid(field, "may not contain control characters"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use cloud_mock_sdk::HealthCheck;
    use cloud_mock_sdk::families::Backend;

    use super::*;
    use crate::model::tests::spec;

    fn pool() -> VipPools {
        "127.77.0.0/28,blue=127.78.0.0/29,blue=2001:db8:51:100::/64,v6=2001:db8:51:200::/120"
            .parse()
            .unwrap()
    }

    fn field_of(result: Result<Placement, SpecError>) -> String {
        match result {
            Err(SpecError::Invalid { field, .. }) => field,
            other => panic!("expected an invalid field, got {other:?}"),
        }
    }

    fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        Ipv4Addr::new(a, b, c, d).into()
    }

    fn asked(family: IpFamily, requested: Option<IpAddr>) -> FamilyVip {
        FamilyVip { family, requested }
    }

    #[test]
    fn a_complete_spec_is_valid_and_names_no_pool() {
        assert_eq!(
            validate_spec(&spec("a"), &pool()),
            Ok(Placement {
                pool: None,
                vips: vec![asked(IpFamily::Ipv4, None)],
            })
        );
    }

    #[test]
    fn pool_edges_are_not_vips() {
        let default: IpNet = "127.77.0.0/28".parse().unwrap();
        assert!(!vip_in_pool(v4(127, 77, 0, 0), default));
        assert!(vip_in_pool(v4(127, 77, 0, 1), default));
        assert!(vip_in_pool(v4(127, 77, 0, 14), default));
        assert!(!vip_in_pool(v4(127, 77, 0, 15), default));
        assert!(!vip_in_pool(v4(127, 77, 1, 1), default));
        assert!(vip_in_pool(v4(10, 0, 0, 1), "10.0.0.1/32".parse().unwrap()));
    }

    #[test]
    fn requested_vip_picks_its_pool_and_must_lie_in_a_named_one() {
        let blue_vip = v4(127, 78, 0, 1);
        let mut s = spec("a");
        s.address.vips = vec![blue_vip];
        let placement = validate_spec(&s, &pool()).unwrap();
        assert_eq!(placement.vips, vec![asked(IpFamily::Ipv4, Some(blue_vip))]);
        assert_eq!(placement.pool.as_deref(), Some("blue"));

        s.address.pool = Some("default".into());
        assert!(matches!(
            validate_spec(&s, &pool()),
            Err(SpecError::VipOutsidePool { pool, .. }) if pool == "default"
        ));
        s.address.pool = Some("green".into());
        assert_eq!(
            validate_spec(&s, &pool()),
            Err(SpecError::UnknownPool {
                pool: "green".into()
            })
        );

        let mut outside = spec("a");
        outside.vip = Some(Ipv4Addr::new(127, 79, 0, 1));
        assert!(matches!(
            validate_spec(&outside, &pool()),
            Err(SpecError::VipOutsidePools { .. })
        ));
        let mut two = spec("a");
        two.vip = Some(Ipv4Addr::new(127, 77, 0, 2));
        two.address.vips = vec![v4(127, 77, 0, 3)];
        assert_eq!(field_of(validate_spec(&two, &pool())), "vips");
        two.address.vips = vec![v4(127, 77, 0, 2)];
        assert!(validate_spec(&two, &pool()).is_ok(), "vip and vips agree");
    }

    #[test]
    fn families_are_one_or_two_distinct_and_addresses_match_them() {
        let mut s = spec("a");
        s.ip_families = vec![];
        assert_eq!(field_of(validate_spec(&s, &pool())), "ipFamilies");
        s.ip_families = vec![IpFamily::Ipv6, IpFamily::Ipv6];
        assert_eq!(field_of(validate_spec(&s, &pool())), "ipFamilies");

        // An IPv6 address for an IPv4 load balancer (what a client before families sends
        // for an IPv6 request) is refused, not half served.
        let mut v6_for_v4 = spec("a");
        v6_for_v4.address.vips = vec!["2001:db8:51:100::1".parse().unwrap()];
        assert_eq!(field_of(validate_spec(&v6_for_v4, &pool())), "vips");

        let mut dual = spec("a");
        dual.ip_families = vec![IpFamily::Ipv6, IpFamily::Ipv4];
        dual.address.pool = Some("blue".into());
        assert_eq!(
            validate_spec(&dual, &pool()).map(|p| p.vips),
            Ok(vec![
                asked(IpFamily::Ipv6, None),
                asked(IpFamily::Ipv4, None)
            ])
        );
        dual.address.vips = vec![
            "2001:db8:51:100::9".parse().unwrap(),
            "2001:db8:51:100::a".parse().unwrap(),
        ];
        assert_eq!(
            field_of(validate_spec(&dual, &pool())),
            "vips",
            "one per family"
        );

        // Backends of a family the load balancer does not have serve nothing: refused.
        let mut stray = spec("a");
        stray.backends.push(Backend {
            ip: "2001:db8:18::11".parse().unwrap(),
        });
        assert_eq!(field_of(validate_spec(&stray, &pool())), "backends[2].ip");
        // Source ranges of either family are fine: each applies to its family's VIP.
        let mut ranges = spec("a");
        ranges
            .source_ranges
            .push("2001:db8:203::/64".parse().unwrap());
        assert!(validate_spec(&ranges, &pool()).is_ok());
    }

    #[test]
    fn a_pool_without_an_asked_family_is_refused() {
        let mut s = spec("a");
        s.ip_families = vec![IpFamily::Ipv4, IpFamily::Ipv6];
        s.address.pool = Some("default".into());
        assert_eq!(
            validate_spec(&s, &pool()),
            Err(SpecError::PoolLacksFamily {
                pool: "default".into(),
                family: IpFamily::Ipv6
            })
        );
        s.address.pool = Some("v6".into());
        assert_eq!(
            validate_spec(&s, &pool()),
            Err(SpecError::PoolLacksFamily {
                pool: "v6".into(),
                family: IpFamily::Ipv4
            })
        );
        // The pool of a requested address must have the other family too.
        s.address.pool = None;
        s.address.vips = vec!["2001:db8:51:200::7".parse().unwrap()];
        assert!(matches!(
            validate_spec(&s, &pool()),
            Err(SpecError::PoolLacksFamily { pool, family: IpFamily::Ipv4 }) if pool == "v6"
        ));
        s.address.vips = vec!["2001:db8:51:100::7".parse().unwrap()];
        assert_eq!(
            validate_spec(&s, &pool()).map(|p| p.pool),
            Ok(Some("blue".into()))
        );
        // Both requested, from two pools: refused, naming both.
        s.address.vips = vec![v4(127, 77, 0, 2), "2001:db8:51:100::7".parse().unwrap()];
        assert!(matches!(
            validate_spec(&s, &pool()),
            Err(SpecError::VipsInTwoPools { pool, other_pool, .. })
                if pool == "blue" && other_pool == "default"
        ));
        let message = validate_spec(&s, &pool()).unwrap_err().to_string();
        assert!(message.contains("one pool"), "{message}");
    }

    #[test]
    fn each_broken_field_is_named() {
        let mut s = spec("");
        assert_eq!(field_of(validate_spec(&s, &pool())), "name");
        s = spec("bad\nname");
        assert_eq!(field_of(validate_spec(&s, &pool())), "name");

        s = spec("a");
        s.listeners[1].port = 0;
        assert_eq!(field_of(validate_spec(&s, &pool())), "listeners[1].port");

        s = spec("a");
        s.listeners[0].backend_port = 0;
        assert_eq!(
            field_of(validate_spec(&s, &pool())),
            "listeners[0].backendPort"
        );

        s = spec("a");
        s.listeners[1] = s.listeners[0].clone();
        assert_eq!(field_of(validate_spec(&s, &pool())), "listeners[1].port");

        s = spec("a");
        s.listeners[0].health_check = Some(HealthCheck {
            protocol: HealthCheckProtocol::Http,
            port: 1,
            path: None,
        });
        assert_eq!(
            field_of(validate_spec(&s, &pool())),
            "listeners[0].healthCheck.path"
        );
        s.listeners[0].health_check = Some(HealthCheck {
            protocol: HealthCheckProtocol::Http,
            port: 1,
            path: Some("healthz".into()),
        });
        assert_eq!(
            field_of(validate_spec(&s, &pool())),
            "listeners[0].healthCheck.path"
        );

        s = spec("a");
        s.backends.push(s.backends[0]);
        assert_eq!(field_of(validate_spec(&s, &pool())), "backends[2].ip");
        s = spec("a");
        s.backends[0] = Backend {
            ip: Ipv4Addr::UNSPECIFIED.into(),
        };
        assert_eq!(field_of(validate_spec(&s, &pool())), "backends[0].ip");

        s = spec("a");
        s.tags.insert("a=b".into(), "c".into());
        assert_eq!(field_of(validate_spec(&s, &pool())), "tags.a=b");
    }

    #[test]
    fn udp_in_proxy_mode_is_refused_where_only_tcp_is_proxied() {
        let mut udp = spec("x");
        udp.listeners[0].protocol = Protocol::Udp;
        udp.listeners[0].port = 53;
        assert!(validate_served(&udp, true, true).is_ok());
        let refused = validate_served(&udp, false, true).unwrap_err();
        assert_eq!(refused, SpecError::UdpUnserved { index: 0, port: 53 });
        assert!(refused.to_string().contains("UDP port 53"));
        udp.mode = Mode::Passthrough;
        assert!(
            validate_served(&udp, false, true).is_ok(),
            "routes carry UDP"
        );
        assert_eq!(
            validate_served(&udp, true, false),
            Err(SpecError::PassthroughUnserved),
            "the L2 mode's owner takes a VIP's packets itself"
        );
        let mut tcp = spec("x");
        tcp.listeners
            .retain(|listener| listener.protocol == Protocol::Tcp);
        assert!(validate_served(&tcp, false, false).is_ok());
    }

    #[test]
    fn same_port_is_fine_for_tcp_and_udp() {
        let mut s = spec("a");
        s.listeners[1].port = s.listeners[0].port;
        assert!(validate_spec(&s, &pool()).is_ok());
    }

    #[test]
    fn a_node_pool_takes_the_place_of_backends() {
        let mut on_pool = spec("a");
        on_pool.node_pool = Some("c1-nodes".into());
        assert_eq!(
            validate_spec(&on_pool, &pool()),
            Err(SpecError::BackendsAndNodePool {
                node_pool: "c1-nodes".into()
            })
        );
        on_pool.backends.clear();
        assert!(validate_spec(&on_pool, &pool()).is_ok());
        on_pool.node_pool = Some("C1_nodes".into());
        assert_eq!(field_of(validate_spec(&on_pool, &pool())), "nodePool");
    }

    #[test]
    fn node_pool_specs_are_checked() {
        let member = |ip: &str| Backend {
            ip: ip.parse().unwrap(),
        };
        let mut node_pool = NodePoolSpec {
            tags: BTreeMap::from([("cluster".into(), "c1".into())]),
            backends: vec![member("198.18.0.11"), member("2001:db8:18::11")],
        };
        assert_eq!(validate_node_pool("c1-nodes", &node_pool), Ok(()));
        let field = |name: &str, spec: &NodePoolSpec| match validate_node_pool(name, spec) {
            Err(SpecError::Invalid { field, .. }) => field,
            other => panic!("expected an invalid field, got {other:?}"),
        };
        for bad in ["", "-a", "a-", "A", "a.b", &"a".repeat(64)] {
            assert_eq!(field(bad, &node_pool), "name", "{bad:?}");
        }
        node_pool.backends.push(member("198.18.0.11"));
        assert_eq!(field("p", &node_pool), "backends[2].ip");
        node_pool.backends[2] = member("224.0.0.1");
        assert_eq!(field("p", &node_pool), "backends[2].ip");
        node_pool.backends = (0..=MAX_NODE_POOL_BACKENDS)
            .map(|i| Backend {
                ip: IpAddr::from([10, 0, (i / 256) as u8, (i % 256) as u8]),
            })
            .collect();
        assert_eq!(field("p", &node_pool), "backends");
        node_pool.backends.pop();
        assert_eq!(validate_node_pool("p", &node_pool), Ok(()));
        node_pool.tags.insert("a=b".into(), String::new());
        assert_eq!(field("p", &node_pool), "tags.a=b");
    }
}
