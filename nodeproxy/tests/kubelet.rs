//! A node with the kubelet v1.21 (`tests/data/kubelet-v1.21.iptables`): its chains and jumps
//! must come through the node proxy's start, syncs, mode switches and `--cleanup`, in both
//! modes and on both iptables backends, byte for byte as the kernel prints them, counters
//! included (a chain flushed and written again with the same rules would lose them); and
//! what an older node proxy left in the kubelet's KUBE-FIREWALL goes, and only that. Root
//! only, each backend in a fresh network namespace.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::process::Command;

use common::*;
use prometheus_client::registry::Registry;
use tandem_common::ProxyMode;
use tandem_nodeproxy::datapath::iptables::backend::{Backend, BackendChoice};
use tandem_nodeproxy::datapath::iptables::restore::is_owned_chain;
use tandem_nodeproxy::datapath::{self, DataPath};
use tandem_nodeproxy::metrics::Metrics;
use tandem_proxy_rules::model::ProxyState;

async fn start_and_sync(mode: ProxyMode, state: &ProxyState, metrics: &Metrics) -> DataPath {
    let ports: BTreeSet<_> = state.services().keys().cloned().collect();
    let mut path = datapath::start(mode, BackendChoice::Auto, node())
        .await
        .unwrap();
    assert!(!path.update(state, &ports).is_empty());
    assert!(path.apply(metrics).await, "{mode} sync failed");
    path
}

/// `iptables-save -c` of the three tables: the whole namespace as `backend` sees it.
fn everything(backend: Backend) -> String {
    ["mangle", "filter", "nat"]
        .iter()
        .map(|table| normalize(&run(backend.save(), &["-c", "-t", table])))
        .collect()
}

/// The node proxy's own chains (none of the kubelet's or shared ones) in `backend`.
fn our_chains(backend: Backend) -> Vec<String> {
    everything(backend)
        .lines()
        .filter_map(|line| line.strip_prefix(':')?.split_whitespace().next())
        .filter(|chain| is_owned_chain(chain))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_kubelets_v1_21_chains_survive_start_syncs_mode_switches_and_cleanup() {
    if !is_root() || Command::new("nft").arg("--version").output().is_err() {
        eprintln!("skipped: needs root and the nft command");
        return;
    }
    for backend in backends() {
        eprintln!("backend {backend}");
        in_fresh_netns(move |_| async move {
            install_kubelet_chains(backend);
            let installed = everything(backend);
            let kubelet = kubelet_lines(backend);
            // The fixture is what the kernel prints back (its rules with their counters).
            let fixture_rules = KUBELET_V1_21
                .lines()
                .filter(|l| l.starts_with("-A "))
                .count();
            assert_eq!(kubelet.matches("[7:420] -A ").count(), fixture_rules);
            let unchanged = |step: &str| {
                assert_eq!(
                    kubelet_lines(backend),
                    kubelet,
                    "{backend}: the kubelet's chains changed by: {step}"
                );
            };
            let metrics = Metrics::register(&mut Registry::default());
            let state = reference_state(reference_endpoints());

            // iptables mode; the backend is found by the kubelet's hint chain.
            let mut path = start_and_sync(ProxyMode::Iptables, &state, &metrics).await;
            unchanged("iptables mode start");
            let nat = save(backend, "nat");
            assert!(nat.contains(":KUBE-SVC-6IM33IEVEEV7U3GP"), "{nat}");
            assert_eq!(lines_with(&nat, "-j KUBE-POSTROUTING").len(), 1, "{nat}");
            let filter = save(backend, "filter");
            assert_eq!(
                lines_with(
                    &filter,
                    "\"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL"
                )
                .len(),
                3,
                "{filter}"
            );

            // An endpoint goes: an incremental sync.
            let fewer = reference_state(reference_endpoints()[..1].to_vec());
            let ports: BTreeSet<_> = fewer.services().keys().cloned().collect();
            assert!(path.update(&fewer, &ports).chains > 0);
            assert!(path.apply(&metrics).await);
            unchanged("an incremental sync");

            // A restart: a full --noflush write over our own chains.
            start_and_sync(ProxyMode::Iptables, &state, &metrics).await;
            unchanged("a restart in iptables mode");

            // To nftables mode and back: each start removes the other mode's rules.
            start_and_sync(ProxyMode::Nftables, &state, &metrics).await;
            unchanged("switching to nftables mode");
            assert_eq!(our_chains(backend), Vec::<String>::new());
            start_and_sync(ProxyMode::Iptables, &state, &metrics).await;
            unchanged("switching back to iptables mode");

            // --cleanup leaves the namespace as the kubelet left it, exactly.
            datapath::cleanup(BackendChoice::Auto).await.unwrap();
            unchanged("--cleanup after iptables mode");
            assert_eq!(everything(backend), installed);

            start_and_sync(ProxyMode::Nftables, &state, &metrics).await;
            datapath::cleanup(BackendChoice::Auto).await.unwrap();
            unchanged("--cleanup after nftables mode");
            assert_eq!(everything(backend), installed);
        });
    }
}

#[test]
fn without_the_kubelet_the_shared_chains_are_created_and_cleanup_removes_them() {
    if !is_root() || Command::new("nft").arg("--version").output().is_err() {
        eprintln!("skipped: needs root and the nft command");
        return;
    }
    for backend in backends() {
        in_fresh_netns(move |_| async move {
            // Something foreign forces the --noflush write, where shared chains are ensured
            // (and its rule makes the auto-detection pick this backend).
            run(backend.iptables(), &["-t", "nat", "-N", "FOREIGN"]);
            run(
                backend.iptables(),
                &["-t", "nat", "-A", "FOREIGN", "-j", "RETURN"],
            );
            let installed = everything(backend);
            let metrics = Metrics::register(&mut Registry::default());
            let state = reference_state(reference_endpoints());
            start_and_sync(ProxyMode::Iptables, &state, &metrics).await;
            let nat = save(backend, "nat");
            for rule in [
                "-A KUBE-MARK-DROP -j MARK --set-xmark 0x8000/0x8000",
                "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000",
                "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING",
            ] {
                assert_eq!(lines_with(&nat, rule), [rule], "{backend}: {nat}");
            }
            assert_eq!(lines_with(&nat, "-A KUBE-POSTROUTING ").len(), 3, "{nat}");
            // A restart ensures them again and adds nothing.
            start_and_sync(ProxyMode::Iptables, &state, &metrics).await;
            assert_eq!(save(backend, "nat"), nat);
            datapath::cleanup(BackendChoice::Auto).await.unwrap();
            assert_eq!(everything(backend), installed, "{backend}");
        });
    }
}

/// What a node proxy before KUBE-PROXY-FIREWALL left in filter: `-j KUBE-FIREWALL` first in
/// INPUT, FORWARD and OUTPUT (ensured: the kubelet's INPUT and OUTPUT jumps are the same
/// rule), and KUBE-FIREWALL flushed and holding only the drop rule (on a kubelet's node,
/// its localnet guard lost).
fn load_old_node_proxy_firewall(backend: Backend) {
    let iptables = backend.iptables();
    let filter = |args: &[&str]| {
        let mut all = vec!["-t", "filter"];
        all.extend(args);
        run(iptables, &all);
    };
    let exists = Command::new(iptables)
        .args(["-t", "filter", "-S", "KUBE-FIREWALL"])
        .output()
        .unwrap()
        .status
        .success();
    if exists {
        filter(&["-F", "KUBE-FIREWALL"]);
    } else {
        filter(&["-N", "KUBE-FIREWALL"]);
    }
    for builtin in ["INPUT", "FORWARD", "OUTPUT"] {
        let present = Command::new(iptables)
            .args(["-t", "filter", "-C", builtin, "-j", "KUBE-FIREWALL"])
            .output()
            .unwrap()
            .status
            .success();
        if !present {
            filter(&["-I", builtin, "1", "-j", "KUBE-FIREWALL"]);
        }
    }
    filter(&[
        "-A",
        "KUBE-FIREWALL",
        "-m",
        "comment",
        "--comment",
        "kubernetes firewall for dropping marked packets",
        "-m",
        "mark",
        "--mark",
        "0x8000/0x8000",
        "-j",
        "DROP",
    ]);
}

fn firewall_lines(backend: Backend) -> Vec<String> {
    lines_with(&save(backend, "filter"), "KUBE-FIREWALL")
}

#[test]
fn what_an_older_node_proxy_left_in_kube_firewall_is_removed_and_only_that() {
    if !is_root() || Command::new("nft").arg("--version").output().is_err() {
        eprintln!("skipped: needs root and the nft command");
        return;
    }
    for backend in backends() {
        for mode in [ProxyMode::Iptables, ProxyMode::Nftables] {
            // A kubelet's node: the FORWARD jump goes, the kubelet's chain and jumps stay.
            in_fresh_netns(move |_| async move {
                install_kubelet_chains(backend);
                load_old_node_proxy_firewall(backend);
                let metrics = Metrics::register(&mut Registry::default());
                start_and_sync(mode, &reference_lb(), &metrics).await;
                assert_eq!(
                    firewall_lines(backend),
                    [
                        ":KUBE-FIREWALL -",
                        "-A INPUT -j KUBE-FIREWALL",
                        "-A OUTPUT -j KUBE-FIREWALL",
                        "-A KUBE-FIREWALL -m comment --comment \"kubernetes firewall for dropping marked packets\" -m mark --mark 0x8000/0x8000 -j DROP",
                    ],
                    "{backend} {mode}"
                );
            });
            // No kubelet: the old chain and its three jumps go.
            in_fresh_netns(move |_| async move {
                load_old_node_proxy_firewall(backend);
                let metrics = Metrics::register(&mut Registry::default());
                start_and_sync(mode, &reference_lb(), &metrics).await;
                assert_eq!(
                    firewall_lines(backend),
                    Vec::<String>::new(),
                    "{backend} {mode}"
                );
            });
        }
        // --cleanup removes it too.
        in_fresh_netns(move |_| async move {
            load_old_node_proxy_firewall(backend);
            datapath::cleanup(BackendChoice::Auto).await.unwrap();
            assert_eq!(firewall_lines(backend), Vec::<String>::new(), "{backend}");
        });
    }
}

fn reference_lb() -> ProxyState {
    reference_state(reference_endpoints())
}
