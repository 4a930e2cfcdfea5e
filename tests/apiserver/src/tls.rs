//! One port, two protocols: TLS (kubectl sends bearer tokens only over https) and plain
//! HTTP (for clients without TLS). The first byte of a connection decides: 0x16 opens a
//! TLS handshake. The certificate is generated at start-up, signed by a fresh CA whose
//! PEM goes into the kubeconfig.

use std::io;
use std::net::{IpAddr, SocketAddr};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};
use tandem_common::tls::{Connection, PlainHttp, TlsAcceptor, TlsListener};
use tokio::net::TcpListener;
use tokio_rustls::rustls::pki_types::PrivatePkcs8KeyDer;
use tokio_util::sync::CancellationToken;

/// DNS names the serving certificate carries besides IP addresses, so relays can set
/// `tls-server-name`.
pub const SERVER_NAMES: [&str; 3] = ["localhost", "tandem-apiserver", "kubernetes.default.svc"];

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("generating the certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error(transparent)]
    Config(#[from] tandem_common::tls::TlsError),
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

    let key_der = PrivatePkcs8KeyDer::from(key.serialize_der()).into();
    Ok(Identity {
        ca_pem: ca.pem(),
        acceptor: tandem_common::tls::acceptor(
            vec![cert.der().clone(), ca.der().clone()],
            key_der,
        )?,
    })
}

/// The API server's port: TLS and plain HTTP on one port, as the module comment says.
pub struct DualListener(TlsListener);

impl DualListener {
    pub fn new(
        listener: TcpListener,
        acceptor: TlsAcceptor,
        shutdown: CancellationToken,
    ) -> io::Result<Self> {
        TlsListener::new(listener, acceptor, PlainHttp::Allowed, shutdown).map(Self)
    }
}

impl axum::serve::Listener for DualListener {
    type Io = Connection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        self.0.accept().await
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.0.local_addr()
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
