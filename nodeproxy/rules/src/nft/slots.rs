//! Where each Service port's runs of buckets live. Ports share endpoint maps
//! (`endpoints-tcp-0`, `endpoints-tcp-1`, …), each port in a range of its own, because a
//! map of its own per port makes every endpoint change slower as the cluster grows: the
//! kernel finds a set by walking all the table's sets and comparing names (a change at
//! 10,000 ports spent four fifths of its kernel time there), and declaring thousands of
//! sets costs the square of their number at the first sync. A shared map is not free
//! either: every element added to it is checked against every rule that uses it, and
//! since kernel 6.18 every commit that changes an interval map rebuilds the map's lookup
//! array by walking all its elements, on caches our own work has just cooled. So a map
//! holds at most [`PORTS_PER_ENDPOINT_MAP`] ports: few enough for that walk, many enough
//! for the maps to stay few.

use std::collections::{BTreeMap, BTreeSet};

use tandem_common::Protocol;
use tandem_nftables::BUCKETS;

use crate::model::{ProxyState, ServicePortName};

/// The ports whose buckets one endpoint map holds. Measured on kernel 6.18 (one endpoint
/// added; 64 → 16 → 8): 355–379 → 250–273 µs at 2,700 LoadBalancer Services, 369–388 →
/// 247–261 → 284–313 µs at 10,000 ClusterIP Services, where 8 loses more to the walk
/// through the table's sets than it gains; the first sync at 10,000 took 2.1–2.6 s with
/// 64, 1.4–1.6 s with 16.
pub const PORTS_PER_ENDPOINT_MAP: u32 = 16;

/// Which of a port's two spreads a range of buckets belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spread {
    /// Over the cluster-wide endpoints (the `service-…` chain).
    Cluster,
    /// Over this node's endpoints (the `local-…` chain).
    Local,
}

/// A Service port's place in the endpoint maps, held for the port's lifetime (its rules
/// name the map and the offset): map `endpoints-<protocol>-<index / 64>`, and within it
/// [`BUCKETS`] for each [`Spread`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BucketSlot {
    pub protocol: Protocol,
    pub index: u32,
}

impl BucketSlot {
    /// The endpoint map holding this slot.
    pub fn map(self) -> String {
        format!(
            "endpoints-{}-{}",
            self.protocol.as_str(),
            self.index / PORTS_PER_ENDPOINT_MAP
        )
    }

    /// The first bucket of `spread`: `numgen random mod BUCKETS offset <this>`.
    pub fn offset(self, spread: Spread) -> u32 {
        let spreads = 2 * (self.index % PORTS_PER_ENDPOINT_MAP);
        match spread {
            Spread::Cluster => spreads * BUCKETS,
            Spread::Local => (spreads + 1) * BUCKETS,
        }
    }
}

/// Which port holds which [`BucketSlot`]. A port keeps its slot as long as it exists
/// with the same protocol; a freed slot goes to the next new port, lowest first, so the
/// maps stay full and few.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BucketSlots {
    held: BTreeMap<ServicePortName, BucketSlot>,
    free: BTreeSet<BucketSlot>,
    /// Per protocol, the lowest index never given out.
    next: BTreeMap<Protocol, u32>,
}

impl BucketSlots {
    /// A slot for every port of `state`, given out in name order: what a fresh start has.
    pub fn in_name_order(state: &ProxyState) -> Self {
        let mut slots = Self::default();
        for (name, svc) in state.services() {
            slots.assign(name, svc.protocol);
        }
        slots
    }

    pub fn get(&self, name: &ServicePortName) -> Option<BucketSlot> {
        self.held.get(name).copied()
    }

    /// The slot of `name`: the one it holds, or (when it holds none, or one of another
    /// protocol) the lowest free one of `protocol`.
    pub fn assign(&mut self, name: &ServicePortName, protocol: Protocol) -> BucketSlot {
        match self.held.get(name) {
            Some(slot) if slot.protocol == protocol => return *slot,
            Some(_) => self.release(name),
            None => {}
        }
        let reused = self
            .free
            .range(BucketSlot { protocol, index: 0 }..)
            .next()
            .copied()
            .filter(|slot| slot.protocol == protocol);
        let slot = match reused {
            Some(slot) => {
                self.free.remove(&slot);
                slot
            }
            None => {
                let next = self.next.entry(protocol).or_default();
                let slot = BucketSlot {
                    protocol,
                    index: *next,
                };
                *next += 1;
                slot
            }
        };
        self.held.insert(name.clone(), slot);
        slot
    }

    /// Frees the slots of the ports `keep` says no to.
    pub fn retain(&mut self, keep: impl Fn(&ServicePortName) -> bool) {
        let gone: Vec<ServicePortName> = self
            .held
            .keys()
            .filter(|name| !keep(name))
            .cloned()
            .collect();
        for name in &gone {
            self.release(name);
        }
    }

    /// Frees the slot of a port that is gone.
    pub fn release(&mut self, name: &ServicePortName) {
        if let Some(slot) = self.held.remove(name) {
            self.free.insert(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(port: &str) -> ServicePortName {
        ServicePortName {
            namespace: "ns".into(),
            name: "svc".into(),
            port: port.into(),
        }
    }

    #[test]
    fn a_port_keeps_its_slot_and_a_freed_slot_goes_to_the_next_new_port() {
        let mut slots = BucketSlots::default();
        let a = slots.assign(&name("a"), Protocol::Tcp);
        let b = slots.assign(&name("b"), Protocol::Tcp);
        let dns = slots.assign(&name("dns"), Protocol::Udp);
        assert_eq!((a.index, b.index, dns.index), (0, 1, 0));
        assert_eq!(slots.assign(&name("b"), Protocol::Tcp), b);
        slots.release(&name("a"));
        assert_eq!(slots.assign(&name("c"), Protocol::Tcp), a);
        // A new protocol: a slot of that protocol, the old one freed.
        assert_eq!(slots.assign(&name("b"), Protocol::Udp).index, 1);
        assert_eq!(slots.assign(&name("d"), Protocol::Tcp), b);
    }

    #[test]
    fn spreads_never_overlap_and_fit_a_32_bit_bucket() {
        let last = BucketSlot {
            protocol: Protocol::Tcp,
            index: PORTS_PER_ENDPOINT_MAP - 1,
        };
        let first = BucketSlot {
            protocol: Protocol::Tcp,
            index: PORTS_PER_ENDPOINT_MAP,
        };
        assert_eq!(first.map(), "endpoints-tcp-1");
        assert_eq!(last.map(), "endpoints-tcp-0");
        assert_eq!(first.offset(Spread::Cluster), 0);
        assert_eq!(first.offset(Spread::Local), BUCKETS);
        let top = u64::from(last.offset(Spread::Local)) + u64::from(BUCKETS);
        assert!(top <= u64::from(u32::MAX) + 1);
    }
}
