//! Someone else's change to our rules, learned as it happens on the nf_tables backends
//! (the nftables mode and iptables-nft): the kernel announces every committed change with
//! the netlink port that sent it ([`tandem_nftables::monitor`]), and a change to what a
//! family's data path writes, sent through a port that is not ours, raises that family's
//! alarm, with where ([`Suspicion`]: the iptables chains the changes name, or everywhere).
//! The proxier then reads that family's rules back at once, there, instead of reading
//! everything back every period on a node where nothing changes.
//!
//! Our own writes are told apart by their port: each nftables socket's, recorded when it
//! is opened, and each `iptables-restore` child's (a process's first netlink socket takes
//! its pid as port), recorded before it is given its input. A port we fail to recognise
//! costs one needless read-back, never a missed change.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tandem_common::IpFamily;
use tandem_nftables::kernel::KernelError;
use tandem_nftables::monitor::{Announcement, Change, Monitor, Object};
use tandem_proxy_rules::ruleset::Table;
use tokio::sync::Notify;

use crate::datapath::iptables::restore;
use crate::metrics::Metrics;

/// Ports of our writers remembered: the open nftables sockets and the last restores,
/// whose announcements may arrive after they exited.
const REMEMBERED_PORTS: usize = 64;
/// Before the socket is opened again after it failed.
const REOPEN_DELAY: Duration = Duration::from_secs(1);

/// The netlink ports this process writes rules through, newest last.
static OWN_PORTS: Mutex<VecDeque<u32>> = Mutex::new(VecDeque::new());

/// `port` writes rules for us: its announced changes are not drift.
pub fn record_own_port(port: u32) {
    let mut ports = OWN_PORTS.lock().unwrap_or_else(PoisonError::into_inner);
    if ports.len() == REMEMBERED_PORTS {
        ports.pop_front();
    }
    ports.push_back(port);
}

fn is_own_port(port: u32) -> bool {
    OWN_PORTS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .contains(&port)
}

/// What one family's data path writes, as far as announcements can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The nftables mode: the whole table `tandem` of the family.
    NftablesTable,
    /// The iptables mode on iptables-nft: our chains in the `nat` and `filter` tables and
    /// our jumps in their built-in chains.
    IptablesNft,
}

/// True when `change`, someone else's, may have altered what `written` holds for
/// `family`. Built-in chains are everyone's: only a removal there can take a jump of ours
/// (a replaced rule is announced as a removal too), and rules others add beside ours are
/// theirs, as the read-back treats them.
pub fn concerns(written: Written, family: IpFamily, change: &Change) -> bool {
    if change.family != family {
        return false;
    }
    match written {
        Written::NftablesTable => change.table == tandem_nftables::TABLE,
        Written::IptablesNft => {
            let Some(table) = Table::ALL
                .into_iter()
                .find(|table| table.as_str() == change.table)
            else {
                return false;
            };
            match (change.object, change.chain.as_deref()) {
                (Object::Table, _) => change.removal,
                (Object::Chain | Object::Rule, Some(chain)) => {
                    restore::is_owned_chain(chain)
                        || (change.removal
                            && restore::builtin_chains(table.as_str()).contains(&chain))
                }
                _ => false,
            }
        }
    }
}

/// What someone else may have changed in one family's rules: where a read-back must look.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Suspicion {
    /// Anywhere: every rule is read back.
    pub everywhere: bool,
    /// The iptables chains named by the changes, per table (the built-in chains are read
    /// back by any read-back).
    pub chains: BTreeMap<Table, BTreeSet<String>>,
}

impl Suspicion {
    /// Everywhere: announcements were lost, or a change is not one chain's.
    pub fn everywhere() -> Self {
        Self {
            everywhere: true,
            chains: BTreeMap::new(),
        }
    }

    /// Where `change` (one that [`concerns`] the family) may have altered its rules.
    fn of(written: Written, change: &Change) -> Self {
        let table = Table::ALL
            .into_iter()
            .find(|table| table.as_str() == change.table);
        match (written, table, change.object, &change.chain) {
            (Written::IptablesNft, Some(table), Object::Chain | Object::Rule, Some(chain)) => {
                Self {
                    everywhere: false,
                    chains: BTreeMap::from([(table, BTreeSet::from([chain.clone()]))]),
                }
            }
            _ => Self::everywhere(),
        }
    }

    pub fn merge(&mut self, other: Suspicion) {
        self.everywhere |= other.everywhere;
        for (table, chains) in other.chains {
            self.chains.entry(table).or_default().extend(chains);
        }
    }
}

/// Raised per family when someone else changed what that family's data path wrote, with
/// where.
#[derive(Debug, Default)]
pub struct DriftAlarm {
    suspicions: Mutex<BTreeMap<IpFamily, Suspicion>>,
    raised: Notify,
}

impl DriftAlarm {
    fn raise(&self, family: IpFamily, suspicion: Suspicion) {
        self.suspicions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(family)
            .or_default()
            .merge(suspicion);
        self.raised.notify_one();
    }

    /// Waits until some family's alarm is raised (at once when one was raised since the
    /// last wait).
    pub async fn raised(&self) {
        self.raised.notified().await;
    }

    /// What was suspected of `family`'s rules since the last take, once.
    pub fn take(&self, family: IpFamily) -> Option<Suspicion> {
        self.suspicions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&family)
    }
}

/// Listens to the kernel's announcements on a thread of its own, in the calling
/// thread's network namespace, raising the alarm of each family in `watched` whose rules
/// someone else changed.
pub fn start(
    watched: Vec<(IpFamily, Written)>,
    metrics: Metrics,
) -> Result<Arc<DriftAlarm>, KernelError> {
    let monitor = Monitor::open()?;
    let alarm = Arc::new(DriftAlarm::default());
    let raising = Arc::clone(&alarm);
    std::thread::Builder::new()
        .name("ruleset-events".into())
        .spawn(move || listen(monitor, &watched, &raising, &metrics))
        .map_err(KernelError::Open)?;
    Ok(alarm)
}

/// The thread's loop. When announcements were lost (the socket's queue overflowed) or the
/// socket failed, every family's alarm is raised: nothing may be missed unchecked.
fn listen(
    mut monitor: Monitor,
    watched: &[(IpFamily, Written)],
    alarm: &DriftAlarm,
    metrics: &Metrics,
) {
    let raise_all = || {
        for (family, _) in watched {
            alarm.raise(*family, Suspicion::everywhere());
        }
    };
    loop {
        let changes = match monitor.receive() {
            Ok(Announcement::Changes(changes)) => changes,
            Ok(Announcement::Lost) => {
                tracing::debug!("ruleset announcements were lost; reading back every family");
                raise_all();
                continue;
            }
            Err(error) => {
                tracing::warn!(%error, "reading ruleset announcements failed; opening the socket again");
                raise_all();
                std::thread::sleep(REOPEN_DELAY);
                match Monitor::open() {
                    Ok(reopened) => monitor = reopened,
                    Err(error) => {
                        tracing::error!(%error, "ruleset announcements are no longer read; drift is found by the periodic read-back only");
                        return;
                    }
                }
                continue;
            }
        };
        let foreign: Vec<&Change> = changes
            .iter()
            .filter(|change| !is_own_port(change.port))
            .collect();
        for &(family, written) in watched {
            let concerning: Vec<&&Change> = foreign
                .iter()
                .filter(|change| concerns(written, family, change))
                .collect();
            let Some(first) = concerning.first() else {
                continue;
            };
            let count = concerning.len();
            metrics.foreign_ruleset_changes.inc_by(count as u64);
            tracing::info!(
                %family,
                table = first.table,
                chain = first.chain,
                object = ?first.object,
                removal = first.removal,
                port = first.port,
                count,
                "someone else changed our rules; reading them back"
            );
            let mut suspicion = Suspicion::default();
            for change in concerning {
                suspicion.merge(Suspicion::of(written, change));
            }
            alarm.raise(family, suspicion);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(table: &str, chain: Option<&str>, object: Object, removal: bool) -> Change {
        Change {
            port: 1,
            family: IpFamily::V4,
            table: table.into(),
            chain: chain.map(Into::into),
            object,
            removal,
        }
    }

    #[test]
    fn anything_in_our_nftables_table_of_the_family_concerns_it() {
        let element = change("tandem", None, Object::Set, false);
        assert!(concerns(Written::NftablesTable, IpFamily::V4, &element));
        assert!(!concerns(Written::NftablesTable, IpFamily::V6, &element));
        let other = change("filter", Some("INPUT"), Object::Rule, true);
        assert!(!concerns(Written::NftablesTable, IpFamily::V4, &other));
    }

    #[test]
    fn on_iptables_nft_our_chains_and_removals_from_built_in_chains_concern_it() {
        let cases = [
            (
                change("nat", Some("KUBE-SEP-ABC"), Object::Rule, false),
                true,
            ),
            (
                change("nat", Some("KUBE-SERVICES"), Object::Chain, true),
                true,
            ),
            (change("nat", Some("PREROUTING"), Object::Rule, true), true),
            (change("filter", Some("FORWARD"), Object::Rule, true), true),
            (change("nat", None, Object::Table, true), true),
            // Others' rules beside ours, others' chains, other tables.
            (
                change("nat", Some("POSTROUTING"), Object::Rule, false),
                false,
            ),
            (change("nat", Some("CNI-1234"), Object::Rule, true), false),
            (change("nat", None, Object::Table, false), false),
            (
                change("mangle", Some("KUBE-SEP-ABC"), Object::Rule, true),
                false,
            ),
            (change("tandem", None, Object::Set, true), false),
        ];
        for (change, expected) in cases {
            assert_eq!(
                concerns(Written::IptablesNft, IpFamily::V4, &change),
                expected,
                "{change:?}"
            );
        }
    }

    #[test]
    fn an_iptables_chain_change_is_suspected_there_anything_else_everywhere() {
        let rule = change("nat", Some("KUBE-SEP-ABC"), Object::Rule, true);
        let jump = change("filter", Some("FORWARD"), Object::Rule, true);
        let mut suspicion = Suspicion::of(Written::IptablesNft, &rule);
        suspicion.merge(Suspicion::of(Written::IptablesNft, &jump));
        assert_eq!(
            suspicion,
            Suspicion {
                everywhere: false,
                chains: BTreeMap::from([
                    (Table::Filter, BTreeSet::from(["FORWARD".to_owned()])),
                    (Table::Nat, BTreeSet::from(["KUBE-SEP-ABC".to_owned()])),
                ]),
            }
        );
        let table = change("nat", None, Object::Table, true);
        assert!(Suspicion::of(Written::IptablesNft, &table).everywhere);
        let element = change("tandem", None, Object::Set, false);
        assert!(Suspicion::of(Written::NftablesTable, &element).everywhere);
        suspicion.merge(Suspicion::everywhere());
        assert!(suspicion.everywhere);
    }

    #[test]
    fn recorded_ports_are_ours_until_many_newer_ones_push_them_out() {
        record_own_port(4_000_001);
        assert!(is_own_port(4_000_001));
        assert!(!is_own_port(4_000_002));
        for port in 0..REMEMBERED_PORTS as u32 {
            record_own_port(5_000_000 + port);
        }
        assert!(!is_own_port(4_000_001));
    }
}
