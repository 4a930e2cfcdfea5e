//! The mock-cloud provider's configuration file (`--cloud-config`), JSON:
//!
//! ```json
//! {"url": "https://edge.example.net:8443", "urls": ["https://edge2.example.net:8443"], "tokenFile": "/etc/tandem/cloud/token", "caFile": "/etc/tandem/cloud/ca.crt", "clientCertFile": "/etc/tandem/cloud-client/tls.crt", "clientKeyFile": "/etc/tandem/cloud-client/tls.key"}
//! ```
//!
//! `url` is the edge's API; `urls`, more edges of the same API (an edge cluster), tried in
//! turn when one does not take the connection: `url` and `urls` together, in that order,
//! are the edges, and either may be left out. `tokenFile` holds the bearer token (read
//! again when it changes, so a rotated Secret needs no restart: `token.rs`), and
//! `caFile` (optional) the PEM certificate of the CA that signed the edges' certificates,
//! for `https` URLs. `clientCertFile` and `clientKeyFile` (optional, both or neither) hold
//! the PEM certificate chain and key shown to an edge that asks for a client certificate
//! (mutual TLS); unlike the token they are read at the start alone, so a renewed
//! certificate takes a restart. `--cloud-url` and `--cloud-token-file` are a shortcut for a
//! file with `url` and `tokenFile` alone.

use std::path::{Path, PathBuf};

use cloud_mock_sdk as sdk;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub urls: Vec<String>,
    pub token_file: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_file: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "needs a configuration: --cloud-config FILE ({{\"url\": …, \"tokenFile\": …}}), or --cloud-url and --cloud-token-file"
    )]
    Missing,
    #[error("configuration: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("{what} {path}: {source}")]
    File {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("token file {0} is empty")]
    EmptyToken(String),
    #[error("configuration names no edge: give its API as url (or several as urls)")]
    NoEdge,
    #[error("configuration gives {given} without {missing}: a client certificate needs both")]
    HalfClientIdentity {
        given: &'static str,
        missing: &'static str,
    },
}

impl Config {
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let config: Self = serde_json::from_str(text)?;
        if config.edges().is_empty() {
            return Err(ConfigError::NoEdge);
        }
        match (&config.client_cert_file, &config.client_key_file) {
            (Some(_), None) => Err(ConfigError::HalfClientIdentity {
                given: "clientCertFile",
                missing: "clientKeyFile",
            }),
            (None, Some(_)) => Err(ConfigError::HalfClientIdentity {
                given: "clientKeyFile",
                missing: "clientCertFile",
            }),
            _ => Ok(config),
        }
    }

    /// The edges' APIs: `url`, then `urls`, each once.
    pub fn edges(&self) -> Vec<&str> {
        let mut edges: Vec<&str> = Vec::new();
        for url in self.url.iter().chain(&self.urls) {
            if !edges.contains(&url.as_str()) {
                edges.push(url);
            }
        }
        edges
    }

    /// The file `--cloud-url URL --cloud-token-file FILE` stand for.
    pub fn shortcut(url: &str, token_file: &Path) -> Result<String, ConfigError> {
        let config = Self {
            url: Some(url.to_owned()),
            urls: Vec::new(),
            token_file: token_file.to_path_buf(),
            ca_file: None,
            client_cert_file: None,
            client_key_file: None,
        };
        Ok(serde_json::to_string(&config)?)
    }

    /// The PEM of `caFile`, if given.
    pub fn ca(&self) -> Result<Option<String>, ConfigError> {
        self.ca_file
            .as_deref()
            .map(|path| read_pem("CA file", path))
            .transpose()
    }

    /// `clientCertFile` and `clientKeyFile`, if given (both, as [`Config::parse`]
    /// checked); the client reads them, and again when they are renewed.
    pub fn client_identity(&self) -> Option<sdk::ClientIdentity> {
        let (Some(cert), Some(key)) = (&self.client_cert_file, &self.client_key_file) else {
            return None;
        };
        Some(sdk::ClientIdentity {
            certificate_file: cert.clone(),
            key_file: key.clone(),
        })
    }
}

fn read_pem(what: &'static str, path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::File {
        what,
        path: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_file_and_refuses_unknown_fields() {
        // The example at the top of this file.
        let documented = include_str!("config.rs")
            .split("//! ```json\n//! ")
            .nth(1)
            .and_then(|rest| rest.split('\n').next())
            .unwrap();
        let config = Config::parse(documented).unwrap();
        assert_eq!(
            config.edges(),
            [
                "https://edge.example.net:8443",
                "https://edge2.example.net:8443"
            ]
        );
        assert_eq!(
            config.ca_file.as_deref(),
            Some(Path::new("/etc/tandem/cloud/ca.crt"))
        );
        assert_eq!(
            (
                config.client_cert_file.as_deref(),
                config.client_key_file.as_deref()
            ),
            (
                Some(Path::new("/etc/tandem/cloud-client/tls.crt")),
                Some(Path::new("/etc/tandem/cloud-client/tls.key"))
            )
        );
        assert!(Config::parse(r#"{"url": "http://x", "tokenFile": "/t", "token": "s"}"#).is_err());
        assert!(Config::parse(r#"{"url": "http://x"}"#).is_err());
        assert!(Config::parse("url: http://x").is_err());
    }

    #[test]
    fn the_edges_are_url_then_urls_each_once() {
        let edges = |text: &str| Config::parse(text).map(|c| c.edges().join(" "));
        assert_eq!(
            edges(r#"{"url": "http://a", "tokenFile": "/t"}"#).unwrap(),
            "http://a"
        );
        assert_eq!(
            edges(r#"{"urls": ["http://a", "http://b"], "tokenFile": "/t"}"#).unwrap(),
            "http://a http://b"
        );
        assert_eq!(
            edges(r#"{"url": "http://a", "urls": ["http://b", "http://a"], "tokenFile": "/t"}"#)
                .unwrap(),
            "http://a http://b"
        );
        for none in [
            r#"{"tokenFile": "/t"}"#,
            r#"{"urls": [], "tokenFile": "/t"}"#,
        ] {
            assert!(
                matches!(Config::parse(none), Err(ConfigError::NoEdge)),
                "{none}"
            );
        }
    }

    #[test]
    fn the_flags_shortcut_is_a_config_file() {
        let text = Config::shortcut("http://127.0.0.1:1", Path::new("/tmp/token")).unwrap();
        assert_eq!(
            Config::parse(&text).unwrap(),
            Config {
                url: Some("http://127.0.0.1:1".into()),
                urls: Vec::new(),
                token_file: "/tmp/token".into(),
                ca_file: None,
                client_cert_file: None,
                client_key_file: None,
            }
        );
    }

    #[test]
    fn ca_file_is_read_when_given() {
        let dir = std::env::temp_dir().join(format!("tdm-mockcloud-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ca.crt");
        std::fs::write(&file, "-----BEGIN CERTIFICATE-----\n").unwrap();
        let mut config = Config::parse(&Config::shortcut("https://x", &file).unwrap()).unwrap();
        assert_eq!(config.ca().unwrap(), None);
        config.ca_file = Some(file);
        assert_eq!(
            config.ca().unwrap().as_deref(),
            Some("-----BEGIN CERTIFICATE-----\n")
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(
            config.ca(),
            Err(ConfigError::File {
                what: "CA file",
                ..
            })
        ));
    }

    #[test]
    fn a_client_certificate_comes_with_its_key() {
        let with = |fields: &str| {
            Config::parse(&format!(
                r#"{{"url": "https://x", "tokenFile": "/t"{fields}}}"#
            ))
        };
        let both = r#", "clientCertFile": "/c/tls.crt", "clientKeyFile": "/c/tls.key""#;
        assert_eq!(
            with(both).unwrap().client_identity(),
            Some(sdk::ClientIdentity {
                certificate_file: "/c/tls.crt".into(),
                key_file: "/c/tls.key".into(),
            })
        );
        assert_eq!(with("").unwrap().client_identity(), None);
        let half = with(r#", "clientCertFile": "/c""#).unwrap_err();
        assert_eq!(
            half.to_string(),
            "configuration gives clientCertFile without clientKeyFile: a client certificate needs both"
        );
        assert!(matches!(
            with(r#", "clientKeyFile": "/k""#),
            Err(ConfigError::HalfClientIdentity {
                missing: "clientCertFile",
                ..
            })
        ));
    }
}
