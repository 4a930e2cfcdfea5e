//! Kernel tests of the virtual cluster (root only): real namespaces, veths, routes and
//! processes. Each test builds its own topology with its own prefix.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tandem_netlab::{EchoClient, Netns, Topology, list_netns, remove_stale_namespaces};

const ECHO: &str = env!("CARGO_BIN_EXE_tandem-echo");

fn topology(pods_per_node: &[u32]) -> Topology {
    Topology::builder()
        .nodes(pods_per_node.len())
        .pods_per_node(pods_per_node)
        .echo_binary(ECHO)
        .build()
        .unwrap()
}

fn client() -> EchoClient {
    EchoClient::new(ECHO).with_timeout(Duration::from_millis(1500))
}

fn namespaces_with(prefix: &str) -> Vec<String> {
    let own = format!("{prefix}-");
    list_netns()
        .unwrap()
        .into_iter()
        .filter(|n| n.starts_with(&own))
        .collect()
}

fn root_links() -> String {
    let out = Command::new("ip").args(["-o", "link"]).output().unwrap();
    String::from_utf8(out.stdout).unwrap()
}

/// Pids of every process inside the namespaces of `prefix`.
fn pids_in(prefix: &str) -> Vec<i32> {
    namespaces_with(prefix)
        .iter()
        .flat_map(|ns| {
            let out = Command::new("ip")
                .args(["netns", "pids", ns])
                .output()
                .unwrap();
            String::from_utf8(out.stdout)
                .unwrap()
                .split_whitespace()
                .map(|p| p.parse().unwrap())
                .collect::<Vec<i32>>()
        })
        .collect()
}

/// Alive = exists and is not a zombie waiting for init.
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            stat.rsplit(')')
                .next()
                .is_some_and(|rest| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn assert_all_gone(prefix: &str, pids: &[i32], links_before: &str) {
    assert!(
        namespaces_with(prefix).is_empty(),
        "namespaces left: {:?}",
        namespaces_with(prefix)
    );
    wait_until("processes to die", || pids.iter().all(|&p| !alive(p)));
    let links = root_links();
    assert!(
        !links.contains(prefix),
        "root namespace has links of {prefix}: {links}"
    );
    assert_eq!(
        links.lines().count(),
        links_before.lines().count(),
        "root links changed"
    );
}

#[test]
fn pods_reach_pods_on_other_nodes_over_http_and_udp_without_nat() {
    let topo = topology(&[2, 1]);
    let src = topo.pods_on(1).next().unwrap();
    let same_node = topo.pods_on(1).nth(1).unwrap();
    let other_node = topo.pods_on(2).next().unwrap();
    let port = topo.echo_http_port();
    for dst in [other_node, same_node] {
        let reply = client()
            .http_get(&src.netns, &format!("http://{}:{port}/", dst.ip))
            .unwrap();
        assert_eq!(reply.pod, dst.name);
        assert_eq!(reply.node.as_deref(), Some(dst.node_name.as_str()));
        assert_eq!(reply.client.ip(), src.ip, "pod-to-pod traffic is not NATed");

        let addr = SocketAddr::from((dst.ip, topo.echo_udp_port()));
        let reply = client().udp_request(&src.netns, addr).unwrap();
        assert_eq!(reply.pod, dst.name);
        assert_eq!(reply.client.ip(), src.ip);
    }
    // And back the other way, many times, each on a new connection / source port.
    let back = client()
        .http_get_many(&other_node.netns, &format!("http://{}:{port}/", src.ip), 20)
        .unwrap();
    assert_eq!(back.len(), 20);
    assert!(back.iter().all(|r| r.as_ref().unwrap().pod == src.name));
    let ports: std::collections::HashSet<u16> = back
        .iter()
        .map(|r| r.as_ref().unwrap().client.port())
        .collect();
    assert_eq!(ports.len(), 20, "every request used a new connection");
}

#[test]
fn external_clients_cannot_reach_pod_ips_but_the_edge_reaches_nodes() {
    let topo = topology(&[1, 1]);
    let pod = &topo.pods()[1];
    let start = Instant::now();
    for c in [topo.client_in_range(), topo.client_out_of_range()] {
        let http = client().http_get(
            &c.netns,
            &format!("http://{}:{}/", pod.ip, topo.echo_http_port()),
        );
        assert!(http.is_err(), "{} reached pod {}: {http:?}", c.ip, pod.ip);
        let udp = client().udp_request(&c.netns, SocketAddr::from((pod.ip, topo.echo_udp_port())));
        assert!(udp.is_err(), "{} reached pod {} over UDP", c.ip, pod.ip);
    }
    // The edge itself has no route to pods either.
    assert!(
        client()
            .http_get(&topo.edge().netns, &format!("http://{}:8080/", pod.ip))
            .is_err()
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "prohibited routes fail fast"
    );

    // Host-network servers on the nodes are reachable from the edge, from the control
    // plane, and from pods; the clients reach the edge.
    for node in topo.nodes() {
        let _server = topo.spawn_echo(&node.netns, &node.name).unwrap();
        let url = format!("http://{}:{}/", node.ip, topo.echo_http_port());
        for from in [&topo.edge().netns, &topo.control_plane().netns, &pod.netns] {
            let reply = client().http_get(from, &url).unwrap();
            assert_eq!(reply.pod, node.name);
        }
        let reply = client().http_get(&topo.edge().netns, &url).unwrap();
        assert_eq!(reply.client.ip(), topo.edge().node_network_ip);
    }
    let edge_server = topo.spawn_echo(&topo.edge().netns, "edge").unwrap();
    for c in [topo.client_in_range(), topo.client_out_of_range()] {
        let reply = client()
            .http_get(&c.netns, "http://198.18.0.1:8080/")
            .unwrap();
        assert_eq!(
            reply.client.ip(),
            c.ip,
            "clients reach the edge with their own address"
        );
    }
    drop(edge_server);
}

#[test]
fn pods_come_and_go() {
    let mut topo = topology(&[1, 0]);
    let src = topo.pods()[0].clone();
    let added = topo.add_pod(2).unwrap();
    assert_eq!(added.name, "n2p1");
    assert_eq!(added.ip.to_string(), "10.244.2.2");
    let url = format!("http://{}:{}/", added.ip, topo.echo_http_port());
    assert_eq!(client().http_get(&src.netns, &url).unwrap().pod, "n2p1");

    let removed = topo.remove_pod("n2p1").unwrap();
    assert!(
        !list_netns()
            .unwrap()
            .contains(&removed.netns.name().to_owned())
    );
    assert!(client().http_get(&src.netns, &url).is_err());
    assert!(topo.remove_pod("n2p1").is_err());

    // Indices are not reused: a new pod gets a new address.
    let again = topo.add_pod(2).unwrap();
    assert_eq!(again.ip.to_string(), "10.244.2.3");
    assert_eq!(
        client()
            .http_get(&src.netns, &format!("http://{}:8080/", again.ip))
            .unwrap()
            .pod,
        "n2p2"
    );
}

#[test]
fn drop_removes_every_namespace_link_and_process() {
    let links_before = root_links();
    let topo = topology(&[2, 2, 1]);
    let prefix = topo.prefix().to_owned();
    assert_eq!(namespaces_with(&prefix).len(), 5 + 3 + 5);
    let extra = topo.spawn_echo(&topo.control_plane().netns, "cp").unwrap();
    let pids = pids_in(&prefix);
    assert_eq!(pids.len(), 6, "five pod echoes and one extra server");
    // A guard outliving its topology is harmless.
    drop(topo);
    assert_all_gone(&prefix, &pids, &links_before);
    drop(extra);
}

#[test]
fn a_panicking_test_leaves_nothing_behind() {
    let links_before = root_links();
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::panic::catch_unwind(move || {
        let topo = topology(&[1, 1]);
        tx.send((topo.prefix().to_owned(), pids_in(topo.prefix())))
            .unwrap();
        panic!("test failure inside a topology");
    });
    assert!(result.is_err());
    let (prefix, pids) = rx.recv().unwrap();
    assert_eq!(pids.len(), 2);
    assert_all_gone(&prefix, &pids, &links_before);
}

const CHILD_ENV: &str = "TANDEM_NETLAB_TEST_CHILD";

/// The tests with child processes run one at a time: a child starting up removes stale
/// namespaces, which would race with the stale-namespace test's own check.
static CHILD_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn child_test_lock() -> std::sync::MutexGuard<'static, ()> {
    CHILD_TESTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Not a test on its own: the process that `sigterm_*` and `stale_*` start, kill and
/// inspect. It builds a topology, reports its prefix, and waits (bounded) to be killed.
#[test]
#[ignore = "helper process started by other tests"]
fn child_process_holding_a_topology() {
    assert!(
        std::env::var_os(CHILD_ENV).is_some(),
        "run only by other tests"
    );
    let topo = topology(&[1, 1]);
    println!("PREFIX {}", topo.prefix());
    std::thread::sleep(Duration::from_secs(20));
    panic!("nobody killed this child within 20 s");
}

/// Starts the child test and returns it with its topology prefix.
fn start_child() -> (std::process::Child, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_process_holding_a_topology",
            "--ignored",
            "--nocapture",
        ])
        .env(CHILD_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let prefix = BufReader::new(stdout)
        .lines()
        .map(|l| l.unwrap())
        .find_map(|l| l.strip_prefix("PREFIX ").map(str::to_owned))
        .expect("child reported no prefix");
    (child, prefix)
}

fn wait_exit(child: &mut std::process::Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("child did not exit");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_and_sigint_remove_the_topology_and_exit_with_128_plus_signal() {
    let _serial = child_test_lock();
    let links_before = root_links();
    for (signal, code) in [(Signal::SIGTERM, 143), (Signal::SIGINT, 130)] {
        let (mut child, prefix) = start_child();
        let pids = pids_in(&prefix);
        assert_eq!(pids.len(), 2, "two pod echoes run");
        kill(Pid::from_raw(child.id() as i32), signal).unwrap();
        let status = wait_exit(&mut child);
        assert_eq!(status.code(), Some(code), "{signal}");
        assert_all_gone(&prefix, &pids, &links_before);
    }
}

#[test]
fn namespaces_and_processes_of_a_killed_run_are_removed_as_stale() {
    let _serial = child_test_lock();
    // This process's own start-up cleanup must be over before the child dies, or it could
    // remove the child's namespaces before the check below.
    drop(
        Topology::builder()
            .nodes(1)
            .pods_per_node(&[0])
            .without_echo()
            .build()
            .unwrap(),
    );
    let (mut child, prefix) = start_child();
    let pids = pids_in(&prefix);
    kill(Pid::from_raw(child.id() as i32), Signal::SIGKILL).unwrap();
    wait_exit(&mut child);
    // SIGKILL allows no cleanup: everything is still there, owned by a dead pid.
    assert_eq!(namespaces_with(&prefix).len(), 5 + 2 + 2);
    assert!(pids.iter().all(|&p| alive(p)));

    let removed = remove_stale_namespaces().unwrap();
    assert!(
        removed
            .iter()
            .filter(|n| n.starts_with(&format!("{prefix}-")))
            .count()
            == 9,
        "{removed:?}"
    );
    assert!(namespaces_with(&prefix).is_empty());
    wait_until("stale processes to die", || pids.iter().all(|&p| !alive(p)));
}

#[test]
fn processes_run_inside_their_namespace() {
    let topo = topology(&[1]);
    let pod = &topo.pods()[0];
    let addrs = pod
        .netns
        .exec_checked(["ip", "-4", "-o", "addr", "show", "dev", "eth0"])
        .unwrap();
    assert!(addrs.contains(&format!("{}/24", pod.ip)), "{addrs}");
    let route = pod
        .netns
        .exec_checked(["ip", "route", "show", "default"])
        .unwrap();
    assert!(route.contains("via 10.244.1.1"), "{route}");
    // In-process threads can enter a namespace too.
    let local = pod
        .netns
        .run_in_thread(|| {
            std::net::TcpListener::bind("10.244.1.2:0").map(|l| l.local_addr().is_ok())
        })
        .unwrap();
    assert!(
        local.unwrap(),
        "the pod address is local only inside the pod"
    );
    assert!(
        std::net::TcpListener::bind("10.244.1.2:0").is_err(),
        "and not in the root namespace"
    );
    assert!(
        Netns::attach("tdm-missing-ns")
            .run_in_thread(|| ())
            .is_err()
    );
}
