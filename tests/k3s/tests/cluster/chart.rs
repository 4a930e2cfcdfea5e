//! The chart on the three nodes, as a user installs it: the node proxy as its DaemonSet
//! on every node, the controller, and the mock cloud in the topology's edge, with a
//! Deployment spread over the nodes behind a load balancer of each mode. Day-2 work runs
//! under traffic from an outside client through both VIPs (new connections, and one
//! long-lived connection through each), and fails no request:
//! - `externalTrafficPolicy: Local` through a passthrough VIP: only the node with the
//!   endpoint is healthy in the cloud and answers, with the client's own address, and the
//!   traffic follows the endpoint to another node;
//! - `kubectl cordon` and `uncordon` of node 3 (it stays in the load balancers);
//! - the cluster autoscaler's `ToBeDeletedByClusterAutoscaler` taint on node 3: the
//!   controller takes it out of the load balancers, and back in when the taint goes;
//! - `kubectl drain` of node 3, its pods moving to the other nodes;
//! - a rolling restart of the Deployment, terminating endpoints served until they are
//!   gone;
//! - `helm upgrade` of the node proxy's DaemonSet from iptables to nftables mode on every
//!   node. Through the passthrough VIP this is counted only: each node is unhealthy in the
//!   cloud for the seconds its node proxy restarts, and the edge's kernel steering moves
//!   its flows to another node, which resets them.
//!
//! Long-lived connections must last through all of it, but where their node or pod goes
//! (the taint, the drain, the roll, the cut): they end with it.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, ensure};
use tandem_k3s::chart::{
    Binaries, CLOUD_PORT, ClientTraffic, Kube, LongLived, MODE_ANNOTATION, NAMESPACE, RELEASE,
    TCP_ECHO_PORT, TRAFFIC_TIMEOUT, cloud_backends, finish_traffic, helm_run, http_get,
    install_values, seccomp_values, spread, start_cloud,
};
use tandem_k3s::cluster::K3sCluster;
use tandem_k3s::wait_for;
use tandem_netlab::Topology;

use crate::{NODES, parse_echo};

/// The Deployment behind both load balancers, one pod on each node.
const WEB_REPLICAS: usize = NODES;
/// The taint the cluster autoscaler puts on a node it is about to delete (KEP-3458).
const AUTOSCALER_TAINT: &str = "ToBeDeletedByClusterAutoscaler";
/// How long the cloud may take to follow a change of a load balancer's nodes or health:
/// the controller's sync, and the cloud's health checks (a few seconds apart).
const CLOUD_FOLLOWS_WITHIN: Duration = Duration::from_secs(30);

/// What the scenarios share.
pub struct ChartRun<'a> {
    pub cluster: &'a K3sCluster,
    pub topology: &'a Topology,
    pub bins: &'a Binaries,
    pub helm: &'a Path,
    pub chart: &'a Path,
    pub work: &'a Path,
}

/// Installs the chart and runs every scenario; each with its outcome. A failed install
/// ends the list.
pub fn scenarios(run: &ChartRun) -> Vec<(&'static str, Result<()>)> {
    let mut out = Vec::new();
    let edge = run.topology.edge();
    let cloud_addr = SocketAddrV4::new(edge.node_network_ip, CLOUD_PORT);
    let installed = (|| {
        let cloud = start_cloud(
            &run.bins.cloud_mock,
            &edge.netns,
            cloud_addr,
            run.work,
            "proxy",
        )?;
        let kube = run.kube();
        kube.apply("web.yaml", &web())?;
        // The cluster's own `etp-local`, through the edge untouched: its client's address
        // reaches the pod.
        run.kubectl([
            "annotate",
            "service",
            "etp-local",
            &format!("{MODE_ANNOTATION}=passthrough"),
        ])?;
        let mut cmd = run.cluster.server().command(run.helm);
        cmd.args(["install", RELEASE])
            .arg(run.chart)
            .args(["-n", NAMESPACE, "--create-namespace"])
            .args(install_values(
                run.cluster.server().ip(),
                &format!("http://{cloud_addr}"),
            ))
            .args(seccomp_values(&kube)?);
        helm_run(cmd, &kube)?;
        kube.wait_release_ready(Duration::from_secs(180))?;
        let proxies = run.cluster.server().kubectl([
            "-n",
            NAMESPACE,
            "get",
            "daemonset/tandem-nodeproxy",
            "-o",
            "jsonpath={.status.numberReady}",
        ])?;
        ensure!(
            proxies.trim() == NODES.to_string(),
            "{} node proxies Ready, not {NODES}",
            proxies.trim()
        );
        kube.wait_pods_ready("default", "app=web", WEB_REPLICAS, Duration::from_secs(90))?;
        let vips = [
            kube.wait_ingress("web-proxy", Duration::from_secs(90))?,
            kube.wait_ingress("web-passthrough", Duration::from_secs(90))?,
        ];
        for vip in vips {
            spread(&run.topology.client_in_range().netns, vip, 24)?;
        }
        Ok((cloud, vips))
    })();
    let (_cloud, vips) = match installed {
        Ok(installed) => installed,
        Err(e) => {
            out.push((
                "the chart installs on three nodes, both LB modes answer through the edge",
                Err(e),
            ));
            return out;
        }
    };
    out.push((
        "the chart installs on three nodes, both LB modes answer through the edge",
        Ok(()),
    ));
    let lost = &run.cluster.nodes()[NODES - 1];
    // Through the proxy-mode VIP, then the passthrough one, each with what its long-lived
    // connection must do.
    let both = |proxy, passthrough| [(vips[0], proxy), (vips[1], passthrough)];
    out.push((
        "externalTrafficPolicy Local through a passthrough VIP: only the endpoint's node is healthy and answers, with the client's address; the traffic follows the endpoint to node 3",
        run.etp_local(cloud_addr),
    ));
    out.push((
        "cordon and uncordon node 3 under traffic: 0 failed requests, the long-lived connections kept",
        run.under_traffic(both(Some(LongLived::MustLast), Some(LongLived::MustLast)), || {
            run.kubectl(["cordon", lost.name()])?;
            std::thread::sleep(Duration::from_secs(3));
            run.kubectl(["uncordon", lost.name()])
        }),
    ));
    out.push((
        "the autoscaler's taint on node 3 under traffic: out of both load balancers, back once it goes; 0 failed requests",
        // A long-lived connection through node 3 goes with it.
        run.under_traffic(both(Some(LongLived::MayBreak), Some(LongLived::MayBreak)), || {
            let taint = format!("{AUTOSCALER_TAINT}=1700000000:NoSchedule");
            run.kubectl(["taint", "node", lost.name(), &taint])?;
            let taken = Instant::now();
            run.wait_backend(cloud_addr, &vips, lost.ip(), None)?;
            eprintln!("  node 3 out of both load balancers {:.1?} after the taint", taken.elapsed());
            run.kubectl(["taint", "node", lost.name(), &format!("{AUTOSCALER_TAINT}-")])?;
            let back = Instant::now();
            run.wait_backend(cloud_addr, &vips, lost.ip(), Some("healthy"))?;
            eprintln!("  back and healthy {:.1?} after the taint went", back.elapsed());
            Ok(())
        }),
    ));
    out.push((
        "drain node 3 under traffic: its pods move, 0 failed requests",
        run.under_traffic(
            both(Some(LongLived::MayBreak), Some(LongLived::MayBreak)),
            || {
                run.kubectl([
                    "drain",
                    lost.name(),
                    "--ignore-daemonsets",
                    "--delete-emptydir-data",
                    "--force",
                    "--timeout=120s",
                ])?;
                run.kube().wait_pods_ready(
                    "default",
                    "app=web",
                    WEB_REPLICAS,
                    Duration::from_secs(90),
                )?;
                run.kubectl(["uncordon", lost.name()])
            },
        ),
    ));
    out.push((
        "a rolling restart of the Deployment under traffic: 0 failed requests",
        run.under_traffic(
            both(Some(LongLived::MayBreak), Some(LongLived::MayBreak)),
            || {
                run.kubectl(["rollout", "restart", "deployment/web"])?;
                run.kubectl(["rollout", "status", "deployment/web", "--timeout=180s"])
            },
        ),
    ));
    out.push((
        "node 3's cable cut under traffic through both VIPs: the cloud's health checks take it out before it is NotReady, no request fails after that; mended, it is back, failing nothing",
        run.node_cut(cloud_addr, &vips),
    ));
    out.push((
        "helm upgrade of the node proxy from iptables to nftables mode on every node under traffic: through the proxy-mode VIP 0 failed requests, the long-lived connection kept",
        // Each node is unhealthy in the cloud for the seconds its node proxy restarts: the
        // edge's proxy keeps its connections through it, while the kernel's passthrough
        // steering moves such a node's flows to another node, which resets them, and a
        // connection being opened there too (1 of 595 in one run). Counted, not asserted,
        // until the edge keeps a node's flows while it is merely unhealthy.
        run.under_traffic(both(Some(LongLived::MustLast), None), || {
            let kube = run.kube();
            let mut cmd = run.cluster.server().command(run.helm);
            cmd.args(["upgrade", RELEASE])
                .arg(run.chart)
                .args(["-n", NAMESPACE, "--reuse-values"])
                .args(["--set", "nodeProxy.proxyMode=nftables"]);
            helm_run(cmd, &kube)?;
            kube.wait_rollout("daemonset/tandem-nodeproxy", Duration::from_secs(180))?;
            kube.wait_release_ready(Duration::from_secs(60))?;
            for node in run.cluster.nodes() {
                let tables = node.netns().exec_checked(["nft", "list", "tables"])?;
                ensure!(
                    tables.contains("table ip tandem"),
                    "no table ip tandem on {} after the upgrade:\n{tables}",
                    node.name()
                );
            }
            Ok(())
        }),
    ));
    out
}

impl ChartRun<'_> {
    fn kube(&self) -> Kube<'_> {
        Kube {
            node: self.cluster.server(),
            work: self.work,
        }
    }

    fn kubectl<const N: usize>(&self, args: [&str; N]) -> Result<()> {
        self.cluster.server().kubectl(args)?;
        Ok(())
    }

    /// Runs `act` while the outside client sends through each VIP, then counts what failed:
    /// a VIP's client must be clean, with its long-lived connection as given, or (`None`)
    /// is only counted.
    fn under_traffic<const N: usize>(
        &self,
        traffic: [(Ipv4Addr, Option<LongLived>); N],
        act: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let clients = traffic
            .into_iter()
            .map(|(vip, long_lived)| Ok((self.traffic(vip)?, long_lived)))
            .collect::<Result<Vec<_>>>()?;
        let began = Instant::now();
        act()?;
        eprintln!("  done {:.1?} after the traffic began", began.elapsed());
        let (checked, counted): (Vec<_>, Vec<_>) = clients
            .into_iter()
            .partition(|(_, long_lived)| long_lived.is_some());
        let result = finish_traffic(
            checked
                .into_iter()
                .filter_map(|(client, long_lived)| Some((client, long_lived?))),
        );
        for (client, _) in counted {
            eprintln!("  counted only: {}", client.stop()?);
        }
        result
    }

    /// The outside client's traffic through `vip`.
    fn traffic(&self, vip: Ipv4Addr) -> Result<ClientTraffic> {
        let client = &self.topology.client_in_range().netns;
        ClientTraffic::through_vip(&self.bins.traffic, client, vip, self.work)
    }

    /// Waits until `node` is, in every VIP's load balancer, `wanted`: `Some(health)` a
    /// backend with that health, `None` no backend.
    fn wait_backend(
        &self,
        cloud: SocketAddrV4,
        vips: &[Ipv4Addr],
        node: Ipv4Addr,
        wanted: Option<&str>,
    ) -> Result<()> {
        let edge = &self.topology.edge().netns;
        wait_for(
            &format!("node {node} {wanted:?} in the load balancers"),
            CLOUD_FOLLOWS_WITHIN,
            || {
                for vip in vips {
                    let backends = cloud_backends(edge, cloud, *vip)?;
                    if backends.get(&node).map(String::as_str) != wanted {
                        return Ok(Err(anyhow!("{vip}'s backends: {backends:?}")));
                    }
                }
                Ok(Ok(()))
            },
        )
    }

    /// Cuts node 3's cable under traffic through `vips`, then mends it. The cloud's health
    /// checks take node 3 out of the load balancers within seconds, but the other nodes
    /// still send to its pod until the node lifecycle controller marks it NotReady and its
    /// endpoint leaves, as with kube-proxy: requests fail until then, and none after. The
    /// long-lived connections through node 3 end with the cable.
    fn node_cut(&self, cloud: SocketAddrV4, vips: &[Ipv4Addr]) -> Result<()> {
        let lost = &self.cluster.nodes()[NODES - 1];
        let clients = vips
            .iter()
            .map(|vip| self.traffic(*vip))
            .collect::<Result<Vec<_>>>()?;
        let clock = crate::Clock::start();
        std::thread::sleep(Duration::from_secs(2));
        let cut = clock.ms();
        crate::cable(self.topology, NODES, "down")?;
        let outcome = (|| -> Result<(u64, u64, u64, u64, u64)> {
            self.wait_backend(cloud, vips, lost.ip(), Some("unhealthy"))?;
            let unhealthy = clock.ms();
            let not_ready = crate::wait_not_ready(self.cluster.server(), lost, clock)?;
            wait_for(
                "no endpoint on node 3 behind web-proxy",
                Duration::from_secs(30),
                || {
                    let ready = crate::ready_endpoints(self.cluster.server(), "web-proxy")?;
                    let on_lost: Vec<&String> = ready
                        .iter()
                        .filter(|ip| {
                            ip.parse::<Ipv4Addr>()
                                .is_ok_and(|ip| lost.pod_subnet().contains(&ip))
                        })
                        .collect();
                    Ok(on_lost
                        .is_empty()
                        .then_some(())
                        .ok_or_else(|| anyhow!("ready there: {on_lost:?}")))
                },
            )?;
            let gone = clock.ms();
            std::thread::sleep(Duration::from_secs(3));
            crate::cable(self.topology, NODES, "up")?;
            let mended = clock.ms();
            self.wait_backend(cloud, vips, lost.ip(), Some("healthy"))?;
            let healthy = clock.ms();
            std::thread::sleep(Duration::from_secs(3));
            Ok((unhealthy, not_ready, gone, mended, healthy))
        })();
        let mended = crate::cable(self.topology, NODES, "up");
        let summaries = clients
            .into_iter()
            .map(ClientTraffic::stop)
            .collect::<Result<Vec<_>>>()?;
        let (unhealthy, not_ready, gone, mended_at, healthy) = outcome?;
        mended?;
        eprintln!(
            "  node 3 unhealthy in the cloud {:.1}s after the cut, NotReady {:.1}s after (grace {:?}), no endpoint there {:.1}s after; mended: healthy {:.1}s after",
            crate::secs(unhealthy - cut),
            crate::secs(not_ready - cut),
            crate::NOT_READY_GRACE,
            crate::secs(gone - cut),
            crate::secs(healthy - mended_at)
        );
        let in_flight = u64::try_from(TRAFFIC_TIMEOUT.as_millis()).unwrap_or(u64::MAX);
        let mut problems = Vec::new();
        for summary in &summaries {
            eprintln!("  {summary}");
            let (window, late) =
                crate::failed_outside_cut(&summary.failed_at_ms(), cut, gone, in_flight);
            if !late.is_empty() {
                problems.push(format!(
                    "{}: {} requests failed outside {:.1}s to {:.1}s, the first at {:?} ms",
                    summary.target(),
                    late.len(),
                    crate::secs(*window.start()),
                    crate::secs(*window.end()),
                    &late[..late.len().min(10)]
                ));
            }
        }
        ensure!(problems.is_empty(), "{}", problems.join("\n"));
        ensure!(
            unhealthy < not_ready,
            "the cloud took node 3 out only after it was NotReady"
        );
        Ok(())
    }

    /// `etp-local` (passthrough, `externalTrafficPolicy: Local`) over the echo pod of node
    /// 2, then of node 3.
    fn etp_local(&self, cloud: SocketAddrV4) -> Result<()> {
        let kube = self.kube();
        let vip = kube.wait_ingress("etp-local", Duration::from_secs(90))?;
        let client = self.topology.client_in_range();
        let edge = &self.topology.edge().netns;
        for (index, node) in self.cluster.nodes().iter().enumerate().skip(1) {
            let pod = format!("echo-{}", index + 1);
            self.kubectl([
                "patch",
                "service",
                "etp-local",
                "-p",
                &format!(r#"{{"spec":{{"selector":{{"pod":"{pod}"}}}}}}"#),
            ])?;
            let moved = Instant::now();
            wait_for(
                &format!("only {} healthy behind {vip}", node.name()),
                CLOUD_FOLLOWS_WITHIN,
                || {
                    let backends = cloud_backends(edge, cloud, vip)?;
                    let healthy: Vec<Ipv4Addr> = backends
                        .iter()
                        .filter(|(_, health)| *health == "healthy")
                        .map(|(ip, _)| *ip)
                        .collect();
                    Ok((backends.len() == NODES && healthy == [node.ip()])
                        .then_some(())
                        .ok_or_else(|| anyhow!("backends {backends:?}")))
                },
            )?;
            eprintln!(
                "  {pod}: only {} healthy {:.1?} after the selector moved",
                node.name(),
                moved.elapsed()
            );
            for _ in 0..12 {
                let reply = http_get(
                    &client.netns,
                    SocketAddrV4::new(vip, 80),
                    "/cgi-bin/echo",
                    None,
                )?;
                let (answered, seen) = parse_echo(&reply.body)?;
                ensure!(
                    answered == pod && seen == client.ip.to_string(),
                    "answered by {answered}, which saw {seen}; want {pod} seeing {}",
                    client.ip
                );
            }
        }
        Ok(())
    }
}

/// The Deployment `web` (an HTTP echo and a TCP echo in each pod, spread over the nodes;
/// each pod keeps serving for a few seconds once it is terminating, while the proxies
/// take it out) and a load balancer of each mode over it.
fn web() -> String {
    let container = |name: &str, port: u16, command: &str| {
        format!(
            r#"
        - name: {name}
          image: localhost/tandem-echo:1
          imagePullPolicy: Never{command}
          ports: [{{containerPort: {port}}}]
          readinessProbe: {{tcpSocket: {{port: {port}}}, periodSeconds: 1}}
          lifecycle: {{preStop: {{exec: {{command: [/bin/sleep, "3"]}}}}}}"#
        )
    };
    let lb = |name: &str, mode: &str| {
        format!(
            r#"---
apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
  annotations: {{{MODE_ANNOTATION}: {mode}}}
spec:
  type: LoadBalancer
  selector: {{app: web}}
  ports:
    - {{name: http, port: 80, targetPort: 8080}}
    - {{name: tcp-echo, port: {TCP_ECHO_PORT}, targetPort: {TCP_ECHO_PORT}}}
"#
        )
    };
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: default
spec:
  replicas: {WEB_REPLICAS}
  selector:
    matchLabels: {{app: web}}
  template:
    metadata:
      labels: {{app: web}}
    spec:
      # busybox as PID 1 ignores SIGTERM: the pod ends at the grace's end.
      terminationGracePeriodSeconds: 5
      topologySpreadConstraints:
        - maxSkew: 1
          topologyKey: kubernetes.io/hostname
          whenUnsatisfiable: ScheduleAnyway
          labelSelector:
            matchLabels: {{app: web}}
      containers:{}{}
{}{}"#,
        container("echo", 8080, ""),
        container(
            "tcp-echo",
            TCP_ECHO_PORT,
            // Each connection gets a cat of its own: lines come back as sent.
            &format!("\n          command: [/bin/nc, -ll, -p, \"{TCP_ECHO_PORT}\", -e, /bin/cat]"),
        ),
        lb("web-proxy", "proxy"),
        lb("web-passthrough", "passthrough"),
    )
}
