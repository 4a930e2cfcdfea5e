//! Test harness: the API server stand-in and cloud-mock in-process, the controller as its
//! real binary. Everything binds 127.0.0.1 only; the cloud's data plane is off, so no
//! address is ever configured and no packet is sent.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use cloud_mock_dataplane::{DataPlaneConfig, DataPlaneKind};
use cloud_mock_sdk as sdk;
use k8s_openapi::api::core::v1::{
    Event, Node, NodeAddress, NodeStatus, Service, ServicePort, ServiceSpec,
};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

pub const CLUSTER: &str = "lab";
pub const POOL: &str = "198.51.100.0/24";

pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(label: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "tdm-ctl-{}-{label}-{}",
            std::process::id(),
            uuid_like()
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn uuid_like() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// A running cloud-mock (API only).
pub struct Cloud {
    pub url: String,
    pub token: String,
    pub client: sdk::Client,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Cloud {
    pub async fn start(data_dir: &Path) -> Self {
        let token = "cloud-token".to_string();
        let settings = cloud_mock::Settings {
            data_dir: data_dir.to_path_buf(),
            token: token.clone(),
            vip_pools: POOL.parse().unwrap(),
            provisioning_delay: Duration::from_millis(300),
            dataplane: DataPlaneConfig {
                mode: DataPlaneKind::None,
                ..DataPlaneConfig::default()
            },
        };
        let app = cloud_mock::App::new(&settings).unwrap();
        let listener = tokio::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
            .await
            .unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let cancel = CancellationToken::new();
        let lifecycle = tokio::spawn(app.lifecycle.run(cancel.clone()));
        let stop = cancel.clone();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app.router)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
            let _ = lifecycle.await;
        });
        let client = sdk::Client::new(&url, token.clone(), sdk::ClientOptions::default()).unwrap();
        Self {
            url,
            token,
            client,
            cancel,
            task,
        }
    }

    pub async fn stop(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }

    pub async fn all(&self) -> Vec<sdk::LoadBalancer> {
        self.client
            .list_load_balancers(&sdk::ListFilter::default())
            .await
            .unwrap()
    }

    pub async fn for_uid(&self, uid: &str) -> Vec<sdk::LoadBalancer> {
        self.client
            .list_load_balancers(&sdk::ListFilter {
                tags: BTreeMap::from([("kubernetes.io/service-uid".to_string(), uid.to_string())]),
                name: None,
            })
            .await
            .unwrap()
            .into_iter()
            .filter(|lb| lb.state != sdk::State::Deleting)
            .collect()
    }

    pub async fn set_faults(&self, faults: sdk::Faults) {
        self.client.set_faults(&faults).await.unwrap();
    }
}

/// A controller process; killed (by its PID, via the handle) when dropped.
pub struct Controller {
    pub child: Child,
    pub metrics_addr: SocketAddr,
}

impl Controller {
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id().unwrap()).unwrap()
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), signal).unwrap();
    }

    pub async fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(within, self.child.wait())
            .await
            .expect("controller did not exit in time")
            .unwrap()
    }

    pub async fn metrics(&self) -> String {
        self.try_metrics().await.expect("the controller's /metrics")
    }

    /// `/metrics`, or `None` while the controller is not serving it yet.
    pub async fn try_metrics(&self) -> Option<String> {
        reqwest::get(format!("http://{}/metrics", self.metrics_addr))
            .await
            .ok()?
            .text()
            .await
            .ok()
    }

    /// Sum of the cloud-call counters this process reports.
    pub async fn cloud_calls(&self) -> u64 {
        self.metrics()
            .await
            .lines()
            .filter(|l| l.starts_with("tandem_controller_cloud_calls_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }
}

pub fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    l.local_addr().unwrap()
}

pub struct Harness {
    pub dir: TempDir,
    pub api: tandem_apiserver::RunningServer,
    pub client: kube::Client,
    pub cloud: Cloud,
    pub kubeconfig: PathBuf,
    pub token_file: PathBuf,
}

impl Harness {
    pub async fn new(label: &str) -> Self {
        let dir = TempDir::new(label);
        let api = tandem_apiserver::spawn(tandem_apiserver::ServerConfig::default())
            .await
            .unwrap();
        let client = api.client().await.unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).await.unwrap();
        let cloud_dir = dir.path().join("cloud");
        std::fs::create_dir_all(&cloud_dir).unwrap();
        let cloud = Cloud::start(&cloud_dir).await;
        let token_file = dir.path().join("cloud-token");
        std::fs::write(&token_file, format!("{}\n", cloud.token)).unwrap();
        Self {
            dir,
            api,
            client,
            cloud,
            kubeconfig,
            token_file,
        }
    }

    /// Starts the controller binary with fast test timings plus `extra` flags.
    pub fn controller(&self, extra: &[&str]) -> Controller {
        let metrics_addr = free_port();
        let log = std::fs::File::create(
            self.dir
                .path()
                .join(format!("controller-{}.log", metrics_addr.port())),
        )
        .unwrap();
        let mut cmd = self.controller_command();
        cmd.args(["--metrics-bind-address", &metrics_addr.to_string()])
            .args(["--health-bind-address", &metrics_addr.to_string()])
            .args(["--cloud-timeout-seconds", "5"])
            .args(extra)
            .env_remove("KUBECONFIG")
            .env("TANDEM_NODE_DEBOUNCE_MS", "300")
            .env("RUST_LOG", "info,tandem_controller=debug")
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        let child = cmd.spawn().unwrap();
        Controller {
            child,
            metrics_addr,
        }
    }

    /// The controller binary pointed at this harness's API server, cloud and cluster id.
    pub fn controller_command(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-controller"));
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["--cloud-url", &self.cloud.url])
            .arg("--cloud-token-file")
            .arg(&self.token_file)
            .args(["--cluster-id", CLUSTER]);
        cmd
    }

    /// The controller's log, for assertion messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for entry in std::fs::read_dir(self.dir.path()).unwrap().flatten() {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with("controller-")
            {
                out.push_str(&std::fs::read_to_string(entry.path()).unwrap_or_default());
            }
        }
        let tail: Vec<&str> = out.lines().rev().take(200).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    pub fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), "default")
    }

    pub fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    pub async fn add_node(&self, name: &str, ip: &str) {
        let node = Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        self.nodes()
            .create(&PostParams::default(), &node)
            .await
            .unwrap();
        let status = NodeStatus {
            addresses: Some(vec![NodeAddress {
                type_: "InternalIP".into(),
                address: ip.into(),
            }]),
            conditions: Some(vec![k8s_openapi::api::core::v1::NodeCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..Default::default()
            }]),
            ..Default::default()
        };
        self.nodes()
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": status })),
            )
            .await
            .unwrap();
    }

    pub async fn patch_node(&self, name: &str, patch: serde_json::Value) {
        self.nodes()
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .unwrap();
    }

    pub async fn create_service(&self, svc: Service) -> Service {
        self.services()
            .create(&PostParams::default(), &svc)
            .await
            .unwrap()
    }

    pub async fn patch_service(&self, name: &str, patch: serde_json::Value) -> Service {
        self.services()
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .unwrap()
    }

    pub async fn delete_service(&self, name: &str) {
        self.services()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }

    pub async fn get_service(&self, name: &str) -> Option<Service> {
        self.services().get_opt(name).await.unwrap()
    }

    /// Event reasons recorded on the Service, with their messages.
    pub async fn events_for(&self, name: &str) -> Vec<(String, String, String)> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), "default");
        events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(name))
            .map(|e| {
                (
                    e.type_.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.message.unwrap_or_default(),
                )
            })
            .collect()
    }

    /// Polls `check` every 200 ms until it returns `Some`, or panics with the controller log.
    pub async fn eventually<T, F, Fut>(&self, what: &str, within: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(value) = check().await {
                return value;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "timed out waiting for {what}\n--- controller log ---\n{}",
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until the Service has an ingress IP and its LB is active; returns both.
    pub async fn wait_served(&self, name: &str) -> (Service, sdk::LoadBalancer) {
        self.eventually(
            &format!("{name} served"),
            Duration::from_secs(30),
            || async {
                let svc = self.get_service(name).await?;
                let ip = ingress_ip(&svc)?;
                let uid = svc.metadata.uid.clone()?;
                let lbs = self.cloud.for_uid(&uid).await;
                match lbs.as_slice() {
                    [lb] if lb.state == sdk::State::Active && lb.vip() == Some(ip) => {
                        Some((svc, lb.clone()))
                    }
                    _ => None,
                }
            },
        )
        .await
    }

    pub async fn shutdown(self) {
        self.cloud.stop().await;
        let _ = self.api.shutdown().await;
    }
}

pub fn ingress_ip(svc: &Service) -> Option<Ipv4Addr> {
    svc.status
        .as_ref()?
        .load_balancer
        .as_ref()?
        .ingress
        .as_ref()?
        .first()?
        .ip
        .as_ref()?
        .parse()
        .ok()
}

pub fn condition_reason(svc: &Service) -> Option<String> {
    svc.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "LoadBalancerReady")
        .map(|c| c.reason.clone())
}

pub fn lb_service(name: &str, ports: &[(i32, &str)]) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            selector: Some(BTreeMap::from([("app".into(), name.into())])),
            ports: Some(
                ports
                    .iter()
                    .map(|(port, protocol)| ServicePort {
                        name: Some(format!("p{port}-{}", protocol.to_lowercase())),
                        port: *port,
                        protocol: Some((*protocol).into()),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
        status: None,
    }
}

pub fn backend_ips(lb: &sdk::LoadBalancer) -> Vec<String> {
    let mut ips: Vec<String> = lb.spec.backends.iter().map(|b| b.ip.to_string()).collect();
    ips.sort();
    ips
}
