//! A real cluster of three nodes (`tandem_k3s::cluster`): a k3s server and two k3s agents,
//! each a real kubelet with containerd and runc pods in a network namespace of its own on
//! one node network (tandem_netlab's topology: nodes 198.18.0.11-13, pod subnets
//! 10.244.0-2.0/24 routed to their nodes), k3s's own kube-proxy serving Services.
//!
//! What one node cannot show, with real pods placed on each node:
//! - every node Ready, with the pod CIDR of its place from the real node IPAM;
//! - a pod on node 1 reaching a Service whose endpoints are on nodes 2 and 3 through its
//!   cluster IP, every endpoint answering, and seeing the client pod's own address (the
//!   source kept through a cluster IP from another node's pod, which upstream's e2e test
//!   skips on one node);
//! - the same Service through its NodePort on node 3, from node 1's pod.
//!
//! Needs root, `TANDEM_K3S` naming a k3s binary, Debian's containerd (its runc shim),
//! runc, containernetworking-plugins, busybox-static, conntrack, iptables and buildah (the
//! test images). Without `--ignored` it is reported skipped; asked for without
//! `TANDEM_K3S`, it fails.
//!
//! Run: `TANDEM_K3S=/path/to/k3s cargo test -p tandem-k3s --test cluster -- --ignored --nocapture`
//! (logs under `target/tmp/k3s-cluster/` until the next run).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, ensure};
use tandem_k3s::cluster::{ClusterConfig, K3sCluster};
use tandem_k3s::node::{K3sNode, checked};
use tandem_k3s::wait_for;
use tandem_netlab::Topology;

const NODES: usize = 3;
const CLUSTER_CIDR: &str = "10.244.0.0/16";
const SERVICE_CIDR: &str = "10.43.0.0/16";
/// Requests from the client pod through each way in: enough for every endpoint to answer.
const REQUESTS: usize = 12;

#[test]
#[ignore = "needs a real k3s: TANDEM_K3S=/path/to/k3s cargo test -p tandem-k3s --test cluster -- --ignored"]
fn a_real_cluster_of_three_nodes_serves_across_nodes() -> Result<()> {
    let k3s = tandem_k3s::k3s_binary().with_context(|| {
        format!(
            "{} must name a k3s binary for the real-cluster test",
            tandem_k3s::K3S_ENV
        )
    })?;
    ensure!(
        nix::unistd::geteuid().is_root(),
        "the real-cluster test needs root (network namespaces, cgroups, mounts)"
    );
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let base = Path::new(env!("CARGO_TARGET_TMPDIR")).join("k3s-cluster");
    let work = base.join("work");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;

    let images = test_images(&repo, &work.join("images"))?;
    let topology = Topology::builder()
        .nodes(NODES)
        .pods_per_node(&[0; NODES])
        .without_echo()
        .build()?;
    let (cluster, took) = K3sCluster::start(ClusterConfig {
        k3s,
        nodes: topology.nodes().to_vec(),
        bridge: "cni0".to_owned(),
        cluster_cidr: CLUSTER_CIDR.parse()?,
        service_cidr: SERVICE_CIDR.parse()?,
        images,
        server_args: Vec::new(),
        base_dir: base.clone(),
    })?;
    eprintln!(
        "{NODES} nodes Ready {took:.1?} after the server started; logs: {}",
        base.display()
    );
    let server = cluster.server();
    let names: Vec<&str> = cluster.nodes().iter().map(K3sNode::name).collect();

    let manifest = work.join("workloads.yaml");
    std::fs::write(&manifest, workloads(&names))?;
    wait_for(
        "the default ServiceAccount",
        Duration::from_secs(60),
        || {
            Ok(server
                .kubectl(["-n", "default", "get", "serviceaccount", "default"])
                .map(drop)
                .map_err(anyhow::Error::from))
        },
    )?;
    server.kubectl(["apply", "-f", &manifest.to_string_lossy()])?;
    let pods = wait_for(
        "every pod Ready on its node",
        Duration::from_secs(120),
        || {
            let out = server.kubectl([
            "get",
            "pods",
            "-o",
            r#"jsonpath={range .items[*]}{.metadata.name} {.spec.nodeName} {.status.podIP} {.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}"#,
        ])?;
            let ready: Vec<(String, String, String)> = out
                .lines()
                .filter_map(
                    |line| match line.split_whitespace().collect::<Vec<_>>()[..] {
                        [pod, node, ip, "True"] => {
                            Some((pod.to_owned(), node.to_owned(), ip.to_owned()))
                        }
                        _ => None,
                    },
                )
                .collect();
            Ok((ready.len() == NODES)
                .then_some(ready)
                .ok_or_else(|| anyhow!("pods:\n{out}")))
        },
    )?;
    for (pod, node, ip) in &pods {
        let on = cluster
            .nodes()
            .iter()
            .find(|n| n.name() == node)
            .with_context(|| format!("{pod} runs on {node}, no node of the cluster"))?;
        ensure!(
            ip.parse::<std::net::Ipv4Addr>()
                .is_ok_and(|ip| on.pod_subnet().contains(&ip)),
            "{pod} on {node} has {ip}, outside the node's pod subnet {}",
            on.pod_subnet()
        );
    }
    let client_ip = pods
        .iter()
        .find(|(pod, ..)| pod == "client")
        .map(|(_, _, ip)| ip.clone())
        .context("no client pod")?;

    let cluster_ip =
        server.kubectl(["get", "service", "echo", "-o", "jsonpath={.spec.clusterIP}"])?;
    let node_port = server.kubectl([
        "get",
        "service",
        "echo",
        "-o",
        "jsonpath={.spec.ports[0].nodePort}",
    ])?;
    let third = cluster.nodes()[NODES - 1].ip();
    for (way, target) in [
        ("the cluster IP", format!("{} 80", cluster_ip.trim())),
        (
            "the NodePort on the third node",
            format!("{third} {}", node_port.trim()),
        ),
    ] {
        let mut answered = BTreeSet::new();
        for _ in 0..REQUESTS {
            let out = server.kubectl([
                "exec",
                "client",
                "--",
                "sh",
                "-c",
                // Static busybox's wget crashes (glibc's NSS): a request through nc.
                &format!(r"printf 'GET /cgi-bin/echo HTTP/1.0\r\n\r\n' | nc -w 3 {target}"),
            ])?;
            let answer = out
                .lines()
                .find(|line| line.starts_with("pod="))
                .with_context(|| format!("{way} ({target}) from the client pod: {out:?}"))?;
            // busybox httpd listens on IPv6 and names an IPv4 client `[::ffff:A.B.C.D]`.
            let seen = answer
                .rsplit("client=")
                .next()
                .unwrap_or("")
                .trim_matches(['[', ']'])
                .trim_start_matches("::ffff:");
            if way == "the cluster IP" {
                ensure!(
                    seen == client_ip,
                    "through {way} the echo saw another source than the client pod {client_ip}: {answer}"
                );
            }
            answered.insert(answer.split_whitespace().next().unwrap_or("").to_owned());
        }
        eprintln!("  {way}: answered by {answered:?}");
        ensure!(
            answered.len() == NODES - 1,
            "through {way} from node 1, both endpoints (on nodes 2 and 3) answer: {answered:?}"
        );
    }
    drop(cluster);
    let _ = std::fs::remove_dir_all(&work);
    Ok(())
}

/// The test images (pause, echo) as docker archives in `dir`.
fn test_images(repo: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut cmd = Command::new("bash");
    cmd.arg(repo.join("tests/k3s/node/test-images.sh")).arg(dir);
    Ok(checked(cmd)?.lines().map(PathBuf::from).collect())
}

/// An echo pod on each node but the first, a Service over them, and a client pod on the
/// first.
fn workloads(nodes: &[&str]) -> String {
    let pod = |name: &str, node: &str, labels: &str, command: &str| {
        format!(
            r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: default
  labels: {{{labels}}}
spec:
  nodeName: {node}
  # busybox as PID 1 ignores SIGTERM.
  terminationGracePeriodSeconds: 1
  containers:
    - name: {name}
      image: localhost/tandem-echo:1
      imagePullPolicy: Never{command}
---
"#
        )
    };
    let mut out = pod(
        "client",
        nodes[0],
        "app: client",
        "\n      command: [/bin/sleep, \"3600\"]",
    );
    for (index, node) in nodes.iter().enumerate().skip(1) {
        out.push_str(&pod(
            &format!("echo-{}", index + 1),
            node,
            "app: echo",
            "\n      readinessProbe: {tcpSocket: {port: 8080}, periodSeconds: 1}",
        ));
    }
    out.push_str(
        r#"apiVersion: v1
kind: Service
metadata:
  name: echo
  namespace: default
spec:
  type: NodePort
  selector: {app: echo}
  ports:
    - {name: http, port: 80, targetPort: 8080}
"#,
    );
    out
}
