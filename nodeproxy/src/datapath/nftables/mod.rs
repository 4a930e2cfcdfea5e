//! The nftables mode: one table of our own (`ip tandem`, `ip6 tandem`), written through
//! netlink in transactions. Its parts are the iptables mode's: the state (this module: the
//! desired table of [`NftablesPath`], kept current one Service port at a time, and the
//! operations queued for the kernel), the executor (the transactions, or the whole table
//! when the kernel's is not known to match) and the read-back (the kernel's table,
//! compared by digest with what was written, and the repairs).

mod executor;
mod readback;

use std::collections::BTreeSet;

use ipnet::IpNet;
use tandem_common::IpFamily;
use tandem_nftables::digest::TableDigest;
use tandem_nftables::kernel::Netlink;
use tandem_nftables::{Fingerprint, Transaction, Written};
use tandem_proxy_rules::model::{NodeConfig, ProxyState, ServicePortName};
use tandem_proxy_rules::nft;

use super::iptables::backend::Backend;
use super::{DataPathSize, RulesChanged};

/// The nftables data path of one IP family.
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

impl NftablesPath {
    /// `backend`: where the iptables mode's rules would be, to remove them.
    pub fn new(node: NodeConfig, kernel: Netlink, backend: Backend) -> Self {
        let family = node.family;
        Self {
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
        }
    }

    fn family(&self) -> IpFamily {
        self.rules.ruleset().family
    }

    /// See [`super::DataPath::set_zone`].
    pub fn set_zone(&mut self, zone: Option<String>) {
        self.rules.set_zone(zone);
    }

    /// Rewrites the `cluster-ips-check` chain alone for the node's Service CIDRs of this
    /// family (queued for the next apply, or in the whole table that apply writes).
    pub fn set_service_cidrs(&mut self, cidrs: Vec<IpNet>) -> RulesChanged {
        let tx = self.rules.set_service_cidrs(cidrs);
        let operations = tx.ops.len();
        if self.in_sync {
            self.pending.ops.extend(tx.ops);
        }
        RulesChanged {
            operations,
            ..RulesChanged::default()
        }
    }

    /// Rebuilds the given Service ports from `state`; returns the operations the change
    /// queued, or, while the next apply writes the whole table, the ports rebuilt.
    pub fn update(
        &mut self,
        state: &ProxyState,
        ports: &BTreeSet<ServicePortName>,
    ) -> RulesChanged {
        if !self.in_sync {
            self.rules.update_without_transaction(state, ports);
            return RulesChanged {
                ports_rebuilt: ports.len(),
                ..RulesChanged::default()
            };
        }
        let tx = self.rules.update(state, ports);
        let operations = tx.ops.len();
        self.pending.ops.extend(tx.ops);
        RulesChanged {
            operations,
            ..RulesChanged::default()
        }
    }

    /// See [`super::DataPath::check_against_full_rebuild`]; on a divergence the next apply
    /// replaces the table.
    pub fn check_against_full_rebuild(&mut self, state: &ProxyState) -> Option<usize> {
        // Rebuilt in place and compared by fingerprint: a second whole ruleset beside the
        // first made this check the node proxy's peak memory (195 against 179 MiB at
        // 10,000 Services).
        let before = Fingerprint::of(self.rules.ruleset());
        self.rules.rebuild(state);
        let after = Fingerprint::of(self.rules.ruleset());
        let differing = before.differing(&after);
        if differing.is_empty() {
            return None;
        }
        tracing::error!(
            objects = differing.len(),
            first = ?differing.iter().take(5).collect::<Vec<_>>(),
            "the incremental nftables ruleset differs from a full rebuild; replacing the table"
        );
        self.in_sync = false;
        Some(differing.len())
    }

    /// Chains, rules and set elements.
    pub fn size(&self) -> DataPathSize {
        let ruleset = self.rules.ruleset();
        DataPathSize {
            nftables: Some((
                ruleset.chains.len(),
                ruleset.rule_count(),
                ruleset.element_count(),
            )),
            ..DataPathSize::default()
        }
    }
}
