//! What every Tandem binary does at its edge, written once: the `--log-format` flag and
//! logging setup, shutdown on SIGINT/SIGTERM (feature `runtime`), duration flags in Go's
//! syntax, the facts of Kubernetes that several components rely on (with the [`IpFamily`]
//! and [`Protocol`] of Service ports; these alone need no feature, so the pure rules crates
//! take them without a runtime), the Kubernetes client (feature `kube`),
//! the serving of metrics and health endpoints (feature `http`) and of HTTPS (feature
//! `tls`).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};
#[cfg(feature = "runtime")]
use tokio_util::sync::CancellationToken;

#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "kube")]
mod kube_client;
#[cfg(feature = "kube")]
mod node;
pub mod permissions;
#[cfg(feature = "tls")]
pub mod tls;
#[cfg(feature = "kube")]
pub use kube_client::{KubeClientError, client_from_kubeconfig, kube_client};
#[cfg(feature = "kube")]
pub use node::node_is_leaving;

/// The port of the node proxy's health server (`/healthz`), as kube-proxy's
/// `--healthz-bind-address` default: cloud load balancers probe it on every node.
pub const NODE_HEALTHZ_PORT: u16 = 10256;

/// The taint the cluster autoscaler puts on a node it is about to delete; such a node
/// leaves the load balancers' backends and fails the node health check (KEP-3458).
pub const TAINT_TO_BE_DELETED_BY_CLUSTER_AUTOSCALER: &str = "ToBeDeletedByClusterAutoscaler";

/// A DNS-1123 label, as Kubernetes validates names: 1 to 63 lowercase letters, digits and
/// `-`, starting and ending with a letter or digit. Address-pool names follow it too.
pub fn is_dns1123_label(s: &str) -> bool {
    (1..=63).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// `--log-format`: human-readable lines or one JSON object per line.
#[cfg(feature = "runtime")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The node proxy's `--proxy-mode`: which data path it programs. Here because the lab and
/// the benchmarks start node proxies in either mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "runtime", derive(clap::ValueEnum))]
pub enum ProxyMode {
    /// kube-proxy v1.21's iptables chains, through iptables-restore.
    #[default]
    Iptables,
    /// One nftables table of our own (`ip tandem`), through netlink transactions.
    Nftables,
}

impl ProxyMode {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Iptables => "iptables",
            ProxyMode::Nftables => "nftables",
        }
    }
}

impl std::fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An IP family. The node proxy runs a proxier per family, with tables of its own
/// (`iptables` and `ip6tables`, `ip` and `ip6` in nftables) holding the same chain names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum IpFamily {
    #[default]
    V4,
    V6,
}

impl IpFamily {
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }

    /// The Kubernetes name: `IPv4` or `IPv6` (`ipFamilies`, an EndpointSlice's
    /// `addressType`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        }
    }

    /// The family Kubernetes names `name` ([`Self::as_str`]), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::V4, Self::V6]
            .into_iter()
            .find(|family| family.as_str() == name)
    }

    /// The loopback addresses: 127.0.0.0/8, or ::1/128.
    pub fn loopback(self) -> IpNet {
        match self {
            Self::V4 => IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(127, 0, 0, 0), 8)),
            Self::V6 => IpNet::V6(Ipv6Net::new_assert(Ipv6Addr::LOCALHOST, 128)),
        }
    }

    pub fn holds(self, ip: IpAddr) -> bool {
        Self::of(ip) == self
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The L4 protocol of a Service port, in both of the node proxy's modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// Lower-case name, as nft, iptables and the chain-name hashes write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }

    /// IANA protocol number (`meta l4proto`).
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Installs ring as rustls's process-wide crypto provider (idempotent). The workspace's
/// reqwest has rustls without a provider of its own (ring, as kube uses, rather than
/// aws-lc): a client built without a preconfigured TLS setup (the cloud SDK brings one)
/// takes the process default, and reqwest panics when there is none, even for `http` URLs.
/// Every process that builds such a client calls this first.
#[cfg(feature = "runtime")]
pub fn install_crypto_provider() {
    // An error means a provider is installed already, which is all that is asked.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Logs to stderr in `format`, filtered by `RUST_LOG` (default `info`).
#[cfg(feature = "runtime")]
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// Resolves on the first SIGINT or SIGTERM and names it. If the SIGTERM handler cannot be
/// installed, only SIGINT ends it.
#[cfg(feature = "runtime")]
pub async fn shutdown_signal() -> &'static str {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = tokio::signal::ctrl_c() => "SIGINT",
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot handle SIGTERM; only SIGINT stops this process");
            let _ = tokio::signal::ctrl_c().await;
            "SIGINT"
        }
    }
}

/// Cancels `token` on SIGINT or SIGTERM: the one shutdown path of a server.
#[cfg(feature = "runtime")]
pub fn cancel_on_shutdown_signal(token: CancellationToken) {
    tokio::spawn(async move {
        let signal = shutdown_signal().await;
        tracing::info!(signal, "shutting down");
        token.cancel();
    });
}

/// A duration in Go's syntax, as kube-proxy's flags take it: `1m30s`, `500ms`, `2h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GoDuration(pub Duration);

impl FromStr for GoDuration {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut rest = s.trim();
        if rest == "0" {
            return Ok(Self(Duration::ZERO));
        }
        if rest.is_empty() {
            return Err("empty duration".into());
        }
        let mut total = Duration::ZERO;
        while !rest.is_empty() {
            let digits = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .ok_or_else(|| format!("{s:?}: missing unit (ms, s, m, h)"))?;
            let (number, tail) = rest.split_at(digits);
            let value: f64 = number
                .parse()
                .map_err(|_| format!("{s:?}: bad number {number:?}"))?;
            let unit_len = tail
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(tail.len());
            let (unit, tail) = tail.split_at(unit_len);
            let seconds = match unit {
                "ns" => 1e-9,
                "us" | "µs" => 1e-6,
                "ms" => 1e-3,
                "s" => 1.0,
                "m" => 60.0,
                "h" => 3600.0,
                _ => return Err(format!("{s:?}: unknown unit {unit:?}")),
            };
            total +=
                Duration::try_from_secs_f64(value * seconds).map_err(|e| format!("{s:?}: {e}"))?;
            rest = tail;
        }
        Ok(Self(total))
    }
}

impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl From<GoDuration> for Duration {
    fn from(d: GoDuration) -> Self {
        d.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns1123_labels() {
        assert!(is_dns1123_label("blue-2") && is_dns1123_label(&"x".repeat(63)));
        for bad in ["", "-a", "a-", "A", "a_b", &"x".repeat(64)] {
            assert!(!is_dns1123_label(bad), "{bad:?}");
        }
    }

    #[test]
    fn ip_families_are_named_as_kubernetes_names_them() {
        for family in [IpFamily::V4, IpFamily::V6] {
            assert_eq!(IpFamily::from_name(family.as_str()), Some(family));
        }
        assert_eq!(IpFamily::from_name("ipv6"), None);
        assert_eq!(IpFamily::of(Ipv6Addr::LOCALHOST.into()), IpFamily::V6);
    }

    #[test]
    fn go_durations_parse() {
        for (text, expected) in [
            ("30s", Duration::from_secs(30)),
            ("1m30s", Duration::from_secs(90)),
            ("500ms", Duration::from_millis(500)),
            ("1.5s", Duration::from_millis(1500)),
            ("2h", Duration::from_secs(7200)),
            ("0", Duration::ZERO),
        ] {
            assert_eq!(
                text.parse::<GoDuration>(),
                Ok(GoDuration(expected)),
                "{text}"
            );
        }
        for bad in ["", "10", "5x", "s", "-1s"] {
            assert!(bad.parse::<GoDuration>().is_err(), "{bad}");
        }
    }

    #[cfg(feature = "runtime")]
    #[test]
    fn log_format_flag_values() {
        use clap::ValueEnum;
        assert_eq!(LogFormat::from_str("json", true), Ok(LogFormat::Json));
        assert_eq!(LogFormat::from_str("text", true), Ok(LogFormat::Text));
        assert!(LogFormat::from_str("xml", true).is_err());
    }

    #[cfg(feature = "runtime")]
    #[test]
    fn proxy_mode_names_are_the_flag_values() {
        use clap::ValueEnum;
        for mode in ProxyMode::value_variants() {
            assert_eq!(ProxyMode::from_str(mode.as_str(), false), Ok(*mode));
        }
    }
}
