//! Results as data, rendered as a terminal table and as BENCHMARKS.md: each benchmark's
//! sections are a marked block of the file that its next run replaces ([`splice`]), and
//! the summary at the top is made from the blocks' tables ([`summary`]).

pub mod machine;
pub mod summary;

use std::fmt::Write as _;

/// A measured quantity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    Seconds(f64),
    MiB(f64),
    GbitPerSecond(f64),
    Count(f64),
}

impl Value {
    pub fn number(self) -> f64 {
        match self {
            Value::Seconds(v) | Value::MiB(v) | Value::GbitPerSecond(v) | Value::Count(v) => v,
        }
    }

    fn render(self) -> String {
        match self {
            Value::Seconds(s) if s < 1e-3 => format!("{:.0} µs", s * 1e6),
            Value::Seconds(s) if s < 1.0 => format!("{:.1} ms", s * 1000.0),
            Value::Seconds(s) => format!("{s:.2} s"),
            Value::MiB(m) => format!("{m:.0} MiB"),
            Value::GbitPerSecond(g) => format!("{g:.2} Gbit/s"),
            Value::Count(c) if c.fract() == 0.0 => format!("{c:.0}"),
            Value::Count(c) => format!("{c:.2}"),
        }
    }
}

/// What a figure is held to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target {
    /// ours ÷ limit must be at most this (times, where lower is better).
    RatioAtMost(f64),
    /// ours ÷ limit must be at least this (throughput, where higher is better).
    RatioAtLeast(f64),
    /// ours must be at most this absolute value.
    AtMost(Value),
}

/// One line of the table: our figure, the limit it is compared with, and the target.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub what: String,
    pub ours: Value,
    /// The limit measured in the same run, and what it is (e.g. "raw iptables-restore").
    pub limit: Option<(String, Value)>,
    pub target: Option<Target>,
}

impl Row {
    pub fn ratio(&self) -> Option<f64> {
        let (_, limit) = self.limit.as_ref()?;
        (limit.number() > 0.0).then(|| self.ours.number() / limit.number())
    }

    /// Whether the target is met; None without a target (or without the limit it needs).
    pub fn met(&self) -> Option<bool> {
        match self.target? {
            Target::RatioAtMost(max) => self.ratio().map(|r| r <= max),
            Target::RatioAtLeast(min) => self.ratio().map(|r| r >= min),
            Target::AtMost(max) => Some(self.ours.number() <= max.number()),
        }
    }
}

/// A picture beside the report (an SVG file), shown above its section's table.
#[derive(Debug, Clone, PartialEq)]
pub struct Figure {
    /// The file, relative to the report.
    pub path: String,
    /// What it shows, in a few words (the image's alternative text).
    pub title: String,
    /// What was measured, shown under it.
    pub caption: String,
}

/// A titled group of rows, with notes that explain misses and method.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Section {
    pub title: String,
    pub figures: Vec<Figure>,
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
}

/// A ratio with two decimals, or two significant digits below 0.1 (ours against
/// kube-proxy's, say, where two decimals would print 0.00×).
fn ratio_text(ratio: f64) -> String {
    if ratio > 0.0 && ratio < 0.1 {
        let decimals = (1.0 - ratio.log10().floor()).max(2.0) as usize;
        format!("{ratio:.decimals$}×")
    } else {
        format!("{ratio:.2}×")
    }
}

fn target_text(target: Option<Target>) -> String {
    match target {
        Some(Target::RatioAtMost(r)) => format!("≤ {r}×"),
        Some(Target::RatioAtLeast(r)) => format!("≥ {r}×"),
        Some(Target::AtMost(v)) => format!("≤ {}", v.render()),
        None => "—".to_owned(),
    }
}

fn verdict(row: &Row) -> &'static str {
    match row.met() {
        Some(true) => "met",
        Some(false) => "MISSED",
        None => "—",
    }
}

/// The first two lines of every section's table, by which [`summary`] finds the tables.
pub const TABLE_HEADER: &str = "| what | ours | limit (same run) | ratio | target | |";
const TABLE_RULE: &str = "|---|---|---|---|---|---|";

/// Markdown table of one section (also readable in a terminal).
pub fn markdown(section: &Section) -> String {
    let mut out = format!("### {}\n\n", section.title);
    for figure in &section.figures {
        let _ = write!(
            out,
            "![{}]({})\n\n{}\n\n",
            figure.title, figure.path, figure.caption
        );
    }
    let _ = writeln!(out, "{TABLE_HEADER}\n{TABLE_RULE}");
    for row in &section.rows {
        let limit = row
            .limit
            .as_ref()
            .map(|(what, v)| format!("{} ({what})", v.render()))
            .unwrap_or_else(|| "—".to_owned());
        let ratio = row.ratio().map_or_else(|| "—".to_owned(), ratio_text);
        let _ = writeln!(
            out,
            "| {} | {} | {limit} | {ratio} | {} | {} |",
            row.what,
            row.ours.render(),
            target_text(row.target),
            verdict(row)
        );
    }
    for note in &section.notes {
        let _ = write!(out, "\n- {note}");
    }
    out.push('\n');
    out
}

/// The sections one benchmark run writes as one marked block of the report: a later run of
/// that benchmark replaces them and leaves everything else in the file as it is.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub name: &'static str,
    pub sections: Vec<Section>,
}

/// How a block's sections were measured: its first line, so that a block from an older run
/// says when and where it ran beside the newer ones (the file's blocks come from
/// different runs).
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// The day, as YYYY-MM-DD.
    pub date: String,
    /// The command line, e.g. `tandem-bench nodeproxy --proxy-mode iptables`.
    pub command: String,
    /// "release" or "debug": debug builds are several times slower.
    pub build: &'static str,
    /// `uname -r`: the data path's cost is the kernel's as much as ours.
    pub kernel: String,
}

/// How a block's first line begins; [`summary`] reads the run's date after it.
pub const RUN_PREFIX: &str = "Run of ";

impl Run {
    pub fn line(&self) -> String {
        format!(
            "{RUN_PREFIX}{}: `{}`, {} build, kernel {}.",
            self.date, self.command, self.build, self.kernel
        )
    }
}

/// The body of a block: its run line, then its sections' tables.
pub fn block_body(run: &Run, sections: &[Section]) -> String {
    let tables: Vec<String> = sections.iter().map(markdown).collect();
    format!("{}\n\n{}", run.line(), tables.join("\n"))
}

/// The report's block of its title, what it holds, the machine and how to reproduce it;
/// every run writes it, so it names the machine of the latest run (each block's run line
/// names its own kernel and day).
pub const HEADER_BLOCK: &str = "header";

/// The header block's body.
pub fn header(machine: &machine::Machine) -> String {
    format!(
        "# Benchmarks\n\n\
         Every figure is compared with a limit measured in the same run on the same machine, \
         next to the target it is held to. `tandem-bench` prints these tables and writes the \
         marked blocks of this file, each beginning with the run it comes from: a run of one \
         benchmark replaces its own block and the summary, and leaves the rest (the text \
         outside the blocks is kept by hand).\n\n\
         Machine of the latest run: {}.\n\n\
         Reproduce (as root; the data plane installs iperf3 and haproxy if missing):\n\n\
         ```sh\n\
         cargo build --release --workspace --bins && sudo target/release/tandem-bench all    \
         # or: nodeproxy [--proxy-mode iptables|nftables] | idle | controller | dataplane | curves [--quick]\n\
         target/release/tandem-bench summary    # only the summary, from the tables in the file\n\
         ```\n",
        machine.describe()
    )
}

/// Why a report's markers cannot be trusted. Replacing a block between broken markers
/// would cut hand-kept text out of the file, so the writer refuses instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MarkerError {
    #[error(
        "line {line}: block \"{name}\" begins inside block \"{open}\", which has not ended \
         (blocks do not nest; add `<!-- end of {open} -->` before it)"
    )]
    Nested {
        line: usize,
        name: String,
        open: String,
    },
    #[error("line {line}: `<!-- end of {name} -->` ends a block \"{name}\" that did not begin")]
    EndWithoutBegin { line: usize, name: String },
    #[error("line {line}: block \"{name}\" never ends (no `<!-- end of {name} -->` after it)")]
    Unterminated { line: usize, name: String },
    #[error("block \"{name}\" appears twice, at lines {first} and {second}")]
    Repeated {
        name: String,
        first: usize,
        second: usize,
    },
}

/// Where one marked block sits in a document, in bytes: `outer` from the start of its
/// begin marker to the end of its end marker's line, `body` between the two markers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    pub name: String,
    pub outer: std::ops::Range<usize>,
    pub body: std::ops::Range<usize>,
}

/// `body` between the markers of the block `name`, so that a later run can find and
/// replace it (see [`splice`]).
pub fn marked(name: &str, body: &str) -> String {
    let (begin, end) = markers(name);
    format!("{begin}\n{}\n{end}\n", body.trim_end())
}

/// Every marked block of `document`, in order; an error when the markers are broken (a
/// block that never ends, an end without its begin, a block inside another, a name used
/// twice).
pub fn spans(document: &str) -> Result<Vec<Span>, MarkerError> {
    let mut spans: Vec<Span> = Vec::new();
    // The open block: its name, first line number, and where its marker and body begin.
    let mut open: Option<(String, usize, usize, usize)> = None;
    let mut offset = 0;
    for (index, line) in document.split_inclusive('\n').enumerate() {
        let number = index + 1;
        let start = offset;
        offset += line.len();
        let text = line.trim_end();
        if let Some(name) = begin_name(text) {
            if let Some((open, ..)) = &open {
                return Err(MarkerError::Nested {
                    line: number,
                    name: name.to_owned(),
                    open: open.clone(),
                });
            }
            if let Some(first) = spans.iter().find(|s| s.name == name) {
                return Err(MarkerError::Repeated {
                    name: name.to_owned(),
                    first: line_number(document, first.outer.start),
                    second: number,
                });
            }
            open = Some((name.to_owned(), number, start, offset));
        } else if let Some(name) = end_name(text) {
            match open.take() {
                Some((open_name, _, outer_start, body_start)) if open_name == name => {
                    spans.push(Span {
                        name: open_name,
                        outer: outer_start..offset,
                        body: body_start..start,
                    });
                }
                // An end of another block while one is open leaves the open one unended.
                Some((open_name, open_line, ..)) => {
                    return Err(MarkerError::Unterminated {
                        line: open_line,
                        name: open_name,
                    });
                }
                None => {
                    return Err(MarkerError::EndWithoutBegin {
                        line: number,
                        name: name.to_owned(),
                    });
                }
            }
        }
    }
    match open {
        Some((name, line, ..)) => Err(MarkerError::Unterminated { line, name }),
        None => Ok(spans),
    }
}

/// The text between the markers of the block `name`, if the document has it.
pub fn block<'a>(document: &'a str, name: &str) -> Result<Option<&'a str>, MarkerError> {
    Ok(spans(document)?
        .into_iter()
        .find(|span| span.name == name)
        .map(|span| &document[span.body]))
}

/// `document` with its block `name` replaced by `body`, the rest untouched; a document
/// without the block gets it at its end.
pub fn splice(document: &str, name: &str, body: &str) -> Result<String, MarkerError> {
    let block = marked(name, body);
    if let Some(span) = spans(document)?.into_iter().find(|s| s.name == name) {
        return Ok(format!(
            "{}{block}{}",
            &document[..span.outer.start],
            &document[span.outer.end..]
        ));
    }
    if document.trim().is_empty() {
        return Ok(block);
    }
    Ok(format!("{}\n\n{block}", document.trim_end()))
}

const BEGIN_SUFFIX: &str = ": written by tandem-bench, replaced by its next run -->";

fn markers(name: &str) -> (String, String) {
    (
        format!("<!-- {name}{BEGIN_SUFFIX}"),
        format!("<!-- end of {name} -->"),
    )
}

fn begin_name(line: &str) -> Option<&str> {
    line.strip_prefix("<!-- ")?.strip_suffix(BEGIN_SUFFIX)
}

fn end_name(line: &str) -> Option<&str> {
    line.strip_prefix("<!-- end of ")?.strip_suffix(" -->")
}

fn line_number(document: &str, offset: usize) -> usize {
    document[..offset].matches('\n').count() + 1
}

#[cfg(test)]
mod tests {
    #[test]
    fn small_ratios_keep_two_significant_digits() {
        assert_eq!(super::ratio_text(1.234), "1.23×");
        assert_eq!(super::ratio_text(0.0437), "0.044×");
        assert_eq!(super::ratio_text(0.00193), "0.0019×");
        assert_eq!(super::ratio_text(0.0), "0.00×");
    }

    use super::*;

    #[test]
    fn ratios_and_verdicts() {
        let row = Row {
            what: "first sync".into(),
            ours: Value::Seconds(3.0),
            limit: Some(("raw restore".into(), Value::Seconds(2.0))),
            target: Some(Target::RatioAtMost(1.5)),
        };
        assert_eq!(row.ratio(), Some(1.5));
        assert_eq!(row.met(), Some(true));
        let slow = Row {
            ours: Value::Seconds(3.2),
            ..row.clone()
        };
        assert_eq!(slow.met(), Some(false));
        let absolute = Row {
            target: Some(Target::AtMost(Value::MiB(200.0))),
            ours: Value::MiB(150.0),
            limit: None,
            ..row
        };
        assert_eq!(absolute.met(), Some(true));
        let text = markdown(&Section {
            title: "t".into(),
            rows: vec![slow, absolute],
            notes: vec!["why".into()],
            ..Section::default()
        });
        assert!(
            text.contains("MISSED")
                && text.contains("1.60×")
                && text.contains("150 MiB")
                && text.contains("- why")
        );
    }

    #[test]
    fn figures_come_before_the_table() {
        let text = markdown(&Section {
            title: "curves".into(),
            figures: vec![Figure {
                path: "docs/bench/a.svg".into(),
                title: "a plot".into(),
                caption: "what it shows".into(),
            }],
            ..Section::default()
        });
        let image = text
            .find("![a plot](docs/bench/a.svg)\n\nwhat it shows")
            .unwrap();
        assert!(image < text.find("| what |").unwrap());
    }

    #[test]
    fn a_spliced_block_replaces_its_old_self_and_nothing_else() {
        let first = splice("# Report\n\n### other\n\ntext\n", "curves", "old body\n").unwrap();
        assert!(first.starts_with("# Report\n\n### other\n\ntext\n\n<!-- curves: "));
        assert!(first.contains("old body\n<!-- end of curves -->\n"));
        let edited = first.replace("text", "text edited by hand") + "\n## after\n";
        let second = splice(&edited, "curves", "new body").unwrap();
        assert!(!second.contains("old body"));
        assert!(second.contains("new body\n<!-- end of curves -->\n\n## after\n"));
        assert!(second.starts_with("# Report\n\n### other\n\ntext edited by hand\n"));
        assert_eq!(splice(&second, "curves", "new body").unwrap(), second);
        assert_eq!(
            splice("", "curves", "body").unwrap(),
            marked("curves", "body")
        );
    }

    fn two_blocks() -> String {
        let document = splice("# Report\n\nhand-kept\n", "a", "first a").unwrap();
        splice(&(document + "\nmore hand-kept\n"), "b", "first b").unwrap()
    }

    #[test]
    fn replacing_one_block_keeps_the_others_and_the_hand_kept_text() {
        let document = two_blocks();
        let replaced = splice(&document, "a", "second a").unwrap();
        assert_eq!(replaced, document.replace("first a", "second a"));
        assert_eq!(block(&replaced, "a").unwrap(), Some("second a\n"));
        assert_eq!(block(&replaced, "b").unwrap(), Some("first b\n"));
        let names: Vec<String> = spans(&replaced)
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn a_missing_block_is_appended() {
        let document = two_blocks();
        let added = splice(&document, "c", "new c").unwrap();
        assert!(added.starts_with(document.trim_end()));
        assert!(added.ends_with(&marked("c", "new c")));
        assert_eq!(block(&document, "c").unwrap(), None);
    }

    #[test]
    fn broken_markers_are_refused_with_the_line_they_are_on() {
        let document = two_blocks();
        let (begin_a, end_a) = markers("a");
        let unended = document.replacen(&format!("{end_a}\n"), "", 1);
        assert_eq!(
            splice(&unended, "b", "x"),
            Err(MarkerError::Nested {
                line: 10,
                name: "b".into(),
                open: "a".into()
            })
        );
        let last_unended = document.replace("<!-- end of b -->\n", "");
        assert_eq!(
            splice(&last_unended, "a", "x"),
            Err(MarkerError::Unterminated {
                line: 11,
                name: "b".into()
            })
        );
        let unbegun = document.replacen(&format!("{begin_a}\n"), "", 1);
        assert_eq!(
            splice(&unbegun, "a", "x"),
            Err(MarkerError::EndWithoutBegin {
                line: 6,
                name: "a".into()
            })
        );
        let twice = format!("{document}{}", marked("a", "again"));
        assert_eq!(
            splice(&twice, "c", "x"),
            Err(MarkerError::Repeated {
                name: "a".into(),
                first: 5,
                second: 14
            })
        );
        let crossed = document.replacen(&end_a, "<!-- end of b -->", 1);
        let error = splice(&crossed, "a", "x").unwrap_err();
        assert_eq!(
            error,
            MarkerError::Unterminated {
                line: 5,
                name: "a".into()
            }
        );
        assert_eq!(
            error.to_string(),
            "line 5: block \"a\" never ends (no `<!-- end of a -->` after it)"
        );
    }

    #[test]
    fn a_block_begins_with_its_run() {
        let run = Run {
            date: "2026-11-24".into(),
            command: "tandem-bench controller".into(),
            build: "release",
            kernel: "6.1.0".into(),
        };
        let body = block_body(
            &run,
            &[Section {
                title: "t".into(),
                ..Section::default()
            }],
        );
        assert!(body.starts_with(
            "Run of 2026-11-24: `tandem-bench controller`, release build, kernel 6.1.0.\n\n### t\n"
        ));
    }
}
