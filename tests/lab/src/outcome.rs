//! What a scenario under client traffic measured, and the table of failed requests that
//! the day-2 and the edge-cluster tests print.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::traffic::Summary;

/// What one scenario measured, and the targets it missed.
pub struct Outcome {
    pub scenario: &'static str,
    /// Whether its target is no failed request and the long-lived connections kept (else
    /// failures are only counted).
    pub zero_failures: bool,
    /// The target as the table states it.
    pub target: String,
    /// The traffic through each Service, in LB mode order.
    pub traffic: Vec<Summary>,
    pub notes: Vec<String>,
    pub missed: Vec<String>,
    pub took: Duration,
}

impl Outcome {
    pub fn new(scenario: &'static str, zero_failures: bool) -> Self {
        Self {
            scenario,
            zero_failures,
            target: match zero_failures {
                true => "0 failed, long-lived kept".to_owned(),
                false => "counted".to_owned(),
            },
            traffic: Vec::new(),
            notes: Vec::new(),
            missed: Vec::new(),
            took: Duration::ZERO,
        }
    }

    pub fn could_not_run(scenario: &'static str, error: &anyhow::Error) -> Self {
        let mut outcome = Self::new(scenario, true);
        outcome.missed.push(format!("could not run: {error:#}"));
        outcome
    }

    /// States the target as `target`, for a scenario that checks its own.
    pub fn with_target(mut self, target: impl Into<String>) -> Self {
        self.target = target.into();
        self
    }

    pub fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    /// Records `target` as missed unless `met`.
    pub fn check(&mut self, met: bool, target: impl Into<String>) {
        if !met {
            self.missed.push(target.into());
        }
    }

    /// Records the traffic, and checks it against the target when the scenario has one.
    pub fn finish(mut self, traffic: Vec<Summary>, started: Instant) -> Self {
        if self.zero_failures {
            for summary in &traffic {
                self.check(
                    summary.failed() == 0,
                    format!("0 failed requests: {}", summary.describe()),
                );
                self.check(
                    summary.long_lived_kept(),
                    format!("the long-lived connection kept: {}", summary.describe()),
                );
            }
        }
        self.traffic = traffic;
        self.took = started.elapsed();
        self
    }

    pub fn describe(&self) -> String {
        let mut text = format!("=== {} ({:.1?})", self.scenario, self.took);
        for summary in &self.traffic {
            let _ = write!(text, "\n  {}", summary.describe());
        }
        for note in &self.notes {
            let _ = write!(text, "\n  {note}");
        }
        for missed in &self.missed {
            let _ = write!(text, "\n  MISSED {missed}");
        }
        text
    }
}

/// The failed-request table, in Markdown, under `title`: a row per scenario, a cell pair
/// per Service (proxy LB, passthrough LB), then each scenario's notes.
pub fn table(title: &str, outcomes: &[Outcome]) -> String {
    let mut text = format!(
        "\n{title}:\n\n\
         | scenario | proxy LB: failed / sent | long-lived | passthrough LB: failed / sent | long-lived | target | met |\n\
         |---|---|---|---|---|---|---|\n"
    );
    for outcome in outcomes {
        let mut cells = Vec::new();
        for summary in &outcome.traffic {
            cells.push(format!("{} / {}", summary.failed(), summary.sent));
            cells.push(if summary.long_lived_kept() {
                "kept".to_owned()
            } else {
                "broken".to_owned()
            });
        }
        cells.resize(4, "-".to_owned());
        let met = if outcome.missed.is_empty() {
            "yes"
        } else {
            "NO"
        };
        let _ = writeln!(
            text,
            "| {} | {} | {} | {met} |",
            outcome.scenario,
            cells.join(" | "),
            outcome.target
        );
    }
    for outcome in outcomes.iter().filter(|o| !o.notes.is_empty()) {
        let _ = write!(text, "\n{}:", outcome.scenario);
        for note in &outcome.notes {
            let _ = write!(text, "\n  {note}");
        }
    }
    text
}
