#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The etcd store against a real 3-member etcd cluster (Debian's etcd 3.4 on loopback):
//! several edges writing at once never hand out one VIP twice, make one load balancer
//! twice or pass a tenant's quota; an edge cut from its member resumes its watch, and lists again after a
//! compaction; writes without quorum fail cleanly while reads go on; one edge leads, and
//! another takes over when it goes; a redb store copied into etcd keeps everything.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use cloud_mock::etcd_cluster::EtcdCluster;
use cloud_mock::pools::VipPools;
use cloud_mock::store::{EtcdSettings, Store, StoreError, etcd};
use cloud_mock::validate::validate_spec;
use cloud_mock_sdk::families::LoadBalancerSpec;
use cloud_mock_sdk::{NodePoolSpec, State};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// 62 VIPs.
const POOL: &str = "198.51.100.0/26";

fn pools() -> VipPools {
    POOL.parse().unwrap()
}

fn settings(endpoints: Vec<String>, edge: &str) -> EtcdSettings {
    EtcdSettings {
        endpoints,
        prefix: "/test-edge".into(),
        tls: None,
        user: None,
        edge_name: edge.into(),
    }
}

/// An edge's store on `endpoints`, watched until `cancel`.
async fn edge(endpoints: Vec<String>, name: &str, cancel: &CancellationToken) -> Store {
    Store::open_etcd(&settings(endpoints, name), pools(), cancel.clone())
        .await
        .unwrap()
}

fn spec(name: &str) -> LoadBalancerSpec {
    serde_json::from_value(json!({
        "name": name,
        "tags": {"cluster": "c1"},
        "mode": "proxy",
        "listeners": [{"protocol": "TCP", "port": 80, "backendPort": 30080}],
        "backends": [{"ip": "198.18.0.11"}],
    }))
    .unwrap()
}

async fn create(
    store: &Store,
    name: &str,
    key: Option<&str>,
) -> Result<cloud_mock::store::Created, StoreError> {
    let spec = spec(name);
    let placement = validate_spec(&spec, store.pools()).unwrap();
    store
        .create(spec, placement, None, key.map(str::to_owned), None, 0)
        .await
}

/// Waits until `done` holds, at most `within`.
async fn eventually(within: Duration, what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn ids(store: &Store) -> BTreeSet<String> {
    store.list().into_iter().map(|lb| lb.id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edges_writing_at_once_never_hand_out_a_vip_twice_make_a_key_twice_or_pass_a_quota() {
    let cluster = EtcdCluster::start(3).await;
    let cancel = CancellationToken::new();
    let endpoints = cluster.endpoints();
    // Each edge talks to a member of its own.
    let a = edge(vec![endpoints[0].clone()], "a", &cancel).await;
    let b = edge(vec![endpoints[1].clone()], "b", &cancel).await;
    // 80 creates for 62 addresses, 8 at a time on each edge.
    let mut tasks = tokio::task::JoinSet::new();
    let mut results = Vec::new();
    for n in 0..80 {
        let store = if n % 2 == 0 { a.clone() } else { b.clone() };
        tasks.spawn(async move { create(&store, &format!("lb{n}"), None).await });
        if tasks.len() >= 16 {
            results.extend(tasks.join_next().await);
        }
    }
    while let Some(result) = tasks.join_next().await {
        results.push(result);
    }
    let mut acknowledged = Vec::new();
    let mut exhausted = 0;
    for result in results {
        match result.unwrap() {
            Ok(created) => acknowledged.push(created.load_balancer),
            Err(StoreError::PoolExhausted { .. }) => exhausted += 1,
            Err(other) => panic!("an unexpected refusal: {other}"),
        }
    }
    eventually(
        Duration::from_secs(10),
        "both edges see every load balancer",
        || ids(&a) == ids(&b),
    )
    .await;
    let all = a.list();
    assert_eq!(all.len(), 62, "the pool is used up");
    assert_eq!(
        (acknowledged.len(), exhausted),
        (62, 18),
        "every refusal was for exhaustion"
    );
    let vips: BTreeSet<IpAddr> = all.iter().flat_map(|lb| lb.vips()).collect();
    assert_eq!(vips.len(), all.len(), "no VIP handed out twice");
    for lb in &acknowledged {
        assert_eq!(
            a.get(&lb.id).as_deref(),
            Some(lb),
            "an acknowledged create is kept"
        );
    }
    assert!(
        a.create(
            spec("more"),
            validate_spec(&spec("more"), &pools()).unwrap(),
            None,
            None,
            None,
            0
        )
        .await
        .is_err()
    );

    // One Idempotency-Key sent to both edges at once makes one load balancer.
    for lb in all {
        a.mark_deleting(lb.id.clone(), 0).await.unwrap();
        b.remove(lb.id).await.unwrap();
    }
    eventually(Duration::from_secs(10), "every one removed", || {
        ids(&a).is_empty() && ids(&b).is_empty()
    })
    .await;
    let (on_a, on_b) = tokio::join!(
        create(&a, "same", Some("key-1")),
        create(&b, "same", Some("key-1"))
    );
    let (on_a, on_b) = (on_a.unwrap(), on_b.unwrap());
    assert_eq!(on_a.load_balancer.id, on_b.load_balancer.id);
    assert!(
        on_a.is_new != on_b.is_new,
        "one made it, the other replayed it"
    );

    // A tenant's quota holds however many edges create for it at once: 20 creates, 10 on
    // each edge, for a quota of 5.
    let tenant = cloud_mock::tenants::parse(
        r#"{"tenants": [{"name": "t", "clusters": ["c1"], "pools": ["default"],
            "quotas": {"loadBalancers": 5}, "credentials": []}]}"#,
    )
    .unwrap()
    .remove(0);
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..20 {
        let store = if n % 2 == 0 { a.clone() } else { b.clone() };
        let tenant = tenant.clone();
        tasks.spawn(async move {
            let mut spec = spec(&format!("t{n}"));
            spec.tags = [("kubernetes.io/cluster-id".to_owned(), "c1".to_owned())].into();
            let placement = validate_spec(&spec, store.pools()).unwrap();
            store
                .create(spec, placement, None, None, Some(tenant), 0)
                .await
        });
    }
    let (mut made, mut refused) = (0, 0);
    while let Some(result) = tasks.join_next().await {
        match result.unwrap() {
            Ok(_) => made += 1,
            Err(StoreError::Refused(_)) => refused += 1,
            Err(other) => panic!("an unexpected refusal: {other}"),
        }
    }
    assert_eq!((made, refused), (5, 15));
    eventually(Duration::from_secs(10), "both edges see the five", || {
        ids(&a) == ids(&b)
    })
    .await;
    let owned = a
        .list()
        .into_iter()
        .filter(|lb| tenant.owns(&lb.spec.tags))
        .count();
    assert_eq!(owned, 5, "no edge passed the quota");
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_cut_from_its_member_resumes_and_lists_again_after_a_compaction() {
    let mut cluster = EtcdCluster::start(3).await;
    let cancel = CancellationToken::new();
    let endpoints = cluster.endpoints();
    let a = edge(vec![endpoints[0].clone()], "a", &cancel).await;
    let b = edge(vec![endpoints[2].clone()], "b", &cancel).await;
    let first = create(&a, "first", None).await.unwrap().load_balancer;
    eventually(Duration::from_secs(5), "b sees the first", || {
        b.get(&first.id).is_some()
    })
    .await;

    // b's member goes: b keeps what it has and refuses writes.
    cluster.stop_member(2);
    let started = Instant::now();
    assert!(matches!(
        create(&b, "refused", None).await,
        Err(StoreError::Unavailable { .. })
    ));
    assert!(
        started.elapsed() < Duration::from_secs(12),
        "refused in bounded time: {:?}",
        started.elapsed()
    );
    assert_eq!(
        b.get(&first.id).as_deref(),
        Some(&first),
        "reads are served from its copy"
    );

    // Meanwhile a writes, and the history b would resume from is compacted away.
    let mut written = vec![first.id.clone()];
    for n in 0..5 {
        written.push(
            create(&a, &format!("while-away-{n}"), None)
                .await
                .unwrap()
                .load_balancer
                .id,
        );
    }
    a.remove(first.id.clone()).await.unwrap();
    written.remove(0);
    let mut client = etcd_client::Client::connect([&endpoints[0]], None)
        .await
        .unwrap();
    let revision = client
        .get("/test-edge", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    client.compact(revision, None).await.unwrap();

    cluster.start_member(2);
    cluster.wait_healthy().await;
    let expected: BTreeSet<String> = written.into_iter().collect();
    eventually(
        Duration::from_secs(20),
        "b lists again and converges",
        || ids(&b) == expected,
    )
    .await;
    // And b writes again.
    let after = create(&b, "after", None).await.unwrap().load_balancer;
    eventually(Duration::from_secs(5), "a sees b's write", || {
        a.get(&after.id).is_some()
    })
    .await;
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_quorum_writes_fail_cleanly_and_nothing_acknowledged_is_lost() {
    let mut cluster = EtcdCluster::start(3).await;
    let cancel = CancellationToken::new();
    let store = edge(cluster.endpoints(), "a", &cancel).await;
    let kept = create(&store, "kept", Some("k1"))
        .await
        .unwrap()
        .load_balancer;
    cluster.stop_member(1);
    cluster.stop_member(2);
    let refused = create(&store, "refused", Some("k2")).await;
    assert!(
        matches!(refused, Err(StoreError::Unavailable { .. })),
        "{refused:?}"
    );
    assert_eq!(store.get(&kept.id).as_deref(), Some(&kept));
    cluster.start_member(1);
    cluster.start_member(2);
    cluster.wait_healthy().await;
    // A retry of the refused create (its key) makes it once; the kept one is still there.
    let retried = create(&store, "refused", Some("k2")).await.unwrap();
    let replayed = create(&store, "refused", Some("k2")).await.unwrap();
    assert!(replayed.load_balancer.id == retried.load_balancer.id && !replayed.is_new);
    assert_eq!(store.list().len(), 2);
    let fresh = edge(cluster.endpoints(), "c", &cancel).await;
    assert_eq!(
        fresh.get(&kept.id).as_deref(),
        Some(&kept),
        "a restarted edge lists what was acknowledged"
    );
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_through_a_killed_etcd_leader_lose_nothing_and_make_nothing_twice() {
    let mut cluster = EtcdCluster::start(3).await;
    let cancel = CancellationToken::new();
    let a = edge(cluster.endpoints(), "a", &cancel).await;
    let b = edge(cluster.endpoints(), "b", &cancel).await;
    const CREATES: usize = 40;
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..CREATES {
        let store = if n % 2 == 0 { a.clone() } else { b.clone() };
        // As the controller does: a refused create is sent again with its key.
        tasks.spawn(async move {
            let key = format!("key-{n}");
            let mut refused = 0;
            loop {
                match create(&store, &format!("lb{n}"), Some(&key)).await {
                    Ok(created) => return (key, created.load_balancer.id, refused),
                    Err(StoreError::Unavailable { .. }) => refused += 1,
                    Err(other) => panic!("{key}: {other}"),
                }
            }
        });
        if n == CREATES / 4 {
            let leader = cluster.leader(0).await;
            cluster.stop_member(leader);
        }
        if tasks.len() >= 4 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut made = std::collections::BTreeMap::new();
    let mut refusals = 0;
    while let Some(result) = tasks.join_next().await {
        let (key, id, refused) = result.unwrap();
        refusals += refused;
        made.insert(key, id);
    }
    eventually(Duration::from_secs(10), "both edges converge", || {
        ids(&a) == ids(&b)
    })
    .await;
    let all = a.list();
    assert_eq!(made.len(), CREATES);
    assert_eq!(all.len(), CREATES, "one load balancer per key, none twice");
    for lb in &all {
        let key = lb.idempotency_key.as_ref().unwrap();
        assert_eq!(made.get(key), Some(&lb.id), "the acknowledged one");
    }
    let vips: BTreeSet<IpAddr> = all.iter().flat_map(|lb| lb.vips()).collect();
    assert_eq!(vips.len(), CREATES);
    println!("creates refused while etcd elected a new leader: {refusals}");
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_edge_leads_and_another_takes_over_when_it_goes() {
    let cluster = EtcdCluster::start(3).await;
    let (cancel_a, cancel_b) = (CancellationToken::new(), CancellationToken::new());
    let a = edge(cluster.endpoints(), "a", &cancel_a).await;
    let b = edge(cluster.endpoints(), "b", &cancel_b).await;
    let (leads_a, leads_b) = (a.leadership(), b.leadership());
    eventually(Duration::from_secs(10), "one edge leads", || {
        *leads_a.borrow() || *leads_b.borrow()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !(*leads_a.borrow() && *leads_b.borrow()),
        "never two leaders"
    );
    let (leader_cancel, follower) = if *leads_a.borrow() {
        (cancel_a, leads_b)
    } else {
        (cancel_b, leads_a)
    };
    let stopped = Instant::now();
    leader_cancel.cancel();
    eventually(Duration::from_secs(10), "the other edge takes over", || {
        *follower.borrow()
    })
    .await;
    println!("leadership moved in {:?}", stopped.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_edges_store_copied_into_etcd_keeps_ids_vips_versions_and_keys() {
    let cluster = EtcdCluster::start(3).await;
    let dir = std::env::temp_dir().join(format!("cloud-mock-copy-{}", std::process::id()));
    let single = Store::open_redb(&dir, pools()).unwrap();
    single
        .put_node_pool(
            "c1".into(),
            serde_json::from_value::<NodePoolSpec>(json!({"backends": [{"ip": "198.18.0.11"}]}))
                .unwrap(),
            None,
        )
        .await
        .unwrap();
    let mut made = Vec::new();
    for n in 0..3 {
        made.push(
            create(&single, &format!("lb{n}"), Some(&format!("key-{n}")))
                .await
                .unwrap()
                .load_balancer,
        );
    }
    single
        .mark_active(vec![made[0].id.clone()], 5)
        .await
        .unwrap();
    let before = single.snapshot();
    let etcd_settings = settings(cluster.endpoints(), "copy");
    let copied = etcd::copy_into(&single, &etcd_settings).await.unwrap();
    assert_eq!(
        copied,
        3 + 3 + 3 + 1,
        "load balancers, VIPs, keys and the node pool"
    );
    assert!(
        etcd::copy_into(&single, &etcd_settings).await.is_err(),
        "never over a store"
    );

    let cancel = CancellationToken::new();
    let grown = Store::open_etcd(&etcd_settings, pools(), cancel.clone())
        .await
        .unwrap();
    assert_eq!(grown.snapshot(), before);
    assert_eq!(grown.get(&made[0].id).unwrap().state, State::Active);
    let replayed = create(&grown, "lb1", Some("key-1")).await.unwrap();
    assert!(
        !replayed.is_new && replayed.load_balancer == made[1],
        "its key replays it"
    );
    let next = create(&grown, "new", None).await.unwrap().load_balancer;
    assert!(
        !made.iter().any(|lb| lb.vips() == next.vips()),
        "its VIPs stay taken"
    );
    cancel.cancel();
    let _ = std::fs::remove_dir_all(&dir);
}
