//! The checked-in BENCHMARKS.md agrees with itself: its summary is the one its tables make,
//! so a hand edit of either that makes them disagree fails here (run `tandem-bench
//! summary` after editing a table).

use std::path::Path;

use tandem_bench::report::{self, summary};

fn checked_in() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../BENCHMARKS.md");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("reading {}: {error}", path.display()))
}

#[test]
fn the_checked_in_summary_is_the_one_its_tables_make() {
    let document = checked_in();
    let made = summary::summary(&document).unwrap_or_else(|error| panic!("{error}"));
    let kept = report::block(&document, summary::BLOCK)
        .unwrap_or_else(|error| panic!("{error}"))
        .expect("BENCHMARKS.md has a summary block");
    assert_eq!(
        kept.trim_end(),
        made.trim_end(),
        "BENCHMARKS.md's summary disagrees with its tables: `tandem-bench summary` makes it again"
    );
}

#[test]
fn every_results_block_says_which_run_it_comes_from() {
    let document = checked_in();
    let tables = summary::tables(&document).unwrap_or_else(|error| panic!("{error}"));
    assert!(tables.len() >= 7, "{} results tables", tables.len());
    for table in &tables {
        assert!(
            jiff::civil::Date::strptime("%Y-%m-%d", &table.run).is_ok(),
            "{}: run date {:?}",
            table.title,
            table.run
        );
    }
}
