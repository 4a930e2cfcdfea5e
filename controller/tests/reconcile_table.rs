//! Reconcile in process, table-driven like k8s.io/cloud-provider's `controller_test.go`:
//! every row is a starting state (the Service as the API server holds it, the nodes, the
//! LBs in a `FakeProvider`), one reconcile, and the expected cloud calls, Service state and
//! Events. The API server is the stand-in, in process, serving a dual-stack cluster (IPv4
//! first, so a Service that names no family is IPv4 alone); no binary and no network
//! beyond 127.0.0.1.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)]
mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Namespace, Node, NodeStatus, Service};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::watcher;
use serde_json::json;
use support::{
    DUAL_STACK_SERVICE_CIDRS, condition_reason, ingress_families, internal_ips, lb_service,
};
use tandem_common::IpFamily;
use tandem_controller::fake::{Call, FakeProvider};
use tandem_controller::metrics::Metrics;
use tandem_controller::plan::FINALIZER;
use tandem_controller::provider::{AddressRefusal, Capabilities, Operation, ProviderError};
use tandem_controller::reconcile::{Context, ContextParts, reconcile};
use tandem_controller::spec::{
    AnnotationKeys, ClassFilter, WithoutNodePorts, desired_load_balancer, owner_of,
};
use tandem_controller::status::IngressFields;

const CLASS: &str = "tandem.io/fake";
/// The fake provider's annotations.
static KEYS: std::sync::LazyLock<AnnotationKeys> =
    std::sync::LazyLock::new(|| AnnotationKeys::of(&tandem_controller::fake::PROFILE));
const CLUSTER: &str = "table";

/// What the cloud holds before the reconcile.
#[derive(Clone, Copy, PartialEq, Eq)]
enum CloudStart {
    Empty,
    /// The LB the Service needs, active, with the nodes it had (`NODE_A` only).
    Matching,
    /// As `Matching`, but listening on another port (drifted behind our back).
    Drifted,
}

/// What the Service looks like before the reconcile.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ServiceStart {
    /// Just created by a user.
    New,
    /// Served earlier: our finalizer and LB id on it.
    Served,
    /// Served earlier, then deleted (deletionTimestamp set, our finalizer holds it).
    Deleted,
    /// Served earlier with our class, then switched to ClusterIP (class cleared with it).
    SwitchedToClusterIp,
}

struct Row {
    name: &'static str,
    service: ServiceStart,
    /// Extra Service fields, merged into the Service before it is created.
    edit: fn(&mut Service),
    /// Nodes other than `NODE_A`, each its comma-separated InternalIPs.
    extra_nodes: &'static [&'static str],
    cloud: CloudStart,
    /// Fails the next call of this operation.
    fail: Option<(Operation, ProviderError)>,
    create_active: bool,
    /// The cloud deletes asynchronously: a deleted LB stays listed, `Deleting`.
    delete_async: bool,
    without_node_ports: WithoutNodePorts,
    /// The address pool the Service's Namespace names.
    namespace_pool: Option<&'static str>,
    /// The controller's `--default-address-pool`.
    default_pool: Option<&'static str>,
    /// The families of the cloud's pool `default` (`None`: both).
    default_pool_families: Option<&'static [IpFamily]>,
    /// A user's edit after the starting state, before the reconcile.
    then: Option<fn(&mut Service)>,
    // Expected:
    ok: bool,
    calls: fn(Option<&str>) -> Vec<Call>,
    /// `None`: the Service is gone after the reconcile.
    finalizer: Option<bool>,
    condition: Option<&'static str>,
    /// The families of `status.loadBalancer.ingress`, entry by entry.
    ingress: &'static [&'static str],
    id_persisted: bool,
    events: &'static [&'static str],
    /// The pool of the Service's LB in the cloud, when it must have one.
    pool: Option<&'static str>,
    /// The families of the Service's LB in the cloud, when checked (`[]`: it has none).
    lb_families: Option<&'static [IpFamily]>,
    /// The backends of the Service's LB in the cloud, when checked.
    backends: Option<&'static [&'static str]>,
}

/// A dual-stack node.
const NODE_A: &str = "198.18.0.11,2001:db8:18::11";
const V4: &[&str] = &["IPv4"];
const NONE: &[&str] = &[];

fn require_dual_stack(svc: &mut Service) {
    svc.spec.as_mut().unwrap().ip_family_policy = Some("RequireDualStack".into());
}

fn set_policy(svc: &mut Service, policy: &str) {
    svc.spec.as_mut().unwrap().ip_family_policy = Some(policy.into());
}

fn no_edit(_: &mut Service) {}

/// The calls of an LB updated in place: one read, one update of the LB it found.
fn read_then_update(id: Option<&str>) -> Vec<Call> {
    vec![
        Call::Get {
            known_id: id.map(str::to_owned),
        },
        Call::Update {
            id: id.unwrap_or_default().to_owned(),
        },
    ]
}

fn annotate(svc: &mut Service, key: &str, value: &str) {
    svc.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(key.into(), value.into());
}

/// The Namespace `default`, naming `pool` for its Services.
fn namespaces(pool: Option<&str>) -> reflector::Store<Namespace> {
    let (store, mut writer) = reflector::store::<Namespace>();
    let mut namespace = Namespace {
        metadata: ObjectMeta {
            name: Some("default".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    if let Some(pool) = pool {
        namespace.metadata.annotations =
            Some(BTreeMap::from([(KEYS.address_pool.clone(), pool.into())]));
    }
    writer.apply_watcher_event(&watcher::Event::Apply(namespace));
    store
}

fn unavailable(operation: Operation) -> ProviderError {
    ProviderError::Unavailable {
        operation,
        message: "injected".into(),
    }
}

/// The shared harness's LoadBalancer Service with one TCP port, of our class.
fn base_service(name: &str) -> Service {
    let mut svc = lb_service(name, &[(80, "TCP")]);
    if let Some(spec) = svc.spec.as_mut() {
        spec.load_balancer_class = Some(CLASS.into());
    }
    svc
}

fn rows() -> Vec<Row> {
    let row = |name| Row {
        name,
        service: ServiceStart::New,
        edit: no_edit,
        extra_nodes: &[],
        cloud: CloudStart::Empty,
        fail: None,
        create_active: true,
        delete_async: false,
        without_node_ports: WithoutNodePorts::Passthrough,
        namespace_pool: None,
        default_pool: None,
        default_pool_families: None,
        then: None,
        ok: true,
        calls: |_| vec![],
        finalizer: Some(true),
        condition: Some("LoadBalancerActive"),
        ingress: V4,
        id_persisted: true,
        events: &[],
        pool: None,
        lb_families: None,
        backends: None,
    };
    // The cloud refuses the create (the address, a quota, the credential's permissions):
    // its own condition reason, a Warning Event, no LB.
    let refused_by = |name, error, reason| Row {
        fail: Some((Operation::Create, error)),
        ok: false,
        calls: |_| vec![Call::Create { replaces: None }],
        condition: Some(reason),
        ingress: NONE,
        id_persisted: false,
        events: &["EnsuringLoadBalancer", "SyncLoadBalancerFailed"],
        ..row(name)
    };
    let refused = |name, refusal, reason| {
        refused_by(
            name,
            ProviderError::AddressRefused {
                refusal,
                message: "refused by the cloud".into(),
            },
            reason,
        )
    };
    // A new Service, created in one call.
    let created = |name| Row {
        calls: |_| vec![Call::Create { replaces: None }],
        events: &["EnsuringLoadBalancer", "EnsuredLoadBalancer"],
        ..row(name)
    };
    // A served Service whose LB is updated in place after one read.
    let updated = |name| Row {
        service: ServiceStart::Served,
        cloud: CloudStart::Matching,
        calls: read_then_update,
        events: &["EnsuringLoadBalancer", "EnsuredLoadBalancer"],
        ..row(name)
    };
    // Refused before any cloud call: no finalizer, a condition and a Warning.
    let invalid = |name| Row {
        ok: false,
        finalizer: Some(false),
        condition: Some("InvalidConfiguration"),
        ingress: NONE,
        id_persisted: false,
        events: &["SyncLoadBalancerFailed"],
        ..row(name)
    };
    vec![
        refused(
            "refused-unknown-pool",
            AddressRefusal::UnknownPool,
            "UnknownAddressPool",
        ),
        refused(
            "refused-pool-exhausted",
            AddressRefusal::PoolExhausted,
            "AddressPoolExhausted",
        ),
        refused(
            "refused-address-outside-pools",
            AddressRefusal::OutsidePools,
            "AddressOutsidePools",
        ),
        refused(
            "refused-address-taken",
            AddressRefusal::Taken,
            "AddressInUse",
        ),
        refused(
            "refused-shared-port-clash",
            AddressRefusal::PortConflict,
            "SharedAddressPortConflict",
        ),
        refused(
            "refused-shared-mode-mismatch",
            AddressRefusal::SharingModeMismatch,
            "SharedAddressModeMismatch",
        ),
        refused(
            "refused-pool-not-permitted",
            AddressRefusal::PoolNotPermitted,
            "AddressPoolNotPermitted",
        ),
        refused_by(
            "refused-quota-exceeded",
            ProviderError::QuotaExceeded {
                message: r#"tenant "team-a" reached its quota of 5 load balancers (quota loadBalancers)"#.into(),
            },
            "QuotaExceeded",
        ),
        Row {
            // A served Service whose repair would pass a quota keeps its address.
            service: ServiceStart::Served,
            cloud: CloudStart::Drifted,
            fail: Some((
                Operation::Update,
                ProviderError::QuotaExceeded {
                    message: r#"tenant "team-a" reached its quota of 2 VIPs in pool "dmz" (quota vipsPerPool.dmz)"#.into(),
                },
            )),
            ok: false,
            calls: read_then_update,
            condition: Some("QuotaExceeded"),
            events: &["EnsuringLoadBalancer", "SyncLoadBalancerFailed"],
            ..row("repair-over-quota-keeps-the-address")
        },
        refused_by(
            "refused-forbidden",
            ProviderError::Forbidden {
                operation: Operation::Create,
                message: "cluster-not-permitted: the credential is not bound to cluster table"
                    .into(),
            },
            "CloudForbidden",
        ),
        Row {
            namespace_pool: Some("ns-pool"),
            default_pool: Some("flag-pool"),
            pool: Some("ns-pool"),
            ..created("pool-from-namespace")
        },
        Row {
            default_pool: Some("flag-pool"),
            pool: Some("flag-pool"),
            ..created("pool-from-flag")
        },
        Row {
            edit: |s| annotate(s, &KEYS.address_pool, "svc-pool"),
            namespace_pool: Some("ns-pool"),
            pool: Some("svc-pool"),
            ..created("pool-of-service-beats-namespace")
        },
        Row {
            namespace_pool: Some("ns-pool"),
            pool: Some("ns-pool"),
            ..updated("namespace-pool-moves-the-same-lb")
        },
        Row {
            then: Some(|s| annotate(s, &KEYS.requested_ip, "198.51.100.42")),
            ..updated("requested-ip-changed-updates-the-same-lb")
        },
        Row {
            edit: |s| {
                s.spec.as_mut().unwrap().load_balancer_ip = Some("198.51.100.40".into());
                annotate(s, &KEYS.requested_ip, "198.51.100.41");
            },
            ..invalid("requested-ip-conflict-refused-before-the-cloud")
        },
        Row {
            edit: |s| annotate(s, &KEYS.shared_ip, "dns"),
            ..created("sharing-key-reaches-the-cloud")
        },
        created("create-never-looks-up-first"),
        Row {
            // The poll writes the Provisioning condition if the LB is still provisioning
            // then (see `api_writes_of_one_service_create_path`); this pass writes none.
            create_active: false,
            calls: |_| vec![Call::Create { replaces: None }],
            condition: None,
            ingress: NONE,
            events: &["EnsuringLoadBalancer", "EnsuredLoadBalancer"],
            ..row("create-provisioning")
        },
        Row {
            fail: Some((Operation::Create, unavailable(Operation::Create))),
            ok: false,
            calls: |_| vec![Call::Create { replaces: None }],
            condition: Some("CloudError"),
            ingress: NONE,
            id_persisted: false,
            events: &["EnsuringLoadBalancer", "SyncLoadBalancerFailed"],
            ..row("create-cloud-error")
        },
        Row {
            // The cloud cannot serve a listener the provider's capabilities let pass (a UDP
            // port on an HAProxy edge): the cloud's message, never a lesser LB.
            fail: Some((
                Operation::Create,
                ProviderError::Unsupported {
                    operation: Operation::Create,
                    message: "UDP port 53 cannot be served".into(),
                },
            )),
            ok: false,
            calls: |_| vec![Call::Create { replaces: None }],
            condition: Some("UnsupportedByProvider"),
            ingress: NONE,
            id_persisted: false,
            events: &["EnsuringLoadBalancer", "SyncLoadBalancerFailed"],
            ..row("create-unsupported-by-the-cloud")
        },
        Row {
            edit: |s| annotate(s, &KEYS.mode, "sideways"),
            ..invalid("invalid-annotation-no-cloud-call-no-finalizer")
        },
        Row {
            edit: |s| s.spec.as_mut().unwrap().allocate_load_balancer_node_ports = Some(false),
            ..created("no-node-ports-served-in-passthrough")
        },
        Row {
            edit: |s| s.spec.as_mut().unwrap().allocate_load_balancer_node_ports = Some(false),
            without_node_ports: WithoutNodePorts::Refuse,
            ..invalid("no-node-ports-refused")
        },
        Row {
            service: ServiceStart::Served,
            cloud: CloudStart::Matching,
            calls: |id| {
                vec![Call::Get {
                    known_id: id.map(str::to_owned),
                }]
            },
            ..row("in-sync-one-read-no-write")
        },
        Row {
            service: ServiceStart::Served,
            cloud: CloudStart::Matching,
            extra_nodes: &["198.18.0.12"],
            calls: read_then_update,
            events: &["UpdatedLoadBalancer"],
            ..row("node-added-one-update")
        },
        Row {
            service: ServiceStart::Served,
            cloud: CloudStart::Drifted,
            calls: read_then_update,
            events: &["EnsuringLoadBalancer", "EnsuredLoadBalancer"],
            ..row("drift-repaired")
        },
        Row {
            service: ServiceStart::Served,
            cloud: CloudStart::Matching,
            extra_nodes: &["198.18.0.12"],
            fail: Some((Operation::Update, unavailable(Operation::Update))),
            ok: false,
            calls: read_then_update,
            condition: Some("CloudError"),
            events: &["UpdateLoadBalancerFailed"],
            ..row("node-update-fails")
        },
        Row {
            service: ServiceStart::Served,
            cloud: CloudStart::Empty,
            calls: |id| {
                vec![
                    Call::Get {
                        known_id: id.map(str::to_owned),
                    },
                    Call::Create {
                        replaces: id.map(str::to_owned),
                    },
                ]
            },
            events: &["EnsuringLoadBalancer", "EnsuredLoadBalancer"],
            ..row("vanished-lb-recreated-as-a-new-request")
        },
        Row {
            service: ServiceStart::Served,
            cloud: CloudStart::Matching,
            fail: Some((Operation::Get, unavailable(Operation::Get))),
            ok: false,
            calls: |id| {
                vec![Call::Get {
                    known_id: id.map(str::to_owned),
                }]
            },
            condition: Some("CloudError"),
            events: &["SyncLoadBalancerFailed"],
            ..row("read-fails")
        },
        Row {
            service: ServiceStart::Deleted,
            cloud: CloudStart::Matching,
            calls: |id| {
                vec![Call::Delete {
                    known_id: id.map(str::to_owned),
                }]
            },
            finalizer: None,
            condition: None,
            ingress: NONE,
            id_persisted: false,
            events: &["DeletingLoadBalancer", "DeletedLoadBalancer"],
            ..row("deleted-service-lb-deleted-finalizer-removed")
        },
        Row {
            service: ServiceStart::Deleted,
            cloud: CloudStart::Matching,
            fail: Some((Operation::Delete, unavailable(Operation::Delete))),
            ok: false,
            calls: |id| {
                vec![Call::Delete {
                    known_id: id.map(str::to_owned),
                }]
            },
            finalizer: Some(true),
            condition: Some("LoadBalancerActive"),
            events: &["DeletingLoadBalancer", "DeleteLoadBalancerFailed"],
            ..row("delete-fails-finalizer-stays")
        },
        // The cloud still lists the LB (deleting): the finalizer waits until it is gone.
        Row {
            service: ServiceStart::Deleted,
            cloud: CloudStart::Matching,
            delete_async: true,
            calls: |id| {
                vec![Call::Delete {
                    known_id: id.map(str::to_owned),
                }]
            },
            finalizer: Some(true),
            condition: Some("LoadBalancerActive"),
            events: &["DeletingLoadBalancer"],
            ..row("delete-in-progress-finalizer-stays")
        },
        Row {
            service: ServiceStart::SwitchedToClusterIp,
            cloud: CloudStart::Matching,
            calls: |id| {
                vec![Call::Delete {
                    known_id: id.map(str::to_owned),
                }]
            },
            finalizer: Some(false),
            condition: None,
            ingress: NONE,
            id_persisted: false,
            events: &["DeletingLoadBalancer", "DeletedLoadBalancer"],
            ..row("class-service-switched-to-cluster-ip-no-leak")
        },
        // IP families: one VIP per family, in the Service's order.
        Row {
            edit: |s| s.spec.as_mut().unwrap().ip_families = Some(vec!["IPv6".into()]),
            ingress: &["IPv6"],
            lb_families: Some(&[IpFamily::V6]),
            backends: Some(&["2001:db8:18::11"]),
            ..created("ipv6-only")
        },
        Row {
            edit: require_dual_stack,
            ingress: &["IPv4", "IPv6"],
            lb_families: Some(&[IpFamily::V4, IpFamily::V6]),
            ..created("dual-stack-ipv4-first")
        },
        Row {
            edit: |s| {
                require_dual_stack(s);
                s.spec.as_mut().unwrap().ip_families = Some(vec!["IPv6".into(), "IPv4".into()]);
            },
            ingress: &["IPv6", "IPv4"],
            lb_families: Some(&[IpFamily::V6, IpFamily::V4]),
            ..created("dual-stack-ipv6-first")
        },
        Row {
            edit: |s| {
                require_dual_stack(s);
                s.spec.as_mut().unwrap().load_balancer_source_ranges =
                    Some(vec!["2001:db8:203::/64".into(), "203.0.113.0/24".into()]);
            },
            ingress: &["IPv4", "IPv6"],
            ..created("dual-stack-mixed-source-ranges")
        },
        Row {
            edit: |s| {
                require_dual_stack(s);
                annotate(s, &KEYS.requested_ip, "2001:db8:51:100::42,198.51.100.42");
            },
            ingress: &["IPv4", "IPv6"],
            ..created("dual-stack-requested-address-per-family")
        },
        Row {
            edit: |s| annotate(s, &KEYS.requested_ip, "2001:db8:51:100::42"),
            ..invalid("requested-address-of-another-family-refused-before-the-cloud")
        },
        Row {
            service: ServiceStart::Served,
            cloud: CloudStart::Matching,
            edit: require_dual_stack,
            extra_nodes: &["198.18.0.12"],
            calls: read_then_update,
            ingress: &["IPv4", "IPv6"],
            events: &["UpdatedLoadBalancer"],
            backends: Some(&["198.18.0.11", "198.18.0.12", "2001:db8:18::11"]),
            ..row("node-without-an-ipv6-address-backs-ipv4-only")
        },
        Row {
            edit: require_dual_stack,
            default_pool_families: Some(&[IpFamily::V4]),
            fail: None,
            lb_families: Some(&[]),
            ..refused(
                "pool-lacks-a-family-nothing-made",
                AddressRefusal::PoolLacksFamily,
                "AddressPoolLacksFamily",
            )
        },
        Row {
            then: Some(|s| set_policy(s, "PreferDualStack")),
            ingress: &["IPv4", "IPv6"],
            lb_families: Some(&[IpFamily::V4, IpFamily::V6]),
            ..updated("upgrade-to-dual-stack-updates-the-same-lb")
        },
        Row {
            edit: require_dual_stack,
            then: Some(|s| set_policy(s, "SingleStack")),
            lb_families: Some(&[IpFamily::V4]),
            ..updated("downgrade-to-single-stack-updates-the-same-lb")
        },
        Row {
            then: Some(|s| set_policy(s, "PreferDualStack")),
            default_pool_families: Some(&[IpFamily::V4]),
            ok: false,
            condition: Some("AddressPoolLacksFamily"),
            events: &["EnsuringLoadBalancer", "SyncLoadBalancerFailed"],
            lb_families: Some(&[IpFamily::V4]),
            ..updated("upgrade-refused-by-the-pool-keeps-the-ipv4-lb")
        },
        Row {
            edit: |s| {
                s.spec.as_mut().unwrap().load_balancer_class = Some("example.com/other".into())
            },
            finalizer: Some(false),
            condition: None,
            ingress: NONE,
            id_persisted: false,
            ..row("other-class-untouched")
        },
    ]
}

/// A node with these comma-separated InternalIPs.
fn node(name: &str, ips: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: None,
        status: Some(NodeStatus {
            addresses: Some(internal_ips(ips)),
            ..Default::default()
        }),
    }
}

fn has_finalizer(svc: &Service) -> bool {
    svc.metadata
        .finalizers
        .as_ref()
        .is_some_and(|f| f.iter().any(|f| f == FINALIZER))
}

async fn event_reasons(client: &kube::Client, name: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let mut listed: Vec<Event> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(name))
        .collect();
    listed.sort_by_key(|e| {
        e.metadata
            .resource_version
            .as_ref()
            .and_then(|v| v.parse::<u64>().ok())
    });
    listed.into_iter().filter_map(|e| e.reason).collect()
}

/// A context on its own Event recorder (the recorder folds repeats of an Event into a
/// series, and each reconcile's Events are checked on their own).
/// The context of a row; `wake` is told the Services whose reconcile a held read's
/// answer starts.
fn context(
    client: &kube::Client,
    provider: &FakeProvider,
    nodes: &reflector::Store<Node>,
    row: &Row,
    namespace_pool: Option<&str>,
    wake: tokio::sync::mpsc::UnboundedSender<ObjectRef<Service>>,
) -> Context<FakeProvider> {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "tandem-controller".into(),
            instance: Some("table".into()),
        },
    );
    Context::new(ContextParts {
        client: client.clone(),
        provider: provider.clone(),
        cluster_id: CLUSTER.parse().unwrap(),
        classes: ClassFilter {
            class: CLASS.into(),
            claim_unclassed: false,
        },
        without_node_ports: row.without_node_ports,
        default_pool: row.default_pool.map(str::to_owned),
        nodes: nodes.clone(),
        namespaces: namespaces(namespace_pool),
        recorder,
        metrics: Metrics::default(),
        resync: Duration::from_secs(300),
        ingress_fields: IngressFields::ALL,
        wake,
    })
}

/// Brings the Service to its starting state through the API, as a user and an earlier
/// reconcile would have.
async fn start_service(
    client: &kube::Client,
    provider: &FakeProvider,
    nodes: &reflector::Store<Node>,
    row: &Row,
) -> Service {
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    let mut svc = base_service(row.name);
    (row.edit)(&mut svc);
    let created = api.create(&PostParams::default(), &svc).await.unwrap();
    if row.service == ServiceStart::New {
        return created;
    }
    // Served earlier (in a Namespace that named no pool then): one reconcile against an
    // empty cloud made the LB, the finalizer, the id and the status.
    let (wake, _) = tokio::sync::mpsc::unbounded_channel();
    let ctx = context(client, provider, nodes, row, None, wake);
    reconcile(Arc::new(created), Arc::new(ctx)).await.unwrap();
    let mut served = api.get(row.name).await.unwrap();
    let id = served.metadata.annotations.as_ref().unwrap()[&KEYS.lb_id].clone();
    match row.cloud {
        CloudStart::Empty => provider.remove(&id),
        CloudStart::Matching => {}
        CloudStart::Drifted => {
            let mut lb = provider
                .load_balancers()
                .into_iter()
                .find(|l| l.id == id)
                .unwrap();
            lb.listeners[0].port = 8080;
            provider.insert(lb);
        }
    }
    match row.service {
        ServiceStart::Deleted => {
            api.delete(row.name, &DeleteParams::default())
                .await
                .unwrap();
            served = api.get(row.name).await.unwrap();
        }
        ServiceStart::SwitchedToClusterIp => {
            served = api
                .patch(
                    row.name,
                    &PatchParams::default(),
                    &Patch::Merge(
                        json!({ "spec": { "type": "ClusterIP", "loadBalancerClass": null } }),
                    ),
                )
                .await
                .unwrap();
        }
        ServiceStart::New | ServiceStart::Served => {}
    }
    if let Some(then) = row.then {
        then(&mut served);
        served = api
            .replace(row.name, &PostParams::default(), &served)
            .await
            .unwrap();
    }
    provider.take_calls();
    served
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_table() {
    let server = tandem_apiserver::spawn(tandem_apiserver::ServerConfig {
        store: tandem_apiserver::StoreConfig {
            service_cidrs: DUAL_STACK_SERVICE_CIDRS.parse().unwrap(),
            ..Default::default()
        },
        ..Default::default()
    })
    .await
    .unwrap();
    let client = server.client().await.unwrap();
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    let mut failures = Vec::new();
    for row in rows() {
        let (nodes, mut writer) = reflector::store::<Node>();
        writer.apply_watcher_event(&watcher::Event::Apply(node("a", NODE_A)));
        let provider = FakeProvider::new(true);
        // The table is the path of a provider without node pools, where each LB carries
        // its backends (node sync's tests cover the pool's), and without held reads: one
        // runs on a task of its own beside the reconcile, so its call would race the
        // row's calls (`api_writes_of_one_service_create_path` covers it).
        provider.set_capabilities(Capabilities {
            node_pools: false,
            waits_out_provisioning: false,
            ..Capabilities::ALL
        });
        if let Some(families) = row.default_pool_families {
            provider.set_pool_families("default", families);
        }
        let start = start_service(&client, &provider, &nodes, &row).await;
        // Each row calls reconcile itself: nothing is started from outside.
        let (wake, _) = tokio::sync::mpsc::unbounded_channel();
        let ctx = context(&client, &provider, &nodes, &row, row.namespace_pool, wake);
        let events_before = event_reasons(&client, row.name).await.len();
        for (i, ip) in row.extra_nodes.iter().enumerate() {
            writer.apply_watcher_event(&watcher::Event::Apply(node(&format!("x{i}"), ip)));
        }
        provider.set_create_active(row.create_active);
        provider.set_delete_async(row.delete_async);
        if let Some((operation, error)) = row.fail.clone() {
            provider.fail_next(operation, error);
        }
        let known_id = start
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(&KEYS.lb_id))
            .cloned();
        let result = reconcile(Arc::new(start), Arc::new(ctx)).await;
        let all_nodes: Vec<Node> = nodes.state().iter().map(|n| n.as_ref().clone()).collect();
        let calls = provider.take_calls();
        let after = api.get_opt(row.name).await.unwrap();
        let events: Vec<String> = event_reasons(&client, row.name)
            .await
            .into_iter()
            .skip(events_before)
            .collect();
        let mut problems = Vec::new();
        if result.is_ok() != row.ok {
            problems.push(format!("result {result:?}"));
        }
        let expected_calls = (row.calls)(known_id.as_deref());
        if calls != expected_calls {
            problems.push(format!("calls {calls:?}, want {expected_calls:?}"));
        }
        if events != row.events {
            problems.push(format!("events {events:?}, want {:?}", row.events));
        }
        match (&after, row.finalizer) {
            (None, None) => {}
            (Some(svc), Some(want)) => {
                if has_finalizer(svc) != want {
                    problems.push(format!("finalizer {}, want {want}", has_finalizer(svc)));
                }
                let reason = condition_reason(svc);
                if reason.as_deref() != row.condition {
                    problems.push(format!("condition {reason:?}, want {:?}", row.condition));
                }
                let ingress = ingress_families(svc);
                if ingress != row.ingress {
                    problems.push(format!("ingress {ingress:?}, want {:?}", row.ingress));
                }
                let id = svc
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(&KEYS.lb_id));
                if id.is_some() != row.id_persisted {
                    problems.push(format!("id {id:?}, want persisted: {}", row.id_persisted));
                }
            }
            (after, want) => problems.push(format!(
                "Service exists: {}, want finalizer {want:?}",
                after.is_some()
            )),
        }
        // Each row has a cloud of its own.
        let lbs = provider.load_balancers();
        if let Some(want) = row.lb_families {
            let families: Vec<IpFamily> = lbs.iter().flat_map(|l| l.ip_families.clone()).collect();
            if families != want {
                problems.push(format!("cloud LB families {families:?}, want {want:?}"));
            }
        }
        if let Some(want) = row.backends {
            let backends: Vec<String> = lbs
                .iter()
                .flat_map(|l| l.backends.iter().map(ToString::to_string))
                .collect();
            if backends != want {
                problems.push(format!("cloud LB backends {backends:?}, want {want:?}"));
            }
        }
        // What the cloud holds matches the Service's need.
        if row.ok
            && row.finalizer == Some(true)
            && let Some(svc) = &after
        {
            let owner = owner_of(svc, &CLUSTER.parse().unwrap()).unwrap();
            let lbs: Vec<_> = provider
                .load_balancers()
                .into_iter()
                .filter(|l| l.owner.as_ref() == Some(&owner))
                .collect();
            let backends = tandem_controller::nodes::eligible_backends(&all_nodes);
            let desired = desired_load_balancer(
                svc,
                &KEYS,
                owner.clone(),
                backends,
                row.without_node_ports,
                row.namespace_pool.or(row.default_pool),
            )
            .unwrap();
            match lbs.as_slice() {
                [lb] if lb.drift(&desired).is_empty()
                    && (row.pool.is_none() || lb.pool.as_deref() == row.pool) => {}
                other => problems.push(format!("cloud holds {other:?} for {desired:?}")),
            }
        }
        if !problems.is_empty() {
            failures.push(format!("{}: {}", row.name, problems.join("; ")));
        }
    }
    server.shutdown().await.unwrap();
    assert!(failures.is_empty(), "failed rows:\n{}", failures.join("\n"));
}

/// The stand-in's writes (every create, update, patch or delete of any object, Events
/// included: each one moves its resourceVersion) and the cloud calls made for one Service
/// from its create to its ingress, in a cloud whose LBs are still provisioning when the
/// create answers, as cloud-mock's are. The cloud calls are the create and one held read
/// that answers when the LB is active (`tandem_controller::provisioning`); its answer is
/// the next reconcile's observation. The writes are the finalizer, the Events
/// `EnsuringLoadBalancer` and `EnsuredLoadBalancer`, the LB id, and one status write of
/// the ingress; no status write for the provisioning in between (there was one until
/// issue 33: 6 writes). The LB id is a patch of its own after the create when the cloud
/// chooses it (5 writes), and goes with the finalizer when the provider plans it
/// (`LoadBalancerProvider::planned_id`, as the mock cloud's does): 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_writes_of_one_service_create_path() {
    assert_eq!(create_path_writes(false).await, 5, "the cloud chooses ids");
    assert_eq!(create_path_writes(true).await, 4, "the client plans ids");
}

/// [`api_writes_of_one_service_create_path`] in a cloud that takes the client's ids
/// (`client_ids`) or not.
async fn create_path_writes(client_ids: bool) -> u64 {
    let server = tandem_apiserver::spawn(tandem_apiserver::ServerConfig::default())
        .await
        .unwrap();
    let client = server.client().await.unwrap();
    let store = server.store().clone();
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    let (nodes, mut writer) = reflector::store::<Node>();
    writer.apply_watcher_event(&watcher::Event::Apply(node("a", "198.18.0.11")));
    let provider = FakeProvider::new(false);
    provider.set_capabilities(Capabilities {
        node_pools: false,
        ..Capabilities::ALL
    });
    provider.set_client_ids(client_ids);
    // The context of any row: no pools, node ports as the table's default.
    let row = Row {
        name: "writes",
        ..rows().remove(0)
    };
    let (wake, mut woken) = tokio::sync::mpsc::unbounded_channel();
    let ctx = Arc::new(context(&client, &provider, &nodes, &row, None, wake));
    let created = api
        .create(&PostParams::default(), &base_service("writes"))
        .await
        .unwrap();
    let before = store.resource_version().unwrap();

    let first = reconcile(Arc::new(created), ctx.clone()).await.unwrap();
    assert_eq!(
        first,
        kube::runtime::controller::Action::requeue(
            tandem_controller::provisioning::HELD_READ + ctx.provisioning_poll
        ),
        "the held read starts the next reconcile; the requeue is only the backstop"
    );
    // The cloud finishes provisioning while the read is held; its answer starts the next
    // reconcile (here: the test's).
    for mut lb in provider.load_balancers() {
        lb.phase = tandem_controller::provider::LoadBalancerPhase::Active;
        provider.insert(lb);
    }
    let started = tokio::time::timeout(Duration::from_secs(10), woken.recv()).await;
    assert_eq!(
        started.ok().flatten(),
        Some(ObjectRef::new("writes").within("default")),
        "the held read answered and started the Service's reconcile"
    );
    let woken = api.get("writes").await.unwrap();
    reconcile(Arc::new(woken), ctx.clone()).await.unwrap();
    assert_eq!(
        provider.take_calls(),
        [
            Call::Create { replaces: None },
            Call::AwaitProvisioned {
                id: provider.load_balancers()[0].id.clone()
            }
        ],
        "the held read's answer is the second reconcile's observation: no other read"
    );
    let served = api.get("writes").await.unwrap();
    assert_eq!(ingress_families(&served), V4);
    assert_eq!(
        condition_reason(&served).as_deref(),
        Some("LoadBalancerActive")
    );
    assert_eq!(
        event_reasons(&client, "writes").await,
        ["EnsuringLoadBalancer", "EnsuredLoadBalancer"]
    );
    let writes = store.resource_version().unwrap() - before;
    let lb_id = served
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(&KEYS.lb_id))
        .cloned();
    assert_eq!(lb_id, Some(provider.load_balancers()[0].id.clone()));

    // Served and in sync: the next reconcile writes nothing.
    let again = store.resource_version().unwrap();
    reconcile(Arc::new(served), ctx.clone()).await.unwrap();
    assert_eq!(store.resource_version().unwrap(), again);
    server.shutdown().await.unwrap();
    writes
}
