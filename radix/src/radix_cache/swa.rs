//! The sliding-window (SWA) request lifecycle of [`RadixCache`]: the tree's SWA component
//! (`tree/swa.rs`) driven by match, begin, allocation, chunk and finish inserts, the per-step
//! slide of the window and abort.
//!
//! A request holds its window KV in [`RequestKv::swa_pages`]: one SWA page per page of tokens
//! from [`RequestKv::swa_evicted_len`] to the end of its row (so the full-KV row and the SWA
//! table grow together, and `swa_evicted_len / P + swa_pages.len()` is the row's page count).
//! Its first pages, up to `cache_protected_len`, are the tree's window pages of its cached
//! prefix, locked by the request's receipt ([`RadixTree::inc_lock_ref_swa`]); the rest are the
//! request's own. Three rules keep that true:
//! - `swa_evicted_len <= align_down(committed_len) - window` (saturating): the window before
//!   the next token is always held, so after an insert the window before its end is live and
//!   can be locked.
//! - A chunk insert hands every page of `[swa_evicted_len, aligned)` to the tree (adopted,
//!   reviving tombstones, or freed as a duplicate of live window KV) and keeps only the
//!   canonical tree pages of the window before `aligned` in the table: tree pages outside the
//!   window are never referenced unlocked.
//! - A slide frees the request's own pages that left the window and forgets the tree's; once
//!   no tree page is left in the table, the receipt's SWA locks are released (its full-KV locks
//!   stay until the finish).
//!
//! The tree-level [`PrefixCache::insert`] takes full-KV pages only: what it adds has no window
//! KV (a tombstone for this component), so no match ends there until a request's insert
//! revives it.

use super::*;
use crate::cache::{alloc_row_pages, free_row_pages_from, pages_to_alloc};
use crate::tree::swa::SwaInsert;

/// Sliding-window attention layers of a [`RadixConfig`] (see [`RadixConfig::swa`]).
///
/// A token attends to the `window` tokens before it in the SWA layers, so only that window
/// of their KV is needed per request, and a cached prefix of length `L` is usable only when
/// the window KV of `[L − window, L)` is still cached.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SwaConfig {
    /// The window in tokens: at least one page, and a multiple of the page size (window KV is
    /// held and released in pages).
    pub window: usize,
    /// Pages of the SWA page pool (same page size as the full-KV pool), `1..=u32::MAX`.
    pub pages: usize,
}

/// Refuses an impossible or unsupported SWA configuration before anything is allocated.
pub(super) fn check_config(cfg: &RadixConfig) -> Result<()> {
    let Some(w) = cfg.swa else {
        return Ok(());
    };
    if w.window == 0 {
        return Err(CacheError::Config(
            "the sliding window must be at least one token".into(),
        ));
    }
    if cfg.page_size != 0 && !w.window.is_multiple_of(cfg.page_size) {
        return Err(CacheError::Config(format!(
            "the sliding window ({} tokens) must be a multiple of the page size ({})",
            w.window, cfg.page_size
        )));
    }
    if w.pages == 0 || w.pages > u32::MAX as usize {
        return Err(CacheError::Config(format!(
            "the SWA pool size {} must be in 1..=u32::MAX pages",
            w.pages
        )));
    }
    Ok(())
}

impl RadixCache {
    /// Where every SWA page is (`None` without the sliding-window component).
    pub fn swa_accounting(&self) -> Option<ComponentAccounting> {
        self.tree.swa_accounting().ok()
    }

    /// The sliding window in tokens (`None` without the component).
    pub fn swa_window(&self) -> Option<usize> {
        self.tree.swa_window().ok()
    }

    /// Tombstones unlocked window KV, least recently used first, until `pages` SWA pages are
    /// free or none is evictable; the nodes keep their full KV. Returns the pages freed (0
    /// without the component). Allocation does this by itself when the SWA pool is short.
    pub fn evict_swa(&mut self, pages: usize) -> usize {
        let n = self.tree.evict_swa(pages);
        self.debug_audit();
        n
    }

    /// The SWA pool's part of [`PrefixCache::check_invariants`] (the tree audits its nodes).
    pub(super) fn check_swa_pool(&self) -> std::result::Result<(), InvariantViolation> {
        if let Ok(a) = self.tree.swa_accounting() {
            ensure_inv!(a.balanced(), "SWA pool accounting does not balance: {a:?}");
        }
        Ok(())
    }

    /// Audits one request's SWA page table (the SWA part of [`PrefixCache::check_request`]):
    /// it covers the row from `swa_evicted_len` on, its pages before `cache_protected_len` are
    /// tree-held and locked by the request's receipt, the others are the request's own, and
    /// the window before the next token is held.
    ///
    /// # Errors
    /// The first violated invariant.
    pub fn check_request_swa(
        &self,
        req: &RequestKv,
    ) -> std::result::Result<(), InvariantViolation> {
        self.check_window_table(req, req.lock.as_ref())
    }

    /// [`RadixCache::check_request_swa`] with the receipt that locks the request's tree
    /// window pages given apart (a session slot keeps it beside the parked request).
    pub(super) fn check_window_table(
        &self,
        req: &RequestKv,
        lock: Option<&LockReceipt>,
    ) -> std::result::Result<(), InvariantViolation> {
        let (Ok(pool), Ok(window)) = (self.tree.swa_pool(), self.tree.swa_window()) else {
            ensure_inv!(
                req.swa_pages.is_empty() && req.swa_evicted_len == 0,
                "a cache without SWA layers: the request holds SWA pages"
            );
            return Ok(());
        };
        let Some(row) = req.row else {
            ensure_inv!(
                req.swa_pages.is_empty(),
                "a request without a row holds SWA pages"
            );
            return Ok(());
        };
        let p = self.pools.page_size;
        let rows = self
            .pools
            .rows
            .pages(row)
            .map_err(|e| InvariantViolation(format!("request row {row:?}: {e}")))?
            .len();
        let from = req.swa_evicted_len;
        ensure_inv!(
            from.is_multiple_of(p) && from / p + req.swa_pages.len() == rows,
            "SWA table from token {from} with {} pages does not cover the row's {rows} pages",
            req.swa_pages.len()
        );
        ensure_inv!(
            from <= align_down(req.committed_len, p).saturating_sub(window),
            "SWA table starts at {from}, inside the window before token {}",
            req.committed_len
        );
        let tree_held = req.cache_protected_len.saturating_sub(from) / p;
        ensure_inv!(
            tree_held == 0 || lock.is_some_and(LockReceipt::locks_swa_window),
            "the request references tree window pages without an SWA lock"
        );
        for (j, &pg) in req.swa_pages.iter().enumerate() {
            let want = if j < tree_held {
                PageState::Tree
            } else {
                PageState::Owned
            };
            let st = pool.state(pg);
            ensure_inv!(
                st == Ok(want),
                "request SWA page {pg:?} at token {} is {st:?}, not {want:?}",
                from + j * p
            );
        }
        Ok(())
    }

    /// [`RadixCache::match_tree`] with the SWA component: the KV match cut back to the deepest
    /// node boundary with a full window of live window KV before it (and, with the Mamba
    /// component too, a Mamba state at it). The second value is how far the KV matched (with
    /// the Mamba component, for the forward pass to checkpoint there; 0 otherwise).
    pub(super) fn match_tree_swa(
        &mut self,
        key: KeyRef<'_>,
        out: &mut Vec<PageId>,
    ) -> Result<(TreeMatch, usize)> {
        let m = self.tree.match_swa(key, out)?;
        let usable = TreeMatch {
            device_len: m.usable_len,
            host_len: 0,
            last_device: m.anchor,
            last_node: m.anchor,
        };
        let kv_len = if self.tree.mamba_enabled() {
            m.kv.device_len
        } else {
            0
        };
        Ok((usable, kv_len))
    }

    /// Locks `anchor`'s root path and, unless it is the root, the window KV before its end
    /// (and its Mamba state, with that component).
    fn lock_swa_anchor(&mut self, anchor: NodeId) -> Result<LockReceipt> {
        if anchor == self.tree.root() {
            self.tree.inc_lock_ref(anchor)
        } else if self.tree.mamba_enabled() {
            self.tree.inc_lock_ref_swa_mamba(anchor)
        } else {
            self.tree.inc_lock_ref_swa(anchor)
        }
    }

    /// With the Mamba component: the request's own running slot, a copy-on-write destination
    /// of the locked state on a hit (`receipt` locks it) or a fresh slot at the root. `None`
    /// without the component.
    fn mamba_slot_for(&mut self, receipt: &LockReceipt) -> Result<Option<(u32, Option<MambaCow>)>> {
        if !self.tree.mamba_enabled() {
            return Ok(None);
        }
        let slot = if receipt.locks_mamba_state() {
            self.tree.cow_mamba(receipt).map(|c| (c.dst, Some(c)))?
        } else {
            (self.tree.alloc_mamba_slot()?, None)
        };
        Ok(Some(slot))
    }

    /// The tree's window pages of tokens `[from, end)` on the path ending with node `last`,
    /// which ends at token `end` (every node there must hold window KV).
    fn tree_window_pages(&self, last: NodeId, end: usize, from: usize) -> Result<Vec<PageId>> {
        let p = self.pools.page_size;
        let mut out = Vec::with_capacity(end.saturating_sub(from) / p);
        let (mut node, mut stop) = (last, end);
        while stop > from {
            let pages = self
                .tree
                .swa_pages(node)?
                .ok_or(CacheError::InvalidRequestState(
                    "window KV the request needs is a tombstone",
                ))?;
            let start = stop - pages.len() * p;
            let skip = from.saturating_sub(start) / p;
            out.extend(pages[skip..].iter().rev());
            stop = start;
            if stop > from {
                node = self
                    .tree
                    .parent(node)?
                    .ok_or(CacheError::InvalidRequestState(
                        "the window passes the root",
                    ))?;
            }
        }
        out.reverse();
        Ok(out)
    }

    /// [`PrefixCache::begin_request`] with the SWA component: locks the matched path and the
    /// window KV before its end (re-matching first when the match went stale, e.g. its window
    /// was tombstoned meanwhile), allocates the row and installs the full-KV prefix in it and
    /// the window pages of the prefix in [`RequestKv::swa_pages`].
    pub(super) fn begin_request_swa(&mut self, req: &mut RequestKv) -> Result<()> {
        if req.row.is_some() || req.lock.is_some() || !req.swa_pages.is_empty() {
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
        // Checked before the window pages and the state slot are taken, which may evict.
        self.pools.rows.ensure_available()?;
        let root = self.tree.root();
        let anchor_ok = req.last_node.is_some_and(|n| {
            n == root
                || (self.tree.contains(n)
                    && self.tree.device_pages(n).is_ok_and(|p| !p.is_empty())
                    && self.tree.depth_tokens(n) == Ok(req.prefix_len)
                    // A Mamba hit needs its state still there (it may have been evicted).
                    && (!mamba || self.tree.mamba_state(n).is_ok_and(|s| s.is_some())))
        });
        let locked = match req.last_node {
            Some(n) if anchor_ok => self.lock_swa_anchor(n).ok(),
            _ => None,
        };
        let receipt = match locked {
            Some(r) => r,
            None => {
                self.match_request(req)?;
                self.lock_swa_anchor(req.last_node.unwrap_or(root))?
            }
        };
        let window = self.tree.swa_window()?;
        let len = req.prefix_len;
        let from = len.saturating_sub(window);
        let swa = match self.tree_window_pages(receipt.anchor(), len, from) {
            Ok(s) => s,
            Err(e) => {
                self.tree.dec_lock_ref(receipt)?;
                return Err(e);
            }
        };
        let slot = match self.mamba_slot_for(&receipt) {
            Ok(s) => s,
            Err(e) => {
                self.tree.dec_lock_ref(receipt)?;
                return Err(e);
            }
        };
        let row = match self.pools.rows.alloc() {
            Ok(r) => r,
            Err(e) => {
                if let Some((s, _)) = slot {
                    self.tree.free_mamba_slot(s)?;
                }
                self.tree.dec_lock_ref(receipt)?;
                return Err(e);
            }
        };
        self.start_row(row, req)?;
        req.row = Some(row);
        req.lock = Some(receipt);
        req.swa_pages = swa;
        req.swa_evicted_len = from;
        req.committed_len = len;
        req.allocated_len = len;
        req.cache_protected_len = len;
        if let Some((s, cow)) = slot {
            req.mamba_slot = Some(s);
            req.mamba_cow = cow;
            // Disabled mode caches nothing, so it takes no checkpoint either.
            if !self.disabled {
                self.mamba.plan(&mut self.tree, req);
            }
        }
        self.debug_audit();
        Ok(())
    }

    /// [`PrefixCache::alloc_tokens`] with the SWA component: the row's new full-KV pages and
    /// as many SWA pages, from both pools or from neither.
    pub(super) fn alloc_tokens_swa(&mut self, req: &mut RequestKv, n: usize) -> Result<()> {
        let (row, need) = pages_to_alloc(self, req, n)?;
        if need > 0 {
            // Both pools are checked before either is touched: evicting full KV (which frees
            // its window KV with it) leaves the SWA pool's free + evictable unchanged, and
            // tombstoning window KV frees no full KV, so the checks are independent.
            let a = self.tree.swa_accounting()?;
            if a.free + a.evictable < need {
                return Err(CacheError::OutOfComponentPages {
                    component: "swa",
                    needed: need,
                    available: a.free + a.evictable,
                });
            }
            let before = alloc_row_pages(self, row, need)?;
            if let Err(e) = self.tree.alloc_swa_pages(need, &mut req.swa_pages) {
                // Neither pool, then: the full-KV pages go back.
                free_row_pages_from(self, row, before)?;
                return Err(match e {
                    CacheError::OutOfPages { needed, available } => {
                        CacheError::OutOfComponentPages {
                            component: "swa",
                            needed,
                            available,
                        }
                    }
                    e => e,
                });
            }
        }
        req.allocated_len += n;
        self.debug_audit();
        Ok(())
    }

    /// Inserts the first `len` tokens of the request (page-aligned) with their full KV from
    /// its row and their window KV from its SWA table (tokens before `swa_evicted_len` become
    /// or stay tombstones), frees the duplicates, makes the row's first `len / P` pages
    /// canonical and protected, and leaves in the SWA table the tree's window pages of the
    /// window before `len` followed by the request's own pages after it.
    fn insert_request_prefix_swa(
        &mut self,
        req: &mut RequestKv,
        len: usize,
        chunked: bool,
    ) -> Result<SwaInsert> {
        let row = req
            .row
            .ok_or(CacheError::InvalidRequestState("request has no row"))?;
        let p = self.pools.page_size;
        let window = self.tree.swa_window()?;
        let from = req.swa_evicted_len;
        if from > len {
            return Err(CacheError::InvalidRequestState(
                "the request's window KV starts past the inserted prefix",
            ));
        }
        let swa_n = (len - from) / p;
        if swa_n > req.swa_pages.len() {
            return Err(CacheError::InvalidRequestState(
                "the request's SWA table is shorter than the inserted prefix",
            ));
        }
        let (mut buf, owned_from) = self.take_row_pages(row, len)?;
        let opts = InsertOptions {
            priority: req.priority,
            chunked,
        };
        let key = req.key_prefix(len);
        let swa_pages = &req.swa_pages[..swa_n];
        let mut done = None;
        let res =
            self.insert_owned_with(&mut buf[..len / p], owned_from, |tree, pages, replaced| {
                let r = tree.insert_swa_from(key, pages, from, swa_pages, replaced, opts)?;
                done = Some(r);
                Ok(r.kv)
            });
        let r = self.put_row_pages(row, buf, len, res)?;
        // The tree holds (or freed as duplicates) every SWA page of `[from, len)` now: keep
        // its canonical pages of the window before `len`, locked by the caller next.
        let keep = from.max(len.saturating_sub(window));
        let canonical = self.tree_window_pages(r.last_node, len, keep)?;
        req.swa_pages.splice(..swa_n, canonical);
        req.swa_evicted_len = keep;
        done.ok_or(CacheError::InvalidRequestState("the insert did not run"))
    }

    /// [`PrefixCache::cache_unfinished_req`] with the SWA component.
    pub(super) fn cache_unfinished_req_swa(&mut self, req: &mut RequestKv) -> Result<()> {
        if req.row.is_none() {
            return Err(CacheError::InvalidRequestState(
                "cache_unfinished_req without a row",
            ));
        }
        let aligned = align_down(req.committed_len, self.pools.page_size);
        if self.disabled || aligned <= req.cache_protected_len {
            return Ok(());
        }
        let r = self.insert_request_prefix_swa(req, aligned, true)?;
        // The new end and the window before it first, then the old lock goes.
        let receipt = self.tree.inc_lock_ref_swa(r.kv.last_node)?;
        if let Some(old) = req.lock.replace(receipt) {
            self.tree.dec_lock_ref(old)?;
        }
        req.last_node = Some(r.kv.last_node);
        req.cache_protected_len = aligned;
        req.prefix_len = aligned;
        // With the Mamba component, as without SWA.
        let states = self.chunk_states(req, r.kv.last_node, aligned);
        self.debug_audit();
        states
    }

    /// [`PrefixCache::cache_finished_req`] with the SWA component: inserts the full KV and
    /// the window KV the request still holds (unless aborted), frees its own SWA pages past
    /// that, releases its row and its lock.
    pub(super) fn cache_finished_req_swa(
        &mut self,
        req: &mut RequestKv,
        kind: FinishKind,
    ) -> Result<()> {
        let Some(row) = req.row else {
            // Never began: nothing held but a possible stray lock (and, from a session layer,
            // Mamba slots).
            let states = self.free_request_states(req);
            let unlocked = match req.lock.take() {
                Some(l) => self.tree.dec_lock_ref(l),
                None => Ok(()),
            };
            req.clear_kv_state();
            return states.and(unlocked);
        };
        let p = self.pools.page_size;
        let aligned = align_down(req.committed_len, p);
        let mut result = Ok(());
        let mut owned_from = req.cache_protected_len;
        let mut end = None;
        if kind == FinishKind::Finished && !self.disabled && aligned > 0 {
            match self.insert_request_prefix_swa(req, aligned, false) {
                Ok(r) => {
                    owned_from = owned_from.max(aligned);
                    end = Some(r.kv.last_node);
                }
                Err(e) => result = Err(e),
            }
        }
        // The Mamba component, as without SWA: checkpoints the forward passed are stored with
        // the KV, the running or tracked state becomes the state of the inserted end (where
        // the policy keeps it and its window is live), the rest is freed.
        if self.tree.mamba_enabled() {
            result = result.and(self.finish_request_states(req, aligned, end));
        }
        // The request's own SWA pages: past the insert (the unaligned tail, over-allocation),
        // or all of them on abort. The tree's pages before them are only forgotten.
        let first_owned =
            (owned_from.saturating_sub(req.swa_evicted_len) / p).min(req.swa_pages.len());
        let freed_swa = self.tree.free_swa_pages(&req.swa_pages[first_owned..]);
        let freed = self.pools.release_row(row);
        let unlocked = match req.lock.take() {
            Some(l) => self.tree.dec_lock_ref(l),
            None => Ok(()),
        };
        req.clear_kv_state();
        self.debug_audit();
        result.and(freed_swa).and(freed).and(unlocked)
    }

    /// [`PrefixCache::truncate_request`] with the SWA component: the window pages beside the
    /// freed full-KV pages go too, and the window before the new end must still be held.
    pub(super) fn truncate_request_swa(&mut self, req: &mut RequestKv, len: usize) -> Result<()> {
        crate::cache::check_truncate(req, len)?;
        let row = req.row.ok_or(CacheError::InvalidRequestState(
            "truncate_request without a row",
        ))?;
        let p = self.pools.page_size;
        let keep = crate::types::pages_for(len, p);
        // The row must be live before anything is freed.
        self.pools.rows.pages(row)?;
        if let Ok(window) = self.tree.swa_window() {
            let from = req.swa_evicted_len;
            let committed = req.committed_len.min(len);
            if from > align_down(committed, p).saturating_sub(window) {
                return Err(CacheError::InvalidRequestState(
                    "truncating into the window the request no longer holds",
                ));
            }
            // Every page past the cut lies past `cache_protected_len`: the request's own.
            let table = keep.saturating_sub(from / p).min(req.swa_pages.len());
            self.tree.free_swa_pages(&req.swa_pages[table..])?;
            req.swa_pages.truncate(table);
        }
        self.pools.truncate_row(row, keep)?;
        req.allocated_len = len;
        req.committed_len = req.committed_len.min(len);
        self.debug_audit();
        Ok(())
    }

    /// [`PrefixCache::slide_window`]: 0 without the SWA component.
    pub(super) fn slide_window_swa(&mut self, req: &mut RequestKv) -> Result<usize> {
        let Ok(window) = self.tree.swa_window() else {
            return Ok(0);
        };
        if req.row.is_none() {
            return Err(CacheError::InvalidRequestState(
                "slide_window without a row",
            ));
        }
        let p = self.pools.page_size;
        let target = align_down(req.committed_len, p).saturating_sub(window);
        let from = req.swa_evicted_len;
        let mut freed = 0;
        if target > from {
            let k = ((target - from) / p).min(req.swa_pages.len());
            let tree_held = (req.cache_protected_len.saturating_sub(from) / p).min(k);
            self.tree.free_swa_pages(&req.swa_pages[tree_held..k])?;
            freed = k - tree_held;
            req.swa_pages.drain(..k);
            req.swa_evicted_len = from + k * p;
        }
        // No tree window page left in the table: the receipt's SWA locks can go early.
        if req.swa_evicted_len >= req.cache_protected_len
            && let Some(lock) = req.lock.as_mut()
            && lock.locks_swa_window()
        {
            self.tree.release_swa_lock(lock)?;
        }
        self.debug_audit();
        Ok(freed)
    }
}
