//! The read-back of the nftables mode: our table as the kernel holds it, compared by
//! digest with what was written, and the repair transaction it queues.

use std::time::Instant;

use tandem_nftables::digest::{ChainDigest, ObjectKind, SetDigest, TableDigest};
use tandem_nftables::{NftFamily, TABLE, TableDrift, Transaction, Written};
use tokio::task::JoinHandle;

use super::NftablesPath;
use crate::datapath::{KernelRead, LOGGED_OBJECTS, ReadBack, count_repairs, open_netlink};
use crate::metrics::{Metrics, RepairedObject};

impl NftablesPath {
    /// Starts reading our whole table back on the blocking pool, beside the sync loop;
    /// what is written meanwhile is left out of the comparison.
    pub fn start_read_back(&mut self) -> JoinHandle<ReadBack> {
        let started = Instant::now();
        self.written_since_read = Written::default();
        let family = self.family();
        tokio::task::spawn_blocking(move || {
            let read = open_netlink(family).and_then(|mut kernel| kernel.read_table(TABLE, true));
            ReadBack {
                kernel: KernelRead::Nftables(read),
                elapsed: started.elapsed(),
            }
        })
    }

    /// Drops the digests of what a transaction wrote.
    pub(super) fn forget_digests(&mut self, written: &Written) {
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
    pub(super) fn refresh_digests(&mut self) {
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
    pub fn repair(&mut self, kernel: &TableDigest, metrics: &Metrics) -> usize {
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
