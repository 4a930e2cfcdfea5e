//! The virtual cluster: switch, control plane, nodes with pods, cloud edge, clients.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use ipnet::Ipv4Net;

use crate::addr::{self, IpFamily, PodNetwork, v6};
use crate::cleanup;
use crate::echo::{DEFAULT_ECHO_PORT, EchoClient, READY_LINE, echo_binary};
use crate::error::NetlabError;
use crate::naming::RunPrefix;
use crate::netns::{ChildGuard, Netns, run_checked};
use crate::plan::{self, Step, ifname};

/// A namespace with one address (and an IPv6 one in a dual-stack topology): the control
/// plane and the external clients.
#[derive(Debug, Clone)]
pub struct Host {
    pub netns: Netns,
    pub ip: Ipv4Addr,
    pub ip6: Option<Ipv6Addr>,
}

/// The address of `family` of a host, node or pod: IPv6 only in a dual-stack topology.
fn address_of(family: IpFamily, ip: Ipv4Addr, ip6: Option<Ipv6Addr>) -> Option<IpAddr> {
    match family {
        IpFamily::V4 => Some(ip.into()),
        IpFamily::V6 => ip6.map(IpAddr::from),
    }
}

impl Host {
    /// Its address of `family`.
    pub fn ip_of(&self, family: IpFamily) -> Option<IpAddr> {
        address_of(family, self.ip, self.ip6)
    }
}

impl Node {
    /// Its address of `family` on the node network.
    pub fn ip_of(&self, family: IpFamily) -> Option<IpAddr> {
        address_of(family, self.ip, self.ip6)
    }
}

impl Pod {
    /// Its address of `family`.
    pub fn ip_of(&self, family: IpFamily) -> Option<IpAddr> {
        address_of(family, self.ip, self.ip6)
    }
}

/// A cloud edge. The single edge is the gateway of the node network and of both client
/// networks; an edge of an edge cluster sits behind the router, which is.
#[derive(Debug, Clone)]
pub struct Edge {
    pub netns: Netns,
    /// 198.18.0.1 for the single edge (the nodes' default gateway); 198.18.0.(240+E) for
    /// edge E of a cluster.
    pub node_network_ip: Ipv4Addr,
    /// Interface where the mock cloud puts VIPs in proxy mode (`lo`).
    pub vip_interface: String,
    /// An edge cluster's edge's leg on the edge LAN (its interface and address): where it
    /// meets the router, as BGP neighbour or as the L2 owner of a VIP.
    pub uplink: Option<(String, Ipv4Addr)>,
}

/// A node namespace.
#[derive(Debug, Clone)]
pub struct Node {
    /// 1-based.
    pub index: usize,
    /// The Kubernetes Node name, also what the pod echo reports as `node`.
    pub name: String,
    pub netns: Netns,
    pub ip: Ipv4Addr,
    pub pod_cidr: Ipv4Net,
    /// The IPv6 address and pod CIDR in a dual-stack topology.
    pub ip6: Option<Ipv6Addr>,
}

/// A pod namespace on a node.
#[derive(Debug, Clone)]
pub struct Pod {
    /// What the pod echo reports as `pod`, e.g. `n2p1`.
    pub name: String,
    /// 1-based index of its node.
    pub node: usize,
    pub node_name: String,
    /// Per-node index, never reused within a topology.
    pub index: u32,
    pub netns: Netns,
    pub ip: Ipv4Addr,
    pub ip6: Option<Ipv6Addr>,
}

/// Whether and how pods run the echo server.
#[derive(Debug, Clone)]
enum EchoSetup {
    /// Locate `tandem-echo` with [`echo_binary`].
    Locate,
    Binary(PathBuf),
    Off,
}

/// Builds a [`Topology`]: `Topology::builder().nodes(3).pods_per_node(&[2, 2, 0]).build()`.
#[derive(Debug, Clone)]
pub struct TopologyBuilder {
    nodes: usize,
    pods: PodNetwork,
    pods_per_node: Option<Vec<u32>>,
    echo: EchoSetup,
    http_port: u16,
    udp_port: u16,
    handle_signals: bool,
    ipv6: bool,
    edges: usize,
}

impl TopologyBuilder {
    /// An edge cluster of `edges` behind a router, with a 3-member etcd's namespaces, when
    /// more than one (default 1: the single edge is the gateway). IPv4 only.
    pub fn edges(mut self, edges: usize) -> Self {
        self.edges = edges;
        self
    }

    /// IPv6 beside IPv4 on every link, host and pod ([`addr::v6`]): a dual-stack
    /// topology (default: IPv4 alone).
    pub fn ipv6(mut self) -> Self {
        self.ipv6 = true;
        self
    }

    /// Number of nodes (default 2).
    pub fn nodes(mut self, nodes: usize) -> Self {
        self.nodes = nodes;
        self
    }

    /// The cluster's pod network; node N gets its N-th /24 (default `10.244.0.0/16`).
    pub fn pod_network(mut self, pods: PodNetwork) -> Self {
        self.pods = pods;
        self
    }

    /// Pods per node, one entry per node (default: one pod on every node).
    pub fn pods_per_node(mut self, pods: &[u32]) -> Self {
        self.pods_per_node = Some(pods.to_vec());
        self
    }

    /// The `tandem-echo` binary the pods run (default: [`echo_binary`]).
    pub fn echo_binary(mut self, binary: impl Into<PathBuf>) -> Self {
        self.echo = EchoSetup::Binary(binary.into());
        self
    }

    /// Pods run nothing; the caller starts its own processes in them.
    pub fn without_echo(mut self) -> Self {
        self.echo = EchoSetup::Off;
        self
    }

    /// Ports of the pod echo (default 8080 for both).
    pub fn echo_ports(mut self, http: u16, udp: u16) -> Self {
        self.http_port = http;
        self.udp_port = udp;
        self
    }

    /// Whether SIGINT/SIGTERM remove the topology and exit the process with 130/143
    /// (default true). A binary with its own graceful shutdown turns this off and drops
    /// the topology itself.
    pub fn handle_signals(mut self, handle: bool) -> Self {
        self.handle_signals = handle;
        self
    }

    /// [`TopologyBuilder::build`] on a blocking thread, for async callers.
    pub async fn build_async(self) -> Result<Topology, NetlabError> {
        tokio::task::spawn_blocking(move || self.build())
            .await
            .map_err(|e| NetlabError::Io {
                context: "building the topology".to_owned(),
                source: std::io::Error::other(e),
            })?
    }

    /// Creates every namespace, link, address and route, and starts the pod echoes.
    /// On error everything created so far is removed.
    pub fn build(self) -> Result<Topology, NetlabError> {
        if self.nodes == 0 || self.nodes > addr::MAX_NODES {
            return Err(NetlabError::NodeOutOfRange {
                node: self.nodes,
                max: addr::MAX_NODES,
            });
        }
        if self.edges == 0 || self.edges > addr::MAX_EDGES {
            return Err(NetlabError::EdgesOutOfRange {
                edges: self.edges,
                max: addr::MAX_EDGES,
            });
        }
        if self.edges > 1 && self.ipv6 {
            return Err(NetlabError::EdgeClusterIpv4Only);
        }
        let pods_per_node = self
            .pods_per_node
            .clone()
            .unwrap_or_else(|| vec![1; self.nodes]);
        if pods_per_node.len() != self.nodes {
            return Err(NetlabError::PodsPerNodeMismatch {
                listed: pods_per_node.len(),
                nodes: self.nodes,
            });
        }
        let echo_binary = match &self.echo {
            EchoSetup::Locate => Some(echo_binary()?),
            EchoSetup::Binary(path) if path.is_file() => Some(path.clone()),
            EchoSetup::Binary(path) => {
                return Err(NetlabError::EchoBinaryNotFound {
                    searched: vec![path.clone()],
                });
            }
            EchoSetup::Off => None,
        };
        cleanup::remove_stale_once();

        let prefix = RunPrefix::next_for_this_process();
        let ipv6 = self.ipv6;
        let host = |netns: String, ip, ip6| Host {
            netns: Netns::attach(netns),
            ip,
            ip6: ipv6.then_some(ip6),
        };
        // The Topology exists before the first namespace, so an error below drops it and
        // removes whatever was already created.
        let mut topology = Topology {
            switch: Netns::attach(prefix.switch()),
            control_plane: host(
                prefix.control_plane(),
                addr::CONTROL_PLANE_IP,
                v6::CONTROL_PLANE_IP,
            ),
            edges: Vec::new(),
            router: None,
            etcd: Vec::new(),
            client_in_range: host(
                prefix.client(1),
                addr::CLIENT_IN_RANGE_IP,
                v6::CLIENT_IN_RANGE_IP,
            ),
            client_out_of_range: host(
                prefix.client(2),
                addr::CLIENT_OUT_OF_RANGE_IP,
                v6::CLIENT_OUT_OF_RANGE_IP,
            ),
            nodes: Vec::new(),
            pods: Vec::new(),
            next_pod_index: vec![1; self.nodes],
            echo_binary,
            http_port: self.http_port,
            udp_port: self.udp_port,
            echoes: HashMap::new(),
            prefix,
            pod_network: self.pods,
            ipv6,
        };
        cleanup::register(&topology.prefix, self.handle_signals);
        tracing::info!(prefix = %topology.prefix, nodes = self.nodes, "building topology");

        run_steps(&plan::base(&topology.prefix, self.pods, ipv6, self.edges))?;
        if self.edges == 1 {
            topology.edges.push(Edge {
                netns: Netns::attach(topology.prefix.edge()),
                node_network_ip: addr::EDGE_NODE_IP,
                vip_interface: ifname::EDGE_VIPS.to_owned(),
                uplink: None,
            });
        } else {
            run_steps(&plan::edge_cluster(
                &topology.prefix,
                self.pods,
                self.edges,
            )?)?;
            topology.router = Some(host(
                topology.prefix.router(),
                addr::EDGE_NODE_IP,
                v6::EDGE_NODE_IP,
            ));
            for edge in 1..=self.edges {
                let (node_network_ip, uplink) = addr::cluster_edge_ips(edge)?;
                topology.edges.push(Edge {
                    netns: Netns::attach(topology.prefix.cluster_edge(edge)),
                    node_network_ip,
                    vip_interface: ifname::EDGE_VIPS.to_owned(),
                    uplink: Some((ifname::EDGE_UPLINK.to_owned(), uplink)),
                });
            }
            topology.etcd = (1..=addr::ETCD_MEMBERS)
                .map(|member| Host {
                    netns: Netns::attach(topology.prefix.etcd(member)),
                    ip: addr::etcd_ip(member),
                    ip6: None,
                })
                .collect();
        }
        for index in 1..=self.nodes {
            run_steps(&plan::node(
                &topology.prefix,
                self.pods,
                index,
                self.nodes,
                ipv6,
            )?)?;
            topology.nodes.push(Node {
                index,
                name: node_name(index),
                netns: Netns::attach(topology.prefix.node(index)),
                ip: addr::node_ip(index)?,
                pod_cidr: self.pods.node_cidr(index)?,
                ip6: if ipv6 {
                    Some(v6::node_ip(index)?)
                } else {
                    None
                },
            });
        }
        let mut starting = Vec::new();
        for (node_pos, &count) in pods_per_node.iter().enumerate() {
            for _ in 0..count {
                let pod = topology.create_pod(node_pos + 1)?;
                if let Some(guard) = topology.start_echo(&pod)? {
                    starting.push((pod.name.clone(), guard));
                }
                topology.pods.push(pod);
            }
        }
        // All echoes start in parallel; then each must say it is listening.
        for (name, mut guard) in starting {
            wait_ready(&mut guard)?;
            topology.echoes.insert(name, guard);
        }
        Ok(topology)
    }
}

/// The Kubernetes Node name of node `index`.
pub fn node_name(index: usize) -> String {
    format!("node-{index}")
}

fn run_steps(steps: &[Step]) -> Result<(), NetlabError> {
    for step in steps {
        run_step(step)?;
    }
    Ok(())
}

fn run_step(step: &Step) -> Result<(), NetlabError> {
    match step {
        Step::AddNetns(name) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "add", name]);
            run_checked(cmd).map(drop)
        }
        Step::Ip { netns, commands } => {
            let mut cmd = Command::new("ip");
            cmd.args(["-n", netns, "-batch", "-"]);
            run_with_stdin(cmd, &(commands.join("\n") + "\n"))
        }
        Step::Sysctl { netns, settings } => {
            let mut cmd = Netns::attach(netns.as_str()).command("sysctl");
            cmd.arg("-qew");
            cmd.args(settings.iter().map(|(k, v)| format!("{k}={v}")));
            run_checked(cmd).map(drop)
        }
    }
}

fn run_with_stdin(mut cmd: Command, input: &str) -> Result<(), NetlabError> {
    use std::io::Write;
    let command = crate::netns::describe(&cmd);
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| NetlabError::Spawn {
            command: command.clone(),
            source,
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .map_err(|source| NetlabError::Io {
                context: format!("writing to `{command}`"),
                source,
            })?;
    }
    let output = child.wait_with_output().map_err(|source| NetlabError::Io {
        context: format!("waiting for `{command}`"),
        source,
    })?;
    crate::netns::checked_stdout(format!("{command} <<< {input:?}"), output).map(drop)
}

fn wait_ready(guard: &mut ChildGuard) -> Result<(), NetlabError> {
    let command = guard.command().to_owned();
    let stdout = guard.child_mut().stdout.take();
    let mut line = String::new();
    if let Some(stdout) = stdout {
        // The echo prints the line right after binding, or exits (EOF) on failure.
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(|source| NetlabError::Io {
                context: format!("reading the ready line of `{command}`"),
                source,
            })?;
    }
    if line.trim() == READY_LINE {
        Ok(())
    } else {
        Err(NetlabError::Io {
            context: format!("`{command}` did not become ready"),
            source: std::io::Error::other(format!("first line {line:?}")),
        })
    }
}

/// A running virtual cluster. Dropping it (also while unwinding from a panic) kills every
/// process inside its namespaces and removes them; so does SIGINT/SIGTERM.
#[derive(Debug)]
pub struct Topology {
    prefix: RunPrefix,
    pod_network: PodNetwork,
    /// IPv6 beside IPv4 everywhere.
    ipv6: bool,
    switch: Netns,
    control_plane: Host,
    /// One, or the edge cluster's.
    edges: Vec<Edge>,
    /// The router in front of an edge cluster (198.18.0.1, the gateway).
    router: Option<Host>,
    /// An edge cluster's etcd members.
    etcd: Vec<Host>,
    client_in_range: Host,
    client_out_of_range: Host,
    nodes: Vec<Node>,
    pods: Vec<Pod>,
    next_pod_index: Vec<u32>,
    echo_binary: Option<PathBuf>,
    http_port: u16,
    udp_port: u16,
    echoes: HashMap<String, ChildGuard>,
}

impl Topology {
    pub fn builder() -> TopologyBuilder {
        TopologyBuilder {
            nodes: 2,
            pods: PodNetwork::DEFAULT,
            pods_per_node: None,
            echo: EchoSetup::Locate,
            http_port: DEFAULT_ECHO_PORT,
            udp_port: DEFAULT_ECHO_PORT,
            handle_signals: true,
            ipv6: false,
            edges: 1,
        }
    }

    /// The prefix of every namespace of this topology, e.g. `tdm4242x1`.
    /// The cluster's pod network, which node pod CIDRs and pod addresses come from.
    pub fn pod_network(&self) -> PodNetwork {
        self.pod_network
    }

    pub fn prefix(&self) -> &str {
        self.prefix.as_str()
    }

    /// The namespace holding the bridges.
    pub fn switch(&self) -> &Netns {
        &self.switch
    }

    /// 198.18.0.2: where the API server relay and the controller run.
    pub fn control_plane(&self) -> &Host {
        &self.control_plane
    }

    /// The cloud edge (198.18.0.1): where the mock cloud runs; an edge cluster's first.
    pub fn edge(&self) -> &Edge {
        // A topology is built with at least one edge.
        &self.edges[0]
    }

    /// Every edge: the single one, or the edge cluster's.
    pub fn edges(&self) -> &[Edge] {
        &self.edges
    }

    /// The router in front of an edge cluster: the nodes' and clients' gateway.
    pub fn router(&self) -> Option<&Host> {
        self.router.as_ref()
    }

    /// An edge cluster's etcd members (none for a single edge).
    pub fn etcd(&self) -> &[Host] {
        &self.etcd
    }

    /// Client `c1`, 203.0.113.10: inside the usual source range.
    pub fn client_in_range(&self) -> &Host {
        &self.client_in_range
    }

    /// Client `c2`, 192.0.2.10: outside any source range.
    pub fn client_out_of_range(&self) -> &Host {
        &self.client_out_of_range
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Node `index` (1-based).
    pub fn node(&self, index: usize) -> Result<&Node, NetlabError> {
        index
            .checked_sub(1)
            .and_then(|i| self.nodes.get(i))
            .ok_or(NetlabError::UnknownNode(index))
    }

    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    /// The pods on node `index`.
    pub fn pods_on(&self, index: usize) -> impl Iterator<Item = &Pod> {
        self.pods.iter().filter(move |p| p.node == index)
    }

    pub fn pod(&self, name: &str) -> Result<&Pod, NetlabError> {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| NetlabError::UnknownPod(name.to_owned()))
    }

    /// Every namespace of the topology.
    pub fn namespaces(&self) -> Vec<&Netns> {
        let mut all = vec![
            &self.switch,
            &self.control_plane.netns,
            &self.client_in_range.netns,
            &self.client_out_of_range.netns,
        ];
        all.extend(self.edges.iter().map(|e| &e.netns));
        all.extend(self.router.iter().map(|r| &r.netns));
        all.extend(self.etcd.iter().map(|m| &m.netns));
        all.extend(self.nodes.iter().map(|n| &n.netns));
        all.extend(self.pods.iter().map(|p| &p.netns));
        all
    }

    /// The pod echo's HTTP port.
    pub fn echo_http_port(&self) -> u16 {
        self.http_port
    }

    /// The pod echo's UDP port.
    pub fn echo_udp_port(&self) -> u16 {
        self.udp_port
    }

    /// A client for the echo servers, using the pods' `tandem-echo` binary.
    pub fn echo_client(&self) -> Result<EchoClient, NetlabError> {
        match &self.echo_binary {
            Some(binary) => Ok(EchoClient::new(binary)),
            None => EchoClient::locate(),
        }
    }

    /// Adds a pod on node `node` (running the echo unless built `without_echo`).
    pub fn add_pod(&mut self, node: usize) -> Result<Pod, NetlabError> {
        let pod = self.create_pod(node)?;
        if let Some(mut guard) = self.start_echo(&pod)? {
            wait_ready(&mut guard)?;
            self.echoes.insert(pod.name.clone(), guard);
        }
        self.pods.push(pod.clone());
        Ok(pod)
    }

    /// Removes a pod: its processes die, its namespace and veth go.
    pub fn remove_pod(&mut self, name: &str) -> Result<Pod, NetlabError> {
        let pos = self
            .pods
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| NetlabError::UnknownPod(name.to_owned()))?;
        let pod = self.pods.remove(pos);
        drop(self.echoes.remove(name));
        cleanup::remove_netns(pod.netns.name());
        Ok(pod)
    }

    fn create_pod(&mut self, node: usize) -> Result<Pod, NetlabError> {
        let node_name = self.node(node)?.name.clone();
        let slot = self
            .next_pod_index
            .get_mut(node - 1)
            .ok_or(NetlabError::UnknownNode(node))?;
        let index = *slot;
        let ip = self.pod_network.pod_ip(node, index)?;
        let ip6 = if self.ipv6 {
            Some(v6::pod_ip(node, index)?)
        } else {
            None
        };
        *slot += 1;
        let pod = Pod {
            name: format!("n{node}p{index}"),
            node,
            node_name,
            index,
            netns: Netns::attach(self.prefix.pod(node, index)),
            ip,
            ip6,
        };
        run_steps(&plan::pod(
            &self.prefix,
            self.pod_network,
            node,
            index,
            self.ipv6,
        )?)?;
        Ok(pod)
    }

    fn start_echo(&self, pod: &Pod) -> Result<Option<ChildGuard>, NetlabError> {
        let Some(binary) = &self.echo_binary else {
            return Ok(None);
        };
        self.spawn_echo_process(binary, &pod.netns, &pod.name, Some(&pod.node_name))
            .map(Some)
    }

    fn spawn_echo_process(
        &self,
        binary: &PathBuf,
        netns: &Netns,
        name: &str,
        node: Option<&str>,
    ) -> Result<ChildGuard, NetlabError> {
        let mut cmd = netns.command(binary);
        cmd.args(["--name", name])
            .args(node.map(|n| ["--node", n]).into_iter().flatten())
            .args(["--http-port", &self.http_port.to_string()])
            .args(["--udp-port", &self.udp_port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        ChildGuard::spawn(cmd)
    }

    /// Runs an echo server reporting `name` in any namespace of the topology (e.g. a node,
    /// to check host-network reachability) and waits until it listens.
    pub fn spawn_echo(&self, netns: &Netns, name: &str) -> Result<ChildGuard, NetlabError> {
        let binary = match &self.echo_binary {
            Some(b) => b.clone(),
            None => echo_binary()?,
        };
        let mut guard = self.spawn_echo_process(&binary, netns, name, None)?;
        wait_ready(&mut guard)?;
        Ok(guard)
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        tracing::info!(prefix = %self.prefix, "removing topology");
        self.echoes.clear();
        cleanup::remove_prefix(&self.prefix);
        cleanup::unregister(&self.prefix);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_shapes_are_refused_before_touching_the_kernel() {
        let build = |b: TopologyBuilder| b.without_echo().build().map(|_| ()).unwrap_err();
        assert!(matches!(
            build(Topology::builder().nodes(0)),
            NetlabError::NodeOutOfRange { node: 0, .. }
        ));
        assert!(matches!(
            build(Topology::builder().nodes(addr::MAX_NODES + 1)),
            NetlabError::NodeOutOfRange { .. }
        ));
        assert!(matches!(
            build(Topology::builder().nodes(2).pods_per_node(&[1])),
            NetlabError::PodsPerNodeMismatch {
                listed: 1,
                nodes: 2
            }
        ));
    }

    #[test]
    fn a_missing_echo_binary_is_reported_before_building() {
        let err = Topology::builder()
            .echo_binary("/nonexistent/tandem-echo")
            .build()
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(&err, NetlabError::EchoBinaryNotFound { searched } if searched[0].ends_with("tandem-echo")),
            "{err}"
        );
    }
}
