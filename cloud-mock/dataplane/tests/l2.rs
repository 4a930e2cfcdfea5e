//! The L2 mode's announcements with real packets (root only): an edge and a client
//! namespace on one veth, the edge holding an IPv6 VIP through `L2Device`, the client
//! listening on a raw ICMPv6 socket for what the edge says of it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::BTreeSet;
use std::io::Read;
use std::net::{IpAddr, Ipv6Addr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cloud_mock_dataplane::{L2Config, L2Device};
use socket2::{Domain, Protocol, Socket, Type};

use support::netns::{Namespaces, in_netns, ip, is_root};

const VIP: &str = "2001:db8:51:100::9";

/// The neighbour advertisements of `vip` that `socket` receives within `within`: their
/// flags byte and target link-layer address option.
fn advertisements(socket: &Socket, vip: Ipv6Addr, within: Duration) -> Vec<(u8, Vec<u8>)> {
    let started = Instant::now();
    let mut seen = Vec::new();
    socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    while started.elapsed() < within {
        let mut packet = [0u8; 256];
        // The kernel hands a raw ICMPv6 socket the ICMPv6 message alone.
        let mut reader = socket;
        let Ok(length) = reader.read(&mut packet) else {
            continue;
        };
        let packet = &packet[..length];
        if packet.len() >= 32 && packet[0] == 136 && packet[8..24] == vip.octets() {
            seen.push((packet[4], packet[24..32].to_vec()));
        }
    }
    seen
}

#[test]
fn an_owned_ipv6_vip_is_advertised_at_takeover_and_again_with_the_override_flag() {
    if !is_root() {
        eprintln!("skipped: needs root (network namespaces)");
        return;
    }
    let hosts = Namespaces::create("l2na", &["e", "c"]);
    let (edge, client) = (hosts.name("e"), hosts.name("c"));
    ip(&[
        "link", "add", "eth0", "netns", &edge, "type", "veth", "peer", "name", "eth0", "netns",
        &client,
    ]);
    for (host, address) in [
        (&edge, "2001:db8:88::1/64"),
        (&client, "2001:db8:88::10/64"),
    ] {
        ip(&["-n", host, "addr", "add", address, "dev", "eth0", "nodad"]);
        ip(&["-n", host, "link", "set", "eth0", "up"]);
    }
    // The link sends IPv6 once its link-local addresses are no longer tentative.
    let up = Instant::now();
    while [&edge, &client]
        .iter()
        .any(|host| !ip(&["-n", host, "-6", "addr", "show", "dev", "eth0", "tentative"]).is_empty())
    {
        assert!(
            up.elapsed() < Duration::from_secs(10),
            "IPv6 on the link is not ready"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let links = ip(&["-n", &edge, "-o", "link", "show", "dev", "eth0"]);
    let mac: Vec<u8> = links
        .split("link/ether ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap()
        .split(':')
        .map(|octet| u8::from_str_radix(octet, 16).unwrap())
        .collect();
    let vip: Ipv6Addr = VIP.parse().unwrap();

    let listener = in_netns(&client, || {
        Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::ICMPV6)).unwrap()
    });
    // The kernel's own advertisement at takeover stays off (`ndisc_notify` 0, prepare not
    // called): what the client sees is the device's.
    in_netns(&edge, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let mut device = L2Device::new(L2Config {
                    device: "eth0".to_owned(),
                    // This thread is in the edge's namespace, and so are its children.
                    ip_program: PathBuf::from("ip"),
                    arping_program: PathBuf::from("arping"),
                    sysctl_program: PathBuf::from("sysctl"),
                    vip_ranges: Vec::new(),
                });
                device.hold(&BTreeSet::from([IpAddr::V6(vip)])).await;
                let at_takeover = advertisements(&listener, vip, Duration::from_millis(500));
                device.announce_held().await;
                let again = advertisements(&listener, vip, Duration::from_millis(500));
                for (when, seen) in [("at takeover", &at_takeover), ("again", &again)] {
                    assert_eq!(seen.len(), 1, "one advertisement {when}: {seen:?}");
                    let (flags, option) = &seen[0];
                    assert_eq!(*flags, 0x20, "override, unsolicited {when}");
                    assert_eq!(option[..2], [2, 1], "a target link-layer address {when}");
                    assert_eq!(option[2..], mac[..], "the edge's own address {when}");
                }
            });
    });
}
