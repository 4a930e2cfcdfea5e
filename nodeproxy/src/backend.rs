//! Which iptables backend (nf_tables or legacy) the host uses, decided once at start-up the
//! way kube-proxy's `iptables-wrappers` do: rules of the two backends live in different
//! kernel subsystems, and writing ours into the one the host does not use would leave them
//! without effect.

use std::fmt;
use std::process::Stdio;

use tokio::process::Command;

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
        match self {
            Backend::Nft => "iptables-nft",
            Backend::Legacy => "iptables-legacy",
        }
    }

    pub fn restore(self) -> &'static str {
        match self {
            Backend::Nft => "iptables-nft-restore",
            Backend::Legacy => "iptables-legacy-restore",
        }
    }

    pub fn save(self) -> &'static str {
        match self {
            Backend::Nft => "iptables-nft-save",
            Backend::Legacy => "iptables-legacy-save",
        }
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
        }
    }
}

const HINT_CHAINS: &[&str] = &[":KUBE-IPTABLES-HINT ", ":KUBE-KUBELET-CANARY "];

/// Decide from the `iptables-save` output of both backends (all tables).
pub fn detect(legacy_save: &str, nft_save: &str) -> (Backend, Reason) {
    let has_hint = |text: &str| {
        text.lines()
            .any(|l| HINT_CHAINS.iter().any(|h| l.starts_with(h)))
    };
    if has_hint(nft_save) {
        return (Backend::Nft, Reason::KubeletHint);
    }
    if has_hint(legacy_save) {
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

/// Resolve `--iptables-backend`: run both `*-save` binaries once (a missing binary or a
/// failing save counts as an empty ruleset) and apply [`detect`].
pub async fn resolve(choice: BackendChoice) -> (Backend, Reason) {
    match choice {
        BackendChoice::Nft => (Backend::Nft, Reason::Flag),
        BackendChoice::Legacy => (Backend::Legacy, Reason::Flag),
        BackendChoice::Auto => {
            let (legacy, nft) = tokio::join!(
                save_all(Backend::Legacy.save()),
                save_all(Backend::Nft.save())
            );
            detect(&legacy, &nft)
        }
    }
}

async fn save_all(program: &str) -> String {
    let output = Command::new(program)
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
