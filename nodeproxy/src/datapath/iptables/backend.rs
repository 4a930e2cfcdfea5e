//! Which iptables backend (nf_tables or legacy) the host uses, decided once at start-up the
//! way kube-proxy's `iptables-wrappers` do: rules of the two backends live in different
//! kernel subsystems, and writing ours into the one the host does not use would leave them
//! without effect.

use std::fmt;
use std::process::Stdio;

use tandem_common::IpFamily;
use tokio::process::Command;

use crate::datapath::iptables::restore::CANARY_CHAIN;

/// `--iptables-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendChoice {
    /// Detect from the rules already on the host.
    Auto,
    Nft,
    Legacy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Nft,
    Legacy,
}

impl Backend {
    /// The `iptables` binary of this backend, named explicitly: plain `iptables` is
    /// whichever backend the distribution's alternatives point at.
    pub fn iptables(self) -> &'static str {
        Tools::new(self, IpFamily::V4).iptables()
    }

    pub fn restore(self) -> &'static str {
        Tools::new(self, IpFamily::V4).restore()
    }

    pub fn save(self) -> &'static str {
        Tools::new(self, IpFamily::V4).save()
    }
}

/// The programs of one backend for one IP family: the proxier of each family writes the
/// same chains, IPv4's with `iptables-*`, IPv6's with `ip6tables-*`, as kube-proxy's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tools {
    pub backend: Backend,
    pub family: IpFamily,
}

impl Tools {
    pub fn new(backend: Backend, family: IpFamily) -> Self {
        Self { backend, family }
    }

    pub fn iptables(self) -> &'static str {
        match (self.backend, self.family) {
            (Backend::Nft, IpFamily::V4) => "iptables-nft",
            (Backend::Legacy, IpFamily::V4) => "iptables-legacy",
            (Backend::Nft, IpFamily::V6) => "ip6tables-nft",
            (Backend::Legacy, IpFamily::V6) => "ip6tables-legacy",
        }
    }

    pub fn restore(self) -> &'static str {
        match (self.backend, self.family) {
            (Backend::Nft, IpFamily::V4) => "iptables-nft-restore",
            (Backend::Legacy, IpFamily::V4) => "iptables-legacy-restore",
            (Backend::Nft, IpFamily::V6) => "ip6tables-nft-restore",
            (Backend::Legacy, IpFamily::V6) => "ip6tables-legacy-restore",
        }
    }

    pub fn save(self) -> &'static str {
        match (self.backend, self.family) {
            (Backend::Nft, IpFamily::V4) => "iptables-nft-save",
            (Backend::Legacy, IpFamily::V4) => "iptables-legacy-save",
            (Backend::Nft, IpFamily::V6) => "ip6tables-nft-save",
            (Backend::Legacy, IpFamily::V6) => "ip6tables-legacy-save",
        }
    }
}

/// A backend's IPv4 programs.
impl From<Backend> for Tools {
    fn from(backend: Backend) -> Self {
        Self::new(backend, IpFamily::V4)
    }
}

impl fmt::Display for Tools {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.backend, self.family)
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Nft => "nf_tables",
            Backend::Legacy => "legacy",
        })
    }
}

/// Why a backend was picked, for the start-up log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    Flag,
    /// The kubelet's marker chains (`KUBE-IPTABLES-HINT`, `KUBE-KUBELET-CANARY`) are there.
    KubeletHint,
    /// More KUBE-* rules in this backend (legacy, nft counts).
    KubeRules(usize, usize),
    /// More rules of any kind in this backend (legacy, nft counts); nft wins ties.
    AnyRules(usize, usize),
    /// Only this backend holds our canary chain: a node proxy wrote there before.
    OurCanary,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Flag => f.write_str("set by --iptables-backend"),
            Reason::KubeletHint => f.write_str("the kubelet's hint chain is in this backend"),
            Reason::KubeRules(legacy, nft) => {
                write!(f, "KUBE-* rules: {legacy} legacy, {nft} nf_tables")
            }
            Reason::AnyRules(legacy, nft) => write!(
                f,
                "rules: {legacy} legacy, {nft} nf_tables (nf_tables unless legacy has more)"
            ),
            Reason::OurCanary => f.write_str("a node proxy's canary chain is in this backend"),
        }
    }
}

const HINT_CHAINS: &[&str] = &[":KUBE-IPTABLES-HINT ", ":KUBE-KUBELET-CANARY "];

fn has_chain(save: &str, declarations: &[&str]) -> bool {
    save.lines()
        .any(|l| declarations.iter().any(|d| l.starts_with(d)))
}

/// Decide from the kubelet's hint chains and our canary, which all sit in the mangle table
/// (`iptables-save -t mangle` of both backends, cheap however many Services a node has);
/// `None` when they do not tell.
pub fn detect_from_mangle(legacy_mangle: &str, nft_mangle: &str) -> Option<(Backend, Reason)> {
    if has_chain(nft_mangle, HINT_CHAINS) {
        return Some((Backend::Nft, Reason::KubeletHint));
    }
    if has_chain(legacy_mangle, HINT_CHAINS) {
        return Some((Backend::Legacy, Reason::KubeletHint));
    }
    let canary = format!(":{CANARY_CHAIN} ");
    match (
        has_chain(legacy_mangle, &[&canary]),
        has_chain(nft_mangle, &[&canary]),
    ) {
        (true, false) => Some((Backend::Legacy, Reason::OurCanary)),
        (false, true) => Some((Backend::Nft, Reason::OurCanary)),
        _ => None,
    }
}

/// Decide from the `iptables-save` output of both backends (all tables).
pub fn detect(legacy_save: &str, nft_save: &str) -> (Backend, Reason) {
    if has_chain(nft_save, HINT_CHAINS) {
        return (Backend::Nft, Reason::KubeletHint);
    }
    if has_chain(legacy_save, HINT_CHAINS) {
        return (Backend::Legacy, Reason::KubeletHint);
    }
    let count = |text: &str, kube_only: bool| {
        text.lines()
            .filter(|l| l.starts_with("-A ") && (!kube_only || l.contains("KUBE-")))
            .count()
    };
    let (legacy_kube, nft_kube) = (count(legacy_save, true), count(nft_save, true));
    if legacy_kube != nft_kube {
        let backend = if legacy_kube > nft_kube {
            Backend::Legacy
        } else {
            Backend::Nft
        };
        return (backend, Reason::KubeRules(legacy_kube, nft_kube));
    }
    let (legacy_any, nft_any) = (count(legacy_save, false), count(nft_save, false));
    let backend = if legacy_any > nft_any {
        Backend::Legacy
    } else {
        Backend::Nft
    };
    (backend, Reason::AnyRules(legacy_any, nft_any))
}

/// Resolve `--iptables-backend`: the mangle tables of both backends first
/// ([`detect_from_mangle`]); only when they do not tell, both whole rulesets ([`detect`]),
/// whose save takes seconds on nf_tables once it holds thousands of Services. A missing
/// binary or a failing save counts as an empty ruleset.
pub async fn resolve(choice: BackendChoice) -> (Backend, Reason) {
    match choice {
        BackendChoice::Nft => (Backend::Nft, Reason::Flag),
        BackendChoice::Legacy => (Backend::Legacy, Reason::Flag),
        BackendChoice::Auto => {
            let mangle = ["-t", "mangle"];
            let (legacy, nft) = tokio::join!(
                save(Backend::Legacy.save(), &mangle),
                save(Backend::Nft.save(), &mangle)
            );
            if let Some(found) = detect_from_mangle(&legacy, &nft) {
                return found;
            }
            let (legacy, nft) = tokio::join!(
                save(Backend::Legacy.save(), &[]),
                save(Backend::Nft.save(), &[])
            );
            detect(&legacy, &nft)
        }
    }
}

async fn save(program: &str, args: &[&str]) -> String {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .await;
    match output {
        Ok(output) if output.status.success() => {
            String::from_utf8_lossy(&output.stdout).into_owned()
        }
        Ok(output) => {
            tracing::debug!(program, status = %output.status, "iptables save failed; counting it as empty");
            String::new()
        }
        Err(error) => {
            tracing::debug!(program, %error, "iptables save not runnable; counting it as empty");
            String::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_empty_prefers_nft() {
        assert_eq!(detect("", ""), (Backend::Nft, Reason::AnyRules(0, 0)));
    }

    #[test]
    fn kubelet_hint_decides_first() {
        let legacy = "*filter\n-A INPUT -j DROP\n-A INPUT -j DROP\nCOMMIT\n";
        let nft = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";
        assert_eq!(detect(legacy, nft), (Backend::Nft, Reason::KubeletHint));
        let legacy_hint = "*mangle\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n";
        assert_eq!(
            detect(legacy_hint, ""),
            (Backend::Legacy, Reason::KubeletHint)
        );
    }

    #[test]
    fn the_mangle_table_tells_by_the_kubelets_hint_or_our_canary_alone() {
        let hint = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";
        let canary = "*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n";
        let empty = "*mangle\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n";
        assert_eq!(
            detect_from_mangle(canary, hint),
            Some((Backend::Nft, Reason::KubeletHint))
        );
        assert_eq!(
            detect_from_mangle(canary, empty),
            Some((Backend::Legacy, Reason::OurCanary))
        );
        assert_eq!(
            detect_from_mangle(empty, canary),
            Some((Backend::Nft, Reason::OurCanary))
        );
        // Our canary in both, or in neither: the whole rulesets decide.
        assert_eq!(detect_from_mangle(canary, canary), None);
        assert_eq!(detect_from_mangle(empty, ""), None);
    }

    #[test]
    fn kube_rules_outweigh_other_rules() {
        let legacy = "*nat\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n";
        let nft = "*filter\n-A INPUT -j DROP\n-A INPUT -j ACCEPT\nCOMMIT\n";
        assert_eq!(
            detect(legacy, nft),
            (Backend::Legacy, Reason::KubeRules(1, 0))
        );
    }

    #[test]
    fn any_rules_decide_when_no_kube_rules() {
        let legacy = "*filter\n-A INPUT -j DROP\n-A INPUT -j ACCEPT\nCOMMIT\n";
        let nft = "*filter\n-A INPUT -j DROP\nCOMMIT\n";
        assert_eq!(
            detect(legacy, nft),
            (Backend::Legacy, Reason::AnyRules(2, 1))
        );
        assert_eq!(detect(nft, nft), (Backend::Nft, Reason::AnyRules(1, 1)));
    }
}
