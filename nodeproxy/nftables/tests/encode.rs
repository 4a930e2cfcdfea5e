//! The encoding is byte-for-byte what `nft` 1.0.6 sends for the rendered text.
//!
//! `fixtures/nft-1.0.6-every-variant.bin` (and `…-ipv6.bin` for table `ip6 tandem`) is
//! the batch `nft -f` sent (captured with `strace -e trace=sendmsg -e write=3`) for the
//! text `render::transaction` writes for the transaction below, which uses every model
//! variant but one: elements of an endpoint map (runs of buckets), which nft 1.0.6
//! reorders and sends twice when the map is declared in the same batch.
//! `tests/kernel.rs` checks those by their listing.

#![allow(clippy::expect_used)]

use std::net::{IpAddr, SocketAddr};

use tandem_common::{IpFamily, Protocol};
use tandem_nftables::encode;
use tandem_nftables::render;
use tandem_nftables::{
    BaseChain, ChainType, DispatchKey, Hook, Key, KeyType, Match, Op, Rule, SetSpec, Statement,
    Transaction, Value, Verdict,
};

const NFT_BATCH: &[u8] = include_bytes!("fixtures/nft-1.0.6-every-variant.bin");
const NFT_BATCH_IPV6: &[u8] = include_bytes!("fixtures/nft-1.0.6-every-variant-ipv6.bin");

fn chain(name: &str, base: Option<BaseChain>) -> Op {
    Op::AddChain {
        name: name.into(),
        base,
    }
}

fn rule(chain: &str, rule: Rule) -> Op {
    Op::AddRule {
        chain: chain.into(),
        rule,
    }
}

/// The IPv4 text, or its IPv6 counterpart, for `family`.
fn of(family: IpFamily, v4: &'static str, v6: &'static str) -> &'static str {
    match family {
        IpFamily::V4 => v4,
        IpFamily::V6 => v6,
    }
}

fn every_variant(family: IpFamily) -> Transaction {
    let goto = |chain: &str| Value::from(Verdict::Goto(chain.into()));
    let drop = || Value::from(Verdict::Drop);
    let ip = |v4, v6| -> IpAddr { of(family, v4, v6).parse().expect("test address") };
    let net = |v4, v6| -> ipnet::IpNet { of(family, v4, v6).parse().expect("test prefix") };
    let pod = ip("10.244.1.2", "fd42:0:0:1::2");
    let mark = 0x4000;
    let ops = vec![
        Op::AddTable,
        Op::DeleteTable,
        Op::AddTable,
        chain(
            "pre",
            Some(BaseChain {
                chain_type: ChainType::Nat,
                hook: Hook::Prerouting,
                priority: -100,
            }),
        ),
        chain(
            "filt",
            Some(BaseChain {
                chain_type: ChainType::Filter,
                hook: Hook::Forward,
                priority: 0,
            }),
        ),
        chain("svc", None),
        chain("ep", None),
        Op::AddSet {
            name: "disp".into(),
            spec: SetSpec::VerdictMap(KeyType::AddressProtocolPort),
        },
        Op::AddSet {
            name: "np".into(),
            spec: SetSpec::VerdictMap(KeyType::ProtocolPort),
        },
        Op::AddSet {
            name: "idx".into(),
            spec: SetSpec::VerdictMap(KeyType::Index),
        },
        Op::AddSet {
            name: "addrs".into(),
            spec: SetSpec::VerdictMap(KeyType::Address),
        },
        Op::AddSet {
            name: "aff".into(),
            spec: SetSpec::Dynamic {
                timeout_seconds: 10800,
            },
        },
        Op::AddElements {
            set: "disp".into(),
            elements: vec![
                (
                    Key::AddressProtocolPort(ip("10.96.0.10", "fd43::10"), Protocol::Tcp, 80),
                    goto("svc"),
                ),
                (
                    Key::AddressProtocolPort(ip("10.96.0.11", "fd43::11"), Protocol::Udp, 53),
                    drop(),
                ),
            ],
        },
        Op::AddElements {
            set: "np".into(),
            elements: vec![(Key::ProtocolPort(Protocol::Tcp, 30080), goto("svc"))],
        },
        Op::AddElements {
            set: "idx".into(),
            elements: vec![(Key::Index(0), goto("ep")), (Key::Index(1), drop())],
        },
        Op::AddElements {
            set: "addrs".into(),
            elements: vec![(Key::Address(ip("10.1.2.3", "fd01::3")), drop())],
        },
        rule(
            "pre",
            Rule::always(Statement::Dispatch {
                key: DispatchKey::AddressProtocolPort,
                map: "disp".into(),
            }),
        ),
        rule(
            "pre",
            Rule::always(Statement::Dispatch {
                key: DispatchKey::ProtocolPort,
                map: "np".into(),
            }),
        ),
        rule(
            "svc",
            Rule::when(
                vec![
                    Match::SourceAddress {
                        net: net("10.244.0.0/16", "fd42::/56"),
                        negated: true,
                    },
                    Match::DestinationAddress {
                        net: net("10.96.0.10/32", "fd43::10/128"),
                        negated: false,
                    },
                    Match::DestinationPort {
                        protocol: Protocol::Tcp,
                        port: 80,
                    },
                ],
                Statement::Jump("ep".into()),
            )
            .with_comment("hello world"),
        ),
        rule(
            "svc",
            Rule::always(Statement::RandomDispatch {
                modulus: 2,
                map: "idx".into(),
            }),
        ),
        rule(
            "ep",
            Rule::when(
                vec![
                    Match::ConnectionNew,
                    Match::DestinationLocal,
                    Match::SourceLocal,
                    Match::Mark {
                        bit: mark,
                        set: true,
                    },
                ],
                Statement::SetMark(mark),
            ),
        ),
        rule(
            "ep",
            Rule::when(
                vec![Match::Mark {
                    bit: mark,
                    set: false,
                }],
                Statement::ToggleMark(mark),
            ),
        ),
        rule(
            "ep",
            Rule::when(
                vec![Match::SourceInSet("addrs".into())],
                Statement::AddSourceToSet("aff".into()),
            ),
        ),
        rule(
            "ep",
            Rule::when(
                vec![Match::Protocol(Protocol::Udp)],
                Statement::Dnat(SocketAddr::new(pod, 53)),
            ),
        ),
        chain(
            "post",
            Some(BaseChain {
                chain_type: ChainType::Nat,
                hook: Hook::Postrouting,
                priority: 100,
            }),
        ),
        rule("post", Rule::always(Statement::Masquerade)),
        rule("filt", Rule::always(Statement::Reject)),
        rule("filt", Rule::always(Statement::Return)),
        rule("filt", Rule::always(Statement::Accept)),
        rule("filt", Rule::always(Statement::Drop)),
        rule(
            "filt",
            Rule::when(
                vec![
                    Match::SourceAddress {
                        net: net("10.1.1.1/32", "fd01::1/128"),
                        negated: false,
                    },
                    Match::DestinationAddress {
                        net: net("10.0.0.0/8", "fd00::/12"),
                        negated: false,
                    },
                ],
                Statement::Drop,
            ),
        ),
        Op::AddSet {
            name: "eps".into(),
            spec: SetSpec::EndpointMap(Protocol::Tcp),
        },
        Op::AddSet {
            name: "pairs".into(),
            spec: SetSpec::AddressPairs,
        },
        Op::AddElements {
            set: "pairs".into(),
            elements: vec![(Key::SelfPair(pod), Value::Member)],
        },
        rule(
            "pre",
            Rule::when(
                vec![Match::Protocol(Protocol::Tcp)],
                Statement::RandomDnat {
                    map: "eps".into(),
                    offset: 0,
                },
            ),
        ),
        rule(
            "post",
            Rule::when(
                vec![
                    Match::ConnectionDnat,
                    Match::AddressPairInSet("pairs".into()),
                ],
                Statement::Masquerade,
            ),
        ),
        Op::AddSet {
            name: "cips".into(),
            spec: SetSpec::Addresses,
        },
        Op::AddElements {
            set: "cips".into(),
            elements: vec![(Key::Address(ip("10.96.0.10", "fd43::10")), Value::Member)],
        },
        rule(
            "filt",
            Rule::when(
                vec![Match::DestinationInSet("cips".into())],
                Statement::Reject,
            ),
        ),
    ];
    Transaction { family, ops }
}

const RENDERED: &str = "\
add table ip tandem
delete table ip tandem
add table ip tandem
add chain ip tandem pre { type nat hook prerouting priority -100; policy accept; }
add chain ip tandem filt { type filter hook forward priority 0; policy accept; }
add chain ip tandem svc
add chain ip tandem ep
add map ip tandem disp { type ipv4_addr . inet_proto . inet_service : verdict; }
add map ip tandem np { type inet_proto . inet_service : verdict; }
add map ip tandem idx { typeof numgen random mod 1 : verdict; }
add map ip tandem addrs { type ipv4_addr : verdict; }
add set ip tandem aff { type ipv4_addr; flags dynamic,timeout; timeout 10800s; }
add element ip tandem disp { 10.96.0.10 . tcp . 80 : goto svc, 10.96.0.11 . udp . 53 : drop }
add element ip tandem np { tcp . 30080 : goto svc }
add element ip tandem idx { 0 : goto ep, 1 : drop }
add element ip tandem addrs { 10.1.2.3 : drop }
add rule ip tandem pre ip daddr . meta l4proto . th dport vmap @disp
add rule ip tandem pre meta l4proto . th dport vmap @np
add rule ip tandem svc ip saddr != 10.244.0.0/16 ip daddr 10.96.0.10 tcp dport 80 jump ep comment \"hello world\"
add rule ip tandem svc numgen random mod 2 vmap @idx
add rule ip tandem ep ct state new fib daddr type local fib saddr type local meta mark & 0x00004000 == 0x00004000 meta mark set meta mark | 0x00004000
add rule ip tandem ep meta mark & 0x00004000 == 0x00000000 meta mark set meta mark ^ 0x00004000
add rule ip tandem ep ip saddr @addrs update @aff { ip saddr }
add rule ip tandem ep meta l4proto udp dnat to 10.244.1.2:53
add chain ip tandem post { type nat hook postrouting priority 100; policy accept; }
add rule ip tandem post masquerade fully-random
add rule ip tandem filt reject
add rule ip tandem filt return
add rule ip tandem filt accept
add rule ip tandem filt drop
add rule ip tandem filt ip saddr 10.1.1.1 ip daddr 10.0.0.0/8 drop
add map ip tandem eps { typeof numgen random mod 1 : ip daddr . tcp dport; flags interval; }
add set ip tandem pairs { type ipv4_addr . ipv4_addr; }
add element ip tandem pairs { 10.244.1.2 . 10.244.1.2 }
add rule ip tandem pre meta l4proto tcp dnat ip to numgen random mod 720720 map @eps
add rule ip tandem post ct status dnat ip saddr . ip daddr @pairs masquerade fully-random
add set ip tandem cips { type ipv4_addr; }
add element ip tandem cips { 10.96.0.10 }
add rule ip tandem filt ip daddr @cips reject
";

/// The IPv4 text with each IPv4 construct swapped for its IPv6 counterpart.
fn rendered_ipv6() -> String {
    [
        (" ip tandem", " ip6 tandem"),
        ("ipv4_addr", "ipv6_addr"),
        ("ip saddr", "ip6 saddr"),
        ("ip daddr", "ip6 daddr"),
        ("dnat ip to", "dnat ip6 to"),
        ("10.96.0.10 . tcp", "fd43::10 . tcp"),
        ("10.96.0.11", "fd43::11"),
        ("10.1.2.3", "fd01::3"),
        ("10.244.0.0/16", "fd42::/56"),
        ("10.96.0.10", "fd43::10"),
        ("10.244.1.2:53", "[fd42:0:0:1::2]:53"),
        ("10.244.1.2", "fd42:0:0:1::2"),
        ("10.1.1.1", "fd01::1"),
        ("10.0.0.0/8", "fd00::/12"),
    ]
    .iter()
    .fold(RENDERED.to_owned(), |text, (v4, v6)| text.replace(v4, v6))
}

#[test]
fn the_batch_is_what_nft_sends_for_the_rendered_text() {
    for (family, rendered, nft_batch) in [
        (IpFamily::V4, RENDERED.to_owned(), NFT_BATCH),
        (IpFamily::V6, rendered_ipv6(), NFT_BATCH_IPV6),
    ] {
        let tx = every_variant(family);
        assert_eq!(render::transaction(&tx), rendered, "{family}");
        let batch = encode::batch(&tx, 0).expect("encodes");
        let ours = batch.chunks().concat();
        assert_eq!(ours.len(), nft_batch.len(), "{family}");
        let first_difference = ours.iter().zip(nft_batch).position(|(a, b)| a != b);
        assert_eq!(first_difference, None, "{family}: bytes differ");
    }
}

#[test]
fn every_message_maps_back_to_its_operation() {
    let tx = every_variant(IpFamily::V4);
    let batch = encode::batch(&tx, 1000).expect("encodes");
    assert_eq!(batch.begin_seq(), 1000);
    assert_eq!(batch.message_count(), tx.ops.len());
    assert_eq!(batch.op_index(1000), None);
    assert_eq!(batch.op_index(1001), Some(0));
    assert_eq!(
        batch.op_index(1000 + tx.ops.len() as u32),
        Some(tx.ops.len() - 1)
    );
    assert_eq!(batch.end_seq(), 1001 + tx.ops.len() as u32);
    assert_eq!(batch.op_index(batch.end_seq()), None);
}

#[test]
fn large_element_lists_are_split_over_messages_of_the_same_operation() {
    let elements: Vec<(Key, Value)> = (0..60_000u32)
        .map(|i| {
            (
                Key::Index(i),
                Verdict::Goto(format!("endpoint-chain-{i:08}")).into(),
            )
        })
        .collect();
    let tx = Transaction {
        family: IpFamily::V4,
        ops: vec![
            Op::AddTable,
            Op::AddElements {
                set: "m".into(),
                elements,
            },
            Op::AddTable,
        ],
    };
    let batch = encode::batch(&tx, 0).expect("encodes");
    assert!(batch.message_count() > 3);
    let last = batch.end_seq() - 1;
    assert_eq!(batch.op_index(1), Some(0));
    assert_eq!(batch.op_index(2), Some(1));
    assert_eq!(batch.op_index(last - 1), Some(1));
    assert_eq!(batch.op_index(last), Some(2));

    // The bytes come in several buffers, each of whole messages.
    assert!(batch.chunks().len() > 1);
    let mut messages = 0;
    for chunk in batch.chunks() {
        let mut at = 0;
        while at < chunk.len() {
            let len = u32::from_ne_bytes(chunk[at..at + 4].try_into().expect("4 bytes"));
            at += (len as usize + 3) & !3;
            messages += 1;
        }
        assert_eq!(at, chunk.len());
        // None outgrew the 1 MiB it was made with (growing doubles a buffer).
        assert!(chunk.capacity() <= 1 << 20, "{}", chunk.capacity());
    }
    assert_eq!(messages, batch.message_count() + 2);
}

#[test]
fn an_oversized_comment_is_an_error_naming_its_operation() {
    let tx = Transaction {
        family: IpFamily::V4,
        ops: vec![rule(
            "c",
            Rule::always(Statement::Accept).with_comment("x".repeat(300)),
        )],
    };
    let err = encode::batch(&tx, 0).expect_err("too large");
    assert!(matches!(
        err,
        encode::EncodeError::TooLarge { index: 0, .. }
    ));
}
