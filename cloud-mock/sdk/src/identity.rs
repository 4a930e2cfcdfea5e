//! The client certificate shown to an edge that asks for one (mutual TLS): PEM files, read
//! again when they change, so that a renewed certificate is shown without a restart.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rustls::SignatureScheme;
use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

use crate::error::TlsError;

/// How long a read of the files is trusted: a handshake after that reads them again.
const RECHECK: Duration = Duration::from_secs(1);

/// The certificate a client shows an `https` server that asks for one (as `curl --cert
/// --key`): PEM files as a `kubernetes.io/tls` Secret mounts them (`tls.crt`, `tls.key`).
/// Read when the client is built (a bad pair is an error then), and again at a new
/// connection's handshake once a second has passed: a changed pair is shown from then on,
/// one that does not parse keeps the pair read last (with a warning).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    /// The client's certificate first, then the intermediates up to the server's CA.
    pub certificate_file: PathBuf,
    /// PKCS#8, PKCS#1 (RSA) or SEC1 (EC) private key of the first certificate.
    pub key_file: PathBuf,
}

/// What one read of the two files found.
type Contents = (Vec<u8>, Vec<u8>);

impl ClientIdentity {
    fn read(&self) -> Result<Contents, TlsError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::ClientIdentityFile {
                path: path.to_path_buf(),
                source,
            })
        };
        Ok((read(&self.certificate_file)?, read(&self.key_file)?))
    }
}

/// The chain and key of `contents`, each refused with its own error when it is not PEM of
/// its kind, and the key refused when it is not the certificate's.
fn certified(
    (chain, key): &Contents,
    provider: &CryptoProvider,
) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(chain)
        .collect::<Result<Vec<_>, _>>()
        .map_err(TlsError::ClientCertificate)?;
    if chain.is_empty() {
        return Err(TlsError::ClientCertificate(pem::Error::NoItemsFound));
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(TlsError::ClientKey)?;
    CertifiedKey::from_der(chain, key, provider)
        .map(Arc::new)
        .map_err(TlsError::ClientIdentity)
}

/// The resolver rustls asks at each handshake.
#[derive(Debug)]
pub(crate) struct ReloadingIdentity {
    files: ClientIdentity,
    provider: Arc<CryptoProvider>,
    loaded: Mutex<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    read_at: Instant,
    /// What was read last, taken or not: a broken pair is warned about once.
    contents: Contents,
    key: Arc<CertifiedKey>,
}

impl ReloadingIdentity {
    pub(crate) fn load(
        files: &ClientIdentity,
        provider: Arc<CryptoProvider>,
    ) -> Result<Self, TlsError> {
        let contents = files.read()?;
        let key = certified(&contents, &provider)?;
        Ok(Self {
            files: files.clone(),
            provider,
            loaded: Mutex::new(Loaded {
                read_at: Instant::now(),
                contents,
                key,
            }),
        })
    }

    /// The pair to show now, read again if the last read is older than [`RECHECK`].
    fn current(&self) -> Arc<CertifiedKey> {
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        if loaded.read_at.elapsed() >= RECHECK {
            loaded.read_at = Instant::now();
            match self.files.read() {
                Ok(contents) if contents != loaded.contents => {
                    match certified(&contents, &self.provider) {
                        Ok(key) => {
                            tracing::info!(
                                certificate = %self.files.certificate_file.display(),
                                "client certificate changed: showing the new one"
                            );
                            loaded.key = key;
                        }
                        Err(error) => tracing::warn!(
                            %error,
                            "client certificate refused: the one read last is still shown"
                        ),
                    }
                    loaded.contents = contents;
                }
                Ok(_) => {}
                // A Secret volume swaps its files in one rename; a read between is rare.
                Err(error) => tracing::warn!(
                    %error,
                    "client certificate unreadable: the one read last is still shown"
                ),
            }
        }
        loaded.key.clone()
    }
}

impl ResolvesClientCert for ReloadingIdentity {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory removed on drop.
    struct Dir(PathBuf);

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn dir(label: &str) -> Dir {
        let path = std::env::temp_dir().join(format!(
            "cloud-mock-sdk-{label}-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&path).unwrap();
        Dir(path)
    }

    /// A self-signed certificate for `name` and its key, PEM.
    fn pair(name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn write(dir: &Dir, (cert, key): &(String, String)) -> ClientIdentity {
        let files = ClientIdentity {
            certificate_file: dir.0.join("tls.crt"),
            key_file: dir.0.join("tls.key"),
        };
        std::fs::write(&files.certificate_file, cert).unwrap();
        std::fs::write(&files.key_file, key).unwrap();
        files
    }

    fn provider() -> Arc<CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    fn leaf(key: &CertifiedKey) -> Vec<u8> {
        key.cert[0].to_vec()
    }

    #[test]
    fn a_pair_that_is_not_one_is_refused_by_what_is_wrong() {
        let dir = dir("refused");
        let good = pair("tandem-controller");
        let load = |pair: (&str, &str)| {
            let files = write(&dir, &(pair.0.to_owned(), pair.1.to_owned()));
            ReloadingIdentity::load(&files, provider()).map(|_| ())
        };
        assert!(load((&good.0, &good.1)).is_ok());
        for bad_chain in ["", "not PEM", good.1.as_str()] {
            let refused = load((bad_chain, &good.1));
            assert!(
                matches!(refused, Err(TlsError::ClientCertificate(_))),
                "{bad_chain:?}: {refused:?}"
            );
        }
        let garbled = "-----BEGIN PRIVATE KEY-----\nnot base64!\n-----END PRIVATE KEY-----\n";
        for bad_key in ["", good.0.as_str(), garbled] {
            let refused = load((&good.0, bad_key));
            assert!(
                matches!(refused, Err(TlsError::ClientKey(_))),
                "{bad_key:?}: {refused:?}"
            );
        }
        let other = pair("someone-else");
        assert!(matches!(
            load((&good.0, &other.1)),
            Err(TlsError::ClientIdentity(_))
        ));
        let missing = ClientIdentity {
            certificate_file: dir.0.join("none.crt"),
            key_file: dir.0.join("none.key"),
        };
        assert!(matches!(
            ReloadingIdentity::load(&missing, provider()),
            Err(TlsError::ClientIdentityFile { .. })
        ));
    }

    #[test]
    fn a_renewed_pair_is_shown_after_a_second_and_a_broken_one_never() {
        let dir = dir("renewed");
        let first = pair("tandem-controller");
        let files = write(&dir, &first);
        let identity = ReloadingIdentity::load(&files, provider()).unwrap();
        let shown_first = leaf(&identity.current());

        let renewed = pair("tandem-controller");
        write(&dir, &renewed);
        assert_eq!(leaf(&identity.current()), shown_first, "within the second");
        std::thread::sleep(RECHECK + Duration::from_millis(50));
        let shown_renewed = leaf(&identity.current());
        assert_ne!(shown_renewed, shown_first, "the renewal is shown");

        // A key of another certificate keeps the pair read last.
        std::fs::write(&files.key_file, pair("other").1).unwrap();
        std::thread::sleep(RECHECK + Duration::from_millis(50));
        assert_eq!(leaf(&identity.current()), shown_renewed);
    }
}
