//! Decide, for HAProxy: which sections serve which listener, and whether HAProxy gets
//! there through its runtime API or needs a reload. Pure.
//!
//! HAProxy 2.6 cannot add binds or backends at run time, only servers and the entries of
//! maps and ACLs, so the sections are laid out for that, as HAProxy's own Kubernetes
//! ingress controller lays out its own:
//! - One frontend per port and family, bound on every address of the family. A map from
//!   VIP to backend picks the backend; a VIP not in the map is refused. A new VIP on a
//!   port already bound is one map entry. A port that other sockets of the edge listen on
//!   (its API) cannot be bound on every address: there a frontend binds one VIP, and a
//!   new VIP on that port is a new frontend.
//! - Backends are numbered sections made ahead of need, each for one way of checking its
//!   servers (`option httpchk` and its path are section settings, not server ones). A new
//!   listener takes an empty backend of its kind, and gets its servers and source ranges
//!   at run time.
//! - A reload is needed only for a frontend not bound yet, or when no empty backend of a
//!   kind is left. It binds exactly the frontends in use and leaves, for each kind in use,
//!   [`SPARE_BACKENDS`] or as many empty backends as there are listeners of the kind,
//!   whichever is more: the reloads for backends get rarer as the edge grows (their
//!   number grows with the logarithm of the listeners).
//! - A listener keeps its backend (and number) as long as its servers' lines stay the
//!   same; one whose backend port or check changes moves to an empty backend, as a new one.
//!
//! A frontend whose last listener went stays bound until a reload for another reason:
//! unbinding it would take a reload of its own.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;

use super::proxy::Proxy;
use crate::HealthCheck;
use crate::metrics::ReloadReason;

/// Empty backends a reload leaves at least, per kind in use. Each costs HAProxy about
/// 14 KB and a reload about 0.1 ms (HAProxy 2.6: a reload with 128 empty backends takes
/// 80 ms against 65 ms with none), so that a burst of this many new listeners on bound
/// ports takes no reload.
pub(crate) const SPARE_BACKENDS: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Family {
    V4,
    V6,
}

/// A port of one family on every address of the edge, bound once: the VIPs on it are
/// entries of its map. Or, on a port shared with other sockets, that port on one VIP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Frontend {
    pub port: u16,
    pub family: Family,
    /// The one address bound, on a shared port; every address of the family when `None`.
    pub vip: Option<IpAddr>,
}

impl Frontend {
    pub fn of(proxy: &Proxy) -> Self {
        Self {
            port: proxy.bind.port(),
            family: if proxy.bind.is_ipv4() {
                Family::V4
            } else {
                Family::V6
            },
            vip: proxy.bound_alone.then(|| proxy.bind.ip()),
        }
    }

    /// Letters, digits and `-` only, as HAProxy's section and file names take them.
    pub fn name(self) -> String {
        let family = match self.family {
            Family::V4 => "v4",
            Family::V6 => "v6",
        };
        match self.vip {
            None => format!("port-{}-{family}", self.port),
            Some(vip) => {
                let vip = vip.to_string().replace(['.', ':'], "-");
                format!("port-{}-{family}-{vip}", self.port)
            }
        }
    }
}

/// How a backend checks its servers, fixed when it is rendered. A TCP backend takes
/// unchecked listeners too (servers without `check` are not checked).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Checks {
    Tcp,
    Http { path: String },
}

impl Checks {
    pub fn of(proxy: &Proxy) -> Self {
        match &proxy.health_check {
            Some(HealthCheck::Http { path, .. }) => Self::Http { path: path.clone() },
            Some(HealthCheck::Tcp { .. }) | None => Self::Tcp,
        }
    }
}

/// One numbered backend section: empty, or serving one listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Backend {
    pub checks: Checks,
    pub proxy: Option<Proxy>,
}

pub(crate) fn backend_name(number: u32) -> String {
    format!("backend-{number}")
}

/// What HAProxy runs: its frontends, and its backends by number.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Layout {
    pub frontends: BTreeSet<Frontend>,
    pub backends: BTreeMap<u32, Backend>,
}

impl Layout {
    /// The listeners served, with the number of the backend of each.
    pub fn proxies(&self) -> impl Iterator<Item = (u32, &Proxy)> {
        self.backends
            .iter()
            .filter_map(|(&number, backend)| Some((number, backend.proxy.as_ref()?)))
    }

    /// Each frontend's map: the backend of every VIP on it.
    pub fn routes(&self) -> BTreeMap<(Frontend, IpAddr), u32> {
        self.proxies()
            .map(|(number, proxy)| ((Frontend::of(proxy), proxy.bind.ip()), number))
            .collect()
    }
}

/// How to get from the running layout to the desired listeners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Where runtime commands alone lead: the running frontends and backends, with every
    /// listener that is gone taken out, every kept one with its servers and source ranges
    /// as desired, and every new one that a bound frontend and an empty backend can take.
    pub run_time: Layout,
    /// When listeners are left over: the layout a reload makes from `run_time`, and why.
    pub reload: Option<(Layout, ReloadReason)>,
}

/// The plan from `running` to `desired` (listeners by name).
///
/// New listeners take only backends that are empty in `running`: one emptied by this plan
/// still drains its sessions while the runtime commands run.
pub(crate) fn plan(running: &Layout, desired: &BTreeMap<String, Proxy>) -> Plan {
    let mut run_time = Layout {
        frontends: running.frontends.clone(),
        backends: BTreeMap::new(),
    };
    let mut placed = BTreeSet::new();
    let mut empty: BTreeMap<&Checks, VecDeque<u32>> = BTreeMap::new();
    for (&number, backend) in &running.backends {
        let kept = backend.proxy.as_ref().and_then(|have| {
            let name = have.name();
            let want = desired
                .get(&name)
                .filter(|want| have.same_server_lines(want))?;
            placed.insert(name);
            Some(want.clone())
        });
        if backend.proxy.is_none() {
            empty.entry(&backend.checks).or_default().push_back(number);
        }
        run_time.backends.insert(
            number,
            Backend {
                checks: backend.checks.clone(),
                proxy: kept,
            },
        );
    }
    let mut reason = None;
    for (name, want) in desired {
        if placed.contains(name) {
            continue;
        }
        if !run_time.frontends.contains(&Frontend::of(want)) {
            reason = Some(ReloadReason::NewFrontend);
            continue;
        }
        let backend = empty
            .get_mut(&Checks::of(want))
            .and_then(VecDeque::pop_front)
            .and_then(|number| run_time.backends.get_mut(&number));
        match backend {
            Some(backend) => backend.proxy = Some(want.clone()),
            None => reason = reason.or(Some(ReloadReason::NoSpareBackend)),
        }
    }
    let reload = reason.map(|reason| (reloaded(&run_time, desired), reason));
    Plan { run_time, reload }
}

/// The layout an HAProxy that runs sections this edge does not know reloads to.
pub(crate) fn fresh(desired: &BTreeMap<String, Proxy>) -> Layout {
    reloaded(&Layout::default(), desired)
}

/// The layout a reload makes from `base`: the frontends of `desired`; every desired
/// listener in its backend of `base`, or else in an empty one of its kind; then the spare
/// backends of every kind in use (see the module's notes). Empty backends of `base` are
/// reused before new ones are numbered (from the lowest free number); the rest are dropped.
fn reloaded(base: &Layout, desired: &BTreeMap<String, Proxy>) -> Layout {
    let mut layout = Layout {
        frontends: desired.values().map(Frontend::of).collect(),
        backends: BTreeMap::new(),
    };
    let mut empty: BTreeMap<Checks, VecDeque<u32>> = BTreeMap::new();
    for (&number, backend) in &base.backends {
        match &backend.proxy {
            Some(proxy) if desired.get(&proxy.name()) == Some(proxy) => {
                layout.backends.insert(number, backend.clone());
            }
            _ => empty
                .entry(backend.checks.clone())
                .or_default()
                .push_back(number),
        }
    }
    let served: BTreeSet<String> = layout.proxies().map(|(_, proxy)| proxy.name()).collect();
    // Backends still to number, in order.
    let mut unnumbered = Vec::new();
    let mut place = |layout: &mut Layout, backend: Backend| match empty
        .get_mut(&backend.checks)
        .and_then(VecDeque::pop_front)
    {
        Some(number) => {
            layout.backends.insert(number, backend);
        }
        None => unnumbered.push(backend),
    };
    let mut in_use: BTreeMap<Checks, usize> = BTreeMap::new();
    for proxy in desired.values() {
        *in_use.entry(Checks::of(proxy)).or_default() += 1;
        if !served.contains(&proxy.name()) {
            let backend = Backend {
                checks: Checks::of(proxy),
                proxy: Some(proxy.clone()),
            };
            place(&mut layout, backend);
        }
    }
    for (checks, listeners) in in_use {
        for _ in 0..SPARE_BACKENDS.max(listeners) {
            let backend = Backend {
                checks: checks.clone(),
                proxy: None,
            };
            place(&mut layout, backend);
        }
    }
    let mut number = 0;
    for backend in unnumbered {
        while layout.backends.contains_key(&number) {
            number += 1;
        }
        layout.backends.insert(number, backend);
    }
    layout
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proxy(lb: &str, bind: &str, servers: &[&str]) -> Proxy {
        Proxy {
            lb_id: lb.into(),
            bind: bind.parse().unwrap(),
            backend_port: 31000,
            health_check: Some(HealthCheck::Http {
                port: 32000,
                path: "/healthz".into(),
            }),
            source_ranges: Vec::new(),
            servers: servers.iter().map(|s| s.parse().unwrap()).collect(),
            bound_alone: false,
        }
    }

    fn desired(proxies: &[&Proxy]) -> BTreeMap<String, Proxy> {
        proxies
            .iter()
            .map(|&proxy| (proxy.name(), proxy.clone()))
            .collect()
    }

    fn http() -> Checks {
        Checks::Http {
            path: "/healthz".into(),
        }
    }

    /// Backends of `layout` by kind: (serving, empty).
    fn counts(layout: &Layout, checks: &Checks) -> (usize, usize) {
        let of_kind = layout.backends.values().filter(|b| b.checks == *checks);
        let serving = of_kind.clone().filter(|b| b.proxy.is_some()).count();
        (serving, of_kind.count() - serving)
    }

    #[test]
    fn the_first_listener_on_a_port_takes_a_reload_that_leaves_spare_backends() {
        let a = proxy("lb-a", "198.51.100.1:80", &["198.18.0.11"]);
        let plan = plan(&Layout::default(), &desired(&[&a]));
        assert_eq!(plan.run_time, Layout::default());
        let (layout, reason) = plan.reload.unwrap();
        assert_eq!(reason, ReloadReason::NewFrontend);
        assert_eq!(
            layout.frontends,
            BTreeSet::from([Frontend {
                port: 80,
                family: Family::V4,
                vip: None,
            }])
        );
        assert_eq!(layout.proxies().collect::<Vec<_>>(), [(0, &a)]);
        assert_eq!(counts(&layout, &http()), (1, SPARE_BACKENDS));
        assert_eq!(layout.backends.len(), 1 + SPARE_BACKENDS);
        assert_eq!(fresh(&desired(&[&a])), layout);
    }

    #[test]
    fn a_new_listener_on_a_bound_port_is_a_run_time_change() {
        let a = proxy("lb-a", "198.51.100.1:80", &["198.18.0.11"]);
        let b = proxy("lb-b", "198.51.100.2:80", &["198.18.0.11", "198.18.0.12"]);
        let running = fresh(&desired(&[&a]));
        let plan = plan(&running, &desired(&[&a, &b]));
        assert_eq!(plan.reload, None);
        assert_eq!(plan.run_time.frontends, running.frontends);
        assert_eq!(
            plan.run_time.proxies().collect::<Vec<_>>(),
            [(0, &a), (1, &b)],
            "b takes the lowest empty backend"
        );
        let v4 = |port| Frontend {
            port,
            family: Family::V4,
            vip: None,
        };
        assert_eq!(
            plan.run_time.routes(),
            BTreeMap::from([((v4(80), a.bind.ip()), 0), ((v4(80), b.bind.ip()), 1)])
        );

        // Its nodes and source ranges change in place; going empties its backend, which
        // stays for the next one, and its frontend stays bound.
        let mut b2 = b.clone();
        b2.servers.pop();
        b2.source_ranges = vec!["203.0.113.0/24".parse().unwrap()];
        let changed = super::plan(&plan.run_time, &desired(&[&a, &b2]));
        assert_eq!(changed.reload, None);
        assert_eq!(
            changed.run_time.proxies().collect::<Vec<_>>(),
            [(0, &a), (1, &b2)]
        );
        let gone = super::plan(&changed.run_time, &desired(&[&b2]));
        assert_eq!(gone.reload, None);
        assert_eq!(gone.run_time.proxies().collect::<Vec<_>>(), [(1, &b2)]);
        assert_eq!(gone.run_time.backends.len(), running.backends.len());
        let none = super::plan(&gone.run_time, &BTreeMap::new());
        assert_eq!(none.reload, None);
        assert_eq!(none.run_time.frontends, running.frontends);
        assert_eq!(none.run_time.proxies().count(), 0);
    }

    #[test]
    fn a_listener_whose_server_lines_change_moves_and_its_backend_is_not_reused_at_once() {
        let a = proxy("lb-a", "198.51.100.1:80", &["198.18.0.11"]);
        let running = fresh(&desired(&[&a]));
        let mut moved = a.clone();
        moved.backend_port = 31001;
        let b = proxy("lb-b", "198.51.100.2:80", &[]);
        let plan = plan(&running, &desired(&[&moved, &b]));
        assert_eq!(plan.reload, None);
        assert_eq!(
            plan.run_time.proxies().collect::<Vec<_>>(),
            [(1, &moved), (2, &b)],
            "backend 0 drains a's old servers"
        );
        // A new kind of check: no empty backend of it.
        let mut tcp = a.clone();
        tcp.health_check = Some(HealthCheck::Tcp { port: 10256 });
        let plan = super::plan(&running, &desired(&[&tcp]));
        let (layout, reason) = plan.reload.unwrap();
        assert_eq!(reason, ReloadReason::NoSpareBackend);
        assert_eq!(plan.run_time.proxies().count(), 0, "a left backend 0");
        assert_eq!(counts(&layout, &Checks::Tcp), (1, SPARE_BACKENDS));
        assert_eq!(
            counts(&layout, &http()),
            (0, 0),
            "kinds no longer in use are dropped"
        );
    }

    #[test]
    fn reloads_keep_every_listener_s_backend_and_grow_the_spares_with_the_listeners() {
        // One listener and its spares fill this many backends.
        let capacity = 1 + SPARE_BACKENDS;
        let listeners: Vec<Proxy> = (0..=capacity)
            .map(|i| {
                let host = u8::try_from(i % 250).unwrap();
                let bind = format!("198.51.{}.{host}:80", 100 + i / 250);
                proxy(&format!("lb-{i}"), &bind, &["198.18.0.11"])
            })
            .collect();
        let mut running = fresh(&desired(&[&listeners[0]]));
        for count in 2..=capacity {
            let all: Vec<&Proxy> = listeners[..count].iter().collect();
            let plan = plan(&running, &desired(&all));
            assert_eq!(plan.reload, None, "{count} listeners fit the spares");
            running = plan.run_time;
        }
        let all: Vec<&Proxy> = listeners.iter().collect();
        let plan = plan(&running, &desired(&all));
        assert_eq!(plan.run_time.proxies().count(), capacity);
        let (layout, reason) = plan.reload.unwrap();
        assert_eq!(reason, ReloadReason::NoSpareBackend);
        for (number, proxy) in plan.run_time.proxies() {
            assert_eq!(
                layout.backends[&number].proxy.as_ref(),
                Some(proxy),
                "a reload moves no listener"
            );
        }
        assert_eq!(
            counts(&layout, &http()),
            (capacity + 1, capacity + 1),
            "as many spares as listeners once they outnumber the floor"
        );

        // A new port with spares left: only the frontend is added; the backends stay.
        let other_port = proxy("lb-x", "198.51.100.1:443", &[]);
        let mut some = desired(&[&listeners[0], &other_port]);
        let first = fresh(&desired(&[&listeners[0]]));
        let plan = super::plan(&first, &some);
        let (layout, reason) = plan.reload.unwrap();
        assert_eq!(reason, ReloadReason::NewFrontend);
        assert_eq!(layout.frontends.len(), 2);
        assert_eq!(layout.proxies().collect::<Vec<_>>()[0], (0, &listeners[0]));
        assert_eq!(counts(&layout, &http()), (2, SPARE_BACKENDS));
        // And a reload binds only the frontends in use.
        some.remove(&listeners[0].name());
        let dropped = super::plan(&layout, &some);
        assert_eq!(dropped.reload, None);
        assert_eq!(dropped.run_time.frontends.len(), 2);
        assert_eq!(fresh(&some).frontends.len(), 1);
    }
}
