//! [`SessionAwareCache`]: the session table, slots, the idle index and the session API.
//! The [`PrefixCache`] implementation lives in `prefix.rs`.

use std::collections::BTreeSet;

use ahash::HashMap;
use radixkv_radix::{
    CacheError, FinishKind, LockReceipt, MambaCheckpoint, MambaTrack, PageHash, PageId,
    PrefixCache, RadixKey, RequestKv, RowHolder, RowId, align_down,
};

use crate::clock::{Clock, SystemClock};
use crate::error::SessionError;

/// Bounds on the KV that idle sessions may hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionConfig {
    /// Global budget: tokens all idle sessions together may hold (owned pages, at page
    /// granularity). Over it, the least recently used idle sessions are demoted.
    pub max_held_tokens: usize,
    /// Tokens one session may hold; a turn that ends above it is demoted at once.
    pub max_session_tokens: usize,
    /// Default idle TTL in clock ticks (`None`: no expiry). [`SessionAwareCache::open`] may
    /// override it per session.
    pub idle_ttl: Option<u64>,
    /// State slots (Mamba running states and pending checkpoints) all idle sessions together
    /// may hold, over a cache with the Mamba component. Over it, the least recently used
    /// idle sessions are demoted. Independently of it, a new request that finds no free
    /// state slot demotes idle sessions holding one (see the crate docs), so held slots never
    /// keep a request from starting.
    pub max_held_state_slots: usize,
    /// Sliding-window pages (the window KV of their last turn, see the crate docs) all idle
    /// sessions together may own, over a cache with sliding-window layers. Over it, the least
    /// recently used idle sessions are demoted. Independently of it, an allocation that finds
    /// the window pool short demotes idle sessions owning window pages, so held windows never
    /// keep a request from running.
    pub max_held_window_pages: usize,
}

impl SessionConfig {
    /// A budget of `max_held_tokens`, a per-session cap of the same size, no TTL and no cap
    /// on held state slots or window pages beyond their pools (see
    /// [`SessionConfig::max_held_state_slots`], [`SessionConfig::max_held_window_pages`]).
    pub fn with_budget(max_held_tokens: usize) -> Self {
        SessionConfig {
            max_held_tokens,
            max_session_tokens: max_held_tokens,
            idle_ttl: None,
            max_held_state_slots: usize::MAX,
            max_held_window_pages: usize::MAX,
        }
    }
}

/// What [`SessionAwareCache::close`] did.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CloseOutcome {
    /// The session is gone and everything it held is released.
    Closed,
    /// A turn is in flight; the session closes when that turn ends.
    Deferred,
}

/// What [`SessionAwareCache::reap`] demoted.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ReapReport {
    /// Sessions demoted because their idle TTL passed.
    pub expired: usize,
    /// Sessions demoted to get back under the held-token budget.
    pub over_budget: usize,
}

/// A read-only view of one session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    /// Streaming sessions keep their KV between turns.
    pub streaming: bool,
    /// Tokens of the previous turns (prompt + output).
    pub history_len: usize,
    /// Tokens whose KV the slot holds (`None`: no slot, the next turn matches the tree).
    pub slot_committed_len: Option<usize>,
    /// True while the slot is lent to a running turn.
    pub lent: bool,
    /// True when a close waits for the turn in flight.
    pub closing: bool,
}

/// The KV a streaming session keeps between turns: everything a finished request owned.
///
/// While idle, the row is held by [`RowHolder::Session`] and its owned pages are
/// session-held; while lent, the row is held by the running request and counts as its own.
/// The lock receipt never leaves the slot: it keeps the first turn's cached prefix (the row's
/// protected pages) in the tree for the whole life of the slot.
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) row: RowId,
    pub(crate) lock: Option<LockReceipt>,
    pub(crate) committed_len: usize,
    pub(crate) allocated_len: usize,
    pub(crate) cache_protected_len: usize,
    /// The running Mamba state after the slot's committed tokens (a cache with the Mamba
    /// component): the next turn continues from it in place.
    pub(crate) mamba_slot: Option<u32>,
    /// Mamba checkpoints the turn took past its cached prefix (all at or below the committed
    /// KV): stored in the tree with the KV on demotion, freed on release.
    pub(crate) mamba_checkpoints: Vec<MambaCheckpoint>,
    /// The turn's Mamba tracking slot (the state at the last page boundary of the committed
    /// KV): lent with the running state, handed to the inner finish on demotion.
    pub(crate) mamba_track: Option<MambaTrack>,
    /// Sliding-window layers: the tokens before the window the slot holds (see
    /// [`RequestKv::swa_evicted_len`]).
    pub(crate) swa_evicted_len: usize,
    /// Sliding-window layers: the window KV of the committed tokens from `swa_evicted_len` on
    /// (see [`RequestKv::swa_pages`]): the tree's window pages of the cached prefix first,
    /// locked by `lock`, then the slot's own. Empty while lent (the running turn holds it).
    pub(crate) swa_pages: Vec<PageId>,
    pub(crate) lent: bool,
    /// Session-held tokens while idle (owned pages × page size), cached for O(1) accounting.
    pub(crate) held_tokens: usize,
    /// Window pages the slot owns while idle (its SWA table past the tree's pages).
    pub(crate) held_window_pages: usize,
}

impl Slot {
    /// State slots the slot holds (its running Mamba state, tracking slot and checkpoints),
    /// counted as a request's ([`RequestKv::mamba_slots_held`]).
    pub(crate) fn state_slots(&self) -> usize {
        RequestKv::count_mamba_slots(self.mamba_slot, self.mamba_track, &self.mamba_checkpoints)
    }

    /// The window pages of the slot's table that are its own (past the tree's window pages
    /// of its cached prefix).
    pub(crate) fn own_window_pages(&self, page_size: usize) -> usize {
        let tree_held = self
            .cache_protected_len
            .saturating_sub(self.swa_evicted_len)
            / page_size.max(1);
        self.swa_pages.len().saturating_sub(tree_held)
    }
}

#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) streaming: bool,
    pub(crate) ttl: Option<u64>,
    /// Prompt + output of all finished turns; the next streaming turn must extend it.
    pub(crate) history: RadixKey,
    /// The match hash of the history's page `k` − 1 with `k` (≥ 1), where a turn carried
    /// hashes ([`RequestKv::page_hashes`]) that far: a next turn whose hash there is the same
    /// extends the first `k` pages, and only the rest of the history is compared.
    pub(crate) history_hash: Option<(usize, PageHash)>,
    pub(crate) slot: Option<Slot>,
    pub(crate) closing: bool,
    /// (last use, sequence number) while the slot is idle: the key in the LRU and expiry sets.
    pub(crate) idle_key: Option<(u64, u64)>,
}

/// Makes `req`'s key, a finished turn's, session `s`'s history (`p` tokens per page). The
/// caller checked that it extends the history (`check_extends`), so only the new tail is
/// copied (O(new tokens)); an empty history, whose namespace is not the turn's yet, takes the
/// whole key, and so does a shorter key, which also drops the history hash (it named the
/// replaced history's pages). The turn's match hashes, where they reach further than the
/// history hash, become it: they are its key's chain, and the key is now the history.
///
/// A key that dropped its cached prefix ([`RequestKv::drop_cached_prefix`]) must still hold
/// the tokens past the history (a lent turn's key does: it dropped its slot's cached prefix,
/// which the history holds); the finish restores any other key first
/// ([`PrefixCache::restore_key`](radixkv_radix::PrefixCache::restore_key)).
pub(crate) fn adopt_history(
    history: &mut RadixKey,
    history_hash: &mut Option<(usize, PageHash)>,
    req: &RequestKv,
    p: usize,
) {
    let key = &req.key;
    let have = history.len();
    let len = req.key_len();
    if have == 0 || len < have {
        if req.key_start > 0 {
            debug_assert!(false, "a history taken from a key that lacks its prefix");
            return;
        }
        *history = key.clone();
        *history_hash = None;
    } else if let Some(tail) = req.key_tokens(have, len) {
        history.tokens.extend_from_slice(tail);
    } else {
        debug_assert!(false, "a key that lacks tokens of the history's extension");
        return;
    }
    let k = req.page_hashes.len().min(len / p);
    if let Some(h) = k.checked_sub(1).and_then(|i| req.page_hashes.get(i))
        && history_hash.is_none_or(|(old, _)| old < k)
    {
        *history_hash = Some((k, h));
    }
}

/// A decorator over any [`PrefixCache`] that keeps streaming sessions' KV between turns,
/// bounded by a held-token budget, an idle TTL and a per-session cap. See the crate docs.
pub struct SessionAwareCache<C, K = SystemClock> {
    pub(crate) inner: C,
    pub(crate) clock: K,
    pub(crate) cfg: SessionConfig,
    pub(crate) sessions: HashMap<u64, Session>,
    /// Idle slots by (last use, seq, id): the demotion order.
    pub(crate) lru: BTreeSet<(u64, u64, u64)>,
    /// Idle slots with a TTL by (deadline, seq, id).
    pub(crate) expiry: BTreeSet<(u64, u64, u64)>,
    pub(crate) seq: u64,
    /// Σ `held_tokens` over idle slots.
    pub(crate) held_tokens: usize,
    /// Σ state slots over idle slots.
    pub(crate) held_states: usize,
    /// Σ `held_window_pages` over idle slots.
    pub(crate) held_window: usize,
}

impl<C: std::fmt::Debug, K> std::fmt::Debug for SessionAwareCache<C, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionAwareCache")
            .field("inner", &self.inner)
            .field("cfg", &self.cfg)
            .field("sessions", &self.sessions.len())
            .field("idle_slots", &self.lru.len())
            .field("held_tokens", &self.held_tokens)
            .finish()
    }
}

impl<C: PrefixCache> SessionAwareCache<C, SystemClock> {
    /// Wraps `inner` with the wall clock (milliseconds; TTLs in milliseconds).
    pub fn new(inner: C, cfg: SessionConfig) -> Self {
        Self::with_clock(inner, cfg, SystemClock::new())
    }
}

impl<C: PrefixCache, K: Clock> SessionAwareCache<C, K> {
    /// Wraps `inner` with an explicit clock (tests pass a [`crate::ManualClock`]).
    pub fn with_clock(inner: C, cfg: SessionConfig, clock: K) -> Self {
        SessionAwareCache {
            inner,
            clock,
            cfg,
            sessions: HashMap::default(),
            lru: BTreeSet::new(),
            expiry: BTreeSet::new(),
            seq: 0,
            held_tokens: 0,
            held_states: 0,
            held_window: 0,
        }
    }

    /// The wrapped cache (read-only: mutating it behind the sessions' back would break the
    /// accounting).
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// The wrapped cache, mutably, for tier maintenance that leaves the device accounting of
    /// the sessions' slots alone (a tiered cache's `start_loading` / `step` at step
    /// boundaries). Tree-level calls must still go through the [`PrefixCache`] methods.
    pub fn inner_mut(&mut self) -> &mut C {
        &mut self.inner
    }

    /// The bounds in force.
    pub fn config(&self) -> &SessionConfig {
        &self.cfg
    }

    /// Changes the bounds; the next [`reap`](Self::reap) or turn end enforces them. Sessions
    /// already open keep the TTL they were opened with.
    pub fn set_config(&mut self, cfg: SessionConfig) {
        self.cfg = cfg;
    }

    /// Opens a session. `ttl` overrides the configured idle TTL (in clock ticks).
    ///
    /// # Errors
    /// [`SessionError::AlreadyOpen`].
    pub fn open(&mut self, id: u64, streaming: bool, ttl: Option<u64>) -> Result<(), SessionError> {
        if self.sessions.contains_key(&id) {
            return Err(SessionError::AlreadyOpen(id));
        }
        self.sessions.insert(
            id,
            Session {
                streaming,
                ttl: ttl.or(self.cfg.idle_ttl),
                history: RadixKey::default(),
                history_hash: None,
                slot: None,
                closing: false,
                idle_key: None,
            },
        );
        Ok(())
    }

    /// Closes a session. An idle slot is released at once (its owned pages are freed, its lock
    /// released); with a turn in flight the close is deferred to the end of that turn, whose
    /// KV is then cached like an ordinary finished request (or freed if the turn aborts).
    /// Closing again while deferred is a no-op.
    ///
    /// # Errors
    /// [`SessionError::Unknown`]; [`SessionError::Cache`] if the inner cache rejects the
    /// release (the session is gone anyway, nothing stays referenced).
    pub fn close(&mut self, id: u64) -> Result<CloseOutcome, SessionError> {
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or(SessionError::Unknown(id))?;
        if s.slot.as_ref().is_some_and(|sl| sl.lent) {
            s.closing = true;
            return Ok(CloseOutcome::Deferred);
        }
        let slot = self.take_idle_slot(id);
        self.sessions.remove(&id);
        if let Some(slot) = slot {
            self.release_slot(slot)?;
        }
        Ok(CloseOutcome::Closed)
    }

    /// Demotes one idle session now: its KV goes into the inner cache, its slot and row are
    /// released, the session stays open. Returns false if it held nothing idle.
    ///
    /// # Errors
    /// [`SessionError::Unknown`]; [`SessionError::Cache`] from the inner insert.
    pub fn demote(&mut self, id: u64) -> Result<bool, SessionError> {
        if !self.sessions.contains_key(&id) {
            return Err(SessionError::Unknown(id));
        }
        Ok(self.demote_idle(id)?)
    }

    /// Demotes idle sessions whose TTL passed, then least recently used ones until the held
    /// tokens fit the budget. Call it periodically (e.g. once per scheduling round); turn ends
    /// call it too.
    ///
    /// # Errors
    /// [`SessionError::Cache`] from the inner insert of a demoted session.
    pub fn reap(&mut self) -> Result<ReapReport, SessionError> {
        let mut report = ReapReport::default();
        let now = self.clock.now();
        while let Some(&(deadline, _, id)) = self.expiry.first() {
            if deadline > now {
                break;
            }
            self.demote_idle(id)?;
            report.expired += 1;
        }
        while self.held_tokens > self.cfg.max_held_tokens
            || self.held_states > self.cfg.max_held_state_slots
            || self.held_window > self.cfg.max_held_window_pages
        {
            let Some(&(_, _, id)) = self.lru.first() else {
                break;
            };
            self.demote_idle(id)?;
            report.over_budget += 1;
        }
        Ok(report)
    }

    /// Checks that `req` may start as the next turn of its streaming session: the session is
    /// open, has no other turn in flight, and the key extends its history. Requests without a
    /// streaming session always pass. [`PrefixCache::match_request`] runs the same check and
    /// reports failures as [`CacheError::Session`]; call this first for the typed reason.
    ///
    /// # Errors
    /// [`SessionError::Unknown`], [`SessionError::Closing`], [`SessionError::Busy`],
    /// [`SessionError::NotExtending`].
    pub fn validate_turn(&self, req: &RequestKv) -> Result<(), SessionError> {
        let Some(tag) = req.session.filter(|t| t.streaming) else {
            return Ok(());
        };
        let s = self
            .sessions
            .get(&tag.id)
            .ok_or(SessionError::Unknown(tag.id))?;
        if !s.streaming {
            return Ok(());
        }
        if req.kv_lent {
            return Self::check_extends(tag.id, s, req, self.inner.page_size());
        }
        if s.closing {
            return Err(SessionError::Closing(tag.id));
        }
        if s.slot.as_ref().is_some_and(|sl| sl.lent) {
            return Err(SessionError::Busy(tag.id));
        }
        Self::check_extends(tag.id, s, req, self.inner.page_size())
    }

    /// A view of session `id`.
    pub fn session_info(&self, id: u64) -> Option<SessionInfo> {
        self.sessions.get(&id).map(|s| SessionInfo {
            streaming: s.streaming,
            history_len: s.history.len(),
            slot_committed_len: s.slot.as_ref().map(|sl| sl.committed_len),
            lent: s.slot.as_ref().is_some_and(|sl| sl.lent),
            closing: s.closing,
        })
    }

    /// Open sessions.
    pub fn open_sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Request-pool rows held by idle sessions.
    pub fn held_rows(&self) -> usize {
        self.lru.len()
    }

    /// Mamba running-state slots held by idle sessions.
    pub fn held_mamba_slots(&self) -> usize {
        self.idle_slots().filter(|s| s.mamba_slot.is_some()).count()
    }

    /// State slots held by idle sessions: their running Mamba states plus their pending
    /// checkpoints (what [`SessionConfig::max_held_state_slots`] bounds).
    pub fn held_state_slots(&self) -> usize {
        self.held_states
    }

    /// Sliding-window pages idle sessions own (what [`SessionConfig::max_held_window_pages`]
    /// bounds): in the window pool they are request-owned pages.
    pub fn held_window_pages(&self) -> usize {
        self.held_window
    }

    pub(crate) fn idle_slots(&self) -> impl Iterator<Item = &Slot> + '_ {
        self.sessions
            .values()
            .filter_map(|s| s.slot.as_ref())
            .filter(|sl| !sl.lent)
    }

    /// Whether `req` (a turn of session `id`) extends the session's history. Where the turn
    /// carries the match hash the history recorded, the pages it covers are taken as equal
    /// (the chain names them) and only the rest of the history is compared; debug builds
    /// compare it all and keep the token result where the two differ (hashes that are not the
    /// turn's chain).
    pub(crate) fn check_extends(
        id: u64,
        s: &Session,
        req: &RequestKv,
        p: usize,
    ) -> Result<(), SessionError> {
        debug_assert_eq!(
            req.key_start, 0,
            "a turn's extension is checked on its whole key"
        );
        let h = &s.history;
        let ok = h.is_empty()
            || (req.key.namespace == h.namespace && req.key.len() >= h.len() && {
                let from = match s.history_hash {
                    Some((k, hash)) if req.page_hashes.get(k - 1) == Some(hash) => k * p,
                    _ => 0,
                };
                let tail = req.key.tokens[from..h.len()] == h.tokens[from..];
                if cfg!(debug_assertions) && from > 0 && tail {
                    req.key.tokens.starts_with(&h.tokens)
                } else {
                    tail
                }
            });
        if ok {
            Ok(())
        } else {
            Err(SessionError::NotExtending {
                id,
                history_len: h.len(),
            })
        }
    }

    /// Puts session `id`'s slot (already stored, not lent) into the idle index at `now`.
    pub(crate) fn mark_idle(&mut self, id: u64) {
        let now = self.clock.now();
        self.seq += 1;
        let seq = self.seq;
        let Some(s) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some(slot) = s.slot.as_ref() else {
            return;
        };
        debug_assert!(!slot.lent && s.idle_key.is_none());
        self.held_tokens += slot.held_tokens;
        self.held_states += slot.state_slots();
        self.held_window += slot.held_window_pages;
        s.idle_key = Some((now, seq));
        self.lru.insert((now, seq, id));
        if let Some(ttl) = s.ttl {
            self.expiry.insert((now.saturating_add(ttl), seq, id));
        }
    }

    /// Removes session `id`'s slot from the idle index (it is being lent or dropped).
    pub(crate) fn unmark_idle(&mut self, id: u64) {
        let Some(s) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some((t, seq)) = s.idle_key.take() else {
            return;
        };
        self.lru.remove(&(t, seq, id));
        if let Some(ttl) = s.ttl {
            self.expiry.remove(&(t.saturating_add(ttl), seq, id));
        }
        if let Some(slot) = s.slot.as_ref() {
            self.held_tokens = self.held_tokens.saturating_sub(slot.held_tokens);
            self.held_states = self.held_states.saturating_sub(slot.state_slots());
            self.held_window = self.held_window.saturating_sub(slot.held_window_pages);
        }
    }

    /// Detaches session `id`'s idle slot (None if it has none or it is lent).
    pub(crate) fn take_idle_slot(&mut self, id: u64) -> Option<Slot> {
        let lent = self.sessions.get(&id)?.slot.as_ref()?.lent;
        if lent {
            return None;
        }
        self.unmark_idle(id);
        self.sessions.get_mut(&id)?.slot.take()
    }

    /// Owned pages of `row` × page size: what the row holds beyond the tree.
    pub(crate) fn owned_tokens(&self, row: RowId) -> Result<usize, CacheError> {
        let rows = &self.inner.pools().rows;
        let owned = rows
            .pages(row)?
            .len()
            .saturating_sub(rows.protected_pages(row)?);
        Ok(owned * self.inner.page_size())
    }

    /// Releases a detached slot without caching anything: the inner cache finishes it as an
    /// aborted request, which frees the owned pages and the row, its own window pages, its
    /// Mamba state and checkpoints, and releases the lock (the protected prefix becomes
    /// ordinary cache).
    pub(crate) fn release_slot(&mut self, slot: Slot) -> Result<(), CacheError> {
        self.finish_slot(slot, RadixKey::default(), FinishKind::Aborted)
    }

    /// Frees state slots the session layer holds, through the inner cache's finish of a
    /// request that holds nothing else (which frees a row-less request's slots).
    pub(crate) fn free_states(
        &mut self,
        mamba_slot: Option<u32>,
        mamba_track: Option<MambaTrack>,
        checkpoints: Vec<MambaCheckpoint>,
    ) -> Result<(), CacheError> {
        if mamba_slot.is_none() && mamba_track.is_none() && checkpoints.is_empty() {
            return Ok(());
        }
        let mut req = RequestKv {
            mamba_slot,
            mamba_track,
            mamba_checkpoints: checkpoints,
            ..RequestKv::default()
        };
        self.inner.cache_finished_req(&mut req, FinishKind::Aborted)
    }

    /// Hands a detached slot to the inner cache as a finished request over `history`: the
    /// committed, page-aligned KV is inserted (shared prefixes dedup; the window KV the slot
    /// holds with it, tombstones before it), the tail freed, the lock and row released.
    pub(crate) fn cache_slot(&mut self, slot: Slot, history: RadixKey) -> Result<(), CacheError> {
        self.finish_slot(slot, history, FinishKind::Finished)
    }

    /// The inner finish of a detached slot as the request it was, over `history`.
    fn finish_slot(
        &mut self,
        slot: Slot,
        history: RadixKey,
        kind: FinishKind,
    ) -> Result<(), CacheError> {
        if let Err(e) = self
            .inner
            .pools_mut()
            .rows
            .set_holder(slot.row, RowHolder::Request)
        {
            // The row is gone already: still hand the lock back so the path does not stay locked.
            if let Some(l) = slot.lock {
                self.inner.dec_lock_ref(l)?;
            }
            return Err(e);
        }
        let mut req = RequestKv::new(history);
        req.row = Some(slot.row);
        req.last_node = slot.lock.as_ref().map(|l| l.anchor());
        req.lock = slot.lock;
        // The history always covers the committed KV; the clamp only guards a caller that broke
        // the append-only contract (an aborted finish inserts nothing and needs no key).
        req.committed_len = match kind {
            FinishKind::Finished => slot.committed_len.min(req.key.len()),
            FinishKind::Aborted => slot.committed_len,
        };
        req.allocated_len = slot.allocated_len.max(req.committed_len);
        req.cache_protected_len = slot.cache_protected_len;
        req.mamba_slot = slot.mamba_slot;
        req.mamba_checkpoints = slot.mamba_checkpoints;
        req.mamba_track = slot.mamba_track;
        req.swa_evicted_len = slot.swa_evicted_len;
        req.swa_pages = slot.swa_pages;
        self.inner.cache_finished_req(&mut req, kind)
    }

    /// Demotes session `id`'s idle slot into the inner cache. False if it had none.
    pub(crate) fn demote_idle(&mut self, id: u64) -> Result<bool, CacheError> {
        let Some(slot) = self.take_idle_slot(id) else {
            return Ok(false);
        };
        let history = self
            .sessions
            .get(&id)
            .map(|s| s.history.clone())
            .unwrap_or_default();
        self.cache_slot(slot, history)?;
        Ok(true)
    }

    /// Demotes the least recently used idle session that holds a state slot (its state goes to
    /// the tree as evictable cache or is freed, so a state slot can be had). False if none
    /// holds one.
    pub(crate) fn reclaim_state(&mut self) -> Result<bool, CacheError> {
        let victim = self.lru.iter().map(|&(_, _, id)| id).find(|id| {
            self.sessions
                .get(id)
                .and_then(|s| s.slot.as_ref())
                .is_some_and(|sl| sl.state_slots() > 0)
        });
        match victim {
            Some(id) => self.demote_idle(id),
            None => Ok(false),
        }
    }

    /// Demotes idle sessions owning window pages (least recently used first) until what they
    /// owned covers the `short` pages the window pool lacks. Demotes nothing when even all of
    /// them would not suffice. Returns true if it demoted any (worth retrying).
    pub(crate) fn reclaim_window(&mut self, short: usize) -> Result<bool, CacheError> {
        if self.held_window < short || self.held_window == 0 {
            return Ok(false);
        }
        let mut got = 0;
        while got < short {
            let victim = self.lru.iter().find_map(|&(_, _, id)| {
                self.sessions
                    .get(&id)
                    .and_then(|s| s.slot.as_ref())
                    .filter(|sl| sl.held_window_pages > 0)
                    .map(|sl| (id, sl.held_window_pages))
            });
            let Some((id, pages)) = victim else {
                break;
            };
            self.demote_idle(id)?;
            got += pages;
        }
        Ok(got > 0)
    }

    /// Demotes idle sessions (least recently used first) until the inner cache can supply
    /// `tokens`. Demotes nothing when even all of them would not suffice, so a failing
    /// allocation leaves the sessions as they were. Returns true if it is worth retrying.
    pub(crate) fn reclaim_for(&mut self, tokens: usize) -> Result<bool, CacheError> {
        if self.inner.available_tokens() + self.held_tokens < tokens || self.lru.is_empty() {
            return Ok(false);
        }
        while self.inner.available_tokens() < tokens {
            let Some(&(_, _, id)) = self.lru.first() else {
                break;
            };
            self.demote_idle(id)?;
        }
        Ok(true)
    }

    /// The slot of a finished turn takes the request's KV. `committed` is clamped to the key
    /// and the allocation; pages past it (speculative overshoot, a retract gap) are freed.
    pub(crate) fn slot_from_request(
        &mut self,
        req: &mut RequestKv,
        lock: Option<LockReceipt>,
    ) -> Result<Slot, CacheError> {
        let row = req
            .row
            .ok_or(CacheError::InvalidRequestState("request has no row"))?;
        let committed = req.committed_len.min(req.allocated_len).min(req.key_len());
        let p = self.inner.page_size();
        // The row and the window table go together (the window before `committed` is held).
        self.inner.truncate_request(req, committed)?;
        self.inner
            .pools_mut()
            .rows
            .set_holder(row, RowHolder::Session)?;
        let held_tokens = self.owned_tokens(row)?;
        // Checkpoints the forward pass has passed stay with the KV (stored on demotion, as a
        // finish would); those past the committed KV hold no state and are freed.
        let aligned = align_down(committed, p);
        let (keep, drop): (Vec<_>, Vec<_>) = std::mem::take(&mut req.mamba_checkpoints)
            .into_iter()
            .partition(|c| c.pos <= aligned);
        if let Err(e) = self.free_states(None, None, drop) {
            // The caller finishes the request as aborted: it frees what the request still holds.
            req.mamba_checkpoints = keep;
            return Err(e);
        }
        // The copy on write ran with the turn's first forward.
        req.mamba_cow = None;
        let mut slot = Slot {
            row,
            lock,
            committed_len: committed,
            allocated_len: committed,
            cache_protected_len: req.cache_protected_len,
            mamba_slot: req.mamba_slot.take(),
            // The engine keeps the tracked state at the last page boundary of the computed KV.
            mamba_track: req
                .mamba_track
                .take()
                .map(|t| MambaTrack { pos: aligned, ..t }),
            mamba_checkpoints: keep,
            swa_evicted_len: req.swa_evicted_len,
            swa_pages: std::mem::take(&mut req.swa_pages),
            lent: false,
            held_tokens,
            held_window_pages: 0,
        };
        slot.held_window_pages = slot.own_window_pages(p);
        Ok(slot)
    }

    /// After a turn stored its slot: the per-session cap, then TTL and budget.
    pub(crate) fn after_save(&mut self, id: u64) -> Result<(), CacheError> {
        let over_cap = self
            .sessions
            .get(&id)
            .and_then(|s| s.slot.as_ref())
            .is_some_and(|sl| sl.held_tokens > self.cfg.max_session_tokens);
        if over_cap {
            self.demote_idle(id)?;
        }
        self.reap().map_err(CacheError::from)?;
        Ok(())
    }
}
