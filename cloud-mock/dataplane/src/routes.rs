//! Passthrough mode: a kernel route `VIP/32` (an IPv6 VIP: `VIP/128`, with `ip -6`) with
//! ECMP nexthops over the healthy backends of the VIP's family.
//!
//! A route carries every port of its VIP, so load balancers sharing a VIP share its
//! nexthops. Their backends' health may differ (a node with `externalTrafficPolicy: Local`
//! answers healthy only for Services with a pod on it), and a flow hashed to a node that
//! cannot serve its port is dropped there. So the nexthops are the backends healthy for
//! every sharer that has a healthy backend at all; when no backend is healthy for all of
//! them, the union (each sharer then reaches the flows hashed to its own nodes, instead of
//! every sharer losing all). When no backend is healthy for any sharer, the route fails
//! open over every sharer's backends, as the proxy mode's listeners do.
//! Deciding is pure (`desired_routes`, `plan_routes`, `route_args`); `RouteManager` runs
//! the resulting `ip` commands whenever the desired set or any backend's health changes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::BackendHealth;
use crate::command::{IpCommand, already_gone, family_flag, host_prefix};
use crate::config::PassthroughConfig;
use crate::error::CommandError;
use crate::health::{HealthTable, ProbeTarget};
use crate::metrics::Metrics;
use crate::plan::{PassthroughRoute, combined_health};

/// VIP → nexthops (sorted). An empty list means "ours, nexthops unknown" (adopted from
/// an earlier run); a desired route always has at least one nexthop.
pub(crate) type RouteTable = BTreeMap<IpAddr, Vec<IpAddr>>;

pub(crate) type WantedRoutes = Arc<BTreeMap<IpAddr, Vec<PassthroughRoute>>>;

/// The `ip` family flags whose routes of ours are adopted at start.
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RouteChange {
    Replace {
        vip: IpAddr,
        /// Of the VIP's family.
        nexthops: Vec<IpAddr>,
    },
    Delete {
        vip: IpAddr,
    },
}

/// Changes from `installed` to `desired`; deletions first.
pub(crate) fn plan_routes(installed: &RouteTable, desired: &RouteTable) -> Vec<RouteChange> {
    let deletes = installed
        .keys()
        .filter(|vip| !desired.contains_key(vip))
        .map(|&vip| RouteChange::Delete { vip });
    let replaces = desired
        .iter()
        .filter(|(vip, nexthops)| installed.get(vip) != Some(nexthops))
        .map(|(&vip, nexthops)| RouteChange::Replace {
            vip,
            nexthops: nexthops.clone(),
        });
    deletes.chain(replaces).collect()
}

/// `ip` arguments for one change; `protocol` marks the route as ours.
pub(crate) fn route_args(change: &RouteChange, protocol: u8) -> Vec<String> {
    let vip = match change {
        RouteChange::Replace { vip, .. } | RouteChange::Delete { vip } => *vip,
    };
    let mut args: Vec<String> = [family_flag(vip), "route"].map(str::to_owned).to_vec();
    match change {
        RouteChange::Replace { nexthops, .. } => {
            args.extend([
                "replace".to_owned(),
                host_prefix(vip),
                "proto".to_owned(),
                protocol.to_string(),
            ]);
            if let [single] = nexthops.as_slice() {
                args.extend(["via".to_owned(), single.to_string()]);
            } else {
                for nexthop in nexthops {
                    args.extend([
                        "nexthop".to_owned(),
                        "via".to_owned(),
                        nexthop.to_string(),
                        "weight".to_owned(),
                        "1".to_owned(),
                    ]);
                }
            }
        }
        RouteChange::Delete { .. } => {
            args.extend([
                "delete".to_owned(),
                host_prefix(vip),
                "proto".to_owned(),
                protocol.to_string(),
            ]);
        }
    }
    args
}

/// `ip` arguments listing our routes of one family (`family_flag`: `-4` or `-6`).
pub(crate) fn list_args(family_flag: &str, protocol: u8) -> Vec<String> {
    [family_flag, "route", "show", "proto"]
        .map(str::to_owned)
        .into_iter()
        .chain([protocol.to_string()])
        .collect()
}

/// Host-route destinations in `ip route show` output (nexthop lines are indented).
pub(crate) fn parse_destinations(output: &str) -> Vec<IpAddr> {
    output
        .lines()
        .filter(|line| !line.starts_with(char::is_whitespace))
        .filter_map(|line| line.split_whitespace().next())
        .filter_map(|destination| {
            let address = destination
                .strip_suffix("/32")
                .or_else(|| destination.strip_suffix("/128"))
                .unwrap_or(destination);
            address.parse().ok()
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
    pub ip: IpCommand,
    pub settings: PassthroughConfig,
    pub health: HealthTable,
    pub metrics: Metrics,
    pub wanted: watch::Receiver<WantedRoutes>,
    /// First wait before retrying failed changes; doubles per failed round.
    pub retry_delay: Duration,
}

impl RouteManager {
    /// Converges until cancelled, then removes every route it installed.
    pub async fn run(mut self, cancel: CancellationToken) {
        let health_changed = self.health.changed();
        let mut installed = self.adopt().await;
        // The families (by `ip` flag) whose forwarding is prepared.
        let mut prepared: BTreeSet<&'static str> = BTreeSet::new();
        let mut failed_rounds: u32 = 0;
        loop {
            let desired = {
                let wanted = self.wanted.borrow_and_update();
                desired_routes(&wanted, |target| self.health.get(target))
            };
            let changes = plan_routes(&installed, &desired);
            for change in &changes {
                if let RouteChange::Replace { vip, .. } = change
                    && prepared.insert(family_flag(*vip))
                {
                    self.prepare_forwarding(sysctls_of(*vip)).await;
                }
            }
            let mut failed = false;
            for change in changes {
                failed |= !self.execute(&change, &mut installed).await;
            }
            failed_rounds = if failed {
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
        let vips: Vec<IpAddr> = installed.keys().copied().collect();
        for vip in vips {
            self.execute(&RouteChange::Delete { vip }, &mut installed)
                .await;
        }
    }

    /// Routes of ours left by an earlier run, so they are replaced or removed.
    async fn adopt(&self) -> RouteTable {
        let mut adopted = RouteTable::new();
        for flag in FAMILY_FLAGS {
            match self
                .ip
                .run(&list_args(flag, self.settings.route_protocol))
                .await
            {
                Ok(output) => adopted.extend(
                    parse_destinations(&output)
                        .into_iter()
                        .map(|vip| (vip, Vec::new())),
                ),
                Err(error) => {
                    warn!(%error, family = flag, "cannot list passthrough routes of an earlier run");
                }
            }
        }
        if !adopted.is_empty() {
            info!(
                count = adopted.len(),
                "adopting passthrough routes of an earlier run"
            );
        }
        adopted
    }

    /// Runs one change and records it in `installed`; false when it failed.
    async fn execute(&self, change: &RouteChange, installed: &mut RouteTable) -> bool {
        let args = route_args(change, self.settings.route_protocol);
        let result: Result<(), CommandError> = match self.ip.run(&args).await {
            Ok(_) => Ok(()),
            Err(error) if matches!(change, RouteChange::Delete { .. }) && already_gone(&error) => {
                Ok(())
            }
            Err(error) => Err(error),
        };
        self.metrics.route_change(result.is_ok());
        match (result, change) {
            (Ok(()), RouteChange::Replace { vip, nexthops }) => {
                info!(%vip, ?nexthops, "passthrough route installed");
                installed.insert(*vip, nexthops.clone());
                true
            }
            (Ok(()), RouteChange::Delete { vip }) => {
                info!(%vip, "passthrough route removed");
                installed.remove(vip);
                true
            }
            (Err(error), _) => {
                warn!(%error, "passthrough route change failed; will retry");
                false
            }
        }
    }
}

impl RouteManager {
    /// Before the first route of a family: make its ECMP hash on ports too (L4), so flows
    /// from one client spread over the backends, and warn when this namespace does not
    /// forward that family at all. Best effort: routes work without the hash policy, only
    /// less evenly.
    async fn prepare_forwarding(&self, sysctls: &FamilySysctls) {
        let hash_policy = sysctls.hash_policy;
        if self.settings.set_multipath_hash_policy {
            match tokio::fs::write(sysctl_path(hash_policy), "1").await {
                Ok(()) => info!("set {hash_policy}=1 (L4 hash)"),
                Err(error) => warn!(
                    %error,
                    "cannot set {hash_policy}=1; ECMP hashes on addresses only"
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

    #[test]
    fn plan_replaces_changed_and_deletes_gone() {
        let installed = RouteTable::from([
            (vip(1), vec![ip(11)]),
            (vip(2), vec![ip(11), ip(12)]),
            (vip(3), vec![]),
            (vip(4), vec![ip(11)]),
        ]);
        let desired = RouteTable::from([
            (vip(2), vec![ip(11), ip(12)]),
            (vip(3), vec![ip(12)]),
            (vip(4), vec![ip(12)]),
            (vip(5), vec![ip(13)]),
        ]);
        assert_eq!(
            plan_routes(&installed, &desired),
            vec![
                RouteChange::Delete { vip: vip(1) },
                RouteChange::Replace {
                    vip: vip(3),
                    nexthops: vec![ip(12)]
                },
                RouteChange::Replace {
                    vip: vip(4),
                    nexthops: vec![ip(12)]
                },
                RouteChange::Replace {
                    vip: vip(5),
                    nexthops: vec![ip(13)]
                },
            ]
        );
        assert!(plan_routes(&desired, &desired).is_empty());
    }

    #[test]
    fn route_commands() {
        let ecmp = RouteChange::Replace {
            vip: vip(5),
            nexthops: vec![ip(11), ip(12)],
        };
        assert_eq!(
            route_args(&ecmp, 77).join(" "),
            "-4 route replace 198.51.100.5/32 proto 77 nexthop via 198.18.0.11 weight 1 nexthop via 198.18.0.12 weight 1"
        );
        let single = RouteChange::Replace {
            vip: vip(5),
            nexthops: vec![ip(11)],
        };
        assert_eq!(
            route_args(&single, 77).join(" "),
            "-4 route replace 198.51.100.5/32 proto 77 via 198.18.0.11"
        );
        assert_eq!(
            route_args(&RouteChange::Delete { vip: vip(5) }, 200).join(" "),
            "-4 route delete 198.51.100.5/32 proto 200"
        );
        assert_eq!(list_args("-4", 77).join(" "), "-4 route show proto 77");
        let ecmp6 = RouteChange::Replace {
            vip: vip6(5),
            nexthops: vec![ip6(0x11), ip6(0x12)],
        };
        assert_eq!(
            route_args(&ecmp6, 77).join(" "),
            "-6 route replace 2001:db8:51:100::5/128 proto 77 nexthop via 2001:db8:18::11 weight 1 nexthop via 2001:db8:18::12 weight 1"
        );
        assert_eq!(
            route_args(&RouteChange::Delete { vip: vip6(5) }, 77).join(" "),
            "-6 route delete 2001:db8:51:100::5/128 proto 77"
        );
        assert_eq!(list_args("-6", 77).join(" "), "-6 route show proto 77");
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

    #[test]
    fn destinations_parse_from_route_listing() {
        let output = "198.51.100.5 proto 77 \n\tnexthop via 198.18.0.11 dev eth0 weight 1 \n\tnexthop via 198.18.0.12 dev eth0 weight 1 \n198.51.100.6 via 198.18.0.11 dev eth0 proto 77 \n198.51.100.7/32 via 198.18.0.11 dev eth0 proto 77 \ndefault via 198.18.0.1 dev eth0 proto 77\n";
        assert_eq!(parse_destinations(output), vec![vip(5), vip(6), vip(7)]);
        assert!(parse_destinations("").is_empty());
        let output6 = "2001:db8:51:100::5 proto 77 metric 1024 pref medium\n\tnexthop via 2001:db8:18::11 dev ve weight 1 \n\tnexthop via 2001:db8:18::12 dev ve weight 1 \n2001:db8:51:100::6 via 2001:db8:18::11 dev ve proto 77 metric 1024 pref medium\n2001:db8:51:100::7/128 via 2001:db8:18::11 dev ve proto 77\n";
        assert_eq!(parse_destinations(output6), vec![vip6(5), vip6(6), vip6(7)]);
        assert_eq!(
            sysctl_path(IPV6_SYSCTLS.forwarding),
            "/proc/sys/net/ipv6/conf/all/forwarding"
        );
    }
}
