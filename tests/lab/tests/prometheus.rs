//! The chart's alerts against a real Prometheus (Debian's `prometheus` package) and the lab.
//!
//! The PrometheusRule is rendered by Helm from `charts/tandem`, with the values the chart's
//! own alert tests use (the defaults, the rule enabled). Prometheus runs in the lab's
//! control-plane namespace with its own config and data under the lab's run directory,
//! scrapes every metrics endpoint the lab's Tandem processes listen on (found with `ss`:
//! the controller, each node's proxy, the mock cloud) every second and evaluates the rules
//! every second. A Service gets traffic, the cloud answers 429 for a moment, and another
//! tool's chain holds one of a node proxy's chains so that a sync fails: then every
//! rule must evaluate with health ok, and every metric selector of every alert, label
//! matchers included, must find series. An alert that names a metric or a label value the
//! components do not export fails here.
//!
//! Needs root, the binaries (`cargo build --workspace --bins`), `prometheus` on PATH
//! (`apt-get install prometheus`; .ci/run installs it) and Helm from
//! `tests/k3s/install-helm.sh` (fetched once, then kept under target/).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cloud_mock_sdk::Faults;
use jiff::Timestamp;
use serde_json::Value;
use tandem_common::ProxyMode;
use tandem_lab::bridge::NamespaceRelay;
use tandem_lab::components::Component;
use tandem_lab::lab::{Lab, LabOptions};
use tandem_lab::scenario::{LbMode, ServicePlan};
use tandem_netlab::Netns;

/// Where Prometheus listens, inside the control-plane namespace (the test's runtime is there).
const PROMETHEUS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9090);
/// Scrape and rule evaluation interval.
const INTERVAL: &str = "1s";
/// The processes whose metrics are scraped, by binary name (`ss` shows a process name cut
/// to 15 characters).
const COMPONENTS: [&str; 3] = ["tandem-controller", "tandem-nodeproxy", "cloud-mock"];
/// Metric names of Tandem's components start with one of these.
const METRIC_PREFIXES: [&str; 2] = ["tandem_", "cloud_mock_"];
/// Another tool's chain that jumps to a node proxy's chain, so that deleting it fails.
const HOLDING_CHAIN: &str = "TANDEM-TEST-HOLD";
/// Bound on waiting for every series and rule evaluation.
const DEADLINE: Duration = Duration::from_secs(60);

#[test]
fn prometheus_evaluates_every_alert_of_the_chart_against_the_lab() {
    let started = Instant::now();
    let prometheus = on_path("prometheus").unwrap_or_else(|| {
        panic!("prometheus is not on PATH: apt-get install prometheus (.ci/run installs it)")
    });
    // Helm may be fetched first: from the root namespace, before the lab's thread moves.
    let rules = alert_rules().unwrap();
    let options = LabOptions {
        proxy_mode: ProxyMode::Iptables,
        ..LabOptions::default()
    };
    let lab_thread = std::thread::spawn(move || {
        let prepared = Lab::prepare(&options).unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let progress = |what: &str| {
                eprintln!("[{:>5.1}s] {what}", started.elapsed().as_secs_f64());
            };
            let lab = Lab::start(prepared, options, &progress).await.unwrap();
            evaluate_alerts(&lab, &prometheus, &rules, &progress)
                .await
                .unwrap();
            lab.shutdown().await.unwrap();
        });
    });
    if let Err(panic) = lab_thread.join() {
        std::panic::resume_unwind(panic);
    }
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());
}

async fn evaluate_alerts(
    lab: &Lab,
    prometheus: &Path,
    rules: &str,
    progress: &dyn Fn(&str),
) -> Result<()> {
    progress("finding the metrics endpoints of the lab's processes");
    let (targets, _relays) = metrics_targets(lab).await?;
    let jobs = |job: &str| targets.iter().filter(|t| t.job == job).count();
    anyhow::ensure!(
        jobs("tandem-controller") >= 1
            && jobs("cloud-mock") >= 1
            && jobs("tandem-nodeproxy") == lab.topology.nodes().len(),
        "not every component serves metrics: {targets:?}"
    );

    progress("starting Prometheus in the control plane");
    let dir = lab.run_dir.join("prometheus");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("rules.yaml"), rules)?;
    std::fs::write(dir.join("prometheus.yml"), config(&targets))?;
    let mut server = Component::start(
        &lab.topology.control_plane().netns,
        "prometheus",
        prometheus,
        &[
            format!("--config.file={}", dir.join("prometheus.yml").display()),
            format!("--storage.tsdb.path={}", dir.join("data").display()),
            format!("--web.listen-address={PROMETHEUS}"),
        ],
        &[],
        &lab.run_dir.join("logs"),
    )?;
    server
        .wait_serving(PROMETHEUS, Duration::from_secs(30))
        .await?;
    wait_ready().await?;
    let loaded = rule_list().await?;
    let alerts = rules.matches("- alert: ").count();
    anyhow::ensure!(
        alerts > 0 && loaded.len() == alerts,
        "Prometheus loaded {} rules, the chart has {alerts} alerts",
        loaded.len()
    );

    progress("a Service with traffic");
    let mut web = ServicePlan::new("web", LbMode::Proxy);
    web.pods = lab
        .topology
        .pods()
        .iter()
        .map(|pod| pod.name.clone())
        .collect();
    lab.create_service(&web).await?;
    let vip = lab.wait_for_ingress(&web, Duration::from_secs(60)).await?;
    let spread = lab
        .http_requests(lab.topology.client_in_range(), vip, web.port, 20)
        .await?;
    anyhow::ensure!(spread.failed < 20, "no request got through: {spread:?}");

    progress("the cloud answers 429 while three Services are created at once");
    lab.cloud
        .set_faults(&Faults {
            rate_limit_per_second: Some(1),
            ..Faults::default()
        })
        .await?;
    for index in 0..3 {
        lab.create_service(&ServicePlan::new(&format!("burst-{index}"), LbMode::Proxy))
            .await?;
    }

    progress("another tool's chain holds the Service's chain on one node; the Service goes");
    let node = lab
        .topology
        .nodes()
        .first()
        .context("the lab has no node")?;
    let held = service_chain(&node.netns, &web).await?;
    iptables(&node.netns, &["-N", HOLDING_CHAIN]).await?;
    iptables(&node.netns, &["-A", HOLDING_CHAIN, "-j", &held]).await?;
    lab.delete_service(&web).await?;

    progress("waiting until every selector has series and every rule evaluated after that");
    let healthy = every_rule_finds_its_series(&loaded).await;

    // Put the lab back as the node proxy and the cloud would have it.
    iptables(&node.netns, &["-F", HOLDING_CHAIN]).await?;
    iptables(&node.netns, &["-X", HOLDING_CHAIN]).await?;
    lab.cloud.set_faults(&Faults::default()).await?;
    healthy
}

/// A metrics endpoint of one of the lab's processes, as Prometheus reaches it.
#[derive(Debug, Clone, PartialEq)]
struct Target {
    job: &'static str,
    address: SocketAddr,
}

/// Every endpoint a Tandem process of the lab listens on that answers `/metrics` with the
/// exposition format. Endpoints bound to a node's loopback are relayed to the node's
/// address (the relays are returned: they serve as long as they live).
async fn metrics_targets(lab: &Lab) -> Result<(Vec<Target>, Vec<NamespaceRelay>)> {
    let topology = &lab.topology;
    let control_plane = topology.control_plane();
    let mut hosts = vec![
        (&control_plane.netns, control_plane.ip),
        (&topology.edge().netns, topology.edge().node_network_ip),
    ];
    hosts.extend(topology.nodes().iter().map(|node| (&node.netns, node.ip)));
    let (mut targets, mut relays, mut scraped) = (Vec::new(), Vec::new(), Vec::new());
    for (netns, host_ip) in hosts {
        let listing = netns.exec_async(["ss", "-ltnpH"]).await?;
        for Socket { job, pid, listen } in listening(&String::from_utf8_lossy(&listing.stdout)) {
            // A process serving one registry on two ports (the controller's metrics and
            // health addresses) is scraped once.
            if scraped.contains(&pid) {
                continue;
            }
            let reachable = SocketAddr::new(IpAddr::V4(host_ip), listen.port());
            let (address, relay) = match listen.ip() {
                ip if ip.is_unspecified() => (reachable, None),
                ip if ip.is_loopback() && netns.name() != control_plane.netns.name() => {
                    let relay =
                        NamespaceRelay::start(Some(netns), netns, reachable, listen.to_string())?;
                    (reachable, Some(relay))
                }
                _ => (listen, None),
            };
            if serves_metrics(address).await {
                targets.push(Target { job, address });
                relays.extend(relay);
                scraped.push(pid);
            }
        }
    }
    Ok((targets, relays))
}

/// A listening TCP socket of one of Tandem's processes.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Socket {
    job: &'static str,
    pid: u32,
    listen: SocketAddr,
}

/// The TCP sockets of Tandem's processes in an `ss -ltnpH` listing.
fn listening(listing: &str) -> Vec<Socket> {
    listing
        .lines()
        .filter_map(|line| {
            let local = line.split_whitespace().nth(3)?;
            let local = local.replacen('*', "0.0.0.0", 1);
            let (process, rest) = line.split_once("users:((\"")?.1.split_once('"')?;
            let job = COMPONENTS
                .into_iter()
                .find(|name| !process.is_empty() && name.starts_with(process))?;
            let pid = rest.split_once("pid=")?.1.split(',').next()?.parse().ok()?;
            Some(Socket {
                job,
                pid,
                listen: local.parse().ok()?,
            })
        })
        .collect()
}

async fn serves_metrics(address: SocketAddr) -> bool {
    matches!(http_get(address, "/metrics").await, Ok((200, body)) if body.contains("# TYPE "))
}

fn config(targets: &[Target]) -> String {
    let mut config = format!(
        "global:\n  scrape_interval: {INTERVAL}\n  scrape_timeout: {INTERVAL}\n  \
         evaluation_interval: {INTERVAL}\nrule_files: [rules.yaml]\nscrape_configs:\n"
    );
    for job in COMPONENTS {
        let addresses: Vec<String> = targets
            .iter()
            .filter(|t| t.job == job)
            .map(|t| format!("'{}'", t.address))
            .collect();
        config.push_str(&format!(
            "  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
            addresses.join(", ")
        ));
    }
    config
}

/// The chart's alert rules as a Prometheus rule file: the PrometheusRule's `spec`, rendered
/// by Helm with the rule and the ServiceMonitors it needs enabled, every other value at its
/// default.
fn alert_rules() -> Result<String> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // The same Helm, at the same place, as the real-node test.
    let helm_dest = Path::new(env!("CARGO_TARGET_TMPDIR")).join("k3s-node/helm-3.9.4/helm");
    let helm = run(Command::new("bash")
        .arg(repo.join("tests/k3s/install-helm.sh"))
        .arg(&helm_dest))?;
    let rendered = run(Command::new(helm.trim())
        .args(["template", "tandem"])
        .arg(repo.join("charts/tandem"))
        .args([
            "--namespace=tandem-system",
            "--set=metrics.prometheusRule.enabled=true",
            "--set=metrics.serviceMonitor.enabled=true",
            "--show-only=templates/prometheusrule.yaml",
        ]))?;
    rule_file(&rendered)
}

/// The `spec` of a rendered PrometheusRule, moved to the top level.
fn rule_file(rendered: &str) -> Result<String> {
    let (_, spec) = rendered
        .split_once("\nspec:\n")
        .context("the rendered PrometheusRule has no spec")?;
    Ok(spec
        .lines()
        .map(|line| line.strip_prefix("  ").unwrap_or(line))
        .map(|line| format!("{line}\n"))
        .collect())
}

fn run(command: &mut Command) -> Result<String> {
    let output = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8(output.stdout)?)
}

fn on_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

/// Waits until Prometheus says it is ready (its rules loaded).
async fn wait_ready() -> Result<()> {
    let start = Instant::now();
    while !matches!(http_get(PROMETHEUS, "/-/ready").await, Ok((200, _))) {
        if start.elapsed() > Duration::from_secs(30) {
            bail!("Prometheus was not ready within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// One alerting rule as Prometheus reports it.
#[derive(Debug, Clone)]
struct Rule {
    name: String,
    query: String,
    health: String,
    last_error: String,
    last_evaluation: Timestamp,
}

async fn rule_list() -> Result<Vec<Rule>> {
    let rules = api("/api/v1/rules").await?;
    let text = |rule: &Value, field: &str| rule[field].as_str().unwrap_or_default().to_owned();
    rules["groups"]
        .as_array()
        .context("no rule groups")?
        .iter()
        .flat_map(|group| group["rules"].as_array().into_iter().flatten())
        .map(|rule| {
            Ok(Rule {
                name: text(rule, "name"),
                query: text(rule, "query"),
                health: text(rule, "health"),
                last_error: text(rule, "lastError"),
                last_evaluation: text(rule, "lastEvaluation")
                    .parse()
                    .context("a rule's lastEvaluation")?,
            })
        })
        .collect()
}

/// Waits until every Tandem metric selector of every rule returns series, then until every
/// rule has been evaluated after that, with health ok.
async fn every_rule_finds_its_series(rules: &[Rule]) -> Result<()> {
    let start = Instant::now();
    let mut wanted: Vec<(String, String)> = Vec::new();
    for rule in rules {
        let found = selectors(&rule.query);
        anyhow::ensure!(
            !found.is_empty(),
            "{} names no metric of Tandem's: {}",
            rule.name,
            rule.query
        );
        wanted.extend(found.into_iter().map(|s| (rule.name.clone(), s)));
    }
    let mut all_found: Option<Timestamp> = None;
    loop {
        let mut missing = Vec::new();
        for (rule, selector) in &wanted {
            if !has_series(selector).await? {
                missing.push(format!("{rule}: {selector}"));
            }
        }
        if missing.is_empty() && all_found.is_none() {
            all_found = Some(Timestamp::now());
        }
        let current = rule_list().await?;
        let unhealthy: Vec<String> = current
            .iter()
            .filter(|r| r.health != "ok" || all_found.is_none_or(|t| r.last_evaluation <= t))
            .map(|r| format!("{}: health {} {}", r.name, r.health, r.last_error))
            .collect();
        if let Some(broken) = current.iter().find(|r| r.health == "err") {
            bail!(
                "{} does not evaluate: {}\n{}",
                broken.name,
                broken.last_error,
                broken.query
            );
        }
        if all_found.is_some() && unhealthy.is_empty() {
            return Ok(());
        }
        if start.elapsed() > DEADLINE {
            let targets = api("/api/v1/targets").await?;
            if missing.is_empty() {
                bail!(
                    "after {DEADLINE:?}, rules not evaluated ok since every selector had \
                     series:\n{}",
                    unhealthy.join("\n")
                );
            }
            bail!(
                "after {DEADLINE:?}, selectors without series (a metric or label value the \
                 components do not export?):\n{}\nscrape targets: {}",
                missing.join("\n"),
                targets["activeTargets"]
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn has_series(selector: &str) -> Result<bool> {
    let series = api(&format!(
        "/api/v1/series?match[]={}",
        query_encode(selector)
    ))
    .await?;
    Ok(series.as_array().is_some_and(|s| !s.is_empty()))
}

/// The vector selectors of Tandem's metrics in a PromQL expression, each with its label
/// matchers: `tandem_controller_cloud_calls_total{outcome!="success"}`.
fn selectors(expr: &str) -> Vec<String> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut found = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find(|c: char| is_name(c)) {
        let tail = &rest[start..];
        let name_end = tail.find(|c: char| !is_name(c)).unwrap_or(tail.len());
        let mut end = name_end;
        if METRIC_PREFIXES.iter().any(|p| tail.starts_with(p)) && tail[name_end..].starts_with('{')
        {
            let mut quoted = false;
            let mut escaped = false;
            for (offset, c) in tail[name_end..].char_indices() {
                match c {
                    '\\' if quoted && !escaped => {
                        escaped = true;
                        continue;
                    }
                    '"' if !escaped => quoted = !quoted,
                    '}' if !quoted => {
                        end = name_end + offset + 1;
                        break;
                    }
                    _ => {}
                }
                escaped = false;
            }
        }
        if METRIC_PREFIXES.iter().any(|p| tail.starts_with(p)) {
            found.push(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    found.sort();
    found.dedup();
    found
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn query_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus API call's `data`.
async fn api(path: &str) -> Result<Value> {
    let (status, body) = http_get(PROMETHEUS, path).await?;
    let answer: Value =
        serde_json::from_str(&body).with_context(|| format!("{path} answered {status}: {body}"))?;
    if status != 200 || answer["status"] != "success" {
        bail!("{path} answered {status}: {body}");
    }
    Ok(answer["data"].clone())
}

/// `GET path`: the status code and the body.
async fn http_get(address: SocketAddr, path: &str) -> Result<(u16, String)> {
    Ok(tandem_netlab::http::get(address, path, Duration::from_secs(5)).await?)
}

/// The `KUBE-SVC-…` chain of the Service's first port on a node, once the node proxy wrote
/// it.
async fn service_chain(node: &Netns, plan: &ServicePlan) -> Result<String> {
    let service = plan.service();
    let port = service
        .spec
        .and_then(|spec| spec.ports?.into_iter().next()?.name)
        .context("the Service has no named port")?;
    let comment = format!("{}/{}:{port} cluster IP", plan.namespace, plan.name);
    let start = Instant::now();
    loop {
        let rules = iptables(node, &["-S", "KUBE-SERVICES"]).await?;
        let chain = rules
            .lines()
            .filter(|line| line.contains(&comment))
            .find_map(|line| line.split_once("-j KUBE-SVC-"))
            .and_then(|(_, hash)| hash.split_whitespace().next())
            .map(|hash| format!("KUBE-SVC-{hash}"));
        if let Some(chain) = chain {
            return Ok(chain);
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("no rule for {comment} in KUBE-SERVICES within 30 s:\n{rules}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `iptables -w -t nat ARGS` on a node; its output.
async fn iptables(node: &Netns, args: &[&str]) -> Result<String> {
    let argv = ["iptables", "-w", "-t", "nat"].iter().chain(args);
    let output = node.exec_async(argv).await?;
    if !output.status.success() {
        bail!(
            "iptables -t nat {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[test]
fn selectors_keep_their_matchers_and_skip_functions_and_labels() {
    let expr = "sum(rate(tandem_controller_cloud_calls_total{outcome!=\"success\"}[5m])) \
                / sum(rate(tandem_controller_cloud_calls_total[5m])) > 0.05 or \
                histogram_quantile(0.99, sum by (instance, le) \
                (rate(tandem_nodeproxy_network_programming_duration_seconds_bucket{a=\"}\\\"\"}[10m])))";
    assert_eq!(
        selectors(expr),
        [
            "tandem_controller_cloud_calls_total",
            "tandem_controller_cloud_calls_total{outcome!=\"success\"}",
            "tandem_nodeproxy_network_programming_duration_seconds_bucket{a=\"}\\\"\"}",
        ]
    );
    assert!(selectors("up{job=\"x\"} > 0").is_empty());
}

#[test]
fn the_rule_file_is_the_spec_at_the_top_level() {
    let rendered = "---\n# Source: x\nkind: PrometheusRule\nmetadata:\n  name: a\nspec:\n  \
                    groups:\n    - name: g\n      rules:\n        - alert: A\n";
    assert_eq!(
        rule_file(rendered).unwrap(),
        "groups:\n  - name: g\n    rules:\n      - alert: A\n"
    );
}

#[test]
fn tandem_sockets_are_found_by_process_name() {
    let listing = "LISTEN 0 1024 198.18.0.2:10257 0.0.0.0:* users:((\"tandem-controll\",pid=7,fd=9))\n\
                   LISTEN 0 1024 127.0.0.1:10249 0.0.0.0:* users:((\"tandem-nodeprox\",pid=8,fd=3))\n\
                   LISTEN 0 1024 *:10256 *:* users:((\"tandem-nodeprox\",pid=8,fd=4))\n\
                   LISTEN 0 128 127.0.0.1:9090 0.0.0.0:* users:((\"prometheus\",pid=9,fd=7))\n";
    let socket = |job, pid, listen: &str| Socket {
        job,
        pid,
        listen: listen.parse().unwrap(),
    };
    assert_eq!(
        listening(listing),
        [
            socket("tandem-controller", 7, "198.18.0.2:10257"),
            socket("tandem-nodeproxy", 8, "127.0.0.1:10249"),
            socket("tandem-nodeproxy", 8, "0.0.0.0:10256"),
        ]
    );
    assert_eq!(query_encode("a{b=\"c\"}"), "a%7Bb%3D%22c%22%7D");
}
