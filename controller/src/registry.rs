//! The providers, registered by name in one place. `--cloud-provider NAME` picks one and
//! `--cloud-config FILE` hands it its own configuration, which it parses itself, as
//! Kubernetes' cloud controllers do (`cloudprovider.RegisterCloudProvider`). Nothing else
//! in the controller knows which cloud it talks to: adding a provider is its module plus
//! one line in [`PROVIDERS`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::metrics::CloudMetrics;
use crate::provider::{
    Capabilities, ClusterId, DesiredLoadBalancer, DesiredNodePool, LoadBalancerLookup,
    LoadBalancerProvider, ObservedLoadBalancer, ObservedNodePool, Profile, ProviderError,
};
use crate::ratelimit::SharedTokenBucket;

/// Every provider the controller can run with.
const PROVIDERS: &[Registration] = &[crate::mockcloud::REGISTRATION];

/// What the controller gives every provider it builds: the one cloud-API token bucket
/// (`--cloud-rate`, `--cloud-burst`), the cloud-call metrics, and the bound on one cloud
/// call (`--cloud-timeout-seconds`).
#[derive(Debug, Clone)]
pub struct Shared {
    pub bucket: SharedTokenBucket,
    pub metrics: CloudMetrics,
    pub timeout: Duration,
}

/// A provider's error about its configuration, in its own words.
pub type ConfigError = Box<dyn std::error::Error + Send + Sync>;

/// One provider: its profile and how to build it.
#[derive(Debug, Clone, Copy)]
pub struct Registration {
    pub profile: &'static Profile,
    /// Builds the provider from the text of its `--cloud-config` file (`None`: no file).
    /// Called once at start-up, off the async runtime, so it may read files it names.
    pub build: fn(config: Option<&str>, shared: Shared) -> Result<DynProvider, ConfigError>,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("no cloud provider {name:?}; known: {}", names().join(", "))]
    Unknown { name: String },
    #[error("cloud provider {provider}: {source}")]
    Config {
        provider: &'static str,
        #[source]
        source: ConfigError,
    },
}

/// The registered names, for `--cloud-provider`.
pub fn names() -> Vec<&'static str> {
    PROVIDERS.iter().map(|r| r.profile.name).collect()
}

pub fn find(name: &str) -> Result<&'static Registration, RegistryError> {
    PROVIDERS
        .iter()
        .find(|r| r.profile.name == name)
        .ok_or_else(|| RegistryError::Unknown {
            name: name.to_owned(),
        })
}

/// Builds the provider `name` from its configuration text.
pub fn build(
    name: &str,
    config: Option<&str>,
    shared: Shared,
) -> Result<DynProvider, RegistryError> {
    let registration = find(name)?;
    (registration.build)(config, shared).map_err(|source| RegistryError::Config {
        provider: registration.profile.name,
        source,
    })
}

type Answer<'a, T> = Pin<Box<dyn Future<Output = Result<T, ProviderError>> + Send + 'a>>;

/// [`LoadBalancerProvider`] with boxed futures, so one type can hold any provider.
trait Erased: Send + Sync + 'static {
    fn profile(&self) -> &'static Profile;
    fn capabilities(&self) -> Capabilities;
    fn planned_id(&self, desired: &DesiredLoadBalancer, replaces: Option<&str>) -> Option<String>;
    fn get<'a>(
        &'a self,
        lookup: &'a LoadBalancerLookup,
    ) -> Answer<'a, Option<ObservedLoadBalancer>>;
    fn create<'a>(
        &'a self,
        desired: &'a DesiredLoadBalancer,
        replaces: Option<&'a str>,
    ) -> Answer<'a, ObservedLoadBalancer>;
    fn update<'a>(
        &'a self,
        current: &'a ObservedLoadBalancer,
        desired: &'a DesiredLoadBalancer,
    ) -> Answer<'a, ObservedLoadBalancer>;
    fn delete<'a>(
        &'a self,
        lookup: &'a LoadBalancerLookup,
    ) -> Answer<'a, Option<ObservedLoadBalancer>>;
    fn await_provisioned<'a>(
        &'a self,
        lb: &'a ObservedLoadBalancer,
        within: Duration,
    ) -> Answer<'a, Option<ObservedLoadBalancer>>;
    fn list_owned<'a>(&'a self, cluster_id: &'a ClusterId)
    -> Answer<'a, Vec<ObservedLoadBalancer>>;
    fn get_node_pool<'a>(&'a self, name: &'a str) -> Answer<'a, Option<ObservedNodePool>>;
    fn put_node_pool<'a>(
        &'a self,
        desired: &'a DesiredNodePool,
        version: Option<u64>,
    ) -> Answer<'a, ObservedNodePool>;
    fn list_owned_node_pools<'a>(
        &'a self,
        cluster_id: &'a ClusterId,
    ) -> Answer<'a, Vec<ObservedNodePool>>;
    fn delete_node_pool<'a>(&'a self, name: &'a str) -> Answer<'a, ()>;
}

impl<P: LoadBalancerProvider> Erased for P {
    fn profile(&self) -> &'static Profile {
        LoadBalancerProvider::profile(self)
    }
    fn capabilities(&self) -> Capabilities {
        LoadBalancerProvider::capabilities(self)
    }
    fn planned_id(&self, desired: &DesiredLoadBalancer, replaces: Option<&str>) -> Option<String> {
        LoadBalancerProvider::planned_id(self, desired, replaces)
    }
    fn get<'a>(
        &'a self,
        lookup: &'a LoadBalancerLookup,
    ) -> Answer<'a, Option<ObservedLoadBalancer>> {
        Box::pin(LoadBalancerProvider::get(self, lookup))
    }
    fn create<'a>(
        &'a self,
        desired: &'a DesiredLoadBalancer,
        replaces: Option<&'a str>,
    ) -> Answer<'a, ObservedLoadBalancer> {
        Box::pin(LoadBalancerProvider::create(self, desired, replaces))
    }
    fn update<'a>(
        &'a self,
        current: &'a ObservedLoadBalancer,
        desired: &'a DesiredLoadBalancer,
    ) -> Answer<'a, ObservedLoadBalancer> {
        Box::pin(LoadBalancerProvider::update(self, current, desired))
    }
    fn delete<'a>(
        &'a self,
        lookup: &'a LoadBalancerLookup,
    ) -> Answer<'a, Option<ObservedLoadBalancer>> {
        Box::pin(LoadBalancerProvider::delete(self, lookup))
    }
    fn await_provisioned<'a>(
        &'a self,
        lb: &'a ObservedLoadBalancer,
        within: Duration,
    ) -> Answer<'a, Option<ObservedLoadBalancer>> {
        Box::pin(LoadBalancerProvider::await_provisioned(self, lb, within))
    }
    fn list_owned<'a>(
        &'a self,
        cluster_id: &'a ClusterId,
    ) -> Answer<'a, Vec<ObservedLoadBalancer>> {
        Box::pin(LoadBalancerProvider::list_owned(self, cluster_id))
    }
    fn get_node_pool<'a>(&'a self, name: &'a str) -> Answer<'a, Option<ObservedNodePool>> {
        Box::pin(LoadBalancerProvider::get_node_pool(self, name))
    }
    fn put_node_pool<'a>(
        &'a self,
        desired: &'a DesiredNodePool,
        version: Option<u64>,
    ) -> Answer<'a, ObservedNodePool> {
        Box::pin(LoadBalancerProvider::put_node_pool(self, desired, version))
    }
    fn list_owned_node_pools<'a>(
        &'a self,
        cluster_id: &'a ClusterId,
    ) -> Answer<'a, Vec<ObservedNodePool>> {
        Box::pin(LoadBalancerProvider::list_owned_node_pools(
            self, cluster_id,
        ))
    }
    fn delete_node_pool<'a>(&'a self, name: &'a str) -> Answer<'a, ()> {
        Box::pin(LoadBalancerProvider::delete_node_pool(self, name))
    }
}

/// Any provider, chosen at run time. Cheap to clone.
#[derive(Clone)]
pub struct DynProvider(Arc<dyn Erased>);

impl DynProvider {
    pub fn new(provider: impl LoadBalancerProvider) -> Self {
        Self(Arc::new(provider))
    }
}

impl fmt::Debug for DynProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DynProvider")
            .field(&self.0.profile().name)
            .finish()
    }
}

impl LoadBalancerProvider for DynProvider {
    fn profile(&self) -> &'static Profile {
        self.0.profile()
    }

    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }

    fn planned_id(&self, desired: &DesiredLoadBalancer, replaces: Option<&str>) -> Option<String> {
        self.0.planned_id(desired, replaces)
    }

    async fn get(
        &self,
        lookup: &LoadBalancerLookup,
    ) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
        self.0.get(lookup).await
    }

    async fn create(
        &self,
        desired: &DesiredLoadBalancer,
        replaces: Option<&str>,
    ) -> Result<ObservedLoadBalancer, ProviderError> {
        self.0.create(desired, replaces).await
    }

    async fn update(
        &self,
        current: &ObservedLoadBalancer,
        desired: &DesiredLoadBalancer,
    ) -> Result<ObservedLoadBalancer, ProviderError> {
        self.0.update(current, desired).await
    }

    async fn delete(
        &self,
        lookup: &LoadBalancerLookup,
    ) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
        self.0.delete(lookup).await
    }

    async fn await_provisioned(
        &self,
        lb: &ObservedLoadBalancer,
        within: Duration,
    ) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
        self.0.await_provisioned(lb, within).await
    }

    async fn list_owned(
        &self,
        cluster_id: &ClusterId,
    ) -> Result<Vec<ObservedLoadBalancer>, ProviderError> {
        self.0.list_owned(cluster_id).await
    }

    async fn get_node_pool(&self, name: &str) -> Result<Option<ObservedNodePool>, ProviderError> {
        self.0.get_node_pool(name).await
    }

    async fn put_node_pool(
        &self,
        desired: &DesiredNodePool,
        version: Option<u64>,
    ) -> Result<ObservedNodePool, ProviderError> {
        self.0.put_node_pool(desired, version).await
    }

    async fn list_owned_node_pools(
        &self,
        cluster_id: &ClusterId,
    ) -> Result<Vec<ObservedNodePool>, ProviderError> {
        self.0.list_owned_node_pools(cluster_id).await
    }

    async fn delete_node_pool(&self, name: &str) -> Result<(), ProviderError> {
        self.0.delete_node_pool(name).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_found() {
        let all = names();
        for name in &all {
            assert_eq!(all.iter().filter(|n| *n == name).count(), 1, "{name}");
            assert_eq!(find(name).unwrap().profile.name, *name);
        }
        assert!(all.contains(&"mockcloud"));
        let unknown = find("nope").unwrap_err().to_string();
        assert!(unknown.contains("mockcloud"), "{unknown}");
    }

    #[test]
    fn profiles_have_distinct_prefixes_and_classes() {
        for a in PROVIDERS {
            for b in PROVIDERS {
                if a.profile.name != b.profile.name {
                    assert_ne!(a.profile.annotation_prefix, b.profile.annotation_prefix);
                    assert_ne!(a.profile.default_class, b.profile.default_class);
                }
            }
        }
    }
}
