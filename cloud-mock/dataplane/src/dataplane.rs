//! The handle the API server drives: `apply` converges to the desired set.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::{Mutex, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::announce::{AnnounceConfig, Announcer, offered};
use crate::command::{Program, add_address_args, already_gone, delete_address_args};
use crate::config::{DataPlaneConfig, DataPlaneKind};
use crate::error::DataPlaneError;
use crate::failure::{LbFailure, LbFailureReason};
use crate::haproxy::{CheckTiming, Haproxy, proxies};
use crate::health::{HealthTable, ProbeSettings, ProbeTarget, run_checker};
use crate::metrics::Metrics;
use crate::plan::{
    Desired, LbView, ListenerChange, ListenerKey, ListenerRoute, PassthroughRoute, desired_state,
    lb_backend_health, passthrough_probes, plan_listeners, plan_set,
};
use crate::routes::{RouteManager, WantedRoutes};
use crate::tcp::{ListenerContext, serve_tcp};
use crate::udp::{FlowSettings, serve_udp};
use crate::{BackendHealth, LoadBalancer, Protocol};

/// The mock cloud's data plane. Clones share one data plane.
///
/// With `DataPlaneKind::Haproxy` a real HAProxy serves proxy mode (and checks its
/// backends); otherwise proxy mode spreads new TCP connections and new UDP flows round-robin over the backends
/// that are healthy at that moment (all of them when none is: it fails open, as cloud
/// load balancers do); a backend that refuses a TCP connect is skipped for the next one.
#[derive(Clone)]
pub struct DataPlane {
    shared: Arc<Shared>,
}

struct Shared {
    config: DataPlaneConfig,
    ip: Program,
    health: HealthTable,
    metrics: Metrics,
    /// Serves proxy mode with `DataPlaneKind::Haproxy`.
    haproxy: Option<Haproxy>,
    /// What `backend_health` answers from; replaced whole by every `apply`.
    views: RwLock<HashMap<String, LbView>>,
    cancel: CancellationToken,
    running: Mutex<Running>,
    /// The announcer, when VIPs are announced: stopped (withdrawing) first at shutdown.
    announcing: std::sync::Mutex<Option<Announcing>>,
}

struct Announcing {
    cancel: CancellationToken,
    task: JoinHandle<()>,
    drain: Duration,
}

/// How often the set of VIPs this edge can forward is read again (from memory) for the
/// announcer: health changes at the probes' pace, so this adds at most this much to a
/// withdrawal.
const OFFER_INTERVAL: Duration = Duration::from_millis(100);

impl Shared {
    /// Health of each backend of `view`: healthy only if healthy under every distinct
    /// health check of its listeners (no checks: healthy).
    fn view_health(&self, view: &LbView) -> Vec<(IpAddr, BackendHealth)> {
        let haproxy = self.haproxy.as_ref();
        lb_backend_health(view, |target| {
            haproxy
                .and_then(|haproxy| haproxy.health(target))
                .unwrap_or_else(|| self.health.get(target))
        })
    }

    /// The VIPs this edge can forward now.
    fn offered(&self) -> BTreeSet<IpAddr> {
        let views = self.views.read().unwrap_or_else(PoisonError::into_inner);
        offered(views.values(), |view| self.view_health(view))
    }
}

/// Hands `announced` the VIPs `shared` can forward, as they change, until `cancel` (or
/// until the data plane is gone).
async fn offer(
    shared: Weak<Shared>,
    announced: watch::Sender<BTreeSet<IpAddr>>,
    cancel: CancellationToken,
) {
    loop {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let now = shared.offered();
        drop(shared);
        announced.send_if_modified(|current| {
            let changed = *current != now;
            *current = now;
            changed
        });
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(OFFER_INTERVAL) => {}
        }
    }
}

impl Drop for Shared {
    // Dropping the last handle without `shutdown` still frees every socket.
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

#[derive(Default)]
struct Running {
    listeners: BTreeMap<ListenerKey, RunningListener>,
    probes: BTreeMap<ProbeTarget, CancellationToken>,
    probe_tasks: TaskTracker,
    next_generation: u64,
    addresses: BTreeSet<IpAddr>,
    routes: Option<RunningRoutes>,
    shut_down: bool,
}

struct RunningListener {
    route: ListenerRoute,
    updates: watch::Sender<Arc<ListenerRoute>>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

struct RunningRoutes {
    wanted: watch::Sender<WantedRoutes>,
    task: JoinHandle<()>,
}

impl DataPlane {
    pub fn new(config: DataPlaneConfig) -> Self {
        let ip = Program::new(config.ip_program.clone());
        let metrics = Metrics::default();
        let cancel = CancellationToken::new();
        let haproxy = (config.mode == DataPlaneKind::Haproxy).then(|| {
            let timing = CheckTiming {
                interval: config.health_interval,
                timeout: config.health_timeout,
                rise: config.healthy_threshold,
                fall: config.unhealthy_threshold,
            };
            Haproxy::new(
                config.haproxy.clone(),
                timing,
                config.connect_timeout,
                metrics.clone(),
                cancel.child_token(),
            )
        });
        let announce = config.announce.clone();
        let dataplane = Self {
            shared: Arc::new(Shared {
                config,
                ip,
                health: HealthTable::default(),
                metrics,
                haproxy,
                views: RwLock::default(),
                cancel,
                running: Mutex::default(),
                announcing: std::sync::Mutex::default(),
            }),
        };
        if let Some(announce) = announce {
            dataplane.start_announcing(announce);
        }
        dataplane
    }

    /// The VIPs this data plane can forward, as they change (needs a runtime), for an
    /// announcer of the caller's own, such as the L2 mode's owner election.
    pub fn offers(&self) -> watch::Receiver<BTreeSet<IpAddr>> {
        let (offered, offers) = watch::channel(BTreeSet::new());
        tokio::spawn(offer(
            Arc::downgrade(&self.shared),
            offered,
            self.shared.cancel.child_token(),
        ));
        offers
    }

    /// Starts announcing the VIPs this data plane can forward (needs a runtime).
    fn start_announcing(&self, config: AnnounceConfig) {
        let cancel = CancellationToken::new();
        let drain = config.drain;
        let announcer = Announcer::new(config, self.shared.ip.clone());
        let task = tokio::spawn(announcer.run(self.offers(), cancel.clone()));
        *self
            .shared
            .announcing
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Announcing {
            cancel,
            task,
            drain,
        });
    }

    /// The complete desired set; converges idempotently: starts/stops only what changed.
    /// An unchanged listener keeps its socket and connections; a listener whose backends or
    /// source ranges change keeps them too. Load balancers that cannot be realised (port
    /// taken, conflicting VIP) are reported in `DataPlaneError::Incomplete` after everything
    /// else converged; the next `apply` retries them.
    pub async fn apply(&self, desired: Vec<LoadBalancer>) -> Result<(), DataPlaneError> {
        let shared = &self.shared;
        let mut running = shared.running.lock().await;
        if running.shut_down {
            return Err(DataPlaneError::ShutDown);
        }
        let plan = desired_state(&desired, shared.config.manage_vip_addresses);
        if shared.config.mode == DataPlaneKind::None {
            let views = plan
                .views
                .into_iter()
                .map(|(id, view)| {
                    (
                        id,
                        LbView {
                            realised: false,
                            ..view
                        },
                    )
                })
                .collect();
            *shared.views.write().unwrap_or_else(PoisonError::into_inner) = views;
            return Ok(());
        }
        let Desired {
            listeners,
            passthrough,
            probes,
            addresses,
            views,
            rejected,
        } = plan;
        let mut failures = rejected;
        let probes = if shared.haproxy.is_some() {
            passthrough_probes(&passthrough)
        } else {
            probes
        };
        self.converge_probes(&mut running, &probes);
        let unavailable = self
            .add_addresses(&mut running, &addresses, &listeners, &mut failures)
            .await;
        match &shared.haproxy {
            Some(haproxy) => {
                converge_haproxy(haproxy, &listeners, &unavailable, &mut failures).await;
            }
            None => {
                self.converge_listeners(&mut running, &listeners, &unavailable, &mut failures)
                    .await;
            }
        }
        self.remove_addresses(&mut running, &addresses).await;
        self.converge_routes(&mut running, passthrough);
        *shared.views.write().unwrap_or_else(PoisonError::into_inner) = views;
        if failures.is_empty() {
            Ok(())
        } else {
            for failure in &failures {
                warn!(%failure, "load balancer not realised");
            }
            Err(DataPlaneError::Incomplete { failures })
        }
    }

    /// Health of each backend of `lb_id`, in the load balancer's order: healthy only if
    /// healthy under every distinct health check of its listeners (no checks: healthy).
    /// Empty for an unknown id.
    pub fn backend_health(&self, lb_id: &str) -> Vec<(IpAddr, BackendHealth)> {
        let views = self
            .shared
            .views
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        views
            .get(lb_id)
            .map_or_else(Vec::new, |view| self.shared.view_health(view))
    }

    /// Whether proxy-mode load balancers may have UDP listeners (HAProxy serves TCP only).
    pub fn proxies_udp(&self) -> bool {
        self.shared.config.mode.serves_udp()
    }

    pub fn register_metrics(&self, registry: &mut Registry) {
        self.shared.metrics.register(registry);
    }

    /// Withdraws every announced VIP and keeps serving through the drain, then stops
    /// every listener (closing its connections) and probe, removes passthrough routes and
    /// managed VIP addresses, and refuses further `apply`s.
    pub async fn shutdown(&self) {
        let shared = &self.shared;
        let announcing = shared
            .announcing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(announcing) = announcing {
            announcing.cancel.cancel();
            if let Err(error) = announcing.task.await {
                warn!(%error, "announcer task failed");
            }
            info!(drain = ?announcing.drain, "VIPs withdrawn; serving through the drain");
            tokio::time::sleep(announcing.drain).await;
        }
        let mut running = shared.running.lock().await;
        if running.shut_down {
            return;
        }
        running.shut_down = true;
        shared.cancel.cancel();
        if let Some(haproxy) = &shared.haproxy {
            haproxy.shutdown().await;
        }
        for (key, listener) in std::mem::take(&mut running.listeners) {
            if let Err(error) = listener.task.await {
                warn!(vip = %key.vip, port = key.port, %error, "listener task failed");
            }
        }
        running.probes.clear();
        running.probe_tasks.close();
        running.probe_tasks.wait().await;
        if let Some(routes) = running.routes.take()
            && let Err(error) = routes.task.await
        {
            warn!(%error, "route manager task failed");
        }
        self.remove_addresses(&mut running, &BTreeSet::new()).await;
        shared
            .views
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        info!("data plane shut down");
    }

    fn converge_probes(&self, running: &mut Running, desired: &BTreeSet<ProbeTarget>) {
        let shared = &self.shared;
        let current: BTreeSet<ProbeTarget> = running.probes.keys().cloned().collect();
        let (start, stop) = plan_set(&current, desired);
        for target in stop {
            if let Some(cancel) = running.probes.remove(&target) {
                cancel.cancel();
            }
            shared.health.forget(&target);
        }
        let settings = ProbeSettings {
            interval: shared.config.health_interval,
            timeout: shared.config.health_timeout,
            healthy_threshold: shared.config.healthy_threshold,
            unhealthy_threshold: shared.config.unhealthy_threshold,
        };
        for target in start {
            running.next_generation += 1;
            let generation = running.next_generation;
            shared.health.track(target.clone(), generation);
            let cancel = shared.cancel.child_token();
            running.probe_tasks.spawn(run_checker(
                target.clone(),
                generation,
                shared.health.clone(),
                settings,
                shared.metrics.clone(),
                cancel.clone(),
            ));
            running.probes.insert(target, cancel);
        }
    }

    /// Adds the VIP addresses new listeners need; returns the VIPs that could not be added.
    async fn add_addresses(
        &self,
        running: &mut Running,
        desired: &BTreeSet<IpAddr>,
        listeners: &BTreeMap<ListenerKey, ListenerRoute>,
        failures: &mut Vec<LbFailure>,
    ) -> HashSet<IpAddr> {
        let (add, _) = plan_set(&running.addresses, desired);
        let mut unavailable = HashSet::new();
        for vip in add {
            let args = add_address_args(vip, &self.shared.config.vip_device);
            match self.shared.ip.run(&args).await {
                Ok(_) => {
                    info!(%vip, device = %self.shared.config.vip_device, "VIP address added");
                    running.addresses.insert(vip);
                }
                Err(error) => {
                    let lb_ids: BTreeSet<&str> = listeners
                        .iter()
                        .filter(|(key, _)| key.vip == vip)
                        .map(|(_, route)| route.lb_id.as_str())
                        .collect();
                    let message = error.to_string();
                    for lb_id in lb_ids {
                        failures.push(LbFailure {
                            lb_id: lb_id.to_owned(),
                            reason: LbFailureReason::AddVip {
                                vip,
                                detail: message.clone(),
                            },
                        });
                    }
                    unavailable.insert(vip);
                }
            }
        }
        unavailable
    }

    async fn remove_addresses(&self, running: &mut Running, desired: &BTreeSet<IpAddr>) {
        let (_, remove) = plan_set(&running.addresses, desired);
        for vip in remove {
            let args = delete_address_args(vip, &self.shared.config.vip_device);
            match self.shared.ip.run(&args).await {
                Ok(_) => {
                    info!(%vip, "VIP address removed");
                    running.addresses.remove(&vip);
                }
                Err(error) if already_gone(&error) => {
                    running.addresses.remove(&vip);
                }
                // Kept as ours, so the next apply or shutdown retries.
                Err(error) => warn!(%vip, %error, "cannot remove VIP address"),
            }
        }
    }

    async fn converge_listeners(
        &self,
        running: &mut Running,
        desired: &BTreeMap<ListenerKey, ListenerRoute>,
        unavailable: &HashSet<IpAddr>,
        failures: &mut Vec<LbFailure>,
    ) {
        let current: BTreeMap<ListenerKey, ListenerRoute> = running
            .listeners
            .iter()
            .map(|(key, listener)| (*key, listener.route.clone()))
            .collect();
        for change in plan_listeners(&current, desired) {
            match change {
                ListenerChange::Unbind(key) => {
                    if let Some(listener) = running.listeners.remove(&key) {
                        listener.cancel.cancel();
                        // Wait until the socket is closed, so the address can be reused.
                        if let Err(error) = listener.task.await {
                            warn!(vip = %key.vip, port = key.port, %error, "listener task failed");
                        }
                        info!(vip = %key.vip, protocol = %key.protocol, port = key.port, "listener closed");
                    }
                }
                ListenerChange::Update(key, route) => {
                    if let Some(listener) = running.listeners.get_mut(&key) {
                        listener.updates.send_replace(Arc::new(route.clone()));
                        listener.route = route;
                    }
                }
                ListenerChange::Bind(key, route) => {
                    if unavailable.contains(&key.vip) {
                        continue;
                    }
                    let lb_id = route.lb_id.clone();
                    match self.bind(key, route.clone()).await {
                        Ok(listener) => {
                            info!(lb = %lb_id, vip = %key.vip, protocol = %key.protocol, port = key.port, "listening");
                            running.listeners.insert(key, listener);
                        }
                        Err(source) => failures.push(LbFailure {
                            lb_id,
                            reason: LbFailureReason::Bind {
                                protocol: key.protocol,
                                addr: SocketAddr::new(key.vip, key.port),
                                source,
                            },
                        }),
                    }
                }
            }
        }
    }

    async fn bind(
        &self,
        key: ListenerKey,
        route: ListenerRoute,
    ) -> std::io::Result<RunningListener> {
        let shared = &self.shared;
        let address = SocketAddr::new(key.vip, key.port);
        let (updates, route_rx) = watch::channel(Arc::new(route.clone()));
        let context = ListenerContext {
            route: route_rx,
            health: shared.health.clone(),
            metrics: shared.metrics.clone(),
            connect_timeout: shared.config.connect_timeout,
        };
        let cancel = shared.cancel.child_token();
        let task = match key.protocol {
            Protocol::Tcp => {
                let listener = TcpListener::bind(address).await?;
                tokio::spawn(serve_tcp(listener, context, cancel.clone()))
            }
            Protocol::Udp => {
                let socket = UdpSocket::bind(address).await?;
                let flows = FlowSettings {
                    idle_timeout: shared.config.udp_idle_timeout,
                    max_sessions: shared.config.udp_max_sessions,
                };
                tokio::spawn(serve_udp(socket, context, flows, cancel.clone()))
            }
        };
        Ok(RunningListener {
            route,
            updates,
            cancel,
            task,
        })
    }

    fn converge_routes(
        &self,
        running: &mut Running,
        passthrough: BTreeMap<IpAddr, Vec<PassthroughRoute>>,
    ) {
        let wanted: WantedRoutes = Arc::new(passthrough);
        if let Some(routes) = &running.routes {
            routes.wanted.send_if_modified(|current| {
                let modified = **current != *wanted;
                *current = Arc::clone(&wanted);
                modified
            });
            return;
        }
        // Started by the first passthrough load balancer only, so a proxy-only cloud
        // never runs `ip route`.
        if wanted.is_empty() {
            return;
        }
        let shared = &self.shared;
        let (sender, receiver) = watch::channel(wanted);
        let manager = RouteManager {
            ip: shared.ip.clone(),
            settings: shared.config.passthrough.clone(),
            health: shared.health.clone(),
            metrics: shared.metrics.clone(),
            wanted: receiver,
            retry_delay: shared.config.health_interval,
        };
        running.routes = Some(RunningRoutes {
            wanted: sender,
            task: tokio::spawn(manager.run(shared.cancel.child_token())),
        });
    }
}

/// Hands the proxy-mode TCP listeners to HAProxy; UDP ones, and ones HAProxy must not be
/// given, are failures of their load balancers.
async fn converge_haproxy(
    haproxy: &Haproxy,
    listeners: &BTreeMap<ListenerKey, ListenerRoute>,
    unavailable: &HashSet<IpAddr>,
    failures: &mut Vec<LbFailure>,
) {
    let mut tcp = BTreeMap::new();
    for (key, route) in listeners {
        if key.protocol != Protocol::Tcp {
            failures.push(LbFailure {
                lb_id: route.lb_id.clone(),
                reason: LbFailureReason::ProtocolUnsupported {
                    protocol: key.protocol,
                    port: key.port,
                },
            });
        } else if !unavailable.contains(&key.vip) {
            tcp.insert(*key, route.clone());
        }
    }
    let (desired, refused) = proxies(&tcp, haproxy.shared_ports());
    for (lb_id, reason) in refused {
        failures.push(LbFailure {
            lb_id,
            reason: reason.into(),
        });
    }
    if let Err((error, lb_ids)) = haproxy.apply(desired).await {
        warn!(%error, "HAProxy not converged");
        failures.extend(lb_ids.into_iter().map(|lb_id| LbFailure {
            lb_id,
            reason: LbFailureReason::Haproxy(error.clone()),
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Listener, Mode};

    fn is_send<T: Send>(_: &T) {}

    #[tokio::test]
    async fn handle_and_futures_can_cross_threads() {
        fn shareable<T: Send + Sync + Clone + 'static>() {}
        shareable::<DataPlane>();
        let dataplane = DataPlane::new(DataPlaneConfig::default());
        is_send(&dataplane.apply(Vec::new()));
        is_send(&dataplane.shutdown());
    }

    #[tokio::test]
    async fn kind_none_realises_nothing_and_reports_unknown_health() {
        let dataplane = DataPlane::new(DataPlaneConfig {
            mode: DataPlaneKind::None,
            ..DataPlaneConfig::default()
        });
        let backend = IpAddr::from([127, 77, 250, 11]);
        let lb = LoadBalancer {
            id: "lb-none".to_owned(),
            vips: vec![IpAddr::from([127, 77, 250, 1])],
            mode: Mode::Proxy,
            listeners: vec![Listener {
                protocol: Protocol::Tcp,
                port: 1,
                backend_port: 1,
                health_check: None,
            }],
            backends: vec![backend],
            source_ranges: Vec::new(),
        };
        dataplane.apply(vec![lb]).await.unwrap();
        assert_eq!(
            dataplane.backend_health("lb-none"),
            vec![(backend, BackendHealth::Unknown)]
        );
        assert!(dataplane.shared.running.lock().await.listeners.is_empty());
        assert!(dataplane.backend_health("lb-other").is_empty());
    }
}
