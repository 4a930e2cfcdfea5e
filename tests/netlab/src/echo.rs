//! The pod echo: its reply format, where its binary is, and clients that run inside a
//! namespace (`tandem-echo get|udp` through `ip netns exec`), so tests need no curl.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::NetlabError;
use crate::netns::{Netns, checked_stdout, describe};

/// Port the pod echo serves HTTP and UDP on unless told otherwise.
pub const DEFAULT_ECHO_PORT: u16 = 8080;
/// What every client request may take at most, connect included.
pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bound on requests per client invocation.
pub const MAX_REQUESTS_PER_CALL: u32 = 10_000;
/// Env var naming the `tandem-echo` binary, for callers outside this crate's tests.
pub const ECHO_BIN_ENV: &str = "TANDEM_ECHO_BIN";
/// First line the echo server prints on stdout once both sockets are bound.
pub const READY_LINE: &str = "ready";

/// What the echo answers, over HTTP (JSON body) and UDP (JSON datagram).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EchoReply {
    /// The pod that answered.
    pub pod: String,
    /// The client address the pod saw: shows SNAT vs source-IP preservation.
    pub client: SocketAddr,
    /// The node the pod runs on, when the echo was told.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// Prefix of a failed request's line in `--count` output.
pub const ERROR_LINE_PREFIX: &str = "error: ";

/// One line of client output: a reply, or the error of that request.
pub fn parse_client_line(line: &str) -> Result<EchoReply, String> {
    match line.strip_prefix(ERROR_LINE_PREFIX) {
        Some(e) => Err(e.to_owned()),
        None => serde_json::from_str(line).map_err(|e| format!("unexpected reply {line:?}: {e}")),
    }
}

/// Where `tandem-echo` is: `$TANDEM_ECHO_BIN`, else next to the running executable
/// (`target/debug/` for binaries, `target/debug/deps/..` for tests).
pub fn echo_binary() -> Result<PathBuf, NetlabError> {
    let from_env = std::env::var_os(ECHO_BIN_ENV).map(PathBuf::from);
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf));
    let candidates = echo_binary_candidates(from_env, exe_dir);
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or(NetlabError::EchoBinaryNotFound {
            searched: candidates,
        })
}

fn echo_binary_candidates(from_env: Option<PathBuf>, exe_dir: Option<PathBuf>) -> Vec<PathBuf> {
    if let Some(p) = from_env {
        // An explicit choice is the only one: never silently fall back to another build.
        return vec![p];
    }
    let mut out = Vec::new();
    if let Some(dir) = exe_dir {
        out.push(dir.join("tandem-echo"));
        if dir.file_name().is_some_and(|n| n == "deps")
            && let Some(parent) = dir.parent()
        {
            out.push(parent.join("tandem-echo"));
        }
    }
    out
}

/// Runs `tandem-echo get|udp` inside namespaces.
#[derive(Debug, Clone)]
pub struct EchoClient {
    binary: PathBuf,
    timeout: Duration,
}

impl EchoClient {
    pub fn new(binary: impl Into<PathBuf>) -> Self {
        Self {
            binary: binary.into(),
            timeout: DEFAULT_CLIENT_TIMEOUT,
        }
    }

    /// A client using [`echo_binary`].
    pub fn locate() -> Result<Self, NetlabError> {
        Ok(Self::new(echo_binary()?))
    }

    /// Per-request timeout (connect + answer).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn argv(&self, mode: &str, target: &str, count: u32) -> Vec<String> {
        vec![
            self.binary.to_string_lossy().into_owned(),
            mode.to_owned(),
            target.to_owned(),
            "--timeout-ms".to_owned(),
            self.timeout.as_millis().to_string(),
            "--count".to_owned(),
            count.min(MAX_REQUESTS_PER_CALL).to_string(),
        ]
    }

    /// One HTTP GET from inside `ns`.
    pub fn http_get(&self, ns: &Netns, url: &str) -> Result<EchoReply, NetlabError> {
        let argv = self.argv("get", url, 1);
        single(ns, argv.clone(), ns.exec(argv))
    }

    /// One UDP request from inside `ns`.
    pub fn udp_request(&self, ns: &Netns, addr: SocketAddr) -> Result<EchoReply, NetlabError> {
        let argv = self.argv("udp", &addr.to_string(), 1);
        single(ns, argv.clone(), ns.exec(argv))
    }

    /// `count` HTTP GETs from inside `ns`, each on a new connection; one result each.
    pub fn http_get_many(
        &self,
        ns: &Netns,
        url: &str,
        count: u32,
    ) -> Result<Vec<Result<EchoReply, String>>, NetlabError> {
        many(ns.exec(self.argv("get", url, count))?)
    }

    /// `count` UDP requests from inside `ns`, each from a new source port; one result each.
    pub fn udp_request_many(
        &self,
        ns: &Netns,
        addr: SocketAddr,
        count: u32,
    ) -> Result<Vec<Result<EchoReply, String>>, NetlabError> {
        many(ns.exec(self.argv("udp", &addr.to_string(), count))?)
    }

    /// [`EchoClient::http_get`] for async code.
    pub async fn http_get_async(&self, ns: &Netns, url: &str) -> Result<EchoReply, NetlabError> {
        let argv = self.argv("get", url, 1);
        single(ns, argv.clone(), ns.exec_async(argv).await)
    }

    /// [`EchoClient::udp_request`] for async code.
    pub async fn udp_request_async(
        &self,
        ns: &Netns,
        addr: SocketAddr,
    ) -> Result<EchoReply, NetlabError> {
        let argv = self.argv("udp", &addr.to_string(), 1);
        single(ns, argv.clone(), ns.exec_async(argv).await)
    }

    /// [`EchoClient::http_get_many`] for async code.
    pub async fn http_get_many_async(
        &self,
        ns: &Netns,
        url: &str,
        count: u32,
    ) -> Result<Vec<Result<EchoReply, String>>, NetlabError> {
        many(ns.exec_async(self.argv("get", url, count)).await?)
    }

    /// [`EchoClient::udp_request_many`] for async code.
    pub async fn udp_request_many_async(
        &self,
        ns: &Netns,
        addr: SocketAddr,
        count: u32,
    ) -> Result<Vec<Result<EchoReply, String>>, NetlabError> {
        many(
            ns.exec_async(self.argv("udp", &addr.to_string(), count))
                .await?,
        )
    }
}

fn single(
    ns: &Netns,
    argv: Vec<String>,
    output: Result<Output, NetlabError>,
) -> Result<EchoReply, NetlabError> {
    let mut cmd = ns.command(&argv[0]);
    cmd.args(&argv[1..]);
    let stdout = checked_stdout(describe(&cmd), output?)?;
    let line = stdout.trim();
    serde_json::from_str(line).map_err(|source| NetlabError::EchoReply {
        output: line.to_owned(),
        source,
    })
}

fn many(output: Output) -> Result<Vec<Result<EchoReply, String>>, NetlabError> {
    // Exit status 1 only says some request failed; each line tells which.
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(parse_client_line)
        .collect())
}

/// One HTTP GET from inside `ns` with the located `tandem-echo` and default timeout.
pub fn http_get_in(ns: &Netns, url: &str) -> Result<EchoReply, NetlabError> {
    EchoClient::locate()?.http_get(ns, url)
}

/// One UDP request from inside `ns` with the located `tandem-echo` and default timeout.
pub fn udp_request_in(ns: &Netns, addr: SocketAddr) -> Result<EchoReply, NetlabError> {
    EchoClient::locate()?.udp_request(ns, addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_json_matches_the_documented_shape() {
        let reply = EchoReply {
            pod: "n1p1".into(),
            client: "10.244.2.2:40000".parse().unwrap(),
            node: None,
        };
        let json = serde_json::to_string(&reply).unwrap();
        assert_eq!(json, r#"{"pod":"n1p1","client":"10.244.2.2:40000"}"#);
        let with_node: EchoReply =
            serde_json::from_str(r#"{"pod":"p","client":"1.2.3.4:5","node":"node-1"}"#).unwrap();
        assert_eq!(with_node.node.as_deref(), Some("node-1"));
    }

    #[test]
    fn client_lines_are_replies_or_errors() {
        assert_eq!(
            parse_client_line("error: timed out"),
            Err("timed out".to_owned())
        );
        assert_eq!(
            parse_client_line(r#"{"pod":"p","client":"1.2.3.4:5"}"#)
                .unwrap()
                .pod,
            "p"
        );
        assert!(parse_client_line("garbage").is_err());
    }

    #[test]
    fn the_binary_is_looked_for_next_to_the_executable_and_its_parent_for_tests() {
        let c = echo_binary_candidates(None, Some(PathBuf::from("/t/debug/deps")));
        assert_eq!(
            c,
            [
                PathBuf::from("/t/debug/deps/tandem-echo"),
                PathBuf::from("/t/debug/tandem-echo")
            ]
        );
        let c = echo_binary_candidates(None, Some(PathBuf::from("/t/debug")));
        assert_eq!(c, [PathBuf::from("/t/debug/tandem-echo")]);
        let c = echo_binary_candidates(Some("/x/echo".into()), Some(PathBuf::from("/t/debug")));
        assert_eq!(c, [PathBuf::from("/x/echo")]);
    }

    #[test]
    fn a_missing_binary_says_how_to_build_it() {
        let err = NetlabError::EchoBinaryNotFound { searched: vec![] };
        assert!(err.to_string().contains("cargo build -p tandem-netlab"));
    }

    #[test]
    fn client_requests_are_bounded() {
        let argv = EchoClient::new("/e").argv("get", "http://x/", u32::MAX);
        assert_eq!(argv.last().unwrap(), &MAX_REQUESTS_PER_CALL.to_string());
    }
}
