//! Results as data, rendered as a terminal table and as BENCHMARKS.md.

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
    out.push_str(
        "| what | ours | limit (same run) | ratio | target | |\n|---|---|---|---|---|---|\n",
    );
    for row in &section.rows {
        let limit = row
            .limit
            .as_ref()
            .map(|(what, v)| format!("{} ({what})", v.render()))
            .unwrap_or_else(|| "—".to_owned());
        let ratio = row
            .ratio()
            .map(|r| format!("{r:.2}×"))
            .unwrap_or_else(|| "—".to_owned());
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

/// `body` between the markers of the block `name`, so that a later run can find and
/// replace it (see [`splice`]).
pub fn marked(name: &str, body: &str) -> String {
    let (begin, end) = markers(name);
    format!("{begin}\n{}\n{end}\n", body.trim_end())
}

/// `document` with its block `name` replaced by `body`, the rest untouched; a document
/// without the block gets it at its end.
pub fn splice(document: &str, name: &str, body: &str) -> String {
    let (begin, end) = markers(name);
    let block = marked(name, body);
    if let Some(start) = document.find(&begin)
        && let Some(length) = document[start..].find(&end)
    {
        let after = &document[start + length + end.len()..];
        let after = after.strip_prefix('\n').unwrap_or(after);
        return format!("{}{block}{after}", &document[..start]);
    }
    if document.trim().is_empty() {
        return block;
    }
    format!("{}\n\n{block}", document.trim_end())
}

fn markers(name: &str) -> (String, String) {
    (
        format!("<!-- {name}: written by tandem-bench, replaced by its next run -->"),
        format!("<!-- end of {name} -->"),
    )
}

#[cfg(test)]
mod tests {
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
        let first = splice("# Report\n\n### other\n\ntext\n", "curves", "old body\n");
        assert!(first.starts_with("# Report\n\n### other\n\ntext\n\n<!-- curves: "));
        assert!(first.contains("old body\n<!-- end of curves -->\n"));
        let edited = first.replace("text", "text edited by hand") + "\n## after\n";
        let second = splice(&edited, "curves", "new body");
        assert!(!second.contains("old body"));
        assert!(second.contains("new body\n<!-- end of curves -->\n\n## after\n"));
        assert!(second.starts_with("# Report\n\n### other\n\ntext edited by hand\n"));
        assert_eq!(splice(&second, "curves", "new body"), second);
        assert_eq!(splice("", "curves", "body"), marked("curves", "body"));
    }
}
