//! Command-line flags (each with an environment fallback) and their translation into
//! [`crate::runtime::Settings`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::PossibleValuesParser;
use clap::{Parser, Subcommand};

pub use tandem_common::LogFormat;

use crate::mockcloud;
use crate::provider::ClusterId;
use crate::registry::{self, RegistryError};
use crate::release::ReleaseArgs;
use crate::runtime::{self, LeaderElection, RuntimeError, Settings};
use crate::spec::{ClassFilter, WithoutNodePorts};
use tandem_common::is_dns1123_label;

/// Provisions cloud load balancers for Kubernetes Services of type LoadBalancer.
#[derive(Debug, Clone, Parser)]
#[command(name = "tandem-controller", version)]
pub struct Args {
    /// Kubeconfig file; the in-cluster config is used when absent.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The cloud provider, by its registered name.
    #[arg(long, env = "TANDEM_CLOUD_PROVIDER", default_value = mockcloud::PROFILE.name, value_parser = PossibleValuesParser::new(registry::names()))]
    pub cloud_provider: String,
    /// The provider's configuration file, in the provider's own format (docs/providers.md).
    #[arg(long, env = "TANDEM_CLOUD_CONFIG", conflicts_with_all = ["cloud_url", "cloud_token_file"])]
    pub cloud_config: Option<PathBuf>,
    /// Base URL of the cloud API: with --cloud-token-file, the mockcloud provider's
    /// configuration without a file.
    #[arg(long, env = "TANDEM_CLOUD_URL", requires = "cloud_token_file")]
    pub cloud_url: Option<String>,
    /// File holding the cloud API bearer token (with --cloud-url).
    #[arg(long, env = "TANDEM_CLOUD_TOKEN_FILE", requires = "cloud_url")]
    pub cloud_token_file: Option<PathBuf>,
    /// This cluster's id, written as a tag on every LB (1-24 chars of [a-z0-9-]).
    #[arg(long, env = "TANDEM_CLUSTER_ID")]
    pub cluster_id: ClusterId,
    /// The spec.loadBalancerClass this controller implements; unset: the provider's own
    /// (mockcloud: tandem.io/mockcloud).
    #[arg(long, env = "TANDEM_LOAD_BALANCER_CLASS")]
    pub load_balancer_class: Option<String>,
    /// Also manage Services that set no loadBalancerClass.
    #[arg(long, env = "TANDEM_CLAIM_UNCLASSED", default_value_t = true, action = clap::ArgAction::Set)]
    pub claim_unclassed: bool,
    /// Services with spec.allocateLoadBalancerNodePorts false and no mode annotation:
    /// serve them in passthrough mode (which needs no node ports), or refuse them.
    #[arg(long, env = "TANDEM_WITHOUT_NODE_PORTS", value_enum, default_value_t = WithoutNodePorts::Passthrough)]
    pub without_node_ports: WithoutNodePorts,
    /// The address pool of Services whose Service and Namespace name none (annotation
    /// service.beta.kubernetes.io/mockcloud-load-balancer-address-pool); unset: the
    /// cloud's default pool.
    #[arg(long, env = "TANDEM_DEFAULT_ADDRESS_POOL", value_parser = parse_pool_name)]
    pub default_address_pool: Option<String>,
    /// Run only while holding the leader Lease.
    #[arg(long, env = "TANDEM_LEADER_ELECT")]
    pub leader_elect: bool,
    #[arg(
        long,
        env = "TANDEM_LEADER_ELECT_NAMESPACE",
        default_value = "kube-system"
    )]
    pub leader_elect_namespace: String,
    #[arg(
        long,
        env = "TANDEM_LEADER_ELECT_LEASE_NAME",
        default_value = "tandem-controller"
    )]
    pub leader_elect_lease_name: String,
    /// Seconds a lease stays valid without renewal (the hand-over bound).
    #[arg(long, env = "TANDEM_LEADER_ELECT_LEASE_DURATION", default_value_t = 15)]
    pub leader_elect_lease_duration: u64,
    /// Identity in the Lease and in Events; defaults to the host name.
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    #[arg(
        long,
        env = "TANDEM_METRICS_BIND_ADDRESS",
        default_value = "0.0.0.0:8080"
    )]
    pub metrics_bind_address: SocketAddr,
    #[arg(
        long,
        env = "TANDEM_HEALTH_BIND_ADDRESS",
        default_value = "0.0.0.0:8081"
    )]
    pub health_bind_address: SocketAddr,
    /// Services reconciled at once, and LBs updated at once on node changes.
    #[arg(long, env = "TANDEM_CONCURRENCY", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    pub concurrency: u16,
    /// Seconds between re-checks of every LB (drift repair).
    #[arg(long, env = "TANDEM_RESYNC_SECONDS", default_value_t = 300)]
    pub resync_seconds: u64,
    /// Seconds between orphan collections.
    #[arg(long, env = "TANDEM_GC_SECONDS", default_value_t = 300)]
    pub gc_seconds: u64,
    /// Milliseconds of quiet after node changes before LBs are updated.
    #[arg(long, env = "TANDEM_NODE_DEBOUNCE_MS", default_value_t = 1000)]
    pub node_debounce_ms: u64,
    /// Cloud API calls per second (shared by all work), and the burst above it.
    #[arg(long, env = "TANDEM_CLOUD_RATE", default_value_t = 20.0)]
    pub cloud_rate: f64,
    #[arg(long, env = "TANDEM_CLOUD_BURST", default_value_t = 40)]
    pub cloud_burst: u32,
    /// Seconds one cloud HTTP attempt may take.
    #[arg(long, env = "TANDEM_CLOUD_TIMEOUT_SECONDS", default_value_t = 10)]
    pub cloud_timeout_seconds: u64,
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Without a command: run the controller.
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Release every load balancer of this cluster, our finalizers and the leader Lease
    /// (before uninstalling); refuses while LoadBalancer Services still use them.
    ReleaseLoadBalancers(ReleaseArgs),
}

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(
        "--cloud-url and --cloud-token-file configure the {} provider; give --cloud-provider {provider} its --cloud-config",
        mockcloud::PROFILE.name
    )]
    ShortcutOfAnotherProvider { provider: String },
    #[error("--cloud-url: {0}")]
    Shortcut(#[from] mockcloud::ConfigError),
}

fn parse_pool_name(raw: &str) -> Result<String, String> {
    if is_dns1123_label(raw) {
        Ok(raw.to_owned())
    } else {
        Err(
            "want a pool name: up to 63 characters of [a-z0-9-], not starting or ending with -"
                .to_owned(),
        )
    }
}

impl Args {
    pub fn identity(&self) -> String {
        self.identity
            .clone()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| format!("tandem-controller-{}", std::process::id()))
    }

    /// The text of the provider's configuration: the `--cloud-config` file, or the file
    /// `--cloud-url` and `--cloud-token-file` stand for; `None` without either.
    pub async fn cloud_config(&self) -> Result<Option<String>, CliError> {
        if let Some(path) = &self.cloud_config {
            return Ok(Some(runtime::read_cloud_config(path).await?));
        }
        let (Some(url), Some(token_file)) = (&self.cloud_url, &self.cloud_token_file) else {
            return Ok(None);
        };
        if self.cloud_provider != mockcloud::PROFILE.name {
            return Err(CliError::ShortcutOfAnotherProvider {
                provider: self.cloud_provider.clone(),
            });
        }
        Ok(Some(mockcloud::Config::shortcut(url, token_file)?))
    }

    pub fn settings(&self, cloud_config: Option<String>) -> Result<Settings, CliError> {
        let identity = self.identity();
        let profile = registry::find(&self.cloud_provider)?.profile;
        Ok(Settings {
            cluster_id: self.cluster_id.clone(),
            classes: ClassFilter {
                class: self
                    .load_balancer_class
                    .clone()
                    .unwrap_or_else(|| profile.default_class.to_owned()),
                claim_unclassed: self.claim_unclassed,
            },
            without_node_ports: self.without_node_ports,
            default_pool: self.default_address_pool.clone(),
            cloud_provider: self.cloud_provider.clone(),
            cloud_config,
            cloud_timeout: Duration::from_secs(self.cloud_timeout_seconds.max(1)),
            cloud_rate_per_second: self.cloud_rate,
            cloud_burst: self.cloud_burst,
            leader_election: self.leader_elect.then(|| LeaderElection {
                namespace: self.leader_elect_namespace.clone(),
                lease_name: self.leader_elect_lease_name.clone(),
                identity: identity.clone(),
                lease_duration: Duration::from_secs(self.leader_elect_lease_duration),
            }),
            metrics_addr: self.metrics_bind_address,
            health_addr: self.health_bind_address,
            concurrency: self.concurrency,
            resync: Duration::from_secs(self.resync_seconds.max(1)),
            gc_period: Duration::from_secs(self.gc_seconds.max(1)),
            node_debounce: Duration::from_millis(self.node_debounce_ms),
            identity,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_valid() {
        Args::command().debug_assert();
    }

    #[test]
    fn flags_parse_into_settings() {
        let args = Args::try_parse_from([
            "tandem-controller",
            "--kubeconfig",
            "/tmp/kc",
            "--cloud-url",
            "http://127.0.0.1:1",
            "--cloud-token-file",
            "/tmp/t",
            "--cluster-id",
            "lab",
            "--leader-elect",
            "--identity",
            "a",
            "--concurrency",
            "3",
            "--log-format",
            "json",
        ])
        .unwrap();
        let settings = args.settings(Some("{}".into())).unwrap();
        assert_eq!(settings.cloud_provider, "mockcloud");
        assert_eq!(settings.classes.class, "tandem.io/mockcloud");
        assert_eq!(settings.cluster_id.as_str(), "lab");
        assert_eq!(settings.concurrency, 3);
        assert_eq!(settings.leader_election.unwrap().identity, "a");
        assert_eq!(settings.default_pool, None);
        assert!(settings.classes.claim_unclassed);
        assert_eq!(args.log_format, LogFormat::Json);
    }

    #[test]
    fn provider_flags() {
        let parse = |extra: &[&str]| {
            Args::try_parse_from(
                ["tandem-controller", "--cluster-id", "c"]
                    .iter()
                    .chain(extra)
                    .copied(),
            )
        };
        let args = parse(&["--cloud-provider", "mockcloud", "--cloud-config", "/c.json"]).unwrap();
        assert_eq!(
            args.cloud_config.as_deref(),
            Some(std::path::Path::new("/c.json"))
        );
        assert!(parse(&["--cloud-provider", "nope"]).is_err());
        // The shortcut flags go together, and not with a file.
        assert!(parse(&["--cloud-url", "http://x"]).is_err());
        assert!(
            parse(&[
                "--cloud-config",
                "/c",
                "--cloud-url",
                "http://x",
                "--cloud-token-file",
                "/t"
            ])
            .is_err()
        );
        let class = parse(&["--load-balancer-class", "example.com/lb"]).unwrap();
        assert_eq!(
            class.settings(None).unwrap().classes.class,
            "example.com/lb"
        );
    }

    #[tokio::test]
    async fn the_url_flags_are_the_mock_clouds_config() {
        let args = Args::try_parse_from([
            "tandem-controller",
            "--cluster-id",
            "c",
            "--cloud-url",
            "http://127.0.0.1:1",
            "--cloud-token-file",
            "/t",
        ])
        .unwrap();
        let text = args.cloud_config().await.unwrap().unwrap();
        assert_eq!(
            mockcloud::Config::parse(&text).unwrap().url,
            "http://127.0.0.1:1"
        );
        let none = Args::try_parse_from(["tandem-controller", "--cluster-id", "c"]).unwrap();
        assert_eq!(none.cloud_config().await.unwrap(), None);
    }

    #[test]
    fn bad_values_are_rejected() {
        let base = [
            "tandem-controller",
            "--cloud-url",
            "http://x",
            "--cloud-token-file",
            "/t",
        ];
        let with =
            |extra: &[&str]| Args::try_parse_from(base.iter().chain(extra.iter()).copied()).is_ok();
        assert!(with(&["--cluster-id", "ok"]));
        assert!(!with(&["--cluster-id", "Not_OK"]));
        assert!(!with(&["--cluster-id", "ok", "--concurrency", "0"]));
        assert!(with(&[
            "--cluster-id",
            "ok",
            "--default-address-pool",
            "blue"
        ]));
        assert!(!with(&[
            "--cluster-id",
            "ok",
            "--default-address-pool",
            "Blue"
        ]));
    }
}
