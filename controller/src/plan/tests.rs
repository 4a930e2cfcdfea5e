use super::*;
use crate::provider::tests::observed_from;
use crate::spec::tests::{KEYS, service};
use crate::spec::{WithoutNodePorts, desired_load_balancer};
use std::collections::BTreeSet;
use std::net::Ipv4Addr;

fn classes(claim_unclassed: bool) -> ClassFilter {
    ClassFilter {
        class: "ours".into(),
        claim_unclassed,
    }
}

fn cluster() -> ClusterId {
    "c".parse().unwrap()
}

fn with(edit: impl FnOnce(&mut Service)) -> Service {
    let mut svc = service("web");
    edit(&mut svc);
    svc
}

fn finalized(svc: &mut Service) {
    svc.metadata.finalizers = Some(vec![FINALIZER.into()]);
}

/// Served earlier: our finalizer and the id of `observed_from`'s LB.
fn served(svc: &mut Service) {
    finalized(svc);
    svc.metadata.annotations = Some([(KEYS.lb_id.clone(), "lb-1".to_owned())].into());
}

fn deleted(svc: &mut Service) {
    svc.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        jiff::Timestamp::UNIX_EPOCH,
    ));
}

fn now() -> Timestamp {
    Timestamp::from_second(1_000).unwrap()
}

/// The observation of a Service ours to ensure: `desired` what it needs, `seen` what
/// the cloud holds.
fn observed(
    svc: &Service,
    desired: Result<DesiredLoadBalancer, Refusal>,
    seen: Seen,
) -> Observation<'_> {
    Observation {
        svc,
        ownership: Ownership::Ensure,
        lookup: lookup_of(svc, &KEYS, &cluster()),
        desired: Some(desired),
        seen,
        planned_id: None,
    }
}

fn plan(svc: &Service, desired: Result<DesiredLoadBalancer, Refusal>, seen: Seen) -> Plan<'_> {
    decide(observed(svc, desired, seen), &KEYS)
}

fn settle(plan: &Plan<'_>, result: Result<Option<ObservedLoadBalancer>, ProviderError>) -> Settled {
    plan.settle(result, IngressFields::ALL, now())
}

/// The reason and message of the condition the status write sets.
fn condition(settled: &Settled) -> Option<(String, String)> {
    let sent = &settled.status.as_ref()?.body["status"]["conditions"][0];
    Some((
        sent["reason"].as_str()?.to_owned(),
        sent["message"].as_str()?.to_owned(),
    ))
}

fn reason(settled: &Settled) -> Option<String> {
    condition(settled).map(|(reason, _)| reason)
}

/// Whether the status write leaves the ingress as it is.
fn keeps_ingress(settled: &Settled) -> bool {
    settled.status.as_ref().is_some_and(|w| w.ingress.is_none())
}

fn ingress_ips(settled: &Settled) -> Vec<String> {
    match settled.status.as_ref().and_then(|w| w.ingress.as_ref()) {
        Some(ingress) => ingress.iter().filter_map(|i| i.ip.clone()).collect(),
        None => panic!("no ingress written: {settled:?}"),
    }
}

/// The LB id the settled writes persist.
fn persisted(settled: &Settled) -> Option<String> {
    let patch = settled.persist_id.as_ref()?;
    patch.metadata["annotations"][&KEYS.lb_id]
        .as_str()
        .map(str::to_owned)
}

fn reasons(events: &[EventDecision]) -> Vec<EventReason> {
    events.iter().map(|e| e.reason).collect()
}

#[test]
fn the_finalizer_decides_before_the_class() {
    let cluster_ip = |s: &mut Service| s.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
    let class = |c: &str| {
        let c = c.to_owned();
        move |s: &mut Service| s.spec.as_mut().unwrap().load_balancer_class = Some(c)
    };
    let rows: Vec<(&str, Service, bool, Ownership)> = vec![
        (
            "unclassed, claimed",
            service("web"),
            true,
            Ownership::Ensure,
        ),
        (
            "unclassed, not claimed",
            service("web"),
            false,
            Ownership::Ignore,
        ),
        ("our class", with(class("ours")), false, Ownership::Ensure),
        (
            "other class",
            with(class("theirs")),
            true,
            Ownership::Ignore,
        ),
        (
            "other class with our finalizer",
            with(|s| {
                class("theirs")(s);
                finalized(s)
            }),
            true,
            Ownership::Cleanup,
        ),
        (
            // The leak: the class went with the type.
            "switched to ClusterIP, class cleared, not claimed",
            with(|s| {
                cluster_ip(s);
                finalized(s)
            }),
            false,
            Ownership::Cleanup,
        ),
        (
            "ClusterIP, never ours",
            with(cluster_ip),
            true,
            Ownership::Ignore,
        ),
        (
            "deleted with our finalizer",
            with(|s| {
                deleted(s);
                finalized(s)
            }),
            true,
            Ownership::Cleanup,
        ),
        (
            "deleted, no finalizer",
            with(deleted),
            true,
            Ownership::Ignore,
        ),
    ];
    for (name, svc, claim, want) in rows {
        assert_eq!(ownership(&svc, &classes(claim)), want, "{name}");
    }
}

#[test]
fn only_a_service_never_sent_to_the_cloud_skips_the_lookup() {
    let may_have =
        |svc: &Service| may_have_load_balancer(svc, &lookup_of(svc, &KEYS, &cluster()).unwrap());
    assert!(!may_have(&service("web")));
    assert!(may_have(&with(finalized)));
    assert!(may_have(&with(|s| {
        s.metadata.annotations = Some([(KEYS.lb_id.clone(), "lb-1".to_owned())].into())
    })));
}

#[test]
fn one_lookup_names_the_persisted_id_and_the_owner() {
    let lookup = lookup_of(&with(served), &KEYS, &cluster()).unwrap();
    assert_eq!(lookup.known_id.as_deref(), Some("lb-1"));
    assert_eq!(
        (lookup.owner.name.as_str(), lookup.owner.uid.as_str()),
        ("web", "uid-web")
    );
    let nameless = with(|s| s.metadata.uid = None);
    assert_eq!(
        lookup_of(&nameless, &KEYS, &cluster()),
        Err(SpecError::MissingMetadata("uid"))
    );
}

fn desired(svc: &Service, nodes: &[u8]) -> DesiredLoadBalancer {
    let backends: BTreeSet<IpAddr> = nodes
        .iter()
        .map(|n| IpAddr::V4(Ipv4Addr::new(198, 18, 0, *n)))
        .collect();
    desired_load_balancer(
        svc,
        &KEYS,
        owner_of(svc, &cluster()).unwrap(),
        backends,
        WithoutNodePorts::Passthrough,
        None,
    )
    .unwrap()
}

/// One row of the decision: an observation, the cloud's answer, and every write.
struct Case {
    name: &'static str,
    svc: Service,
    ownership: Ownership,
    desired: Option<Result<DesiredLoadBalancer, Refusal>>,
    seen: Seen,
    /// What the plan's cloud call answers.
    answer: Result<Option<ObservedLoadBalancer>, ProviderError>,
    // Expected:
    add_finalizer: bool,
    before: &'static [EventReason],
    cloud: &'static str,
    persist_id: bool,
    after: &'static [EventReason],
    /// Whether a status write is made, and the reason of the condition it sets.
    status: Option<Option<&'static str>>,
    first_ingress: bool,
    /// `Some(drops the id annotation)` when the finalizer is removed.
    remove_finalizer: Option<bool>,
    /// `Err(category)`.
    outcome: Result<Next, &'static str>,
}

fn cloud_kind(action: &CloudAction) -> &'static str {
    match action {
        CloudAction::None => "none",
        CloudAction::Create { .. } => "create",
        CloudAction::Update { .. } => "update",
        CloudAction::Delete(_) => "delete",
    }
}

/// The Service `svc` after `settled`'s status write, as the API server applies it.
fn written(svc: &Service, settled: &Settled) -> Service {
    match &settled.status {
        Some(write) => crate::status::tests::apply(svc, write),
        None => svc.clone(),
    }
}

#[test]
fn decision_table() {
    use EventReason::*;
    let new = service("web");
    let d = desired(&new, &[11]);
    let active = observed_from(&d);
    let provisioning = ObservedLoadBalancer {
        phase: LoadBalancerPhase::Provisioning,
        vips: Vec::new(),
        ..active.clone()
    };
    // Served and in sync, its status written by an earlier settle.
    let finalized_svc = with(served);
    let status_written = written(
        &finalized_svc,
        &settle(
            &plan(&finalized_svc, Ok(d.clone()), Seen::Found(active.clone())),
            Ok(None),
        ),
    );
    let down = ProviderError::Unavailable {
        operation: crate::provider::Operation::Create,
        message: "down".into(),
    };
    let base = |name, svc: &Service| Case {
        name,
        svc: svc.clone(),
        ownership: Ownership::Ensure,
        desired: Some(Ok(d.clone())),
        seen: Seen::NotAsked,
        answer: Ok(None),
        add_finalizer: false,
        before: &[],
        cloud: "none",
        persist_id: false,
        after: &[],
        status: None,
        first_ingress: false,
        remove_finalizer: None,
        outcome: Ok(Next::AwaitChange),
    };
    let cases = vec![
        Case {
            answer: Ok(Some(active.clone())),
            add_finalizer: true,
            before: &[EnsuringLoadBalancer],
            cloud: "create",
            persist_id: true,
            after: &[EnsuredLoadBalancer],
            status: Some(Some("LoadBalancerActive")),
            first_ingress: true,
            outcome: Ok(Next::Resync),
            ..base("new, created active", &new)
        },
        Case {
            // The poll writes the condition if it is still provisioning then.
            answer: Ok(Some(provisioning.clone())),
            add_finalizer: true,
            before: &[EnsuringLoadBalancer],
            cloud: "create",
            persist_id: true,
            after: &[EnsuredLoadBalancer],
            outcome: Ok(Next::Provisioning(Box::new(provisioning.clone()))),
            ..base("new, created provisioning: no status yet", &new)
        },
        Case {
            seen: Seen::Found(provisioning.clone()),
            status: Some(Some("Provisioning")),
            outcome: Ok(Next::Provisioning(Box::new(provisioning.clone()))),
            ..base("polled, still provisioning", &finalized_svc)
        },
        Case {
            seen: Seen::Found(active.clone()),
            status: Some(Some("LoadBalancerActive")),
            first_ingress: true,
            outcome: Ok(Next::Resync),
            ..base("polled, active", &finalized_svc)
        },
        Case {
            seen: Seen::Found(active.clone()),
            outcome: Ok(Next::Resync),
            ..base("in sync, status as it should be: no write", &status_written)
        },
        Case {
            seen: Seen::Found(active.clone()),
            desired: Some(Ok(desired(&new, &[11, 12]))),
            answer: Ok(Some(observed_from(&desired(&new, &[11, 12])))),
            cloud: "update",
            after: &[UpdatedLoadBalancer],
            outcome: Ok(Next::Resync),
            ..base(
                "a node added: one update, nothing else written",
                &status_written,
            )
        },
        Case {
            seen: Seen::Missing,
            answer: Err(down.clone()),
            before: &[EnsuringLoadBalancer],
            cloud: "create",
            after: &[SyncLoadBalancerFailed],
            status: Some(Some("CloudError")),
            outcome: Err("unavailable"),
            ..base("vanished, the create fails", &finalized_svc)
        },
        Case {
            seen: Seen::Failed(down.clone()),
            after: &[SyncLoadBalancerFailed],
            status: Some(Some("CloudError")),
            outcome: Err("unavailable"),
            ..base("the read fails: no call", &finalized_svc)
        },
        Case {
            desired: Some(Err(Refusal::Spec(SpecError::NoPorts))),
            after: &[SyncLoadBalancerFailed],
            status: Some(Some("InvalidConfiguration")),
            outcome: Err("invalid_configuration"),
            ..base("invalid: no finalizer, no call", &new)
        },
        Case {
            ownership: Ownership::Cleanup,
            desired: None,
            before: &[DeletingLoadBalancer],
            cloud: "delete",
            after: &[DeletedLoadBalancer],
            remove_finalizer: Some(false),
            ..base("deleted: the finalizer goes, the id with the Service", &{
                let mut svc = status_written.clone();
                deleted(&mut svc);
                svc
            })
        },
        Case {
            ownership: Ownership::Cleanup,
            desired: None,
            before: &[DeletingLoadBalancer],
            cloud: "delete",
            after: &[DeletedLoadBalancer],
            status: Some(None),
            remove_finalizer: Some(true),
            ..base("switched to ClusterIP: status, finalizer and id go", &{
                let mut svc = status_written.clone();
                svc.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
                svc
            })
        },
        Case {
            ownership: Ownership::Cleanup,
            desired: None,
            answer: Ok(Some(ObservedLoadBalancer {
                phase: LoadBalancerPhase::Deleting,
                ..active.clone()
            })),
            before: &[DeletingLoadBalancer],
            cloud: "delete",
            outcome: Ok(Next::Poll),
            ..base("still being deleted: the finalizer waits", &{
                let mut svc = finalized_svc.clone();
                deleted(&mut svc);
                svc
            })
        },
        Case {
            ownership: Ownership::Ignore,
            desired: None,
            ..base("not ours: nothing", &new)
        },
    ];
    for case in cases {
        let plan = decide(
            Observation {
                svc: &case.svc,
                ownership: case.ownership,
                lookup: lookup_of(&case.svc, &KEYS, &cluster()),
                desired: case.desired.clone(),
                seen: case.seen.clone(),
                planned_id: None,
            },
            &KEYS,
        );
        let settled = settle(&plan, case.answer.clone());
        let name = case.name;
        assert_eq!(plan.add_finalizer.is_some(), case.add_finalizer, "{name}");
        assert_eq!(reasons(&plan.events_before), case.before, "{name}");
        assert_eq!(cloud_kind(&plan.cloud), case.cloud, "{name}");
        assert_eq!(settled.persist_id.is_some(), case.persist_id, "{name}");
        assert_eq!(reasons(&settled.events), case.after, "{name}");
        assert_eq!(
            settled.status.as_ref().map(|_| reason(&settled)),
            case.status.map(|r| r.map(str::to_owned)),
            "{name}"
        );
        assert_eq!(settled.first_ingress, case.first_ingress, "{name}");
        assert_eq!(
            settled
                .remove_finalizer
                .as_ref()
                .map(|p| p.metadata.get("annotations").is_some()),
            case.remove_finalizer,
            "{name}"
        );
        assert_eq!(
            settled.outcome.as_ref().map_err(PlanError::category),
            case.outcome.as_ref().map_err(|c| *c),
            "{name}"
        );
    }
}

#[test]
fn the_metadata_patches_are_finished() {
    let mut svc = service("web");
    svc.metadata.finalizers = Some(vec!["example.com/other".into()]);
    let d = desired(&svc, &[11]);
    let create = plan(&svc, Ok(d.clone()), Seen::NotAsked);
    assert_eq!(
        create.add_finalizer,
        Some(MetadataPatch {
            action: "add finalizer",
            metadata: json!({ "finalizers": ["example.com/other", FINALIZER] }),
            guarded: true,
        })
    );
    let settled = settle(&create, Ok(Some(observed_from(&d))));
    assert_eq!(
        settled.persist_id,
        Some(MetadataPatch {
            action: "persist load balancer id",
            metadata: json!({ "annotations": { KEYS.lb_id.as_str(): "lb-1" } }),
            guarded: false,
        })
    );
    // A type switched away: the other writer's finalizer stays, ours and the id go.
    let mut switched = svc.clone();
    served(&mut switched);
    switched.metadata.finalizers = Some(vec!["example.com/other".into(), FINALIZER.into()]);
    switched.spec.as_mut().unwrap().type_ = Some("NodePort".into());
    let cleanup = decide(
        Observation {
            svc: &switched,
            ownership: Ownership::Cleanup,
            lookup: lookup_of(&switched, &KEYS, &cluster()),
            desired: None,
            seen: Seen::NotAsked,
            planned_id: None,
        },
        &KEYS,
    );
    assert_eq!(
        cleanup.cloud,
        CloudAction::Delete(lookup_of(&switched, &KEYS, &cluster()).unwrap())
    );
    assert_eq!(
        settle(&cleanup, Ok(None)).remove_finalizer,
        Some(MetadataPatch {
            action: "remove finalizer",
            metadata: json!({
                "finalizers": ["example.com/other"],
                "annotations": { KEYS.lb_id.as_str(): null },
            }),
            guarded: true,
        })
    );
}

/// A provider whose cloud takes the client's id: the id goes with the finalizer, before
/// the create, and needs no patch after it unless the cloud answered another LB.
#[test]
fn a_planned_id_is_persisted_with_the_finalizer() {
    let svc = service("web");
    let d = desired(&svc, &[11]);
    fn planned<'a>(svc: &'a Service, d: &DesiredLoadBalancer, seen: Seen) -> Plan<'a> {
        decide(
            Observation {
                planned_id: Some("lb-1".to_owned()),
                ..observed(svc, Ok(d.clone()), seen)
            },
            &KEYS,
        )
    }
    let create = planned(&svc, &d, Seen::NotAsked);
    assert_eq!(
        create.add_finalizer,
        Some(MetadataPatch {
            action: "add finalizer and load balancer id",
            metadata: json!({
                "finalizers": [FINALIZER],
                "annotations": { KEYS.lb_id.as_str(): "lb-1" },
            }),
            guarded: true,
        })
    );
    assert_eq!(
        create.cloud,
        CloudAction::Create {
            desired: d.clone(),
            replaces: None
        }
    );
    let answered = observed_from(&d);
    assert_eq!(answered.id, "lb-1");
    assert_eq!(settle(&create, Ok(Some(answered.clone()))).persist_id, None);
    // A key that replayed an earlier create answers that LB: its id is persisted.
    let other = ObservedLoadBalancer {
        id: "lb-0".into(),
        ..answered
    };
    assert_eq!(
        persisted(&settle(&create, Ok(Some(other)))).as_deref(),
        Some("lb-0")
    );
    // A Service that holds the finalizer already (its LB vanished) keeps the id patch
    // after the create: there is no earlier write to carry it.
    let holding = with(finalized);
    let again = planned(&holding, &d, Seen::Missing);
    assert_eq!(again.add_finalizer, None);
    assert_eq!(
        persisted(&settle(&again, Ok(Some(observed_from(&d))))).as_deref(),
        Some("lb-1")
    );
}

#[test]
fn what_the_provider_cannot_do_is_refused_before_any_cloud_call() {
    let svc = with(finalized);
    let d = desired(&svc, &[11]);
    let no_proxy = Capabilities {
        proxy: false,
        ..Capabilities::ALL
    };
    let refused = servable(Ok(d.clone()), "edge", no_proxy);
    assert_eq!(
        refused,
        Err(Refusal::Unsupported {
            provider: "edge",
            need: Unsupported::Mode(crate::provider::LoadBalancerMode::Proxy)
        })
    );
    let plan = plan(&svc, refused, Seen::NotAsked);
    assert_eq!(
        (plan.cloud.clone(), plan.add_finalizer.is_some()),
        (CloudAction::None, false)
    );
    let settled = settle(&plan, Ok(None));
    assert!(keeps_ingress(&settled));
    assert_eq!(
        condition(&settled),
        Some((
            ConditionReason::Unsupported.as_str().to_owned(),
            "the edge provider's load balancers have no proxy mode".to_owned()
        ))
    );
    assert_eq!(
        settled.events[0].reason,
        EventReason::SyncLoadBalancerFailed
    );
    let error = settled.outcome.unwrap_err();
    assert_eq!(error.category(), "unsupported");
    assert_eq!(servable(Ok(d.clone()), "edge", Capabilities::ALL), Ok(d));
}

#[test]
fn an_lb_known_by_a_hostname_alone_is_served() {
    let svc = with(finalized);
    let d = desired(&svc, &[11]);
    let mut lb = observed_from(&d);
    lb.vips.clear();
    lb.hostname = Some("lb-1.example.net".into());
    let settled = settle(&plan(&svc, Ok(d), Seen::Found(lb.clone())), Ok(None));
    let ingress = settled.status.as_ref().and_then(|w| w.ingress.clone());
    let ingress = ingress.expect("an ingress");
    assert_eq!(ingress[0].hostname.as_deref(), Some("lb-1.example.net"));
    assert_eq!(ingress[0].ip, None);
    let (reason, message) = condition(&settled).unwrap();
    assert_eq!(reason, ConditionReason::Ready.as_str());
    assert!(message.ends_with("serves lb-1.example.net"));
    assert!(settled.first_ingress);
    // Without a hostname, a missing VIP is still a cloud fault.
    lb.hostname = None;
    let d = desired(&svc, &[11]);
    let settled = settle(&plan(&svc, Ok(d), Seen::Found(lb)), Ok(None));
    assert!(settled.outcome.is_err());
}

#[test]
fn a_new_address_or_pool_updates_the_same_load_balancer() {
    let svc = with(finalized);
    let d = desired(&svc, &[11]);
    let lb = observed_from(&d);
    for change in [
        |d: &mut DesiredLoadBalancer| {
            d.address.requested = vec![Ipv4Addr::new(198, 51, 100, 42).into()]
        },
        |d: &mut DesiredLoadBalancer| d.address.pool = Some("blue".into()),
        |d: &mut DesiredLoadBalancer| d.address.sharing_key = Some("dns".into()),
    ] {
        let mut moved = d.clone();
        change(&mut moved);
        let plan = plan(&svc, Ok(moved.clone()), Seen::Found(lb.clone()));
        assert_eq!(
            plan.cloud,
            CloudAction::Update {
                current: lb.clone(),
                desired: moved
            }
        );
    }
}

#[test]
fn an_address_refusal_is_its_own_reason_and_permanent() {
    let svc = with(finalized);
    let d = desired(&svc, &[11]);
    let plan = plan(&svc, Ok(d), Seen::Missing);
    let refused = ProviderError::AddressRefused {
        refusal: crate::provider::AddressRefusal::PortConflict,
        message: "TCP port 53 of 198.51.100.7 is served by lb-2".into(),
    };
    let settled = settle(&plan, Err(refused.clone()));
    assert!(keeps_ingress(&settled));
    assert_eq!(
        reason(&settled).as_deref(),
        Some("SharedAddressPortConflict")
    );
    assert_eq!(
        settled.events[0].reason,
        EventReason::SyncLoadBalancerFailed
    );
    assert!(
        settled.events[0]
            .message
            .contains("TCP port 53 of 198.51.100.7")
    );
    assert_eq!(settled.persist_id, None);
    assert_eq!(settled.outcome, Err(PlanError::Provider(refused)));
}

#[test]
fn one_cloud_call_chosen_by_what_was_seen() {
    let svc = with(finalized);
    let d = desired(&svc, &[11]);
    let new = service("web");
    let create = plan(&new, Ok(d.clone()), Seen::NotAsked);
    assert!(create.add_finalizer.is_some());
    assert!(matches!(
        create.cloud,
        CloudAction::Create { replaces: None, .. }
    ));
    let in_sync = plan(&svc, Ok(d.clone()), Seen::Found(observed_from(&d)));
    assert_eq!(in_sync.cloud, CloudAction::None);
    assert!(in_sync.add_finalizer.is_none() && in_sync.events_before.is_empty());
    let settled = settle(&in_sync, Ok(None));
    assert_eq!(settled.outcome, Ok(Next::Resync));
    assert_eq!(persisted(&settled).as_deref(), Some("lb-1"));
    // One more node: an update of the LB as observed, at its version.
    let moved = desired(&svc, &[11, 12]);
    let update = plan(&svc, Ok(moved.clone()), Seen::Found(observed_from(&d)));
    match &update.cloud {
        CloudAction::Update { current, desired } => {
            assert_eq!((current.version, desired), (1, &moved));
        }
        other => panic!("{other:?}"),
    }
    let settled = settle(&update, Ok(Some(observed_from(&moved))));
    assert_eq!(
        reasons(&settled.events),
        vec![EventReason::UpdatedLoadBalancer]
    );
    // No node at all: still ensured, and said so.
    let none = desired(&svc, &[]);
    let empty = plan(&svc, Ok(none.clone()), Seen::Found(observed_from(&d)));
    assert!(
        empty
            .events_before
            .iter()
            .any(|e| e.reason == EventReason::UnAvailableLoadBalancer)
    );
    let settled = settle(&empty, Ok(Some(observed_from(&none))));
    assert_eq!(
        reason(&settled).as_deref(),
        Some(ConditionReason::NoEligibleNodes.as_str())
    );
}

fn dual_stack(svc: &Service, backends: &[&str]) -> DesiredLoadBalancer {
    let mut svc = svc.clone();
    svc.spec.as_mut().unwrap().ip_families = Some(vec!["IPv6".into(), "IPv4".into()]);
    desired_load_balancer(
        &svc,
        &KEYS,
        owner_of(&svc, &cluster()).unwrap(),
        backends.iter().map(|b| b.parse().unwrap()).collect(),
        WithoutNodePorts::Passthrough,
        None,
    )
    .unwrap()
}

#[test]
fn a_dual_stack_lb_is_served_per_family_in_the_services_order() {
    let svc = with(finalized);
    let d = dual_stack(&svc, &["198.18.0.11", "2001:db8:18::11"]);
    let settled = settle(
        &plan(&svc, Ok(d.clone()), Seen::Found(observed_from(&d))),
        Ok(None),
    );
    assert_eq!(
        ingress_ips(&settled),
        ["2001:db8:51:100::7", "198.51.100.7"]
    );
    let (reason, message) = condition(&settled).unwrap();
    assert_eq!(reason, ConditionReason::Ready.as_str());
    assert!(message.contains("2001:db8:51:100::7, 198.51.100.7"));
    // Upgraded from IPv4 alone: the same LB is updated, and serves both afterwards.
    let single = desired(&svc, &[11]);
    let upgrade = plan(&svc, Ok(d.clone()), Seen::Found(observed_from(&single)));
    assert!(matches!(&upgrade.cloud, CloudAction::Update { current, .. } if current.id == "lb-1"));
    let settled = settle(&upgrade, Ok(Some(observed_from(&d))));
    assert_eq!(settled.events[0].reason, EventReason::EnsuredLoadBalancer);
    assert_eq!(ingress_ips(&settled).len(), 2);
}

#[test]
fn a_family_without_nodes_is_named_and_its_vip_still_reported() {
    let svc = with(finalized);
    let d = dual_stack(&svc, &["198.18.0.11"]);
    let first = plan(&svc, Ok(d.clone()), Seen::Missing);
    let warning = first
        .events_before
        .iter()
        .find(|e| e.reason == EventReason::UnAvailableLoadBalancer)
        .unwrap();
    assert_eq!(
        warning.message,
        "There are no available nodes with an IPv6 address for LoadBalancer"
    );
    let settled = settle(&first, Ok(Some(observed_from(&d))));
    assert_eq!(ingress_ips(&settled).len(), 2);
    assert_eq!(
        condition(&settled),
        Some((
            ConditionReason::NoEligibleNodes.as_str().to_owned(),
            "no eligible node has an IPv6 address".to_owned()
        ))
    );
    let none = dual_stack(&svc, &[]);
    let nothing = plan(&svc, Ok(none), Seen::Missing);
    assert_eq!(
        nothing.events_before[1].message,
        "There are no available nodes for LoadBalancer"
    );
}

#[test]
fn a_pool_lacking_a_family_refuses_the_upgrade_and_keeps_what_serves() {
    let svc = with(finalized);
    let single = desired(&svc, &[11]);
    let d = dual_stack(&svc, &["198.18.0.11", "2001:db8:18::11"]);
    let plan = plan(&svc, Ok(d), Seen::Found(observed_from(&single)));
    let refused = ProviderError::AddressRefused {
        refusal: crate::provider::AddressRefusal::PoolLacksFamily,
        message: "the VIP pool default has no IPv6 addresses".into(),
    };
    let settled = settle(&plan, Err(refused.clone()));
    assert!(keeps_ingress(&settled));
    assert_eq!(reason(&settled).as_deref(), Some("AddressPoolLacksFamily"));
    assert!(settled.events[0].message.contains("no IPv6 addresses"));
    assert_eq!(settled.outcome, Err(PlanError::Provider(refused)));
}

#[test]
fn what_the_cloud_cannot_serve_is_unsupported_with_its_message_and_permanent() {
    let svc = with(finalized);
    let d = desired(&svc, &[11]);
    let plan = plan(&svc, Ok(d), Seen::Missing);
    let refused = ProviderError::Unsupported {
        operation: crate::provider::Operation::Create,
        message: "UDP port 53 cannot be served".into(),
    };
    let settled = settle(&plan, Err(refused.clone()));
    assert!(keeps_ingress(&settled));
    let (reason, message) = condition(&settled).unwrap();
    assert_eq!(reason, "UnsupportedByProvider");
    assert!(message.contains("UDP port 53"), "{message}");
    assert_eq!(settled.events.len(), 1, "{:?}", settled.events);
    assert_eq!(
        settled.events[0].reason,
        EventReason::SyncLoadBalancerFailed
    );
    assert!(settled.events[0].message.contains("UDP port 53"));
    assert_eq!(settled.outcome, Err(PlanError::Provider(refused.clone())));
    assert!(refused.is_permanent(), "waits for the Service to change");
}

#[test]
fn a_quota_or_a_permission_refused_has_its_own_reason_and_keeps_what_serves() {
    let svc = with(finalized);
    let single = desired(&svc, &[11]);
    let d = dual_stack(&svc, &["198.18.0.11", "2001:db8:18::11"]);
    let plan = plan(&svc, Ok(d), Seen::Found(observed_from(&single)));
    let quota =
        r#"tenant "team-a" reached its quota of 2 VIPs in pool "dmz" (quota vipsPerPool.dmz)"#;
    for (refused, want) in [
        (
            ProviderError::QuotaExceeded {
                message: quota.into(),
            },
            "QuotaExceeded",
        ),
        (
            ProviderError::Forbidden {
                operation: crate::provider::Operation::Update,
                message: "cluster-not-permitted: not bound to cluster prod".into(),
            },
            "CloudForbidden",
        ),
    ] {
        let settled = settle(&plan, Err(refused.clone()));
        assert!(keeps_ingress(&settled), "{want}");
        let (reason, message) = condition(&settled).unwrap();
        assert_eq!(reason, want);
        assert!(message.ends_with(&refused.to_string()), "{message}");
        assert_eq!(
            settled.events[0].reason,
            EventReason::SyncLoadBalancerFailed
        );
        assert!(settled.events[0].message.contains(&refused.to_string()));
        assert!(refused.is_permanent(), "{want}: not hammered");
    }
}

#[test]
fn an_active_lb_without_a_vip_of_a_family_is_a_cloud_fault() {
    let svc = with(finalized);
    let d = dual_stack(&svc, &["198.18.0.11", "2001:db8:18::11"]);
    let mut half = observed_from(&d);
    half.vips.retain(IpAddr::is_ipv4);
    let settled = settle(
        &plan(&svc, Ok(d), Seen::Found(half.clone())),
        Ok(Some(half)),
    );
    assert!(keeps_ingress(&settled));
    assert_eq!(
        reason(&settled).as_deref(),
        Some(ConditionReason::CloudError.as_str())
    );
    assert!(matches!(
        settled.outcome,
        Err(PlanError::Provider(ProviderError::Unavailable { .. }))
    ));
}

#[test]
fn cleanup_removes_the_finalizer_only_after_the_lb_is_gone() {
    let svc = with(|s| {
        served(s);
        s.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
    });
    let plan = decide(
        Observation {
            svc: &svc,
            ownership: ownership(&svc, &classes(true)),
            lookup: lookup_of(&svc, &KEYS, &cluster()),
            desired: None,
            seen: Seen::NotAsked,
            planned_id: None,
        },
        &KEYS,
    );
    assert!(matches!(plan.cloud, CloudAction::Delete(_)));
    let done = settle(&plan, Ok(None));
    assert!(done.remove_finalizer.is_some());
    // Nothing of ours in the status, so nothing to clear.
    assert_eq!(done.status, None);
    let failed = settle(
        &plan,
        Err(ProviderError::Unavailable {
            operation: crate::provider::Operation::Delete,
            message: "down".into(),
        }),
    );
    assert!(failed.remove_finalizer.is_none() && failed.outcome.is_err());
    assert_eq!(
        failed.events[0].reason,
        EventReason::DeleteLoadBalancerFailed
    );
}

#[test]
fn nine_reasons_with_types() {
    let all = [
        EventReason::EnsuringLoadBalancer,
        EventReason::EnsuredLoadBalancer,
        EventReason::SyncLoadBalancerFailed,
        EventReason::DeletingLoadBalancer,
        EventReason::DeletedLoadBalancer,
        EventReason::DeleteLoadBalancerFailed,
        EventReason::UpdatedLoadBalancer,
        EventReason::UpdateLoadBalancerFailed,
        EventReason::UnAvailableLoadBalancer,
    ];
    let names: std::collections::BTreeSet<_> = all.iter().map(|r| r.as_str()).collect();
    assert_eq!(names.len(), 9);
    assert_eq!(all.iter().filter(|r| r.is_warning()).count(), 4);
}
