//! The provider conformance kit against the mock-cloud provider on a real cloud-mock (in
//! process, API only; over HTTP and over HTTPS with a CA from its configuration; its rate
//! limit and lost answers through the cloud's fault injection), on the shared edge of
//! `TANDEM_E2E_CLOUD_URL` when one is given (without faults: they would be the whole
//! edge's), and against the fake (its switches).
#![allow(clippy::unwrap_used, clippy::expect_used)]

// Shared with e2e.rs, which uses the rest of it.
#[allow(dead_code)]
mod support;

use std::time::Duration;

use cloud_mock_sdk as sdk;
use tandem_controller::conformance::{self, CloudFaults, Kit};
use tandem_controller::fake::FakeProvider;
use tandem_controller::metrics::CloudMetrics;
use tandem_controller::mockcloud::PROFILE;
use tandem_controller::provider::LoadBalancerPhase;
use tandem_controller::ratelimit::SharedTokenBucket;
use tandem_controller::registry::{self, Shared};

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

/// The fake misbehaves by its switches.
struct FakeFaults<'a>(&'a FakeProvider);

impl CloudFaults for FakeFaults<'_> {
    async fn throttle(&self) {
        self.0.set_throttled(true);
    }

    async fn lose_answers(&self) {
        self.0.set_lose_create_answers(true);
    }

    async fn heal(&self) {
        self.0.set_throttled(false);
        self.0.set_lose_create_answers(false);
    }
}

/// The mock-cloud provider built as the controller builds it: by name, from a configuration
/// file naming `cloud`'s URL, its token and, over HTTPS, its CA.
fn mock_cloud_provider(cloud: &support::Cloud, dir: &std::path::Path) -> registry::DynProvider {
    let config = std::fs::read_to_string(cloud.write_config(dir)).unwrap();
    registry::build(
        PROFILE.name,
        Some(&config),
        Shared {
            bucket: SharedTokenBucket::new(50.0, 50),
            metrics: CloudMetrics::default(),
            timeout: Duration::from_secs(5),
        },
    )
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

/// The fake conforms whether the cloud chooses the LB's ids or takes the planned ones.
#[tokio::test]
async fn the_fake_conforms() {
    for client_ids in [false, true] {
        fake_conforms(client_ids).await;
    }
}

async fn fake_conforms(client_ids: bool) {
    let fake = FakeProvider::new(false);
    fake.set_client_ids(client_ids);
    fake.set_delete_async(true);
    // A pool without addresses of any family: the fake's way of refusing a pool.
    fake.set_pool_families(&kit().refused_pool, &[]);
    let finish = {
        let fake = fake.clone();
        tokio::spawn(async move {
            // The fake's cloud makes LBs active and finishes deletes now and then.
            loop {
                tokio::time::sleep(Duration::from_millis(300)).await;
                fake.finish_deletes();
                for mut lb in fake.load_balancers() {
                    if lb.phase == LoadBalancerPhase::Provisioning {
                        lb.phase = LoadBalancerPhase::Active;
                        fake.insert(lb);
                    }
                }
            }
        })
    };
    conformance::run_with_faults(&fake, &kit(), &FakeFaults(&fake))
        .await
        .unwrap();
    finish.abort();
}
