//! Property: for random sequences of Service and EndpointSlice watch events
//! (relists included), the ruleset kept by the change tracker and the incremental build
//! equals a full conversion and build of the same objects after every step, and a sync
//! writes exactly the chains that differ.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher::Event;
use proptest::prelude::*;
use tandem_common::IpFamily;
use tandem_nodeproxy::observe::change_tracker::ChangeTracker;
use tandem_nodeproxy::observe::convert::{SERVICE_NAME_LABEL, proxy_state};
use tandem_proxy_rules::incremental::IncrementalRuleset;
use tandem_proxy_rules::ruleset::ChangedChains;

const SERVICES: usize = 3;
const SLICES: usize = 4;
const NAMESPACE: &str = "default";

fn meta(name: String, labels: Option<BTreeMap<String, String>>) -> ObjectMeta {
    ObjectMeta {
        namespace: Some(NAMESPACE.into()),
        name: Some(name),
        labels,
        ..ObjectMeta::default()
    }
}

/// What a generated Service looks like.
#[derive(Debug, Clone)]
struct ServiceShape {
    kind: &'static str,
    headless: bool,
    two_ports: bool,
    local: bool,
    internal_local: bool,
    udp: bool,
}

fn service(index: usize, shape: &ServiceShape) -> Service {
    let node_ports = shape.kind != "ClusterIP";
    let port = |name: &str, number: i32, offset: i32| ServicePort {
        name: Some(name.into()),
        port: number,
        protocol: Some(if shape.udp { "UDP" } else { "TCP" }.into()),
        node_port: node_ports.then_some(30_000 + 10 * index as i32 + offset),
        ..ServicePort::default()
    };
    let mut ports = vec![port("http", 80, 0)];
    if shape.two_ports {
        ports.push(port("metrics", 9090, 1));
    }
    Service {
        metadata: meta(format!("svc-{index}"), None),
        spec: Some(ServiceSpec {
            type_: Some(shape.kind.into()),
            cluster_ip: Some(if shape.headless {
                "None".into()
            } else {
                format!("10.96.0.{}", index + 1)
            }),
            ports: Some(ports),
            external_traffic_policy: (node_ports && shape.local).then(|| "Local".into()),
            health_check_node_port: (shape.kind == "LoadBalancer" && shape.local)
                .then_some(32_000 + index as i32),
            internal_traffic_policy: Some(
                if shape.internal_local {
                    "Local"
                } else {
                    "Cluster"
                }
                .into(),
            ),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// What a generated EndpointSlice looks like.
#[derive(Debug, Clone)]
struct SliceShape {
    service: usize,
    port_names: Vec<&'static str>,
    /// (last octet, node, ready, serving, terminating)
    endpoints: Vec<(u8, &'static str, bool, bool, bool)>,
}

fn slice(index: usize, shape: &SliceShape) -> EndpointSlice {
    let labels = BTreeMap::from([(
        SERVICE_NAME_LABEL.to_owned(),
        format!("svc-{}", shape.service),
    )]);
    EndpointSlice {
        metadata: meta(format!("slice-{index}"), Some(labels)),
        address_type: "IPv4".into(),
        endpoints: shape
            .endpoints
            .iter()
            .map(|&(last, node, ready, serving, terminating)| Endpoint {
                addresses: vec![format!("10.244.1.{last}")],
                conditions: Some(EndpointConditions {
                    ready: Some(ready),
                    serving: Some(serving),
                    terminating: Some(terminating),
                }),
                node_name: Some(node.into()),
                ..Endpoint::default()
            })
            .collect(),
        ports: Some(
            shape
                .port_names
                .iter()
                .map(|name| EndpointPort {
                    name: Some((*name).into()),
                    port: Some(8080),
                    protocol: Some("TCP".into()),
                    ..EndpointPort::default()
                })
                .collect(),
        ),
    }
}

#[derive(Debug, Clone)]
enum Change {
    ApplyService(usize, ServiceShape),
    DeleteService(usize),
    ApplySlice(usize, SliceShape),
    DeleteSlice(usize),
    /// The watch of Services (false) or slices (true) restarts and lists again; objects
    /// not in the new list went away meanwhile.
    Relist {
        slices: bool,
        keep: Vec<bool>,
    },
}

fn service_shape() -> impl Strategy<Value = ServiceShape> {
    (
        prop_oneof![Just("ClusterIP"), Just("NodePort"), Just("LoadBalancer")],
        prop::bool::weighted(0.15),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop::bool::weighted(0.2),
    )
        .prop_map(
            |(kind, headless, two_ports, local, internal_local, udp)| ServiceShape {
                kind,
                headless,
                two_ports,
                local,
                internal_local,
                udp,
            },
        )
}

fn slice_shape() -> impl Strategy<Value = SliceShape> {
    let endpoint = (
        1u8..6,
        prop_oneof![Just("node-a"), Just("node-b")],
        prop::bool::weighted(0.7),
        prop::bool::weighted(0.8),
        prop::bool::weighted(0.3),
    );
    (
        0..SERVICES,
        prop_oneof![
            Just(vec!["http"]),
            Just(vec!["http", "metrics"]),
            Just(vec!["metrics"])
        ],
        prop::collection::vec(endpoint, 0..4),
    )
        .prop_map(|(service, port_names, endpoints)| SliceShape {
            service,
            port_names,
            endpoints,
        })
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        3 => (0..SERVICES, service_shape()).prop_map(|(i, s)| Change::ApplyService(i, s)),
        1 => (0..SERVICES).prop_map(Change::DeleteService),
        4 => (0..SLICES, slice_shape()).prop_map(|(i, s)| Change::ApplySlice(i, s)),
        1 => (0..SLICES).prop_map(Change::DeleteSlice),
        1 => (any::<bool>(), prop::collection::vec(any::<bool>(), SLICES))
            .prop_map(|(slices, keep)| Change::Relist { slices, keep }),
    ]
}

/// The API server's view, independent of the tracker.
#[derive(Default)]
struct Cluster {
    services: BTreeMap<usize, Service>,
    slices: BTreeMap<usize, EndpointSlice>,
}

/// Applies one change to the cluster and feeds the tracker the watch events a real
/// watch would deliver for it.
fn step(cluster: &mut Cluster, tracker: &mut ChangeTracker, change: Change) {
    match change {
        Change::ApplyService(i, shape) => {
            let object = service(i, &shape);
            cluster.services.insert(i, object.clone());
            tracker.record_service(Event::Apply(object));
        }
        Change::DeleteService(i) => {
            if let Some(object) = cluster.services.remove(&i) {
                tracker.record_service(Event::Delete(object));
            }
        }
        Change::ApplySlice(i, shape) => {
            let object = slice(i, &shape);
            cluster.slices.insert(i, object.clone());
            tracker.record_slice(Event::Apply(object));
        }
        Change::DeleteSlice(i) => {
            if let Some(object) = cluster.slices.remove(&i) {
                tracker.record_slice(Event::Delete(object));
            }
        }
        Change::Relist { slices: true, keep } => {
            cluster.slices.retain(|i, _| keep[*i % keep.len()]);
            tracker.record_slice(Event::Init);
            for object in cluster.slices.values() {
                tracker.record_slice(Event::InitApply(object.clone()));
            }
            tracker.record_slice(Event::InitDone);
        }
        Change::Relist {
            slices: false,
            keep,
        } => {
            cluster.services.retain(|i, _| keep[*i % keep.len()]);
            tracker.record_service(Event::Init);
            for object in cluster.services.values() {
                tracker.record_service(Event::InitApply(object.clone()));
            }
            tracker.record_service(Event::InitDone);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn incremental_rules_equal_the_full_rebuild_after_every_event(
        changes in prop::collection::vec(prop::collection::vec(change(), 1..4), 1..12)
    ) {
        let mut cluster = Cluster::default();
        let mut tracker = ChangeTracker::new(IpFamily::V4);
        let mut rules = IncrementalRuleset::new(common::node());
        let mut previous = rules.ruleset().clone();
        // Each inner batch is what arrives between two syncs.
        for batch in changes {
            for change in batch {
                step(&mut cluster, &mut tracker, change);
            }
            let changes = tracker.take();
            let changed = rules.update(&changes.current, &changes.ports);
            let full_state =
                proxy_state(cluster.services.values(), cluster.slices.values(), IpFamily::V4).state;
            prop_assert_eq!(tracker.state(), &full_state);
            let full = tandem_proxy_rules::build(&full_state, &common::node());
            prop_assert_eq!(rules.ruleset(), &full);
            prop_assert_eq!(&changed, &ChangedChains::between(&previous, &full));
            prop_assert_eq!(
                tracker.snapshot().joined().state,
                full_state,
                "the tracker holds the same objects"
            );
            previous = full;
        }
    }
}
