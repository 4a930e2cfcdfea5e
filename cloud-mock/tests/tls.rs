#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The edge's API over TLS: an in-process server given a certificate and key (made here by
//! rcgen, signed by a CA of the test) answers HTTPS to a client that trusts the CA, and
//! refuses plain HTTP and clients that trust another CA; the SDK given the CA's PEM talks
//! to it. With a client CA (mutual TLS) a client certificate names its tenant.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cloud_mock::credentials::TokenSource;
use cloud_mock::server::{TlsFiles, serve_on};
use cloud_mock::{Settings, test_edge};
use cloud_mock_sdk::{Client, ClientOptions, Error};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
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
        Self::start_with(pki, None, None).await
    }

    /// With `tenants` (a tenants file's text) instead of the token, and with `client_ca`
    /// (PEM), mutual TLS.
    async fn start_with(pki: &Pki, tenants: Option<&str>, client_ca: Option<&str>) -> Self {
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
            client_ca_file: client_ca.map(|_| dir.join("client-ca.crt")),
        };
        std::fs::write(&tls.cert_file, &pki.cert_pem).unwrap();
        std::fs::write(&tls.key_file, &pki.key_pem).unwrap();
        if let (Some(path), Some(pem)) = (&tls.client_ca_file, client_ca) {
            std::fs::write(path, pem).unwrap();
        }
        let token = match tenants {
            Some(text) => {
                let path = dir.join("tenants.json");
                std::fs::write(&path, text).unwrap();
                TokenSource::Tenants(path)
            }
            None => TOKEN.into(),
        };
        let settings = Settings {
            fault_injection: false,
            ..test_edge::api_only(&dir.join("data"), token, "127.77.0.0/24")
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

/// A CA for client certificates, and one it signed with `common_name` as the subject.
fn client_ca() -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

fn client_certificate(
    ca: &CertifiedIssuer<'static, KeyPair>,
    common_name: &str,
) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, ca).unwrap();
    (
        cert.der().clone(),
        PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
    )
}

/// `GET /v1/loadbalancers` over TLS trusting `ca`, showing `identity` and `token` if
/// given: the status line, or why there was none.
async fn list_as(
    edge: &Edge,
    ca: &CertificateDer<'static>,
    identity: Option<(CertificateDer<'static>, PrivateKeyDer<'static>)>,
    token: Option<&str>,
) -> Result<String, std::io::Error> {
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates({
        let mut roots = RootCertStore::empty();
        roots.add(ca.clone()).unwrap();
        roots
    });
    let config = match identity {
        Some((cert, key)) => builder.with_client_auth_cert(vec![cert], key).unwrap(),
        None => builder.with_no_client_auth(),
    };
    let tcp = TcpStream::connect(edge.addr).await?;
    let mut tls = TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await?;
    let authorization = token.map_or_else(String::new, |token| {
        format!("Authorization: Bearer {token}\r\n")
    });
    let request = format!(
        "GET /v1/loadbalancers HTTP/1.1\r\nHost: 127.0.0.1\r\n{authorization}Connection: close\r\n\r\n"
    );
    tls.write_all(request.as_bytes()).await?;
    let mut answer = String::new();
    tls.read_to_string(&mut answer).await?;
    Ok(answer.lines().next().unwrap_or_default().to_owned())
}

#[tokio::test]
async fn a_client_certificate_of_the_client_ca_names_its_tenant() {
    let sha256 = |token: &str| {
        use sha2::Digest;
        data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(token.as_bytes()))
    };
    let tenants = format!(
        r#"{{"tenants": [
          {{"name": "team-a", "clusters": ["ca"], "pools": ["default"],
            "credentials": [{{"id": "a", "sha256": "{}"}}]}},
          {{"name": "team-b", "clusters": ["cb"], "pools": ["default"],
            "credentials": [{{"id": "b", "sha256": "{}"}}]}}]}}"#,
        sha256("a-token"),
        sha256("b-token")
    );
    let pki = pki();
    let clients = client_ca();
    let edge = Edge::start_with(&pki, Some(&tenants), Some(&clients.pem())).await;
    let ok = "HTTP/1.1 200 OK";
    let refused = "HTTP/1.1 401 Unauthorized";
    let as_a = || Some(client_certificate(&clients, "team-a"));
    assert_eq!(list_as(&edge, &pki.ca, as_a(), None).await.unwrap(), ok);
    assert_eq!(
        list_as(&edge, &pki.ca, as_a(), Some("a-token"))
            .await
            .unwrap(),
        ok
    );
    assert_eq!(
        list_as(&edge, &pki.ca, as_a(), Some("b-token"))
            .await
            .unwrap(),
        refused,
        "a certificate and a token of two tenants"
    );
    assert_eq!(
        list_as(
            &edge,
            &pki.ca,
            Some(client_certificate(&clients, "nobody")),
            None
        )
        .await
        .unwrap(),
        refused,
        "no tenant of that name"
    );
    assert_eq!(
        list_as(&edge, &pki.ca, None, Some("b-token"))
            .await
            .unwrap(),
        ok,
        "a token alone, as without mutual TLS"
    );
    assert_eq!(list_as(&edge, &pki.ca, None, None).await.unwrap(), refused);
    // A certificate of another CA is refused in the handshake (TLS 1.3: at the first read).
    let forged = Some(client_certificate(&client_ca(), "team-a"));
    let answer = list_as(&edge, &pki.ca, forged, None).await;
    assert!(
        answer.as_ref().is_err() || answer.as_ref().is_ok_and(String::is_empty),
        "{answer:?}"
    );
}
