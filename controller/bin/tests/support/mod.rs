//! Test harness: the API server stand-in and cloud-mock in-process, the controller as its
//! real binary. Everything binds 127.0.0.1 only; the cloud's data plane is off, so no
//! address is ever configured and no packet is sent.
//!
//! [`Harness::start`] runs against a real API server instead when [`REAL_API_SERVER_ENV`]
//! names its kubeconfig (`tandem-k3s control-plane -- cargo test …` sets it). A real server
//! is shared, so each test gets its own Namespace, cluster id and Node names, removes them
//! at the end (also when it fails), and the tests take turns: every controller watches all
//! Namespaces and every Node, and tests assert exact backend sets.
//!
//! It talks to a cloud edge it did not start when [`SHARED_CLOUD_URL_ENV`] names one (any
//! server of cloud-mock's API, whatever its data plane: CI runs the suite against
//! `cloud-mock --dataplane haproxy`). Such an edge is shared too: each test gets its own
//! cluster id, sees only the LBs of that id, removes them at the end, and the tests take
//! turns, since VIPs come from the edge's common pools. The edge must serve the pools of
//! [`DUAL_STACK_POOLS`]. Tests that need the cloud to misbehave start a cloud of their own
//! ([`Harness::start_with_own_cloud`]): fault injection is the whole edge's.

// The Kubernetes objects the tests write and read, shared with the library's in-process
// tests (controller/tests), which have no binary and no cloud.
#[path = "../../../tests/support/mod.rs"]
mod objects;
pub use objects::*;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use cloud_mock_dataplane::{DataPlaneConfig, DataPlaneKind};
use cloud_mock_sdk as sdk;
use k8s_openapi::api::core::v1::{Event, Namespace, Node, NodeStatus, Service};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;
use tandem_controller::provider::{TAG_CLUSTER_ID, TAG_SERVICE_UID};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

pub const CLUSTER: &str = "lab";
pub const POOL: &str = "198.51.100.0/24";
/// The cloud's pools on a dual-stack cluster: `default` of both families, and one of IPv4
/// alone.
pub const DUAL_STACK_POOLS: &str =
    "default=198.51.100.0/24,default=2001:db8:51:100::/64,v4only=203.0.113.0/24";
pub const V4_ONLY_POOL: &str = "v4only";
/// A real API server's kubeconfig; unset: the stand-in (the lab's end-to-end suite reads
/// the same variable).
pub const REAL_API_SERVER_ENV: &str = "TANDEM_E2E_KUBECONFIG";

/// The URL of a cloud edge this suite did not start; unset: each test starts its own cloud.
pub const SHARED_CLOUD_URL_ENV: &str = "TANDEM_E2E_CLOUD_URL";
/// The bearer token of [`SHARED_CLOUD_URL_ENV`]'s edge.
pub const SHARED_CLOUD_TOKEN_ENV: &str = "TANDEM_E2E_CLOUD_TOKEN";
/// The PEM file of the CA that signed the edge's certificate, when it serves HTTPS with a
/// certificate the system does not trust.
pub const SHARED_CLOUD_CA_FILE_ENV: &str = "TANDEM_E2E_CLOUD_CA_FILE";

/// Tests on a shared server or cloud take turns (see the module comment); held for a
/// Harness's life.
static SHARED_TURN: LazyLock<Arc<tokio::sync::Mutex<()>>> =
    LazyLock::new(|| Arc::new(tokio::sync::Mutex::new(())));

/// Whether the tests run against a real API server.
pub fn real_api_server() -> Option<PathBuf> {
    std::env::var_os(REAL_API_SERVER_ENV).map(PathBuf::from)
}

/// Runs one write to the API server as a user would: on `409 Conflict` ("the object has
/// been modified") it reads again and retries, with backoff, for up to 30 s; any other
/// error fails the test. `write` must do the whole read-modify-write each time it is
/// called: a merge patch names no resourceVersion, so sending it again is applied to the
/// object as the server holds it then. The controller writes the same Services and Nodes
/// (finalizer, annotation, status), and some servers answer a patch that meets its write
/// with 409 (v1.21's Service storage does), so no test write may count on winning that race.
pub async fn retry_on_conflict<T, F, Fut>(what: &str, mut write: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = kube::Result<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut delay = Duration::from_millis(20);
    loop {
        match write().await {
            Ok(done) => return done,
            Err(kube::Error::Api(status))
                if status.is_conflict() && tokio::time::Instant::now() < deadline =>
            {
                eprintln!("{what}: {status}; reading again and retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_millis(500));
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(label: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "tdm-ctl-{}-{label}-{}",
            std::process::id(),
            uuid_like()
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn uuid_like() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// The cloud edge of [`SHARED_CLOUD_URL_ENV`], if set: its URL, token and CA.
pub fn shared_cloud() -> Option<(String, String, Option<String>)> {
    let url = std::env::var(SHARED_CLOUD_URL_ENV).ok()?;
    let token = std::env::var(SHARED_CLOUD_TOKEN_ENV)
        .unwrap_or_else(|_| panic!("{SHARED_CLOUD_URL_ENV} needs {SHARED_CLOUD_TOKEN_ENV}"));
    let ca_pem = std::env::var_os(SHARED_CLOUD_CA_FILE_ENV).map(|file| {
        std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{SHARED_CLOUD_CA_FILE_ENV} {file:?}: {e}"))
    });
    Some((url, token, ca_pem))
}

/// An SDK client of the cloud at `url`, trusting `ca_pem` beside the system's roots.
fn connect(url: &str, token: &str, ca_pem: Option<&str>) -> sdk::Client {
    let options = sdk::ClientOptions {
        root_certificates: ca_pem.map(str::to_owned),
        ..sdk::ClientOptions::default()
    };
    sdk::Client::new(url, token.to_owned(), options).unwrap()
}

/// Who an edge of the test's own lets in, and with which tokens.
struct Access {
    source: cloud_mock::credentials::TokenSource,
    /// The test's own calls'.
    token: String,
    /// The controller's.
    controller_token: String,
    /// The controller's client certificate and key files, for an edge with mutual TLS.
    client_identity: Option<(PathBuf, PathBuf)>,
}

/// The name of the controller's tenant on an edge with tenants.
const TENANT: &str = "controller";

impl Access {
    /// One token for everyone; or, for a tenant bound to a cluster id with quotas, a
    /// tenants file in `data_dir` with the admin's token and the tenant's.
    fn new(data_dir: &Path, tenant: Option<(&str, &str)>) -> Self {
        let token = "cloud-token".to_string();
        let Some((cluster_id, quotas)) = tenant else {
            return Self {
                source: token.as_str().into(),
                controller_token: token.clone(),
                token,
                client_identity: None,
            };
        };
        let controller_token = "cloud-tenant-token".to_string();
        let sha256 = |token: &str| {
            use sha2::Digest;
            data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(token.as_bytes()))
        };
        let file = json!({
            "admin": [{"id": "test", "sha256": sha256(&token)}],
            "tenants": [{
                "name": TENANT,
                "clusters": [cluster_id],
                "pools": ["default"],
                "quotas": serde_json::from_str::<serde_json::Value>(quotas).unwrap(),
                "credentials": [{"id": "controller", "sha256": sha256(&controller_token)}],
            }],
        });
        std::fs::create_dir_all(data_dir).unwrap();
        let path = data_dir.join("tenants.json");
        std::fs::write(&path, file.to_string()).unwrap();
        Self {
            source: cloud_mock::credentials::TokenSource::Tenants(path),
            token,
            controller_token,
            client_identity: None,
        }
    }
}

/// A cloud-mock API: one this test runs (API only), or a shared edge.
pub struct Cloud {
    pub url: String,
    /// The token the controller's configuration carries (on an edge with tenants, a
    /// tenant's; the test's own client has the admin's).
    controller_token: String,
    /// The client certificate and key files the controller shows (mutual TLS).
    client_identity: Option<(PathBuf, PathBuf)>,
    /// The PEM of the CA that signed its certificate, when it serves HTTPS.
    pub ca_pem: Option<String>,
    pub client: sdk::Client,
    server: CloudServer,
}

enum CloudServer {
    /// In this process, stopped with the test.
    Own {
        cancel: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    },
    /// An edge of [`SHARED_CLOUD_URL_ENV`]: the test sees, and at its end removes, the LBs
    /// tagged with these cluster ids only (its own and the one it plays a foreign cluster
    /// with).
    Shared { cluster_ids: [String; 2] },
}

impl Cloud {
    /// With the VIP pools `pools` (`--vip-pool` values, comma-separated); with `https`,
    /// over HTTPS only, with a certificate for 127.0.0.1 signed by a CA of its own
    /// ([`Self::ca_pem`]), its files in `data_dir`; else over plain HTTP.
    pub async fn start(data_dir: &Path, pools: &str, https: bool) -> Self {
        Self::start_with(data_dir, pools, https, None).await
    }

    /// As [`Self::start`] (HTTPS), with tenants: the controller's token is that of a tenant
    /// bound to `cluster_id` with `quotas` (JSON, as in `--tenants-file`), the test's the
    /// admin's; and mutual TLS: the controller shows a client certificate naming its
    /// tenant, of a client CA the edge trusts.
    pub async fn start_for_tenant(
        data_dir: &Path,
        pools: &str,
        cluster_id: &str,
        quotas: &str,
    ) -> Self {
        Self::start_with(data_dir, pools, true, Some((cluster_id, quotas))).await
    }

    async fn start_with(
        data_dir: &Path,
        pools: &str,
        https: bool,
        tenant: Option<(&str, &str)>,
    ) -> Self {
        let mut access = Access::new(data_dir, tenant);
        if !https {
            return Self::serve(data_dir, pools, None, access).await;
        }
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        std::fs::create_dir_all(data_dir).unwrap();
        let client_ca_file = tenant.map(|_| {
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            let clients =
                rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap())
                    .unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, TENANT);
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &clients).unwrap();
            let identity = (data_dir.join("client.crt"), data_dir.join("client.key"));
            std::fs::write(&identity.0, cert.pem()).unwrap();
            std::fs::write(&identity.1, key.serialize_pem()).unwrap();
            access.client_identity = Some(identity);
            let path = data_dir.join("client-ca.crt");
            std::fs::write(&path, clients.pem()).unwrap();
            path
        });
        let files = cloud_mock::server::TlsFiles {
            client_ca_file,
            cert_file: data_dir.join("tls.crt"),
            key_file: data_dir.join("tls.key"),
        };
        std::fs::write(&files.cert_file, cert.pem()).unwrap();
        std::fs::write(&files.key_file, key.serialize_pem()).unwrap();
        Self::serve(data_dir, pools, Some((files, ca.pem())), access).await
    }

    async fn serve(
        data_dir: &Path,
        pools: &str,
        tls: Option<(cloud_mock::server::TlsFiles, String)>,
        access: Access,
    ) -> Self {
        let Access {
            source,
            token,
            controller_token,
            client_identity,
        } = access;
        let settings = cloud_mock::Settings {
            data_dir: data_dir.to_path_buf(),
            store: cloud_mock::store::StoreSettings::Redb,
            token: source,
            vip_pools: pools.parse().unwrap(),
            provisioning_delay: Duration::from_millis(300),
            fault_injection: true,
            l2: None,
            dataplane: DataPlaneConfig {
                mode: DataPlaneKind::None,
                ..DataPlaneConfig::default()
            },
        };
        let listener = tokio::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
            .await
            .unwrap();
        let (files, ca_pem) = tls.unzip();
        let scheme = if files.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{}", listener.local_addr().unwrap());
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        let task = tokio::spawn(async move {
            cloud_mock::server::serve_on(&settings, listener, files.as_ref(), stop)
                .await
                .unwrap();
        });
        Self {
            client: connect(&url, &token, ca_pem.as_deref()),
            url,
            controller_token,
            client_identity,
            ca_pem,
            server: CloudServer::Own { cancel, task },
        }
    }

    /// The shared edge of [`shared_cloud`], as seen by the cluster `cluster_id`.
    pub fn shared(
        (url, token, ca_pem): (String, String, Option<String>),
        cluster_id: &str,
    ) -> Self {
        Self {
            client: connect(&url, &token, ca_pem.as_deref()),
            url,
            controller_token: token,
            client_identity: None,
            ca_pem,
            server: CloudServer::Shared {
                cluster_ids: [cluster_id.to_owned(), foreign_cluster_id(cluster_id)],
            },
        }
    }

    /// Whether other tests' LBs and VIPs share this cloud (its pools' counts are not the
    /// test's alone).
    pub fn is_shared(&self) -> bool {
        matches!(self.server, CloudServer::Shared { .. })
    }

    /// Writes the mock-cloud provider's configuration for this cloud, with its token and
    /// CA (when it serves HTTPS) in files beside it, into `dir`; returns its path.
    pub fn write_config(&self, dir: &Path) -> PathBuf {
        let token = dir.join("cloud-token");
        std::fs::write(&token, format!("{}\n", self.controller_token)).unwrap();
        let mut config = json!({"url": self.url, "tokenFile": token});
        if let Some(pem) = &self.ca_pem {
            let ca = dir.join("cloud-ca.crt");
            std::fs::write(&ca, pem).unwrap();
            config["caFile"] = ca.display().to_string().into();
        }
        if let Some((cert, key)) = &self.client_identity {
            config["clientCertFile"] = cert.display().to_string().into();
            config["clientKeyFile"] = key.display().to_string().into();
        }
        let path = dir.join("cloud-config.json");
        std::fs::write(&path, config.to_string()).unwrap();
        path
    }

    /// Stops a cloud of the test's own; on a shared edge, deletes the test's LBs and node
    /// pools, so their VIPs go back to the pools for the tests after it.
    pub async fn stop(self) {
        match self.server {
            CloudServer::Own { cancel, task } => {
                cancel.cancel();
                let _ = task.await;
            }
            CloudServer::Shared { ref cluster_ids } => {
                for lb in self.all().await {
                    if let Err(e) = self.client.delete_load_balancer(&lb.id).await {
                        eprintln!("deleting {} from the shared cloud: {e}", lb.id);
                    }
                }
                // The node pools go once no LB references them (the deletes above finish
                // after the edge's provisioning delay).
                for cluster_id in cluster_ids {
                    let filter = sdk::ListFilter {
                        tags: BTreeMap::from([(TAG_CLUSTER_ID.to_owned(), cluster_id.clone())]),
                        name: None,
                    };
                    let pools = self
                        .client
                        .list_node_pools(&filter)
                        .await
                        .unwrap_or_default();
                    for pool in pools {
                        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
                        while let Err(e) = self.client.delete_node_pool(&pool.name).await {
                            if tokio::time::Instant::now() > deadline {
                                eprintln!(
                                    "deleting node pool {} from the shared cloud: {e}",
                                    pool.name
                                );
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                }
            }
        }
    }

    /// Whether the cloud serves UDP listeners in proxy mode (an HAProxy edge refuses them
    /// with `unsupported-protocol`): asked of the cloud itself, with an LB of
    /// `cluster_id` it refuses or that is deleted at once.
    pub async fn proxies_udp(&self, cluster_id: &str) -> bool {
        let probe = sdk::LoadBalancerSpec {
            name: format!("k8s-{cluster_id}-udp-probe"),
            tags: BTreeMap::from([(TAG_CLUSTER_ID.to_owned(), cluster_id.to_owned())]),
            mode: sdk::Mode::Proxy,
            vip: None,
            listeners: vec![sdk::Listener {
                protocol: sdk::Protocol::Udp,
                port: 53,
                backend_port: 30053,
                health_check: None,
            }],
            backends: vec![],
            node_pool: None,
            source_ranges: vec![],
            address: sdk::AddressRequest::default(),
        };
        let key = format!("{cluster_id}-udp-probe");
        match self.client.create_load_balancer(&probe, &key).await {
            Ok(lb) => {
                self.client.delete_load_balancer(&lb.id).await.unwrap();
                true
            }
            Err(sdk::Error::Invalid { code, .. })
                if code.as_deref() == Some("unsupported-protocol") =>
            {
                false
            }
            Err(e) => panic!("probing the cloud for UDP in proxy mode: {e}"),
        }
    }

    /// Every LB this test can see: all of its own cloud's, or those of its cluster ids on a
    /// shared edge.
    pub async fn all(&self) -> Vec<sdk::LoadBalancer> {
        let CloudServer::Shared { cluster_ids } = &self.server else {
            return self
                .client
                .list_load_balancers(&sdk::ListFilter::default())
                .await
                .unwrap();
        };
        let mut all = Vec::new();
        for cluster_id in cluster_ids {
            let filter = sdk::ListFilter {
                tags: BTreeMap::from([(TAG_CLUSTER_ID.to_owned(), cluster_id.clone())]),
                name: None,
            };
            all.extend(self.client.list_load_balancers(&filter).await.unwrap());
        }
        all
    }

    pub async fn for_uid(&self, uid: &str) -> Vec<sdk::LoadBalancer> {
        self.client
            .list_load_balancers(&uid_filter(uid))
            .await
            .unwrap()
            .into_iter()
            .filter(|lb| lb.state != sdk::State::Deleting)
            .collect()
    }

    /// As [`Self::for_uid`], the whole LBs of any family.
    pub async fn families_for_uid(&self, uid: &str) -> Vec<sdk::families::LoadBalancer> {
        self.client
            .families()
            .list_load_balancers(&uid_filter(uid))
            .await
            .unwrap()
            .into_iter()
            .filter(|lb| lb.state != sdk::State::Deleting)
            .collect()
    }

    pub async fn set_faults(&self, faults: sdk::Faults) {
        self.client.set_faults(&faults).await.unwrap();
    }
}

/// The cluster id a test gives an LB of "another cluster" (which its controller must leave
/// alone).
pub fn foreign_cluster_id(cluster_id: &str) -> String {
    format!("{cluster_id}-other")
}

fn uid_filter(uid: &str) -> sdk::ListFilter {
    sdk::ListFilter {
        tags: BTreeMap::from([(TAG_SERVICE_UID.to_string(), uid.to_string())]),
        name: None,
    }
}

/// A plain GET, as `reqwest::get` with the process's crypto provider installed first
/// (see `tandem_common::install_crypto_provider`).
pub async fn http_get(url: &str) -> reqwest::Result<reqwest::Response> {
    tandem_common::install_crypto_provider();
    reqwest::get(url).await
}

/// A controller process; killed (by its PID, via the handle) when dropped.
pub struct Controller {
    pub child: Child,
    pub metrics_addr: SocketAddr,
}

impl Controller {
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id().unwrap()).unwrap()
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), signal).unwrap();
    }

    pub async fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(within, self.child.wait())
            .await
            .expect("controller did not exit in time")
            .unwrap()
    }

    pub async fn metrics(&self) -> String {
        self.try_metrics().await.expect("the controller's /metrics")
    }

    /// `/metrics`, or `None` while the controller is not serving it yet.
    pub async fn try_metrics(&self) -> Option<String> {
        http_get(&format!("http://{}/metrics", self.metrics_addr))
            .await
            .ok()?
            .text()
            .await
            .ok()
    }

    /// Sum of the cloud-call counters this process reports.
    pub async fn cloud_calls(&self) -> u64 {
        self.metrics()
            .await
            .lines()
            .filter(|l| l.starts_with("tandem_controller_cloud_calls_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }
}

pub fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    l.local_addr().unwrap()
}

/// The API server a harness talks to.
pub enum ApiServer {
    StandIn {
        api: tandem_apiserver::RunningServer,
        /// Held while the test uses a shared cloud (see [`SHARED_TURN`]).
        _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
    },
    /// A shared real server: what this test wrote there goes at the end.
    Real {
        cleanup: RealCleanup,
        /// Whose turn it is (see [`SHARED_TURN`]); released after the cleanup.
        _turn: tokio::sync::OwnedMutexGuard<()>,
    },
}

pub struct Harness {
    // Field order is drop order: the real server's cleanup runs before the turn passes on.
    pub api: ApiServer,
    pub dir: TempDir,
    pub client: kube::Client,
    pub cloud: Cloud,
    pub kubeconfig: PathBuf,
    /// The controller's `--cloud-config`: the cloud's URL, token file and CA file.
    pub cloud_config: PathBuf,
    /// The Namespace of this test's Services: `default` on the stand-in, a fresh one on a
    /// real server.
    pub namespace: String,
    /// The controller's `--cluster-id`.
    pub cluster_id: String,
    /// Prepended to the Node names tests use (empty on the stand-in).
    node_prefix: String,
    /// Whether the server knows `status.loadBalancer.ingress[].ipMode` (1.29+; older ones
    /// drop it).
    pub ip_mode: bool,
}

/// Which cloud a harness talks to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum CloudChoice {
    /// The edge of [`SHARED_CLOUD_URL_ENV`] if set, else one of the test's own.
    Configured,
    /// Always one of the test's own (its fault injection is the test's alone).
    Own,
    /// One of the test's own with tenants, the controller's bound to its cluster id with
    /// these quotas.
    Tenant(&'static str),
}

/// A name part unique over runs and tests, so leftovers of a killed run never meet a new
/// test on a shared server or cloud.
fn unique_run() -> String {
    static SEQUENCE: AtomicU32 = AtomicU32::new(1);
    format!(
        "{}-{}",
        std::process::id(),
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    )
}

impl Harness {
    /// On the stand-in, always (tests that need it, or need the whole server alone).
    pub async fn new(label: &str) -> Self {
        Self::on_stand_in(
            label,
            tandem_apiserver::StoreConfig::default(),
            POOL,
            CloudChoice::Configured,
        )
        .await
    }

    async fn on_stand_in(
        label: &str,
        store: tandem_apiserver::StoreConfig,
        pools: &str,
        choice: CloudChoice,
    ) -> Self {
        // On a shared cloud the test needs its turn and a cluster id of its own.
        let shared = (choice == CloudChoice::Configured)
            .then(shared_cloud)
            .flatten()
            .is_some();
        let turn = match shared {
            true => Some(SHARED_TURN.clone().lock_owned().await),
            false => None,
        };
        let cluster_id = match shared {
            true => format!("e2e-{}", unique_run()),
            false => CLUSTER.into(),
        };
        let api = tandem_apiserver::spawn(tandem_apiserver::ServerConfig {
            store,
            ..Default::default()
        })
        .await
        .unwrap();
        let client = api.client().await.unwrap();
        let dir = TempDir::new(label);
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).await.unwrap();
        Self::with_server(
            ApiServer::StandIn { api, _turn: turn },
            dir,
            client,
            kubeconfig,
            "default".into(),
            cluster_id,
            String::new(),
            true,
            (pools, choice),
        )
        .await
    }

    /// On the real API server of [`REAL_API_SERVER_ENV`] if set, else on the stand-in;
    /// with the cloud of [`SHARED_CLOUD_URL_ENV`] if set, else one of its own.
    pub async fn start(label: &str) -> Self {
        Self::start_with(label, CloudChoice::Configured).await
    }

    /// As [`Self::start`], always with a cloud of the test's own: for tests that make the
    /// cloud misbehave.
    pub async fn start_with_own_cloud(label: &str) -> Self {
        Self::start_with(label, CloudChoice::Own).await
    }

    /// As [`Self::start_with_own_cloud`], on an edge with tenants: the controller's
    /// credentials are a tenant's, bound to its cluster id, with `quotas` (JSON, as in
    /// `--tenants-file`).
    pub async fn start_with_tenant_cloud(label: &str, quotas: &'static str) -> Self {
        Self::start_with(label, CloudChoice::Tenant(quotas)).await
    }

    async fn start_with(label: &str, choice: CloudChoice) -> Self {
        match real_api_server() {
            Some(kubeconfig) => Self::on_real_server(label, kubeconfig, POOL, choice).await,
            None if choice == CloudChoice::Configured => Self::new(label).await,
            None => {
                let store = tandem_apiserver::StoreConfig::default();
                Self::on_stand_in(label, store, POOL, choice).await
            }
        }
    }

    /// On a dual-stack cluster, with a cloud whose pools are [`DUAL_STACK_POOLS`]: the real
    /// API server of [`REAL_API_SERVER_ENV`] if set, else the stand-in serving
    /// [`DUAL_STACK_SERVICE_CIDRS`]. `None` when the real server serves one family only:
    /// there is no dual-stack cluster to test on.
    pub async fn start_dual_stack(label: &str) -> Option<Self> {
        let choice = CloudChoice::Configured;
        let Some(kubeconfig) = real_api_server() else {
            let store = tandem_apiserver::StoreConfig {
                service_cidrs: DUAL_STACK_SERVICE_CIDRS.parse().unwrap(),
                ..Default::default()
            };
            return Some(Self::on_stand_in(label, store, DUAL_STACK_POOLS, choice).await);
        };
        let h = Self::on_real_server(label, kubeconfig, DUAL_STACK_POOLS, choice).await;
        if h.serves_dual_stack().await {
            return Some(h);
        }
        eprintln!("{label}: the API server is not dual-stack; nothing to test on");
        h.shutdown().await;
        None
    }

    /// Whether the server gives a Service both families (it refuses `RequireDualStack`
    /// when it has one service CIDR).
    async fn serves_dual_stack(&self) -> bool {
        let mut probe = lb_service("dual-stack-probe", &[(80, "TCP")]);
        let spec = probe.spec.as_mut().unwrap();
        spec.type_ = Some("ClusterIP".into());
        spec.ip_family_policy = Some("RequireDualStack".into());
        probe.metadata.namespace = Some(self.namespace.clone());
        let created = self
            .services()
            .create(&PostParams::default(), &probe)
            .await
            .is_ok();
        if created {
            self.delete_service("dual-stack-probe").await;
        }
        created
    }

    async fn on_real_server(
        label: &str,
        kubeconfig: PathBuf,
        pools: &str,
        choice: CloudChoice,
    ) -> Self {
        let turn = SHARED_TURN.clone().lock_owned().await;
        let client = kube_client(&kubeconfig).await;
        let run = unique_run();
        let namespace = format!("e2e-{label}-{run}");
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let mut created: Namespace = serde_json::from_value(json!({
            "metadata": { "labels": { "tandem.io/e2e": "controller" } }
        }))
        .unwrap();
        created.metadata.name = Some(namespace.clone());
        namespaces
            .create(&PostParams::default(), &created)
            .await
            .unwrap();
        let node_prefix = format!("{namespace}-");
        let ip_mode = server_has_ip_mode(&client).await;
        let cleanup = RealCleanup {
            kubeconfig: kubeconfig.clone(),
            namespace: namespace.clone(),
            node_prefix: node_prefix.clone(),
            done: false,
        };
        Self::with_server(
            ApiServer::Real {
                cleanup,
                _turn: turn,
            },
            TempDir::new(label),
            client,
            kubeconfig,
            namespace,
            format!("e2e-{run}"),
            node_prefix,
            ip_mode,
            (pools, choice),
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn with_server(
        api: ApiServer,
        dir: TempDir,
        client: kube::Client,
        kubeconfig: PathBuf,
        namespace: String,
        cluster_id: String,
        node_prefix: String,
        ip_mode: bool,
        (pools, choice): (&str, CloudChoice),
    ) -> Self {
        let cloud_dir = dir.path().join("cloud");
        let cloud = match (choice, shared_cloud()) {
            (CloudChoice::Configured, Some(shared)) => Cloud::shared(shared, &cluster_id),
            (CloudChoice::Tenant(quotas), _) => {
                Cloud::start_for_tenant(&cloud_dir, pools, &cluster_id, quotas).await
            }
            _ => {
                std::fs::create_dir_all(&cloud_dir).unwrap();
                // Over HTTPS, as an edge on another host serves it.
                Cloud::start(&cloud_dir, pools, true).await
            }
        };
        let cloud_config = cloud.write_config(dir.path());
        Self {
            api,
            dir,
            client,
            cloud,
            kubeconfig,
            cloud_config,
            namespace,
            cluster_id,
            node_prefix,
            ip_mode,
        }
    }

    /// The Node name a test's `name` stands for on this server.
    pub fn node_name(&self, name: &str) -> String {
        format!("{}{name}", self.node_prefix)
    }

    /// Starts the controller binary with fast test timings plus `extra` flags.
    pub fn controller(&self, extra: &[&str]) -> Controller {
        let metrics_addr = free_port();
        let log = std::fs::File::create(
            self.dir
                .path()
                .join(format!("controller-{}.log", metrics_addr.port())),
        )
        .unwrap();
        let mut cmd = self.controller_command();
        cmd.args(["--metrics-bind-address", &metrics_addr.to_string()])
            .args(["--health-bind-address", &metrics_addr.to_string()])
            .args(["--cloud-timeout-seconds", "5"])
            .args(extra)
            .env_remove("KUBECONFIG")
            .env("TANDEM_NODE_DEBOUNCE_MS", "300")
            .env(
                "RUST_LOG",
                "info,tandem_controller=debug,tandem_provider_mockcloud=debug",
            )
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        let child = cmd.spawn().unwrap();
        Controller {
            child,
            metrics_addr,
        }
    }

    /// The controller binary pointed at this harness's API server, cloud and cluster id.
    pub fn controller_command(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-controller"));
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["--cloud-provider", "mockcloud", "--cloud-config"])
            .arg(&self.cloud_config)
            .args(["--cluster-id", &self.cluster_id]);
        cmd
    }

    /// The controller's log, for assertion messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for entry in std::fs::read_dir(self.dir.path()).unwrap().flatten() {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with("controller-")
            {
                out.push_str(&std::fs::read_to_string(entry.path()).unwrap_or_default());
            }
        }
        let tail: Vec<&str> = out.lines().rev().take(200).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    pub fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    pub fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    /// A Ready node with these comma-separated InternalIPs.
    pub async fn add_node(&self, name: &str, ips: &str) {
        let name = &self.node_name(name);
        let node = Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        self.nodes()
            .create(&PostParams::default(), &node)
            .await
            .unwrap();
        let status = NodeStatus {
            addresses: Some(internal_ips(ips)),
            conditions: Some(vec![k8s_openapi::api::core::v1::NodeCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..Default::default()
            }]),
            ..Default::default()
        };
        let patch = json!({ "status": status });
        retry_on_conflict(&format!("writing the status of Node {name}"), || async {
            self.nodes()
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
        })
        .await;
    }

    pub async fn patch_node(&self, name: &str, patch: serde_json::Value) {
        let name = &self.node_name(name);
        retry_on_conflict(&format!("patching Node {name}"), || async {
            self.nodes()
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
        })
        .await;
    }

    pub async fn patch_node_status(&self, name: &str, patch: serde_json::Value) {
        let name = &self.node_name(name);
        retry_on_conflict(&format!("patching the status of Node {name}"), || async {
            self.nodes()
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
        })
        .await;
    }

    pub async fn delete_node(&self, name: &str) {
        self.nodes()
            .delete(&self.node_name(name), &DeleteParams::default())
            .await
            .unwrap();
    }

    /// Creates the Service in this test's Namespace.
    pub async fn create_service(&self, mut svc: Service) -> Service {
        svc.metadata.namespace = Some(self.namespace.clone());
        self.services()
            .create(&PostParams::default(), &svc)
            .await
            .unwrap()
    }

    pub async fn patch_service(&self, name: &str, patch: serde_json::Value) -> Service {
        retry_on_conflict(&format!("patching Service {name}"), || async {
            self.services()
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
        })
        .await
    }

    pub async fn delete_service(&self, name: &str) {
        self.services()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }

    pub async fn get_service(&self, name: &str) -> Option<Service> {
        self.services().get_opt(name).await.unwrap()
    }

    /// Event reasons recorded on the Service, with their messages.
    pub async fn events_for(&self, name: &str) -> Vec<(String, String, String)> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.namespace);
        events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(name))
            .map(|e| {
                (
                    e.type_.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.message.unwrap_or_default(),
                )
            })
            .collect()
    }

    /// Polls `check` every 200 ms until it returns `Some`, or panics with the controller log.
    pub async fn eventually<T, F, Fut>(&self, what: &str, within: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(value) = check().await {
                return value;
            }
            if tokio::time::Instant::now() > deadline {
                panic!(
                    "timed out waiting for {what}\n--- controller log ---\n{}",
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until the Service has an ingress IP and its LB is active; returns both.
    pub async fn wait_served(&self, name: &str) -> (Service, sdk::LoadBalancer) {
        self.eventually(
            &format!("{name} served"),
            Duration::from_secs(30),
            || async {
                let svc = self.get_service(name).await?;
                let ip = ingress_ip(&svc)?;
                let uid = svc.metadata.uid.clone()?;
                let lbs = self.cloud.for_uid(&uid).await;
                match lbs.as_slice() {
                    [lb] if lb.state == sdk::State::Active && lb.vip() == Some(ip) => {
                        Some((svc, lb.clone()))
                    }
                    _ => None,
                }
            },
        )
        .await
    }

    /// Waits until the Service's ingress is its LB's VIPs, of `families` in that order, and
    /// the LB is active with those families; returns both.
    pub async fn wait_served_as(
        &self,
        name: &str,
        families: &[&str],
    ) -> (Service, sdk::families::LoadBalancer) {
        self.eventually(
            &format!("{name} served as {families:?}"),
            Duration::from_secs(30),
            || async {
                let svc = self.get_service(name).await?;
                let uid = svc.metadata.uid.clone()?;
                let lbs = self.cloud.families_for_uid(&uid).await;
                let [lb] = lbs.as_slice() else { return None };
                let lb_families: Vec<String> = lb
                    .spec
                    .ip_families
                    .iter()
                    .map(ToString::to_string)
                    .collect();
                let served = lb.state == sdk::State::Active
                    && ingress_ips(&svc) == lb.vips()
                    && ingress_families(&svc) == families
                    && lb_families == families;
                served.then(|| (svc, lb.clone()))
            },
        )
        .await
    }

    pub async fn shutdown(mut self) {
        match &mut self.api {
            ApiServer::Real { cleanup, .. } => cleanup.run().await,
            ApiServer::StandIn { .. } => {}
        }
        self.cloud.stop().await;
        if let ApiServer::StandIn { api, _turn } = self.api {
            let _ = api.shutdown().await;
        }
    }
}

/// A kube client for a kubeconfig file.
pub async fn kube_client(kubeconfig: &Path) -> kube::Client {
    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(kubeconfig).unwrap(),
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    kube::Client::try_from(config).unwrap()
}

/// Whether the server's schema has `LoadBalancerIngress.ipMode` (its `/openapi/v2`).
async fn server_has_ip_mode(client: &kube::Client) -> bool {
    let request = kube::core::Request::new("")
        .get("openapi/v2", &kube::core::params::GetParams::default())
        .unwrap();
    let text = client.request_text(request).await.unwrap();
    let schema: serde_json::Value = serde_json::from_str(&text).unwrap();
    !schema["definitions"]["io.k8s.api.core.v1.LoadBalancerIngress"]["properties"]["ipMode"]
        .is_null()
}

/// Removes what one test wrote on a shared server: its Services (finalizers stripped, so a
/// stopped or broken controller cannot hold them), its Nodes and its Namespace.
pub struct RealCleanup {
    kubeconfig: PathBuf,
    namespace: String,
    node_prefix: String,
    done: bool,
}

impl RealCleanup {
    async fn run(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        // A fresh client: this may run on another runtime than the test's (see Drop).
        let client = kube_client(&self.kubeconfig).await;
        let services: Api<Service> = Api::namespaced(client.clone(), &self.namespace);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let left = services.list(&ListParams::default()).await.unwrap().items;
            if left.is_empty() {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "Services of {} not removed: {:?}",
                self.namespace,
                left.iter()
                    .map(|s| s.metadata.name.clone())
                    .collect::<Vec<_>>()
            );
            for svc in left {
                let name = svc.metadata.name.unwrap_or_default();
                // Either may find the Service gone already.
                let _ = services.delete(&name, &DeleteParams::default()).await;
                let _ = services
                    .patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({ "metadata": { "finalizers": null } })),
                    )
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let nodes: Api<Node> = Api::all(client.clone());
        for node in nodes.list(&ListParams::default()).await.unwrap().items {
            let name = node.metadata.name.unwrap_or_default();
            if name.starts_with(&self.node_prefix) {
                let _ = nodes.delete(&name, &DeleteParams::default()).await;
            }
        }
        // The namespace controller removes its Events and Leases; nothing waits for that.
        let namespaces: Api<Namespace> = Api::all(client);
        let _ = namespaces
            .delete(&self.namespace, &DeleteParams::default())
            .await;
    }
}

impl Drop for RealCleanup {
    /// A test that failed never reached `shutdown`: clean up on a thread of our own, whose
    /// runtime works whatever state the test's runtime is in.
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut this = RealCleanup {
            kubeconfig: self.kubeconfig.clone(),
            namespace: self.namespace.clone(),
            node_prefix: self.node_prefix.clone(),
            done: false,
        };
        self.done = true;
        let cleaned = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(this.run());
        })
        .join();
        if cleaned.is_err() {
            eprintln!("cleanup of {} failed", self.namespace);
        }
    }
}

/// The LB's backends: its own, or (on a node pool) the pool's members its health list
/// shows.
pub fn backend_ips(lb: &sdk::LoadBalancer) -> Vec<String> {
    let mut ips: Vec<String> = match lb.spec.node_pool {
        Some(_) => lb.health.iter().map(|b| b.ip.to_string()).collect(),
        None => lb.spec.backends.iter().map(|b| b.ip.to_string()).collect(),
    };
    ips.sort();
    ips
}
