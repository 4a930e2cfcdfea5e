//! Human-readable traces, for the `tandem-nodeproxy trace` CLI and the lab.

use std::fmt;

use super::{Entry, Hop, Route, Trace, Verdict};

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Route::LocalDelivery => "local delivery",
            Route::Forward => "forward",
        })
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Pass => f.write_str("ACCEPT (no rule stopped it)"),
            Verdict::Accept { table, chain } => write!(f, "ACCEPT by {} {chain}", table.as_str()),
            Verdict::Drop { table, chain } => write!(f, "DROP by {} {chain}", table.as_str()),
            Verdict::Reject { table, chain } => write!(f, "REJECT by {} {chain}", table.as_str()),
        }
    }
}

impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.request.packet;
        let entry = match self.request.entry {
            Entry::FromOutside => "from outside",
            Entry::Local => "generated locally",
        };
        writeln!(
            f,
            "{} -> {}/{} ({entry})",
            p.src,
            std::net::SocketAddr::new(p.dst, p.dst_port),
            p.protocol.as_str()
        )?;
        for (i, outcome) in self.outcomes.iter().enumerate() {
            let dnat = outcome
                .dnat
                .map_or("no DNAT".to_owned(), |to| format!("DNAT to {to}"));
            let masq = if outcome.masqueraded {
                "masqueraded"
            } else {
                "source kept"
            };
            writeln!(
                f,
                "outcome {} (p={:.4}): {}, {dnat}, {masq}, {}",
                i + 1,
                outcome.probability,
                outcome.verdict,
                outcome.route
            )?;
            for hop in &outcome.hops {
                match hop {
                    Hop::Rule { table, chain, rule } => {
                        writeln!(f, "  {} {chain}: {rule}", table.as_str())?
                    }
                    Hop::Route { route, dst } => writeln!(f, "  routing: {route} (dst {dst})")?,
                }
            }
        }
        Ok(())
    }
}
