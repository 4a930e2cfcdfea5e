//! Command-line flags (each with an environment fallback).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use cloud_mock_dataplane::{
    AnnounceConfig, DataPlaneConfig, DataPlaneKind, HaproxySettings, L2Config, MaglevConfig,
    PassthroughConfig,
};

pub use tandem_common::{GoDuration, LogFormat};

use crate::credentials::TokenSource;
use crate::pools::{PoolsError, VipPool, VipPools};
use crate::server::{Settings, TlsFiles};
use crate::store::etcd::EtcdTls;
use crate::store::{EtcdSettings, StoreSettings};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreArg {
    /// The embedded database in --data-dir: one edge.
    Redb,
    /// etcd (--etcd-endpoints): an edge cluster, every edge serving the same store.
    Etcd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DataPlaneArg {
    /// Realise load balancers: listeners on VIP:port (proxy) or kernel routes (passthrough).
    Proxy,
    /// Like `proxy`, but a real HAProxy (`--haproxy-program`) serves proxy-mode load
    /// balancers, with its own health checks; UDP listeners in proxy mode are refused.
    /// Its configuration and sockets live in DATA_DIR/haproxy.
    Haproxy,
    /// API only: nothing is realised, health stays unknown.
    None,
}

/// How passthrough flows are spread over a VIP's nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SteeringArg {
    /// The kernel's route hash over a resilient nexthop group: this host's own spread.
    Kernel,
    /// A Maglev table (nftables and a routing table per node) that every edge computes
    /// alike: a flow the router moves to another edge keeps its node. For edge clusters.
    Maglev,
}

/// `cloud-mock copy-store`: copies the embedded store of --data-dir into an empty etcd
/// store, keeping ids, VIPs, versions and idempotency keys: how a single edge grows into
/// an edge cluster. Stop the edge first.
#[derive(Debug, Clone, Parser)]
#[command(name = "cloud-mock copy-store", version)]
pub struct CopyStoreArgs {
    /// The stopped edge's data directory.
    #[arg(long, env = "CLOUD_MOCK_DATA_DIR")]
    pub data_dir: PathBuf,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// The word that selects [`CopyStoreArgs`] instead of the server's flags.
pub const COPY_STORE: &str = "copy-store";

/// How to reach etcd.
#[derive(Debug, Clone, clap::Args)]
pub struct EtcdArgs {
    /// Client URLs of the etcd members (comma-separated or repeated).
    #[arg(long, env = "CLOUD_MOCK_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// The key prefix of this edge cluster's store in etcd.
    #[arg(long, env = "CLOUD_MOCK_ETCD_PREFIX", default_value = "/tandem-edge")]
    pub etcd_prefix: String,
    /// The PEM CA that signed the etcd members' certificates (for `https` endpoints).
    #[arg(long, env = "CLOUD_MOCK_ETCD_CA_FILE")]
    pub etcd_ca_file: Option<PathBuf>,
    /// A client certificate for etcd's --client-cert-auth; needs --etcd-key-file.
    #[arg(long, env = "CLOUD_MOCK_ETCD_CERT_FILE", requires_all = ["etcd_key_file", "etcd_ca_file"])]
    pub etcd_cert_file: Option<PathBuf>,
    #[arg(long, env = "CLOUD_MOCK_ETCD_KEY_FILE", requires = "etcd_cert_file")]
    pub etcd_key_file: Option<PathBuf>,
    /// An etcd user, when etcd's authentication is on; needs --etcd-password-file.
    #[arg(long, env = "CLOUD_MOCK_ETCD_USER", requires = "etcd_password_file")]
    pub etcd_user: Option<String>,
    #[arg(long, env = "CLOUD_MOCK_ETCD_PASSWORD_FILE", requires = "etcd_user")]
    pub etcd_password_file: Option<PathBuf>,
    /// This edge's name in the edge cluster (its election and the writes it makes); the
    /// host name when not given.
    #[arg(long, env = "CLOUD_MOCK_EDGE_NAME")]
    pub edge_name: Option<String>,
}

impl EtcdArgs {
    pub fn settings(&self) -> EtcdSettings {
        EtcdSettings {
            endpoints: self.etcd_endpoints.clone(),
            prefix: self.etcd_prefix.clone(),
            tls: self.etcd_ca_file.clone().map(|ca_file| EtcdTls {
                ca_file,
                identity: self.etcd_cert_file.clone().zip(self.etcd_key_file.clone()),
            }),
            user: self.etcd_user.clone().zip(self.etcd_password_file.clone()),
            edge_name: self.edge_name.clone().unwrap_or_else(host_name),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error(transparent)]
    Pools(#[from] PoolsError),
    #[error("no bearer token: give --token, --token-file or --tenants-file")]
    NoToken,
}

/// A routing table of ours: not `unspec` (0) and none of the kernel's `default`, `main`
/// and `local` (253 to 255), whose routes forward packets.
fn own_table(text: &str) -> Result<u32, String> {
    let table: u32 = text.parse().map_err(|error| format!("{text:?}: {error}"))?;
    match table {
        0 | 253..=255 => Err(format!(
            "table {table} is the kernel's own (unspec, default, main or local): give a table of its own"
        )),
        table => Ok(table),
    }
}

/// This host's name, as the kernel has it.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "edge".to_owned())
}

/// Mock cloud: load-balancer REST API, embedded store and a real L4 data plane. With
/// `copy-store` first: see [`CopyStoreArgs`].
#[derive(Debug, Clone, Parser)]
#[command(name = "cloud-mock", version)]
pub struct Args {
    /// Address of the REST API (port 0 picks a free one; the log says which).
    #[arg(long, env = "CLOUD_MOCK_LISTEN", default_value = "127.0.0.1:8780")]
    pub listen: SocketAddr,
    /// Directory of the embedded database (and of HAProxy's files).
    #[arg(long, env = "CLOUD_MOCK_DATA_DIR")]
    pub data_dir: PathBuf,
    /// Where load balancers, VIPs and keys are kept.
    #[arg(long, env = "CLOUD_MOCK_STORE", value_enum, default_value_t = StoreArg::Redb, requires_if("etcd", "etcd_endpoints"))]
    pub store: StoreArg,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// Bearer token clients must send. A restart changes it; --token-file does without.
    #[arg(
        long,
        env = "CLOUD_MOCK_TOKEN",
        hide_env_values = true,
        required_unless_present_any = ["token_file", "tenants_file"],
        conflicts_with_all = ["token_file", "tenants_file"]
    )]
    pub token: Option<String>,
    /// A file of the bearer tokens clients may send, one a line: a token, or `sha256:`
    /// and the 64 hex digits of its SHA-256 (`printf %s "$TOKEN" | sha256sum`); blank
    /// lines and lines starting with `#` are left out. Read again within about a second
    /// of a change, so that two lines let a rotation go without a restart; a file that
    /// becomes unreadable or holds no valid token keeps the tokens read last.
    #[arg(long, env = "CLOUD_MOCK_TOKEN_FILE", conflicts_with = "tenants_file")]
    pub token_file: Option<PathBuf>,
    /// A JSON file of the edge's tenants, for an edge that several clusters share: each
    /// tenant's cluster ids, VIP pools, quotas, rate limit and the SHA-256 of its tokens,
    /// and the admin's tokens (docs/install.md, "Tenants"). Every call is scoped to its
    /// tenant. Read again within about a second of a change, as --token-file.
    #[arg(long, env = "CLOUD_MOCK_TENANTS_FILE")]
    pub tenants_file: Option<PathBuf>,
    /// A VIP pool, NAME=CIDR, IPv4 or IPv6; a bare CIDR is the pool `default` (e.g.
    /// 127.77.0.0/24: loopback, needs no setup). Repeatable; a name may come twice, once
    /// per family, for dual-stack load balancers. The environment variable takes a
    /// comma-separated list. Pools may not overlap.
    #[arg(
        long,
        env = "CLOUD_MOCK_VIP_POOL",
        required = true,
        value_delimiter = ','
    )]
    pub vip_pool: Vec<VipPool>,
    #[arg(long, env = "CLOUD_MOCK_DATAPLANE", value_enum, default_value_t = DataPlaneArg::Proxy)]
    pub dataplane: DataPlaneArg,
    /// The `haproxy` program that `--dataplane haproxy` runs (2.6 or newer).
    #[arg(long, env = "CLOUD_MOCK_HAPROXY_PROGRAM", default_value = "haproxy")]
    pub haproxy_program: PathBuf,
    /// Time a new load balancer stays provisioning (and a deleted one deleting) beyond what
    /// realising it takes, like `500ms`, `2s` (Go duration syntax). None by default: a
    /// production edge makes a load balancer active once its data plane serves it. The lab
    /// and the tests set one, so that clients meet a provisioning state as on a cloud.
    #[arg(long, env = "CLOUD_MOCK_PROVISIONING_DELAY", default_value = "0s")]
    pub provisioning_delay: GoDuration,
    /// Time between two health probes of one backend.
    #[arg(long, env = "CLOUD_MOCK_HEALTH_INTERVAL", default_value = "1s")]
    pub health_interval: GoDuration,
    /// Add non-loopback VIPs as addresses to --vip-device (only inside a network
    /// namespace that belongs to the cloud, like the lab's cloud edge).
    #[arg(long, env = "CLOUD_MOCK_MANAGE_VIP_ADDRESSES")]
    pub manage_vip_addresses: bool,
    /// Device that managed VIP addresses are added to.
    #[arg(long, env = "CLOUD_MOCK_VIP_DEVICE", default_value = "lo")]
    pub vip_device: String,
    /// Announce every VIP this edge can forward (its load balancer realised, a backend
    /// healthy by its own checks) as a route in this kernel routing table, for the host's
    /// BGP speaker to export (BIRD's kernel protocol with `learn`); withdrawn when it no
    /// longer can, and before the edge stops.
    #[arg(long, env = "CLOUD_MOCK_ANNOUNCE_TABLE", value_parser = own_table)]
    pub announce_table: Option<u32>,
    /// The `proto` of the announcement routes (another writer's are never touched).
    #[arg(
        long,
        env = "CLOUD_MOCK_ANNOUNCE_ROUTE_PROTOCOL",
        default_value_t = 78,
        requires = "announce_table"
    )]
    pub announce_route_protocol: u8,
    /// How long a stopping edge keeps serving after it withdrew its VIPs: the routers'
    /// time to move new flows to the other edges.
    #[arg(
        long,
        env = "CLOUD_MOCK_DRAIN_DELAY",
        default_value = "5s",
        requires = "announce_table"
    )]
    pub drain_delay: GoDuration,
    /// The L2 announcement mode, for networks without BGP: this edge claims the VIPs it can
    /// forward that no other edge owns (an etcd lease each, so it needs `--store etcd`),
    /// holds them on this device on the clients' network and announces them by gratuitous
    /// ARP; cut off from etcd it gives them up within the lease (3 s).
    #[arg(
        long,
        env = "CLOUD_MOCK_L2_DEVICE",
        conflicts_with = "announce_table",
        requires = "etcd_endpoints"
    )]
    pub l2_device: Option<String>,
    /// The `arping` program (Debian's `arping`) of the L2 mode.
    #[arg(
        long,
        env = "CLOUD_MOCK_ARPING_PROGRAM",
        default_value = "arping",
        requires = "l2_device"
    )]
    pub arping_program: PathBuf,
    /// How passthrough flows are spread over a VIP's nodes; every edge of an edge cluster
    /// needs `maglev`, so that a flow keeps its node on whichever edge it arrives.
    #[arg(long, env = "CLOUD_MOCK_PASSTHROUGH_STEERING", value_enum, default_value_t = SteeringArg::Kernel)]
    pub passthrough_steering: SteeringArg,
    /// The routing table (and packet mark) of the first node of `--passthrough-steering
    /// maglev`; the next 1,023 are ours too (one per node).
    #[arg(long, env = "CLOUD_MOCK_MAGLEV_FIRST_TABLE", default_value_t = MaglevConfig::default().first_table, value_parser = own_table)]
    pub maglev_first_table: u32,
    /// Serve `/v1/admin/faults`, with which any holder of the token injects errors,
    /// latency, lost answers and rate limits into the API: for tests and the lab, never a
    /// production edge. Off, the API takes no lock for it.
    #[arg(long, env = "CLOUD_MOCK_FAULT_INJECTION")]
    pub fault_injection: bool,
    #[arg(long, env = "CLOUD_MOCK_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Serve the API over HTTPS only, with this PEM certificate chain (server certificate
    /// first); needs --tls-key-file. Without both: plain HTTP.
    #[arg(long, env = "CLOUD_MOCK_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// The PEM private key of --tls-cert-file (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "CLOUD_MOCK_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// Mutual TLS: PEM CA certificates whose client certificates the API verifies. A
    /// verified certificate whose subject's common name is a tenant of --tenants-file
    /// authenticates as that tenant, without a token; a client may still show a token
    /// instead (both must then name one tenant). Needs --tls-cert-file.
    #[arg(
        long,
        env = "CLOUD_MOCK_TLS_CLIENT_CA_FILE",
        requires = "tls_cert_file"
    )]
    pub tls_client_ca_file: Option<PathBuf>,
}

impl Args {
    /// The API's certificate and key, when both flags are given (clap refuses one alone).
    pub fn tls(&self) -> Option<TlsFiles> {
        Some(TlsFiles {
            cert_file: self.tls_cert_file.clone()?,
            key_file: self.tls_key_file.clone()?,
            client_ca_file: self.tls_client_ca_file.clone(),
        })
    }

    /// Where the tokens come from; `None` only for `Args` not made by clap, which
    /// requires one of the flags.
    fn token_source(&self) -> Option<TokenSource> {
        match (&self.tenants_file, &self.token_file, &self.token) {
            (Some(path), _, _) => Some(TokenSource::Tenants(path.clone())),
            (None, Some(path), _) => Some(TokenSource::File(path.clone())),
            (None, None, Some(token)) => Some(TokenSource::Token(token.clone())),
            (None, None, None) => None,
        }
    }

    pub fn settings(&self) -> Result<Settings, SettingsError> {
        Ok(Settings {
            data_dir: self.data_dir.clone(),
            store: match self.store {
                StoreArg::Redb => StoreSettings::Redb,
                StoreArg::Etcd => StoreSettings::Etcd(self.etcd.settings()),
            },
            token: self.token_source().ok_or(SettingsError::NoToken)?,
            vip_pools: VipPools::new(self.vip_pool.clone())?,
            provisioning_delay: self.provisioning_delay.into(),
            fault_injection: self.fault_injection,
            l2: self.l2_device.clone().map(|device| L2Config {
                device,
                ip_program: PathBuf::from("ip"),
                arping_program: self.arping_program.clone(),
                sysctl_program: PathBuf::from("sysctl"),
                vip_ranges: self.vip_pool.iter().map(|pool| pool.cidr).collect(),
            }),
            dataplane: DataPlaneConfig {
                mode: match self.dataplane {
                    DataPlaneArg::Proxy => DataPlaneKind::Proxy,
                    DataPlaneArg::Haproxy => DataPlaneKind::Haproxy,
                    DataPlaneArg::None => DataPlaneKind::None,
                },
                haproxy: HaproxySettings {
                    program: self.haproxy_program.clone(),
                    state_dir: self.data_dir.join("haproxy"),
                    // The API's own socket is in the namespace HAProxy binds in.
                    shared_ports: BTreeSet::from([self.listen.port()]),
                    ..HaproxySettings::default()
                },
                health_interval: self.health_interval.into(),
                manage_vip_addresses: self.manage_vip_addresses,
                vip_device: self.vip_device.clone(),
                passthrough: PassthroughConfig {
                    maglev: (self.passthrough_steering == SteeringArg::Maglev).then(|| {
                        MaglevConfig {
                            first_table: self.maglev_first_table,
                            ..MaglevConfig::default()
                        }
                    }),
                    ..PassthroughConfig::default()
                },
                announce: self.announce_table.map(|table| AnnounceConfig {
                    table,
                    route_protocol: self.announce_route_protocol,
                    drain: self.drain_delay.into(),
                }),
                ..DataPlaneConfig::default()
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_definition_is_valid() {
        Args::command().debug_assert();
        CopyStoreArgs::command().debug_assert();
    }

    #[test]
    fn flags_become_settings() {
        let args = Args::try_parse_from([
            "cloud-mock",
            "--data-dir",
            "/tmp/x",
            "--token",
            "t",
            "--vip-pool",
            "127.77.0.0/24",
            "--dataplane",
            "none",
            "--provisioning-delay",
            "250ms",
        ])
        .unwrap();
        let settings = args.settings().unwrap();
        assert_eq!(settings.store, StoreSettings::Redb);
        assert_eq!(settings.provisioning_delay, Duration::from_millis(250));
        assert_eq!(settings.dataplane.mode, DataPlaneKind::None);
        assert_eq!(settings.vip_pools, "127.77.0.0/24".parse().unwrap());
        assert!(Args::try_parse_from(["cloud-mock", "--token", "t"]).is_err());
    }

    #[test]
    fn the_token_comes_from_the_flag_or_from_a_file() {
        let pool = [
            "cloud-mock",
            "--data-dir",
            "/tmp/x",
            "--vip-pool",
            "127.77.0.0/24",
        ];
        let with = |extra: &[&str]| Args::try_parse_from(pool.iter().chain(extra));
        assert_eq!(
            with(&["--token", "t"]).unwrap().settings().unwrap().token,
            TokenSource::Token("t".into())
        );
        assert_eq!(
            with(&["--token-file", "/etc/tandem/tokens"])
                .unwrap()
                .settings()
                .unwrap()
                .token,
            TokenSource::File("/etc/tandem/tokens".into())
        );
        assert_eq!(
            with(&["--tenants-file", "/etc/tandem/tenants.json"])
                .unwrap()
                .settings()
                .unwrap()
                .token,
            TokenSource::Tenants("/etc/tandem/tenants.json".into())
        );
        assert!(with(&["--tenants-file", "/t", "--token", "t"]).is_err());
        assert!(with(&["--tenants-file", "/t", "--token-file", "/tokens"]).is_err());
        assert!(with(&[]).is_err(), "one of them is required");
        assert!(
            with(&["--token", "t", "--token-file", "/tokens"]).is_err(),
            "not both"
        );
    }

    /// Parses the required flags and `extra`.
    fn parse(extra: &[&'static str]) -> Result<Args, clap::Error> {
        let base = ["cloud-mock", "--data-dir", "/tmp/x", "--token", "t"];
        Args::try_parse_from(base.iter().chain(extra))
    }

    #[test]
    fn a_production_edge_holds_no_load_balancer_back() {
        let args = parse(&["--vip-pool", "127.77.0.0/24"]).unwrap();
        assert_eq!(args.settings().unwrap().provisioning_delay, Duration::ZERO);
    }

    #[test]
    fn tls_takes_both_files_or_neither() {
        let pool = ["--vip-pool", "127.77.0.0/24"];
        let with_pool = |tls: &[&'static str]| parse(&[&pool[..], tls].concat());
        assert_eq!(with_pool(&[]).unwrap().tls(), None);
        assert_eq!(
            with_pool(&["--tls-cert-file", "/c.pem", "--tls-key-file", "/k.pem"])
                .unwrap()
                .tls(),
            Some(TlsFiles {
                cert_file: "/c.pem".into(),
                key_file: "/k.pem".into(),
                client_ca_file: None,
            })
        );
        assert!(with_pool(&["--tls-cert-file", "/c.pem"]).is_err());
        assert!(with_pool(&["--tls-key-file", "/k.pem"]).is_err());
        assert!(with_pool(&["--tls-client-ca-file", "/ca.pem"]).is_err());
        let mutual = with_pool(&[
            "--tls-cert-file",
            "/c.pem",
            "--tls-key-file",
            "/k.pem",
            "--tls-client-ca-file",
            "/ca.pem",
        ]);
        assert_eq!(
            mutual.unwrap().tls().unwrap().client_ca_file,
            Some("/ca.pem".into())
        );
    }

    #[test]
    fn vip_pools_repeat_and_may_come_as_a_list() {
        let repeated = parse(&[
            "--vip-pool",
            "10.0.0.0/24",
            "--vip-pool",
            "blue=10.1.0.0/28",
        ])
        .unwrap()
        .settings()
        .unwrap();
        let listed = parse(&["--vip-pool", "blue=10.1.0.0/28,10.0.0.0/24"])
            .unwrap()
            .settings()
            .unwrap();
        assert_eq!(repeated.vip_pools, listed.vip_pools);
        assert_eq!(
            repeated
                .vip_pools
                .cidr("blue", cloud_mock_sdk::IpFamily::Ipv4),
            Some("10.1.0.0/28".parse().unwrap())
        );
        let dual = parse(&[
            "--vip-pool",
            "blue=10.1.0.0/28",
            "--vip-pool",
            "blue=2001:db8:51:100::/64",
        ])
        .unwrap()
        .settings()
        .unwrap();
        assert_eq!(
            dual.vip_pools.cidr("blue", cloud_mock_sdk::IpFamily::Ipv6),
            Some("2001:db8:51:100::/64".parse().unwrap())
        );
        let overlapping = parse(&["--vip-pool", "10.0.0.0/16", "--vip-pool", "b=10.0.1.0/24"]);
        assert!(matches!(
            overlapping.unwrap().settings(),
            Err(SettingsError::Pools(PoolsError::Overlap { .. }))
        ));
        assert!(parse(&["--vip-pool", "Bad=10.0.0.0/8"]).is_err());
    }

    #[test]
    fn announcements_go_to_a_table_of_their_own() {
        let pool = ["--vip-pool", "127.77.0.0/24"];
        let none = parse(&pool).unwrap().settings().unwrap();
        assert_eq!(none.dataplane.announce, None);
        let announce = parse(
            &[
                &pool[..],
                &["--announce-table", "100", "--drain-delay", "2s"],
            ]
            .concat(),
        )
        .unwrap()
        .settings()
        .unwrap()
        .dataplane
        .announce
        .unwrap();
        assert_eq!(
            (announce.table, announce.route_protocol, announce.drain),
            (100, 78, Duration::from_secs(2))
        );
        for kernel_table in ["0", "253", "254", "255"] {
            assert!(
                parse(&[&pool[..], &["--announce-table", kernel_table]].concat()).is_err(),
                "{kernel_table}"
            );
        }
        assert!(
            parse(&[&pool[..], &["--drain-delay", "2s"]].concat()).is_err(),
            "a drain needs announcements"
        );
    }

    #[test]
    fn the_l2_mode_takes_a_device_and_etcd() {
        let etcd = [
            "--vip-pool",
            "127.77.0.0/24",
            "--store",
            "etcd",
            "--etcd-endpoints",
            "http://127.0.0.1:2379",
        ];
        let l2 = parse(&[&etcd[..], &["--l2-device", "eth1"]].concat())
            .unwrap()
            .settings()
            .unwrap()
            .l2
            .unwrap();
        assert_eq!(l2.device, "eth1");
        assert_eq!(l2.arping_program, PathBuf::from("arping"));
        assert!(
            parse(&["--vip-pool", "127.77.0.0/24", "--l2-device", "eth1"]).is_err(),
            "needs etcd"
        );
        assert!(
            parse(
                &[
                    &etcd[..],
                    &["--l2-device", "eth1", "--announce-table", "100"]
                ]
                .concat()
            )
            .is_err(),
            "one way of announcing"
        );
    }

    #[test]
    fn maglev_steering_is_asked_for() {
        let pool = ["--vip-pool", "127.77.0.0/24"];
        let kernel = parse(&pool).unwrap().settings().unwrap();
        assert!(kernel.dataplane.passthrough.maglev.is_none());
        let maglev = parse(
            &[
                &pool[..],
                &[
                    "--passthrough-steering",
                    "maglev",
                    "--maglev-first-table",
                    "4000",
                ],
            ]
            .concat(),
        )
        .unwrap()
        .settings()
        .unwrap()
        .dataplane
        .passthrough
        .maglev
        .unwrap();
        assert_eq!(maglev.first_table, 4000);
        assert!(parse(&[&pool[..], &["--maglev-first-table", "254"]].concat()).is_err());
    }

    #[test]
    fn an_etcd_store_names_its_members_and_a_copy_needs_no_server_flags() {
        let pool = ["--vip-pool", "127.77.0.0/24"];
        assert!(
            parse(&[&pool[..], &["--store", "etcd"]].concat()).is_err(),
            "no endpoints"
        );
        let etcd = parse(
            &[
                &pool[..],
                &[
                    "--store",
                    "etcd",
                    "--etcd-endpoints",
                    "http://127.0.0.1:2379,http://127.0.0.1:2381",
                ],
                &["--edge-name", "edge-1"],
            ]
            .concat(),
        )
        .unwrap()
        .settings()
        .unwrap();
        let StoreSettings::Etcd(settings) = etcd.store else {
            panic!("not etcd: {:?}", etcd.store);
        };
        assert_eq!(settings.endpoints.len(), 2);
        assert_eq!(settings.prefix, "/tandem-edge");
        assert_eq!(settings.edge_name, "edge-1");
        let copy = CopyStoreArgs::try_parse_from([
            "cloud-mock copy-store",
            "--data-dir",
            "/tmp/x",
            "--etcd-endpoints",
            "http://127.0.0.1:2379",
        ])
        .unwrap();
        assert_eq!(copy.etcd.settings().endpoints, ["http://127.0.0.1:2379"]);
    }
}
