//! The summary at the top of the report, made from the tables of its blocks: each
//! section's run and targets met, every missed row, and a few headline rows quoted cell
//! for cell. It is made from the file rather than from one run's results because the
//! file's blocks come from different runs (a run of one benchmark replaces one block), and
//! because a test can then check the checked-in file: a hand edit of the summary or of a
//! table that makes them disagree fails it.

use std::fmt::Write as _;

use super::{MarkerError, RUN_PREFIX, TABLE_HEADER, spans};

/// The report's block that holds the summary.
pub const BLOCK: &str = "summary";
/// Blocks without tables of results.
const NOT_RESULTS: [&str; 2] = [BLOCK, super::HEADER_BLOCK];

/// The rows quoted beside the misses: (a section's title begins with, a row's `what`
/// contains). Of rows with the same `what` in a section (one figure against several
/// limits) only the first, the one held to a target, is quoted.
const HEADLINES: &[(&str, &str)] = &[
    (
        "Node proxy sync — ",
        "first sync, 2,700 LoadBalancer × 10, absolute",
    ),
    (
        "Node proxy sync — nf_tables",
        "one endpoint added, 2,700 LoadBalancer × 10 (",
    ),
    (
        "Node proxy sync — legacy",
        "one endpoint added, 2,700 LoadBalancer × 10 (",
    ),
    (
        "Node proxy sync — nftables",
        "one endpoint added, 2,700 LoadBalancer × 10 (",
    ),
    (
        "Node proxy sync — ",
        "our own time per change, 2,700 LoadBalancer",
    ),
    (
        "Node proxy sync — ",
        "network programming latency p99, 2,700",
    ),
    ("Node proxy sync — ", "peak RSS"),
    (
        "Node proxy sync — nftables",
        "one endpoint added, 10,000 ClusterIP × 10 (",
    ),
    (
        "Node proxy sync — nftables",
        "flat in the number of Services",
    ),
    ("Node proxy sync — nftables", "first-packet latency"),
    (
        "Controller:",
        "Services created at once: all have an ingress IP",
    ),
    ("Controller:", "cloud calls per Service, create path"),
    ("Controller:", "cloud calls after"),
    ("Controller:", "node added: cloud calls in all"),
    ("Data plane: throughput", "throughput, passthrough"),
    ("Data plane: throughput", "throughput, IPv6 passthrough"),
    (
        "Data plane: throughput",
        "throughput, proxy-mode VIP (own edge)",
    ),
    ("Data plane: latency", "p50 request, passthrough"),
    (
        "Data plane: latency",
        "p50 request, proxy-mode VIP (own edge)",
    ),
    ("Cloud edges:", "failed requests"),
    ("Cloud edges:", "p99 create"),
];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SummaryError {
    #[error(transparent)]
    Markers(#[from] MarkerError),
    #[error("block \"{block}\": a table row of {cells} cells where 6 were expected: {line}")]
    MalformedRow {
        block: String,
        line: String,
        cells: usize,
    },
    #[error("block \"{block}\": a table row outside any `### ` section: {line}")]
    RowOutsideSection { block: String, line: String },
    #[error("block \"{block}\" has no line beginning `{RUN_PREFIX}YYYY-MM-DD:` to say when it ran")]
    NoRun { block: String },
}

/// One row of a results table, cell for cell as the file shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableRow {
    pub what: String,
    pub ours: String,
    pub limit: String,
    pub ratio: String,
    pub target: String,
    /// "met", "MISSED" or "—".
    pub verdict: String,
}

impl TableRow {
    fn has_target(&self) -> bool {
        self.target != "—"
    }

    fn missed(&self) -> bool {
        self.verdict == "MISSED"
    }
}

/// One section's table and the day of the run its block names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    pub title: String,
    pub run: String,
    pub rows: Vec<TableRow>,
}

impl Table {
    /// The title up to its colon or parenthesis: "Data plane", "Node proxy sync — legacy".
    fn short_title(&self) -> &str {
        let end = self.title.find([':', '(']).unwrap_or(self.title.len());
        self.title[..end].trim_end()
    }
}

/// Every results table in the document's blocks, in order (the summary's and the
/// header's blocks, and anything outside a block, are not results).
pub fn tables(document: &str) -> Result<Vec<Table>, SummaryError> {
    let mut tables = Vec::new();
    for span in spans(document)? {
        if NOT_RESULTS.contains(&span.name.as_str()) {
            continue;
        }
        tables.extend(block_tables(&span.name, &document[span.body])?);
    }
    Ok(tables)
}

fn block_tables(block: &str, body: &str) -> Result<Vec<Table>, SummaryError> {
    let run = body
        .lines()
        .find_map(|line| line.strip_prefix(RUN_PREFIX)?.split_once(':'))
        .map(|(date, _)| date.trim().to_owned())
        .ok_or_else(|| SummaryError::NoRun {
            block: block.to_owned(),
        })?;
    let mut tables: Vec<Table> = Vec::new();
    let mut in_table = false;
    for line in body.lines() {
        let line = line.trim_end();
        if let Some(title) = line.strip_prefix("### ") {
            tables.push(Table {
                title: title.to_owned(),
                run: run.clone(),
                rows: Vec::new(),
            });
            in_table = false;
        } else if line == TABLE_HEADER {
            in_table = true;
        } else if in_table && line.starts_with("|---") {
            continue;
        } else if in_table && line.starts_with('|') {
            let row = parse_row(block, line)?;
            let Some(table) = tables.last_mut() else {
                return Err(SummaryError::RowOutsideSection {
                    block: block.to_owned(),
                    line: line.to_owned(),
                });
            };
            table.rows.push(row);
        } else {
            in_table = false;
        }
    }
    Ok(tables)
}

fn parse_row(block: &str, line: &str) -> Result<TableRow, SummaryError> {
    let inner = line
        .strip_prefix('|')
        .and_then(|l| l.strip_suffix('|'))
        .unwrap_or(line);
    let cells: Vec<String> = inner.split('|').map(|c| c.trim().to_owned()).collect();
    match <[String; 6]>::try_from(cells) {
        Ok([what, ours, limit, ratio, target, verdict]) => Ok(TableRow {
            what,
            ours,
            limit,
            ratio,
            target,
            verdict,
        }),
        Err(cells) => Err(SummaryError::MalformedRow {
            block: block.to_owned(),
            line: line.to_owned(),
            cells: cells.len(),
        }),
    }
}

/// The summary's block body, made from the document's tables.
pub fn summary(document: &str) -> Result<String, SummaryError> {
    Ok(render(&tables(document)?))
}

fn render(tables: &[Table]) -> String {
    let rows = tables.iter().flat_map(|t| &t.rows);
    let targets = rows.clone().filter(|r| r.has_target()).count();
    let missed = rows.filter(|r| r.missed()).count();
    let mut out = format!(
        "## Summary\n\nMade by `tandem-bench` from the tables below, each section from the run its \
         block's first line names; `tandem-bench summary` makes it again after a table is edited \
         by hand, and a test fails when it disagrees with them. {} of {targets} targets met.\n\n\
         | section | run | targets | met | missed |\n|---|---|---|---|---|\n",
        targets - missed
    );
    for table in tables {
        let targets = table.rows.iter().filter(|r| r.has_target()).count();
        let missed = table.rows.iter().filter(|r| r.missed()).count();
        let _ = writeln!(
            out,
            "| {} | {} | {targets} | {} | {missed} |",
            table.title,
            table.run,
            targets - missed
        );
    }
    if missed > 0 {
        out.push_str("\nMissed:\n\n");
        for table in tables {
            for row in table.rows.iter().filter(|r| r.missed()) {
                let _ = writeln!(out, "- {}", missed_line(table, row));
            }
        }
    }
    out.push_str(
        "\nHeadline figures, quoted from the tables:\n\n\
         | section | what | ours | limit (same run) | ratio | target | |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for table in tables {
        for row in headlines(table) {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} |",
                table.short_title(),
                row.what,
                row.ours,
                row.limit,
                row.ratio,
                row.target,
                row.verdict
            );
        }
    }
    out
}

fn missed_line(table: &Table, row: &TableRow) -> String {
    let against = if row.limit == "—" {
        String::new()
    } else {
        format!(" against {}, {}", row.limit, row.ratio)
    };
    format!(
        "**{}**, {}: {}{against} (target {}).",
        table.short_title(),
        row.what,
        row.ours,
        row.target
    )
}

/// The table's rows that [`HEADLINES`] names, the first of each `what`.
fn headlines(table: &Table) -> Vec<&TableRow> {
    let mut quoted: Vec<&TableRow> = Vec::new();
    for row in &table.rows {
        let named = HEADLINES
            .iter()
            .any(|(title, what)| table.title.starts_with(title) && row.what.contains(what));
        if named && !quoted.iter().any(|q| q.what == row.what) {
            quoted.push(row);
        }
    }
    quoted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Row, Run, Section, Target, Value, block_body, marked, splice};

    fn run(date: &str) -> Run {
        Run {
            date: date.into(),
            command: "tandem-bench nodeproxy".into(),
            build: "release",
            kernel: "6.1.0".into(),
        }
    }

    fn row(what: &str, ours: f64, limit: f64, target: Option<Target>) -> Row {
        Row {
            what: what.into(),
            ours: Value::Seconds(ours),
            limit: Some(("raw restore".into(), Value::Seconds(limit))),
            target,
        }
    }

    fn document() -> String {
        let iptables = Section {
            title: "Node proxy sync — legacy (iptables-legacy-restore)".into(),
            rows: vec![
                row(
                    "first sync, 2,700 LoadBalancer × 10, absolute",
                    1.28,
                    0.97,
                    Some(Target::AtMost(Value::Seconds(1.5))),
                ),
                row(
                    "one endpoint removed, 1,000 LoadBalancer × 10 (event seen → restore returned)",
                    0.2255,
                    0.1836,
                    Some(Target::RatioAtMost(1.2)),
                ),
                row("network programming latency p50, 2,700", 0.5, 0.5, None),
            ],
            notes: vec!["a note | with a pipe is not a row".into()],
            ..Section::default()
        };
        let data_plane = Section {
            title: "Data plane: throughput of one TCP stream, client → VIP → node → pod".into(),
            rows: vec![
                row(
                    "throughput, proxy-mode VIP (own edge) → NodePort",
                    8.0,
                    4.0,
                    Some(Target::RatioAtLeast(1.0)),
                ),
                row(
                    "throughput, proxy-mode VIP (own edge) → NodePort",
                    8.0,
                    12.0,
                    None,
                ),
            ],
            ..Section::default()
        };
        let mut document =
            "# Benchmarks\n\n## Hand-kept\n\n| a | b |\n|---|---|\n| 1 | 2 |\n".to_owned();
        document = splice(&document, BLOCK, "stale").unwrap();
        document = splice(
            &document,
            "node proxy",
            &block_body(&run("2026-11-24"), &[iptables]),
        )
        .unwrap();
        splice(
            &document,
            "data plane",
            &block_body(&run("2026-11-27"), &[data_plane]),
        )
        .unwrap()
    }

    #[test]
    fn the_tables_are_read_back_cell_for_cell_from_the_blocks_only() {
        let tables = tables(&document()).unwrap();
        let titles: Vec<(&str, &str, usize)> = tables
            .iter()
            .map(|t| (t.short_title(), t.run.as_str(), t.rows.len()))
            .collect();
        assert_eq!(
            titles,
            [
                ("Node proxy sync — legacy", "2026-11-24", 3),
                ("Data plane", "2026-11-27", 2)
            ]
        );
        assert_eq!(
            tables[0].rows[1],
            TableRow {
                what:
                    "one endpoint removed, 1,000 LoadBalancer × 10 (event seen → restore returned)"
                        .into(),
                ours: "225.5 ms".into(),
                limit: "183.6 ms (raw restore)".into(),
                ratio: "1.23×".into(),
                target: "≤ 1.2×".into(),
                verdict: "MISSED".into(),
            }
        );
    }

    #[test]
    fn the_summary_counts_targets_names_misses_and_quotes_headlines() {
        let text = summary(&document()).unwrap();
        assert!(text.contains("2 of 3 targets met."), "{text}");
        assert!(text.contains(
            "| Node proxy sync — legacy (iptables-legacy-restore) | 2026-11-24 | 2 | 1 | 1 |"
        ));
        assert!(text.contains(
            "| Data plane: throughput of one TCP stream, client → VIP → node → pod | 2026-11-27 | 1 | 1 | 0 |"
        ));
        assert!(text.contains(
            "- **Node proxy sync — legacy**, one endpoint removed, 1,000 LoadBalancer × 10 \
             (event seen → restore returned): 225.5 ms against 183.6 ms (raw restore), 1.23× \
             (target ≤ 1.2×)."
        ));
        assert!(text.contains(
            "| Node proxy sync — legacy | first sync, 2,700 LoadBalancer × 10, absolute | 1.28 s \
             | 970.0 ms (raw restore) | 1.32× | ≤ 1.50 s | met |"
        ));
        // One figure against two limits: only the row held to a target is quoted.
        assert_eq!(text.matches("| Data plane | throughput").count(), 1);
        assert!(text.contains("| 2.00× | ≥ 1× | met |"));
        assert!(!text.contains("network programming latency p50"));
    }

    #[test]
    fn a_broken_table_or_block_is_refused() {
        let document = document();
        let torn = document.replace("| 1.28 s |", "| 1.28 s");
        assert!(matches!(
            summary(&torn),
            Err(SummaryError::MalformedRow { cells: 5, .. })
        ));
        let undated = document.replace("Run of 2026-11-27", "Ran");
        assert_eq!(
            summary(&undated),
            Err(SummaryError::NoRun {
                block: "data plane".into()
            })
        );
        let unended = document.replace("<!-- end of data plane -->", "");
        assert!(matches!(
            summary(&unended),
            Err(SummaryError::Markers(MarkerError::Unterminated { .. }))
        ));
        let headless = marked("x", "Run of 2026-11-27: x.\n\n| 1 | 2 | 3 | 4 | 5 | 6 |");
        assert!(summary(&headless).unwrap().contains("0 of 0 targets met"));
        let orphan = marked(
            "x",
            &format!("Run of 2026-11-27: x.\n\n{TABLE_HEADER}\n| 1 | 2 | 3 | 4 | 5 | 6 |"),
        );
        assert!(matches!(
            summary(&orphan),
            Err(SummaryError::RowOutsideSection { .. })
        ));
    }
}
