//! The model as nft text: a [`Transaction`] as an `nft -f` script, and single rules and
//! elements as `nft list` shows them (the tracer's hops and the logs use these).

use std::fmt::Write as _;

use ipnet::Ipv4Net;

use crate::model::{
    BUCKETS, BaseChain, DispatchKey, Key, KeyType, Match, Rule, SetSpec, Statement, TABLE, Value,
    Verdict,
};
use crate::transaction::{Op, Transaction};

/// `nft -f -` input performing `tx` as one transaction.
pub fn transaction(tx: &Transaction) -> String {
    let mut out = String::new();
    for op in &tx.ops {
        out.push_str(&operation(op));
        out.push('\n');
    }
    out
}

/// One operation as an nft command.
pub fn operation(op: &Op) -> String {
    match op {
        Op::AddTable => format!("add table ip {TABLE}"),
        Op::DeleteTable => format!("delete table ip {TABLE}"),
        Op::AddChain { name, base: None } => format!("add chain ip {TABLE} {name}"),
        Op::AddChain {
            name,
            base: Some(base),
        } => format!("add chain ip {TABLE} {name} {{ {} }}", base_chain(base)),
        Op::FlushChain(name) => format!("flush chain ip {TABLE} {name}"),
        Op::DeleteChain(name) => format!("delete chain ip {TABLE} {name}"),
        Op::AddRule { chain, rule: r } => format!("add rule ip {TABLE} {chain} {}", rule(r)),
        Op::AddSet { name, spec } => match spec {
            SetSpec::VerdictMap(key) => format!(
                "add map ip {TABLE} {name} {{ {} : verdict; }}",
                key_declaration(*key)
            ),
            SetSpec::EndpointMap(protocol) => format!(
                "add map ip {TABLE} {name} {{ typeof numgen random mod 1 : ip daddr . {protocol} dport; flags interval; }}"
            ),
            SetSpec::AddressPairs => format!(
                "add set ip {TABLE} {name} {{ {}; }}",
                key_declaration(KeyType::AddressPair)
            ),
            SetSpec::Addresses => format!(
                "add set ip {TABLE} {name} {{ {}; }}",
                key_declaration(KeyType::Address)
            ),
            SetSpec::Dynamic { timeout_seconds } => format!(
                "add set ip {TABLE} {name} {{ type ipv4_addr; flags dynamic,timeout; timeout {timeout_seconds}s; }}"
            ),
        },
        Op::DeleteSet(name) => format!("delete set ip {TABLE} {name}"),
        Op::FlushSet(name) => format!("flush set ip {TABLE} {name}"),
        Op::AddElements { set, elements } => {
            let list: Vec<String> = elements.iter().map(|(k, v)| element(k, v)).collect();
            format!("add element ip {TABLE} {set} {{ {} }}", list.join(", "))
        }
        Op::DeleteElements { set, keys } => {
            let list: Vec<String> = keys.iter().map(key).collect();
            format!("delete element ip {TABLE} {set} {{ {} }}", list.join(", "))
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

/// `type ipv4_addr . inet_proto . inet_service` and the like.
pub fn key_declaration(key: KeyType) -> &'static str {
    match key {
        KeyType::AddressProtocolPort => "type ipv4_addr . inet_proto . inet_service",
        KeyType::ProtocolPort => "type inet_proto . inet_service",
        KeyType::Index => "typeof numgen random mod 1",
        KeyType::Address => "type ipv4_addr",
        KeyType::AddressPair => "type ipv4_addr . ipv4_addr",
    }
}

/// A rule as `nft list` prints it (matches, statement, comment).
pub fn rule(rule: &Rule) -> String {
    let mut parts: Vec<String> = rule.matches.iter().map(condition).collect();
    parts.push(statement(&rule.statement));
    let mut text = parts.join(" ");
    if let Some(comment) = &rule.comment {
        let _ = write!(text, " comment \"{comment}\"");
    }
    text
}

pub fn condition(m: &Match) -> String {
    match m {
        Match::SourceAddress { net, negated } => address_match("saddr", net, *negated),
        Match::DestinationAddress { net, negated } => address_match("daddr", net, *negated),
        Match::Protocol(protocol) => format!("meta l4proto {protocol}"),
        Match::DestinationPort { protocol, port } => format!("{protocol} dport {port}"),
        Match::ConnectionNew => "ct state new".to_owned(),
        Match::ConnectionDnat => "ct status dnat".to_owned(),
        Match::DestinationLocal => "fib daddr type local".to_owned(),
        Match::SourceLocal => "fib saddr type local".to_owned(),
        Match::Mark { bit, set: true } => format!("meta mark & {bit:#010x} == {bit:#010x}"),
        Match::Mark { bit, set: false } => format!("meta mark & {bit:#010x} == 0x00000000"),
        Match::SourceInSet(set) => format!("ip saddr @{set}"),
        Match::AddressPairInSet(set) => format!("ip saddr . ip daddr @{set}"),
        Match::DestinationInSet(set) => format!("ip daddr @{set}"),
    }
}

fn address_match(field: &str, net: &Ipv4Net, negated: bool) -> String {
    let op = if negated { "!= " } else { "" };
    if net.prefix_len() == 32 {
        format!("ip {field} {op}{}", net.addr())
    } else {
        format!("ip {field} {op}{}", net.trunc())
    }
}

pub fn statement(s: &Statement) -> String {
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
        } => format!("ip daddr . meta l4proto . th dport vmap @{map}"),
        Statement::Dispatch {
            key: DispatchKey::ProtocolPort,
            map,
        } => format!("meta l4proto . th dport vmap @{map}"),
        Statement::RandomDispatch { modulus, map } => {
            format!("numgen random mod {modulus} vmap @{map}")
        }
        // nft lists a zero offset by leaving it out.
        Statement::RandomDnat { map, offset: 0 } => {
            format!("dnat ip to numgen random mod {BUCKETS} map @{map}")
        }
        Statement::RandomDnat { map, offset } => {
            format!("dnat ip to numgen random mod {BUCKETS} offset {offset} map @{map}")
        }
        Statement::SetMark(bit) => format!("meta mark set meta mark | {bit:#010x}"),
        Statement::ToggleMark(bit) => format!("meta mark set meta mark ^ {bit:#010x}"),
        Statement::Masquerade => "masquerade fully-random".to_owned(),
        Statement::Dnat(addr) => format!("dnat to {addr}"),
        Statement::AddSourceToSet(set) => format!("update @{set} {{ ip saddr }}"),
    }
}

/// `10.96.0.10 . tcp . 80`
pub fn key(k: &Key) -> String {
    match k {
        Key::AddressProtocolPort(addr, protocol, port) => format!("{addr} . {protocol} . {port}"),
        Key::ProtocolPort(protocol, port) => format!("{protocol} . {port}"),
        Key::Index(index) => index.to_string(),
        Key::Address(addr) => addr.to_string(),
        Key::AddressPair(src, dst) => format!("{src} . {dst}"),
        Key::Buckets { first, last } => format!("{first}-{last}"),
    }
}

/// `10.96.0.10 . tcp . 80 : goto service-…`, `0-72071 : 10.244.1.2 . 8080`, or the key
/// alone for a set's member.
pub fn element(k: &Key, value: &Value) -> String {
    match value {
        Value::Member => key(k),
        Value::Verdict(v) => format!("{} : {}", key(k), verdict(v)),
        Value::Endpoint(endpoint) => {
            format!("{} : {} . {}", key(k), endpoint.ip(), endpoint.port())
        }
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
    use super::*;
    use crate::model::Protocol;
    use std::net::{Ipv4Addr, SocketAddrV4};

    #[test]
    fn rules_read_as_nft_lists_them() {
        let masq = Rule::when(
            vec![
                Match::DestinationAddress {
                    net: Ipv4Net::from(Ipv4Addr::new(10, 96, 0, 10)),
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
            rule(&masq),
            "ip daddr 10.96.0.10 tcp dport 80 ip saddr != 10.244.0.0/16 jump mark-for-masquerade"
        );
        let dnat = Rule::when(
            vec![Match::Protocol(Protocol::Udp)],
            Statement::Dnat(SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, 2), 53)),
        );
        assert_eq!(rule(&dnat), "meta l4proto udp dnat to 10.244.1.2:53");
        assert_eq!(
            rule(&Rule::when(
                vec![Match::Mark {
                    bit: 0x4000,
                    set: false
                }],
                Statement::Return
            )),
            "meta mark & 0x00004000 == 0x00000000 return"
        );
    }
}
