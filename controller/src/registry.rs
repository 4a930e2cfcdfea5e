//! The providers a binary runs with, registered by name. `--cloud-provider NAME` picks one
//! and `--cloud-config FILE` hands it its own configuration, which it parses itself, as
//! Kubernetes' cloud controllers do (`cloudprovider.RegisterCloudProvider`). The library
//! knows no provider: each lives in a crate of its own and hands the binary a
//! [`Registration`], and the binary lists them in its [`Providers`]. Adding a provider is
//! its crate plus one line there.

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::metrics::CloudMetrics;
use crate::provider::{
    Capabilities, ClusterId, DesiredLoadBalancer, DesiredNodePool, LoadBalancerLookup,
    LoadBalancerProvider, ObservedLoadBalancer, ObservedNodePool, Profile, ProviderError,
};
use crate::ratelimit::SharedTokenBucket;

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

/// The configuration text `--cloud-url URL --cloud-token-file FILE` stand for.
pub type FromUrlFlags = fn(url: &str, token_file: &Path) -> Result<String, ConfigError>;

/// One provider: its profile and how to build it.
#[derive(Debug, Clone, Copy)]
pub struct Registration {
    pub profile: &'static Profile,
    /// Builds the provider from the text of its `--cloud-config` file (`None`: no file).
    /// Called once at start-up, off the async runtime, so it may read files it names.
    pub build: fn(config: Option<&str>, shared: Shared) -> Result<DynProvider, ConfigError>,
    /// For a provider that takes `--cloud-url` and `--cloud-token-file`, the configuration
    /// they stand for; `None`: it is configured by its file alone.
    pub from_url_flags: Option<FromUrlFlags>,
}

impl Registration {
    /// Builds the provider from its configuration text.
    pub fn provider(
        &self,
        config: Option<&str>,
        shared: Shared,
    ) -> Result<DynProvider, RegistryError> {
        (self.build)(config, shared).map_err(|source| RegistryError::Config {
            provider: self.profile.name,
            source,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("no cloud provider {name:?}; known: {}", known.join(", "))]
    Unknown {
        name: String,
        known: Vec<&'static str>,
    },
    #[error("cloud provider {provider}: {source}")]
    Config {
        provider: &'static str,
        #[source]
        source: ConfigError,
    },
    /// Two registrations would read the same Services: one name, annotation prefix or
    /// default class for both.
    #[error("cloud providers {first} and {second} have the same {what}")]
    Clash {
        first: &'static str,
        second: &'static str,
        what: &'static str,
    },
}

/// The providers a binary registers, the first the default of `--cloud-provider`.
#[derive(Debug, Clone, Copy)]
pub struct Providers(&'static [Registration]);

impl Providers {
    pub const fn new(registrations: &'static [Registration]) -> Self {
        Self(registrations)
    }

    /// The registered names, for `--cloud-provider`.
    pub fn names(&self) -> Vec<&'static str> {
        self.0.iter().map(|r| r.profile.name).collect()
    }

    /// The provider `--cloud-provider` means when it is not given.
    pub fn default_name(&self) -> Option<&'static str> {
        self.0.first().map(|r| r.profile.name)
    }

    pub fn find(&self, name: &str) -> Result<&'static Registration, RegistryError> {
        self.0
            .iter()
            .find(|r| r.profile.name == name)
            .ok_or_else(|| RegistryError::Unknown {
                name: name.to_owned(),
                known: self.names(),
            })
    }

    /// Refuses two providers that share a name, an annotation prefix or a default class,
    /// which would pick or serve one another's Services.
    pub fn check(&self) -> Result<(), RegistryError> {
        for (index, a) in self.0.iter().enumerate() {
            for b in &self.0[index + 1..] {
                let (a, b) = (a.profile, b.profile);
                let what = if a.name == b.name {
                    "name"
                } else if a.annotation_prefix == b.annotation_prefix {
                    "annotation prefix"
                } else if a.default_class == b.default_class {
                    "default loadBalancerClass"
                } else {
                    continue;
                };
                return Err(RegistryError::Clash {
                    first: a.name,
                    second: b.name,
                    what,
                });
            }
        }
        Ok(())
    }
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

    /// A registration of `profile` that is never built here.
    const fn of(profile: &'static Profile) -> Registration {
        Registration {
            profile,
            build: |_, _| Err("not built in these tests".into()),
            from_url_flags: None,
        }
    }

    const ONE: Profile = Profile {
        name: "one",
        annotation_prefix: "example.com/one-",
        default_class: "example.com/one",
    };

    const OTHER: Profile = Profile {
        name: "other",
        annotation_prefix: "example.com/other-",
        default_class: "example.com/other",
    };

    #[test]
    fn names_are_found_and_the_first_is_the_default() {
        static LIST: [Registration; 2] = [of(&ONE), of(&OTHER)];
        let providers = Providers::new(&LIST);
        assert_eq!(providers.names(), ["one", "other"]);
        assert_eq!(providers.default_name(), Some("one"));
        assert_eq!(providers.find("other").unwrap().profile.name, "other");
        let unknown = providers.find("nope").unwrap_err().to_string();
        assert_eq!(unknown, r#"no cloud provider "nope"; known: one, other"#);
        providers.check().unwrap();
        assert_eq!(Providers::new(&[]).default_name(), None);
    }

    #[test]
    fn a_configuration_error_names_its_provider() {
        let shared = Shared {
            bucket: SharedTokenBucket::new(1.0, 1),
            metrics: CloudMetrics::default(),
            timeout: Duration::from_secs(1),
        };
        let error = of(&ONE).provider(None, shared).unwrap_err();
        assert_eq!(
            error.to_string(),
            "cloud provider one: not built in these tests"
        );
    }

    #[test]
    fn providers_that_would_share_services_are_refused() {
        const SAME_CLASS: Profile = Profile {
            name: "third",
            annotation_prefix: "example.com/third-",
            default_class: OTHER.default_class,
        };
        static CLASHING: [Registration; 3] = [of(&ONE), of(&OTHER), of(&SAME_CLASS)];
        assert_eq!(
            Providers::new(&CLASHING).check().unwrap_err().to_string(),
            "cloud providers other and third have the same default loadBalancerClass"
        );
        static TWICE: [Registration; 2] = [of(&OTHER), of(&OTHER)];
        assert!(matches!(
            Providers::new(&TWICE).check(),
            Err(RegistryError::Clash { what: "name", .. })
        ));
    }
}
