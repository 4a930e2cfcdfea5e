//! Proxy mode with real sockets on loopback VIPs (`127.77.N.x`, one N per test): no root,
//! no setup. Backends are `127.77.N.11` and `127.77.N.12` on a shared backend port.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cloud_mock_dataplane::{
    BackendHealth, DataPlane, DataPlaneConfig, DataPlaneError, HealthCheck, LbFailureReason,
    Protocol,
};
use tokio::io::AsyncWriteExt;
use tokio::net::UdpSocket;

use support::*;

fn fast_config() -> DataPlaneConfig {
    DataPlaneConfig {
        health_interval: Duration::from_millis(100),
        health_timeout: Duration::from_millis(500),
        ..DataPlaneConfig::default()
    }
}

fn http_check(port: u16) -> Option<HealthCheck> {
    Some(HealthCheck::Http {
        port,
        path: "/healthz".to_owned(),
    })
}

#[tokio::test]
async fn tcp_through_the_vip_uses_both_backends() {
    let (vip, a, b) = (addr(201, 1), addr(201, 11), addr(201, 12));
    let backend_port = free_port(a).await;
    let _servers = [
        tcp_backend(a, backend_port, "a").await,
        tcp_backend(b, backend_port, "b").await,
    ];
    let health_port = free_port(a).await;
    let _checks = [
        HealthServer::start(a, health_port).await,
        HealthServer::start(b, health_port).await,
    ];
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(fast_config());
    let lb = lb(
        "lb-tcp",
        vip,
        vec![listener(
            Protocol::Tcp,
            port,
            backend_port,
            http_check(health_port),
        )],
        vec![a, b],
    );
    dataplane.apply(vec![lb]).await.unwrap();
    wait_healthy(&dataplane, "lb-tcp", 2).await;

    let mut seen: HashMap<String, usize> = HashMap::new();
    for i in 0..10 {
        let (mut stream, greeting) = tcp_hello(None, vip, port).await.unwrap();
        stream
            .write_all(format!("ping {i}\n").as_bytes())
            .await
            .unwrap();
        assert_eq!(
            read_line(&mut stream).await.unwrap(),
            format!("ping {i}"),
            "echo through the proxy"
        );
        *seen.entry(greeting).or_default() += 1;
    }
    // Round-robin over two healthy backends, one connection at a time: an even split.
    assert_eq!(seen.get("a"), Some(&5), "{seen:?}");
    assert_eq!(seen.get("b"), Some(&5), "{seen:?}");

    let text = metrics_text(&dataplane);
    assert!(
        text.contains(
            r#"cloud_mock_dataplane_connections_total{protocol="tcp",outcome="forwarded"} 10"#
        ),
        "{text}"
    );
    assert!(
        text.contains(r#"cloud_mock_dataplane_health_checks_total{check="http",result="pass"}"#),
        "{text}"
    );
    dataplane.shutdown().await;
}

#[tokio::test]
async fn udp_through_the_vip_uses_both_backends_and_replies_reach_each_client() {
    let (vip, a, b) = (addr(202, 1), addr(202, 11), addr(202, 12));
    let backend_port = free_port(a).await;
    let _servers = [
        udp_backend(a, backend_port, "a").await,
        udp_backend(b, backend_port, "b").await,
    ];
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(fast_config());
    let lb = lb(
        "lb-udp",
        vip,
        vec![listener(Protocol::Udp, port, backend_port, None)],
        vec![a, b],
    );
    dataplane.apply(vec![lb]).await.unwrap();

    let mut seen: HashMap<String, usize> = HashMap::new();
    for i in 0..6 {
        let client = UdpSocket::bind((addr(202, 100), 0)).await.unwrap();
        let mut backend_of_client = None;
        for round in 0..2 {
            let payload = format!("client {i} round {round}");
            let (reply, from) = udp_ask(&client, vip, port, &payload, Duration::from_secs(2))
                .await
                .expect("a reply");
            assert_eq!(
                from.to_string(),
                format!("{vip}:{port}"),
                "replies come from the VIP"
            );
            let (backend, echoed) = reply.split_once(':').unwrap();
            assert_eq!(echoed, payload, "each client gets its own replies");
            // One flow per client: every datagram of a client goes to the same backend.
            assert_eq!(
                *backend_of_client.get_or_insert(backend.to_owned()),
                backend
            );
        }
        *seen.entry(backend_of_client.unwrap()).or_default() += 1;
    }
    assert_eq!(seen.get("a"), Some(&3), "{seen:?}");
    assert_eq!(seen.get("b"), Some(&3), "{seen:?}");
    let text = metrics_text(&dataplane);
    assert!(
        text.contains(
            r#"cloud_mock_dataplane_connections_total{protocol="udp",outcome="forwarded"} 6"#
        ),
        "{text}"
    );
    assert!(
        text.contains(r#"cloud_mock_dataplane_active_connections{protocol="udp"} 6"#),
        "{text}"
    );
    dataplane.shutdown().await;
}

#[tokio::test]
async fn udp_flows_idle_out_and_the_table_is_bounded() {
    let (vip, a) = (addr(208, 1), addr(208, 11));
    let backend_port = free_port(a).await;
    let _server = udp_backend(a, backend_port, "a").await;
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(DataPlaneConfig {
        udp_idle_timeout: Duration::from_millis(300),
        udp_max_sessions: 2,
        ..fast_config()
    });
    let lb = lb(
        "lb-flows",
        vip,
        vec![listener(Protocol::Udp, port, backend_port, None)],
        vec![a],
    );
    dataplane.apply(vec![lb]).await.unwrap();
    let clients = [
        UdpSocket::bind((addr(208, 100), 0)).await.unwrap(),
        UdpSocket::bind((addr(208, 101), 0)).await.unwrap(),
        UdpSocket::bind((addr(208, 102), 0)).await.unwrap(),
    ];
    let wait = Duration::from_millis(500);
    assert!(udp_ask(&clients[0], vip, port, "1", wait).await.is_some());
    assert!(udp_ask(&clients[1], vip, port, "2", wait).await.is_some());
    assert!(
        udp_ask(&clients[2], vip, port, "3", wait).await.is_none(),
        "third flow: table full"
    );
    // Once the first two flows idle out, there is room again.
    wait_for("flows to idle out", Duration::from_secs(3), || {
        metrics_text(&dataplane)
            .contains(r#"cloud_mock_dataplane_active_connections{protocol="udp"} 0"#)
    })
    .await;
    assert!(udp_ask(&clients[2], vip, port, "3", wait).await.is_some());
    assert!(metrics_text(&dataplane).contains(r#"outcome="table_full"} 1"#));
    dataplane.shutdown().await;
}

/// With the default health settings (1 s interval, 1 s timeout, 2 failures to turn
/// unhealthy, 2 passes to turn healthy again), a backend whose health check starts
/// failing stops getting new connections within 2 intervals + 1 timeout = 3 s.
#[tokio::test]
async fn backend_failing_its_health_check_stops_getting_traffic() {
    let (vip, a, b) = (addr(203, 1), addr(203, 11), addr(203, 12));
    let backend_port = free_port(a).await;
    let _servers = [
        tcp_backend(a, backend_port, "a").await,
        tcp_backend(b, backend_port, "b").await,
    ];
    let health_port = free_port(a).await;
    let health_a = HealthServer::start(a, health_port).await;
    let health_b = HealthServer::start(b, health_port).await;
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(DataPlaneConfig::default());
    let lb = lb(
        "lb-failover",
        vip,
        vec![listener(
            Protocol::Tcp,
            port,
            backend_port,
            http_check(health_port),
        )],
        vec![a, b],
    );
    dataplane.apply(vec![lb]).await.unwrap();
    wait_healthy(&dataplane, "lb-failover", 2).await;

    health_b.set(503);
    let failing_since = Instant::now();
    // Measured by traffic: connect until 4 connections in a row avoid b.
    let mut in_a_row = 0;
    while in_a_row < 4 {
        assert!(
            failing_since.elapsed() < Duration::from_millis(4500),
            "b still gets traffic"
        );
        let (_, greeting) = tcp_hello(None, vip, port).await.unwrap();
        in_a_row = if greeting == "a" { in_a_row + 1 } else { 0 };
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopped_after = failing_since.elapsed();
    println!("traffic to the failing backend stopped after {stopped_after:?} (bound 3 s)");
    assert_eq!(
        dataplane.backend_health("lb-failover"),
        vec![(a, BackendHealth::Healthy), (b, BackendHealth::Unhealthy)]
    );
    for _ in 0..6 {
        assert_eq!(tcp_hello(None, vip, port).await.unwrap().1, "a");
    }

    health_b.set(200);
    let recovered_after = wait_for("b healthy again", Duration::from_secs(4), || {
        dataplane.backend_health("lb-failover")[1].1 == BackendHealth::Healthy
    })
    .await;
    println!("the backend was healthy again after {recovered_after:?}");
    let mut greetings = Vec::new();
    for _ in 0..4 {
        greetings.push(tcp_hello(None, vip, port).await.unwrap().1);
    }
    assert!(greetings.iter().any(|g| g == "b"), "{greetings:?}");
    drop(health_a);
    dataplane.shutdown().await;
}

#[tokio::test]
async fn with_no_healthy_backend_every_backend_serves_and_without_backends_none() {
    let (vip, a) = (addr(204, 1), addr(204, 11));
    let backend_port = free_port(a).await;
    let _servers = [
        tcp_backend(a, backend_port, "a").await,
        udp_backend(a, backend_port, "a").await,
    ];
    // Nothing listens on the health check port: the TCP check fails.
    let check = Some(HealthCheck::Tcp {
        port: free_port(a).await,
    });
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(fast_config());
    let listeners = vec![
        listener(Protocol::Tcp, port, backend_port, check.clone()),
        listener(Protocol::Udp, port, backend_port, check),
    ];
    dataplane
        .apply(vec![lb("lb-down", vip, listeners.clone(), vec![a])])
        .await
        .unwrap();
    wait_for("backend unhealthy", Duration::from_secs(3), || {
        dataplane.backend_health("lb-down") == vec![(a, BackendHealth::Unhealthy)]
    })
    .await;
    // Fail open, as cloud load balancers do when every check fails.
    assert_eq!(tcp_hello(None, vip, port).await.unwrap().1, "a");
    let client = UdpSocket::bind((addr(204, 100), 0)).await.unwrap();
    let answer = udp_ask(&client, vip, port, "x", Duration::from_secs(2)).await;
    assert_eq!(answer.map(|(reply, _)| reply).as_deref(), Some("a:x"));

    // An LB without backends has nothing to send to.
    dataplane
        .apply(vec![lb("lb-down", vip, listeners, vec![])])
        .await
        .unwrap();
    let refused = tcp_hello(None, vip, port).await;
    assert!(
        refused.is_err(),
        "connection must be refused, got {refused:?}"
    );
    let other = UdpSocket::bind((addr(204, 101), 0)).await.unwrap();
    assert!(
        udp_ask(&other, vip, port, "x", Duration::from_millis(300))
            .await
            .is_none()
    );
    let text = metrics_text(&dataplane);
    assert!(
        text.contains(r#"{protocol="tcp",outcome="no_backend"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"{protocol="udp",outcome="no_backend"} 1"#),
        "{text}"
    );
    dataplane.shutdown().await;
}

#[tokio::test]
async fn source_ranges_are_enforced() {
    let (vip, a) = (addr(205, 1), addr(205, 11));
    let backend_port = free_port(a).await;
    let _servers = [
        tcp_backend(a, backend_port, "a").await,
        udp_backend(a, backend_port, "a").await,
    ];
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(fast_config());
    let mut lb = lb(
        "lb-ranges",
        vip,
        vec![
            listener(Protocol::Tcp, port, backend_port, None),
            listener(Protocol::Udp, port, backend_port, None),
        ],
        vec![a],
    );
    lb.source_ranges = vec!["127.77.205.64/30".parse().unwrap()];
    dataplane.apply(vec![lb]).await.unwrap();
    let (allowed, denied) = (addr(205, 65), addr(205, 68));

    assert_eq!(tcp_hello(Some(allowed), vip, port).await.unwrap().1, "a");
    let started = Instant::now();
    let refused = tcp_hello(Some(denied), vip, port).await;
    assert!(
        refused.is_err(),
        "client outside the ranges got {refused:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "closed at once, not timed out"
    );

    let wait = Duration::from_millis(500);
    let client = UdpSocket::bind((allowed, 0)).await.unwrap();
    assert!(udp_ask(&client, vip, port, "hi", wait).await.is_some());
    let client = UdpSocket::bind((denied, 0)).await.unwrap();
    assert!(udp_ask(&client, vip, port, "hi", wait).await.is_none());

    let text = metrics_text(&dataplane);
    assert!(
        text.contains(r#"{protocol="tcp",outcome="denied"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"{protocol="udp",outcome="denied"} 1"#),
        "{text}"
    );
    dataplane.shutdown().await;
}

#[tokio::test]
async fn apply_is_idempotent_and_keeps_open_connections() {
    let (vip, a, b) = (addr(206, 1), addr(206, 11), addr(206, 12));
    let backend_port = free_port(a).await;
    let _servers = [
        tcp_backend(a, backend_port, "a").await,
        tcp_backend(b, backend_port, "b").await,
    ];
    let port = free_port(vip).await;
    let other_port = free_port(vip).await;
    let dataplane = DataPlane::new(fast_config());
    let first = lb(
        "lb-keep",
        vip,
        vec![listener(Protocol::Tcp, port, backend_port, None)],
        vec![a, b],
    );
    let other = lb(
        "lb-other",
        vip,
        vec![listener(Protocol::Tcp, other_port, backend_port, None)],
        vec![a],
    );
    dataplane.apply(vec![first.clone()]).await.unwrap();
    let (mut open, _) = tcp_hello(None, vip, port).await.unwrap();
    let echo = async |stream: &mut tokio::net::TcpStream, text: &str| {
        stream.write_all(format!("{text}\n").as_bytes()).await?;
        read_line(stream).await
    };

    dataplane.apply(vec![first.clone()]).await.unwrap();
    dataplane
        .apply(vec![other.clone(), first.clone()])
        .await
        .unwrap();
    assert_eq!(
        echo(&mut open, "after re-apply").await.unwrap(),
        "after re-apply"
    );
    assert_eq!(tcp_hello(None, vip, other_port).await.unwrap().1, "a");

    // New backends for the same listener: same socket, old connection stays.
    let only_b = lb(
        "lb-keep",
        vip,
        vec![listener(Protocol::Tcp, port, backend_port, None)],
        vec![b],
    );
    dataplane
        .apply(vec![only_b.clone(), other.clone()])
        .await
        .unwrap();
    assert_eq!(
        echo(&mut open, "after update").await.unwrap(),
        "after update"
    );
    for _ in 0..3 {
        assert_eq!(tcp_hello(None, vip, port).await.unwrap().1, "b");
    }

    // Removing the load balancer closes its listener and its connections, not the other.
    dataplane.apply(vec![other]).await.unwrap();
    assert!(
        tcp_hello(None, vip, port).await.is_err(),
        "listener must be gone"
    );
    assert!(
        echo(&mut open, "after delete").await.is_err(),
        "connection must be closed"
    );
    assert_eq!(tcp_hello(None, vip, other_port).await.unwrap().1, "a");
    assert!(dataplane.backend_health("lb-keep").is_empty());
    dataplane.shutdown().await;
}

#[tokio::test]
async fn a_fresh_data_plane_with_the_stored_set_serves_again() {
    let (vip, a) = (addr(207, 1), addr(207, 11));
    let backend_port = free_port(a).await;
    let _servers = [
        tcp_backend(a, backend_port, "a").await,
        udp_backend(a, backend_port, "a").await,
    ];
    let port = free_port(vip).await;
    let stored = vec![lb(
        "lb-restart",
        vip,
        vec![
            listener(
                Protocol::Tcp,
                port,
                backend_port,
                Some(HealthCheck::Tcp { port: backend_port }),
            ),
            listener(Protocol::Udp, port, backend_port, None),
        ],
        vec![a],
    )];
    let before = DataPlane::new(fast_config());
    before.apply(stored.clone()).await.unwrap();
    wait_healthy(&before, "lb-restart", 1).await;
    assert_eq!(tcp_hello(None, vip, port).await.unwrap().1, "a");
    before.shutdown().await;
    assert!(
        tcp_hello(None, vip, port).await.is_err(),
        "shutdown closes listeners"
    );
    assert!(matches!(
        before.apply(stored.clone()).await,
        Err(DataPlaneError::ShutDown)
    ));

    let after = DataPlane::new(fast_config());
    after.apply(stored).await.unwrap();
    wait_healthy(&after, "lb-restart", 1).await;
    assert_eq!(tcp_hello(None, vip, port).await.unwrap().1, "a");
    let client = UdpSocket::bind((addr(207, 100), 0)).await.unwrap();
    assert!(
        udp_ask(&client, vip, port, "x", Duration::from_secs(1))
            .await
            .is_some()
    );
    after.shutdown().await;
}

#[tokio::test]
async fn unrealisable_load_balancers_are_reported_and_the_rest_converges() {
    let (vip, a) = (addr(209, 1), addr(209, 11));
    let backend_port = free_port(a).await;
    let _server = tcp_backend(a, backend_port, "a").await;
    let taken_port = free_port(vip).await;
    let squatter = std::net::TcpListener::bind((vip, taken_port)).unwrap();
    let good_port = free_port(vip).await;
    let dataplane = DataPlane::new(fast_config());
    let blocked = lb(
        "lb-blocked",
        vip,
        vec![listener(Protocol::Tcp, taken_port, backend_port, None)],
        vec![a],
    );
    let good = lb(
        "lb-good",
        vip,
        vec![listener(Protocol::Tcp, good_port, backend_port, None)],
        vec![a],
    );
    let Err(DataPlaneError::Incomplete { failures }) =
        dataplane.apply(vec![blocked.clone(), good.clone()]).await
    else {
        panic!("the blocked listener must be reported");
    };
    assert_eq!(failures.len(), 1);
    assert_eq!(failures[0].lb_id, "lb-blocked");
    assert!(
        matches!(failures[0].reason, LbFailureReason::Bind { .. }),
        "{:?}",
        failures[0]
    );
    assert_eq!(tcp_hello(None, vip, good_port).await.unwrap().1, "a");

    // The next apply retries.
    drop(squatter);
    dataplane.apply(vec![blocked, good]).await.unwrap();
    assert_eq!(tcp_hello(None, vip, taken_port).await.unwrap().1, "a");
    dataplane.shutdown().await;
}

#[tokio::test]
async fn proxied_connections_probe_a_silent_peer() {
    let (vip, a) = (addr(209, 1), addr(209, 11));
    let backend_port = free_port(a).await;
    let _server = tcp_backend(a, backend_port, "a").await;
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(fast_config());
    let only = lb(
        "lb-keepalive",
        vip,
        vec![listener(Protocol::Tcp, port, backend_port, None)],
        vec![a],
    );
    dataplane.apply(vec![only]).await.unwrap();
    let (_open, greeting) = tcp_hello(None, vip, port).await.unwrap();
    assert_eq!(greeting, "a");
    // The edge's two sockets of the connection: the client's, accepted on the VIP, and the
    // one to the backend. `ss -o` shows each one's keep-alive timer.
    let sockets = |filter: String| {
        let out = std::process::Command::new("ss")
            .args(["-Htno", "state", "established", &filter])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let accepted = sockets(format!("src {vip}:{port}"));
    let upstream = sockets(format!("dst {a}:{backend_port}"));
    for (side, listing) in [("client", &accepted), ("backend", &upstream)] {
        assert!(
            listing.contains("timer:(keepalive,"),
            "the {side} side probes its peer: {listing:?}"
        );
    }
    dataplane.shutdown().await;
}
