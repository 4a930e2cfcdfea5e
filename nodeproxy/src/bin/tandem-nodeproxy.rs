//! `tandem-nodeproxy`: flags and wiring; the work is in the library.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::Parser;
use kube::Client;
use prometheus_client::registry::Registry;
use tandem_common::ProxyMode;
use tandem_nodeproxy::cli::{Cli, ClusterArgs, Command, TraceArgs};
use tandem_nodeproxy::convert;
use tandem_nodeproxy::datapath;
use tandem_nodeproxy::healthcheck::{self, NodeHealth, ServiceHealthServers};
use tandem_nodeproxy::metrics::{self, Metrics};
use tandem_nodeproxy::proxier::{self, Proxier, ProxierConfig};
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

/// The flags and the node's IP, logged: the node port addresses depend on both.
fn node_config(
    cluster: &ClusterArgs,
    node_name: String,
    node_ip: Option<Ipv4Addr>,
) -> anyhow::Result<NodeConfig> {
    let node = cluster.node_config(node_name, node_ip)?;
    tracing::info!(
        node_ip = ?node.node_ip,
        node_port_addresses = ?node.node_port_addresses,
        masquerade_all = node.masquerade_all,
        "node settings"
    );
    Ok(node)
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
    let (observed, watches) = proxier::watch(
        client,
        &node_name,
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
    let conversion = observed.joined();
    for skipped in &conversion.skipped {
        tracing::warn!(%skipped, "invalid value left out of the rules");
    }
    let nodes = observed.node.state();
    let local_addrs: Vec<_> = nodes
        .iter()
        .flat_map(|n| convert::node_addresses(n))
        .collect();
    let node_ip = nodes.iter().find_map(|n| convert::node_primary_ip(n));
    let node = node_config(cluster, node_name, node_ip)?;
    let request = TraceRequest::new(
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
    Ok(())
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let node_name = node_name(&cli.cluster)?;
    let client = client(&cli.cluster).await?;
    let node_ip = proxier::node_ip(client.clone(), &node_name).await;
    let node = node_config(&cli.cluster, node_name, node_ip)?;
    let datapath = datapath::start(
        cli.cluster.proxy_mode,
        cli.proxy.iptables_backend,
        node.clone(),
    )
    .await
    .context("starting the data path")?;

    let shutdown = CancellationToken::new();
    tandem_common::cancel_on_shutdown_signal(shutdown.clone());

    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let sync_period = cli.proxy.sync_period.0;
    // Healthy while syncs keep succeeding; two periods leave room for one slow sync.
    let node_health = Arc::new(NodeHealth::new(sync_period * 2));

    let healthz = serve(
        cli.proxy.healthz_bind_address,
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
    let (observed, watches) = proxier::watch(
        client,
        &node.node_name,
        Arc::clone(&dirty),
        metrics.clone(),
        shutdown.clone(),
    );
    let watching = tokio::spawn(watches);
    let proxier = Proxier::new(
        ProxierConfig {
            node,
            sync_period,
            min_sync_period: cli.proxy.min_sync_period.0,
        },
        datapath,
        metrics,
        node_health,
        ServiceHealthServers::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), shutdown.clone()),
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

async fn serve(
    address: SocketAddr,
    app: axum::Router,
    shutdown: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<std::io::Result<()>>> {
    tandem_common::http::serve_http(address, app, shutdown)
        .await
        .with_context(|| format!("binding {address}"))
}
