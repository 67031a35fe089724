//! Eviction policies over the set of evictable leaves.
//!
//! The tree keeps exactly the evictable leaves (on device, unlocked, no child on device) in one
//! policy structure and tells it when a leaf enters, leaves or is touched. Evicting `k` leaves
//! costs `O(k log n)` for the ordered policies and amortised `O(k)` for SIEVE; nothing ever
//! collects or heapifies all leaves.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;

use crate::types::NodeId;

/// What a policy may read about a node. Times are ticks of the tree's logical clock (one tick
/// per match or insert), never wall-clock time.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeMeta {
    /// Tick of the last match or insert that walked through the node.
    pub last_access: u64,
    /// Tick at which the node was created (a split node keeps its original time).
    pub created: u64,
    /// Number of inserts that found the node already present (reuse count).
    pub hit_count: u32,
    /// Highest request priority that ever inserted through the node (max-propagated).
    pub priority: i32,
}

/// The opaque position of a leaf inside a policy, returned by `insert`/`touch` and handed back
/// to `remove`/`touch`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct LeafToken(pub u64, pub u64);

/// An ordering of evictable leaves.
///
/// Implementations must hold each inserted leaf exactly once until it is removed or popped.
pub trait EvictionPolicy: Debug + Send {
    /// Short name (`"lru"`, ...).
    fn name(&self) -> &'static str;
    /// A node became an evictable leaf.
    fn insert(&mut self, node: NodeId, meta: &NodeMeta) -> LeafToken;
    /// A leaf stopped being evictable (locked, got a child, removed by the tree).
    fn remove(&mut self, node: NodeId, token: LeafToken);
    /// A leaf was accessed; returns its new token.
    fn touch(&mut self, node: NodeId, token: LeafToken, meta: &NodeMeta) -> LeafToken {
        self.remove(node, token);
        self.insert(node, meta)
    }
    /// Removes and returns the next victim.
    fn pop(&mut self) -> Option<NodeId>;
    /// The victim `pop` would return next, if the policy can tell cheaply (used to prefetch
    /// the next victim's node while the current one is evicted).
    fn peek(&self) -> Option<NodeId> {
        None
    }
    /// Number of leaves held.
    fn len(&self) -> usize;
    /// True when no leaf is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forgets every leaf.
    fn clear(&mut self);
}

/// The built-in policies, selectable by configuration.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum PolicyKind {
    /// Least recently used leaf first.
    #[default]
    Lru,
    /// Least frequently reused leaf first, ties by recency.
    Lfu,
    /// Oldest leaf first.
    Fifo,
    /// Most recently used leaf first.
    Mru,
    /// Newest leaf first.
    Filo,
    /// Lowest request priority first, ties by recency.
    Priority,
    /// Segmented LRU: leaves reused at least twice are protected behind every probationary leaf.
    Slru,
    /// SIEVE adapted to leaves: a FIFO with a visited bit and a moving hand; scan-resistant.
    Sieve,
}

impl PolicyKind {
    /// Every built-in policy.
    pub const ALL: [PolicyKind; 8] = [
        PolicyKind::Lru,
        PolicyKind::Lfu,
        PolicyKind::Fifo,
        PolicyKind::Mru,
        PolicyKind::Filo,
        PolicyKind::Priority,
        PolicyKind::Slru,
        PolicyKind::Sieve,
    ];

    /// The policy's short name.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Lfu => "lfu",
            PolicyKind::Fifo => "fifo",
            PolicyKind::Mru => "mru",
            PolicyKind::Filo => "filo",
            PolicyKind::Priority => "priority",
            PolicyKind::Slru => "slru",
            PolicyKind::Sieve => "sieve",
        }
    }

    /// Parses a short name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(name))
    }

    /// A fresh policy instance.
    pub fn build(self) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru => Box::new(RecencyList::new(false)),
            PolicyKind::Lfu => Box::new(OrderedPolicy::new("lfu", |m| {
                (m.hit_count as u64, m.last_access)
            })),
            PolicyKind::Fifo => Box::new(OrderedPolicy::new("fifo", |m| (m.created, 0))),
            PolicyKind::Mru => Box::new(RecencyList::new(true)),
            PolicyKind::Filo => Box::new(OrderedPolicy::new("filo", |m| (u64::MAX - m.created, 0))),
            PolicyKind::Priority => Box::new(OrderedPolicy::new("priority", |m| {
                ((m.priority as i64 - i32::MIN as i64) as u64, m.last_access)
            })),
            PolicyKind::Slru => Box::new(OrderedPolicy::new("slru", |m| {
                (u64::from(m.hit_count >= 2), m.last_access)
            })),
            PolicyKind::Sieve => Box::new(SievePolicy::default()),
        }
    }
}

/// A policy defined by a sort key over [`NodeMeta`]; smaller keys are evicted first, ties by
/// node index. Backed by a `BTreeSet`, so insert, remove and pop are `O(log n)`.
pub struct OrderedPolicy {
    name: &'static str,
    key: fn(&NodeMeta) -> (u64, u64),
    set: BTreeSet<(u64, u64, NodeId)>,
}

impl Debug for OrderedPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrderedPolicy")
            .field("name", &self.name)
            .field("len", &self.set.len())
            .finish()
    }
}

impl OrderedPolicy {
    /// A policy ordering leaves by `key`.
    pub fn new(name: &'static str, key: fn(&NodeMeta) -> (u64, u64)) -> Self {
        OrderedPolicy {
            name,
            key,
            set: BTreeSet::new(),
        }
    }
}

impl EvictionPolicy for OrderedPolicy {
    fn name(&self) -> &'static str {
        self.name
    }

    fn insert(&mut self, node: NodeId, meta: &NodeMeta) -> LeafToken {
        let (a, b) = (self.key)(meta);
        let fresh = self.set.insert((a, b, node));
        debug_assert!(fresh, "leaf {node:?} inserted twice");
        LeafToken(a, b)
    }

    fn remove(&mut self, node: NodeId, token: LeafToken) {
        let had = self.set.remove(&(token.0, token.1, node));
        debug_assert!(had, "leaf {node:?} removed but not held");
    }

    fn touch(&mut self, node: NodeId, token: LeafToken, meta: &NodeMeta) -> LeafToken {
        let (a, b) = (self.key)(meta);
        if (a, b) == (token.0, token.1) {
            return token;
        }
        self.set.remove(&(token.0, token.1, node));
        self.set.insert((a, b, node));
        LeafToken(a, b)
    }

    fn pop(&mut self) -> Option<NodeId> {
        self.set.pop_first().map(|(_, _, n)| n)
    }

    fn peek(&self) -> Option<NodeId> {
        self.set.first().map(|&(_, _, n)| n)
    }

    fn len(&self) -> usize {
        self.set.len()
    }

    fn clear(&mut self) {
        self.set.clear();
    }
}

const NO: u32 = u32::MAX;

/// LRU (or MRU) as an intrusive doubly linked list ordered by `last_access`, threaded through
/// arrays indexed by node index: insert, remove, touch and pop are `O(1)` and allocation-free
/// in the common cases.
///
/// A touched leaf moves to the tail (its access tick is the newest). A node that becomes a leaf
/// with an older access time (a parent whose last child was evicted, an unlocked path) is placed
/// at its exact position by a search that starts from both ends at once, so it costs
/// `O(min(distance from head, distance from tail))` — a handful of steps in practice, since
/// such nodes are either among the oldest or among the newest.
#[derive(Debug)]
pub struct RecencyList {
    most_recent_first: bool,
    prev: Vec<u32>,
    next: Vec<u32>,
    tick: Vec<u64>,
    generation: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl RecencyList {
    /// An empty list; `most_recent_first` makes it MRU.
    pub fn new(most_recent_first: bool) -> Self {
        RecencyList {
            most_recent_first,
            prev: Vec::new(),
            next: Vec::new(),
            tick: Vec::new(),
            generation: Vec::new(),
            head: NO,
            tail: NO,
            len: 0,
        }
    }

    fn ensure(&mut self, i: usize) {
        if i >= self.prev.len() {
            let n = (i + 1).max(self.prev.len() * 2).max(64);
            self.prev.resize(n, NO);
            self.next.resize(n, NO);
            self.tick.resize(n, 0);
            self.generation.resize(n, 0);
        }
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NO {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NO {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.len -= 1;
    }

    /// Links `i` after `p` (`NO`: at the head).
    fn link_after(&mut self, i: u32, p: u32) {
        let n = if p == NO {
            self.head
        } else {
            self.next[p as usize]
        };
        self.prev[i as usize] = p;
        self.next[i as usize] = n;
        if p == NO {
            self.head = i;
        } else {
            self.next[p as usize] = i;
        }
        if n == NO {
            self.tail = i;
        } else {
            self.prev[n as usize] = i;
        }
        self.len += 1;
    }

    /// Inserts `i` with access tick `t` at its sorted position (ascending ticks, ties after).
    fn insert_sorted(&mut self, i: u32, t: u64) {
        let (mut back, mut front) = (self.tail, self.head);
        loop {
            if back == NO || self.tick[back as usize] <= t {
                return self.link_after(i, back);
            }
            if self.tick[front as usize] > t {
                let p = self.prev[front as usize];
                return self.link_after(i, p);
            }
            back = self.prev[back as usize];
            front = self.next[front as usize];
        }
    }
}

impl EvictionPolicy for RecencyList {
    fn name(&self) -> &'static str {
        if self.most_recent_first { "mru" } else { "lru" }
    }

    fn insert(&mut self, node: NodeId, meta: &NodeMeta) -> LeafToken {
        self.ensure(node.index());
        self.tick[node.index()] = meta.last_access;
        self.generation[node.index()] = node.generation;
        self.insert_sorted(node.idx, meta.last_access);
        LeafToken(meta.last_access, 0)
    }

    fn remove(&mut self, node: NodeId, _token: LeafToken) {
        self.unlink(node.idx);
    }

    fn touch(&mut self, node: NodeId, token: LeafToken, meta: &NodeMeta) -> LeafToken {
        if token.0 == meta.last_access {
            return token;
        }
        self.unlink(node.idx);
        self.tick[node.index()] = meta.last_access;
        self.insert_sorted(node.idx, meta.last_access);
        LeafToken(meta.last_access, 0)
    }

    fn pop(&mut self) -> Option<NodeId> {
        let i = if self.most_recent_first {
            self.tail
        } else {
            self.head
        };
        if i == NO {
            return None;
        }
        self.unlink(i);
        Some(NodeId {
            idx: i,
            generation: self.generation[i as usize],
        })
    }

    fn peek(&self) -> Option<NodeId> {
        let i = if self.most_recent_first {
            self.tail
        } else {
            self.head
        };
        (i != NO).then(|| NodeId {
            idx: i,
            generation: self.generation[i as usize],
        })
    }

    fn len(&self) -> usize {
        self.len
    }

    fn clear(&mut self) {
        self.head = NO;
        self.tail = NO;
        self.len = 0;
    }
}

/// SIEVE (Zhang et al., NSDI'24) adapted to radix leaves.
///
/// Leaves sit in a FIFO by the sequence number at which they became evictable. A touch sets
/// the leaf's visited bit. The hand moves from the oldest leaf towards the newest: a visited
/// leaf has its bit cleared and is passed over (it stays where it is, unlike CLOCK's reinsertion),
/// an unvisited one is evicted. A leaf that was reused before it became a leaf (a parent whose
/// children were evicted, with reuse on record) starts visited. One-hit prefixes, the bulk of a
/// scan, are evicted on the first pass, which is what makes it scan-resistant.
#[derive(Debug, Default)]
pub struct SievePolicy {
    queue: BTreeMap<u64, (NodeId, bool)>,
    next_seq: u64,
    /// Sequence number the hand points at (the next candidate is the first key ≥ hand).
    hand: u64,
}

impl EvictionPolicy for SievePolicy {
    fn name(&self) -> &'static str {
        "sieve"
    }

    fn insert(&mut self, node: NodeId, meta: &NodeMeta) -> LeafToken {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queue.insert(seq, (node, meta.hit_count >= 1));
        LeafToken(seq, 0)
    }

    fn remove(&mut self, node: NodeId, token: LeafToken) {
        let had = self.queue.remove(&token.0);
        debug_assert!(
            matches!(had, Some((n, _)) if n == node),
            "sieve remove {node:?}"
        );
    }

    fn touch(&mut self, _node: NodeId, token: LeafToken, _meta: &NodeMeta) -> LeafToken {
        if let Some(e) = self.queue.get_mut(&token.0) {
            e.1 = true;
        }
        token
    }

    fn pop(&mut self) -> Option<NodeId> {
        if self.queue.is_empty() {
            return None;
        }
        // At most two sweeps: the first clears every visited bit it passes.
        loop {
            let mut cursor = self.queue.range_mut(self.hand..);
            let mut victim = None;
            for (&seq, entry) in &mut cursor {
                if entry.1 {
                    entry.1 = false;
                } else {
                    victim = Some(seq);
                    break;
                }
            }
            match victim {
                Some(seq) => {
                    let (node, _) = self.queue.remove(&seq).expect("victim present");
                    self.hand = seq + 1;
                    return Some(node);
                }
                None => self.hand = 0,
            }
        }
    }

    fn len(&self) -> usize {
        self.queue.len()
    }

    fn clear(&mut self) {
        self.queue.clear();
        self.hand = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nid(i: u32) -> NodeId {
        NodeId {
            idx: i,
            generation: 0,
        }
    }

    fn meta(last: u64, created: u64, hits: u32, prio: i32) -> NodeMeta {
        NodeMeta {
            last_access: last,
            created,
            hit_count: hits,
            priority: prio,
        }
    }

    fn order(kind: PolicyKind, metas: &[NodeMeta]) -> Vec<u32> {
        let mut p = kind.build();
        for (i, m) in metas.iter().enumerate() {
            p.insert(nid(i as u32), m);
        }
        std::iter::from_fn(|| p.pop().map(|n| n.idx)).collect()
    }

    #[test]
    fn ordered_policies_pop_in_their_order() {
        // (last_access, created, hits, priority)
        let m = [
            meta(5, 1, 0, 3),
            meta(2, 3, 4, 1),
            meta(9, 2, 1, 1),
            meta(7, 0, 2, -5),
        ];
        assert_eq!(order(PolicyKind::Lru, &m), vec![1, 0, 3, 2]);
        assert_eq!(order(PolicyKind::Mru, &m), vec![2, 3, 0, 1]);
        assert_eq!(order(PolicyKind::Fifo, &m), vec![3, 0, 2, 1]);
        assert_eq!(order(PolicyKind::Filo, &m), vec![1, 2, 0, 3]);
        assert_eq!(order(PolicyKind::Lfu, &m), vec![0, 2, 3, 1]);
        assert_eq!(order(PolicyKind::Priority, &m), vec![3, 1, 2, 0]);
        // SLRU: probationary (hits < 2) by recency, then protected by recency.
        assert_eq!(order(PolicyKind::Slru, &m), vec![0, 2, 1, 3]);
    }

    #[test]
    fn recency_list_places_old_leaves_exactly() {
        let mut p = PolicyKind::Lru.build();
        for (i, t) in [(0u32, 10u64), (1, 20), (2, 30), (3, 40)] {
            p.insert(nid(i), &meta(t, 0, 0, 0));
        }
        // A parent becoming a leaf with an old tick, and one with a middle tick.
        p.insert(nid(4), &meta(5, 0, 0, 0));
        p.insert(nid(5), &meta(25, 0, 0, 0));
        let order: Vec<u32> = std::iter::from_fn(|| p.pop().map(|n| n.idx)).collect();
        assert_eq!(order, vec![4, 0, 1, 5, 2, 3]);
        assert!(p.is_empty());
    }

    #[test]
    fn touch_reorders_lru() {
        let mut p = PolicyKind::Lru.build();
        let t0 = p.insert(nid(0), &meta(1, 1, 0, 0));
        p.insert(nid(1), &meta(2, 2, 0, 0));
        p.touch(nid(0), t0, &meta(3, 1, 0, 0));
        assert_eq!(p.pop(), Some(nid(1)));
        assert_eq!(p.pop(), Some(nid(0)));
        assert_eq!(p.pop(), None);
    }

    #[test]
    fn remove_takes_leaf_out() {
        for kind in PolicyKind::ALL {
            let mut p = kind.build();
            let t0 = p.insert(nid(0), &meta(1, 1, 0, 0));
            p.insert(nid(1), &meta(2, 2, 0, 0));
            p.remove(nid(0), t0);
            assert_eq!(p.len(), 1, "{kind:?}");
            assert_eq!(p.pop(), Some(nid(1)), "{kind:?}");
            assert!(p.is_empty());
        }
    }

    #[test]
    fn sieve_spares_visited_leaves_once() {
        let mut p = PolicyKind::Sieve.build();
        let toks: Vec<_> = (0..4)
            .map(|i| p.insert(nid(i), &meta(0, 0, 0, 0)))
            .collect();
        // Leaves 0 and 2 are hit again; a scan (1, 3) is not.
        p.touch(nid(0), toks[0], &meta(1, 0, 0, 0));
        p.touch(nid(2), toks[2], &meta(1, 0, 0, 0));
        assert_eq!(p.pop(), Some(nid(1)));
        assert_eq!(p.pop(), Some(nid(3)));
        // Bits were cleared by the first pass: now plain FIFO order.
        assert_eq!(p.pop(), Some(nid(0)));
        assert_eq!(p.pop(), Some(nid(2)));
        assert_eq!(p.pop(), None);
    }

    #[test]
    fn sieve_new_leaf_with_reuse_starts_visited() {
        let mut p = PolicyKind::Sieve.build();
        p.insert(nid(0), &meta(0, 0, 3, 0));
        p.insert(nid(1), &meta(0, 0, 0, 0));
        assert_eq!(p.pop(), Some(nid(1)));
    }

    #[test]
    fn names_round_trip() {
        for k in PolicyKind::ALL {
            assert_eq!(PolicyKind::from_name(k.name()), Some(k));
            assert_eq!(k.build().name(), k.name());
        }
        assert_eq!(PolicyKind::from_name("nope"), None);
    }
}
