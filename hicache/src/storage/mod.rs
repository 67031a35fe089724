//! The storage tier (L3): stores of encoded KV pages under content-addressed keys.
//!
//! - **Keys.** A page is stored under a [`PageKey`](radixkv_radix::PageKey): a BLAKE3 chain
//!   over the token pages of its prefix, seeded with its namespace and the model's
//!   [`KvIdentity`](radixkv_radix::KvIdentity) (see `radixkv_radix::KeySeed`). Tenants never
//!   share a key and a crafted prompt cannot alias another prompt's page.
//! - **Pages.** A stored page is a header (magic, version, geometry, identity, key, lengths,
//!   checksum) and a payload (the page's KV of every layer, page-major, then the extra pools'
//!   sections): [`PageFormat`]. Under a hybrid tree a page's sections are the Mamba state
//!   that ends at the page (the state after its last token) and its window KV, where the host
//!   copy had them ([`SectionSource`], [`SectionTarget`]; see `HiRadixCache`'s module docs,
//!   "Storage tier: components"). A page that fails any check is a [`PageError`], which the tier
//!   counts as a miss: it never becomes KV. A damaged page ([`PageError::is_damage`]: bad
//!   magic, lengths, key or checksum) is also removed from the store
//!   ([`StorageBackend::discard_damaged`], counted in [`StoreStats::damaged_pages`]), so it
//!   costs one miss rather than one per lookup.
//! - **Stores.** [`StorageBackend`] is an object-safe async trait of batched operations
//!   (longest stored prefix, get, put, delete, stats); a store keeps encoded pages and knows
//!   nothing else. [`MemStore`] keeps them in process memory; [`FileStore`], the default,
//!   appends them to segment files in a directory (checksummed records, a torn tail is never
//!   read, a size cap with least-recently-used eviction of whole segments, an index rebuilt at
//!   open so a restarted server finds its pages); `RedisStore`
//!   (cargo feature `redis`) on a Redis server or cluster.
//! - **Faults.** [`FaultStore`] wraps any store and injects seeded errors, hangs, slow
//!   answers, partial batches and corrupted pages, and can take the store down and up again:
//!   the tests of the tier above run against it.
//! - **Engine.** [`StorageTier`] runs backups (host pool → store), queries (longest stored
//!   prefix) and fetches (store → host pool) as tasks on a tokio runtime, with bounded
//!   concurrency and per-operation timeouts, and hands their [`Completion`]s back to the
//!   scheduler thread, which never blocks on the store. [`HiRadixCache`](crate::HiRadixCache)
//!   drives it when [`HiCacheConfig::storage`](crate::HiCacheConfig::storage) is set.

mod backend;
mod fault;
mod file;
mod page;
#[cfg(feature = "redis")]
mod redis;
mod tier;

pub use backend::{MemStore, StorageBackend, StoreError, StoreFuture, StoreStats};
pub use fault::{FaultConfig, FaultCounts, FaultStore};
pub use file::{DEFAULT_SEGMENT_BYTES, FileStore, FileStoreConfig, FileSync, RECORD_HEADER_BYTES};
pub use page::{
    DecodedPage, FIXED_HEADER_BYTES, MAX_SECTIONS, PAGE_MAGIC, PAGE_VERSION, PageError, PageFormat,
};
#[cfg(feature = "redis")]
pub use redis::{REDIS_MAX_VALUE_BYTES, RedisConfig, RedisStore};
pub use tier::{
    Completion, GateState, JobGate, JobId, SEED_CACHE_LIMIT, SectionSource, SectionTarget,
    StorageTier, TierOptions,
};
