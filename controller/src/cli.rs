//! Command-line flags (each with an environment fallback) and their translation into
//! [`crate::runtime::Settings`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::PossibleValuesParser;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

pub use tandem_common::LogFormat;

use crate::provider::ClusterId;
use crate::registry::{Providers, Registration};
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
    #[arg(long, env = "TANDEM_CLOUD_PROVIDER")]
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
    Runtime(#[from] RuntimeError),
    #[error(
        "--cloud-provider {provider} takes no --cloud-url and --cloud-token-file; give it its --cloud-config"
    )]
    NoUrlFlags { provider: &'static str },
    #[error("--cloud-url: {0}")]
    UrlFlags(#[source] crate::registry::ConfigError),
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
    /// The command line of a binary that registers `providers`: `--cloud-provider` takes
    /// their names, the first when the flag is not given.
    pub fn command_for(providers: &Providers) -> clap::Command {
        Self::command().mut_arg("cloud_provider", |arg| {
            let arg = arg.value_parser(PossibleValuesParser::new(providers.names()));
            match providers.default_name() {
                Some(name) => arg.required(false).default_value(name),
                None => arg,
            }
        })
    }

    /// The arguments of this process, for a binary that registers `providers` (exits on
    /// a bad command line, with clap's message).
    pub fn parse_for(providers: &Providers) -> Self {
        Self::try_parse_for(providers, std::env::args_os()).unwrap_or_else(|error| error.exit())
    }

    pub fn try_parse_for<I, T>(providers: &Providers, args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let mut matches = Self::command_for(providers).try_get_matches_from(args)?;
        Self::from_arg_matches_mut(&mut matches)
    }

    pub fn identity(&self) -> String {
        self.identity
            .clone()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| format!("tandem-controller-{}", std::process::id()))
    }

    /// The text of `provider`'s configuration: the `--cloud-config` file, or the text
    /// `--cloud-url` and `--cloud-token-file` stand for; `None` without either.
    pub async fn cloud_config(&self, provider: &Registration) -> Result<Option<String>, CliError> {
        if let Some(path) = &self.cloud_config {
            return Ok(Some(runtime::read_cloud_config(path).await?));
        }
        let (Some(url), Some(token_file)) = (&self.cloud_url, &self.cloud_token_file) else {
            return Ok(None);
        };
        let from_url_flags = provider.from_url_flags.ok_or(CliError::NoUrlFlags {
            provider: provider.profile.name,
        })?;
        from_url_flags(url, token_file)
            .map(Some)
            .map_err(CliError::UrlFlags)
    }

    /// The settings of a run with `provider` (the one `--cloud-provider` names) and its
    /// configuration text.
    pub fn settings(
        &self,
        provider: &'static Registration,
        cloud_config: Option<String>,
    ) -> Settings {
        let identity = self.identity();
        let profile = provider.profile;
        Settings {
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
            cloud_provider: provider,
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
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::fake;
    use crate::registry::ConfigError;

    fn url_and_token_file(url: &str, token_file: &Path) -> Result<String, ConfigError> {
        Ok(format!("{url} {}", token_file.display()))
    }

    const OTHER: crate::provider::Profile = crate::provider::Profile {
        name: "other",
        annotation_prefix: "example.com/other-",
        default_class: "example.com/other",
    };
    /// The fake taking the URL flags, as the mock cloud's provider does, and another that
    /// takes its file alone.
    const PROVIDERS: Providers = Providers::new(&[
        Registration {
            from_url_flags: Some(url_and_token_file),
            ..fake::REGISTRATION
        },
        Registration {
            profile: &OTHER,
            ..fake::REGISTRATION
        },
    ]);

    fn registered(name: &str) -> &'static Registration {
        PROVIDERS.find(name).unwrap()
    }

    fn parse<'a>(args: impl IntoIterator<Item = &'a str>) -> Result<Args, clap::Error> {
        Args::try_parse_for(&PROVIDERS, std::iter::once("tandem-controller").chain(args))
    }

    #[test]
    fn cli_definition_is_valid() {
        Args::command_for(&PROVIDERS).debug_assert();
        Args::command_for(&Providers::new(&[])).debug_assert();
    }

    #[test]
    fn flags_parse_into_settings() {
        let args = parse([
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
        assert_eq!(args.cloud_provider, "fake", "the first registered");
        let settings = args.settings(registered("fake"), Some("{}".into()));
        assert_eq!(settings.cloud_provider.profile.name, "fake");
        assert_eq!(settings.classes.class, "tandem.io/fake");
        assert_eq!(settings.cluster_id.as_str(), "lab");
        assert_eq!(settings.concurrency, 3);
        assert_eq!(settings.leader_election.unwrap().identity, "a");
        assert_eq!(settings.default_pool, None);
        assert!(settings.classes.claim_unclassed);
        assert_eq!(args.log_format, LogFormat::Json);
    }

    #[test]
    fn provider_flags() {
        let args = parse([
            "--cluster-id",
            "c",
            "--cloud-provider",
            "other",
            "--cloud-config",
            "/c.json",
        ])
        .unwrap();
        assert_eq!(args.cloud_provider, "other");
        assert_eq!(args.cloud_config.as_deref(), Some(Path::new("/c.json")));
        // Only registered names.
        assert!(parse(["--cluster-id", "c", "--cloud-provider", "nope"]).is_err());
        // The shortcut flags go together, and not with a file.
        assert!(parse(["--cluster-id", "c", "--cloud-url", "http://x"]).is_err());
        assert!(
            parse([
                "--cluster-id",
                "c",
                "--cloud-config",
                "/c",
                "--cloud-url",
                "http://x",
                "--cloud-token-file",
                "/t"
            ])
            .is_err()
        );
        let class = parse([
            "--cluster-id",
            "c",
            "--load-balancer-class",
            "example.com/lb",
        ])
        .unwrap();
        assert_eq!(
            class.settings(registered("fake"), None).classes.class,
            "example.com/lb"
        );
        // A binary that registers no provider must be told one.
        let none = Providers::new(&[]);
        assert!(Args::try_parse_for(&none, ["tandem-controller", "--cluster-id", "c"]).is_err());
    }

    #[tokio::test]
    async fn the_url_flags_are_the_configuration_of_a_provider_that_takes_them() {
        let args = parse([
            "--cluster-id",
            "c",
            "--cloud-url",
            "http://127.0.0.1:1",
            "--cloud-token-file",
            "/t",
        ])
        .unwrap();
        assert_eq!(
            args.cloud_config(registered("fake"))
                .await
                .unwrap()
                .as_deref(),
            Some("http://127.0.0.1:1 /t")
        );
        let refused = args.cloud_config(registered("other")).await;
        assert!(
            matches!(refused, Err(CliError::NoUrlFlags { provider: "other" })),
            "{refused:?}"
        );
        let none = parse(["--cluster-id", "c"]).unwrap();
        assert_eq!(none.cloud_config(registered("fake")).await.unwrap(), None);
    }

    #[test]
    fn bad_values_are_rejected() {
        let base = ["--cloud-url", "http://x", "--cloud-token-file", "/t"];
        let with = |extra: &[&str]| parse(base.iter().chain(extra.iter()).copied()).is_ok();
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
