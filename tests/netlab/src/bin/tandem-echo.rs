//! Pod echo server and its in-namespace client.
//!
//! `tandem-echo --name POD [--node NODE] [--http-port 8080] [--udp-port 8080]` answers HTTP
//! GETs and UDP datagrams with `{"pod": ..., "client": "ip:port", "node": ...}`.
//! `tandem-echo get URL` and `tandem-echo udp ADDR` are the clients tests run inside
//! namespaces: one line per request, a JSON reply or `error: ...`; exit 1 if any failed.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use anyhow::Context;
use axum::extract::{ConnectInfo, State};
use axum::{Json, Router};
use clap::{Args, Parser, Subcommand};
use tandem_netlab::echo::{
    DEFAULT_ECHO_PORT, ERROR_LINE_PREFIX, EchoReply, MAX_REQUESTS_PER_CALL, READY_LINE,
};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, UdpSocket};

#[derive(Debug, Parser)]
#[command(
    version,
    about,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    client: Option<ClientCommand>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// Pod name to report.
    #[arg(long, env = "TANDEM_ECHO_NAME", required = true)]
    name: Option<String>,
    /// Node name to report.
    #[arg(long, env = "TANDEM_ECHO_NODE")]
    node: Option<String>,
    #[arg(long, env = "TANDEM_ECHO_HTTP_PORT", default_value_t = DEFAULT_ECHO_PORT)]
    http_port: u16,
    #[arg(long, env = "TANDEM_ECHO_UDP_PORT", default_value_t = DEFAULT_ECHO_PORT)]
    udp_port: u16,
}

#[derive(Debug, Subcommand)]
enum ClientCommand {
    /// HTTP GET URL, each request on a new connection.
    Get {
        url: String,
        #[command(flatten)]
        opts: ClientOpts,
    },
    /// Send a datagram to ADDR and print the reply, each request from a new port.
    Udp {
        addr: SocketAddr,
        #[command(flatten)]
        opts: ClientOpts,
    },
}

#[derive(Debug, Args)]
struct ClientOpts {
    /// Per-request timeout.
    #[arg(long, env = "TANDEM_ECHO_TIMEOUT_MS", default_value_t = 2000)]
    timeout_ms: u64,
    /// Number of requests, one after another.
    #[arg(long, env = "TANDEM_ECHO_COUNT", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_REQUESTS_PER_CALL)))]
    count: u32,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the runtime")?;
    match cli.client {
        None => runtime.block_on(serve(cli.serve)),
        Some(client) => {
            let all_ok = runtime.block_on(run_client(client))?;
            if !all_ok {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}

#[derive(Clone)]
struct Identity {
    pod: String,
    node: Option<String>,
}

impl Identity {
    /// The reply names the client as it is, not as the `[::]` socket maps an IPv4 one.
    fn reply(&self, client: SocketAddr) -> EchoReply {
        EchoReply {
            pod: self.pod.clone(),
            client: SocketAddr::new(client.ip().to_canonical(), client.port()),
            node: self.node.clone(),
        }
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let identity = Identity {
        pod: args.name.context("--name is required")?,
        node: args.node,
    };
    // `[::]` takes both families (IPv4 arrives mapped); a namespace without IPv6 has
    // only the IPv4 wildcard.
    let tcp = match TcpListener::bind((Ipv6Addr::UNSPECIFIED, args.http_port)).await {
        Ok(tcp) => tcp,
        Err(_) => TcpListener::bind((Ipv4Addr::UNSPECIFIED, args.http_port))
            .await
            .with_context(|| format!("binding HTTP port {}", args.http_port))?,
    };
    let udp = match UdpSocket::bind((Ipv6Addr::UNSPECIFIED, args.udp_port)).await {
        Ok(udp) => udp,
        Err(_) => UdpSocket::bind((Ipv4Addr::UNSPECIFIED, args.udp_port))
            .await
            .with_context(|| format!("binding UDP port {}", args.udp_port))?,
    };
    let mut stdout = tokio::io::stdout();
    stdout
        .write_all(format!("{READY_LINE}\n").as_bytes())
        .await?;
    stdout.flush().await?;
    tracing::info!(pod = %identity.pod, http = args.http_port, udp = args.udp_port, "echo ready");

    let app = Router::new()
        .fallback(http_echo)
        .with_state(identity.clone());
    let http = axum::serve(tcp, app.into_make_service_with_connect_info::<SocketAddr>());
    tokio::select! {
        res = http => res.context("HTTP server"),
        res = udp_echo(udp, identity) => res,
    }
}

async fn http_echo(
    State(identity): State<Identity>,
    ConnectInfo(client): ConnectInfo<SocketAddr>,
) -> Json<EchoReply> {
    Json(identity.reply(client))
}

async fn udp_echo(socket: UdpSocket, identity: Identity) -> anyhow::Result<()> {
    let mut buf = vec![0u8; 2048];
    loop {
        let (_, client) = socket.recv_from(&mut buf).await.context("UDP receive")?;
        let body = serde_json::to_vec(&identity.reply(client))?;
        if let Err(e) = socket.send_to(&body, client).await {
            // One unreachable client must not stop the server.
            tracing::warn!(%client, error = %e, "UDP reply");
        }
    }
}

/// Runs the requests; whether all succeeded.
async fn run_client(command: ClientCommand) -> anyhow::Result<bool> {
    let mut all_ok = true;
    let mut out = tokio::io::stdout();
    match command {
        ClientCommand::Get { url, opts } => {
            let timeout = Duration::from_millis(opts.timeout_ms);
            tandem_common::install_crypto_provider();
            let client = reqwest::Client::builder()
                .no_proxy()
                .timeout(timeout)
                .connect_timeout(timeout)
                // A new connection per request, so every request is balanced anew.
                .pool_max_idle_per_host(0)
                .build()
                .context("building the HTTP client")?;
            for _ in 0..opts.count {
                let line = match http_once(&client, &url).await {
                    Ok(body) => body,
                    Err(e) => {
                        all_ok = false;
                        format!("{ERROR_LINE_PREFIX}{e:#}")
                    }
                };
                out.write_all(format!("{}\n", line.trim()).as_bytes())
                    .await?;
            }
        }
        ClientCommand::Udp { addr, opts } => {
            let timeout = Duration::from_millis(opts.timeout_ms);
            for _ in 0..opts.count {
                let line = match udp_once(addr, timeout).await {
                    Ok(body) => body,
                    Err(e) => {
                        all_ok = false;
                        format!("{ERROR_LINE_PREFIX}{e:#}")
                    }
                };
                out.write_all(format!("{}\n", line.trim()).as_bytes())
                    .await?;
            }
        }
    }
    out.flush().await?;
    Ok(all_ok)
}

async fn http_once(client: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    let response = client.get(url).send().await?.error_for_status()?;
    let body = response.text().await?;
    // Only echo replies count as answers.
    serde_json::from_str::<EchoReply>(&body)
        .with_context(|| format!("not an echo reply: {body:?}"))?;
    Ok(body)
}

async fn udp_once(addr: SocketAddr, timeout: Duration) -> anyhow::Result<String> {
    let any: IpAddr = match addr {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let socket = UdpSocket::bind((any, 0)).await?;
    socket.connect(addr).await?;
    socket.send(b"ping").await?;
    let mut buf = vec![0u8; 2048];
    let n = tokio::time::timeout(timeout, socket.recv(&mut buf))
        .await
        .with_context(|| format!("no UDP reply from {addr} within {timeout:?}"))??;
    let body = String::from_utf8_lossy(&buf[..n]).into_owned();
    serde_json::from_str::<EchoReply>(&body)
        .with_context(|| format!("not an echo reply: {body:?}"))?;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_valid() {
        Cli::command().debug_assert();
    }

    #[test]
    fn serving_needs_a_name_but_clients_do_not() {
        assert!(Cli::try_parse_from(["tandem-echo"]).is_err());
        let cli = Cli::try_parse_from(["tandem-echo", "--name", "p"]).unwrap();
        assert!(cli.client.is_none());
        assert_eq!(cli.serve.http_port, 8080);
        let cli = Cli::try_parse_from(["tandem-echo", "udp", "1.2.3.4:5", "--count", "3"]).unwrap();
        assert!(matches!(
            cli.client,
            Some(ClientCommand::Udp {
                opts: ClientOpts { count: 3, .. },
                ..
            })
        ));
        assert!(Cli::try_parse_from(["tandem-echo", "get", "http://x/", "--count", "0"]).is_err());
    }
}
