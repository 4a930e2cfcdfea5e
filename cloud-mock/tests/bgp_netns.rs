#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Two edges announcing one VIP by BGP with BFD to a router, with real packets and a real
//! BGP speaker (Debian's BIRD 2) on every host (root only; every host a network namespace
//! of this test, removed at the end):
//!
//! ```text
//! client 203.0.113.10 ── router (BIRD: ECMP over the edges, BFD) ──┬── edge 1 (cloud-mock + BIRD) ──┐
//!                                                                  └── edge 2 (cloud-mock + BIRD) ──┴── node 198.18.0.11
//! ```
//!
//! Each edge runs the `cloud-mock` binary with `--announce-table`: it writes a route for
//! every VIP it can forward into that table, which its BIRD exports. The router spreads the
//! VIP's flows over both edges. An edge killed outright (its processes: the host is gone)
//! is taken out of the router's routes by BFD within a second; an edge that is stopped
//! (SIGTERM) withdraws its VIP first and keeps serving through its drain, so no request
//! fails.

#[path = "../dataplane/tests/support/mod.rs"]
mod support;

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::netns::{Namespaces, bind_in, block_on_in_netns, ip, is_root};
use support::{greet_on, tcp_hello};

const VIP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
const NODE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 11);
const NODE_PORT: u16 = 30080;
const CLIENT: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const TOKEN: &str = "bgp-test-token";
/// The kernel table each edge announces from.
const ANNOUNCE_TABLE: &str = "100";

/// A process of the test, killed (by its PID) when dropped: also when the test fails.
struct Process(Child);

impl Process {
    fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).unwrap_or(i32::MAX))
    }

    /// SIGKILL, and wait for it to end.
    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The hosts of one run and their files.
struct Hosts {
    namespaces: Namespaces,
    dir: PathBuf,
}

impl Hosts {
    fn name(&self, host: &str) -> String {
        self.namespaces.name(host)
    }

    fn create() -> Self {
        let namespaces = Namespaces::create("bgp", &["c", "r", "e1", "e2", "n"]);
        let dir = std::env::temp_dir().join(namespaces.name("files"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let hosts = Self { namespaces, dir };
        hosts.link("c", "eth0", "203.0.113.10/24", "r", "c0", "203.0.113.1/24");
        hosts.link("e1", "up0", "198.19.1.2/24", "r", "e1", "198.19.1.1/24");
        hosts.link("e2", "up0", "198.19.2.2/24", "r", "e2", "198.19.2.1/24");
        // The node's side is a bridge, so both edges share its one address.
        let node = hosts.name("n");
        ip(&["-n", &node, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &node, "addr", "add", "198.18.0.11/24", "dev", "br0"]);
        ip(&["-n", &node, "link", "set", "br0", "up"]);
        for (edge, address) in [("e1", "198.18.0.1/24"), ("e2", "198.18.0.2/24")] {
            let (outer, inner) = (format!("{edge}n"), format!("n{edge}"));
            ip(&[
                "link",
                "add",
                &outer,
                "netns",
                &hosts.name(edge),
                "type",
                "veth",
                "peer",
                "name",
                &inner,
                "netns",
                &node,
            ]);
            ip(&[
                "-n",
                &hosts.name(edge),
                "link",
                "set",
                &outer,
                "name",
                "down0",
            ]);
            ip(&[
                "-n",
                &hosts.name(edge),
                "addr",
                "add",
                address,
                "dev",
                "down0",
            ]);
            ip(&["-n", &hosts.name(edge), "link", "set", "down0", "up"]);
            ip(&["-n", &node, "link", "set", &inner, "master", "br0", "up"]);
        }
        ip(&[
            "-n",
            &hosts.name("c"),
            "route",
            "add",
            "default",
            "via",
            "203.0.113.1",
        ]);
        ip(&[
            "-n",
            &hosts.name("e1"),
            "route",
            "add",
            "default",
            "via",
            "198.19.1.1",
        ]);
        ip(&[
            "-n",
            &hosts.name("e2"),
            "route",
            "add",
            "default",
            "via",
            "198.19.2.1",
        ]);
        for sysctl in [
            "net.ipv4.ip_forward=1",
            "net.ipv4.fib_multipath_hash_policy=1",
        ] {
            let done = Command::new("ip")
                .args(["netns", "exec", &hosts.name("r"), "sysctl", "-qw", sysctl])
                .status()
                .unwrap();
            assert!(done.success(), "{sysctl}");
        }
        hosts
    }

    /// A veth pair between two hosts, addressed and up.
    fn link(&self, a: &str, a_dev: &str, a_addr: &str, b: &str, b_dev: &str, b_addr: &str) {
        let (a_ns, b_ns) = (self.name(a), self.name(b));
        let (tmp_a, tmp_b) = (format!("t{a}{b}"), format!("u{a}{b}"));
        ip(&[
            "link", "add", &tmp_a, "netns", &a_ns, "type", "veth", "peer", "name", &tmp_b, "netns",
            &b_ns,
        ]);
        ip(&["-n", &a_ns, "link", "set", &tmp_a, "name", a_dev]);
        ip(&["-n", &b_ns, "link", "set", &tmp_b, "name", b_dev]);
        ip(&["-n", &a_ns, "addr", "add", a_addr, "dev", a_dev]);
        ip(&["-n", &b_ns, "addr", "add", b_addr, "dev", b_dev]);
        ip(&["-n", &a_ns, "link", "set", a_dev, "up"]);
        ip(&["-n", &b_ns, "link", "set", b_dev, "up"]);
    }

    /// Starts `program args` in `host`, its output in a log file of the run.
    fn spawn(&self, host: &str, log: &str, program: &Path, args: &[&str]) -> Process {
        let log = std::fs::File::create(self.dir.join(log)).unwrap();
        // `ip netns exec` execs the program: the child's PID is the program's.
        let child = Command::new("ip")
            .args(["netns", "exec", &self.name(host)])
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        Process(child)
    }

    /// Starts BIRD in `host` with `config`.
    fn bird(&self, host: &str, config: &str) -> Process {
        let path = self.dir.join(format!("bird-{host}.conf"));
        std::fs::write(&path, config).unwrap();
        let socket = self.dir.join(format!("bird-{host}.ctl"));
        self.spawn(
            host,
            &format!("bird-{host}.log"),
            Path::new("bird"),
            &[
                "-f",
                "-c",
                path.to_str().unwrap(),
                "-s",
                socket.to_str().unwrap(),
            ],
        )
    }

    /// What each BIRD says of its sessions, the edges' announcement tables and the
    /// router's routes: what a failed wait prints.
    fn diagnostics(&self) -> String {
        let mut out = String::new();
        for host in ["r", "e1", "e2"] {
            let socket = self.dir.join(format!("bird-{host}.ctl"));
            let birdc = Command::new("birdc")
                .args([
                    "-s",
                    socket.to_str().unwrap_or_default(),
                    "show",
                    "protocols",
                ])
                .output();
            let said = birdc.map_or_else(
                |e| e.to_string(),
                |o| String::from_utf8_lossy(&o.stdout).into_owned(),
            );
            out.push_str(&format!("--- {host}: birdc show protocols\n{said}"));
            let log = std::fs::read_to_string(self.dir.join(format!("bird-{host}.log")))
                .unwrap_or_default();
            out.push_str(&format!(
                "--- {host}: bird log (tail)\n{}\n",
                tail(&log, 10)
            ));
            if host != "r" {
                let table = ip(&[
                    "-n",
                    &self.name(host),
                    "route",
                    "show",
                    "table",
                    ANNOUNCE_TABLE,
                ]);
                out.push_str(&format!("--- {host}: table {ANNOUNCE_TABLE}\n{table}"));
                let log = std::fs::read_to_string(self.dir.join(format!("cloud-mock-{host}.log")))
                    .unwrap_or_default();
                out.push_str(&format!(
                    "--- {host}: cloud-mock log (tail)\n{}\n",
                    tail(&log, 8)
                ));
            }
        }
        out.push_str(&format!(
            "--- r: routes\n{}",
            ip(&["-n", &self.name("r"), "route"])
        ));
        out
    }

    /// Drops every packet into and out of `host` (`frozen`), or stops dropping them.
    fn freeze(&self, host: &str, frozen: bool) {
        let rules = if frozen {
            "table inet freeze {\n chain in { type filter hook input priority -500; policy drop; }\n \
             chain out { type filter hook output priority -500; policy drop; }\n}\n"
        } else {
            "delete table inet freeze\n"
        };
        let mut nft = Command::new("ip")
            .args(["netns", "exec", &self.name(host), "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut nft.stdin.take().unwrap(), rules.as_bytes()).unwrap();
        assert!(nft.wait().unwrap().success(), "nft in {host}");
    }

    /// Packets received on `device` of `host`.
    fn rx_packets(&self, host: &str, device: &str) -> u64 {
        let json = ip(&["-n", &self.name(host), "-j", "-s", "link", "show", device]);
        let links: serde_json::Value = serde_json::from_str(&json).unwrap();
        links[0]["stats64"]["rx"]["packets"].as_u64().unwrap()
    }

    /// The router's next hops for the VIP.
    fn next_hops(&self) -> usize {
        let routes = ip(&["-n", &self.name("r"), "route", "show", &VIP.to_string()]);
        let hops = routes.matches("nexthop via").count();
        if hops == 0 && routes.contains(" via ") {
            1
        } else {
            hops
        }
    }
}

impl Drop for Hosts {
    // The namespaces go with their guard.
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn router_config() -> String {
    let mut config = String::from(
        "router id 198.19.0.1;\n\
         protocol device { scan time 1; }\n\
         protocol bfd { interface \"*\" { min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }; }\n\
         protocol kernel { ipv4 { import none; export all; }; merge paths on; }\n",
    );
    for edge in [1, 2] {
        config.push_str(&format!(
            "protocol bgp edge{edge} {{ local 198.19.{edge}.1 as 64500; neighbor 198.19.{edge}.2 as 64512; \
             bfd on; hold time 3; connect retry time 1; error wait time 1, 10; ipv4 {{ import all; export none; }}; }}\n"
        ));
    }
    config
}

fn edge_config(edge: u8) -> String {
    format!(
        "router id 198.19.{edge}.2;\n\
         protocol device {{ scan time 1; }}\n\
         ipv4 table announced;\n\
         protocol kernel announce {{ ipv4 {{ table announced; import all; export none; }}; kernel table {ANNOUNCE_TABLE}; learn; scan time 1; }}\n\
         protocol bfd {{ interface \"*\" {{ min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }}; }}\n\
         protocol bgp uplink {{ local 198.19.{edge}.2 as 64512; neighbor 198.19.{edge}.1 as 64500; \
         bfd on; hold time 3; connect retry time 1; error wait time 1, 10; ipv4 {{ table announced; import none; export all; next hop self; }}; }}\n"
    )
}

/// One edge: cloud-mock and its BIRD.
struct Edge {
    cloud_mock: Process,
    bird: Process,
}

impl Edge {
    fn start(hosts: &Hosts, edge: u8) -> Self {
        let host = format!("e{edge}");
        let data_dir = hosts.dir.join(format!("data-{host}"));
        let data_dir = data_dir.to_str().unwrap().to_owned();
        let cloud_mock = hosts.spawn(
            &host,
            &format!("cloud-mock-{host}.log"),
            Path::new(env!("CARGO_BIN_EXE_cloud-mock")),
            &[
                "--listen",
                "127.0.0.1:8780",
                "--data-dir",
                &data_dir,
                "--token",
                TOKEN,
                "--vip-pool",
                "198.51.100.0/24",
                "--dataplane",
                "proxy",
                "--manage-vip-addresses",
                "--provisioning-delay",
                "0s",
                "--health-interval",
                "200ms",
                "--announce-table",
                ANNOUNCE_TABLE,
                "--drain-delay",
                "2s",
            ],
        );
        let bird = hosts.bird(&host, &edge_config(edge));
        Self { cloud_mock, bird }
    }

    /// The host is gone: every process of the edge killed at once.
    fn kill(mut self) {
        self.cloud_mock.kill();
        self.bird.kill();
    }

    /// A planned stop: SIGTERM to cloud-mock, which withdraws and drains; then BIRD.
    fn stop(mut self) -> Duration {
        let started = Instant::now();
        nix::sys::signal::kill(self.cloud_mock.pid(), nix::sys::signal::Signal::SIGTERM).unwrap();
        let _ = self.cloud_mock.0.wait();
        let stopped = started.elapsed();
        self.bird.kill();
        stopped
    }
}

/// Creates the VIP's load balancer on an edge through its API (curl inside the edge).
fn create_lb(hosts: &Hosts, edge: u8) {
    let body = serde_json::json!({
        "name": "web", "tags": {}, "mode": "proxy", "vip": VIP.to_string(),
        "listeners": [{"protocol": "TCP", "port": 80, "backendPort": NODE_PORT,
                       "healthCheck": {"protocol": "TCP", "port": NODE_PORT}}],
        "backends": [{"ip": NODE.to_string()}],
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let output = Command::new("ip")
            .args([
                "netns",
                "exec",
                &hosts.name(&format!("e{edge}")),
                "curl",
                "-sS",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
            ])
            .args(["-X", "POST", "http://127.0.0.1:8780/v1/loadbalancers"])
            .args([
                "-H",
                &format!("Authorization: Bearer {TOKEN}"),
                "-H",
                "Content-Type: application/json",
            ])
            .args(["-H", "Idempotency-Key: web"])
            .args(["--data", &body.to_string()])
            .output()
            .unwrap();
        let code = String::from_utf8_lossy(&output.stdout).into_owned();
        if code == "201" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "edge {edge} did not create the LB: {code} {}",
            String::from_utf8_lossy(&output.stderr)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn wait_for_hops(hosts: &Hosts, wanted: usize, within: Duration) -> Duration {
    let started = Instant::now();
    while hosts.next_hops() != wanted {
        assert!(
            started.elapsed() < within,
            "the router has {} next hops for the VIP, not {wanted}:\n{}",
            hosts.next_hops(),
            hosts.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    started.elapsed()
}

/// How long a client waits for a new connection's answer.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(300);

/// How long the traffic runs before `during` starts.
const LEAD: Duration = Duration::from_millis(500);

/// What the client saw while `during` ran: new connections every 10 ms for `span`.
struct Traffic {
    failed: usize,
    sent: usize,
    /// When the router had one next hop left, from the moment `during` was done.
    one_hop: Option<Duration>,
    /// When the first and the last failed connection gave up, from the moment `during` was
    /// done (the fault in place): a loaded machine may take a while to put it there.
    first_failure: Option<Duration>,
    last_failure: Option<Duration>,
}

impl Traffic {
    /// The router dropped the lost edge within `bound`, and no connection failed that
    /// started after it had: only those in flight to the lost edge (each gives up after
    /// [`CONNECT_TIMEOUT`]).
    fn assert_routed_around_within(&self, bound: Duration) {
        let one_hop = self.one_hop.expect("the router kept both next hops");
        assert!(one_hop <= bound, "routed around after {one_hop:?}");
        assert!(
            self.last_failure
                .is_none_or(|last| last <= one_hop + CONNECT_TIMEOUT + Duration::from_millis(100)),
            "a connection failed at {:?}, after the router had moved at {one_hop:?}",
            self.last_failure
        );
    }

    fn report(&self, what: &str) {
        println!(
            "{what}: the router had one next hop {:?} after; {} of {} new connections failed, \
             the first {:?} and the last {:?} after",
            self.one_hop, self.failed, self.sent, self.first_failure, self.last_failure
        );
    }
}

fn traffic_while(hosts: &Hosts, span: Duration, during: impl FnOnce() + Send) -> Traffic {
    let client_ns = hosts.name("c");
    let started = Instant::now();
    std::thread::scope(|scope| {
        let load = scope.spawn(move || {
            let mut failures = Vec::new();
            let mut sent = 0;
            block_on_in_netns(&client_ns, || async {
                while started.elapsed() < span {
                    sent += 1;
                    let hello = tcp_hello(Some(IpAddr::V4(CLIENT)), IpAddr::V4(VIP), 80);
                    let answered = tokio::time::timeout(CONNECT_TIMEOUT, hello).await;
                    if !matches!(answered, Ok(Ok((_, ref reply))) if reply.trim() == "node") {
                        failures.push(started.elapsed());
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            });
            (failures, sent)
        });
        std::thread::sleep(LEAD);
        during();
        let in_place = started.elapsed();
        let mut one_hop = None;
        while one_hop.is_none() && started.elapsed() < span {
            if hosts.next_hops() == 1 {
                one_hop = Some(started.elapsed() - in_place);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let (failures, sent) = load.join().unwrap();
        let after = |at: &Duration| at.saturating_sub(in_place);
        Traffic {
            failed: failures.len(),
            sent,
            one_hop,
            first_failure: failures.first().map(after),
            last_failure: failures.last().map(after),
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_lost_is_routed_around_within_a_second_and_a_drained_one_drops_nothing() {
    if !is_root() {
        eprintln!("skipped: needs root (network namespaces)");
        return;
    }
    assert!(
        Command::new("bird").arg("--version").output().is_ok(),
        "install Debian's bird2 (bash .ci/run does)"
    );
    let hosts = Hosts::create();
    let node = greet_on(
        tokio::net::TcpListener::from_std(bind_in(&hosts.name("n"), IpAddr::V4(NODE), NODE_PORT))
            .unwrap(),
        "node",
    );
    let router = hosts.bird("r", &router_config());
    let edge1 = Edge::start(&hosts, 1);
    let edge2 = Edge::start(&hosts, 2);
    create_lb(&hosts, 1);
    create_lb(&hosts, 2);
    wait_for_hops(&hosts, 2, Duration::from_secs(30));

    // Both edges carry the VIP's flows.
    let before = [hosts.rx_packets("e1", "up0"), hosts.rx_packets("e2", "up0")];
    let spread = traffic_while(&hosts, Duration::from_secs(1), || {});
    assert_eq!(spread.failed, 0);
    let carried = [
        hosts.rx_packets("e1", "up0") - before[0],
        hosts.rx_packets("e2", "up0") - before[1],
    ];
    assert!(
        carried
            .iter()
            .all(|&packets| packets > spread.sent as u64 / 2),
        "packets per edge: {carried:?} for {} connections",
        spread.sent
    );

    // Edge 1's host falls silent under traffic (every packet in and out of it dropped, as
    // when a host hangs or its cable is cut past the switch): only BFD can tell.
    let silent = traffic_while(&hosts, Duration::from_secs(4), || hosts.freeze("e1", true));
    silent.report("edge silent");
    assert_eq!(hosts.next_hops(), 1);
    assert!(
        silent.failed > 0,
        "flows were hashed to the silent edge until BFD took it out"
    );
    silent.assert_routed_around_within(Duration::from_secs(1));
    hosts.freeze("e1", false);
    wait_for_hops(&hosts, 2, Duration::from_secs(30));

    // Edge 1's processes are killed: their sessions close, and the router moves at once.
    let killed = traffic_while(&hosts, Duration::from_secs(3), || edge1.kill());
    killed.report("edge killed");
    assert_eq!(hosts.next_hops(), 1);
    killed.assert_routed_around_within(Duration::from_secs(1));

    // Edge 1 back; then edge 2 drained: it withdraws, serves through its drain, stops.
    let edge1 = Edge::start(&hosts, 1);
    create_lb(&hosts, 1);
    wait_for_hops(&hosts, 2, Duration::from_secs(30));
    let mut drain = Duration::ZERO;
    let drained = traffic_while(&hosts, Duration::from_secs(4), || {
        drain = edge2.stop();
    });
    println!(
        "edge drained in {drain:?}: {} of {} new connections failed",
        drained.failed, drained.sent
    );
    assert_eq!(drained.failed, 0, "a drain drops nothing");
    assert_eq!(hosts.next_hops(), 1);
    edge1.kill();
    drop(router);
    drop(node);
}
