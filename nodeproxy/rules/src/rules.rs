//! Observed state in, the whole kube-proxy v1.21 ruleset out (`syncProxyRules`, minus I/O),
//! plus the KUBE-SVL chains of internalTrafficPolicy Local, which v1.21 did not have.
//!
//! Rule texts are written in the form `iptables-save` prints them (addresses and protocol
//! first, then the matches in order, expanded targets such as `--set-xmark`), which
//! `iptables-restore` accepts unchanged: so the desired ruleset can be compared with what
//! the kernel reports byte for byte.

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use tandem_common::{IpFamily, Protocol};

use crate::chains::{
    self, DROP_MARK, KUBE_EXTERNAL_SERVICES, KUBE_FORWARD, KUBE_MARK_DROP, KUBE_MARK_MASQ,
    KUBE_NODEPORTS, KUBE_POSTROUTING, KUBE_PROXY_FIREWALL, KUBE_SERVICES, MASQUERADE_MARK,
};
use crate::model::{
    Endpoint, LocalDetector, NodeConfig, NodePortAddresses, ProxyState, ServicePort, overlaps,
    sorted_unique,
};
use crate::ruleset::{Ruleset, Table};
use crate::topology::{PortPaths, UsableEndpoint, usable_endpoints};

/// The complete desired ruleset for this node: every chain the node proxy owns in the nat
/// and filter tables, with all of its rules. Headless Services get no rules; which endpoints
/// are used is [`crate::topology::choose_endpoints`]' decision (ready ones as the topology
/// hints allow, else serving terminating ones).
pub fn build(state: &ProxyState, node: &NodeConfig) -> Ruleset {
    debug_assert_eq!(state.family(), node.family, "a state of the node's family");
    let mut out = RulesetBuilder::with_fixed_chains();
    for service in state.services().values() {
        out.add_service_port(
            service,
            &usable_endpoints(state.endpoints_of(&service.name), node),
            node,
        );
    }
    for rule in last_service_rules(node) {
        out.nat(KUBE_SERVICES, rule);
    }
    out.ruleset
}

/// The chains Service ports share: each adds its rules to them, in Service port order.
/// Every other chain a port writes is its own (KUBE-SVC, KUBE-SVL, KUBE-SEP, KUBE-FW,
/// KUBE-XLB).
pub const DISPATCH_CHAINS: [(Table, &str); 5] = [
    (Table::Filter, KUBE_SERVICES),
    (Table::Filter, KUBE_EXTERNAL_SERVICES),
    (Table::Filter, KUBE_NODEPORTS),
    (Table::Nat, KUBE_SERVICES),
    (Table::Nat, KUBE_NODEPORTS),
];

/// The rules nat KUBE-SERVICES ends with, after every Service port's rules: the jumps to
/// KUBE-NODEPORTS for the node's local addresses, all of them or those inside
/// `--nodeport-addresses`, without 127.0.0.0/8 when `--iptables-localhost-nodeports` is
/// off (`::1/128` in IPv6). kube-proxy writes one `-d IP` jump per address of the node it finds in the CIDRs
/// at each sync; a CIDR with `--dst-type LOCAL` is the same set of addresses, and follows
/// address changes without a sync.
pub fn last_service_rules(node: &NodeConfig) -> Vec<String> {
    let nodeports = || {
        RuleText::new()
            .comment("kubernetes service nodeports; NOTE: this must be the last rule in this chain")
            .matching("-m addrtype --dst-type LOCAL")
    };
    let loopback = node.loopback();
    let cidrs = match &node.node_port_addresses {
        NodePortAddresses::All if node.localhost_node_ports => {
            return vec![nodeports().jump(KUBE_NODEPORTS)];
        }
        // kube-proxy ≥ 1.26's rule for `--iptables-localhost-nodeports=false`.
        NodePortAddresses::All => {
            return vec![nodeports().not_destination(loopback).jump(KUBE_NODEPORTS)];
        }
        NodePortAddresses::Cidrs(cidrs) => cidrs,
    };
    let mut rules = Vec::new();
    // One match on the destination per rule: loopback leaves first when a CIDR holds more.
    let holds_more = |c: &IpNet| overlaps(*c, loopback) && c.prefix_len() < loopback.prefix_len();
    if !node.localhost_node_ports && cidrs.iter().any(holds_more) {
        rules.push(nodeports().destination_net(loopback).jump("RETURN"));
    }
    for cidr in cidrs {
        if !node.localhost_node_ports && loopback.contains(cidr) {
            continue;
        }
        rules.push(nodeports().destination_net(*cidr).jump(KUBE_NODEPORTS));
    }
    rules
}

/// The rules of one Service port alone: its own chains with their rules, and (under the
/// [`DISPATCH_CHAINS`] names) the rules it adds to the shared chains. [`build`] is the
/// fixed chains, then these for every port in [`ServicePortName`] order, then
/// [`last_service_rule`]. `svc` and `endpoints` are a port of a [`ProxyState`] of the
/// node's family, which holds that family's addresses only.
///
/// [`ServicePortName`]: crate::model::ServicePortName
pub fn port_rules(svc: &ServicePort, endpoints: &[Endpoint], node: &NodeConfig) -> Ruleset {
    let mut out = RulesetBuilder {
        ruleset: Ruleset::default(),
    };
    out.add_service_port(svc, &usable_endpoints(endpoints, node), node);
    out.ruleset
}

/// `--probability` for the i-th of n remaining endpoints (1/n), as `iptables-save` prints
/// it: kube-proxy writes 1/n with 10 decimals, the kernel stores it as a fraction of 2^31,
/// and iptables prints that fraction with 11 decimals (1/3 → `0.33333333349`).
pub fn probability(n: usize) -> String {
    const SCALE: f64 = 2_147_483_648.0; // 0x80000000, libxt_statistic's fixed point
    let exact = 1.0 / n as f64;
    let written: f64 = format!("{exact:.10}").parse().unwrap_or(exact);
    let stored = (written * SCALE).round();
    format!("{:.11}", stored / SCALE)
}

/// One rule's text, assembled in `iptables-save` order.
#[derive(Debug, Default)]
struct RuleText {
    source: Option<String>,
    destination: Option<String>,
    in_interface: Option<String>,
    protocol: Option<Protocol>,
    matches: Vec<String>,
}

impl RuleText {
    fn new() -> Self {
        Self::default()
    }

    fn source(mut self, cidr: impl ToString) -> Self {
        self.source = Some(format!("-s {}", cidr.to_string()));
        self
    }

    /// The local-traffic detector's match, kube-proxy's `IfLocal()` or (`negated`)
    /// `IfNotLocal()`: a source CIDR, or an input interface (`-i`), each where
    /// `iptables-save` puts it.
    fn local(mut self, detector: &LocalDetector, negated: bool) -> Self {
        let text = detector.iptables(negated);
        match detector {
            LocalDetector::None => {}
            LocalDetector::ClusterCidr(_) | LocalDetector::NodeCidr(_) => self.source = text,
            LocalDetector::BridgeInterface(_) | LocalDetector::InterfaceNamePrefix(_) => {
                self.in_interface = text
            }
        }
        self
    }

    fn destination(self, ip: IpAddr) -> Self {
        self.destination_net(IpNet::from(ip))
    }

    fn destination_net(mut self, net: IpNet) -> Self {
        self.destination = Some(format!("-d {net}"));
        self
    }

    fn not_destination(mut self, net: IpNet) -> Self {
        self.destination = Some(format!("! -d {net}"));
        self
    }

    fn protocol(mut self, protocol: Protocol) -> Self {
        self.protocol = Some(protocol);
        self
    }

    fn comment(self, text: &str) -> Self {
        self.matching(&format!("-m comment --comment \"{text}\""))
    }

    fn matching(mut self, text: &str) -> Self {
        self.matches.push(text.to_owned());
        self
    }

    /// `-m tcp --dport N` (the protocol must also be set with [`RuleText::protocol`]).
    fn dport(self, protocol: Protocol, port: u16) -> Self {
        self.matching(&format!("-m {} --dport {port}", protocol.as_str()))
    }

    fn jump(self, target: &str) -> String {
        let mut text = String::new();
        let protocol = self.protocol.map(|p| format!("-p {}", p.as_str()));
        let parts = [self.source, self.destination, self.in_interface, protocol]
            .into_iter()
            .flatten();
        for part in parts.chain(self.matches) {
            let _ = write!(text, "{part} ");
        }
        let _ = write!(text, "-j {target}");
        text
    }
}

struct RulesetBuilder {
    ruleset: Ruleset,
}

impl RulesetBuilder {
    /// The chains that exist whatever the Services are, with their fixed rules.
    fn with_fixed_chains() -> Self {
        let mut out = Self {
            ruleset: Ruleset::default(),
        };
        for chain in [
            KUBE_SERVICES,
            KUBE_EXTERNAL_SERVICES,
            KUBE_FORWARD,
            KUBE_NODEPORTS,
            KUBE_PROXY_FIREWALL,
        ] {
            out.declare(Table::Filter, chain);
        }
        for chain in [
            KUBE_SERVICES,
            KUBE_NODEPORTS,
            KUBE_POSTROUTING,
            KUBE_MARK_MASQ,
            KUBE_MARK_DROP,
        ] {
            out.declare(Table::Nat, chain);
        }

        let postrouting = [
            RuleText::new()
                .matching(&format!("-m mark ! --mark {MASQUERADE_MARK}"))
                .jump("RETURN"),
            // Clear the mark so a packet that traverses the stack again is not re-masqueraded.
            RuleText::new().jump("MARK --set-xmark 0x4000/0x0"),
            RuleText::new()
                .comment("kubernetes service traffic requiring SNAT")
                .jump("MASQUERADE --random-fully"),
        ];
        for rule in postrouting {
            out.nat(KUBE_POSTROUTING, rule);
        }
        out.nat(
            KUBE_MARK_MASQ,
            RuleText::new().jump(&format!("MARK --set-xmark {MASQUERADE_MARK}")),
        );
        out.nat(
            KUBE_MARK_DROP,
            RuleText::new().jump(&format!("MARK --set-xmark {DROP_MARK}")),
        );

        out.filter(
            KUBE_PROXY_FIREWALL,
            RuleText::new()
                .comment("kubernetes firewall for dropping marked packets")
                .matching(&format!("-m mark --mark {DROP_MARK}"))
                .jump("DROP"),
        );
        out.add_forward_rules();
        out
    }

    /// KUBE-FORWARD exactly as kube-proxy v1.21 writes it: v1.21 no longer restricts the
    /// two conntrack rules to the cluster CIDR (the reference dump, taken with a cluster
    /// CIDR set, has none).
    fn add_forward_rules(&mut self) {
        let rules = [
            RuleText::new()
                .matching("-m conntrack --ctstate INVALID")
                .jump("DROP"),
            RuleText::new()
                .comment("kubernetes forwarding rules")
                .matching(&format!("-m mark --mark {MASQUERADE_MARK}"))
                .jump("ACCEPT"),
            RuleText::new()
                .comment("kubernetes forwarding conntrack pod source rule")
                .matching("-m conntrack --ctstate RELATED,ESTABLISHED")
                .jump("ACCEPT"),
            RuleText::new()
                .comment("kubernetes forwarding conntrack pod destination rule")
                .matching("-m conntrack --ctstate RELATED,ESTABLISHED")
                .jump("ACCEPT"),
        ];
        for rule in rules {
            self.filter(KUBE_FORWARD, rule);
        }
    }

    fn declare(&mut self, table: Table, chain: &str) {
        self.ruleset
            .table_mut(table)
            .chains
            .entry(chain.to_owned())
            .or_default();
    }

    fn push(&mut self, table: Table, chain: &str, rule: String) {
        let chains = &mut self.ruleset.table_mut(table).chains;
        // Look up before allocating the key: most pushes go to an existing chain.
        match chains.get_mut(chain) {
            Some(rules) => rules.push(rule),
            None => {
                chains.insert(chain.to_owned(), vec![rule]);
            }
        }
    }

    fn nat(&mut self, chain: &str, rule: String) {
        self.push(Table::Nat, chain, rule);
    }

    fn filter(&mut self, chain: &str, rule: String) {
        self.push(Table::Filter, chain, rule);
    }

    fn add_service_port(
        &mut self,
        svc: &ServicePort,
        endpoints: &[UsableEndpoint],
        node: &NodeConfig,
    ) {
        let Some(port) = PortContext::new(svc, endpoints, node) else {
            return; // headless: DNS only, no proxying
        };
        if port.has_endpoints {
            if port.uses_cluster {
                self.declare(Table::Nat, &port.chains.service);
            }
            self.add_endpoint_chains(&port);
            if port.local_policy {
                self.declare(Table::Nat, &port.chains.external_local);
            }
        }
        self.add_cluster_ip(&port);
        self.add_external_ips(&port);
        self.add_load_balancer_ips(&port);
        self.add_node_port(&port);
        self.add_health_check_port(&port);
        if port.has_endpoints {
            if port.uses_cluster {
                let cluster: Vec<&str> = port
                    .endpoints
                    .iter()
                    .filter(|ep| ep.cluster)
                    .map(|ep| ep.chain.as_str())
                    .collect();
                let service = &port.chains.service;
                self.add_balancing_rules(&port, service, &cluster, |_| port.name.clone());
            }
            if port.internal_local && port.has_local_endpoints() {
                self.add_service_local_chain(&port);
            }
            if port.local_policy {
                self.add_external_local_chain(&port);
            }
        }
    }

    /// The cluster-IP rules. With internalTrafficPolicy Local they lead to KUBE-SVL, which
    /// holds the off-cluster masquerade rule itself, as kube-proxy ≥ v1.24 writes it; with
    /// endpoints elsewhere only, the cluster IP is dropped, not rejected, as kube-proxy
    /// does: the Service has endpoints, just none this node may use.
    fn add_cluster_ip(&mut self, port: &PortContext) {
        let capture = || port.capture(port.cluster_ip, "cluster IP");
        if !port.has_endpoints {
            self.filter(
                KUBE_SERVICES,
                port.capture(port.cluster_ip, "has no endpoints")
                    .jump(reject(port.family)),
            );
            return;
        }
        if port.internal_local {
            if port.has_local_endpoints() {
                self.nat(KUBE_SERVICES, capture().jump(&port.chains.service_local));
            } else {
                let drop = port.capture(port.cluster_ip, "has no local endpoints");
                self.filter(KUBE_SERVICES, drop.jump("DROP"));
            }
            return;
        }
        if let Some(masquerade) = port.cluster_ip_masquerade() {
            self.nat(KUBE_SERVICES, masquerade);
        }
        self.nat(KUBE_SERVICES, capture().jump(&port.chains.service));
    }

    fn add_external_ips(&mut self, port: &PortContext) {
        for &external_ip in &sorted_unique(&port.svc.external_ips) {
            if !port.has_endpoints {
                let reject = port
                    .capture(external_ip, "has no endpoints")
                    .jump(reject(port.family));
                self.filter(KUBE_EXTERNAL_SERVICES, reject);
                continue;
            }
            let capture = || port.capture(external_ip, "external IP");
            if port.local_policy {
                self.nat(KUBE_SERVICES, capture().jump(&port.chains.external_local));
                continue;
            }
            let masquerade = capture().local(&port.local_detector, true);
            self.nat(KUBE_SERVICES, masquerade.jump(KUBE_MARK_MASQ));
            self.nat(KUBE_SERVICES, capture().jump(&port.chains.service));
        }
    }

    fn add_load_balancer_ips(&mut self, port: &PortContext) {
        for &ingress_ip in &port.vip_ingress {
            if port.has_endpoints {
                let capture = port
                    .capture(ingress_ip, "loadbalancer IP")
                    .jump(&port.chains.firewall);
                self.nat(KUBE_SERVICES, capture);
            } else {
                let reject = port
                    .capture(ingress_ip, "has no endpoints")
                    .jump(reject(port.family));
                self.filter(KUBE_EXTERNAL_SERVICES, reject);
            }
        }
        // kube-proxy v1.21 rewrites the KUBE-FW chain once per ingress IP, repeating its
        // rules; one copy behaves the same.
        if port.has_endpoints && !port.vip_ingress.is_empty() {
            self.add_firewall_chain(port);
        }
    }

    fn add_node_port(&mut self, port: &PortContext) {
        let Some(node_port) = port.svc.node_port else {
            return;
        };
        let proto = port.svc.protocol;
        let capture = || {
            RuleText::new()
                .protocol(proto)
                .comment(&port.name)
                .dport(proto, node_port)
        };
        if !port.has_endpoints {
            let reject = RuleText::new()
                .protocol(proto)
                .comment(&format!("{} has no endpoints", port.name))
                .matching("-m addrtype --dst-type LOCAL")
                .dport(proto, node_port)
                .jump(reject(port.family));
            self.filter(KUBE_EXTERNAL_SERVICES, reject);
        } else if port.local_policy {
            // Locally generated traffic to a node port would be a martian source after DNAT.
            self.nat(
                KUBE_NODEPORTS,
                capture()
                    .source(port.family.loopback())
                    .jump(KUBE_MARK_MASQ),
            );
            self.nat(KUBE_NODEPORTS, capture().jump(&port.chains.external_local));
        } else {
            self.nat(KUBE_NODEPORTS, capture().jump(KUBE_MARK_MASQ));
            self.nat(KUBE_NODEPORTS, capture().jump(&port.chains.service));
        }
    }

    /// Accepted whether or not this node has endpoints, so that the load balancer gets a
    /// 503 rather than a timeout. Like kube-proxy, once per Service port.
    fn add_health_check_port(&mut self, port: &PortContext) {
        let Some(health_port) = port.svc.health_check_node_port else {
            return;
        };
        let accept = RuleText::new()
            .protocol(Protocol::Tcp)
            .comment(&format!("{} health check node port", port.name))
            .dport(Protocol::Tcp, health_port)
            .jump("ACCEPT");
        self.filter(KUBE_NODEPORTS, accept);
    }
    /// One KUBE-SEP chain per endpoint: masquerade hairpin traffic, then DNAT.
    fn add_endpoint_chains(&mut self, port: &PortContext) {
        let proto = port.svc.protocol;
        for ep in &port.endpoints {
            let chain = &ep.chain;
            let hairpin = RuleText::new()
                .source(IpNet::from(ep.addr.ip()))
                .comment(&port.name);
            self.nat(chain, hairpin.jump(KUBE_MARK_MASQ));
            let mut dnat = RuleText::new().protocol(proto).comment(&port.name);
            if port.svc.session_affinity_timeout.is_some() {
                dnat = dnat.matching(&format!(
                    "-m recent --set --name {chain} {}",
                    recent_source(port.family)
                ));
            }
            let dnat = dnat.matching(&format!("-m {}", proto.as_str()));
            self.nat(
                chain,
                dnat.jump(&format!("DNAT --to-destination {}", ep.addr)),
            );
        }
    }

    /// Session-affinity checks, then the statistic cascade: rule i of n matches with
    /// probability 1/(n-i), the last one always.
    fn add_balancing_rules(
        &mut self,
        port: &PortContext,
        from_chain: &str,
        targets: &[&str],
        comment: impl Fn(usize) -> String,
    ) {
        let svc = port.svc;
        if let Some(timeout) = svc.session_affinity_timeout {
            for target in targets {
                let sticky = RuleText::new().comment(&port.name).matching(&format!(
                    "-m recent --rcheck --seconds {timeout} --reap --name {target} {}",
                    recent_source(port.family)
                ));
                self.nat(from_chain, sticky.jump(target));
            }
        }
        let n = targets.len();
        for (i, target) in targets.iter().enumerate() {
            let mut rule = RuleText::new().comment(&comment(i));
            if i + 1 < n {
                rule = rule.matching(&format!(
                    "-m statistic --mode random --probability {}",
                    probability(n - i)
                ));
            }
            self.nat(from_chain, rule.jump(target));
        }
    }

    /// KUBE-FW: masquerade (policy Cluster), let allowed sources through, mark the rest
    /// for dropping.
    fn add_firewall_chain(&mut self, port: &PortContext) {
        let chains = &port.chains;
        self.declare(Table::Nat, &chains.firewall);
        let comment = format!("{} loadbalancer IP", port.name);
        let rule = || RuleText::new().comment(&comment);
        let allowed_target = if port.local_policy {
            // Keep the client's source IP: only local endpoints, no masquerade.
            &chains.external_local
        } else {
            self.nat(&chains.firewall, rule().jump(KUBE_MARK_MASQ));
            &chains.service
        };
        let ranges = &port.svc.load_balancer_source_ranges;
        if ranges.is_empty() {
            self.nat(&chains.firewall, rule().jump(allowed_target));
        }
        for range in sorted_unique(ranges) {
            self.nat(&chains.firewall, rule().source(range).jump(allowed_target));
        }
        if port.allow_from_node {
            // The node reaching its LB IP through a route that loops the packet back
            // (the VIP as a local address, or a cloud that sends it back) sends it from
            // the LB IP itself.
            for ingress in &port.vip_ingress {
                let from_lb_ip = rule().source(IpNet::from(*ingress));
                self.nat(&chains.firewall, from_lb_ip.jump(allowed_target));
            }
        }
        // Whatever reaches the end was not let through: it must not be DNATed anywhere.
        self.nat(&chains.firewall, rule().jump(KUBE_MARK_DROP));
    }

    /// KUBE-SVL: masquerade off-cluster clients (they may have been routed here by a static
    /// route to the Service range), then spread over this node's endpoints.
    fn add_service_local_chain(&mut self, port: &PortContext) {
        let svl = port.chains.service_local.as_str();
        self.declare(Table::Nat, svl);
        if let Some(masquerade) = port.cluster_ip_masquerade() {
            self.nat(svl, masquerade);
        }
        let local = port.local_endpoint_chains();
        self.add_balancing_rules(port, svl, &local, |_| port.name.clone());
    }

    /// KUBE-XLB: pods and the node itself short-cut to the Service chain; everything else
    /// goes to local endpoints only, or is dropped when there are none.
    fn add_external_local_chain(&mut self, port: &PortContext) {
        let (name, chains) = (&port.name, &port.chains);
        let xlb = chains.external_local.as_str();
        if port.local_detector != LocalDetector::None {
            let redirect = RuleText::new()
                .local(&port.local_detector, false)
                .comment("Redirect pods trying to reach external loadbalancer VIP to clusterIP");
            self.nat(xlb, redirect.jump(&chains.service));
        }
        let from_node = |comment: String| {
            RuleText::new()
                .comment(&comment)
                .matching("-m addrtype --src-type LOCAL")
        };
        let masquerade = from_node(format!("masquerade LOCAL traffic for {name} LB IP"));
        self.nat(xlb, masquerade.jump(KUBE_MARK_MASQ));
        let route = from_node(format!(
            "route LOCAL traffic for {name} LB IP to service chain"
        ));
        self.nat(xlb, route.jump(&chains.service));
        let local = port.local_endpoint_chains();
        if local.is_empty() {
            let drop = RuleText::new().comment(&format!("{name} has no local endpoints"));
            self.nat(xlb, drop.jump(KUBE_MARK_DROP));
        } else {
            self.add_balancing_rules(port, xlb, &local, |i| {
                format!("Balancing rule {i} for {name}")
            });
        }
    }
}

/// A usable endpoint of one Service port, with its KUBE-SEP chain.
struct PortEndpoint {
    addr: SocketAddr,
    cluster: bool,
    local: bool,
    chain: String,
}

/// Everything the rules of one (non-headless) Service port are derived from.
struct PortContext<'a> {
    svc: &'a ServicePort,
    cluster_ip: IpAddr,
    /// `namespace/name:port`, the comment on most of its rules.
    name: String,
    chains: ServiceChains,
    endpoints: Vec<PortEndpoint>,
    /// Ingress IPs the node captures: `ipMode: Proxy` ones are reached through node
    /// ports only (KEP-1860), so the node must not short-cut them.
    vip_ingress: Vec<IpAddr>,
    /// externalTrafficPolicy Local, where it applies: to node ports, external and LB IPs
    /// (the API refuses Local on a Service that has none of them).
    local_policy: bool,
    /// internalTrafficPolicy Local: the cluster IP leads to KUBE-SVL, not KUBE-SVC.
    internal_local: bool,
    /// KUBE-SVC is written: the cluster IP uses it (internalTrafficPolicy Cluster) or the
    /// port is reachable from outside (node port, external or LB IP), whose Cluster policy
    /// or KUBE-XLB short-cuts need it. kube-proxy's `UsesClusterEndpoints`.
    uses_cluster: bool,
    /// The port has endpoints somewhere in the cluster (ready, else serving terminating):
    /// without any, its IPs are rejected.
    has_endpoints: bool,
    /// Tells pods' traffic from the rest (`--detect-local-mode`).
    local_detector: LocalDetector,
    /// The node's family: host prefixes, loopback and ICMP errors differ.
    family: IpFamily,
    /// `--masquerade-all`.
    masquerade_all: bool,
    /// A source range holds the node's IP: the LB IPs are allowed sources too.
    allow_from_node: bool,
}

impl<'a> PortContext<'a> {
    fn new(svc: &'a ServicePort, endpoints: &[UsableEndpoint], node: &NodeConfig) -> Option<Self> {
        let cluster_ip = svc.cluster_ip?;
        let paths = PortPaths::of(svc);
        Some(Self {
            svc,
            cluster_ip,
            name: svc.name.to_string(),
            chains: ServiceChains::for_port(svc),
            endpoints: endpoints
                .iter()
                .filter(|ep| paths.spreads_over(ep))
                .map(|ep| PortEndpoint {
                    addr: ep.addr,
                    cluster: ep.cluster,
                    local: ep.local,
                    chain: chains::endpoint_chain(&svc.name, svc.protocol, ep.addr),
                })
                .collect(),
            vip_ingress: paths.vip_ingress,
            local_policy: paths.local_policy,
            internal_local: paths.internal_local,
            uses_cluster: paths.uses_cluster,
            // The local set is a subset of the cluster-wide one unless another node has
            // a ready endpoint: the cluster-wide set alone says whether any exists.
            has_endpoints: endpoints.iter().any(|ep| ep.cluster),
            local_detector: node.local_detector.clone(),
            family: node.family,
            masquerade_all: node.masquerade_all,
            allow_from_node: node.allows_from_node(&svc.load_balancer_source_ranges),
        })
    }

    /// Marks cluster-IP traffic for masquerade: all of it with `--masquerade-all`, else
    /// that from outside the cluster CIDR (such clients, routed here by a static route to
    /// the Service range, may be sent to another node), else none.
    fn cluster_ip_masquerade(&self) -> Option<String> {
        let capture = self.capture(self.cluster_ip, "cluster IP");
        let masquerade = match &self.local_detector {
            _ if self.masquerade_all => capture,
            LocalDetector::None => return None,
            detector => capture.local(detector, true),
        };
        Some(masquerade.jump(KUBE_MARK_MASQ))
    }

    fn has_local_endpoints(&self) -> bool {
        self.endpoints.iter().any(|ep| ep.local)
    }

    /// The KUBE-SEP chains of this node's endpoints, in endpoint order.
    fn local_endpoint_chains(&self) -> Vec<&str> {
        self.endpoints
            .iter()
            .filter(|ep| ep.local)
            .map(|ep| ep.chain.as_str())
            .collect()
    }

    /// Matches this port's traffic to `ip`, commented "<name> <what>".
    fn capture(&self, ip: IpAddr, what: &str) -> RuleText {
        let proto = self.svc.protocol;
        RuleText::new()
            .destination(ip)
            .protocol(proto)
            .comment(&format!("{} {what}", self.name))
            .dport(proto, self.svc.port)
    }
}

/// The REJECT target of a family: the ICMP error a refused connection gets.
fn reject(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "REJECT --reject-with icmp-port-unreachable",
        IpFamily::V6 => "REJECT --reject-with icmp6-port-unreachable",
    }
}

/// `-m recent` options iptables-save adds to every `--set` / `--rcheck`: the whole source
/// address of the family.
fn recent_source(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "--mask 255.255.255.255 --rsource",
        IpFamily::V6 => "--mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff --rsource",
    }
}

struct ServiceChains {
    service: String,
    service_local: String,
    firewall: String,
    external_local: String,
}

impl ServiceChains {
    fn for_port(svc: &ServicePort) -> Self {
        Self {
            service: chains::service_chain(&svc.name, svc.protocol),
            service_local: chains::service_local_chain(&svc.name, svc.protocol),
            firewall: chains::firewall_chain(&svc.name, svc.protocol),
            external_local: chains::external_local_chain(&svc.name, svc.protocol),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_ordered_as_text_and_deduplicated() {
        let node = NodeConfig::new("a", None);
        let ep = |ip: [u8; 4], node: &str| Endpoint {
            ip: IpAddr::from(ip),
            port: 80,
            ready: true,
            serving: true,
            terminating: false,
            node_name: Some(node.into()),
            hints: None,
        };
        let endpoints = [
            ep([10, 0, 0, 5], "b"),
            ep([10, 0, 0, 10], "b"),
            ep([10, 0, 0, 5], "a"),
        ];
        let usable = usable_endpoints(&endpoints, &node);
        let order: Vec<String> = usable.iter().map(|ep| ep.addr.to_string()).collect();
        assert_eq!(order, ["10.0.0.10:80", "10.0.0.5:80"]);
        assert!(!usable[0].local && usable[1].local);
    }

    fn last_octet(ip: IpAddr) -> u8 {
        match ip {
            IpAddr::V4(ip) => ip.octets()[3],
            IpAddr::V6(ip) => ip.octets()[15],
        }
    }

    #[test]
    fn serving_terminating_endpoints_stand_in_only_where_nothing_is_ready() {
        let node = NodeConfig::new("a", None);
        let ep = |last: u8, node: &str, ready: bool, serving: bool| Endpoint {
            ip: IpAddr::from([10, 0, 0, last]),
            port: 80,
            ready,
            serving,
            terminating: !ready,
            node_name: Some(node.into()),
            hints: None,
        };
        let flags = |endpoints: &[Endpoint]| -> Vec<(u8, bool, bool)> {
            usable_endpoints(endpoints, &node)
                .iter()
                .map(|u| (last_octet(u.addr.ip()), u.cluster, u.local))
                .collect()
        };
        // A rolling update of the only local pod: the old one still serves locally.
        assert_eq!(
            flags(&[ep(1, "a", false, true), ep(2, "b", true, true)]),
            [(1, false, true), (2, true, false)]
        );
        // Once the new local pod is ready, the terminating one gets nothing.
        assert_eq!(
            flags(&[ep(1, "a", false, true), ep(3, "a", true, true)]),
            [(3, true, true)]
        );
        // Nothing ready anywhere: every serving terminating endpoint, not the others.
        assert_eq!(
            flags(&[
                ep(1, "a", false, true),
                ep(2, "b", false, true),
                ep(4, "b", false, false)
            ]),
            [(1, true, true), (2, true, false)]
        );
    }

    #[test]
    fn probabilities_are_printed_as_iptables_save_does() {
        assert_eq!(probability(2), "0.50000000000");
        assert_eq!(probability(3), "0.33333333349");
        assert_eq!(probability(4), "0.25000000000");
        assert_eq!(probability(5), "0.20000000019");
        assert_eq!(probability(6), "0.16666666651");
        assert_eq!(probability(10), "0.10000000009");
    }

    #[test]
    fn rule_text_orders_addresses_protocol_then_matches() {
        let rule = RuleText::new()
            .comment("c")
            .dport(Protocol::Udp, 53)
            .protocol(Protocol::Udp)
            .destination(IpAddr::from([10, 0, 0, 1]))
            .local(
                &LocalDetector::ClusterCidr("10.244.0.0/16".parse().unwrap()),
                true,
            )
            .jump("X");
        assert_eq!(
            rule,
            "! -s 10.244.0.0/16 -d 10.0.0.1/32 -p udp -m comment --comment \"c\" -m udp --dport 53 -j X"
        );
        // An input interface goes between the addresses and the protocol.
        let bridge = LocalDetector::BridgeInterface("cni0".parse().unwrap());
        let rule = RuleText::new()
            .protocol(Protocol::Tcp)
            .local(&bridge, true)
            .destination(IpAddr::from([10, 0, 0, 1]))
            .jump("X");
        assert_eq!(rule, "-d 10.0.0.1/32 ! -i cni0 -p tcp -j X");
    }
}
