//! The two data paths the sync loop can program, behind one interface: the kube-proxy v1.21
//! iptables layout (the default, [`iptables`]) and the nftables table `ip tandem`
//! (`ip6 tandem`, [`nftables`]). Each is laid out alike: its state keeps the desired rules
//! current one changed Service port at a time and can be checked against a full rebuild,
//! its executor writes only what changed, and its read-back compares the kernel with what
//! was written to repair what someone else changed, at once where the kernel announces
//! changes ([`events`]) and every sync period where it does not.

pub mod events;
pub mod iptables;
pub mod nftables;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use ipnet::IpNet;
use tandem_common::{IpFamily, ProxyMode};
use tandem_nftables::digest::TableDigest;
use tandem_nftables::kernel::{KernelError, Netlink};
use tandem_nftables::{NftFamily, Transaction};
use tandem_proxy_rules::model::{NodeConfig, ProxyState, ServicePortName};
use tandem_proxy_rules::ruleset::Table;
use tokio::task::JoinHandle;

use self::iptables::backend::{self, Backend, BackendChoice, Tools};
use self::iptables::{ChainScope, IptablesPath, IptablesReadBack, SyncError, Syncer};
use self::nftables::NftablesPath;
use crate::metrics::{Metrics, RepairLabels, RepairedObject, TableLabels};

/// Opens the data path of `mode`. The other mode's rules, if a node switched modes, stay
/// until this mode's first sync is in (see [`DataPath::apply`]), so the node is never
/// without rules: while both are there, the first NAT chain to bind a new connection
/// decides it (both send it to the same endpoints), a connection is masqueraded once
/// (one source binding per connection), and both drop the same sources.
pub async fn start(
    mode: ProxyMode,
    backend_choice: BackendChoice,
    mut node: NodeConfig,
) -> Result<DataPath, StartError> {
    let (backend, reason) = backend::resolve(backend_choice).await;
    let tools = Tools::new(backend, node.family);
    match mode {
        ProxyMode::Iptables => {
            tracing::info!(%backend, %reason, family = %node.family, restore = tools.restore(), "iptables mode; backend chosen");
            if node.family == IpFamily::V4
                && node.localhost_node_ports
                && node.node_ports_overlap_loopback()
                && let Err(error) = enable_route_localnet().await
            {
                // An unprivileged container sees /proc/sys read-only. Without the sysctl
                // a DNATed packet to 127.0.0.1 is dropped as martian, so refuse such
                // connections at once instead, as --iptables-localhost-nodeports=false does.
                tracing::warn!(
                    %error,
                    "cannot set route_localnet: node ports are not served on 127.0.0.0/8 (set net.ipv4.conf.all.route_localnet=1 on the host, or run privileged, to serve them)"
                );
                node.localhost_node_ports = false;
            }
            Ok(DataPath::Iptables(IptablesPath::new(
                node,
                Syncer::new(tools),
            )))
        }
        ProxyMode::Nftables => {
            let family = node.family;
            let kernel = tokio::task::spawn_blocking(move || open_netlink(family))
                .await
                .map_err(|e| StartError::Task(e.to_string()))??;
            tracing::info!(table = %family.nft_table(), "nftables mode, written through netlink");
            Ok(DataPath::Nftables(NftablesPath::new(node, kernel, backend)))
        }
    }
}

/// Where the kernel keeps `route_localnet` for every interface.
const ROUTE_LOCALNET: &str = "/proc/sys/net/ipv4/conf/all/route_localnet";

/// Lets packets to 127.0.0.0/8 be DNATed to a pod, which node ports on localhost need (as
/// kube-proxy does in iptables mode; left set on exit, as kube-proxy leaves it). Packets
/// from other hosts to 127.0.0.0/8 are then routed too: the kubelet's "block incoming
/// localnet connections" rule drops them.
async fn enable_route_localnet() -> Result<(), StartError> {
    // Set on the host already (or by an earlier run): nothing to write.
    if tokio::fs::read_to_string(ROUTE_LOCALNET)
        .await
        .is_ok_and(|value| value.trim() == "1")
    {
        return Ok(());
    }
    tracing::info!(
        "setting route_localnet=1 to serve node ports on 127.0.0.1; --iptables-localhost-nodeports=false or --nodeport-addresses without 127.0.0.0/8 turn this off"
    );
    tokio::fs::write(ROUTE_LOCALNET, "1")
        .await
        .map_err(StartError::RouteLocalnet)
}

/// A netlink socket that reads our table of `family`; its writes are known as ours
/// ([`events`]).
fn open_netlink(family: IpFamily) -> Result<Netlink, KernelError> {
    let netlink = Netlink::open()?.reading(family);
    events::record_own_port(netlink.port().map_err(KernelError::Open)?);
    Ok(netlink)
}

/// `--cleanup`: everything either mode installs, in both families.
pub async fn cleanup(backend_choice: BackendChoice) -> Result<(), StartError> {
    let (backend, reason) = backend::resolve(backend_choice).await;
    tracing::info!(%backend, %reason, "removing all node proxy rules");
    Syncer::new(Tools::new(backend, IpFamily::V4))
        .cleanup()
        .await?;
    // A host without IPv6 (or its ip6tables) has no IPv6 rules of ours either.
    let ipv6 = Tools::new(backend, IpFamily::V6);
    if let Err(error) = Syncer::new(ipv6).cleanup().await {
        tracing::warn!(%error, tools = %ipv6, "could not remove IPv6 rules");
    }
    remove_nftables_table(IpFamily::V4).await?;
    remove_nftables_table(IpFamily::V6).await
}

/// Deletes our table of `family` (no error when it is not there).
pub async fn remove_nftables_table(family: IpFamily) -> Result<(), StartError> {
    tokio::task::spawn_blocking(move || Netlink::open()?.apply(&Transaction::delete_all(family)))
        .await
        .map_err(|e| StartError::Task(e.to_string()))??;
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("iptables: {0}")]
    Iptables(#[from] SyncError),
    #[error("nftables: {0}")]
    Nftables(#[from] KernelError),
    #[error("netlink task: {0}")]
    Task(String),
    #[error("setting {ROUTE_LOCALNET}: {0}")]
    RouteLocalnet(std::io::Error),
}

pub enum DataPath {
    Iptables(IptablesPath),
    Nftables(NftablesPath),
}

/// What a change to the desired rules ([`DataPath::update`],
/// [`DataPath::set_service_cidrs`]) left for the next apply to write: each mode fills in
/// its own fields, and the ones of the other mode stay zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RulesChanged {
    /// iptables: the chains whose rules changed (or that went).
    pub chains: usize,
    /// nftables: the operations of the change's transaction, queued for the next apply
    /// (which writes the whole table instead while it is out of sync).
    pub operations: usize,
    /// nftables, while the next apply writes the whole table: the Service ports rebuilt
    /// for it, with no operations queued.
    pub ports_rebuilt: usize,
}

impl RulesChanged {
    /// Nothing changed.
    pub fn is_empty(self) -> bool {
        self == Self::default()
    }
}

impl std::ops::AddAssign for RulesChanged {
    fn add_assign(&mut self, other: Self) {
        self.chains += other.chains;
        self.operations += other.operations;
        self.ports_rebuilt += other.ports_rebuilt;
    }
}

/// A finished read-back of the kernel.
pub struct ReadBack {
    kernel: KernelRead,
    /// From its start to its end, beside the sync loop.
    pub elapsed: Duration,
}

enum KernelRead {
    Iptables(Result<IptablesReadBack, SyncError>),
    Nftables(Result<TableDigest, KernelError>),
}

/// Chains logged one by one per read-back; the rest are counted.
const LOGGED_OBJECTS: usize = 10;

impl DataPath {
    /// The node's zone changed: ports updated from now on choose their endpoints by the
    /// new one; the caller updates those whose endpoints carry zone hints.
    pub fn set_zone(&mut self, zone: Option<String>) {
        match self {
            DataPath::Iptables(path) => path.set_zone(zone),
            DataPath::Nftables(path) => path.set_zone(zone),
        }
    }

    /// The node's Service CIDRs of this family are now `cidrs`: the nftables mode rewrites
    /// its `cluster-ips-check` chain; the iptables mode has no rule that uses them, as
    /// kube-proxy's. Returns what the change left for the next apply.
    pub fn set_service_cidrs(&mut self, cidrs: Vec<IpNet>) -> RulesChanged {
        match self {
            DataPath::Iptables(_) => RulesChanged::default(),
            DataPath::Nftables(path) => path.set_service_cidrs(cidrs),
        }
    }

    /// Rebuilds the given Service ports from `state`; returns what the change left for
    /// the next apply.
    pub fn update(
        &mut self,
        state: &ProxyState,
        ports: &BTreeSet<ServicePortName>,
    ) -> RulesChanged {
        match self {
            DataPath::Iptables(path) => path.update(state, ports),
            DataPath::Nftables(path) => path.update(state, ports),
        }
    }

    /// The safety net: rebuilds every port of `state` from nothing (in nftables mode, each
    /// in the bucket slot it holds) and compares. A difference is a bug in the change
    /// tracking; the rebuild then takes over (and is written on the next apply). Returns
    /// the number of differing chains or objects.
    pub fn check_against_full_rebuild(
        &mut self,
        node: &NodeConfig,
        state: &ProxyState,
    ) -> Option<usize> {
        match self {
            DataPath::Iptables(path) => path.check_against_full_rebuild(node, state),
            DataPath::Nftables(path) => path.check_against_full_rebuild(state),
        }
    }

    /// Starts reading back what the kernel holds of our rules, on its own task beside
    /// the sync loop; what is written meanwhile is left out of the comparison
    /// ([`DataPath::take_read_back`]). With `only`, the iptables mode reads the rules of
    /// those chains alone (with the built-in chains and the chain names, as always); the
    /// nftables mode always reads its whole table.
    pub fn start_read_back(&mut self, only: Option<ChainScope>) -> JoinHandle<ReadBack> {
        match self {
            DataPath::Iptables(path) => path.start_read_back(only),
            DataPath::Nftables(path) => path.start_read_back(),
        }
    }

    /// What the kernel's announcements say about this data path's rules: `None` on
    /// iptables-legacy, which announces nothing.
    pub fn written(&self) -> Option<events::Written> {
        match self {
            DataPath::Iptables(path) => {
                (path.backend() == Backend::Nft).then_some(events::Written::IptablesNft)
            }
            DataPath::Nftables(_) => Some(events::Written::NftablesTable),
        }
    }

    /// True when a read-back should start now rather than at the next period (the
    /// iptables-nft tables written in full take their digests from it).
    pub fn wants_read_back(&self) -> bool {
        match self {
            DataPath::Iptables(path) => path.wants_read_back(),
            DataPath::Nftables(_) => false,
        }
    }

    /// Compares a finished read-back with what was written (leaving out what was written
    /// since it began), logs and counts what differs, and schedules its repair with the
    /// next apply. Returns how many objects are to be repaired.
    pub fn take_read_back(&mut self, read: ReadBack, metrics: &Metrics) -> usize {
        metrics
            .readback_duration
            .observe(read.elapsed.as_secs_f64());
        let repairs = match (self, read.kernel) {
            (DataPath::Iptables(path), KernelRead::Iptables(Ok(kernel))) => {
                path.repair(kernel, metrics)
            }
            (DataPath::Nftables(path), KernelRead::Nftables(Ok(kernel))) => {
                path.repair(&kernel, metrics)
            }
            (_, KernelRead::Iptables(Err(error))) => {
                tracing::warn!(%error, "reading back the iptables rules failed; trying again next period");
                metrics.readback_failures.inc();
                0
            }
            (_, KernelRead::Nftables(Err(error))) => {
                tracing::warn!(%error, "reading back our nftables table failed; trying again next period");
                metrics.readback_failures.inc();
                0
            }
            _ => 0,
        };
        tracing::debug!(
            elapsed_ms = read.elapsed.as_millis() as u64,
            repairs,
            "read-back compared"
        );
        repairs
    }

    /// How many chains, rules and elements it holds.
    pub fn size(&self) -> DataPathSize {
        match self {
            DataPath::Iptables(path) => path.size(),
            DataPath::Nftables(path) => path.size(),
        }
    }

    /// Writes what changed since the last successful apply (and the repairs a read-back
    /// queued). Returns false when the kernel refused it; the next apply then rewrites in
    /// full. The first successful apply also removes the other mode's rules.
    pub async fn apply(&mut self, metrics: &Metrics) -> bool {
        match self {
            DataPath::Iptables(path) => path.apply(metrics).await,
            DataPath::Nftables(path) => path.apply(metrics).await,
        }
    }
}

fn count_repairs(metrics: &Metrics, object: RepairedObject, count: usize) {
    if count > 0 {
        metrics
            .sync_repairs
            .get_or_create(&RepairLabels { object })
            .inc_by(count as u64);
    }
}

/// The size of one data path, or of several (the proxiers of both families) added up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DataPathSize {
    /// iptables mode: chains and rules per table.
    iptables: BTreeMap<Table, (usize, usize)>,
    /// nftables mode: chains, rules and set elements.
    nftables: Option<(usize, usize, usize)>,
}

impl std::ops::Add for DataPathSize {
    type Output = Self;

    fn add(mut self, other: Self) -> Self {
        for (table, (chains, rules)) in other.iptables {
            let total = self.iptables.entry(table).or_default();
            *total = (total.0 + chains, total.1 + rules);
        }
        self.nftables = match (self.nftables, other.nftables) {
            (Some(a), Some(b)) => Some((a.0 + b.0, a.1 + b.1, a.2 + b.2)),
            (a, b) => a.or(b),
        };
        self
    }
}

impl DataPathSize {
    /// Sets the size gauges of the modes it covers.
    pub fn record(&self, metrics: &Metrics) {
        for (&table, &(chains, rules)) in &self.iptables {
            let labels = TableLabels {
                table: table.into(),
            };
            metrics.chains.get_or_create(&labels).set(chains as i64);
            metrics.rules.get_or_create(&labels).set(rules as i64);
        }
        if let Some((chains, rules, elements)) = self.nftables {
            metrics.nftables_chains.set(chains as i64);
            metrics.nftables_rules.set(rules as i64);
            metrics.nftables_elements.set(elements as i64);
        }
    }
}
