//! Service status: `status.loadBalancer.ingress` and the `LoadBalancerReady` condition
//! explaining why a Service is not served yet. The write is computed here, purely, and is
//! `None` when nothing would change, so an idle controller never writes. Ingress and our
//! condition are written with server-side apply under our field manager, so conditions of
//! other writers are never overwritten; clearing them (cleanup) is a merge patch.

use std::net::Ipv4Addr;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{LoadBalancerIngress, PortStatus, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use serde_json::{Value, json};

use crate::provider::{AddressRefusal, DesiredLoadBalancer, LoadBalancerMode, Protocol};

pub const CONDITION_TYPE: &str = "LoadBalancerReady";

/// Why the `LoadBalancerReady` condition has its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConditionReason {
    Ready,
    Provisioning,
    NoEligibleNodes,
    /// The cloud refused the address (pool, requested address or sharing).
    AddressRefused(AddressRefusal),
    CloudError,
    InvalidConfiguration,
}

impl ConditionReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionReason::Ready => "LoadBalancerActive",
            ConditionReason::Provisioning => "Provisioning",
            ConditionReason::NoEligibleNodes => "NoEligibleNodes",
            ConditionReason::AddressRefused(refusal) => match refusal {
                AddressRefusal::UnknownPool => "UnknownAddressPool",
                AddressRefusal::PoolExhausted => "AddressPoolExhausted",
                AddressRefusal::OutsidePools => "AddressOutsidePools",
                AddressRefusal::Taken => "AddressInUse",
                AddressRefusal::PortConflict => "SharedAddressPortConflict",
                AddressRefusal::SharingModeMismatch => "SharedAddressModeMismatch",
            },
            ConditionReason::CloudError => "CloudError",
            ConditionReason::InvalidConfiguration => "InvalidConfiguration",
        }
    }

    fn status(self) -> &'static str {
        if self == ConditionReason::Ready {
            "True"
        } else {
            "False"
        }
    }
}

/// Our condition as it should read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredCondition {
    pub reason: ConditionReason,
    pub message: String,
}

/// What to do with `status.loadBalancer.ingress`.
#[derive(Debug, Clone, PartialEq)]
pub enum IngressUpdate {
    /// Leave it as it is (e.g. a transient cloud error on an LB that already serves).
    Keep,
    Set(Vec<LoadBalancerIngress>),
    Clear,
}

/// The ingress entry for an LB with this VIP: ipMode `VIP` in passthrough mode (traffic
/// arrives addressed to the VIP, so in-cluster clients may short-cut it), `Proxy` in proxy
/// mode (traffic arrives from the LB; in-cluster clients must go through it too).
pub fn ingress_for(vip: Ipv4Addr, desired: &DesiredLoadBalancer) -> Vec<LoadBalancerIngress> {
    let ip_mode = match desired.mode {
        LoadBalancerMode::Passthrough => "VIP",
        LoadBalancerMode::Proxy => "Proxy",
    };
    let ports = desired
        .listeners
        .iter()
        .map(|l| PortStatus {
            port: i32::from(l.port),
            protocol: match l.protocol {
                Protocol::Tcp => "TCP".into(),
                Protocol::Udp => "UDP".into(),
            },
            error: None,
        })
        .collect();
    vec![LoadBalancerIngress {
        ip: Some(vip.to_string()),
        ip_mode: Some(ip_mode.into()),
        ports: Some(ports),
        hostname: None,
    }]
}

/// The Service's `status.loadBalancer.ingress` (empty when unset).
pub fn current_ingress(svc: &Service) -> &[LoadBalancerIngress] {
    svc.status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_deref())
        .unwrap_or_default()
}

fn current_conditions(svc: &Service) -> Vec<Condition> {
    svc.status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default()
}

/// The conditions list with ours replaced (or removed when `desired` is `None`).
/// lastTransitionTime moves only when the condition's status flips.
fn merged_conditions(
    current: &[Condition],
    desired: Option<&DesiredCondition>,
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    let previous = current.iter().find(|c| c.type_ == CONDITION_TYPE);
    let mut merged: Vec<Condition> = current
        .iter()
        .filter(|c| c.type_ != CONDITION_TYPE)
        .cloned()
        .collect();
    if let Some(desired) = desired {
        let status = desired.reason.status();
        let last_transition_time = match previous {
            Some(p) if p.status == status => p.last_transition_time.clone(),
            _ => Time(now),
        };
        merged.push(Condition {
            type_: CONDITION_TYPE.into(),
            status: status.into(),
            reason: desired.reason.as_str().into(),
            message: desired.message.clone(),
            observed_generation: generation,
            last_transition_time,
        });
    }
    merged
}

/// A status write: a server-side apply of the fields we own, or the merge patch that
/// clears them.
#[derive(Debug, Clone, PartialEq)]
pub enum StatusWrite {
    Apply(Value),
    Merge(Value),
}

impl StatusWrite {
    pub fn body(&self) -> &Value {
        match self {
            StatusWrite::Apply(v) | StatusWrite::Merge(v) => v,
        }
    }
}

/// The write that brings the status to `ingress` + `condition`, or `None` when it already
/// matches. The apply body holds only our fields: the ingress (kept or new) and our
/// condition; the list of conditions is keyed by type, so the API server keeps the rest.
pub fn status_write(
    svc: &Service,
    ingress: &IngressUpdate,
    condition: Option<&DesiredCondition>,
    now: Timestamp,
) -> Option<StatusWrite> {
    let current_ingress = current_ingress(svc);
    let new_ingress = match ingress {
        IngressUpdate::Keep => current_ingress.to_vec(),
        IngressUpdate::Set(v) => v.clone(),
        IngressUpdate::Clear => Vec::new(),
    };
    let current_conditions = current_conditions(svc);
    let new_conditions =
        merged_conditions(&current_conditions, condition, svc.metadata.generation, now);
    if new_ingress.as_slice() == current_ingress && new_conditions == current_conditions {
        return None;
    }
    if matches!(ingress, IngressUpdate::Clear) {
        let conditions_value = if new_conditions.is_empty() {
            Value::Null
        } else {
            json!(new_conditions)
        };
        return Some(StatusWrite::Merge(json!({
            "status": {
                "loadBalancer": { "ingress": Value::Null },
                "conditions": conditions_value,
            }
        })));
    }
    let ours: Vec<&Condition> = new_conditions
        .iter()
        .filter(|c| c.type_ == CONDITION_TYPE)
        .collect();
    let load_balancer = if new_ingress.is_empty() {
        json!({})
    } else {
        json!({ "ingress": new_ingress })
    };
    Some(StatusWrite::Apply(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": svc.metadata.name,
            "namespace": svc.metadata.namespace,
        },
        "status": {
            "loadBalancer": load_balancer,
            "conditions": ours,
        }
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::{Listener, Owner};
    use k8s_openapi::api::core::v1::{LoadBalancerStatus, ServiceStatus};
    use std::collections::BTreeSet;

    fn desired(mode: LoadBalancerMode) -> DesiredLoadBalancer {
        DesiredLoadBalancer {
            owner: Owner {
                cluster_id: "c".parse().unwrap(),
                namespace: "default".into(),
                name: "web".into(),
                uid: "u".into(),
            },
            mode,
            address: Default::default(),
            listeners: vec![
                Listener {
                    protocol: Protocol::Tcp,
                    port: 80,
                    backend_port: 30080,
                    health_check: None,
                },
                Listener {
                    protocol: Protocol::Udp,
                    port: 53,
                    backend_port: 30053,
                    health_check: None,
                },
            ],
            backends: BTreeSet::new(),
            source_ranges: vec![],
        }
    }

    fn vip() -> Ipv4Addr {
        Ipv4Addr::new(198, 51, 100, 5)
    }

    fn ready() -> DesiredCondition {
        DesiredCondition {
            reason: ConditionReason::Ready,
            message: "served".into(),
        }
    }

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).unwrap()
    }

    /// Performs our write the way the API server would: an apply replaces the ingress
    /// and merges conditions by type; the merge patch replaces both.
    fn apply(svc: &Service, write: &StatusWrite) -> Service {
        let mut out = svc.clone();
        let status = &write.body()["status"];
        let ingress: Option<Vec<LoadBalancerIngress>> =
            serde_json::from_value(status["loadBalancer"]["ingress"].clone()).unwrap();
        let sent: Option<Vec<Condition>> =
            serde_json::from_value(status["conditions"].clone()).unwrap();
        let conditions = match write {
            StatusWrite::Merge(_) => sent,
            StatusWrite::Apply(_) => {
                let sent = sent.unwrap_or_default();
                let mut merged: Vec<Condition> = current_conditions(svc)
                    .into_iter()
                    .filter(|c| !sent.iter().any(|s| s.type_ == c.type_))
                    .collect();
                merged.extend(sent);
                Some(merged)
            }
        };
        out.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus { ingress }),
            conditions,
        });
        out
    }

    #[test]
    fn ip_mode_follows_lb_mode() {
        let proxy = ingress_for(vip(), &desired(LoadBalancerMode::Proxy));
        assert_eq!(proxy[0].ip_mode.as_deref(), Some("Proxy"));
        assert_eq!(proxy[0].ip.as_deref(), Some("198.51.100.5"));
        assert_eq!(proxy[0].ports.as_ref().unwrap().len(), 2);
        let pass = ingress_for(vip(), &desired(LoadBalancerMode::Passthrough));
        assert_eq!(pass[0].ip_mode.as_deref(), Some("VIP"));
    }

    #[test]
    fn patch_only_on_change() {
        let svc = crate::spec::tests::service("web");
        let ingress = IngressUpdate::Set(ingress_for(vip(), &desired(LoadBalancerMode::Proxy)));
        let patch = status_write(&svc, &ingress, Some(&ready()), t(100)).unwrap();
        let updated = apply(&svc, &patch);
        assert_eq!(
            status_write(&updated, &ingress, Some(&ready()), t(200)),
            None
        );
        assert_eq!(
            status_write(&updated, &IngressUpdate::Keep, Some(&ready()), t(200)),
            None
        );
    }

    #[test]
    fn transition_time_kept_unless_status_changes() {
        let svc = crate::spec::tests::service("web");
        let provisioning = DesiredCondition {
            reason: ConditionReason::Provisioning,
            message: "waiting".into(),
        };
        let s1 = apply(
            &svc,
            &status_write(&svc, &IngressUpdate::Keep, Some(&provisioning), t(100)).unwrap(),
        );
        // Same status (False), different reason: the reason changes, the time does not.
        let cloud = DesiredCondition {
            reason: ConditionReason::CloudError,
            message: "503".into(),
        };
        let s2 = apply(
            &s1,
            &status_write(&s1, &IngressUpdate::Keep, Some(&cloud), t(200)).unwrap(),
        );
        let c2 = &s2.status.as_ref().unwrap().conditions.as_ref().unwrap()[0];
        assert_eq!(c2.reason, "CloudError");
        assert_eq!(c2.last_transition_time, Time(t(100)));
        let s3 = apply(
            &s2,
            &status_write(&s2, &IngressUpdate::Keep, Some(&ready()), t(300)).unwrap(),
        );
        let c3 = &s3.status.as_ref().unwrap().conditions.as_ref().unwrap()[0];
        assert_eq!(
            (c3.status.as_str(), &c3.last_transition_time),
            ("True", &Time(t(300)))
        );
    }

    fn reason_strategy() -> impl proptest::strategy::Strategy<Value = ConditionReason> {
        proptest::sample::select(vec![
            ConditionReason::Ready,
            ConditionReason::Provisioning,
            ConditionReason::NoEligibleNodes,
            ConditionReason::AddressRefused(AddressRefusal::Taken),
            ConditionReason::AddressRefused(AddressRefusal::PortConflict),
            ConditionReason::CloudError,
            ConditionReason::InvalidConfiguration,
        ])
    }

    proptest::proptest! {
        // Whatever sequence of outcomes, applying our patch converges in one step (the
        // next computation is a no-op), and the transition time moves only on flips.
        #[test]
        fn patches_converge_and_times_move_only_on_flips(
            steps in proptest::collection::vec((reason_strategy(), proptest::bool::ANY), 1..12)
        ) {
            let mut svc = crate::spec::tests::service("web");
            let mut last: Option<(String, Time)> = None;
            for (i, (reason, serving)) in steps.into_iter().enumerate() {
                let now = t(1000 + i64::try_from(i).unwrap());
                let ingress = if serving {
                    IngressUpdate::Set(ingress_for(vip(), &desired(LoadBalancerMode::Proxy)))
                } else {
                    IngressUpdate::Keep
                };
                let condition = DesiredCondition { reason, message: reason.as_str().into() };
                if let Some(patch) = status_write(&svc, &ingress, Some(&condition), now) {
                    svc = apply(&svc, &patch);
                }
                proptest::prop_assert_eq!(status_write(&svc, &ingress, Some(&condition), now), None);
                let ours = svc.status.as_ref().unwrap().conditions.as_ref().unwrap()[0].clone();
                if let Some((status, time)) = &last {
                    if *status == ours.status {
                        proptest::prop_assert_eq!(time, &ours.last_transition_time);
                    } else {
                        proptest::prop_assert_eq!(&ours.last_transition_time, &Time(now));
                    }
                }
                last = Some((ours.status.clone(), ours.last_transition_time.clone()));
            }
        }
    }

    #[test]
    fn foreign_conditions_are_preserved_and_clear_removes_ours() {
        let mut svc = crate::spec::tests::service("web");
        let foreign = Condition {
            type_: "Other".into(),
            status: "True".into(),
            reason: "X".into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: Time(t(1)),
        };
        svc.status = Some(ServiceStatus {
            conditions: Some(vec![foreign.clone()]),
            load_balancer: None,
        });
        let ingress = IngressUpdate::Set(ingress_for(vip(), &desired(LoadBalancerMode::Proxy)));
        let write = status_write(&svc, &ingress, Some(&ready()), t(5)).unwrap();
        // The apply carries our condition only; the other writer's is not ours to send.
        let sent = write.body()["status"]["conditions"].as_array().unwrap();
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0]["type"], CONDITION_TYPE);
        let s1 = apply(&svc, &write);
        assert_eq!(
            s1.status
                .as_ref()
                .unwrap()
                .conditions
                .as_ref()
                .unwrap()
                .len(),
            2
        );
        let patch = status_write(&s1, &IngressUpdate::Clear, None, t(6)).unwrap();
        assert!(matches!(patch, StatusWrite::Merge(_)));
        assert_eq!(
            patch.body()["status"]["loadBalancer"]["ingress"],
            Value::Null
        );
        let s2 = apply(&s1, &patch);
        assert_eq!(
            s2.status.as_ref().unwrap().conditions.as_ref().unwrap(),
            &vec![foreign]
        );
        assert_eq!(status_write(&s2, &IngressUpdate::Clear, None, t(7)), None);
    }
}
