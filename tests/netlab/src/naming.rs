//! Names of the namespaces of one run (pure).
//!
//! Every namespace of a topology is `tdm<pid>x<seq>-<role>`: the pid of the process that
//! built it (so a later run can tell a dead run's leftovers from a live one's) and a
//! per-process sequence number (so parallel tests in one process never collide).

use std::sync::atomic::{AtomicU32, Ordering};

const PREFIX_HEAD: &str = "tdm";

/// The prefix shared by every namespace of one topology, e.g. `tdm4242x3`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RunPrefix(String);

impl RunPrefix {
    /// A prefix no other topology of this process has used.
    pub fn next_for_this_process() -> Self {
        static SEQUENCE: AtomicU32 = AtomicU32::new(1);
        Self::new(std::process::id(), SEQUENCE.fetch_add(1, Ordering::Relaxed))
    }

    /// The prefix of topology `seq` built by process `pid`.
    pub fn new(pid: u32, seq: u32) -> Self {
        Self(format!("{PREFIX_HEAD}{pid}x{seq}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether a namespace name belongs to this prefix.
    pub fn owns(&self, netns: &str) -> bool {
        netns
            .strip_prefix(self.0.as_str())
            .is_some_and(|rest| rest.starts_with('-'))
    }

    pub fn switch(&self) -> String {
        format!("{}-sw", self.0)
    }
    pub fn control_plane(&self) -> String {
        format!("{}-cp", self.0)
    }
    pub fn edge(&self) -> String {
        format!("{}-edge", self.0)
    }
    /// Edge `edge` of an edge cluster (the single edge is [`RunPrefix::edge`]).
    pub fn cluster_edge(&self, edge: usize) -> String {
        format!("{}-e{edge}", self.0)
    }
    /// The router in front of an edge cluster.
    pub fn router(&self) -> String {
        format!("{}-rt", self.0)
    }
    /// Member `member` of an edge cluster's etcd.
    pub fn etcd(&self, member: usize) -> String {
        format!("{}-etcd{member}", self.0)
    }
    pub fn node(&self, node: usize) -> String {
        format!("{}-n{node}", self.0)
    }
    pub fn pod(&self, node: usize, index: u32) -> String {
        format!("{}-n{node}p{index}", self.0)
    }
    pub fn client(&self, client: usize) -> String {
        format!("{}-c{client}", self.0)
    }
}

impl std::fmt::Display for RunPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The pid of the process that created a netlab namespace, or `None` when the name is not
/// one of ours (`tdm<pid>x<seq>-<role>`).
pub fn owner_pid(netns: &str) -> Option<u32> {
    let rest = netns.strip_prefix(PREFIX_HEAD)?;
    let (pid, rest) = split_digits(rest)?;
    let rest = rest.strip_prefix('x')?;
    let (_seq, rest) = split_digits(rest)?;
    let role = rest.strip_prefix('-')?;
    if role.is_empty() {
        return None;
    }
    pid.parse().ok()
}

fn split_digits(s: &str) -> Option<(&str, &str)> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    (end > 0).then(|| s.split_at(end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_pid_and_sequence() {
        let p = RunPrefix::new(4242, 7);
        assert_eq!(p.as_str(), "tdm4242x7");
        assert_eq!(p.node(2), "tdm4242x7-n2");
        assert_eq!(p.pod(2, 13), "tdm4242x7-n2p13");
        assert_eq!(owner_pid(&p.pod(2, 13)), Some(4242));
        assert_eq!(owner_pid(&p.switch()), Some(4242));
    }

    #[test]
    fn foreign_names_are_not_ours() {
        for name in [
            "",
            "tdm",
            "tdm12",
            "tdm12x",
            "tdm12x3",
            "tdm12x3-",
            "tdmx3-sw",
            "tdm12-sw",
            "foo",
            "tdm12y3-sw",
        ] {
            assert_eq!(owner_pid(name), None, "{name}");
        }
    }

    #[test]
    fn a_prefix_owns_only_its_own_namespaces() {
        let p = RunPrefix::new(12, 1);
        assert!(p.owns("tdm12x1-sw"));
        assert!(!p.owns("tdm12x11-sw"));
        assert!(!p.owns("tdm12x1"));
        assert!(!RunPrefix::new(1, 1).owns("tdm12x1-sw"));
    }

    #[test]
    fn prefixes_of_one_process_are_unique() {
        let a = RunPrefix::next_for_this_process();
        let b = RunPrefix::next_for_this_process();
        assert_ne!(a, b);
        assert_eq!(owner_pid(&a.edge()), Some(std::process::id()));
    }
}
