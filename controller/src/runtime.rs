//! Wiring: Kubernetes client, leader election, watches, the controller, node sync, orphan
//! collection and the HTTP endpoints, all stopped by one cancellation token.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector;
use kube::runtime::utils::PredicateConfig;
use kube::runtime::watcher::{self, watcher};
use kube_lease_manager::LeaseManagerBuilder;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::metrics::{CloudMetrics, Metrics};
use crate::mockcloud::MockCloudProvider;
use crate::predicate::reensure_fingerprint;
use crate::provider::{ClusterId, LoadBalancerProvider};
use crate::ratelimit::SharedTokenBucket;
use crate::reconcile::{Context, error_policy, reconcile};
use crate::spec::ClassFilter;
use crate::{gc, http, nodesync};

pub const CONTROLLER_NAME: &str = "tandem-controller";

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("cloud token file {path}: {source}")]
    TokenFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cloud client: {0}")]
    Cloud(#[source] cloud_mock_sdk::Error),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("leader election: {0}")]
    Lease(#[source] kube_lease_manager::LeaseManagerError),
    #[error("the leader-election task ended unexpectedly")]
    LeaseTaskEnded,
    #[error("lost leadership")]
    LostLeadership,
}

pub async fn read_token(path: &Path) -> Result<String, RuntimeError> {
    tokio::fs::read_to_string(path)
        .await
        .map(|t| t.trim().to_owned())
        .map_err(|source| RuntimeError::TokenFile {
            path: path.display().to_string(),
            source,
        })
}

#[derive(Debug, Clone)]
pub struct LeaderElection {
    pub namespace: String,
    pub lease_name: String,
    pub identity: String,
    pub lease_duration: Duration,
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub cluster_id: ClusterId,
    pub classes: ClassFilter,
    pub cloud_url: String,
    pub cloud_token: String,
    pub cloud_timeout: Duration,
    pub cloud_rate_per_second: f64,
    pub cloud_burst: u32,
    pub leader_election: Option<LeaderElection>,
    pub metrics_addr: SocketAddr,
    pub health_addr: SocketAddr,
    pub concurrency: u16,
    pub resync: Duration,
    pub gc_period: Duration,
    pub node_debounce: Duration,
    pub identity: String,
}

/// The cloud provider the settings name, with the shared rate limit and its metrics.
pub fn cloud_provider(
    settings: &Settings,
    metrics: CloudMetrics,
) -> Result<MockCloudProvider, RuntimeError> {
    let sdk_client = cloud_mock_sdk::Client::new(
        &settings.cloud_url,
        settings.cloud_token.clone(),
        MockCloudProvider::client_options(settings.cloud_timeout),
    )
    .map_err(RuntimeError::Cloud)?;
    let bucket = SharedTokenBucket::new(settings.cloud_rate_per_second, settings.cloud_burst);
    Ok(MockCloudProvider::new(sdk_client, bucket, metrics))
}

/// Runs until `cancel` (clean shutdown, `Ok`) or until leadership is lost or the lease task
/// dies (`Err`: the process should exit so a fresh replica takes over).
pub async fn run(
    client: kube::Client,
    settings: Settings,
    cancel: CancellationToken,
) -> Result<(), RuntimeError> {
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let ready = Arc::new(AtomicBool::new(false));
    let app = http::router(Arc::new(registry), ready.clone());
    let servers = CancellationToken::new();
    let mut server_tasks = Vec::new();
    let mut addrs = vec![settings.metrics_addr];
    if settings.health_addr != settings.metrics_addr {
        addrs.push(settings.health_addr);
    }
    for addr in addrs {
        let task = tandem_common::http::serve_http(addr, app.clone(), servers.clone())
            .await
            .map_err(|source| RuntimeError::Bind { addr, source })?;
        server_tasks.push(task);
    }

    let provider = cloud_provider(&settings, metrics.cloud.clone())?;

    let result = match &settings.leader_election {
        None => {
            ready.store(true, Ordering::Release);
            run_leader(
                client,
                provider,
                &settings,
                metrics,
                ready.clone(),
                cancel.clone(),
            )
            .await;
            Ok(())
        }
        Some(election) => {
            run_elected(
                client,
                provider,
                &settings,
                election,
                metrics,
                ready.clone(),
                cancel.clone(),
            )
            .await
        }
    };
    servers.cancel();
    for task in server_tasks {
        if let Ok(Err(error)) = task.await {
            tracing::warn!(%error, "HTTP server ended with an error");
        }
    }
    result
}

async fn run_elected<P: LoadBalancerProvider>(
    client: kube::Client,
    provider: P,
    settings: &Settings,
    election: &LeaderElection,
    metrics: Metrics,
    ready: Arc<AtomicBool>,
    cancel: CancellationToken,
) -> Result<(), RuntimeError> {
    let duration = election.lease_duration.as_secs().max(2);
    let manager = LeaseManagerBuilder::new(client.clone(), &election.lease_name)
        .with_namespace(&election.namespace)
        .with_identity(&election.identity)
        .with_duration(duration)
        .with_grace((duration / 3).max(1))
        .build()
        .await
        .map_err(RuntimeError::Lease)?;
    let (mut leader, mut lease_task) = manager.watch().await;
    // A standby replica is healthy and ready; it just does not write.
    ready.store(true, Ordering::Release);
    tracing::info!(identity = %election.identity, lease = %election.lease_name, "waiting for leadership");
    loop {
        if *leader.borrow_and_update() {
            break;
        }
        tokio::select! {
            _ = cancel.cancelled() => return release(leader, lease_task).await,
            changed = leader.changed() => if changed.is_err() { return Err(RuntimeError::LeaseTaskEnded) },
            _ = &mut lease_task => return Err(RuntimeError::LeaseTaskEnded),
        }
    }
    tracing::info!(identity = %election.identity, "acquired leadership");
    let work_cancel = cancel.child_token();
    let work = run_leader(
        client,
        provider,
        settings,
        metrics,
        ready,
        work_cancel.clone(),
    );
    let mut work = std::pin::pin!(work);
    let outcome = loop {
        tokio::select! {
            _ = &mut work => break Ok(()),
            _ = &mut lease_task => break Err(RuntimeError::LeaseTaskEnded),
            changed = leader.changed() => match changed {
                Err(_) => break Err(RuntimeError::LeaseTaskEnded),
                Ok(()) if !*leader.borrow_and_update() => break Err(RuntimeError::LostLeadership),
                Ok(()) => {}
            },
        }
    };
    if outcome.is_err() {
        // Stop writing at once; the controller tasks see the token and wind down.
        work_cancel.cancel();
        return outcome;
    }
    release(leader, lease_task).await
}

/// Dropping the receiver makes the lease task release the lease, so a standby replica
/// takes over without waiting for expiry.
async fn release(
    leader: tokio::sync::watch::Receiver<bool>,
    lease_task: tokio::task::JoinHandle<
        kube_lease_manager::Result<kube_lease_manager::LeaseManager>,
    >,
) -> Result<(), RuntimeError> {
    drop(leader);
    match tokio::time::timeout(Duration::from_secs(5), lease_task).await {
        Ok(Ok(Ok(_))) => tracing::info!("released leadership"),
        Ok(Ok(Err(error))) => tracing::warn!(%error, "cannot release the lease"),
        Ok(Err(error)) => tracing::warn!(%error, "lease task failed"),
        Err(_) => tracing::warn!("timed out releasing the lease"),
    }
    Ok(())
}

/// Everything only the leader does. Returns when `cancel` fires.
async fn run_leader<P: LoadBalancerProvider>(
    client: kube::Client,
    provider: P,
    settings: &Settings,
    metrics: Metrics,
    ready: Arc<AtomicBool>,
    cancel: CancellationToken,
) {
    let (nodes, nodes_writer) = reflector::store::<Node>();
    let node_events = watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(nodes_writer);
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: CONTROLLER_NAME.into(),
            instance: Some(settings.identity.clone()),
        },
    );
    let ctx = Arc::new(Context::new(
        client.clone(),
        provider,
        settings.cluster_id.clone(),
        settings.classes.clone(),
        nodes.clone(),
        recorder,
        metrics,
        settings.resync,
    ));
    let (services, services_writer) = reflector::store::<Service>();
    let (retry_tx, retry_rx) = mpsc::unbounded_channel();
    let node_sync = tokio::spawn(nodesync::run(
        ctx.clone(),
        node_events,
        services.clone(),
        settings.node_debounce,
        usize::from(settings.concurrency),
        retry_tx,
        cancel.clone(),
    ));
    tokio::select! {
        _ = cancel.cancelled() => {
            let _ = node_sync.await;
            return;
        }
        _ = gc::wait_ready(&nodes) => {}
    }
    let orphan_gc = tokio::spawn(gc::run(
        ctx.clone(),
        services.clone(),
        settings.gc_period,
        cancel.clone(),
    ));
    let service_events = watcher(
        Api::<Service>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(services_writer)
    .applied_objects()
    .predicate_filter(
        |svc: &Service| Some(reensure_fingerprint(svc)),
        PredicateConfig::default(),
    );
    ready.store(true, Ordering::Release);
    tracing::info!(cluster = %settings.cluster_id, "controller started");
    Controller::for_stream(service_events, services)
        .with_config(controller::Config::default().concurrency(settings.concurrency))
        .reconcile_on(futures::stream::unfold(retry_rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        }))
        .graceful_shutdown_on(cancel.clone().cancelled_owned())
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "controller event");
            }
        })
        .await;
    cancel.cancel();
    let _ = node_sync.await;
    let _ = orphan_gc.await;
    tracing::info!("controller stopped");
}
