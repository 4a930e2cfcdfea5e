//! Golden text for every scenario, in `iptables-restore` layout, reviewed as insta snapshots.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use tandem_proxy_rules::build;
use tandem_proxy_rules::ruleset::Table;

#[test]
fn scenario_rulesets() {
    for (name, state) in common::scenarios() {
        let ruleset = build(&state, &common::node_a());
        let text = format!(
            "{}{}",
            ruleset.restore_payload(Table::Filter),
            ruleset.restore_payload(Table::Nat)
        );
        insta::assert_snapshot!(name, text);
    }
}
