#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The real `kubectl` binary against the stand-in: create, get (server-side columns),
//! patch of the status subresource, get -w streaming, delete; the imperative commands
//! (protobuf bodies) and `--dry-run=server`.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use tandem_apiserver::{RunningServer, ServerConfig, spawn};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const TIMEOUT: Duration = Duration::from_secs(30);

/// A scratch directory with the kubeconfig; removed on drop, also when a test panics.
struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    async fn new(server: &RunningServer, tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tdm{}-apiserver-{tag}", std::process::id()));
        tokio::fs::create_dir_all(&dir).await.unwrap();
        server
            .write_kubeconfig(&dir.join("kubeconfig"))
            .await
            .unwrap();
        Self { dir }
    }

    /// kubectl with this kubeconfig and its discovery cache inside the scratch directory
    /// (not in `$HOME/.kube`).
    fn kubectl(&self, args: &[&str]) -> Command {
        let mut command = Command::new("kubectl");
        command
            .arg("--kubeconfig")
            .arg(self.dir.join("kubeconfig"))
            .arg("--cache-dir")
            .arg(self.dir.join("cache"))
            .args(args)
            .kill_on_drop(true);
        command
    }

    /// Runs kubectl to completion; panics with its stderr if it fails.
    async fn run(&self, args: &[&str]) -> String {
        let output = tokio::time::timeout(TIMEOUT, self.kubectl(args).output())
            .await
            .expect("kubectl timed out")
            .expect("kubectl is installed");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "kubectl {args:?} failed: {stderr}");
        assert!(
            stderr.trim().is_empty(),
            "kubectl {args:?} complained: {stderr}"
        );
        String::from_utf8(output.stdout).unwrap()
    }
}

impl Scratch {
    /// [`Scratch::run`] in `namespace`.
    async fn run_in(&self, namespace: &str, args: &[&str]) -> String {
        self.run(&[&["-n", namespace], args].concat()).await
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const SERVICE_YAML: &str = "apiVersion: v1
kind: Service
metadata:
  name: web
  labels:
    app: web
spec:
  type: LoadBalancer
  selector:
    app: web
  ports:
  - name: http
    port: 80
    targetPort: 8080
  - name: dns
    port: 53
    protocol: UDP
";

fn columns(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_create_get_patch_watch_delete() {
    let server = spawn(ServerConfig::default()).await.unwrap();
    let scratch = Scratch::new(&server, "kubectl").await;
    let services: Api<Service> = Api::namespaced(server.client().await.unwrap(), "default");

    let manifest = scratch.dir.join("svc.yaml");
    tokio::fs::write(&manifest, SERVICE_YAML).await.unwrap();
    let created = scratch
        .run(&["create", "-f", manifest.to_str().unwrap()])
        .await;
    assert_eq!(created.trim(), "service/web created");

    let svc = services.get("web").await.unwrap();
    let spec = svc.spec.unwrap();
    let ports = spec.ports.unwrap();
    let listing = scratch.run(&["get", "svc"]).await;
    let lines: Vec<&str> = listing.lines().collect();
    assert_eq!(
        columns(lines[0]),
        [
            "NAME",
            "TYPE",
            "CLUSTER-IP",
            "EXTERNAL-IP",
            "PORT(S)",
            "AGE"
        ]
    );
    let row = columns(lines[1]);
    let port_column = format!(
        "80:{}/TCP,53:{}/UDP",
        ports[0].node_port.unwrap(),
        ports[1].node_port.unwrap()
    );
    assert_eq!(
        row[..5],
        [
            "web",
            "LoadBalancer",
            spec.cluster_ip.as_deref().unwrap(),
            "<pending>",
            port_column.as_str()
        ]
    );
    assert!(row[5].ends_with('s'), "age column {:?}", row[5]);

    let patched = scratch
        .run(&[
            "patch",
            "svc",
            "web",
            "--type",
            "merge",
            "--subresource",
            "status",
            "-p",
            r#"{"status":{"loadBalancer":{"ingress":[{"ip":"198.51.100.3"}]}}}"#,
        ])
        .await;
    assert_eq!(patched.trim(), "service/web patched");
    let ingress = services
        .get("web")
        .await
        .unwrap()
        .status
        .unwrap()
        .load_balancer
        .unwrap()
        .ingress
        .unwrap();
    assert_eq!(ingress[0].ip.as_deref(), Some("198.51.100.3"));
    let wide = scratch.run(&["get", "svc", "web", "-o", "wide"]).await;
    let wide_row = columns(wide.lines().nth(1).unwrap());
    assert_eq!((wide_row[3], wide_row[6]), ("198.51.100.3", "app=web"));

    // get -w: the initial row, then a row per change, as the change happens.
    let mut watch = scratch
        .kubectl(&["get", "svc", "-w"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    let header = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(columns(&header)[0], "NAME");
    let first = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(first.contains("198.51.100.3"), "{first}");
    let status = json!({"status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.77"}]}}});
    services
        .patch_status("web", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let changed = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        columns(&changed)[..4],
        [
            "web",
            "LoadBalancer",
            spec.cluster_ip.as_deref().unwrap(),
            "198.51.100.77"
        ]
    );
    watch.kill().await.unwrap();

    let deleted = scratch.run(&["delete", "svc", "web"]).await;
    assert_eq!(deleted.trim(), "service \"web\" deleted");
    let status = services.get("web").await.unwrap_err();
    assert!(matches!(status, kube::Error::Api(s) if s.code == 404));
    let empty = tokio::time::timeout(TIMEOUT, scratch.kubectl(&["get", "svc"]).output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&empty.stderr).trim(),
        "No resources found in default namespace."
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_reports_invalid_services_and_reads_nodes() {
    let server = spawn(ServerConfig::default()).await.unwrap();
    let scratch = Scratch::new(&server, "invalid").await;
    let bad = scratch.dir.join("bad.yaml");
    tokio::fs::write(
        &bad,
        SERVICE_YAML.replace(
            "    targetPort: 8080\n",
            "    targetPort: 8080\n    nodePort: 99\n",
        ),
    )
    .await
    .unwrap();
    let output = tokio::time::timeout(
        TIMEOUT,
        scratch
            .kubectl(&["create", "-f", bad.to_str().unwrap()])
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("is invalid") && stderr.contains("spec.ports[0].nodePort"),
        "{stderr}"
    );

    let node = scratch.dir.join("node.json");
    let body = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "node-1", "labels": {"node-role.kubernetes.io/worker": ""}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "nodeInfo": {"kubeletVersion": "v1.34.0"}}
    });
    tokio::fs::write(&node, body.to_string()).await.unwrap();
    scratch.run(&["create", "-f", node.to_str().unwrap()]).await;
    let nodes = scratch.run(&["get", "nodes"]).await;
    let lines: Vec<&str> = nodes.lines().collect();
    assert_eq!(
        columns(lines[0]),
        ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    );
    let row = columns(lines[1]);
    assert_eq!(
        (row[0], row[1], row[2], row[4]),
        ("node-1", "Ready", "worker", "v1.34.0")
    );
    server.shutdown().await.unwrap();
}

/// A command line split at spaces (none of these arguments contains one).
fn words(line: &str) -> Vec<&str> {
    line.split(' ').collect()
}

/// kubectl's imperative commands send protobuf bodies (typed clients); labels and
/// annotations are patches; `--dry-run=server` leaves the store as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_imperative_commands_and_server_dry_run() {
    let server = spawn(ServerConfig::default()).await.unwrap();
    let scratch = Scratch::new(&server, "imperative").await;
    let client = server.client().await.unwrap();
    let services: Api<Service> = Api::namespaced(client.clone(), "team-a");
    let namespaces: Api<Namespace> = Api::all(client);
    let ns = "team-a";

    let created = [
        ("create namespace team-a", "namespace/team-a created"),
        (
            "-n team-a create service clusterip db --tcp=5432:5432",
            "service/db created",
        ),
        (
            "-n team-a create service nodeport np --tcp=80:8080 --node-port=30080",
            "service/np created",
        ),
        (
            "-n team-a create service loadbalancer web --tcp=80:8080",
            "service/web created",
        ),
        (
            "-n team-a create service externalname ext --external-name=db.example.com",
            "service/ext created",
        ),
        (
            "-n team-a expose service web --name=web-udp --port=53 --protocol=UDP --target-port=5353 --type=LoadBalancer",
            "service/web-udp exposed",
        ),
    ];
    for (command, answer) in created {
        assert_eq!(scratch.run(&words(command)).await.trim(), answer);
    }

    let spec = |svc: Service| svc.spec.unwrap();
    let db = spec(services.get("db").await.unwrap());
    assert_eq!(db.type_.as_deref(), Some("ClusterIP"));
    assert!(db.cluster_ip.unwrap().starts_with("10.96."));
    let np = spec(services.get("np").await.unwrap());
    let np_port = &np.ports.unwrap()[0];
    assert_eq!((np_port.port, np_port.node_port), (80, Some(30080)));
    assert_eq!(
        np_port.target_port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8080))
    );
    let web = services.get("web").await.unwrap();
    assert_eq!(
        web.metadata.labels.as_ref().unwrap()["app"],
        "web",
        "kubectl's generator labels and selects app=<name>"
    );
    assert_eq!(spec(web).type_.as_deref(), Some("LoadBalancer"));
    let ext = spec(services.get("ext").await.unwrap());
    assert_eq!(
        (ext.type_.as_deref(), ext.external_name.as_deref()),
        (Some("ExternalName"), Some("db.example.com"))
    );
    let exposed = spec(services.get("web-udp").await.unwrap());
    let exposed_port = &exposed.ports.unwrap()[0];
    assert_eq!(
        (exposed_port.port, exposed_port.protocol.as_deref()),
        (53, Some("UDP"))
    );
    assert!(exposed_port.node_port.is_some());
    assert_eq!(exposed.selector.unwrap()["app"], "web");

    let out = scratch.run_in(ns, &words("label svc web tier=front")).await;
    assert_eq!(out.trim(), "service/web labeled");
    let out = scratch
        .run_in(ns, &words("annotate svc web owner=team-a"))
        .await;
    assert_eq!(out.trim(), "service/web annotated");
    let web = services.get("web").await.unwrap();
    assert_eq!(web.metadata.labels.as_ref().unwrap()["tier"], "front");
    assert_eq!(
        web.metadata.annotations.as_ref().unwrap()["owner"],
        "team-a"
    );
    let version = web.metadata.resource_version.clone();

    // --dry-run=server: the answers of a real write, and nothing written.
    let dry_runs = [
        (
            "-n team-a create service nodeport dry --tcp=80:80 --node-port=30082",
            "service/dry created (server dry run)",
        ),
        (
            "create namespace dry-ns",
            "namespace/dry-ns created (server dry run)",
        ),
        (
            "-n team-a label svc web tier=back --overwrite",
            "service/web labeled (server dry run)",
        ),
        (
            "-n team-a delete svc web",
            "service \"web\" deleted (server dry run)",
        ),
        (
            "delete namespace team-a",
            "namespace \"team-a\" deleted (server dry run)",
        ),
    ];
    for (command, answer) in dry_runs {
        let mut args = words(command);
        args.push("--dry-run=server");
        assert_eq!(scratch.run(&args).await.trim(), answer);
    }
    let not_found = |e: kube::Error| matches!(e, kube::Error::Api(s) if s.code == 404);
    assert!(not_found(services.get("dry").await.unwrap_err()));
    assert!(not_found(namespaces.get("dry-ns").await.unwrap_err()));
    let web = services.get("web").await.unwrap();
    assert_eq!(web.metadata.labels.as_ref().unwrap()["tier"], "front");
    assert_eq!(web.metadata.resource_version, version);
    let team = namespaces.get("team-a").await.unwrap();
    assert!(team.metadata.deletion_timestamp.is_none());
    // The dry-run create allocated nothing: the node port it took is free.
    let out = scratch
        .run_in(
            ns,
            &words("create service nodeport np2 --tcp=81:81 --node-port=30082"),
        )
        .await;
    assert_eq!(out.trim(), "service/np2 created");
    server.shutdown().await.unwrap();
}
