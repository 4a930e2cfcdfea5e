//! `networking.k8s.io/v1` ServiceCIDR: validation as kube-apiserver's (`ValidateServiceCIDR`)
//! and the status its ServiceCIDR controller writes.
//!
//! The stand-in has no such controller: an accepted object is Ready at once (the real
//! one marks it Ready within moments when nothing overlaps), gets no finalizer (so a
//! delete removes it at once, where the real finalizer waits for the cluster IPs in it to
//! be released), and the Service allocator keeps allocating from
//! `--service-cluster-ip-range` alone. No default `kubernetes` object is created: tests
//! create the ones they need.

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Value, json};

use crate::status::FieldError;

const CIDRS: &str = "spec.cidrs";

/// `spec.cidrs` of a ServiceCIDR body (`None` when absent or not a list of strings).
fn cidrs(obj: &Value) -> Option<Vec<&str>> {
    obj["spec"]["cidrs"]
        .as_array()?
        .iter()
        .map(Value::as_str)
        .collect()
}

/// kube-apiserver's checks: one or two CIDRs, each valid and canonical, two of different
/// families.
pub fn validate(obj: &Value) -> Result<(), Vec<FieldError>> {
    let Some(cidrs) = cidrs(obj).filter(|cidrs| !cidrs.is_empty()) else {
        return Err(vec![FieldError::required(
            CIDRS,
            "at least one CIDR required",
        )]);
    };
    if cidrs.len() > 2 {
        return Err(vec![FieldError::invalid(
            CIDRS,
            obj["spec"].clone(),
            "may only hold up to 2 values",
        )]);
    }
    let mut errors = Vec::new();
    let mut parsed = Vec::new();
    for (i, cidr) in cidrs.iter().enumerate() {
        let field = format!("{CIDRS}[{i}]");
        match cidr.parse::<IpNet>() {
            Err(_) => errors.push(FieldError::invalid(
                field,
                *cidr,
                "must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)",
            )),
            Ok(net) if net != net.trunc() => errors.push(FieldError::invalid(
                field,
                *cidr,
                format!("must be in canonical form (\"{}\")", net.trunc()),
            )),
            Ok(net) => parsed.push(net),
        }
    }
    if let [a, b] = parsed[..]
        && matches!(a.addr(), IpAddr::V4(_)) == matches!(b.addr(), IpAddr::V4(_))
    {
        errors.push(FieldError::invalid(
            CIDRS,
            obj["spec"].clone(),
            "may specify no more than one IP for each IP family, i.e 192.168.0.0/24 and 2001:db8::/64",
        ));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// Create: validation, then the status the ServiceCIDR controller writes (whatever the
/// body carried: the real strategy drops it).
pub fn prepare_create(obj: &mut Value, now: &str) -> Result<(), Vec<FieldError>> {
    validate(obj)?;
    if let Some(map) = obj.as_object_mut() {
        map.insert(
            "status".into(),
            json!({"conditions": [{
                "type": "Ready",
                "status": "True",
                "lastTransitionTime": now,
                "reason": "",
                "message": "Kubernetes Service CIDR is ready",
            }]}),
        );
    }
    Ok(())
}

/// Update of the main resource: `spec.cidrs` is immutable.
pub fn validate_update(current: &Value, new: &Value) -> Result<(), Vec<FieldError>> {
    if cidrs(new) != cidrs(current) {
        return Err(vec![FieldError::invalid(
            CIDRS,
            new["spec"]["cidrs"].clone(),
            "field is immutable",
        )]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(cidrs: Value) -> Value {
        json!({"metadata": {"name": "extra"}, "spec": {"cidrs": cidrs}})
    }

    fn fields(result: Result<(), Vec<FieldError>>) -> Vec<String> {
        result
            .err()
            .unwrap_or_default()
            .into_iter()
            .map(|e| e.to_string())
            .collect()
    }

    #[test]
    fn one_cidr_or_one_per_family_each_canonical() {
        for ok in [
            json!(["10.97.0.0/16"]),
            json!(["fd00:97::/108"]),
            json!(["10.97.0.0/16", "fd00:97::/108"]),
        ] {
            assert!(validate(&body(ok.clone())).is_ok(), "{ok}");
        }
        let cases = [
            (json!([]), "spec.cidrs: Required value"),
            (json!(null), "spec.cidrs: Required value"),
            (
                json!(["10.1.0.0/16", "fd00::/64", "10.2.0.0/16"]),
                "may only hold up to 2 values",
            ),
            (json!(["10.97.0.0"]), "spec.cidrs[0]: Invalid value"),
            (
                json!(["10.97.1.0/16"]),
                "must be in canonical form (\"10.97.0.0/16\")",
            ),
            (
                json!(["10.97.0.0/16", "10.98.0.0/16"]),
                "no more than one IP for each IP family",
            ),
        ];
        for (cidrs, expected) in cases {
            let errors = fields(validate(&body(cidrs.clone())));
            assert!(
                errors.iter().any(|e| e.contains(expected)),
                "{cidrs}: {errors:?}"
            );
        }
    }

    #[test]
    fn created_ready_and_immutable() {
        let mut obj = body(json!(["10.97.0.0/16"]));
        obj["status"] = json!({"conditions": [{"type": "Ready", "status": "False"}]});
        prepare_create(&mut obj, "2026-01-01T00:00:00Z").unwrap();
        assert_eq!(obj["status"]["conditions"][0]["status"], "True");
        assert!(validate_update(&obj, &obj).is_ok());
        let changed = body(json!(["10.98.0.0/16"]));
        assert!(fields(validate_update(&obj, &changed))[0].contains("field is immutable"));
    }
}
