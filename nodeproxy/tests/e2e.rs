//! The `tandem-nodeproxy` binary end to end: in a fresh network namespace, against the API
//! server stand-in running in the same namespace. Root only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use tandem_nodeproxy::datapath::iptables::backend::Backend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_tandem-nodeproxy");
const HEALTHZ: &str = "127.0.0.1:10256";
const METRICS: &str = "127.0.0.1:10249";

async fn http_get(address: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).await.ok()?;
    let status = reply.split_whitespace().nth(1)?.parse().ok()?;
    let body = reply.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

/// Poll `check` every 20 ms until it holds or `limit` passes; returns the time it took.
async fn eventually(limit: Duration, what: &str, mut check: impl AsyncFnMut() -> bool) -> Duration {
    let started = Instant::now();
    while started.elapsed() < limit {
        if check().await {
            return started.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out after {limit:?} waiting for {what}");
}

fn slice(name: &str, service: &str, endpoints: &[(&str, &str)]) -> EndpointSlice {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
        "endpoints": endpoints.iter().map(|(ip, node)| json!({
            "addresses": [ip], "conditions": {"ready": true}, "nodeName": node
        })).collect::<Vec<_>>(),
    }))
    .unwrap()
}

fn load_balancer(name: &str, local: bool) -> Service {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "type": "LoadBalancer",
            "ports": [{"name": "http", "port": 80, "targetPort": 80, "protocol": "TCP"}],
            "loadBalancerSourceRanges": ["203.0.113.0/24"],
            "externalTrafficPolicy": if local { "Local" } else { "Cluster" },
        }
    }))
    .unwrap()
}

fn spawn_proxy(kubeconfig: &str, extra: &[&str]) -> Child {
    Command::new(BIN)
        .args([
            "--kubeconfig",
            kubeconfig,
            "--node-name",
            "node-a",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--healthz-bind-address",
            HEALTHZ,
            "--metrics-bind-address",
            METRICS,
        ])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

async fn run_to_end(args: &[&str]) -> String {
    let output = Command::new(BIN)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "{args:?}: {}", output.status);
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn the_binary_programs_rules_serves_health_and_cleans_up() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    in_fresh_netns(|netns| async move {
        run("ip", &["link", "set", "lo", "up"]);
        let server = tandem_apiserver::spawn(tandem_apiserver::ServerConfig::default())
            .await
            .unwrap();
        let kubeconfig = format!("/tmp/{netns}-kubeconfig.json");
        server
            .write_kubeconfig(std::path::Path::new(&kubeconfig))
            .await
            .unwrap();
        let client = server.client().await.unwrap();
        let nodes: Api<Node> = Api::all(client.clone());
        let services: Api<Service> = Api::namespaced(client.clone(), "default");
        let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
        let post = PostParams::default();
        nodes
            .create(
                &post,
                &serde_json::from_value(json!({"metadata": {"name": "node-a"}})).unwrap(),
            )
            .await
            .unwrap();
        let nginx = services
            .create(&post, &load_balancer("nginx-service", false))
            .await
            .unwrap();
        services
            .patch_status(
                "nginx-service",
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.20"}]}}}),
                ),
            )
            .await
            .unwrap();
        slices
            .create(
                &post,
                &slice(
                    "nginx-a",
                    "nginx-service",
                    &[("10.244.1.5", "node-a"), ("10.244.2.7", "node-b")],
                ),
            )
            .await
            .unwrap();
        let cluster_ip = nginx.spec.unwrap().cluster_ip.unwrap();

        let proxy = spawn_proxy(
            &kubeconfig,
            &[
                "--min-sync-period",
                "100ms",
                "--sync-period",
                "2s",
                "--drift-check-period",
                "2s",
            ],
        );
        let backend = Backend::Nft; // what auto-detection picks in an empty namespace
        let startup = eventually(Duration::from_secs(30), "the first sync", async || {
            save(backend, "nat").contains("-j KUBE-FW-6IM33IEVEEV7U3GP")
        })
        .await;
        eprintln!("first rules in the kernel {startup:?} after start");
        let nat = save(backend, "nat");
        assert!(nat.contains(&format!("-d {cluster_ip}/32 -p tcp -m comment --comment \"default/nginx-service:http cluster IP\"")), "{nat}");
        assert!(nat.contains("-s 203.0.113.0/24 -m comment --comment \"default/nginx-service:http loadbalancer IP\" -j KUBE-SVC-6IM33IEVEEV7U3GP"));
        assert!(nat.contains("--to-destination 10.244.2.7:80"));

        // Healthy once the sync loop has recorded the first sync, a moment after its rules
        // are in the kernel (the restore returns, then the other mode's table is removed).
        let healthz: SocketAddr = HEALTHZ.parse().unwrap();
        let mut answer = None;
        eventually(Duration::from_secs(5), "/healthz 200", async || {
            answer = http_get(healthz, "/healthz").await;
            answer.as_ref().is_some_and(|(status, _)| *status == 200)
        })
        .await;
        let (_, body) = answer.unwrap();
        let body: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(body["lastUpdated"].is_string() && body["currentTime"].is_string());

        // An endpoint replaced: in the kernel well within a second (min sync period 100 ms).
        slices
            .replace("nginx-a", &post, &{
                let mut s = slice(
                    "nginx-a",
                    "nginx-service",
                    &[("10.244.1.5", "node-a"), ("10.244.3.9", "node-c")],
                );
                s.metadata.resource_version = slices
                    .get("nginx-a")
                    .await
                    .unwrap()
                    .metadata
                    .resource_version;
                s
            })
            .await
            .unwrap();
        let update = eventually(Duration::from_secs(5), "the endpoint change", async || {
            let nat = save(backend, "nat");
            nat.contains("--to-destination 10.244.3.9:80") && !nat.contains("10.244.2.7")
        })
        .await;
        eprintln!("endpoint change in the kernel after {update:?}");
        assert!(
            update < Duration::from_secs(1),
            "endpoint change took {update:?}"
        );

        // A Service another proxy owns, or that says it is headless, is left alone, also
        // when the label comes or goes on a live Service (kube-proxy's label selector).
        for label in [
            "service.kubernetes.io/service-proxy-name",
            "service.kubernetes.io/headless",
        ] {
            let labelled = |value: serde_json::Value| {
                Patch::Merge(json!({"metadata": {"labels": {label: value}}}))
            };
            services
                .patch(
                    "nginx-service",
                    &PatchParams::default(),
                    &labelled(json!("other")),
                )
                .await
                .unwrap();
            eventually(
                Duration::from_secs(5),
                "rules gone with the label",
                async || !save(backend, "nat").contains("KUBE-FW-6IM33IEVEEV7U3GP"),
            )
            .await;
            services
                .patch(
                    "nginx-service",
                    &PatchParams::default(),
                    &labelled(json!(null)),
                )
                .await
                .unwrap();
            eventually(
                Duration::from_secs(5),
                "rules back without the label",
                async || save(backend, "nat").contains("--to-destination 10.244.3.9:80"),
            )
            .await;
        }

        // An externalTrafficPolicy Local Service gets a health-check server.
        services
            .create(&post, &load_balancer("local", true))
            .await
            .unwrap();
        let hcnp = services
            .get("local")
            .await
            .unwrap()
            .spec
            .unwrap()
            .health_check_node_port
            .expect("allocated") as u16;
        slices
            .create(
                &post,
                &slice("local-a", "local", &[("10.244.1.8", "node-a")]),
            )
            .await
            .unwrap();
        let hc: SocketAddr = format!("127.0.0.1:{hcnp}").parse().unwrap();
        eventually(
            Duration::from_secs(5),
            "the health-check port",
            async || {
                http_get(hc, "/")
                    .await
                    .is_some_and(|(status, _)| status == 200)
            },
        )
        .await;
        let (_, body) = http_get(hc, "/").await.unwrap();
        assert_eq!(
            body,
            r#"{"service": {"namespace": "default", "name": "local"}, "localEndpoints": 1}"#
        );
        slices.delete("local-a", &Default::default()).await.unwrap();
        eventually(
            Duration::from_secs(5),
            "503 without local endpoints",
            async || {
                http_get(hc, "/")
                    .await
                    .is_some_and(|(status, _)| status == 503)
            },
        )
        .await;
        services.delete("local", &Default::default()).await.unwrap();
        eventually(
            Duration::from_secs(5),
            "the health-check server to stop",
            async || http_get(hc, "/").await.is_none(),
        )
        .await;

        // A node marked for deletion reports unhealthy so load balancers drain it.
        nodes
            .patch(
                "node-a",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}})),
            )
            .await
            .unwrap();
        eventually(
            Duration::from_secs(5),
            "healthz 503 on a draining node",
            async || {
                http_get(healthz, "/healthz")
                    .await
                    .is_some_and(|(status, _)| status == 503)
            },
        )
        .await;
        // The process itself stays live, so the kubelet does not restart it (KEP-3836).
        let (status, body) = http_get(healthz, "/livez").await.unwrap();
        assert_eq!(status, 200, "{body}");

        // Let a periodic sync (every 2 s here) compare the incremental rules with a full
        // rebuild.
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        let (status, metrics) = http_get(METRICS.parse().unwrap(), "/metrics")
            .await
            .unwrap();
        assert_eq!(status, 200);
        assert!(
            metrics.contains("tandem_nodeproxy_sync_proxy_rules_total{result=\"Success\"}"),
            "{metrics}"
        );
        assert!(
            metrics.contains("tandem_nodeproxy_endpoints_changes_total"),
            "{metrics}"
        );
        let periodic_syncs: u64 = metrics
            .lines()
            .find_map(|line| {
                line.strip_prefix("tandem_nodeproxy_sync_full_proxy_rules_duration_seconds_count ")
            })
            .and_then(|count| count.trim().parse().ok())
            .unwrap_or(0);
        assert!(periodic_syncs >= 1, "no periodic sync yet: {metrics}");
        assert!(
            metrics.contains("tandem_nodeproxy_sync_divergence_total 0\n"),
            "{metrics}"
        );

        // Nothing changes now: once a full check has run with nothing changed since, the
        // next ones find the ruleset's generation as it was and are skipped...
        let full_checks = async || {
            let (_, metrics) = http_get(METRICS.parse().unwrap(), "/metrics")
                .await
                .unwrap();
            let count = |name: &str| -> u64 {
                metrics
                    .lines()
                    .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
                    .and_then(|count| count.trim().parse().ok())
                    .unwrap_or(0)
            };
            (
                count("tandem_nodeproxy_sync_full_proxy_rules_duration_seconds_count"),
                count("tandem_nodeproxy_sync_full_checks_skipped_total"),
            )
        };
        eventually(
            Duration::from_secs(10),
            "a full check skipped",
            async || full_checks().await.1 >= 1,
        )
        .await;
        let (ran, skipped) = full_checks().await;
        // ...until anyone commits anything, to any table: the next one runs.
        let status = Command::new("nft")
            .args(["add", "table", "inet", "tandem_test_other"])
            .status()
            .await
            .unwrap();
        assert!(status.success());
        eventually(
            Duration::from_secs(10),
            "a full check after someone else's commit",
            async || full_checks().await.0 > ran,
        )
        .await;
        eprintln!("full checks: {ran} ran and {skipped} skipped before someone else's commit");

        // The tracer over the rules built from the API.
        let common = [
            "--kubeconfig",
            kubeconfig.as_str(),
            "--node-name",
            "node-a",
            "--cluster-cidr",
            "10.244.0.0/16",
        ];
        let allowed = run_to_end(
            &[
                &common[..],
                &["trace", "--src", "203.0.113.5", "--dst", "198.51.100.20:80"],
            ]
            .concat(),
        )
        .await;
        assert!(
            allowed.contains("DNAT to 10.244.3.9:80") && allowed.contains("DNAT to 10.244.1.5:80"),
            "{allowed}"
        );
        let denied = run_to_end(
            &[
                &common[..],
                &[
                    "trace",
                    "--src",
                    "192.0.2.1",
                    "--dst",
                    "198.51.100.20",
                    "--dport",
                    "80",
                ],
            ]
            .concat(),
        )
        .await;
        assert!(denied.contains("DROP"), "{denied}");

        // internalTrafficPolicy Local: a pod's request to the cluster IP goes to node-a's
        // endpoint only, through KUBE-SVL, in the kernel and in the tracer.
        let itp_local: Service = serde_json::from_value(json!({
            "metadata": {"name": "itp", "namespace": "default"},
            "spec": {
                "ports": [{"name": "http", "port": 80, "targetPort": 80, "protocol": "TCP"}],
                "internalTrafficPolicy": "Local",
            }
        }))
        .unwrap();
        services.create(&post, &itp_local).await.unwrap();
        let itp_cluster_ip = services
            .get("itp")
            .await
            .unwrap()
            .spec
            .unwrap()
            .cluster_ip
            .expect("allocated");
        slices
            .create(
                &post,
                &slice(
                    "itp-a",
                    "itp",
                    &[("10.244.1.7", "node-a"), ("10.244.2.7", "node-b")],
                ),
            )
            .await
            .unwrap();
        eventually(
            Duration::from_secs(5),
            "the KUBE-SVL chain",
            async || save(backend, "nat").contains(&format!("-d {itp_cluster_ip}/32 -p tcp -m comment --comment \"default/itp:http cluster IP\" -m tcp --dport 80 -j KUBE-SVL-")),
        )
        .await;
        let from_pod = run_to_end(
            &[
                &common[..],
                &[
                    "trace",
                    "--src",
                    "10.244.1.20",
                    "--dst",
                    &format!("{itp_cluster_ip}:80"),
                ],
            ]
            .concat(),
        )
        .await;
        assert!(
            from_pod.contains("KUBE-SVL-")
                && from_pod.contains("DNAT to 10.244.1.7:80")
                && !from_pod.contains("10.244.2.7"),
            "{from_pod}"
        );

        // --detect-local-mode in the tracer: NodeCIDR reads the Node's spec.podCIDRs, the
        // interface modes look at the packet's --in-interface.
        nodes
            .patch(
                "node-a",
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]}}),
                ),
            )
            .await
            .unwrap();
        let itp_dst = format!("{itp_cluster_ip}:80");
        let node_cidr = ["--detect-local-mode", "NodeCIDR"];
        let bridge = [
            "--detect-local-mode",
            "BridgeInterface",
            "--pod-bridge-interface",
            "cni0",
        ];
        let prefix = [
            "--detect-local-mode",
            "InterfaceNamePrefix",
            "--pod-interface-name-prefix",
            "veth",
        ];
        // (source, flags, interface it came in on, source kept)
        for (src, detect, iif, kept) in [
            ("10.244.1.20", &node_cidr[..], "eth0", true),
            ("10.244.2.20", &node_cidr[..], "eth0", false),
            ("10.244.1.20", &bridge[..], "cni0", true),
            ("10.244.1.20", &bridge[..], "eth0", false),
            ("10.244.1.20", &prefix[..], "veth3", true),
            ("10.244.1.20", &prefix[..], "cni0", false),
        ] {
            let traced = run_to_end(
                &[
                    &common[..],
                    &["trace", "--src", src, "--dst", &itp_dst],
                    detect,
                    &["--in-interface", iif],
                ]
                .concat(),
            )
            .await;
            let expected = if kept { "source kept" } else { "masqueraded" };
            assert!(
                traced.contains("DNAT to 10.244.1.7:80") && traced.contains(expected),
                "{src} {detect:?} on {iif}: {traced}"
            );
        }

        // SIGTERM: clean exit, rules stay.
        let before_stop = save(backend, "nat");
        terminate(proxy).await;
        assert_eq!(save(backend, "nat"), before_stop);

        run_to_end(&["--cleanup", "--iptables-backend", "nft"]).await;
        for table in ["mangle", "nat", "filter"] {
            let left = save(backend, table);
            assert!(!left.contains("KUBE-"), "{table}: {left}");
        }
        let _ = std::fs::remove_file(&kubeconfig);
        server.shutdown().await.unwrap();
    });
}
