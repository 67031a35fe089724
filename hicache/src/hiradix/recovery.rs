//! Applying acks at step boundaries: reporting completed backups, releasing locks, and undoing
//! or repairing failed copies (see the module docs of `hiradix`).

use std::collections::{HashMap, HashSet};

use radixkv_radix::{Medium, NodeId, PageId, PrefixCache};

use super::{HiRadixCache, PendingLoad, PendingWrite};
use crate::backend::DeviceBackend;
use crate::controller::radix_sort_by_key;
use crate::controller::{Acks, PoolName, PoolTransfer};
use crate::error::{HiCacheError, Result};

impl<B: DeviceBackend> HiRadixCache<B> {
    /// Applies completed transfers. With failures among them, first waits for every started
    /// transfer so that undoing a backup never frees host pages a copy still touches.
    ///
    /// A failed backup also fails the backups still queued (refused submissions awaiting a
    /// retry): one of them may extend a failed chain, and undoing it must neither report a host
    /// removal for KV never reported stored nor free host pages a later copy would write.
    ///
    /// Ranks agree on failures ([`Consensus`](crate::Consensus)): a copy fails on one rank
    /// only (its device), so when any rank's acks hold a failure, every rank waits for all
    /// its started transfers, takes all their acks, and treats as failed every operation that
    /// failed on any rank (a backup that succeeded here is undone like a failed one; a load
    /// that succeeded here is repaired, which copies the same bytes again). Operation ids are
    /// the same on every rank, which submit the same operations in the same order.
    pub(super) fn apply_acks(&mut self, acks: &mut Acks) -> Result<()> {
        let (applied, repaired) = self.apply_acks_apart(acks);
        applied.and(repaired)
    }

    /// [`HiRadixCache::apply_acks`] for a call that completes transfers without being the
    /// step boundary that reports failed loads (a reset, a write-back eviction, completing the
    /// backups that pin the room an allocation or a begin needs): a failed load whose repair
    /// fails again is not its failure. The load was demoted (no request held its nodes:
    /// nothing reads them) or stays unrepaired: [`HiRadixCache::start_loading`] refuses every
    /// batch until it is, and the next [`HiRadixCache::step`] retries the repair and reports
    /// it. (Such calls returned the repair's error, folded into an invalid request state,
    /// after the acks had changed the pools: found by fuzzing `hicache_ops` at a reset, a
    /// begin and an allocation.)
    ///
    /// # Errors
    /// A stale lock or pin (a bug).
    pub(super) fn apply_acks_leaving_repairs(&mut self, acks: &mut Acks) -> Result<()> {
        let (applied, repaired) = self.apply_acks_apart(acks);
        if let Err(e) = repaired {
            tracing::debug!(error = %e, "a failed load's repair failed again; the next step retries it");
        }
        applied
    }

    /// The body of [`HiRadixCache::apply_acks`]: returns the errors of applying the acks
    /// (stale locks or pins: bugs) apart from the outcome of repairing failed loads.
    fn apply_acks_apart(&mut self, acks: &mut Acks) -> (Result<()>, Result<()>) {
        if self.consensus.max(u64::from(acks.has_failures())) == 1 {
            // The wait's error is the failure being handled here.
            let _ = self.ctrl.wait_all();
            acks.extend(self.ctrl.poll_acks());
            self.agree_on_failures(acks);
            if !acks.failed_writes.is_empty() {
                self.ctrl.fail_queued_writes();
                acks.extend(self.ctrl.poll_acks());
            }
            tracing::error!(
                writes = ?acks.failed_writes,
                loads = ?acks.failed_loads,
                "host tier transfers failed"
            );
            self.stats.failed_transfers +=
                (acks.failed_writes.len() + acks.failed_loads.len()) as u64;
        }
        let mut res = Ok(());
        for id in &acks.writes {
            self.stats.writes_acked += 1;
            if let Some(mut w) = self.pending_writes.remove(id) {
                self.sort_backup_host(&mut w);
                self.report_backup(&w);
                self.queue_storage_backup(&w);
                res = res.and(self.unpin_windows(&w.swa_pins));
                res = res.and(self.release(w.lock.take()));
                for l in std::mem::take(&mut w.state_locks) {
                    res = res.and(self.release(Some(l)));
                }
                res = res.and(self.finish_write_back(&mut w, true));
            }
        }
        for id in &acks.loads {
            self.stats.loads_acked += 1;
            if let Some(l) = self.pending_loads.remove(id) {
                res = res.and(self.unpin_windows(&l.swa_pins));
                res = res.and(self.release(l.lock));
            }
        }
        // Loads first: a repair reads host copies that undoing a failed backup may drop.
        for id in &acks.failed_loads {
            self.stats.failed_loads += 1;
            if let Some(l) = self.pending_loads.remove(id) {
                self.unrepaired.push(l);
            }
        }
        let repaired = if self.unrepaired.is_empty() {
            Ok(())
        } else {
            let (released, repaired) = self.repair_loads();
            res = res.and(released);
            repaired
        };
        let mut failed = Vec::new();
        for id in &acks.failed_writes {
            self.stats.failed_writes += 1;
            if let Some(mut w) = self.pending_writes.remove(id) {
                res = res.and(self.unpin_windows(&std::mem::take(&mut w.swa_pins)));
                res = res.and(self.release(w.lock.take()));
                for l in std::mem::take(&mut w.state_locks) {
                    res = res.and(self.release(Some(l)));
                }
                res = res.and(self.finish_write_back(&mut w, false));
                failed.push(w);
            }
        }
        if !failed.is_empty() {
            self.drop_failed_backups(&failed);
        }
        (res, repaired)
    }

    /// Makes `acks` fail every operation that failed on any rank: the union of the ranks'
    /// failed ids, taken one id at a time, smallest first (one reduction per failed operation
    /// plus one, the same number on every rank). Single-rank: one reduction, no change.
    fn agree_on_failures(&mut self, acks: &mut Acks) {
        let mut local: Vec<u64> = acks
            .failed_writes
            .iter()
            .chain(&acks.failed_loads)
            .copied()
            .collect();
        local.sort_unstable();
        let mut union = HashSet::new();
        let mut from = 0;
        loop {
            let mine = local
                .iter()
                .copied()
                .find(|&id| id >= from)
                .unwrap_or(u64::MAX);
            let agreed = self.consensus.min(mine);
            if agreed == u64::MAX {
                break;
            }
            union.insert(agreed);
            from = agreed + 1;
        }
        let moved = |ok: &mut Vec<u64>, failed: &mut Vec<u64>| {
            ok.retain(|id| {
                let keep = !union.contains(id);
                if !keep {
                    failed.push(*id);
                }
                keep
            });
        };
        moved(&mut acks.writes, &mut acks.failed_writes);
        moved(&mut acks.loads, &mut acks.failed_loads);
    }

    /// Waits for every started transfer and applies the acks, after reporting the backups
    /// still queued (the backend refused their submission) as failed: for a caller that cannot
    /// wait for a retry (write-back eviction reuses the source pages at once, a reset discards
    /// everything). A failed copy is handled by the acks, so the wait's own error adds nothing.
    ///
    /// # Errors
    /// A stale lock or pin (a bug). A failed load's repair that fails again is the next step's
    /// to report ([`HiRadixCache::apply_acks_leaving_repairs`]).
    pub(super) fn finish_writes_now(&mut self) -> Result<()> {
        self.ctrl.fail_queued_writes();
        let _ = self.ctrl.wait_all();
        let mut acks = self.ctrl.poll_acks();
        self.apply_acks_leaving_repairs(&mut acks)
    }

    fn release(&mut self, lock: Option<radixkv_radix::LockReceipt>) -> Result<()> {
        match lock {
            Some(r) => self.inner.dec_lock_ref(r).map_err(HiCacheError::from),
            None => Ok(()),
        }
    }

    /// Sorts an acknowledged backup's host pages when its event report or storage backup will
    /// look pages up in them (binary search); otherwise leaves them as they are.
    pub(super) fn sort_backup_host(&self, w: &mut PendingWrite) {
        if self.inner.tree().events_enabled() || self.storage.is_some() {
            radix_sort_by_key(&mut w.host, |&h| h);
        }
    }

    /// Emits the host `BlockStored` events of an acknowledged backup, shallowest first: its
    /// nodes plus the parts split off above them since, i.e. the ancestors whose host pages
    /// belong to this backup.
    fn report_backup(&mut self, w: &PendingWrite) {
        let tree = self.inner.tree();
        if !tree.events_enabled() {
            return;
        }
        let mut seen = HashSet::new();
        let mut found = Vec::new();
        for &last in &w.nodes {
            let mut n = last;
            while let Ok(Some(h)) = tree.host_pages(n) {
                if h.first().is_none_or(|p| w.host.binary_search(p).is_err()) || !seen.insert(n) {
                    break;
                }
                found.push((tree.depth_tokens(n).unwrap_or(0), n));
                match tree.parent(n) {
                    Ok(Some(p)) => n = p,
                    _ => break,
                }
            }
        }
        found.sort_unstable();
        let (tree, _) = self.inner.parts_mut();
        for (_, n) in found {
            // The node was checked just above; a stale id cannot occur here.
            let _ = tree.emit_stored_event(n, Medium::Host);
        }
    }

    /// Undoes failed backups: every node holding a failed host page loses its host copy, and
    /// so does every backed-up node below one (backed-up nodes stay root-connected). Nodes on
    /// device become device-only; host-only nodes below are removed. Host pages that held good
    /// bytes are freed only after the loads that may read them.
    fn drop_failed_backups(&mut self, failed: &[PendingWrite]) {
        // The states a failed backup wrote hold garbage, and no load read them (their device
        // states were locked on device): free them at once.
        for w in failed {
            for &(n, h) in &w.states {
                if self
                    .inner
                    .tree()
                    .mamba_host_state(n)
                    .is_ok_and(|s| s == Some(h))
                {
                    self.drop_host_state(n, true);
                }
            }
        }
        // Likewise the window pages a failed backup wrote (a split may have divided them
        // among the node and its new ancestors: found by page).
        let mut bad_swa: Vec<u32> = failed
            .iter()
            .flat_map(|w| w.swa_host.iter().copied())
            .collect();
        if !bad_swa.is_empty() {
            bad_swa.sort_unstable();
            let copies = self.inner.tree().swa_host_copies().unwrap_or_default();
            for (n, h) in copies {
                if h.iter().any(|p| bad_swa.binary_search(p).is_ok()) {
                    self.drop_host_window(n, true);
                }
            }
        }
        let mut bad: Vec<u32> = failed.iter().flat_map(|w| w.host.iter().copied()).collect();
        bad.sort_unstable();
        let tree = self.inner.tree();
        let mut backed: HashMap<NodeId, bool> = HashMap::new();
        tree.for_each_host_page(|n, h| {
            *backed.entry(n).or_default() |= bad.binary_search(&h).is_ok();
        });
        let failed_nodes: HashSet<NodeId> = backed
            .iter()
            .filter(|&(_, &b)| b)
            .map(|(&n, _)| n)
            .collect();
        let mut doomed: Vec<(usize, NodeId, bool)> = Vec::new();
        for (&n, &is_bad) in &backed {
            let mut up = Some(n);
            while let Some(u) = up {
                if failed_nodes.contains(&u) {
                    let depth = tree.depth_tokens(n).unwrap_or(0);
                    doomed.push((depth, n, !is_bad));
                    break;
                }
                up = tree.parent(u).ok().flatten();
            }
        }
        // Deepest first: a node drops its copy only after every backed-up child did.
        doomed.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut pages = Vec::new();
        for (_, n, reported) in doomed {
            pages.clear();
            // A good host state goes with its node's host copy, after the loads that may read it.
            self.drop_host_state(n, false);
            self.drop_host_window(n, false);
            let (tree, _) = self.inner.parts_mut();
            let tokens = tree.node_key(n).map_or(0, <[u32]>::len);
            let dropped = if tree.on_device(n).unwrap_or(false) {
                let r = tree.clear_host_pages(n, &mut pages);
                if r.is_ok() && reported {
                    let _ = tree.emit_removed_event(n, Medium::Host);
                }
                r
            } else {
                self.host_leaves.forget(n);
                tree.evict_host_leaf(n, &mut pages).map(|_| ())
            };
            if let Err(e) = dropped {
                tracing::error!(node = ?n, error = %e, "could not drop a failed backup");
                continue;
            }
            self.stats.dropped_backup_tokens += tokens as u64;
            // A storage backup may still read these pages: stop it first.
            self.cancel_backups_reading(&pages);
            let freed = if reported {
                self.ctrl.free_host_after_loads(std::mem::take(&mut pages))
            } else {
                // Garbage no load reads (its nodes were locked on device): free at once.
                self.ctrl.free_host(&pages)
            };
            if let Err(e) = freed {
                debug_assert!(false, "host pages of a node were not allocated: {e}");
            }
        }
    }

    /// Repairs failed loads by copying their host copies again, synchronously. A load whose
    /// repair fails is demoted to host-only once its nodes are unlocked, retried at every step
    /// until then.
    ///
    /// Returns the errors of releasing the loads' pins and locks (stale: bugs) apart from the
    /// repairs' outcome: [`HiCacheError::Transfer`] when some failed load's repair failed
    /// (whether or not it was then demoted).
    fn repair_loads(&mut self) -> (Result<()>, Result<()>) {
        let mut res = Ok(());
        let mut outcome = Ok(());
        for mut l in std::mem::take(&mut self.unrepaired) {
            // No copy is in flight any more: the pins go (before the KV lock they need).
            res = res.and(self.unpin_windows(&std::mem::take(&mut l.swa_pins)));
            let lock = l.lock.take();
            // The host copy is the repair's source: only trust it while the anchor still holds
            // it (a failed backup above may have dropped it since).
            let tree = self.inner.tree();
            let kv_intact = l.host.is_empty()
                || tree
                    .host_pages(l.last)
                    .ok()
                    .flatten()
                    .and_then(<[u32]>::last)
                    .is_some_and(|p| l.host.contains(p));
            let state_intact = l
                .state
                .is_none_or(|(h, _)| tree.mamba_host_state(l.last).is_ok_and(|s| s == Some(h)));
            // Each loaded window: its node (or the parts split off it) still holds the host
            // pages and the device pages of the load.
            let window_intact = l.swa.iter().all(|(n, h, d)| {
                let host = tree.swa_host_pages(*n).ok().flatten().unwrap_or(&[]);
                let dev = tree.swa_pages(*n).ok().flatten().unwrap_or(&[]);
                !host.is_empty() && h.ends_with(host) && d.ends_with(dev) && !dev.is_empty()
            });
            let mut extra: Vec<PoolTransfer> = l
                .state
                .iter()
                .map(|&(h, d)| PoolTransfer {
                    name: PoolName::Mamba,
                    host_indices: vec![h],
                    device_indices: vec![d],
                })
                .collect();
            if !l.swa.is_empty() {
                extra.push(PoolTransfer {
                    name: PoolName::Swa,
                    host_indices: l.swa.iter().flat_map(|(_, h, _)| h.clone()).collect(),
                    device_indices: l
                        .swa
                        .iter()
                        .flat_map(|(_, _, d)| d.iter().map(|p| p.0))
                        .collect(),
                });
            }
            let repaired = if kv_intact && state_intact && window_intact {
                self.ctrl.reload_now(&l.host, &l.device, &extra)
            } else {
                Err(HiCacheError::Transfer(
                    "the host copy of a failed load is gone".into(),
                ))
            };
            match repaired {
                Ok(()) => {
                    self.stats.repaired_loads += 1;
                    res = res.and(self.release(lock));
                }
                Err(e) => {
                    res = res.and(self.release(lock));
                    if self.demote_loaded(&l) {
                        self.stats.demoted_failed_loads += 1;
                    } else {
                        self.unrepaired.push(l);
                    }
                    outcome = outcome.and(Err(e));
                }
            }
        }
        (res, outcome)
    }

    /// Demotes the nodes of a failed load back to host-only (a node whose host copy was
    /// dropped meanwhile is removed instead), deepest first. Returns `true` when none of them
    /// is left on device (or the load is gone from the tree).
    fn demote_loaded(&mut self, l: &PendingLoad) -> bool {
        let mut device = l.device.clone();
        device.sort_unstable();
        let tree = self.inner.tree();
        if !tree.contains(l.last) {
            return true;
        }
        let mut chain = Vec::new();
        let mut n = l.last;
        loop {
            match tree.device_pages(n) {
                Ok([]) => {}
                Ok([first, ..]) if device.binary_search(first).is_ok() => chain.push(n),
                _ => break,
            }
            match tree.parent(n) {
                Ok(Some(p)) if p != tree.root() => n = p,
                _ => break,
            }
        }
        // Loaded window pages of nodes that keep their device KV (between the device prefix
        // and the loaded KV, or the whole load for a window-only one) are tombstoned.
        for (w, _, d) in &l.swa {
            let tree = self.inner.tree();
            if chain.contains(w) || !tree.contains(*w) {
                continue;
            }
            let live = tree.swa_pages(*w).ok().flatten().unwrap_or(&[]);
            if !live.is_empty() && d.ends_with(live) {
                let (tree, _) = self.inner.parts_mut();
                if tree.evict_swa_node(*w).is_err() {
                    return false;
                }
            }
        }
        let tree = self.inner.tree();
        // A state-only load: its state goes (the node keeps its device KV).
        if chain.is_empty()
            && let Some((_, d)) = l.state
            && tree.mamba_state(l.last).is_ok_and(|s| s == Some(d))
        {
            let (tree, _) = self.inner.parts_mut();
            return tree.evict_mamba_state(l.last).is_ok();
        }
        let mut freed: Vec<PageId> = Vec::new();
        for &n in &chain {
            let (tree, pools) = self.inner.parts_mut();
            freed.clear();
            if tree.evict_device(n, &mut freed).is_err() {
                return false;
            }
            if let Err(e) = pools.pages.free_released_tree_pages(&freed) {
                debug_assert!(false, "demoted pages were not tree-owned: {e}");
            }
            if let Ok(m) = tree.meta(n) {
                self.host_leaves.push(n, m);
            }
        }
        true
    }
}
