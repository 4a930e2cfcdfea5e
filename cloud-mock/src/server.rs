//! Wiring: store, data plane, lifecycle task and router, and serving them until shutdown,
//! over plain HTTP or, given a certificate and key, HTTPS only.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use cloud_mock_dataplane::{DataPlane, DataPlaneConfig, L2Config, L2Device};
use prometheus_client::registry::Registry;
use tandem_common::tls::{PeerCertificate, PlainHttp, TlsError, TlsListener};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api::{AppState, router};
use crate::credentials::{Credentials, CredentialsError, TokenSource};
use crate::faults::FaultState;
use crate::l2::L2Owner;
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::pools::VipPools;
use crate::store::{Store, StoreError, StoreSettings};

/// Everything the server needs to start.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The data directory: the embedded store's file, HAProxy's configuration.
    pub data_dir: PathBuf,
    pub store: StoreSettings,
    /// The bearer tokens clients must send.
    pub token: TokenSource,
    pub vip_pools: VipPools,
    pub provisioning_delay: Duration,
    pub dataplane: DataPlaneConfig,
    /// Serve `/v1/admin/faults` and inject the faults it sets (tests and the lab only).
    pub fault_injection: bool,
    /// The L2 announcement mode: the device this edge holds the VIPs it owns on (needs
    /// the etcd store, whose leases decide the owners).
    pub l2: Option<L2Config>,
}

/// The API's certificate chain (server certificate first) and private key, PEM files,
/// and the CAs whose client certificates name a tenant (mutual TLS), if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub client_ca_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("serving HTTP: {0}")]
    Serve(#[source] std::io::Error),
}

/// The API router and the lifecycle task that goes with it (run it with
/// [`Lifecycle::run`], or the API answers but nothing ever becomes active).
pub struct App {
    pub router: Router,
    pub lifecycle: Lifecycle,
    /// The L2 mode's owner of VIPs (run it with [`L2Owner::run`]).
    pub l2: Option<L2Owner>,
}

impl App {
    /// Reads the tokens, opens the store and builds the router; an etcd store is watched,
    /// and a token file re-read, until `cancel`.
    pub async fn new(settings: &Settings, cancel: CancellationToken) -> Result<Self, ServeError> {
        let metrics = Metrics::default();
        let (credentials, token_file) = Credentials::load(&settings.token, &metrics).await?;
        let store = Store::open(
            &settings.store,
            &settings.data_dir,
            settings.vip_pools.clone(),
            cancel.clone(),
        )
        .await?;
        let dataplane = DataPlane::new(settings.dataplane.clone());
        let l2 = match (&settings.l2, &settings.store) {
            (Some(device), StoreSettings::Etcd(etcd)) => Some(L2Owner::new(
                etcd.clone(),
                L2Device::new(device.clone()),
                dataplane.offers(),
            )),
            (Some(_), StoreSettings::Redb) => {
                return Err(StoreError::NeedsEtcd {
                    what: "the L2 mode (--l2-device)",
                }
                .into());
            }
            (None, _) => None,
        };
        if let Some(watch) = token_file {
            tokio::spawn(watch.run(cancel));
        }
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        dataplane.register_metrics(&mut registry);
        let state = AppState {
            store: store.clone(),
            dataplane: dataplane.clone(),
            faults: settings
                .fault_injection
                .then(|| Arc::new(Mutex::new(FaultState::new(Instant::now())))),
            metrics: metrics.clone(),
            registry: Arc::new(registry),
            credentials,
            serves_passthrough: l2.is_none(),
        };
        Ok(Self {
            router: router(state),
            lifecycle: Lifecycle::new(store, dataplane, settings.provisioning_delay, metrics),
            l2,
        })
    }
}

/// Serves the API on `listen` until `cancel` (see [`serve_on`]).
pub async fn serve(
    settings: &Settings,
    listen: SocketAddr,
    tls: Option<&TlsFiles>,
    cancel: CancellationToken,
) -> Result<(), ServeError> {
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: listen,
            source,
        })?;
    serve_on(settings, listener, tls, cancel).await
}

/// Serves the API on `listener` until `cancel`, then stops the lifecycle task and the data
/// plane. With `tls`, every connection must complete a TLS handshake (plain HTTP is closed
/// unanswered); the files are read once, here. Logs the bound address (useful with port 0).
pub async fn serve_on(
    settings: &Settings,
    listener: TcpListener,
    tls: Option<&TlsFiles>,
    cancel: CancellationToken,
) -> Result<(), ServeError> {
    let acceptor = tls
        .map(|files| {
            tandem_common::tls::acceptor_from_pem_files(
                &files.cert_file,
                &files.key_file,
                files.client_ca_file.as_deref(),
            )
        })
        .transpose()?;
    let App {
        router,
        lifecycle,
        l2,
    } = App::new(settings, cancel.clone()).await?;
    let local = listener.local_addr().map_err(ServeError::Serve)?;
    let scheme = if acceptor.is_some() { "https" } else { "http" };
    tracing::info!(
        addr = %local,
        scheme,
        pools = %settings.vip_pools,
        data_dir = %settings.data_dir.display(),
        "cloud-mock listening on {local}"
    );
    let lifecycle_task = tokio::spawn(lifecycle.run(cancel.clone()));
    let l2_task = l2.map(|owner| tokio::spawn(owner.run(cancel.clone())));
    let shutdown = cancel.clone().cancelled_owned();
    let served = match acceptor {
        Some(acceptor) => {
            match TlsListener::new(listener, acceptor, PlainHttp::Refused, cancel.clone()) {
                Ok(listener) => {
                    // Each request learns the client certificate its connection showed.
                    let service = router.into_make_service_with_connect_info::<PeerCertificate>();
                    axum::serve(listener, service)
                        .with_graceful_shutdown(shutdown)
                        .await
                }
                Err(error) => Err(error),
            }
        }
        None => {
            axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
    .map_err(ServeError::Serve);
    cancel.cancel();
    if let Err(error) = lifecycle_task.await {
        tracing::error!(%error, "lifecycle task failed");
    }
    if let Some(task) = l2_task
        && let Err(error) = task.await
    {
        tracing::error!(%error, "L2 ownership task failed");
    }
    served
}
