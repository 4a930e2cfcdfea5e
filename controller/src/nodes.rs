//! Which nodes back a load balancer (KEP-3458): every node except those being deleted,
//! labelled `node.kubernetes.io/exclude-from-external-load-balancers`, or tainted
//! `ToBeDeletedByClusterAutoscaler`. NotReady and cordoned nodes stay in: the LB's own
//! health checks take them out, without a cloud call per node flap.

use std::collections::BTreeSet;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Node;
use tandem_common::{IpFamily, node_is_leaving};

pub const LABEL_EXCLUDE_FROM_LB: &str = "node.kubernetes.io/exclude-from-external-load-balancers";

/// Go's `strconv.ParseBool`, which is what the label value is parsed with upstream.
fn parse_go_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// Whether the node may receive LB traffic: not on its way out, nor labelled out.
pub fn is_eligible(node: &Node) -> bool {
    // An unparseable value still excludes: the label's presence alone meant exclusion
    // before values were parsed, and keeping traffic off a node is the safe reading.
    let excluded = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_EXCLUDE_FROM_LB))
        .is_some_and(|v| parse_go_bool(v.trim()).unwrap_or(true));
    !excluded && !node_is_leaving(node)
}

/// The node's address of `family`: its first InternalIP of that family, else its first
/// ExternalIP of it.
pub fn node_ip(node: &Node, family: IpFamily) -> Option<IpAddr> {
    let addresses = node.status.as_ref()?.addresses.as_ref()?;
    ["InternalIP", "ExternalIP"].iter().find_map(|kind| {
        addresses
            .iter()
            .filter(|a| a.type_ == *kind)
            .filter_map(|a| a.address.parse::<IpAddr>().ok())
            .find(|ip| IpFamily::of(*ip) == family)
    })
}

/// The backend addresses of every LB: each eligible node's address of each family it has
/// one of. A node without an address of a family is no backend of that family's VIPs.
pub fn eligible_backends<'a>(nodes: impl IntoIterator<Item = &'a Node>) -> BTreeSet<IpAddr> {
    nodes
        .into_iter()
        .filter(|n| is_eligible(n))
        .flat_map(|n| [IpFamily::V4, IpFamily::V6].map(|family| node_ip(n, family)))
        .flatten()
        .collect()
}

/// The node set last pushed to the LBs, and whether a new observation differs from it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeSet(Option<BTreeSet<IpAddr>>);

impl NodeSet {
    /// True when `current` must be pushed: nothing synced yet, or the set changed.
    pub fn differs(&self, current: &BTreeSet<IpAddr>) -> bool {
        self.0.as_ref() != Some(current)
    }

    pub fn record(&mut self, synced: BTreeSet<IpAddr>) {
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
    use tandem_common::TAINT_TO_BE_DELETED_BY_CLUSTER_AUTOSCALER;

    pub(crate) fn node(name: &str, ip: &str) -> Node {
        with_addresses(name, &[("InternalIP", ip)])
    }

    fn with_addresses(name: &str, addresses: &[(&str, &str)]) -> Node {
        let hostname = NodeAddress {
            type_: "Hostname".into(),
            address: name.into(),
        };
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(NodeSpec::default()),
            status: Some(NodeStatus {
                addresses: Some(
                    std::iter::once(hostname)
                        .chain(addresses.iter().map(|(kind, ip)| NodeAddress {
                            type_: (*kind).into(),
                            address: (*ip).into(),
                        }))
                        .collect(),
                ),
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

    fn ips(texts: &[&str]) -> BTreeSet<IpAddr> {
        texts.iter().map(|t| t.parse().unwrap()).collect()
    }

    #[test]
    fn backends_are_each_nodes_internal_ip_of_each_family() {
        let dual = with_addresses(
            "a",
            &[
                ("InternalIP", "198.18.0.11"),
                ("InternalIP", "2001:db8:18::11"),
                ("InternalIP", "2001:db8:18::99"),
            ],
        );
        let v4_only = node("b", "198.18.0.12");
        let v6_only = node("c", "2001:db8:18::13");
        // The external address stands in only for the family without an internal one.
        let external_v6 = with_addresses(
            "d",
            &[
                ("ExternalIP", "198.51.100.200"),
                ("InternalIP", "198.18.0.14"),
                ("ExternalIP", "2001:db8:ff::14"),
            ],
        );
        assert_eq!(
            eligible_backends(&[dual, v4_only, v6_only, external_v6]),
            ips(&[
                "198.18.0.11",
                "198.18.0.12",
                "198.18.0.14",
                "2001:db8:18::11",
                "2001:db8:18::13",
                "2001:db8:ff::14",
            ])
        );
    }

    #[test]
    fn node_set_differs_only_on_change() {
        let mut synced = NodeSet::default();
        let set = ips(&["198.18.0.11"]);
        assert!(synced.differs(&set));
        synced.record(set.clone());
        assert!(!synced.differs(&set));
        assert!(synced.differs(&BTreeSet::new()));
    }

    proptest! {
        #[test]
        fn backend_set_ignores_node_order(ips in prop::collection::vec(any::<[u8; 4]>(), 0..8)) {
            let nodes: Vec<Node> = ips.iter().enumerate()
                .map(|(i, ip)| node(&format!("n{i}"), &std::net::Ipv4Addr::from(*ip).to_string()))
                .collect();
            let mut reversed = nodes.clone();
            reversed.reverse();
            prop_assert_eq!(eligible_backends(&nodes), eligible_backends(&reversed));
            prop_assert_eq!(eligible_backends(&nodes).len(), ips.iter().collect::<BTreeSet<_>>().len());
        }
    }
}
