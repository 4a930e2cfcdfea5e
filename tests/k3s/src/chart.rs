//! The chart on a real cluster, as the real-cluster tests install and drive it: the
//! workspace's binaries, the chart's images for the nodes, Helm, the mock cloud in the
//! topology's edge, `kubectl` and Helm calls that explain their failures, and client
//! traffic through the load balancers that counts what failed.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{ChildStdout, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;
use tandem_netlab::{ChildGuard, Netns};

use crate::node::{K3sNode, checked, describe, tail};
use crate::wait_for;

/// `local`: use the chart's images as podman's store holds them instead of running
/// `scripts/images.sh --offline` first.
pub const IMAGES_ENV: &str = "TANDEM_K3S_IMAGES";
pub const NAMESPACE: &str = "tandem-system";
pub const RELEASE: &str = "tandem";
pub const CLOUD_PORT: u16 = 8080;
pub const CLOUD_TOKEN: &str = "tandem-k3s-chart-test-token";
pub const VIP_POOL: &str = "198.51.100.0/24";
/// The echo pods' TCP echo (busybox `nc -e cat`), for the long-lived connections.
pub const TCP_ECHO_PORT: u16 = 9000;
/// Each request's time limit in [`ClientTraffic`].
pub const TRAFFIC_TIMEOUT: Duration = Duration::from_secs(2);
/// The mock cloud's annotation choosing a load balancer's mode: `proxy` or `passthrough`.
pub const MODE_ANNOTATION: &str = "service.beta.kubernetes.io/mockcloud-load-balancer-mode";
/// Appended to the chart's image tag for the rolling upgrade: the same images, retagged.
pub const UPGRADE_TAG_SUFFIX: &str = "-rolled";

/// The workspace binaries the test runs itself, next to the test executable's directory.
pub struct Binaries {
    pub cloud_mock: PathBuf,
    pub nodeproxy: PathBuf,
    pub traffic: PathBuf,
}

impl Binaries {
    pub fn locate() -> Result<Self> {
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

/// Helm 3.9.4 (`tests/k3s/install-helm.sh`), kept under `tmp_dir` for the next test; its
/// path.
pub fn install_helm(repo: &Path, tmp_dir: &Path) -> Result<PathBuf> {
    let mut cmd = Command::new("bash");
    cmd.arg(repo.join("tests/k3s/install-helm.sh"))
        .arg(tmp_dir.join("helm-3.9.4/helm"));
    let out = checked(cmd)?;
    Ok(PathBuf::from(out.trim()))
}

/// The node's images, and the tag the rolling upgrade moves the chart to.
pub struct SavedImages {
    pub archives: Vec<PathBuf>,
    pub upgrade_tag: String,
}

/// Docker archives for the node: the test images (`node/test-images.sh`) and the chart's
/// default images, built by `scripts/images.sh --offline` (or, with
/// `TANDEM_K3S_IMAGES=local`, taken as podman's store holds them) and saved from the store,
/// each also under the upgrade's tag (its tag and [`UPGRADE_TAG_SUFFIX`]).
pub fn save_images(repo: &Path, dir: &Path) -> Result<SavedImages> {
    let mut archives = crate::node::build_test_images(dir)?;
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
pub struct ClientTraffic {
    target: SocketAddrV4,
    process: ChildGuard,
    output: BufReader<ChildStdout>,
}

impl ClientTraffic {
    /// Through a VIP: the Services' port 80 and their TCP echo port.
    pub fn through_vip(binary: &Path, client: &Netns, vip: Ipv4Addr, work: &Path) -> Result<Self> {
        let at = |port| SocketAddrV4::new(vip, port);
        Self::start(binary, client, at(80), at(TCP_ECHO_PORT), work)
    }

    /// Starts it and waits for its first line, `{"kind":"ready"}`: the long-lived
    /// connection made its first exchange.
    pub fn start(
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
            .arg(format!("--timeout={}s", TRAFFIC_TIMEOUT.as_secs()))
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
    pub fn stop(mut self) -> Result<TrafficSummary> {
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
pub struct TrafficSummary {
    target: SocketAddrV4,
    summary: Value,
}

impl TrafficSummary {
    /// Where the traffic went.
    pub fn target(&self) -> SocketAddrV4 {
        self.target
    }

    pub fn failures(&self) -> &[Value] {
        self.summary["failures"]
            .as_array()
            .map_or(&[], Vec::as_slice)
    }

    /// When each failed request was sent, in milliseconds from the traffic's start.
    pub fn failed_at_ms(&self) -> Vec<u64> {
        self.failures()
            .iter()
            .filter_map(|failure| failure["at_ms"].as_u64())
            .collect()
    }

    /// No failed request, and the long-lived connection lasted if it had to.
    pub fn clean(&self, long_lived: LongLived) -> bool {
        let connection = &self.summary["long_lived"];
        let lasted =
            connection["broken"].is_null() && connection["exchanges"].as_u64().unwrap_or(0) > 0;
        self.failures().is_empty() && (lasted || long_lived == LongLived::MayBreak)
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

/// Whether a client's long-lived connection must last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LongLived {
    MustLast,
    /// Its pod may go (a drain, a roll): the connection ends with it, as with kube-proxy.
    MayBreak,
}

/// Lets late failures arrive, stops every client and fails unless each was clean (no
/// failed request, its long-lived connection kept if it must be); each client's summary
/// is printed.
pub fn finish_traffic(clients: impl IntoIterator<Item = (ClientTraffic, LongLived)>) -> Result<()> {
    std::thread::sleep(Duration::from_secs(3));
    let mut problems = Vec::new();
    for (client, long_lived) in clients {
        let summary = client.stop()?;
        eprintln!("  {summary}");
        if !summary.clean(long_lived) {
            problems.push(summary.to_string());
        }
    }
    ensure!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(())
}

/// The mock cloud in the edge's namespace, its proxy mode served by `dataplane` (`proxy` or
/// `haproxy`); its store and log stay in `work` across restarts.
pub fn start_cloud(
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
pub fn install_values(node_ip: Ipv4Addr, cloud_url: &str) -> Vec<String> {
    [
        format!("apiServer.host={node_ip}"),
        format!("nodeProxy.clusterCIDR={}", crate::CLUSTER_CIDR),
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
pub fn seccomp_values(kube: &Kube) -> Result<Vec<String>> {
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
pub fn helm_run(mut cmd: Command, kube: &Kube) -> Result<()> {
    let out = crate::node::run(&mut cmd)?;
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

pub struct Kube<'a> {
    pub node: &'a K3sNode,
    pub work: &'a Path,
}

impl Kube<'_> {
    /// Waits for the default Namespace's ServiceAccount: the controller-manager creates it
    /// a moment after the first node is Ready, and a bare Pod created before it is refused.
    pub fn wait_default_service_account(&self) -> Result<()> {
        wait_for(
            "the default ServiceAccount",
            Duration::from_secs(60),
            || {
                Ok(self
                    .node
                    .kubectl(["-n", "default", "get", "serviceaccount", "default"])
                    .map(drop)
                    .map_err(anyhow::Error::from))
            },
        )
    }

    pub fn apply(&self, name: &str, manifest: &str) -> Result<()> {
        let path = self.work.join(name);
        std::fs::write(&path, manifest)?;
        self.node.kubectl([
            Path::new("apply").as_os_str(),
            "-f".as_ref(),
            path.as_os_str(),
        ])?;
        Ok(())
    }

    pub fn wait_pods_ready(
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
    pub fn wait_release_ready(&self, timeout: Duration) -> Result<()> {
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

    pub fn wait_rollout(&self, what: &str, timeout: Duration) -> Result<()> {
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

    pub fn service(&self, name: &str) -> Result<Value> {
        let json = self.node.kubectl(["get", "service", name, "-o", "json"])?;
        Ok(serde_json::from_str(&json)?)
    }

    pub fn wait_ingress(&self, name: &str, timeout: Duration) -> Result<Ipv4Addr> {
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

    pub fn cluster_ip_and_node_port(&self, name: &str) -> Result<(Ipv4Addr, u16)> {
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
    pub fn node_ports(&self, name: &str) -> Result<Vec<SocketAddrV4>> {
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
    pub fn diagnose(&self) -> String {
        let get = |args: &[&str]| self.node.kubectl(args).unwrap_or_else(|e| e.to_string());
        format!(
            "pods:\n{}\nwarnings:\n{}\nrelease job log:\n{}",
            get(&["get", "pods", "-A", "-o", "wide"]),
            get(&["get", "events", "-A", "--field-selector", "type=Warning"]),
            get(&["-n", NAMESPACE, "logs", "job/tandem-release", "--tail=20"]),
        )
    }
}

pub struct HttpReply {
    pub status: u16,
    pub body: String,
}

impl HttpReply {
    /// The echo's reply `pod=NAME client=ADDR`: the pod that answered.
    pub fn echo(&self) -> Result<String> {
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
pub fn http_get(
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
pub fn spread(netns: &Netns, ip: Ipv4Addr, count: usize) -> Result<BTreeMap<String, usize>> {
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
pub fn dropped(netns: &Netns, ip: Ipv4Addr) -> Result<()> {
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

/// The load balancers in the mock cloud, as its API lists them.
fn cloud_lb_list(edge: &Netns, addr: SocketAddrV4) -> Result<Vec<Value>> {
    let reply = http_get(edge, addr, "/v1/loadbalancers", Some(CLOUD_TOKEN))?;
    ensure!(
        reply.status == 200,
        "listing LBs: {} {}",
        reply.status,
        reply.body
    );
    let mut list: Value = serde_json::from_str(&reply.body)?;
    Ok(match list["items"].take() {
        Value::Array(items) => items,
        _ => Vec::new(),
    })
}

/// The load balancers in the mock cloud (their names).
pub fn cloud_lbs(edge: &Netns, addr: SocketAddrV4) -> Result<Vec<String>> {
    Ok(cloud_lb_list(edge, addr)?
        .iter()
        .map(|lb| lb["name"].as_str().unwrap_or("?").to_owned())
        .collect())
}

/// The backends (node addresses) of the load balancer with `vip`, each with its health as
/// the cloud's own checks see it (`healthy`, `unhealthy`, `unknown`).
pub fn cloud_backends(
    edge: &Netns,
    addr: SocketAddrV4,
    vip: Ipv4Addr,
) -> Result<BTreeMap<Ipv4Addr, String>> {
    let lbs = cloud_lb_list(edge, addr)?;
    let lb = lbs
        .iter()
        .find(|lb| lb["vip"].as_str() == Some(&vip.to_string()))
        .ok_or_else(|| anyhow!("no load balancer with VIP {vip} in the cloud"))?;
    lb["health"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|backend| {
            let ip = backend["ip"].as_str().unwrap_or_default();
            Ok((
                ip.parse()
                    .with_context(|| format!("backend address {ip:?} of {vip}"))?,
                backend["health"].as_str().unwrap_or("?").to_owned(),
            ))
        })
        .collect()
}
