//! The Kubernetes objects the controller's tests write and read: Services, node addresses,
//! and the status and conditions the controller writes back. Shared by the library's
//! in-process tests and, with the cloud and the binary, the end-to-end harness
//! (controller/bin/tests/support).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1::{NodeAddress, Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::ObjectMeta;

/// The stand-in's `--service-cluster-ip-range` for a dual-stack cluster, IPv4 first.
pub const DUAL_STACK_SERVICE_CIDRS: &str = "10.96.0.0/16,fd00:10:96::/108";

/// The first ingress entry's IP, when it is an IPv4 address.
pub fn ingress_ip(svc: &Service) -> Option<Ipv4Addr> {
    match ingress_ips(svc).first()? {
        IpAddr::V4(ip) => Some(*ip),
        IpAddr::V6(_) => None,
    }
}

/// The IP of each `status.loadBalancer.ingress` entry, in order.
pub fn ingress_ips(svc: &Service) -> Vec<IpAddr> {
    tandem_controller::status::current_ingress(svc)
        .iter()
        .filter_map(|entry| entry.ip.as_ref()?.parse().ok())
        .collect()
}

/// The family of each `status.loadBalancer.ingress` entry, in order.
pub fn ingress_families(svc: &Service) -> Vec<&'static str> {
    ingress_ips(svc)
        .iter()
        .map(|ip| if ip.is_ipv4() { "IPv4" } else { "IPv6" })
        .collect()
}

/// A node's InternalIP addresses, from a comma-separated list.
pub fn internal_ips(ips: &str) -> Vec<NodeAddress> {
    ips.split(',')
        .map(|ip| NodeAddress {
            type_: "InternalIP".into(),
            address: ip.into(),
        })
        .collect()
}

pub fn condition_reason(svc: &Service) -> Option<String> {
    ready_condition(svc).map(|c| c.reason.clone())
}

pub fn condition_message(svc: &Service) -> Option<String> {
    ready_condition(svc).map(|c| c.message.clone())
}

fn ready_condition(svc: &Service) -> Option<&Condition> {
    svc.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "LoadBalancerReady")
}

pub fn lb_service(name: &str, ports: &[(i32, &str)]) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            selector: Some(BTreeMap::from([("app".into(), name.into())])),
            ports: Some(
                ports
                    .iter()
                    .map(|(port, protocol)| ServicePort {
                        name: Some(format!("p{port}-{}", protocol.to_lowercase())),
                        port: *port,
                        protocol: Some((*protocol).into()),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
        status: None,
    }
}
