//! The rule syntax [`crate::rules::build`] emits, read back into matches and targets; any
//! other syntax is an error.

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use tandem_common::Protocol;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Cond {
    Source {
        negated: bool,
        net: IpNet,
    },
    Destination {
        negated: bool,
        net: IpNet,
    },
    /// `-i NAME`; a name ending in `+` matches every interface it starts.
    InInterface {
        negated: bool,
        name: String,
    },
    Protocol(Protocol),
    DestPort(u16),
    SrcTypeLocal,
    DstTypeLocal,
    Mark {
        negated: bool,
        value: u32,
        mask: u32,
    },
    /// Matches when the listed states include NEW (the only state traced).
    CtState(Vec<String>),
    Statistic(f64),
    RecentCheck(String),
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Target {
    Jump(String),
    Accept,
    Drop,
    Reject,
    Return,
    Dnat(SocketAddr),
    Masquerade,
    SetXMark { value: u32, mask: u32 },
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct ParsedRule {
    pub(super) text: String,
    pub(super) conds: Vec<Cond>,
    pub(super) target: Target,
}

/// Splits on whitespace, keeping double-quoted strings (comments) whole.
fn tokenize(rule: &str) -> Result<Vec<String>, String> {
    let mut tokens = Vec::new();
    let mut chars = rule.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
        } else if c == '"' {
            chars.next();
            let mut quoted = String::new();
            loop {
                match chars.next() {
                    Some('"') => break,
                    Some(c) => quoted.push(c),
                    None => return Err("unterminated quote".into()),
                }
            }
            tokens.push(quoted);
        } else {
            let mut word = String::new();
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                word.push(c);
                chars.next();
            }
            tokens.push(word);
        }
    }
    Ok(tokens)
}

pub(super) fn parse_rule(text: &str) -> Result<ParsedRule, String> {
    let tokens = tokenize(text)?;
    let mut args = tokens.iter().map(String::as_str);
    let mut conds = Vec::new();
    let mut module = "";
    let mut negated = false;
    let mut target = None;
    while let Some(arg) = args.next() {
        let mut value = |what: &str| args.next().ok_or_else(|| format!("{what} needs a value"));
        if negated && !matches!(arg, "-s" | "-d" | "-i" | "--mark") {
            return Err(format!("`!` before {arg} is not supported"));
        }
        match (module, arg) {
            (_, "!") => {
                negated = true;
                continue;
            }
            (_, "-s") => conds.push(Cond::Source {
                negated,
                net: parse_net(value("-s")?)?,
            }),
            (_, "-d") => conds.push(Cond::Destination {
                negated,
                net: parse_net(value("-d")?)?,
            }),
            (_, "-i") => conds.push(Cond::InInterface {
                negated,
                name: value("-i")?.to_owned(),
            }),
            (_, "-p") => conds.push(Cond::Protocol(parse_protocol(value("-p")?)?)),
            (_, "-m") => {
                module = value("-m")?;
                if ![
                    "comment",
                    "tcp",
                    "udp",
                    "sctp",
                    "addrtype",
                    "mark",
                    "conntrack",
                    "statistic",
                    "recent",
                ]
                .contains(&module)
                {
                    return Err(format!("unknown match module {module}"));
                }
            }
            (_, "-j") => {
                let rest: Vec<&str> = args.by_ref().collect();
                target = Some(parse_target(value_of_target(&rest)?, &rest[1..])?);
            }
            ("comment", "--comment") => {
                value("--comment")?;
            }
            ("tcp" | "udp" | "sctp", "--dport") => {
                let port = value("--dport")?;
                conds.push(Cond::DestPort(
                    port.parse().map_err(|_| format!("bad port {port}"))?,
                ));
            }
            ("addrtype", "--src-type" | "--dst-type") => {
                let kind = value(arg)?;
                if kind != "LOCAL" {
                    return Err(format!("addrtype {kind} is not supported"));
                }
                conds.push(if arg == "--src-type" {
                    Cond::SrcTypeLocal
                } else {
                    Cond::DstTypeLocal
                });
            }
            ("mark", "--mark") => {
                let (value, mask) = parse_mark(value("--mark")?)?;
                conds.push(Cond::Mark {
                    negated,
                    value,
                    mask,
                });
            }
            ("conntrack", "--ctstate") => {
                conds.push(Cond::CtState(
                    value("--ctstate")?.split(',').map(str::to_owned).collect(),
                ));
            }
            ("statistic", "--mode") => {
                let mode = value("--mode")?;
                if mode != "random" {
                    return Err(format!("statistic mode {mode} is not supported"));
                }
            }
            ("statistic", "--probability") => {
                let p = value("--probability")?;
                let p: f64 = p.parse().map_err(|_| format!("bad probability {p}"))?;
                if !(0.0..=1.0).contains(&p) {
                    return Err(format!("probability {p} out of range"));
                }
                conds.push(Cond::Statistic(p));
            }
            ("recent", "--rcheck") => conds.push(Cond::RecentCheck(String::new())),
            ("recent", "--name") => {
                let name = value("--name")?;
                if let Some(Cond::RecentCheck(list)) = conds.last_mut() {
                    *list = name.to_owned();
                }
            }
            ("recent", "--seconds") => {
                value("--seconds")?;
            }
            ("recent", "--mask") => {
                // The whole source address, in either family.
                let mask = value("--mask")?;
                if !matches!(
                    mask,
                    "255.255.255.255" | "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
                ) {
                    return Err(format!("recent mask {mask} is not supported"));
                }
            }
            // --set records the source for later connections; --reap and --rsource only
            // refine how entries age and which address is recorded.
            ("recent", "--set" | "--reap" | "--rsource") => {}
            (module, arg) => return Err(format!("unknown option {arg} (match module {module:?})")),
        }
        negated = false;
    }
    if negated {
        return Err("dangling `!`".into());
    }
    if conds
        .iter()
        .any(|c| matches!(c, Cond::RecentCheck(name) if name.is_empty()))
    {
        return Err("recent --rcheck without --name".into());
    }
    let target = target.ok_or("no -j target")?;
    Ok(ParsedRule {
        text: text.to_owned(),
        conds,
        target,
    })
}

fn value_of_target<'a>(rest: &[&'a str]) -> Result<&'a str, String> {
    rest.first()
        .copied()
        .ok_or_else(|| "-j needs a target".to_owned())
}

fn parse_target(name: &str, options: &[&str]) -> Result<Target, String> {
    let target = match (name, options) {
        ("ACCEPT", []) => Target::Accept,
        ("DROP", []) => Target::Drop,
        ("RETURN", []) => Target::Return,
        (
            "REJECT",
            []
            | [
                "--reject-with",
                "icmp-port-unreachable" | "icmp6-port-unreachable",
            ],
        ) => Target::Reject,
        ("MASQUERADE", [] | ["--random-fully"]) => Target::Masquerade,
        ("DNAT", ["--to-destination", to]) => Target::Dnat(
            to.parse()
                .map_err(|_| format!("bad DNAT destination {to}"))?,
        ),
        ("MARK", ["--set-xmark", mark]) => {
            let (value, mask) = parse_mark(mark)?;
            Target::SetXMark { value, mask }
        }
        (chain, []) if chain.starts_with("KUBE-") => Target::Jump(chain.to_owned()),
        _ => {
            return Err(format!(
                "unknown target `{}`",
                [&[name], options].concat().join(" ")
            ));
        }
    };
    Ok(target)
}

fn parse_net(text: &str) -> Result<IpNet, String> {
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| format!("bad address {text}"))
}

fn parse_protocol(text: &str) -> Result<Protocol, String> {
    match text {
        "tcp" => Ok(Protocol::Tcp),
        "udp" => Ok(Protocol::Udp),
        "sctp" => Ok(Protocol::Sctp),
        other => Err(format!("unknown protocol {other}")),
    }
}

fn parse_mark(text: &str) -> Result<(u32, u32), String> {
    let hex = |s: &str| {
        s.strip_prefix("0x")
            .and_then(|digits| u32::from_str_radix(digits, 16).ok())
            .ok_or_else(|| format!("bad mark {text}"))
    };
    let (value, mask) = text
        .split_once('/')
        .ok_or_else(|| format!("mark {text} has no mask"))?;
    Ok((hex(value)?, hex(mask)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form_build_emits() {
        let rule = parse_rule(
            "! -s 10.244.0.0/16 -d 10.43.35.197/32 -p tcp -m comment --comment \"a b\" -m tcp --dport 80 -j KUBE-MARK-MASQ",
        )
        .unwrap();
        assert_eq!(rule.conds.len(), 4);
        assert_eq!(rule.target, Target::Jump("KUBE-MARK-MASQ".into()));
        let recent = parse_rule(
            "-m comment --comment \"x\" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-A --mask 255.255.255.255 --rsource -j KUBE-SEP-A",
        )
        .unwrap();
        assert_eq!(recent.conds, [Cond::RecentCheck("KUBE-SEP-A".into())]);
        let mark = parse_rule("-m mark ! --mark 0x4000/0x4000 -j RETURN").unwrap();
        assert_eq!(
            mark.conds,
            [Cond::Mark {
                negated: true,
                value: 0x4000,
                mask: 0x4000
            }]
        );
        assert_eq!(
            parse_rule("-j MARK --set-xmark 0x4000/0x0").unwrap().target,
            Target::SetXMark {
                value: 0x4000,
                mask: 0
            }
        );
    }

    #[test]
    fn parses_input_interfaces() {
        let rule = parse_rule("! -i veth+ -p tcp -j ACCEPT").unwrap();
        assert_eq!(
            rule.conds[0],
            Cond::InInterface {
                negated: true,
                name: "veth+".to_owned()
            }
        );
        let rule = parse_rule("-i cni0 -j ACCEPT").unwrap();
        assert_eq!(
            rule.conds[0],
            Cond::InInterface {
                negated: false,
                name: "cni0".to_owned()
            }
        );
    }

    #[test]
    fn refuses_what_it_does_not_know() {
        for rule in [
            "-o eth0 -j ACCEPT",
            "-m set --match-set foo src -j ACCEPT",
            "-m tcp --sport 80 -j ACCEPT",
            "-m addrtype --dst-type UNICAST -j ACCEPT",
            "-j SNAT --to-source 1.2.3.4",
            "-j LOG",
            "! -p tcp -j ACCEPT",
            "-m comment --comment \"unterminated -j ACCEPT",
            "-m recent --rcheck -j KUBE-SEP-A",
            "-m statistic --mode nth --every 2 -j ACCEPT",
            "-s 10.0.0.0/8",
        ] {
            assert!(parse_rule(rule).is_err(), "accepted {rule}");
        }
    }
}
