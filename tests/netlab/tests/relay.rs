//! The API server relay against a local TCP echo: a client inside the lab reaches a server
//! that only the root namespace's loopback has (root only).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use tandem_netlab::{EchoClient, Netns, Relay, Topology, addr, bridge_api_server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A TCP echo on the root namespace's 127.0.0.1.
async fn loopback_echo() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                loop {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => conn.write_all(&buf[..n]).await.unwrap(),
                    }
                }
            });
        }
    });
    addr
}

/// Connects from inside `netns` to `addr`, sends `msg` and returns the answer (or the
/// connect/read error).
async fn round_trip_from(
    netns: &Netns,
    addr: SocketAddr,
    msg: &'static [u8],
) -> std::io::Result<Vec<u8>> {
    let ns = netns.clone();
    tokio::task::spawn_blocking(move || {
        ns.run_in_thread(move || {
            let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
            stream.set_read_timeout(Some(Duration::from_secs(2)))?;
            stream.write_all(msg)?;
            let mut buf = vec![0u8; msg.len()];
            stream.read_exact(&mut buf)?;
            Ok(buf)
        })
        .unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lab_components_reach_a_loopback_server_through_the_relay() {
    let topo = Topology::builder()
        .nodes(1)
        .pods_per_node(&[0])
        .without_echo()
        .build_async()
        .await
        .unwrap();
    let upstream = loopback_echo().await;
    let listen = SocketAddr::from((addr::CONTROL_PLANE_IP, 6443));
    let relay = Relay::start(&topo.control_plane().netns, listen, upstream.to_string())
        .await
        .unwrap();
    assert_eq!(relay.local_addr(), listen);

    // From a node, over the node network, several connections at once.
    let node = topo.node(1).unwrap().netns.clone();
    let (a, b) = tokio::join!(
        round_trip_from(&node, listen, b"GET /version"),
        round_trip_from(&node, listen, b"watch events"),
    );
    assert_eq!(a.unwrap(), b"GET /version");
    assert_eq!(b.unwrap(), b"watch events");

    // The loopback server itself is not reachable from the lab: only the relay is.
    assert!(round_trip_from(&node, upstream, b"x").await.is_err());

    relay.stop().await;
    assert!(round_trip_from(&node, listen, b"after stop").await.is_err());
    tokio::task::spawn_blocking(move || drop(topo))
        .await
        .unwrap();
}

/// A one-request-per-connection HTTP server on the root namespace's 127.0.0.1 answering
/// like the pod echo, standing in for an API server only the host can reach.
async fn loopback_http() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut conn, peer) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut seen = Vec::new();
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let body = format!(r#"{{"pod":"apiserver","client":"{peer}"}}"#);
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(response.as_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_writes_a_kubeconfig_whose_server_works_from_every_node() {
    let topo = tokio::task::spawn_blocking(|| {
        Topology::builder()
            .nodes(2)
            .pods_per_node(&[0, 0])
            .echo_binary(env!("CARGO_BIN_EXE_tandem-echo"))
            .build()
            .unwrap()
    })
    .await
    .unwrap();
    let upstream = loopback_http().await;
    let original = kube::config::Kubeconfig::from_yaml(&format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\ncontexts: [{{name: c, context: {{cluster: k, user: u}}}}]\n\
         clusters: [{{name: k, cluster: {{server: 'http://{upstream}'}}}}]\nusers: [{{name: u, user: {{token: t}}}}]\n"
    ))
    .unwrap();
    let dir = std::env::temp_dir().join(format!("netlab-bridge-{}", topo.prefix()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kubeconfig");
    let bridge = bridge_api_server(&topo, &original, &path).await.unwrap();

    let written = kube::config::Kubeconfig::read_from(&path).unwrap();
    let server = written.clusters[0]
        .cluster
        .as_ref()
        .unwrap()
        .server
        .clone()
        .unwrap();
    assert_eq!(server, "http://198.18.0.2:6443");
    let client = EchoClient::new(env!("CARGO_BIN_EXE_tandem-echo"));
    for node in topo.nodes() {
        let reply = client
            .http_get_async(&node.netns, &format!("{server}/version"))
            .await
            .unwrap();
        assert_eq!(reply.pod, "apiserver");
        assert!(
            reply.client.ip().is_loopback(),
            "the server sees the relay's host-side connection"
        );
    }

    bridge.relay.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
    tokio::task::spawn_blocking(move || drop(topo))
        .await
        .unwrap();
}
