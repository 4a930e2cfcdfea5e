//! The provider conformance kit against the mock-cloud provider on a real cloud-mock (in
//! process, API only) and against the fake.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// Shared with e2e.rs, which uses the rest of it.
#[allow(dead_code)]
mod support;

use std::time::Duration;

use tandem_controller::conformance::{self, Kit};
use tandem_controller::fake::FakeProvider;
use tandem_controller::metrics::CloudMetrics;
use tandem_controller::mockcloud::PROFILE;
use tandem_controller::provider::LoadBalancerPhase;
use tandem_controller::ratelimit::SharedTokenBucket;
use tandem_controller::registry::{self, Shared};

fn kit() -> Kit {
    Kit::new("conformance".parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_cloud_provider_conforms() {
    let dir = support::TempDir::new("conformance");
    let cloud = support::Cloud::start(dir.path(), support::POOL).await;
    let token = dir.path().join("token");
    std::fs::write(&token, &cloud.token).unwrap();
    let config = format!(
        r#"{{"url": "{}", "tokenFile": "{}"}}"#,
        cloud.url,
        token.display()
    );
    // Built as the controller builds it: by name, from its configuration.
    let provider = registry::build(
        PROFILE.name,
        Some(&config),
        Shared {
            bucket: SharedTokenBucket::new(50.0, 50),
            metrics: CloudMetrics::default(),
            timeout: Duration::from_secs(5),
        },
    )
    .unwrap();
    conformance::run(&provider, &kit()).await.unwrap();
    cloud.stop().await;
}

#[tokio::test]
async fn the_fake_conforms() {
    let fake = FakeProvider::new(false);
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
    conformance::run(&fake, &kit()).await.unwrap();
    finish.abort();
}
