//! core/v1 Events and events.k8s.io/v1 Events are two views of one store (kept in the core
//! shape), converted field by field as kube-apiserver's conversion functions do.

use serde_json::{Map, Value, json};

fn take(obj: &Value, key: &str) -> Option<Value> {
    obj.get(key).filter(|v| !v.is_null()).cloned()
}

fn put(map: &mut Map<String, Value>, key: &str, value: Option<Value>) {
    if let Some(v) = value {
        map.insert(key.to_string(), v);
    }
}

/// A core timestamp (`2024-01-01T00:00:00Z`) as a MicroTime (`...00.000000Z`).
fn micro(time: &Value) -> Option<Value> {
    let text = time.as_str()?;
    let ts: jiff::Timestamp = text.parse().ok()?;
    Some(json!(ts.strftime("%Y-%m-%dT%H:%M:%S.%6fZ").to_string()))
}

/// A MicroTime as a whole-second core timestamp.
fn seconds(time: &Value) -> Option<Value> {
    let text = time.as_str()?;
    let ts: jiff::Timestamp = text.parse().ok()?;
    Some(json!(ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()))
}

/// core/v1 shape → events.k8s.io/v1 shape.
pub fn core_to_v1(core: &Value) -> Value {
    let mut out = Map::new();
    out.insert("apiVersion".into(), json!("events.k8s.io/v1"));
    out.insert("kind".into(), json!("Event"));
    put(&mut out, "metadata", take(core, "metadata"));
    put(&mut out, "regarding", take(core, "involvedObject"));
    put(&mut out, "related", take(core, "related"));
    put(&mut out, "note", take(core, "message"));
    put(&mut out, "reason", take(core, "reason"));
    put(&mut out, "type", take(core, "type"));
    put(&mut out, "action", take(core, "action"));
    let event_time = take(core, "eventTime").or_else(|| core.get("firstTimestamp").and_then(micro));
    put(&mut out, "eventTime", event_time);
    let count = core["count"].as_u64().unwrap_or(0);
    let series = take(core, "series").or_else(|| {
        (count > 1).then(|| json!({"count": count, "lastObservedTime": core.get("lastTimestamp").and_then(micro)}))
    });
    put(&mut out, "series", series);
    let controller = take(core, "reportingComponent")
        .filter(|v| v != "")
        .or_else(|| take(&core["source"], "component"));
    put(&mut out, "reportingController", controller);
    let instance = take(core, "reportingInstance")
        .filter(|v| v != "")
        .or_else(|| take(&core["source"], "host"));
    put(&mut out, "reportingInstance", instance);
    put(&mut out, "deprecatedSource", take(core, "source"));
    put(
        &mut out,
        "deprecatedFirstTimestamp",
        take(core, "firstTimestamp"),
    );
    put(
        &mut out,
        "deprecatedLastTimestamp",
        take(core, "lastTimestamp"),
    );
    put(&mut out, "deprecatedCount", take(core, "count"));
    Value::Object(out)
}

/// events.k8s.io/v1 shape → core/v1 shape.
pub fn v1_to_core(v1: &Value) -> Value {
    let mut out = Map::new();
    out.insert("apiVersion".into(), json!("v1"));
    out.insert("kind".into(), json!("Event"));
    put(&mut out, "metadata", take(v1, "metadata"));
    put(
        &mut out,
        "involvedObject",
        take(v1, "regarding").or_else(|| Some(json!({}))),
    );
    put(&mut out, "related", take(v1, "related"));
    put(&mut out, "message", take(v1, "note"));
    put(&mut out, "reason", take(v1, "reason"));
    put(&mut out, "type", take(v1, "type"));
    put(&mut out, "action", take(v1, "action"));
    put(&mut out, "eventTime", take(v1, "eventTime"));
    put(&mut out, "series", take(v1, "series"));
    put(
        &mut out,
        "reportingComponent",
        take(v1, "reportingController"),
    );
    put(&mut out, "reportingInstance", take(v1, "reportingInstance"));
    let source = take(v1, "deprecatedSource").or_else(|| {
        let mut source = Map::new();
        put(&mut source, "component", take(v1, "reportingController"));
        put(&mut source, "host", take(v1, "reportingInstance"));
        Some(Value::Object(source))
    });
    put(&mut out, "source", source);
    let first =
        take(v1, "deprecatedFirstTimestamp").or_else(|| v1.get("eventTime").and_then(seconds));
    put(&mut out, "firstTimestamp", first);
    let last = take(v1, "deprecatedLastTimestamp")
        .or_else(|| v1["series"].get("lastObservedTime").and_then(seconds))
        .or_else(|| v1.get("eventTime").and_then(seconds));
    put(&mut out, "lastTimestamp", last);
    let count = take(v1, "deprecatedCount")
        .or_else(|| take(&v1["series"], "count"))
        .or(Some(json!(1)));
    put(&mut out, "count", count);
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_event_reads_back_through_core_view() {
        let v1 = json!({
            "metadata": {"name": "e1", "namespace": "default"},
            "regarding": {"kind": "Service", "name": "web", "namespace": "default"},
            "note": "Ensured load balancer",
            "reason": "EnsuredLoadBalancer",
            "type": "Normal",
            "action": "Ensure",
            "eventTime": "2026-01-02T03:04:05.123456Z",
            "reportingController": "tandem-controller",
            "reportingInstance": "ctrl-0",
            "series": {"count": 3, "lastObservedTime": "2026-01-02T03:05:00.000000Z"}
        });
        let core = v1_to_core(&v1);
        assert_eq!(core["involvedObject"]["name"], "web");
        assert_eq!(core["message"], "Ensured load balancer");
        assert_eq!(core["source"]["component"], "tandem-controller");
        assert_eq!(core["firstTimestamp"], "2026-01-02T03:04:05Z");
        assert_eq!(core["lastTimestamp"], "2026-01-02T03:05:00Z");
        assert_eq!(core["count"], 3);
        let back = core_to_v1(&core);
        for key in [
            "regarding",
            "note",
            "reason",
            "type",
            "action",
            "eventTime",
            "series",
            "reportingController",
            "reportingInstance",
            "metadata",
        ] {
            assert_eq!(back[key], v1[key], "{key}");
        }
    }

    #[test]
    fn core_event_shows_in_v1_view() {
        let core = json!({
            "metadata": {"name": "e2"},
            "involvedObject": {"kind": "Node", "name": "n1"},
            "message": "hello",
            "reason": "Ping",
            "type": "Warning",
            "source": {"component": "kubelet", "host": "n1"},
            "firstTimestamp": "2026-01-02T03:04:05Z",
            "lastTimestamp": "2026-01-02T03:09:05Z",
            "count": 4
        });
        let v1 = core_to_v1(&core);
        assert_eq!(v1["regarding"]["name"], "n1");
        assert_eq!(v1["note"], "hello");
        assert_eq!(v1["reportingController"], "kubelet");
        assert_eq!(v1["reportingInstance"], "n1");
        assert_eq!(v1["eventTime"], "2026-01-02T03:04:05.000000Z");
        assert_eq!(v1["series"]["count"], 4);
        assert_eq!(v1["deprecatedCount"], 4);
    }
}
