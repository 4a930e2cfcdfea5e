//! Wiring: Kubernetes client, leader election, watches, the controller, node sync, orphan
//! collection and the HTTP endpoints, all stopped by one cancellation token.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::controller::{self, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::utils::PredicateConfig;
use kube::runtime::watcher::{self, watcher};
use kube_lease_manager::LeaseManagerBuilder;
use prometheus_client::registry::Registry;
use tokio::sync::{broadcast, mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::metrics::{CloudMetrics, Metrics};
use crate::nodes::eligible_backends;
use crate::nodesync::NodePoolKeeper;
use crate::provider::{ClusterId, LoadBalancerProvider, ProviderError};
use crate::ratelimit::SharedTokenBucket;
use crate::reconcile::{Context, ContextParts, error_policy, reconcile};
use crate::registry::{self, DynProvider, Registration, RegistryError};
use crate::spec::{AnnotationKeys, ClassFilter, WithoutNodePorts};
use crate::status::IngressFields;
use crate::triggers::{namespace_fingerprint, reensure_fingerprint};
use crate::{gc, http, nodesync};

pub const CONTROLLER_NAME: &str = "tandem-controller";

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("cloud config file {path}: {source}")]
    CloudConfig {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Provider(#[from] RegistryError),
    #[error("building the cloud provider: {0}")]
    ProviderTask(#[source] tokio::task::JoinError),
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
    #[error("lost leadership: {0}")]
    LostLeadership(String),
    #[error(
        "reading the kube-system Namespace, whose UID tells this cluster's node pool from another's: {0}"
    )]
    ClusterUid(#[source] kube::Error),
    #[error("the node pool: {0}")]
    NodePool(#[source] ProviderError),
}

/// The text of a `--cloud-config` file, for its provider to parse.
pub async fn read_cloud_config(path: &Path) -> Result<String, RuntimeError> {
    tokio::fs::read_to_string(path)
        .await
        .map_err(|source| RuntimeError::CloudConfig {
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

impl LeaderElection {
    /// How long a leader may go without seeing its Lease renewed before it stops leading:
    /// four fifths of the lease duration, so it stops before a standby may take the Lease
    /// (client-go's leader election stops at its renew deadline for the same reason).
    fn renew_deadline(&self) -> Duration {
        self.lease_duration * 4 / 5
    }
}

/// How often a leader reads its Lease back to see that it still holds it.
const LEASE_CHECK_PERIOD: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct Settings {
    pub cluster_id: ClusterId,
    pub classes: ClassFilter,
    pub without_node_ports: WithoutNodePorts,
    pub default_pool: Option<String>,
    /// The registered provider to run with (`--cloud-provider`).
    pub cloud_provider: &'static Registration,
    /// The text of its configuration (`--cloud-config`, or the flags that stand for it).
    pub cloud_config: Option<String>,
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

/// Service changes a leader would reconcile, buffered for a leader that falls behind
/// (one that lags re-reconciles everything from the store).
const SERVICE_CHANGE_BUFFER: usize = 4096;
/// How long a new leader waits for the Namespace cache (pool defaults) before it ensures
/// Services anyway: a ClusterRole from before Namespace pools cannot list them, and must
/// not keep the controller from serving.
const NAMESPACES_READY_TIMEOUT: Duration = Duration::from_secs(10);

/// The watches and caches every replica keeps, leader or standby, so a hand-over starts
/// with warm stores instead of a relist.
struct Watches {
    services: Store<Service>,
    nodes: Store<Node>,
    namespaces: Store<Namespace>,
    /// Services whose re-ensure fingerprint changed (see [`crate::triggers`]).
    service_changes: broadcast::Sender<ObjectRef<Service>>,
    /// Ticks on every node change.
    node_changes: watch::Receiver<u64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Watches {
    fn start(client: &kube::Client, keys: &AnnotationKeys, cancel: &CancellationToken) -> Self {
        let (services, services_writer) = reflector::store::<Service>();
        let (service_changes, _) = broadcast::channel(SERVICE_CHANGE_BUFFER);
        let service_stream = watcher(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect(services_writer)
        .applied_objects()
        .predicate_filter(
            {
                let keys = keys.clone();
                move |svc: &Service| Some(reensure_fingerprint(svc, &keys))
            },
            PredicateConfig::default(),
        );
        let changes = service_changes.clone();
        let services_task = tokio::spawn(drive(service_stream, cancel.clone(), move |svc| {
            // No receiver while standing by: the store is what is kept warm.
            let _ = changes.send(ObjectRef::from_obj(&svc));
        }));
        let (nodes, nodes_writer) = reflector::store::<Node>();
        let (node_tick, node_changes) = watch::channel(0u64);
        let node_stream = watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .reflect(nodes_writer);
        let nodes_task = tokio::spawn(drive(node_stream, cancel.clone(), move |event| {
            if matches!(
                event,
                watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone
            ) {
                node_tick.send_modify(|n| *n = n.wrapping_add(1));
            }
        }));
        // A Namespace naming another address pool re-ensures each of its Services.
        let (namespaces, namespaces_writer) = reflector::store::<Namespace>();
        let namespace_stream = watcher(
            Api::<Namespace>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect(namespaces_writer)
        .applied_objects()
        .predicate_filter(
            {
                let keys = keys.clone();
                move |ns: &Namespace| Some(namespace_fingerprint(ns, &keys))
            },
            PredicateConfig::default(),
        );
        let changes = service_changes.clone();
        let services_of = services.clone();
        let namespaces_task = tokio::spawn(drive(namespace_stream, cancel.clone(), move |ns| {
            // A standby has no subscriber: nothing to wake, so no scan of every Service.
            if changes.receiver_count() == 0 {
                return;
            }
            let name = ns.name_any();
            for svc in services_of.state() {
                if svc.namespace().as_deref() == Some(name.as_str()) {
                    let _ = changes.send(ObjectRef::from_obj(svc.as_ref()));
                }
            }
        }));
        Self {
            services,
            nodes,
            namespaces,
            service_changes,
            node_changes,
            tasks: vec![services_task, nodes_task, namespaces_task],
        }
    }

    async fn stop(self) {
        for task in self.tasks {
            let _ = task.await;
        }
    }

    /// Every Service once (the start-up ensure), then each change; a leader that fell
    /// behind the buffer gets every Service again.
    fn triggers(&self) -> impl futures::Stream<Item = ObjectRef<Service>> + Send + 'static {
        let all = |store: &Store<Service>| -> Vec<ObjectRef<Service>> {
            store
                .state()
                .iter()
                .map(|s| ObjectRef::from_obj(s.as_ref()))
                .collect()
        };
        // Subscribe before the snapshot, so no change falls between the two.
        let receiver = self.service_changes.subscribe();
        let initial = all(&self.services);
        let live = futures::stream::unfold(
            (receiver, self.services.clone()),
            move |(mut receiver, store)| async move {
                let batch = match receiver.recv().await {
                    Ok(changed) => vec![changed],
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        tracing::warn!(missed, "fell behind Service changes; reconciling all");
                        all(&store)
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                };
                Some((batch, (receiver, store)))
            },
        )
        .flat_map(futures::stream::iter);
        futures::stream::iter(initial).chain(live)
    }
}

/// Polls a watch stream until it ends or `cancel`, handing each item to `on_item`.
async fn drive<T, S>(stream: S, cancel: CancellationToken, mut on_item: impl FnMut(T) + Send)
where
    S: futures::Stream<Item = Result<T, watcher::Error>> + Send,
{
    let mut stream = std::pin::pin!(stream);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            item = stream.next() => match item {
                Some(Ok(item)) => on_item(item),
                Some(Err(error)) => tracing::warn!(%error, "watch error"),
                None => return,
            },
        }
    }
}

/// The cloud provider the settings name, built from its configuration, with the shared
/// rate limit and its metrics.
pub async fn cloud_provider(
    settings: &Settings,
    metrics: CloudMetrics,
) -> Result<DynProvider, RuntimeError> {
    let shared = registry::Shared {
        bucket: SharedTokenBucket::new(settings.cloud_rate_per_second, settings.cloud_burst),
        metrics,
        timeout: settings.cloud_timeout,
    };
    let registration = settings.cloud_provider;
    let config = settings.cloud_config.clone();
    // A provider may read the files its configuration names.
    let provider =
        tokio::task::spawn_blocking(move || registration.provider(config.as_deref(), shared))
            .await
            .map_err(RuntimeError::ProviderTask)??;
    tracing::info!(provider = provider.profile().name, "cloud provider");
    Ok(provider)
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
    let provider = cloud_provider(&settings, metrics.cloud.clone()).await?;
    let watch_cancel = cancel.child_token();
    let watches = Watches::start(
        &client,
        &AnnotationKeys::of(provider.profile()),
        &watch_cancel,
    );
    Metrics::register_services(
        &mut registry,
        watches.services.clone(),
        settings.classes.clone(),
    );
    let ready = Arc::new(AtomicBool::new(false));
    let app = http::router(Arc::new(registry), ready.clone());
    let servers = CancellationToken::new();
    let mut server_tasks = Vec::new();
    let mut addrs = vec![settings.metrics_addr];
    if settings.health_addr != settings.metrics_addr {
        addrs.push(settings.health_addr);
    }
    for addr in addrs {
        match tandem_common::http::serve_http(addr, app.clone(), servers.clone()).await {
            Ok(task) => server_tasks.push(task),
            Err(source) => {
                servers.cancel();
                watch_cancel.cancel();
                watches.stop().await;
                return Err(RuntimeError::Bind { addr, source });
            }
        }
    }

    let result = match &settings.leader_election {
        None => {
            ready.store(true, Ordering::Release);
            run_leader(
                client,
                provider,
                &settings,
                &watches,
                metrics,
                cancel.clone(),
            )
            .await
        }
        Some(election) => {
            run_elected(
                client,
                provider,
                &settings,
                election,
                &watches,
                metrics,
                ready.clone(),
                cancel.clone(),
            )
            .await
        }
    };
    watch_cancel.cancel();
    watches.stop().await;
    servers.cancel();
    for task in server_tasks {
        if let Ok(Err(error)) = task.await {
            tracing::warn!(%error, "HTTP server ended with an error");
        }
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn run_elected<P: LoadBalancerProvider>(
    client: kube::Client,
    provider: P,
    settings: &Settings,
    election: &LeaderElection,
    watches: &Watches,
    metrics: Metrics,
    ready: Arc<AtomicBool>,
    cancel: CancellationToken,
) -> Result<(), RuntimeError> {
    let duration = election.lease_duration.as_secs().max(2);
    let manager = LeaseManagerBuilder::new(client.clone(), &election.lease_name)
        .with_namespace(&election.namespace)
        .with_identity(&election.identity)
        .with_duration(duration)
        // Renew halfway through the lease, well before the renew deadline.
        .with_grace((duration / 2).max(1))
        .build()
        .await
        .map_err(RuntimeError::Lease)?;
    let (mut leader, mut lease_task) = manager.watch().await;
    // A standby replica is healthy and ready; it watches and caches, it just does not write.
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
    let client_for_lease = client.clone();
    let work_cancel = cancel.child_token();
    let work = run_leader(
        client,
        provider,
        settings,
        watches,
        metrics,
        work_cancel.clone(),
    );
    let mut work = std::pin::pin!(work);
    let lapsed = renewal_lapsed(
        Api::namespaced(client_for_lease, &election.namespace),
        election,
    );
    let mut lapsed = std::pin::pin!(lapsed);
    let outcome = loop {
        tokio::select! {
            result = &mut work => break result,
            _ = &mut lease_task => break Err(RuntimeError::LeaseTaskEnded),
            reason = &mut lapsed => break Err(RuntimeError::LostLeadership(reason)),
            changed = leader.changed() => match changed {
                Err(_) => break Err(RuntimeError::LeaseTaskEnded),
                Ok(()) if !*leader.borrow_and_update() => break Err(RuntimeError::LostLeadership(
                    "the lease manager saw the Lease taken".to_owned(),
                )),
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

/// Resolves, with the reason, when this leader can no longer be sure it holds the Lease:
/// the last renewal it saw (`renewTime`, written from this replica's own clock) is older
/// than the renew deadline, or the Lease names another holder. The lease manager retries a
/// renewal that fails or hangs (a dropped connection waits for the client's long read
/// timeout) without ever saying the Lease is lost, while a standby takes the Lease once it
/// expires: without this check two replicas led at once after the API server was
/// unreachable for a minute.
async fn renewal_lapsed(leases: Api<Lease>, election: &LeaderElection) -> String {
    let deadline = election.renew_deadline();
    // Leadership was confirmed just now.
    let mut renewed = jiff::Timestamp::now();
    loop {
        tokio::time::sleep(LEASE_CHECK_PERIOD).await;
        match tokio::time::timeout(LEASE_CHECK_PERIOD, leases.get_opt(&election.lease_name)).await {
            Ok(Ok(Some(lease))) => {
                let spec = lease.spec.unwrap_or_default();
                if spec.holder_identity.as_deref() != Some(election.identity.as_str()) {
                    return format!("the Lease is held by {:?}", spec.holder_identity);
                }
                if let Some(MicroTime(time)) = spec.renew_time {
                    renewed = renewed.max(time);
                }
            }
            Ok(Ok(None)) => return "the Lease is gone".to_owned(),
            Ok(Err(error)) => tracing::warn!(%error, "cannot read the Lease"),
            Err(_) => tracing::warn!("reading the Lease timed out"),
        }
        let age = jiff::Timestamp::now().duration_since(renewed);
        if age.as_secs_f64() > deadline.as_secs_f64() {
            return format!(
                "the Lease was last renewed {:.1} s ago, beyond the renew deadline of {} s",
                age.as_secs_f64(),
                deadline.as_secs_f64()
            );
        }
    }
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

/// The ingress fields the API server's version has; a server that does not say is assumed
/// new, and the first status write corrects that.
async fn server_ingress_fields(client: &kube::Client) -> IngressFields {
    match client.apiserver_version().await {
        Ok(info) => {
            let fields = IngressFields::of_version(&info.major, &info.minor);
            tracing::info!(version = %info.git_version, ip_mode = fields.ip_mode, ports = fields.ports, "API server version");
            fields
        }
        Err(error) => {
            tracing::warn!(%error, "cannot read the API server version; assuming the newest status fields");
            IngressFields::ALL
        }
    }
}

/// `leader_election_master_status` is 1 while this lives, however leading ends.
struct LeaderMark(prometheus_client::metrics::gauge::Gauge);

impl LeaderMark {
    fn set(gauge: &prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.set(1);
        Self(gauge.clone())
    }
}

impl Drop for LeaderMark {
    fn drop(&mut self) {
        self.0.set(0);
    }
}

/// Everything only the leader does, on the warm stores. Returns when `cancel` fires.
async fn run_leader<P: LoadBalancerProvider>(
    client: kube::Client,
    provider: P,
    settings: &Settings,
    watches: &Watches,
    metrics: Metrics,
    cancel: CancellationToken,
) -> Result<(), RuntimeError> {
    let leading_since = tokio::time::Instant::now();
    let _leading = LeaderMark::set(&metrics.leader);
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: CONTROLLER_NAME.into(),
            instance: Some(settings.identity.clone()),
        },
    );
    let ingress_fields = server_ingress_fields(&client).await;
    // Reconciles started from outside the watches: node sync's failures, held reads'
    // answers.
    let (retry_tx, retry_rx) = mpsc::unbounded_channel();
    let ctx = Arc::new(Context::new(ContextParts {
        client: client.clone(),
        provider,
        cluster_id: settings.cluster_id.clone(),
        classes: settings.classes.clone(),
        without_node_ports: settings.without_node_ports,
        default_pool: settings.default_pool.clone(),
        nodes: watches.nodes.clone(),
        namespaces: watches.namespaces.clone(),
        recorder,
        metrics,
        resync: settings.resync,
        ingress_fields,
        wake: retry_tx.clone(),
    }));
    // Decisions need complete lists: every LB would look orphaned, every node set new.
    tokio::select! {
        _ = cancel.cancelled() => return Ok(()),
        _ = async {
            gc::wait_ready(&watches.nodes).await;
            gc::wait_ready(&watches.services).await;
            // Without it a start-up ensure could move a Namespace-pool LB to the default pool.
            if tokio::time::timeout(NAMESPACES_READY_TIMEOUT, gc::wait_ready(&watches.namespaces))
                .await
                .is_err()
            {
                tracing::warn!(
                    waited = ?NAMESPACES_READY_TIMEOUT,
                    "Namespaces are not listed yet (RBAC: namespaces get/list/watch); Namespace address pools apply once they are"
                );
            }
        } => {}
    }
    // LBs reference the node pool from their first create: it is claimed (and filled)
    // before any reconcile, and refused when another cluster holds it.
    let pool = match &ctx.node_pool {
        None => None,
        Some(name) => {
            let uid = cluster_uid(&client).await?;
            let mut keeper = NodePoolKeeper::new(name.clone(), settings.cluster_id.clone(), uid);
            let backends = eligible_backends(watches.nodes.state().iter().map(Arc::as_ref));
            keeper
                .claim(&ctx.provider, &backends, &cancel)
                .await
                .map_err(RuntimeError::NodePool)?;
            Some(keeper)
        }
    };
    let node_sync = tokio::spawn(nodesync::run(
        ctx.clone(),
        pool,
        watches.node_changes.clone(),
        watches.services.clone(),
        settings.node_debounce,
        usize::from(settings.concurrency),
        retry_tx,
        cancel.clone(),
    ));
    let orphan_gc = tokio::spawn(gc::run(
        ctx.clone(),
        watches.services.clone(),
        settings.gc_period,
        cancel.clone(),
    ));
    // With warm stores this is the whole hand-over cost on our side: no relist.
    tracing::info!(cluster = %settings.cluster_id, ready_after = ?leading_since.elapsed(), "controller started");
    Controller::for_stream(
        futures::stream::pending::<Result<Service, watcher::Error>>(),
        watches.services.clone(),
    )
    .with_config(controller::Config::default().concurrency(settings.concurrency))
    .reconcile_on(watches.triggers())
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
    Ok(())
}

/// The UID of the `kube-system` Namespace: what tells this cluster from another that was
/// given the same cluster id (see [`crate::provider::TAG_CLUSTER_UID`]).
async fn cluster_uid(client: &kube::Client) -> Result<String, RuntimeError> {
    let namespace = Api::<Namespace>::all(client.clone())
        .get("kube-system")
        .await
        .map_err(RuntimeError::ClusterUid)?;
    Ok(namespace.uid().unwrap_or_default())
}
