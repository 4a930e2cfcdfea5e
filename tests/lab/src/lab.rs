//! The running lab: topology, processes, and the API/cloud clients to drive them.

use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Service};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use nix::sys::signal::Signal;
use tandem_common::{GoDuration, NODE_HEALTHZ_PORT, ProxyMode};
use tandem_netlab::addr::{self, v6};
use tandem_netlab::cluster::{Endpoint, EndpointSliceWriter, LabNode, NodeAgent, NodeAgentConfig};
use tandem_netlab::{ClusterFamilies, Host, IpFamily, Netns, Node, PodNetwork, Topology};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::binaries;
use crate::bridge::RelayThread;
use crate::components::Component;
use crate::edges::{Announce, EdgeSettings, Edges};
use crate::images::Images;
use crate::launcher::Launcher;
use crate::netns;
use crate::rules;
use crate::scenario::{LbMode, ServicePlan, Spread};
use crate::traffic::{Traffic, TrafficArgs};

const API_PORT: u16 = 6443;
/// The first controller replica's metrics and health ports; replica N adds 10 × N.
const CONTROLLER_METRICS_PORT: u16 = 10257;
const CONTROLLER_HEALTH_PORT: u16 = 10258;
/// The Lease the controller replicas elect their leader on (the controller's defaults).
const LEADER_LEASE_NAMESPACE: &str = "kube-system";
const LEADER_LEASE_NAME: &str = "tandem-controller";
/// How long a stopped process may take to exit before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// The mock cloud's VIP pools: the lab's VIP range (198.51.100.0/24, routed to the cloud
/// edge) split in halves, so the second pool's addresses stay inside the lab too.
pub const VIP_POOLS: [(&str, &str); 2] = [
    ("default", "198.51.100.0/25"),
    ("blue", "198.51.100.128/25"),
];
/// The IPv6 CIDRs of the pools, when the lab has IPv6: the first half of the IPv6 VIP range
/// (2001:db8:51:100::/120). Pool `blue` stays IPv4 only, so that an IPv6 Service asking
/// for it shows the refusal of a pool without the family.
pub const VIP_POOLS_V6: [(&str, &str); 1] = [("default", "2001:db8:51:100::/121")];

/// What serves the cloud edge's proxy-mode load balancers (`cloud-mock --dataplane`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum EdgeDataPlane {
    /// The mock cloud's own listeners (TCP and UDP).
    #[default]
    Proxy,
    /// A real HAProxy, driven by the mock cloud (TCP only: UDP is refused in proxy mode).
    Haproxy,
}

impl EdgeDataPlane {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Proxy => "proxy",
            Self::Haproxy => "haproxy",
        }
    }

    /// Whether load balancers of `mode` serve UDP on this edge (routes carry anything).
    pub fn serves_udp(self, mode: LbMode) -> bool {
        mode == LbMode::Passthrough || self == Self::Proxy
    }
}

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
    /// What serves the edge's proxy-mode load balancers.
    pub edge_dataplane: EdgeDataPlane,
    /// Controller replicas; with more than one they elect a leader on a Lease, as the
    /// chart's Deployment runs them.
    pub controller_replicas: usize,
    /// The node proxies' `--sync-period` (how often they rewrite their rules in full);
    /// their default when `None`.
    pub sync_period: Option<Duration>,
    /// The cluster's IP families: what the Nodes report, the Services get (the stand-in's
    /// Service CIDRs), the pools hold and the node proxies serve. With IPv6 the topology is
    /// dual-stack underneath.
    pub ip_family: ClusterFamilies,
    /// Cloud edges: one (the gateway), or an edge cluster of this many behind a router,
    /// with a 3-member etcd (IPv4 only).
    pub edges: usize,
    /// How an edge cluster announces its VIPs to the router.
    pub announce: Announce,
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
            edge_dataplane: EdgeDataPlane::default(),
            controller_replicas: 1,
            sync_period: None,
            ip_family: ClusterFamilies::default(),
            edges: 1,
            announce: Announce::default(),
        }
    }
}

/// A built virtual cluster, before its processes start: see [`Lab::prepare`].
pub struct Prepared {
    topology: Topology,
    run_dir: PathBuf,
    relay: Option<RelayThread>,
}

/// A running lab. Dropping it stops every process and removes every namespace.
pub struct Lab {
    // Field order is drop order: the node agent stops before the API server it talks to,
    // and processes go before the namespaces they run in.
    /// The node agent (Lease renewals, Ready heartbeats): stopped when the lab goes, and
    /// waited for by [`Lab::shutdown`] before it removes the Nodes, so that an agent still
    /// registering never makes a Node again after they were removed.
    node_agent: Option<(DropGuard, tokio::task::JoinHandle<()>)>,
    /// The controller's replicas, in the order they were started; stopped ones are gone.
    controllers: Vec<ControllerReplica>,
    /// Controller replicas started so far: the next one's number.
    controllers_started: usize,
    /// Whether the replicas elect a leader, and on which Lease (namespace, name).
    leader_lease: Option<(String, String)>,
    /// The controller's flags every replica shares.
    controller_args: Vec<String>,
    /// One per node, in node order.
    node_proxies: Vec<NodeProxy>,
    /// The node proxies' `--sync-period`, when the lab sets it.
    sync_period: Option<Duration>,
    /// The cloud edges (and an edge cluster's etcd and router).
    pub edges: Edges,
    /// Held for its drop: the API server stand-in.
    _components: Vec<Component>,
    launcher: Launcher,
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
    /// What serves the edge's proxy-mode load balancers.
    pub edge_dataplane: EdgeDataPlane,
    /// The cluster's IP families (see [`LabOptions::ip_family`]).
    pub ip_family: ClusterFamilies,
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
        let builder = Topology::builder()
            .nodes(options.nodes)
            .pods_per_node(&options.pods_per_node)
            .pod_network(options.pod_network)
            .edges(options.edges)
            // The lab handles SIGINT/SIGTERM itself: it must stop its processes before the
            // namespaces go, and the topology's own handler would exit without them.
            .handle_signals(false);
        let builder = if options.ip_family.has(IpFamily::V6) {
            builder.ipv6()
        } else {
            builder
        };
        let topology = builder
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
            components
                .push(start_stand_in(&cp, options.ip_family, &token, &kubeconfig, &logs).await?);
        }
        let kube = kube_client(&kubeconfig).await?;

        progress("registering the nodes (a kubelet's Node, Lease and Ready heartbeats)");
        let lab_nodes = lab_nodes(&topology, options.ip_family)?;
        let mut agent = NodeAgent::new(kube.clone(), lab_nodes, NodeAgentConfig::default());
        agent.register().await.context("registering the nodes")?;
        let stop_agent = CancellationToken::new();
        let agent_token = stop_agent.clone();
        let agent_task = tokio::spawn(async move {
            if let Err(e) = agent.run(agent_token).await {
                tracing::error!(error = %e, "node agent stopped");
            }
        });

        let token_file = run_dir.join("cloud-token");
        std::fs::write(&token_file, &token).context("writing the cloud token file")?;
        if let Some(images) = &options.images {
            images.check_present(&["cloud-mock", "tandem-nodeproxy", "tandem-controller"])?;
        }
        let engine_config = match &options.images {
            Some(_) => Some(crate::images::write_engine_config(&run_dir)?),
            None => None,
        };
        let launcher = Launcher {
            images: options.images.clone().zip(engine_config),
            prefix: topology.prefix().to_owned(),
            run_dir: run_dir.clone(),
            logs: logs.clone(),
        };
        let mut cloud_args = vec![format!("--token={token}")];
        let v4_pools = options
            .ip_family
            .has(IpFamily::V4)
            .then_some(VIP_POOLS.as_slice());
        let v6_pools = options
            .ip_family
            .has(IpFamily::V6)
            .then_some(VIP_POOLS_V6.as_slice());
        cloud_args.extend(
            v4_pools
                .into_iter()
                .chain(v6_pools)
                .flatten()
                .map(|(name, cidr)| format!("--vip-pool={name}={cidr}")),
        );
        cloud_args.extend([
            format!("--dataplane={}", options.edge_dataplane.as_str()),
            "--manage-vip-addresses".to_owned(),
            format!("--vip-device={}", topology.edge().vip_interface),
            "--provisioning-delay=200ms".to_owned(),
            // The lab is where faults are injected by hand and by its tests.
            "--fault-injection".to_owned(),
        ]);
        let edges = Edges::start(
            &topology,
            EdgeSettings {
                cloud_args,
                announce: options.announce,
                run_dir: &run_dir,
                logs: &logs,
            },
            launcher.clone(),
            progress,
        )
        .await?;
        let urls = edges.urls();
        let cloud_url = urls[0].clone();
        let url_refs: Vec<&str> = urls.iter().map(String::as_str).collect();
        let cloud_client = cloud_mock_sdk::Client::with_edges(
            &url_refs,
            token.clone(),
            cloud_mock_sdk::ClientOptions::default(),
        )
        .map_err(|e| anyhow!("cloud client: {e}"))?;

        progress("starting a node proxy on every node");
        let node_proxies = topology
            .nodes()
            .iter()
            .map(|node| NodeProxy {
                node: node.clone(),
                mode: options.proxy_mode,
                process: None,
            })
            .collect();

        let mut controller_args = vec![format!("--kubeconfig={}", kubeconfig.display())];
        if urls.len() == 1 {
            controller_args.extend([
                format!("--cloud-url={cloud_url}"),
                format!("--cloud-token-file={}", token_file.display()),
            ]);
        } else {
            // Every edge's API: a call that cannot connect to one is tried on the next.
            let config = run_dir.join("cloud-config.json");
            let text = serde_json::json!({"urls": urls, "tokenFile": token_file});
            std::fs::write(&config, text.to_string()).context("writing the cloud config")?;
            controller_args.push(format!("--cloud-config={}", config.display()));
        }
        controller_args.push(format!("--cluster-id={}", options.cluster_id));
        if let Some(class) = &load_balancer_class {
            controller_args.extend([
                format!("--load-balancer-class={class}"),
                "--claim-unclassed=false".to_owned(),
            ]);
        }
        // On a shared API server each lab elects on a Lease of its own.
        let leader_lease = (options.controller_replicas > 1).then(|| {
            let name = match relay {
                Some(_) => format!("tandem-lab-{}", topology.prefix()),
                None => LEADER_LEASE_NAME.to_owned(),
            };
            (LEADER_LEASE_NAMESPACE.to_owned(), name)
        });
        if let Some((namespace, name)) = &leader_lease {
            controller_args.extend([
                "--leader-elect".to_owned(),
                format!("--leader-elect-namespace={namespace}"),
                format!("--leader-elect-lease-name={name}"),
            ]);
        }

        let mut lab = Self {
            edges,
            _components: components,
            controllers: Vec::new(),
            controllers_started: 0,
            leader_lease,
            controller_args,
            node_proxies,
            sync_period: options.sync_period,
            launcher,
            relay,
            load_balancer_class,
            created: std::sync::Mutex::new(Vec::new()),
            topology,
            run_dir,
            kubeconfig,
            keep_run_dir: false,
            proxy_mode: options.proxy_mode,
            edge_dataplane: options.edge_dataplane,
            ip_family: options.ip_family,
            endpoints: EndpointSliceWriter::new(kube.clone()),
            kube,
            cloud: cloud_client,
            cloud_url,
            node_agent: Some((stop_agent.drop_guard(), agent_task)),
        };
        for index in 0..lab.node_proxies.len() {
            lab.start_node_proxy(index, options.proxy_mode)?;
            lab.wait_node_proxy_serving(index).await?;
        }
        progress(if options.controller_replicas > 1 {
            "starting the controller's replicas (leader election)"
        } else {
            "starting the controller"
        });
        for _ in 0..options.controller_replicas.max(1) {
            lab.start_controller_replica().await?;
        }
        Ok(lab)
    }

    /// Stops the lab. On a real API server it first removes what the lab wrote there: its
    /// Services (waiting for the controller to release their load balancers), their
    /// EndpointSlices, and its Nodes and Leases. With the stand-in, dropping is enough.
    pub async fn shutdown(mut self) -> Result<()> {
        if let Some((stop, task)) = self.node_agent.take() {
            drop(stop);
            if let Err(e) = task.await {
                tracing::warn!(error = %e, "the node agent's task failed");
            }
        }
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
            let lab_nodes = lab_nodes(&self.topology, self.ip_family)?;
            NodeAgent::new(self.kube.clone(), lab_nodes, NodeAgentConfig::default())
                .unregister()
                .await
                .context("removing the lab's Nodes and Leases")?;
            if let Some((namespace, name)) = &self.leader_lease {
                let leases: Api<Lease> = Api::namespaced(self.kube.clone(), namespace);
                if let Err(e) = leases.delete(name, &DeleteParams::default()).await {
                    tracing::warn!(error = %e, lease = %name, "removing the controllers' leader Lease");
                }
            }
        }
        Ok(())
    }

    /// Creates the Service and the EndpointSlices for its pods.
    /// Whether the lab's Services of `mode` have a UDP port the edge serves.
    pub fn serves_udp(&self, mode: LbMode) -> bool {
        self.edge_dataplane.serves_udp(mode)
    }

    pub async fn create_service(&self, plan: &ServicePlan) -> Result<()> {
        // An edge that proxies TCP only refuses a UDP port in proxy mode: the Service then
        // has its TCP port alone (tests ask `serves_udp` before they send UDP).
        self.create(plan, plan.service_with_udp(self.serves_udp(plan.mode)))
            .await
    }

    /// [`Self::create_service`] with every port of the plan, whether the edge serves it
    /// or not (to see the refusal).
    pub async fn create_service_with_every_port(&self, plan: &ServicePlan) -> Result<()> {
        self.create(plan, plan.service()).await
    }

    async fn create(&self, plan: &ServicePlan, mut service: Service) -> Result<()> {
        let services: Api<Service> = Api::namespaced(self.kube.clone(), &plan.namespace);
        if let (Some(spec), Some(class)) = (service.spec.as_mut(), &self.load_balancer_class) {
            spec.load_balancer_class = Some(class.clone());
        }
        let created = services
            .create(&PostParams::default(), &service)
            .await
            .with_context(|| format!("creating Service {}/{}", plan.namespace, plan.name))?;
        self.created
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((plan.namespace.clone(), plan.name.clone()));
        self.write_endpoints_of(plan, &created).await
    }

    /// Makes the Service's EndpointSlices list exactly `plan.pods` (all ready), a slice
    /// per family the API server gave the Service.
    pub async fn write_endpoints(&self, plan: &ServicePlan) -> Result<()> {
        let service = self.service(plan).await?;
        self.write_endpoints_of(plan, &service).await
    }

    async fn write_endpoints_of(&self, plan: &ServicePlan, service: &Service) -> Result<()> {
        for family in service_families(service)? {
            let endpoints = plan
                .pods
                .iter()
                .map(|name| Ok(Endpoint::ready(self.topology.pod(name)?, family)?))
                .collect::<Result<Vec<_>>>()
                .context("the plan's pods")?;
            self.endpoints
                .sync(&plan.service(), family, &endpoints)
                .await?;
        }
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

    /// Waits until the Service has an ingress IP, and returns the first.
    pub async fn wait_for_ingress(&self, plan: &ServicePlan, timeout: Duration) -> Result<IpAddr> {
        let ips = self.wait_for_ingresses(plan, 1, timeout).await?;
        ips.first()
            .copied()
            .ok_or_else(|| anyhow!("Service {} has no ingress IP", plan.name))
    }

    /// Waits until the Service has `count` ingress IPs (one per family it has), and
    /// returns them in the status's order.
    pub async fn wait_for_ingresses(
        &self,
        plan: &ServicePlan,
        count: usize,
        timeout: Duration,
    ) -> Result<Vec<IpAddr>> {
        let start = Instant::now();
        loop {
            let svc = self.service(plan).await?;
            let ips = ingress_ips(&svc);
            if ips.len() >= count {
                // In front of an edge cluster, a VIP answers once the router can reach it.
                let remaining = timeout.saturating_sub(start.elapsed());
                for &vip in &ips {
                    self.edges
                        .wait_announced(&self.topology, vip, remaining)
                        .await?;
                }
                return Ok(ips);
            }
            if start.elapsed() > timeout {
                bail!(
                    "Service {}/{} got {} of {count} ingress IPs within {timeout:?}; check {} (controller*.log, cloud-mock.log) and its Events",
                    plan.namespace,
                    plan.name,
                    ips.len(),
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
        vip: IpAddr,
        port: u16,
        count: u32,
    ) -> Result<Spread> {
        self.http_requests_in(&client.netns, SocketAddr::new(vip, port), count)
            .await
    }

    /// Sends `count` HTTP requests from inside `netns` (a client, a node) to `target`, each
    /// on a new connection.
    pub async fn http_requests_in(
        &self,
        netns: &Netns,
        target: SocketAddr,
        count: u32,
    ) -> Result<Spread> {
        let url = format!("http://{target}/");
        let replies = self.echo()?.http_get_many_async(netns, &url, count).await;
        self.spread(replies)
    }

    /// Sends `count` UDP requests from `client` to `vip:port`, each from a new source port.
    pub async fn udp_requests(
        &self,
        client: &Host,
        vip: IpAddr,
        port: u16,
        count: u32,
    ) -> Result<Spread> {
        let target = SocketAddr::new(vip, port);
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
    pub async fn trace(&self, node: &Node, src: IpAddr, dst: IpAddr, dport: u16) -> Result<String> {
        let out = node
            .netns
            .tokio_command(binaries::locate("tandem-nodeproxy")?)
            .args([
                "trace".to_owned(),
                format!("--kubeconfig={}", self.kubeconfig.display()),
                format!("--node-name={}", node.name),
                format!("--cluster-cidr={}", self.cluster_cidrs()),
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

    /// Waits until the node's rules of `ip`'s family mention it (the nat table in iptables
    /// mode, table `ip tandem` or `ip6 tandem` in nftables mode): the node proxy has synced
    /// it.
    pub async fn wait_for_nat_rules(
        &self,
        node: &Netns,
        ip: IpAddr,
        timeout: Duration,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            let listing = node_rules(node, self.proxy_mode, IpFamily::of(ip)).await?;
            if rules::mentions(self.proxy_mode, &listing, ip) {
                return Ok(());
            }
            if start.elapsed() > timeout {
                bail!("no rule for {ip} within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The node proxies' `--cluster-cidr`: the pod network of each cluster family.
    fn cluster_cidrs(&self) -> String {
        self.ip_family
            .families()
            .iter()
            .map(|family| match family {
                IpFamily::V4 => self.topology.pod_network().to_string(),
                IpFamily::V6 => v6::POD_NETWORK.to_string(),
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The endpoints (pod address and target port) the plan's pods give its TCP port.
    pub fn endpoints_of(&self, plan: &ServicePlan) -> Result<Vec<SocketAddrV4>> {
        plan.pods
            .iter()
            .map(|name| {
                let pod = self.topology.pod(name)?;
                Ok(SocketAddrV4::new(pod.ip, plan.target_port))
            })
            .collect()
    }

    /// Starts client traffic (`tandem-traffic`, see [`crate::traffic`]) from `client`; its
    /// log is `logs/traffic-NAME.log`.
    pub async fn start_traffic(
        &self,
        client: &Host,
        args: &TrafficArgs,
        name: &str,
    ) -> Result<Traffic> {
        let log = self
            .run_dir
            .join("logs")
            .join(format!("traffic-{name}.log"));
        Ok(Traffic::start(&client.netns, args, &log).await?)
    }

    /// Waits until 10 requests in a row from the client inside the source ranges to
    /// `vip:80` all succeed; returns how long it took.
    pub async fn serve_within(&self, vip: IpAddr, bound: Duration) -> Result<Duration> {
        let start = Instant::now();
        loop {
            let spread = self
                .http_requests(self.topology.client_in_range(), vip, 80, 10)
                .await?;
            if spread.failed == 0 {
                return Ok(start.elapsed());
            }
            if start.elapsed() > bound {
                bail!("{vip}:80 still fails requests after {bound:?}: {spread:?}");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// A Service `NAME-MODE` of each of `modes` over every pod, each answering from the
    /// client inside the source ranges within `within`.
    pub async fn create_served_services(
        &self,
        name: &str,
        modes: &[LbMode],
        within: Duration,
    ) -> Result<Vec<ServedService>> {
        let mut services = Vec::new();
        for &mode in modes {
            let mut plan = ServicePlan::new(&format!("{name}-{}", mode.as_str()), mode);
            plan.pods = self
                .topology
                .pods()
                .iter()
                .map(|p| p.name.clone())
                .collect();
            self.create_service(&plan).await?;
            let vip = self.wait_for_ingress(&plan, within).await?;
            self.serve_within(vip, within).await?;
            services.push(ServedService { plan, vip });
        }
        Ok(services)
    }

    /// Client traffic from the client inside the source ranges towards each of
    /// `services`, in their order.
    pub async fn start_traffic_through(
        &self,
        services: &[ServedService],
        scenario: &str,
    ) -> Result<Vec<Traffic>> {
        let mut traffic = Vec::new();
        for ServedService { plan, vip } in services {
            let args = TrafficArgs::new(SocketAddr::new(*vip, plan.port));
            let name = format!("{scenario}-{}", plan.mode.as_str());
            traffic.push(
                self.start_traffic(self.topology.client_in_range(), &args, &name)
                    .await?,
            );
        }
        Ok(traffic)
    }

    /// The edges holding long-lived connections from the client inside the source ranges
    /// to `service`, with how many each holds ([`Edges::holding_long_lived`]).
    pub async fn edges_holding_long_lived(
        &self,
        service: &ServedService,
    ) -> Result<std::collections::BTreeMap<usize, usize>> {
        self.edges
            .holding_long_lived(
                self.topology.client_in_range(),
                service.vip,
                service.plan.port,
            )
            .await
    }

    /// Every load balancer of the cloud, by id, with its VIP: what must come through an
    /// edge cluster's failures unchanged.
    pub async fn load_balancer_vips(
        &self,
    ) -> Result<std::collections::BTreeMap<String, Option<std::net::Ipv4Addr>>> {
        let all = self
            .cloud
            .list_load_balancers(&Default::default())
            .await
            .context("listing the load balancers")?;
        Ok(all
            .into_iter()
            .map(|lb| (lb.id.clone(), lb.vip()))
            .collect())
    }

    /// A client of edge `index`'s API alone, which tries once: what that edge answers.
    pub fn edge_client(&self, index: usize) -> Result<cloud_mock_sdk::Client> {
        let token = std::fs::read_to_string(self.run_dir.join("cloud-token"))
            .context("reading the cloud token")?;
        let options = cloud_mock_sdk::ClientOptions {
            timeout: Duration::from_secs(5),
            max_retries: 0,
            ..cloud_mock_sdk::ClientOptions::default()
        };
        cloud_mock_sdk::Client::new(&self.edges.url(index)?, token, options)
            .map_err(|e| anyhow!("a client of edge {index}: {e}"))
    }

    /// The mode node `index`'s proxy runs in, or last ran in (nodes in topology order, from 0).
    pub fn node_proxy_mode(&self, index: usize) -> Result<ProxyMode> {
        Ok(self.node_proxy(index)?.mode)
    }

    fn node_proxy(&self, index: usize) -> Result<&NodeProxy> {
        self.node_proxies
            .get(index)
            .ok_or_else(|| anyhow!("the lab has no node {index} (from 0)"))
    }

    fn node_proxy_mut(&mut self, index: usize) -> Result<&mut NodeProxy> {
        self.node_proxies
            .get_mut(index)
            .ok_or_else(|| anyhow!("the lab has no node {index} (from 0)"))
    }

    /// Starts node `index`'s proxy in `mode` and returns when it was spawned; it must not
    /// be running. [`Lab::wait_node_proxy_serving`] waits until it serves.
    pub fn start_node_proxy(&mut self, index: usize, mode: ProxyMode) -> Result<Instant> {
        let node = self.node_proxy(index)?.node.clone();
        if self.node_proxy(index)?.process.is_some() {
            bail!("the node proxy of {} runs already", node.name);
        }
        let mut args = vec![
            format!("--kubeconfig={}", self.kubeconfig.display()),
            format!("--node-name={}", node.name),
            format!("--cluster-cidr={}", self.cluster_cidrs()),
            format!("--healthz-bind-address=0.0.0.0:{NODE_HEALTHZ_PORT}"),
            "--metrics-bind-address=127.0.0.1:10249".to_owned(),
            "--min-sync-period=200ms".to_owned(),
            format!("--proxy-mode={mode}"),
        ];
        if let Some(period) = self.sync_period {
            args.push(format!("--sync-period={}", GoDuration(period)));
        }
        let spawned = Instant::now();
        let process = self.launcher.start(
            &node.netns,
            &format!("nodeproxy-{}", node.name),
            "tandem-nodeproxy",
            // What the chart's DaemonSet grants: iptables and conntrack.
            &["NET_ADMIN", "NET_RAW"],
            &args,
        )?;
        let proxy = self.node_proxy_mut(index)?;
        proxy.mode = mode;
        proxy.process = Some(process);
        Ok(spawned)
    }

    /// Waits until node `index`'s proxy serves its health port.
    pub async fn wait_node_proxy_serving(&mut self, index: usize) -> Result<()> {
        let proxy = self.node_proxy_mut(index)?;
        let addr = SocketAddr::from((proxy.node.ip, NODE_HEALTHZ_PORT));
        let name = proxy.node.name.clone();
        let process = proxy
            .process
            .as_mut()
            .ok_or_else(|| anyhow!("the node proxy of {name} is not running"))?;
        process.wait_serving(addr, Duration::from_secs(20)).await?;
        Ok(())
    }

    /// Waits until node `index`'s proxy answers `/healthz` with 200 (it has synced), as a
    /// DaemonSet's readiness probe does; returns how long it took.
    pub async fn wait_node_proxy_healthy(&self, index: usize) -> Result<Duration> {
        let node = &self.node_proxy(index)?.node;
        let healthz = SocketAddr::from((node.ip, NODE_HEALTHZ_PORT));
        let start = Instant::now();
        loop {
            let answer = tokio::time::timeout(
                Duration::from_secs(1),
                crate::traffic::http_get(healthz, "/healthz"),
            )
            .await;
            let last = match answer {
                Ok(Ok((200, _))) => return Ok(start.elapsed()),
                Ok(Ok((status, body))) => format!("HTTP {status}: {body}"),
                Ok(Err(e)) => e.to_string(),
                Err(_) => "no answer within 1 s".to_owned(),
            };
            if start.elapsed() > Duration::from_secs(20) {
                bail!(
                    "the node proxy of {} is not healthy after 20 s: {last}",
                    node.name
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends `signal` to node `index`'s proxy and waits until it exited (it is killed when
    /// it has not within 10 s); returns how long it took.
    pub async fn stop_node_proxy(&mut self, index: usize, signal: Signal) -> Result<Duration> {
        let proxy = self.node_proxy_mut(index)?;
        let name = proxy.node.name.clone();
        let process = proxy
            .process
            .take()
            .ok_or_else(|| anyhow!("the node proxy of {name} is not running"))?;
        process.stop(signal, STOP_GRACE).await?.ok_or_else(|| {
            anyhow!("the node proxy of {name} did not exit within {STOP_GRACE:?} of {signal}")
        })
    }

    /// Stops node `index`'s proxy with SIGTERM, starts it again in `mode`, and waits until
    /// it is healthy: a DaemonSet's rolling restart on one node. Returns how long the node
    /// was without a healthy node proxy.
    pub async fn restart_node_proxy(&mut self, index: usize, mode: ProxyMode) -> Result<Duration> {
        let start = Instant::now();
        self.stop_node_proxy(index, Signal::SIGTERM).await?;
        self.start_node_proxy(index, mode)?;
        self.wait_node_proxy_healthy(index).await?;
        Ok(start.elapsed())
    }

    /// Starts one more controller replica, with an identity of its own (as a Deployment's
    /// new pod), and waits until it serves its health port; returns its identity. Without
    /// leader election only one replica may run.
    pub async fn start_controller_replica(&mut self) -> Result<String> {
        let running = self.controller_replicas();
        if self.leader_lease.is_none() && !running.is_empty() {
            bail!(
                "a second controller replica needs leader election (LabOptions::controller_replicas > 1)"
            );
        }
        self.controllers_started += 1;
        let identity = match self.leader_lease {
            Some(_) => format!("controller-{}", self.controllers_started),
            None => "controller".to_owned(),
        };
        // Each replica binds ports of its own: the lowest slot no running replica uses.
        let cp = self.topology.control_plane().clone();
        let slot = (0u16..)
            .find(|slot| {
                let health = SocketAddr::from((cp.ip, CONTROLLER_HEALTH_PORT + 10 * slot));
                self.controllers.iter().all(|c| c.health != health)
            })
            .unwrap_or_default();
        let health = SocketAddr::from((cp.ip, CONTROLLER_HEALTH_PORT + 10 * slot));
        let metrics = SocketAddr::from((cp.ip, CONTROLLER_METRICS_PORT + 10 * slot));
        let mut args = self.controller_args.clone();
        args.extend([
            format!("--health-bind-address={health}"),
            format!("--metrics-bind-address={metrics}"),
            format!("--identity={identity}"),
        ]);
        let mut component =
            self.launcher
                .start(&cp.netns, &identity, "tandem-controller", &[], &args)?;
        component
            .wait_serving(health, Duration::from_secs(20))
            .await?;
        self.controllers.push(ControllerReplica {
            identity: identity.clone(),
            health,
            metrics,
            component,
        });
        Ok(identity)
    }

    /// The identities of the running controller replicas, oldest first. A replica that
    /// exited by itself (e.g. after losing the leader Lease) is logged and forgotten; the
    /// lab does not restart it (no kubelet here): see [`Lab::start_controller_replica`].
    pub fn controller_replicas(&mut self) -> Vec<String> {
        self.controllers.retain_mut(|replica| {
            let running = replica.component.is_running();
            if !running {
                tracing::warn!(identity = %replica.identity, log = %replica.component.log.display(), "a controller replica exited");
            }
            running
        });
        self.controllers
            .iter()
            .map(|c| c.identity.clone())
            .collect()
    }

    /// Each running controller replica's identity and metrics address, oldest first.
    pub fn controller_metrics_addresses(&mut self) -> Vec<(String, SocketAddr)> {
        self.controller_replicas();
        self.controllers
            .iter()
            .map(|c| (c.identity.clone(), c.metrics))
            .collect()
    }

    /// The holder of the controllers' leader Lease, if any (`None` also without leader
    /// election).
    pub async fn controller_leader(&self) -> Result<Option<String>> {
        let Some((namespace, name)) = &self.leader_lease else {
            return Ok(None);
        };
        let leases: Api<Lease> = Api::namespaced(self.kube.clone(), namespace);
        let lease = leases
            .get_opt(name)
            .await
            .with_context(|| format!("reading Lease {namespace}/{name}"))?;
        Ok(lease
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .filter(|holder| !holder.is_empty()))
    }

    /// Sends `signal` to the controller replica `identity` and waits until it exited.
    pub async fn stop_controller(&mut self, identity: &str, signal: Signal) -> Result<()> {
        let position = self
            .controllers
            .iter()
            .position(|c| c.identity == identity)
            .ok_or_else(|| anyhow!("no controller replica {identity} runs"))?;
        let replica = self.controllers.remove(position);
        replica
            .component
            .stop(signal, STOP_GRACE)
            .await?
            .ok_or_else(|| {
                anyhow!(
                    "controller replica {identity} did not exit within {STOP_GRACE:?} of {signal}"
                )
            })?;
        Ok(())
    }

    /// Makes the API server unreachable from everything in the lab (the node proxies, the
    /// controllers and the lab's own node agent) until the returned outage ends: its
    /// packets are dropped in the control plane, so connections stall rather than close,
    /// as when a network path fails. Nothing in the API server is lost.
    pub async fn block_api_server(&self) -> Result<ApiOutage> {
        let cp = self.topology.control_plane();
        let outage = ApiOutage {
            netns: cp.netns.clone(),
            rule: [
                "INPUT",
                "-d",
                &cp.ip.to_string(),
                "-p",
                "tcp",
                "--dport",
                &API_PORT.to_string(),
                "-m",
                "comment",
                "--comment",
                "tandem-lab: API server outage",
                "-j",
                "DROP",
            ]
            .map(str::to_owned)
            .to_vec(),
            ended: false,
        };
        outage
            .iptables("--insert", "blocking the API server")
            .await?;
        Ok(outage)
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

/// A node's proxy: the mode it runs (or last ran) in, and its process while it runs.
struct NodeProxy {
    node: Node,
    mode: ProxyMode,
    process: Option<Component>,
}

/// One controller replica: the identity it elects its leader with, and its process.
struct ControllerReplica {
    identity: String,
    health: SocketAddr,
    metrics: SocketAddr,
    component: Component,
}

/// The API server unreachable from inside the lab (see [`Lab::block_api_server`]); ends
/// with [`ApiOutage::end`], or when dropped.
pub struct ApiOutage {
    netns: Netns,
    /// The DROP rule's chain and matches.
    rule: Vec<String>,
    ended: bool,
}

impl ApiOutage {
    /// `iptables OPERATION` of the rule.
    fn command(&self, operation: &str) -> Vec<String> {
        ["iptables", "-w", operation]
            .iter()
            .map(|s| (*s).to_owned())
            .chain(self.rule.iter().cloned())
            .collect()
    }

    async fn iptables(&self, operation: &str, what: &str) -> Result<()> {
        let out = self
            .netns
            .exec_async(self.command(operation))
            .await
            .context(what.to_owned())?;
        if !out.status.success() {
            bail!("{what}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// Makes the API server reachable again.
    pub async fn end(mut self) -> Result<()> {
        self.iptables("--delete", "ending the API server outage")
            .await?;
        self.ended = true;
        Ok(())
    }
}

impl Drop for ApiOutage {
    fn drop(&mut self) {
        if !self.ended
            && let Err(e) = self.netns.exec(self.command("--delete"))
        {
            tracing::warn!(error = %e, "ending the API server outage");
        }
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

/// A Service that answers: its plan and its (first) VIP.
pub struct ServedService {
    pub plan: ServicePlan,
    pub vip: IpAddr,
}

/// The lab's Nodes as the API sees them: an InternalIP and a pod CIDR per cluster family.
fn lab_nodes(topology: &Topology, families: ClusterFamilies) -> Result<Vec<LabNode>> {
    topology
        .nodes()
        .iter()
        .map(|node| LabNode::new(node, families))
        .collect::<Result<_, _>>()
        .context("the lab's Nodes")
}

/// The families the API server gave a Service (`spec.ipFamilies`); IPv4 where a server
/// older than dual-stack leaves it out.
fn service_families(service: &Service) -> Result<Vec<IpFamily>> {
    let Some(families) = service.spec.as_ref().and_then(|s| s.ip_families.as_ref()) else {
        return Ok(vec![IpFamily::V4]);
    };
    families
        .iter()
        .map(|name| {
            IpFamily::from_name(name)
                .with_context(|| format!("the Service has the unknown IP family {name:?}"))
        })
        .collect()
}

/// Starts the API server stand-in in the control plane with a Service CIDR per cluster
/// family; it writes the lab's kubeconfig.
async fn start_stand_in(
    cp: &Host,
    families: ClusterFamilies,
    token: &str,
    kubeconfig: &Path,
    logs: &Path,
) -> Result<Component> {
    let api_addr = SocketAddr::from((cp.ip, API_PORT));
    let service_cidrs: Vec<String> = families
        .families()
        .iter()
        .map(|family| match family {
            IpFamily::V4 => addr::SERVICE_CIDR.to_string(),
            IpFamily::V6 => v6::SERVICE_CIDR.to_string(),
        })
        .collect();
    let mut apiserver = Component::start(
        &cp.netns,
        "apiserver",
        &binaries::locate("tandem-apiserver")?,
        &[
            format!("--listen={api_addr}"),
            format!("--token={token}"),
            format!("--kubeconfig-out={}", kubeconfig.display()),
            format!("--service-cluster-ip-range={}", service_cidrs.join(",")),
        ],
        &[],
        logs,
    )?;
    apiserver
        .wait_serving(api_addr, Duration::from_secs(20))
        .await?;
    // It serves before it writes the kubeconfig (renamed into place whole), so a lab that
    // read it at once now and then found no file.
    let written = Instant::now();
    while !kubeconfig.exists() {
        if written.elapsed() > Duration::from_secs(20) {
            bail!(
                "the API server stand-in serves but wrote no {}",
                kubeconfig.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(apiserver)
}

/// The controller's gauge that is 1 while a replica leads (writes), 0 while it stands by.
const LEADER_GAUGE: &str = "tandem_controller_leader_election_master_status";

/// The Prometheus exposition of the controller replica serving metrics on `metrics`.
async fn controller_metrics(metrics: SocketAddr) -> Result<String> {
    let (status, body) = tokio::time::timeout(
        Duration::from_secs(2),
        crate::traffic::http_get(metrics, "/metrics"),
    )
    .await
    .map_err(|_| anyhow!("{metrics}/metrics: no answer within 2 s"))??;
    if status != 200 {
        bail!("{metrics}/metrics: HTTP {status}");
    }
    Ok(body)
}

/// Whether the controller replica serving metrics on `metrics` says it leads.
pub async fn controller_leads(metrics: SocketAddr) -> Result<bool> {
    let body = controller_metrics(metrics).await?;
    leads(&body).with_context(|| format!("{metrics}/metrics has no {LEADER_GAUGE}"))
}

/// The cloud calls the controller replica serving metrics on `metrics` made so far, by
/// operation (`create`, `update`, `put_node_pool`, ...), whatever their outcome.
pub async fn controller_cloud_calls(
    metrics: SocketAddr,
) -> Result<std::collections::BTreeMap<String, u64>> {
    let body = controller_metrics(metrics).await?;
    Ok(cloud_calls(&body))
}

/// The cloud-call counters of an exposition, summed by operation.
fn cloud_calls(exposition: &str) -> std::collections::BTreeMap<String, u64> {
    let mut calls = std::collections::BTreeMap::new();
    for line in exposition.lines() {
        let Some(labels) = line.strip_prefix("tandem_controller_cloud_calls_total{") else {
            continue;
        };
        let operation = labels
            .split("operation=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next());
        let count = line.rsplit(' ').next().and_then(|n| n.parse::<u64>().ok());
        if let (Some(operation), Some(count)) = (operation, count) {
            *calls.entry(operation.to_owned()).or_default() += count;
        }
    }
    calls
}

/// The leader gauge's value in a Prometheus exposition, as a flag.
fn leads(exposition: &str) -> Option<bool> {
    exposition.lines().find_map(|line| {
        let value = line.strip_prefix(LEADER_GAUGE)?.strip_prefix(' ')?;
        Some(value.trim().parse::<f64>().ok()? > 0.0)
    })
}

/// What a node's kernel holds of a node proxy's rules of `family` in `mode` (see
/// [`rules::listing_command`]); empty when there is no table `ip tandem` (`ip6 tandem`).
pub async fn node_rules(node: &Netns, mode: ProxyMode, family: IpFamily) -> Result<String> {
    let out = node
        .exec_async(rules::listing_command(mode, family).iter().copied())
        .await
        .context("listing the node's rules")?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let error = String::from_utf8_lossy(&out.stderr);
    if mode == ProxyMode::Nftables && error.contains("No such file or directory") {
        return Ok(String::new());
    }
    bail!(
        "{}: {error}",
        rules::listing_command(mode, family).join(" ")
    )
}

/// The ingress addresses of a Service's status, in its order.
pub fn ingress_ips(svc: &Service) -> Vec<IpAddr> {
    svc.status
        .iter()
        .filter_map(|s| s.load_balancer.as_ref()?.ingress.as_ref())
        .flatten()
        .filter_map(|i| i.ip.as_deref()?.parse().ok())
        .collect()
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
    fn the_leader_gauge_is_read_from_the_exposition() {
        let exposition = "# HELP tandem_controller_leader_election_master_status 1 while ...\n\
            # TYPE tandem_controller_leader_election_master_status gauge\n\
            tandem_controller_leader_election_master_status 1\n\
            tandem_controller_leader_election_master_status_other 0\n";
        assert_eq!(leads(exposition), Some(true));
        assert_eq!(
            leads("tandem_controller_leader_election_master_status 0\n"),
            Some(false)
        );
        assert_eq!(leads("other_metric 1\n"), None);
    }

    #[test]
    fn cloud_calls_are_summed_by_operation_over_outcomes() {
        let exposition = "# TYPE tandem_controller_cloud_calls_total counter\n\
            tandem_controller_cloud_calls_total{operation=\"update\",outcome=\"success\"} 3\n\
            tandem_controller_cloud_calls_total{operation=\"update\",outcome=\"conflict\"} 1\n\
            tandem_controller_cloud_calls_total{operation=\"put_node_pool\",outcome=\"success\"} 2\n\
            tandem_controller_reconciliations_total 9\n";
        let calls = cloud_calls(exposition);
        assert_eq!(calls.get("update"), Some(&4));
        assert_eq!(calls.get("put_node_pool"), Some(&2));
        assert_eq!(calls.len(), 2);
    }

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
