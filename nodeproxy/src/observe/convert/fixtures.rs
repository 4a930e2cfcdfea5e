//! Kubernetes objects for the conversion's tests: the Service of the kube-proxy reference
//! dump and its EndpointSlices.

use k8s_openapi::api::core::v1::{
    LoadBalancerIngress as K8sIngress, LoadBalancerStatus, Service, ServicePort as K8sServicePort,
    ServiceSpec, ServiceStatus,
};
use k8s_openapi::api::discovery::v1::{
    Endpoint as K8sEndpoint, EndpointConditions, EndpointPort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tandem_proxy_rules::model::ServicePortName;

use super::endpointslice::SERVICE_NAME_LABEL;

fn meta(namespace: &str, name: &str) -> ObjectMeta {
    ObjectMeta {
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        ..Default::default()
    }
}

pub(super) fn port(
    name: Option<&str>,
    protocol: &str,
    port: i32,
    node_port: Option<i32>,
) -> K8sServicePort {
    K8sServicePort {
        name: name.map(Into::into),
        protocol: Some(protocol.into()),
        port,
        node_port,
        ..Default::default()
    }
}

/// The Service of the kube-proxy reference dump (`nodeproxy/rules/tests/data/`).
pub(super) fn nginx() -> Service {
    Service {
        metadata: meta("default", "nginx-service"),
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            cluster_ip: Some("10.43.35.197".into()),
            cluster_ips: Some(vec!["10.43.35.197".into()]),
            ports: Some(vec![port(Some("http"), "TCP", 80, Some(30166))]),
            load_balancer_source_ranges: Some(vec!["203.0.113.0/24".into()]),
            external_traffic_policy: Some("Cluster".into()),
            session_affinity: Some("None".into()),
            ..Default::default()
        }),
        status: Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus {
                ingress: Some(vec![K8sIngress {
                    ip: Some("198.51.100.20".into()),
                    ..Default::default()
                }]),
            }),
            ..Default::default()
        }),
    }
}

pub(super) fn endpoint(
    ip: &str,
    node: &str,
    ready: Option<bool>,
    terminating: Option<bool>,
) -> K8sEndpoint {
    K8sEndpoint {
        addresses: vec![ip.into()],
        conditions: Some(EndpointConditions {
            ready,
            serving: ready,
            terminating,
        }),
        node_name: Some(node.into()),
        ..Default::default()
    }
}

pub(super) fn slice(
    name: &str,
    service: &str,
    ports: &[(Option<&str>, i32)],
    endpoints: Vec<K8sEndpoint>,
) -> EndpointSlice {
    let mut metadata = meta("default", name);
    metadata.labels = Some([(SERVICE_NAME_LABEL.to_owned(), service.to_owned())].into());
    EndpointSlice {
        metadata,
        address_type: "IPv4".into(),
        endpoints,
        ports: Some(
            ports
                .iter()
                .map(|(name, port)| EndpointPort {
                    name: name.map(Into::into),
                    port: Some(*port),
                    protocol: Some("TCP".into()),
                    ..Default::default()
                })
                .collect(),
        ),
    }
}

pub(super) fn spn(name: &str, port: &str) -> ServicePortName {
    ServicePortName {
        namespace: "default".into(),
        name: name.into(),
        port: port.into(),
    }
}
