//! The mock-cloud provider, on `cloud-mock-sdk`.
//!
//! Finding an LB: by the id persisted on the Service, else by deterministic name + tags.
//! Creating: with an `Idempotency-Key` derived from the Service UID and the spec, so a
//! retried or repeated create after a timeout or a crash returns the same LB. Updating:
//! with `If-Match`, re-reading on a version conflict. LBs whose tags name another cluster
//! are never touched. Every call goes through the shared token bucket; a 429 pauses it for
//! everyone.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::Ipv4Addr;
use std::time::Duration;

use cloud_mock_sdk as sdk;
use sha2::{Digest, Sha256};

use crate::metrics::CloudMetrics;
use crate::provider::{
    ClusterId, DesiredLoadBalancer, HealthCheck, HealthCheckProtocol, Listener, LoadBalancerLookup,
    LoadBalancerMode, LoadBalancerPhase, LoadBalancerProvider, ObservedLoadBalancer, Operation,
    Owner, Protocol, ProviderError, TAG_CLUSTER_ID, TAG_SERVICE_UID,
};
use crate::ratelimit::SharedTokenBucket;

/// Attempts per cloud call for retryable failures (429, 503, transport).
const MAX_ATTEMPTS: u32 = 6;
/// Re-reads after an `If-Match` conflict before giving up for this reconcile.
const MAX_CONFLICT_RETRIES: u32 = 3;

#[derive(Debug, Clone)]
pub struct MockCloudProvider {
    client: sdk::Client,
    bucket: SharedTokenBucket,
    metrics: CloudMetrics,
    retry_base: Duration,
}

// ---- decide: pure conversions ----

fn to_sdk_mode(mode: LoadBalancerMode) -> sdk::Mode {
    match mode {
        LoadBalancerMode::Proxy => sdk::Mode::Proxy,
        LoadBalancerMode::Passthrough => sdk::Mode::Passthrough,
    }
}

fn from_sdk_mode(mode: sdk::Mode) -> LoadBalancerMode {
    match mode {
        sdk::Mode::Proxy => LoadBalancerMode::Proxy,
        sdk::Mode::Passthrough => LoadBalancerMode::Passthrough,
    }
}

fn to_sdk_listener(l: &Listener) -> sdk::Listener {
    sdk::Listener {
        protocol: match l.protocol {
            Protocol::Tcp => sdk::Protocol::Tcp,
            Protocol::Udp => sdk::Protocol::Udp,
        },
        port: l.port,
        backend_port: l.backend_port,
        health_check: l.health_check.as_ref().map(|h| sdk::HealthCheck {
            protocol: match h.protocol {
                HealthCheckProtocol::Tcp => sdk::HealthCheckProtocol::Tcp,
                HealthCheckProtocol::Http => sdk::HealthCheckProtocol::Http,
            },
            port: h.port,
            path: h.path.clone(),
        }),
    }
}

fn from_sdk_listener(l: &sdk::Listener) -> Listener {
    Listener {
        protocol: match l.protocol {
            sdk::Protocol::Tcp => Protocol::Tcp,
            sdk::Protocol::Udp => Protocol::Udp,
        },
        port: l.port,
        backend_port: l.backend_port,
        health_check: l.health_check.as_ref().map(|h| HealthCheck {
            protocol: match h.protocol {
                sdk::HealthCheckProtocol::Tcp => HealthCheckProtocol::Tcp,
                sdk::HealthCheckProtocol::Http => HealthCheckProtocol::Http,
            },
            port: h.port,
            path: h.path.clone(),
        }),
    }
}

fn backends(ips: &BTreeSet<Ipv4Addr>) -> Vec<sdk::Backend> {
    ips.iter().map(|ip| sdk::Backend { ip: *ip }).collect()
}

/// The SDK spec for `desired`; `current_vip` keeps an assigned VIP when none is requested.
pub fn to_sdk_spec(
    desired: &DesiredLoadBalancer,
    current_vip: Option<Ipv4Addr>,
) -> sdk::LoadBalancerSpec {
    sdk::LoadBalancerSpec {
        name: desired.name(),
        tags: desired.owner.tags(),
        mode: to_sdk_mode(desired.mode),
        vip: desired.requested_ip.or(current_vip),
        listeners: desired.listeners.iter().map(to_sdk_listener).collect(),
        backends: backends(&desired.backends),
        source_ranges: desired.source_ranges.clone(),
        address: sdk::AddressRequest::default(),
    }
}

pub fn observe(lb: &sdk::LoadBalancer) -> ObservedLoadBalancer {
    ObservedLoadBalancer {
        id: lb.id.clone(),
        name: lb.spec.name.clone(),
        owner: Owner::from_tags(&lb.spec.tags),
        phase: match lb.state {
            sdk::State::Provisioning => LoadBalancerPhase::Provisioning,
            sdk::State::Active => LoadBalancerPhase::Active,
            sdk::State::Deleting => LoadBalancerPhase::Deleting,
        },
        vip: lb.vip(),
        mode: from_sdk_mode(lb.spec.mode),
        listeners: lb.spec.listeners.iter().map(from_sdk_listener).collect(),
        backends: lb.spec.backends.iter().map(|b| b.ip).collect(),
        source_ranges: lb.spec.source_ranges.clone(),
    }
}

/// The `Idempotency-Key` of a create: the Service UID, the spec, and the LB this create
/// replaces (if any), so re-creating after an LB vanished is a new request, while a retry
/// of the same create is not.
pub fn idempotency_key(spec: &sdk::LoadBalancerSpec, uid: &str, replaces: Option<&str>) -> String {
    let mut hasher = Sha256::new();
    hasher.update(uid.as_bytes());
    hasher.update([0]);
    hasher.update(serde_json::to_vec(spec).unwrap_or_default());
    hasher.update([0]);
    hasher.update(replaces.unwrap_or_default().as_bytes());
    let digest = data_encoding::BASE32_NOPAD.encode(&hasher.finalize());
    format!("{uid}-{}", &digest[..26]).to_lowercase()
}

/// Whether an LB found by id may be treated as the owner's: its tags name the owner's
/// cluster, or it carries no cluster tag but the owner's deterministic name.
pub fn may_touch(lb: &sdk::LoadBalancer, owner: &Owner) -> bool {
    match lb.spec.tags.get(TAG_CLUSTER_ID) {
        Some(cluster) => cluster == owner.cluster_id.as_str(),
        None => lb.spec.name == owner.load_balancer_name(),
    }
}

fn belongs_to(lb: &sdk::LoadBalancer, owner: &Owner) -> bool {
    lb.spec.tags.get(TAG_SERVICE_UID) == Some(&owner.uid)
        || lb.spec.name == owner.load_balancer_name()
}

/// The SDK error as a provider error; `requested_ip` tells a VIP conflict from others.
pub fn classify(
    err: &sdk::Error,
    operation: Operation,
    id: Option<&str>,
    requested_ip: Option<Ipv4Addr>,
) -> ProviderError {
    let mentions_vip = |message: &str| {
        let lower = message.to_lowercase();
        lower.contains("vip") || lower.contains("pool") || lower.contains("address")
    };
    match err {
        sdk::Error::NotFound { .. } => ProviderError::NotFound {
            id: id.unwrap_or_default().to_owned(),
        },
        sdk::Error::Conflict { message } | sdk::Error::Invalid { message }
            if requested_ip.is_some() && mentions_vip(message) =>
        {
            ProviderError::IpUnavailable {
                ip: requested_ip.unwrap_or(Ipv4Addr::UNSPECIFIED),
                message: message.clone(),
            }
        }
        sdk::Error::Conflict { .. } => ProviderError::Conflict {
            operation,
            id: id.unwrap_or_default().to_owned(),
        },
        sdk::Error::Invalid { message } => ProviderError::Invalid {
            operation,
            message: message.clone(),
        },
        sdk::Error::RateLimited { retry_after } => ProviderError::RateLimited {
            operation,
            retry_after: *retry_after,
        },
        sdk::Error::Unauthorized => ProviderError::Unauthorized {
            operation,
            message: err.to_string(),
        },
        sdk::Error::Unavailable { .. } | sdk::Error::Transport(_) | sdk::Error::Decode(_) => {
            ProviderError::Unavailable {
                operation,
                message: err.to_string(),
            }
        }
    }
}

fn outcome(result: &Result<impl Sized, sdk::Error>) -> &'static str {
    match result {
        Ok(_) => "success",
        Err(sdk::Error::NotFound { .. }) => "not_found",
        Err(sdk::Error::Conflict { .. }) => "conflict",
        Err(sdk::Error::Invalid { .. }) => "invalid",
        Err(sdk::Error::RateLimited { .. }) => "rate_limited",
        Err(sdk::Error::Unauthorized) => "unauthorized",
        Err(sdk::Error::Unavailable { .. }) => "unavailable",
        Err(sdk::Error::Transport(_)) => "transport",
        Err(sdk::Error::Decode(_)) => "decode",
    }
}

/// Backoff before retry `attempt` (0-based) of a retryable failure.
fn retry_delay(base: Duration, attempt: u32, err: &sdk::Error) -> Duration {
    match err {
        // The bucket pause already makes us wait; no extra sleep on top.
        sdk::Error::RateLimited { .. } => Duration::ZERO,
        _ => base
            .saturating_mul(1 << attempt.min(6))
            .min(Duration::from_secs(5)),
    }
}

// ---- do: the SDK calls ----

impl MockCloudProvider {
    /// `client` should be built with `max_retries: 0`: retries happen here, through the
    /// shared bucket.
    pub fn new(client: sdk::Client, bucket: SharedTokenBucket, metrics: CloudMetrics) -> Self {
        Self {
            client,
            bucket,
            metrics,
            retry_base: Duration::from_millis(200),
        }
    }

    /// SDK options that leave retries to the provider.
    pub fn client_options(timeout: Duration) -> sdk::ClientOptions {
        sdk::ClientOptions {
            timeout,
            max_retries: 0,
            ..sdk::ClientOptions::default()
        }
    }

    async fn call<T, F, Fut>(&self, operation: Operation, f: F) -> Result<T, sdk::Error>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, sdk::Error>>,
    {
        let mut attempt = 0;
        loop {
            self.bucket.acquire().await;
            let result = f().await;
            self.metrics.record(operation, outcome(&result));
            match result {
                Err(err) if err.is_retryable() && attempt + 1 < MAX_ATTEMPTS => {
                    if let sdk::Error::RateLimited { retry_after } = &err {
                        self.bucket.pause(*retry_after);
                    }
                    let delay = retry_delay(self.retry_base, attempt, &err);
                    tracing::debug!(%operation, attempt, ?delay, error = %err, "retrying cloud call");
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
                Err(err) => {
                    if let sdk::Error::RateLimited { retry_after } = &err {
                        self.bucket.pause(*retry_after);
                    }
                    return Err(err);
                }
                Ok(value) => return Ok(value),
            }
        }
    }

    async fn get_raw(&self, id: &str) -> Result<Option<sdk::LoadBalancer>, ProviderError> {
        match self
            .call(Operation::Get, || self.client.get_load_balancer(id))
            .await
        {
            Ok(lb) => Ok(Some(lb)),
            Err(sdk::Error::NotFound { .. }) => Ok(None),
            Err(err) => Err(classify(&err, Operation::Get, Some(id), None)),
        }
    }

    /// The live LBs of `owner`: the persisted id's alone when it is live and ours, else
    /// every one its tags list (normally one).
    async fn find_raw(
        &self,
        lookup: &LoadBalancerLookup,
    ) -> Result<Vec<sdk::LoadBalancer>, ProviderError> {
        let owner = &lookup.owner;
        if let Some(id) = lookup.known_id.as_deref()
            && let Some(lb) = self.get_raw(id).await?
        {
            if !may_touch(&lb, owner) {
                return Err(ProviderError::ForeignLoadBalancer { id: lb.id });
            }
            // An id annotation copied from another Service must not make us adopt its LB.
            if belongs_to(&lb, owner) && lb.state != sdk::State::Deleting {
                // The id is written right after the create, so a duplicate could only
                // have been made before it, when the lookup below ran and found it: with
                // a known, live id one GET is the whole lookup.
                return Ok(vec![lb]);
            }
        }
        let filter = sdk::ListFilter {
            tags: [
                (TAG_CLUSTER_ID.to_owned(), owner.cluster_id.to_string()),
                (TAG_SERVICE_UID.to_owned(), owner.uid.clone()),
            ]
            .into(),
            name: Some(owner.load_balancer_name()),
        };
        let listed = self
            .call(Operation::List, || self.client.list_load_balancers(&filter))
            .await
            .map_err(|e| classify(&e, Operation::List, None, None))?;
        Ok(listed
            .into_iter()
            .filter(|lb| lb.state != sdk::State::Deleting)
            .collect())
    }

    async fn delete_raw(&self, id: &str) -> Result<(), ProviderError> {
        self.call(Operation::Delete, || self.client.delete_load_balancer(id))
            .await
            .map_err(|e| classify(&e, Operation::Delete, Some(id), None))
    }

    /// Keeps the first LB and deletes any duplicates, so a Service never has two.
    async fn keep_one(
        &self,
        mut found: Vec<sdk::LoadBalancer>,
    ) -> Result<Option<sdk::LoadBalancer>, ProviderError> {
        if found.is_empty() {
            return Ok(None);
        }
        let keep = found.remove(0);
        for duplicate in found {
            tracing::warn!(keep = %keep.id, duplicate = %duplicate.id, "deleting duplicate load balancer");
            self.delete_raw(&duplicate.id).await?;
        }
        Ok(Some(keep))
    }

    /// Writes `spec` over `current`, re-reading on version conflicts.
    async fn update_with_retry(
        &self,
        mut current: sdk::LoadBalancer,
        make_spec: impl Fn(&sdk::LoadBalancer) -> sdk::LoadBalancerSpec,
        requested_ip: Option<Ipv4Addr>,
    ) -> Result<sdk::LoadBalancer, ProviderError> {
        let mut conflicts = 0;
        loop {
            let spec = make_spec(&current);
            let version = current.version;
            let id = current.id.clone();
            match self
                .call(Operation::Update, || {
                    self.client.update_load_balancer(&id, &spec, version)
                })
                .await
            {
                Ok(lb) => return Ok(lb),
                Err(sdk::Error::Conflict { message }) if conflicts < MAX_CONFLICT_RETRIES => {
                    conflicts += 1;
                    let Some(fresh) = self.get_raw(&id).await? else {
                        return Err(ProviderError::NotFound { id });
                    };
                    // Same version: the conflict is not about the version (a taken VIP).
                    if fresh.version == version {
                        return Err(classify(
                            &sdk::Error::Conflict { message },
                            Operation::Update,
                            Some(&id),
                            requested_ip,
                        ));
                    }
                    current = fresh;
                }
                Err(err) => return Err(classify(&err, Operation::Update, Some(&id), requested_ip)),
            }
        }
    }
}

impl LoadBalancerProvider for MockCloudProvider {
    fn name(&self) -> &'static str {
        "mockcloud"
    }

    async fn get(
        &self,
        lookup: &LoadBalancerLookup,
    ) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
        let found = self.find_raw(lookup).await?;
        Ok(found.first().map(observe))
    }

    async fn ensure(
        &self,
        desired: &DesiredLoadBalancer,
        known_id: Option<&str>,
    ) -> Result<ObservedLoadBalancer, ProviderError> {
        let lookup = LoadBalancerLookup {
            known_id: known_id.map(str::to_owned),
            owner: desired.owner.clone(),
        };
        let found = self.find_raw(&lookup).await?;
        match self.keep_one(found).await? {
            None => {
                let spec = to_sdk_spec(desired, None);
                let key = idempotency_key(&spec, &desired.owner.uid, known_id);
                let lb = self
                    .call(Operation::Create, || {
                        self.client.create_load_balancer(&spec, &key)
                    })
                    .await
                    .map_err(|e| classify(&e, Operation::Create, None, desired.requested_ip))?;
                tracing::info!(id = %lb.id, name = %lb.spec.name, "created load balancer");
                Ok(observe(&lb))
            }
            Some(lb) if observe(&lb).drift(desired).is_empty() => Ok(observe(&lb)),
            Some(lb) => {
                let updated = self
                    .update_with_retry(
                        lb,
                        |current| to_sdk_spec(desired, current.vip()),
                        desired.requested_ip,
                    )
                    .await?;
                Ok(observe(&updated))
            }
        }
    }

    async fn update_backends(
        &self,
        lookup: &LoadBalancerLookup,
        backends_wanted: &BTreeSet<Ipv4Addr>,
    ) -> Result<ObservedLoadBalancer, ProviderError> {
        let found = self.find_raw(lookup).await?;
        let Some(lb) = self.keep_one(found).await? else {
            return Err(ProviderError::NotFound {
                id: lookup.known_id.clone().unwrap_or_default(),
            });
        };
        let updated = self
            .update_with_retry(
                lb,
                |current| sdk::LoadBalancerSpec {
                    backends: backends(backends_wanted),
                    ..current.spec.clone()
                },
                None,
            )
            .await?;
        Ok(observe(&updated))
    }

    async fn delete(&self, lookup: &LoadBalancerLookup) -> Result<(), ProviderError> {
        for lb in self.find_raw(lookup).await? {
            self.delete_raw(&lb.id).await?;
            tracing::info!(id = %lb.id, "deleted load balancer");
        }
        Ok(())
    }

    async fn list_owned(
        &self,
        cluster_id: &ClusterId,
    ) -> Result<Vec<ObservedLoadBalancer>, ProviderError> {
        let filter = sdk::ListFilter {
            tags: [(TAG_CLUSTER_ID.to_owned(), cluster_id.to_string())].into(),
            name: None,
        };
        let listed = self
            .call(Operation::List, || self.client.list_load_balancers(&filter))
            .await
            .map_err(|e| classify(&e, Operation::List, None, None))?;
        Ok(listed
            .iter()
            .filter(|lb| {
                lb.spec.tags.get(TAG_CLUSTER_ID).map(String::as_str) == Some(cluster_id.as_str())
            })
            .map(observe)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desired() -> DesiredLoadBalancer {
        DesiredLoadBalancer {
            owner: Owner {
                cluster_id: "c1".parse().unwrap(),
                namespace: "default".into(),
                name: "web".into(),
                uid: "11111111-2222-3333-4444-555555555555".into(),
            },
            mode: LoadBalancerMode::Passthrough,
            requested_ip: None,
            listeners: vec![Listener {
                protocol: Protocol::Udp,
                port: 53,
                backend_port: 30053,
                health_check: Some(HealthCheck {
                    protocol: HealthCheckProtocol::Http,
                    port: 10256,
                    path: Some("/healthz".into()),
                }),
            }],
            backends: BTreeSet::from([Ipv4Addr::new(198, 18, 0, 11)]),
            source_ranges: vec!["203.0.113.0/24".parse().unwrap()],
        }
    }

    fn lb_from(spec: sdk::LoadBalancerSpec) -> sdk::LoadBalancer {
        sdk::LoadBalancer {
            id: "lb-1".into(),
            spec: sdk::LoadBalancerSpec {
                vip: Some(Ipv4Addr::new(198, 51, 100, 3)),
                ..spec
            },
            state: sdk::State::Active,
            version: 1,
            health: vec![],
        }
    }

    #[test]
    fn spec_round_trips_without_drift() {
        let d = desired();
        let observed = observe(&lb_from(to_sdk_spec(&d, None)));
        assert!(observed.drift(&d).is_empty(), "{:?}", observed.drift(&d));
        assert_eq!(observed.owner.as_ref(), Some(&d.owner));
        assert_eq!(observed.vip, Some(Ipv4Addr::new(198, 51, 100, 3)));
        assert_eq!(observed.phase, LoadBalancerPhase::Active);
    }

    #[test]
    fn requested_ip_wins_over_current_vip() {
        let mut d = desired();
        let current = Some(Ipv4Addr::new(198, 51, 100, 3));
        assert_eq!(to_sdk_spec(&d, current).vip, current);
        d.requested_ip = Some(Ipv4Addr::new(198, 51, 100, 9));
        assert_eq!(to_sdk_spec(&d, current).vip, d.requested_ip);
    }

    #[test]
    fn idempotency_key_is_stable_and_distinguishes_replacements() {
        let spec = to_sdk_spec(&desired(), None);
        let uid = &desired().owner.uid;
        let a = idempotency_key(&spec, uid, None);
        assert_eq!(a, idempotency_key(&spec, uid, None));
        assert_ne!(a, idempotency_key(&spec, uid, Some("lb-1")));
        let mut other = spec.clone();
        other.listeners[0].port = 54;
        assert_ne!(a, idempotency_key(&other, uid, None));
        assert!(a.starts_with(uid.as_str()));
        assert!(a.len() < 100);
    }

    #[test]
    fn foreign_cluster_lbs_are_untouchable() {
        let d = desired();
        let ours = lb_from(to_sdk_spec(&d, None));
        assert!(may_touch(&ours, &d.owner));
        let mut foreign = ours.clone();
        foreign
            .spec
            .tags
            .insert(TAG_CLUSTER_ID.into(), "other".into());
        assert!(!may_touch(&foreign, &d.owner));
        let mut untagged = ours.clone();
        untagged.spec.tags.clear();
        assert!(may_touch(&untagged, &d.owner));
        untagged.spec.name = "someone-elses".into();
        assert!(!may_touch(&untagged, &d.owner));
    }

    #[test]
    fn errors_are_classified() {
        let vip = Some(Ipv4Addr::new(198, 51, 100, 9));
        let taken = sdk::Error::Conflict {
            message: "VIP 198.51.100.9 is already in use".into(),
        };
        assert!(matches!(
            classify(&taken, Operation::Create, None, vip),
            ProviderError::IpUnavailable { .. }
        ));
        let outside = sdk::Error::Invalid {
            message: "vip 10.0.0.1 is outside the pool 198.51.100.0/24".into(),
        };
        assert!(matches!(
            classify(
                &outside,
                Operation::Create,
                None,
                Some(Ipv4Addr::new(10, 0, 0, 1))
            ),
            ProviderError::IpUnavailable { .. }
        ));
        assert!(matches!(
            classify(&taken, Operation::Update, Some("lb-1"), None),
            ProviderError::Conflict { .. }
        ));
        assert!(matches!(
            classify(
                &sdk::Error::RateLimited {
                    retry_after: Duration::from_secs(2)
                },
                Operation::Get,
                None,
                None
            ),
            ProviderError::RateLimited { .. }
        ));
        assert!(
            classify(
                &sdk::Error::Unavailable {
                    message: "x".into()
                },
                Operation::Get,
                None,
                None
            )
            .category()
                == "unavailable"
        );
    }

    #[test]
    fn retry_delay_doubles_and_is_capped() {
        let err = sdk::Error::Unavailable {
            message: String::new(),
        };
        let base = Duration::from_millis(200);
        assert_eq!(retry_delay(base, 0, &err), Duration::from_millis(200));
        assert_eq!(retry_delay(base, 2, &err), Duration::from_millis(800));
        assert_eq!(retry_delay(base, 10, &err), Duration::from_secs(5));
        let limited = sdk::Error::RateLimited {
            retry_after: Duration::from_secs(3),
        };
        assert_eq!(retry_delay(base, 0, &limited), Duration::ZERO);
    }
}
