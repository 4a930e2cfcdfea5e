//! Tenants of a shared edge: who a credential belongs to, and what that tenant may touch.
//!
//! A tenant is bound to cluster ids: it sees and changes only the load balancers and node
//! pools whose `kubernetes.io/cluster-id` tag names one of them (the tag the controller
//! writes on everything it makes), and no two tenants share a cluster id, so they never
//! see each other's objects. It draws VIPs only from the pools it is given, within its
//! quotas, and at most as fast as its rate limit. The file that says so holds tokens only
//! as their SHA-256 (see [`crate::credentials`], which reads it and re-reads it).

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota};
use serde::Deserialize;

/// The tag that names the cluster an object belongs to.
pub const CLUSTER_ID_TAG: &str = "kubernetes.io/cluster-id";

/// The tenants file, as JSON.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct TenantsFile {
    /// Credentials that manage the edge (faults) and may read and change every tenant's
    /// objects; none of a tenant's can.
    #[serde(default)]
    pub admin: Vec<CredentialEntry>,
    pub tenants: Vec<TenantEntry>,
}

/// A credential: an id to name it in logs, and the SHA-256 of the token.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct CredentialEntry {
    pub id: String,
    /// 64 hex digits: `printf %s "$TOKEN" | sha256sum`.
    pub sha256: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct TenantEntry {
    name: String,
    clusters: BTreeSet<String>,
    pools: BTreeSet<String>,
    #[serde(default)]
    quotas: Quotas,
    #[serde(default)]
    rate_limit: Option<RateLimit>,
    pub credentials: Vec<CredentialEntry>,
}

/// Most a tenant may hold; a quota left out is unlimited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Quotas {
    /// Load balancers, whatever their state.
    pub load_balancers: Option<u64>,
    /// Distinct VIPs held, per pool (a VIP shared by several load balancers counts once).
    #[serde(default)]
    pub vips_per_pool: BTreeMap<String, u64>,
}

/// A token bucket: `requestsPerSecond` on average, `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RateLimit {
    pub requests_per_second: NonZeroU32,
    pub burst: NonZeroU32,
}

/// Why a tenants file is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantsError {
    #[error("not valid: {0}")]
    Syntax(String),
    #[error("holds no tenant and no admin credential")]
    Empty,
    #[error("tenant name {0:?} is not a DNS label (a-z, 0-9 and '-', at most 63)")]
    BadName(String),
    #[error("tenant {0:?} comes twice")]
    DuplicateTenant(String),
    #[error("tenant {tenant:?} has no cluster id")]
    NoCluster { tenant: String },
    #[error("cluster id {cluster:?} is bound to both tenant {first:?} and tenant {second:?}")]
    SharedCluster {
        cluster: String,
        first: String,
        second: String,
    },
    #[error("tenant {tenant:?} has no VIP pool")]
    NoPool { tenant: String },
    #[error("tenant {tenant:?} has a quota for pool {pool:?}, which is not one of its pools")]
    QuotaOutsidePools { tenant: String, pool: String },
    #[error("credential {id:?}: sha256 must be 64 hex digits")]
    BadHash { id: String },
    #[error("credential id {0:?} comes twice")]
    DuplicateCredential(String),
    #[error("credential id {0:?} must be 1 to 63 visible characters")]
    BadCredentialId(String),
}

/// A tenant as the request path uses it.
#[derive(Debug)]
pub struct Tenant {
    pub name: String,
    pub clusters: BTreeSet<String>,
    pub pools: BTreeSet<String>,
    pub quotas: Quotas,
    rate_limit: Option<(RateLimit, Arc<DefaultDirectRateLimiter>)>,
}

/// A call a tenant may not make, answered 403 (see [`crate::error`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "tenant {tenant:?} is not bound to cluster {cluster:?} (tag {CLUSTER_ID_TAG}); its clusters: {clusters}"
    )]
    Cluster {
        tenant: String,
        cluster: String,
        clusters: String,
    },
    #[error("tenant {tenant:?} may not draw VIPs from pool {pool:?} (its pools: {pools})")]
    Pool {
        tenant: String,
        pool: String,
        pools: String,
    },
    #[error("tenant {tenant:?} reached its quota of {limit} {what} (quota {quota})")]
    Quota {
        tenant: String,
        /// The quota's name in the tenants file: `loadBalancers`, `vipsPerPool.POOL`.
        quota: String,
        what: String,
        limit: u64,
    },
}

fn joined(names: &BTreeSet<String>) -> String {
    names
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Tenant {
    /// The cluster an object with `tags` belongs to, if it names one.
    pub fn cluster_of(tags: &BTreeMap<String, String>) -> Option<&str> {
        tags.get(CLUSTER_ID_TAG).map(String::as_str)
    }

    /// Whether an object with `tags` is this tenant's (the others' do not exist for it).
    pub fn owns(&self, tags: &BTreeMap<String, String>) -> bool {
        Self::cluster_of(tags).is_some_and(|cluster| self.clusters.contains(cluster))
    }

    /// Refuses an object written with `tags` that would not be this tenant's.
    pub fn check_cluster(&self, tags: &BTreeMap<String, String>) -> Result<(), Refusal> {
        if self.owns(tags) {
            return Ok(());
        }
        Err(Refusal::Cluster {
            tenant: self.name.clone(),
            cluster: Self::cluster_of(tags).unwrap_or_default().to_owned(),
            clusters: joined(&self.clusters),
        })
    }

    pub fn check_pool(&self, pool: &str) -> Result<(), Refusal> {
        if self.pools.contains(pool) {
            return Ok(());
        }
        Err(Refusal::Pool {
            tenant: self.name.clone(),
            pool: pool.to_owned(),
            pools: joined(&self.pools),
        })
    }

    /// Refuses a create that would hold `count` load balancers.
    pub fn check_load_balancers(&self, count: u64) -> Result<(), Refusal> {
        match self.quotas.load_balancers {
            Some(limit) if count > limit => Err(Refusal::Quota {
                tenant: self.name.clone(),
                quota: "loadBalancers".into(),
                what: "load balancers".into(),
                limit,
            }),
            _ => Ok(()),
        }
    }

    /// Refuses a write that would hold `count` distinct VIPs of `pool`.
    pub fn check_vips(&self, pool: &str, count: u64) -> Result<(), Refusal> {
        match self.quotas.vips_per_pool.get(pool) {
            Some(&limit) if count > limit => Err(Refusal::Quota {
                tenant: self.name.clone(),
                quota: format!("vipsPerPool.{pool}"),
                what: format!("VIPs in pool {pool:?}"),
                limit,
            }),
            _ => Ok(()),
        }
    }

    /// Takes one request from the tenant's rate limit; when it is spent, how long until
    /// the next request would be taken.
    pub fn admit(&self) -> Result<(), Duration> {
        let Some((_, limiter)) = &self.rate_limit else {
            return Ok(());
        };
        limiter
            .check()
            .map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now()))
    }
}

/// A tenant file's tenants, checked. `previous` are the tenants read last: one whose rate
/// limit is unchanged keeps its bucket, so a reload refills no one's.
pub(crate) fn tenants(
    file: &TenantsFile,
    previous: &[Arc<Tenant>],
) -> Result<Vec<Arc<Tenant>>, TenantsError> {
    if file.tenants.is_empty() && file.admin.is_empty() {
        return Err(TenantsError::Empty);
    }
    let mut bound: BTreeMap<&str, &str> = BTreeMap::new();
    let mut names = BTreeSet::new();
    let mut built = Vec::with_capacity(file.tenants.len());
    for entry in &file.tenants {
        let name = entry.name.as_str();
        if !tandem_common::is_dns1123_label(name) {
            return Err(TenantsError::BadName(name.to_owned()));
        }
        if !names.insert(name) {
            return Err(TenantsError::DuplicateTenant(name.to_owned()));
        }
        if entry.clusters.is_empty() {
            return Err(TenantsError::NoCluster {
                tenant: name.to_owned(),
            });
        }
        for cluster in &entry.clusters {
            if let Some(first) = bound.insert(cluster, name) {
                return Err(TenantsError::SharedCluster {
                    cluster: cluster.clone(),
                    first: first.to_owned(),
                    second: name.to_owned(),
                });
            }
        }
        if entry.pools.is_empty() {
            return Err(TenantsError::NoPool {
                tenant: name.to_owned(),
            });
        }
        if let Some(pool) = entry
            .quotas
            .vips_per_pool
            .keys()
            .find(|pool| !entry.pools.contains(*pool))
        {
            return Err(TenantsError::QuotaOutsidePools {
                tenant: name.to_owned(),
                pool: pool.clone(),
            });
        }
        let rate_limit = entry.rate_limit.map(|limit| {
            let kept = previous
                .iter()
                .find(|old| old.name == name)
                .and_then(|old| old.rate_limit.as_ref())
                .filter(|(old, _)| *old == limit)
                .map(|(_, limiter)| limiter.clone());
            let limiter = kept.unwrap_or_else(|| {
                Arc::new(DefaultDirectRateLimiter::direct(
                    Quota::per_second(limit.requests_per_second).allow_burst(limit.burst),
                ))
            });
            (limit, limiter)
        });
        built.push(Arc::new(Tenant {
            name: name.to_owned(),
            clusters: entry.clusters.clone(),
            pools: entry.pools.clone(),
            quotas: entry.quotas.clone(),
            rate_limit,
        }));
    }
    Ok(built)
}

impl TenantsFile {
    pub fn parse(text: &str) -> Result<Self, TenantsError> {
        serde_json::from_str(text).map_err(|err| TenantsError::Syntax(err.to_string()))
    }
}

/// The tenants of a tenants file's text, checked (their credentials aside: see
/// [`crate::credentials`]).
pub fn parse(text: &str) -> Result<Vec<Arc<Tenant>>, TenantsError> {
    tenants(&TenantsFile::parse(text)?, &[])
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: &str = "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b";

    fn file(tenants: &str) -> String {
        format!(r#"{{"admin": [{{"id": "ops", "sha256": "{HASH}"}}], "tenants": [{tenants}]}}"#)
    }

    fn tenant(name: &str, clusters: &str, extra: &str) -> String {
        format!(
            r#"{{"name": "{name}", "clusters": [{clusters}], "pools": ["default"], "credentials": []{extra}}}"#
        )
    }

    fn tags(cluster: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(CLUSTER_ID_TAG.to_owned(), cluster.to_owned())])
    }

    #[test]
    fn a_tenant_owns_the_objects_of_its_clusters_only() {
        let built = parse(&file(&tenant("a", r#""c1", "c2""#, ""))).unwrap();
        let a = &built[0];
        assert!(a.owns(&tags("c1")) && a.owns(&tags("c2")));
        assert!(!a.owns(&tags("c3")));
        assert!(
            !a.owns(&BTreeMap::new()),
            "an untagged object is no tenant's"
        );
        let refused = a.check_cluster(&tags("c3")).unwrap_err();
        assert_eq!(
            refused.to_string(),
            format!(
                "tenant \"a\" is not bound to cluster \"c3\" (tag {CLUSTER_ID_TAG}); its clusters: c1, c2"
            )
        );
        assert!(a.check_pool("default").is_ok());
        assert!(a.check_pool("dmz").is_err());
    }

    #[test]
    fn quotas_name_themselves_when_reached() {
        let built = parse(&file(&tenant(
            "a",
            r#""c1""#,
            r#", "quotas": {"loadBalancers": 2, "vipsPerPool": {"default": 1}}"#,
        )))
        .unwrap();
        let a = &built[0];
        assert!(a.check_load_balancers(2).is_ok());
        assert_eq!(
            a.check_load_balancers(3).unwrap_err().to_string(),
            "tenant \"a\" reached its quota of 2 load balancers (quota loadBalancers)"
        );
        assert!(a.check_vips("default", 1).is_ok());
        assert_eq!(
            a.check_vips("default", 2).unwrap_err().to_string(),
            "tenant \"a\" reached its quota of 1 VIPs in pool \"default\" (quota vipsPerPool.default)"
        );
        assert!(a.check_vips("other", 1000).is_ok(), "no quota, no limit");
    }

    #[test]
    fn files_that_would_mix_tenants_up_are_refused() {
        let refused = |tenants: &str| parse(&file(tenants)).unwrap_err();
        assert_eq!(
            refused(&format!(
                "{}, {}",
                tenant("a", r#""c1""#, ""),
                tenant("b", r#""c2", "c1""#, "")
            )),
            TenantsError::SharedCluster {
                cluster: "c1".into(),
                first: "a".into(),
                second: "b".into()
            }
        );
        assert_eq!(
            refused(&format!(
                "{}, {}",
                tenant("a", r#""c1""#, ""),
                tenant("a", r#""c2""#, "")
            )),
            TenantsError::DuplicateTenant("a".into())
        );
        assert_eq!(
            refused(&tenant("a", "", "")),
            TenantsError::NoCluster { tenant: "a".into() }
        );
        assert_eq!(
            refused(&tenant("Not_a_label", r#""c1""#, "")),
            TenantsError::BadName("Not_a_label".into())
        );
        assert_eq!(
            refused(&tenant(
                "a",
                r#""c1""#,
                r#", "quotas": {"vipsPerPool": {"dmz": 1}}"#
            )),
            TenantsError::QuotaOutsidePools {
                tenant: "a".into(),
                pool: "dmz".into()
            }
        );
        assert_eq!(
            parse(r#"{"tenants": []}"#).unwrap_err(),
            TenantsError::Empty
        );
        assert!(matches!(
            parse(r#"{"tenants": [], "extra": 1}"#),
            Err(TenantsError::Syntax(_))
        ));
        assert!(matches!(
            parse(&file(&tenant(
                "a",
                r#""c1""#,
                r#", "rateLimit": {"requestsPerSecond": 0, "burst": 1}"#
            ))),
            Err(TenantsError::Syntax(_))
        ));
    }

    #[test]
    fn the_rate_limit_takes_a_burst_then_says_how_long_to_wait() {
        let limited = r#", "rateLimit": {"requestsPerSecond": 1, "burst": 3}"#;
        let built = parse(&file(&tenant("a", r#""c1""#, limited))).unwrap();
        for _ in 0..3 {
            assert!(built[0].admit().is_ok());
        }
        let wait = built[0].admit().unwrap_err();
        assert!(
            wait > Duration::from_millis(900) && wait <= Duration::from_secs(1),
            "{wait:?}"
        );

        // A reload that keeps the limit keeps the spent bucket; a changed limit starts anew.
        let parsed = TenantsFile::parse(&file(&tenant("a", r#""c1""#, limited))).unwrap();
        assert!(tenants(&parsed, &built).unwrap()[0].admit().is_err());
        let raised = r#", "rateLimit": {"requestsPerSecond": 1, "burst": 4}"#;
        let parsed = TenantsFile::parse(&file(&tenant("a", r#""c1""#, raised))).unwrap();
        assert!(tenants(&parsed, &built).unwrap()[0].admit().is_ok());
    }
}
