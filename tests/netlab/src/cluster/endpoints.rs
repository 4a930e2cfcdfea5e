//! EndpointSlices for selectorless Services, from the pods the harness chose.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::{
    self as discovery, EndpointConditions, EndpointPort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, PostParams};

use super::{ClusterError, MANAGED_BY, is_status};
use crate::addr::IpFamily;
use crate::error::NetlabError;

/// `endpointslice.kubernetes.io/managed-by` of the slices the lab writes; the cluster's own
/// EndpointSlice controller leaves them alone.
pub const ENDPOINT_SLICE_MANAGER: &str = MANAGED_BY;
/// The API's limit of endpoints in one slice.
pub const MAX_ENDPOINTS_PER_SLICE: usize = 1000;

const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// Conflicting writers (409) are retried this often before giving up.
const CONFLICT_RETRIES: usize = 3;

/// One backend of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub node_name: String,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

impl Endpoint {
    /// A running pod's address of `family`: ready and serving. IPv6 needs a dual-stack
    /// topology.
    pub fn ready(pod: &crate::Pod, family: IpFamily) -> Result<Self, NetlabError> {
        let ip = pod.ip_of(family).ok_or_else(|| NetlabError::NoIpv6 {
            host: pod.name.clone(),
        })?;
        Ok(Self {
            ip,
            node_name: pod.node_name.clone(),
            ready: true,
            serving: true,
            terminating: false,
        })
    }

    /// A pod being deleted that still serves (graceful termination): not ready.
    pub fn terminating(pod: &crate::Pod, family: IpFamily) -> Result<Self, NetlabError> {
        Ok(Self {
            ready: false,
            terminating: true,
            ..Self::ready(pod, family)?
        })
    }
}

/// The name of the lab's slice of `family` for a Service (a slice holds one family).
pub fn slice_name_for(service_name: &str, family: IpFamily) -> String {
    match family {
        IpFamily::V4 => format!("{service_name}-{MANAGED_BY}"),
        IpFamily::V6 => format!("{service_name}-{MANAGED_BY}-ipv6"),
    }
}

/// The EndpointSlice of `family` listing `endpoints` for a selectorless `service`: one
/// port per Service port (same name and protocol, the numeric targetPort or else the
/// port), endpoints sorted by address so equal inputs give equal slices.
pub fn endpoint_slice_for(
    service: &Service,
    family: IpFamily,
    endpoints: &[Endpoint],
) -> Result<EndpointSlice, ClusterError> {
    let name = service
        .metadata
        .name
        .as_deref()
        .ok_or(ClusterError::ServiceWithout("name"))?;
    let namespace = service
        .metadata
        .namespace
        .as_deref()
        .ok_or(ClusterError::ServiceWithout("namespace"))?;
    if endpoints.len() > MAX_ENDPOINTS_PER_SLICE {
        return Err(ClusterError::TooManyEndpoints {
            count: endpoints.len(),
        });
    }
    if let Some(other) = endpoints.iter().find(|e| IpFamily::of(e.ip) != family) {
        return Err(ClusterError::EndpointOfOtherFamily {
            ip: other.ip,
            address_type: family.as_str(),
        });
    }
    let ports = service
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .map(|ports| {
            ports
                .iter()
                .map(|p| {
                    let port = match &p.target_port {
                        None => p.port,
                        Some(IntOrString::Int(target)) => *target,
                        Some(IntOrString::String(target)) => {
                            return Err(ClusterError::NamedTargetPort {
                                port: p.port,
                                target: target.clone(),
                            });
                        }
                    };
                    Ok(EndpointPort {
                        name: Some(p.name.clone().unwrap_or_default()),
                        port: Some(port),
                        protocol: Some(p.protocol.clone().unwrap_or_else(|| "TCP".to_owned())),
                        app_protocol: p.app_protocol.clone(),
                    })
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?
        .unwrap_or_default();

    let mut sorted: Vec<&Endpoint> = endpoints.iter().collect();
    sorted.sort_by_key(|e| e.ip);
    sorted.dedup_by_key(|e| e.ip);
    let endpoints = sorted
        .into_iter()
        .map(|e| discovery::Endpoint {
            addresses: vec![e.ip.to_string()],
            conditions: Some(EndpointConditions {
                ready: Some(e.ready),
                serving: Some(e.serving),
                terminating: Some(e.terminating),
            }),
            node_name: Some(e.node_name.clone()),
            ..discovery::Endpoint::default()
        })
        .collect();

    let owner = service.metadata.uid.as_ref().map(|uid| {
        vec![OwnerReference {
            api_version: "v1".to_owned(),
            kind: "Service".to_owned(),
            name: name.to_owned(),
            uid: uid.clone(),
            ..OwnerReference::default()
        }]
    });
    Ok(EndpointSlice {
        metadata: ObjectMeta {
            name: Some(slice_name_for(name, family)),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([
                (SERVICE_NAME_LABEL.to_owned(), name.to_owned()),
                (
                    MANAGED_BY_LABEL.to_owned(),
                    ENDPOINT_SLICE_MANAGER.to_owned(),
                ),
            ])),
            owner_references: owner,
            ..ObjectMeta::default()
        },
        address_type: family.as_str().to_owned(),
        endpoints,
        ports: Some(ports),
    })
}

/// Whether the stored slice already says what `desired` says (so no write is needed).
fn slice_matches(stored: &EndpointSlice, desired: &EndpointSlice) -> bool {
    let labels_present = desired.metadata.labels.iter().flatten().all(|(k, v)| {
        stored
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(k))
            .is_some_and(|s| s == v)
    });
    labels_present
        && stored.address_type == desired.address_type
        && stored.endpoints == desired.endpoints
        && stored.ports == desired.ports
        && stored.metadata.owner_references == desired.metadata.owner_references
}

/// Writes the lab's EndpointSlices with get / create / replace only.
#[derive(Clone)]
pub struct EndpointSliceWriter {
    client: kube::Client,
}

impl EndpointSliceWriter {
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }

    /// Makes the Service's slice of `family` list exactly `endpoints`; writes only on
    /// change. Returns whether it wrote.
    pub async fn sync(
        &self,
        service: &Service,
        family: IpFamily,
        endpoints: &[Endpoint],
    ) -> Result<bool, ClusterError> {
        let desired = endpoint_slice_for(service, family, endpoints)?;
        let name = desired.metadata.name.clone().unwrap_or_default();
        let namespace = desired.metadata.namespace.clone().unwrap_or_default();
        let api: Api<EndpointSlice> = Api::namespaced(self.client.clone(), &namespace);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let stored = api.get_opt(&name).await.map_err(ClusterError::api(
                "get",
                "EndpointSlice",
                &name,
            ))?;
            let result = match stored {
                None => api.create(&PostParams::default(), &desired).await,
                Some(stored) if slice_matches(&stored, &desired) => return Ok(false),
                Some(stored) => {
                    let mut update = desired.clone();
                    update.metadata.resource_version = stored.metadata.resource_version;
                    api.replace(&name, &PostParams::default(), &update).await
                }
            };
            match result {
                Ok(_) => {
                    tracing::debug!(%namespace, %name, endpoints = endpoints.len(), "EndpointSlice written");
                    return Ok(true);
                }
                // Someone wrote in between (or created it first): look again.
                Err(e) if is_status(&e, 409) && attempt < CONFLICT_RETRIES => {}
                Err(e) => return Err(ClusterError::api("write", "EndpointSlice", &name)(e)),
            }
        }
    }

    /// Deletes the Service's slices of both families; a missing one is fine.
    pub async fn delete(&self, service: &Service) -> Result<(), ClusterError> {
        let name = service
            .metadata
            .name
            .as_deref()
            .ok_or(ClusterError::ServiceWithout("name"))?;
        let namespace = service
            .metadata
            .namespace
            .as_deref()
            .ok_or(ClusterError::ServiceWithout("namespace"))?;
        let api: Api<EndpointSlice> = Api::namespaced(self.client.clone(), namespace);
        for family in [IpFamily::V4, IpFamily::V6] {
            let slice = slice_name_for(name, family);
            match api.delete(&slice, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(e) if is_status(&e, 404) => {}
                Err(e) => return Err(ClusterError::api("delete", "EndpointSlice", &slice)(e)),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ServicePort, ServiceSpec};

    fn service(ports: Vec<ServicePort>) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("s1".into()),
                uid: Some("svc-uid".into()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                ports: Some(ports),
                ..ServiceSpec::default()
            }),
            status: None,
        }
    }

    fn port(
        name: Option<&str>,
        port: i32,
        target: Option<IntOrString>,
        protocol: Option<&str>,
    ) -> ServicePort {
        ServicePort {
            name: name.map(str::to_owned),
            port,
            target_port: target,
            protocol: protocol.map(str::to_owned),
            ..ServicePort::default()
        }
    }

    fn ep(ip: [u8; 4], node: &str, ready: bool) -> Endpoint {
        Endpoint {
            ip: std::net::Ipv4Addr::from(ip).into(),
            node_name: node.into(),
            ready,
            serving: true,
            terminating: !ready,
        }
    }

    #[test]
    fn slice_is_labelled_owned_and_lists_every_endpoint_sorted() {
        let svc = service(vec![port(
            Some("http"),
            80,
            Some(IntOrString::Int(8080)),
            None,
        )]);
        let slice = endpoint_slice_for(
            &svc,
            IpFamily::V4,
            &[
                ep([10, 244, 2, 2], "node-2", true),
                ep([10, 244, 1, 2], "node-1", false),
            ],
        )
        .unwrap();
        assert_eq!(slice.metadata.name.as_deref(), Some("web-tandem-lab"));
        assert_eq!(slice.metadata.namespace.as_deref(), Some("s1"));
        let labels = slice.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["kubernetes.io/service-name"], "web");
        assert_eq!(
            labels["endpointslice.kubernetes.io/managed-by"],
            "tandem-lab"
        );
        assert_eq!(
            slice.metadata.owner_references.as_ref().unwrap()[0].uid,
            "svc-uid"
        );
        assert_eq!(slice.address_type, "IPv4");
        let ips: Vec<&str> = slice
            .endpoints
            .iter()
            .map(|e| e.addresses[0].as_str())
            .collect();
        assert_eq!(ips, ["10.244.1.2", "10.244.2.2"]);
        let first = &slice.endpoints[0];
        assert_eq!(first.node_name.as_deref(), Some("node-1"));
        assert_eq!(
            first.conditions,
            Some(EndpointConditions {
                ready: Some(false),
                serving: Some(true),
                terminating: Some(true)
            })
        );
        let json = serde_json::to_value(&slice).unwrap();
        assert_eq!(json["endpoints"][1]["conditions"]["ready"], true);
        assert_eq!(json["endpoints"][1]["nodeName"], "node-2");
    }

    #[test]
    fn a_slice_holds_one_family_under_a_name_of_its_own() {
        let svc = service(vec![port(Some("http"), 80, None, None)]);
        let v6 = Endpoint {
            ip: "fd00:10:244:1::2".parse().unwrap(),
            ..ep([10, 244, 1, 2], "node-1", true)
        };
        let slice = endpoint_slice_for(&svc, IpFamily::V6, std::slice::from_ref(&v6)).unwrap();
        assert_eq!(slice.address_type, "IPv6");
        assert_eq!(slice.metadata.name.as_deref(), Some("web-tandem-lab-ipv6"));
        assert_eq!(slice.endpoints[0].addresses, ["fd00:10:244:1::2"]);
        assert!(matches!(
            endpoint_slice_for(&svc, IpFamily::V4, &[v6]),
            Err(ClusterError::EndpointOfOtherFamily {
                address_type: "IPv4",
                ..
            })
        ));
        assert!(matches!(
            endpoint_slice_for(&svc, IpFamily::V6, &[ep([10, 244, 1, 2], "node-1", true)]),
            Err(ClusterError::EndpointOfOtherFamily {
                address_type: "IPv6",
                ..
            })
        ));
    }

    #[test]
    fn ports_carry_service_port_names_protocols_and_target_ports() {
        let svc = service(vec![
            port(Some("http"), 80, Some(IntOrString::Int(8080)), Some("TCP")),
            port(Some("dns"), 53, None, Some("UDP")),
            port(None, 9000, None, None),
        ]);
        let ports = endpoint_slice_for(&svc, IpFamily::V4, &[])
            .unwrap()
            .ports
            .unwrap();
        let got: Vec<(String, i32, String)> = ports
            .into_iter()
            .map(|p| (p.name.unwrap(), p.port.unwrap(), p.protocol.unwrap()))
            .collect();
        assert_eq!(
            got,
            [
                ("http".into(), 8080, "TCP".into()),
                ("dns".into(), 53, "UDP".into()),
                (String::new(), 9000, "TCP".into())
            ]
        );
    }

    #[test]
    fn named_target_ports_and_oversized_or_anonymous_services_are_errors() {
        let named = service(vec![port(
            Some("http"),
            80,
            Some(IntOrString::String("web".into())),
            None,
        )]);
        assert!(matches!(
            endpoint_slice_for(&named, IpFamily::V4, &[]),
            Err(ClusterError::NamedTargetPort { port: 80, .. })
        ));
        let svc = service(vec![]);
        let many: Vec<Endpoint> = (0..=MAX_ENDPOINTS_PER_SLICE)
            .map(|i| {
                ep(
                    [10, 244, (i / 250) as u8 + 1, (i % 250) as u8 + 2],
                    "n",
                    true,
                )
            })
            .collect();
        assert!(matches!(
            endpoint_slice_for(&svc, IpFamily::V4, &many),
            Err(ClusterError::TooManyEndpoints { .. })
        ));
        let mut anonymous = service(vec![]);
        anonymous.metadata.namespace = None;
        assert!(matches!(
            endpoint_slice_for(&anonymous, IpFamily::V4, &[]),
            Err(ClusterError::ServiceWithout("namespace"))
        ));
    }

    #[test]
    fn equal_inputs_in_any_order_give_equal_slices_and_no_write() {
        let svc = service(vec![port(Some("http"), 80, None, None)]);
        let a = [
            ep([10, 244, 1, 2], "node-1", true),
            ep([10, 244, 2, 2], "node-2", true),
        ];
        let b = [a[1].clone(), a[0].clone(), a[0].clone()];
        let slice_a = endpoint_slice_for(&svc, IpFamily::V4, &a).unwrap();
        assert_eq!(slice_a, endpoint_slice_for(&svc, IpFamily::V4, &b).unwrap());

        // What the API server returns has more metadata; it still matches.
        let mut stored = slice_a.clone();
        stored.metadata.resource_version = Some("7".into());
        stored.metadata.uid = Some("slice-uid".into());
        stored
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("extra".into(), "x".into());
        assert!(slice_matches(&stored, &slice_a));

        let fewer = endpoint_slice_for(&svc, IpFamily::V4, &a[..1]).unwrap();
        assert!(!slice_matches(&stored, &fewer));
        let not_ready = endpoint_slice_for(
            &svc,
            IpFamily::V4,
            &[ep([10, 244, 1, 2], "node-1", false), a[1].clone()],
        )
        .unwrap();
        assert!(!slice_matches(&stored, &not_ready));
    }
}
