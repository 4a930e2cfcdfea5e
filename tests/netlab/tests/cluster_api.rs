//! The node agent and the EndpointSlice writer against a scripted API server (tower-test):
//! which requests they make, in which order, and how they react to 404 and 409.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::client::Body;
use serde_json::{Value, json};
use tandem_netlab::IpFamily;
use tandem_netlab::cluster::{
    Endpoint, EndpointSliceWriter, LabNode, NodeAgent, NodeAgentConfig, endpoint_slice_for,
};
use tower_test::mock::{Handle, SendResponse};

type ApiHandle = Handle<Request<Body>, Response<Body>>;

fn mock_client() -> (kube::Client, ApiHandle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (kube::Client::new(service, "default"), handle)
}

/// The next request: method, path and JSON body (Null when empty).
async fn expect(handle: &mut ApiHandle) -> (Method, String, Value, SendResponse<Response<Body>>) {
    let (request, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
        .await
        .expect("a request")
        .expect("the client is alive");
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    (method, path, body, send)
}

fn respond(send: SendResponse<Response<Body>>, status: StatusCode, body: &Value) {
    send.send_response(
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap(),
    );
}

fn status(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code, "message": reason})
}

/// No further request arrives (the client is done or idle).
async fn expect_no_more(handle: &mut ApiHandle) {
    if let Ok(Some((request, _))) =
        tokio::time::timeout(Duration::from_millis(200), handle.next_request()).await
    {
        panic!("unexpected request {} {}", request.method(), request.uri());
    }
}

fn service() -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some("web".into()),
            namespace: Some("s1".into()),
            uid: Some("svc-uid".into()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: 80,
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

fn endpoint(last: u8, node: &str) -> Endpoint {
    Endpoint {
        ip: [10, 244, 1, last].into(),
        node_name: node.into(),
        ready: true,
        serving: true,
        terminating: false,
    }
}

fn stored(slice: &EndpointSlice, resource_version: &str) -> Value {
    let mut stored = slice.clone();
    stored.metadata.resource_version = Some(resource_version.into());
    stored.metadata.uid = Some("slice-uid".into());
    serde_json::to_value(stored).unwrap()
}

const SLICE_PATH: &str = "/apis/discovery.k8s.io/v1/namespaces/s1/endpointslices/web-tandem-lab";

#[tokio::test]
async fn a_missing_slice_is_created() {
    let (client, mut handle) = mock_client();
    let writer = EndpointSliceWriter::new(client);
    let task = tokio::spawn(async move {
        writer
            .sync(&service(), IpFamily::V4, &[endpoint(2, "node-1")])
            .await
    });

    let (method, path, _, send) = expect(&mut handle).await;
    assert_eq!((method, path.as_str()), (Method::GET, SLICE_PATH));
    respond(send, StatusCode::NOT_FOUND, &status(404, "NotFound"));
    let (method, path, body, send) = expect(&mut handle).await;
    assert_eq!(
        (method, path.as_str()),
        (
            Method::POST,
            "/apis/discovery.k8s.io/v1/namespaces/s1/endpointslices"
        )
    );
    assert_eq!(
        body["metadata"]["labels"]["kubernetes.io/service-name"],
        "web"
    );
    assert_eq!(body["endpoints"][0]["addresses"][0], "10.244.1.2");
    respond(send, StatusCode::CREATED, &body);

    assert!(task.await.unwrap().unwrap(), "wrote");
    expect_no_more(&mut handle).await;
}

#[tokio::test]
async fn an_equal_slice_is_not_written_again() {
    let (client, mut handle) = mock_client();
    let writer = EndpointSliceWriter::new(client);
    let endpoints = [endpoint(2, "node-1"), endpoint(3, "node-1")];
    let desired = endpoint_slice_for(&service(), IpFamily::V4, &endpoints).unwrap();
    let task = tokio::spawn(async move { writer.sync(&service(), IpFamily::V4, &endpoints).await });

    let (_, path, _, send) = expect(&mut handle).await;
    assert_eq!(path, SLICE_PATH);
    respond(send, StatusCode::OK, &stored(&desired, "9"));
    assert!(!task.await.unwrap().unwrap(), "no write");
    expect_no_more(&mut handle).await;
}

#[tokio::test]
async fn a_changed_slice_is_replaced_and_a_conflict_is_retried_with_the_new_version() {
    let (client, mut handle) = mock_client();
    let writer = EndpointSliceWriter::new(client);
    let old = endpoint_slice_for(&service(), IpFamily::V4, &[endpoint(2, "node-1")]).unwrap();
    let task = tokio::spawn(async move {
        writer
            .sync(
                &service(),
                IpFamily::V4,
                &[endpoint(2, "node-1"), endpoint(3, "node-2")],
            )
            .await
    });

    let (_, _, _, send) = expect(&mut handle).await;
    respond(send, StatusCode::OK, &stored(&old, "5"));
    let (method, path, body, send) = expect(&mut handle).await;
    assert_eq!((method, path.as_str()), (Method::PUT, SLICE_PATH));
    assert_eq!(body["metadata"]["resourceVersion"], "5");
    respond(send, StatusCode::CONFLICT, &status(409, "Conflict"));

    let (method, _, _, send) = expect(&mut handle).await;
    assert_eq!(method, Method::GET);
    respond(send, StatusCode::OK, &stored(&old, "6"));
    let (method, _, body, send) = expect(&mut handle).await;
    assert_eq!(method, Method::PUT);
    assert_eq!(body["metadata"]["resourceVersion"], "6");
    assert_eq!(body["endpoints"].as_array().unwrap().len(), 2);
    respond(send, StatusCode::OK, &body);

    assert!(task.await.unwrap().unwrap());
    expect_no_more(&mut handle).await;
}

#[tokio::test]
async fn deleting_removes_both_families_slices_and_a_missing_one_is_fine() {
    let (client, mut handle) = mock_client();
    let writer = EndpointSliceWriter::new(client);
    let task = tokio::spawn(async move { writer.delete(&service()).await });
    let (method, path, _, send) = expect(&mut handle).await;
    assert_eq!((method, path.as_str()), (Method::DELETE, SLICE_PATH));
    respond(send, StatusCode::NOT_FOUND, &status(404, "NotFound"));
    let (method, path, _, send) = expect(&mut handle).await;
    assert_eq!(
        (method, path),
        (Method::DELETE, format!("{SLICE_PATH}-ipv6"))
    );
    respond(send, StatusCode::NOT_FOUND, &status(404, "NotFound"));
    task.await.unwrap().unwrap();
    expect_no_more(&mut handle).await;
}

#[tokio::test]
async fn registering_creates_the_node_posts_ready_and_creates_its_lease() {
    let (client, mut handle) = mock_client();
    let node = LabNode {
        name: "node-1".into(),
        internal_ips: vec![[198, 18, 0, 11].into()],
        pod_cidrs: vec!["10.244.1.0/24".parse().unwrap()],
    };
    let mut agent = NodeAgent::new(client, vec![node], NodeAgentConfig::default());
    let task = tokio::spawn(async move { agent.register().await });

    let (method, path, _, send) = expect(&mut handle).await;
    assert_eq!(
        (method, path.as_str()),
        (Method::GET, "/api/v1/nodes/node-1")
    );
    respond(send, StatusCode::NOT_FOUND, &status(404, "NotFound"));

    let (method, path, mut body, send) = expect(&mut handle).await;
    assert_eq!((method, path.as_str()), (Method::POST, "/api/v1/nodes"));
    assert_eq!(body["spec"]["podCIDR"], "10.244.1.0/24");
    body["metadata"]["uid"] = json!("node-uid");
    respond(send, StatusCode::CREATED, &body);

    let (method, path, body, send) = expect(&mut handle).await;
    assert_eq!(
        (method, path.as_str()),
        (Method::PATCH, "/api/v1/nodes/node-1/status")
    );
    assert_eq!(
        body["status"]["addresses"][0],
        json!({"type": "InternalIP", "address": "198.18.0.11"})
    );
    assert_eq!(body["status"]["conditions"][0]["type"], "Ready");
    assert_eq!(body["status"]["conditions"][0]["status"], "True");
    respond(
        send,
        StatusCode::OK,
        &json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}}),
    );

    let lease_path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases";
    let (method, path, _, send) = expect(&mut handle).await;
    assert_eq!(
        (method, path),
        (Method::PATCH, format!("{lease_path}/node-1"))
    );
    respond(send, StatusCode::NOT_FOUND, &status(404, "NotFound"));
    let (method, path, body, send) = expect(&mut handle).await;
    assert_eq!((method, path.as_str()), (Method::POST, lease_path));
    assert_eq!(body["spec"]["holderIdentity"], "node-1");
    assert_eq!(body["spec"]["leaseDurationSeconds"], 40);
    assert_eq!(body["metadata"]["ownerReferences"][0]["uid"], "node-uid");
    respond(send, StatusCode::CREATED, &body);

    task.await.unwrap().unwrap();
    expect_no_more(&mut handle).await;
}

#[tokio::test]
async fn heartbeats_repeat_until_cancelled_and_survive_errors() {
    let (client, mut handle) = mock_client();
    let node = LabNode {
        name: "node-1".into(),
        internal_ips: vec![[198, 18, 0, 11].into()],
        pod_cidrs: vec!["10.244.1.0/24".parse().unwrap()],
    };
    let config = NodeAgentConfig {
        lease_renew_interval: Duration::from_millis(50),
        lease_duration_seconds: 40,
        status_update_interval: Duration::from_secs(3600),
    };
    let cancel = tokio_util::sync::CancellationToken::new();
    let mut agent = NodeAgent::new(client, vec![node], config);
    let stop = cancel.clone();
    let task = tokio::spawn(async move { agent.run(stop).await });

    // Registration against an existing, Ready node: patched, not created.
    let (method, _, _, send) = expect(&mut handle).await;
    assert_eq!(method, Method::GET);
    let existing = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1", "uid": "u"},
        "status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    respond(send, StatusCode::OK, &existing);
    let (method, path, _, send) = expect(&mut handle).await;
    assert_eq!(
        (method, path.as_str()),
        (Method::PATCH, "/api/v1/nodes/node-1")
    );
    respond(send, StatusCode::OK, &existing);
    let (_, path, body, send) = expect(&mut handle).await;
    assert_eq!(path, "/api/v1/nodes/node-1/status");
    assert_eq!(
        body["status"]["conditions"][0]["lastTransitionTime"], "2026-01-01T00:00:00Z",
        "no status churn"
    );
    respond(send, StatusCode::OK, &existing);
    let (_, _, _, send) = expect(&mut handle).await;
    respond(
        send,
        StatusCode::OK,
        &json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "node-1"}}),
    );

    // Renewals: a failing one is logged and the next tick tries again.
    let (method, path, _, send) = expect(&mut handle).await;
    assert_eq!(method, Method::PATCH);
    assert!(path.ends_with("/leases/node-1"));
    respond(
        send,
        StatusCode::INTERNAL_SERVER_ERROR,
        &status(500, "InternalError"),
    );
    let (method, _, body, send) = expect(&mut handle).await;
    assert_eq!(method, Method::PATCH);
    assert!(body["spec"]["renewTime"].is_string());
    respond(
        send,
        StatusCode::OK,
        &json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "node-1"}}),
    );

    cancel.cancel();
    // A renewal may be in flight when the token fires; answer it so the agent can stop.
    if let Ok(Some((_, send))) =
        tokio::time::timeout(Duration::from_millis(100), handle.next_request()).await
    {
        respond(
            send,
            StatusCode::OK,
            &json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "node-1"}}),
        );
    }
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
