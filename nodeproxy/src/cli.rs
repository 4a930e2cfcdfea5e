//! Command-line flags (each with an environment fallback).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;

use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};
use ipnet::IpNet;
use tandem_common::{IpFamily, Protocol};
use tandem_proxy_rules::model::{InterfaceName, LocalDetector, NodeConfig, NodePortAddresses};

pub use tandem_common::{GoDuration, LogFormat};

use crate::datapath::iptables::backend::BackendChoice;
use crate::observe::convert::NodeFacts;
use tandem_common::ProxyMode;

#[derive(Debug, Parser)]
#[command(
    name = "tandem-nodeproxy",
    version,
    about = "Node proxy: programs the Service data path (kube-proxy v1.21 iptables chains, or an nftables table)"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub proxy: ProxyArgs,
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
}

/// How to reach the API server, who this node is and which data path it runs (shared by
/// `run`, `trace` and `--cleanup`).
#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// Which data path to program: kube-proxy v1.21's iptables chains, or one nftables table
    /// (`ip tandem`) written through netlink. Starting in one mode removes the other's rules
    /// once its own first sync is in.
    #[arg(long, alias = "mode", env = "PROXY_MODE", value_enum, default_value_t = ProxyMode::Iptables, global = true)]
    pub proxy_mode: ProxyMode,
    /// kubeconfig file; without it the in-cluster config (or the usual defaults) is used.
    #[arg(long, env = "KUBECONFIG", global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// This node's name, as in its Node object.
    #[arg(long, env = "NODE_NAME", global = true)]
    pub node_name: Option<String>,
    /// Pod CIDRs of the cluster, at most one per IP family (comma-separated): each family
    /// given gets a proxier (none given: IPv4 only), and with --detect-local-mode
    /// ClusterCIDR traffic to cluster IPs from outside them is masqueraded.
    #[arg(long, env = "CLUSTER_CIDR", value_delimiter = ',', global = true)]
    pub cluster_cidr: Vec<IpNet>,
    /// How traffic from pods is told from the rest (kube-proxy's flag): ClusterCIDR
    /// (sources in --cluster-cidr), NodeCIDR (sources in this Node's spec.podCIDRs),
    /// BridgeInterface (arriving on --pod-bridge-interface) or InterfaceNamePrefix
    /// (arriving on an interface named --pod-interface-name-prefix...). Connections to
    /// cluster IPs from anything else are masqueraded.
    #[arg(long, env = "DETECT_LOCAL_MODE", value_enum, default_value_t = DetectLocalMode::ClusterCidr, global = true)]
    pub detect_local_mode: DetectLocalMode,
    /// The bridge the pods' interfaces are attached to (--detect-local-mode
    /// BridgeInterface), e.g. cni0.
    #[arg(long, env = "POD_BRIDGE_INTERFACE", global = true)]
    pub pod_bridge_interface: Option<InterfaceName>,
    /// The start of the name of every pod's host-side interface (--detect-local-mode
    /// InterfaceNamePrefix), e.g. veth.
    #[arg(long, env = "POD_INTERFACE_NAME_PREFIX", global = true)]
    pub pod_interface_name_prefix: Option<InterfaceName>,
    /// Masquerade every connection to a cluster IP, not only those from outside the pods
    /// (--detect-local-mode).
    #[arg(long, env = "MASQUERADE_ALL", global = true)]
    pub masquerade_all: bool,
    /// Serve node ports only on this node's addresses inside these CIDRs (comma-separated),
    /// or `primary`: the node's own IP. Unset: every address in iptables mode, `primary` in
    /// nftables mode.
    #[arg(long, env = "NODEPORT_ADDRESSES", value_delimiter = ',', global = true)]
    pub nodeport_addresses: Vec<NodePortAddress>,
    /// iptables mode: also serve node ports on 127.0.0.0/8 (sets route_localnet). The
    /// nftables mode never does.
    #[arg(long, env = "IPTABLES_LOCALHOST_NODEPORTS", default_value_t = true, action = ArgAction::Set, global = true)]
    pub iptables_localhost_nodeports: bool,
    /// The Service CIDRs (kube-apiserver's flag of this name; comma-separated): in
    /// nftables mode, new connections to an address in them that no Service holds are
    /// dropped. Where the API server serves ServiceCIDR objects (1.33 and later), their
    /// CIDRs replace these and are followed as they change.
    #[arg(
        long,
        env = "SERVICE_CLUSTER_IP_RANGE",
        value_delimiter = ',',
        global = true
    )]
    pub service_cluster_ip_range: Vec<IpNet>,
}

/// `--detect-local-mode`, spelled as kube-proxy spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DetectLocalMode {
    #[value(name = "ClusterCIDR")]
    ClusterCidr,
    #[value(name = "NodeCIDR")]
    NodeCidr,
    #[value(name = "BridgeInterface")]
    BridgeInterface,
    #[value(name = "InterfaceNamePrefix")]
    InterfaceNamePrefix,
}

/// One value of `--nodeport-addresses`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodePortAddress {
    /// The node's primary IP (kube-proxy ≥ 1.29's `primary`).
    Primary,
    Cidr(IpNet),
}

impl FromStr for NodePortAddress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "primary" {
            return Ok(Self::Primary);
        }
        s.parse()
            .map(Self::Cidr)
            .map_err(|_| format!("{s:?} is neither a CIDR nor `primary`"))
    }
}

/// Why the cluster flags cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodePortAddressesError {
    #[error("--nodeport-addresses: `primary` cannot be combined with CIDRs")]
    PrimaryWithCidrs,
    #[error("--cluster-cidr: at most one CIDR per IP family ({0} given twice)")]
    ClusterCidrsOfOneFamily(IpFamily),
    #[error("--detect-local-mode BridgeInterface needs --pod-bridge-interface")]
    NoPodBridgeInterface,
    #[error("--detect-local-mode InterfaceNamePrefix needs --pod-interface-name-prefix")]
    NoPodInterfaceNamePrefix,
    #[error(
        "--detect-local-mode NodeCIDR: the Node has no spec.podCIDRs of {0} (is it registered, and does the cluster allocate pod CIDRs?)"
    )]
    NoNodePodCidr(IpFamily),
}

impl ClusterArgs {
    /// The IP families to proxy, IPv4 first: those of `--cluster-cidr`, or IPv4 alone
    /// without it.
    pub fn families(&self) -> Result<Vec<IpFamily>, NodePortAddressesError> {
        let mut families: Vec<IpFamily> = self
            .cluster_cidr
            .iter()
            .map(|cidr| IpFamily::of(cidr.addr()))
            .collect();
        families.sort();
        if let Some(twice) = families.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(NodePortAddressesError::ClusterCidrsOfOneFamily(twice[0]));
        }
        if families.is_empty() {
            families.push(IpFamily::V4);
        }
        Ok(families)
    }

    /// The node port addresses of `family` in force for this mode, as kube-proxy resolves
    /// them: an unset flag means every local address in iptables mode and `primary` in
    /// nftables mode; `primary` is `node_ip` as a host prefix, or every address while the
    /// node's IP is unknown; CIDRs of the other family are the other proxier's.
    pub fn node_port_addresses(
        &self,
        family: IpFamily,
        node_ip: Option<IpAddr>,
    ) -> Result<NodePortAddresses, NodePortAddressesError> {
        let given = &self.nodeport_addresses;
        let primary = given.contains(&NodePortAddress::Primary);
        if primary && given.len() > 1 {
            return Err(NodePortAddressesError::PrimaryWithCidrs);
        }
        if primary || (given.is_empty() && self.proxy_mode == ProxyMode::Nftables) {
            let own: Vec<IpNet> = node_ip.map(IpNet::from).into_iter().collect();
            return Ok(NodePortAddresses::from_cidrs(&own));
        }
        let cidrs: Vec<IpNet> = given
            .iter()
            .filter_map(|address| match address {
                NodePortAddress::Cidr(cidr) if family.holds(cidr.addr()) => Some(*cidr),
                _ => None,
            })
            .collect();
        Ok(NodePortAddresses::from_cidrs(&cidrs))
    }

    /// The local-traffic detector of `family`'s proxier, as kube-proxy's
    /// `getLocalDetector` picks it: ClusterCIDR without a CIDR of the family detects
    /// nothing; the other modes without their value are refused.
    pub fn local_detector(
        &self,
        family: IpFamily,
        pod_cidr: Option<IpNet>,
    ) -> Result<LocalDetector, NodePortAddressesError> {
        let of_family = |cidr: &&IpNet| family.holds(cidr.addr());
        Ok(match self.detect_local_mode {
            DetectLocalMode::ClusterCidr => self
                .cluster_cidr
                .iter()
                .find(of_family)
                .map_or(LocalDetector::None, |cidr| {
                    LocalDetector::ClusterCidr(cidr.trunc())
                }),
            DetectLocalMode::NodeCidr => LocalDetector::NodeCidr(
                pod_cidr
                    .filter(|cidr| family.holds(cidr.addr()))
                    .ok_or(NodePortAddressesError::NoNodePodCidr(family))?
                    .trunc(),
            ),
            DetectLocalMode::BridgeInterface => LocalDetector::BridgeInterface(
                self.pod_bridge_interface
                    .clone()
                    .ok_or(NodePortAddressesError::NoPodBridgeInterface)?,
            ),
            DetectLocalMode::InterfaceNamePrefix => LocalDetector::InterfaceNamePrefix(
                self.pod_interface_name_prefix
                    .clone()
                    .ok_or(NodePortAddressesError::NoPodInterfaceNamePrefix)?,
            ),
        })
    }

    /// The settings of this node's proxier of `family`: the flags of that family, and
    /// the node's IP and pod CIDR of it from its Node object.
    /// `--iptables-localhost-nodeports` is IPv4's (`route_localnet`); the IPv6 proxier
    /// writes what kube-proxy v1.21 does.
    pub fn node_config(
        &self,
        node_name: String,
        family: IpFamily,
        node: NodeFacts,
    ) -> Result<NodeConfig, NodePortAddressesError> {
        let of_family = |cidr: &&IpNet| family.holds(cidr.addr());
        let node_ip = node.ip;
        Ok(NodeConfig {
            node_name,
            // From the Node at each sync: it may change while the proxy runs.
            zone: None,
            family,
            local_detector: self.local_detector(family, node.pod_cidr)?,
            node_ip,
            masquerade_all: self.masquerade_all,
            node_port_addresses: self.node_port_addresses(family, node_ip)?,
            localhost_node_ports: family == IpFamily::V6 || self.iptables_localhost_nodeports,
            service_cidrs: self
                .service_cluster_ip_range
                .iter()
                .filter(of_family)
                .map(IpNet::trunc)
                .collect(),
        })
    }
}

#[derive(Debug, Args)]
pub struct ProxyArgs {
    #[arg(long, env = "HEALTHZ_BIND_ADDRESS", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: SocketAddr,
    #[arg(long, env = "METRICS_BIND_ADDRESS", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: SocketAddr,
    /// Periodic sync (Go duration syntax: 30s, 1m, 500ms); on iptables-legacy, which
    /// announces no ruleset change, also the period of the full check of every rule.
    #[arg(long, env = "SYNC_PERIOD", default_value = "30s")]
    pub sync_period: GoDuration,
    /// Changes are applied at most this often.
    #[arg(long, env = "MIN_SYNC_PERIOD", default_value = "1s")]
    pub min_sync_period: GoDuration,
    /// How often every rule is read back and checked, on the nf_tables backends (nftables
    /// mode, iptables-nft), where the kernel announces each change and someone else's is
    /// repaired within a second anyway; a check that finds nothing committed to any table
    /// and no change taken since the last is skipped. On iptables-legacy that is every
    /// --sync-period.
    #[arg(long, env = "DRIFT_CHECK_PERIOD", default_value = "1h")]
    pub drift_check_period: GoDuration,
    #[arg(long, env = "IPTABLES_BACKEND", value_enum, default_value_t = BackendChoice::Auto)]
    pub iptables_backend: BackendChoice,
    /// Remove every rule, chain and table the node proxy installs (in both modes), then exit.
    #[arg(long, env = "CLEANUP")]
    pub cleanup: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Where a packet goes on this node, traced through the desired ruleset.
    Trace(TraceArgs),
}

#[derive(Debug, Args)]
pub struct TraceArgs {
    /// The source address, of the destination's family.
    #[arg(long, env = "TRACE_SRC")]
    pub src: IpAddr,
    /// Destination `IP` (with --dport) or `IP:PORT` (`[IPv6]:PORT`); its family picks the
    /// proxier traced.
    #[arg(long, env = "TRACE_DST")]
    pub dst: Destination,
    #[arg(long, env = "TRACE_DPORT")]
    pub dport: Option<u16>,
    #[arg(long, alias = "proto", env = "TRACE_PROTOCOL", value_enum, default_value_t = ProtocolArg::Tcp)]
    pub protocol: ProtocolArg,
    /// The packet is generated on the node itself (host network) instead of arriving.
    #[arg(long, env = "TRACE_FROM_NODE")]
    pub from_node: bool,
    /// The interface the packet comes in on (what --detect-local-mode BridgeInterface and
    /// InterfaceNamePrefix look at); not with --from-node.
    #[arg(long, env = "TRACE_IN_INTERFACE", conflicts_with = "from_node")]
    pub in_interface: Option<InterfaceName>,
}

impl TraceArgs {
    /// The destination port from `--dport` or from `--dst IP:PORT`.
    pub fn port(&self) -> Option<u16> {
        self.dport.or(self.dst.port)
    }
}

/// `IP` or `IP:PORT`, an IPv6 one as `ADDRESS` or `[ADDRESS]:PORT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Destination {
    pub ip: IpAddr,
    pub port: Option<u16>,
}

impl FromStr for Destination {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Self { ip, port: None });
        }
        let with_port: SocketAddr = s
            .parse()
            .map_err(|_| format!("{s:?}: neither an address nor address:port"))?;
        Ok(Self {
            ip: with_port.ip(),
            port: Some(with_port.port()),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProtocolArg {
    Tcp,
    Udp,
    Sctp,
}

impl From<ProtocolArg> for Protocol {
    fn from(p: ProtocolArg) -> Self {
        match p {
            ProtocolArg::Tcp => Protocol::Tcp,
            ProtocolArg::Udp => Protocol::Udp,
            ProtocolArg::Sctp => Protocol::Sctp,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::time::Duration;

    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_valid() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_flags_parse_with_defaults() {
        let cli = Cli::try_parse_from([
            "tandem-nodeproxy",
            "--kubeconfig",
            "/tmp/kc",
            "--node-name",
            "node-a",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--min-sync-period",
            "250ms",
        ])
        .unwrap();
        assert!(cli.command.is_none());
        assert_eq!(cli.cluster.node_name.as_deref(), Some("node-a"));
        assert_eq!(cli.proxy.sync_period, GoDuration(Duration::from_secs(30)));
        assert_eq!(
            cli.proxy.min_sync_period,
            GoDuration(Duration::from_millis(250))
        );
        assert_eq!(
            cli.proxy.healthz_bind_address,
            "0.0.0.0:10256".parse().unwrap()
        );
        assert_eq!(
            cli.proxy.metrics_bind_address,
            "127.0.0.1:10249".parse().unwrap()
        );
        assert_eq!(cli.proxy.iptables_backend, BackendChoice::Auto);
        assert_eq!(cli.cluster.proxy_mode, ProxyMode::Iptables);
        assert!(!cli.proxy.cleanup);
        let nft = Cli::try_parse_from([
            "tandem-nodeproxy",
            "--mode",
            "nftables",
            "trace",
            "--src",
            "10.0.0.1",
            "--dst",
            "10.96.0.1:53",
        ])
        .unwrap();
        assert_eq!(nft.cluster.proxy_mode, ProxyMode::Nftables);
    }

    #[test]
    fn kube_proxys_flags_resolve_as_kube_proxy_resolves_them() {
        let parse = |args: &[&str]| {
            let mut all = vec!["tandem-nodeproxy"];
            all.extend(args);
            Cli::try_parse_from(all).unwrap().cluster
        };
        let node_ip = Some(IpAddr::from([198, 18, 0, 11]));
        let facts = |ip| NodeFacts { ip, pod_cidr: None };
        let cidrs = |list: &[&str]| {
            NodePortAddresses::Cidrs(list.iter().map(|c| c.parse().unwrap()).collect())
        };
        // Unset: every address in iptables mode, the node's own in nftables mode.
        let defaults = parse(&[]);
        assert_eq!(
            defaults.node_port_addresses(IpFamily::V4, node_ip),
            Ok(NodePortAddresses::All)
        );
        assert!(!defaults.masquerade_all && defaults.iptables_localhost_nodeports);
        let nft = parse(&["--proxy-mode", "nftables"]);
        assert_eq!(
            nft.node_port_addresses(IpFamily::V4, node_ip),
            Ok(cidrs(&["198.18.0.11/32"]))
        );
        // `primary` without a known node IP: every address (kube-proxy's fallback).
        assert_eq!(
            nft.node_port_addresses(IpFamily::V4, None),
            Ok(NodePortAddresses::All)
        );
        let given = parse(&[
            "--nodeport-addresses",
            "192.168.7.0/24,fd00::/64,10.0.0.0/8",
            "--masquerade-all",
            "--iptables-localhost-nodeports=false",
            "--service-cluster-ip-range",
            "10.96.0.0/16,fd00:96::/112",
        ]);
        assert_eq!(
            given.node_port_addresses(IpFamily::V4, node_ip),
            Ok(cidrs(&["10.0.0.0/8", "192.168.7.0/24"]))
        );
        assert_eq!(
            given.node_port_addresses(IpFamily::V6, None),
            Ok(cidrs(&["fd00::/64"]))
        );
        let node = given
            .node_config("node-a".into(), IpFamily::V4, facts(node_ip))
            .unwrap();
        assert!(node.masquerade_all && !node.localhost_node_ports);
        assert_eq!(node.service_cidrs, vec!["10.96.0.0/16".parse().unwrap()]);
        assert_eq!(node.node_ip, node_ip);
        let v6 = given
            .node_config("node-a".into(), IpFamily::V6, NodeFacts::default())
            .unwrap();
        assert_eq!(v6.service_cidrs, vec!["fd00:96::/112".parse().unwrap()]);
        assert!(v6.localhost_node_ports, "IPv6 has no route_localnet switch");
        // A proxier per family of --cluster-cidr; IPv4 alone without it.
        assert_eq!(defaults.families(), Ok(vec![IpFamily::V4]));
        let dual = parse(&["--cluster-cidr", "fd00:10:244::/56,10.244.0.0/16"]);
        assert_eq!(dual.families(), Ok(vec![IpFamily::V4, IpFamily::V6]));
        let dual_v6 = dual
            .node_config("node-a".into(), IpFamily::V6, NodeFacts::default())
            .unwrap();
        assert_eq!(
            dual_v6.local_detector,
            LocalDetector::ClusterCidr("fd00:10:244::/56".parse().unwrap())
        );
        assert_eq!(
            parse(&["--cluster-cidr", "fd00:10:244::/56"]).families(),
            Ok(vec![IpFamily::V6])
        );
        assert_eq!(
            parse(&["--cluster-cidr", "10.244.0.0/16,10.245.0.0/16"]).families(),
            Err(NodePortAddressesError::ClusterCidrsOfOneFamily(
                IpFamily::V4
            ))
        );
        assert_eq!(
            parse(&["--nodeport-addresses", "primary"]).node_port_addresses(IpFamily::V4, node_ip),
            Ok(cidrs(&["198.18.0.11/32"]))
        );
        assert_eq!(
            parse(&["--nodeport-addresses", "primary,10.0.0.0/8"])
                .node_port_addresses(IpFamily::V4, node_ip),
            Err(NodePortAddressesError::PrimaryWithCidrs)
        );
        assert!(Cli::try_parse_from(["tandem-nodeproxy", "--nodeport-addresses", "eth0"]).is_err());
    }

    #[test]
    fn detect_local_mode_picks_the_detector_as_kube_proxy_does() {
        let parse = |args: &[&str]| {
            let mut all = vec!["tandem-nodeproxy", "--cluster-cidr", "10.244.0.0/16"];
            all.extend(args);
            Cli::try_parse_from(all).map(|cli| cli.cluster)
        };
        let pod_cidr = Some("10.244.3.0/24".parse().unwrap());
        let v6_pod_cidr = Some("fd00:10:244:3::/64".parse().unwrap());
        let detector =
            |args: &[&str], family, pod_cidr| parse(args).unwrap().local_detector(family, pod_cidr);
        let name = |s: &str| s.parse::<InterfaceName>().unwrap();
        // ClusterCIDR is the default; a family without a CIDR detects nothing.
        assert_eq!(
            detector(&[], IpFamily::V4, pod_cidr),
            Ok(LocalDetector::ClusterCidr("10.244.0.0/16".parse().unwrap()))
        );
        assert_eq!(
            detector(&[], IpFamily::V6, v6_pod_cidr),
            Ok(LocalDetector::None)
        );
        let node_cidr = ["--detect-local-mode", "NodeCIDR"];
        assert_eq!(
            detector(&node_cidr, IpFamily::V4, pod_cidr),
            Ok(LocalDetector::NodeCidr("10.244.3.0/24".parse().unwrap()))
        );
        assert_eq!(
            detector(&node_cidr, IpFamily::V6, v6_pod_cidr),
            Ok(LocalDetector::NodeCidr(
                "fd00:10:244:3::/64".parse().unwrap()
            ))
        );
        assert_eq!(
            detector(&node_cidr, IpFamily::V4, None),
            Err(NodePortAddressesError::NoNodePodCidr(IpFamily::V4))
        );
        assert_eq!(
            detector(&node_cidr, IpFamily::V6, pod_cidr),
            Err(NodePortAddressesError::NoNodePodCidr(IpFamily::V6))
        );
        let bridge = ["--detect-local-mode", "BridgeInterface"];
        assert_eq!(
            detector(&bridge, IpFamily::V4, None),
            Err(NodePortAddressesError::NoPodBridgeInterface)
        );
        let with_bridge = [&bridge[..], &["--pod-bridge-interface", "cni0"]].concat();
        for family in [IpFamily::V4, IpFamily::V6] {
            assert_eq!(
                detector(&with_bridge, family, None),
                Ok(LocalDetector::BridgeInterface(name("cni0")))
            );
        }
        let prefix = ["--detect-local-mode", "InterfaceNamePrefix"];
        assert_eq!(
            detector(&prefix, IpFamily::V4, None),
            Err(NodePortAddressesError::NoPodInterfaceNamePrefix)
        );
        let with_prefix = [&prefix[..], &["--pod-interface-name-prefix", "veth"]].concat();
        assert_eq!(
            detector(&with_prefix, IpFamily::V4, None),
            Ok(LocalDetector::InterfaceNamePrefix(name("veth")))
        );
        // Names the kernel (or the rule syntax) would not take are refused when parsed.
        for bad in ["", "a-name-too-long-for-linux", "veth+", "cni 0", "cni\"0"] {
            assert!(parse(&["--pod-bridge-interface", bad]).is_err(), "{bad:?}");
        }
        assert!(parse(&["--detect-local-mode", "Bogus"]).is_err());
        let error = detector(&bridge, IpFamily::V4, None)
            .unwrap_err()
            .to_string();
        assert!(error.contains("--pod-bridge-interface"), "{error}");
    }

    #[test]
    fn trace_takes_the_port_either_way() {
        let cli = Cli::try_parse_from([
            "tandem-nodeproxy",
            "trace",
            "--src",
            "203.0.113.5",
            "--dst",
            "198.51.100.20:80",
            "--proto",
            "udp",
        ])
        .unwrap();
        let Some(Command::Trace(args)) = cli.command else {
            panic!("not trace")
        };
        assert_eq!(args.port(), Some(80));
        assert_eq!(args.protocol, ProtocolArg::Udp);
        let cli = Cli::try_parse_from([
            "tandem-nodeproxy",
            "trace",
            "--src",
            "203.0.113.5",
            "--dst",
            "198.51.100.20",
            "--dport",
            "443",
        ])
        .unwrap();
        let Some(Command::Trace(args)) = cli.command else {
            panic!("not trace")
        };
        assert_eq!(
            (args.dst.ip, args.port(), args.protocol),
            (
                Ipv4Addr::new(198, 51, 100, 20).into(),
                Some(443),
                ProtocolArg::Tcp
            )
        );
        for (dst, port) in [
            ("2001:db8:100::20", None),
            ("[2001:db8:100::20]:80", Some(80)),
        ] {
            let cli = Cli::try_parse_from([
                "tandem-nodeproxy",
                "trace",
                "--src",
                "2001:db8::5",
                "--dst",
                dst,
            ])
            .unwrap();
            let Some(Command::Trace(args)) = cli.command else {
                panic!("not trace")
            };
            assert_eq!(args.dst.ip, "2001:db8:100::20".parse::<IpAddr>().unwrap());
            assert_eq!(args.dst.port, port);
        }
        assert!(
            Cli::try_parse_from([
                "tandem-nodeproxy",
                "trace",
                "--src",
                "x",
                "--dst",
                "1.2.3.4"
            ])
            .is_err()
        );
    }
}
