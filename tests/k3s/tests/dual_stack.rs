//! Dual-stack on the real API server: the k3s control plane's IP families, and what the real
//! kube-proxy v1.21 writes for dual-stack Services, kept as the node proxy's reference data.
//!
//! * The default control plane is IPv4 only; `ClusterFamilies::Dual` gives a Service one
//!   cluster IP per family, from the Service CIDR of that family.
//! * kube-proxy (`TANDEM_KUBE_PROXY`, iptables mode, its dual-stack proxier) runs in a
//!   network namespace of its own against a dual-stack control plane holding the API state
//!   that `nodeproxy/rules/tests/data/REFERENCE-README.md` describes; once it has synced,
//!   its `iptables-save` and `ip6tables-save` must match the stored reference files (in a
//!   canonical form: no counters or comments, chains sorted, and the Services' rules in the
//!   shared chains sorted by Service, where kube-proxy's order is Go's random map order).
//!   `TANDEM_UPDATE_REFERENCE=1` rewrites the files with the new capture instead.
//!
//! Needs root and `TANDEM_K3S` naming a k3s binary (and `TANDEM_KUBE_PROXY` for the
//! reference) when built: without them these tests are built ignored, and the summary
//! says so (`build.rs`). Each test starts its own control plane (about 5-10 s). kube-proxy,
//! its namespace (and with it every rule it wrote) and the control plane are removed on
//! success, failure and panic.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::Kubeconfig;
use serde_json::json;
use tandem_k3s::control_plane::{
    ClusterFamilies, ControlPlane, ControlPlaneOptions, OwnedNetns, cidr_list,
};
use tandem_netlab::{ChildGuard, Relay, plan_relay, write_kubeconfig};

/// Set to `1`: the reference test rewrites the stored files instead of comparing.
const UPDATE_ENV: &str = "TANDEM_UPDATE_REFERENCE";
/// The stored captures, relative to this crate.
const REFERENCE_DIR: &str = "../../nodeproxy/rules/tests/data";
const REFERENCE_IPV4: &str = "kube-proxy-v1.21-dualstack.iptables";
const REFERENCE_IPV6: &str = "kube-proxy-v1.21-dualstack.ip6tables";
/// The node kube-proxy runs as.
const NODE: &str = "node-a";
/// How long kube-proxy may take to write its first rules on a loaded machine.
const SYNC_TIMEOUT: Duration = Duration::from_secs(90);
/// KUBE-SVC chains of a synced kube-proxy: Service ports of the family with endpoints
/// (IPv4: nginx-service:http; IPv6: nginx-service:http and echo-v6:http).
const SVC_CHAINS_IPV4: usize = 1;
const SVC_CHAINS_IPV6: usize = 2;

/// The k3s binary (the tests needing it are built ignored without `TANDEM_K3S`).
fn k3s() -> Result<PathBuf> {
    tandem_k3s::k3s_for_test("dual-stack test")
}

async fn start(k3s: &Path, options: &ControlPlaneOptions) -> Result<ControlPlane> {
    ControlPlane::start(k3s, options)
        .await
        .with_context(|| format!("starting k3s from {}", k3s.display()))
}

/// Stops the control plane (blocking: off the runtime's workers) and passes `result` on.
async fn stop<T>(plane: ControlPlane, result: Result<T>) -> Result<T> {
    tokio::task::spawn_blocking(move || plane.stop()).await?;
    result
}

fn service(name: &str, policy: &str, families: &[&str]) -> Result<Service> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "ipFamilyPolicy": policy,
            "ipFamilies": families,
            "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
        },
    }))?)
}

/// The Service's cluster IPs, each checked to lie in the Service CIDR of its family.
fn cluster_ips(service: &Service, cidrs: &[IpNet]) -> Result<Vec<IpAddr>> {
    let spec = service.spec.as_ref().context("no spec")?;
    let ips = spec
        .cluster_ips
        .iter()
        .flatten()
        .map(|ip| {
            ip.parse::<IpAddr>()
                .with_context(|| format!("cluster IP {ip}"))
        })
        .collect::<Result<Vec<_>>>()?;
    for ip in &ips {
        ensure!(
            cidrs.iter().any(|cidr| cidr.contains(ip)),
            "cluster IP {ip} is outside the Service CIDRs {cidrs:?}"
        );
    }
    Ok(ips)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(tandem_k3s), ignore = "needs TANDEM_K3S naming a k3s binary")]
async fn a_dual_stack_control_plane_gives_a_service_a_cluster_ip_per_family() -> Result<()> {
    let k3s = k3s()?;
    let options = ControlPlaneOptions::new(ClusterFamilies::Dual);
    let plane = start(&k3s, &options).await?;
    let result = async {
        let services: Api<Service> = Api::namespaced(plane.client().await?, "default");
        let post = PostParams::default();

        let dual = services
            .create(
                &post,
                &service("dual", "RequireDualStack", &["IPv4", "IPv6"])?,
            )
            .await
            .context("creating a RequireDualStack Service")?;
        let ips = cluster_ips(&dual, &options.service_cidrs)?;
        ensure!(
            matches!(ips[..], [IpAddr::V4(_), IpAddr::V6(_)]),
            "a RequireDualStack Service got cluster IPs {ips:?}"
        );
        let spec = dual.spec.as_ref().context("no spec")?;
        ensure!(spec.cluster_ip == Some(ips[0].to_string()));
        ensure!(spec.ip_families == Some(vec!["IPv4".to_owned(), "IPv6".to_owned()]));

        // The IPv6 family alone, and the primary family when none is named.
        let v6 = services
            .create(&post, &service("v6", "SingleStack", &["IPv6"])?)
            .await
            .context("creating an IPv6 Service")?;
        let ips = cluster_ips(&v6, &options.service_cidrs)?;
        ensure!(matches!(ips[..], [IpAddr::V6(_)]), "IPv6 Service: {ips:?}");
        let unnamed = services
            .create(&post, &service("unnamed", "SingleStack", &[])?)
            .await
            .context("creating a Service naming no family")?;
        let ips = cluster_ips(&unnamed, &options.service_cidrs)?;
        ensure!(
            matches!(ips[..], [IpAddr::V4(_)]),
            "no family named: {ips:?}"
        );
        Ok(())
    }
    .await;
    stop(plane, result).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(not(tandem_k3s), ignore = "needs TANDEM_K3S naming a k3s binary")]
async fn the_default_control_plane_is_ipv4_only() -> Result<()> {
    let k3s = k3s()?;
    let options = ControlPlaneOptions::default();
    let plane = start(&k3s, &options).await?;
    let result = async {
        let services: Api<Service> = Api::namespaced(plane.client().await?, "default");
        let post = PostParams::default();
        let preferred = services
            .create(&post, &service("preferred", "PreferDualStack", &[])?)
            .await
            .context("creating a PreferDualStack Service")?;
        let ips = cluster_ips(&preferred, &options.service_cidrs)?;
        ensure!(
            matches!(ips[..], [IpAddr::V4(_)]),
            "PreferDualStack: {ips:?}"
        );
        let required = services
            .create(&post, &service("required", "RequireDualStack", &[])?)
            .await;
        ensure!(
            matches!(&required, Err(kube::Error::Api(status)) if status.code == 422),
            "an IPv4-only cluster took a RequireDualStack Service: {required:?}"
        );
        Ok(())
    }
    .await;
    stop(plane, result).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(all(tandem_k3s, tandem_kube_proxy)),
    ignore = "needs TANDEM_K3S and TANDEM_KUBE_PROXY naming k3s and kube-proxy binaries"
)]
async fn kube_proxy_v1_21_dual_stack_rules_match_the_reference() -> Result<()> {
    let k3s = k3s()?;
    let kube_proxy = tandem_k3s::kube_proxy_binary()
        .with_context(|| format!("{} names no kube-proxy binary", tandem_k3s::KUBE_PROXY_ENV))?;
    // The reference's Service CIDRs: IPv4 as in the single-stack reference (so the same
    // Service has the same cluster IP there), IPv6 the dual-stack control plane's.
    let options = ControlPlaneOptions {
        service_cidrs: vec![
            tandem_k3s::SERVICE_CIDR.parse()?,
            IpNet::V6(tandem_k3s::control_plane::SERVICE_CIDR_V6),
        ],
        ..ControlPlaneOptions::new(ClusterFamilies::Dual)
    };
    let plane = start(&k3s, &options).await?;
    let result = async {
        write_reference_state(&plane.client().await?).await?;
        let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kube-proxy-reference");
        let capture = capture_kube_proxy_rules(&plane, &kube_proxy, &options, &work).await?;
        keep_or_compare(&capture)
    }
    .await;
    stop(plane, result).await
}

/// The API state of the reference (REFERENCE-README.md says the same in words).
async fn write_reference_state(client: &kube::Client) -> Result<()> {
    let post = PostParams::default();
    let merge = PatchParams::default();
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &post,
            &serde_json::from_value(json!({
                "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
            }))?,
        )
        .await
        .context("creating the Node")?;
    nodes
        .patch_status(
            NODE,
            &merge,
            &Patch::Merge(json!({"status": {"addresses": [
                {"type": "InternalIP", "address": "198.18.0.11"},
                {"type": "InternalIP", "address": "2001:db8:18::11"},
                {"type": "Hostname", "address": NODE},
            ]}})),
        )
        .await
        .context("writing the Node's addresses")?;

    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let dual_stack = json!({
        "metadata": {"name": "nginx-service"},
        "spec": {
            "type": "LoadBalancer",
            "ipFamilyPolicy": "RequireDualStack",
            "ipFamilies": ["IPv4", "IPv6"],
            "clusterIP": "10.43.35.197",
            "clusterIPs": ["10.43.35.197", "fd00:10:96::197"],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80,
                       "nodePort": 30166}],
            "loadBalancerSourceRanges": ["203.0.113.0/24", "2001:db8:203::/64"],
            "externalTrafficPolicy": "Cluster",
        },
    });
    let ipv6_local = json!({
        "metadata": {"name": "echo-v6"},
        "spec": {
            "type": "LoadBalancer",
            "ipFamilyPolicy": "SingleStack",
            "ipFamilies": ["IPv6"],
            "clusterIP": "fd00:10:96::80",
            "clusterIPs": ["fd00:10:96::80"],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080,
                       "nodePort": 30380}],
            "externalTrafficPolicy": "Local",
            "healthCheckNodePort": 30381,
        },
    });
    // No EndpointSlice: what kube-proxy rejects, and how, in IPv6.
    let ipv6_without_endpoints = json!({
        "metadata": {"name": "empty-v6"},
        "spec": {
            "type": "LoadBalancer",
            "ipFamilyPolicy": "SingleStack",
            "ipFamilies": ["IPv6"],
            "clusterIP": "fd00:10:96::81",
            "clusterIPs": ["fd00:10:96::81"],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80,
                       "nodePort": 30480}],
            "externalTrafficPolicy": "Cluster",
        },
    });
    for (service, ingress) in [
        (
            dual_stack,
            json!([{"ip": "198.51.100.20"}, {"ip": "2001:db8:51:100::20"}]),
        ),
        (ipv6_local, json!([{"ip": "2001:db8:51:100::21"}])),
        (
            ipv6_without_endpoints,
            json!([{"ip": "2001:db8:51:100::22"}]),
        ),
    ] {
        let service: Service = serde_json::from_value(service)?;
        let name = service.metadata.name.clone().unwrap_or_default();
        let created = services
            .create(&post, &service)
            .await
            .with_context(|| format!("creating Service {name}"))?;
        ensure!(
            created.spec.as_ref().and_then(|s| s.cluster_ips.as_ref())
                == service.spec.as_ref().and_then(|s| s.cluster_ips.as_ref()),
            "Service {name} did not get the cluster IPs asked for: {:?}",
            created.spec
        );
        services
            .patch_status(
                &name,
                &merge,
                &Patch::Merge(json!({"status": {"loadBalancer": {"ingress": ingress}}})),
            )
            .await
            .with_context(|| format!("writing the ingress of Service {name}"))?;
    }

    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    for (service, family, port, endpoints) in [
        (
            "nginx-service",
            "IPv4",
            80,
            [("10.244.1.5", NODE), ("10.244.2.7", "node-b")],
        ),
        (
            "nginx-service",
            "IPv6",
            80,
            [("fd00:10:244:1::5", NODE), ("fd00:10:244:2::7", "node-b")],
        ),
        (
            "echo-v6",
            "IPv6",
            8080,
            [("fd00:10:244:1::8", NODE), ("fd00:10:244:2::9", "node-b")],
        ),
    ] {
        let name = format!("{service}-{}", family.to_lowercase());
        let endpoints: Vec<_> = endpoints
            .iter()
            .map(|(ip, node)| {
                json!({"addresses": [ip], "conditions": {"ready": true}, "nodeName": node})
            })
            .collect();
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/service-name": service,
                    "endpointslice.kubernetes.io/managed-by": "tandem-k3s-tests",
                },
            },
            "addressType": family,
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": endpoints,
        }))?;
        slices
            .create(&post, &slice)
            .await
            .with_context(|| format!("creating EndpointSlice {name}"))?;
    }
    Ok(())
}

/// What kube-proxy wrote, as `iptables-save` and `ip6tables-save` print it.
struct Capture {
    ipv4: String,
    ipv6: String,
}

/// kube-proxy, in a network namespace of its own, and what it needs there; dropped in
/// field order: kube-proxy killed, the relay closed, the namespace (and every rule in it)
/// deleted.
struct KubeProxyRun {
    process: ChildGuard,
    _relay: Relay,
    netns: OwnedNetns,
    log: PathBuf,
}

/// Starts kube-proxy against the control plane, waits until both of its proxiers have
/// written their Services' chains and the rules hold still, and returns them.
async fn capture_kube_proxy_rules(
    plane: &ControlPlane,
    kube_proxy: &Path,
    options: &ControlPlaneOptions,
    work: &Path,
) -> Result<Capture> {
    // Kept until the next run, for the log.
    if work.exists() {
        std::fs::remove_dir_all(work).with_context(|| format!("clearing {}", work.display()))?;
    }
    std::fs::create_dir_all(work).with_context(|| format!("creating {}", work.display()))?;
    let netns = OwnedNetns::create("kube-proxy")?;
    // The API server as 127.0.0.1:6443 inside kube-proxy's namespace.
    let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, 6443));
    let original = Kubeconfig::read_from(plane.kubeconfig())?;
    let plan = plan_relay(&original, listen)?;
    let kubeconfig = work.join("kubeconfig.json");
    write_kubeconfig(&kubeconfig, &plan.kubeconfig)?;
    let relay = Relay::start(netns.netns(), listen, plan.upstream).await?;
    let log = work.join("kube-proxy.log");
    let out = std::fs::File::create(&log)?;
    let mut cmd = netns.netns().command(kube_proxy);
    cmd.args(tandem_k3s::kube_proxy_args(
        &kubeconfig,
        NODE,
        &cidr_list(&options.cluster_cidrs),
    ))
    .args(["--feature-gates", "IPv6DualStack=true"])
    .stdin(Stdio::null())
    .stdout(out.try_clone()?)
    .stderr(out);
    let process = ChildGuard::spawn(cmd)?;
    let mut run = KubeProxyRun {
        process,
        _relay: relay,
        netns,
        log,
    };
    let captured = tokio::task::spawn_blocking(move || {
        let captured = run.wait_for_rules();
        (run, captured)
    })
    .await?;
    let (run, captured) = captured;
    let captured = captured.with_context(|| {
        format!(
            "kube-proxy's rules; last lines of {}:\n{}",
            run.log.display(),
            tandem_k3s::node::tail(&run.log, 30)
        )
    });
    drop(run);
    captured
}

impl KubeProxyRun {
    fn save(&self, command: &str) -> Result<String> {
        Ok(self.netns.netns().exec_checked([command])?)
    }

    /// Polls until both tables hold the expected KUBE-SVC chains, then until two captures
    /// a second apart agree.
    fn wait_for_rules(&mut self) -> Result<Capture> {
        let deadline = Instant::now() + SYNC_TIMEOUT;
        let mut previous: Option<Capture> = None;
        loop {
            if let Some(status) = self.process.try_wait()? {
                bail!("kube-proxy exited ({status})");
            }
            let capture = Capture {
                ipv4: self.save("iptables-save")?,
                ipv6: self.save("ip6tables-save")?,
            };
            let synced = svc_chains(&capture.ipv4) == SVC_CHAINS_IPV4
                && svc_chains(&capture.ipv6) == SVC_CHAINS_IPV6;
            if synced {
                if let Some(previous) = &previous
                    && canonical(&previous.ipv4) == canonical(&capture.ipv4)
                    && canonical(&previous.ipv6) == canonical(&capture.ipv6)
                {
                    return Ok(capture);
                }
                previous = Some(capture);
            } else {
                previous = None;
            }
            if Instant::now() > deadline {
                bail!(
                    "kube-proxy did not write {SVC_CHAINS_IPV4} IPv4 and {SVC_CHAINS_IPV6} \
                     IPv6 KUBE-SVC chains that held still within {SYNC_TIMEOUT:?}"
                );
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

fn svc_chains(dump: &str) -> usize {
    dump.lines()
        .filter(|line| line.starts_with(":KUBE-SVC-"))
        .count()
}

/// Rewrites the stored files with `capture` when asked to, else compares with them.
fn keep_or_compare(capture: &Capture) -> Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(REFERENCE_DIR);
    let files = [
        (REFERENCE_IPV4, &capture.ipv4),
        (REFERENCE_IPV6, &capture.ipv6),
    ];
    if std::env::var(UPDATE_ENV).as_deref() == Ok("1") {
        for (name, text) in files {
            let path = dir.join(name);
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        return Ok(());
    }
    let mut differences = Vec::new();
    for (name, text) in files {
        let path = dir.join(name);
        let stored = std::fs::read_to_string(&path).with_context(|| {
            format!("reading {} (write it with {UPDATE_ENV}=1)", path.display())
        })?;
        if let Some(difference) = difference(&canonical(&stored), &canonical(text)) {
            differences.push(format!("{name}:\n{difference}"));
        }
    }
    ensure!(
        differences.is_empty(),
        "kube-proxy's rules differ from the stored reference (after {UPDATE_ENV}=1, review \
         the change):\n{}",
        differences.join("\n")
    );
    Ok(())
}

/// `iptables-save` output as two runs of kube-proxy on the same API state write it alike:
/// comments, `COMMIT` lines and counters left out; tables, chain declarations and chains
/// sorted by name; in each chain, every run of consecutive rules that name a Service port
/// in their comment sorted by that name, each Service's rules keeping their order (kube-proxy
/// v1.21 writes the Services into the shared chains in Go's random map order).
fn canonical(dump: &str) -> String {
    #[derive(Default)]
    struct Table<'a> {
        declarations: BTreeSet<String>,
        chains: BTreeMap<&'a str, Vec<&'a str>>,
    }
    let mut tables: BTreeMap<&str, Table> = BTreeMap::new();
    let mut current = None;
    for line in dump.lines() {
        if let Some(name) = line.strip_prefix('*') {
            current = Some(name);
            tables.entry(name).or_default();
            continue;
        }
        let Some(table) = current.and_then(|name| tables.get_mut(name)) else {
            continue;
        };
        if let Some(declaration) = line.strip_prefix(':') {
            let without_counters: Vec<&str> = declaration
                .split_whitespace()
                .filter(|word| !word.starts_with('['))
                .collect();
            table.declarations.insert(without_counters.join(" "));
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let (chain, rule) = rule.split_once(' ').unwrap_or((rule, ""));
            table.chains.entry(chain).or_default().push(rule);
        }
    }
    let mut out = String::new();
    for (name, mut table) in tables {
        out.push_str(&format!("*{name}\n"));
        for declaration in &table.declarations {
            out.push_str(&format!(":{declaration}\n"));
        }
        for (chain, rules) in &mut table.chains {
            sort_service_runs(rules);
            for rule in rules.iter() {
                out.push_str(&format!("-A {chain} {rule}\n"));
            }
        }
    }
    out
}

/// Sorts each run of consecutive rules naming a Service port by that name (stably).
fn sort_service_runs(rules: &mut [&str]) {
    let mut start = 0;
    while start < rules.len() {
        let run = rules[start..]
            .iter()
            .take_while(|rule| service_port(rule).is_some())
            .count();
        rules[start..start + run].sort_by_key(|rule| service_port(rule));
        start += run.max(1);
    }
}

/// The `namespace/name:port` a rule's comment starts with, if it does.
fn service_port(rule: &str) -> Option<&str> {
    let (_, comment) = rule.split_once("--comment \"")?;
    let first = comment.split([' ', '"']).next()?;
    first.contains('/').then_some(first)
}

/// The lines only one of two canonical dumps has, or that they order differently.
fn difference(stored: &str, captured: &str) -> Option<String> {
    if stored == captured {
        return None;
    }
    let stored_lines: BTreeSet<&str> = stored.lines().collect();
    let captured_lines: BTreeSet<&str> = captured.lines().collect();
    let mut out: Vec<String> = stored_lines
        .difference(&captured_lines)
        .map(|line| format!("- {line}"))
        .chain(
            captured_lines
                .difference(&stored_lines)
                .map(|line| format!("+ {line}")),
        )
        .collect();
    if out.is_empty() {
        out.push(format!(
            "the same lines in another order; stored:\n{stored}\ncaptured:\n{captured}"
        ));
    }
    Some(out.join("\n"))
}

#[test]
fn the_canonical_form_ignores_what_kube_proxy_does_not_decide() {
    let one = "# Generated by iptables-save v1.8.9 on Mon\n*nat\n\
               :PREROUTING ACCEPT [12:720]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-A - [0:0]\n\
               -A KUBE-SERVICES -d 10.43.0.2/32 -m comment --comment \"ns/b:http cluster IP\" -j KUBE-MARK-MASQ\n\
               -A KUBE-SERVICES -d 10.43.0.2/32 -m comment --comment \"ns/b:http cluster IP\" -j KUBE-SVC-B\n\
               -A KUBE-SERVICES -d 10.43.0.1/32 -m comment --comment \"ns/a:http cluster IP\" -j KUBE-SVC-A\n\
               -A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: last\" -j KUBE-NODEPORTS\n\
               -A PREROUTING -j KUBE-SERVICES\nCOMMIT\n*filter\n:INPUT ACCEPT [3:4]\nCOMMIT\n";
    let other = "*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n*nat\n\
                 :KUBE-SVC-A - [0:0]\n:KUBE-SERVICES - [0:0]\n:PREROUTING ACCEPT [0:0]\n\
                 -A PREROUTING -j KUBE-SERVICES\n\
                 -A KUBE-SERVICES -d 10.43.0.1/32 -m comment --comment \"ns/a:http cluster IP\" -j KUBE-SVC-A\n\
                 -A KUBE-SERVICES -d 10.43.0.2/32 -m comment --comment \"ns/b:http cluster IP\" -j KUBE-MARK-MASQ\n\
                 -A KUBE-SERVICES -d 10.43.0.2/32 -m comment --comment \"ns/b:http cluster IP\" -j KUBE-SVC-B\n\
                 -A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: last\" -j KUBE-NODEPORTS\n\
                 COMMIT\n";
    assert_eq!(canonical(one), canonical(other));
    assert_eq!(difference(&canonical(one), &canonical(other)), None);

    // A Service's own rule order, the place of a rule naming no Service, and any rule
    // text are kube-proxy's decisions.
    let swapped_in_service = other.replace(
        "-j KUBE-MARK-MASQ\n-A KUBE-SERVICES -d 10.43.0.2/32 -m comment --comment \"ns/b:http cluster IP\" -j KUBE-SVC-B",
        "-j KUBE-SVC-B\n-A KUBE-SERVICES -d 10.43.0.2/32 -m comment --comment \"ns/b:http cluster IP\" -j KUBE-MARK-MASQ",
    );
    let nodeports_first = other
        .replace(
            "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: last\" -j KUBE-NODEPORTS\n",
            "",
        )
        .replace(
            "-A PREROUTING -j KUBE-SERVICES\n",
            "-A PREROUTING -j KUBE-SERVICES\n-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: last\" -j KUBE-NODEPORTS\n",
        );
    let other_rule = other.replace("10.43.0.1/32", "10.43.0.9/32");
    for changed in [swapped_in_service, nodeports_first, other_rule] {
        assert_ne!(changed, other);
        let difference = difference(&canonical(other), &canonical(&changed));
        assert!(difference.is_some(), "{changed}");
    }
}
