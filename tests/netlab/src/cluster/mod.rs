//! The cluster side of the lab against any Kubernetes API server (real or stand-in): a
//! node agent that registers Nodes and keeps them Ready like a kubelet, and EndpointSlices
//! for selectorless Services. Only plain API semantics are used (get, create, replace,
//! merge patch), so nothing depends on the stand-in.

mod endpoints;
mod node_agent;

pub use endpoints::{
    ENDPOINT_SLICE_MANAGER, Endpoint, EndpointSliceWriter, MAX_ENDPOINTS_PER_SLICE,
    endpoint_slice_for, slice_name_for,
};
pub use node_agent::{
    LabNode, NODE_LEASE_NAMESPACE, NodeAgent, NodeAgentConfig, lease_for, node_object,
    node_status_patch, ready_condition, ready_transition_time,
};

/// Label value (`app.kubernetes.io/managed-by`, EndpointSlice `managed-by`) marking what
/// the lab wrote.
pub const MANAGED_BY: &str = "tandem-lab";

/// Errors of the node agent and the EndpointSlice writer.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("{action} {kind} {name}: {source}")]
    Api {
        action: &'static str,
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("the Service has no metadata.{0}")]
    ServiceWithout(&'static str),
    #[error(
        "Service port {port} has the named targetPort {target:?}; a selectorless Service needs numeric \
         target ports"
    )]
    NamedTargetPort { port: i32, target: String },
    #[error("endpoint {ip} does not belong in an EndpointSlice of addressType {address_type}")]
    EndpointOfOtherFamily {
        ip: std::net::IpAddr,
        address_type: &'static str,
    },
    #[error("{count} endpoints exceed the {max} one EndpointSlice may hold", max = MAX_ENDPOINTS_PER_SLICE)]
    TooManyEndpoints { count: usize },
    #[error("Node {0} is still being deleted after {1:?} (a finalizer no one removes?)")]
    NodeNotGone(String, std::time::Duration),
}

impl ClusterError {
    fn api(
        action: &'static str,
        kind: &'static str,
        name: &str,
    ) -> impl FnOnce(kube::Error) -> Self {
        let name = name.to_owned();
        move |source| Self::Api {
            action,
            kind,
            name,
            source,
        }
    }
}

/// Whether a kube error is the API server's 404 / 409.
fn is_status(err: &kube::Error, code: u16) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == code)
}
