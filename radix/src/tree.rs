//! The radix tree core: an arena of nodes keyed by page-aligned token runs.
//!
//! The tree is pure bookkeeping: it never frees memory itself. Operations hand back what must
//! happen to pages (the duplicates an insert replaced, the pages an eviction released) and the
//! owner applies it. A node carries its device pages and, in tiered caches, its host pages; the
//! tree keeps the counters and the evictable-leaf set consistent with both.
//!
//! # Invariants (checked by [`RadixTree::check`])
//! - Every edge (node key) is a non-empty multiple of the page size; a node on device holds one
//!   page per `page_size` tokens.
//! - Device residency is root-connected: a node on device has its parent on device (or is a
//!   root child). Host residency is root-connected too.
//! - `lock_ref(n) >= Σ lock_ref(children)`: a lock anchored at a node counts on every ancestor.
//! - `evictable + protected == tokens on device`, where protected counts nodes with
//!   `lock_ref > 0`; both are maintained in O(1) per node state change.
//! - The policy holds exactly the evictable leaves: on device, unlocked, no child on device,
//!   not the root.

use std::sync::atomic::{AtomicU64, Ordering};

use ahash::RandomState;
use slab::Slab;

use crate::ensure_inv;
use crate::error::{CacheError, InvariantViolation, Result};
use crate::events::{EventBuffer, KvEvent, chain_hashes, namespace_seed};
use crate::page_hash::{PageHash, PageHasher};
use crate::page_key::{KeySeed, KvIdentity, PageKey};
use crate::policy::{EvictionPolicy, LeafClass, LeafToken, NodeMeta, PolicyKind};
use crate::types::{KeyRef, Medium, Namespace, NodeId, PageId, TokenId};

use children::{Children, NIL, Slot};

static NEXT_TREE_ID: AtomicU64 = AtomicU64::new(1);

/// Proof that a lock is held on the path from the root to `anchor`.
///
/// Returned by `inc_lock_ref` and consumed by `dec_lock_ref`. It is neither `Clone` nor `Copy`,
/// so a second release of the same receipt does not compile; a receipt from another cache, or
/// whose anchor was dropped by a reset, is rejected with [`CacheError::StaleReceipt`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a lock receipt must be handed back to dec_lock_ref, or the path stays locked"]
pub struct LockReceipt {
    anchor: NodeId,
    tree_id: u64,
    /// The receipt also holds a lock on the anchor's Mamba state.
    mamba: bool,
    /// The receipt also holds SWA locks: on the anchor's path up to the node carrying this
    /// mark (0: up to the root). See [`RadixTree::inc_lock_ref_swa`].
    swa: Option<u64>,
}

impl LockReceipt {
    /// The node whose root path is locked.
    pub fn anchor(&self) -> NodeId {
        self.anchor
    }

    /// True when the receipt also locks the anchor's Mamba state
    /// ([`RadixTree::inc_lock_ref_mamba`]).
    pub fn locks_mamba_state(&self) -> bool {
        self.mamba
    }

    /// True when the receipt also locks the sliding-window KV before its anchor
    /// ([`RadixTree::inc_lock_ref_swa`]).
    pub fn locks_swa_window(&self) -> bool {
        self.swa.is_some()
    }
}

/// A tree node. `repr(C)` keeps the fields in the order written: what every walk up or down
/// the tree reads (the parent link, the lock count, the depth, the key and the device pages)
/// first and together, then what a match or an insert reads at the nodes it passes, then the
/// rest. (In the compiler's own order the lock count and the parent link came last, behind
/// the fields only events and the host tier read.)
#[derive(Debug)]
#[repr(C)]
struct Node {
    parent: u32,
    lock_ref: u32,
    /// Tokens from the root to the end of `key` (the path's length): set when the node is
    /// made, and only a split, which puts a node above it, leaves it as it is. An anchored
    /// insert or walk checks its offset against it without reading the path.
    depth: usize,
    key: Vec<TokenId>,
    /// Device pages, one per page of `key`; empty when the node is not on device.
    pages: Vec<PageId>,
    /// Match hash of the node's last page (its whole path's chain, see [`crate::page_hash`]),
    /// 0 while unknown: set by an insert or a match that carries hashes that far.
    end_hash: u128,
    meta: NodeMeta,
    leaf: Option<LeafToken>,
    /// Host pages (tiered caches only).
    host: Option<Vec<u32>>,
    device_children: u32,
    children: Children,
    child_hash: u64,
    namespace: Namespace,
    /// Chain hash per page (only kept when events are enabled).
    page_hashes: Vec<u64>,
    /// Storage key per page (only kept when events carry page keys).
    page_keys: Vec<PageKey>,
}

impl Node {
    fn on_device(&self) -> bool {
        !self.pages.is_empty()
    }

    /// Its tokens count as evictable (on device, no lock): a lock moves them to protected.
    fn counts_evictable(&self) -> bool {
        self.lock_ref == 0 && self.on_device()
    }
}

/// Result of a prefix match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeMatch {
    /// Leading tokens whose KV is on device (page-aligned).
    pub device_len: usize,
    /// Tokens after `device_len` whose KV is only on the host tier.
    pub host_len: usize,
    /// Deepest node of the device prefix (the root when nothing matched): the lock anchor.
    pub last_device: NodeId,
    /// Deepest matched node on any tier: the load-back anchor.
    pub last_node: NodeId,
}

/// Result of an insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeInsert {
    /// Leading tokens that were already on device before the insert.
    pub prefix_len: usize,
    /// Tokens whose pages the tree adopted.
    pub adopted_len: usize,
    /// The node that ends the inserted key.
    pub last_node: NodeId,
}

/// Per-insert options.
#[derive(Debug, Clone, Copy, Default)]
pub struct InsertOptions {
    /// Request priority, max-propagated along the path.
    pub priority: i32,
    /// A chunked-prefill insert: does not count as a reuse hit.
    pub chunked: bool,
}

/// The radix tree over page-aligned token runs. See the module docs for its invariants.
pub struct RadixTree {
    /// The node arena; `generations` beside it makes [`NodeId`]s stale-safe.
    ///
    /// Why not `slotmap::SlotMap` (a version kept in each slot, keys as links): measured in
    /// the radix benches (callgrind, per operation), a port with the same behaviour ran 7.8%
    /// more instructions per 1,000 evictions from 1M single-page leaves (618.5K against
    /// 573.5K) and misses the simulated L1 and last-level caches 5–6% more often (6,027
    /// against 5,717; 3,108 against 2,932), the extra misses falling where the victim's handle
    /// is checked and removed; its checked index was not inlined there. Match, insert and
    /// `match_fanout/6` were equal within 1.3% in instructions and L1 misses (at most one
    /// last-level miss per operation on either), and the node grows from 216 to 232 bytes
    /// (8-byte keys in `parent` and the inline children). On the wall clock (a loaded machine)
    /// eviction took 1.035× the time (median of six interleaved runs, range 0.93–1.49×); the
    /// other groups' ratios were lost in the noise.
    nodes: Slab<Node>,
    generations: Vec<u32>,
    root: u32,
    page_size: usize,
    clock: u64,
    evictable: usize,
    protected: usize,
    policy: Box<dyn EvictionPolicy>,
    hasher: RandomState,
    /// The match hashes' hasher (random seed; see [`crate::page_hash`]).
    page_hasher: PageHasher,
    /// Set when a match hash accepted an edge whose tokens differ (debug builds check every
    /// edge a hash accepts): reported by [`RadixTree::check_invariants`].
    hash_contract_broken: std::sync::atomic::AtomicBool,
    /// Set when a node was given a match hash that is not its path's chain (checked in debug
    /// builds when a hash is set): reported by [`RadixTree::check_invariants`].
    hash_chain_broken: std::sync::atomic::AtomicBool,
    events: Option<EventBuffer>,
    tree_id: u64,
    outstanding_locks: usize,
    bufs: BufferPool,
    /// The first bad answer of the policy not yet taken (see [`RadixTree::pop_victim`]).
    policy_fault: Option<CacheError>,
    /// The Mamba component (hybrid models only); `None` for a KV-only tree.
    mamba: Option<Box<mamba::MambaComponent>>,
    /// The sliding-window KV component (SWA models only); `None` for a KV-only tree.
    swa: Option<Box<swa::SwaComponent>>,
    /// Events carry storage page keys ([`RadixTree::set_event_page_keys`]).
    event_keys: Option<Box<EventKeys>>,
    /// A hinted match's path (see [`RadixTree::match_prefix_from`]), kept for its allocation.
    path_scratch: Vec<u32>,
}

/// What page keys of events are chained from: the identity and each namespace's seed (cached,
/// cleared past [`EventKeys::SEED_LIMIT`] namespaces so a namespace per request cannot grow it).
#[derive(Debug)]
struct EventKeys {
    identity: KvIdentity,
    seeds: ahash::AHashMap<Namespace, KeySeed>,
}

impl EventKeys {
    const SEED_LIMIT: usize = 4096;

    fn seed(&mut self, ns: &Namespace) -> KeySeed {
        if self.seeds.len() >= Self::SEED_LIMIT && !self.seeds.contains_key(ns) {
            self.seeds.clear();
        }
        *self
            .seeds
            .entry(ns.clone())
            .or_insert_with(|| KeySeed::new(ns, &self.identity))
    }
}

/// Recycled edge buffers: evicting a leaf and inserting a new one is the steady state of a
/// full cache, and reusing their allocations takes malloc and free off both paths.
///
/// The pool is bounded in elements, not only in buffers, and a buffer is reused only for an
/// edge that fills at least half of it: the tree's memory then stays within twice the tokens
/// and pages it holds (a small edge taking a large buffer, or a pool of large buffers that no
/// edge fits, would hold memory that follows the traffic's history, not the cache).
#[derive(Debug, Default)]
struct BufferPool {
    tokens: Recycled<TokenId, 0>,
    /// A sixteenth of the tokens' element bound: an edge holds one page id per page of tokens
    /// (16 or more tokens a page in practice), so it keeps at least as many edges' worth.
    pages: Recycled<PageId, 4>,
}

/// Recycled buffers of `T`, at most `2^18 >> SHIFT` elements in all, kept by size class (the
/// power of two below their capacity) so that an edge finds a buffer of its size whatever
/// the order the sizes were freed in.
#[derive(Debug)]
struct Recycled<T, const SHIFT: u32> {
    /// `classes[k]` holds buffers whose capacity is in `[2^k, 2^(k+1))`.
    classes: [Vec<Vec<T>>; CLASSES],
    /// Buffers kept, in all classes.
    buffers: usize,
    /// Sum of the kept buffers' capacities.
    elements: usize,
}

/// Size classes of [`Recycled`]: capacities up to `2^18`.
const CLASSES: usize = 19;

impl<T, const SHIFT: u32> Default for Recycled<T, SHIFT> {
    fn default() -> Self {
        Recycled {
            classes: std::array::from_fn(|_| Vec::new()),
            buffers: 0,
            elements: 0,
        }
    }
}

impl<T: Copy, const SHIFT: u32> Recycled<T, SHIFT> {
    /// Buffers kept, the largest capacity worth keeping (a quarter of the bound, so that one
    /// long edge's buffer never crowds out the rest), and the most elements kept in all.
    const MAX_BUFFERS: usize = 4096;
    const MAX_ELEMENTS: usize = (1 << 18) >> SHIFT;
    const MAX_CAPACITY: usize = Self::MAX_ELEMENTS / 4;

    fn class(capacity: usize) -> usize {
        capacity.ilog2() as usize
    }

    /// Keeps `v` for reuse if it is small enough and the pool has room for it.
    fn put(&mut self, mut v: Vec<T>) {
        let cap = v.capacity();
        if (1..=Self::MAX_CAPACITY).contains(&cap)
            && self.buffers < Self::MAX_BUFFERS
            && self.elements + cap <= Self::MAX_ELEMENTS
        {
            v.clear();
            self.elements += cap;
            self.buffers += 1;
            self.classes[Self::class(cap)].push(v);
        }
    }

    /// A buffer holding a copy of `src`: a kept one with room for it and at most twice its
    /// size (the most recently kept of its class or the next), or a new one. A kept buffer
    /// too small is never grown (that would copy its whole old capacity for nothing: it is
    /// empty), and one more than twice the size is left for a longer edge.
    fn take(&mut self, src: &[T]) -> Vec<T> {
        let len = src.len();
        if len == 0 || len > Self::MAX_CAPACITY {
            return src.to_vec();
        }
        let k = Self::class(len);
        let fits = |v: &mut Vec<T>| v.capacity() >= len && v.capacity() <= 2 * len;
        let found = match self.classes[k].pop_if(fits) {
            Some(v) => Some(v),
            None => self.classes.get_mut(k + 1).and_then(|c| c.pop_if(fits)),
        };
        match found {
            Some(mut v) => {
                self.elements -= v.capacity();
                self.buffers -= 1;
                v.extend_from_slice(src);
                v
            }
            None => src.to_vec(),
        }
    }
}

impl BufferPool {
    fn recycle(&mut self, key: Vec<TokenId>, pages: Vec<PageId>) {
        self.tokens.put(key);
        self.pages.put(pages);
    }

    fn tokens(&mut self, src: &[TokenId]) -> Vec<TokenId> {
        self.tokens.take(src)
    }

    fn pages(&mut self, src: &[PageId]) -> Vec<PageId> {
        self.pages.take(src)
    }
}

impl std::fmt::Debug for RadixTree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RadixTree")
            .field("nodes", &self.nodes.len())
            .field("page_size", &self.page_size)
            .field("evictable", &self.evictable)
            .field("protected", &self.protected)
            .field("policy", &self.policy.name())
            .finish()
    }
}

impl RadixTree {
    /// An empty tree with `page_size` tokens per page, the given eviction policy, and KV events
    /// recorded when `events` is true.
    ///
    /// # Errors
    /// [`CacheError::Config`] for a page size of 0.
    pub fn new(page_size: usize, policy: PolicyKind, events: bool) -> Result<Self> {
        Self::with_policy(page_size, policy.build(), events)
    }

    /// Like [`RadixTree::new`] with a custom policy implementation.
    pub fn with_policy(
        page_size: usize,
        policy: Box<dyn EvictionPolicy>,
        events: bool,
    ) -> Result<Self> {
        if page_size == 0 {
            return Err(CacheError::Config("page size must be at least 1".into()));
        }
        let mut t = RadixTree {
            nodes: Slab::new(),
            generations: Vec::new(),
            root: NIL,
            page_size,
            clock: 0,
            evictable: 0,
            protected: 0,
            policy,
            hasher: RandomState::new(),
            page_hasher: PageHasher::random(page_size),
            hash_contract_broken: std::sync::atomic::AtomicBool::new(false),
            hash_chain_broken: std::sync::atomic::AtomicBool::new(false),
            events: events.then(EventBuffer::default),
            tree_id: NEXT_TREE_ID.fetch_add(1, Ordering::Relaxed),
            outstanding_locks: 0,
            bufs: BufferPool::default(),
            policy_fault: None,
            mamba: None,
            swa: None,
            event_keys: None,
            path_scratch: Vec::new(),
        };
        t.root = t.alloc_node(Node {
            parent: NIL,
            key: Vec::new(),
            depth: 0,
            pages: Vec::new(),
            host: None,
            children: Children::default(),
            child_hash: 0,
            namespace: Namespace::DEFAULT,
            lock_ref: 0,
            device_children: 0,
            meta: NodeMeta {
                priority: i32::MIN,
                ..NodeMeta::default()
            },
            leaf: None,
            page_hashes: Vec::new(),
            end_hash: 0,
            page_keys: Vec::new(),
        });
        Ok(t)
    }

    // ---------------------------------------------------------------------------------------
    // Accessors

    /// The hasher of this tree's match hashes ([`crate::page_hash`]): the chain a prompt's
    /// [`KeyRef::hashes`] must be.
    pub fn page_hasher(&self) -> PageHasher {
        self.page_hasher
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Tokens on device in unlocked nodes.
    pub fn evictable_tokens(&self) -> usize {
        self.evictable
    }

    /// Tokens on device in locked nodes.
    pub fn protected_tokens(&self) -> usize {
        self.protected
    }

    /// Number of nodes, the root included.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Number of evictable leaves.
    pub fn evictable_leaves(&self) -> usize {
        self.policy.len()
    }

    /// Lock receipts handed out and not yet returned.
    pub fn outstanding_locks(&self) -> usize {
        self.outstanding_locks
    }

    /// The root handle.
    pub fn root(&self) -> NodeId {
        self.id_of(self.root)
    }

    /// Name of the eviction policy.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// True when KV events are recorded.
    pub fn events_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// Makes KV events carry each page's storage [`PageKey`] (chained from `identity` and the
    /// page's namespace, as the storage tier keys it; see the [events](crate::events#page-keys)
    /// docs), or stops it with `None`.
    ///
    /// # Errors
    /// [`CacheError::Config`] when the tree records no events, or already holds a node: every
    /// node's keys chain from its parent's, so they must be kept from the first insert on.
    pub fn set_event_page_keys(&mut self, identity: Option<KvIdentity>) -> Result<()> {
        if identity.is_some() && self.events.is_none() {
            return Err(CacheError::Config(
                "event page keys need KV events to be recorded".into(),
            ));
        }
        if self.nodes.len() > 1 {
            return Err(CacheError::Config(
                "event page keys must be set on an empty tree (before the first insert)".into(),
            ));
        }
        self.event_keys = identity.map(|identity| {
            Box::new(EventKeys {
                identity,
                seeds: ahash::AHashMap::default(),
            })
        });
        Ok(())
    }

    /// The identity event page keys are chained from, when they are on.
    pub fn event_page_keys(&self) -> Option<&KvIdentity> {
        self.event_keys.as_ref().map(|k| &k.identity)
    }

    /// The storage keys of the whole pages of `tokens`, a new child of `parent` in `ns`;
    /// empty unless events carry page keys.
    fn chain_page_keys(&mut self, parent: u32, ns: &Namespace, tokens: &[TokenId]) -> Vec<PageKey> {
        let Some(keys) = self.event_keys.as_deref_mut() else {
            return Vec::new();
        };
        let p = self.page_size;
        let mut out = Vec::with_capacity(tokens.len() / p);
        match self.nodes[parent as usize].page_keys.last() {
            // Below the root a node's chain continues its parent's.
            Some(&parent_key) => {
                let mut prev = parent_key;
                for page in tokens.chunks_exact(p) {
                    prev = prev.next(page);
                    out.push(prev);
                }
            }
            None => keys.seed(ns).extend_chain(None, tokens, p, &mut out),
        }
        out
    }

    /// Drains recorded KV events.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        match &mut self.events {
            Some(b) => b.take(),
            None => Vec::new(),
        }
    }

    /// Records an event (tiered caches report host-side stores and removals through this). A
    /// full buffer drops it and counts the drop (see [`EventBuffer`]).
    pub fn push_event(&mut self, ev: KvEvent) {
        if let Some(b) = &mut self.events {
            b.push(ev);
        }
    }

    /// Sets how many events are held until drained (default
    /// [`EventBuffer::DEFAULT_CAPACITY`]); without events, nothing changes.
    ///
    /// # Errors
    /// [`CacheError::Config`] for 0.
    pub fn set_event_capacity(&mut self, capacity: usize) -> Result<()> {
        match &mut self.events {
            Some(b) => b.set_capacity(capacity),
            None => EventBuffer::new(capacity).map(|_| ()),
        }
    }

    /// KV events dropped because nobody drained them in time (see [`EventBuffer`]); 0 without
    /// events.
    pub fn events_dropped(&self) -> u64 {
        self.events.as_ref().map_or(0, EventBuffer::dropped)
    }

    fn id_of(&self, idx: u32) -> NodeId {
        NodeId {
            idx,
            generation: self.generations[idx as usize],
        }
    }

    fn resolve(&self, id: NodeId) -> Result<u32> {
        match self.generations.get(id.index()) {
            Some(&g) if g == id.generation && self.nodes.contains(id.index()) => Ok(id.idx),
            _ => Err(CacheError::StaleNode(id)),
        }
    }

    /// True when `id` names a live node.
    pub fn contains(&self, id: NodeId) -> bool {
        self.resolve(id).is_ok()
    }

    /// The device pages of node `id` (empty when not on device).
    pub fn device_pages(&self, id: NodeId) -> Result<&[PageId]> {
        Ok(&self.nodes[self.resolve(id)? as usize].pages)
    }

    /// The edge tokens of node `id`.
    pub fn node_key(&self, id: NodeId) -> Result<&[TokenId]> {
        Ok(&self.nodes[self.resolve(id)? as usize].key)
    }

    /// The lock count of node `id`.
    pub fn lock_ref(&self, id: NodeId) -> Result<u32> {
        Ok(self.nodes[self.resolve(id)? as usize].lock_ref)
    }

    /// The policy metadata of node `id`.
    pub fn meta(&self, id: NodeId) -> Result<NodeMeta> {
        Ok(self.nodes[self.resolve(id)? as usize].meta)
    }

    /// The parent of `id` (`None` for the root).
    pub fn parent(&self, id: NodeId) -> Result<Option<NodeId>> {
        let p = self.nodes[self.resolve(id)? as usize].parent;
        Ok((p != NIL).then(|| self.id_of(p)))
    }

    /// Depth of `id` in tokens (length of the key from the root to the end of the node). The
    /// node keeps it, so this reads no path.
    pub fn depth_tokens(&self, id: NodeId) -> Result<usize> {
        Ok(self.depth_of(self.resolve(id)?))
    }

    /// Pushes the path from the root to the resolved node index `i` (root excluded) onto
    /// `out`, deepest first (its length in tokens is [`RadixTree::depth_of`] `i`).
    fn push_path(&self, mut i: u32, out: &mut Vec<u32>) {
        while i != self.root {
            out.push(i);
            i = self.nodes[i as usize].parent;
        }
    }

    /// [`RadixTree::depth_tokens`] of a resolved node index.
    #[inline]
    fn depth_of(&self, i: u32) -> usize {
        self.nodes[i as usize].depth
    }

    // ---------------------------------------------------------------------------------------
    // Arena

    fn alloc_node(&mut self, node: Node) -> u32 {
        let idx = self.nodes.insert(node);
        if idx >= self.generations.len() {
            self.generations.resize(idx + 1, 0);
        }
        idx as u32
    }

    /// Removes node `idx` from the arena (bumping its generation) and returns it.
    fn free_node(&mut self, idx: u32) -> Node {
        let g = &mut self.generations[idx as usize];
        *g = g.wrapping_add(1);
        self.nodes.remove(idx as usize)
    }

    /// Like [`RadixTree::free_node`], recycling the node's edge buffers; the caller must have
    /// taken what it needs from them.
    fn free_node_recycle(&mut self, idx: u32) {
        let mut n = self.free_node(idx);
        let key = std::mem::take(&mut n.key);
        let pages = std::mem::take(&mut n.pages);
        self.bufs.recycle(key, pages);
    }

    #[inline]
    fn child_hash(&self, parent: u32, ns: &Namespace, first_page: &[TokenId]) -> u64 {
        if parent == self.root {
            self.hasher.hash_one((ns, first_page))
        } else {
            self.hasher.hash_one(first_page)
        }
    }

    /// Refuses to add the component `name` (`present`: the tree already has it) unless the
    /// tree is empty: a component added later would miss the nodes already there.
    fn check_can_add_component(&self, name: &str, present: bool) -> Result<()> {
        if present {
            return Err(CacheError::Config(format!(
                "the {name} component is already enabled"
            )));
        }
        if self.nodes.len() > 1 {
            return Err(CacheError::Config(format!(
                "the {name} component can only be added to an empty tree"
            )));
        }
        Ok(())
    }

    #[inline]
    fn is_live(&self, idx: u32, generation: u32) -> bool {
        self.generations[idx as usize] == generation && self.nodes.contains(idx as usize)
    }

    #[inline]
    fn find_child(&self, parent: u32, ns: &Namespace, page: &[TokenId]) -> Option<u32> {
        let p = self.page_size;
        let at_root = parent == self.root;
        let starts_here = |c: u32| {
            let n = &self.nodes[c as usize];
            n.key[..p] == *page && (!at_root || n.namespace == *ns)
        };
        match &self.nodes[parent as usize].children {
            // A few children: their first pages are compared directly, which costs less than
            // hashing the page (most nodes on a long conversation's path have one child).
            Children::Inline(v) => v.iter().copied().find(|&c| starts_here(c)),
            Children::Table(t) => {
                let h = self.child_hash(parent, ns, page);
                t.find(
                    h,
                    |i, g| self.is_live(i, g),
                    |c| self.nodes[c as usize].child_hash == h && starts_here(c),
                )
            }
        }
    }

    fn add_child(&mut self, parent: u32, child: u32) {
        let slot = Slot {
            hash: self.nodes[child as usize].child_hash,
            idx: child,
            generation: self.generations[child as usize],
        };
        let mut children = std::mem::take(&mut self.nodes[parent as usize].children);
        children.add(
            slot,
            |c| {
                (
                    self.nodes[c as usize].child_hash,
                    self.generations[c as usize],
                )
            },
            |i, g| self.is_live(i, g),
        );
        self.nodes[parent as usize].children = children;
    }

    /// Unlinks `child` from `parent`. The caller frees the child from the arena right after
    /// (or re-links it), which is what makes a table's lazily kept entry stale.
    fn remove_child(&mut self, parent: u32, child: u32) {
        self.nodes[parent as usize].children.remove(child);
    }

    /// Points the parent's child entry at `new` instead of `old` (same first page).
    fn replace_child(&mut self, parent: u32, old: u32, new: u32) {
        let h = self.nodes[old as usize].child_hash;
        let old_g = self.generations[old as usize];
        let new_g = self.generations[new as usize];
        self.nodes[parent as usize]
            .children
            .replace(h, (old, old_g), (new, new_g));
    }

    // ---------------------------------------------------------------------------------------
    // Leaf set and counters

    #[inline]
    fn is_evictable_leaf(&self, idx: u32) -> bool {
        let n = &self.nodes[idx as usize];
        idx != self.root && n.on_device() && n.lock_ref == 0 && n.device_children == 0
    }

    /// Brings `idx`'s membership in the evictable-leaf set in line with its state.
    #[inline]
    fn update_leaf(&mut self, idx: u32) {
        let should = self.is_evictable_leaf(idx);
        let id = self.id_of(idx);
        let n = &mut self.nodes[idx as usize];
        match (n.leaf, should) {
            (None, true) => {
                // A KV-only tree (and one without dead-end tracking) has one class.
                n.leaf = Some(match self.mamba.as_deref() {
                    Some(m) if m.dead_end_first => {
                        let class = if m.keeps_state(idx) {
                            LeafClass::Later
                        } else {
                            LeafClass::First
                        };
                        self.policy.insert_in(id, &n.meta, class)
                    }
                    _ => self.policy.insert(id, &n.meta),
                })
            }
            (Some(tok), false) => {
                self.policy.remove(id, tok);
                n.leaf = None;
            }
            _ => {}
        }
    }

    #[inline]
    fn touch(&mut self, idx: u32, now: u64) {
        let id = self.id_of(idx);
        let n = &mut self.nodes[idx as usize];
        n.meta.last_access = now;
        if let Some(tok) = n.leaf {
            n.leaf = Some(self.policy.touch(id, tok, &n.meta));
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    // ---------------------------------------------------------------------------------------
    // Reset and traversal

    /// Drops every node; returns the device pages they held (appended to `out`). Every node
    /// handle and lock receipt issued before becomes stale.
    ///
    /// # Errors
    /// [`CacheError::Busy`] while lock receipts are outstanding (nothing changes then).
    pub fn reset(&mut self, out: &mut Vec<PageId>) -> Result<()> {
        if self.outstanding_locks > 0 {
            return Err(CacheError::Busy("lock receipts are outstanding"));
        }
        if let Some(m) = self.mamba.as_deref_mut() {
            m.clear_tree_states();
        }
        if let Some(w) = self.swa.as_deref_mut() {
            w.clear_tree_pages();
        }
        let keys: Vec<usize> = self.nodes.iter().map(|(k, _)| k).collect();
        for k in keys {
            if k as u32 == self.root {
                continue;
            }
            out.extend_from_slice(&self.nodes[k].pages);
            self.free_node_recycle(k as u32);
        }
        let r = &mut self.nodes[self.root as usize];
        r.children = Children::default();
        r.device_children = 0;
        self.policy.clear();
        self.evictable = 0;
        self.protected = 0;
        self.push_event(KvEvent::AllBlocksCleared);
        Ok(())
    }

    /// Total device tokens held by the tree.
    pub fn device_tokens(&self) -> usize {
        self.evictable + self.protected
    }

    /// Visits every device page held by the tree.
    pub fn for_each_device_page(&self, mut f: impl FnMut(PageId)) {
        for (_, n) in self.nodes.iter() {
            n.pages.iter().copied().for_each(&mut f);
        }
    }
}

/// Hints the CPU to start loading `value`'s cache line. No effect on semantics.
#[inline(always)]
fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and has no architectural effect; SSE is part of the
    // x86_64 baseline, so the instruction exists on every target this compiles for.
    unsafe {
        use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

/// Length of the common prefix of `a` and `b`, rounded down to whole pages of `p` tokens.
/// Compares page by page (memcmp on each page), so the per-token cost is that of a memcmp.
#[inline]
fn common_pages(a: &[TokenId], b: &[TokenId], p: usize) -> usize {
    let n = a.len().min(b.len());
    let n = n - n % p;
    if p == 1 {
        // Compare 16 tokens at a time, then finish the diverging block token by token.
        let mut i = 0;
        while i + 16 <= n && a[i..i + 16] == b[i..i + 16] {
            i += 16;
        }
        while i < n && a[i] == b[i] {
            i += 1;
        }
        return i;
    }
    // Gallop over whole pages in blocks of 8 pages, then page by page.
    let block = 8 * p;
    let mut i = 0;
    while i + block <= n && a[i..i + block] == b[i..i + block] {
        i += block;
    }
    while i + p <= n && a[i..i + p] == b[i..i + p] {
        i += p;
    }
    i
}

mod check;
mod children;
mod locks;
pub(crate) mod mamba;
pub(crate) mod mamba_tier;
mod restore;
pub(crate) mod swa;
pub(crate) mod swa_tier;
#[cfg(test)]
mod tests;
pub(crate) mod tier;
mod walk;
