//! # radixkv-radix — the radix prefix cache over paged device KV pools
//!
//! This crate is the bottom floor of radixkv: the [`PrefixCache`] trait that every cache
//! implements, the request-side state it reads and writes ([`RequestKv`]), the tree core
//! ([`RadixTree`]), the device pool allocators ([`PageAllocator`], [`RowPool`]), pluggable
//! eviction policies ([`PolicyKind`], [`EvictionPolicy`]), KV events ([`KvEvent`]) and the
//! device-only [`RadixCache`]. It is pure: no threads, no I/O, no async.
//!
//! ## Model
//! KV memory is paged: a page holds `page_size` tokens (1 allowed). Tree keys are token runs
//! in a [`Namespace`] (tenant / LoRA / cache salt), always page-aligned; a request keeps its own
//! partial last page. Children are keyed by (namespace, first page), so namespaces never share
//! a node. Nodes live in a `slab` arena and are named by generation-checked [`NodeId`]s: a
//! stale handle is an error, never a different node.
//!
//! A request that uses a cached prefix holds a lock on its root path; locks are receipts
//! ([`LockReceipt`]) that must be handed back, not `Clone`, so a double release does not compile
//! and a foreign or stale receipt is a typed error. Unlocked leaves on device are evictable; the
//! tree keeps them in one policy structure so that evicting `k` leaves costs `O(k log n)`.
//!
//! Every device page is in exactly one place — free, in the tree, or owned by a request or
//! session row — and [`PrefixCache::accounting`] reports
//! `free + evictable + protected + session_held + request_owned == total`.
//!
//! ## Components: one tree for hybrid models
//! Hybrid Transformer–Mamba models keep more than KV per prefix. The tree stays one tree; a
//! node carries *components* beside its full KV, each with its own pool, its own lock counts,
//! its own eviction order and its own audit. The full KV is always there; the others are
//! optional per cache and live in side tables indexed by arena index, so a KV-only tree keeps
//! its node layout and pays a single branch on a `None` where a node leaves the device.
//!
//! **Mamba** ([`RadixConfig::mamba_slots`], [`RadixTree::enable_mamba`]): a fixed pool of
//! state slots ([`StateSlotPool`]; a slot holds the states of all Mamba layers, the crate only
//! keeps slot ids). A node may carry one slot: the state after its last token.
//! - *Split*: a state cannot be split, so only the lower node (which keeps the node's id and
//!   last token) keeps it.
//! - *Match* ([`RadixTree::match_mamba`]): usable only up to the deepest device node on the
//!   path that carries a state; [`MambaMatch::kv`] says how far the KV went, which is where the
//!   forward pass should checkpoint for the next request.
//! - *Copy on write* ([`RadixTree::cow_mamba`]): a hit locks the state
//!   ([`RadixTree::inc_lock_ref_mamba`]; the receipt records that it did) and allocates the
//!   request's own slot; the tree returns `(src, dst)` ([`MambaCow`]) and the device backend
//!   copies the bytes.
//! - *Insert* ([`RadixTree::insert_mamba_state`]): a request's slot becomes the node's state,
//!   or is freed when the node already has one.
//! - *Admission* ([`RadixConfig::mamba_policy`], [`mamba_policy`]): which states a
//!   [`RadixCache`] request leaves behind. [`MambaPolicy::Sglang`], the baseline, where SGLang
//!   caches: the state at the end of every prefill chunk, handed over from the request's
//!   tracking slot ([`RequestKv::mamba_track`], [`MambaTrack`]; one is taken where a slot can
//!   be spared, [`RadixConfig::mamba_track`]), the branching point where the KV match passed
//!   the deepest state, and the state at the request's end, at the computed length floored to
//!   a page (a node boundary): the running state where that is the computed length, else the
//!   tracked one.
//!   [`MambaPolicy::Marconi`], the default: the same points plus checkpoints at the branch
//!   point where the request leaves a cached path (and optionally at its prompt end), handed
//!   to the engine as [`RequestKv::mamba_checkpoints`] (one slot each; stored with the KV that
//!   reaches them, freed when the request ends first), with hit-driven admission per kind
//!   ([`MambaStats`]).
//! - *Locks*: a receipt locks the KV path to its anchor and, optionally, the anchor's state
//!   (Mamba lock ≤ KV lock on every node).
//! - *Eviction and the cascade*: evicting a node's device KV evicts its state (a state cannot
//!   be resumed without the KV before it); evicting a state under slot pressure
//!   ([`RadixTree::evict_mamba`]: least recently used unlocked state first, or under Marconi
//!   the lowest recency + FLOPs-saved-per-byte utility; automatically when
//!   [`RadixTree::alloc_mamba_slot`] finds the pool full) keeps the KV: the node becomes a
//!   tombstone for the Mamba component. With no free slot and every state locked, allocation
//!   fails with [`CacheError::OutOfStateSlots`].
//! - *Accounting* ([`RadixTree::mamba_accounting`]): every slot is exactly one of free, held by
//!   a node (evictable or protected) or held by a request; the audit checks it, and that no
//!   slot is held twice or freed twice.
//!
//! **Sliding window** ([`RadixConfig::swa`], [`RadixTree::enable_swa`]): a second paged pool for the
//! window KV of sliding-window layers (same page size; a [`PageAllocator`] owned by the
//! component). A node may carry one window page per page of its key, or none (a *tombstone*;
//! its full KV stays).
//! - *Match* ([`RadixTree::match_swa`]): cut back to the deepest node boundary `L` with a full
//!   window of live window KV before it (`[L - window, L)`, or all of `[0, L)` when shorter);
//!   [`SwaMatch::kv`] says how far the full KV went.
//! - *Insert* ([`RadixTree::insert_swa`]): the full-KV insert plus one window page per page of
//!   the key; tombstones on the key's path are revived with the caller's pages, caller pages that
//!   duplicate live window KV are freed.
//! - *Locks* ([`RadixTree::inc_lock_ref_swa`]): the receipt locks the KV path and the window KV
//!   of the nodes the window before the anchor's end touches; the top of that walk carries a
//!   mark the receipt records, which a split moves to the new upper node (with the lock count),
//!   so the release always undoes exactly what was locked (SWA lock ≤ KV lock on every node).
//! - *Eviction and the cascade*: evicting a node's full KV frees its window KV; tombstoning
//!   ([`RadixTree::evict_swa`], least recently used unlocked window KV first, automatically in
//!   [`RadixTree::alloc_swa_pages`] when the pool is short; [`RadixTree::evict_swa_node`]) keeps
//!   the full KV.
//! - *Accounting* ([`RadixTree::swa_accounting`]): every SWA page is free, tree-held (evictable
//!   or protected) or held by a caller; the audit checks it, that no page is held twice, and
//!   that every live node holds one window page per page of its key.
//! - *Decode* (the tree's side of it): a request frees its own window pages that slid out
//!   ([`RadixTree::free_swa_pages`]), drops its SWA locks once it is a window past its cached
//!   prefix ([`RadixTree::release_swa_lock`]; the KV locks stay) and inserts with the window
//!   pages it still has ([`RadixTree::insert_swa_from`]: nodes before them stay or become
//!   tombstones, splitting a node that straddles the first one).
//!
//! - *Requests* ([`RadixCache`] with [`SwaConfig`]; the window a multiple of the page size): a
//!   request's SWA page table ([`RequestKv::swa_pages`]) covers its tokens from
//!   [`RequestKv::swa_evicted_len`] on, one SWA page per full-KV page of its row. `begin_request`
//!   locks the window KV before the match end and puts the tree's window pages first in it;
//!   [`PrefixCache::alloc_tokens`] takes pages from both pools or from neither
//!   ([`CacheError::OutOfComponentPages`] names the SWA pool); chunk inserts hand the request's
//!   window pages to the tree and keep only the (canonical) window before the cached end;
//!   [`PrefixCache::slide_window`] frees the request's own pages that left the window and, once
//!   the window has passed the cached prefix, releases the receipt's SWA locks; the finish inserts
//!   what the request still holds (what slid out is a tombstone), abort frees it all.
//!   [`RadixCache::swa_accounting`] and the audits (after every operation in debug builds) cover
//!   the SWA pool like the full-KV pool.
//!
//! - *Both components in one tree* (a model with full-attention, sliding-window and Mamba
//!   layers: [`RadixConfig::mamba_slots`] and [`RadixConfig::swa`] together): a match ends only
//!   at a node boundary where both validators pass — a Mamba state there *and* a full window of
//!   live window KV before it ([`RadixTree::match_swa`] checks both) — and a hit's receipt
//!   locks the path, the window and the state ([`RadixTree::inc_lock_ref_swa_mamba`]); a
//!   request holds its running Mamba slot beside its window table, and allocation stays atomic
//!   across the full-KV and SWA pools (states are taken at begin). Eviction cascades Full >
//!   SWA > Mamba on a node: evicting full KV drops both components, tombstoning a node's window
//!   KV drops its unlocked state (a state whose window is gone could not be resumed, and
//!   [`RadixTree::insert_mamba_state`] refuses one there: [`MambaInsert::WindowTombstone`]),
//!   evicting a state keeps the KV of both kinds. The audits check all three pools and that no
//!   unlocked state sits on a window tombstone.
//!
//! Sessions carry the sliding window (a streaming session's slot keeps its window table across
//! turns through [`PrefixCache::truncate_request`] and [`PrefixCache::check_parked`], see
//! `radixkv-session`); the host tier does not yet (it refuses it).
//!
//! The session layer carries the Mamba component (a streaming session's slot keeps the
//! request's running state across turns, see `radixkv-session`), and so does the host tier
//! (`radixkv-hicache`'s `HiRadixCache` backs up and loads the states with their KV).
//!
//! ## Errors
//! No panic is reachable from the public API. Bad input (empty or misaligned keys, mismatched
//! lengths, stale handles, foreign receipts) and exhausted resources (pages, rows) return a
//! [`CacheError`], and the cache is unchanged afterwards. `check_invariants` audits everything;
//! the test suites call it after every step.
//!
//! ## Performance
//! `cargo bench -p radixkv-radix --bench tree` (criterion; page 16, token ids from a seeded
//! RNG, 1024 chains of 2048 tokens sharing a 1024-token root), medians of two runs on a 2-core
//! VM:
//!
//! | operation | measured | goal |
//! | --- | --- | --- |
//! | match a fully cached 2048-token prompt | 2.8–4.0 ns per matched page | ≤ 5 |
//! | insert a new 2048-token chain sharing the root | 9.2–9.6 ns per new page | ≤ 10 |
//! | evict 1,000 of 1K / 100K / 1M single-page leaves | 38–39 / 45–46 / 47–50 ns per leaf | ≤ 50 |
//!
//! For comparison, on the same shapes and a similar machine: text-generation-inference's trie
//! 16.5 / 16.2 ns per page and 100 / 362 / 495 ns per leaf; a vLLM-style hash-chain pool
//! (mistral.rs) 126 / 272 ns per page and 37 / 219 / 404 ns per leaf.

mod alloc;
mod cache;
mod error;
pub mod events;
pub mod mamba_policy;
pub mod page_hash;
mod page_key;
pub mod policy;
mod radix_cache;
mod slots;
mod tree;
mod types;

pub use alloc::{
    DevicePools, PageAllocator, PageState, RowHolder, RowPool, try_filled, try_with_capacity,
};
pub use cache::{
    FinishKind, InsertResult, PoolAccounting, PrefixCache, RequestKv, RequestMatch, SessionTag,
    make_room_by_evicting, pages_to_alloc, refuse_partial_key_finish,
};
pub use error::{CacheError, InvariantViolation, Result, SessionFault};
pub use events::{EventBuffer, KvEvent, KvEventBatch};
pub use mamba_policy::{
    CheckpointKind, FlopCurve, KindStats, MambaCheckpoint, MambaPolicy, MambaStats, MambaTrack,
    MarconiParams,
};
pub use page_hash::{PageHash, PageHasher, PageHashes};
pub use page_key::{KeySeed, KvIdentity, PageKey};
pub use policy::{EvictionPolicy, LeafClass, LeafToken, NodeMeta, PolicyKind, ReuseCreditPolicy};
pub use radix_cache::{RadixCache, RadixConfig, SwaConfig};
pub use slots::{SlotState, StateSlotPool};
pub use tree::mamba::{MambaCow, MambaInsert, MambaMatch};
pub use tree::mamba_tier::MambaHostHit;
pub use tree::swa::{SwaInsert, SwaMatch};
pub use tree::swa_tier::SwaHostHit;
pub use tree::tier::{HostInsert, TierWalk};
pub use tree::{InsertOptions, LockReceipt, RadixTree, TreeInsert, TreeMatch};
pub use types::{
    ComponentAccounting, KeyRef, Medium, Namespace, NodeId, PageId, RadixKey, RowId, TokenId,
    align_down, pages_for,
};
