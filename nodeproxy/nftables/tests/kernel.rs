//! Netlink programming against the real kernel, in scratch network namespaces (root
//! only; skipped with a message otherwise or without `nft`).
//!
//! The contract: a transaction applied by netlink lists (`nft list table ip tandem`, and
//! `ip6 tandem` for IPv6) exactly as its rendered text applied by `nft -f`.
//!
//! `TANDEM_NFT_SCALE_SERVICES` (default 2700) sets the size of the scale case, whose
//! timings are printed (run with `--nocapture`); only its listing counts are asserted.

#![allow(clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::sched::{CloneFlags, setns};
use tandem_common::{IpFamily, Protocol};
use tandem_nftables::digest::TableDigest;
use tandem_nftables::kernel::{KernelError, Netlink};
use tandem_nftables::render;
use tandem_nftables::{
    BUCKETS, BaseChain, Chain, ChainType, DispatchKey, Drift, Hook, Key, KeyType, Match, NftFamily,
    Op, Rule, Ruleset, Set, SetSpec, Statement, TableDrift, Transaction, Value, Verdict,
};

const MARK: u32 = 0x4000;

/// A network namespace of this test process, removed on drop, and the family of our
/// table in it that the test looks at.
struct ScratchNetns(String, IpFamily);

impl ScratchNetns {
    fn new(role: &str) -> Self {
        Self::of(role, IpFamily::V4)
    }

    fn of(role: &str, family: IpFamily) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "tandem-nftnl-{}-{}-{role}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let status = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("run ip netns add");
        assert!(status.success(), "ip netns add {name}");
        Self(name, family)
    }

    /// Runs `f` on a thread that entered this namespace (netlink sockets belong to
    /// the namespace they are opened in).
    fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/run/netns/{}", self.0);
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let file = File::open(&path).expect("open the netns");
                    setns(&file, CloneFlags::CLONE_NEWNET).expect("enter the netns");
                    f()
                })
                .join()
                .expect("netns thread")
        })
    }

    fn apply(&self, tx: &Transaction) -> Result<(), KernelError> {
        self.run(|| Netlink::open()?.apply(tx))
    }

    /// `nft -f -` with `script`; panics when nft fails.
    fn nft_script(&self, script: &str) -> Duration {
        let started = Instant::now();
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.0, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run nft");
        child
            .stdin
            .take()
            .expect("nft stdin")
            .write_all(script.as_bytes())
            .expect("feed nft");
        let output = child.wait_with_output().expect("wait for nft");
        let took = started.elapsed();
        assert!(
            output.status.success(),
            "nft -f failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        took
    }

    /// `nft list table ip tandem` (or `ip6`), with each set's elements sorted (the
    /// kernel lists hash sets in an order of its own).
    fn listing(&self) -> String {
        let family = self.1.nft_family();
        let output = Command::new("ip")
            .args([
                "netns", "exec", &self.0, "nft", "list", "table", family, "tandem",
            ])
            .output()
            .expect("run nft list");
        assert!(
            output.status.success(),
            "nft list failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        normalize(&String::from_utf8_lossy(&output.stdout))
    }

    fn has_table(&self) -> bool {
        let output = Command::new("ip")
            .args(["netns", "exec", &self.0, "nft", "list", "tables"])
            .output()
            .expect("run nft list tables");
        let table = format!("table {} tandem", self.1.nft_family());
        String::from_utf8_lossy(&output.stdout).contains(&table)
    }
}

impl Drop for ScratchNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Element lists folded onto one line each and sorted.
fn normalize(listing: &str) -> String {
    let mut out = String::new();
    let mut elements: Option<String> = None;
    for line in listing.lines() {
        let trimmed = line.trim();
        if let Some(open) = elements.as_mut() {
            open.push(' ');
            open.push_str(trimmed);
        } else if let Some(rest) = trimmed.strip_prefix("elements = {") {
            elements = Some(rest.to_owned());
        } else {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        if let Some(body) = elements.as_ref().and_then(|e| e.strip_suffix('}')) {
            let mut items: Vec<&str> = body.split(',').map(str::trim).collect();
            items.sort_unstable();
            out.push_str(&format!("elements = {{ {} }}\n", items.join(", ")));
            elements = None;
        }
    }
    out
}

fn can_run() -> bool {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root (network namespaces and nf_tables)");
        return false;
    }
    if Command::new("nft").arg("--version").output().is_err() {
        eprintln!("skipped: the nft command is not installed");
        return false;
    }
    true
}

/// The test's IPv4 address, or for IPv6 the same 32 bits under `fd00::/96`.
fn ip(family: IpFamily, addr: [u8; 4]) -> IpAddr {
    let v4 = Ipv4Addr::from(addr);
    match family {
        IpFamily::V4 => v4.into(),
        IpFamily::V6 => Ipv6Addr::from((0xfd00_u128 << 112) | u128::from(u32::from(v4))).into(),
    }
}

fn host(family: IpFamily, addr: [u8; 4]) -> ipnet::IpNet {
    ipnet::IpNet::from(ip(family, addr))
}

/// The test's IPv4 prefix, or for IPv6 its counterpart under `fd00::/96`.
fn net(family: IpFamily, text: &str) -> ipnet::IpNet {
    let v4: ipnet::Ipv4Net = text.parse().expect("test prefix");
    let addr = ip(family, v4.addr().octets());
    let len = match family {
        IpFamily::V4 => v4.prefix_len(),
        IpFamily::V6 => 96 + v4.prefix_len(),
    };
    ipnet::IpNet::new(addr, len).expect("prefix length")
}

fn base(chain_type: ChainType, hook: Hook, priority: i32) -> Option<BaseChain> {
    Some(BaseChain {
        chain_type,
        hook,
        priority,
    })
}

fn chain(base: Option<BaseChain>, rules: Vec<Rule>) -> Chain {
    Chain { base, rules }
}

fn goto(chain: &str) -> Value {
    Verdict::Goto(chain.into()).into()
}

fn drop_verdict() -> Value {
    Verdict::Drop.into()
}

/// An endpoint map spreading UDP over 10.244.1.`last`:53, one run of buckets each.
/// Where svc-b's buckets start in its map: not at 0, as a map shared by many spreads
/// holds most of them.
const SVC_B_OFFSET: u32 = 2 * BUCKETS;

fn udp_endpoints(family: IpFamily, lasts: &[u8]) -> Set {
    let count = lasts.len() as u32;
    let run = BUCKETS / count;
    Set {
        spec: SetSpec::EndpointMap(Protocol::Udp),
        elements: (0..count)
            .zip(lasts)
            .map(|(i, last)| {
                (
                    Key::Buckets {
                        first: SVC_B_OFFSET + i * run,
                        last: SVC_B_OFFSET
                            + if i + 1 == count {
                                BUCKETS - 1
                            } else {
                                (i + 1) * run - 1
                            },
                    },
                    Value::Endpoint(SocketAddr::new(ip(family, [10, 244, 1, *last]), 53)),
                )
            })
            .collect(),
    }
}

/// A ruleset with every model variant: each match, statement, key type, set kind and
/// verdict, base chains of both types on every hook, comments.
fn every_variant(family: IpFamily) -> Ruleset {
    let mut rs = Ruleset::empty(family);
    let services = Set {
        spec: tandem_nftables::SetSpec::VerdictMap(KeyType::AddressProtocolPort),
        elements: BTreeMap::from([
            (
                Key::AddressProtocolPort(ip(family, [10, 96, 0, 10]), Protocol::Tcp, 80),
                goto("svc-a"),
            ),
            (
                Key::AddressProtocolPort(ip(family, [10, 96, 0, 11]), Protocol::Udp, 53),
                drop_verdict(),
            ),
        ]),
    };
    let node_ports = Set {
        spec: tandem_nftables::SetSpec::VerdictMap(KeyType::ProtocolPort),
        elements: BTreeMap::from([(Key::ProtocolPort(Protocol::Tcp, 30080), goto("svc-a"))]),
    };
    let endpoints = Set {
        spec: tandem_nftables::SetSpec::VerdictMap(KeyType::Index),
        elements: BTreeMap::from([
            (Key::Index(0), goto("ep-a-0")),
            (Key::Index(1), goto("ep-a-1")),
        ]),
    };
    let firewall = Set {
        spec: tandem_nftables::SetSpec::VerdictMap(KeyType::Address),
        elements: BTreeMap::from([(Key::Address(ip(family, [10, 1, 2, 3])), drop_verdict())]),
    };
    rs.sets.insert("service-ips".into(), services);
    rs.sets.insert("node-ports".into(), node_ports);
    rs.sets.insert("svc-a-endpoints".into(), endpoints);
    rs.sets.insert("firewall-sources".into(), firewall);
    rs.sets
        .insert("affinity-ep-a-0".into(), Set::dynamic(10800));
    rs.sets
        .insert("svc-b-endpoints".into(), udp_endpoints(family, &[5, 6]));
    let endpoint = ip(family, [10, 244, 1, 5]);
    rs.sets.insert(
        "hairpins".into(),
        Set {
            spec: SetSpec::AddressPairs,
            elements: BTreeMap::from([(Key::SelfPair(endpoint), Value::Member)]),
        },
    );
    rs.chains.insert(
        "svc-b-spread".into(),
        chain(
            None,
            vec![Rule::when(
                vec![Match::Protocol(Protocol::Udp)],
                Statement::RandomDnat {
                    map: "svc-b-endpoints".into(),
                    offset: SVC_B_OFFSET,
                },
            )],
        ),
    );
    rs.chains.insert(
        "nat-postrouting-hairpin".into(),
        chain(
            base(ChainType::Nat, Hook::Postrouting, 90),
            vec![Rule::when(
                vec![Match::AddressPairInSet("hairpins".into())],
                Statement::Masquerade,
            )],
        ),
    );

    let dispatch = |key, map: &str| Statement::Dispatch {
        key,
        map: map.into(),
    };
    rs.chains.insert(
        "nat-prerouting".into(),
        chain(
            base(ChainType::Nat, Hook::Prerouting, -100),
            vec![
                Rule::always(dispatch(DispatchKey::AddressProtocolPort, "service-ips"))
                    .with_comment("services"),
                Rule::when(
                    vec![Match::DestinationLocal],
                    dispatch(DispatchKey::ProtocolPort, "node-ports"),
                ),
            ],
        ),
    );
    rs.chains.insert(
        "nat-output".into(),
        chain(
            base(ChainType::Nat, Hook::Output, -100),
            vec![Rule::always(dispatch(
                DispatchKey::AddressProtocolPort,
                "service-ips",
            ))],
        ),
    );
    rs.chains.insert(
        "nat-postrouting".into(),
        chain(
            base(ChainType::Nat, Hook::Postrouting, 100),
            vec![
                Rule::when(
                    vec![Match::Mark {
                        bit: MARK,
                        set: false,
                    }],
                    Statement::Return,
                ),
                Rule::always(Statement::ToggleMark(MARK)),
                Rule::always(Statement::Masquerade).with_comment("masquerade marked traffic"),
            ],
        ),
    );
    rs.chains.insert(
        "filter-input".into(),
        chain(
            base(ChainType::Filter, Hook::Input, 0),
            vec![
                Rule::when(
                    vec![
                        Match::ConnectionNew,
                        Match::SourceInSet("firewall-sources".into()),
                    ],
                    Statement::Drop,
                ),
                Rule::when(
                    vec![
                        Match::DestinationAddress {
                            net: host(family, [10, 96, 0, 11]),
                            negated: false,
                        },
                        Match::DestinationPort {
                            protocol: Protocol::Udp,
                            port: 53,
                        },
                    ],
                    Statement::Reject,
                ),
            ],
        ),
    );
    rs.chains.insert(
        "filter-forward".into(),
        chain(
            base(ChainType::Filter, Hook::Forward, 0),
            vec![
                Rule::when(
                    vec![
                        Match::SourceAddress {
                            net: net(family, "10.240.0.0/12"),
                            negated: false,
                        },
                        Match::DestinationAddress {
                            net: net(family, "10.0.0.0/8"),
                            negated: true,
                        },
                    ],
                    Statement::Accept,
                ),
                Rule::when(
                    vec![
                        Match::SourceLocal,
                        Match::SourceAddress {
                            net: net(family, "0.0.0.0/0"),
                            negated: false,
                        },
                        Match::DestinationAddress {
                            net: net(family, "10.0.0.0/31"),
                            negated: true,
                        },
                    ],
                    Statement::Accept,
                ),
            ],
        ),
    );
    rs.sets.insert(
        "cluster-ips".into(),
        Set {
            spec: SetSpec::Addresses,
            elements: BTreeMap::from([
                (Key::Address(ip(family, [10, 96, 0, 10])), Value::Member),
                (Key::Address(ip(family, [10, 96, 0, 11])), Value::Member),
            ]),
        },
    );
    rs.chains.insert(
        "filter-output".into(),
        chain(
            base(ChainType::Filter, Hook::Output, 0),
            vec![
                Rule::when(
                    vec![Match::DestinationInSet("cluster-ips".into())],
                    Statement::Reject,
                )
                .with_comment("Reject traffic to invalid ports of ClusterIPs"),
                Rule::always(Statement::Goto("filter-common".into())),
            ],
        ),
    );
    rs.chains.insert(
        "filter-common".into(),
        chain(
            None,
            vec![
                Rule::when(vec![Match::Protocol(Protocol::Sctp)], Statement::Return),
                Rule::always(Statement::Accept),
            ],
        ),
    );
    rs.chains.insert(
        "mark-for-masquerade".into(),
        chain(None, vec![Rule::always(Statement::SetMark(MARK))]),
    );
    rs.chains.insert(
        "svc-a".into(),
        chain(
            None,
            vec![
                Rule::when(
                    vec![
                        Match::SourceAddress {
                            net: net(family, "10.244.0.0/16"),
                            negated: true,
                        },
                        Match::DestinationAddress {
                            net: host(family, [10, 96, 0, 10]),
                            negated: false,
                        },
                        Match::DestinationPort {
                            protocol: Protocol::Tcp,
                            port: 80,
                        },
                    ],
                    Statement::Jump("mark-for-masquerade".into()),
                )
                .with_comment("default/a:http cluster IP"),
                Rule::always(Statement::RandomDispatch {
                    modulus: 2,
                    map: "svc-a-endpoints".into(),
                }),
            ],
        ),
    );
    rs.chains.insert(
        "ep-a-0".into(),
        chain(
            None,
            vec![
                Rule::when(
                    vec![Match::SourceAddress {
                        net: host(family, [10, 244, 1, 2]),
                        negated: false,
                    }],
                    Statement::Jump("mark-for-masquerade".into()),
                ),
                Rule::always(Statement::AddSourceToSet("affinity-ep-a-0".into())),
                Rule::when(
                    vec![Match::Protocol(Protocol::Tcp)],
                    Statement::Dnat(SocketAddr::new(ip(family, [10, 244, 1, 2]), 8080)),
                ),
            ],
        ),
    );
    rs.chains.insert("ep-a-1".into(), udp_endpoint(family, 53));
    rs
}

/// An endpoint chain DNATing UDP to 10.244.1.3:`port`.
fn udp_endpoint(family: IpFamily, port: u16) -> Chain {
    chain(
        None,
        vec![Rule::when(
            vec![Match::Protocol(Protocol::Udp)],
            Statement::Dnat(SocketAddr::new(ip(family, [10, 244, 1, 3]), port)),
        )],
    )
}

/// `every_variant` changed: a service element added (to a new chain) and one removed,
/// an endpoint chain rewritten, a base chain moved to another priority (so made anew)
/// and the chain it jumped to removed, a set deleted with the rule that used it.
fn every_variant_changed(family: IpFamily) -> Ruleset {
    let mut rs = every_variant(family);
    let services = rs.sets.get_mut("service-ips").expect("service map");
    services.elements.insert(
        Key::AddressProtocolPort(ip(family, [10, 96, 0, 12]), Protocol::Tcp, 443),
        goto("svc-b"),
    );
    services.elements.remove(&Key::AddressProtocolPort(
        ip(family, [10, 96, 0, 11]),
        Protocol::Udp,
        53,
    ));
    rs.chains.insert(
        "svc-b".into(),
        chain(None, vec![Rule::always(Statement::Drop)]),
    );
    rs.chains
        .insert("ep-a-1".into(), udp_endpoint(family, 5353));
    // A third endpoint: every run of buckets moves.
    rs.sets
        .insert("svc-b-endpoints".into(), udp_endpoints(family, &[5, 6, 7]));
    rs.chains.insert(
        "filter-output".into(),
        chain(
            base(ChainType::Filter, Hook::Output, 10),
            vec![Rule::always(Statement::Accept)],
        ),
    );
    rs.chains.remove("filter-common");
    rs.sets.remove("firewall-sources");
    if let Some(input) = rs.chains.get_mut("filter-input") {
        input.rules.remove(0);
    }
    rs
}

fn between(old: &Ruleset, new: &Ruleset) -> Transaction {
    let chains: BTreeSet<&str> = old
        .chains
        .keys()
        .chain(new.chains.keys())
        .map(String::as_str)
        .collect();
    let sets: BTreeSet<&str> = old
        .sets
        .keys()
        .chain(new.sets.keys())
        .map(String::as_str)
        .collect();
    Transaction::between(old, new, &chains, &sets)
}

#[test]
fn netlink_and_nft_program_the_same_ruleset() {
    if !can_run() {
        return;
    }
    for family in [IpFamily::V4, IpFamily::V6] {
        eprintln!("{family}");
        the_same_ruleset_by_netlink_and_nft(family);
    }
}

fn the_same_ruleset_by_netlink_and_nft(family: IpFamily) {
    let (by_netlink, by_nft) = (
        ScratchNetns::of("netlink", family),
        ScratchNetns::of("nft", family),
    );
    let (old, new) = (every_variant(family), every_variant_changed(family));
    let nft_ip = family.nft_family();
    let address = match family {
        IpFamily::V4 => "ipv4_addr",
        IpFamily::V6 => "ipv6_addr",
    };

    let full = Transaction::replace_all(&old);
    by_netlink
        .apply(&full)
        .expect("netlink applies the full ruleset");
    by_nft.nft_script(&render::transaction(&full));
    let listed = by_netlink.listing();
    assert_eq!(listed, by_nft.listing());
    for needle in [
        "typeof numgen random mod 1 : verdict".to_owned(),
        format!("type {address} . inet_proto . inet_service : verdict"),
        "comment \"default/a:http cluster IP\"".to_owned(),
        format!("update @affinity-ep-a-0 {{ {nft_ip} saddr }}"),
        format!(
            "dnat {nft_ip} to numgen random mod {BUCKETS} offset {SVC_B_OFFSET} map @svc-b-endpoints"
        ),
    ] {
        assert!(listed.contains(&needle), "{needle} missing from\n{listed}");
    }

    let change = between(&old, &new);
    by_netlink
        .apply(&change)
        .expect("netlink applies the change");
    by_nft.nft_script(&render::transaction(&change));
    let changed = by_netlink.listing();
    assert_eq!(changed, by_nft.listing());
    assert!(changed.contains("goto svc-b") && !changed.contains("firewall-sources"));
    let moved = SocketAddr::new(ip(family, [10, 244, 1, 3]), 5353);
    assert!(changed.contains(&format!("dnat to {moved}")), "{changed}");
    assert!(
        changed.contains("hook output priority filter + 10") && !changed.contains("filter-common")
    );

    // Replacing an existing table, then removing it.
    let again = Transaction::replace_all(&old);
    by_netlink
        .apply(&again)
        .expect("netlink replaces the ruleset");
    assert_eq!(by_netlink.listing(), listed);
    by_netlink
        .apply(&Transaction::delete_all(family))
        .expect("netlink deletes the table");
    assert!(!by_netlink.has_table());
    by_netlink
        .apply(&Transaction::delete_all(family))
        .expect("deleting a missing table is no error");
}

/// The generation moves with every commit, of any table and any writer, and only then.
#[test]
fn the_generation_moves_with_every_commit_and_only_then() {
    if !can_run() {
        return;
    }
    let family = IpFamily::V4;
    let ns = ScratchNetns::new("generation");
    let generation = || ns.run(|| Netlink::open()?.generation());
    let first = generation().expect("generation");
    assert_eq!(
        generation().expect("generation"),
        first,
        "nothing committed"
    );
    ns.apply(&Transaction::replace_all(&every_variant(family)))
        .expect("our ruleset");
    let ours = generation().expect("generation");
    assert_ne!(ours, first, "our commit");
    // Reads of every kind commit nothing.
    let _ = ns.listing();
    ns.run(|| Netlink::open()?.read_table(tandem_nftables::TABLE, true))
        .expect("read back");
    assert_eq!(generation().expect("generation"), ours, "reads");
    ns.nft_script("add table inet someone_else\n");
    assert_ne!(
        generation().expect("generation"),
        ours,
        "someone else's commit"
    );
}

#[test]
fn a_rejected_transaction_names_its_operation_and_changes_nothing() {
    if !can_run() {
        return;
    }
    let family = IpFamily::V4;
    let ns = ScratchNetns::new("reject");
    ns.apply(&Transaction::replace_all(&every_variant(family)))
        .expect("initial ruleset");
    let before = ns.listing();

    let tx = Transaction {
        family,
        ops: vec![
            Op::AddChain {
                name: "new-chain".into(),
                base: None,
            },
            Op::AddElements {
                set: "service-ips".into(),
                elements: vec![(
                    Key::AddressProtocolPort(ip(family, [10, 96, 0, 99]), Protocol::Tcp, 80),
                    goto("new-chain"),
                )],
            },
            Op::AddRule {
                chain: "new-chain".into(),
                rule: Rule::always(Statement::Jump("no-such-chain".into())),
            },
        ],
    };
    let err = ns.apply(&tx).expect_err("the jump target is missing");
    match &err {
        KernelError::Rejected {
            index,
            operation,
            errno,
            ..
        } => {
            assert_eq!(*index, 2);
            assert_eq!(operation, "add rule ip tandem new-chain jump no-such-chain");
            assert_eq!(errno.raw_os_error(), Some(nix::libc::ENOENT));
        }
        other => panic!("expected a rejected operation, got {other}"),
    }
    eprintln!("rejected as expected: {err}");
    assert_eq!(ns.listing(), before);

    // A loop is found by the kernel's validation of the whole table, which replays the
    // batch; the error still names the rule that closes the loop.
    let jump = |from: &str, to: &str| Op::AddRule {
        chain: from.into(),
        rule: Rule::always(Statement::Jump(to.into())),
    };
    let looping = Transaction {
        family,
        ops: vec![
            Op::AddChain {
                name: "loop".into(),
                base: None,
            },
            jump("loop", "filter-common"),
            jump("filter-common", "loop"),
        ],
    };
    let err = ns.apply(&looping).expect_err("a jump loop");
    eprintln!("rejected as expected: {err}");
    match &err {
        KernelError::Rejected { index, errno, .. } => {
            assert_eq!(*index, 2);
            // nf_tables reports a loop as "too many links".
            assert_eq!(errno.raw_os_error(), Some(nix::libc::EMLINK), "{err}");
        }
        other => panic!("expected a rejected operation, got {other}"),
    }
    assert_eq!(ns.listing(), before);
}

/// A kube-proxy-like ruleset: `services` services of `endpoints` endpoints each.
fn scale_ruleset(services: u32, endpoints: u32) -> Ruleset {
    let family = IpFamily::V4;
    let mut rs = Ruleset::empty(family);
    rs.chains.insert(
        "nat-prerouting".into(),
        chain(
            base(ChainType::Nat, Hook::Prerouting, -100),
            vec![Rule::always(Statement::Dispatch {
                key: DispatchKey::AddressProtocolPort,
                map: "service-ips".into(),
            })],
        ),
    );
    rs.chains.insert(
        "nat-postrouting".into(),
        chain(
            base(ChainType::Nat, Hook::Postrouting, 100),
            vec![Rule::when(
                vec![Match::Mark {
                    bit: MARK,
                    set: true,
                }],
                Statement::Masquerade,
            )],
        ),
    );
    rs.chains.insert(
        "mark-for-masquerade".into(),
        chain(None, vec![Rule::always(Statement::SetMark(MARK))]),
    );
    let mut dispatch = Set::verdict_map(KeyType::AddressProtocolPort);
    for service in 0..services {
        let [_, _, high, low] = service.to_be_bytes();
        let service_chain = format!("service-{service:05}-tcp");
        dispatch.elements.insert(
            Key::AddressProtocolPort(ip(family, [10, 96, high, low]), Protocol::Tcp, 80),
            goto(&service_chain),
        );
        let map = format!("{service_chain}-endpoints");
        rs.chains.insert(
            service_chain.clone(),
            chain(
                None,
                vec![Rule::always(Statement::RandomDispatch {
                    modulus: endpoints,
                    map: map.clone(),
                })],
            ),
        );
        let mut endpoint_map = Set::verdict_map(KeyType::Index);
        for endpoint in 0..endpoints {
            let name = endpoint_chain(service, endpoint);
            endpoint_map
                .elements
                .insert(Key::Index(endpoint), goto(&name));
            rs.chains.insert(name, endpoint_rules(service, endpoint));
        }
        rs.sets.insert(map, endpoint_map);
    }
    rs.sets.insert("service-ips".into(), dispatch);
    rs
}

fn endpoint_chain(service: u32, endpoint: u32) -> String {
    format!("endpoint-{service:05}-{endpoint:03}")
}

fn endpoint_rules(service: u32, endpoint: u32) -> Chain {
    let [_, _, high, low] = service.to_be_bytes();
    let addr = ip(IpFamily::V4, [10, 128 + (high & 0x3f), low, endpoint as u8]);
    chain(
        None,
        vec![
            Rule::when(
                vec![Match::SourceAddress {
                    net: ipnet::IpNet::from(addr),
                    negated: false,
                }],
                Statement::Jump("mark-for-masquerade".into()),
            ),
            Rule::when(
                vec![Match::Protocol(Protocol::Tcp)],
                Statement::Dnat(SocketAddr::new(addr, 8080)),
            ),
        ],
    )
}

/// The ruleset with one more endpoint for `service`.
fn with_one_more_endpoint(rs: &Ruleset, service: u32, endpoints: u32) -> (Ruleset, Transaction) {
    let mut new = rs.clone();
    let service_chain = format!("service-{service:05}-tcp");
    let map = format!("{service_chain}-endpoints");
    let added = endpoint_chain(service, endpoints);
    new.chains
        .insert(added.clone(), endpoint_rules(service, endpoints));
    new.chains.insert(
        service_chain.clone(),
        chain(
            None,
            vec![Rule::always(Statement::RandomDispatch {
                modulus: endpoints + 1,
                map: map.clone(),
            })],
        ),
    );
    if let Some(set) = new.sets.get_mut(&map) {
        set.elements.insert(Key::Index(endpoints), goto(&added));
    }
    let chains = BTreeSet::from([service_chain.as_str(), added.as_str()]);
    let sets = BTreeSet::from([map.as_str()]);
    let tx = Transaction::between(rs, &new, &chains, &sets);
    (new, tx)
}

const CYCLES: usize = 5;

fn median(mut took: Vec<Duration>) -> Duration {
    took.sort_unstable();
    took.get(took.len() / 2).copied().unwrap_or_default()
}

struct Counts {
    chains: usize,
    rules_with_dnat: usize,
    vmaps: usize,
}

fn counts(listing: &str) -> Counts {
    Counts {
        chains: listing.matches("\tchain ").count(),
        rules_with_dnat: listing.matches("dnat to").count(),
        vmaps: listing.matches("\tmap ").count(),
    }
}

#[test]
fn a_large_ruleset_and_a_one_endpoint_change() {
    if !can_run() {
        return;
    }
    let services: u32 = std::env::var("TANDEM_NFT_SCALE_SERVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2700);
    let endpoints = 10;
    let (by_netlink, by_nft) = (
        ScratchNetns::new("scale-nl"),
        ScratchNetns::new("scale-nft"),
    );
    let rs = scale_ruleset(services, endpoints);
    let full = Transaction::replace_all(&rs);

    let started = Instant::now();
    let batch = tandem_nftables::encode::batch(&full, 1).expect("encodes");
    let encode_took = started.elapsed();
    let (grown, add) = with_one_more_endpoint(&rs, services / 2, endpoints);
    let remove = between(&grown, &rs);
    // Each change is made CYCLES times (added, removed, added, …, ending added): the
    // medians are printed.
    let (load_took, add_took, remove_took) = by_netlink.run(|| {
        let mut netlink = Netlink::open().expect("open netlink");
        let started = Instant::now();
        netlink
            .apply(&full)
            .expect("netlink applies the full ruleset");
        let load_took = started.elapsed();
        let (mut add_took, mut remove_took) = (Vec::new(), Vec::new());
        for cycle in 0..CYCLES {
            if cycle > 0 {
                let started = Instant::now();
                netlink
                    .apply(&remove)
                    .expect("netlink removes the endpoint");
                remove_took.push(started.elapsed());
            }
            let started = Instant::now();
            netlink.apply(&add).expect("netlink adds the endpoint");
            add_took.push(started.elapsed());
        }
        (load_took, median(add_took), median(remove_took))
    });
    let text = render::transaction(&full);
    let nft_load_took = by_nft.nft_script(&text);
    let (add_text, remove_text) = (render::transaction(&add), render::transaction(&remove));
    let (mut nft_add_took, mut nft_remove_took) = (Vec::new(), Vec::new());
    for cycle in 0..CYCLES {
        if cycle > 0 {
            nft_remove_took.push(by_nft.nft_script(&remove_text));
        }
        nft_add_took.push(by_nft.nft_script(&add_text));
    }
    let (nft_add_took, nft_remove_took) = (median(nft_add_took), median(nft_remove_took));

    println!(
        "{services} services x {endpoints} endpoints: {} ops, batch {:.1} MB in {} messages (encoded in {:?}), nft text {:.1} MB",
        full.ops.len(),
        batch.byte_len() as f64 / 1e6,
        batch.message_count(),
        encode_took,
        text.len() as f64 / 1e6,
    );
    println!("full load: netlink {load_took:?}, nft -f {nft_load_took:?}");
    println!(
        "one endpoint added ({} ops), median of {CYCLES}: netlink {add_took:?}, nft -f {nft_add_took:?}",
        add.ops.len()
    );
    println!(
        "one endpoint removed ({} ops), median of {}: netlink {remove_took:?}, nft -f {nft_remove_took:?}",
        remove.ops.len(),
        CYCLES - 1
    );

    let listed = by_netlink.listing();
    let found = counts(&listed);
    let total = (services * endpoints) as usize;
    assert_eq!(found.chains, 3 + services as usize + total + 1);
    assert_eq!(found.rules_with_dnat, total + 1);
    assert_eq!(found.vmaps, services as usize + 1);
    let nft_found = counts(&by_nft.listing());
    assert_eq!(
        (nft_found.chains, nft_found.rules_with_dnat, nft_found.vmaps),
        (found.chains, found.rules_with_dnat, found.vmaps)
    );
    assert!(listed.contains(&format!(
        "numgen random mod {} vmap @service-{:05}-tcp-endpoints",
        endpoints + 1,
        services / 2
    )));
}

impl ScratchNetns {
    /// What our table of the namespace's family holds, as digests (elements included).
    fn read(&self) -> TableDigest {
        let family = self.1;
        self.run(|| Netlink::open()?.reading(family).read_table("tandem", true))
            .expect("read the table back")
    }

    /// `nft CMD…` in the namespace; panics when nft fails.
    fn nft(&self, args: &[&str]) {
        let output = Command::new("ip")
            .args(["netns", "exec", &self.0, "nft"])
            .args(args)
            .output()
            .expect("run nft");
        assert!(
            output.status.success(),
            "nft {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

fn no_drift(written: &Ruleset, kernel: &TableDigest) -> TableDrift {
    TableDrift::between(&TableDigest::of(written), kernel, |_, _| false)
}

#[test]
fn what_netlink_writes_reads_back_the_same_and_drift_is_found_and_repaired() {
    if !can_run() {
        return;
    }
    for family in [IpFamily::V4, IpFamily::V6] {
        eprintln!("{family}");
        drift_found_and_repaired(family);
    }
}

fn drift_found_and_repaired(family: IpFamily) {
    let ns = ScratchNetns::of("readback", family);
    let (old, new) = (every_variant(family), every_variant_changed(family));
    let (table, address) = match family {
        IpFamily::V4 => ("ip tandem", "ipv4_addr"),
        IpFamily::V6 => ("ip6 tandem", "ipv6_addr"),
    };
    ns.apply(&Transaction::replace_all(&old))
        .expect("initial ruleset");
    let drift = no_drift(&old, &ns.read());
    assert!(drift.is_empty(), "a fresh table differs: {drift:?}");
    ns.apply(&between(&old, &new)).expect("the change");
    let kernel = ns.read();
    let drift = no_drift(&new, &kernel);
    assert!(drift.is_empty(), "a changed table differs: {drift:?}");
    // Packets fill a dynamic set; its elements are not compared.
    let client = format!("{{ {} }}", ip(family, [192, 0, 2, 1]));
    ns.nft(&[
        "add",
        "element",
        family.nft_family(),
        "tandem",
        "affinity-ep-a-0",
        &client,
    ]);
    assert!(no_drift(&new, &ns.read()).is_empty());

    // Someone else: an endpoint's run of buckets deleted, a chain flushed, a rule added,
    // a base chain's policy changed, a chain and a set of their own added, a set emptied
    // and a base chain deleted.
    let run = format!("{}-{}", SVC_B_OFFSET, SVC_B_OFFSET + BUCKETS / 3 - 1);
    for command in [
        format!("delete element {table} svc-b-endpoints {{ {run} }}"),
        format!("flush chain {table} svc-b-spread"),
        format!("add rule {table} svc-b accept"),
        format!("chain {table} filter-input {{ policy drop; }}"),
        format!("add chain {table} intruder"),
        format!("add set {table} intruders {{ type {address}; }}"),
        format!("flush set {table} hairpins"),
        format!("flush chain {table} filter-output"),
        format!("delete chain {table} filter-output"),
    ] {
        ns.nft_script(&command);
    }
    let drift = no_drift(&new, &ns.read());
    let chains: Vec<(&str, Drift)> = drift.chains.iter().map(|(n, d)| (n.as_str(), *d)).collect();
    assert_eq!(
        chains,
        [
            ("filter-input", Drift::Declaration),
            ("filter-output", Drift::Missing),
            ("intruder", Drift::Unexpected),
            ("svc-b", Drift::Content),
            ("svc-b-spread", Drift::Content),
        ]
    );
    let sets: Vec<(&str, Drift)> = drift.sets.iter().map(|(n, d)| (n.as_str(), *d)).collect();
    assert_eq!(
        sets,
        [
            ("hairpins", Drift::Content),
            ("intruders", Drift::Unexpected),
            ("svc-b-endpoints", Drift::Content),
        ]
    );
    let repair = Transaction::repair(&new, &drift);
    ns.apply(&repair).expect("the repair applies");
    let left = no_drift(&new, &ns.read());
    assert!(left.is_empty(), "left after the repair: {left:?}");
    // A table deleted whole reads as empty: everything is missing, and the repair
    // writes it all.
    ns.apply(&Transaction::delete_all(family)).expect("delete");
    let drift = no_drift(&new, &ns.read());
    assert_eq!(drift.chains.len(), new.chains.len());
    assert!(drift.chains.values().all(|d| *d == Drift::Missing));
    ns.apply(&Transaction::repair(&new, &drift))
        .expect("the repair applies");
    assert!(no_drift(&new, &ns.read()).is_empty());
}
