//! The measurements against real netfilter: fresh network namespaces, the node proxy's
//! `Syncer`, and raw `iptables-restore` runs of the same payloads for the limit.

use std::future::Future;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use tandem_netlab::{Netns, RunPrefix};
use tandem_nodeproxy::datapath::iptables::backend::Backend;
use tandem_nodeproxy::datapath::iptables::restore::{self, RestoreMode};
use tandem_nodeproxy::datapath::iptables::{Syncer, TableSync};
use tandem_nodeproxy::observe::change_tracker::ChangeTracker;
use tandem_proxy_rules::incremental::IncrementalRuleset;
use tandem_proxy_rules::ruleset::{ChangedChains, Table};
use tokio::io::AsyncWriteExt;

use super::cluster::{self, Cluster};

/// A network namespace of this run (`tdm<pid>x<seq>-np<n>`, so netlab's clean-up of dead
/// runs knows it), deleted on drop, also when a measurement fails or panics.
#[derive(Debug)]
pub struct FreshNetns {
    netns: Netns,
}

impl FreshNetns {
    pub fn create(prefix: &RunPrefix) -> anyhow::Result<Self> {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        let name = format!("{prefix}-np{}", NEXT.fetch_add(1, Ordering::Relaxed));
        let output = std::process::Command::new("ip")
            .args(["netns", "add", &name])
            .stdin(Stdio::null())
            .output()
            .context("running ip netns add")?;
        if !output.status.success() {
            bail!(
                "ip netns add {name}: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(Self {
            netns: Netns::attach(name),
        })
    }

    pub fn name(&self) -> &str {
        self.netns.name()
    }

    /// Runs `body` on a thread that entered the namespace, on a current-thread runtime
    /// built there, so every process it spawns and every socket it opens is inside.
    pub fn run<T, F, Fut>(&self, body: F) -> anyhow::Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = anyhow::Result<T>>,
    {
        self.netns.run_in_thread(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("building a runtime in the namespace")?;
            runtime.block_on(body())
        })?
    }

    /// Runs `argv` in the namespace; a non-zero exit is an error carrying its stderr.
    pub fn exec_checked(&self, argv: &[&str]) -> anyhow::Result<String> {
        Ok(self.netns.exec_checked(argv)?)
    }

    /// Runs blocking `body` on a thread that entered the namespace.
    pub fn run_blocking<T, F>(&self, body: F) -> anyhow::Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> anyhow::Result<T> + Send + 'static,
    {
        self.netns.run_in_thread(body)?
    }
}

impl Drop for FreshNetns {
    fn drop(&mut self) {
        let deleted = std::process::Command::new("ip")
            .args(["netns", "del", self.netns.name()])
            .stdin(Stdio::null())
            .output();
        match deleted {
            Ok(output) if output.status.success() => {}
            Ok(output) => tracing::warn!(
                netns = self.netns.name(),
                stderr = %String::from_utf8_lossy(&output.stderr).trim(),
                "cannot delete namespace"
            ),
            Err(error) => {
                tracing::warn!(netns = self.netns.name(), %error, "cannot delete namespace")
            }
        }
    }
}

/// The backends whose `iptables-restore` exists on this machine.
pub fn available_backends() -> Vec<Backend> {
    [Backend::Nft, Backend::Legacy]
        .into_iter()
        .filter(|b| {
            std::process::Command::new(b.restore())
                .arg("--version")
                .stdin(Stdio::null())
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect()
}

/// One raw `iptables-restore` of `text` in the current namespace; returns how long it took
/// from spawn to exit, as the Syncer's own restores are timed.
pub async fn raw_restore(
    backend: Backend,
    text: &str,
    mode: RestoreMode,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut command = tokio::process::Command::new(backend.restore());
    if mode == RestoreMode::NoFlush {
        command.arg("--noflush");
    }
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("spawning {}", backend.restore()))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(text.as_bytes())
            .await
            .with_context(|| format!("writing to {}", backend.restore()))?;
    }
    let output = child.wait_with_output().await?;
    let elapsed = started.elapsed();
    if !output.status.success() {
        bail!(
            "raw {} failed ({}): {}",
            backend.restore(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(elapsed)
}

/// What one sync wrote: the payloads of its tables, joined into one restore input, and
/// the mode they share.
#[derive(Debug, Clone)]
pub struct Written {
    pub text: String,
    pub mode: RestoreMode,
    pub chains: usize,
    pub rules: usize,
    pub deleted_chains: usize,
    /// Each table's restore as the Syncer timed it.
    pub restores: Vec<(Table, Duration)>,
}

fn written(tables: &[TableSync]) -> anyhow::Result<Written> {
    let Some(first) = tables.first() else {
        bail!("the sync wrote nothing");
    };
    if tables.iter().any(|t| t.mode != first.mode) {
        bail!("the sync mixed flush and --noflush restores; no single raw restore matches it");
    }
    Ok(Written {
        text: tables.iter().map(|t| t.payload.as_str()).collect(),
        mode: first.mode,
        chains: tables.iter().map(|t| t.written_chains).sum(),
        rules: tables.iter().map(|t| t.rules).sum(),
        deleted_chains: tables.iter().map(|t| t.deleted_chains).sum(),
        restores: tables.iter().map(|t| (t.table, t.elapsed)).collect(),
    })
}

/// The node proxy's first sync into an empty namespace.
#[derive(Debug, Clone)]
pub struct FirstSync {
    /// Watch events recorded → changes taken → ruleset built.
    pub convert_build: Duration,
    /// Everything: convert, build, inspection, canary, restores, base jumps.
    pub total: Duration,
    pub written: Written,
}

/// One incremental change: our sync and the raw restore of the same payload.
#[derive(Debug, Clone, Copy)]
pub struct Incremental {
    /// Recording the watch event, taking the changes and rebuilding the changed ports.
    pub track_build: Duration,
    /// From the EndpointSlice event reaching the tracker to the restore returning: the
    /// network programming latency without the --min-sync-period wait.
    pub ours: Duration,
    /// `ours` without the `iptables-restore` process: tracking, build, diff, payload.
    pub own: Duration,
    pub raw: Duration,
    pub written_chains: usize,
    pub deleted_chains: usize,
}

#[derive(Debug, Clone)]
pub struct SyncRun {
    pub first: FirstSync,
    pub added: Vec<Incremental>,
    pub removed: Vec<Incremental>,
}

/// In a fresh namespace: the first sync of `cluster`, then `rounds` times one endpoint
/// added and removed again, each followed by a raw restore of the same payload into the
/// same table (put back to the state before the change first, untimed).
pub fn measure_sync(
    prefix: &RunPrefix,
    backend: Backend,
    cluster: Cluster,
    rounds: usize,
) -> anyhow::Result<SyncRun> {
    let netns = FreshNetns::create(prefix)?;
    netns.run(move || sync_in_namespace(backend, cluster, rounds))
}

/// The node proxy's own machinery, driven as its sync loop drives it.
struct NodeProxy {
    tracker: ChangeTracker,
    rules: IncrementalRuleset,
    syncer: Syncer,
}

impl NodeProxy {
    /// Takes the recorded changes and rebuilds the Service ports they touched.
    fn take_and_build(&mut self) -> ChangedChains {
        let changes = self.tracker.take();
        self.rules.update(&changes.current, &changes.ports)
    }
}

/// The events of a watch's first list of `objects`.
fn initial_list<K: Clone>(objects: &[K]) -> Vec<Event<K>> {
    let listed = objects.iter().cloned().map(Event::InitApply);
    [Event::Init]
        .into_iter()
        .chain(listed)
        .chain([Event::InitDone])
        .collect()
}

/// A cluster's initial lists as the watches deliver them: cloned out of the cluster before
/// the clock starts, fed to the tracker after.
pub(super) struct InitialLists {
    services: Vec<Event<Service>>,
    slices: Vec<Event<EndpointSlice>>,
}

impl InitialLists {
    pub(super) fn of(cluster: &Cluster) -> Self {
        Self {
            services: initial_list(&cluster.services),
            slices: initial_list(&cluster.slices),
        }
    }

    pub(super) fn feed(self, tracker: &mut ChangeTracker) {
        self.services
            .into_iter()
            .for_each(|event| _ = tracker.record_service(event));
        self.slices
            .into_iter()
            .for_each(|event| _ = tracker.record_slice(event));
    }
}

/// The watch event of the slice at `index` as it is now (after a round changed it).
pub(super) fn slice_update(
    cluster: &Cluster,
    index: usize,
) -> anyhow::Result<Event<EndpointSlice>> {
    let slice = cluster
        .slices
        .get(index)
        .context("the changed slice is gone")?;
    Ok(Event::Apply(slice.clone()))
}

async fn sync_in_namespace(
    backend: Backend,
    mut cluster: Cluster,
    rounds: usize,
) -> anyhow::Result<SyncRun> {
    let mut proxy = NodeProxy {
        tracker: ChangeTracker::new(cluster::V4.family),
        rules: IncrementalRuleset::new(cluster::V4.node_config()),
        syncer: Syncer::new(backend),
    };
    let lists = InitialLists::of(&cluster);
    let started = Instant::now();
    lists.feed(&mut proxy.tracker);
    let changed = proxy.take_and_build();
    let convert_build = started.elapsed();
    let tables = proxy
        .syncer
        .sync_changed(proxy.rules.ruleset(), &changed)
        .await?;
    let total = started.elapsed();
    let first = FirstSync {
        convert_build,
        total,
        written: written(&tables)?,
    };
    let (mut added, mut removed) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let index = cluster.changed_service(round);
        cluster.add_endpoint(index, round);
        added.push(change(backend, &mut proxy, &cluster, index).await?);
        cluster.remove_last_endpoint(index);
        removed.push(change(backend, &mut proxy, &cluster, index).await?);
    }
    Ok(SyncRun {
        first,
        added,
        removed,
    })
}

/// Feed the changed slice at `index` to the node proxy as its watch would and sync, then
/// time the raw restore of the very payload the sync wrote.
async fn change(
    backend: Backend,
    proxy: &mut NodeProxy,
    cluster: &Cluster,
    index: usize,
) -> anyhow::Result<Incremental> {
    let update = slice_update(cluster, index)?;
    let before = proxy.rules.ruleset().clone();
    let started = Instant::now();
    proxy.tracker.record_slice(update);
    let changed = proxy.take_and_build();
    let track_build = started.elapsed();
    let tables = proxy
        .syncer
        .sync_changed(proxy.rules.ruleset(), &changed)
        .await?;
    let ours = started.elapsed();
    let restores: Duration = tables.iter().map(|t| t.restore).sum();
    let ours_written = written(&tables)?;
    // Put the kernel back where the sync started, so the raw run does the same work.
    let desired = proxy.rules.ruleset();
    let undo: String = Table::ALL
        .into_iter()
        .filter_map(|t| restore::between(t.as_str(), desired.table(t), before.table(t)))
        .map(|p| p.text)
        .collect();
    if undo.is_empty() {
        bail!("the change left the ruleset as it was");
    }
    raw_restore(backend, &undo, RestoreMode::NoFlush).await?;
    let raw = raw_restore(backend, &ours_written.text, ours_written.mode).await?;
    Ok(Incremental {
        track_build,
        ours,
        own: ours.saturating_sub(restores),
        raw,
        written_chains: ours_written.chains,
        deleted_chains: ours_written.deleted_chains,
    })
}

/// The limit of a first sync: a raw restore of the same payload into a fresh namespace.
pub fn measure_raw_first(
    prefix: &RunPrefix,
    backend: Backend,
    written: &Written,
) -> anyhow::Result<Duration> {
    let netns = FreshNetns::create(prefix)?;
    let (text, mode) = (written.text.clone(), written.mode);
    netns.run(move || async move { raw_restore(backend, &text, mode).await })
}
