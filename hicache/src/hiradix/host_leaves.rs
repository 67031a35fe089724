//! The host-tier eviction order: host-only leaves, ordered by a second instance of the
//! device tier's eviction policy ([`PolicyKind::build`]) fed with the nodes' [`NodeMeta`].
//!
//! The tree does not track host-only leaves incrementally, so the cache keeps them here,
//! pushing a node whenever it becomes one through the cache's own actions (a device eviction
//! demotes a backed-up leaf, a host eviction exposes the parent). Entries are validated
//! lazily when popped: stale ones (loaded back, removed, locked, gained a child) are dropped,
//! and an entry whose metadata changed since it was pushed (accessed, reused) is re-queued
//! under its new metadata, so the policy always decides on current facts. When the order runs
//! dry the cache rebuilds it with one scan of the tree, so a leaf the order missed (e.g. one
//! unlocked after it was dropped) is still found.
//!
//! Entries are keyed by arena index, not by [`NodeId`]: a policy may index its own arrays by
//! node index, so two generations of one slot must never be held at once. They live in a
//! vector indexed by arena index (the arena is dense), not a hash map: a write-back eviction
//! pushes every leaf it demotes, and hashing was a tenth of its cost.

use radixkv_radix::{EvictionPolicy, LeafToken, NodeId, NodeMeta, PolicyKind, RadixTree};

#[derive(Debug)]
pub(crate) struct HostLeaves {
    kind: PolicyKind,
    policy: Box<dyn EvictionPolicy>,
    entries: Vec<Option<(NodeId, LeafToken, NodeMeta)>>,
}

impl HostLeaves {
    pub(crate) fn new(kind: PolicyKind) -> Self {
        HostLeaves {
            kind,
            policy: kind.build(),
            entries: Vec::new(),
        }
    }

    /// The policy family ordering the host tier.
    pub(crate) fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// Queues `id` (or re-queues it under `meta`).
    pub(crate) fn push(&mut self, id: NodeId, meta: NodeMeta) {
        let i = id.index();
        self.forget_index(i);
        let token = self.policy.insert(id, &meta);
        if i >= self.entries.len() {
            self.entries.resize(i + 1, None);
        }
        self.entries[i] = Some((id, token, meta));
    }

    /// Drops the entry of `id`'s slot, if any (the node is being removed by other means).
    pub(crate) fn forget(&mut self, id: NodeId) {
        self.forget_index(id.index());
    }

    fn forget_index(&mut self, index: usize) {
        if let Some((old, token, _)) = self.entries.get_mut(index).and_then(Option::take) {
            self.policy.remove(old, token);
        }
    }

    /// The next valid host-only leaf in policy order, removed from the order.
    pub(crate) fn pop(&mut self, tree: &RadixTree) -> Option<NodeId> {
        while let Some(id) = self.policy.pop() {
            let Some((held, _, meta)) = self.entries.get_mut(id.index()).and_then(Option::take)
            else {
                continue;
            };
            debug_assert_eq!(held, id, "policy and entries disagree");
            if !tree.is_host_leaf(id) {
                continue;
            }
            let now = tree.meta(id).unwrap_or(meta);
            if now != meta {
                // Re-queued once under its current metadata; the next pop sees it unchanged.
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
                self.push(id, m);
            }
        }
    }

    pub(crate) fn clear(&mut self) {
        self.policy.clear();
        self.entries.clear();
    }
}
