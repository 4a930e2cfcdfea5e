use std::net::IpAddr;

use tandem_common::{IpFamily, Protocol};

use super::*;
use crate::model::{Hints, ServicePortName};
use crate::trace::{Entry, Packet};

const NODE: &str = "node-a";

/// An endpoint as upstream's `BaseEndpointInfo` literals give it: `local` is on this
/// node; `ready` alone means ready and serving.
#[derive(Clone, Copy, Default)]
struct Ep {
    addr: &'static str,
    zones: &'static [&'static str],
    nodes: &'static [&'static str],
    ready: bool,
    serving: bool,
    terminating: bool,
    local: bool,
}

impl Ep {
    fn endpoint(&self) -> Endpoint {
        let addr: SocketAddr = self.addr.parse().unwrap();
        Endpoint {
            ip: addr.ip(),
            port: addr.port(),
            ready: self.ready,
            serving: self.serving || self.ready,
            terminating: self.terminating,
            node_name: Some(if self.local { NODE } else { "node-b" }.into()),
            hints: Hints::of(self.zones.iter().copied(), self.nodes.iter().copied()),
        }
    }
}

/// The Service port of upstream's `BaseServicePortInfo` fields.
#[derive(Clone, Copy, Default)]
struct Svc {
    internal_local: bool,
    external_local: bool,
    node_port: Option<u16>,
}

impl Svc {
    fn port(&self) -> ServicePort {
        ServicePort {
            name: ServicePortName {
                namespace: "ns".into(),
                name: "svc".into(),
                port: "p".into(),
            },
            protocol: Protocol::Tcp,
            cluster_ip: Some(IpAddr::from([10, 96, 0, 1])),
            port: 80,
            node_port: self.node_port,
            external_ips: vec![],
            load_balancer_ingress: vec![],
            load_balancer_source_ranges: vec![],
            session_affinity_timeout: None,
            external_traffic_policy_local: self.external_local,
            health_check_node_port: None,
            internal_traffic_policy_local: self.internal_local,
        }
    }
}

/// One case of upstream's `TestCategorizeEndpoints`: `None` for a set the Service
/// never uses; `all` only where it differs from the one set used; `only_remote` where
/// the Service has endpoints somewhere though none is reachable from this node.
struct Case {
    name: &'static str,
    zone: Option<&'static str>,
    svc: Svc,
    endpoints: &'static [Ep],
    cluster: Option<&'static [&'static str]>,
    local: Option<&'static [&'static str]>,
    all: Option<&'static [&'static str]>,
    only_remote: bool,
}

const fn ready(addr: &'static str) -> Ep {
    Ep {
        addr,
        zones: &[],
        nodes: &[],
        ready: true,
        serving: false,
        terminating: false,
        local: false,
    }
}

const fn zoned(addr: &'static str, zones: &'static [&'static str]) -> Ep {
    Ep {
        zones,
        ..ready(addr)
    }
}

const fn hinted(
    addr: &'static str,
    zones: &'static [&'static str],
    nodes: &'static [&'static str],
) -> Ep {
    Ep {
        zones,
        nodes,
        ..ready(addr)
    }
}

const fn local(ep: Ep) -> Ep {
    Ep { local: true, ..ep }
}

const fn unready(ep: Ep) -> Ep {
    Ep { ready: false, ..ep }
}

const fn serving_terminating(ep: Ep) -> Ep {
    Ep {
        ready: false,
        serving: true,
        terminating: true,
        ..ep
    }
}

const CLUSTER: Svc = Svc {
    internal_local: false,
    external_local: false,
    node_port: None,
};

const FOUR_ZONED: &[Ep] = &[
    zoned("10.1.2.3:80", &["zone-a"]),
    zoned("10.1.2.4:80", &["zone-b"]),
    zoned("10.1.2.5:80", &["zone-c"]),
    zoned("10.1.2.6:80", &["zone-a"]),
];

/// Upstream's cases (pkg/proxy/topology_test.go), then PreferSameNode's, then IPv6.
const CASES: &[Case] = &[
    Case {
        name: "should use topology since all endpoints have hints, node has a zone label and there are endpoints for the node's zone",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: FOUR_ZONED,
        cluster: Some(&["10.1.2.3:80", "10.1.2.6:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "externalTrafficPolicy: Local, topology ignored for Local endpoints",
        zone: Some("zone-a"),
        svc: Svc {
            external_local: true,
            node_port: Some(8080),
            ..CLUSTER
        },
        endpoints: &[
            local(zoned("10.1.2.3:80", &["zone-a"])),
            local(zoned("10.1.2.4:80", &["zone-b"])),
            zoned("10.1.2.5:80", &["zone-c"]),
            zoned("10.1.2.6:80", &["zone-a"]),
        ],
        cluster: Some(&["10.1.2.3:80", "10.1.2.6:80"]),
        local: Some(&["10.1.2.3:80", "10.1.2.4:80"]),
        all: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"]),
        only_remote: false,
    },
    Case {
        name: "internalTrafficPolicy: Local, topology ignored for Local endpoints",
        zone: Some("zone-a"),
        svc: Svc {
            internal_local: true,
            node_port: Some(8080),
            ..CLUSTER
        },
        endpoints: &[
            local(zoned("10.1.2.3:80", &["zone-a"])),
            local(zoned("10.1.2.4:80", &["zone-b"])),
            zoned("10.1.2.5:80", &["zone-c"]),
            zoned("10.1.2.6:80", &["zone-a"]),
        ],
        cluster: Some(&["10.1.2.3:80", "10.1.2.6:80"]),
        local: Some(&["10.1.2.3:80", "10.1.2.4:80"]),
        all: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"]),
        only_remote: false,
    },
    Case {
        name: "empty node labels",
        zone: None,
        svc: CLUSTER,
        endpoints: &[zoned("10.1.2.3:80", &["zone-a"])],
        cluster: Some(&["10.1.2.3:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "empty zone label",
        zone: Some(""),
        svc: CLUSTER,
        endpoints: &[zoned("10.1.2.3:80", &["zone-a"])],
        cluster: Some(&["10.1.2.3:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "node in different zone, no endpoint filtering",
        zone: Some("zone-b"),
        svc: CLUSTER,
        endpoints: &[zoned("10.1.2.3:80", &["zone-a"])],
        cluster: Some(&["10.1.2.3:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "unready endpoint",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: &[
            zoned("10.1.2.3:80", &["zone-a"]),
            zoned("10.1.2.4:80", &["zone-b"]),
            zoned("10.1.2.5:80", &["zone-c"]),
            unready(zoned("10.1.2.6:80", &["zone-a"])),
        ],
        cluster: Some(&["10.1.2.3:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "only unready endpoints in same zone (should not filter)",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: &[
            unready(zoned("10.1.2.3:80", &["zone-a"])),
            zoned("10.1.2.4:80", &["zone-b"]),
            zoned("10.1.2.5:80", &["zone-c"]),
            unready(zoned("10.1.2.6:80", &["zone-a"])),
        ],
        cluster: Some(&["10.1.2.4:80", "10.1.2.5:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "missing hints, no filtering applied",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: &[
            zoned("10.1.2.3:80", &["zone-a"]),
            zoned("10.1.2.4:80", &["zone-b"]),
            ready("10.1.2.5:80"),
            zoned("10.1.2.6:80", &["zone-a"]),
        ],
        cluster: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.5:80", "10.1.2.6:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "multiple hints per endpoint, filtering includes any endpoint with zone included",
        zone: Some("zone-c"),
        svc: CLUSTER,
        endpoints: &[
            zoned("10.1.2.3:80", &["zone-a", "zone-b", "zone-c"]),
            zoned("10.1.2.4:80", &["zone-b", "zone-c"]),
            zoned("10.1.2.5:80", &["zone-b", "zone-d"]),
            zoned("10.1.2.6:80", &["zone-c"]),
        ],
        cluster: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "conflicting topology and localness require merging allEndpoints",
        zone: Some("zone-a"),
        svc: Svc {
            external_local: true,
            node_port: Some(8080),
            ..CLUSTER
        },
        endpoints: &[
            local(zoned("10.0.0.0:80", &["zone-a"])),
            local(zoned("10.0.0.1:80", &["zone-b"])),
            zoned("10.0.0.2:80", &["zone-a"]),
            zoned("10.0.0.3:80", &["zone-b"]),
        ],
        cluster: Some(&["10.0.0.0:80", "10.0.0.2:80"]),
        local: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        all: Some(&["10.0.0.0:80", "10.0.0.1:80", "10.0.0.2:80"]),
        only_remote: false,
    },
    Case {
        name: "internalTrafficPolicy: Local, with empty endpoints",
        zone: None,
        svc: Svc {
            internal_local: true,
            ..CLUSTER
        },
        endpoints: &[],
        cluster: None,
        local: Some(&[]),
        all: None,
        only_remote: false,
    },
    Case {
        name: "internalTrafficPolicy: Local, but all endpoints are remote",
        zone: None,
        svc: Svc {
            internal_local: true,
            ..CLUSTER
        },
        endpoints: &[ready("10.0.0.0:80"), ready("10.0.0.1:80")],
        cluster: None,
        local: Some(&[]),
        all: None,
        only_remote: true,
    },
    Case {
        name: "internalTrafficPolicy: Local, all endpoints are local",
        zone: None,
        svc: Svc {
            internal_local: true,
            ..CLUSTER
        },
        endpoints: &[local(ready("10.0.0.0:80")), local(ready("10.0.0.1:80"))],
        cluster: None,
        local: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        all: None,
        only_remote: false,
    },
    Case {
        name: "internalTrafficPolicy: Local, some endpoints are local",
        zone: None,
        svc: Svc {
            internal_local: true,
            ..CLUSTER
        },
        endpoints: &[local(ready("10.0.0.0:80")), ready("10.0.0.1:80")],
        cluster: None,
        local: Some(&["10.0.0.0:80"]),
        all: None,
        only_remote: false,
    },
    Case {
        name: "Cluster traffic policy, endpoints not Ready",
        zone: None,
        svc: CLUSTER,
        endpoints: &[unready(ready("10.0.0.0:80")), unready(ready("10.0.0.1:80"))],
        cluster: Some(&[]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "Cluster traffic policy, some endpoints are Ready",
        zone: None,
        svc: CLUSTER,
        endpoints: &[unready(ready("10.0.0.0:80")), ready("10.0.0.1:80")],
        cluster: Some(&["10.0.0.1:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "Cluster traffic policy, all endpoints are terminating",
        zone: None,
        svc: CLUSTER,
        endpoints: &[
            local(serving_terminating(ready("10.0.0.0:80"))),
            serving_terminating(ready("10.0.0.1:80")),
        ],
        cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "iTP: Local, eTP: Cluster, some endpoints local",
        zone: None,
        svc: Svc {
            internal_local: true,
            node_port: Some(8080),
            ..CLUSTER
        },
        endpoints: &[local(ready("10.0.0.0:80")), ready("10.0.0.1:80")],
        cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        local: Some(&["10.0.0.0:80"]),
        all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        only_remote: false,
    },
    Case {
        name: "iTP: Cluster, eTP: Local, some endpoints local",
        zone: None,
        svc: Svc {
            external_local: true,
            node_port: Some(8080),
            ..CLUSTER
        },
        endpoints: &[local(ready("10.0.0.0:80")), ready("10.0.0.1:80")],
        cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        local: Some(&["10.0.0.0:80"]),
        all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        only_remote: false,
    },
    Case {
        name: "iTP: Local, eTP: Local, some endpoints local",
        zone: None,
        svc: Svc {
            internal_local: true,
            external_local: true,
            node_port: Some(8080),
        },
        endpoints: &[local(ready("10.0.0.0:80")), ready("10.0.0.1:80")],
        cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        local: Some(&["10.0.0.0:80"]),
        all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        only_remote: false,
    },
    Case {
        name: "iTP: Local, eTP: Local, all endpoints remote",
        zone: None,
        svc: Svc {
            internal_local: true,
            external_local: true,
            node_port: Some(8080),
        },
        endpoints: &[ready("10.0.0.0:80"), ready("10.0.0.1:80")],
        cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        local: Some(&[]),
        all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        only_remote: false,
    },
    Case {
        name: "iTP: Local, eTP: Local, all endpoints remote and terminating",
        zone: None,
        svc: Svc {
            internal_local: true,
            external_local: true,
            node_port: Some(8080),
        },
        endpoints: &[
            serving_terminating(ready("10.0.0.0:80")),
            serving_terminating(ready("10.0.0.1:80")),
        ],
        cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        local: Some(&[]),
        all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        only_remote: true,
    },
    Case {
        name: "iTP: Cluster, eTP: Local, with terminating endpoints",
        zone: None,
        svc: Svc {
            external_local: true,
            node_port: Some(8080),
            ..CLUSTER
        },
        endpoints: &[
            ready("10.0.0.0:80"),
            local(unready(ready("10.0.0.1:80"))),
            local(serving_terminating(ready("10.0.0.2:80"))),
            serving_terminating(ready("10.0.0.3:80")),
        ],
        cluster: Some(&["10.0.0.0:80"]),
        local: Some(&["10.0.0.2:80"]),
        all: Some(&["10.0.0.0:80", "10.0.0.2:80"]),
        only_remote: false,
    },
    Case {
        name: "externalTrafficPolicy ignored if not externally accessible",
        zone: None,
        svc: Svc {
            external_local: true,
            ..CLUSTER
        },
        endpoints: &[ready("10.0.0.0:80"), local(ready("10.0.0.1:80"))],
        cluster: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        local: None,
        all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
        only_remote: false,
    },
    Case {
        name: "no cluster endpoints for iTP:Local internal-only service",
        zone: None,
        svc: Svc {
            internal_local: true,
            ..CLUSTER
        },
        endpoints: &[ready("10.0.0.0:80"), local(ready("10.0.0.1:80"))],
        cluster: None,
        local: Some(&["10.0.0.1:80"]),
        all: Some(&["10.0.0.1:80"]),
        only_remote: false,
    },
    // PreferSameNode (1.34, hints.forNodes), from topologyModeFromHints.
    Case {
        name: "PreferSameNode: every endpoint has node hints, one for this node",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: &[
            local(hinted("10.1.2.3:80", &["zone-a"], &[NODE])),
            hinted("10.1.2.4:80", &["zone-a"], &["node-b"]),
            hinted("10.1.2.5:80", &["zone-b"], &["node-c"]),
        ],
        cluster: Some(&["10.1.2.3:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "PreferSameNode: a node hint for this node on a remote endpoint counts as well",
        zone: None,
        svc: CLUSTER,
        endpoints: &[
            hinted("10.1.2.3:80", &[], &[NODE, "node-b"]),
            hinted("10.1.2.4:80", &[], &["node-b"]),
        ],
        cluster: Some(&["10.1.2.3:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "PreferSameNode: no endpoint for this node falls back to the zone hints",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: &[
            hinted("10.1.2.4:80", &["zone-a"], &["node-b"]),
            hinted("10.1.2.5:80", &["zone-b"], &["node-c"]),
        ],
        cluster: Some(&["10.1.2.4:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "PreferSameNode: one endpoint without a node hint falls back to the zone hints",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: &[
            local(hinted("10.1.2.3:80", &["zone-a"], &[NODE])),
            hinted("10.1.2.4:80", &["zone-a"], &[]),
            hinted("10.1.2.5:80", &["zone-b"], &["node-c"]),
        ],
        cluster: Some(&["10.1.2.3:80", "10.1.2.4:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "PreferSameNode: an unready endpoint without hints does not count",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: &[
            local(hinted("10.1.2.3:80", &["zone-a"], &[NODE])),
            unready(ready("10.1.2.4:80")),
            hinted("10.1.2.5:80", &["zone-b"], &["node-c"]),
        ],
        cluster: Some(&["10.1.2.3:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "PreferSameNode: node hints for other nodes and no zone hints use every endpoint",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: &[
            hinted("10.1.2.4:80", &[], &["node-b"]),
            hinted("10.1.2.5:80", &[], &["node-c"]),
        ],
        cluster: Some(&["10.1.2.4:80", "10.1.2.5:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "PreferSameNode: eTP Local keeps every local endpoint, the cluster set only this node's",
        zone: Some("zone-a"),
        svc: Svc {
            external_local: true,
            node_port: Some(8080),
            ..CLUSTER
        },
        endpoints: &[
            local(hinted("10.1.2.3:80", &["zone-a"], &[NODE])),
            local(hinted("10.1.2.4:80", &["zone-a"], &["node-x"])),
            hinted("10.1.2.5:80", &["zone-b"], &["node-c"]),
        ],
        cluster: Some(&["10.1.2.3:80"]),
        local: Some(&["10.1.2.3:80", "10.1.2.4:80"]),
        all: Some(&["10.1.2.3:80", "10.1.2.4:80"]),
        only_remote: false,
    },
    Case {
        name: "hints on serving terminating endpoints are not used when none is ready",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: &[
            serving_terminating(zoned("10.1.2.3:80", &["zone-a"])),
            serving_terminating(zoned("10.1.2.4:80", &["zone-b"])),
        ],
        cluster: Some(&["10.1.2.3:80", "10.1.2.4:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    // IPv6: the same decisions, addresses of the other family.
    Case {
        name: "IPv6: zone hints narrow the set",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: &[
            zoned("[fd00:10:244::3]:80", &["zone-a"]),
            zoned("[fd00:10:244::4]:80", &["zone-b"]),
            zoned("[fd00:10:244::6]:80", &["zone-a"]),
        ],
        cluster: Some(&["[fd00:10:244::3]:80", "[fd00:10:244::6]:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "IPv6: one endpoint without hints, every endpoint",
        zone: Some("zone-a"),
        svc: CLUSTER,
        endpoints: &[
            zoned("[fd00:10:244::3]:80", &["zone-a"]),
            ready("[fd00:10:244::4]:80"),
        ],
        cluster: Some(&["[fd00:10:244::3]:80", "[fd00:10:244::4]:80"]),
        local: None,
        all: None,
        only_remote: false,
    },
    Case {
        name: "IPv6: PreferSameNode",
        zone: Some("zone-a"),
        svc: Svc {
            internal_local: true,
            node_port: Some(8080),
            ..CLUSTER
        },
        endpoints: &[
            local(hinted("[fd00:10:244::3]:80", &["zone-a"], &[NODE])),
            hinted("[fd00:10:244::4]:80", &["zone-a"], &["node-b"]),
        ],
        cluster: Some(&["[fd00:10:244::3]:80"]),
        local: Some(&["[fd00:10:244::3]:80"]),
        all: Some(&["[fd00:10:244::3]:80"]),
        only_remote: false,
    },
];

fn set(addrs: &[&str]) -> BTreeSet<SocketAddr> {
    addrs.iter().map(|a| a.parse().unwrap()).collect()
}

#[test]
fn categorize_endpoints_as_kube_proxy() {
    for case in CASES {
        let mut node = NodeConfig::new(NODE, None);
        node.zone = case.zone.map(str::to_owned);
        let svc = case.svc.port();
        let endpoints: Vec<Endpoint> = case.endpoints.iter().map(Ep::endpoint).collect();
        let paths = PortPaths::of(&svc);
        let choice = choose_endpoints(&endpoints, &node);
        let chosen = |pick: fn(&UsableEndpoint) -> bool| -> BTreeSet<SocketAddr> {
            choice
                .endpoints
                .iter()
                .filter(|ep| pick(ep))
                .map(|ep| ep.addr)
                .collect()
        };
        // A set the Service does not use is upstream's nil.
        let cluster = paths.uses_cluster.then(|| chosen(|ep| ep.cluster));
        let local = paths.uses_local.then(|| chosen(|ep| ep.local));
        assert_eq!(cluster, case.cluster.map(set), "{}: cluster", case.name);
        assert_eq!(local, case.local.map(set), "{}: local", case.name);
        let all: BTreeSet<SocketAddr> = choice
            .endpoints
            .iter()
            .filter(|ep| paths.spreads_over(ep))
            .map(|ep| ep.addr)
            .collect();
        let expected_all = match (case.cluster, case.local) {
            (Some(cluster), None) => set(cluster),
            (None, Some(local)) => set(local),
            _ => set(case.all.unwrap_or_default()),
        };
        assert_eq!(all, expected_all, "{}: all reachable", case.name);
        // hasAnyEndpoints: the layouts' "has endpoints" (reject otherwise).
        let has_any = choice.endpoints.iter().any(|ep| ep.cluster);
        assert_eq!(
            has_any,
            !expected_all.is_empty() || case.only_remote,
            "{}: has any endpoints",
            case.name
        );
    }
}

#[test]
fn the_choice_says_why() {
    let node = |zone: Option<&str>| NodeConfig {
        zone: zone.map(str::to_owned),
        ..NodeConfig::new(NODE, None)
    };
    let describe = |zone: Option<&str>, eps: &[Ep]| {
        let endpoints: Vec<Endpoint> = eps.iter().map(Ep::endpoint).collect();
        choose_endpoints(&endpoints, &node(zone)).to_string()
    };
    assert_eq!(
        describe(Some("us-east-1a"), FOUR_ZONED),
        "no endpoint hinted for zone us-east-1a: all endpoints, 4 of 4 endpoints"
    );
    assert_eq!(
        describe(Some("zone-a"), FOUR_ZONED),
        "topology: zone zone-a hints, 2 of 4 endpoints"
    );
    assert_eq!(
        describe(
            Some("zone-a"),
            &[zoned("10.1.2.3:80", &["zone-a"]), ready("10.1.2.4:80")]
        ),
        "hints incomplete: all endpoints, 2 of 2 endpoints"
    );
    assert_eq!(
        describe(None, FOUR_ZONED),
        "hints ignored, the node has no topology.kubernetes.io/zone label: all endpoints, 4 of 4 endpoints"
    );
    assert_eq!(
        describe(Some("zone-a"), &[ready("10.1.2.3:80")]),
        "no topology hints: all endpoints, 1 of 1 endpoints"
    );
    assert_eq!(
        describe(
            None,
            &[
                hinted("10.1.2.3:80", &[], &[NODE]),
                hinted("10.1.2.4:80", &[], &["node-b"])
            ]
        ),
        "topology: node node-a hints, 1 of 2 endpoints"
    );
    assert_eq!(
        describe(
            Some("zone-a"),
            &[serving_terminating(zoned("10.1.2.3:80", &["zone-a"]))]
        ),
        "no ready endpoint: serving terminating endpoints, hints unused, 1 of 1 endpoints"
    );
}

#[test]
fn the_trace_explains_the_ports_a_packet_is_addressed_to() {
    let mut node = NodeConfig::new(NODE, None);
    node.zone = Some("zone-a".into());
    let svc = Svc {
        external_local: true,
        node_port: Some(30080),
        ..CLUSTER
    }
    .port();
    let mut other = CLUSTER.port();
    other.name.name = "other".into();
    other.cluster_ip = Some(IpAddr::from([10, 96, 0, 2]));
    let mut endpoints: Vec<Endpoint> = FOUR_ZONED.iter().map(Ep::endpoint).collect();
    endpoints.push(local(zoned("10.1.2.7:80", &["zone-b"])).endpoint());
    let state = ProxyState::from_entries(
        IpFamily::V4,
        [svc.clone(), other],
        [(svc.name.clone(), endpoints)],
    );
    let to = |dst: [u8; 4], dst_port: u16| {
        let packet = Packet {
            src: IpAddr::from([192, 0, 2, 1]),
            dst: IpAddr::from(dst),
            protocol: Protocol::Tcp,
            dst_port,
        };
        explain(
            &state,
            &node,
            &TraceRequest::new(packet, Entry::FromOutside, [IpAddr::from([192, 0, 2, 10])]),
        )
    };
    let line = "ns/svc:p: topology: zone zone-a hints, 2 of 5 endpoints; traffic policy Local: 1 endpoints on this node, hints not used";
    assert_eq!(to([10, 96, 0, 1], 80), [line]);
    assert_eq!(to([192, 0, 2, 10], 30080), [line]);
    assert!(to([10, 96, 0, 1], 81).is_empty());
    assert!(to([192, 0, 2, 11], 30080).is_empty());
    assert_eq!(
        to([10, 96, 0, 2], 80),
        ["ns/other:p: no ready or serving terminating endpoint: rejected"]
    );
}

#[test]
fn hints_are_sets_and_none_when_empty() {
    assert_eq!(Hints::of(Vec::<String>::new(), Vec::<String>::new()), None);
    let hints = Hints::of(["b", "a", "b"], ["n"]).unwrap();
    assert_eq!(hints.zones, ["a", "b"]);
    assert!(hints.for_zone("a") && hints.for_zone("b") && !hints.for_zone(""));
    assert!(hints.for_node("n") && !hints.for_node("m"));
}
