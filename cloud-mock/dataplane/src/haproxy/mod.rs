//! The HAProxy data plane for proxy-mode load balancers: a real HAProxy in master-worker
//! mode, driven by a rendered configuration for its frontends and backends and by its
//! runtime API for what changes within them, as HAProxy's own controllers drive it.
//!
//! - HAProxy listens on each port once, on every address of the family, and picks a
//!   backend by destination from a map; backends are made ahead of need (module
//!   `layout`). So a new load balancer on a port already bound, nodes joining and leaving
//!   and source ranges changing are runtime commands (map, ACL and server entries), no
//!   reload. The edge must therefore own its load balancers' ports in its network
//!   namespace: another socket on such a port, on any address, keeps HAProxy from
//!   binding it (a reload that fails, reported).
//! - A reload only for a port (of a family) not bound yet, or when no empty backend of
//!   a kind is left. It goes through the master CLI, which hands the listening sockets
//!   to the new worker (nothing is refused; old workers finish their connections).
//!   Reloads are spaced by `min_reload_interval` and each waits for its new worker, so a
//!   burst of changes is one reload: the caller converges to the whole desired set. The
//!   reloads are counted by reason (`cloud_mock_haproxy_reload_reasons_total`).
//! - The files (configuration, maps, ACLs) always hold the whole layout, written before
//!   the runtime commands, so a reload or a restart starts from the truth (HAProxy
//!   forgets runtime changes that are not in its files).
//! - A configuration for a reload is checked with `haproxy -c` first; a refused one is
//!   reported and the running one stays. One that differs only in servers and map and
//!   ACL entries is not checked: its structure is the running one's, and HAProxy takes
//!   the same values through its runtime API (a refused command falls back to a reload,
//!   which checks).
//! - Health is what HAProxy's checks say (`show stat`), read every check interval.
//! - It fails open, like the edge's own data plane and cloud load balancers: when no
//!   checked server of a listener is up, all of its nodes serve. HAProxy alone would close
//!   every connection then, so each checked server `IP` has an unchecked backup twin
//!   `open-IP` to the same address, and `option allbackups` spreads over all the twins
//!   while every checked server is DOWN; while any checked server is up, the twins take
//!   nothing. The twins come and go with their nodes, in the file and through the
//!   runtime API alike; their names are no addresses, so the health reader skips them.
//! - The master is a child of the edge; if it dies it is started again from the files. An
//!   HAProxy that a crashed edge left running keeps serving: the next edge adopts it and
//!   reloads it from the store, so an edge restart drops no connection.

pub(crate) mod error;
mod layout;
mod proxy;
mod render;
mod socket;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::HaproxySettings;
use crate::health::ProbeTarget;
use crate::metrics::{Metrics, ReloadReason};
use crate::{BackendHealth, HealthCheck};
pub use error::HaproxyError;
use layout::{Layout, backend_name};
pub(crate) use proxy::{CheckTiming, Proxy, proxies};

/// How long a started or reloaded HAProxy may take to have its new worker.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Wait before starting a master that exited on its own again.
const RESTART_DELAY: Duration = Duration::from_secs(1);
/// How long a server that leaves a backend may carry sessions before they are shut: the
/// requests in flight through it finish well within it.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a drain reads the servers' sessions.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// Where HAProxy's files live, all in the edge's state directory.
#[derive(Debug, Clone)]
struct Paths {
    /// The state directory: the map and ACL files too.
    dir: PathBuf,
    config: PathBuf,
    master_socket: PathBuf,
    runtime_socket: PathBuf,
}

impl Paths {
    fn new(dir: &Path) -> Result<Self, HaproxyError> {
        let plain = dir.to_str().is_some_and(|dir| {
            dir.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/._-".contains(&b))
        });
        if !plain {
            return Err(HaproxyError::PathNotPlain(dir.to_owned()));
        }
        let paths = Self {
            dir: dir.to_owned(),
            config: dir.join("haproxy.cfg"),
            master_socket: dir.join("master.sock"),
            runtime_socket: dir.join("runtime.sock"),
        };
        // sockaddr_un holds 108 bytes, the terminating NUL included.
        for socket in [&paths.master_socket, &paths.runtime_socket] {
            if socket.as_os_str().len() > 107 {
                return Err(HaproxyError::PathTooLong(dir.to_owned()));
            }
        }
        Ok(paths)
    }
}

/// Handle on the HAProxy that serves proxy-mode load balancers. Clones share it.
#[derive(Clone)]
pub(crate) struct Haproxy {
    shared: Arc<Shared>,
}

struct Shared {
    settings: HaproxySettings,
    timing: CheckTiming,
    connect_timeout: Duration,
    metrics: Metrics,
    /// Health by what was checked, as HAProxy last reported it.
    health: RwLock<HashMap<ProbeTarget, BackendHealth>>,
    cancel: CancellationToken,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    paths: Option<Paths>,
    /// What the current worker runs (and the files hold).
    running: Layout,
    /// The map and ACL files as last written, by path: only changed ones are written.
    written: BTreeMap<PathBuf, String>,
    /// The worker runs what an earlier edge gave it: the next converge reloads in full.
    adopted: bool,
    last_reload: Option<Instant>,
    tasks: Vec<JoinHandle<()>>,
}

impl Haproxy {
    /// See [`HaproxySettings::shared_ports`].
    pub fn shared_ports(&self) -> &BTreeSet<u16> {
        &self.shared.settings.shared_ports
    }

    pub fn new(
        settings: HaproxySettings,
        timing: CheckTiming,
        connect_timeout: Duration,
        metrics: Metrics,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                settings,
                timing,
                connect_timeout,
                metrics,
                health: RwLock::default(),
                cancel,
                state: Mutex::default(),
            }),
        }
    }

    /// What HAProxy's checks say of `target`; `None` when no HAProxy server is checked so.
    pub fn health(&self, target: &ProbeTarget) -> Option<BackendHealth> {
        self.shared
            .health
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(target)
            .copied()
    }

    /// Converges HAProxy to `desired` (by name). On an error the running configuration
    /// stays, and the error comes with the load balancers it left unserved as desired.
    pub async fn apply(
        &self,
        desired: BTreeMap<String, Proxy>,
    ) -> Result<(), (HaproxyError, BTreeSet<String>)> {
        let mut state = self.shared.state.lock().await;
        self.converge(&mut state, &desired)
            .await
            .map_err(|error| (error, unserved(&state.running, &desired)))
    }

    /// What runtime commands can do first, so that load balancers that need no reload are
    /// served at once (and stay served when the reload fails), then the reload if one is
    /// needed.
    async fn converge(
        &self,
        state: &mut State,
        desired: &BTreeMap<String, Proxy>,
    ) -> Result<(), HaproxyError> {
        let paths = match &state.paths {
            Some(paths) => paths.clone(),
            None => {
                let paths = self.start(state).await?;
                state.paths = Some(paths.clone());
                paths
            }
        };
        if state.adopted {
            let fresh = layout::fresh(desired);
            return self
                .reload_to(state, &paths, fresh, ReloadReason::Adopted)
                .await;
        }
        let plan = layout::plan(&state.running, desired);
        if plan.run_time != state.running {
            self.change_at_run_time(state, &paths, plan.run_time)
                .await?;
        }
        match plan.reload {
            Some((layout, reason)) => self.reload_to(state, &paths, layout, reason).await,
            None => Ok(()),
        }
    }

    /// Turns the running layout into `next` (same frontends and backends) through the
    /// runtime API; a refused command falls back to a reload to `next`.
    async fn change_at_run_time(
        &self,
        state: &mut State,
        paths: &Paths,
        next: Layout,
    ) -> Result<(), HaproxyError> {
        let commands =
            render::runtime_commands(&paths.dir, &state.running, &next, self.shared.timing);
        // The files first: a restart or a reload from them reaches `next` whatever
        // becomes of the commands.
        self.write(state, paths, &next, false).await?;
        if !self.send_runtime(paths, &commands.before_drain).await? {
            return self
                .reload_to(state, paths, next, ReloadReason::RuntimeRefused)
                .await;
        }
        self.drain(paths, &commands.draining).await;
        if !self.send_runtime(paths, &commands.after_drain).await? {
            return self
                .reload_to(state, paths, next, ReloadReason::RuntimeRefused)
                .await;
        }
        state.running = next;
        info!(
            commands = commands.len(),
            "HAProxy changed through its runtime API, no reload"
        );
        Ok(())
    }

    /// Reloads HAProxy to `layout`. When `haproxy -c` refuses its files or the reload
    /// fails, the running layout's files are written back.
    async fn reload_to(
        &self,
        state: &mut State,
        paths: &Paths,
        layout: Layout,
        reason: ReloadReason,
    ) -> Result<(), HaproxyError> {
        let result = match self.write(state, paths, &layout, true).await {
            Ok(()) => self.reload(state, paths, reason).await,
            Err(error) => Err(error),
        };
        match result {
            Ok(()) => {
                state.running = layout;
                state.adopted = false;
                Ok(())
            }
            Err(error) => {
                // An adopted worker runs an earlier edge's files, which are not ours to
                // write back.
                if !state.adopted {
                    let running = state.running.clone();
                    if let Err(restore) = self.write(state, paths, &running, false).await {
                        warn!(error = %restore, "cannot write the running configuration back");
                    }
                }
                Err(error)
            }
        }
    }

    /// Sends `commands` through the runtime API in order; false when HAProxy refused one
    /// (logged and counted; the files already hold the wanted state, so a reload makes
    /// it so).
    async fn send_runtime(&self, paths: &Paths, commands: &[String]) -> Result<bool, HaproxyError> {
        for command in commands {
            let answer = socket::send(&paths.runtime_socket, command)
                .await
                .map_err(|source| HaproxyError::RuntimeUnreachable {
                    socket: paths.runtime_socket.clone(),
                    source: Arc::new(source),
                })?;
            if let Some(refusal) = socket::refused(&answer) {
                warn!(%command, %refusal, "HAProxy refused a runtime change; reloading instead");
                self.shared.metrics.haproxy_runtime_command(false);
                return Ok(false);
            }
            self.shared.metrics.haproxy_runtime_command(true);
            debug!(%command, "HAProxy runtime change");
        }
        Ok(true)
    }

    /// Waits, at most [`DRAIN_TIMEOUT`], until the servers in maintenance that go carry no
    /// session: a request in flight through a node that leaves the pool finishes instead
    /// of being reset. What is left after it (a long-lived connection) is shut with the
    /// server, as no L3 balancer could keep it either.
    async fn drain(&self, paths: &Paths, draining: &[(String, IpAddr)]) {
        if draining.is_empty() {
            return;
        }
        let started = Instant::now();
        loop {
            let carrying = match socket::send(&paths.runtime_socket, "show stat").await {
                Ok(answer) => socket::parse_stat(&answer)
                    .iter()
                    .filter(|stat| {
                        stat.sessions > 0
                            && draining.iter().any(|(proxy, server)| {
                                *proxy == stat.proxy && *server == stat.server
                            })
                    })
                    .count(),
                Err(error) => {
                    debug!(%error, "cannot read HAProxy's statistics; not draining");
                    return;
                }
            };
            if carrying == 0 {
                debug!(
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "servers drained"
                );
                return;
            }
            if started.elapsed() >= DRAIN_TIMEOUT {
                warn!(
                    servers = carrying,
                    "servers still carry sessions after the drain; shutting them"
                );
                return;
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
    }

    /// Writes the files of `layout`: the map and ACL files that changed (removing those it
    /// no longer reads), then the configuration, which replaces the running one's only
    /// once `haproxy -c` accepts it when `check`.
    async fn write(
        &self,
        state: &mut State,
        paths: &Paths,
        layout: &Layout,
        check: bool,
    ) -> Result<(), HaproxyError> {
        let patterns = render::pattern_files(&paths.dir, layout);
        for (path, text) in &patterns {
            if state.written.get(path) != Some(text) {
                write_file(path, text).await?;
                state.written.insert(path.clone(), text.clone());
            }
        }
        let stale: Vec<PathBuf> = state
            .written
            .keys()
            .filter(|path| !patterns.contains_key(*path))
            .cloned()
            .collect();
        for path in stale {
            match tokio::fs::remove_file(&path).await {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(source) => return Err(write_error(&path, source)),
            }
            state.written.remove(&path);
        }
        let globals = render::Globals {
            dir: &paths.dir,
            runtime_socket: &paths.runtime_socket,
            connect_timeout: self.shared.connect_timeout,
            timing: self.shared.timing,
        };
        let candidate = paths.config.with_extension("cfg.new");
        tokio::fs::write(&candidate, render::config(&globals, layout))
            .await
            .map_err(|source| write_error(&candidate, source))?;
        if check {
            self.check(&candidate).await?;
        }
        tokio::fs::rename(&candidate, &paths.config)
            .await
            .map_err(|source| write_error(&paths.config, source))
    }

    /// `haproxy -c` on `config`: its message when it refuses.
    async fn check(&self, config: &Path) -> Result<(), HaproxyError> {
        let program = &self.shared.settings.program;
        let output = Command::new(program)
            .arg("-c")
            .arg("-q")
            .arg("-f")
            .arg(config)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|source| HaproxyError::Spawn {
                program: program.clone(),
                source: Arc::new(source),
            })?;
        if output.status.success() {
            return Ok(());
        }
        let message = String::from_utf8_lossy(&output.stderr).trim().to_owned();
        Err(HaproxyError::ConfigRefused { message })
    }

    /// Starts HAProxy with no load balancer (which always loads), or adopts the one a
    /// previous run of the edge left on our socket, and the tasks that watch it.
    async fn start(&self, state: &mut State) -> Result<Paths, HaproxyError> {
        let dir = &self.shared.settings.state_dir;
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|source| write_error(dir, source))?;
        let paths = Paths::new(dir)?;
        state.running = Layout::default();
        let master = match running_master(&paths.master_socket).await {
            Some(pid) => {
                info!(%pid, "adopting the HAProxy an earlier run of the edge left running; reloading it from the store");
                state.adopted = true;
                Master::Adopted(pid)
            }
            None => {
                self.write(state, &paths, &Layout::default(), true).await?;
                let child = self.spawn_master(&paths)?;
                self.wait_for_worker(&paths, &socket::Processes::default())
                    .await?;
                info!(config = %paths.config.display(), "HAProxy started");
                Master::Child(child)
            }
        };
        state
            .tasks
            .push(tokio::spawn(self.clone().supervise(master, paths.clone())));
        state
            .tasks
            .push(tokio::spawn(self.clone().poll_health(paths.clone())));
        Ok(paths)
    }

    fn spawn_master(&self, paths: &Paths) -> Result<Child, HaproxyError> {
        let program = &self.shared.settings.program;
        let mut child = Command::new(program)
            .arg("-W")
            .arg("-db")
            .arg("-S")
            .arg(&paths.master_socket)
            .arg("-f")
            .arg(&paths.config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| HaproxyError::Spawn {
                program: program.clone(),
                source: Arc::new(source),
            })?;
        // HAProxy's own log lines (server state changes, reloads) join ours.
        if let Some(stdout) = child.stdout.take() {
            tokio::spawn(log_lines(stdout));
        }
        if let Some(stderr) = child.stderr.take() {
            tokio::spawn(log_lines(stderr));
        }
        Ok(child)
    }

    /// Restarts the master from the current files whenever it exits on its own (HAProxy's
    /// master exits when a worker dies); stops it at shutdown.
    async fn supervise(self, mut master: Master, paths: Paths) {
        let cancel = self.shared.cancel.clone();
        loop {
            tokio::select! {
                () = cancel.cancelled() => {
                    master.stop().await;
                    return;
                }
                status = master.exited() => {
                    warn!(%status, "HAProxy exited; starting it again from the current configuration");
                    self.shared.metrics.haproxy_restart();
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(RESTART_DELAY) => {}
            }
            match self.spawn_master(&paths) {
                Ok(child) => master = Master::Child(child),
                Err(error) => warn!(%error, "cannot start HAProxy"),
            }
        }
    }

    /// Reads every server's state from HAProxy each check interval.
    async fn poll_health(self, paths: Paths) {
        let cancel = self.shared.cancel.clone();
        let mut ticker =
            tokio::time::interval(self.shared.timing.interval.max(Duration::from_millis(100)));
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let checks: HashMap<String, HealthCheck> = {
                let state = self.shared.state.lock().await;
                state
                    .running
                    .proxies()
                    .filter_map(|(number, proxy)| {
                        Some((backend_name(number), proxy.health_check.clone()?))
                    })
                    .collect()
            };
            match socket::send(&paths.runtime_socket, "show stat").await {
                Ok(answer) => {
                    let health = health_by_target(&socket::parse_stat(&answer), &checks);
                    *self
                        .shared
                        .health
                        .write()
                        .unwrap_or_else(PoisonError::into_inner) = health;
                }
                Err(error) => debug!(%error, "cannot read HAProxy's statistics"),
            }
        }
    }

    /// Reloads through the master CLI and waits for the new worker, at least
    /// `min_reload_interval` after the previous reload.
    async fn reload(
        &self,
        state: &mut State,
        paths: &Paths,
        reason: ReloadReason,
    ) -> Result<(), HaproxyError> {
        if let Some(last) = state.last_reload {
            let due = last + self.shared.settings.min_reload_interval;
            tokio::time::sleep_until(due.into()).await;
        }
        let before = self.processes(paths).await?;
        let answer = socket::send(&paths.master_socket, "reload")
            .await
            .map_err(|source| master_unreachable(paths, source))?;
        debug!(%answer, reason = reason.as_str(), "HAProxy reload requested");
        state.last_reload = Some(Instant::now());
        let result = self.wait_for_worker(paths, &before).await;
        self.shared.metrics.haproxy_reload(reason, result.is_ok());
        if result.is_ok() {
            info!(reason = reason.as_str(), "HAProxy reloaded");
        }
        result
    }

    async fn processes(&self, paths: &Paths) -> Result<socket::Processes, HaproxyError> {
        socket::send(&paths.master_socket, "show proc")
            .await
            .map(|answer| socket::parse_processes(&answer))
            .map_err(|source| master_unreachable(paths, source))
    }

    /// Waits until the master has a worker that was not among `before`'s, or counts a
    /// failed reload more than `before` did.
    async fn wait_for_worker(
        &self,
        paths: &Paths,
        before: &socket::Processes,
    ) -> Result<(), HaproxyError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            // The master re-executes itself on reload: its socket is briefly unanswered.
            if let Ok(answer) = socket::send(&paths.master_socket, "show proc").await {
                let now = socket::parse_processes(&answer);
                if now.failed_reloads > before.failed_reloads {
                    return Err(HaproxyError::ReloadFailed);
                }
                if now.workers.iter().any(|pid| !before.workers.contains(pid)) {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(HaproxyError::NoNewWorker(READY_TIMEOUT));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Stops HAProxy; old workers end with it.
    pub async fn shutdown(&self) {
        self.shared.cancel.cancel();
        let tasks = std::mem::take(&mut self.shared.state.lock().await.tasks);
        for task in tasks {
            if let Err(error) = task.await {
                warn!(%error, "HAProxy task failed");
            }
        }
    }
}

/// Load balancers with a listener in `desired` that `running` does not serve as desired.
fn unserved(running: &Layout, desired: &BTreeMap<String, Proxy>) -> BTreeSet<String> {
    let served: HashMap<String, &Proxy> = running
        .proxies()
        .map(|(_, proxy)| (proxy.name(), proxy))
        .collect();
    desired
        .iter()
        .filter(|(name, proxy)| served.get(*name) != Some(proxy))
        .map(|(_, proxy)| proxy.lb_id.clone())
        .collect()
}

/// Writes `text` to `path` through a file beside it, so that HAProxy never reads half a
/// file.
async fn write_file(path: &Path, text: &str) -> Result<(), HaproxyError> {
    let mut candidate = path.as_os_str().to_owned();
    candidate.push(".new");
    let candidate = PathBuf::from(candidate);
    tokio::fs::write(&candidate, text)
        .await
        .map_err(|source| write_error(&candidate, source))?;
    tokio::fs::rename(&candidate, path)
        .await
        .map_err(|source| write_error(path, source))
}

fn write_error(path: &Path, source: io::Error) -> HaproxyError {
    HaproxyError::Write {
        path: path.to_owned(),
        source: Arc::new(source),
    }
}

fn master_unreachable(paths: &Paths, source: io::Error) -> HaproxyError {
    HaproxyError::MasterUnreachable {
        socket: paths.master_socket.clone(),
        source: Arc::new(source),
    }
}

/// HAProxy's server states as health per checked target (`checks` by backend name): a
/// node is unhealthy for a check if any backend checking it so says DOWN.
fn health_by_target(
    stats: &[socket::ServerStat],
    checks: &HashMap<String, HealthCheck>,
) -> HashMap<ProbeTarget, BackendHealth> {
    let mut health: HashMap<ProbeTarget, BackendHealth> = HashMap::new();
    for stat in stats {
        let Some(check) = checks.get(&stat.proxy) else {
            continue;
        };
        let target = ProbeTarget {
            ip: stat.server,
            check: check.clone(),
        };
        let combined = health.entry(target).or_insert(stat.health);
        *combined = match (*combined, stat.health) {
            (BackendHealth::Unhealthy, _) | (_, BackendHealth::Unhealthy) => {
                BackendHealth::Unhealthy
            }
            (BackendHealth::Unknown, _) | (_, BackendHealth::Unknown) => BackendHealth::Unknown,
            _ => BackendHealth::Healthy,
        };
    }
    health
}

/// The HAProxy master answering on our socket, if one does (left by an earlier edge).
async fn running_master(master_socket: &Path) -> Option<Pid> {
    let answer = socket::send(master_socket, "show proc").await.ok()?;
    answer.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let pid = fields.next()?.parse::<i32>().ok()?;
        (fields.next() == Some("master")).then(|| Pid::from_raw(pid))
    })
}

/// The HAProxy master the edge watches: its own child, or one it adopted.
enum Master {
    Child(Child),
    Adopted(Pid),
}

impl Master {
    /// Waits until the master is gone; how it ended, as far as the edge can tell.
    async fn exited(&mut self) -> String {
        match self {
            Self::Child(child) => match child.wait().await {
                Ok(status) => status.to_string(),
                Err(error) => error.to_string(),
            },
            Self::Adopted(pid) => {
                while kill(*pid, None).is_ok() {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                "the adopted master is gone".to_owned()
            }
        }
    }

    /// SIGTERM (the master stops its workers), SIGKILL if it lingers.
    async fn stop(&mut self) {
        let pid = match self {
            Self::Child(child) => child
                .id()
                .and_then(|pid| i32::try_from(pid).ok())
                .map(Pid::from_raw),
            Self::Adopted(pid) => Some(*pid),
        };
        if let Some(pid) = pid {
            let _ = kill(pid, Signal::SIGTERM);
            let stopped = tokio::time::timeout(Duration::from_secs(5), self.exited()).await;
            if stopped.is_ok() {
                info!("HAProxy stopped");
                return;
            }
            let _ = kill(pid, Signal::SIGKILL);
        }
        if let Self::Child(child) = self {
            let _ = child.kill().await;
        }
    }
}

async fn log_lines(stream: impl tokio::io::AsyncRead + Unpin) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if line.contains("[ALERT]") || line.contains("[WARNING]") {
            warn!(target: "haproxy", "{line}");
        } else {
            info!(target: "haproxy", "{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_combines_every_backend_that_checks_a_node_alike() {
        let check = HealthCheck::Tcp { port: 80 };
        let checks = HashMap::from([
            ("backend-0".to_owned(), check.clone()),
            ("backend-1".to_owned(), check.clone()),
        ]);
        let stat = |proxy: &str, server: &str, health| socket::ServerStat {
            proxy: proxy.into(),
            server: server.parse().unwrap(),
            health,
            sessions: 0,
        };
        let health = health_by_target(
            &[
                stat("backend-0", "198.18.0.11", BackendHealth::Healthy),
                stat("backend-1", "198.18.0.11", BackendHealth::Unhealthy),
                stat("backend-0", "198.18.0.12", BackendHealth::Healthy),
                stat("backend-2", "198.18.0.13", BackendHealth::Healthy),
            ],
            &checks,
        );
        let of = |ip: &str| {
            health
                .get(&ProbeTarget {
                    ip: ip.parse().unwrap(),
                    check: check.clone(),
                })
                .copied()
        };
        assert_eq!(of("198.18.0.11"), Some(BackendHealth::Unhealthy));
        assert_eq!(of("198.18.0.12"), Some(BackendHealth::Healthy));
        assert_eq!(of("198.18.0.13"), None, "an unchecked backend says nothing");
    }

    #[test]
    fn long_or_unplain_state_directories_are_refused() {
        let long = PathBuf::from(format!("/{}", "d".repeat(100)));
        assert!(matches!(
            Paths::new(&long),
            Err(HaproxyError::PathTooLong(_))
        ));
        for unplain in ["/var/lib/my edge", "/var/lib/a,b", "/var/lib/x(y)", "/d#c"] {
            assert!(
                matches!(
                    Paths::new(Path::new(unplain)),
                    Err(HaproxyError::PathNotPlain(_))
                ),
                "{unplain}"
            );
        }
        assert!(Paths::new(Path::new("/var/lib/cloud-mock/haproxy")).is_ok());
    }

    #[test]
    fn the_load_balancers_not_served_as_desired_are_the_ones_a_failure_names() {
        let proxy = |lb: &str, bind: &str| Proxy {
            lb_id: lb.into(),
            bind: bind.parse().unwrap(),
            backend_port: 31000,
            health_check: None,
            source_ranges: Vec::new(),
            servers: Vec::new(),
            bound_alone: false,
        };
        let (a, b) = (
            proxy("lb-a", "198.51.100.1:80"),
            proxy("lb-b", "198.51.100.2:81"),
        );
        let running = layout::fresh(&BTreeMap::from([(a.name(), a.clone())]));
        let mut a_changed = a.clone();
        a_changed.servers = vec!["198.18.0.11".parse().unwrap()];
        let desired = BTreeMap::from([(a.name(), a_changed), (b.name(), b)]);
        assert_eq!(
            unserved(&running, &desired),
            BTreeSet::from(["lb-a".to_owned(), "lb-b".to_owned()])
        );
        assert_eq!(
            unserved(&running, &BTreeMap::from([(a.name(), a)])),
            BTreeSet::new()
        );
    }
}
