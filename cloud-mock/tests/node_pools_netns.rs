#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Node pools with real packets (root only): the whole edge (API, store, lifecycle, data
//! plane) runs in the edge namespace of a fresh edge and node namespace pair
//! (`support::netns::Lab`, always deleted), the nodes' servers in the node namespace, the
//! client in the edge namespace. Nothing touches the root namespace.
//!
//! - Own proxy mode: one pool write moves the traffic of every LB on the pool, and an
//!   edge started again on the same store serves the pool's members at once.
//! - HAProxy: a pool write of one node over several LBs is a runtime change of each, no
//!   reload, and the rendered file holds the new servers.

// The data plane's test support: namespaces, node servers, clients.
#[path = "../dataplane/tests/support/mod.rs"]
mod support;

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use cloud_mock::store::StoreSettings;
use cloud_mock::{App, Settings};
use cloud_mock_dataplane::{DataPlaneConfig, DataPlaneKind, HaproxySettings};
use http::{Method, Request, StatusCode, header};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use support::netns::{Lab, bind_in, block_on_in_netns, is_root};
use support::{Server, greet_on, tcp_hello};

const TOKEN: &str = "node-pool-test";
const NODE_A: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 11);
const NODE_B: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 12);
const NODE_PORT: u16 = 30080;

/// A directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(label: &str) -> Self {
        let path = std::env::temp_dir().join(format!("cm-np-{}-{label}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One edge: the API router with its lifecycle task running; stopped (data plane shut
/// down) by [`Edge::stop`].
struct Edge {
    router: Router,
    cancel: CancellationToken,
    lifecycle: JoinHandle<()>,
}

impl Edge {
    async fn start(data_dir: &Path, dataplane: DataPlaneConfig) -> Self {
        let settings = Settings {
            data_dir: data_dir.to_owned(),
            store: StoreSettings::Redb,
            token: TOKEN.into(),
            vip_pools: "198.51.100.0/24".parse().unwrap(),
            provisioning_delay: Duration::ZERO,
            fault_injection: false,
            l2: None,
            dataplane,
        };
        let cancel = CancellationToken::new();
        let App {
            router, lifecycle, ..
        } = App::new(&settings, cancel.clone()).await.unwrap();
        let lifecycle = tokio::spawn(lifecycle.run(cancel.clone()));
        Self {
            router,
            cancel,
            lifecycle,
        }
    }

    async fn stop(self) {
        self.cancel.cancel();
        self.lifecycle.await.unwrap();
    }

    async fn call(&self, method: Method, uri: &str, body: Option<Value>) -> (StatusCode, Value) {
        let builder = Request::builder()
            .method(method)
            .uri(uri)
            .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"));
        let request = match body {
            Some(body) => builder
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(body.to_string())),
            None => builder.body(Body::empty()),
        }
        .unwrap();
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        let body = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        (status, body)
    }

    async fn put_pool(&self, members: &[Ipv4Addr]) -> Value {
        let backends: Vec<Value> = members.iter().map(|ip| json!({"ip": ip})).collect();
        let (status, body) = self
            .call(
                Method::PUT,
                "/v1/nodepools/nodes",
                Some(json!({"tags": {"cluster": "c1"}, "backends": backends})),
            )
            .await;
        assert!(status.is_success(), "{status}: {body}");
        body
    }

    /// Creates `count` proxy-mode LBs on pool `nodes` and waits until they are active;
    /// their VIPs.
    async fn lbs_on_pool(&self, count: usize) -> Vec<IpAddr> {
        let mut vips = Vec::new();
        for i in 0..count {
            let (status, lb) = self
                .call(
                    Method::POST,
                    "/v1/loadbalancers",
                    Some(json!({"name": format!("lb-{i}"), "mode": "proxy",
                        "listeners": [{"protocol": "TCP", "port": 80, "backendPort": NODE_PORT}],
                        "backends": [], "nodePool": "nodes"})),
                )
                .await;
            assert_eq!(status, StatusCode::CREATED, "{lb}");
            vips.push(lb["vips"][0].as_str().unwrap().parse().unwrap());
        }
        self.wait_all_active(count).await;
        vips
    }

    async fn wait_all_active(&self, count: usize) {
        for _ in 0..250 {
            let (_, list) = self.call(Method::GET, "/v1/loadbalancers", None).await;
            let items = list["items"].as_array().unwrap();
            if items.len() == count && items.iter().all(|lb| lb["state"] == "active") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the load balancers never all became active");
    }

    async fn metrics(&self) -> String {
        let request = Request::get("/metrics").body(Body::empty()).unwrap();
        let response = self.router.clone().oneshot(request).await.unwrap();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }
}

/// The node servers: `a` on NODE_A, `b` on NODE_B, bound in the node namespace.
fn node_listeners(lab: &Lab) -> [std::net::TcpListener; 2] {
    [
        bind_in(&lab.node, NODE_A, NODE_PORT),
        bind_in(&lab.node, NODE_B, NODE_PORT),
    ]
}

fn serve_nodes(listeners: [std::net::TcpListener; 2]) -> [Server; 2] {
    let [a, b] = listeners;
    [
        greet_on(tokio::net::TcpListener::from_std(a).unwrap(), "a"),
        greet_on(tokio::net::TcpListener::from_std(b).unwrap(), "b"),
    ]
}

/// Waits (at most 5 s) until a connection to every VIP is answered by node `name`.
async fn wait_served_by(vips: &[IpAddr], name: &str) {
    for _ in 0..250 {
        let mut all = true;
        for &vip in vips {
            let greeting = tcp_hello(None, vip, 80).await.map(|(_, greeting)| greeting);
            all &= greeting.as_deref().is_ok_and(|greeting| greeting == name);
        }
        if all {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the VIPs {vips:?} were never all served by node {name}");
}

fn counter(text: &str, line: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn own_proxy_a_pool_write_moves_every_lb_and_an_edge_restart_keeps_the_members() {
    if !is_root() {
        return;
    }
    let lab = Lab::create('p');
    let nodes = node_listeners(&lab);
    let data = TempDir::new("proxy");
    block_on_in_netns(&lab.edge, || async move {
        let _nodes = serve_nodes(nodes);
        let proxy = || DataPlaneConfig {
            mode: DataPlaneKind::Proxy,
            manage_vip_addresses: true,
            ..DataPlaneConfig::default()
        };
        let edge = Edge::start(&data.0, proxy()).await;
        edge.put_pool(&[NODE_A]).await;
        let vips = edge.lbs_on_pool(3).await;
        wait_served_by(&vips, "a").await;

        let written = edge.put_pool(&[NODE_B]).await;
        assert_eq!(written["version"], 2);
        assert_eq!(written["loadBalancers"].as_array().unwrap().len(), 3);
        wait_served_by(&vips, "b").await;
        let (_, list) = edge.call(Method::GET, "/v1/loadbalancers", None).await;
        for lb in list["items"].as_array().unwrap() {
            assert_eq!(lb["health"][0]["ip"], "10.77.0.12", "{lb}");
            assert_eq!(lb["health"].as_array().unwrap().len(), 1, "{lb}");
            assert_eq!(lb["version"], 1, "the LBs themselves were not written");
        }

        // The next edge on the same store serves the pool's members from its first pass.
        edge.stop().await;
        assert!(
            tcp_hello(None, vips[0], 80).await.is_err(),
            "the edge is down"
        );
        let edge = Edge::start(&data.0, proxy()).await;
        wait_served_by(&vips, "b").await;
        edge.stop().await;
    });
}

#[test]
fn haproxy_a_pool_write_of_one_node_over_several_lbs_reloads_nothing() {
    if !is_root() {
        return;
    }
    assert!(
        std::process::Command::new("haproxy")
            .arg("-v")
            .output()
            .is_ok_and(|out| out.status.success()),
        "this test runs a real HAProxy: install Debian's haproxy package"
    );
    let lab = Lab::create('h');
    let nodes = node_listeners(&lab);
    let data = TempDir::new("haproxy");
    block_on_in_netns(&lab.edge, || async move {
        let _nodes = serve_nodes(nodes);
        let state_dir = data.0.join("haproxy");
        let edge = Edge::start(
            &data.0.join("store"),
            DataPlaneConfig {
                mode: DataPlaneKind::Haproxy,
                manage_vip_addresses: true,
                haproxy: HaproxySettings {
                    state_dir: state_dir.clone(),
                    min_reload_interval: Duration::from_millis(100),
                    ..HaproxySettings::default()
                },
                ..DataPlaneConfig::default()
            },
        )
        .await;
        const LBS: usize = 5;
        edge.put_pool(&[NODE_A]).await;
        let vips = edge.lbs_on_pool(LBS).await;
        wait_served_by(&vips, "a").await;
        let reloads = r#"cloud_mock_haproxy_reloads_total{result="ok"}"#;
        let commands = r#"cloud_mock_haproxy_runtime_commands_total{result="ok"}"#;
        let before = edge.metrics().await;

        // Node B joins: one pool write, a server added to each LB's backend at run time.
        edge.put_pool(&[NODE_A, NODE_B]).await;
        let config = state_dir.join("haproxy.cfg");
        let mut after = String::new();
        for _ in 0..250 {
            after = edge.metrics().await;
            if counter(&after, commands) >= counter(&before, commands) + LBS as u64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            counter(&after, commands) >= counter(&before, commands) + LBS as u64,
            "a runtime change per LB: {after}"
        );
        assert_eq!(
            counter(&after, reloads),
            counter(&before, reloads),
            "no reload for a node joining"
        );
        let rendered = std::fs::read_to_string(&config).unwrap();
        assert_eq!(
            rendered
                .matches("server 10.77.0.12 10.77.0.12:30080")
                .count(),
            LBS,
            "the file holds the new server of every LB:\n{rendered}"
        );

        // Node A leaves: its server deleted at run time from each LB (disabled, its
        // sessions shut, deleted: three commands), still no reload, and B serves.
        let joined = counter(&after, commands);
        edge.put_pool(&[NODE_B]).await;
        let mut after = String::new();
        for _ in 0..250 {
            after = edge.metrics().await;
            if counter(&after, commands) >= joined + 3 * LBS as u64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            counter(&after, commands) >= joined + 3 * LBS as u64,
            "a runtime removal per LB: {after}"
        );
        for _ in 0..3 {
            wait_served_by(&vips, "b").await;
        }
        assert_eq!(
            counter(&after, reloads),
            counter(&before, reloads),
            "no reload for a node leaving"
        );
        let rendered = std::fs::read_to_string(&config).unwrap();
        assert!(!rendered.contains("10.77.0.11"), "{rendered}");
        edge.stop().await;
    });
}
