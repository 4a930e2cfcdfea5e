//! The state of one family: every converted Service port with the endpoints its Service's
//! slices give it.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use tandem_common::IpFamily;
use tandem_proxy_rules::model::ProxyState;

use super::endpointslice::{SliceEntry, port_endpoints};
use super::service::ServiceEntry;
use super::{ObjectKey, Skipped};

/// The converted state plus everything that was left out of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conversion {
    pub state: ProxyState,
    pub skipped: Vec<Skipped>,
}

/// Build the view of the cluster of the proxier of `family` from the Services and
/// EndpointSlices it sees.
pub fn proxy_state<'a>(
    services: impl IntoIterator<Item = &'a Service>,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    family: IpFamily,
) -> Conversion {
    let services: Vec<ServiceEntry> = services
        .into_iter()
        .map(|service| ServiceEntry::of(service, family))
        .collect();
    let slices: Vec<SliceEntry> = slices
        .into_iter()
        .map(|slice| SliceEntry::of(slice, family))
        .collect();
    join(&services, &slices, family)
}

/// The state of `family` of all converted Services and EndpointSlices: each Service port
/// with the endpoints its Service's slices give it.
pub fn join<'a>(
    services: impl IntoIterator<Item = &'a ServiceEntry>,
    slices: impl IntoIterator<Item = &'a SliceEntry>,
    family: IpFamily,
) -> Conversion {
    let mut slices_of: HashMap<&ObjectKey, Vec<&SliceEntry>> = HashMap::new();
    let mut slices_skipped = Vec::new();
    for slice in slices {
        slices_skipped.extend(slice.skipped.iter().cloned());
        if let Some(service) = &slice.service {
            slices_of.entry(service).or_default().push(slice);
        }
    }
    let mut out = Conversion {
        state: ProxyState::new(family),
        skipped: Vec::new(),
    };
    for service in services {
        out.skipped.extend(service.skipped.iter().cloned());
        for port in &service.ports {
            let key = (port.name.namespace.clone(), port.name.name.clone());
            let endpoints = port_endpoints(
                &port.name,
                slices_of.get(&key).into_iter().flatten().copied(),
            );
            out.state.insert_endpoints(port.name.clone(), endpoints);
            out.state.insert_service(port.clone());
        }
    }
    out.skipped.extend(slices_skipped);
    out
}

#[cfg(test)]
mod tests;
