//! Running the iptables tools for both the executor and the read-back: a process with its
//! input and output, work on the blocking pool, and the errors of either.

use std::process::Stdio;

use tandem_nftables::kernel::KernelError;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

/// Seconds `iptables*` wait for the xtables lock (legacy) before failing.
pub(super) const LOCK_WAIT_SECONDS: &str = "5";

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: &'static str,
        source: std::io::Error,
    },
    #[error("{program} for table {table} failed ({status}): {stderr}{}", context.as_deref().map(|c| format!("\n{c}")).unwrap_or_default())]
    Restore {
        program: &'static str,
        table: String,
        status: std::process::ExitStatus,
        stderr: String,
        /// Payload lines around the line the error names.
        context: Option<String>,
    },
    #[error("{program} {args} failed ({status}): {stderr}")]
    Command {
        program: &'static str,
        args: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("reading table {table} over netlink: {source}")]
    Netlink {
        table: &'static str,
        source: KernelError,
    },
    #[error("a blocking task failed: {0}")]
    Task(String),
}

/// Runs `work` on the blocking pool (netlink dumps, parsing large listings).
pub(super) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, SyncError> + Send + 'static,
) -> Result<T, SyncError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| SyncError::Task(error.to_string()))?
}

pub(super) async fn run(
    program: &'static str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<String, SyncError> {
    let output = spawn_with_stdin(program, args, stdin).await?;
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    Err(SyncError::Command {
        program,
        args: args.join(" "),
        status: output.status,
        stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
    })
}

pub(super) async fn spawn_with_stdin(
    program: &'static str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<std::process::Output, SyncError> {
    let spawn_error = |source| SyncError::Spawn { program, source };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(spawn_error)?;
    // Before its input: the changes it commits are announced as ours.
    if let Some(pid) = child.id() {
        crate::datapath::events::record_own_port(pid);
    }
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A restore that dies early closes its stdin; its exit status tells why.
        if let Err(error) = pipe.write_all(text.as_bytes()).await {
            tracing::debug!(program, %error, "writing restore input");
        }
        drop(pipe);
    }
    child.wait_with_output().await.map_err(spawn_error)
}
