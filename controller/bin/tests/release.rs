//! `tandem-controller release-load-balancers` (the chart's pre-delete hook) against the API
//! server stand-in + cloud-mock: it refuses while LoadBalancer Services are in use, and
//! otherwise leaves no LB, finalizer, ingress or Lease behind.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// Shared with e2e.rs, which uses the rest of it.
#[allow(dead_code)]
mod support;

use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use support::*;
use tandem_controller::provider::TAG_CLUSTER_ID;

/// The mock cloud's LB-id annotation.
const ANNOTATION_LB_ID: &str = "service.beta.kubernetes.io/mockcloud-load-balancer-id";

const FINALIZER: &str = "service.kubernetes.io/load-balancer-cleanup";
const LEASE: &str = "tandem-controller";
const WAIT: Duration = Duration::from_secs(30);
const ELECTION: [&str; 4] = [
    "--leader-elect",
    "--leader-elect-namespace",
    "default",
    "--leader-elect-lease-duration=4",
];

/// Runs the subcommand to completion: (success, stderr).
async fn release(h: &Harness, extra: &[&str]) -> (bool, String) {
    let output = h
        .controller_command()
        .args(ELECTION)
        .arg("release-load-balancers")
        .args(extra)
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), output)
        .await
        .expect("release-load-balancers did not finish")
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_while_in_use_then_releases_everything() {
    let h = Harness::new("release").await;
    h.add_node("node-1", "198.18.0.11").await;
    let mut controller = h.controller(&ELECTION);
    h.create_service(lb_service("web", &[(80, "TCP")])).await;
    h.create_service(lb_service("gone", &[(81, "TCP")])).await;
    h.wait_served("web").await;
    h.wait_served("gone").await;
    let leases: Api<Lease> = Api::namespaced(h.client.clone(), "default");
    assert!(leases.get_opt(LEASE).await.unwrap().is_some());

    // In use: refused, naming the Services, and nothing is touched.
    let (ok, stderr) = release(&h, &[]).await;
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("refusing")
            && stderr.contains("default/web")
            && stderr.contains("default/gone"),
        "{stderr}"
    );
    assert_eq!(h.cloud.all().await.len(), 2);

    // The controller goes without cleaning up (as when its Deployment is deleted first):
    // a deleted Service then stays terminating, held by our finalizer.
    controller.signal(nix::sys::signal::Signal::SIGKILL);
    controller.wait_exit(WAIT).await;
    h.delete_service("gone").await;
    let stuck = h.get_service("gone").await.expect("held by the finalizer");
    assert!(stuck.metadata.deletion_timestamp.is_some());

    let (ok, stderr) = release(&h, &[]).await;
    assert!(
        !ok && stderr.contains("default/web") && !stderr.contains("default/gone"),
        "{stderr}"
    );

    // web's persisted id names another cluster's LB (edited by hand, or copied from a
    // manifest): that LB is never touched, and web's own LB is still found by its tags.
    let mut foreign_tags = std::collections::BTreeMap::new();
    foreign_tags.insert("kubernetes.io/cluster-id".to_string(), "other".to_string());
    let foreign = h
        .cloud
        .client
        .create_load_balancer(
            &cloud_mock_sdk::LoadBalancerSpec {
                name: "k8s-other-x1".into(),
                tags: foreign_tags,
                mode: cloud_mock_sdk::Mode::Proxy,
                vip: None,
                listeners: vec![cloud_mock_sdk::Listener {
                    protocol: cloud_mock_sdk::Protocol::Tcp,
                    port: 80,
                    backend_port: 30080,
                    health_check: None,
                }],
                backends: vec![],
                node_pool: None,
                source_ranges: vec![],
                address: cloud_mock_sdk::AddressRequest::default(),
            },
            "foreign-1",
        )
        .await
        .unwrap();
    h.patch_service(
        "web",
        serde_json::json!({"metadata": {"annotations": {
            ANNOTATION_LB_ID: foreign.id,
        }}}),
    )
    .await;

    assert_eq!(our_node_pools(&h).await.len(), 1, "the cluster's node pool");
    let (ok, stderr) = release(&h, &["--release-in-use"]).await;
    assert!(ok, "{stderr}");
    assert!(
        h.get_service("gone").await.is_none(),
        "finalizer removed, deletion completes"
    );
    let web = h.get_service("web").await.unwrap();
    assert!(
        !web.metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == FINALIZER)
    );
    assert_eq!(ingress_ip(&web), None);
    let left: Vec<_> = h
        .cloud
        .all()
        .await
        .into_iter()
        .filter(|lb| lb.state != cloud_mock_sdk::State::Deleting)
        .collect();
    assert_eq!(
        left.iter().map(|lb| &lb.id).collect::<Vec<_>>(),
        [&foreign.id],
        "only the foreign LB is left"
    );
    let pools = our_node_pools(&h).await;
    assert!(pools.is_empty(), "the node pool is left: {pools:?}");
    assert!(leases.get_opt(LEASE).await.unwrap().is_none());

    // Idempotent: a second run finds nothing to release and succeeds.
    let (ok, stderr) = release(&h, &["--release-in-use"]).await;
    assert!(ok, "{stderr}");
    h.shutdown().await;
}

async fn our_node_pools(h: &Harness) -> Vec<cloud_mock_sdk::NodePool> {
    let filter = cloud_mock_sdk::ListFilter {
        tags: [(TAG_CLUSTER_ID.to_owned(), h.cluster_id.clone())].into(),
        name: None,
    };
    h.cloud.client.list_node_pools(&filter).await.unwrap()
}
