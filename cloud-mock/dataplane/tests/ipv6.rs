//! IPv6 and dual-stack with real packets (root only), inside a fresh edge and node
//! namespace pair per test (`support::netns::Lab`), always deleted. Addresses follow the
//! project's IPv6 plan: nodes `2001:db8:18::/64`, VIPs `2001:db8:51:100::/64`, clients
//! `2001:db8:203::/64` (and `2001:db8:192::/64` outside every source range).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use cloud_mock_dataplane::{
    BackendHealth, DataPlane, DataPlaneConfig, HealthCheck, LoadBalancer, Mode, Protocol,
};
use tokio::net::UdpSocket;

use support::netns::{
    Lab, NODE6_A, NODE6_B, bind_in, bind_udp_in, block_on_in_netns, in_netns, ip, ip_async,
    is_root, vip4, vip6, wait_for_ip,
};
use support::{Server, greet_on, listener, tcp_hello, udp_ask, udp_greet_on, wait_for};

const HEALTH_PORT: u16 = 10256;
const NODE4_A: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 11);

fn client_in() -> IpAddr {
    "2001:db8:203::10".parse().unwrap()
}

fn client_out() -> IpAddr {
    "2001:db8:192::10".parse().unwrap()
}

/// Probes every 100 ms; one answer decides.
fn quick(manage_vip_addresses: bool) -> DataPlaneConfig {
    DataPlaneConfig {
        health_interval: Duration::from_millis(100),
        health_timeout: Duration::from_millis(300),
        healthy_threshold: 1,
        unhealthy_threshold: 1,
        manage_vip_addresses,
        ..DataPlaneConfig::default()
    }
}

fn serve(listener: std::net::TcpListener, name: &'static str) -> Server {
    greet_on(tokio::net::TcpListener::from_std(listener).unwrap(), name)
}

fn serve_udp(socket: std::net::UdpSocket, name: &'static str) -> Server {
    udp_greet_on(UdpSocket::from_std(socket).unwrap(), name)
}

async fn wait_healthy(dataplane: &DataPlane, lb_id: &str, count: usize) {
    wait_for("backends healthy", Duration::from_secs(5), || {
        let health = dataplane.backend_health(lb_id);
        health.len() == count && health.iter().all(|(_, h)| *h == BackendHealth::Healthy)
    })
    .await;
}

#[test]
fn proxy_mode_forwards_tcp_and_udp_from_an_ipv6_vip_to_ipv6_backends() {
    if !is_root() {
        return;
    }
    let lab = Lab::create('v');
    let tcp = [
        bind_in(&lab.node, NODE6_A, 30080),
        bind_in(&lab.node, NODE6_B, 30080),
    ];
    let udp = [
        bind_udp_in(&lab.node, NODE6_A, 30053),
        bind_udp_in(&lab.node, NODE6_B, 30053),
    ];
    let health = [
        bind_in(&lab.node, NODE6_A, HEALTH_PORT),
        bind_in(&lab.node, NODE6_B, HEALTH_PORT),
    ];
    // Client addresses inside the edge namespace, one in the source range, one outside.
    for client in [client_in(), client_out()] {
        ip(&[
            "-n",
            &lab.edge,
            "address",
            "add",
            &format!("{client}/128"),
            "dev",
            "lo",
            "nodad",
        ]);
    }
    block_on_in_netns(&lab.edge, || async move {
        let [tcp_a, tcp_b] = tcp;
        let [udp_a, udp_b] = udp;
        let _servers = [
            serve(tcp_a, "a"),
            serve(tcp_b, "b"),
            serve_udp(udp_a, "a"),
            serve_udp(udp_b, "b"),
        ];
        let _health = health.map(|listener| serve(listener, "health"));
        let dataplane = DataPlane::new(quick(true));
        let vip = vip6(0x9);
        let check = Some(HealthCheck::Tcp { port: HEALTH_PORT });
        let lb = LoadBalancer {
            id: "lb-v6".to_owned(),
            vips: vec![vip],
            mode: Mode::Proxy,
            listeners: vec![
                listener(Protocol::Tcp, 80, 30080, check.clone()),
                listener(Protocol::Udp, 53, 30053, check),
            ],
            backends: vec![NODE6_A.into(), NODE6_B.into()],
            source_ranges: vec![
                "203.0.113.0/24".parse().unwrap(),
                "2001:db8:203::/64".parse().unwrap(),
            ],
        };
        dataplane.apply(vec![lb]).await.unwrap();
        assert!(
            ip_async(&["-6", "address", "show", "dev", "lo"])
                .await
                .contains("2001:db8:51:100::9/128"),
            "the IPv6 VIP is a local address"
        );
        wait_healthy(&dataplane, "lb-v6", 2).await;
        assert_eq!(
            dataplane.backend_health("lb-v6"),
            vec![
                (NODE6_A.into(), BackendHealth::Healthy),
                (NODE6_B.into(), BackendHealth::Healthy)
            ]
        );

        let mut seen = BTreeSet::new();
        for _ in 0..4 {
            let (_, greeting) = tcp_hello(Some(client_in()), vip, 80).await.unwrap();
            seen.insert(greeting);
        }
        assert_eq!(seen, BTreeSet::from(["a".to_owned(), "b".to_owned()]));
        assert!(
            tcp_hello(Some(client_out()), vip, 80).await.is_err(),
            "a client outside the IPv6 source range is refused"
        );

        let mut udp_seen = BTreeSet::new();
        for i in 0..4 {
            let client = UdpSocket::bind((client_in(), 0)).await.unwrap();
            let payload = format!("hello {i}");
            let (reply, from) = udp_ask(&client, vip, 53, &payload, Duration::from_secs(2))
                .await
                .expect("a UDP reply through the IPv6 VIP");
            assert_eq!(from.to_string(), "[2001:db8:51:100::9]:53", "from the VIP");
            let (backend, echoed) = reply.split_once(':').unwrap();
            assert_eq!(echoed, payload);
            udp_seen.insert(backend.to_owned());
        }
        assert_eq!(udp_seen.len(), 2, "both backends take flows: {udp_seen:?}");
        let outside = UdpSocket::bind((client_out(), 0)).await.unwrap();
        assert_eq!(
            udp_ask(&outside, vip, 53, "x", Duration::from_millis(300)).await,
            None
        );

        dataplane.apply(vec![]).await.unwrap();
        assert!(
            !ip_async(&["-6", "address", "show", "dev", "lo"])
                .await
                .contains("2001:db8:51:100::9"),
            "the VIP address goes with its load balancer"
        );
        dataplane.shutdown().await;
    });
}

#[test]
fn passthrough_routes_an_ipv6_vip_over_the_nodes_ipv6_addresses() {
    if !is_root() {
        return;
    }
    let lab = Lab::create('w');
    let vip = vip6(0x21);
    // The node takes the VIP's packets unchanged (as kube-proxy's rules would).
    ip(&[
        "-n",
        &lab.node,
        "address",
        "add",
        "2001:db8:51:100::21/128",
        "dev",
        "lo",
        "nodad",
    ]);
    let web = bind_in(&lab.node, vip, 80);
    let health = [
        bind_in(&lab.node, NODE6_A, HEALTH_PORT),
        bind_in(&lab.node, NODE6_B, HEALTH_PORT),
    ];
    block_on_in_netns(&lab.edge, || async move {
        // A route of ours left by an earlier run: adopted and removed.
        ip_async(&[
            "-6",
            "route",
            "add",
            "2001:db8:51:100::99/128",
            "via",
            "2001:db8:18::11",
            "proto",
            "77",
        ])
        .await;
        let _web = serve(web, "web");
        let [a, b] = health.map(|listener| serve(listener, "health"));
        let dataplane = DataPlane::new(quick(false));
        let lb = LoadBalancer {
            id: "lb-pass6".to_owned(),
            vips: vec![vip],
            mode: Mode::Passthrough,
            listeners: vec![listener(
                Protocol::Tcp,
                80,
                80,
                Some(HealthCheck::Tcp { port: HEALTH_PORT }),
            )],
            backends: vec![NODE6_A.into(), NODE6_B.into()],
            source_ranges: vec![],
        };
        dataplane.apply(vec![lb]).await.unwrap();
        let show = ["-6", "route", "show", "2001:db8:51:100::21/128"];
        let took = wait_for_ip(&show, "route over both IPv6 nodes", |out| {
            out.contains("nexthop via 2001:db8:18::11")
                && out.contains("nexthop via 2001:db8:18::12")
        })
        .await;
        println!("IPv6 route installed {took:?} after apply");
        let route = ip_async(&show).await;
        assert!(route.contains("proto 77"));
        // Through a resilient group of IPv6 nexthop objects.
        assert!(route.contains(" nhid "), "{route}");
        let nexthops = ip_async(&["nexthop", "show", "proto", "77"]).await;
        assert!(
            nexthops.contains("via 2001:db8:18::11") && nexthops.contains("type resilient"),
            "{nexthops}"
        );
        let policy = tokio::fs::read_to_string("/proc/sys/net/ipv6/fib_multipath_hash_policy")
            .await
            .unwrap();
        assert_eq!(policy.trim(), "1", "L4 multipath hash for IPv6");
        wait_for_ip(
            &["-6", "route", "show", "2001:db8:51:100::99/128"],
            "stale IPv6 route removed",
            str::is_empty,
        )
        .await;
        // A client in the edge reaches the node's service through the routed VIP (asked
        // again while the new IPv6 link resolves its first neighbours: one SYN was lost
        // to that in CI on a loaded machine).
        assert_eq!(first_hello(vip, 80).await, "web");

        drop(b);
        wait_for_ip(&show, "route over node a only", |out| {
            out.contains("via 2001:db8:18::11") && !out.contains("2001:db8:18::12")
        })
        .await;
        assert_eq!(tcp_hello(None, vip, 80).await.unwrap().1, "web");
        drop(a);
        wait_for_ip(
            &show,
            "both nodes again once none is healthy (fail open)",
            |out| {
                out.contains("nexthop via 2001:db8:18::11")
                    && out.contains("nexthop via 2001:db8:18::12")
            },
        )
        .await;
        dataplane.shutdown().await;
        assert_eq!(ip_async(&show).await, "", "shutdown removes routes");
        assert_eq!(ip_async(&["nexthop", "show", "proto", "77"]).await, "");
    });
}

#[test]
fn both_vips_of_a_dual_stack_load_balancer_answer_in_both_modes() {
    if !is_root() {
        return;
    }
    let lab = Lab::create('d');
    // Proxy mode: each family's VIP forwards to the node address of its family.
    let proxied = [
        bind_in(&lab.node, NODE4_A, 30080),
        bind_in(&lab.node, NODE6_A, 30080),
    ];
    let proxied_udp = [
        bind_udp_in(&lab.node, NODE4_A, 30053),
        bind_udp_in(&lab.node, NODE6_A, 30053),
    ];
    // Passthrough: the node holds both VIPs, and each route leads there in its family.
    let (pass4, pass6) = (vip4(40), vip6(0x40));
    for vip in [pass4, pass6] {
        ip(&[
            "-n",
            &lab.node,
            "address",
            "add",
            &format!("{vip}/{}", if vip.is_ipv4() { 32 } else { 128 }),
            "dev",
            "lo",
            "nodad",
        ]);
    }
    let routed = in_netns(&lab.node, || {
        // One listener on both families: which VIP a client used shows in its address.
        let listener = std::net::TcpListener::bind("[::]:81").unwrap();
        listener.set_nonblocking(true).unwrap();
        listener
    });
    block_on_in_netns(&lab.edge, || async move {
        let [v4, v6] = proxied;
        let [u4, u6] = proxied_udp;
        let _servers = [
            serve(v4, "node-ipv4"),
            serve(v6, "node-ipv6"),
            serve_udp(u4, "node-ipv4"),
            serve_udp(u6, "node-ipv6"),
            serve(routed, "routed"),
        ];
        let dataplane = DataPlane::new(quick(true));
        let (proxy4, proxy6) = (vip4(30), vip6(0x30));
        let proxy = LoadBalancer {
            id: "lb-dual-proxy".to_owned(),
            vips: vec![proxy6, proxy4],
            mode: Mode::Proxy,
            listeners: vec![
                listener(Protocol::Tcp, 80, 30080, None),
                listener(Protocol::Udp, 53, 30053, None),
            ],
            backends: vec![NODE4_A.into(), NODE6_A.into()],
            source_ranges: vec![],
        };
        let passthrough = LoadBalancer {
            id: "lb-dual-pass".to_owned(),
            vips: vec![pass4, pass6],
            mode: Mode::Passthrough,
            listeners: vec![listener(Protocol::Tcp, 81, 81, None)],
            backends: vec![NODE4_A.into(), NODE6_A.into()],
            source_ranges: vec![],
        };
        dataplane.apply(vec![proxy, passthrough]).await.unwrap();

        assert_eq!(first_hello(proxy4, 80).await, "node-ipv4");
        assert_eq!(first_hello(proxy6, 80).await, "node-ipv6");
        for (vip, expected) in [(proxy4, "node-ipv4"), (proxy6, "node-ipv6")] {
            let any: IpAddr = if vip.is_ipv4() {
                Ipv4Addr::UNSPECIFIED.into()
            } else {
                std::net::Ipv6Addr::UNSPECIFIED.into()
            };
            let client = UdpSocket::bind((any, 0)).await.unwrap();
            let (reply, _) = udp_ask(&client, vip, 53, "ping", Duration::from_secs(2))
                .await
                .expect("a UDP reply through each VIP");
            assert_eq!(reply, format!("{expected}:ping"));
        }

        wait_for_ip(
            &["-4", "route", "show", "198.51.100.40/32"],
            "IPv4 route",
            |out| out.contains("via 10.77.0.11"),
        )
        .await;
        wait_for_ip(
            &["-6", "route", "show", "2001:db8:51:100::40/128"],
            "IPv6 route",
            |out| out.contains("via 2001:db8:18::11"),
        )
        .await;
        assert_eq!(first_hello(pass4, 81).await, "routed");
        assert_eq!(first_hello(pass6, 81).await, "routed");

        dataplane.shutdown().await;
        assert_eq!(
            ip_async(&["-6", "route", "show", "proto", "77"]).await,
            "",
            "shutdown removes the IPv6 route"
        );
        assert_eq!(ip_async(&["-4", "route", "show", "proto", "77"]).await, "");
    });
}

/// The first greeting through `vip:port`, asked again while the data plane still brings the
/// VIP up (each family's listener, address or route follows that family's first health
/// checks, so one family may answer a moment before the other) or a new IPv6 link still
/// resolves its neighbours.
async fn first_hello(vip: IpAddr, port: u16) -> String {
    let limit = Duration::from_secs(5);
    let start = std::time::Instant::now();
    loop {
        match tcp_hello(None, vip, port).await {
            Ok((_, greeting)) => return greeting,
            Err(_) if start.elapsed() < limit => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(error) => panic!("no answer through {vip}:{port} within {limit:?}: {error}"),
        }
    }
}
