//! Server-side printing: `meta.k8s.io/v1` Table responses, columns as kube-apiserver prints
//! them, so `kubectl get` looks as it does on a real cluster.

use serde_json::{Value, json};

use crate::resources::{ResourceType, Storage, View};

/// What each row carries besides its cells (`includeObject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncludeObject {
    None,
    Metadata,
    Object,
}

impl IncludeObject {
    pub fn parse(value: Option<&str>) -> Self {
        match value {
            Some("None") => Self::None,
            Some("Object") => Self::Object,
            _ => Self::Metadata,
        }
    }
}

/// Whether the `Accept` header asks for a Table.
pub fn wants_table(accept: &str) -> bool {
    accept
        .split(',')
        .next()
        .is_some_and(|first| first.contains("as=Table") && first.contains("g=meta.k8s.io"))
}

fn column(name: &str, format: &str, priority: u32, description: &str) -> Value {
    json!({"name": name, "type": "string", "format": format, "description": description, "priority": priority})
}

fn columns(rt: &ResourceType) -> Vec<Value> {
    let name = column("Name", "name", 0, "Name must be unique within a namespace.");
    let age = column(
        "Age",
        "",
        0,
        "CreationTimestamp is a timestamp representing the server time when this object was created.",
    );
    match rt.storage {
        Storage::Services => vec![
            name,
            column("Type", "", 0, "type determines how the Service is exposed."),
            column(
                "Cluster-IP",
                "",
                0,
                "clusterIP is the IP address of the service.",
            ),
            column(
                "External-IP",
                "",
                0,
                "externalIPs and load balancer ingress addresses.",
            ),
            column(
                "Port(s)",
                "",
                0,
                "The list of ports that are exposed by this service.",
            ),
            age,
            column(
                "Selector",
                "",
                1,
                "Route service traffic to pods with label keys and values matching this selector.",
            ),
        ],
        Storage::Nodes => vec![
            name,
            column("Status", "", 0, "The status of the node"),
            column("Roles", "", 0, "The roles of the node"),
            age,
            column("Version", "", 0, "Kubelet Version reported by the node."),
            column(
                "Internal-IP",
                "",
                1,
                "List of addresses reachable to the node.",
            ),
        ],
        Storage::Namespaces => vec![
            name,
            column("Status", "", 0, "The status of the namespace"),
            age,
        ],
        Storage::Leases => vec![
            name,
            column("Holder", "", 0, "holderIdentity of the lease."),
            age,
        ],
        Storage::ServiceCidrs => vec![
            name,
            column(
                "CIDRs",
                "",
                0,
                "CIDRs defines the IP blocks in CIDR notation.",
            ),
            age,
        ],
        Storage::EndpointSlices => vec![
            name,
            column(
                "AddressType",
                "",
                0,
                "Type of address carried by this EndpointSlice.",
            ),
            column("Ports", "", 0, "Ports of this EndpointSlice."),
            column(
                "Endpoints",
                "",
                0,
                "Addresses of the endpoints (first three).",
            ),
            age,
        ],
        // As kubectl shows core Events: newest observation first, no name column.
        Storage::Events if rt.view == View::Native => vec![
            column(
                "Last Seen",
                "",
                0,
                "Time since the event was last observed.",
            ),
            column("Type", "", 0, "Type of this event."),
            column("Reason", "", 0, "Why the event happened."),
            column("Object", "", 0, "The object this event is about."),
            column("Message", "", 0, "A human-readable description."),
        ],
        Storage::Events => vec![name, age],
    }
}

fn since(time: &Value, now: jiff::Timestamp) -> Option<String> {
    let created: jiff::Timestamp = time.as_str()?.parse().ok()?;
    Some(human_duration(now.as_second() - created.as_second()))
}

/// First three items, then `+ N more...`, as kubectl's list formatting.
fn first_three(items: Vec<String>) -> String {
    if items.is_empty() {
        return "<unset>".to_string();
    }
    let shown = items.iter().take(3).cloned().collect::<Vec<_>>().join(",");
    if items.len() > 3 {
        format!("{shown} + {} more...", items.len() - 3)
    } else {
        shown
    }
}

fn endpoint_slice_cells(slice: &Value, now: jiff::Timestamp) -> Vec<Value> {
    let ports = slice["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            p["port"]
                .as_u64()
                .map_or_else(|| "<unset>".to_string(), |n| n.to_string())
        })
        .collect();
    let endpoints = slice["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|e| strings(&e["addresses"]))
        .collect();
    vec![
        slice["metadata"]["name"].clone(),
        json!(slice["addressType"].as_str().unwrap_or_default()),
        json!(first_three(ports)),
        json!(first_three(endpoints)),
        json!(age(slice, now)),
    ]
}

fn event_cells(event: &Value, now: jiff::Timestamp) -> Vec<Value> {
    let first = since(&event["firstTimestamp"], now)
        .or_else(|| since(&event["eventTime"], now))
        .unwrap_or_else(|| "<unknown>".to_string());
    let last = since(&event["lastTimestamp"], now).unwrap_or_else(|| first.clone());
    let count = event["count"].as_u64().unwrap_or(0);
    let interval = if count > 1 {
        format!("{last} (x{count} over {first})")
    } else {
        last
    };
    let kind = event["involvedObject"]["kind"]
        .as_str()
        .unwrap_or_default()
        .to_lowercase();
    let target = match event["involvedObject"]["name"]
        .as_str()
        .filter(|n| !n.is_empty())
    {
        Some(name) => format!("{kind}/{name}"),
        None => kind,
    };
    vec![
        json!(interval),
        json!(event["type"].as_str().unwrap_or_default()),
        json!(event["reason"].as_str().unwrap_or_default()),
        json!(target),
        json!(event["message"].as_str().unwrap_or_default()),
    ]
}

/// `duration.HumanDuration` of apimachinery.
pub fn human_duration(seconds: i64) -> String {
    if seconds < -1 {
        return "<invalid>".to_string();
    }
    if seconds < 0 {
        return "0s".to_string();
    }
    if seconds < 120 {
        return format!("{seconds}s");
    }
    let minutes = seconds / 60;
    if minutes < 10 {
        let s = seconds % 60;
        return if s == 0 {
            format!("{minutes}m")
        } else {
            format!("{minutes}m{s}s")
        };
    }
    if minutes < 180 {
        return format!("{minutes}m");
    }
    let hours = minutes / 60;
    if hours < 8 {
        let m = minutes % 60;
        return if m == 0 {
            format!("{hours}h")
        } else {
            format!("{hours}h{m}m")
        };
    }
    if hours < 48 {
        return format!("{hours}h");
    }
    if hours < 24 * 8 {
        let h = hours % 24;
        return if h == 0 {
            format!("{}d", hours / 24)
        } else {
            format!("{}d{h}h", hours / 24)
        };
    }
    if hours < 24 * 365 * 2 {
        return format!("{}d", hours / 24);
    }
    if hours < 24 * 365 * 8 {
        let days = (hours / 24) % 365;
        return if days == 0 {
            format!("{}y", hours / 24 / 365)
        } else {
            format!("{}y{days}d", hours / 24 / 365)
        };
    }
    format!("{}y", hours / 24 / 365)
}

fn age(obj: &Value, now: jiff::Timestamp) -> String {
    obj["metadata"]["creationTimestamp"]
        .as_str()
        .and_then(|t| t.parse::<jiff::Timestamp>().ok())
        .map_or_else(
            || "<unknown>".to_string(),
            |created| human_duration(now.as_second() - created.as_second()),
        )
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_string)
        .collect()
}

fn service_cells(svc: &Value, now: jiff::Timestamp) -> Vec<Value> {
    let spec = &svc["spec"];
    let svc_type = spec["type"].as_str().unwrap_or("ClusterIP");
    let cluster_ip = match spec["clusterIP"].as_str().unwrap_or_default() {
        "" => "<none>".to_string(),
        ip => ip.to_string(),
    };
    let mut external = strings(&spec["externalIPs"]);
    let external_ip = match svc_type {
        "ExternalName" => spec["externalName"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        "LoadBalancer" => {
            for ingress in svc["status"]["loadBalancer"]["ingress"]
                .as_array()
                .into_iter()
                .flatten()
            {
                if let Some(addr) = ingress["ip"]
                    .as_str()
                    .or_else(|| ingress["hostname"].as_str())
                {
                    external.push(addr.to_string());
                }
            }
            if external.is_empty() {
                "<pending>".to_string()
            } else {
                external.join(",")
            }
        }
        _ if external.is_empty() => "<none>".to_string(),
        _ => external.join(","),
    };
    let ports: Vec<String> = spec["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let protocol = p["protocol"].as_str().unwrap_or("TCP");
            match p["nodePort"].as_u64().filter(|n| *n != 0) {
                Some(node_port) => format!("{}:{node_port}/{protocol}", p["port"]),
                None => format!("{}/{protocol}", p["port"]),
            }
        })
        .collect();
    let ports = if ports.is_empty() {
        "<none>".to_string()
    } else {
        ports.join(",")
    };
    let selector = spec["selector"]
        .as_object()
        .filter(|m| !m.is_empty())
        .map_or_else(
            || "<none>".to_string(),
            |m| {
                m.iter()
                    .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                    .collect::<Vec<_>>()
                    .join(",")
            },
        );
    vec![
        json!(svc_type),
        json!(cluster_ip),
        json!(external_ip),
        json!(ports),
        json!(age(svc, now)),
        json!(selector),
    ]
}

fn node_cells(node: &Value, now: jiff::Timestamp) -> Vec<Value> {
    let ready = node["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "Ready");
    let mut status = match ready.and_then(|c| c["status"].as_str()) {
        Some("True") => "Ready".to_string(),
        Some(_) => "NotReady".to_string(),
        None => "Unknown".to_string(),
    };
    if node["spec"]["unschedulable"].as_bool() == Some(true) {
        status.push_str(",SchedulingDisabled");
    }
    let mut roles: Vec<&str> = node["metadata"]["labels"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, _)| k.strip_prefix("node-role.kubernetes.io/"))
        .filter(|r| !r.is_empty())
        .collect();
    roles.sort_unstable();
    let roles = if roles.is_empty() {
        "<none>".to_string()
    } else {
        roles.join(",")
    };
    let version = node["status"]["nodeInfo"]["kubeletVersion"]
        .as_str()
        .unwrap_or_default();
    let internal_ip = node["status"]["addresses"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["type"] == "InternalIP")
        .and_then(|a| a["address"].as_str())
        .unwrap_or("<none>");
    vec![
        json!(status),
        json!(roles),
        json!(age(node, now)),
        json!(version),
        json!(internal_ip),
    ]
}

fn cells(rt: &ResourceType, obj: &Value, now: jiff::Timestamp) -> Vec<Value> {
    match rt.storage {
        Storage::EndpointSlices => return endpoint_slice_cells(obj, now),
        Storage::Events if rt.view == View::Native => return event_cells(obj, now),
        _ => {}
    }
    let mut cells = vec![obj["metadata"]["name"].clone()];
    cells.extend(match rt.storage {
        Storage::Services => service_cells(obj, now),
        Storage::Nodes => node_cells(obj, now),
        Storage::Namespaces => vec![
            json!(obj["status"]["phase"].as_str().unwrap_or("Active")),
            json!(age(obj, now)),
        ],
        Storage::Leases => vec![
            json!(obj["spec"]["holderIdentity"].as_str().unwrap_or_default()),
            json!(age(obj, now)),
        ],
        // As kubectl: the CIDRs joined with commas.
        Storage::ServiceCidrs => vec![
            json!(
                obj["spec"]["cidrs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            json!(age(obj, now)),
        ],
        _ => vec![json!(age(obj, now))],
    });
    cells
}

/// An object reduced to a `meta.k8s.io/v1` PartialObjectMetadata.
pub fn partial_metadata(obj: &Value) -> Value {
    json!({
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj["metadata"],
    })
}

fn row(rt: &ResourceType, obj: &Value, include: IncludeObject, now: jiff::Timestamp) -> Value {
    let mut row = json!({"cells": cells(rt, obj, now)});
    let object = match include {
        IncludeObject::None => None,
        IncludeObject::Object => Some(obj.clone()),
        IncludeObject::Metadata => Some(partial_metadata(obj)),
    };
    if let (Some(object), Some(map)) = (object, row.as_object_mut()) {
        map.insert("object".into(), object);
    }
    row
}

/// A Table of `objects` (view shape).
pub fn table(
    rt: &ResourceType,
    objects: &[Value],
    resource_version: u64,
    continue_token: Option<&str>,
    include: IncludeObject,
    now: jiff::Timestamp,
) -> Value {
    let mut metadata = json!({"resourceVersion": resource_version.to_string()});
    if let (Some(token), Some(map)) = (continue_token, metadata.as_object_mut()) {
        map.insert("continue".into(), json!(token));
    }
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": metadata,
        "columnDefinitions": columns(rt),
        "rows": objects.iter().map(|o| row(rt, o, include, now)).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{LEASES, NODES, SERVICES};

    fn now() -> jiff::Timestamp {
        "2026-01-01T01:00:00Z".parse().unwrap()
    }

    #[test]
    fn service_rows_match_kubectl_output() {
        let lb = json!({
            "metadata": {"name": "web", "creationTimestamp": "2026-01-01T00:59:30Z"},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10", "ports": [{"port": 80, "nodePort": 30166, "protocol": "TCP"}, {"port": 53, "nodePort": 30053, "protocol": "UDP"}], "selector": {"app": "web"}},
            "status": {"loadBalancer": {}}
        });
        let t = table(
            SERVICES,
            std::slice::from_ref(&lb),
            7,
            None,
            IncludeObject::Metadata,
            now(),
        );
        let headers: Vec<&str> = t["columnDefinitions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            headers,
            [
                "Name",
                "Type",
                "Cluster-IP",
                "External-IP",
                "Port(s)",
                "Age",
                "Selector"
            ]
        );
        assert_eq!(
            t["rows"][0]["cells"],
            json!([
                "web",
                "LoadBalancer",
                "10.96.0.10",
                "<pending>",
                "80:30166/TCP,53:30053/UDP",
                "30s",
                "app=web"
            ])
        );
        assert_eq!(t["rows"][0]["object"]["kind"], "PartialObjectMetadata");

        let mut served = lb;
        served["status"]["loadBalancer"]["ingress"] = json!([{"ip": "198.51.100.4"}]);
        assert_eq!(
            table(SERVICES, &[served], 7, None, IncludeObject::None, now())["rows"][0]["cells"][3],
            "198.51.100.4"
        );

        let plain = json!({"metadata": {"name": "db"}, "spec": {"type": "ClusterIP", "clusterIP": "None", "ports": [{"port": 5432, "protocol": "TCP"}]}});
        let cells =
            &table(SERVICES, &[plain], 7, None, IncludeObject::None, now())["rows"][0]["cells"];
        assert_eq!(cells[2], "None");
        assert_eq!(cells[3], "<none>");
        assert_eq!(cells[4], "5432/TCP");
    }

    #[test]
    fn node_rows_show_status_roles_and_version() {
        let node = json!({
            "metadata": {"name": "n1", "creationTimestamp": "2025-12-31T00:00:00Z", "labels": {"node-role.kubernetes.io/control-plane": ""}},
            "spec": {"unschedulable": true},
            "status": {"conditions": [{"type": "Ready", "status": "True"}], "nodeInfo": {"kubeletVersion": "v1.34.0"}}
        });
        let t = table(NODES, &[node], 1, None, IncludeObject::None, now());
        assert_eq!(
            t["rows"][0]["cells"],
            json!([
                "n1",
                "Ready,SchedulingDisabled",
                "control-plane",
                "25h",
                "v1.34.0",
                "<none>"
            ])
        );
        let generic = table(
            LEASES,
            &[json!({"metadata": {"name": "l"}, "spec": {}})],
            1,
            Some("tok"),
            IncludeObject::None,
            now(),
        );
        assert_eq!(generic["metadata"]["continue"], "tok");
    }

    #[test]
    fn event_and_endpoint_slice_rows() {
        let event = json!({
            "metadata": {"name": "web.1"},
            "involvedObject": {"kind": "Service", "name": "web"},
            "type": "Normal", "reason": "EnsuredLoadBalancer", "message": "Ensured load balancer",
            "firstTimestamp": "2026-01-01T00:50:00Z", "lastTimestamp": "2026-01-01T00:59:00Z", "count": 3
        });
        let t = table(
            crate::resources::EVENTS,
            &[event],
            1,
            None,
            IncludeObject::None,
            now(),
        );
        assert_eq!(t["columnDefinitions"][0]["name"], "Last Seen");
        assert_eq!(
            t["rows"][0]["cells"],
            json!([
                "60s (x3 over 10m)",
                "Normal",
                "EnsuredLoadBalancer",
                "service/web",
                "Ensured load balancer"
            ])
        );

        let slice = json!({
            "metadata": {"name": "web-abc", "creationTimestamp": "2026-01-01T00:59:00Z"},
            "addressType": "IPv4",
            "ports": [{"port": 8080}],
            "endpoints": [{"addresses": ["10.244.1.2"]}, {"addresses": ["10.244.2.2"]}, {"addresses": ["10.244.2.3"]}, {"addresses": ["10.244.3.2"]}]
        });
        let t = table(
            crate::resources::ENDPOINT_SLICES,
            &[slice],
            1,
            None,
            IncludeObject::None,
            now(),
        );
        assert_eq!(
            t["rows"][0]["cells"],
            json!([
                "web-abc",
                "IPv4",
                "8080",
                "10.244.1.2,10.244.2.2,10.244.2.3 + 1 more...",
                "60s"
            ])
        );
    }

    #[test]
    fn human_durations_match_apimachinery() {
        for (secs, text) in [
            (-5, "<invalid>"),
            (5, "5s"),
            (119, "119s"),
            (150, "2m30s"),
            (600, "10m"),
            (3 * 3600 + 60, "3h1m"),
            (30 * 3600, "30h"),
            (50 * 3600, "2d2h"),
            (10 * 86400, "10d"),
            (800 * 86400, "2y70d"),
        ] {
            assert_eq!(human_duration(secs), text, "{secs}");
        }
    }

    #[test]
    fn table_accept_header_detection() {
        assert!(wants_table(
            "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json"
        ));
        assert!(!wants_table("application/json"));
        assert!(!wants_table(
            "application/json, application/json;as=Table;v=v1;g=meta.k8s.io"
        ));
    }
}
