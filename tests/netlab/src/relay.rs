//! Bringing an API server that the root namespace reaches into the virtual network.
//!
//! The relay's listening socket is created by a thread that entered the target namespace
//! (a socket stays in the namespace it was made in), while the upstream connections are
//! made by the runtime in the caller's namespace. So a server on the host's 127.0.0.1 or
//! a remote cluster becomes `198.18.0.2:6443` for the controller and node proxies, and no
//! packet is sent from the root namespace into the lab. The components get a kubeconfig
//! pointing at the relay with `tls-server-name` set to the original host, so TLS still
//! verifies against the real server's certificate.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use http::Uri;
use kube::config::Kubeconfig;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::NetlabError;
use crate::netns::Netns;

/// Errors of deriving the in-lab kubeconfig.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("the kubeconfig has no current-context")]
    NoCurrentContext,
    #[error("the kubeconfig has no context {0:?}")]
    UnknownContext(String),
    #[error("the kubeconfig has no cluster {0:?}")]
    UnknownCluster(String),
    #[error("cluster {0:?} has no server")]
    NoServer(String),
    #[error("server URL {server:?} is not usable: {reason}")]
    BadServer { server: String, reason: String },
    #[error("writing kubeconfig {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("serializing kubeconfig: {0}")]
    Serialize(#[from] serde_json::Error),
    #[error(transparent)]
    Lab(#[from] NetlabError),
}

/// Where the relay connects, and the kubeconfig the in-lab components use.
#[derive(Debug, Clone)]
pub struct RelayPlan {
    /// `host:port` of the real API server, as reached from the caller's namespace.
    pub upstream: String,
    /// The original kubeconfig with the current context's cluster pointing at the relay.
    pub kubeconfig: Kubeconfig,
}

/// Rewrites the current context's cluster of `original` to `https?://RELAY` and keeps TLS
/// verifying against the original host (`tls-server-name`, unless one is set already).
pub fn plan_relay(original: &Kubeconfig, relay: SocketAddr) -> Result<RelayPlan, RelayError> {
    let context_name = original
        .current_context
        .clone()
        .ok_or(RelayError::NoCurrentContext)?;
    let cluster_name = original
        .contexts
        .iter()
        .find(|c| c.name == context_name)
        .and_then(|c| c.context.as_ref())
        .map(|c| c.cluster.clone())
        .ok_or_else(|| RelayError::UnknownContext(context_name.clone()))?;
    let mut kubeconfig = original.clone();
    let cluster = kubeconfig
        .clusters
        .iter_mut()
        .find(|c| c.name == cluster_name)
        .and_then(|c| c.cluster.as_mut())
        .ok_or_else(|| RelayError::UnknownCluster(cluster_name.clone()))?;
    let server = cluster
        .server
        .clone()
        .ok_or_else(|| RelayError::NoServer(cluster_name.clone()))?;
    let bad = |reason: &str| RelayError::BadServer {
        server: server.clone(),
        reason: reason.to_owned(),
    };
    let uri: Uri = server
        .parse()
        .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
    let scheme = uri.scheme_str().ok_or_else(|| bad("no scheme"))?.to_owned();
    let host = uri.host().ok_or_else(|| bad("no host"))?.to_owned();
    let port = match (uri.port_u16(), scheme.as_str()) {
        (Some(p), _) => p,
        (None, "https") => 443,
        (None, "http") => 80,
        (None, _) => return Err(bad("scheme is neither http nor https")),
    };
    let path = uri.path().trim_end_matches('/');
    cluster.server = Some(format!("{scheme}://{relay}{path}"));
    if scheme == "https" && cluster.tls_server_name.is_none() {
        cluster.tls_server_name = Some(
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
        );
    }
    // A proxy would be dialled from inside the lab, where it does not exist.
    cluster.proxy_url = None;
    Ok(RelayPlan {
        upstream: format!("{host}:{port}"),
        kubeconfig,
    })
}

/// Writes a kubeconfig as JSON (a subset of YAML that kubectl and kube-rs read).
pub fn write_kubeconfig(path: &Path, kubeconfig: &Kubeconfig) -> Result<(), RelayError> {
    let text = serde_json::to_string_pretty(kubeconfig)?;
    std::fs::write(path, text).map_err(|source| RelayError::Write {
        path: path.display().to_string(),
        source,
    })
}

/// An API server made reachable inside a topology.
#[derive(Debug)]
pub struct ApiBridge {
    pub relay: Relay,
    /// The kubeconfig for components inside the lab (controller, node proxies).
    pub kubeconfig: Kubeconfig,
    /// Where it was written.
    pub kubeconfig_path: PathBuf,
}

/// Relays the API server of `original`'s current context to
/// `198.18.0.2:6443` in the topology's control plane and writes the in-lab kubeconfig to
/// `kubeconfig_path`. Must run inside a Tokio runtime.
pub async fn bridge_api_server(
    topology: &crate::Topology,
    original: &Kubeconfig,
    kubeconfig_path: &Path,
) -> Result<ApiBridge, RelayError> {
    let listen = SocketAddr::from((crate::addr::CONTROL_PLANE_IP, crate::addr::API_RELAY_PORT));
    let plan = plan_relay(original, listen)?;
    write_kubeconfig(kubeconfig_path, &plan.kubeconfig)?;
    let relay = Relay::start(&topology.control_plane().netns, listen, plan.upstream).await?;
    Ok(ApiBridge {
        relay,
        kubeconfig: plan.kubeconfig,
        kubeconfig_path: kubeconfig_path.to_path_buf(),
    })
}

/// A running relay; stops (closing its listener and every relayed connection) on
/// [`Relay::stop`] or drop.
#[derive(Debug)]
pub struct Relay {
    local_addr: SocketAddr,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

impl Relay {
    /// Listens on `listen` inside `netns` and forwards every connection to `upstream`
    /// (`host:port`, resolved and dialled from the caller's namespace). Must run inside a
    /// Tokio runtime.
    pub async fn start(
        netns: &Netns,
        listen: SocketAddr,
        upstream: String,
    ) -> Result<Self, NetlabError> {
        let ns = netns.clone();
        let bound = tokio::task::spawn_blocking(move || {
            ns.run_in_thread(move || std::net::TcpListener::bind(listen))
        })
        .await
        .map_err(|e| NetlabError::Io {
            context: format!("binding the relay in {}", netns.name()),
            source: std::io::Error::other(e),
        })??;
        let io = |context: String| move |source| NetlabError::Io { context, source };
        let std_listener = bound.map_err(io(format!("binding {listen} in {}", netns.name())))?;
        std_listener
            .set_nonblocking(true)
            .map_err(io("making the relay listener non-blocking".into()))?;
        let listener = TcpListener::from_std(std_listener)
            .map_err(io("registering the relay listener".into()))?;
        let local_addr = listener
            .local_addr()
            .map_err(io("reading the relay address".into()))?;
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        tracker.spawn(accept_loop(
            listener,
            upstream.clone(),
            cancel.clone(),
            tracker.clone(),
        ));
        tracing::info!(netns = netns.name(), %local_addr, %upstream, "relay started");
        Ok(Self {
            local_addr,
            cancel,
            tracker,
        })
    }

    /// The address the relay listens on, inside its namespace.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Closes the listener and every relayed connection, and waits until they are gone.
    pub async fn stop(self) {
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: String,
    cancel: CancellationToken,
    tracker: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((inbound, peer)) => {
                let upstream = upstream.clone();
                let cancel = cancel.clone();
                tracker.spawn(async move {
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        result = relay_connection(inbound, &upstream) => {
                            if let Err(e) = result {
                                tracing::debug!(%peer, %upstream, error = %e, "relayed connection ended");
                            }
                        }
                    }
                });
            }
            // Running out of descriptors must not end the relay: the next accept may work.
            Err(e) => {
                tracing::warn!(error = %e, "relay accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

async fn relay_connection(mut inbound: TcpStream, upstream: &str) -> std::io::Result<()> {
    let mut outbound = TcpStream::connect(upstream).await?;
    // Both legs carry many small API requests and watch events.
    inbound.set_nodelay(true)?;
    outbound.set_nodelay(true)?;
    tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kubeconfig(server: &str, tls_server_name: Option<&str>) -> Kubeconfig {
        let text = format!(
            r#"
apiVersion: v1
kind: Config
current-context: lab
contexts:
- name: other
  context: {{cluster: elsewhere, user: u}}
- name: lab
  context: {{cluster: real, user: u}}
clusters:
- name: elsewhere
  cluster: {{server: "https://10.0.0.1:6443"}}
- name: real
  cluster:
    server: "{server}"
    certificate-authority-data: Q0E=
    proxy-url: "http://proxy:3128"
    {tls}
users:
- name: u
  user: {{token: secret-token}}
"#,
            tls = tls_server_name
                .map(|n| format!("tls-server-name: {n}"))
                .unwrap_or_default()
        );
        Kubeconfig::from_yaml(&text).unwrap()
    }

    fn cluster<'a>(k: &'a Kubeconfig, name: &str) -> &'a kube::config::Cluster {
        k.clusters
            .iter()
            .find(|c| c.name == name)
            .unwrap()
            .cluster
            .as_ref()
            .unwrap()
    }

    const RELAY: SocketAddr =
        SocketAddr::new(std::net::IpAddr::V4(crate::addr::CONTROL_PLANE_IP), 6443);

    #[test]
    fn https_servers_keep_verifying_against_their_own_name() {
        let plan = plan_relay(
            &kubeconfig("https://api.example.test:8443/prefix/", None),
            RELAY,
        )
        .unwrap();
        assert_eq!(plan.upstream, "api.example.test:8443");
        let real = cluster(&plan.kubeconfig, "real");
        assert_eq!(
            real.server.as_deref(),
            Some("https://198.18.0.2:6443/prefix")
        );
        assert_eq!(real.tls_server_name.as_deref(), Some("api.example.test"));
        assert_eq!(real.certificate_authority_data.as_deref(), Some("Q0E="));
        assert_eq!(real.proxy_url, None);
        // Other clusters are untouched.
        assert_eq!(
            cluster(&plan.kubeconfig, "elsewhere").server.as_deref(),
            Some("https://10.0.0.1:6443")
        );
    }

    #[test]
    fn default_ports_explicit_server_names_and_plain_http() {
        let plan = plan_relay(&kubeconfig("https://10.1.2.3", Some("kubernetes")), RELAY).unwrap();
        assert_eq!(plan.upstream, "10.1.2.3:443");
        assert_eq!(
            cluster(&plan.kubeconfig, "real").tls_server_name.as_deref(),
            Some("kubernetes")
        );

        let plan = plan_relay(&kubeconfig("http://127.0.0.1:8080", None), RELAY).unwrap();
        assert_eq!(plan.upstream, "127.0.0.1:8080");
        let real = cluster(&plan.kubeconfig, "real");
        assert_eq!(real.server.as_deref(), Some("http://198.18.0.2:6443"));
        assert_eq!(real.tls_server_name, None);
    }

    #[test]
    fn the_written_kubeconfig_reads_back_with_its_token() {
        let plan = plan_relay(&kubeconfig("https://api:6443", None), RELAY).unwrap();
        let dir = std::env::temp_dir().join(format!("netlab-kubeconfig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config");
        write_kubeconfig(&path, &plan.kubeconfig).unwrap();
        let back = Kubeconfig::read_from(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            cluster(&back, "real").server.as_deref(),
            Some("https://198.18.0.2:6443")
        );
        let user = serde_json::to_value(&back.auth_infos[0]).unwrap();
        assert_eq!(user["user"]["token"], "secret-token");
    }

    #[test]
    fn unusable_kubeconfigs_are_clear_errors() {
        let mut k = kubeconfig("https://api:6443", None);
        k.current_context = Some("missing".into());
        assert!(
            matches!(plan_relay(&k, RELAY), Err(RelayError::UnknownContext(c)) if c == "missing")
        );
        k.current_context = None;
        assert!(matches!(
            plan_relay(&k, RELAY),
            Err(RelayError::NoCurrentContext)
        ));
        let k = kubeconfig("api-without-scheme", None);
        assert!(matches!(
            plan_relay(&k, RELAY),
            Err(RelayError::BadServer { .. })
        ));
    }
}
