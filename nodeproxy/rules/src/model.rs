//! What the node proxy knows about the cluster, reduced to what the rules depend on.
//!
//! The node proxy's runtime converts Kubernetes objects (Services, EndpointSlices, its
//! Node) into these types; rule generation and tracing work only on them.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use tandem_common::{IpFamily, Protocol};

/// `namespace/name:portname` (or `namespace/name` when the port has no name): kube-proxy's
/// `ServicePortName`, the unit that gets one KUBE-SVC chain.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    /// Empty when the Service port has no name.
    pub port: String,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}/{}", self.namespace, self.name)
        } else {
            write!(f, "{}/{}:{}", self.namespace, self.name, self.port)
        }
    }
}

/// How a load balancer delivers traffic for an ingress IP (`status.loadBalancer.ingress[].ipMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum IpMode {
    /// Packets arrive with the LB IP as destination: the node programs KUBE-FW for it.
    #[default]
    Vip,
    /// The LB proxies to node ports: the node must not short-cut the LB IP.
    Proxy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LoadBalancerIngress {
    pub ip: IpAddr,
    pub ip_mode: IpMode,
}

/// One port of one Service, with everything from the Service spec and status that the
/// rules for it depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    pub name: ServicePortName,
    pub protocol: Protocol,
    /// None for headless Services (`clusterIP: None`), which get no rules.
    pub cluster_ip: Option<IpAddr>,
    pub port: u16,
    pub node_port: Option<u16>,
    pub external_ips: Vec<IpAddr>,
    pub load_balancer_ingress: Vec<LoadBalancerIngress>,
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// `sessionAffinity: ClientIP` with its timeout in seconds.
    pub session_affinity_timeout: Option<u32>,
    /// `externalTrafficPolicy: Local` (only meaningful for NodePort/LoadBalancer Services).
    pub external_traffic_policy_local: bool,
    pub health_check_node_port: Option<u16>,
    /// `internalTrafficPolicy: Local`: traffic to the cluster IP stays on this node.
    pub internal_traffic_policy_local: bool,
}

/// One endpoint of a Service port, from an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Endpoint {
    pub ip: IpAddr,
    /// The target port resolved from the EndpointSlice port of the same name.
    pub port: u16,
    /// `conditions.ready` (unset counts as ready, as in the API).
    pub ready: bool,
    /// `conditions.serving` (unset counts as `ready`, as in the API).
    pub serving: bool,
    /// `conditions.terminating`.
    pub terminating: bool,
    /// `nodeName` of the endpoint; compared with [`NodeConfig::node_name`] for "local".
    pub node_name: Option<String>,
    /// `hints` of the endpoint (`None`: neither zone nor node hints). Shared, as every
    /// port of a slice gets a copy of its endpoints and most have no hints at all.
    pub hints: Option<Arc<Hints>>,
}

/// An endpoint's topology hints, written by the EndpointSlice controller for
/// `trafficDistribution` and `service.kubernetes.io/topology-mode: Auto`: the zones
/// (`hints.forZones[].name`) and nodes (`hints.forNodes[].name`, PreferSameNode) whose
/// nodes should use it. Each list is sorted and without repeats: kube-proxy keeps them as
/// sets.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Hints {
    pub zones: Vec<String>,
    pub nodes: Vec<String>,
}

impl Hints {
    /// The hints of these zone and node names; `None` when there are none of either, so
    /// an endpoint without hints costs no allocation.
    pub fn of<Z, N>(zones: Z, nodes: N) -> Option<Arc<Hints>>
    where
        Z: IntoIterator,
        Z::Item: Into<String>,
        N: IntoIterator,
        N::Item: Into<String>,
    {
        let set = |names: Vec<String>| {
            let mut names = names;
            names.sort();
            names.dedup();
            names
        };
        let hints = Hints {
            zones: set(zones.into_iter().map(Into::into).collect()),
            nodes: set(nodes.into_iter().map(Into::into).collect()),
        };
        (hints != Hints::default()).then(|| Arc::new(hints))
    }

    /// Hinted for the zone `zone` (kube-proxy's `ZoneHints().Has(zone)`).
    pub fn for_zone(&self, zone: &str) -> bool {
        self.zones
            .binary_search_by(|z| z.as_str().cmp(zone))
            .is_ok()
    }

    /// Hinted for the node `node` (kube-proxy's `NodeHints().Has(node)`).
    pub fn for_node(&self, node: &str) -> bool {
        self.nodes
            .binary_search_by(|n| n.as_str().cmp(node))
            .is_ok()
    }
}

impl Endpoint {
    /// Gets new connections: ready and not terminating.
    pub fn is_ready(&self) -> bool {
        self.ready && !self.terminating
    }

    /// Terminating but still able to serve: the fallback when a Service port has no ready
    /// endpoint where it needs one (KEP-1669).
    pub fn is_serving_terminating(&self) -> bool {
        self.serving && self.terminating
    }

    /// The zones this endpoint is hinted for (empty: no zone hints).
    pub fn zone_hints(&self) -> &[String] {
        self.hints.as_deref().map_or(&[], |hints| &hints.zones)
    }

    /// The nodes this endpoint is hinted for (empty: no node hints).
    pub fn node_hints(&self) -> &[String] {
        self.hints.as_deref().map_or(&[], |hints| &hints.nodes)
    }
}

/// Everything the node proxy observes of one IP family, keyed for deterministic output: as
/// kube-proxy's proxier per family, the Services with a cluster IP of that family, only
/// their addresses and source ranges of that family, and the EndpointSlices of its
/// `addressType`.
///
/// It holds no address of another family whatever is put in: every way in drops them (a
/// cluster IP of another family leaves its port headless) and truncates source ranges to
/// their prefix, so the rule layouts take what it holds as it is. A port without
/// endpoints has no entry in [`ProxyState::endpoints`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyState {
    family: IpFamily,
    services: BTreeMap<ServicePortName, ServicePort>,
    endpoints: BTreeMap<ServicePortName, Vec<Endpoint>>,
}

impl ProxyState {
    /// An empty state of `family`.
    pub fn new(family: IpFamily) -> Self {
        Self {
            family,
            services: BTreeMap::new(),
            endpoints: BTreeMap::new(),
        }
    }

    /// The state of `family` of these Service ports and endpoint lists. Its maps are built
    /// in bulk, which leaves their nodes full: grown by inserts in key order they stay
    /// half empty.
    pub fn from_entries(
        family: IpFamily,
        services: impl IntoIterator<Item = ServicePort>,
        endpoints: impl IntoIterator<Item = (ServicePortName, Vec<Endpoint>)>,
    ) -> Self {
        let services = services
            .into_iter()
            .map(|mut service| {
                service.keep_family(family);
                (service.name.clone(), service)
            })
            .collect();
        let endpoints = endpoints
            .into_iter()
            .filter_map(|(name, mut endpoints)| {
                keep_family(&mut endpoints, family);
                (!endpoints.is_empty()).then_some((name, endpoints))
            })
            .collect();
        Self {
            family,
            services,
            endpoints,
        }
    }

    /// The family of every address it holds.
    pub fn family(&self) -> IpFamily {
        self.family
    }

    pub fn services(&self) -> &BTreeMap<ServicePortName, ServicePort> {
        &self.services
    }

    pub fn endpoints(&self) -> &BTreeMap<ServicePortName, Vec<Endpoint>> {
        &self.endpoints
    }

    /// The endpoints of a Service port; none when no EndpointSlice names it.
    pub fn endpoints_of(&self, name: &ServicePortName) -> &[Endpoint] {
        self.endpoints.get(name).map_or(&[], Vec::as_slice)
    }

    /// Puts in a Service port under its name (replacing the one there), with this
    /// family's addresses only.
    pub fn insert_service(&mut self, mut service: ServicePort) {
        service.keep_family(self.family);
        self.services.insert(service.name.clone(), service);
    }

    /// Sets the endpoints of a Service port to those of this family among `endpoints`;
    /// without any, the port has no entry.
    pub fn insert_endpoints(&mut self, name: ServicePortName, mut endpoints: Vec<Endpoint>) {
        keep_family(&mut endpoints, self.family);
        if endpoints.is_empty() {
            self.endpoints.remove(&name);
        } else {
            self.endpoints.insert(name, endpoints);
        }
    }

    /// Puts in every Service port and endpoint list of `other` (a state of another family
    /// gives only this family's addresses).
    pub fn extend(&mut self, other: ProxyState) {
        for service in other.services.into_values() {
            self.insert_service(service);
        }
        for (name, endpoints) in other.endpoints {
            self.insert_endpoints(name, endpoints);
        }
    }

    /// Takes a Service port and its endpoints out.
    pub fn remove(&mut self, name: &ServicePortName) {
        self.services.remove(name);
        self.endpoints.remove(name);
    }

    /// Moves a Service port and its endpoints, those of them this state has, into `to`.
    pub fn move_port(&mut self, name: &ServicePortName, to: &mut ProxyState) {
        if let Some(service) = self.services.remove(name) {
            to.insert_service(service);
        }
        if let Some(endpoints) = self.endpoints.remove(name) {
            to.insert_endpoints(name.clone(), endpoints);
        }
    }

    /// Keeps the Service ports, and the endpoints, of the names `keep` holds for, given
    /// the name and its Service port (none for endpoints without one).
    pub fn retain(&mut self, mut keep: impl FnMut(&ServicePortName, Option<&ServicePort>) -> bool) {
        let services = &self.services;
        self.endpoints
            .retain(|name, _| keep(name, services.get(name)));
        self.services
            .retain(|name, service| keep(name, Some(service)));
    }

    /// Changes every Service port in place (its name, its key, must stay), each keeping
    /// this family's addresses only after.
    pub fn edit_services(&mut self, mut edit: impl FnMut(&mut ServicePort)) {
        let family = self.family;
        for service in self.services.values_mut() {
            edit(service);
            service.keep_family(family);
        }
    }

    /// Changes the endpoints of every Service port that has some in place, each keeping
    /// this family's only after (a port left with none has no entry).
    pub fn edit_endpoints(&mut self, mut edit: impl FnMut(&ServicePortName, &mut Vec<Endpoint>)) {
        let family = self.family;
        self.endpoints.retain(|name, endpoints| {
            edit(name, endpoints);
            keep_family(endpoints, family);
            !endpoints.is_empty()
        });
    }

    /// Builds the maps again in bulk, which leaves their nodes full: after most ports
    /// were put in by inserts in key order (a first sync), they are half empty.
    pub fn compact(&mut self) {
        self.services = std::mem::take(&mut self.services).into_iter().collect();
        self.endpoints = std::mem::take(&mut self.endpoints).into_iter().collect();
    }
}

impl ServicePort {
    /// Drops the addresses not of `family` (a cluster IP of another family leaves the port
    /// headless) and truncates the source ranges to their prefix.
    fn keep_family(&mut self, family: IpFamily) {
        self.cluster_ip = self.cluster_ip.filter(|ip| family.holds(*ip));
        self.external_ips.retain(|ip| family.holds(*ip));
        self.load_balancer_ingress
            .retain(|ingress| family.holds(ingress.ip));
        self.load_balancer_source_ranges.retain_mut(|range| {
            *range = range.trunc();
            family.holds(range.addr())
        });
    }
}

/// Drops the endpoints not of `family`.
fn keep_family(endpoints: &mut Vec<Endpoint>, family: IpFamily) {
    endpoints.retain(|endpoint| family.holds(endpoint.ip));
}

/// A network interface's name (or name prefix), as the kernel allows it: 1 to 15 bytes
/// (`IFNAMSIZ` less the NUL), none of them a space, `/`, `"` or a control character, and no
/// `+` or `*` (the iptables and nftables wildcards).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InterfaceName(String);

/// Why a string is not an [`InterfaceName`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InterfaceNameError {
    #[error("an interface name cannot be empty")]
    Empty,
    #[error("{0:?} is longer than an interface name can be (15 bytes)")]
    TooLong(String),
    #[error(
        "{0:?} holds a character an interface name cannot (space, /, \", +, * or a control character)"
    )]
    BadCharacter(String),
}

impl std::str::FromStr for InterfaceName {
    type Err = InterfaceNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Err(InterfaceNameError::Empty);
        }
        if s.len() > 15 {
            return Err(InterfaceNameError::TooLong(s.to_owned()));
        }
        let bad = |c: char| c.is_whitespace() || c.is_control() || "/\"+*".contains(c);
        if s.contains(bad) {
            return Err(InterfaceNameError::BadCharacter(s.to_owned()));
        }
        Ok(Self(s.to_owned()))
    }
}

impl InterfaceName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InterfaceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How one family's proxier tells traffic from this cluster's pods from the rest,
/// kube-proxy's `LocalTrafficDetector` (`--detect-local-mode`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LocalDetector {
    /// No detection (no CIDR of this family given): kube-proxy's no-op detector, no rule
    /// that needs it is written.
    #[default]
    None,
    /// `ClusterCIDR`: sources in `--cluster-cidr` of this family.
    ClusterCidr(IpNet),
    /// `NodeCIDR`: sources in this Node's `spec.podCIDRs` of this family.
    NodeCidr(IpNet),
    /// `BridgeInterface`: packets that came in on `--pod-bridge-interface`.
    BridgeInterface(InterfaceName),
    /// `InterfaceNamePrefix`: packets that came in on an interface whose name starts with
    /// `--pod-interface-name-prefix`.
    InterfaceNamePrefix(InterfaceName),
}

impl LocalDetector {
    /// kube-proxy's `IfLocal()` (`negated` false) or `IfNotLocal()` (true), as iptables
    /// arguments: `-s CIDR`, `-i NAME` or `-i PREFIX+`; none without detection.
    pub fn iptables(&self, negated: bool) -> Option<String> {
        let not = if negated { "! " } else { "" };
        Some(match self {
            Self::None => return None,
            Self::ClusterCidr(net) | Self::NodeCidr(net) => format!("{not}-s {}", net.trunc()),
            Self::BridgeInterface(name) => format!("{not}-i {name}"),
            Self::InterfaceNamePrefix(prefix) => format!("{not}-i {prefix}+"),
        })
    }

    /// The same as an nftables match: `ip saddr CIDR`, `iifname "NAME"` or
    /// `iifname "PREFIX*"` (kube-proxy writes `iif`, which needs the interface to exist
    /// when the rule is added and takes no wildcard; `iifname` matches the same packets
    /// without either limit). None without detection, or for a CIDR of another family.
    pub fn nft(&self, family: IpFamily, negated: bool) -> Option<tandem_nftables::Match> {
        use tandem_nftables::Match;
        match self {
            Self::None => None,
            Self::ClusterCidr(net) | Self::NodeCidr(net) => {
                family.holds(net.addr()).then(|| Match::SourceAddress {
                    net: net.trunc(),
                    negated,
                })
            }
            Self::BridgeInterface(name) => Some(Match::InputInterface {
                name: name.to_string(),
                prefix: false,
                negated,
            }),
            Self::InterfaceNamePrefix(prefix) => Some(Match::InputInterface {
                name: prefix.to_string(),
                prefix: true,
                negated,
            }),
        }
    }
}

/// This node's settings, for the proxier of one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    pub node_name: String,
    /// The node's `topology.kubernetes.io/zone` label (`None`: no label), which endpoint
    /// zone hints are matched against. An empty label is no zone, as in kube-proxy.
    pub zone: Option<String>,
    /// The family of every address the proxier writes.
    pub family: IpFamily,
    /// How this family's proxier tells traffic from pods (`--detect-local-mode`): traffic
    /// to cluster IPs from anything else is masqueraded, and pods reaching an LB or
    /// external IP of an externalTrafficPolicy Local Service short-cut to all endpoints.
    pub local_detector: LocalDetector,
    /// The node's primary address of this family (its Node's first InternalIP, else
    /// ExternalIP), as kube-proxy detects it: a source range holding it also lets the LB
    /// IP itself in as a source (traffic from this node looped back to it), kube-proxy's
    /// `allowFromNode`.
    pub node_ip: Option<IpAddr>,
    /// `--masquerade-all`: every connection to a cluster IP is masqueraded, not only those
    /// from outside the cluster CIDR.
    pub masquerade_all: bool,
    /// `--nodeport-addresses` of this family: the local addresses node ports are served on.
    pub node_port_addresses: NodePortAddresses,
    /// `--iptables-localhost-nodeports`: the iptables mode serves node ports on
    /// 127.0.0.0/8 too (which needs `route_localnet`; IPv6 has no such switch, and
    /// kube-proxy never writes the loopback exception there). The nftables mode never does.
    pub localhost_node_ports: bool,
    /// The Service CIDRs of this family: in the nftables mode, new connections to an
    /// address in them that no Service holds are dropped (kube-proxy's
    /// `cluster-ips-check`). From the cluster's ServiceCIDR objects where the API server
    /// serves them (followed as they change), else `--service-cluster-ip-range`; see
    /// [`service_cidrs_of`].
    pub service_cidrs: Vec<IpNet>,
}

impl NodeConfig {
    /// An IPv4 node with kube-proxy's defaults for everything but its name and cluster
    /// CIDR (local traffic detected by it, kube-proxy's `ClusterCIDR` mode).
    pub fn new(node_name: impl Into<String>, cluster_cidr: Option<IpNet>) -> Self {
        Self {
            node_name: node_name.into(),
            zone: None,
            family: IpFamily::V4,
            local_detector: cluster_cidr.map_or(LocalDetector::None, LocalDetector::ClusterCidr),
            node_ip: None,
            masquerade_all: false,
            node_port_addresses: NodePortAddresses::All,
            localhost_node_ports: true,
            service_cidrs: Vec::new(),
        }
    }

    /// Whether a source range of a Service lets in its LB IPs as sources too: it holds this
    /// node's IP (kube-proxy's `allowFromNode`).
    pub fn allows_from_node(&self, source_ranges: &[IpNet]) -> bool {
        self.node_ip
            .is_some_and(|ip| source_ranges.iter().any(|range| range.contains(&ip)))
    }

    /// This family's loopback addresses.
    pub fn loopback(&self) -> IpNet {
        self.family.loopback()
    }

    /// Whether node ports may be served on a loopback address of this family.
    pub fn node_ports_overlap_loopback(&self) -> bool {
        match &self.node_port_addresses {
            NodePortAddresses::All => true,
            NodePortAddresses::Cidrs(cidrs) => {
                cidrs.iter().any(|cidr| overlaps(*cidr, self.loopback()))
            }
        }
    }
}

/// The Service CIDRs of `family` among `cidrs` (every CIDR of every ServiceCIDR object, of
/// both families), truncated, in order and without repeats: kube-proxy's
/// `OnServiceCIDRsChanged`, which keeps the CIDRs of its proxier's family. Every object
/// counts whatever its status, also one being deleted (its finalizer holds it while
/// cluster IPs in it are still allocated), as kube-proxy's ServiceCIDR informer keeps
/// them all. Two objects may name one CIDR; it counts once, and stays while either does.
pub fn service_cidrs_of(family: IpFamily, cidrs: impl IntoIterator<Item = IpNet>) -> Vec<IpNet> {
    let mut of_family: Vec<IpNet> = cidrs
        .into_iter()
        .filter(|cidr| family.holds(cidr.addr()))
        .map(|cidr| cidr.trunc())
        .collect();
    of_family.sort();
    of_family.dedup();
    of_family
}

/// Where node ports are served (kube-proxy's `--nodeport-addresses`, resolved).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every local address of the node (no flag, or a CIDR of length 0).
    All,
    /// The node's local addresses inside these CIDRs (never empty; `primary` is the node's
    /// IP as a host prefix).
    Cidrs(Vec<IpNet>),
}

impl NodePortAddresses {
    /// kube-proxy's reading of a CIDR list of one family: empty, or holding `0.0.0.0/0`
    /// (`::/0`), means every address.
    pub fn from_cidrs(cidrs: &[IpNet]) -> Self {
        if cidrs.is_empty() || cidrs.iter().any(|cidr| cidr.prefix_len() == 0) {
            return Self::All;
        }
        let mut cidrs: Vec<IpNet> = cidrs.iter().map(IpNet::trunc).collect();
        cidrs.sort();
        cidrs.dedup();
        Self::Cidrs(cidrs)
    }
}

/// Two prefixes share an address exactly when one contains the other (never across
/// families).
pub fn overlaps(a: IpNet, b: IpNet) -> bool {
    a.contains(&b) || b.contains(&a)
}

/// A sorted copy of `items` without duplicates: the one order the rules write a list of
/// addresses in, whatever order the API gave it.
pub(crate) fn sorted_unique<T: Ord + Clone>(items: &[T]) -> Vec<T> {
    let mut items = items.to_vec();
    items.sort();
    items.dedup();
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn name() -> ServicePortName {
        ServicePortName {
            namespace: "default".into(),
            name: "web".into(),
            port: "http".into(),
        }
    }

    fn endpoint(ip: &str) -> Endpoint {
        Endpoint {
            ip: self::ip(ip),
            port: 8080,
            ready: true,
            serving: true,
            terminating: false,
            node_name: Some("node-a".into()),
            hints: None,
        }
    }

    /// A LoadBalancer port with `cluster_ip` and the given addresses, ranges and endpoints.
    fn port(
        cluster_ip: &str,
        addresses: &[&str],
        ranges: &[&str],
        endpoints: &[&str],
    ) -> (ServicePort, Vec<Endpoint>) {
        let service = ServicePort {
            name: name(),
            protocol: Protocol::Tcp,
            cluster_ip: Some(ip(cluster_ip)),
            port: 80,
            node_port: Some(30080),
            external_ips: addresses.iter().map(|a| ip(a)).collect(),
            load_balancer_ingress: addresses
                .iter()
                .map(|a| LoadBalancerIngress {
                    ip: ip(a),
                    ip_mode: IpMode::Vip,
                })
                .collect(),
            load_balancer_source_ranges: ranges.iter().map(|r| net(r)).collect(),
            session_affinity_timeout: None,
            external_traffic_policy_local: false,
            health_check_node_port: None,
            internal_traffic_policy_local: false,
        };
        (service, endpoints.iter().map(|e| endpoint(e)).collect())
    }

    fn state_of(
        family: IpFamily,
        (service, endpoints): (ServicePort, Vec<Endpoint>),
    ) -> ProxyState {
        let mut state = ProxyState::new(family);
        state.insert_endpoints(service.name.clone(), endpoints);
        state.insert_service(service);
        state
    }

    #[test]
    fn a_state_keeps_its_familys_addresses_only_and_the_layouts_see_nothing_else() {
        let mixed = port(
            "10.96.0.10",
            &["192.0.2.10", "2001:db8::10"],
            &["203.0.113.77/24", "2001:db8:203::77/64"],
            &["10.244.1.5", "fd00:10:244:1::5"],
        );
        let v4 = port(
            "10.96.0.10",
            &["192.0.2.10"],
            &["203.0.113.0/24"],
            &["10.244.1.5"],
        );
        let state = state_of(IpFamily::V4, mixed.clone());
        assert_eq!(state.family(), IpFamily::V4);
        assert_eq!(state.services()[&name()], v4.0);
        assert_eq!(state.endpoints_of(&name()), v4.1);
        // Every way in normalises alike.
        let built =
            ProxyState::from_entries(IpFamily::V4, [mixed.0.clone()], [(name(), mixed.1.clone())]);
        assert_eq!(built, state);
        let mut edited = state.clone();
        edited.edit_services(|service| service.external_ips.push(ip("2001:db8::11")));
        assert_eq!(edited, state);

        // Both layouts write for the mixed input what they write for its IPv4 part alone.
        let node = NodeConfig::new("node-a", Some(net("10.244.0.0/16")));
        let filtered = state_of(IpFamily::V4, v4);
        assert_eq!(
            crate::nft::build(&state, &node),
            crate::nft::build(&filtered, &node)
        );
        assert_eq!(crate::build(&state, &node), crate::build(&filtered, &node));
    }

    #[test]
    fn a_port_of_another_familys_cluster_ip_is_headless_and_endpoints_of_it_are_none() {
        let v6 = port(
            "fd00:10:96::10",
            &["2001:db8::10"],
            &[],
            &["fd00:10:244:1::5"],
        );
        let state = state_of(IpFamily::V4, v6);
        let service = &state.services()[&name()];
        assert_eq!(service.cluster_ip, None);
        assert!(service.external_ips.is_empty() && service.load_balancer_ingress.is_empty());
        assert!(state.endpoints().is_empty());
    }
}
