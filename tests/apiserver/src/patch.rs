//! The four patch flavours the API server accepts, applied to JSON objects.

use serde_json::{Map, Value};

use crate::resources::{ListStrategy, ResourceType};

/// The patch flavour, from the request's `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    Merge,
    Json,
    Strategic,
    /// Server-side apply, served simply: create when missing, else a strategic merge.
    Apply,
}

impl PatchType {
    pub fn from_content_type(content_type: &str) -> Option<Self> {
        let media = content_type.split(';').next().unwrap_or_default().trim();
        match media {
            "application/merge-patch+json" => Some(Self::Merge),
            "application/json-patch+json" => Some(Self::Json),
            "application/strategic-merge-patch+json" => Some(Self::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+json" => Some(Self::Apply),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PatchError {
    /// The patch document itself is malformed (400).
    #[error("invalid patch document: {0}")]
    Malformed(String),
    /// The patch is well formed but cannot be applied, e.g. a failed `test` (422).
    #[error("the patch could not be applied: {0}")]
    NotApplicable(String),
}

/// Applies a patch body to `original`, returning the patched object.
pub fn apply(
    original: &Value,
    patch_type: PatchType,
    body: &[u8],
    rt: &ResourceType,
) -> Result<Value, PatchError> {
    match patch_type {
        PatchType::Json => {
            let ops: json_patch::Patch =
                serde_json::from_slice(body).map_err(|e| PatchError::Malformed(e.to_string()))?;
            let mut doc = original.clone();
            for op in &ops.0 {
                if tests_missing_as_null(&doc, op) {
                    continue;
                }
                json_patch::patch(&mut doc, std::slice::from_ref(op))
                    .map_err(|e| PatchError::NotApplicable(e.to_string()))?;
            }
            Ok(doc)
        }
        PatchType::Merge => {
            let patch = parse_object(body)?;
            let mut doc = original.clone();
            json_patch::merge(&mut doc, &patch);
            Ok(doc)
        }
        PatchType::Strategic | PatchType::Apply => {
            let patch = parse_object(body)?;
            strategic_merge(original, &patch, rt)
        }
    }
}

/// The API server's JSON patch library treats a missing member as `null` in `test`
/// (kube-runtime's `finalizer()` relies on it: `test /metadata/finalizers == null`);
/// json-patch calls that an invalid pointer. True when such a test should pass.
fn tests_missing_as_null(doc: &Value, op: &json_patch::PatchOperation) -> bool {
    let json_patch::PatchOperation::Test(test) = op else {
        return false;
    };
    let path = test.path.as_str();
    let parent = path.rsplit_once('/').map_or("", |(parent, _)| parent);
    test.value.is_null()
        && doc.pointer(path).is_none()
        && doc.pointer(parent).is_some_and(Value::is_object)
}

fn parse_object(body: &[u8]) -> Result<Value, PatchError> {
    let patch: Value =
        serde_json::from_slice(body).map_err(|e| PatchError::Malformed(e.to_string()))?;
    if patch.is_object() {
        Ok(patch)
    } else {
        Err(PatchError::Malformed(
            "the patch must be a JSON object".to_string(),
        ))
    }
}

/// Strategic merge patch with the list strategies of `rt`.
pub fn strategic_merge(
    original: &Value,
    patch: &Value,
    rt: &ResourceType,
) -> Result<Value, PatchError> {
    let (Some(original), Some(patch)) = (original.as_object(), patch.as_object()) else {
        return Err(PatchError::Malformed(
            "strategic merge patches objects only".to_string(),
        ));
    };
    let mut merged = original.clone();
    merge_map(&mut merged, patch, "", rt)?;
    Ok(Value::Object(merged))
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

fn merge_map(
    original: &mut Map<String, Value>,
    patch: &Map<String, Value>,
    path: &str,
    rt: &ResourceType,
) -> Result<(), PatchError> {
    match patch.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            *original = without_directives(patch);
            return Ok(());
        }
        Some("delete") => {
            original.clear();
            return Ok(());
        }
        Some("merge") | None => {}
        Some(other) => {
            return Err(PatchError::Malformed(format!(
                "unknown patch directive {other:?}"
            )));
        }
    }
    if let Some(retain) = patch.get("$retainKeys") {
        let keep: Vec<&str> = retain
            .as_array()
            .ok_or_else(|| PatchError::Malformed("$retainKeys must be a list".to_string()))?
            .iter()
            .filter_map(Value::as_str)
            .collect();
        original.retain(|k, _| keep.contains(&k.as_str()));
    }
    for (key, value) in patch {
        if let Some(field) = key.strip_prefix("$deleteFromPrimitiveList/") {
            let remove = value.as_array().cloned().unwrap_or_default();
            if let Some(Value::Array(list)) = original.get_mut(field) {
                list.retain(|v| !remove.contains(v));
            }
            continue;
        }
        if key.starts_with('$') {
            continue;
        }
        let field_path = join(path, key);
        match (original.get_mut(key), value) {
            (_, Value::Null) => {
                original.remove(key);
            }
            (Some(Value::Object(orig)), Value::Object(p)) => {
                if p.get("$patch").and_then(Value::as_str) == Some("delete") {
                    original.remove(key);
                } else {
                    merge_map(orig, p, &field_path, rt)?;
                }
            }
            (Some(Value::Array(orig)), Value::Array(p)) => {
                merge_list(orig, p, &field_path, rt)?;
            }
            (_, v) => {
                original.insert(key.clone(), strip(v));
            }
        }
    }
    Ok(())
}

fn merge_list(
    original: &mut Vec<Value>,
    patch: &[Value],
    path: &str,
    rt: &ResourceType,
) -> Result<(), PatchError> {
    match rt.list_strategy(path) {
        ListStrategy::Replace => {
            *original = patch.iter().map(strip).collect();
        }
        ListStrategy::MergePrimitives => {
            for value in patch {
                if !original.contains(value) {
                    original.push(value.clone());
                }
            }
        }
        ListStrategy::MergeByKey(key) => {
            if patch
                .iter()
                .any(|p| p.get("$patch").and_then(Value::as_str) == Some("replace"))
            {
                *original = patch
                    .iter()
                    .filter(|p| p.get("$patch").is_none())
                    .map(strip)
                    .collect();
                return Ok(());
            }
            for item in patch {
                let Some(item_map) = item.as_object() else {
                    return Err(PatchError::Malformed(format!(
                        "{path}: list items must be objects"
                    )));
                };
                let Some(item_key) = item_map.get(key) else {
                    return Err(PatchError::Malformed(format!(
                        "{path}: item has no merge key {key:?}"
                    )));
                };
                let position = original.iter().position(|o| o.get(key) == Some(item_key));
                let delete = item_map.get("$patch").and_then(Value::as_str) == Some("delete");
                match (position, delete) {
                    (Some(i), true) => {
                        original.remove(i);
                    }
                    (None, true) => {}
                    (Some(i), false) => {
                        if let Some(Value::Object(orig)) = original.get_mut(i) {
                            merge_map(orig, item_map, path, rt)?;
                        }
                    }
                    (None, false) => original.push(strip(item)),
                }
            }
        }
    }
    Ok(())
}

fn without_directives(map: &Map<String, Value>) -> Map<String, Value> {
    map.iter()
        .filter(|(k, _)| !k.starts_with('$'))
        .map(|(k, v)| (k.clone(), strip(v)))
        .collect()
}

/// A patch value with directives removed and nulls dropped from maps (nothing to delete in
/// a new value).
fn strip(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, v)| !k.starts_with('$') && !v.is_null())
                .map(|(k, v)| (k.clone(), strip(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(strip).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{ENDPOINT_SLICES, NODES, SERVICES};
    use serde_json::json;

    fn smp(original: Value, patch: Value, rt: &ResourceType) -> Value {
        apply(
            &original,
            PatchType::Strategic,
            patch.to_string().as_bytes(),
            rt,
        )
        .unwrap()
    }

    #[test]
    fn service_ports_merge_by_port() {
        let svc = json!({"spec": {"ports": [{"port": 80, "protocol": "TCP", "nodePort": 30001}, {"port": 443, "nodePort": 30002}]}});
        let out = smp(
            svc,
            json!({"spec": {"ports": [{"port": 80, "targetPort": 8080}, {"port": 53, "protocol": "UDP"}]}}),
            SERVICES,
        );
        assert_eq!(
            out["spec"]["ports"],
            json!([
                {"port": 80, "protocol": "TCP", "nodePort": 30001, "targetPort": 8080},
                {"port": 443, "nodePort": 30002},
                {"port": 53, "protocol": "UDP"}
            ])
        );
    }

    #[test]
    fn delete_directive_removes_keyed_item_and_null_removes_field() {
        let svc = json!({"metadata": {"labels": {"a": "1", "b": "2"}}, "spec": {"ports": [{"port": 80}, {"port": 81}]}});
        let out = smp(
            svc,
            json!({"metadata": {"labels": {"a": null}}, "spec": {"ports": [{"port": 80, "$patch": "delete"}]}}),
            SERVICES,
        );
        assert_eq!(out["spec"]["ports"], json!([{"port": 81}]));
        assert_eq!(out["metadata"]["labels"], json!({"b": "2"}));
    }

    #[test]
    fn finalizers_merge_as_a_set() {
        let obj = json!({"metadata": {"finalizers": ["a", "b"]}});
        let out = smp(
            obj,
            json!({"metadata": {"finalizers": ["b", "c"], "$deleteFromPrimitiveList/finalizers": ["a"]}}),
            SERVICES,
        );
        assert_eq!(out["metadata"]["finalizers"], json!(["b", "c"]));
    }

    #[test]
    fn ingress_is_replaced_whole_and_conditions_merge_by_key() {
        let svc = json!({"status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}, "conditions": [{"type": "A", "status": "False"}]}});
        let out = smp(
            svc,
            json!({"status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.2", "ipMode": "VIP"}]}, "conditions": [{"type": "A", "status": "True"}, {"type": "B", "status": "True"}]}}),
            SERVICES,
        );
        assert_eq!(
            out["status"]["loadBalancer"]["ingress"],
            json!([{"ip": "198.51.100.2", "ipMode": "VIP"}])
        );
        assert_eq!(
            out["status"]["conditions"],
            json!([{"type": "A", "status": "True"}, {"type": "B", "status": "True"}])
        );
    }

    #[test]
    fn node_addresses_merge_by_type_and_slice_endpoints_replace() {
        let node = json!({"status": {"addresses": [{"type": "InternalIP", "address": "1.1.1.1"}, {"type": "Hostname", "address": "n1"}]}});
        let out = smp(
            node,
            json!({"status": {"addresses": [{"type": "InternalIP", "address": "2.2.2.2"}]}}),
            NODES,
        );
        assert_eq!(out["status"]["addresses"][0]["address"], "2.2.2.2");
        assert_eq!(out["status"]["addresses"][1]["address"], "n1");

        let slice =
            json!({"endpoints": [{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.2"]}]});
        let out = smp(
            slice,
            json!({"endpoints": [{"addresses": ["10.0.0.3"]}]}),
            ENDPOINT_SLICES,
        );
        assert_eq!(out["endpoints"], json!([{"addresses": ["10.0.0.3"]}]));
    }

    #[test]
    fn replace_directive_replaces_map() {
        let obj = json!({"spec": {"selector": {"a": "1", "b": "2"}}});
        let out = smp(
            obj,
            json!({"spec": {"selector": {"$patch": "replace", "c": "3"}}}),
            SERVICES,
        );
        assert_eq!(out["spec"]["selector"], json!({"c": "3"}));
    }

    #[test]
    fn json_patch_test_failure_is_not_applicable() {
        let obj = json!({"metadata": {"labels": {"a": "1"}}});
        let body = json!([{"op": "test", "path": "/metadata/labels/a", "value": "2"}, {"op": "remove", "path": "/metadata/labels/a"}]);
        let err = apply(&obj, PatchType::Json, body.to_string().as_bytes(), SERVICES).unwrap_err();
        assert!(matches!(err, PatchError::NotApplicable(_)));
        let ok = json!([{"op": "test", "path": "/metadata/labels/a", "value": "1"}, {"op": "remove", "path": "/metadata/labels/a"}]);
        let out = apply(&obj, PatchType::Json, ok.to_string().as_bytes(), SERVICES).unwrap();
        assert_eq!(out["metadata"]["labels"], json!({}));
    }

    #[test]
    fn json_patch_test_treats_missing_member_as_null() {
        // What kube-runtime's finalizer() sends for an object without finalizers.
        let add = json!([
            {"op": "test", "path": "/metadata/finalizers", "value": null},
            {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}
        ]);
        let obj = json!({"metadata": {"name": "a"}});
        let out = apply(&obj, PatchType::Json, add.to_string().as_bytes(), SERVICES).unwrap();
        assert_eq!(out["metadata"]["finalizers"], json!(["x"]));
        // Once present, the same test fails, so a concurrent add is detected.
        let err = apply(&out, PatchType::Json, add.to_string().as_bytes(), SERVICES).unwrap_err();
        assert!(matches!(err, PatchError::NotApplicable(_)));
        // A missing parent is still an error.
        let deep = json!([{"op": "test", "path": "/spec/nothing/here", "value": null}]);
        assert!(apply(&obj, PatchType::Json, deep.to_string().as_bytes(), SERVICES).is_err());
    }

    #[test]
    fn merge_patch_replaces_lists_and_rejects_junk() {
        let obj = json!({"spec": {"ports": [{"port": 80}, {"port": 81}]}});
        let out = apply(
            &obj,
            PatchType::Merge,
            br#"{"spec":{"ports":[{"port":82}]}}"#,
            SERVICES,
        )
        .unwrap();
        assert_eq!(out["spec"]["ports"], json!([{"port": 82}]));
        assert!(matches!(
            apply(&obj, PatchType::Merge, b"[1]", SERVICES),
            Err(PatchError::Malformed(_))
        ));
        assert!(matches!(
            apply(&obj, PatchType::Json, b"{}", SERVICES),
            Err(PatchError::Malformed(_))
        ));
    }

    #[test]
    fn content_types_map_to_patch_types() {
        assert_eq!(
            PatchType::from_content_type("application/merge-patch+json; charset=utf-8"),
            Some(PatchType::Merge)
        );
        assert_eq!(
            PatchType::from_content_type("application/json-patch+json"),
            Some(PatchType::Json)
        );
        assert_eq!(
            PatchType::from_content_type("application/strategic-merge-patch+json"),
            Some(PatchType::Strategic)
        );
        assert_eq!(
            PatchType::from_content_type("application/apply-patch+yaml"),
            Some(PatchType::Apply)
        );
        assert_eq!(PatchType::from_content_type("text/plain"), None);
    }
}
