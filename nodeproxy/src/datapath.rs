//! The two data paths the sync loop can program, behind one interface: the kube-proxy v1.21
//! iptables layout (the default) and the nftables table `ip tandem`. Each keeps its desired
//! rules current one changed Service port at a time, can be checked against a full rebuild,
//! and writes only what changed.

use std::collections::BTreeSet;
use std::time::Instant;

use tandem_common::ProxyMode;
use tandem_nftables::kernel::{KernelError, Netlink};
use tandem_nftables::{Fingerprint, Transaction};
use tandem_proxy_rules::incremental::IncrementalRuleset;
use tandem_proxy_rules::model::{NodeConfig, ProxyState, ServicePortName};
use tandem_proxy_rules::nft;
use tandem_proxy_rules::ruleset::{ChangedChains, Table};

use crate::backend::{self, BackendChoice};
use crate::iptables::{SyncError, Syncer};
use crate::metrics::{Metrics, TableLabel, TableLabels};

/// Opens the data path of `mode`, after removing the other mode's rules, as kube-proxy does
/// when it starts: two data paths answering for the same Service addresses would fight, and a
/// node switched between modes must keep no stale rules.
pub async fn start(
    mode: ProxyMode,
    backend_choice: BackendChoice,
    mut node: NodeConfig,
) -> Result<DataPath, StartError> {
    let (backend, reason) = backend::resolve(backend_choice).await;
    match mode {
        ProxyMode::Iptables => {
            tracing::info!(%backend, %reason, restore = backend.restore(), "iptables mode; backend chosen");
            // A kernel without nf_tables has no table of ours to remove either.
            if let Err(error) = remove_nftables_table().await {
                tracing::warn!(%error, "could not remove the nftables mode's table");
            }
            if node.localhost_node_ports
                && node.node_port_addresses.overlap_loopback()
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
            Ok(DataPath::iptables(node, Syncer::new(backend)))
        }
        ProxyMode::Nftables => {
            let kernel = tokio::task::spawn_blocking(Netlink::open)
                .await
                .map_err(|e| StartError::Task(e.to_string()))??;
            tracing::info!("nftables mode: table ip tandem, written through netlink");
            // A host without iptables has no iptables-mode rules to remove either.
            if let Err(error) = Syncer::new(backend).cleanup().await {
                tracing::warn!(%error, %backend, "could not remove iptables-mode rules");
            }
            Ok(DataPath::nftables(node, kernel))
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

/// `--cleanup`: everything either mode installs.
pub async fn cleanup(backend_choice: BackendChoice) -> Result<(), StartError> {
    let (backend, reason) = backend::resolve(backend_choice).await;
    tracing::info!(%backend, %reason, "removing all node proxy rules");
    Syncer::new(backend).cleanup().await?;
    remove_nftables_table().await
}

/// Deletes table `ip tandem` (no error when it is not there).
pub async fn remove_nftables_table() -> Result<(), StartError> {
    tokio::task::spawn_blocking(|| Netlink::open()?.apply(&Transaction::delete_all()))
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

pub struct IptablesPath {
    rules: IncrementalRuleset,
    syncer: Syncer,
    /// Chains changed since the last successful apply.
    changed: ChangedChains,
}

pub struct NftablesPath {
    rules: nft::incremental::IncrementalRuleset,
    /// `None` only while a transaction is in flight on the blocking pool.
    kernel: Option<Netlink>,
    /// Operations not applied yet, in order.
    pending: Transaction,
    /// False until a whole-table write succeeded, and again after any failed transaction:
    /// the next apply then replaces the table in full instead of sending `pending`.
    in_sync: bool,
}

impl DataPath {
    pub fn iptables(node: NodeConfig, syncer: Syncer) -> Self {
        DataPath::Iptables(IptablesPath {
            rules: IncrementalRuleset::new(node),
            syncer,
            changed: ChangedChains::default(),
        })
    }

    pub fn nftables(node: NodeConfig, kernel: Netlink) -> Self {
        DataPath::Nftables(NftablesPath {
            rules: nft::incremental::IncrementalRuleset::new(node),
            kernel: Some(kernel),
            pending: Transaction::default(),
            in_sync: false,
        })
    }

    /// Rebuilds the given Service ports from `state`; returns how many chains (iptables) or
    /// operations (nftables) the change needs, or, for an nftables table that the next
    /// apply writes whole, how many ports were rebuilt.
    pub fn update(&mut self, state: &ProxyState, ports: &BTreeSet<ServicePortName>) -> usize {
        match self {
            DataPath::Iptables(path) => {
                let changed = path.rules.update(state, ports);
                let count = changed.count();
                path.changed.merge(changed);
                count
            }
            DataPath::Nftables(path) if !path.in_sync => {
                path.rules.update_without_transaction(state, ports);
                ports.len()
            }
            DataPath::Nftables(path) => {
                let tx = path.rules.update(state, ports);
                let count = tx.ops.len();
                path.pending.ops.extend(tx.ops);
                count
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

    /// Periodic checks of the kernel state: the iptables canary chains (a flush by someone
    /// else makes the next sync rewrite everything, as kube-proxy does).
    pub async fn housekeeping(&mut self) {
        if let DataPath::Iptables(path) = self
            && let Err(error) = path.syncer.canaries_present().await
        {
            tracing::warn!(%error, "checking canary chains");
        }
    }

    /// Sets the chain and rule gauges from the desired ruleset (they count everything, so
    /// callers run this only when something changed).
    pub fn record_size(&self, metrics: &Metrics) {
        match self {
            DataPath::Iptables(path) => {
                let ruleset = path.rules.ruleset();
                for table in Table::ALL {
                    let labels = TableLabels {
                        table: table.into(),
                    };
                    let rules = ruleset.table(table);
                    metrics
                        .chains
                        .get_or_create(&labels)
                        .set(rules.chains.len() as i64);
                    metrics
                        .rules
                        .get_or_create(&labels)
                        .set(rules.chains.values().map(Vec::len).sum::<usize>() as i64);
                }
            }
            DataPath::Nftables(path) => {
                let ruleset = path.rules.ruleset();
                metrics.nftables_chains.set(ruleset.chains.len() as i64);
                metrics.nftables_rules.set(ruleset.rule_count() as i64);
                metrics
                    .nftables_elements
                    .set(ruleset.element_count() as i64);
            }
        }
    }

    /// Writes what changed since the last successful apply. Returns false when the kernel
    /// refused it; the next apply then rewrites in full.
    pub async fn apply(&mut self, metrics: &Metrics) -> bool {
        match self {
            DataPath::Iptables(path) => path.apply(metrics).await,
            DataPath::Nftables(path) => path.apply(metrics).await,
        }
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
}

impl NftablesPath {
    async fn apply(&mut self, metrics: &Metrics) -> bool {
        let full = !self.in_sync;
        let tx = if full {
            self.pending.ops.clear();
            Transaction::replace_all(self.rules.ruleset())
        } else {
            std::mem::take(&mut self.pending)
        };
        if tx.is_empty() {
            return true;
        }
        let Some(mut kernel) = self.kernel.take() else {
            tracing::error!("the netlink socket was lost; reopening");
            return self.reopen();
        };
        let ops = tx.ops.len();
        let started = Instant::now();
        let (kernel, result) = match tokio::task::spawn_blocking(move || {
            let result = kernel.apply(&tx);
            (kernel, result)
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
        match result {
            Ok(()) => {
                self.in_sync = true;
                tracing::info!(
                    full,
                    ops,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "nftables transaction applied"
                );
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
        match Netlink::open() {
            Ok(kernel) => self.kernel = Some(kernel),
            Err(error) => tracing::error!(%error, "opening a netlink socket"),
        }
        self.in_sync = false;
        false
    }
}
