//! A real cluster of several nodes: a k3s server (with its own kubelet) and k3s agents
//! joined to it, each a real node ([`crate::node`]) in a network namespace of its own on
//! one node network, a `tandem_netlab` topology's nodes.
//!
//! The topology routes every node's pod subnet to that node, and the CNI bridge of each
//! hands out its addresses: the pod network owns the addresses, as a network plugin with
//! its own IPAM does. So the controller-manager allocates no pod CIDRs (its allocator hands
//! them out in the order Nodes register), and the cluster writes each Node's
//! `spec.podCIDR` once its kubelet registered it, as such a plugin does.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use tandem_netlab::{NetlabError, Topology};

use crate::node::{K3sNode, NodeConfig, NodeError, NodeRole};

/// The controller-manager's flag that leaves pod CIDRs to the pod network.
const NO_NODE_IPAM: &str = "--kube-controller-manager-arg=allocate-node-cidrs=false";
/// How long each node may take to register, and to be Ready.
const NODE_WITHIN: Duration = Duration::from_secs(120);

/// The lab's topology for a cluster of `nodes`: the node namespaces, with no pods of the
/// lab's own (the kubelets make them), and the outside clients.
pub fn topology(nodes: usize) -> Result<Topology, NetlabError> {
    Topology::builder()
        .nodes(nodes)
        .pods_per_node(&vec![0; nodes])
        .without_echo()
        .build()
}

/// What cluster to start.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The k3s binary (any release; [`crate::k3s_binary`]).
    pub k3s: PathBuf,
    /// The nodes, the server first.
    pub nodes: Vec<tandem_netlab::Node>,
    /// The pod bridge on every node.
    pub bridge: String,
    pub cluster_cidr: Ipv4Net,
    pub service_cidr: Ipv4Net,
    /// Docker archives every node imports at start; one must hold the pause image.
    pub images: Vec<PathBuf>,
    /// More `k3s server` arguments; the agents follow the server's choices (kube-proxy,
    /// flannel).
    pub server_args: Vec<String>,
    /// More kubelet arguments (`NAME=VALUE`), on every node.
    pub kubelet_args: Vec<String>,
    /// Parent of the nodes' run directories.
    pub base_dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("the cluster needs a server node")]
    NoNodes,
    #[error(transparent)]
    Node(Box<NodeError>),
    #[error("writing node {node}'s pod CIDR: {source}")]
    PodCidr {
        node: String,
        #[source]
        source: Box<NodeError>,
    },
}

impl From<NodeError> for ClusterError {
    fn from(error: NodeError) -> Self {
        Self::Node(Box::new(error))
    }
}

/// A running cluster; dropping it stops the agents, then the server.
#[derive(Debug)]
pub struct K3sCluster {
    /// The server first.
    nodes: Vec<K3sNode>,
}

impl K3sCluster {
    /// Starts the server, then every agent at once, writes each Node's pod CIDR once it
    /// registered, and waits until every node is Ready. Returns the cluster and how long
    /// it took.
    pub fn start(config: ClusterConfig) -> Result<(Self, Duration), ClusterError> {
        let started = Instant::now();
        let (server, agents) = config.nodes.split_first().ok_or(ClusterError::NoNodes)?;
        let kubelet_args = config
            .kubelet_args
            .iter()
            .map(|arg| format!("--kubelet-arg={arg}"));
        let node_config = |node: &tandem_netlab::Node, role: NodeRole| NodeConfig {
            extra_args: match role {
                NodeRole::Server => [&config.server_args[..], &[NO_NODE_IPAM.to_owned()]].concat(),
                NodeRole::Agent { .. } => Vec::new(),
            }
            .into_iter()
            .chain(kubelet_args.clone())
            .collect(),
            k3s: config.k3s.clone(),
            netns: node.netns.clone(),
            name: node.name.clone(),
            role,
            ip: node.ip,
            pod_subnet: node.pod_cidr,
            bridge: config.bridge.clone(),
            cluster_cidr: config.cluster_cidr,
            service_cidr: config.service_cidr,
            images: config.images.clone(),
            base_dir: config.base_dir.clone(),
        };
        let mut cluster = Self { nodes: Vec::new() };
        // From here on a failure drops `cluster`, which stops what started.
        cluster
            .nodes
            .push(K3sNode::start(node_config(server, NodeRole::Server))?);
        cluster.nodes[0].wait_registered(NODE_WITHIN)?;
        let join = NodeRole::Agent {
            server: server.ip,
            server_kubeconfig: cluster.nodes[0].kubeconfig().to_owned(),
        };
        for agent in agents {
            cluster
                .nodes
                .push(K3sNode::start(node_config(agent, join.clone()))?);
        }
        for index in 0..cluster.nodes.len() {
            cluster.nodes[index].wait_registered(NODE_WITHIN)?;
            cluster.write_pod_cidr(index)?;
        }
        for node in &mut cluster.nodes {
            node.wait_ready(NODE_WITHIN)?;
        }
        Ok((cluster, started.elapsed()))
    }

    /// Writes node `index`'s pod subnet into its Node's `spec.podCIDR(s)`: set once, as
    /// the API server allows.
    fn write_pod_cidr(&self, index: usize) -> Result<(), ClusterError> {
        let node = &self.nodes[index];
        let cidr = node.pod_subnet();
        self.server()
            .kubectl([
                "patch",
                "node",
                node.name(),
                "--type=merge",
                "-p",
                &format!(r#"{{"spec":{{"podCIDR":"{cidr}","podCIDRs":["{cidr}"]}}}}"#),
            ])
            .map(drop)
            .map_err(|source| ClusterError::PodCidr {
                node: node.name().to_owned(),
                source: Box::new(source),
            })
    }

    /// The server node: its kubeconfig and `kubectl` reach the API server.
    pub fn server(&self) -> &K3sNode {
        &self.nodes[0]
    }

    /// Every node, the server first.
    pub fn nodes(&self) -> &[K3sNode] {
        &self.nodes
    }
}

impl Drop for K3sCluster {
    fn drop(&mut self) {
        // The agents first, while the server still answers their last calls.
        while let Some(mut node) = self.nodes.pop() {
            node.stop();
        }
    }
}
