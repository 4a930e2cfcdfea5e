//! Reading back what a node proxy wrote into its node's kernel. Pure: a listing in, an
//! answer out. Whether a Service port is programmed (for recovery and mode-switch checks),
//! and single rules or map elements of it (for tests that play someone else editing the
//! node's rules).

use std::net::{IpAddr, SocketAddrV4};
use std::ops::Range;

use tandem_common::ProxyMode;
use tandem_netlab::IpFamily;

/// The command that lists what a node proxy of `mode` owns for `family`: the nat table in
/// iptables mode (`ip6tables` for IPv6), table `ip tandem` (`ip6 tandem`) in nftables mode.
pub fn listing_command(mode: ProxyMode, family: IpFamily) -> &'static [&'static str] {
    match (mode, family) {
        (ProxyMode::Iptables, IpFamily::V4) => &["iptables", "-w", "-t", "nat", "-S"],
        (ProxyMode::Iptables, IpFamily::V6) => &["ip6tables", "-w", "-t", "nat", "-S"],
        (ProxyMode::Nftables, IpFamily::V4) => &["nft", "list", "table", "ip", "tandem"],
        (ProxyMode::Nftables, IpFamily::V6) => &["nft", "list", "table", "ip6", "tandem"],
    }
}

/// Whether a listing of `mode` matches packets addressed to `ip`.
pub fn mentions(mode: ProxyMode, listing: &str, ip: IpAddr) -> bool {
    let host_prefix = if ip.is_ipv4() { 32 } else { 128 };
    match mode {
        ProxyMode::Iptables => listing.contains(&format!("-d {ip}/{host_prefix}")),
        ProxyMode::Nftables => listing.contains(&format!("{ip} . ")),
    }
}

/// A TCP Service port, as the node proxy names it in its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    pub namespace: String,
    pub name: String,
    /// The port's name.
    pub port: String,
}

impl ServicePort {
    /// Whether an iptables rule (`-S` form) carries kube-proxy's comment for the port's
    /// endpoints, `NAMESPACE/NAME:PORT` (quoted or not, by iptables version).
    fn commented(&self, rule: &str) -> bool {
        let comment = format!("{}/{}:{}", self.namespace, self.name, self.port);
        rule.contains(&format!("--comment \"{comment}\" "))
            || rule.contains(&format!("--comment {comment} "))
    }

    /// The readable end of the port's nftables chain names.
    fn chain_suffix(&self) -> String {
        format!("-{}/{}/tcp/{}", self.namespace, self.name, self.port)
    }
}

/// Whether a listing of `mode` holds what serves `port` over `endpoints`. iptables: the
/// jump from PREROUTING to KUBE-SERVICES and the DNAT to every endpoint; nftables: the
/// port's `service-…` chain and every endpoint among the buckets it picks from.
pub fn programmed(
    mode: ProxyMode,
    listing: &str,
    port: &ServicePort,
    endpoints: &[SocketAddrV4],
) -> bool {
    match mode {
        ProxyMode::Iptables => {
            let hooked = listing
                .lines()
                .any(|l| l.starts_with("-A PREROUTING ") && l.ends_with("-j KUBE-SERVICES"));
            hooked
                && endpoints
                    .iter()
                    .all(|e| endpoint_dnat_rule(listing, port, *e).is_some())
        }
        ProxyMode::Nftables => endpoints
            .iter()
            .all(|e| endpoint_map_element(listing, port, *e).is_some()),
    }
}

/// iptables mode: the rule (`-S` form) that DNATs `port`'s connections to `endpoint`.
pub fn endpoint_dnat_rule<'a>(
    listing: &'a str,
    port: &ServicePort,
    endpoint: SocketAddrV4,
) -> Option<&'a str> {
    let dnat = format!("-j DNAT --to-destination {endpoint}");
    listing.lines().find(|l| {
        l.starts_with("-A KUBE-SEP-") && port.commented(l) && l.trim_end().ends_with(&dnat)
    })
}

/// iptables mode: the endpoint of the last rule of `port`'s `KUBE-SVC-…` chain, the one
/// whose rule has no `statistic` match. A connection that reaches an endpoint chain without
/// its DNAT rule falls through to the next endpoint's rule; only at this last one does it
/// leave the chain without a DNAT, and fail.
pub fn last_endpoint(listing: &str, port: &ServicePort) -> Option<SocketAddrV4> {
    let endpoint_chain = listing
        .lines()
        .rev()
        .filter(|l| l.starts_with("-A KUBE-SVC-") && port.commented(l))
        .find_map(|l| l.split_once(" -j KUBE-SEP-"))
        .map(|(_, chain)| format!("-A KUBE-SEP-{} ", chain.trim()))?;
    listing
        .lines()
        .filter(|l| l.starts_with(&endpoint_chain))
        .find_map(|l| l.split_once("-j DNAT --to-destination "))
        .and_then(|(_, endpoint)| endpoint.trim().parse().ok())
}

/// One element of an nftables map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapElement {
    pub map: String,
    /// The element's key, as `nft` prints it (a bucket range).
    pub key: String,
}

impl MapElement {
    /// `nft delete element` for this element of table `ip tandem`.
    pub fn delete_command(&self) -> Vec<String> {
        ["nft", "delete", "element", "ip", "tandem", &self.map]
            .iter()
            .map(|s| (*s).to_owned())
            .chain([format!("{{ {} }}", self.key)])
            .collect()
    }
}

/// nftables mode: an element of the `endpoints-…` map `port`'s service chain picks from,
/// within its range of buckets, that sends them to `endpoint`.
pub fn endpoint_map_element(
    listing: &str,
    port: &ServicePort,
    endpoint: SocketAddrV4,
) -> Option<MapElement> {
    let (map, buckets) = bucket_range(listing, port)?;
    let wanted = format!("{} . {}", endpoint.ip(), endpoint.port());
    let elements = map_elements(listing, &map)?;
    elements
        .split(',')
        .filter_map(|element| element.split_once(" : "))
        .find(|(key, value)| {
            let first = key.trim().split('-').next().and_then(|n| n.parse().ok());
            value.trim() == wanted && first.is_some_and(|first| buckets.contains(&first))
        })
        .map(|(key, _)| MapElement {
            map: map.clone(),
            key: key.trim().to_owned(),
        })
}

/// Where `port`'s `service-…` chain picks its endpoint: the map, and the buckets of its
/// range (`numgen random mod N offset O map @M`).
fn bucket_range(listing: &str, port: &ServicePort) -> Option<(String, Range<u64>)> {
    let suffix = format!("{} {{", port.chain_suffix());
    let mut lines = listing.lines().map(str::trim);
    lines.find(|l| l.starts_with("chain service-") && l.ends_with(&suffix))?;
    let pick = lines
        .take_while(|l| *l != "}")
        .find(|l| l.contains(" numgen random mod "))?;
    let word_after = |word: &str| {
        let mut words = pick.split_whitespace();
        words.find(|w| *w == word)?;
        words.next()
    };
    let buckets: u64 = word_after("mod")?.parse().ok()?;
    let offset: u64 = match word_after("offset") {
        Some(offset) => offset.parse().ok()?,
        None => 0,
    };
    let map = word_after("map")?.strip_prefix('@')?.to_owned();
    Some((map, offset..offset + buckets))
}

/// The text of a map's elements (`KEY : VALUE, …`), from a table listing.
fn map_elements(listing: &str, map: &str) -> Option<String> {
    let header = format!("map {map} {{");
    let mut lines = listing.lines().map(str::trim);
    lines.find(|l| *l == header)?;
    let mut elements = String::new();
    let mut inside = false;
    for line in lines.take_while(|l| *l != "}") {
        let text = match line.strip_prefix("elements = {") {
            Some(first) => {
                inside = true;
                first
            }
            None if inside => line,
            None => continue,
        };
        match text.split_once('}') {
            Some((last, _)) => {
                elements.push_str(last);
                inside = false;
            }
            None => {
                elements.push_str(text);
                elements.push(' ');
            }
        }
    }
    Some(elements)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web() -> ServicePort {
        ServicePort {
            namespace: "default".to_owned(),
            name: "web".to_owned(),
            port: "http".to_owned(),
        }
    }

    const IPTABLES: &str = "-P PREROUTING ACCEPT
-N KUBE-SEP-AAAA
-N KUBE-SEP-BBBB
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-SEP-AAAA -s 10.244.1.2/32 -m comment --comment \"default/web:http\" -j KUBE-MARK-MASQ
-A KUBE-SEP-AAAA -p tcp -m comment --comment \"default/web:http\" -m tcp -j DNAT --to-destination 10.244.1.2:8080
-A KUBE-SEP-BBBB -p tcp -m comment --comment \"default/web-2:http\" -m tcp -j DNAT --to-destination 10.244.2.2:8080
-A KUBE-SERVICES -d 198.51.100.1/32 -p tcp -m comment --comment \"default/web:http loadbalancer IP\" -m tcp --dport 80 -j KUBE-FW-CCCC
-A KUBE-SVC-DDDD -m comment --comment \"default/web:http\" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-BBBB
-A KUBE-SVC-DDDD -m comment --comment \"default/web:http\" -j KUBE-SEP-AAAA
";

    #[test]
    fn iptables_rules_are_found_by_comment_and_endpoint() {
        let one = "10.244.1.2:8080".parse().unwrap();
        let other = "10.244.2.2:8080".parse().unwrap();
        assert!(endpoint_dnat_rule(IPTABLES, &web(), one).is_some_and(|r| r.contains("AAAA")));
        // The other endpoint's rule belongs to another Service.
        assert_eq!(endpoint_dnat_rule(IPTABLES, &web(), other), None);
        assert!(programmed(ProxyMode::Iptables, IPTABLES, &web(), &[one]));
        assert!(!programmed(
            ProxyMode::Iptables,
            IPTABLES,
            &web(),
            &[one, other]
        ));
        let unhooked: String = IPTABLES
            .lines()
            .filter(|l| !l.starts_with("-A PREROUTING"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(!programmed(ProxyMode::Iptables, &unhooked, &web(), &[one]));
        assert_eq!(last_endpoint(IPTABLES, &web()), Some(one));
        assert!(mentions(
            ProxyMode::Iptables,
            IPTABLES,
            "198.51.100.1".parse().unwrap()
        ));
    }

    const NFTABLES: &str = "table ip tandem {
	map endpoints-tcp-0 {
		typeof numgen random mod 1 : ip daddr . tcp dport
		flags interval
		elements = { 0-360359 : 10.244.1.2 . 8080, 360360-720719 : 10.244.2.2 . 8080, 1441440-2162159 : 10.244.1.2 . 8080,
			     2162160-2882879 : 10.244.1.3 . 8080 }
	}

	chain service-SUSTUHLJ-default/web/tcp/http {
		ip daddr 10.96.204.90 tcp dport 80 ip saddr != 10.244.0.0/16 jump mark-for-masquerade
		meta l4proto tcp dnat ip to numgen random mod 720720 map @endpoints-tcp-0
	}

	chain service-GW6G3FS6-default/other/tcp/http {
		meta l4proto tcp dnat ip to numgen random mod 1441440 offset 1441440 map @endpoints-tcp-0
	}
}
";

    #[test]
    fn nftables_elements_are_found_within_the_ports_buckets() {
        let mut other = web();
        other.name = "other".to_owned();
        let element =
            |port: &ServicePort, e: &str| endpoint_map_element(NFTABLES, port, e.parse().unwrap());
        assert_eq!(
            element(&web(), "10.244.2.2:8080"),
            Some(MapElement {
                map: "endpoints-tcp-0".to_owned(),
                key: "360360-720719".to_owned()
            })
        );
        // The same endpoint in another port's range is that port's element.
        assert_eq!(element(&web(), "10.244.1.2:8080").unwrap().key, "0-360359");
        assert_eq!(
            element(&other, "10.244.1.2:8080").unwrap().key,
            "1441440-2162159"
        );
        assert_eq!(element(&web(), "10.244.1.3:8080"), None);
        assert_eq!(
            element(&other, "10.244.1.3:8080").unwrap().key,
            "2162160-2882879"
        );
        assert_eq!(
            element(&web(), "10.244.2.2:8080")
                .unwrap()
                .delete_command()
                .join(" "),
            "nft delete element ip tandem endpoints-tcp-0 { 360360-720719 }"
        );
        let both = [
            "10.244.1.2:8080".parse().unwrap(),
            "10.244.2.2:8080".parse().unwrap(),
        ];
        assert!(programmed(ProxyMode::Nftables, NFTABLES, &web(), &both));
        assert!(!programmed(ProxyMode::Nftables, NFTABLES, &other, &both));
        let mut missing = web();
        missing.name = "missing".to_owned();
        assert!(!programmed(
            ProxyMode::Nftables,
            NFTABLES,
            &missing,
            &both[..1]
        ));
        assert!(!programmed(ProxyMode::Nftables, "", &web(), &both[..1]));
    }
}
