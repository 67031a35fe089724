//! The host-tier eviction order: host-only leaves by least recent access.
//!
//! The tree does not track host-only leaves incrementally, so the cache keeps them here,
//! pushing a node whenever it becomes one through the cache's own actions (a device eviction
//! demotes a backed-up leaf, a host eviction exposes the parent). Entries are validated
//! lazily when popped: stale ones (loaded back, removed, locked, gained a child) are dropped,
//! and an entry whose node was accessed since it was pushed is re-queued under its new time.
//! When the order runs dry the cache rebuilds it with one scan of the tree, so a leaf the
//! order missed (e.g. one unlocked after it was dropped) is still found.

use std::collections::{BTreeSet, HashMap};

use radixkv_radix::{NodeId, RadixTree};

#[derive(Debug, Default)]
pub(crate) struct HostLeaves {
    order: BTreeSet<(u64, NodeId)>,
    keys: HashMap<NodeId, u64>,
}

impl HostLeaves {
    pub(crate) fn push(&mut self, id: NodeId, tick: u64) {
        if let Some(old) = self.keys.insert(id, tick) {
            self.order.remove(&(old, id));
        }
        self.order.insert((tick, id));
    }

    /// The least recently accessed valid host-only leaf, removed from the order.
    pub(crate) fn pop(&mut self, tree: &RadixTree) -> Option<NodeId> {
        while let Some((tick, id)) = self.order.pop_first() {
            self.keys.remove(&id);
            if !tree.is_host_leaf(id) {
                continue;
            }
            let now = tree.meta(id).map(|m| m.last_access).unwrap_or(tick);
            if now != tick {
                self.push(id, now);
                continue;
            }
            return Some(id);
        }
        None
    }

    pub(crate) fn rebuild(&mut self, tree: &RadixTree) {
        self.clear();
        for id in tree.host_leaves() {
            if let Ok(m) = tree.meta(id) {
                self.push(id, m.last_access);
            }
        }
    }

    pub(crate) fn clear(&mut self) {
        self.order.clear();
        self.keys.clear();
    }
}
