//! Decide, for HAProxy: from the proxy-mode listeners to what HAProxy is to serve, one
//! [`Proxy`] per listener and VIP. Pure.
//!
//! Every name that reaches HAProxy is the edge's own (a load balancer id the store made,
//! a port, a family) and every value a parsed address, prefix or port; the one piece of
//! free text that reaches HAProxy, an HTTP health-check path, is checked against a narrow
//! character set. What does not pass is refused here, with a reason, before HAProxy sees it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
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

/// A load balancer's TCP listener on one of its VIPs, as HAProxy serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Proxy {
    pub lb_id: String,
    pub bind: SocketAddr,
    pub backend_port: u16,
    pub health_check: Option<HealthCheck>,
    pub source_ranges: Vec<IpNet>,
    /// Sorted; the server names are these addresses. A checked listener also has, for
    /// each, a backup server (see [`Proxy::fail_open`]).
    pub servers: Vec<IpAddr>,
    /// Its port is shared with other sockets of the edge (see
    /// [`crate::HaproxySettings::shared_ports`]): its frontend binds its VIP alone.
    pub bound_alone: bool,
}

impl Proxy {
    /// Unique per (load balancer, port, family), which is unique per (VIP, port) because a
    /// load balancer has one VIP per family.
    pub fn name(&self) -> String {
        let family = if self.bind.is_ipv4() { "v4" } else { "v6" };
        format!("{}_{}_{family}", self.lb_id, self.bind.port())
    }

    /// Whether the listener fails open: its servers are checked, so each has an unchecked
    /// backup twin and `option allbackups` spreads over all of them when every checked
    /// server is DOWN (as cloud load balancers do when no target is healthy). Without a
    /// check the servers are always up and need no backups.
    pub fn fail_open(&self) -> bool {
        self.health_check.is_some()
    }

    /// Whether `other` can take over this one's servers as they are: every server line
    /// (address, port, check) would read the same.
    pub fn same_server_lines(&self, other: &Self) -> bool {
        self.backend_port == other.backend_port && self.health_check == other.health_check
    }
}

/// The proxies of `listeners` (TCP ones: the caller refuses UDP) by name, each checked;
/// a listener that cannot be given to HAProxy is returned with its reason instead. Those
/// on `shared_ports` bind their VIP alone.
pub(crate) fn proxies(
    listeners: &BTreeMap<ListenerKey, ListenerRoute>,
    shared_ports: &BTreeSet<u16>,
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
            bound_alone: shared_ports.contains(&key.port),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Protocol;

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
            let (proxies, rejected) =
                proxies(&BTreeMap::from([(key, route(id, path))]), &BTreeSet::new());
            assert!(proxies.is_empty());
            assert_eq!(rejected, vec![(id.to_owned(), refused)]);
        }
        let (proxies, rejected) = proxies(
            &BTreeMap::from([(key, route("lb-1", "/healthz"))]),
            &BTreeSet::new(),
        );
        assert!(rejected.is_empty());
        assert_eq!(proxies.keys().collect::<Vec<_>>(), ["lb-1_80_v4"]);
    }
}
