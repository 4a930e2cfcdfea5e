//! Network namespaces for tests that load rules into a real kernel (root only).

use std::io::Write as _;
use std::process::{Command, Stdio};

/// A network namespace of this test run, deleted on drop (also when a test panics).
pub struct Netns(String);

impl Netns {
    pub fn create(suffix: &str) -> Self {
        let name = format!("tdm{}-{suffix}", std::process::id());
        let status = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap();
        assert!(status.success(), "ip netns add {name}");
        Self(name)
    }

    pub fn run(&self, program: &str, args: &[&str], stdin: &str) -> String {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.0, program])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "{program} {args:?} failed: {}\ninput:\n{stdin}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false)
}
