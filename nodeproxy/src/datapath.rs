//! The two data paths the sync loop can program, behind one interface: the kube-proxy v1.21
//! iptables layout (the default) and the nftables table `ip tandem` (`ip6 tandem`). Each keeps its desired
//! rules current one changed Service port at a time, can be checked against a full rebuild,
//! writes only what changed, and is read back from the kernel every sync period to repair
//! what someone else changed.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use tandem_common::IpFamily;
use tandem_common::ProxyMode;
use tandem_nftables::digest::{ChainDigest, ObjectKind, SetDigest, TableDigest};
use tandem_nftables::encode::Batch;
use tandem_nftables::kernel::{KernelError, Netlink};
use tandem_nftables::{Fingerprint, NftFamily, TABLE, TableDrift, Transaction, Written};
use tandem_proxy_rules::incremental::IncrementalRuleset;
use tandem_proxy_rules::model::{NodeConfig, ProxyState, ServicePortName};
use tandem_proxy_rules::nft;
use tandem_proxy_rules::ruleset::{ChangedChains, Table};
use tokio::task::JoinHandle;

use crate::backend::{self, Backend, BackendChoice, Tools};
use crate::iptables::{self, ChainScope, IptablesReadBack, SyncError, Syncer};
use crate::metrics::{Metrics, RepairLabels, RepairedObject, TableLabel, TableLabels};
use crate::ruleset_events;

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
            Ok(DataPath::iptables(node, Syncer::new(tools)))
        }
        ProxyMode::Nftables => {
            let family = node.family;
            let kernel = tokio::task::spawn_blocking(move || open_netlink(family))
                .await
                .map_err(|e| StartError::Task(e.to_string()))??;
            tracing::info!(table = %family.nft_table(), "nftables mode, written through netlink");
            Ok(DataPath::nftables(node, kernel, backend))
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
/// ([`ruleset_events`]).
fn open_netlink(family: IpFamily) -> Result<Netlink, KernelError> {
    let netlink = Netlink::open()?.reading(family);
    ruleset_events::record_own_port(netlink.port().map_err(KernelError::Open)?);
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

pub struct IptablesPath {
    rules: IncrementalRuleset,
    syncer: Syncer,
    /// Chains changed since the last successful apply.
    changed: ChangedChains,
    /// The nftables mode's table of this family may be there: removed after the first
    /// successful apply.
    remove_nftables_table: bool,
}

pub struct NftablesPath {
    rules: nft::incremental::IncrementalRuleset,
    /// `None` only while a transaction is in flight on the blocking pool.
    kernel: Option<Netlink>,
    /// Operations not applied yet, in order, on the table of this proxier's family (the
    /// default transaction's, IPv4, would send an IPv6 proxier's to table ip tandem).
    pending: Transaction,
    /// False until a whole-table write succeeded, and again after any failed transaction:
    /// the next apply then replaces the table in full instead of sending `pending`.
    in_sync: bool,
    /// The iptables mode's rules may be there (in this backend): removed after the first
    /// successful apply.
    remove_iptables: Option<Backend>,
    /// True until the first whole-table write: a table an earlier run left that already
    /// holds exactly these rules is kept as it is, so a restart writes nothing.
    adopt_kernel_table: bool,
    /// The digests of the chains and sets as written, for the read-back; an object is
    /// dropped when written and digested again when the next read-back is compared.
    digests: TableDigest,
    /// What was written since the read-back in flight began.
    written_since_read: Written,
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
    pub fn iptables(node: NodeConfig, syncer: Syncer) -> Self {
        DataPath::Iptables(IptablesPath {
            rules: IncrementalRuleset::new(node),
            syncer,
            changed: ChangedChains::default(),
            remove_nftables_table: true,
        })
    }

    /// `backend`: where the iptables mode's rules would be, to remove them.
    pub fn nftables(node: NodeConfig, kernel: Netlink, backend: Backend) -> Self {
        let family = node.family;
        DataPath::Nftables(NftablesPath {
            rules: nft::incremental::IncrementalRuleset::new(node),
            kernel: Some(kernel),
            pending: Transaction {
                family,
                ops: Vec::new(),
            },
            in_sync: false,
            remove_iptables: Some(backend),
            adopt_kernel_table: true,
            digests: TableDigest::default(),
            written_since_read: Written::default(),
        })
    }

    /// The node's zone changed: ports updated from now on choose their endpoints by the
    /// new one; the caller updates those whose endpoints carry zone hints.
    pub fn set_zone(&mut self, zone: Option<String>) {
        match self {
            DataPath::Iptables(path) => path.rules.set_zone(zone),
            DataPath::Nftables(path) => path.rules.set_zone(zone),
        }
    }

    /// The node's Service CIDRs of this family are now `cidrs`: the nftables mode rewrites
    /// its `cluster-ips-check` chain alone (queued for the next apply, or in the whole table
    /// that apply writes); the iptables mode has no rule that uses them, as kube-proxy's.
    /// Returns the operations the change needs.
    pub fn set_service_cidrs(&mut self, cidrs: Vec<IpNet>) -> RulesChanged {
        match self {
            DataPath::Iptables(_) => RulesChanged::default(),
            DataPath::Nftables(path) => {
                let tx = path.rules.set_service_cidrs(cidrs);
                let operations = tx.ops.len();
                if path.in_sync {
                    path.pending.ops.extend(tx.ops);
                }
                RulesChanged {
                    operations,
                    ..RulesChanged::default()
                }
            }
        }
    }

    /// Rebuilds the given Service ports from `state`; returns the chains (iptables) or
    /// operations (nftables) the change needs, or, for an nftables table that the next
    /// apply writes whole, the ports rebuilt.
    pub fn update(
        &mut self,
        state: &ProxyState,
        ports: &BTreeSet<ServicePortName>,
    ) -> RulesChanged {
        match self {
            DataPath::Iptables(path) => {
                let changed = path.rules.update(state, ports);
                let chains = changed.count();
                path.changed.merge(changed);
                RulesChanged {
                    chains,
                    ..RulesChanged::default()
                }
            }
            DataPath::Nftables(path) if !path.in_sync => {
                path.rules.update_without_transaction(state, ports);
                RulesChanged {
                    ports_rebuilt: ports.len(),
                    ..RulesChanged::default()
                }
            }
            DataPath::Nftables(path) => {
                let tx = path.rules.update(state, ports);
                let operations = tx.ops.len();
                path.pending.ops.extend(tx.ops);
                RulesChanged {
                    operations,
                    ..RulesChanged::default()
                }
            }
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
            DataPath::Iptables(path) => {
                // Built port by port from nothing, so on a divergence it can take over as is;
                // from scratch it equals `tandem_proxy_rules::build` (tested in the rules crate).
                let mut rebuilt = IncrementalRuleset::new(node.clone());
                rebuilt.update(state, state.services.keys());
                if rebuilt.ruleset() == path.rules.ruleset() {
                    return None;
                }
                let differing = ChangedChains::between(path.rules.ruleset(), rebuilt.ruleset());
                let count = differing.count();
                tracing::error!(
                    chains = count,
                    first = ?differing.nat.iter().chain(&differing.filter).take(5).collect::<Vec<_>>(),
                    "the incremental ruleset differs from a full rebuild; using the full rebuild"
                );
                path.rules = rebuilt;
                path.changed.merge(differing);
                Some(count)
            }
            DataPath::Nftables(path) => {
                // Rebuilt in place and compared by fingerprint: a second whole ruleset
                // beside the first made this check the node proxy's peak memory (195
                // against 179 MiB at 10,000 Services).
                let before = Fingerprint::of(path.rules.ruleset());
                path.rules.rebuild(state);
                let after = Fingerprint::of(path.rules.ruleset());
                let differing = before.differing(&after);
                if differing.is_empty() {
                    return None;
                }
                tracing::error!(
                    objects = differing.len(),
                    first = ?differing.iter().take(5).collect::<Vec<_>>(),
                    "the incremental nftables ruleset differs from a full rebuild; replacing the table"
                );
                path.in_sync = false;
                Some(differing.len())
            }
        }
    }

    /// Starts reading back what the kernel holds of our rules, on its own task beside
    /// the sync loop; what is written meanwhile is left out of the comparison
    /// ([`DataPath::take_read_back`]). With `only`, the iptables mode reads the rules of
    /// those chains alone (with the built-in chains and the chain names, as always); the
    /// nftables mode always reads its whole table.
    pub fn start_read_back(&mut self, only: Option<ChainScope>) -> JoinHandle<ReadBack> {
        let started = Instant::now();
        match self {
            DataPath::Iptables(path) => {
                let backend = path.syncer.begin_read();
                tokio::spawn(async move {
                    let kernel = KernelRead::Iptables(iptables::read_back(backend, only).await);
                    ReadBack {
                        kernel,
                        elapsed: started.elapsed(),
                    }
                })
            }
            DataPath::Nftables(path) => {
                path.written_since_read = Written::default();
                let family = path.family();
                tokio::task::spawn_blocking(move || {
                    let read =
                        open_netlink(family).and_then(|mut kernel| kernel.read_table(TABLE, true));
                    ReadBack {
                        kernel: KernelRead::Nftables(read),
                        elapsed: started.elapsed(),
                    }
                })
            }
        }
    }

    /// What the kernel's announcements say about this data path's rules: `None` on
    /// iptables-legacy, which announces nothing.
    pub fn written(&self) -> Option<ruleset_events::Written> {
        match self {
            DataPath::Iptables(path) => (path.syncer.backend() == Backend::Nft)
                .then_some(ruleset_events::Written::IptablesNft),
            DataPath::Nftables(_) => Some(ruleset_events::Written::NftablesTable),
        }
    }

    /// True when a read-back should start now rather than at the next period (the
    /// iptables-nft tables written in full take their digests from it).
    pub fn wants_read_back(&self) -> bool {
        match self {
            DataPath::Iptables(path) => path.syncer.wants_read_back(),
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
        let mut size = DataPathSize::default();
        match self {
            DataPath::Iptables(path) => {
                let ruleset = path.rules.ruleset();
                for table in Table::ALL {
                    let rules = ruleset.table(table);
                    size.iptables.insert(
                        table,
                        (
                            rules.chains.len(),
                            rules.chains.values().map(Vec::len).sum(),
                        ),
                    );
                }
            }
            DataPath::Nftables(path) => {
                let ruleset = path.rules.ruleset();
                size.nftables = Some((
                    ruleset.chains.len(),
                    ruleset.rule_count(),
                    ruleset.element_count(),
                ));
            }
        }
        size
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

impl IptablesPath {
    async fn apply(&mut self, metrics: &Metrics) -> bool {
        let changed = std::mem::take(&mut self.changed);
        match self
            .syncer
            .sync_changed(self.rules.ruleset(), &changed)
            .await
        {
            Ok(tables) => {
                for done in tables {
                    tracing::info!(
                        table = done.table.as_str(),
                        full = done.full,
                        mode = ?done.mode,
                        chains_written = done.written_chains,
                        chains_deleted = done.deleted_chains,
                        rules = done.rules,
                        elapsed_ms = done.elapsed.as_millis() as u64,
                        "iptables-restore applied"
                    );
                }
                if std::mem::take(&mut self.remove_nftables_table) {
                    // A kernel without nf_tables has no table of ours to remove either.
                    let family = self.rules.node().family;
                    match remove_nftables_table(family).await {
                        Ok(()) => tracing::info!(
                            table = %family.nft_table(),
                            "the nftables mode's table removed, if it was there"
                        ),
                        Err(error) => {
                            tracing::warn!(%error, "could not remove the nftables mode's table")
                        }
                    }
                }
                true
            }
            Err(error) => {
                if let SyncError::Restore { table, .. } = &error
                    && let Some(table) = TableLabel::from_name(table)
                {
                    metrics
                        .restore_failures
                        .get_or_create(&TableLabels { table })
                        .inc();
                }
                // The syncer forgot the failed table: it is rewritten in full next time.
                tracing::error!(%error, "applying iptables rules failed; the table is rewritten in full next sync");
                false
            }
        }
    }

    /// Schedules the repair of what the read-back found (see [`Syncer::take_read_back`]),
    /// and logs and counts it.
    fn repair(&mut self, kernel: IptablesReadBack, metrics: &Metrics) -> usize {
        let mut repairs = 0;
        for found in self.syncer.take_read_back(kernel, self.rules.ruleset()) {
            let (table, drift) = (found.table.as_str(), &found.drift);
            let chains = drift.chains.len() + drift.unexpected.len();
            if found.whole {
                tracing::warn!(
                    table,
                    canary_missing = drift.canary_missing,
                    chains,
                    "our chains in this table were flushed or deleted wholesale; writing the table in full"
                );
                count_repairs(metrics, RepairedObject::Table, 1);
                repairs += 1;
                continue;
            }
            for (chain, chain_drift) in drift.chains.iter().take(LOGGED_OBJECTS) {
                let missing = found.missing_rules.get(chain).cloned().unwrap_or_default();
                tracing::warn!(
                    table,
                    chain = %chain,
                    absent = chain_drift.absent,
                    missing = ?missing,
                    missing_count = chain_drift.missing.len(),
                    unexpected = chain_drift.unexpected,
                    "chain differs from what was written; rewriting it"
                );
            }
            for chain in drift.unexpected.iter().take(LOGGED_OBJECTS) {
                tracing::warn!(table, chain = %chain, "chain of ours that we did not write; deleting it");
            }
            if chains > LOGGED_OBJECTS {
                tracing::warn!(
                    table,
                    chains,
                    "more chains differ than logged; repairing them all"
                );
            }
            for jump in &drift.jumps {
                tracing::warn!(
                    table,
                    chain = jump.builtin_chain,
                    rule = jump.rule,
                    "base jump missing; inserting it again"
                );
            }
            for line in &drift.shared {
                tracing::warn!(table, line = %line, "shared chain lacks our rule; adding it");
            }
            let shared_chains = drift.shared_chains().len();
            count_repairs(metrics, RepairedObject::Chain, chains + shared_chains);
            count_repairs(metrics, RepairedObject::Jump, drift.jumps.len());
            repairs += chains + shared_chains + drift.jumps.len();
            self.changed
                .table_mut(found.table)
                .extend(drift.chains.keys().chain(&drift.unexpected).cloned());
        }
        repairs
    }
}

impl NftablesPath {
    fn family(&self) -> IpFamily {
        self.rules.ruleset().family
    }

    async fn apply(&mut self, metrics: &Metrics) -> bool {
        let full = !self.in_sync;
        let family = self.family();
        if full {
            self.pending.ops.clear();
        } else if self.pending.is_empty() {
            return true;
        }
        let Some(mut kernel) = self.kernel.take() else {
            tracing::error!("the netlink socket was lost; reopening");
            return self.reopen();
        };
        let started = Instant::now();
        let (outgoing, ops, written) = if full {
            // Encoded here from the rules in place, as the blocking task cannot borrow
            // them: a transaction of their copies beside its batch was the first sync's
            // peak memory.
            let mut ops = 0;
            let all = Transaction::replace_all_ops(self.rules.ruleset()).inspect(|_| ops += 1);
            let batch = kernel.encode_ops(family, all);
            let written = Written {
                table: true,
                ..Written::default()
            };
            (Outgoing::Table(batch), ops, written)
        } else {
            let empty = Transaction {
                family,
                ops: Vec::new(),
            };
            let tx = std::mem::replace(&mut self.pending, empty);
            let (ops, written) = (tx.ops.len(), tx.written());
            (Outgoing::Changes(tx), ops, written)
        };
        // The digests go to the blocking task and come back with the kernel.
        let adopt = (full && std::mem::take(&mut self.adopt_kernel_table)).then(|| {
            self.refresh_digests();
            std::mem::take(&mut self.digests)
        });
        let (kernel, result, expected) = match tokio::task::spawn_blocking(move || {
            let result = match &adopt {
                Some(expected) if kernel_holds(&mut kernel, expected) => Ok(Write::Adopted),
                _ => outgoing.send(&mut kernel).map(|()| Write::Applied),
            };
            (kernel, result, adopt)
        })
        .await
        {
            Ok(done) => done,
            Err(error) => {
                tracing::error!(%error, "the nftables transaction task failed");
                self.in_sync = false;
                return self.reopen();
            }
        };
        self.kernel = Some(kernel);
        if let Some(digests) = expected {
            self.digests = digests;
        }
        let result = if full {
            let ruleset = self.rules.ruleset();
            result.map_err(|error| {
                error.naming_operation(
                    |index| Transaction::replace_all_ops(ruleset).nth(index),
                    family,
                )
            })
        } else {
            result
        };
        match result {
            Ok(write) => {
                self.in_sync = true;
                if write == Write::Adopted {
                    tracing::info!(
                        table = %self.family().nft_table(),
                        elapsed_ms = started.elapsed().as_millis() as u64,
                        "the table already holds these rules; kept as it is"
                    );
                } else {
                    tracing::info!(
                        table = %self.family().nft_table(),
                        full,
                        ops,
                        elapsed_ms = started.elapsed().as_millis() as u64,
                        "nftables transaction applied"
                    );
                    self.forget_digests(&written);
                    self.written_since_read.merge(written);
                }
                if let Some(backend) = self.remove_iptables.take() {
                    // Both families': this mode serves neither in iptables.
                    for tools in [IpFamily::V4, IpFamily::V6].map(|f| Tools::new(backend, f)) {
                        match Syncer::new(tools).cleanup().await {
                            Ok(()) => {
                                tracing::info!(%tools, "the iptables mode's rules removed, if they were there")
                            }
                            // A host without iptables has no iptables-mode rules either.
                            Err(error) => {
                                tracing::warn!(%error, %tools, "could not remove iptables-mode rules")
                            }
                        }
                    }
                }
                true
            }
            Err(error) => {
                self.in_sync = false;
                metrics.nftables_failures.inc();
                tracing::error!(%error, full, ops, "nftables transaction rejected; the previous rules stay, and the table is replaced in full next sync");
                false
            }
        }
    }

    fn reopen(&mut self) -> bool {
        match open_netlink(self.family()) {
            Ok(kernel) => self.kernel = Some(kernel),
            Err(error) => tracing::error!(%error, "opening a netlink socket"),
        }
        self.in_sync = false;
        false
    }

    /// Drops the digests of what a transaction wrote.
    fn forget_digests(&mut self, written: &Written) {
        if written.table {
            self.digests = TableDigest::default();
            return;
        }
        for chain in &written.chains {
            self.digests.chains.remove(chain);
        }
        for set in &written.sets {
            self.digests.sets.remove(set);
        }
    }

    /// The digests of every chain and set as written: those kept, and the rest computed
    /// (after a transaction wrote them).
    fn refresh_digests(&mut self) {
        let ruleset = self.rules.ruleset();
        let family = ruleset.family;
        let digests = &mut self.digests;
        digests
            .chains
            .retain(|name, _| ruleset.chains.contains_key(name));
        digests
            .sets
            .retain(|name, _| ruleset.sets.contains_key(name));
        for (name, chain) in &ruleset.chains {
            if !digests.chains.contains_key(name) {
                digests
                    .chains
                    .insert(name.clone(), ChainDigest::of(chain, family));
            }
        }
        for (name, set) in &ruleset.sets {
            if !digests.sets.contains_key(name) {
                digests
                    .sets
                    .insert(name.clone(), SetDigest::of(name, set, family));
            }
        }
    }

    /// Compares the kernel's table with what was written and queues the repair of what
    /// differs (what was written since the read began is left for the next one).
    fn repair(&mut self, kernel: &TableDigest, metrics: &Metrics) -> usize {
        if !self.in_sync || !self.pending.is_empty() {
            // The next apply replaces the table in full, or has yet to send what the
            // kernel is compared with.
            return 0;
        }
        self.refresh_digests();
        let since = &self.written_since_read;
        let found = TableDrift::between(&self.digests, kernel, |kind, name| {
            since.table
                || match kind {
                    ObjectKind::Chain => since.chains.contains(name),
                    ObjectKind::Set => since.sets.contains(name),
                }
        });
        if found.is_empty() {
            return 0;
        }
        let table = self.family().nft_table();
        if kernel.chains.is_empty() {
            tracing::warn!(%table, "our table is gone; writing it whole");
            count_repairs(metrics, RepairedObject::Table, 1);
            self.in_sync = false;
            return 1;
        }
        for (name, drift) in found.chains.iter().take(LOGGED_OBJECTS) {
            let (ours, theirs) = (
                self.digests.chains.get(name).map_or(0, |c| c.rules.len()),
                kernel.chains.get(name).map_or(0, |c| c.rules.len()),
            );
            tracing::warn!(%table, chain = %name, ?drift, rules_written = ours, rules_in_kernel = theirs, "chain differs from what was written; repairing it");
        }
        for (name, drift) in found.sets.iter().take(LOGGED_OBJECTS) {
            let (ours, theirs) = (
                self.digests.sets.get(name).map_or(0, |s| s.elements),
                kernel.sets.get(name).map_or(0, |s| s.elements),
            );
            tracing::warn!(%table, set = %name, ?drift, elements_written = ours, elements_in_kernel = theirs, "set differs from what was written; repairing it");
        }
        let (chains, sets) = (found.chains.len(), found.sets.len());
        if chains + sets > LOGGED_OBJECTS {
            tracing::warn!(
                %table,
                chains,
                sets,
                "more chains and sets differ than logged; repairing them all"
            );
        }
        count_repairs(metrics, RepairedObject::Chain, chains);
        count_repairs(metrics, RepairedObject::Set, sets);
        self.pending = Transaction::repair(self.rules.ruleset(), &found);
        chains + sets
    }
}

/// What an apply sends.
enum Outgoing {
    /// The whole table, encoded (or what kept it from being encoded).
    Table(Result<Batch, KernelError>),
    /// The operations queued since the last apply.
    Changes(Transaction),
}

impl Outgoing {
    fn send(self, kernel: &mut Netlink) -> Result<(), KernelError> {
        match self {
            Outgoing::Table(batch) => kernel.send_batch(&batch?),
            Outgoing::Changes(tx) => kernel.apply(&tx),
        }
    }
}

/// How the first whole-table write of a run went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Write {
    Applied,
    /// The kernel's table already matched: nothing was sent.
    Adopted,
}

/// Whether our table in the kernel (of the family `kernel` reads) holds exactly the chains
/// and sets of `expected`.
/// Replacing a table in one transaction is atomic for the rules, but a restart that
/// writes nothing cannot open a gap for any packet, and costs one read instead of a write.
fn kernel_holds(kernel: &mut Netlink, expected: &TableDigest) -> bool {
    match kernel.read_table(TABLE, true) {
        Ok(found) => TableDrift::between(expected, &found, |_, _| false).is_empty(),
        Err(error) => {
            tracing::warn!(%error, "reading our table before the first write failed; replacing it");
            false
        }
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
