//! Runs the core crate's stale-UDP conntrack deletions
//! ([`tandem_proxy_rules::conntrack::stale_udp_deletions`]) after a successful sync.

use std::process::Stdio;

use tandem_proxy_rules::conntrack::{ConntrackDeletion, stale_udp_deletions};
use tandem_proxy_rules::model::{IpFamily, ProxyState};
use tokio::process::Command;

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
