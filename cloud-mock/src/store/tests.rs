//! The store's operations on the embedded backend, through a blocking wrapper with the
//! signatures the tests were written against.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use cloud_mock_sdk::families::LoadBalancerSpec;
use cloud_mock_sdk::{IpFamily, Listener, NodePoolSpec, State};
use redb::{Database, ReadableDatabase, TableHandle};

use super::embedded::{FILE_NAME, IDEMPOTENCY_KEYS, LOAD_BALANCERS, VIP_HOLDERS};
use super::*;
use crate::model::tests::spec;
use crate::pools::DEFAULT_POOL;
use crate::testutil::TempDir;
use crate::validate::validate_spec;

/// A [`Store`] on redb, called as blocking functions.
struct SyncStore {
    store: Store,
    runtime: tokio::runtime::Runtime,
}

impl SyncStore {
    fn open(dir: &Path, pools: VipPools) -> Self {
        Self {
            store: Store::open_redb(dir, pools).unwrap(),
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        }
    }

    fn pools(&self) -> &VipPools {
        self.store.pools()
    }

    fn block<T>(&self, future: impl std::future::Future<Output = T>) -> T {
        self.runtime.block_on(future)
    }

    fn pool_use(&self) -> Result<Vec<Pool>, StoreError> {
        Ok(self.store.pool_use())
    }

    fn get(&self, id: &str) -> Result<Option<StoredLoadBalancer>, StoreError> {
        Ok(self.store.get(id).as_deref().cloned())
    }

    fn list(&self) -> Result<Vec<StoredLoadBalancer>, StoreError> {
        Ok(self.store.list())
    }

    fn snapshot(&self) -> Result<Snapshot, StoreError> {
        Ok(self.store.snapshot())
    }

    fn node_pool(&self, name: &str) -> Result<Option<StoredNodePool>, StoreError> {
        Ok(self.store.node_pool(name))
    }

    fn get_node_pool(
        &self,
        name: &str,
    ) -> Result<Option<(StoredNodePool, Vec<String>)>, StoreError> {
        Ok(self.store.get_node_pool(name))
    }

    fn list_node_pools(&self) -> Result<Vec<(StoredNodePool, Vec<String>)>, StoreError> {
        Ok(self.store.list_node_pools())
    }

    fn create(
        &self,
        spec: &LoadBalancerSpec,
        placement: &Placement,
        id: Option<&str>,
        key: Option<&str>,
        now_ms: u64,
    ) -> Result<Created, StoreError> {
        self.block(self.store.create(
            spec.clone(),
            placement.clone(),
            id.map(str::to_owned),
            key.map(str::to_owned),
            None,
            now_ms,
        ))
    }

    fn update(
        &self,
        id: &str,
        spec: &LoadBalancerSpec,
        placement: &Placement,
        version: u64,
    ) -> Result<StoredLoadBalancer, StoreError> {
        self.block(self.store.update(
            id.to_owned(),
            spec.clone(),
            placement.clone(),
            version,
            None,
        ))
    }

    fn mark_deleting(&self, id: &str, now_ms: u64) -> Result<Option<Transition>, StoreError> {
        self.block(self.store.mark_deleting(id.to_owned(), now_ms))
    }

    fn mark_active(&self, ids: &[String], now_ms: u64) -> Result<usize, StoreError> {
        self.block(self.store.mark_active(ids.to_vec(), now_ms))
    }

    fn remove(&self, id: &str) -> Result<(), StoreError> {
        self.block(self.store.remove(id.to_owned()))
    }

    fn put_node_pool(
        &self,
        name: &str,
        spec: &NodePoolSpec,
        if_match: Option<u64>,
    ) -> Result<NodePoolWrite, StoreError> {
        self.block(
            self.store
                .put_node_pool(name.to_owned(), spec.clone(), if_match),
        )
    }

    fn delete_node_pool(&self, name: &str) -> Result<bool, StoreError> {
        self.block(self.store.delete_node_pool(name.to_owned()))
    }
}

/// Writes `value` under `key` in `table` of the closed redb file in `dir`, as another
/// version (or a fault) would have.
fn write_raw(dir: &TempDir, table: redb::TableDefinition<&str, &[u8]>, key: &str, value: &[u8]) {
    let db = Database::create(dir.path().join(FILE_NAME)).unwrap();
    let txn = db.begin_write().unwrap();
    txn.open_table(table).unwrap().insert(key, value).unwrap();
    txn.commit().unwrap();
}

fn pools() -> VipPools {
    "127.77.0.0/29,blue=127.78.0.0/30".parse().unwrap()
}

fn open(dir: &TempDir) -> SyncStore {
    SyncStore::open(dir.path(), pools())
}

/// Creates `spec` as the API does: validated, then placed.
fn create(
    store: &SyncStore,
    spec: &LoadBalancerSpec,
    key: Option<&str>,
) -> Result<Created, StoreError> {
    create_as(store, spec, None, key)
}

/// [`create`] under an id the client chose.
fn create_as(
    store: &SyncStore,
    spec: &LoadBalancerSpec,
    id: Option<&str>,
    key: Option<&str>,
) -> Result<Created, StoreError> {
    let placement = validate_spec(spec, store.pools()).unwrap();
    store.create(spec, &placement, id, key, 0)
}

fn update(
    store: &SyncStore,
    id: &str,
    spec: &LoadBalancerSpec,
    version: u64,
) -> Result<StoredLoadBalancer, StoreError> {
    let placement = validate_spec(spec, store.pools()).unwrap();
    store.update(id, spec, &placement, version)
}

fn ip(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 77, 0, last)
}

/// A load balancer named `name` sharing under `key`, serving TCP `ports`.
fn sharer(name: &str, key: &str, ports: &[u16]) -> LoadBalancerSpec {
    let mut s = spec(name);
    s.address.sharing_key = Some(key.into());
    let template = s.listeners[0].clone();
    s.listeners = ports
        .iter()
        .map(|&port| Listener {
            port,
            ..template.clone()
        })
        .collect();
    s
}

#[test]
fn a_freed_vip_is_handed_out_first_again() {
    let dir = TempDir::new("store-floor");
    let store = open(&dir);
    let vip_of = |created: &Created| created.load_balancer.spec.vip;
    let lbs: Vec<Created> = ["a", "b", "c"]
        .iter()
        .map(|name| create(&store, &spec(name), None).unwrap())
        .collect();
    assert_eq!(
        lbs.iter().map(vip_of).collect::<Vec<_>>(),
        [1, 2, 3].map(|n| Some(ip(n)))
    );
    let second = &lbs[1].load_balancer.id;
    store.mark_deleting(second, 0).unwrap();
    store.remove(second).unwrap();
    assert_eq!(
        vip_of(&create(&store, &spec("d"), None).unwrap()),
        Some(ip(2))
    );
    assert_eq!(
        vip_of(&create(&store, &spec("e"), None).unwrap()),
        Some(ip(4))
    );
}

#[test]
fn create_allocates_and_persists_across_reopen() {
    let dir = TempDir::new("store-reopen");
    let store = open(&dir);
    let first = create(&store, &spec("a"), Some("key-a")).unwrap();
    assert!(first.is_new);
    let lb = first.load_balancer;
    assert_eq!(lb.spec.vip, Some(Ipv4Addr::new(127, 77, 0, 1)));
    assert_eq!(lb.state, State::Provisioning);
    assert_eq!(lb.spec.address.pool.as_deref(), Some("default"));
    assert_eq!(lb.spec.address.vips, vec![IpAddr::V4(ip(1))]);
    assert_eq!(lb.version, 1);
    assert!(lb.id.starts_with("lb-") && lb.id.len() == 11);
    drop(store);

    let store = open(&dir);
    assert_eq!(store.get(&lb.id).unwrap(), Some(lb.clone()));
    let again = create(&store, &spec("other"), Some("key-a")).unwrap();
    assert!(!again.is_new);
    assert_eq!(again.load_balancer, lb);
    let second = create(&store, &spec("b"), None).unwrap().load_balancer;
    assert_eq!(second.spec.vip, Some(Ipv4Addr::new(127, 77, 0, 2)));
    assert_eq!(store.list().unwrap().len(), 2);
}

#[test]
fn requested_vip_taken_and_pool_exhaustion_are_refused() {
    let dir = TempDir::new("store-vips");
    let store = open(&dir);
    let mut wanted = spec("a");
    wanted.vip = Some(Ipv4Addr::new(127, 77, 0, 5));
    let holder = create(&store, &wanted, None).unwrap().load_balancer;
    assert!(matches!(
        create(&store, &wanted, None),
        Err(StoreError::VipTaken { holder: h, .. }) if h == holder.id
    ));
    // A /29 has six usable VIPs; one is taken by the request above.
    for _ in 0..5 {
        create(&store, &spec("x"), None).unwrap();
    }
    assert!(matches!(
        create(&store, &spec("x"), None),
        Err(StoreError::PoolExhausted { pool, .. }) if pool == "default"
    ));
    assert_eq!(
        store.list().unwrap().len(),
        6,
        "the refused creates left nothing"
    );
    let used = store.pool_use().unwrap();
    assert_eq!(
        used.iter()
            .map(|p| (p.name.as_str(), p.size, p.allocated))
            .collect::<Vec<_>>(),
        vec![("blue", 2, 0), ("default", 6, 6)]
    );
}

#[test]
fn named_pools_hand_out_their_own_addresses() {
    let dir = TempDir::new("store-pools");
    let store = open(&dir);
    let mut blue = spec("b");
    blue.address.pool = Some("blue".into());
    let first = create(&store, &blue, None).unwrap().load_balancer;
    assert_eq!(first.spec.vip, Some(Ipv4Addr::new(127, 78, 0, 1)));
    assert_eq!(first.spec.address.pool.as_deref(), Some("blue"));
    create(&store, &blue, None).unwrap();
    assert!(matches!(
        create(&store, &blue, None),
        Err(StoreError::PoolExhausted { pool, .. }) if pool == "blue"
    ));
    // Moving the first one to the default pool frees its blue address.
    let moved = update(&store, &first.id, &spec("b"), 1).unwrap();
    assert_eq!(
        moved.spec.vip,
        Some(Ipv4Addr::new(127, 78, 0, 1)),
        "no pool named: it stays"
    );
    let mut to_default = spec("b");
    to_default.address.pool = Some("default".into());
    let moved = update(&store, &first.id, &to_default, 1).unwrap();
    assert_eq!(moved.spec.vip, Some(ip(1)));
    assert_eq!(moved.spec.address.pool.as_deref(), Some("default"));
    assert_eq!(
        create(&store, &blue, None).unwrap().load_balancer.spec.vip,
        Some(Ipv4Addr::new(127, 78, 0, 1))
    );
}

#[test]
fn sharers_with_one_key_and_disjoint_ports_share_until_the_last_goes() {
    let dir = TempDir::new("store-share");
    let store = open(&dir);
    let web = create(&store, &sharer("web", "k", &[80, 443]), None)
        .unwrap()
        .load_balancer;
    // Without a requested address, the key's VIP is reused where the ports fit.
    let dns = create(&store, &sharer("dns", "k", &[53]), None)
        .unwrap()
        .load_balancer;
    assert_eq!(dns.spec.vip, web.spec.vip);
    let clash = create(&store, &sharer("alt", "k", &[443]), None)
        .unwrap()
        .load_balancer;
    assert_ne!(
        clash.spec.vip, web.spec.vip,
        "an unrequested clash gets its own address"
    );

    let mut requested = sharer("alt2", "k", &[443, 8443]);
    requested.vip = web.spec.vip;
    assert!(matches!(
        create(&store, &requested, None),
        Err(StoreError::PortConflict { port: 443, holder, .. }) if holder == web.id
    ));
    let mut other_key = sharer("x", "other", &[9000]);
    other_key.vip = web.spec.vip;
    assert!(matches!(
        create(&store, &other_key, None),
        Err(StoreError::VipTaken { .. })
    ));
    let mut no_key = spec("y");
    no_key.vip = web.spec.vip;
    assert!(matches!(
        create(&store, &no_key, None),
        Err(StoreError::VipTaken { .. })
    ));
    let mut passthrough = sharer("p", "k", &[9001]);
    passthrough.vip = web.spec.vip;
    passthrough.mode = cloud_mock_sdk::Mode::Passthrough;
    assert!(matches!(
        create(&store, &passthrough, None),
        Err(StoreError::SharingModeMismatch { .. })
    ));
    // An update may not grow into a sharer's port either.
    let mut dns_grows = sharer("dns", "k", &[53, 80]);
    dns_grows.vip = dns.spec.vip;
    assert!(matches!(
        update(&store, &dns.id, &dns_grows, 1),
        Err(StoreError::PortConflict { port: 80, .. })
    ));

    for lb in [&web, &dns] {
        store.mark_deleting(&lb.id, 1).unwrap();
    }
    store.remove(&web.id).unwrap();
    let mut newcomer = spec("z");
    newcomer.vip = web.spec.vip;
    assert!(
        matches!(create(&store, &newcomer, None), Err(StoreError::VipTaken { holder, .. }) if holder == dns.id),
        "the VIP stays with its last sharer"
    );
    store.remove(&dns.id).unwrap();
    assert_eq!(
        create(&store, &newcomer, None)
            .unwrap()
            .load_balancer
            .spec
            .vip,
        web.spec.vip
    );
}

#[test]
fn a_sharer_whose_key_goes_or_changes_moves_and_a_lone_holder_stays() {
    let dir = TempDir::new("store-share-rekey");
    let store = open(&dir);
    let web = create(&store, &sharer("web", "k", &[80]), None)
        .unwrap()
        .load_balancer;
    let dns = create(&store, &sharer("dns", "k", &[53]), None)
        .unwrap()
        .load_balancer;
    assert_eq!(dns.spec.vip, web.spec.vip);

    // The key removed while web still shares: dns gets a fresh address.
    let mut unkeyed = sharer("dns", "k", &[53]);
    unkeyed.address.sharing_key = None;
    let moved = update(&store, &dns.id, &unkeyed, dns.version).unwrap();
    assert_ne!(moved.spec.vip, web.spec.vip);

    // Another key: it moves again only if someone else holds its address under
    // another key; alone on its address, it keeps it.
    let rekeyed = update(&store, &dns.id, &sharer("dns", "j", &[53]), moved.version).unwrap();
    assert_eq!(
        rekeyed.spec.vip, moved.spec.vip,
        "a lone holder keeps its address"
    );

    // web changes its key while alone on its address: it stays there too.
    let web_rekeyed = update(&store, &web.id, &sharer("web", "j", &[80]), web.version).unwrap();
    assert_eq!(web_rekeyed.spec.vip, web.spec.vip);
}

#[test]
fn a_corrupt_record_fails_the_open_instead_of_freeing_its_address() {
    let dir = TempDir::new("store-corrupt-sharer");
    let store = open(&dir);
    let web = create(&store, &sharer("web", "k", &[80]), None)
        .unwrap()
        .load_balancer;
    drop(store);
    write_raw(&dir, LOAD_BALANCERS, &web.id, b"not json");
    let opened = Store::open_redb(dir.path(), pools());
    assert!(
        matches!(&opened, Err(StoreError::Corrupt { what, .. }) if what.contains(&web.id)),
        "the record is named"
    );
}

#[test]
fn a_record_from_before_pools_updates_in_the_default_pool() {
    let dir = TempDir::new("store-no-pool");
    let store = open(&dir);
    let mut lb = create(&store, &spec("a"), None).unwrap().load_balancer;
    drop(store);
    lb.spec.address.pool = None;
    write_raw(
        &dir,
        LOAD_BALANCERS,
        &lb.id,
        &serde_json::to_vec(&lb).unwrap(),
    );
    let store = open(&dir);
    let mut changed = spec("a");
    changed.backends.pop();
    let updated = update(&store, &lb.id, &changed, 1).unwrap();
    assert_eq!(updated.spec.address.pool.as_deref(), Some(DEFAULT_POOL));
    assert_eq!(updated.spec.vip, lb.spec.vip);
}

#[test]
fn update_checks_version_and_moves_the_vip() {
    let dir = TempDir::new("store-update");
    let store = open(&dir);
    let lb = create(&store, &spec("a"), None).unwrap().load_balancer;
    let mut changed = spec("a");
    changed.backends.pop();
    assert!(matches!(
        update(&store, &lb.id, &changed, 7),
        Err(StoreError::VersionMismatch {
            current: 1,
            expected: 7,
            ..
        })
    ));
    let updated = update(&store, &lb.id, &changed, 1).unwrap();
    assert_eq!(updated.version, 2);
    assert_eq!(updated.spec.vip, lb.spec.vip);
    let unchanged = update(&store, &lb.id, &changed, 2).unwrap();
    assert_eq!(unchanged.version, 2);

    changed.vip = Some(Ipv4Addr::new(127, 77, 0, 6));
    let moved = update(&store, &lb.id, &changed, 2).unwrap();
    assert_eq!(moved.spec.vip, Some(Ipv4Addr::new(127, 77, 0, 6)));
    // The old VIP is free again: the next create gets it.
    let next = create(&store, &spec("b"), None).unwrap().load_balancer;
    assert_eq!(next.spec.vip, lb.spec.vip);
    assert!(matches!(
        update(&store, "lb-missing", &changed, 1),
        Err(StoreError::NotFound { .. })
    ));
}

#[test]
fn delete_lifecycle_frees_vip_and_key() {
    let dir = TempDir::new("store-delete");
    let store = open(&dir);
    let lb = create(&store, &spec("a"), Some("k")).unwrap().load_balancer;
    assert_eq!(
        store.mark_active(std::slice::from_ref(&lb.id), 5).unwrap(),
        1
    );
    let active = store.get(&lb.id).unwrap().unwrap();
    assert_eq!((active.state, active.state_since_ms), (State::Active, 5));
    let deleting = store.mark_deleting(&lb.id, 9).unwrap().unwrap();
    assert!(deleting.changed);
    assert_eq!(deleting.load_balancer.state, State::Deleting);
    // A second delete, even within the same millisecond, changes nothing.
    for now in [9, 50] {
        let again = store.mark_deleting(&lb.id, now).unwrap().unwrap();
        assert!(!again.changed);
        assert_eq!(again.load_balancer.state_since_ms, 9);
    }
    assert_eq!(
        store.mark_active(std::slice::from_ref(&lb.id), 60).unwrap(),
        0
    );
    assert!(matches!(
        update(&store, &lb.id, &spec("a"), 1),
        Err(StoreError::Deleting { .. })
    ));
    store.remove(&lb.id).unwrap();
    assert_eq!(store.get(&lb.id).unwrap(), None);
    assert_eq!(store.mark_deleting(&lb.id, 70).unwrap(), None);
    let fresh = create(&store, &spec("a"), Some("k")).unwrap();
    assert!(fresh.is_new);
    assert_eq!(fresh.load_balancer.spec.vip, lb.spec.vip);
}

#[test]
fn a_client_chosen_id_is_used_once_and_its_key_replays_it() {
    let dir = TempDir::new("store-chosen-id");
    let store = open(&dir);
    let first = create_as(&store, &spec("a"), Some("web-1"), Some("k1")).unwrap();
    assert!(first.is_new);
    assert_eq!(first.load_balancer.id, "web-1");
    // A retry of the same create answers the same LB.
    let replay = create_as(&store, &spec("a"), Some("web-1"), Some("k1")).unwrap();
    assert!(!replay.is_new);
    assert_eq!(replay.load_balancer.id, "web-1");
    // Another create may not take the id, with another key or none.
    for key in [Some("k2"), None] {
        assert!(matches!(
            create_as(&store, &spec("b"), Some("web-1"), key),
            Err(StoreError::IdTaken { id }) if id == "web-1"
        ));
    }
    // Refused whole: the VIP the second create would have had is still free.
    let other = create(&store, &spec("b"), Some("k2")).unwrap();
    assert_eq!(
        other.load_balancer.spec.vip,
        Some(Ipv4Addr::new(127, 77, 0, 2))
    );
}

fn dual_pools() -> VipPools {
    "127.77.0.0/29,2001:db8:51:100::/125,blue=127.78.0.0/30,v6=2001:db8:51:200::/126"
        .parse()
        .unwrap()
}

fn v6(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// `spec` of these families, with backends of those families only.
fn of_families(mut s: LoadBalancerSpec, families: &[IpFamily]) -> LoadBalancerSpec {
    s.ip_families = families.to_vec();
    s.backends.extend(
        ["2001:db8:18::11", "2001:db8:18::12"]
            .map(|ip| cloud_mock_sdk::families::Backend { ip: v6(ip) }),
    );
    s.backends
        .retain(|backend| families.contains(&IpFamily::of(&backend.ip)));
    s
}

fn dual(name: &str) -> LoadBalancerSpec {
    of_families(spec(name), &[IpFamily::Ipv6, IpFamily::Ipv4])
}

fn only6(name: &str) -> LoadBalancerSpec {
    of_families(spec(name), &[IpFamily::Ipv6])
}

fn allocated(store: &SyncStore) -> Vec<(String, IpFamily, u64)> {
    store
        .pool_use()
        .unwrap()
        .into_iter()
        .map(|p| (p.name, p.family, p.allocated))
        .collect()
}

#[test]
fn each_family_gets_its_vip_in_order_and_frees_it() {
    let dir = TempDir::new("store-dual");
    let store = SyncStore::open(dir.path(), dual_pools());
    let lb = create(&store, &dual("a"), None).unwrap().load_balancer;
    assert_eq!(
        lb.spec.address.vips,
        vec![v6("2001:db8:51:100::1"), IpAddr::V4(ip(1))]
    );
    assert_eq!(lb.spec.vip, Some(ip(1)), "vip stays the IPv4 one");
    let b = create(&store, &only6("b"), None).unwrap().load_balancer;
    assert_eq!(b.vips(), vec![v6("2001:db8:51:100::2")]);
    assert_eq!(b.spec.vip, None);
    assert_eq!(
        allocated(&store),
        vec![
            ("blue".to_owned(), IpFamily::Ipv4, 0),
            ("default".to_owned(), IpFamily::Ipv4, 1),
            ("default".to_owned(), IpFamily::Ipv6, 2),
            ("v6".to_owned(), IpFamily::Ipv6, 0),
        ]
    );
    for id in [&lb.id, &b.id] {
        store.mark_deleting(id, 1).unwrap();
        store.remove(id).unwrap();
    }
    assert!(allocated(&store).iter().all(|(_, _, n)| *n == 0));
}

#[test]
fn one_exhausted_family_refuses_the_whole_load_balancer() {
    let dir = TempDir::new("store-dual-exhausted");
    let store = SyncStore::open(dir.path(), dual_pools());
    let mut in_v6 = only6("x");
    in_v6.address.pool = Some("v6".into());
    for _ in 0..3 {
        create(&store, &in_v6, None).unwrap();
    }
    assert!(matches!(
        create(&store, &in_v6, None),
        Err(StoreError::PoolExhausted { pool, .. }) if pool == "v6"
    ));
    // The default pool's IPv6 CIDR is full: a dual-stack create takes no IPv4 either.
    let filler = only6("f");
    for _ in 0..7 {
        create(&store, &filler, None).unwrap();
    }
    let before = store.list().unwrap().len();
    assert!(matches!(
        create(&store, &dual("z"), None),
        Err(StoreError::PoolExhausted {
            cidr: IpNet::V6(_),
            ..
        })
    ));
    assert_eq!(store.list().unwrap().len(), before, "nothing half made");
    assert!(
        allocated(&store).contains(&("default".to_owned(), IpFamily::Ipv4, 0)),
        "no IPv4 address was taken"
    );
}

#[test]
fn sharing_keys_share_per_family() {
    let dir = TempDir::new("store-dual-share");
    let store = SyncStore::open(dir.path(), dual_pools());
    let web = of_families(sharer("web", "k", &[80]), &[IpFamily::Ipv4, IpFamily::Ipv6]);
    let web = create(&store, &web, None).unwrap().load_balancer;
    let dns = of_families(sharer("dns", "k", &[53]), &[IpFamily::Ipv6, IpFamily::Ipv4]);
    let dns = create(&store, &dns, None).unwrap().load_balancer;
    assert_eq!(
        dns.vips(),
        vec![web.vips()[1], web.vips()[0]],
        "both addresses shared, in the sharer's own order"
    );
    // An IPv4-only sharer shares the IPv4 address.
    let v4_only = create(&store, &sharer("ntp", "k", &[123]), None)
        .unwrap()
        .load_balancer;
    assert_eq!(v4_only.vips(), vec![web.vips()[0]]);
    // A port clash in one family: its own addresses, in both.
    let clash = of_families(sharer("alt", "k", &[80]), &[IpFamily::Ipv6]);
    let clash = create(&store, &clash, None).unwrap().load_balancer;
    assert_ne!(clash.vips()[0], web.vips()[1]);
    // Requesting the shared IPv6 address without the key is refused.
    let mut taker = only6("t");
    taker.address.vips = vec![web.vips()[1]];
    assert!(matches!(
        create(&store, &taker, None),
        Err(StoreError::VipTaken { vip, .. }) if vip == web.vips()[1]
    ));
    for lb in [&web, &dns, &v4_only] {
        store.mark_deleting(&lb.id, 1).unwrap();
        store.remove(&lb.id).unwrap();
    }
    assert_eq!(
        create(&store, &taker, None).unwrap().load_balancer.vips(),
        vec![v6("2001:db8:51:100::1")],
        "freed with the last sharer"
    );
}

#[test]
fn updates_add_drop_and_reorder_families_keeping_addresses() {
    let dir = TempDir::new("store-dual-update");
    let store = SyncStore::open(dir.path(), dual_pools());
    let lb = create(&store, &spec("a"), None).unwrap().load_balancer;
    assert_eq!(lb.vips(), vec![IpAddr::V4(ip(1))]);
    let mut both = of_families(spec("a"), &[IpFamily::Ipv4, IpFamily::Ipv6]);
    let grown = update(&store, &lb.id, &both, 1).unwrap();
    assert_eq!(
        grown.vips(),
        vec![IpAddr::V4(ip(1)), v6("2001:db8:51:100::1")],
        "the IPv4 address stays"
    );
    both.ip_families.reverse();
    let reordered = update(&store, &lb.id, &both, 2).unwrap();
    assert_eq!(
        reordered.vips(),
        vec![v6("2001:db8:51:100::1"), IpAddr::V4(ip(1))]
    );
    let shrunk = update(&store, &lb.id, &only6("a"), 3).unwrap();
    assert_eq!(shrunk.vips(), vec![v6("2001:db8:51:100::1")]);
    assert_eq!(shrunk.spec.vip, None);
    assert_eq!(
        create(&store, &spec("b"), None)
            .unwrap()
            .load_balancer
            .vips(),
        vec![IpAddr::V4(ip(1))],
        "the dropped family's address is free again"
    );

    // In a pool without IPv6, an update that adds IPv6 is refused and changes nothing.
    let mut blue = spec("c");
    blue.address.pool = Some("blue".into());
    let c = create(&store, &blue, None).unwrap().load_balancer;
    let grow = of_families(spec("c"), &[IpFamily::Ipv4, IpFamily::Ipv6]);
    assert!(matches!(
        update(&store, &c.id, &grow, 1),
        Err(StoreError::PoolLacksFamily { pool, family: IpFamily::Ipv6 }) if pool == "blue"
    ));
    assert_eq!(store.get(&c.id).unwrap(), Some(c));
}

#[test]
fn a_database_of_the_ipv4_only_version_opens_and_serves() {
    let dir = TempDir::new("store-upgrade");
    // What the previous version wrote: its three tables, an IPv4 LB and its holder.
    {
        let db = Database::create(dir.path().join("cloud-mock.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        let record = r#"{"id": "lb-0000000a", "spec": {"name": "old", "tags": {}, "mode": "proxy",
          "vip": "127.77.0.3", "listeners": [{"protocol": "TCP", "port": 80, "backendPort": 30080}],
          "backends": [{"ip": "198.18.0.11"}], "sourceRanges": ["203.0.113.0/24"],
          "pool": "default", "vips": ["127.77.0.3"]},
          "state": "active", "version": 2, "stateSinceMs": 5}"#;
        txn.open_table(LOAD_BALANCERS)
            .unwrap()
            .insert("lb-0000000a", record.as_bytes())
            .unwrap();
        txn.open_table(VIP_HOLDERS)
            .unwrap()
            .insert(u32::from(ip(3)), br#"{"ids": ["lb-0000000a"]}"#.as_slice())
            .unwrap();
        txn.open_table(IDEMPOTENCY_KEYS).unwrap();
        txn.commit().unwrap();
    }
    let store = SyncStore::open(dir.path(), dual_pools());
    let old = store.get("lb-0000000a").unwrap().unwrap();
    assert_eq!(old.spec.ip_families, vec![IpFamily::Ipv4]);
    assert_eq!(old.vips(), vec![IpAddr::V4(ip(3))]);
    // Its address stays taken, and it can grow an IPv6 VIP.
    assert_ne!(
        create(&store, &spec("new"), None)
            .unwrap()
            .load_balancer
            .vips(),
        vec![IpAddr::V4(ip(3))]
    );
    let grown = of_families(old.spec.clone(), &[IpFamily::Ipv4, IpFamily::Ipv6]);
    let grown = update(&store, &old.id, &grown, 2).unwrap();
    assert_eq!(
        grown.vips(),
        vec![IpAddr::V4(ip(3)), v6("2001:db8:51:100::1")]
    );
}

fn members(ips: &[&str]) -> NodePoolSpec {
    NodePoolSpec {
        tags: std::collections::BTreeMap::from([("cluster".into(), "c1".into())]),
        backends: ips
            .iter()
            .map(|ip| cloud_mock_sdk::families::Backend {
                ip: ip.parse().unwrap(),
            })
            .collect(),
    }
}

fn on_pool(name: &str, node_pool: &str) -> LoadBalancerSpec {
    let mut s = spec(name);
    s.backends.clear();
    s.node_pool = Some(node_pool.into());
    s
}

#[test]
fn node_pools_are_created_replaced_left_alone_and_kept_across_reopen() {
    let dir = TempDir::new("store-node-pools");
    let store = open(&dir);
    let created = store
        .put_node_pool("c1", &members(&["10.0.0.2", "10.0.0.1"]), None)
        .unwrap();
    assert_eq!(created.written, Written::Created);
    assert_eq!(created.node_pool.version, 1);
    assert_eq!(
        created.node_pool.spec,
        members(&["10.0.0.1", "10.0.0.2"]),
        "kept in address order"
    );
    // The same set in another order, with a stale or no If-Match: nothing changes.
    for if_match in [None, Some(1), Some(7)] {
        let same = store
            .put_node_pool("c1", &members(&["10.0.0.1", "10.0.0.2"]), if_match)
            .unwrap();
        assert_eq!(same.written, Written::Unchanged, "{if_match:?}");
        assert_eq!(same.node_pool, created.node_pool);
    }
    let replaced = store
        .put_node_pool("c1", &members(&["10.0.0.1", "10.0.0.3"]), Some(1))
        .unwrap();
    assert_eq!(replaced.written, Written::Replaced);
    assert_eq!(replaced.node_pool.version, 2);
    assert!(matches!(
        store.put_node_pool("c1", &members(&["10.0.0.4"]), Some(1)),
        Err(StoreError::NodePoolVersionMismatch {
            current: Some(2),
            expected: 1,
            ..
        })
    ));
    assert!(matches!(
        store.put_node_pool("c2", &members(&[]), Some(1)),
        Err(StoreError::NodePoolVersionMismatch { current: None, .. })
    ));
    assert_eq!(
        store.node_pool("c2").unwrap(),
        None,
        "a refused write makes nothing"
    );
    drop(store);

    let store = open(&dir);
    let (kept, users) = store.get_node_pool("c1").unwrap().unwrap();
    assert_eq!(kept, replaced.node_pool);
    assert!(users.is_empty());
    assert!(store.delete_node_pool("c1").unwrap());
    assert!(
        !store.delete_node_pool("c1").unwrap(),
        "absent the second time"
    );
    assert_eq!(store.get_node_pool("c1").unwrap(), None);
}

#[test]
fn the_reference_index_of_earlier_versions_is_dropped_at_open() {
    let dir = TempDir::new("store-node-pool-index");
    let store = open(&dir);
    store
        .put_node_pool("c1", &members(&["10.0.0.1"]), None)
        .unwrap();
    let a = create(&store, &on_pool("a", "c1"), None)
        .unwrap()
        .load_balancer;
    create(&store, &spec("b"), None).unwrap();
    drop(store);
    // What an earlier version kept on disk: an index, stale here (it names b).
    {
        let db = Database::create(dir.path().join(FILE_NAME)).unwrap();
        let txn = db.begin_write().unwrap();
        let index: redb::TableDefinition<&str, ()> =
            redb::TableDefinition::new("node_pool_references");
        txn.open_table(index)
            .unwrap()
            .insert("c1\0lb-stale", ())
            .unwrap();
        txn.commit().unwrap();
    }
    let store = open(&dir);
    let (_, users) = store.get_node_pool("c1").unwrap().unwrap();
    assert_eq!(users, vec![a.id], "derived from the specs");
    drop(store);
    let db = Database::create(dir.path().join(FILE_NAME)).unwrap();
    let tables: Vec<String> = db
        .begin_read()
        .unwrap()
        .list_tables()
        .unwrap()
        .map(|table| table.name().to_owned())
        .collect();
    assert!(
        !tables.contains(&"node_pool_references".to_owned()),
        "an earlier version opening the file rebuilds its index: {tables:?}"
    );
}

#[test]
fn a_node_pool_is_held_by_its_load_balancers_until_they_are_removed() {
    let dir = TempDir::new("store-node-pool-use");
    let store = open(&dir);
    assert!(matches!(
        create(&store, &on_pool("a", "c1"), None),
        Err(StoreError::UnknownNodePool { name }) if name == "c1"
    ));
    assert!(
        store.list().unwrap().is_empty(),
        "the refused create made nothing"
    );
    store
        .put_node_pool("c1", &members(&["10.0.0.1"]), None)
        .unwrap();
    store.put_node_pool("other", &members(&[]), None).unwrap();
    let a = create(&store, &on_pool("a", "c1"), None)
        .unwrap()
        .load_balancer;
    let b = create(&store, &spec("b"), None).unwrap().load_balancer;
    // An update may move an LB onto a pool that exists, not onto one that does not.
    assert!(matches!(
        update(&store, &b.id, &on_pool("b", "nope"), 1),
        Err(StoreError::UnknownNodePool { .. })
    ));
    update(&store, &b.id, &on_pool("b", "c1"), 1).unwrap();
    let listed = store.list_node_pools().unwrap();
    let users: Vec<(&str, usize)> = listed
        .iter()
        .map(|(pool, ids)| (pool.name.as_str(), ids.len()))
        .collect();
    assert_eq!(users, vec![("c1", 2), ("other", 0)]);
    let snapshot = store.snapshot().unwrap();
    let resolved = snapshot
        .load_balancers
        .iter()
        .filter_map(|lb| snapshot.node_pool_of(lb))
        .count();
    assert_eq!(resolved, 2);

    let in_use = |store: &SyncStore| match store.delete_node_pool("c1") {
        Err(StoreError::NodePoolInUse { load_balancers, .. }) => load_balancers,
        other => panic!("expected node-pool-in-use, got {other:?}"),
    };
    let mut both = vec![a.id.clone(), b.id.clone()];
    both.sort();
    assert_eq!(in_use(&store), both);
    update(&store, &b.id, &spec("b"), 2).unwrap();
    // Being deleted still holds it: the data plane may still serve the LB.
    store.mark_deleting(&a.id, 0).unwrap();
    assert_eq!(in_use(&store), vec![a.id.clone()]);
    store.remove(&a.id).unwrap();
    assert!(store.delete_node_pool("c1").unwrap());
}
