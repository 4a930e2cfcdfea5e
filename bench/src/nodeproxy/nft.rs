//! The nftables mode against the kernel (issue 14), in fresh network namespaces: the
//! first sync and single-endpoint changes through the node proxy's change tracker,
//! incremental nftables build and netlink transactions, each against the kernel's own part
//! (the same batch sent again) and against `nft -f` of the same transaction (what a proxy
//! driving the nft command pays); and the latency of a new connection's first packet with
//! many Services in the table against a table holding the target Service alone. A
//! dual-stack cluster gets a proxier per family, as the node proxy runs them: both tables
//! written by the first sync, the changes made to `ip6 tandem` beside a full `ip tandem`.

use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tandem_common::IpFamily;
use tandem_netlab::RunPrefix;
use tandem_nftables::encode::Batch;
use tandem_nftables::kernel::Netlink;
use tandem_nftables::{Transaction, render};
use tandem_nodeproxy::observe::change_tracker::ChangeTracker;
use tandem_nodeproxy::observe::convert::proxy_state;
use tandem_proxy_rules::nft::incremental::IncrementalRuleset;
use tandem_proxy_rules::nft::layout;

use super::cluster::{self, Cluster};
use super::kernel::{FreshNetns, InitialLists, slice_update};
use super::summary::median;

/// What one transaction was (or the first sync's, added up over the tables), for the
/// report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Size {
    pub ops: usize,
    pub bytes: usize,
}

impl Size {
    fn of(tx: &Transaction, batch: &Batch) -> Self {
        Self {
            ops: tx.ops.len(),
            bytes: batch.byte_len(),
        }
    }
}

/// The node proxy's first sync into an empty namespace (every family's table).
#[derive(Debug, Clone, Copy, Default)]
pub struct FirstSync {
    /// Watch events recorded → changes taken → ruleset built.
    pub convert_build: Duration,
    /// The whole-table transaction encoded as one netlink batch.
    pub encode: Duration,
    /// The batch sent and the kernel's answers read.
    pub send: Duration,
    /// All of it.
    pub total: Duration,
    pub size: Size,
    pub chains: usize,
    pub rules: usize,
    pub elements: usize,
}

/// One incremental change.
#[derive(Debug, Clone, Copy)]
pub struct Change {
    /// Recording the watch event, taking the changes and rebuilding the changed port.
    pub track_build: Duration,
    /// From the EndpointSlice event reaching the tracker to the kernel's answer: the
    /// network programming latency without the --min-sync-period wait.
    pub ours: Duration,
    /// `ours` without the kernel's part (the send): tracking, build, diff, encoding.
    pub own: Duration,
    /// The same batch sent again from the same starting state: the kernel's part.
    pub raw: Duration,
    /// `nft -f` of the same transaction from the same starting state (the first rounds
    /// only, as many as asked).
    pub nft_cli: Option<Duration>,
    pub size: Size,
}

#[derive(Debug, Clone)]
pub struct SyncRun {
    pub first: FirstSync,
    pub added: Vec<Change>,
    pub removed: Vec<Change>,
}

/// In a fresh namespace: the first sync of `cluster`, then `rounds` times one endpoint
/// added and removed again. After each pair the kernel is back where the added one
/// started, so the same two batches are sent again (the kernel's part), and then the same
/// two transactions of the first `nft_cli_rounds` rounds go through `nft -f`.
pub fn measure_sync(
    prefix: &RunPrefix,
    cluster: Cluster,
    rounds: usize,
    nft_cli_rounds: usize,
) -> anyhow::Result<SyncRun> {
    let netns = FreshNetns::create(prefix)?;
    netns.run_blocking(move || sync_in_namespace(cluster, rounds, nft_cli_rounds))
}

/// One proxier of the node proxy's own machinery, driven as its nftables data path
/// drives it.
struct NodeProxy {
    family: IpFamily,
    tracker: ChangeTracker,
    rules: IncrementalRuleset,
    kernel: Netlink,
}

impl NodeProxy {
    fn new(plan: &cluster::AddressPlan) -> anyhow::Result<Self> {
        Ok(Self {
            family: plan.family,
            tracker: ChangeTracker::new(plan.family),
            rules: IncrementalRuleset::new(plan.node_config()),
            kernel: Netlink::open()?,
        })
    }
}

fn sync_in_namespace(
    mut cluster: Cluster,
    rounds: usize,
    nft_cli_rounds: usize,
) -> anyhow::Result<SyncRun> {
    let mut proxies = cluster
        .plans
        .iter()
        .map(NodeProxy::new)
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Every proxier sees every watch event, as in the node proxy.
    let lists: Vec<InitialLists> = proxies.iter().map(|_| InitialLists::of(&cluster)).collect();
    let started = Instant::now();
    let mut first = FirstSync::default();
    for (proxy, lists) in proxies.iter_mut().zip(lists) {
        let building = Instant::now();
        lists.feed(&mut proxy.tracker);
        let changes = proxy.tracker.take();
        // As the data path does before its first apply, which replaces the whole table.
        proxy
            .rules
            .update_without_transaction(&changes.current, &changes.ports);
        first.convert_build += building.elapsed();
        let encoding = Instant::now();
        let tx = Transaction::replace_all(proxy.rules.ruleset());
        let batch = proxy.kernel.encode(&tx)?;
        first.encode += encoding.elapsed();
        let sending = Instant::now();
        proxy.kernel.send(&tx, &batch)?;
        first.send += sending.elapsed();
        let ruleset = proxy.rules.ruleset();
        first.size.ops += tx.ops.len();
        first.size.bytes += batch.byte_len();
        first.chains += ruleset.chains.len();
        first.rules += ruleset.rule_count();
        first.elements += ruleset.element_count();
    }
    first.total = started.elapsed();
    let mut pairs = Vec::new();
    for round in 0..rounds {
        let index = cluster.changed_service(round);
        let family = cluster.family_of(index);
        let proxy = proxies
            .iter_mut()
            .find(|proxy| proxy.family == family)
            .context("no proxier of the changed slice's family")?;
        cluster.add_endpoint(index, round);
        let add = apply_change(proxy, &cluster, index)?;
        cluster.remove_last_endpoint(index);
        let remove = apply_change(proxy, &cluster, index)?;
        // The kernel is back where `add` started: each batch again.
        let raws = [
            add.resend(&mut proxy.kernel)?,
            remove.resend(&mut proxy.kernel)?,
        ];
        pairs.push((add, raws[0], remove, raws[1]));
    }
    // Each pair left the kernel as it found it, so every pair can go through nft from the
    // same state, after all the timed changes: nft reads the whole table back, which a
    // node proxy never does, and that would slow the timed change after it.
    let (mut added, mut removed) = (Vec::new(), Vec::new());
    for (round, (add, add_raw, remove, remove_raw)) in pairs.into_iter().enumerate() {
        let through_nft = round < nft_cli_rounds;
        added.push(add.with_limits(add_raw, through_nft)?);
        removed.push(remove.with_limits(remove_raw, through_nft)?);
    }
    Ok(SyncRun {
        first,
        added,
        removed,
    })
}

/// One change the node proxy applied, with its transaction and batch to send again.
struct Applied {
    track_build: Duration,
    ours: Duration,
    send: Duration,
    tx: Transaction,
    batch: Batch,
}

impl Applied {
    /// The same batch sent again (from the state it was first sent from): the kernel's part.
    fn resend(&self, kernel: &mut Netlink) -> anyhow::Result<Duration> {
        timed(|| Ok(kernel.send(&self.tx, &self.batch)?))
    }

    /// The change with its limits: the kernel's part, and (when `through_nft`) `nft -f`
    /// of the same transaction, run from the same state as the first send.
    fn with_limits(self, raw: Duration, through_nft: bool) -> anyhow::Result<Change> {
        let nft_cli = if through_nft {
            Some(nft_file(&render::transaction(&self.tx))?)
        } else {
            None
        };
        Ok(Change {
            track_build: self.track_build,
            ours: self.ours,
            own: self.ours.saturating_sub(self.send),
            raw,
            nft_cli,
            size: Size::of(&self.tx, &self.batch),
        })
    }
}

/// Feeds the changed slice at `index` to the node proxy as its watch would and applies the
/// transaction.
fn apply_change(proxy: &mut NodeProxy, cluster: &Cluster, index: usize) -> anyhow::Result<Applied> {
    let update = slice_update(cluster, index)?;
    let started = Instant::now();
    proxy.tracker.record_slice(update);
    let changes = proxy.tracker.take();
    let tx = proxy.rules.update(&changes.current, &changes.ports);
    let track_build = started.elapsed();
    if tx.is_empty() {
        bail!("the change left the ruleset as it was");
    }
    let batch = proxy.kernel.encode(&tx)?;
    let sending = Instant::now();
    proxy.kernel.send(&tx, &batch)?;
    let send = sending.elapsed();
    Ok(Applied {
        track_build,
        ours: started.elapsed(),
        send,
        tx,
        batch,
    })
}

fn timed(body: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<Duration> {
    let started = Instant::now();
    body()?;
    Ok(started.elapsed())
}

/// One `nft -f -` of `text` in the current namespace, from spawn to exit.
fn nft_file(text: &str) -> anyhow::Result<Duration> {
    timed(|| {
        let mut child = Command::new("nft")
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawning nft (Debian package nftables)")?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(text.as_bytes()).context("writing to nft")?;
        }
        let output = child.wait_with_output().context("waiting for nft")?;
        if !output.status.success() {
            bail!(
                "nft -f failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(())
    })
}

/// The limits of a first sync, each into a fresh namespace: the same whole-table batch
/// sent (the kernel's part), and `nft -f` of the same transaction.
#[derive(Debug, Clone, Copy)]
pub struct FirstSyncLimits {
    pub raw: Duration,
    pub nft_cli: Duration,
}

pub fn measure_first_limits(
    prefix: &RunPrefix,
    cluster: &Cluster,
) -> anyhow::Result<FirstSyncLimits> {
    let txs: Vec<Transaction> = cluster
        .plans
        .iter()
        .map(|plan| full_table(cluster, plan))
        .collect();
    let text: String = txs.iter().map(render::transaction).collect();
    let netns = FreshNetns::create(prefix)?;
    let raw = netns.run_blocking(move || {
        let mut kernel = Netlink::open()?;
        let batches = txs
            .iter()
            .map(|tx| kernel.encode(tx))
            .collect::<Result<Vec<_>, _>>()?;
        timed(|| {
            for (tx, batch) in txs.iter().zip(&batches) {
                kernel.send(tx, batch)?;
            }
            Ok(())
        })
    })?;
    let netns = FreshNetns::create(prefix)?;
    let nft_cli = netns.run_blocking(move || nft_file(&text))?;
    Ok(FirstSyncLimits { raw, nft_cli })
}

/// The whole table of `plan`'s family for `cluster`, as one transaction.
fn full_table(cluster: &Cluster, plan: &cluster::AddressPlan) -> Transaction {
    let state = proxy_state(&cluster.services, &cluster.slices, plan.family).state;
    Transaction::replace_all(&layout::build(&state, &plan.node_config()))
}

/// First-packet latency: the median time a TCP connect to the target Service's cluster IP
/// takes (SYN through the nat hooks and DNAT to a local endpoint, SYN-ACK back), with the
/// whole `cluster` in the table and with the target Service alone.
#[derive(Debug, Clone, Copy)]
pub struct FirstPacket {
    pub services: usize,
    pub loaded: Duration,
    pub alone: Duration,
    pub connects: usize,
}

/// `rounds` alternating rounds of `per_round` connects into each of two namespaces: one
/// with the whole `cluster` loaded and one with only its last Service, the target.
pub fn measure_first_packet(
    prefix: &RunPrefix,
    cluster: &Cluster,
    rounds: usize,
    per_round: usize,
) -> anyhow::Result<FirstPacket> {
    let (Some(service), Some(slice)) = (cluster.services.last(), cluster.slices.last()) else {
        bail!("the cluster has no Service");
    };
    let alone = Cluster {
        services: vec![service.clone()],
        slices: vec![slice.clone()],
        plans: cluster.plans,
    };
    let target = cluster_ip_target(service)?;
    let endpoints: Vec<Ipv4Addr> = slice
        .endpoints
        .iter()
        .flat_map(|e| &e.addresses)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()
        .context("an endpoint address of the target Service")?;
    let loaded_ns = FirstPacketNetns::new(prefix, cluster, &endpoints)?;
    let alone_ns = FirstPacketNetns::new(prefix, &alone, &endpoints)?;
    let (mut loaded, mut alone) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // Alternate which goes first, so a drift in the machine's load hits both alike.
        let order = if round % 2 == 0 {
            [(&loaded_ns, &mut loaded), (&alone_ns, &mut alone)]
        } else {
            [(&alone_ns, &mut alone), (&loaded_ns, &mut loaded)]
        };
        for (netns, samples) in order {
            samples.extend(netns.connects(target, per_round)?);
        }
    }
    Ok(FirstPacket {
        services: cluster.services.len(),
        loaded: median(&loaded),
        alone: median(&alone),
        connects: loaded.len(),
    })
}

fn cluster_ip_target(
    service: &k8s_openapi::api::core::v1::Service,
) -> anyhow::Result<SocketAddrV4> {
    let spec = service
        .spec
        .as_ref()
        .context("the target Service has no spec")?;
    let ip: Ipv4Addr = spec
        .cluster_ip
        .as_deref()
        .context("the target Service has no cluster IP")?
        .parse()
        .context("the target's cluster IP")?;
    let port = spec
        .ports
        .as_ref()
        .and_then(|ports| ports.first())
        .context("the target Service has no port")?
        .port;
    Ok(SocketAddrV4::new(ip, u16::try_from(port)?))
}

/// A namespace whose table holds a cluster's Services, with the target's endpoints as
/// local addresses and a listener on their port.
struct FirstPacketNetns {
    netns: FreshNetns,
}

impl FirstPacketNetns {
    fn new(prefix: &RunPrefix, cluster: &Cluster, endpoints: &[Ipv4Addr]) -> anyhow::Result<Self> {
        let netns = FreshNetns::create(prefix)?;
        let ip = |args: &[&str]| {
            let argv: Vec<&str> = ["ip"].into_iter().chain(args.iter().copied()).collect();
            netns.exec_checked(&argv).map(drop)
        };
        ip(&["link", "set", "lo", "up"])?;
        // The node's address and a default route, so cluster IPs are routable before DNAT
        // (a veth pair with both ends here: the dummy module may be missing).
        ip(&[
            "link",
            "add",
            "node0",
            "type",
            "veth",
            "peer",
            "name",
            "node0-peer",
        ])?;
        ip(&["link", "set", "node0-peer", "up"])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", cluster::V4.node_ip),
            "dev",
            "node0",
        ])?;
        ip(&["link", "set", "node0", "up"])?;
        ip(&["route", "add", "default", "dev", "node0"])?;
        for endpoint in endpoints {
            ip(&["addr", "add", &format!("{endpoint}/32"), "dev", "lo"])?;
        }
        let tx = full_table(cluster, &cluster::V4);
        netns.run_blocking(move || Ok(Netlink::open()?.apply(&tx)?))?;
        Ok(Self { netns })
    }

    /// `count` connects to `target`, each timed from connect() to its return.
    fn connects(&self, target: SocketAddrV4, count: usize) -> anyhow::Result<Vec<Duration>> {
        self.netns.run_blocking(move || {
            let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, cluster::TARGET_PORT as u16))
                .context("listening on the endpoints' port")?;
            listener.set_nonblocking(true)?;
            let mut samples = Vec::with_capacity(count);
            for _ in 0..count {
                let started = Instant::now();
                let stream =
                    TcpStream::connect_timeout(&SocketAddr::V4(target), Duration::from_secs(2))
                        .with_context(|| format!("connecting to {target}"))?;
                samples.push(started.elapsed());
                drop(stream);
                // Keep the accept queue empty.
                while listener.accept().is_ok() {}
            }
            Ok(samples)
        })
    }
}
