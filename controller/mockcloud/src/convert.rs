//! Pure translations between the provider-neutral LB description and the mock cloud's
//! API types, and the identity rules: idempotency keys and which LBs we may touch.

use std::net::IpAddr;

use cloud_mock_sdk as sdk;
use cloud_mock_sdk::families;
use sha2::{Digest, Sha256};
use tandem_common::IpFamily;
use tandem_controller::provider::{
    DesiredLoadBalancer, DesiredNodePool, HealthCheck, HealthCheckProtocol, Listener,
    LoadBalancerMode, LoadBalancerPhase, ObservedLoadBalancer, ObservedNodePool, Owner, Protocol,
    TAG_CLUSTER_ID, TAG_SERVICE_UID,
};

fn to_sdk_family(family: IpFamily) -> sdk::IpFamily {
    match family {
        IpFamily::V4 => sdk::IpFamily::Ipv4,
        IpFamily::V6 => sdk::IpFamily::Ipv6,
    }
}

fn from_sdk_family(family: sdk::IpFamily) -> IpFamily {
    match family {
        sdk::IpFamily::Ipv4 => IpFamily::V4,
        sdk::IpFamily::Ipv6 => IpFamily::V6,
    }
}

fn to_sdk_mode(mode: LoadBalancerMode) -> sdk::Mode {
    match mode {
        LoadBalancerMode::Proxy => sdk::Mode::Proxy,
        LoadBalancerMode::Passthrough => sdk::Mode::Passthrough,
    }
}

fn from_sdk_mode(mode: sdk::Mode) -> LoadBalancerMode {
    match mode {
        sdk::Mode::Proxy => LoadBalancerMode::Proxy,
        sdk::Mode::Passthrough => LoadBalancerMode::Passthrough,
    }
}

fn to_sdk_listener(l: &Listener) -> sdk::Listener {
    sdk::Listener {
        protocol: match l.protocol {
            Protocol::Tcp => sdk::Protocol::Tcp,
            Protocol::Udp => sdk::Protocol::Udp,
        },
        port: l.port,
        backend_port: l.backend_port,
        health_check: l.health_check.as_ref().map(|h| sdk::HealthCheck {
            protocol: match h.protocol {
                HealthCheckProtocol::Tcp => sdk::HealthCheckProtocol::Tcp,
                HealthCheckProtocol::Http => sdk::HealthCheckProtocol::Http,
            },
            port: h.port,
            path: h.path.clone(),
        }),
    }
}

fn from_sdk_listener(l: &sdk::Listener) -> Listener {
    Listener {
        protocol: match l.protocol {
            sdk::Protocol::Tcp => Protocol::Tcp,
            sdk::Protocol::Udp => Protocol::Udp,
        },
        port: l.port,
        backend_port: l.backend_port,
        health_check: l.health_check.as_ref().map(|h| HealthCheck {
            protocol: match h.protocol {
                sdk::HealthCheckProtocol::Tcp => HealthCheckProtocol::Tcp,
                sdk::HealthCheckProtocol::Http => HealthCheckProtocol::Http,
            },
            port: h.port,
            path: h.path.clone(),
        }),
    }
}

/// The VIPs an update keeps where none is requested: the assigned ones of the families
/// the LB keeps, unless the LB moves to another pool (then the cloud allocates from the
/// new pool) or leaves the sharing key it had (then it leaves that key's shared VIPs, as
/// MetalLB re-allocates; the cloud gives it the new key's VIPs or fresh ones). Taking a
/// key when it had none keeps them.
pub fn kept_vips(
    desired: &DesiredLoadBalancer,
    vips: &[IpAddr],
    pool: Option<&str>,
    sharing_key: Option<&str>,
) -> Vec<IpAddr> {
    let moves_pool = desired
        .address
        .pool
        .as_deref()
        .is_some_and(|wanted| pool.is_some_and(|current| current != wanted));
    let leaves_key =
        sharing_key.is_some_and(|current| desired.address.sharing_key.as_deref() != Some(current));
    if moves_pool || leaves_key {
        return Vec::new();
    }
    vips.iter()
        .copied()
        .filter(|vip| desired.ip_families.contains(&IpFamily::of(*vip)))
        .collect()
}

/// The SDK spec for `desired`, with one VIP per family: the requested one, else the one
/// in `kept` (see `kept_vips`), else none (the cloud allocates it).
pub fn to_sdk_spec(desired: &DesiredLoadBalancer, kept: &[IpAddr]) -> families::LoadBalancerSpec {
    let address = &desired.address;
    families::LoadBalancerSpec {
        name: desired.name(),
        tags: desired.owner.tags(),
        mode: to_sdk_mode(desired.mode),
        ip_families: desired
            .ip_families
            .iter()
            .copied()
            .map(to_sdk_family)
            .collect(),
        vip: None,
        listeners: desired.listeners.iter().map(to_sdk_listener).collect(),
        // On a node pool the pool carries the backends.
        backends: match desired.node_pool {
            Some(_) => Vec::new(),
            None => desired
                .backends
                .iter()
                .map(|ip| families::Backend { ip: *ip })
                .collect(),
        },
        node_pool: desired.node_pool.clone(),
        source_ranges: desired.source_ranges.clone(),
        address: sdk::AddressRequest {
            pool: address.pool.clone(),
            vips: desired
                .ip_families
                .iter()
                .filter_map(|family| {
                    address.requested_of(*family).or_else(|| {
                        kept.iter()
                            .copied()
                            .find(|vip| IpFamily::of(*vip) == *family)
                    })
                })
                .collect(),
            sharing_key: address.sharing_key.clone(),
        },
    }
}

/// The LB's VIPs in family order. A cloud from before IP families answers with `vip`
/// alone, the IPv4 one.
fn assigned_vips(lb: &families::LoadBalancer) -> Vec<IpAddr> {
    if lb.vips().is_empty() {
        lb.spec.vip.map(IpAddr::V4).into_iter().collect()
    } else {
        lb.vips().to_vec()
    }
}

/// The SDK spec of the cluster's node pool.
pub fn to_sdk_node_pool(desired: &DesiredNodePool) -> sdk::NodePoolSpec {
    sdk::NodePoolSpec {
        tags: desired.tags(),
        backends: desired
            .backends
            .iter()
            .map(|ip| families::Backend { ip: *ip })
            .collect(),
    }
}

pub fn observe_node_pool(pool: &sdk::NodePool) -> ObservedNodePool {
    ObservedNodePool {
        name: pool.name.clone(),
        version: pool.version,
        tags: pool.tags.clone(),
        backends: pool.backends.iter().map(|b| b.ip).collect(),
        load_balancers: pool.load_balancers.len(),
    }
}

pub fn observe(lb: &families::LoadBalancer) -> ObservedLoadBalancer {
    ObservedLoadBalancer {
        id: lb.id.clone(),
        version: lb.version,
        name: lb.spec.name.clone(),
        owner: Owner::from_tags(&lb.spec.tags),
        phase: match lb.state {
            sdk::State::Provisioning => LoadBalancerPhase::Provisioning,
            sdk::State::Active => LoadBalancerPhase::Active,
            sdk::State::Deleting => LoadBalancerPhase::Deleting,
        },
        ip_families: lb
            .spec
            .ip_families
            .iter()
            .copied()
            .map(from_sdk_family)
            .collect(),
        vips: assigned_vips(lb),
        hostname: None,
        pool: lb.spec.address.pool.clone(),
        sharing_key: lb.spec.address.sharing_key.clone(),
        mode: from_sdk_mode(lb.spec.mode),
        listeners: lb.spec.listeners.iter().map(from_sdk_listener).collect(),
        // On a node pool the spec names the pool and the health list its members.
        backends: match lb.spec.node_pool {
            Some(_) => lb.health.iter().map(|b| b.ip).collect(),
            None => lb.spec.backends.iter().map(|b| b.ip).collect(),
        },
        node_pool: lb.spec.node_pool.clone(),
        source_ranges: lb.spec.source_ranges.clone(),
    }
}

/// What identifies one create: its `Idempotency-Key` and the id it asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateRequest {
    pub idempotency_key: String,
    /// `lb-` and the request's digest: a DNS label, as the edge wants its ids.
    pub id: String,
}

/// The create of `spec` for the Service `uid`, replacing the LB `replaces` (if any): both
/// its key and its id are digests of all three, so re-creating after an LB vanished is a
/// new request with a new id, while a retry of the same create is the same request.
pub fn create_request(
    spec: &families::LoadBalancerSpec,
    uid: &str,
    replaces: Option<&str>,
) -> CreateRequest {
    let mut hasher = Sha256::new();
    hasher.update(uid.as_bytes());
    hasher.update([0]);
    hasher.update(serde_json::to_vec(spec).unwrap_or_default());
    hasher.update([0]);
    hasher.update(replaces.unwrap_or_default().as_bytes());
    let digest = data_encoding::BASE32_NOPAD
        .encode(&hasher.finalize())
        .to_lowercase();
    let digest = &digest[..26];
    CreateRequest {
        idempotency_key: format!("{uid}-{digest}"),
        id: format!("lb-{digest}"),
    }
}

/// Whether an LB found by id may be treated as the owner's: its tags name the owner's
/// cluster, or it carries no cluster tag but the owner's deterministic name.
pub fn may_touch(lb: &families::LoadBalancer, owner: &Owner) -> bool {
    match lb.spec.tags.get(TAG_CLUSTER_ID) {
        Some(cluster) => cluster == owner.cluster_id.as_str(),
        None => lb.spec.name == owner.load_balancer_name(),
    }
}

pub fn belongs_to(lb: &families::LoadBalancer, owner: &Owner) -> bool {
    lb.spec.tags.get(TAG_SERVICE_UID) == Some(&owner.uid)
        || lb.spec.name == owner.load_balancer_name()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use tandem_controller::provider::AddressRequest;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn desired() -> DesiredLoadBalancer {
        DesiredLoadBalancer {
            owner: Owner {
                cluster_id: "c1".parse().unwrap(),
                namespace: "default".into(),
                name: "web".into(),
                uid: "11111111-2222-3333-4444-555555555555".into(),
            },
            mode: LoadBalancerMode::Passthrough,
            ip_families: vec![IpFamily::V4],
            address: AddressRequest {
                pool: Some("blue".into()),
                requested: vec![],
                sharing_key: Some("dns".into()),
            },
            listeners: vec![Listener {
                protocol: Protocol::Udp,
                port: 53,
                backend_port: 30053,
                health_check: Some(HealthCheck {
                    protocol: HealthCheckProtocol::Http,
                    port: 10256,
                    path: Some("/healthz".into()),
                }),
            }],
            backends: BTreeSet::from([ip("198.18.0.11")]),
            node_pool: None,
            source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
        }
    }

    fn dual() -> DesiredLoadBalancer {
        let mut d = desired();
        d.ip_families = vec![IpFamily::V6, IpFamily::V4];
        d.backends.insert(ip("2001:db8:18::11"));
        d.source_ranges.push("2001:db8:203::/64".parse().unwrap());
        d
    }

    /// The LB the cloud answers for `spec`: the VIPs it asks for, else 198.51.100.3 and
    /// 2001:db8:51:100::3.
    fn lb_from(spec: families::LoadBalancerSpec) -> families::LoadBalancer {
        let vips: Vec<IpAddr> = spec
            .ip_families
            .iter()
            .map(|family| {
                let asked = spec
                    .address
                    .vips
                    .iter()
                    .copied()
                    .find(|v| sdk::IpFamily::of(v) == *family);
                asked.unwrap_or(match family {
                    sdk::IpFamily::Ipv4 => ip("198.51.100.3"),
                    sdk::IpFamily::Ipv6 => ip("2001:db8:51:100::3"),
                })
            })
            .collect();
        families::LoadBalancer {
            id: "lb-1".into(),
            spec: families::LoadBalancerSpec {
                vip: vips.iter().find_map(|v| match v {
                    IpAddr::V4(v4) => Some(*v4),
                    IpAddr::V6(_) => None,
                }),
                address: sdk::AddressRequest {
                    vips,
                    ..spec.address.clone()
                },
                ..spec
            },
            state: sdk::State::Active,
            version: 1,
            health: vec![],
        }
    }

    #[test]
    fn spec_round_trips_without_drift() {
        for d in [desired(), dual()] {
            let observed = observe(&lb_from(to_sdk_spec(&d, &[])));
            assert!(observed.drift(&d).is_empty(), "{:?}", observed.drift(&d));
            assert_eq!(observed.owner.as_ref(), Some(&d.owner));
            assert_eq!(observed.vip_of(IpFamily::V4), Some(ip("198.51.100.3")));
            assert_eq!(observed.phase, LoadBalancerPhase::Active);
        }
        let observed = observe(&lb_from(to_sdk_spec(&dual(), &[])));
        assert_eq!(
            observed.vips,
            [ip("2001:db8:51:100::3"), ip("198.51.100.3")]
        );
    }

    #[test]
    fn an_answer_from_before_families_is_read_as_ipv4() {
        let mut old = lb_from(to_sdk_spec(&desired(), &[]));
        old.spec.address.vips.clear();
        let observed = observe(&old);
        assert_eq!(observed.vips, [ip("198.51.100.3")]);
        assert!(observed.drift(&desired()).is_empty());
    }

    #[test]
    fn the_spec_carries_families_mixed_backends_and_ranges() {
        let json = serde_json::to_value(to_sdk_spec(&dual(), &[])).unwrap();
        assert_eq!(json["ipFamilies"], serde_json::json!(["IPv6", "IPv4"]));
        assert_eq!(json["backends"].as_array().unwrap().len(), 2);
        assert_eq!(json["sourceRanges"].as_array().unwrap().len(), 2);
        assert!(json.get("vip").is_none() && json.get("vips").is_none());
    }

    #[test]
    fn requested_vips_win_over_kept_ones_per_family() {
        let mut d = dual();
        let kept = [ip("198.51.100.3"), ip("2001:db8:51:100::3")];
        // In the LB's family order, whatever order they were kept in.
        assert_eq!(
            to_sdk_spec(&d, &kept).address.vips,
            [ip("2001:db8:51:100::3"), ip("198.51.100.3")]
        );
        d.address.requested = vec![ip("2001:db8:51:100::9")];
        let spec = to_sdk_spec(&d, &kept);
        assert_eq!(
            spec.address.vips,
            [ip("2001:db8:51:100::9"), ip("198.51.100.3")]
        );
        assert_eq!(spec.vip, None);
        assert_eq!(spec.address.pool.as_deref(), Some("blue"));
        assert_eq!(spec.address.sharing_key.as_deref(), Some("dns"));
    }

    #[test]
    fn a_downgrade_keeps_the_vip_of_the_family_that_stays() {
        let vips = [ip("2001:db8:51:100::3"), ip("198.51.100.3")];
        assert_eq!(
            kept_vips(&desired(), &vips, Some("blue"), Some("dns")),
            [ip("198.51.100.3")]
        );
        assert_eq!(kept_vips(&dual(), &vips, Some("blue"), Some("dns")), vips);
    }

    #[test]
    fn moving_to_another_pool_gives_up_the_vips() {
        let d = dual();
        let vips = [ip("2001:db8:51:100::3"), ip("198.51.100.3")];
        assert_eq!(kept_vips(&d, &vips, Some("blue"), Some("dns")), vips);
        assert!(kept_vips(&d, &vips, Some("default"), Some("dns")).is_empty());
        let mut any_pool = dual();
        any_pool.address.pool = None;
        assert_eq!(
            kept_vips(&any_pool, &vips, Some("default"), Some("dns")),
            vips
        );
    }

    #[test]
    fn leaving_a_sharing_key_gives_up_its_vips_and_taking_one_keeps_them() {
        let mut d = desired();
        d.address.pool = None;
        let vips = [ip("198.51.100.3")];
        d.address.sharing_key = None;
        assert!(kept_vips(&d, &vips, None, Some("team-a")).is_empty());
        d.address.sharing_key = Some("team-b".to_owned());
        assert!(kept_vips(&d, &vips, None, Some("team-a")).is_empty());
        assert_eq!(kept_vips(&d, &vips, None, None), vips);
        d.address.sharing_key = Some("team-a".to_owned());
        assert_eq!(kept_vips(&d, &vips, None, Some("team-a")), vips);
    }

    #[test]
    fn a_create_request_is_stable_and_distinguishes_replacements() {
        let spec = to_sdk_spec(&desired(), &[]);
        let uid = &desired().owner.uid;
        let a = create_request(&spec, uid, None);
        assert_eq!(a, create_request(&spec, uid, None));
        let mut other = spec.clone();
        other.listeners[0].port = 54;
        for different in [
            create_request(&spec, uid, Some("lb-1")),
            create_request(&other, uid, None),
            create_request(&to_sdk_spec(&dual(), &[]), uid, None),
        ] {
            assert_ne!(a.idempotency_key, different.idempotency_key);
            assert_ne!(a.id, different.id);
        }
        assert!(a.idempotency_key.starts_with(uid.as_str()));
        assert!(a.idempotency_key.len() < 100);
        assert!(tandem_common::is_dns1123_label(&a.id), "{}", a.id);
    }

    #[test]
    fn foreign_cluster_lbs_are_untouchable() {
        let d = desired();
        let ours = lb_from(to_sdk_spec(&d, &[]));
        assert!(may_touch(&ours, &d.owner));
        let mut foreign = ours.clone();
        foreign
            .spec
            .tags
            .insert(TAG_CLUSTER_ID.into(), "other".into());
        assert!(!may_touch(&foreign, &d.owner));
        let mut untagged = ours.clone();
        untagged.spec.tags.clear();
        assert!(may_touch(&untagged, &d.owner));
        untagged.spec.name = "someone-elses".into();
        assert!(!may_touch(&untagged, &d.owner));
    }
}
