#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The edge's API over TLS: an in-process server given a certificate and key (made here by
//! rcgen, signed by a CA of the test) answers HTTPS to a client that trusts the CA, and
//! refuses plain HTTP and clients that trust another CA; the SDK given the CA's PEM talks
//! to it.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cloud_mock::Settings;
use cloud_mock::server::{TlsFiles, serve_on};
use cloud_mock_dataplane::{DataPlaneConfig, DataPlaneKind};
use cloud_mock_sdk::{Client, ClientOptions, Error};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{self, RootCertStore};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "tls-test-token";

/// A CA, and a serving certificate it signed for 127.0.0.1 and `localhost`.
struct Pki {
    ca: CertificateDer<'static>,
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

fn pki() -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let params = CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca).unwrap();
    Pki {
        ca: ca.der().clone(),
        ca_pem: ca.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    }
}

/// An edge serving HTTPS with `pki`'s certificate, from files in its own directory;
/// stopped, and the directory removed, on drop.
struct Edge {
    addr: SocketAddr,
    cancel: CancellationToken,
    dir: PathBuf,
}

impl Edge {
    async fn start(pki: &Pki) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "cloud-mock-tls-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let tls = TlsFiles {
            cert_file: dir.join("tls.crt"),
            key_file: dir.join("tls.key"),
        };
        std::fs::write(&tls.cert_file, &pki.cert_pem).unwrap();
        std::fs::write(&tls.key_file, &pki.key_pem).unwrap();
        let settings = Settings {
            data_dir: dir.join("data"),
            store: cloud_mock::store::StoreSettings::Redb,
            token: TOKEN.into(),
            vip_pools: "127.77.0.0/24".parse().unwrap(),
            provisioning_delay: Duration::ZERO,
            fault_injection: false,
            l2: None,
            dataplane: DataPlaneConfig {
                mode: DataPlaneKind::None,
                ..DataPlaneConfig::default()
            },
        };
        let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        tokio::spawn(async move {
            serve_on(&settings, listener, Some(&tls), stop)
                .await
                .unwrap();
        });
        Self { addr, cancel, dir }
    }
}

impl Drop for Edge {
    fn drop(&mut self) {
        self.cancel.cancel();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn connector(trusted: &CertificateDer<'static>) -> TlsConnector {
    let mut roots = RootCertStore::empty();
    roots.add(trusted.clone()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

fn list_pools_request() -> String {
    format!(
        "GET /v1/pools HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\
         Connection: close\r\n\r\n"
    )
}

#[tokio::test]
async fn answers_https_to_a_client_trusting_its_ca() {
    let pki = pki();
    let edge = Edge::start(&pki).await;
    let tcp = TcpStream::connect(edge.addr).await.unwrap();
    let mut tls = connector(&pki.ca)
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap();
    tls.write_all(list_pools_request().as_bytes())
        .await
        .unwrap();
    let mut answer = String::new();
    tls.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("127.77.0.0/24"), "{answer}");
}

#[tokio::test]
async fn refuses_plain_http() {
    let pki = pki();
    let edge = Edge::start(&pki).await;
    let mut tcp = TcpStream::connect(edge.addr).await.unwrap();
    tcp.write_all(list_pools_request().as_bytes())
        .await
        .unwrap();
    let mut answer = Vec::new();
    // The handshake fails on the first bytes: the edge closes the connection, at most
    // after a TLS alert; no HTTP answer comes back.
    let read = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut answer))
        .await
        .expect("the edge neither answered nor closed");
    assert!(
        read.is_err() || !answer.starts_with(b"HTTP/"),
        "plain HTTP got an answer: {}",
        String::from_utf8_lossy(&answer)
    );
}

#[tokio::test]
async fn a_client_trusting_another_ca_does_not_connect() {
    // Another CA, which signed nothing the edge serves.
    let other = pki().ca;
    let pki = pki();
    let edge = Edge::start(&pki).await;
    let tcp = TcpStream::connect(edge.addr).await.unwrap();
    let refused = connector(&other)
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("invalid peer certificate"),
        "{refused}"
    );
}

fn sdk(url: &str, root_certificates: Option<&str>) -> Client {
    let options = ClientOptions {
        timeout: Duration::from_secs(5),
        max_retries: 0,
        root_certificates: root_certificates.map(str::to_owned),
        ..ClientOptions::default()
    };
    Client::new(url, TOKEN, options).unwrap()
}

#[tokio::test]
async fn the_sdk_trusts_the_ca_it_is_given() {
    let pki = pki();
    let edge = Edge::start(&pki).await;
    let https = format!("https://{}", edge.addr);
    let pools = sdk(&https, Some(&pki.ca_pem)).list_pools().await.unwrap();
    assert_eq!(pools.len(), 1, "{pools:?}");
    // Without the CA it trusts only the platform's roots, which never signed this edge.
    let untrusting = sdk(&https, None).list_pools().await;
    assert!(
        matches!(untrusting, Err(Error::Transport(_))),
        "{untrusting:?}"
    );
    // Plain HTTP to the TLS port gets no answer.
    let plain = sdk(&format!("http://{}", edge.addr), Some(&pki.ca_pem))
        .list_pools()
        .await;
    assert!(matches!(plain, Err(Error::Transport(_))), "{plain:?}");
}
