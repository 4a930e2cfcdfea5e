#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Mutual TLS: a server that requires a client certificate signed by its CA (rustls'
//! `WebPkiClientVerifier`, in process) answers a client given one, and refuses a client
//! without one or with a certificate of another CA; a renewed certificate written over the
//! files is shown from the next connection a second later.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cloud_mock_sdk::{Client, ClientIdentity, ClientOptions, Error};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use rustls::server::WebPkiClientVerifier;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// A CA of its own.
fn ca() -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A certificate and its key, PEM.
struct Pem {
    certificate_chain: String,
    private_key: String,
}

impl Pem {
    /// Written as `tls.crt` and `tls.key` in `dir`, as a Secret volume holds them.
    fn write(&self, dir: &Path) -> ClientIdentity {
        let identity = ClientIdentity {
            certificate_file: dir.join("tls.crt"),
            key_file: dir.join("tls.key"),
        };
        std::fs::write(&identity.certificate_file, &self.certificate_chain).unwrap();
        std::fs::write(&identity.key_file, &self.private_key).unwrap();
        identity
    }

    fn der(&self) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(self.certificate_chain.as_bytes()).unwrap()
    }
}

/// A directory of the test's own, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(label: &str) -> Self {
        let path = std::env::temp_dir().join(format!("sdk-mtls-{label}-{}", std::process::id()));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A certificate `ca` signed for `names`, for `purpose`, and its key, PEM.
fn leaf(
    ca: &CertifiedIssuer<'static, KeyPair>,
    names: &[&str],
    purpose: ExtendedKeyUsagePurpose,
) -> Pem {
    let mut params = CertificateParams::new(
        names
            .iter()
            .map(|name| (*name).to_owned())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    params.extended_key_usages = vec![purpose];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, ca).unwrap();
    Pem {
        certificate_chain: cert.pem(),
        private_key: key.serialize_pem(),
    }
}

/// The server: serving `tls` on 127.0.0.1, asking every client for a certificate of
/// `client_ca`, answering each request an empty pool list; `peers` collects the
/// certificate each accepted client showed.
struct Server {
    addr: SocketAddr,
    peers: Arc<Mutex<Vec<CertificateDer<'static>>>>,
    server_ca_pem: String,
}

impl Server {
    async fn start(client_ca: &CertifiedIssuer<'static, KeyPair>) -> Self {
        let server_ca = ca();
        let serving = leaf(
            &server_ca,
            &["127.0.0.1"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(client_ca.der().clone()).unwrap();
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .unwrap();
        let chain = CertificateDer::pem_slice_iter(serving.certificate_chain.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_slice(serving.private_key.as_bytes()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .unwrap();
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let peers = Arc::new(Mutex::new(Vec::new()));
        let seen = peers.clone();
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                let seen = seen.clone();
                tokio::spawn(async move {
                    // A refused client ends here, with the handshake.
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    if let Some(chain) = tls.get_ref().1.peer_certificates() {
                        seen.lock().unwrap().push(chain[0].clone().into_owned());
                    }
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let body = r#"{"items": []}"#;
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = tls.write_all(answer.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        Self {
            addr,
            peers,
            server_ca_pem: server_ca.pem(),
        }
    }

    fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    fn options(&self) -> ClientOptions {
        ClientOptions {
            timeout: Duration::from_secs(5),
            max_retries: 0,
            root_certificates: Some(self.server_ca_pem.clone()),
            ..ClientOptions::default()
        }
    }

    fn options_showing(&self, identity: &ClientIdentity) -> ClientOptions {
        ClientOptions {
            client_identity: Some(identity.clone()),
            ..self.options()
        }
    }
}

#[tokio::test]
async fn a_server_that_requires_a_client_certificate_takes_the_one_given() {
    let client_ca = ca();
    let server = Server::start(&client_ca).await;
    let dir = Dir::new("given");
    let first = leaf(
        &client_ca,
        &["tandem-controller"],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let identity = first.write(&dir.0);
    let client =
        Client::with_edges(&[&server.url()], "t", server.options_showing(&identity)).unwrap();
    assert!(client.list_pools().await.unwrap().is_empty());
    assert_eq!(*server.peers.lock().unwrap(), [first.der()]);

    // Renewed over the same files (cert-manager's way): shown once a second has passed.
    let renewed = leaf(
        &client_ca,
        &["tandem-controller"],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    renewed.write(&dir.0);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(client.list_pools().await.unwrap().is_empty());
    assert_eq!(
        server.peers.lock().unwrap().last(),
        Some(&renewed.der()),
        "the renewed certificate, without a new client"
    );
    server.peers.lock().unwrap().clear();

    let anonymous = Client::new(&server.url(), "t", server.options()).unwrap();
    let refused = anonymous.list_pools().await;
    assert!(matches!(refused, Err(Error::Transport(_))), "{refused:?}");

    let stranger_dir = Dir::new("stranger");
    let stranger = leaf(&ca(), &["intruder"], ExtendedKeyUsagePurpose::ClientAuth);
    let stranger = stranger.write(&stranger_dir.0);
    let stranger =
        Client::with_edges(&[&server.url()], "t", server.options_showing(&stranger)).unwrap();
    let refused = stranger.list_pools().await;
    assert!(matches!(refused, Err(Error::Transport(_))), "{refused:?}");
    assert_eq!(server.peers.lock().unwrap().len(), 0, "neither was let in");
}
