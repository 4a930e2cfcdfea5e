use super::*;

#[test]
fn service_cidrs_of_every_object_whatever_its_status_and_bad_values_reported() {
    let object = |name: &str, cidrs: serde_json::Value, status: serde_json::Value| {
        serde_json::from_value::<ServiceCIDR>(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"cidrs": cidrs},
            "status": status,
        }))
        .unwrap()
    };
    let objects = [
        object(
            "kubernetes",
            serde_json::json!(["10.96.0.0/16", "fd00:96::/112"]),
            serde_json::json!({"conditions": [{"type": "Ready", "status": "True",
                "reason": "", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
        ),
        // Not Ready (overlapping), or being deleted: kube-proxy still counts it.
        object(
            "extra",
            serde_json::json!(["10.97.0.0/16", "bogus"]),
            serde_json::json!({}),
        ),
    ];
    let (cidrs, skipped) = service_cidrs(&objects);
    let expected: Vec<IpNet> = ["10.96.0.0/16", "fd00:96::/112", "10.97.0.0/16"]
        .iter()
        .map(|c| c.parse().unwrap())
        .collect();
    assert_eq!(cidrs, expected);
    assert_eq!(
        skipped,
        [Skipped::ServiceCidrValue {
            service_cidr: "extra".into(),
            value: "bogus".into()
        }]
    );
}
