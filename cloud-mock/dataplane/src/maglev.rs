//! Decide: passthrough flows that survive losing an edge. Every edge of an edge cluster
//! sends a given flow to the same node, without sharing any per-flow state.
//!
//! A VIP's nexthops (sorted, as [`crate::routes::desired_routes`] gives them) fill a Maglev
//! lookup table (Eisenbud et al., "Maglev: A Fast and Reliable Software Network Load
//! Balancer", NSDI 2016, §3.4; Katran does the same): each node's preference list is a
//! permutation of the table's slots, made from two hashes of its address with fixed keys,
//! and the nodes take turns claiming their next preferred free slot. The table depends
//! only on the set of nodes, so every edge computes the same one, and a node leaving or
//! joining moves little more than its own share of slots.
//!
//! The kernel side is one nftables table of our own ([`NFT_TABLE`]), hooked at prerouting:
//! - a TCP or UDP packet to a VIP takes the mark of the node in slot
//!   `jhash(saddr . sport . daddr . dport, SEED) mod SIZE` of its VIP's table (the seed is
//!   fixed, so the slot is the same on every edge), and the edge's flow map remembers it;
//! - a packet of a flow the map holds, whose node is still a nexthop of its VIP, keeps
//!   that node: a flow stays on the node it started on when a node that joined takes its
//!   slot;
//! - each node's mark leads, by an `ip rule` (`fwmark M lookup M`), to a routing table of
//!   its own whose default route is the node.
//!
//! Anything unmarked (ICMP, or packets before the first table is loaded) takes the VIP's
//! route in the main table, as without this steering. The `steering` module does the
//! writes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::hash::Hasher as _;
use std::net::IpAddr;

use siphasher::sip::SipHasher13;

use crate::plan::RouteTable;

/// Slots of a lookup table: a prime (the preference lists are permutations only then),
/// large enough that a node joining or leaving moves under 1 % of flows beyond its own
/// share up to 20 nodes (4,093 slots moved 1.4 % at 10 nodes); a map this size loads in
/// milliseconds.
pub(crate) const SIZE: u16 = 16381;

/// The seed of the kernel's jhash of a flow: fixed, so that every edge hashes a flow to
/// the same slot.
pub(crate) const SEED: u32 = 0x7a6d_6c76;

/// Fixed SipHash keys of a node's two preference hashes: every edge, whatever its build,
/// makes the same permutations.
const OFFSET_KEYS: (u64, u64) = (0x7461_6e64_656d_0001, 0x6d61_676c_6576_0001);
const SKIP_KEYS: (u64, u64) = (0x7461_6e64_656d_0002, 0x6d61_676c_6576_0002);

/// Our nftables table.
pub(crate) const NFT_TABLE: &str = "tandem_maglev";

fn address_hash(node: IpAddr, (k0, k1): (u64, u64)) -> u64 {
    let mut hasher = SipHasher13::new_with_keys(k0, k1);
    match node {
        IpAddr::V4(v4) => hasher.write(&v4.octets()),
        IpAddr::V6(v6) => hasher.write(&v6.octets()),
    }
    hasher.finish()
}

/// The Maglev lookup table of `nodes`: for each of [`SIZE`] slots, the index in `nodes` of
/// the node it sends flows to. Empty without nodes.
pub(crate) fn lookup_table(nodes: &[IpAddr]) -> Vec<u16> {
    const EMPTY: u16 = u16::MAX;
    let size = u64::from(SIZE);
    if nodes.is_empty() {
        return Vec::new();
    }
    // (next slot to try, step): the node's permutation is `offset + j * skip mod SIZE`.
    let mut preferences: Vec<(u64, u64)> = nodes
        .iter()
        .map(|&node| {
            let offset = address_hash(node, OFFSET_KEYS) % size;
            let skip = address_hash(node, SKIP_KEYS) % (size - 1) + 1;
            (offset, skip)
        })
        .collect();
    let mut table = vec![EMPTY; usize::from(SIZE)];
    let mut filled = 0;
    'fill: loop {
        for (index, (next, skip)) in (0_u16..).zip(preferences.iter_mut()) {
            // A prime size makes every permutation reach every slot, so this ends.
            let slot = loop {
                let slot = *next;
                *next = (*next + *skip) % size;
                if table[slot as usize] == EMPTY {
                    break slot as usize;
                }
            };
            table[slot] = index;
            filled += 1;
            if filled == table.len() {
                break 'fill;
            }
        }
    }
    table
}

/// The routing table (and mark) of each node that a desired route uses: a node keeps the
/// table it has in `current`, so that connections marked for it stay on it; a new node
/// takes the lowest free table from `first` up; at most `capacity` nodes get one.
pub(crate) fn node_tables(
    current: &BTreeMap<IpAddr, u32>,
    desired: &RouteTable,
    first: u32,
    capacity: u32,
) -> BTreeMap<IpAddr, u32> {
    let wanted: BTreeSet<IpAddr> = desired.values().flatten().copied().collect();
    let mut tables: BTreeMap<IpAddr, u32> = current
        .iter()
        .filter(|(node, _)| wanted.contains(node))
        .map(|(&node, &table)| (node, table))
        .collect();
    let taken: BTreeSet<u32> = tables.values().copied().collect();
    let mut free = (first..first.saturating_add(capacity)).filter(|table| !taken.contains(table));
    for node in wanted {
        if tables.contains_key(&node) {
            continue;
        }
        match free.next() {
            Some(table) => {
                tables.insert(node, table);
            }
            None => break,
        }
    }
    tables
}

/// Flows remembered per family: at most this many at once.
const FLOWS: u32 = 262_144;
/// A flow not seen this long is forgotten: it then follows the lookup table alone.
const FLOW_TIMEOUT: &str = "10m";

/// The kernel's types of a family's flow key (`saddr . sport . daddr . dport`).
fn flow_key_type(family: &str) -> &'static str {
    if family == "ip" {
        "ipv4_addr . inet_service . ipv4_addr . inet_service"
    } else {
        "ipv6_addr . inet_service . ipv6_addr . inet_service"
    }
}

/// The `nft -f` text that steers `desired`, in place of what an earlier load made of our
/// table, whose lookup chains were `nodes_0 .. nodes_{previous_chains}`. Returns the text
/// and how many lookup chains it makes.
///
/// Each distinct set of nodes (VIPs of one node pool share it) gets a chain holding its
/// lookup table; a verdict map per family sends each VIP's TCP and UDP packets to its
/// chain. The chain first looks the flow up in the family's flow map: a flow whose node
/// is still one of its VIP's keeps it; any other takes the node its lookup-table slot
/// names, and the flow map remembers it. The flow map is the edge's own memory of its
/// flows, so that a node joining moves none of them; it is kept across loads (only the
/// steering around it is replaced), and needs no reply packets, which take the nodes'
/// own way back to the client (conntrack, seeing one direction only, drops its state for
/// such flows).
///
/// A VIP with a node that has no table (more nodes than tables) is left to its
/// main-table route. The lookup tables are anonymous maps in their chain's rule: nft 1.0.6
/// (Debian 12) crashes listing a named map keyed `typeof jhash`, and a named map cannot be
/// keyed by the plain integer jhash gives.
pub(crate) fn ruleset(
    desired: &RouteTable,
    tables: &BTreeMap<IpAddr, u32>,
    previous_chains: usize,
) -> (String, usize) {
    let mut chains: BTreeMap<&[IpAddr], usize> = BTreeMap::new();
    let mut steered: Vec<(IpAddr, usize, Vec<u32>)> = Vec::new();
    for (&vip, nodes) in desired {
        let Some(marks) = nodes
            .iter()
            .map(|node| tables.get(node).copied())
            .collect::<Option<Vec<u32>>>()
        else {
            continue;
        };
        let next = chains.len();
        let chain = *chains.entry(nodes.as_slice()).or_insert(next);
        steered.push((vip, chain, marks));
    }
    let family_of = |ip: &IpAddr| if ip.is_ipv4() { "ip" } else { "ip6" };
    let table = format!("inet {NFT_TABLE}");
    // Made when missing (an `add` of what exists changes nothing), then emptied.
    let mut text = format!("table {table} {{\n");
    for family in ["ip", "ip6"] {
        let key = flow_key_type(family);
        let address = if family == "ip" {
            "ipv4_addr"
        } else {
            "ipv6_addr"
        };
        let _ = writeln!(
            text,
            "  map flows_{family} {{ type {key} : mark; flags dynamic, timeout; timeout {FLOW_TIMEOUT}; size {FLOWS}; }}\n  \
             set live_{family} {{ type {address} . mark; }}"
        );
    }
    text.push_str(
        "  chain steer { type filter hook prerouting priority mangle; policy accept; }\n}\n",
    );
    let _ = writeln!(text, "flush chain {table} steer");
    for family in ["ip", "ip6"] {
        let _ = writeln!(text, "flush set {table} live_{family}");
    }
    for chain in 0..previous_chains {
        let _ = writeln!(text, "delete chain {table} nodes_{chain}");
    }
    for (nodes, chain) in &chains {
        let family = nodes.first().map_or("ip", family_of);
        let flow = format!("{family} saddr . th sport . {family} daddr . th dport");
        let elements = lookup_table(nodes)
            .iter()
            .enumerate()
            .map(|(slot, &node)| format!("{slot} : {}", tables[&nodes[usize::from(node)]]))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            text,
            "add chain {table} nodes_{chain}\n\
             add rule {table} nodes_{chain} meta mark set {flow} map @flows_{family}\n\
             add rule {table} nodes_{chain} {family} daddr . meta mark @live_{family} update @flows_{family} {{ {flow} : meta mark }} return\n\
             add rule {table} nodes_{chain} meta mark set jhash {flow} mod {SIZE} seed {SEED:#x} map {{ {elements} }}\n\
             add rule {table} nodes_{chain} update @flows_{family} {{ {flow} : meta mark }}"
        );
    }
    for family in ["ip", "ip6"] {
        let of_family = || steered.iter().filter(|(vip, ..)| family_of(vip) == family);
        let live: Vec<String> = of_family()
            .flat_map(|(vip, _, marks)| marks.iter().map(move |mark| format!("{vip} . {mark}")))
            .collect();
        if live.is_empty() {
            continue;
        }
        let _ = writeln!(
            text,
            "add element {table} live_{family} {{ {} }}",
            live.join(", ")
        );
        let vips: Vec<String> = of_family()
            .map(|(vip, chain, _)| format!("{vip} : jump nodes_{chain}"))
            .collect();
        let _ = writeln!(
            text,
            "add rule {table} steer meta l4proto {{ tcp, udp }} {family} daddr vmap {{ {} }}",
            vips.join(", ")
        );
    }
    (text, chains.len())
}

/// `nft -f` text that removes our table (an `add` first, so that it exists to delete).
pub(crate) fn removal() -> String {
    format!("table inet {NFT_TABLE} {{}}\ndelete table inet {NFT_TABLE}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(count: u8) -> Vec<IpAddr> {
        (1..=count)
            .map(|host| IpAddr::from([198, 18, 0, host]))
            .collect()
    }

    /// The share of slots whose node changed from `before` to `after`, among slots whose
    /// node is in both (the slots of a node that left or joined must move).
    fn moved(before: &[IpAddr], after: &[IpAddr]) -> (f64, f64) {
        let (old, new) = (lookup_table(before), lookup_table(after));
        let mut moved = 0;
        let mut needless = 0;
        for (o, n) in old.iter().zip(&new) {
            let (o, n) = (before[usize::from(*o)], after[usize::from(*n)]);
            if o != n {
                moved += 1;
                if before.contains(&n) && after.contains(&o) {
                    needless += 1;
                }
            }
        }
        let size = f64::from(SIZE);
        (f64::from(moved) / size, f64::from(needless) / size)
    }

    #[test]
    fn every_slot_is_filled_and_shares_are_even() {
        for count in [1_u8, 2, 3, 7, 40] {
            let pool = nodes(count);
            let table = lookup_table(&pool);
            assert_eq!(table.len(), usize::from(SIZE));
            let mut shares = vec![0_u32; pool.len()];
            for &node in &table {
                shares[usize::from(node)] += 1;
            }
            let (min, max) = (
                shares.iter().min().copied().unwrap_or(0),
                shares.iter().max().copied().unwrap_or(0),
            );
            // Maglev fills in turns: shares differ by at most one slot.
            assert!(max - min <= 1, "{count} nodes: shares {shares:?}");
        }
    }

    #[test]
    fn the_table_depends_only_on_the_set_of_nodes() {
        let pool = nodes(5);
        let table = lookup_table(&pool);
        assert_eq!(lookup_table(&pool), table, "the same on every edge and run");
        // Pinned: a change of hash, keys or size would split an edge cluster whose edges
        // run different builds.
        let first: Vec<u16> = table.iter().take(12).copied().collect();
        assert_eq!(first, [4, 2, 2, 4, 3, 4, 2, 0, 4, 4, 3, 3]);
        assert!(lookup_table(&[]).is_empty());
    }

    #[test]
    fn a_node_leaving_or_joining_moves_about_its_own_share() {
        for count in [3_u8, 5, 10, 20] {
            let pool = nodes(count);
            let fewer: Vec<IpAddr> = pool.iter().copied().skip(1).collect();
            let ideal = 1.0 / f64::from(count);
            for (before, after) in [(&pool, &fewer), (&fewer, &pool)] {
                let (moved, needless) = moved(before, after);
                println!(
                    "{} → {} nodes: {moved:.4} of flows moved (1/N = {ideal:.4}), {needless:.4} between nodes that stay",
                    before.len(),
                    after.len()
                );
                assert!(
                    moved <= ideal + 0.01,
                    "{count} nodes: {moved:.4} of flows moved, ideal {ideal:.4}"
                );
                assert!(
                    needless <= 0.01,
                    "{count} nodes: {needless:.4} moved needlessly"
                );
            }
        }
    }

    #[test]
    fn nodes_keep_their_tables_and_new_ones_take_free_ones() {
        let [a, b, c] = [nodes(3)[0], nodes(3)[1], nodes(3)[2]];
        let vip: IpAddr = "198.51.100.5".parse().unwrap();
        let current = BTreeMap::from([(a, 101), (b, 100)]);
        let desired = RouteTable::from([(vip, vec![b, c])]);
        assert_eq!(
            node_tables(&current, &desired, 100, 8),
            BTreeMap::from([(b, 100), (c, 101)]),
            "a left, so its table is free for c"
        );
        let crowded = RouteTable::from([(vip, vec![a, b, c])]);
        assert_eq!(
            node_tables(&BTreeMap::new(), &crowded, 100, 2).len(),
            2,
            "no more nodes than tables"
        );
    }

    #[test]
    fn the_ruleset_maps_each_vip_through_its_nodes_table() {
        let pool = nodes(2);
        let (v4, v6): (IpAddr, IpAddr) = (
            "198.51.100.5".parse().unwrap(),
            "2001:db8:51:100::5".parse().unwrap(),
        );
        let node6: IpAddr = "2001:db8:18::11".parse().unwrap();
        let shared: IpAddr = "198.51.100.6".parse().unwrap();
        let desired = RouteTable::from([
            (v4, pool.clone()),
            (shared, pool.clone()),
            (v6, vec![node6]),
        ]);
        let tables = BTreeMap::from([(pool[0], 7000), (pool[1], 7001), (node6, 7002)]);
        let (text, chains) = ruleset(&desired, &tables, 3);
        assert_eq!(chains, 2, "one lookup table per node set");
        assert!(text.starts_with("table inet tandem_maglev {\n  map flows_ip { type ipv4_addr . inet_service . ipv4_addr . inet_service : mark; flags dynamic, timeout;"));
        assert!(text.contains("flush chain inet tandem_maglev steer\nflush set inet tandem_maglev live_ip\nflush set inet tandem_maglev live_ip6\ndelete chain inet tandem_maglev nodes_0\ndelete chain inet tandem_maglev nodes_1\ndelete chain inet tandem_maglev nodes_2\n"));
        assert!(text.contains("add element inet tandem_maglev live_ip { 198.51.100.5 . 7000, 198.51.100.5 . 7001, 198.51.100.6 . 7000, 198.51.100.6 . 7001 }"));
        assert!(
            text.contains("add element inet tandem_maglev live_ip6 { 2001:db8:51:100::5 . 7002 }")
        );
        let flow = "ip saddr . th sport . ip daddr . th dport";
        assert!(text.contains(&format!(
            "add rule inet tandem_maglev nodes_0 meta mark set {flow} map @flows_ip\n"
        )));
        assert!(text.contains(&format!("add rule inet tandem_maglev nodes_0 ip daddr . meta mark @live_ip update @flows_ip {{ {flow} : meta mark }} return\n")));
        assert!(text.contains(&format!(
            "add rule inet tandem_maglev nodes_0 meta mark set jhash {flow} mod 16381 seed {SEED:#x} map {{ 0 : "
        )));
        assert!(text.contains("add rule inet tandem_maglev nodes_1 meta mark set jhash ip6 saddr . th sport . ip6 daddr"));
        assert!(text.contains("add rule inet tandem_maglev steer meta l4proto { tcp, udp } ip daddr vmap { 198.51.100.5 : jump nodes_0, 198.51.100.6 : jump nodes_0 }"));
        assert!(text.contains("add rule inet tandem_maglev steer meta l4proto { tcp, udp } ip6 daddr vmap { 2001:db8:51:100::5 : jump nodes_1 }"));
        let (untabled, _) = ruleset(&desired, &BTreeMap::from([(pool[0], 7000)]), 0);
        assert!(
            !untabled.contains("198.51.100.5 :"),
            "a VIP with a node without a table is not steered"
        );
    }
}
