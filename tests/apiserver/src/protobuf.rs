//! Protobuf request bodies (`application/vnd.kubernetes.protobuf`), turned into the JSON
//! objects the store keeps.
//!
//! client-go's typed clients send protobuf: `kubectl create service`, `kubectl expose` and
//! `kubectl create namespace` POST their objects that way. The wire format is the 4-byte
//! magic `k8s\0` followed by a `runtime.Unknown` envelope whose `raw` field holds the
//! object's own message. The messages come from `k8s-pb` (generated from the Kubernetes
//! `.proto` files); this module only maps them to the JSON field names.
//!
//! Decoded: every kind the stand-in serves — Service and Namespace (what kubectl's
//! imperative commands create), Node and Lease (what a kubelet writes), EndpointSlice and
//! both Event versions (what controllers write), ServiceCIDR. Node fields that no Tandem component reads
//! (images, volumes, runtime handlers, features, config) and deprecated EndpointSlice
//! topology are left out. Any other kind answers 415 rather than being misread.
//! Responses are always JSON: clients send `Accept: application/vnd.kubernetes.protobuf,
//! application/json`.

use std::collections::BTreeMap;

use k8s_pb::api::coordination::v1 as coordination;
use k8s_pb::api::core::v1 as core;
use k8s_pb::api::discovery::v1 as discovery;
use k8s_pb::api::events::v1 as events;
use k8s_pb::api::networking::v1 as networking;
use k8s_pb::apimachinery::pkg::apis::meta::v1 as meta;
use k8s_pb::apimachinery::pkg::runtime::Unknown;
use k8s_pb::apimachinery::pkg::util::intstr::IntOrString;
use prost::Message;
use serde_json::{Map, Value};

use crate::resources::ResourceType;

/// The media type of Kubernetes protobuf bodies.
pub const MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf";

/// What every Kubernetes protobuf body starts with.
const MAGIC: &[u8; 4] = b"k8s\0";

/// The kinds whose protobuf bodies are decoded.
pub const KINDS: [&str; 7] = [
    "Service",
    "Namespace",
    "Node",
    "Lease",
    "EndpointSlice",
    "Event",
    "ServiceCIDR",
];

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("protobuf body does not start with the \"k8s\\x00\" magic")]
    Magic,
    #[error("decoding the runtime.Unknown envelope: {0}")]
    Envelope(prost::DecodeError),
    #[error("protobuf envelope uses content encoding {0:?}; only unencoded bodies are read")]
    Encoding(String),
    #[error("the body is a {found}, the request is for {expected}")]
    KindMismatch { found: String, expected: String },
    #[error("protobuf bodies of kind {0} are not decoded (only {kinds}); send JSON", kinds = KINDS.join(", "))]
    UnsupportedKind(String),
    #[error("decoding the {kind} message: {source}")]
    Object {
        kind: String,
        source: prost::DecodeError,
    },
}

/// Whether a `Content-Type` header names a protobuf body.
pub fn is_protobuf(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|media| media.trim().eq_ignore_ascii_case(MEDIA_TYPE))
}

/// Decodes a protobuf body sent to `rt`'s collection or object into its JSON form.
pub fn decode(rt: &ResourceType, body: &[u8]) -> Result<Value, DecodeError> {
    let envelope = body.strip_prefix(MAGIC).ok_or(DecodeError::Magic)?;
    let unknown = Unknown::decode(envelope).map_err(DecodeError::Envelope)?;
    if let Some(encoding) = unknown.content_encoding.filter(|e| !e.is_empty()) {
        return Err(DecodeError::Encoding(encoding));
    }
    let type_meta = unknown.type_meta.unwrap_or_default();
    let kind = type_meta.kind.unwrap_or_default();
    let api_version = type_meta.api_version.unwrap_or_default();
    if kind != rt.kind || (!api_version.is_empty() && api_version != rt.api_version()) {
        return Err(DecodeError::KindMismatch {
            found: format!("{api_version} {kind}"),
            expected: format!("{} {}", rt.api_version(), rt.kind),
        });
    }
    let raw = unknown.raw.unwrap_or_default();
    let object_error = |source| DecodeError::Object {
        kind: kind.clone(),
        source,
    };
    let (metadata, mut fields) = match (rt.group, kind.as_str()) {
        (_, "Service") => {
            let service = core::Service::decode(raw.as_slice()).map_err(object_error)?;
            let fields = Fields::new()
                .object("spec", service.spec.map(service_spec))
                .object("status", service.status.map(service_status));
            (service.metadata, fields)
        }
        (_, "Namespace") => {
            let namespace = core::Namespace::decode(raw.as_slice()).map_err(object_error)?;
            let fields = Fields::new()
                .object(
                    "spec",
                    namespace
                        .spec
                        .map(|s| Fields::new().strings("finalizers", s.finalizers).done()),
                )
                .object("status", namespace.status.map(namespace_status));
            (namespace.metadata, fields)
        }
        (_, "Node") => {
            let node = core::Node::decode(raw.as_slice()).map_err(object_error)?;
            let fields = Fields::new()
                .object("spec", node.spec.map(node_spec))
                .object("status", node.status.map(node_status));
            (node.metadata, fields)
        }
        (_, "Lease") => {
            let lease = coordination::Lease::decode(raw.as_slice()).map_err(object_error)?;
            (
                lease.metadata,
                Fields::new().object("spec", lease.spec.map(lease_spec)),
            )
        }
        (_, "EndpointSlice") => {
            let slice = discovery::EndpointSlice::decode(raw.as_slice()).map_err(object_error)?;
            let endpoints = slice.endpoints.into_iter().map(endpoint).collect();
            let ports = slice
                .ports
                .into_iter()
                .map(|p| {
                    // Every field of EndpointPort is a pointer in Go.
                    Fields::new()
                        .put_pointer("name", p.name)
                        .put_pointer("protocol", p.protocol)
                        .put_pointer("port", p.port)
                        .put_pointer("appProtocol", p.app_protocol)
                        .done()
                })
                .collect();
            let fields = Fields::new()
                .put("addressType", slice.address_type)
                .items("endpoints", endpoints)
                .items("ports", ports);
            (slice.metadata, fields)
        }
        ("", "Event") => {
            let event = core::Event::decode(raw.as_slice()).map_err(object_error)?;
            let source = event.source.map(event_source);
            let fields = Fields::new()
                .object(
                    "involvedObject",
                    event.involved_object.map(object_reference),
                )
                .put("reason", event.reason)
                .put("message", event.message)
                .object("source", source)
                .put("firstTimestamp", event.first_timestamp.and_then(time))
                .put("lastTimestamp", event.last_timestamp.and_then(time))
                .put("count", event.count)
                .put("type", event.r#type)
                .put("eventTime", event.event_time.and_then(micro_time))
                .object(
                    "series",
                    event
                        .series
                        .map(|s| event_series(s.count, s.last_observed_time)),
                )
                .put("action", event.action)
                .object("related", event.related.map(object_reference))
                .put("reportingComponent", event.reporting_component)
                .put("reportingInstance", event.reporting_instance);
            (event.metadata, fields)
        }
        ("events.k8s.io", "Event") => {
            let event = events::Event::decode(raw.as_slice()).map_err(object_error)?;
            let source = event.deprecated_source.map(event_source);
            let fields = Fields::new()
                .put("eventTime", event.event_time.and_then(micro_time))
                .object(
                    "series",
                    event
                        .series
                        .map(|s| event_series(s.count, s.last_observed_time)),
                )
                .put("reportingController", event.reporting_controller)
                .put("reportingInstance", event.reporting_instance)
                .put("action", event.action)
                .put("reason", event.reason)
                .object("regarding", event.regarding.map(object_reference))
                .object("related", event.related.map(object_reference))
                .put("note", event.note)
                .put("type", event.r#type)
                .object("deprecatedSource", source)
                .put(
                    "deprecatedFirstTimestamp",
                    event.deprecated_first_timestamp.and_then(time),
                )
                .put(
                    "deprecatedLastTimestamp",
                    event.deprecated_last_timestamp.and_then(time),
                )
                .put("deprecatedCount", event.deprecated_count);
            (event.metadata, fields)
        }
        (_, "ServiceCIDR") => {
            let cidr = networking::ServiceCIDR::decode(raw.as_slice()).map_err(object_error)?;
            let fields = Fields::new()
                .object(
                    "spec",
                    cidr.spec
                        .map(|s| Fields::new().strings("cidrs", s.cidrs).done()),
                )
                .object(
                    "status",
                    cidr.status.map(|s| {
                        Fields::new()
                            .items(
                                "conditions",
                                s.conditions.into_iter().map(condition).collect(),
                            )
                            .done()
                    }),
                );
            (cidr.metadata, fields)
        }
        _ => return Err(DecodeError::UnsupportedKind(kind)),
    };
    fields = fields.object("metadata", Some(object_meta(metadata.unwrap_or_default())));
    let mut object = Map::new();
    object.insert("apiVersion".into(), Value::from(rt.api_version()));
    object.insert("kind".into(), Value::from(kind));
    object.extend(fields.0);
    Ok(Value::Object(object))
}

/// A JSON object built from protobuf fields the way Go's JSON encoding writes the same
/// struct. Go's protobuf encoder writes every plain (non-pointer) field, zero or not, while
/// its JSON encoder leaves zero values out (`omitempty`): so [`Fields::put`] drops zero
/// values, and [`Fields::put_pointer`] keeps them for the fields that are pointers in Go,
/// where a zero (e.g. `allocateLoadBalancerNodePorts: false`) means something.
struct Fields(Map<String, Value>);

impl Fields {
    fn new() -> Self {
        Self(Map::new())
    }

    fn put<T: Into<Value> + Default + PartialEq>(self, key: &str, value: Option<T>) -> Self {
        self.put_pointer(key, value.filter(|v| *v != T::default()))
    }

    fn put_pointer(mut self, key: &str, value: Option<impl Into<Value>>) -> Self {
        if let Some(value) = value {
            self.0.insert(key.into(), value.into());
        }
        self
    }

    fn object(self, key: &str, value: Option<Value>) -> Self {
        self.put_pointer(key, value)
    }

    fn strings(self, key: &str, values: Vec<String>) -> Self {
        self.items(key, values.into_iter().map(Value::from).collect())
    }

    fn items(mut self, key: &str, values: Vec<Value>) -> Self {
        if !values.is_empty() {
            self.0.insert(key.into(), Value::Array(values));
        }
        self
    }

    fn map(mut self, key: &str, values: BTreeMap<String, String>) -> Self {
        if !values.is_empty() {
            let map = values.into_iter().map(|(k, v)| (k, Value::from(v)));
            self.0.insert(key.into(), Value::Object(map.collect()));
        }
        self
    }

    fn done(self) -> Value {
        Value::Object(self.0)
    }
}

/// `metav1.Time` as RFC 3339 in UTC, the way Kubernetes writes it in JSON.
fn time(time: meta::Time) -> Option<String> {
    let timestamp = jiff::Timestamp::from_second(time.seconds.unwrap_or_default()).ok()?;
    Some(timestamp.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
}

/// `metav1.MicroTime`: RFC 3339 with microseconds, as Leases carry it.
fn micro_time(time: meta::MicroTime) -> Option<String> {
    let nanos = time.nanos.unwrap_or_default();
    let timestamp = jiff::Timestamp::new(time.seconds.unwrap_or_default(), nanos).ok()?;
    Some(timestamp.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string())
}

fn object_meta(m: meta::ObjectMeta) -> Value {
    let owners = m
        .owner_references
        .into_iter()
        .map(|o| {
            Fields::new()
                .put("apiVersion", o.api_version)
                .put("kind", o.kind)
                .put("name", o.name)
                .put("uid", o.uid)
                .put_pointer("controller", o.controller)
                .put_pointer("blockOwnerDeletion", o.block_owner_deletion)
                .done()
        })
        .collect();
    // managedFields are left out: the store does not record them.
    Fields::new()
        .put("name", m.name)
        .put("generateName", m.generate_name)
        .put("namespace", m.namespace)
        .put("uid", m.uid)
        .put("resourceVersion", m.resource_version)
        .put("generation", m.generation)
        .put("creationTimestamp", m.creation_timestamp.and_then(time))
        .put("deletionTimestamp", m.deletion_timestamp.and_then(time))
        .put_pointer(
            "deletionGracePeriodSeconds",
            m.deletion_grace_period_seconds,
        )
        .map("labels", m.labels)
        .map("annotations", m.annotations)
        .items("ownerReferences", owners)
        .strings("finalizers", m.finalizers)
        .done()
}

/// An IntOrString; the zero value (`0` or `""`) is left out, so it is defaulted as if unset.
fn int_or_string(value: IntOrString) -> Option<Value> {
    // intstr.Type: 0 = Int, 1 = String.
    match value.r#type.unwrap_or_default() {
        1 => value.str_val.filter(|s| !s.is_empty()).map(Value::from),
        _ => value.int_val.filter(|i| *i != 0).map(Value::from),
    }
}

fn service_spec(s: core::ServiceSpec) -> Value {
    let ports = s
        .ports
        .into_iter()
        .map(|p| {
            Fields::new()
                .put("name", p.name)
                .put("protocol", p.protocol)
                .put("appProtocol", p.app_protocol)
                .put("port", p.port)
                .object("targetPort", p.target_port.and_then(int_or_string))
                .put("nodePort", p.node_port)
                .done()
        })
        .collect();
    let affinity = s.session_affinity_config.map(|c| {
        Fields::new()
            .object(
                "clientIP",
                c.client_ip.map(|ip| {
                    Fields::new()
                        .put_pointer("timeoutSeconds", ip.timeout_seconds)
                        .done()
                }),
            )
            .done()
    });
    Fields::new()
        .items("ports", ports)
        .map("selector", s.selector)
        .put("clusterIP", s.cluster_ip)
        .strings("clusterIPs", s.cluster_ips)
        .put("type", s.r#type)
        .strings("externalIPs", s.external_ips)
        .put("sessionAffinity", s.session_affinity)
        .put("loadBalancerIP", s.load_balancer_ip)
        .strings("loadBalancerSourceRanges", s.load_balancer_source_ranges)
        .put("externalName", s.external_name)
        .put("externalTrafficPolicy", s.external_traffic_policy)
        .put("healthCheckNodePort", s.health_check_node_port)
        .put("publishNotReadyAddresses", s.publish_not_ready_addresses)
        .object("sessionAffinityConfig", affinity)
        .strings("ipFamilies", s.ip_families)
        .put_pointer("ipFamilyPolicy", s.ip_family_policy)
        .put_pointer(
            "allocateLoadBalancerNodePorts",
            s.allocate_load_balancer_node_ports,
        )
        .put_pointer("loadBalancerClass", s.load_balancer_class)
        .put_pointer("internalTrafficPolicy", s.internal_traffic_policy)
        .put_pointer("trafficDistribution", s.traffic_distribution)
        .done()
}

fn condition(c: meta::Condition) -> Value {
    Fields::new()
        .put("type", c.r#type)
        .put("status", c.status)
        .put("observedGeneration", c.observed_generation)
        .put("lastTransitionTime", c.last_transition_time.and_then(time))
        .put("reason", c.reason)
        .put("message", c.message)
        .done()
}

fn service_status(s: core::ServiceStatus) -> Value {
    let ingress = s
        .load_balancer
        .map(|lb| {
            lb.ingress
                .into_iter()
                .map(|i| {
                    let ports = i
                        .ports
                        .into_iter()
                        .map(|p| {
                            Fields::new()
                                .put("port", p.port)
                                .put("protocol", p.protocol)
                                .put_pointer("error", p.error)
                                .done()
                        })
                        .collect();
                    Fields::new()
                        .put("ip", i.ip)
                        .put("hostname", i.hostname)
                        .put_pointer("ipMode", i.ip_mode)
                        .items("ports", ports)
                        .done()
                })
                .collect()
        })
        .unwrap_or_default();
    Fields::new()
        .object(
            "loadBalancer",
            Some(Fields::new().items("ingress", ingress).done()),
        )
        .items(
            "conditions",
            s.conditions.into_iter().map(condition).collect(),
        )
        .done()
}

fn object_reference(r: core::ObjectReference) -> Value {
    Fields::new()
        .put("kind", r.kind)
        .put("namespace", r.namespace)
        .put("name", r.name)
        .put("uid", r.uid)
        .put("apiVersion", r.api_version)
        .put("resourceVersion", r.resource_version)
        .put("fieldPath", r.field_path)
        .done()
}

fn event_source(s: core::EventSource) -> Value {
    Fields::new()
        .put("component", s.component)
        .put("host", s.host)
        .done()
}

/// An `EventSeries` of either Event version (the same two fields in both).
fn event_series(count: Option<i32>, last_observed: Option<meta::MicroTime>) -> Value {
    Fields::new()
        .put("count", count)
        .put("lastObservedTime", last_observed.and_then(micro_time))
        .done()
}

fn endpoint(e: discovery::Endpoint) -> Value {
    // ready, serving and terminating are pointers in Go: unset is not false.
    let conditions = e.conditions.map(|c| {
        Fields::new()
            .put_pointer("ready", c.ready)
            .put_pointer("serving", c.serving)
            .put_pointer("terminating", c.terminating)
            .done()
    });
    let hints = e.hints.map(|h| {
        let names = |names: Vec<Option<String>>| {
            names
                .into_iter()
                .map(|name| Fields::new().put("name", name).done())
                .collect()
        };
        Fields::new()
            .items(
                "forZones",
                names(h.for_zones.into_iter().map(|z| z.name).collect()),
            )
            .items(
                "forNodes",
                names(h.for_nodes.into_iter().map(|n| n.name).collect()),
            )
            .done()
    });
    Fields::new()
        .strings("addresses", e.addresses)
        .object("conditions", conditions)
        .put_pointer("hostname", e.hostname)
        .object("targetRef", e.target_ref.map(object_reference))
        .put_pointer("nodeName", e.node_name)
        .put_pointer("zone", e.zone)
        .object("hints", hints)
        .done()
}

fn node_spec(s: core::NodeSpec) -> Value {
    let taints = s
        .taints
        .into_iter()
        .map(|t| {
            Fields::new()
                .put("key", t.key)
                .put("value", t.value)
                .put("effect", t.effect)
                .put_pointer("timeAdded", t.time_added.and_then(time))
                .done()
        })
        .collect();
    Fields::new()
        .put("podCIDR", s.pod_cidr)
        .strings("podCIDRs", s.pod_cid_rs)
        .put("providerID", s.provider_id)
        .put("unschedulable", s.unschedulable)
        .items("taints", taints)
        .done()
}

fn quantities(
    map: BTreeMap<String, k8s_pb::apimachinery::pkg::api::resource::Quantity>,
) -> BTreeMap<String, String> {
    map.into_iter()
        .filter_map(|(k, q)| Some((k, q.string?)))
        .collect()
}

fn node_status(s: core::NodeStatus) -> Value {
    let conditions = s
        .conditions
        .into_iter()
        .map(|c| {
            Fields::new()
                .put("type", c.r#type)
                .put("status", c.status)
                .put("lastHeartbeatTime", c.last_heartbeat_time.and_then(time))
                .put("lastTransitionTime", c.last_transition_time.and_then(time))
                .put("reason", c.reason)
                .put("message", c.message)
                .done()
        })
        .collect();
    let addresses = s
        .addresses
        .into_iter()
        .map(|a| {
            Fields::new()
                .put("type", a.r#type)
                .put("address", a.address)
                .done()
        })
        .collect();
    let endpoints = s.daemon_endpoints.map(|d| {
        let kubelet = d
            .kubelet_endpoint
            .map(|e| Fields::new().put("Port", e.port).done());
        Fields::new().object("kubeletEndpoint", kubelet).done()
    });
    let info = s.node_info.map(|i| {
        Fields::new()
            .put("machineID", i.machine_id)
            .put("systemUUID", i.system_uuid)
            .put("bootID", i.boot_id)
            .put("kernelVersion", i.kernel_version)
            .put("osImage", i.os_image)
            .put("containerRuntimeVersion", i.container_runtime_version)
            .put("kubeletVersion", i.kubelet_version)
            .put("kubeProxyVersion", i.kube_proxy_version)
            .put("operatingSystem", i.operating_system)
            .put("architecture", i.architecture)
            .done()
    });
    Fields::new()
        .map("capacity", quantities(s.capacity))
        .map("allocatable", quantities(s.allocatable))
        .put("phase", s.phase)
        .items("conditions", conditions)
        .items("addresses", addresses)
        .object("daemonEndpoints", endpoints)
        .object("nodeInfo", info)
        .done()
}

fn lease_spec(s: coordination::LeaseSpec) -> Value {
    // Every field of LeaseSpec is a pointer in Go.
    Fields::new()
        .put_pointer("holderIdentity", s.holder_identity)
        .put_pointer("leaseDurationSeconds", s.lease_duration_seconds)
        .put_pointer("acquireTime", s.acquire_time.and_then(micro_time))
        .put_pointer("renewTime", s.renew_time.and_then(micro_time))
        .put_pointer("leaseTransitions", s.lease_transitions)
        .put_pointer("strategy", s.strategy)
        .put_pointer("preferredHolder", s.preferred_holder)
        .done()
}

fn namespace_status(s: core::NamespaceStatus) -> Value {
    let conditions = s
        .conditions
        .into_iter()
        .map(|c| {
            Fields::new()
                .put("type", c.r#type)
                .put("status", c.status)
                .put("lastTransitionTime", c.last_transition_time.and_then(time))
                .put("reason", c.reason)
                .put("message", c.message)
                .done()
        })
        .collect();
    Fields::new()
        .put("phase", s.phase)
        .items("conditions", conditions)
        .done()
}

#[cfg(test)]
mod tests {
    use k8s_pb::apimachinery::pkg::runtime::TypeMeta;
    use serde_json::json;

    use super::*;
    use crate::resources::{
        ENDPOINT_SLICES, EVENTS, EVENTS_V1, LEASES, NAMESPACES, NODES, SERVICE_CIDRS, SERVICES,
    };

    /// A body as client-go's protobuf serializer writes it.
    fn wire(api_version: &str, kind: &str, raw: Vec<u8>) -> Vec<u8> {
        let envelope = Unknown {
            type_meta: Some(TypeMeta {
                api_version: Some(api_version.into()),
                kind: Some(kind.into()),
            }),
            raw: Some(raw),
            content_encoding: Some(String::new()),
            content_type: Some(String::new()),
        };
        let mut body = MAGIC.to_vec();
        body.extend(envelope.encode_to_vec());
        body
    }

    fn service() -> core::Service {
        core::Service {
            metadata: Some(meta::ObjectMeta {
                name: Some("web".into()),
                labels: BTreeMap::from([("app".into(), "web".into())]),
                creation_timestamp: Some(meta::Time {
                    seconds: Some(0),
                    nanos: Some(0),
                }),
                ..Default::default()
            }),
            spec: Some(core::ServiceSpec {
                ports: vec![
                    core::ServicePort {
                        name: Some("80-8080".into()),
                        protocol: Some("TCP".into()),
                        port: Some(80),
                        target_port: Some(IntOrString {
                            r#type: Some(0),
                            int_val: Some(8080),
                            str_val: Some(String::new()),
                        }),
                        ..Default::default()
                    },
                    core::ServicePort {
                        port: Some(53),
                        protocol: Some("UDP".into()),
                        target_port: Some(IntOrString {
                            r#type: Some(1),
                            int_val: Some(0),
                            str_val: Some("dns".into()),
                        }),
                        ..Default::default()
                    },
                ],
                selector: BTreeMap::from([("app".into(), "web".into())]),
                r#type: Some("LoadBalancer".into()),
                load_balancer_source_ranges: vec!["192.0.2.0/24".into()],
                // Plain Go fields arrive with their zero values; pointers keep theirs.
                session_affinity: Some(String::new()),
                health_check_node_port: Some(0),
                allocate_load_balancer_node_ports: Some(false),
                ..Default::default()
            }),
            status: Some(core::ServiceStatus {
                load_balancer: Some(core::LoadBalancerStatus::default()),
                conditions: vec![],
            }),
        }
    }

    #[test]
    fn service_bodies_decode_to_the_json_form() {
        let body = wire("v1", "Service", service().encode_to_vec());
        assert_eq!(
            decode(SERVICES, &body).unwrap(),
            json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": "web",
                    "labels": {"app": "web"},
                    "creationTimestamp": "1970-01-01T00:00:00Z"
                },
                "spec": {
                    "ports": [
                        {"name": "80-8080", "protocol": "TCP", "port": 80, "targetPort": 8080},
                        {"protocol": "UDP", "port": 53, "targetPort": "dns"}
                    ],
                    "selector": {"app": "web"},
                    "type": "LoadBalancer",
                    "loadBalancerSourceRanges": ["192.0.2.0/24"],
                    "allocateLoadBalancerNodePorts": false
                },
                "status": {"loadBalancer": {}}
            })
        );
    }

    #[test]
    fn namespace_bodies_decode_to_the_json_form() {
        let namespace = core::Namespace {
            metadata: Some(meta::ObjectMeta {
                name: Some("team-a".into()),
                ..Default::default()
            }),
            spec: Some(core::NamespaceSpec::default()),
            status: Some(core::NamespaceStatus::default()),
        };
        let body = wire("v1", "Namespace", namespace.encode_to_vec());
        assert_eq!(
            decode(NAMESPACES, &body).unwrap(),
            json!({
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": "team-a"},
                "spec": {},
                "status": {}
            })
        );
    }

    #[test]
    fn node_and_lease_bodies_decode_to_the_json_form() {
        let node = core::Node {
            metadata: Some(meta::ObjectMeta {
                name: Some("node-1".into()),
                ..Default::default()
            }),
            spec: Some(core::NodeSpec {
                pod_cidr: Some("10.244.1.0/24".into()),
                pod_cid_rs: vec!["10.244.1.0/24".into()],
                unschedulable: Some(false),
                taints: vec![core::Taint {
                    key: Some("ToBeDeletedByClusterAutoscaler".into()),
                    value: Some(String::new()),
                    effect: Some("NoSchedule".into()),
                    time_added: None,
                }],
                ..Default::default()
            }),
            status: Some(core::NodeStatus {
                capacity: BTreeMap::from([(
                    "cpu".into(),
                    k8s_pb::apimachinery::pkg::api::resource::Quantity {
                        string: Some("2".into()),
                    },
                )]),
                conditions: vec![core::NodeCondition {
                    r#type: Some("Ready".into()),
                    status: Some("True".into()),
                    ..Default::default()
                }],
                addresses: vec![core::NodeAddress {
                    r#type: Some("InternalIP".into()),
                    address: Some("198.18.0.11".into()),
                }],
                node_info: Some(core::NodeSystemInfo {
                    kubelet_version: Some("v1.34.0".into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        };
        let body = wire("v1", "Node", node.encode_to_vec());
        assert_eq!(
            decode(NODES, &body).unwrap(),
            json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": "node-1"},
                "spec": {
                    "podCIDR": "10.244.1.0/24",
                    "podCIDRs": ["10.244.1.0/24"],
                    "taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]
                },
                "status": {
                    "capacity": {"cpu": "2"},
                    "conditions": [{"type": "Ready", "status": "True"}],
                    "addresses": [{"type": "InternalIP", "address": "198.18.0.11"}],
                    "nodeInfo": {"kubeletVersion": "v1.34.0"}
                }
            })
        );

        let cidr = networking::ServiceCIDR {
            metadata: Some(meta::ObjectMeta {
                name: Some("extra".into()),
                ..Default::default()
            }),
            spec: Some(networking::ServiceCIDRSpec {
                cidrs: vec!["10.97.0.0/16".into(), "fd00:97::/108".into()],
            }),
            status: None,
        };
        let body = wire("networking.k8s.io/v1", "ServiceCIDR", cidr.encode_to_vec());
        assert_eq!(
            decode(SERVICE_CIDRS, &body).unwrap(),
            json!({
                "apiVersion": "networking.k8s.io/v1",
                "kind": "ServiceCIDR",
                "metadata": {"name": "extra"},
                "spec": {"cidrs": ["10.97.0.0/16", "fd00:97::/108"]}
            })
        );

        let lease = coordination::Lease {
            metadata: Some(meta::ObjectMeta {
                name: Some("node-1".into()),
                namespace: Some("kube-node-lease".into()),
                ..Default::default()
            }),
            spec: Some(coordination::LeaseSpec {
                holder_identity: Some("node-1".into()),
                lease_duration_seconds: Some(40),
                renew_time: Some(meta::MicroTime {
                    seconds: Some(1),
                    nanos: Some(500_000_000),
                }),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        let body = wire("coordination.k8s.io/v1", "Lease", lease.encode_to_vec());
        assert_eq!(
            decode(LEASES, &body).unwrap()["spec"],
            json!({
                "holderIdentity": "node-1",
                "leaseDurationSeconds": 40,
                "renewTime": "1970-01-01T00:00:01.500000Z",
                "leaseTransitions": 0
            })
        );
    }

    #[test]
    fn endpoint_slice_and_event_bodies_decode_to_the_json_form() {
        let slice = discovery::EndpointSlice {
            metadata: Some(meta::ObjectMeta {
                name: Some("web-1".into()),
                ..Default::default()
            }),
            address_type: Some("IPv4".into()),
            endpoints: vec![discovery::Endpoint {
                addresses: vec!["10.244.1.2".into()],
                conditions: Some(discovery::EndpointConditions {
                    ready: Some(false),
                    serving: Some(true),
                    terminating: None,
                }),
                node_name: Some("node-1".into()),
                ..Default::default()
            }],
            ports: vec![discovery::EndpointPort {
                name: Some(String::new()),
                protocol: Some("TCP".into()),
                port: Some(8080),
                app_protocol: None,
            }],
        };
        let body = wire(
            "discovery.k8s.io/v1",
            "EndpointSlice",
            slice.encode_to_vec(),
        );
        let decoded = decode(ENDPOINT_SLICES, &body).unwrap();
        assert_eq!(decoded["addressType"], "IPv4");
        assert_eq!(
            decoded["endpoints"],
            json!([{"addresses": ["10.244.1.2"], "conditions": {"ready": false, "serving": true}, "nodeName": "node-1"}])
        );
        assert_eq!(
            decoded["ports"],
            json!([{"name": "", "protocol": "TCP", "port": 8080}])
        );

        let regarding = core::ObjectReference {
            kind: Some("Service".into()),
            namespace: Some("default".into()),
            name: Some("web".into()),
            ..Default::default()
        };
        let core_event = core::Event {
            metadata: Some(meta::ObjectMeta {
                name: Some("web.1".into()),
                ..Default::default()
            }),
            involved_object: Some(regarding.clone()),
            reason: Some("EnsuredLoadBalancer".into()),
            count: Some(1),
            r#type: Some("Normal".into()),
            ..Default::default()
        };
        let body = wire("v1", "Event", core_event.encode_to_vec());
        let decoded = decode(EVENTS, &body).unwrap();
        assert_eq!(
            (
                &decoded["involvedObject"]["name"],
                &decoded["reason"],
                &decoded["count"]
            ),
            (&json!("web"), &json!("EnsuredLoadBalancer"), &json!(1))
        );
        let event = events::Event {
            metadata: core_event.metadata,
            event_time: Some(meta::MicroTime {
                seconds: Some(0),
                nanos: Some(1000),
            }),
            regarding: Some(regarding),
            reason: Some("EnsuredLoadBalancer".into()),
            note: Some("Ensured load balancer".into()),
            ..Default::default()
        };
        let body = wire("events.k8s.io/v1", "Event", event.encode_to_vec());
        let decoded = decode(EVENTS_V1, &body).unwrap();
        assert_eq!(decoded["eventTime"], "1970-01-01T00:00:00.000001Z");
        assert_eq!(decoded["regarding"]["kind"], "Service");
        assert_eq!(decoded["note"], "Ensured load balancer");
        assert!(matches!(
            decode(EVENTS_V1, &wire("v1", "Event", vec![])),
            Err(DecodeError::KindMismatch { .. })
        ));
    }

    #[test]
    fn bad_bodies_are_errors() {
        let raw = service().encode_to_vec();
        assert!(matches!(decode(SERVICES, &raw), Err(DecodeError::Magic)));
        assert!(matches!(
            decode(SERVICES, b"k8s\0\xff\xff"),
            Err(DecodeError::Envelope(_))
        ));
        assert!(matches!(
            decode(NAMESPACES, &wire("v1", "Service", raw.clone())),
            Err(DecodeError::KindMismatch { .. })
        ));
        assert!(matches!(
            decode(SERVICES, &wire("v1", "Pod", raw.clone())),
            Err(DecodeError::KindMismatch { .. })
        ));
        assert!(matches!(
            decode(SERVICES, &wire("v1", "Service", vec![0xff, 0xff])),
            Err(DecodeError::Object { .. })
        ));
    }

    #[test]
    fn content_types_are_recognised() {
        assert!(is_protobuf("application/vnd.kubernetes.protobuf"));
        assert!(is_protobuf(
            "application/vnd.kubernetes.protobuf; charset=x"
        ));
        assert!(!is_protobuf("application/json"));
        assert!(!is_protobuf("application/cbor"));
    }
}
