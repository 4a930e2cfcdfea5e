//! Render, for HAProxy: a [`Layout`] as HAProxy's configuration file and the map and ACL
//! files it reads, and the runtime commands that turn one layout into another. Pure.
//!
//! The files always hold the whole layout (every server, map entry and source range), so
//! a reload or a restart rebuilds what the runtime commands built.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;

use super::layout::{Checks, Family, Frontend, Layout, backend_name};
use super::proxy::{CheckTiming, Proxy};
use crate::HealthCheck;

/// Settings of the configuration that are not load balancers.
#[derive(Debug, Clone)]
pub(crate) struct Globals<'a> {
    /// Where the map and ACL files live (the state directory, a plain path).
    pub dir: &'a Path,
    /// The runtime API's socket (local to the edge: a Unix socket, mode 600).
    pub runtime_socket: &'a Path,
    pub connect_timeout: Duration,
    pub timing: CheckTiming,
}

/// A frontend's map: a `VIP backend-N` line for each VIP on it.
fn map_path(dir: &Path, frontend: Frontend) -> PathBuf {
    dir.join(format!("{}.map", frontend.name()))
}

/// A backend's ACL: the source ranges it admits, one a line.
fn acl_path(dir: &Path, number: u32) -> PathBuf {
    dir.join(format!("{}.acl", backend_name(number)))
}

/// The patterns of the ACL of a backend serving `proxy`: its source ranges, or every
/// source when it names none; an empty backend admits none.
fn admitted(proxy: Option<&Proxy>) -> BTreeSet<String> {
    match proxy {
        None => BTreeSet::new(),
        Some(proxy) if proxy.source_ranges.is_empty() => {
            BTreeSet::from(["0.0.0.0/0".to_owned(), "::/0".to_owned()])
        }
        Some(proxy) => proxy.source_ranges.iter().map(IpNet::to_string).collect(),
    }
}

/// The configuration file of `layout`.
pub(crate) fn config(globals: &Globals<'_>, layout: &Layout) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "# Rendered by cloud-mock from its store at every change, with the map and ACL files\n\
         # beside it; edits are overwritten.\n\
         global\n    \
             stats socket {socket} mode 600 level admin\n    \
             stats timeout 30s\n\
         \n\
         defaults\n    \
             mode tcp\n    \
             balance roundrobin\n    \
             option redispatch\n    \
             retries 2\n    \
             timeout connect {connect}\n    \
             timeout client 1h\n    \
             timeout server 1h\n    \
             timeout check {check}\n",
        socket = globals.runtime_socket.display(),
        connect = millis(globals.connect_timeout),
        check = millis(globals.timing.timeout),
    );
    for &frontend in &layout.frontends {
        let bind = match (frontend.vip, frontend.family) {
            (Some(vip), _) => SocketAddr::new(vip, frontend.port).to_string(),
            (None, Family::V4) => format!("0.0.0.0:{}", frontend.port),
            (None, Family::V6) => format!("[::]:{} v6only", frontend.port),
        };
        let map = map_path(globals.dir, frontend);
        let _ = write!(
            out,
            "\nfrontend {name}\n    \
                 bind {bind}\n    \
                 tcp-request connection reject unless {{ dst,map_ip({map}) -m found }}\n    \
                 use_backend %[dst,map_ip({map})]\n",
            name = frontend.name(),
            map = map.display(),
        );
    }
    for (&number, backend) in &layout.backends {
        let _ = writeln!(out, "\nbackend {}", backend_name(number));
        if let Some(proxy) = &backend.proxy {
            let _ = writeln!(out, "    # {} on {}", proxy.name(), proxy.bind);
        }
        if let Checks::Http { path } = &backend.checks {
            let _ = write!(
                out,
                "    option httpchk\n    \
                     http-check send meth GET uri {path}\n    \
                     http-check expect status 200\n"
            );
        }
        let _ = write!(
            out,
            "    option allbackups\n    \
                 tcp-request content reject unless {{ src -f {} }}\n",
            acl_path(globals.dir, number).display()
        );
        let Some(proxy) = &backend.proxy else {
            continue;
        };
        for &server in &proxy.servers {
            let _ = writeln!(
                out,
                "    server {server} {}",
                server_line(proxy, server, globals.timing)
            );
        }
        if proxy.fail_open() {
            for &server in &proxy.servers {
                let _ = writeln!(
                    out,
                    "    server {} {}",
                    backup_name(server),
                    backup_line(proxy, server)
                );
            }
        }
    }
    out
}

/// The map and ACL files the configuration of `layout` reads, by path.
pub(crate) fn pattern_files(dir: &Path, layout: &Layout) -> BTreeMap<PathBuf, String> {
    let mut files: BTreeMap<PathBuf, String> = layout
        .frontends
        .iter()
        .map(|&frontend| (map_path(dir, frontend), String::new()))
        .collect();
    for ((frontend, vip), number) in layout.routes() {
        let map = files.entry(map_path(dir, frontend)).or_default();
        let _ = writeln!(map, "{vip} {}", backend_name(number));
    }
    for (&number, backend) in &layout.backends {
        let patterns = admitted(backend.proxy.as_ref());
        let text = patterns
            .iter()
            .map(|pattern| format!("{pattern}\n"))
            .collect();
        files.insert(acl_path(dir, number), text);
    }
    files
}

/// Runtime API commands that turn the running layout into the next, in two steps with a
/// drain between them (see [`runtime_commands`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RuntimeCommands {
    /// New source ranges and servers first, then the map entries that route to them,
    /// then the map entries and ranges that go, then the servers that go put in
    /// maintenance: they take no new connection, and the ones they carry go on.
    pub before_drain: Vec<String>,
    /// The servers that go and can carry sessions, as `(backend, address)`: the drain
    /// waits for their sessions to end.
    pub draining: Vec<(String, IpAddr)>,
    /// After the drain: what is left of their sessions shut, and the servers deleted.
    pub after_drain: Vec<String>,
}

impl RuntimeCommands {
    pub fn len(&self) -> usize {
        self.before_drain.len() + self.after_drain.len()
    }
}

/// Runtime API commands from `running` to `next`, two layouts with the same frontends and
/// backends (a plan's run-time step). A backend changes listener only through being
/// empty; the listener it keeps has the same server lines (see `layout::plan`), so its
/// servers differ by address alone.
///
/// A route appears only once its backend has its servers and source ranges, and goes
/// before its servers do. A server that goes is put in maintenance and drained (a request
/// in flight through it finishes), then what is left of its sessions is shut and it is
/// deleted (HAProxy deletes only a server without sessions). Additions come up in
/// maintenance, so their checks are enabled before they take traffic. A listener that
/// fails open has a backup server with each node, added and deleted with it, so the
/// running servers are always those of the file.
pub(crate) fn runtime_commands(
    dir: &Path,
    running: &Layout,
    next: &Layout,
    timing: CheckTiming,
) -> RuntimeCommands {
    let mut commands = RuntimeCommands::default();
    let (mut acl_adds, mut server_adds, mut acl_dels, mut disables) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let occupant = |layout: &'_ Layout, number| {
        layout
            .backends
            .get(&number)
            .and_then(|backend| backend.proxy.clone())
    };
    let numbers: BTreeSet<u32> = running
        .backends
        .keys()
        .chain(next.backends.keys())
        .copied()
        .collect();
    for number in numbers {
        let (have, want) = (occupant(running, number), occupant(next, number));
        let acl = acl_path(dir, number);
        let (had, wanted) = (admitted(have.as_ref()), admitted(want.as_ref()));
        for pattern in wanted.difference(&had) {
            acl_adds.push(format!("add acl {} {pattern}", acl.display()));
        }
        for pattern in had.difference(&wanted) {
            acl_dels.push(format!("del acl {} {pattern}", acl.display()));
        }
        let servers = |proxy: &Option<Proxy>| -> BTreeSet<IpAddr> {
            proxy
                .iter()
                .flat_map(|p| p.servers.iter().copied())
                .collect()
        };
        let (have_servers, want_servers) = (servers(&have), servers(&want));
        let backend = backend_name(number);
        if let Some(have) = &have {
            for &gone in have_servers.difference(&want_servers) {
                commands.draining.push((backend.clone(), gone));
                for server in server_names(&backend, have, gone) {
                    disables.push(format!("disable server {server}"));
                    commands
                        .after_drain
                        .push(format!("shutdown sessions server {server}"));
                    commands.after_drain.push(format!("del server {server}"));
                }
            }
        }
        if let Some(want) = &want {
            for &new in want_servers.difference(&have_servers) {
                let server = format!("{backend}/{new}");
                server_adds.push(format!(
                    "add server {server} {}",
                    server_line(want, new, timing)
                ));
                if want.health_check.is_some() {
                    server_adds.push(format!("enable health {server}"));
                }
                server_adds.push(format!("enable server {server}"));
                if want.fail_open() {
                    let backup = format!("{backend}/{}", backup_name(new));
                    server_adds.push(format!("add server {backup} {}", backup_line(want, new)));
                    server_adds.push(format!("enable server {backup}"));
                }
            }
        }
    }
    let (have_routes, want_routes) = (running.routes(), next.routes());
    let mut route_changes = Vec::new();
    for (&(frontend, vip), &number) in &want_routes {
        let verb = match have_routes.get(&(frontend, vip)) {
            Some(&had) if had == number => continue,
            Some(_) => "set",
            None => "add",
        };
        route_changes.push(format!(
            "{verb} map {} {vip} {}",
            map_path(dir, frontend).display(),
            backend_name(number)
        ));
    }
    for &(frontend, vip) in have_routes.keys() {
        if !want_routes.contains_key(&(frontend, vip)) {
            route_changes.push(format!(
                "del map {} {vip}",
                map_path(dir, frontend).display()
            ));
        }
    }
    commands.before_drain = [acl_adds, server_adds, route_changes, acl_dels, disables].concat();
    commands
}

/// The runtime names of `ip`'s servers in `backend` serving `proxy`: its own, and its
/// backup's when `proxy` fails open.
fn server_names(backend: &str, proxy: &Proxy, ip: IpAddr) -> Vec<String> {
    let mut names = vec![format!("{backend}/{ip}")];
    if proxy.fail_open() {
        names.push(format!("{backend}/{}", backup_name(ip)));
    }
    names
}

/// What follows `server NAME` for `ip` in `proxy`: the address and the check.
fn server_line(proxy: &Proxy, ip: IpAddr, timing: CheckTiming) -> String {
    let mut line = SocketAddr::new(ip, proxy.backend_port).to_string();
    if let Some(check) = &proxy.health_check {
        let port = match check {
            HealthCheck::Tcp { port } | HealthCheck::Http { port, .. } => port,
        };
        let _ = write!(
            line,
            " check port {port} inter {} fall {} rise {}",
            millis(timing.interval),
            timing.fall.max(1),
            timing.rise.max(1)
        );
    }
    line
}

/// The name of `ip`'s backup server in a listener that fails open. Not an address, so
/// the health reader (`socket::parse_stat`) skips it, and distinct from every primary's.
fn backup_name(ip: IpAddr) -> String {
    format!("open-{ip}")
}

/// What follows `server open-IP` for `ip` in `proxy`: the same address, unchecked (always
/// up), a backup (takes traffic only while no checked server is up).
fn backup_line(proxy: &Proxy, ip: IpAddr) -> String {
    format!("{} backup", SocketAddr::new(ip, proxy.backend_port))
}

fn millis(duration: Duration) -> String {
    format!("{}ms", duration.as_millis().max(1))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use proptest::prelude::*;

    use super::*;
    use crate::Protocol;
    use crate::haproxy::layout::{self, Backend, SPARE_BACKENDS};
    use crate::haproxy::proxy::proxies;
    use crate::plan::{ListenerKey, ListenerRoute};

    const TIMING: CheckTiming = CheckTiming {
        interval: Duration::from_secs(1),
        timeout: Duration::from_secs(1),
        rise: 2,
        fall: 2,
    };

    fn globals(dir: &Path) -> Globals<'_> {
        Globals {
            dir,
            runtime_socket: Path::new("/run/edge/runtime.sock"),
            connect_timeout: Duration::from_secs(3),
            timing: TIMING,
        }
    }

    fn proxy(servers: &[&str]) -> Proxy {
        Proxy {
            lb_id: "lb-0000000a".into(),
            bind: "198.51.100.10:80".parse().unwrap(),
            backend_port: 31000,
            health_check: Some(HealthCheck::Http {
                port: 32000,
                path: "/healthz".into(),
            }),
            source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
            servers: servers.iter().map(|s| s.parse().unwrap()).collect(),
            bound_alone: false,
        }
    }

    /// `proxies` in backends 0, 1, … with one empty backend of each's kind after them.
    fn layout(proxies: &[Proxy]) -> Layout {
        let mut layout = Layout::default();
        for proxy in proxies {
            layout.frontends.insert(Frontend::of(proxy));
            let number = u32::try_from(layout.backends.len()).unwrap();
            layout.backends.insert(
                number,
                Backend {
                    checks: Checks::of(proxy),
                    proxy: Some(proxy.clone()),
                },
            );
        }
        for proxy in proxies {
            let number = u32::try_from(layout.backends.len()).unwrap();
            let checks = Checks::of(proxy);
            layout.backends.insert(
                number,
                Backend {
                    checks,
                    proxy: None,
                },
            );
        }
        layout
    }

    /// `layout` with backend `number` serving `proxy` (or nothing).
    fn with(mut layout: Layout, number: u32, proxy: Option<Proxy>) -> Layout {
        if let Some(backend) = layout.backends.get_mut(&number) {
            backend.proxy = proxy;
        }
        layout
    }

    #[test]
    fn a_port_is_one_frontend_routing_by_vip_and_a_listener_one_backend() {
        let dir = Path::new("/var/lib/edge");
        let running = layout(&[proxy(&["198.18.0.11", "198.18.0.12"])]);
        let text = config(&globals(dir), &running);
        assert!(text.contains("stats socket /run/edge/runtime.sock mode 600 level admin"));
        let sections = text.split_once("\nfrontend ").unwrap().1;
        assert_eq!(
            sections,
            "port-80-v4\n    \
                 bind 0.0.0.0:80\n    \
                 tcp-request connection reject unless { dst,map_ip(/var/lib/edge/port-80-v4.map) -m found }\n    \
                 use_backend %[dst,map_ip(/var/lib/edge/port-80-v4.map)]\n\
             \n\
             backend backend-0\n    \
                 # lb-0000000a_80_v4 on 198.51.100.10:80\n    \
                 option httpchk\n    \
                 http-check send meth GET uri /healthz\n    \
                 http-check expect status 200\n    \
                 option allbackups\n    \
                 tcp-request content reject unless { src -f /var/lib/edge/backend-0.acl }\n    \
                 server 198.18.0.11 198.18.0.11:31000 check port 32000 inter 1000ms fall 2 rise 2\n    \
                 server 198.18.0.12 198.18.0.12:31000 check port 32000 inter 1000ms fall 2 rise 2\n    \
                 server open-198.18.0.11 198.18.0.11:31000 backup\n    \
                 server open-198.18.0.12 198.18.0.12:31000 backup\n\
             \n\
             backend backend-1\n    \
                 option httpchk\n    \
                 http-check send meth GET uri /healthz\n    \
                 http-check expect status 200\n    \
                 option allbackups\n    \
                 tcp-request content reject unless { src -f /var/lib/edge/backend-1.acl }\n"
        );
        let mut open = proxy(&["198.18.0.11"]);
        open.source_ranges.clear();
        let files = pattern_files(dir, &layout(&[open]));
        assert_eq!(
            files,
            BTreeMap::from([
                (
                    PathBuf::from("/var/lib/edge/port-80-v4.map"),
                    "198.51.100.10 backend-0\n".to_owned()
                ),
                (
                    PathBuf::from("/var/lib/edge/backend-0.acl"),
                    "0.0.0.0/0\n::/0\n".to_owned()
                ),
                (PathBuf::from("/var/lib/edge/backend-1.acl"), String::new()),
            ]),
            "no source ranges admit every source; an empty backend none"
        );
        assert_eq!(
            pattern_files(dir, &running)[Path::new("/var/lib/edge/backend-0.acl")],
            "203.0.113.0/24\n"
        );
    }

    #[test]
    fn ipv6_binds_every_address_of_its_own_family_and_servers_are_bracketed() {
        let mut v6 = proxy(&["2001:db8:18::11"]);
        v6.bind = "[2001:db8:51:100::10]:443".parse().unwrap();
        v6.health_check = Some(HealthCheck::Tcp { port: 443 });
        let dir = Path::new("/s");
        let layout = layout(&[v6]);
        let text = config(&globals(dir), &layout);
        assert!(text.contains("frontend port-443-v6\n    bind [::]:443 v6only\n"));
        assert!(!text.contains("httpchk"), "{text}");
        assert!(text.contains(
            "server 2001:db8:18::11 [2001:db8:18::11]:31000 check port 443 inter 1000ms"
        ));
        assert!(text.contains("server open-2001:db8:18::11 [2001:db8:18::11]:31000 backup\n"));
        assert_eq!(
            pattern_files(dir, &layout)[Path::new("/s/port-443-v6.map")],
            "2001:db8:51:100::10 backend-0\n"
        );
    }

    #[test]
    fn a_new_listener_gets_its_ranges_and_servers_before_its_route_and_loses_them_after() {
        let dir = Path::new("/d");
        let empty = layout(&[proxy(&[])]);
        let empty = with(empty, 0, None);
        let served = with(empty.clone(), 0, Some(proxy(&["198.18.0.11"])));
        let arrive = runtime_commands(dir, &empty, &served, TIMING);
        assert_eq!(
            arrive,
            RuntimeCommands {
                before_drain: vec![
                    "add acl /d/backend-0.acl 203.0.113.0/24".into(),
                    "add server backend-0/198.18.0.11 198.18.0.11:31000 check port 32000 inter 1000ms fall 2 rise 2".into(),
                    "enable health backend-0/198.18.0.11".into(),
                    "enable server backend-0/198.18.0.11".into(),
                    "add server backend-0/open-198.18.0.11 198.18.0.11:31000 backup".into(),
                    "enable server backend-0/open-198.18.0.11".into(),
                    "add map /d/port-80-v4.map 198.51.100.10 backend-0".into(),
                ],
                draining: Vec::new(),
                after_drain: Vec::new(),
            }
        );
        let leave = runtime_commands(dir, &served, &empty, TIMING);
        assert_eq!(
            leave,
            RuntimeCommands {
                before_drain: vec![
                    "del map /d/port-80-v4.map 198.51.100.10".into(),
                    "del acl /d/backend-0.acl 203.0.113.0/24".into(),
                    "disable server backend-0/198.18.0.11".into(),
                    "disable server backend-0/open-198.18.0.11".into(),
                ],
                draining: vec![("backend-0".into(), "198.18.0.11".parse().unwrap())],
                after_drain: vec![
                    "shutdown sessions server backend-0/198.18.0.11".into(),
                    "del server backend-0/198.18.0.11".into(),
                    "shutdown sessions server backend-0/open-198.18.0.11".into(),
                    "del server backend-0/open-198.18.0.11".into(),
                ],
            }
        );
        assert_eq!(runtime_commands(dir, &served, &served, TIMING).len(), 0);

        // A move to another backend: the VIP's entry is set to the new one once it serves.
        let mut moved = proxy(&["198.18.0.11"]);
        moved.backend_port = 31001;
        let there = with(empty, 1, Some(moved));
        let commands = runtime_commands(dir, &served, &there, TIMING);
        assert!(
            commands
                .before_drain
                .iter()
                .position(|c| c.starts_with("add server backend-1/"))
                < commands
                    .before_drain
                    .iter()
                    .position(|c| c == "set map /d/port-80-v4.map 198.51.100.10 backend-1"),
            "{commands:?}"
        );
        assert_eq!(commands.draining.len(), 1);
    }

    #[test]
    fn nodes_and_source_ranges_change_in_place_and_unchecked_listeners_have_no_backups() {
        let dir = Path::new("/d");
        let running = layout(&[proxy(&["198.18.0.11", "198.18.0.12"])]);
        let mut changed = proxy(&["198.18.0.12", "198.18.0.13"]);
        changed.source_ranges = vec!["198.51.100.0/24".parse().unwrap()];
        let next = with(running.clone(), 0, Some(changed));
        let commands = runtime_commands(dir, &running, &next, TIMING);
        assert_eq!(
            commands.before_drain,
            [
                "add acl /d/backend-0.acl 198.51.100.0/24",
                "add server backend-0/198.18.0.13 198.18.0.13:31000 check port 32000 inter 1000ms fall 2 rise 2",
                "enable health backend-0/198.18.0.13",
                "enable server backend-0/198.18.0.13",
                "add server backend-0/open-198.18.0.13 198.18.0.13:31000 backup",
                "enable server backend-0/open-198.18.0.13",
                "del acl /d/backend-0.acl 203.0.113.0/24",
                "disable server backend-0/198.18.0.11",
                "disable server backend-0/open-198.18.0.11",
            ],
            "a source both range sets admit is never refused"
        );
        assert_eq!(
            commands.after_drain,
            [
                "shutdown sessions server backend-0/198.18.0.11",
                "del server backend-0/198.18.0.11",
                "shutdown sessions server backend-0/open-198.18.0.11",
                "del server backend-0/open-198.18.0.11",
            ]
        );

        let mut unchecked = proxy(&["198.18.0.11"]);
        unchecked.health_check = None;
        let running = layout(&[unchecked.clone()]);
        let text = config(&globals(dir), &running);
        assert!(
            !text.contains(" backup\n") && !text.contains("open-") && !text.contains("httpchk"),
            "{text}"
        );
        let mut more = unchecked;
        more.servers.push("198.18.0.13".parse().unwrap());
        let with_more = with(running.clone(), 0, Some(more));
        let added = runtime_commands(dir, &running, &with_more, TIMING);
        assert_eq!(
            added.before_drain,
            [
                "add server backend-0/198.18.0.13 198.18.0.13:31000",
                "enable server backend-0/198.18.0.13",
            ]
        );
        let removed = runtime_commands(dir, &with_more, &running, TIMING);
        assert_eq!(
            removed.before_drain,
            ["disable server backend-0/198.18.0.13"]
        );
        assert_eq!(
            removed.after_drain,
            [
                "shutdown sessions server backend-0/198.18.0.13",
                "del server backend-0/198.18.0.13",
            ]
        );
    }

    /// Text a Service's author (or a buggy client) could put where the edge's identifiers
    /// and the health-check path go: HAProxy's quotes, escapes, comments, variables,
    /// separators and line breaks among plain characters.
    fn hostile_text() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                proptest::char::range('a', 'z'),
                proptest::char::range('0', '9'),
                Just('-'),
                Just('/'),
                Just(' '),
                Just('\n'),
                Just('#'),
                Just('"'),
                Just('\''),
                Just('\\'),
                Just('$'),
                Just('{'),
                Just('}'),
                Just(';'),
                Just('%'),
            ],
            0..24,
        )
        .prop_map(|chars| chars.into_iter().collect())
    }

    fn listener() -> impl Strategy<Value = (ListenerKey, ListenerRoute)> {
        (
            prop_oneof![hostile_text(), Just("/healthz".to_owned())],
            prop_oneof![Just("lb-0000000a".to_owned()), hostile_text()],
            1_u16..,
            1_u16..,
            proptest::collection::vec(any::<u32>(), 0..4),
            proptest::collection::vec((any::<u32>(), 0_u8..=32), 0..3),
            any::<bool>(),
        )
            .prop_map(|(path, lb_id, port, check_port, servers, ranges, http)| {
                let key = ListenerKey {
                    vip: IpAddr::from(Ipv4Addr::new(127, 77, 99, 1)),
                    protocol: Protocol::Tcp,
                    port,
                };
                let mut backends: Vec<IpAddr> = servers
                    .into_iter()
                    .map(|ip| Ipv4Addr::from(ip).into())
                    .collect();
                backends.sort_unstable();
                backends.dedup();
                let route = ListenerRoute {
                    lb_id,
                    backend_port: port,
                    backends,
                    health_check: Some(if http {
                        HealthCheck::Http {
                            port: check_port,
                            path,
                        }
                    } else {
                        HealthCheck::Tcp { port: check_port }
                    }),
                    source_ranges: ranges
                        .into_iter()
                        .filter_map(|(ip, len)| {
                            ipnet::Ipv4Net::new(Ipv4Addr::from(ip), len)
                                .ok()
                                .map(|net| IpNet::V4(net.trunc()))
                        })
                        .collect(),
                };
                (key, route)
            })
    }

    proptest! {
        // Each case runs `haproxy -c` (Debian's haproxy; CI installs it).
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Whatever reaches the renderer, what it renders HAProxy accepts, with its map
        /// and ACL files, and what it cannot render safely it refuses by name.
        #[test]
        fn whatever_is_rendered_haproxy_accepts(listener in listener(), shared in any::<bool>()) {
            let listeners = BTreeMap::from([listener.clone()]);
            // Bound on every address, or on its VIP alone when its port is shared.
            let shared_ports = BTreeSet::from_iter(shared.then_some(listener.0.port));
            let (rendered, refused) = proxies(&listeners, &shared_ports);
            prop_assert_eq!(rendered.len() + refused.len(), 1);
            let dir = std::env::temp_dir().join(format!(
                "cloud-mock-render-{}-{}",
                std::process::id(),
                std::thread::current().name().unwrap_or("t").replace("::", "-")
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let layout = layout::fresh(&rendered);
            let text = config(&globals(&dir), &layout);
            for (path, contents) in pattern_files(&dir, &layout) {
                std::fs::write(path, contents).unwrap();
            }
            let file = dir.join("haproxy.cfg");
            std::fs::write(&file, &text).unwrap();
            let check = std::process::Command::new("haproxy")
                .args(["-c", "-q", "-f"])
                .arg(&file)
                .output()
                .expect("haproxy -c runs (install Debian's haproxy)");
            let _ = std::fs::remove_dir_all(&dir);
            prop_assert!(
                check.status.success(),
                "haproxy refused:\n{}\n{}",
                text,
                String::from_utf8_lossy(&check.stderr)
            );
            // Nothing the author wrote outside the checked values comes through.
            let (_, route) = listener;
            if !rendered.is_empty() {
                prop_assert!(!text.contains('"') && !text.contains('\\') && !text.contains('$'));
                prop_assert_eq!(text.lines().filter(|l| l.starts_with("frontend ")).count(), 1);
                prop_assert_eq!(
                    text.lines().filter(|l| l.starts_with("backend ")).count(),
                    1 + SPARE_BACKENDS
                );
            } else {
                prop_assert!(!text.contains("\nfrontend "), "a refused listener is not rendered");
                prop_assert_eq!(&refused[0].0, &route.lb_id);
            }
        }
    }
}
