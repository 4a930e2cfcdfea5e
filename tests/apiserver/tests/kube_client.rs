#![allow(clippy::unwrap_used, clippy::expect_used)]
//! kube-rs and kube-runtime against the stand-in, as the controller and node proxy use them.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Namespace, Node, Service};
use k8s_openapi::api::events::v1::Event as EventV1;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::json;
use tandem_apiserver::{RunningServer, ServerConfig, spawn};

const WAIT: Duration = Duration::from_secs(10);

async fn server() -> (RunningServer, kube::Client) {
    let server = spawn(ServerConfig {
        bookmark_interval: Duration::from_millis(200),
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let client = server.client().await.unwrap();
    (server, client)
}

fn lb_service(name: &str) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"type": "LoadBalancer", "selector": {"app": name}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
    }))
    .unwrap()
}

fn api_error(err: kube::Error) -> kube::core::Status {
    match err {
        kube::Error::Api(status) => *status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflector_sees_every_change_in_order() {
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    let (reader, writer) = reflector::store();
    let mut events = Box::pin(watcher(api.clone(), watcher::Config::default()).reflect(writer));
    // Wait for the initial (empty) list to finish.
    loop {
        if let watcher::Event::InitDone = tokio::time::timeout(WAIT, events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            break;
        }
    }
    let mut expected = Vec::new();
    let a = api
        .create(&PostParams::default(), &lb_service("a"))
        .await
        .unwrap();
    expected.push((
        "apply",
        "a".to_string(),
        a.metadata.resource_version.clone().unwrap(),
    ));
    let b = api
        .create(&PostParams::default(), &lb_service("b"))
        .await
        .unwrap();
    expected.push((
        "apply",
        "b".to_string(),
        b.metadata.resource_version.clone().unwrap(),
    ));
    let patch = json!({"metadata": {"annotations": {"x": "1"}}});
    let a2 = api
        .patch("a", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    expected.push((
        "apply",
        "a".to_string(),
        a2.metadata.resource_version.clone().unwrap(),
    ));
    let status =
        json!({"status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.9", "ipMode": "VIP"}]}}});
    let a3 = api
        .patch_status("a", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    expected.push((
        "apply",
        "a".to_string(),
        a3.metadata.resource_version.clone().unwrap(),
    ));
    api.delete("b", &DeleteParams::default()).await.unwrap();
    expected.push(("delete", "b".to_string(), String::new()));

    let mut seen = Vec::new();
    while seen.len() < expected.len() {
        match tokio::time::timeout(WAIT, events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            watcher::Event::Apply(svc) => seen.push((
                "apply",
                svc.metadata.name.unwrap(),
                svc.metadata.resource_version.unwrap(),
            )),
            watcher::Event::Delete(svc) => {
                seen.push(("delete", svc.metadata.name.unwrap(), String::new()))
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
    assert_eq!(seen, expected);
    let rvs: Vec<u64> = seen
        .iter()
        .filter(|s| !s.2.is_empty())
        .map(|s| s.2.parse().unwrap())
        .collect();
    assert!(
        rvs.windows(2).all(|w| w[0] < w[1]),
        "resourceVersions increase: {rvs:?}"
    );
    let cached = reader
        .get(&reflector::ObjectRef::new("a").within("default"))
        .unwrap();
    assert_eq!(
        cached
            .status
            .as_ref()
            .unwrap()
            .load_balancer
            .as_ref()
            .unwrap()
            .ingress
            .as_ref()
            .unwrap()[0]
            .ip
            .as_deref(),
        Some("198.51.100.9")
    );
    assert_eq!(reader.state().len(), 1);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_compaction_makes_the_watcher_relist_and_recover() {
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    api.create(&PostParams::default(), &lb_service("before"))
        .await
        .unwrap();
    let mut events = Box::pin(watcher(api.clone(), watcher::Config::default()));
    let mut inits = 0;
    loop {
        match tokio::time::timeout(WAIT, events.next())
            .await
            .unwrap()
            .unwrap()
        {
            Ok(watcher::Event::Init) => inits += 1,
            Ok(watcher::Event::InitDone) => break,
            _ => {}
        }
    }
    // Changes the watcher misses while it is cut off, then compaction expires its version.
    let stream_rv: u64 = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap()
        .parse()
        .unwrap();
    server.compact_history().unwrap();
    api.create(&PostParams::default(), &lb_service("after"))
        .await
        .unwrap();

    let mut saw_gone = false;
    let mut relisted = BTreeSet::new();
    loop {
        match tokio::time::timeout(WAIT, events.next())
            .await
            .unwrap()
            .unwrap()
        {
            Err(watcher::Error::WatchError(status)) => {
                assert_eq!(status.code, 410);
                saw_gone = true;
            }
            Ok(watcher::Event::Init) => inits += 1,
            Ok(watcher::Event::InitApply(svc)) => {
                relisted.insert(svc.metadata.name.unwrap());
            }
            Ok(watcher::Event::InitDone) => break,
            Ok(watcher::Event::Apply(svc)) => {
                relisted.insert(svc.metadata.name.unwrap());
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(saw_gone, "the resumed watch got 410 Gone");
    assert_eq!(inits, 2, "the watcher relisted once");
    assert_eq!(
        relisted,
        BTreeSet::from(["after".to_string(), "before".to_string()])
    );
    // A raw watch from before the compaction gets an in-stream 410 Expired.
    let mut raw = api
        .watch(&WatchParams::default(), &stream_rv.to_string())
        .await
        .unwrap()
        .boxed();
    match raw.try_next().await.unwrap().unwrap() {
        WatchEvent::Error(status) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"))
        }
        other => panic!("expected 410, got {other:?}"),
    }
    // And the recovered watcher keeps following changes.
    api.delete("before", &DeleteParams::default())
        .await
        .unwrap();
    match tokio::time::timeout(WAIT, events.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        watcher::Event::Delete(svc) => assert_eq!(svc.metadata.name.as_deref(), Some("before")),
        other => panic!("unexpected {other:?}"),
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_list_watcher_works() {
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    api.create(&PostParams::default(), &lb_service("s1"))
        .await
        .unwrap();
    let mut events = Box::pin(watcher(
        api.clone(),
        watcher::Config::default().streaming_lists(),
    ));
    let mut initial = Vec::new();
    loop {
        match tokio::time::timeout(WAIT, events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            watcher::Event::Init => {}
            watcher::Event::InitApply(svc) => initial.push(svc.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(initial, ["s1"]);
    api.create(&PostParams::default(), &lb_service("s2"))
        .await
        .unwrap();
    match tokio::time::timeout(WAIT, events.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        watcher::Event::Apply(svc) => assert_eq!(svc.metadata.name.as_deref(), Some("s2")),
        other => panic!("unexpected {other:?}"),
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_update_conflicts() {
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client, "default");
    let created = api
        .create(&PostParams::default(), &lb_service("web"))
        .await
        .unwrap();
    let mut first = created.clone();
    first
        .metadata
        .labels
        .get_or_insert_default()
        .insert("v".into(), "1".into());
    api.replace("web", &PostParams::default(), &first)
        .await
        .unwrap();
    let mut stale = created;
    stale
        .metadata
        .labels
        .get_or_insert_default()
        .insert("v".into(), "2".into());
    let status = api_error(
        api.replace("web", &PostParams::default(), &stale)
            .await
            .unwrap_err(),
    );
    assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
    // A merge patch carrying a stale resourceVersion conflicts as well.
    let stale_patch = json!({"metadata": {"resourceVersion": "1", "labels": {"v": "3"}}});
    let status = api_error(
        api.patch("web", &PatchParams::default(), &Patch::Merge(&stale_patch))
            .await
            .unwrap_err(),
    );
    assert_eq!(status.code, 409);
    assert_eq!(
        api.get("web").await.unwrap().metadata.labels.unwrap()["v"],
        "1"
    );
    // Creating it again is AlreadyExists, patching a missing object is NotFound.
    let status = api_error(
        api.create(&PostParams::default(), &lb_service("web"))
            .await
            .unwrap_err(),
    );
    assert_eq!(
        (status.code, status.reason.as_str()),
        (409, "AlreadyExists")
    );
    let status = api_error(
        api.patch("nope", &PatchParams::default(), &Patch::Merge(json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!(status.code, 404);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalizers_delay_deletion_until_removed() {
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client, "default");
    let mut svc = lb_service("web");
    svc.metadata.finalizers = Some(vec!["service.kubernetes.io/load-balancer-cleanup".into()]);
    let created = api.create(&PostParams::default(), &svc).await.unwrap();
    let rv = created.metadata.resource_version.unwrap();
    let mut watch = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();

    api.delete("web", &DeleteParams::default()).await.unwrap();
    let marked = api.get("web").await.unwrap();
    assert!(marked.metadata.deletion_timestamp.is_some());
    match tokio::time::timeout(WAIT, watch.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Modified(s) => assert!(s.metadata.deletion_timestamp.is_some()),
        other => panic!("expected MODIFIED, got {other:?}"),
    }
    let remove = json!([{"op": "test", "path": "/metadata/finalizers/0", "value": "service.kubernetes.io/load-balancer-cleanup"}, {"op": "remove", "path": "/metadata/finalizers/0"}]);
    // kube's own json-patch version; the type comes from `Patch::Json`.
    api.patch(
        "web",
        &PatchParams::default(),
        &Patch::<()>::Json(serde_json::from_value(remove).unwrap()),
    )
    .await
    .unwrap();
    match tokio::time::timeout(WAIT, watch.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Deleted(s) => assert_eq!(s.metadata.name.as_deref(), Some("web")),
        other => panic!("expected DELETED, got {other:?}"),
    }
    assert_eq!(api_error(api.get("web").await.unwrap_err()).code, 404);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_json_patch_test_is_rejected() {
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client, "default");
    api.create(&PostParams::default(), &lb_service("web"))
        .await
        .unwrap();
    let patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/type", "value": "NodePort"},
        {"op": "replace", "path": "/spec/sessionAffinity", "value": "ClientIP"}
    ]))
    .unwrap();
    let status = api_error(
        api.patch("web", &PatchParams::default(), &Patch::<()>::Json(patch))
            .await
            .unwrap_err(),
    );
    assert_eq!(status.code, 422);
    assert_eq!(
        api.get("web")
            .await
            .unwrap()
            .spec
            .unwrap()
            .session_affinity
            .as_deref(),
        Some("None")
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_load_balancer_creates_get_unique_node_ports() {
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client, "default");
    let creates = (0..200).map(|i| {
        let api = api.clone();
        tokio::spawn(async move {
            api.create(&PostParams::default(), &lb_service(&format!("svc-{i}")))
                .await
        })
    });
    let started = std::time::Instant::now();
    let created: Vec<Service> = futures::future::join_all(creates)
        .await
        .into_iter()
        .map(|r| r.unwrap().unwrap())
        .collect();
    eprintln!(
        "200 concurrent LoadBalancer creates took {:?}",
        started.elapsed()
    );
    let mut node_ports = BTreeSet::new();
    let mut cluster_ips = BTreeSet::new();
    for svc in &created {
        let spec = svc.spec.as_ref().unwrap();
        let port = spec.ports.as_ref().unwrap()[0].node_port.unwrap();
        assert!((30000..=32767).contains(&port));
        assert!(node_ports.insert(port), "nodePort {port} allocated twice");
        assert!(cluster_ips.insert(spec.cluster_ip.clone().unwrap()));
        assert_eq!(spec.external_traffic_policy.as_deref(), Some("Cluster"));
        assert_eq!(spec.allocate_load_balancer_node_ports, Some(true));
    }
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        200
    );
    // Pagination walks all of them.
    let mut paged = 0;
    let mut params = ListParams::default().limit(64);
    loop {
        let page = api.list(&params).await.unwrap();
        paged += page.items.len();
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => break,
        }
    }
    assert_eq!(paged, 200);
    // Deleting releases the node port: a new Service may request it.
    let port = created[0].spec.as_ref().unwrap().ports.as_ref().unwrap()[0]
        .node_port
        .unwrap();
    let mut wants = lb_service("wants-port");
    wants.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].node_port = Some(port);
    assert_eq!(
        api_error(
            api.create(&PostParams::default(), &wants)
                .await
                .unwrap_err()
        )
        .code,
        422
    );
    api.delete("svc-0", &DeleteParams::default()).await.unwrap();
    let got = api.create(&PostParams::default(), &wants).await.unwrap();
    assert_eq!(got.spec.unwrap().ports.unwrap()[0].node_port, Some(port));
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_services_get_422_with_causes() {
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client, "default");
    let cases = [
        (
            json!({"type": "LoadBalancer", "ports": [{"port": 80, "nodePort": 80}]}),
            "spec.ports[0].nodePort",
            "FieldValueInvalid",
        ),
        (
            json!({"ports": [{"name": "a", "port": 80}, {"name": "b", "port": 80}]}),
            "spec.ports[1]",
            "FieldValueDuplicate",
        ),
        (
            json!({"ports": [{"port": 0}]}),
            "spec.ports[0].port",
            "FieldValueInvalid",
        ),
        (
            json!({"type": "Magic", "ports": [{"port": 80}]}),
            "spec.type",
            "FieldValueNotSupported",
        ),
        (
            json!({"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/33"], "ports": [{"port": 80}]}),
            "spec.loadBalancerSourceRanges[0]",
            "FieldValueInvalid",
        ),
        (
            json!({"clusterIP": "192.168.0.1", "ports": [{"port": 80}]}),
            "spec.clusterIP",
            "FieldValueInvalid",
        ),
    ];
    for (i, (spec, field, reason)) in cases.into_iter().enumerate() {
        let svc: Service =
            serde_json::from_value(json!({"metadata": {"name": format!("bad-{i}")}, "spec": spec}))
                .unwrap();
        let status = api_error(api.create(&PostParams::default(), &svc).await.unwrap_err());
        assert_eq!(
            (status.code, status.reason.as_str()),
            (422, "Invalid"),
            "{field}"
        );
        let causes = status.details.unwrap().causes;
        assert!(
            causes
                .iter()
                .any(|c| c.field == field && c.reason == reason),
            "{field} {reason} not in {causes:?}"
        );
    }
    // Taken node port, and clusterIP changes on update.
    let mut first = lb_service("first");
    first.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].node_port = Some(31000);
    let first = api.create(&PostParams::default(), &first).await.unwrap();
    let mut second = lb_service("second");
    second.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].node_port = Some(31000);
    let status = api_error(
        api.create(&PostParams::default(), &second)
            .await
            .unwrap_err(),
    );
    assert_eq!(
        status.details.unwrap().causes[0].field,
        "spec.ports[0].nodePort"
    );
    let change_ip =
        json!({"spec": {"clusterIP": "10.96.200.200", "clusterIPs": ["10.96.200.200"]}});
    let status = api_error(
        api.patch("first", &PatchParams::default(), &Patch::Merge(&change_ip))
            .await
            .unwrap_err(),
    );
    assert_eq!(status.details.unwrap().causes[0].field, "spec.clusterIP");
    assert_eq!(
        api.get("first").await.unwrap().spec.unwrap().cluster_ip,
        first.spec.unwrap().cluster_ip
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selectors_filter_lists_and_watches() {
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    api.create(&PostParams::default(), &lb_service("a"))
        .await
        .unwrap();
    let b = api
        .create(&PostParams::default(), &lb_service("b"))
        .await
        .unwrap();
    let list = api
        .list(&ListParams::default().labels("app=a"))
        .await
        .unwrap();
    assert_eq!(list.items.len(), 1);
    api.create(&PostParams::default(), &lb_service("doomed"))
        .await
        .unwrap();
    let removed = api
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels("app=doomed"),
        )
        .await
        .unwrap();
    assert_eq!(removed.left().unwrap().items.len(), 1);
    assert_eq!(
        api.list(&ListParams::default()).await.unwrap().items.len(),
        2
    );
    let list = api
        .list(&ListParams::default().fields("metadata.name=b"))
        .await
        .unwrap();
    assert_eq!(list.items[0].metadata.name.as_deref(), Some("b"));
    let all: Api<Service> = Api::all(client);
    assert_eq!(
        all.list(&ListParams::default().labels("app in (a,b)"))
            .await
            .unwrap()
            .items
            .len(),
        2
    );

    let rv = b.metadata.resource_version.unwrap();
    let mut watch = api
        .watch(&WatchParams::default().labels("app=b"), &rv)
        .await
        .unwrap()
        .boxed();
    // b leaves the selection (DELETED for this watcher); a enters it (ADDED).
    api.patch(
        "b",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "gone"}}})),
    )
    .await
    .unwrap();
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "b"}}})),
    )
    .await
    .unwrap();
    match tokio::time::timeout(WAIT, watch.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Deleted(s) => assert_eq!(s.metadata.name.as_deref(), Some("b")),
        other => panic!("expected DELETED, got {other:?}"),
    }
    match tokio::time::timeout(WAIT, watch.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Added(s) => assert_eq!(s.metadata.name.as_deref(), Some("a")),
        other => panic!("expected ADDED, got {other:?}"),
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_get_bookmarks_and_end_at_timeout() {
    let (server, client) = server().await;
    let api: Api<Node> = Api::all(client);
    let rv = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let mut params = WatchParams::default().timeout(1);
    params.bookmarks = true;
    let events: Vec<WatchEvent<Node>> =
        tokio::time::timeout(WAIT, api.watch(&params, &rv).await.unwrap().try_collect())
            .await
            .unwrap()
            .unwrap();
    assert!(!events.is_empty());
    assert!(events.iter().all(|e| matches!(e, WatchEvent::Bookmark(b) if b.metadata.resource_version.parse::<u64>().unwrap() >= rv.parse().unwrap())));
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_subresource_and_generation() {
    let (server, client) = server().await;
    let api: Api<Node> = Api::all(client);
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": "n1"},
        "spec": {"podCIDR": "10.244.1.0/24"},
        "status": {"addresses": [{"type": "InternalIP", "address": "198.18.0.11"}], "conditions": [{"type": "Ready", "status": "True"}]}
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &node).await.unwrap();
    assert_eq!(
        created
            .status
            .as_ref()
            .unwrap()
            .addresses
            .as_ref()
            .unwrap()
            .len(),
        1,
        "nodes keep status on create"
    );
    let heartbeat = json!({"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}]}, "spec": {"unschedulable": true}});
    let patched = api
        .patch_status("n1", &PatchParams::default(), &Patch::Strategic(&heartbeat))
        .await
        .unwrap();
    assert_eq!(
        patched.status.unwrap().conditions.unwrap()[0].status,
        "False"
    );
    assert_eq!(
        patched.spec.as_ref().unwrap().unschedulable,
        None,
        "status writes leave spec alone"
    );
    let cordon = json!({"spec": {"unschedulable": true}, "status": {"conditions": []}});
    let cordoned = api
        .patch("n1", &PatchParams::default(), &Patch::Strategic(&cordon))
        .await
        .unwrap();
    assert_eq!(cordoned.spec.unwrap().unschedulable, Some(true));
    assert_eq!(
        cordoned.status.unwrap().conditions.unwrap().len(),
        1,
        "main writes leave status alone"
    );
    assert_eq!(cordoned.metadata.generation, Some(2));
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_events_namespaces_and_auth() {
    let (server, client) = server().await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let names: BTreeSet<String> = namespaces
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|n| n.metadata.name.unwrap())
        .collect();
    assert!(names.is_superset(&BTreeSet::from([
        "default".into(),
        "kube-system".into(),
        "kube-node-lease".into(),
        "kube-public".into()
    ])));

    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let apply = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "spec": {"holderIdentity": "n1", "leaseDurationSeconds": 40}});
    let lease = leases
        .patch("n1", &PatchParams::apply("tandem"), &Patch::Apply(&apply))
        .await
        .unwrap();
    assert_eq!(lease.spec.unwrap().holder_identity.as_deref(), Some("n1"));

    let v1: Api<EventV1> = Api::namespaced(client.clone(), "default");
    let event: EventV1 = serde_json::from_value(json!({
        "metadata": {"generateName": "web."},
        "regarding": {"kind": "Service", "name": "web", "namespace": "default"},
        "note": "Ensured load balancer", "reason": "EnsuredLoadBalancer", "type": "Normal", "action": "Ensure",
        "eventTime": "2026-01-02T03:04:05.000000Z", "reportingController": "tandem-controller", "reportingInstance": "c-0"
    }))
    .unwrap();
    let created = v1.create(&PostParams::default(), &event).await.unwrap();
    let name = created.metadata.name.unwrap();
    assert!(name.starts_with("web."));
    let core: Api<CoreEvent> = Api::namespaced(client.clone(), "default");
    let seen = core.get(&name).await.unwrap();
    assert_eq!(seen.message.as_deref(), Some("Ensured load balancer"));
    assert_eq!(seen.involved_object.name.as_deref(), Some("web"));
    assert_eq!(
        seen.source.unwrap().component.as_deref(),
        Some("tandem-controller")
    );
    let by_object = core
        .list(&ListParams::default().fields("involvedObject.name=web"))
        .await
        .unwrap();
    assert_eq!(by_object.items.len(), 1);

    // No token, no service; plain HTTP on the same port works with the token.
    let anonymous = plain_http(&server.url(), "GET", "/api/v1/namespaces", None).await;
    assert!(anonymous.starts_with("HTTP/1.1 401"), "{anonymous}");
    assert!(anonymous.contains("\"reason\":\"Unauthorized\""));
    let version = plain_http(&server.url(), "GET", "/version", Some(server.token())).await;
    assert!(
        version.starts_with("HTTP/1.1 200") && version.contains("\"major\":\"1\""),
        "{version}"
    );

    // The admin endpoint compacts history: resuming from an older version is 410.
    let old_rv = created.metadata.resource_version.unwrap();
    let compacted = plain_http(
        &server.url(),
        "POST",
        "/_tandem/compact",
        Some(server.token()),
    )
    .await;
    assert!(compacted.starts_with("HTTP/1.1 200"), "{compacted}");
    let mut raw = v1
        .watch(&WatchParams::default(), &old_rv)
        .await
        .unwrap()
        .boxed();
    match raw.try_next().await.unwrap().unwrap() {
        WatchEvent::Error(status) => assert_eq!(status.code, 410),
        other => panic!("expected 410, got {other:?}"),
    }
    server.shutdown().await.unwrap();
}

/// A bare HTTP/1.1 request over plain TCP (kube clients use the TLS side of the port).
async fn plain_http(url: &str, method: &str, path: &str, token: Option<&str>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(host).await.unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_watchers_each_see_every_change() {
    const WATCHERS: usize = 100;
    const CHANGES: usize = 300;
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    let rv = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let mut watches = Vec::new();
    for _ in 0..WATCHERS {
        watches.push(
            api.watch(&WatchParams::default(), &rv)
                .await
                .unwrap()
                .boxed(),
        );
    }
    let started = std::time::Instant::now();
    for i in 0..CHANGES {
        api.create(&PostParams::default(), &lb_service(&format!("s{i}")))
            .await
            .unwrap();
    }
    let created = started.elapsed();
    let readers = watches.into_iter().map(|mut watch| {
        tokio::spawn(async move {
            let mut names = Vec::new();
            while names.len() < CHANGES {
                match tokio::time::timeout(WAIT, watch.try_next())
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap()
                {
                    WatchEvent::Added(svc) => names.push(svc.metadata.name.unwrap()),
                    WatchEvent::Bookmark(_) => {}
                    other => panic!("unexpected {other:?}"),
                }
            }
            names
        })
    });
    let expected: Vec<String> = (0..CHANGES).map(|i| format!("s{i}")).collect();
    for names in futures::future::join_all(readers).await {
        assert_eq!(names.unwrap(), expected);
    }
    eprintln!(
        "{CHANGES} sequential creates took {created:?}; {WATCHERS} watchers each saw all {CHANGES} in order after {:?}",
        started.elapsed()
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_runtime_recorder_events_show_in_both_views() {
    use kube::runtime::events::{Event as RecordedEvent, EventType, Recorder, Reporter};
    let (server, client) = server().await;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let svc = services
        .create(&PostParams::default(), &lb_service("web"))
        .await
        .unwrap();
    let reporter = Reporter {
        controller: "tandem-controller".into(),
        instance: Some("c-0".into()),
    };
    let recorder = Recorder::new(client.clone(), reporter);
    let event = RecordedEvent {
        type_: EventType::Normal,
        reason: "EnsuredLoadBalancer".into(),
        note: Some("Ensured load balancer".into()),
        action: "Ensure".into(),
        secondary: None,
    };
    let reference = kube::Resource::object_ref(&svc, &());
    recorder.publish(&event, &reference).await.unwrap();
    recorder.publish(&event, &reference).await.unwrap();

    let v1: Api<EventV1> = Api::namespaced(client.clone(), "default");
    let listed = v1.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(
        listed.len(),
        1,
        "the repeat is a series update, not a new event"
    );
    assert_eq!(listed[0].series.as_ref().unwrap().count, 2);
    assert_eq!(
        listed[0].reporting_controller.as_deref(),
        Some("tandem-controller")
    );
    let core: Api<CoreEvent> = Api::namespaced(client, "default");
    let fields = "involvedObject.kind=Service,involvedObject.name=web";
    let seen = core
        .list(&ListParams::default().fields(fields))
        .await
        .unwrap()
        .items;
    assert_eq!(seen[0].reason.as_deref(), Some("EnsuredLoadBalancer"));
    assert_eq!(seen[0].message.as_deref(), Some("Ensured load balancer"));
    assert_eq!(seen[0].involved_object.uid, svc.metadata.uid);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_handle_stops_the_server() {
    let (server, _client) = server().await;
    let addr = server.local_addr();
    assert!(tokio::net::TcpStream::connect(addr).await.is_ok());
    drop(server);
    let deadline = tokio::time::Instant::now() + WAIT;
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "still listening after drop"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_runtime_finalizer_helper_works() {
    use kube::runtime::controller::Action;
    use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};
    use std::sync::Arc;
    const NAME: &str = "service.kubernetes.io/load-balancer-cleanup";
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client, "default");
    api.create(&PostParams::default(), &lb_service("web"))
        .await
        .unwrap();

    async fn step(api: &Api<Service>) -> &'static str {
        let svc = Arc::new(api.get("web").await.unwrap());
        let mut seen = "finalizer added";
        finalizer(api, NAME, svc, |event| {
            seen = match event {
                FinalizerEvent::Apply(_) => "apply",
                FinalizerEvent::Cleanup(_) => "cleanup",
            };
            async { Ok::<_, std::io::Error>(Action::await_change()) }
        })
        .await
        .unwrap();
        seen
    }

    assert_eq!(step(&api).await, "finalizer added");
    assert_eq!(
        api.get("web").await.unwrap().metadata.finalizers,
        Some(vec![NAME.to_string()])
    );
    assert_eq!(step(&api).await, "apply");
    api.delete("web", &DeleteParams::default()).await.unwrap();
    assert_eq!(step(&api).await, "cleanup");
    assert_eq!(api_error(api.get("web").await.unwrap_err()).code, 404);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_lists_and_watches() {
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client, "default");
    let created = api
        .create(&PostParams::default(), &lb_service("web"))
        .await
        .unwrap();
    let list = api.list_metadata(&ListParams::default()).await.unwrap();
    assert_eq!(list.items[0].metadata.name.as_deref(), Some("web"));
    let rv = created.metadata.resource_version.unwrap();
    let mut watch = api
        .watch_metadata(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    api.patch(
        "web",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
    )
    .await
    .unwrap();
    match tokio::time::timeout(WAIT, watch.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Modified(meta) => assert_eq!(meta.metadata.labels.unwrap()["x"], "y"),
        other => panic!("expected MODIFIED, got {other:?}"),
    }
    server.shutdown().await.unwrap();
}

/// kube-rs's `dry_run` parameters: the answer of a real write, nothing written, nothing
/// allocated; a dryRun value other than `All` is refused.
#[tokio::test]
async fn dry_run_writes_answer_and_keep_nothing() {
    let (server, client) = server().await;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let dry_post = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let answer = services
        .create(&dry_post, &lb_service("web"))
        .await
        .unwrap();
    assert!(answer.metadata.uid.is_some() && answer.metadata.resource_version.is_none());
    let node_port = answer.spec.unwrap().ports.unwrap()[0].node_port.unwrap();
    assert!(services.get_opt("web").await.unwrap().is_none());

    // The node port the dry run chose is still free.
    let mut web = lb_service("web");
    web.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].node_port = Some(node_port);
    let created = services.create(&PostParams::default(), &web).await.unwrap();

    let dry_patch = PatchParams {
        dry_run: true,
        ..PatchParams::default()
    };
    let label = json!({"metadata": {"labels": {"tier": "front"}}});
    let patched = services
        .patch("web", &dry_patch, &Patch::Merge(&label))
        .await
        .unwrap();
    assert_eq!(patched.metadata.labels.unwrap()["tier"], "front");
    assert_eq!(
        patched.metadata.resource_version,
        created.metadata.resource_version
    );
    let dry_delete = DeleteParams {
        dry_run: true,
        ..DeleteParams::default()
    };
    services.delete("web", &dry_delete).await.unwrap();
    let live = services.get("web").await.unwrap();
    assert!(!live.metadata.labels.unwrap().contains_key("tier"));
    assert_eq!(
        live.metadata.resource_version,
        created.metadata.resource_version
    );

    let bogus = http::Request::post("/api/v1/namespaces/default/services?dryRun=Some")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&lb_service("other")).unwrap())
        .unwrap();
    let refused = client.request_text(bogus).await.unwrap_err();
    assert!(
        matches!(&refused, kube::Error::Api(s) if s.code == 400 && s.message.contains("\"Some\"")),
        "{refused:?}"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_dual_stack_cluster_gives_services_an_ip_per_family() {
    let server = spawn(ServerConfig {
        store: tandem_apiserver::StoreConfig {
            service_cidrs: "10.96.0.0/16,fd00:10:96::/112".parse().unwrap(),
            ..Default::default()
        },
        ..ServerConfig::default()
    })
    .await
    .unwrap();
    let client = server.client().await.unwrap();
    let services: Api<Service> = Api::namespaced(client, "default");
    let mut svc = lb_service("dual");
    svc.spec.as_mut().unwrap().ip_family_policy = Some("RequireDualStack".into());
    svc.spec.as_mut().unwrap().ip_families = Some(vec!["IPv6".into()]);
    let created = services.create(&PostParams::default(), &svc).await.unwrap();
    let spec = created.spec.unwrap();
    assert_eq!(spec.ip_families, Some(vec!["IPv6".into(), "IPv4".into()]));
    let ips = spec.cluster_ips.unwrap();
    assert!(
        ips[0].starts_with("fd00:10:96::") && ips[1].starts_with("10.96."),
        "{ips:?}"
    );
    assert_eq!(spec.cluster_ip.as_ref(), Some(&ips[0]));
}

/// ServiceCIDRs as a node proxy reads them: found by discovery, the server's own as the
/// default `kubernetes` one, listed and watched through a reflector, cluster-scoped, Ready
/// on create, `spec.cidrs` validated and
/// immutable, status written through `/status`, gone at once when deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_cidrs_are_discovered_watched_validated_and_deleted() {
    use k8s_openapi::api::networking::v1::ServiceCIDR;

    let (server, client) = server().await;
    let served = client
        .list_api_group_resources("networking.k8s.io/v1")
        .await
        .unwrap();
    let names: Vec<&str> = served.resources.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["servicecidrs", "servicecidrs/status"]);
    assert!(!served.resources[0].namespaced);

    let api: Api<ServiceCIDR> = Api::all(client.clone());
    let (reader, writer) = reflector::store();
    let events = watcher(api.clone(), watcher::Config::default()).reflect(writer);
    let watching = tokio::spawn(events.applied_objects().for_each(|_| async {}));
    reader.wait_until_ready().await.unwrap();
    let cidrs_seen = |reader: &reflector::Store<ServiceCIDR>| -> BTreeSet<String> {
        reader
            .state()
            .iter()
            .flat_map(|c| c.spec.clone().unwrap_or_default().cidrs.unwrap_or_default())
            .collect()
    };
    // As kube-apiserver 1.33+: the server's own Service CIDRs are the default ServiceCIDR.
    let default = api.get("kubernetes").await.unwrap();
    let defaults = default.spec.unwrap().cidrs.unwrap();
    assert_eq!(defaults, ["10.96.0.0/16"]);
    let object = |name: &str, cidrs: serde_json::Value| -> ServiceCIDR {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"cidrs": cidrs}}))
            .unwrap()
    };
    let post = PostParams::default();
    let created = api
        .create(
            &post,
            &object("extra", json!(["10.97.0.0/16", "fd00:97::/108"])),
        )
        .await
        .unwrap();
    assert_eq!(created.metadata.namespace, None);
    let ready = &created.status.unwrap().conditions.unwrap()[0];
    assert_eq!(
        (ready.type_.as_str(), ready.status.as_str()),
        ("Ready", "True")
    );
    tokio::time::timeout(WAIT, async {
        while cidrs_seen(&reader).len() != 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap();

    // As kube-apiserver: canonical CIDRs, one per family, and immutable.
    for (cidrs, message) in [
        (json!(["10.98.1.0/16"]), "must be in canonical form"),
        (
            json!(["10.98.0.0/16", "10.99.0.0/16"]),
            "no more than one IP for each IP family",
        ),
        (json!([]), "at least one CIDR required"),
    ] {
        let status = api_error(api.create(&post, &object("bad", cidrs)).await.unwrap_err());
        assert_eq!(status.code, 422);
        assert!(status.message.contains(message), "{}", status.message);
    }
    let moved = api
        .patch(
            "extra",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"cidrs": ["10.98.0.0/16"]}})),
        )
        .await
        .unwrap_err();
    assert!(api_error(moved).message.contains("field is immutable"));

    // The status subresource, as the ServiceCIDR controller writes it.
    let not_ready = json!({"status": {"conditions": [{"type": "Ready", "status": "False",
        "reason": "OverlappingServiceCIDR", "message": "overlaps",
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    let patched = api
        .patch_status("extra", &PatchParams::default(), &Patch::Merge(not_ready))
        .await
        .unwrap();
    assert_eq!(
        patched.status.unwrap().conditions.unwrap()[0].status,
        "False"
    );

    api.delete("extra", &DeleteParams::default()).await.unwrap();
    tokio::time::timeout(WAIT, async {
        while cidrs_seen(&reader).len() != 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap();
    watching.abort();
    server.shutdown().await.unwrap();
}

/// As kube-apiserver: a merge patch that clears `metadata.resourceVersion` asks for an
/// update without one and is refused; leaving it out patches unconditionally.
#[tokio::test]
async fn a_merge_patch_clearing_the_resource_version_is_refused() {
    let (server, client) = server().await;
    let api: Api<Service> = Api::namespaced(client, "default");
    api.create(&PostParams::default(), &lb_service("web"))
        .await
        .unwrap();
    for cleared in [json!(null), json!("")] {
        let patch = json!({"metadata": {"finalizers": ["x/y"], "resourceVersion": cleared}});
        let status = api_error(
            api.patch("web", &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .unwrap_err(),
        );
        assert_eq!(status.code, 422, "{status:?}");
        assert!(
            status.message.contains("must be specified for an update"),
            "{}",
            status.message
        );
    }
    let unconditional = json!({"metadata": {"finalizers": ["x/y"]}});
    api.patch(
        "web",
        &PatchParams::default(),
        &Patch::Merge(&unconditional),
    )
    .await
    .unwrap();
    server.shutdown().await.unwrap();
}
