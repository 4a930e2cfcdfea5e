//! The iptables mode: kube-proxy v1.21's chains, written with one `iptables-restore` per
//! changed table. Its parts are the nftables mode's: the state (this module: the desired
//! rules of [`IptablesPath`], kept current one Service port at a time, and what
//! [`Syncer`] knows the kernel holds, all of it from its own writes), the executor (the
//! restores that bring the kernel to the desired rules) and the read-back (what the
//! kernel holds, compared with what was written, and the repairs). Beside them, pure:
//! [`backend`] detection, the [`restore`] payloads and the [`drift`] a read-back finds.
//!
//! What it applied is forgotten (and the next sync of that table is a full write, see
//! [`restore::full`]) at start-up, after a restore failure and when the read-back
//! ([`read_back`]) finds a canary chain gone or most of our chains changed, i.e. someone
//! flushed or deleted our chains. Smaller drift is repaired chain by chain
//! ([`Syncer::take_read_back`]) by the next sync's restore.

pub mod backend;
mod command;
pub mod drift;
mod executor;
mod readback;
pub mod restore;

use std::collections::{BTreeMap, BTreeSet};

use tandem_proxy_rules::incremental::IncrementalRuleset;
use tandem_proxy_rules::model::{NodeConfig, ProxyState, ServicePortName};
use tandem_proxy_rules::ruleset::{ChangedChains, Table, TableRules};

pub use command::SyncError;
pub use executor::{TableSync, base_jump_deletion, split_rule};
pub use readback::{ChainScope, IptablesReadBack, TableRepair, read_back};

use self::backend::{Backend, Tools};
use super::{DataPathSize, RulesChanged};

/// The iptables data path of one IP family.
pub struct IptablesPath {
    rules: IncrementalRuleset,
    syncer: Syncer,
    /// Chains changed since the last successful apply.
    changed: ChangedChains,
    /// The nftables mode's table of this family may be there: removed after the first
    /// successful apply.
    remove_nftables_table: bool,
}

impl IptablesPath {
    pub fn new(node: NodeConfig, syncer: Syncer) -> Self {
        Self {
            rules: IncrementalRuleset::new(node),
            syncer,
            changed: ChangedChains::default(),
            remove_nftables_table: true,
        }
    }

    /// The backend it writes with.
    pub fn backend(&self) -> Backend {
        self.syncer.backend()
    }

    /// See [`super::DataPath::wants_read_back`].
    pub fn wants_read_back(&self) -> bool {
        self.syncer.wants_read_back()
    }

    /// See [`super::DataPath::set_zone`].
    pub fn set_zone(&mut self, zone: Option<String>) {
        self.rules.set_zone(zone);
    }

    /// Rebuilds the given Service ports from `state`; returns the chains the change
    /// needs, written by the next apply.
    pub fn update(
        &mut self,
        state: &ProxyState,
        ports: &BTreeSet<ServicePortName>,
    ) -> RulesChanged {
        let changed = self.rules.update(state, ports);
        let chains = changed.count();
        self.changed.merge(changed);
        RulesChanged {
            chains,
            ..RulesChanged::default()
        }
    }

    /// See [`super::DataPath::check_against_full_rebuild`].
    pub fn check_against_full_rebuild(
        &mut self,
        node: &NodeConfig,
        state: &ProxyState,
    ) -> Option<usize> {
        // Built port by port from nothing, so on a divergence it can take over as is;
        // from scratch it equals `tandem_proxy_rules::build` (tested in the rules crate).
        let mut rebuilt = IncrementalRuleset::new(node.clone());
        rebuilt.update(state, state.services().keys());
        if rebuilt.ruleset() == self.rules.ruleset() {
            return None;
        }
        let differing = ChangedChains::between(self.rules.ruleset(), rebuilt.ruleset());
        let count = differing.count();
        tracing::error!(
            chains = count,
            first = ?differing.nat.iter().chain(&differing.filter).take(5).collect::<Vec<_>>(),
            "the incremental ruleset differs from a full rebuild; using the full rebuild"
        );
        self.rules = rebuilt;
        self.changed.merge(differing);
        Some(count)
    }

    /// Chains and rules per table.
    pub fn size(&self) -> DataPathSize {
        let ruleset = self.rules.ruleset();
        let mut size = DataPathSize::default();
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
        size
    }
}

/// Applies rulesets; owns the memory of what is in the kernel.
#[derive(Debug)]
pub struct Syncer {
    /// The backend's programs for the family this syncer writes.
    tools: Tools,
    /// What it knows of each table in the kernel; a table it does not know (never
    /// written, or forgotten) is written in full by the next sync.
    tables: BTreeMap<Table, KnownTable>,
    /// Chains written since the read-back in flight began, and tables written in full
    /// since: that read may predate them. About the read, not the tables: forgetting a
    /// table keeps them (its read-back is skipped while it is unknown, and its full
    /// write marks it again).
    written_since_read: BTreeMap<Table, BTreeSet<String>>,
    rewritten_since_read: BTreeSet<Table>,
}

/// What a [`Syncer`] knows of one table in the kernel, all of it from its writes: what
/// it forgets of a table, it forgets together.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct KnownTable {
    /// What is in the kernel.
    applied: TableRules,
    /// A digest per rule of each of our chains as last written (see [`drift`]): what the
    /// read-back compares the kernel with.
    written: BTreeMap<String, Vec<u64>>,
    /// Repair lines (base jumps, shared chains) for the next write.
    ensure: Vec<String>,
    /// nf_tables: written in full, so the next read-back takes its digests as they are,
    /// instead of comparing (reading every chain right after the write would hold up the
    /// sync loop: 0.6 s at 2,700 Services, 2.4 s at 10,000).
    baseline_pending: bool,
}

impl Syncer {
    /// A syncer that knows nothing about the kernel yet: its first sync is a full write.
    pub fn new(tools: impl Into<Tools>) -> Self {
        Self {
            tools: tools.into(),
            tables: BTreeMap::new(),
            written_since_read: BTreeMap::new(),
            rewritten_since_read: BTreeSet::new(),
        }
    }

    /// Forget what is applied: the next sync writes every table in full.
    pub fn forget(&mut self) {
        self.tables.clear();
    }

    /// Forget one table: its next sync writes it in full.
    fn forget_table(&mut self, table: Table) {
        self.tables.remove(&table);
    }

    /// The backend it writes with.
    pub fn backend(&self) -> Backend {
        self.tools.backend
    }

    /// A table was written in full on nf_tables: a read-back should take its digests
    /// now, rather than a sync period later.
    pub fn wants_read_back(&self) -> bool {
        self.tables.values().any(|known| known.baseline_pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_common::IpFamily;

    /// A syncer that knows both tables, each written in full on nf_tables with its
    /// digests still to be taken, a chain drifted since and a repair line pending.
    fn knowing_every_table() -> Syncer {
        let mut syncer = Syncer::new(Tools::new(Backend::Nft, IpFamily::V4));
        for table in Table::ALL {
            syncer.tables.insert(
                table,
                KnownTable {
                    applied: TableRules {
                        chains: [("KUBE-SERVICES".to_owned(), vec!["-j RETURN".to_owned()])].into(),
                    },
                    written: [("KUBE-SERVICES".to_owned(), vec![1])].into(),
                    ensure: vec!["-A KUBE-SERVICES -j RETURN".to_owned()],
                    baseline_pending: true,
                },
            );
        }
        assert!(syncer.wants_read_back());
        syncer
    }

    #[test]
    fn forgetting_every_table_forgets_what_forgetting_each_one_does() {
        let mut all = knowing_every_table();
        all.forget();
        let mut each = knowing_every_table();
        for table in Table::ALL {
            each.forget_table(table);
        }
        for (how, syncer) in [("forget", &all), ("forget_table", &each)] {
            // Unknown, so the next sync writes every table in full.
            assert!(syncer.tables.is_empty(), "{how}: {:?}", syncer.tables);
            // No read-back is due for the digests of a write it no longer knows of.
            assert!(!syncer.wants_read_back(), "{how}");
        }
    }

    #[test]
    fn forgetting_one_table_keeps_the_other() {
        let mut syncer = knowing_every_table();
        let kept = syncer.tables[&Table::Nat].clone();
        syncer.forget_table(Table::Filter);
        assert_eq!(syncer.tables.keys().collect::<Vec<_>>(), [&Table::Nat]);
        assert_eq!(syncer.tables[&Table::Nat], kept);
        assert!(syncer.wants_read_back());
    }
}
