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

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;
use tandem_common::permissions::{Permission, Scope};
use tandem_k3s::docs::{self, DocCommand, Placeholders};
use tandem_k3s::node::{K3sNode, NodeConfig, NodeRole, checked, describe, run_name, tail};
use tandem_k3s::wait_for;
use tandem_netlab::{ChildGuard, Netns, Topology};

/// `local`: use the chart's images as podman's store holds them instead of running
/// `scripts/images.sh --offline` first.
const IMAGES_ENV: &str = "TANDEM_K3S_IMAGES";
const NAMESPACE: &str = "tandem-system";
const RELEASE: &str = "tandem";
const CLOUD_PORT: u16 = 8080;
const CLOUD_TOKEN: &str = "tandem-k3s-node-test-token";
const VIP_POOL: &str = "198.51.100.0/24";
const CLUSTER_CIDR: &str = "10.244.0.0/16";
const SERVICE_CIDR: &str = "10.43.0.0/16";
const SOURCE_RANGE: &str = "203.0.113.0/24";
const ECHO_REPLICAS: usize = 3;
/// The echo pods' TCP echo (busybox `nc -e cat`), for the long-lived connections.
const TCP_ECHO_PORT: u16 = 9000;
/// Appended to the chart's image tag for the rolling upgrade: the same images, retagged.
const UPGRADE_TAG_SUFFIX: &str = "-rolled";
const MODE_ANNOTATION: &str = "service.beta.kubernetes.io/mockcloud-load-balancer-mode";
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
    let k3s = tandem_k3s::k3s_binary().with_context(|| {
        format!(
            "{} must name a k3s binary for the real-node test",
            tandem_k3s::K3S_ENV
        )
    })?;
    ensure!(
        nix::unistd::geteuid().is_root(),
        "the real-node test needs root (network namespaces, cgroups, mounts)"
    );
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
        install_helm(&repo, &base.join("helm-3.9.4/helm"))
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
        // The controller-manager creates a Namespace's default ServiceAccount a moment after
        // the node is Ready; a bare Pod created before it is refused.
        wait_for(
            "the default ServiceAccount",
            Duration::from_secs(60),
            || {
                Ok(node
                    .kubectl(["-n", "default", "get", "serviceaccount", "default"])
                    .map(drop)
                    .map_err(anyhow::Error::from))
            },
        )?;
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
            || finish_traffic(vec![client]),
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
                finish_traffic(clients)
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
                finish_traffic(clients)?;
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

/// The workspace binaries the test runs itself, next to the test executable's directory.
struct Binaries {
    cloud_mock: PathBuf,
    nodeproxy: PathBuf,
    traffic: PathBuf,
}

impl Binaries {
    fn locate() -> Result<Self> {
        let exe = std::env::current_exe()?;
        // target/debug/deps/node-HASH -> target/debug
        let dir = exe
            .parent()
            .and_then(Path::parent)
            .ok_or_else(|| anyhow!("no directory above {}", exe.display()))?;
        let find = |name: &str| {
            let path = dir.join(name);
            path.is_file().then_some(path.clone()).ok_or_else(|| {
                anyhow!(
                    "{} is missing: run `cargo build --workspace --bins` first",
                    path.display()
                )
            })
        };
        Ok(Self {
            cloud_mock: find("cloud-mock")?,
            nodeproxy: find("tandem-nodeproxy")?,
            traffic: find("tandem-traffic")?,
        })
    }
}

fn install_helm(repo: &Path, dest: &Path) -> Result<PathBuf> {
    let mut cmd = Command::new("bash");
    cmd.arg(repo.join("tests/k3s/install-helm.sh")).arg(dest);
    let out = checked(cmd)?;
    Ok(PathBuf::from(out.trim()))
}

/// The node's images, and the tag the rolling upgrade moves the chart to.
struct SavedImages {
    archives: Vec<PathBuf>,
    upgrade_tag: String,
}

/// Docker archives for the node: the test images (`node/test-images.sh`) and the chart's
/// default images, built by `scripts/images.sh --offline` (or, with
/// `TANDEM_K3S_IMAGES=local`, taken as podman's store holds them) and saved from the store,
/// each also under the upgrade's tag (its tag and [`UPGRADE_TAG_SUFFIX`]).
fn save_images(repo: &Path, dir: &Path) -> Result<SavedImages> {
    let mut archives = tandem_k3s::node::build_test_images(dir)?;
    let mut names = Command::new("bash");
    names
        .arg(repo.join("scripts/images.sh"))
        .arg("--print-names");
    let refs: Vec<String> = checked(names)?.lines().map(str::to_owned).collect();
    if std::env::var(IMAGES_ENV).as_deref() == Ok("local") {
        for r in &refs {
            let exists = Command::new("podman")
                .args(["image", "exists", r])
                .status()
                .is_ok_and(|s| s.success());
            ensure!(
                exists,
                "{IMAGES_ENV}=local but {r} is not in podman's store: run scripts/images.sh --offline"
            );
        }
    } else {
        // Always through the script, so the node runs what the tree builds; cargo and the
        // image layers make it quick when nothing changed.
        let mut build = Command::new("bash");
        build.arg(repo.join("scripts/images.sh")).arg("--offline");
        checked(build).context("scripts/images.sh --offline")?;
    }
    let save = |reference: &str| -> Result<PathBuf> {
        let name = reference
            .rsplit('/')
            .next()
            .unwrap_or(reference)
            .replace(':', "-");
        let archive = dir.join(format!("{name}.tar"));
        let _ = std::fs::remove_file(&archive);
        let mut save = Command::new("podman");
        save.args(["save", "--quiet", "--format", "docker-archive", "-o"])
            .arg(&archive)
            .arg(reference);
        checked(save)?;
        Ok(archive)
    };
    let mut upgrade_tag = None;
    for r in &refs {
        archives.push(save(r)?);
        let (repository, tag) = r
            .rsplit_once(':')
            .ok_or_else(|| anyhow!("image reference {r} has no tag"))?;
        let retagged = format!("{repository}:{tag}{UPGRADE_TAG_SUFFIX}");
        let mut tag_cmd = Command::new("podman");
        tag_cmd.args(["tag", r, &retagged]);
        checked(tag_cmd)?;
        let saved = save(&retagged);
        // podman's store is left as it was: the retagged name only goes to the node. (With
        // no name after the image, `podman untag` would remove every name of it.)
        let mut untag = Command::new("podman");
        untag.args(["untag", r, &retagged]);
        checked(untag)?;
        archives.push(saved?);
        upgrade_tag = Some(format!("{tag}{UPGRADE_TAG_SUFFIX}"));
    }
    Ok(SavedImages {
        archives,
        upgrade_tag: upgrade_tag.ok_or_else(|| anyhow!("scripts/images.sh names no image"))?,
    })
}

/// `tandem-traffic` (see `tandem_lab::traffic`) from a client namespace through a VIP:
/// GETs of the busybox echo on new connections, and one long-lived connection to the
/// pods' TCP echo. Killed with its process group if dropped.
struct ClientTraffic {
    target: SocketAddrV4,
    process: ChildGuard,
    output: BufReader<ChildStdout>,
}

impl ClientTraffic {
    /// Through a VIP: the Services' port 80 and their TCP echo port.
    fn through_vip(binary: &Path, client: &Netns, vip: Ipv4Addr, work: &Path) -> Result<Self> {
        let at = |port| SocketAddrV4::new(vip, port);
        Self::start(binary, client, at(80), at(TCP_ECHO_PORT), work)
    }

    /// Starts it and waits for its first line, `{"kind":"ready"}`: the long-lived
    /// connection made its first exchange.
    fn start(
        binary: &Path,
        client: &Netns,
        target: SocketAddrV4,
        long_lived: SocketAddrV4,
        work: &Path,
    ) -> Result<Self> {
        let log = std::fs::File::create(work.join(format!("traffic-{target}.log")))?;
        let mut cmd = client.command(binary);
        cmd.arg(format!("--target={target}"))
            .arg("--path=/cgi-bin/echo")
            .arg("--long-lived=echo")
            .arg(format!("--long-lived-target={long_lived}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log);
        let mut process = ChildGuard::spawn(cmd)?;
        let output = process
            .child_mut()
            .stdout
            .take()
            .map(BufReader::new)
            .ok_or_else(|| anyhow!("tandem-traffic's stdout is not piped"))?;
        let mut traffic = Self {
            target,
            process,
            output,
        };
        let ready = traffic.line()?;
        ensure!(
            ready["kind"] == "ready",
            "tandem-traffic towards {target} began with {ready}"
        );
        Ok(traffic)
    }

    fn line(&mut self) -> Result<Value> {
        let mut line = String::new();
        self.output.read_line(&mut line)?;
        ensure!(
            !line.is_empty(),
            "tandem-traffic towards {} ended early",
            self.target
        );
        serde_json::from_str(&line).with_context(|| format!("tandem-traffic printed {line:?}"))
    }

    /// Stops the traffic (closing its stdin) and returns what the client saw.
    fn stop(mut self) -> Result<TrafficSummary> {
        drop(self.process.child_mut().stdin.take());
        let summary = self.line()?;
        ensure!(
            summary["kind"] == "summary",
            "tandem-traffic towards {} ended with {summary}",
            self.target
        );
        Ok(TrafficSummary {
            target: self.target,
            summary,
        })
    }
}

/// The generator's summary line: requests sent and failed, and the long-lived connection.
struct TrafficSummary {
    target: SocketAddrV4,
    summary: Value,
}

impl TrafficSummary {
    fn failures(&self) -> &[Value] {
        self.summary["failures"]
            .as_array()
            .map_or(&[], Vec::as_slice)
    }

    /// No failed request, and the long-lived connection lasted.
    fn clean(&self) -> bool {
        let long_lived = &self.summary["long_lived"];
        self.failures().is_empty()
            && long_lived["broken"].is_null()
            && long_lived["exchanges"].as_u64().unwrap_or(0) > 0
    }
}

impl std::fmt::Display for TrafficSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let long_lived = &self.summary["long_lived"];
        let sent_at = |failure: Option<&Value>| {
            failure.and_then(|f| f["at_ms"].as_u64()).unwrap_or(0) as f64 / 1000.0
        };
        let window = match self.failures() {
            [] => String::new(),
            all => format!(
                " (sent from {:.1}s to {:.1}s)",
                sent_at(all.first()),
                sent_at(all.last())
            ),
        };
        write!(
            f,
            "{}: {} of {} requests failed{window}; long-lived connection {} after {} exchanges",
            self.target,
            self.failures().len(),
            self.summary["sent"],
            if long_lived["broken"].is_null() {
                "kept".to_owned()
            } else {
                format!("broken ({})", long_lived["broken"])
            },
            long_lived["exchanges"]
        )?;
        let mut errors: BTreeMap<String, usize> = BTreeMap::new();
        for failure in self.failures() {
            *errors
                .entry(failure["error"].as_str().unwrap_or("?").to_owned())
                .or_default() += 1;
        }
        for (error, count) in errors {
            write!(f, "; x{count}: {error}")?;
        }
        Ok(())
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

/// Lets late failures arrive, stops every client and fails unless each was clean (no
/// failed request, the long-lived connection kept); each client's summary is printed.
fn finish_traffic(clients: Vec<ClientTraffic>) -> Result<()> {
    std::thread::sleep(Duration::from_secs(3));
    let mut problems = Vec::new();
    for client in clients {
        let summary = client.stop()?;
        eprintln!("  {summary}");
        if !summary.clean() {
            problems.push(summary.to_string());
        }
    }
    ensure!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(())
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

/// The mock cloud in the edge's namespace, its proxy mode served by `dataplane` (`proxy` or
/// `haproxy`); its store and log stay in `work` across restarts.
fn start_cloud(
    binary: &Path,
    edge: &Netns,
    addr: SocketAddrV4,
    work: &Path,
    dataplane: &str,
) -> Result<ChildGuard> {
    let log = work.join(format!("cloud-mock-{dataplane}.log"));
    let out = std::fs::File::create(&log)?;
    let mut cmd = edge.command(binary);
    cmd.arg(format!("--listen={addr}"))
        .arg(format!("--data-dir={}", work.join("cloud").display()))
        .arg(format!("--token={CLOUD_TOKEN}"))
        .arg(format!("--vip-pool=default={VIP_POOL}"))
        .arg(format!("--dataplane={dataplane}"))
        .args(["--manage-vip-addresses", "--vip-device=lo"])
        .arg("--provisioning-delay=200ms")
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out);
    let mut guard = ChildGuard::spawn(cmd)?;
    wait_for("the mock cloud serves", Duration::from_secs(20), || {
        if let Some(status) = guard.try_wait()? {
            bail!("cloud-mock exited ({status}):\n{}", tail(&log, 20));
        }
        Ok(http_get(edge, addr, "/healthz", None)
            .map(drop)
            .map_err(|e| anyhow!("{e:#}")))
    })?;
    Ok(guard)
}

/// The values docs/install.md documents for a cluster without kube-proxy and with a cloud
/// of its own.
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

fn install_values(node_ip: Ipv4Addr, cloud_url: &str) -> Vec<String> {
    [
        format!("apiServer.host={node_ip}"),
        format!("nodeProxy.clusterCIDR={CLUSTER_CIDR}"),
        "cloudMock.enabled=false".to_owned(),
        format!("cloud.url={cloud_url}"),
        format!("cloud.token={CLOUD_TOKEN}"),
    ]
    .into_iter()
    .flat_map(|v| ["--set".to_owned(), v])
    .collect()
}

/// docs/install.md: on container runtimes whose default seccomp profile lacks clone3
/// (containerd before 1.5, as in k3s v1.21) the chart needs `seccompProfile.type=Unconfined`.
fn seccomp_values(kube: &Kube) -> Result<Vec<String>> {
    let runtime = kube.node.kubectl([
        "get",
        "node",
        kube.node.name(),
        "-o",
        "jsonpath={.status.nodeInfo.containerRuntimeVersion}",
    ])?;
    let version = runtime.trim().trim_start_matches("containerd://");
    let mut parts = version
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let old = runtime.starts_with("containerd://")
        && (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) < (1, 5);
    eprintln!(
        "  container runtime {runtime}: seccomp {}",
        if old { "Unconfined" } else { "RuntimeDefault" }
    );
    Ok(if old {
        vec![
            "--set".to_owned(),
            "seccompProfile.type=Unconfined".to_owned(),
        ]
    } else {
        Vec::new()
    })
}

/// Runs a helm command; a failure carries helm's output and the state of the release's
/// pods and the hook Job.
fn helm_run(mut cmd: Command, kube: &Kube) -> Result<()> {
    let out = tandem_k3s::node::run(&mut cmd)?;
    if out.status.success() {
        return Ok(());
    }
    bail!(
        "`{}` failed ({}):\n{}{}\n{}",
        describe(&cmd),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        kube.diagnose()
    )
}

struct Kube<'a> {
    node: &'a K3sNode,
    work: &'a Path,
}

impl Kube<'_> {
    fn apply(&self, name: &str, manifest: &str) -> Result<()> {
        let path = self.work.join(name);
        std::fs::write(&path, manifest)?;
        self.node.kubectl([
            Path::new("apply").as_os_str(),
            "-f".as_ref(),
            path.as_os_str(),
        ])?;
        Ok(())
    }

    fn wait_pods_ready(
        &self,
        ns: &str,
        selector: &str,
        want: usize,
        timeout: Duration,
    ) -> Result<()> {
        wait_for(&format!("{want} Ready pods {selector}"), timeout, || {
            let out = self.node.kubectl([
                "-n", ns, "get", "pods", "-l", selector, "-o",
                r#"jsonpath={range .items[*]}{.metadata.name} {.status.phase} {.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}"#,
            ])?;
            let ready = out.lines().filter(|l| l.ends_with(" Running True")).count();
            Ok((ready >= want)
                .then_some(())
                .ok_or_else(|| anyhow!("pods:\n{out}\n{}", self.diagnose())))
        })
    }

    /// Every pod of the release Running and Ready; a container that restarted twice fails
    /// at once, with its previous log.
    fn wait_release_ready(&self, timeout: Duration) -> Result<()> {
        wait_for("the release's pods Ready", timeout, || {
            let json = self
                .node
                .kubectl(["-n", NAMESPACE, "get", "pods", "-o", "json"])?;
            let pods: Value = serde_json::from_str(&json)?;
            let items = pods["items"].as_array().cloned().unwrap_or_default();
            let mut not_ready = Vec::new();
            for pod in &items {
                let name = pod["metadata"]["name"].as_str().unwrap_or("?");
                if pod["status"]["phase"] == "Succeeded" {
                    continue;
                }
                for status in pod["status"]["containerStatuses"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    if status["restartCount"].as_u64().unwrap_or(0) >= 2 {
                        let log = self
                            .node
                            .kubectl(["-n", NAMESPACE, "logs", name, "--previous", "--tail=20"])
                            .unwrap_or_else(|e| e.to_string());
                        bail!(
                            "pod {name} keeps crashing ({}); its last log:\n{log}",
                            status["state"]
                        );
                    }
                }
                let ready = pod["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True");
                if !ready {
                    not_ready.push(name.to_owned());
                }
            }
            Ok(if items.is_empty() || !not_ready.is_empty() {
                Err(anyhow!("not Ready: {not_ready:?}\n{}", self.diagnose()))
            } else {
                Ok(())
            })
        })
    }

    fn wait_rollout(&self, what: &str, timeout: Duration) -> Result<()> {
        self.node.kubectl([
            "-n",
            NAMESPACE,
            "rollout",
            "status",
            what,
            &format!("--timeout={}s", timeout.as_secs()),
        ])?;
        Ok(())
    }

    fn service(&self, name: &str) -> Result<Value> {
        let json = self.node.kubectl(["get", "service", name, "-o", "json"])?;
        Ok(serde_json::from_str(&json)?)
    }

    fn wait_ingress(&self, name: &str, timeout: Duration) -> Result<Ipv4Addr> {
        wait_for(&format!("an ingress IP on Service {name}"), timeout, || {
            let svc = self.service(name)?;
            let ip = svc["status"]["loadBalancer"]["ingress"][0]["ip"].as_str();
            Ok(match ip {
                Some(ip) => Ok(ip.parse()?),
                None => Err(anyhow!(
                    "status {}; events:\n{}\ncontroller log:\n{}",
                    svc["status"],
                    self.node
                        .kubectl([
                            "get",
                            "events",
                            "--field-selector",
                            &format!("involvedObject.name={name}")
                        ])
                        .unwrap_or_default(),
                    self.node
                        .kubectl([
                            "-n",
                            NAMESPACE,
                            "logs",
                            "deploy/tandem-controller",
                            "--tail=15"
                        ])
                        .unwrap_or_default()
                )),
            })
        })
    }

    fn cluster_ip_and_node_port(&self, name: &str) -> Result<(Ipv4Addr, u16)> {
        let svc = self.service(name)?;
        let ip = svc["spec"]["clusterIP"]
            .as_str()
            .ok_or_else(|| anyhow!("no clusterIP"))?;
        let port = svc["spec"]["ports"][0]["nodePort"]
            .as_u64()
            .ok_or_else(|| anyhow!("no nodePort"))?;
        Ok((ip.parse()?, u16::try_from(port)?))
    }

    /// `nodeIP:nodePort` of each of Service `name`'s ports, in order.
    fn node_ports(&self, name: &str) -> Result<Vec<SocketAddrV4>> {
        let svc = self.service(name)?;
        svc["spec"]["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|port| {
                let node_port = port["nodePort"]
                    .as_u64()
                    .ok_or_else(|| anyhow!("{name}: a port without nodePort: {port}"))?;
                Ok(SocketAddrV4::new(self.node.ip(), u16::try_from(node_port)?))
            })
            .collect()
    }

    /// Pods, the hook Job and recent warnings, for failure messages.
    fn diagnose(&self) -> String {
        let get = |args: &[&str]| self.node.kubectl(args).unwrap_or_else(|e| e.to_string());
        format!(
            "pods:\n{}\nwarnings:\n{}\nrelease job log:\n{}",
            get(&["get", "pods", "-A", "-o", "wide"]),
            get(&["get", "events", "-A", "--field-selector", "type=Warning"]),
            get(&["-n", NAMESPACE, "logs", "job/tandem-release", "--tail=20"]),
        )
    }
}

/// Retries `f` until it gives `Ok(Ok(v))` or `timeout` passes; `Ok(Err(why))` means "not
/// yet" (the last `why` is reported), `Err` ends the wait at once.
struct HttpReply {
    status: u16,
    body: String,
}

impl HttpReply {
    /// The echo's reply `pod=NAME client=ADDR`: the pod that answered.
    fn echo(&self) -> Result<String> {
        self.body
            .split_whitespace()
            .find_map(|w| w.strip_prefix("pod="))
            .map(str::to_owned)
            .ok_or_else(|| {
                anyhow!(
                    "not an echo reply (status {}): {:?}",
                    self.status,
                    self.body
                )
            })
    }
}

/// An HTTP/1.0 GET from inside `netns` (a thread that entered it), 3 s per attempt.
fn http_get(
    netns: &Netns,
    addr: SocketAddrV4,
    path: &str,
    bearer: Option<&str>,
) -> Result<HttpReply> {
    let request = format!(
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{}\r\n",
        bearer
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default()
    );
    let text = netns.run_in_thread(move || -> std::io::Result<String> {
        let timeout = Duration::from_secs(3);
        let mut stream = TcpStream::connect_timeout(&SocketAddr::V4(addr), timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.write_all(request.as_bytes())?;
        let mut text = String::new();
        stream.read_to_string(&mut text)?;
        Ok(text)
    })??;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("no HTTP status from {addr}: {text:?}"))?;
    Ok(HttpReply {
        status,
        body: body.to_owned(),
    })
}

/// `count` requests from `netns` to `ip:80` all answer, from more than one echo pod.
/// First waits (up to 30 s) for one answer: right after a node proxy restarts, the cloud
/// takes the node out of its LBs until its health check passes again.
fn spread(netns: &Netns, ip: Ipv4Addr, count: usize) -> Result<BTreeMap<String, usize>> {
    let addr = SocketAddrV4::new(ip, 80);
    wait_for(
        &format!("a first answer from {addr}"),
        Duration::from_secs(30),
        || Ok(http_get(netns, addr, "/cgi-bin/echo", None).and_then(|r| r.echo())),
    )?;
    let mut by_pod = BTreeMap::new();
    let mut failures = Vec::new();
    for _ in 0..count {
        match http_get(netns, addr, "/cgi-bin/echo", None).and_then(|r| r.echo()) {
            Ok(pod) => *by_pod.entry(pod).or_insert(0) += 1,
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    ensure!(
        failures.is_empty(),
        "{} of {count} requests to {addr} from {} failed (answers: {by_pod:?}); first: {}",
        failures.len(),
        netns.name(),
        failures[0]
    );
    ensure!(
        by_pod.len() > 1,
        "every answer from {addr} came from one pod: {by_pod:?}"
    );
    eprintln!("  {addr} from {}: {by_pod:?}", netns.name());
    Ok(by_pod)
}

/// No request from `netns` to `ip:80` gets an answer.
fn dropped(netns: &Netns, ip: Ipv4Addr) -> Result<()> {
    let addr = SocketAddrV4::new(ip, 80);
    for _ in 0..3 {
        if let Ok(reply) = http_get(netns, addr, "/cgi-bin/echo", None) {
            bail!(
                "{} got an answer from {addr}: {:?}",
                netns.name(),
                reply.body
            );
        }
    }
    Ok(())
}

/// The load balancers in the mock cloud (their names).
fn cloud_lbs(edge: &Netns, addr: SocketAddrV4) -> Result<Vec<String>> {
    let reply = http_get(edge, addr, "/v1/loadbalancers", Some(CLOUD_TOKEN))?;
    ensure!(
        reply.status == 200,
        "listing LBs: {} {}",
        reply.status,
        reply.body
    );
    let list: Value = serde_json::from_str(&reply.body)?;
    Ok(list["items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|lb| lb["name"].as_str().unwrap_or("?").to_owned())
                .collect()
        })
        .unwrap_or_default())
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
