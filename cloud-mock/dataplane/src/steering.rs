//! Do: the Maglev steering of passthrough flows (module `maglev` decides). Each node gets a
//! routing table (`default via NODE`) and an `ip rule` from its mark to it, then one `nft -f`
//! transaction replaces the steering table; a node's rule and table go only after the
//! table no longer marks packets for it.
//!
//! Node tables and rules carry the routes' `proto N`: a restart adopts the tables an
//! earlier run gave its nodes, so connections marked for a node stay on it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use tracing::{debug, info, warn};

use crate::command::{Program, already_gone, device_towards, family_flag, value_of};
use crate::config::MaglevConfig;
use crate::maglev::{self, NFT_TABLE};
use crate::plan::RouteTable;

/// `ip` arguments for the default route of a node's table.
fn node_route_args(node: IpAddr, device: &str, table: u32, protocol: u8) -> Vec<String> {
    [
        family_flag(node),
        "route",
        "replace",
        "default",
        "via",
        &node.to_string(),
        "dev",
        device,
        "table",
        &table.to_string(),
        "proto",
        &protocol.to_string(),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// `ip` arguments that add (`add`) or delete (`del`) the rule from a node's mark to its
/// table, in the node's family.
fn rule_args(verb: &str, family: &str, table: u32, priority: u32, protocol: u8) -> Vec<String> {
    let table = table.to_string();
    [
        family,
        "rule",
        verb,
        "fwmark",
        &table,
        "lookup",
        &table,
        "priority",
        &priority.to_string(),
        "protocol",
        &protocol.to_string(),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// `ip` arguments flushing a node's table (its one route).
fn flush_table_args(family: &str, table: u32) -> Vec<String> {
    [family, "route", "flush", "table", &table.to_string()]
        .map(str::to_owned)
        .to_vec()
}

/// The node tables in `ip route show table all proto N` output: `default via NODE ...
/// table T` with `T` in `range`.
pub(crate) fn parse_node_tables(
    output: &str,
    range: &std::ops::Range<u32>,
) -> BTreeMap<IpAddr, u32> {
    output
        .lines()
        .filter_map(|line| {
            let tokens: Vec<&str> = line.split_whitespace().collect();
            if tokens.first() != Some(&"default") {
                return None;
            }
            let node: IpAddr = value_of(&tokens, "via")?.parse().ok()?;
            let table: u32 = value_of(&tokens, "table")?.parse().ok()?;
            range.contains(&table).then_some((node, table))
        })
        .collect()
}

/// The tables our rules lead to in `ip rule show protocol N` output (`... lookup T ...`),
/// within `range`.
pub(crate) fn parse_rule_tables(output: &str, range: &std::ops::Range<u32>) -> BTreeSet<u32> {
    output
        .lines()
        .filter(|line| line.contains("fwmark"))
        .filter_map(|line| {
            let tokens: Vec<&str> = line.split_whitespace().collect();
            value_of(&tokens, "lookup")?.parse().ok()
        })
        .filter(|table| range.contains(table))
        .collect()
}

/// What of the steering is in the kernel, as far as this run knows.
pub(crate) struct Steering {
    ip: Program,
    nft: Program,
    config: MaglevConfig,
    protocol: u8,
    /// Node → its table, each with its default route.
    tables: BTreeMap<IpAddr, u32>,
    /// (family flag, table) of each rule of ours.
    rules: BTreeSet<(&'static str, u32)>,
    /// The ruleset last loaded (an unchanged one is not loaded again), and how many
    /// lookup chains it made.
    loaded: Option<String>,
    chains: usize,
}

impl Steering {
    pub(crate) fn new(ip: Program, config: MaglevConfig, protocol: u8) -> Self {
        let nft = Program::new(config.nft_program.clone());
        Self {
            ip,
            nft,
            config,
            protocol,
            tables: BTreeMap::new(),
            rules: BTreeSet::new(),
            loaded: None,
            chains: 0,
        }
    }

    fn range(&self) -> std::ops::Range<u32> {
        self.config.first_table..self.config.first_table.saturating_add(self.config.tables)
    }

    /// Takes over the node tables and rules an earlier run left; its steering table goes
    /// (this run does not know its chains), so flows follow the lookup tables alone until
    /// this run's first load.
    pub(crate) async fn adopt(&mut self) {
        self.remove_table().await;
        let range = self.range();
        let protocol = self.protocol.to_string();
        for family in ["-4", "-6"] {
            let routes =
                [family, "route", "show", "table", "all", "proto", &protocol].map(str::to_owned);
            match self.ip.run(&routes).await {
                Ok(output) => self.tables.extend(parse_node_tables(&output, &range)),
                Err(error) => warn!(%error, "cannot list the Maglev node tables of an earlier run"),
            }
            let rules = [family, "rule", "show", "protocol", &protocol].map(str::to_owned);
            match self.ip.run(&rules).await {
                Ok(output) => self.rules.extend(
                    parse_rule_tables(&output, &range)
                        .into_iter()
                        .map(|table| (family, table)),
                ),
                Err(error) => warn!(%error, "cannot list the Maglev rules of an earlier run"),
            }
        }
        if !self.tables.is_empty() {
            info!(nodes = self.tables.len(), "adopting Maglev node tables");
        }
    }

    /// Steers `desired`; false when anything failed (the caller retries).
    pub(crate) async fn sync(&mut self, desired: &RouteTable) -> bool {
        let wanted = maglev::node_tables(
            &self.tables,
            desired,
            self.config.first_table,
            self.config.tables,
        );
        let mut all_done = true;
        for (&node, &table) in &wanted {
            if self.tables.get(&node) != Some(&table) && !self.route_node(node, table).await {
                all_done = false;
                continue;
            }
            let rule = (family_flag(node), table);
            if !self.rules.contains(&rule) {
                match self.rule("add", rule).await {
                    Ok(()) => {
                        self.rules.insert(rule);
                    }
                    Err(error) => {
                        warn!(%error, %node, table, "cannot add a Maglev rule; will retry");
                        all_done = false;
                    }
                }
            }
        }
        // Marks lead to nodes only through rules and tables that exist.
        let ready: BTreeMap<IpAddr, u32> = wanted
            .iter()
            .filter(|&(&node, &table)| {
                self.tables.get(&node) == Some(&table)
                    && self.rules.contains(&(family_flag(node), table))
            })
            .map(|(&node, &table)| (node, table))
            .collect();
        let (ruleset, chains) = maglev::ruleset(desired, &ready, self.chains);
        if self.loaded.as_ref() != Some(&ruleset) {
            match self
                .nft
                .run_with_input(&["-f".to_owned(), "-".to_owned()], &ruleset)
                .await
            {
                Ok(_) => {
                    debug!(
                        vips = desired.len(),
                        nodes = ready.len(),
                        "Maglev steering loaded"
                    );
                    self.loaded = Some(ruleset);
                    self.chains = chains;
                }
                Err(error) => {
                    warn!(%error, "cannot load the Maglev steering table; will retry");
                    return false;
                }
            }
        }
        self.forget_except(&wanted).await && all_done
    }

    /// Removes the steering table, then every rule and node table.
    pub(crate) async fn clear(&mut self) {
        self.remove_table().await;
        self.forget_except(&BTreeMap::new()).await;
    }

    async fn remove_table(&mut self) {
        if let Err(error) = self
            .nft
            .run_with_input(&["-f".to_owned(), "-".to_owned()], &maglev::removal())
            .await
        {
            warn!(%error, table = NFT_TABLE, "cannot remove the Maglev steering table");
        }
        self.loaded = None;
        self.chains = 0;
    }

    /// Deletes the rules and node tables not in `wanted`.
    async fn forget_except(&mut self, wanted: &BTreeMap<IpAddr, u32>) -> bool {
        let mut all_done = true;
        let kept: BTreeSet<(&'static str, u32)> = wanted
            .iter()
            .map(|(&node, &table)| (family_flag(node), table))
            .collect();
        for rule in self.rules.clone() {
            if kept.contains(&rule) {
                continue;
            }
            match self.rule("del", rule).await {
                Ok(()) => {
                    self.rules.remove(&rule);
                }
                Err(error) => {
                    warn!(%error, table = rule.1, "cannot delete a Maglev rule; will retry");
                    all_done = false;
                }
            }
        }
        for (node, table) in self.tables.clone() {
            if wanted.get(&node) == Some(&table) {
                continue;
            }
            match self
                .ip
                .run(&flush_table_args(family_flag(node), table))
                .await
            {
                Ok(_) => {
                    debug!(%node, table, "Maglev node table removed");
                    self.tables.remove(&node);
                }
                Err(error) if already_gone(&error) => {
                    self.tables.remove(&node);
                }
                Err(error) => {
                    warn!(%error, table, "cannot remove a Maglev node table; will retry");
                    all_done = false;
                }
            }
        }
        all_done
    }

    /// Gives `node` the default route of `table`; false when that failed.
    async fn route_node(&mut self, node: IpAddr, table: u32) -> bool {
        let routed = match device_towards(&self.ip, node).await {
            Ok(device) => self
                .ip
                .run(&node_route_args(node, &device, table, self.protocol))
                .await
                .map_err(|error| error.to_string()),
            Err(error) => Err(error.to_string()),
        };
        match routed {
            Ok(_) => {
                info!(%node, table, "Maglev node table set");
                self.tables.insert(node, table);
                true
            }
            Err(error) => {
                warn!(%error, %node, "cannot route a Maglev node table; will retry");
                false
            }
        }
    }

    async fn rule(
        &self,
        verb: &str,
        (family, table): (&'static str, u32),
    ) -> Result<(), crate::error::CommandError> {
        let args = rule_args(
            verb,
            family,
            table,
            self.config.rule_priority,
            self.protocol,
        );
        match self.ip.run(&args).await {
            Ok(_) => Ok(()),
            // Added by an earlier attempt whose answer was lost, or deleted already.
            Err(error) if verb == "add" && error.stderr().contains("File exists") => Ok(()),
            Err(error) if verb == "del" && already_gone(&error) => Ok(()),
            Err(error) => Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_tables_and_rules_of_an_earlier_run_are_read_back() {
        let range = 31232..31232 + 64;
        let routes = "default via 10.77.0.11 dev ve table 31232 \n\
                      default via 10.77.0.12 dev ve table 31233 \n\
                      default via 10.9.9.9 dev ve table 100 \n\
                      198.51.100.5 nhid 16777216 \n";
        assert_eq!(
            parse_node_tables(routes, &range),
            BTreeMap::from([
                ("10.77.0.11".parse().unwrap(), 31232),
                ("10.77.0.12".parse().unwrap(), 31233),
            ])
        );
        let rules = "0:\tfrom all lookup local\n\
                     100:\tfrom all fwmark 0x7a00 lookup 31232 proto 77\n\
                     100:\tfrom all fwmark 0x10 lookup 16 proto 77\n\
                     32766:\tfrom all lookup main\n";
        assert_eq!(parse_rule_tables(rules, &range), BTreeSet::from([31232]));
    }

    #[test]
    fn args_name_the_table_mark_and_protocol() {
        let node: IpAddr = "2001:db8:18::11".parse().unwrap();
        assert_eq!(
            node_route_args(node, "ve", 31233, 77).join(" "),
            "-6 route replace default via 2001:db8:18::11 dev ve table 31233 proto 77"
        );
        assert_eq!(
            rule_args("add", "-4", 31232, 100, 77).join(" "),
            "-4 rule add fwmark 31232 lookup 31232 priority 100 protocol 77"
        );
        assert_eq!(
            flush_table_args("-4", 31232).join(" "),
            "-4 route flush table 31232"
        );
    }
}
