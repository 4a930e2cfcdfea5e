//! The L2 announcement mode, for networks without BGP: exactly one edge of an edge cluster
//! owns each VIP it can forward, through etcd, and holds it on the clients' network
//! (`cloud_mock_dataplane::L2Device`: the address, gratuitous ARP).
//!
//! Each edge keeps one etcd lease of [`LEASE_TTL`] alive. An offered VIP that nobody owns
//! is claimed with a transaction that creates `PREFIX/l2/VIP` (its value the edge's name)
//! only if it does not exist, attached to the lease; a VIP the edge can no longer forward
//! is released. When the owner dies, etcd removes its keys as its lease expires, and the
//! other edges claim them.
//!
//! Under no partition do two edges answer for one VIP: an edge counts its lease valid
//! only until [`LEASE_TTL`] less [`SAFETY_MARGIN`] after it *sent* the last keep-alive
//! etcd answered, which is before etcd can expire it (etcd renews no earlier than it
//! receives the request), and gives every VIP up at that moment if no newer answer came:
//! cut off from etcd, an edge stops answering within one lease period, before another can
//! claim the VIP.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use cloud_mock_dataplane::L2Device;
use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::store::etcd::connect;
use crate::store::{EtcdSettings, StoreError};

/// Why a round of ownership failed (the next round tries again).
#[derive(Debug, thiserror::Error)]
enum RoundError {
    #[error(transparent)]
    Connect(#[from] StoreError),
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
}

/// The ownership lease's time to live: an edge that dies loses its VIPs this long after.
pub const LEASE_TTL: Duration = Duration::from_secs(3);
/// An edge gives its VIPs up this long before etcd could expire its lease.
const SAFETY_MARGIN: Duration = Duration::from_secs(1);
/// How often an edge renews its lease and claims what nobody owns.
const ROUND: Duration = Duration::from_millis(500);
/// How often the held VIPs are announced again.
const ANNOUNCE_EVERY: Duration = Duration::from_secs(5);

/// An owner of a VIP, as its key says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Owner {
    pub edge: String,
    pub lease: i64,
}

/// What one round writes, and what this edge owns after it.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Ownership {
    pub claim: Vec<IpAddr>,
    pub release: Vec<IpAddr>,
    pub owned: BTreeSet<IpAddr>,
}

/// The round's decision for edge `me` under `lease`: claim every offered VIP nobody owns,
/// release every VIP it owns but cannot forward, and own the offered VIPs its keys hold
/// under this lease (a key of an earlier lease of its own expires with that lease).
pub(crate) fn decide(
    offered: &BTreeSet<IpAddr>,
    owners: &BTreeMap<IpAddr, Owner>,
    me: &str,
    lease: i64,
) -> Ownership {
    let mine = |owner: &Owner| owner.edge == me && owner.lease == lease;
    Ownership {
        claim: offered
            .iter()
            .filter(|vip| !owners.contains_key(vip))
            .copied()
            .collect(),
        release: owners
            .iter()
            .filter(|(vip, owner)| mine(owner) && !offered.contains(vip))
            .map(|(&vip, _)| vip)
            .collect(),
        owned: owners
            .iter()
            .filter(|(vip, owner)| mine(owner) && offered.contains(vip))
            .map(|(&vip, _)| vip)
            .collect(),
    }
}

/// A lease this edge holds, and until when it may count on it.
struct Held {
    id: i64,
    keeper: etcd_client::LeaseKeeper,
    answers: etcd_client::LeaseKeepAliveStream,
    valid_until: Instant,
}

/// Owns VIPs for this edge until cancelled.
pub struct L2Owner {
    settings: EtcdSettings,
    prefix: String,
    device: L2Device,
    /// The VIPs this edge can forward.
    offers: watch::Receiver<BTreeSet<IpAddr>>,
}

impl L2Owner {
    pub fn new(
        settings: EtcdSettings,
        device: L2Device,
        offers: watch::Receiver<BTreeSet<IpAddr>>,
    ) -> Self {
        let prefix = format!("{}/l2/", settings.prefix.trim_end_matches('/'));
        Self {
            settings,
            prefix,
            device,
            offers,
        }
    }

    /// Claims, holds and releases VIPs as the offers and the other edges allow, until
    /// `cancel`; then gives every VIP up and revokes the lease, so that another edge
    /// takes them at once.
    pub async fn run(mut self, cancel: CancellationToken) {
        let mut offers = self.offers.clone();
        if let Err(error) = self.device.prepare().await {
            warn!(%error, "the L2 device's settings could not be set; other edges' VIPs may be answered here");
        }
        let mut client: Option<Client> = None;
        let mut held: Option<Held> = None;
        let mut announced = Instant::now();
        loop {
            let deadline = held.as_ref().map(|held| held.valid_until);
            let offered = offers.borrow_and_update().clone();
            let round = self.round(&mut client, &mut held, &offered);
            tokio::select! {
                () = cancel.cancelled() => break,
                () = sleep_until_some(deadline) => {
                    warn!("no answer from etcd within the lease: every VIP given up");
                    held = None;
                    self.device.hold(&BTreeSet::new()).await;
                }
                owned = tokio::time::timeout(ROUND, round) => match owned {
                    Ok(Ok(owned)) => self.device.hold(&owned).await,
                    Ok(Err(error)) => warn!(%error, "an L2 ownership round failed"),
                    Err(_) => warn!("an L2 ownership round went unanswered"),
                }
            }
            if announced.elapsed() >= ANNOUNCE_EVERY {
                self.device.announce_held().await;
                announced = Instant::now();
            }
            tokio::select! {
                () = cancel.cancelled() => break,
                () = sleep_until_some(held.as_ref().map(|held| held.valid_until)) => {}
                () = tokio::time::sleep(ROUND) => {}
                _ = offers.changed() => {}
            }
        }
        self.device.hold(&BTreeSet::new()).await;
        if let (Some(mut client), Some(held)) = (client, held) {
            let _ = tokio::time::timeout(ROUND, client.lease_revoke(held.id)).await;
        }
        info!("L2 ownership ended: every VIP given up");
    }

    /// One round: the lease kept (or a new one granted), the owners read, the claims and
    /// releases written; the VIPs this edge owns after it.
    async fn round(
        &self,
        client: &mut Option<Client>,
        held: &mut Option<Held>,
        offered: &BTreeSet<IpAddr>,
    ) -> Result<BTreeSet<IpAddr>, RoundError> {
        let client = match client {
            Some(client) => client,
            None => client.insert(connect(&self.settings, Some(ROUND)).await?),
        };
        let lease = self.keep(client, held).await?;
        let listed = client
            .get(self.prefix.as_str(), Some(GetOptions::new().with_prefix()))
            .await?;
        let owners: BTreeMap<IpAddr, Owner> = listed
            .kvs()
            .iter()
            .filter_map(|kv| {
                let vip = kv
                    .key_str()
                    .ok()?
                    .strip_prefix(self.prefix.as_str())?
                    .parse()
                    .ok()?;
                let edge = kv.value_str().ok()?.to_owned();
                Some((
                    vip,
                    Owner {
                        edge,
                        lease: kv.lease(),
                    },
                ))
            })
            .collect();
        let me = self.settings.edge_name.as_str();
        let decided = decide(offered, &owners, me, lease);
        let mut owned = decided.owned;
        for vip in decided.claim {
            let key = format!("{}{vip}", self.prefix);
            let claim = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(
                    key,
                    me,
                    Some(PutOptions::new().with_lease(lease)),
                )]);
            if client.txn(claim).await?.succeeded() {
                info!(%vip, edge = me, "this edge owns the VIP");
                owned.insert(vip);
            }
        }
        for vip in decided.release {
            let key = format!("{}{vip}", self.prefix);
            let release = Txn::new()
                .when([Compare::lease(key.clone(), CompareOp::Equal, lease)])
                .and_then([TxnOp::delete(key, None)]);
            client.txn(release).await?;
            info!(%vip, edge = me, "VIP released: this edge cannot forward it");
        }
        Ok(owned)
    }

    /// Keeps the held lease alive, or grants one; its id.
    async fn keep(
        &self,
        client: &mut Client,
        held: &mut Option<Held>,
    ) -> Result<i64, etcd_client::Error> {
        if let Some(lease) = held.as_mut() {
            let sent = Instant::now();
            lease.keeper.keep_alive().await?;
            match lease.answers.message().await? {
                Some(answer) if answer.ttl() > 0 => {
                    let ttl = Duration::from_secs(u64::try_from(answer.ttl()).unwrap_or(0));
                    lease.valid_until = sent + ttl.saturating_sub(SAFETY_MARGIN);
                    return Ok(lease.id);
                }
                _ => {
                    warn!("the L2 lease expired: its VIPs are no longer this edge's");
                    *held = None;
                }
            }
        }
        let sent = Instant::now();
        let ttl = i64::try_from(LEASE_TTL.as_secs()).unwrap_or(3);
        let granted = client.lease_grant(ttl, None).await?;
        let (keeper, answers) = client.lease_keep_alive(granted.id()).await?;
        let ttl = Duration::from_secs(u64::try_from(granted.ttl()).unwrap_or(0));
        let lease = held.insert(Held {
            id: granted.id(),
            keeper,
            answers,
            valid_until: sent + ttl.saturating_sub(SAFETY_MARGIN),
        });
        Ok(lease.id)
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vip(host: u8) -> IpAddr {
        IpAddr::from([198, 51, 100, host])
    }

    #[test]
    fn an_edge_claims_the_free_releases_what_it_cannot_forward_and_owns_the_rest() {
        let owner = |edge: &str, lease| Owner {
            edge: edge.to_owned(),
            lease,
        };
        let owners = BTreeMap::from([
            (vip(1), owner("a", 7)),
            (vip(2), owner("b", 9)),
            (vip(3), owner("a", 7)),
            (vip(4), owner("a", 6)),
        ]);
        let offered = BTreeSet::from([vip(1), vip(2), vip(4), vip(5)]);
        assert_eq!(
            decide(&offered, &owners, "a", 7),
            Ownership {
                claim: vec![vip(5)],
                release: vec![vip(3)],
                owned: BTreeSet::from([vip(1)]),
            },
            "2 is b's; 4 is under an old lease of a's, which expires with it"
        );
        assert_eq!(
            decide(&BTreeSet::new(), &BTreeMap::new(), "a", 7),
            Ownership::default()
        );
    }
}
