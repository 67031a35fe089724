//! # radixkv-session — streaming sessions that keep their KV between turns, within bounds
//!
//! [`SessionAwareCache`] decorates any [`PrefixCache`] (today `RadixCache`) for chat backends
//! that hold per-user sessions. Requests whose [`RequestKv::session`] names an open *streaming*
//! session are served from that session's slot; every other request, and every tree-level call,
//! goes straight to the inner cache.
//!
//! ## Model
//! A streaming session's turn N+1 prompt extends turn N's tokens (prompt + output); anything
//! else is a [`SessionError::NotExtending`] for that request and the session is untouched.
//! - **Save.** When a turn finishes, the session's *slot* takes over everything the request
//!   owned: its request-pool row (page table), committed and allocated lengths, the
//!   tree-owned (`cache_protected_len`) prefix, its lock receipt, and the Mamba state (see
//!   below). Pages past the committed KV (speculative overshoot, a retract
//!   gap) are freed, and the request is cleared so it cannot free anything twice.
//! - **Restore.** The next turn's `match_request` lends the row back without a tree walk:
//!   `prefix = min(committed, len − 1)`, the rest of the row is trimmed. Lending is idempotent,
//!   so a turn rejected by admission simply matches again. While lent, the row is the running
//!   request's (it is not counted as session-held, so nothing is counted twice).
//! - **The lock stays in the slot.** The first turn's lock receipt never leaves the slot: it
//!   keeps the turn-1 prefix that the tree owns (shared system prompts) resident for as long as
//!   the slot lives, and a lent turn needs no lock of its own because it writes only past that
//!   prefix. Later turns' KV stays in the row's owned pages and reaches the tree on demotion.
//! - **Abort and retract** of a lent turn roll the slot back to the previous turn (the new
//!   pages are freed, the history is kept). A first turn, or a turn after a demotion, runs
//!   through the inner cache and becomes the slot when it finishes.
//! - **Close** releases an idle slot at once (owned pages freed, lock released). With a turn
//!   in flight the close is deferred: the turn's KV is then cached like an ordinary finished
//!   request (or freed if it aborts). Closing an unknown session is [`SessionError::Unknown`].
//!
//! ## Hybrid models: the Mamba state
//! Over a cache with the Mamba component, the slot also keeps the finished turn's **running
//! Mamba slot**: the state after exactly its committed tokens. The next turn is lent that slot
//! and continues in place — no copy on write, and no cut-back of the match to a state the tree
//! holds: its usable prefix is the whole held length even where the tree has no state. (When
//! a turn could use only part of the held tokens, e.g. under `max_prefix_len`, the state cannot
//! be cut back: the slot is demoted and the turn matches the tree.) Checkpoints the turn's
//! first run took past its cached prefix ([`RequestKv::mamba_checkpoints`]) stay with the slot;
//! those past its committed KV are freed at once.
//! - **Demotion** hands the state to the inner cache as a finish would: stored as the state of
//!   the node ending the committed KV where that ends a page and the cache's Mamba policy keeps
//!   it, freed otherwise; the checkpoints are stored with the KV.
//! - **Close** of an idle slot frees the state and the checkpoints with the KV (a deferred close
//!   caches them like a finished request).
//! - **Abort or retract of a lent turn** that allocated KV may have run a forward pass that
//!   advanced the state past the slot's tokens: the state is freed and the slot demoted (its
//!   KV, still exact, becomes cache). A lent turn given back before it allocated anything (an
//!   admission wait) keeps the slot as it was.
//! - **Bounds.** [`SessionConfig::max_held_state_slots`] caps the state slots idle sessions
//!   hold (over it the least recently used are demoted), and a request that finds no free state
//!   slot in `begin_request` demotes idle sessions holding one (least recently used first) and
//!   retries, so held states never keep a new request from starting.
//! - [`PrefixCache::check_request`] is the inner cache's (its Mamba-slot audit included), and
//!   `check_invariants` audits every idle slot as the request it was, plus that no state slot is
//!   held twice.
//!
//! ## Sliding-window layers: the window KV
//! Over a cache whose requests hold sliding-window pages ([`PrefixCache::has_window_state`]),
//! the slot also keeps the finished turn's **window**: its SWA page table from
//! [`RequestKv::swa_evicted_len`] on (the window before the committed end, and the pages after
//! it), the tree's window pages of its cached prefix in it locked by the slot's receipt. The
//! pages that slid out during the turn were freed by [`PrefixCache::slide_window`] already.
//! - **Restore.** The next turn is lent the table, and with it the receipt (a slide that moves
//!   the window past the cached prefix releases the receipt's window locks, as for any
//!   request); it continues at the whole held length without re-prefilling the window. A cut
//!   back below the held length that would need window KV the slot no longer holds demotes the
//!   slot instead, as for a Mamba state.
//! - **Demotion** hands the table to the inner cache's finish insert, which tombstones what
//!   slid out and stores (or revives) the window before the committed end; **close** frees the
//!   slot's own window pages. [`PrefixCache::truncate_request`] trims the row and the table
//!   together whenever a slot is stored or lent.
//! - **Abort or retract of a lent turn** rolls the table back with the row, unless the turn slid
//!   the window past the slot's end: then the slot is dropped, its KV (still exact) finished by
//!   the inner cache as cache where its window still reaches the page-aligned end, freed
//!   otherwise; the session keeps its history.
//! - **Bounds.** [`SessionConfig::max_held_window_pages`] caps the window pages idle sessions
//!   own ([`SessionAwareCache::held_window_pages`]; in the window pool they are request-owned
//!   pages), and an allocation short of window pages demotes idle sessions owning some
//!   (least recently used first) and retries. `check_invariants` audits every idle slot's table
//!   through [`PrefixCache::check_parked`] with the slot's receipt.
//!
//! ## Bounds and demotion
//! Pinned, unbounded session KV starves admission, so held KV is bounded three ways
//! ([`SessionConfig`]): a global budget of held tokens, a per-session cap, and an idle TTL read
//! from an injectable [`Clock`] (tests use [`ManualClock`]). Over budget, expired, or when an
//! allocation (`alloc_tokens`, `alloc_pages`, `make_room`) would otherwise fail, the least
//! recently used *idle* session is **demoted**: its
//! KV is inserted into the inner cache as if its last turn had just finished (shared prefixes
//! deduplicate, the rest becomes ordinary evictable cache), then its lock and row are released.
//! The session stays open and its next turn works through an ordinary prefix match. A session
//! with a turn in flight is never demoted. [`SessionAwareCache::reap`] applies TTL and budget;
//! turn ends call it too.
//!
//! ## Accounting
//! [`PrefixCache::session_held_tokens`] counts the owned pages of idle slots only, so
//! `free + evictable + protected + session_held + request_owned == total` always holds.
//! `check_invariants` runs the inner cache's audit and then checks every slot against the
//! pools (row holder, protected pages, held pages, the idle index) — it is extended, never
//! skipped, while slots legitimately hold their locks. In the Mamba slot pool a held state is
//! a request-held slot (`free + evictable + protected + request_owned == total` per pool), and
//! [`SessionAwareCache::held_state_slots`] says how many of those the idle sessions hold.
//!
//! ## Errors
//! No panic is reachable from the public API. Session misuse returns a [`SessionError`]
//! (mapped to [`radixkv_radix::CacheError::Session`] through the [`PrefixCache`] methods; call
//! [`SessionAwareCache::validate_turn`] for the typed reason).
//!
//! ```
//! use radixkv_radix::{FinishKind, PrefixCache, RadixCache, RadixConfig, RadixKey, RequestKv,
//!     SessionTag};
//! use radixkv_session::{ManualClock, SessionAwareCache, SessionConfig};
//!
//! let inner = RadixCache::new(RadixConfig { page_size: 4, total_pages: 64, ..Default::default() })?;
//! let mut cache = SessionAwareCache::with_clock(inner, SessionConfig::with_budget(128),
//!     ManualClock::new(0));
//! cache.open(7, true, None).unwrap();
//! let tag = Some(SessionTag { id: 7, streaming: true });
//! // Turn 1: 10 prompt tokens, 2 generated.
//! let mut t1 = RequestKv { session: tag, ..RequestKv::new(RadixKey::new((0..10).collect())) };
//! cache.match_request(&mut t1)?;
//! cache.begin_request(&mut t1)?;
//! cache.alloc_tokens(&mut t1, 10)?;
//! t1.commit(10)?;
//! t1.append_tokens(&[100, 101]);
//! cache.alloc_tokens(&mut t1, 1)?; // the last sampled token is not computed yet
//! t1.commit(1)?;
//! cache.cache_finished_req(&mut t1, FinishKind::Finished)?;
//! assert_eq!(cache.session_held_tokens(), 12); // 3 owned pages of 4
//! // Turn 2 extends turn 1 and is answered from the slot.
//! let mut tokens: Vec<u32> = (0..10).collect();
//! tokens.extend([100, 101, 5, 6]);
//! let mut t2 = RequestKv { session: tag, ..RequestKv::new(RadixKey::new(tokens)) };
//! let m = cache.match_request(&mut t2)?;
//! assert!(m.from_session);
//! assert_eq!(m.prefix_len, 11);
//! # cache.cache_finished_req(&mut t2, FinishKind::Aborted)?;
//! # cache.check_invariants().unwrap();
//! # Ok::<(), radixkv_radix::CacheError>(())
//! ```
//!
//! [`PrefixCache`]: radixkv_radix::PrefixCache
//! [`RequestKv::session`]: radixkv_radix::RequestKv::session
//! [`PrefixCache::session_held_tokens`]: radixkv_radix::PrefixCache::session_held_tokens
//! [`PrefixCache::check_request`]: radixkv_radix::PrefixCache::check_request
//! [`PrefixCache::has_window_state`]: radixkv_radix::PrefixCache::has_window_state
//! [`RequestKv::mamba_checkpoints`]: radixkv_radix::RequestKv::mamba_checkpoints
//! [`RequestKv::swa_evicted_len`]: radixkv_radix::RequestKv::swa_evicted_len
//! [`PrefixCache::slide_window`]: radixkv_radix::PrefixCache::slide_window
//! [`PrefixCache::truncate_request`]: radixkv_radix::PrefixCache::truncate_request
//! [`PrefixCache::check_parked`]: radixkv_radix::PrefixCache::check_parked

#![warn(missing_docs)]

mod cache;
mod clock;
mod error;
mod prefix;
#[cfg(test)]
mod tests;

pub use cache::{CloseOutcome, ReapReport, SessionAwareCache, SessionConfig, SessionInfo};
pub use clock::{Clock, ManualClock, SystemClock};
pub use error::SessionError;
