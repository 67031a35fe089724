//! The sliding-window (SWA) component of the tree: per-node window KV in a second paged pool,
//! its own lock counts, its own eviction order and its tombstones.
//!
//! A sliding-window attention layer only looks at the last `window` tokens, so a cached prefix
//! is usable up to a position `L` only when the window KV of the tokens `[L - window, L)` is
//! still there (all of it, or all of `[0, L)` when `L < window`). The full-attention KV of the
//! same tokens is needed everywhere. So a node's window KV may be dropped (a *tombstone*) while
//! its full KV stays, for a node deep enough under a later match end; a match is cut back to
//! the deepest node boundary that has a full window of live window KV before it; an insert
//! carrying window pages for a tombstoned node revives it; and dropping a node's full KV always
//! drops its window KV (the cascade).
//!
//! Window KV has the same page size as the full KV and one page per page of the node's key; it
//! lives in its own [`PageAllocator`], owned by the component (requests allocate from it with
//! [`RadixTree::alloc_swa_pages`] and hand their pages over at insert). Like the Mamba
//! component it lives beside the nodes, indexed by arena index: a KV-only tree keeps its node
//! layout and pays one branch on a `None` where a node is split or leaves the device.
//!
//! Locks: [`RadixTree::inc_lock_ref_swa`] locks the window KV of the nodes that the window
//! before the anchor's end touches (walking up until `window` tokens are covered). The top
//! node of that walk carries a *mark*, and the receipt records the mark, so the release stops
//! at the same node even after a split (a split moves the mark to the new upper node, which
//! inherits the lock count: the lock then covers a little more, never less).

use std::collections::BTreeSet;

use super::*;
use crate::alloc::{PageAllocator, PageState};
use crate::types::ComponentAccounting;

/// Per-node window data, indexed by the node's arena index. `pages` empty: a tombstone (or a
/// node that never had window KV). `host` empty: no host copy of the window KV (a host
/// tombstone; tiered caches, see `swa_tier`).
#[derive(Clone, Debug, Default)]
pub(super) struct SwaNode {
    pub(super) pages: Vec<PageId>,
    /// Host pages (indices of the owner's host SWA pool) holding a copy of the window KV, one
    /// per page of the node's key.
    pub(super) host: Vec<u32>,
    /// Receipts (and pins, see `swa_tier`) that locked this node's window KV.
    pub(super) lock: u32,
    /// The component's recency tick (the LRU key while unlocked and live).
    pub(super) tick: u64,
    /// The generation of the node that got the pages, device or host (the audit catches pages
    /// left behind on a reused arena index).
    pub(super) generation: u32,
    /// Non-zero when this node is the top of the SWA locks of one or more receipts.
    pub(super) mark: u64,
}

impl SwaNode {
    pub(super) fn live(&self) -> bool {
        !self.pages.is_empty()
    }
}

/// The sliding-window component of a [`RadixTree`] (see the module docs).
#[derive(Debug)]
pub(crate) struct SwaComponent {
    pub(super) pool: PageAllocator,
    pub(super) window: usize,
    pub(super) nodes: Vec<SwaNode>,
    /// Unlocked live window KV by (tick, node index): the eviction order.
    pub(super) lru: BTreeSet<(u64, u32)>,
    /// Tree-held window pages of unlocked / locked nodes.
    pub(super) evictable: usize,
    pub(super) protected: usize,
    clock: u64,
    next_mark: u64,
}

impl SwaComponent {
    pub(super) fn get(&self, idx: u32) -> Option<&SwaNode> {
        self.nodes.get(idx as usize)
    }

    pub(super) fn live(&self, idx: u32) -> bool {
        self.get(idx).is_some_and(SwaNode::live)
    }

    pub(super) fn entry(&mut self, idx: u32) -> &mut SwaNode {
        if idx as usize >= self.nodes.len() {
            self.nodes.resize_with(idx as usize + 1, SwaNode::default);
        }
        &mut self.nodes[idx as usize]
    }

    pub(super) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn touch(&mut self, idx: u32) {
        let now = self.tick();
        let e = self.entry(idx);
        if !e.live() {
            return;
        }
        let old = std::mem::replace(&mut e.tick, now);
        if e.lock == 0 {
            self.lru.remove(&(old, idx));
            self.lru.insert((now, idx));
        }
    }

    /// Tombstones node `idx` (unlocked): frees its window pages; the entry keeps the node's
    /// generation, so a later insert can tell a revival. Returns the pages freed.
    fn tombstone(&mut self, idx: u32) -> usize {
        let Some(e) = self.nodes.get_mut(idx as usize) else {
            return 0;
        };
        if !e.live() {
            return 0;
        }
        debug_assert_eq!(e.lock, 0, "dropping locked window KV");
        let pages = std::mem::take(&mut e.pages);
        e.mark = 0;
        let tick = e.tick;
        self.lru.remove(&(tick, idx));
        self.evictable -= pages.len();
        self.pool.free_tree_pages(&pages);
        pages.len()
    }

    /// Drops the window KV of node `idx` (unlocked), freeing its pages, and forgets the node's
    /// entry (its full KV leaves the device) except a host copy of the window KV, which stays
    /// with the node's generation (the node stays host-only). Returns the pages freed.
    pub(super) fn drop_pages(&mut self, idx: u32) -> usize {
        let n = self.tombstone(idx);
        if let Some(e) = self.nodes.get_mut(idx as usize) {
            let host = std::mem::take(&mut e.host);
            let generation = e.generation;
            *e = SwaNode::default();
            if !host.is_empty() {
                e.host = host;
                e.generation = generation;
            }
        }
        n
    }

    /// A split of node `child` at page `pages_at`: the new upper node `mid` gets the first
    /// pages, the lock count and the lock mark (see the module docs).
    pub(super) fn split(&mut self, child: u32, mid: u32, pages_at: usize, generation: u32) {
        let Some(c) = self.nodes.get_mut(child as usize) else {
            return;
        };
        let head = if c.live() {
            let tail = c.pages.split_off(pages_at);
            std::mem::replace(&mut c.pages, tail)
        } else {
            Vec::new()
        };
        // A host copy divides like the device pages.
        let host_head = if c.host.is_empty() {
            Vec::new()
        } else {
            let tail = c.host.split_off(pages_at);
            std::mem::replace(&mut c.host, tail)
        };
        let (lock, tick) = (c.lock, c.tick);
        let mark = std::mem::take(&mut c.mark);
        let live = !head.is_empty();
        let m = self.entry(mid);
        debug_assert!(!m.live() && m.lock == 0, "a fresh node with window KV");
        *m = SwaNode {
            pages: head,
            host: host_head,
            lock,
            tick,
            generation,
            mark,
        };
        if live && lock == 0 {
            self.lru.insert((tick, mid));
        }
    }

    /// Frees every tree-held window page and forgets every host copy (a reset: no lock is
    /// outstanding; the owner resets its host pool).
    pub(super) fn clear_tree_pages(&mut self) {
        for i in 0..self.nodes.len() as u32 {
            self.drop_pages(i);
        }
        self.nodes.clear();
        self.lru.clear();
        self.protected = 0;
    }
}

/// Result of [`RadixTree::match_swa`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwaMatch {
    /// The KV match as [`RadixTree::match_prefix`] found it (`kv.device_len`: how far the full
    /// KV went).
    pub kv: TreeMatch,
    /// Leading tokens the request may reuse: the deepest node boundary on the device path with
    /// a full window of live window KV before it (0 when none). The full-KV pages appended to
    /// `out` cover exactly this prefix.
    pub usable_len: usize,
    /// The node that ends `usable_len` (the root when 0): the lock anchor.
    pub anchor: NodeId,
}

/// What [`RadixTree::insert_swa`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwaInsert {
    /// The full-KV insert.
    pub kv: TreeInsert,
    /// Window pages the tree adopted (new nodes and revived tombstones).
    pub adopted_pages: usize,
    /// Tombstoned nodes that got their window KV back.
    pub revived_nodes: usize,
    /// Caller pages that duplicated live window KV of the tree and were freed.
    pub freed_duplicates: usize,
}

impl RadixTree {
    /// Adds the sliding-window component: a window of `window` tokens and an SWA pool of
    /// `pages` pages (of the tree's page size). Only an empty tree can gain it.
    ///
    /// # Errors
    /// [`CacheError::Config`] for a window of 0, a pool size outside `1..=u32::MAX`, a tree
    /// that already has the component, or one that holds nodes.
    pub fn enable_swa(&mut self, window: usize, pages: usize) -> Result<()> {
        self.check_can_add_component("SWA", self.swa.is_some())?;
        if window == 0 {
            return Err(CacheError::Config(
                "the sliding window must be at least one token".into(),
            ));
        }
        self.swa = Some(Box::new(SwaComponent {
            pool: PageAllocator::new(pages)?,
            window,
            nodes: Vec::new(),
            lru: BTreeSet::new(),
            evictable: 0,
            protected: 0,
            clock: 0,
            next_mark: 1,
        }));
        Ok(())
    }

    /// True when the tree has the sliding-window component.
    pub fn swa_enabled(&self) -> bool {
        self.swa.is_some()
    }

    pub(super) fn swa_ref(&self) -> Result<&SwaComponent> {
        self.swa
            .as_deref()
            .ok_or(CacheError::ComponentDisabled("swa"))
    }

    pub(super) fn swa_mut(&mut self) -> Result<&mut SwaComponent> {
        self.swa
            .as_deref_mut()
            .ok_or(CacheError::ComponentDisabled("swa"))
    }

    /// The sliding window in tokens.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`] without the component.
    pub fn swa_window(&self) -> Result<usize> {
        Ok(self.swa_ref()?.window)
    }

    /// The SWA page pool.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`] without the component.
    pub fn swa_pool(&self) -> Result<&PageAllocator> {
        Ok(&self.swa_ref()?.pool)
    }

    /// Where every SWA page is.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`] without the component.
    pub fn swa_accounting(&self) -> Result<ComponentAccounting> {
        let w = self.swa_ref()?;
        Ok(ComponentAccounting {
            total: w.pool.total(),
            free: w.pool.available(),
            evictable: w.evictable,
            protected: w.protected,
            request_owned: w.pool.owned_pages(),
        })
    }

    /// The window pages of node `id` (`None`: a tombstone, or a node that never had any).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`].
    pub fn swa_pages(&self, id: NodeId) -> Result<Option<&[PageId]>> {
        let idx = self.resolve(id)?;
        Ok(self
            .swa_ref()?
            .get(idx)
            .filter(|e| e.live())
            .map(|e| e.pages.as_slice()))
    }

    /// The SWA lock count of node `id`.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`].
    pub fn swa_lock_ref(&self, id: NodeId) -> Result<u32> {
        let idx = self.resolve(id)?;
        Ok(self.swa_ref()?.get(idx).map_or(0, |e| e.lock))
    }

    /// Longest prefix of `key` whose full KV is on device **and** that has a full window of
    /// live window KV before its end: the KV match of [`RadixTree::match_prefix`] cut back to
    /// the deepest such node boundary. With the Mamba component too, the boundary must also
    /// carry a Mamba state (both validators pass there). Appends the full-KV pages of the
    /// usable prefix only to `out`. Refreshes the recency of the window KV the match needs
    /// (and of the state). Takes no lock.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`] without the component (nothing changes then).
    pub fn match_swa(&mut self, key: KeyRef<'_>, out: &mut Vec<PageId>) -> Result<SwaMatch> {
        self.swa_ref()?;
        let start = out.len();
        let kv = self.match_prefix(key, out);
        let path = self.path_from_root(self.resolve(kv.last_device)?);
        let (mut best, mut anchor) = (0, self.root);
        {
            let w = self.swa_ref()?;
            let m = self.mamba.as_deref();
            let (mut depth, mut run) = (0usize, 0usize);
            for &i in &path {
                let len = self.nodes[i as usize].key.len();
                depth += len;
                run = if w.live(i) { run + len } else { 0 };
                let window_ok = run >= w.window || run == depth;
                if window_ok && m.is_none_or(|m| m.has_state(i)) {
                    (best, anchor) = (depth, i);
                }
            }
        }
        out.truncate(start + best / self.page_size);
        self.swa_window_walk(anchor, |w, i| w.touch(i));
        if anchor != self.root
            && let Some(m) = self.mamba.as_deref_mut()
        {
            m.touch(anchor);
        }
        Ok(SwaMatch {
            kv,
            usable_len: best,
            anchor: self.id_of(anchor),
        })
    }

    /// The nodes from below the root down to `idx` (empty for the root).
    pub(super) fn path_from_root(&self, idx: u32) -> Vec<u32> {
        let mut path = Vec::new();
        let mut i = idx;
        while i != self.root {
            path.push(i);
            i = self.nodes[i as usize].parent;
        }
        path.reverse();
        path
    }

    /// Calls `f` on each node that the window before the end of `idx` touches, bottom-up;
    /// returns the top one (`None` when the walk reached the root first).
    fn swa_window_walk(
        &mut self,
        idx: u32,
        mut f: impl FnMut(&mut SwaComponent, u32),
    ) -> Option<u32> {
        let root = self.root;
        let w = self.swa.as_deref_mut()?;
        let mut i = idx;
        let mut covered = 0;
        while i != root {
            f(w, i);
            covered += self.nodes[i as usize].key.len();
            if covered >= w.window {
                return Some(i);
            }
            i = self.nodes[i as usize].parent;
        }
        None
    }

    /// Locks the root path of `node` like [`RadixTree::inc_lock_ref`] **and** the window KV
    /// before the node's end, so that neither can be evicted until the receipt is handed back
    /// to [`RadixTree::dec_lock_ref`]. The node the window starts inside is split at the
    /// window's start first (`node` keeps its id), so that only the window's pages are locked
    /// and the window KV before it stays evictable.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`];
    /// [`CacheError::InvalidRequestState`] when part of that window is a tombstone (the node
    /// is not a usable match end). Nothing changes on error.
    pub fn inc_lock_ref_swa(&mut self, node: NodeId) -> Result<LockReceipt> {
        let idx = self.resolve(node)?;
        self.swa_ref()?;
        let mut all_live = true;
        self.swa_window_walk(idx, |w, i| all_live &= w.live(i));
        if !all_live {
            return Err(CacheError::InvalidRequestState(
                "the window before the node holds a tombstone",
            ));
        }
        // Nodes split at page boundaries only: with a window that is a page multiple (as
        // `RadixCache` requires) the window's start is one.
        let window = self.swa_ref()?.window;
        let (mut i, mut covered) = (idx, 0);
        while i != self.root {
            let len = self.nodes[i as usize].key.len();
            if covered + len > window {
                let at = len - (window - covered);
                if at.is_multiple_of(self.page_size) {
                    self.split(i, at);
                }
                break;
            }
            covered += len;
            if covered >= window {
                break;
            }
            i = self.nodes[i as usize].parent;
        }
        let mut receipt = self.inc_lock_ref(node)?;
        let top = self.swa_window_walk(idx, |w, i| {
            let e = w.entry(i);
            e.lock += 1;
            if e.lock == 1 {
                let (t, n) = (e.tick, e.pages.len());
                w.lru.remove(&(t, i));
                w.evictable -= n;
                w.protected += n;
            }
        });
        let mark = match (top, self.swa.as_deref_mut()) {
            (Some(t), Some(w)) => {
                if w.entry(t).mark == 0 {
                    let m = w.next_mark;
                    w.next_mark += 1;
                    w.entry(t).mark = m;
                }
                w.entry(t).mark
            }
            _ => 0,
        };
        receipt.swa = Some(mark);
        Ok(receipt)
    }

    /// Checks that the SWA locks of a receipt (anchored at `start`, top `mark`) are held.
    pub(super) fn swa_check_unlock(&self, start: u32, mark: u64) -> Result<()> {
        let Some(w) = self.swa.as_deref() else {
            return Err(CacheError::StaleReceipt);
        };
        let mut i = start;
        while i != self.root {
            let e = w.get(i);
            if e.is_none_or(|e| e.lock == 0) {
                return Err(CacheError::LockUnderflow(self.id_of(i)));
            }
            if mark != 0 && e.is_some_and(|e| e.mark == mark) {
                return Ok(());
            }
            i = self.nodes[i as usize].parent;
        }
        if mark == 0 {
            Ok(())
        } else {
            Err(CacheError::LockUnderflow(self.id_of(start)))
        }
    }

    /// Releases the SWA locks of a receipt (validated by [`RadixTree::swa_check_unlock`]).
    pub(super) fn swa_unlock(&mut self, start: u32, mark: u64) {
        let root = self.root;
        let Some(w) = self.swa.as_deref_mut() else {
            return;
        };
        let mut i = start;
        while i != root {
            let e = w.entry(i);
            e.lock -= 1;
            let top = mark != 0 && e.mark == mark;
            if e.lock == 0 {
                e.mark = 0;
                let (t, n) = (e.tick, e.pages.len());
                w.lru.insert((t, i));
                w.protected -= n;
                w.evictable += n;
            }
            if top {
                break;
            }
            i = self.nodes[i as usize].parent;
        }
    }

    /// Appends `n` fresh SWA pages (a request's window KV) to `out`, evicting unlocked window
    /// KV (least recently used first; the nodes keep their full KV) when too few are free.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`]; [`CacheError::OutOfPages`] when free plus evictable
    /// pages are fewer than `n` (nothing is evicted then).
    pub fn alloc_swa_pages(&mut self, n: usize, out: &mut Vec<PageId>) -> Result<()> {
        let w = self.swa_mut()?;
        let free = w.pool.available();
        if n > free + w.evictable {
            return Err(CacheError::OutOfPages {
                needed: n,
                available: free + w.evictable,
            });
        }
        if n > free {
            self.evict_swa(n - free);
        }
        self.swa_mut()?.pool.alloc_into(n, out)
    }

    /// Returns a request's SWA pages to the pool (abort, or window KV that slid out).
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`]; [`CacheError::PageOutOfRange`] or
    /// [`CacheError::PageState`] for a page no caller holds (nothing is freed then).
    pub fn free_swa_pages(&mut self, pages: &[PageId]) -> Result<()> {
        self.swa_mut()?.pool.free(pages)
    }

    /// Tombstones unlocked window KV, least recently used first, until at least `pages` pages
    /// were freed or none is left. The nodes keep their full KV. Returns the pages freed; 0
    /// without the component.
    pub fn evict_swa(&mut self, pages: usize) -> usize {
        let Some(w) = self.swa.as_deref_mut() else {
            return 0;
        };
        let mut done = 0;
        while done < pages {
            let Some(&(_, idx)) = w.lru.first() else {
                break;
            };
            done += w.tombstone(idx);
            // The cascade on a node: SWA before Mamba, so its unlocked state goes too.
            if let Some(m) = self.mamba.as_deref_mut() {
                m.drop_unlocked_state(idx);
            }
        }
        self.apply_leaf_classes();
        done
    }

    /// Tombstones the window KV of `node` only (its full KV stays). Returns the pages freed.
    ///
    /// # Errors
    /// [`CacheError::ComponentDisabled`], [`CacheError::StaleNode`];
    /// [`CacheError::InvalidRequestState`] when the node has no window KV or it is locked.
    pub fn evict_swa_node(&mut self, node: NodeId) -> Result<usize> {
        let idx = self.resolve(node)?;
        let w = self.swa_mut()?;
        if !w.get(idx).is_some_and(|e| e.live() && e.lock == 0) {
            return Err(CacheError::InvalidRequestState(
                "only unlocked live window KV can be tombstoned",
            ));
        }
        let n = w.tombstone(idx);
        // The cascade on a node: SWA before Mamba, so its unlocked state goes too.
        if let Some(m) = self.mamba.as_deref_mut() {
            m.drop_unlocked_state(idx);
        }
        self.apply_leaf_classes();
        Ok(n)
    }

    /// Inserts `key` like [`RadixTree::insert`] (same `pages` / `replaced` contract for the
    /// full KV) together with its window KV: `swa_pages` holds one SWA page per page of the key.
    /// Each of them is either a page the caller allocated ([`RadixTree::alloc_swa_pages`]) or
    /// the tree's own window page at that position (a matched prefix). Where a node of the key
    /// has no window KV (a new node, or a tombstone, which is thereby *revived*) the tree adopts
    /// the caller's pages; where it has live window KV, a caller page that differs is a
    /// duplicate and is freed. Either way the caller holds none of `swa_pages` afterwards.
    ///
    /// # Errors
    /// See [`RadixTree::insert_swa_from`] (with `swa_from` 0).
    pub fn insert_swa(
        &mut self,
        key: KeyRef<'_>,
        pages: &mut [PageId],
        swa_pages: &[PageId],
        replaced: &mut Vec<PageId>,
        opts: InsertOptions,
    ) -> Result<SwaInsert> {
        self.insert_swa_from(key, pages, 0, swa_pages, replaced, opts)
    }

    /// Like [`RadixTree::insert_swa`] for a request whose window KV before token `swa_from`
    /// (page-aligned) slid out during decode and was freed: `swa_pages` covers
    /// `key[swa_from..]` only. Nodes before `swa_from` keep their window KV if they have it and
    /// stay (or are created as) tombstones otherwise; a node without window KV that straddles
    /// `swa_from` is split there, so that its lower part can take the caller's pages.
    ///
    /// # Errors
    /// Those of [`RadixTree::insert`]; [`CacheError::ComponentDisabled`];
    /// [`CacheError::Misaligned`] for an unaligned `swa_from`;
    /// [`CacheError::InvalidRequestState`] for `swa_from` past the key;
    /// [`CacheError::LengthMismatch`] when `swa_pages` does not hold one page per page of
    /// `key[swa_from..]`; [`CacheError::PageOutOfRange`] / [`CacheError::PageState`] for an SWA
    /// page that is free, listed twice, or tree-held at another position. Nothing changes on
    /// error.
    pub fn insert_swa_from(
        &mut self,
        key: KeyRef<'_>,
        pages: &mut [PageId],
        swa_from: usize,
        swa_pages: &[PageId],
        replaced: &mut Vec<PageId>,
        opts: InsertOptions,
    ) -> Result<SwaInsert> {
        self.swa_ref()?;
        if key.tokens.is_empty() {
            return Err(CacheError::EmptyKey);
        }
        self.check_key_pages(key.tokens, pages)?;
        let p = self.page_size;
        if !swa_from.is_multiple_of(p) {
            return Err(CacheError::Misaligned {
                len: swa_from,
                page_size: p,
            });
        }
        if swa_from > key.tokens.len() {
            return Err(CacheError::InvalidRequestState(
                "the window KV starts past the end of the key",
            ));
        }
        if swa_pages.len() != pages.len() - swa_from / p {
            return Err(CacheError::LengthMismatch {
                tokens: key.tokens.len() - swa_from,
                pages: swa_pages.len(),
                page_size: p,
            });
        }
        self.check_swa_insert(key, swa_from, swa_pages)?;
        let kv = self.insert(key, pages, replaced, opts)?;
        let path = self.path_from_root(self.resolve(kv.last_node)?);
        let mut res = SwaInsert {
            kv,
            adopted_pages: 0,
            revived_nodes: 0,
            freed_duplicates: 0,
        };
        let mut pos = 0;
        for &i in &path {
            let len = self.nodes[i as usize].key.len();
            let end = pos + len;
            if end <= swa_from {
                // Before the window KV the caller has: keep whatever the node has.
                pos = end;
                continue;
            }
            let live = self.swa.as_deref().is_some_and(|w| w.live(i));
            if pos < swa_from && !live {
                // The upper part (before `swa_from`) stays a tombstone.
                self.split(i, swa_from - pos);
                pos = swa_from;
            }
            let generation = self.generations[i as usize];
            // A live node may straddle `swa_from`: its pages before it are not the caller's.
            let from = pos.max(swa_from);
            let seg = &swa_pages[(from - swa_from) / p..(end - swa_from) / p];
            let skip = (from - pos) / p;
            pos = end;
            let Some(w) = self.swa.as_deref_mut() else {
                break;
            };
            let now = w.tick();
            let e = w.entry(i);
            if e.live() {
                let theirs = &e.pages[skip..];
                let dups = seg
                    .iter()
                    .zip(theirs)
                    .filter(|(m, t)| m != t)
                    .map(|(&m, _)| m);
                let dups: Vec<PageId> = dups.collect();
                // Validated: caller-owned pages, each listed once.
                let freed = w.pool.free(&dups);
                debug_assert!(freed.is_ok(), "{freed:?}");
                res.freed_duplicates += dups.len();
                w.touch(i);
                continue;
            }
            let revived = e.generation == generation && e.tick != 0;
            debug_assert_eq!(e.lock, 0, "locked window KV on a tombstone");
            let adopted = w.pool.adopt_into_tree(seg);
            debug_assert!(adopted.is_ok(), "{adopted:?}");
            let e = w.entry(i);
            e.pages = seg.to_vec();
            e.generation = generation;
            e.tick = now;
            e.lock = 0;
            w.lru.insert((now, i));
            w.evictable += seg.len();
            res.adopted_pages += seg.len();
            res.revived_nodes += usize::from(revived);
        }
        Ok(res)
    }

    /// Releases the SWA locks a receipt holds, keeping its KV locks: once a request has decoded
    /// a full window past its cached prefix, it no longer reads that window KV. Afterwards the
    /// receipt is a plain KV receipt.
    ///
    /// # Errors
    /// [`CacheError::StaleReceipt`] for a receipt of another tree, whose anchor is gone, or that
    /// holds no SWA lock; [`CacheError::LockUnderflow`] when its locks are not held (nothing
    /// changes on error).
    pub fn release_swa_lock(&mut self, receipt: &mut LockReceipt) -> Result<()> {
        let Some(mark) = receipt.swa else {
            return Err(CacheError::StaleReceipt);
        };
        if receipt.tree_id != self.tree_id {
            return Err(CacheError::StaleReceipt);
        }
        let start = self
            .resolve(receipt.anchor)
            .map_err(|_| CacheError::StaleReceipt)?;
        self.swa_check_unlock(start, mark)?;
        self.swa_unlock(start, mark);
        receipt.swa = None;
        Ok(())
    }

    /// Validates the SWA pages of an insert without changing anything: every page is in the
    /// pool, caller-owned pages are listed once, and a tree-held page is the tree's own window
    /// page at that position. `swa_pages` covers `key[swa_from..]`.
    fn check_swa_insert(
        &self,
        key: KeyRef<'_>,
        swa_from: usize,
        swa_pages: &[PageId],
    ) -> Result<()> {
        let w = self.swa_ref()?;
        let p = self.page_size;
        let first = swa_from / p;
        // The tree's window page at each position of the existing path (read-only walk).
        let mut existing: Vec<Option<PageId>> = vec![None; swa_pages.len()];
        let tokens = key.tokens;
        let (mut node, mut pos) = (self.root, 0);
        while pos < tokens.len() {
            let Some(c) = self.find_child(node, key.namespace, &tokens[pos..pos + p]) else {
                break;
            };
            let ck = &self.nodes[c as usize].key;
            let common = common_pages(ck, &tokens[pos..], p);
            if let Some(e) = w.get(c).filter(|e| e.live()) {
                for (j, &pg) in e.pages.iter().take(common / p).enumerate() {
                    if let Some(slot) = (pos / p + j).checked_sub(first) {
                        existing[slot] = Some(pg);
                    }
                }
            }
            pos += common;
            if common < ck.len() {
                break;
            }
            node = c;
        }
        let mut owned = Vec::new();
        for (j, &pg) in swa_pages.iter().enumerate() {
            match w.pool.state(pg)? {
                PageState::Owned => owned.push(pg),
                PageState::Tree if existing[j] == Some(pg) => {}
                _ => {
                    return Err(CacheError::PageState {
                        page: pg,
                        expected: "caller-owned, or the tree's window page at this position",
                    });
                }
            }
        }
        owned.sort_unstable();
        if let Some(d) = owned.windows(2).find(|d| d[0] == d[1]) {
            return Err(CacheError::PageState {
                page: d[0],
                expected: "listed once",
            });
        }
        Ok(())
    }

    /// The SWA part of [`RadixTree::check`].
    pub(super) fn check_swa(&self) -> std::result::Result<(), InvariantViolation> {
        let Some(w) = self.swa.as_deref() else {
            return Ok(());
        };
        self.check_swa_host(w)?;
        let mut seen = vec![false; w.pool.total()];
        let (mut held, mut evictable, mut protected, mut unlocked) = (0usize, 0, 0, 0usize);
        for (i, e) in w.nodes.iter().enumerate() {
            let k = i as u32;
            if !e.live() {
                ensure_inv!(e.lock == 0, "node {k}: SWA lock {} on a tombstone", e.lock);
                continue;
            }
            ensure_inv!(
                k != self.root && self.is_live(k, e.generation),
                "window KV held by a dead node or the root ({k})"
            );
            let n = &self.nodes[i];
            ensure_inv!(n.on_device(), "node {k} holds window KV without full KV");
            ensure_inv!(
                e.pages.len() * self.page_size == n.key.len(),
                "node {k}: {} window pages for {} tokens",
                e.pages.len(),
                n.key.len()
            );
            for &pg in &e.pages {
                ensure_inv!(
                    w.pool.state(pg) == Ok(PageState::Tree),
                    "node {k}: window page {pg:?} is not tree-held"
                );
                ensure_inv!(!seen[pg.index()], "window page {pg:?} held twice");
                seen[pg.index()] = true;
            }
            ensure_inv!(
                e.lock <= n.lock_ref,
                "node {k}: SWA lock {} > KV lock {}",
                e.lock,
                n.lock_ref
            );
            held += e.pages.len();
            if e.lock > 0 {
                protected += e.pages.len();
            } else {
                evictable += e.pages.len();
                unlocked += 1;
                ensure_inv!(
                    w.lru.contains(&(e.tick, k)),
                    "node {k}: unlocked window KV missing from the LRU"
                );
            }
        }
        ensure_inv!(
            held == w.pool.tree_pages(),
            "nodes hold {held} window pages, the pool has {} tree-held",
            w.pool.tree_pages()
        );
        ensure_inv!(
            evictable == w.evictable && protected == w.protected && unlocked == w.lru.len(),
            "SWA counters evictable {} protected {} LRU {} (tree: {evictable}, {protected}, {unlocked})",
            w.evictable,
            w.protected,
            w.lru.len()
        );
        Ok(())
    }
}
