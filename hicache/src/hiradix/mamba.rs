//! Mamba states on the host tier: the tiered match, the choice of states a backup carries, and
//! their audit (see the module docs of `hiradix`, "Extra pools").

use radixkv_radix::{
    CacheError, InvariantViolation, NodeId, PrefixCache, RequestKv, RequestMatch, align_down,
};

use super::{HiRadixCache, set_tiered_match};
use crate::backend::DeviceBackend;
use crate::controller::PoolName;
use crate::error::Result;

impl<B: DeviceBackend> HiRadixCache<B> {
    /// [`PrefixCache::match_request`] with the Mamba component (see there).
    pub(super) fn match_request_mamba(
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
        let (usable, anchor, kv_len, hit) = if limit == 0 {
            (0, root, 0, None)
        } else {
            let (m, hit) = tree.match_mamba_tiered(
                req.key.prefix(limit).with_hashes(&req.page_hashes),
                &mut req.prefix_pages,
            )?;
            (m.usable_len, m.anchor, m.kv.device_len, hit)
        };
        req.kv_match_len = kv_len;
        Ok(set_tiered_match(
            req,
            usable,
            anchor,
            hit.map(|h| (h.node, h.len)),
        ))
    }

    /// The device states of `nodes` that a backup should carry (those without a host copy
    /// yet), as (node, device slot), in the order given.
    pub(super) fn states_to_back_up(&self, nodes: &[NodeId]) -> Result<Vec<(NodeId, u32)>> {
        let tree = self.inner.tree();
        let mut out = Vec::new();
        if !self.mamba {
            return Ok(out);
        }
        for &n in nodes {
            if let Some(slot) = tree.mamba_state(n)?
                && tree.mamba_host_state(n)?.is_none()
            {
                out.push((n, slot));
            }
        }
        Ok(out)
    }

    /// Makes room for `states` host copies: evicts host-only leaves (in host-policy order)
    /// until enough host Mamba slots are free; when that is not enough, drops the shallowest
    /// states from the list (counted in [`HiCacheStats::mamba_host_full`]): their nodes are
    /// backed up without them.
    ///
    /// [`HiCacheStats::mamba_host_full`]: super::HiCacheStats::mamba_host_full
    pub(super) fn make_room_for_states(&mut self, states: &mut Vec<(NodeId, u32)>) {
        if states.is_empty() {
            return;
        }
        let free = self.mamba_host_free();
        if free < states.len() {
            self.evict_host_leaves(0, states.len() - free);
        }
        let free = self.mamba_host_free();
        if free < states.len() {
            let skip = states.len() - free;
            self.stats.mamba_host_full += skip as u64;
            states.drain(..skip);
        }
    }

    /// When no device Mamba slot is free or evictable but pending backups lock states (until
    /// their acks), completes those backups ([`HiRadixCache::finish_pinned_backups`], counted
    /// in [`HiCacheStats::backups_awaited_for_room`]) so that a request can have a slot.
    ///
    /// [`HiCacheStats::backups_awaited_for_room`]: super::HiCacheStats::backups_awaited_for_room
    pub(super) fn unpin_states_if_short(&mut self) -> Result<()> {
        let Some(a) = self.inner.mamba_accounting() else {
            return Ok(());
        };
        let pinned = self
            .pending_writes
            .values()
            .any(|w| !w.state_locks.is_empty());
        if a.free + a.evictable == 0 && pinned {
            self.stats.backups_awaited_for_room += 1;
            self.finish_pinned_backups()?;
        }
        Ok(())
    }

    /// Free host Mamba slots (0 without the Mamba pool).
    pub(super) fn mamba_host_free(&self) -> usize {
        self.ctrl
            .extra_host(PoolName::Mamba)
            .map_or(0, |a| a.available())
    }

    /// Takes the host state of `n` (if any) and frees its slot: at once when `now`, else once
    /// the loads outstanding now are done (they may read it). Returns whether there was one.
    pub(super) fn drop_host_state(&mut self, n: NodeId, now: bool) -> bool {
        if !self.mamba {
            return false;
        }
        let (tree, _) = self.inner.parts_mut();
        let Ok(Some(h)) = tree.take_mamba_host_state(n) else {
            return false;
        };
        // A storage backup may still read the state: stop it first.
        self.cancel_backups_reading_extra(PoolName::Mamba, &[h]);
        let freed = if now {
            self.ctrl.free_extra(PoolName::Mamba, &[h], &[])
        } else {
            self.ctrl
                .free_extra_host_after_loads(PoolName::Mamba, vec![h])
        };
        if let Err(e) = freed {
            debug_assert!(false, "a host Mamba slot was not allocated: {e}");
        }
        true
    }

    /// The host part of the Mamba audit: every host state of the tree holds an allocated host
    /// slot, and the allocated slots are exactly those plus the ones awaiting loads.
    pub(super) fn check_mamba_host(&self) -> std::result::Result<(), InvariantViolation> {
        let tree = self.inner.tree();
        let states = tree
            .mamba_host_states()
            .map_err(|e| InvariantViolation(format!("Mamba host states: {e}")))?;
        let alloc = self
            .ctrl
            .extra_host(PoolName::Mamba)
            .map_err(|e| InvariantViolation(format!("Mamba host pool: {e}")))?;
        if let Some((n, h)) = states.iter().find(|&&(_, h)| !alloc.is_used(h)) {
            return Err(InvariantViolation(format!(
                "node {n:?}: host Mamba slot {h} is out of range or free"
            )));
        }
        let deferred = self.ctrl.deferred_extra_slots(PoolName::Mamba);
        let prefetched = self.storage_reserved_extra(PoolName::Mamba);
        if states.len() + deferred + prefetched != alloc.used() {
            return Err(InvariantViolation(format!(
                "tree holds {} host Mamba states (+{deferred} awaiting loads, +{prefetched} \
                 reserved by prefetches) but {} host slots are allocated",
                states.len(),
                alloc.used()
            )));
        }
        Ok(())
    }
}
