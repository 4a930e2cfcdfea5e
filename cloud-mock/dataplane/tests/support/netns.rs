//! Network namespaces for the kernel tests (root only): a cloud edge and a node joined by
//! a veth (`tdmdp<pid><test><e|n>`), deleted on drop, also on panic. Nothing touches the
//! root namespace.
//!
//! Addresses, IPv4 / IPv6 (the project's IPv6 plan): the edge is `10.77.0.1/24` /
//! `2001:db8:18::1/64` on `ve`, the node `10.77.0.11`, `10.77.0.12` /
//! `2001:db8:18::11`, `2001:db8:18::12` on `vn`.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sched::{CloneFlags, setns};
use nix::unistd::Uid;

const PREFIX: &str = "tdmdp";

pub const NODE6_A: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x18, 0, 0, 0, 0, 0x11);
pub const NODE6_B: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x18, 0, 0, 0, 0, 0x12);
pub const EDGE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x18, 0, 0, 0, 0, 1);

/// `2001:db8:51:100::<host>`: the LB VIP pool of the IPv6 plan.
pub fn vip6(host: u16) -> IpAddr {
    Ipv6Addr::new(0x2001, 0xdb8, 0x51, 0x100, 0, 0, 0, host).into()
}

/// `198.51.100.<host>`: the IPv4 LB VIP pool.
pub fn vip4(host: u8) -> IpAddr {
    Ipv4Addr::new(198, 51, 100, host).into()
}

pub fn ip(args: &[&str]) -> String {
    let output = Command::new("ip").args(args).output().unwrap();
    assert!(
        output.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// An edge and a node namespace joined by a veth, `tdmdp<pid><test>e` and `…n`; deleted on
/// drop, also on panic.
pub struct Lab {
    pub edge: String,
    pub node: String,
}

impl Lab {
    pub fn create(test: char) -> Self {
        // A digit would read as part of the pid, and another test's sweep of stale
        // namespaces would delete this one's as a dead process's.
        assert!(
            test.is_ascii_alphabetic(),
            "a test's tag is a letter, not {test:?}"
        );
        remove_stale_namespaces();
        let pid = std::process::id();
        let lab = Self {
            edge: format!("{PREFIX}{pid}{test}e"),
            node: format!("{PREFIX}{pid}{test}n"),
        };
        ip(&["netns", "add", &lab.edge]);
        ip(&["netns", "add", &lab.node]);
        let (edge, node) = (lab.edge.as_str(), lab.node.as_str());
        ip(&[
            "-n", edge, "link", "add", "ve", "type", "veth", "peer", "name", "vn", "netns", node,
        ]);
        ip(&["-n", edge, "address", "add", "10.77.0.1/24", "dev", "ve"]);
        ip(&["-n", node, "address", "add", "10.77.0.11/24", "dev", "vn"]);
        ip(&["-n", node, "address", "add", "10.77.0.12/24", "dev", "vn"]);
        // No duplicate address detection: a tentative address cannot be bound.
        for (ns, dev, address) in [
            (edge, "ve", "2001:db8:18::1/64"),
            (node, "vn", "2001:db8:18::11/64"),
            (node, "vn", "2001:db8:18::12/64"),
        ] {
            ip(&["-n", ns, "address", "add", address, "dev", dev, "nodad"]);
        }
        for (ns, dev) in [(edge, "ve"), (edge, "lo"), (node, "vn"), (node, "lo")] {
            ip(&["-n", ns, "link", "set", dev, "up"]);
        }
        lab
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for name in [&self.edge, &self.node] {
            let _ = Command::new("ip").args(["netns", "delete", name]).status();
        }
    }
}

/// The network namespaces of one test, `tdmdp<pid><tag>-<host>` (`tag` starts with a
/// letter), each with `lo` up: deleted on drop, also on panic, and by the next test run
/// when this process was killed (Ctrl-C) before it could drop them.
pub struct Namespaces {
    prefix: String,
    made: Vec<String>,
}

impl Namespaces {
    pub fn create(tag: &str, hosts: &[&str]) -> Self {
        assert!(
            tag.starts_with(|c: char| c.is_ascii_alphabetic()),
            "a test's tag starts with a letter, not {tag:?}"
        );
        remove_stale_namespaces();
        let mut namespaces = Self {
            prefix: format!("{PREFIX}{}{tag}-", std::process::id()),
            made: Vec::new(),
        };
        for host in hosts {
            let name = namespaces.name(host);
            ip(&["netns", "add", &name]);
            namespaces.made.push(name.clone());
            ip(&["-n", &name, "link", "set", "lo", "up"]);
        }
        namespaces
    }

    /// The namespace of `host`.
    pub fn name(&self, host: &str) -> String {
        format!("{}{host}", self.prefix)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in &self.made {
            let _ = Command::new("ip").args(["netns", "delete", name]).status();
        }
    }
}

/// Namespaces of earlier runs whose process is gone.
fn remove_stale_namespaces() {
    for line in ip(&["netns", "list"]).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if !pid.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "delete", name]).status();
        }
    }
}

/// Runs `body` on a thread inside namespace `name` (threads it starts inherit it).
pub fn in_netns<T: Send>(name: &str, body: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        let thread = scope.spawn(|| {
            let netns = File::open(format!("/run/netns/{name}")).unwrap();
            setns(&netns, CloneFlags::CLONE_NEWNET).unwrap();
            body()
        });
        thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Runs the async `body` on a runtime whose every thread lives in namespace `name`.
pub fn block_on_in_netns<F: Future<Output = ()>>(name: &str, body: impl FnOnce() -> F + Send) {
    in_netns(name, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(body());
    });
}

pub fn is_root() -> bool {
    if Uid::effective().is_root() {
        return true;
    }
    eprintln!("skipped: network-namespace tests need root");
    false
}

pub async fn ip_async(args: &[&str]) -> String {
    let output = tokio::process::Command::new("ip")
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Polls `ip ARGS` until its output satisfies `condition`; the time it took.
pub async fn wait_for_ip(args: &[&str], what: &str, condition: impl Fn(&str) -> bool) -> Duration {
    let start = Instant::now();
    loop {
        let output = ip_async(args).await;
        if condition(&output) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "timed out waiting for {what}; last: {output:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A switch: a bridge `br0` in namespace `switch` (which exists).
pub fn switch(switch: &str) {
    ip(&["-n", switch, "link", "add", "br0", "type", "bridge"]);
    ip(&["-n", switch, "link", "set", "br0", "up"]);
}

/// Plugs namespace `host` into `switch` (port `port` there) as `eth0` with `address`
/// (`ADDRESS/PREFIX`), up.
pub fn plug(switch: &str, port: &str, host: &str, address: &str) {
    ip(&[
        "-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host,
    ]);
    ip(&["-n", switch, "link", "set", port, "master", "br0", "up"]);
    ip(&["-n", host, "addr", "add", address, "dev", "eth0"]);
    ip(&["-n", host, "link", "set", "eth0", "up"]);
}

/// A TCP listener bound inside namespace `netns` at `ip:port`, for a server started
/// later in another namespace's runtime.
pub fn bind_in(netns: &str, ip: impl Into<IpAddr>, port: u16) -> std::net::TcpListener {
    let ip = ip.into();
    in_netns(netns, || {
        let listener = std::net::TcpListener::bind((ip, port)).unwrap();
        listener.set_nonblocking(true).unwrap();
        listener
    })
}

/// A UDP socket bound inside namespace `netns` at `ip:port`.
pub fn bind_udp_in(netns: &str, ip: impl Into<IpAddr>, port: u16) -> std::net::UdpSocket {
    let ip = ip.into();
    in_netns(netns, || {
        let socket = std::net::UdpSocket::bind((ip, port)).unwrap();
        socket.set_nonblocking(true).unwrap();
        socket
    })
}
