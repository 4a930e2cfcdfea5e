//! Serving HTTPS through `axum::serve`, written once for the mock cloud's API and the API
//! server stand-in: a rustls acceptor with the ring provider (from PEM files or from DER,
//! optionally asking clients for a certificate of a given CA), a listener that completes
//! each handshake in its own task, so a slow or silent client never holds up the others,
//! and graceful shutdown works as with a `TcpListener`, and the name of a connection's
//! verified client certificate for the handlers ([`PeerCertificate`]).

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use sha2::Digest;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

pub use tokio_rustls::TlsAcceptor;

/// Time a new connection has to complete its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading PEM from {path}: {source}")]
    Pem {
        path: PathBuf,
        #[source]
        source: pem::Error,
    },
    #[error("{path} holds no certificate")]
    NoCertificate { path: PathBuf },
    #[error("the client CA certificates of {path}: {source}")]
    ClientRoots {
        path: PathBuf,
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
    #[error("configuring TLS: {0}")]
    Config(#[from] rustls::Error),
}

/// An acceptor serving `chain` (the server's certificate first) with `key`, over TLS 1.2
/// or 1.3 with the ring provider. It offers only HTTP/1.1 by ALPN: axum's server speaks
/// both versions, but an h2 client meeting an HTTP/1.1-only peer would hang.
pub fn acceptor(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<TlsAcceptor, TlsError> {
    server_config(chain, key, None)
}

fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    client_verifier: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
) -> Result<TlsAcceptor, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?;
    let mut config = match client_verifier {
        Some(verifier) => builder.with_client_cert_verifier(verifier),
        None => builder.with_no_client_auth(),
    }
    .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The certificates of a PEM file, at least one.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem_error = |source| TlsError::Pem {
        path: path.to_path_buf(),
        source,
    };
    let certificates = CertificateDer::pem_file_iter(path)
        .map_err(pem_error)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_error)?;
    if certificates.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certificates)
}

/// [`acceptor`] from PEM files: the certificate chain (server certificate first) and its
/// private key (PKCS#8, PKCS#1 or SEC1). With `client_ca_file`, clients are asked for a
/// certificate: one signed by those CAs is verified and its name handed on
/// ([`PeerCertificate`]), one signed by another is refused in the handshake, and a client
/// that shows none is let through (it may prove itself otherwise, with a bearer token).
pub fn acceptor_from_pem_files(
    cert_file: &Path,
    key_file: &Path,
    client_ca_file: Option<&Path>,
) -> Result<TlsAcceptor, TlsError> {
    let chain = certificates(cert_file)?;
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|source| TlsError::Pem {
        path: key_file.to_path_buf(),
        source,
    })?;
    let verifier = client_ca_file
        .map(|path| {
            let mut roots = rustls::RootCertStore::empty();
            for certificate in certificates(path)? {
                roots.add(certificate)?;
            }
            rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                Arc::new(rustls::crypto::ring::default_provider()),
            )
            .allow_unauthenticated()
            .build()
            .map_err(|source| TlsError::ClientRoots {
                path: path.to_path_buf(),
                source,
            })
        })
        .transpose()?;
    server_config(chain, key, verifier)
}

/// The verified client certificate of a connection, as [`axum::extract::ConnectInfo`]
/// (`Router::into_make_service_with_connect_info`): its subject's common name and the
/// SHA-256 of the certificate, or `None` for a client that showed none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerCertificate(pub Option<ClientName>);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientName {
    pub common_name: String,
    pub sha256: [u8; 32],
}

impl ClientName {
    /// The name of a DER certificate: its subject's first common name.
    pub fn of(certificate: &[u8]) -> Option<Self> {
        let (_, parsed) = x509_parser::parse_x509_certificate(certificate).ok()?;
        let common_name = parsed
            .subject()
            .iter_common_name()
            .next()?
            .as_str()
            .ok()?
            .to_owned();
        let sha256 = sha2::Sha256::digest(certificate).into();
        Some(Self {
            common_name,
            sha256,
        })
    }
}

impl Connection {
    /// The client's certificate, verified in the handshake (rustls keeps only those).
    fn peer_certificate(&self) -> PeerCertificate {
        let name = match self {
            Connection::Plain(_) => None,
            Connection::Tls(stream) => stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(|certificate| ClientName::of(certificate)),
        };
        PeerCertificate(name)
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, TlsListener>>
    for PeerCertificate
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, TlsListener>) -> Self {
        stream.io().peer_certificate()
    }
}

/// Whether a [`TlsListener`] also takes clients that do not start with a TLS handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlainHttp {
    /// Every connection must complete a TLS handshake; others are closed.
    Refused,
    /// The first byte decides: 0x16 opens a TLS handshake, anything else is plain HTTP
    /// (for a port that serves both, like the API server stand-in's).
    Allowed,
}

/// An accepted connection, plain (only with [`PlainHttp::Allowed`]) or TLS.
pub enum Connection {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Connection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Connection::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Connection::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Connection::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Connection::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Connection::Plain(s) => Pin::new(s).poll_flush(cx),
            Connection::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Connection::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Connection::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A listener handing `axum::serve` connections whose handshake is done. The accept loop
/// ends when `shutdown` is cancelled.
pub struct TlsListener {
    ready: mpsc::Receiver<(Connection, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    pub fn new(
        listener: TcpListener,
        acceptor: TlsAcceptor,
        plain: PlainHttp,
        shutdown: CancellationToken,
    ) -> io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, ready) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = shutdown.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let (stream, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let tx = tx.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let setup =
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, set_up(stream, acceptor, plain));
                    match setup.await {
                        Ok(Ok(connection)) => {
                            // The server stopped accepting: the connection is simply dropped.
                            let _ = tx.send((connection, peer)).await;
                        }
                        Ok(Err(error)) => tracing::debug!(%peer, %error, "connection setup failed"),
                        Err(_) => tracing::debug!(%peer, "connection setup timed out"),
                    }
                });
            }
        });
        Ok(Self { ready, local })
    }
}

async fn set_up(
    stream: TcpStream,
    acceptor: TlsAcceptor,
    plain: PlainHttp,
) -> io::Result<Connection> {
    if plain == PlainHttp::Allowed {
        let mut first = [0u8; 1];
        let n = stream.peek(&mut first).await?;
        if n != 1 || first[0] != 0x16 {
            return Ok(Connection::Plain(stream));
        }
    }
    Ok(Connection::Tls(Box::new(acceptor.accept(stream).await?)))
}

impl axum::serve::Listener for TlsListener {
    type Io = Connection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(connection) => connection,
            // The accept loop ended (shutdown); axum stops asking once it shuts down.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}
