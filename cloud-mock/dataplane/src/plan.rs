//! Decide: from the desired load balancers to the listeners, probes, routes and addresses
//! that realise them, and from what runs now to the changes that converge. Pure.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use crate::failure::{LbFailure, LbFailureReason};
use crate::health::ProbeTarget;
use crate::{BackendHealth, HealthCheck, Listener, LoadBalancer, Mode, Protocol, same_family};

/// Passthrough VIP → the nodes its route leads to (sorted); a desired route always has at
/// least one. `routes::desired_routes` decides it, the routes and the Maglev steering
/// realise it.
pub(crate) type RouteTable = BTreeMap<IpAddr, Vec<IpAddr>>;

/// A socket the proxy binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ListenerKey {
    pub vip: IpAddr,
    pub protocol: Protocol,
    pub port: u16,
}

/// Where a bound listener forwards. Changing it never rebinds the socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ListenerRoute {
    pub lb_id: String,
    pub backend_port: u16,
    /// Of the VIP's family; sorted, without duplicates.
    pub backends: Vec<IpAddr>,
    pub health_check: Option<HealthCheck>,
    /// Of the VIP's family; empty allows every source.
    pub source_ranges: Vec<IpNet>,
}

/// What one passthrough load balancer asks of its VIP's kernel route, before health
/// filtering. Several may share a VIP (with disjoint ports): the route is one per VIP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PassthroughRoute {
    pub lb_id: String,
    /// Of the VIP's family; sorted, without duplicates.
    pub backends: Vec<IpAddr>,
    /// Every distinct health check of the load balancer's listeners.
    pub checks: Vec<HealthCheck>,
}

/// What `backend_health` needs to answer for one load balancer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LbView {
    /// What the edge announces when it can forward them (see `announce`).
    pub vips: Vec<IpAddr>,
    /// In the order the load balancer lists them, without duplicates.
    pub backends: Vec<IpAddr>,
    pub checks: Vec<HealthCheck>,
    /// False when the load balancer was rejected (a conflict): nothing checks it.
    pub realised: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Desired {
    pub listeners: BTreeMap<ListenerKey, ListenerRoute>,
    /// VIP → its passthrough load balancers, by id.
    pub passthrough: BTreeMap<IpAddr, Vec<PassthroughRoute>>,
    pub probes: BTreeSet<ProbeTarget>,
    /// VIPs the data plane must add as local addresses before binding.
    pub addresses: BTreeSet<IpAddr>,
    pub views: HashMap<String, LbView>,
    pub rejected: Vec<LbFailure>,
}

/// Everything that realises `lbs`. Load balancers of one mode may share a VIP on disjoint
/// (protocol, port) pairs. Conflicts are settled by load balancer id: the lowest id keeps
/// the contested VIP or listener, the other load balancer is rejected as a whole.
pub(crate) fn desired_state(lbs: &[LoadBalancer], manage_vip_addresses: bool) -> Desired {
    let mut sorted: Vec<&LoadBalancer> = lbs.iter().collect();
    sorted.sort_by(|a, b| a.id.cmp(&b.id));
    let mut desired = Desired::default();
    let mut vip_owners: HashMap<IpAddr, (Mode, &str)> = HashMap::new();
    let mut listener_owners: HashMap<ListenerKey, &str> = HashMap::new();
    for lb in sorted {
        let backends_in_order = dedup_in_order(&lb.backends);
        let checks: Vec<HealthCheck> = lb
            .listeners
            .iter()
            .filter_map(|l| l.health_check.clone())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let view = LbView {
            vips: lb.vips.clone(),
            backends: backends_in_order.clone(),
            checks: checks.clone(),
            realised: false,
        };
        if desired.views.contains_key(&lb.id) {
            desired
                .rejected
                .push(failure(lb, LbFailureReason::DuplicateId));
            continue;
        }
        if let Err(reason) = check_conflicts(lb, &vip_owners, &listener_owners) {
            desired.rejected.push(failure(lb, reason));
            desired.views.insert(lb.id.clone(), view);
            continue;
        }
        let mut backends = backends_in_order.clone();
        backends.sort_unstable();
        for &vip in &lb.vips {
            vip_owners.entry(vip).or_insert((lb.mode, &lb.id));
            // Each VIP serves its own family: an IPv4 client reaches IPv4 nodes.
            let family_backends: Vec<IpAddr> = backends
                .iter()
                .copied()
                .filter(|&ip| same_family(ip, vip))
                .collect();
            match lb.mode {
                Mode::Proxy => {
                    let source_ranges: Vec<IpNet> = lb
                        .source_ranges
                        .iter()
                        .copied()
                        .filter(|range| same_family(range.addr(), vip))
                        .collect();
                    for listener in &lb.listeners {
                        desired.listeners.insert(
                            listener_key(vip, listener),
                            ListenerRoute {
                                lb_id: lb.id.clone(),
                                backend_port: listener.backend_port,
                                backends: family_backends.clone(),
                                health_check: listener.health_check.clone(),
                                source_ranges: source_ranges.clone(),
                            },
                        );
                    }
                    if manage_vip_addresses && !vip.is_loopback() {
                        desired.addresses.insert(vip);
                    }
                }
                Mode::Passthrough => {
                    desired
                        .passthrough
                        .entry(vip)
                        .or_default()
                        .push(PassthroughRoute {
                            lb_id: lb.id.clone(),
                            backends: family_backends.clone(),
                            checks: checks.clone(),
                        });
                }
            }
            for listener in &lb.listeners {
                listener_owners.insert(listener_key(vip, listener), &lb.id);
            }
            for &ip in &family_backends {
                for check in &checks {
                    desired.probes.insert(ProbeTarget {
                        ip,
                        check: check.clone(),
                    });
                }
            }
        }
        desired.views.insert(
            lb.id.clone(),
            LbView {
                realised: true,
                ..view
            },
        );
    }
    desired
}

fn listener_key(vip: IpAddr, listener: &Listener) -> ListenerKey {
    ListenerKey {
        vip,
        protocol: listener.protocol,
        port: listener.port,
    }
}

fn check_conflicts(
    lb: &LoadBalancer,
    vip_owners: &HashMap<IpAddr, (Mode, &str)>,
    listener_owners: &HashMap<ListenerKey, &str>,
) -> Result<(), LbFailureReason> {
    for &vip in &lb.vips {
        if let Some(&(mode, other)) = vip_owners.get(&vip)
            && mode != lb.mode
        {
            return Err(LbFailureReason::VipTaken {
                vip,
                other: other.to_owned(),
            });
        }
        // Passthrough routes whole packets, ports and all, but the nodes behind
        // demultiplex by port: sharers' ports must not overlap in either mode.
        let mut own = HashSet::new();
        for listener in &lb.listeners {
            let key = listener_key(vip, listener);
            if !own.insert(key) {
                return Err(LbFailureReason::DuplicateListener {
                    protocol: listener.protocol,
                    port: listener.port,
                });
            }
            if let Some(other) = listener_owners.get(&key) {
                return Err(LbFailureReason::ListenerTaken {
                    protocol: listener.protocol,
                    addr: SocketAddr::new(vip, listener.port),
                    other: (*other).to_owned(),
                });
            }
        }
    }
    Ok(())
}

fn failure(lb: &LoadBalancer, reason: LbFailureReason) -> LbFailure {
    LbFailure {
        lb_id: lb.id.clone(),
        reason,
    }
}

fn dedup_in_order(ips: &[IpAddr]) -> Vec<IpAddr> {
    let mut seen = HashSet::new();
    ips.iter().copied().filter(|ip| seen.insert(*ip)).collect()
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ListenerChange {
    Bind(ListenerKey, ListenerRoute),
    /// Same socket, new forwarding: open connections stay.
    Update(ListenerKey, ListenerRoute),
    Unbind(ListenerKey),
}

/// Changes that turn the bound listeners `current` into `desired`; unbinds first.
pub(crate) fn plan_listeners(
    current: &BTreeMap<ListenerKey, ListenerRoute>,
    desired: &BTreeMap<ListenerKey, ListenerRoute>,
) -> Vec<ListenerChange> {
    let unbinds = current
        .keys()
        .filter(|key| !desired.contains_key(key))
        .map(|key| ListenerChange::Unbind(*key));
    let binds_and_updates = desired
        .iter()
        .filter_map(|(key, route)| match current.get(key) {
            None => Some(ListenerChange::Bind(*key, route.clone())),
            Some(running) if running != route => Some(ListenerChange::Update(*key, route.clone())),
            Some(_) => None,
        });
    unbinds.chain(binds_and_updates).collect()
}

/// The probes passthrough routes need alone (when proxy mode checks its backends itself).
pub(crate) fn passthrough_probes(
    passthrough: &BTreeMap<IpAddr, Vec<PassthroughRoute>>,
) -> BTreeSet<ProbeTarget> {
    passthrough
        .values()
        .flatten()
        .flat_map(|route| {
            route.backends.iter().flat_map(|&ip| {
                route.checks.iter().map(move |check| ProbeTarget {
                    ip,
                    check: check.clone(),
                })
            })
        })
        .collect()
}

/// `(to start, to stop)` turning `current` into `desired`.
pub(crate) fn plan_set<T: Ord + Clone>(
    current: &BTreeSet<T>,
    desired: &BTreeSet<T>,
) -> (Vec<T>, Vec<T>) {
    (
        desired.difference(current).cloned().collect(),
        current.difference(desired).cloned().collect(),
    )
}

/// Health of one backend over several checks: unhealthy if any check fails, healthy only
/// if every check passes, healthy when nothing checks it.
pub(crate) fn combined_health(
    checks: &[HealthCheck],
    mut health_of: impl FnMut(&HealthCheck) -> BackendHealth,
) -> BackendHealth {
    let mut combined = BackendHealth::Healthy;
    for check in checks {
        match health_of(check) {
            BackendHealth::Unhealthy => return BackendHealth::Unhealthy,
            BackendHealth::Unknown => combined = BackendHealth::Unknown,
            BackendHealth::Healthy => {}
        }
    }
    combined
}

pub(crate) fn lb_backend_health(
    view: &LbView,
    lookup: impl Fn(&ProbeTarget) -> BackendHealth,
) -> Vec<(IpAddr, BackendHealth)> {
    view.backends
        .iter()
        .map(|&ip| {
            let health = if view.realised {
                combined_health(&view.checks, |check| {
                    lookup(&ProbeTarget {
                        ip,
                        check: check.clone(),
                    })
                })
            } else {
                BackendHealth::Unknown
            };
            (ip, health)
        })
        .collect()
}

/// Whether a client at `source` may use a load balancer with these source ranges.
pub(crate) fn source_allowed(ranges: &[IpNet], source: IpAddr) -> bool {
    ranges.is_empty() || ranges.iter().any(|range| range.contains(&source))
}

/// Order in which to try `len` backends for the `turn`-th new connection: round-robin
/// start, then the others in turn (so a failed connect falls through to the next).
pub(crate) fn try_order(len: usize, turn: usize) -> impl Iterator<Item = usize> {
    let start = if len == 0 { 0 } else { turn % len };
    (0..len).map(move |i| (start + i) % len)
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use proptest::prelude::*;

    use super::*;

    fn ip(last: u8) -> IpAddr {
        Ipv4Addr::new(198, 18, 0, last).into()
    }

    fn ip6(last: u16) -> IpAddr {
        Ipv6Addr::new(0x2001, 0xdb8, 0x18, 0, 0, 0, 0, last).into()
    }

    fn vip4(last: u8) -> IpAddr {
        Ipv4Addr::new(198, 51, 100, last).into()
    }

    fn vip6(last: u16) -> IpAddr {
        Ipv6Addr::new(0x2001, 0xdb8, 0x51, 0x100, 0, 0, 0, last).into()
    }

    fn http_check() -> HealthCheck {
        HealthCheck::Http {
            port: 10256,
            path: "/healthz".to_owned(),
        }
    }

    fn lb(id: &str, vip: u8, mode: Mode, ports: &[(Protocol, u16)]) -> LoadBalancer {
        LoadBalancer {
            id: id.to_owned(),
            vips: vec![vip4(vip)],
            mode,
            listeners: ports
                .iter()
                .map(|&(protocol, port)| Listener {
                    protocol,
                    port,
                    backend_port: 30000 + port,
                    health_check: Some(http_check()),
                })
                .collect(),
            backends: vec![ip(12), ip(11), ip(12)],
            source_ranges: vec![],
        }
    }

    #[test]
    fn proxy_lb_becomes_listeners_probes_and_addresses() {
        let desired = desired_state(
            &[lb(
                "lb-a",
                5,
                Mode::Proxy,
                &[(Protocol::Tcp, 80), (Protocol::Udp, 53)],
            )],
            true,
        );
        assert_eq!(desired.listeners.len(), 2);
        let route = &desired.listeners[&ListenerKey {
            vip: vip4(5),
            protocol: Protocol::Tcp,
            port: 80,
        }];
        assert_eq!(route.backends, vec![ip(11), ip(12)]);
        assert_eq!(route.backend_port, 30080);
        assert_eq!(
            desired.probes.len(),
            2,
            "one probe per backend and distinct check"
        );
        assert_eq!(
            desired.addresses.iter().copied().collect::<Vec<_>>(),
            vec![vip4(5)]
        );
        assert!(desired.passthrough.is_empty());
        assert_eq!(desired.views["lb-a"].backends, vec![ip(12), ip(11)]);
        assert!(desired.rejected.is_empty());
    }

    #[test]
    fn each_vip_of_a_dual_stack_lb_serves_its_own_family() {
        let mut dual = lb("lb-d", 5, Mode::Proxy, &[(Protocol::Tcp, 80)]);
        dual.vips = vec![vip6(5), vip4(5)];
        dual.backends = vec![ip(11), ip6(11), ip(12), ip6(12)];
        dual.source_ranges = vec![
            "203.0.113.0/24".parse().unwrap(),
            "2001:db8:203::/64".parse().unwrap(),
            "2001:db8:204::/64".parse().unwrap(),
        ];
        let desired = desired_state(&[dual.clone()], true);
        let route = |vip| {
            &desired.listeners[&ListenerKey {
                vip,
                protocol: Protocol::Tcp,
                port: 80,
            }]
        };
        assert_eq!(route(vip4(5)).backends, vec![ip(11), ip(12)]);
        assert_eq!(route(vip6(5)).backends, vec![ip6(11), ip6(12)]);
        assert_eq!(
            route(vip4(5)).source_ranges,
            vec!["203.0.113.0/24".parse::<IpNet>().unwrap()]
        );
        assert_eq!(route(vip6(5)).source_ranges.len(), 2);
        assert_eq!(
            desired.addresses,
            BTreeSet::from([vip4(5), vip6(5)]),
            "both VIPs become addresses"
        );
        assert_eq!(desired.probes.len(), 4, "every backend of both families");
        assert_eq!(
            desired.views["lb-d"].backends, dual.backends,
            "health in the LB's order"
        );

        // Ranges of one family only: the other VIP is open, as kube-proxy does it.
        dual.source_ranges = vec!["203.0.113.0/24".parse().unwrap()];
        let desired = desired_state(&[dual.clone()], false);
        assert!(
            desired
                .listeners
                .iter()
                .any(|(key, route)| key.vip == vip6(5) && route.source_ranges.is_empty())
        );

        dual.mode = Mode::Passthrough;
        let desired = desired_state(&[dual], false);
        assert_eq!(
            desired.passthrough[&vip6(5)][0].backends,
            vec![ip6(11), ip6(12)]
        );
        assert_eq!(
            desired.passthrough[&vip4(5)][0].backends,
            vec![ip(11), ip(12)]
        );
    }

    #[test]
    fn a_vip_of_either_family_conflicts_like_an_ipv4_one() {
        let mut a = lb("lb-a", 5, Mode::Proxy, &[(Protocol::Tcp, 80)]);
        a.vips = vec![vip4(5), vip6(5)];
        let mut b = lb("lb-b", 6, Mode::Proxy, &[(Protocol::Tcp, 80)]);
        b.vips = vec![vip4(6), vip6(5)];
        let desired = desired_state(&[b, a], false);
        let rejected: Vec<String> = desired.rejected.iter().map(ToString::to_string).collect();
        assert_eq!(
            rejected,
            vec![
                "load balancer lb-b: TCP [2001:db8:51:100::5]:80 is already served by load balancer lb-a"
                    .to_owned()
            ]
        );
        assert!(
            !desired.listeners.keys().any(|key| key.vip == vip4(6)),
            "a rejected LB is rejected as a whole, both families"
        );
    }

    #[test]
    fn loopback_vips_and_unmanaged_addresses_need_no_address() {
        let mut loopback = lb("lb-a", 5, Mode::Proxy, &[(Protocol::Tcp, 80)]);
        loopback.vips = vec![Ipv4Addr::new(127, 77, 0, 9).into()];
        assert!(desired_state(&[loopback], true).addresses.is_empty());
        let other = lb("lb-b", 5, Mode::Proxy, &[(Protocol::Tcp, 80)]);
        assert!(desired_state(&[other], false).addresses.is_empty());
    }

    #[test]
    fn passthrough_lb_becomes_a_route_and_binds_nothing() {
        let desired = desired_state(
            &[lb("lb-p", 7, Mode::Passthrough, &[(Protocol::Tcp, 80)])],
            true,
        );
        assert!(desired.listeners.is_empty());
        assert!(desired.addresses.is_empty());
        let route = &desired.passthrough[&vip4(7)][0];
        assert_eq!(route.backends, vec![ip(11), ip(12)]);
        assert_eq!(route.checks, vec![http_check()]);
    }

    #[test]
    fn conflicts_reject_the_higher_id_only() {
        let desired = desired_state(
            &[
                lb("lb-b", 5, Mode::Proxy, &[(Protocol::Tcp, 80)]),
                lb(
                    "lb-a",
                    5,
                    Mode::Proxy,
                    &[(Protocol::Tcp, 80), (Protocol::Tcp, 443)],
                ),
                lb("lb-c", 5, Mode::Proxy, &[(Protocol::Udp, 80)]),
                lb("lb-d", 5, Mode::Passthrough, &[]),
                lb("lb-e", 6, Mode::Passthrough, &[(Protocol::Tcp, 53)]),
                lb("lb-f", 6, Mode::Passthrough, &[(Protocol::Tcp, 53)]),
                lb("lb-h", 6, Mode::Passthrough, &[(Protocol::Udp, 53)]),
                lb(
                    "lb-g",
                    8,
                    Mode::Proxy,
                    &[(Protocol::Tcp, 80), (Protocol::Tcp, 80)],
                ),
                lb("lb-a", 9, Mode::Proxy, &[(Protocol::Tcp, 80)]),
            ],
            false,
        );
        let rejected: Vec<(&str, String)> = desired
            .rejected
            .iter()
            .map(|f| (f.lb_id.as_str(), f.reason.to_string()))
            .collect();
        assert_eq!(
            rejected,
            vec![
                ("lb-a", "id given twice in the desired set".to_owned()),
                (
                    "lb-b",
                    "TCP 198.51.100.5:80 is already served by load balancer lb-a".to_owned()
                ),
                (
                    "lb-d",
                    "VIP 198.51.100.5 is already used by load balancer lb-a in the other mode"
                        .to_owned()
                ),
                (
                    "lb-f",
                    "TCP 198.51.100.6:53 is already served by load balancer lb-e".to_owned()
                ),
                ("lb-g", "TCP listener on port 80 is given twice".to_owned()),
            ]
        );
        // Two load balancers of one mode may share a VIP on different ports.
        assert_eq!(desired.listeners.len(), 3);
        let sharers: Vec<&str> = desired.passthrough[&vip4(6)]
            .iter()
            .map(|route| route.lb_id.as_str())
            .collect();
        assert_eq!(sharers, vec!["lb-e", "lb-h"]);
        assert!(!desired.views["lb-b"].realised);
        assert!(desired.views["lb-c"].realised);
        assert!(
            lb_backend_health(&desired.views["lb-b"], |_| BackendHealth::Healthy)
                .iter()
                .all(|(_, h)| *h == BackendHealth::Unknown)
        );
    }

    #[test]
    fn listener_plan_binds_updates_and_unbinds() {
        let key = |port| ListenerKey {
            vip: Ipv4Addr::new(127, 77, 0, 1).into(),
            protocol: Protocol::Tcp,
            port,
        };
        let route = |backend_port| ListenerRoute {
            lb_id: "lb-a".to_owned(),
            backend_port,
            backends: vec![ip(11)],
            health_check: None,
            source_ranges: vec![],
        };
        let current = BTreeMap::from([(key(1), route(1)), (key(2), route(2)), (key(3), route(3))]);
        let desired = BTreeMap::from([(key(2), route(2)), (key(3), route(33)), (key(4), route(4))]);
        assert_eq!(
            plan_listeners(&current, &desired),
            vec![
                ListenerChange::Unbind(key(1)),
                ListenerChange::Update(key(3), route(33)),
                ListenerChange::Bind(key(4), route(4)),
            ]
        );
        assert!(plan_listeners(&desired, &desired).is_empty());
    }

    #[test]
    fn health_combines_over_checks() {
        let tcp = HealthCheck::Tcp { port: 1 };
        let http = http_check();
        let checks = [tcp.clone(), http.clone()];
        let with = |t: BackendHealth, h: BackendHealth| {
            combined_health(&checks, |c| if *c == tcp { t } else { h })
        };
        use BackendHealth::{Healthy as H, Unhealthy as U, Unknown as N};
        assert_eq!(with(H, H), H);
        assert_eq!(with(H, N), N);
        assert_eq!(with(N, U), U);
        assert_eq!(with(U, H), U);
        assert_eq!(combined_health(&[], |_| U), H, "nothing checks it: healthy");
    }

    #[test]
    fn source_ranges() {
        let ranges: Vec<IpNet> = vec![
            "127.0.0.0/30".parse().unwrap(),
            "10.0.0.0/8".parse().unwrap(),
        ];
        let v4 = |a, b, c, d| IpAddr::from(Ipv4Addr::new(a, b, c, d));
        assert!(source_allowed(&ranges, v4(127, 0, 0, 3)));
        assert!(!source_allowed(&ranges, v4(127, 0, 0, 4)));
        assert!(source_allowed(&ranges, v4(10, 200, 0, 1)));
        assert!(source_allowed(&[], v4(203, 0, 113, 9)));
        let v6: Vec<IpNet> = vec!["2001:db8:203::/64".parse().unwrap()];
        assert!(source_allowed(&v6, "2001:db8:203::9".parse().unwrap()));
        assert!(!source_allowed(&v6, "2001:db8:192::9".parse().unwrap()));
    }

    #[test]
    fn try_order_rotates_and_covers_all() {
        assert_eq!(try_order(3, 4).collect::<Vec<_>>(), vec![1, 2, 0]);
        assert_eq!(try_order(0, 4).count(), 0);
    }

    fn arb_routes() -> impl Strategy<Value = BTreeMap<ListenerKey, ListenerRoute>> {
        prop::collection::btree_map(
            (0_u8..4, any::<bool>(), 1_u16..6).prop_map(|(vip, udp, port)| ListenerKey {
                vip: Ipv4Addr::new(127, 77, 0, vip).into(),
                protocol: if udp { Protocol::Udp } else { Protocol::Tcp },
                port,
            }),
            (1_u16..4, prop::collection::vec(0_u8..4, 0..3)).prop_map(
                |(backend_port, backends)| ListenerRoute {
                    lb_id: "lb".to_owned(),
                    backend_port,
                    backends: backends.into_iter().map(ip).collect(),
                    health_check: None,
                    source_ranges: vec![],
                },
            ),
            0..8,
        )
    }

    proptest! {
        #[test]
        fn listener_plan_converges(current in arb_routes(), desired in arb_routes()) {
            let mut running = current.clone();
            for change in plan_listeners(&current, &desired) {
                match change {
                    ListenerChange::Bind(key, route) => {
                        prop_assert!(running.insert(key, route).is_none(), "bind of a bound key");
                    }
                    ListenerChange::Update(key, route) => {
                        prop_assert!(running.insert(key, route).is_some(), "update of an unbound key");
                    }
                    ListenerChange::Unbind(key) => {
                        prop_assert!(running.remove(&key).is_some(), "unbind of an unbound key");
                    }
                }
            }
            prop_assert_eq!(&running, &desired);
            prop_assert!(plan_listeners(&desired, &desired).is_empty());
        }

        #[test]
        fn set_plan_converges(current in prop::collection::btree_set(0_u8..10, 0..6),
                              desired in prop::collection::btree_set(0_u8..10, 0..6)) {
            let (start, stop) = plan_set(&current, &desired);
            let mut running = current.clone();
            for item in stop { prop_assert!(running.remove(&item)); }
            for item in start { prop_assert!(running.insert(item)); }
            prop_assert_eq!(running, desired);
        }
    }
}
