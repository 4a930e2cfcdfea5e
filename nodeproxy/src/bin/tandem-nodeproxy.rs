//! `tandem-nodeproxy`: flags and wiring; the work is in the library.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::Parser;
use kube::Client;
use prometheus_client::registry::Registry;
use tandem_common::IpFamily;
use tandem_common::ProxyMode;
use tandem_nodeproxy::cli::{Cli, ClusterArgs, Command, TraceArgs};
use tandem_nodeproxy::convert::{self, NodeFacts};
use tandem_nodeproxy::datapath;
use tandem_nodeproxy::healthcheck::{self, NodeHealth, ServiceHealthServers};
use tandem_nodeproxy::metrics::{self, Metrics};
use tandem_nodeproxy::proxier::{self, FamilyProxier, Proxier, ProxierConfig};
use tandem_proxy_rules::model::NodeConfig;
use tandem_proxy_rules::trace::{Entry, Packet, TraceRequest};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tandem_common::init_logging(cli.log_format);
    match &cli.command {
        Some(Command::Trace(args)) => trace(&cli.cluster, args).await,
        None if cli.proxy.cleanup => cleanup(&cli).await,
        None => run(cli).await,
    }
}

async fn client(cluster: &ClusterArgs) -> anyhow::Result<Client> {
    Ok(tandem_common::kube_client(cluster.kubeconfig.as_deref()).await?)
}

fn node_name(cluster: &ClusterArgs) -> anyhow::Result<String> {
    let Some(node_name) = cluster.node_name.clone() else {
        bail!("--node-name (or NODE_NAME) is required");
    };
    Ok(node_name)
}

/// The flags and the node's IP of `family`, logged: the node port addresses depend on
/// both.
fn node_config(
    cluster: &ClusterArgs,
    node_name: String,
    family: IpFamily,
    facts: NodeFacts,
) -> anyhow::Result<NodeConfig> {
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
    let served = proxier::serves_service_cidrs(client).await;
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

async fn cleanup(cli: &Cli) -> anyhow::Result<()> {
    datapath::cleanup(cli.proxy.iptables_backend).await?;
    tracing::info!("cleanup done");
    Ok(())
}

async fn trace(cluster: &ClusterArgs, args: &TraceArgs) -> anyhow::Result<()> {
    let node_name = node_name(cluster)?;
    let Some(port) = args.port() else {
        bail!("give the destination port with --dport or --dst IP:PORT");
    };
    let client = client(cluster).await?;
    let shutdown = CancellationToken::new();
    let dirty = Arc::new(Notify::new());
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    // The proxier of the packet's family is all the trace needs.
    let family = IpFamily::of(args.dst.ip);
    if !family.holds(args.src) {
        bail!(
            "--src {} and --dst {} are of different families",
            args.src,
            args.dst.ip
        );
    }
    let service_cidrs = watches_service_cidrs(cluster, &client).await;
    let (observed, watches) = proxier::watch(
        client,
        &node_name,
        &[family],
        service_cidrs,
        Arc::clone(&dirty),
        metrics,
        shutdown.clone(),
    );
    let watching = tokio::spawn(watches);
    if !observed.wait_until_listed(&dirty).await {
        bail!("the watches ended before their first list");
    }
    shutdown.cancel();
    watching.await?;
    let conversion = observed
        .joined(family)
        .with_context(|| format!("the {family} family is watched"))?;
    for skipped in &conversion.skipped {
        tracing::warn!(%skipped, "invalid value left out of the rules");
    }
    let nodes = observed.node.state();
    let local_addrs: Vec<IpAddr> = nodes
        .iter()
        .flat_map(|n| convert::node_addresses(n))
        .filter(|ip| family.holds(*ip))
        .collect();
    let facts = nodes
        .iter()
        .map(|n| NodeFacts::of(n, family))
        .next()
        .unwrap_or_default();
    let mut node = node_config(cluster, node_name, family, facts)?;
    node.zone = observed.node_zone();
    if let Some((cidrs, skipped)) = observed.service_cidrs() {
        for skipped in &skipped {
            tracing::warn!(%skipped, "invalid value left out of the rules");
        }
        node.service_cidrs = tandem_proxy_rules::model::service_cidrs_of(family, cidrs);
    }
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

async fn run(cli: Cli) -> anyhow::Result<()> {
    let node_name = node_name(&cli.cluster)?;
    let families = cli.cluster.families()?;
    let client = client(&cli.cluster).await?;
    let node_facts = proxier::node_facts(client.clone(), &node_name, &families).await;
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
        .with_context(|| format!("starting the {family} data path"))?;
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

    let dirty = Arc::new(Notify::new());
    let service_cidrs = watches_service_cidrs(&cli.cluster, &client).await;
    let (observed, watches) = proxier::watch(
        client,
        &node_name,
        &families,
        service_cidrs,
        Arc::clone(&dirty),
        metrics.clone(),
        shutdown.clone(),
    );
    let watching = tokio::spawn(watches);
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
    proxier.run(observed, dirty, shutdown.clone()).await;
    // The sync loop also ends when the watches die; make everything else stop too.
    shutdown.cancel();
    watching.await?;
    for server in [healthz, metrics_server] {
        server.await?.context("HTTP server failed")?;
    }
    tracing::info!("stopped; rules left in place");
    Ok(())
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
) -> anyhow::Result<tokio::task::JoinHandle<std::io::Result<()>>> {
    tandem_common::http::serve_http(address, app, shutdown)
        .await
        .with_context(|| format!("binding {address}"))
}
