//! ServiceCIDR objects → the Service CIDRs of the cluster.

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use super::Skipped;

/// Every CIDR of every ServiceCIDR object, of both families (each proxier keeps its own,
/// [`tandem_proxy_rules::model::service_cidrs_of`]), whatever the object's status, as
/// kube-proxy's ServiceCIDR handler passes them on; plus the values that are not CIDRs
/// (the API server validates them, so only a server that does not would send one).
pub fn service_cidrs<'a>(
    objects: impl IntoIterator<Item = &'a ServiceCIDR>,
) -> (Vec<IpNet>, Vec<Skipped>) {
    let mut cidrs = Vec::new();
    let mut skipped = Vec::new();
    for object in objects {
        let values = object
            .spec
            .iter()
            .flat_map(|spec| spec.cidrs.iter().flatten());
        for value in values {
            match value.parse::<IpNet>() {
                Ok(cidr) => cidrs.push(cidr),
                Err(_) => skipped.push(Skipped::ServiceCidrValue {
                    service_cidr: object.metadata.name.clone().unwrap_or_default(),
                    value: value.clone(),
                }),
            }
        }
    }
    (cidrs, skipped)
}

#[cfg(test)]
mod tests;
