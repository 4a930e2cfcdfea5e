//! The typed registry of served resources: what discovery advertises and how the store,
//! the patcher and the printer treat each kind.

/// How strategic merge treats a list field ([`crate::patch`] applies it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListStrategy {
    /// The patch list replaces the original (lists without `patchStrategy`).
    Replace,
    /// Objects are matched by the merge key and merged; `$patch: delete` removes one.
    MergeByKey(&'static str),
    /// A set of scalars: the patch adds missing values (`metadata.finalizers`).
    MergePrimitives,
}

/// Where objects live. Two API resources may share one storage (the two Event views).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Storage {
    Namespaces,
    Services,
    Nodes,
    EndpointSlices,
    Events,
    Leases,
    ServiceCidrs,
}

impl Storage {
    pub const ALL: [Storage; 7] = [
        Storage::Namespaces,
        Storage::Services,
        Storage::Nodes,
        Storage::EndpointSlices,
        Storage::Events,
        Storage::Leases,
        Storage::ServiceCidrs,
    ];
}

/// How an API resource presents its storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// Objects are served as stored.
    Native,
    /// `events.k8s.io/v1` view of core/v1 Events.
    EventsV1,
    /// `discovery.k8s.io/v1beta1` view of v1 EndpointSlices.
    EndpointSlicesV1beta1,
}

#[derive(Debug, PartialEq, Eq)]
pub struct ResourceType {
    /// API group; empty for the core group.
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub singular: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    /// Served with a `/status` subresource: main writes keep status, status writes keep the rest.
    pub has_status: bool,
    /// `metadata.generation` is kept and bumped on spec changes.
    pub has_generation: bool,
    pub short_names: &'static [&'static str],
    pub categories: &'static [&'static str],
    pub storage: Storage,
    pub view: View,
    /// Strategic-merge list strategies by dotted path (all other lists are replaced).
    pub merge_lists: &'static [(&'static str, ListStrategy)],
}

const COMMON_LISTS: [(&str, ListStrategy); 2] = [
    ("metadata.finalizers", ListStrategy::MergePrimitives),
    ("metadata.ownerReferences", ListStrategy::MergeByKey("uid")),
];

pub static NAMESPACES: &ResourceType = &ResourceType {
    group: "",
    version: "v1",
    plural: "namespaces",
    singular: "namespace",
    kind: "Namespace",
    namespaced: false,
    has_status: false,
    has_generation: false,
    short_names: &["ns"],
    categories: &[],
    storage: Storage::Namespaces,
    view: View::Native,
    merge_lists: &[
        COMMON_LISTS[0],
        COMMON_LISTS[1],
        ("status.conditions", ListStrategy::MergeByKey("type")),
    ],
};

pub static SERVICES: &ResourceType = &ResourceType {
    group: "",
    version: "v1",
    plural: "services",
    singular: "service",
    kind: "Service",
    namespaced: true,
    has_status: true,
    has_generation: true,
    short_names: &["svc"],
    categories: &["all"],
    storage: Storage::Services,
    view: View::Native,
    merge_lists: &[
        COMMON_LISTS[0],
        COMMON_LISTS[1],
        ("spec.ports", ListStrategy::MergeByKey("port")),
        // `+listType=atomic` upstream: a patch replaces the whole list.
        ("status.loadBalancer.ingress", ListStrategy::Replace),
        ("status.conditions", ListStrategy::MergeByKey("type")),
    ],
};

pub static NODES: &ResourceType = &ResourceType {
    group: "",
    version: "v1",
    plural: "nodes",
    singular: "node",
    kind: "Node",
    namespaced: false,
    has_status: true,
    has_generation: true,
    short_names: &["no"],
    categories: &[],
    storage: Storage::Nodes,
    view: View::Native,
    merge_lists: &[
        COMMON_LISTS[0],
        COMMON_LISTS[1],
        ("status.conditions", ListStrategy::MergeByKey("type")),
        ("status.addresses", ListStrategy::MergeByKey("type")),
    ],
};

pub static ENDPOINT_SLICES: &ResourceType = &ResourceType {
    group: "discovery.k8s.io",
    version: "v1",
    plural: "endpointslices",
    singular: "endpointslice",
    kind: "EndpointSlice",
    namespaced: true,
    has_status: false,
    has_generation: false,
    short_names: &[],
    categories: &[],
    storage: Storage::EndpointSlices,
    view: View::Native,
    merge_lists: &[COMMON_LISTS[0], COMMON_LISTS[1]],
};

/// The v1beta1 view of the same EndpointSlices, for clients as old as kube-proxy v1.21
/// (served by Kubernetes until 1.25).
pub static ENDPOINT_SLICES_V1BETA1: &ResourceType = &ResourceType {
    version: "v1beta1",
    view: View::EndpointSlicesV1beta1,
    ..*ENDPOINT_SLICES
};

pub static EVENTS: &ResourceType = &ResourceType {
    group: "",
    version: "v1",
    plural: "events",
    singular: "event",
    kind: "Event",
    namespaced: true,
    has_status: false,
    has_generation: false,
    short_names: &["ev"],
    categories: &[],
    storage: Storage::Events,
    view: View::Native,
    merge_lists: &[COMMON_LISTS[0], COMMON_LISTS[1]],
};

pub static EVENTS_V1: &ResourceType = &ResourceType {
    group: "events.k8s.io",
    version: "v1",
    plural: "events",
    singular: "event",
    kind: "Event",
    namespaced: true,
    has_status: false,
    has_generation: false,
    // "ev" stays with core/v1 events, so kubectl resolves it without a warning.
    short_names: &[],
    categories: &[],
    storage: Storage::Events,
    view: View::EventsV1,
    merge_lists: &[COMMON_LISTS[0], COMMON_LISTS[1]],
};

pub static LEASES: &ResourceType = &ResourceType {
    group: "coordination.k8s.io",
    version: "v1",
    plural: "leases",
    singular: "lease",
    kind: "Lease",
    namespaced: true,
    has_status: false,
    has_generation: false,
    short_names: &[],
    categories: &[],
    storage: Storage::Leases,
    view: View::Native,
    merge_lists: &[COMMON_LISTS[0], COMMON_LISTS[1]],
};

/// `networking.k8s.io/v1` ServiceCIDRs (GA in 1.33): the ranges cluster IPs come from,
/// which node proxies follow. Cluster-scoped; `spec.cidrs` is immutable.
pub static SERVICE_CIDRS: &ResourceType = &ResourceType {
    group: "networking.k8s.io",
    version: "v1",
    plural: "servicecidrs",
    singular: "servicecidr",
    kind: "ServiceCIDR",
    namespaced: false,
    has_status: true,
    has_generation: false,
    short_names: &[],
    categories: &[],
    storage: Storage::ServiceCidrs,
    view: View::Native,
    merge_lists: &[
        COMMON_LISTS[0],
        COMMON_LISTS[1],
        ("status.conditions", ListStrategy::MergeByKey("type")),
    ],
};

/// Every served resource, in discovery order.
pub static ALL: [&ResourceType; 9] = [
    NAMESPACES,
    SERVICES,
    NODES,
    EVENTS,
    ENDPOINT_SLICES,
    ENDPOINT_SLICES_V1BETA1,
    EVENTS_V1,
    LEASES,
    SERVICE_CIDRS,
];

/// Served API groups (core excluded), in discovery order; each prefers v1.
pub static GROUPS: [&str; 4] = [
    "discovery.k8s.io",
    "events.k8s.io",
    "coordination.k8s.io",
    "networking.k8s.io",
];

/// The resource served at `group/version/plural`.
pub fn find(group: &str, version: &str, plural: &str) -> Option<&'static ResourceType> {
    ALL.iter()
        .copied()
        .find(|rt| rt.group == group && rt.version == version && rt.plural == plural)
}

/// The resources of one group version.
pub fn in_group_version(group: &str, version: &str) -> impl Iterator<Item = &'static ResourceType> {
    ALL.iter()
        .copied()
        .filter(move |rt| rt.group == group && rt.version == version)
}

impl ResourceType {
    /// `v1` or `group/v1`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `services` or `leases.coordination.k8s.io`, as error messages name resources.
    pub fn group_resource(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// The strategic-merge strategy of the list at a dotted path.
    pub fn list_strategy(&self, path: &str) -> ListStrategy {
        self.merge_lists
            .iter()
            .find(|(p, _)| *p == path)
            .map_or(ListStrategy::Replace, |(_, strategy)| *strategy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_resources_by_group_version_plural() {
        assert_eq!(find("", "v1", "services"), Some(SERVICES));
        assert_eq!(find("events.k8s.io", "v1", "events"), Some(EVENTS_V1));
        assert_eq!(find("", "v1", "pods"), None);
        assert_eq!(LEASES.api_version(), "coordination.k8s.io/v1");
        assert_eq!(
            find("networking.k8s.io", "v1", "servicecidrs"),
            Some(SERVICE_CIDRS)
        );
        assert_eq!(
            SERVICE_CIDRS.group_resource(),
            "servicecidrs.networking.k8s.io"
        );
        assert_eq!(
            SERVICES.list_strategy("spec.ports"),
            ListStrategy::MergeByKey("port")
        );
        assert_eq!(
            ENDPOINT_SLICES.list_strategy("endpoints"),
            ListStrategy::Replace
        );
    }

    #[test]
    fn every_group_has_resources() {
        for group in GROUPS {
            assert!(in_group_version(group, "v1").count() > 0, "{group}");
        }
    }
}
