//! Sliding-window KV on the host tier: the tiered match, the window pages a backup carries,
//! host room for them, and their audit (see the module docs of `hiradix`, "Extra pools:
//! sliding-window KV").

use std::collections::HashMap;

use radixkv_radix::{
    CacheError, InvariantViolation, NodeId, PageId, PrefixCache, RequestKv, RequestMatch,
    align_down,
};

use super::{HiRadixCache, set_tiered_match};
use crate::backend::DeviceBackend;
use crate::controller::PoolName;
use crate::error::Result;

impl<B: DeviceBackend> HiRadixCache<B> {
    /// Tombstones up to `pages` unlocked device window pages (least recently used first; see
    /// `RadixTree::evict_swa`): their nodes keep their KV and any host copy of the window KV,
    /// which a later load-back brings back. Returns the pages freed; 0 without the SWA
    /// component.
    pub fn evict_swa(&mut self, pages: usize) -> usize {
        self.inner.parts_mut().0.evict_swa(pages)
    }

    /// Device SWA pages free or evictable while the window KV before `node`'s end is locked,
    /// as an admission matched there locks it (see `RadixTree::inc_lock_ref_swa`), plus those
    /// only pending backups pin ([`HiRadixCache::backup_pinned_swa_pages`], read under the same
    /// lock): an allocation short of window pages completes those backups first, as
    /// [`PrefixCache::alloc_tokens`] says. `None` without the SWA component. A `node` that is
    /// the root, `None`, or whose window is not live on the device (a tombstone, a stale id)
    /// locks nothing. The lock is released before returning: only a split at the window's
    /// start remains.
    ///
    /// # Errors
    /// Releasing the temporary lock failed (a bug).
    pub fn swa_available_locked(
        &mut self,
        node: Option<NodeId>,
    ) -> radixkv_radix::Result<Option<usize>> {
        let (tree, _) = self.inner.parts_mut();
        let receipt = match node {
            Some(n) if n != tree.root() => tree.inc_lock_ref_swa(n).ok(),
            _ => None,
        };
        let a = self.inner.swa_accounting();
        let pinned = self.backup_pinned_swa_pages();
        if let Some(r) = receipt {
            self.inner.parts_mut().0.dec_lock_ref(r)?;
        }
        Ok(a.map(|a| a.free + a.evictable + pinned))
    }

    /// Device window pages that only pending backups keep from being tombstoned: the live
    /// window KV of nodes a backup pinned until its ack ([`RadixTree::pin_swa_pages`]) that
    /// nothing else (a request, a session slot, a load) locks. They become evictable once the
    /// backups are acknowledged, which [`HiRadixCache::finish_pinned_backups`] forces; an
    /// allocation short of window pages does that first. (A pinned node split since counts
    /// only its lower part: the count never exceeds what the acks free.) 0 without the SWA
    /// component.
    ///
    /// [`RadixTree::pin_swa_pages`]: radixkv_radix::RadixTree::pin_swa_pages
    pub fn backup_pinned_swa_pages(&self) -> usize {
        if !self.swa {
            return 0;
        }
        let tree = self.inner.tree();
        let mut pins: HashMap<NodeId, u32> = HashMap::new();
        for &(n, _) in self.pending_writes.values().flat_map(|w| &w.swa_pins) {
            *pins.entry(n).or_default() += 1;
        }
        pins.into_iter()
            .filter(|&(n, pinned)| tree.swa_lock_ref(n).is_ok_and(|l| l == pinned))
            .map(|(n, _)| tree.swa_pages(n).ok().flatten().map_or(0, <[PageId]>::len))
            .sum()
    }

    /// Host window pages held (0 without the SWA component).
    pub fn host_swa_pages(&self) -> usize {
        self.ctrl.extra_host(PoolName::Swa).map_or(0, |a| a.used())
    }

    /// [`PrefixCache::match_request`] with the SWA component, and the Mamba component too if
    /// the tree carries both (see there).
    pub(super) fn match_request_swa(
        &mut self,
        req: &mut RequestKv,
    ) -> radixkv_radix::Result<RequestMatch> {
        if req.row.is_some() || req.lock.is_some() {
            return Err(CacheError::InvalidRequestState(
                "match_request on a request that already holds KV",
            ));
        }
        req.prefix_pages.clear();
        let limit = align_down(req.max_match_len(), self.page_size());
        let (tree, _) = self.inner.parts_mut();
        let root = tree.root();
        let mamba = tree.mamba_enabled();
        let (usable, anchor, kv_len, hit) = if limit == 0 {
            (0, root, 0, None)
        } else {
            let (m, hit) = tree.match_swa_tiered(
                req.key.prefix(limit).with_hashes(&req.page_hashes),
                &mut req.prefix_pages,
            )?;
            (m.usable_len, m.anchor, m.kv.device_len, hit)
        };
        // As the device tier reports it: how far the device KV matched with the Mamba
        // component (the forward pass checkpoints there), 0 without it.
        req.kv_match_len = if mamba { kv_len } else { 0 };
        Ok(set_tiered_match(
            req,
            usable,
            anchor,
            hit.map(|h| (h.node, h.len)),
        ))
    }

    /// The live device window pages of `nodes` that a backup should carry (those without a
    /// host copy yet), as (node, device pages), in the order given.
    pub(super) fn swa_to_back_up(&self, nodes: &[NodeId]) -> Result<Vec<(NodeId, Vec<PageId>)>> {
        let tree = self.inner.tree();
        let mut out = Vec::new();
        if !self.swa {
            return Ok(out);
        }
        for &n in nodes {
            if let Some(pages) = tree.swa_pages(n)?
                && tree.swa_host_pages(n)?.is_none()
            {
                out.push((n, pages.to_vec()));
            }
        }
        Ok(out)
    }

    /// Makes room for the host copies of `windows`: evicts host-only leaves (in host-policy
    /// order) until enough host SWA pages are free; when that is not enough, drops the
    /// shallowest nodes from the list (counted in [`HiCacheStats::swa_host_full`]): they are
    /// backed up without their window pages.
    ///
    /// [`HiCacheStats::swa_host_full`]: super::HiCacheStats::swa_host_full
    pub(super) fn make_room_for_windows(&mut self, windows: &mut Vec<(NodeId, Vec<PageId>)>) {
        let need: usize = windows.iter().map(|(_, p)| p.len()).sum();
        if need == 0 {
            return;
        }
        let free = self.swa_host_free();
        if free < need {
            self.evict_host_leaves_for(0, 0, need - free, None);
        }
        let free = self.swa_host_free();
        let mut need = need;
        let mut skip = 0;
        while need > free && skip < windows.len() {
            need -= windows[skip].1.len();
            skip += 1;
        }
        self.stats.swa_host_full += skip as u64;
        windows.drain(..skip);
    }

    /// Free host SWA pages (0 without the SWA pool).
    pub(super) fn swa_host_free(&self) -> usize {
        self.ctrl
            .extra_host(PoolName::Swa)
            .map_or(0, |a| a.available())
    }

    /// Takes the host window pages of `n` (if any) and frees them: at once when `now`, else
    /// once the loads outstanding now are done (they may read them). Returns how many.
    pub(super) fn drop_host_window(&mut self, n: NodeId, now: bool) -> usize {
        if !self.swa {
            return 0;
        }
        let (tree, _) = self.inner.parts_mut();
        let Ok(Some(h)) = tree.take_swa_host_pages(n) else {
            return 0;
        };
        // A storage backup may still read the pages: stop it first.
        self.cancel_backups_reading_extra(PoolName::Swa, &h);
        let count = h.len();
        let freed = if now {
            self.ctrl.free_extra(PoolName::Swa, &h, &[])
        } else {
            self.ctrl.free_extra_host_after_loads(PoolName::Swa, h)
        };
        if let Err(e) = freed {
            debug_assert!(false, "a host SWA page was not allocated: {e}");
        }
        count
    }

    /// Releases window pins (node, pages when pinned); a pin whose nodes are gone is a bug
    /// reported as an error.
    pub(super) fn unpin_windows(&mut self, pins: &[(NodeId, usize)]) -> Result<()> {
        let (tree, _) = self.inner.parts_mut();
        let mut res = Ok(());
        for &(n, pages) in pins {
            if let Err(e) = tree.unpin_swa_pages(n, pages) {
                res = res.and(Err(e.into()));
            }
        }
        res
    }

    /// The host part of the SWA audit: every host window page of the tree is allocated, and
    /// the allocated pages are exactly those plus the ones awaiting loads.
    pub(super) fn check_swa_host(&self) -> std::result::Result<(), InvariantViolation> {
        let tree = self.inner.tree();
        let copies = tree
            .swa_host_copies()
            .map_err(|e| InvariantViolation(format!("SWA host copies: {e}")))?;
        let alloc = self
            .ctrl
            .extra_host(PoolName::Swa)
            .map_err(|e| InvariantViolation(format!("SWA host pool: {e}")))?;
        let mut count = 0;
        for (n, pages) in &copies {
            if let Some(h) = pages.iter().find(|&&h| !alloc.is_used(h)) {
                return Err(InvariantViolation(format!(
                    "node {n:?}: host SWA page {h} is out of range or free"
                )));
            }
            count += pages.len();
        }
        let deferred = self.ctrl.deferred_extra_slots(PoolName::Swa);
        let prefetched = self.storage_reserved_extra(PoolName::Swa);
        if count + deferred + prefetched != alloc.used() {
            return Err(InvariantViolation(format!(
                "tree holds {count} host SWA pages (+{deferred} awaiting loads, +{prefetched} \
                 reserved by prefetches) but {} host pages are allocated",
                alloc.used()
            )));
        }
        Ok(())
    }
}
