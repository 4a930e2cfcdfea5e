//! The `tandem-nodeproxy` binary with a proxier per IP family, with real packets of both
//! families, in a dual-stack virtual cluster of `tandem-netlab` (root only; IPv6 beside
//! IPv4 on every link). One node with two pods; the API server stand-in (dual-stack Service CIDRs)
//! and the node proxy (`--cluster-cidr` of both families, each proxy mode in turn) run in
//! the node's namespace; the edge routes each LB IP to the node's address of its family
//! (passthrough). Clients connect from their own namespaces: the in-range client's
//! networks are in every Service's source ranges, the out-of-range client's are not.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::core::v1::{Node as K8sNode, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tandem_apiserver::service::ServiceCidrs;
use tandem_common::IpFamily;
use tandem_netlab::{Host, Netns, Node, Pod, Topology, addr};
use tandem_nftables::NftFamily;
use tandem_nodeproxy::datapath::iptables::backend::{Backend, Tools};
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_tandem-nodeproxy");
const POD_PORT: u16 = 8080;
const CLUSTER_CIDRS: &str = "10.244.0.0/16,fd00:10:244::/56";
/// The node's and the in-range client's IPv6 addresses in netlab's plan
/// (`tandem_netlab::addr::v6`).
const NODE_V6: &str = "2001:db8:18::11";
const CLIENT_IN_RANGE_V6: &str = "2001:db8:203::10";
/// The LB IPs of the Cluster-policy Service and of the Local-policy one, per family.
const LB_V4: &str = "198.51.100.20";
const LB_V6: &str = "2001:db8:51:100::20";
const LOCAL_LB_V4: &str = "198.51.100.21";
const LOCAL_LB_V6: &str = "2001:db8:51:100::21";

fn pod_v6(pod: &Pod) -> String {
    pod.ip6.expect("a dual-stack topology").to_string()
}

fn ip(netns: &Netns, args: &[&str]) {
    netns.exec_checked(["ip"].iter().chain(args)).unwrap();
}

/// The edge routes each LB IP to the node's address of its family (passthrough), once
/// the topology's IPv6 links work.
fn route_lb_ips(topo: &Topology) {
    let edge = &topo.edge().netns;
    let node = topo.node(1).unwrap();
    assert_eq!(node.ip6, Some(NODE_V6.parse().unwrap()));
    for vip in [LB_V4, LOCAL_LB_V4] {
        route_via(edge, vip.parse().unwrap(), node.ip);
    }
    for vip in [LB_V6, LOCAL_LB_V6] {
        ip(edge, &["-6", "route", "add", vip, "via", NODE_V6]);
    }
    // New IPv6 links take a moment (neighbour discovery, the edge turning router): wait
    // until both clients reach the node, whose closed port answers with a reset.
    for client in [topo.client_in_range(), topo.client_out_of_range()] {
        let started = Instant::now();
        while !client
            .netns
            .run_in_thread(|| {
                let closed_port = socket(NODE_V6, 1);
                TcpStream::connect_timeout(&closed_port, Duration::from_millis(500))
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
            })
            .unwrap()
        {
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "{} never reached the node over IPv6",
                client.netns.name()
            );
        }
    }
}

/// A pod's server answering each connection with `<pod> <client address>`.
fn who_am_i(mut stream: TcpStream, client: SocketAddr, name: &str) {
    let answer = format!("{name} {}\n", client.ip().to_canonical());
    let _ = std::io::Write::write_all(&mut stream, answer.as_bytes());
}

/// `count` connections to `target` from `netns`: per answer, the pod and the client
/// address it saw; the failures as errors.
fn ask(netns: &Netns, target: SocketAddr, count: usize) -> Vec<Result<(String, IpAddr), String>> {
    netns
        .run_in_thread(move || {
            (0..count)
                .map(|_| {
                    let stream = TcpStream::connect_timeout(&target, Duration::from_secs(1))
                        .map_err(|e| e.to_string())?;
                    stream
                        .set_read_timeout(Some(Duration::from_secs(1)))
                        .map_err(|e| e.to_string())?;
                    let mut line = String::new();
                    BufReader::new(stream)
                        .read_line(&mut line)
                        .map_err(|e| e.to_string())?;
                    let (pod, client) = line.trim().split_once(' ').ok_or(line.clone())?;
                    Ok((pod.to_owned(), client.parse().map_err(|_| line.clone())?))
                })
                .collect()
        })
        .unwrap()
}

/// Asserts that `count` connections to `target` all succeed, spread over both pods, each
/// pod seeing `client` as the source when given; returns the pods that answered.
fn assert_served(netns: &Netns, target: SocketAddr, client: Option<IpAddr>) {
    let answers = ask(netns, target, 24);
    let mut pods = std::collections::BTreeMap::<String, usize>::new();
    for answer in &answers {
        let (pod, seen) = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("{target} from {}: {e}", netns.name()));
        if let Some(client) = client {
            assert_eq!(*seen, client, "{target}: the pod saw the client's address");
        }
        *pods.entry(pod.clone()).or_default() += 1;
    }
    eprintln!("  {target} from {}: {pods:?}", netns.name());
    assert_eq!(pods.len(), 2, "{target}: spread over both pods: {pods:?}");
}

fn assert_dropped(netns: &Netns, target: SocketAddr) {
    let answers = ask(netns, target, 2);
    assert!(
        answers
            .iter()
            .all(|a| a.as_ref().is_err_and(|e| e.contains("timed out"))),
        "{target} from {}: {answers:?}",
        netns.name()
    );
}

fn socket(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

fn node_object(topo: &Topology) -> K8sNode {
    let node = topo.node(1).unwrap();
    serde_json::from_value(json!({
        "metadata": {"name": node.name},
        "status": {"addresses": [
            {"type": "InternalIP", "address": node.ip.to_string()},
            {"type": "InternalIP", "address": NODE_V6},
        ]},
    }))
    .unwrap()
}

fn dual_stack_load_balancer(name: &str, local: bool) -> Service {
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "type": "LoadBalancer",
            "ipFamilyPolicy": "RequireDualStack",
            "ipFamilies": ["IPv4", "IPv6"],
            "ports": [{"name": "http", "port": 80, "targetPort": POD_PORT, "protocol": "TCP"}],
            "loadBalancerSourceRanges": ["203.0.113.0/24", "2001:db8:203::/64"],
            "externalTrafficPolicy": if local { "Local" } else { "Cluster" },
        }
    }))
    .unwrap()
}

fn slice(service: &str, family: &str, pods: &[Pod]) -> EndpointSlice {
    let address = |pod: &Pod| match family {
        "IPv4" => pod.ip.to_string(),
        _ => pod_v6(pod),
    };
    serde_json::from_value(json!({
        "metadata": {
            "name": format!("{service}-{}", family.to_lowercase()),
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": family,
        "ports": [{"name": "http", "port": POD_PORT, "protocol": "TCP"}],
        "endpoints": pods.iter().map(|pod| json!({
            "addresses": [address(pod)], "conditions": {"ready": true}, "nodeName": pod.node_name,
        })).collect::<Vec<_>>(),
    }))
    .unwrap()
}

fn spawn_proxy(kubeconfig: &str, node_name: &str, mode: &str, log: Stdio) -> Child {
    Command::new(BIN)
        .args([
            "--kubeconfig",
            kubeconfig,
            "--node-name",
            node_name,
            "--proxy-mode",
            mode,
            "--cluster-cidr",
            CLUSTER_CIDRS,
            "--healthz-bind-address",
            "0.0.0.0:10256",
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--sync-period",
            "2s",
            "--min-sync-period",
            "100ms",
        ])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// The ip6tables programs of the backend an empty namespace gets (nf_tables).
fn ip6tables() -> Tools {
    Tools::new(Backend::Nft, IpFamily::V6)
}

fn ip6tables_save(table: &str) -> String {
    run(ip6tables().save(), &["-t", table])
}

/// `nft list table ip tandem` (or `ip6`); empty without the table.
fn nft_table(family: IpFamily) -> String {
    let table = family.nft_table();
    let output = std::process::Command::new("nft")
        .arg("list")
        .arg("table")
        .args(table.split(' '))
        .output()
        .unwrap();
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The node proxy's IPv6 NAT rules in `mode`, as the kernel lists them.
fn ipv6_rules(mode: &str) -> String {
    match mode {
        "iptables" => ip6tables_save("nat"),
        _ => nft_table(IpFamily::V6),
    }
}

/// How `pod`'s IPv6 endpoint shows in [`ipv6_rules`]: a DNAT target, or an endpoint map
/// element.
fn endpoint_in_rules(mode: &str, pod: &Pod) -> String {
    match mode {
        "iptables" => format!("[{}]:{POD_PORT}", pod_v6(pod)),
        _ => format!("{} . {POD_PORT}", pod_v6(pod)),
    }
}

/// An IPv6 rule someone else deleted: a KUBE-SEP DNAT rule with ip6tables, or the
/// dispatch rule of `services` in `ip6 tandem` with nft.
struct Deleted {
    mode: &'static str,
    count: usize,
    at: Instant,
}

impl Deleted {
    fn counted(mode: &str) -> usize {
        let needle = match mode {
            "iptables" => "-j DNAT",
            _ => "vmap @service-ips",
        };
        ipv6_rules(mode).matches(needle).count()
    }

    fn is_back(&self) -> bool {
        Self::counted(self.mode) == self.count
    }
}

fn delete_an_ipv6_rule(mode: &'static str) -> Deleted {
    let count = Deleted::counted(mode);
    if mode == "iptables" {
        let sep = ip6tables_save("nat")
            .lines()
            .find(|l| l.starts_with("-A KUBE-SEP-") && l.contains("-j DNAT"))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap()
            .to_owned();
        run(ip6tables().iptables(), &["-t", "nat", "-D", &sep, "2"]);
    } else {
        run("nft", &["flush", "chain", "ip6", "tandem", "services"]);
    }
    // Not checked that the rule is gone now: the kernel announces the deletion, and the
    // repair may already be written (`run` checked that the deletion succeeded).
    Deleted {
        mode,
        count,
        at: Instant::now(),
    }
}

/// From outside and from the node, both families: LB IPs spread over both pods, the
/// source ranges, eTP Local's client address, ClusterIP and NodePort over IPv6.
fn assert_both_families_served(
    c1: &Host,
    c2: &Host,
    node: &Node,
    cluster_ip_v6: &str,
    node_port: u16,
) {
    let (c1_ns, c2_ns) = (&c1.netns, &c2.netns);
    eprintln!("a dual-stack LoadBalancer answers on both LB IPs, over both pods");
    assert_served(c1_ns, socket(LB_V4, 80), None);
    assert_served(c1_ns, socket(LB_V6, 80), None);
    eprintln!("a client outside the source ranges is dropped, in both families");
    assert_dropped(c2_ns, socket(LB_V4, 80));
    assert_dropped(c2_ns, socket(LB_V6, 80));
    eprintln!("externalTrafficPolicy Local keeps the IPv6 client's address");
    assert_served(
        c1_ns,
        socket(LOCAL_LB_V6, 80),
        Some(CLIENT_IN_RANGE_V6.parse().unwrap()),
    );
    assert_served(c1_ns, socket(LOCAL_LB_V4, 80), Some(c1.ip.into()));
    eprintln!("ClusterIP over IPv6 from the node, NodePort over IPv6 from outside");
    assert_served(&node.netns, socket(cluster_ip_v6, 80), None);
    assert_served(c1_ns, socket(NODE_V6, node_port), None);
    assert_served(c1_ns, SocketAddr::new(node.ip.into(), node_port), None);
}
#[test]
fn both_families_are_served_with_real_packets() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let topo = Topology::builder()
        .nodes(1)
        .pods_per_node(&[2])
        .without_echo()
        .handle_signals(false)
        .ipv6()
        .build()
        .unwrap();
    route_lb_ips(&topo);
    let _servers: Vec<PodServer> = topo
        .pods()
        .iter()
        .map(|pod| PodServer::start(pod, Ipv6Addr::UNSPECIFIED.into(), POD_PORT, who_am_i))
        .collect();
    let pods = topo.pods().to_vec();
    let node = topo.node(1).unwrap().clone();
    let node_object = node_object(&topo);
    let (c1, c2): (Host, Host) = (
        topo.client_in_range().clone(),
        topo.client_out_of_range().clone(),
    );
    let netns = node.netns.clone();
    block_on_in(&netns, move || async move {
        let mut config = tandem_apiserver::ServerConfig::default();
        config.store.service_cidrs = format!("{},{}", addr::SERVICE_CIDR, addr::v6::SERVICE_CIDR)
            .parse::<ServiceCidrs>()
            .unwrap();
        let server = tandem_apiserver::spawn(config).await.unwrap();
        let kubeconfig = format!("/tmp/{}-kubeconfig.json", node.netns.name());
        server
            .write_kubeconfig(std::path::Path::new(&kubeconfig))
            .await
            .unwrap();
        let client = server.client().await.unwrap();
        let post = PostParams::default();
        Api::<K8sNode>::all(client.clone())
            .create(&post, &node_object)
            .await
            .unwrap();
        let services: Api<Service> = Api::namespaced(client.clone(), "default");
        let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
        for (name, local, ingress) in [
            ("web", false, [LB_V4, LB_V6]),
            ("local", true, [LOCAL_LB_V4, LOCAL_LB_V6]),
        ] {
            services
                .create(&post, &dual_stack_load_balancer(name, local))
                .await
                .unwrap();
            let status = json!({"status": {"loadBalancer": {"ingress":
                ingress.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}}});
            services
                .patch_status(name, &PatchParams::default(), &Patch::Merge(status))
                .await
                .unwrap();
            for family in ["IPv4", "IPv6"] {
                slices
                    .create(&post, &slice(name, family, &pods))
                    .await
                    .unwrap();
            }
        }
        let web: Value = serde_json::to_value(services.get("web").await.unwrap()).unwrap();
        let cluster_ip_v6 = web["spec"]["clusterIPs"][1].as_str().unwrap().to_owned();
        let node_port = web["spec"]["ports"][0]["nodePort"].as_u64().unwrap() as u16;

        for mode in ["iptables", "nftables"] {
            eprintln!("{mode} mode");
            let proxy = spawn_proxy(&kubeconfig, &node.name, mode, Stdio::inherit());
            let started = Instant::now();
            let pod_endpoint = endpoint_in_rules(mode, &pods[1]);
            while !ipv6_rules(mode).contains(&pod_endpoint) {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "no IPv6 rules:\n{}",
                    ipv6_rules(mode)
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            eprintln!(
                "{mode}: IPv6 rules in {:?} after the start",
                started.elapsed()
            );
            let (client, outsider, this_node) = (c1.clone(), c2.clone(), node.clone());
            let cluster_ip_v6 = cluster_ip_v6.clone();
            tokio::task::spawn_blocking(move || {
                assert_both_families_served(
                    &client,
                    &outsider,
                    &this_node,
                    &cluster_ip_v6,
                    node_port,
                )
            })
            .await
            .unwrap();

            // The tracer follows an IPv6 packet through the IPv6 proxier's rules.
            let traced = Command::new(BIN)
                .args(["--kubeconfig", &kubeconfig, "--node-name", &node.name])
                .args(["--cluster-cidr", CLUSTER_CIDRS, "--proxy-mode", mode])
                .args(["trace", "--src", CLIENT_IN_RANGE_V6])
                .args(["--dst", &format!("[{LB_V6}]:80")])
                .output()
                .await
                .unwrap();
            let traced = String::from_utf8_lossy(&traced.stdout);
            for pod in &pods {
                let dnat = format!("DNAT to [{}]:{POD_PORT}", pod_v6(pod));
                assert!(traced.contains(&dnat), "{mode}: {dnat} not in\n{traced}");
            }

            // /healthz answers on the node's IPv6 address too (`0.0.0.0` means both).
            let healthz = ask_http(&c1.netns, socket(NODE_V6, 10256)).await;
            assert!(healthz.starts_with("HTTP/1.1 200"), "{healthz}");

            // The IPv6 proxier's read-back repairs its own rules: what someone deletes
            // is back at once (the kernel announces the change).
            let deleted = delete_an_ipv6_rule(mode);
            while !deleted.is_back() {
                assert!(
                    deleted.at.elapsed() < Duration::from_secs(10),
                    "{mode}: the IPv6 rule was not repaired:\n{}",
                    ipv6_rules(mode)
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            eprintln!(
                "{mode}: the IPv6 rule deleted is back {:?} later",
                deleted.at.elapsed()
            );

            terminate(proxy).await;
            // --cleanup removes the rules of both families, in both modes.
            let cleaned = Command::new(BIN)
                .args(["--cleanup"])
                .status()
                .await
                .unwrap();
            assert!(cleaned.success());
            for family in [IpFamily::V4, IpFamily::V6] {
                assert_eq!(nft_table(family), "", "{mode}: {family} table left");
            }
            assert!(
                !ip6tables_save("nat").contains("KUBE-SVC-"),
                "{}",
                ip6tables_save("nat")
            );
            assert!(!save(Backend::Nft, "nat").contains("KUBE-SVC-"));
        }
        let _ = std::fs::remove_file(&kubeconfig);
        server.shutdown().await.unwrap();
    });
}

/// A plain HTTP GET of `/healthz` from `netns`: the whole answer.
async fn ask_http(netns: &Netns, target: SocketAddr) -> String {
    let netns = netns.clone();
    tokio::task::spawn_blocking(move || {
        netns
            .run_in_thread(move || {
                let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(2))?;
                std::io::Write::write_all(
                    &mut stream,
                    b"GET /healthz HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n",
                )?;
                let mut answer = String::new();
                std::io::Read::read_to_string(&mut stream, &mut answer)?;
                Ok::<_, std::io::Error>(answer)
            })
            .unwrap()
            .unwrap_or_else(|e| e.to_string())
    })
    .await
    .unwrap()
}
