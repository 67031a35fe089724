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
//!   tree-owned (`cache_protected_len`) prefix, its lock receipt, and the hybrid-model state
//!   (Mamba slot, SWA frontier). Pages past the committed KV (speculative overshoot, a retract
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
//! skipped, while slots legitimately hold their locks.
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
