//! The HAProxy data plane for proxy-mode load balancers: a real HAProxy in master-worker
//! mode, driven by a rendered configuration for its frontends and by its runtime API for
//! its servers, as HAProxy's own controllers drive it.
//!
//! - The configuration file always holds the current servers, so a reload or a restart
//!   starts from the truth (HAProxy forgets runtime changes that are not in the file).
//! - A file is checked with `haproxy -c` before it is used; a refused one is reported and
//!   the running one stays.
//! - Frontend changes take a reload through the master CLI, which hands the listening
//!   sockets to the new worker (nothing is refused; old workers finish their connections).
//!   Reloads are spaced by `min_reload_interval` and each waits for its new worker, so a
//!   burst of changes is one reload: the caller converges to the whole desired set.
//! - Server changes (nodes joining and leaving) go through the runtime API, no reload.
//! - Health is what HAProxy's checks say (`show stat`), read every check interval.
//! - It fails open, like the edge's own data plane and cloud load balancers: when no
//!   checked server of a section is up, all of its nodes serve. HAProxy alone would close
//!   every connection then, so each checked server `IP` has an unchecked backup twin
//!   `open-IP` to the same address, and `option allbackups` spreads over all the twins
//!   while every checked server is DOWN; while any checked server is up, the twins take
//!   nothing. The twins come and go with their nodes, in the file and through the
//!   runtime API alike; their names are no addresses, so the health reader skips them.
//! - The master is a child of the edge; if it dies it is started again from the file. An
//!   HAProxy that a crashed edge left running keeps serving: the next edge adopts it and
//!   reloads it from the store, so an edge restart drops no connection.

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
use crate::metrics::Metrics;
use crate::{BackendHealth, HealthCheck};

pub(crate) use render::{CheckTiming, Proxy, proxies};

/// How long a started or reloaded HAProxy may take to have its new worker.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Wait before starting a master that exited on its own again.
const RESTART_DELAY: Duration = Duration::from_secs(1);
/// How long a server that leaves a section may carry sessions before they are shut: the
/// requests in flight through it finish well within it.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a drain reads the servers' sessions.
const DRAIN_POLL: Duration = Duration::from_millis(50);

#[derive(Debug, thiserror::Error)]
pub enum HaproxyError {
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("HAProxy refused the configuration (the running one stays): {detail}")]
    Invalid { detail: String },
    #[error("HAProxy's reload failed (the running configuration stays); its log says why")]
    ReloadFailed,
    #[error("HAProxy did not answer on {socket}: {source}")]
    Socket {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("HAProxy had no new worker within {0:?}")]
    NotReady(Duration),
    #[error("socket path {0} is longer than a Unix socket address may be")]
    PathTooLong(PathBuf),
}

/// Where HAProxy's files live, all in the edge's state directory.
#[derive(Debug, Clone)]
struct Paths {
    config: PathBuf,
    master_socket: PathBuf,
    runtime_socket: PathBuf,
}

impl Paths {
    fn new(dir: &Path) -> Result<Self, HaproxyError> {
        let paths = Self {
            config: dir.join("haproxy.cfg"),
            master_socket: dir.join("master.sock"),
            runtime_socket: dir.join("runtime.sock"),
        };
        // sockaddr_un holds 108 bytes, the terminating NUL included.
        for socket in [&paths.master_socket, &paths.runtime_socket] {
            if socket.as_os_str().len() > 107 {
                return Err(HaproxyError::PathTooLong(socket.clone()));
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
    /// What the current worker runs (and the file holds).
    running: BTreeMap<String, Proxy>,
    /// The worker runs what an earlier edge gave it: the next converge reloads in full.
    adopted: bool,
    last_reload: Option<Instant>,
    tasks: Vec<JoinHandle<()>>,
}

impl Haproxy {
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

    /// Converges HAProxy to `desired`. On an error the running configuration stays, and
    /// the error comes with the load balancers whose sections it left unchanged.
    pub async fn apply(
        &self,
        desired: BTreeMap<String, Proxy>,
    ) -> Result<(), (HaproxyError, BTreeSet<String>)> {
        let mut state = self.shared.state.lock().await;
        match self.converge(&mut state, &desired).await {
            Ok(()) => {
                state.running = desired;
                Ok(())
            }
            Err(error) => Err((error, changed_load_balancers(&state.running, &desired))),
        }
    }

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
        if state.adopted || render::needs_reload(&state.running, desired) {
            self.write_checked(&paths, desired).await?;
            if let Err(error) = self.reload(state, &paths).await {
                // Back to the file the running worker was started from.
                if !state.adopted {
                    self.write_checked(&paths, &state.running).await?;
                }
                return Err(error);
            }
            state.adopted = false;
            return Ok(());
        }
        let commands = render::server_commands(&state.running, desired, self.shared.timing);
        if commands.is_empty() {
            return Ok(());
        }
        self.write_checked(&paths, desired).await?;
        let sent = commands.drain.len() + commands.then.len();
        if !self.send_runtime(&paths, &commands.drain).await? {
            return self.reload(state, &paths).await;
        }
        self.drain(&paths, &commands.draining).await;
        if !self.send_runtime(&paths, &commands.then).await? {
            return self.reload(state, &paths).await;
        }
        info!(commands = sent, "HAProxy servers changed without a reload");
        Ok(())
    }

    /// Sends `commands` through the runtime API in order; false when HAProxy refused one
    /// (logged and counted; the file already holds the wanted servers, so a reload makes
    /// them so).
    async fn send_runtime(&self, paths: &Paths, commands: &[String]) -> Result<bool, HaproxyError> {
        for command in commands {
            let answer = socket::send(&paths.runtime_socket, command)
                .await
                .map_err(|source| HaproxyError::Socket {
                    socket: paths.runtime_socket.clone(),
                    source,
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

    /// Writes the configuration of `proxies` and checks it with `haproxy -c`; the file is
    /// replaced only when HAProxy accepts it.
    async fn write_checked(
        &self,
        paths: &Paths,
        proxies: &BTreeMap<String, Proxy>,
    ) -> Result<(), HaproxyError> {
        let globals = render::Globals {
            runtime_socket: &paths.runtime_socket,
            connect_timeout: self.shared.connect_timeout,
            timing: self.shared.timing,
        };
        let text = render::render(&globals, proxies);
        let candidate = paths.config.with_extension("cfg.new");
        let write_error = |path: &Path| {
            let path = path.to_owned();
            move |source| HaproxyError::Write { path, source }
        };
        tokio::fs::write(&candidate, text)
            .await
            .map_err(write_error(&candidate))?;
        let program = &self.shared.settings.program;
        let output = Command::new(program)
            .arg("-c")
            .arg("-q")
            .arg("-f")
            .arg(&candidate)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|source| HaproxyError::Spawn {
                program: program.clone(),
                source,
            })?;
        if !output.status.success() {
            let detail = String::from_utf8_lossy(&output.stderr).trim().to_owned();
            return Err(HaproxyError::Invalid { detail });
        }
        tokio::fs::rename(&candidate, &paths.config)
            .await
            .map_err(write_error(&paths.config))
    }

    /// Starts HAProxy with no load balancer (which always loads), or adopts the one a
    /// previous run of the edge left on our socket, and the tasks that watch it.
    async fn start(&self, state: &mut State) -> Result<Paths, HaproxyError> {
        let dir = &self.shared.settings.state_dir;
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|source| HaproxyError::Write {
                path: dir.clone(),
                source,
            })?;
        let paths = Paths::new(dir)?;
        state.running.clear();
        let master = match running_master(&paths.master_socket).await {
            Some(pid) => {
                info!(%pid, "adopting the HAProxy an earlier run of the edge left running; reloading it from the store");
                state.adopted = true;
                Master::Adopted(pid)
            }
            None => {
                self.write_checked(&paths, &BTreeMap::new()).await?;
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
                source,
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

    /// Restarts the master from the current file whenever it exits on its own (HAProxy's
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
                    .iter()
                    .filter_map(|(name, proxy)| Some((name.clone(), proxy.health_check.clone()?)))
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
    async fn reload(&self, state: &mut State, paths: &Paths) -> Result<(), HaproxyError> {
        if let Some(last) = state.last_reload {
            let due = last + self.shared.settings.min_reload_interval;
            tokio::time::sleep_until(due.into()).await;
        }
        let before = self.processes(paths).await?;
        let answer = socket::send(&paths.master_socket, "reload")
            .await
            .map_err(|source| HaproxyError::Socket {
                socket: paths.master_socket.clone(),
                source,
            })?;
        debug!(%answer, "HAProxy reload requested");
        state.last_reload = Some(Instant::now());
        let result = self.wait_for_worker(paths, &before).await;
        self.shared.metrics.haproxy_reload(result.is_ok());
        if result.is_ok() {
            info!("HAProxy reloaded");
        }
        result
    }

    async fn processes(&self, paths: &Paths) -> Result<socket::Processes, HaproxyError> {
        socket::send(&paths.master_socket, "show proc")
            .await
            .map(|answer| socket::parse_processes(&answer))
            .map_err(|source| HaproxyError::Socket {
                socket: paths.master_socket.clone(),
                source,
            })
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
                return Err(HaproxyError::NotReady(READY_TIMEOUT));
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

/// Load balancers with a section in `desired` that differs from (or is missing in)
/// `running`.
fn changed_load_balancers(
    running: &BTreeMap<String, Proxy>,
    desired: &BTreeMap<String, Proxy>,
) -> BTreeSet<String> {
    desired
        .iter()
        .filter(|(name, proxy)| running.get(*name) != Some(proxy))
        .map(|(_, proxy)| proxy.lb_id.clone())
        .collect()
}

/// HAProxy's server states as health per checked target: a backend is unhealthy for a
/// check if any section checking it so says DOWN.
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
    fn health_combines_every_section_that_checks_a_backend_alike() {
        let check = HealthCheck::Tcp { port: 80 };
        let checks = HashMap::from([
            ("a_80_v4".to_owned(), check.clone()),
            ("b_80_v4".to_owned(), check.clone()),
        ]);
        let stat = |proxy: &str, server: &str, health| socket::ServerStat {
            proxy: proxy.into(),
            server: server.parse().unwrap(),
            health,
            sessions: 0,
        };
        let health = health_by_target(
            &[
                stat("a_80_v4", "198.18.0.11", BackendHealth::Healthy),
                stat("b_80_v4", "198.18.0.11", BackendHealth::Unhealthy),
                stat("a_80_v4", "198.18.0.12", BackendHealth::Healthy),
                stat("unchecked_80_v4", "198.18.0.13", BackendHealth::Healthy),
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
        assert_eq!(of("198.18.0.13"), None);
    }

    #[test]
    fn long_state_directories_are_refused() {
        let long = PathBuf::from(format!("/{}", "d".repeat(100)));
        assert!(matches!(
            Paths::new(&long),
            Err(HaproxyError::PathTooLong(_))
        ));
        assert!(Paths::new(Path::new("/var/lib/cloud-mock/haproxy")).is_ok());
    }
}
