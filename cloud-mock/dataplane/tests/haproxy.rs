//! The HAProxy data plane with a real HAProxy (Debian's `haproxy` package): spread, health
//! from HAProxy's own checks, failing open when no node is healthy, source ranges, new
//! load balancers, nodes and source ranges changed without a reload, hitless reloads for
//! new ports, refusals, and HAProxy killed and started again from its files. HAProxy
//! binds each port on every address, so each test runs in a network namespace of its own
//! (`support::netns::Lab`, root only, always deleted), on loopback VIPs `127.77.N.x` (N
//! from 220 on, one per test) and IPv6 VIPs it adds to its `lo`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cloud_mock_dataplane::{
    BackendHealth, DataPlane, DataPlaneConfig, DataPlaneError, DataPlaneKind, HaproxyError,
    HaproxySettings, HealthCheck, LbFailureReason, Protocol,
};
use tokio::io::AsyncWriteExt;

use support::netns::{Lab, block_on_in_netns, ip_async, is_root};
use support::*;

/// HAProxy's state directory for one test; removed when the test ends, also on panic,
/// with whatever HAProxy still runs from it.
struct StateDir(PathBuf);

impl Drop for StateDir {
    fn drop(&mut self) {
        for pid in haproxy_pids(&self.0.join("haproxy.cfg")) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `body` in a network namespace of its own (`id`: the test's letter), with the path
/// of a state directory for `test`.
fn in_own_netns<F: Future<Output = ()>>(
    id: char,
    test: &str,
    body: impl FnOnce(PathBuf) -> F + Send,
) {
    if !is_root() {
        return;
    }
    let lab = Lab::create(id);
    let dir = std::env::temp_dir().join(format!("cm-hx-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Dropped before `lab`, also on panic: HAProxy stops before its namespace goes.
    let _state = StateDir(dir.clone());
    block_on_in_netns(&lab.edge, || body(dir));
}

fn read_config(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("haproxy.cfg")).unwrap()
}

fn haproxy_config(dir: &Path) -> DataPlaneConfig {
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
            state_dir: dir.to_owned(),
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

#[test]
fn haproxy_spreads_and_its_checks_are_the_health_the_api_reports() {
    in_own_netns('s', "spread", |dir| async move {
        let (vip, a, b) = (addr(220, 1), addr(220, 11), addr(220, 12));
        let (backend_port, _servers) = backends_a_and_b(a, b).await;
        let (health_port, health) = listen_on_all(&[a, b]).await;
        let checks: Vec<HealthServer> = health.into_iter().map(HealthServer::on).collect();
        let port = free_port(vip).await;
        let dataplane = DataPlane::new(haproxy_config(&dir));
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
        let config = read_config(&dir);
        assert!(
            config.contains("http-check send meth GET uri /healthz"),
            "{config}"
        );
        dataplane.shutdown().await;
        assert!(
            tcp_hello(None, vip, port).await.is_err(),
            "HAProxy stopped with the data plane"
        );
    });
}

/// Like cloud load balancers (and the edge's own data plane), HAProxy fails open: with
/// every node's health port closed but its service port answering, connections through
/// the VIP still succeed, spread over all the nodes; with one node healthy, only it
/// serves. Nodes joining and leaving at run time bring and take their fail-open backups.
#[test]
fn haproxy_fails_open_when_no_node_is_healthy() {
    in_own_netns('o', "open", |dir| async move {
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
        let dataplane = DataPlane::new(haproxy_config(&dir));
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
        let config = read_config(&dir);
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
        let config = read_config(&dir);
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
    });
}

#[test]
fn nodes_change_through_the_runtime_api_and_frontends_through_hitless_reloads() {
    in_own_netns('r', "runtime", |dir| async move {
        let (vip, a, b) = (addr(221, 1), addr(221, 11), addr(221, 12));
        let (backend_port, _servers) = backends_a_and_b(a, b).await;
        let port = free_port(vip).await;
        let dataplane = DataPlane::new(haproxy_config(&dir));
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
        let config = read_config(&dir);
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

        // Five load balancers on new ports, five new frontends and so five reloads, under
        // steady traffic, with a connection held open across them: nothing is refused and
        // the held connection keeps working.
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
    });
}

#[test]
fn source_ranges_refuse_other_clients_and_udp_is_refused_by_name() {
    in_own_netns('q', "ranges", |dir| async move {
        let (vip, a) = (addr(222, 1), addr(222, 11));
        let (inside, outside) = (addr(222, 100), addr(222, 101));
        let backend_port = free_port(a).await;
        let _server = tcp_backend(a, backend_port, "a").await;
        let port = free_port(vip).await;
        let dataplane = DataPlane::new(haproxy_config(&dir));
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
    });
}

#[test]
fn haproxy_killed_is_started_again_from_the_store_s_configuration() {
    in_own_netns('k', "killed", |dir| async move {
        let (vip, a, b) = (addr(223, 1), addr(223, 11), addr(223, 12));
        let (backend_port, _servers) = backends_a_and_b(a, b).await;
        let port = free_port(vip).await;
        let dataplane = DataPlane::new(haproxy_config(&dir));
        let lbs = vec![lb(
            "lb-killed",
            vip,
            vec![listener(Protocol::Tcp, port, backend_port, None)],
            vec![a],
        )];
        dataplane.apply(lbs.clone()).await.unwrap();
        assert_eq!(tcp_hello(None, vip, port).await.unwrap().1, "a");

        for pid in haproxy_pids(&dir.join("haproxy.cfg")) {
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
    });
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

#[test]
fn an_haproxy_a_crashed_edge_left_running_is_adopted_and_reloaded_without_a_gap() {
    in_own_netns('a', "adopt", |dir| async move {
        let (vip, a, b) = (addr(224, 1), addr(224, 11), addr(224, 12));
        let (backend_port, _servers) = backends_a_and_b(a, b).await;
        let port = free_port(vip).await;
        let config = haproxy_config(&dir);
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
        let left = haproxy_pids(&dir.join("haproxy.cfg"));
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
        let masters = haproxy_pids(&dir.join("haproxy.cfg"));
        assert!(
            masters.contains(&left[0]),
            "the same master serves: {left:?} {masters:?}"
        );
        dataplane.shutdown().await;
    });
}

#[test]
fn a_reload_haproxy_refuses_is_reported_and_the_running_configuration_stays() {
    in_own_netns('x', "refused", |dir| async move {
        let (vip, a, b) = (addr(225, 1), addr(225, 11), addr(225, 12));
        let (backend_port, _servers) = backends_a_and_b(a, b).await;
        let port = free_port(vip).await;
        let dataplane = DataPlane::new(haproxy_config(&dir));
        let serving = lb(
            "lb-serving",
            vip,
            vec![listener(Protocol::Tcp, port, backend_port, None)],
            vec![a],
        );
        dataplane.apply(vec![serving.clone()]).await.unwrap();
        let config = read_config(&dir);

        // Another socket holds a port on one address: `haproxy -c` accepts a listener on
        // it, the new worker cannot bind the port on every address.
        let holder_ip = addr(225, 50);
        let taken = free_port(holder_ip).await;
        let _holder = tokio::net::TcpListener::bind((holder_ip, taken))
            .await
            .unwrap();
        let unbindable = lb(
            "lb-unbindable",
            addr(225, 2),
            vec![listener(Protocol::Tcp, taken, backend_port, None)],
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
            matches!(
                failures[0].reason,
                LbFailureReason::Haproxy(HaproxyError::ReloadFailed)
            ),
            "{failures:?}"
        );
        assert!(
            failures[0].to_string().contains("reload failed"),
            "{failures:?}"
        );
        assert_eq!(
            read_config(&dir),
            config,
            "the file the running worker was started from is back"
        );
        assert!(
            !std::fs::read_dir(&dir)
                .unwrap()
                .any(|entry| entry.unwrap().file_name() == format!("port-{taken}-v4.map").as_str()),
            "and only its map and ACL files"
        );
        assert_eq!(tcp_hello(None, vip, port).await.unwrap().1, "a");
        assert!(
            counter(
                &metrics_text(&dataplane),
                r#"cloud_mock_haproxy_reloads_total{result="error"}"#
            ) >= 1
        );
        dataplane.shutdown().await;
    });
}

/// A port the edge shares with another socket (its API) is bound per VIP: the load
/// balancers on it serve beside that socket, each new VIP with a reload of its own.
#[test]
fn a_shared_port_binds_each_vip_alone_beside_the_other_socket() {
    in_own_netns('h', "shared", |dir| async move {
        let (first_vip, second_vip, a) = (addr(228, 1), addr(228, 2), addr(228, 11));
        let (backend_port, _servers) = backends_a_and_b(a, addr(228, 12)).await;
        let holder_ip = addr(228, 50);
        let shared = free_port(holder_ip).await;
        let holder = tokio::net::TcpListener::bind((holder_ip, shared))
            .await
            .unwrap();
        let mut config = haproxy_config(&dir);
        config.haproxy.shared_ports = [shared].into();
        let dataplane = DataPlane::new(config);
        let on_shared = |id: &str, vip| {
            lb(
                id,
                vip,
                vec![listener(Protocol::Tcp, shared, backend_port, None)],
                vec![a],
            )
        };
        let first = on_shared("lb-first", first_vip);
        dataplane.apply(vec![first.clone()]).await.unwrap();
        assert_eq!(tcp_hello(None, first_vip, shared).await.unwrap().1, "a");
        let second = on_shared("lb-second", second_vip);
        dataplane.apply(vec![first, second]).await.unwrap();
        assert_eq!(tcp_hello(None, second_vip, shared).await.unwrap().1, "a");
        let config = read_config(&dir);
        assert!(
            config.contains(&format!("bind {first_vip}:{shared}\n"))
                && config.contains(&format!("bind {second_vip}:{shared}\n")),
            "{config}"
        );
        let text = metrics_text(&dataplane);
        assert_eq!(
            counter(
                &text,
                r#"cloud_mock_haproxy_reload_reasons_total{reason="new_frontend"}"#
            ),
            2,
            "{text}"
        );
        let (accepted, _) = tokio::join!(
            holder.accept(),
            tokio::net::TcpStream::connect((holder_ip, shared))
        );
        assert!(accepted.is_ok(), "the other socket keeps its address");
        dataplane.shutdown().await;
    });
}

/// A new load balancer on a port HAProxy binds already is a map entry, its servers and
/// its source ranges, all at run time; so are its source ranges changing and a load
/// balancer going. The files hold all of it: HAProxy killed and started again from them,
/// and a reload for a new port, serve the same.
#[test]
fn a_new_load_balancer_on_a_bound_port_is_served_without_a_reload_and_rebuilt_from_the_files() {
    in_own_netns('n', "bound", |dir| async move {
        let (first_vip, second_vip, third_vip) = (addr(227, 1), addr(227, 2), addr(227, 3));
        let (a, b) = (addr(227, 11), addr(227, 12));
        let (inside, outside) = (addr(227, 100), addr(227, 101));
        let (backend_port, _servers) = backends_a_and_b(a, b).await;
        let port = free_port(first_vip).await;
        let dataplane = DataPlane::new(haproxy_config(&dir));
        let on_port = |id: &str, vip, port, node| {
            lb(
                id,
                vip,
                vec![listener(Protocol::Tcp, port, backend_port, None)],
                vec![node],
            )
        };
        let first = on_port("lb-first", first_vip, port, a);
        dataplane.apply(vec![first.clone()]).await.unwrap();
        assert_eq!(tcp_hello(None, first_vip, port).await.unwrap().1, "a");
        let new_frontends = r#"cloud_mock_haproxy_reload_reasons_total{reason="new_frontend"}"#;
        let text = metrics_text(&dataplane);
        assert_eq!(counter(&text, new_frontends), 1, "{text}");
        let before = counter(&text, RELOADS_OK);

        // Served as soon as apply returns, without a reload.
        let mut second = on_port("lb-second", second_vip, port, b);
        dataplane
            .apply(vec![first.clone(), second.clone()])
            .await
            .unwrap();
        assert_eq!(tcp_hello(None, second_vip, port).await.unwrap().1, "b");
        assert_eq!(tcp_hello(None, first_vip, port).await.unwrap().1, "a");
        assert_changed_at_run_time(&dataplane, before, "a load balancer on a bound port");
        let config = read_config(&dir);
        assert!(
            config.contains(&format!("server {b} {b}:{backend_port}\n")),
            "{config}"
        );
        let map = std::fs::read_to_string(dir.join(format!("port-{port}-v4.map"))).unwrap();
        assert!(
            map.contains(&format!("{first_vip} backend-"))
                && map.contains(&format!("{second_vip} backend-")),
            "{map}"
        );
        assert!(
            tcp_hello(None, third_vip, port).await.is_err(),
            "a local address no load balancer has is refused on the bound port"
        );

        // Its source ranges change in place; the first one goes.
        second.source_ranges = vec![format!("{inside}/32").parse().unwrap()];
        dataplane.apply(vec![second.clone()]).await.unwrap();
        assert_eq!(
            tcp_hello(Some(inside), second_vip, port).await.unwrap().1,
            "b"
        );
        assert!(tcp_hello(Some(outside), second_vip, port).await.is_err());
        assert!(tcp_hello(None, first_vip, port).await.is_err(), "gone");
        assert_changed_at_run_time(
            &dataplane,
            before,
            "source ranges and a load balancer going",
        );

        // Killed, HAProxy is started again from the files: the same state serves.
        for pid in haproxy_pids(&dir.join("haproxy.cfg")) {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            )
            .unwrap();
        }
        wait_for_async("traffic again", Duration::from_secs(10), || async {
            tcp_hello(Some(inside), second_vip, port).await.is_ok()
        })
        .await;
        assert!(tcp_hello(Some(outside), second_vip, port).await.is_err());
        assert!(tcp_hello(None, first_vip, port).await.is_err());

        // A new port takes a reload, which rebuilds the same state from the files too.
        let other_port = free_port(third_vip).await;
        let third = on_port("lb-third", third_vip, other_port, a);
        dataplane.apply(vec![second, third]).await.unwrap();
        assert_eq!(tcp_hello(None, third_vip, other_port).await.unwrap().1, "a");
        assert_eq!(
            tcp_hello(Some(inside), second_vip, port).await.unwrap().1,
            "b"
        );
        assert!(tcp_hello(Some(outside), second_vip, port).await.is_err());
        let text = metrics_text(&dataplane);
        assert_eq!(counter(&text, new_frontends), 2, "{text}");
        assert_eq!(counter(&text, RELOADS_OK), before + 1, "{text}");
        dataplane.shutdown().await;
    });
}

/// An IPv6 VIP has a frontend of its own family on the port (`[::]:PORT v6only`), beside
/// the IPv4 one; a second IPv6 VIP on it is a map entry of that frontend.
#[test]
fn ipv6_vips_have_a_frontend_of_their_own_family() {
    in_own_netns('i', "ipv6", |dir| async move {
        let vips: [IpAddr; 2] = [
            "2001:db8:51:100::7".parse().unwrap(),
            "2001:db8:51:100::8".parse().unwrap(),
        ];
        for vip in vips {
            ip_async(&[
                "address",
                "add",
                &format!("{vip}/128"),
                "dev",
                "lo",
                "nodad",
            ])
            .await;
        }
        let node: IpAddr = "::1".parse().unwrap();
        let (v4_vip, v4_node) = (addr(228, 1), addr(228, 11));
        let (backend_port, listeners) = listen_on_all(&[node, v4_node]).await;
        let _servers: Vec<Server> = listeners
            .into_iter()
            .zip(["six", "four"])
            .map(|(listener, name)| greet_on(listener, name))
            .collect();
        let port = free_port(v4_vip).await;
        let dataplane = DataPlane::new(haproxy_config(&dir));
        let on = |id: &str, vip, node| {
            lb(
                id,
                vip,
                vec![listener(Protocol::Tcp, port, backend_port, None)],
                vec![node],
            )
        };
        let mut lbs = vec![on("lb-four", v4_vip, v4_node), on("lb-six", vips[0], node)];
        dataplane.apply(lbs.clone()).await.unwrap();
        assert_eq!(tcp_hello(None, vips[0], port).await.unwrap().1, "six");
        assert_eq!(tcp_hello(None, v4_vip, port).await.unwrap().1, "four");
        let config = read_config(&dir);
        assert!(
            config.contains(&format!(
                "frontend port-{port}-v6\n    bind [::]:{port} v6only\n"
            )),
            "{config}"
        );
        let before = counter(&metrics_text(&dataplane), RELOADS_OK);
        lbs.push(on("lb-six-too", vips[1], node));
        dataplane.apply(lbs).await.unwrap();
        assert_eq!(tcp_hello(None, vips[1], port).await.unwrap().1, "six");
        assert_changed_at_run_time(&dataplane, before, "a second IPv6 VIP on the port");
        dataplane.shutdown().await;
    });
}
