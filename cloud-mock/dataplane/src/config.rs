use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use crate::announce::AnnounceConfig;

/// Whether the data plane realises load balancers at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPlaneKind {
    /// Realise every load balancer: proxy-mode ones with sockets on `VIP:port`,
    /// passthrough ones with kernel routes.
    Proxy,
    /// Proxy-mode load balancers are served by a real HAProxy (`haproxy` settings);
    /// passthrough ones by kernel routes, as with `Proxy`. UDP listeners are refused.
    Haproxy,
    /// Realise nothing (an API-only mock): no sockets, no probes, health stays unknown.
    None,
}

impl DataPlaneKind {
    /// Whether proxy-mode listeners may be UDP.
    pub const fn serves_udp(self) -> bool {
        !matches!(self, Self::Haproxy)
    }
}

/// Where and how the HAProxy data plane runs HAProxy.
#[derive(Debug, Clone)]
pub struct HaproxySettings {
    /// The `haproxy` program (2.6 or newer).
    pub program: PathBuf,
    /// HAProxy's configuration file and its two command sockets (the master CLI and the
    /// runtime API, both Unix sockets of mode 600: never on the network) live here.
    pub state_dir: PathBuf,
    /// Least time between two reloads; changes in between wait and go in one reload.
    pub min_reload_interval: Duration,
    /// Ports that other sockets of the edge's namespace listen on, on some address (the
    /// edge's own API): a listener on one binds its VIP alone, since a bind on every
    /// address would collide with them, and a new VIP on it takes a reload.
    pub shared_ports: BTreeSet<u16>,
}

impl Default for HaproxySettings {
    fn default() -> Self {
        Self {
            program: PathBuf::from("haproxy"),
            state_dir: PathBuf::from("/var/lib/cloud-mock/haproxy"),
            min_reload_interval: Duration::from_millis(500),
            shared_ports: BTreeSet::new(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct DataPlaneConfig {
    pub mode: DataPlaneKind,
    /// Time between two health probes of one backend.
    pub health_interval: Duration,
    /// Time one probe may take before it counts as failed.
    pub health_timeout: Duration,
    /// Consecutive passing probes that turn an unhealthy backend healthy.
    pub healthy_threshold: u32,
    /// Consecutive failing probes that turn a healthy backend unhealthy.
    pub unhealthy_threshold: u32,
    /// Time allowed to connect to one backend before the next healthy one is tried.
    pub connect_timeout: Duration,
    /// A UDP flow with no packet in either direction for this long is forgotten.
    pub udp_idle_timeout: Duration,
    /// Most UDP flows one listener tracks; packets of further new flows are dropped.
    pub udp_max_sessions: usize,
    /// Add non-loopback proxy-mode VIPs as /32 or /128 addresses to `vip_device` (and remove them
    /// when their load balancer goes). Only for a network namespace the cloud owns (the
    /// lab's cloud edge): outside one it would change the host.
    pub manage_vip_addresses: bool,
    pub vip_device: String,
    pub passthrough: PassthroughConfig,
    /// Used by `DataPlaneKind::Haproxy` only.
    pub haproxy: HaproxySettings,
    /// The iproute2 `ip` program.
    pub ip_program: PathBuf,
    /// Announce the VIPs this edge can forward to a BGP speaker (none: nothing announced).
    pub announce: Option<AnnounceConfig>,
}

/// Settings of passthrough-mode kernel routes.
#[derive(Debug, Clone)]
pub struct PassthroughConfig {
    /// `proto` number that marks routes as ours, so that routes left by an earlier run are
    /// found and replaced or removed, and routes of anyone else are never touched.
    pub route_protocol: u8,
    /// Set `net.ipv4.fib_multipath_hash_policy=1` (L4 hash) before the first route, so that
    /// the multipath hash (resilient groups use it too) spreads flows, not just
    /// source/destination pairs, over the backends.
    pub set_multipath_hash_policy: bool,
    /// Steer TCP and UDP flows by Maglev hashing, the same on every edge of an edge
    /// cluster (none: the routes' own hash, which is this host's alone).
    pub maglev: Option<MaglevConfig>,
}

/// Settings of the Maglev steering of passthrough flows (module `maglev`).
#[derive(Debug, Clone)]
pub struct MaglevConfig {
    /// The routing table (and packet mark) of the first node; node tables are
    /// `first_table .. first_table + tables`, all ours.
    pub first_table: u32,
    /// How many nodes can be steered to; a VIP with more nodes keeps its main-table route.
    pub tables: u32,
    /// The priority of the rules from a node's mark to its table: before `main` (32766).
    pub rule_priority: u32,
    /// The nftables `nft` program.
    pub nft_program: PathBuf,
}

impl Default for MaglevConfig {
    fn default() -> Self {
        Self {
            first_table: 0x7a00,
            tables: 1024,
            rule_priority: 100,
            nft_program: PathBuf::from("nft"),
        }
    }
}

impl Default for PassthroughConfig {
    fn default() -> Self {
        Self {
            route_protocol: 77,
            set_multipath_hash_policy: true,
            maglev: None,
        }
    }
}

impl Default for DataPlaneConfig {
    fn default() -> Self {
        Self {
            mode: DataPlaneKind::Proxy,
            health_interval: Duration::from_secs(1),
            health_timeout: Duration::from_secs(1),
            healthy_threshold: 2,
            unhealthy_threshold: 2,
            connect_timeout: Duration::from_secs(3),
            udp_idle_timeout: Duration::from_secs(60),
            udp_max_sessions: 4096,
            manage_vip_addresses: false,
            vip_device: "lo".to_owned(),
            passthrough: PassthroughConfig::default(),
            haproxy: HaproxySettings::default(),
            ip_program: PathBuf::from("ip"),
            announce: None,
        }
    }
}
