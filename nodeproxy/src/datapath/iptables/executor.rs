//! The executor of the iptables mode: the restores that bring the kernel to the desired
//! rules, writing only the chains that changed, and the single-rule commands around them
//! (base jumps, `--cleanup`).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use tandem_nftables::NftFamily;
use tandem_proxy_rules::ruleset::{BASE_JUMPS, ChangedChains, Ruleset, Table, TableRules};

use super::command::{LOCK_WAIT_SECONDS, SyncError, run, spawn_with_stdin};
use super::readback::inspect;
use super::restore::{self, CANARY_CHAIN, Payload, RestoreMode, TableInspection};
use super::{IptablesPath, KnownTable, Syncer};
use crate::datapath::remove_nftables_table;
use crate::metrics::{Metrics, TableLabel, TableLabels};

/// Payload lines logged on each side of the line a failing restore names.
const CONTEXT_RADIUS: usize = 3;
/// Tables that get a canary chain.
const CANARY_TABLES: [&str; 3] = ["mangle", "nat", "filter"];

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

impl Syncer {
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
                self.delete_every_copy(table, jump.builtin_chain, jump.rule)
                    .await?;
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
            self.delete_every_copy(table, builtin, rule).await?;
        }
        if let Some(text) = plan.payload {
            self.restore_noflush_text(table, &text).await?;
        }
        Ok(())
    }

    /// Deletes `rule` from `builtin` of `table` until none is left (`-D` removes one copy
    /// and fails when there is none).
    async fn delete_every_copy(
        &self,
        table: &str,
        builtin: &str,
        rule: &str,
    ) -> Result<(), SyncError> {
        let rule = split_rule(rule);
        let mut delete = vec!["-w", LOCK_WAIT_SECONDS, "-t", table, "-D", builtin];
        delete.extend(rule.iter().map(String::as_str));
        while spawn_with_stdin(self.tools.iptables(), &delete, None)
            .await?
            .status
            .success()
        {}
        Ok(())
    }
}

impl IptablesPath {
    /// See [`crate::datapath::DataPath::apply`].
    pub async fn apply(&mut self, metrics: &Metrics) -> bool {
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
}

fn canary_payload(table: &str) -> String {
    format!("*{table}\n:{CANARY_CHAIN} - [0:0]\nCOMMIT\n")
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

    #[test]
    fn canary_payload_declares_only_the_canary() {
        assert_eq!(
            canary_payload("mangle"),
            "*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n"
        );
    }
}
