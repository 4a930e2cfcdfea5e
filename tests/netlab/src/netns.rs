//! Running processes and threads inside a network namespace.

use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Output, Stdio};

use nix::sched::CloneFlags;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use crate::error::NetlabError;

/// A named network namespace (`ip netns add`), so `ip netns exec NAME` works for users too.
///
/// This is only a handle: the [`crate::Topology`] that created the namespace removes it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// A handle to an existing named namespace.
    pub fn attach(name: impl Into<String>) -> Self {
        Self { name: name.into() }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip netns exec NAME program`, ready for arguments, environment and stdio.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    /// The same as [`Netns::command`] for async code.
    pub fn tokio_command(&self, program: impl AsRef<OsStr>) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd.kill_on_drop(true);
        cmd
    }

    /// `argv` as a command inside the namespace, with stdin closed.
    fn argv_command<I, S>(&self, argv: I) -> Result<Command, NetlabError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let (program, args) = split_argv(argv)?;
        let mut cmd = self.command(&program);
        cmd.args(&args).stdin(Stdio::null());
        Ok(cmd)
    }

    /// Runs `argv` inside the namespace to completion and returns its output, whatever its
    /// exit status.
    pub fn exec<I, S>(&self, argv: I) -> Result<Output, NetlabError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.argv_command(argv)?;
        cmd.output().map_err(|source| NetlabError::Spawn {
            command: describe(&cmd),
            source,
        })
    }

    /// Runs `argv` inside the namespace and returns its stdout; a non-zero exit is an error
    /// carrying stderr.
    pub fn exec_checked<I, S>(&self, argv: I) -> Result<String, NetlabError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        run_checked(self.argv_command(argv)?)
    }

    /// [`Netns::exec`] for async code.
    pub async fn exec_async<I, S>(&self, argv: I) -> Result<Output, NetlabError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let (program, args) = split_argv(argv)?;
        let mut cmd = self.tokio_command(&program);
        cmd.args(&args).stdin(Stdio::null());
        cmd.output().await.map_err(|source| NetlabError::Spawn {
            command: describe(cmd.as_std()),
            source,
        })
    }

    /// Starts `argv` inside the namespace in its own process group; stdout and stderr are
    /// inherited. The process group is killed when the guard drops.
    pub fn spawn<I, S>(&self, argv: I) -> Result<ChildGuard, NetlabError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        ChildGuard::spawn(self.argv_command(argv)?)
    }

    /// Runs `f` on a fresh thread that has entered this namespace, and returns its result.
    /// Sockets made there stay in the namespace after the thread ends, so this is how
    /// in-process code binds a listener inside a namespace.
    pub fn run_in_thread<T, F>(&self, f: F) -> Result<T, NetlabError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let path = format!("/run/netns/{}", self.name);
        let file = File::open(&path).map_err(|source| NetlabError::Io {
            context: format!("opening {path}"),
            source,
        })?;
        let netns = self.name.clone();
        let handle = std::thread::Builder::new()
            .name(format!("netns-{}", self.name))
            .spawn(move || {
                // setns moves only this thread, which ends with `f`.
                nix::sched::setns(&file, CloneFlags::CLONE_NEWNET).map(|()| f())
            })
            .map_err(|source| NetlabError::Io {
                context: format!("starting a thread for namespace {netns}"),
                source,
            })?;
        handle
            .join()
            .map_err(|_| NetlabError::ThreadPanicked {
                netns: netns.clone(),
            })?
            .map_err(|source| NetlabError::Sys {
                context: format!("entering namespace {netns}"),
                source,
            })
    }
}

fn split_argv<I, S>(argv: I) -> Result<(std::ffi::OsString, Vec<std::ffi::OsString>), NetlabError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut it = argv.into_iter().map(|a| a.as_ref().to_owned());
    let program = it.next().ok_or_else(|| NetlabError::Spawn {
        command: String::new(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty command line"),
    })?;
    Ok((program, it.collect()))
}

/// A command line for error messages.
pub(crate) fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs a command to completion; its stdout on success, a [`NetlabError::CommandFailed`]
/// with stderr otherwise.
pub(crate) fn run_checked(mut cmd: Command) -> Result<String, NetlabError> {
    cmd.stdin(Stdio::null());
    let output = cmd.output().map_err(|source| NetlabError::Spawn {
        command: describe(&cmd),
        source,
    })?;
    checked_stdout(describe(&cmd), output)
}

pub(crate) fn checked_stdout(command: String, output: Output) -> Result<String, NetlabError> {
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(NetlabError::CommandFailed {
            command,
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

/// Who [`ChildGuard::signal`] reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recipients {
    /// The started process alone, as a service manager stops a service (kubelet signals a
    /// container's first process; systemd's `KillMode=mixed` the main one): it stops its
    /// own children in its own time.
    Leader,
    /// Every process of its group.
    Group,
}

/// A process started in its own process group; dropping the guard kills the whole group
/// (SIGKILL) and reaps the process.
#[derive(Debug)]
pub struct ChildGuard {
    child: Child,
    command: String,
    /// Set once the leader was reaped: from then on its pid may name another process.
    reaped: bool,
}

impl ChildGuard {
    /// Starts `cmd` as the leader of a new process group.
    pub fn spawn(mut cmd: Command) -> Result<Self, NetlabError> {
        cmd.process_group(0);
        let command = describe(&cmd);
        let child = cmd.spawn().map_err(|source| NetlabError::Spawn {
            command: command.clone(),
            source,
        })?;
        tracing::debug!(pid = child.id(), %command, "started");
        Ok(Self {
            child,
            command,
            reaped: false,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The command line, for messages.
    pub fn command(&self) -> &str {
        &self.command
    }

    /// The child, e.g. to take its piped stdout.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Whether the process has exited (and how), without blocking.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>, NetlabError> {
        let status = self.child.try_wait().map_err(|source| NetlabError::Io {
            context: format!("waiting for `{}`", self.command),
            source,
        })?;
        self.reaped |= status.is_some();
        Ok(status)
    }

    /// Sends `signal` to the leader alone or to its whole process group.
    pub fn signal(&self, signal: Signal, to: Recipients) -> Result<(), NetlabError> {
        if self.reaped {
            return Err(NetlabError::Sys {
                context: format!("signalling `{}` after it exited", self.command),
                source: nix::errno::Errno::ESRCH,
            });
        }
        match to {
            Recipients::Leader => kill(self.pgid(), signal),
            Recipients::Group => killpg(self.pgid(), signal),
        }
        .map_err(|source| NetlabError::Sys {
            context: format!("signalling `{}`", self.command),
            source,
        })
    }

    fn pgid(&self) -> Pid {
        // The child is its group's leader (process_group(0)); pids fit in i32 on Linux.
        Pid::from_raw(i32::try_from(self.child.id()).unwrap_or(i32::MAX))
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.reaped {
            return;
        }
        // The unreaped leader keeps its pid (and so the group id) from being reused.
        if let Err(e) = killpg(self.pgid(), Signal::SIGKILL)
            && e != nix::errno::Errno::ESRCH
        {
            tracing::warn!(pid = self.child.id(), command = %self.command, error = %e, "cannot kill");
        }
        if let Err(e) = self.child.wait() {
            tracing::warn!(pid = self.child.id(), command = %self.command, error = %e, "cannot reap");
        }
    }
}
