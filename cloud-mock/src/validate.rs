//! Semantic checks of a load-balancer spec (types and ranges of the JSON are checked by
//! deserialisation already), and where its VIP is to come from.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use cloud_mock_sdk::{HealthCheckProtocol, LoadBalancerSpec};
use ipnet::Ipv4Net;

use crate::pools::{VipPools, vip_in_pool};
use tandem_common::is_dns1123_label;

pub const MAX_NAME_LEN: usize = 253;
pub const MAX_TAGS: usize = 64;
pub const MAX_TAG_KEY_LEN: usize = 128;
pub const MAX_TAG_VALUE_LEN: usize = 256;
pub const MAX_LISTENERS: usize = 100;
pub const MAX_BACKENDS: usize = 1000;
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
        vip: Ipv4Addr,
        pool: String,
        cidr: Ipv4Net,
    },
    #[error("pool: there is no VIP pool named {pool}")]
    UnknownPool { pool: String },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> SpecError {
    SpecError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Where a valid spec's VIP comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The pool named, or the one holding the requested VIP; `None` when the spec names
    /// neither (a create then takes the default pool, an update keeps its VIP).
    pub pool: Option<(String, Ipv4Net)>,
    pub requested: Option<Ipv4Addr>,
}

/// Checks everything about `spec` that its types do not, first problem first, and
/// resolves its pool and requested VIP against `pools`.
pub fn validate_spec(spec: &LoadBalancerSpec, pools: &VipPools) -> Result<Placement, SpecError> {
    validate_text("name", &spec.name, 1, MAX_NAME_LEN)?;
    if spec.tags.len() > MAX_TAGS {
        return Err(invalid("tags", format!("at most {MAX_TAGS} tags")));
    }
    for (key, value) in &spec.tags {
        validate_text("tags", key, 1, MAX_TAG_KEY_LEN)?;
        if key.contains('=') {
            return Err(invalid(
                format!("tags.{key}"),
                "a tag key may not contain '='",
            ));
        }
        validate_text(&format!("tags.{key}"), value, 0, MAX_TAG_VALUE_LEN)?;
    }
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
    if spec.backends.len() > MAX_BACKENDS {
        return Err(invalid(
            "backends",
            format!("at most {MAX_BACKENDS} backends"),
        ));
    }
    let mut seen_backends = BTreeSet::new();
    for (index, backend) in spec.backends.iter().enumerate() {
        let ip = backend.ip;
        if ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast() {
            return Err(invalid(
                format!("backends[{index}].ip"),
                format!("{ip} is not a unicast address"),
            ));
        }
        if !seen_backends.insert(ip) {
            return Err(invalid(
                format!("backends[{index}].ip"),
                format!("{ip} is listed twice"),
            ));
        }
    }
    if spec.source_ranges.len() > MAX_SOURCE_RANGES {
        return Err(invalid(
            "sourceRanges",
            format!("at most {MAX_SOURCE_RANGES} ranges"),
        ));
    }
    Ok(placement)
}

/// The requested VIP (from `vip` and `vips`, which must agree: one address per family)
/// and the pool it belongs to, or the named pool.
fn placement(spec: &LoadBalancerSpec, pools: &VipPools) -> Result<Placement, SpecError> {
    let mut requested: Option<Ipv4Addr> = None;
    let asked = spec
        .vip
        .map(IpAddr::V4)
        .into_iter()
        .chain(spec.address.vips.iter().copied());
    for vip in asked {
        // Every pool is IPv4: an IPv6 request lies outside them all.
        let IpAddr::V4(v4) = vip else {
            return Err(SpecError::VipOutsidePools { vip });
        };
        match requested {
            Some(earlier) if earlier != v4 => {
                return Err(invalid(
                    "vips",
                    format!("{earlier} and {v4}: at most one address per IP family"),
                ));
            }
            _ => requested = Some(v4),
        }
    }
    let named = match &spec.address.pool {
        Some(name) => {
            if !is_dns1123_label(name) {
                return Err(invalid("pool", format!("{name:?} is not a pool name")));
            }
            let cidr = pools
                .get(name)
                .ok_or_else(|| SpecError::UnknownPool { pool: name.clone() })?;
            Some((name.clone(), cidr))
        }
        None => None,
    };
    let pool = match (requested, named) {
        (Some(vip), Some((name, cidr))) => {
            if !vip_in_pool(vip, cidr) {
                return Err(SpecError::VipOutsidePool {
                    vip,
                    pool: name,
                    cidr,
                });
            }
            Some((name, cidr))
        }
        (Some(vip), None) => {
            let (name, cidr) = pools.pool_of(vip).ok_or(SpecError::VipOutsidePools {
                vip: IpAddr::V4(vip),
            })?;
            Some((name.to_owned(), cidr))
        }
        (None, named) => named,
    };
    Ok(Placement { pool, requested })
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
    use cloud_mock_sdk::{Backend, HealthCheck};

    use super::*;
    use crate::model::tests::spec;

    fn pool() -> VipPools {
        "127.77.0.0/28,blue=127.78.0.0/29".parse().unwrap()
    }

    fn field_of(result: Result<Placement, SpecError>) -> String {
        match result {
            Err(SpecError::Invalid { field, .. }) => field,
            other => panic!("expected an invalid field, got {other:?}"),
        }
    }

    #[test]
    fn a_complete_spec_is_valid_and_names_no_pool() {
        assert_eq!(
            validate_spec(&spec("a"), &pool()),
            Ok(Placement {
                pool: None,
                requested: None
            })
        );
    }

    #[test]
    fn pool_edges_are_not_vips() {
        let default: Ipv4Net = "127.77.0.0/28".parse().unwrap();
        assert!(!vip_in_pool(Ipv4Addr::new(127, 77, 0, 0), default));
        assert!(vip_in_pool(Ipv4Addr::new(127, 77, 0, 1), default));
        assert!(vip_in_pool(Ipv4Addr::new(127, 77, 0, 14), default));
        assert!(!vip_in_pool(Ipv4Addr::new(127, 77, 0, 15), default));
        assert!(!vip_in_pool(Ipv4Addr::new(127, 77, 1, 1), default));
        assert!(vip_in_pool(
            Ipv4Addr::new(10, 0, 0, 1),
            "10.0.0.1/32".parse().unwrap()
        ));
    }

    #[test]
    fn requested_vip_picks_its_pool_and_must_lie_in_a_named_one() {
        let blue_vip = Ipv4Addr::new(127, 78, 0, 1);
        let mut s = spec("a");
        s.address.vips = vec![IpAddr::V4(blue_vip)];
        let placement = validate_spec(&s, &pool()).unwrap();
        assert_eq!(placement.requested, Some(blue_vip));
        assert_eq!(
            placement.pool.map(|(name, _)| name).as_deref(),
            Some("blue")
        );

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
        let mut v6 = spec("a");
        v6.address.vips = vec!["2001:db8::1".parse().unwrap()];
        assert!(matches!(
            validate_spec(&v6, &pool()),
            Err(SpecError::VipOutsidePools { .. })
        ));
        let mut two = spec("a");
        two.vip = Some(Ipv4Addr::new(127, 77, 0, 2));
        two.address.vips = vec![IpAddr::V4(Ipv4Addr::new(127, 77, 0, 3))];
        assert_eq!(field_of(validate_spec(&two, &pool())), "vips");
        two.address.vips = vec![IpAddr::V4(Ipv4Addr::new(127, 77, 0, 2))];
        assert!(validate_spec(&two, &pool()).is_ok(), "vip and vips agree");
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
            ip: Ipv4Addr::UNSPECIFIED,
        };
        assert_eq!(field_of(validate_spec(&s, &pool())), "backends[0].ip");

        s = spec("a");
        s.tags.insert("a=b".into(), "c".into());
        assert_eq!(field_of(validate_spec(&s, &pool())), "tags.a=b");
    }

    #[test]
    fn same_port_is_fine_for_tcp_and_udp() {
        let mut s = spec("a");
        s.listeners[1].port = s.listeners[0].port;
        assert!(validate_spec(&s, &pool()).is_ok());
    }
}
