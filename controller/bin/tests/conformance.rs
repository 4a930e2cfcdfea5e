//! The provider conformance kit against the providers this binary registers, built from
//! their registrations as the binary builds them: the mock cloud's on a real cloud-mock (in
//! process, API only; over HTTP and over HTTPS with a CA from its configuration; its rate
//! limit and lost answers through the cloud's fault injection), and on the shared edge of
//! `TANDEM_E2E_CLOUD_URL` when one is given (without faults: they would be the whole
//! edge's). The library's tests run it against the fake.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// Shared with e2e.rs, which uses the rest of it.
#[allow(dead_code)]
mod support;

use std::time::Duration;

use cloud_mock_sdk as sdk;
use tandem_controller::conformance::{self, CloudFaults, Kit};
use tandem_controller::metrics::CloudMetrics;
use tandem_controller::ratelimit::SharedTokenBucket;
use tandem_controller::registry::{DynProvider, Shared};

fn kit() -> Kit {
    Kit::new("conformance".parse().unwrap())
}

/// The mock cloud misbehaves through its own fault injection.
struct MockCloudFaults<'a>(&'a support::Cloud);

impl CloudFaults for MockCloudFaults<'_> {
    async fn throttle(&self) {
        self.0
            .set_faults(sdk::Faults {
                rate_limit_per_second: Some(1),
                ..sdk::Faults::default()
            })
            .await;
    }

    async fn lose_answers(&self) {
        self.0
            .set_faults(sdk::Faults {
                lost_answer_rate: 1.0,
                ..sdk::Faults::default()
            })
            .await;
    }

    async fn heal(&self) {
        self.0.set_faults(sdk::Faults::default()).await;
    }
}

/// The mock-cloud provider built as the controller builds it: from its registration, with a
/// configuration file naming `cloud`'s URL, its token and, over HTTPS, its CA.
fn mock_cloud_provider(cloud: &support::Cloud, dir: &std::path::Path) -> DynProvider {
    let config = std::fs::read_to_string(cloud.write_config(dir)).unwrap();
    provider_of(&config)
}

fn provider_of(config: &str) -> DynProvider {
    let shared = Shared {
        bucket: SharedTokenBucket::new(50.0, 50),
        metrics: CloudMetrics::default(),
        timeout: Duration::from_secs(5),
    };
    tandem_provider_mockcloud::REGISTRATION
        .provider(Some(config), shared)
        .unwrap()
}

/// Runs the kit, faults included, against the mock-cloud provider on `cloud`.
async fn mock_cloud_provider_conforms(cloud: support::Cloud, dir: &std::path::Path) {
    let provider = mock_cloud_provider(&cloud, dir);
    conformance::run_with_faults(&provider, &kit(), &MockCloudFaults(&cloud))
        .await
        .unwrap();
    cloud.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_cloud_provider_conforms() {
    let dir = support::TempDir::new("conformance");
    let cloud = support::Cloud::start(&dir.path().join("cloud"), support::POOL, false).await;
    mock_cloud_provider_conforms(cloud, dir.path()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_cloud_provider_conforms_over_tls() {
    let dir = support::TempDir::new("conformance-tls");
    let cloud = support::Cloud::start(&dir.path().join("cloud"), support::POOL, true).await;
    assert!(cloud.url.starts_with("https://"), "{}", cloud.url);
    mock_cloud_provider_conforms(cloud, dir.path()).await;
}

/// An edge cluster whose first edge is down (a port with nothing listening): every call
/// goes to the next edge, and the provider conforms as on one edge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_cloud_provider_conforms_with_its_first_edge_down() {
    let dir = support::TempDir::new("conformance-failover");
    let cloud = support::Cloud::start(&dir.path().join("cloud"), support::POOL, false).await;
    let down = support::free_port();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cloud.write_config(dir.path())).unwrap())
            .unwrap();
    let live = config["url"].take();
    config["urls"] = serde_json::json!([format!("http://{down}"), live]);
    config.as_object_mut().unwrap().remove("url");
    let provider = provider_of(&config.to_string());
    let outcome = conformance::run(&provider, &kit()).await;
    cloud.stop().await;
    outcome.unwrap();
}

/// The kit against an edge this suite did not start (CI: cloud-mock with HAProxy as its
/// data plane), as a cluster of its own there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_cloud_conforms() {
    let Some(shared) = support::shared_cloud() else {
        eprintln!(
            "skipped: {} names no shared cloud edge",
            support::SHARED_CLOUD_URL_ENV
        );
        return;
    };
    let dir = support::TempDir::new("conformance-shared");
    let kit = Kit::new(
        format!("conformance-{}", std::process::id())
            .parse()
            .unwrap(),
    );
    let cloud = support::Cloud::shared(shared, kit.cluster_id.as_str());
    let provider = mock_cloud_provider(&cloud, dir.path());
    let outcome = conformance::run(&provider, &kit).await;
    cloud.stop().await;
    outcome.unwrap();
}
