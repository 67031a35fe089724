//! # radixkv-hicache — the hierarchical KV cache (device L1 ↔ host L2)
//!
//! [`HiRadixCache`] is a [`PrefixCache`](radixkv_radix::PrefixCache) whose tree nodes live on
//! two tiers: the device KV pool and a larger host pool. Bytes really move: a
//! [`DeviceBackend`] owns the device pool and two copy streams, and the
//! [`HybridCacheController`] turns the cache's decisions into merged, asynchronous copies.
//!
//! ## Model
//! - **Geometry.** A pool is `layers × pages × page_size × bytes_per_token_layer` bytes
//!   ([`KvGeometry`]); the device pool is layer-major, the host pool is
//!   [`HostLayout::LayerFirst`] (same as the device) or [`HostLayout::PageFirst`] (all layers
//!   of a page contiguous, so a whole page is one contiguous object).
//! - **Backends.** [`DeviceBackend`] has CUDA semantics: `enqueue_copy` returns at once, an
//!   event recorded after it completes when the copy is done. [`HostSim`] implements it with
//!   ordinary memory and one worker thread per stream; it can delay or gate copies so tests
//!   observe overlap. With the `cuda` feature, `cuda::CudaBackend` implements it on an NVIDIA
//!   GPU (the CUDA driver API, loaded at run time; see that module). An engine may also
//!   implement [`DeviceBackend`] for its own device; either is handed to
//!   [`HiRadixCache::new`] (or to the manager's builder in `radixkv-scheduler-api`).
//! - **Controller.** `write`/`load` allocate the target pages (and extra-pool slots, all or
//!   nothing) and queue a [`CacheOperation`]; `start_writing`/`start_loading` merge the queue
//!   into one transfer whose adjacent pages coalesce into runs. Extra pools (Mamba state, SWA
//!   KV: [`ExtraPoolSpec`] with their own item size) have a host-side [`SlotMemory`] and a
//!   device-side buffer in the backend, and their slots move in the same transfer, before the
//!   same events. Loads go layer by layer and complete one event per layer in a
//!   [`LayerDoneCounter`], so the forward pass of layer `i` waits only for layer `i`.
//!   Completions return as [`Acks`]; a failed copy is reported as failed, never as done.
//! - **Tiers.** Node states: device only → writing (locked until the ack) → both → host only
//!   → gone. [`WritePolicy`] decides when to back up; device eviction of a backed-up node frees
//!   only its device pages; host eviction removes host-only leaves in the order of the
//!   host tier's eviction policy (`HiCacheConfig::host_policy`, by default a second instance
//!   of the device tier's [`PolicyKind`](radixkv_radix::PolicyKind)); an exhausted host degrades to device-only (counted in
//!   [`HiCacheStats`]), never to an error. A host `BlockStored` event is emitted when the
//!   backup is acknowledged, not when it is queued. A failed backup leaves the node
//!   device-only; a failed load is reported to the forward pass as an error and repaired (or
//!   demoted) at the next step, never served as wrong KV. A host hit is loaded
//!   back in `begin_request` (minimum size and quota apply) and becomes part of the request's
//!   prefix; the scheduler starts the loads with [`HiRadixCache::start_loading`] and waits per
//!   layer before reading them.
//! - **Threads.** Only the streams run on other threads; the tree changes on the caller's
//!   thread, when [`HiRadixCache::step`] applies acks at a step boundary. Pages whose load is
//!   in flight are in the tree already, so every batch starts its loads with
//!   [`HiRadixCache::start_loading`] (even a batch that loads nothing) and its forward waits
//!   on the returned step, which also covers earlier batches' loads still in flight.
//!
//! ## Limits and failures
//! - **Bounded queues.** A [`HostSim`] stream queues at most
//!   [`HostSimConfig::stream_capacity`] commands; a submission beyond that blocks until the
//!   worker makes room (a GPU's launch queue does the same). The controller holds at most
//!   [`HiCacheConfig::max_pending_ops`] operations per direction, queued or in flight until
//!   acknowledged: past it a backup is skipped and counted
//!   ([`HiCacheStats::backups_skipped_queue_full`]; the prefix stays device-only) and a
//!   load-back makes `begin_request` return `CacheError::Busy` with nothing changed (the request
//!   waits for the next step; loads are never dropped silently).
//! - **Refused submissions.** When the backend refuses a copy or an event
//!   ([`HostSim::refuse_next_submissions`] injects it), the operations are re-queued and
//!   retried: backups at the next insert or step, loads at the next `start_loading`, whose
//!   error tells that batch not to run. A write-back eviction cannot wait for a retry, so its
//!   refused backup is undone and the victims are evicted without one.
//! - **Dead streams.** If a stream's worker exits (panics), every event pending on it
//!   completes with [`HiCacheError::StreamClosed`] and every later submission is refused with
//!   it; the operations on that stream are reported as failed copies and handled as above, so
//!   no `wait` blocks forever.
//! - **Sizes.** Pool sizes are checked; a pool that overflows is [`HiCacheError::Config`], one
//!   the allocator refuses is [`HiCacheError::AllocFailed`] (never an abort).
//!
//! ## Example
//! ```
//! use std::sync::Arc;
//! use radixkv_hicache::{HiCacheConfig, HiRadixCache, HostSim, HostSimConfig, KvGeometry, WritePolicy};
//! use radixkv_radix::{FinishKind, PrefixCache, RadixConfig, RadixKey, RequestKv};
//!
//! let radix = RadixConfig { page_size: 4, total_pages: 8, ..Default::default() };
//! let geometry = KvGeometry::new(2, 4, 16)?;
//! let device = Arc::new(HostSim::new(geometry, 8, HostSimConfig::default())?);
//! let cfg = HiCacheConfig { radix, write_policy: WritePolicy::WriteThrough, ..Default::default() };
//! let mut cache = HiRadixCache::new(cfg, device)?;
//!
//! let mut a = RequestKv::new(RadixKey::new((0..17).collect()));
//! cache.match_request(&mut a)?;
//! cache.begin_request(&mut a)?;
//! cache.alloc_tokens(&mut a, 17)?;
//! a.commit(17)?; // the forward pass wrote the KV into the row's pages
//! cache.cache_finished_req(&mut a, FinishKind::Finished)?;
//! cache.flush()?; // the backup is on the host now
//! cache.evict(16); // device eviction demotes the node to host-only
//!
//! let mut b = RequestKv::new(RadixKey::new((0..17).collect()));
//! assert_eq!(cache.match_request(&mut b)?.host_hit_len, 16);
//! cache.begin_request(&mut b)?; // loads the 16 tokens back
//! assert_eq!(b.prefix_len, 16);
//! let step = cache.start_loading()?.expect("a load is queued");
//! cache.layer_counter().set_consumer(step.producer);
//! cache.layer_counter().wait_until(0)?; // layer 0 may be read now
//! # cache.flush()?;
//! # cache.cache_finished_req(&mut b, FinishKind::Finished)?;
//! # cache.check_invariants().unwrap();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! - **Storage tier (L3).** With [`HiCacheConfig::storage`], acknowledged host copies are backed
//!   up to a [`storage::StorageBackend`] in the background and requests can prefetch their
//!   stored prefix into the host tier ([`HiRadixCache::prefetch`],
//!   [`HiRadixCache::check_prefetch`]); see [`storage`] and [`HiRadixCache`]'s module docs,
//!   "Storage tier".
//! - **Several ranks.** A [`Consensus`] hook ([`HiCacheConfig::consensus`], default
//!   [`SingleRank`]) reduces every asynchronous outcome across ranks so their trees stay
//!   identical.
//!
//! ## Not yet here
//! The CUDA backend has not run on a GPU yet (no GPU machine was available; its tests skip
//! without one). It has no copy gate or refusal injection, so the tests that need them run on
//! [`HostSim`] only. It does not use the driver's batched copy call or a gather kernel.
//!
//! The storage tier stores the tree's Mamba states and sliding-window KV with their pages (also
//! those that reach the host after their page was stored), but no other extra pool
//! ([`HiCacheConfig::extra_pools`] with a storage tier is refused).
//! [`HiRadixCache`] moves Mamba states and sliding-window KV with their KV (the tree's Mamba
//! and SWA components, one of them or both in one tree; see its module docs, "Extra pools").

mod backend;
mod consensus;
mod controller;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod geometry;
mod hiradix;
mod host_pool;
mod hostsim;
mod layer_counter;
pub mod storage;

pub use backend::{
    CopyEvent, DeviceBackend, Direction, HostMemory, PageCopy, PageRun, SlotCopy, SlotMemory,
    StreamKind, validate_copy,
};
pub use consensus::{Consensus, SingleRank};
pub use controller::{
    Acks, CacheOperation, DEFAULT_MAX_PENDING_OPS, ExtraPoolSpec, HybridCacheController, LoadStep,
    OpId, PoolName, PoolTransfer, SORT_RUNS_FROM_PAGES, SORT_RUNS_UP_TO, SlotOwner, TransferStats,
    merge_runs,
};
pub use error::{HiCacheError, Result};
pub use geometry::{HostLayout, KvGeometry};
pub use hiradix::{
    DEFAULT_PREFETCH_THRESHOLD_TOKENS, HiCacheConfig, HiCacheStats, HiRadixCache, PrefetchStatus,
    PrefetchStop, StorageConfig, TestMutations, WritePolicy,
};
pub use host_pool::{HostPool, HostSize, SlotAllocator};
pub use hostsim::{
    CopyGate, DEFAULT_STREAM_CAPACITY, HostSim, HostSimConfig, POISON_BYTE, SimEvent,
};
pub use layer_counter::{LayerDoneCounter, PRODUCER_RING};
