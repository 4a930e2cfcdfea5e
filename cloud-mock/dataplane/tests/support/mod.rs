//! Backends and helpers for the data-plane tests. In the root namespace everything binds
//! on 127/8 only; the namespace tests (`netns`) bind inside namespaces they create.

#![allow(dead_code)]

pub mod netns;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use cloud_mock_dataplane::{
    BackendHealth, DataPlane, HealthCheck, Listener, LoadBalancer, Mode, Protocol,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};
use tokio::task::JoinHandle;

/// `127.77.<net>.<host>`: each test uses its own `net`.
pub fn addr(net: u8, host: u8) -> IpAddr {
    Ipv4Addr::new(127, 77, net, host).into()
}

/// A port free on `ip` for both TCP and UDP right now.
pub async fn free_port(ip: IpAddr) -> u16 {
    loop {
        let tcp = TcpListener::bind((ip, 0)).await.unwrap();
        let port = tcp.local_addr().unwrap().port();
        if UdpSocket::bind((ip, port)).await.is_ok() {
            return port;
        }
    }
}

/// Listeners on one port, free on every one of `ips` (a port free on one address may be
/// held on another by a connection of a test running beside).
pub async fn listen_on_all(ips: &[IpAddr]) -> (u16, Vec<TcpListener>) {
    'port: loop {
        let first = TcpListener::bind((ips[0], 0)).await.unwrap();
        let port = first.local_addr().unwrap().port();
        let mut listeners = vec![first];
        for &ip in &ips[1..] {
            match TcpListener::bind((ip, port)).await {
                Ok(listener) => listeners.push(listener),
                Err(_) => continue 'port,
            }
        }
        return (port, listeners);
    }
}

/// A task that is aborted when dropped.
pub struct Server(JoinHandle<()>);

impl Server {
    pub fn from_task(task: JoinHandle<()>) -> Self {
        Self(task)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// TCP backend: greets every connection with `name\n`, then echoes.
pub async fn tcp_backend(ip: IpAddr, port: u16, name: &'static str) -> Server {
    greet_on(TcpListener::bind((ip, port)).await.unwrap(), name)
}

/// Serves `listener` like `tcp_backend`.
pub fn greet_on(listener: TcpListener, name: &'static str) -> Server {
    Server(tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                if stream
                    .write_all(format!("{name}\n").as_bytes())
                    .await
                    .is_err()
                {
                    return;
                }
                let (mut read, mut write) = stream.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    }))
}

/// UDP backend: answers every datagram with `name:payload`.
pub async fn udp_backend(ip: IpAddr, port: u16, name: &'static str) -> Server {
    udp_greet_on(UdpSocket::bind((ip, port)).await.unwrap(), name)
}

/// Serves `socket` like `udp_backend`.
pub fn udp_greet_on(socket: UdpSocket, name: &'static str) -> Server {
    Server(tokio::spawn(async move {
        let mut buffer = [0_u8; 2048];
        while let Ok((length, peer)) = socket.recv_from(&mut buffer).await {
            let mut reply = format!("{name}:").into_bytes();
            reply.extend_from_slice(&buffer[..length]);
            let _ = socket.send_to(&reply, peer).await;
        }
    }))
}

/// HTTP health endpoint answering every request with the current `status`.
pub struct HealthServer {
    pub status: Arc<AtomicU16>,
    _server: Server,
}

impl HealthServer {
    pub async fn start(ip: IpAddr, port: u16) -> Self {
        Self::on(TcpListener::bind((ip, port)).await.unwrap())
    }

    /// Answers on `listener`.
    pub fn on(listener: TcpListener) -> Self {
        let status = Arc::new(AtomicU16::new(200));
        let current = Arc::clone(&status);
        let server = Server(tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let code = current.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut request = [0_u8; 1024];
                    let _ = stream.read(&mut request).await;
                    let answer = format!(
                        "HTTP/1.1 {code} Whatever\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                });
            }
        }));
        Self {
            status,
            _server: server,
        }
    }

    pub fn set(&self, code: u16) {
        self.status.store(code, Ordering::SeqCst);
    }
}

pub fn lb(id: &str, vip: IpAddr, listeners: Vec<Listener>, backends: Vec<IpAddr>) -> LoadBalancer {
    LoadBalancer {
        id: id.to_owned(),
        vips: vec![vip],
        mode: Mode::Proxy,
        listeners,
        backends,
        source_ranges: vec![],
    }
}

pub fn listener(
    protocol: Protocol,
    port: u16,
    backend_port: u16,
    check: Option<HealthCheck>,
) -> Listener {
    Listener {
        protocol,
        port,
        backend_port,
        health_check: check,
    }
}

/// Polls `condition` every 10 ms; the time it took, or a panic after `limit`.
pub async fn wait_for(
    what: &str,
    limit: Duration,
    mut condition: impl FnMut() -> bool,
) -> Duration {
    let start = Instant::now();
    while !condition() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    start.elapsed()
}

pub async fn wait_healthy(dataplane: &DataPlane, lb_id: &str, count: usize) {
    wait_for("backends healthy", Duration::from_secs(5), || {
        let health = dataplane.backend_health(lb_id);
        health.len() == count && health.iter().all(|(_, h)| *h == BackendHealth::Healthy)
    })
    .await;
}

/// Connects to `vip:port` from `source` (any when `None`) and returns the greeting.
pub async fn tcp_hello(
    source: Option<IpAddr>,
    vip: IpAddr,
    port: u16,
) -> std::io::Result<(TcpStream, String)> {
    let socket = if vip.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Some(source) = source {
        socket.bind(SocketAddr::new(source, 0))?;
    }
    let mut stream = tokio::time::timeout(
        Duration::from_secs(2),
        socket.connect(SocketAddr::new(vip, port)),
    )
    .await
    .map_err(|_| std::io::Error::other("connect timed out"))??;
    let greeting = read_line(&mut stream).await?;
    Ok((stream, greeting))
}

pub async fn read_line(stream: &mut TcpStream) -> std::io::Result<String> {
    let mut line = Vec::new();
    let mut byte = [0_u8; 1];
    loop {
        let read = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut byte))
            .await
            .map_err(|_| std::io::Error::other("read timed out"))??;
        if read == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "closed",
            ));
        }
        if byte[0] == b'\n' {
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
        line.push(byte[0]);
    }
}

/// Sends `payload` from `socket` to `vip:port`; the reply and who sent it, or `None`
/// when nothing comes back within `wait`.
pub async fn udp_ask(
    socket: &UdpSocket,
    vip: IpAddr,
    port: u16,
    payload: &str,
    wait: Duration,
) -> Option<(String, SocketAddr)> {
    socket
        .send_to(payload.as_bytes(), (vip, port))
        .await
        .unwrap();
    let mut buffer = [0_u8; 2048];
    match tokio::time::timeout(wait, socket.recv_from(&mut buffer)).await {
        Ok(Ok((length, from))) => Some((
            String::from_utf8_lossy(&buffer[..length]).into_owned(),
            from,
        )),
        _ => None,
    }
}

pub fn metrics_text(dataplane: &DataPlane) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    dataplane.register_metrics(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    text
}
