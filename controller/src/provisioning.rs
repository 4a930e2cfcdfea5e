//! Provisioning LBs are waited out beside the reconciler, not in it. A reconcile that leaves
//! an LB provisioning hands it here and frees its slot; one held read
//! ([`crate::provider::LoadBalancerProvider::await_provisioned`]) waits until the LB is
//! active; its answer becomes the next reconcile's observation of the cloud, and that
//! reconcile starts at once. A create thus costs the create and this one read, and the
//! Service has its ingress as soon as the LB serves, not at the next poll. The reconciler
//! hands over the read itself, so this module knows the held reads, not the reconciler.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::mpsc;

use crate::provider::{ObservedLoadBalancer, Owner, ProviderError};

/// How long one read may be held; a provisioning LB still provisioning then is handed to
/// a reconcile (which reports it in the Service's condition) and waited for again.
pub const HELD_READ: Duration = Duration::from_secs(20);

/// Held reads at once at most (each holds a connection to the cloud); beyond them a
/// provisioning LB is polled, as without the capability.
const MAX_WAITS: usize = 1024;

/// An answer older than this is read again rather than used (its reconcile was late).
const FRESH_FOR: Duration = Duration::from_secs(30);

/// The held reads running and the answers not yet taken, by Service.
pub struct ProvisioningWaits {
    state: Mutex<Waits>,
    /// Starts a reconcile of the Service (the controller's `reconcile_on` stream).
    wake: mpsc::UnboundedSender<ObjectRef<Service>>,
}

#[derive(Default)]
struct Waits {
    running: HashSet<ObjectRef<Service>>,
    answers: HashMap<ObjectRef<Service>, (Instant, ObservedLoadBalancer)>,
}

impl ProvisioningWaits {
    pub fn new(wake: mpsc::UnboundedSender<ObjectRef<Service>>) -> Self {
        Self {
            state: Mutex::default(),
            wake,
        }
    }

    fn state(&self) -> MutexGuard<'_, Waits> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The held read's answer for `svc`, when it is fresh and `owner`'s LB; taken, so it
    /// is used once.
    pub fn take(&self, svc: &ObjectRef<Service>, owner: &Owner) -> Option<ObservedLoadBalancer> {
        let (at, lb) = self.state().answers.remove(svc)?;
        (at.elapsed() < FRESH_FOR && lb.owner.as_ref() == Some(owner)).then_some(lb)
    }

    fn answered(&self, svc: ObjectRef<Service>, lb: Option<ObservedLoadBalancer>) {
        let mut state = self.state();
        state.running.remove(&svc);
        if let Some(lb) = lb {
            // Answers of Services deleted meanwhile are never taken: drop the stale ones
            // now and then, not on every answer.
            if state.answers.len() >= MAX_WAITS {
                state.answers.retain(|_, (at, _)| at.elapsed() < FRESH_FOR);
            }
            state.answers.insert(svc.clone(), (Instant::now(), lb));
        }
        drop(state);
        // The receiver goes only at shutdown.
        let _ = self.wake.send(svc);
    }

    /// Runs `held_read`, the read of `svc`'s LB `lb_id` that the cloud holds until it is
    /// active ([`crate::provider::LoadBalancerProvider::await_provisioned`] with
    /// [`HELD_READ`]), beside the reconciler, unless one for it runs already; `false` when
    /// too many are held, so the caller polls.
    pub fn wait_out<R>(self: &Arc<Self>, svc: ObjectRef<Service>, lb_id: &str, held_read: R) -> bool
    where
        R: Future<Output = Result<Option<ObservedLoadBalancer>, ProviderError>> + Send + 'static,
    {
        {
            let mut state = self.state();
            if state.running.contains(&svc) {
                return true;
            }
            if state.running.len() >= MAX_WAITS {
                return false;
            }
            state.running.insert(svc.clone());
        }
        let waits = self.clone();
        let lb_id = lb_id.to_owned();
        tokio::spawn(async move {
            let answer = match held_read.await {
                Ok(answer) => answer,
                Err(error) => {
                    // The reconcile it starts reads the LB the usual way.
                    tracing::warn!(service = %svc, lb = %lb_id, %error, "waiting out provisioning failed");
                    None
                }
            };
            waits.answered(svc, answer);
        });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::tests::{desired, observed_from};

    #[test]
    fn an_answer_is_taken_once_and_only_for_its_owner() {
        let (wake, mut woken) = mpsc::unbounded_channel();
        let waits = ProvisioningWaits::new(wake);
        let svc = ObjectRef::<Service>::new("web").within("default");
        let lb = observed_from(&desired());
        let owner = lb.owner.clone().unwrap();
        waits.state().running.insert(svc.clone());

        waits.answered(svc.clone(), Some(lb.clone()));
        assert_eq!(
            woken.try_recv().ok(),
            Some(svc.clone()),
            "its reconcile is started"
        );
        assert!(waits.state().running.is_empty());
        let stranger = Owner {
            uid: "another-uid".into(),
            ..owner.clone()
        };
        assert_eq!(
            waits.take(&svc, &stranger),
            None,
            "the Service was replaced meanwhile"
        );

        waits.answered(svc.clone(), Some(lb.clone()));
        assert_eq!(waits.take(&svc, &owner), Some(lb));
        assert_eq!(waits.take(&svc, &owner), None, "used once");

        // Gone (or the read failed): the reconcile is started, and reads for itself.
        waits.answered(svc.clone(), None);
        assert_eq!(woken.try_recv().ok(), Some(svc.clone()));
        assert_eq!(waits.take(&svc, &owner), None);
    }
}
