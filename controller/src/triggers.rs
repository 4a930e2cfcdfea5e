//! What wakes the reconciler: the kube-runtime predicates over Service and Namespace
//! changes.
//!
//! A Service is re-ensured when anything the LB depends on changes: type, ports, source
//! ranges, session affinity, requested IP, externalIPs, UID, externalTrafficPolicy,
//! healthCheckNodePort, IP families, allocateLoadBalancerNodePorts, class, any annotation,
//! or its deletion/finalizers. Labels, status and EndpointSlices do not count, and neither
//! do the controller's own writes (its finalizer and its LB-id annotation): a reconcile
//! they triggered would only read back what it just wrote.

use std::hash::{DefaultHasher, Hash, Hasher};

use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::ResourceExt;
use serde_json::json;

use crate::plan::FINALIZER;
use crate::spec::AnnotationKeys;

/// A hash of every field that can require a cloud call; used as the kube-runtime
/// predicate so status writes and label edits do not wake the reconciler.
pub fn reensure_fingerprint(svc: &Service, keys: &AnnotationKeys) -> u64 {
    let spec = svc.spec.as_ref();
    let annotations: Vec<(&String, &String)> = svc
        .annotations()
        .iter()
        .filter(|(k, _)| **k != keys.lb_id)
        .collect();
    let finalizers: Vec<&String> = svc
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .collect();
    let relevant = json!({
        "type": spec.and_then(|s| s.type_.as_ref()),
        "ports": spec.and_then(|s| s.ports.as_ref()),
        "sourceRanges": spec.and_then(|s| s.load_balancer_source_ranges.as_ref()),
        "sessionAffinity": spec.and_then(|s| s.session_affinity.as_ref()),
        "sessionAffinityConfig": spec.and_then(|s| s.session_affinity_config.as_ref()),
        "loadBalancerIP": spec.and_then(|s| s.load_balancer_ip.as_ref()),
        "externalIPs": spec.and_then(|s| s.external_ips.as_ref()),
        "externalTrafficPolicy": spec.and_then(|s| s.external_traffic_policy.as_ref()),
        "healthCheckNodePort": spec.and_then(|s| s.health_check_node_port),
        "ipFamilies": spec.and_then(|s| s.ip_families.as_ref()),
        "ipFamilyPolicy": spec.and_then(|s| s.ip_family_policy.as_ref()),
        "loadBalancerClass": spec.and_then(|s| s.load_balancer_class.as_ref()),
        "uid": svc.metadata.uid.as_ref(),
        "allocateLoadBalancerNodePorts": spec.and_then(|s| s.allocate_load_balancer_node_ports),
        "annotations": annotations,
        "deletionTimestamp": svc.metadata.deletion_timestamp.as_ref(),
        "finalizers": finalizers,
    });
    let mut hasher = DefaultHasher::new();
    relevant.to_string().hash(&mut hasher);
    hasher.finish()
}

/// A hash of what a Namespace gives its Services (the address pool), so only a change of
/// it re-ensures them.
pub fn namespace_fingerprint(namespace: &Namespace, keys: &AnnotationKeys) -> u64 {
    let mut hasher = DefaultHasher::new();
    keys.namespace_pool(namespace).hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the runtime's predicate decides for an update from `old` to `new`.
    fn needs_reensure(old: &Service, new: &Service) -> bool {
        reensure_fingerprint(old, &KEYS) != reensure_fingerprint(new, &KEYS)
    }
    use crate::spec::tests::KEYS;
    use crate::spec::tests::service;
    use k8s_openapi::api::core::v1::{LoadBalancerIngress, LoadBalancerStatus, ServiceStatus};
    use std::collections::BTreeMap;

    type Edit = fn(&mut Service);

    #[test]
    fn relevant_changes_trigger_reensure() {
        let edits: [(&str, Edit); 14] = [
            ("type", |s| {
                s.spec.as_mut().unwrap().type_ = Some("ClusterIP".into())
            }),
            ("ports", |s| {
                s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 81
            }),
            ("nodePort", |s| {
                s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].node_port = Some(30081)
            }),
            ("sourceRanges", |s| {
                s.spec.as_mut().unwrap().load_balancer_source_ranges =
                    Some(vec!["1.0.0.0/8".into()])
            }),
            ("affinity", |s| {
                s.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into())
            }),
            ("lbIP", |s| {
                s.spec.as_mut().unwrap().load_balancer_ip = Some("1.2.3.4".into())
            }),
            ("externalIPs", |s| {
                s.spec.as_mut().unwrap().external_ips = Some(vec!["1.2.3.4".into()])
            }),
            ("uid", |s| s.metadata.uid = Some("other".into())),
            ("etp", |s| {
                s.spec.as_mut().unwrap().external_traffic_policy = Some("Local".into())
            }),
            ("hcnp", |s| {
                s.spec.as_mut().unwrap().health_check_node_port = Some(31000)
            }),
            ("families", |s| {
                s.spec.as_mut().unwrap().ip_families = Some(vec!["IPv4".into()])
            }),
            ("allocateNodePorts", |s| {
                s.spec.as_mut().unwrap().allocate_load_balancer_node_ports = Some(false)
            }),
            ("annotation", |s| {
                s.metadata.annotations = Some(BTreeMap::from([("any/thing".into(), "x".into())]))
            }),
            ("deletion", |s| {
                s.metadata.deletion_timestamp =
                    Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                        jiff::Timestamp::UNIX_EPOCH,
                    ))
            }),
        ];
        let base = service("web");
        for (name, edit) in edits {
            let mut changed = base.clone();
            edit(&mut changed);
            assert!(needs_reensure(&base, &changed), "{name} should trigger");
        }
    }

    #[test]
    fn labels_and_status_do_not_trigger() {
        let base = service("web");
        let mut changed = base.clone();
        changed.metadata.labels = Some(BTreeMap::from([("app".into(), "x".into())]));
        changed.metadata.resource_version = Some("99".into());
        changed.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(vec![LoadBalancerIngress {
                    ip: Some("1.1.1.1".into()),
                    ..Default::default()
                }]),
            }),
            conditions: None,
        });
        assert!(!needs_reensure(&base, &changed));
    }

    #[test]
    fn our_own_writes_do_not_trigger() {
        let base = service("web");
        let mut ours = base.clone();
        ours.metadata.finalizers = Some(vec![FINALIZER.into()]);
        ours.metadata.annotations = Some(BTreeMap::from([(KEYS.lb_id.clone(), "lb-1".into())]));
        assert!(!needs_reensure(&base, &ours));
        let mut foreign = ours.clone();
        foreign
            .metadata
            .finalizers
            .as_mut()
            .unwrap()
            .push("example.com/other".into());
        assert!(needs_reensure(&ours, &foreign));
    }

    #[test]
    fn only_the_pool_of_a_namespace_counts() {
        let mut namespace = Namespace::default();
        let before = namespace_fingerprint(&namespace, &KEYS);
        namespace.metadata.labels = Some(BTreeMap::from([("team".into(), "a".into())]));
        assert_eq!(namespace_fingerprint(&namespace, &KEYS), before);
        namespace.metadata.annotations =
            Some(BTreeMap::from([(KEYS.address_pool.clone(), "blue".into())]));
        assert_ne!(namespace_fingerprint(&namespace, &KEYS), before);
    }
}
