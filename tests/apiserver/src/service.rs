//! Service defaulting, validation and clusterIP / nodePort allocation, as kube-apiserver's
//! service REST strategy does them, for single-stack and dual-stack clusters (IP families
//! defaulted and checked as `initIPFamilyFields` does). Pure functions over JSON plus an
//! in-memory allocator; the store calls them under its lock, which makes allocation
//! race-free.

use std::collections::{BTreeSet, HashSet};
use std::net::IpAddr;
use std::ops::RangeInclusive;
use std::str::FromStr;

use ipnet::IpNet;
use serde_json::{Value, json};
use tandem_common::{IpFamily, is_dns1123_label};

use crate::status::FieldError;

/// `--service-node-port-range`, e.g. `30000-32767`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortRange(pub RangeInclusive<u16>);

impl Default for PortRange {
    fn default() -> Self {
        Self(30000..=32767)
    }
}

impl FromStr for PortRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (a, b) = s
            .split_once('-')
            .ok_or_else(|| format!("expected A-B, got {s:?}"))?;
        let a: u16 = a
            .trim()
            .parse()
            .map_err(|e| format!("bad range start {a:?}: {e}"))?;
        let b: u16 = b
            .trim()
            .parse()
            .map_err(|e| format!("bad range end {b:?}: {e}"))?;
        if a == 0 || a > b {
            return Err(format!("empty or invalid port range {s:?}"));
        }
        Ok(Self(a..=b))
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.0.start(), self.0.end())
    }
}

/// `--service-cluster-ip-range`: one CIDR, or one of each family for a dual-stack cluster;
/// the first is the cluster's primary family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceCidrs(Vec<IpNet>);

impl ServiceCidrs {
    pub fn new(cidrs: Vec<IpNet>) -> Result<Self, String> {
        match cidrs.as_slice() {
            [_] => Ok(Self(cidrs)),
            [a, b] if IpFamily::of(a.addr()) != IpFamily::of(b.addr()) => Ok(Self(cidrs)),
            [_, _] => Err("two service CIDRs must be of different IP families".into()),
            _ => Err("expected one service CIDR, or one per IP family".into()),
        }
    }

    /// The CIDRs, primary family first.
    pub fn cidrs(&self) -> &[IpNet] {
        &self.0
    }

    /// The cluster's families, primary first.
    pub fn families(&self) -> Vec<IpFamily> {
        self.0.iter().map(|net| IpFamily::of(net.addr())).collect()
    }

    pub fn primary(&self) -> IpFamily {
        IpFamily::of(self.0[0].addr())
    }

    pub fn is_dual_stack(&self) -> bool {
        self.0.len() == 2
    }

    pub fn of(&self, family: IpFamily) -> Option<IpNet> {
        self.0
            .iter()
            .copied()
            .find(|net| IpFamily::of(net.addr()) == family)
    }
}

impl Default for ServiceCidrs {
    fn default() -> Self {
        Self(vec![IpNet::V4(
            ipnet::Ipv4Net::new(std::net::Ipv4Addr::new(10, 96, 0, 0), 16).unwrap_or_default(),
        )])
    }
}

impl FromStr for ServiceCidrs {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let cidrs = s
            .split(',')
            .map(|cidr| {
                cidr.trim()
                    .parse::<IpNet>()
                    .map(|net| net.trunc())
                    .map_err(|e| format!("bad service CIDR {cidr:?}: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(cidrs)
    }
}

impl std::fmt::Display for ServiceCidrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cidrs: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&cidrs.join(","))
    }
}

/// Addresses in `net` as offsets from its first: at most 2^64 are ever probed, whatever
/// the size of an IPv6 range.
fn range_size(net: IpNet) -> u64 {
    let host_bits = u32::from(net.max_prefix_len() - net.prefix_len());
    1u64.checked_shl(host_bits).unwrap_or(u64::MAX)
}

fn nth_address(net: IpNet, n: u64) -> IpAddr {
    match net {
        IpNet::V4(v4) => IpAddr::V4(std::net::Ipv4Addr::from(
            u32::from(v4.network()).wrapping_add(u32::try_from(n).unwrap_or(u32::MAX)),
        )),
        IpNet::V6(v6) => IpAddr::V6(std::net::Ipv6Addr::from(
            u128::from(v6.network()).wrapping_add(u128::from(n)),
        )),
    }
}

/// Used cluster IPs and node ports. Dynamic picks start at a random offset and probe
/// linearly, so concurrent creators do not all contend for the same first free value.
#[derive(Debug, Clone)]
pub struct Allocator {
    cidrs: ServiceCidrs,
    port_range: PortRange,
    ips: HashSet<IpAddr>,
    ports: HashSet<u16>,
}

impl Allocator {
    pub fn new(cidrs: ServiceCidrs, port_range: PortRange) -> Self {
        Self {
            cidrs,
            port_range,
            ips: HashSet::new(),
            ports: HashSet::new(),
        }
    }

    pub fn cidrs(&self) -> &ServiceCidrs {
        &self.cidrs
    }

    pub fn port_range(&self) -> &PortRange {
        &self.port_range
    }

    /// The network address is never handed out, nor an IPv4 range's broadcast address.
    fn ip_in_range(&self, ip: IpAddr) -> bool {
        let Some(net) = self.cidrs.of(IpFamily::of(ip)) else {
            return false;
        };
        let broadcast = match net {
            IpNet::V4(v4) => v4.prefix_len() < 31 && ip == IpAddr::V4(v4.broadcast()),
            IpNet::V6(_) => false,
        };
        net.contains(&ip) && ip != net.network() && !broadcast
    }

    fn ip_capacity(&self, family: IpFamily) -> u64 {
        self.cidrs.of(family).map_or(0, |net| match net {
            IpNet::V4(v4) if v4.prefix_len() >= 31 => range_size(net),
            IpNet::V4(_) => range_size(net).saturating_sub(2),
            IpNet::V6(_) => range_size(net).saturating_sub(1),
        })
    }

    fn ips_used(&self, family: IpFamily) -> u64 {
        self.ips
            .iter()
            .filter(|ip| IpFamily::of(**ip) == family)
            .count() as u64
    }

    fn port_capacity(&self) -> usize {
        usize::from(self.port_range.0.end() - self.port_range.0.start()) + 1
    }

    fn allocate_ip(&mut self, family: IpFamily) -> Option<IpAddr> {
        let net = self.cidrs.of(family)?;
        let size = range_size(net);
        let offset = rand::random_range(0..size);
        (0..size)
            .map(|i| nth_address(net, offset.wrapping_add(i) % size))
            .find(|ip| self.ip_in_range(*ip) && !self.ips.contains(ip))
            .inspect(|ip| {
                self.ips.insert(*ip);
            })
    }

    fn allocate_port(&mut self) -> Option<u16> {
        let start = *self.port_range.0.start();
        let size = self.port_capacity() as u32;
        let offset = rand::random_range(0..size);
        (0..size)
            .map(|i| start + ((offset + i) % size) as u16)
            .find(|p| !self.ports.contains(p))
            .inspect(|p| {
                self.ports.insert(*p);
            })
    }

    pub fn ip_used(&self, ip: IpAddr) -> bool {
        self.ips.contains(&ip)
    }

    pub fn port_used(&self, port: u16) -> bool {
        self.ports.contains(&port)
    }
}

/// What one Service holds in the allocator.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Held {
    /// Its cluster IPs, in the order of its `ipFamilies`.
    pub ips: Vec<IpAddr>,
    pub ports: BTreeSet<u16>,
}

fn needs_cluster_ip(svc_type: &str) -> bool {
    svc_type != "ExternalName"
}

fn needs_node_ports(spec: &Value) -> bool {
    match spec["type"].as_str() {
        Some("NodePort") => true,
        Some("LoadBalancer") => spec["allocateLoadBalancerNodePorts"].as_bool() != Some(false),
        _ => false,
    }
}

fn needs_health_check_port(spec: &Value) -> bool {
    spec["type"] == "LoadBalancer" && spec["externalTrafficPolicy"] == "Local"
}

/// The allocations a stored Service holds.
pub fn held(svc: &Value) -> Held {
    let spec = &svc["spec"];
    let ips = cluster_ips(spec)
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect();
    let mut ports: BTreeSet<u16> = spec["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["nodePort"].as_u64())
        .filter_map(|p| u16::try_from(p).ok())
        .collect();
    if let Some(hc) = spec["healthCheckNodePort"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
    {
        ports.insert(hc);
    }
    Held { ips, ports }
}

/// `spec.clusterIPs`, or `[spec.clusterIP]` when only that is set (clients older than
/// dual-stack send no list).
fn cluster_ips(spec: &Value) -> Vec<&str> {
    match spec["clusterIPs"].as_array() {
        Some(ips) if !ips.is_empty() => ips.iter().filter_map(Value::as_str).collect(),
        _ => spec["clusterIP"]
            .as_str()
            .filter(|ip| !ip.is_empty())
            .into_iter()
            .collect(),
    }
}

/// Returns a deleted Service's allocations to the pool.
pub fn release(svc: &Value, allocator: &mut Allocator) {
    let held = held(svc);
    for ip in held.ips {
        allocator.ips.remove(&ip);
    }
    for port in held.ports {
        allocator.ports.remove(&port);
    }
}

fn set(map: &mut Value, key: &str, value: Value) {
    if let Some(m) = map.as_object_mut() {
        m.insert(key.to_string(), value);
    }
}

fn remove(map: &mut Value, key: &str) {
    if let Some(m) = map.as_object_mut() {
        m.remove(key);
    }
}

fn default_if_missing(map: &mut Value, key: &str, value: Value) {
    if map.get(key).is_none_or(Value::is_null) {
        set(map, key, value);
    }
}

/// Copies values the client left out on update from the old object, as the API server's
/// `patchAllocatedValues` does, then drops fields the new type no longer allows but the
/// client did not change (`dropTypeDependentFields`).
fn carry_over(old: &Value, new: &mut Value) {
    let old_spec = &old["spec"];
    let Some(spec) = new.get_mut("spec") else {
        return;
    };
    let new_type = spec["type"].as_str().unwrap_or("ClusterIP").to_string();
    let old_type = old_spec["type"].as_str().unwrap_or("ClusterIP");
    if needs_cluster_ip(&new_type) && needs_cluster_ip(old_type) {
        if spec["clusterIP"].as_str().is_none_or(str::is_empty) {
            set(spec, "clusterIP", old_spec["clusterIP"].clone());
        }
        if spec["clusterIPs"].as_array().is_none_or(Vec::is_empty)
            && !old_spec["clusterIPs"].is_null()
        {
            set(spec, "clusterIPs", old_spec["clusterIPs"].clone());
        }
    }
    if !needs_cluster_ip(&new_type) && spec["clusterIP"] == old_spec["clusterIP"] {
        remove(spec, "clusterIP");
        remove(spec, "clusterIPs");
    }
    // Set to SingleStack, a dual-stack Service keeps only its primary family and IP, as
    // upstream's `trimFieldsForDualStackDowngrade` does with lists the client left as they were.
    if spec["ipFamilyPolicy"] == "SingleStack" && old_spec["ipFamilyPolicy"] != "SingleStack" {
        for key in ["ipFamilies", "clusterIPs"] {
            let unchanged = spec[key] == old_spec[key];
            if let Some(list) = spec.get_mut(key).and_then(Value::as_array_mut)
                && unchanged
                && list.len() == 2
            {
                list.truncate(1);
            }
        }
    }
    let keeps_node_ports = needs_node_ports(spec) || new_type == "LoadBalancer";
    if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
        for port in ports {
            let old_port = old_spec["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|o| {
                    o["port"] == port["port"]
                        && o["protocol"].as_str().unwrap_or("TCP")
                            == port["protocol"].as_str().unwrap_or("TCP")
                });
            let Some(old_port) = old_port else { continue };
            let unset = port["nodePort"].as_u64().is_none_or(|p| p == 0);
            if keeps_node_ports && unset && !old_port["nodePort"].is_null() {
                set(port, "nodePort", old_port["nodePort"].clone());
            } else if !keeps_node_ports && port["nodePort"] == old_port["nodePort"] {
                remove(port, "nodePort");
            }
        }
    }
    if needs_health_check_port(spec) {
        if spec["healthCheckNodePort"].as_u64().is_none_or(|p| p == 0)
            && !old_spec["healthCheckNodePort"].is_null()
        {
            set(
                spec,
                "healthCheckNodePort",
                old_spec["healthCheckNodePort"].clone(),
            );
        }
    } else if spec["healthCheckNodePort"] == old_spec["healthCheckNodePort"] {
        remove(spec, "healthCheckNodePort");
    }
    if new_type != "LoadBalancer"
        && spec["allocateLoadBalancerNodePorts"] == old_spec["allocateLoadBalancerNodePorts"]
    {
        remove(spec, "allocateLoadBalancerNodePorts");
    }
    // A Service leaving LoadBalancer loses the class it kept unchanged, as upstream does: the
    // cloud controller then recognises it as its own only by the finalizer.
    if new_type != "LoadBalancer" && spec["loadBalancerClass"] == old_spec["loadBalancerClass"] {
        remove(spec, "loadBalancerClass");
    }
    if !matches!(new_type.as_str(), "NodePort" | "LoadBalancer")
        && spec["externalTrafficPolicy"] == old_spec["externalTrafficPolicy"]
    {
        remove(spec, "externalTrafficPolicy");
    }
}

/// Fills in the defaults a real API server sets.
pub fn apply_defaults(svc: &mut Value) {
    if svc.get("spec").is_none_or(|s| !s.is_object()) {
        set(svc, "spec", json!({}));
    }
    let Some(spec) = svc.get_mut("spec") else {
        return;
    };
    default_if_missing(spec, "type", json!("ClusterIP"));
    default_if_missing(spec, "sessionAffinity", json!("None"));
    let svc_type = spec["type"].as_str().unwrap_or_default().to_string();
    if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
        for port in ports {
            default_if_missing(port, "protocol", json!("TCP"));
            let target = port["port"].clone();
            default_if_missing(port, "targetPort", target);
        }
    }
    if needs_cluster_ip(&svc_type) {
        default_if_missing(spec, "internalTrafficPolicy", json!("Cluster"));
    }
    if matches!(svc_type.as_str(), "NodePort" | "LoadBalancer") {
        default_if_missing(spec, "externalTrafficPolicy", json!("Cluster"));
    }
    if svc_type == "LoadBalancer" {
        default_if_missing(spec, "allocateLoadBalancerNodePorts", json!(true));
    }
}

const DUAL_STACK_OFF: &str = "this cluster is not configured for dual-stack services";

/// Defaults `ipFamilies` and `ipFamilyPolicy` from what the Service asks (families, cluster
/// IPs, policy) and what the cluster has, as kube-apiserver's `initIPFamilyFields` does,
/// and says what cannot be served. `old` is the stored object on update.
pub fn ip_families(svc: &mut Value, old: Option<&Value>, cidrs: &ServiceCidrs) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let Some(spec) = svc.get_mut("spec") else {
        return errors;
    };
    if !needs_cluster_ip(spec["type"].as_str().unwrap_or_default()) {
        return errors;
    }
    let mut families = Vec::new();
    for (i, name) in spec["ipFamilies"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        match name.as_str().and_then(IpFamily::from_name) {
            Some(family) => families.push(family),
            None => errors.push(FieldError::not_supported(
                format!("spec.ipFamilies[{i}]"),
                name.clone(),
                &["IPv4", "IPv6"],
            )),
        }
    }
    let ips: Vec<IpAddr> = cluster_ips(spec)
        .iter()
        .filter_map(|ip| ip.parse().ok())
        .collect();
    for (i, ip) in ips.iter().enumerate() {
        let family = IpFamily::of(*ip);
        match families.get(i) {
            None => families.push(family),
            Some(want) if *want != family => errors.push(FieldError::invalid(
                format!("spec.ipFamilies[{i}]"),
                want.as_str(),
                format!(
                    "expected clusterIPs[{i}] to be of the {} family",
                    want.as_str()
                ),
            )),
            Some(_) => {}
        }
    }
    let policy = match spec["ipFamilyPolicy"].as_str() {
        Some(policy) => policy.to_owned(),
        None if families.len() > 1 => "RequireDualStack".to_owned(),
        None => "SingleStack".to_owned(),
    };
    if families.is_empty() {
        families.push(cidrs.primary());
    }
    let dual = matches!(policy.as_str(), "PreferDualStack" | "RequireDualStack");
    if dual && cidrs.is_dual_stack() && families.len() == 1 {
        let first = families[0];
        families.extend(cidrs.families().into_iter().filter(|f| *f != first));
    }
    if policy == "RequireDualStack" && !cidrs.is_dual_stack() {
        errors.push(FieldError::invalid(
            "spec.ipFamilyPolicy",
            "RequireDualStack",
            DUAL_STACK_OFF,
        ));
    }
    if policy == "SingleStack" && families.len() > 1 {
        errors.push(FieldError::invalid(
            "spec.ipFamilyPolicy",
            "SingleStack",
            "must be RequireDualStack or PreferDualStack when multiple IP families are specified",
        ));
    }
    if families.len() > 2 {
        errors.push(FieldError::invalid(
            "spec.ipFamilies",
            json!(families.iter().map(|f| f.as_str()).collect::<Vec<_>>()),
            "may specify no more than one IP for each IP family",
        ));
    } else if families.len() == 2 && families[0] == families[1] {
        errors.push(FieldError::duplicate(
            "spec.ipFamilies[1]",
            families[1].as_str(),
        ));
    }
    for (i, family) in families.iter().enumerate() {
        if cidrs.of(*family).is_none() {
            let detail = if cidrs.is_dual_stack() {
                format!("{} is not configured on this cluster", family.as_str())
            } else {
                format!(
                    "{DUAL_STACK_OFF}; {} is not configured on this cluster",
                    family.as_str()
                )
            };
            errors.push(FieldError::invalid(
                format!("spec.ipFamilies[{i}]"),
                family.as_str(),
                detail,
            ));
        }
    }
    if let Some(old) = old
        && let Some(old_primary) = old["spec"]["ipFamilies"][0].as_str()
        && families.first().map(|f| f.as_str()) != Some(old_primary)
    {
        errors.push(FieldError::invalid(
            "spec.ipFamilies[0]",
            families.first().map_or("", |f| f.as_str()),
            "field is immutable",
        ));
    }
    set(
        spec,
        "ipFamilies",
        json!(families.iter().map(|f| f.as_str()).collect::<Vec<_>>()),
    );
    set(spec, "ipFamilyPolicy", json!(policy));
    errors
}

const TYPES: &[&str] = &["ClusterIP", "ExternalName", "LoadBalancer", "NodePort"];
const PROTOCOLS: &[&str] = &["SCTP", "TCP", "UDP"];

fn is_dns1035_label(s: &str) -> bool {
    let bytes = s.as_bytes();
    !s.is_empty()
        && s.len() <= 63
        && bytes[0].is_ascii_lowercase()
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && !s.ends_with('-')
}

fn is_iana_svc_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.bytes().any(|b| b.is_ascii_lowercase())
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
}

/// Checks a defaulted Service (without allocation state). `old` is the stored object on update.
pub fn validate(svc: &Value, old: Option<&Value>, allocator: &Allocator) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let name = svc["metadata"]["name"].as_str().unwrap_or_default();
    if !is_dns1035_label(name) {
        errors.push(FieldError::invalid(
            "metadata.name",
            name,
            "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character",
        ));
    }
    let spec = &svc["spec"];
    let svc_type = spec["type"].as_str().unwrap_or_default();
    if !TYPES.contains(&svc_type) {
        errors.push(FieldError::not_supported(
            "spec.type",
            spec["type"].clone(),
            TYPES,
        ));
    }
    let cluster_ip = spec["clusterIP"].as_str().unwrap_or_default();
    let headless = cluster_ip == "None";
    let ports = spec["ports"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if svc_type == "ExternalName" {
        let external = spec["externalName"].as_str().unwrap_or_default();
        if external.is_empty() {
            errors.push(FieldError::required("spec.externalName", ""));
        } else if !external
            .trim_end_matches('.')
            .split('.')
            .all(is_dns1123_label)
        {
            errors.push(FieldError::invalid(
                "spec.externalName",
                external,
                "must be a DNS-1123 subdomain",
            ));
        }
    } else if ports.is_empty() && !headless {
        errors.push(FieldError::required("spec.ports", ""));
    }
    validate_ports(ports, svc_type, allocator, &mut errors);
    if !headless {
        for (i, ip) in cluster_ips(spec).into_iter().enumerate() {
            let field = cluster_ip_field(i);
            match ip.parse::<IpAddr>() {
                Err(_) => errors.push(FieldError::invalid(
                    field,
                    ip,
                    "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)",
                )),
                Ok(addr) if !allocator.ip_in_range(addr) => {
                    let range = allocator
                        .cidrs()
                        .of(IpFamily::of(addr))
                        .map_or_else(|| "none of its family".to_owned(), |net| net.to_string());
                    errors.push(FieldError::invalid(
                        field,
                        ip,
                        format!("failed to allocate IP {ip}: the provided IP ({ip}) is not in the valid range. The range of valid IPs is {range}"),
                    ));
                }
                Ok(_) => {}
            }
        }
    }
    if headless && svc_type != "ClusterIP" {
        errors.push(FieldError::invalid(
            "spec.clusterIP",
            "None",
            format!("may not be set to 'None' for {svc_type} services"),
        ));
    }
    if let Some(old) = old {
        let old_ip = old["spec"]["clusterIP"].as_str().unwrap_or_default();
        let old_type = old["spec"]["type"].as_str().unwrap_or_default();
        if !old_ip.is_empty()
            && old_type != "ExternalName"
            && svc_type != "ExternalName"
            && cluster_ip != old_ip
        {
            errors.push(FieldError::invalid(
                "spec.clusterIP",
                cluster_ip,
                "field is immutable",
            ));
        }
        let old_class = &old["spec"]["loadBalancerClass"];
        if old_type == "LoadBalancer"
            && svc_type == "LoadBalancer"
            && spec["loadBalancerClass"] != *old_class
        {
            errors.push(FieldError::invalid(
                "spec.loadBalancerClass",
                spec["loadBalancerClass"].clone(),
                "may not change once set",
            ));
        }
    }
    if let Some(ips) = spec["clusterIPs"].as_array() {
        let families = spec["ipFamilies"].as_array().map_or(0, Vec::len);
        if ips.len() > families.max(1) {
            errors.push(FieldError::invalid(
                "spec.clusterIPs",
                spec["clusterIPs"].clone(),
                "may not have more IPs than the Service has IP families",
            ));
        }
        if let Some(first) = ips.first().and_then(Value::as_str)
            && !cluster_ip.is_empty()
            && first != cluster_ip
        {
            errors.push(FieldError::invalid(
                "spec.clusterIPs[0]",
                first,
                "must match `spec.clusterIP`",
            ));
        }
    }
    for (i, range) in spec["loadBalancerSourceRanges"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let field = format!("spec.loadBalancerSourceRanges[{i}]");
        let text = range.as_str().unwrap_or_default().trim();
        if text.parse::<ipnet::IpNet>().is_err() {
            errors.push(FieldError::invalid(
                field,
                range.clone(),
                "must be a list of IP ranges. For example, 10.240.0.0/24,10.250.0.0/24 ",
            ));
        } else if svc_type != "LoadBalancer" {
            errors.push(FieldError::forbidden(
                field,
                "may only be used when `type` is 'LoadBalancer'",
            ));
        }
    }
    for (i, ip) in spec["externalIPs"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        if ip.as_str().and_then(|s| s.parse::<IpAddr>().ok()).is_none() {
            errors.push(FieldError::invalid(
                format!("spec.externalIPs[{i}]"),
                ip.clone(),
                "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)",
            ));
        }
    }
    if let Some(lb_ip) = spec["loadBalancerIP"].as_str()
        && !lb_ip.is_empty()
        && lb_ip.parse::<IpAddr>().is_err()
    {
        errors.push(FieldError::invalid(
            "spec.loadBalancerIP",
            lb_ip,
            "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)",
        ));
    }
    if !spec["loadBalancerClass"].is_null() && svc_type != "LoadBalancer" {
        errors.push(FieldError::forbidden(
            "spec.loadBalancerClass",
            "may only be used when `type` is 'LoadBalancer'",
        ));
    }
    check_enum(spec, "sessionAffinity", &["ClientIP", "None"], &mut errors);
    check_enum(
        spec,
        "externalTrafficPolicy",
        &["Cluster", "Local"],
        &mut errors,
    );
    check_enum(
        spec,
        "internalTrafficPolicy",
        &["Cluster", "Local"],
        &mut errors,
    );
    check_enum(
        spec,
        "ipFamilyPolicy",
        &["PreferDualStack", "RequireDualStack", "SingleStack"],
        &mut errors,
    );
    if let Some(hc) = spec.get("healthCheckNodePort").filter(|v| !v.is_null()) {
        if !needs_health_check_port(spec) {
            errors.push(FieldError::invalid(
                "spec.healthCheckNodePort",
                hc.clone(),
                "may only be set when `type` is 'LoadBalancer' and `externalTrafficPolicy` is 'Local'",
            ));
        } else {
            check_node_port_range("spec.healthCheckNodePort", hc, allocator, &mut errors);
        }
    }
    errors
}

/// The primary cluster IP is `spec.clusterIP`; the others are reported by index.
fn cluster_ip_field(i: usize) -> String {
    if i == 0 {
        "spec.clusterIP".into()
    } else {
        format!("spec.clusterIPs[{i}]")
    }
}

fn check_enum(spec: &Value, key: &str, allowed: &[&'static str], errors: &mut Vec<FieldError>) {
    if let Some(value) = spec.get(key).filter(|v| !v.is_null())
        && !value.as_str().is_some_and(|s| allowed.contains(&s))
    {
        errors.push(FieldError::not_supported(
            format!("spec.{key}"),
            value.clone(),
            allowed,
        ));
    }
}

fn check_node_port_range(
    field: &str,
    value: &Value,
    allocator: &Allocator,
    errors: &mut Vec<FieldError>,
) {
    let in_range = value
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .is_some_and(|p| allocator.port_range.0.contains(&p));
    if !in_range {
        errors.push(FieldError::invalid(
            field,
            value.clone(),
            format!(
                "provided port is not in the valid range. The range of valid ports is {}",
                allocator.port_range
            ),
        ));
    }
}

fn validate_ports(
    ports: &[Value],
    svc_type: &str,
    allocator: &Allocator,
    errors: &mut Vec<FieldError>,
) {
    let mut names = HashSet::new();
    let mut keys = HashSet::new();
    let mut node_ports = HashSet::new();
    for (i, port) in ports.iter().enumerate() {
        let at = |f: &str| format!("spec.ports[{i}].{f}");
        match port["name"].as_str().filter(|n| !n.is_empty()) {
            Some(name) => {
                if !is_dns1123_label(name) {
                    errors.push(FieldError::invalid(at("name"), name, "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-'"));
                }
                if !names.insert(name.to_string()) {
                    errors.push(FieldError::duplicate(at("name"), name));
                }
            }
            None if ports.len() > 1 => errors.push(FieldError::required(at("name"), "")),
            None => {}
        }
        let number = port["port"].as_u64().filter(|p| (1..=65535).contains(p));
        if number.is_none() {
            errors.push(FieldError::invalid(
                at("port"),
                port["port"].clone(),
                "must be between 1 and 65535, inclusive",
            ));
        }
        let protocol = port["protocol"].as_str().unwrap_or_default();
        if !PROTOCOLS.contains(&protocol) {
            errors.push(FieldError::not_supported(
                at("protocol"),
                port["protocol"].clone(),
                PROTOCOLS,
            ));
        }
        if let Some(number) = number
            && !keys.insert((number, protocol.to_string()))
        {
            errors.push(FieldError::duplicate(
                format!("spec.ports[{i}]"),
                json!({"port": number, "protocol": protocol}),
            ));
        }
        match &port["targetPort"] {
            Value::Number(n) if n.as_u64().is_some_and(|p| (1..=65535).contains(&p)) => {}
            Value::String(s) if is_iana_svc_name(s) => {}
            Value::Null => {}
            other => errors.push(FieldError::invalid(
                at("targetPort"),
                other.clone(),
                "must contain a valid port number or IANA service name",
            )),
        }
        if let Some(node_port) = port
            .get("nodePort")
            .filter(|v| !v.is_null() && v.as_u64() != Some(0))
        {
            if svc_type == "ClusterIP" || svc_type == "ExternalName" {
                errors.push(FieldError::forbidden(
                    at("nodePort"),
                    format!("may not be used when `type` is '{svc_type}'"),
                ));
            } else {
                check_node_port_range(&at("nodePort"), node_port, allocator, errors);
                if !node_ports.insert((node_port.as_u64(), protocol.to_string())) {
                    errors.push(FieldError::duplicate(at("nodePort"), node_port.clone()));
                }
            }
        }
    }
}

/// Allocates what a validated Service needs, treating what `previous` holds as its own;
/// releases what it no longer uses. All or nothing: on error the allocator is unchanged.
pub fn allocate(
    svc: &mut Value,
    previous: &Held,
    allocator: &mut Allocator,
) -> Result<(), Vec<FieldError>> {
    let mut errors = Vec::new();
    let spec_type = svc["spec"]["type"].as_str().unwrap_or_default().to_string();
    let wants_ip = needs_cluster_ip(&spec_type) && svc["spec"]["clusterIP"] != "None";
    let requested = held(svc);
    for (i, ip) in requested.ips.iter().enumerate() {
        if !previous.ips.contains(ip) && allocator.ip_used(*ip) {
            errors.push(FieldError::invalid(
                cluster_ip_field(i),
                ip.to_string(),
                format!("failed to allocate IP {ip}: provided IP is already allocated"),
            ));
        }
    }
    let spec = &svc["spec"];
    // The families still without an IP, in the Service's order.
    let families: Vec<IpFamily> = spec["ipFamilies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f.as_str().and_then(IpFamily::from_name))
        .collect();
    let missing_ips: Vec<IpFamily> = if wants_ip {
        families.iter().skip(requested.ips.len()).copied().collect()
    } else {
        Vec::new()
    };
    for (i, port) in spec["ports"].as_array().into_iter().flatten().enumerate() {
        if let Some(p) = port["nodePort"]
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            && !previous.ports.contains(&p)
            && allocator.port_used(p)
        {
            errors.push(FieldError::invalid(
                format!("spec.ports[{i}].nodePort"),
                p,
                "provided port is already allocated",
            ));
        }
    }
    if let Some(p) = spec["healthCheckNodePort"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        && !previous.ports.contains(&p)
        && allocator.port_used(p)
    {
        errors.push(FieldError::invalid(
            "spec.healthCheckNodePort",
            p,
            "provided port is already allocated",
        ));
    }
    let missing_ports = if needs_node_ports(spec) {
        spec["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["nodePort"].as_u64().is_none_or(|n| n == 0))
            .count()
    } else {
        0
    } + usize::from(
        needs_health_check_port(spec)
            && spec["healthCheckNodePort"].as_u64().is_none_or(|n| n == 0),
    );
    let freed_ports = previous.ports.difference(&requested.ports).count();
    let new_ports = requested.ports.difference(&previous.ports).count();
    if allocator.ports.len() + new_ports + missing_ports > allocator.port_capacity() + freed_ports {
        errors.push(FieldError::invalid(
            "spec.ports",
            spec["ports"].clone(),
            "range for node ports is full",
        ));
    }
    for family in &missing_ips {
        let freed = previous
            .ips
            .iter()
            .filter(|ip| IpFamily::of(**ip) == *family && !requested.ips.contains(ip))
            .count() as u64;
        if allocator.ips_used(*family) >= allocator.ip_capacity(*family) + freed {
            errors.push(FieldError::invalid(
                "spec.clusterIPs",
                family.as_str(),
                format!("range for {} cluster IPs is full", family.as_str()),
            ));
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }

    // Commit: free what is dropped, take what is requested, then pick the rest.
    for ip in previous.ips.iter().filter(|ip| !requested.ips.contains(ip)) {
        allocator.ips.remove(ip);
    }
    for p in previous.ports.difference(&requested.ports) {
        allocator.ports.remove(p);
    }
    allocator.ips.extend(requested.ips.iter().copied());
    allocator.ports.extend(requested.ports.iter().copied());
    let spec = svc.get_mut("spec").ok_or_else(Vec::new)?;
    if wants_ip {
        let mut ips = requested.ips;
        ips.extend(
            missing_ips
                .into_iter()
                .filter_map(|family| allocator.allocate_ip(family)),
        );
        let ips: Vec<String> = ips.iter().map(ToString::to_string).collect();
        set(spec, "clusterIP", json!(ips.first()));
        set(spec, "clusterIPs", json!(ips));
    } else if spec["clusterIP"] == "None" {
        set(spec, "clusterIPs", json!(["None"]));
    }
    if needs_node_ports(spec) {
        let mut picked = Vec::new();
        for port in spec["ports"].as_array().into_iter().flatten() {
            let missing = port["nodePort"].as_u64().is_none_or(|n| n == 0);
            picked.push(if missing {
                allocator.allocate_port()
            } else {
                None
            });
        }
        if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
            for (port, pick) in ports.iter_mut().zip(picked) {
                if let Some(p) = pick {
                    set(port, "nodePort", json!(p));
                }
            }
        }
    }
    if needs_health_check_port(spec)
        && spec["healthCheckNodePort"].as_u64().is_none_or(|n| n == 0)
        && let Some(p) = allocator.allocate_port()
    {
        set(spec, "healthCheckNodePort", json!(p));
    }
    Ok(())
}

/// Create: defaults, validation, allocation; status starts empty.
pub fn prepare_create(svc: &mut Value, allocator: &mut Allocator) -> Result<(), Vec<FieldError>> {
    apply_defaults(svc);
    let mut errors = ip_families(svc, None, allocator.cidrs());
    errors.extend(validate(svc, None, allocator));
    if !errors.is_empty() {
        return Err(errors);
    }
    allocate(svc, &Held::default(), allocator)
}

/// Update: carry allocated values over from `old`, default, validate, re-allocate.
pub fn prepare_update(
    old: &Value,
    svc: &mut Value,
    allocator: &mut Allocator,
) -> Result<(), Vec<FieldError>> {
    carry_over(old, svc);
    apply_defaults(svc);
    let mut errors = ip_families(svc, Some(old), allocator.cidrs());
    errors.extend(validate(svc, Some(old), allocator));
    if !errors.is_empty() {
        return Err(errors);
    }
    allocate(svc, &held(old), allocator)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn allocator() -> Allocator {
        Allocator::new("10.96.0.0/16".parse().unwrap(), PortRange::default())
    }

    fn dual_stack() -> Allocator {
        Allocator::new(
            "10.96.0.0/16,fd00:10:96::/112".parse().unwrap(),
            PortRange::default(),
        )
    }

    fn svc(spec: Value) -> Value {
        json!({"metadata": {"name": "web", "namespace": "default"}, "spec": spec})
    }

    fn fields(errors: &[FieldError]) -> Vec<(&str, &str)> {
        errors
            .iter()
            .map(|e| (e.field.as_str(), e.reason()))
            .collect()
    }

    #[test]
    fn load_balancer_gets_defaults_ip_and_node_ports() {
        let mut alloc = allocator();
        let mut s = svc(
            json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "ports": [{"port": 80}]}),
        );
        prepare_create(&mut s, &mut alloc).unwrap();
        let spec = &s["spec"];
        let ip: IpAddr = spec["clusterIP"].as_str().unwrap().parse().unwrap();
        assert!(alloc.cidrs().of(IpFamily::V4).unwrap().contains(&ip));
        assert_eq!(spec["clusterIPs"], json!([ip.to_string()]));
        assert_eq!(spec["ports"][0]["protocol"], "TCP");
        assert_eq!(spec["ports"][0]["targetPort"], 80);
        assert!((30000..=32767).contains(&spec["ports"][0]["nodePort"].as_u64().unwrap()));
        assert!((30000..=32767).contains(&spec["healthCheckNodePort"].as_u64().unwrap()));
        assert_eq!(spec["sessionAffinity"], "None");
        assert_eq!(spec["ipFamilies"], json!(["IPv4"]));
        assert_eq!(spec["ipFamilyPolicy"], "SingleStack");
        assert_eq!(spec["internalTrafficPolicy"], "Cluster");
        assert_eq!(spec["allocateLoadBalancerNodePorts"], true);
        assert_eq!(alloc.ports.len(), 2);
    }

    #[test]
    fn cluster_ip_service_gets_no_node_ports_and_no_traffic_policy() {
        let mut alloc = allocator();
        let mut s = svc(json!({"ports": [{"port": 80, "targetPort": "http"}]}));
        prepare_create(&mut s, &mut alloc).unwrap();
        assert!(s["spec"]["ports"][0].get("nodePort").is_none());
        assert!(s["spec"].get("externalTrafficPolicy").is_none());
        assert!(alloc.ports.is_empty());
    }

    #[test]
    fn requested_values_are_honoured_and_collisions_rejected() {
        let mut alloc = allocator();
        let mut a = svc(
            json!({"type": "NodePort", "clusterIP": "10.96.5.5", "ports": [{"port": 80, "nodePort": 30080}]}),
        );
        prepare_create(&mut a, &mut alloc).unwrap();
        assert_eq!(a["spec"]["clusterIP"], "10.96.5.5");
        assert_eq!(a["spec"]["ports"][0]["nodePort"], 30080);
        let mut b = svc(
            json!({"type": "NodePort", "clusterIP": "10.96.5.5", "ports": [{"port": 80, "nodePort": 30080}]}),
        );
        let errors = prepare_create(&mut b, &mut alloc).unwrap_err();
        assert_eq!(
            fields(&errors),
            vec![
                ("spec.clusterIP", "FieldValueInvalid"),
                ("spec.ports[0].nodePort", "FieldValueInvalid")
            ]
        );
        assert_eq!(alloc.ports.len(), 1, "a failed create allocates nothing");
        release(&a, &mut alloc);
        prepare_create(&mut b, &mut alloc).unwrap();
    }

    #[test]
    fn invalid_services_list_every_cause() {
        let alloc = allocator();
        let mut s = svc(json!({
            "type": "LoadBalancer",
            "clusterIP": "10.1.0.1",
            "loadBalancerSourceRanges": ["10.0.0.0/8", "banana"],
            "ports": [
                {"name": "a", "port": 80, "nodePort": 99},
                {"name": "a", "port": 80},
                {"port": 70000, "protocol": "ICMP"}
            ]
        }));
        apply_defaults(&mut s);
        let errors = validate(&s, None, &alloc);
        let got = fields(&errors);
        for expected in [
            ("spec.ports[0].nodePort", "FieldValueInvalid"),
            ("spec.ports[1].name", "FieldValueDuplicate"),
            ("spec.ports[1]", "FieldValueDuplicate"),
            ("spec.ports[2].name", "FieldValueRequired"),
            ("spec.ports[2].port", "FieldValueInvalid"),
            ("spec.ports[2].protocol", "FieldValueNotSupported"),
            ("spec.clusterIP", "FieldValueInvalid"),
            ("spec.loadBalancerSourceRanges[1]", "FieldValueInvalid"),
        ] {
            assert!(got.contains(&expected), "{expected:?} missing from {got:?}");
        }
        let unknown = svc(json!({"type": "Bogus", "ports": [{"port": 80, "protocol": "TCP"}]}));
        assert_eq!(
            fields(&validate(&unknown, None, &alloc)),
            vec![("spec.type", "FieldValueNotSupported")]
        );
    }

    #[test]
    fn update_keeps_allocations_and_rejects_cluster_ip_change() {
        let mut alloc = allocator();
        let mut old = svc(json!({"type": "LoadBalancer", "ports": [{"port": 80}]}));
        prepare_create(&mut old, &mut alloc).unwrap();
        let mut new = svc(
            json!({"type": "LoadBalancer", "ports": [{"port": 80}, {"port": 81, "name": "b"}]}),
        );
        new["spec"]["ports"][0]["name"] = json!("a");
        prepare_update(&old, &mut new, &mut alloc).unwrap();
        assert_eq!(new["spec"]["clusterIP"], old["spec"]["clusterIP"]);
        assert_eq!(
            new["spec"]["ports"][0]["nodePort"],
            old["spec"]["ports"][0]["nodePort"]
        );
        assert_eq!(alloc.ports.len(), 2);

        let mut changed = new.clone();
        changed["spec"]["clusterIP"] = json!("10.96.9.9");
        changed["spec"]["clusterIPs"] = json!(["10.96.9.9"]);
        let errors = prepare_update(&new, &mut changed, &mut alloc).unwrap_err();
        assert_eq!(
            fields(&errors),
            vec![("spec.clusterIP", "FieldValueInvalid")]
        );

        let mut to_cluster_ip = new.clone();
        to_cluster_ip["spec"]["type"] = json!("ClusterIP");
        prepare_update(&new, &mut to_cluster_ip, &mut alloc).unwrap();
        assert!(to_cluster_ip["spec"]["ports"][0].get("nodePort").is_none());
        assert!(
            alloc.ports.is_empty(),
            "node ports are released when the type no longer needs them"
        );
    }

    #[test]
    fn leaving_load_balancer_drops_an_unchanged_class_and_keeps_a_changed_one() {
        let mut alloc = allocator();
        let mut old = svc(
            json!({"type": "LoadBalancer", "loadBalancerClass": "example.net/lb",
            "ports": [{"port": 80}]}),
        );
        prepare_create(&mut old, &mut alloc).unwrap();
        let mut to_cluster_ip = old.clone();
        to_cluster_ip["spec"]["type"] = json!("ClusterIP");
        prepare_update(&old, &mut to_cluster_ip, &mut alloc).unwrap();
        assert!(to_cluster_ip["spec"].get("loadBalancerClass").is_none());
        assert!(
            to_cluster_ip["spec"]
                .get("allocateLoadBalancerNodePorts")
                .is_none()
        );

        let mut changed = old.clone();
        changed["spec"]["type"] = json!("ClusterIP");
        changed["spec"]["loadBalancerClass"] = json!("other.example.net/lb");
        let errors = prepare_update(&old, &mut changed, &mut alloc).unwrap_err();
        assert_eq!(
            fields(&errors),
            vec![("spec.loadBalancerClass", "FieldValueForbidden")]
        );
    }

    fn families_and_ips(s: &Value) -> (Value, Value, Vec<IpFamily>) {
        let spec = &s["spec"];
        let ips = spec["clusterIPs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|ip| IpFamily::of(ip.as_str().unwrap().parse().unwrap()))
            .collect();
        (
            spec["ipFamilyPolicy"].clone(),
            spec["ipFamilies"].clone(),
            ips,
        )
    }

    #[test]
    fn families_default_as_the_cluster_has_them() {
        use IpFamily::{V4, V6};
        let cases = [
            // (cluster, requested spec fields, policy, families, IP families)
            (
                allocator(),
                json!({}),
                "SingleStack",
                json!(["IPv4"]),
                vec![V4],
            ),
            (
                allocator(),
                json!({"ipFamilyPolicy": "PreferDualStack"}),
                "PreferDualStack",
                json!(["IPv4"]),
                vec![V4],
            ),
            (
                dual_stack(),
                json!({}),
                "SingleStack",
                json!(["IPv4"]),
                vec![V4],
            ),
            (
                dual_stack(),
                json!({"ipFamilies": ["IPv6"]}),
                "SingleStack",
                json!(["IPv6"]),
                vec![V6],
            ),
            (
                dual_stack(),
                json!({"ipFamilyPolicy": "PreferDualStack"}),
                "PreferDualStack",
                json!(["IPv4", "IPv6"]),
                vec![V4, V6],
            ),
            (
                dual_stack(),
                json!({"ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv6"]}),
                "RequireDualStack",
                json!(["IPv6", "IPv4"]),
                vec![V6, V4],
            ),
            // Two families without a policy ask for dual-stack.
            (
                dual_stack(),
                json!({"ipFamilies": ["IPv6", "IPv4"]}),
                "RequireDualStack",
                json!(["IPv6", "IPv4"]),
                vec![V6, V4],
            ),
            // A requested IPv6 cluster IP names the family.
            (
                dual_stack(),
                json!({"clusterIP": "fd00:10:96::99"}),
                "SingleStack",
                json!(["IPv6"]),
                vec![V6],
            ),
        ];
        for (mut alloc, fields, policy, families, ips) in cases {
            let mut spec = json!({"type": "LoadBalancer", "ports": [{"port": 80}]});
            for (k, v) in fields.as_object().unwrap() {
                spec[k] = v.clone();
            }
            let mut s = svc(spec);
            prepare_create(&mut s, &mut alloc).unwrap_or_else(|e| panic!("{fields}: {e:?}"));
            assert_eq!(
                families_and_ips(&s),
                (json!(policy), families, ips),
                "{fields}"
            );
            assert_eq!(s["spec"]["clusterIP"], s["spec"]["clusterIPs"][0]);
        }
    }

    #[test]
    fn families_the_cluster_lacks_are_refused() {
        let cases = [
            (
                allocator(),
                json!({"ipFamilyPolicy": "RequireDualStack"}),
                "spec.ipFamilyPolicy",
            ),
            (
                allocator(),
                json!({"ipFamilies": ["IPv6"]}),
                "spec.ipFamilies[0]",
            ),
            (
                dual_stack(),
                json!({"ipFamilyPolicy": "SingleStack", "ipFamilies": ["IPv4", "IPv6"]}),
                "spec.ipFamilyPolicy",
            ),
            (
                dual_stack(),
                json!({"ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv4", "IPv4"]}),
                "spec.ipFamilies[1]",
            ),
            (
                dual_stack(),
                json!({"ipFamilies": ["IPv4"], "clusterIP": "fd00:10:96::9"}),
                "spec.ipFamilies[0]",
            ),
            (
                dual_stack(),
                json!({"ipFamilies": ["IPv5"]}),
                "spec.ipFamilies[0]",
            ),
        ];
        for (mut alloc, fields, field) in cases {
            let mut spec = json!({"ports": [{"port": 80}]});
            for (k, v) in fields.as_object().unwrap() {
                spec[k] = v.clone();
            }
            let errors = prepare_create(&mut svc(spec), &mut alloc).unwrap_err();
            assert!(fields_of(&errors).contains(&field), "{fields}: {errors:?}");
            assert!(alloc.ips.is_empty(), "a refused Service holds no IP");
        }
    }

    fn fields_of(errors: &[FieldError]) -> Vec<&str> {
        errors.iter().map(|e| e.field.as_str()).collect()
    }

    #[test]
    fn upgrade_to_dual_stack_and_back_allocates_and_frees_the_second_ip() {
        let mut alloc = dual_stack();
        let mut single = svc(json!({"ports": [{"port": 80}]}));
        prepare_create(&mut single, &mut alloc).unwrap();
        let mut dual = single.clone();
        dual["spec"]["ipFamilyPolicy"] = json!("PreferDualStack");
        prepare_update(&single, &mut dual, &mut alloc).unwrap();
        assert_eq!(dual["spec"]["ipFamilies"], json!(["IPv4", "IPv6"]));
        assert_eq!(dual["spec"]["clusterIPs"][0], single["spec"]["clusterIP"]);
        assert_eq!(alloc.ips.len(), 2);
        // The primary family cannot change.
        let mut flipped = dual.clone();
        flipped["spec"]["ipFamilies"] = json!(["IPv6", "IPv4"]);
        flipped["spec"]["clusterIPs"] = json!([]);
        flipped["spec"]["clusterIP"] = json!("");
        let errors = prepare_update(&dual, &mut flipped, &mut alloc).unwrap_err();
        assert!(
            fields_of(&errors).contains(&"spec.ipFamilies[0]"),
            "{errors:?}"
        );
        // Back to SingleStack: the second family and its IP go.
        let mut back = dual.clone();
        back["spec"]["ipFamilyPolicy"] = json!("SingleStack");
        prepare_update(&dual, &mut back, &mut alloc).unwrap();
        assert_eq!(back["spec"]["ipFamilies"], json!(["IPv4"]));
        assert_eq!(
            back["spec"]["clusterIPs"],
            json!([single["spec"]["clusterIP"]])
        );
        assert_eq!(alloc.ips.len(), 1);
        release(&back, &mut alloc);
        assert!(alloc.ips.is_empty());
    }

    #[test]
    fn service_cidrs_parse_one_or_one_per_family() {
        let dual: ServiceCidrs = "10.96.0.0/16, fd00:10:96::/112".parse().unwrap();
        assert!(dual.is_dual_stack());
        assert_eq!(dual.primary(), IpFamily::V4);
        assert_eq!(dual.to_string(), "10.96.0.0/16,fd00:10:96::/112");
        assert!("10.96.0.0/16,10.97.0.0/16".parse::<ServiceCidrs>().is_err());
        assert!("fd00::/64".parse::<ServiceCidrs>().unwrap().primary() == IpFamily::V6);
        assert!("".parse::<ServiceCidrs>().is_err());
    }

    #[test]
    fn a_large_ipv6_range_allocates_without_walking_it() {
        let mut alloc = Allocator::new("fd00:10:96::/64".parse().unwrap(), PortRange::default());
        let mut s = svc(json!({"ports": [{"port": 80}]}));
        prepare_create(&mut s, &mut alloc).unwrap();
        let ip: IpAddr = s["spec"]["clusterIP"].as_str().unwrap().parse().unwrap();
        assert!(alloc.cidrs().of(IpFamily::V6).unwrap().contains(&ip));
        assert_eq!(s["spec"]["ipFamilies"], json!(["IPv6"]));
    }

    #[test]
    fn port_range_parses() {
        assert_eq!(
            "30000-32767".parse::<PortRange>().unwrap(),
            PortRange::default()
        );
        assert!("5-1".parse::<PortRange>().is_err());
        assert!("x".parse::<PortRange>().is_err());
    }

    #[test]
    fn small_range_fills_up_cleanly() {
        let mut alloc = Allocator::new(
            "10.96.0.0/29".parse().unwrap(),
            "30000-30002".parse().unwrap(),
        );
        for i in 0..3 {
            let mut s = svc(json!({"type": "NodePort", "ports": [{"port": 80}]}));
            s["metadata"]["name"] = json!(format!("s{i}"));
            prepare_create(&mut s, &mut alloc).unwrap();
        }
        let mut full = svc(json!({"type": "NodePort", "ports": [{"port": 80}]}));
        let errors = prepare_create(&mut full, &mut alloc).unwrap_err();
        assert_eq!(fields(&errors), vec![("spec.ports", "FieldValueInvalid")]);
    }

    proptest! {
        #[test]
        fn node_ports_stay_unique_and_in_range(count in 1usize..60, ports_per in 1usize..4) {
            let mut alloc = Allocator::new("10.96.0.0/24".parse().unwrap(), "30000-30200".parse().unwrap());
            let mut seen = HashSet::new();
            let mut ips = HashSet::new();
            for i in 0..count {
                let ports: Vec<Value> = (0..ports_per).map(|p| json!({"name": format!("p{p}"), "port": 80 + p})).collect();
                let mut s = svc(json!({"type": "LoadBalancer", "ports": ports}));
                s["metadata"]["name"] = json!(format!("s{i}"));
                if prepare_create(&mut s, &mut alloc).is_err() {
                    break;
                }
                for p in s["spec"]["ports"].as_array().unwrap() {
                    let n = p["nodePort"].as_u64().unwrap();
                    prop_assert!((30000..=30200).contains(&n));
                    prop_assert!(seen.insert(n));
                }
                prop_assert!(ips.insert(s["spec"]["clusterIP"].as_str().unwrap().to_string()));
            }
        }
    }
}
