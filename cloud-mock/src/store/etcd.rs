//! The etcd backend, for a cluster of edges that share one store, kept the way the
//! Kubernetes API server keeps its own objects:
//! - every edge lists the store once, then watches it from the revision it listed, and
//!   lists again when that revision was compacted away; its in-memory copy serves every
//!   read and every data-plane pass, so a cut from etcd stops writes, not traffic;
//! - a write is decided against that copy and committed as one etcd transaction that
//!   also rewrites a guard key and succeeds only if the guard is at the revision the copy
//!   has: any other edge's write in between fails the compare, and the write is decided
//!   again on the newer copy (optimistic concurrency, serializable across edges). Only a
//!   committed transaction is acknowledged, after this edge's copy has applied it;
//! - the work that must happen once (the lifecycle's transitions) runs on the edge that
//!   holds etcd's election, under a lease it keeps alive.
//!
//! Keys, under `PREFIX/state/`: `lb/ID`, `vip/ADDRESS`, `key/IDEMPOTENCY-KEY` (the id as
//! its value), `nodepool/NAME` (JSON values as the embedded store keeps them) and `guard`;
//! the election is `PREFIX/leader`.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity,
    KeyValue, TlsOptions, Txn as EtcdTxn, TxnOp, TxnOpResponse, WatchOptions,
};
use ipnet::IpNet;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::embedded::{decode, encode};
use super::state::{Change, State};
use super::txn::Txn;
use super::{Cached, Shared, StoreError};
use crate::pools::VipPools;

/// Records per transaction: etcd refuses more than 128 operations in one (its default
/// `--max-txn-ops`), and the guard takes one.
pub(crate) const MAX_RECORDS_PER_TXN: usize = 100;

/// How many times a write is decided again after other edges wrote first.
const MAX_ATTEMPTS: u32 = 16;

/// Keys per page when the store is listed.
const LIST_PAGE: i64 = 500;

/// How long one request to etcd may take before the edge calls it unavailable.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a committed write waits for the watch to bring it into this edge's copy.
const APPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// The election lease's time to live: a leader cut off from etcd stops leading within it.
const LEASE_TTL_SECS: i64 = 3;

/// Backoff between two attempts to watch or campaign again after a failure.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(3);

/// How to reach etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdSettings {
    /// Client URLs of the members (`http://host:2379`, or `https://` with `tls`).
    pub endpoints: Vec<String>,
    /// The key prefix under which this edge cluster keeps its store.
    pub prefix: String,
    pub tls: Option<EtcdTls>,
    /// etcd's authentication, when it is enabled: a user and its password's file.
    pub user: Option<(String, PathBuf)>,
    /// This edge's name, in the guard it writes and the election it enters.
    pub edge_name: String,
}

/// The PEM files of an etcd connection over TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca_file: PathBuf,
    /// A client certificate and its key, for etcd's `--client-cert-auth`.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// How long a write keeps trying to reach etcd before it is refused as unavailable:
/// longer than an election of a new etcd leader takes (about a second by default).
const SEND_BUDGET: Duration = Duration::from_secs(6);
/// How long a write keeps trying on an edge whose lease keep-alives go unanswered: longer
/// than etcd takes to elect a leader, and short enough that a client has time left to
/// try another edge.
const UNREACHABLE_BUDGET: Duration = Duration::from_secs(2);
/// HTTP/2 pings on a connection with streams open: above etcd's default
/// `--grpc-keepalive-min-time` (5 s), with room for timer jitter.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(6);

fn unavailable(err: etcd_client::Error) -> StoreError {
    StoreError::Unavailable {
        message: err.to_string(),
    }
}

/// The keys of one edge cluster's store.
#[derive(Debug, Clone)]
struct Keys {
    state: String,
}

/// What one watched or listed key is.
enum Decoded {
    Record(Change),
    Guard,
    /// Not a key of the store (written by someone else under the prefix): ignored.
    Foreign,
}

impl Keys {
    fn new(prefix: &str) -> Self {
        Self {
            state: format!("{}/state/", prefix.trim_end_matches('/')),
        }
    }

    fn guard(&self) -> String {
        format!("{}guard", self.state)
    }

    fn election(&self) -> String {
        format!("{}leader", self.state.trim_end_matches("state/"))
    }

    /// The transaction's operations that write `change`.
    fn encode(&self, change: &Change) -> Result<Vec<TxnOp>, StoreError> {
        let mut ops = Vec::with_capacity(change.len());
        let mut write = |key: String, value: Option<Vec<u8>>| match value {
            Some(value) => ops.push(TxnOp::put(key, value, None)),
            None => ops.push(TxnOp::delete(key, None)),
        };
        for (id, lb) in &change.load_balancers {
            let value = lb
                .as_ref()
                .map(|lb| encode(lb, "load balancer"))
                .transpose()?;
            write(format!("{}lb/{id}", self.state), value);
        }
        for (vip, holders) in &change.holders {
            let value = holders
                .as_ref()
                .map(|holders| encode(holders, "VIP holders"))
                .transpose()?;
            write(format!("{}vip/{vip}", self.state), value);
        }
        for (key, id) in &change.idempotency_keys {
            let value = id.as_ref().map(|id| id.clone().into_bytes());
            write(format!("{}key/{key}", self.state), value);
        }
        for (name, pool) in &change.node_pools {
            let value = pool
                .as_ref()
                .map(|pool| encode(pool, "node pool"))
                .transpose()?;
            write(format!("{}nodepool/{name}", self.state), value);
        }
        Ok(ops)
    }

    /// The record `key` holds (`value`), or its deletion (`None`).
    fn decode(&self, key: &[u8], value: Option<&[u8]>) -> Result<Decoded, StoreError> {
        let text = String::from_utf8_lossy(key);
        let Some(name) = text.strip_prefix(self.state.as_str()) else {
            return Ok(Decoded::Foreign);
        };
        if name == "guard" {
            return Ok(Decoded::Guard);
        }
        let Some((kind, id)) = name.split_once('/') else {
            return Ok(Decoded::Foreign);
        };
        let id = id.to_owned();
        let mut change = Change::default();
        match kind {
            "lb" => {
                let lb = value.map(|v| decode(v, || text.to_string())).transpose()?;
                change.load_balancers.insert(id, lb);
            }
            "vip" => {
                let Ok(vip) = id.parse::<IpAddr>() else {
                    return Ok(Decoded::Foreign);
                };
                let holders = value.map(|v| decode(v, || text.to_string())).transpose()?;
                change.holders.insert(vip, holders);
            }
            "key" => {
                let lb_id = value.map(|v| String::from_utf8_lossy(v).into_owned());
                change.idempotency_keys.insert(id, lb_id);
            }
            "nodepool" => {
                let pool = value.map(|v| decode(v, || text.to_string())).transpose()?;
                change.node_pools.insert(id, pool);
            }
            _ => return Ok(Decoded::Foreign),
        }
        Ok(Decoded::Record(change))
    }
}

/// Applies one watched or listed key to `cached`; whether a record changed. A value that
/// cannot be decoded poisons the store (writes are refused: a VIP whose holders cannot be
/// read must not be handed out again) until the key is written anew or deleted.
fn apply_key(keys: &Keys, cached: &mut Cached, kv: &KeyValue, deleted: bool, changes: &mut Change) {
    let value = (!deleted).then(|| kv.value());
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    match keys.decode(kv.key(), value) {
        Ok(Decoded::Record(change)) => {
            cached.poisoned.remove(&key);
            changes.extend(change);
        }
        Ok(Decoded::Guard) => cached.guard_revision = kv.mod_revision(),
        Ok(Decoded::Foreign) => {}
        Err(error) => {
            tracing::error!(%key, %error, "a record in etcd cannot be decoded; writes are refused until it is repaired");
            cached.poisoned.insert(key, error.to_string());
        }
    }
}

/// The edge's connection to etcd.
pub(crate) struct EtcdBackend {
    client: Client,
    keys: Keys,
    edge_name: String,
    /// The revision this edge's copy has applied, for writes waiting on their own.
    applied: watch::Receiver<i64>,
    /// This edge's writes take turns: they would only fail each other's compare.
    writer: tokio::sync::Mutex<()>,
    /// Whether etcd answers this edge's lease keep-alives: an edge cut off from etcd
    /// refuses writes at once instead of after a whole [`SEND_BUDGET`] each.
    reachable: watch::Receiver<bool>,
}

/// Connects to etcd; requests time out after `timeout` (elections and leases wait
/// without one).
pub(crate) async fn connect(
    settings: &EtcdSettings,
    timeout: Option<Duration>,
) -> Result<Client, StoreError> {
    // etcd's gRPC server closes a connection (GOAWAY "too_many_pings") that pings more
    // often than its --grpc-keepalive-min-time (5 s by default), or at all without a
    // stream open: every watch and election then broke every few seconds.
    let mut options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(3))
        .with_keep_alive(KEEP_ALIVE_INTERVAL, Duration::from_secs(3))
        .with_keep_alive_while_idle(false);
    if let Some(timeout) = timeout {
        options = options.with_timeout(timeout);
    }
    if let Some(tls) = &settings.tls {
        let read = |path: &PathBuf| {
            std::fs::read(path)
                .map_err(|source| StoreError::Etcd(format!("reading {}: {source}", path.display())))
        };
        let mut config =
            TlsOptions::new().ca_certificate(Certificate::from_pem(read(&tls.ca_file)?));
        if let Some((cert, key)) = &tls.identity {
            config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        options = options.with_tls(config);
    }
    if let Some((user, password_file)) = &settings.user {
        let password = std::fs::read_to_string(password_file).map_err(|source| {
            StoreError::Etcd(format!("reading {}: {source}", password_file.display()))
        })?;
        options = options.with_user(user.clone(), password.trim_end().to_owned());
    }
    Client::connect(&settings.endpoints, Some(options))
        .await
        .map_err(unavailable)
}

impl EtcdBackend {
    /// Connects, lists the store into `shared`, and starts the watch and the election
    /// (until `cancel`); the receiver says whether this edge leads.
    pub async fn open(
        settings: &EtcdSettings,
        cidrs: Vec<IpNet>,
        shared: Arc<Shared>,
        cancel: CancellationToken,
    ) -> Result<(Self, watch::Receiver<bool>), StoreError> {
        let client = connect(settings, Some(REQUEST_TIMEOUT)).await?;
        let keys = Keys::new(&settings.prefix);
        let listed = list(&client, &keys, &cidrs).await?;
        let revision = listed.applied_revision;
        shared.update(|cached| {
            *cached = listed;
            true
        });
        let (applied_tx, applied) = watch::channel(revision);
        tokio::spawn(watch_store(
            client.clone(),
            keys.clone(),
            cidrs,
            shared,
            applied_tx,
            cancel.clone(),
        ));
        let (leader_tx, leader) = watch::channel(false);
        // It answered the list just now.
        let (reachable_tx, reachable) = watch::channel(true);
        let election_client = connect(settings, None).await?;
        tokio::spawn(lead(
            election_client,
            keys.election(),
            settings.edge_name.clone(),
            Term {
                leader: leader_tx,
                reachable: reachable_tx,
            },
            cancel,
        ));
        Ok((
            Self {
                client,
                keys,
                edge_name: settings.edge_name.clone(),
                applied,
                writer: tokio::sync::Mutex::new(()),
                reachable,
            },
            leader,
        ))
    }

    /// Decides with `decide` on this edge's copy and commits it if no other edge wrote
    /// since; decides again on the newer copy if one did.
    pub async fn write<T>(
        &self,
        shared: &Shared,
        pools: &VipPools,
        decide: &(impl Fn(&mut Txn<'_>) -> Result<T, StoreError> + Sync),
    ) -> Result<T, StoreError> {
        let _turn = self.writer.lock().await;
        for _ in 0..MAX_ATTEMPTS {
            let (result, change, guard) = {
                let cached = shared.read();
                if let Some((key, message)) = cached.poisoned.iter().next() {
                    return Err(StoreError::Poisoned {
                        key: key.clone(),
                        message: message.clone(),
                    });
                }
                let mut txn = Txn::new(&cached.state, pools);
                let result = decide(&mut txn)?;
                (result, txn.into_change(), cached.guard_revision)
            };
            if change.is_empty() {
                return Ok(result);
            }
            // The guard holds a value of this write's own: an answer lost with its
            // commit (a member or the leader gone mid-request) is found in the guard
            // when the write is sent again, instead of being decided and made twice.
            let write_id = format!("{}/{:016x}", self.edge_name, rand::random::<u64>());
            let guard_key = self.keys.guard();
            let mut ops = self.keys.encode(&change)?;
            ops.push(TxnOp::put(guard_key.clone(), write_id.clone(), None));
            let txn = EtcdTxn::new()
                .when([Compare::mod_revision(
                    guard_key.clone(),
                    CompareOp::Equal,
                    guard,
                )])
                .and_then(ops)
                .or_else([TxnOp::get(guard_key, None)]);
            let response = self.send(txn).await?;
            let current_guard = response.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => get.kvs().first().cloned(),
                _ => None,
            });
            let committed = if response.succeeded() {
                Some(response.header().map_or(0, |header| header.revision()))
            } else {
                current_guard
                    .as_ref()
                    .filter(|kv| kv.value() == write_id.as_bytes())
                    .map(KeyValue::mod_revision)
            };
            if let Some(revision) = committed {
                self.wait_applied(|applied| *applied >= revision).await;
                return Ok(result);
            }
            // Another edge wrote first: wait until this copy has its write, then decide
            // again on it.
            let newer = current_guard.as_ref().map_or(0, KeyValue::mod_revision);
            self.wait_applied(|_| shared.read().guard_revision >= newer)
                .await;
        }
        Err(StoreError::Contended {
            attempts: MAX_ATTEMPTS,
        })
    }

    /// Sends `txn` until etcd answers, within [`SEND_BUDGET`]: a member that cannot be
    /// connected to (down, or just back and not yet known so by the client's balancer),
    /// a leader being elected, a request cut off. Sending it again is safe: its compare
    /// lets it commit at most once, and [`Self::write`] recognises its own commit. An
    /// edge whose lease keep-alives go unanswered (cut off from etcd) tries only for
    /// [`UNREACHABLE_BUDGET`], so that it refuses writes promptly and the caller turns to
    /// another edge.
    async fn send(&self, txn: EtcdTxn) -> Result<etcd_client::TxnResponse, StoreError> {
        let reachable = *self.reachable.borrow();
        let budget = if reachable {
            SEND_BUDGET
        } else {
            UNREACHABLE_BUDGET
        };
        let deadline = tokio::time::Instant::now() + budget;
        let mut backoff = RETRY_MIN;
        loop {
            let mut kv = self.client.kv_client();
            match tokio::time::timeout_at(deadline, kv.txn(txn.clone())).await {
                Ok(Err(error)) if tokio::time::Instant::now() + backoff < deadline => {
                    tracing::debug!(%error, "etcd did not answer the write; sending it again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RETRY_MAX);
                }
                Ok(sent) => return sent.map_err(unavailable),
                Err(_) => {
                    return Err(StoreError::Unavailable {
                        message: match reachable {
                            true => format!("etcd did not answer within {budget:?}"),
                            false => "this edge cannot reach etcd (its lease keep-alives go \
                                      unanswered): another edge of the cluster takes writes"
                                .to_owned(),
                        },
                    });
                }
            }
        }
    }

    /// Waits until `done` holds of the applied revision, at most [`APPLY_TIMEOUT`]: a
    /// watch that lags that long is logged, and the caller goes on.
    async fn wait_applied(&self, done: impl Fn(&i64) -> bool) {
        let mut applied = self.applied.clone();
        if tokio::time::timeout(APPLY_TIMEOUT, applied.wait_for(|revision| done(revision)))
            .await
            .is_err()
        {
            tracing::warn!("the etcd watch has not brought this edge's own write yet");
        }
    }
}

/// The whole store at one revision, listed in pages.
async fn list(client: &Client, keys: &Keys, cidrs: &[IpNet]) -> Result<Cached, StoreError> {
    let mut kv = client.kv_client();
    let end = prefix_end(&keys.state);
    let mut cached = Cached::empty(State::new(cidrs.iter().copied()));
    let mut records = Change::default();
    let mut from = keys.state.clone().into_bytes();
    let mut revision = 0;
    loop {
        let mut options = GetOptions::new()
            .with_range(end.clone())
            .with_limit(LIST_PAGE);
        if revision > 0 {
            options = options.with_revision(revision);
        }
        let page = kv
            .get(from.clone(), Some(options))
            .await
            .map_err(unavailable)?;
        if revision == 0 {
            revision = page.header().map_or(0, |header| header.revision());
        }
        for kv in page.kvs() {
            apply_key(keys, &mut cached, kv, false, &mut records);
        }
        match page.kvs().last() {
            Some(last) if page.more() => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => break,
        }
    }
    cached.state = State::loaded(cidrs.iter().copied(), records);
    cached.applied_revision = revision;
    Ok(cached)
}

/// The first key after every key that starts with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

/// How one watch ended.
enum WatchEnd {
    /// The revision to resume from was compacted: list again.
    Compacted,
    Failed(String),
}

/// Keeps `shared` up to date with etcd until `cancel`: watches from the revision applied,
/// resumes after a failure, lists again after a compaction.
async fn watch_store(
    client: Client,
    keys: Keys,
    cidrs: Vec<IpNet>,
    shared: Arc<Shared>,
    applied: watch::Sender<i64>,
    cancel: CancellationToken,
) {
    let mut backoff = RETRY_MIN;
    loop {
        let from = shared.read().applied_revision + 1;
        let ended = tokio::select! {
            () = cancel.cancelled() => return,
            ended = watch_from(&client, &keys, &shared, &applied, from) => ended,
        };
        match ended {
            WatchEnd::Compacted => {
                tracing::warn!(
                    from,
                    "the etcd revision to resume from was compacted; listing again"
                );
                match list(&client, &keys, &cidrs).await {
                    Ok(listed) => {
                        let revision = listed.applied_revision;
                        shared.update(|cached| {
                            *cached = listed;
                            true
                        });
                        applied.send_replace(revision);
                        backoff = RETRY_MIN;
                        continue;
                    }
                    Err(error) => tracing::warn!(%error, "listing the store failed; retrying"),
                }
            }
            WatchEnd::Failed(error) => {
                tracing::warn!(%error, from, "the etcd watch ended; resuming");
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

/// One watch from revision `from`, applied as it comes.
async fn watch_from(
    client: &Client,
    keys: &Keys,
    shared: &Shared,
    applied: &watch::Sender<i64>,
    from: i64,
) -> WatchEnd {
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(from)
        .with_progress_notify();
    let mut stream = match client
        .watch_client()
        .watch(keys.state.clone(), Some(options))
        .await
    {
        Ok(stream) => stream,
        Err(error) => return WatchEnd::Failed(error.to_string()),
    };
    loop {
        let response = match stream.message().await {
            Ok(Some(response)) => response,
            Ok(None) => return WatchEnd::Failed("the watch stream closed".into()),
            Err(error) => return WatchEnd::Failed(error.to_string()),
        };
        if response.canceled() {
            if response.compact_revision() > 0 {
                return WatchEnd::Compacted;
            }
            return WatchEnd::Failed(format!(
                "the watch was canceled: {}",
                response.cancel_reason()
            ));
        }
        // An answer with events covers the revisions of its events (a batch catching up
        // may stop short of the header's); one without, other than the first, is a
        // progress notification: nothing changed up to its header's revision.
        let revision = match response
            .events()
            .iter()
            .filter_map(|e| e.kv())
            .map(KeyValue::mod_revision)
            .max()
        {
            Some(revision) => revision,
            None if response.created() => continue,
            None => response.header().map_or(0, |header| header.revision()),
        };
        shared.update(|cached| {
            let mut change = Change::default();
            for event in response.events() {
                if let Some(kv) = event.kv() {
                    let deleted = event.event_type() == EventType::Delete;
                    apply_key(keys, cached, kv, deleted, &mut change);
                }
            }
            cached.applied_revision = cached.applied_revision.max(revision);
            let records_changed = !change.is_empty();
            cached.state.apply(change);
            records_changed
        });
        applied.send_replace(revision);
    }
}

/// Campaigns in `election` as `edge_name` until `cancel`, saying in `leader` whether this
/// edge leads. Leadership is held under a lease kept alive every third of its time to
/// live; a keep-alive that fails or goes unanswered ends it at once, so that an edge cut
/// off from etcd stops leading before its lease expires and another edge is elected.
async fn lead(
    mut client: Client,
    election: String,
    edge_name: String,
    term: Term,
    cancel: CancellationToken,
) {
    let mut backoff = RETRY_MIN;
    loop {
        let ended = campaign(&mut client, &election, &edge_name, &term, &cancel).await;
        term.leader.send_replace(false);
        term.reachable.send_replace(false);
        if cancel.is_cancelled() {
            return;
        }
        tracing::warn!(error = %ended, "leadership of the edge cluster ended; campaigning again");
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

/// What the election says of this edge: whether it leads, and whether etcd answers its
/// lease keep-alives.
struct Term {
    leader: watch::Sender<bool>,
    reachable: watch::Sender<bool>,
}

/// One term: a lease, the campaign, leadership until the lease is lost or `cancel`; says
/// why it ended. The lease is revoked on the way out, so that a stopped edge hands the
/// election on at once rather than when the lease expires.
async fn campaign(
    client: &mut Client,
    election: &str,
    edge_name: &str,
    term: &Term,
    cancel: &CancellationToken,
) -> String {
    let lease = match client.lease_grant(LEASE_TTL_SECS, None).await {
        Ok(lease) => lease.id(),
        Err(error) => return format!("granting a lease: {error}"),
    };
    term.reachable.send_replace(true);
    let (mut keeper, mut answers) = match client.lease_keep_alive(lease).await {
        Ok(pair) => pair,
        Err(error) => return format!("keeping the lease alive: {error}"),
    };
    let period = Duration::from_millis(u64::try_from(LEASE_TTL_SECS * 1000 / 3).unwrap_or(1000));
    let keep_alive = async {
        loop {
            let round = async {
                keeper.keep_alive().await?;
                answers.message().await
            };
            match tokio::time::timeout(period, round).await {
                Ok(Ok(Some(answer))) if answer.ttl() > 0 => {
                    term.reachable.send_replace(true);
                }
                Ok(Ok(_)) => return "the lease expired".to_owned(),
                Ok(Err(error)) => return format!("keeping the lease alive: {error}"),
                Err(_) => return "a lease keep-alive went unanswered".to_owned(),
            }
            tokio::time::sleep(period).await;
        }
    };
    tokio::pin!(keep_alive);
    let mut campaigner = client.clone();
    let ended = tokio::select! {
        ended = &mut keep_alive => ended,
        () = cancel.cancelled() => "stopping".to_owned(),
        elected = campaigner.campaign(election, edge_name, lease) => match elected {
            Err(error) => format!("campaigning: {error}"),
            Ok(_) => {
                tracing::info!(edge = edge_name, "this edge leads the edge cluster");
                term.leader.send_replace(true);
                tokio::select! {
                    ended = &mut keep_alive => ended,
                    () = cancel.cancelled() => "stopping".to_owned(),
                }
            }
        },
    };
    term.leader.send_replace(false);
    // Whatever the lease's fate, free the election at once.
    let _ = tokio::time::timeout(period, client.lease_revoke(lease)).await;
    ended
}

/// Copies every record of `from` (a store that an edge is not serving) into the empty
/// etcd store `to`, keeping ids, VIPs, versions and idempotency keys: how a site with one
/// edge grows into an edge cluster. Refuses a prefix that holds a store already; a copy
/// that failed half-way is written again from the start.
pub async fn copy_into(from: &super::Store, to: &EtcdSettings) -> Result<usize, StoreError> {
    let client = connect(to, Some(REQUEST_TIMEOUT)).await?;
    let keys = Keys::new(&to.prefix);
    let mut kv = client.kv_client();
    let guard = kv
        .get(keys.guard(), Some(GetOptions::new().with_count_only()))
        .await
        .map_err(unavailable)?;
    if guard.count() > 0 {
        return Err(StoreError::Etcd(format!(
            "{} already holds a store: copy into an empty prefix",
            keys.state
        )));
    }
    let ops = keys.encode(&from.records())?;
    let copied = ops.len();
    for chunk in ops.chunks(MAX_RECORDS_PER_TXN) {
        let txn = EtcdTxn::new()
            .when([Compare::mod_revision(keys.guard(), CompareOp::Equal, 0)])
            .and_then(chunk.to_vec());
        let response = kv.txn(txn).await.map_err(unavailable)?;
        if !response.succeeded() {
            return Err(StoreError::Etcd(
                "another writer began using the store during the copy".into(),
            ));
        }
    }
    kv.put(keys.guard(), to.edge_name.clone(), None)
        .await
        .map_err(unavailable)?;
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::StoredLoadBalancer;
    use crate::model::tests::spec;

    #[test]
    fn records_round_trip_through_their_keys() {
        let keys = Keys::new("/tandem-edge/");
        assert_eq!(keys.guard(), "/tandem-edge/state/guard");
        assert_eq!(keys.election(), "/tandem-edge/leader");
        let lb = StoredLoadBalancer {
            id: "lb-1".into(),
            spec: spec("a"),
            state: cloud_mock_sdk::State::Active,
            version: 3,
            state_since_ms: 7,
            idempotency_key: Some("k/1".into()),
        };
        let value = encode(&lb, "load balancer").unwrap();
        let Ok(Decoded::Record(change)) = keys.decode(b"/tandem-edge/state/lb/lb-1", Some(&value))
        else {
            panic!("not a record");
        };
        assert_eq!(change.load_balancers.get("lb-1"), Some(&Some(lb)));
        let Ok(Decoded::Record(change)) = keys.decode(b"/tandem-edge/state/key/k/1", Some(b"lb-1"))
        else {
            panic!("not a record");
        };
        assert_eq!(
            change.idempotency_keys.get("k/1"),
            Some(&Some("lb-1".to_owned())),
            "a key may hold a slash"
        );
        let Ok(Decoded::Record(change)) = keys.decode(b"/tandem-edge/state/vip/2001:db8::1", None)
        else {
            panic!("not a record");
        };
        assert_eq!(change.holders.len(), 1);
        assert!(matches!(
            keys.decode(b"/tandem-edge/state/guard", Some(b"e1")),
            Ok(Decoded::Guard)
        ));
        assert!(matches!(
            keys.decode(b"/tandem-edge/leader/1", Some(b"e1")),
            Ok(Decoded::Foreign)
        ));
        assert!(matches!(
            keys.decode(b"/tandem-edge/state/lb/x", Some(b"junk")),
            Err(StoreError::Corrupt { .. })
        ));
        assert_eq!(prefix_end("/a/"), b"/a0");
    }
}
