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
use crate::events::{KvEvent, chain_hashes, namespace_seed};
use crate::policy::{EvictionPolicy, LeafToken, NodeMeta, PolicyKind};
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
}

impl LockReceipt {
    /// The node whose root path is locked.
    pub fn anchor(&self) -> NodeId {
        self.anchor
    }
}

#[derive(Debug)]
struct Node {
    parent: u32,
    key: Vec<TokenId>,
    /// Device pages, one per page of `key`; empty when the node is not on device.
    pages: Vec<PageId>,
    /// Host pages (tiered caches only).
    host: Option<Vec<u32>>,
    children: Children,
    child_hash: u64,
    namespace: Namespace,
    lock_ref: u32,
    device_children: u32,
    meta: NodeMeta,
    leaf: Option<LeafToken>,
    /// Chain hash per page (only kept when events are enabled).
    page_hashes: Vec<u64>,
}

impl Node {
    fn on_device(&self) -> bool {
        !self.pages.is_empty()
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
    nodes: Slab<Node>,
    generations: Vec<u32>,
    root: u32,
    page_size: usize,
    clock: u64,
    evictable: usize,
    protected: usize,
    policy: Box<dyn EvictionPolicy>,
    hasher: RandomState,
    events: Option<Vec<KvEvent>>,
    tree_id: u64,
    outstanding_locks: usize,
    bufs: BufferPool,
}

/// Recycled edge buffers: evicting a leaf and inserting a new one is the steady state of a
/// full cache, and reusing their allocations takes malloc and free off both paths.
#[derive(Debug, Default)]
struct BufferPool {
    tokens: Vec<Vec<TokenId>>,
    pages: Vec<Vec<PageId>>,
}

impl BufferPool {
    /// Buffers kept per kind, and the largest capacity worth keeping.
    const MAX_BUFFERS: usize = 4096;
    const MAX_CAPACITY: usize = 4096;

    fn recycle(&mut self, mut key: Vec<TokenId>, mut pages: Vec<PageId>) {
        if (1..=Self::MAX_CAPACITY).contains(&key.capacity())
            && self.tokens.len() < Self::MAX_BUFFERS
        {
            key.clear();
            self.tokens.push(key);
        }
        if (1..=Self::MAX_CAPACITY).contains(&pages.capacity())
            && self.pages.len() < Self::MAX_BUFFERS
        {
            pages.clear();
            self.pages.push(pages);
        }
    }

    fn tokens(&mut self, src: &[TokenId]) -> Vec<TokenId> {
        let mut v = self.tokens.pop().unwrap_or_default();
        v.extend_from_slice(src);
        v
    }

    fn pages(&mut self, src: &[PageId]) -> Vec<PageId> {
        let mut v = self.pages.pop().unwrap_or_default();
        v.extend_from_slice(src);
        v
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
            events: events.then(Vec::new),
            tree_id: NEXT_TREE_ID.fetch_add(1, Ordering::Relaxed),
            outstanding_locks: 0,
            bufs: BufferPool::default(),
        };
        t.root = t.alloc_node(Node {
            parent: NIL,
            key: Vec::new(),
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
        });
        Ok(t)
    }

    // ---------------------------------------------------------------------------------------
    // Accessors

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

    /// Drains recorded KV events.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        match &mut self.events {
            Some(v) => std::mem::take(v),
            None => Vec::new(),
        }
    }

    /// Records an event (tiered caches report host-side stores and removals through this).
    pub fn push_event(&mut self, ev: KvEvent) {
        if let Some(v) = &mut self.events {
            v.push(ev);
        }
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

    /// Depth of `id` in tokens (length of the key from the root to the end of the node).
    pub fn depth_tokens(&self, id: NodeId) -> Result<usize> {
        let mut i = self.resolve(id)?;
        let mut d = 0;
        while i != self.root {
            d += self.nodes[i as usize].key.len();
            i = self.nodes[i as usize].parent;
        }
        Ok(d)
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

    #[inline]
    fn is_live(&self, idx: u32, generation: u32) -> bool {
        self.generations[idx as usize] == generation && self.nodes.contains(idx as usize)
    }

    #[inline]
    fn find_child(&self, parent: u32, ns: &Namespace, page: &[TokenId]) -> Option<u32> {
        let h = self.child_hash(parent, ns, page);
        let p = self.page_size;
        let at_root = parent == self.root;
        let matches = |c: u32| {
            let n = &self.nodes[c as usize];
            n.child_hash == h && n.key[..p] == *page && (!at_root || n.namespace == *ns)
        };
        match &self.nodes[parent as usize].children {
            Children::Inline(v) => v.iter().copied().find(|&c| matches(c)),
            Children::Table(t) => t.find(h, |i, g| self.is_live(i, g), matches),
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
            (None, true) => n.leaf = Some(self.policy.insert(id, &n.meta)),
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
    // Match

    /// Longest page-aligned prefix of `key` in the tree. Appends the device pages of the
    /// device prefix to `out`. The key is truncated to whole pages first. Refreshes access
    /// times along the path and splits a node when the match ends inside it (so the returned
    /// anchors end exactly at the match). Takes no lock.
    pub fn match_prefix(&mut self, key: KeyRef<'_>, out: &mut Vec<PageId>) -> TreeMatch {
        let p = self.page_size;
        let tokens = &key.tokens[..key.tokens.len() - key.tokens.len() % p];
        let now = self.next_tick();
        let mut node = self.root;
        let mut last_device = self.root;
        let mut pos = 0;
        let mut device_len = 0;
        let mut on_device = true;
        while pos < tokens.len() {
            let Some(child) = self.find_child(node, key.namespace, &tokens[pos..pos + p]) else {
                break;
            };
            let common = common_pages(&self.nodes[child as usize].key, &tokens[pos..], p);
            let child = if common < self.nodes[child as usize].key.len() {
                self.split(child, common)
            } else {
                child
            };
            self.touch(child, now);
            let n = &self.nodes[child as usize];
            if on_device && n.on_device() {
                out.extend_from_slice(&n.pages);
                device_len += common;
                last_device = child;
            } else if n.host.is_some() {
                on_device = false;
            } else {
                break;
            }
            pos += common;
            node = child;
            if common < n.key.len() {
                break;
            }
        }
        TreeMatch {
            device_len,
            host_len: pos - device_len,
            last_device: self.id_of(last_device),
            last_node: self.id_of(node),
        }
    }

    /// Splits `child` so that its first `at` tokens become a new parent node; returns the new
    /// node. The child keeps its id, so outstanding receipts anchored at it stay valid.
    fn split(&mut self, child: u32, at: usize) -> u32 {
        let p = self.page_size;
        debug_assert!(at > 0 && at.is_multiple_of(p) && at < self.nodes[child as usize].key.len());
        let pages_at = at / p;
        let c = &mut self.nodes[child as usize];
        let tail_key = c.key.split_off(at);
        let head_key = std::mem::replace(&mut c.key, tail_key);
        let head_pages = if c.pages.is_empty() {
            Vec::new()
        } else {
            let tail = c.pages.split_off(pages_at);
            std::mem::replace(&mut c.pages, tail)
        };
        let head_host = c.host.as_mut().map(|h| {
            let tail = h.split_off(pages_at);
            std::mem::replace(h, tail)
        });
        let head_hashes = if c.page_hashes.is_empty() {
            Vec::new()
        } else {
            let tail = c.page_hashes.split_off(pages_at);
            std::mem::replace(&mut c.page_hashes, tail)
        };
        let parent = c.parent;
        let mid_node = Node {
            parent,
            key: head_key,
            pages: head_pages,
            host: head_host,
            children: Children::default(),
            child_hash: c.child_hash,
            namespace: c.namespace.clone(),
            lock_ref: c.lock_ref,
            device_children: u32::from(c.on_device()),
            meta: c.meta,
            leaf: None,
            page_hashes: head_hashes,
        };
        let mid = self.alloc_node(mid_node);
        self.replace_child(parent, child, mid);
        let new_hash = self.child_hash(
            mid,
            &Namespace::DEFAULT,
            &self.nodes[child as usize].key[..p],
        );
        let c = &mut self.nodes[child as usize];
        c.parent = mid;
        c.child_hash = new_hash;
        if let Children::Inline(v) = &mut self.nodes[mid as usize].children {
            v.push(child);
        }
        // The child's leaf status is unchanged (its own state did not change); the new parent
        // may be a leaf only in tiered caches (child not on device).
        self.update_leaf(mid);
        mid
    }

    // ---------------------------------------------------------------------------------------
    // Insert

    /// Inserts `key` (page-aligned, non-empty) with one device page per page in `pages`.
    ///
    /// Where the tree already holds a device page for a position and it differs from
    /// `pages[i]`, the caller's page is a duplicate: it is appended to `replaced` and `pages[i]`
    /// is overwritten with the tree's page, so on return `pages` is the canonical page list of
    /// the key. Every other page of `pages` is adopted by the tree (the caller must mark it
    /// tree-owned). Nodes that exist only on the host tier adopt the caller's pages.
    ///
    /// # Errors
    /// [`CacheError::EmptyKey`], [`CacheError::Misaligned`], [`CacheError::LengthMismatch`];
    /// the tree is unchanged then.
    pub fn insert(
        &mut self,
        key: KeyRef<'_>,
        pages: &mut [PageId],
        replaced: &mut Vec<PageId>,
        opts: InsertOptions,
    ) -> Result<TreeInsert> {
        let p = self.page_size;
        let tokens = key.tokens;
        if tokens.is_empty() {
            return Err(CacheError::EmptyKey);
        }
        if !tokens.len().is_multiple_of(p) {
            return Err(CacheError::Misaligned {
                len: tokens.len(),
                page_size: p,
            });
        }
        if pages.len() * p != tokens.len() {
            return Err(CacheError::LengthMismatch {
                tokens: tokens.len(),
                pages: pages.len(),
                page_size: p,
            });
        }
        self.insert_at(self.root, 0, key, pages, replaced, opts)
    }

    /// Like [`RadixTree::insert`], but starts the walk at `anchor`, which must end exactly at
    /// token `offset` of `key` (a node locked by the request whose key this is: its path is
    /// `key[..offset]` and its pages are already the caller's first `offset / P` pages). The
    /// cached prefix is not compared again, which makes finishing a request cost its new tokens
    /// only; the anchor's ancestors still get their reuse statistics. `prefix_len` counts from
    /// `offset` on top of it.
    ///
    /// # Errors
    /// As [`RadixTree::insert`], plus [`CacheError::StaleNode`] for a dead anchor and
    /// [`CacheError::InvalidRequestState`] when the anchor does not end at `offset`.
    pub fn insert_from(
        &mut self,
        anchor: NodeId,
        offset: usize,
        key: KeyRef<'_>,
        pages: &mut [PageId],
        replaced: &mut Vec<PageId>,
        opts: InsertOptions,
    ) -> Result<TreeInsert> {
        let start = self.resolve(anchor)?;
        let p = self.page_size;
        let tokens = key.tokens;
        if !tokens.len().is_multiple_of(p) || pages.len() * p != tokens.len() {
            return Err(CacheError::LengthMismatch {
                tokens: tokens.len(),
                pages: pages.len(),
                page_size: p,
            });
        }
        if offset > tokens.len() || self.depth_tokens(anchor)? != offset {
            return Err(CacheError::InvalidRequestState(
                "insert anchor does not end at the given offset",
            ));
        }
        if offset == tokens.len() && start == self.root {
            return Err(CacheError::EmptyKey);
        }
        self.insert_at(start, offset, key, pages, replaced, opts)
    }

    fn insert_at(
        &mut self,
        start: u32,
        start_pos: usize,
        key: KeyRef<'_>,
        pages: &mut [PageId],
        replaced: &mut Vec<PageId>,
        opts: InsertOptions,
    ) -> Result<TreeInsert> {
        let p = self.page_size;
        let tokens = key.tokens;
        let now = self.next_tick();
        // The anchor's path was matched before: it only needs its statistics refreshed.
        let mut up = start;
        while up != self.root {
            let n = &mut self.nodes[up as usize];
            if !opts.chunked {
                n.meta.hit_count = n.meta.hit_count.saturating_add(1);
            }
            n.meta.priority = n.meta.priority.max(opts.priority);
            let parent = n.parent;
            self.touch(up, now);
            up = parent;
        }
        let mut node = start;
        let mut pos = start_pos;
        let mut prefix_len = start_pos;
        let mut adopted = 0;
        let mut prefix_done = false;
        while pos < tokens.len() {
            let Some(child) = self.find_child(node, key.namespace, &tokens[pos..pos + p]) else {
                break;
            };
            let common = common_pages(&self.nodes[child as usize].key, &tokens[pos..], p);
            let child = if common < self.nodes[child as usize].key.len() {
                self.split(child, common)
            } else {
                child
            };
            // Update the reuse stats before the touch, so the policy keys the leaf by them.
            {
                let n = &mut self.nodes[child as usize];
                if !opts.chunked {
                    n.meta.hit_count = n.meta.hit_count.saturating_add(1);
                }
                n.meta.priority = n.meta.priority.max(opts.priority);
            }
            self.touch(child, now);
            let seg = &mut pages[pos / p..(pos + common) / p];
            if self.nodes[child as usize].on_device() {
                for (mine, theirs) in seg.iter_mut().zip(&self.nodes[child as usize].pages) {
                    if *mine != *theirs {
                        replaced.push(*mine);
                        *mine = *theirs;
                    }
                }
                if !prefix_done {
                    prefix_len += common;
                }
            } else {
                // Host-only node (tiered caches): take the caller's pages.
                prefix_done = true;
                self.nodes[child as usize].pages = seg.to_vec();
                self.on_device_added(child, common);
                adopted += common;
            }
            pos += common;
            node = child;
        }
        if pos < tokens.len() {
            let leaf = self.new_leaf(
                node,
                key.namespace,
                &tokens[pos..],
                &pages[pos / p..],
                now,
                opts,
            );
            adopted += tokens.len() - pos;
            node = leaf;
        }
        Ok(TreeInsert {
            prefix_len,
            adopted_len: adopted,
            last_node: self.id_of(node),
        })
    }

    fn new_leaf(
        &mut self,
        parent: u32,
        ns: &Namespace,
        tokens: &[TokenId],
        pages: &[PageId],
        now: u64,
        opts: InsertOptions,
    ) -> u32 {
        let p = self.page_size;
        let child_hash = self.child_hash(parent, ns, &tokens[..p]);
        let mut page_hashes = Vec::new();
        if self.events.is_some() {
            let seed = self.nodes[parent as usize]
                .page_hashes
                .last()
                .copied()
                .unwrap_or_else(|| namespace_seed(ns));
            page_hashes.reserve_exact(pages.len());
            chain_hashes(seed, tokens, p, &mut page_hashes);
        }
        let key = self.bufs.tokens(tokens);
        let node_pages = self.bufs.pages(pages);
        let idx = self.alloc_node(Node {
            parent,
            key,
            pages: node_pages,
            host: None,
            children: Children::default(),
            child_hash,
            namespace: ns.clone(),
            lock_ref: 0,
            device_children: 0,
            meta: NodeMeta {
                last_access: now,
                created: now,
                hit_count: 0,
                priority: opts.priority,
            },
            leaf: None,
            page_hashes,
        });
        self.add_child(parent, idx);
        self.on_device_added(idx, tokens.len());
        self.emit_stored(idx, Medium::Device);
        idx
    }

    /// Counter and leaf bookkeeping after node `idx` gained `len` device tokens.
    fn on_device_added(&mut self, idx: u32, len: usize) {
        if self.nodes[idx as usize].lock_ref > 0 {
            self.protected += len;
        } else {
            self.evictable += len;
        }
        let parent = self.nodes[idx as usize].parent;
        self.nodes[parent as usize].device_children += 1;
        self.update_leaf(parent);
        self.update_leaf(idx);
    }

    fn emit_stored(&mut self, idx: u32, medium: Medium) {
        if self.events.is_none() {
            return;
        }
        let n = &self.nodes[idx as usize];
        let parent_hash = self.nodes[n.parent as usize].page_hashes.last().copied();
        let ev = KvEvent::BlockStored {
            page_hashes: n.page_hashes.clone(),
            parent_hash,
            token_ids: n.key.clone(),
            page_size: self.page_size,
            namespace: n.namespace.clone(),
            medium,
        };
        self.push_event(ev);
    }

    // ---------------------------------------------------------------------------------------
    // Locks

    /// Locks the path from the root to `node` against eviction.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`] for a handle to a removed node.
    pub fn inc_lock_ref(&mut self, node: NodeId) -> Result<LockReceipt> {
        let mut i = self.resolve(node)?;
        while i != self.root {
            let n = &mut self.nodes[i as usize];
            if n.lock_ref == 0 && n.on_device() {
                self.evictable -= n.key.len();
                self.protected += n.key.len();
            }
            n.lock_ref += 1;
            let parent = n.parent;
            if self.nodes[i as usize].lock_ref == 1 {
                self.update_leaf(i);
            }
            i = parent;
        }
        self.outstanding_locks += 1;
        Ok(LockReceipt {
            anchor: node,
            tree_id: self.tree_id,
        })
    }

    /// Releases the lock proven by `receipt`.
    ///
    /// # Errors
    /// [`CacheError::StaleReceipt`] for a receipt of another tree or whose anchor is gone;
    /// [`CacheError::LockUnderflow`] if the path does not hold the lock (nothing changes then).
    pub fn dec_lock_ref(&mut self, receipt: LockReceipt) -> Result<()> {
        if receipt.tree_id != self.tree_id {
            return Err(CacheError::StaleReceipt);
        }
        let start = self
            .resolve(receipt.anchor)
            .map_err(|_| CacheError::StaleReceipt)?;
        let mut i = start;
        while i != self.root {
            if self.nodes[i as usize].lock_ref == 0 {
                return Err(CacheError::LockUnderflow(self.id_of(i)));
            }
            i = self.nodes[i as usize].parent;
        }
        let mut i = start;
        while i != self.root {
            let n = &mut self.nodes[i as usize];
            n.lock_ref -= 1;
            let parent = n.parent;
            if n.lock_ref == 0 {
                if n.on_device() {
                    self.protected -= n.key.len();
                    self.evictable += n.key.len();
                }
                self.update_leaf(i);
            }
            i = parent;
        }
        self.outstanding_locks -= 1;
        Ok(())
    }

    // ---------------------------------------------------------------------------------------
    // Eviction

    /// Takes the next victim out of the evictable-leaf set (policy order). The node is still
    /// in the tree: pass it to [`RadixTree::evict_device`].
    pub fn pop_victim(&mut self) -> Option<NodeId> {
        let id = self.policy.pop()?;
        self.nodes[id.index()].leaf = None;
        Some(id)
    }

    /// Releases the device pages of `id` (appended to `out`); returns the tokens released.
    /// A node with a host copy stays in the tree (host only); any other node is removed.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`]; [`CacheError::InvalidRequestState`] when the node is locked,
    /// the root, not on device or has a child on device (nothing changes then).
    pub fn evict_device(&mut self, id: NodeId, out: &mut Vec<PageId>) -> Result<usize> {
        let idx = self.resolve(id)?;
        let n = &self.nodes[idx as usize];
        if idx == self.root || n.lock_ref > 0 || !n.on_device() || n.device_children > 0 {
            return Err(CacheError::InvalidRequestState(
                "only an unlocked device leaf can be evicted",
            ));
        }
        if let Some(tok) = self.nodes[idx as usize].leaf.take() {
            self.policy.remove(id, tok);
        }
        let n = &mut self.nodes[idx as usize];
        let len = n.key.len();
        out.extend_from_slice(&n.pages);
        let pages = std::mem::take(&mut n.pages);
        self.bufs.recycle(Vec::new(), pages);
        self.evictable -= len;
        let parent = n.parent;
        let keep = n.host.is_some();
        if self.events.is_some() {
            let hashes = self.nodes[idx as usize].page_hashes.clone();
            self.push_event(KvEvent::BlockRemoved {
                page_hashes: hashes,
                medium: Medium::Device,
            });
        }
        if !keep {
            debug_assert_eq!(self.nodes[idx as usize].children.len(), 0);
            self.remove_child(parent, idx);
            self.free_node_recycle(idx);
        }
        self.nodes[parent as usize].device_children -= 1;
        self.update_leaf(parent);
        Ok(len)
    }

    /// Evicts leaves in policy order until at least `tokens` device tokens were released or
    /// nothing evictable is left. Released pages are appended to `out`. Returns the tokens
    /// released.
    pub fn evict(&mut self, tokens: usize, out: &mut Vec<PageId>) -> usize {
        let mut done = 0;
        while done < tokens {
            let Some(victim) = self.pop_victim() else {
                break;
            };
            if let Some(n) = self
                .policy
                .peek()
                .and_then(|next| self.nodes.get(next.index()))
            {
                // Victims of a large cache are cold: start loading the next one's node while
                // this one is evicted.
                prefetch(n);
            }
            match self.evict_device(victim, out) {
                Ok(n) => done += n,
                Err(e) => {
                    debug_assert!(false, "policy returned a non-evictable node: {e}");
                    break;
                }
            }
        }
        done
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
        self.push_event(KvEvent::AllCleared);
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

    /// Checks every structural invariant listed in the module docs. `O(nodes)`.
    pub fn check(&self) -> std::result::Result<(), InvariantViolation> {
        let p = self.page_size;
        let root = &self.nodes[self.root as usize];
        ensure_inv!(root.leaf.is_none(), "root is in the evictable-leaf set");
        ensure_inv!(root.lock_ref == 0, "root holds a lock count");
        let (mut evictable, mut protected, mut leaves) = (0, 0, 0);
        for (k, n) in self.nodes.iter() {
            let k = k as u32;
            let (mut child_locks, mut dev_children, mut count) = (0u64, 0u32, 0usize);
            let mut check_child = |c: u32| -> std::result::Result<(), InvariantViolation> {
                let cn = self.nodes.get(c as usize);
                ensure_inv!(
                    cn.is_some_and(|cn| cn.parent == k),
                    "child {c} of {k} has another parent"
                );
                let cn = &self.nodes[c as usize];
                child_locks += u64::from(cn.lock_ref);
                dev_children += u32::from(cn.on_device());
                count += 1;
                let h = self.child_hash(k, &cn.namespace, &cn.key[..p]);
                ensure_inv!(h == cn.child_hash, "child {c} has a stale first-page hash");
                Ok(())
            };
            match &n.children {
                Children::Inline(v) => {
                    for &c in v {
                        check_child(c)?;
                    }
                }
                Children::Table(t) => {
                    for slot in t.live_entries(|i, g| self.is_live(i, g)) {
                        if self.nodes[slot.idx as usize].parent != k {
                            continue; // slot reused by a node elsewhere: stale
                        }
                        ensure_inv!(
                            self.nodes[slot.idx as usize].child_hash == slot.hash,
                            "child {} filed under a foreign hash",
                            slot.idx
                        );
                        check_child(slot.idx)?;
                    }
                    ensure_inv!(
                        count == n.children.len(),
                        "node {k}: child table count {} != {count}",
                        n.children.len()
                    );
                }
            }
            ensure_inv!(
                dev_children == n.device_children,
                "node {k}: device_children {} != {dev_children}",
                n.device_children
            );
            if k == self.root {
                continue;
            }
            ensure_inv!(
                u64::from(n.lock_ref) >= child_locks,
                "node {k}: lock_ref {} < children's {child_locks}",
                n.lock_ref
            );
            ensure_inv!(
                !n.key.is_empty() && n.key.len().is_multiple_of(p),
                "node {k}: key length {} not page-aligned",
                n.key.len()
            );
            ensure_inv!(
                n.pages.is_empty() || n.pages.len() * p == n.key.len(),
                "node {k}: {} pages for {} tokens",
                n.pages.len(),
                n.key.len()
            );
            ensure_inv!(
                n.host.as_ref().is_none_or(|h| h.len() * p == n.key.len()),
                "node {k}: host pages do not cover the key"
            );
            ensure_inv!(
                n.on_device() || n.host.is_some(),
                "node {k} has neither device nor host KV"
            );
            let parent = &self.nodes[n.parent as usize];
            ensure_inv!(
                !n.on_device() || n.parent == self.root || parent.on_device(),
                "node {k} on device under an evicted parent"
            );
            ensure_inv!(
                n.host.is_none() || n.parent == self.root || parent.host.is_some(),
                "node {k} backed up under a parent that is not"
            );
            if n.parent != self.root {
                ensure_inv!(
                    n.namespace == parent.namespace,
                    "node {k} crosses namespaces"
                );
            }
            if n.on_device() {
                if n.lock_ref > 0 {
                    protected += n.key.len();
                } else {
                    evictable += n.key.len();
                }
            }
            ensure_inv!(
                n.leaf.is_some() == self.is_evictable_leaf(k),
                "node {k}: leaf-set membership {} disagrees with its state",
                n.leaf.is_some()
            );
            leaves += usize::from(n.leaf.is_some());
        }
        ensure_inv!(
            evictable == self.evictable,
            "evictable counter {} != {evictable}",
            self.evictable
        );
        ensure_inv!(
            protected == self.protected,
            "protected counter {} != {protected}",
            self.protected
        );
        ensure_inv!(
            leaves == self.policy.len(),
            "policy holds {} leaves, tree has {leaves}",
            self.policy.len()
        );
        Ok(())
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

mod children;
#[cfg(test)]
mod tests;
pub(crate) mod tier;
