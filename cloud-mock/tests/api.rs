#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The API driven in-process through the axum router (tower `oneshot`), with the data
//! plane off: round trip, idempotency, concurrency control, VIP conflicts, auth, junk
//! input, and the OpenAPI document against the route table.

use std::time::Duration;

use axum::Router;
use axum::body::Body;

use cloud_mock::testutil::TempDir;
use cloud_mock::{OPENAPI_YAML, Settings, openapi, routes, test_edge};
use http::{Method, Request, StatusCode, header};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

const TOKEN: &str = "test-token";

struct TestApp {
    router: Router,
    cancel: CancellationToken,
    /// Removed after the app stopped (fields drop after [`Drop::drop`]).
    _data_dir: TempDir,
}

impl TestApp {
    /// An app on its own data dir and VIP pool, with its lifecycle task running and fault
    /// injection on.
    async fn start(pool: &str, provisioning_delay: Duration) -> Self {
        Self::start_with(pool, provisioning_delay, true).await
    }

    async fn start_with(pool: &str, provisioning_delay: Duration, fault_injection: bool) -> Self {
        let data_dir = TempDir::new("api");
        let settings = Settings {
            provisioning_delay,
            fault_injection,
            ..test_edge::api_only(data_dir.path(), TOKEN.into(), pool)
        };
        let cancel = CancellationToken::new();
        Self {
            router: test_edge::router(&settings, &cancel).await,
            cancel,
            _data_dir: data_dir,
        }
    }

    async fn send(&self, request: Request<Body>) -> (StatusCode, http::HeaderMap, Value) {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        (status, headers, body)
    }

    async fn call(&self, method: Method, uri: &str, body: Option<Value>) -> (StatusCode, Value) {
        let (status, _, body) = self.send(request(method, uri, body, &[])).await;
        (status, body)
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn request(
    method: Method,
    uri: &str,
    body: Option<Value>,
    extra_headers: &[(&str, &str)],
) -> Request<Body> {
    let mut builder = Request::builder()
        .method(method)
        .uri(uri)
        .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"));
    for (name, value) in extra_headers {
        builder = builder.header(*name, *value);
    }
    match body {
        Some(body) => builder
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
            .unwrap(),
        None => builder.body(Body::empty()).unwrap(),
    }
}

fn spec(name: &str) -> Value {
    json!({
        "name": name,
        "tags": {"cluster": "c1", "service": name},
        "mode": "proxy",
        "listeners": [{"protocol": "TCP", "port": 80, "backendPort": 30080,
                       "healthCheck": {"protocol": "HTTP", "port": 32000, "path": "/healthz"}}],
        "backends": [{"ip": "198.18.0.11"}, {"ip": "198.18.0.12"}],
        "sourceRanges": ["203.0.113.0/24"]
    })
}

fn error_code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("<no error code>")
}

fn error_message(body: &Value) -> &str {
    body["error"]["message"]
        .as_str()
        .unwrap_or("<no error message>")
}

async fn wait_for_state(app: &TestApp, id: &str, state: &str) -> Value {
    for _ in 0..100 {
        let (status, body) = app
            .call(Method::GET, &format!("/v1/loadbalancers/{id}"), None)
            .await;
        if status == StatusCode::OK && body["state"] == state {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{id} never reached {state}");
}

#[tokio::test]
async fn create_get_list_update_delete_round_trip() {
    let app = TestApp::start("127.77.0.0/28", Duration::from_millis(50)).await;

    let (status, headers, created) = app
        .send(request(
            Method::POST,
            "/v1/loadbalancers",
            Some(spec("web")),
            &[],
        ))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let id = created["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("lb-") && id.len() == 11, "{id}");
    assert_eq!(created["vip"], "127.77.0.1");
    assert_eq!(created["state"], "provisioning");
    assert_eq!(created["version"], 1);
    assert_eq!(created["listeners"][0]["backendPort"], 30080);
    assert_eq!(
        created["health"],
        json!([{"ip": "198.18.0.11", "health": "unknown"}, {"ip": "198.18.0.12", "health": "unknown"}])
    );
    assert_eq!(headers[header::LOCATION], format!("/v1/loadbalancers/{id}"));
    assert_eq!(headers[header::ETAG], "\"1\"");

    let active = wait_for_state(&app, &id, "active").await;
    assert_eq!(
        active["version"], 1,
        "state changes do not bump the version"
    );

    app.call(Method::POST, "/v1/loadbalancers", Some(spec("api")))
        .await;
    let (status, list) = app.call(Method::GET, "/v1/loadbalancers", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list["items"].as_array().unwrap().len(), 2);
    let (_, filtered) = app
        .call(
            Method::GET,
            "/v1/loadbalancers?tag=service%3Dweb&tag=cluster%3Dc1",
            None,
        )
        .await;
    let items = filtered["items"].as_array().unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["id"], id.as_str());
    let (_, by_name) = app
        .call(Method::GET, "/v1/loadbalancers?name=api", None)
        .await;
    assert_eq!(by_name["items"][0]["name"], "api");
    let (_, none) = app
        .call(Method::GET, "/v1/loadbalancers?tag=cluster%3Dother", None)
        .await;
    assert_eq!(none["items"], json!([]));

    let mut changed = spec("web");
    changed["backends"] = json!([{"ip": "198.18.0.13"}]);
    let (status, _, updated) = app
        .send(request(
            Method::PUT,
            &format!("/v1/loadbalancers/{id}"),
            Some(changed),
            &[("if-match", "1")],
        ))
        .await;
    assert_eq!(status, StatusCode::OK, "{updated}");
    assert_eq!(updated["version"], 2);
    assert_eq!(
        updated["vip"], "127.77.0.1",
        "an update without vip keeps it"
    );
    assert_eq!(updated["backends"], json!([{"ip": "198.18.0.13"}]));

    let (status, deleting) = app
        .call(Method::DELETE, &format!("/v1/loadbalancers/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert_eq!(deleting["state"], "deleting");
    let mut gone = false;
    for _ in 0..100 {
        let (status, body) = app
            .call(Method::GET, &format!("/v1/loadbalancers/{id}"), None)
            .await;
        if status == StatusCode::NOT_FOUND {
            assert_eq!(error_code(&body), "not-found");
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gone, "deleted load balancer never went away");
    let (status, _) = app
        .call(Method::DELETE, &format!("/v1/loadbalancers/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "delete is idempotent");
}

#[tokio::test]
async fn create_with_the_same_idempotency_key_returns_the_same_load_balancer() {
    let app = TestApp::start("127.77.0.16/28", Duration::ZERO).await;
    let key = [("idempotency-key", "svc-uid-1234")];
    let (status, _, first) = app
        .send(request(
            Method::POST,
            "/v1/loadbalancers",
            Some(spec("a")),
            &key,
        ))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, headers, second) = app
        .send(request(
            Method::POST,
            "/v1/loadbalancers",
            Some(spec("a")),
            &key,
        ))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(second["id"], first["id"]);
    assert_eq!(second["vip"], first["vip"]);
    let (_, list) = app.call(Method::GET, "/v1/loadbalancers", None).await;
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    let (status, _, other) = app
        .send(request(
            Method::POST,
            "/v1/loadbalancers",
            Some(spec("a")),
            &[("idempotency-key", "svc-uid-5678")],
        ))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_ne!(other["id"], first["id"]);
}

#[tokio::test]
async fn a_create_may_choose_its_id_once() {
    let app = TestApp::start("127.77.9.0/28", Duration::ZERO).await;
    let create = |id: &str, key: &str| {
        request(
            Method::POST,
            &format!("/v1/loadbalancers?loadBalancerId={id}"),
            Some(spec("a")),
            &[("idempotency-key", key)],
        )
    };
    let (status, headers, first) = app.send(create("web-1", "k1")).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    assert_eq!(first["id"], "web-1");
    assert_eq!(headers[header::LOCATION], "/v1/loadbalancers/web-1");
    let (status, headers, replay) = app.send(create("web-1", "k1")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replay["id"], "web-1");
    let (status, _, taken) = app.send(create("web-1", "k2")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{taken}");
    assert_eq!(taken["error"]["code"], "id-taken");
    for (hostile, why) in [
        ("Web-1", "upper case"),
        ("web_1", "underscore"),
        ("-web", "leading dash"),
        (&"a".repeat(64), "too long"),
    ] {
        let (status, _, refused) = app.send(create(hostile, "k3")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{why}: {refused}");
        assert_eq!(refused["error"]["code"], "invalid-query");
    }
    let (status, _, unknown) = app
        .send(request(
            Method::POST,
            "/v1/loadbalancers?lbId=x",
            Some(spec("a")),
            &[],
        ))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{unknown}");
    let (_, list) = app.call(Method::GET, "/v1/loadbalancers", None).await;
    assert_eq!(list["items"].as_array().unwrap().len(), 1, "{list}");
}

#[tokio::test]
async fn stale_update_is_rejected() {
    let app = TestApp::start("127.77.0.32/28", Duration::ZERO).await;
    let (_, created) = app
        .call(Method::POST, "/v1/loadbalancers", Some(spec("a")))
        .await;
    let uri = format!("/v1/loadbalancers/{}", created["id"].as_str().unwrap());
    let mut changed = spec("a");
    changed["listeners"][0]["port"] = json!(8080);
    let (status, _, _) = app
        .send(request(
            Method::PUT,
            &uri,
            Some(changed.clone()),
            &[("if-match", "\"1\"")],
        ))
        .await;
    assert_eq!(status, StatusCode::OK);
    changed["listeners"][0]["port"] = json!(9090);
    let (status, _, body) = app
        .send(request(
            Method::PUT,
            &uri,
            Some(changed.clone()),
            &[("if-match", "1")],
        ))
        .await;
    assert_eq!(status, StatusCode::PRECONDITION_FAILED, "{body}");
    assert_eq!(error_code(&body), "version-mismatch");
    assert!(error_message(&body).contains("version 2"), "{body}");
    let (status, _, body) = app
        .send(request(Method::PUT, &uri, Some(changed), &[]))
        .await;
    assert_eq!(status, StatusCode::PRECONDITION_REQUIRED, "{body}");
    let (_, current) = app.call(Method::GET, &uri, None).await;
    assert_eq!(current["listeners"][0]["port"], 8080);
}

#[tokio::test]
async fn requested_vip_taken_is_a_conflict_and_outside_the_pool_is_rejected() {
    let app = TestApp::start("127.77.0.48/28", Duration::ZERO).await;
    let mut wanted = spec("a");
    wanted["vip"] = json!("127.77.0.57");
    let (status, created) = app
        .call(Method::POST, "/v1/loadbalancers", Some(wanted.clone()))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(created["vip"], "127.77.0.57");
    let (status, body) = app
        .call(Method::POST, "/v1/loadbalancers", Some(wanted))
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(error_code(&body), "vip-taken");
    assert!(error_message(&body).contains("127.77.0.57"), "{body}");

    let mut outside = spec("b");
    outside["vip"] = json!("127.78.0.1");
    let (status, body) = app
        .call(Method::POST, "/v1/loadbalancers", Some(outside))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&body), "vip-outside-pool");
}

/// Creates `body`; the status and the answer.
async fn create(app: &TestApp, body: Value) -> (StatusCode, Value) {
    app.call(Method::POST, "/v1/loadbalancers", Some(body))
        .await
}

#[tokio::test]
async fn named_pools_are_listed_chosen_and_refused_clearly() {
    let app = TestApp::start("127.77.1.0/28,blue=127.77.2.0/30", Duration::ZERO).await;
    let (status, pools) = app.call(Method::GET, "/v1/pools", None).await;
    assert_eq!(status, StatusCode::OK, "{pools}");
    assert_eq!(
        pools,
        json!({"items": [
            {"name": "blue", "family": "IPv4", "cidr": "127.77.2.0/30", "size": 2, "allocated": 0},
            {"name": "default", "family": "IPv4", "cidr": "127.77.1.0/28", "size": 14, "allocated": 0},
        ]})
    );

    let mut blue = spec("b");
    blue["pool"] = json!("blue");
    let (status, first) = create(&app, blue.clone()).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    assert_eq!(
        (&first["vip"], &first["pool"]),
        (&json!("127.77.2.1"), &json!("blue"))
    );
    assert_eq!(first["vips"], json!(["127.77.2.1"]));
    assert_eq!(create(&app, blue.clone()).await.0, StatusCode::CREATED);
    let (status, body) = create(&app, blue).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_code(&body), "pool-exhausted");
    assert!(error_message(&body).contains("blue"), "{body}");

    let mut green = spec("g");
    green["pool"] = json!("green");
    let (status, body) = create(&app, green).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_code(&body), "unknown-pool");
    assert!(error_message(&body).contains("green"), "{body}");

    // A requested address picks its pool; one outside every pool is refused.
    let mut requested = spec("r");
    requested["vips"] = json!(["127.77.1.9"]);
    let (status, body) = create(&app, requested).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(
        (&body["vip"], &body["pool"]),
        (&json!("127.77.1.9"), &json!("default"))
    );
    let mut outside = spec("o");
    outside["vips"] = json!(["10.9.9.9"]);
    let (status, body) = create(&app, outside).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::BAD_REQUEST, "vip-outside-pool")
    );

    // Nothing half-made: only the three accepted creates exist.
    let (_, all) = app.call(Method::GET, "/v1/loadbalancers", None).await;
    assert_eq!(all["items"].as_array().unwrap().len(), 3);
    let (_, pools) = app.call(Method::GET, "/v1/pools", None).await;
    assert_eq!(pools["items"][0]["allocated"], 2);
    assert_eq!(pools["items"][1]["allocated"], 1);
}

/// `spec(name)` asking for `families`, with node addresses of those families.
fn spec_of(name: &str, families: &[&str]) -> Value {
    let mut body = spec(name);
    let mut backends = Vec::new();
    for family in families {
        match *family {
            "IPv4" => backends.extend([json!({"ip": "198.18.0.11"}), json!({"ip": "198.18.0.12"})]),
            _ => backends.extend([
                json!({"ip": "2001:db8:18::11"}),
                json!({"ip": "2001:db8:18::12"}),
            ]),
        }
    }
    body["ipFamilies"] = json!(families);
    body["backends"] = json!(backends);
    body["sourceRanges"] = json!(["203.0.113.0/24", "2001:db8:203::/64"]);
    body
}

#[tokio::test]
async fn ip_families_get_a_vip_each_and_a_pool_without_one_is_refused() {
    let app = TestApp::start(
        "127.77.3.0/28,2001:db8:51:100::/120,v4only=127.77.4.0/30",
        Duration::ZERO,
    )
    .await;
    let (_, pools) = app.call(Method::GET, "/v1/pools", None).await;
    assert_eq!(
        pools["items"][1],
        json!({"name": "default", "family": "IPv6", "cidr": "2001:db8:51:100::/120",
               "size": 255, "allocated": 0})
    );

    // Dual-stack, IPv6 first: one VIP per family in that order; `vip` stays IPv4.
    let (status, dual) = create(&app, spec_of("d", &["IPv6", "IPv4"])).await;
    assert_eq!(status, StatusCode::CREATED, "{dual}");
    assert_eq!(dual["ipFamilies"], json!(["IPv6", "IPv4"]));
    assert_eq!(dual["vips"], json!(["2001:db8:51:100::1", "127.77.3.1"]));
    assert_eq!(dual["vip"], json!("127.77.3.1"));
    assert_eq!(dual["sourceRanges"][1], json!("2001:db8:203::/64"));
    assert_eq!(dual["health"][1]["ip"], json!("2001:db8:18::12"));
    let active = wait_for_state(&app, dual["id"].as_str().unwrap(), "active").await;
    assert_eq!(active["vips"], dual["vips"]);

    // IPv6 alone: no `vip` at all.
    let mut v6 = spec_of("six", &["IPv6"]);
    v6["vips"] = json!(["2001:db8:51:100::80"]);
    let (status, single) = create(&app, v6).await;
    assert_eq!(status, StatusCode::CREATED, "{single}");
    assert_eq!(single["vips"], json!(["2001:db8:51:100::80"]));
    assert!(single.get("vip").is_none(), "{single}");

    // A client that sends no families gets IPv4, as before families existed.
    let (status, plain) = create(&app, spec("plain")).await;
    assert_eq!(status, StatusCode::CREATED, "{plain}");
    assert_eq!(plain["ipFamilies"], json!(["IPv4"]));
    assert_eq!(plain["vips"], json!(["127.77.3.2"]));

    // A pool without a family asked for: refused whole, with its own code.
    let mut lacking = spec_of("l", &["IPv4", "IPv6"]);
    lacking["pool"] = json!("v4only");
    let (status, body) = create(&app, lacking).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_code(&body), "pool-lacks-family");
    assert!(
        error_message(&body).contains("v4only") && error_message(&body).contains("IPv6"),
        "{body}"
    );
    // Backends of a family the LB does not have, an address of another family, twice
    // the same family: clear 422s.
    let mut stray = spec_of("s", &["IPv4"]);
    stray["backends"] = json!([{"ip": "2001:db8:18::11"}]);
    let (status, body) = create(&app, stray).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::UNPROCESSABLE_ENTITY, "invalid")
    );
    assert!(error_message(&body).starts_with("backends[0].ip"), "{body}");
    let mut mismatch = spec("m");
    mismatch["vips"] = json!(["2001:db8:51:100::9"]);
    let (status, body) = create(&app, mismatch).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::UNPROCESSABLE_ENTITY, "invalid")
    );
    let (status, body) = create(&app, spec_of("x", &["IPv4", "IPv4"])).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::UNPROCESSABLE_ENTITY, "invalid")
    );
    let mut junk = spec("j");
    junk["ipFamilies"] = json!(["IPv5"]);
    let (status, body) = create(&app, junk).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::BAD_REQUEST, "invalid-field")
    );
    assert!(error_message(&body).contains("ipFamilies"), "{body}");

    let (_, all) = app.call(Method::GET, "/v1/loadbalancers", None).await;
    assert_eq!(
        all["items"].as_array().unwrap().len(),
        3,
        "nothing half made"
    );
    let (_, pools) = app.call(Method::GET, "/v1/pools", None).await;
    let held: Vec<&Value> = pools["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pool| &pool["allocated"])
        .collect();
    assert_eq!(held, vec![&json!(2), &json!(2), &json!(0)]);

    // An update adds IPv6 to the plain one, keeping its IPv4 address.
    let id = plain["id"].as_str().unwrap();
    let (status, _, grown) = app
        .send(request(
            Method::PUT,
            &format!("/v1/loadbalancers/{id}"),
            Some(spec_of("plain", &["IPv4", "IPv6"])),
            &[("If-Match", "1")],
        ))
        .await;
    assert_eq!(status, StatusCode::OK, "{grown}");
    assert_eq!(grown["vips"], json!(["127.77.3.2", "2001:db8:51:100::2"]));
}

#[tokio::test]
async fn the_sdk_sends_and_reads_both_views() {
    let app = TestApp::start("127.77.5.0/28,2001:db8:51:100::/120", Duration::ZERO).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let router = app.router.clone();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let client =
        cloud_mock_sdk::Client::new(&url, TOKEN, cloud_mock_sdk::ClientOptions::default()).unwrap();
    let spec: cloud_mock_sdk::families::LoadBalancerSpec =
        serde_json::from_value(spec_of("sdk", &["IPv4", "IPv6"])).unwrap();
    let made = client
        .families()
        .create_load_balancer(&spec, "sdk-key")
        .await
        .unwrap();
    assert_eq!(
        made.vip_of(cloud_mock_sdk::IpFamily::Ipv6),
        Some("2001:db8:51:100::1".parse().unwrap())
    );
    assert_eq!(made.health.len(), 4);
    // A client of the IPv4 view reads the same load balancer: its IPv4 half.
    let seen = client.get_load_balancer(&made.id).await.unwrap();
    assert_eq!(seen.vip(), Some("127.77.5.1".parse().unwrap()));
    assert_eq!(seen.spec.backends.len(), 2);
    assert_eq!(seen.health.len(), 2);
    let listed = client
        .families()
        .list_load_balancers(&Default::default())
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].spec, made.spec);
    let mut shrunk = spec.clone();
    shrunk.ip_families = vec![cloud_mock_sdk::IpFamily::Ipv6];
    shrunk.backends.retain(|b| b.ip.is_ipv6());
    let updated = client
        .families()
        .update_load_balancer(&made.id, &shrunk, made.version)
        .await
        .unwrap();
    assert_eq!(
        updated.vips(),
        ["2001:db8:51:100::1".parse::<std::net::IpAddr>().unwrap()]
    );
    assert_eq!(
        client.get_load_balancer(&made.id).await.unwrap().vip(),
        None
    );
    server.abort();
}

#[tokio::test]
async fn a_sharing_key_shares_one_vip_between_disjoint_ports() {
    let app = TestApp::start("127.77.3.0/28", Duration::ZERO).await;
    let mut web = spec("web");
    web["sharingKey"] = json!("edge");
    let (_, web) = create(&app, web).await;
    let vip = web["vip"].clone();
    let mut dns = spec("dns");
    dns["sharingKey"] = json!("edge");
    dns["vip"] = vip.clone();
    dns["listeners"][0]["port"] = json!(53);
    dns["listeners"][0]["protocol"] = json!("UDP");
    let (status, dns) = create(&app, dns).await;
    assert_eq!(status, StatusCode::CREATED, "{dns}");
    assert_eq!(dns["vip"], vip);

    let mut clash = spec("clash");
    clash["sharingKey"] = json!("edge");
    clash["vip"] = vip.clone();
    let (status, body) = create(&app, clash).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::CONFLICT, "port-conflict")
    );
    assert!(error_message(&body).contains("TCP port 80 "), "{body}");
    let mut stranger = spec("stranger");
    stranger["vip"] = vip.clone();
    stranger["listeners"][0]["port"] = json!(9999);
    let (status, body) = create(&app, stranger).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::CONFLICT, "vip-taken")
    );

    // Moving one sharer away is an update of the same load balancer.
    let uri = format!("/v1/loadbalancers/{}", dns["id"].as_str().unwrap());
    let mut moved = dns.clone();
    for field in ["id", "state", "version", "health"] {
        moved.as_object_mut().unwrap().remove(field);
    }
    moved["vip"] = json!("127.77.3.14");
    moved["vips"] = json!(["127.77.3.14"]);
    let (status, _, body) = app
        .send(request(
            Method::PUT,
            &uri,
            Some(moved),
            &[("if-match", "1")],
        ))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        (&body["id"], &body["vip"]),
        (&dns["id"], &json!("127.77.3.14"))
    );
    let (_, all) = app.call(Method::GET, "/v1/loadbalancers", None).await;
    assert_eq!(all["items"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn requests_without_the_token_are_unauthorized() {
    let app = TestApp::start("127.77.0.64/28", Duration::ZERO).await;
    for (method, uri) in [
        (Method::GET, "/v1/loadbalancers"),
        (Method::GET, "/v1/loadbalancers/lb-00000000"),
        (Method::DELETE, "/v1/loadbalancers/lb-00000000"),
        (Method::PUT, "/v1/admin/faults"),
    ] {
        let unauthenticated = Request::builder()
            .method(method.clone())
            .uri(uri)
            .body(Body::empty())
            .unwrap();
        let (status, headers, body) = app.send(unauthenticated).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {uri}");
        assert_eq!(error_code(&body), "unauthorized");
        assert!(headers.contains_key(header::WWW_AUTHENTICATE));
        let wrong = Request::builder()
            .method(method.clone())
            .uri(uri)
            .header(header::AUTHORIZATION, "Bearer nope")
            .body(Body::empty())
            .unwrap();
        assert_eq!(app.send(wrong).await.0, StatusCode::UNAUTHORIZED);
    }
    let health = Request::get("/healthz").body(Body::empty()).unwrap();
    assert_eq!(app.send(health).await.0, StatusCode::OK);
}

#[tokio::test]
async fn junk_input_gets_a_clear_4xx() {
    let app = TestApp::start("127.77.0.80/28", Duration::ZERO).await;
    let raw = |body: Vec<u8>| {
        Request::post("/v1/loadbalancers")
            .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .unwrap()
    };

    let (status, _, body) = app.send(raw(b"{\"name\": \"a\",".to_vec())).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&body), "malformed-json");

    let (status, _, body) = app.send(raw(vec![0xff, 0xfe, 0x00])).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");

    let mut wrong_type = spec("a");
    wrong_type["backends"] = json!("198.18.0.11");
    let (status, body) = app
        .call(Method::POST, "/v1/loadbalancers", Some(wrong_type))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&body), "invalid-field");
    assert!(error_message(&body).starts_with("backends: "), "{body}");

    let mut out_of_range = spec("a");
    out_of_range["listeners"][0]["port"] = json!(65536);
    let (status, body) = app
        .call(Method::POST, "/v1/loadbalancers", Some(out_of_range))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_message(&body).starts_with("listeners[0].port: "),
        "{body}"
    );
    assert!(error_message(&body).contains("65536"), "{body}");

    let mut negative = spec("a");
    negative["listeners"][0]["backendPort"] = json!(-1);
    let (status, body) = app
        .call(Method::POST, "/v1/loadbalancers", Some(negative))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error_message(&body).starts_with("listeners[0].backendPort: "),
        "{body}"
    );

    let mut zero_port = spec("a");
    zero_port["listeners"][0]["healthCheck"]["port"] = json!(0);
    let (status, body) = app
        .call(Method::POST, "/v1/loadbalancers", Some(zero_port))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(error_code(&body), "invalid");
    assert!(
        error_message(&body)
            .starts_with("listeners[0].healthCheck.port: must be between 1 and 65535"),
        "{body}"
    );

    let mut missing = spec("a");
    missing.as_object_mut().unwrap().remove("mode");
    let (status, body) = app
        .call(Method::POST, "/v1/loadbalancers", Some(missing))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(error_message(&body).contains("mode"), "{body}");

    let huge = vec![b' '; 2 * 1024 * 1024];
    let (status, _, body) = app.send(raw(huge)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(error_code(&body), "payload-too-large");

    let text = Request::post("/v1/loadbalancers")
        .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Body::from(spec("a").to_string()))
        .unwrap();
    assert_eq!(app.send(text).await.0, StatusCode::UNSUPPORTED_MEDIA_TYPE);

    let (status, _, body) = app
        .send(request(
            Method::POST,
            "/v1/loadbalancers",
            Some(spec("a")),
            &[("idempotency-key", "")],
        ))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&body), "invalid-header");

    let (status, body) = app
        .call(Method::GET, "/v1/loadbalancers?tag=novalue", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_code(&body), "invalid-query");

    let (status, body) = app.call(Method::PATCH, "/v1/loadbalancers", None).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(error_code(&body), "method-not-allowed");
    let (status, body) = app.call(Method::GET, "/v2/nothing", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_code(&body), "no-route");

    let (status, body) = app
        .call(
            Method::PUT,
            "/v1/admin/faults",
            Some(json!({"errorRate": 2.0})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(error_message(&body).starts_with("errorRate"), "{body}");

    let (_, list) = app.call(Method::GET, "/v1/loadbalancers", None).await;
    assert_eq!(list["items"], json!([]), "no junk request created anything");
}

#[tokio::test]
async fn faults_inject_rate_limits_and_errors() {
    let app = TestApp::start("127.77.0.96/28", Duration::ZERO).await;
    let (status, _) = app
        .call(
            Method::PUT,
            "/v1/admin/faults",
            Some(json!({"rateLimitPerSecond": 1})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        app.call(Method::GET, "/v1/loadbalancers", None).await.0,
        StatusCode::OK
    );
    let (status, headers, body) = app
        .send(request(Method::GET, "/v1/loadbalancers", None, &[]))
        .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers[header::RETRY_AFTER], "1");
    assert_eq!(error_code(&body), "rate-limited");
    // Admin and health routes are never limited, so faults can always be cleared.
    let (_, faults) = app.call(Method::GET, "/v1/admin/faults", None).await;
    assert_eq!(faults["rateLimitPerSecond"], 1);

    app.call(
        Method::PUT,
        "/v1/admin/faults",
        Some(json!({"errorRate": 1.0})),
    )
    .await;
    let (status, body) = app.call(Method::GET, "/v1/loadbalancers", None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error_code(&body), "unavailable");

    app.call(Method::PUT, "/v1/admin/faults", Some(json!({})))
        .await;
    assert_eq!(
        app.call(Method::GET, "/v1/loadbalancers", None).await.0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn metrics_count_requests_and_load_balancers_by_state() {
    let app = TestApp::start("127.77.0.112/28", Duration::ZERO).await;
    let (_, created) = app
        .call(Method::POST, "/v1/loadbalancers", Some(spec("a")))
        .await;
    wait_for_state(&app, created["id"].as_str().unwrap(), "active").await;
    let mut text = String::new();
    for _ in 0..100 {
        let (_, _, body) = app
            .send(Request::get("/metrics").body(Body::empty()).unwrap())
            .await;
        text = body.as_str().unwrap().to_owned();
        if text.contains(r#"cloud_mock_load_balancers{state="active"} 1"#) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        text.contains(r#"cloud_mock_http_requests_total{route="/v1/loadbalancers",method="POST",status="201"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"cloud_mock_load_balancers{state="active"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn openapi_document_and_routes_match() {
    let documented = openapi::operations(OPENAPI_YAML);
    assert!(documented.len() >= 10, "parsed {documented:?}");
    let routed: std::collections::BTreeSet<(String, String)> = routes()
        .iter()
        .map(|route| (route.path.to_owned(), route.verb.method().to_string()))
        .collect();
    assert_eq!(
        documented, routed,
        "openapi.yaml and the route table differ"
    );

    // Every documented operation is really routed: neither the no-route fallback nor 405.
    let app = TestApp::start("127.77.0.128/28", Duration::ZERO).await;
    for (path, method) in &documented {
        let uri = path
            .replace("{id}", "lb-00000000")
            .replace("{name}", "some-pool");
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let body = matches!(method, Method::POST | Method::PUT).then(|| json!({}));
        let (status, response) = app.call(method.clone(), &uri, body).await;
        assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert_ne!(error_code(&response), "no-route", "{method} {path}");
    }

    let (status, headers, body) = app
        .send(Request::get("/openapi.yaml").body(Body::empty()).unwrap())
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[header::CONTENT_TYPE], "application/yaml");
    assert_eq!(body.as_str(), Some(OPENAPI_YAML));
}

fn on_pool(name: &str, node_pool: &str) -> Value {
    let mut body = spec(name);
    body["backends"] = json!([]);
    body["nodePool"] = json!(node_pool);
    body
}

fn health_ips(lb: &Value) -> Vec<String> {
    lb["health"]
        .as_array()
        .unwrap()
        .iter()
        .map(|status| status["ip"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn node_pools_round_trip_and_their_load_balancers_follow_them() {
    let app = TestApp::start("127.77.0.144/28", Duration::ZERO).await;
    let members = json!({"tags": {"cluster": "c1"},
        "backends": [{"ip": "198.18.0.12"}, {"ip": "198.18.0.11"}, {"ip": "2001:db8:18::11"}]});
    let (status, headers, created) = app
        .send(request(
            Method::PUT,
            "/v1/nodepools/c1-nodes",
            Some(members.clone()),
            &[],
        ))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(headers[header::ETAG], "\"1\"");
    assert_eq!(created["name"], "c1-nodes");
    assert_eq!(created["version"], 1);
    assert_eq!(created["loadBalancers"], json!([]));
    assert_eq!(
        created["backends"][0]["ip"], "198.18.0.11",
        "kept as a set, in order"
    );
    // The same content again: 200, same version, nothing committed.
    let (status, same) = app
        .call(Method::PUT, "/v1/nodepools/c1-nodes", Some(members.clone()))
        .await;
    assert_eq!(
        (status, same["version"].clone()),
        (StatusCode::OK, json!(1))
    );

    // Load balancers name it instead of carrying backends, and must name one that exists.
    let mut both = on_pool("both", "c1-nodes");
    both["backends"] = json!([{"ip": "198.18.0.11"}]);
    let (status, body) = create(&app, both).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(error_code(&body), "backends-and-node-pool");
    let (status, body) = create(&app, on_pool("lost", "no-such-pool")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(error_code(&body), "node-pool-not-found");
    let (status, lb) = create(&app, on_pool("web", "c1-nodes")).await;
    assert_eq!(status, StatusCode::CREATED, "{lb}");
    let id = lb["id"].as_str().unwrap().to_owned();
    assert_eq!(lb["nodePool"], "c1-nodes");
    assert_eq!(lb["backends"], json!([]));
    assert_eq!(
        health_ips(&lb),
        ["198.18.0.11", "198.18.0.12"],
        "the IPv4 members of the pool, for an IPv4 load balancer"
    );
    let (_, plain) = create(&app, spec("plain")).await;
    assert!(plain.get("nodePool").is_none(), "absent when not given");

    // One pool write moves every referencing load balancer.
    let moved = json!({"tags": {"cluster": "c1"}, "backends": [{"ip": "198.18.0.13"}]});
    let (status, _, body) = app
        .send(request(
            Method::PUT,
            "/v1/nodepools/c1-nodes",
            Some(moved.clone()),
            &[("If-Match", "7")],
        ))
        .await;
    assert_eq!(status, StatusCode::PRECONDITION_FAILED);
    assert_eq!(error_code(&body), "version-mismatch");
    let (status, _, replaced) = app
        .send(request(
            Method::PUT,
            "/v1/nodepools/c1-nodes",
            Some(moved),
            &[("If-Match", "\"1\"")],
        ))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(replaced["version"], 2);
    assert_eq!(replaced["loadBalancers"], json!([id]));
    let lb = wait_for_state(&app, &id, "active").await;
    assert_eq!(health_ips(&lb), ["198.18.0.13"]);
    assert_eq!(lb["version"], 1, "the load balancer itself did not change");

    // Get and list, with the load-balancer list's filters.
    let (status, got) = app.call(Method::GET, "/v1/nodepools/c1-nodes", None).await;
    assert_eq!((status, got["version"].clone()), (StatusCode::OK, json!(2)));
    app.call(
        Method::PUT,
        "/v1/nodepools/c2-nodes",
        Some(json!({"tags": {"cluster": "c2"}})),
    )
    .await;
    let names = |list: &Value| -> Vec<String> {
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|pool| pool["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let (_, all) = app.call(Method::GET, "/v1/nodepools", None).await;
    assert_eq!(names(&all), ["c1-nodes", "c2-nodes"]);
    let (_, c2) = app
        .call(Method::GET, "/v1/nodepools?tag=cluster=c2", None)
        .await;
    assert_eq!(names(&c2), ["c2-nodes"]);
    let (_, named) = app
        .call(Method::GET, "/v1/nodepools?name=c1-nodes", None)
        .await;
    assert_eq!(names(&named), ["c1-nodes"]);
    let (status, body) = app.call(Method::GET, "/v1/nodepools?tag=nope", None).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::BAD_REQUEST, "invalid-query")
    );

    // Refused specs name the field.
    let (status, body) = app
        .call(Method::PUT, "/v1/nodepools/Bad_Name", Some(json!({})))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(error_message(&body).starts_with("name:"), "{body}");
    let (status, body) = app
        .call(
            Method::PUT,
            "/v1/nodepools/dup",
            Some(json!({"backends": [{"ip": "10.0.0.1"}, {"ip": "10.0.0.1"}]})),
        )
        .await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::UNPROCESSABLE_ENTITY, "invalid")
    );

    // In use until the load balancer is gone (being deleted still holds it).
    let (status, body) = app
        .call(Method::DELETE, "/v1/nodepools/c1-nodes", None)
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(error_code(&body), "node-pool-in-use");
    assert!(error_message(&body).contains(&id), "{body}");
    app.call(Method::DELETE, &format!("/v1/loadbalancers/{id}"), None)
        .await;
    let mut deleted = StatusCode::CONFLICT;
    for _ in 0..100 {
        deleted = app
            .call(Method::DELETE, "/v1/nodepools/c1-nodes", None)
            .await
            .0;
        if deleted != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(deleted, StatusCode::NO_CONTENT);
    let (status, body) = app
        .call(Method::DELETE, "/v1/nodepools/c1-nodes", None)
        .await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::NOT_FOUND, "not-found")
    );
    let (status, _) = app.call(Method::GET, "/v1/nodepools/c1-nodes", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (_, _, metrics) = app
        .send(Request::get("/metrics").body(Body::empty()).unwrap())
        .await;
    let text = metrics.as_str().unwrap();
    for line in [
        r#"cloud_mock_node_pool_writes_total{outcome="created"} 2"#,
        r#"cloud_mock_node_pool_writes_total{outcome="unchanged"} 1"#,
        r#"cloud_mock_node_pool_writes_total{outcome="replaced"} 1"#,
        r#"cloud_mock_node_pool_writes_total{outcome="deleted"} 1"#,
    ] {
        assert!(text.contains(line), "{line} in {text}");
    }
}

#[tokio::test]
async fn node_pool_routes_take_the_injected_faults_and_a_lost_answer_is_retried_into_one_write() {
    let app = TestApp::start("127.77.0.160/28", Duration::ZERO).await;
    let members = json!({"backends": [{"ip": "198.18.0.11"}]});
    app.call(
        Method::PUT,
        "/v1/admin/faults",
        Some(json!({"errorRate": 1.0})),
    )
    .await;
    for (method, uri) in [
        (Method::GET, "/v1/nodepools"),
        (Method::GET, "/v1/nodepools/p"),
        (Method::PUT, "/v1/nodepools/p"),
        (Method::DELETE, "/v1/nodepools/p"),
    ] {
        let body = (method == Method::PUT).then(|| members.clone());
        let (status, _) = app.call(method.clone(), uri, body).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{method} {uri}");
    }
    app.call(
        Method::PUT,
        "/v1/admin/faults",
        Some(json!({"rateLimitPerSecond": 1})),
    )
    .await;
    app.call(Method::GET, "/v1/nodepools", None).await;
    let (status, body) = app.call(Method::GET, "/v1/nodepools", None).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::TOO_MANY_REQUESTS, "rate-limited")
    );
    let unauthorized = Request::get("/v1/nodepools").body(Body::empty()).unwrap();
    assert_eq!(app.send(unauthorized).await.0, StatusCode::UNAUTHORIZED);

    // Every committed answer is lost: the write happened all the same, and the retry
    // (its content the pool's now) is answered, unchanged, however stale its If-Match.
    app.call(
        Method::PUT,
        "/v1/admin/faults",
        Some(json!({"lostAnswerRate": 1.0})),
    )
    .await;
    let (status, _) = app
        .call(Method::PUT, "/v1/nodepools/p", Some(members.clone()))
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, _, retried) = app
        .send(request(
            Method::PUT,
            "/v1/nodepools/p",
            Some(members.clone()),
            &[],
        ))
        .await;
    assert_eq!(
        (status, retried["version"].clone()),
        (StatusCode::OK, json!(1))
    );
    let changed = json!({"backends": [{"ip": "198.18.0.12"}]});
    let (status, _, _) = app
        .send(request(
            Method::PUT,
            "/v1/nodepools/p",
            Some(changed.clone()),
            &[("If-Match", "1")],
        ))
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, _, retried) = app
        .send(request(
            Method::PUT,
            "/v1/nodepools/p",
            Some(changed),
            &[("If-Match", "1")],
        ))
        .await;
    assert_eq!(
        (status, retried["version"].clone()),
        (StatusCode::OK, json!(2))
    );
    // A lost delete: the retry finds it gone.
    let (status, _) = app.call(Method::DELETE, "/v1/nodepools/p", None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    app.call(Method::PUT, "/v1/admin/faults", Some(json!({})))
        .await;
    let (status, _) = app.call(Method::DELETE, "/v1/nodepools/p", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_held_read_answers_when_provisioning_ends() {
    let delay = Duration::from_millis(400);
    let app = TestApp::start("127.77.0.0/24", delay).await;
    // Provisioning starts while the create is answered, so its delay is timed from before.
    let created_at = std::time::Instant::now();
    let (status, created) = create(&app, spec("held")).await;
    assert_eq!(status, StatusCode::CREATED);
    let id = created["id"].as_str().unwrap();
    let uri = format!("/v1/loadbalancers/{id}");

    // A plain read answers at once, still provisioning.
    let (status, plain) = app.call(Method::GET, &uri, None).await;
    assert_eq!(
        (status, plain["state"].as_str()),
        (StatusCode::OK, Some("provisioning"))
    );

    // A read held for less than what is left answers at its end, still provisioning.
    let started = std::time::Instant::now();
    let (_, short) = app
        .call(Method::GET, &format!("{uri}?waitMs=50"), None)
        .await;
    assert_eq!(short["state"], "provisioning");
    assert!(started.elapsed() >= Duration::from_millis(50));

    // A held read answers once the LB is active: after the delay, long before its wait.
    let (status, held) = app
        .call(Method::GET, &format!("{uri}?waitMs=20000"), None)
        .await;
    let elapsed = created_at.elapsed();
    assert_eq!(
        (status, held["state"].as_str()),
        (StatusCode::OK, Some("active"))
    );
    // The store keeps its times in whole milliseconds of the wall clock.
    assert!(
        elapsed + Duration::from_millis(2) >= delay,
        "answered {elapsed:?} after the create, before provisioning ended"
    );
    assert!(
        elapsed < Duration::from_secs(5),
        "held {elapsed:?}: the activation did not wake it"
    );

    // An active LB is answered at once whatever the wait.
    let again = std::time::Instant::now();
    let (_, active) = app
        .call(Method::GET, &format!("{uri}?waitMs=20000"), None)
        .await;
    assert_eq!(active["state"], "active");
    assert!(again.elapsed() < Duration::from_secs(1));

    for junk in ["waitMs=30001", "waitMs=-1", "waitMs=soon", "wait=5s"] {
        let (status, body) = app.call(Method::GET, &format!("{uri}?{junk}"), None).await;
        assert_eq!(
            (status, error_code(&body)),
            (StatusCode::BAD_REQUEST, "invalid-query"),
            "{junk}: {body}"
        );
    }
}

#[tokio::test]
async fn without_fault_injection_there_is_no_fault_api_and_no_fault_applies() {
    let app = TestApp::start_with("127.77.90.0/24", Duration::ZERO, false).await;
    for method in [Method::GET, Method::PUT] {
        let (status, body) = app
            .call(
                method.clone(),
                "/v1/admin/faults",
                Some(json!({"errorRate": 1.0})),
            )
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{method}: {body}");
        assert_eq!(error_code(&body), "no-route", "{method}: {body}");
    }
    let (status, _) = app.call(Method::GET, "/v1/loadbalancers", None).await;
    assert_eq!(status, StatusCode::OK);
}
