//! Real packets through the nftables mode's cluster-IP check as the node proxy binary
//! keeps it from ServiceCIDR objects, in the virtual cluster of `tandem-netlab`: node 1
//! with a client pod and a pod that holds an unallocated address of each of three ranges
//! (the node routes them to it, so a packet let through is answered). The API server
//! stand-in runs in node 1's namespace and serves ServiceCIDRs; the binary is given
//! `--service-cluster-ip-range` 10.98.0.0/16, which the objects replace, as kube-proxy
//! knows no other source. A new connection to an unallocated address of a ServiceCIDR is
//! dropped, one of a ServiceCIDR created later too, and no longer once it is deleted.
//! Every packet is sent from the client pod's namespace. Root only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use tandem_netlab::{EchoClient, Topology};

/// Unallocated addresses of the first ServiceCIDR, of the one created later, and of the
/// flag's range.
const IN_FIRST: Ipv4Addr = Ipv4Addr::new(10, 96, 200, 1);
const IN_SECOND: Ipv4Addr = Ipv4Addr::new(10, 97, 200, 1);
const IN_FLAG: Ipv4Addr = Ipv4Addr::new(10, 98, 200, 1);
/// How long a GET waits: a dropped connection runs into it, an answered one takes
/// milliseconds.
const TIMEOUT: Duration = Duration::from_millis(1000);

/// A file removed when the test ends, also when it fails.
struct RemoveOnDrop(String);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Whether a new connection from `netns` to `ip` on the echo's port is dropped (runs into
/// the timeout) rather than answered; a refusal is neither and fails the test.
async fn dropped(netns: &tandem_netlab::Netns, ip: Ipv4Addr, port: u16) -> bool {
    let netns = netns.clone();
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let reply = EchoClient::locate()
            .unwrap()
            .with_timeout(TIMEOUT)
            .http_get(&netns, &format!("http://{ip}:{port}/"));
        match reply {
            Ok(_) => false,
            Err(error) => {
                assert!(
                    started.elapsed() >= TIMEOUT,
                    "{ip}: refused, not dropped: {error}"
                );
                true
            }
        }
    })
    .await
    .unwrap()
}

/// Polls until each address's fate (dropped or not) is as expected; panics after 15 s.
async fn until_fates(
    netns: &tandem_netlab::Netns,
    port: u16,
    what: &str,
    expected: &[(Ipv4Addr, bool)],
) {
    let limit = Duration::from_secs(15);
    let started = Instant::now();
    loop {
        let mut fates = Vec::new();
        for &(ip, _) in expected {
            fates.push((ip, dropped(netns, ip, port).await));
        }
        if fates == expected {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "{what}: after {limit:?}, dropped: {fates:?}, expected {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The drop rules of the kernel's `cluster-ips-check`, as `nft` lists them in the node's
/// namespace.
fn kernel_check(node: &tandem_netlab::Netns) -> String {
    node.exec_checked(["nft", "list", "chain", "ip", "tandem", "cluster-ips-check"])
        .unwrap()
}

#[test]
fn the_nftables_mode_drops_unallocated_addresses_of_the_service_cidr_objects_as_they_change() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let topo = Topology::builder()
        .nodes(1)
        .pods_per_node(&[2])
        .handle_signals(false)
        .build()
        .unwrap();
    let node = topo.node(1).unwrap();
    let mut pods = topo.pods_on(1);
    let (client, holder) = (pods.next().unwrap(), pods.next().unwrap());
    for ip in [IN_FIRST, IN_SECOND, IN_FLAG] {
        holder
            .netns
            .exec_checked(["ip", "addr", "add", &format!("{ip}/32"), "dev", "lo"])
            .unwrap();
        route_via(&node.netns, ip, holder.ip);
    }
    node.netns
        .exec_checked(["ip", "link", "set", "lo", "up"])
        .unwrap();
    let port = topo.echo_http_port();
    let (client, node_netns, node_name) =
        (client.netns.clone(), node.netns.clone(), node.name.clone());
    block_on_in(&node.netns, move || async move {
        let server = tandem_apiserver::spawn(tandem_apiserver::ServerConfig::default())
            .await
            .unwrap();
        let kubeconfig = format!("/tmp/tandem-service-cidrs-{}.json", std::process::id());
        server
            .write_kubeconfig(std::path::Path::new(&kubeconfig))
            .await
            .unwrap();
        let _remove = RemoveOnDrop(kubeconfig.clone());
        let cidrs: Api<ServiceCIDR> = Api::all(server.client().await.unwrap());
        let object = |name: &str, cidr: &str| -> ServiceCIDR {
            serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"cidrs": [cidr]}}))
                .unwrap()
        };
        let post = PostParams::default();
        // The server's own Service CIDR is the default ServiceCIDR, as on kube-apiserver.
        let default = cidrs.get("kubernetes").await.unwrap();
        assert_eq!(default.spec.unwrap().cidrs.unwrap(), ["10.96.0.0/16"]);
        // Before any rule, every address answers: the fates below are the proxy's.
        until_fates(
            &client,
            port,
            "before the proxy",
            &[(IN_FIRST, false), (IN_SECOND, false), (IN_FLAG, false)],
        )
        .await;

        let proxy = start_node_proxy(
            &kubeconfig,
            &node_name,
            &[
                "--service-cluster-ip-range",
                "10.98.0.0/16",
                "--proxy-mode",
                "nftables",
            ],
        );
        // The object's range is dropped; the flag's is not (the objects replace it).
        until_fates(
            &client,
            port,
            "the kubernetes ServiceCIDR",
            &[(IN_FIRST, true), (IN_SECOND, false), (IN_FLAG, false)],
        )
        .await;
        let check = kernel_check(&node_netns);
        assert!(
            check.contains("10.96.0.0/16") && !check.contains("10.98.0.0/16"),
            "{check}"
        );

        // A second ServiceCIDR: its range is dropped too, without a restart.
        cidrs
            .create(&post, &object("extra", "10.97.0.0/16"))
            .await
            .unwrap();
        until_fates(
            &client,
            port,
            "a second ServiceCIDR",
            &[(IN_FIRST, true), (IN_SECOND, true), (IN_FLAG, false)],
        )
        .await;
        assert!(kernel_check(&node_netns).contains("10.97.0.0/16"));

        // Deleted: no longer.
        cidrs
            .delete("extra", &DeleteParams::default())
            .await
            .unwrap();
        until_fates(
            &client,
            port,
            "the second ServiceCIDR deleted",
            &[(IN_FIRST, true), (IN_SECOND, false), (IN_FLAG, false)],
        )
        .await;
        assert!(!kernel_check(&node_netns).contains("10.97.0.0/16"));
        terminate(proxy).await;
        server.shutdown().await.unwrap();
    });
}
