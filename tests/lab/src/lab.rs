//! The running lab: topology, processes, and the API/cloud clients to drive them.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::core::v1::{Event, Service};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use tandem_common::{NODE_HEALTHZ_PORT, ProxyMode};
use tandem_netlab::cluster::{Endpoint, EndpointSliceWriter, LabNode, NodeAgent, NodeAgentConfig};
use tandem_netlab::{Host, Netns, Node, PodNetwork, Topology};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::binaries;
use crate::bridge::RelayThread;
use crate::components::Component;
use crate::images::{ContainerRun, Images};
use crate::netns;
use crate::scenario::{ServicePlan, Spread};

const API_PORT: u16 = 6443;
const CLOUD_PORT: u16 = 8080;
/// The mock cloud's VIP pools: the lab's VIP range (198.51.100.0/24, routed to the cloud
/// edge) split in halves, so the second pool's addresses stay inside the lab too.
pub const VIP_POOLS: [(&str, &str); 2] = [
    ("default", "198.51.100.0/25"),
    ("blue", "198.51.100.128/25"),
];

#[derive(Debug, Clone)]
pub struct LabOptions {
    pub nodes: usize,
    pub pods_per_node: Vec<u32>,
    pub cluster_id: String,
    /// Where logs, kubeconfig and the cloud's data go; a fresh temporary directory if None.
    pub run_dir: Option<PathBuf>,
    /// Run against this real API server (its kubeconfig) instead of the stand-in.
    pub api_server: Option<PathBuf>,
    /// The cluster's pod CIDR; node N's pods get its N-th /24.
    pub pod_network: PodNetwork,
    /// Run the mock cloud, the controller and the node proxies from these container images
    /// instead of the binaries next to the lab's.
    pub images: Option<Images>,
    /// The node proxies' data path.
    pub proxy_mode: ProxyMode,
}

impl Default for LabOptions {
    fn default() -> Self {
        Self {
            nodes: 3,
            pods_per_node: vec![2, 2, 0],
            cluster_id: "lab".to_owned(),
            run_dir: None,
            api_server: None,
            pod_network: PodNetwork::DEFAULT,
            images: None,
            proxy_mode: ProxyMode::default(),
        }
    }
}

/// A running lab. Dropping it stops every process and removes every namespace.
/// A built virtual cluster, before its processes start: see [`Lab::prepare`].
pub struct Prepared {
    topology: Topology,
    run_dir: PathBuf,
    relay: Option<RelayThread>,
}

pub struct Lab {
    // Field order is drop order: the node agent stops before the API server it talks to,
    // and processes go before the namespaces they run in.
    /// Stops the node agent (Lease renewals, Ready heartbeats) when the lab goes.
    _node_agent: DropGuard,
    /// Held for their drop: it stops the processes.
    _components: Vec<Component>,
    relay: Option<RelayThread>,
    pub topology: Topology,
    pub run_dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub kube: kube::Client,
    pub cloud: cloud_mock_sdk::Client,
    pub cloud_url: String,
    /// Keep the run directory (logs, kubeconfig, cloud data) when the lab goes; it is kept
    /// anyway when the lab is dropped during a panic (a failing test).
    pub keep_run_dir: bool,
    /// The node proxies' data path.
    pub proxy_mode: ProxyMode,
    /// The loadBalancerClass of the lab's Services on a real API server, so that the lab's
    /// controller never touches the cluster's own LoadBalancer Services.
    load_balancer_class: Option<String>,
    /// Services this lab created (namespace, name), removed by [`Lab::shutdown`].
    created: std::sync::Mutex<Vec<(String, String)>>,
    endpoints: EndpointSliceWriter,
}

impl Lab {
    /// Builds the virtual cluster (and, for a real API server, the relay that brings it in)
    /// and moves the calling thread into the control-plane namespace, so that the tokio
    /// runtime the caller builds next, and every socket the process opens, lives inside the
    /// lab. Call before building the runtime.
    pub fn prepare(options: &LabOptions) -> Result<Prepared> {
        let topology = Topology::builder()
            .nodes(options.nodes)
            .pods_per_node(&options.pods_per_node)
            .pod_network(options.pod_network)
            // The lab handles SIGINT/SIGTERM itself: it must stop its processes before the
            // namespaces go, and the topology's own handler would exit without them.
            .handle_signals(false)
            .build()
            .context("building the virtual cluster (network namespaces)")?;
        let run_dir = match &options.run_dir {
            Some(dir) => dir.clone(),
            None => std::env::temp_dir().join(format!("tandem-lab-{}", topology.prefix())),
        };
        std::fs::create_dir_all(run_dir.join("logs"))
            .with_context(|| format!("creating {}", run_dir.display()))?;
        // The relay must start here, in the root namespace, to reach the real server.
        let relay = match &options.api_server {
            Some(original) => Some(RelayThread::start(
                original,
                &topology.control_plane().netns,
                &run_dir.join("kubeconfig"),
            )?),
            None => None,
        };
        netns::enter(topology.control_plane().netns.name())?;
        Ok(Prepared {
            topology,
            run_dir,
            relay,
        })
    }

    /// Starts the API server stand-in (unless a real one is bridged in), the mock cloud,
    /// the controller and a node proxy per node, registers the Nodes, and waits until each
    /// serves.
    pub async fn start(
        prepared: Prepared,
        options: LabOptions,
        progress: &dyn Fn(&str),
    ) -> Result<Self> {
        let Prepared {
            topology,
            run_dir,
            relay,
        } = prepared;
        let logs = run_dir.join("logs");
        let token = format!("lab-{}", topology.prefix());
        let kubeconfig = run_dir.join("kubeconfig");
        let cp = topology.control_plane().clone();
        let mut components = Vec::new();

        let load_balancer_class = relay
            .as_ref()
            .map(|_| format!("tandem.io/lab-{}", topology.prefix()));
        if relay.is_some() {
            progress("using the real API server through the relay at 198.18.0.2:6443");
        } else {
            progress("starting the API server stand-in");
            components.push(start_stand_in(&cp, &token, &kubeconfig, &logs).await?);
        }
        let kube = kube_client(&kubeconfig).await?;

        progress("registering the nodes (a kubelet's Node, Lease and Ready heartbeats)");
        let lab_nodes = topology.nodes().iter().map(LabNode::from).collect();
        let mut agent = NodeAgent::new(kube.clone(), lab_nodes, NodeAgentConfig::default());
        agent.register().await.context("registering the nodes")?;
        let stop_agent = CancellationToken::new();
        let agent_token = stop_agent.clone();
        tokio::spawn(async move {
            if let Err(e) = agent.run(agent_token).await {
                tracing::error!(error = %e, "node agent stopped");
            }
        });

        progress("starting the mock cloud in the cloud edge");
        let edge = topology.edge().clone();
        let cloud_addr = SocketAddr::from((edge.node_network_ip, CLOUD_PORT));
        let cloud_url = format!("http://{cloud_addr}");
        let token_file = run_dir.join("cloud-token");
        std::fs::write(&token_file, &token).context("writing the cloud token file")?;
        let cloud_data = run_dir.join("cloud");
        if let Some(images) = &options.images {
            images.check_present(&["cloud-mock", "tandem-nodeproxy", "tandem-controller"])?;
            // The image's non-root user writes the cloud's database.
            images.hand_over("cloud-mock", &cloud_data)?;
        }
        let engine_config = match &options.images {
            Some(_) => Some(crate::images::write_engine_config(&run_dir)?),
            None => None,
        };
        let launcher = Launcher {
            images: options.images.as_ref().zip(engine_config.as_deref()),
            prefix: topology.prefix(),
            run_dir: &run_dir,
            logs: &logs,
        };
        let mut cloud_args = vec![
            format!("--listen={cloud_addr}"),
            format!("--data-dir={}", cloud_data.display()),
            format!("--token={token}"),
        ];
        cloud_args.extend(
            VIP_POOLS
                .iter()
                .map(|(name, cidr)| format!("--vip-pool={name}={cidr}")),
        );
        cloud_args.extend([
            "--dataplane=proxy".to_owned(),
            "--manage-vip-addresses".to_owned(),
            format!("--vip-device={}", edge.vip_interface),
            "--provisioning-delay=200ms".to_owned(),
        ]);
        let mut cloud = launcher.start(
            &edge.netns,
            "cloud-mock",
            "cloud-mock",
            // VIP addresses and passthrough routes in the cloud edge; listeners on the LB
            // ports (80) as its non-root user.
            &["NET_ADMIN", "NET_RAW", "NET_BIND_SERVICE"],
            &cloud_args,
        )?;
        cloud
            .wait_serving(cloud_addr, Duration::from_secs(20))
            .await?;
        components.push(cloud);
        let cloud_client = cloud_mock_sdk::Client::new(
            &cloud_url,
            token.clone(),
            cloud_mock_sdk::ClientOptions::default(),
        )
        .map_err(|e| anyhow!("cloud client: {e}"))?;

        progress("starting a node proxy on every node");
        for node in topology.nodes() {
            let mut proxy = launcher.start(
                &node.netns,
                &format!("nodeproxy-{}", node.name),
                "tandem-nodeproxy",
                // What the chart's DaemonSet grants: iptables and conntrack.
                &["NET_ADMIN", "NET_RAW"],
                &[
                    format!("--kubeconfig={}", kubeconfig.display()),
                    format!("--node-name={}", node.name),
                    format!("--cluster-cidr={}", topology.pod_network()),
                    format!("--healthz-bind-address=0.0.0.0:{NODE_HEALTHZ_PORT}"),
                    "--metrics-bind-address=127.0.0.1:10249".to_owned(),
                    "--min-sync-period=200ms".to_owned(),
                    format!("--proxy-mode={}", options.proxy_mode),
                ],
            )?;
            proxy
                .wait_serving(
                    SocketAddr::from((node.ip, NODE_HEALTHZ_PORT)),
                    Duration::from_secs(20),
                )
                .await?;
            components.push(proxy);
        }

        progress("starting the controller");
        let health = SocketAddr::from((cp.ip, 10258));
        let mut args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--cloud-url={cloud_url}"),
            format!("--cloud-token-file={}", token_file.display()),
            format!("--cluster-id={}", options.cluster_id),
            format!("--health-bind-address={health}"),
            format!(
                "--metrics-bind-address={}",
                SocketAddr::from((cp.ip, 10257))
            ),
        ];
        if let Some(class) = &load_balancer_class {
            args.extend([
                format!("--load-balancer-class={class}"),
                "--claim-unclassed=false".to_owned(),
            ]);
        }
        let mut controller =
            launcher.start(&cp.netns, "controller", "tandem-controller", &[], &args)?;
        controller
            .wait_serving(health, Duration::from_secs(20))
            .await?;
        components.push(controller);

        Ok(Self {
            _components: components,
            relay,
            load_balancer_class,
            created: std::sync::Mutex::new(Vec::new()),
            topology,
            run_dir,
            kubeconfig,
            keep_run_dir: false,
            proxy_mode: options.proxy_mode,
            endpoints: EndpointSliceWriter::new(kube.clone()),
            kube,
            cloud: cloud_client,
            cloud_url,
            _node_agent: stop_agent.drop_guard(),
        })
    }

    /// Stops the lab. On a real API server it first removes what the lab wrote there: its
    /// Services (waiting for the controller to release their load balancers), their
    /// EndpointSlices, and its Nodes and Leases. With the stand-in, dropping is enough.
    pub async fn shutdown(self) -> Result<()> {
        if self.relay.is_some() {
            let created =
                std::mem::take(&mut *self.created.lock().unwrap_or_else(|e| e.into_inner()));
            for (namespace, name) in created {
                let mut plan = ServicePlan::new(&name, crate::scenario::LbMode::Proxy);
                plan.namespace = namespace;
                if let Err(e) = self.delete_service(&plan).await {
                    tracing::warn!(error = %e, service = %name, "removing a lab Service from the API server");
                    continue;
                }
                // The controller must release the load balancer and its finalizer while it
                // still runs, or the Service would stay behind, terminating forever.
                let services: Api<Service> = Api::namespaced(self.kube.clone(), &plan.namespace);
                let start = Instant::now();
                while services.get_opt(&name).await?.is_some() {
                    if start.elapsed() > Duration::from_secs(60) {
                        bail!(
                            "Service {}/{name} was not released within 60 s",
                            plan.namespace
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            let lab_nodes = self.topology.nodes().iter().map(LabNode::from).collect();
            NodeAgent::new(self.kube.clone(), lab_nodes, NodeAgentConfig::default())
                .unregister()
                .await
                .context("removing the lab's Nodes and Leases")?;
        }
        Ok(())
    }

    /// Creates the Service and the EndpointSlice for its pods.
    pub async fn create_service(&self, plan: &ServicePlan) -> Result<()> {
        let services: Api<Service> = Api::namespaced(self.kube.clone(), &plan.namespace);
        let mut service = plan.service();
        if let (Some(spec), Some(class)) = (service.spec.as_mut(), &self.load_balancer_class) {
            spec.load_balancer_class = Some(class.clone());
        }
        services
            .create(&PostParams::default(), &service)
            .await
            .with_context(|| format!("creating Service {}/{}", plan.namespace, plan.name))?;
        self.created
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((plan.namespace.clone(), plan.name.clone()));
        self.write_endpoints(plan).await
    }

    /// Makes the Service's EndpointSlice list exactly `plan.pods` (all ready).
    pub async fn write_endpoints(&self, plan: &ServicePlan) -> Result<()> {
        let endpoints = plan
            .pods
            .iter()
            .map(|name| self.topology.pod(name).map(Endpoint::ready))
            .collect::<Result<Vec<_>, _>>()
            .context("the plan names a pod the topology does not have")?;
        self.endpoints.sync(&plan.service(), &endpoints).await?;
        Ok(())
    }

    pub async fn delete_service(&self, plan: &ServicePlan) -> Result<()> {
        let services: Api<Service> = Api::namespaced(self.kube.clone(), &plan.namespace);
        services
            .delete(&plan.name, &DeleteParams::default())
            .await?;
        self.endpoints.delete(&plan.service()).await?;
        Ok(())
    }

    pub async fn service(&self, plan: &ServicePlan) -> Result<Service> {
        let services: Api<Service> = Api::namespaced(self.kube.clone(), &plan.namespace);
        Ok(services.get(&plan.name).await?)
    }

    /// The reason of the Service's `LoadBalancerReady` condition.
    pub async fn condition_reason(&self, plan: &ServicePlan) -> Result<Option<String>> {
        let svc = self.service(plan).await?;
        Ok(svc
            .status
            .and_then(|s| s.conditions)
            .and_then(|c| c.into_iter().find(|c| c.type_ == "LoadBalancerReady"))
            .map(|c| c.reason))
    }

    /// The Service's Events as (type, reason, message).
    pub async fn events(&self, plan: &ServicePlan) -> Result<Vec<(String, String, String)>> {
        let events: Api<Event> = Api::namespaced(self.kube.clone(), &plan.namespace);
        Ok(events
            .list(&ListParams::default())
            .await
            .with_context(|| format!("listing Events in {}", plan.namespace))?
            .items
            .into_iter()
            // A Pod or an EndpointSlice may share the Service's name; only the Service's count.
            .filter(|e| {
                e.involved_object.kind.as_deref() == Some("Service")
                    && e.involved_object.name.as_deref() == Some(plan.name.as_str())
            })
            .map(|e| {
                (
                    e.type_.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.message.unwrap_or_default(),
                )
            })
            .collect())
    }

    /// Waits until the Service's Events hold a Warning with `reason` and its condition reads
    /// `condition`: how a refused Service is explained.
    pub async fn wait_for_refusal(
        &self,
        plan: &ServicePlan,
        condition: &str,
        timeout: Duration,
    ) -> Result<String> {
        let start = Instant::now();
        loop {
            let reason = self.condition_reason(plan).await?;
            let warning = self
                .events(plan)
                .await?
                .into_iter()
                .find(|(kind, reason, _)| kind == "Warning" && reason == "SyncLoadBalancerFailed");
            if let (Some(reason), Some((_, _, message))) = (&reason, warning)
                && reason == condition
            {
                return Ok(message);
            }
            if start.elapsed() > timeout {
                bail!(
                    "Service {}/{} was not refused with {condition} within {timeout:?} (condition {reason:?})",
                    plan.namespace,
                    plan.name
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until the Service has an ingress IP, and returns it.
    pub async fn wait_for_ingress(
        &self,
        plan: &ServicePlan,
        timeout: Duration,
    ) -> Result<Ipv4Addr> {
        let start = Instant::now();
        loop {
            let svc = self.service(plan).await?;
            if let Some(ip) = ingress_ip(&svc) {
                return Ok(ip);
            }
            if start.elapsed() > timeout {
                bail!(
                    "Service {}/{} got no ingress IP within {timeout:?}; check {} (controller.log, cloud-mock.log) and its Events",
                    plan.namespace,
                    plan.name,
                    self.run_dir.join("logs").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Sends `count` HTTP requests from `client` to `vip:port`, each on a new connection.
    pub async fn http_requests(
        &self,
        client: &Host,
        vip: Ipv4Addr,
        port: u16,
        count: u32,
    ) -> Result<Spread> {
        let url = format!("http://{vip}:{port}/");
        let replies = self
            .echo()?
            .http_get_many_async(&client.netns, &url, count)
            .await;
        self.spread(replies)
    }

    /// Sends `count` UDP requests from `client` to `vip:port`, each from a new source port.
    pub async fn udp_requests(
        &self,
        client: &Host,
        vip: Ipv4Addr,
        port: u16,
        count: u32,
    ) -> Result<Spread> {
        let target = SocketAddr::from((vip, port));
        let replies = self
            .echo()?
            .udp_request_many_async(&client.netns, target, count)
            .await;
        self.spread(replies)
    }

    fn echo(&self) -> Result<tandem_netlab::EchoClient> {
        self.topology
            .echo_client()
            .context("the pods run no echo server")
    }

    fn spread(
        &self,
        replies: Result<Vec<Result<tandem_netlab::EchoReply, String>>, tandem_netlab::NetlabError>,
    ) -> Result<Spread> {
        let replies = replies.context("running the echo client")?;
        Ok(Spread::from_replies(&replies, self.topology.nodes()))
    }

    /// `tandem-nodeproxy trace` on a node: where a packet goes there, chain by chain.
    pub async fn trace(
        &self,
        node: &Node,
        src: Ipv4Addr,
        dst: Ipv4Addr,
        dport: u16,
    ) -> Result<String> {
        let out = node
            .netns
            .tokio_command(binaries::locate("tandem-nodeproxy")?)
            .args([
                "trace".to_owned(),
                format!("--kubeconfig={}", self.kubeconfig.display()),
                format!("--node-name={}", node.name),
                format!("--cluster-cidr={}", self.topology.pod_network()),
                format!("--proxy-mode={}", self.proxy_mode),
                format!("--src={src}"),
                format!("--dst={dst}"),
                format!("--dport={dport}"),
            ])
            .output()
            .await
            .context("running tandem-nodeproxy trace")?;
        if !out.status.success() {
            bail!(
                "tandem-nodeproxy trace failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// [`Lab::chain_packets`] summed over every node.
    pub async fn chain_packets_on_all_nodes(&self, table: &str, chain: &str) -> Result<u64> {
        let mut total = 0;
        for node in self.topology.nodes() {
            total += self.chain_packets(&node.netns, table, chain).await?;
        }
        Ok(total)
    }

    /// Waits until the node's rules mention `ip` (its nat table in iptables mode, table
    /// `ip tandem` in nftables mode): the node proxy has synced it.
    pub async fn wait_for_nat_rules(
        &self,
        node: &Netns,
        ip: Ipv4Addr,
        timeout: Duration,
    ) -> Result<()> {
        let start = Instant::now();
        let (command, needle): (&[&str], String) = match self.proxy_mode {
            ProxyMode::Iptables => (
                &["iptables", "-w", "-t", "nat", "-S"],
                format!("-d {ip}/32"),
            ),
            ProxyMode::Nftables => (
                &["nft", "list", "table", "ip", "tandem"],
                format!("{ip} . "),
            ),
        };
        loop {
            let out = node
                .exec_async(command.iter().copied())
                .await
                .context("listing the node's rules")?;
            if String::from_utf8_lossy(&out.stdout).contains(&needle) {
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!("no rule for {ip} within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Packets counted by the rules of the chains named `chain` (or, when it ends in `-`,
    /// starting with it, e.g. `KUBE-FW-`) of one table on a node (`iptables -L -v -x`).
    pub async fn chain_packets(&self, node: &Netns, table: &str, chain: &str) -> Result<u64> {
        let out = node
            .exec_async(["iptables", "-w", "-t", table, "-L", "-v", "-x", "-n"])
            .await
            .context("reading iptables counters")?;
        if !out.status.success() {
            bail!(
                "iptables -t {table} -L: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(sum_packet_counters(
            &String::from_utf8_lossy(&out.stdout),
            chain,
        ))
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.keep_run_dir || std::thread::panicking() {
            eprintln!("lab logs kept in {}", self.run_dir.join("logs").display());
        } else if let Err(e) = std::fs::remove_dir_all(&self.run_dir) {
            tracing::warn!(error = %e, dir = %self.run_dir.display(), "removing the lab's run directory");
        }
    }
}

/// Starts Tandem's binaries: as processes in the lab's namespaces, or from their images.
struct Launcher<'a> {
    /// The images and the engine configuration, or `None` for processes.
    images: Option<(&'a Images, &'a Path)>,
    prefix: &'a str,
    run_dir: &'a Path,
    logs: &'a Path,
}

impl Launcher<'_> {
    /// Starts `binary args` in `netns` as `name`; a container gets `capabilities` (a
    /// process runs as root with all of them).
    fn start(
        &self,
        netns: &Netns,
        name: &str,
        binary: &str,
        capabilities: &[&'static str],
        args: &[String],
    ) -> Result<Component> {
        let component = match self.images {
            None => Component::start(
                netns,
                name,
                &binaries::locate(binary)?,
                args,
                &[],
                self.logs,
            )?,
            Some((images, config)) => {
                let run = ContainerRun {
                    config: config.to_owned(),
                    name: format!("tandem-lab-{}-{name}", self.prefix),
                    image: images.reference(binary),
                    netns: netns.name().to_owned(),
                    add_capabilities: capabilities.to_vec(),
                    // Kubeconfig, cloud token and the cloud's data, at the same paths.
                    mounts: vec![self.run_dir.to_owned()],
                };
                Component::start_container(&run, name, args, self.logs)?
            }
        };
        Ok(component)
    }
}

/// Starts the API server stand-in in the control plane; it writes the lab's kubeconfig.
async fn start_stand_in(
    cp: &Host,
    token: &str,
    kubeconfig: &Path,
    logs: &Path,
) -> Result<Component> {
    let api_addr = SocketAddr::from((cp.ip, API_PORT));
    let mut apiserver = Component::start(
        &cp.netns,
        "apiserver",
        &binaries::locate("tandem-apiserver")?,
        &[
            format!("--listen={api_addr}"),
            format!("--token={token}"),
            format!("--kubeconfig-out={}", kubeconfig.display()),
        ],
        &[],
        logs,
    )?;
    apiserver
        .wait_serving(api_addr, Duration::from_secs(20))
        .await?;
    Ok(apiserver)
}

/// The first IPv4 ingress address of a Service's status.
pub fn ingress_ip(svc: &Service) -> Option<Ipv4Addr> {
    svc.status
        .as_ref()?
        .load_balancer
        .as_ref()?
        .ingress
        .as_ref()?
        .iter()
        .find_map(|i| i.ip.as_deref()?.parse().ok())
}

/// Sum of the packet column of the rules of the matching chains in `iptables -L -v -x -n`
/// output; `chain` ending in `-` matches every chain with that prefix.
pub fn sum_packet_counters(listing: &str, chain: &str) -> u64 {
    let matches = |name: &str| {
        if chain.ends_with('-') {
            name.starts_with(chain)
        } else {
            name == chain
        }
    };
    let mut in_chain = false;
    let mut total = 0;
    for line in listing.lines() {
        if let Some(rest) = line.strip_prefix("Chain ") {
            in_chain = rest.split_whitespace().next().is_some_and(matches);
        } else if in_chain
            && let Some(Ok(packets)) = line.split_whitespace().next().map(str::parse::<u64>)
        {
            total += packets;
        }
    }
    total
}

pub async fn kube_client(kubeconfig: &Path) -> Result<kube::Client> {
    Ok(tandem_common::kube_client(Some(kubeconfig)).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packet_counters_are_summed_over_matching_chains() {
        let listing = "Chain PREROUTING (policy ACCEPT 40 packets, 2400 bytes)\n    pkts      bytes target     prot opt in     out     source               destination\n      40     2400 KUBE-SERVICES  all  --  *      *       0.0.0.0/0            0.0.0.0/0\n\nChain KUBE-FW-AAAA (1 references)\n    pkts      bytes target     prot opt in     out     source               destination\n       7      420 KUBE-MARK-MASQ  all  --  *      *       0.0.0.0/0            0.0.0.0/0\n\nChain KUBE-FW-BBBB (1 references)\n    pkts      bytes target     prot opt in     out     source               destination\n       2      120 KUBE-MARK-DROP  all  --  *      *       0.0.0.0/0            0.0.0.0/0\n";
        assert_eq!(sum_packet_counters(listing, "KUBE-FW-"), 9);
        assert_eq!(sum_packet_counters(listing, "KUBE-FW-AAAA"), 7);
        // Policy counters in a built-in chain's header are not rule counters.
        assert_eq!(sum_packet_counters(listing, "PREROUTING"), 40);
        assert_eq!(sum_packet_counters(listing, "KUBE-SVC-"), 0);
    }
}
