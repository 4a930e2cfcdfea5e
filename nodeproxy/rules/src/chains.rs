//! Chain names, exactly as kube-proxy derives them, so that existing tooling and
//! people who know kube-proxy can read our rules.

use std::net::SocketAddr;

use data_encoding::BASE32;
use sha2::{Digest, Sha256};
use tandem_common::Protocol;

use crate::model::ServicePortName;

/// nat and filter: entry chain for Service portals.
pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
/// filter: REJECTs for external IPs, LB IPs and node ports of Services without endpoints.
pub const KUBE_EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
/// nat: node port captures; filter: health-check node port ACCEPTs.
pub const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
/// nat: masquerades marked traffic (shared with the kubelet, see
/// [`SHARED_CHAINS`](crate::ruleset::SHARED_CHAINS)).
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
/// nat: marks a packet for masquerading (shared with the kubelet).
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
/// nat: marks a packet for dropping by [`KUBE_PROXY_FIREWALL`] (shared with the kubelet).
pub const KUBE_MARK_DROP: &str = "KUBE-MARK-DROP";
/// filter: accepts forwarded Service traffic.
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
/// filter: drops packets marked by [`KUBE_MARK_DROP`]. kube-proxy >= 1.25's name for its
/// own filter chain: the kubelet's `KUBE-FIREWALL` (with its localnet guard) is not ours
/// to write, and kubelets >= 1.28 no longer drop the mark there.
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";

/// The masquerade mark as `value/mask`.
pub const MASQUERADE_MARK: &str = "0x4000/0x4000";
/// The drop mark as `value/mask`.
pub const DROP_MARK: &str = "0x8000/0x8000";

/// Prefixes of the per-Service and per-endpoint chains: every chain with one of these
/// prefixes belongs to the node proxy and is deleted when no longer wanted.
pub const PER_SERVICE_PREFIXES: &[&str] = &[
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-FW-",
    "KUBE-XLB-",
];

/// `KUBE-SVC-…`: spreads a Service port's traffic over its endpoints.
pub fn service_chain(name: &ServicePortName, protocol: Protocol) -> String {
    hashed_chain("KUBE-SVC-", &format!("{name}{}", protocol.as_str()))
}

/// `KUBE-SVL-…`: internalTrafficPolicy Local, spreads cluster-IP traffic over this node's
/// endpoints only (kube-proxy's name since v1.24; v1.21 had no such chain).
pub fn service_local_chain(name: &ServicePortName, protocol: Protocol) -> String {
    hashed_chain("KUBE-SVL-", &format!("{name}{}", protocol.as_str()))
}

/// `KUBE-FW-…`: the load-balancer IP firewall (loadBalancerSourceRanges) of a Service port.
pub fn firewall_chain(name: &ServicePortName, protocol: Protocol) -> String {
    hashed_chain("KUBE-FW-", &format!("{name}{}", protocol.as_str()))
}

/// `KUBE-XLB-…`: externalTrafficPolicy Local, spreads over this node's endpoints only.
pub fn external_local_chain(name: &ServicePortName, protocol: Protocol) -> String {
    hashed_chain("KUBE-XLB-", &format!("{name}{}", protocol.as_str()))
}

/// `KUBE-SEP-…`: DNATs to one endpoint of a Service port.
pub fn endpoint_chain(name: &ServicePortName, protocol: Protocol, endpoint: SocketAddr) -> String {
    hashed_chain(
        "KUBE-SEP-",
        &format!("{name}{}{endpoint}", protocol.as_str()),
    )
}

/// kube-proxy's scheme: prefix + the first 16 characters of base32(sha256(input)); chain
/// names must stay within iptables' 28-character limit.
fn hashed_chain(prefix: &str, input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    let encoded = BASE32.encode(&digest);
    format!("{prefix}{}", &encoded[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nginx_http() -> ServicePortName {
        ServicePortName {
            namespace: "default".into(),
            name: "nginx-service".into(),
            port: "http".into(),
        }
    }

    #[test]
    fn service_chains_match_the_reference_dump() {
        let name = nginx_http();
        assert_eq!(
            service_chain(&name, Protocol::Tcp),
            "KUBE-SVC-6IM33IEVEEV7U3GP"
        );
        assert_eq!(
            firewall_chain(&name, Protocol::Tcp),
            "KUBE-FW-6IM33IEVEEV7U3GP"
        );
        assert_eq!(
            external_local_chain(&name, Protocol::Tcp),
            "KUBE-XLB-6IM33IEVEEV7U3GP"
        );
        assert_eq!(
            service_local_chain(&name, Protocol::Tcp),
            "KUBE-SVL-6IM33IEVEEV7U3GP"
        );
    }

    #[test]
    fn endpoint_chains_match_the_reference_dump() {
        let name = nginx_http();
        let ep = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(
            endpoint_chain(&name, Protocol::Tcp, ep("10.244.1.5:80")),
            "KUBE-SEP-XZBMABGU65WCSBQV"
        );
        assert_eq!(
            endpoint_chain(&name, Protocol::Tcp, ep("10.244.2.7:80")),
            "KUBE-SEP-ZAFOM24KKU3TSBE6"
        );
    }

    #[test]
    fn well_known_kubernetes_service_chain() {
        // `default/kubernetes:https` over TCP is KUBE-SVC-NPX46M4PTMTKRN6Y on every cluster.
        let name = ServicePortName {
            namespace: "default".into(),
            name: "kubernetes".into(),
            port: "https".into(),
        };
        assert_eq!(
            service_chain(&name, Protocol::Tcp),
            "KUBE-SVC-NPX46M4PTMTKRN6Y"
        );
    }

    #[test]
    fn protocol_and_port_name_change_the_hash() {
        let name = nginx_http();
        let unnamed = ServicePortName {
            port: String::new(),
            ..nginx_http()
        };
        let tcp = service_chain(&name, Protocol::Tcp);
        assert_ne!(tcp, service_chain(&name, Protocol::Udp));
        assert_ne!(tcp, service_chain(&name, Protocol::Sctp));
        assert_ne!(tcp, service_chain(&unnamed, Protocol::Tcp));
        assert!(tcp.len() <= 28);
    }
}
