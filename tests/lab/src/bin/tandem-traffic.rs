//! `tandem-traffic`: client traffic through a VIP, run inside an outside client's network
//! namespace (`ip netns exec CLIENT tandem-traffic --target VIP:PORT`). Prints
//! `{"kind":"ready"}` once its long-lived connection made its first exchange, and, when
//! stdin closes, SIGTERM or SIGINT arrives, or `--duration` passes, one line with the
//! summary of what failed (see `tandem_lab::traffic`).

use anyhow::Context;
use clap::Parser;
use tandem_lab::traffic::{self, Line, TrafficArgs};
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

fn main() -> anyhow::Result<()> {
    let args = TrafficArgs::parse();
    tandem_common::init_logging(tandem_common::LogFormat::Text);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the runtime")?;
    let summary = runtime.block_on(async {
        let stop = CancellationToken::new();
        let on_stdin_closed = stop.clone();
        tokio::spawn(async move {
            let mut sink = Vec::new();
            let _ = tokio::io::stdin().read_to_end(&mut sink).await;
            on_stdin_closed.cancel();
        });
        let on_signal = stop.clone();
        tokio::spawn(async move {
            let signal = tandem_common::shutdown_signal().await;
            tracing::info!(signal, "stopping");
            on_signal.cancel();
        });
        traffic::generate(&args, stop, || print_line(&Line::Ready)).await
    });
    print_line(&Line::Summary(summary));
    // The stdin reader may still block in the runtime's blocking pool: do not wait for it.
    runtime.shutdown_background();
    Ok(())
}

fn print_line(line: &Line) {
    match serde_json::to_string(line) {
        // println! flushes at the newline only on a terminal; the reader waits for each line.
        Ok(text) => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{text}");
            let _ = out.flush();
        }
        Err(e) => tracing::error!(error = %e, "cannot print the output line"),
    }
}
