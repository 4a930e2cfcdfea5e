#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The real `cloud-mock` binary, driven through the SDK: round trip, fault injection
//! (errors, latency, 429 with Retry-After), and persistence across `kill -9` with the
//! data plane forwarding again after the restart.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cloud_mock_sdk::{
    AddressRequest, Backend, BackendHealth, BackendStatus, Client, ClientOptions, Error, Faults,
    HealthCheck, HealthCheckProtocol, ListFilter, Listener, LoadBalancerSpec, LostAnswer, Mode,
    NodePoolSpec, Protocol, State, families,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};

const TOKEN: &str = "server-test-token";

/// A directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(label: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "cloud-mock-{label}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One `cloud-mock` process, SIGKILLed on drop.
struct Server {
    child: Child,
    base_url: String,
}

impl Server {
    async fn start(data_dir: &Path, pool: &str, dataplane: &str) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cloud-mock"))
            .args([
                "--listen",
                "127.0.0.1:0",
                "--token",
                TOKEN,
                "--vip-pool",
                pool,
            ])
            .args([
                "--dataplane",
                dataplane,
                "--provisioning-delay",
                "0ms",
                "--fault-injection",
            ])
            .arg("--data-dir")
            .arg(data_dir)
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info")
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        // Logs go to stderr.
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if let Some((_, rest)) = line.split_once("listening on ") {
                    return rest.split_whitespace().next().unwrap().to_owned();
                }
            }
            panic!("cloud-mock exited before listening");
        })
        .await
        .expect("cloud-mock did not start listening within 30 s");
        // Keep draining the log so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Self {
            child,
            base_url: format!("http://{addr}"),
        }
    }

    fn client(&self, options: ClientOptions) -> Client {
        Client::new(&self.base_url, TOKEN, options).unwrap()
    }

    /// SIGKILL, like `kill -9`: no shutdown path runs.
    async fn kill(&mut self) {
        self.child.start_kill().unwrap();
        self.child.wait().await.unwrap();
    }
}

fn quick_options(max_retries: u32) -> ClientOptions {
    ClientOptions {
        timeout: Duration::from_secs(5),
        max_retries,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(100),
        ..ClientOptions::default()
    }
}

fn spec(name: &str, backend: Ipv4Addr, backend_port: u16) -> LoadBalancerSpec {
    LoadBalancerSpec {
        name: name.into(),
        tags: BTreeMap::from([
            ("cluster".into(), "c1".into()),
            ("service".into(), name.into()),
        ]),
        mode: Mode::Proxy,
        vip: None,
        listeners: vec![Listener {
            protocol: Protocol::Tcp,
            port: 8080,
            backend_port,
            health_check: None,
        }],
        backends: vec![Backend { ip: backend }],
        node_pool: None,
        source_ranges: vec![],
        address: AddressRequest::default(),
    }
}

async fn wait_gone(client: &Client, id: &str) {
    for _ in 0..200 {
        match client.get_load_balancer(id).await {
            Err(Error::NotFound { .. }) => return,
            Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(other) => panic!("unexpected {other}"),
        }
    }
    panic!("{id} was never removed");
}

#[tokio::test]
async fn sdk_round_trip_against_the_real_server() {
    let dir = TempDir::new("sdk");
    let server = Server::start(&dir.0, "127.79.0.0/28", "none").await;
    let client = server.client(quick_options(2));
    let backend = Ipv4Addr::new(198, 18, 0, 11);

    let mut web = spec("web", backend, 30080);
    web.listeners[0].health_check = Some(HealthCheck {
        protocol: HealthCheckProtocol::Http,
        port: 32000,
        path: Some("/healthz".into()),
    });
    let created = client.create_load_balancer(&web, "uid-web").await.unwrap();
    assert_eq!(created.vip(), Some(Ipv4Addr::new(127, 79, 0, 1)));
    assert_eq!(created.version, 1);
    let again = client.create_load_balancer(&web, "uid-web").await.unwrap();
    assert_eq!(
        again.id, created.id,
        "same Idempotency-Key, same load balancer"
    );
    client
        .create_load_balancer(&spec("api", backend, 30081), "uid-api")
        .await
        .unwrap();

    let fetched = client.get_load_balancer(&created.id).await.unwrap();
    assert_eq!(fetched.spec.listeners, web.listeners);
    let filter = ListFilter {
        tags: BTreeMap::from([("service".into(), "web".into())]),
        name: None,
    };
    let listed = client.list_load_balancers(&filter).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, created.id);
    let by_name = ListFilter {
        name: Some("api".into()),
        ..ListFilter::default()
    };
    assert_eq!(
        client.list_load_balancers(&by_name).await.unwrap()[0]
            .spec
            .name,
        "api"
    );
    assert_eq!(
        client
            .list_load_balancers(&ListFilter::default())
            .await
            .unwrap()
            .len(),
        2
    );

    let mut changed = web.clone();
    changed.backends.push(Backend {
        ip: Ipv4Addr::new(198, 18, 0, 12),
    });
    let updated = client
        .update_load_balancer(&created.id, &changed, 1)
        .await
        .unwrap();
    assert_eq!(updated.version, 2);
    assert_eq!(updated.spec.backends.len(), 2);
    assert!(matches!(
        client.update_load_balancer(&created.id, &web, 1).await,
        Err(Error::Conflict { .. })
    ));

    let mut taken = spec("clash", backend, 1);
    taken.vip = created.vip();
    assert!(matches!(
        client.create_load_balancer(&taken, "uid-clash").await,
        Err(Error::Conflict { .. })
    ));
    let mut invalid = spec("bad", backend, 1);
    invalid.listeners[0].port = 0;
    assert!(matches!(
        client.create_load_balancer(&invalid, "uid-bad").await,
        Err(Error::Invalid { .. })
    ));

    let intruder = Client::new(&server.base_url, "wrong", quick_options(2)).unwrap();
    assert!(matches!(
        intruder.get_load_balancer(&created.id).await,
        Err(Error::Unauthorized)
    ));

    client.delete_load_balancer(&created.id).await.unwrap();
    wait_gone(&client, &created.id).await;
    client.delete_load_balancer(&created.id).await.unwrap();
    assert!(matches!(
        client.get_load_balancer("lb-00000000").await,
        Err(Error::NotFound { .. })
    ));
}

#[tokio::test]
async fn sdk_under_injected_faults() {
    let dir = TempDir::new("faults");
    let server = Server::start(&dir.0, "127.79.0.16/28", "none").await;
    let client = server.client(quick_options(10));
    let lb = client
        .create_load_balancer(&spec("f", Ipv4Addr::new(198, 18, 0, 11), 30080), "uid-f")
        .await
        .unwrap();

    // Errors: without retries they surface as Unavailable; with retries calls succeed.
    client
        .set_faults(&Faults {
            error_rate: 1.0,
            ..Faults::default()
        })
        .await
        .unwrap();
    assert!(matches!(
        server
            .client(quick_options(0))
            .get_load_balancer(&lb.id)
            .await,
        Err(Error::Unavailable { .. })
    ));
    client
        .set_faults(&Faults {
            error_rate: 0.3,
            ..Faults::default()
        })
        .await
        .unwrap();
    for _ in 0..20 {
        assert_eq!(client.get_load_balancer(&lb.id).await.unwrap().id, lb.id);
    }

    // Latency: every call takes at least the injected time; a shorter timeout fails.
    client
        .set_faults(&Faults {
            latency_ms: 300,
            ..Faults::default()
        })
        .await
        .unwrap();
    let started = Instant::now();
    client.get_load_balancer(&lb.id).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    let impatient = server.client(ClientOptions {
        timeout: Duration::from_millis(100),
        ..quick_options(0)
    });
    assert!(matches!(
        impatient.get_load_balancer(&lb.id).await,
        Err(Error::Transport(_))
    ));

    // Rate limit: 429 with Retry-After; the retrying client waits it out.
    client
        .set_faults(&Faults {
            rate_limit_per_second: Some(1),
            ..Faults::default()
        })
        .await
        .unwrap();
    let no_retries = server.client(quick_options(0));
    no_retries.get_load_balancer(&lb.id).await.unwrap();
    match no_retries.get_load_balancer(&lb.id).await {
        Err(Error::RateLimited { retry_after }) => assert_eq!(retry_after, Duration::from_secs(1)),
        other => panic!("expected a rate limit, got {other:?}"),
    }
    let started = Instant::now();
    client.get_load_balancer(&lb.id).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After honoured: waited {:?}",
        started.elapsed()
    );

    client.set_faults(&Faults::default()).await.unwrap();
    tandem_common::install_crypto_provider();
    let metrics = reqwest::get(format!("{}/metrics", server.base_url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains(r#"status="503""#), "errors were injected");
    assert!(
        metrics.contains(r#"status="429""#),
        "rate limits were injected"
    );
}

#[tokio::test]
async fn retries_after_lost_answers_converge_to_one_load_balancer_and_leak_nothing() {
    let dir = TempDir::new("lost");
    let server = Server::start(&dir.0, "127.79.1.0/28", "none").await;
    let admin = server.client(quick_options(0));
    // Short attempts, so that a hanging answer times out and is retried.
    let client = server.client(ClientOptions {
        timeout: Duration::from_millis(500),
        ..quick_options(4)
    });
    let one_shot = server.client(ClientOptions {
        timeout: Duration::from_millis(500),
        ..quick_options(0)
    });
    let backend = Ipv4Addr::new(198, 18, 0, 11);
    let every_way = [LostAnswer::Unavailable, LostAnswer::Reset, LostAnswer::Hang];
    let mut ids = Vec::new();
    for (index, how) in every_way.into_iter().enumerate() {
        // Every committed change loses its answer; a replayed create commits nothing
        // and is answered.
        admin
            .set_faults(&Faults {
                lost_answer_rate: 1.0,
                lost_answer: how,
                ..Faults::default()
            })
            .await
            .unwrap();
        let name = format!("svc-{index}");
        let key = format!("uid-{index}");
        let lost = one_shot
            .create_load_balancer(&spec(&name, backend, 30080), &key)
            .await;
        assert!(
            matches!(&lost, Err(err) if err.is_retryable()),
            "{how:?}: the answer is lost, got {lost:?}"
        );
        let lb = client
            .create_load_balancer(&spec(&name, backend, 30080), &key)
            .await
            .unwrap_or_else(|err| panic!("{how:?}: the retried create failed: {err}"));
        let named = ListFilter {
            name: Some(name.clone()),
            ..ListFilter::default()
        };
        let found = admin.list_load_balancers(&named).await.unwrap();
        assert_eq!(found.len(), 1, "{how:?}: exactly one load balancer");
        assert_eq!(found[0].id, lb.id, "{how:?}: the one the retry returned");
        ids.push(lb.id);
    }
    for id in &ids {
        client.delete_load_balancer(id).await.unwrap();
    }
    admin.set_faults(&Faults::default()).await.unwrap();
    for id in &ids {
        wait_gone(&admin, id).await;
    }
    let left = admin
        .list_load_balancers(&ListFilter::default())
        .await
        .unwrap();
    assert!(left.is_empty(), "leaked: {left:?}");
    let pools = admin.list_pools().await.unwrap();
    assert_eq!(pools[0].allocated, 0, "every VIP is free again");
}

#[tokio::test]
async fn sigterm_shuts_down_cleanly_and_frees_the_vips() {
    let dir = TempDir::new("sigterm");
    let echo_port = start_echo().await;
    let mut server = Server::start(&dir.0, "127.79.0.48/28", "proxy").await;
    let lb = server
        .client(quick_options(2))
        .create_load_balancer(&spec("t", Ipv4Addr::LOCALHOST, echo_port), "uid-t")
        .await
        .unwrap();
    let vip = lb.vip().unwrap();
    assert_forwards(vip).await;
    let pid = server.child.id().unwrap().to_string();
    let sent = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(sent.success());
    let exit = tokio::time::timeout(Duration::from_secs(10), server.child.wait())
        .await
        .expect("cloud-mock did not exit within 10 s of SIGTERM")
        .unwrap();
    assert!(exit.success(), "exit status {exit}");
    assert!(
        TcpStream::connect(SocketAddrV4::new(vip, 8080))
            .await
            .is_err(),
        "the listener on {vip}:8080 outlived the server"
    );
}

/// A TCP echo server on loopback; returns its port.
async fn start_echo() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = stream.read(&mut buf).await {
                    if n == 0 || stream.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

/// Sends a line through `vip:8080` and expects it back, retrying while the data plane
/// comes up (at most 10 s).
async fn assert_forwards(vip: Ipv4Addr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let attempt = async {
            let mut stream = TcpStream::connect(SocketAddrV4::new(vip, 8080)).await?;
            stream.write_all(b"ping\n").await?;
            let mut answer = [0u8; 5];
            stream.read_exact(&mut answer).await?;
            Ok::<_, std::io::Error>(answer)
        };
        match tokio::time::timeout(Duration::from_secs(2), attempt).await {
            Ok(Ok(answer)) => {
                assert_eq!(&answer, b"ping\n");
                return;
            }
            outcome => {
                assert!(
                    Instant::now() < deadline,
                    "{vip}:8080 does not forward: {outcome:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

#[tokio::test]
async fn backend_health_from_the_data_plane_is_reported_per_backend() {
    let dir = TempDir::new("health");
    let echo_port = start_echo().await;
    let server = Server::start(&dir.0, "127.79.0.32/28", "proxy").await;
    let client = server.client(quick_options(2));
    let up = Ipv4Addr::LOCALHOST;
    // Nothing listens on 127.0.0.2: the echo server is bound to 127.0.0.1 only.
    let down = Ipv4Addr::new(127, 0, 0, 2);
    let mut checked = spec("checked", up, echo_port);
    checked.backends.push(Backend { ip: down });
    checked.listeners[0].health_check = Some(HealthCheck {
        protocol: HealthCheckProtocol::Tcp,
        port: echo_port,
        path: None,
    });
    let lb = client
        .create_load_balancer(&checked, "uid-checked")
        .await
        .unwrap();
    let expected = vec![
        BackendStatus {
            ip: up,
            health: BackendHealth::Healthy,
        },
        BackendStatus {
            ip: down,
            health: BackendHealth::Unhealthy,
        },
    ];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let current = client.get_load_balancer(&lb.id).await.unwrap();
        if current.health == expected && current.state == State::Active {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "health never settled: {current:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_forwards(lb.vip().unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_creates_survive_kill_9_and_forward_again() {
    let dir = TempDir::new("persist");
    let pool = "127.79.1.0/25";
    let echo_port = start_echo().await;
    let mut server = Server::start(&dir.0, pool, "proxy").await;
    let client = server.client(quick_options(0));

    let acknowledged = Arc::new(Mutex::new(Vec::new()));
    let creator = {
        let acknowledged = acknowledged.clone();
        tokio::spawn(async move {
            for i in 0..100 {
                let spec = spec(&format!("lb-{i}"), Ipv4Addr::LOCALHOST, echo_port);
                match client
                    .create_load_balancer(&spec, &format!("uid-{i}"))
                    .await
                {
                    Ok(lb) => acknowledged.lock().unwrap().push((lb.id.clone(), lb.vip())),
                    Err(_) => return i,
                }
            }
            100
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while acknowledged.lock().unwrap().len() < 50 {
        assert!(Instant::now() < deadline, "50 creates took over 60 s");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    server.kill().await;
    let stopped_at = creator.await.unwrap();
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert!(stopped_at < 100, "the kill must interrupt the creates");
    assert!(acknowledged.len() >= 50);
    eprintln!(
        "killed after {} acknowledged creates; create #{stopped_at} was in flight",
        acknowledged.len()
    );

    let restarted = Instant::now();
    let server = Server::start(&dir.0, pool, "proxy").await;
    eprintln!("restarted and listening in {:?}", restarted.elapsed());
    let client = server.client(quick_options(3));
    let stored: BTreeMap<_, _> = client
        .list_load_balancers(&ListFilter::default())
        .await
        .unwrap()
        .into_iter()
        .map(|lb| (lb.id.clone(), lb))
        .collect();
    for (id, vip) in &acknowledged {
        let lb = stored
            .get(id)
            .unwrap_or_else(|| panic!("acknowledged {id} lost"));
        assert_eq!(lb.vip(), *vip, "{id} changed its VIP");
        assert_ne!(lb.state, State::Deleting);
    }
    let vips: BTreeSet<_> = stored.values().map(|lb| lb.vip()).collect();
    assert_eq!(vips.len(), stored.len(), "no VIP is held twice");
    // A create that was in flight at the kill is either absent or complete; repeating
    // it with its key never makes a second one.
    let retried = client
        .create_load_balancer(
            &spec(&format!("lb-{stopped_at}"), Ipv4Addr::LOCALHOST, echo_port),
            &format!("uid-{stopped_at}"),
        )
        .await
        .unwrap();
    let named = client
        .list_load_balancers(&ListFilter {
            name: Some(format!("lb-{stopped_at}")),
            ..ListFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(named.len(), 1);
    assert_eq!(named[0].id, retried.id);

    let first = acknowledged.first().unwrap().1.unwrap();
    let last = acknowledged.last().unwrap().1.unwrap();
    assert_forwards(first).await;
    assert_forwards(last).await;
    eprintln!(
        "{} load balancers after restart; {first} and {last} forward again {:?} after the restart",
        stored.len(),
        restarted.elapsed()
    );
}

#[tokio::test]
async fn sdk_node_pools_round_trip_and_survive_lost_answers() {
    let dir = TempDir::new("node-pools");
    let server = Server::start(&dir.0, "127.79.2.0/28", "none").await;
    let client = server.client(quick_options(3));
    let member = |ip: &str| families::Backend {
        ip: ip.parse().unwrap(),
    };
    let tagged = BTreeMap::from([("cluster".to_string(), "c1".to_string())]);
    let spec = NodePoolSpec {
        tags: tagged.clone(),
        backends: vec![member("198.18.0.11"), member("2001:db8:18::11")],
    };
    let created = client.put_node_pool("c1-nodes", &spec, None).await.unwrap();
    assert_eq!(created.version, 1);
    assert!(created.load_balancers.is_empty());
    assert!(matches!(
        client.get_node_pool("absent").await,
        Err(Error::NotFound { .. })
    ));

    let mut lb = spec_on_pool("web", "c1-nodes");
    let made = client.create_load_balancer(&lb, "uid-web").await.unwrap();
    assert_eq!(made.spec.node_pool.as_deref(), Some("c1-nodes"));
    assert_eq!(
        made.health.iter().map(|s| s.ip).collect::<Vec<_>>(),
        vec![Ipv4Addr::new(198, 18, 0, 11)],
        "the IPv4 view lists the IPv4 members"
    );
    lb.node_pool = Some("gone".into());
    let refused = client.create_load_balancer(&lb, "uid-gone").await;
    assert_eq!(
        refused.as_ref().err().and_then(Error::code),
        Some("node-pool-not-found"),
        "{refused:?}"
    );

    // Every committed answer lost: the client's own retry finds the pool written and is
    // answered, once, with the new version.
    client
        .set_faults(&Faults {
            lost_answer_rate: 1.0,
            lost_answer: LostAnswer::Reset,
            ..Faults::default()
        })
        .await
        .unwrap();
    let grown = NodePoolSpec {
        backends: vec![member("198.18.0.11"), member("198.18.0.12")],
        ..spec.clone()
    };
    let written = client
        .put_node_pool("c1-nodes", &grown, Some(1))
        .await
        .unwrap();
    assert_eq!(written.version, 2);
    assert_eq!(written.load_balancers, vec![made.id.clone()]);
    client.set_faults(&Faults::default()).await.unwrap();

    let listed = client
        .list_node_pools(&ListFilter {
            tags: tagged,
            name: None,
        })
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].backends.len(), 2);
    let in_use = client.delete_node_pool("c1-nodes").await;
    assert!(
        matches!(&in_use, Err(Error::Conflict { code: Some(code), .. }) if code == "node-pool-in-use"),
        "{in_use:?}"
    );
    client.delete_load_balancer(&made.id).await.unwrap();
    wait_gone(&client, &made.id).await;
    client.delete_node_pool("c1-nodes").await.unwrap();
    assert!(matches!(
        client.delete_node_pool("c1-nodes").await,
        Err(Error::NotFound { .. })
    ));
}

fn spec_on_pool(name: &str, node_pool: &str) -> LoadBalancerSpec {
    LoadBalancerSpec {
        backends: vec![],
        node_pool: Some(node_pool.into()),
        ..spec(name, Ipv4Addr::LOCALHOST, 30080)
    }
}
