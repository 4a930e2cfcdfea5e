//! What the controller (and its uninstall hook, `release`) asks of the Kubernetes API: the
//! chart's ClusterRole and leader-election Role grant exactly this, and the real-node test
//! checks the API server's answer for the ServiceAccount against it. A new call adds its
//! verb here and in `charts/tandem/templates/controller-rbac.yaml`.

use tandem_common::permissions::{Permission, Scope};

pub const PERMISSIONS: &[Permission] = &[
    // The watch of every Service (list, watch); the finalizer and the LB id annotation
    // (patch); the uninstall hook lists them and reads one again before it lets go (get).
    Permission {
        api_group: "",
        resource: "services",
        verbs: &["get", "list", "watch", "patch"],
        scope: Scope::Cluster,
    },
    // Ingress and conditions, as a strategic-merge patch of the status.
    Permission {
        api_group: "",
        resource: "services/status",
        verbs: &["patch"],
        scope: Scope::Cluster,
    },
    // The backends of every load balancer.
    Permission {
        api_group: "",
        resource: "nodes",
        verbs: &["list", "watch"],
        scope: Scope::Cluster,
    },
    // The address pool a Namespace names (list, watch); the UID of `kube-system`, which
    // tells this cluster from another of the same id (get).
    Permission {
        api_group: "",
        resource: "namespaces",
        verbs: &["get", "list", "watch"],
        scope: Scope::Cluster,
    },
    // kube-runtime's event Recorder writes events.k8s.io/v1 Events only.
    Permission {
        api_group: "events.k8s.io",
        resource: "events",
        verbs: &["create", "patch"],
        scope: Scope::Cluster,
    },
    // Leader election (kube-lease-manager: get, create, patch; the lapse check: get) and
    // the uninstall hook, which deletes the Lease.
    Permission {
        api_group: "coordination.k8s.io",
        resource: "leases",
        verbs: &["get", "create", "patch", "delete"],
        scope: Scope::ReleaseNamespace,
    },
];
