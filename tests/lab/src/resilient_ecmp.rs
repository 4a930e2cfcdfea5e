//! The lab router's resilient ECMP. BIRD 2 (and FRR) install a multipath route as a
//! hash-threshold route: when one next hop goes, the hash ranges of the others shift too,
//! so some flows of every edge that stays move to another edge, and a proxy-mode
//! connection ends where it is not terminated. The routers of a production site hash
//! resiliently (resilient hashing, in vendors' words): only the flows of a lost next hop
//! move. On Linux that is a resilient nexthop group (Linux 5.13 or later; see the kernel's
//! Documentation/networking/nexthop-group-resilient.rst).
//!
//! `tandem-resilient-ecmp` gives the lab's router that: the BGP speaker writes its routes
//! into a kernel table of their own (`--source-table`), and this mirrors each of them into
//! the main table as a route to a resilient group of its next hops, changed in place as
//! next hops come and go, so that the kernel moves only the buckets of a next hop that
//! left, and hands a bucket to a next hop that joined only once it has been idle.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

/// The routing protocol number of the routes and next hops this installs, so that it finds
/// its own and touches nothing else.
pub const PROTOCOL: u8 = 98;

/// How the groups hash.
#[derive(Debug, Clone, Copy)]
pub struct GroupSettings {
    /// Buckets per group: each next hop holds about buckets/N of them.
    pub buckets: u16,
    /// A bucket no packet hit for this many seconds may be handed to a next hop that
    /// joined (`ip` takes whole seconds).
    pub idle_timer_seconds: u32,
}

/// One next hop of a route.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct NextHop {
    pub gateway: IpAddr,
    pub dev: String,
}

/// Routes by prefix, each with its set of next hops.
pub type Routes = BTreeMap<String, BTreeSet<NextHop>>;

/// A route as `ip -j route show` prints it: one next hop inline, or several.
#[derive(Debug, Deserialize)]
struct KernelRoute {
    dst: String,
    gateway: Option<IpAddr>,
    dev: Option<String>,
    #[serde(default)]
    nexthops: Vec<KernelNextHop>,
}

#[derive(Debug, Deserialize)]
struct KernelNextHop {
    gateway: Option<IpAddr>,
    dev: Option<String>,
}

/// The routes of `ip -j route show` output that go through a gateway, by prefix.
pub fn parse_routes(json: &str) -> Result<Routes> {
    let routes: Vec<KernelRoute> =
        serde_json::from_str(json).context("parsing `ip -j route show`")?;
    let mut out = Routes::new();
    for route in routes {
        let hops: BTreeSet<NextHop> = match route.nexthops.is_empty() {
            true => next_hop(route.gateway, route.dev).into_iter().collect(),
            false => route
                .nexthops
                .into_iter()
                .filter_map(|hop| next_hop(hop.gateway, hop.dev))
                .collect(),
        };
        if !hops.is_empty() {
            out.entry(route.dst).or_default().extend(hops);
        }
    }
    Ok(out)
}

fn next_hop(gateway: Option<IpAddr>, dev: Option<String>) -> Option<NextHop> {
    Some(NextHop {
        gateway: gateway?,
        dev: dev?,
    })
}

/// What this has installed: a nexthop object per next hop, a group per prefix.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Installed {
    next_hops: BTreeMap<NextHop, u32>,
    groups: BTreeMap<String, (u32, BTreeSet<NextHop>)>,
    last_id: u32,
}

impl Installed {
    fn allocate(&mut self) -> u32 {
        self.last_id += 1;
        self.last_id
    }
}

/// The `ip -batch` commands that take `installed` to `wanted`, and what is installed after
/// them. A prefix keeps its group while its next hops change: the kernel then moves only
/// the buckets it must. Creations go in dependency order (next hops, groups, routes),
/// deletions in the reverse one.
pub fn plan(
    installed: &Installed,
    wanted: &Routes,
    group: GroupSettings,
) -> (Vec<String>, Installed) {
    let mut after = installed.clone();
    let mut commands = Vec::new();
    for hop in wanted.values().flatten() {
        if !after.next_hops.contains_key(hop) {
            let id = after.allocate();
            commands.push(format!(
                "nexthop replace id {id} via {} dev {} proto {PROTOCOL}",
                hop.gateway, hop.dev
            ));
            after.next_hops.insert(hop.clone(), id);
        }
    }
    for (prefix, hops) in wanted {
        let existing = after.groups.get(prefix).cloned();
        if existing
            .as_ref()
            .is_some_and(|(_, installed)| installed == hops)
        {
            continue;
        }
        let id = match &existing {
            Some((id, _)) => *id,
            None => after.allocate(),
        };
        let members: Vec<String> = hops
            .iter()
            .map(|hop| after.next_hops[hop].to_string())
            .collect();
        commands.push(format!(
            "nexthop replace id {id} group {} type resilient buckets {} idle_timer {} proto {PROTOCOL}",
            members.join("/"),
            group.buckets,
            group.idle_timer_seconds,
        ));
        if existing.is_none() {
            commands.push(format!("route replace {prefix} nhid {id} proto {PROTOCOL}"));
        }
        after.groups.insert(prefix.clone(), (id, hops.clone()));
    }
    let gone: Vec<String> = after
        .groups
        .keys()
        .filter(|prefix| !wanted.contains_key(*prefix))
        .cloned()
        .collect();
    for prefix in gone {
        if let Some((id, _)) = after.groups.remove(&prefix) {
            commands.push(format!("route del {prefix} proto {PROTOCOL}"));
            commands.push(format!("nexthop del id {id}"));
        }
    }
    let used: BTreeSet<&NextHop> = wanted.values().flatten().collect();
    let unused: Vec<NextHop> = after
        .next_hops
        .keys()
        .filter(|hop| !used.contains(hop))
        .cloned()
        .collect();
    for hop in unused {
        if let Some(id) = after.next_hops.remove(&hop) {
            commands.push(format!("nexthop del id {id}"));
        }
    }
    (commands, after)
}

/// Mirrors the routes of `source_table` into resilient groups until the process ends:
/// at every change `ip monitor` reports, and every second in case it missed one.
pub fn run(source_table: u32, group: GroupSettings) -> Result<()> {
    let (changed, changes) = mpsc::channel();
    let mut monitor = Command::new("ip")
        .args(["-o", "monitor", "route"])
        .stdout(Stdio::piped())
        .spawn()
        .context("starting `ip monitor route`")?;
    let output = monitor.stdout.take().context("ip monitor's output")?;
    std::thread::spawn(move || {
        for _ in BufReader::new(output).lines().map_while(|line| line.ok()) {
            if changed.send(()).is_err() {
                break;
            }
        }
    });
    // Whatever an earlier run installed is not known here: start from nothing.
    flush()?;
    let mut installed = Installed::default();
    loop {
        let wanted = source_routes(source_table)?;
        let (commands, after) = plan(&installed, &wanted, group);
        if !commands.is_empty() {
            match batch(&commands) {
                Ok(()) => {
                    for (prefix, hops) in &wanted {
                        if installed.groups.get(prefix).map(|(_, h)| h) != Some(hops) {
                            let gateways: Vec<String> =
                                hops.iter().map(|h| h.gateway.to_string()).collect();
                            tracing::info!(%prefix, next_hops = ?gateways, "resilient group");
                        }
                    }
                    installed = after;
                }
                Err(error) => {
                    tracing::warn!(%error, "installing the routes failed; starting over");
                    flush()?;
                    installed = Installed::default();
                }
            }
        }
        match changes.recv_timeout(Duration::from_secs(1)) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Timeout) => while changes.try_recv().is_ok() {},
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("`ip monitor route` ended"),
        }
    }
}

/// The routes of `table`: none while the kernel has not made it (before its first route).
fn source_routes(table: u32) -> Result<Routes> {
    let table = table.to_string();
    let output = Command::new("ip")
        .args(["-j", "route", "show", "table", &table])
        .output()
        .context("running ip route show")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if stderr.contains("FIB table does not exist") {
        return Ok(Routes::new());
    }
    if !output.status.success() {
        bail!("ip route show table {table} failed: {}", stderr.trim());
    }
    parse_routes(&String::from_utf8_lossy(&output.stdout))
}

/// Deletes every route and next hop of [`PROTOCOL`]: routes first, as they hold the groups.
fn flush() -> Result<()> {
    let protocol = PROTOCOL.to_string();
    ip(&["route", "flush", "proto", &protocol])?;
    ip(&["nexthop", "flush", "protocol", &protocol])?;
    Ok(())
}

fn ip(args: &[&str]) -> Result<String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .with_context(|| format!("running ip {}", args.join(" ")))?;
    if !output.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn batch(commands: &[String]) -> Result<()> {
    let mut child = Command::new("ip")
        .args(["-batch", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running ip -batch")?;
    let mut stdin = child.stdin.take().context("ip -batch's input")?;
    stdin
        .write_all((commands.join("\n") + "\n").as_bytes())
        .context("writing to ip -batch")?;
    drop(stdin);
    let output = child.wait_with_output().context("waiting for ip -batch")?;
    if !output.status.success() {
        bail!(
            "ip -batch failed: {} (commands: {commands:?})",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GROUP: GroupSettings = GroupSettings {
        buckets: 128,
        idle_timer_seconds: 3,
    };

    fn hops(gateways: &[&str]) -> BTreeSet<NextHop> {
        gateways
            .iter()
            .map(|g| NextHop {
                gateway: g.parse().unwrap(),
                dev: "eth3".to_owned(),
            })
            .collect()
    }

    #[test]
    fn reads_single_and_multipath_routes() {
        let json = r#"[
            {"dst":"203.0.113.1","gateway":"198.19.0.11","dev":"eth3","protocol":"bird","flags":[]},
            {"dst":"203.0.113.2","protocol":"bird","flags":[],"nexthops":[
                {"gateway":"198.19.0.12","dev":"eth3","weight":1,"flags":[]},
                {"gateway":"198.19.0.11","dev":"eth3","weight":1,"flags":[]}]},
            {"dst":"203.0.113.3","type":"blackhole","protocol":"bird","flags":[]}
        ]"#;
        let routes = parse_routes(json).unwrap();
        assert_eq!(
            routes.len(),
            2,
            "a route without a gateway is not forwarded: {routes:?}"
        );
        assert_eq!(routes["203.0.113.1"], hops(&["198.19.0.11"]));
        assert_eq!(routes["203.0.113.2"], hops(&["198.19.0.11", "198.19.0.12"]));
    }

    #[test]
    fn a_prefix_keeps_its_group_while_next_hops_come_and_go() {
        let mut wanted = Routes::new();
        wanted.insert(
            "203.0.113.1".to_owned(),
            hops(&["198.19.0.11", "198.19.0.12", "198.19.0.13"]),
        );
        let (first, installed) = plan(&Installed::default(), &wanted, GROUP);
        assert_eq!(
            first,
            [
                "nexthop replace id 1 via 198.19.0.11 dev eth3 proto 98",
                "nexthop replace id 2 via 198.19.0.12 dev eth3 proto 98",
                "nexthop replace id 3 via 198.19.0.13 dev eth3 proto 98",
                "nexthop replace id 4 group 1/2/3 type resilient buckets 128 idle_timer 3 proto 98",
                "route replace 203.0.113.1 nhid 4 proto 98",
            ]
        );
        let (again, same) = plan(&installed, &wanted, GROUP);
        assert!(again.is_empty(), "nothing changed: {again:?}");
        assert_eq!(same, installed);

        // An edge goes: the same group, changed in place, and its next hop deleted after.
        wanted.insert(
            "203.0.113.1".to_owned(),
            hops(&["198.19.0.11", "198.19.0.13"]),
        );
        let (lost, installed) = plan(&installed, &wanted, GROUP);
        assert_eq!(
            lost,
            [
                "nexthop replace id 4 group 1/3 type resilient buckets 128 idle_timer 3 proto 98",
                "nexthop del id 2",
            ]
        );
        // It comes back with a new nexthop object, into the same group.
        wanted.insert(
            "203.0.113.1".to_owned(),
            hops(&["198.19.0.11", "198.19.0.12", "198.19.0.13"]),
        );
        let (back, _) = plan(&installed, &wanted, GROUP);
        assert_eq!(
            back,
            [
                "nexthop replace id 5 via 198.19.0.12 dev eth3 proto 98",
                "nexthop replace id 4 group 1/5/3 type resilient buckets 128 idle_timer 3 proto 98",
            ]
        );
    }

    #[test]
    fn a_withdrawn_prefix_loses_its_route_before_its_group() {
        let mut wanted = Routes::new();
        wanted.insert("203.0.113.1".to_owned(), hops(&["198.19.0.11"]));
        let (_, installed) = plan(&Installed::default(), &wanted, GROUP);
        let (commands, after) = plan(&installed, &Routes::new(), GROUP);
        assert_eq!(
            commands,
            [
                "route del 203.0.113.1 proto 98",
                "nexthop del id 2",
                "nexthop del id 1",
            ]
        );
        assert!(after.groups.is_empty() && after.next_hops.is_empty());
    }
}
