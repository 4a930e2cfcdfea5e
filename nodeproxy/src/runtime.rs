//! Wiring: the Kubernetes client, the watches, a data path and proxier per IP family, the
//! health and metrics servers, all stopped by one cancellation token; and the two other
//! commands, `trace` and `--cleanup`. `trace` observes the cluster and sets up its
//! family's node settings through the same functions as the sync loop, so what it traces
//! is what a sync writes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use kube::Client;
use prometheus_client::registry::Registry;
use tandem_common::{IpFamily, KubeClientError, ProxyMode};
use tandem_proxy_rules::model::NodeConfig;
use tandem_proxy_rules::trace::{Entry, Packet, TraceError, TraceRequest};
use tokio::sync::Notify;
use tokio::task::{JoinError, JoinHandle};
use tokio_util::sync::CancellationToken;

use crate::cli::{Cli, ClusterArgs, Command, NodePortAddressesError, TraceArgs};
use crate::datapath::{self, StartError};
use crate::healthcheck::{self, NodeHealth, ServiceHealthServers};
use crate::metrics::{self, Metrics};
use crate::observe::convert::{self, NodeFacts};
use crate::observe::{self, Observed};
use crate::proxier::{FamilyProxier, Proxier, ProxierConfig};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("--node-name (or NODE_NAME) is required")]
    NoNodeName,
    #[error(transparent)]
    Flags(#[from] NodePortAddressesError),
    #[error(transparent)]
    Client(#[from] KubeClientError),
    #[error("starting the {family} data path")]
    DataPath {
        family: IpFamily,
        #[source]
        source: StartError,
    },
    #[error("removing the rules")]
    Cleanup(#[source] StartError),
    #[error("binding {address}")]
    Bind {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP server failed")]
    Serve(#[source] std::io::Error),
    #[error("a task of the node proxy failed")]
    Task(#[from] JoinError),
    #[error("give the destination port with --dport or --dst IP:PORT")]
    NoDestinationPort,
    #[error("--src {src} and --dst {dst} are of different families")]
    MixedFamilies { src: IpAddr, dst: IpAddr },
    #[error("the watches ended before their first list")]
    WatchesEnded,
    #[error(transparent)]
    Trace(#[from] TraceError),
}

/// The command the flags name.
pub async fn main(cli: Cli) -> Result<(), RuntimeError> {
    match &cli.command {
        Some(Command::Trace(args)) => trace(&cli.cluster, args).await,
        None if cli.proxy.cleanup => {
            datapath::cleanup(cli.proxy.iptables_backend)
                .await
                .map_err(RuntimeError::Cleanup)?;
            tracing::info!("cleanup done");
            Ok(())
        }
        None => run(cli).await,
    }
}

/// The node proxy: a data path per IP family of the cluster, fed by the watches through
/// the sync loop until a shutdown signal or the watches' end.
async fn run(cli: Cli) -> Result<(), RuntimeError> {
    let node_name = node_name(&cli.cluster)?;
    let families = cli.cluster.families()?;
    let client = tandem_common::kube_client(cli.cluster.kubeconfig.as_deref()).await?;
    let node_facts = observe::node_facts(client.clone(), &node_name, &families).await;
    let mut family_proxiers = Vec::new();
    for &family in &families {
        let facts = node_facts.get(&family).copied().unwrap_or_default();
        let node = node_config(&cli.cluster, node_name.clone(), family, facts)?;
        let datapath = datapath::start(
            cli.cluster.proxy_mode,
            cli.proxy.iptables_backend,
            node.clone(),
        )
        .await
        .map_err(|source| RuntimeError::DataPath { family, source })?;
        family_proxiers.push(FamilyProxier::new(node, datapath));
    }

    let shutdown = CancellationToken::new();
    tandem_common::cancel_on_shutdown_signal(shutdown.clone());

    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let sync_period = cli.proxy.sync_period.0;
    // Healthy while syncs keep succeeding; two periods leave room for one slow sync.
    let node_health = Arc::new(NodeHealth::new(sync_period * 2));
    let serves_ipv6 = families.contains(&IpFamily::V6);

    let healthz_address = cli.proxy.healthz_bind_address;
    let healthz = serve(
        SocketAddr::new(
            every_family(healthz_address.ip(), serves_ipv6),
            healthz_address.port(),
        ),
        healthcheck::healthz_router(Arc::clone(&node_health)),
        shutdown.clone(),
    )
    .await?;
    let metrics_server = serve(
        cli.proxy.metrics_bind_address,
        metrics::router(Arc::new(registry)),
        shutdown.clone(),
    )
    .await?;

    let watching = observe(
        &cli.cluster,
        client,
        &node_name,
        &families,
        metrics.clone(),
        shutdown.clone(),
    )
    .await;
    let proxier = Proxier::new(
        ProxierConfig {
            sync_period,
            min_sync_period: cli.proxy.min_sync_period.0,
            drift_check_period: cli.proxy.drift_check_period.0,
        },
        family_proxiers,
        metrics,
        node_health,
        ServiceHealthServers::new(
            every_family(IpAddr::V4(Ipv4Addr::UNSPECIFIED), serves_ipv6),
            shutdown.clone(),
        ),
    );
    proxier
        .run(watching.observed, watching.dirty, shutdown.clone())
        .await;
    // The sync loop also ends when the watches die; make everything else stop too.
    shutdown.cancel();
    watching.task.await?;
    for server in [healthz, metrics_server] {
        server.await?.map_err(RuntimeError::Serve)?;
    }
    tracing::info!("stopped; rules left in place");
    Ok(())
}

/// `trace`: where a packet goes on this node. The cluster is listed as the node proxy
/// lists it, the packet's family's node settings come about as at its start and in every
/// sync, and the rules are the full build the sync loop's drift check compares with.
async fn trace(cluster: &ClusterArgs, args: &TraceArgs) -> Result<(), RuntimeError> {
    let node_name = node_name(cluster)?;
    let port = args.port().ok_or(RuntimeError::NoDestinationPort)?;
    // The proxier of the packet's family is all the trace needs.
    let family = IpFamily::of(args.dst.ip);
    if !family.holds(args.src) {
        return Err(RuntimeError::MixedFamilies {
            src: args.src,
            dst: args.dst.ip,
        });
    }
    let client = tandem_common::kube_client(cluster.kubeconfig.as_deref()).await?;
    let facts = observe::node_facts(client.clone(), &node_name, &[family]).await;
    let started = node_config(
        cluster,
        node_name.clone(),
        family,
        facts.get(&family).copied().unwrap_or_default(),
    )?;

    let shutdown = CancellationToken::new();
    let metrics = Metrics::register(&mut Registry::default());
    let watching = observe(
        cluster,
        client,
        &node_name,
        &[family],
        metrics,
        shutdown.clone(),
    )
    .await;
    let listed = watching.observed.wait_until_listed(&watching.dirty).await;
    shutdown.cancel();
    watching.task.await?;
    if !listed {
        return Err(RuntimeError::WatchesEnded);
    }
    let observed = watching.observed;
    let settings = observed.node_settings();
    let node = settings.applied_to(&started);
    let conversion = observed.joined(family).ok_or(RuntimeError::WatchesEnded)?;
    for skipped in settings.skipped.iter().chain(&conversion.skipped) {
        tracing::warn!(%skipped, "invalid value left out of the rules");
    }

    let local_addrs: Vec<IpAddr> = observed
        .node
        .state()
        .iter()
        .flat_map(|n| convert::node_addresses(n))
        .filter(|ip| family.holds(*ip))
        .collect();
    let mut request = TraceRequest::new(
        Packet {
            src: args.src,
            dst: args.dst.ip,
            protocol: args.protocol.into(),
            dst_port: port,
        },
        if args.from_node {
            Entry::Local
        } else {
            Entry::FromOutside
        },
        local_addrs,
    );
    request.in_interface = args.in_interface.as_ref().map(ToString::to_string);
    let trace = match cluster.proxy_mode {
        ProxyMode::Iptables => tandem_proxy_rules::trace::trace(
            &tandem_proxy_rules::build(&conversion.state, &node),
            &request,
        )?,
        ProxyMode::Nftables => tandem_proxy_rules::nft::trace::trace(
            &tandem_proxy_rules::nft::build(&conversion.state, &node),
            &request,
        )?,
    };
    print!("{trace}");
    // Which endpoints the rules spread over, and why (topology hints, traffic policy).
    for line in tandem_proxy_rules::topology::explain(&conversion.state, &node, &request) {
        println!("endpoints of {line}");
    }
    Ok(())
}

/// The watches `run` and `trace` observe the cluster through.
struct Watching {
    observed: Observed,
    /// Notified whenever a change waits for a sync.
    dirty: Arc<Notify>,
    /// Runs the watches until the shutdown.
    task: JoinHandle<()>,
}

async fn observe(
    cluster: &ClusterArgs,
    client: Client,
    node_name: &str,
    families: &[IpFamily],
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Watching {
    let dirty = Arc::new(Notify::new());
    let service_cidrs = watches_service_cidrs(cluster, &client).await;
    let (observed, watches) = observe::watch(
        client,
        node_name,
        families,
        service_cidrs,
        Arc::clone(&dirty),
        metrics,
        shutdown,
    );
    Watching {
        observed,
        dirty,
        task: tokio::spawn(watches),
    }
}

fn node_name(cluster: &ClusterArgs) -> Result<String, RuntimeError> {
    cluster.node_name.clone().ok_or(RuntimeError::NoNodeName)
}

/// The flags and the node's facts of `family` as a proxier's settings, logged: the node
/// port addresses and the local-traffic detector depend on both.
fn node_config(
    cluster: &ClusterArgs,
    node_name: String,
    family: IpFamily,
    facts: NodeFacts,
) -> Result<NodeConfig, RuntimeError> {
    let node = cluster.node_config(node_name, family, facts)?;
    tracing::info!(
        %family,
        local_detector = ?node.local_detector,
        node_ip = ?node.node_ip,
        node_port_addresses = ?node.node_port_addresses,
        masquerade_all = node.masquerade_all,
        "node settings"
    );
    Ok(node)
}

/// Whether to watch ServiceCIDR objects: only the nftables mode has rules that use the
/// Service CIDRs, and only a server that serves the API has them (1.33 and later; not
/// k3s v1.21, where `--service-cluster-ip-range` stays the source).
async fn watches_service_cidrs(cluster: &ClusterArgs, client: &Client) -> bool {
    if cluster.proxy_mode != ProxyMode::Nftables {
        return false;
    }
    let served = observe::serves_service_cidrs(client).await;
    if served {
        tracing::info!(
            "the API server serves ServiceCIDRs: their CIDRs, followed as they change, replace --service-cluster-ip-range"
        );
    } else {
        tracing::info!(
            "the API server does not serve ServiceCIDRs: the Service CIDRs are --service-cluster-ip-range's"
        );
    }
    served
}

/// `0.0.0.0` as kube-proxy reads it when it serves IPv6 too: every address of both
/// families (Go listens on `[::]`, which takes IPv4 connections as well). Load balancers
/// probe a node's `/healthz` and health-check node ports on its address of each family.
fn every_family(ip: IpAddr, serves_ipv6: bool) -> IpAddr {
    if serves_ipv6 && ip == IpAddr::V4(Ipv4Addr::UNSPECIFIED) {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    } else {
        ip
    }
}

async fn serve(
    address: SocketAddr,
    app: axum::Router,
    shutdown: CancellationToken,
) -> Result<JoinHandle<std::io::Result<()>>, RuntimeError> {
    tandem_common::http::serve_http(address, app, shutdown)
        .await
        .map_err(|source| RuntimeError::Bind { address, source })
}
