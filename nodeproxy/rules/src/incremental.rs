//! The ruleset kept up to date one Service port at a time: a sync rebuilds only the ports
//! that changed and reports the chains whose rules differ, so its cost follows the change,
//! not the cluster.
//!
//! Each port's rules come from [`port_rules`]; its own chains go straight into the
//! assembled ruleset (only their names are remembered), its rules in the shared
//! [`DISPATCH_CHAINS`] are kept per port, and a dispatch chain is re-assembled (every
//! port's share in [`ServicePortName`] order) only when some port's share of it changed.
//! The result equals [`build`](crate::build) of the same state; the node proxy checks
//! that every `--sync-period`.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::{NodeConfig, ProxyState, ServicePortName};
use crate::rules::{DISPATCH_CHAINS, last_service_rules, port_rules};
use crate::ruleset::{ChangedChains, Ruleset, Table};

/// What the assembled ruleset holds of one Service port.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PortShare {
    /// Its own chains (KUBE-SVC, KUBE-SVL, KUBE-SEP, KUBE-FW, KUBE-XLB).
    own: Vec<(Table, String)>,
    /// Its rules in each dispatch chain it adds to, by index into [`DISPATCH_CHAINS`].
    dispatch: BTreeMap<usize, Vec<String>>,
}

/// The desired ruleset, updated per Service port.
#[derive(Debug, Clone)]
pub struct IncrementalRuleset {
    node: NodeConfig,
    ruleset: Ruleset,
    ports: BTreeMap<ServicePortName, PortShare>,
}

impl IncrementalRuleset {
    /// The ruleset of a cluster without Services: the fixed chains only.
    pub fn new(node: NodeConfig) -> Self {
        let ruleset = crate::build(&ProxyState::new(node.family), &node);
        Self {
            node,
            ruleset,
            ports: BTreeMap::new(),
        }
    }

    pub fn ruleset(&self) -> &Ruleset {
        &self.ruleset
    }

    /// The node the rules are for.
    pub fn node(&self) -> &NodeConfig {
        &self.node
    }

    /// The node's zone changed: later updates choose endpoints by the new one. Only ports
    /// whose endpoints carry zone hints depend on it; the caller updates those.
    pub fn set_zone(&mut self, zone: Option<String>) {
        self.node.zone = zone;
    }

    /// Rebuilds the given Service ports from `state` (a port `state` no longer has is
    /// removed) and returns the chains whose rules changed or that went away.
    pub fn update<'a>(
        &mut self,
        state: &ProxyState,
        ports: impl IntoIterator<Item = &'a ServicePortName>,
    ) -> ChangedChains {
        let mut changed = ChangedChains::default();
        let mut dispatch_changed = BTreeSet::new();
        for name in ports {
            let old = self.ports.remove(name).unwrap_or_default();
            let new = match state.services().get(name) {
                Some(service) => self.install(
                    port_rules(service, state.endpoints_of(name), &self.node),
                    &mut changed,
                ),
                None => PortShare::default(),
            };
            for (table, chain) in &old.own {
                if !new.own.contains(&(*table, chain.clone())) {
                    self.ruleset.table_mut(*table).chains.remove(chain);
                    changed.table_mut(*table).insert(chain.clone());
                }
            }
            for index in 0..DISPATCH_CHAINS.len() {
                if old.dispatch.get(&index) != new.dispatch.get(&index) {
                    dispatch_changed.insert(index);
                }
            }
            if new != PortShare::default() {
                self.ports.insert(name.clone(), new);
            }
        }
        for index in dispatch_changed {
            let (table, chain) = DISPATCH_CHAINS[index];
            let mut rules: Vec<String> = self
                .ports
                .values()
                .filter_map(|share| share.dispatch.get(&index))
                .flatten()
                .cloned()
                .collect();
            if (table, chain) == (Table::Nat, crate::chains::KUBE_SERVICES) {
                rules.extend(last_service_rules(&self.node));
            }
            let current = self.ruleset.table_mut(table).chains.entry(chain.to_owned());
            let current = current.or_default();
            if *current != rules {
                *current = rules;
                changed.table_mut(table).insert(chain.to_owned());
            }
        }
        changed
    }

    /// Puts one port's own chains into the ruleset (noting those that differ) and returns
    /// what it holds of the port.
    fn install(&mut self, rules: Ruleset, changed: &mut ChangedChains) -> PortShare {
        let mut share = PortShare::default();
        let Ruleset { filter, nat } = rules;
        for (table, rules) in [(Table::Filter, filter), (Table::Nat, nat)] {
            for (chain, chain_rules) in rules.chains {
                if let Some(index) = DISPATCH_CHAINS.iter().position(|d| *d == (table, &*chain)) {
                    share.dispatch.insert(index, chain_rules);
                    continue;
                }
                let chains = &mut self.ruleset.table_mut(table).chains;
                if chains.get(&chain) != Some(&chain_rules) {
                    changed.table_mut(table).insert(chain.clone());
                    chains.insert(chain.clone(), chain_rules);
                }
                share.own.push((table, chain));
            }
        }
        share
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use tandem_common::{IpFamily, Protocol};

    use super::*;
    use crate::model::{Endpoint, ServicePort};

    fn node() -> NodeConfig {
        NodeConfig::new("node-a", Some("10.244.0.0/16".parse().unwrap()))
    }

    fn name(n: &str) -> ServicePortName {
        ServicePortName {
            namespace: "default".into(),
            name: n.into(),
            port: "http".into(),
        }
    }

    fn service(n: &str, last: u8) -> ServicePort {
        ServicePort {
            name: name(n),
            protocol: Protocol::Tcp,
            cluster_ip: Some(Ipv4Addr::new(10, 96, 0, last).into()),
            port: 80,
            node_port: Some(30_000 + u16::from(last)),
            external_ips: vec![],
            load_balancer_ingress: vec![],
            load_balancer_source_ranges: vec![],
            session_affinity_timeout: None,
            external_traffic_policy_local: false,
            health_check_node_port: None,
            internal_traffic_policy_local: false,
        }
    }

    fn endpoint(last: u8) -> Endpoint {
        Endpoint {
            ip: Ipv4Addr::new(10, 244, 1, last).into(),
            port: 8080,
            ready: true,
            serving: true,
            terminating: false,
            node_name: Some("node-b".into()),
            hints: None,
        }
    }

    #[test]
    fn an_endpoint_change_touches_only_that_port_and_the_full_build_agrees() {
        let mut state = ProxyState::new(IpFamily::V4);
        for (n, last) in [("a", 1), ("b", 2)] {
            state.insert_service(service(n, last));
            state.insert_endpoints(name(n), vec![endpoint(last)]);
        }
        let mut incremental = IncrementalRuleset::new(node());
        let first = incremental.update(&state, state.services().keys());
        assert_eq!(incremental.ruleset(), &crate::build(&state, &node()));
        assert!(first.nat.contains("KUBE-SERVICES"));

        let mut endpoints = state.endpoints_of(&name("a")).to_vec();
        endpoints.push(endpoint(9));
        state.insert_endpoints(name("a"), endpoints);
        let changed = incremental.update(&state, [&name("a")]);
        assert_eq!(incremental.ruleset(), &crate::build(&state, &node()));
        // The KUBE-SVC chain of "a" and the new KUBE-SEP chain; no dispatch chain.
        assert!(changed.filter.is_empty());
        assert_eq!(changed.nat.len(), 2, "{changed:?}");
        assert!(changed.nat.iter().all(|c| c.starts_with("KUBE-S")));
        assert!(!changed.nat.contains("KUBE-SERVICES"));

        state.remove(&name("b"));
        let changed = incremental.update(&state, [&name("b")]);
        assert_eq!(incremental.ruleset(), &crate::build(&state, &node()));
        assert!(changed.nat.contains("KUBE-SERVICES") && changed.nat.contains("KUBE-NODEPORTS"));
        assert_eq!(
            incremental.update(&state, [&name("b")]),
            ChangedChains::default()
        );
    }
}
