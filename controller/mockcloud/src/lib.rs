//! The mock-cloud provider, on `cloud-mock-sdk`: the controller's only code that knows
//! that cloud. A binary registers it with [`REGISTRATION`].
//!
//! Finding an LB: by the id persisted on the Service, else by deterministic name + tags.
//! Creating: with an `Idempotency-Key` derived from the Service UID and the spec, so a
//! retried or repeated create after a timeout or a crash returns the same LB. Updating:
//! with `If-Match` on the version the reconcile observed, re-reading only on a conflict.
//! LBs whose tags name another cluster are never touched. Every call goes through the
//! shared token bucket; a 429 pauses it for everyone. A token file that changes is read
//! again (see [`TokenFile`]): a rotated token needs no restart. A client certificate (mutual
//! TLS) is read at the start alone: a renewed one needs a restart.

mod config;
mod convert;
mod errors;
mod token;

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cloud_mock_sdk as sdk;
use cloud_mock_sdk::families;
use tandem_controller::metrics::CloudMetrics;
use tandem_controller::provider::{
    Capabilities, ClusterId, DesiredLoadBalancer, DesiredNodePool, LoadBalancerLookup,
    LoadBalancerProvider, ObservedLoadBalancer, ObservedNodePool, Operation, Profile,
    ProviderError, TAG_CLUSTER_ID, TAG_SERVICE_UID,
};
use tandem_controller::ratelimit::SharedTokenBucket;
use tandem_controller::registry::{self, DynProvider, Registration, Shared};

pub use config::{Config, ConfigError};
pub use convert::{
    create_request, may_touch, observe, observe_node_pool, to_sdk_node_pool, to_sdk_spec,
};
pub use errors::classify;
pub use token::{LOOK_INTERVAL, TokenFile};

use convert::{belongs_to, kept_vips};
use errors::{is_address_refusal, outcome, retry_delay};

pub const PROFILE: Profile = Profile {
    name: "mockcloud",
    annotation_prefix: "service.beta.kubernetes.io/mockcloud-load-balancer-",
    default_class: "tandem.io/mockcloud",
};

pub const REGISTRATION: Registration = Registration {
    profile: &PROFILE,
    build,
    from_url_flags: Some(from_url_flags),
};

/// Builds the provider from its configuration file (see [`Config`]).
fn build(config: Option<&str>, shared: Shared) -> Result<DynProvider, registry::ConfigError> {
    let config = Config::parse(config.ok_or(ConfigError::Missing)?)?;
    let options = sdk::ClientOptions {
        root_certificates: config.ca()?,
        client_identity: config.client_identity(),
        ..MockCloudProvider::client_options(shared.timeout)
    };
    let (token_file, token) = TokenFile::open(&config.token_file)?;
    let client = sdk::Client::with_edges(&config.edges(), token, options)?;
    Ok(DynProvider::new(
        MockCloudProvider::new(client, shared.bucket, shared.metrics).with_token_file(token_file),
    ))
}

fn from_url_flags(url: &str, token_file: &Path) -> Result<String, registry::ConfigError> {
    Ok(Config::shortcut(url, token_file)?)
}

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
    token_file: Option<Arc<TokenFile>>,
}

impl MockCloudProvider {
    /// `client` should be built with `max_retries: 0`: retries happen here, through the
    /// shared bucket.
    pub fn new(client: sdk::Client, bucket: SharedTokenBucket, metrics: CloudMetrics) -> Self {
        Self {
            client,
            bucket,
            metrics,
            retry_base: Duration::from_millis(200),
            token_file: None,
        }
    }

    /// Sends the token of `file` (the one `client` was built with, at first), and the next
    /// one whenever the file changes.
    pub fn with_token_file(self, file: TokenFile) -> Self {
        Self {
            token_file: Some(Arc::new(file)),
            ..self
        }
    }

    /// Whether the token file holds a new token, which the next call then sends. `now`:
    /// read it whatever the time since the last read.
    async fn take_rotated_token(&self, now: bool) -> bool {
        let Some(file) = &self.token_file else {
            return false;
        };
        let Some(token) = file.changed(now).await else {
            return false;
        };
        match self.client.set_token(&token) {
            Ok(()) => {
                tracing::info!("the token file changed: cloud calls carry its new token");
                true
            }
            Err(error) => {
                tracing::warn!(%error, "the token file's new token cannot be sent; calls keep the one before");
                false
            }
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
        let mut token_retried = false;
        loop {
            self.bucket.acquire().await;
            self.take_rotated_token(false).await;
            let result = f().await;
            self.metrics.record(operation, outcome(&result));
            match result {
                // The edge can drop the old token before this file was looked at again:
                // one retry with the new token. With the same token it would fail alike.
                Err(sdk::Error::Unauthorized)
                    if !token_retried && self.take_rotated_token(true).await =>
                {
                    tracing::info!(%operation, "cloud refused the token; retrying with the new one");
                    token_retried = true;
                }
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

    async fn get_raw(&self, id: &str) -> Result<Option<families::LoadBalancer>, ProviderError> {
        let cloud = self.client.families();
        match self
            .call(Operation::Get, || cloud.get_load_balancer(id))
            .await
        {
            Ok(lb) => Ok(Some(lb)),
            Err(sdk::Error::NotFound { .. }) => Ok(None),
            Err(err) => Err(classify(&err, Operation::Get, Some(id))),
        }
    }

    /// The LBs of `owner`, being deleted or not: the persisted id's alone when it is live
    /// and ours, else every one its tags list (normally one).
    async fn find_raw(
        &self,
        lookup: &LoadBalancerLookup,
    ) -> Result<Vec<families::LoadBalancer>, ProviderError> {
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
        let cloud = self.client.families();
        let listed = self
            .call(Operation::List, || cloud.list_load_balancers(&filter))
            .await
            .map_err(|e| classify(&e, Operation::List, None))?;
        Ok(listed)
    }

    async fn delete_raw(&self, id: &str) -> Result<(), ProviderError> {
        self.call(Operation::Delete, || self.client.delete_load_balancer(id))
            .await
            .map_err(|e| classify(&e, Operation::Delete, Some(id)))
    }

    /// Keeps the first LB and deletes any duplicates, so a Service never has two.
    async fn keep_one(
        &self,
        mut found: Vec<families::LoadBalancer>,
    ) -> Result<Option<families::LoadBalancer>, ProviderError> {
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

    /// Writes `desired` over LB `id` at `version`, re-reading only on a version conflict.
    async fn update_with_retry(
        &self,
        id: &str,
        mut version: u64,
        mut kept: Vec<std::net::IpAddr>,
        desired: &DesiredLoadBalancer,
    ) -> Result<families::LoadBalancer, ProviderError> {
        let cloud = self.client.families();
        let mut conflicts = 0;
        loop {
            let spec = to_sdk_spec(desired, &kept);
            match self
                .call(Operation::Update, || {
                    cloud.update_load_balancer(id, &spec, version)
                })
                .await
            {
                Ok(lb) => return Ok(lb),
                // A stale version is worth a re-read; an address refusal is not.
                Err(conflict @ sdk::Error::Conflict { .. })
                    if conflicts < MAX_CONFLICT_RETRIES && !is_address_refusal(&conflict) =>
                {
                    conflicts += 1;
                    let Some(fresh) = self.get_raw(id).await? else {
                        return Err(ProviderError::NotFound { id: id.to_owned() });
                    };
                    // Same version: the conflict is not about the version (the LB is deleting).
                    if fresh.version == version {
                        return Err(classify(&conflict, Operation::Update, Some(id)));
                    }
                    version = fresh.version;
                    kept = kept_vips(
                        desired,
                        fresh.vips(),
                        fresh.spec.address.pool.as_deref(),
                        fresh.spec.address.sharing_key.as_deref(),
                    );
                }
                Err(err) => {
                    return Err(classify(&err, Operation::Update, Some(id)));
                }
            }
        }
    }
}

impl LoadBalancerProvider for MockCloudProvider {
    fn profile(&self) -> &'static Profile {
        &PROFILE
    }

    /// The edge's API takes TCP and UDP listeners in either mode, VIPs of both families and
    /// node pools.
    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }

    async fn get(
        &self,
        lookup: &LoadBalancerLookup,
    ) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
        let mut found = self.find_raw(lookup).await?;
        found.retain(|lb| lb.state != sdk::State::Deleting);
        Ok(self.keep_one(found).await?.as_ref().map(observe))
    }

    /// One read the edge holds until the LB is active (`?waitMs=`).
    async fn await_provisioned(
        &self,
        lb: &ObservedLoadBalancer,
        within: Duration,
    ) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
        let cloud = self.client.families();
        let id = lb.id.as_str();
        match self
            .call(Operation::AwaitProvisioned, || {
                cloud.get_load_balancer_provisioned(id, within)
            })
            .await
        {
            Ok(found)
                if found.state != sdk::State::Deleting
                    && lb
                        .owner
                        .as_ref()
                        .is_some_and(|owner| belongs_to(&found, owner)) =>
            {
                Ok(Some(observe(&found)))
            }
            // Deleted, or no longer its owner's: gone, as far as this LB is concerned.
            Ok(_) | Err(sdk::Error::NotFound { .. }) => Ok(None),
            Err(err) => Err(classify(&err, Operation::AwaitProvisioned, Some(id))),
        }
    }

    fn planned_id(&self, desired: &DesiredLoadBalancer, replaces: Option<&str>) -> Option<String> {
        let spec = to_sdk_spec(desired, &[]);
        Some(create_request(&spec, &desired.owner.uid, replaces).id)
    }

    async fn create(
        &self,
        desired: &DesiredLoadBalancer,
        replaces: Option<&str>,
    ) -> Result<ObservedLoadBalancer, ProviderError> {
        let spec = to_sdk_spec(desired, &[]);
        let request = create_request(&spec, &desired.owner.uid, replaces);
        let cloud = self.client.families();
        let lb = self
            .call(Operation::Create, || {
                cloud.create_load_balancer_as(&request.id, &spec, &request.idempotency_key)
            })
            .await
            .map_err(|e| classify(&e, Operation::Create, Some(&request.id)))?;
        tracing::info!(id = %lb.id, name = %lb.spec.name, "created load balancer");
        Ok(observe(&lb))
    }

    async fn update(
        &self,
        current: &ObservedLoadBalancer,
        desired: &DesiredLoadBalancer,
    ) -> Result<ObservedLoadBalancer, ProviderError> {
        let updated = self
            .update_with_retry(
                &current.id,
                current.version,
                kept_vips(
                    desired,
                    &current.vips,
                    current.pool.as_deref(),
                    current.sharing_key.as_deref(),
                ),
                desired,
            )
            .await?;
        Ok(observe(&updated))
    }

    async fn delete(
        &self,
        lookup: &LoadBalancerLookup,
    ) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
        let mut remaining = None;
        for mut lb in self.find_raw(lookup).await? {
            if lb.state != sdk::State::Deleting {
                self.delete_raw(&lb.id).await?;
                tracing::info!(id = %lb.id, "deleting load balancer");
                lb.state = sdk::State::Deleting;
            }
            remaining.get_or_insert(observe(&lb));
        }
        Ok(remaining)
    }

    async fn list_owned(
        &self,
        cluster_id: &ClusterId,
    ) -> Result<Vec<ObservedLoadBalancer>, ProviderError> {
        let filter = sdk::ListFilter {
            tags: [(TAG_CLUSTER_ID.to_owned(), cluster_id.to_string())].into(),
            name: None,
        };
        let cloud = self.client.families();
        let listed = self
            .call(Operation::List, || cloud.list_load_balancers(&filter))
            .await
            .map_err(|e| classify(&e, Operation::List, None))?;
        Ok(listed
            .iter()
            .filter(|lb| {
                lb.spec.tags.get(TAG_CLUSTER_ID).map(String::as_str) == Some(cluster_id.as_str())
            })
            .map(observe)
            .collect())
    }

    async fn get_node_pool(&self, name: &str) -> Result<Option<ObservedNodePool>, ProviderError> {
        match self
            .call(Operation::GetNodePool, || self.client.get_node_pool(name))
            .await
        {
            Ok(pool) => Ok(Some(observe_node_pool(&pool))),
            Err(sdk::Error::NotFound { .. }) => Ok(None),
            Err(err) => Err(classify(&err, Operation::GetNodePool, Some(name))),
        }
    }

    async fn put_node_pool(
        &self,
        desired: &DesiredNodePool,
        version: Option<u64>,
    ) -> Result<ObservedNodePool, ProviderError> {
        let spec = to_sdk_node_pool(desired);
        let pool = self
            .call(Operation::PutNodePool, || {
                self.client.put_node_pool(&desired.name, &spec, version)
            })
            .await
            .map_err(|e| classify(&e, Operation::PutNodePool, Some(&desired.name)))?;
        Ok(observe_node_pool(&pool))
    }

    async fn list_owned_node_pools(
        &self,
        cluster_id: &ClusterId,
    ) -> Result<Vec<ObservedNodePool>, ProviderError> {
        let filter = sdk::ListFilter {
            tags: [(TAG_CLUSTER_ID.to_owned(), cluster_id.to_string())].into(),
            name: None,
        };
        let listed = self
            .call(Operation::ListNodePools, || {
                self.client.list_node_pools(&filter)
            })
            .await
            .map_err(|e| classify(&e, Operation::ListNodePools, None))?;
        Ok(listed
            .iter()
            .map(observe_node_pool)
            .filter(|pool| pool.is_owned_by_cluster(cluster_id))
            .collect())
    }

    async fn delete_node_pool(&self, name: &str) -> Result<(), ProviderError> {
        match self
            .call(Operation::DeleteNodePool, || {
                self.client.delete_node_pool(name)
            })
            .await
        {
            Ok(()) | Err(sdk::Error::NotFound { .. }) => Ok(()),
            Err(err) => Err(classify(&err, Operation::DeleteNodePool, Some(name))),
        }
    }
}
