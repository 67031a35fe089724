//! Eviction policies over the set of evictable leaves.
//!
//! The tree keeps exactly the evictable leaves (on device, unlocked, no child on device) in one
//! policy structure and tells it when a leaf enters, leaves or is touched. Evicting `k` leaves
//! costs `O(k log n)` for the ordered policies and amortised `O(k)` for SIEVE; nothing ever
//! collects or heapifies all leaves.
//!
//! Every built-in policy also keeps two [`LeafClass`]es: each class has the policy's own
//! order, and no leaf of the later class is popped while the first holds one. A hybrid tree
//! with Mamba-aware KV eviction ([`crate::MarconiParams::dead_end_kv_first`]) puts KV that
//! ends at a Mamba state in the later class, so dead-end KV goes first at the same cost per
//! eviction; a KV-only tree never leaves the first class.

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

/// Which of two eviction classes a leaf is in. Every leaf of class [`LeafClass::First`] is
/// popped before any leaf of class [`LeafClass::Later`]; inside a class the policy's own order
/// holds. A tree whose leaves are all of one class sees the policy's plain order.
///
/// The tree puts a leaf in `Later` only under Mamba-aware KV eviction
/// ([`crate::MarconiParams::dead_end_kv_first`]): a leaf whose node carries a Mamba state (on
/// device or host) is `Later`, a dead-end leaf (no state, so no match can use its tokens) is
/// `First`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum LeafClass {
    /// Evicted first (every leaf of a KV-only tree).
    #[default]
    First,
    /// Evicted only once no `First` leaf is left.
    Later,
}

impl LeafClass {
    /// `First` as 0, `Later` as 1.
    #[inline]
    pub fn index(self) -> usize {
        self as usize
    }
}

/// An ordering of evictable leaves.
///
/// Implementations must hold each inserted leaf exactly once until it is removed or popped.
/// The tree does not trust `pop`: an answer that is not one of its evictable leaves is a
/// [`crate::CacheError::PolicyFault`] (see [`crate::RadixTree::try_pop_victim`]), never a
/// panic or a corrupted tree.
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
    /// True when the policy keeps [`LeafClass`]es ([`EvictionPolicy::insert_in`],
    /// [`EvictionPolicy::set_class`], [`EvictionPolicy::class_len`]). Every built-in policy
    /// does; a tree refuses Mamba-aware KV eviction with a policy that does not (see
    /// [`crate::RadixTree::set_mamba_policy`]). Default: false.
    fn supports_classes(&self) -> bool {
        false
    }
    /// A node became an evictable leaf of class `class`. A policy with classes pops it only
    /// once no leaf of an earlier class is held. Default (a policy without classes, which the
    /// tree only ever asks for `First`): [`EvictionPolicy::insert`].
    fn insert_in(&mut self, node: NodeId, meta: &NodeMeta, class: LeafClass) -> LeafToken {
        let _ = class;
        self.insert(node, meta)
    }
    /// Moves a held leaf into `class` (nothing happens when it is there already), keeping
    /// what the policy records about it (its place in its order, SIEVE's visited bit); returns
    /// its new token. `O(1)` or `O(log n)` in the built-in policies. Default: nothing moves.
    fn set_class(&mut self, node: NodeId, token: LeafToken, class: LeafClass) -> LeafToken {
        let _ = (node, class);
        token
    }
    /// Leaves held in `class`. Default (no classes): every leaf is `First`.
    fn class_len(&self, class: LeafClass) -> usize {
        match class {
            LeafClass::First => self.len(),
            LeafClass::Later => 0,
        }
    }
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
    /// LRU in which each past reuse (up to five) buys a leaf one more residence time of the
    /// cache ([`ReuseCreditPolicy`]); the best of these on multi-turn chat traces.
    Reuse,
}

impl PolicyKind {
    /// Every built-in policy.
    pub const ALL: [PolicyKind; 9] = [
        PolicyKind::Lru,
        PolicyKind::Lfu,
        PolicyKind::Fifo,
        PolicyKind::Mru,
        PolicyKind::Filo,
        PolicyKind::Priority,
        PolicyKind::Slru,
        PolicyKind::Sieve,
        PolicyKind::Reuse,
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
            PolicyKind::Reuse => "reuse",
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
            PolicyKind::Reuse => Box::new(ReuseCreditPolicy::new()),
        }
    }
}

/// A policy defined by a sort key over [`NodeMeta`]; smaller keys are evicted first, ties by
/// node index. Backed by one `BTreeSet` per [`LeafClass`], so insert, remove, a class move and
/// pop are `O(log n)`.
pub struct OrderedPolicy {
    name: &'static str,
    key: fn(&NodeMeta) -> (u64, u64),
    /// The leaves of each class (`LeafClass::index`). A leaf's token is its key, which says
    /// where it is in its set; which set holds it is found by looking (the first set first,
    /// where every leaf of a tree without classes is).
    sets: [BTreeSet<(u64, u64, NodeId)>; 2],
}

impl Debug for OrderedPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrderedPolicy")
            .field("name", &self.name)
            .field("len", &self.len())
            .finish()
    }
}

impl OrderedPolicy {
    /// A policy ordering leaves by `key`.
    pub fn new(name: &'static str, key: fn(&NodeMeta) -> (u64, u64)) -> Self {
        OrderedPolicy {
            name,
            key,
            sets: [BTreeSet::new(), BTreeSet::new()],
        }
    }

    /// Removes the entry `e`; returns the class it was in (`None`: not held).
    #[inline]
    fn take(&mut self, e: &(u64, u64, NodeId)) -> Option<usize> {
        if self.sets[0].remove(e) {
            Some(0)
        } else if self.sets[1].remove(e) {
            Some(1)
        } else {
            None
        }
    }
}

impl EvictionPolicy for OrderedPolicy {
    fn name(&self) -> &'static str {
        self.name
    }

    fn insert(&mut self, node: NodeId, meta: &NodeMeta) -> LeafToken {
        self.insert_in(node, meta, LeafClass::First)
    }

    fn remove(&mut self, node: NodeId, token: LeafToken) {
        let had = self.take(&(token.0, token.1, node));
        debug_assert!(had.is_some(), "leaf {node:?} removed but not held");
    }

    fn touch(&mut self, node: NodeId, token: LeafToken, meta: &NodeMeta) -> LeafToken {
        let (a, b) = (self.key)(meta);
        if (a, b) == (token.0, token.1) {
            return token;
        }
        let class = self.take(&(token.0, token.1, node)).unwrap_or(0);
        self.sets[class].insert((a, b, node));
        LeafToken(a, b)
    }

    fn pop(&mut self) -> Option<NodeId> {
        self.sets[0]
            .pop_first()
            .or_else(|| self.sets[1].pop_first())
            .map(|(_, _, n)| n)
    }

    fn peek(&self) -> Option<NodeId> {
        self.sets[0]
            .first()
            .or_else(|| self.sets[1].first())
            .map(|&(_, _, n)| n)
    }

    fn len(&self) -> usize {
        self.sets[0].len() + self.sets[1].len()
    }

    fn clear(&mut self) {
        self.sets[0].clear();
        self.sets[1].clear();
    }

    fn supports_classes(&self) -> bool {
        true
    }

    fn insert_in(&mut self, node: NodeId, meta: &NodeMeta, class: LeafClass) -> LeafToken {
        let (a, b) = (self.key)(meta);
        let fresh = self.sets[class.index()].insert((a, b, node));
        debug_assert!(fresh, "leaf {node:?} inserted twice");
        LeafToken(a, b)
    }

    fn set_class(&mut self, node: NodeId, token: LeafToken, class: LeafClass) -> LeafToken {
        let e = (token.0, token.1, node);
        let (to, from) = (class.index(), 1 - class.index());
        if self.sets[from].remove(&e) {
            self.sets[to].insert(e);
        }
        token
    }

    fn class_len(&self, class: LeafClass) -> usize {
        self.sets[class.index()].len()
    }
}

const NO: u32 = u32::MAX;

/// Doubly linked lists ordered by access tick, threaded through arrays indexed by node index.
/// A node is in at most one list at a time (its `class`); every list keeps ascending ticks.
///
/// A node that enters with an older tick than the newest (a parent whose last child was
/// evicted, an unlocked path, a leaf demoted to the host tier) is placed at its exact position
/// by a search from the list's finger, the node the last such insert placed: nodes demoted in
/// eviction order enter with ascending old ticks, each right after the one before. A finger
/// more than [`TickLists::FINGER_STEPS`] from the position gives way to a search from both
/// ends of the list at once, `O(min(distance from head, distance from tail))`.
#[derive(Debug)]
struct TickLists {
    prev: Vec<u32>,
    next: Vec<u32>,
    tick: Vec<u64>,
    generation: Vec<u32>,
    class: Vec<u8>,
    head: Vec<u32>,
    /// `tick` of each head, kept beside `head` so that comparing heads touches no node.
    head_tick: Vec<u64>,
    tail: Vec<u32>,
    /// Nodes in each list.
    count: Vec<usize>,
    /// Per list: the node the last insert at an old tick placed (`NO`: none), a node of that
    /// list; when it leaves the list, the node before it takes its place.
    finger: Vec<u32>,
    len: usize,
}

impl TickLists {
    fn new(lists: usize) -> Self {
        TickLists {
            prev: Vec::new(),
            next: Vec::new(),
            tick: Vec::new(),
            generation: Vec::new(),
            class: Vec::new(),
            head: vec![NO; lists],
            head_tick: vec![u64::MAX; lists],
            tail: vec![NO; lists],
            count: vec![0; lists],
            finger: vec![NO; lists],
            len: 0,
        }
    }

    /// Steps a search from the finger takes before it gives way to the search from both ends.
    const FINGER_STEPS: usize = 16;

    fn ensure(&mut self, i: usize) {
        if i >= self.prev.len() {
            let n = (i + 1).max(self.prev.len() * 2).max(64);
            self.prev.resize(n, NO);
            self.next.resize(n, NO);
            self.tick.resize(n, 0);
            self.generation.resize(n, 0);
            self.class.resize(n, 0);
        }
    }

    fn id(&self, i: u32) -> NodeId {
        NodeId {
            idx: i,
            generation: self.generation[i as usize],
        }
    }

    /// Adds `node` to list `class` at the position of tick `t`.
    fn insert(&mut self, node: NodeId, t: u64, class: usize) {
        let i = node.index();
        self.ensure(i);
        self.tick[i] = t;
        self.generation[i] = node.generation;
        self.class[i] = class as u8;
        self.insert_sorted(node.idx, t, class);
    }

    fn unlink(&mut self, i: u32) {
        let c = self.class[i as usize] as usize;
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if self.finger[c] == i {
            self.finger[c] = p;
        }
        if p == NO {
            self.head[c] = n;
            self.head_tick[c] = if n == NO {
                u64::MAX
            } else {
                self.tick[n as usize]
            };
        } else {
            self.next[p as usize] = n;
        }
        if n == NO {
            self.tail[c] = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.count[c] -= 1;
        self.len -= 1;
    }

    /// Links `i` after `p` (`NO`: at the head) in list `c`.
    fn link_after(&mut self, i: u32, p: u32, c: usize) {
        let n = if p == NO {
            self.head[c]
        } else {
            self.next[p as usize]
        };
        self.prev[i as usize] = p;
        self.next[i as usize] = n;
        if p == NO {
            self.head[c] = i;
            self.head_tick[c] = self.tick[i as usize];
        } else {
            self.next[p as usize] = i;
        }
        if n == NO {
            self.tail[c] = i;
        } else {
            self.prev[n as usize] = i;
        }
        self.count[c] += 1;
        self.len += 1;
    }

    /// Inserts `i` with access tick `t` at its sorted position in list `c` (ties after).
    fn insert_sorted(&mut self, i: u32, t: u64, c: usize) {
        let tail = self.tail[c];
        // The common case: the newest tick goes last.
        if tail == NO || self.tick[tail as usize] <= t {
            return self.link_after(i, tail, c);
        }
        let p = self
            .place_by_finger(t, c)
            .unwrap_or_else(|| self.place_from_ends(t, c));
        self.finger[c] = i;
        self.link_after(i, p, c);
    }

    /// The node after which tick `t` goes in list `c` (`NO`: at the head), searched from both
    /// ends at once; `t` is older than the tail's tick.
    fn place_from_ends(&self, t: u64, c: usize) -> u32 {
        let (mut back, mut front) = (self.tail[c], self.head[c]);
        loop {
            // The caller checked the tail; this checks the front, then steps in from both.
            if self.tick[front as usize] > t {
                return self.prev[front as usize];
            }
            back = self.prev[back as usize];
            if back == NO || self.tick[back as usize] <= t {
                return back;
            }
            front = self.next[front as usize];
        }
    }

    /// The node after which tick `t` goes in list `c` (`Some(NO)`: at the head), found from
    /// the list's finger within [`TickLists::FINGER_STEPS`] steps; `None` without a finger or
    /// past them.
    fn place_by_finger(&self, t: u64, c: usize) -> Option<u32> {
        let mut at = self.finger[c];
        if at == NO {
            return None;
        }
        if self.tick[at as usize] <= t {
            // Forward to the last node whose tick is at most `t` (ties after).
            for _ in 0..Self::FINGER_STEPS {
                let n = self.next[at as usize];
                if n == NO || self.tick[n as usize] > t {
                    return Some(at);
                }
                at = n;
            }
        } else {
            // Back to the first node whose tick is at most `t`, or the head.
            for _ in 0..Self::FINGER_STEPS {
                let p = self.prev[at as usize];
                if p == NO || self.tick[p as usize] <= t {
                    return Some(p);
                }
                at = p;
            }
        }
        None
    }

    /// Moves node `i` (held) into list `c`, at the place of its tick there.
    fn move_to(&mut self, i: u32, c: usize) {
        if self.class[i as usize] as usize == c {
            return;
        }
        self.unlink(i);
        self.class[i as usize] = c as u8;
        self.insert_sorted(i, self.tick[i as usize], c);
    }

    fn clear(&mut self) {
        self.head.fill(NO);
        self.head_tick.fill(u64::MAX);
        self.tail.fill(NO);
        self.finger.fill(NO);
        self.count.fill(0);
        self.len = 0;
    }
}

/// LRU (or MRU) as an intrusive list ordered by `last_access` (one per [`LeafClass`]): insert,
/// remove, touch and pop are `O(1)` and allocation-free in the common cases. A leaf that enters
/// with an old tick (a parent whose last child was evicted), or moves to the other class, is
/// placed exactly by a search from both ends of its list at once.
#[derive(Debug)]
pub struct RecencyList {
    most_recent_first: bool,
    lists: TickLists,
}

impl RecencyList {
    /// An empty list; `most_recent_first` makes it MRU.
    pub fn new(most_recent_first: bool) -> Self {
        RecencyList {
            most_recent_first,
            lists: TickLists::new(2),
        }
    }

    /// The next victim: the end of the first class's list, or of the later one's when the
    /// first is empty.
    #[inline]
    fn end(&self) -> u32 {
        let ends = if self.most_recent_first {
            &self.lists.tail
        } else {
            &self.lists.head
        };
        if ends[0] != NO { ends[0] } else { ends[1] }
    }
}

impl EvictionPolicy for RecencyList {
    fn name(&self) -> &'static str {
        if self.most_recent_first { "mru" } else { "lru" }
    }

    fn insert(&mut self, node: NodeId, meta: &NodeMeta) -> LeafToken {
        self.lists.insert(node, meta.last_access, 0);
        LeafToken(meta.last_access, 0)
    }

    fn remove(&mut self, node: NodeId, _token: LeafToken) {
        self.lists.unlink(node.idx);
    }

    fn touch(&mut self, node: NodeId, token: LeafToken, meta: &NodeMeta) -> LeafToken {
        if token.0 == meta.last_access {
            return token;
        }
        // The token's second half is the leaf's class.
        self.lists.unlink(node.idx);
        self.lists.insert(node, meta.last_access, token.1 as usize);
        LeafToken(meta.last_access, token.1)
    }

    fn pop(&mut self) -> Option<NodeId> {
        let i = self.end();
        if i == NO {
            return None;
        }
        self.lists.unlink(i);
        Some(self.lists.id(i))
    }

    fn peek(&self) -> Option<NodeId> {
        let i = self.end();
        (i != NO).then(|| self.lists.id(i))
    }

    fn len(&self) -> usize {
        self.lists.len
    }

    fn clear(&mut self) {
        self.lists.clear();
    }

    fn supports_classes(&self) -> bool {
        true
    }

    fn insert_in(&mut self, node: NodeId, meta: &NodeMeta, class: LeafClass) -> LeafToken {
        self.lists.insert(node, meta.last_access, class.index());
        LeafToken(meta.last_access, class.index() as u64)
    }

    fn set_class(&mut self, node: NodeId, token: LeafToken, class: LeafClass) -> LeafToken {
        self.lists.move_to(node.idx, class.index());
        LeafToken(token.0, class.index() as u64)
    }

    fn class_len(&self, class: LeafClass) -> usize {
        self.lists.count[class.index()]
    }
}

/// Reuse-credit LRU: recency order in which every past reuse of a leaf buys it extra time in
/// the cache, measured in units of the cache's own current residence time.
///
/// A leaf's eviction score is `last_access + ALPHA × R × min(hit_count, MAX_CREDITS)`, where
/// `R` is a running average of the "effective age" (`now − score`) of recent victims — about
/// how long an unreused leaf survives in this cache. The credit therefore scales with the
/// cache's size and load by itself: a leaf reused three times outlives an unreused one of the
/// same age by about three residence times, whether the tier holds 1M or 100M tokens. Credits
/// are capped so that a once-hot prefix still ages out (unbounded frequency, as in LFU or
/// SLRU's protected segment, fills a big tier with stale history).
///
/// Leaves sit in one tick-ordered list per credit count (per [`LeafClass`]), so insert,
/// remove, touch and a class move are `O(1)` and a pop compares `MAX_CREDITS + 1` list heads.
/// Until the first eviction `R` is 0 and the order is plain LRU.
///
/// Why: on chat traffic most new prefixes are never reused (the conversation ends), while a
/// prefix that was reused belongs to a conversation that already continued, and those continue
/// again more often; the shared prefixes (system prompts, documents) are reused many times.
#[derive(Debug)]
pub struct ReuseCreditPolicy {
    lists: TickLists,
    now: u64,
    residence: f64,
}

impl ReuseCreditPolicy {
    /// Reuses beyond this many earn no more credit.
    pub const MAX_CREDITS: u32 = 5;
    /// Credit per reuse, in residence times.
    pub const ALPHA: f64 = 1.0;
    /// Weight of one victim in the running residence average.
    const RESIDENCE_WEIGHT: f64 = 1.0 / 256.0;
    /// Lists per class (one per credit count); class `k`'s lists are `k * LISTS ..`.
    const LISTS: usize = Self::MAX_CREDITS as usize + 1;

    /// An empty policy.
    pub fn new() -> Self {
        ReuseCreditPolicy {
            lists: TickLists::new(2 * Self::LISTS),
            now: 0,
            residence: 0.0,
        }
    }

    /// The current residence estimate `R`, in ticks.
    pub fn residence(&self) -> f64 {
        self.residence
    }

    fn class(meta: &NodeMeta) -> usize {
        meta.hit_count.min(Self::MAX_CREDITS) as usize
    }

    /// Inserts into the list of `meta`'s credits among those starting at `base` (its class).
    #[inline]
    fn insert_at(&mut self, node: NodeId, meta: &NodeMeta, base: usize) -> LeafToken {
        self.now = self.now.max(meta.last_access);
        let c = base + Self::class(meta);
        self.lists.insert(node, meta.last_access, c);
        LeafToken(meta.last_access, c as u64)
    }

    /// The head with the smallest score, ties to the fewest credits; from the first class
    /// while it holds a leaf.
    fn victim(&self) -> Option<(u32, f64)> {
        self.victim_in(0).or_else(|| self.victim_in(Self::LISTS))
    }

    /// [`ReuseCreditPolicy::victim`] among the lists of one class (`base`: its first list).
    #[inline]
    fn victim_in(&self, base: usize) -> Option<(u32, f64)> {
        let credit = Self::ALPHA * self.residence;
        let mut best: Option<(u32, f64)> = None;
        let lists = base..base + Self::LISTS;
        for (c, (&h, &t)) in self.lists.head[lists.clone()]
            .iter()
            .zip(&self.lists.head_tick[lists])
            .enumerate()
        {
            if h == NO {
                continue;
            }
            let score = t as f64 + credit * c as f64;
            if best.is_none_or(|(_, s)| score < s) {
                best = Some((h, score));
            }
        }
        best
    }
}

impl Default for ReuseCreditPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl EvictionPolicy for ReuseCreditPolicy {
    fn name(&self) -> &'static str {
        "reuse"
    }

    fn insert(&mut self, node: NodeId, meta: &NodeMeta) -> LeafToken {
        self.insert_at(node, meta, 0)
    }

    fn remove(&mut self, node: NodeId, _token: LeafToken) {
        self.lists.unlink(node.idx);
    }

    fn touch(&mut self, node: NodeId, token: LeafToken, meta: &NodeMeta) -> LeafToken {
        // The token's second half is the leaf's list: its class's base plus its credits.
        let base = token.1 as usize / Self::LISTS * Self::LISTS;
        if token == LeafToken(meta.last_access, (base + Self::class(meta)) as u64) {
            return token;
        }
        self.lists.unlink(node.idx);
        self.insert_at(node, meta, base)
    }

    fn pop(&mut self) -> Option<NodeId> {
        let (i, score) = self.victim()?;
        self.lists.unlink(i);
        let age = (self.now as f64 - score).max(0.0);
        self.residence += Self::RESIDENCE_WEIGHT * (age - self.residence);
        Some(self.lists.id(i))
    }

    fn peek(&self) -> Option<NodeId> {
        self.victim().map(|(i, _)| self.lists.id(i))
    }

    fn len(&self) -> usize {
        self.lists.len
    }

    fn clear(&mut self) {
        self.lists.clear();
    }

    fn supports_classes(&self) -> bool {
        true
    }

    fn insert_in(&mut self, node: NodeId, meta: &NodeMeta, class: LeafClass) -> LeafToken {
        self.insert_at(node, meta, class.index() * Self::LISTS)
    }

    fn set_class(&mut self, node: NodeId, token: LeafToken, class: LeafClass) -> LeafToken {
        let list = class.index() * Self::LISTS + token.1 as usize % Self::LISTS;
        self.lists.move_to(node.idx, list);
        LeafToken(token.0, list as u64)
    }

    fn class_len(&self, class: LeafClass) -> usize {
        let base = class.index() * Self::LISTS;
        self.lists.count[base..base + Self::LISTS].iter().sum()
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
///
/// Each [`LeafClass`] is its own FIFO with its own hand; a leaf that moves to the other class
/// keeps its sequence number and its visited bit.
#[derive(Debug, Default)]
pub struct SievePolicy {
    /// Per class: sequence number → (leaf, visited). A token is (sequence number, class).
    queues: [BTreeMap<u64, (NodeId, bool)>; 2],
    next_seq: u64,
    /// Per class, the sequence number the hand points at (the next candidate is the first
    /// key ≥ hand).
    hands: [u64; 2],
}

impl SievePolicy {
    fn insert_at(&mut self, node: NodeId, meta: &NodeMeta, class: usize) -> LeafToken {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queues[class].insert(seq, (node, meta.hit_count >= 1));
        LeafToken(seq, class as u64)
    }
}

impl EvictionPolicy for SievePolicy {
    fn name(&self) -> &'static str {
        "sieve"
    }

    fn insert(&mut self, node: NodeId, meta: &NodeMeta) -> LeafToken {
        self.insert_at(node, meta, 0)
    }

    fn remove(&mut self, node: NodeId, token: LeafToken) {
        let had = self.queues[token.1 as usize & 1].remove(&token.0);
        debug_assert!(
            matches!(had, Some((n, _)) if n == node),
            "sieve remove {node:?}"
        );
    }

    fn touch(&mut self, _node: NodeId, token: LeafToken, _meta: &NodeMeta) -> LeafToken {
        if let Some(e) = self.queues[token.1 as usize & 1].get_mut(&token.0) {
            e.1 = true;
        }
        token
    }

    fn pop(&mut self) -> Option<NodeId> {
        let c = usize::from(self.queues[0].is_empty());
        let (queue, hand) = (&mut self.queues[c], &mut self.hands[c]);
        if queue.is_empty() {
            return None;
        }
        // At most two sweeps: the first clears every visited bit it passes.
        loop {
            let mut cursor = queue.range_mut(*hand..);
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
                    let (node, _) = queue.remove(&seq)?;
                    *hand = seq + 1;
                    return Some(node);
                }
                None => *hand = 0,
            }
        }
    }

    fn len(&self) -> usize {
        self.queues[0].len() + self.queues[1].len()
    }

    fn clear(&mut self) {
        self.queues[0].clear();
        self.queues[1].clear();
        self.hands = [0; 2];
    }

    fn supports_classes(&self) -> bool {
        true
    }

    fn insert_in(&mut self, node: NodeId, meta: &NodeMeta, class: LeafClass) -> LeafToken {
        self.insert_at(node, meta, class.index())
    }

    fn set_class(&mut self, node: NodeId, token: LeafToken, class: LeafClass) -> LeafToken {
        let (from, to) = (token.1 as usize & 1, class.index());
        if from == to {
            return token;
        }
        // Same sequence number, same visited bit: only the queue changes.
        if let Some(e) = self.queues[from].remove(&token.0) {
            debug_assert_eq!(e.0, node, "sieve set_class {node:?}");
            self.queues[to].insert(token.0, e);
        }
        LeafToken(token.0, to as u64)
    }

    fn class_len(&self, class: LeafClass) -> usize {
        self.queues[class.index()].len()
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
    fn recency_list_places_old_leaves_exactly_wherever_its_finger_is() {
        // Old-tick inserts near the last one (the finger's case), far from it (past the
        // finger's steps), removals of the finger itself and touches, against a model sorted
        // by (tick, arrival): ties go after.
        let mut p = PolicyKind::Lru.build();
        let mut model: Vec<(u64, u64, u32)> = Vec::new();
        let (mut seq, mut now, mut x) = (0u64, 1000u64, 0x2545_f491_4f6c_dd1du64);
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut tokens = std::collections::HashMap::new();
        for step in 0..4000u32 {
            let id = step % 300;
            if let Some(pos) = model.iter().position(|e| e.2 == id) {
                model.remove(pos);
                p.remove(nid(id), tokens.remove(&id).unwrap());
                continue;
            }
            let t = match rnd(4) {
                // The newest, an old tick near the last old one, or anywhere.
                0 => {
                    now += 1;
                    now
                }
                1 => 500 + u64::from(step) / 64,
                _ => rnd(now),
            };
            tokens.insert(id, p.insert(nid(id), &meta(t, 0, 0, 0)));
            model.push((t, seq, id));
            seq += 1;
            if rnd(8) == 0
                && let Some(&(_, _, tid)) = model.get(rnd(model.len() as u64) as usize)
            {
                now += 1;
                let tok = tokens[&tid];
                tokens.insert(tid, p.touch(nid(tid), tok, &meta(now, 0, 0, 0)));
                let e = model.iter_mut().find(|e| e.2 == tid).unwrap();
                *e = (now, seq, tid);
                seq += 1;
            }
        }
        model.sort_unstable();
        let order: Vec<u32> = std::iter::from_fn(|| p.pop().map(|n| n.idx)).collect();
        assert_eq!(order, model.iter().map(|e| e.2).collect::<Vec<_>>());
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
    fn reuse_credit_is_lru_until_it_has_evicted() {
        let m = [meta(5, 1, 3, 0), meta(2, 3, 0, 0), meta(9, 2, 1, 0)];
        assert_eq!(order(PolicyKind::Reuse, &m), vec![1, 0, 2]);
    }

    #[test]
    fn reuse_credit_keeps_reused_leaves_longer_than_residence() {
        let mut p = ReuseCreditPolicy::new();
        // Unreused leaves, one per tick, evicted as they age: residence settles near 100 ticks.
        let mut next = 0u32;
        for t in 0..2_000u64 {
            p.insert(nid(next), &meta(t, t, 0, 0));
            next += 1;
            if t >= 100 {
                p.pop();
            }
        }
        let r = p.residence();
        assert!((80.0..=120.0).contains(&r), "residence {r}");
        // A leaf reused twice, last accessed 150 ticks ago, scores 1850 + 2R ≈ 2050: later
        // than every unreused leaf held (ticks ≤ 1999), so it goes last.
        let reused = nid(next);
        p.insert(reused, &meta(1_850, 0, 2, 0));
        let before = p.len();
        let mut popped = Vec::new();
        for _ in 0..before - 1 {
            popped.push(p.pop().unwrap());
            assert_eq!(p.peek().is_some(), p.len() > 0);
        }
        assert!(!popped.contains(&reused));
        assert_eq!(p.pop(), Some(reused));
        assert!(p.is_empty());
    }

    #[test]
    fn reuse_credit_is_capped() {
        let mut p = ReuseCreditPolicy::new();
        for t in 0..1_000u64 {
            p.insert(nid(t as u32), &meta(t, t, 0, 0));
            if t >= 10 {
                p.pop();
            }
        }
        let r = p.residence();
        // A leaf with a huge reuse count but older than MAX_CREDITS residence times loses to
        // an unreused leaf of this instant.
        let old = nid(5_000);
        let stale_tick = 999 - (r * 7.0) as u64;
        p.insert(old, &meta(stale_tick, 0, 1_000, 0));
        p.insert(nid(5_001), &meta(999, 999, 0, 0));
        assert_eq!(p.pop(), Some(old));
    }

    #[test]
    fn reuse_credit_touch_moves_between_classes() {
        let mut p = ReuseCreditPolicy::new();
        let a = p.insert(nid(0), &meta(1, 1, 0, 0));
        p.insert(nid(1), &meta(2, 2, 0, 0));
        // Same tick, one more reuse: the token changes, the leaf moves to the next class.
        let a2 = p.touch(nid(0), a, &meta(1, 1, 1, 0));
        assert_ne!(a, a2);
        assert_eq!(p.len(), 2);
        assert_eq!(p.touch(nid(0), a2, &meta(1, 1, 1, 0)), a2);
        // R is still 0: order is by tick alone.
        assert_eq!(p.pop(), Some(nid(0)));
        assert_eq!(p.pop(), Some(nid(1)));
        assert_eq!(p.pop(), None);
        p.insert(nid(2), &meta(3, 3, 4, 0));
        p.clear();
        assert!(p.is_empty() && p.pop().is_none());
    }

    /// Metas of twelve leaves; every third is `First`, the others `Later` (interleaved in
    /// every order the policies use).
    fn classed_leaves(kind: PolicyKind) -> Vec<(NodeMeta, LeafClass)> {
        (0..12u64)
            .map(|i| {
                // Reuse credits are scaled by the residence the pops of the first class
                // measure: no credits keeps the expected order that of each class alone.
                let hits = if kind == PolicyKind::Reuse {
                    0
                } else {
                    (i % 4) as u32
                };
                let m = meta((i * 7) % 12 + 1, (i * 5) % 12, hits, (i % 3) as i32 - 1);
                let class = if i % 3 == 0 {
                    LeafClass::First
                } else {
                    LeafClass::Later
                };
                (m, class)
            })
            .collect()
    }

    /// The order each class alone would be popped in (a fresh policy per class), the first
    /// class's leaves before the later's.
    fn expected_class_order(kind: PolicyKind, leaves: &[(NodeMeta, LeafClass)]) -> Vec<u32> {
        let mut out = Vec::new();
        for class in [LeafClass::First, LeafClass::Later] {
            let mut p = kind.build();
            for (i, (m, c)) in leaves.iter().enumerate() {
                if *c == class {
                    p.insert(nid(i as u32), m);
                }
            }
            out.extend(std::iter::from_fn(|| p.pop().map(|n| n.idx)));
        }
        out
    }

    #[test]
    fn classes_pop_the_first_class_first_each_in_its_own_order() {
        for kind in PolicyKind::ALL {
            let leaves = classed_leaves(kind);
            let mut p = kind.build();
            assert!(p.supports_classes(), "{kind:?}");
            for (i, (m, c)) in leaves.iter().enumerate() {
                p.insert_in(nid(i as u32), m, *c);
            }
            assert_eq!(
                (p.class_len(LeafClass::First), p.class_len(LeafClass::Later)),
                (4, 8),
                "{kind:?}"
            );
            let mut got = Vec::new();
            loop {
                let peeked = p.peek();
                let Some(n) = p.pop() else { break };
                assert!(
                    peeked.is_none_or(|k| k == n),
                    "{kind:?}: peek {peeked:?}, pop {n:?}"
                );
                got.push(n.idx);
            }
            assert_eq!(got, expected_class_order(kind, &leaves), "{kind:?}");
            assert!(
                p.is_empty() && p.class_len(LeafClass::Later) == 0,
                "{kind:?}"
            );
        }
    }

    #[test]
    fn touch_keeps_a_leaf_in_its_class() {
        for kind in PolicyKind::ALL {
            let leaves = classed_leaves(kind);
            let mut p = kind.build();
            let tokens: Vec<LeafToken> = leaves
                .iter()
                .enumerate()
                .map(|(i, (m, c))| p.insert_in(nid(i as u32), m, *c))
                .collect();
            // Every leaf is accessed again (newer, reused once more).
            for (i, (m, _)) in leaves.iter().enumerate() {
                let newer = meta(m.last_access + 100, m.created, m.hit_count + 1, m.priority);
                p.touch(nid(i as u32), tokens[i], &newer);
            }
            assert_eq!(p.class_len(LeafClass::First), 4, "{kind:?}");
            let first: Vec<u32> = (0..4).filter_map(|_| p.pop().map(|n| n.idx)).collect();
            assert!(first.iter().all(|i| i % 3 == 0), "{kind:?}: {first:?}");
            assert_eq!(p.class_len(LeafClass::Later), 8, "{kind:?}");
        }
    }

    #[test]
    fn set_class_moves_a_leaf_and_keeps_its_place() {
        for kind in PolicyKind::ALL {
            let leaves = classed_leaves(kind);
            let mut p = kind.build();
            // All enter the first class; the later ones move over, some back and forth.
            let mut tokens: Vec<LeafToken> = leaves
                .iter()
                .enumerate()
                .map(|(i, (m, _))| p.insert(nid(i as u32), m))
                .collect();
            for (i, (_, c)) in leaves.iter().enumerate() {
                if *c == LeafClass::Later {
                    tokens[i] = p.set_class(nid(i as u32), tokens[i], LeafClass::Later);
                    if i % 2 == 0 {
                        tokens[i] = p.set_class(nid(i as u32), tokens[i], LeafClass::First);
                        tokens[i] = p.set_class(nid(i as u32), tokens[i], LeafClass::Later);
                    }
                }
                // A move to the class it is in changes nothing.
                let again = p.set_class(nid(i as u32), tokens[i], *c);
                assert_eq!(again, tokens[i], "{kind:?}");
            }
            assert_eq!(p.class_len(LeafClass::Later), 8, "{kind:?}");
            // Tokens stay valid: a removal through one takes exactly that leaf.
            p.remove(nid(1), tokens[1]);
            assert_eq!(p.len(), 11, "{kind:?}");
            let got: Vec<u32> = std::iter::from_fn(|| p.pop().map(|n| n.idx)).collect();
            let mut expect = expected_class_order(kind, &leaves);
            expect.retain(|&i| i != 1);
            assert_eq!(got, expect, "{kind:?}");
        }
    }

    #[test]
    fn sieve_visited_bit_survives_class_moves_and_first_class_pops() {
        let mut p = PolicyKind::Sieve.build();
        let m = meta(0, 0, 0, 0);
        let hot = p.insert_in(nid(0), &m, LeafClass::Later);
        p.insert_in(nid(1), &m, LeafClass::Later);
        let dead = p.insert_in(nid(2), &m, LeafClass::First);
        p.insert_in(nid(3), &m, LeafClass::First);
        // Leaf 0 is reused, then moves to the first class and back (its state went and came).
        let hot = p.touch(nid(0), hot, &m);
        let hot = p.set_class(nid(0), hot, LeafClass::First);
        let hot = p.set_class(nid(0), hot, LeafClass::Later);
        // Leaf 2 moves to the later class: after leaf 1 in the FIFO, as it entered.
        p.set_class(nid(2), dead, LeafClass::Later);
        assert_eq!(p.pop(), Some(nid(3)), "the first class goes first");
        // The later class: leaf 0 is visited (spared once), leaf 1 is not.
        assert_eq!(p.pop(), Some(nid(1)));
        assert_eq!(p.pop(), Some(nid(2)));
        assert_eq!(p.pop(), Some(nid(0)));
        assert_eq!(p.pop(), None);
        let _ = hot;
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
