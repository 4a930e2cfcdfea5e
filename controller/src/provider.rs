//! The cloud-provider seam: a provider-neutral description of the load balancer a Service
//! needs, what a provider reports back, and the trait every cloud implements (after
//! `cloudprovider.LoadBalancer`, but split into get / create / update / delete so that the
//! controller decides which one call a reconcile makes, plus list_owned for orphan
//! collection). Reconcile logic only ever talks to [`LoadBalancerProvider`], so adding a
//! cloud touches nothing else.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;
use std::net::IpAddr;
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;
use tandem_common::IpFamily;

/// How the cloud delivers traffic to the nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoadBalancerMode {
    /// The LB terminates the connection and forwards to `nodeIP:nodePort`.
    Proxy,
    /// The LB routes the VIP to a node unchanged.
    Passthrough,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HealthCheckProtocol {
    Tcp,
    Http,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HealthCheck {
    pub protocol: HealthCheckProtocol,
    pub port: u16,
    /// Only meaningful for HTTP checks.
    pub path: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Listener {
    pub protocol: Protocol,
    pub port: u16,
    pub backend_port: u16,
    pub health_check: Option<HealthCheck>,
}

/// A validated cluster id: 1..=24 chars of `[a-z0-9-]`, so LB names stay within 63 chars.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClusterId(String);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid cluster id {0:?}: want 1 to 24 characters of [a-z0-9-]")]
pub struct InvalidClusterId(String);

impl FromStr for ClusterId {
    type Err = InvalidClusterId;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let valid = !s.is_empty()
            && s.len() <= 24
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if valid {
            Ok(Self(s.to_owned()))
        } else {
            Err(InvalidClusterId(s.to_owned()))
        }
    }
}

impl ClusterId {
    /// The name of the cluster's node pool (at most 34 characters).
    pub fn node_pool_name(&self) -> String {
        format!("k8s-{}-nodes", self.0)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClusterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Tag keys written on every LB; they prove ownership and drive orphan collection.
pub const TAG_CLUSTER_ID: &str = "kubernetes.io/cluster-id";
pub const TAG_SERVICE_NAMESPACE: &str = "kubernetes.io/service-namespace";
pub const TAG_SERVICE_NAME: &str = "kubernetes.io/service-name";
pub const TAG_SERVICE_UID: &str = "kubernetes.io/service-uid";
/// On a node pool beside [`TAG_CLUSTER_ID`]: the UID of the cluster's `kube-system`
/// Namespace, which two clusters never share, so two controllers given the same cluster id
/// find out before either touches the other's load balancers.
pub const TAG_CLUSTER_UID: &str = "tandem.io/cluster-uid";

/// The Service (and cluster) an LB belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner {
    pub cluster_id: ClusterId,
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl Owner {
    /// The deterministic LB name: the same Service in the same cluster always maps to the
    /// same name, so a lost create response can be found again.
    pub fn load_balancer_name(&self) -> String {
        let uid: String = self.uid.chars().filter(|c| *c != '-').take(32).collect();
        format!("k8s-{}-{}", self.cluster_id, uid)
    }

    pub fn tags(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (TAG_CLUSTER_ID.to_owned(), self.cluster_id.to_string()),
            (TAG_SERVICE_NAMESPACE.to_owned(), self.namespace.clone()),
            (TAG_SERVICE_NAME.to_owned(), self.name.clone()),
            (TAG_SERVICE_UID.to_owned(), self.uid.clone()),
        ])
    }

    /// Reads an owner back from LB tags; `None` when any tag is missing or the cluster id is
    /// malformed (such an LB is never ours).
    pub fn from_tags(tags: &BTreeMap<String, String>) -> Option<Self> {
        Some(Self {
            cluster_id: tags.get(TAG_CLUSTER_ID)?.parse().ok()?,
            namespace: tags.get(TAG_SERVICE_NAMESPACE)?.clone(),
            name: tags.get(TAG_SERVICE_NAME)?.clone(),
            uid: tags.get(TAG_SERVICE_UID)?.clone(),
        })
    }

    pub fn display_name(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// What a provider is, said once in its module: the name `--cloud-provider` picks it by,
/// the prefix of the Service annotations it reads, and the `spec.loadBalancerClass` it
/// serves unless `--load-balancer-class` names another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    pub name: &'static str,
    /// E.g. `service.beta.kubernetes.io/mockcloud-load-balancer-`: the annotations are this
    /// followed by `id`, `mode`, `ip`, … (see [`crate::spec::AnnotationKeys`]).
    pub annotation_prefix: &'static str,
    pub default_class: &'static str,
}

/// What a provider's load balancers can do. The controller checks every desired LB
/// against them before any cloud call: a Service that needs what its provider lacks gets
/// a condition and an Event that say so, never a lesser LB in silence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// UDP listeners.
    pub udp: bool,
    /// Proxy mode: the LB forwards to `nodeIP:nodePort`.
    pub proxy: bool,
    /// Passthrough mode: the LB routes the VIP to a node unchanged.
    pub passthrough: bool,
    /// IPv6 VIPs (IPv6-only and dual-stack Services).
    pub ipv6: bool,
    /// Node pools: one named set of backends per cluster that LBs reference, so a node
    /// change is one pool write whatever the number of LBs. Without them every LB carries
    /// its own backends and a node change updates each.
    pub node_pools: bool,
    /// Reads that wait out provisioning ([`LoadBalancerProvider::await_provisioned`]): the
    /// cloud holds a read of a provisioning LB until it is active, so a create costs the
    /// create and that one read however long provisioning takes, and the Service gets its
    /// ingress as soon as the LB serves. Without them the controller reads again every
    /// few seconds.
    pub waits_out_provisioning: bool,
}

impl Capabilities {
    /// Everything the controller can ask for.
    pub const ALL: Self = Self {
        udp: true,
        proxy: true,
        passthrough: true,
        ipv6: true,
        node_pools: true,
        waits_out_provisioning: true,
    };

    /// The first thing `desired` needs that these capabilities lack.
    pub fn check(&self, desired: &DesiredLoadBalancer) -> Result<(), Unsupported> {
        let udp_ports: Vec<u16> = desired
            .listeners
            .iter()
            .filter(|l| l.protocol == Protocol::Udp)
            .map(|l| l.port)
            .collect();
        let mode = match desired.mode {
            LoadBalancerMode::Proxy => self.proxy,
            LoadBalancerMode::Passthrough => self.passthrough,
        };
        if !mode {
            Err(Unsupported::Mode(desired.mode))
        } else if !self.udp && !udp_ports.is_empty() {
            Err(Unsupported::Udp(udp_ports))
        } else if !self.ipv6 && desired.ip_families.contains(&IpFamily::V6) {
            Err(Unsupported::Ipv6)
        } else {
            Ok(())
        }
    }
}

/// What a Service needs that its provider cannot do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsupported {
    #[error("no UDP listeners (the Service's UDP ports: {})", joined(.0))]
    Udp(Vec<u16>),
    #[error("no {} mode", mode_name(*.0))]
    Mode(LoadBalancerMode),
    #[error("no IPv6 addresses (the Service's ipFamilies include IPv6)")]
    Ipv6,
}

fn joined(ports: &[u16]) -> String {
    ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn mode_name(mode: LoadBalancerMode) -> &'static str {
    match mode {
        LoadBalancerMode::Proxy => "proxy",
        LoadBalancerMode::Passthrough => "passthrough",
    }
}

/// Where an LB's addresses come from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressRequest {
    /// The address pool to allocate from; `None` leaves it to the cloud's default pool.
    pub pool: Option<String>,
    /// Requested addresses, at most one per IP family, each of a family the LB has.
    pub requested: Vec<IpAddr>,
    /// LBs with the same key may share one address per family when their (protocol, port)
    /// sets do not overlap; without a key the addresses are the LB's alone.
    pub sharing_key: Option<String>,
}

impl AddressRequest {
    /// The requested address of `family`, if any.
    pub fn requested_of(&self, family: IpFamily) -> Option<IpAddr> {
        self.requested
            .iter()
            .copied()
            .find(|ip| IpFamily::of(*ip) == family)
    }
}

/// Everything a provider needs to build the LB for one Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredLoadBalancer {
    pub owner: Owner,
    pub mode: LoadBalancerMode,
    /// The families of its VIPs, one VIP each, in the Service's `spec.ipFamilies` order.
    pub ip_families: Vec<IpFamily>,
    pub address: AddressRequest,
    /// Sorted by (protocol, port).
    pub listeners: Vec<Listener>,
    /// Node addresses of the LB's families: each VIP goes to those of its own family.
    /// With a [`Self::node_pool`] the pool carries them to the cloud, and this is only
    /// what the controller knows of them (for its conditions and Events).
    pub backends: BTreeSet<IpAddr>,
    /// The cluster's node pool the LB references instead of carrying `backends` (when the
    /// provider has [`Capabilities::node_pools`]).
    pub node_pool: Option<String>,
    /// Sorted and deduplicated, of the LB's families: each applies to its family's VIP (a
    /// VIP whose family has none is open to every source, as kube-proxy reads them).
    pub source_ranges: Vec<IpNet>,
}

impl DesiredLoadBalancer {
    pub fn name(&self) -> String {
        self.owner.load_balancer_name()
    }

    /// The LB's families that no backend has an address of: their VIPs reach no node.
    pub fn families_without_backends(&self) -> Vec<IpFamily> {
        self.ip_families
            .iter()
            .copied()
            .filter(|family| !self.backends.iter().any(|ip| IpFamily::of(*ip) == *family))
            .collect()
    }
}

/// The cluster's node pool as the controller wants it: every eligible node, of every family
/// (each LB's VIPs use the members of their own family).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredNodePool {
    pub name: String,
    pub cluster_id: ClusterId,
    /// See [`TAG_CLUSTER_UID`].
    pub cluster_uid: String,
    pub backends: BTreeSet<IpAddr>,
}

impl DesiredNodePool {
    pub fn tags(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (TAG_CLUSTER_ID.to_owned(), self.cluster_id.to_string()),
            (TAG_CLUSTER_UID.to_owned(), self.cluster_uid.clone()),
        ])
    }
}

/// A node pool as the cloud reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedNodePool {
    pub name: String,
    /// The cloud's version of the pool: a write is conditional on it.
    pub version: u64,
    pub tags: BTreeMap<String, String>,
    pub backends: BTreeSet<IpAddr>,
    /// How many LBs reference it.
    pub load_balancers: usize,
}

impl ObservedNodePool {
    /// The `kube-system` UID of the cluster that claimed it, if any (see [`TAG_CLUSTER_UID`]).
    pub fn cluster_uid(&self) -> Option<&str> {
        self.tags.get(TAG_CLUSTER_UID).map(String::as_str)
    }

    /// Whether it is tagged with `cluster_id`.
    pub fn is_owned_by_cluster(&self, cluster_id: &ClusterId) -> bool {
        self.tags.get(TAG_CLUSTER_ID).map(String::as_str) == Some(cluster_id.as_str())
    }

    /// Whether it already is `desired` (members and tags): nothing to write.
    pub fn matches(&self, desired: &DesiredNodePool) -> bool {
        self.backends == desired.backends && self.tags == desired.tags()
    }
}

/// Where the provider should look for an existing LB.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadBalancerLookup {
    /// The id persisted on the Service, if any; tried first.
    pub known_id: Option<String>,
    pub owner: Owner,
}

/// The lifecycle phase a provider reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadBalancerPhase {
    Provisioning,
    Active,
    Deleting,
}

/// An LB as the cloud reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedLoadBalancer {
    pub id: String,
    /// The cloud's version of the LB: an update is conditional on it (`If-Match`).
    pub version: u64,
    pub name: String,
    pub owner: Option<Owner>,
    pub phase: LoadBalancerPhase,
    /// The families of its VIPs, in order.
    pub ip_families: Vec<IpFamily>,
    /// The assigned VIPs, one per family, in the order of `ip_families`; may be empty when
    /// the LB has a `hostname`.
    pub vips: Vec<IpAddr>,
    /// The DNS name clients reach the LB by, when the cloud gives one (as AWS NLBs do),
    /// beside the VIPs or instead of them.
    pub hostname: Option<String>,
    /// The pool the VIPs belong to, when the cloud says.
    pub pool: Option<String>,
    pub sharing_key: Option<String>,
    pub mode: LoadBalancerMode,
    pub listeners: Vec<Listener>,
    /// Its backends: its own, or its node pool's members.
    pub backends: BTreeSet<IpAddr>,
    /// The node pool it references, if any.
    pub node_pool: Option<String>,
    pub source_ranges: Vec<IpNet>,
}

/// The fields in which an observed LB differs from the desired one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drift {
    Mode,
    IpFamilies,
    Listeners,
    Backends,
    NodePool,
    SourceRanges,
    Vip,
    Pool,
    SharingKey,
    Tags,
}

impl ObservedLoadBalancer {
    /// The assigned VIP of `family`.
    pub fn vip_of(&self, family: IpFamily) -> Option<IpAddr> {
        self.vips
            .iter()
            .copied()
            .find(|vip| IpFamily::of(*vip) == family)
    }

    /// The VIPs of `families`, in that order, or the first family that has none.
    pub fn vips_of(&self, families: &[IpFamily]) -> Result<Vec<IpAddr>, IpFamily> {
        families
            .iter()
            .map(|family| self.vip_of(*family).ok_or(*family))
            .collect()
    }

    /// Compares in a canonical order, so listing order in the cloud never counts as drift;
    /// the order of the families does count (it is the order of the Service's ingress).
    pub fn drift(&self, desired: &DesiredLoadBalancer) -> Vec<Drift> {
        let mut drift = Vec::new();
        if self.mode != desired.mode {
            drift.push(Drift::Mode);
        }
        if self.ip_families != desired.ip_families {
            drift.push(Drift::IpFamilies);
        }
        if canonical(&self.listeners) != canonical(&desired.listeners) {
            drift.push(Drift::Listeners);
        }
        // An LB on a node pool follows the pool, which node sync keeps: its members are no
        // business of the LB's.
        if self.node_pool != desired.node_pool {
            drift.push(Drift::NodePool);
        } else if desired.node_pool.is_none() && self.backends != desired.backends {
            drift.push(Drift::Backends);
        }
        if canonical(&self.source_ranges) != canonical(&desired.source_ranges) {
            drift.push(Drift::SourceRanges);
        }
        let moved = desired.address.requested.iter().any(|requested| {
            self.vip_of(IpFamily::of(*requested))
                .is_some_and(|vip| vip != *requested)
        });
        if moved {
            drift.push(Drift::Vip);
        }
        // No pool named: whichever pool the cloud chose is fine.
        if let Some(pool) = &desired.address.pool
            && self.pool.as_ref() != Some(pool)
        {
            drift.push(Drift::Pool);
        }
        if self.sharing_key != desired.address.sharing_key {
            drift.push(Drift::SharingKey);
        }
        if self.owner.as_ref() != Some(&desired.owner) {
            drift.push(Drift::Tags);
        }
        drift
    }

    /// How to find this LB again: by its id, for its owner; `None` for an LB without one
    /// (never ours to touch).
    pub fn lookup(&self) -> Option<LoadBalancerLookup> {
        Some(LoadBalancerLookup {
            known_id: Some(self.id.clone()),
            owner: self.owner.clone()?,
        })
    }

    pub fn is_owned_by_cluster(&self, cluster_id: &ClusterId) -> bool {
        self.owner
            .as_ref()
            .is_some_and(|owner| &owner.cluster_id == cluster_id)
    }
}

fn canonical<T: Ord + Clone>(items: &[T]) -> Vec<T> {
    let mut sorted = items.to_vec();
    sorted.sort();
    sorted.dedup();
    sorted
}

/// A cloud operation, for metrics and error context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operation {
    Get,
    /// A read held until the LB has left provisioning.
    AwaitProvisioned,
    List,
    Create,
    Update,
    Delete,
    GetNodePool,
    PutNodePool,
    ListNodePools,
    DeleteNodePool,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Get => "get",
            Operation::AwaitProvisioned => "await_provisioned",
            Operation::List => "list",
            Operation::Create => "create",
            Operation::Update => "update",
            Operation::Delete => "delete",
            Operation::GetNodePool => "get_node_pool",
            Operation::PutNodePool => "put_node_pool",
            Operation::ListNodePools => "list_node_pools",
            Operation::DeleteNodePool => "delete_node_pool",
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the cloud will not give a Service the address it asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddressRefusal {
    /// No pool of that name.
    UnknownPool,
    /// The pool has no free address left.
    PoolExhausted,
    /// The requested address is in no pool (or not in the named one).
    OutsidePools,
    /// Another LB holds the requested address and may not share it.
    Taken,
    /// A sharer of the address already serves one of the (protocol, port) pairs.
    PortConflict,
    /// A sharer of the address uses the other LB mode.
    SharingModeMismatch,
    /// The pool has no addresses of a family the LB asks for.
    PoolLacksFamily,
    /// The pool exists, but our credentials may not draw addresses from it (a cloud whose
    /// accounts or tenants are each given some pools).
    PoolNotPermitted,
}

impl AddressRefusal {
    /// A bounded label for metrics.
    pub fn category(self) -> &'static str {
        match self {
            AddressRefusal::UnknownPool => "unknown_pool",
            AddressRefusal::PoolExhausted => "pool_exhausted",
            AddressRefusal::OutsidePools => "address_outside_pools",
            AddressRefusal::Taken => "address_taken",
            AddressRefusal::PortConflict => "port_conflict",
            AddressRefusal::SharingModeMismatch => "sharing_mode_mismatch",
            AddressRefusal::PoolLacksFamily => "pool_lacks_family",
            AddressRefusal::PoolNotPermitted => "pool_not_permitted",
        }
    }
}

/// What went wrong talking to a cloud.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ProviderError {
    /// The message is the cloud's and names the pool, address or clash.
    #[error("address refused: {message}")]
    AddressRefused {
        refusal: AddressRefusal,
        message: String,
    },
    #[error("the cloud rejected the load balancer {operation}: {message}")]
    Invalid {
        operation: Operation,
        message: String,
    },
    /// The cloud cannot serve what the Service asks (a listener its balancer cannot serve,
    /// though the provider's capabilities let it pass); the message is the cloud's and
    /// names it (the port).
    #[error("the cloud cannot serve the load balancer: {message}")]
    Unsupported {
        operation: Operation,
        message: String,
    },
    #[error("load balancer {id} belongs to another cluster; refusing to touch it")]
    ForeignLoadBalancer { id: String },
    #[error("cloud rate limit on {operation}; retry after {retry_after:?}")]
    RateLimited {
        operation: Operation,
        retry_after: Duration,
    },
    #[error("the cloud refused our credentials on {operation}: {message}")]
    Unauthorized {
        operation: Operation,
        message: String,
    },
    /// The create or update would pass a quota of our account; the message is the cloud's
    /// and names the quota. Raising it or freeing LBs cures it, not a retry soon.
    #[error("quota exceeded: {message}")]
    QuotaExceeded { message: String },
    /// The cloud knows our credentials but does not let them do this (an LB of a cluster
    /// they are not bound to, a route they may not call); the message is the cloud's.
    #[error("cloud {operation} forbidden: {message}")]
    Forbidden {
        operation: Operation,
        message: String,
    },
    #[error("load balancer {id} changed concurrently during {operation}")]
    Conflict { operation: Operation, id: String },
    #[error("load balancer {id} not found")]
    NotFound { id: String },
    /// An LB names a node pool the cloud does not have (deleted behind our back): node
    /// sync writes it again.
    #[error("the cloud has no such node pool: {message}")]
    NodePoolMissing { message: String },
    /// The node pool is still referenced by load balancers.
    #[error("node pool {name} is still in use by load balancers")]
    NodePoolInUse { name: String },
    /// The node pool of our cluster id was claimed by another cluster: two controllers
    /// were given the same cluster id.
    #[error(
        "node pool {name} belongs to another cluster (kube-system UID {claimed_by}, ours is {ours}): two clusters share the cluster id; give each its own --cluster-id"
    )]
    ForeignNodePool {
        name: String,
        claimed_by: String,
        ours: String,
    },
    #[error("cloud {operation} failed: {message}")]
    Unavailable {
        operation: Operation,
        message: String,
    },
}

impl ProviderError {
    /// A bounded label for metrics, Events and conditions.
    pub fn category(&self) -> &'static str {
        match self {
            ProviderError::AddressRefused { refusal, .. } => refusal.category(),
            ProviderError::Invalid { .. } => "invalid_request",
            ProviderError::Unsupported { .. } => "unsupported",
            ProviderError::ForeignLoadBalancer { .. } => "foreign_load_balancer",
            ProviderError::RateLimited { .. } => "rate_limited",
            ProviderError::Unauthorized { .. } => "unauthorized",
            ProviderError::QuotaExceeded { .. } => "quota_exceeded",
            ProviderError::Forbidden { .. } => "forbidden",
            ProviderError::Conflict { .. } => "conflict",
            ProviderError::NotFound { .. } => "not_found",
            ProviderError::NodePoolMissing { .. } => "node_pool_missing",
            ProviderError::NodePoolInUse { .. } => "node_pool_in_use",
            ProviderError::ForeignNodePool { .. } => "foreign_node_pool",
            ProviderError::Unavailable { .. } => "unavailable",
        }
    }

    /// Permanent errors will not go away by retrying the same request soon; the Service
    /// (or the cloud) has to change first. The reconciler waits for that change, with a
    /// slow backstop retry (`ratelimit::PERMANENT_ERROR_RETRY`).
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            ProviderError::AddressRefused { .. }
                | ProviderError::Invalid { .. }
                | ProviderError::Unsupported { .. }
                | ProviderError::ForeignLoadBalancer { .. }
                | ProviderError::ForeignNodePool { .. }
                | ProviderError::Unauthorized { .. }
                | ProviderError::QuotaExceeded { .. }
                | ProviderError::Forbidden { .. }
        )
    }
}

/// Deletes the LB of `lookup.owner`. A persisted id that names another cluster's LB is
/// never touched: the lookup goes on by our name and tags alone. Every path that releases a
/// Service's LB (reconcile cleanup, the uninstall hook) deletes through here.
pub async fn delete_ours<P: LoadBalancerProvider>(
    provider: &P,
    lookup: &LoadBalancerLookup,
) -> Result<Option<ObservedLoadBalancer>, ProviderError> {
    match provider.delete(lookup).await {
        Err(ProviderError::ForeignLoadBalancer { id }) => {
            tracing::warn!(%id, "persisted id names a foreign load balancer; ignoring it");
            let by_owner = LoadBalancerLookup {
                known_id: None,
                owner: lookup.owner.clone(),
            };
            provider.delete(&by_owner).await
        }
        other => other,
    }
}

/// A cloud that can provide external load balancers (cf. `cloudprovider.LoadBalancer`).
///
/// Reads and writes are separate so a reconcile can observe once, decide, then make exactly
/// the write it decided on. Implementations must be idempotent: every method may be retried
/// after a timeout, and `create` must never make a second LB for the same request.
pub trait LoadBalancerProvider: Send + Sync + 'static {
    /// Its name, annotation prefix and default class.
    fn profile(&self) -> &'static Profile;

    /// What its LBs can do; the controller refuses a Service that needs more.
    fn capabilities(&self) -> Capabilities;

    /// Finds the LB of `lookup.owner`, by id first, then by its deterministic name and tags.
    /// `ForeignLoadBalancer` when the id names an LB of another cluster.
    fn get(
        &self,
        lookup: &LoadBalancerLookup,
    ) -> impl Future<Output = Result<Option<ObservedLoadBalancer>, ProviderError>> + Send;

    /// The id [`create`](Self::create)`(desired, replaces)` gives the LB, when the cloud
    /// lets the client choose it (as GCE's names, or AIP-133's `{resource}_id`): the
    /// controller then persists it with the finalizer, before the create, instead of in
    /// a patch of its own after it. `None`, the default: the cloud chooses.
    fn planned_id(&self, desired: &DesiredLoadBalancer, replaces: Option<&str>) -> Option<String> {
        let _ = (desired, replaces);
        None
    }

    /// Creates the LB. `replaces` names an LB of this Service that vanished, so the create
    /// is a new request rather than a replay of the first one.
    /// Returns as soon as the cloud accepted it; the LB may still be provisioning.
    fn create(
        &self,
        desired: &DesiredLoadBalancer,
        replaces: Option<&str>,
    ) -> impl Future<Output = Result<ObservedLoadBalancer, ProviderError>> + Send;

    /// Writes `desired` over `current`, conditional on `current.version`; the VIP stays
    /// unless another is requested. `NotFound` when the LB is gone.
    fn update(
        &self,
        current: &ObservedLoadBalancer,
        desired: &DesiredLoadBalancer,
    ) -> impl Future<Output = Result<ObservedLoadBalancer, ProviderError>> + Send;

    /// Deletes the LB (found as in `get`, or already being deleted). Returns the LB while
    /// the cloud still lists it (it is `Deleting`), `None` once it is gone: only then may
    /// the Service's finalizer go (cf. `EnsureLoadBalancerDeleted`).
    fn delete(
        &self,
        lookup: &LoadBalancerLookup,
    ) -> impl Future<Output = Result<Option<ObservedLoadBalancer>, ProviderError>> + Send;

    /// `lb`, which was provisioning, once it no longer is (or `None` once it is gone), or
    /// as it is after `within`: one call that the cloud holds. Only called when
    /// [`Capabilities::waits_out_provisioning`] is set; the default says the provider
    /// cannot.
    fn await_provisioned(
        &self,
        lb: &ObservedLoadBalancer,
        within: Duration,
    ) -> impl Future<Output = Result<Option<ObservedLoadBalancer>, ProviderError>> + Send {
        let _ = (lb, within);
        std::future::ready(Err(ProviderError::Unsupported {
            operation: Operation::AwaitProvisioned,
            message: "this provider cannot wait out provisioning".into(),
        }))
    }

    /// Every LB tagged with this cluster's id (for orphan collection).
    fn list_owned(
        &self,
        cluster_id: &ClusterId,
    ) -> impl Future<Output = Result<Vec<ObservedLoadBalancer>, ProviderError>> + Send;

    /// The node pool `name`, `None` when the cloud has none of that name. Only called when
    /// [`Capabilities::node_pools`] is set; the default says the provider has none.
    fn get_node_pool(
        &self,
        name: &str,
    ) -> impl Future<Output = Result<Option<ObservedNodePool>, ProviderError>> + Send {
        let _ = name;
        std::future::ready(Err(no_node_pools(Operation::GetNodePool)))
    }

    /// Creates or replaces the node pool, conditional on `version` (the one observed) when
    /// given: `Conflict` when it changed meanwhile. Every LB referencing it follows.
    fn put_node_pool(
        &self,
        desired: &DesiredNodePool,
        version: Option<u64>,
    ) -> impl Future<Output = Result<ObservedNodePool, ProviderError>> + Send {
        let _ = (desired, version);
        std::future::ready(Err(no_node_pools(Operation::PutNodePool)))
    }

    /// Every node pool tagged with this cluster's id (for orphan collection).
    fn list_owned_node_pools(
        &self,
        cluster_id: &ClusterId,
    ) -> impl Future<Output = Result<Vec<ObservedNodePool>, ProviderError>> + Send {
        let _ = cluster_id;
        std::future::ready(Err(no_node_pools(Operation::ListNodePools)))
    }

    /// Deletes the node pool; `Ok` when it is gone already, `NodePoolInUse` while LBs
    /// reference it.
    fn delete_node_pool(
        &self,
        name: &str,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send {
        let _ = name;
        std::future::ready(Err(no_node_pools(Operation::DeleteNodePool)))
    }
}

/// What the node-pool calls of a provider without node pools answer.
fn no_node_pools(operation: Operation) -> ProviderError {
    ProviderError::Unsupported {
        operation,
        message: "this provider has no node pools".into(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn owner() -> Owner {
        Owner {
            cluster_id: "prod-1".parse().unwrap(),
            namespace: "default".into(),
            name: "web".into(),
            uid: "0b6e1b0c-5f0e-4c1f-9d7e-2a3b4c5d6e7f".into(),
        }
    }

    fn listener(port: u16) -> Listener {
        Listener {
            protocol: Protocol::Tcp,
            port,
            backend_port: 30000 + port,
            health_check: None,
        }
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    pub(crate) fn desired() -> DesiredLoadBalancer {
        DesiredLoadBalancer {
            owner: owner(),
            mode: LoadBalancerMode::Proxy,
            ip_families: vec![IpFamily::V4],
            address: AddressRequest::default(),
            listeners: vec![listener(80), listener(443)],
            backends: BTreeSet::from([ip("198.18.0.11")]),
            node_pool: None,
            source_ranges: vec![],
        }
    }

    /// The LB the cloud reports once `d` is in place: active, id `lb-1`, version 1, its
    /// VIPs 198.51.100.7 and 2001:db8:51:100::7 (of the families it has).
    pub(crate) fn observed_from(d: &DesiredLoadBalancer) -> ObservedLoadBalancer {
        ObservedLoadBalancer {
            id: "lb-1".into(),
            version: 1,
            name: d.name(),
            owner: Some(d.owner.clone()),
            phase: LoadBalancerPhase::Active,
            ip_families: d.ip_families.clone(),
            vips: d
                .ip_families
                .iter()
                .map(|family| {
                    d.address.requested_of(*family).unwrap_or(match family {
                        IpFamily::V4 => ip("198.51.100.7"),
                        IpFamily::V6 => ip("2001:db8:51:100::7"),
                    })
                })
                .collect(),
            hostname: None,
            pool: d.address.pool.clone(),
            sharing_key: d.address.sharing_key.clone(),
            mode: d.mode,
            listeners: d.listeners.clone(),
            backends: d.backends.clone(),
            node_pool: d.node_pool.clone(),
            source_ranges: d.source_ranges.clone(),
        }
    }

    #[test]
    fn cluster_id_validation() {
        assert!("a".parse::<ClusterId>().is_ok());
        assert!("prod-eu-1".parse::<ClusterId>().is_ok());
        assert!("".parse::<ClusterId>().is_err());
        assert!("Prod".parse::<ClusterId>().is_err());
        assert!("a_b".parse::<ClusterId>().is_err());
        assert!("x".repeat(25).parse::<ClusterId>().is_err());
    }

    #[test]
    fn name_is_deterministic_and_bounded() {
        let name = owner().load_balancer_name();
        assert_eq!(name, "k8s-prod-1-0b6e1b0c5f0e4c1f9d7e2a3b4c5d6e7f");
        let mut long = owner();
        long.cluster_id = "x".repeat(24).parse().unwrap();
        assert!(long.load_balancer_name().len() <= 63);
        let mut other = owner();
        other.uid = "1b6e1b0c-5f0e-4c1f-9d7e-2a3b4c5d6e7f".into();
        assert_ne!(other.load_balancer_name(), name);
    }

    #[test]
    fn tags_round_trip() {
        assert_eq!(Owner::from_tags(&owner().tags()), Some(owner()));
        let mut tags = owner().tags();
        tags.remove(TAG_SERVICE_UID);
        assert_eq!(Owner::from_tags(&tags), None);
    }

    #[test]
    fn no_drift_when_equal_up_to_order() {
        let d = desired();
        let mut o = observed_from(&d);
        o.listeners.reverse();
        assert!(o.drift(&d).is_empty());
    }

    #[test]
    fn drift_detects_each_field() {
        let d = desired();
        let mut o = observed_from(&d);
        o.backends.insert(ip("198.18.0.12"));
        o.mode = LoadBalancerMode::Passthrough;
        o.listeners.pop();
        o.source_ranges.push("203.0.113.0/24".parse().unwrap());
        o.owner = None;
        assert_eq!(
            o.drift(&d),
            vec![
                Drift::Mode,
                Drift::Listeners,
                Drift::Backends,
                Drift::SourceRanges,
                Drift::Tags
            ]
        );
        let mut d2 = desired();
        d2.address.requested = vec![ip("198.51.100.9")];
        assert_eq!(observed_from(&desired()).drift(&d2), vec![Drift::Vip]);
        let mut d3 = desired();
        d3.address.pool = Some("blue".into());
        d3.address.sharing_key = Some("dns".into());
        assert_eq!(
            observed_from(&desired()).drift(&d3),
            vec![Drift::Pool, Drift::SharingKey]
        );
    }

    #[test]
    fn an_lb_on_the_node_pool_follows_the_pool_not_its_own_backends() {
        let mut pooled = desired();
        pooled.node_pool = Some("k8s-prod-1-nodes".into());
        let mut lb = observed_from(&pooled);
        // The pool moved on before the controller's node store did: not the LB's drift.
        lb.backends = BTreeSet::from([ip("198.18.0.12")]);
        assert_eq!(lb.drift(&pooled), []);
        // An LB still carrying its own backends moves onto the pool, and back.
        let mut own = lb.clone();
        own.node_pool = None;
        assert_eq!(own.drift(&pooled), [Drift::NodePool]);
        assert_eq!(lb.drift(&desired()), [Drift::NodePool]);
    }

    #[test]
    fn families_drift_in_order_and_vips_per_family() {
        let mut dual = desired();
        dual.ip_families = vec![IpFamily::V6, IpFamily::V4];
        dual.backends.insert(ip("2001:db8:18::11"));
        let o = observed_from(&dual);
        assert!(o.drift(&dual).is_empty());
        assert_eq!(
            o.vips_of(&dual.ip_families),
            Ok(vec![ip("2001:db8:51:100::7"), ip("198.51.100.7")])
        );
        // Upgrade and downgrade: the family list differs; so does its order.
        assert_eq!(
            observed_from(&desired()).drift(&dual),
            vec![Drift::IpFamilies, Drift::Backends]
        );
        let mut reordered = dual.clone();
        reordered.ip_families.reverse();
        assert_eq!(o.drift(&reordered), vec![Drift::IpFamilies]);
        assert_eq!(
            observed_from(&desired()).vips_of(&dual.ip_families),
            Err(IpFamily::V6)
        );
        // A request moves the VIP of its own family only.
        let mut moved = dual.clone();
        moved.address.requested = vec![ip("2001:db8:51:100::9")];
        assert_eq!(o.drift(&moved), vec![Drift::Vip]);
        moved.address.requested = vec![ip("198.51.100.7"), ip("2001:db8:51:100::7")];
        assert!(o.drift(&moved).is_empty());
    }

    #[test]
    fn families_without_backends() {
        let mut dual = desired();
        dual.ip_families = vec![IpFamily::V4, IpFamily::V6];
        assert_eq!(dual.families_without_backends(), vec![IpFamily::V6]);
        dual.backends.insert(ip("2001:db8:18::11"));
        assert!(dual.families_without_backends().is_empty());
        dual.backends.clear();
        assert_eq!(dual.families_without_backends(), dual.ip_families);
    }

    #[test]
    fn no_pool_named_accepts_the_clouds_choice() {
        let d = desired();
        let mut o = observed_from(&d);
        o.pool = Some("default".into());
        assert!(o.drift(&d).is_empty());
    }

    #[test]
    fn ownership_by_cluster() {
        let o = observed_from(&desired());
        assert!(o.is_owned_by_cluster(&"prod-1".parse().unwrap()));
        assert!(!o.is_owned_by_cluster(&"prod-2".parse().unwrap()));
    }

    #[test]
    fn permanent_errors() {
        assert!(
            ProviderError::AddressRefused {
                refusal: AddressRefusal::Taken,
                message: String::new()
            }
            .is_permanent()
        );
        assert!(
            !ProviderError::Unavailable {
                operation: Operation::Create,
                message: String::new()
            }
            .is_permanent()
        );
        assert_eq!(
            ProviderError::RateLimited {
                operation: Operation::Get,
                retry_after: Duration::from_secs(1)
            }
            .category(),
            "rate_limited"
        );
    }
}
