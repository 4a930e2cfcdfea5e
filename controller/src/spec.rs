//! Service → desired load balancer: which Services are ours, and what their LB must look
//! like (IP families, listeners, health checks, mode, source ranges, address pool,
//! requested addresses, sharing key), from the Service spec, the annotations under its
//! provider's prefix ([`AnnotationKeys`]; the mock cloud's is
//! `service.beta.kubernetes.io/mockcloud-load-balancer-*`) and the address pool its
//! Namespace or the controller names.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Namespace, Service};
use tandem_common::{IpFamily, is_dns1123_label};

use crate::provider::{
    AddressRequest, ClusterId, DesiredLoadBalancer, HealthCheck, HealthCheckProtocol, Listener,
    LoadBalancerMode, Owner, Profile, Protocol,
};

/// The annotation keys of one provider: its prefix (e.g.
/// `service.beta.kubernetes.io/mockcloud-load-balancer-`, see
/// [`crate::provider::Profile::annotation_prefix`]) followed by each name below.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnotationKeys {
    pub prefix: String,
    /// The LB id, persisted right after create so a restart finds the LB by id.
    pub lb_id: String,
    pub mode: String,
    pub hc_protocol: String,
    pub hc_path: String,
    pub hc_port: String,
    /// Requested addresses: a comma-separated list, at most one per IP family.
    pub requested_ip: String,
    /// The address pool, on the Service or (as the default of its Services) on a Namespace.
    pub address_pool: String,
    /// The sharing key: Services with the same key may share one address (MetalLB's
    /// `allow-shared-ip`).
    pub shared_ip: String,
}

impl AnnotationKeys {
    /// The annotations a provider reads, under its prefix.
    pub fn of(profile: &Profile) -> Self {
        Self::with_prefix(profile.annotation_prefix)
    }

    pub fn with_prefix(prefix: &str) -> Self {
        let key = |name: &str| format!("{prefix}{name}");
        Self {
            prefix: prefix.to_owned(),
            lb_id: key("id"),
            mode: key("mode"),
            hc_protocol: key("health-check-protocol"),
            hc_path: key("health-check-path"),
            hc_port: key("health-check-port"),
            requested_ip: key("ip"),
            address_pool: key("address-pool"),
            shared_ip: key("allow-shared-ip"),
        }
    }

    fn known(&self) -> [&str; 8] {
        [
            &self.lb_id,
            &self.mode,
            &self.hc_protocol,
            &self.hc_path,
            &self.hc_port,
            &self.requested_ip,
            &self.address_pool,
            &self.shared_ip,
        ]
    }

    /// The LB id persisted on the Service, if any.
    pub fn persisted_id<'a>(&self, svc: &'a Service) -> Option<&'a str> {
        svc.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(&self.lb_id))
            .map(String::as_str)
            .filter(|id| !id.is_empty())
    }

    /// The address pool a Namespace names as the default of its Services.
    pub fn namespace_pool<'a>(&self, namespace: &'a Namespace) -> Option<&'a str> {
        self.pool_annotation(namespace.metadata.annotations.as_ref())
    }

    /// The address-pool annotation of a Service or a Namespace; empty counts as unset.
    fn pool_annotation<'a>(
        &self,
        annotations: Option<&'a BTreeMap<String, String>>,
    ) -> Option<&'a str> {
        annotations
            .and_then(|a| a.get(&self.address_pool))
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
    }
}

/// The upstream annotation, honoured when `spec.loadBalancerSourceRanges` is empty.
pub const ANNOTATION_SOURCE_RANGES: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";

pub const HEALTHZ_PATH: &str = "/healthz";

/// A Service we cannot turn into an LB; reported as a Warning Event and a condition.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum SpecError {
    #[error("Service has no metadata.{0}")]
    MissingMetadata(&'static str),
    #[error("annotation {annotation}: {value:?} is not valid: {reason}")]
    BadAnnotation {
        annotation: String,
        value: String,
        reason: &'static str,
    },
    #[error(
        "unknown annotation {0} (known: mode, health-check-protocol, health-check-path, health-check-port, ip, address-pool, allow-shared-ip)"
    )]
    UnknownAnnotation(String),
    #[error("Service has no ports")]
    NoPorts,
    #[error("port {port}: protocol {protocol} is not supported (TCP and UDP are)")]
    UnsupportedProtocol { port: i32, protocol: String },
    #[error("port {0} is out of range")]
    PortOutOfRange(i32),
    #[error("port {0} has no nodePort allocated (needed in proxy mode)")]
    MissingNodePort(i32),
    #[error(
        "port {port} has no nodePort because spec.allocateLoadBalancerNodePorts is false, and proxy mode forwards to node ports; set annotation {mode_annotation}: passthrough to serve it without them"
    )]
    NodePortsNotAllocated { port: i32, mode_annotation: String },
    #[error("externalTrafficPolicy Local but no healthCheckNodePort allocated")]
    MissingHealthCheckNodePort,
    #[error("loadBalancerSourceRanges entry {0:?} is not a CIDR")]
    BadSourceRange(String),
    #[error("requested address {0:?} is not an IP address")]
    BadRequestedIp(String),
    #[error("requested addresses {first} and {second}: at most one address per IP family")]
    TwoAddressesOfOneFamily { first: IpAddr, second: IpAddr },
    #[error(
        "spec.loadBalancerIP {spec} is not among the addresses of annotation {key} ({annotation}); set one of them, or make them agree"
    )]
    ConflictingRequestedIp {
        spec: IpAddr,
        key: String,
        annotation: String,
    },
    #[error(
        "spec.ipFamilies {0:?} cannot be served: this controller serves IPv4, IPv6, or one of each"
    )]
    UnsupportedIpFamilies(Vec<String>),
    #[error(
        "requested address {address} is {family}, but the Service's ipFamilies are [{families}]: request addresses of its families only"
    )]
    RequestedFamilyNotInService {
        address: IpAddr,
        family: IpFamily,
        families: String,
    },
    #[error(
        "address pool {pool:?} (from {key} on the Service or its Namespace, or --default-address-pool) is not a pool name: want up to 63 characters of [a-z0-9-], not starting or ending with -"
    )]
    BadPoolName { pool: String, key: String },
}

impl SpecError {
    pub fn category(&self) -> &'static str {
        "invalid_configuration"
    }
}

/// Which Services this controller manages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassFilter {
    /// Our `spec.loadBalancerClass`.
    pub class: String,
    /// Whether Services without a class are ours (the default cloud provider's role).
    pub claim_unclassed: bool,
}

impl ClassFilter {
    /// Whether the Service's class names us. Services of other classes are never touched,
    /// whatever their type.
    pub fn class_is_ours(&self, svc: &Service) -> bool {
        match svc
            .spec
            .as_ref()
            .and_then(|s| s.load_balancer_class.as_deref())
        {
            None => self.claim_unclassed,
            Some(class) => class == self.class,
        }
    }
}

/// What to do with a Service that has `spec.allocateLoadBalancerNodePorts: false` and
/// does not choose a mode: passthrough needs no node ports, proxy mode does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WithoutNodePorts {
    /// Serve it in passthrough mode.
    Passthrough,
    /// Refuse it with a condition and an Event (the mode annotation can still ask for
    /// passthrough).
    Refuse,
}

fn allocates_node_ports(svc: &Service) -> bool {
    svc.spec
        .as_ref()
        .and_then(|s| s.allocate_load_balancer_node_ports)
        != Some(false)
}

pub fn is_load_balancer(svc: &Service) -> bool {
    svc.spec.as_ref().and_then(|s| s.type_.as_deref()) == Some("LoadBalancer")
}

pub fn is_being_deleted(svc: &Service) -> bool {
    svc.metadata.deletion_timestamp.is_some()
}

pub fn owner_of(svc: &Service, cluster_id: &ClusterId) -> Result<Owner, SpecError> {
    Ok(Owner {
        cluster_id: cluster_id.clone(),
        namespace: svc
            .metadata
            .namespace
            .clone()
            .ok_or(SpecError::MissingMetadata("namespace"))?,
        name: svc
            .metadata
            .name
            .clone()
            .ok_or(SpecError::MissingMetadata("name"))?,
        uid: svc
            .metadata
            .uid
            .clone()
            .ok_or(SpecError::MissingMetadata("uid"))?,
    })
}

fn annotation<'a>(svc: &'a Service, key: &str) -> Option<&'a str> {
    svc.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(|v| v.trim())
}

fn bad(annotation: &str, value: &str, reason: &'static str) -> SpecError {
    SpecError::BadAnnotation {
        annotation: annotation.to_owned(),
        value: value.to_owned(),
        reason,
    }
}

fn parse_mode(
    svc: &Service,
    keys: &AnnotationKeys,
    without_node_ports: WithoutNodePorts,
) -> Result<LoadBalancerMode, SpecError> {
    match annotation(svc, &keys.mode) {
        None if !allocates_node_ports(svc)
            && without_node_ports == WithoutNodePorts::Passthrough =>
        {
            Ok(LoadBalancerMode::Passthrough)
        }
        None => Ok(LoadBalancerMode::Proxy),
        Some(v) if v.eq_ignore_ascii_case("proxy") => Ok(LoadBalancerMode::Proxy),
        Some(v) if v.eq_ignore_ascii_case("passthrough") => Ok(LoadBalancerMode::Passthrough),
        Some(v) => Err(bad(&keys.mode, v, "want proxy or passthrough")),
    }
}

fn parse_ip(raw: &str) -> Result<IpAddr, SpecError> {
    raw.trim()
        .parse::<IpAddr>()
        .map_err(|_| SpecError::BadRequestedIp(raw.to_owned()))
}

/// The requested addresses, IPv4 first: our annotation's list (one address per family),
/// or `spec.loadBalancerIP` (deprecated upstream, still honoured). When both are set the
/// annotation wins, and the spec's address must be one of its addresses: a Service that
/// asks for two different addresses of one family is refused, not guessed at.
pub fn requested_ips(svc: &Service, keys: &AnnotationKeys) -> Result<Vec<IpAddr>, SpecError> {
    let from_spec = svc
        .spec
        .as_ref()
        .and_then(|s| s.load_balancer_ip.as_deref())
        .filter(|v| !v.trim().is_empty())
        .map(parse_ip)
        .transpose()?;
    let Some(raw) = annotation(svc, &keys.requested_ip).filter(|v| !v.is_empty()) else {
        return Ok(from_spec.into_iter().collect());
    };
    let mut listed: Vec<IpAddr> = Vec::new();
    for ip in raw
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(parse_ip)
    {
        let ip = ip?;
        if let Some(first) = listed.iter().find(|l| l.is_ipv4() == ip.is_ipv4()) {
            return Err(SpecError::TwoAddressesOfOneFamily {
                first: *first,
                second: ip,
            });
        }
        listed.push(ip);
    }
    listed.sort_by_key(IpAddr::is_ipv6);
    match from_spec {
        Some(spec) if !listed.contains(&spec) => Err(SpecError::ConflictingRequestedIp {
            spec,
            key: keys.requested_ip.clone(),
            annotation: raw.to_owned(),
        }),
        _ => Ok(listed),
    }
}

/// Where the LB's address comes from: the Service's pool annotation, else `inherited_pool`
/// (its Namespace's, else the controller's default); the requested addresses; the sharing key.
pub fn address_request(
    svc: &Service,
    keys: &AnnotationKeys,
    inherited_pool: Option<&str>,
) -> Result<AddressRequest, SpecError> {
    let pool = keys
        .pool_annotation(svc.metadata.annotations.as_ref())
        .or(inherited_pool);
    if let Some(pool) = pool.filter(|p| !is_dns1123_label(p)) {
        return Err(SpecError::BadPoolName {
            pool: pool.to_owned(),
            key: keys.address_pool.clone(),
        });
    }
    Ok(AddressRequest {
        pool: pool.map(str::to_owned),
        requested: requested_ips(svc, keys)?,
        sharing_key: annotation(svc, &keys.shared_ip)
            .filter(|v| !v.is_empty())
            .map(str::to_owned),
    })
}

/// The Service's `loadBalancerSourceRanges` (else the annotation's), of every family.
fn source_ranges(svc: &Service) -> Result<Vec<IpNet>, SpecError> {
    let from_spec: Vec<String> = svc
        .spec
        .as_ref()
        .and_then(|s| s.load_balancer_source_ranges.clone())
        .unwrap_or_default();
    let raw: Vec<String> = if from_spec.is_empty() {
        annotation(svc, ANNOTATION_SOURCE_RANGES)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    } else {
        from_spec
    };
    let mut ranges = raw
        .iter()
        .map(|r| {
            r.trim()
                .parse::<IpNet>()
                .map(|net| net.trunc())
                .map_err(|_| SpecError::BadSourceRange(r.clone()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    ranges.sort();
    ranges.dedup();
    Ok(ranges)
}

fn health_check(svc: &Service, keys: &AnnotationKeys) -> Result<HealthCheck, SpecError> {
    let spec = svc.spec.as_ref();
    let local = spec.and_then(|s| s.external_traffic_policy.as_deref()) == Some("Local");
    let default_port = if local {
        let port = spec
            .and_then(|s| s.health_check_node_port)
            .ok_or(SpecError::MissingHealthCheckNodePort)?;
        u16::try_from(port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or(SpecError::PortOutOfRange(port))?
    } else {
        tandem_common::NODE_HEALTHZ_PORT
    };
    let protocol = match annotation(svc, &keys.hc_protocol) {
        None => HealthCheckProtocol::Http,
        Some(v) if v.eq_ignore_ascii_case("http") => HealthCheckProtocol::Http,
        Some(v) if v.eq_ignore_ascii_case("tcp") => HealthCheckProtocol::Tcp,
        Some(v) => return Err(bad(&keys.hc_protocol, v, "want http or tcp")),
    };
    let port = match annotation(svc, &keys.hc_port) {
        None => default_port,
        Some(v) => v
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad(&keys.hc_port, v, "want a port number 1-65535"))?,
    };
    let path = match (protocol, annotation(svc, &keys.hc_path)) {
        (HealthCheckProtocol::Http, None) => Some(HEALTHZ_PATH.to_owned()),
        (HealthCheckProtocol::Http, Some(p)) => {
            if !p.starts_with('/') || p.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(bad(
                    &keys.hc_path,
                    p,
                    "want an absolute path without spaces",
                ));
            }
            Some(p.to_owned())
        }
        (HealthCheckProtocol::Tcp, None) => None,
        (HealthCheckProtocol::Tcp, Some(p)) => {
            return Err(bad(
                &keys.hc_path,
                p,
                "a path needs the http health-check protocol",
            ));
        }
    };
    Ok(HealthCheck {
        protocol,
        port,
        path,
    })
}

fn listeners(
    svc: &Service,
    keys: &AnnotationKeys,
    mode: LoadBalancerMode,
    check: &HealthCheck,
) -> Result<Vec<Listener>, SpecError> {
    let ports = svc
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .filter(|p| !p.is_empty())
        .ok_or(SpecError::NoPorts)?;
    let mut listeners = ports
        .iter()
        .map(|p| {
            let protocol = match p.protocol.as_deref().unwrap_or("TCP") {
                "TCP" => Protocol::Tcp,
                "UDP" => Protocol::Udp,
                other => {
                    return Err(SpecError::UnsupportedProtocol {
                        port: p.port,
                        protocol: other.to_owned(),
                    });
                }
            };
            let port = u16::try_from(p.port)
                .ok()
                .filter(|v| *v != 0)
                .ok_or(SpecError::PortOutOfRange(p.port))?;
            // Passthrough routes the VIP to the node unchanged; the node proxy matches the
            // Service port there, so a Service without node ports still works.
            let backend_port = match (p.node_port, mode) {
                (Some(np), _) => u16::try_from(np)
                    .ok()
                    .filter(|v| *v != 0)
                    .ok_or(SpecError::PortOutOfRange(np))?,
                (None, LoadBalancerMode::Passthrough) => port,
                (None, LoadBalancerMode::Proxy) if !allocates_node_ports(svc) => {
                    return Err(SpecError::NodePortsNotAllocated {
                        port: p.port,
                        mode_annotation: keys.mode.clone(),
                    });
                }
                (None, LoadBalancerMode::Proxy) => return Err(SpecError::MissingNodePort(p.port)),
            };
            Ok(Listener {
                protocol,
                port,
                backend_port,
                health_check: Some(check.clone()),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    listeners.sort();
    Ok(listeners)
}

fn check_annotations(svc: &Service, keys: &AnnotationKeys) -> Result<(), SpecError> {
    let Some(annotations) = svc.metadata.annotations.as_ref() else {
        return Ok(());
    };
    match annotations
        .keys()
        .find(|k| k.starts_with(&keys.prefix) && !keys.known().contains(&k.as_str()))
    {
        Some(unknown) => Err(SpecError::UnknownAnnotation(unknown.clone())),
        None => Ok(()),
    }
}

/// The Service's IP families in its order: `spec.ipFamilies`, which the API server
/// defaults since 1.20; a server older than that leaves it unset, and its Services are
/// IPv4. Anything but one or two distinct known families cannot be served.
pub fn ip_families(svc: &Service) -> Result<Vec<IpFamily>, SpecError> {
    let names = svc
        .spec
        .as_ref()
        .and_then(|s| s.ip_families.as_deref())
        .unwrap_or_default();
    if names.is_empty() {
        return Ok(vec![IpFamily::V4]);
    }
    let families: Vec<IpFamily> = names
        .iter()
        .map(|name| match name.as_str() {
            "IPv4" => Some(IpFamily::V4),
            "IPv6" => Some(IpFamily::V6),
            _ => None,
        })
        .collect::<Option<_>>()
        .ok_or_else(|| SpecError::UnsupportedIpFamilies(names.to_vec()))?;
    match families.as_slice() {
        [_] => Ok(families),
        [a, b] if a != b => Ok(families),
        _ => Err(SpecError::UnsupportedIpFamilies(names.to_vec())),
    }
}

/// Every requested address must be of one of the Service's families: an address of
/// another would be dropped silently, or refused by the cloud for a reason that does not
/// name the Service's families.
fn check_requested_families(
    address: &AddressRequest,
    families: &[IpFamily],
) -> Result<(), SpecError> {
    match address
        .requested
        .iter()
        .find(|ip| !families.contains(&IpFamily::of(**ip)))
    {
        Some(ip) => Err(SpecError::RequestedFamilyNotInService {
            address: *ip,
            family: IpFamily::of(*ip),
            families: families
                .iter()
                .map(IpFamily::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        }),
        None => Ok(()),
    }
}

/// The LB the Service needs, with the backends of its families out of `backends` (see
/// [`crate::nodes`]); `owner` is the Service's ([`owner_of`], read once per reconcile with
/// the lookup it also names), `inherited_pool` the pool its Namespace or the controller
/// names (see [`address_request`]).
pub fn desired_load_balancer(
    svc: &Service,
    keys: &AnnotationKeys,
    owner: Owner,
    backends: BTreeSet<IpAddr>,
    without_node_ports: WithoutNodePorts,
    inherited_pool: Option<&str>,
) -> Result<DesiredLoadBalancer, SpecError> {
    check_annotations(svc, keys)?;
    let ip_families = ip_families(svc)?;
    let of_families = |ip: &IpAddr| ip_families.contains(&IpFamily::of(*ip));
    let mode = parse_mode(svc, keys, without_node_ports)?;
    let check = health_check(svc, keys)?;
    let address = address_request(svc, keys, inherited_pool)?;
    check_requested_families(&address, &ip_families)?;
    let mut source_ranges = source_ranges(svc)?;
    source_ranges.retain(|net| of_families(&net.addr()));
    Ok(DesiredLoadBalancer {
        owner,
        mode,
        address,
        listeners: listeners(svc, keys, mode, &check)?,
        backends: backends.into_iter().filter(of_families).collect(),
        // Whether the LB references the cluster's node pool is the provider's matter
        // (`Context::node_pool`), not the Service's.
        node_pool: None,
        source_ranges,
        ip_families,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};
    use kube::api::ObjectMeta;
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use std::net::Ipv4Addr;
    use std::sync::LazyLock;

    /// The keys of a provider whose prefix is `example.com/lb-`.
    pub(crate) static KEYS: LazyLock<AnnotationKeys> =
        LazyLock::new(|| AnnotationKeys::with_prefix("example.com/lb-"));

    pub(crate) fn service(name: &str) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                uid: Some(format!("uid-{name}")),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                type_: Some("LoadBalancer".into()),
                ports: Some(vec![ServicePort {
                    name: Some("http".into()),
                    port: 80,
                    protocol: Some("TCP".into()),
                    node_port: Some(30080),
                    ..Default::default()
                }]),
                external_traffic_policy: Some("Cluster".into()),
                ..Default::default()
            }),
            status: None,
        }
    }

    fn with_annotation(mut svc: Service, k: &str, v: &str) -> Service {
        svc.metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(k.into(), v.into());
        svc
    }

    fn cluster() -> ClusterId {
        "test".parse().unwrap()
    }

    fn desired(svc: &Service) -> Result<DesiredLoadBalancer, SpecError> {
        desired_load_balancer(
            svc,
            &KEYS,
            owner_of(svc, &cluster()).unwrap(),
            BTreeSet::new(),
            WithoutNodePorts::Passthrough,
            None,
        )
    }

    #[test]
    fn services_without_node_ports_are_passthrough_or_refused_never_port_zero() {
        let mut svc = service("np");
        let spec = svc.spec.as_mut().unwrap();
        spec.allocate_load_balancer_node_ports = Some(false);
        spec.ports.as_mut().unwrap()[0].node_port = None;
        let served = desired(&svc).unwrap();
        assert_eq!(served.mode, LoadBalancerMode::Passthrough);
        assert_eq!(served.listeners[0].backend_port, 80);
        let refused = desired_load_balancer(
            &svc,
            &KEYS,
            owner_of(&svc, &cluster()).unwrap(),
            BTreeSet::new(),
            WithoutNodePorts::Refuse,
            None,
        );
        assert_eq!(
            refused,
            Err(SpecError::NodePortsNotAllocated {
                port: 80,
                mode_annotation: KEYS.mode.clone()
            })
        );
        let proxy = with_annotation(svc.clone(), &KEYS.mode, "proxy");
        assert_eq!(
            desired(&proxy),
            Err(SpecError::NodePortsNotAllocated {
                port: 80,
                mode_annotation: KEYS.mode.clone()
            })
        );
        let asked = with_annotation(svc, &KEYS.mode, "passthrough");
        let asked = desired_load_balancer(
            &asked,
            &KEYS,
            owner_of(&asked, &cluster()).unwrap(),
            BTreeSet::new(),
            WithoutNodePorts::Refuse,
            None,
        )
        .unwrap();
        assert_eq!(asked.mode, LoadBalancerMode::Passthrough);
        // Node ports the user still set are used as they are, in either mode.
        let mut kept = service("kept");
        kept.spec
            .as_mut()
            .unwrap()
            .allocate_load_balancer_node_ports = Some(false);
        let kept = desired(&kept).unwrap();
        assert_eq!(kept.listeners[0].backend_port, 30080);
        assert!(kept.listeners.iter().all(|l| l.backend_port != 0));
    }

    #[test]
    fn default_service_maps_to_proxy_lb_with_node_proxy_health_check() {
        let d = desired(&service("web")).unwrap();
        assert_eq!(d.mode, LoadBalancerMode::Proxy);
        assert_eq!(
            d.listeners,
            vec![Listener {
                protocol: Protocol::Tcp,
                port: 80,
                backend_port: 30080,
                health_check: Some(HealthCheck {
                    protocol: HealthCheckProtocol::Http,
                    port: 10256,
                    path: Some("/healthz".into())
                })
            }]
        );
        assert_eq!(d.owner.uid, "uid-web");
        assert_eq!(d.address, AddressRequest::default());
    }

    #[test]
    fn local_policy_checks_health_check_node_port() {
        let mut svc = service("web");
        let spec = svc.spec.as_mut().unwrap();
        spec.external_traffic_policy = Some("Local".into());
        spec.health_check_node_port = Some(32000);
        let d = desired(&svc).unwrap();
        assert_eq!(d.listeners[0].health_check.as_ref().unwrap().port, 32000);
        svc.spec.as_mut().unwrap().health_check_node_port = None;
        assert_eq!(desired(&svc), Err(SpecError::MissingHealthCheckNodePort));
    }

    #[test]
    fn udp_and_tcp_ports_become_listeners_sorted() {
        let mut svc = service("dns");
        svc.spec.as_mut().unwrap().ports = Some(vec![
            ServicePort {
                port: 53,
                protocol: Some("UDP".into()),
                node_port: Some(30053),
                ..Default::default()
            },
            ServicePort {
                port: 53,
                protocol: Some("TCP".into()),
                node_port: Some(30054),
                ..Default::default()
            },
        ]);
        let d = desired(&svc).unwrap();
        assert_eq!(
            d.listeners
                .iter()
                .map(|l| (l.protocol, l.port, l.backend_port))
                .collect::<Vec<_>>(),
            vec![(Protocol::Tcp, 53, 30054), (Protocol::Udp, 53, 30053)]
        );
    }

    #[test]
    fn sctp_is_rejected() {
        let mut svc = service("s");
        svc.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].protocol = Some("SCTP".into());
        assert!(matches!(
            desired(&svc),
            Err(SpecError::UnsupportedProtocol { .. })
        ));
    }

    #[test]
    fn missing_node_port_only_matters_in_proxy_mode() {
        let mut svc = service("s");
        svc.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].node_port = None;
        assert_eq!(desired(&svc), Err(SpecError::MissingNodePort(80)));
        let svc = with_annotation(svc, &KEYS.mode, "passthrough");
        let d = desired(&svc).unwrap();
        assert_eq!(d.mode, LoadBalancerMode::Passthrough);
        assert_eq!(d.listeners[0].backend_port, 80);
    }

    #[test]
    fn annotations_override_health_check() {
        let svc = with_annotation(service("s"), &KEYS.hc_path, "/ready");
        let svc = with_annotation(svc, &KEYS.hc_port, "8080");
        let hc = desired(&svc).unwrap().listeners[0]
            .health_check
            .clone()
            .unwrap();
        assert_eq!((hc.port, hc.path.as_deref()), (8080, Some("/ready")));
        let svc = with_annotation(service("s"), &KEYS.hc_protocol, "TCP");
        let hc = desired(&svc).unwrap().listeners[0]
            .health_check
            .clone()
            .unwrap();
        assert_eq!((hc.protocol, hc.path), (HealthCheckProtocol::Tcp, None));
    }

    #[test]
    fn bad_annotations_are_typed_errors() {
        for (k, v) in [
            (&KEYS.mode, "bridge"),
            (&KEYS.hc_protocol, "grpc"),
            (&KEYS.hc_port, "0"),
            (&KEYS.hc_port, "70000"),
            (&KEYS.hc_path, "healthz"),
        ] {
            let err = desired(&with_annotation(service("s"), k, v)).unwrap_err();
            assert!(
                matches!(&err, SpecError::BadAnnotation { annotation, .. } if annotation == k),
                "{k}={v}: {err}"
            );
        }
        let svc = with_annotation(service("s"), &KEYS.hc_protocol, "tcp");
        let svc = with_annotation(svc, &KEYS.hc_path, "/x");
        assert!(matches!(
            desired(&svc),
            Err(SpecError::BadAnnotation { .. })
        ));
        let typo = format!("{}mdoe", KEYS.prefix);
        assert_eq!(
            desired(&with_annotation(service("s"), &typo, "proxy")),
            Err(SpecError::UnknownAnnotation(typo))
        );
    }

    fn v4(d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(198, 51, 100, d))
    }

    #[test]
    fn requested_ips_from_spec_or_annotation_list() {
        let requested = |svc: &Service| desired(svc).map(|d| d.address.requested);
        let mut svc = service("s");
        svc.spec.as_mut().unwrap().load_balancer_ip = Some("198.51.100.10".into());
        assert_eq!(requested(&svc), Ok(vec![v4(10)]));
        let same = with_annotation(svc.clone(), &KEYS.requested_ip, "198.51.100.10");
        assert_eq!(requested(&same), Ok(vec![v4(10)]));
        let other = with_annotation(svc.clone(), &KEYS.requested_ip, "198.51.100.11");
        assert!(matches!(
            requested(&other),
            Err(SpecError::ConflictingRequestedIp { .. })
        ));
        // The annotation's list wins and lists the families in order, IPv4 first.
        let dual = with_families(
            with_annotation(svc, &KEYS.requested_ip, " 2001:db8::1, 198.51.100.10"),
            &["IPv6", "IPv4"],
        );
        assert_eq!(
            requested(&dual),
            Ok(vec![v4(10), "2001:db8::1".parse().unwrap()])
        );
        let annotated = with_annotation(service("s"), &KEYS.requested_ip, "198.51.100.12");
        assert_eq!(requested(&annotated), Ok(vec![v4(12)]));
        let two_v4 = with_annotation(
            service("s"),
            &KEYS.requested_ip,
            "198.51.100.12,198.51.100.13",
        );
        assert_eq!(
            requested(&two_v4),
            Err(SpecError::TwoAddressesOfOneFamily {
                first: v4(12),
                second: v4(13)
            })
        );
        let garbage = with_annotation(service("s"), &KEYS.requested_ip, "198.51.100.x");
        assert!(matches!(
            requested(&garbage),
            Err(SpecError::BadRequestedIp(_))
        ));
        assert_eq!(requested(&service("s")), Ok(vec![]));
    }

    #[test]
    fn pool_from_service_else_inherited() {
        let pool = |svc: &Service, inherited: Option<&str>| {
            desired_load_balancer(
                svc,
                &KEYS,
                owner_of(svc, &cluster()).unwrap(),
                BTreeSet::new(),
                WithoutNodePorts::Passthrough,
                inherited,
            )
            .unwrap()
            .address
            .pool
        };
        let plain = service("s");
        assert_eq!(pool(&plain, None), None);
        assert_eq!(pool(&plain, Some("ns-pool")), Some("ns-pool".into()));
        let own = with_annotation(plain.clone(), &KEYS.address_pool, " blue ");
        assert_eq!(pool(&own, Some("ns-pool")), Some("blue".into()));
        let empty = with_annotation(plain.clone(), &KEYS.address_pool, "");
        assert_eq!(pool(&empty, Some("ns-pool")), Some("ns-pool".into()));
        for bad in ["Blue", "-blue", "blue pool", &"x".repeat(64)] {
            let named = with_annotation(plain.clone(), &KEYS.address_pool, bad);
            assert_eq!(
                desired(&named),
                Err(SpecError::BadPoolName {
                    pool: bad.to_owned(),
                    key: KEYS.address_pool.clone()
                }),
                "{bad}"
            );
        }
        let mut namespace = Namespace::default();
        assert_eq!(KEYS.namespace_pool(&namespace), None);
        namespace.metadata.annotations = Some(BTreeMap::from([(
            KEYS.address_pool.clone(),
            "green".into(),
        )]));
        assert_eq!(KEYS.namespace_pool(&namespace), Some("green"));
    }

    #[test]
    fn sharing_key_from_annotation() {
        let key = |svc: &Service| desired(svc).unwrap().address.sharing_key;
        assert_eq!(key(&service("s")), None);
        let shared = with_annotation(service("s"), &KEYS.shared_ip, "dns");
        assert_eq!(key(&shared), Some("dns".into()));
    }

    #[test]
    fn source_ranges_are_parsed_sorted_and_truncated() {
        let mut svc = service("s");
        svc.spec.as_mut().unwrap().load_balancer_source_ranges =
            Some(vec!["203.0.113.7/24".into(), " 10.0.0.0/8".into()]);
        assert_eq!(
            desired(&svc).unwrap().source_ranges,
            vec![
                "10.0.0.0/8".parse::<IpNet>().unwrap(),
                "203.0.113.0/24".parse().unwrap()
            ]
        );
        svc.spec.as_mut().unwrap().load_balancer_source_ranges = Some(vec!["nope".into()]);
        assert_eq!(desired(&svc), Err(SpecError::BadSourceRange("nope".into())));
        let annotated = with_annotation(
            service("s"),
            ANNOTATION_SOURCE_RANGES,
            "192.0.2.0/24, 198.51.100.0/24",
        );
        assert_eq!(desired(&annotated).unwrap().source_ranges.len(), 2);
    }

    fn with_families(mut svc: Service, families: &[&str]) -> Service {
        svc.spec.as_mut().unwrap().ip_families =
            Some(families.iter().map(|f| (*f).to_owned()).collect());
        svc
    }

    fn ips(texts: &[&str]) -> BTreeSet<IpAddr> {
        texts.iter().map(|t| t.parse().unwrap()).collect()
    }

    #[test]
    fn ip_families_in_the_services_order_ipv4_when_unset() {
        let families = |svc: &Service| desired(svc).map(|d| d.ip_families);
        // A server before 1.20 sets no ipFamilies: its Services are IPv4.
        assert_eq!(families(&service("s")), Ok(vec![IpFamily::V4]));
        for (names, want) in [
            (vec!["IPv6"], vec![IpFamily::V6]),
            (vec!["IPv4", "IPv6"], vec![IpFamily::V4, IpFamily::V6]),
            (vec!["IPv6", "IPv4"], vec![IpFamily::V6, IpFamily::V4]),
        ] {
            assert_eq!(families(&with_families(service("s"), &names)), Ok(want));
        }
        // What no controller can serve is refused, naming the field.
        for names in [
            vec!["IPv5"],
            vec!["IPv4", "IPv4"],
            vec!["IPv4", "IPv6", "IPv4"],
        ] {
            let err = families(&with_families(service("s"), &names)).unwrap_err();
            assert_eq!(
                err,
                SpecError::UnsupportedIpFamilies(names.iter().map(|n| (*n).into()).collect())
            );
            assert!(err.to_string().contains("spec.ipFamilies"), "{err}");
        }
    }

    #[test]
    fn backends_and_source_ranges_of_the_services_families_only() {
        let nodes = ips(&["198.18.0.11", "198.18.0.12", "2001:db8:18::11"]);
        let ranges = |svc: &mut Service| {
            svc.spec.as_mut().unwrap().load_balancer_source_ranges =
                Some(vec!["2001:db8:203::/64".into(), "203.0.113.0/24".into()]);
        };
        let of = |families: &[&str]| {
            let mut svc = with_families(service("s"), families);
            ranges(&mut svc);
            let d = desired_load_balancer(
                &svc,
                &KEYS,
                owner_of(&svc, &cluster()).unwrap(),
                nodes.clone(),
                WithoutNodePorts::Passthrough,
                None,
            )
            .unwrap();
            let ranges: Vec<String> = d.source_ranges.iter().map(IpNet::to_string).collect();
            (d.backends, ranges)
        };
        assert_eq!(
            of(&["IPv4"]),
            (
                ips(&["198.18.0.11", "198.18.0.12"]),
                vec!["203.0.113.0/24".to_owned()]
            )
        );
        assert_eq!(
            of(&["IPv6"]),
            (
                ips(&["2001:db8:18::11"]),
                vec!["2001:db8:203::/64".to_owned()]
            )
        );
        let (backends, ranges) = of(&["IPv6", "IPv4"]);
        assert_eq!((backends, ranges.len()), (nodes.clone(), 2));
    }

    #[test]
    fn requested_addresses_must_be_of_the_services_families() {
        let dual_request = with_annotation(
            service("s"),
            &KEYS.requested_ip,
            "2001:db8:51:100::9,198.51.100.9",
        );
        assert_eq!(
            desired(&dual_request),
            Err(SpecError::RequestedFamilyNotInService {
                address: "2001:db8:51:100::9".parse().unwrap(),
                family: IpFamily::V6,
                families: "IPv4".into()
            })
        );
        let dual = with_families(dual_request, &["IPv6", "IPv4"]);
        let address = desired(&dual).unwrap().address;
        assert_eq!(
            address.requested_of(IpFamily::V6),
            Some("2001:db8:51:100::9".parse().unwrap())
        );
        assert_eq!(address.requested_of(IpFamily::V4), Some(v4(9)));
        let mut v6_only = with_families(service("s"), &["IPv6"]);
        v6_only.spec.as_mut().unwrap().load_balancer_ip = Some("2001:db8:51:100::9".into());
        assert!(desired(&v6_only).is_ok());
        v6_only.spec.as_mut().unwrap().load_balancer_ip = Some("198.51.100.9".into());
        assert!(matches!(
            desired(&v6_only),
            Err(SpecError::RequestedFamilyNotInService { .. })
        ));
    }

    #[test]
    fn class_filter() {
        let ours = ClassFilter {
            class: "tandem.io/mockcloud".into(),
            claim_unclassed: true,
        };
        let mut svc = service("s");
        assert!(ours.class_is_ours(&svc));
        svc.spec.as_mut().unwrap().load_balancer_class = Some("tandem.io/mockcloud".into());
        assert!(ours.class_is_ours(&svc));
        svc.spec.as_mut().unwrap().load_balancer_class = Some("other.io/lb".into());
        assert!(!ours.class_is_ours(&svc));
        let strict = ClassFilter {
            claim_unclassed: false,
            ..ours
        };
        assert!(!strict.class_is_ours(&service("s")));
    }

    #[test]
    fn persisted_id_ignores_empty() {
        assert_eq!(KEYS.persisted_id(&service("s")), None);
        assert_eq!(
            KEYS.persisted_id(&with_annotation(service("s"), &KEYS.lb_id, "lb-1")),
            Some("lb-1")
        );
        assert_eq!(
            KEYS.persisted_id(&with_annotation(service("s"), &KEYS.lb_id, "")),
            None
        );
    }

    proptest! {
        // Whatever annotation values users write, the mapping returns (never panics) and is
        // deterministic.
        #[test]
        fn arbitrary_annotations_never_panic(
            key in prop::sample::select(KEYS.known().map(str::to_owned).to_vec()),
            value in ".{0,40}",
        ) {
            let svc = with_annotation(service("s"), &key, &value);
            let first = desired(&svc);
            prop_assert_eq!(first, desired(&svc));
        }

        #[test]
        fn listener_order_does_not_depend_on_port_order(ports in prop::collection::btree_set(1u16..1000, 1..6)) {
            let mk = |order: Vec<u16>| {
                let mut svc = service("s");
                svc.spec.as_mut().unwrap().ports = Some(order.iter().map(|p| ServicePort {
                    port: i32::from(*p),
                    node_port: Some(30000 + i32::from(*p)),
                    ..Default::default()
                }).collect());
                desired(&svc).unwrap().listeners
            };
            let forward: Vec<u16> = ports.iter().copied().collect();
            let backward: Vec<u16> = forward.iter().rev().copied().collect();
            prop_assert_eq!(mk(forward), mk(backward));
        }
    }
}
