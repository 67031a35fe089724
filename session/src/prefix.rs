//! [`PrefixCache`] for [`SessionAwareCache`]: streaming turns are answered from their session's
//! slot; everything else is delegated to the inner cache.

use radixkv_radix::{
    CacheError, DevicePools, FinishKind, InsertOptions, InsertResult, InvariantViolation, KeyRef,
    KvEvent, LockReceipt, MambaTrack, NodeId, PageId, PrefixCache, RequestKv, RequestMatch, Result,
    RowHolder, TreeMatch, align_down, ensure_inv, pages_for, refuse_partial_key_finish,
};

use crate::cache::{SessionAwareCache, adopt_history};
use crate::clock::Clock;

/// How a request relates to the session table.
enum Route {
    /// Not a streaming session turn: the inner cache handles it.
    Inner,
    /// A turn of streaming session `id`.
    Session(u64),
}

impl<C: PrefixCache, K: Clock> SessionAwareCache<C, K> {
    fn route(&self, req: &RequestKv) -> Route {
        match req.session {
            Some(tag)
                if tag.streaming
                    && (req.kv_lent || self.sessions.get(&tag.id).is_none_or(|s| s.streaming)) =>
            {
                Route::Session(tag.id)
            }
            _ => Route::Inner,
        }
    }

    /// Lends session `id`'s slot to `req` (or re-lends it to the same request after a rejected
    /// admission). Returns None when the slot cannot serve this key: it is then demoted and the
    /// caller matches the tree instead.
    fn lend(&mut self, id: u64, req: &mut RequestKv) -> Result<Option<RequestMatch>> {
        let p = self.inner.page_size();
        let max = req.max_match_len();
        let again = req.kv_lent;
        let Some(slot) = self.sessions.get(&id).and_then(|s| s.slot.as_ref()) else {
            return Err(CacheError::InvalidRequestState(
                "request marked as lent but its session holds no slot",
            ));
        };
        if again && (!slot.lent || req.row != Some(slot.row)) {
            return Err(CacheError::InvalidRequestState(
                "request marked as lent does not hold its session's row",
            ));
        }
        // The key already obeys the len − 1 rule; a retract retry can leave committed one past it.
        let prefix = slot.committed_len.min(max);
        // A Mamba state is the state after exactly the committed tokens: it cannot be cut back.
        let state_cut = slot.mamba_slot.is_some() && prefix < slot.committed_len;
        // Nor can the window: a cut needs the window before its end, which may have slid out.
        let evicted = if again {
            req.swa_evicted_len
        } else {
            slot.swa_evicted_len
        };
        let window_cut = self
            .inner
            .sliding_window()
            .is_some_and(|w| evicted > align_down(prefix, p).saturating_sub(w));
        if prefix < slot.cache_protected_len || state_cut || window_cut {
            // Sessions are append-only: below the tree-owned prefix the row cannot be reused in
            // place (writing there would overwrite shared pages).
            if again {
                return Err(CacheError::InvalidRequestState(
                    "re-match of a lent turn below its session's protected prefix",
                ));
            }
            self.demote_idle(id)?;
            return Ok(None);
        }
        let row = slot.row;
        let window_state = self.inner.has_window_state();
        if !again {
            // The request takes the slot's KV: its row and lengths, its window table and, with
            // sliding-window layers, the lock on the tree's window pages in it (a slide may
            // release that part; it comes back with the row).
            let Some(slot) = self.sessions.get_mut(&id).and_then(|s| s.slot.as_mut()) else {
                return Err(CacheError::InvalidRequestState("session slot vanished"));
            };
            req.row = Some(row);
            req.committed_len = slot.committed_len;
            req.allocated_len = slot.allocated_len;
            req.cache_protected_len = slot.cache_protected_len;
            req.swa_evicted_len = slot.swa_evicted_len;
            req.swa_pages = std::mem::take(&mut slot.swa_pages);
            if window_state {
                req.lock = slot.lock.take();
            }
        }
        // Pool calls first: if one fails (a stale row would be a bug), the slot stays idle.
        let cut = self.inner.truncate_request(req, prefix).and_then(|()| {
            let pools = self.inner.pools_mut();
            pools.rows.set_holder(row, RowHolder::Request)?;
            req.prefix_pages.clear();
            let lent_pages = pools.rows.pages(row)?.get(..pages_for(prefix, p)).ok_or(
                CacheError::InvalidRequestState("session row is shorter than its committed KV"),
            )?;
            req.prefix_pages.extend_from_slice(lent_pages);
            Ok(())
        });
        if let Err(e) = cut {
            if !again && let Some(slot) = self.sessions.get_mut(&id).and_then(|s| s.slot.as_mut()) {
                slot.swa_pages = std::mem::take(&mut req.swa_pages);
                if let Some(l) = req.lock.take() {
                    slot.lock = Some(l);
                }
                req.clear_kv_state();
            }
            return Err(e);
        }
        if !again {
            self.unmark_idle(id);
        }
        let Some(slot) = self.sessions.get_mut(&id).and_then(|s| s.slot.as_mut()) else {
            return Err(CacheError::InvalidRequestState("session slot vanished"));
        };
        slot.lent = true;
        slot.committed_len = prefix;
        slot.allocated_len = prefix;
        slot.held_window_pages = 0;
        req.row = Some(row);
        req.prefix_len = prefix;
        req.host_hit_len = 0;
        req.last_node = None;
        req.load_anchor = None;
        req.committed_len = prefix;
        req.allocated_len = prefix;
        req.cache_protected_len = slot.cache_protected_len;
        // The running state continues in place: no copy, no cut back to a cached state.
        req.mamba_slot = slot.mamba_slot;
        req.mamba_track = slot.mamba_track;
        req.mamba_cow = None;
        req.kv_match_len = 0;
        req.kv_lent = true;
        Ok(Some(RequestMatch {
            prefix_len: prefix,
            host_hit_len: 0,
            from_session: true,
        }))
    }

    /// End of a lent turn: the slot takes its row back, either at the turn's end (finished)
    /// or rolled back to the previous turn (aborted, retracted).
    fn take_back(&mut self, id: u64, req: &mut RequestKv, kind: FinishKind) -> Result<()> {
        let p = self.inner.page_size();
        let Some(s) = self.sessions.get(&id) else {
            return Err(CacheError::InvalidRequestState(
                "lent turn of an unknown session",
            ));
        };
        let Some(slot) = s
            .slot
            .as_ref()
            .filter(|sl| sl.lent && req.row == Some(sl.row))
        else {
            return Err(CacheError::InvalidRequestState(
                "request marked as lent does not hold its session's row",
            ));
        };
        let row = slot.row;
        let previous = slot.committed_len;
        // An aborted or retracted turn that allocated KV may have run a forward pass: that
        // advanced the running Mamba state in place past the slot's tokens (stale: the slot is
        // demoted without it below), and may have slid the window past the slot's end.
        let ran = req.allocated_len > previous;
        if kind == FinishKind::Aborted
            && ran
            && self
                .inner
                .sliding_window()
                .is_some_and(|w| req.swa_evicted_len > align_down(previous, p).saturating_sub(w))
        {
            return self.drop_windowless(id, req, previous);
        }
        let keep_len = match kind {
            FinishKind::Finished => req.committed_len.min(req.allocated_len).min(req.key_len()),
            FinishKind::Aborted => previous,
        };
        // The row and the window table go back to what the slot keeps.
        let trimmed = self.inner.truncate_request(req, keep_len);
        let Some(s) = self.sessions.get_mut(&id) else {
            return Err(CacheError::InvalidRequestState("session vanished"));
        };
        let Some(slot) = s.slot.as_mut() else {
            return Err(CacheError::InvalidRequestState("session slot vanished"));
        };
        let mut stale_state = None;
        let mut stale_track = None;
        match kind {
            FinishKind::Finished => {
                slot.committed_len = keep_len;
                slot.allocated_len = keep_len;
                slot.mamba_slot = req.mamba_slot.take();
                // The engine keeps the tracked state at the last page boundary it computed.
                slot.mamba_track = req.mamba_track.take().map(|t| MambaTrack {
                    pos: align_down(keep_len, p),
                    ..t
                });
                // The match verified that the key extends the history.
                adopt_history(&mut s.history, &mut s.history_hash, req, p);
            }
            FinishKind::Aborted => {
                if slot.mamba_slot.is_some() && ran {
                    stale_state = slot.mamba_slot.take();
                    stale_track = slot.mamba_track.take();
                }
                slot.allocated_len = slot.committed_len;
            }
        }
        // The window KV (and the lock lent with it) comes back with the row.
        slot.swa_evicted_len = req.swa_evicted_len;
        slot.swa_pages = std::mem::take(&mut req.swa_pages);
        let stray_lock = match (req.lock.take(), slot.lock.is_some()) {
            (Some(l), false) => {
                slot.lock = Some(l);
                None
            }
            (l, _) => l,
        };
        slot.held_window_pages = slot.own_window_pages(p);
        // A lent turn plans no checkpoints of its own; should it hold any, the slot takes
        // them (stored with the KV on demotion, past the committed KV freed then).
        slot.mamba_checkpoints
            .extend(std::mem::take(&mut req.mamba_checkpoints));
        slot.mamba_checkpoints.sort_by_key(|c| c.pos);
        slot.lent = false;
        let closing = s.closing;
        req.clear_kv_state();
        let unlocked = match stray_lock {
            Some(l) => self.inner.dec_lock_ref(l),
            None => Ok(()),
        };
        let held = self
            .inner
            .pools_mut()
            .rows
            .set_holder(row, RowHolder::Session);
        let owned = self.owned_tokens(row);
        if let Some(slot) = self.sessions.get_mut(&id).and_then(|s| s.slot.as_mut()) {
            slot.held_tokens = owned.as_ref().copied().unwrap_or(0);
        }
        self.mark_idle(id);
        let done = trimmed.and(unlocked).and(held).and(owned.map(|_| ()));
        if closing {
            let slot = self.take_idle_slot(id);
            let history = self
                .sessions
                .remove(&id)
                .map(|s| s.history)
                .unwrap_or_default();
            if let Some(slot) = slot {
                match kind {
                    FinishKind::Finished => self.cache_slot(slot, history)?,
                    FinishKind::Aborted => self.release_slot(slot)?,
                }
            }
            if stale_state.is_some() || stale_track.is_some() {
                self.free_states(stale_state, stale_track, Vec::new())?;
            }
            return done;
        }
        done?;
        if stale_state.is_some() {
            // The KV is still exact: it goes to the tree as cache, without a state.
            let freed = self.free_states(stale_state, stale_track, Vec::new());
            let demoted = self.demote_idle(id).map(|_| ());
            return freed.and(demoted);
        }
        if kind == FinishKind::Finished {
            self.after_save(id)?;
        }
        Ok(())
    }

    /// An aborted lent turn that slid the window past its slot's end: the slot cannot continue
    /// (the window before its end is gone). The slot's KV, still exact, is finished by the
    /// inner cache as a request that computed `previous` tokens: cached where its window
    /// starts at or before the page-aligned end (the window KV before it tombstoned), freed
    /// otherwise; the running Mamba state ran past it and is freed. The session keeps its
    /// history without a slot (closed, if its close waited for this turn).
    fn drop_windowless(&mut self, id: u64, req: &mut RequestKv, previous: usize) -> Result<()> {
        let p = self.inner.page_size();
        let Some(s) = self.sessions.get_mut(&id) else {
            return Err(CacheError::InvalidRequestState("session vanished"));
        };
        let slot = s.slot.take();
        if s.closing {
            self.sessions.remove(&id);
        }
        let stale = self.free_states(req.mamba_slot.take(), req.mamba_track.take(), Vec::new());
        if let Some(slot) = slot {
            req.mamba_checkpoints.extend(slot.mamba_checkpoints);
            req.mamba_checkpoints.sort_by_key(|c| c.pos);
            if let Some(l) = slot.lock
                && let Some(stray) = req.lock.replace(l)
            {
                self.inner.dec_lock_ref(stray)?;
            }
        }
        req.committed_len = previous;
        let kind = if req.swa_evicted_len <= align_down(previous, p) {
            FinishKind::Finished
        } else {
            FinishKind::Aborted
        };
        let finished = self.inner.cache_finished_req(req, kind);
        stale.and(finished)
    }

    /// End of a turn that ran through the inner cache (first turn, or after a demotion): the
    /// session takes its KV if it can, otherwise the inner cache finishes it.
    fn finish_unlent(&mut self, id: u64, req: &mut RequestKv, kind: FinishKind) -> Result<()> {
        let p = self.inner.page_size();
        // Checking that the turn extends the history guards against a second, concurrent
        // request of the same session: only such a turn becomes the history and the new slot.
        let extends = kind == FinishKind::Finished
            && self.sessions.get(&id).is_some_and(|s| {
                s.streaming
                    && !s.closing
                    && s.slot.is_none()
                    && Self::check_extends(id, s, req, p).is_ok()
            });
        let savable = extends
            && req.row.is_some()
            && req.committed_len > 0
            && req.committed_len >= req.cache_protected_len;
        if !savable {
            // A finished turn that extends the history is the session's history even when it
            // left no KV to keep (nothing committed yet): the next turn must extend it.
            if extends && let Some(s) = self.sessions.get_mut(&id) {
                adopt_history(&mut s.history, &mut s.history_hash, req, p);
            }
            return self.inner.cache_finished_req(req, kind);
        }
        let lock = req.lock.take();
        let slot = match self.slot_from_request(req, lock) {
            Ok(slot) => slot,
            Err(e) => {
                // Nothing was handed over: finish as an ordinary request so nothing leaks.
                self.inner.cache_finished_req(req, FinishKind::Aborted)?;
                return Err(e);
            }
        };
        let Some(s) = self.sessions.get_mut(&id) else {
            return Err(CacheError::InvalidRequestState("session vanished"));
        };
        adopt_history(&mut s.history, &mut s.history_hash, req, p);
        s.slot = Some(slot);
        req.clear_kv_state();
        self.mark_idle(id);
        self.after_save(id)
    }
}

impl<C: PrefixCache, K: Clock> PrefixCache for SessionAwareCache<C, K> {
    fn page_size(&self) -> usize {
        self.inner.page_size()
    }

    fn page_hasher(&self) -> radixkv_radix::PageHasher {
        self.inner.page_hasher()
    }

    fn has_state_slots(&self) -> bool {
        self.inner.has_state_slots()
    }

    /// The inner cache's: a turn's finish restores a key it needs whole
    /// ([`PrefixCache::restore_key`]), and the session's own calls read none before the lock.
    fn takes_windowed_keys(&self) -> bool {
        self.inner.takes_windowed_keys()
    }

    fn restore_key(&self, req: &mut RequestKv) -> Result<()> {
        self.inner.restore_key(req)
    }

    fn pools(&self) -> &DevicePools {
        self.inner.pools()
    }

    fn pools_mut(&mut self) -> &mut DevicePools {
        self.inner.pools_mut()
    }

    fn match_prefix(&mut self, key: KeyRef<'_>, out: &mut Vec<PageId>) -> Result<TreeMatch> {
        self.inner.match_prefix(key, out)
    }

    fn insert(
        &mut self,
        key: KeyRef<'_>,
        pages: &[PageId],
        opts: InsertOptions,
    ) -> Result<InsertResult> {
        self.inner.insert(key, pages, opts)
    }

    /// Evicts from the inner cache only; idle sessions are demoted by the budget, the TTL and
    /// allocation pressure, never by a plain evict.
    fn evict(&mut self, tokens: usize) -> usize {
        self.inner.evict(tokens)
    }

    fn inc_lock_ref(&mut self, node: NodeId) -> Result<LockReceipt> {
        self.inner.inc_lock_ref(node)
    }

    fn dec_lock_ref(&mut self, receipt: LockReceipt) -> Result<()> {
        self.inner.dec_lock_ref(receipt)
    }

    /// The inner cache's, plus what idle sessions hold (a lock changes neither that nor
    /// anything else this adds).
    fn available_tokens_if_locked(&mut self, node: NodeId) -> Result<usize> {
        Ok(self.inner.available_tokens_if_locked(node)? + self.held_tokens)
    }

    fn evictable_tokens(&self) -> usize {
        self.inner.evictable_tokens()
    }

    fn protected_tokens(&self) -> usize {
        self.inner.protected_tokens()
    }

    fn session_held_tokens(&self) -> usize {
        self.held_tokens
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        self.inner.take_events()
    }

    fn events_dropped(&self) -> u64 {
        self.inner.events_dropped()
    }

    /// # Errors
    /// [`CacheError::Busy`] while any session holds a slot (close or demote them first).
    fn reset(&mut self) -> Result<()> {
        if self.sessions.values().any(|s| s.slot.is_some()) {
            return Err(CacheError::Busy("sessions hold KV"));
        }
        self.inner.reset()
    }

    /// The inner cache's audit of the request (its Mamba slot included).
    fn check_request(&self, req: &RequestKv) -> std::result::Result<(), InvariantViolation> {
        self.inner.check_request(req)
    }

    fn has_window_state(&self) -> bool {
        self.inner.has_window_state()
    }

    fn sliding_window(&self) -> Option<usize> {
        self.inner.sliding_window()
    }

    fn check_parked(
        &self,
        req: &RequestKv,
        lock: Option<&LockReceipt>,
    ) -> std::result::Result<(), InvariantViolation> {
        self.inner.check_parked(req, lock)
    }

    fn truncate_request(&mut self, req: &mut RequestKv, len: usize) -> Result<()> {
        self.inner.truncate_request(req, len)
    }

    fn check_invariants(&self) -> std::result::Result<(), InvariantViolation> {
        self.inner.check_invariants()?;
        let mut states = ahash::HashSet::default();
        let mut idle_states = 0usize;
        let mut idle_window = 0usize;
        let pools = self.inner.pools();
        let p = self.inner.page_size();
        let mut idle = 0usize;
        let mut held = 0usize;
        for (&id, s) in &self.sessions {
            let Some(slot) = s.slot.as_ref() else {
                ensure_inv!(
                    s.idle_key.is_none(),
                    "session {id} has no slot but is indexed as idle"
                );
                continue;
            };
            let holder = pools.rows.holder(slot.row);
            let want = if slot.lent {
                RowHolder::Request
            } else {
                RowHolder::Session
            };
            ensure_inv!(
                holder == Ok(want),
                "session {id}: row {:?} holder {holder:?}, expected {want:?}",
                slot.row
            );
            let prot = pools.rows.protected_pages(slot.row).unwrap_or(usize::MAX);
            ensure_inv!(
                prot * p == slot.cache_protected_len
                    && slot.cache_protected_len <= slot.committed_len,
                "session {id}: row protects {prot} pages, slot {}",
                slot.cache_protected_len
            );
            // With sliding-window layers a lent slot's lock travels with its window table.
            let lock_lent = slot.lent && self.inner.has_window_state();
            ensure_inv!(
                slot.lock.is_some() != lock_lent || (slot.cache_protected_len == 0 && !lock_lent),
                "session {id}: protected prefix without a lock, or a lent lock kept"
            );
            for st in slot
                .mamba_slot
                .iter()
                .chain(slot.mamba_track.as_ref().map(|t| &t.slot))
                .chain(slot.mamba_checkpoints.iter().map(|c| &c.slot))
            {
                ensure_inv!(
                    states.insert(*st),
                    "session {id}: state slot {st} is held twice"
                );
            }
            if slot.lent {
                ensure_inv!(
                    s.idle_key.is_none(),
                    "session {id}: lent slot is indexed as idle"
                );
                ensure_inv!(
                    slot.swa_pages.is_empty() && slot.held_window_pages == 0,
                    "session {id}: a lent slot keeps window pages"
                );
                continue;
            }
            idle += 1;
            idle_states += slot.state_slots();
            idle_window += slot.held_window_pages;
            ensure_inv!(
                slot.held_window_pages == slot.own_window_pages(p),
                "session {id}: cached held window pages {} but the table owns {}",
                slot.held_window_pages,
                slot.own_window_pages(p)
            );
            // The slot as the request it was: the inner cache audits its row, Mamba slots and
            // window table (with the slot's receipt for the tree's window pages in it).
            let as_req = RequestKv {
                row: Some(slot.row),
                committed_len: slot.committed_len,
                allocated_len: slot.allocated_len,
                cache_protected_len: slot.cache_protected_len,
                mamba_slot: slot.mamba_slot,
                mamba_track: slot.mamba_track,
                mamba_checkpoints: slot.mamba_checkpoints.clone(),
                swa_evicted_len: slot.swa_evicted_len,
                swa_pages: slot.swa_pages.clone(),
                ..RequestKv::default()
            };
            self.inner
                .check_parked(&as_req, slot.lock.as_ref())
                .map_err(|e| InvariantViolation(format!("session {id}: {}", e.0)))?;
            ensure_inv!(
                slot.mamba_checkpoints
                    .iter()
                    .all(|c| c.pos <= slot.committed_len),
                "session {id}: a Mamba checkpoint lies past the committed KV"
            );
            let pages = pools.rows.pages(slot.row).map(|v| v.len()).unwrap_or(0);
            ensure_inv!(
                slot.committed_len >= slot.cache_protected_len
                    && slot.allocated_len == slot.committed_len
                    && pages == pages_for(slot.committed_len, p)
                    && slot.committed_len <= s.history.len(),
                "session {id}: idle slot committed {} allocated {} protected {} pages {pages} \
                 history {}",
                slot.committed_len,
                slot.allocated_len,
                slot.cache_protected_len,
                s.history.len()
            );
            ensure_inv!(
                slot.held_tokens == (pages - prot) * p,
                "session {id}: cached held tokens {} but row owns {} pages",
                slot.held_tokens,
                pages - prot
            );
            let Some((t, seq)) = s.idle_key else {
                return Err(InvariantViolation(format!(
                    "session {id}: idle slot is not indexed"
                )));
            };
            ensure_inv!(
                self.lru.contains(&(t, seq, id))
                    && s.ttl.is_none_or(|ttl| self.expiry.contains(&(
                        t.saturating_add(ttl),
                        seq,
                        id
                    ))),
                "session {id}: idle index entry missing"
            );
            held += slot.held_tokens;
        }
        ensure_inv!(
            idle_window == self.held_window,
            "session window pages: {idle_window} owned by idle slots, counter {}",
            self.held_window
        );
        ensure_inv!(
            idle_states == self.held_states,
            "session state slots: {idle_states} held by idle slots, counter {}",
            self.held_states
        );
        ensure_inv!(
            self.lru.len() == idle
                && self.expiry.len() <= idle
                && held == self.held_tokens
                && pools.session_held_pages() * p == self.held_tokens,
            "session accounting: {} idle slots, {} indexed, held {held} / counter {} / pool {}",
            idle,
            self.lru.len(),
            self.held_tokens,
            pools.session_held_pages() * p
        );
        let session_rows = pools
            .rows
            .iter()
            .filter(|(_, h, _, _)| *h == RowHolder::Session)
            .count();
        ensure_inv!(
            session_rows == idle,
            "{session_rows} rows are session-held but {idle} slots are idle"
        );
        ensure_inv!(
            self.accounting().balanced(),
            "pool accounting does not balance: {:?}",
            self.accounting()
        );
        Ok(())
    }

    fn match_request(&mut self, req: &mut RequestKv) -> Result<RequestMatch> {
        let Route::Session(id) = self.route(req) else {
            return self.inner.match_request(req);
        };
        self.validate_turn(req).map_err(CacheError::from)?;
        let has_slot = self.sessions.get(&id).is_some_and(|s| s.slot.is_some());
        if (req.kv_lent || has_slot)
            && let Some(m) = self.lend(id, req)?
        {
            return Ok(m);
        }
        self.inner.match_request(req)
    }

    /// A request that finds no free state slot (every Mamba slot running, locked or held by
    /// a session) demotes idle sessions holding one, least recently used first, and retries:
    /// a held session state never keeps a new request from starting.
    fn begin_request(&mut self, req: &mut RequestKv) -> Result<()> {
        if !req.kv_lent {
            loop {
                match self.inner.begin_request(req) {
                    Err(CacheError::OutOfStateSlots { .. }) if self.reclaim_state()? => {}
                    r => return r,
                }
            }
        }
        // A lent turn got its row and prefix at match time; the slot keeps the lock.
        match req.row {
            Some(row) if self.inner.pools().rows.holder(row) == Ok(RowHolder::Request) => Ok(()),
            _ => Err(CacheError::InvalidRequestState(
                "lent request without its session's row",
            )),
        }
    }

    /// The inner allocation; when the full-KV pool is short, idle sessions are demoted (least
    /// recently used first) and it is retried, and likewise when the sliding-window pool is
    /// short, demoting idle sessions that own window pages.
    fn alloc_tokens(&mut self, req: &mut RequestKv, n: usize) -> Result<()> {
        let (mut kv_tried, mut window_tried) = (false, false);
        loop {
            let retry = match self.inner.alloc_tokens(req, n) {
                Err(CacheError::OutOfPages { needed, .. }) if !kv_tried => {
                    kv_tried = true;
                    self.reclaim_for(needed.saturating_mul(self.inner.page_size()))?
                }
                Err(CacheError::OutOfComponentPages {
                    component: "swa",
                    needed,
                    available,
                }) if !window_tried => {
                    window_tried = true;
                    // The new pages take as many full-KV pages: windows are reclaimed only when
                    // those can be found too, so that a failing allocation demotes nothing.
                    let kv = needed.saturating_mul(self.inner.page_size());
                    if self
                        .inner
                        .available_tokens()
                        .saturating_add(self.held_tokens)
                        < kv
                    {
                        false
                    } else {
                        self.reclaim_window(needed.saturating_sub(available))?
                    }
                }
                r => return r,
            };
            if !retry {
                // Nothing was demoted: the allocation fails as it did.
                return self.inner.alloc_tokens(req, n);
            }
        }
    }

    fn cache_unfinished_req(&mut self, req: &mut RequestKv) -> Result<()> {
        if req.kv_lent {
            // Later turns stay in the session's row; they reach the tree on demotion. The
            // tracking position follows the computed KV as the inner cache's chunk would move it.
            let p = self.inner.page_size();
            if let Some(t) = &mut req.mamba_track {
                t.pos = t.pos.max(align_down(req.committed_len, p));
            }
            return Ok(());
        }
        self.inner.cache_unfinished_req(req)
    }

    fn cache_finished_req(&mut self, req: &mut RequestKv, kind: FinishKind) -> Result<()> {
        let Route::Session(id) = self.route(req) else {
            return self.inner.cache_finished_req(req, kind);
        };
        // A session keeps the turn's whole key as its history: a key that dropped its cached
        // prefix is refused where the inner cache cannot give it back.
        if let Some(refused) = refuse_partial_key_finish(self, req, kind) {
            return refused;
        }
        // A lent turn dropped at most its slot's cached prefix, which the history holds: its
        // finish reads only the tokens past the history. Any other finished turn's finish reads
        // the whole key (the extension check from the start of the history, or a first turn's
        // key taken whole), so it gets it back from the tree. An aborted turn's reads none.
        if kind == FinishKind::Finished
            && req.key_start > 0
            && !(req.kv_lent
                && self
                    .sessions
                    .get(&id)
                    .is_some_and(|s| req.key_start <= s.history.len()))
            && let Err(e) = self.inner.restore_key(req)
        {
            let released = if req.kv_lent {
                self.take_back(id, req, FinishKind::Aborted)
            } else {
                self.inner.cache_finished_req(req, FinishKind::Aborted)
            };
            return released.and(Err(e));
        }
        if req.kv_lent {
            self.take_back(id, req, kind)
        } else {
            self.finish_unlent(id, req, kind)
        }
    }

    /// Forwarded: a lent turn holds its session's window table (and the lock on the tree's
    /// window pages in it) while it runs, so the inner cache slides it as any request's.
    fn slide_window(&mut self, req: &mut RequestKv) -> Result<usize> {
        self.inner.slide_window(req)
    }

    fn alloc_pages(&mut self, n: usize) -> Result<Vec<PageId>> {
        match self.inner.alloc_pages(n) {
            Err(CacheError::OutOfPages { .. })
                if self.reclaim_for(n.saturating_mul(self.inner.page_size()))? =>
            {
                self.inner.alloc_pages(n)
            }
            r => r,
        }
    }

    /// The inner cache's `make_room`; when that fails, idle sessions are demoted (least
    /// recently used first) and it is retried, as for [`PrefixCache::alloc_pages`].
    fn make_room(&mut self, n: usize) -> Result<()> {
        match self.inner.make_room(n) {
            Err(CacheError::OutOfPages { .. })
                if self.reclaim_for(n.saturating_mul(self.inner.page_size()))? =>
            {
                self.inner.make_room(n)
            }
            r => r,
        }
    }

    /// Free plus evictable tokens of the inner cache, plus what idle sessions hold (allocation
    /// demotes them under pressure, so admission may count on it).
    fn available_tokens(&self) -> usize {
        self.inner.available_tokens() + self.held_tokens
    }
}
