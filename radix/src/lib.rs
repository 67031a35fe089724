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
//! ## Errors
//! No panic is reachable from the public API. Bad input (empty or misaligned keys, mismatched
//! lengths, stale handles, foreign receipts) and exhausted resources (pages, rows) return a
//! [`CacheError`], and the cache is unchanged afterwards. `check_invariants` audits everything;
//! the test suites call it after every step.
//!
//! ## Performance
//! Measured with `cargo bench -p radixkv-radix --bench tree` (criterion, page size 16, see the
//! bench file for shapes); figures are in the repository README.

mod alloc;
mod cache;
mod error;
pub mod events;
pub mod policy;
mod radix_cache;
mod tree;
mod types;

pub use alloc::{DevicePools, PageAllocator, PageState, RowHolder, RowPool};
pub use cache::{
    FinishKind, InsertResult, PoolAccounting, PrefixCache, RequestKv, RequestMatch, SessionTag,
};
pub use error::{CacheError, InvariantViolation, Result};
pub use events::KvEvent;
pub use policy::{EvictionPolicy, LeafToken, NodeMeta, PolicyKind};
pub use radix_cache::{RadixCache, RadixConfig};
pub use tree::tier::TierWalk;
pub use tree::{InsertOptions, LockReceipt, RadixTree, TreeInsert, TreeMatch};
pub use types::{
    KeyRef, Medium, Namespace, NodeId, PageId, RadixKey, RowId, TokenId, align_down, pages_for,
};
