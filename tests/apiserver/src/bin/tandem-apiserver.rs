//! `tandem-apiserver`: the Kubernetes API server stand-in as a process.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tandem_apiserver::{PortRange, ServerConfig, ServiceCidrs, StoreConfig, spawn};
use tandem_common::LogFormat;

/// Kubernetes API server stand-in for the Tandem virtual cluster (HTTPS and plain HTTP on
/// one port, bearer token).
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Address to listen on.
    #[arg(
        long,
        env = "TANDEM_APISERVER_LISTEN",
        default_value = "127.0.0.1:6443"
    )]
    listen: SocketAddr,
    /// Bearer token clients must send.
    #[arg(long, env = "TANDEM_APISERVER_TOKEN")]
    token: String,
    /// Write a kubeconfig for this server here.
    #[arg(long, env = "TANDEM_APISERVER_KUBECONFIG_OUT")]
    kubeconfig_out: Option<PathBuf>,
    /// Address written into the kubeconfig (default: the listen address, or 127.0.0.1).
    #[arg(long, env = "TANDEM_APISERVER_ADVERTISE_ADDRESS")]
    advertise_address: Option<IpAddr>,
    /// CIDR range from which Service cluster IPs are allocated; two, comma-separated, one
    /// per IP family, make a dual-stack cluster (the first is the primary family).
    #[arg(
        long,
        env = "TANDEM_APISERVER_SERVICE_CLUSTER_IP_RANGE",
        default_value = "10.96.0.0/16"
    )]
    service_cluster_ip_range: ServiceCidrs,
    /// Port range for Service node ports.
    #[arg(
        long,
        env = "TANDEM_APISERVER_SERVICE_NODE_PORT_RANGE",
        default_value = "30000-32767"
    )]
    service_node_port_range: PortRange,
    /// Changes kept per resource for resuming watches; older versions get 410 Gone.
    #[arg(
        long,
        env = "TANDEM_APISERVER_WATCH_CACHE_SIZE",
        default_value_t = 1000
    )]
    watch_cache_size: usize,
    /// Seconds between bookmarks on idle watches.
    #[arg(long, env = "TANDEM_APISERVER_BOOKMARK_INTERVAL", default_value_t = 60)]
    bookmark_interval_seconds: u64,
    /// Log format.
    #[arg(
        long,
        env = "TANDEM_APISERVER_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    log_format: LogFormat,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tandem_common::init_logging(args.log_format);
    let config = ServerConfig {
        listen: args.listen,
        token: args.token,
        store: StoreConfig {
            service_cidrs: args.service_cluster_ip_range,
            node_port_range: args.service_node_port_range,
            watch_cache_size: args.watch_cache_size,
        },
        bookmark_interval: Duration::from_secs(args.bookmark_interval_seconds.max(1)),
        advertise_host: args.advertise_address,
    };
    let server = spawn(config)
        .await
        .context("starting the API server stand-in")?;
    if let Some(path) = &args.kubeconfig_out {
        server
            .write_kubeconfig(path)
            .await
            .context("writing the kubeconfig")?;
        tracing::info!(path = %path.display(), "kubeconfig written");
    }
    let signal = tandem_common::shutdown_signal().await;
    tracing::info!(signal, "shutting down");
    server.shutdown().await.context("stopping the server")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_valid() {
        Args::command().debug_assert();
        let args = Args::try_parse_from([
            "tandem-apiserver",
            "--token",
            "t",
            "--service-node-port-range",
            "31000-31010",
        ])
        .unwrap();
        assert_eq!(args.service_node_port_range.to_string(), "31000-31010");
        assert_eq!(args.service_cluster_ip_range.to_string(), "10.96.0.0/16");
    }
}
