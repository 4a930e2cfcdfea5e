//! Tandem on a real node: k3s (kubelet, containerd, runc pods) in a network namespace, the
//! chart's default images built by `scripts/images.sh` and imported into the node, the
//! chart installed by the real Helm with the values docs/install.md documents, the mock
//! cloud (with its own L4 data plane, later restarted on its store with HAProxy serving
//! proxy mode) in the cloud edge's namespace and the outside clients in
//! theirs (tandem_netlab's topology: node 198.18.0.11, edge 198.18.0.1, client c1
//! 203.0.113.10 inside the source range, c2 192.0.2.10 outside).
//!
//! Needs root, `TANDEM_K3S` naming a k3s binary, the workspace's binaries built (`cargo
//! build --workspace --bins`), Debian's containerd (for its runc shim), runc,
//! containernetworking-plugins, busybox-static, conntrack, iptables, nftables, buildah,
//! podman and mmdebstrap (the images), haproxy (the edge's HAProxy), curl, python3-venv
//! (Helm from its PyPI wheel). Without
//! `--ignored` the test is reported skipped (ignored); asked for without `TANDEM_K3S`, it
//! fails.
//!
//! Run: `TANDEM_K3S=/path/to/k3s cargo test -p tandem-k3s --test node -- --ignored --nocapture`
//! (`TANDEM_K3S_IMAGES=local` skips rebuilding the chart's images). Logs (k3s, cloud-mock,
//! manifests) stay under `target/tmp/k3s-node/` until the next run.
//!
//! During a `helm upgrade` to a new image tag (the chart's images retagged, so the
//! DaemonSet and the Deployment roll), `tandem-traffic` (the lab's client traffic) sends
//! 20 new connections a second through each LB mode's VIP and keeps one long-lived
//! connection through each, to the echo pods' TCP echo: no request may fail and neither
//! connection may break.
//!
//! Before the chart, kube-proxy (`TANDEM_KUBE_PROXY`; CI's is v1.21.2), in iptables mode,
//! serves the node while a client sends through a NodePort; the chart then takes over as
//! docs/install.md's move from kube-proxy says (kube-proxy stopped, its rules left, the
//! chart installed). Near the end the way back is walked with the controller still
//! serving: the node proxy disabled, kube-proxy started, Tandem's nftables table deleted,
//! under traffic through both VIPs and the NodePort. Each direction must fail no request.
//! Without `TANDEM_KUBE_PROXY` both directions are reported skipped.
//!
//! Every `kubectl` and `curl` command of README, docs/, the chart's README and NOTES (as
//! Helm rendered them) that is not marked as an illustration runs here, placeholders
//! filled in (`tandem_k3s::docs`), and must succeed.
//!
//! Each of the chart's ServiceAccounts is granted, as the API server answers for it, exactly
//! the API permissions its component's code lists (`permissions.rs` of the controller and
//! of the node proxy), in the release namespace and in another.
//!
//! Every check is a named step; a failed check is reported and the checks that do not
//! depend on it still run, then the test fails listing every failed step. All traffic stays
//! inside the topology's namespaces; the node, its pods and the namespaces are removed on
//! success, failure and panic (and a dead run's leftovers at the next start).

use std::collections::BTreeSet;
use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use tandem_common::permissions::{Permission, Scope};
use tandem_k3s::chart::{
    Binaries, CLOUD_PORT, ClientTraffic, Kube, LongLived, MODE_ANNOTATION, NAMESPACE, RELEASE,
    SavedImages, TCP_ECHO_PORT, cloud_lbs, dropped, finish_traffic, helm_run, http_get,
    install_helm, install_values, save_images, seccomp_values, spread, start_cloud,
};
use tandem_k3s::docs::{self, DocCommand, Placeholders};
use tandem_k3s::node::{K3sNode, NodeConfig, NodeRole, checked, run_name, tail};
use tandem_k3s::{CLUSTER_CIDR, SERVICE_CIDR, wait_for};
use tandem_netlab::{ChildGuard, Topology};

const SOURCE_RANGE: &str = "203.0.113.0/24";
const ECHO_REPLICAS: usize = 3;
/// The Namespace the documents' commands run in (the kubeconfig's default there), so that
/// their Deployments and Services meet none of the test's own.
const DOCS_NAMESPACE: &str = "docs";
/// Documented commands that make sense at one step only, where the scenario runs them.
const RELEASE_JOB_LOG: &str = "kubectl -n tandem-system logs job/tandem-release";
const DELETE_LEASE: &str =
    "kubectl -n tandem-system delete lease tandem-controller --ignore-not-found";
/// The kubelet's own iptables chains (v1.21), which nothing of Tandem's may change.
const KUBELET_CHAINS: [&str; 5] = [
    "KUBE-FIREWALL",
    "KUBE-MARK-DROP",
    "KUBE-MARK-MASQ",
    "KUBE-POSTROUTING",
    "KUBE-KUBELET-CANARY",
];
/// Chains the node proxy writes in iptables mode (prefixes); none may stay after cleanup.
const PROXY_CHAINS: [&str; 8] = [
    "KUBE-PROXY-FIREWALL",
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-SVC-",
    "KUBE-SEP-",
    "KUBE-FW-",
    "KUBE-XLB-",
    "KUBE-EXT-",
];

// Ignored unless asked for, so that without a k3s it reports itself skipped, never passed.
#[test]
#[ignore = "needs a real k3s: TANDEM_K3S=/path/to/k3s cargo test -p tandem-k3s --test node -- --ignored"]
fn tandem_on_a_real_k3s_node() -> Result<()> {
    let k3s = tandem_k3s::k3s_for_test("real-node test")?;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_test_writer()
        .try_init();
    let mut steps = Steps::new();
    let result = scenario(&mut steps, &k3s);
    steps.finish(result)
}

fn scenario(steps: &mut Steps, k3s: &Path) -> Result<()> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let base = Path::new(env!("CARGO_TARGET_TMPDIR")).join("k3s-node");
    tandem_k3s::node::remove_stale(&base);
    let work = base.join(run_name("test"));
    std::fs::create_dir_all(&work).context("creating the test's directory")?;
    eprintln!("logs and manifests: {}", work.display());

    let bins = steps.must("the workspace's binaries are built", Binaries::locate)?;
    let documented = steps.must(
        "the commands of README, docs/ and the chart's README",
        || documented_commands(&repo),
    )?;
    let helm = steps.must("Helm 3.9.4 from its PyPI wheel", || {
        install_helm(&repo, Path::new(env!("CARGO_TARGET_TMPDIR")))
    })?;
    let SavedImages {
        archives: images,
        upgrade_tag,
    } = steps.must("images: test images and the chart's images", || {
        save_images(&repo, &work.join("images"))
    })?;
    let topology = steps.must("network topology: node, cloud edge, two clients", || {
        Topology::builder()
            .nodes(1)
            .pods_per_node(&[0])
            .without_echo()
            .build()
            .map_err(anyhow::Error::from)
    })?;
    let node_ns = topology.node(1)?.clone();
    let edge = topology.edge().clone();
    let cloud_addr = SocketAddrV4::new(edge.node_network_ip, CLOUD_PORT);
    let mut cloud = Some(steps.must("mock cloud in the cloud edge", || {
        start_cloud(&bins.cloud_mock, &edge.netns, cloud_addr, &work, "proxy")
    })?);

    let mut node = steps.must("k3s node starts", || {
        K3sNode::start(NodeConfig {
            k3s: k3s.to_path_buf(),
            netns: node_ns.netns.clone(),
            name: node_ns.name.clone(),
            role: NodeRole::Server,
            ip: node_ns.ip,
            pod_subnet: node_ns.pod_cidr,
            bridge: "cni0".to_owned(),
            cluster_cidr: CLUSTER_CIDR.parse()?,
            service_cidr: SERVICE_CIDR.parse()?,
            images,
            // The node proxy replaces kube-proxy (docs/install.md).
            extra_args: vec!["--disable-kube-proxy".to_owned()],
            base_dir: base.clone(),
        })
        .map_err(anyhow::Error::from)
    })?;
    eprintln!("k3s log: {}", node.log().display());
    // The node holds its own links to the archives.
    let _ = std::fs::remove_dir_all(work.join("images"));
    steps.must("node is Ready", || {
        node.wait_ready(Duration::from_secs(120))
            .map(|took| eprintln!("  node Ready {took:.1?} after start"))
            .map_err(anyhow::Error::from)
    })?;
    let kube = Kube {
        node: &node,
        work: &work,
    };
    steps.must("echo pods and a client pod are Running", || {
        kube.wait_default_service_account()?;
        kube.apply("workloads.yaml", &workloads())?;
        kube.wait_pods_ready(
            "default",
            "app=echo",
            ECHO_REPLICAS,
            Duration::from_secs(90),
        )?;
        kube.wait_pods_ready("default", "app=client", 1, Duration::from_secs(60))
    })?;
    let kubelet_rules = steps.must(
        "the kubelet's own iptables chains, before the chart",
        || {
            let rules = kubelet_chains(&node)?;
            ensure!(
                rules.contains("block incoming localnet connections"),
                "KUBE-FIREWALL lacks the kubelet's localnet rule:\n{rules}"
            );
            Ok(rules)
        },
    )?;

    let c1 = topology.client_in_range().netns.clone();
    let c2 = topology.client_out_of_range().netns.clone();
    let node_port_traffic = || -> Result<ClientTraffic> {
        match kube.node_ports("echo-nodeport")?[..] {
            [http, tcp_echo] => ClientTraffic::start(&bins.traffic, &c1, http, tcp_echo, &work),
            ref ports => bail!("echo-nodeport has node ports {ports:?}"),
        }
    };

    // The move from kube-proxy to Tandem (docs/install.md): kube-proxy serves the node
    // first, with the Services in place, while a client sends through a NodePort.
    kube.apply("services.yaml", &services())?;
    let kube_proxy_binary = tandem_k3s::kube_proxy_binary();
    if kube_proxy_binary.is_none() {
        eprintln!(
            "SKIPPED: the move from kube-proxy to Tandem and back ({} names no kube-proxy binary)",
            tandem_k3s::KUBE_PROXY_ENV
        );
    }
    let (mut kube_proxy, move_traffic) = kube_proxy_binary
        .as_deref()
        .and_then(|binary| {
            steps.check(
                "kube-proxy serves the node (iptables mode), a client sends through a NodePort",
                || {
                    Ok((
                        KubeProxy::start(&node, binary, &work)?,
                        node_port_traffic()?,
                    ))
                },
            )
        })
        .unzip();

    let chart = repo.join("charts/tandem");
    let cloud_url = format!("http://{cloud_addr}");
    steps.must("helm install with the documented values", || {
        // kube-proxy stops first (its DaemonSet deleted); its rules stay and serve until
        // the node proxy's first sync takes their chains over.
        drop(kube_proxy.take());
        let mut cmd = node.command(&helm);
        cmd.args(["install", RELEASE])
            .arg(&chart)
            .args(["-n", NAMESPACE, "--create-namespace"])
            .args(install_values(node.ip(), &cloud_url))
            .args(seccomp_values(&kube)?);
        helm_run(cmd, &kube)?;
        kube.wait_release_ready(Duration::from_secs(120))
    })?;
    if let Some(client) = move_traffic {
        steps.check(
            "from kube-proxy to Tandem under traffic through a NodePort: 0 failed requests, the long-lived connection kept",
            || finish_traffic([(client, LongLived::MustLast)]),
        );
    }
    note_kubelet_chains(
        &node,
        &kubelet_rules,
        "with the chart installed (iptables mode)",
    );
    steps.check(
        "each ServiceAccount may do exactly what its code asks for, in its namespace and in another",
        || {
            let accounts = [
                ("controller", tandem_controller::permissions::PERMISSIONS),
                ("nodeproxy", tandem_nodeproxy::permissions::PERMISSIONS),
            ];
            for (component, permissions) in accounts {
                for namespace in [NAMESPACE, "default"] {
                    check_granted(&node, component, permissions, namespace)?;
                }
            }
            Ok(())
        },
    );
    steps.check("node proxy /healthz answers 200 on the node", || {
        let reply = http_get(
            node.netns(),
            SocketAddrV4::new(node.ip(), 10256),
            "/healthz",
            None,
        )?;
        ensure!(
            reply.status == 200,
            "status {}: {}",
            reply.status,
            reply.body
        );
        Ok(())
    });

    let proxy_vip = steps.check("proxy-mode Service gets its EXTERNAL-IP", || {
        kube.wait_ingress("echo-proxy", Duration::from_secs(90))
    });
    let passthrough_vip = steps.check("passthrough Service gets its EXTERNAL-IP", || {
        kube.wait_ingress("echo-passthrough", Duration::from_secs(90))
    });
    let traffic = |steps: &mut Steps, mode: &str| {
        if let Some(vip) = proxy_vip {
            steps.check(
                &format!("{mode}: proxy-mode VIP answers the client, spread over the pods"),
                || spread(&c1, vip, 24),
            );
        }
        if let Some(vip) = passthrough_vip {
            steps.check(
                &format!("{mode}: passthrough VIP answers the client, spread over the pods"),
                || spread(&c1, vip, 24),
            );
            steps.check(
                &format!("{mode}: a client outside loadBalancerSourceRanges is dropped"),
                || dropped(&c2, vip),
            );
        }
        steps.check(
            &format!("{mode}: ClusterIP and NodePort from the node"),
            || {
                let (cluster_ip, node_port) = kube.cluster_ip_and_node_port("echo-nodeport")?;
                spread(node.netns(), cluster_ip, 12)?;
                let nodeport = SocketAddrV4::new(node.ip(), node_port);
                http_get(node.netns(), nodeport, "/cgi-bin/echo", None)
                    .and_then(|r| r.echo())
                    .with_context(|| format!("NodePort {nodeport}"))?;
                Ok(())
            },
        );
        steps.check(
            &format!("{mode}: ClusterIP and NodePort from a pod"),
            || {
                let (cluster_ip, node_port) = kube.cluster_ip_and_node_port("echo-nodeport")?;
                for target in [
                    format!("{cluster_ip}:80"),
                    format!("{}:{node_port}", node.ip()),
                ] {
                    // Static busybox's wget crashes (glibc's NSS in a static binary):
                    // a hand-written request through nc instead.
                    let (host, port) = target.split_once(':').unwrap_or((&target, "80"));
                    let out = node.kubectl([
                        "exec",
                        "client",
                        "--",
                        "sh",
                        "-c",
                        &format!(
                            r"printf 'GET /cgi-bin/echo HTTP/1.0\r\n\r\n' | nc -w 3 {host} {port}"
                        ),
                    ])?;
                    ensure!(
                        out.contains("pod=echo-"),
                        "{target} from the client pod: {out:?}"
                    );
                }
                Ok(())
            },
        );
    };
    traffic(steps, "iptables");

    if let Some(vip) = proxy_vip {
        steps.check(
            "every command of README, docs/, the chart's README and its NOTES runs on the cluster, but the illustrations",
            || {
                let notes = checked({
                    let mut cmd = node.command(&helm);
                    cmd.args(["get", "notes", RELEASE, "-n", NAMESPACE]);
                    cmd
                })?;
                let notes = docs::in_plain_text("NOTES.txt as rendered", &notes);
                let kubeconfig = work.join("docs-kubeconfig.yaml");
                std::fs::copy(node.kubeconfig(), &kubeconfig)?;
                node.kubectl(["create", "namespace", DOCS_NAMESPACE])?;
                node.kubectl([
                    "config".as_ref(),
                    "set-context".as_ref(),
                    "--current".as_ref(),
                    format!("--namespace={DOCS_NAMESPACE}").as_ref(),
                    "--kubeconfig".as_ref(),
                    kubeconfig.as_os_str(),
                ])?;
                let (node_ip, vip) = (node.ip().to_string(), vip.to_string());
                let values = Placeholders {
                    // docs/install.md's own Service, made before operations.md's commands.
                    service: "web",
                    namespace: NAMESPACE,
                    lease: "tandem-controller",
                    node_ip: &node_ip,
                    vip: &vip,
                };
                let mut failed = Vec::new();
                let mut ran = 0;
                for command in documented.iter().chain(notes.iter().filter(|c| !c.illustration)) {
                    if [RELEASE_JOB_LOG, DELETE_LEASE].contains(&command.text.as_str()) {
                        continue;
                    }
                    ran += 1;
                    if let Err(e) = run_documented(&node, &kubeconfig, command, &values) {
                        failed.push(format!("{e:#}"));
                    }
                }
                eprintln!("  ran {ran} documented commands, {} failed", failed.len());
                // The documents' Deployments and Services go with their Namespace, and
                // the controller releases their load balancers.
                node.kubectl(["delete", "namespace", DOCS_NAMESPACE, "--timeout=120s"])?;
                wait_for("only the test's two LBs in the cloud", Duration::from_secs(60), || {
                    let lbs = cloud_lbs(&edge.netns, cloud_addr)?;
                    Ok((lbs.len() == 2).then_some(()).ok_or_else(|| anyhow!("LBs: {lbs:?}")))
                })?;
                ensure!(failed.is_empty(), "{}", failed.join("\n"));
                Ok(())
            },
        );
    }

    if let (Some(proxy), Some(passthrough)) = (proxy_vip, passthrough_vip) {
        steps.check(
            &format!("helm upgrade to image tag {upgrade_tag} under traffic through both LB modes: 0 failed requests, the long-lived connections kept"),
            || {
                let clients = [proxy, passthrough]
                    .into_iter()
                    .map(|vip| ClientTraffic::through_vip(&bins.traffic, &c1, vip, &work))
                    .collect::<Result<Vec<_>>>()?;
                let traffic_began = Instant::now();
                let mut cmd = node.command(&helm);
                cmd.args(["upgrade", RELEASE])
                    .arg(&chart)
                    .args(["-n", NAMESPACE, "--reuse-values"])
                    .args(["--set", &format!("image.tag={upgrade_tag}")]);
                helm_run(cmd, &kube)?;
                for workload in ["daemonset/tandem-nodeproxy", "deployment/tandem-controller"] {
                    kube.wait_rollout(workload, Duration::from_secs(120))?;
                }
                kube.wait_release_ready(Duration::from_secs(60))?;
                eprintln!(
                    "  rolled out {:.1?} after the traffic began",
                    traffic_began.elapsed()
                );
                finish_traffic(clients.into_iter().map(|c| (c, LongLived::MustLast)))
            },
        );
    }

    steps.check("helm upgrade to the nftables mode", || {
        let mut cmd = node.command(&helm);
        cmd.args(["upgrade", RELEASE])
            .arg(&chart)
            .args(["-n", NAMESPACE, "--reuse-values"])
            .args(["--set", "nodeProxy.proxyMode=nftables"]);
        helm_run(cmd, &kube)?;
        kube.wait_rollout("daemonset/tandem-nodeproxy", Duration::from_secs(120))?;
        kube.wait_release_ready(Duration::from_secs(60))?;
        let tables = node.netns().exec_checked(["nft", "list", "tables"])?;
        ensure!(
            tables.contains("table ip tandem"),
            "no table ip tandem after the upgrade:\n{tables}"
        );
        Ok(())
    });
    note_kubelet_chains(&node, &kubelet_rules, "after the upgrade to nftables mode");
    traffic(steps, "nftables");

    // The edge as users run it in production: the same store, proxy mode served by a real
    // HAProxy. Nothing changes in the cluster; the Services are served again.
    steps.check(
        "the edge restarted on its store with --dataplane haproxy",
        || {
            drop(cloud.take());
            cloud = Some(start_cloud(
                &bins.cloud_mock,
                &edge.netns,
                cloud_addr,
                &work,
                "haproxy",
            )?);
            Ok(())
        },
    );
    traffic(steps, "HAProxy edge");

    // And back (docs/install.md), the controller still serving the LoadBalancer Services:
    // the node proxy goes, kube-proxy starts, and Tandem's nftables table, which would keep
    // translating with endpoints that no longer change, is deleted once kube-proxy's rules
    // are in.
    if let Some(binary) = kube_proxy_binary.as_deref() {
        kube_proxy = steps.check(
            "from Tandem (nftables mode) back to kube-proxy under traffic through both VIPs and a NodePort: 0 failed requests, the long-lived connections kept",
            || {
                let mut clients = vec![node_port_traffic()?];
                for vip in [proxy_vip, passthrough_vip].into_iter().flatten() {
                    clients.push(ClientTraffic::through_vip(&bins.traffic, &c1, vip, &work)?);
                }
                let mut cmd = node.command(&helm);
                cmd.args(["upgrade", RELEASE])
                    .arg(&chart)
                    .args(["-n", NAMESPACE, "--reuse-values"])
                    .args(["--set", "nodeProxy.enabled=false"]);
                helm_run(cmd, &kube)?;
                wait_for("the node proxy's pod gone", Duration::from_secs(60), || {
                    let left = node.kubectl([
                        "-n",
                        NAMESPACE,
                        "get",
                        "pods",
                        "-l",
                        "app.kubernetes.io/component=nodeproxy",
                        "-o",
                        "name",
                    ])?;
                    Ok(left.trim().is_empty().then_some(()).ok_or_else(|| anyhow!("{left}")))
                })?;
                let kube_proxy = KubeProxy::start(&node, binary, &work)?;
                let tables = node.netns().exec_checked(["nft", "list", "tables"])?;
                for family in ["ip", "ip6"] {
                    if tables.lines().any(|l| l == format!("table {family} tandem")) {
                        node.netns()
                            .exec_checked(["nft", "delete", "table", family, "tandem"])?;
                    }
                }
                finish_traffic(clients.into_iter().map(|c| (c, LongLived::MustLast)))?;
                Ok(kube_proxy)
            },
        );
    }

    steps.check(
        "helm uninstall refuses while LoadBalancer Services exist, naming them",
        || {
            let mut cmd = node.command(&helm);
            cmd.args(["uninstall", RELEASE, "-n", NAMESPACE, "--timeout", "3m"]);
            let out = tandem_k3s::node::run(&mut cmd)?;
            ensure!(
                !out.status.success(),
                "helm uninstall succeeded while LoadBalancer Services exist:\n{}",
                String::from_utf8_lossy(&out.stdout)
            );
            let logs = run_documented(
                &node,
                node.kubeconfig(),
                documented_command(&documented, RELEASE_JOB_LOG)?,
                &Placeholders::NONE,
            )?;
            for svc in ["echo-proxy", "echo-passthrough"] {
                ensure!(
                    logs.contains(svc),
                    "the release Job's log does not name {svc}:\n{logs}"
                );
            }
            // Refusing means releasing nothing: both LBs (and their VIPs) are still there.
            let lbs = cloud_lbs(&edge.netns, cloud_addr)?;
            ensure!(
                lbs.len() == 2,
                "after the refused uninstall the cloud holds {lbs:?}"
            );
            Ok(())
        },
    );
    steps.check(
        "LoadBalancer Services deleted, their LBs gone from the cloud",
        || {
            node.kubectl([
                "delete",
                "service",
                "echo-proxy",
                "echo-passthrough",
                "--wait",
                "--timeout",
                "90s",
            ])?;
            wait_for("no LB left in the cloud", Duration::from_secs(60), || {
                let lbs = cloud_lbs(&edge.netns, cloud_addr)?;
                Ok(lbs
                    .is_empty()
                    .then_some(())
                    .ok_or_else(|| anyhow!("LBs: {lbs:?}")))
            })
        },
    );
    steps.check("helm uninstall succeeds", || {
        let mut cmd = node.command(&helm);
        cmd.args([
            "uninstall",
            RELEASE,
            "-n",
            NAMESPACE,
            "--wait",
            "--timeout",
            "3m",
        ]);
        helm_run(cmd, &kube)?;
        // docs/install.md: the controller may create its Lease again before Helm deletes it.
        run_documented(
            &node,
            node.kubeconfig(),
            documented_command(&documented, DELETE_LEASE)?,
            &Placeholders::NONE,
        )?;
        Ok(())
    });
    steps.check("nothing left: no LB, no finalizer, no Lease, no Job, no pod", || {
        let lbs = cloud_lbs(&edge.netns, cloud_addr)?;
        ensure!(lbs.is_empty(), "LBs left in the cloud: {lbs:?}");
        let finalizers = node.kubectl([
            "get", "services", "-A", "-o",
            r#"jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name}={.metadata.finalizers}{"\n"}{end}"#,
        ])?;
        ensure!(
            !finalizers.contains("load-balancer-cleanup"),
            "Services still carry the finalizer:\n{finalizers}"
        );
        wait_for("the release's objects gone", Duration::from_secs(60), || {
            let left = node.kubectl(["-n", NAMESPACE, "get", "lease,job,pod,daemonset,deployment", "-o", "name"])?;
            Ok(left.trim().is_empty().then_some(()).ok_or_else(|| anyhow!("left in {NAMESPACE}:\n{left}")))
        })
    });
    // kube-proxy stops and leaves its chains, which are laid out as Tandem's iptables mode
    // lays out its own: the cleanup below removes them too.
    drop(kube_proxy.take());
    note_kubelet_chains(
        &node,
        &kubelet_rules,
        "after helm uninstall, before the cleanup",
    );
    steps.check(
        "after tandem-nodeproxy --cleanup: no rules of ours, the kubelet's chains intact",
        || {
            let mut cmd = node.command_in_node(&bins.nodeproxy)?;
            cmd.arg("--cleanup");
            checked(cmd).context("tandem-nodeproxy --cleanup")?;
            let mut problems = Vec::new();
            let save = iptables_save(&node)?;
            for chain in PROXY_CHAINS {
                if save.lines().any(|l| l.starts_with(&format!(":{chain}"))) {
                    problems.push(format!("chain {chain}* is still there"));
                }
            }
            let tables = node.netns().exec_checked(["nft", "list", "tables"])?;
            if tables.contains("table ip tandem") {
                problems.push("table ip tandem is still there".to_owned());
            }
            let after = kubelet_chains(&node)?;
            if let Some(changes) = chain_changes(&kubelet_rules, &after) {
                problems.push(format!(
                "the kubelet's chains differ from before the chart (- gone, + added):\n{changes}"
            ));
            }
            ensure!(problems.is_empty(), "{}", problems.join("\n"));
            Ok(())
        },
    );
    Ok(())
}

/// Named steps: `must` ends the scenario on failure, `check` records the failure and goes on.
struct Steps {
    started: Instant,
    failed: Vec<String>,
}

impl Steps {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            failed: Vec::new(),
        }
    }

    fn run<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let start = Instant::now();
        eprintln!("=== {name}");
        let result = f();
        match &result {
            Ok(_) => eprintln!("ok  {name} ({:.1?})", start.elapsed()),
            Err(e) => {
                eprintln!("FAILED {name} ({:.1?}): {e:#}", start.elapsed());
                self.failed.push(format!("{name}: {e:#}"));
            }
        }
        result
    }

    fn must<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.run(name, f)
            .map_err(|e| e.context(format!("step `{name}`")))
    }

    fn check<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Option<T> {
        self.run(name, f).ok()
    }

    fn finish(self, result: Result<()>) -> Result<()> {
        eprintln!("took {:.1?}", self.started.elapsed());
        if self.failed.is_empty() {
            return result;
        }
        bail!(
            "{} step(s) failed{}:\n{}",
            self.failed.len(),
            if result.is_err() {
                " (the scenario stopped)"
            } else {
                ""
            },
            self.failed.join("\n\n")
        )
    }
}

/// The commands of [`docs::DOCUMENTS`] that are no illustrations.
fn documented_commands(repo: &Path) -> Result<Vec<DocCommand>> {
    let mut found = Vec::new();
    for doc in docs::DOCUMENTS {
        let text =
            std::fs::read_to_string(repo.join(doc)).with_context(|| format!("reading {doc}"))?;
        found.extend(
            docs::in_markdown(doc, &text)
                .into_iter()
                .filter(|c| !c.illustration),
        );
    }
    Ok(found)
}

/// The documented command `text`, which the scenario runs at its own step.
fn documented_command<'a>(documented: &'a [DocCommand], text: &str) -> Result<&'a DocCommand> {
    documented.iter().find(|c| c.text == text).ok_or_else(|| {
        anyhow!("the documents no longer show `{text}`, which this test runs at its step")
    })
}

/// Runs a documented command as a user types it: through `sh`, in the node's namespace
/// with its `kubectl` and `curl`, the placeholders filled in; a `--watch` is stopped after
/// 15 s. Its stdout; a failure carries the document's line and what the command printed.
fn run_documented(
    node: &K3sNode,
    kubeconfig: &Path,
    command: &DocCommand,
    values: &Placeholders,
) -> Result<String> {
    let text = docs::fill(&command.text, &values.values()).map_err(|left| {
        anyhow!(
            "{}: no value for {left:?} in `{}`",
            command.source,
            command.text
        )
    })?;
    let watch = text.contains("--watch");
    let mut cmd = node.command("timeout");
    cmd.arg(if watch { "15" } else { "60" })
        .args(["sh", "-c", &text])
        .env("KUBECONFIG", kubeconfig);
    let out = tandem_k3s::node::run(&mut cmd)?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let watch_stopped = watch && out.status.code() == Some(124);
    ensure!(
        out.status.success() || watch_stopped,
        "{}: `{text}`: {}:\n{stdout}{}",
        command.source,
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("  {}: `{text}`: ok", command.source);
    Ok(stdout)
}

/// kube-proxy (`TANDEM_KUBE_PROXY`) on the node in iptables mode, as its DaemonSet runs it:
/// in the node's network and mount namespaces (the kubelet's xtables lock), with the
/// kubeconfig k3s writes for it. It sets no global sysctl (`--conntrack-*` 0). Dropping
/// it kills it, which leaves its rules in the kernel, as deleting its DaemonSet does.
struct KubeProxy {
    _process: ChildGuard,
    log: PathBuf,
}

impl KubeProxy {
    fn start(node: &K3sNode, binary: &Path, work: &Path) -> Result<Self> {
        let log = work.join("kube-proxy.log");
        let out = std::fs::File::create(&log)?;
        let mut cmd = node.command_in_node(binary)?;
        cmd.args(tandem_k3s::kube_proxy_args(
            &node.kube_proxy_kubeconfig(),
            node.name(),
            CLUSTER_CIDR,
        ))
        .stdout(out.try_clone()?)
        .stderr(out);
        let kube_proxy = Self {
            _process: ChildGuard::spawn(cmd)?,
            log,
        };
        // Its first sync writes a KUBE-SVC chain for every Service port with endpoints.
        wait_for("kube-proxy's rules", Duration::from_secs(60), || {
            let save = iptables_save(node)?;
            let missing: Vec<&str> = ["echo-nodeport:http", "echo-nodeport:tcp-echo"]
                .into_iter()
                .filter(|port| {
                    !save.lines().any(|l| {
                        l.starts_with("-A KUBE-SVC-") && l.contains(&format!("default/{port}"))
                    })
                })
                .collect();
            Ok(missing.is_empty().then_some(()).ok_or_else(|| {
                anyhow!(
                    "no KUBE-SVC rules for {missing:?}; kube-proxy's log:\n{}",
                    tail(&kube_proxy.log, 10)
                )
            }))
        })?;
        Ok(kube_proxy)
    }
}

/// What `account` may do in `namespace`, by resource and verb, as the API server answers
/// `kubectl auth can-i --list` for it (resource rules only: the non-resource URLs are the
/// discovery every client may read).
fn granted(node: &K3sNode, account: &str, namespace: &str) -> Result<BTreeSet<(String, String)>> {
    let table = node.kubectl([
        "auth",
        "can-i",
        "--list",
        &format!("--as=system:serviceaccount:{NAMESPACE}:{account}"),
        "-n",
        namespace,
    ])?;
    let mut lines = table.lines();
    let header = lines.next().context("an empty answer")?;
    let column = |name: &str| {
        header
            .find(name)
            .with_context(|| format!("no {name:?} column in {header:?}"))
    };
    let (urls, names, verbs) = (
        column("Non-Resource URLs")?,
        column("Resource Names")?,
        column("Verbs")?,
    );
    let mut granted = BTreeSet::new();
    for line in lines {
        let cell = |from: usize, to: usize| line.get(from..to.min(line.len())).unwrap_or("").trim();
        let resource = cell(0, urls);
        if resource.is_empty() {
            continue;
        }
        let resource = match cell(names, verbs) {
            "[]" | "" => resource.to_owned(),
            names => format!("{resource} {names}"),
        };
        let verbs = cell(verbs, line.len());
        for verb in verbs.trim_matches(['[', ']']).split_whitespace() {
            granted.insert((resource.clone(), verb.to_owned()));
        }
    }
    Ok(granted)
}

/// The chart's ServiceAccount of `component` is granted, in `namespace`, exactly what its
/// code asks for there: beyond what every ServiceAccount has (the namespace's `default`
/// one, which the chart binds nothing to), nothing more and nothing less.
fn check_granted(
    node: &K3sNode,
    component: &str,
    permissions: &[Permission],
    namespace: &str,
) -> Result<()> {
    let account = format!("{RELEASE}-{component}");
    let everyone = granted(node, "default", namespace)?;
    let granted: BTreeSet<_> = granted(node, &account, namespace)?
        .difference(&everyone)
        .cloned()
        .collect();
    let wanted: BTreeSet<_> = permissions
        .iter()
        .filter(|p| p.scope == Scope::Cluster || namespace == NAMESPACE)
        .flat_map(|p| {
            p.verbs
                .iter()
                .map(|verb| (p.qualified_resource(), (*verb).to_owned()))
        })
        .collect();
    let more: Vec<_> = granted.difference(&wanted).collect();
    let less: Vec<_> = wanted.difference(&granted).collect();
    ensure!(
        more.is_empty() && less.is_empty(),
        "{account} in namespace {namespace}: granted beyond what the code asks {more:?}, \
         asked but not granted {less:?}"
    );
    eprintln!(
        "  {account} in namespace {namespace}: {} grants, exactly the code's",
        granted.len()
    );
    Ok(())
}

/// The node's iptables ruleset (filter and nat), as the kernel prints it.
fn iptables_save(node: &K3sNode) -> Result<String> {
    Ok(node.netns().exec_checked(["iptables-save"])?)
}

/// The kubelet's own chains, their declarations and rules, sorted: what must survive
/// the chart.
fn kubelet_chains(node: &K3sNode) -> Result<String> {
    let save = iptables_save(node)?;
    let mut lines: Vec<String> = save
        .lines()
        .filter(|l| {
            KUBELET_CHAINS
                .iter()
                .any(|c| l.starts_with(&format!(":{c} ")) || l.starts_with(&format!("-A {c} ")))
        })
        // Counters change with traffic.
        .map(|l| l.split(" [").next().unwrap_or(l).to_owned())
        .collect();
    lines.sort();
    Ok(lines.join("\n"))
}

/// What changed in the kubelet's chains since `before`: lines gone and lines added.
fn chain_changes(before: &str, after: &str) -> Option<String> {
    let old: std::collections::BTreeSet<&str> = before.lines().collect();
    let new: std::collections::BTreeSet<&str> = after.lines().collect();
    let gone: Vec<&str> = old.difference(&new).copied().collect();
    let added: Vec<&str> = new.difference(&old).copied().collect();
    (!gone.is_empty() || !added.is_empty()).then(|| {
        gone.iter()
            .map(|l| format!("  - {l}"))
            .chain(added.iter().map(|l| format!("  + {l}")))
            .collect::<Vec<_>>()
            .join("\n")
    })
}

/// Reports (without failing) how the kubelet's chains differ from before the chart: while
/// the node proxy runs, iptables mode shares KUBE-MARK-MASQ and KUBE-POSTROUTING as
/// kube-proxy v1.21 does; only the end state is asserted.
fn note_kubelet_chains(node: &K3sNode, before: &str, when: &str) {
    match kubelet_chains(node) {
        Ok(now) => match chain_changes(before, &now) {
            Some(changes) => eprintln!("  the kubelet's chains {when}:\n{changes}"),
            None => eprintln!("  the kubelet's chains {when}: unchanged"),
        },
        Err(e) => eprintln!("  the kubelet's chains {when}: {e:#}"),
    }
}

fn workloads() -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: echo
  namespace: default
spec:
  replicas: {ECHO_REPLICAS}
  selector:
    matchLabels: {{app: echo}}
  template:
    metadata:
      labels: {{app: echo}}
    spec:
      # busybox as PID 1 ignores SIGTERM.
      terminationGracePeriodSeconds: 1
      containers:
        - name: echo
          image: localhost/tandem-echo:1
          imagePullPolicy: Never
          ports: [{{containerPort: 8080}}]
          readinessProbe:
            tcpSocket: {{port: 8080}}
            periodSeconds: 1
        - name: tcp-echo
          image: localhost/tandem-echo:1
          imagePullPolicy: Never
          # Each connection gets a cat of its own: lines come back as sent.
          command: [/bin/nc, -ll, -p, "{TCP_ECHO_PORT}", -e, /bin/cat]
          ports: [{{containerPort: {TCP_ECHO_PORT}}}]
          readinessProbe:
            tcpSocket: {{port: {TCP_ECHO_PORT}}}
            periodSeconds: 1
---
apiVersion: v1
kind: Pod
metadata:
  name: client
  namespace: default
  labels: {{app: client}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: client
      image: localhost/tandem-echo:1
      imagePullPolicy: Never
      command: [/bin/sleep, "3600"]
"#
    )
}

fn services() -> String {
    let lb = |name: &str, mode: &str, ranges: &str| {
        format!(
            r#"apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
  annotations:
    {MODE_ANNOTATION}: {mode}
spec:
  type: LoadBalancer
  selector: {{app: echo}}
  ports:
    - {{name: http, port: 80, targetPort: 8080}}
    - {{name: tcp-echo, port: {TCP_ECHO_PORT}, targetPort: {TCP_ECHO_PORT}}}{ranges}
---
"#
        )
    };
    let proxy = lb("echo-proxy", "proxy", "");
    let passthrough = lb(
        "echo-passthrough",
        "passthrough",
        &format!("\n  loadBalancerSourceRanges: [{SOURCE_RANGE}]"),
    );
    format!(
        r#"{proxy}{passthrough}apiVersion: v1
kind: Service
metadata:
  name: echo-nodeport
  namespace: default
spec:
  type: NodePort
  selector: {{app: echo}}
  ports:
    - {{name: http, port: 80, targetPort: 8080}}
    - {{name: tcp-echo, port: {TCP_ECHO_PORT}, targetPort: {TCP_ECHO_PORT}}}
"#
    )
}
