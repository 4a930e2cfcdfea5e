//! HAProxy's command sockets: the master CLI (processes, reloads) and the worker's runtime
//! API (servers, statistics). Both are Unix sockets in the edge's state directory; a
//! command is one line, the answer is everything until HAProxy closes the connection.

use std::io;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::BackendHealth;

/// How long one command may take; HAProxy answers in microseconds.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends `command` (several may be joined with `;`) and returns the answer.
pub(crate) async fn send(socket: &Path, command: &str) -> io::Result<String> {
    let exchange = async {
        let mut stream = UnixStream::connect(socket).await?;
        stream.write_all(command.as_bytes()).await?;
        stream.write_all(b"\n").await?;
        // The master CLI answers only once our side is closed.
        stream.shutdown().await?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await?;
        Ok(answer)
    };
    tokio::time::timeout(COMMAND_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer to {command:?} within {COMMAND_TIMEOUT:?}"),
            ))
        })
}

/// What the master CLI's `show proc` says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Processes {
    /// Reloads that failed since the master started (`[failed: N]`).
    pub failed_reloads: u32,
    /// Current workers (not the old ones still finishing their connections).
    pub workers: Vec<u32>,
}

pub(crate) fn parse_processes(answer: &str) -> Processes {
    let mut processes = Processes::default();
    let mut section = "";
    for line in answer.lines() {
        let line = line.trim();
        if let Some(title) = line.strip_prefix('#') {
            section = title.trim();
            continue;
        }
        let mut fields = line.split_whitespace();
        let Some(pid) = fields.next().and_then(|pid| pid.parse::<u32>().ok()) else {
            continue;
        };
        match (section, fields.next()) {
            (_, Some("master")) => {
                processes.failed_reloads = line
                    .split_once("[failed:")
                    .and_then(|(_, rest)| rest.split(']').next())
                    .and_then(|count| count.trim().parse().ok())
                    .unwrap_or(0);
            }
            ("workers", Some("worker")) => processes.workers.push(pid),
            _ => {}
        }
    }
    processes
}

/// One server's state in the runtime API's `show stat`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerStat {
    pub proxy: String,
    pub server: IpAddr,
    pub health: BackendHealth,
    /// Its current sessions (`scur`; 0 where HAProxy does not say).
    pub sessions: u64,
}

/// The servers of `show stat` (frontends, backends and servers not named by an address,
/// such as the fail-open backups `open-<ip>`, are skipped). HAProxy's status words: `UP` (and `UP 1/2` while going down), `DOWN`
/// (and `DOWN 1/2` while coming up), `no check`, `MAINT`, `DRAIN`, `NOLB`.
pub(crate) fn parse_stat(answer: &str) -> Vec<ServerStat> {
    let mut lines = answer.lines();
    let Some(header) = lines.next().and_then(|line| line.strip_prefix("# ")) else {
        return Vec::new();
    };
    let column = |name: &str| header.split(',').position(|field| field == name);
    let sessions_at = column("scur");
    let (Some(proxy_at), Some(server_at), Some(status_at)) =
        (column("pxname"), column("svname"), column("status"))
    else {
        return Vec::new();
    };
    lines
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            let server = fields.get(server_at)?.parse().ok()?;
            let status = *fields.get(status_at)?;
            let health = if status.starts_with("UP") || status == "no check" {
                BackendHealth::Healthy
            } else if status.starts_with("DOWN") {
                BackendHealth::Unhealthy
            } else {
                BackendHealth::Unknown
            };
            let sessions = sessions_at
                .and_then(|at| fields.get(at)?.parse().ok())
                .unwrap_or(0);
            Some(ServerStat {
                proxy: (*fields.get(proxy_at)?).to_owned(),
                server,
                health,
                sessions,
            })
        })
        .collect()
}

/// The refusal in a runtime API answer to a server change, if it is one. The commands the
/// edge sends answer nothing or one known notice when they succeed; anything else (HAProxy
/// names what is wrong) is a refusal.
pub(crate) fn refused(answer: &str) -> Option<&str> {
    const SUCCESS: [&str; 3] = ["", "New server registered.", "Server deleted."];
    let answer = answer.trim();
    (!SUCCESS.contains(&answer)).then_some(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn show_proc_gives_current_workers_and_failed_reloads() {
        let answer = "#<PID>          <type>          <reloads>       <uptime>        <version>\n\
            7300            master          6 [failed: 1]   0d00h10m29s     2.6.12\n\
            # workers\n\
            3046            worker          0               0d00h00m02s     2.6.12\n\
            # old workers\n\
            2926            worker          1               0d00h00m05s     2.6.12\n\
            # programs\n\n";
        assert_eq!(
            parse_processes(answer),
            Processes {
                failed_reloads: 1,
                workers: vec![3046],
            }
        );
        assert_eq!(parse_processes(""), Processes::default());
    }

    #[test]
    fn show_stat_gives_the_servers_health() {
        let answer = "# pxname,svname,qcur,scur,status,weight\n\
            lb-1_80_v4,FRONTEND,,5,OPEN,\n\
            lb-1_80_v4,198.18.0.11,0,2,UP,1\n\
            lb-1_80_v4,198.18.0.12,0,0,DOWN 1/2,1\n\
            lb-1_80_v4,198.18.0.13,0,0,no check,1\n\
            lb-1_80_v4,198.18.0.14,0,3,MAINT,1\n\
            lb-1_80_v6,2001:db8:18::11,0,0,UP 1/2,1\n\
            lb-1_80_v4,open-198.18.0.12,0,0,no check,1\n\
            lb-1_80_v6,open-2001:db8:18::11,0,0,no check,1\n\
            lb-1_80_v4,BACKEND,0,5,UP,3\n";
        let health: Vec<(String, BackendHealth)> = parse_stat(answer)
            .into_iter()
            .map(|stat| (stat.server.to_string(), stat.health))
            .collect();
        // The fail-open backups (`open-<ip>`, always `no check`) are not named by an
        // address: they are skipped, and never stand for a node's health (198.18.0.12
        // stays DOWN although its backup is up).
        assert_eq!(
            health,
            [
                ("198.18.0.11".into(), BackendHealth::Healthy),
                ("198.18.0.12".into(), BackendHealth::Unhealthy),
                ("198.18.0.13".into(), BackendHealth::Healthy),
                ("198.18.0.14".into(), BackendHealth::Unknown),
                ("2001:db8:18::11".into(), BackendHealth::Healthy),
            ]
        );

        // The sessions a server carries, which a drain waits out (one in maintenance
        // still carries its own).
        let sessions: Vec<u64> = parse_stat(answer)
            .iter()
            .map(|stat| stat.sessions)
            .collect();
        assert_eq!(sessions, [2, 0, 0, 3, 0]);

        assert!(parse_stat("garbage").is_empty());
    }

    #[test]
    fn refusals_are_told_from_notices() {
        assert_eq!(refused("New server registered.\n"), None);
        assert_eq!(refused("Server deleted.\n"), None);
        assert_eq!(refused("\n"), None);
        assert!(
            refused("Backend must use a dynamic load balancing to support dynamic servers.\n")
                .is_some()
        );
        assert!(refused("No such server.\n").is_some());
        assert!(refused("Require 'backend/server'.\n").is_some());
    }
}
