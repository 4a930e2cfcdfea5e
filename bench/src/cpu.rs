//! CPU time of processes, from /proc: what a benchmark's processes used over a phase.

use anyhow::Context as _;

/// Every process's CPU time, read from /proc at one moment.
pub struct CpuTimes {
    /// `/proc/PID/stat` lines.
    stats: Vec<String>,
    ticks_per_second: f64,
}

impl CpuTimes {
    pub fn read() -> anyhow::Result<Self> {
        let mut stats = Vec::new();
        for entry in std::fs::read_dir("/proc").context("listing /proc")? {
            let Ok(entry) = entry else { continue };
            if entry.file_name().to_string_lossy().parse::<u32>().is_err() {
                continue;
            }
            // A process that exits meanwhile is in its parent's waited-for time, or gone.
            if let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) {
                stats.push(stat);
            }
        }
        let ticks_per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .filter(|ticks| *ticks > 0)
            .unwrap_or(100);
        Ok(Self {
            stats,
            ticks_per_second: ticks_per_second as f64,
        })
    }

    /// CPU seconds `pid` and its descendants had used: its own and its waited-for
    /// children's (`/proc/PID/stat`'s utime, stime, cutime and cstime), and those of the
    /// descendants still running (a restore in flight has not been waited for yet).
    pub fn seconds(&self, pid: u32) -> anyhow::Result<f64> {
        let ticks = tree_ticks(pid, &self.stats)
            .with_context(|| format!("/proc/{pid}/stat is gone or malformed"))?;
        Ok(ticks as f64 / self.ticks_per_second)
    }
}

/// [`CpuTimes::seconds`] of `pid`, read now.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    CpuTimes::read()?.seconds(pid)
}

/// The clock ticks of `root` and its live descendants among `stats` (`/proc/*/stat`
/// lines); `None` without `root`.
fn tree_ticks(root: u32, stats: &[String]) -> Option<u64> {
    let parsed: Vec<(u32, u32, u64)> = stats.iter().filter_map(|stat| parse_stat(stat)).collect();
    let mut tree = vec![root];
    let mut total = parsed.iter().find(|(pid, ..)| *pid == root)?.2;
    let mut next = 0;
    while let Some(&parent) = tree.get(next) {
        next += 1;
        for &(pid, ppid, ticks) in &parsed {
            if ppid == parent && !tree.contains(&pid) {
                tree.push(pid);
                total += ticks;
            }
        }
    }
    Some(total)
}

/// A `/proc/PID/stat` line: pid, parent pid, and utime + stime + cutime + cstime in clock
/// ticks (fields 1, 4 and 14 to 17; the command between is in parentheses and may hold
/// spaces).
fn parse_stat(stat: &str) -> Option<(u32, u32, u64)> {
    let pid = stat.split_whitespace().next()?.parse().ok()?;
    let after_command: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    let ppid = after_command.get(1)?.parse().ok()?;
    let ticks: Vec<u64> = after_command
        .get(11..15)?
        .iter()
        .map(|field| field.parse().ok())
        .collect::<Option<_>>()?;
    Some((pid, ppid, ticks.iter().sum()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_add_the_process_its_waited_children_and_its_live_descendants() {
        let stat = |pid: u32, ppid: u32, ticks: [u64; 4]| {
            format!(
                "{pid} (a (b) c) S {ppid} 1 1 0 -1 4194560 100 0 0 0 {} {} {} {} 20 0 9 0",
                ticks[0], ticks[1], ticks[2], ticks[3]
            )
        };
        let stats = [
            stat(1234, 1, [70, 30, 5, 2]),
            stat(1300, 1234, [10, 0, 0, 0]),
            stat(1301, 1300, [1, 1, 0, 0]),
            stat(999, 1, [500, 0, 0, 0]),
        ];
        assert_eq!(parse_stat(&stats[0]), Some((1234, 1, 107)));
        assert_eq!(tree_ticks(1234, &stats), Some(119));
        assert_eq!(tree_ticks(7, &stats), None);
        assert_eq!(parse_stat("1234 (x) S 1"), None);
    }
}
