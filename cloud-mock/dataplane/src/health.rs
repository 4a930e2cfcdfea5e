//! Health checks: one probe task per (backend IP, health check), shared by every listener
//! and load balancer that checks the same thing.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::{BackendHealth, HealthCheck};

/// What one probe task checks.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ProbeTarget {
    pub ip: IpAddr,
    pub check: HealthCheck,
}

/// Health of one target as a sequence of probe results makes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProbeState {
    pub health: BackendHealth,
    /// Consecutive results that disagree with `health`.
    contrary: u32,
}

impl Default for ProbeState {
    fn default() -> Self {
        Self {
            health: BackendHealth::Unknown,
            contrary: 0,
        }
    }
}

impl ProbeState {
    /// The first result decides at once (so a restarted data plane serves again after one
    /// probe); after that a change needs `threshold` consecutive contrary results.
    pub fn observe(self, passed: bool, healthy_threshold: u32, unhealthy_threshold: u32) -> Self {
        let (verdict, threshold) = if passed {
            (BackendHealth::Healthy, healthy_threshold)
        } else {
            (BackendHealth::Unhealthy, unhealthy_threshold)
        };
        if self.health == BackendHealth::Unknown || self.health == verdict {
            return Self {
                health: verdict,
                contrary: 0,
            };
        }
        let contrary = self.contrary + 1;
        if contrary >= threshold.max(1) {
            Self {
                health: verdict,
                contrary: 0,
            }
        } else {
            Self {
                health: self.health,
                contrary,
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Which probe task owns the entry, so a cancelled task never overwrites its successor.
    generation: u64,
    health: BackendHealth,
}

/// Current health of every probed target, shared by listeners, the route manager and
/// `backend_health`. Short critical sections only; never held across an await.
#[derive(Debug, Clone, Default)]
pub(crate) struct HealthTable {
    entries: Arc<RwLock<HashMap<ProbeTarget, Entry>>>,
    changed: Arc<Notify>,
}

impl HealthTable {
    /// The backends that serve under `check`, in the given order: the healthy ones, or all
    /// of them when none is healthy. Cloud load balancers fail open so (an AWS NLB, a GCP
    /// backend service): a check failing on every backend at once says more about the
    /// check, or a node agent being restarted, than about the backends, and dropping
    /// everything would turn a one-node rollout into an outage.
    pub fn serving(&self, backends: &[IpAddr], check: Option<&HealthCheck>) -> Vec<IpAddr> {
        let Some(check) = check else {
            return backends.to_vec();
        };
        let entries = self.entries.read().unwrap_or_else(PoisonError::into_inner);
        let healthy: Vec<IpAddr> = backends
            .iter()
            .copied()
            .filter(|&ip| {
                let target = ProbeTarget {
                    ip,
                    check: check.clone(),
                };
                entries
                    .get(&target)
                    .is_some_and(|entry| entry.health == BackendHealth::Healthy)
            })
            .collect();
        if healthy.is_empty() {
            backends.to_vec()
        } else {
            healthy
        }
    }

    pub fn get(&self, target: &ProbeTarget) -> BackendHealth {
        self.entries
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(target)
            .map_or(BackendHealth::Unknown, |entry| entry.health)
    }

    pub fn track(&self, target: ProbeTarget, generation: u64) {
        self.entries
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                target,
                Entry {
                    generation,
                    health: BackendHealth::Unknown,
                },
            );
    }

    pub fn forget(&self, target: &ProbeTarget) {
        self.entries
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(target);
    }

    fn record(&self, target: &ProbeTarget, generation: u64, health: BackendHealth) {
        let mut entries = self.entries.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = entries.get_mut(target)
            && entry.generation == generation
        {
            entry.health = health;
            drop(entries);
            self.changed.notify_one();
        }
    }

    /// Signalled after any health change (one waiter: the route manager).
    pub fn changed(&self) -> Arc<Notify> {
        Arc::clone(&self.changed)
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct ProbeSettings {
    pub interval: Duration,
    pub timeout: Duration,
    pub healthy_threshold: u32,
    pub unhealthy_threshold: u32,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ProbeFailure {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("answer is not HTTP/1.x")]
    Malformed,
    #[error("health check path {0:?} is not a valid request target")]
    InvalidPath(String),
}

/// Probes `target` every interval until cancelled, publishing health changes.
pub(crate) async fn run_checker(
    target: ProbeTarget,
    generation: u64,
    table: HealthTable,
    settings: ProbeSettings,
    metrics: Metrics,
    cancel: CancellationToken,
) {
    let mut ticker = tokio::time::interval(settings.interval.max(Duration::from_millis(1)));
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut state = ProbeState::default();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let result = tokio::select! {
            () = cancel.cancelled() => return,
            result = probe(&target, settings.timeout) => result,
        };
        metrics.health_check(&target.check, result.is_ok());
        let next = state.observe(
            result.is_ok(),
            settings.healthy_threshold,
            settings.unhealthy_threshold,
        );
        if next.health != state.health {
            match &result {
                Ok(()) => info!(backend = %target.ip, check = ?target.check, "backend healthy"),
                Err(failure) => {
                    warn!(backend = %target.ip, check = ?target.check, %failure, "backend unhealthy");
                }
            }
            table.record(&target, generation, next.health);
        }
        state = next;
    }
}

pub(crate) async fn probe(target: &ProbeTarget, timeout: Duration) -> Result<(), ProbeFailure> {
    tokio::time::timeout(timeout, probe_once(target))
        .await
        .unwrap_or(Err(ProbeFailure::Timeout(timeout)))
}

async fn probe_once(target: &ProbeTarget) -> Result<(), ProbeFailure> {
    match &target.check {
        HealthCheck::Tcp { port } => {
            TcpStream::connect((target.ip, *port)).await?;
            Ok(())
        }
        HealthCheck::Http { port, path } => {
            let request = http_request(target.ip, *port, path)
                .ok_or_else(|| ProbeFailure::InvalidPath(path.clone()))?;
            let mut stream = TcpStream::connect((target.ip, *port)).await?;
            stream.write_all(request.as_bytes()).await?;
            let head = read_status_line(&mut stream).await?;
            match parse_status_code(&head) {
                Some(200) => Ok(()),
                Some(code) => Err(ProbeFailure::Status(code)),
                None => Err(ProbeFailure::Malformed),
            }
        }
    }
}

/// Longest status line we read; a real one is ~20 bytes.
const MAX_STATUS_LINE: usize = 1024;

async fn read_status_line(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut head = Vec::with_capacity(128);
    let mut chunk = [0_u8; 256];
    while !head.contains(&b'\n') && head.len() < MAX_STATUS_LINE {
        let read = stream.read(&mut chunk).await?;
        if read == 0 {
            break;
        }
        head.extend_from_slice(&chunk[..read]);
    }
    Ok(head)
}

/// The probe request, or `None` when `path` could smuggle extra request text.
pub(crate) fn http_request(ip: IpAddr, port: u16, path: &str) -> Option<String> {
    if path.bytes().any(|b| b.is_ascii_control() || b == b' ') {
        return None;
    }
    let path = if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("/{path}")
    };
    // As a socket address, an IPv6 host is bracketed: `[2001:db8::1]:10256`.
    let host = std::net::SocketAddr::new(ip, port);
    Some(format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: cloud-mock-health-check\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    ))
}

/// Status code of an HTTP/1.x status line at the start of `head`.
pub(crate) fn parse_status_code(head: &[u8]) -> Option<u16> {
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    let line = std::str::from_utf8(&head[..line_end]).ok()?;
    let mut parts = line.split_ascii_whitespace();
    let version = parts.next()?;
    let code = parts.next()?;
    if !version.starts_with("HTTP/1.")
        || code.len() != 3
        || !code.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    code.parse().ok()
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn run(results: &[bool], healthy: u32, unhealthy: u32) -> Vec<BackendHealth> {
        let mut state = ProbeState::default();
        results
            .iter()
            .map(|&passed| {
                state = state.observe(passed, healthy, unhealthy);
                state.health
            })
            .collect()
    }

    use BackendHealth::{Healthy as H, Unhealthy as U};

    #[test]
    fn first_result_decides_at_once() {
        assert_eq!(run(&[true], 3, 3), vec![H]);
        assert_eq!(run(&[false], 3, 3), vec![U]);
    }

    #[test]
    fn change_needs_threshold_consecutive_results() {
        assert_eq!(run(&[true, false, false, false], 2, 3), vec![H, H, H, U]);
        assert_eq!(run(&[false, true, true], 2, 3), vec![U, U, H]);
    }

    #[test]
    fn an_agreeing_result_resets_the_streak() {
        assert_eq!(
            run(&[true, false, true, false, true, false, false], 2, 2),
            vec![H, H, H, H, H, H, U]
        );
    }

    #[test]
    fn zero_threshold_acts_as_one() {
        assert_eq!(run(&[true, false, true], 0, 0), vec![H, U, H]);
    }

    #[test]
    fn status_codes_parse() {
        assert_eq!(
            parse_status_code(b"HTTP/1.1 200 OK\r\nServer: x\r\n"),
            Some(200)
        );
        assert_eq!(
            parse_status_code(b"HTTP/1.0 503 Service Unavailable\r\n"),
            Some(503)
        );
        assert_eq!(parse_status_code(b"HTTP/1.1 200"), Some(200));
        assert_eq!(parse_status_code(b"HTTP/2 200\r\n"), None);
        assert_eq!(parse_status_code(b"SSH-2.0-OpenSSH\r\n"), None);
        assert_eq!(parse_status_code(b"HTTP/1.1 20\r\n"), None);
        assert_eq!(parse_status_code(b"HTTP/1.1 2000 OK\r\n"), None);
        assert_eq!(parse_status_code(b""), None);
        assert_eq!(parse_status_code(b"\xff\xfe 200\r\n"), None);
    }

    #[test]
    fn request_is_plain_http11_and_refuses_injection() {
        let request = http_request(Ipv4Addr::new(198, 18, 0, 11).into(), 10256, "/healthz");
        assert_eq!(
            request.as_deref(),
            Some(
                "GET /healthz HTTP/1.1\r\nHost: 198.18.0.11:10256\r\nUser-Agent: cloud-mock-health-check\r\nAccept: */*\r\nConnection: close\r\n\r\n"
            )
        );
        assert!(
            http_request(Ipv4Addr::LOCALHOST.into(), 1, "healthz")
                .is_some_and(|r| r.starts_with("GET /healthz "))
        );
        assert_eq!(
            http_request(Ipv4Addr::LOCALHOST.into(), 1, "/a\r\nX: y"),
            None
        );
        assert_eq!(http_request(Ipv4Addr::LOCALHOST.into(), 1, "/a b"), None);
        let v6 = http_request("2001:db8:18::11".parse().unwrap(), 10256, "/healthz");
        assert!(
            v6.is_some_and(|r| r.contains("\r\nHost: [2001:db8:18::11]:10256\r\n")),
            "an IPv6 host is bracketed"
        );
    }

    /// A server on 127.0.0.1 that answers each connection with `answer` (or never).
    async fn server(answer: Option<&'static str>) -> (u16, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut request = [0_u8; 512];
                let _ = stream.read(&mut request).await;
                if let Some(answer) = answer {
                    let _ = stream.write_all(answer.as_bytes()).await;
                } else {
                    open.push(stream);
                }
            }
        });
        (port, task)
    }

    fn http(port: u16) -> ProbeTarget {
        ProbeTarget {
            ip: Ipv4Addr::LOCALHOST.into(),
            check: HealthCheck::Http {
                port,
                path: "/healthz".to_owned(),
            },
        }
    }

    #[tokio::test]
    async fn probes_pass_on_200_only_and_time_out() {
        let timeout = Duration::from_millis(300);
        let (ok, _a) = server(Some("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")).await;
        let (unavailable, _b) = server(Some("HTTP/1.1 503 Service Unavailable\r\n\r\n")).await;
        let (junk, _c) = server(Some("hello\n")).await;
        let (silent, _d) = server(None).await;
        assert!(probe(&http(ok), timeout).await.is_ok());
        assert!(matches!(
            probe(&http(unavailable), timeout).await,
            Err(ProbeFailure::Status(503))
        ));
        assert!(matches!(
            probe(&http(junk), timeout).await,
            Err(ProbeFailure::Malformed)
        ));
        assert!(matches!(
            probe(&http(silent), timeout).await,
            Err(ProbeFailure::Timeout(_))
        ));
        let tcp = |port| ProbeTarget {
            ip: Ipv4Addr::LOCALHOST.into(),
            check: HealthCheck::Tcp { port },
        };
        assert!(
            probe(&tcp(silent), timeout).await.is_ok(),
            "TCP check needs a connect only"
        );
        let closed = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let closed_port = closed.local_addr().unwrap().port();
        drop(closed);
        assert!(matches!(
            probe(&tcp(closed_port), timeout).await,
            Err(ProbeFailure::Io(_))
        ));
    }

    #[test]
    fn table_ignores_results_of_a_replaced_probe() {
        let table = HealthTable::default();
        let target = ProbeTarget {
            ip: Ipv4Addr::LOCALHOST.into(),
            check: HealthCheck::Tcp { port: 1 },
        };
        table.track(target.clone(), 1);
        table.track(target.clone(), 2);
        table.record(&target, 1, BackendHealth::Healthy);
        assert_eq!(table.get(&target), BackendHealth::Unknown);
        table.record(&target, 2, BackendHealth::Healthy);
        assert_eq!(table.get(&target), BackendHealth::Healthy);
        table.forget(&target);
        assert_eq!(table.get(&target), BackendHealth::Unknown);
        let (a, b) = (
            IpAddr::from(Ipv4Addr::LOCALHOST),
            IpAddr::from([127, 0, 0, 2]),
        );
        assert_eq!(table.serving(&[a], None), vec![a], "nothing checks it");
        assert_eq!(
            table.serving(&[a, b], Some(&target.check)),
            vec![a, b],
            "none healthy: all serve (fail open)"
        );
        let b_target = ProbeTarget {
            ip: b,
            check: target.check.clone(),
        };
        table.track(b_target.clone(), 1);
        table.record(&b_target, 1, BackendHealth::Healthy);
        assert_eq!(table.serving(&[a, b], Some(&target.check)), vec![b]);
    }
}
