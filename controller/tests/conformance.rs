//! The provider conformance kit against the fake (its switches for the faults). The mock
//! cloud's provider runs it where the binary registers it (controller/bin/tests).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tandem_controller::conformance::{self, CloudFaults, Kit};
use tandem_controller::fake::FakeProvider;
use tandem_controller::provider::LoadBalancerPhase;

fn kit() -> Kit {
    Kit::new("conformance".parse().unwrap())
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
