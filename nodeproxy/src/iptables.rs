//! The executor: applies a desired [`Ruleset`] to the kernel with one `iptables-restore` per
//! changed table, remembering what it applied so the next sync writes only what changed.
//!
//! What it applied is forgotten (and the next sync of that table is a full write, see
//! [`restore::full`]) at start-up, after a restore failure and when the periodic read-back
//! ([`read_back`]) finds a canary chain gone or most of our chains changed, i.e. someone
//! flushed or deleted our chains. Smaller drift is repaired chain by chain
//! ([`Syncer::take_read_back`]) by the next sync's restore.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tandem_common::IpFamily;
use tandem_nftables::kernel::{KernelError, Netlink};
use tandem_proxy_rules::ruleset::{BASE_JUMPS, ChangedChains, Ruleset, Table, TableRules};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use crate::backend::{Backend, Tools};
use crate::drift::{self, TableDrift, TableReadBack};
use crate::restore::{self, CANARY_CHAIN, Payload, RestoreMode, TableInspection};

/// Seconds `iptables*` wait for the xtables lock (legacy) before failing.
const LOCK_WAIT_SECONDS: &str = "5";
/// Payload lines logged on each side of the line a failing restore names.
const CONTEXT_RADIUS: usize = 3;
/// Tables that get a canary chain.
const CANARY_TABLES: [&str; 3] = ["mangle", "nat", "filter"];

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: &'static str,
        source: std::io::Error,
    },
    #[error("{program} for table {table} failed ({status}): {stderr}{}", context.as_deref().map(|c| format!("\n{c}")).unwrap_or_default())]
    Restore {
        program: &'static str,
        table: String,
        status: std::process::ExitStatus,
        stderr: String,
        /// Payload lines around the line the error names.
        context: Option<String>,
    },
    #[error("{program} {args} failed ({status}): {stderr}")]
    Command {
        program: &'static str,
        args: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("reading table {table} over netlink: {source}")]
    Netlink {
        table: &'static str,
        source: KernelError,
    },
    #[error("a blocking task failed: {0}")]
    Task(String),
}

/// What one table's restore did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSync {
    pub table: Table,
    pub mode: RestoreMode,
    /// True for a full write (state was unknown), false for an incremental one.
    pub full: bool,
    pub written_chains: usize,
    pub deleted_chains: usize,
    pub rules: usize,
    /// From computing the payload to the restore (and any base-jump fix) done.
    pub elapsed: Duration,
    /// The `iptables-restore` process alone, spawn to exit.
    pub restore: Duration,
    /// The exact payload, kept for tests and debug logs.
    pub payload: String,
    /// The chains it wrote or deleted.
    pub chains: BTreeSet<String>,
}

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

    /// Bring the kernel to `desired`, comparing every chain with what was applied.
    pub async fn sync(&mut self, desired: &Ruleset) -> Result<Vec<TableSync>, SyncError> {
        let mut changed = ChangedChains::default();
        for (table, known) in &self.tables {
            let (applied, wanted) = (&known.applied.chains, &desired.table(*table).chains);
            changed.table_mut(*table).extend(
                applied
                    .keys()
                    .chain(wanted.keys())
                    .filter(|chain| applied.get(*chain) != wanted.get(*chain))
                    .cloned(),
            );
        }
        self.sync_changed(desired, &changed).await
    }

    /// Bring the kernel to `desired`, where only the `changed` chains can differ from what
    /// was applied: the cost follows the change, not the ruleset. Tables whose state is
    /// unknown are written in full. Tables whose restore fails are forgotten (full write
    /// next time); the others stay synced. Returns what was written.
    pub async fn sync_changed(
        &mut self,
        desired: &Ruleset,
        changed: &ChangedChains,
    ) -> Result<Vec<TableSync>, SyncError> {
        let mut done = Vec::new();
        let mut first_error = None;
        for table in Table::ALL {
            let wanted = desired.table(table);
            let chains = changed.table(table);
            let ensure = self
                .tables
                .get_mut(&table)
                .map(|known| std::mem::take(&mut known.ensure))
                .unwrap_or_default();
            match self.sync_table(table, wanted, chains, &ensure).await {
                Ok(Some(report)) => {
                    match self.tables.get_mut(&table) {
                        // Only the chains written are copied; an idle sync copies nothing.
                        Some(known) if !report.full => {
                            for chain in chains {
                                match wanted.chains.get(chain) {
                                    Some(rules) => {
                                        known.applied.chains.insert(chain.clone(), rules.clone());
                                    }
                                    None => {
                                        known.applied.chains.remove(chain);
                                    }
                                }
                            }
                        }
                        // Written in full: all that was known of it is replaced.
                        _ => {
                            self.tables.insert(
                                table,
                                KnownTable {
                                    applied: wanted.clone(),
                                    ..KnownTable::default()
                                },
                            );
                        }
                    }
                    self.record(table, report.full, &report.chains, wanted)
                        .await;
                    done.push(report);
                }
                Ok(None) => {}
                Err(error) => {
                    self.forget_table(table);
                    first_error.get_or_insert(error);
                }
            }
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(done),
        }
    }

    /// Keeps the digests of what a write left in `chains` (all of the table's after a
    /// full write, which starts from none), for the read-back: of the text on the legacy
    /// backend, of what the kernel holds on nf_tables, read right away (after a full
    /// write, by the read-back that follows at once). A chain that cannot be read is not
    /// compared until it is written again.
    async fn record(
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

    async fn sync_table(
        &self,
        table: Table,
        wanted: &TableRules,
        changed: &BTreeSet<String>,
        ensure: &[String],
    ) -> Result<Option<TableSync>, SyncError> {
        let name = table.as_str();
        let started = Instant::now();
        let mut inspection = TableInspection::default();
        let (payload, full) = match self.tables.get(&table).map(|known| &known.applied) {
            // The canary is written by full writes only, so incremental diffs ignore it.
            Some(applied) => match restore::incremental(name, applied, wanted, changed, ensure) {
                Some(payload) => (payload, false),
                None => return Ok(None),
            },
            None => {
                inspection = inspect(self.tools, name).await?;
                if table == Table::Filter {
                    // The mangle canary goes in with the first full write.
                    self.restore_noflush_text("mangle", &canary_payload("mangle"))
                        .await?;
                }
                let mut with_canary = wanted.clone();
                with_canary
                    .chains
                    .entry(CANARY_CHAIN.to_owned())
                    .or_default();
                (restore::full(name, &inspection, &with_canary), true)
            }
        };
        let restore_started = Instant::now();
        self.restore(name, &payload).await?;
        let restore = restore_started.elapsed();
        if payload.mode == RestoreMode::NoFlush && full {
            self.ensure_base_jumps(table).await?;
            // Best effort: what an old version left behind does not stop the rules.
            if let Err(error) = self.remove_old_firewall(name, &inspection).await {
                tracing::warn!(%error, "could not remove an older node proxy's KUBE-FIREWALL rules");
            }
        }
        Ok(Some(TableSync {
            table,
            mode: payload.mode,
            full,
            written_chains: payload.written_chains,
            deleted_chains: payload.deleted_chains,
            rules: payload.rules,
            elapsed: started.elapsed(),
            restore,
            payload: payload.text,
            chains: payload.chains,
        }))
    }

    async fn restore(&self, table: &str, payload: &Payload) -> Result<(), SyncError> {
        let mut args = vec!["-w", LOCK_WAIT_SECONDS];
        if payload.mode == RestoreMode::NoFlush {
            args.push("--noflush");
        }
        let program = self.tools.restore();
        let output = spawn_with_stdin(program, &args, Some(&payload.text)).await?;
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr).trim().to_owned();
        let context = restore::failing_line(&stderr)
            .map(|line| restore::context_lines(&payload.text, line, CONTEXT_RADIUS));
        Err(SyncError::Restore {
            program,
            table: table.to_owned(),
            status: output.status,
            stderr,
            context,
        })
    }

    async fn restore_noflush_text(&self, table: &str, text: &str) -> Result<(), SyncError> {
        let payload = Payload {
            mode: RestoreMode::NoFlush,
            text: text.to_owned(),
            written_chains: 0,
            deleted_chains: 0,
            rules: 0,
            chains: BTreeSet::new(),
        };
        self.restore(table, &payload).await
    }

    /// Make sure the base jumps of `table` exist (`-C`, else `-I` at the top). Prepending
    /// in reverse keeps [`BASE_JUMPS`] order in a chain that had none of them.
    ///
    /// These single-rule commands run the detected backend's binary on the async runtime
    /// with the same bounded lock wait as the restores; the `iptables` crate was tried for
    /// them and dropped: it waits for the xtables lock without bound (`--wait`), blocks
    /// (std::process), probes `iptables --version` whatever the backend, and splits rules
    /// with a regex that does not know iptables-save's backslash escapes.
    async fn ensure_base_jumps(&self, table: Table) -> Result<(), SyncError> {
        for jump in BASE_JUMPS.iter().rev().filter(|j| j.table == table) {
            let rule = split_rule(jump.rule);
            let mut check = vec![
                "-w",
                LOCK_WAIT_SECONDS,
                "-t",
                table.as_str(),
                "-C",
                jump.builtin_chain,
            ];
            check.extend(rule.iter().map(String::as_str));
            let output = spawn_with_stdin(self.tools.iptables(), &check, None).await?;
            if output.status.success() {
                continue;
            }
            let mut insert = vec![
                "-w",
                LOCK_WAIT_SECONDS,
                "-t",
                table.as_str(),
                "-I",
                jump.builtin_chain,
                "1",
            ];
            insert.extend(rule.iter().map(String::as_str));
            run(self.tools.iptables(), &insert, None).await?;
        }
        Ok(())
    }

    /// `--cleanup`: remove from mangle, nat and filter what [`restore::cleanup`] finds ours
    /// (the kubelet's chains and the shared ones it holds stay). Idempotent.
    pub async fn cleanup(&mut self) -> Result<(), SyncError> {
        self.forget();
        for table in CANARY_TABLES {
            let inspection = inspect(self.tools, table).await?;
            let plan = restore::cleanup(table, &inspection);
            for jump in plan.jumps {
                let rule = split_rule(jump.rule);
                let mut delete = vec![
                    "-w",
                    LOCK_WAIT_SECONDS,
                    "-t",
                    table,
                    "-D",
                    jump.builtin_chain,
                ];
                delete.extend(rule.iter().map(String::as_str));
                // Delete every copy; the loop ends when the rule is not found.
                while spawn_with_stdin(self.tools.iptables(), &delete, None)
                    .await?
                    .status
                    .success()
                {}
            }
            if let Some(text) = plan.payload {
                self.restore_noflush_text(table, &text).await?;
            }
            self.remove_old_firewall(table, &inspection).await?;
        }
        Ok(())
    }

    /// Removes what [`restore::old_firewall`] finds an older node proxy left in `table`.
    async fn remove_old_firewall(
        &self,
        table: &str,
        inspection: &TableInspection,
    ) -> Result<(), SyncError> {
        let plan = restore::old_firewall(table, inspection);
        if plan.is_empty() {
            return Ok(());
        }
        tracing::info!(?plan.jumps, chain = plan.payload.is_some(), "removing an older node proxy's KUBE-FIREWALL rules");
        for (builtin, rule) in plan.jumps {
            let mut delete = vec!["-w", LOCK_WAIT_SECONDS, "-t", table, "-D", builtin];
            let rule = split_rule(rule);
            delete.extend(rule.iter().map(String::as_str));
            while spawn_with_stdin(self.tools.iptables(), &delete, None)
                .await?
                .status
                .success()
            {}
        }
        if let Some(text) = plan.payload {
            self.restore_noflush_text(table, &text).await?;
        }
        Ok(())
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
async fn inspect(tools: Tools, table: &'static str) -> Result<TableInspection, SyncError> {
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

/// Runs `work` on the blocking pool (netlink dumps, parsing large listings).
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, SyncError> + Send + 'static,
) -> Result<T, SyncError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| SyncError::Task(error.to_string()))?
}

async fn run(
    program: &'static str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<String, SyncError> {
    let output = spawn_with_stdin(program, args, stdin).await?;
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    Err(SyncError::Command {
        program,
        args: args.join(" "),
        status: output.status,
        stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
    })
}

fn canary_payload(table: &str) -> String {
    format!("*{table}\n:{CANARY_CHAIN} - [0:0]\nCOMMIT\n")
}

async fn spawn_with_stdin(
    program: &'static str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<std::process::Output, SyncError> {
    let spawn_error = |source| SyncError::Spawn { program, source };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(spawn_error)?;
    // Before its input: the changes it commits are announced as ours.
    if let Some(pid) = child.id() {
        crate::ruleset_events::record_own_port(pid);
    }
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A restore that dies early closes its stdin; its exit status tells why.
        if let Err(error) = pipe.write_all(text.as_bytes()).await {
            tracing::debug!(program, %error, "writing restore input");
        }
        drop(pipe);
    }
    child.wait_with_output().await.map_err(spawn_error)
}

/// `iptables` arguments that delete our base jump from `builtin_chain` of `table`, as
/// someone else would (the drift tests and benchmarks); `None` when there is none.
pub fn base_jump_deletion(table: Table, builtin_chain: &str) -> Option<Vec<String>> {
    let jump = BASE_JUMPS
        .iter()
        .find(|jump| jump.table == table && jump.builtin_chain == builtin_chain)?;
    let mut args: Vec<String> = ["-t", table.as_str(), "-D", builtin_chain]
        .map(str::to_owned)
        .to_vec();
    args.extend(split_rule(jump.rule));
    Some(args)
}

/// Split a rule text into arguments the way a shell would for the quoting `iptables-save`
/// uses (double quotes around comments, backslash escapes inside them).
pub fn split_rule(rule: &str) -> Vec<String> {
    let mut args = Vec::new();
    let mut current = String::new();
    let mut in_quotes = false;
    let mut has_token = false;
    let mut chars = rule.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                in_quotes = !in_quotes;
                has_token = true;
            }
            '\\' if in_quotes => {
                if let Some(next) = chars.next() {
                    current.push(next);
                }
            }
            c if c.is_whitespace() && !in_quotes => {
                if has_token {
                    args.push(std::mem::take(&mut current));
                    has_token = false;
                }
            }
            c => {
                current.push(c);
                has_token = true;
            }
        }
    }
    if has_token {
        args.push(current);
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_split_like_a_shell() {
        assert_eq!(
            split_rule(
                r#"-m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#
            ),
            vec![
                "-m",
                "conntrack",
                "--ctstate",
                "NEW",
                "-m",
                "comment",
                "--comment",
                "kubernetes service portals",
                "-j",
                "KUBE-SERVICES"
            ]
        );
        assert_eq!(
            split_rule("  -j   KUBE-FIREWALL "),
            vec!["-j", "KUBE-FIREWALL"]
        );
        assert_eq!(
            split_rule(r#"--comment "" -j X"#),
            vec!["--comment", "", "-j", "X"]
        );
        assert_eq!(
            split_rule(r#"--comment "a \"b\"""#),
            vec!["--comment", "a \"b\""]
        );
    }

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

    #[test]
    fn canary_payload_declares_only_the_canary() {
        assert_eq!(
            canary_payload("mangle"),
            "*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n"
        );
    }
}
