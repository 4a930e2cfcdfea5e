//! The one background task that converges the world to the store: it hands the data plane
//! every load balancer that is not being deleted (those on a node pool with its members),
//! then, on the edge that leads (every edge of its own store; one elected edge of an edge
//! cluster), moves provisioning ones to active (once realised and the provisioning delay
//! passed) and removes deleting ones (once the delay passed). It runs at start-up, after
//! every change the store applies (this edge's or, on etcd, another's), when leadership
//! moves and when the next delay expires, so a restart resumes where the last run
//! stopped. Transitions are conditional in the store, so a former leader that still
//! makes one changes nothing twice.

use std::borrow::Borrow;
use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cloud_mock_dataplane::{DataPlane, DataPlaneError};
use cloud_mock_sdk::State;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Metrics, STATES};
use crate::model::{StoredLoadBalancer, to_dataplane};
use crate::store::Store;

/// How long the task rests after a pass, in multiples of the pass's own time.
const PASS_REST_FACTOR: u32 = 2;

/// Wait before retrying after a failed data-plane apply or store access.
const RETRY_INTERVAL: Duration = Duration::from_secs(2);

/// Unix time in milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// State changes that are due.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Transitions {
    pub activate: Vec<String>,
    pub remove: Vec<String>,
    /// When the next not-yet-due change falls due (Unix ms).
    pub next_due_ms: Option<u64>,
}

/// Decides which lifecycle changes are due at `now_ms`. Load balancers the data plane
/// could not realise (`unrealised`) stay provisioning.
pub fn plan_transitions(
    lbs: &[impl Borrow<StoredLoadBalancer>],
    now_ms: u64,
    delay: Duration,
    unrealised: &BTreeSet<String>,
) -> Transitions {
    let delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
    let mut plan = Transitions::default();
    for lb in lbs.iter().map(Borrow::borrow) {
        let due = lb.state_since_ms.saturating_add(delay_ms);
        let target = match lb.state {
            State::Provisioning if !unrealised.contains(&lb.id) => &mut plan.activate,
            State::Deleting => &mut plan.remove,
            State::Provisioning | State::Active => continue,
        };
        if due <= now_ms {
            target.push(lb.id.clone());
        } else {
            plan.next_due_ms = Some(plan.next_due_ms.map_or(due, |next| next.min(due)));
        }
    }
    plan
}

/// Load balancers per state, in the order of [`STATES`].
fn count_states(lbs: &[impl Borrow<StoredLoadBalancer>]) -> [i64; 3] {
    STATES.map(|state| {
        let count = lbs
            .iter()
            .filter(|lb| (*lb).borrow().state == state)
            .count();
        i64::try_from(count).unwrap_or(i64::MAX)
    })
}

pub struct Lifecycle {
    store: Store,
    dataplane: DataPlane,
    delay: Duration,
    metrics: Metrics,
}

impl Lifecycle {
    pub fn new(store: Store, dataplane: DataPlane, delay: Duration, metrics: Metrics) -> Self {
        Self {
            store,
            dataplane,
            delay,
            metrics,
        }
    }

    /// Runs until `cancel`, then shuts the data plane down.
    pub async fn run(self, cancel: CancellationToken) {
        let mut changes = self.store.subscribe();
        let mut leadership = self.store.leadership();
        loop {
            changes.mark_unchanged();
            leadership.mark_unchanged();
            let started = tokio::time::Instant::now();
            let converged = self.converge().await;
            let (wait, waited_on_data_plane) = match converged {
                Ok(pass) => (pass.wait, pass.waited_on_data_plane),
                Err(error) => {
                    tracing::error!(%error, "converging load balancers failed; retrying");
                    (Some(RETRY_INTERVAL), Duration::ZERO)
                }
            };
            // A pass reads every LB: under a burst of API writes, back-to-back passes would
            // take a core from the API. Resting twice as long as the pass worked keeps them
            // to a third of one; changes meanwhile are taken by the next pass together. The
            // time it waited on the data plane (an HAProxy reload) took no core, so it is
            // not rested for: that would only delay the next activation.
            let worked = started.elapsed().saturating_sub(waited_on_data_plane);
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(worked * PASS_REST_FACTOR) => {}
            }
            let sleep = async {
                match wait {
                    Some(wait) => tokio::time::sleep(wait).await,
                    None => std::future::pending().await,
                }
            };
            // A sender gone (the store shutting down) leaves the other wakers.
            tokio::select! {
                () = cancel.cancelled() => break,
                Ok(()) = changes.changed() => {}
                Ok(()) = leadership.changed() => {}
                () = sleep => {}
            }
        }
        self.dataplane.shutdown().await;
    }

    /// One pass.
    async fn converge(&self) -> Result<Pass, crate::store::StoreError> {
        let snapshot = self.store.snapshot();
        let lbs = &snapshot.load_balancers;
        self.metrics.set_load_balancers(count_states(lbs));
        // LBs on a node pool get its members here: a pool change reaches every one of them
        // in this one pass, as a backend change the data plane makes without a reload.
        let desired = lbs
            .iter()
            .filter_map(|lb| to_dataplane(lb, snapshot.node_pool_of(lb)))
            .collect();
        let mut retry = None;
        let applying = tokio::time::Instant::now();
        let applied = self.dataplane.apply(desired).await;
        let waited_on_data_plane = applying.elapsed();
        let unrealised: BTreeSet<String> = match applied {
            Ok(()) => BTreeSet::new(),
            Err(DataPlaneError::Incomplete { failures }) => {
                retry = Some(RETRY_INTERVAL);
                failures.into_iter().map(|failure| failure.lb_id).collect()
            }
            Err(error @ DataPlaneError::ShutDown) => {
                tracing::warn!(%error, "data plane refused the desired state");
                return Ok(Pass {
                    wait: None,
                    waited_on_data_plane,
                });
            }
        };
        if !*self.store.leadership().borrow() {
            return Ok(Pass {
                wait: retry,
                waited_on_data_plane,
            });
        }
        let now = now_ms();
        let plan = plan_transitions(lbs, now, self.delay, &unrealised);
        let changed = !plan.activate.is_empty() || !plan.remove.is_empty();
        if !plan.activate.is_empty() {
            for id in &plan.activate {
                tracing::info!(lb = %id, "load balancer active");
            }
            self.store.mark_active(plan.activate, now).await?;
        }
        for id in plan.remove {
            tracing::info!(lb = %id, "load balancer deleted");
            self.store.remove(id).await?;
        }
        if changed {
            // Refresh the per-state gauge and hand the data plane the new set at once.
            return Ok(Pass {
                wait: Some(Duration::ZERO),
                waited_on_data_plane,
            });
        }
        let until_due = plan
            .next_due_ms
            .map(|due| Duration::from_millis(due.saturating_sub(now)));
        Ok(Pass {
            wait: match (until_due, retry) {
                (Some(due), Some(retry)) => Some(due.min(retry)),
                (due, retry) => due.or(retry),
            },
            waited_on_data_plane,
        })
    }
}

/// What one pass leaves for the next.
struct Pass {
    /// How long to wait at most before the next pass (`None`: until woken).
    wait: Option<Duration>,
    /// How long the pass waited for the data plane to apply it.
    waited_on_data_plane: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::spec;

    fn lb(id: &str, state: State, since: u64) -> StoredLoadBalancer {
        StoredLoadBalancer {
            id: id.into(),
            spec: spec(id),
            state,
            version: 1,
            state_since_ms: since,
            idempotency_key: None,
        }
    }

    #[test]
    fn due_changes_happen_and_the_next_one_is_scheduled() {
        let lbs = [
            lb("p-due", State::Provisioning, 0),
            lb("p-later", State::Provisioning, 900),
            lb("active", State::Active, 0),
            lb("d-due", State::Deleting, 500),
            lb("d-later", State::Deleting, 700),
        ];
        let plan = plan_transitions(&lbs, 1500, Duration::from_secs(1), &BTreeSet::new());
        assert_eq!(plan.activate, vec!["p-due".to_string()]);
        assert_eq!(plan.remove, vec!["d-due".to_string()]);
        assert_eq!(plan.next_due_ms, Some(1700));
    }

    #[test]
    fn unrealised_load_balancers_stay_provisioning() {
        let lbs = [lb("p", State::Provisioning, 0)];
        let unrealised = BTreeSet::from(["p".to_string()]);
        let plan = plan_transitions(&lbs, 10_000, Duration::ZERO, &unrealised);
        assert_eq!(plan, Transitions::default());
    }

    #[test]
    fn states_are_counted() {
        let lbs = [
            lb("a", State::Provisioning, 0),
            lb("b", State::Active, 0),
            lb("c", State::Active, 0),
        ];
        assert_eq!(count_states(&lbs), [1, 2, 0]);
    }
}
