//! What a component asks of the Kubernetes API, verb by verb: the RBAC its ServiceAccount
//! needs and no more. Each binary's library keeps its list beside the code that makes the
//! calls; the chart grants exactly that, and the real-node test asks the API server what
//! each ServiceAccount may do and compares the answer with the list.

/// Where a grant holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every namespace (a ClusterRole).
    Cluster,
    /// The release's namespace only (a Role there).
    ReleaseNamespace,
}

/// Verbs on one resource (or subresource, as `services/status`) of one API group (`""`
/// is the core group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permission {
    pub api_group: &'static str,
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
    pub scope: Scope,
}

impl Permission {
    /// The resource as RBAC reviews name it: `resource.group`, or `resource` in the core
    /// group (`leases.coordination.k8s.io`, `services/status`).
    pub fn qualified_resource(&self) -> String {
        if self.api_group.is_empty() {
            self.resource.to_owned()
        } else {
            let (resource, subresource) = match self.resource.split_once('/') {
                Some((resource, sub)) => (resource, Some(sub)),
                None => (self.resource, None),
            };
            match subresource {
                Some(sub) => format!("{resource}.{}/{sub}", self.api_group),
                None => format!("{resource}.{}", self.api_group),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_are_named_as_rbac_reviews_name_them() {
        let permission = |api_group, resource| Permission {
            api_group,
            resource,
            verbs: &["get"],
            scope: Scope::Cluster,
        };
        assert_eq!(
            permission("", "services/status").qualified_resource(),
            "services/status"
        );
        assert_eq!(
            permission("coordination.k8s.io", "leases").qualified_resource(),
            "leases.coordination.k8s.io"
        );
        assert_eq!(
            permission("apps", "deployments/scale").qualified_resource(),
            "deployments.apps/scale"
        );
    }
}
