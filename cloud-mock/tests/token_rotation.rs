#![allow(clippy::unwrap_used, clippy::expect_used)]
//! A token rotation through `--token-file`, on an edge that keeps running: the new token
//! is accepted beside the old one, then alone; a file emptied or removed meanwhile keeps
//! the tokens read last. Each step must take effect within [`WITHIN`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cloud_mock::test_edge;
use cloud_mock_sdk::{Client, ClientOptions, Error};
use tokio_util::sync::CancellationToken;

/// `printf %s token-b | sha256sum`
const TOKEN_B_SHA256: &str = "49e2bb7eab54cf09b409ffafd3fa8a8a955a60eb972faacaefbed3dbd3207132";

/// The edge reads the file every second and takes a change that held for 100 ms.
const WITHIN: Duration = Duration::from_secs(3);

/// An edge on 127.0.0.1 serving the tokens of `tokens`; stopped, and its directory
/// removed, on drop.
struct Edge {
    url: String,
    tokens: PathBuf,
    dir: PathBuf,
    cancel: CancellationToken,
}

impl Edge {
    async fn start(label: &str, tokens: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "cloud-mock-{label}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let token_file = dir.join("tokens");
        std::fs::write(&token_file, tokens).unwrap();
        let cancel = CancellationToken::new();
        let url = test_edge::serve(
            &dir.join("data"),
            "--token-file",
            &token_file,
            cancel.clone(),
        )
        .await;
        Self {
            url,
            tokens: token_file,
            dir,
            cancel,
        }
    }

    fn client(&self, token: &str) -> Client {
        let options = ClientOptions {
            timeout: Duration::from_secs(2),
            max_retries: 0,
            ..ClientOptions::default()
        };
        Client::new(&self.url, token, options).unwrap()
    }

    /// Whether a call with `token` is let in (any other failure fails the test).
    async fn accepts(&self, token: &str) -> bool {
        match self.client(token).list_pools().await {
            Ok(_) => true,
            Err(Error::Unauthorized) => false,
            Err(other) => panic!("{other}"),
        }
    }

    /// How long until `token` is let in (`accepted`) or refused; fails after [`WITHIN`].
    async fn until(&self, token: &str, accepted: bool) -> Duration {
        let started = Instant::now();
        while self.accepts(token).await != accepted {
            assert!(
                started.elapsed() < WITHIN,
                "{token} still {} after {WITHIN:?}",
                if accepted { "refused" } else { "accepted" }
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        started.elapsed()
    }

    /// The value of one series of the edge's `/metrics`, 0 when it is not there yet.
    async fn metric(&self, series: &str) -> u64 {
        tandem_common::install_crypto_provider();
        let text = reqwest::get(format!("{}/metrics", self.url))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Edge {
    fn drop(&mut self) {
        self.cancel.cancel();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Replaces `path` by a rename, as `mv` and a Secret volume do: another inode.
fn replace(path: &Path, text: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_rotates_through_the_file_without_a_restart() {
    let edge = Edge::start("rotation", "token-a\n").await;
    assert!(edge.accepts("token-a").await);
    assert!(!edge.accepts("token-b").await);

    // Written in place: the same inode, another content.
    std::fs::write(&edge.tokens, "# rotation\ntoken-a\ntoken-b\n").unwrap();
    let added = edge.until("token-b", true).await;
    assert!(
        edge.accepts("token-a").await,
        "both, while the clients roll"
    );

    // Only B's hash is left, and through a rename.
    replace(&edge.tokens, &format!("sha256:{TOKEN_B_SHA256}\n"));
    let removed = edge.until("token-a", false).await;
    assert!(edge.accepts("token-b").await);
    assert_eq!(
        edge.metric(r#"cloud_mock_token_file_reloads_total{outcome="applied"}"#)
            .await,
        2
    );
    eprintln!(
        "token-b accepted {added:?} after it was added; token-a refused {removed:?} after it was removed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emptied_or_removed_file_keeps_the_last_good_tokens() {
    let edge = Edge::start("keep", "token-a\n").await;
    assert!(edge.accepts("token-a").await);
    for (how, outcome) in [("emptied", "empty"), ("removed", "unreadable")] {
        match how {
            "emptied" => std::fs::write(&edge.tokens, "").unwrap(),
            _ => std::fs::remove_file(&edge.tokens).unwrap(),
        }
        let series = format!(r#"cloud_mock_token_file_reloads_total{{outcome="{outcome}"}}"#);
        let started = Instant::now();
        while edge.metric(&series).await == 0 {
            assert!(started.elapsed() < WITHIN, "the {how} file was not seen");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            edge.accepts("token-a").await,
            "{how}: the last good set stays"
        );
        assert_eq!(edge.metric("cloud_mock_tokens").await, 1);
    }
    std::fs::write(&edge.tokens, "token-b\n").unwrap();
    edge.until("token-b", true).await;
    assert!(!edge.accepts("token-a").await);
}
