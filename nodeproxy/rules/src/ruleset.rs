//! The desired iptables state as plain data: tables of chains of rule texts.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::chains;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Table {
    Filter,
    Nat,
}

impl Table {
    /// The tables the ruleset covers, in the order they are written.
    pub const ALL: [Table; 2] = [Table::Filter, Table::Nat];

    pub fn as_str(self) -> &'static str {
        match self {
            Table::Filter => "filter",
            Table::Nat => "nat",
        }
    }
}

/// The chains the node proxy needs in one table (its own and the [`SHARED_CHAINS`]), each
/// with its rules in order. A rule is the text after `-A CHAIN ` exactly as
/// `iptables-restore` accepts it, e.g.
/// `-m comment --comment "default/nginx-service:http" -j KUBE-SEP-XZBMABGU65WCSBQV`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableRules {
    pub chains: BTreeMap<String, Vec<String>>,
}

/// The whole desired state of both tables. Jumps from the built-in chains are not in
/// here: they are the fixed [`BASE_JUMPS`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ruleset {
    pub filter: TableRules,
    pub nat: TableRules,
}

impl Ruleset {
    pub fn table(&self, table: Table) -> &TableRules {
        match table {
            Table::Filter => &self.filter,
            Table::Nat => &self.nat,
        }
    }

    pub fn table_mut(&mut self, table: Table) -> &mut TableRules {
        match table {
            Table::Filter => &mut self.filter,
            Table::Nat => &mut self.nat,
        }
    }

    /// One table as a complete `iptables-restore` payload in `iptables-save` layout
    /// (`*table`, chain declarations, rules, `COMMIT`), without the built-in chains.
    pub fn restore_payload(&self, table: Table) -> String {
        let chains = &self.table(table).chains;
        let mut text = format!("*{}\n", table.as_str());
        for chain in chains.keys() {
            let _ = writeln!(text, ":{chain} - [0:0]");
        }
        for (chain, rules) in chains {
            for rule in rules {
                let _ = writeln!(text, "-A {chain} {rule}");
            }
        }
        text.push_str("COMMIT\n");
        text
    }
}

/// The names of the chains whose rules changed (or that went away) in each table: what
/// an incremental restore writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangedChains {
    pub filter: BTreeSet<String>,
    pub nat: BTreeSet<String>,
}

impl ChangedChains {
    /// Every chain that differs between two rulesets, by a full comparison.
    pub fn between(old: &Ruleset, new: &Ruleset) -> Self {
        let mut out = Self::default();
        for table in Table::ALL {
            let (old, new) = (&old.table(table).chains, &new.table(table).chains);
            let differs = old
                .iter()
                .filter(|(name, rules)| new.get(*name) != Some(rules))
                .map(|(name, _)| name);
            let added = new.keys().filter(|name| !old.contains_key(*name));
            out.table_mut(table).extend(differs.chain(added).cloned());
        }
        out
    }

    pub fn table(&self, table: Table) -> &BTreeSet<String> {
        match table {
            Table::Filter => &self.filter,
            Table::Nat => &self.nat,
        }
    }

    pub fn table_mut(&mut self, table: Table) -> &mut BTreeSet<String> {
        match table {
            Table::Filter => &mut self.filter,
            Table::Nat => &mut self.nat,
        }
    }

    /// How many chains are named, in both tables.
    pub fn count(&self) -> usize {
        self.filter.len() + self.nat.len()
    }

    /// Adds the chains of `other`.
    pub fn merge(&mut self, other: ChangedChains) {
        self.filter.extend(other.filter);
        self.nat.extend(other.nat);
    }
}

/// The nat chains the kubelet v1.21 creates too, with the same rules (kube-proxy and the
/// kubelet keep them identical on purpose), and which the kubelet rebuilds only when its
/// canary chain vanishes; kubelets >= 1.28 no longer create them. They are in the
/// [`Ruleset`] because our rules jump to them, but on a node that may hold them already
/// they are only ensured (created if missing, missing rules appended), never rewritten,
/// and `--cleanup` removes them only from a table without the kubelet.
pub const SHARED_CHAINS: [(Table, &str); 3] = [
    (Table::Nat, chains::KUBE_MARK_DROP),
    (Table::Nat, chains::KUBE_MARK_MASQ),
    (Table::Nat, chains::KUBE_POSTROUTING),
];

/// A jump from a built-in chain into one of ours, installed once (prepended, idempotent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseJump {
    pub table: Table,
    pub builtin_chain: &'static str,
    /// Rule text after `-A BUILTIN `, ending in `-j OURCHAIN`.
    pub rule: &'static str,
    /// The kubelet v1.21 installs the same rule (into a [`SHARED_CHAINS`] chain): it is
    /// ensured like ours, but left in place by `--cleanup` where the kubelet is.
    pub shared: bool,
}

/// Every jump from a built-in chain the node proxy installs, in the order they must end up
/// in each built-in chain (the installer prepends in reverse so this order holds).
///
/// kube-proxy v1.21's own jumps, plus KUBE-PROXY-FIREWALL (kube-proxy >= 1.25's jump, first
/// in INPUT, FORWARD and OUTPUT): it drops what KUBE-MARK-DROP marked. v1.21 left that to the
/// kubelet's KUBE-FIREWALL, hooked from INPUT and OUTPUT only, so a packet to a non-local LB
/// IP (passthrough) from outside loadBalancerSourceRanges was forwarded instead of dropped;
/// and kubelets >= 1.28 no longer drop the mark at all.
pub const BASE_JUMPS: &[BaseJump] = &[
    BaseJump {
        table: Table::Filter,
        builtin_chain: "INPUT",
        rule: LB_FIREWALL_JUMP,
        shared: false,
    },
    BaseJump {
        table: Table::Filter,
        builtin_chain: "INPUT",
        rule: "-m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS",
        shared: false,
    },
    BaseJump {
        table: Table::Filter,
        builtin_chain: "INPUT",
        rule: "-m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES",
        shared: false,
    },
    BaseJump {
        table: Table::Filter,
        builtin_chain: "FORWARD",
        rule: LB_FIREWALL_JUMP,
        shared: false,
    },
    BaseJump {
        table: Table::Filter,
        builtin_chain: "FORWARD",
        rule: "-m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD",
        shared: false,
    },
    BaseJump {
        table: Table::Filter,
        builtin_chain: "FORWARD",
        rule: "-m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
        shared: false,
    },
    BaseJump {
        table: Table::Filter,
        builtin_chain: "FORWARD",
        rule: "-m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES",
        shared: false,
    },
    BaseJump {
        table: Table::Filter,
        builtin_chain: "OUTPUT",
        rule: LB_FIREWALL_JUMP,
        shared: false,
    },
    BaseJump {
        table: Table::Filter,
        builtin_chain: "OUTPUT",
        rule: "-m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
        shared: false,
    },
    BaseJump {
        table: Table::Nat,
        builtin_chain: "PREROUTING",
        rule: "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
        shared: false,
    },
    BaseJump {
        table: Table::Nat,
        builtin_chain: "OUTPUT",
        rule: "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
        shared: false,
    },
    BaseJump {
        table: Table::Nat,
        builtin_chain: "POSTROUTING",
        rule: "-m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING",
        shared: true,
    },
];

/// The jump into KUBE-PROXY-FIREWALL, as kube-proxy >= 1.25 writes it: the drop mark is
/// set in nat, which sees only a connection's first packet.
const LB_FIREWALL_JUMP: &str = "-m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL";
