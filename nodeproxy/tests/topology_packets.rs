//! Real packets through the rules each mode programs for a Service whose endpoints carry
//! topology hints, in the virtual cluster of `tandem-netlab`: node 1 (zone `zone-a`) with
//! a client pod and two endpoints hinted for `zone-a`, node 2 with two endpoints hinted for
//! `zone-b`. Only node 1 is programmed; its pods' packets to the cluster IP reach only
//! the zone-a endpoints while every ready endpoint has hints, and every endpoint once one
//! lacks them (kube-proxy's `CategorizeEndpoints`). The node proxy binary follows a change
//! of the Node's zone label. Root only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::json;
use tandem_common::ProxyMode;
use tandem_netlab::{EchoClient, Topology};
use tandem_proxy_rules::model::{Endpoint, Hints, NodeConfig};

/// The cluster IP of the reference state's nginx Service.
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 43, 35, 197);
/// The binary's test Service: the API server stand-in allocates from 10.96.0.0/16.
const SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 35, 197);
const MODES: [ProxyMode; 2] = [ProxyMode::Iptables, ProxyMode::Nftables];
const BIN: &str = env!("CARGO_BIN_EXE_tandem-nodeproxy");
/// Four endpoints each get a request at least once in 60 but about once in 5 million.
const REQUESTS: u32 = 60;

/// Node 1 with a client pod and two endpoint pods, node 2 with two endpoint pods.
fn topology() -> Option<Topology> {
    if !is_root() {
        eprintln!("skipped: needs root");
        return None;
    }
    let topo = Topology::builder()
        .nodes(2)
        .pods_per_node(&[3, 2])
        .handle_signals(false)
        .build()
        .unwrap();
    Some(topo)
}

/// The pods that answered `REQUESTS` GETs to the cluster IP from `netns`, each on a new
/// connection.
fn answering(netns: &tandem_netlab::Netns, ip: Ipv4Addr) -> BTreeSet<String> {
    EchoClient::locate()
        .unwrap()
        .with_timeout(Duration::from_secs(2))
        .http_get_many(netns, &format!("http://{ip}:80/"), REQUESTS)
        .unwrap()
        .into_iter()
        .map(|reply| {
            reply
                .unwrap_or_else(|e| panic!("a request failed: {e}"))
                .pod
        })
        .collect()
}

/// The cluster's pods: the client on node 1, the endpoints of zone-a (node 1) and zone-b
/// (node 2).
struct Pods<'a> {
    client: &'a tandem_netlab::Pod,
    zone_a: Vec<&'a tandem_netlab::Pod>,
    zone_b: Vec<&'a tandem_netlab::Pod>,
}

impl<'a> Pods<'a> {
    fn of(topo: &'a Topology) -> Self {
        let mut on_node1 = topo.pods_on(1);
        Self {
            client: on_node1.next().unwrap(),
            zone_a: on_node1.collect(),
            zone_b: topo.pods_on(2).collect(),
        }
    }

    fn names(pods: &[&tandem_netlab::Pod]) -> BTreeSet<String> {
        pods.iter().map(|pod| pod.name.clone()).collect()
    }

    fn all(&self) -> BTreeSet<String> {
        Self::names(&[&self.zone_a[..], &self.zone_b[..]].concat())
    }
}

#[test]
fn a_node_reaches_its_zones_endpoints_when_the_hints_allow_and_all_otherwise_under_each_mode() {
    let Some(topo) = topology() else {
        return;
    };
    let node = topo.node(1).unwrap();
    let pods = Pods::of(&topo);
    let port = topo.echo_http_port();
    let endpoint = |pod: &tandem_netlab::Pod, zones: &[&str], nodes: &[&str]| Endpoint {
        hints: Hints::of(zones.iter().copied(), nodes.iter().copied()),
        ..common::endpoint(pod.ip.octets(), port, &pod.node_name)
    };
    let hinted = || -> Vec<Endpoint> {
        let a = pods
            .zone_a
            .iter()
            .map(|pod| endpoint(pod, &["zone-a"], &[]));
        let b = pods
            .zone_b
            .iter()
            .map(|pod| endpoint(pod, &["zone-b"], &[]));
        a.chain(b).collect()
    };
    // One zone-b endpoint without hints: hints incomplete.
    let mut incomplete = hinted();
    incomplete[3].hints = None;
    // PreferSameNode: every endpoint hinted for a node, the first zone-a one for node 1.
    let same_node: Vec<Endpoint> = hinted()
        .into_iter()
        .enumerate()
        .map(|(i, ep)| Endpoint {
            hints: Hints::of(
                ep.zone_hints().to_vec(),
                [if i == 0 {
                    node.name.clone()
                } else {
                    format!("other-{i}")
                }],
            ),
            ..ep
        })
        .collect();
    let config = |zone: Option<&str>| NodeConfig {
        zone: zone.map(str::to_owned),
        ..node_named(&node.name)
    };
    let cases = [
        (
            "hints for zone-a",
            Some("zone-a"),
            hinted(),
            Pods::names(&pods.zone_a),
        ),
        (
            "the node moved to zone-b",
            Some("zone-b"),
            hinted(),
            Pods::names(&pods.zone_b),
        ),
        ("hints incomplete", Some("zone-a"), incomplete, pods.all()),
        ("node without a zone", None, hinted(), pods.all()),
        (
            "a zone no endpoint is hinted for",
            Some("zone-c"),
            hinted(),
            pods.all(),
        ),
        (
            "PreferSameNode",
            Some("zone-a"),
            same_node,
            Pods::names(&pods.zone_a[..1]),
        ),
    ];
    for mode in MODES {
        for (what, zone, endpoints, expected) in &cases {
            program(
                node,
                mode,
                config(*zone),
                &reference_state(endpoints.clone()),
            );
            assert_eq!(
                answering(&pods.client.netns, CLUSTER_IP),
                *expected,
                "{mode}: {what}"
            );
        }
    }
}

/// A file removed when the test ends, also when it fails.
struct RemoveOnDrop(String);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Polls `check` every 100 ms until it holds; panics after `limit`.
async fn eventually(limit: Duration, what: &str, mut check: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while started.elapsed() < limit {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out after {limit:?} waiting for {what}");
}

/// The binary, on node 1, against the API server stand-in running there: the Node's zone
/// label decides which endpoints its pods reach, a change of the label is followed without
/// a restart, and `trace` says which endpoints were chosen and why.
#[test]
fn the_node_proxy_follows_its_zones_label_under_each_mode() {
    let Some(topo) = topology() else {
        return;
    };
    let node = topo.node(1).unwrap();
    let pods = Pods::of(&topo);
    let (zone_a, zone_b, all) = (
        Pods::names(&pods.zone_a),
        Pods::names(&pods.zone_b),
        pods.all(),
    );
    let client = pods.client.netns.clone();
    let node_name = node.name.clone();
    let port = i32::from(topo.echo_http_port());
    let endpoints: Vec<serde_json::Value> = pods
        .zone_a
        .iter()
        .map(|pod| (pod, "zone-a"))
        .chain(pods.zone_b.iter().map(|pod| (pod, "zone-b")))
        .map(|(pod, zone)| {
            json!({
                "addresses": [pod.ip.to_string()],
                "conditions": {"ready": true},
                "nodeName": pod.node_name,
                "hints": {"forZones": [{"name": zone}]},
            })
        })
        .collect();
    node.netns
        .exec_checked(["ip", "link", "set", "lo", "up"])
        .unwrap();
    for mode in MODES {
        let (client, node_name, endpoints) = (client.clone(), node_name.clone(), endpoints.clone());
        let (zone_a, zone_b, all) = (zone_a.clone(), zone_b.clone(), all.clone());
        block_on_in(&node.netns, move || async move {
            let server = tandem_apiserver::spawn(tandem_apiserver::ServerConfig::default())
                .await
                .unwrap();
            let kubeconfig = format!("/tmp/tandem-topology-{}-{mode}.json", std::process::id());
            server
                .write_kubeconfig(std::path::Path::new(&kubeconfig))
                .await
                .unwrap();
            let _remove = RemoveOnDrop(kubeconfig.clone());
            let api = server.client().await.unwrap();
            let nodes: Api<Node> = Api::all(api.clone());
            let services: Api<Service> = Api::namespaced(api.clone(), "default");
            let slices: Api<EndpointSlice> = Api::namespaced(api, "default");
            let post = PostParams::default();
            let zone_label = |zone: &str| json!({"topology.kubernetes.io/zone": zone});
            let node_object =
                json!({"metadata": {"name": node_name, "labels": zone_label("zone-a")}});
            nodes
                .create(&post, &serde_json::from_value(node_object).unwrap())
                .await
                .unwrap();
            let service = json!({
                "metadata": {"name": "web", "namespace": "default"},
                "spec": {
                    "clusterIP": SERVICE_IP.to_string(),
                    "ports": [{"name": "http", "port": 80, "targetPort": port, "protocol": "TCP"}],
                    "trafficDistribution": "PreferClose",
                }
            });
            services
                .create(&post, &serde_json::from_value(service).unwrap())
                .await
                .unwrap();
            let slice = json!({
                "metadata": {"name": "web-1", "namespace": "default",
                    "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
                "endpoints": endpoints,
            });
            slices
                .create(&post, &serde_json::from_value(slice).unwrap())
                .await
                .unwrap();
            let proxy = start_node_proxy(
                &kubeconfig,
                &node_name,
                &["--proxy-mode", &mode.to_string()],
            );
            let reaches = |expected: BTreeSet<String>| {
                let client = client.clone();
                async move || {
                    let client = client.clone();
                    tokio::task::spawn_blocking(move || {
                        EchoClient::locate()
                            .unwrap()
                            .with_timeout(Duration::from_secs(1))
                            .http_get_many(&client, &format!("http://{SERVICE_IP}:80/"), REQUESTS)
                            .ok()
                            .map(|replies| {
                                replies
                                    .into_iter()
                                    .filter_map(Result::ok)
                                    .map(|reply| reply.pod)
                                    .collect::<BTreeSet<String>>()
                            })
                    })
                    .await
                    .unwrap()
                        == Some(expected.clone())
                }
            };
            let limit = Duration::from_secs(15);
            eventually(
                limit,
                &format!("{mode}: zone-a's endpoints"),
                reaches(zone_a),
            )
            .await;

            // The label changes: the proxy re-chooses, without a restart.
            let relabel = |zone: serde_json::Value| {
                Patch::Merge(json!({"metadata": {"labels": {"topology.kubernetes.io/zone": zone}}}))
            };
            nodes
                .patch(
                    &node_name,
                    &PatchParams::default(),
                    &relabel(json!("zone-b")),
                )
                .await
                .unwrap();
            eventually(
                limit,
                &format!("{mode}: zone-b's endpoints"),
                reaches(zone_b.clone()),
            )
            .await;
            let trace = tokio::process::Command::new(BIN)
                .args([
                    "--kubeconfig",
                    &kubeconfig,
                    "--node-name",
                    &node_name,
                    "--cluster-cidr",
                    "10.244.0.0/16",
                    "--proxy-mode",
                    &mode.to_string(),
                    "trace",
                    "--src",
                    "10.244.1.200",
                    "--dst",
                    &format!("{SERVICE_IP}:80"),
                ])
                .stderr(Stdio::inherit())
                .output()
                .await
                .unwrap();
            let trace = String::from_utf8(trace.stdout).unwrap();
            assert!(
                trace.contains(
                    "endpoints of default/web:http: topology: zone zone-b hints, 2 of 4 endpoints"
                ),
                "{trace}"
            );

            // Without the label, the hints cannot apply: every endpoint.
            nodes
                .patch(&node_name, &PatchParams::default(), &relabel(json!(null)))
                .await
                .unwrap();
            eventually(limit, &format!("{mode}: every endpoint"), reaches(all)).await;
            terminate(proxy).await;
        });
    }
}
