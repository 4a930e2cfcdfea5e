//! Pure translations between the provider-neutral LB description and the mock cloud's
//! API types, and the identity rules: idempotency keys and which LBs we may touch.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use cloud_mock_sdk as sdk;
use sha2::{Digest, Sha256};

use crate::provider::{
    DesiredLoadBalancer, HealthCheck, HealthCheckProtocol, Listener, LoadBalancerMode,
    LoadBalancerPhase, ObservedLoadBalancer, Owner, Protocol, TAG_CLUSTER_ID, TAG_SERVICE_UID,
};

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

pub fn backends(ips: &BTreeSet<Ipv4Addr>) -> Vec<sdk::Backend> {
    ips.iter().map(|ip| sdk::Backend { ip: *ip }).collect()
}

/// The VIP an update keeps when none is requested: the assigned one, unless the LB moves
/// to another pool (then the cloud allocates from the new pool) or leaves the sharing key
/// it had (then it leaves that key's shared VIP, as MetalLB re-allocates; the cloud gives
/// it the new key's VIP or a fresh one). Taking a key when it had none keeps the VIP.
pub fn kept_vip(
    desired: &DesiredLoadBalancer,
    vip: Option<Ipv4Addr>,
    pool: Option<&str>,
    sharing_key: Option<&str>,
) -> Option<Ipv4Addr> {
    let moves_pool = desired
        .address
        .pool
        .as_deref()
        .is_some_and(|wanted| pool.is_some_and(|current| current != wanted));
    let leaves_key =
        sharing_key.is_some_and(|current| desired.address.sharing_key.as_deref() != Some(current));
    if moves_pool || leaves_key { None } else { vip }
}

/// The SDK spec for `desired`; `current_vip` keeps an assigned VIP when none is requested
/// (see `kept_vip`).
pub fn to_sdk_spec(
    desired: &DesiredLoadBalancer,
    current_vip: Option<Ipv4Addr>,
) -> sdk::LoadBalancerSpec {
    let address = &desired.address;
    sdk::LoadBalancerSpec {
        name: desired.name(),
        tags: desired.owner.tags(),
        mode: to_sdk_mode(desired.mode),
        vip: address.requested_ipv4().or(current_vip),
        listeners: desired.listeners.iter().map(to_sdk_listener).collect(),
        backends: backends(&desired.backends),
        source_ranges: desired.source_ranges.clone(),
        address: sdk::AddressRequest {
            pool: address.pool.clone(),
            // The IPv4 address travels as `vip`; the others (other families) here.
            vips: address
                .requested
                .iter()
                .filter(|ip| ip.is_ipv6())
                .copied()
                .collect(),
            sharing_key: address.sharing_key.clone(),
        },
    }
}

pub fn observe(lb: &sdk::LoadBalancer) -> ObservedLoadBalancer {
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
        vip: lb.vip(),
        pool: lb.spec.address.pool.clone(),
        sharing_key: lb.spec.address.sharing_key.clone(),
        mode: from_sdk_mode(lb.spec.mode),
        listeners: lb.spec.listeners.iter().map(from_sdk_listener).collect(),
        backends: lb.spec.backends.iter().map(|b| b.ip).collect(),
        source_ranges: lb.spec.source_ranges.clone(),
    }
}

/// The `Idempotency-Key` of a create: the Service UID, the spec, and the LB this create
/// replaces (if any), so re-creating after an LB vanished is a new request, while a retry
/// of the same create is not.
pub fn idempotency_key(spec: &sdk::LoadBalancerSpec, uid: &str, replaces: Option<&str>) -> String {
    let mut hasher = Sha256::new();
    hasher.update(uid.as_bytes());
    hasher.update([0]);
    hasher.update(serde_json::to_vec(spec).unwrap_or_default());
    hasher.update([0]);
    hasher.update(replaces.unwrap_or_default().as_bytes());
    let digest = data_encoding::BASE32_NOPAD.encode(&hasher.finalize());
    format!("{uid}-{}", &digest[..26]).to_lowercase()
}

/// Whether an LB found by id may be treated as the owner's: its tags name the owner's
/// cluster, or it carries no cluster tag but the owner's deterministic name.
pub fn may_touch(lb: &sdk::LoadBalancer, owner: &Owner) -> bool {
    match lb.spec.tags.get(TAG_CLUSTER_ID) {
        Some(cluster) => cluster == owner.cluster_id.as_str(),
        None => lb.spec.name == owner.load_balancer_name(),
    }
}

pub fn belongs_to(lb: &sdk::LoadBalancer, owner: &Owner) -> bool {
    lb.spec.tags.get(TAG_SERVICE_UID) == Some(&owner.uid)
        || lb.spec.name == owner.load_balancer_name()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::AddressRequest;

    fn desired() -> DesiredLoadBalancer {
        DesiredLoadBalancer {
            owner: Owner {
                cluster_id: "c1".parse().unwrap(),
                namespace: "default".into(),
                name: "web".into(),
                uid: "11111111-2222-3333-4444-555555555555".into(),
            },
            mode: LoadBalancerMode::Passthrough,
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
            backends: BTreeSet::from([Ipv4Addr::new(198, 18, 0, 11)]),
            source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
        }
    }

    fn lb_from(spec: sdk::LoadBalancerSpec) -> sdk::LoadBalancer {
        sdk::LoadBalancer {
            id: "lb-1".into(),
            spec: sdk::LoadBalancerSpec {
                vip: Some(Ipv4Addr::new(198, 51, 100, 3)),
                ..spec
            },
            state: sdk::State::Active,
            version: 1,
            health: vec![],
        }
    }

    #[test]
    fn spec_round_trips_without_drift() {
        let d = desired();
        let observed = observe(&lb_from(to_sdk_spec(&d, None)));
        assert!(observed.drift(&d).is_empty(), "{:?}", observed.drift(&d));
        assert_eq!(observed.owner.as_ref(), Some(&d.owner));
        assert_eq!(observed.vip, Some(Ipv4Addr::new(198, 51, 100, 3)));
        assert_eq!(observed.phase, LoadBalancerPhase::Active);
    }

    #[test]
    fn requested_ip_wins_over_current_vip() {
        let mut d = desired();
        let current = Some(Ipv4Addr::new(198, 51, 100, 3));
        assert_eq!(to_sdk_spec(&d, current).vip, current);
        let requested = Ipv4Addr::new(198, 51, 100, 9);
        d.address.requested = vec![requested.into()];
        let spec = to_sdk_spec(&d, current);
        assert_eq!(spec.vip, Some(requested));
        assert!(spec.address.vips.is_empty());
        assert_eq!(spec.address.pool.as_deref(), Some("blue"));
        assert_eq!(spec.address.sharing_key.as_deref(), Some("dns"));
    }

    #[test]
    fn moving_to_another_pool_gives_up_the_vip() {
        let d = desired();
        let vip = Some(Ipv4Addr::new(198, 51, 100, 3));
        assert_eq!(kept_vip(&d, vip, Some("blue"), None), vip);
        assert_eq!(kept_vip(&d, vip, Some("default"), None), None);
        let mut any_pool = desired();
        any_pool.address.pool = None;
        assert_eq!(kept_vip(&any_pool, vip, Some("default"), None), vip);
    }

    #[test]
    fn leaving_a_sharing_key_gives_up_its_vip_and_taking_one_keeps_it() {
        let mut d = desired();
        d.address.pool = None;
        let vip = Some(Ipv4Addr::new(198, 51, 100, 3));
        assert_eq!(kept_vip(&d, vip, None, Some("team-a")), None);
        d.address.sharing_key = Some("team-b".to_owned());
        assert_eq!(kept_vip(&d, vip, None, Some("team-a")), None);
        assert_eq!(kept_vip(&d, vip, None, None), vip);
        d.address.sharing_key = Some("team-a".to_owned());
        assert_eq!(kept_vip(&d, vip, None, Some("team-a")), vip);
    }

    #[test]
    fn idempotency_key_is_stable_and_distinguishes_replacements() {
        let spec = to_sdk_spec(&desired(), None);
        let uid = &desired().owner.uid;
        let a = idempotency_key(&spec, uid, None);
        assert_eq!(a, idempotency_key(&spec, uid, None));
        assert_ne!(a, idempotency_key(&spec, uid, Some("lb-1")));
        let mut other = spec.clone();
        other.listeners[0].port = 54;
        assert_ne!(a, idempotency_key(&other, uid, None));
        assert!(a.starts_with(uid.as_str()));
        assert!(a.len() < 100);
    }

    #[test]
    fn foreign_cluster_lbs_are_untouchable() {
        let d = desired();
        let ours = lb_from(to_sdk_spec(&d, None));
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
