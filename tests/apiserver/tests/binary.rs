#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The `tandem-apiserver` process: flags, the kubeconfig it writes, clean exit on SIGTERM.

use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::process::Command;

const WAIT: Duration = Duration::from_secs(15);

/// Removes the scratch directory, also when the test panics.
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_writes_a_working_kubeconfig_and_stops_on_sigterm() {
    let dir = std::env::temp_dir().join(format!("tdm{}-apiserver-bin", std::process::id()));
    tokio::fs::create_dir_all(&dir).await.unwrap();
    let _scratch = Scratch(dir.clone());
    let kubeconfig_path = dir.join("kubeconfig");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem-apiserver"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--service-node-port-range",
            "31000-31099",
        ])
        .arg("--kubeconfig-out")
        .arg(&kubeconfig_path)
        .env("TANDEM_APISERVER_TOKEN", "from-env")
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();

    let deadline = tokio::time::Instant::now() + WAIT;
    while !tokio::fs::try_exists(&kubeconfig_path).await.unwrap() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no kubeconfig written"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let kubeconfig = Kubeconfig::read_from(&kubeconfig_path).unwrap();
    assert_eq!(
        kubeconfig.auth_infos[0]
            .auth_info
            .as_ref()
            .unwrap()
            .token
            .as_ref()
            .map(|_| ()),
        Some(())
    );
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    assert_eq!(
        namespaces
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        4
    );

    // The node port range flag is honoured.
    let services: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(client, "default");
    let svc = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "np"}, "spec": {"type": "NodePort", "ports": [{"port": 80}]}
    }))
    .unwrap();
    let created = services.create(&Default::default(), &svc).await.unwrap();
    let port = created.spec.unwrap().ports.unwrap()[0].node_port.unwrap();
    assert!((31000..=31099).contains(&port), "{port}");

    let pid = child.id().unwrap().to_string();
    let status = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(status.success());
    let exit = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("exits after SIGTERM")
        .unwrap();
    assert!(exit.success(), "{exit:?}");
}
