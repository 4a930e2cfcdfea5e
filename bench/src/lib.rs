//! Tandem's benchmarks. Not part of the test suite: `tandem-bench` runs them, prints a
//! table and writes BENCHMARKS.md. Every figure is a ratio to a limit measured in the same
//! run (these machines are noisy), next to the target it is held to.

pub mod controller;
mod cpu;
pub mod curves;
pub mod dataplane;
pub mod edgecluster;
pub mod nodeproxy;
pub mod report;

/// Settings shared by every benchmark.
#[derive(Debug, Clone, Copy, Default)]
pub struct BenchOptions {
    /// Small scales, for checking that a benchmark runs; its numbers mean little.
    pub quick: bool,
    /// The node proxy benchmark measures this data path only (both when `None`).
    pub proxy_mode: Option<tandem_common::ProxyMode>,
}

impl BenchOptions {
    /// Whether the node proxy benchmarks measure `mode`'s data path.
    pub fn measures(&self, mode: tandem_common::ProxyMode) -> bool {
        self.proxy_mode.is_none_or(|only| only == mode)
    }
}
