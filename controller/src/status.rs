//! Service status: `status.loadBalancer.ingress` and the `LoadBalancerReady` condition
//! explaining why a Service is not served yet. The write is computed here, purely, and is
//! `None` when nothing would change, so an idle controller never writes. Ingress and our
//! condition go in one strategic merge patch that touches only our condition, so
//! conditions of other writers are never overwritten.

use std::net::IpAddr;

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
    /// A create or update would pass a quota of the cloud account.
    QuotaExceeded,
    /// The cloud does not let our credentials do what the Service needs.
    CloudForbidden,
    InvalidConfiguration,
    /// The Service needs what its provider cannot do.
    Unsupported,
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
                AddressRefusal::PoolLacksFamily => "AddressPoolLacksFamily",
                AddressRefusal::PoolNotPermitted => "AddressPoolNotPermitted",
            },
            ConditionReason::CloudError => "CloudError",
            ConditionReason::QuotaExceeded => "QuotaExceeded",
            ConditionReason::CloudForbidden => "CloudForbidden",
            ConditionReason::InvalidConfiguration => "InvalidConfiguration",
            ConditionReason::Unsupported => "UnsupportedByProvider",
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

/// The ingress of an LB with these VIPs (one per family, in the Service's family order),
/// one entry each: ipMode `VIP` in passthrough mode (traffic arrives addressed to the VIP,
/// so in-cluster clients may short-cut it), `Proxy` in proxy mode (traffic arrives from
/// the LB; in-cluster clients must go through it too). A `hostname` goes on every entry,
/// or, for an LB without VIPs, on one entry of its own with no ipMode (the API allows
/// one only beside an ip; kube-proxy takes no short-cut to a hostname).
pub fn ingress_for(
    vips: &[IpAddr],
    hostname: Option<&str>,
    desired: &DesiredLoadBalancer,
) -> Vec<LoadBalancerIngress> {
    let ip_mode = match desired.mode {
        LoadBalancerMode::Passthrough => "VIP",
        LoadBalancerMode::Proxy => "Proxy",
    };
    let ports: Vec<PortStatus> = desired
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
    let hostname = hostname.map(str::to_owned);
    if vips.is_empty() {
        return hostname
            .map(|hostname| LoadBalancerIngress {
                hostname: Some(hostname),
                ports: Some(ports),
                ..LoadBalancerIngress::default()
            })
            .into_iter()
            .collect();
    }
    vips.iter()
        .map(|vip| LoadBalancerIngress {
            ip: Some(vip.to_string()),
            ip_mode: Some(ip_mode.into()),
            ports: Some(ports.clone()),
            hostname: hostname.clone(),
        })
        .collect()
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

/// Which optional fields of `status.loadBalancer.ingress[]` the API server keeps.
///
/// A server drops fields it does not know from a patch (and refuses them in a server-side
/// apply, which is why status is never applied). `ports` came with 1.20 (KEP-1435) and
/// `ipMode` with 1.29 (KEP-1860); a server whose feature gate is off drops them too. So the
/// version gives the first guess, and a write whose answer lacks a field we sent corrects
/// it: either way the controller never writes a field the server discards, and never
/// rewrites a status for want of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IngressFields {
    pub ip_mode: bool,
    pub ports: bool,
}

impl IngressFields {
    /// The newest API: every field.
    pub const ALL: Self = Self {
        ip_mode: true,
        ports: true,
    };

    /// The fields in the schema of Kubernetes `1.minor`.
    pub fn of_minor(minor: u32) -> Self {
        Self {
            ip_mode: minor >= 29,
            ports: minor >= 20,
        }
    }

    /// The fields of the server that answered `/version`; [`Self::ALL`] when its version
    /// does not parse (vendor builds write e.g. minor `"21+"`), left to [`Self::learn`].
    pub fn of_version(major: &str, minor: &str) -> Self {
        let digits: String = minor.chars().take_while(char::is_ascii_digit).collect();
        match (major, digits.parse()) {
            ("1", Ok(minor)) => Self::of_minor(minor),
            _ => Self::ALL,
        }
    }

    /// `ingress` with only the fields the server keeps.
    pub fn project(self, ingress: &[LoadBalancerIngress]) -> Vec<LoadBalancerIngress> {
        ingress
            .iter()
            .map(|entry| LoadBalancerIngress {
                ip_mode: entry.ip_mode.clone().filter(|_| self.ip_mode),
                ports: entry.ports.clone().filter(|_| self.ports),
                ..entry.clone()
            })
            .collect()
    }

    /// The fields after a write of `sent` came back as `written`: one sent but not kept
    /// is one the server drops.
    pub fn learn(self, sent: &[LoadBalancerIngress], written: &[LoadBalancerIngress]) -> Self {
        let dropped = |has: fn(&LoadBalancerIngress) -> bool| {
            sent.iter().any(has) && !written.iter().any(has)
        };
        Self {
            ip_mode: self.ip_mode && !dropped(|i| i.ip_mode.is_some()),
            ports: self.ports && !dropped(|i| i.ports.is_some()),
        }
    }
}

/// A status write: one strategic merge patch of the status subresource, the form every
/// server since 1.21 takes (the cloud-provider service controller writes status the same
/// way). `ingress` is replaced whole; `conditions` merge by type, so only ours is sent
/// (or deleted) and the conditions of other writers stay as they are.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusWrite {
    pub body: Value,
    /// The ingress the patch sets, if it sets one: what [`IngressFields::learn`] checks.
    pub ingress: Option<Vec<LoadBalancerIngress>>,
}

/// Our condition as a strategic-merge list element: a field we leave unset is sent as
/// null, lest the server keep the old element's value.
fn condition_patch(condition: &Condition) -> Value {
    let mut value = json!(condition);
    if condition.observed_generation.is_none() {
        value["observedGeneration"] = Value::Null;
    }
    value
}

/// The write that brings the status to `ingress` + `condition`, or `None` when it already
/// matches. Only the fields `fields` says the server keeps are written or compared.
pub fn status_write(
    svc: &Service,
    ingress: &IngressUpdate,
    condition: Option<&DesiredCondition>,
    fields: IngressFields,
    now: Timestamp,
) -> Option<StatusWrite> {
    let current_ingress = current_ingress(svc);
    let new_ingress = match ingress {
        IngressUpdate::Keep => None,
        IngressUpdate::Set(v) => Some(fields.project(v)),
        IngressUpdate::Clear => Some(Vec::new()),
    }
    .filter(|new| new.as_slice() != current_ingress);
    let current_conditions = current_conditions(svc);
    let previous = current_conditions
        .iter()
        .find(|c| c.type_ == CONDITION_TYPE);
    let new_conditions =
        merged_conditions(&current_conditions, condition, svc.metadata.generation, now);
    let ours = new_conditions.iter().find(|c| c.type_ == CONDITION_TYPE);
    let condition_patch = match (previous, ours) {
        (previous, Some(ours)) if previous != Some(ours) => Some(condition_patch(ours)),
        (Some(_), None) => Some(json!({ "$patch": "delete", "type": CONDITION_TYPE })),
        _ => None,
    };
    if new_ingress.is_none() && condition_patch.is_none() {
        return None;
    }
    let mut status = serde_json::Map::new();
    if let Some(new) = &new_ingress {
        let value = if new.is_empty() {
            Value::Null
        } else {
            json!(new)
        };
        status.insert("loadBalancer".into(), json!({ "ingress": value }));
    }
    if let Some(patch) = condition_patch {
        status.insert("conditions".into(), json!([patch]));
    }
    Some(StatusWrite {
        body: json!({ "status": status }),
        ingress: new_ingress,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::provider::{Listener, Owner};
    use k8s_openapi::api::core::v1::{LoadBalancerStatus, ServiceStatus};
    use std::collections::BTreeSet;
    use tandem_common::IpFamily;

    fn desired(mode: LoadBalancerMode) -> DesiredLoadBalancer {
        DesiredLoadBalancer {
            owner: Owner {
                cluster_id: "c".parse().unwrap(),
                namespace: "default".into(),
                name: "web".into(),
                uid: "u".into(),
            },
            mode,
            ip_families: vec![IpFamily::V4],
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
            node_pool: None,
            source_ranges: vec![],
        }
    }

    fn vip() -> [IpAddr; 1] {
        ["198.51.100.5".parse().unwrap()]
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

    /// Performs our write the way the API server would: a strategic merge that replaces
    /// or removes the ingress, and merges conditions by type (`$patch: delete` removes
    /// one); fields the server lacks are dropped.
    fn apply_as(svc: &Service, write: &StatusWrite, server: IngressFields) -> Service {
        let mut out = svc.clone();
        let status = out.status.get_or_insert_with(Default::default);
        let patch = &write.body["status"];
        if let Some(lb) = patch.get("loadBalancer") {
            let ingress: Option<Vec<LoadBalancerIngress>> =
                serde_json::from_value(lb["ingress"].clone()).unwrap();
            status.load_balancer = Some(LoadBalancerStatus {
                ingress: ingress.map(|i| server.project(&i)),
            });
        }
        if let Some(sent) = patch.get("conditions") {
            let mut conditions = status.conditions.take().unwrap_or_default();
            for element in sent.as_array().unwrap() {
                let kind = element["type"].as_str().unwrap();
                conditions.retain(|c| c.type_ != kind);
                if element.get("$patch").is_none() {
                    conditions.push(serde_json::from_value(element.clone()).unwrap());
                }
            }
            status.conditions = (!conditions.is_empty()).then_some(conditions);
        }
        out
    }

    pub(crate) fn apply(svc: &Service, write: &StatusWrite) -> Service {
        apply_as(svc, write, IngressFields::ALL)
    }

    fn write(
        svc: &Service,
        ingress: &IngressUpdate,
        condition: Option<&DesiredCondition>,
        now: Timestamp,
    ) -> Option<StatusWrite> {
        status_write(svc, ingress, condition, IngressFields::ALL, now)
    }

    fn ingress_of(svc: &Service) -> Vec<LoadBalancerIngress> {
        current_ingress(svc).to_vec()
    }

    #[test]
    fn fields_follow_the_server_version() {
        let v1_21 = IngressFields::of_version("1", "21+");
        assert_eq!(
            v1_21,
            IngressFields {
                ip_mode: false,
                ports: true
            }
        );
        assert_eq!(IngressFields::of_version("1", "34"), IngressFields::ALL);
        assert!(!IngressFields::of_version("1", "19").ports);
        assert_eq!(IngressFields::of_version("", "x"), IngressFields::ALL);
    }

    #[test]
    fn a_v1_21_server_gets_no_ip_mode_and_is_not_rewritten() {
        let svc = crate::spec::tests::service("web");
        let v1_21 = IngressFields::of_minor(21);
        let ingress =
            IngressUpdate::Set(ingress_for(&vip(), None, &desired(LoadBalancerMode::Proxy)));
        let patch = status_write(&svc, &ingress, Some(&ready()), v1_21, t(1)).unwrap();
        let sent = &patch.body["status"]["loadBalancer"]["ingress"][0];
        assert_eq!(sent["ip"], "198.51.100.5");
        assert!(sent.get("ipMode").is_none() && sent.get("ports").is_some());
        let written = apply_as(&svc, &patch, v1_21);
        assert_eq!(
            status_write(&written, &ingress, Some(&ready()), v1_21, t(2)),
            None
        );
    }

    #[test]
    fn one_entry_per_family_in_order_on_a_v1_21_server_and_a_family_less_rewrites() {
        let svc = crate::spec::tests::service("web");
        let v1_21 = IngressFields::of_minor(21);
        let mut dual = desired(LoadBalancerMode::Passthrough);
        dual.ip_families = vec![IpFamily::V6, IpFamily::V4];
        let vips: Vec<IpAddr> = ["2001:db8:51:100::5", "198.51.100.5"]
            .iter()
            .map(|v| v.parse().unwrap())
            .collect();
        let ingress = IngressUpdate::Set(ingress_for(&vips, None, &dual));
        let patch = status_write(&svc, &ingress, Some(&ready()), v1_21, t(1)).unwrap();
        let sent = patch.body["status"]["loadBalancer"]["ingress"]
            .as_array()
            .unwrap();
        let sent_ips: Vec<&str> = sent.iter().map(|e| e["ip"].as_str().unwrap()).collect();
        assert_eq!(sent_ips, ["2001:db8:51:100::5", "198.51.100.5"]);
        assert!(
            sent.iter()
                .all(|e| e.get("ipMode").is_none() && e["ports"].as_array().unwrap().len() == 2)
        );
        let written = apply_as(&svc, &patch, v1_21);
        assert_eq!(
            status_write(&written, &ingress, Some(&ready()), v1_21, t(2)),
            None
        );
        // Downgraded to its primary family: the other entry goes, in one write.
        let single = IngressUpdate::Set(ingress_for(&vips[..1], None, &dual));
        let patch = status_write(&written, &single, Some(&ready()), v1_21, t(3)).unwrap();
        let ips: Vec<String> = current_ingress(&apply_as(&written, &patch, v1_21))
            .iter()
            .filter_map(|e| e.ip.clone())
            .collect();
        assert_eq!(ips, ["2001:db8:51:100::5"]);
    }

    #[test]
    fn a_field_the_server_drops_is_learned_and_then_not_compared() {
        let svc = crate::spec::tests::service("web");
        // A 1.29 server with its LoadBalancerIPMode gate off.
        let server = IngressFields {
            ip_mode: false,
            ports: true,
        };
        let guess = IngressFields::of_minor(29);
        let ingress =
            IngressUpdate::Set(ingress_for(&vip(), None, &desired(LoadBalancerMode::Proxy)));
        let patch = status_write(&svc, &ingress, Some(&ready()), guess, t(1)).unwrap();
        let written = apply_as(&svc, &patch, server);
        let learned = guess.learn(patch.ingress.as_deref().unwrap(), &ingress_of(&written));
        assert_eq!(learned, server);
        assert_eq!(
            status_write(&written, &ingress, Some(&ready()), learned, t(2)),
            None
        );
        // What the server keeps stays.
        assert_eq!(
            IngressFields::ALL.learn(patch.ingress.as_deref().unwrap(), &ingress_of(&written)),
            server
        );
    }

    #[test]
    fn ip_mode_follows_lb_mode() {
        let proxy = ingress_for(&vip(), None, &desired(LoadBalancerMode::Proxy));
        assert_eq!(proxy[0].ip_mode.as_deref(), Some("Proxy"));
        assert_eq!(proxy[0].ip.as_deref(), Some("198.51.100.5"));
        assert_eq!(proxy[0].ports.as_ref().unwrap().len(), 2);
        let pass = ingress_for(&vip(), None, &desired(LoadBalancerMode::Passthrough));
        assert_eq!(pass[0].ip_mode.as_deref(), Some("VIP"));
    }

    #[test]
    fn a_hostname_goes_beside_the_vips_or_alone() {
        let d = desired(LoadBalancerMode::Passthrough);
        let both = ingress_for(&vip(), Some("lb-1.example.net"), &d);
        assert_eq!(both.len(), 1);
        assert_eq!(
            (both[0].ip.as_deref(), both[0].hostname.as_deref()),
            (Some("198.51.100.5"), Some("lb-1.example.net"))
        );
        let alone = ingress_for(&[], Some("lb-1.example.net"), &d);
        assert_eq!(alone.len(), 1);
        assert_eq!(alone[0].hostname.as_deref(), Some("lb-1.example.net"));
        // The API accepts an ipMode only beside an ip.
        assert_eq!(
            (alone[0].ip.as_deref(), alone[0].ip_mode.as_deref()),
            (None, None)
        );
        assert_eq!(alone[0].ports.as_ref().map(Vec::len), Some(2));
        assert!(ingress_for(&[], None, &d).is_empty());
        // A hostname that changes is a status write; the same one is not.
        let svc = crate::spec::tests::service("web");
        let named = IngressUpdate::Set(alone);
        let patch = write(&svc, &named, Some(&ready()), t(100)).unwrap();
        let updated = apply(&svc, &patch);
        assert_eq!(write(&updated, &named, Some(&ready()), t(200)), None);
        let renamed = IngressUpdate::Set(ingress_for(&[], Some("lb-2.example.net"), &d));
        assert!(write(&updated, &renamed, Some(&ready()), t(200)).is_some());
    }

    #[test]
    fn patch_only_on_change() {
        let svc = crate::spec::tests::service("web");
        let ingress =
            IngressUpdate::Set(ingress_for(&vip(), None, &desired(LoadBalancerMode::Proxy)));
        let patch = write(&svc, &ingress, Some(&ready()), t(100)).unwrap();
        let updated = apply(&svc, &patch);
        assert_eq!(write(&updated, &ingress, Some(&ready()), t(200)), None);
        assert_eq!(
            write(&updated, &IngressUpdate::Keep, Some(&ready()), t(200)),
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
            &write(&svc, &IngressUpdate::Keep, Some(&provisioning), t(100)).unwrap(),
        );
        // Same status (False), different reason: the reason changes, the time does not.
        let cloud = DesiredCondition {
            reason: ConditionReason::CloudError,
            message: "503".into(),
        };
        let s2 = apply(
            &s1,
            &write(&s1, &IngressUpdate::Keep, Some(&cloud), t(200)).unwrap(),
        );
        let c2 = &s2.status.as_ref().unwrap().conditions.as_ref().unwrap()[0];
        assert_eq!(c2.reason, "CloudError");
        assert_eq!(c2.last_transition_time, Time(t(100)));
        let s3 = apply(
            &s2,
            &write(&s2, &IngressUpdate::Keep, Some(&ready()), t(300)).unwrap(),
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
            ConditionReason::QuotaExceeded,
            ConditionReason::CloudForbidden,
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
                    IngressUpdate::Set(ingress_for(&vip(), None, &desired(LoadBalancerMode::Proxy)))
                } else {
                    IngressUpdate::Keep
                };
                let condition = DesiredCondition { reason, message: reason.as_str().into() };
                if let Some(patch) = write(&svc, &ingress, Some(&condition), now) {
                    svc = apply(&svc, &patch);
                }
                proptest::prop_assert_eq!(write(&svc, &ingress, Some(&condition), now), None);
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
        let ingress =
            IngressUpdate::Set(ingress_for(&vip(), None, &desired(LoadBalancerMode::Proxy)));
        let patch = write(&svc, &ingress, Some(&ready()), t(5)).unwrap();
        // The patch carries our condition only; the other writer's is not ours to send.
        let sent = patch.body["status"]["conditions"].as_array().unwrap();
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0]["type"], CONDITION_TYPE);
        let s1 = apply(&svc, &patch);
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
        let patch = write(&s1, &IngressUpdate::Clear, None, t(6)).unwrap();
        assert_eq!(patch.body["status"]["loadBalancer"]["ingress"], Value::Null);
        assert_eq!(
            patch.body["status"]["conditions"],
            json!([{ "$patch": "delete", "type": CONDITION_TYPE }])
        );
        let s2 = apply(&s1, &patch);
        assert_eq!(
            s2.status.as_ref().unwrap().conditions.as_ref().unwrap(),
            &vec![foreign]
        );
        assert_eq!(write(&s2, &IngressUpdate::Clear, None, t(7)), None);
    }
}
