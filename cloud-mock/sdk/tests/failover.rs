//! A client of several edges: a call that cannot connect to one edge goes to the next, and
//! stays there; with every edge down the error names each. The edges are loopback
//! listeners that answer every request with one canned JSON body, and ports with nothing
//! listening on 127.0.0.1.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cloud_mock_sdk::{Client, ClientOptions, Error, families};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

/// A load balancer as the API answers a create.
const LOAD_BALANCER: &str = r#"{"id": "lb-1", "name": "web", "mode": "proxy", "ipFamilies": ["IPv4"],
  "listeners": [], "backends": [], "state": "provisioning", "version": 1}"#;

/// An edge that answers every request with `body`, and counts the requests and those that
/// carried an `Idempotency-Key`.
struct Edge {
    url: String,
    requests: Arc<AtomicUsize>,
    with_key: Arc<AtomicUsize>,
}

impl Edge {
    async fn start(body: &'static str) -> Self {
        Self::on(TcpListener::bind("127.0.0.1:0").await.unwrap(), body)
    }

    fn on(listener: TcpListener, body: &'static str) -> Self {
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(AtomicUsize::new(0));
        let with_key = Arc::new(AtomicUsize::new(0));
        let (counted, keyed) = (requests.clone(), with_key.clone());
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let (counted, keyed) = (counted.clone(), keyed.clone());
                tokio::spawn(async move {
                    let mut stream = BufReader::new(stream);
                    // One request per connection: its head, then its body.
                    let mut length = 0;
                    loop {
                        let mut line = String::new();
                        if stream.read_line(&mut line).await.unwrap() == 0 {
                            return;
                        }
                        let lower = line.to_ascii_lowercase();
                        if let Some(value) = lower.strip_prefix("content-length:") {
                            length = value.trim().parse().unwrap();
                        }
                        if lower.starts_with("idempotency-key:") {
                            keyed.fetch_add(1, Ordering::SeqCst);
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut request_body = vec![0; length];
                    stream.read_exact(&mut request_body).await.unwrap();
                    counted.fetch_add(1, Ordering::SeqCst);
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    stream.write_all(answer.as_bytes()).await.unwrap();
                });
            }
        });
        Self {
            url,
            requests,
            with_key,
        }
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

/// A port on 127.0.0.1 with nothing listening: a connection to it is refused.
async fn closed_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap()
}

fn options() -> ClientOptions {
    ClientOptions {
        timeout: Duration::from_secs(5),
        max_retries: 0,
        ..ClientOptions::default()
    }
}

fn spec() -> families::LoadBalancerSpec {
    serde_json::from_str(r#"{"name": "web", "mode": "proxy", "listeners": [], "backends": []}"#)
        .unwrap()
}

#[tokio::test]
async fn a_call_an_edge_refuses_goes_to_the_next_and_stays_there() {
    let down = closed_port().await;
    let live = Edge::start(LOAD_BALANCER).await;
    let down_url = format!("http://{down}");
    let client = Client::with_edges(&[&down_url, &live.url], "t", options()).unwrap();

    // A create (POST) with its Idempotency-Key: nothing reached the first edge, so the
    // second gets it, once, without a retry (max_retries is 0).
    let lb = client
        .families()
        .create_load_balancer(&spec(), "key-1")
        .await
        .unwrap();
    assert_eq!(lb.id, "lb-1");
    assert_eq!(live.requests(), 1);
    assert_eq!(live.with_key.load(Ordering::SeqCst), 1);

    // The first edge is back, but calls stay on the one that answered.
    let back = Edge::on(TcpListener::bind(down).await.unwrap(), LOAD_BALANCER);
    client.families().get_load_balancer("lb-1").await.unwrap();
    assert_eq!((back.requests(), live.requests()), (0, 2));
}

#[tokio::test]
async fn with_every_edge_down_the_error_names_each() {
    let (first, second) = (closed_port().await, closed_port().await);
    let urls = [format!("http://{first}"), format!("http://{second}")];
    let client = Client::with_edges(&[&urls[0], &urls[1]], "t", options()).unwrap();
    let error = client.list_pools().await.unwrap_err();
    let Error::Unreachable(failures) = &error else {
        panic!("not unreachable: {error:?}");
    };
    let edges: Vec<&str> = failures.iter().map(|f| f.edge.as_str()).collect();
    assert_eq!(edges, [format!("{}/", urls[0]), format!("{}/", urls[1])]);
    let message = error.to_string();
    assert!(
        message.starts_with("no cloud edge could be reached: "),
        "{message}"
    );
    for url in &urls {
        assert!(message.contains(url.as_str()), "{message}");
    }
    assert!(message.to_lowercase().contains("refused"), "{message}");
    assert!(error.is_retryable(), "the edges may come back");

    // One edge down is a transport error, as it always was.
    let one = Client::new(&urls[0], "t", options()).unwrap();
    assert!(matches!(
        one.list_pools().await,
        Err(Error::Transport(error)) if error.is_connect()
    ));
}

#[test]
fn a_client_needs_an_edge_and_each_must_be_a_url() {
    assert!(matches!(
        Client::with_edges(&[], "t", options()),
        Err(Error::Invalid { .. })
    ));
    assert!(Client::with_edges(&["http://127.0.0.1:1", "ftp://x"], "t", options()).is_err());
}
