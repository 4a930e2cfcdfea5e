//! What a topology consists of, as a list of steps (pure).
//!
//! The doing side (`topology.rs`) runs each step with `ip`/`sysctl`; keeping the steps
//! as data lets the tests check the wiring (names, addresses, routes) without root.

use crate::addr::{self, PodNetwork, v6};
use crate::error::NetlabError;
use crate::naming::RunPrefix;

/// Interface names inside the namespaces. Every name is per-namespace, so they can be
/// fixed short words: nothing is ever created in the root namespace.
pub mod ifname {
    /// Node-network bridge in the switch namespace.
    pub const NODE_BRIDGE: &str = "brnode";
    /// In-range client bridge in the switch namespace.
    pub const CLIENT_IN_RANGE_BRIDGE: &str = "brc1";
    /// Out-of-range client bridge in the switch namespace.
    pub const CLIENT_OUT_OF_RANGE_BRIDGE: &str = "brc2";
    /// Every host's uplink (and the edge's node-network leg).
    pub const UPLINK: &str = "eth0";
    /// The edge's leg on the in-range client network.
    pub const EDGE_CLIENT_IN_RANGE: &str = "eth1";
    /// The edge's leg on the out-of-range client network.
    pub const EDGE_CLIENT_OUT_OF_RANGE: &str = "eth2";
    /// Where the mock cloud puts VIPs in the edge (proxy mode). The loopback: the
    /// `dummy` link type needs a kernel module that may not be loaded.
    pub const EDGE_VIPS: &str = "lo";
    /// The bridge between the router and the edges of an edge cluster.
    pub const EDGE_LAN_BRIDGE: &str = "bredges";
    /// An edge cluster's edge's leg on the edge LAN (the single edge's is its client legs).
    pub const EDGE_UPLINK: &str = "eth1";
    /// The switch port of node `node`'s uplink.
    pub fn node_port(node: usize) -> String {
        format!("n{node}")
    }
    /// The switch port of edge `edge`'s leg on the node network.
    pub fn edge_node_port(edge: usize) -> String {
        format!("e{edge}")
    }
    /// The switch port of edge `edge`'s leg on the edge LAN.
    pub fn edge_lan_port(edge: usize) -> String {
        format!("e{edge}up")
    }
    /// The router's leg on the edge LAN.
    pub const ROUTER_EDGE_LAN: &str = "eth3";
    /// The pod bridge on every node.
    pub const POD_BRIDGE: &str = "cni0";

    /// The node-side end of pod `index`'s veth.
    pub fn pod_veth(index: u32) -> String {
        format!("veth{index}")
    }
}

/// One thing to do to the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// `ip netns add NAME`.
    AddNetns(String),
    /// `ip -n NETNS -batch -` with these command lines (without the leading `ip`).
    Ip {
        netns: String,
        commands: Vec<String>,
    },
    /// `ip netns exec NETNS sysctl -qew KEY=VALUE...`; unknown keys are ignored so a
    /// kernel without br_netfilter still works.
    Sysctl {
        netns: String,
        settings: Vec<(String, String)>,
    },
}

fn ip(netns: &str, commands: Vec<String>) -> Step {
    Step::Ip {
        netns: netns.to_owned(),
        commands,
    }
}

fn sysctl(netns: &str, settings: &[(&str, &str)]) -> Step {
    Step::Sysctl {
        netns: netns.to_owned(),
        settings: settings
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

/// A veth whose one end is `local` in the switch namespace, enslaved to `bridge`, and
/// whose other end is `eth0` in `peer_netns`.
fn switch_port(local: &str, bridge: &str, peer_netns: &str, peer_if: &str) -> Vec<String> {
    vec![
        format!("link add {local} type veth peer name {peer_if} netns {peer_netns}"),
        format!("link set {local} master {bridge}"),
        format!("link set {local} up"),
    ]
}

/// The namespace that is the nodes' and the clients' gateway: the single edge, or the
/// router in front of an edge cluster of `edges`.
pub fn gateway(prefix: &RunPrefix, edges: usize) -> String {
    if edges > 1 {
        prefix.router()
    } else {
        prefix.edge()
    }
}

/// The fixed part of every topology: switch, control plane, gateway (the edge, or the
/// router of an edge cluster of `edges`) and the two clients; with `ipv6`, each of them
/// also gets its address of [`v6`].
pub fn base(prefix: &RunPrefix, pods: PodNetwork, ipv6: bool, edges: usize) -> Vec<Step> {
    use ifname::*;
    let sw = prefix.switch();
    let cp = prefix.control_plane();
    let edge = gateway(prefix, edges);
    let c1 = prefix.client(1);
    let c2 = prefix.client(2);
    let mut steps: Vec<Step> = [&sw, &cp, &edge, &c1, &c2]
        .iter()
        .map(|n| Step::AddNetns((*n).clone()))
        .collect();

    let mut switch = vec!["link set lo up".to_owned()];
    for bridge in [
        NODE_BRIDGE,
        CLIENT_IN_RANGE_BRIDGE,
        CLIENT_OUT_OF_RANGE_BRIDGE,
    ] {
        switch.push(format!("link add {bridge} type bridge"));
        switch.push(format!("link set {bridge} up"));
    }
    switch.extend(switch_port("cp", NODE_BRIDGE, &cp, UPLINK));
    switch.extend(switch_port("edge", NODE_BRIDGE, &edge, UPLINK));
    switch.extend(switch_port(
        "edgec1",
        CLIENT_IN_RANGE_BRIDGE,
        &edge,
        EDGE_CLIENT_IN_RANGE,
    ));
    switch.extend(switch_port(
        "edgec2",
        CLIENT_OUT_OF_RANGE_BRIDGE,
        &edge,
        EDGE_CLIENT_OUT_OF_RANGE,
    ));
    switch.extend(switch_port("c1", CLIENT_IN_RANGE_BRIDGE, &c1, UPLINK));
    switch.extend(switch_port("c2", CLIENT_OUT_OF_RANGE_BRIDGE, &c2, UPLINK));
    steps.push(ip(&sw, switch));

    let cp_v6 = ipv6.then_some((v6::CONTROL_PLANE_IP, v6::EDGE_NODE_IP));
    steps.push(ip(
        &cp,
        host_uplink(addr::CONTROL_PLANE_IP, 24, addr::EDGE_NODE_IP, cp_v6),
    ));

    steps.push(sysctl(&edge, &forwarding(ipv6)));
    let mut edge_commands = vec![
        format!("link set {EDGE_VIPS} up"),
        format!("addr add {}/24 dev {UPLINK}", addr::EDGE_NODE_IP),
        format!("link set {UPLINK} up"),
        format!(
            "addr add {}/24 dev {EDGE_CLIENT_IN_RANGE}",
            addr::EDGE_CLIENT_IN_RANGE_IP
        ),
        format!("link set {EDGE_CLIENT_IN_RANGE} up"),
        format!(
            "addr add {}/24 dev {EDGE_CLIENT_OUT_OF_RANGE}",
            addr::EDGE_CLIENT_OUT_OF_RANGE_IP
        ),
        format!("link set {EDGE_CLIENT_OUT_OF_RANGE} up"),
        // The cloud never routes to pod IPs: external clients must go through a VIP or
        // a node port. `prohibit` answers with an ICMP error, so a client fails fast.
        format!("route add prohibit {}", pods.cidr()),
    ];
    if ipv6 {
        edge_commands.extend([
            format!("addr add {}/64 dev {UPLINK} nodad", v6::EDGE_NODE_IP),
            format!(
                "addr add {}/64 dev {EDGE_CLIENT_IN_RANGE} nodad",
                v6::EDGE_CLIENT_IN_RANGE_IP
            ),
            format!(
                "addr add {}/64 dev {EDGE_CLIENT_OUT_OF_RANGE} nodad",
                v6::EDGE_CLIENT_OUT_OF_RANGE_IP
            ),
            format!("route add prohibit {}", v6::POD_NETWORK),
        ]);
    }
    steps.push(ip(&edge, edge_commands));

    steps.push(ip(
        &c1,
        host_uplink(
            addr::CLIENT_IN_RANGE_IP,
            24,
            addr::EDGE_CLIENT_IN_RANGE_IP,
            ipv6.then_some((v6::CLIENT_IN_RANGE_IP, v6::EDGE_CLIENT_IN_RANGE_IP)),
        ),
    ));
    steps.push(ip(
        &c2,
        host_uplink(
            addr::CLIENT_OUT_OF_RANGE_IP,
            24,
            addr::EDGE_CLIENT_OUT_OF_RANGE_IP,
            ipv6.then_some((v6::CLIENT_OUT_OF_RANGE_IP, v6::EDGE_CLIENT_OUT_OF_RANGE_IP)),
        ),
    ));
    steps
}

/// An edge cluster of `edges` behind the router [`base`] made the gateway: each edge
/// with a leg on the node network and one on the edge LAN (its default route the router),
/// and the [`addr::ETCD_MEMBERS`] etcd members on the node network.
pub fn edge_cluster(
    prefix: &RunPrefix,
    pods: PodNetwork,
    edges: usize,
) -> Result<Vec<Step>, NetlabError> {
    use ifname::*;
    let router = prefix.router();
    let mut steps = Vec::new();
    let mut switch = vec![
        format!("link add {EDGE_LAN_BRIDGE} type bridge"),
        format!("link set {EDGE_LAN_BRIDGE} up"),
    ];
    switch.extend(switch_port(
        "rtedges",
        EDGE_LAN_BRIDGE,
        &router,
        ROUTER_EDGE_LAN,
    ));
    let mut hosts = Vec::new();
    for edge in 1..=edges {
        let name = prefix.cluster_edge(edge);
        let (node_ip, lan_ip) = addr::cluster_edge_ips(edge)?;
        steps.push(Step::AddNetns(name.clone()));
        switch.extend(switch_port(
            &edge_node_port(edge),
            NODE_BRIDGE,
            &name,
            UPLINK,
        ));
        switch.extend(switch_port(
            &edge_lan_port(edge),
            EDGE_LAN_BRIDGE,
            &name,
            EDGE_UPLINK,
        ));
        hosts.push(sysctl(&name, &forwarding(false)));
        hosts.push(ip(
            &name,
            vec![
                "link set lo up".to_owned(),
                format!("addr add {node_ip}/24 dev {UPLINK}"),
                format!("link set {UPLINK} up"),
                format!("addr add {lan_ip}/24 dev {EDGE_UPLINK}"),
                format!("link set {EDGE_UPLINK} up"),
                format!("route add default via {}", addr::ROUTER_EDGE_LAN_IP),
                format!("route add prohibit {}", pods.cidr()),
            ],
        ));
    }
    for member in 1..=addr::ETCD_MEMBERS {
        let name = prefix.etcd(member);
        steps.push(Step::AddNetns(name.clone()));
        switch.extend(switch_port(
            &format!("etcd{member}"),
            NODE_BRIDGE,
            &name,
            UPLINK,
        ));
        hosts.push(ip(
            &name,
            vec![
                "link set lo up".to_owned(),
                format!("addr add {}/24 dev {UPLINK}", addr::etcd_ip(member)),
                format!("link set {UPLINK} up"),
            ],
        ));
    }
    steps.push(ip(&prefix.switch(), switch));
    steps.extend(hosts);
    // An L4 hash: the router spreads flows, not just client addresses, over the edges.
    steps.push(sysctl(
        &router,
        &[("net.ipv4.fib_multipath_hash_policy", "1")],
    ));
    steps.push(ip(
        &router,
        vec![
            format!(
                "addr add {}/24 dev {ROUTER_EDGE_LAN}",
                addr::ROUTER_EDGE_LAN_IP
            ),
            format!("link set {ROUTER_EDGE_LAN} up"),
        ],
    ));
    Ok(steps)
}

/// IP forwarding, of IPv6 too with `ipv6`.
fn forwarding(ipv6: bool) -> Vec<(&'static str, &'static str)> {
    let mut settings = vec![("net.ipv4.ip_forward", "1")];
    if ipv6 {
        settings.push(("net.ipv6.conf.all.forwarding", "1"));
    }
    settings
}

/// The uplink's address (a /`prefix_len`) and default route, and the IPv6 ones (a /64,
/// without duplicate address detection, so the address works at once) when given.
fn host_uplink(
    ip: std::net::Ipv4Addr,
    prefix_len: u8,
    gateway: std::net::Ipv4Addr,
    ipv6: Option<(std::net::Ipv6Addr, std::net::Ipv6Addr)>,
) -> Vec<String> {
    use ifname::UPLINK;
    let mut commands = vec![
        "link set lo up".to_owned(),
        format!("addr add {ip}/{prefix_len} dev {UPLINK}"),
        format!("link set {UPLINK} up"),
        format!("route add default via {gateway}"),
    ];
    if let Some((ip, gateway)) = ipv6 {
        commands.extend([
            format!("addr add {ip}/64 dev {UPLINK} nodad"),
            format!("route add default via {gateway}"),
        ]);
    }
    commands
}

/// Node `node` of `node_count`: uplink on the node bridge, `cni0`, host-gw routes to the
/// other nodes' pod CIDRs; of both families with `ipv6`.
pub fn node(
    prefix: &RunPrefix,
    pods: PodNetwork,
    node: usize,
    node_count: usize,
    ipv6: bool,
) -> Result<Vec<Step>, NetlabError> {
    use ifname::*;
    let name = prefix.node(node);
    let node_ip = addr::node_ip(node)?;
    let switch = switch_port(&node_port(node), NODE_BRIDGE, &name, UPLINK);
    let uplink_v6 = match ipv6 {
        true => Some((v6::node_ip(node)?, v6::EDGE_NODE_IP)),
        false => None,
    };
    let mut commands = host_uplink(node_ip, 24, addr::EDGE_NODE_IP, uplink_v6);
    commands.extend([
        format!("link add {POD_BRIDGE} type bridge"),
        format!("addr add {}/24 dev {POD_BRIDGE}", pods.gateway(node)?),
        format!("link set {POD_BRIDGE} up"),
    ]);
    if ipv6 {
        commands.push(format!(
            "addr add {}/64 dev {POD_BRIDGE} nodad",
            v6::pod_gateway(node)?
        ));
    }
    for other in (1..=node_count).filter(|&o| o != node) {
        commands.push(format!(
            "route add {} via {}",
            pods.node_cidr(other)?,
            addr::node_ip(other)?
        ));
        if ipv6 {
            commands.push(format!(
                "route add {} via {}",
                v6::node_pod_cidr(other)?,
                v6::node_ip(other)?
            ));
        }
    }
    let mut settings = forwarding(ipv6);
    // kube-proxy needs bridged pod traffic to pass netfilter (hairpin, same-node service
    // traffic); it is per namespace and on by default, made explicit.
    settings.push(("net.bridge.bridge-nf-call-iptables", "1"));
    if ipv6 {
        settings.push(("net.bridge.bridge-nf-call-ip6tables", "1"));
    }
    Ok(vec![
        Step::AddNetns(name.clone()),
        ip(&prefix.switch(), switch),
        sysctl(&name, &settings),
        ip(&name, commands),
    ])
}

/// Pod `index` on node `node`: a namespace with `eth0` on the node's `cni0`, with an
/// IPv6 address too with `ipv6`.
pub fn pod(
    prefix: &RunPrefix,
    pods: PodNetwork,
    node: usize,
    index: u32,
    ipv6: bool,
) -> Result<Vec<Step>, NetlabError> {
    use ifname::*;
    let pod = prefix.pod(node, index);
    let node_ns = prefix.node(node);
    let veth = pod_veth(index);
    Ok(vec![
        Step::AddNetns(pod.clone()),
        ip(
            &node_ns,
            vec![
                format!("link add {veth} type veth peer name {UPLINK} netns {pod}"),
                format!("link set {veth} master {POD_BRIDGE}"),
                // Hairpin lets a pod reach itself through a Service, as kubenet sets it.
                format!("link set {veth} type bridge_slave hairpin on"),
                format!("link set {veth} up"),
            ],
        ),
        ip(
            &pod,
            host_uplink(
                pods.pod_ip(node, index)?,
                24,
                pods.gateway(node)?,
                match ipv6 {
                    true => Some((v6::pod_ip(node, index)?, v6::pod_gateway(node)?)),
                    false => None,
                },
            ),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernel limit for interface names (IFNAMSIZ - 1).
    const MAX_IFNAME_LEN: usize = 15;

    fn all_steps() -> Vec<Step> {
        let p = RunPrefix::new(4194304, 4000);
        let pods = PodNetwork::DEFAULT;
        let mut steps = base(&p, pods, true, 1);
        for n in 1..=3 {
            steps.extend(node(&p, pods, n, 3, true).unwrap());
            steps.extend(pod(&p, pods, n, addr::MAX_POD_INDEX, true).unwrap());
        }
        steps
    }

    fn ip_lines(steps: &[Step]) -> Vec<(String, String)> {
        steps
            .iter()
            .filter_map(|s| match s {
                Step::Ip { netns, commands } => {
                    Some(commands.iter().map(move |c| (netns.clone(), c.clone())))
                }
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn every_created_interface_name_fits_the_kernel_limit() {
        for (_, line) in ip_lines(&all_steps()) {
            let words: Vec<&str> = line.split_whitespace().collect();
            if words.starts_with(&["link", "add"]) {
                assert!(words[2].len() <= MAX_IFNAME_LEN, "{line}");
                if let Some(i) = words.iter().position(|w| *w == "name") {
                    assert!(words[i + 1].len() <= MAX_IFNAME_LEN, "{line}");
                }
            }
        }
    }

    #[test]
    fn every_namespace_is_created_before_use_and_belongs_to_the_run() {
        let p = RunPrefix::new(4194304, 4000);
        let mut created = std::collections::HashSet::new();
        for step in all_steps() {
            match step {
                Step::AddNetns(n) => {
                    assert!(p.owns(&n), "{n}");
                    assert!(created.insert(n.clone()), "created twice: {n}");
                }
                Step::Ip { netns, commands } => {
                    assert!(created.contains(&netns), "{netns} used before creation");
                    for c in commands {
                        if let Some(peer) = c.split(" netns ").nth(1) {
                            assert!(created.contains(peer), "{peer} used before creation");
                        }
                    }
                }
                Step::Sysctl { netns, .. } => assert!(created.contains(&netns)),
            }
        }
    }

    #[test]
    fn an_edge_cluster_sits_behind_a_router_that_is_everyones_gateway() {
        let p = RunPrefix::new(4194304, 4000);
        let pods = PodNetwork::DEFAULT;
        let mut steps = base(&p, pods, false, 3);
        steps.extend(edge_cluster(&p, pods, 3).unwrap());
        let lines = ip_lines(&steps);
        assert!(lines.contains(&(p.router(), "addr add 198.18.0.1/24 dev eth0".into())));
        assert!(lines.contains(&(p.router(), "addr add 198.19.0.1/24 dev eth3".into())));
        assert!(!steps.contains(&Step::AddNetns(p.edge())));
        for edge in 1..=3 {
            let e = p.cluster_edge(edge);
            assert!(
                lines.contains(&(e.clone(), format!("addr add 198.18.0.24{edge}/24 dev eth0")))
            );
            assert!(lines.contains(&(e.clone(), format!("addr add 198.19.0.1{edge}/24 dev eth1"))));
            assert!(lines.contains(&(e, "route add default via 198.19.0.1".into())));
        }
        assert!(lines.contains(&(p.etcd(3), "addr add 198.18.0.253/24 dev eth0".into())));
        // The same names and ordering checks as a single edge's topology.
        let mut created = std::collections::HashSet::new();
        for step in &steps {
            match step {
                Step::AddNetns(n) => assert!(p.owns(n) && created.insert(n.clone()), "{n}"),
                Step::Ip { netns, commands } => {
                    assert!(created.contains(netns), "{netns}");
                    for c in commands {
                        if let Some(peer) = c.split(" netns ").nth(1) {
                            assert!(created.contains(peer), "{peer} used before creation");
                        }
                        let words: Vec<&str> = c.split_whitespace().collect();
                        if words.starts_with(&["link", "add"]) {
                            assert!(words[2].len() <= MAX_IFNAME_LEN, "{c}");
                        }
                    }
                }
                Step::Sysctl { netns, .. } => assert!(created.contains(netns)),
            }
        }
        assert!(matches!(
            edge_cluster(&p, pods, addr::MAX_EDGES + 1),
            Err(NetlabError::EdgesOutOfRange { .. })
        ));
    }

    #[test]
    fn nodes_get_host_gw_routes_to_every_other_node() {
        let p = RunPrefix::new(1, 1);
        let lines = ip_lines(&node(&p, PodNetwork::DEFAULT, 2, 3, true).unwrap());
        let routes: Vec<&str> = lines
            .iter()
            .filter(|(ns, l)| ns == &p.node(2) && l.starts_with("route add "))
            .map(|(_, l)| l.as_str())
            .collect();
        assert_eq!(
            routes,
            [
                "route add default via 198.18.0.1",
                "route add default via 2001:db8:18::1",
                "route add 10.244.1.0/24 via 198.18.0.11",
                "route add fd00:10:244:1::/64 via 2001:db8:18::11",
                "route add 10.244.3.0/24 via 198.18.0.13",
                "route add fd00:10:244:3::/64 via 2001:db8:18::13",
            ]
        );
        // IPv4 alone: no IPv6 address or route anywhere.
        let v4_only = ip_lines(&node(&p, PodNetwork::DEFAULT, 2, 3, false).unwrap());
        assert!(v4_only.iter().all(|(_, l)| !l.contains(':')), "{v4_only:?}");
    }

    #[test]
    fn the_edge_forwards_but_prohibits_pod_addresses() {
        let p = RunPrefix::new(1, 1);
        let steps = base(&p, PodNetwork::DEFAULT, false, 1);
        assert!(steps.contains(&Step::Sysctl {
            netns: p.edge(),
            settings: vec![("net.ipv4.ip_forward".into(), "1".into())]
        }));
        let lines = ip_lines(&steps);
        assert!(lines.contains(&(p.edge(), "route add prohibit 10.244.0.0/16".into())));
        assert!(lines.contains(&(p.client(1), "route add default via 203.0.113.1".into())));
        assert!(lines.contains(&(p.client(2), "route add default via 192.0.2.1".into())));
        let lines = ip_lines(&base(&p, PodNetwork::DEFAULT, true, 1));
        for (netns, line) in [
            (p.edge(), "route add prohibit fd00:10:244::/48"),
            (p.client(1), "addr add 2001:db8:203::10/64 dev eth0 nodad"),
            (p.client(1), "route add default via 2001:db8:203::1"),
            (p.client(2), "route add default via 2001:db8:192::1"),
        ] {
            assert!(lines.contains(&(netns, line.into())), "{line}");
        }
    }

    #[test]
    fn pods_use_their_node_bridge_as_gateway() {
        let p = RunPrefix::new(1, 1);
        let lines = ip_lines(&pod(&p, PodNetwork::DEFAULT, 3, 2, true).unwrap());
        assert!(lines.contains(&(p.pod(3, 2), "addr add 10.244.3.3/24 dev eth0".into())));
        assert!(lines.contains(&(p.pod(3, 2), "route add default via 10.244.3.1".into())));
        assert!(lines.contains(&(
            p.pod(3, 2),
            "addr add fd00:10:244:3::3/64 dev eth0 nodad".into()
        )));
        assert!(lines.contains(&(p.pod(3, 2), "route add default via fd00:10:244:3::1".into())));
        let other: PodNetwork = "10.42.0.0/16".parse().unwrap();
        let lines = ip_lines(&pod(&p, other, 3, 2, false).unwrap());
        assert!(lines.contains(&(p.pod(3, 2), "addr add 10.42.3.3/24 dev eth0".into())));
        assert!(lines.contains(&(p.node(3), "link set veth2 master cni0".into())));
    }
}
