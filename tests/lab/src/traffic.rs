//! Client traffic through a load balancer, and what the client saw: the measure of every
//! day-2 operation (restarts, mode switches, leader loss, API outages) is how many requests
//! failed while it happened.
//!
//! The generator is the `tandem-traffic` binary, started inside an outside client's
//! namespace: a new connection at a fixed rate, one HTTP GET on each, and one long-lived
//! connection that exchanges a message every interval. When its stdin closes, or its
//! `--duration` passes, it waits for the requests in flight and prints a [`Summary`]. The
//! lab starts it with [`Traffic::start`]; the real-node test runs the same binary.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use serde::{Deserialize, Serialize};
use tandem_common::GoDuration;
use tandem_netlab::{EchoReply, Netns};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::binaries;

const DEFAULT_RATE: u32 = 20;
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_DURATION: Duration = Duration::from_secs(300);
const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// How long the generator may take to open its long-lived connection and say it is ready.
const READY_TIMEOUT: Duration = Duration::from_secs(15);

/// The generator's flags.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "tandem-traffic",
    version,
    about = "Client traffic through a VIP: new connections at a fixed rate and one long-lived connection; prints what failed"
)]
pub struct TrafficArgs {
    /// Where the new connections go (a VIP and its port).
    #[arg(long)]
    pub target: SocketAddr,
    /// The path of each GET.
    #[arg(long, default_value = "/")]
    pub path: String,
    /// New connections per second.
    #[arg(long, default_value_t = DEFAULT_RATE, value_parser = clap::value_parser!(u32).range(1..=200))]
    pub rate: u32,
    /// What one exchange may take, connecting included.
    #[arg(long, default_value_t = GoDuration(DEFAULT_TIMEOUT))]
    pub timeout: GoDuration,
    /// The generator stops by itself after this long.
    #[arg(long, default_value_t = GoDuration(DEFAULT_DURATION))]
    pub duration: GoDuration,
    /// What the long-lived connection speaks.
    #[arg(long, value_enum, default_value_t = LongLivedProtocol::Http)]
    pub long_lived: LongLivedProtocol,
    /// Where the long-lived connection goes; the target when not given.
    #[arg(long)]
    pub long_lived_target: Option<SocketAddr>,
    /// Time between two exchanges on the long-lived connection.
    #[arg(long, default_value_t = GoDuration(DEFAULT_INTERVAL))]
    pub long_lived_interval: GoDuration,
}

/// The long-lived connection's protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LongLivedProtocol {
    /// HTTP/1.1 keep-alive: a GET of `--path` per exchange (`tandem-echo` keeps the
    /// connection open).
    Http,
    /// A line sent and the same line read back (a TCP echo such as `nc -e cat`).
    Echo,
}

impl TrafficArgs {
    /// The defaults, towards `target`.
    pub fn new(target: SocketAddr) -> Self {
        Self {
            target,
            path: "/".to_owned(),
            rate: DEFAULT_RATE,
            timeout: GoDuration(DEFAULT_TIMEOUT),
            duration: GoDuration(DEFAULT_DURATION),
            long_lived: LongLivedProtocol::Http,
            long_lived_target: None,
            long_lived_interval: GoDuration(DEFAULT_INTERVAL),
        }
    }

    /// The flags that ask the binary for exactly these settings.
    pub fn command_line(&self) -> Vec<String> {
        let mut args = vec![
            format!("--target={}", self.target),
            format!("--path={}", self.path),
            format!("--rate={}", self.rate),
            format!("--timeout={}", self.timeout),
            format!("--duration={}", self.duration),
            format!(
                "--long-lived={}",
                match self.long_lived {
                    LongLivedProtocol::Http => "http",
                    LongLivedProtocol::Echo => "echo",
                }
            ),
            format!("--long-lived-interval={}", self.long_lived_interval),
        ];
        if let Some(target) = self.long_lived_target {
            args.push(format!("--long-lived-target={target}"));
        }
        args
    }
}

/// One line of the generator's output (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Line {
    /// The long-lived connection made its first exchange (or failed to) and the stream of
    /// new connections has begun.
    Ready,
    /// The last line: everything the client saw.
    Summary(Summary),
}

/// What the client saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    pub target: SocketAddr,
    /// Requests sent on new connections.
    pub sent: u64,
    /// How long the stream ran.
    pub ran_ms: u64,
    /// The requests that failed, by the time they were sent.
    pub failures: Vec<Failure>,
    /// Answers, by the pod that gave them.
    pub by_pod: BTreeMap<String, u64>,
    pub long_lived: LongLived,
}

/// One failed exchange: when it began (since the generator started) and why it failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub at_ms: u64,
    pub error: String,
}

/// The long-lived connection: how many exchanges it made, and what broke it, if anything.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LongLived {
    pub target: SocketAddr,
    pub exchanges: u64,
    pub broken: Option<Failure>,
}

impl Summary {
    pub fn failed(&self) -> usize {
        self.failures.len()
    }

    /// Whether the long-lived connection lasted the whole run.
    pub fn long_lived_kept(&self) -> bool {
        self.long_lived.broken.is_none() && self.long_lived.exchanges > 0
    }

    /// Failures by error text, for reports.
    pub fn errors(&self) -> BTreeMap<&str, usize> {
        let mut errors = BTreeMap::new();
        for failure in &self.failures {
            *errors.entry(failure.error.as_str()).or_default() += 1;
        }
        errors
    }

    /// One line for people: sent, failed (and why), and the long-lived connection.
    pub fn describe(&self) -> String {
        let long_lived = match &self.long_lived.broken {
            None => format!("kept ({} exchanges)", self.long_lived.exchanges),
            Some(f) => format!(
                "broken at {:.1}s after {} exchanges: {}",
                f.at_ms as f64 / 1000.0,
                self.long_lived.exchanges,
                f.error
            ),
        };
        let window = match (self.failures.first(), self.failures.last()) {
            (Some(first), Some(last)) => format!(
                " (sent from {:.1}s to {:.1}s)",
                first.at_ms as f64 / 1000.0,
                last.at_ms as f64 / 1000.0
            ),
            _ => String::new(),
        };
        let mut text = format!(
            "{}: {} failed{window} of {} in {:.1}s; long-lived connection {long_lived}",
            self.target,
            self.failed(),
            self.sent,
            self.ran_ms as f64 / 1000.0
        );
        for (error, count) in self.errors() {
            text.push_str(&format!("\n    x{count}: {error}"));
        }
        text
    }
}

/// Why one exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("the peer closed the connection")]
    Closed,
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("not an HTTP/1.x response: {0:?}")]
    Malformed(String),
    #[error("not an echo reply: {0:?}")]
    NotEcho(String),
    #[error("echoed {got:?} for {sent:?}")]
    Mismatch { sent: String, got: String },
}

/// Runs the generator until `stop` fires or `--duration` passes; `ready` is called once
/// the long-lived connection made its first exchange (or failed to).
pub async fn generate(
    args: &TrafficArgs,
    stop: CancellationToken,
    ready: impl FnOnce(),
) -> Summary {
    let start = Instant::now();
    let timeout = Duration::from(args.timeout);
    let long_lived_target = args.long_lived_target.unwrap_or(args.target);
    let mut long_lived = LongLivedConnection::open(args, long_lived_target).await;
    ready();

    let run_long_lived = {
        let stop = stop.clone();
        let interval = Duration::from(args.long_lived_interval);
        async move {
            while long_lived.broken.is_none() {
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(interval) => {}
                }
                long_lived.exchange(start, timeout).await;
            }
            long_lived.into_report(long_lived_target)
        }
    };
    let long_lived = tokio::spawn(run_long_lived);

    let mut requests = JoinSet::new();
    let mut ticker = tokio::time::interval(Duration::from_secs(1) / args.rate);
    // A starved client sends late rather than in a burst.
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let deadline = tokio::time::sleep(args.duration.into());
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            () = &mut deadline => break,
            _ = ticker.tick() => {
                let at_ms = millis(start.elapsed());
                let (target, path) = (args.target, args.path.clone());
                requests.spawn(async move {
                    let outcome = within(timeout, get_on_new_connection(target, &path)).await;
                    (at_ms, outcome)
                });
            }
        }
    }
    stop.cancel();

    let mut summary = Summary {
        target: args.target,
        sent: 0,
        ran_ms: 0,
        failures: Vec::new(),
        by_pod: BTreeMap::new(),
        long_lived: LongLived {
            target: long_lived_target,
            exchanges: 0,
            broken: None,
        },
    };
    while let Some(joined) = requests.join_next().await {
        summary.sent += 1;
        match joined {
            Ok((_, Ok(pod))) => *summary.by_pod.entry(pod).or_default() += 1,
            Ok((at_ms, Err(e))) => summary.failures.push(Failure {
                at_ms,
                error: e.to_string(),
            }),
            Err(e) => summary.failures.push(Failure {
                at_ms: millis(start.elapsed()),
                error: format!("request task: {e}"),
            }),
        }
    }
    summary.failures.sort_by_key(|f| f.at_ms);
    summary.long_lived = long_lived.await.unwrap_or_else(|e| LongLived {
        target: long_lived_target,
        exchanges: 0,
        broken: Some(Failure {
            at_ms: millis(start.elapsed()),
            error: format!("long-lived task: {e}"),
        }),
    });
    summary.ran_ms = millis(start.elapsed());
    summary
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

async fn within<T>(
    timeout: Duration,
    work: impl Future<Output = Result<T, ExchangeError>>,
) -> Result<T, ExchangeError> {
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or(Err(ExchangeError::Timeout(timeout)))
}

/// One GET on a connection of its own; the pod that answered.
async fn get_on_new_connection(target: SocketAddr, path: &str) -> Result<String, ExchangeError> {
    let (status, body) = http_get(target, path).await?;
    answer(status, &body)
}

/// One HTTP GET on a connection of its own: the status and the body.
pub async fn http_get(target: SocketAddr, path: &str) -> Result<(u16, String), ExchangeError> {
    let stream = TcpStream::connect(target)
        .await
        .map_err(ExchangeError::Connect)?;
    let mut stream = BufReader::new(stream);
    stream
        .get_mut()
        .write_all(get_request(target, path, false).as_bytes())
        .await?;
    read_response(&mut stream).await
}

fn get_request(target: SocketAddr, path: &str, keep_alive: bool) -> String {
    let connection = if keep_alive { "keep-alive" } else { "close" };
    format!("GET {path} HTTP/1.1\r\nHost: {target}\r\nConnection: {connection}\r\n\r\n")
}

/// The pod named by a 200 answer.
fn answer(status: u16, body: &str) -> Result<String, ExchangeError> {
    if status != 200 {
        return Err(ExchangeError::Status(status));
    }
    answering_pod(body).ok_or_else(|| ExchangeError::NotEcho(body.to_owned()))
}

/// The pod an echo answer names: `tandem-echo`'s JSON reply, or the `pod=NAME` line of the
/// real-node test's busybox echo.
pub fn answering_pod(body: &str) -> Option<String> {
    if let Ok(reply) = serde_json::from_str::<EchoReply>(body) {
        return Some(reply.pod);
    }
    body.split_whitespace()
        .find_map(|word| word.strip_prefix("pod="))
        .filter(|pod| !pod.is_empty())
        .map(str::to_owned)
}

/// Reads one HTTP/1.x response: its status, and its body (by `Content-Length`, else up to
/// the end of the connection).
async fn read_response<R: AsyncBufRead + Unpin>(
    reader: &mut R,
) -> Result<(u16, String), ExchangeError> {
    let mut head = String::new();
    loop {
        let before = head.len();
        if reader.read_line(&mut head).await? == 0 {
            return Err(if head.is_empty() {
                ExchangeError::Closed
            } else {
                ExchangeError::Malformed(head)
            });
        }
        if head[before..].trim_end().is_empty() {
            break;
        }
    }
    let (status, length) = parse_head(&head)?;
    let mut body = Vec::new();
    match length {
        Some(length) => {
            body.resize(length, 0);
            reader.read_exact(&mut body).await?;
        }
        None => {
            reader.read_to_end(&mut body).await?;
        }
    }
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The status and `Content-Length` of a response head.
fn parse_head(head: &str) -> Result<(u16, Option<usize>), ExchangeError> {
    let malformed = || ExchangeError::Malformed(head.to_owned());
    let mut lines = head.lines();
    let status = lines
        .next()
        .filter(|line| line.starts_with("HTTP/1."))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(malformed)?;
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.trim().parse().map_err(|_| malformed())?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            // Neither echo sends chunked answers; reading one as plain text would be wrong.
            return Err(malformed());
        }
    }
    Ok((status, length))
}

/// The long-lived connection and how it has fared.
struct LongLivedConnection {
    protocol: LongLivedProtocol,
    path: String,
    stream: Option<BufReader<TcpStream>>,
    exchanges: u64,
    broken: Option<Failure>,
}

impl LongLivedConnection {
    /// Connects and makes the first exchange.
    async fn open(args: &TrafficArgs, target: SocketAddr) -> Self {
        let start = Instant::now();
        let timeout = Duration::from(args.timeout);
        let mut connection = Self {
            protocol: args.long_lived,
            path: args.path.clone(),
            stream: None,
            exchanges: 0,
            broken: None,
        };
        match within(timeout, async {
            TcpStream::connect(target)
                .await
                .map_err(ExchangeError::Connect)
        })
        .await
        {
            Ok(stream) => {
                connection.stream = Some(BufReader::new(stream));
                connection.exchange(start, timeout).await;
            }
            Err(e) => {
                connection.broken = Some(Failure {
                    at_ms: 0,
                    error: e.to_string(),
                })
            }
        }
        connection
    }

    /// One message and its answer; the first failure breaks the connection for good.
    async fn exchange(&mut self, start: Instant, timeout: Duration) {
        let Some(stream) = self.stream.as_mut() else {
            return;
        };
        let at_ms = millis(start.elapsed());
        let sequence = self.exchanges;
        let (protocol, path) = (self.protocol, self.path.as_str());
        let outcome = within(timeout, async {
            match protocol {
                LongLivedProtocol::Http => {
                    let target = stream.get_ref().peer_addr()?;
                    stream
                        .get_mut()
                        .write_all(get_request(target, path, true).as_bytes())
                        .await?;
                    let (status, body) = read_response(stream).await?;
                    answer(status, &body).map(drop)
                }
                LongLivedProtocol::Echo => {
                    let sent = format!("tandem-traffic {sequence}\n");
                    stream.get_mut().write_all(sent.as_bytes()).await?;
                    let mut got = String::new();
                    if stream.read_line(&mut got).await? == 0 {
                        return Err(ExchangeError::Closed);
                    }
                    if got == sent {
                        Ok(())
                    } else {
                        Err(ExchangeError::Mismatch { sent, got })
                    }
                }
            }
        })
        .await;
        match outcome {
            Ok(()) => self.exchanges += 1,
            Err(e) => {
                self.stream = None;
                self.broken = Some(Failure {
                    at_ms,
                    error: e.to_string(),
                });
            }
        }
    }

    fn into_report(self, target: SocketAddr) -> LongLived {
        LongLived {
            target,
            exchanges: self.exchanges,
            broken: self.broken,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TrafficError {
    #[error("starting tandem-traffic: {0}")]
    Binary(#[from] binaries::BinaryNotFound),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("tandem-traffic towards {target} ended without {what}; its log {log}:\n{tail}")]
    Ended {
        target: SocketAddr,
        what: &'static str,
        log: PathBuf,
        tail: String,
    },
    #[error(
        "tandem-traffic towards {target} was not ready within {READY_TIMEOUT:?}; its log {log}:\n{tail}"
    )]
    NotReady {
        target: SocketAddr,
        log: PathBuf,
        tail: String,
    },
    #[error("tandem-traffic printed {line:?}: {source}")]
    Line {
        line: String,
        source: serde_json::Error,
    },
}

/// A running generator; dropping it kills the process.
pub struct Traffic {
    target: SocketAddr,
    log: PathBuf,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: tokio::io::Lines<BufReader<ChildStdout>>,
    /// When it became ready: its failures' `at_ms` count from about here.
    pub started: Instant,
}

impl Traffic {
    /// Starts `tandem-traffic` in `netns` (its stderr to `log`) and waits until it is ready.
    pub async fn start(
        netns: &Netns,
        args: &TrafficArgs,
        log: &Path,
    ) -> Result<Self, TrafficError> {
        let io = |context: &str| {
            let context = context.to_owned();
            move |source| TrafficError::Io { context, source }
        };
        let stderr = std::fs::File::create(log).map_err(io("creating the traffic log"))?;
        let mut command = netns.tokio_command(binaries::locate("tandem-traffic")?);
        command
            .args(args.command_line())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let mut child = command.spawn().map_err(io("starting tandem-traffic"))?;
        let started = Instant::now();
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(TrafficError::Io {
                context: "tandem-traffic's pipes".to_owned(),
                source: std::io::Error::other("not piped"),
            });
        };
        let mut traffic = Self {
            target: args.target,
            log: log.to_owned(),
            child,
            stdin: Some(stdin),
            lines: BufReader::new(stdout).lines(),
            started,
        };
        match tokio::time::timeout(READY_TIMEOUT, traffic.next_line("its ready line")).await {
            Ok(Ok(Line::Ready)) => {
                traffic.started = Instant::now();
                Ok(traffic)
            }
            Ok(Ok(Line::Summary(_))) => Err(traffic.ended("its ready line")),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TrafficError::NotReady {
                target: traffic.target,
                log: traffic.log.clone(),
                tail: log_tail(&traffic.log),
            }),
        }
    }

    /// Stops every stream of `all` and returns what their clients saw, in their order.
    pub async fn stop_all(all: Vec<Self>) -> Result<Vec<Summary>, TrafficError> {
        let mut summaries = Vec::new();
        for traffic in all {
            summaries.push(traffic.stop().await?);
        }
        Ok(summaries)
    }

    /// Stops the stream and returns what the client saw.
    pub async fn stop(mut self) -> Result<Summary, TrafficError> {
        // Closing stdin is the generator's signal to stop.
        drop(self.stdin.take());
        let line = self.next_line("a summary").await?;
        let _ = self.child.wait().await;
        match line {
            Line::Summary(summary) => Ok(summary),
            Line::Ready => Err(self.ended("a summary")),
        }
    }

    async fn next_line(&mut self, what: &'static str) -> Result<Line, TrafficError> {
        let line = self
            .lines
            .next_line()
            .await
            .map_err(|source| TrafficError::Io {
                context: "reading tandem-traffic's output".to_owned(),
                source,
            })?
            .ok_or_else(|| self.ended(what))?;
        serde_json::from_str(&line).map_err(|source| TrafficError::Line { line, source })
    }

    fn ended(&self, what: &'static str) -> TrafficError {
        TrafficError::Ended {
            target: self.target,
            what,
            log: self.log.clone(),
            tail: log_tail(&self.log),
        }
    }
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_name_their_pod_in_either_echo_format() {
        assert_eq!(
            answering_pod(r#"{"pod":"n1p1","client":"198.18.0.11:4000"}"#).as_deref(),
            Some("n1p1")
        );
        assert_eq!(
            answering_pod("pod=echo-5d8f client=10.244.0.1\n").as_deref(),
            Some("echo-5d8f")
        );
        assert_eq!(answering_pod("<html>bad gateway</html>"), None);
        assert_eq!(answering_pod("pod= client=x"), None);
    }

    #[test]
    fn response_heads_give_status_and_length() {
        assert_eq!(
            parse_head("HTTP/1.1 200 OK\r\ncontent-length: 42\r\n\r\n").unwrap(),
            (200, Some(42))
        );
        assert_eq!(
            parse_head("HTTP/1.0 503 Service Unavailable\r\n\r\n").unwrap(),
            (503, None)
        );
        for bad in [
            "SSH-2.0-OpenSSH\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            assert!(parse_head(bad).is_err(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn responses_are_read_by_length_or_to_the_end() {
        let mut framed: &[u8] =
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi";
        assert_eq!(
            read_response(&mut framed).await.unwrap(),
            (200, "hello".to_owned())
        );
        assert_eq!(
            read_response(&mut framed).await.unwrap(),
            (200, "hi".to_owned())
        );
        assert!(matches!(
            read_response(&mut framed).await,
            Err(ExchangeError::Closed)
        ));
        let mut unframed: &[u8] = b"HTTP/1.0 200 OK\r\n\r\npod=a client=b\n";
        assert_eq!(
            read_response(&mut unframed).await.unwrap(),
            (200, "pod=a client=b\n".to_owned())
        );
    }

    #[test]
    fn the_command_line_asks_for_the_same_settings() {
        let mut args = TrafficArgs::new("198.51.100.1:80".parse().unwrap());
        args.long_lived = LongLivedProtocol::Echo;
        args.long_lived_target = Some("198.51.100.1:9000".parse().unwrap());
        args.rate = 5;
        let parsed = TrafficArgs::try_parse_from(
            std::iter::once("tandem-traffic".to_owned()).chain(args.command_line()),
        )
        .unwrap();
        assert_eq!(parsed.command_line(), args.command_line());
        assert_eq!(parsed.rate, 5);
        assert_eq!(parsed.timeout, GoDuration(DEFAULT_TIMEOUT));
    }

    #[test]
    fn cli_definition_is_valid() {
        use clap::CommandFactory;
        TrafficArgs::command().debug_assert();
    }

    /// The generator against an in-process keep-alive HTTP echo on loopback: every request
    /// answered, the long-lived connection kept, then a closed port failing both.
    #[tokio::test]
    async fn the_generator_counts_answers_and_failures() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            loop {
                let Ok((stream, client)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let mut stream = BufReader::new(stream);
                    let mut line = String::new();
                    loop {
                        line.clear();
                        match stream.read_line(&mut line).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) if line == "\r\n" => {
                                let body = format!(r#"{{"pod":"p1","client":"{client}"}}"#);
                                let answer = format!(
                                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                                    body.len()
                                );
                                if stream.get_mut().write_all(answer.as_bytes()).await.is_err() {
                                    return;
                                }
                            }
                            Ok(_) => {}
                        }
                    }
                });
            }
        });
        let mut args = TrafficArgs::new(target);
        args.rate = 50;
        args.long_lived_interval = GoDuration(Duration::from_millis(100));
        let stop = CancellationToken::new();
        let stopper = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            stopper.cancel();
        });
        let summary = generate(&args, stop, || {}).await;
        assert_eq!(summary.failed(), 0, "{}", summary.describe());
        assert!(summary.sent >= 10, "{}", summary.describe());
        assert_eq!(summary.by_pod["p1"], summary.sent);
        assert!(summary.long_lived_kept(), "{}", summary.describe());

        server.abort();
        let _ = server.await;
        args.duration = GoDuration(Duration::from_millis(300));
        let summary = generate(&args, CancellationToken::new(), || {}).await;
        assert_eq!(summary.failed() as u64, summary.sent);
        assert!(summary.sent > 0);
        assert!(!summary.long_lived_kept());
    }
}
