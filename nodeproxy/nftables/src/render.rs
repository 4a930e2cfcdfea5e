//! The model as nft text: a [`Transaction`] as an `nft -f` script, and single rules and
//! elements as `nft list` shows them (the tracer's hops and the logs use these).

use std::fmt::Write as _;

use ipnet::IpNet;
use tandem_common::IpFamily;

use crate::model::{
    BUCKETS, BaseChain, DispatchKey, Key, KeyType, Match, NftFamily, Rule, SetSpec, Statement,
    Value, Verdict,
};
use crate::transaction::{Op, Transaction};

/// `nft -f -` input performing `tx` as one transaction.
pub fn transaction(tx: &Transaction) -> String {
    let mut out = String::new();
    for op in &tx.ops {
        out.push_str(&operation(op, tx.family));
        out.push('\n');
    }
    out
}

/// One operation on our table of `family` as an nft command.
pub fn operation(op: &Op, family: IpFamily) -> String {
    let table = family.nft_table();
    let address = address_type(family);
    match op {
        Op::AddTable => format!("add table {table}"),
        Op::DeleteTable => format!("delete table {table}"),
        Op::AddChain { name, base: None } => format!("add chain {table} {name}"),
        Op::AddChain {
            name,
            base: Some(base),
        } => format!("add chain {table} {name} {{ {} }}", base_chain(base)),
        Op::FlushChain(name) => format!("flush chain {table} {name}"),
        Op::DeleteChain(name) => format!("delete chain {table} {name}"),
        Op::AddRule { chain, rule: r } => {
            format!("add rule {table} {chain} {}", rule(r, family))
        }
        Op::AddSet { name, spec } => match spec {
            SetSpec::VerdictMap(key) => format!(
                "add map {table} {name} {{ {} : verdict; }}",
                key_declaration(*key, family)
            ),
            SetSpec::EndpointMap(protocol) => format!(
                "add map {table} {name} {{ typeof numgen random mod 1 : {} daddr . {protocol} dport; flags interval; }}",
                family.nft_family()
            ),
            SetSpec::AddressPairs => format!(
                "add set {table} {name} {{ {}; }}",
                key_declaration(KeyType::AddressPair, family)
            ),
            SetSpec::Addresses => format!(
                "add set {table} {name} {{ {}; }}",
                key_declaration(KeyType::Address, family)
            ),
            SetSpec::Dynamic { timeout_seconds } => format!(
                "add set {table} {name} {{ type {address}; flags dynamic,timeout; timeout {timeout_seconds}s; }}"
            ),
        },
        Op::DeleteSet(name) => format!("delete set {table} {name}"),
        Op::FlushSet(name) => format!("flush set {table} {name}"),
        Op::AddElements { set, elements } => {
            let list: Vec<String> = elements.iter().map(|(k, v)| element(k, v)).collect();
            format!("add element {table} {set} {{ {} }}", list.join(", "))
        }
        Op::DeleteElements { set, keys } => {
            let list: Vec<String> = keys.iter().map(key).collect();
            format!("delete element {table} {set} {{ {} }}", list.join(", "))
        }
    }
}

/// `type nat hook prerouting priority -100; policy accept;`
pub fn base_chain(base: &BaseChain) -> String {
    format!(
        "type {} hook {} priority {}; policy accept;",
        base.chain_type.as_str(),
        base.hook.as_str(),
        base.priority
    )
}

/// nft's address type: `ipv4_addr` or `ipv6_addr`.
fn address_type(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ipv4_addr",
        IpFamily::V6 => "ipv6_addr",
    }
}

/// `type ipv4_addr . inet_proto . inet_service` and the like.
pub fn key_declaration(key: KeyType, family: IpFamily) -> String {
    let address = address_type(family);
    match key {
        KeyType::AddressProtocolPort => format!("type {address} . inet_proto . inet_service"),
        KeyType::ProtocolPort => "type inet_proto . inet_service".to_owned(),
        KeyType::Index => "typeof numgen random mod 1".to_owned(),
        KeyType::Address => format!("type {address}"),
        KeyType::AddressPair => format!("type {address} . {address}"),
    }
}

/// A rule of our table of `family` as `nft list` prints it (matches, statement,
/// comment).
pub fn rule(rule: &Rule, family: IpFamily) -> String {
    let mut parts: Vec<String> = rule.matches.iter().map(|m| condition(m, family)).collect();
    parts.push(statement(&rule.statement, family));
    let mut text = parts.join(" ");
    if let Some(comment) = &rule.comment {
        let _ = write!(text, " comment \"{comment}\"");
    }
    text
}

pub fn condition(m: &Match, family: IpFamily) -> String {
    let ip = family.nft_family();
    match m {
        Match::SourceAddress { net, negated } => address_match(ip, "saddr", net, *negated),
        Match::DestinationAddress { net, negated } => address_match(ip, "daddr", net, *negated),
        Match::Protocol(protocol) => format!("meta l4proto {protocol}"),
        Match::DestinationPort { protocol, port } => format!("{protocol} dport {port}"),
        Match::ConnectionNew => "ct state new".to_owned(),
        Match::ConnectionDnat => "ct status dnat".to_owned(),
        Match::DestinationLocal => "fib daddr type local".to_owned(),
        Match::SourceLocal => "fib saddr type local".to_owned(),
        Match::Mark { bit, set: true } => format!("meta mark & {bit:#010x} == {bit:#010x}"),
        Match::Mark { bit, set: false } => format!("meta mark & {bit:#010x} == 0x00000000"),
        Match::SourceInSet(set) => format!("{ip} saddr @{set}"),
        Match::AddressPairInSet(set) => format!("{ip} saddr . {ip} daddr @{set}"),
        Match::DestinationInSet(set) => format!("{ip} daddr @{set}"),
        Match::InputInterface {
            name,
            prefix,
            negated,
        } => {
            let op = if *negated { "!= " } else { "" };
            let wildcard = if *prefix { "*" } else { "" };
            format!("iifname {op}\"{name}{wildcard}\"")
        }
    }
}

fn address_match(ip: &str, field: &str, net: &IpNet, negated: bool) -> String {
    let op = if negated { "!= " } else { "" };
    if net.prefix_len() == net.max_prefix_len() {
        format!("{ip} {field} {op}{}", net.addr())
    } else {
        format!("{ip} {field} {op}{}", net.trunc())
    }
}

pub fn statement(s: &Statement, family: IpFamily) -> String {
    let ip = family.nft_family();
    match s {
        Statement::Jump(chain) => format!("jump {chain}"),
        Statement::Goto(chain) => format!("goto {chain}"),
        Statement::Return => "return".to_owned(),
        Statement::Accept => "accept".to_owned(),
        Statement::Drop => "drop".to_owned(),
        Statement::Reject => "reject".to_owned(),
        Statement::Dispatch {
            key: DispatchKey::AddressProtocolPort,
            map,
        } => format!("{ip} daddr . meta l4proto . th dport vmap @{map}"),
        Statement::Dispatch {
            key: DispatchKey::ProtocolPort,
            map,
        } => format!("meta l4proto . th dport vmap @{map}"),
        Statement::RandomDispatch { modulus, map } => {
            format!("numgen random mod {modulus} vmap @{map}")
        }
        // nft lists a zero offset by leaving it out.
        Statement::RandomDnat { map, offset: 0 } => {
            format!("dnat {ip} to numgen random mod {BUCKETS} map @{map}")
        }
        Statement::RandomDnat { map, offset } => {
            format!("dnat {ip} to numgen random mod {BUCKETS} offset {offset} map @{map}")
        }
        Statement::SetMark(bit) => format!("meta mark set meta mark | {bit:#010x}"),
        Statement::ToggleMark(bit) => format!("meta mark set meta mark ^ {bit:#010x}"),
        Statement::Masquerade => "masquerade fully-random".to_owned(),
        Statement::Dnat(addr) => format!("dnat to {addr}"),
        Statement::AddSourceToSet(set) => format!("update @{set} {{ {ip} saddr }}"),
    }
}

/// `10.96.0.10 . tcp . 80`
pub fn key(k: &Key) -> String {
    match k {
        Key::AddressProtocolPort(addr, protocol, port) => format!("{addr} . {protocol} . {port}"),
        Key::ProtocolPort(protocol, port) => format!("{protocol} . {port}"),
        Key::Index(index) => index.to_string(),
        Key::Address(addr) => addr.to_string(),
        Key::SelfPair(ip) => format!("{ip} . {ip}"),
        Key::Buckets { first, last } => format!("{first}-{last}"),
    }
}

/// `10.96.0.10 . tcp . 80 : goto service-…`, `0-72071 : 10.244.1.2 . 8080`, or the key
/// alone for a set's member.
pub fn element(k: &Key, value: &Value) -> String {
    match value {
        Value::Member => key(k),
        Value::Verdict(v) => format!("{} : {}", key(k), verdict(v)),
        Value::Endpoint(to) => format!("{} : {} . {}", key(k), to.ip(), to.port()),
    }
}

/// `goto service-…` or `drop`.
pub fn verdict(v: &Verdict) -> String {
    match v {
        Verdict::Drop => "drop".to_owned(),
        Verdict::Goto(chain) => format!("goto {chain}"),
    }
}

#[cfg(test)]
mod tests {
    use tandem_common::Protocol;

    use super::*;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

    #[test]
    fn rules_read_as_nft_lists_them() {
        let masq = Rule::when(
            vec![
                Match::DestinationAddress {
                    net: IpNet::from(IpAddr::from(Ipv4Addr::new(10, 96, 0, 10))),
                    negated: false,
                },
                Match::DestinationPort {
                    protocol: Protocol::Tcp,
                    port: 80,
                },
                Match::SourceAddress {
                    net: "10.244.0.0/16".parse().unwrap(),
                    negated: true,
                },
            ],
            Statement::Jump("mark-for-masquerade".into()),
        );
        assert_eq!(
            rule(&masq, IpFamily::V4),
            "ip daddr 10.96.0.10 tcp dport 80 ip saddr != 10.244.0.0/16 jump mark-for-masquerade"
        );
        let dnat = Rule::when(
            vec![Match::Protocol(Protocol::Udp)],
            Statement::Dnat(SocketAddr::new(Ipv4Addr::new(10, 244, 1, 2).into(), 53)),
        );
        assert_eq!(
            rule(&dnat, IpFamily::V4),
            "meta l4proto udp dnat to 10.244.1.2:53"
        );
        let dnat6 = Rule::when(
            vec![
                Match::SourceAddress {
                    net: "fd42::/56".parse().unwrap(),
                    negated: true,
                },
                Match::Protocol(Protocol::Tcp),
            ],
            Statement::Dnat(SocketAddr::new(
                Ipv6Addr::new(0xfd42, 0, 0, 1, 0, 0, 0, 2).into(),
                8080,
            )),
        );
        assert_eq!(
            rule(&dnat6, IpFamily::V6),
            "ip6 saddr != fd42::/56 meta l4proto tcp dnat to [fd42:0:0:1::2]:8080"
        );
        assert_eq!(
            rule(
                &Rule::when(
                    vec![Match::Mark {
                        bit: 0x4000,
                        set: false
                    }],
                    Statement::Return
                ),
                IpFamily::V6
            ),
            "meta mark & 0x00004000 == 0x00000000 return"
        );
        let iif = |name: &str, prefix, negated| {
            let m = Match::InputInterface {
                name: name.to_owned(),
                prefix,
                negated,
            };
            rule(&Rule::when(vec![m], Statement::Return), IpFamily::V4)
        };
        assert_eq!(iif("cni0", false, false), "iifname \"cni0\" return");
        assert_eq!(iif("cni0", false, true), "iifname != \"cni0\" return");
        assert_eq!(iif("veth", true, true), "iifname != \"veth*\" return");
    }
}
