//! One port, two protocols: TLS (kubectl sends bearer tokens only over https) and plain
//! HTTP (for clients without TLS). The first byte of a connection decides: 0x16 opens a
//! TLS handshake. The certificate is generated at start-up, signed by a fresh CA whose
//! PEM goes into the kubeconfig.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

/// DNS names the serving certificate carries besides IP addresses, so relays can set
/// `tls-server-name`.
pub const SERVER_NAMES: [&str; 3] = ["localhost", "tandem-apiserver", "kubernetes.default.svc"];

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("generating the certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("configuring TLS: {0}")]
    Config(#[from] rustls::Error),
}

/// The generated CA (trusted by kubeconfigs) and the server's TLS acceptor.
#[derive(Clone)]
pub struct Identity {
    pub ca_pem: String,
    pub acceptor: TlsAcceptor,
}

/// A CA and a serving certificate for `ips` plus [`SERVER_NAMES`].
pub fn generate(ips: &[IpAddr]) -> Result<Identity, TlsError> {
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "tandem-apiserver-ca");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;

    let mut params = CertificateParams::new(
        SERVER_NAMES
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>(),
    )?;
    params
        .distinguished_name
        .push(DnType::CommonName, "tandem-apiserver");
    for ip in ips {
        if !params.subject_alt_names.contains(&SanType::IpAddress(*ip)) {
            params.subject_alt_names.push(SanType::IpAddress(*ip));
        }
    }
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &ca)?;

    let key_der = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der())
        .map_err(|e| rustls::Error::General(e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone(), ca.der().clone()], key_der)?;
    // axum serves HTTP/1.1 here; offering h2 would leave h2 clients hanging.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Identity {
        ca_pem: ca.pem(),
        acceptor: TlsAcceptor::from(Arc::new(config)),
    })
}

/// An accepted connection, plain or TLS.
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

/// A listener handing axum ready connections; handshakes run in their own tasks so a slow
/// client never holds up others.
pub struct DualListener {
    ready: mpsc::Receiver<(Connection, SocketAddr)>,
    local: SocketAddr,
}

impl DualListener {
    pub fn new(
        listener: TcpListener,
        acceptor: TlsAcceptor,
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
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, classify(stream, acceptor)).await
                    {
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

async fn classify(stream: TcpStream, acceptor: TlsAcceptor) -> io::Result<Connection> {
    let mut first = [0u8; 1];
    let n = stream.peek(&mut first).await?;
    if n == 1 && first[0] == 0x16 {
        Ok(Connection::Tls(Box::new(acceptor.accept(stream).await?)))
    } else {
        Ok(Connection::Plain(stream))
    }
}

impl axum::serve::Listener for DualListener {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_a_ca_and_serving_certificate() {
        let identity = generate(&["127.0.0.1".parse().unwrap()]).unwrap();
        assert!(identity.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
    }
}
