#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The provider, built as the controller builds it, against a real edge on 127.0.0.1: a
//! token Secret that the kubelet updates (a `..data` symlink swapped to a new directory)
//! is sent without a restart, within a second of the change, and at once when the edge
//! refused the token before.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use cloud_mock_sdk::{Client, ClientOptions, Error};
use prometheus_client::registry::Registry;
use tandem_controller::metrics::Metrics;
use tandem_controller::provider::{LoadBalancerProvider, ProviderError};
use tandem_controller::ratelimit::SharedTokenBucket;
use tandem_controller::registry::{DynProvider, Shared};
use tandem_provider_mockcloud::{LOOK_INTERVAL, REGISTRATION};
use tokio_util::sync::CancellationToken;

const REFUSED_CALLS: &str =
    r#"tandem_controller_cloud_calls_total{operation="get_node_pool",outcome="unauthorized"}"#;

/// A directory with the edge's token file (`edge/tokens`) and the controller's mounted
/// Secret (`secret/token`); an edge serving the former. Stopped and removed on drop.
struct Setup {
    dir: PathBuf,
    url: String,
    cancel: CancellationToken,
    generation: u32,
    registry: Registry,
    metrics: Metrics,
}

impl Setup {
    async fn start(edge_tokens: &str, secret_token: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tdm-token-rotation-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("edge")).unwrap();
        std::fs::create_dir_all(dir.join("secret")).unwrap();
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let mut setup = Self {
            url: String::new(),
            dir,
            cancel: CancellationToken::new(),
            generation: 0,
            registry,
            metrics,
        };
        setup.edge_tokens(edge_tokens);
        setup.rotate_secret(secret_token);
        setup.url = cloud_mock::test_edge::serve(
            &setup.dir.join("edge"),
            "--token-file",
            &setup.dir.join("edge/tokens"),
            setup.cancel.clone(),
        )
        .await;
        setup
    }

    /// The provider, from a configuration naming the edge and the Secret's `token`.
    fn provider(&self) -> DynProvider {
        let config = serde_json::json!({
            "url": self.url,
            "tokenFile": self.dir.join("secret/token"),
        });
        let shared = Shared {
            bucket: SharedTokenBucket::new(50.0, 50),
            metrics: self.metrics.cloud.clone(),
            timeout: Duration::from_secs(5),
        };
        REGISTRATION
            .provider(Some(&config.to_string()), shared)
            .unwrap()
    }

    /// Replaces the edge's token file by a rename.
    fn edge_tokens(&self, text: &str) {
        let next = self.dir.join("edge/tokens.next");
        std::fs::write(&next, text).unwrap();
        std::fs::rename(&next, self.dir.join("edge/tokens")).unwrap();
    }

    /// Updates the Secret as the kubelet does: its data in a new directory, then the
    /// `..data` symlink, which `token` goes through, swapped to it by a rename.
    fn rotate_secret(&mut self, token: &str) {
        self.generation += 1;
        let secret = self.dir.join("secret");
        let data = format!("..{}", self.generation);
        std::fs::create_dir_all(secret.join(&data)).unwrap();
        std::fs::write(secret.join(&data).join("token"), token).unwrap();
        std::os::unix::fs::symlink(&data, secret.join("..data_tmp")).unwrap();
        std::fs::rename(secret.join("..data_tmp"), secret.join("..data")).unwrap();
        let link = secret.join("token");
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink("..data/token", link).unwrap();
        }
    }

    /// Waits until the edge lets `token` in, or no longer does.
    async fn edge_until(&self, token: &str, accepted: bool) -> Duration {
        let client = Client::new(
            &self.url,
            token,
            ClientOptions {
                max_retries: 0,
                ..ClientOptions::default()
            },
        )
        .unwrap();
        let started = Instant::now();
        loop {
            match client.list_pools().await {
                Ok(_) if accepted => return started.elapsed(),
                Err(Error::Unauthorized) if !accepted => return started.elapsed(),
                Ok(_) | Err(Error::Unauthorized) => {}
                Err(other) => panic!("{other}"),
            }
            assert!(started.elapsed() < Duration::from_secs(5), "edge: {token}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The provider's calls the edge refused, by the controller's own count.
    fn refused_calls(&self) -> u64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text.lines()
            .find_map(|line| line.strip_prefix(REFUSED_CALLS)?.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.cancel.cancel();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A call that needs the token: the node pool `absent`, which there is not.
async fn call(provider: &DynProvider) -> Result<(), ProviderError> {
    provider.get_node_pool("absent").await.map(|pool| {
        assert!(pool.is_none());
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_secret_is_sent_without_a_restart() {
    let mut setup = Setup::start("token-a\n", "token-a\n").await;
    let provider = setup.provider();
    call(&provider).await.unwrap();

    // The rotation as documented: the edge takes both, the Secret changes, the edge drops
    // the old token once the controller has had a look.
    setup.edge_tokens("token-a\ntoken-b\n");
    let edge_added = setup.edge_until("token-b", true).await;
    setup.rotate_secret("token-b\n");
    tokio::time::sleep(LOOK_INTERVAL + Duration::from_millis(100)).await;
    call(&provider).await.unwrap();
    setup.edge_tokens("token-b\n");
    let edge_removed = setup.edge_until("token-a", false).await;
    let refused = setup.refused_calls();
    call(&provider).await.unwrap();
    assert_eq!(
        setup.refused_calls(),
        refused,
        "the first call after the look carried the new token"
    );
    eprintln!("edge: token-b in after {edge_added:?}, token-a out after {edge_removed:?}");

    // The other order: the edge refuses the token first. A call fails (the Secret has no
    // other token), and once the Secret changes the next call is let in at once, through
    // one refused attempt and a read of the file.
    setup.edge_tokens("token-c\n");
    setup.edge_until("token-b", false).await;
    let refused = setup.refused_calls();
    assert!(matches!(
        call(&provider).await,
        Err(ProviderError::Unauthorized { .. })
    ));
    assert_eq!(
        setup.refused_calls(),
        refused + 1,
        "no retry without a new token"
    );
    setup.rotate_secret("token-c\n");
    let started = Instant::now();
    call(&provider).await.unwrap();
    let took = started.elapsed();
    assert!(
        took < LOOK_INTERVAL,
        "{took:?}: not the look of the next second"
    );
    assert_eq!(
        setup.refused_calls(),
        refused + 2,
        "one refused, one retried"
    );
    eprintln!("a refused call retried with the new Secret in {took:?}");
}
