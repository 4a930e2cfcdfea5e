//! End-to-end: the API server stand-in + cloud-mock + the real controller binary.
//!
//! With `TANDEM_E2E_KUBECONFIG` set (`tandem-k3s control-plane -- cargo test -p
//! tandem-controller --test e2e`), the same tests run against that real API server, one at
//! a time, each in a Namespace of its own (see `support`). The IP-family tests at the end
//! run on a dual-stack stand-in, or on the real server when it serves both families.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use cloud_mock_sdk as sdk;
use serde_json::json;
use support::*;
use tandem_controller::provider::{
    TAG_CLUSTER_ID, TAG_SERVICE_NAME, TAG_SERVICE_NAMESPACE, TAG_SERVICE_UID,
};
use tandem_controller::status::current_ingress;

const FINALIZER: &str = "service.kubernetes.io/load-balancer-cleanup";
// The mock cloud's annotations, as users write them.
const ID_ANNOTATION: &str = "service.beta.kubernetes.io/mockcloud-load-balancer-id";
const ANNOTATION_ADDRESS_POOL: &str =
    "service.beta.kubernetes.io/mockcloud-load-balancer-address-pool";
const ANNOTATION_MODE: &str = "service.beta.kubernetes.io/mockcloud-load-balancer-mode";
const ANNOTATION_REQUESTED_IP: &str = "service.beta.kubernetes.io/mockcloud-load-balancer-ip";
const ANNOTATION_SHARED_IP: &str =
    "service.beta.kubernetes.io/mockcloud-load-balancer-allow-shared-ip";
const WAIT: Duration = Duration::from_secs(30);

async fn two_nodes(h: &Harness) {
    h.add_node("node-1", "198.18.0.11").await;
    h.add_node("node-2", "198.18.0.12").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_lifecycle_create_update_type_change_delete() {
    let h = Harness::start("lifecycle").await;
    two_nodes(&h).await;
    let _controller = h.controller(&[]);
    // A second port of the other protocol, where the cloud proxies UDP (an HAProxy edge
    // refuses it: the lab's end-to-end suite tests that refusal).
    let udp = h.cloud.proxies_udp(&h.cluster_id).await;
    let second_port = if udp { (53, "UDP") } else { (8080, "TCP") };
    let created = h
        .create_service(lb_service("web", &[(80, "TCP"), second_port]))
        .await;
    let (svc, lb) = h.wait_served("web").await;

    // Listeners per port, backend port = nodePort, HTTP /healthz on 10256 (Cluster).
    let node_ports: BTreeSet<(u16, u16)> = svc
        .spec
        .as_ref()
        .unwrap()
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|p| (p.port as u16, p.node_port.unwrap() as u16))
        .collect();
    let listeners: BTreeSet<(u16, u16)> = lb
        .spec
        .listeners
        .iter()
        .map(|l| (l.port, l.backend_port))
        .collect();
    assert_eq!(listeners, node_ports);
    assert_eq!(
        lb.spec
            .listeners
            .iter()
            .any(|l| l.protocol == sdk::Protocol::Udp),
        udp
    );
    for l in &lb.spec.listeners {
        let hc = l.health_check.as_ref().unwrap();
        assert_eq!(
            (hc.protocol, hc.port, hc.path.as_deref()),
            (sdk::HealthCheckProtocol::Http, 10256, Some("/healthz"))
        );
    }
    assert_eq!(backend_ips(&lb), vec!["198.18.0.11", "198.18.0.12"]);
    assert_eq!(lb.spec.mode, sdk::Mode::Proxy);
    assert_eq!(lb.spec.tags.get(TAG_CLUSTER_ID), Some(&h.cluster_id));
    assert_eq!(
        lb.spec.tags.get(TAG_SERVICE_UID),
        created.metadata.uid.as_ref()
    );
    // Status, annotation, finalizer, condition, Events.
    let ingress = &current_ingress(&svc)[0];
    assert_eq!(ingress.ip_mode.as_deref(), h.ip_mode.then_some("Proxy"));
    assert_eq!(
        svc.metadata
            .annotations
            .as_ref()
            .unwrap()
            .get(ID_ANNOTATION),
        Some(&lb.id)
    );
    assert!(
        svc.metadata
            .finalizers
            .as_ref()
            .unwrap()
            .iter()
            .any(|f| f == FINALIZER)
    );
    assert_eq!(
        condition_reason(&svc).as_deref(),
        Some("LoadBalancerActive")
    );
    let reasons: Vec<String> = h.events_for("web").await.into_iter().map(|e| e.1).collect();
    assert!(
        reasons.contains(&"EnsuringLoadBalancer".to_string()),
        "{reasons:?}"
    );
    assert!(
        reasons.contains(&"EnsuredLoadBalancer".to_string()),
        "{reasons:?}"
    );

    // Ports, source ranges and externalTrafficPolicy changes reach the LB.
    h.patch_service(
        "web",
        json!({"spec": {
            "ports": [{"name": "https", "port": 443, "protocol": "TCP"}],
            "loadBalancerSourceRanges": ["203.0.113.0/24"],
            "externalTrafficPolicy": "Local",
        }}),
    )
    .await;
    let updated = h
        .eventually("LB updated", WAIT, || async {
            let lb = h.cloud.client.get_load_balancer(&lb.id).await.ok()?;
            let ok = lb.spec.listeners.len() == 1
                && lb.spec.listeners[0].port == 443
                && lb.spec.source_ranges == vec!["203.0.113.0/24".parse().unwrap()];
            ok.then_some(lb)
        })
        .await;
    let svc = h.get_service("web").await.unwrap();
    let hcnp = svc.spec.as_ref().unwrap().health_check_node_port.unwrap() as u16;
    assert_eq!(
        updated.spec.listeners[0]
            .health_check
            .as_ref()
            .unwrap()
            .port,
        hcnp
    );
    assert_eq!(
        h.cloud
            .for_uid(created.metadata.uid.as_deref().unwrap())
            .await
            .len(),
        1
    );

    // Type change away from LoadBalancer: LB deleted, finalizer gone, status cleared.
    h.patch_service("web", json!({"spec": {"type": "ClusterIP", "externalTrafficPolicy": null, "loadBalancerSourceRanges": null}})).await;
    h.eventually("cleanup after type change", WAIT, || async {
        let svc = h.get_service("web").await?;
        let no_finalizer = !svc
            .metadata
            .finalizers
            .clone()
            .unwrap_or_default()
            .iter()
            .any(|f| f == FINALIZER);
        let cleared = ingress_ip(&svc).is_none() && condition_reason(&svc).is_none();
        let gone = h
            .cloud
            .for_uid(created.metadata.uid.as_deref().unwrap())
            .await
            .is_empty();
        (no_finalizer && cleared && gone).then_some(())
    })
    .await;

    // Back to LoadBalancer, then delete: LB gone, then the Service is gone.
    h.patch_service("web", json!({"spec": {"type": "LoadBalancer"}}))
        .await;
    h.wait_served("web").await;
    h.delete_service("web").await;
    h.eventually("service and LB gone", WAIT, || async {
        let gone = h.get_service("web").await.is_none();
        let lbs = h
            .cloud
            .for_uid(created.metadata.uid.as_deref().unwrap())
            .await;
        (gone && lbs.is_empty()).then_some(())
    })
    .await;
    let reasons: Vec<String> = h.events_for("web").await.into_iter().map(|e| e.1).collect();
    assert!(
        reasons.contains(&"DeletedLoadBalancer".to_string()),
        "{reasons:?}"
    );
    h.shutdown().await;
}

/// Real k3s answered the lifecycle test's merge patch of its Service with 409 Conflict
/// while the controller wrote the same Service: every test write goes through
/// `retry_on_conflict`, which reads again and retries as a user would.
#[tokio::test]
async fn a_write_that_meets_a_conflict_is_retried() {
    let conflict = || {
        kube::Error::Api(Box::new(kube::core::Status {
            code: 409,
            reason: "Conflict".into(),
            message: "Operation cannot be fulfilled on services \"web\": the object has been modified; please apply your changes to the latest version and try again".into(),
            ..Default::default()
        }))
    };
    let attempts = std::sync::atomic::AtomicU32::new(0);
    let written = retry_on_conflict("patching Service web", || async {
        match attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 | 1 => Err(conflict()),
            n => Ok(n),
        }
    })
    .await;
    assert_eq!(
        written, 2,
        "the third attempt, after two conflicts, is taken"
    );
}

/// The cloud calls of `operation` the controller counted.
async fn calls(c: &Controller, operation: &str) -> u64 {
    calls_of(&c.metrics().await, operation)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_follow_nodes() {
    let h = Harness::start("nodes").await;
    two_nodes(&h).await;
    let controller = h.controller(&["--node-debounce-ms", "1000"]);
    h.create_service(lb_service("web", &[(80, "TCP")])).await;
    h.create_service(lb_service("api", &[(8080, "TCP")])).await;
    let (_, web) = h.wait_served("web").await;
    let (_, api) = h.wait_served("api").await;
    let expect = |want: &'static [&'static str]| {
        let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
        let ids = [web.id.clone(), api.id.clone()];
        let h = &h;
        async move {
            h.eventually(&format!("backends {want:?}"), WAIT, || {
                let want = want.clone();
                let ids = ids.clone();
                async move {
                    for id in &ids {
                        let lb = h.cloud.client.get_load_balancer(id).await.ok()?;
                        if backend_ips(&lb) != want {
                            return None;
                        }
                    }
                    Some(())
                }
            })
            .await
        }
    };
    // Every LB references the cluster's node pool.
    let pool = format!("k8s-{}-nodes", h.cluster_id);
    for lb in [&web, &api] {
        assert_eq!(lb.spec.node_pool.as_deref(), Some(pool.as_str()));
        assert!(lb.spec.backends.is_empty(), "{lb:?}");
    }
    // A burst of node churn is debounced into a few writes of the pool, and no LB is
    // written at all: the cost does not grow with the number of LBs.
    let updates_before = calls(&controller, "update").await;
    let writes_before = calls(&controller, "put_node_pool").await;
    for i in 3..=7 {
        h.add_node(&format!("node-{i}"), &format!("198.18.0.1{i}"))
            .await;
    }
    for i in 4..=7 {
        h.delete_node(&format!("node-{i}")).await;
    }
    expect(&["198.18.0.11", "198.18.0.12", "198.18.0.13"]).await;
    let updates = calls(&controller, "update").await - updates_before;
    let writes = calls(&controller, "put_node_pool").await - writes_before;
    assert_eq!(updates, 0, "LB updates after 9 node changes");
    assert!(
        (1..=2).contains(&writes),
        "{writes} pool writes after 9 node changes"
    );
    h.patch_node("node-1", json!({"metadata": {"labels": {"node.kubernetes.io/exclude-from-external-load-balancers": "true"}}})).await;
    expect(&["198.18.0.12", "198.18.0.13"]).await;
    h.patch_node("node-2", json!({"spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}})).await;
    expect(&["198.18.0.13"]).await;
    // NotReady (and cordoned) stays in: the LB's health check handles it.
    h.patch_node_status(
        "node-3",
        json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
    )
    .await;
    h.patch_node("node-3", json!({"spec": {"unschedulable": true}}))
        .await;
    h.patch_node("node-1", json!({"metadata": {"labels": {"node.kubernetes.io/exclude-from-external-load-balancers": "false"}}})).await;
    expect(&["198.18.0.11", "198.18.0.13"]).await;
    h.delete_node("node-1").await;
    expect(&["198.18.0.13"]).await;
    assert_eq!(
        calls(&controller, "update").await,
        updates_before,
        "no LB written"
    );
    h.shutdown().await;
}

/// The scaling problem of the cloud-provider service controller (a node change costs a
/// call per LB) is gone: with twenty LBs, node heartbeats cost no cloud call, a node joining
/// is one write of the node pool and no other cloud call, and every LB serves the new node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_change_costs_one_pool_write_whatever_the_number_of_load_balancers() {
    let h = Harness::start("pool-churn").await;
    two_nodes(&h).await;
    let controller = h.controller(&["--node-debounce-ms", "300"]);
    let names: Vec<String> = (0..20).map(|i| format!("s{i:02}")).collect();
    for name in &names {
        h.create_service(lb_service(name, &[(80, "TCP")])).await;
    }
    let mut ids = Vec::new();
    for name in &names {
        ids.push(h.wait_served(name).await.1.id);
    }
    // Node status heartbeats change Nodes but not the set: no cloud call at all.
    let idle = controller.cloud_calls().await;
    for beat in 0..3 {
        let ready = json!({"type": "Ready", "status": "True",
            "lastHeartbeatTime": format!("2026-01-01T00:00:0{beat}Z")});
        h.patch_node_status("node-1", json!({"status": {"conditions": [ready]}}))
            .await;
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        controller.cloud_calls().await,
        idle,
        "cloud calls for heartbeats"
    );
    let before = controller.cloud_calls().await;
    let writes_before = calls(&controller, "put_node_pool").await;
    h.add_node("node-3", "198.18.0.13").await;
    h.eventually("every LB on the new node", WAIT, || async {
        for id in &ids {
            let lb = h.cloud.client.get_load_balancer(id).await.ok()?;
            if backend_ips(&lb) != ["198.18.0.11", "198.18.0.12", "198.18.0.13"] {
                return None;
            }
        }
        Some(())
    })
    .await;
    let all = controller.cloud_calls().await - before;
    let writes = calls(&controller, "put_node_pool").await - writes_before;
    println!("a node added under 20 LBs: {all} cloud calls ({writes} pool writes)");
    assert_eq!(
        (all, writes),
        (1, 1),
        "cloud calls for one node added under 20 LBs"
    );
    h.shutdown().await;
}

/// Two clusters given one cluster id would take each other's LBs for orphans: the second
/// controller finds the node pool of that id claimed by another cluster and refuses to
/// start, touching nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_id_another_cluster_holds_is_refused() {
    let h = Harness::start("foreign-pool").await;
    two_nodes(&h).await;
    let pool = format!("k8s-{}-nodes", h.cluster_id);
    let theirs = sdk::NodePoolSpec {
        tags: [
            (TAG_CLUSTER_ID.to_owned(), h.cluster_id.clone()),
            (
                "tandem.io/cluster-uid".to_owned(),
                "another-clusters-kube-system-uid".to_owned(),
            ),
        ]
        .into(),
        backends: vec![sdk::families::Backend {
            ip: "198.18.0.99".parse().unwrap(),
        }],
    };
    h.cloud
        .client
        .put_node_pool(&pool, &theirs, None)
        .await
        .unwrap();
    h.create_service(lb_service("web", &[(80, "TCP")])).await;
    let mut controller = h.controller(&[]);
    let status = controller.wait_exit(Duration::from_secs(30)).await;
    assert!(!status.success(), "{status:?}");
    let logs = h.logs();
    assert!(
        logs.contains("belongs to another cluster") && logs.contains("--cluster-id"),
        "{logs}"
    );
    let now = h.cloud.client.get_node_pool(&pool).await.unwrap();
    assert_eq!(now.backends, theirs.backends, "the pool was not touched");
    assert!(h.cloud.all().await.is_empty(), "no LB made");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_is_repaired() {
    let h = Harness::start("drift").await;
    two_nodes(&h).await;
    let _controller = h.controller(&["--resync-seconds", "2"]);
    h.create_service(lb_service("web", &[(80, "TCP")])).await;
    let (svc, lb) = h.wait_served("web").await;
    let uid = svc.metadata.uid.clone().unwrap();
    // Changed behind our back: listeners and the node pool reference are put right.
    let mut tampered = lb.spec.clone();
    tampered.listeners[0].backend_port = 1;
    tampered.node_pool = None;
    tampered.backends.clear();
    h.cloud
        .client
        .update_load_balancer(&lb.id, &tampered, lb.version)
        .await
        .unwrap();
    h.eventually("tampered LB restored", WAIT, || async {
        let now = h.cloud.client.get_load_balancer(&lb.id).await.ok()?;
        (now.spec.listeners == lb.spec.listeners
            && now.spec.node_pool == lb.spec.node_pool
            && backend_ips(&now) == backend_ips(&lb))
        .then_some(())
    })
    .await;
    // The node pool changed behind our back: the drift check writes it again.
    let pool = lb.spec.node_pool.clone().unwrap();
    let pool_spec = sdk::NodePoolSpec {
        tags: h.cloud.client.get_node_pool(&pool).await.unwrap().tags,
        backends: vec![],
    };
    h.cloud
        .client
        .put_node_pool(&pool, &pool_spec, None)
        .await
        .unwrap();
    h.eventually("tampered node pool restored", WAIT, || async {
        let now = h.cloud.client.get_load_balancer(&lb.id).await.ok()?;
        (backend_ips(&now) == backend_ips(&lb)).then_some(())
    })
    .await;
    // Deleted behind our back: a new LB is created and the status follows.
    h.cloud.client.delete_load_balancer(&lb.id).await.unwrap();
    let (svc, new_lb) = h
        .eventually("deleted LB recreated", WAIT, || async {
            let (svc, new_lb) = h.wait_served("web").await;
            (new_lb.id != lb.id).then_some((svc, new_lb))
        })
        .await;
    assert_eq!(
        svc.metadata.annotations.unwrap().get(ID_ANNOTATION),
        Some(&new_lb.id)
    );
    assert_eq!(h.cloud.for_uid(&uid).await.len(), 1);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classes_foreign_lbs_and_orphans() {
    let h = Harness::start("gc").await;
    two_nodes(&h).await;
    // A foreign cluster's LB and an orphan of ours exist before the controller starts.
    let mut foreign_tags = std::collections::BTreeMap::new();
    foreign_tags.insert(
        TAG_CLUSTER_ID.to_string(),
        foreign_cluster_id(&h.cluster_id),
    );
    foreign_tags.insert(TAG_SERVICE_UID.to_string(), "x-1".to_string());
    let spec = |name: &str, tags| sdk::LoadBalancerSpec {
        name: name.into(),
        tags,
        mode: sdk::Mode::Proxy,
        vip: None,
        listeners: vec![sdk::Listener {
            protocol: sdk::Protocol::Tcp,
            port: 80,
            backend_port: 30080,
            health_check: None,
        }],
        backends: vec![],
        node_pool: None,
        source_ranges: vec![],
        address: sdk::AddressRequest::default(),
    };
    let foreign = h
        .cloud
        .client
        .create_load_balancer(
            &spec("k8s-other-x1", foreign_tags),
            &format!("{}-foreign", h.cluster_id),
        )
        .await
        .unwrap();
    let orphan_tags = [
        (TAG_CLUSTER_ID, h.cluster_id.as_str()),
        (TAG_SERVICE_NAMESPACE, "default"),
        (TAG_SERVICE_NAME, "gone"),
        (TAG_SERVICE_UID, "gone-uid"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let orphan = h
        .cloud
        .client
        .create_load_balancer(
            &spec("k8s-lab-goneuid", orphan_tags),
            &format!("{}-orphan", h.cluster_id),
        )
        .await
        .unwrap();
    let _controller = h.controller(&["--gc-seconds", "1"]);
    let mut other = lb_service("other-class", &[(80, "TCP")]);
    other.spec.as_mut().unwrap().load_balancer_class = Some("example.com/other".into());
    h.create_service(other).await;
    h.create_service(lb_service("mine", &[(80, "TCP")])).await;
    h.wait_served("mine").await;
    h.eventually("orphan collected", WAIT, || async {
        h.cloud
            .client
            .get_load_balancer(&orphan.id)
            .await
            .is_err()
            .then_some(())
    })
    .await;
    assert!(
        h.cloud.client.get_load_balancer(&foreign.id).await.is_ok(),
        "foreign LB touched"
    );
    let other = h.get_service("other-class").await.unwrap();
    assert!(
        other
            .metadata
            .finalizers
            .clone()
            .unwrap_or_default()
            .is_empty()
    );
    assert!(ingress_ip(&other).is_none());
    assert!(
        h.cloud
            .for_uid(other.metadata.uid.as_deref().unwrap())
            .await
            .is_empty()
    );
    assert_eq!(
        h.cloud.all().await.len(),
        2,
        "only the foreign LB and ours remain"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_annotations_and_impossible_requests_are_reported() {
    let h = Harness::start("bad").await;
    two_nodes(&h).await;
    let _controller = h.controller(&[]);
    let annotated = |name: &str, port: i32, annotations: &[(&str, &str)]| {
        let mut svc = lb_service(name, &[(port, "TCP")]);
        svc.metadata.annotations = Some(
            annotations
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        svc
    };
    h.create_service(annotated("bad-mode", 80, &[(ANNOTATION_MODE, "bridge")]))
        .await;
    let mut outside = lb_service("outside", &[(80, "TCP")]);
    outside.spec.as_mut().unwrap().load_balancer_ip = Some("192.0.2.10".into());
    h.create_service(outside).await;
    h.create_service(lb_service("good", &[(80, "TCP")])).await;
    h.create_service(annotated("shared", 80, &[(ANNOTATION_SHARED_IP, "k")]))
        .await;
    let (_, good_lb) = h.wait_served("good").await;
    let (_, shared_lb) = h.wait_served("shared").await;
    let good_vip = good_lb.vip().unwrap().to_string();
    let shared_vip = shared_lb.vip().unwrap().to_string();
    // Request the VIP the good Service holds, and the shared one with a clashing port or
    // the other mode.
    h.create_service(annotated(
        "taken",
        80,
        &[(ANNOTATION_REQUESTED_IP, &good_vip)],
    ))
    .await;
    let sharer = [
        (ANNOTATION_SHARED_IP, "k"),
        (ANNOTATION_REQUESTED_IP, shared_vip.as_str()),
    ];
    h.create_service(annotated("clash", 80, &sharer)).await;
    let mut other_mode = sharer.to_vec();
    other_mode.push((ANNOTATION_MODE, "passthrough"));
    h.create_service(annotated("other-mode", 81, &other_mode))
        .await;
    for (name, reason, needle) in [
        ("bad-mode", "InvalidConfiguration", "bridge"),
        ("outside", "AddressOutsidePools", "192.0.2.10"),
        ("taken", "AddressInUse", good_vip.as_str()),
        ("clash", "SharedAddressPortConflict", "80"),
        (
            "other-mode",
            "SharedAddressModeMismatch",
            shared_vip.as_str(),
        ),
    ] {
        h.eventually(&format!("{name} reported"), WAIT, || async {
            let svc = h.get_service(name).await?;
            let events = h.events_for(name).await;
            let warned = events.iter().any(|(t, r, m)| {
                t == "Warning" && r == "SyncLoadBalancerFailed" && m.contains(needle)
            });
            (condition_reason(&svc).as_deref() == Some(reason) && warned).then_some(())
        })
        .await;
    }
    // The served Services are unaffected, never warned, and nothing extra was created.
    for name in ["good", "shared"] {
        h.wait_served(name).await;
        let events = h.events_for(name).await;
        assert!(
            events.iter().all(|(t, _, _)| t != "Warning"),
            "{name}: {events:?}"
        );
    }
    assert_eq!(h.cloud.all().await.len(), 2);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_converge_without_duplicates() {
    let h = Harness::start_with_own_cloud("faults").await;
    two_nodes(&h).await;
    h.cloud
        .set_faults(sdk::Faults {
            error_rate: 0.3,
            latency_ms: 2000,
            rate_limit_per_second: Some(2),
            ..sdk::Faults::default()
        })
        .await;
    let controller = h.controller(&[]);
    let names: Vec<String> = (0..6).map(|i| format!("svc-{i}")).collect();
    for name in &names {
        h.create_service(lb_service(name, &[(80, "TCP")])).await;
    }
    for name in &names {
        h.eventually(
            &format!("{name} served under faults"),
            Duration::from_secs(120),
            || async {
                let svc = h.get_service(name).await?;
                ingress_ip(&svc)?;
                Some(())
            },
        )
        .await;
    }
    h.cloud.set_faults(sdk::Faults::default()).await;
    let metrics = controller.metrics().await;
    for outcome in ["rate_limited", "unavailable"] {
        assert!(
            metrics.contains(&format!("outcome=\"{outcome}\"")),
            "no {outcome} call seen:\n{metrics}"
        );
    }
    let lbs = h.cloud.all().await;
    assert_eq!(lbs.len(), names.len(), "never two LBs for one Service");
    for name in &names {
        h.wait_served(name).await;
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_requested_address_moves_the_same_lb_and_a_settled_one_is_left_alone() {
    let h = Harness::start("moving").await;
    two_nodes(&h).await;
    let controller = h.controller(&["--resync-seconds", "1"]);
    let mut svc = lb_service("moving", &[(80, "TCP")]);
    svc.metadata.annotations = Some(
        [
            (
                ANNOTATION_REQUESTED_IP.to_owned(),
                "198.51.100.50".to_owned(),
            ),
            (ANNOTATION_SHARED_IP.to_owned(), "key".to_owned()),
            (ANNOTATION_ADDRESS_POOL.to_owned(), "default".to_owned()),
        ]
        .into(),
    );
    h.create_service(svc).await;
    let (_, lb) = h.wait_served("moving").await;
    assert_eq!(lb.vip(), Some("198.51.100.50".parse().unwrap()));
    assert_eq!(lb.spec.address.sharing_key.as_deref(), Some("key"));
    // Several resyncs: pool, key and address as the cloud reports them are no drift.
    let updates = calls(&controller, "update").await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        calls(&controller, "update").await,
        updates,
        "a settled LB was rewritten"
    );

    h.patch_service(
        "moving",
        json!({ "metadata": { "annotations": { ANNOTATION_REQUESTED_IP: "198.51.100.60" } } }),
    )
    .await;
    let moved = h
        .eventually("the LB moved to the new address", WAIT, || async {
            let (_, now) = h.wait_served("moving").await;
            (now.vip() == Some("198.51.100.60".parse().unwrap())).then_some(now)
        })
        .await;
    assert_eq!(moved.id, lb.id, "the same LB, updated in place");
    assert_eq!(h.cloud.all().await.len(), 1);
    h.shutdown().await;
}

/// Annotates the test's Namespace with `pool` (creating the Namespace if the API server
/// has none yet).
async fn set_namespace_pool(h: &Harness, pool: &str) {
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> =
        kube::Api::all(h.client.clone());
    let annotated = json!({ "metadata": { "annotations": { ANNOTATION_ADDRESS_POOL: pool } } });
    if namespaces.get_opt(&h.namespace).await.unwrap().is_some() {
        retry_on_conflict(&format!("annotating Namespace {}", h.namespace), || async {
            namespaces
                .patch(
                    &h.namespace,
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&annotated),
                )
                .await
        })
        .await;
    } else {
        let mut namespace: k8s_openapi::api::core::v1::Namespace =
            serde_json::from_value(annotated).unwrap();
        namespace.metadata.name = Some(h.namespace.clone());
        namespaces
            .create(&kube::api::PostParams::default(), &namespace)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_from_flag_then_namespace_and_a_namespace_change_re_ensures_at_once() {
    let h = Harness::start("pools").await;
    two_nodes(&h).await;
    let _controller = h.controller(&["--default-address-pool", "nowhere"]);
    h.create_service(lb_service("web", &[(80, "TCP")])).await;
    h.eventually("the flag's unknown pool reported", WAIT, || async {
        let svc = h.get_service("web").await?;
        let warned = h.events_for("web").await.iter().any(|(t, r, m)| {
            t == "Warning" && r == "SyncLoadBalancerFailed" && m.contains("nowhere")
        });
        (condition_reason(&svc).as_deref() == Some("UnknownAddressPool") && warned).then_some(())
    })
    .await;
    assert!(h.cloud.all().await.is_empty(), "nothing half-created");
    // The Namespace names the pool that exists: the Service is served long before the
    // backstop retry of a permanent error (minutes).
    set_namespace_pool(&h, "default").await;
    let (_, lb) = h.wait_served("web").await;
    assert_eq!(lb.spec.address.pool.as_deref(), Some("default"));
    assert_eq!(h.cloud.all().await.len(), 1);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_mutual_tls_sees_its_quota_on_the_service_until_one_is_freed() {
    let h = Harness::start_with_tenant_cloud("quota", r#"{"loadBalancers": 1}"#).await;
    two_nodes(&h).await;
    let _controller = h.controller(&[]);
    h.create_service(lb_service("first", &[(80, "TCP")])).await;
    h.wait_served("first").await;
    h.create_service(lb_service("second", &[(80, "TCP")])).await;
    let quota = "reached its quota of 1 load balancers (quota loadBalancers)";
    h.eventually("the quota reported on the Service", WAIT, || async {
        let svc = h.get_service("second").await?;
        let named = condition_message(&svc).is_some_and(|message| message.contains(quota));
        let warned =
            h.events_for("second").await.iter().any(|(t, r, m)| {
                t == "Warning" && r == "SyncLoadBalancerFailed" && m.contains(quota)
            });
        (condition_reason(&svc).as_deref() == Some("QuotaExceeded") && named && warned)
            .then_some(())
    })
    .await;
    assert_eq!(h.cloud.all().await.len(), 1, "nothing half-created");
    // The first one gone, a change of the second is served within the quota.
    h.delete_service("first").await;
    h.eventually("the first load balancer gone", WAIT, || async {
        h.cloud.all().await.is_empty().then_some(())
    })
    .await;
    h.patch_service(
        "second",
        json!({"metadata": {"annotations": {"example.com/retry": "now"}}}),
    )
    .await;
    h.wait_served("second").await;
    h.shutdown().await;
}

/// Whether the controller's metrics count a cloud call whose answer never came.
fn an_answer_was_lost(metrics: &str) -> bool {
    ["unavailable", "transport"]
        .iter()
        .any(|outcome| metrics.contains(&format!("outcome=\"{outcome}\"")))
}

/// The cloud commits a share of the changes and then loses the answer (`lost`): every
/// Service still ends with exactly one LB, and deleting them all leaves no LB and no VIP.
async fn lost_answers_converge_and_leak_nothing(label: &str, lost: sdk::LostAnswer) {
    let h = Harness::start_with_own_cloud(label).await;
    two_nodes(&h).await;
    let lose_answers = |rate| sdk::Faults {
        lost_answer_rate: rate,
        lost_answer: lost,
        ..sdk::Faults::default()
    };
    // Every answer is lost until the controller has seen one lost (a random half of four
    // creates may all get through: 1 run in 16), then half of them.
    h.cloud.set_faults(lose_answers(1.0)).await;
    let controller = h.controller(&[]);
    let names: Vec<String> = (0..4).map(|i| format!("svc-{i}")).collect();
    let mut uids = Vec::new();
    for name in &names {
        let created = h.create_service(lb_service(name, &[(80, "TCP")])).await;
        uids.push(created.metadata.uid.unwrap());
    }
    h.eventually("an answer lost", Duration::from_secs(180), || async {
        let metrics = controller.try_metrics().await?;
        an_answer_was_lost(&metrics).then_some(())
    })
    .await;
    h.cloud.set_faults(lose_answers(0.5)).await;
    for name in &names {
        h.eventually(
            &format!("{name} served with lost answers"),
            Duration::from_secs(180),
            || async { ingress_ip(&h.get_service(name).await?) },
        )
        .await;
    }
    for uid in &uids {
        let lbs = h.cloud.for_uid(uid).await;
        assert_eq!(lbs.len(), 1, "exactly one LB for Service {uid}: {lbs:?}");
    }
    assert_eq!(h.cloud.all().await.len(), names.len(), "no duplicate LB");
    for name in &names {
        h.delete_service(name).await;
    }
    for name in &names {
        h.eventually(
            &format!("{name} gone with lost answers"),
            Duration::from_secs(180),
            || async { h.get_service(name).await.is_none().then_some(()) },
        )
        .await;
    }
    h.cloud.set_faults(sdk::Faults::default()).await;
    h.eventually("no LB and no VIP left", WAIT, || async {
        let pools = h.cloud.client.list_pools().await.ok()?;
        let vips: u64 = pools.iter().map(|p| p.allocated).sum();
        (h.cloud.all().await.is_empty() && vips == 0).then_some(())
    })
    .await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_answers_unavailable_converge_and_leak_nothing() {
    lost_answers_converge_and_leak_nothing("lost-503", sdk::LostAnswer::Unavailable).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_answers_reset_converge_and_leak_nothing() {
    lost_answers_converge_and_leak_nothing("lost-reset", sdk::LostAnswer::Reset).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_answers_hang_converge_and_leak_nothing() {
    lost_answers_converge_and_leak_nothing("lost-hang", sdk::LostAnswer::Hang).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_provisioning_then_restart_gives_exactly_one_lb_each() {
    let h = Harness::start("sigkill").await;
    two_nodes(&h).await;
    let mut first = h.controller(&["--concurrency", "8"]);
    let names: Vec<String> = (0..50).map(|i| format!("s{i:02}")).collect();
    for name in &names {
        h.create_service(lb_service(name, &[(80, "TCP")])).await;
    }
    h.eventually("some LBs created", WAIT, || async {
        (h.cloud.all().await.len() >= 10).then_some(())
    })
    .await;
    first.signal(nix::sys::signal::Signal::SIGKILL);
    first.wait_exit(Duration::from_secs(10)).await;
    let restarted = tokio::time::Instant::now();
    let _second = h.controller(&["--concurrency", "8"]);
    for name in &names {
        h.wait_served(name).await;
    }
    println!(
        "50 Services served {:?} after the restart",
        restarted.elapsed()
    );
    assert_eq!(h.cloud.all().await.len(), 50);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_election_only_leader_writes_and_hands_over() {
    let h = Harness::start("leader").await;
    two_nodes(&h).await;
    let args = [
        "--leader-elect",
        "--leader-elect-namespace",
        &h.namespace,
        "--leader-elect-lease-duration",
        "4",
    ];
    let mut a = h.controller(&[&args[..], &["--identity", "replica-a"]].concat());
    h.create_service(lb_service("first", &[(80, "TCP")])).await;
    h.wait_served("first").await;
    let b = h.controller(&[&args[..], &["--identity", "replica-b"]].concat());
    h.eventually("standby serving metrics", WAIT, || async {
        support::http_get(&format!("http://{}/readyz", b.metrics_addr))
            .await
            .ok()?
            .status()
            .is_success()
            .then_some(())
    })
    .await;
    h.create_service(lb_service("second", &[(80, "TCP")])).await;
    h.wait_served("second").await;
    assert_eq!(b.cloud_calls().await, 0, "the standby called the cloud");
    assert!(a.cloud_calls().await > 0);
    a.signal(nix::sys::signal::Signal::SIGKILL);
    a.wait_exit(Duration::from_secs(10)).await;
    let killed = tokio::time::Instant::now();
    h.create_service(lb_service("third", &[(80, "TCP")])).await;
    h.wait_served("third").await;
    let handover = killed.elapsed();
    println!("hand-over plus provisioning took {handover:?}");
    // The new leader's own share: from acquiring the lease to reconciling, on warm stores.
    for line in h
        .logs()
        .lines()
        .filter(|l| l.contains("controller started"))
    {
        println!("{line}");
    }
    assert!(
        handover < Duration::from_secs(4 + 6),
        "hand-over took {handover:?}"
    );
    assert!(b.cloud_calls().await > 0);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_shuts_down_cleanly() {
    let h = Harness::start("sigterm").await;
    let mut c = h.controller(&[]);
    h.eventually("controller ready", WAIT, || async {
        support::http_get(&format!("http://{}/readyz", c.metrics_addr))
            .await
            .ok()?
            .status()
            .is_success()
            .then_some(())
    })
    .await;
    c.signal(nix::sys::signal::Signal::SIGTERM);
    let status = c.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "{status:?}\n{}", h.logs());
    h.shutdown().await;
}

/// Cloud calls of one operation in the controller's metrics.
fn calls_of(metrics: &str, operation: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("tandem_controller_cloud_calls_total{"))
        .filter(|l| l.contains(&format!("operation=\"{operation}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// The leak of issue 13: with `--claim-unclassed=false`, a Service of our class switched
/// to ClusterIP loses its class with its type; our finalizer still makes it ours to clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn class_service_switched_to_cluster_ip_leaves_no_lb_and_no_finalizer() {
    let h = Harness::start("leak").await;
    two_nodes(&h).await;
    let _controller = h.controller(&[
        "--load-balancer-class",
        "tandem.io/mockcloud",
        "--claim-unclassed=false",
    ]);
    let mut svc = lb_service("classy", &[(80, "TCP")]);
    svc.spec.as_mut().unwrap().load_balancer_class = Some("tandem.io/mockcloud".into());
    let created = h.create_service(svc).await;
    h.wait_served("classy").await;
    let uid = created.metadata.uid.clone().unwrap();
    // What a real API server does on the type change: the class goes with the type.
    h.patch_service(
        "classy",
        json!({ "spec": { "type": "ClusterIP", "loadBalancerClass": null } }),
    )
    .await;
    h.eventually("LB deleted and finalizer removed", WAIT, || async {
        let svc = h.get_service("classy").await?;
        let clean = h.cloud.for_uid(&uid).await.is_empty()
            && !svc
                .metadata
                .finalizers
                .clone()
                .unwrap_or_default()
                .iter()
                .any(|f| f == FINALIZER)
            && ingress_ip(&svc).is_none()
            && condition_reason(&svc).is_none()
            && !svc
                .metadata
                .annotations
                .clone()
                .unwrap_or_default()
                .contains_key(ID_ANNOTATION);
        clean.then_some(())
    })
    .await;
    h.shutdown().await;
}

/// `allocateLoadBalancerNodePorts: false`: no node ports, so the LB is a passthrough one
/// routing the VIP to the nodes on the Service port; the create path costs the POST and
/// one read, and the controller's own writes wake nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_node_ports_served_in_passthrough_with_two_cloud_calls() {
    let h = Harness::start("nonodeports").await;
    two_nodes(&h).await;
    let controller = h.controller(&[]);
    let mut svc = lb_service("direct", &[(80, "TCP"), (53, "UDP")]);
    svc.spec.as_mut().unwrap().allocate_load_balancer_node_ports = Some(false);
    h.create_service(svc).await;
    let (svc, lb) = h.wait_served("direct").await;
    assert!(
        svc.spec
            .as_ref()
            .unwrap()
            .ports
            .as_ref()
            .unwrap()
            .iter()
            .all(|p| p.node_port.is_none()),
        "the API server allocated node ports"
    );
    assert_eq!(lb.spec.mode, sdk::Mode::Passthrough);
    let listeners: BTreeSet<(u16, u16)> = lb
        .spec
        .listeners
        .iter()
        .map(|l| (l.port, l.backend_port))
        .collect();
    assert_eq!(listeners, BTreeSet::from([(53, 53), (80, 80)]));
    let ingress = &svc
        .status
        .as_ref()
        .unwrap()
        .load_balancer
        .as_ref()
        .unwrap()
        .ingress;
    assert_eq!(
        ingress.as_ref().unwrap()[0].ip_mode.as_deref(),
        h.ip_mode.then_some("VIP")
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let metrics = controller.metrics().await;
    // The one LIST is the orphan collection at start-up, not this Service's.
    assert_eq!(
        (
            calls_of(&metrics, "create"),
            calls_of(&metrics, "await_provisioned"),
            calls_of(&metrics, "get"),
            calls_of(&metrics, "list"),
            calls_of(&metrics, "update"),
        ),
        (1, 1, 0, 1, 0),
        "create path: one POST and one read, held until the LB is active\n{metrics}"
    );
    h.shutdown().await;
}

/// The same Service refused by configuration: a condition and an Event say why, and the
/// cloud is never asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_node_ports_refused_by_flag_is_explained() {
    let h = Harness::start("refused").await;
    two_nodes(&h).await;
    let controller = h.controller(&["--without-node-ports", "refuse"]);
    let mut svc = lb_service("noports", &[(80, "TCP")]);
    svc.spec.as_mut().unwrap().allocate_load_balancer_node_ports = Some(false);
    h.create_service(svc).await;
    h.eventually("refusal explained", WAIT, || async {
        let svc = h.get_service("noports").await?;
        let explained = condition_reason(&svc).as_deref() == Some("InvalidConfiguration");
        let events = h.events_for("noports").await;
        let warned = events.iter().any(|(kind, reason, message)| {
            kind == "Warning"
                && reason == "SyncLoadBalancerFailed"
                && message.contains("allocateLoadBalancerNodePorts")
        });
        (explained && warned).then_some(())
    })
    .await;
    let metrics = controller.metrics().await;
    for operation in ["create", "get", "update", "delete"] {
        assert_eq!(calls_of(&metrics, operation), 0, "{operation}\n{metrics}");
    }
    assert!(h.cloud.all().await.is_empty());
    h.shutdown().await;
}

// IP families, on a dual-stack cluster (a real server that serves one family skips these):
// IPv6-only and dual-stack Services in either order, backends and source ranges per
// family, upgrades and downgrades in place, and a pool lacking a family refused without a
// half-made LB.

/// A dual-stack harness with a node of each family and one of IPv4 alone, and a
/// controller; `None` on a real server that serves one family.
async fn dual_stack(label: &str) -> Option<(Harness, Controller)> {
    let h = Harness::start_dual_stack(label).await?;
    h.add_node("node-1", "198.18.0.11,2001:db8:18::11").await;
    h.add_node("node-2", "198.18.0.12").await;
    let controller = h.controller(&[]);
    Some((h, controller))
}

fn with_families(
    name: &str,
    policy: &str,
    families: &[&str],
) -> k8s_openapi::api::core::v1::Service {
    let mut svc = lb_service(name, &[(80, "TCP")]);
    let spec = svc.spec.as_mut().unwrap();
    spec.ip_family_policy = Some(policy.into());
    spec.ip_families = Some(families.iter().map(|f| (*f).to_owned()).collect());
    svc
}

fn strings<T: ToString>(items: impl IntoIterator<Item = T>) -> Vec<String> {
    let mut out: Vec<String> = items.into_iter().map(|i| i.to_string()).collect();
    out.sort();
    out
}

/// As [`backend_ips`], of any family.
fn backends(lb: &sdk::families::LoadBalancer) -> Vec<String> {
    match lb.spec.node_pool {
        Some(_) => strings(lb.health.iter().map(|b| b.ip)),
        None => strings(lb.spec.backends.iter().map(|b| b.ip)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_and_dual_stack_services_get_a_vip_per_family_in_order() {
    let Some((h, _controller)) = dual_stack("families").await else {
        return;
    };
    h.create_service(with_families("v6", "SingleStack", &["IPv6"]))
        .await;
    let mut dual = with_families("dual", "RequireDualStack", &["IPv4", "IPv6"]);
    dual.spec.as_mut().unwrap().load_balancer_source_ranges =
        Some(vec!["2001:db8:203::/64".into(), "203.0.113.0/24".into()]);
    h.create_service(dual).await;
    let mut dual6 = with_families("dual6", "RequireDualStack", &["IPv6", "IPv4"]);
    dual6.spec.as_mut().unwrap().external_traffic_policy = Some("Local".into());
    dual6.metadata.annotations = Some(
        [(
            ANNOTATION_REQUESTED_IP.to_owned(),
            "198.51.100.42,2001:db8:51:100::42".to_owned(),
        )]
        .into(),
    );
    h.create_service(dual6).await;

    let (v6, v6_lb) = h.wait_served_as("v6", &["IPv6"]).await;
    // node-2 has no IPv6 address: it backs no IPv6 VIP.
    assert_eq!(backends(&v6_lb), ["2001:db8:18::11"]);
    assert_eq!(condition_reason(&v6).as_deref(), Some("LoadBalancerActive"));

    let (_, dual_lb) = h.wait_served_as("dual", &["IPv4", "IPv6"]).await;
    assert_eq!(
        backends(&dual_lb),
        ["198.18.0.11", "198.18.0.12", "2001:db8:18::11"]
    );
    assert_eq!(
        strings(&dual_lb.spec.source_ranges),
        ["2001:db8:203::/64", "203.0.113.0/24"]
    );

    let (dual6, dual6_lb) = h.wait_served_as("dual6", &["IPv6", "IPv4"]).await;
    let requested: Vec<IpAddr> = vec![
        "2001:db8:51:100::42".parse().unwrap(),
        "198.51.100.42".parse().unwrap(),
    ];
    assert_eq!(ingress_ips(&dual6), requested);
    // externalTrafficPolicy Local: every family's backends are checked on the Service's
    // health-check node port.
    let hc_port = dual6.spec.as_ref().unwrap().health_check_node_port.unwrap();
    for listener in &dual6_lb.spec.listeners {
        assert_eq!(
            listener.health_check.as_ref().map(|c| i32::from(c.port)),
            Some(hc_port)
        );
    }
    // Every entry carries the fields the server keeps, as a single-family one does.
    for entry in current_ingress(&dual6) {
        assert_eq!(entry.ip_mode.as_deref(), h.ip_mode.then_some("Proxy"));
        assert_eq!(entry.ports.as_ref().map(Vec::len), Some(1));
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_and_downgrade_update_the_same_lb_in_place() {
    let Some((h, _controller)) = dual_stack("upgrade").await else {
        return;
    };
    h.create_service(lb_service("web", &[(80, "TCP")])).await;
    let (svc, single) = h.wait_served_as("web", &["IPv4"]).await;
    let uid = svc.metadata.uid.clone().unwrap();

    h.patch_service(
        "web",
        json!({ "spec": { "ipFamilyPolicy": "PreferDualStack" } }),
    )
    .await;
    let (_, dual) = h.wait_served_as("web", &["IPv4", "IPv6"]).await;
    assert_eq!(dual.id, single.id, "upgraded in place");
    assert_eq!(dual.vips()[0], single.vips()[0], "the IPv4 VIP stays");
    assert_eq!(
        backends(&dual),
        ["198.18.0.11", "198.18.0.12", "2001:db8:18::11"]
    );

    h.patch_service(
        "web",
        json!({ "spec": { "ipFamilyPolicy": "SingleStack" } }),
    )
    .await;
    let (_, back) = h.wait_served_as("web", &["IPv4"]).await;
    assert_eq!(back.id, single.id, "downgraded in place");
    assert_eq!(back.vips(), single.vips());
    assert_eq!(backends(&back), ["198.18.0.11", "198.18.0.12"]);
    assert_eq!(h.cloud.families_for_uid(&uid).await.len(), 1);
    // The IPv6 VIP went back to its pool (whose count is this test's alone on its own
    // cloud).
    if !h.cloud.is_shared() {
        let pools = h.cloud.client.list_pools().await.unwrap();
        let v6 = pools
            .iter()
            .find(|p| p.name == "default" && p.family == sdk::IpFamily::Ipv6)
            .unwrap();
        assert_eq!(v6.allocated, 0);
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_lacking_a_family_is_refused_whole_and_retried_on_change() {
    let Some((h, _controller)) = dual_stack("lacks").await else {
        return;
    };
    let mut svc = with_families("web", "RequireDualStack", &["IPv4", "IPv6"]);
    svc.metadata.annotations =
        Some([(ANNOTATION_ADDRESS_POOL.to_owned(), V4_ONLY_POOL.to_owned())].into());
    let uid = h.create_service(svc).await.metadata.uid.unwrap();
    let refused = |needle: &'static str| {
        let h = &h;
        async move {
            let svc = h.get_service("web").await?;
            let warned = h.events_for("web").await.iter().any(|(t, r, m)| {
                t == "Warning" && r == "SyncLoadBalancerFailed" && m.contains(needle)
            });
            (condition_reason(&svc).as_deref() == Some("AddressPoolLacksFamily") && warned)
                .then_some(svc)
        }
    };
    let svc = h
        .eventually("the refusal reported", WAIT, || refused("IPv6"))
        .await;
    // Nothing half-made: no LB of the IPv4 family alone, no ingress.
    assert!(h.cloud.families_for_uid(&uid).await.is_empty());
    assert!(ingress_ips(&svc).is_empty());

    // The Service changes to what the pool has: served at once.
    h.patch_service(
        "web",
        json!({ "spec": { "ipFamilyPolicy": "SingleStack" } }),
    )
    .await;
    let (_, lb) = h.wait_served_as("web", &["IPv4"]).await;
    assert_eq!(lb.spec.address.pool.as_deref(), Some(V4_ONLY_POOL));

    // An upgrade the pool cannot serve is refused; the IPv4 VIP keeps serving.
    h.patch_service(
        "web",
        json!({ "spec": { "ipFamilyPolicy": "PreferDualStack" } }),
    )
    .await;
    let svc = h
        .eventually("the upgrade refused", WAIT, || async {
            let svc = refused("IPv6").await?;
            (ingress_families(&svc) == ["IPv4"]).then_some(svc)
        })
        .await;
    assert_eq!(ingress_ips(&svc), lb.vips());
    let now = h.cloud.families_for_uid(&uid).await;
    assert_eq!(now.len(), 1);
    assert_eq!(now[0].spec.ip_families, [sdk::IpFamily::Ipv4]);
    assert_eq!(now[0].version, lb.version, "the LB was not touched");
    h.shutdown().await;
}
