//! Measures the TCP proxy against the physical limit in the same run: the same work over
//! a direct loopback connection to the backend. Prints the ratios; fails only when the
//! proxy is far off (a regression such as per-byte copies or a serialised accept loop).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::IpAddr;
use std::time::{Duration, Instant};

use cloud_mock_dataplane::{DataPlane, DataPlaneConfig, Protocol};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::*;

const VOLUME: usize = 64 << 20;
const CHUNK: usize = 64 << 10;
const CONNECTIONS: usize = 200;

/// Backend that drains each connection and answers with the byte count when it ends.
async fn sink(ip: IpAddr, port: u16) -> Server {
    let listener = TcpListener::bind((ip, port)).await.unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = vec![0_u8; CHUNK];
                let mut total: u64 = 0;
                loop {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => break,
                        Ok(read) => total += read as u64,
                    }
                }
                let _ = stream.write_all(&total.to_be_bytes()).await;
            });
        }
    });
    Server::from_task(task)
}

/// Seconds to push `VOLUME` bytes to `ip:port` and get the backend's count back.
async fn transfer(ip: IpAddr, port: u16) -> f64 {
    let chunk = vec![7_u8; CHUNK];
    let start = Instant::now();
    let mut stream = TcpStream::connect((ip, port)).await.unwrap();
    for _ in 0..VOLUME / CHUNK {
        stream.write_all(&chunk).await.unwrap();
    }
    stream.shutdown().await.unwrap();
    let mut count = [0_u8; 8];
    stream.read_exact(&mut count).await.unwrap();
    assert_eq!(u64::from_be_bytes(count), VOLUME as u64);
    start.elapsed().as_secs_f64()
}

/// Seconds for `CONNECTIONS` sequential connect + one byte + answer round trips.
async fn connection_round_trips(ip: IpAddr, port: u16) -> f64 {
    let start = Instant::now();
    for _ in 0..CONNECTIONS {
        let mut stream = TcpStream::connect((ip, port)).await.unwrap();
        stream.write_all(b"x").await.unwrap();
        stream.shutdown().await.unwrap();
        let mut count = [0_u8; 8];
        stream.read_exact(&mut count).await.unwrap();
    }
    start.elapsed().as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_against_direct_loopback() {
    let (vip, backend) = (addr(210, 1), addr(210, 11));
    let backend_port = free_port(backend).await;
    let _sink = sink(backend, backend_port).await;
    let port = free_port(vip).await;
    let dataplane = DataPlane::new(DataPlaneConfig::default());
    let lb = lb(
        "lb-bench",
        vip,
        vec![listener(Protocol::Tcp, port, backend_port, None)],
        vec![backend],
    );
    dataplane.apply(vec![lb]).await.unwrap();

    let direct = transfer(backend, backend_port).await;
    let proxied = transfer(vip, port).await;
    let mib = (VOLUME >> 20) as f64;
    println!(
        "throughput: direct {:.0} MiB/s, proxied {:.0} MiB/s, proxied/direct = {:.2}",
        mib / direct,
        mib / proxied,
        direct / proxied
    );
    let direct_rate = connection_round_trips(backend, backend_port).await;
    let proxied_rate = connection_round_trips(vip, port).await;
    println!(
        "connections: direct {:.0}/s, proxied {:.0}/s, proxied/direct = {:.2}",
        CONNECTIONS as f64 / direct_rate,
        CONNECTIONS as f64 / proxied_rate,
        direct_rate / proxied_rate
    );
    // A proxy does at least twice the socket work of a direct connection; far below a
    // tenth of the direct figure something is wrong.
    assert!(direct / proxied > 0.1, "proxied throughput collapsed");
    assert!(
        direct_rate / proxied_rate > 0.1,
        "proxied connection rate collapsed"
    );
    assert!(proxied < Duration::from_secs(20).as_secs_f64());
    dataplane.shutdown().await;
}
