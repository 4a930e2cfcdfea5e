//! Kubernetes API server stand-in for the Tandem virtual cluster.
//!
//! It serves the subset of the Kubernetes API that Tandem's components use, with the real
//! server's semantics: core/v1 namespaces, services (+status), nodes (+status) and events;
//! discovery.k8s.io/v1 endpointslices (and their v1beta1 view, for kube-proxy v1.21);
//! events.k8s.io/v1 events (a second view of the same
//! Events); coordination.k8s.io/v1 leases; networking.k8s.io/v1 servicecidrs (+status; see
//! [`service_cidr`] for what the stand-in leaves out). One global resourceVersion, list + watch with
//! bookmarks and `410 Gone` after compaction, label/field selectors, `limit`/`continue`,
//! optimistic concurrency, merge / JSON / strategic-merge patches (and a simple
//! server-side apply), status subresources, finalizers, Service defaulting, allocation and
//! validation, and Table responses so `kubectl get` prints as on a real cluster.
//!
//! # Transport
//!
//! One port speaks both plain HTTP and TLS (the first byte of a connection decides).
//! Kubeconfigs name `https://` with a CA generated at start-up, because kubectl (client-go)
//! only sends bearer tokens over TLS; [`RunningServer::url`] is the plain-HTTP address for
//! clients without TLS (the workspace's reqwest, curl). Every request needs the bearer
//! token except `/healthz`, `/livez` and `/readyz`; without it the answer is a 401 Status.
//!
//! Objects are created only in existing namespaces (404 otherwise, as on a real cluster);
//! `default`, `kube-system`, `kube-public` and `kube-node-lease` exist from the start, and,
//! as on kube-apiserver 1.33+, the default ServiceCIDR `kubernetes` with its Service CIDRs.
//!
//! # Running it in-process (tests of other crates)
//!
//! ```no_run
//! # async fn demo() -> Result<(), tandem_apiserver::Error> {
//! use tandem_apiserver::{ServerConfig, spawn};
//!
//! let server = spawn(ServerConfig::default()).await?; // binds 127.0.0.1:0
//! let client: kube::Client = server.client().await?;
//! // ... use `client`, or hand `server.kubeconfig()` to code under test ...
//! server.compact_history()?; // the next resumed watch gets 410 Gone and relists
//! server.shutdown().await?;
//! # Ok(()) }
//! ```
//!
//! The binary `tandem-apiserver` wraps the same server with flags named as kube-apiserver's
//! (`--listen`, `--token`, `--kubeconfig-out`, `--service-cluster-ip-range`,
//! `--service-node-port-range`, `--watch-cache-size`). `POST /_tandem/compact` (with the
//! token; not part of the Kubernetes API) forces compaction from outside the process.
//! Dropping a [`RunningServer`] stops it too.
//!
//! # Limits
//!
//! Request bodies are JSON, or protobuf for every served kind (what client-go's typed
//! clients send: kubectl's imperative commands such as `kubectl create service`, a
//! kubelet; see [`protobuf`]); CBOR gets 415. `dryRun=All` works for
//! create, update, patch and delete: the write runs against a scratch copy of the store.
//! Server-side apply records no managedFields and never conflicts. State lives in memory
//! only.

pub mod api;
pub mod discovery;
pub mod endpoint_slice_v1beta1;
pub mod events;
pub mod patch;
pub mod protobuf;
pub mod resources;
pub mod selector;
pub mod service;
pub mod service_cidr;
pub mod status;
pub mod store;
pub mod table;
pub mod tls;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use kube::config::Kubeconfig;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use service::{PortRange, ServiceCidrs};
pub use status::ApiError;
pub use store::{Store, StoreConfig};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("building the kubeconfig: {0}")]
    Kubeconfig(#[source] serde_json::Error),
    #[error("writing the kubeconfig to {path}: {source}")]
    WriteKubeconfig {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Client(#[from] tandem_common::KubeClientError),
    #[error("store: {0}")]
    Store(#[from] ApiError),
    #[error("serving HTTP: {0}")]
    Serve(#[source] std::io::Error),
    #[error("TLS: {0}")]
    Tls(#[from] tls::TlsError),
    #[error("server task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
}

/// How to run the server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to bind; port 0 picks a free one.
    pub listen: SocketAddr,
    /// The bearer token every request must carry.
    pub token: String,
    pub store: StoreConfig,
    /// How often idle watches that asked for bookmarks get one.
    pub bookmark_interval: Duration,
    /// Host written into kubeconfigs and `/api`; defaults to the bound address (127.0.0.1
    /// when bound to an unspecified address).
    pub advertise_host: Option<IpAddr>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            token: format!("tandem-{}", uuid::Uuid::new_v4().simple()),
            store: StoreConfig::default(),
            bookmark_interval: Duration::from_secs(60),
            advertise_host: None,
        }
    }
}

/// A server running on the current tokio runtime.
pub struct RunningServer {
    addr: SocketAddr,
    advertised: SocketAddr,
    token: String,
    ca_pem: String,
    store: Arc<Store>,
    shutdown: CancellationToken,
    /// Taken by `wait`; `None` afterwards.
    task: Option<JoinHandle<std::io::Result<()>>>,
}

/// Binds `config.listen` and serves until the server is shut down.
pub async fn spawn(config: ServerConfig) -> Result<RunningServer, Error> {
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| Error::Bind {
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| Error::Bind {
        addr: config.listen,
        source,
    })?;
    let host = config
        .advertise_host
        .unwrap_or(if addr.ip().is_unspecified() {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        } else {
            addr.ip()
        });
    let advertised = SocketAddr::new(host, addr.port());
    let mut san_ips = vec![IpAddr::V4(Ipv4Addr::LOCALHOST), host];
    if !addr.ip().is_unspecified() {
        san_ips.push(addr.ip());
    }
    let identity = tls::generate(&san_ips)?;
    let store = Arc::new(Store::new(&config.store));
    let shutdown = CancellationToken::new();
    let listener = tls::DualListener::new(listener, identity.acceptor.clone(), shutdown.clone())
        .map_err(|source| Error::Bind {
            addr: config.listen,
            source,
        })?;
    let state = Arc::new(api::AppState {
        store: store.clone(),
        token: config.token.clone(),
        shutdown: shutdown.clone(),
        bookmark_interval: config.bookmark_interval,
        server_address: advertised.to_string(),
    });
    let app = api::router(state);
    let stop = shutdown.clone();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
    });
    tracing::info!(%addr, "API server stand-in listening");
    Ok(RunningServer {
        addr,
        advertised,
        token: config.token,
        ca_pem: identity.ca_pem,
        store,
        shutdown,
        task: Some(task),
    })
}

impl RunningServer {
    /// `http://host:port`: plain HTTP, for clients without TLS.
    pub fn url(&self) -> String {
        format!("http://{}", self.advertised)
    }

    /// `https://host:port`: the same port over TLS (what kubeconfigs name, since kubectl
    /// sends bearer tokens only over https).
    pub fn https_url(&self) -> String {
        format!("https://{}", self.advertised)
    }

    /// PEM of the CA that signed the serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    /// The in-memory store, for tests that inspect state directly.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// A kubeconfig (JSON, hence valid YAML) for kube-rs and `kubectl --kubeconfig`.
    pub fn kubeconfig_json(&self) -> Value {
        kubeconfig_document(&self.https_url(), &self.token, Some(&self.ca_pem))
    }

    pub fn kubeconfig(&self) -> Result<Kubeconfig, Error> {
        serde_json::from_value(self.kubeconfig_json()).map_err(Error::Kubeconfig)
    }

    /// Writes the kubeconfig to `path`, atomically (a temporary file renamed into place), so
    /// a process polling for the file never reads half of it.
    pub async fn write_kubeconfig(&self, path: &std::path::Path) -> Result<(), Error> {
        let text =
            serde_json::to_string_pretty(&self.kubeconfig_json()).map_err(Error::Kubeconfig)?;
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = std::path::PathBuf::from(partial);
        let error = |source| Error::WriteKubeconfig {
            path: path.to_path_buf(),
            source,
        };
        tokio::fs::write(&partial, text).await.map_err(error)?;
        tokio::fs::rename(&partial, path).await.map_err(error)
    }

    /// A kube client for this server, built from its kubeconfig.
    pub async fn client(&self) -> Result<kube::Client, Error> {
        Ok(tandem_common::client_from_kubeconfig(self.kubeconfig()?).await?)
    }

    /// Drops all watch history and ends open watches: clients resuming from an older
    /// resourceVersion get 410 Gone. Returns the resourceVersion history now starts at.
    pub fn compact_history(&self) -> Result<u64, Error> {
        Ok(self.store.compact()?)
    }

    /// The token that stops the server; cancel it to stop from elsewhere.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops accepting requests, ends open watches, and waits for the server task.
    pub async fn shutdown(self) -> Result<(), Error> {
        self.shutdown.cancel();
        self.wait().await
    }

    /// Waits until the server stops (after its cancellation token is cancelled).
    pub async fn wait(mut self) -> Result<(), Error> {
        match self.task.take() {
            Some(task) => task.await?.map_err(Error::Serve),
            None => Ok(()),
        }
    }
}

/// Dropping the handle stops the server, so a test that panics leaves nothing listening.
impl Drop for RunningServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The kubeconfig document for a server URL, token and (for https) the CA to trust.
pub fn kubeconfig_document(url: &str, token: &str, ca_pem: Option<&str>) -> Value {
    let mut cluster = json!({"server": url});
    if let (Some(pem), Some(map)) = (ca_pem, cluster.as_object_mut()) {
        map.insert(
            "certificate-authority-data".into(),
            json!(data_encoding::BASE64.encode(pem.as_bytes())),
        );
    }
    json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "tandem", "cluster": cluster}],
        "users": [{"name": "tandem", "user": {"token": token}}],
        "contexts": [{"name": "tandem", "context": {"cluster": "tandem", "user": "tandem", "namespace": "default"}}],
        "current-context": "tandem",
        "preferences": {},
    })
}
