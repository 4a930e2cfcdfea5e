//! Removing namespaces: on drop, on SIGINT/SIGTERM, and the leftovers of dead runs.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::sync::{Mutex, Once, PoisonError};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::error::NetlabError;
use crate::naming::{RunPrefix, owner_pid};
use crate::netns::run_checked;

/// Prefixes of the topologies of this process that are still alive.
static LIVE: Mutex<BTreeSet<RunPrefix>> = Mutex::new(BTreeSet::new());

/// Records a live topology; with `handle_signals`, SIGINT/SIGTERM will remove it.
pub(crate) fn register(prefix: &RunPrefix, handle_signals: bool) {
    if handle_signals {
        install_signal_handler_once();
    }
    LIVE.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(prefix.clone());
}

pub(crate) fn unregister(prefix: &RunPrefix) {
    LIVE.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(prefix);
}

/// Names of all named network namespaces (`ip netns list`).
pub fn list_netns() -> Result<Vec<String>, NetlabError> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "list"]);
    Ok(parse_netns_list(&run_checked(cmd)?))
}

/// `ip netns list` prints `NAME` or `NAME (id: N)` per line.
fn parse_netns_list(output: &str) -> Vec<String> {
    output
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// Kills every process inside `netns` and deletes it. Best effort: a namespace that is
/// already gone is not an error.
pub fn remove_netns(netns: &str) {
    let mut pids = Command::new("ip");
    pids.args(["netns", "pids", netns]);
    if let Ok(out) = run_checked(pids) {
        let own = std::process::id();
        for pid in out.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            if u32::try_from(pid).ok() == Some(own) {
                continue;
            }
            if let Err(e) = kill(Pid::from_raw(pid), Signal::SIGKILL) {
                tracing::debug!(netns, pid, error = %e, "kill");
            }
        }
    }
    let mut del = Command::new("ip");
    del.args(["netns", "delete", netns]);
    if let Err(e) = run_checked(del) {
        tracing::debug!(netns, error = %e, "netns delete");
    }
}

/// Removes every namespace of `prefix`.
pub(crate) fn remove_prefix(prefix: &RunPrefix) {
    match list_netns() {
        Ok(names) => names
            .iter()
            .filter(|n| prefix.owns(n))
            .for_each(|n| remove_netns(n)),
        Err(e) => tracing::warn!(%prefix, error = %e, "cannot list namespaces to clean up"),
    }
}

/// The netlab namespaces in `names` whose creating process is gone.
fn stale(names: &[String], alive: impl Fn(u32) -> bool) -> Vec<&str> {
    names
        .iter()
        .filter(|n| owner_pid(n).is_some_and(|pid| !alive(pid)))
        .map(String::as_str)
        .collect()
}

/// Removes the namespaces of dead runs (`tdm<pid>x<seq>-*` whose pid is not alive) and
/// returns their names. Called automatically before the first topology of a process.
pub fn remove_stale_namespaces() -> Result<Vec<String>, NetlabError> {
    let names = list_netns()?;
    let own = std::process::id();
    let removed: Vec<String> = stale(&names, |pid| {
        pid == own || Path::new(&format!("/proc/{pid}")).exists()
    })
    .into_iter()
    .map(str::to_owned)
    .collect();
    for name in &removed {
        tracing::info!(netns = %name, "removing namespace of a dead run");
        remove_netns(name);
    }
    Ok(removed)
}

pub(crate) fn remove_stale_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if let Err(e) = remove_stale_namespaces() {
            tracing::warn!(error = %e, "cannot remove namespaces of dead runs");
        }
    });
}

/// On SIGINT/SIGTERM: remove every live topology of this process, then exit 130/143.
/// A dedicated thread owns the handler, so it works whatever runtime the caller uses.
fn install_signal_handler_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("netlab-signals".into())
            .spawn(move || signal_thread(ready_tx));
        match spawned {
            // Wait until the handlers are installed, so no signal can slip through with
            // the default action after a topology exists.
            Ok(_) => {
                if ready_rx.recv().is_err() {
                    tracing::warn!("signal handler thread ended before installing handlers");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot start the signal handler thread"),
        }
    });
}

fn signal_thread(ready: std::sync::mpsc::Sender<()>) {
    use tokio::signal::unix::{SignalKind, signal};
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::warn!(error = %e, "cannot build the signal handler runtime");
            return;
        }
    };
    runtime.block_on(async move {
        let (mut interrupt, mut terminate) = match (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            (Ok(i), Ok(t)) => (i, t),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "cannot install signal handlers");
                return;
            }
        };
        // A closed receiver only means the installer stopped waiting.
        let _ = ready.send(());
        let code = tokio::select! {
            _ = interrupt.recv() => 130,
            _ = terminate.recv() => 143,
        };
        let live: Vec<RunPrefix> = LIVE
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect();
        tracing::info!(?live, code, "signal received: removing topologies");
        let names = list_netns().unwrap_or_default();
        for name in names.iter().filter(|n| live.iter().any(|p| p.owns(n))) {
            remove_netns(name);
        }
        std::process::exit(code);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ip_netns_list() {
        let out = "tdm1x1-sw (id: 3)\ntdm1x1-n1\n\nother (id: 0)\n";
        assert_eq!(parse_netns_list(out), ["tdm1x1-sw", "tdm1x1-n1", "other"]);
    }

    #[test]
    fn only_namespaces_of_dead_netlab_runs_are_stale() {
        let names: Vec<String> = [
            "tdm10x1-sw",
            "tdm10x1-n1",
            "tdm20x1-sw",
            "tdm30-sw",
            "mine",
            "tdm40x2-cp",
        ]
        .map(String::from)
        .to_vec();
        let alive = |pid| pid == 20;
        assert_eq!(
            stale(&names, alive),
            ["tdm10x1-sw", "tdm10x1-n1", "tdm40x2-cp"]
        );
    }
}
