//! Stale conntrack entries, deleted after each successful sync in two ways:
//! - the deletions a change calls for
//!   ([`tandem_proxy_rules::conntrack::stale_udp_deletions`]), run with the `conntrack`
//!   tool as kube-proxy v1.21 does ([`clear_stale`]);
//! - kube-proxy 1.32's reconciler ([`reconcile`]): the kernel's UDP entries of the family,
//!   and its TCP entries that nothing answered, read over ctnetlink
//!   ([`tandem_nftables::ctnetlink`]), each judged against the current Services and
//!   serving endpoints ([`tandem_proxy_rules::conntrack::ServingEndpoints`]), the stale
//!   ones deleted. It catches what the first misses: an entry a packet made through the
//!   old rules while the change was being applied, or a deletion that failed; and the
//!   TCP black holes of SYNs that came before the rules.

use std::process::Stdio;
use std::time::Instant;

use tandem_common::IpFamily;
use tandem_nftables::ctnetlink::{self, Conntrack, ConntrackError};
use tandem_proxy_rules::conntrack::{
    ConntrackDeletion, ConntrackFlow, ServingEndpoints, stale_udp_deletions,
};
use tandem_proxy_rules::model::ProxyState;
use tokio::process::Command;

use crate::metrics::{FamilyLabels, Metrics};

/// How `conntrack` reports that nothing matched (with exit status 1): success for us.
const NOTHING_DELETED: &str = "0 flow entries have been deleted";

/// Run the deletions for going from `previous` to `current`, both of `family`. Failures are logged, never
/// fatal: a missed deletion costs a UDP client a timeout, not the node its rules.
/// Returns how many deletions failed.
pub async fn clear_stale(previous: &ProxyState, current: &ProxyState, family: IpFamily) -> usize {
    let mut failed = 0;
    for deletion in stale_udp_deletions(previous, current) {
        match run(&deletion, family).await {
            Ok(()) => tracing::debug!(?deletion, "conntrack entries deleted"),
            Err(error) => {
                failed += 1;
                tracing::warn!(?deletion, %error, "conntrack deletion failed");
            }
        }
    }
    failed
}

async fn run(deletion: &ConntrackDeletion, family: IpFamily) -> Result<(), String> {
    let args = deletion.conntrack_args(family);
    let output = Command::new("conntrack")
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .await
        .map_err(|e| format!("cannot run conntrack: {e}"))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if deletion_succeeded(output.status.success(), &stderr) {
        Ok(())
    } else {
        Err(format!(
            "conntrack {} ({}): {}",
            args.join(" "),
            output.status,
            stderr.trim()
        ))
    }
}

/// What one run of the reconciler did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reconciled {
    /// Entries of the family the kernel listed: UDP ones, and TCP ones nothing answered.
    pub listed: usize,
    /// Stale entries deleted.
    pub deleted: usize,
    /// Stale entries gone before their deletion (expired, or deleted by someone else).
    pub vanished: usize,
    /// Deletions the kernel refused (each logged).
    pub failed: usize,
    /// The table changed during the listing: what was read was judged all the same (as
    /// kube-proxy does), and the next run sees the rest.
    pub interrupted: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Conntrack(#[from] ConntrackError),
    #[error("the conntrack task: {0}")]
    Task(String),
}

/// The reconciler's run for one family after a successful sync: `serving` is taken from
/// what the family's rules now hold. A protocol none of whose Service ports has a serving
/// endpoint is not read. Failures are logged and counted, never fatal to the sync; returns
/// what it did (`None`: skipped, or the table could not be read).
pub async fn reconcile(
    serving: ServingEndpoints,
    family: IpFamily,
    metrics: &Metrics,
) -> Option<Reconciled> {
    if !serving.has_udp() && !serving.has_tcp() {
        return None;
    }
    let labels = FamilyLabels::of(family);
    let started = Instant::now();
    let result = tokio::task::spawn_blocking(move || reconcile_blocking(family, &serving))
        .await
        .unwrap_or_else(|error| Err(ReconcileError::Task(error.to_string())));
    let elapsed = started.elapsed();
    metrics
        .conntrack_reconciler_duration
        .get_or_create(&labels)
        .observe(elapsed.as_secs_f64());
    match result {
        Ok(done) => {
            metrics
                .conntrack_reconciler_deleted
                .get_or_create(&labels)
                .inc_by(done.deleted as u64);
            if done.failed > 0 {
                metrics
                    .conntrack_reconciler_failures
                    .get_or_create(&labels)
                    .inc_by(done.failed as u64);
            }
            tracing::debug!(
                %family,
                listed = done.listed,
                deleted = done.deleted,
                vanished = done.vanished,
                failed = done.failed,
                interrupted = done.interrupted,
                elapsed_ms = elapsed.as_millis() as u64,
                "conntrack entries reconciled"
            );
            Some(done)
        }
        Err(error) => {
            metrics
                .conntrack_reconciler_failures
                .get_or_create(&labels)
                .inc();
            tracing::warn!(%family, %error, "conntrack reconciliation failed");
            None
        }
    }
}

/// The reconciler's I/O, blocking, in the calling thread's network namespace: lists the
/// UDP entries of `family` and its TCP entries nothing answered (the kernel filters them;
/// a node's many answered TCP connections are not read), each where `serving` has a
/// Service port of the protocol, and deletes those it judges stale, each by its original
/// tuple, zone and id (so an entry made again meanwhile stays).
pub fn reconcile_blocking(
    family: IpFamily,
    serving: &ServingEndpoints,
) -> Result<Reconciled, ReconcileError> {
    let mut conntrack = Conntrack::open()?;
    let mut flows = Vec::new();
    let mut done = Reconciled::default();
    if serving.has_udp() {
        let listing = conntrack.list(family, ctnetlink::IPPROTO_UDP)?;
        done.interrupted |= listing.interrupted;
        flows.extend(listing.flows);
    }
    if serving.has_tcp() {
        let listing = conntrack.list_unreplied(family, ctnetlink::IPPROTO_TCP)?;
        done.interrupted |= listing.interrupted;
        flows.extend(listing.flows);
    }
    done.listed = flows.len();
    for flow in &flows {
        let judged = ConntrackFlow {
            protocol: flow.protocol,
            original_destination: flow.original.destination,
            reply_source: flow.reply.source,
            replied: flow.replied(),
        };
        if !serving.is_stale(&judged) {
            continue;
        }
        match conntrack.delete(flow) {
            Ok(true) => {
                done.deleted += 1;
                tracing::debug!(%family, %flow, "stale conntrack entry deleted");
            }
            Ok(false) => done.vanished += 1,
            Err(error) => {
                done.failed += 1;
                tracing::warn!(%family, %error, "deleting a stale conntrack entry failed");
            }
        }
    }
    Ok(done)
}

fn deletion_succeeded(exit_ok: bool, stderr: &str) -> bool {
    exit_ok || stderr.contains(NOTHING_DELETED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_to_delete_is_not_an_error() {
        assert!(deletion_succeeded(
            false,
            "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n"
        ));
        assert!(deletion_succeeded(
            true,
            "conntrack v1.4.7 (conntrack-tools): 3 flow entries have been deleted.\n"
        ));
        assert!(!deletion_succeeded(
            false,
            "conntrack v1.4.7 (conntrack-tools): Operation failed: invalid parameters\n"
        ));
    }
}
