use k8s_openapi::api::core::v1::NodeSpec;

use super::*;

#[test]
fn the_node_zone_is_its_zone_label() {
    let mut node = Node::default();
    assert_eq!(node_zone(&node), None);
    node.metadata.labels = Some([(ZONE_LABEL.to_owned(), "us-east-1a".to_owned())].into());
    assert_eq!(node_zone(&node).as_deref(), Some("us-east-1a"));
}

#[test]
fn node_addresses_are_the_internal_and_external_ones_and_each_family_has_its_primary() {
    use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};
    let address = |type_: &str, address: &str| NodeAddress {
        type_: type_.into(),
        address: address.into(),
    };
    let node = Node {
        status: Some(NodeStatus {
            addresses: Some(vec![
                address("InternalIP", "198.18.0.11"),
                address("Hostname", "node-a"),
                address("ExternalIP", "203.0.113.50"),
                address("InternalIP", "fd00::11"),
            ]),
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(
        node_addresses(&node),
        ["198.18.0.11", "203.0.113.50", "fd00::11"].map(|ip| ip.parse::<IpAddr>().unwrap())
    );
    assert_eq!(
        node_primary_ip(&node, IpFamily::V4),
        Some(IpAddr::from([198, 18, 0, 11]))
    );
    assert_eq!(
        node_primary_ip(&node, IpFamily::V6),
        Some("fd00::11".parse().unwrap())
    );
    let external_only = Node {
        status: Some(NodeStatus {
            addresses: Some(vec![
                address("InternalIP", "fd00::11"),
                address("ExternalIP", "203.0.113.50"),
            ]),
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(
        node_primary_ip(&external_only, IpFamily::V4),
        Some(IpAddr::from([203, 0, 113, 50]))
    );
    assert_eq!(node_primary_ip(&Node::default(), IpFamily::V4), None);
}

#[test]
fn the_pod_cidr_of_each_family_is_the_first_of_spec_pod_cidrs() {
    let node = |cidrs: &[&str], single: Option<&str>| Node {
        spec: Some(NodeSpec {
            pod_cidrs: Some(cidrs.iter().map(|c| (*c).to_owned()).collect()),
            pod_cidr: single.map(str::to_owned),
            ..Default::default()
        }),
        ..Default::default()
    };
    let dual = node(&["10.244.3.0/24", "bogus", "fd00:10:244:3::1/64"], None);
    assert_eq!(
        NodeFacts::of(&dual, IpFamily::V4).pod_cidr,
        Some("10.244.3.0/24".parse().unwrap())
    );
    // Truncated to the network, as the rules write it.
    assert_eq!(
        node_pod_cidr(&dual, IpFamily::V6),
        Some("fd00:10:244:3::/64".parse().unwrap())
    );
    // The single spec.podCIDR of older clusters, and none of a family.
    let old = node(&[], Some("10.244.4.0/24"));
    assert_eq!(
        node_pod_cidr(&old, IpFamily::V4),
        Some("10.244.4.0/24".parse().unwrap())
    );
    assert_eq!(node_pod_cidr(&old, IpFamily::V6), None);
    assert_eq!(node_pod_cidr(&Node::default(), IpFamily::V4), None);
}
