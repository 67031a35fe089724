//! [`RadixCache`]: the device-only prefix cache over a [`RadixTree`] and the device pools.

use crate::RowId;
use crate::alloc::{DevicePools, PageState, RowHolder};
use crate::cache::{
    FinishKind, InsertResult, PrefixCache, RequestKv, RequestMatch, alloc_tokens_kv,
    check_request_kv, refuse_partial_key_finish,
};
use crate::ensure_inv;
use crate::error::{CacheError, InvariantViolation, Result};
use crate::events::{EventBuffer, KvEvent};
use crate::mamba_policy::{MambaAdmission, MambaPolicy, MambaStats};
use crate::page_key::KvIdentity;
use crate::policy::PolicyKind;
use crate::slots::SlotState;
use crate::tree::mamba::MambaCow;
use crate::tree::{InsertOptions, LockReceipt, RadixTree, TreeInsert, TreeMatch};
use crate::types::{ComponentAccounting, KeyRef, NodeId, PageId, align_down};

mod swa;
pub use swa::SwaConfig;

/// Configuration of a [`RadixCache`].
#[derive(Clone, Debug)]
pub struct RadixConfig {
    /// Tokens per page (1 allowed).
    pub page_size: usize,
    /// Pages in the device KV pool.
    pub total_pages: usize,
    /// Rows in the request pool (max concurrently running requests plus held sessions).
    pub max_rows: usize,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Record KV events.
    pub events: bool,
    /// KV events held until [`PrefixCache::take_events`] drains them; past that, new events
    /// are dropped and counted ([`PrefixCache::events_dropped`]), and a consumer must resync
    /// (see [`EventBuffer`](crate::events::EventBuffer)). At least 1; default
    /// [`EventBuffer::DEFAULT_CAPACITY`](crate::events::EventBuffer::DEFAULT_CAPACITY).
    pub event_capacity: usize,
    /// Disabled mode: nothing is shared or cached (a baseline for comparison).
    pub disabled: bool,
    /// Slots of the Mamba state pool (hybrid Transformer–Mamba models; one slot holds the
    /// states of all Mamba layers). `None`: a KV-only tree. With it, matches stop at the
    /// deepest cached state, every running request holds its own slot, and requests leave
    /// states behind as [`RadixConfig::mamba_policy`] says (see the crate docs). A session
    /// layer keeps a streaming session's running slot across turns (`radixkv-session`), and the
    /// host tier (`radixkv-hicache`) backs up and loads states with their KV.
    pub mamba_slots: Option<u32>,
    /// How Mamba states are admitted and evicted ([`crate::mamba_policy`]); default
    /// [`MambaPolicy::Marconi`]. Validated even without Mamba slots.
    pub mamba_policy: MambaPolicy,
    /// Give each running request a tracking slot ([`RequestKv::mamba_track`],
    /// [`MambaTrack`](crate::MambaTrack)) where the policy keeps request-end states, so that a
    /// request whose computed length does not end a page leaves its state at that length
    /// floored to a page. Taken only while another slot stays obtainable (else the request runs
    /// without, counted in [`MambaStats::tracks_skipped`]). `false`: a request-end state is
    /// stored only where the computed length ends a page. Default `true`; without Mamba slots
    /// it has no effect.
    pub mamba_track: bool,
    /// Sliding-window attention layers (Gemma- or GPT-OSS-style models): the window in tokens
    /// and the pages of the second, SWA page pool. `None`: no SWA layers. With it, matches stop
    /// where a full window of live window KV precedes their end, every running request holds
    /// SWA pages beside its full-KV row ([`RequestKv::swa_pages`], freed as they slide out of
    /// the window by [`PrefixCache::slide_window`]), and inserts cache both (see
    /// [`SwaConfig`] and the crate docs). Together with `mamba_slots` the one tree carries
    /// both components: a match ends only where both a Mamba state and a full live window
    /// precede its end, a hit's receipt locks both, and tombstoning a node's window KV evicts
    /// its unlocked Mamba state with it (the cascade). A session layer keeps a streaming
    /// session's window across turns (`radixkv-session`); the host tier does not support it
    /// yet (it refuses it).
    pub swa: Option<SwaConfig>,
    /// KV events also carry each page's storage key ([`crate::PageKey`]), chained from this
    /// model identity and the page's namespace exactly as the storage tier keys pages (see
    /// the [events](crate::events#page-keys) docs). `None` (the default): the 64-bit routing
    /// hashes only. Needs `events`.
    pub event_page_keys: Option<KvIdentity>,
}

impl Default for RadixConfig {
    fn default() -> Self {
        RadixConfig {
            page_size: 16,
            total_pages: 4096,
            max_rows: 256,
            policy: PolicyKind::Lru,
            events: false,
            event_capacity: EventBuffer::DEFAULT_CAPACITY,
            disabled: false,
            mamba_slots: None,
            mamba_policy: MambaPolicy::default(),
            mamba_track: true,
            swa: None,
            event_page_keys: None,
        }
    }
}

/// The device-only prefix cache.
///
/// Owns the tree and the device pools; frees released pages into the allocator at once.
///
/// ```
/// use radixkv_radix::{FinishKind, PrefixCache, RadixCache, RadixConfig, RadixKey, RequestKv};
///
/// let mut cache = RadixCache::new(RadixConfig { page_size: 4, total_pages: 64, ..Default::default() })?;
/// // First request: nothing cached.
/// let mut a = RequestKv::new(RadixKey::new((0..10).collect()));
/// assert_eq!(cache.match_request(&mut a)?.prefix_len, 0);
/// cache.begin_request(&mut a)?;
/// cache.alloc_tokens(&mut a, 10)?;
/// a.commit(10)?;
/// cache.cache_finished_req(&mut a, FinishKind::Finished)?;
/// // Second request sharing the first 8 tokens reuses two pages.
/// let mut b = RequestKv::new(RadixKey::new((0..12).collect()));
/// assert_eq!(cache.match_request(&mut b)?.prefix_len, 8);
/// # cache.check_invariants().unwrap();
/// # Ok::<(), radixkv_radix::CacheError>(())
/// ```
#[derive(Debug)]
pub struct RadixCache {
    tree: RadixTree,
    pools: DevicePools,
    disabled: bool,
    scratch: Vec<PageId>,
    canonical: Vec<PageId>,
    mamba: MambaAdmission,
}

impl RadixCache {
    /// A cache with fresh pools.
    ///
    /// # Errors
    /// [`CacheError::Config`] for a zero page size, pool or row count, or an impossible
    /// [`SwaConfig`] (see there); [`CacheError::PolicyParam`] for a bad
    /// [`RadixConfig::mamba_policy`].
    pub fn new(cfg: RadixConfig) -> Result<Self> {
        swa::check_config(&cfg)?;
        let pools = DevicePools::new(cfg.page_size, cfg.total_pages, cfg.max_rows)?;
        let mamba = MambaAdmission::new(cfg.mamba_policy, cfg.mamba_track)?;
        let mut tree = RadixTree::new(cfg.page_size, cfg.policy, cfg.events)?;
        tree.set_event_capacity(cfg.event_capacity)?;
        tree.set_event_page_keys(cfg.event_page_keys)?;
        if let Some(slots) = cfg.mamba_slots {
            tree.enable_mamba(slots)?;
            tree.set_mamba_policy(&cfg.mamba_policy)?;
        }
        if let Some(w) = cfg.swa {
            tree.enable_swa(w.window, w.pages)?;
        }
        Ok(RadixCache {
            tree,
            pools,
            disabled: cfg.disabled,
            scratch: Vec::new(),
            canonical: Vec::new(),
            mamba,
        })
    }

    /// The tree (read-only).
    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }

    /// The tree and the pools together, for tiered caches that extend this one.
    pub fn parts_mut(&mut self) -> (&mut RadixTree, &mut DevicePools) {
        (&mut self.tree, &mut self.pools)
    }

    /// Debug builds audit every invariant after each mutation of a small cache (the audit is
    /// `O(pool)` in each pool, so large caches are left to explicit `check_invariants` calls).
    #[inline]
    fn debug_audit(&self) {
        #[cfg(debug_assertions)]
        if self.tree.node_count() <= 256
            && self.pools.pages.total() <= 1 << 12
            && self.tree.swa_pool().map_or(true, |w| w.total() <= 1 << 12)
            && let Err(e) = self.check_invariants()
        {
            panic!("radixkv internal invariant violated: {e}");
        }
    }

    /// Where every Mamba slot is (`None` for a KV-only cache).
    pub fn mamba_accounting(&self) -> Option<ComponentAccounting> {
        self.tree.mamba_accounting().ok()
    }

    /// Mamba state counters per checkpoint kind (`None` for a KV-only cache).
    pub fn mamba_stats(&self) -> Option<MambaStats> {
        self.tree.mamba_stats().ok()
    }

    /// The Mamba admission and eviction policy.
    pub fn mamba_policy(&self) -> &MambaPolicy {
        self.mamba.policy()
    }

    /// Audits one request's Mamba slots: a running request of a cache with the Mamba component
    /// holds exactly one running slot, in the request state, one distinct request-held slot
    /// per pending checkpoint, at ascending page-aligned positions past its cached prefix, and
    /// at most one distinct request-held tracking slot, at a page-aligned position no further
    /// than its computed length, and at most [`RequestKv::MAX_MAMBA_SLOTS`] in all (the Mamba part of [`PrefixCache::check_request`], which runs
    /// it).
    ///
    /// # Errors
    /// The first violated invariant.
    pub fn check_request_mamba(
        &self,
        req: &RequestKv,
    ) -> std::result::Result<(), InvariantViolation> {
        let Ok(pool) = self.tree.mamba_pool() else {
            ensure_inv!(
                req.mamba_slot.is_none()
                    && req.mamba_checkpoints.is_empty()
                    && req.mamba_track.is_none(),
                "a KV-only cache's request holds a Mamba slot"
            );
            return Ok(());
        };
        ensure_inv!(
            req.mamba_slot.is_some() == req.row.is_some(),
            "request row {:?} with Mamba slot {:?}",
            req.row,
            req.mamba_slot
        );
        if let Some(slot) = req.mamba_slot {
            ensure_inv!(
                pool.state(slot) == Ok(SlotState::Request),
                "request's Mamba slot {slot} is {:?}",
                pool.state(slot)
            );
        }
        ensure_inv!(
            req.row.is_some() || req.mamba_checkpoints.is_empty(),
            "a request without a row holds Mamba checkpoints"
        );
        ensure_inv!(
            req.mamba_slots_held() <= RequestKv::MAX_MAMBA_SLOTS,
            "the request holds {} Mamba slots, more than {}",
            req.mamba_slots_held(),
            RequestKv::MAX_MAMBA_SLOTS
        );
        let mut last = req.cache_protected_len;
        for (i, c) in req.mamba_checkpoints.iter().enumerate() {
            ensure_inv!(
                c.pos > last && c.pos.is_multiple_of(self.pools.page_size),
                "Mamba checkpoint at {} is not page-aligned, ascending and past {last}",
                c.pos
            );
            last = c.pos;
            ensure_inv!(
                pool.state(c.slot) == Ok(SlotState::Request)
                    && Some(c.slot) != req.mamba_slot
                    && req.mamba_checkpoints[..i].iter().all(|o| o.slot != c.slot),
                "Mamba checkpoint slot {} is {:?} or held twice",
                c.slot,
                pool.state(c.slot)
            );
        }
        if let Some(t) = req.mamba_track {
            ensure_inv!(
                req.row.is_some(),
                "a request without a row holds a Mamba tracking slot"
            );
            ensure_inv!(
                t.pos.is_multiple_of(self.pools.page_size) && t.pos <= req.committed_len,
                "Mamba tracking position {} is not page-aligned or past the computed {}",
                t.pos,
                req.committed_len
            );
            ensure_inv!(
                pool.state(t.slot) == Ok(SlotState::Request)
                    && Some(t.slot) != req.mamba_slot
                    && req.mamba_checkpoints.iter().all(|c| c.slot != t.slot),
                "Mamba tracking slot {} is {:?} or held twice",
                t.slot,
                pool.state(t.slot)
            );
        }
        if let Some(cow) = req.mamba_cow {
            ensure_inv!(
                Some(cow.dst) == req.mamba_slot,
                "copy-on-write destination {} is not the request's slot",
                cow.dst
            );
        }
        Ok(())
    }

    /// Frees every Mamba slot a request holds (running, tracking, checkpoints).
    fn free_request_states(&mut self, req: &mut RequestKv) -> Result<()> {
        if let Some(s) = req.mamba_slot.take() {
            self.tree.free_mamba_slot(s)?;
        }
        if let Some(t) = req.mamba_track.take() {
            self.tree.free_mamba_slot(t.slot)?;
        }
        if !req.mamba_checkpoints.is_empty() {
            MambaAdmission::free_checkpoints(&mut self.tree, req)?;
        }
        Ok(())
    }

    /// The Mamba side of a chunk insert ending at `aligned` (node `last`): the chunk's forward
    /// has run, so a hit's state copy is done (and its source no longer locked), and the
    /// checkpoints it passed are stored; the tracking slot moves to the chunk's end, and the
    /// policy decides whether it becomes the chunk-end state ([`MambaAdmission::after_chunk`]).
    fn chunk_states(&mut self, req: &mut RequestKv, last: NodeId, aligned: usize) -> Result<()> {
        req.mamba_cow = None;
        let pending = req.mamba_checkpoints.len();
        let stored = if pending == 0 {
            Ok(())
        } else {
            self.mamba.store_checkpoints(&mut self.tree, req, aligned)
        };
        if let Some(t) = &mut req.mamba_track {
            t.pos = aligned;
        }
        let taken = req.mamba_checkpoints.len() < pending;
        let chunk_state = self
            .mamba
            .after_chunk(&mut self.tree, req, last, aligned, taken);
        stored.and(chunk_state)
    }

    /// The Mamba part of a finish whose KV insert ended at `end` (`None`: nothing inserted)
    /// after `aligned` tokens. Checkpoints the forward pass passed are stored with the KV; the
    /// others (and all of them on abort) are freed. The running state is the state after the
    /// last computed token, so it is cached (where the policy keeps it) where that token ends
    /// a page (a node boundary); otherwise the tracking slot, which holds the state at the
    /// computed length floored to a page (where `end` ends), is. The other one, and both on
    /// abort, are freed. Every slot is released, errors or not.
    fn finish_request_states(
        &mut self,
        req: &mut RequestKv,
        aligned: usize,
        end: Option<NodeId>,
    ) -> Result<()> {
        let mut result = Ok(());
        if !req.mamba_checkpoints.is_empty() {
            if end.is_some() {
                let stored = self.mamba.store_checkpoints(&mut self.tree, req, aligned);
                result = result.and(stored);
            }
            result = result.and(MambaAdmission::free_checkpoints(&mut self.tree, req));
        }
        // The running state is the state after the last computed token, so it is cached
        // (where the policy keeps it) where that token ends a page (a node boundary);
        // otherwise the tracking slot, which holds the state at the computed length floored to
        // a page (where `end` ends), is. The other one, and both on abort, are freed.
        let mut track = req.mamba_track.take().map(|t| t.slot);
        let at_page = aligned == req.committed_len;
        if !at_page
            && self
                .mamba
                .drops_track_at_finish(aligned, req.cache_protected_len)
            && let Some(t) = track.take()
        {
            result = result.and(self.tree.free_mamba_slot(t));
        }
        match req.mamba_slot.take() {
            Some(slot) => {
                let cached = self
                    .mamba
                    .finish_state(&mut self.tree, slot, track, end, at_page);
                result = result.and(cached);
            }
            None => {
                if let Some(t) = track {
                    result = result.and(self.tree.free_mamba_slot(t));
                }
            }
        }
        result
    }

    /// True in disabled (no sharing) mode.
    pub fn is_disabled(&self) -> bool {
        self.disabled
    }

    /// Inserts with `pages[owned_from..]` owned by the caller and `pages[..owned_from]` already
    /// the tree's. On return `pages` is canonical and the replaced duplicates are in
    /// `self.scratch` (owned again).
    fn insert_owned(
        &mut self,
        key: KeyRef<'_>,
        pages: &mut [PageId],
        owned_from: usize,
        opts: InsertOptions,
    ) -> Result<TreeInsert> {
        self.insert_owned_with(pages, owned_from, |tree, pages, replaced| {
            tree.insert(key, pages, replaced, opts)
        })
    }

    /// Runs a tree insert with `pages[owned_from..]` tentatively tree-owned, and settles page
    /// states after it: replaced duplicates become owned again (in `self.scratch`), and on error
    /// every page returns to its owner.
    fn insert_owned_with(
        &mut self,
        pages: &mut [PageId],
        owned_from: usize,
        insert: impl FnOnce(&mut RadixTree, &mut [PageId], &mut Vec<PageId>) -> Result<TreeInsert>,
    ) -> Result<TreeInsert> {
        self.pools.pages.adopt_into_tree(&pages[owned_from..])?;
        self.scratch.clear();
        match insert(&mut self.tree, pages, &mut self.scratch) {
            Ok(r) => {
                self.pools.pages.release_from_tree(&self.scratch);
                Ok(r)
            }
            Err(e) => {
                self.pools.pages.release_from_tree(&pages[owned_from..]);
                Err(e)
            }
        }
    }

    /// Inserts the first `len` tokens of the request (page-aligned) from its row, frees the
    /// duplicates, and makes the row's first `len / P` pages canonical and protected.
    fn insert_request_prefix(
        &mut self,
        req: &RequestKv,
        len: usize,
        chunked: bool,
    ) -> Result<TreeInsert> {
        let row = req
            .row
            .ok_or(CacheError::InvalidRequestState("request has no row"))?;
        let p = self.pools.page_size;
        let (mut buf, owned_from) = self.take_row_pages(row, len)?;
        let opts = InsertOptions {
            priority: req.priority,
            chunked,
        };
        // The request's lock anchor ends exactly at its tree-owned prefix, whose pages are
        // already canonical: start the walk there instead of comparing the prefix again.
        let anchor = req.lock.as_ref().map(LockReceipt::anchor).filter(|_| {
            req.cache_protected_len <= len && req.cache_protected_len == owned_from * p
        });
        let res = match anchor {
            Some(anchor) => {
                // Only the tokens past the anchor are read: the key holds them from
                // `key_start` on, which is at most the anchor's end (`drop_cached_prefix`
                // drops no further).
                let from = req.cache_protected_len;
                match req.key_tokens(from, len) {
                    Some(tail) => {
                        let tail = KeyRef::with_namespace(tail, &req.key.namespace);
                        let hashes = &req.page_hashes;
                        self.insert_owned_with(&mut buf[..len / p], owned_from, |tree, pages, r| {
                            let pages = &mut pages[from / p..];
                            tree.insert_tail(anchor, from, tail, hashes, pages, r, opts)
                        })
                    }
                    None => Err(CacheError::InvalidRequestState(
                        "the key's tokens start past its lock anchor",
                    )),
                }
            }
            None if req.key_start > 0 => Err(CacheError::InvalidRequestState(
                "a key without its cached prefix needs the lock anchor that ends it",
            )),
            None => self.insert_owned(req.key_prefix(len), &mut buf[..len / p], owned_from, opts),
        };
        self.put_row_pages(row, buf, len, res)
    }

    /// Gives `row` the request's matched pages and room for its whole key (the prompt and
    /// the output room its buffer was given), as `RowPool::start` says.
    fn start_row(&mut self, row: RowId, req: &RequestKv) -> Result<()> {
        // A begun key holds all its tokens (`begin_request` refuses any other).
        let pages = req.key.tokens.capacity().div_ceil(self.pools.page_size);
        self.pools.rows.start(row, &req.prefix_pages, pages)
    }

    /// Takes the row's page table out for an insert of its first `len` tokens, with the index
    /// of its first page the tree does not own yet.
    fn take_row_pages(&mut self, row: RowId, len: usize) -> Result<(Vec<PageId>, usize)> {
        let p = self.pools.page_size;
        let (pages, protected) = self.pools.rows.parts_mut(row)?;
        let owned_from = (*protected).min(len / p);
        Ok((std::mem::take(pages), owned_from))
    }

    /// Puts back the page table [`RadixCache::take_row_pages`] took; when the insert (`res`)
    /// succeeded, the row's first `len / P` pages are canonical and protected, and the
    /// duplicates it replaced (owned by the row, by nobody now) go back to the pool.
    fn put_row_pages<T>(
        &mut self,
        row: RowId,
        buf: Vec<PageId>,
        len: usize,
        res: Result<T>,
    ) -> Result<T> {
        let p = self.pools.page_size;
        let (pages, protected) = self.pools.rows.parts_mut(row)?;
        *pages = buf;
        let r = res?;
        *protected = (*protected).max(len / p);
        let dups = std::mem::take(&mut self.scratch);
        self.pools.pages.free(&dups)?;
        self.scratch = dups;
        Ok(r)
    }
}

impl PrefixCache for RadixCache {
    fn page_size(&self) -> usize {
        self.pools.page_size
    }

    fn page_hasher(&self) -> crate::PageHasher {
        self.tree.page_hasher()
    }

    fn has_state_slots(&self) -> bool {
        self.tree.mamba_enabled() || self.tree.swa_enabled()
    }

    fn has_window_state(&self) -> bool {
        self.tree.swa_enabled()
    }

    fn takes_windowed_keys(&self) -> bool {
        // The Mamba and sliding-window components read the key before the anchor.
        !self.tree.swa_enabled() && !self.tree.mamba_enabled()
    }

    fn restore_key(&self, req: &mut RequestKv) -> Result<()> {
        if req.key_start == 0 {
            return Ok(());
        }
        let anchor =
            req.lock
                .as_ref()
                .map(LockReceipt::anchor)
                .ok_or(CacheError::InvalidRequestState(
                    "a request without a lock lacks its key's prefix",
                ))?;
        let mut tokens = Vec::with_capacity(req.key_len());
        self.tree
            .path_prefix_tokens(anchor, req.key_start, &mut tokens)?;
        debug_assert!(
            {
                // The path past the dropped prefix (up to the anchor) is the key's too.
                let mut path = Vec::new();
                let depth = self.tree.depth_tokens(anchor).unwrap_or(0);
                let _ = self.tree.path_prefix_tokens(anchor, depth, &mut path);
                let held = (depth - req.key_start).min(req.key.tokens.len());
                path[req.key_start..req.key_start + held] == req.key.tokens[..held]
            },
            "the lock anchor's path is not the request's key"
        );
        req.restore_key_prefix(tokens)
    }

    fn sliding_window(&self) -> Option<usize> {
        self.tree.swa_window().ok()
    }

    fn check_request(&self, req: &RequestKv) -> std::result::Result<(), InvariantViolation> {
        check_request_kv(self, req)?;
        self.check_request_mamba(req)?;
        self.check_request_swa(req)
    }

    /// The request audit with the parked receipt standing in for `req.lock` (the SWA part
    /// reads it).
    fn check_parked(
        &self,
        req: &RequestKv,
        lock: Option<&LockReceipt>,
    ) -> std::result::Result<(), InvariantViolation> {
        check_request_kv(self, req)?;
        self.check_request_mamba(req)?;
        self.check_window_table(req, lock.or(req.lock.as_ref()))
    }

    fn truncate_request(&mut self, req: &mut RequestKv, len: usize) -> Result<()> {
        self.truncate_request_swa(req, len)
    }

    fn pools(&self) -> &DevicePools {
        &self.pools
    }

    fn pools_mut(&mut self) -> &mut DevicePools {
        &mut self.pools
    }

    fn match_prefix(&mut self, key: KeyRef<'_>, out: &mut Vec<PageId>) -> Result<TreeMatch> {
        if key.is_empty() {
            return Err(CacheError::EmptyKey);
        }
        if self.disabled {
            let root = self.tree.root();
            return Ok(TreeMatch {
                device_len: 0,
                host_len: 0,
                last_device: root,
                last_node: root,
            });
        }
        self.match_tree(key, out).map(|(m, _)| m)
    }

    fn insert(
        &mut self,
        key: KeyRef<'_>,
        pages: &[PageId],
        opts: InsertOptions,
    ) -> Result<InsertResult> {
        if self.disabled {
            return Err(CacheError::InvalidRequestState("the cache is disabled"));
        }
        // The canonical page list is only needed during the insert: reuse one buffer.
        let mut buf = std::mem::take(&mut self.canonical);
        buf.clear();
        buf.extend_from_slice(pages);
        let r = self.insert_owned(key, &mut buf, 0, opts);
        self.canonical = buf;
        let r = r?;
        self.debug_audit();
        Ok(InsertResult {
            prefix_len: r.prefix_len,
            adopted_len: r.adopted_len,
            // One allocation of the exact size; the scratch buffer keeps its capacity.
            duplicates: self.scratch.clone(),
            last_node: r.last_node,
        })
    }

    fn evict(&mut self, tokens: usize) -> usize {
        self.scratch.clear();
        let n = self.tree.evict(tokens, &mut self.scratch);
        self.pools.pages.free_tree_pages(&self.scratch);
        self.debug_audit();
        n
    }

    fn inc_lock_ref(&mut self, node: NodeId) -> Result<LockReceipt> {
        self.tree.inc_lock_ref(node)
    }

    fn dec_lock_ref(&mut self, receipt: LockReceipt) -> Result<()> {
        self.tree.dec_lock_ref(receipt)
    }

    fn evictable_tokens(&self) -> usize {
        self.tree.evictable_tokens()
    }

    /// A lock moves the path's unlocked device tokens from evictable to protected and
    /// changes nothing else `available_tokens` reads: one read-only walk instead of a lock
    /// and its release (two walks that write every node, and an admission that waits retries
    /// every step). Debug builds check it against the lock.
    fn available_tokens_if_locked(&mut self, node: NodeId) -> Result<usize> {
        let unlocked = self.tree.unlocked_device_tokens_on_path(node)?;
        let available = self.available_tokens() - unlocked;
        #[cfg(debug_assertions)]
        {
            let receipt = self.tree.inc_lock_ref(node)?;
            let locked = self.available_tokens();
            self.tree.dec_lock_ref(receipt)?;
            debug_assert_eq!(available, locked, "the path's unlocked tokens");
        }
        Ok(available)
    }

    fn protected_tokens(&self) -> usize {
        self.tree.protected_tokens()
    }

    fn events_dropped(&self) -> u64 {
        self.tree.events_dropped()
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        self.tree.take_events()
    }

    fn reset(&mut self) -> Result<()> {
        if self.pools.rows.iter().any(|(_, _, _, prot)| prot > 0) {
            return Err(CacheError::Busy("request rows hold cached pages"));
        }
        self.scratch.clear();
        self.tree.reset(&mut self.scratch)?;
        self.pools.pages.free_tree_pages(&self.scratch);
        self.debug_audit();
        Ok(())
    }

    fn check_invariants(&self) -> std::result::Result<(), InvariantViolation> {
        self.tree.check()?;
        let p = self.pools.page_size;
        let pages = &self.pools.pages;
        ensure_inv!(
            self.tree.device_tokens() == pages.tree_pages() * p,
            "tree holds {} device tokens but {} pages are tree-owned",
            self.tree.device_tokens(),
            pages.tree_pages()
        );
        // Every page is in exactly one place.
        let mut seen = crate::alloc::try_filled(pages.total(), 0u8, "the audit's page map")
            .map_err(|e| InvariantViolation(format!("cannot audit the pool: {e}")))?;
        let mut err = None;
        self.tree
            .for_each_device_page(|pg| match seen.get_mut(pg.index()) {
                Some(s) if *s == 0 && pages.state(pg) == Ok(PageState::Tree) => *s = 1,
                _ => {
                    err.get_or_insert(pg);
                }
            });
        ensure_inv!(
            err.is_none(),
            "tree page {err:?} is listed twice or not tree-owned"
        );
        for &pg in pages.free_pages() {
            let s = &mut seen[pg.index()];
            ensure_inv!(
                *s == 0 && pages.state(pg) == Ok(PageState::Free),
                "free page {pg:?} is also elsewhere"
            );
            *s = 2;
        }
        for (row, _, row_pages, prot) in self.pools.rows.iter() {
            ensure_inv!(
                prot <= row_pages.len(),
                "row {row:?}: protected {prot} > {} pages",
                row_pages.len()
            );
            for (i, &pg) in row_pages.iter().enumerate() {
                let st = pages.state(pg);
                if i < prot {
                    ensure_inv!(
                        st == Ok(PageState::Tree),
                        "row {row:?}: protected page {pg:?} is {st:?}"
                    );
                } else {
                    ensure_inv!(
                        st == Ok(PageState::Owned) && seen[pg.index()] == 0,
                        "row {row:?}: owned page {pg:?} is {st:?} or in two rows"
                    );
                    seen[pg.index()] = 3;
                }
            }
        }
        ensure_inv!(
            self.accounting().balanced(),
            "pool accounting does not balance: {:?}",
            self.accounting()
        );
        self.check_swa_pool()
    }

    fn match_request(&mut self, req: &mut RequestKv) -> Result<RequestMatch> {
        if req.row.is_some() || req.lock.is_some() {
            return Err(CacheError::InvalidRequestState(
                "match_request on a request that already holds KV",
            ));
        }
        req.check_whole_key()?;
        req.prefix_pages.clear();
        let limit = align_down(req.max_match_len(), self.pools.page_size);
        // The match appends a page per matched page: room for all of them at once, so that
        // a long cached prefix is not copied again at every doubling.
        req.prefix_pages.reserve(limit / self.pools.page_size);
        let m = if limit == 0 || self.disabled {
            let root = self.tree.root();
            TreeMatch {
                device_len: 0,
                host_len: 0,
                last_device: root,
                last_node: root,
            }
        } else {
            // Field by field (not `key_prefix`): the match below writes other fields of `req`.
            let key = req.key.prefix(limit).with_hashes(&req.page_hashes);
            match req.load_anchor {
                // A request matched again (it waited): its earlier match's deepest node lies
                // on its key (which only grows), so only what lies past it is compared.
                Some(hint) if !self.tree.swa_enabled() && !self.tree.mamba_enabled() => {
                    req.kv_match_len = 0;
                    self.tree
                        .match_prefix_from(hint, key, &mut req.prefix_pages)
                }
                _ => {
                    let (m, kv_len) = self.match_tree(key, &mut req.prefix_pages)?;
                    req.kv_match_len = kv_len;
                    m
                }
            }
        };
        req.prefix_len = m.device_len;
        req.host_hit_len = m.host_len;
        req.last_node = Some(m.last_device);
        req.load_anchor = Some(m.last_node);
        Ok(RequestMatch {
            prefix_len: m.device_len,
            host_hit_len: m.host_len,
            from_session: false,
        })
    }

    fn begin_request(&mut self, req: &mut RequestKv) -> Result<()> {
        req.check_whole_key()?;
        if self.tree.swa_enabled() {
            return self.begin_request_swa(req);
        }
        if req.row.is_some() || req.lock.is_some() {
            return Err(CacheError::InvalidRequestState(
                "begin_request called twice",
            ));
        }
        let mamba = self.tree.mamba_enabled();
        if mamba && req.mamba_slots_held() > 0 {
            return Err(CacheError::InvalidRequestState(
                "begin_request on a request that already holds a Mamba slot",
            ));
        }
        // Checked before the state slot is taken, which may evict cached states.
        self.pools.rows.ensure_available()?;
        let root = self.tree.root();
        let anchor_ok = req.last_node.is_some_and(|n| {
            self.tree.contains(n)
                && (n == root || self.tree.device_pages(n).is_ok_and(|p| !p.is_empty()))
                // A Mamba hit needs its state still there (it may have been evicted since).
                && (!mamba || n == root || self.tree.mamba_state(n).is_ok_and(|s| s.is_some()))
        });
        if !anchor_ok {
            self.match_request(req)?;
        }
        let anchor = req.last_node.unwrap_or(root);
        let (receipt, slot, cow) = if mamba {
            let (r, s, cow) = self.lock_with_mamba_slot(anchor)?;
            (r, Some(s), cow)
        } else {
            (self.tree.inc_lock_ref(anchor)?, None, None)
        };
        let row = match self.pools.rows.alloc() {
            Ok(r) => r,
            Err(e) => {
                if let Some(s) = slot {
                    self.tree.free_mamba_slot(s)?;
                }
                self.tree.dec_lock_ref(receipt)?;
                return Err(e);
            }
        };
        req.mamba_slot = slot;
        req.mamba_cow = cow;
        self.start_row(row, req)?;
        req.row = Some(row);
        req.lock = Some(receipt);
        req.committed_len = req.prefix_len;
        req.allocated_len = req.prefix_len;
        req.cache_protected_len = req.prefix_len;
        // Disabled mode caches nothing, so it takes no checkpoint either.
        if mamba && !self.disabled {
            self.mamba.plan(&mut self.tree, req);
        }
        self.debug_audit();
        Ok(())
    }

    fn cache_unfinished_req(&mut self, req: &mut RequestKv) -> Result<()> {
        if req.row.is_none() {
            return Err(CacheError::InvalidRequestState(
                "cache_unfinished_req without a row",
            ));
        }
        if !self.takes_windowed_keys() {
            req.check_whole_key()?;
        }
        if self.tree.swa_enabled() {
            return self.cache_unfinished_req_swa(req);
        }
        let aligned = align_down(req.committed_len, self.pools.page_size);
        if self.disabled || aligned <= req.cache_protected_len {
            return Ok(());
        }
        // Chunks do not count as reuse hits; the finish does, once per request.
        let r = self.insert_request_prefix(req, aligned, true)?;
        // Lock the new end before releasing the old one so the shared path never becomes
        // evictable in between.
        let receipt = self.tree.inc_lock_ref(r.last_node)?;
        if let Some(old) = req.lock.replace(receipt) {
            self.tree.dec_lock_ref(old)?;
        }
        req.last_node = Some(r.last_node);
        req.cache_protected_len = aligned;
        req.prefix_len = aligned;
        let states = self.chunk_states(req, r.last_node, aligned);
        self.debug_audit();
        states
    }

    fn alloc_tokens(&mut self, req: &mut RequestKv, n: usize) -> Result<()> {
        if self.tree.swa_enabled() {
            return self.alloc_tokens_swa(req, n);
        }
        alloc_tokens_kv(self, req, n)
    }

    fn slide_window(&mut self, req: &mut RequestKv) -> Result<usize> {
        self.slide_window_swa(req)
    }

    fn cache_finished_req(&mut self, req: &mut RequestKv, kind: FinishKind) -> Result<()> {
        if let Some(refused) = refuse_partial_key_finish(self, req, kind) {
            return refused;
        }
        if self.tree.swa_enabled() {
            return self.cache_finished_req_swa(req, kind);
        }
        let Some(row) = req.row else {
            // Never began: nothing held but a possible stray lock.
            self.free_request_states(req)?;
            if let Some(l) = req.lock.take() {
                self.tree.dec_lock_ref(l)?;
            }
            req.clear_kv_state();
            return Ok(());
        };
        let p = self.pools.page_size;
        let aligned = align_down(req.committed_len, p);
        let mut result = Ok(());
        let mut end = None;
        if kind == FinishKind::Finished && !self.disabled && aligned > 0 {
            result = self
                .insert_request_prefix(req, aligned, false)
                .map(|r| end = Some(r.last_node));
        }
        result = result.and(self.finish_request_states(req, aligned, end));
        // Free everything the row still owns (the unaligned tail, over-allocation, or all of it
        // on abort), release the lock and the row.
        let freed = self.pools.release_row(row);
        let unlocked = match req.lock.take() {
            Some(l) => self.tree.dec_lock_ref(l),
            None => Ok(()),
        };
        req.clear_kv_state();
        self.debug_audit();
        result.and(freed).and(unlocked)
    }
}

impl RadixCache {
    /// The tree match of `key`: with the Mamba component, cut back to the deepest cached state
    /// ([`RadixTree::match_mamba`]), paired with how far the device KV went; 0 for that length
    /// without the component (see [`RequestKv::kv_match_len`]).
    fn match_tree(&mut self, key: KeyRef<'_>, out: &mut Vec<PageId>) -> Result<(TreeMatch, usize)> {
        if self.tree.swa_enabled() {
            return self.match_tree_swa(key, out);
        }
        if !self.tree.mamba_enabled() {
            return Ok((self.tree.match_prefix(key, out), 0));
        }
        let m = self.tree.match_mamba(key, out)?;
        let usable = TreeMatch {
            device_len: m.usable_len,
            host_len: 0,
            last_device: m.anchor,
            last_node: m.anchor,
        };
        Ok((usable, m.kv.device_len))
    }

    /// Locks `anchor` (and its Mamba state, unless it is the root) and gives the request its
    /// own Mamba slot: a copy-on-write destination on a hit, a fresh slot otherwise. Nothing is
    /// held on error.
    fn lock_with_mamba_slot(
        &mut self,
        anchor: NodeId,
    ) -> Result<(LockReceipt, u32, Option<MambaCow>)> {
        let hit = anchor != self.tree.root();
        let receipt = if hit {
            self.tree.inc_lock_ref_mamba(anchor)?
        } else {
            self.tree.inc_lock_ref(anchor)?
        };
        let slot = if hit {
            self.tree.cow_mamba(&receipt).map(|c| (c.dst, Some(c)))
        } else {
            self.tree.alloc_mamba_slot().map(|s| (s, None))
        };
        match slot {
            Ok((s, cow)) => Ok((receipt, s, cow)),
            Err(e) => {
                self.tree.dec_lock_ref(receipt)?;
                Err(e)
            }
        }
    }

    /// Matches `key` into a caller-provided buffer without the `len − 1` rule (hot path for
    /// benchmarks and routers). The full-KV match only: it does not apply the Mamba or the
    /// sliding-window rule of [`PrefixCache::match_prefix`].
    pub fn match_prefix_into(&mut self, key: KeyRef<'_>, out: &mut Vec<PageId>) -> TreeMatch {
        self.tree.match_prefix(key, out)
    }

    /// Moves a request's row to the session holder (used by the session layer).
    pub fn set_row_holder(&mut self, req: &RequestKv, holder: RowHolder) -> Result<()> {
        let row = req
            .row
            .ok_or(CacheError::InvalidRequestState("request has no row"))?;
        self.pools.rows.set_holder(row, holder)
    }
}
