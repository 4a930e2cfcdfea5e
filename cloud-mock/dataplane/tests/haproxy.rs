//! The HAProxy data plane with a real HAProxy (Debian's `haproxy` package) on loopback
//! VIPs (`127.77.N.x`, N from 220 on, one per test): spread, health from HAProxy's own
//! checks, failing open when no node is healthy, source ranges, servers changed without a
//! reload, hitless reloads, refusals, and HAProxy killed and started again. Needs
//! `haproxy` on PATH, not root.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cloud_mock_dataplane::{
    BackendHealth, DataPlane, DataPlaneConfig, DataPlaneError, DataPlaneKind, HaproxySettings,
    HealthCheck, LbFailureReason, Protocol,
};
use tokio::io::AsyncWriteExt;

use support::*;

/// HAProxy's state directory for one test, removed when the test ends.
struct StateDir(PathBuf);

impl StateDir {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("cm-hx-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn haproxy_config(state: &StateDir) -> DataPlaneConfig {
    assert!(
        std::process::Command::new("haproxy")
            .arg("-v")
            .output()
            .is_ok_and(|out| out.status.success()),
        "these tests run a real HAProxy: install Debian's haproxy package"
    );
    DataPlaneConfig {
        mode: DataPlaneKind::Haproxy,
        health_interval: Duration::from_millis(200),
        health_timeout: Duration::from_millis(500),
        haproxy: HaproxySettings {
            state_dir: state.0.clone(),
            min_reload_interval: Duration::from_millis(200),
            ..HaproxySettings::default()
        },
        ..DataPlaneConfig::default()
    }
}

fn http_check(port: u16) -> Option<HealthCheck> {
    Some(HealthCheck::Http {
        port,
        path: "/healthz".to_owned(),
    })
}

/// Greetings of `count` connections to `vip:port`, one at a time, counted by backend.
async fn spread(vip: IpAddr, port: u16, count: usize) -> HashMap<String, usize> {
    let mut seen = HashMap::new();
    for i in 0..count {
        let (mut stream, greeting) = tcp_hello(None, vip, port).await.unwrap();
        stream
            .write_all(format!("ping {i}\n").as_bytes())
            .await
            .unwrap();
        assert_eq!(read_line(&mut stream).await.unwrap(), format!("ping {i}"));
        *seen.entry(greeting).or_default() += 1;
    }
    seen
}

/// Backends greeting `a` and `b` on one port.
async fn backends_a_and_b(a: IpAddr, b: IpAddr) -> (u16, Vec<Server>) {
    let (port, listeners) = listen_on_all(&[a, b]).await;
    let servers = listeners
        .into_iter()
        .zip(["a", "b"])
        .map(|(listener, name)| greet_on(listener, name))
        .collect();
    (port, servers)
}

fn counter(text: &str, line: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
        .unwrap_or(0)
}

const RELOADS_OK: &str = r#"cloud_mock_haproxy_reloads_total{result="ok"}"#;

/// Asserts that the changes since `reloads_before` took no reload and HAProxy refused
/// none of their runtime commands; the metrics text.
fn assert_changed_at_run_time(dataplane: &DataPlane, reloads_before: u64, what: &str) -> String {
    let text = metrics_text(dataplane);
    assert_eq!(
        counter(&text, RELOADS_OK),
        reloads_before,
        "no reload for {what}"
    );
    assert_eq!(
        counter(
            &text,
            r#"cloud_mock_haproxy_runtime_commands_total{result="error"}"#
        ),
        0,
        "HAProxy refused a runtime command for {what}: {text}"
    );
    text
}

#[tokio::test]
async fn haproxy_spreads_and_its_checks_are_the_health_the_api_reports() {
    let state = StateDir::new("spread");
    let (vip, a, b) = (addr(220, 1), addr(220, 11), addr(220, 12));
    let (backend_port, _servers) = backends_a_and_b(a, b).await;
    let (health_port, health) = listen_on_all(&[a, b]).await;
    let checks: Vec<HealthServer> = health.into_iter().map(HealthServer::on).collect();
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(haproxy_config(&state));
    let listeners = vec![listener(
        Protocol::Tcp,
        port,
        backend_port,
        http_check(health_port),
    )];
    dataplane
        .apply(vec![lb("lb-spread", vip, listeners, vec![a, b])])
        .await
        .unwrap();
    wait_healthy(&dataplane, "lb-spread", 2).await;
    let seen = spread(vip, port, 10).await;
    assert_eq!(
        (seen.get("a"), seen.get("b")),
        (Some(&5), Some(&5)),
        "{seen:?}"
    );

    // The node's health check fails: HAProxy takes it out, and the API says so.
    checks[1].set(503);
    wait_for("b unhealthy", Duration::from_secs(5), || {
        dataplane.backend_health("lb-spread")
            == vec![(a, BackendHealth::Healthy), (b, BackendHealth::Unhealthy)]
    })
    .await;
    assert_eq!(spread(vip, port, 6).await.get("a"), Some(&6));
    let config = std::fs::read_to_string(state.0.join("haproxy.cfg")).unwrap();
    assert!(
        config.contains("http-check send meth GET uri /healthz"),
        "{config}"
    );
    dataplane.shutdown().await;
    assert!(
        tcp_hello(None, vip, port).await.is_err(),
        "HAProxy stopped with the data plane"
    );
}

/// Like cloud load balancers (and the edge's own data plane), HAProxy fails open: with
/// every node's health port closed but its service port answering, connections through
/// the VIP still succeed, spread over all the nodes; with one node healthy, only it
/// serves. Nodes joining and leaving at run time bring and take their fail-open backups.
#[tokio::test]
async fn haproxy_fails_open_when_no_node_is_healthy() {
    let state = StateDir::new("open");
    let (vip, a, b, c) = (addr(226, 1), addr(226, 11), addr(226, 12), addr(226, 13));
    let (backend_port, listeners) = listen_on_all(&[a, b, c]).await;
    let _servers: Vec<Server> = listeners
        .into_iter()
        .zip(["a", "b", "c"])
        .map(|(listener, name)| greet_on(listener, name))
        .collect();
    // Health ports on a and b; c's is closed from the start.
    let (health_port, mut health) = listen_on_all(&[a, b, c]).await;
    drop(health.pop());
    let checks: Vec<HealthServer> = health.into_iter().map(HealthServer::on).collect();
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(haproxy_config(&state));
    let checked = || {
        vec![listener(
            Protocol::Tcp,
            port,
            backend_port,
            http_check(health_port),
        )]
    };
    dataplane
        .apply(vec![lb("lb-open", vip, checked(), vec![a, b])])
        .await
        .unwrap();
    wait_healthy(&dataplane, "lb-open", 2).await;
    let config = std::fs::read_to_string(state.0.join("haproxy.cfg")).unwrap();
    assert!(config.contains("    option allbackups\n"), "{config}");
    assert!(
        config.contains(&format!("server open-{a} {a}:{backend_port} backup\n")),
        "{config}"
    );
    let seen = spread(vip, port, 10).await;
    assert_eq!(
        (seen.get("a"), seen.get("b")),
        (Some(&5), Some(&5)),
        "{seen:?}"
    );

    // Every health port closes (the node proxies restart, say); the service ports answer.
    drop(checks);
    wait_for("a and b unhealthy", Duration::from_secs(5), || {
        dataplane.backend_health("lb-open")
            == vec![(a, BackendHealth::Unhealthy), (b, BackendHealth::Unhealthy)]
    })
    .await;
    // Every connection succeeds (`spread` fails on any refused one), over both nodes.
    let seen = spread(vip, port, 10).await;
    assert!(
        seen.get("a").is_some_and(|n| *n >= 2) && seen.get("b").is_some_and(|n| *n >= 2),
        "fail open spreads over all the nodes: {seen:?}"
    );
    // The backups never pass for nodes: health still names a and b only, both DOWN.
    assert_eq!(
        dataplane.backend_health("lb-open"),
        vec![(a, BackendHealth::Unhealthy), (b, BackendHealth::Unhealthy)]
    );

    // a is healthy again: it alone takes the traffic; b's backup takes nothing.
    let _a_health = HealthServer::start(a, health_port).await;
    wait_for("a healthy", Duration::from_secs(5), || {
        dataplane.backend_health("lb-open")
            == vec![(a, BackendHealth::Healthy), (b, BackendHealth::Unhealthy)]
    })
    .await;
    assert_eq!(spread(vip, port, 6).await.get("a"), Some(&6));

    // Through the runtime API, no reload: the healthy a leaves and c (health port closed)
    // joins. With no node healthy the backups serve, c's added at run time among them.
    let before = counter(&metrics_text(&dataplane), RELOADS_OK);
    dataplane
        .apply(vec![lb("lb-open", vip, checked(), vec![b, c])])
        .await
        .unwrap();
    assert_changed_at_run_time(&dataplane, before, "nodes and their backups changing");
    let config = std::fs::read_to_string(state.0.join("haproxy.cfg")).unwrap();
    assert!(
        config.contains(&format!("server open-{c} {c}:{backend_port} backup\n"))
            && !config.contains(&format!("open-{a}")),
        "{config}"
    );
    wait_for("b and c unhealthy", Duration::from_secs(5), || {
        dataplane.backend_health("lb-open")
            == vec![(b, BackendHealth::Unhealthy), (c, BackendHealth::Unhealthy)]
    })
    .await;
    let seen = spread(vip, port, 10).await;
    assert!(
        seen.get("b").is_some_and(|n| *n >= 2)
            && seen.get("c").is_some_and(|n| *n >= 2)
            && !seen.contains_key("a"),
        "the running backups are those of the file: {seen:?}"
    );
    dataplane.shutdown().await;
}

#[tokio::test]
async fn nodes_change_through_the_runtime_api_and_frontends_through_hitless_reloads() {
    let state = StateDir::new("runtime");
    let (vip, a, b) = (addr(221, 1), addr(221, 11), addr(221, 12));
    let (backend_port, _servers) = backends_a_and_b(a, b).await;
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(haproxy_config(&state));
    let one_listener = || vec![listener(Protocol::Tcp, port, backend_port, None)];
    dataplane
        .apply(vec![lb("lb-nodes", vip, one_listener(), vec![a])])
        .await
        .unwrap();
    assert_eq!(spread(vip, port, 4).await.get("a"), Some(&4));
    let before = counter(&metrics_text(&dataplane), RELOADS_OK);

    // A node joins: a server added at run time, no reload, and the file holds it too.
    dataplane
        .apply(vec![lb("lb-nodes", vip, one_listener(), vec![a, b])])
        .await
        .unwrap();
    let seen = spread(vip, port, 4).await;
    assert_eq!(
        (seen.get("a"), seen.get("b")),
        (Some(&2), Some(&2)),
        "{seen:?}"
    );
    let text = assert_changed_at_run_time(&dataplane, before, "a node joining");
    assert!(
        counter(
            &text,
            r#"cloud_mock_haproxy_runtime_commands_total{result="ok"}"#
        ) >= 2
    );
    let config = std::fs::read_to_string(state.0.join("haproxy.cfg")).unwrap();
    assert!(
        config.contains(&format!("server {b} {b}:{backend_port}")),
        "{config}"
    );

    // A node leaves while a connection through it is in flight: at once it takes no new
    // connection, the one it carries goes on (the drain), and its server is deleted
    // once that one ends, at run time, still without a reload.
    let mut through_a = None;
    for _ in 0..8 {
        let (stream, name) = tcp_hello(None, vip, port).await.unwrap();
        if name == "a" {
            through_a = Some(stream);
            break;
        }
    }
    let mut through_a = through_a.expect("a connection through node a");
    let started = std::time::Instant::now();
    let leave = dataplane.apply(vec![lb("lb-nodes", vip, one_listener(), vec![b])]);
    let in_flight = async {
        wait_for_async("node a out of rotation", Duration::from_secs(5), || async {
            spread(vip, port, 4).await.get("b") == Some(&4)
        })
        .await;
        through_a.write_all(b"in flight\n").await.unwrap();
        assert_eq!(read_line(&mut through_a).await.unwrap(), "in flight");
        drop(through_a);
    };
    let (left, ()) = tokio::join!(leave, in_flight);
    left.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the drain ends with the last connection, not at its timeout: {:?}",
        started.elapsed()
    );
    assert_eq!(spread(vip, port, 4).await.get("b"), Some(&4));
    assert_changed_at_run_time(&dataplane, before, "a node leaving");

    // Frontends change five times under steady traffic, with a connection held open
    // across the reloads: nothing is refused and the held connection keeps working.
    let (mut held, _) = tcp_hello(None, vip, port).await.unwrap();
    let traffic = tokio::spawn(async move {
        let mut failed = 0;
        for _ in 0..300 {
            if tcp_hello(None, vip, port).await.is_err() {
                failed += 1;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        failed
    });
    let mut lbs = vec![lb("lb-nodes", vip, one_listener(), vec![a, b])];
    for n in 0..5_u8 {
        let extra_vip = addr(221, 100 + n);
        let extra_port = free_port(extra_vip).await;
        lbs.push(lb(
            &format!("lb-extra-{n}"),
            extra_vip,
            vec![listener(Protocol::Tcp, extra_port, backend_port, None)],
            vec![a],
        ));
        dataplane.apply(lbs.clone()).await.unwrap();
        // A new load balancer serves as soon as apply returns.
        assert_eq!(tcp_hello(None, extra_vip, extra_port).await.unwrap().1, "a");
    }
    assert_eq!(
        traffic.await.unwrap(),
        0,
        "connections refused across reloads"
    );
    held.write_all(b"still here\n").await.unwrap();
    assert_eq!(read_line(&mut held).await.unwrap(), "still here");
    assert!(counter(&metrics_text(&dataplane), RELOADS_OK) >= before + 5);
    dataplane.shutdown().await;
}

#[tokio::test]
async fn source_ranges_are_connection_rules_and_udp_is_refused_by_name() {
    let state = StateDir::new("ranges");
    let (vip, a) = (addr(222, 1), addr(222, 11));
    let (inside, outside) = (addr(222, 100), addr(222, 101));
    let backend_port = free_port(a).await;
    let _server = tcp_backend(a, backend_port, "a").await;
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(haproxy_config(&state));
    let mut ranged = lb(
        "lb-ranged",
        vip,
        vec![listener(Protocol::Tcp, port, backend_port, None)],
        vec![a],
    );
    ranged.source_ranges = vec![format!("{inside}/32").parse().unwrap()];
    let udp = lb(
        "lb-udp",
        addr(222, 2),
        vec![listener(Protocol::Udp, 53, backend_port, None)],
        vec![a],
    );
    let error = dataplane.apply(vec![ranged, udp]).await.unwrap_err();
    let DataPlaneError::Incomplete { failures } = error else {
        panic!("{error}");
    };
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].lb_id, "lb-udp");
    assert!(matches!(
        failures[0].reason,
        LbFailureReason::ProtocolUnsupported {
            protocol: Protocol::Udp,
            port: 53
        }
    ));
    assert!(failures[0].to_string().contains("UDP listener on port 53"));

    assert_eq!(tcp_hello(Some(inside), vip, port).await.unwrap().1, "a");
    assert!(
        tcp_hello(Some(outside), vip, port).await.is_err(),
        "a client outside the source ranges is refused"
    );
    dataplane.shutdown().await;
}

#[tokio::test]
async fn haproxy_killed_is_started_again_from_the_store_s_configuration() {
    let state = StateDir::new("killed");
    let (vip, a, b) = (addr(223, 1), addr(223, 11), addr(223, 12));
    let (backend_port, _servers) = backends_a_and_b(a, b).await;
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(haproxy_config(&state));
    let lbs = vec![lb(
        "lb-killed",
        vip,
        vec![listener(Protocol::Tcp, port, backend_port, None)],
        vec![a],
    )];
    dataplane.apply(lbs.clone()).await.unwrap();
    assert_eq!(tcp_hello(None, vip, port).await.unwrap().1, "a");

    for pid in haproxy_pids(&state.0.join("haproxy.cfg")) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    }
    wait_for_async("traffic again", Duration::from_secs(10), || async {
        tcp_hello(None, vip, port).await.is_ok()
    })
    .await;
    assert!(
        counter(
            &metrics_text(&dataplane),
            "cloud_mock_haproxy_restarts_total"
        ) >= 1,
        "the restart is counted"
    );
    // And it is still driven: a node change after the restart takes effect.
    let mut moved = lbs;
    moved[0].backends = vec![b];
    dataplane.apply(moved).await.unwrap();
    assert_eq!(spread(vip, port, 3).await.get("b"), Some(&3));
    dataplane.shutdown().await;
}

/// HAProxy processes (master and workers) started with `config`.
fn haproxy_pids(config: &Path) -> Vec<i32> {
    let wanted = config.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| {
            let pid: i32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            (cmdline.starts_with("haproxy") && cmdline.contains(&wanted)).then_some(pid)
        })
        .collect()
}

async fn wait_for_async<F: std::future::Future<Output = bool>>(
    what: &str,
    limit: Duration,
    mut condition: impl FnMut() -> F,
) {
    let start = std::time::Instant::now();
    while !condition().await {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn an_haproxy_a_crashed_edge_left_running_is_adopted_and_reloaded_without_a_gap() {
    let state = StateDir::new("adopt");
    let (vip, a, b) = (addr(224, 1), addr(224, 11), addr(224, 12));
    let (backend_port, _servers) = backends_a_and_b(a, b).await;
    let port = free_port(vip).await;
    let config = haproxy_config(&state);
    let first = vec![lb(
        "lb-adopt",
        vip,
        vec![listener(Protocol::Tcp, port, backend_port, None)],
        vec![a],
    )];
    // The first edge starts HAProxy and then dies without any shutdown path running: its
    // runtime is leaked, so nothing of it runs again and its HAProxy is left serving.
    let crashed = {
        let (config, first) = (config.clone(), first.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let dataplane = DataPlane::new(config);
                dataplane.apply(first).await.unwrap();
                std::mem::forget(dataplane);
            });
            std::mem::forget(runtime);
        })
    };
    crashed.join().unwrap();
    let left = haproxy_pids(&state.0.join("haproxy.cfg"));
    assert!(!left.is_empty(), "the crashed edge's HAProxy runs on");
    assert_eq!(tcp_hello(None, vip, port).await.unwrap().1, "a");

    // The next edge adopts it and reloads it from the store, under traffic.
    let traffic = tokio::spawn(async move {
        let mut failed = 0;
        for _ in 0..200 {
            if tcp_hello(None, vip, port).await.is_err() {
                failed += 1;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        failed
    });
    let dataplane = DataPlane::new(config);
    let mut moved = first;
    moved[0].backends = vec![b];
    dataplane.apply(moved).await.unwrap();
    assert_eq!(
        spread(vip, port, 3).await.get("b"),
        Some(&3),
        "the store's state serves"
    );
    assert_eq!(
        traffic.await.unwrap(),
        0,
        "connections refused while the edge came back"
    );
    let masters = haproxy_pids(&state.0.join("haproxy.cfg"));
    assert!(
        masters.contains(&left[0]),
        "the same master serves: {left:?} {masters:?}"
    );
    dataplane.shutdown().await;
}

#[tokio::test]
async fn a_reload_haproxy_refuses_is_reported_and_the_running_configuration_stays() {
    let state = StateDir::new("refused");
    let (vip, a, b) = (addr(225, 1), addr(225, 11), addr(225, 12));
    let (backend_port, _servers) = backends_a_and_b(a, b).await;
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(haproxy_config(&state));
    let serving = lb(
        "lb-serving",
        vip,
        vec![listener(Protocol::Tcp, port, backend_port, None)],
        vec![a],
    );
    dataplane.apply(vec![serving.clone()]).await.unwrap();
    let config = std::fs::read_to_string(state.0.join("haproxy.cfg")).unwrap();

    // A VIP that is no address of this host (and not added: the edge manages no
    // addresses here): `haproxy -c` accepts it, the new worker cannot bind it.
    let unbindable = lb(
        "lb-unbindable",
        "192.0.2.1".parse().unwrap(),
        vec![listener(Protocol::Tcp, 80, backend_port, None)],
        vec![a],
    );
    let error = dataplane
        .apply(vec![serving, unbindable])
        .await
        .unwrap_err();
    let DataPlaneError::Incomplete { failures } = error else {
        panic!("{error}");
    };
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].lb_id, "lb-unbindable");
    assert!(
        matches!(failures[0].reason, LbFailureReason::Haproxy(_)),
        "{failures:?}"
    );
    assert!(
        failures[0].to_string().contains("reload failed"),
        "{failures:?}"
    );
    assert_eq!(
        std::fs::read_to_string(state.0.join("haproxy.cfg")).unwrap(),
        config,
        "the file the running worker was started from is back"
    );
    assert_eq!(tcp_hello(None, vip, port).await.unwrap().1, "a");
    assert!(
        counter(
            &metrics_text(&dataplane),
            r#"cloud_mock_haproxy_reloads_total{result="error"}"#
        ) >= 1
    );
    dataplane.shutdown().await;
}
