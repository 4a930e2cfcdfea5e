//! Starting the lab's processes inside their namespaces and waiting until they serve.

use std::fs::OpenOptions;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tandem_netlab::{ChildGuard, NetlabError, Netns, Recipients};

use crate::images::{ContainerGuard, ContainerRun};

#[derive(Debug, thiserror::Error)]
pub enum ComponentError {
    #[error("creating log file {path}: {source}")]
    Log {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("starting {name}: {source}")]
    Spawn { name: String, source: NetlabError },
    #[error("{name} exited ({status}) before it was ready; last lines of {log}:\n{tail}")]
    Exited {
        name: String,
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error("signalling {name}: {source}")]
    Signal { name: String, source: NetlabError },
    #[error(
        "{name} did not accept connections on {addr} within {waited:?}; last lines of {log}:\n{tail}"
    )]
    NotReady {
        name: String,
        addr: SocketAddr,
        waited: Duration,
        log: PathBuf,
        tail: String,
    },
}

/// One running process of the lab, killed (with its process group) on drop; for a
/// container, the container is removed first.
#[derive(Debug)]
pub struct Component {
    pub name: String,
    pub netns: String,
    pub log: PathBuf,
    _container: Option<ContainerGuard>,
    guard: ChildGuard,
}

impl Component {
    /// Starts `program args` in `netns`, stdout and stderr to `log_dir/name.log` (appended
    /// to, so that a component started again keeps its earlier run's log).
    pub fn start(
        netns: &Netns,
        name: &str,
        program: &Path,
        args: &[String],
        envs: &[(&str, &str)],
        log_dir: &Path,
    ) -> Result<Self, ComponentError> {
        let mut cmd = netns.command(program);
        cmd.args(args);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        Self::spawn_logged(cmd, netns.name(), name, None, log_dir)
    }

    /// Runs `args` in the container `run` describes (joined to its namespace), its output
    /// to `log_dir/name.log`; the container is removed when the component is dropped.
    pub fn start_container(
        run: &ContainerRun,
        name: &str,
        args: &[String],
        log_dir: &Path,
    ) -> Result<Self, ComponentError> {
        // Guard first: a failed start must not leave a half-created container either.
        let container = ContainerGuard::new(&run.name);
        Self::spawn_logged(
            run.command(args),
            &run.netns,
            name,
            Some(container),
            log_dir,
        )
    }

    fn spawn_logged(
        mut cmd: std::process::Command,
        netns: &str,
        name: &str,
        container: Option<ContainerGuard>,
        log_dir: &Path,
    ) -> Result<Self, ComponentError> {
        let log = log_dir.join(format!("{name}.log"));
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|source| ComponentError::Log {
                path: log.clone(),
                source,
            })?;
        let err = out.try_clone().map_err(|source| ComponentError::Log {
            path: log.clone(),
            source,
        })?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        let guard = ChildGuard::spawn(cmd).map_err(|source| ComponentError::Spawn {
            name: name.to_owned(),
            source,
        })?;
        Ok(Self {
            name: name.to_owned(),
            netns: netns.to_owned(),
            log,
            _container: container,
            guard,
        })
    }

    pub fn pid(&self) -> u32 {
        self.guard.pid()
    }

    /// Whether the process is still running (false once it exited, however).
    pub fn is_running(&mut self) -> bool {
        matches!(self.guard.try_wait(), Ok(None))
    }

    /// Sends `signal` to the process alone, as a service manager does (its children, such
    /// as an edge's HAProxy, are its to stop), and waits up to `grace` for it to exit; what
    /// is left then is killed when the component drops. Returns how long the process took to exit, or
    /// `None` when it did not within `grace`.
    pub async fn stop(
        mut self,
        signal: Signal,
        grace: Duration,
    ) -> Result<Option<Duration>, ComponentError> {
        let start = Instant::now();
        self.guard
            .signal(signal, Recipients::Leader)
            .map_err(|source| ComponentError::Signal {
                name: self.name.clone(),
                source,
            })?;
        while start.elapsed() < grace {
            if !self.is_running() {
                return Ok(Some(start.elapsed()));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(None)
    }

    /// Waits until `addr` accepts TCP connections (from the lab's own namespace), failing
    /// early with the log's tail when the process dies.
    pub async fn wait_serving(
        &mut self,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<(), ComponentError> {
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = self.guard.try_wait() {
                return Err(ComponentError::Exited {
                    name: self.name.clone(),
                    status: status.to_string(),
                    log: self.log.clone(),
                    tail: self.log_tail(20),
                });
            }
            let attempt = tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(addr),
            )
            .await;
            if let Ok(Ok(_)) = attempt {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(ComponentError::NotReady {
                    name: self.name.clone(),
                    addr,
                    waited: timeout,
                    log: self.log.clone(),
                    tail: self.log_tail(20),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last `lines` lines of the log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}
