//! Kernel tests (root only): each runs its body inside a fresh network namespace pair
//! (`support::netns::Lab`: a cloud edge and a node behind a veth), and always deletes
//! them. Nothing touches the root namespace.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use cloud_mock_dataplane::{
    BackendHealth, DataPlane, DataPlaneConfig, HealthCheck, LoadBalancer, Mode, Protocol,
};

use support::netns::{
    Lab, bind_in, block_on_in_netns, in_netns, ip, ip_async, is_root, wait_for_ip,
};
use support::{greet_on, listener, tcp_hello};

const NODE_A: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 11);
const NODE_B: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 12);
const HEALTH_PORT: u16 = 10256;

/// Probes every 100 ms; one answer decides.
fn quick_health() -> DataPlaneConfig {
    DataPlaneConfig {
        health_interval: Duration::from_millis(100),
        health_timeout: Duration::from_millis(300),
        healthy_threshold: 1,
        unhealthy_threshold: 1,
        ..DataPlaneConfig::default()
    }
}

fn passthrough_lb(vip: IpAddr, check: Option<HealthCheck>) -> LoadBalancer {
    LoadBalancer {
        id: "lb-pass".to_owned(),
        vips: vec![vip],
        mode: Mode::Passthrough,
        listeners: vec![listener(Protocol::Tcp, 80, 30080, check)],
        backends: vec![NODE_A.into(), NODE_B.into()],
        source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
    }
}

/// The id after `nhid` in `ip route show` output.
fn nhid(route: &str) -> Option<u32> {
    let tokens: Vec<&str> = route.split_whitespace().collect();
    let at = tokens.iter().position(|&token| token == "nhid")?;
    tokens.get(at + 1)?.parse().ok()
}

#[test]
fn passthrough_route_follows_backend_health_through_one_resilient_group() {
    if !is_root() {
        return;
    }
    let lab = Lab::create('r');
    // Health endpoints of the two nodes, bound inside the node namespace.
    let health = in_netns(&lab.node, || {
        [NODE_A, NODE_B].map(|ip| {
            let listener = std::net::TcpListener::bind((ip, HEALTH_PORT)).unwrap();
            listener.set_nonblocking(true).unwrap();
            listener
        })
    });
    block_on_in_netns(&lab.edge, || async move {
        // Left by an earlier run (all `proto 77`): a route, adopted and removed; a group
        // with its route to the VIP, adopted and kept; a nexthop nobody uses, removed.
        for args in [
            "-4 route add 198.51.100.99/32 via 10.77.0.11 proto 77",
            "-4 nexthop add id 500 via 10.77.0.11 dev ve proto 77",
            "-4 nexthop add id 501 via 10.77.0.13 dev ve proto 77",
            "nexthop add id 502 group 500 type resilient buckets 256 idle_timer 5 unbalanced_timer 60 proto 77",
            "-4 route add 198.51.100.5/32 nhid 502 proto 77",
        ] {
            ip_async(&args.split(' ').collect::<Vec<_>>()).await;
        }
        let [a, b] = health
            .map(|l| support::greet_on(tokio::net::TcpListener::from_std(l).unwrap(), "health"));
        let dataplane = DataPlane::new(quick_health());
        let vip = IpAddr::from([198, 51, 100, 5]);
        let show = ["-4", "route", "show", "198.51.100.5/32"];
        let lb = passthrough_lb(vip, Some(HealthCheck::Tcp { port: HEALTH_PORT }));
        dataplane.apply(vec![lb.clone()]).await.unwrap();

        let took = wait_for_ip(&show, "route over both nodes", |out| {
            out.contains("nexthop via 10.77.0.11") && out.contains("nexthop via 10.77.0.12")
        })
        .await;
        println!("route over both nodes {took:?} after apply");
        let route = ip_async(&show).await;
        assert!(route.contains("proto 77"));
        assert_eq!(
            nhid(&route),
            Some(502),
            "the adopted group is kept: {route}"
        );
        let group = ip_async(&["nexthop", "show", "id", "502"]).await;
        assert!(
            group.contains("type resilient buckets 256"),
            "a resilient group: {group}"
        );
        let policy = tokio::fs::read_to_string("/proc/sys/net/ipv4/fib_multipath_hash_policy")
            .await
            .unwrap();
        assert_eq!(
            policy.trim(),
            "1",
            "L4 multipath hash in the edge namespace"
        );
        wait_for_ip(
            &["-4", "route", "show", "198.51.100.99/32"],
            "stale route removed",
            str::is_empty,
        )
        .await;
        wait_for_ip(
            &["nexthop", "show", "proto", "77"],
            "unused nexthop removed",
            |out| !out.contains("10.77.0.13"),
        )
        .await;
        assert!(
            ip_async(&["-4", "address", "show"])
                .await
                .find("198.51.100.5")
                .is_none(),
            "passthrough binds no VIP"
        );

        drop(b);
        let took = wait_for_ip(&show, "route over node a only", |out| {
            out.contains("via 10.77.0.11")
                && !out.contains("nexthop")
                && !out.contains("10.77.0.12")
        })
        .await;
        println!("failing node left the route {took:?} after its health endpoint closed");
        assert_eq!(
            nhid(&ip_async(&show).await),
            Some(502),
            "the group changed in place"
        );
        assert_eq!(
            dataplane.backend_health("lb-pass"),
            vec![
                (NODE_A.into(), BackendHealth::Healthy),
                (NODE_B.into(), BackendHealth::Unhealthy)
            ]
        );

        drop(a);
        wait_for_ip(
            &show,
            "every node again once none is healthy (fail open)",
            |out| out.contains("nexthop via 10.77.0.11") && out.contains("nexthop via 10.77.0.12"),
        )
        .await;

        // Without health checks both nodes count as healthy; removing the LB removes the
        // route, its group and its nexthops.
        dataplane
            .apply(vec![passthrough_lb(vip, None)])
            .await
            .unwrap();
        wait_for_ip(&show, "route back", |out| {
            out.contains("nexthop via 10.77.0.12")
        })
        .await;
        dataplane.apply(vec![]).await.unwrap();
        wait_for_ip(&show, "route removed with its LB", str::is_empty).await;
        wait_for_ip(
            &["nexthop", "show", "proto", "77"],
            "nexthops removed with the route",
            str::is_empty,
        )
        .await;

        // Shutdown removes what is installed.
        dataplane
            .apply(vec![passthrough_lb(vip, None)])
            .await
            .unwrap();
        wait_for_ip(&show, "route back", |out| out.contains("nexthop")).await;
        dataplane.shutdown().await;
        assert_eq!(ip_async(&show).await, "", "shutdown removes routes");
        assert_eq!(
            ip_async(&["nexthop", "show", "proto", "77"]).await,
            "",
            "and nexthops"
        );
    });
}

#[test]
fn proxy_mode_manages_non_loopback_vip_addresses() {
    if !is_root() {
        return;
    }
    let lab = Lab::create('a');
    let backend = in_netns(&lab.node, || {
        let listener = std::net::TcpListener::bind((NODE_A, 30080)).unwrap();
        listener.set_nonblocking(true).unwrap();
        listener
    });
    block_on_in_netns(&lab.edge, || async move {
        let _backend = greet_on(
            tokio::net::TcpListener::from_std(backend).unwrap(),
            "node-a",
        );
        let dataplane = DataPlane::new(DataPlaneConfig {
            manage_vip_addresses: true,
            ..DataPlaneConfig::default()
        });
        let vip = IpAddr::from([198, 51, 100, 9]);
        let lb = LoadBalancer {
            id: "lb-edge".to_owned(),
            vips: vec![vip],
            mode: Mode::Proxy,
            listeners: vec![listener(Protocol::Tcp, 80, 30080, None)],
            backends: vec![NODE_A.into()],
            source_ranges: vec![],
        };
        dataplane.apply(vec![lb]).await.unwrap();
        assert!(
            ip_async(&["-4", "address", "show", "dev", "lo"])
                .await
                .contains("198.51.100.9/32")
        );
        // A client inside the edge namespace reaches the node through the VIP.
        assert_eq!(tcp_hello(None, vip, 80).await.unwrap().1, "node-a");
        dataplane.apply(vec![]).await.unwrap();
        assert!(
            !ip_async(&["-4", "address", "show", "dev", "lo"])
                .await
                .contains("198.51.100.9")
        );
        dataplane.shutdown().await;
    });
}

fn serve(listener: std::net::TcpListener, name: &'static str) -> support::Server {
    greet_on(tokio::net::TcpListener::from_std(listener).unwrap(), name)
}

fn sharer(id: &str, vip: IpAddr, mode: Mode, port: u16, backend_port: u16) -> LoadBalancer {
    LoadBalancer {
        id: id.to_owned(),
        vips: vec![vip],
        mode,
        listeners: vec![listener(Protocol::Tcp, port, backend_port, None)],
        backends: vec![NODE_A.into(), NODE_B.into()],
        source_ranges: vec![],
    }
}

#[test]
fn proxy_mode_serves_each_sharer_of_a_vip_on_its_own_ports() {
    if !is_root() {
        return;
    }
    let lab = Lab::create('s');
    let web = bind_in(&lab.node, NODE_A, 30080);
    let api = bind_in(&lab.node, NODE_B, 30081);
    block_on_in_netns(&lab.edge, || async move {
        let (_web, _api) = (serve(web, "web"), serve(api, "api"));
        let dataplane = DataPlane::new(DataPlaneConfig {
            manage_vip_addresses: true,
            ..DataPlaneConfig::default()
        });
        let vip = IpAddr::from([198, 51, 100, 20]);
        let mut web_lb = sharer("lb-web", vip, Mode::Proxy, 80, 30080);
        web_lb.backends = vec![NODE_A.into()];
        let mut api_lb = sharer("lb-api", vip, Mode::Proxy, 81, 30081);
        api_lb.backends = vec![NODE_B.into()];
        dataplane
            .apply(vec![web_lb.clone(), api_lb.clone()])
            .await
            .unwrap();
        assert_eq!(tcp_hello(None, vip, 80).await.unwrap().1, "web");
        assert_eq!(tcp_hello(None, vip, 81).await.unwrap().1, "api");

        // One sharer goes: the other's traffic and the VIP address stay.
        let (mut open, _) = tcp_hello(None, vip, 81).await.unwrap();
        dataplane.apply(vec![api_lb]).await.unwrap();
        assert!(tcp_hello(None, vip, 80).await.is_err(), "web is gone");
        assert_eq!(tcp_hello(None, vip, 81).await.unwrap().1, "api");
        tokio::io::AsyncWriteExt::write_all(&mut open, b"still here\n")
            .await
            .expect("an open connection of the remaining sharer survives");
        assert!(
            ip_async(&["-4", "address", "show", "dev", "lo"])
                .await
                .contains("198.51.100.20/32")
        );
        dataplane.apply(vec![]).await.unwrap();
        assert!(
            !ip_async(&["-4", "address", "show", "dev", "lo"])
                .await
                .contains("198.51.100.20"),
            "the VIP goes with its last sharer"
        );
        dataplane.shutdown().await;
    });
}

#[test]
fn passthrough_sharers_route_over_the_nodes_that_serve_them_all() {
    if !is_root() {
        return;
    }
    let lab = Lab::create('p');
    let vip = IpAddr::from([198, 51, 100, 21]);
    // The nodes take the VIP's packets unchanged (as kube-proxy's rules would).
    ip(&[
        "-n",
        &lab.node,
        "address",
        "add",
        "198.51.100.21/32",
        "dev",
        "lo",
    ]);
    let web = bind_in(&lab.node, vip, 80);
    let api = bind_in(&lab.node, vip, 81);
    // eTP Local: web has pods on both nodes, api on node b only.
    let health = [
        bind_in(&lab.node, NODE_A, 10001),
        bind_in(&lab.node, NODE_B, 10001),
        bind_in(&lab.node, NODE_B, 10002),
    ];
    block_on_in_netns(&lab.edge, || async move {
        let (_web, _api) = (serve(web, "web"), serve(api, "api"));
        let _health = health.map(|listener| serve(listener, "health"));
        let dataplane = DataPlane::new(quick_health());
        let mut web_lb = sharer("lb-web", vip, Mode::Passthrough, 80, 80);
        web_lb.listeners[0].health_check = Some(HealthCheck::Tcp { port: 10001 });
        let mut api_lb = sharer("lb-api", vip, Mode::Passthrough, 81, 81);
        api_lb.listeners[0].health_check = Some(HealthCheck::Tcp { port: 10002 });
        dataplane.apply(vec![web_lb.clone(), api_lb]).await.unwrap();
        let show = ["-4", "route", "show", "198.51.100.21/32"];
        wait_for_ip(&show, "one route, over node b only", |out| {
            out.contains("via 10.77.0.12") && !out.contains("10.77.0.11")
        })
        .await;
        assert_eq!(tcp_hello(None, vip, 80).await.unwrap().1, "web");
        assert_eq!(tcp_hello(None, vip, 81).await.unwrap().1, "api");

        // The last constraint gone, the route spreads over web's nodes again.
        dataplane.apply(vec![web_lb]).await.unwrap();
        wait_for_ip(&show, "route over both nodes", |out| {
            out.contains("nexthop via 10.77.0.11") && out.contains("nexthop via 10.77.0.12")
        })
        .await;
        assert_eq!(tcp_hello(None, vip, 80).await.unwrap().1, "web");
        dataplane.apply(vec![]).await.unwrap();
        wait_for_ip(&show, "route goes with the last sharer", str::is_empty).await;
        dataplane.shutdown().await;
    });
}

/// `ip` as on a kernel with nexthop objects but without resilient groups (5.3 to 5.12):
/// every command naming a resilient group fails as such a kernel answers. Removed on drop.
struct IpWithoutResilientGroups(std::path::PathBuf);

impl IpWithoutResilientGroups {
    fn create() -> Self {
        let path = std::env::temp_dir().join(format!("tdm-ip-{}", std::process::id()));
        std::fs::write(
            &path,
            "#!/bin/sh\nfor arg in \"$@\"; do\n  if [ \"$arg\" = resilient ]; then echo 'Error: Invalid group type.' >&2; exit 2; fi\ndone\nexec ip \"$@\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        Self(path)
    }
}

impl Drop for IpWithoutResilientGroups {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn without_resilient_groups_passthrough_routes_are_multipath() {
    if !is_root() {
        return;
    }
    let lab = Lab::create('m');
    let ip_program = IpWithoutResilientGroups::create();
    let program = ip_program.0.clone();
    block_on_in_netns(&lab.edge, || async move {
        let dataplane = DataPlane::new(DataPlaneConfig {
            ip_program: program,
            ..quick_health()
        });
        let vip = IpAddr::from([198, 51, 100, 6]);
        dataplane
            .apply(vec![passthrough_lb(vip, None)])
            .await
            .unwrap();
        let show = ["-4", "route", "show", "198.51.100.6/32"];
        wait_for_ip(&show, "multipath route over both nodes", |out| {
            out.contains("nexthop via 10.77.0.11") && out.contains("nexthop via 10.77.0.12")
        })
        .await;
        let route = ip_async(&show).await;
        assert_eq!(nhid(&route), None, "{route}");
        assert_eq!(
            ip_async(&["nexthop", "show", "proto", "77"]).await,
            "",
            "the probe's nexthop is removed"
        );
        dataplane.shutdown().await;
        assert_eq!(ip_async(&show).await, "", "shutdown removes routes");
    });
}
