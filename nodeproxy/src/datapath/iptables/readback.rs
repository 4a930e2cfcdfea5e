//! The read-back of the iptables mode: what the kernel holds of our tables, compared with
//! what was written, and the repairs it schedules for the next restore.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use tandem_common::IpFamily;
use tandem_nftables::kernel::Netlink;
use tandem_proxy_rules::ruleset::{Ruleset, Table, TableRules};
use tokio::task::JoinHandle;

use super::backend::{Backend, Tools};
use super::command::{LOCK_WAIT_SECONDS, SyncError, blocking, run};
use super::drift::{self, TableDrift, TableReadBack};
use super::restore::{self, CANARY_CHAIN, TableInspection};
use super::{IptablesPath, KnownTable, Syncer};
use crate::datapath::{KernelRead, LOGGED_OBJECTS, ReadBack, count_repairs};
use crate::metrics::{Metrics, RepairedObject};

/// What a read-back found in one table, and how it is repaired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableRepair {
    pub table: Table,
    pub drift: TableDrift,
    /// The table is written in full.
    pub whole: bool,
    /// The first few rules each of the first few drifted chains lacks, for the log.
    pub missing_rules: BTreeMap<String, Vec<String>>,
}

/// Drifted chains and rules per chain whose text goes into the log.
const LOGGED_CHAINS: usize = 10;
const LOGGED_RULES: usize = 3;

/// Above this share of a table's chains drifted, the table is written in full: someone
/// flushed it, and a full write can replace it in one flush-mode restore.
const FULL_WRITE_DRIFT_DIVISOR: usize = 2;

impl Syncer {
    /// A read-back of the kernel begins: from now on, what is written is left out of its
    /// comparison. Returns the programs to read with.
    pub fn begin_read(&mut self) -> Tools {
        self.written_since_read.clear();
        self.rewritten_since_read.clear();
        self.tools
    }

    /// Compares a finished read-back with what was written and schedules the repairs:
    /// drifted chains are forgotten (so the next sync writes them), unexpected ones are
    /// deleted by it, missing base jumps and shared rules go into its restore; a table
    /// without its canary, or with most of its chains drifted, is written in full.
    /// Returns what was found per table; the caller adds the chains to the next sync.
    pub fn take_read_back(
        &mut self,
        read: IptablesReadBack,
        desired: &Ruleset,
    ) -> Vec<TableRepair> {
        let mut found = Vec::new();
        for (table, read_table) in read.tables {
            if self.rewritten_since_read.contains(&table) {
                continue;
            }
            // Not every chain's rules were read: the others are not compared.
            let unread = |chain: &str| {
                read.only.as_ref().is_some_and(|only| {
                    !only
                        .get(&table)
                        .is_some_and(|chains| chains.contains(chain))
                })
            };
            let Some(known) = self.tables.get_mut(&table) else {
                // Unknown, so written in full next anyway.
                continue;
            };
            let KnownTable {
                applied,
                written,
                ensure,
                baseline_pending,
            } = known;
            let none = BTreeSet::new();
            let since = self.written_since_read.get(&table).unwrap_or(&none);
            if std::mem::take(baseline_pending) {
                // Read right after the full write: what the kernel made of our chains.
                for (chain, rules) in &read_table.chains {
                    if applied.chains.contains_key(chain) && !since.contains(chain) {
                        written.insert(chain.clone(), rules.clone());
                    }
                }
            }
            let mut drift =
                TableDrift::between(table, written, desired.table(table), &read_table, |chain| {
                    since.contains(chain) || unread(chain)
                });
            // The mangle canary goes in with the filter table's full write.
            drift.canary_missing |= table == Table::Filter && !read.mangle_canary;
            if drift.is_empty() {
                continue;
            }
            let drifted = drift.chains.len() + drift.unexpected.len();
            let whole = drift.canary_missing || drifted > written.len() / FULL_WRITE_DRIFT_DIVISOR;
            let missing_rules = drift
                .chains
                .iter()
                .take(LOGGED_CHAINS)
                .map(|(chain, chain_drift)| {
                    let rules = applied.chains.get(chain).map_or(&[][..], Vec::as_slice);
                    let texts = chain_drift
                        .missing
                        .iter()
                        .take(LOGGED_RULES)
                        .filter_map(|position| rules.get(*position).cloned())
                        .collect();
                    (chain.clone(), texts)
                })
                .collect();
            if whole {
                self.forget_table(table);
            } else {
                for chain in drift.chains.keys() {
                    applied.chains.remove(chain);
                }
                for chain in &drift.unexpected {
                    // Held as written, so the next sync deletes it.
                    applied.chains.insert(chain.clone(), Vec::new());
                }
                ensure.extend(drift.ensure_lines());
            }
            found.push(TableRepair {
                table,
                drift,
                whole,
                missing_rules,
            });
        }
        found
    }

    /// Keeps the digests of what a write left in `chains` (all of the table's after a
    /// full write, which starts from none), for the read-back: of the text on the legacy
    /// backend, of what the kernel holds on nf_tables, read right away (after a full
    /// write, by the read-back that follows at once). A chain that cannot be read is not
    /// compared until it is written again.
    pub(super) async fn record(
        &mut self,
        table: Table,
        full: bool,
        chains: &BTreeSet<String>,
        wanted: &TableRules,
    ) {
        let name = table.as_str();
        if full {
            self.rewritten_since_read.insert(table);
        }
        self.written_since_read
            .entry(table)
            .or_default()
            .extend(chains.iter().cloned());
        let Some(known) = self.tables.get_mut(&table) else {
            return;
        };
        let written = &mut known.written;
        let compared = chains
            .iter()
            .filter(|chain| drift::is_compared_chain(name, chain));
        let mut present = Vec::new();
        for chain in compared {
            match wanted.chains.get(chain) {
                Some(rules) => present.push((chain, rules)),
                None => {
                    written.remove(chain);
                }
            }
        }
        match self.tools.backend {
            Backend::Legacy => written.extend(drift::chain_digests(present)),
            Backend::Nft if full => {
                known.baseline_pending = true;
            }
            Backend::Nft => {
                let names: Vec<String> = present.into_iter().map(|(c, _)| c.clone()).collect();
                match read_rules(self.tools.family, name, names.clone()).await {
                    Ok(read) => written.extend(read),
                    Err(error) => {
                        tracing::warn!(%error, table = name, "reading back the chains just written; they are not checked for drift until written again");
                        for chain in &names {
                            written.remove(chain);
                        }
                    }
                }
            }
        }
    }
}

/// What a read-back found in the tables we write.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IptablesReadBack {
    pub tables: BTreeMap<Table, TableReadBack>,
    /// Whether the mangle table still holds our canary.
    pub mangle_canary: bool,
    /// The chains whose rules were read, when not all were: the others are not compared.
    pub only: Option<ChainScope>,
}

/// Chains per table.
pub type ChainScope = BTreeMap<Table, BTreeSet<String>>;

/// Reads back the nat and filter tables (and the mangle canary), beside the sync loop.
///
/// On legacy `iptables-save -t TABLE` is cheap (0.4 s at 2,700 Services, 1.4 s at 10,000)
/// and prints exactly our text. On nf_tables it is not (10 s at 2,700 Services, over 100 s
/// at 10,000, as it decodes every rule into text), so there the chain names and each of
/// our chains' rules are read over netlink, one small dump per chain, and compared with
/// the nf_tables form recorded right after each write; only the built-in and shared
/// chains, where our rules sit among others', are listed as text (`iptables -S CHAIN`).
///
/// With `only` (nf_tables only: a legacy save is one read anyway), the rules of those
/// chains alone are read, in their tables alone, and of the built-in and shared chains
/// only those named are listed: someone else's change the kernel announced, found in a few
/// small dumps instead of one per chain of ours (3 s at 10,000 Services).
pub async fn read_back(
    tools: Tools,
    only: Option<ChainScope>,
) -> Result<IptablesReadBack, SyncError> {
    let only = only.filter(|_| tools.backend == Backend::Nft);
    let mut read = IptablesReadBack {
        only: only.clone(),
        ..IptablesReadBack::default()
    };
    if tools.backend == Backend::Legacy {
        for table in Table::ALL {
            let name = table.as_str();
            let save = run(tools.save(), &["-t", name], None).await?;
            let table_read = blocking(move || Ok(TableReadBack::from_save(&save, name))).await?;
            read.tables.insert(table, table_read);
        }
        read.mangle_canary =
            restore::parse_save(&run(tools.save(), &["-t", "mangle"], None).await?, "mangle")
                .user_chains
                .contains(CANARY_CHAIN);
        return Ok(read);
    }
    // Every table's chain names in one dump (the kernel lists them all at once).
    let mut names = all_chain_names(tools.family).await?;
    read.mangle_canary = names
        .get("mangle")
        .is_some_and(|chains| chains.contains(CANARY_CHAIN));
    for table in Table::ALL {
        let name = table.as_str();
        // Scoped to what was announced: the other tables are not read at all.
        let scope = match &only {
            None => None,
            Some(only) => match only.get(&table) {
                Some(chains) => Some(chains),
                None => continue,
            },
        };
        let in_scope = |chain: &str| scope.is_none_or(|chains| chains.contains(chain));
        let chains = names.remove(name).unwrap_or_default();
        let inspection = inspect_chains(tools, name, &chains, in_scope).await?;
        let compared: Vec<String> = chains
            .into_iter()
            .filter(|chain| drift::is_compared_chain(name, chain) && in_scope(chain))
            .collect();
        let table_read = TableReadBack {
            inspection,
            chains: read_rules(tools.family, name, compared).await?,
        };
        read.tables.insert(table, table_read);
    }
    Ok(read)
}

/// What is in a table, only for full writes and cleanup (never on the hot path).
///
/// `iptables-nft-save` of a big table is slow (10-30 s at 2,700 Services, it decodes
/// every rule), so on nf_tables the chain names come over netlink (no rules) and the rules
/// of the built-in and shared chains from `iptables-nft -S CHAIN` (~15 ms each: it fetches
/// only that chain). On legacy (where the save is ~1 s), `iptables-save -t TABLE` is used.
pub(super) async fn inspect(
    tools: Tools,
    table: &'static str,
) -> Result<TableInspection, SyncError> {
    match tools.backend {
        Backend::Nft => {
            let chains = all_chain_names(tools.family)
                .await?
                .remove(table)
                .unwrap_or_default();
            inspect_chains(tools, table, &chains, |_| true).await
        }
        Backend::Legacy => {
            let output = run(tools.save(), &["-t", table], None).await?;
            Ok(restore::parse_save(&output, table))
        }
    }
}

/// The inspection of an nf_tables table of which `chains` are all the chains; of its
/// built-in and shared chains, those `listed` says (each costs an `iptables -S` process).
async fn inspect_chains(
    tools: Tools,
    table: &str,
    chains: &BTreeSet<String>,
    listed: impl Fn(&str) -> bool,
) -> Result<TableInspection, SyncError> {
    let mut save = format!("*{table}\n");
    let listed = chains.iter().filter(|c| {
        (restore::builtin_chains(table).contains(&c.as_str())
            || restore::is_shared_chain(table, c)
            || (table == "filter" && c.as_str() == restore::KUBELET_FIREWALL_CHAIN))
            && listed(c)
    });
    for chain in listed {
        let rules = run(
            tools.iptables(),
            &["-w", LOCK_WAIT_SECONDS, "-t", table, "-S", chain],
            None,
        )
        .await?;
        save.push_str(&restore::chain_listing_as_save(&rules));
    }
    for chain in chains
        .iter()
        .filter(|c| !restore::builtin_chains(table).contains(&c.as_str()))
    {
        save.push_str(&format!(":{chain} - [0:0]\n"));
    }
    Ok(restore::parse_save(&save, table))
}

/// The chain names of the nf_tables tables iptables-nft keeps our rules and the canary in
/// (each iptables table is the nftables table of the same name in family `ip`, each
/// ip6tables table in family `ip6`), from one dump.
async fn all_chain_names(
    family: IpFamily,
) -> Result<BTreeMap<String, BTreeSet<String>>, SyncError> {
    blocking(move || {
        let tables: Vec<&str> = Table::ALL
            .iter()
            .map(|table| table.as_str())
            .chain(["mangle"])
            .collect();
        Netlink::open()
            .and_then(|netlink| netlink.reading(family).read_chain_names(&tables))
            .map_err(|source| SyncError::Netlink {
                table: "nat, filter and mangle",
                source,
            })
    })
    .await
}

/// The digests of the rules of `chains` in an nf_tables table, as the kernel holds them.
async fn read_rules(
    family: IpFamily,
    table: &'static str,
    chains: Vec<String>,
) -> Result<BTreeMap<String, Vec<u64>>, SyncError> {
    if chains.is_empty() {
        return Ok(BTreeMap::new());
    }
    blocking(move || {
        let mut netlink = Netlink::open()
            .map(|netlink| netlink.reading(family))
            .map_err(|source| SyncError::Netlink { table, source })?;
        let read = netlink
            .read_rules(table, chains.iter().map(String::as_str))
            .map_err(|source| SyncError::Netlink { table, source })?;
        Ok(read
            .into_iter()
            .map(|(chain, rules)| (chain.to_owned(), rules))
            .collect())
    })
    .await
}

impl IptablesPath {
    /// Starts reading back the kernel's tables beside the sync loop (see [`read_back`]).
    pub fn start_read_back(&mut self, only: Option<ChainScope>) -> JoinHandle<ReadBack> {
        let started = Instant::now();
        let tools = self.syncer.begin_read();
        tokio::spawn(async move {
            let kernel = KernelRead::Iptables(read_back(tools, only).await);
            ReadBack {
                kernel,
                elapsed: started.elapsed(),
            }
        })
    }

    /// Schedules the repair of what the read-back found (see [`Syncer::take_read_back`]),
    /// and logs and counts it.
    pub fn repair(&mut self, kernel: IptablesReadBack, metrics: &Metrics) -> usize {
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
