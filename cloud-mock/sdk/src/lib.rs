//! Typed client for the cloud-mock load-balancer API.
//!
//! [`Client`] speaks the REST API described by `cloud-mock/openapi.yaml`: timeouts,
//! retries with exponential backoff that honour `Retry-After`, an `Idempotency-Key` on
//! every create, `If-Match` on every update, failover to another edge of the API when one
//! does not take the connection, and typed [`Error`]s. It has no dependency on the server.
//!
//! The types at the crate root are the IPv4 view of a load balancer, unchanged since
//! before IP families; [`families`] has the whole one (IPv4, IPv6 or dual-stack), which
//! [`Client::families`] sends and reads.

mod client;
mod error;
pub mod families;
mod identity;
mod ipv4;
mod nodepools;
mod types;

use std::collections::BTreeMap;

pub use client::{Client, ClientOptions, FamiliesClient, IDEMPOTENCY_KEY, MAX_PROVISIONING_WAIT};
pub use error::{EdgeFailure, Error, TlsError};
pub use identity::ClientIdentity;
pub use ipv4::{Backend, BackendStatus, LoadBalancer, LoadBalancerList, LoadBalancerSpec};
pub use nodepools::{NodePool, NodePoolList, NodePoolSpec};
pub use types::{
    AddressRequest, BackendHealth, ErrorBody, ErrorDetail, Faults, HealthCheck,
    HealthCheckProtocol, IpFamily, Listener, LostAnswer, Mode, Pool, PoolList, Protocol, State,
};

/// Which load balancers (or node pools) a list returns: those carrying every tag in `tags` (and named
/// `name`, if given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListFilter {
    pub tags: BTreeMap<String, String>,
    pub name: Option<String>,
}

impl ListFilter {
    /// The query string pairs: `name=N` and one `tag=KEY=VALUE` per tag.
    pub fn query_pairs(&self) -> Vec<(&'static str, String)> {
        self.name
            .iter()
            .map(|name| ("name", name.clone()))
            .chain(
                self.tags
                    .iter()
                    .map(|(key, value)| ("tag", format!("{key}={value}"))),
            )
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_becomes_repeated_tag_pairs() {
        let filter = ListFilter {
            tags: BTreeMap::from([
                ("cluster".to_string(), "c1".to_string()),
                ("svc".to_string(), "a=b".to_string()),
            ]),
            name: Some("lb1".into()),
        };
        assert_eq!(
            filter.query_pairs(),
            vec![
                ("name", "lb1".to_string()),
                ("tag", "cluster=c1".to_string()),
                ("tag", "svc=a=b".to_string()),
            ]
        );
        assert!(ListFilter::default().query_pairs().is_empty());
    }
}
