//! Discovery documents: `/version`, `/api`, `/apis`, and the per-group-version resource lists
//! that kube-rs and kubectl read before they talk to a resource.

use serde_json::{Value, json};

use crate::resources::{self, ResourceType};

/// The Kubernetes version the stand-in speaks (that of the workspace's k8s-openapi feature).
pub const KUBERNETES_MINOR: u32 = 34;

pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": KUBERNETES_MINOR.to_string(),
        "gitVersion": format!("v1.{KUBERNETES_MINOR}.0-tandem"),
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": format!("{}/{}", std::env::consts::OS, if std::env::consts::ARCH == "x86_64" { "amd64" } else { std::env::consts::ARCH }),
    })
}

/// `/api`: the core group's versions.
pub fn core_versions(server_address: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    })
}

fn group(name: &str) -> Value {
    let gv =
        |version: &str| json!({"groupVersion": format!("{name}/{version}"), "version": version});
    let mut versions: Vec<&str> = resources::ALL
        .iter()
        .filter(|rt| rt.group == name)
        .map(|rt| rt.version)
        .collect();
    versions.dedup();
    json!({
        "name": name,
        "versions": versions.into_iter().map(gv).collect::<Vec<_>>(),
        "preferredVersion": gv("v1"),
    })
}

/// `/apis/{group}`, if served.
pub fn api_group(name: &str) -> Option<Value> {
    resources::GROUPS.contains(&name).then(|| {
        let mut g = group(name);
        if let Some(map) = g.as_object_mut() {
            map.insert("kind".into(), json!("APIGroup"));
            map.insert("apiVersion".into(), json!("v1"));
        }
        g
    })
}

/// `/apis`: every non-core group.
pub fn group_list() -> Value {
    json!({
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": resources::GROUPS.iter().map(|g| group(g)).collect::<Vec<_>>(),
    })
}

const VERBS: [&str; 8] = [
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];

fn resource_entry(rt: &ResourceType) -> Value {
    json!({
        "name": rt.plural,
        "singularName": rt.singular,
        "namespaced": rt.namespaced,
        "kind": rt.kind,
        "verbs": VERBS,
        "shortNames": rt.short_names,
        "categories": rt.categories,
    })
}

/// `/api/v1` or `/apis/{group}/{version}`, if served.
pub fn resource_list(group: &str, version: &str) -> Option<Value> {
    let mut entries = Vec::new();
    for rt in resources::in_group_version(group, version) {
        entries.push(resource_entry(rt));
        if rt.has_status {
            entries.push(json!({
                "name": format!("{}/status", rt.plural),
                "singularName": "",
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    let group_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    (!entries.is_empty()).then(|| {
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": entries})
    })
}

fn gv_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

/// `/openapi/v3`: one document per served group version.
pub fn openapi_v3_root() -> Value {
    let mut paths = serde_json::Map::new();
    let mut gvs: Vec<(&str, &str)> = resources::ALL
        .iter()
        .map(|rt| (rt.group, rt.version))
        .collect();
    gvs.dedup();
    for (group, version) in gvs {
        let path = gv_path(group, version);
        paths.insert(
            path.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{path}?hash=tandem")}),
        );
    }
    json!({"paths": paths})
}

/// `/openapi/v3/api/v1` and friends: only the operations and their `fieldValidation`
/// parameter, which is what kubectl checks before it leaves validation to the server (it
/// then sends `fieldValidation=Strict` and needs no schemas).
pub fn openapi_v3_group_version(path: &str) -> Option<Value> {
    let mut paths = serde_json::Map::new();
    for rt in resources::ALL
        .iter()
        .filter(|rt| gv_path(rt.group, rt.version) == path)
    {
        let gvk = json!({"group": rt.group, "version": rt.version, "kind": rt.kind});
        let operation = json!({
            "x-kubernetes-group-version-kind": gvk,
            "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": true}}],
            "responses": {"200": {"description": "OK"}},
        });
        let prefix = format!("/{path}");
        let (collection, item) = if rt.namespaced {
            (
                format!("{prefix}/namespaces/{{namespace}}/{}", rt.plural),
                format!("{prefix}/namespaces/{{namespace}}/{}/{{name}}", rt.plural),
            )
        } else {
            (
                format!("{prefix}/{}", rt.plural),
                format!("{prefix}/{}/{{name}}", rt.plural),
            )
        };
        paths.insert(collection, json!({"post": operation}));
        paths.insert(item, json!({"put": operation, "patch": operation}));
    }
    (!paths.is_empty()).then(|| {
        json!({"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": format!("v1.{KUBERNETES_MINOR}.0")}, "paths": paths})
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openapi_v3_advertises_field_validation_per_kind() {
        let root = openapi_v3_root();
        assert_eq!(
            root["paths"]["api/v1"]["serverRelativeURL"],
            "/openapi/v3/api/v1?hash=tandem"
        );
        assert!(root["paths"]["apis/coordination.k8s.io/v1"].is_object());
        let core = openapi_v3_group_version("api/v1").unwrap();
        let patch = &core["paths"]["/api/v1/namespaces/{namespace}/services/{name}"]["patch"];
        assert_eq!(patch["x-kubernetes-group-version-kind"]["kind"], "Service");
        assert_eq!(patch["parameters"][0]["name"], "fieldValidation");
        assert!(openapi_v3_group_version("apis/apps/v1").is_none());
    }

    #[test]
    fn core_list_has_services_with_status_and_short_names() {
        let list = resource_list("", "v1").unwrap();
        let names: Vec<&str> = list["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "namespaces",
                "services",
                "services/status",
                "nodes",
                "nodes/status",
                "events"
            ]
        );
        assert_eq!(list["resources"][1]["shortNames"], json!(["svc"]));
        assert!(resource_list("apps", "v1").is_none());
        assert_eq!(
            resource_list("coordination.k8s.io", "v1").unwrap()["groupVersion"],
            "coordination.k8s.io/v1"
        );
    }

    #[test]
    fn groups_are_listed_and_found() {
        assert_eq!(group_list()["groups"].as_array().unwrap().len(), 4);
        assert_eq!(
            api_group("events.k8s.io").unwrap()["preferredVersion"]["groupVersion"],
            "events.k8s.io/v1"
        );
        assert!(api_group("apps").is_none());
    }

    #[test]
    fn networking_serves_cluster_scoped_service_cidrs_with_status() {
        let list = resource_list("networking.k8s.io", "v1").unwrap();
        let resources = list["resources"].as_array().unwrap();
        let names: Vec<&str> = resources
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["servicecidrs", "servicecidrs/status"]);
        assert_eq!(resources[0]["kind"], "ServiceCIDR");
        assert_eq!(resources[0]["namespaced"], false);
        assert!(api_group("networking.k8s.io").is_some());
    }
}
