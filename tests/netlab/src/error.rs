//! Errors of the topology, process and echo helpers.

use std::path::PathBuf;

/// Everything that can go wrong building or using a topology.
#[derive(Debug, thiserror::Error)]
pub enum NetlabError {
    #[error("{host} has no IPv6 address: IPv6 needs a dual-stack topology (TopologyBuilder::ipv6)")]
    NoIpv6 { host: String },
    #[error("node {node} is outside 1..={max}")]
    NodeOutOfRange { node: usize, max: usize },
    #[error("pod index {index} on node {node} is outside 1..={max}")]
    PodIndexOutOfRange { node: usize, index: u32, max: u32 },
    #[error(
        "pod network {cidr} is too small: it needs a /24 for each of up to {max_nodes} nodes (a /16 or wider)"
    )]
    PodNetworkTooSmall {
        cidr: ipnet::Ipv4Net,
        max_nodes: usize,
    },
    #[error("an edge cluster has 1..={max} edges, not {edges}")]
    EdgesOutOfRange { edges: usize, max: usize },
    #[error("an edge cluster announces IPv4 VIPs only: build it without ipv6")]
    EdgeClusterIpv4Only,
    #[error("the topology has no node {0}")]
    UnknownNode(usize),
    #[error("the topology has no pod {0:?}")]
    UnknownPod(String),
    #[error("pods_per_node lists {listed} nodes but the topology has {nodes}")]
    PodsPerNodeMismatch { listed: usize, nodes: usize },
    #[error("cannot start `{command}`: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    CommandFailed {
        command: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{context}: {source}")]
    Sys {
        context: String,
        #[source]
        source: nix::Error,
    },
    #[error(
        "tandem-echo binary not found (looked at {searched:?}); run `cargo build -p tandem-netlab` \
         or set TANDEM_ECHO_BIN"
    )]
    EchoBinaryNotFound { searched: Vec<PathBuf> },
    #[error("unexpected echo reply {output:?}: {source}")]
    EchoReply {
        output: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("a thread running inside namespace {netns} panicked")]
    ThreadPanicked { netns: String },
}
