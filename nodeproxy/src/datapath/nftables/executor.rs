//! The executor of the nftables mode: the queued operations in one transaction, or the
//! whole table in one when the kernel's is not known to match (the first write of a run
//! adopts a table that already holds exactly these rules).

use std::time::Instant;

use tandem_common::IpFamily;
use tandem_nftables::digest::TableDigest;
use tandem_nftables::encode::Batch;
use tandem_nftables::kernel::{KernelError, Netlink};
use tandem_nftables::{NftFamily, TABLE, TableDrift, Transaction, Written};

use super::NftablesPath;
use crate::datapath::iptables::Syncer;
use crate::datapath::iptables::backend::Tools;
use crate::datapath::open_netlink;
use crate::metrics::Metrics;

impl NftablesPath {
    /// See [`crate::datapath::DataPath::apply`].
    pub async fn apply(&mut self, metrics: &Metrics) -> bool {
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
        if full && std::mem::take(&mut self.adopt_kernel_table) {
            // The first whole-table write of a run: a table an earlier run left that
            // already holds exactly these rules is kept, so a restart encodes and writes
            // nothing. The digests go to the blocking task and come back with the kernel.
            self.refresh_digests();
            let expected = std::mem::take(&mut self.digests);
            let checked = tokio::task::spawn_blocking(move || {
                let holds = kernel_holds(&mut kernel, &expected);
                (kernel, holds, expected)
            })
            .await;
            let (returned, holds, expected) = match checked {
                Ok(done) => done,
                Err(error) => {
                    tracing::error!(%error, "the nftables table check task failed");
                    return self.reopen();
                }
            };
            kernel = returned;
            self.digests = expected;
            if holds {
                self.kernel = Some(kernel);
                self.in_sync = true;
                tracing::info!(
                    table = %family.nft_table(),
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "the table already holds these rules; kept as it is"
                );
                self.remove_iptables_rules().await;
                return true;
            }
        }
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
        let sent = tokio::task::spawn_blocking(move || {
            let result = outgoing.send(&mut kernel);
            (kernel, result)
        })
        .await;
        let (kernel, result) = match sent {
            Ok(done) => done,
            Err(error) => {
                tracing::error!(%error, "the nftables transaction task failed");
                self.in_sync = false;
                return self.reopen();
            }
        };
        self.kernel = Some(kernel);
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
            Ok(()) => {
                self.in_sync = true;
                tracing::info!(
                    table = %family.nft_table(),
                    full,
                    ops,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "nftables transaction applied"
                );
                self.forget_digests(&written);
                self.written_since_read.merge(written);
                self.remove_iptables_rules().await;
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

    /// After the first successful apply: the iptables mode's rules, of both families
    /// (this mode serves neither in iptables), if a node switched modes.
    async fn remove_iptables_rules(&mut self) {
        let Some(backend) = self.remove_iptables.take() else {
            return;
        };
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

    fn reopen(&mut self) -> bool {
        match open_netlink(self.family()) {
            Ok(kernel) => self.kernel = Some(kernel),
            Err(error) => tracing::error!(%error, "opening a netlink socket"),
        }
        self.in_sync = false;
        false
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
