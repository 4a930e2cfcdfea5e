//! The machine a run measured on, described by what it is (cores, CPU, whether it is a
//! virtual machine, memory, distribution, kernel, the iptables and nftables it drove), so
//! a reader who cannot see it knows what the figures were measured on.

use std::process::Command;

/// What the report's header says about the machine.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Machine {
    pub cores: usize,
    /// e.g. x86_64.
    pub arch: String,
    /// The CPU advertises a hypervisor: the cores are a VM's, shared with its host.
    pub virtual_machine: bool,
    /// /proc/cpuinfo's model name.
    pub cpu_model: Option<String>,
    pub memory_gib: Option<u64>,
    /// /etc/os-release's PRETTY_NAME.
    pub os: Option<String>,
    /// `uname -r`.
    pub kernel: String,
    /// `iptables --version`, `nft --version`: the programs whose cost the iptables
    /// figures include.
    pub tools: Vec<String>,
}

impl Machine {
    /// This machine, read from /proc, /etc/os-release and the tools' `--version`; what
    /// cannot be read is left out of the description rather than failing the run.
    pub fn probe() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let cpuinfo = read("/proc/cpuinfo");
        let tools = [("iptables", "--version"), ("nft", "--version")]
            .into_iter()
            .filter_map(|(program, flag)| {
                let output = Command::new(program).arg(flag).output().ok()?;
                let text = String::from_utf8_lossy(&output.stdout).trim().to_owned();
                (output.status.success() && !text.is_empty()).then_some(text)
            })
            .collect();
        Self {
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            arch: std::env::consts::ARCH.to_owned(),
            virtual_machine: is_virtual(&cpuinfo),
            cpu_model: cpu_model(&cpuinfo),
            memory_gib: memory_gib(&read("/proc/meminfo")),
            os: os_name(&read("/etc/os-release")),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            tools,
        }
    }

    /// e.g. "2-core x86_64 VM (AMD EPYC), 23 GiB RAM, Debian GNU/Linux 12 (bookworm),
    /// kernel 6.1.0-27-amd64, iptables v1.8.9 (nf_tables), nftables v1.0.6".
    pub fn describe(&self) -> String {
        let mut parts = vec![format!(
            "{}-core {} {}{}",
            self.cores,
            self.arch,
            if self.virtual_machine {
                "VM"
            } else {
                "machine"
            },
            self.cpu_model
                .as_ref()
                .map(|model| format!(" ({model})"))
                .unwrap_or_default()
        )];
        parts.extend(self.memory_gib.map(|gib| format!("{gib} GiB RAM")));
        parts.extend(self.os.clone());
        if !self.kernel.is_empty() {
            parts.push(format!("kernel {}", self.kernel));
        }
        parts.extend(self.tools.iter().cloned());
        parts.join(", ")
    }
}

/// The first `model name` of /proc/cpuinfo.
pub fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == "model name" && !value.trim().is_empty()).then(|| value.trim().to_owned())
    })
}

/// Whether /proc/cpuinfo's flags carry `hypervisor` (set by every common hypervisor).
pub fn is_virtual(cpuinfo: &str) -> bool {
    cpuinfo.lines().any(|line| {
        line.split_once(':').is_some_and(|(key, value)| {
            key.trim() == "flags" && value.split_whitespace().any(|flag| flag == "hypervisor")
        })
    })
}

/// /proc/meminfo's MemTotal in GiB, rounded.
pub fn memory_gib(meminfo: &str) -> Option<u64> {
    let kib: u64 = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some((kib + (1 << 19)) >> 20)
}

/// /etc/os-release's PRETTY_NAME, unquoted.
pub fn os_name(os_release: &str) -> Option<String> {
    let value = os_release
        .lines()
        .find_map(|line| line.strip_prefix("PRETTY_NAME="))?
        .trim()
        .trim_matches('"');
    (!value.is_empty()).then(|| value.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPUINFO: &str = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n\
        flags\t\t: fpu vme sse2 hypervisor lahf_lm\n\nprocessor\t: 1\nmodel name\t: AMD EPYC\n";

    #[test]
    fn the_machine_is_read_from_proc_and_os_release() {
        assert_eq!(cpu_model(CPUINFO).as_deref(), Some("AMD EPYC"));
        assert!(is_virtual(CPUINFO));
        assert!(!is_virtual("flags\t: fpu vme hypervisorish\n"));
        assert_eq!(cpu_model("processor : 0\n"), None);
        assert_eq!(
            memory_gib("MemTotal:       24590848 kB\nMemFree: 1 kB\n"),
            Some(23)
        );
        assert_eq!(memory_gib("MemFree: 1 kB\n"), None);
        assert_eq!(
            os_name("NAME=\"Debian GNU/Linux\"\nPRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\n")
                .as_deref(),
            Some("Debian GNU/Linux 12 (bookworm)")
        );
        assert_eq!(os_name(""), None);
    }

    #[test]
    fn the_description_says_what_the_machine_is() {
        let machine = Machine {
            cores: 2,
            arch: "x86_64".into(),
            virtual_machine: true,
            cpu_model: Some("AMD EPYC".into()),
            memory_gib: Some(23),
            os: Some("Debian GNU/Linux 12 (bookworm)".into()),
            kernel: "6.18.44-fc-v669".into(),
            tools: vec!["iptables v1.8.9 (nf_tables)".into()],
        };
        assert_eq!(
            machine.describe(),
            "2-core x86_64 VM (AMD EPYC), 23 GiB RAM, Debian GNU/Linux 12 (bookworm), \
             kernel 6.18.44-fc-v669, iptables v1.8.9 (nf_tables)"
        );
        let bare = Machine {
            cores: 4,
            arch: "aarch64".into(),
            ..Machine::default()
        };
        assert_eq!(bare.describe(), "4-core aarch64 machine");
    }
}
