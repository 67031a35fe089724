//! Tier movements of [`HiRadixCache`]: backups, device eviction with demotion, host eviction,
//! load-back.

use std::collections::HashSet;

use radixkv_radix::{LockReceipt, NodeId, PageId, PrefixCache, RequestKv};

use super::{HiRadixCache, PendingLoad, PendingWrite, WritePolicy};
use crate::backend::{DeviceBackend, StreamKind};
use crate::controller::OpId;
use crate::controller::{PoolName, PoolTransfer};
use crate::error::{HiCacheError, Result};

impl<B: DeviceBackend> HiRadixCache<B> {
    /// Inserts needed before a node is backed up at insert time (`None`: write-back).
    pub(super) fn backup_threshold(&self) -> Option<u32> {
        match self.policy {
            WritePolicy::WriteThrough => Some(1),
            WritePolicy::WriteThroughSelective { hits } => Some(hits.max(1)),
            WritePolicy::WriteBack => None,
        }
    }

    /// Backs up the qualifying part of `path` (root first): from the first node without a
    /// host copy down to the first node that has not been inserted often enough. Stopping
    /// there keeps backed-up nodes root-connected. With the Mamba component, the device
    /// states of the nodes above (backed up before, but whose state was not: it came later,
    /// e.g. a checkpoint at a split) ride along.
    pub(super) fn backup_path(&mut self, path: &[NodeId]) -> Result<()> {
        let Some(threshold) = self.backup_threshold() else {
            return Ok(());
        };
        let tree = self.inner.tree();
        let start = path
            .iter()
            .position(|&n| tree.host_pages(n).is_ok_and(|h| h.is_none()))
            .unwrap_or(path.len());
        let mut chain = Vec::new();
        for &n in &path[start..] {
            let hits = tree.meta(n)?.hit_count.saturating_add(1);
            if hits < threshold || !tree.on_device(n)? {
                break;
            }
            chain.push(n);
        }
        let mut above = Vec::new();
        if self.mamba {
            for &n in &path[..start] {
                if tree.on_device(n)? {
                    above.push(n);
                }
            }
        }
        if !chain.is_empty() || !self.states_to_back_up(&above)?.is_empty() {
            self.backup_chain(&chain, &above, true)?;
        }
        Ok(())
    }

    /// Queues one backup of `chain` (root first; the first node's parent is backed up or the
    /// root; every node on device without a host copy), in one operation with the device
    /// Mamba states of the chain and of `above` (backed-up device nodes) that have no host
    /// copy yet. Evicts host leaves if the host is short of pages or Mamba slots; states that
    /// still find no host slot are left out (counted). With `lock`, the chain and the states
    /// stay locked until the write is acknowledged. The host copies are recorded now (so
    /// nothing backs them up twice) but the KV's is reported by a host `BlockStored` event
    /// only at the ack. Returns the operation queued, or `None` (and counts it) when the host
    /// cannot make room for the KV: the nodes stay device-only.
    pub(super) fn backup_chain(
        &mut self,
        chain: &[NodeId],
        above: &[NodeId],
        lock: bool,
    ) -> Result<Option<OpId>> {
        if !self.ctrl.has_room(StreamKind::Write) {
            self.stats.backups_skipped_queue_full += 1;
            return Ok(None);
        }
        let p = self.page_size();
        self.pages.clear();
        for &n in chain {
            self.pages
                .extend_from_slice(self.inner.tree().device_pages(n)?);
        }
        let need = self.pages.len();
        // Shallowest first, so that a shortage of host slots drops the shallowest states.
        let mut states = self.states_to_back_up(above)?;
        states.extend(self.states_to_back_up(chain)?);
        // The chain's window pages (root first, so a shortage drops the shallowest).
        let mut windows = if need > 0 {
            self.swa_to_back_up(chain)?
        } else {
            Vec::new()
        };
        // Nothing fails from here to the write, which takes the kept pages either way: the
        // host pages of the leaves evicted to make room go straight to this backup
        // (`write_reusing`). Freeing them and allocating them again was a fifth of the
        // write-back eviction's time on the Mooncake replay.
        let free = self.ctrl.host().available();
        let mut reused = std::mem::take(&mut self.host_reuse);
        debug_assert!(reused.is_empty());
        if free < need {
            self.evict_host_leaves_for((need - free) * p, 0, 0, Some(&mut reused));
        }
        self.make_room_for_states(&mut states);
        self.make_room_for_windows(&mut windows);
        if need == 0 && states.is_empty() {
            // Nothing to write, so nothing was evicted for it: `reused` is empty.
            self.host_reuse = reused;
            return Ok(None);
        }
        let mut extra = Vec::new();
        if !states.is_empty() {
            extra.push(PoolTransfer {
                name: PoolName::Mamba,
                host_indices: Vec::new(),
                device_indices: states.iter().map(|&(_, s)| s).collect(),
            });
        }
        if !windows.is_empty() {
            extra.push(PoolTransfer {
                name: PoolName::Swa,
                host_indices: Vec::new(),
                device_indices: windows
                    .iter()
                    .flat_map(|(_, p)| p.iter().map(|pg| pg.0))
                    .collect(),
            });
        }
        let pages = std::mem::take(&mut self.pages);
        let res = self
            .ctrl
            .write_reusing(&pages, &reused, 0, extra)
            .map(|op| {
                let of = |name| {
                    op.extra
                        .iter()
                        .find(|t| t.name == name)
                        .map(|t| t.host_indices.clone())
                        .unwrap_or_default()
                };
                let (slots, swa) = (of(PoolName::Mamba), of(PoolName::Swa));
                (op.id, op.host_pages.clone(), slots, swa)
            });
        self.pages = pages;
        // `write_reusing` took the pages whether it queued the backup or not.
        reused.clear();
        self.host_reuse = reused;
        let (id, host, host_slots, swa_host) = match res {
            Ok(v) => v,
            Err(HiCacheError::HostFull { .. } | HiCacheError::ExtraPoolFull { .. }) => {
                self.stats.host_exhausted += 1;
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let pin = lock && !self.mutations.unpinned_backups;
        let (tree, _) = self.inner.parts_mut();
        let mut at = 0;
        for &n in chain {
            let len = tree.device_pages(n)?.len();
            tree.set_host_pages_unreported(n, host[at..at + len].to_vec())?;
            at += len;
        }
        let mut backed = Vec::with_capacity(states.len());
        let mut state_locks = Vec::new();
        let mut lock = None;
        let mut swa_pins = Vec::new();
        let mut swa_at = 0;
        // The copy is queued: an internal error below must not leave the locks and pins taken
        // so far behind (nothing would release them: the write is not recorded).
        let recorded = (|| -> Result<()> {
            for (&(n, _), &h) in states.iter().zip(&host_slots) {
                tree.set_mamba_host_state(n, h)?;
                backed.push((n, h));
                if pin {
                    // The device slot must not be evicted and reused while the copy reads it.
                    state_locks.push(tree.inc_lock_ref_mamba(n)?);
                }
            }
            if let Some(&last) = chain.last()
                && pin
            {
                lock = Some(tree.inc_lock_ref(last)?);
            }
            for (n, dev) in &windows {
                // The controller allocates one host page per device page it was given.
                let Some(h) = swa_host.get(swa_at..swa_at + dev.len()) else {
                    debug_assert!(false, "the controller allocated too few host SWA pages");
                    break;
                };
                tree.set_swa_host_pages(*n, h.to_vec())?;
                swa_at += dev.len();
                if pin {
                    // The chain's lock covers the node's KV; the pin keeps its window pages
                    // from being tombstoned and reused while the copy reads them.
                    tree.pin_swa_pages(*n)?;
                    swa_pins.push((*n, dev.len()));
                }
            }
            Ok(())
        })();
        if let Err(e) = recorded {
            for l in state_locks.into_iter().chain(lock) {
                let _ = tree.dec_lock_ref(l);
            }
            for (n, pages) in swa_pins {
                let _ = tree.unpin_swa_pages(n, pages);
            }
            return Err(e);
        }
        // `host` stays unsorted: only the ack's event report and storage backup look pages up
        // in it, and they sort it then (`sort_backup_host`); sorting every backup here was a
        // sixth of the write-back eviction's time on the Mooncake HiCache replay.
        self.pending_writes.insert(
            id,
            PendingWrite {
                lock,
                nodes: chain.to_vec(),
                host,
                states: backed,
                state_locks,
                swa_host,
                swa_pins,
                victims: Vec::new(),
                victim_tokens: 0,
            },
        );
        self.stats.backed_up_tokens += (need * p) as u64;
        self.stats.mamba_states_backed_up += states.len() as u64;
        self.stats.swa_pages_backed_up += swa_at as u64;
        Ok(Some(id))
    }

    /// Device eviction: pops leaves in policy order until `tokens` are freed. A backed-up leaf
    /// is demoted (device pages freed, node kept host-only). Under write-back, the victims
    /// without a backup and their unbacked ancestors are first backed up in one merged write:
    /// synchronously here (the victims are freed before this returns; see
    /// [`HiRadixCache::evict_device_async`] for the asynchronous eviction).
    pub(super) fn evict_device(&mut self, tokens: usize) -> usize {
        let mut done = 0;
        let mut victims = Vec::new();
        while done < tokens {
            self.pop_victims(tokens - done, &mut victims);
            if victims.is_empty() {
                break;
            }
            if self.policy == WritePolicy::WriteBack
                && let Err(e) = self.write_back(&victims)
            {
                tracing::warn!(error = %e, "write-back failed; evicting without backup");
            }
            for &v in &victims {
                done += self.evict_one(v, true);
            }
        }
        done
    }

    /// Asynchronous device eviction toward `tokens` free tokens (write-back only; any other
    /// policy evicts synchronously, as [`HiRadixCache::evict_device`]). The victims of
    /// write-backs still in flight count toward `tokens`, since their room arrives at their
    /// acks. Backed-up victims are demoted now; the others are backed up in one merged write
    /// and stay on the device, locked, until its ack, which demotes those still evictable
    /// then. A victim whose backup cannot be queued (host or write queue full) is evicted
    /// without backup now, as in the synchronous path. Returns the tokens freed now.
    pub(super) fn evict_device_async(&mut self, tokens: usize) -> usize {
        if self.policy != WritePolicy::WriteBack {
            return self.evict_device(tokens);
        }
        let mut done = 0;
        let mut queued = self.write_back_tokens;
        let mut victims = Vec::new();
        let mut unbacked = Vec::new();
        while done + queued < tokens {
            self.pop_victims(tokens - done - queued, &mut victims);
            if victims.is_empty() {
                break;
            }
            unbacked.clear();
            for &v in &victims {
                if self.fully_backed_up(v) {
                    done += self.evict_one(v, true);
                } else {
                    unbacked.push(v);
                }
            }
            if unbacked.is_empty() {
                continue;
            }
            match self.write_back_async(&unbacked) {
                Ok(Some(t)) => queued += t,
                Ok(None) => {
                    for &v in &unbacked {
                        done += self.evict_one(v, true);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "write-back failed; evicting without backup");
                    for &v in &unbacked {
                        done += self.evict_one(v, true);
                    }
                }
            }
        }
        done
    }

    /// Pops victims (policy order) until they hold `tokens` device tokens or none is left.
    fn pop_victims(&mut self, tokens: usize, victims: &mut Vec<NodeId>) {
        victims.clear();
        let (tree, _) = self.inner.parts_mut();
        let mut got = 0;
        while got < tokens {
            let Some(v) = tree.pop_victim() else { break };
            got += tree.node_key(v).map_or(0, <[u32]>::len);
            victims.push(v);
        }
    }

    /// True when demoting `v` loses nothing: its KV has a host copy, and so has its device
    /// Mamba state if it has one.
    fn fully_backed_up(&self, v: NodeId) -> bool {
        self.inner.tree().host_pages(v).is_ok_and(|h| h.is_some())
            && self
                .states_to_back_up(&[v])
                .is_ok_and(|states| states.is_empty())
    }

    /// Releases the device pages of victim `v`. `expected`: the policy gave it, so it must be
    /// evictable (a debug assertion); otherwise (a write-back victim at its ack) one that is
    /// not (locked again, grown a child) is left alone. Returns the tokens freed.
    fn evict_one(&mut self, v: NodeId, expected: bool) -> usize {
        let (tree, pools) = self.inner.parts_mut();
        let had_host = tree.host_pages(v).is_ok_and(|h| h.is_some());
        self.pages.clear();
        let n = match tree.evict_device(v, &mut self.pages) {
            Ok(n) => n,
            Err(e) => {
                debug_assert!(!expected, "policy returned a non-evictable node: {e}");
                return 0;
            }
        };
        if let Err(e) = pools.pages.free_released_tree_pages(&self.pages) {
            debug_assert!(false, "evicted pages were not tree-owned: {e}");
        }
        if had_host {
            if let Ok(m) = tree.meta(v) {
                self.host_leaves.push(v, m);
            }
            self.stats.demoted_tokens += n as u64;
        } else if self.policy == WritePolicy::WriteBack {
            self.stats.dropped_without_backup += n as u64;
        }
        n
    }

    /// The chain a write-back of `victims` copies: the victims without a host copy and their
    /// unbacked ancestors, ancestors first (backed-up nodes stay root-connected), and the
    /// victims that have one (their Mamba states may still need a copy).
    fn write_back_chain(&self, victims: &[NodeId]) -> Result<(Vec<NodeId>, Vec<NodeId>)> {
        let tree = self.inner.tree();
        let root = tree.root();
        let mut chain = Vec::new();
        let mut taken = HashSet::new();
        let mut up = Vec::new();
        let mut above = Vec::new();
        for &v in victims {
            if tree.host_pages(v)?.is_some() {
                // Backed up before: its KV needs no copy, its state may.
                above.push(v);
            }
            up.clear();
            let mut n = v;
            while n != root && tree.host_pages(n)?.is_none() && !taken.contains(&n) {
                up.push(n);
                n = tree.parent(n)?.unwrap_or(root);
            }
            for &u in up.iter().rev() {
                taken.insert(u);
                chain.push(u);
            }
        }
        Ok((chain, above))
    }

    /// Backs up the victims without a host copy, ancestors first, and waits for the copy.
    fn write_back(&mut self, victims: &[NodeId]) -> Result<()> {
        let (chain, above) = self.write_back_chain(victims)?;
        if chain.is_empty() && self.states_to_back_up(&above)?.is_empty() {
            return Ok(());
        }
        if self.backup_chain(&chain, &above, false)?.is_some() {
            if let Err(e) = self.ctrl.start_writing() {
                // The victims are evicted right after this, so a refused backup cannot wait for
                // a retry: a copy submitted later would read device pages already reused. Fail
                // it instead; the acks below undo it and the victims go without a backup.
                if !matches!(e, HiCacheError::StreamClosed(_)) {
                    self.stats.refused_submissions += 1;
                }
                tracing::warn!(error = %e, "write-back submission refused; evicting without backup");
            }
            // A failure (the refused backup included) is handled by the acks: the chain goes
            // back to device-only and is then evicted without backup.
            self.finish_writes_now()?;
        }
        Ok(())
    }

    /// Queues the backup of `victims` (not fully backed up) and their unbacked ancestors, and
    /// locks every victim until the ack (which demotes them; see
    /// [`HiRadixCache::evict_device_async`]). The backup is started now; a refused submission
    /// is retried at the next step, like a write-through backup, since nothing reuses the
    /// victims' pages before the ack. Returns the victims' device tokens, or `None` when no
    /// backup was queued (host or write queue full; nothing locked).
    fn write_back_async(&mut self, victims: &[NodeId]) -> Result<Option<usize>> {
        let (chain, above) = self.write_back_chain(victims)?;
        let pin = !self.mutations.write_back_frees_early;
        // The victims are locked first: their locks cover the whole merged chain (every node
        // of it is a victim or an ancestor of one), which pinning its window KV requires.
        let mut tokens = 0;
        let mut locks = Vec::with_capacity(victims.len());
        for &v in victims {
            tokens += self.inner.tree().node_key(v).map_or(0, <[u32]>::len);
            if pin {
                match self.inner.inc_lock_ref(v) {
                    Ok(l) => locks.push(l),
                    Err(e) => {
                        self.release_all(locks)?;
                        return Err(e.into());
                    }
                }
            }
        }
        let id = match self.backup_chain(&chain, &above, pin) {
            Ok(Some(id)) => id,
            Ok(None) => {
                self.release_all(locks)?;
                return Ok(None);
            }
            Err(e) => {
                self.release_all(locks)?;
                return Err(e);
            }
        };
        let early = if pin { Vec::new() } else { victims.to_vec() };
        if let Some(w) = self.pending_writes.get_mut(&id) {
            w.victims = locks;
            w.victim_tokens = tokens;
        }
        self.write_back_tokens += tokens;
        self.stats.write_backs_async += 1;
        self.start_writes();
        for v in early {
            // The mutation: freed now, while the copy may still read the pages.
            self.evict_one(v, false);
        }
        Ok(Some(tokens))
    }

    /// Releases victim locks taken for a write-back that was not queued.
    fn release_all(&mut self, locks: Vec<radixkv_radix::LockReceipt>) -> Result<()> {
        for l in locks {
            self.inner.dec_lock_ref(l)?;
        }
        Ok(())
    }

    /// At the ack of an asynchronous write-back: releases the victims' locks and demotes the
    /// victims that are still evictable (unlocked device leaves). A victim a request locked or
    /// extended meanwhile stays on the device, backed up. After a failed copy (`demote`
    /// false) the victims are only released: device-only again, a later eviction retries.
    pub(super) fn finish_write_back(&mut self, w: &mut PendingWrite, demote: bool) -> Result<()> {
        self.write_back_tokens = self.write_back_tokens.saturating_sub(w.victim_tokens);
        w.victim_tokens = 0;
        let mut res = Ok(());
        let victims = std::mem::take(&mut w.victims);
        let mut anchors = Vec::with_capacity(victims.len());
        for l in victims {
            anchors.push(l.anchor());
            res = res.and(self.inner.dec_lock_ref(l).map_err(HiCacheError::from));
        }
        if demote {
            for v in anchors {
                let n = self.evict_one(v, false);
                self.stats.write_back_demoted_tokens += n as u64;
            }
        }
        res
    }

    /// Host eviction: removes host-only leaves in the order of the configured eviction policy
    /// (the device tier's family, e.g. LFU or priority) until `tokens` are freed or none is
    /// left. Returns the tokens freed.
    pub fn evict_host(&mut self, tokens: usize) -> usize {
        self.evict_host_leaves(tokens, 0).0
    }

    /// Host eviction until `tokens` are freed and `states` host Mamba states with them (or no
    /// host-only leaf is left). Returns both counts.
    pub(super) fn evict_host_leaves(&mut self, tokens: usize, states: usize) -> (usize, usize) {
        self.evict_host_leaves_for(tokens, states, 0, None)
    }

    /// Host eviction until `tokens` are freed, `states` host Mamba states and `windows` host
    /// SWA pages with them (or no host-only leaf is left). Returns the tokens and states freed.
    /// With `keep`, the evicted leaves' KV host pages are appended to it instead of freed: they
    /// stay allocated for the backup that needed the room
    /// ([`HybridCacheController::write_reusing`]).
    pub(super) fn evict_host_leaves_for(
        &mut self,
        tokens: usize,
        states: usize,
        windows: usize,
        mut keep: Option<&mut Vec<u32>>,
    ) -> (usize, usize) {
        let mut done = 0;
        let mut done_states = 0;
        let mut done_windows = 0;
        let mut rebuilt = false;
        let mut skipped = Vec::new();
        while done < tokens || done_states < states || done_windows < windows {
            let (tree, _) = self.inner.parts_mut();
            let Some(v) = self.host_leaves.pop(tree) else {
                if rebuilt {
                    break;
                }
                self.host_leaves.rebuild(tree);
                rebuilt = true;
                continue;
            };
            if self.host_protected(v) {
                // A storage backup reads it or a prefetch inserts below it: kept, re-queued
                // after this eviction.
                skipped.push(v);
                continue;
            }
            let parent = self.inner.tree().parent(v).ok().flatten();
            if self.drop_host_state(v, true) {
                // The leaf is unlocked, so no load reads its state.
                done_states += 1;
                self.stats.mamba_host_evicted += 1;
            }
            // The leaf is unlocked, so no load reads its window pages either.
            let w = self.drop_host_window(v, true);
            done_windows += w;
            self.stats.swa_host_pages_evicted += w as u64;
            let (tree, _) = self.inner.parts_mut();
            // Kept pages go straight into `keep` (the leaf's list is appended there on
            // success only); the others through the scratch list to the free.
            let out = match keep.as_deref_mut() {
                Some(keep) => keep,
                None => {
                    self.host_scratch.clear();
                    &mut self.host_scratch
                }
            };
            let Ok(n) = tree.evict_host_leaf(v, out) else {
                continue;
            };
            if keep.is_none()
                && let Err(e) = self.ctrl.free_host(&self.host_scratch)
            {
                debug_assert!(false, "host pages of a node were not allocated: {e}");
            }
            done += n;
            self.stats.host_evicted_tokens += n as u64;
            let tree = self.inner.tree();
            if let Some(p) = parent.filter(|&p| tree.is_host_leaf(p))
                && let Ok(m) = tree.meta(p)
            {
                self.host_leaves.push(p, m);
            }
        }
        for v in skipped {
            if let Ok(m) = self.inner.tree().meta(v) {
                self.host_leaves.push(v, m);
            }
        }
        (done, done_states)
    }

    /// Loads the request's host hit back to the device: allocates device pages (evicting if
    /// needed, never the request's own path), queues the load (start it with
    /// [`HiRadixCache::start_loading`]) and extends the request's prefix with the loaded pages.
    /// With the Mamba component the same operation loads the host copy of the state at the
    /// hit's end into a device slot (taken from the tree's pool, evicting an unlocked state if
    /// none is free), which becomes that node's device state, so the match is usable there;
    /// the prefix also takes in the device KV between the usable prefix and the loaded part.
    /// Returns the tokens the prefix grew by; 0 when there is nothing to load, the hit is
    /// shorter than the minimum or its KV larger than `quota_tokens`, the match went stale, or
    /// the device cannot make room (the request then proceeds with its device prefix). A
    /// declined load leaves that prefix usable: with Mamba or SWA components its end keeps its
    /// state and window while the load allocates, and a queued load supersedes them.
    ///
    /// # Errors
    /// [`CacheError::Busy`](radixkv_radix::CacheError::Busy) when the controller already holds
    /// its limit of pending loads (nothing changed: retry after the next
    /// [`HiRadixCache::step`]); a request that already holds KV; internal errors of the
    /// backend.
    pub fn init_load_back(
        &mut self,
        req: &mut RequestKv,
        quota_tokens: Option<usize>,
    ) -> radixkv_radix::Result<usize> {
        if req.row.is_some() || req.lock.is_some() {
            return Err(radixkv_radix::CacheError::InvalidRequestState(
                "load-back on a request that already holds KV",
            ));
        }
        // With Mamba or SWA components the device prefix is usable only while its end keeps
        // its state and window. The allocations below may evict unlocked states and tombstone
        // unlocked windows, and the load may still be declined after them (no slot, no window
        // pages, no device room): so the prefix's end is locked with its components until the
        // load is queued or declined, and a declined load leaves the request the prefix it
        // matched. (A CI run found a declined load that had evicted the prefix's state for its
        // own slot: the request then reused nothing.)
        let keep = match req.last_node {
            Some(end) if req.host_hit_len > 0 && req.load_anchor.is_some() => {
                self.lock_device_prefix_end(end)
            }
            _ => None,
        };
        let kept_state = keep.as_ref().is_some_and(|_| self.mamba);
        let r = self.init_load_back_locked(req, quota_tokens, kept_state);
        if let Some(k) = keep {
            let (tree, _) = self.inner.parts_mut();
            let released = tree.dec_lock_ref(k);
            if r.is_ok() {
                released?;
            }
        }
        r
    }

    /// Locks `end` (the device prefix's end) with the components a match there needs: its
    /// Mamba state and the window before it, where the tree has those components. `None` for
    /// a KV-only tree (the load's own lock on its anchor already covers the device path), for
    /// the root, and for an end that is no longer a usable match end (the request's
    /// `begin_request` matches again then).
    fn lock_device_prefix_end(&mut self, end: NodeId) -> Option<LockReceipt> {
        if !(self.mamba || self.swa) {
            return None;
        }
        let (tree, _) = self.inner.parts_mut();
        if end == tree.root() || !tree.contains(end) {
            return None;
        }
        match (self.mamba, self.swa) {
            (true, true) => tree.inc_lock_ref_swa_mamba(end).ok(),
            (true, false) => tree.inc_lock_ref_mamba(end).ok(),
            _ => tree.inc_lock_ref_swa(end).ok(),
        }
    }

    /// [`HiRadixCache::init_load_back`] once the device prefix's end is locked (`kept_state`:
    /// with its Mamba state).
    fn init_load_back_locked(
        &mut self,
        req: &mut RequestKv,
        quota_tokens: Option<usize>,
        kept_state: bool,
    ) -> radixkv_radix::Result<usize> {
        let (Some(anchor), Some(device_end)) = (req.load_anchor, req.last_node) else {
            return Ok(0);
        };
        if req.host_hit_len == 0 {
            return Ok(0);
        }
        let p = self.page_size();
        let tree = self.inner.tree();
        if !tree.contains(anchor) || !tree.contains(device_end) {
            return Ok(0);
        }
        // The host-only chain from the device prefix down to the anchor.
        let mut chain = Vec::new();
        let mut n = anchor;
        let mut tokens = 0;
        while n != tree.root() && !tree.on_device(n)? {
            if tree.host_pages(n)?.is_none() {
                return Ok(0);
            }
            tokens += tree.node_key(n)?.len();
            chain.push(n);
            n = tree.parent(n)?.unwrap_or(tree.root());
        }
        chain.reverse();
        // Mamba: the device nodes between the usable prefix and the chain (no state of their
        // own), and the host state at the anchor.
        let mut between = Vec::new();
        let mut state = None;
        // SWA: the nodes in the window before the anchor's end whose window KV is on the host
        // only, with their host pages.
        let mut windows: Vec<(NodeId, Vec<u32>)> = Vec::new();
        // And those whose window KV is live on device: pinned while the SWA pages are
        // allocated, so that the allocation tombstones none of the window it completes.
        let mut live = Vec::new();
        if self.swa {
            let window = tree.swa_window()?;
            let (mut m, mut covered) = (anchor, 0);
            while m != tree.root() && covered < window {
                if tree.swa_pages(m)?.is_some() {
                    live.push(m);
                } else {
                    let Some(h) = tree.swa_host_pages(m)? else {
                        return Ok(0);
                    };
                    windows.push((m, h.to_vec()));
                }
                covered += tree.node_key(m)?.len();
                m = tree.parent(m)?.unwrap_or(tree.root());
            }
            windows.reverse();
        }
        if self.mamba || self.swa {
            let mut m = n;
            let mut gained = tokens;
            while m != device_end {
                if m == tree.root() {
                    return Ok(0);
                }
                gained += tree.node_key(m)?.len();
                between.push(m);
                m = tree.parent(m)?.unwrap_or(tree.root());
            }
            between.reverse();
            if gained != req.host_hit_len || gained == 0 {
                return Ok(0);
            }
        }
        if self.mamba {
            if tree.mamba_state(anchor)?.is_none() {
                let Some(h) = tree.mamba_host_state(anchor)? else {
                    return Ok(0);
                };
                state = Some(h);
            } else if !self.swa || windows.is_empty() {
                // The anchor's device state (and window) would have made the match usable
                // there: it went stale. With the SWA component a device state stays usable
                // once the window pages before it come back.
                return Ok(0);
            }
        } else if !self.swa && (n != device_end || tokens != req.host_hit_len || chain.is_empty()) {
            return Ok(0);
        }
        let gain = req.host_hit_len;
        let min = self.load_back_min_tokens.div_ceil(p) * p;
        if gain < min {
            self.stats.load_back_too_small += 1;
            return Ok(0);
        }
        if quota_tokens.is_some_and(|q| tokens > q) {
            self.stats.load_back_over_quota += 1;
            return Ok(0);
        }
        if !self.ctrl.has_room(StreamKind::Load) {
            // Checked before anything is locked or evicted, so the refusal changes nothing.
            self.stats.load_back_queue_full += 1;
            return Err(radixkv_radix::CacheError::Busy(
                "host tier load queue is full",
            ));
        }
        // Locking the anchor protects the device prefix from eviction and the host chain from
        // host eviction while room is made.
        let lock = self.inner.inc_lock_ref(anchor)?;
        // A device state at the anchor (SWA and Mamba: only its window is loaded) is locked
        // too, so that no slot allocation below evicts it.
        let lock = if self.mamba && state.is_none() {
            let (tree, _) = self.inner.parts_mut();
            let with_state = tree.inc_lock_ref_mamba(anchor)?;
            tree.dec_lock_ref(lock)?;
            with_state
        } else {
            lock
        };
        let need = tokens / p;
        let free = self.pools().pages.available();
        if free < need {
            self.evict_device((need - free) * p);
        }
        let mut extra = Vec::new();
        if let Some(h) = state {
            let (tree, _) = self.inner.parts_mut();
            match tree.alloc_mamba_slot() {
                Ok(slot) => extra.push(PoolTransfer {
                    name: PoolName::Mamba,
                    host_indices: vec![h],
                    device_indices: vec![slot],
                }),
                Err(_) => {
                    tree.dec_lock_ref(lock)?;
                    self.stats.mamba_load_back_no_slot += 1;
                    return Ok(0);
                }
            }
        }
        let dev_slot = extra.first().map(|t| t.device_indices[0]);
        if self.mamba {
            // The request still needs its own running slot (`begin_request` takes it after
            // the load is queued): a load that leaves none would be queued for a request that
            // then fails with no state slot, so it is not made (nothing changes).
            let (tree, _) = self.inner.parts_mut();
            let a = tree.mamba_accounting()?;
            // The device prefix's own state, locked above only so that a declined load keeps
            // it, is superseded by a queued load: the request's slot may evict it then.
            let own = usize::from(
                kept_state
                    && tree.mamba_state(device_end)?.is_some()
                    && tree.mamba_lock_ref(device_end)? == 1,
            );
            if a.free + a.evictable + own == 0 {
                if let Some(s) = dev_slot {
                    tree.free_mamba_slot(s)?;
                }
                tree.dec_lock_ref(lock)?;
                self.stats.mamba_load_back_no_slot += 1;
                return Ok(0);
            }
        }
        let window_pages: usize = windows.iter().map(|(_, h)| h.len()).sum();
        let mut swa_dev: Vec<PageId> = Vec::new();
        if window_pages > 0 {
            let (tree, _) = self.inner.parts_mut();
            for &m in &live {
                tree.pin_swa_pages(m)?;
            }
            let got = tree.alloc_swa_pages(window_pages, &mut swa_dev);
            for &m in &live {
                let pages = tree.swa_pages(m)?.map_or(0, <[PageId]>::len);
                tree.unpin_swa_pages(m, pages)?;
            }
            if got.is_err() {
                if let Some(s) = dev_slot {
                    tree.free_mamba_slot(s)?;
                }
                tree.dec_lock_ref(lock)?;
                self.stats.swa_load_back_no_pages += 1;
                return Ok(0);
            }
            extra.push(PoolTransfer {
                name: PoolName::Swa,
                host_indices: windows
                    .iter()
                    .flat_map(|(_, h)| h.iter().copied())
                    .collect(),
                device_indices: swa_dev.iter().map(|p| p.0).collect(),
            });
        }
        // The load's host pages, kept by its pending entry.
        let mut host = Vec::with_capacity(need);
        for &c in &chain {
            host.extend_from_slice(self.inner.tree().host_pages(c)?.unwrap_or(&[]));
        }
        let (tree, pools) = self.inner.parts_mut();
        let loaded = self
            .ctrl
            .load(&host, &mut pools.pages, extra)
            .map(|op| (op.id, op.device_pages.clone()));
        let (id, dev) = match loaded {
            Ok(v) => v,
            Err(e) => {
                if let Some(s) = dev_slot {
                    tree.free_mamba_slot(s)?;
                }
                if !swa_dev.is_empty() {
                    tree.free_swa_pages(&swa_dev)?;
                }
                tree.dec_lock_ref(lock)?;
                if matches!(e, HiCacheError::DeviceFull { .. }) {
                    self.stats.load_back_device_full += 1;
                    return Ok(0);
                }
                return Err(e.into());
            }
        };
        pools.pages.mark_tree_owned(&dev)?;
        let mut at = 0;
        for &c in &chain {
            let len = tree.node_key(c)?.len() / p;
            tree.attach_device_pages(c, &dev[at..at + len])?;
            at += len;
        }
        let mut lock = lock;
        if let Some(s) = dev_slot {
            tree.attach_mamba_state(anchor, s)?;
            // The state is locked too until the ack: its slot must not be reused while the
            // copy writes it.
            let with_state = tree.inc_lock_ref_mamba(anchor)?;
            tree.dec_lock_ref(std::mem::replace(&mut lock, with_state))?;
        }
        let mut swa = Vec::with_capacity(windows.len());
        let mut swa_pins = Vec::new();
        let mut at = 0;
        for (w, h) in windows {
            let dev = swa_dev[at..at + h.len()].to_vec();
            at += h.len();
            tree.attach_swa_pages(w, &dev)?;
            if !self.mutations.unpinned_loads {
                // Until the ack the pages hold no KV yet: they must not be tombstoned and
                // handed to a request.
                tree.pin_swa_pages(w)?;
                swa_pins.push((w, dev.len()));
            }
            swa.push((w, h, dev));
        }
        let lock = if self.mutations.unpinned_loads {
            tree.dec_lock_ref(lock)?;
            None
        } else {
            Some(lock)
        };
        for &b in &between {
            req.prefix_pages.extend_from_slice(tree.device_pages(b)?);
        }
        req.prefix_pages.extend_from_slice(&dev);
        // The pending load keeps the lists (a failed copy is repaired from them).
        self.pending_loads.insert(
            id,
            PendingLoad {
                lock,
                last: anchor,
                host,
                device: dev,
                state: state.zip(dev_slot),
                swa,
                swa_pins,
            },
        );
        req.prefix_len += gain;
        req.kv_match_len = req.kv_match_len.max(req.prefix_len);
        req.host_hit_len = 0;
        req.last_node = Some(anchor);
        self.stats.loaded_tokens += tokens as u64;
        if dev_slot.is_some() {
            self.stats.mamba_states_loaded += 1;
        }
        self.stats.swa_pages_loaded += window_pages as u64;
        Ok(gain)
    }
}
