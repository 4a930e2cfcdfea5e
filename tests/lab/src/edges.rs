//! The lab's cloud edges: the single edge of the default lab, or an edge cluster.
//!
//! An edge cluster (`--edges N`, N > 1) runs, in namespaces of its own behind the router
//! that is every node's and client's gateway:
//!
//! ```text
//! clients ── router (BIRD: ECMP, BFD) ── edge LAN ──┬── edge 1 (cloud-mock + BIRD) ──┬── node network
//!                                                   ├── edge 2 (cloud-mock + BIRD) ──┤   (nodes, etcd 1-3)
//!                                                   └── edge N ...                 ──┘
//! ```
//!
//! Each edge keeps its state in the cluster's 3-member etcd (Debian's `etcd`) and steers
//! passthrough flows by Maglev, so every edge sends a flow to the same node. With
//! `--announce bgp` each edge's BIRD exports the VIPs the edge can forward (its
//! `--announce-table`) to the router's BIRD, which spreads the flows over the edges by
//! ECMP and drops a silent edge by BFD; its routes go to resilient nexthop groups, so that
//! only a lost edge's flows move. With `--announce l2` one edge owns each VIP
//! through an etcd lease and answers ARP for it on the edge LAN, where the router reaches
//! the whole VIP range directly.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::Signal;
use tandem_netlab::addr;
use tandem_netlab::{Edge, Host, Topology};

use crate::binaries;
use crate::components::Component;
use crate::launcher::Launcher;

/// The port of the cloud API on every edge.
pub const CLOUD_PORT: u16 = 8080;
/// etcd's client and peer ports on each member.
const ETCD_CLIENT_PORT: u16 = 2379;
const ETCD_PEER_PORT: u16 = 2380;
/// The kernel table each edge writes the VIPs it can forward into, for its BIRD.
const ANNOUNCE_TABLE: u32 = 100;
/// The kernel table the router's BIRD writes its routes into, for its resilient ECMP (see
/// [`crate::resilient_ecmp`]) to mirror into the main table.
const ROUTER_BGP_TABLE: u32 = 200;
/// The router's and the edges' autonomous systems.
const ROUTER_AS: u32 = 64500;
const EDGE_AS: u32 = 64512;
/// How long a stopping edge keeps serving after it withdrew its VIPs.
const DRAIN_DELAY: &str = "2s";
/// How long an edge's cloud API may take to serve after it starts.
const SERVE_WITHIN: Duration = Duration::from_secs(30);

/// How an edge cluster tells the router where its VIPs are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Announce {
    /// BGP with BFD from every edge that can forward a VIP: ECMP over all of them.
    #[default]
    Bgp,
    /// One owner per VIP (an etcd lease), which answers ARP for it on the edge LAN.
    L2,
}

impl Announce {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Bgp => "bgp",
            Self::L2 => "l2",
        }
    }
}

/// BIRD 2's configuration of the router: a BGP session with BFD to each edge, and ECMP
/// into a kernel table, whose routes the router's resilient ECMP installs. No graceful
/// restart: a dead edge's routes go with its session.
pub fn router_bird_config(edge_lan_ips: &[Ipv4Addr]) -> String {
    let mut config = format!(
        "router id {router};\n\
         protocol device {{ scan time 1; }}\n\
         protocol bfd {{ interface \"*\" {{ min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }}; }}\n\
         protocol kernel {{ kernel table {ROUTER_BGP_TABLE}; ipv4 {{ import none; export all; }}; merge paths on; }}\n\
         template bgp edge {{ local {router} as {ROUTER_AS}; bfd on; hold time 3; connect retry time 1; \
         error wait time 1, 10; ipv4 {{ import all; export none; }}; }}\n",
        router = addr::ROUTER_EDGE_LAN_IP,
    );
    for (index, ip) in edge_lan_ips.iter().enumerate() {
        config.push_str(&format!(
            "protocol bgp edge{} from edge {{ neighbor {ip} as {EDGE_AS}; }}\n",
            index + 1
        ));
    }
    config
}

/// BIRD 2's configuration of an edge at `ip` on the edge LAN: the routes of its announce
/// table, exported to the router.
pub fn edge_bird_config(ip: Ipv4Addr) -> String {
    format!(
        "router id {ip};\n\
         protocol device {{ scan time 1; }}\n\
         ipv4 table announced;\n\
         protocol kernel announce {{ ipv4 {{ table announced; import all; export none; }}; \
         kernel table {ANNOUNCE_TABLE}; learn; scan time 1; }}\n\
         protocol bfd {{ interface \"*\" {{ min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }}; }}\n\
         protocol bgp uplink {{ local {ip} as {EDGE_AS}; neighbor {router} as {ROUTER_AS}; \
         bfd on; hold time 3; connect retry time 1; error wait time 1, 10; \
         ipv4 {{ table announced; import none; export all; next hop self; }}; }}\n",
        router = addr::ROUTER_EDGE_LAN_IP,
    )
}

/// etcd's command line for member `member` (1-based) of the lab's cluster.
fn etcd_args(member: &Host, index: usize, members: &[Host], data_dir: &Path) -> Vec<String> {
    let peer = |host: &Host| format!("http://{}:{ETCD_PEER_PORT}", host.ip);
    let client = format!("http://{}:{ETCD_CLIENT_PORT}", member.ip);
    let initial_cluster: Vec<String> = members
        .iter()
        .enumerate()
        .map(|(i, host)| format!("etcd{}={}", i + 1, peer(host)))
        .collect();
    vec![
        format!("--name=etcd{index}"),
        format!("--data-dir={}", data_dir.display()),
        format!("--listen-client-urls={client}"),
        format!("--advertise-client-urls={client}"),
        format!("--listen-peer-urls={}", peer(member)),
        format!("--initial-advertise-peer-urls={}", peer(member)),
        format!("--initial-cluster={}", initial_cluster.join(",")),
        "--initial-cluster-state=new".to_owned(),
        "--initial-cluster-token=tandem-lab".to_owned(),
    ]
}

/// The etcd endpoints of the lab's cluster, as the edges are given them.
fn etcd_endpoints(members: &[Host]) -> String {
    members
        .iter()
        .map(|host| format!("http://{}:{ETCD_CLIENT_PORT}", host.ip))
        .collect::<Vec<_>>()
        .join(",")
}

/// One edge: its cloud-mock and, announcing by BGP, its BIRD.
struct EdgeHost {
    edge: Edge,
    cloud_args: Vec<String>,
    cloud: Option<Component>,
    bird: Option<Component>,
}

struct EtcdMember {
    host: Host,
    args: Vec<String>,
    process: Option<Component>,
}

/// What the edges are started with, beside what each edge's place gives.
pub struct EdgeSettings<'a> {
    /// Every edge's arguments (token, pools, data plane...), without `--listen` and
    /// `--data-dir`.
    pub cloud_args: Vec<String>,
    pub announce: Announce,
    pub run_dir: &'a Path,
    pub logs: &'a Path,
}

/// The running edges, with the etcd and the router of an edge cluster.
pub struct Edges {
    // Field order is drop order: the edges stop before the etcd they write to.
    edges: Vec<EdgeHost>,
    /// The router's BIRD and its resilient ECMP.
    router: Vec<Component>,
    etcd: Vec<EtcdMember>,
    announce: Option<Announce>,
    /// The switch, where each edge's cable to the edge LAN is plugged in.
    switch: tandem_netlab::Netns,
    launcher: Launcher,
    run_dir: PathBuf,
    logs: PathBuf,
}

impl Edges {
    /// Starts every edge of `topology` (and an edge cluster's etcd and router first) and
    /// waits until each serves its API.
    pub async fn start(
        topology: &Topology,
        settings: EdgeSettings<'_>,
        launcher: Launcher,
        progress: &dyn Fn(&str),
    ) -> Result<Self> {
        let cluster = topology.edges().len() > 1;
        let mut edges = Self {
            edges: Vec::new(),
            router: Vec::new(),
            etcd: Vec::new(),
            announce: cluster.then_some(settings.announce),
            switch: topology.switch().clone(),
            launcher,
            run_dir: settings.run_dir.to_owned(),
            logs: settings.logs.to_owned(),
        };
        let mut cluster_args = Vec::new();
        if cluster {
            progress("starting the edge cluster's etcd (3 members)");
            for (position, host) in topology.etcd().iter().enumerate() {
                let index = position + 1;
                let data_dir = settings.run_dir.join(format!("etcd{index}"));
                edges.etcd.push(EtcdMember {
                    host: host.clone(),
                    args: etcd_args(host, index, topology.etcd(), &data_dir),
                    process: None,
                });
            }
            for index in 1..=edges.etcd.len() {
                edges.start_etcd_member(index)?;
            }
            edges.wait_etcd_healthy().await?;
            cluster_args.extend([
                "--store=etcd".to_owned(),
                format!("--etcd-endpoints={}", etcd_endpoints(topology.etcd())),
                "--passthrough-steering=maglev".to_owned(),
                // Offers follow a node's health within a few hundred milliseconds.
                "--health-interval=200ms".to_owned(),
            ]);
            if let (Announce::L2, Some(router)) = (settings.announce, topology.router()) {
                // The router reaches the whole VIP range on the edge LAN, where the owner
                // of each VIP answers ARP for it.
                router
                    .netns
                    .exec_checked([
                        "ip",
                        "route",
                        "add",
                        &addr::VIP_POOL.to_string(),
                        "dev",
                        tandem_netlab::plan::ifname::ROUTER_EDGE_LAN,
                    ])
                    .context("routing the VIP range to the edge LAN")?;
            } else if let Some(router) = topology.router() {
                progress("starting the router's BGP speaker (BIRD: resilient ECMP, BFD)");
                let lan_ips: Vec<Ipv4Addr> = topology
                    .edges()
                    .iter()
                    .filter_map(|edge| edge.uplink.as_ref().map(|(_, ip)| *ip))
                    .collect();
                let ecmp = Component::start(
                    &router.netns,
                    "resilient-ecmp",
                    &binaries::locate("tandem-resilient-ecmp")?,
                    &[format!("--source-table={ROUTER_BGP_TABLE}")],
                    &[],
                    &edges.logs,
                )?;
                edges.router = vec![
                    ecmp,
                    edges.bird(&router.netns, "router", &router_bird_config(&lan_ips))?,
                ];
            }
        }
        progress(if cluster {
            "starting the mock cloud on every edge"
        } else {
            "starting the mock cloud in the cloud edge"
        });
        for (position, edge) in topology.edges().iter().enumerate() {
            let index = position + 1;
            let data_dir = match cluster {
                true => settings.run_dir.join(format!("cloud-e{index}")),
                false => settings.run_dir.join("cloud"),
            };
            edges.launcher.hand_over("cloud-mock", &data_dir)?;
            let mut cloud_args = vec![
                format!(
                    "--listen={}",
                    SocketAddr::from((edge.node_network_ip, CLOUD_PORT))
                ),
                format!("--data-dir={}", data_dir.display()),
            ];
            cloud_args.extend(settings.cloud_args.iter().cloned());
            cloud_args.extend(cluster_args.iter().cloned());
            if cluster {
                cloud_args.push(format!("--edge-name=edge-{index}"));
                match (settings.announce, &edge.uplink) {
                    (Announce::Bgp, _) => cloud_args.extend([
                        format!("--announce-table={ANNOUNCE_TABLE}"),
                        format!("--drain-delay={DRAIN_DELAY}"),
                    ]),
                    (Announce::L2, Some((device, _))) => {
                        cloud_args.push(format!("--l2-device={device}"));
                    }
                    (Announce::L2, None) => bail!("edge {index} has no leg on the edge LAN"),
                }
            }
            edges.edges.push(EdgeHost {
                edge: edge.clone(),
                cloud_args,
                cloud: None,
                bird: None,
            });
        }
        for index in 1..=edges.edges.len() {
            edges.start_edge(index).await?;
        }
        Ok(edges)
    }

    /// The edges' API URLs, in edge order.
    pub fn urls(&self) -> Vec<String> {
        self.edges
            .iter()
            .map(|host| format!("http://{}", api_address(&host.edge)))
            .collect()
    }

    fn host(&self, index: usize) -> Result<&EdgeHost> {
        index
            .checked_sub(1)
            .and_then(|i| self.edges.get(i))
            .with_context(|| format!("the lab has no edge {index}"))
    }

    fn host_mut(&mut self, index: usize) -> Result<&mut EdgeHost> {
        index
            .checked_sub(1)
            .and_then(|i| self.edges.get_mut(i))
            .with_context(|| format!("the lab has no edge {index}"))
    }

    /// Starts edge `index` (1-based; again after it was killed or stopped): its cloud-mock
    /// and its BIRD, and waits until its API serves.
    pub async fn start_edge(&mut self, index: usize) -> Result<()> {
        if self.announce.is_some() {
            self.set_cables(index, true)?;
        }
        let bird = match (self.announce, &self.host(index)?.edge.uplink) {
            (Some(Announce::Bgp), Some((_, ip))) => {
                let host = self.host(index)?;
                Some(self.bird(
                    &host.edge.netns,
                    &format!("e{index}"),
                    &edge_bird_config(*ip),
                )?)
            }
            _ => None,
        };
        let host = self.host(index)?;
        let name = match self.edges.len() {
            1 => "cloud-mock".to_owned(),
            _ => format!("cloud-mock-e{index}"),
        };
        let mut cloud = self.launcher.start(
            &host.edge.netns,
            &name,
            "cloud-mock",
            // VIP addresses and passthrough routes in the cloud edge; listeners on the LB
            // ports (80) as its non-root user.
            &["NET_ADMIN", "NET_RAW", "NET_BIND_SERVICE"],
            &host.cloud_args,
        )?;
        cloud
            .wait_serving(api_address(&host.edge), SERVE_WITHIN)
            .await?;
        let host = self.host_mut(index)?;
        host.cloud = Some(cloud);
        host.bird = bird;
        Ok(())
    }

    /// Every process of edge `index` killed at once (SIGKILL), its host still up.
    pub fn kill_edge(&mut self, index: usize) -> Result<()> {
        let host = self.host_mut(index)?;
        // A component's process group is killed when it is dropped.
        drop(host.cloud.take());
        drop(host.bird.take());
        Ok(())
    }

    /// Edge `index`'s host is gone: its processes killed and both its cables cut, so that
    /// nothing it left in its kernel (addresses, routes) answers any more.
    /// [`Self::start_edge`] plugs them in again.
    pub fn lose_host(&mut self, index: usize) -> Result<()> {
        self.kill_edge(index)?;
        self.set_cables(index, false)
    }

    /// A planned stop of edge `index`: SIGTERM to its cloud-mock, which withdraws its VIPs,
    /// keeps serving for its drain delay, then stops; then its BIRD. Returns how long the
    /// cloud-mock took.
    pub async fn stop_edge(&mut self, index: usize) -> Result<Duration> {
        let host = self.host_mut(index)?;
        let cloud = host
            .cloud
            .take()
            .with_context(|| format!("edge {index} is not running"))?;
        let took = cloud
            .stop(Signal::SIGTERM, Duration::from_secs(20))
            .await?
            .with_context(|| format!("edge {index}'s cloud-mock did not stop within 20 s"))?;
        drop(host.bird.take());
        Ok(took)
    }

    /// Cuts the cable of edge `index`'s leg towards the router (or mends it): its switch
    /// port goes down, so the edge sees no carrier but keeps its addresses and routes, as
    /// with a real cable.
    pub fn set_uplink(&self, index: usize, up: bool) -> Result<()> {
        self.set_port(
            index,
            &tandem_netlab::plan::ifname::edge_lan_port(index),
            up,
        )
    }

    /// Both of edge `index`'s cables: to the router and to the node network.
    fn set_cables(&self, index: usize, up: bool) -> Result<()> {
        self.set_uplink(index, up)?;
        self.set_port(
            index,
            &tandem_netlab::plan::ifname::edge_node_port(index),
            up,
        )
    }

    fn set_port(&self, index: usize, port: &str, up: bool) -> Result<()> {
        self.host(index)?;
        self.switch
            .exec_checked(["ip", "link", "set", port, if up { "up" } else { "down" }])
            .with_context(|| format!("setting edge {index}'s switch port {port}"))?;
        Ok(())
    }

    /// Drops every packet between edge `index` and the etcd members (or stops dropping
    /// them): the edge still reaches the router and the nodes.
    pub fn cut_from_etcd(&self, index: usize, cut: bool) -> Result<()> {
        let host = self.host(index)?;
        let members: Vec<String> = self.etcd.iter().map(|m| m.host.ip.to_string()).collect();
        let rules = match cut {
            true => format!(
                "table inet tandem-lab-etcd-cut {{\n\
                 chain out {{ type filter hook output priority -10; ip daddr {{ {all} }} drop; }}\n\
                 chain in {{ type filter hook input priority -10; ip saddr {{ {all} }} drop; }}\n}}\n",
                all = members.join(", ")
            ),
            false => "delete table inet tandem-lab-etcd-cut\n".to_owned(),
        };
        nft(&host.edge.netns, &rules)
            .with_context(|| format!("cutting edge {index} from etcd ({cut})"))
    }

    /// Starts etcd member `index` (1-based; again, on its data, after it was stopped).
    pub fn start_etcd_member(&mut self, index: usize) -> Result<()> {
        let logs = self.logs.clone();
        let member = index
            .checked_sub(1)
            .and_then(|i| self.etcd.get_mut(i))
            .with_context(|| format!("the lab has no etcd member {index}"))?;
        member.process = Some(Component::start(
            &member.host.netns,
            &format!("etcd{index}"),
            Path::new("etcd"),
            &member.args,
            &[],
            &logs,
        )?);
        Ok(())
    }

    /// Kills etcd member `index` (SIGKILL).
    pub fn kill_etcd_member(&mut self, index: usize) -> Result<()> {
        let member = index
            .checked_sub(1)
            .and_then(|i| self.etcd.get_mut(i))
            .with_context(|| format!("the lab has no etcd member {index}"))?;
        drop(member.process.take());
        Ok(())
    }

    /// The etcd member (1-based) that leads now: the one whose `etcd_server_is_leader`
    /// gauge is 1.
    pub async fn etcd_leader(&self) -> Result<Option<usize>> {
        for (position, member) in self.etcd.iter().enumerate() {
            if member.process.is_none() {
                continue;
            }
            // etcd sends its metrics chunked: curl reads them.
            let url = format!("http://{}:{ETCD_CLIENT_PORT}/metrics", member.host.ip);
            let metrics = tokio::process::Command::new("curl")
                .args(["-sS", "--max-time", "2", &url])
                .output()
                .await
                .context("running curl")?;
            if metrics.status.success()
                && String::from_utf8_lossy(&metrics.stdout)
                    .lines()
                    .any(|line| line == "etcd_server_is_leader 1")
            {
                return Ok(Some(position + 1));
            }
        }
        Ok(None)
    }

    /// Waits until every running etcd member says it is healthy (it has a leader and
    /// commits).
    pub async fn wait_etcd_healthy(&self) -> Result<()> {
        let started = Instant::now();
        for member in self.etcd.iter().filter(|m| m.process.is_some()) {
            let address = SocketAddr::from((member.host.ip, ETCD_CLIENT_PORT));
            loop {
                let health = tokio::time::timeout(
                    Duration::from_secs(2),
                    crate::traffic::http_get(address, "/health"),
                )
                .await;
                match health {
                    Ok(Ok((200, body))) if body.contains("\"true\"") => break,
                    _ if started.elapsed() < Duration::from_secs(60) => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    other => bail!(
                        "etcd member at {address} is not healthy after 60 s ({other:?}); its log: {}",
                        self.logs.join("etcd*.log").display()
                    ),
                }
            }
        }
        Ok(())
    }

    /// Waits until the router can reach `vip`: by a route from an edge's BGP speaker, or,
    /// in the L2 mode, once an edge holds it on the edge LAN. Nothing to wait for in front
    /// of a single edge.
    pub async fn wait_announced(
        &self,
        topology: &Topology,
        vip: IpAddr,
        within: Duration,
    ) -> Result<Duration> {
        let started = Instant::now();
        loop {
            let announced = match self.announce {
                None => true,
                Some(Announce::Bgp) => self.router_next_hops(topology, vip)? > 0,
                Some(Announce::L2) => !self.l2_owners(vip)?.is_empty(),
            };
            if announced {
                return Ok(started.elapsed());
            }
            if started.elapsed() > within {
                bail!(
                    "no edge announced {vip} to the router within {within:?}; see {} (cloud-mock-e*.log, bird-*.log)",
                    self.logs.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The edges (1-based) that hold `vip` on their leg on the edge LAN: the L2 mode's
    /// owners, of which there is never more than one.
    pub fn l2_owners(&self, vip: IpAddr) -> Result<Vec<usize>> {
        self.l2_looks().owners(vip)
    }

    /// What looks at the edges' legs on the edge LAN, for another thread.
    pub fn l2_looks(&self) -> L2Looks {
        L2Looks(
            self.edges
                .iter()
                .filter_map(|host| {
                    let (device, _) = host.edge.uplink.as_ref()?;
                    Some((host.edge.netns.clone(), device.clone()))
                })
                .collect(),
        )
    }

    /// The edges (1-based) holding connections from `client` to `vip:port` that stay
    /// established over three looks 200 ms apart (long-lived connections, not the short
    /// ones around them), with how many each holds. Only connections the client has open
    /// too count: an edge may still hold one whose client was reset elsewhere (its flow
    /// moved to another edge), until its keep-alive probes find that out.
    pub async fn holding_long_lived(
        &self,
        client: &Host,
        vip: IpAddr,
        port: u16,
    ) -> Result<BTreeMap<usize, usize>> {
        let service = SocketAddr::new(vip, port).to_string();
        // The local (Local:Port) or the peer (Peer:Port) column of each connection.
        let established = |netns: &tandem_netlab::Netns, filter: [&str; 2], column: usize| {
            let mut args = vec!["ss", "-Htn", "state", "established"];
            args.extend(filter);
            netns.exec_checked(args).map(|listing| {
                listing
                    .lines()
                    .filter_map(|line| line.split_whitespace().nth(column).map(str::to_owned))
                    .collect::<BTreeSet<String>>()
            })
        };
        let client_ip = client.ip.to_string();
        let mut seen: Vec<BTreeSet<String>> = Vec::new();
        for look in 0..3 {
            if look > 0 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let open = established(&client.netns, ["dst", &service], 2)?;
            for (position, host) in self.edges.iter().enumerate() {
                let mut peers = match host.cloud {
                    None => BTreeSet::new(),
                    Some(_) => established(&host.edge.netns, ["src", &service], 3)?,
                };
                peers.retain(|peer| peer.starts_with(&client_ip) && open.contains(peer));
                match seen.get_mut(position) {
                    Some(kept) => kept.retain(|peer| peers.contains(peer)),
                    None => seen.push(peers),
                }
            }
        }
        Ok(seen
            .iter()
            .enumerate()
            .filter(|(_, peers)| !peers.is_empty())
            .map(|(position, peers)| (position + 1, peers.len()))
            .collect())
    }

    /// Waits until the router has `hops` next hops for each of `vips`; returns how long
    /// it took.
    pub async fn wait_next_hops(
        &self,
        topology: &Topology,
        vips: &[IpAddr],
        hops: usize,
        within: Duration,
    ) -> Result<Duration> {
        let started = Instant::now();
        loop {
            let mut all = Vec::new();
            for &vip in vips {
                all.push(self.router_next_hops(topology, vip)?);
            }
            if all.iter().all(|&h| h == hops) {
                return Ok(started.elapsed());
            }
            if started.elapsed() > within {
                bail!(
                    "the router has {all:?} next hops for {vips:?}, not {hops}, after {within:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits (up to 15 s) until an edge other than `old` owns `vip` in the L2 mode;
    /// returns it.
    pub async fn wait_l2_owner_other_than(&self, vip: IpAddr, old: usize) -> Result<usize> {
        let started = Instant::now();
        loop {
            let owners = self.l2_owners(vip)?;
            if let Some(&owner) = owners.iter().find(|&&o| o != old) {
                return Ok(owner);
            }
            if started.elapsed() > Duration::from_secs(15) {
                bail!("no edge but {old} owned {vip} within 15 s (owners {owners:?})");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The API URL of edge `index`.
    pub fn url(&self, index: usize) -> Result<String> {
        Ok(format!("http://{}", api_address(&self.host(index)?.edge)))
    }

    /// The router's next hops for `vip` (0 when it has no route; 1 for a plain route).
    pub fn router_next_hops(&self, topology: &Topology, vip: IpAddr) -> Result<usize> {
        let router = topology.router().context("the lab has no router")?;
        let routes = router
            .netns
            .exec_checked(["ip", "route", "show", &vip.to_string()])?;
        let hops = routes.matches("nexthop via").count();
        Ok(if hops == 0 && routes.contains(" via ") {
            1
        } else {
            hops
        })
    }

    /// Starts BIRD in `netns` with `config`, its control socket beside its configuration.
    fn bird(&self, netns: &tandem_netlab::Netns, name: &str, config: &str) -> Result<Component> {
        let path = self.run_dir.join(format!("bird-{name}.conf"));
        std::fs::write(&path, config).with_context(|| format!("writing {}", path.display()))?;
        let socket = self.run_dir.join(format!("bird-{name}.ctl"));
        Ok(Component::start(
            netns,
            &format!("bird-{name}"),
            Path::new("bird"),
            &[
                "-f".to_owned(),
                "-c".to_owned(),
                path.display().to_string(),
                "-s".to_owned(),
                socket.display().to_string(),
            ],
            &[],
            &self.logs,
        )?)
    }
}

/// Each edge's namespace and its leg on the edge LAN, in edge order.
#[derive(Debug, Clone)]
pub struct L2Looks(Vec<(tandem_netlab::Netns, String)>);

impl L2Looks {
    /// The edges (1-based) holding `vip` as an address of their leg on the edge LAN.
    pub fn owners(&self, vip: IpAddr) -> Result<Vec<usize>> {
        let mut owners = Vec::new();
        for (position, (netns, device)) in self.0.iter().enumerate() {
            let addresses = netns.exec_checked(["ip", "-o", "addr", "show", "dev", device])?;
            if addresses.contains(&format!(" {vip}/")) {
                owners.push(position + 1);
            }
        }
        Ok(owners)
    }
}

impl L2Looks {
    /// Looks at which edges hold `vip` every 20 ms, on a thread of its own, until
    /// stopped; an edge whose host is `lost` answers nobody, and does not count.
    pub fn watch(self, vip: IpAddr, lost: Option<usize>) -> OwnerWatch {
        let stop = tokio_util::sync::CancellationToken::new();
        let token = stop.clone();
        let task = tokio::task::spawn_blocking(move || {
            let mut most = 0;
            while !token.is_cancelled() {
                let owners = self.owners(vip).unwrap_or_default();
                most = most.max(owners.iter().filter(|&&o| Some(o) != lost).count());
                std::thread::sleep(Duration::from_millis(20));
            }
            most
        });
        OwnerWatch { stop, task }
    }
}

/// A running [`L2Looks::watch`].
pub struct OwnerWatch {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<usize>,
}

impl OwnerWatch {
    /// Stops looking; the most edges seen holding the VIP at once.
    pub async fn stop(self) -> usize {
        self.stop.cancel();
        self.task.await.unwrap_or(usize::MAX)
    }
}

/// Runs `nft -f -` with `rules` in `netns`.
fn nft(netns: &tandem_netlab::Netns, rules: &str) -> Result<()> {
    use std::io::Write;
    let mut child = netns
        .command("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("starting nft")?;
    child
        .stdin
        .take()
        .context("nft's stdin")?
        .write_all(rules.as_bytes())
        .context("writing nft's rules")?;
    let output = child.wait_with_output().context("waiting for nft")?;
    if !output.status.success() {
        bail!("nft: {}", String::from_utf8_lossy(&output.stderr));
    }
    Ok(())
}

/// An edge's API address.
fn api_address(edge: &Edge) -> SocketAddr {
    SocketAddr::from((edge.node_network_ip, CLOUD_PORT))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_router_has_a_bfd_session_to_every_edge_and_no_graceful_restart() {
        let config =
            router_bird_config(&[Ipv4Addr::new(198, 19, 0, 11), Ipv4Addr::new(198, 19, 0, 12)]);
        assert!(config.contains("protocol bgp edge1 from edge { neighbor 198.19.0.11 as 64512; }"));
        assert!(config.contains("protocol bgp edge2 from edge { neighbor 198.19.0.12 as 64512; }"));
        assert!(config.contains("bfd on;"));
        assert!(config.contains("merge paths on"));
        assert!(config.contains("kernel table 200;"), "{config}");
        assert!(!config.contains("graceful restart"));
        let edge = edge_bird_config(Ipv4Addr::new(198, 19, 0, 12));
        assert!(edge.contains("local 198.19.0.12 as 64512; neighbor 198.19.0.1 as 64500;"));
        assert!(edge.contains("kernel table 100;"));
        assert!(!edge.contains("graceful restart"));
    }

    #[test]
    fn every_member_knows_the_whole_initial_cluster() {
        let members: Vec<Host> = (1..=3)
            .map(|m| Host {
                netns: tandem_netlab::Netns::attach(format!("x-etcd{m}")),
                ip: addr::etcd_ip(m),
                ip6: None,
            })
            .collect();
        let args = etcd_args(&members[1], 2, &members, Path::new("/run/lab/etcd2"));
        assert!(args.contains(&"--name=etcd2".to_owned()));
        assert!(args.contains(
            &"--initial-cluster=etcd1=http://198.18.0.251:2380,etcd2=http://198.18.0.252:2380,etcd3=http://198.18.0.253:2380"
                .to_owned()
        ));
        assert!(args.contains(&"--listen-client-urls=http://198.18.0.252:2379".to_owned()));
        assert_eq!(
            etcd_endpoints(&members),
            "http://198.18.0.251:2379,http://198.18.0.252:2379,http://198.18.0.253:2379"
        );
    }
}
