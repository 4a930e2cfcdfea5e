//! Readable output for people: the Service, the cloud's load balancer, the spread.

use std::fmt::Write as _;

use cloud_mock_sdk::families::LoadBalancer;
use serde::Serialize;

use crate::scenario::Spread;

/// What the cloud API calls a value (`proxy`, `active`, `TCP`, `healthy`): its JSON form,
/// so the demo speaks the API's and the docs' language rather than Rust's.
fn api_name(value: &impl Serialize) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(name)) => name,
        Ok(other) => other.to_string(),
        Err(error) => format!("<{error}>"),
    }
}

/// The cloud's view of a load balancer, one line per listener and VIP, and per backend.
pub fn load_balancer(lb: &LoadBalancer) -> String {
    let mut out = String::new();
    let vips: Vec<String> = lb.vips().iter().map(ToString::to_string).collect();
    let _ = writeln!(
        out,
        "  id {}  name {}  mode {}  VIP {}  state {}  version {}",
        lb.id,
        lb.spec.name,
        api_name(&lb.spec.mode),
        if vips.is_empty() {
            "-".to_owned()
        } else {
            vips.join(", ")
        },
        api_name(&lb.state),
        lb.version
    );
    for l in &lb.spec.listeners {
        let check = match &l.health_check {
            Some(hc) => format!(
                "health check {} :{}{}",
                api_name(&hc.protocol),
                hc.port,
                hc.path.as_deref().unwrap_or("")
            ),
            None => "no health check".to_owned(),
        };
        for vip in lb.vips() {
            let _ = writeln!(
                out,
                "  listener {} {} -> backends :{}  ({check})",
                api_name(&l.protocol),
                std::net::SocketAddr::new(*vip, l.port),
                l.backend_port
            );
        }
    }
    for b in &lb.spec.backends {
        let health = lb
            .health
            .iter()
            .find(|h| h.ip == b.ip)
            .map(|h| api_name(&h.health))
            .unwrap_or_else(|| "-".to_owned());
        let _ = writeln!(out, "  backend {}  {health}", b.ip);
    }
    if !lb.spec.source_ranges.is_empty() {
        let ranges: Vec<String> = lb
            .spec
            .source_ranges
            .iter()
            .map(ToString::to_string)
            .collect();
        let _ = writeln!(out, "  source ranges {}", ranges.join(", "));
    }
    out
}

/// How requests spread: by pod and by the source address the pods saw.
pub fn spread(title: &str, spread: &Spread) -> String {
    let mut out = format!(
        "{title}: {} of {} answered\n",
        spread.succeeded(),
        spread.sent
    );
    let bar = |n: usize| "#".repeat((n * 40).div_ceil(spread.sent.max(1)));
    for (pod, n) in &spread.by_pod {
        let _ = writeln!(out, "  pod {pod:<12} {n:>4}  {}", bar(*n));
    }
    for (source, n) in &spread.by_seen_source {
        let _ = writeln!(out, "  pods saw source {source:<14} {n:>4}");
    }
    for (error, n) in &spread.errors {
        let _ = writeln!(out, "  failed x{n}: {error}");
    }
    out
}

/// A `tandem-nodeproxy trace` answer with the chain path of its first outcome only: the
/// other random branches walk the same chains up to their own KUBE-SEP, so their one-line
/// verdicts are enough.
pub fn condensed_trace(trace: &str) -> String {
    let mut out = String::new();
    let mut outcomes = 0;
    for line in trace.lines() {
        if line.starts_with("outcome ") {
            outcomes += 1;
        }
        let is_path_line = line.starts_with("  ");
        if !is_path_line || outcomes <= 1 {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn condensed_trace_keeps_every_verdict_and_the_first_path() {
        let trace = "a -> b:80/tcp (from outside)\noutcome 1 (p=0.5000): ACCEPT\n  nat PREROUTING: x\n  nat KUBE-SVC-A: y\noutcome 2 (p=0.5000): ACCEPT\n  nat PREROUTING: x\n";
        assert_eq!(
            condensed_trace(trace),
            "a -> b:80/tcp (from outside)\noutcome 1 (p=0.5000): ACCEPT\n  nat PREROUTING: x\n  nat KUBE-SVC-A: y\noutcome 2 (p=0.5000): ACCEPT\n"
        );
    }

    #[test]
    fn load_balancers_are_shown_with_the_api_names() {
        let lb: LoadBalancer = serde_json::from_value(serde_json::json!({
            "id": "lb-1", "name": "k8s-lab-0a", "mode": "passthrough",
            "ipFamilies": ["IPv4", "IPv6"],
            "vips": ["198.51.100.7", "2001:db8:51:100::7"],
            "listeners": [{"protocol": "UDP", "port": 53, "backendPort": 53,
                           "healthCheck": {"protocol": "HTTP", "port": 10256, "path": "/healthz"}}],
            "backends": [{"ip": "198.18.0.11"}, {"ip": "2001:db8:18::11"}],
            "sourceRanges": ["203.0.113.0/24", "2001:db8:203::/64"],
            "state": "active", "version": 3,
            "health": [{"ip": "198.18.0.11", "health": "healthy"},
                       {"ip": "2001:db8:18::11", "health": "unhealthy"}]
        }))
        .unwrap();
        assert_eq!(
            load_balancer(&lb),
            "  id lb-1  name k8s-lab-0a  mode passthrough  VIP 198.51.100.7, 2001:db8:51:100::7  state active  version 3\n  \
             listener UDP 198.51.100.7:53 -> backends :53  (health check HTTP :10256/healthz)\n  \
             listener UDP [2001:db8:51:100::7]:53 -> backends :53  (health check HTTP :10256/healthz)\n  \
             backend 198.18.0.11  healthy\n  \
             backend 2001:db8:18::11  unhealthy\n  \
             source ranges 203.0.113.0/24, 2001:db8:203::/64\n"
        );
    }

    #[test]
    fn spread_report_shows_pods_sources_and_errors() {
        let mut s = Spread {
            sent: 4,
            failed: 1,
            ..Spread::default()
        };
        s.by_pod.insert("n1p1".into(), 3);
        s.by_seen_source.insert("node-1".into(), 3);
        s.errors.insert("timed out".into(), 1);
        let text = spread("proxy mode", &s);
        assert!(text.starts_with("proxy mode: 3 of 4 answered"));
        assert!(
            text.contains("pod n1p1")
                && text.contains("node-1")
                && text.contains("failed x1: timed out")
        );
    }
}
