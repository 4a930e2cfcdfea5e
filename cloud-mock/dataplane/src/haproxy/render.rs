//! Decide, for HAProxy: from the proxy-mode listeners to HAProxy's configuration text,
//! and from the running proxies to the runtime commands that converge them. Pure.
//!
//! Every name in the configuration is the edge's own (a load balancer id the store made,
//! a port, a family) and every value a parsed address, prefix or port; the one piece of
//! free text that reaches HAProxy, an HTTP health-check path, is checked against a narrow
//! character set. What does not pass is refused here, with a reason, before HAProxy sees it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;

use crate::HealthCheck;
use crate::failure::Unrenderable;
use crate::plan::{ListenerKey, ListenerRoute};

/// Health-check timing every server gets (dynamic servers inherit no `default-server`,
/// so the configuration and the runtime commands both spell it out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CheckTiming {
    pub interval: Duration,
    pub timeout: Duration,
    pub rise: u32,
    pub fall: u32,
}

/// One HAProxy `listen` section: a load balancer's TCP listener on one of its VIPs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Proxy {
    pub lb_id: String,
    pub bind: SocketAddr,
    pub backend_port: u16,
    pub health_check: Option<HealthCheck>,
    pub source_ranges: Vec<IpNet>,
    /// Sorted; the server names are these addresses. A checked section also has, for
    /// each, a backup server named by [`backup_name`] (see [`Proxy::fail_open`]).
    pub servers: Vec<IpAddr>,
}

impl Proxy {
    /// The section name: unique per (load balancer, port, family), which is unique per
    /// (VIP, port) because a load balancer has one VIP per family.
    pub fn name(&self) -> String {
        let family = if self.bind.is_ipv4() { "v4" } else { "v6" };
        format!("{}_{}_{family}", self.lb_id, self.bind.port())
    }

    /// Whether the section fails open: its servers are checked, so each has an unchecked
    /// backup twin and `option allbackups` spreads over all of them when every checked
    /// server is DOWN (as cloud load balancers do when no target is healthy). Without a
    /// check the servers are always up and need no backups.
    pub fn fail_open(&self) -> bool {
        self.health_check.is_some()
    }

    /// Everything but the servers: what only a reload can change.
    fn frontend(&self) -> Self {
        Self {
            servers: Vec::new(),
            ..self.clone()
        }
    }
}

/// The proxies of `listeners` (TCP ones: the caller refuses UDP), each checked; a listener
/// that cannot be rendered is returned with its reason instead.
pub(crate) fn proxies(
    listeners: &BTreeMap<ListenerKey, ListenerRoute>,
) -> (BTreeMap<String, Proxy>, Vec<(String, Unrenderable)>) {
    let mut proxies = BTreeMap::new();
    let mut refused = Vec::new();
    for (key, route) in listeners {
        let proxy = Proxy {
            lb_id: route.lb_id.clone(),
            bind: SocketAddr::new(key.vip, key.port),
            backend_port: route.backend_port,
            health_check: route.health_check.clone(),
            source_ranges: route.source_ranges.clone(),
            servers: route.backends.clone(),
        };
        match check(&proxy) {
            Ok(()) => {
                proxies.insert(proxy.name(), proxy);
            }
            Err(reason) => refused.push((route.lb_id.clone(), reason)),
        }
    }
    (proxies, refused)
}

fn check(proxy: &Proxy) -> Result<(), Unrenderable> {
    let id = &proxy.lb_id;
    let id_ok = !id.is_empty()
        && id.len() <= 64
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if !id_ok {
        return Err(Unrenderable::Id(id.clone()));
    }
    if let Some(HealthCheck::Http { path, .. }) = &proxy.health_check
        && !path_is_plain(path)
    {
        return Err(Unrenderable::Path(path.clone()));
    }
    Ok(())
}

/// An absolute path of unreserved and a few sub-delimiter characters: nothing HAProxy's
/// configuration parser reads as a quote, an escape, a comment, a variable or a separator.
fn path_is_plain(path: &str) -> bool {
    path.starts_with('/')
        && path.len() <= 256
        && path
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._~-%=&?:@+,".contains(&b))
}

/// Whether going from `running` to `desired` needs a reload: any section added, removed
/// or changed other than in its servers.
pub(crate) fn needs_reload(
    running: &BTreeMap<String, Proxy>,
    desired: &BTreeMap<String, Proxy>,
) -> bool {
    running.len() != desired.len()
        || running
            .iter()
            .zip(desired)
            .any(|((name_a, a), (name_b, b))| name_a != name_b || a.frontend() != b.frontend())
}

/// The runtime API commands that turn the servers of `running` into those of `desired`,
/// in two steps with a drain between them (see [`server_commands`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ServerCommands {
    /// The servers that go, put in maintenance: they take no new connection, and the
    /// ones they carry go on.
    pub drain: Vec<String>,
    /// The servers that go and can carry sessions, as `(section, address)`: the drain
    /// waits for their sessions to end.
    pub draining: Vec<(String, IpAddr)>,
    /// After the drain: what is left of their sessions shut, the servers deleted, then
    /// the new servers added.
    pub then: Vec<String>,
}

impl ServerCommands {
    pub fn is_empty(&self) -> bool {
        self.drain.is_empty() && self.then.is_empty()
    }
}

/// Runtime API commands that turn the servers of `running` into those of `desired`, for
/// sections whose frontends are the same. Removals first: each server is put in
/// maintenance and drained (a request in flight through it finishes), then what is left
/// of its sessions is shut and it is deleted (HAProxy deletes only a server without
/// sessions). Additions come up in maintenance, so their checks are enabled before they
/// take traffic. In a section that fails open a node's backup server goes and comes with
/// its checked one, so the running servers are always those of the file (which a reload
/// starts from).
pub(crate) fn server_commands(
    running: &BTreeMap<String, Proxy>,
    desired: &BTreeMap<String, Proxy>,
    timing: CheckTiming,
) -> ServerCommands {
    let mut commands = ServerCommands::default();
    let mut additions = Vec::new();
    for (name, want) in desired {
        let Some(have) = running.get(name) else {
            continue;
        };
        let have_servers: BTreeSet<IpAddr> = have.servers.iter().copied().collect();
        let want_servers: BTreeSet<IpAddr> = want.servers.iter().copied().collect();
        for &gone in have_servers.difference(&want_servers) {
            let mut servers = vec![format!("{name}/{gone}")];
            if have.fail_open() {
                servers.push(format!("{name}/{}", backup_name(gone)));
            }
            commands.draining.push((name.clone(), gone));
            for server in servers {
                commands.drain.push(format!("disable server {server}"));
                commands
                    .then
                    .push(format!("shutdown sessions server {server}"));
                commands.then.push(format!("del server {server}"));
            }
        }
        for &new in want_servers.difference(&have_servers) {
            let server = format!("{name}/{new}");
            additions.push(format!(
                "add server {server} {}",
                server_line(want, new, timing)
            ));
            if want.health_check.is_some() {
                additions.push(format!("enable health {server}"));
            }
            additions.push(format!("enable server {server}"));
            if want.fail_open() {
                let backup = format!("{name}/{}", backup_name(new));
                additions.push(format!("add server {backup} {}", backup_line(want, new)));
                additions.push(format!("enable server {backup}"));
            }
        }
    }
    commands.then.extend(additions);
    commands
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

/// The name of `ip`'s backup server in a section that fails open. Not an address, so the
/// health reader (`socket::parse_stat`) skips it, and distinct from every primary's name.
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

/// Settings of the configuration that are not load balancers.
#[derive(Debug, Clone)]
pub(crate) struct Globals<'a> {
    /// The runtime API's socket (local to the edge: a Unix socket, mode 600).
    pub runtime_socket: &'a Path,
    pub connect_timeout: Duration,
    pub timing: CheckTiming,
}

/// The whole configuration file.
pub(crate) fn render(globals: &Globals<'_>, proxies: &BTreeMap<String, Proxy>) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "# Rendered by cloud-mock from its store at every change; edits are overwritten.\n\
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
    for (name, proxy) in proxies {
        let _ = write!(out, "\nlisten {name}\n    bind {}\n", proxy.bind);
        if !proxy.source_ranges.is_empty() {
            let ranges: Vec<String> = proxy.source_ranges.iter().map(IpNet::to_string).collect();
            let _ = writeln!(
                out,
                "    tcp-request connection reject unless {{ src {} }}",
                ranges.join(" ")
            );
        }
        if let Some(HealthCheck::Http { path, .. }) = &proxy.health_check {
            let _ = write!(
                out,
                "    option httpchk\n    \
                     http-check send meth GET uri {path}\n    \
                     http-check expect status 200\n"
            );
        }
        if proxy.fail_open() {
            out.push_str("    option allbackups\n");
        }
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

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use proptest::prelude::*;

    use super::*;
    use crate::Protocol;

    const TIMING: CheckTiming = CheckTiming {
        interval: Duration::from_secs(1),
        timeout: Duration::from_secs(1),
        rise: 2,
        fall: 2,
    };

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
        }
    }

    fn one(proxy: Proxy) -> BTreeMap<String, Proxy> {
        BTreeMap::from([(proxy.name(), proxy)])
    }

    #[test]
    fn a_listener_renders_as_one_listen_section() {
        let globals = Globals {
            runtime_socket: Path::new("/run/edge/runtime.sock"),
            connect_timeout: Duration::from_secs(3),
            timing: TIMING,
        };
        let text = render(&globals, &one(proxy(&["198.18.0.11", "198.18.0.12"])));
        let section = text.split_once("\nlisten ").unwrap().1;
        assert_eq!(
            section,
            "lb-0000000a_80_v4\n    \
                 bind 198.51.100.10:80\n    \
                 tcp-request connection reject unless { src 203.0.113.0/24 }\n    \
                 option httpchk\n    \
                 http-check send meth GET uri /healthz\n    \
                 http-check expect status 200\n    \
                 option allbackups\n    \
                 server 198.18.0.11 198.18.0.11:31000 check port 32000 inter 1000ms fall 2 rise 2\n    \
                 server 198.18.0.12 198.18.0.12:31000 check port 32000 inter 1000ms fall 2 rise 2\n    \
                 server open-198.18.0.11 198.18.0.11:31000 backup\n    \
                 server open-198.18.0.12 198.18.0.12:31000 backup\n"
        );
        assert!(text.contains("stats socket /run/edge/runtime.sock mode 600 level admin"));
    }

    #[test]
    fn ipv6_binds_and_servers_are_bracketed_and_named_by_family() {
        let mut v6 = proxy(&["2001:db8:18::11"]);
        v6.bind = "[2001:db8:51:100::10]:443".parse().unwrap();
        v6.health_check = Some(HealthCheck::Tcp { port: 443 });
        v6.source_ranges.clear();
        assert_eq!(v6.name(), "lb-0000000a_443_v6");
        let globals = Globals {
            runtime_socket: Path::new("/s"),
            connect_timeout: Duration::from_secs(3),
            timing: TIMING,
        };
        let text = render(&globals, &one(v6));
        assert!(text.contains("bind [2001:db8:51:100::10]:443\n"));
        assert!(text.contains(
            "server 2001:db8:18::11 [2001:db8:18::11]:31000 check port 443 inter 1000ms"
        ));
        assert!(text.contains("server open-2001:db8:18::11 [2001:db8:18::11]:31000 backup\n"));
        assert!(!text.contains("reject"));
    }

    #[test]
    fn only_server_changes_go_through_the_runtime_api() {
        let running = one(proxy(&["198.18.0.11", "198.18.0.12"]));
        let desired = one(proxy(&["198.18.0.12", "198.18.0.13"]));
        assert!(!needs_reload(&running, &desired));
        let commands = server_commands(&running, &desired, TIMING);
        assert_eq!(
            commands.drain,
            [
                "disable server lb-0000000a_80_v4/198.18.0.11",
                "disable server lb-0000000a_80_v4/open-198.18.0.11",
            ]
        );
        assert_eq!(
            commands.draining,
            [(
                "lb-0000000a_80_v4".to_owned(),
                "198.18.0.11".parse().unwrap()
            )]
        );
        assert_eq!(
            commands.then,
            [
                "shutdown sessions server lb-0000000a_80_v4/198.18.0.11",
                "del server lb-0000000a_80_v4/198.18.0.11",
                "shutdown sessions server lb-0000000a_80_v4/open-198.18.0.11",
                "del server lb-0000000a_80_v4/open-198.18.0.11",
                "add server lb-0000000a_80_v4/198.18.0.13 198.18.0.13:31000 check port 32000 inter 1000ms fall 2 rise 2",
                "enable health lb-0000000a_80_v4/198.18.0.13",
                "enable server lb-0000000a_80_v4/198.18.0.13",
                "add server lb-0000000a_80_v4/open-198.18.0.13 198.18.0.13:31000 backup",
                "enable server lb-0000000a_80_v4/open-198.18.0.13",
            ]
        );
        assert!(server_commands(&running, &running, TIMING).is_empty());
    }

    /// Checked sections fail open: every checked server has an unchecked backup twin to
    /// the same address, and `option allbackups` spreads over all of them once every
    /// checked server is DOWN (the twins' runtime commands: see
    /// `only_server_changes_go_through_the_runtime_api`). Unchecked sections (always up)
    /// have no backups, in the file or at run time.
    #[test]
    fn checked_sections_fail_open_through_backups_and_unchecked_ones_need_none() {
        let globals = Globals {
            runtime_socket: Path::new("/s"),
            connect_timeout: Duration::from_secs(3),
            timing: TIMING,
        };
        let mut tcp = proxy(&["198.18.0.11", "2001:db8:18::12"]);
        tcp.health_check = Some(HealthCheck::Tcp { port: 10256 });
        tcp.source_ranges.clear();
        let text = render(&globals, &one(tcp.clone()));
        let section = text.split_once("\nlisten ").unwrap().1;
        assert_eq!(
            section,
            "lb-0000000a_80_v4\n    \
                 bind 198.51.100.10:80\n    \
                 option allbackups\n    \
                 server 198.18.0.11 198.18.0.11:31000 check port 10256 inter 1000ms fall 2 rise 2\n    \
                 server 2001:db8:18::12 [2001:db8:18::12]:31000 check port 10256 inter 1000ms fall 2 rise 2\n    \
                 server open-198.18.0.11 198.18.0.11:31000 backup\n    \
                 server open-2001:db8:18::12 [2001:db8:18::12]:31000 backup\n"
        );
        // Backup names are not addresses, so they never pass for a node's health, and
        // are distinct from every primary's name.
        let names: Vec<&str> = section
            .lines()
            .filter_map(|line| line.trim().strip_prefix("server ")?.split(' ').next())
            .collect();
        assert_eq!(names.len(), 4);
        assert_eq!(names.iter().collect::<BTreeSet<_>>().len(), 4);
        let backups: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| n.starts_with("open-"))
            .collect();
        assert_eq!(backups.len(), 2);
        assert!(backups.iter().all(|name| name.parse::<IpAddr>().is_err()));

        // Unchecked: no backups, no allbackups.
        let mut unchecked = tcp.clone();
        unchecked.health_check = None;
        let text = render(&globals, &one(unchecked.clone()));
        assert!(!text.contains("backup"), "{text}");
        let mut more = unchecked.clone();
        more.servers.push("198.18.0.13".parse().unwrap());
        let added = server_commands(&one(unchecked.clone()), &one(more.clone()), TIMING);
        assert!(added.drain.is_empty() && added.draining.is_empty());
        assert_eq!(
            added.then,
            [
                "add server lb-0000000a_80_v4/198.18.0.13 198.18.0.13:31000",
                "enable server lb-0000000a_80_v4/198.18.0.13",
            ]
        );
        let removed = server_commands(&one(more), &one(unchecked), TIMING);
        assert_eq!(
            removed.drain,
            ["disable server lb-0000000a_80_v4/198.18.0.13"]
        );
        assert_eq!(
            removed.then,
            [
                "shutdown sessions server lb-0000000a_80_v4/198.18.0.13",
                "del server lb-0000000a_80_v4/198.18.0.13",
            ]
        );
    }

    #[test]
    fn frontend_changes_need_a_reload() {
        let running = one(proxy(&["198.18.0.11"]));
        let mut ranges = proxy(&["198.18.0.11"]);
        ranges.source_ranges.clear();
        let mut port = proxy(&["198.18.0.11"]);
        port.backend_port = 31001;
        let mut check = proxy(&["198.18.0.11"]);
        check.health_check = None;
        for changed in [ranges, port, check] {
            assert!(needs_reload(&running, &one(changed)));
        }
        assert!(needs_reload(&running, &BTreeMap::new()));
        let mut other = running.clone();
        let mut second = proxy(&[]);
        second.bind = "198.51.100.10:443".parse().unwrap();
        other.insert(second.name(), second);
        assert!(needs_reload(&running, &other));
    }

    #[test]
    fn hostile_ids_and_paths_are_refused_before_rendering() {
        let key = ListenerKey {
            vip: "198.51.100.10".parse().unwrap(),
            protocol: Protocol::Tcp,
            port: 80,
        };
        let route = |lb_id: &str, path: &str| ListenerRoute {
            lb_id: lb_id.into(),
            backend_port: 31000,
            backends: Vec::new(),
            health_check: Some(HealthCheck::Http {
                port: 1,
                path: path.into(),
            }),
            source_ranges: Vec::new(),
        };
        for (id, path, refused) in [
            (
                "lb-1\n    bind :22",
                "/healthz",
                Unrenderable::Id("lb-1\n    bind :22".into()),
            ),
            ("lb 1", "/healthz", Unrenderable::Id("lb 1".into())),
            ("lb-1", "/x #c", Unrenderable::Path("/x #c".into())),
            (
                "lb-1",
                "/\"${HOME}\"",
                Unrenderable::Path("/\"${HOME}\"".into()),
            ),
            ("lb-1", "healthz", Unrenderable::Path("healthz".into())),
        ] {
            let (proxies, rejected) = proxies(&BTreeMap::from([(key, route(id, path))]));
            assert!(proxies.is_empty());
            assert_eq!(rejected, vec![(id.to_owned(), refused)]);
        }
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

        /// Whatever reaches the renderer, what it renders HAProxy accepts, and what it
        /// cannot render safely it refuses by name.
        #[test]
        fn whatever_is_rendered_haproxy_accepts(listener in listener()) {
            let listeners = BTreeMap::from([listener.clone()]);
            let (rendered, refused) = proxies(&listeners);
            prop_assert_eq!(rendered.len() + refused.len(), 1);
            let globals = Globals {
                runtime_socket: Path::new("/run/cloud-mock-test/runtime.sock"),
                connect_timeout: Duration::from_secs(3),
                timing: TIMING,
            };
            let text = render(&globals, &rendered);
            let file = std::env::temp_dir().join(format!(
                "cloud-mock-render-{}-{}.cfg",
                std::process::id(),
                std::thread::current().name().unwrap_or("t").replace("::", "-")
            ));
            std::fs::write(&file, &text).unwrap();
            let check = std::process::Command::new("haproxy")
                .args(["-c", "-q", "-f"])
                .arg(&file)
                .output()
                .expect("haproxy -c runs (install Debian's haproxy)");
            let _ = std::fs::remove_file(&file);
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
                prop_assert_eq!(text.lines().filter(|l| l.starts_with("listen ")).count(), 1);
            } else {
                prop_assert!(!text.contains("\nlisten "), "a refused listener is not rendered");
                prop_assert_eq!(&refused[0].0, &route.lb_id);
            }
        }
    }
}
