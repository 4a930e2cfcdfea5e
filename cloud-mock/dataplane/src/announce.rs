//! Announcing: the VIPs this edge can forward, as routes in a kernel routing table of
//! their own that a BGP speaker on the host exports to the routers (BIRD's kernel
//! protocol with `learn`, or FRR's `redistribute table`), the split MetalLB's FRR mode and
//! Katran with ExaBGP make: the balancer decides what it can serve, a real speaker
//! announces it, with BFD for fast failure detection.
//!
//! Each VIP is a `blackhole VIP/32` (`/128`) route in that table with `proto N`: the table
//! is read by the speaker only (no `ip rule` points at it), so the routes forward nothing
//! on the edge itself. Writing the route announces the VIP, deleting it withdraws it. At
//! start the table is adopted (routes still wanted stay, so a restart does not flap them;
//! the others go), and a drained edge withdraws every VIP before it stops serving.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::BackendHealth;
use crate::command::{Program, already_gone, family_flag, host_prefix};
use crate::plan::LbView;

/// Where announcements go, and how a drain withdraws them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnounceConfig {
    /// The kernel routing table the speaker exports.
    pub table: u32,
    /// The `proto` of the routes this edge writes: another writer's are never touched.
    pub route_protocol: u8,
    /// How long a stopping edge keeps serving after it withdrew its VIPs: the routers'
    /// time to move new flows to the other edges, and the connections' to finish.
    pub drain: Duration,
}

/// Wait before trying again after a failed route change.
const RETRY: Duration = Duration::from_secs(1);

/// The VIPs this edge can forward: those of the load balancers it realised that have a
/// backend its own checks find healthy (`health` of a view). A VIP that several load
/// balancers share is offered while any of them can be served.
pub(crate) fn offered<'a>(
    views: impl IntoIterator<Item = &'a LbView>,
    health: impl Fn(&LbView) -> Vec<(IpAddr, BackendHealth)>,
) -> BTreeSet<IpAddr> {
    views
        .into_iter()
        .filter(|view| view.realised)
        .filter(|view| {
            health(view)
                .iter()
                .any(|(_, health)| *health == BackendHealth::Healthy)
        })
        .flat_map(|view| view.vips.iter().copied())
        .collect()
}

/// `ip` arguments `family route VERB ... table T proto P`: the routes of this edge's table.
fn table_args(family: &str, verb: &str, route: &[&str], config: &AnnounceConfig) -> Vec<String> {
    let (table, protocol) = (config.table.to_string(), config.route_protocol.to_string());
    [family, "route", verb]
        .into_iter()
        .chain(route.iter().copied())
        .chain(["table", &table, "proto", &protocol])
        .map(str::to_owned)
        .collect()
}

/// The `ip route` arguments of one announcement: `replace` (announce) or `del`.
fn route_args(verb: &str, vip: IpAddr, config: &AnnounceConfig) -> Vec<String> {
    table_args(
        family_flag(vip),
        verb,
        &["blackhole", &host_prefix(vip)],
        config,
    )
}

/// The `ip route show` arguments that list this edge's announcements of one family.
fn list_args(family: &str, config: &AnnounceConfig) -> Vec<String> {
    table_args(family, "show", &[], config)
}

/// The VIPs of `ip route show` output (`blackhole 198.51.100.7 ...` lines).
fn parse_announced(output: &str) -> BTreeSet<IpAddr> {
    output
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("blackhole"))
                .then(|| words.next())
                .flatten()
                .and_then(|prefix| prefix.split('/').next())
                .and_then(|ip| ip.parse().ok())
        })
        .collect()
}

/// Keeps the table equal to the VIPs `offered` says, until `cancel`; then withdraws them
/// all. Changes are retried until they hold.
pub struct Announcer {
    ip: Program,
    config: AnnounceConfig,
}

impl Announcer {
    pub(crate) fn new(config: AnnounceConfig, ip: Program) -> Self {
        Self { ip, config }
    }

    /// The VIPs the table announces now.
    async fn announced(&self) -> BTreeSet<IpAddr> {
        let mut announced = BTreeSet::new();
        for family in ["-4", "-6"] {
            match self.ip.run(&list_args(family, &self.config)).await {
                Ok(output) => announced.extend(parse_announced(&output)),
                // A family's table exists once a route is in it.
                Err(error) if error.stderr().contains("does not exist") => {}
                Err(error) => warn!(%error, "reading the announced VIPs failed"),
            }
        }
        announced
    }

    /// Writes or deletes routes until the table holds `wanted`; whether it does.
    async fn converge(&self, announced: &mut BTreeSet<IpAddr>, wanted: &BTreeSet<IpAddr>) -> bool {
        let mut held = true;
        for &vip in wanted.difference(&announced.clone()) {
            match self.ip.run(&route_args("replace", vip, &self.config)).await {
                Ok(_) => {
                    info!(%vip, table = self.config.table, "VIP announced");
                    announced.insert(vip);
                }
                Err(error) => {
                    warn!(%vip, %error, "announcing a VIP failed; retrying");
                    held = false;
                }
            }
        }
        for &vip in announced.clone().difference(wanted) {
            match self.ip.run(&route_args("del", vip, &self.config)).await {
                Err(error) if !already_gone(&error) => {
                    warn!(%vip, %error, "withdrawing a VIP failed; retrying");
                    held = false;
                }
                _ => {
                    info!(%vip, table = self.config.table, "VIP withdrawn");
                    announced.remove(&vip);
                }
            }
        }
        held
    }

    /// Runs until `cancel`, then withdraws everything it announced. `offered` is the set
    /// of VIPs this edge can forward now.
    pub async fn run(
        self,
        mut offered: watch::Receiver<BTreeSet<IpAddr>>,
        cancel: CancellationToken,
    ) {
        let mut announced = self.announced().await;
        loop {
            let wanted = offered.borrow_and_update().clone();
            let held = self.converge(&mut announced, &wanted).await;
            let retry = async {
                if held {
                    std::future::pending::<()>().await;
                } else {
                    tokio::time::sleep(RETRY).await;
                }
            };
            tokio::select! {
                () = cancel.cancelled() => break,
                changed = offered.changed() => if changed.is_err() { break },
                () = retry => {}
            }
        }
        // Withdraw before anything stops serving, so that a drain drops nothing.
        for _ in 0..3 {
            if self.converge(&mut announced, &BTreeSet::new()).await {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AnnounceConfig {
        AnnounceConfig {
            table: 100,
            route_protocol: 44,
            drain: Duration::from_secs(1),
        }
    }

    #[test]
    fn an_announcement_is_a_blackhole_route_of_our_own_in_the_table() {
        let vip: IpAddr = "198.51.100.7".parse().unwrap();
        assert_eq!(
            route_args("replace", vip, &config()).join(" "),
            "-4 route replace blackhole 198.51.100.7/32 table 100 proto 44"
        );
        let vip6: IpAddr = "2001:db8:51:100::7".parse().unwrap();
        assert_eq!(
            route_args("del", vip6, &config()).join(" "),
            "-6 route del blackhole 2001:db8:51:100::7/128 table 100 proto 44"
        );
        assert_eq!(
            list_args("-6", &config()).join(" "),
            "-6 route show table 100 proto 44"
        );
    }

    #[test]
    fn a_vip_is_offered_while_a_realised_load_balancer_on_it_has_a_healthy_backend() {
        let ip = |text: &str| -> IpAddr { text.parse().unwrap() };
        let view = |vip: &str, backend: &str, realised: bool| LbView {
            vips: vec![ip(vip)],
            backends: vec![ip(backend)],
            checks: Vec::new(),
            realised,
        };
        let views = [
            view("198.51.100.1", "10.0.0.1", true),
            view("198.51.100.2", "10.0.0.2", true),
            view("198.51.100.3", "10.0.0.1", false),
            // Shares .2 with the one above; its backend is down.
            view("198.51.100.2", "10.0.0.3", true),
        ];
        let health = |view: &LbView| {
            view.backends
                .iter()
                .map(|&backend| {
                    let health = if backend == ip("10.0.0.3") {
                        BackendHealth::Unhealthy
                    } else {
                        BackendHealth::Healthy
                    };
                    (backend, health)
                })
                .collect()
        };
        assert_eq!(
            offered(&views, health),
            BTreeSet::from([ip("198.51.100.1"), ip("198.51.100.2")]),
            "not the one the data plane rejected"
        );
        let all_down = |view: &LbView| {
            view.backends
                .iter()
                .map(|&b| (b, BackendHealth::Unknown))
                .collect()
        };
        assert!(
            offered(&views, all_down).is_empty(),
            "unknown is not healthy"
        );
    }

    #[test]
    fn announced_vips_are_read_back() {
        let output = "blackhole 198.51.100.7 proto 44 \nblackhole 198.51.100.9 proto 44\nunicast 10.0.0.0/8 dev x\n";
        assert_eq!(
            parse_announced(output),
            BTreeSet::from([
                "198.51.100.7".parse().unwrap(),
                "198.51.100.9".parse().unwrap()
            ])
        );
        assert_eq!(
            parse_announced("blackhole 2001:db8:51:100::7 proto 44 metric 1024 pref medium"),
            BTreeSet::from(["2001:db8:51:100::7".parse().unwrap()])
        );
    }
}
