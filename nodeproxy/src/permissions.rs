//! What the node proxy asks of the Kubernetes API, read-only: the chart's ClusterRole
//! grants exactly this, and the real-node test checks the API server's answer for the
//! ServiceAccount against it. A new call adds its verb here and in
//! `charts/tandem/templates/nodeproxy-rbac.yaml`.

use tandem_common::permissions::{Permission, Scope};

pub const PERMISSIONS: &[Permission] = &[
    // The watches the rules are made from.
    Permission {
        api_group: "",
        resource: "services",
        verbs: &["list", "watch"],
        scope: Scope::Cluster,
    },
    Permission {
        api_group: "discovery.k8s.io",
        resource: "endpointslices",
        verbs: &["list", "watch"],
        scope: Scope::Cluster,
    },
    // Its own Node: read once at the start (its addresses, get), then watched (its
    // labels and taints; list and watch carry a field selector, which RBAC does not see).
    Permission {
        api_group: "",
        resource: "nodes",
        verbs: &["get", "list", "watch"],
        scope: Scope::Cluster,
    },
    // The Service CIDRs of the nftables mode's cluster-IP check (Kubernetes 1.33 and
    // later; a grant for a resource an older server does not serve grants nothing).
    Permission {
        api_group: "networking.k8s.io",
        resource: "servicecidrs",
        verbs: &["list", "watch"],
        scope: Scope::Cluster,
    },
];
