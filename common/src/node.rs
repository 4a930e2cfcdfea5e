//! What a Node object says that both the controller and the node proxy act on.

use k8s_openapi::api::core::v1::Node;

use crate::TAINT_TO_BE_DELETED_BY_CLUSTER_AUTOSCALER;

/// The node is on its way out: deleted, or tainted by the cluster autoscaler that is about
/// to delete it. The controller takes it out of every load balancer's backends (KEP-3458),
/// and its node proxy's `/healthz` answers 503 so that load balancers stop sending it new
/// connections first (KEP-3836, kube-proxy since 1.28).
pub fn node_is_leaving(node: &Node) -> bool {
    node.metadata.deletion_timestamp.is_some()
        || node
            .spec
            .as_ref()
            .and_then(|spec| spec.taints.as_ref())
            .is_some_and(|taints| {
                taints
                    .iter()
                    .any(|taint| taint.key == TAINT_TO_BE_DELETED_BY_CLUSTER_AUTOSCALER)
            })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{NodeSpec, Taint};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    #[test]
    fn a_deleted_or_autoscaler_tainted_node_is_leaving_and_a_cordoned_one_is_not() {
        let mut node = Node::default();
        assert!(!node_is_leaving(&node));
        node.spec = Some(NodeSpec {
            unschedulable: Some(true),
            taints: Some(vec![Taint {
                key: "node.kubernetes.io/unschedulable".into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        assert!(!node_is_leaving(&node), "cordoned");
        let mut tainted = node.clone();
        if let Some(taints) = tainted.spec.as_mut().and_then(|spec| spec.taints.as_mut()) {
            taints.push(Taint {
                key: TAINT_TO_BE_DELETED_BY_CLUSTER_AUTOSCALER.into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            });
        }
        assert!(node_is_leaving(&tainted), "tainted by the autoscaler");
        let mut deleted = node;
        deleted.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        assert!(node_is_leaving(&deleted), "deleted");
    }
}
