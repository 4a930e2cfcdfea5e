//! Network-namespace virtual cluster (docs/architecture.md, "The virtual cluster").
//!
//! * [`Topology`]: namespaces `tdm<pid>x<seq>-<role>` built with `ip netns add`, so
//!   `ip netns exec` works for people too. Nothing is created in the root namespace.
//!   - `-sw`: the switch; bridges `brnode` (198.18.0.0/24), `brc1`, `brc2` (client nets);
//!   - `-cp`: control plane, 198.18.0.2 (API server relay on :6443, controller);
//!   - `-n<N>`: node N, `eth0` 198.18.0.(10+N), `cni0` 10.244.N.1/24 (with the default
//!     [`PodNetwork`]), host-gw routes
//!     to the other nodes' pod CIDRs, default via the edge, ip_forward on;
//!   - `-n<N>p<I>`: pod I on node N, 10.244.N.(1+I), running `tandem-echo`;
//!   - `-edge`: the cloud edge, 198.18.0.1 / 203.0.113.1 / 192.0.2.1, forwarding,
//!     `prohibit 10.244.0.0/16`; VIPs (198.51.100.0/24) go on its `lo` or become routes;
//!   - `-c1` 203.0.113.10 (inside the usual source range), `-c2` 192.0.2.10 (outside).
//! * Cleanup: on drop (also while unwinding from a panic), on SIGINT/SIGTERM (exit
//!   130/143), and namespaces of dead runs are removed before a process's first topology.
//! * [`Netns`] runs commands and threads in a namespace; [`ChildGuard`] kills its process
//!   group on drop.
//! * [`echo`]: the pod echo's reply and the in-namespace clients ([`http_get_in`],
//!   [`udp_request_in`], [`EchoClient`]).
//! * [`cluster`]: Nodes kept Ready like a kubelet and EndpointSlices for selectorless
//!   Services, against any API server.
//! * [`relay`]: an API server reachable from the root namespace made reachable inside
//!   the lab, with a matching kubeconfig.
//!
//! ```no_run
//! # fn main() -> Result<(), tandem_netlab::NetlabError> {
//! let topo = tandem_netlab::Topology::builder().nodes(3).pods_per_node(&[2, 2, 0]).build()?;
//! let target = &topo.pods_on(2).next().expect("node 2 has pods").ip;
//! let reply = tandem_netlab::http_get_in(&topo.pods()[0].netns, &format!("http://{target}:8080/"))?;
//! assert_eq!(reply.client.ip(), topo.pods()[0].ip);
//! # Ok(()) }
//! ```

pub mod addr;
mod cleanup;
pub mod cluster;
pub mod echo;
mod error;
pub mod http;
mod naming;
mod netns;
pub mod plan;
pub mod relay;
mod topology;

pub use addr::{ClusterFamilies, IpFamily, PodNetwork};
pub use cleanup::{list_netns, remove_netns, remove_stale_namespaces};
pub use echo::{EchoClient, EchoReply, echo_binary, http_get_in, udp_request_in};
pub use error::NetlabError;
pub use naming::{RunPrefix, owner_pid};
pub use netns::{ChildGuard, Netns, Recipients};
pub use relay::{
    ApiBridge, Relay, RelayError, RelayPlan, bridge_api_server, plan_relay, write_kubeconfig,
};
pub use topology::{Edge, Host, Node, Pod, Topology, TopologyBuilder, node_name};
