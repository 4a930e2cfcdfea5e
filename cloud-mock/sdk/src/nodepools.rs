//! Node pools: a named set of backends that load balancers reference (`nodePool` in their
//! spec) instead of carrying a node list of their own, so that a node joining or leaving
//! costs one pool update whatever the number of load balancers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::families::Backend;

/// The desired state of a node pool: the body of `PUT /v1/nodepools/{name}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePoolSpec {
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// Members of either family: each VIP of a referencing load balancer uses those of its
    /// own family.
    #[serde(default)]
    pub backends: Vec<Backend>,
}

/// A node pool as the cloud reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodePool {
    pub name: String,
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    #[serde(default)]
    pub backends: Vec<Backend>,
    /// Increases by one with every change of the spec; send it as `If-Match`.
    pub version: u64,
    /// Ids of the load balancers (not yet removed) that reference the pool.
    #[serde(default)]
    pub load_balancers: Vec<String>,
}

/// The answer to a node-pool list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePoolList {
    pub items: Vec<NodePool>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_pool_round_trips_in_camel_case() {
        let pool = NodePool {
            name: "c1-nodes".into(),
            tags: BTreeMap::from([("cluster".into(), "c1".into())]),
            backends: vec![
                Backend {
                    ip: "198.18.0.11".parse().unwrap(),
                },
                Backend {
                    ip: "2001:db8:18::11".parse().unwrap(),
                },
            ],
            version: 3,
            load_balancers: vec!["lb-1".into()],
        };
        let json = serde_json::to_value(&pool).unwrap();
        assert_eq!(json["loadBalancers"][0], "lb-1");
        assert_eq!(json["backends"][1]["ip"], "2001:db8:18::11");
        let back: NodePool = serde_json::from_value(json).unwrap();
        assert_eq!(back, pool);
        let spec: NodePoolSpec = serde_json::from_str("{}").unwrap();
        assert_eq!(spec, NodePoolSpec::default());
    }
}
