//! Passthrough mode: a kernel route `VIP/32` (an IPv6 VIP: `VIP/128`, with `ip -6`) over
//! the healthy backends of the VIP's family.
//!
//! Each VIP's route leads to a resilient nexthop group of its own (`nhid G`), whose members
//! are nexthop objects, one per backend address (shared by every group that has it). A
//! resilient group maps the flow hash onto a fixed table of buckets, each bucket held by one
//! member: a member that leaves hands on only its own buckets, and one that joins takes
//! only buckets that have carried no packet for a while. So a node-set change moves no busy
//! flow whose node stays, where a plain multipath route (hash-threshold) re-spreads many
//! and the nodes they land on reset them. A VIP keeps its group id as long as it has a
//! route, so a change of members is one `ip nexthop replace` of the group and the route
//! stays as it is. A VIP with one backend gets a group too: a second node then joins it
//! like any other, taking idle buckets only, where turning a plain `via` route into a new
//! group would spread every flow afresh. A kernel that refuses resilient groups (before
//! 5.13), found by trying once at start, gets multipath routes (`nexthop via A weight 1
//! ...`) instead.
//!
//! A route carries every port of its VIP, so load balancers sharing a VIP share its
//! nexthops. Their backends' health may differ (a node with `externalTrafficPolicy: Local`
//! answers healthy only for Services with a pod on it), and a flow hashed to a node that
//! cannot serve its port is dropped there. So the nexthops are the backends healthy for
//! every sharer that has a healthy backend at all; when no backend is healthy for all of
//! them, the union (each sharer then reaches the flows hashed to its own nodes, instead of
//! every sharer losing all). When no backend is healthy for any sharer, the route fails
//! open over every sharer's backends, as the proxy mode's listeners do.
//!
//! Routes and nexthop objects carry `proto N`: a restart adopts what an earlier run left
//! (keeping each VIP's group, so its flows stay where they are) and removes what is no
//! longer wanted; nexthop ids of anyone else are never taken.
//! Deciding is pure (`desired_routes`, `plan_routes`, the `*_args` functions); `RouteManager`
//! runs the resulting `ip` commands whenever the desired set or any backend's health changes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::BackendHealth;
use crate::command::{Program, already_gone, device_towards, family_flag, host_prefix, value_of};
use crate::config::PassthroughConfig;
use crate::error::DeviceError;
use crate::health::{HealthTable, ProbeTarget};
use crate::metrics::Metrics;
use crate::plan::{PassthroughRoute, RouteTable, combined_health};
use crate::steering::Steering;

pub(crate) type WantedRoutes = Arc<BTreeMap<IpAddr, Vec<PassthroughRoute>>>;

/// Buckets of a resilient group. 256 spreads evenly over a few dozen nodes (three nodes:
/// 86/85/85), and the more buckets, the fewer flows share one, so more of them are idle and
/// free to move when a node joins.
const BUCKETS: u16 = 256;
/// A bucket moves to a joining node only after carrying no packet this long: longer than
/// the pauses of a connection in use (the lab's long-lived connection talks every second),
/// short enough that a joining node gets its share within seconds under steady traffic.
const IDLE_TIMER_SECS: u32 = 5;
/// Unbalanced this long, the group moves busy buckets too: a node that joined under traffic
/// busy enough that buckets are never idle gets its share within a minute, at the price of
/// the flows on the buckets that move.
const UNBALANCED_TIMER_SECS: u32 = 60;

/// The `ip` family flags whose routes of ours are adopted.
const FAMILY_FLAGS: [&str; 2] = ["-4", "-6"];

/// The settings of one IP family that forwarding to passthrough nexthops depends on.
struct FamilySysctls {
    hash_policy: &'static str,
    forwarding: &'static str,
}

const IPV4_SYSCTLS: FamilySysctls = FamilySysctls {
    hash_policy: "net.ipv4.fib_multipath_hash_policy",
    forwarding: "net.ipv4.ip_forward",
};

const IPV6_SYSCTLS: FamilySysctls = FamilySysctls {
    hash_policy: "net.ipv6.fib_multipath_hash_policy",
    forwarding: "net.ipv6.conf.all.forwarding",
};

fn sysctls_of(vip: IpAddr) -> &'static FamilySysctls {
    if vip.is_ipv4() {
        &IPV4_SYSCTLS
    } else {
        &IPV6_SYSCTLS
    }
}

fn sysctl_path(name: &str) -> String {
    format!("/proc/sys/{}", name.replace('.', "/"))
}

/// The routes to install: each VIP over its sharers' backends that pass every check (see
/// the module documentation for sharers that disagree); a VIP with no healthy backend is
/// routed over all its backends (fail open), one without backends gets no route.
pub(crate) fn desired_routes(
    wanted: &BTreeMap<IpAddr, Vec<PassthroughRoute>>,
    lookup: impl Fn(&ProbeTarget) -> BackendHealth,
) -> RouteTable {
    wanted
        .iter()
        .filter_map(|(&vip, sharers)| {
            let healthy: Vec<BTreeSet<IpAddr>> = sharers
                .iter()
                .map(|route| healthy_backends(route, &lookup))
                .filter(|set| !set.is_empty())
                .collect();
            let mut serving_all = healthy.iter();
            let Some(first) = serving_all.next().cloned() else {
                let every: BTreeSet<IpAddr> = sharers
                    .iter()
                    .flat_map(|route| route.backends.iter().copied())
                    .collect();
                return (!every.is_empty()).then(|| (vip, every.into_iter().collect()));
            };
            let common: BTreeSet<IpAddr> = serving_all.fold(first, |common, set| {
                common.intersection(set).copied().collect()
            });
            let nexthops: Vec<IpAddr> = if common.is_empty() {
                healthy
                    .into_iter()
                    .flatten()
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect()
            } else {
                common.into_iter().collect()
            };
            Some((vip, nexthops))
        })
        .collect()
}

fn healthy_backends(
    route: &PassthroughRoute,
    lookup: &impl Fn(&ProbeTarget) -> BackendHealth,
) -> BTreeSet<IpAddr> {
    route
        .backends
        .iter()
        .copied()
        .filter(|&ip| {
            combined_health(&route.checks, |check| {
                lookup(&ProbeTarget {
                    ip,
                    check: check.clone(),
                })
            }) == BackendHealth::Healthy
        })
        .collect()
}

/// How routes reach their nexthops; chosen once per run by trying (`RouteManager::probe`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RouteStyle {
    /// `nhid G`: a resilient group per VIP.
    Resilient,
    /// `nexthop via A weight 1 ...` (hash-threshold): for kernels without resilient groups.
    Multipath,
}

/// A nexthop object of ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Nexthop {
    Gateway(IpAddr),
    /// A resilient group with our bucket count and timers: its members' ids.
    Group(Vec<u32>),
    /// Anything else marked ours (another group type or other settings, a probe's
    /// leftover): removed.
    Other,
}

/// A route of ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Route {
    Group(u32),
    /// Over these nexthops; none when adopted (unknown, so replaced).
    Multipath(Vec<IpAddr>),
}

/// What of ours is in the kernel, as far as the manager knows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Installed {
    pub nexthops: BTreeMap<u32, Nexthop>,
    pub routes: BTreeMap<IpAddr, Route>,
    /// Nexthop ids of others: never taken.
    pub foreign: BTreeSet<u32>,
}

/// One write; a new gateway is a [`Plan::gateways`] entry instead, as it needs a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RouteChange {
    /// Creates (`new`) or updates in place a resilient group.
    SetGroup {
        id: u32,
        members: Vec<u32>,
        new: bool,
    },
    RouteToGroup {
        vip: IpAddr,
        group: u32,
    },
    RouteMultipath {
        vip: IpAddr,
        /// Of the VIP's family.
        nexthops: Vec<IpAddr>,
    },
    DeleteRoute {
        vip: IpAddr,
    },
    DeleteNexthop {
        id: u32,
    },
}

/// The writes from installed to desired, in order: new gateway nexthops, then `changes`
/// (groups, routes, then removals: routes before the groups they use, groups before their
/// members).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub gateways: Vec<(u32, IpAddr)>,
    pub changes: Vec<RouteChange>,
}

/// Free nexthop ids from `protocol << 24` up: far from hand-made ids (which start at 1),
/// and recognisable as ours in `ip nexthop` listings.
struct FreeIds<'a> {
    installed: &'a Installed,
    next: u32,
}

impl<'a> FreeIds<'a> {
    fn new(installed: &'a Installed, protocol: u8) -> Self {
        Self {
            installed,
            next: (u32::from(protocol) << 24).max(1),
        }
    }

    fn take(&mut self) -> u32 {
        // 0 is not an id; ids are never all taken, so this ends.
        while self.next == 0
            || self.installed.nexthops.contains_key(&self.next)
            || self.installed.foreign.contains(&self.next)
        {
            self.next = self.next.wrapping_add(1);
        }
        let id = self.next;
        self.next = self.next.wrapping_add(1);
        id
    }
}

/// The writes from `installed` to `desired`. With resilient groups a VIP keeps the group
/// its route leads to, updated in place; a VIP without one (new, adopted from a multipath
/// route, or sharing a group another VIP kept) gets a new group and its route moves to it.
pub(crate) fn plan_routes(
    installed: &Installed,
    desired: &RouteTable,
    style: RouteStyle,
    protocol: u8,
) -> Plan {
    let mut ids = FreeIds::new(installed, protocol);
    let mut plan = Plan::default();
    let (mut groups, mut routes) = (Vec::new(), Vec::new());
    // Nexthop ids of ours that stay.
    let mut kept: BTreeSet<u32> = BTreeSet::new();
    // The lowest id of ours per gateway; duplicates are removed.
    let mut gateways: BTreeMap<IpAddr, u32> = BTreeMap::new();
    for (&id, nexthop) in &installed.nexthops {
        if let Nexthop::Gateway(gateway) = nexthop {
            gateways.entry(*gateway).or_insert(id);
        }
    }
    for (&vip, nexthops) in desired {
        if style == RouteStyle::Multipath {
            if installed.routes.get(&vip) != Some(&Route::Multipath(nexthops.clone())) {
                routes.push(RouteChange::RouteMultipath {
                    vip,
                    nexthops: nexthops.clone(),
                });
            }
            continue;
        }
        let members: Vec<u32> = nexthops
            .iter()
            .map(|&gateway| {
                *gateways.entry(gateway).or_insert_with(|| {
                    let id = ids.take();
                    plan.gateways.push((id, gateway));
                    id
                })
            })
            .collect();
        kept.extend(members.iter().copied());
        let own_group = match installed.routes.get(&vip) {
            Some(&Route::Group(id)) if !kept.contains(&id) => match installed.nexthops.get(&id) {
                Some(Nexthop::Group(current)) => Some((id, current)),
                _ => None,
            },
            _ => None,
        };
        match own_group {
            Some((id, current)) => {
                kept.insert(id);
                if *current != members {
                    groups.push(RouteChange::SetGroup {
                        id,
                        members,
                        new: false,
                    });
                }
            }
            None => {
                let id = ids.take();
                kept.insert(id);
                groups.push(RouteChange::SetGroup {
                    id,
                    members,
                    new: true,
                });
                routes.push(RouteChange::RouteToGroup { vip, group: id });
            }
        }
    }
    let route_deletes = installed
        .routes
        .keys()
        .filter(|vip| !desired.contains_key(vip))
        .map(|&vip| RouteChange::DeleteRoute { vip });
    let kept = &kept;
    let unused = |gateway: bool| {
        installed
            .nexthops
            .iter()
            .filter(move |(id, nexthop)| {
                !kept.contains(id) && matches!(nexthop, Nexthop::Gateway(_)) == gateway
            })
            .map(|(&id, _)| RouteChange::DeleteNexthop { id })
    };
    plan.changes = groups
        .into_iter()
        .chain(routes)
        .chain(route_deletes)
        .chain(unused(false))
        .chain(unused(true))
        .collect();
    plan
}

impl Installed {
    /// Records a gateway nexthop that was added.
    fn add_gateway(&mut self, id: u32, gateway: IpAddr) {
        self.nexthops.insert(id, Nexthop::Gateway(gateway));
    }

    /// Records a change that was made.
    fn record(&mut self, change: &RouteChange) {
        match change {
            RouteChange::SetGroup { id, members, .. } => {
                self.nexthops.insert(*id, Nexthop::Group(members.clone()));
            }
            RouteChange::RouteToGroup { vip, group } => {
                self.routes.insert(*vip, Route::Group(*group));
            }
            RouteChange::RouteMultipath { vip, nexthops } => {
                self.routes.insert(*vip, Route::Multipath(nexthops.clone()));
            }
            RouteChange::DeleteRoute { vip } => {
                self.routes.remove(vip);
            }
            RouteChange::DeleteNexthop { id } => {
                self.nexthops.remove(id);
            }
        }
    }
}

/// `ip` arguments adding gateway nexthop `id`: `gateway`, reached on `device` (a nexthop
/// object needs its device).
pub(crate) fn gateway_args(id: u32, gateway: IpAddr, device: &str, protocol: u8) -> Vec<String> {
    [
        family_flag(gateway),
        "nexthop",
        "add",
        "id",
        &id.to_string(),
        "via",
        &gateway.to_string(),
        "dev",
        device,
        "proto",
        &protocol.to_string(),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// `ip` arguments for one change; `protocol` marks routes and nexthops as ours.
pub(crate) fn change_args(change: &RouteChange, protocol: u8) -> Vec<String> {
    let protocol = protocol.to_string();
    let owned = |args: &[&str]| args.iter().map(|&arg| arg.to_owned()).collect::<Vec<_>>();
    match change {
        // A group has no family of its own: `ip -6 nexthop add ... group` is refused.
        RouteChange::SetGroup { id, members, new } => {
            let members: Vec<String> = members.iter().map(u32::to_string).collect();
            owned(&[
                "nexthop",
                if *new { "add" } else { "replace" },
                "id",
                &id.to_string(),
                "group",
                &members.join("/"),
                "type",
                "resilient",
                "buckets",
                &BUCKETS.to_string(),
                "idle_timer",
                &IDLE_TIMER_SECS.to_string(),
                "unbalanced_timer",
                &UNBALANCED_TIMER_SECS.to_string(),
                "proto",
                &protocol,
            ])
        }
        RouteChange::RouteToGroup { vip, group } => owned(&[
            family_flag(*vip),
            "route",
            "replace",
            &host_prefix(*vip),
            "nhid",
            &group.to_string(),
            "proto",
            &protocol,
        ]),
        RouteChange::RouteMultipath { vip, nexthops } => {
            let mut args = owned(&[
                family_flag(*vip),
                "route",
                "replace",
                &host_prefix(*vip),
                "proto",
                &protocol,
            ]);
            if let [single] = nexthops.as_slice() {
                args.extend(owned(&["via", &single.to_string()]));
            } else {
                for nexthop in nexthops {
                    args.extend(owned(&[
                        "nexthop",
                        "via",
                        &nexthop.to_string(),
                        "weight",
                        "1",
                    ]));
                }
            }
            args
        }
        RouteChange::DeleteRoute { vip } => owned(&[
            family_flag(*vip),
            "route",
            "delete",
            &host_prefix(*vip),
            "proto",
            &protocol,
        ]),
        RouteChange::DeleteNexthop { id } => owned(&["nexthop", "delete", "id", &id.to_string()]),
    }
}

/// `ip` arguments for the probe's nexthop: a blackhole, the one kind that needs no device.
fn probe_member_args(id: u32, protocol: u8) -> Vec<String> {
    [
        "nexthop",
        "add",
        "id",
        &id.to_string(),
        "blackhole",
        "proto",
        &protocol.to_string(),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// `ip` arguments listing our routes of one family (`family_flag`: `-4` or `-6`).
pub(crate) fn list_args(family_flag: &str, protocol: u8) -> Vec<String> {
    [family_flag, "route", "show", "proto"]
        .map(str::to_owned)
        .into_iter()
        .chain([protocol.to_string()])
        .collect()
}

/// `ip` arguments listing nexthop objects of both families and groups: those marked
/// `protocol`, or all.
pub(crate) fn list_nexthops_args(protocol: Option<u8>) -> Vec<String> {
    ["nexthop", "show"]
        .map(str::to_owned)
        .into_iter()
        .chain(
            protocol
                .into_iter()
                .flat_map(|p| ["proto".to_owned(), p.to_string()]),
        )
        .collect()
}

/// Host routes in `ip route show` output (nexthop lines are indented): to a group
/// (`nhid G`), or anything else (nexthops unknown).
pub(crate) fn parse_routes(output: &str) -> Vec<(IpAddr, Route)> {
    output
        .lines()
        .filter(|line| !line.starts_with(char::is_whitespace))
        .filter_map(|line| {
            let tokens: Vec<&str> = line.split_whitespace().collect();
            let destination = tokens.first()?;
            let address = destination
                .strip_suffix("/32")
                .or_else(|| destination.strip_suffix("/128"))
                .unwrap_or(destination);
            let vip = address.parse().ok()?;
            let route = match value_of(&tokens, "nhid").and_then(|id| id.parse().ok()) {
                Some(id) => Route::Group(id),
                None => Route::Multipath(Vec::new()),
            };
            Some((vip, route))
        })
        .collect()
}

/// Nexthop objects in `ip nexthop show` output; a group counts as ours only with our type,
/// bucket count and timers (they cannot be changed in place).
pub(crate) fn parse_nexthops(output: &str) -> Vec<(u32, Nexthop)> {
    output
        .lines()
        .filter_map(|line| {
            let tokens: Vec<&str> = line.split_whitespace().collect();
            let id = value_of(&tokens, "id")?.parse().ok()?;
            let gateway = value_of(&tokens, "via").and_then(|via| via.parse().ok());
            let ours = |key, value: String| value_of(&tokens, key) == Some(value.as_str());
            let resilient = ours("type", "resilient".to_owned())
                && ours("buckets", BUCKETS.to_string())
                && ours("idle_timer", IDLE_TIMER_SECS.to_string())
                && ours("unbalanced_timer", UNBALANCED_TIMER_SECS.to_string());
            // Members are `ID` or `ID,WEIGHT`, joined by `/`.
            let members: Option<Vec<u32>> = value_of(&tokens, "group").and_then(|group| {
                group
                    .split('/')
                    .map(|member| member.split(',').next().and_then(|id| id.parse().ok()))
                    .collect()
            });
            let nexthop = match (gateway, members) {
                (Some(gateway), None) => Nexthop::Gateway(gateway),
                (None, Some(members)) if resilient => Nexthop::Group(members),
                _ => Nexthop::Other,
            };
            Some((id, nexthop))
        })
        .collect()
}

/// Wait before the next attempt after `failed_rounds` failed rounds in a row: from `base`
/// (at least 100 ms) doubling up to 30 s, so a persistent error (no root) does not spin.
pub(crate) fn retry_after(base: Duration, failed_rounds: u32) -> Duration {
    let base = base.max(Duration::from_millis(100));
    let factor = 1_u32 << failed_rounds.saturating_sub(1).min(10);
    base.saturating_mul(factor).min(Duration::from_secs(30))
}

pub(crate) struct RouteManager {
    pub ip: Program,
    pub settings: PassthroughConfig,
    pub health: HealthTable,
    pub metrics: Metrics,
    pub wanted: watch::Receiver<WantedRoutes>,
    /// First wait before retrying failed changes; doubles per failed round.
    pub retry_delay: Duration,
}

impl RouteManager {
    /// Converges until cancelled, then removes every route and nexthop it installed.
    pub async fn run(mut self, cancel: CancellationToken) {
        let protocol = self.settings.route_protocol;
        let health_changed = self.health.changed();
        let style = self.probe(&self.adopt().await).await;
        // Adopted after the probe, so that anything the probe failed to remove goes too.
        let mut installed = self.adopt().await;
        let mut steering = self
            .settings
            .maglev
            .clone()
            .map(|config| Steering::new(self.ip.clone(), config, protocol));
        if let Some(steering) = steering.as_mut() {
            steering.adopt().await;
        }
        // The families (by `ip` flag) whose forwarding is prepared.
        let mut prepared: BTreeSet<&'static str> = BTreeSet::new();
        let mut failed_rounds: u32 = 0;
        loop {
            let desired = {
                let wanted = self.wanted.borrow_and_update();
                desired_routes(&wanted, |target| self.health.get(target))
            };
            let plan = plan_routes(&installed, &desired, style, protocol);
            // Also for a route adopted as it is: this run has not set the sysctls yet.
            for &vip in desired.keys() {
                if prepared.insert(family_flag(vip)) {
                    self.prepare_forwarding(sysctls_of(vip)).await;
                }
            }
            let mut failed = !self.execute(&plan, &mut installed).await;
            if let Some(steering) = steering.as_mut() {
                failed |= !steering.sync(&desired).await;
            }
            failed_rounds = if failed {
                // What failed may have left the kernel other than believed: look again.
                installed = self.adopt().await;
                failed_rounds.saturating_add(1)
            } else {
                0
            };
            tokio::select! {
                () = cancel.cancelled() => break,
                () = health_changed.notified() => {}
                changed = self.wanted.changed() => if changed.is_err() { break },
                () = tokio::time::sleep(retry_after(self.retry_delay, failed_rounds)), if failed => {}
            }
        }
        // Steering first: no packet is marked for a node whose route is gone.
        if let Some(steering) = steering.as_mut() {
            steering.clear().await;
        }
        let cleanup = plan_routes(&installed, &RouteTable::new(), style, protocol);
        self.execute(&cleanup, &mut installed).await;
    }

    /// Whether this kernel takes resilient groups, found by making one (over a blackhole
    /// nexthop, which needs no device) and removing it again. Logged once per run.
    async fn probe(&self, installed: &Installed) -> RouteStyle {
        let protocol = self.settings.route_protocol;
        let mut ids = FreeIds::new(installed, protocol);
        let (member, group) = (ids.take(), ids.take());
        let made = async {
            self.ip.run(&probe_member_args(member, protocol)).await?;
            let group = RouteChange::SetGroup {
                id: group,
                members: vec![member],
                new: true,
            };
            self.ip.run(&change_args(&group, protocol)).await
        }
        .await;
        for id in [group, member] {
            // What is not removed here is adopted and removed by `run`.
            if let Err(error) = self
                .ip
                .run(&change_args(&RouteChange::DeleteNexthop { id }, protocol))
                .await
            {
                debug!(%error, id, "removing the probe's nexthop");
            }
        }
        match made {
            Ok(_) => {
                info!(
                    buckets = BUCKETS,
                    idle_timer_secs = IDLE_TIMER_SECS,
                    unbalanced_timer_secs = UNBALANCED_TIMER_SECS,
                    "passthrough routes lead to resilient nexthop groups"
                );
                RouteStyle::Resilient
            }
            Err(error) => {
                warn!(
                    %error,
                    "no resilient nexthop groups here: passthrough routes are multipath, and a node-set change moves flows between nodes"
                );
                RouteStyle::Multipath
            }
        }
    }

    /// Routes and nexthop objects of ours (left by an earlier run, or as they are after a
    /// failed change), and the nexthop ids of others.
    async fn adopt(&self) -> Installed {
        let protocol = self.settings.route_protocol;
        let mut installed = Installed::default();
        // A kernel without nexthop objects fails these; the probe says so once.
        match self.ip.run(&list_nexthops_args(Some(protocol))).await {
            Ok(output) => installed.nexthops = parse_nexthops(&output).into_iter().collect(),
            Err(error) => debug!(%error, "cannot list our nexthops"),
        }
        match self.ip.run(&list_nexthops_args(None)).await {
            Ok(output) => {
                installed.foreign = parse_nexthops(&output)
                    .into_iter()
                    .map(|(id, _)| id)
                    .filter(|id| !installed.nexthops.contains_key(id))
                    .collect();
            }
            Err(error) => debug!(%error, "cannot list nexthops"),
        }
        for flag in FAMILY_FLAGS {
            match self.ip.run(&list_args(flag, protocol)).await {
                Ok(output) => installed.routes.extend(parse_routes(&output)),
                Err(error) => {
                    warn!(%error, family = flag, "cannot list passthrough routes of an earlier run");
                }
            }
        }
        if !installed.routes.is_empty() || !installed.nexthops.is_empty() {
            info!(
                routes = installed.routes.len(),
                nexthops = installed.nexthops.len(),
                "adopting passthrough routes and nexthops"
            );
        }
        installed
    }

    /// Runs `plan`, recording in `installed` what was done; false when anything failed.
    async fn execute(&self, plan: &Plan, installed: &mut Installed) -> bool {
        let protocol = self.settings.route_protocol;
        let mut all_done = true;
        for &(id, gateway) in &plan.gateways {
            let result = match device_towards(&self.ip, gateway).await {
                Ok(device) => self
                    .ip
                    .run(&gateway_args(id, gateway, &device, protocol))
                    .await
                    .map_err(DeviceError::from),
                Err(error) => Err(error),
            };
            self.metrics.route_change(result.is_ok());
            match result {
                Ok(_) => {
                    debug!(id, %gateway, "passthrough nexthop added");
                    installed.add_gateway(id, gateway);
                }
                Err(error) => {
                    warn!(%error, "passthrough nexthop change failed; will retry");
                    all_done = false;
                }
            }
        }
        for change in &plan.changes {
            let deleting = matches!(
                change,
                RouteChange::DeleteRoute { .. } | RouteChange::DeleteNexthop { .. }
            );
            let result = match self.ip.run(&change_args(change, protocol)).await {
                Ok(_) => Ok(()),
                Err(error) if deleting && already_gone(&error) => Ok(()),
                Err(error) => Err(error),
            };
            self.metrics.route_change(result.is_ok());
            match result {
                Ok(()) => {
                    log_change(change);
                    installed.record(change);
                }
                Err(error) => {
                    warn!(%error, "passthrough route change failed; will retry");
                    all_done = false;
                }
            }
        }
        all_done
    }
}

fn log_change(change: &RouteChange) {
    match change {
        RouteChange::SetGroup { id, members, new } => {
            info!(group = id, ?members, new, "passthrough nexthop group set");
        }
        RouteChange::RouteToGroup { vip, group } => {
            info!(%vip, group, "passthrough route installed");
        }
        RouteChange::RouteMultipath { vip, nexthops } => {
            info!(%vip, ?nexthops, "passthrough route installed");
        }
        RouteChange::DeleteRoute { vip } => info!(%vip, "passthrough route removed"),
        RouteChange::DeleteNexthop { id } => debug!(id, "passthrough nexthop removed"),
    }
}

impl RouteManager {
    /// Before the first route of a family: make its multipath hash (which resilient groups
    /// use too) cover ports (L4), so flows from one client spread over the backends, and
    /// warn when this namespace does not forward that family at all. Best effort: routes
    /// work without the hash policy, only less evenly.
    async fn prepare_forwarding(&self, sysctls: &FamilySysctls) {
        let hash_policy = sysctls.hash_policy;
        if self.settings.set_multipath_hash_policy {
            match tokio::fs::write(sysctl_path(hash_policy), "1").await {
                Ok(()) => info!("set {hash_policy}=1 (L4 hash)"),
                Err(error) => warn!(
                    %error,
                    "cannot set {hash_policy}=1; flows spread by addresses only"
                ),
            }
        }
        let forwarding = sysctls.forwarding;
        if let Ok(value) = tokio::fs::read_to_string(sysctl_path(forwarding)).await
            && value.trim() == "0"
        {
            warn!("{forwarding} is 0 here: packets to passthrough VIPs will not be forwarded");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::HealthCheck;
    use crate::command::{parse_route_device, route_get_args};

    fn ip(last: u8) -> IpAddr {
        Ipv4Addr::new(198, 18, 0, last).into()
    }

    fn vip(last: u8) -> IpAddr {
        Ipv4Addr::new(198, 51, 100, last).into()
    }

    fn ip6(last: u16) -> IpAddr {
        Ipv6Addr::new(0x2001, 0xdb8, 0x18, 0, 0, 0, 0, last).into()
    }

    fn vip6(last: u16) -> IpAddr {
        Ipv6Addr::new(0x2001, 0xdb8, 0x51, 0x100, 0, 0, 0, last).into()
    }

    fn wanted(checks: Vec<HealthCheck>) -> BTreeMap<IpAddr, Vec<PassthroughRoute>> {
        BTreeMap::from([
            (
                vip(5),
                vec![PassthroughRoute {
                    lb_id: "lb-a".to_owned(),
                    backends: vec![ip(11), ip(12), ip(13)],
                    checks: checks.clone(),
                }],
            ),
            (
                vip(6),
                vec![PassthroughRoute {
                    lb_id: "lb-b".to_owned(),
                    backends: vec![ip(13)],
                    checks,
                }],
            ),
        ])
    }

    #[test]
    fn sharers_route_over_the_nodes_that_serve_them_all() {
        // eTP Local: each Service's check passes only where it has a pod.
        let check = |port| HealthCheck::Http {
            port,
            path: "/healthz".to_owned(),
        };
        let sharer = |id: &str, port| PassthroughRoute {
            lb_id: id.to_owned(),
            backends: vec![ip(11), ip(12), ip(13)],
            checks: vec![check(port)],
        };
        let wanted = BTreeMap::from([(
            vip(5),
            vec![
                sharer("lb-web", 32001),
                sharer("lb-dns", 32002),
                sharer("lb-idle", 32003),
            ],
        )]);
        // web has pods on .11 and .12, dns on .12 and .13, idle nowhere.
        let pods = |web: &[u8], dns: &[u8]| {
            let (web, dns) = (web.to_vec(), dns.to_vec());
            move |target: &ProbeTarget| {
                let IpAddr::V4(node) = target.ip else {
                    return BackendHealth::Unknown;
                };
                let last = node.octets()[3];
                let serves = match &target.check {
                    HealthCheck::Http { port: 32001, .. } => web.contains(&last),
                    HealthCheck::Http { port: 32002, .. } => dns.contains(&last),
                    _ => false,
                };
                if serves {
                    BackendHealth::Healthy
                } else {
                    BackendHealth::Unhealthy
                }
            }
        };
        assert_eq!(
            desired_routes(&wanted, pods(&[11, 12], &[12, 13])),
            RouteTable::from([(vip(5), vec![ip(12)])]),
            "only .12 serves both; the idle sharer does not constrain"
        );
        assert_eq!(
            desired_routes(&wanted, pods(&[11], &[13])),
            RouteTable::from([(vip(5), vec![ip(11), ip(13)])]),
            "no node serves both: each keeps its own"
        );
        assert_eq!(
            desired_routes(&wanted, pods(&[], &[])),
            RouteTable::from([(vip(5), vec![ip(11), ip(12), ip(13)])]),
            "nobody healthy: every backend (fail open)"
        );
    }

    #[test]
    fn routes_follow_health() {
        let tcp = HealthCheck::Tcp { port: 10256 };
        let http = HealthCheck::Http {
            port: 32000,
            path: "/healthz".to_owned(),
        };
        let wanted = wanted(vec![tcp.clone(), http.clone()]);
        // .11 passes both checks, .12 fails the HTTP one, .13 is not checked yet.
        let lookup = |target: &ProbeTarget| match (target.ip, &target.check) {
            (a, _) if a == ip(11) => BackendHealth::Healthy,
            (a, check) if a == ip(12) && *check == tcp => BackendHealth::Healthy,
            (a, _) if a == ip(12) => BackendHealth::Unhealthy,
            _ => BackendHealth::Unknown,
        };
        assert_eq!(
            desired_routes(&wanted, lookup),
            RouteTable::from([(vip(5), vec![ip(11)]), (vip(6), vec![ip(13)])]),
            "vip 6 has no healthy backend: all of its backends (fail open)"
        );
    }

    #[test]
    fn unchecked_backends_are_all_nexthops() {
        assert_eq!(
            desired_routes(&wanted(vec![]), |_| BackendHealth::Unhealthy),
            RouteTable::from([
                (vip(5), vec![ip(11), ip(12), ip(13)]),
                (vip(6), vec![ip(13)])
            ])
        );
    }

    /// The first id `plan_routes` hands out for protocol 77.
    const BASE: u32 = 77 << 24;

    fn done(installed: &mut Installed, plan: &Plan) {
        for &(id, gateway) in &plan.gateways {
            installed.add_gateway(id, gateway);
        }
        for change in &plan.changes {
            installed.record(change);
        }
    }

    fn resilient(installed: &Installed, desired: &RouteTable) -> Plan {
        plan_routes(installed, desired, RouteStyle::Resilient, 77)
    }

    #[test]
    fn each_vip_gets_a_group_over_shared_gateway_nexthops() {
        let desired = RouteTable::from([(vip(5), vec![ip(11), ip(12)]), (vip(6), vec![ip(12)])]);
        let plan = resilient(&Installed::default(), &desired);
        assert_eq!(plan.gateways, vec![(BASE, ip(11)), (BASE + 1, ip(12))]);
        assert_eq!(
            plan.changes,
            vec![
                RouteChange::SetGroup {
                    id: BASE + 2,
                    members: vec![BASE, BASE + 1],
                    new: true
                },
                RouteChange::SetGroup {
                    id: BASE + 3,
                    members: vec![BASE + 1],
                    new: true
                },
                RouteChange::RouteToGroup {
                    vip: vip(5),
                    group: BASE + 2
                },
                RouteChange::RouteToGroup {
                    vip: vip(6),
                    group: BASE + 3
                },
            ]
        );
        let mut installed = Installed::default();
        done(&mut installed, &plan);
        assert_eq!(resilient(&installed, &desired), Plan::default());
    }

    #[test]
    fn nodes_leave_and_join_groups_in_place_and_routes_stay() {
        let mut installed = Installed::default();
        let both = RouteTable::from([(vip(5), vec![ip(11), ip(12)]), (vip(6), vec![ip(12)])]);
        let plan = resilient(&installed, &both);
        done(&mut installed, &plan);

        // .12 leaves vip 5: its group shrinks; vip 6 still uses .12's nexthop.
        let left = RouteTable::from([(vip(5), vec![ip(11)]), (vip(6), vec![ip(12)])]);
        let plan = resilient(&installed, &left);
        assert_eq!(
            plan,
            Plan {
                gateways: vec![],
                changes: vec![RouteChange::SetGroup {
                    id: BASE + 2,
                    members: vec![BASE],
                    new: false
                }]
            }
        );
        done(&mut installed, &plan);

        // .12 leaves everything: vip 6 moves to .11, and .12's nexthop goes.
        let gone = RouteTable::from([(vip(5), vec![ip(11)]), (vip(6), vec![ip(11)])]);
        let plan = resilient(&installed, &gone);
        assert_eq!(
            plan.changes,
            vec![
                RouteChange::SetGroup {
                    id: BASE + 3,
                    members: vec![BASE],
                    new: false
                },
                RouteChange::DeleteNexthop { id: BASE + 1 },
            ]
        );
        done(&mut installed, &plan);

        // .12 and .13 join: new nexthops (the freed id first), the groups grow in place.
        let joined = RouteTable::from([
            (vip(5), vec![ip(11), ip(12), ip(13)]),
            (vip(6), vec![ip(11)]),
        ]);
        let plan = resilient(&installed, &joined);
        assert_eq!(plan.gateways, vec![(BASE + 1, ip(12)), (BASE + 4, ip(13))]);
        assert_eq!(
            plan.changes,
            vec![RouteChange::SetGroup {
                id: BASE + 2,
                members: vec![BASE, BASE + 1, BASE + 4],
                new: false
            }]
        );
        done(&mut installed, &plan);

        // The last route goes: route, then group, then the nexthops nobody uses.
        let plan = resilient(&installed, &RouteTable::from([(vip(6), vec![ip(11)])]));
        assert_eq!(
            plan.changes,
            vec![
                RouteChange::DeleteRoute { vip: vip(5) },
                RouteChange::DeleteNexthop { id: BASE + 2 },
                RouteChange::DeleteNexthop { id: BASE + 1 },
                RouteChange::DeleteNexthop { id: BASE + 4 },
            ]
        );
    }

    #[test]
    fn adopted_state_is_kept_where_it_fits_and_removed_where_not() {
        let installed = Installed {
            nexthops: BTreeMap::from([
                (BASE, Nexthop::Gateway(ip(11))),
                (BASE + 1, Nexthop::Gateway(ip(11))),
                (BASE + 2, Nexthop::Group(vec![BASE])),
                (BASE + 3, Nexthop::Other),
            ]),
            routes: BTreeMap::from([
                // Both on one group (an earlier version's): the first keeps it.
                (vip(5), Route::Group(BASE + 2)),
                (vip(6), Route::Group(BASE + 2)),
                (vip(7), Route::Multipath(vec![])),
                (vip(8), Route::Group(BASE + 3)),
                (vip(9), Route::Multipath(vec![])),
            ]),
            foreign: BTreeSet::from([BASE + 4, BASE + 6]),
        };
        let desired = RouteTable::from([
            (vip(5), vec![ip(11)]),
            (vip(6), vec![ip(11)]),
            (vip(7), vec![ip(11)]),
            (vip(8), vec![ip(11)]),
        ]);
        let plan = resilient(&installed, &desired);
        assert!(
            plan.gateways.is_empty(),
            "the lowest of the duplicates serves"
        );
        let group = |id, vip| {
            [
                RouteChange::SetGroup {
                    id,
                    members: vec![BASE],
                    new: true,
                },
                RouteChange::RouteToGroup { vip, group: id },
            ]
        };
        let [set6, route6] = group(BASE + 5, vip(6));
        let [set7, route7] = group(BASE + 7, vip(7));
        let [set8, route8] = group(BASE + 8, vip(8));
        assert_eq!(
            plan.changes,
            vec![
                set6,
                set7,
                set8,
                route6,
                route7,
                route8,
                RouteChange::DeleteRoute { vip: vip(9) },
                RouteChange::DeleteNexthop { id: BASE + 3 },
                RouteChange::DeleteNexthop { id: BASE + 1 },
            ]
        );
    }

    #[test]
    fn multipath_style_routes_over_addresses_and_removes_groups() {
        let installed = Installed {
            nexthops: BTreeMap::from([
                (BASE, Nexthop::Gateway(ip(11))),
                (BASE + 1, Nexthop::Group(vec![BASE])),
            ]),
            routes: BTreeMap::from([
                (vip(1), Route::Multipath(vec![ip(11)])),
                (vip(2), Route::Multipath(vec![ip(11), ip(12)])),
                (vip(3), Route::Group(BASE + 1)),
            ]),
            foreign: BTreeSet::new(),
        };
        let desired = RouteTable::from([
            (vip(2), vec![ip(11), ip(12)]),
            (vip(3), vec![ip(12)]),
            (vip(4), vec![ip(13)]),
        ]);
        let plan = plan_routes(&installed, &desired, RouteStyle::Multipath, 77);
        assert_eq!(
            plan,
            Plan {
                gateways: vec![],
                changes: vec![
                    RouteChange::RouteMultipath {
                        vip: vip(3),
                        nexthops: vec![ip(12)]
                    },
                    RouteChange::RouteMultipath {
                        vip: vip(4),
                        nexthops: vec![ip(13)]
                    },
                    RouteChange::DeleteRoute { vip: vip(1) },
                    RouteChange::DeleteNexthop { id: BASE + 1 },
                    RouteChange::DeleteNexthop { id: BASE },
                ]
            }
        );
        let mut after = installed;
        done(&mut after, &plan);
        assert_eq!(
            plan_routes(&after, &desired, RouteStyle::Multipath, 77),
            Plan::default()
        );
    }

    #[test]
    fn ids_skip_zero_and_wrap() {
        let installed = Installed::default();
        assert_eq!(FreeIds::new(&installed, 0).take(), 1);
        let mut ids = FreeIds::new(&installed, 255);
        ids.next = u32::MAX;
        assert_eq!((ids.take(), ids.take()), (u32::MAX, 1));
    }

    #[test]
    fn commands() {
        let args = |change| change_args(&change, 77).join(" ");
        assert_eq!(
            gateway_args(BASE, ip(11), "eth0", 77).join(" "),
            "-4 nexthop add id 1291845632 via 198.18.0.11 dev eth0 proto 77"
        );
        assert_eq!(
            gateway_args(9, ip6(0x11), "ve", 77).join(" "),
            "-6 nexthop add id 9 via 2001:db8:18::11 dev ve proto 77"
        );
        assert_eq!(
            args(RouteChange::SetGroup {
                id: 10,
                members: vec![7, 9],
                new: true
            }),
            "nexthop add id 10 group 7/9 type resilient buckets 256 idle_timer 5 unbalanced_timer 60 proto 77"
        );
        assert_eq!(
            args(RouteChange::SetGroup {
                id: 10,
                members: vec![7],
                new: false
            }),
            "nexthop replace id 10 group 7 type resilient buckets 256 idle_timer 5 unbalanced_timer 60 proto 77"
        );
        assert_eq!(
            args(RouteChange::RouteToGroup {
                vip: vip(5),
                group: 10
            }),
            "-4 route replace 198.51.100.5/32 nhid 10 proto 77"
        );
        assert_eq!(
            args(RouteChange::RouteToGroup {
                vip: vip6(5),
                group: 10
            }),
            "-6 route replace 2001:db8:51:100::5/128 nhid 10 proto 77"
        );
        assert_eq!(
            args(RouteChange::RouteMultipath {
                vip: vip(5),
                nexthops: vec![ip(11), ip(12)]
            }),
            "-4 route replace 198.51.100.5/32 proto 77 nexthop via 198.18.0.11 weight 1 nexthop via 198.18.0.12 weight 1"
        );
        assert_eq!(
            args(RouteChange::RouteMultipath {
                vip: vip6(5),
                nexthops: vec![ip6(0x11)]
            }),
            "-6 route replace 2001:db8:51:100::5/128 proto 77 via 2001:db8:18::11"
        );
        assert_eq!(
            args(RouteChange::DeleteRoute { vip: vip(5) }),
            "-4 route delete 198.51.100.5/32 proto 77"
        );
        assert_eq!(
            args(RouteChange::DeleteNexthop { id: 10 }),
            "nexthop delete id 10"
        );
        assert_eq!(
            probe_member_args(3, 77).join(" "),
            "nexthop add id 3 blackhole proto 77"
        );
        assert_eq!(list_args("-6", 77).join(" "), "-6 route show proto 77");
        assert_eq!(
            list_nexthops_args(Some(77)).join(" "),
            "nexthop show proto 77"
        );
        assert_eq!(list_nexthops_args(None).join(" "), "nexthop show");
        assert_eq!(
            route_get_args(ip6(0x11)).join(" "),
            "-6 route get 2001:db8:18::11"
        );
    }

    #[test]
    fn retries_back_off() {
        let second = Duration::from_secs(1);
        assert_eq!(retry_after(second, 1), second);
        assert_eq!(retry_after(second, 2), 2 * second);
        assert_eq!(retry_after(second, 4), 8 * second);
        assert_eq!(retry_after(second, 40), Duration::from_secs(30));
        assert_eq!(retry_after(Duration::ZERO, 1), Duration::from_millis(100));
    }

    /// Listings as iproute2 6.1 prints them (kernel 6.18).
    #[test]
    fn listings_parse() {
        let nexthops = "id 1 via 198.18.0.11 dev va scope link proto 77 \nid 2 via 2001:db8:18::11 dev va scope link proto 77 \nid 3 blackhole proto 77 \nid 10 group 1/4,2 type resilient buckets 256 idle_timer 5 unbalanced_timer 60 unbalanced_time 0 proto 77 \nid 11 group 1 type resilient buckets 64 idle_timer 5 unbalanced_timer 60 unbalanced_time 0 proto 77 \nid 12 group 1/2 proto 77 \n";
        assert_eq!(
            parse_nexthops(nexthops),
            vec![
                (1, Nexthop::Gateway(ip(11))),
                (2, Nexthop::Gateway(ip6(0x11))),
                (3, Nexthop::Other),
                (10, Nexthop::Group(vec![1, 4])),
                (11, Nexthop::Other),
                (12, Nexthop::Other),
            ]
        );
        let routes = "198.51.100.5 nhid 10 \n\tnexthop via 198.18.0.11 dev va weight 1 \n\tnexthop via 198.18.0.12 dev va weight 1 \n198.51.100.6 nhid 11 via 198.18.0.11 dev va \n198.51.100.7 proto 77 \n\tnexthop via 198.18.0.11 dev eth0 weight 1 \n198.51.100.8/32 via 198.18.0.11 dev eth0 proto 77 \ndefault via 198.18.0.1 dev eth0 proto 77\n";
        assert_eq!(
            parse_routes(routes),
            vec![
                (vip(5), Route::Group(10)),
                (vip(6), Route::Group(11)),
                (vip(7), Route::Multipath(vec![])),
                (vip(8), Route::Multipath(vec![])),
            ]
        );
        let routes6 = "2001:db8:51:100::5 nhid 22 metric 1024 pref medium\n\tnexthop via 2001:db8:18::11 dev va weight 1 \n2001:db8:51:100::6/128 via 2001:db8:18::11 dev ve proto 77\n";
        assert_eq!(
            parse_routes(routes6),
            vec![
                (vip6(5), Route::Group(22)),
                (vip6(6), Route::Multipath(vec![]))
            ]
        );
        assert!(parse_routes("").is_empty());
        assert_eq!(
            parse_route_device("198.18.0.11 dev va src 198.18.0.1 uid 0 \n    cache \n").as_deref(),
            Some("va")
        );
        assert_eq!(
            parse_route_device("2001:db8:18::11 from :: dev ve proto kernel src 2001:db8:18::1 metric 256 pref medium\n").as_deref(),
            Some("ve")
        );
        assert_eq!(parse_route_device("unreachable 198.18.0.11"), None);
        assert_eq!(
            sysctl_path(IPV6_SYSCTLS.forwarding),
            "/proc/sys/net/ipv6/conf/all/forwarding"
        );
    }
}
