//! The [`PrefixCache`] trait every cache implements, and the request-side state it reads and
//! writes ([`RequestKv`]).
//!
//! # One request's life
//! 1. [`PrefixCache::match_request`]: longest cached prefix of the prompt (at most `len − 1`
//!    tokens, so at least one token is recomputed to produce logits). Takes no lock.
//! 2. [`PrefixCache::begin_request`]: locks the matched path, allocates the request-pool row
//!    and installs the matched pages as the row's tree-owned prefix.
//! 3. [`PrefixCache::alloc_tokens`] before each forward (evicting as needed), then
//!    [`RequestKv::commit`] once the KV of those tokens is computed. A model with
//!    sliding-window layers calls [`PrefixCache::slide_window`] after each commit to free the
//!    window KV that no later token reads.
//! 4. [`PrefixCache::cache_unfinished_req`] after every prefill chunk: the computed pages enter
//!    the tree at once so concurrent requests can share them; duplicates are freed; the lock
//!    moves to the new end.
//! 5. [`PrefixCache::cache_finished_req`] on finish (insert, free the unaligned tail, unlock,
//!    release the row), or with [`FinishKind::Aborted`] on abort and retract (no insert).

use crate::alloc::DevicePools;
use crate::ensure_inv;
use crate::error::{CacheError, InvariantViolation, Result};
use crate::events::KvEvent;
use crate::mamba_policy::{MambaCheckpoint, MambaTrack};
use crate::page_hash::{PageHasher, PageHashes};
use crate::tree::mamba::MambaCow;
use crate::tree::{InsertOptions, LockReceipt, TreeMatch};
use crate::types::{KeyRef, NodeId, PageId, RadixKey, RowId, TokenId, pages_for};

/// How a request ends.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FinishKind {
    /// Finished normally: its KV is inserted into the cache.
    Finished,
    /// Aborted or retracted: its own KV is freed without inserting.
    Aborted,
}

/// Result of [`PrefixCache::match_request`].
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestMatch {
    /// Leading tokens whose KV is on device and will be reused.
    pub prefix_len: usize,
    /// Tokens after the device prefix that a tiered cache holds on the host.
    pub host_hit_len: usize,
    /// True when the prefix came from a session slot (no tree walk).
    pub from_session: bool,
}

/// Result of [`PrefixCache::insert`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InsertResult {
    /// Leading tokens that were already cached on device.
    pub prefix_len: usize,
    /// Tokens whose pages the cache adopted.
    pub adopted_len: usize,
    /// The caller's pages that duplicated pages already in the cache. They stay owned by the
    /// caller, who must free them (or reuse them).
    pub duplicates: Vec<PageId>,
    /// The node that ends the inserted key.
    pub last_node: NodeId,
}

/// Where every token of a device pool is, at page granularity.
///
/// `free + evictable + protected + session_held + request_owned == total` always holds.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolAccounting {
    /// Pool capacity in tokens.
    pub total: usize,
    /// Tokens in free pages.
    pub free: usize,
    /// Tokens cached in unlocked tree nodes.
    pub evictable: usize,
    /// Tokens cached in locked tree nodes.
    pub protected: usize,
    /// Tokens held by idle sessions (not lent to a running request).
    pub session_held: usize,
    /// Tokens owned by requests (their uncached tails) and other callers.
    pub request_owned: usize,
}

impl PoolAccounting {
    /// True when the five parts add up to the total.
    pub fn balanced(&self) -> bool {
        self.free + self.evictable + self.protected + self.session_held + self.request_owned
            == self.total
    }
}

/// Session-related state a request carries (filled by the session layer).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SessionTag {
    /// The session id.
    pub id: u64,
    /// Streaming sessions keep their KV between turns.
    pub streaming: bool,
}

/// The request-side KV state that caches read and write.
///
/// The scheduler owns one per request and passes it to every cache call. Fields are public for
/// inspection; mutate them only through the cache and the methods here.
#[derive(Debug, Default)]
pub struct RequestKv {
    /// Tokens so far (prompt, then prompt + outputs) and the namespace; from token
    /// [`RequestKv::key_start`] on, where [`RequestKv::drop_cached_prefix`] dropped what the
    /// tree holds for the request.
    pub key: RadixKey,
    /// Leading tokens of the request that `key.tokens` no longer holds (0 unless
    /// [`RequestKv::drop_cached_prefix`] dropped them): `key.tokens[i]` is token
    /// `key_start + i`. Positions elsewhere (`committed_len`, `cache_protected_len`, ...)
    /// count from the request's first token as always; [`RequestKv::key_len`] is the whole
    /// length. Only a cache whose [`PrefixCache::takes_windowed_keys`] is true accepts such a
    /// request; the others refuse it with [`CacheError::InvalidRequestState`].
    pub key_start: usize,
    /// Match hashes of the key's leading whole pages, from the cache's
    /// [`PrefixCache::page_hasher`] (optional: empty matches by tokens; see
    /// [`crate::page_hash`]). An engine that keeps its prompts' page hashes hands them over
    /// here, and a cached prefix is then matched one node at a time instead of one token at a
    /// time. They must be the hasher's chain over the key's tokens.
    pub page_hashes: PageHashes,
    /// Optional cap on the reusable prefix (e.g. a logprob start position).
    pub max_prefix_len: Option<usize>,
    /// Request priority (max-propagated along the path for the priority policy).
    pub priority: i32,
    /// The session this request belongs to, if any.
    pub session: Option<SessionTag>,
    /// The request-pool row (page table), from `begin_request` on.
    pub row: Option<RowId>,
    /// Device pages of the matched prefix (valid between match and begin).
    pub prefix_pages: Vec<PageId>,
    /// Tokens of the matched prefix.
    pub prefix_len: usize,
    /// Tokens a tiered cache holds on the host after the device prefix.
    pub host_hit_len: usize,
    /// Lock anchor from the match (`None`: nothing to lock, e.g. a session restore).
    pub last_node: Option<NodeId>,
    /// Load-back anchor from the match (tiered caches).
    pub load_anchor: Option<NodeId>,
    /// The lock the request holds on its cached prefix.
    pub lock: Option<LockReceipt>,
    /// Tokens whose KV is computed.
    pub committed_len: usize,
    /// Tokens with allocated KV slots (≥ committed; the excess is speculative or in flight).
    pub allocated_len: usize,
    /// Leading tokens owned by the tree (page-aligned); the rest of the row is the request's.
    pub cache_protected_len: usize,
    /// The request's own Mamba state slot (hybrid models), from `begin_request` on: the
    /// running state. At the end of the request a cache with the Mamba component stores it as
    /// the checkpoint of the inserted key (where the computed length ends a page and its
    /// [`MambaPolicy`](crate::MambaPolicy) keeps request-end states) or frees it.
    ///
    /// # Slots a request holds
    /// A running request of a cache with the Mamba component holds, besides its KV:
    /// - exactly 1 running slot (this field): required, `begin_request` fails with
    ///   [`CacheError::OutOfStateSlots`] when none can be had (free, or by evicting an unlocked
    ///   cached state);
    /// - at most 1 tracking slot ([`RequestKv::mamba_track`]);
    /// - at most 2 checkpoint slots ([`RequestKv::mamba_checkpoints`]: branch points and a
    ///   prompt end; the baseline takes at most its branching point),
    ///
    /// so at most [`RequestKv::MAX_MAMBA_SLOTS`] (4), counted by
    /// [`RequestKv::mamba_slots_held`]. The optional ones are taken at `begin_request` only
    /// while at least one more slot stays obtainable, and released by the chunk insert or the
    /// finish that stores them (or the abort): an admission that reserves one slot per running
    /// request (plus one for the request it admits) never sees `begin_request` fail for them,
    /// and one that wants the optional slots too reserves up to 4.
    pub mamba_slot: Option<u32>,
    /// The request's tracking slot (hybrid models; see [`MambaTrack`] for the engine's
    /// contract): the running state at the last page boundary the forward pass reached, stored
    /// at the finish when the computed length does not end a page. Set by `begin_request`
    /// where the policy keeps request-end states, tracking is on
    /// ([`RadixConfig::mamba_track`](crate::RadixConfig::mamba_track)) and a slot can be
    /// spared; `pos` is advanced by `cache_unfinished_req` and the finish. A
    /// `cache_unfinished_req` that hands the tracked state to the tree (chunk-end states, see
    /// [`crate::mamba_policy`]) replaces the slot with a fresh one (or `None` when none can be
    /// spared): the engine reads this field again after every chunk.
    pub mamba_track: Option<MambaTrack>,
    /// A Mamba hit's copy on write: the device backend copies the cached state `src` into the
    /// request's slot `dst` (= `mamba_slot`) before the request's first forward. Set by
    /// `begin_request`, cleared by the first `cache_unfinished_req` (the copy has run by then).
    pub mamba_cow: Option<MambaCow>,
    /// Mamba checkpoints the forward pass must take (hybrid models; see
    /// [`MambaPolicy::Marconi`], and the baseline's branching point):
    /// at each `pos` the engine copies the request's running state into `slot`. Set by
    /// `begin_request` (ascending positions past the cached prefix, each with its own slot);
    /// the cache stores each one in the tree when it inserts the KV up to its position
    /// (a chunk or the finish) and removes it from here, and frees the slots of those left
    /// when the request ends.
    ///
    /// [`MambaPolicy::Marconi`]: crate::MambaPolicy::Marconi
    pub mamba_checkpoints: Vec<MambaCheckpoint>,
    /// How far the device KV match went, set by a cache with the Mamba component (≥
    /// `prefix_len`; 0 from other caches). The usable prefix stops at the deepest cached state;
    /// when this is longer, the forward pass should checkpoint the state at this length so
    /// that the next request on the path hits there.
    pub kv_match_len: usize,
    /// Tokens before the sliding-window frontier whose SWA KV the request no longer holds
    /// (page-aligned; sliding-window models): [`RequestKv::swa_pages`] starts here.
    pub swa_evicted_len: usize,
    /// The request's sliding-window page table (a cache with the SWA component), from
    /// `begin_request` on: one page of the SWA pool per page of tokens from
    /// [`RequestKv::swa_evicted_len`] to the end of the row, in step with the row's full-KV
    /// pages. The pages before `cache_protected_len` are the tree's (the window of the cached
    /// prefix, locked by the request's receipt), the rest are the request's own.
    /// [`PrefixCache::slide_window`] drops the pages that slid out of the window.
    pub swa_pages: Vec<PageId>,
    /// True while the KV is lent by a session slot (the slot, not the request, owns it).
    pub kv_lent: bool,
}

impl RequestKv {
    /// The most Mamba state slots one running request holds: its running slot, a tracking
    /// slot and two checkpoints (see [`RequestKv::mamba_slot`]).
    pub const MAX_MAMBA_SLOTS: usize = 4;

    /// The Mamba state slots the request holds now: running, tracking and checkpoint slots
    /// (at most [`RequestKv::MAX_MAMBA_SLOTS`]).
    pub fn mamba_slots_held(&self) -> usize {
        Self::count_mamba_slots(self.mamba_slot, self.mamba_track, &self.mamba_checkpoints)
    }

    /// The Mamba state slots a running slot, a tracking slot and checkpoints hold together:
    /// [`RequestKv::mamba_slots_held`] of a request with those, for a holder that keeps them
    /// outside a request (a session's idle slot).
    pub fn count_mamba_slots(
        running: Option<u32>,
        track: Option<MambaTrack>,
        checkpoints: &[MambaCheckpoint],
    ) -> usize {
        usize::from(running.is_some()) + usize::from(track.is_some()) + checkpoints.len()
    }

    /// A fresh request for `key`.
    pub fn new(key: RadixKey) -> Self {
        RequestKv {
            key,
            ..Default::default()
        }
    }

    /// The request's length in tokens: the dropped prefix ([`RequestKv::key_start`]) and
    /// the tokens held.
    #[inline]
    pub fn key_len(&self) -> usize {
        self.key_start + self.key.len()
    }

    /// Drops the key's tokens that the tree holds for the request, those before
    /// `cache_protected_len` (the path to its lock anchor: the lock keeps it from eviction,
    /// and a split leaves its tokens as they were) and before `upto`, and gives back their
    /// memory; returns how many were dropped. The tokens left are copied into a buffer with
    /// the same room past them. A request without a lock drops nothing, unless it runs in a
    /// session's row (`kv_lent`): the session's slot holds the lock on that path for it, and
    /// the session's history holds the tokens.
    ///
    /// A running request's prompt is then held once, by the tree, instead of also by the
    /// request. Only for a cache whose [`PrefixCache::takes_windowed_keys`] is true: its
    /// inserts start at the lock anchor and read the tokens past it only. Nothing but the
    /// request's own source can give the dropped tokens back (a retracted request matches
    /// again with its whole key).
    pub fn drop_cached_prefix(&mut self, upto: usize) -> usize {
        if self.lock.is_none() && !self.kv_lent {
            return 0;
        }
        let cut = self
            .cache_protected_len
            .min(upto)
            .saturating_sub(self.key_start)
            .min(self.key.tokens.len());
        if cut == 0 {
            return 0;
        }
        let mut kept = Vec::with_capacity(self.key.tokens.capacity() - cut);
        kept.extend_from_slice(&self.key.tokens[cut..]);
        self.key.tokens = kept;
        self.key_start += cut;
        cut
    }

    /// Gives the key back the tokens [`RequestKv::drop_cached_prefix`] dropped: `prefix` must
    /// hold exactly the first [`RequestKv::key_start`] tokens, and the key's held tokens are
    /// appended to it. The key is whole again (`key_start` 0).
    ///
    /// # Errors
    /// [`CacheError::InvalidRequestState`] when `prefix` is not `key_start` tokens long
    /// (nothing changes).
    pub fn restore_key_prefix(&mut self, mut prefix: Vec<TokenId>) -> Result<()> {
        if prefix.len() != self.key_start {
            return Err(CacheError::InvalidRequestState(
                "the restored prefix is not as long as the dropped one",
            ));
        }
        prefix.extend_from_slice(&self.key.tokens);
        self.key.tokens = prefix;
        self.key_start = 0;
        Ok(())
    }

    /// `Ok` for a key that holds all its tokens; [`CacheError::InvalidRequestState`] for one
    /// that dropped its cached prefix, which a match, a `begin_request` and a cache that reads
    /// whole keys (`!`[`PrefixCache::takes_windowed_keys`]) refuse.
    pub fn check_whole_key(&self) -> Result<()> {
        if self.key_start > 0 {
            return Err(CacheError::InvalidRequestState(
                "the request's key lacks its leading tokens (drop_cached_prefix), and this \
                 call needs the whole key",
            ));
        }
        Ok(())
    }

    /// The longest prefix a match may use: `len − 1` (at least one token is recomputed for
    /// logits), capped by `max_prefix_len`.
    pub fn max_match_len(&self) -> usize {
        let n = self.key_len().saturating_sub(1);
        self.max_prefix_len.map_or(n, |cap| n.min(cap))
    }

    /// The whole key with the request's match hashes (a key that holds all its tokens:
    /// `key_start` 0).
    #[inline]
    pub fn key_ref(&self) -> KeyRef<'_> {
        self.key.as_ref().with_hashes(&self.page_hashes)
    }

    /// The request's tokens at positions `from..to` (counted from its first token), where its
    /// key still holds them: `None` when `from` lies before [`RequestKv::key_start`] (dropped,
    /// [`RequestKv::drop_cached_prefix`]) or the range passes the key's end.
    #[inline]
    pub fn key_tokens(&self, from: usize, to: usize) -> Option<&[TokenId]> {
        let start = from.checked_sub(self.key_start)?;
        self.key.tokens.get(start..to.checked_sub(self.key_start)?)
    }

    /// The key's first `len` tokens (clamped) with the request's match hashes (a key that
    /// holds all its tokens: `key_start` 0).
    #[inline]
    pub fn key_prefix(&self, len: usize) -> KeyRef<'_> {
        self.key.prefix(len).with_hashes(&self.page_hashes)
    }

    /// Appends generated tokens to the key.
    #[inline]
    pub fn append_tokens(&mut self, tokens: &[TokenId]) {
        self.key.tokens.extend_from_slice(tokens);
    }

    /// Records that the KV of the next `n` tokens has been computed.
    ///
    /// # Errors
    /// [`CacheError::InvalidRequestState`] if that passes the allocated slots or the key.
    #[inline]
    pub fn commit(&mut self, n: usize) -> Result<()> {
        match self.committed_len.checked_add(n) {
            Some(c) if c <= self.allocated_len && c <= self.key_len() => {
                self.committed_len = c;
                Ok(())
            }
            // An `n` that overflows is past the allocated slots too.
            _ => Err(CacheError::InvalidRequestState(
                "commit past the allocated slots or the key",
            )),
        }
    }

    /// Forgets everything but the key and request attributes (after finish, abort or retract).
    pub fn clear_kv_state(&mut self) {
        self.row = None;
        self.prefix_pages.clear();
        self.prefix_len = 0;
        self.host_hit_len = 0;
        self.last_node = None;
        self.load_anchor = None;
        self.lock = None;
        self.committed_len = 0;
        self.allocated_len = 0;
        self.cache_protected_len = 0;
        self.mamba_slot = None;
        self.mamba_track = None;
        self.mamba_cow = None;
        self.mamba_checkpoints.clear();
        self.kv_match_len = 0;
        self.swa_evicted_len = 0;
        self.swa_pages.clear();
        self.kv_lent = false;
    }
}

/// A prefix cache over a paged device KV pool.
///
/// Implemented by `RadixCache` (device only), `SessionAwareCache` (a decorator that keeps
/// streaming sessions' KV between turns) and `HiRadixCache` (device + host tiers).
/// No method panics on bad input: every misuse returns a [`CacheError`] and leaves the cache
/// unchanged.
pub trait PrefixCache {
    /// Tokens per page.
    fn page_size(&self) -> usize;

    /// The hasher of the match hashes this cache accepts ([`RequestKv::page_hashes`],
    /// [`crate::page_hash`]).
    fn page_hasher(&self) -> PageHasher;
    /// The device pools.
    fn pools(&self) -> &DevicePools;
    /// The device pools, mutably (allocate and free owned pages, rows).
    fn pools_mut(&mut self) -> &mut DevicePools;
    /// True when requests of this cache own per-request state beyond their full-KV row (Mamba
    /// slots: [`RequestKv::mamba_slot`] and the tracking and checkpoint slots beside it;
    /// sliding-window pages in
    /// [`RequestKv::swa_pages`]) that the cache frees at finish. A decorator that keeps a
    /// request's resources past its finish (a session) must hand that state back too, so it
    /// refuses a cache it cannot do that for.
    fn has_state_slots(&self) -> bool {
        false
    }
    /// True when requests of this cache hold sliding-window pages ([`RequestKv::swa_pages`]),
    /// the part of [`PrefixCache::has_state_slots`] that grows with the request: a decorator
    /// that keeps a request's KV past its finish (a session) trims it with
    /// [`PrefixCache::truncate_request`] and audits it with [`PrefixCache::check_parked`].
    fn has_window_state(&self) -> bool {
        false
    }
    /// The sliding window in tokens when requests of this cache hold sliding-window pages
    /// (see [`PrefixCache::has_window_state`]); `None` otherwise.
    fn sliding_window(&self) -> Option<usize> {
        None
    }
    /// True when the cache takes a running request whose key no longer holds its cached
    /// prefix ([`RequestKv::drop_cached_prefix`]): its inserts start at the request's lock
    /// anchor and read no token before it. False (the default) refuses such a request.
    fn takes_windowed_keys(&self) -> bool {
        false
    }

    /// Gives a running request whose key dropped its cached prefix
    /// ([`RequestKv::drop_cached_prefix`]) its whole key back, read from the tree's path to its
    /// lock anchor (the lock keeps that path, and so the dropped tokens, in the tree). For a
    /// caller that needs the whole key of such a request: a session's finish, which makes the
    /// turn the session's history. A whole key is left as it is.
    ///
    /// # Errors
    /// [`CacheError::InvalidRequestState`] for a key that lacks its prefix where the cache
    /// cannot give it back (the default: only a cache that
    /// [takes such keys](PrefixCache::takes_windowed_keys) can), or where the request holds
    /// no lock or its anchor's path is shorter than what was dropped; nothing changes then.
    fn restore_key(&self, req: &mut RequestKv) -> Result<()> {
        req.check_whole_key()
    }

    // ----- tree level -----
    /// Longest cached page-aligned prefix of `key`; appends its device pages to `out`.
    ///
    /// # Errors
    /// [`CacheError::EmptyKey`] for an empty key.
    fn match_prefix(&mut self, key: KeyRef<'_>, out: &mut Vec<PageId>) -> Result<TreeMatch>;
    /// Inserts `key` with the caller's owned `pages` (one per page of the key).
    ///
    /// # Errors
    /// Empty, misaligned or mismatched input, or pages the caller does not own.
    fn insert(
        &mut self,
        key: KeyRef<'_>,
        pages: &[PageId],
        opts: InsertOptions,
    ) -> Result<InsertResult>;
    /// Evicts unlocked leaves until `tokens` are freed or nothing is evictable; returns the
    /// tokens freed.
    fn evict(&mut self, tokens: usize) -> usize;
    /// Locks the root path of `node`.
    ///
    /// # Errors
    /// [`CacheError::StaleNode`].
    fn inc_lock_ref(&mut self, node: NodeId) -> Result<LockReceipt>;
    /// Releases a lock.
    ///
    /// # Errors
    /// [`CacheError::StaleReceipt`], [`CacheError::LockUnderflow`].
    fn dec_lock_ref(&mut self, receipt: LockReceipt) -> Result<()>;
    /// Cached tokens that eviction could free.
    fn evictable_tokens(&self) -> usize;
    /// Cached tokens under a lock.
    fn protected_tokens(&self) -> usize;
    /// Tokens held by idle sessions.
    fn session_held_tokens(&self) -> usize {
        0
    }
    /// Drains KV events.
    fn take_events(&mut self) -> Vec<KvEvent>;
    /// KV events dropped since the cache was built because its bounded event buffer was full
    /// (nobody drained it in time). When it moves between two drains, the events have a gap
    /// and a consumer must resync (see [`EventBuffer`](crate::events::EventBuffer)).
    fn events_dropped(&self) -> u64 {
        0
    }
    /// Drops every cached entry.
    ///
    /// # Errors
    /// [`CacheError::Busy`] while locks or request rows are outstanding. A refused reset drops
    /// nothing (a tiered cache may have completed the transfers it drained first).
    fn reset(&mut self) -> Result<()>;
    /// Audits every invariant of the cache and its pools. The cache does not know the
    /// requests it serves: their state is audited by [`PrefixCache::check_request`].
    ///
    /// # Errors
    /// The first violated invariant.
    fn check_invariants(&self) -> std::result::Result<(), InvariantViolation>;
    /// Audits one request's KV state against the pools: its row is live, and
    /// `committed_len <= allocated_len <=` the tokens its row's pages can hold. Whoever tracks
    /// the running requests (the scheduler) calls it next to [`PrefixCache::check_invariants`].
    /// A cache with per-request state of its own audits that too ([`RadixCache`]'s Mamba slot).
    ///
    /// [`RadixCache`]: crate::RadixCache
    ///
    /// # Errors
    /// The first violated invariant.
    fn check_request(&self, req: &RequestKv) -> std::result::Result<(), InvariantViolation> {
        check_request_kv(self, req)
    }

    /// [`PrefixCache::check_request`] for a request's KV state that a decorator keeps
    /// parked while no request runs it (a session slot between turns): `req` carries
    /// everything but the lock receipt, which the decorator holds and passes as `lock`. A
    /// cache whose audit reads the receipt (the sliding-window component checks that it
    /// locks the tree's window pages in the table) overrides this; the default ignores
    /// `lock`.
    ///
    /// # Errors
    /// The first violated invariant.
    fn check_parked(
        &self,
        req: &RequestKv,
        lock: Option<&LockReceipt>,
    ) -> std::result::Result<(), InvariantViolation> {
        let _ = lock;
        self.check_request(req)
    }

    // ----- request level -----

    /// Matches the request's key (under the `len − 1` rule) and records the result in `req`.
    ///
    /// # Errors
    /// [`CacheError::InvalidRequestState`] when the request already holds KV.
    fn match_request(&mut self, req: &mut RequestKv) -> Result<RequestMatch>;
    /// Locks the matched prefix, allocates the row and installs the prefix in it. Re-matches
    /// first if the match went stale (its anchor was evicted meanwhile).
    ///
    /// # Errors
    /// [`CacheError::OutOfRows`] (nothing held then), [`CacheError::InvalidRequestState`].
    fn begin_request(&mut self, req: &mut RequestKv) -> Result<()>;
    /// Allocates slots for `n` more tokens, evicting if needed.
    ///
    /// # Errors
    /// [`CacheError::OutOfPages`] (the request is unchanged), [`CacheError::SizeOverflow`] when
    /// `allocated_len + n` overflows, or a request without a row.
    fn alloc_tokens(&mut self, req: &mut RequestKv, n: usize) -> Result<()> {
        alloc_tokens_kv(self, req, n)
    }
    /// Inserts the computed, page-aligned part of a running request (after a prefill chunk).
    ///
    /// # Errors
    /// A request without a row, or stale handles.
    fn cache_unfinished_req(&mut self, req: &mut RequestKv) -> Result<()>;
    /// Ends a request: inserts its KV (unless aborted), frees what the cache does not keep,
    /// releases its lock and row.
    ///
    /// # Errors
    /// Stale handles; the request is cleared as far as possible.
    fn cache_finished_req(&mut self, req: &mut RequestKv, kind: FinishKind) -> Result<()>;
    /// During decode (or between prefill chunks) of a sliding-window model: frees the
    /// request's own SWA pages that slid out of the window (every page wholly before
    /// `committed_len − window`) and, once the window has passed the request's cached prefix,
    /// releases the SWA locks of its receipt (its full-KV locks stay). Returns the pages freed.
    /// A cache without the SWA component has nothing to slide: the default returns 0.
    ///
    /// # Errors
    /// A request without a row, or pool state that does not match the request (nothing
    /// changes then).
    fn slide_window(&mut self, req: &mut RequestKv) -> Result<usize> {
        let _ = req;
        Ok(0)
    }

    /// Shrinks a running (or parked) request's KV to its first `len` tokens
    /// (`cache_protected_len <= len <= allocated_len`): frees its own full-KV pages past
    /// `len`'s last page and, with the sliding-window component, the window pages beside
    /// them; `allocated_len` becomes `len` and `committed_len` at most `len`. Mamba slots are
    /// left alone (the caller decides what a cut-back state is worth).
    ///
    /// # Errors
    /// [`CacheError::InvalidRequestState`] for a request without a row, a `len` outside that
    /// range, or (sliding-window layers) a cut that would need window KV the request no
    /// longer holds (`swa_evicted_len` past `align_down(len) − window`); nothing changes then.
    fn truncate_request(&mut self, req: &mut RequestKv, len: usize) -> Result<()> {
        check_truncate(req, len)?;
        let row = req.row.ok_or(CacheError::InvalidRequestState(
            "truncate_request without a row",
        ))?;
        let p = self.page_size();
        self.pools_mut().truncate_row(row, pages_for(len, p))?;
        req.allocated_len = len;
        req.committed_len = req.committed_len.min(len);
        Ok(())
    }

    // ----- pool level -----

    /// Allocates `n` owned pages, evicting cached pages if needed.
    ///
    /// # Errors
    /// [`CacheError::OutOfPages`] when not even eviction frees enough (nothing allocated and nothing
    /// evicted then).
    fn alloc_pages(&mut self, n: usize) -> Result<Vec<PageId>> {
        self.make_room(n)?;
        self.pools_mut().pages.alloc(n)
    }
    /// Makes `n` pages free. The default evicts cached pages ([`make_room_by_evicting`]); a
    /// cache that can unpin KV first (a tiered cache completing the backups that pin it)
    /// overrides it, and a decorator forwards it to the cache it wraps.
    ///
    /// # Errors
    /// [`CacheError::OutOfPages`] when even that cannot free enough; nothing is evicted then.
    fn make_room(&mut self, n: usize) -> Result<()> {
        make_room_by_evicting(self, n)
    }
    /// Tokens available for new work: free plus evictable (plus, for a cache whose
    /// [`PrefixCache::make_room`] can unpin KV, what it would unpin).
    fn available_tokens(&self) -> usize {
        self.pools().pages.available() * self.page_size() + self.evictable_tokens()
    }
    /// What [`PrefixCache::available_tokens`] would say while `node`'s root path is locked
    /// (the budget of an admission that locks its match), without keeping a lock. The default
    /// takes the lock, reads and releases it; a cache whose lock only moves the path's unlocked
    /// tokens out of `evictable` reads them off the path instead (one walk, nothing written).
    ///
    /// # Errors
    /// As [`PrefixCache::inc_lock_ref`].
    fn available_tokens_if_locked(&mut self, node: NodeId) -> Result<usize> {
        let receipt = self.inc_lock_ref(node)?;
        let available = self.available_tokens();
        self.dec_lock_ref(receipt)?;
        Ok(available)
    }
    /// Where every token of the device pool is.
    fn accounting(&self) -> PoolAccounting {
        let pools = self.pools();
        let p = pools.page_size;
        let total = pools.pages.total() * p;
        let free = pools.pages.available() * p;
        let evictable = self.evictable_tokens();
        let protected = self.protected_tokens();
        let session_held = self.session_held_tokens();
        PoolAccounting {
            total,
            free,
            evictable,
            protected,
            session_held,
            // Counted from the allocator's page states, independently of the tree's counters, so
            // `balanced()` is a real cross-check.
            request_owned: (pools.pages.owned_pages() * p).saturating_sub(session_held),
        }
    }
}

/// The checks every [`PrefixCache::truncate_request`] shares: a row, and
/// `cache_protected_len <= len <= allocated_len`.
///
/// # Errors
/// [`CacheError::InvalidRequestState`].
pub(crate) fn check_truncate(req: &RequestKv, len: usize) -> Result<()> {
    if req.row.is_none() {
        return Err(CacheError::InvalidRequestState(
            "truncate_request without a row",
        ));
    }
    if len < req.cache_protected_len || len > req.allocated_len {
        return Err(CacheError::InvalidRequestState(
            "truncate_request outside the request's own KV",
        ));
    }
    Ok(())
}

/// [`PrefixCache::alloc_tokens`] for the full-KV pool alone (the trait's default; a cache with
/// more per-token pools runs it for the first one).
///
/// # Errors
/// Those of [`PrefixCache::alloc_tokens`].
pub(crate) fn alloc_tokens_kv<C: PrefixCache + ?Sized>(
    cache: &mut C,
    req: &mut RequestKv,
    n: usize,
) -> Result<()> {
    let (row, need) = pages_to_alloc(cache, req, n)?;
    if need > 0 {
        alloc_row_pages(cache, row, need)?;
    }
    req.allocated_len += n;
    Ok(())
}

/// Makes room for `need` full-KV pages (evicting as needed) and appends them to a request's
/// `row`; returns the row's page count before. Nothing is allocated on error. The full-KV part
/// of every [`PrefixCache::alloc_tokens`] (a cache with more per-token pools allocates their
/// pages after it, and hands these back with [`free_row_pages_from`] when that fails).
///
/// # Errors
/// A row that is not live; those of [`PrefixCache::make_room`].
pub(crate) fn alloc_row_pages<C: PrefixCache + ?Sized>(
    cache: &mut C,
    row: RowId,
    need: usize,
) -> Result<usize> {
    cache.make_room(need)?;
    // Straight into the row's page table: no temporary page list on this hot path.
    let pools = cache.pools_mut();
    let (pages, _) = pools.rows.parts_mut(row)?;
    let before = pages.len();
    pools.pages.alloc_into(need, pages)?;
    Ok(before)
}

/// Frees the pages of `row` from index `from` on (the pages [`alloc_row_pages`] added, when
/// another pool could not follow).
///
/// # Errors
/// A row that is not live, or pages the pool does not see as owned.
pub(crate) fn free_row_pages_from<C: PrefixCache + ?Sized>(
    cache: &mut C,
    row: RowId,
    from: usize,
) -> Result<()> {
    let pools = cache.pools_mut();
    let (pages, _) = pools.rows.parts_mut(row)?;
    let fresh = pages.split_off(from.min(pages.len()));
    pools.pages.free(&fresh)
}

/// The request's row and the pages it needs for `n` more tokens: what
/// [`PrefixCache::alloc_tokens`] allocates, for a cache that makes room before delegating it.
///
/// # Errors
/// A request without a row; [`CacheError::SizeOverflow`] when `allocated_len + n` overflows.
pub fn pages_to_alloc<C: PrefixCache + ?Sized>(
    cache: &C,
    req: &RequestKv,
    n: usize,
) -> Result<(RowId, usize)> {
    let row = req.row.ok_or(CacheError::InvalidRequestState(
        "alloc_tokens before begin_request",
    ))?;
    let have = cache.pools().rows.pages(row)?.len();
    let total = req
        .allocated_len
        .checked_add(n)
        .ok_or(CacheError::SizeOverflow(
            "alloc_tokens: allocated_len + n overflows usize",
        ))?;
    Ok((
        row,
        pages_for(total, cache.page_size()).saturating_sub(have),
    ))
}

/// [`PrefixCache::make_room`]'s default: evicts cached pages until `n` pages are free. Nothing
/// is evicted when even evicting everything evictable would not be enough. Public so that a
/// cache overriding `make_room` (to unpin KV first) can finish with it.
///
/// # Errors
/// [`CacheError::OutOfPages`] in that case.
pub fn make_room_by_evicting<C: PrefixCache + ?Sized>(cache: &mut C, n: usize) -> Result<()> {
    let free = cache.pools().pages.available();
    if free < n {
        let p = cache.page_size();
        // Fail before evicting: flushing cached prefixes for an allocation that fails anyway
        // would change the cache on an error path. Tree nodes are page-aligned, so the
        // evictable tokens are exactly the pages eviction can free.
        if free + cache.evictable_tokens() / p < n {
            return Err(CacheError::OutOfPages {
                needed: n,
                available: free,
            });
        }
        cache.evict((n - free) * p);
    }
    Ok(())
}

/// The start of a finish in a cache that may read whole keys: `None` (go on) unless `req`
/// finishes with a key that lacks its leading tokens ([`RequestKv::check_whole_key`]) and
/// `cache` does not take such keys ([`PrefixCache::takes_windowed_keys`]); then it is released
/// as an abort, so that nothing it holds is lost, and the refusal is returned.
pub fn refuse_partial_key_finish<C: PrefixCache + ?Sized>(
    cache: &mut C,
    req: &mut RequestKv,
    kind: FinishKind,
) -> Option<Result<()>> {
    let refused = req
        .check_whole_key()
        .err()
        .filter(|_| kind == FinishKind::Finished && !cache.takes_windowed_keys())?;
    Some(
        cache
            .cache_finished_req(req, FinishKind::Aborted)
            .and(Err(refused)),
    )
}

/// The request audit every [`PrefixCache`] shares ([`PrefixCache::check_request`]'s default): a
/// cache that audits more of a request (its own per-request state) calls it first.
///
/// # Errors
/// The first violated invariant.
pub(crate) fn check_request_kv<C: PrefixCache + ?Sized>(
    cache: &C,
    req: &RequestKv,
) -> std::result::Result<(), InvariantViolation> {
    let Some(row) = req.row else {
        ensure_inv!(
            req.allocated_len == 0 && req.committed_len == 0 && req.lock.is_none(),
            "a request without a row holds KV (allocated {}, committed {})",
            req.allocated_len,
            req.committed_len
        );
        return Ok(());
    };
    ensure_inv!(
        req.key_start == 0
            || (cache.takes_windowed_keys()
                && (req.lock.is_some() || req.kv_lent)
                && req.key_start <= req.cache_protected_len),
        "request row {row:?}: its key starts at {} past its cached prefix ({}), without a lock \
         on it, or in a cache that needs whole keys",
        req.key_start,
        req.cache_protected_len
    );
    let pools = cache.pools();
    let pages = pools
        .rows
        .pages(row)
        .map_err(|e| InvariantViolation(format!("request row {row:?} is not a live row: {e}")))?;
    let capacity = pages.len() * pools.page_size;
    ensure_inv!(
        req.committed_len <= req.allocated_len,
        "request row {row:?}: committed {} > allocated {}",
        req.committed_len,
        req.allocated_len
    );
    ensure_inv!(
        req.allocated_len <= capacity,
        "request row {row:?}: allocated {} tokens but its {} pages hold {capacity}",
        req.allocated_len,
        pages.len()
    );
    Ok(())
}
