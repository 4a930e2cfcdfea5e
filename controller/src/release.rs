//! `tandem-controller release-load-balancers`: what `helm uninstall` runs (a pre-delete
//! hook) before the controller goes, so that nothing of ours is left behind: no load
//! balancer or node pool in the cloud, no finalizer that keeps a Service terminating
//! forever, no stale ingress, no leader Lease.
//!
//! By default it refuses while any of our Services of type LoadBalancer exist: releasing
//! them would take their VIPs away for good, and the running controller is what releases
//! an LB properly (Events, status, finalizer). Delete those Services (or change their type)
//! first. `--release-in-use` releases them too; stop the controller before using it, or it
//! provisions them again.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use serde_json::json;

use crate::metrics::CloudMetrics;
use crate::plan::{Ownership, finalizers_without_ours, has_finalizer, lookup_of, ownership};
use crate::provider::{
    ClusterId, LoadBalancerLookup, LoadBalancerProvider, ProviderError, delete_ours,
};
use crate::runtime::{self, RuntimeError, Settings};
use crate::spec::{AnnotationKeys, ClassFilter, is_load_balancer};
use crate::status::current_ingress;

/// Flags of `release-load-balancers`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReleaseArgs {
    /// Also release the LBs of Services that still use them (their VIPs are lost).
    #[arg(long, env = "TANDEM_RELEASE_IN_USE")]
    pub release_in_use: bool,
    /// Seconds the whole release may take.
    #[arg(long, env = "TANDEM_RELEASE_TIMEOUT_SECONDS", default_value_t = 120)]
    pub timeout_seconds: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error(
        "refusing to release: {} Service(s) of type LoadBalancer still use a load balancer \
         of this controller: {}. Delete them or change their type while the controller \
         runs, then uninstall again (or pass --release-in-use to give up their load \
         balancers and VIPs)",
        .0.len(), .0.join(", ")
    )]
    InUse(Vec<String>),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{what}: {source}")]
    Cloud {
        what: String,
        #[source]
        source: ProviderError,
    },
    #[error("not finished within {0:?}")]
    Timeout(Duration),
}

/// What to do to one Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceRelease {
    pub namespace: String,
    pub name: String,
    /// The LB to delete, when the Service can still name its owner.
    pub lookup: Option<LoadBalancerLookup>,
    pub clear_ingress: bool,
    pub remove_finalizer: bool,
}

/// The whole decision, from the listed Services alone.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReleasePlan {
    /// `namespace/name` of our LoadBalancer Services that are not being deleted.
    pub in_use: Vec<String>,
    pub services: Vec<ServiceRelease>,
}

fn has_ingress(svc: &Service) -> bool {
    !current_ingress(svc).is_empty()
}

/// Decides what to release: every Service that is ours (by class, or by our finalizer
/// whatever its class says now) and carries our finalizer or an ingress we wrote
/// (LoadBalancer Services in use only with `release_in_use`).
pub fn plan(
    services: &[Service],
    keys: &AnnotationKeys,
    classes: &ClassFilter,
    cluster_id: &ClusterId,
    release_in_use: bool,
) -> ReleasePlan {
    let mut plan = ReleasePlan::default();
    for svc in services.iter() {
        let ownership = ownership(svc, classes);
        if ownership == Ownership::Ignore {
            continue;
        }
        let in_use = ownership == Ownership::Ensure;
        let namespace = svc.namespace().unwrap_or_default();
        if in_use {
            plan.in_use.push(format!("{namespace}/{}", svc.name_any()));
            if !release_in_use {
                continue;
            }
        }
        let clear_ingress = is_load_balancer(svc) && has_ingress(svc);
        let remove_finalizer = has_finalizer(svc);
        if !clear_ingress && !remove_finalizer {
            continue;
        }
        plan.services.push(ServiceRelease {
            name: svc.name_any(),
            lookup: lookup_of(svc, keys, cluster_id).ok(),
            namespace,
            clear_ingress,
            remove_finalizer,
        });
    }
    plan
}

/// Lists, decides, and releases: Services first (ingress, LB, finalizer, in the order the
/// controller's own cleanup uses), then every LB still tagged with our cluster id, then the
/// leader Lease.
pub async fn run(
    client: kube::Client,
    settings: &Settings,
    args: &ReleaseArgs,
) -> Result<(), ReleaseError> {
    let timeout = Duration::from_secs(args.timeout_seconds.max(1));
    tokio::time::timeout(timeout, release(client, settings, args))
        .await
        .map_err(|_| ReleaseError::Timeout(timeout))?
}

async fn release(
    client: kube::Client,
    settings: &Settings,
    args: &ReleaseArgs,
) -> Result<(), ReleaseError> {
    let kube_err = |what: &str| {
        let what = what.to_owned();
        move |source| ReleaseError::Kube { what, source }
    };
    let cloud_err = |what: String| move |source| ReleaseError::Cloud { what, source };

    let services = Api::<Service>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(kube_err("listing Services"))?
        .items;
    let provider = runtime::cloud_provider(settings, CloudMetrics::default()).await?;
    let plan = plan(
        &services,
        &AnnotationKeys::of(provider.profile()),
        &settings.classes,
        &settings.cluster_id,
        args.release_in_use,
    );
    if !plan.in_use.is_empty() && !args.release_in_use {
        return Err(ReleaseError::InUse(plan.in_use));
    }

    for svc in &plan.services {
        let service = format!("{}/{}", svc.namespace, svc.name);
        let api = Api::<Service>::namespaced(client.clone(), &svc.namespace);
        if svc.clear_ingress {
            let patch = json!({"status": {"loadBalancer": {"ingress": null}}});
            api.patch_status(&svc.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(kube_err(&format!("clearing the ingress of {service}")))?;
        }
        if let Some(lookup) = &svc.lookup {
            delete_until_gone(&provider, lookup)
                .await
                .map_err(cloud_err(format!(
                    "deleting the load balancer of {service}"
                )))?;
            tracing::info!(%service, "released load balancer");
        }
        if svc.remove_finalizer {
            remove_finalizer(&api, &svc.name)
                .await
                .map_err(kube_err(&format!("removing the finalizer of {service}")))?;
        }
    }

    let leftovers = provider
        .list_owned(&settings.cluster_id)
        .await
        .map_err(cloud_err("listing our load balancers".to_owned()))?;
    for lb in leftovers {
        let Some(lookup) = lb.lookup() else {
            continue;
        };
        tracing::info!(id = %lb.id, service = %lookup.owner.display_name(), "deleting load balancer without a Service");
        delete_until_gone(&provider, &lookup)
            .await
            .map_err(cloud_err(format!("deleting load balancer {}", lb.id)))?;
    }

    // With every LB gone, nothing references the cluster's node pool any more.
    if provider.capabilities().node_pools {
        let pools = provider
            .list_owned_node_pools(&settings.cluster_id)
            .await
            .map_err(cloud_err("listing our node pools".to_owned()))?;
        for pool in pools {
            provider
                .delete_node_pool(&pool.name)
                .await
                .map_err(cloud_err(format!("deleting node pool {}", pool.name)))?;
            tracing::info!(pool = %pool.name, "deleted node pool");
        }
    }

    if let Some(election) = &settings.leader_election {
        let leases = Api::<Lease>::namespaced(client, &election.namespace);
        match leases
            .delete(&election.lease_name, &DeleteParams::default())
            .await
        {
            Ok(_) => tracing::info!(lease = %election.lease_name, "deleted the leader Lease"),
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(source) => return Err(kube_err("deleting the leader Lease")(source)),
        }
    }
    tracing::info!(
        services = plan.services.len(),
        "released every load balancer of this cluster"
    );
    Ok(())
}

/// Deletes an LB and waits until the cloud no longer lists it, so that nothing the
/// release leaves behind is still in the cloud (the hook's timeout bounds the wait).
async fn delete_until_gone<P: LoadBalancerProvider>(
    provider: &P,
    lookup: &LoadBalancerLookup,
) -> Result<(), ProviderError> {
    while let Some(deleting) = delete_ours(provider, lookup).await? {
        tracing::debug!(id = %deleting.id, "waiting for the load balancer to be deleted");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok(())
}

/// Removes our finalizer with a merge patch that carries the resourceVersion it read, so a
/// concurrent change to the finalizers is never overwritten (retried on conflict).
async fn remove_finalizer(api: &Api<Service>, name: &str) -> Result<(), kube::Error> {
    let mut attempt = 0;
    loop {
        let Some(svc) = api.get_opt(name).await? else {
            return Ok(());
        };
        if !has_finalizer(&svc) {
            return Ok(());
        }
        let patch = json!({
            "metadata": {
                "resourceVersion": svc.resource_version(),
                "finalizers": finalizers_without_ours(&svc),
            }
        });
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Err(kube::Error::Api(status)) if status.code == 409 && attempt < 5 => attempt += 1,
            other => return other.map(|_| ()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::FINALIZER;
    use crate::spec::tests::KEYS;
    use k8s_openapi::api::core::v1::{
        LoadBalancerIngress, LoadBalancerStatus, ServiceSpec, ServiceStatus,
    };
    use kube::api::ObjectMeta;

    fn classes() -> ClassFilter {
        ClassFilter {
            class: "tandem.io/mockcloud".into(),
            claim_unclassed: true,
        }
    }

    fn svc(name: &str, type_: &str, finalizer: bool, ingress: bool) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                uid: Some(format!("uid-{name}")),
                finalizers: finalizer.then(|| vec![FINALIZER.to_owned()]),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                type_: Some(type_.into()),
                ..ServiceSpec::default()
            }),
            status: ingress.then(|| ServiceStatus {
                load_balancer: Some(LoadBalancerStatus {
                    ingress: Some(vec![LoadBalancerIngress {
                        ip: Some("198.51.100.7".into()),
                        ..LoadBalancerIngress::default()
                    }]),
                }),
                ..ServiceStatus::default()
            }),
        }
    }

    fn cluster() -> ClusterId {
        "lab".parse().unwrap()
    }

    #[test]
    fn in_use_load_balancers_are_reported_and_left_alone_by_default() {
        let services = [
            svc("web", "LoadBalancer", true, true),
            svc("plain", "ClusterIP", false, false),
        ];
        let plan = plan(&services, &KEYS, &classes(), &cluster(), false);
        assert_eq!(plan.in_use, vec!["default/web"]);
        assert!(plan.services.is_empty());
    }

    #[test]
    fn release_in_use_releases_everything_of_ours() {
        let services = [svc("web", "LoadBalancer", true, true)];
        let plan = plan(&services, &KEYS, &classes(), &cluster(), true);
        let release = &plan.services[0];
        assert!(release.clear_ingress && release.remove_finalizer);
        assert_eq!(
            release.lookup.as_ref().map(|l| l.owner.uid.as_str()),
            Some("uid-web")
        );
    }

    #[test]
    fn leftover_finalizers_are_removed_from_services_no_longer_load_balancers() {
        let mut terminating = svc("gone", "LoadBalancer", true, false);
        terminating.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
        );
        let services = [svc("was-lb", "NodePort", true, false), terminating];
        let plan = plan(&services, &KEYS, &classes(), &cluster(), false);
        assert!(plan.in_use.is_empty());
        let names: Vec<_> = plan.services.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, vec!["was-lb", "gone"]);
        assert!(
            plan.services
                .iter()
                .all(|s| s.remove_finalizer && !s.clear_ingress)
        );
    }

    #[test]
    fn a_class_service_switched_to_cluster_ip_is_released_by_its_finalizer() {
        // The API server cleared its class with its type; our finalizer still names us.
        let leftover = svc("switched", "ClusterIP", true, false);
        let unclaimed = ClassFilter {
            claim_unclassed: false,
            ..classes()
        };
        let plan = plan(&[leftover], &KEYS, &unclaimed, &cluster(), false);
        assert_eq!(plan.services.len(), 1);
        assert!(plan.services[0].remove_finalizer);
        assert!(plan.in_use.is_empty());
    }

    #[test]
    fn other_classes_are_never_touched() {
        let mut foreign = svc("other", "LoadBalancer", false, true);
        if let Some(spec) = foreign.spec.as_mut() {
            spec.load_balancer_class = Some("example.com/other".into());
        }
        let plan = plan(&[foreign], &KEYS, &classes(), &cluster(), true);
        assert_eq!(plan, ReleasePlan::default());
    }
}
