//! Do: the kernel side of the L2 announcement mode, for networks without BGP. The edge
//! that owns a VIP (the cloud-mock crate decides that, with an etcd lease) holds it as an
//! address of the device on the clients' network, so that it alone answers ARP and
//! neighbour solicitations for it, and announces it there on takeover and periodically:
//! a gratuitous ARP (`arping -U`) for IPv4, and for IPv6 an unsolicited neighbour
//! advertisement (RFC 4861 §7.2.6) sent to all nodes from a raw ICMPv6 socket, besides
//! the one the kernel sends when the address is added (`ndisc_notify`).
//!
//! Every edge's listeners bind the VIPs on `--vip-device` (loopback) as in one-edge mode;
//! `arp_ignore=1` on the device keeps an edge from answering ARP for addresses it has only
//! there, and IPv6 answers solicitations only for addresses of the asking interface.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv6Addr, SocketAddrV6};
use std::path::PathBuf;

use ipnet::IpNet;
use tracing::{info, warn};

use crate::command::{Program, add_address_args, already_gone, delete_address_args};
use crate::error::CommandError;

/// Where the owned VIPs are held, and the programs that do it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct L2Config {
    /// The device on the clients' network.
    pub device: String,
    pub ip_program: PathBuf,
    /// Thomas Habets' `arping` (Debian's `arping`), which sends the gratuitous ARPs.
    pub arping_program: PathBuf,
    /// `sysctl`, which sets the device's ARP and neighbour-discovery settings.
    pub sysctl_program: PathBuf,
    /// The VIP pools' ranges: a single address of theirs on the device at start was left
    /// by an earlier run of this edge that died without giving it up.
    pub vip_ranges: Vec<IpNet>,
}

/// The device's settings the mode needs: answer ARP only for the device's own addresses,
/// source ARP requests from them, and announce new IPv6 addresses unasked.
fn sysctls(device: &str) -> [String; 3] {
    [
        format!("net.ipv4.conf.{device}.arp_ignore=1"),
        format!("net.ipv4.conf.{device}.arp_announce=2"),
        format!("net.ipv6.conf.{device}.ndisc_notify=1"),
    ]
}

/// All nodes on the link: where an unsolicited neighbour advertisement goes.
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);

/// An unsolicited neighbour advertisement of `vip` at `mac` (RFC 4861 §4.4, §7.2.6):
/// ICMPv6 type 136 with the override flag, so that neighbours replace the cached
/// address of the VIP's earlier owner, and the target link-layer address option. The
/// kernel fills in the checksum of a raw ICMPv6 socket.
fn unsolicited_advertisement(vip: Ipv6Addr, mac: [u8; 6]) -> [u8; 32] {
    let mut packet = [0; 32];
    packet[0] = 136;
    packet[4] = 0x20;
    packet[8..24].copy_from_slice(&vip.octets());
    // Option 2, the target link-layer address, 1 × 8 octets long.
    packet[24] = 2;
    packet[25] = 1;
    packet[26..32].copy_from_slice(&mac);
    packet
}

/// The index and the MAC address of the device that `listing` (`ip -o link show dev
/// DEVICE`) shows.
fn link_identity(listing: &str) -> Option<(u32, [u8; 6])> {
    let index = listing.split(':').next()?.trim().parse().ok()?;
    let mut words = listing.split_whitespace();
    words.find(|word| *word == "link/ether")?;
    let mut mac = [0; 6];
    let mut octets = words.next()?.split(':');
    for octet in &mut mac {
        *octet = u8::from_str_radix(octets.next()?, 16).ok()?;
    }
    octets.next().is_none().then_some((index, mac))
}

/// Sends `packet` from `vip` to all nodes on the link of device `index`, with the hop
/// limit of 255 that neighbour discovery requires.
fn send_to_all_nodes(vip: Ipv6Addr, index: u32, packet: &[u8]) -> std::io::Result<()> {
    use socket2::{Domain, Protocol, SockAddr, Socket, Type};
    let socket = Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::ICMPV6))?;
    socket.set_multicast_hops_v6(255)?;
    socket.set_multicast_if_v6(index)?;
    socket.bind(&SockAddr::from(SocketAddrV6::new(vip, 0, 0, index)))?;
    socket.send_to(
        packet,
        &SockAddr::from(SocketAddrV6::new(ALL_NODES, 0, 0, index)),
    )?;
    Ok(())
}

/// The VIPs that `listing` (`ip -o address show dev DEVICE`) holds as single addresses
/// inside `ranges`.
fn vips_held(listing: &str, ranges: &[IpNet]) -> Vec<IpAddr> {
    listing
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            words.find(|word| *word == "inet" || *word == "inet6")?;
            let net: IpNet = words.next()?.parse().ok()?;
            (net.prefix_len() == net.max_prefix_len()).then_some(net.addr())
        })
        .filter(|vip| ranges.iter().any(|range| range.contains(vip)))
        .collect()
}

/// `arping` arguments of one gratuitous ARP for `vip` on `device`; `-w 0` ends it once
/// sent, instead of waiting a second for a reply that never comes.
fn gratuitous_arp_args(vip: IpAddr, device: &str) -> Vec<String> {
    let vip = vip.to_string();
    [
        "-q", "-U", "-c", "1", "-w", "0", "-i", device, "-S", &vip, &vip,
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The VIPs this edge holds on its device.
pub struct L2Device {
    config: L2Config,
    ip: Program,
    arping: Program,
    held: BTreeSet<IpAddr>,
}

impl L2Device {
    pub fn new(config: L2Config) -> Self {
        Self {
            ip: Program::new(config.ip_program.clone()),
            arping: Program::new(config.arping_program.clone()),
            config,
            held: BTreeSet::new(),
        }
    }

    /// Sets the device's ARP and neighbour-discovery settings, and gives up the VIPs an
    /// earlier run held there (it died, with SIGKILL or a crash, before it could): this
    /// edge owns nothing yet, and a VIP left on the device would be answered here as
    /// well as by its new owner. An edge that cannot would answer for VIPs it does not
    /// own, so this is an error.
    pub async fn prepare(&self) -> Result<(), CommandError> {
        let sysctl = Program::new(self.config.sysctl_program.clone());
        for setting in sysctls(&self.config.device) {
            sysctl.run(&["-qw".to_owned(), setting]).await?;
        }
        let device = &self.config.device;
        let listing = ["-o", "address", "show", "dev", device].map(str::to_owned);
        let listing = self.ip.run(&listing).await?;
        for vip in vips_held(&listing, &self.config.vip_ranges) {
            match self.ip.run(&delete_address_args(vip, device)).await {
                Ok(_) => info!(%vip, device, "VIP of an earlier run given up"),
                Err(error) if already_gone(&error) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// The VIPs held now.
    pub fn held(&self) -> &BTreeSet<IpAddr> {
        &self.held
    }

    /// Holds exactly `owned`: releases the others first, then takes and announces the new
    /// ones. What fails is retried by the next call.
    pub async fn hold(&mut self, owned: &BTreeSet<IpAddr>) {
        let device = self.config.device.clone();
        for vip in self.held.clone().difference(owned) {
            match self.ip.run(&delete_address_args(*vip, &device)).await {
                Ok(_) => info!(%vip, device, "VIP given up"),
                Err(error) if already_gone(&error) => {}
                Err(error) => {
                    warn!(%error, %vip, "cannot give a VIP up; will retry");
                    continue;
                }
            }
            self.held.remove(vip);
        }
        for &vip in owned.difference(&self.held.clone()) {
            if let Err(error) = self.ip.run(&add_address_args(vip, &device)).await {
                warn!(%error, %vip, "cannot take a VIP; will retry");
                continue;
            }
            info!(%vip, device, "VIP taken");
            self.held.insert(vip);
            self.announce(vip).await;
        }
    }

    /// Announces every held VIP again, so that a client that missed the takeover (or a
    /// switch that forgot the port) learns where it is.
    pub async fn announce_held(&self) {
        for &vip in &self.held {
            self.announce(vip).await;
        }
    }

    async fn announce(&self, vip: IpAddr) {
        let vip = match vip {
            IpAddr::V6(vip) => return self.advertise(vip).await,
            IpAddr::V4(_) => vip,
        };
        match self
            .arping
            .run(&gratuitous_arp_args(vip, &self.config.device))
            .await
        {
            Ok(_) => {}
            // arping exits 1 when nothing answers, as nothing does an unsolicited ARP.
            Err(CommandError::Failed { status, stderr, .. })
                if status.ends_with("exit status: 1") && stderr.is_empty() => {}
            Err(error) => warn!(%error, %vip, "cannot announce a VIP"),
        }
    }
}

impl L2Device {
    /// An unsolicited neighbour advertisement of `vip` on the device.
    async fn advertise(&self, vip: Ipv6Addr) {
        let device = &self.config.device;
        let listing = ["-o", "link", "show", "dev", device].map(str::to_owned);
        let identity = match self.ip.run(&listing).await {
            Ok(listing) => link_identity(&listing),
            Err(error) => {
                warn!(%error, %vip, "cannot read the device's address to announce a VIP");
                return;
            }
        };
        let Some((index, mac)) = identity else {
            warn!(%vip, device, "the device has no Ethernet address: cannot announce a VIP");
            return;
        };
        if let Err(error) = send_to_all_nodes(vip, index, &unsolicited_advertisement(vip, mac)) {
            warn!(%error, %vip, "cannot announce a VIP");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsolicited_advertisement_overrides_and_names_the_owners_address() {
        let vip: Ipv6Addr = "2001:db8:51:100::7".parse().unwrap();
        let packet = unsolicited_advertisement(vip, [0x8a, 0, 0x5e, 1, 2, 3]);
        assert_eq!(packet[0], 136, "a neighbour advertisement");
        assert_eq!(packet[4], 0x20, "override, not solicited, not a router");
        assert_eq!(&packet[8..24], &vip.octets());
        assert_eq!(&packet[24..32], &[2, 1, 0x8a, 0, 0x5e, 1, 2, 3]);
        let listing = "3: eth1@if12: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP mode DEFAULT group default qlen 1000\\    link/ether 8a:00:5e:01:02:03 brd ff:ff:ff:ff:ff:ff link-netns tdm1-sw";
        assert_eq!(link_identity(listing), Some((3, [0x8a, 0, 0x5e, 1, 2, 3])));
        assert_eq!(
            link_identity("1: lo: <LOOPBACK> mtu 65536\\    link/loopback 00:00:00:00:00:00"),
            None
        );
    }

    #[test]
    fn the_device_answers_for_its_own_addresses_only() {
        assert_eq!(
            sysctls("eth1"),
            [
                "net.ipv4.conf.eth1.arp_ignore=1",
                "net.ipv4.conf.eth1.arp_announce=2",
                "net.ipv6.conf.eth1.ndisc_notify=1",
            ]
        );
        assert_eq!(
            gratuitous_arp_args("198.51.100.5".parse().unwrap(), "eth1").join(" "),
            "-q -U -c 1 -w 0 -i eth1 -S 198.51.100.5 198.51.100.5"
        );
    }

    #[test]
    fn the_vips_an_earlier_run_left_are_the_single_addresses_in_the_pools() {
        let listing = "\
3: eth1    inet 198.19.0.11/24 brd 198.19.0.255 scope global eth1\\       valid_lft forever preferred_lft forever
3: eth1    inet 198.51.100.7/32 scope global eth1\\       valid_lft forever preferred_lft forever
3: eth1    inet 192.0.2.9/32 scope global eth1\\       valid_lft forever preferred_lft forever
3: eth1    inet6 2001:db8:51:100::3/128 scope global nodad \\       valid_lft forever preferred_lft forever
3: eth1    inet6 fe80::1/64 scope link \\       valid_lft forever preferred_lft forever
";
        let ranges: Vec<IpNet> = vec![
            "198.51.100.0/24".parse().unwrap(),
            "2001:db8:51:100::/120".parse().unwrap(),
        ];
        assert_eq!(
            vips_held(listing, &ranges),
            [
                "198.51.100.7".parse::<IpAddr>().unwrap(),
                "2001:db8:51:100::3".parse().unwrap()
            ]
        );
    }
}
