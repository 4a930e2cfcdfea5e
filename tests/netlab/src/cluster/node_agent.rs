//! A kubelet's part of the API contract for the lab's nodes: register a Node with its
//! addresses and pod CIDR, report Ready, renew its Lease in `kube-node-lease`.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeCondition, NodeSpec, NodeSystemInfo};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference, Time};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{ClusterError, MANAGED_BY, is_status};
use crate::addr::{ClusterFamilies, IpFamily, v6};
use crate::error::NetlabError;

/// Where kubelets keep their heartbeat Leases.
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";

/// A lab node as the API sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabNode {
    pub name: String,
    /// Its InternalIPs, one per cluster family, primary first (as a dual-stack kubelet
    /// reports them).
    pub internal_ips: Vec<IpAddr>,
    /// Its pod CIDRs, in the same order (`spec.podCIDRs`).
    pub pod_cidrs: Vec<IpNet>,
}

impl LabNode {
    /// The topology's node as a cluster of `families` registers it; IPv6 needs a
    /// dual-stack topology.
    pub fn new(node: &crate::Node, families: ClusterFamilies) -> Result<Self, NetlabError> {
        let mut internal_ips = Vec::new();
        let mut pod_cidrs = Vec::new();
        for family in families.families() {
            match family {
                IpFamily::V4 => {
                    internal_ips.push(node.ip.into());
                    pod_cidrs.push(node.pod_cidr.into());
                }
                IpFamily::V6 => {
                    let ip = node.ip6.ok_or(NetlabError::NoIpv6 {
                        host: node.name.clone(),
                    })?;
                    internal_ips.push(ip.into());
                    pod_cidrs.push(v6::node_pod_cidr(node.index)?.into());
                }
            }
        }
        Ok(Self {
            name: node.name.clone(),
            internal_ips,
            pod_cidrs,
        })
    }
}

/// Heartbeat timing; the defaults are the kubelet's.
#[derive(Debug, Clone)]
pub struct NodeAgentConfig {
    /// How often each Lease is renewed (kubelet: 10 s).
    pub lease_renew_interval: Duration,
    /// `leaseDurationSeconds` (kubelet: 40).
    pub lease_duration_seconds: i32,
    /// How often the Ready condition's heartbeat is posted to Node status.
    pub status_update_interval: Duration,
}

impl Default for NodeAgentConfig {
    fn default() -> Self {
        Self {
            lease_renew_interval: Duration::from_secs(10),
            lease_duration_seconds: 40,
            status_update_interval: Duration::from_secs(10),
        }
    }
}

/// The Node object to create: metadata and spec (status goes through `/status`).
pub fn node_object(node: &LabNode) -> Node {
    let labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_owned(), node.name.clone()),
        ("kubernetes.io/os".to_owned(), "linux".to_owned()),
        (
            "app.kubernetes.io/managed-by".to_owned(),
            MANAGED_BY.to_owned(),
        ),
    ]);
    Node {
        metadata: ObjectMeta {
            name: Some(node.name.clone()),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: node.pod_cidrs.first().map(ToString::to_string),
            pod_cidrs: Some(node.pod_cidrs.iter().map(ToString::to_string).collect()),
            ..NodeSpec::default()
        }),
        status: None,
    }
}

/// The Ready condition as a healthy kubelet posts it.
pub fn ready_condition(now: Timestamp, last_transition: Timestamp) -> NodeCondition {
    NodeCondition {
        type_: "Ready".to_owned(),
        status: "True".to_owned(),
        reason: Some("KubeletReady".to_owned()),
        message: Some("kubelet is posting ready status".to_owned()),
        last_heartbeat_time: Some(Time(now)),
        last_transition_time: Some(Time(last_transition)),
    }
}

/// When Ready last changed: kept from an existing Node that is already Ready (no status
/// churn across restarts of the agent), else now.
pub fn ready_transition_time(existing: Option<&Node>, now: Timestamp) -> Timestamp {
    existing
        .and_then(|n| n.status.as_ref())
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready" && c.status == "True"))
        .and_then(|c| c.last_transition_time.as_ref())
        .map_or(now, |t| t.0)
}

/// Merge patch for the Node's `/status`: addresses, Ready, capacity and node info.
pub fn node_status_patch(
    node: &LabNode,
    now: Timestamp,
    last_transition: Timestamp,
) -> serde_json::Value {
    let addresses: Vec<NodeAddress> = node
        .internal_ips
        .iter()
        .map(|ip| NodeAddress {
            type_: "InternalIP".to_owned(),
            address: ip.to_string(),
        })
        .chain([NodeAddress {
            type_: "Hostname".to_owned(),
            address: node.name.clone(),
        }])
        .collect();
    let resources = BTreeMap::from([
        ("cpu".to_owned(), Quantity("2".to_owned())),
        ("memory".to_owned(), Quantity("4Gi".to_owned())),
        ("pods".to_owned(), Quantity("110".to_owned())),
    ]);
    let info = NodeSystemInfo {
        architecture: std::env::consts::ARCH.to_owned(),
        operating_system: "linux".to_owned(),
        os_image: "tandem lab network namespace".to_owned(),
        kubelet_version: concat!("tandem-lab-", env!("CARGO_PKG_VERSION")).to_owned(),
        machine_id: node.name.clone(),
        system_uuid: node.name.clone(),
        boot_id: node.name.clone(),
        ..NodeSystemInfo::default()
    };
    json!({
        "status": {
            "addresses": addresses,
            "conditions": [ready_condition(now, last_transition)],
            "capacity": resources,
            "allocatable": resources,
            "nodeInfo": info,
        }
    })
}

/// The node's heartbeat Lease, owned by its Node (as the kubelet sets it) when the uid is
/// known.
pub fn lease_for(
    node_name: &str,
    node_uid: Option<&str>,
    now: Timestamp,
    duration_seconds: i32,
) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(node_name.to_owned()),
            namespace: Some(NODE_LEASE_NAMESPACE.to_owned()),
            owner_references: node_uid.map(|uid| {
                vec![OwnerReference {
                    api_version: "v1".to_owned(),
                    kind: "Node".to_owned(),
                    name: node_name.to_owned(),
                    uid: uid.to_owned(),
                    ..OwnerReference::default()
                }]
            }),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node_name.to_owned()),
            lease_duration_seconds: Some(duration_seconds),
            renew_time: Some(MicroTime(now)),
            ..LeaseSpec::default()
        }),
    }
}

/// Keeps the lab's Nodes registered and Ready against an API server.
pub struct NodeAgent {
    nodes: Api<Node>,
    leases: Api<Lease>,
    lab_nodes: Vec<LabNode>,
    config: NodeAgentConfig,
    transitions: HashMap<String, Timestamp>,
    uids: HashMap<String, String>,
}

impl NodeAgent {
    pub fn new(client: kube::Client, lab_nodes: Vec<LabNode>, config: NodeAgentConfig) -> Self {
        Self {
            nodes: Api::all(client.clone()),
            leases: Api::namespaced(client, NODE_LEASE_NAMESPACE),
            lab_nodes,
            config,
            transitions: HashMap::new(),
            uids: HashMap::new(),
        }
    }

    /// Creates (or updates) every Node, posts Ready status and creates the Leases.
    pub async fn register(&mut self) -> Result<(), ClusterError> {
        let now = Timestamp::now();
        for node in self.lab_nodes.clone() {
            let mut existing = self
                .nodes
                .get_opt(&node.name)
                .await
                .map_err(ClusterError::api("get", "Node", &node.name))?;
            let desired = node_object(&node);
            // A Node's pod CIDRs cannot change once set: one left by another lab with other
            // CIDRs (another family setup) is replaced, as a re-installed machine's would be.
            // One still being deleted (k3s holds Nodes with a finalizer of its own for a
            // moment) would vanish under the new registration: it is waited out.
            let pod_cidrs = |n: &Node| n.spec.as_ref().and_then(|s| s.pod_cidrs.clone());
            if let Some(old) = &existing {
                let deleting = old.metadata.deletion_timestamp.is_some();
                let other_cidrs = pod_cidrs(old).is_some_and(|cidrs| !cidrs.is_empty())
                    && pod_cidrs(old) != pod_cidrs(&desired);
                if other_cidrs && !deleting {
                    tracing::info!(node = %node.name, "replacing a Node with other pod CIDRs");
                    self.nodes
                        .delete(&node.name, &DeleteParams::default())
                        .await
                        .map_err(ClusterError::api("delete", "Node", &node.name))?;
                }
                if other_cidrs || deleting {
                    self.wait_gone(&node.name).await?;
                    existing = None;
                }
            }
            let stored = match &existing {
                None => self
                    .nodes
                    .create(&PostParams::default(), &desired)
                    .await
                    .map_err(ClusterError::api("create", "Node", &node.name))?,
                Some(_) => {
                    let patch = json!({ "metadata": { "labels": desired.metadata.labels }, "spec": desired.spec });
                    self.nodes
                        .patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .map_err(ClusterError::api("update", "Node", &node.name))?
                }
            };
            if let Some(uid) = stored.metadata.uid {
                self.uids.insert(node.name.clone(), uid);
            }
            self.transitions.insert(
                node.name.clone(),
                ready_transition_time(existing.as_ref(), now),
            );
            tracing::info!(node = %node.name, ips = ?node.internal_ips, "node registered");
        }
        self.report_status().await?;
        self.renew_leases().await
    }

    /// Waits until Node `name` is gone (its finalizers done).
    async fn wait_gone(&self, name: &str) -> Result<(), ClusterError> {
        const PATIENCE: Duration = Duration::from_secs(60);
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while self
            .nodes
            .get_opt(name)
            .await
            .map_err(ClusterError::api("get", "Node", name))?
            .is_some()
        {
            if tokio::time::Instant::now() >= deadline {
                return Err(ClusterError::NodeNotGone(name.to_owned(), PATIENCE));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }

    /// Posts the Ready heartbeat of every node.
    pub async fn report_status(&self) -> Result<(), ClusterError> {
        let now = Timestamp::now();
        for node in &self.lab_nodes {
            let transition = self.transitions.get(&node.name).copied().unwrap_or(now);
            let patch = node_status_patch(node, now, transition);
            self.nodes
                .patch_status(&node.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(ClusterError::api("patch status of", "Node", &node.name))?;
        }
        Ok(())
    }

    /// Renews every Lease, creating the ones that are missing.
    pub async fn renew_leases(&self) -> Result<(), ClusterError> {
        let now = Timestamp::now();
        for node in &self.lab_nodes {
            let lease = lease_for(
                &node.name,
                self.uids.get(&node.name).map(String::as_str),
                now,
                self.config.lease_duration_seconds,
            );
            let patch = json!({ "spec": lease.spec });
            match self
                .leases
                .patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(_) => {}
                Err(e) if is_status(&e, 404) => {
                    self.leases
                        .create(&PostParams::default(), &lease)
                        .await
                        .map_err(ClusterError::api("create", "Lease", &node.name))?;
                }
                Err(e) => return Err(ClusterError::api("renew", "Lease", &node.name)(e)),
            }
        }
        Ok(())
    }

    /// Registers, then heartbeats until `cancel` fires. Failed heartbeats are logged and
    /// retried on the next tick, as a kubelet does; only registration errors end it.
    pub async fn run(&mut self, cancel: CancellationToken) -> Result<(), ClusterError> {
        self.register().await?;
        let mut leases = tokio::time::interval(self.config.lease_renew_interval);
        let mut status = tokio::time::interval(self.config.status_update_interval);
        // register() just did both: skip the immediate first ticks.
        leases.tick().await;
        status.tick().await;
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                _ = leases.tick() => {
                    if let Err(e) = self.renew_leases().await {
                        tracing::warn!(error = %e, "lease renewal failed");
                    }
                }
                _ = status.tick() => {
                    if let Err(e) = self.report_status().await {
                        tracing::warn!(error = %e, "node status heartbeat failed");
                    }
                }
            }
        }
        tracing::info!("node agent stopped");
        Ok(())
    }

    /// Deletes the Leases and Nodes (a lab run tidying a real cluster up).
    pub async fn unregister(&self) -> Result<(), ClusterError> {
        for node in &self.lab_nodes {
            for result in [
                self.leases
                    .delete(&node.name, &DeleteParams::default())
                    .await
                    .map(drop),
                self.nodes
                    .delete(&node.name, &DeleteParams::default())
                    .await
                    .map(drop),
            ] {
                match result {
                    Ok(()) => {}
                    Err(e) if is_status(&e, 404) => {}
                    Err(e) => {
                        return Err(ClusterError::api("delete", "Node or Lease", &node.name)(e));
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeStatus;

    fn lab() -> LabNode {
        LabNode {
            name: "node-2".into(),
            internal_ips: vec!["198.18.0.12".parse().unwrap()],
            pod_cidrs: vec!["10.244.2.0/24".parse().unwrap()],
        }
    }

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn node_object_has_name_labels_and_pod_cidr() {
        let node = node_object(&lab());
        assert_eq!(node.metadata.name.as_deref(), Some("node-2"));
        let labels = node.metadata.labels.unwrap();
        assert_eq!(labels["kubernetes.io/hostname"], "node-2");
        assert_eq!(labels["app.kubernetes.io/managed-by"], "tandem-lab");
        let spec = node.spec.unwrap();
        assert_eq!(spec.pod_cidr.as_deref(), Some("10.244.2.0/24"));
        assert_eq!(spec.pod_cidrs, Some(vec!["10.244.2.0/24".to_owned()]));
        assert!(spec.unschedulable.is_none() && spec.taints.is_none());
    }

    #[test]
    fn status_patch_reports_internal_ip_and_ready_with_heartbeat() {
        let now = ts("2026-01-01T00:00:30Z");
        let patch = node_status_patch(&lab(), now, ts("2026-01-01T00:00:00Z"));
        // The patch must deserialize as a NodeStatus: the API server will do the same.
        let status: NodeStatus = serde_json::from_value(patch["status"].clone()).unwrap();
        let addresses = status.addresses.unwrap();
        assert_eq!(addresses[0].type_, "InternalIP");
        assert_eq!(addresses[0].address, "198.18.0.12");
        let conditions = status.conditions.unwrap();
        assert_eq!(conditions.len(), 1);
        assert_eq!(
            (conditions[0].type_.as_str(), conditions[0].status.as_str()),
            ("Ready", "True")
        );
        assert_eq!(conditions[0].last_heartbeat_time, Some(Time(now)));
        assert_eq!(
            conditions[0].last_transition_time,
            Some(Time(ts("2026-01-01T00:00:00Z")))
        );
        assert_eq!(
            patch["status"]["conditions"][0]["lastHeartbeatTime"],
            "2026-01-01T00:00:30Z"
        );
        assert_eq!(status.allocatable.unwrap()["pods"], Quantity("110".into()));
    }

    #[test]
    fn transition_time_is_kept_only_from_a_node_that_is_already_ready() {
        let now = ts("2026-01-01T01:00:00Z");
        let earlier = ts("2026-01-01T00:00:00Z");
        let with = |status: &str| Node {
            status: Some(NodeStatus {
                conditions: Some(vec![NodeCondition {
                    status: status.into(),
                    ..ready_condition(earlier, earlier)
                }]),
                ..NodeStatus::default()
            }),
            ..Node::default()
        };
        assert_eq!(ready_transition_time(Some(&with("True")), now), earlier);
        assert_eq!(ready_transition_time(Some(&with("False")), now), now);
        assert_eq!(ready_transition_time(Some(&Node::default()), now), now);
        assert_eq!(ready_transition_time(None, now), now);
    }

    #[test]
    fn lease_is_held_by_the_node_in_kube_node_lease() {
        let now = ts("2026-01-01T00:00:10.123456Z");
        let lease = lease_for("node-2", Some("uid-1"), now, 40);
        assert_eq!(lease.metadata.namespace.as_deref(), Some("kube-node-lease"));
        assert_eq!(lease.metadata.name.as_deref(), Some("node-2"));
        let owner = &lease.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!((owner.kind.as_str(), owner.uid.as_str()), ("Node", "uid-1"));
        let spec = lease.spec.as_ref().unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("node-2"));
        assert_eq!(spec.lease_duration_seconds, Some(40));
        let json = serde_json::to_value(&lease).unwrap();
        assert_eq!(json["spec"]["renewTime"], "2026-01-01T00:00:10.123456Z");
        assert!(
            lease_for("node-2", None, now, 40)
                .metadata
                .owner_references
                .is_none()
        );
    }

    #[test]
    fn lab_nodes_come_from_the_topology_plan() {
        let node = crate::Node {
            index: 2,
            name: crate::node_name(2),
            netns: crate::Netns::attach("x"),
            ip: crate::addr::node_ip(2).unwrap(),
            pod_cidr: crate::addr::PodNetwork::DEFAULT.node_cidr(2).unwrap(),
            ip6: None,
        };
        assert_eq!(LabNode::new(&node, ClusterFamilies::Ipv4).unwrap(), lab());
        assert!(matches!(
            LabNode::new(&node, ClusterFamilies::Dual),
            Err(NetlabError::NoIpv6 { .. })
        ));
        let dual_stack = crate::Node {
            ip6: Some(crate::addr::v6::node_ip(2).unwrap()),
            ..node
        };
        let dual = LabNode::new(&dual_stack, ClusterFamilies::Dual).unwrap();
        assert_eq!(
            dual.internal_ips,
            [
                "198.18.0.12".parse::<IpAddr>().unwrap(),
                "2001:db8:18::12".parse().unwrap()
            ]
        );
        assert_eq!(
            dual.pod_cidrs,
            [
                "10.244.2.0/24".parse::<IpNet>().unwrap(),
                "fd00:10:244:2::/64".parse().unwrap()
            ]
        );
        let node = node_object(&dual);
        let spec = node.spec.unwrap();
        assert_eq!(spec.pod_cidr.as_deref(), Some("10.244.2.0/24"));
        assert_eq!(spec.pod_cidrs.unwrap().len(), 2);
        let patch = node_status_patch(
            &dual,
            ts("2026-01-01T00:00:00Z"),
            ts("2026-01-01T00:00:00Z"),
        );
        let addresses: Vec<&str> = patch["status"]["addresses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["address"].as_str().unwrap())
            .collect();
        assert_eq!(addresses, ["198.18.0.12", "2001:db8:18::12", "node-2"]);
        let v6_only = LabNode::new(&dual_stack, ClusterFamilies::Ipv6).unwrap();
        assert_eq!(
            v6_only.internal_ips,
            ["2001:db8:18::12".parse::<IpAddr>().unwrap()]
        );
    }

    #[test]
    fn default_timing_is_the_kubelets() {
        let c = NodeAgentConfig::default();
        assert_eq!(c.lease_renew_interval, Duration::from_secs(10));
        assert_eq!(c.lease_duration_seconds, 40);
    }
}
