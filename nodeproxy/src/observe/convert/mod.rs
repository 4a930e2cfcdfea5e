//! Kubernetes objects → [`ProxyState`]: pure conversion, no I/O.
//!
//! One IP family at a time, as kube-proxy's proxier per family sees the cluster: a Service
//! has rules in a family only with a cluster IP of it, and brings along only its external
//! IPs, LB ingress IPs and source ranges of that family (the [`ProxyState`] of the family
//! drops the others); an EndpointSlice counts only in the family of its `addressType`.
//! Values of the other family are the other proxier's, not errors.
//!
//! Bad values (an unparsable CIDR, a port out of range) never abort the conversion: the
//! offending value is left out and reported as a [`Skipped`] entry, so one bad Service
//! never breaks the rules of the others.
//!
//! Each object has a file of its own, as kube-proxy has `serviceport.go` and
//! `endpointslicecache.go`: Services (`service`), EndpointSlices (`endpointslice`), this
//! node's Node (`node`), ServiceCIDRs (`servicecidr`), and the state of a family that
//! joins the first two (`state`). This file holds what they share.
//!
//! [`ProxyState`]: tandem_proxy_rules::model::ProxyState

mod endpointslice;
#[cfg(test)]
mod fixtures;
mod node;
mod service;
mod servicecidr;
mod state;

pub use endpointslice::{
    SERVICE_NAME_LABEL, SliceEntry, join_endpoints, port_endpoints, slice_selector,
};
pub use node::{
    NodeFacts, SyncedNodeFields, ZONE_LABEL, node_addresses, node_pod_cidr, node_primary_ip,
    node_zone,
};
pub use service::{
    DEFAULT_AFFINITY_TIMEOUT_SECONDS, HEADLESS_LABEL, SERVICE_PROXY_NAME_LABEL, ServiceEntry,
    service_selector,
};
pub use servicecidr::service_cidrs;
pub use state::{Conversion, join, proxy_state};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// A value left out of the state, with where it came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Skipped {
    #[error("Service {service}: {field} value {value:?} ignored: {reason}")]
    ServiceValue {
        service: String,
        field: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("EndpointSlice {slice}: {field} value {value:?} ignored: {reason}")]
    SliceValue {
        slice: String,
        field: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("ServiceCIDR {service_cidr}: spec.cidrs value {value:?} ignored: not a CIDR")]
    ServiceCidrValue { service_cidr: String, value: String },
}

/// `(namespace, name)` of a watched object.
pub type ObjectKey = (String, String);

/// The [`ObjectKey`] of an object from its metadata.
pub(crate) fn object_key(meta: &ObjectMeta) -> ObjectKey {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

fn positive_port(value: i32) -> Option<u16> {
    u16::try_from(value).ok().filter(|port| *port > 0)
}
