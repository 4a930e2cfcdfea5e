//! Typed errors of the client.

use std::fmt;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("not found: {message}")]
    NotFound { message: String },
    /// The requested VIP is taken, or the version sent in `If-Match` is stale; `code` is
    /// the cloud's error code (`vip-taken`, `version-mismatch`, ...) when it sent one.
    #[error("conflict: {}", coded(.code, .message))]
    Conflict {
        code: Option<String>,
        message: String,
    },
    #[error("rate limited: retry after {retry_after:?}")]
    RateLimited { retry_after: Duration },
    #[error("cloud unavailable: {message}")]
    Unavailable { message: String },
    /// The request was rejected as invalid; sending it again will not help.
    #[error("invalid request: {}", coded(.code, .message))]
    Invalid {
        code: Option<String>,
        message: String,
    },
    /// 401: the token is missing or not one the cloud knows.
    #[error("unauthorized: the cloud rejected the token")]
    Unauthorized,
    /// 403: the credential is known but may not do this (its tenant's quota, VIP pools or
    /// clusters, or an admin route); `code` is the cloud's (`quota-exceeded`,
    /// `pool-not-permitted`, `cluster-not-permitted`, `forbidden`) when it sent one.
    #[error("forbidden: {}", coded(.code, .message))]
    Forbidden {
        code: Option<String>,
        message: String,
    },
    /// The request failed below HTTP: no connection (to a client's one edge), a timeout, a
    /// connection closed before the answer.
    #[error("transport: {0}")]
    Transport(#[source] reqwest::Error),
    /// None of a client's several edges took the connection; each with why, in the order
    /// they were tried. Nothing was sent.
    #[error(
        "no cloud edge could be reached: {}",
        .0.iter().map(EdgeFailure::to_string).collect::<Vec<_>>().join(", ")
    )]
    Unreachable(Vec<EdgeFailure>),
    #[error("cannot decode the cloud's answer: {0}")]
    Decode(#[source] serde_json::Error),
    /// The client could not be built: only [`crate::Client::new`] and
    /// [`crate::Client::with_edges`] return it.
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
}

/// Why the client's TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("root certificates: {0}")]
    RootCertificates(#[source] rustls::pki_types::pem::Error),
    #[error("client certificate: {0}")]
    ClientCertificate(#[source] rustls::pki_types::pem::Error),
    #[error("client key: {0}")]
    ClientKey(#[source] rustls::pki_types::pem::Error),
    #[error("client certificate or key file {path}: {source}")]
    ClientIdentityFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The key is of a kind the provider cannot sign with, or is not the certificate's.
    #[error("client certificate and key: {0}")]
    ClientIdentity(#[source] rustls::Error),
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
}

/// An edge that did not take a connection, and why.
#[derive(Debug)]
pub struct EdgeFailure {
    /// The edge's base URL.
    pub edge: String,
    pub error: reqwest::Error,
}

impl fmt::Display for EdgeFailure {
    /// The edge and the innermost cause (`connection refused`), which reqwest's own message
    /// (`error sending request for url …`) leaves to its sources.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut cause: &dyn std::error::Error = &self.error;
        while let Some(source) = cause.source() {
            cause = source;
        }
        write!(f, "{} ({cause})", self.edge)
    }
}

/// `code: message`, the way the cloud's JSON error reads, or the message alone.
pub(crate) fn coded(code: &Option<String>, message: &str) -> String {
    match code {
        Some(code) => format!("{code}: {message}"),
        None => message.to_owned(),
    }
}

impl Error {
    /// The cloud's error code of a refused request (conflict, invalid or forbidden), for
    /// callers that act on the reason rather than the class.
    pub fn code(&self) -> Option<&str> {
        match self {
            Error::Conflict { code, .. }
            | Error::Invalid { code, .. }
            | Error::Forbidden { code, .. } => code.as_deref(),
            _ => None,
        }
    }

    /// True for failures that may pass by themselves: rate limits, unavailability and
    /// transport errors (timeouts, refused connections, every edge unreachable).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::RateLimited { .. }
                | Error::Unavailable { .. }
                | Error::Transport(_)
                | Error::Unreachable(_)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_passing_failures_are_retryable() {
        assert!(
            Error::RateLimited {
                retry_after: Duration::from_secs(1)
            }
            .is_retryable()
        );
        assert!(
            Error::Unavailable {
                message: String::new()
            }
            .is_retryable()
        );
        assert!(
            !Error::Conflict {
                code: None,
                message: String::new()
            }
            .is_retryable()
        );
        assert!(
            !Error::NotFound {
                message: String::new()
            }
            .is_retryable()
        );
        assert!(
            !Error::Invalid {
                code: None,
                message: String::new()
            }
            .is_retryable()
        );
        assert!(!Error::Unauthorized.is_retryable());
        assert!(
            !Error::Forbidden {
                code: Some("quota-exceeded".into()),
                message: String::new()
            }
            .is_retryable()
        );
    }
}
