//! Which nodes back a load balancer (KEP-3458): every node except those being deleted,
//! labelled `node.kubernetes.io/exclude-from-external-load-balancers`, or tainted
//! `ToBeDeletedByClusterAutoscaler`. NotReady and cordoned nodes stay in: the LB's own
//! health checks take them out, without a cloud call per node flap.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use k8s_openapi::api::core::v1::Node;
use tandem_common::TAINT_TO_BE_DELETED_BY_CLUSTER_AUTOSCALER;

pub const LABEL_EXCLUDE_FROM_LB: &str = "node.kubernetes.io/exclude-from-external-load-balancers";

/// Go's `strconv.ParseBool`, which is what the label value is parsed with upstream.
fn parse_go_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// Whether the node may receive LB traffic.
pub fn is_eligible(node: &Node) -> bool {
    if node.metadata.deletion_timestamp.is_some() {
        return false;
    }
    // An unparseable value still excludes: the label's presence alone meant exclusion
    // before values were parsed, and keeping traffic off a node is the safe reading.
    let excluded = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_EXCLUDE_FROM_LB))
        .is_some_and(|v| parse_go_bool(v.trim()).unwrap_or(true));
    if excluded {
        return false;
    }
    let to_be_deleted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|taints| {
            taints
                .iter()
                .any(|t| t.key == TAINT_TO_BE_DELETED_BY_CLUSTER_AUTOSCALER)
        });
    !to_be_deleted
}

/// The node's first IPv4 InternalIP (falling back to an ExternalIP).
pub fn node_ip(node: &Node) -> Option<Ipv4Addr> {
    let addresses = node.status.as_ref()?.addresses.as_ref()?;
    ["InternalIP", "ExternalIP"].iter().find_map(|kind| {
        addresses
            .iter()
            .filter(|a| a.type_ == *kind)
            .find_map(|a| a.address.parse::<Ipv4Addr>().ok())
    })
}

/// The backend set for every LB: eligible nodes that have an IPv4 address.
pub fn eligible_backends<'a>(nodes: impl IntoIterator<Item = &'a Node>) -> BTreeSet<Ipv4Addr> {
    nodes
        .into_iter()
        .filter(|n| is_eligible(n))
        .filter_map(node_ip)
        .collect()
}

/// The node set last pushed to the LBs, and whether a new observation differs from it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeSet(Option<BTreeSet<Ipv4Addr>>);

impl NodeSet {
    /// True when `current` must be pushed: nothing synced yet, or the set changed.
    pub fn differs(&self, current: &BTreeSet<Ipv4Addr>) -> bool {
        self.0.as_ref() != Some(current)
    }

    pub fn record(&mut self, synced: BTreeSet<Ipv4Addr>) {
        self.0 = Some(synced);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeAddress, NodeSpec, NodeStatus, Taint};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::ObjectMeta;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    pub(crate) fn node(name: &str, ip: &str) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(NodeSpec::default()),
            status: Some(NodeStatus {
                addresses: Some(vec![
                    NodeAddress {
                        type_: "Hostname".into(),
                        address: name.into(),
                    },
                    NodeAddress {
                        type_: "InternalIP".into(),
                        address: ip.into(),
                    },
                ]),
                ..Default::default()
            }),
        }
    }

    fn labelled(mut n: Node, v: &str) -> Node {
        n.metadata
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(LABEL_EXCLUDE_FROM_LB.into(), v.into());
        n
    }

    #[test]
    fn plain_node_is_eligible() {
        assert!(is_eligible(&node("a", "198.18.0.11")));
    }

    #[test]
    fn exclude_label_is_parsed_as_bool() {
        for v in ["true", "True", "1", "t", "junk", ""] {
            assert!(!is_eligible(&labelled(node("a", "1.1.1.1"), v)), "{v:?}");
        }
        for v in ["false", "False", "0", "f"] {
            assert!(is_eligible(&labelled(node("a", "1.1.1.1"), v)), "{v:?}");
        }
    }

    #[test]
    fn deleting_and_autoscaler_tainted_nodes_go() {
        let mut deleting = node("a", "1.1.1.1");
        deleting.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::UNIX_EPOCH));
        assert!(!is_eligible(&deleting));
        let mut tainted = node("a", "1.1.1.1");
        tainted.spec.as_mut().unwrap().taints = Some(vec![Taint {
            key: TAINT_TO_BE_DELETED_BY_CLUSTER_AUTOSCALER.into(),
            effect: "NoSchedule".into(),
            ..Default::default()
        }]);
        assert!(!is_eligible(&tainted));
    }

    #[test]
    fn not_ready_and_cordoned_nodes_stay() {
        let mut n = node("a", "1.1.1.1");
        n.spec.as_mut().unwrap().unschedulable = Some(true);
        n.spec.as_mut().unwrap().taints = Some(vec![Taint {
            key: "node.kubernetes.io/not-ready".into(),
            effect: "NoExecute".into(),
            ..Default::default()
        }]);
        n.status.as_mut().unwrap().conditions =
            Some(vec![k8s_openapi::api::core::v1::NodeCondition {
                type_: "Ready".into(),
                status: "False".into(),
                ..Default::default()
            }]);
        assert!(is_eligible(&n));
    }

    #[test]
    fn backends_use_ipv4_internal_ip() {
        let v6 = node("c", "2001:db8::1");
        let nodes = [node("a", "198.18.0.11"), node("b", "198.18.0.12"), v6];
        assert_eq!(
            eligible_backends(&nodes),
            BTreeSet::from([Ipv4Addr::new(198, 18, 0, 11), Ipv4Addr::new(198, 18, 0, 12)])
        );
    }

    #[test]
    fn node_set_differs_only_on_change() {
        let mut synced = NodeSet::default();
        let set = BTreeSet::from([Ipv4Addr::new(198, 18, 0, 11)]);
        assert!(synced.differs(&set));
        synced.record(set.clone());
        assert!(!synced.differs(&set));
        assert!(synced.differs(&BTreeSet::new()));
    }

    proptest! {
        #[test]
        fn backend_set_ignores_node_order(ips in prop::collection::vec(any::<[u8; 4]>(), 0..8)) {
            let nodes: Vec<Node> = ips.iter().enumerate()
                .map(|(i, ip)| node(&format!("n{i}"), &Ipv4Addr::from(*ip).to_string()))
                .collect();
            let mut reversed = nodes.clone();
            reversed.reverse();
            prop_assert_eq!(eligible_backends(&nodes), eligible_backends(&reversed));
            prop_assert_eq!(eligible_backends(&nodes).len(), ips.iter().collect::<BTreeSet<_>>().len());
        }
    }
}
