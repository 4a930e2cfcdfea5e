//! `discovery.k8s.io/v1beta1` EndpointSlices, a view of the stored v1 ones for clients as
//! old as kube-proxy v1.21, which lists them at that version (Kubernetes served it until
//! 1.25). The versions differ only in where an endpoint's node and zone are: v1's
//! `nodeName` and `zone` (and `deprecatedTopology`) are v1beta1's `topology` map.

use serde_json::{Map, Value, json};

const HOSTNAME: &str = "kubernetes.io/hostname";
const ZONE: &str = "topology.kubernetes.io/zone";

/// Stored v1 → v1beta1.
pub fn v1_to_v1beta1(stored: &Value) -> Value {
    let mut view = stored.clone();
    view["apiVersion"] = json!("discovery.k8s.io/v1beta1");
    for endpoint in endpoints(&mut view) {
        let mut topology: Map<String, Value> = endpoint
            .remove("deprecatedTopology")
            .and_then(|topology| topology.as_object().cloned())
            .unwrap_or_default();
        for (field, key) in [("nodeName", HOSTNAME), ("zone", ZONE)] {
            if let Some(value) = endpoint.remove(field) {
                topology.insert(key.into(), value);
            }
        }
        if !topology.is_empty() {
            endpoint.insert("topology".into(), Value::Object(topology));
        }
    }
    view
}

/// A v1beta1 body → the v1 shape it is stored in.
pub fn v1beta1_to_v1(body: &Value) -> Value {
    let mut stored = body.clone();
    for endpoint in endpoints(&mut stored) {
        let Some(Value::Object(mut topology)) = endpoint.remove("topology") else {
            continue;
        };
        for (key, field) in [(HOSTNAME, "nodeName"), (ZONE, "zone")] {
            if let Some(value) = topology.remove(key) {
                endpoint.insert(field.into(), value);
            }
        }
        if !topology.is_empty() {
            endpoint.insert("deprecatedTopology".into(), Value::Object(topology));
        }
    }
    stored
}

fn endpoints(slice: &mut Value) -> impl Iterator<Item = &mut Map<String, Value>> {
    slice
        .get_mut("endpoints")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object_mut)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_and_zone_move_into_the_topology_map_and_back() {
        let stored = json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.244.1.2"], "nodeName": "node-a", "zone": "z1",
                 "deprecatedTopology": {"rack": "r7"}, "conditions": {"ready": true}},
                {"addresses": ["10.244.1.3"]},
            ],
        });
        let view = v1_to_v1beta1(&stored);
        assert_eq!(view["apiVersion"], "discovery.k8s.io/v1beta1");
        assert_eq!(
            view["endpoints"][0]["topology"],
            json!({HOSTNAME: "node-a", ZONE: "z1", "rack": "r7"})
        );
        assert!(view["endpoints"][0].get("nodeName").is_none());
        assert!(view["endpoints"][1].get("topology").is_none());
        let mut back = v1beta1_to_v1(&view);
        back["apiVersion"] = json!("discovery.k8s.io/v1");
        assert_eq!(back, stored);
    }
}
