//! The address plan of the virtual cluster (docs/architecture.md, "The virtual cluster").
//!
//! Pure functions only: every address the topology configures comes from here, so tests
//! and other crates can compute them without a running topology.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use crate::error::NetlabError;

/// The workspace's IP family, which the addresses, the topology and the slices here take.
pub use tandem_common::IpFamily;

/// The IP families of a lab cluster: what its Nodes report, its Services get and its node
/// proxies serve. The topology underneath is dual-stack whenever IPv6 is among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ClusterFamilies {
    /// IPv4 only.
    #[default]
    Ipv4,
    /// IPv6 only.
    Ipv6,
    /// IPv4 and IPv6, IPv4 first: a Service that names no family gets IPv4.
    Dual,
}

impl ClusterFamilies {
    /// The families, primary first.
    pub fn families(self) -> &'static [IpFamily] {
        match self {
            Self::Ipv4 => &[IpFamily::V4],
            Self::Ipv6 => &[IpFamily::V6],
            Self::Dual => &[IpFamily::V4, IpFamily::V6],
        }
    }

    pub fn has(self, family: IpFamily) -> bool {
        self.families().contains(&family)
    }
}

/// Node network shared by the control plane, the nodes and the cloud edge.
pub const NODE_NETWORK: Ipv4Net = net(Ipv4Addr::new(198, 18, 0, 0), 24);
/// The cloud edge on the node network: every node's default gateway.
pub const EDGE_NODE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The control-plane namespace (API server relay, controller).
pub const CONTROL_PLANE_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
/// Port of the API server relay on the control plane (the API server's usual port).
pub const API_RELAY_PORT: u16 = 6443;
/// Service cluster IPs (the API server allocates them; nothing is configured here).
pub const SERVICE_CIDR: Ipv4Net = net(Ipv4Addr::new(10, 96, 0, 0), 16);
/// Load-balancer VIPs, hosted or routed by the cloud edge.
pub const VIP_POOL: Ipv4Net = net(Ipv4Addr::new(198, 51, 100, 0), 24);
/// External clients inside the usual loadBalancerSourceRanges.
pub const CLIENT_NETWORK_IN_RANGE: Ipv4Net = net(Ipv4Addr::new(203, 0, 113, 0), 24);
/// External clients outside any source range the tests allow.
pub const CLIENT_NETWORK_OUT_OF_RANGE: Ipv4Net = net(Ipv4Addr::new(192, 0, 2, 0), 24);
/// The edge's address on the in-range client network (the clients' gateway).
pub const EDGE_CLIENT_IN_RANGE_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// The edge's address on the out-of-range client network.
pub const EDGE_CLIENT_OUT_OF_RANGE_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// Client `c1`, inside the usual source range.
pub const CLIENT_IN_RANGE_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// Client `c2`, outside any source range.
pub const CLIENT_OUT_OF_RANGE_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);

/// The network between the router and the edges of an edge cluster.
pub const EDGE_LAN: Ipv4Net = net(Ipv4Addr::new(198, 19, 0, 0), 24);
/// The router's address on [`EDGE_LAN`]: the edges' default gateway and BGP neighbour.
pub const ROUTER_EDGE_LAN_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 1);
/// Most edges an edge cluster can have.
pub const MAX_EDGES: usize = 9;
/// Members of an edge cluster's etcd.
pub const ETCD_MEMBERS: usize = 3;

/// Edge E of an edge cluster: 198.18.0.(240+E) on the node network and 198.19.0.(10+E)
/// on [`EDGE_LAN`].
pub fn cluster_edge_ips(edge: usize) -> Result<(Ipv4Addr, Ipv4Addr), NetlabError> {
    let e = u8::try_from(edge)
        .ok()
        .filter(|e| (1..=MAX_EDGES as u8).contains(e))
        .ok_or(NetlabError::EdgesOutOfRange {
            edges: edge,
            max: MAX_EDGES,
        })?;
    Ok((
        Ipv4Addr::new(198, 18, 0, 240 + e),
        Ipv4Addr::new(198, 19, 0, 10 + e),
    ))
}

/// Member M (1..=[`ETCD_MEMBERS`]) of an edge cluster's etcd on the node network:
/// 198.18.0.(250+M).
pub fn etcd_ip(member: usize) -> Ipv4Addr {
    // ETCD_MEMBERS is 3: the sum stays below 255.
    Ipv4Addr::new(198, 18, 0, 250 + (member.min(ETCD_MEMBERS) as u8))
}

/// Most nodes a topology can have: node N uses 198.18.0.(10+N) and the N-th /24 of the
/// pod network.
pub const MAX_NODES: usize = 200;
/// Most pods one node can ever create: pod index i uses host address 1+i of its node's /24.
pub const MAX_POD_INDEX: u32 = 253;

const fn net(addr: Ipv4Addr, prefix: u8) -> Ipv4Net {
    // Only called with literal, valid prefixes above; `Ipv4Net::new_assert` is const.
    Ipv4Net::new_assert(addr, prefix)
}

fn check_node(node: usize) -> Result<u8, NetlabError> {
    if (1..=MAX_NODES).contains(&node) {
        u8::try_from(node).map_err(|_| NetlabError::NodeOutOfRange {
            node,
            max: MAX_NODES,
        })
    } else {
        Err(NetlabError::NodeOutOfRange {
            node,
            max: MAX_NODES,
        })
    }
}

/// Node N's address on the node network: 198.18.0.(10+N).
pub fn node_ip(node: usize) -> Result<Ipv4Addr, NetlabError> {
    let n = check_node(node)?;
    Ok(Ipv4Addr::new(198, 18, 0, 10 + n))
}

/// The cluster's pod network (the API server's `--cluster-cidr`): node N's pods live in
/// its N-th /24, as a node-IPAM controller hands them out. With the default
/// `10.244.0.0/16`, node N has `10.244.N.0/24`, its bridge `10.244.N.1` and pod i
/// `10.244.N.(1+i)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodNetwork(Ipv4Net);

/// The widest prefix that still holds a /24 for each of [`MAX_NODES`] nodes.
const MAX_POD_NETWORK_PREFIX: u8 = 16;

impl PodNetwork {
    /// `10.244.0.0/16`, flannel's and the lab's default.
    pub const DEFAULT: PodNetwork = PodNetwork(net(Ipv4Addr::new(10, 244, 0, 0), 16));

    /// A pod network must hold a /24 for every node a topology can have.
    pub fn new(cidr: Ipv4Net) -> Result<Self, NetlabError> {
        if cidr.prefix_len() > MAX_POD_NETWORK_PREFIX {
            return Err(NetlabError::PodNetworkTooSmall {
                cidr,
                max_nodes: MAX_NODES,
            });
        }
        Ok(Self(cidr.trunc()))
    }

    /// The whole pod network.
    pub fn cidr(self) -> Ipv4Net {
        self.0
    }

    /// Node N's pod CIDR: the N-th /24.
    pub fn node_cidr(self, node: usize) -> Result<Ipv4Net, NetlabError> {
        let n = check_node(node)?;
        let base = u32::from(self.0.network()) + (u32::from(n) << 8);
        Ok(net(Ipv4Addr::from(base), 24))
    }

    /// Node N's address on its `cni0` bridge, the pods' gateway: host 1 of its /24.
    pub fn gateway(self, node: usize) -> Result<Ipv4Addr, NetlabError> {
        Ok(host(self.node_cidr(node)?, 1))
    }

    /// The address of pod index `index` (1-based) on node N: host 1+index of its /24.
    pub fn pod_ip(self, node: usize, index: u32) -> Result<Ipv4Addr, NetlabError> {
        if !(1..=MAX_POD_INDEX).contains(&index) {
            return Err(NetlabError::PodIndexOutOfRange {
                node,
                index,
                max: MAX_POD_INDEX,
            });
        }
        Ok(host(self.node_cidr(node)?, index + 1))
    }
}

impl Default for PodNetwork {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl std::fmt::Display for PodNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::str::FromStr for PodNetwork {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let cidr: Ipv4Net = s
            .parse()
            .map_err(|e| format!("{s:?} is not an IPv4 CIDR: {e}"))?;
        Self::new(cidr).map_err(|e| e.to_string())
    }
}

fn host(cidr: Ipv4Net, offset: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(cidr.network()) + offset)
}

/// The IPv6 plan of a dual-stack topology: every host keeps its IPv4 address and gets an
/// IPv6 one on the same link, whose last group reads like the IPv4 address's last number
/// (node 1, `198.18.0.11`, is `2001:db8:18::11`; pod `10.244.2.3` is `fd00:10:244:2::3`).
pub mod v6 {
    use std::net::Ipv6Addr;

    use ipnet::Ipv6Net;

    use super::{MAX_POD_INDEX, check_node};
    use crate::error::NetlabError;

    /// The node network.
    pub const NODE_NETWORK: Ipv6Net = net(Ipv6Addr::new(0x2001, 0xdb8, 0x18, 0, 0, 0, 0, 0), 64);
    /// The cloud edge on the node network: every node's default gateway.
    pub const EDGE_NODE_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x18, 0, 0, 0, 0, 1);
    pub const CONTROL_PLANE_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x18, 0, 0, 0, 0, 2);
    /// Service cluster IPs of the IPv6 family.
    pub const SERVICE_CIDR: Ipv6Net = net(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0), 112);
    /// IPv6 load-balancer VIPs.
    pub const VIP_POOL: Ipv6Net = net(Ipv6Addr::new(0x2001, 0xdb8, 0x51, 0x100, 0, 0, 0, 0), 120);
    /// The pod network: node N's pods in `fd00:10:244:N::/64` (a /48, so N may read 200).
    pub const POD_NETWORK: Ipv6Net = net(Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0), 48);
    pub const CLIENT_NETWORK_IN_RANGE: Ipv6Net =
        net(Ipv6Addr::new(0x2001, 0xdb8, 0x203, 0, 0, 0, 0, 0), 64);
    pub const CLIENT_NETWORK_OUT_OF_RANGE: Ipv6Net =
        net(Ipv6Addr::new(0x2001, 0xdb8, 0x192, 0, 0, 0, 0, 0), 64);
    pub const EDGE_CLIENT_IN_RANGE_IP: Ipv6Addr =
        Ipv6Addr::new(0x2001, 0xdb8, 0x203, 0, 0, 0, 0, 1);
    pub const EDGE_CLIENT_OUT_OF_RANGE_IP: Ipv6Addr =
        Ipv6Addr::new(0x2001, 0xdb8, 0x192, 0, 0, 0, 0, 1);
    pub const CLIENT_IN_RANGE_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x203, 0, 0, 0, 0, 0x10);
    pub const CLIENT_OUT_OF_RANGE_IP: Ipv6Addr =
        Ipv6Addr::new(0x2001, 0xdb8, 0x192, 0, 0, 0, 0, 0x10);

    const fn net(addr: Ipv6Addr, prefix: u8) -> Ipv6Net {
        Ipv6Net::new_assert(addr, prefix)
    }

    /// `n`'s decimal digits read as hexadecimal: the group that looks like `n`.
    fn looks_like(n: u32) -> u16 {
        u16::from_str_radix(&n.to_string(), 16).unwrap_or(u16::MAX)
    }

    /// Node N's address on the node network: `2001:db8:18::(10+N)`.
    pub fn node_ip(node: usize) -> Result<Ipv6Addr, NetlabError> {
        let n = u32::from(check_node(node)?);
        Ok(with_last(NODE_NETWORK, looks_like(10 + n)))
    }

    /// Node N's pod CIDR: `fd00:10:244:N::/64`.
    pub fn node_pod_cidr(node: usize) -> Result<Ipv6Net, NetlabError> {
        let n = u32::from(check_node(node)?);
        let segments = POD_NETWORK.network().segments();
        let base = Ipv6Addr::new(
            segments[0],
            segments[1],
            segments[2],
            looks_like(n),
            0,
            0,
            0,
            0,
        );
        Ok(net(base, 64))
    }

    /// Node N's address on its `cni0` bridge, the pods' gateway: `fd00:10:244:N::1`.
    pub fn pod_gateway(node: usize) -> Result<Ipv6Addr, NetlabError> {
        Ok(with_last(node_pod_cidr(node)?, 1))
    }

    /// Pod `index` on node N: `fd00:10:244:N::(1+index)`, as its IPv4 address ends.
    pub fn pod_ip(node: usize, index: u32) -> Result<Ipv6Addr, NetlabError> {
        if !(1..=MAX_POD_INDEX).contains(&index) {
            return Err(NetlabError::PodIndexOutOfRange {
                node,
                index,
                max: MAX_POD_INDEX,
            });
        }
        Ok(with_last(node_pod_cidr(node)?, looks_like(index + 1)))
    }

    fn with_last(net: Ipv6Net, last: u16) -> Ipv6Addr {
        let mut segments = net.network().segments();
        segments[7] = last;
        Ipv6Addr::from(segments)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_families_put_the_primary_first() {
        assert_eq!(
            ClusterFamilies::Dual.families(),
            [IpFamily::V4, IpFamily::V6]
        );
        assert!(!ClusterFamilies::Ipv6.has(IpFamily::V4));
        assert!(ClusterFamilies::Ipv4.has(IpFamily::V4));
    }

    #[test]
    fn nodes_and_pods_follow_the_design_plan() {
        assert_eq!(node_ip(1).unwrap(), Ipv4Addr::new(198, 18, 0, 11));
        assert_eq!(node_ip(3).unwrap(), Ipv4Addr::new(198, 18, 0, 13));
        let pods = PodNetwork::DEFAULT;
        assert_eq!(pods.node_cidr(2).unwrap().to_string(), "10.244.2.0/24");
        assert_eq!(pods.gateway(2).unwrap(), Ipv4Addr::new(10, 244, 2, 1));
        assert_eq!(pods.pod_ip(2, 1).unwrap(), Ipv4Addr::new(10, 244, 2, 2));
        assert_eq!(pods.pod_ip(2, 253).unwrap(), Ipv4Addr::new(10, 244, 2, 254));
    }

    #[test]
    fn other_pod_networks_give_each_node_its_slash_24() {
        let pods: PodNetwork = "10.42.0.0/16".parse().unwrap();
        assert_eq!(pods.node_cidr(3).unwrap().to_string(), "10.42.3.0/24");
        assert_eq!(pods.pod_ip(3, 1).unwrap(), Ipv4Addr::new(10, 42, 3, 2));
        let wide: PodNetwork = "172.16.0.0/12".parse().unwrap();
        assert_eq!(wide.node_cidr(1).unwrap().to_string(), "172.16.1.0/24");
        assert!(
            "10.42.0.0/17".parse::<PodNetwork>().is_err(),
            "no room for 200 nodes"
        );
        assert!("10.42.0.0".parse::<PodNetwork>().is_err());
    }

    #[test]
    fn out_of_range_indices_are_errors() {
        assert!(node_ip(0).is_err());
        assert!(node_ip(MAX_NODES + 1).is_err());
        assert!(PodNetwork::DEFAULT.pod_ip(1, 0).is_err());
        assert!(PodNetwork::DEFAULT.pod_ip(1, MAX_POD_INDEX + 1).is_err());
    }

    #[test]
    fn every_node_and_pod_address_is_inside_its_network() {
        for node in 1..=MAX_NODES {
            assert!(NODE_NETWORK.contains(&node_ip(node).unwrap()));
            let pods = PodNetwork::DEFAULT;
            let cidr = pods.node_cidr(node).unwrap();
            assert!(pods.cidr().contains(&cidr));
            for index in [1, 100, MAX_POD_INDEX] {
                let ip = pods.pod_ip(node, index).unwrap();
                assert!(cidr.contains(&ip));
                assert_ne!(ip, cidr.broadcast());
                assert_ne!(ip, pods.gateway(node).unwrap());
            }
        }
    }

    #[test]
    fn the_ipv6_plan_reads_like_the_ipv4_one() {
        assert_eq!(v6::node_ip(1).unwrap().to_string(), "2001:db8:18::11");
        assert_eq!(v6::node_ip(200).unwrap().to_string(), "2001:db8:18::210");
        assert_eq!(
            v6::node_pod_cidr(2).unwrap().to_string(),
            "fd00:10:244:2::/64"
        );
        assert_eq!(v6::pod_gateway(2).unwrap().to_string(), "fd00:10:244:2::1");
        assert_eq!(v6::pod_ip(2, 2).unwrap().to_string(), "fd00:10:244:2::3");
        assert!(v6::pod_ip(2, 0).is_err() && v6::node_ip(0).is_err());
        for node in 1..=MAX_NODES {
            assert!(v6::NODE_NETWORK.contains(&v6::node_ip(node).unwrap()));
            let cidr = v6::node_pod_cidr(node).unwrap();
            assert!(v6::POD_NETWORK.contains(&cidr));
            assert!(cidr.contains(&v6::pod_ip(node, MAX_POD_INDEX).unwrap()));
        }
        for cluster in [
            v6::NODE_NETWORK,
            v6::POD_NETWORK,
            v6::SERVICE_CIDR,
            v6::VIP_POOL,
        ] {
            for client in [v6::CLIENT_NETWORK_IN_RANGE, v6::CLIENT_NETWORK_OUT_OF_RANGE] {
                assert!(!cluster.contains(&client) && !client.contains(&cluster));
            }
        }
    }

    #[test]
    fn client_ranges_do_not_overlap_cluster_ranges() {
        for cluster in [
            NODE_NETWORK,
            PodNetwork::DEFAULT.cidr(),
            SERVICE_CIDR,
            VIP_POOL,
        ] {
            for client in [CLIENT_NETWORK_IN_RANGE, CLIENT_NETWORK_OUT_OF_RANGE] {
                assert!(!cluster.contains(&client) && !client.contains(&cluster));
            }
        }
        assert!(CLIENT_NETWORK_IN_RANGE.contains(&CLIENT_IN_RANGE_IP));
        assert!(CLIENT_NETWORK_OUT_OF_RANGE.contains(&CLIENT_OUT_OF_RANGE_IP));
    }
}
