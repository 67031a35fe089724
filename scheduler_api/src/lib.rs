//! # radixkv-scheduler-api — the scheduler's front door to radixkv
//!
//! A continuous-batching scheduler embeds one [`KvCacheManager`] and drives one lifecycle per
//! request; it never calls tree internals, pool allocators or tier controllers itself.
//!
//! ## The model
//! - **Configuration** ([`ManagerConfig`], from a builder, TOML or JSON): model geometry
//!   ([`geometry`]: every layer full attention, sliding window or Mamba, as a repeated pattern;
//!   KV bytes per token, page size; presets `dense`, `jamba-like`, `gemma-like`; FLOPs per
//!   token), the device pools it derives ([`ManagerConfig::pools`]), the cache
//!   kind (`disabled` / `radix` / `hicache` with a [`HostTier`]: host pool size, write policy,
//!   host eviction policy, host layout, load-back minimum and quota, pending-transfer limit),
//!   the eviction policy, sessions and their budget, the device backend. [`config::EXAMPLE_TOML`]
//!   is a commented example of every key (`radixkv config --example` prints it). The write
//!   policy is `radixkv-hicache`'s [`WritePolicy`], written as a plain string
//!   (`"write_back"`, `"write_through_selective:2"`). Under the host tier, a storage tier (L3,
//!   [`StorageTier`]: a file directory, process memory, Redis with the `redis` feature, or the
//!   engine's own [`radixkv_hicache::storage::StorageBackend`] handed to
//!   [`ManagerBuilder::storage_backend`]) keeps KV pages beyond the host pool and across
//!   restarts; for a model with Mamba or sliding-window layers the stored pages carry the
//!   Mamba states and window KV too.
//! - **Prompts** are owned ([`Request::new`]: the manager keeps the tokens from arrival on) or
//!   given by a [`TokenSource`] ([`Request::lazy`], or [`Request::shared`] over the engine's
//!   `Arc<[TokenId]>`): a lazy request holds no tokens while it waits, [`KvCacheManager::admit`]
//!   fills them, and only the lazy request tried last keeps them while it still waits, so the
//!   memory of a queue is its sources'. [`KvCacheManager::token_storage`] says what waiting
//!   and running requests hold ([`TokenStorage`]).
//! - **Construction** happens in one place, [`factory::build_cache`], which turns the config into
//!   a [`factory::ManagedCache`]: a `PrefixCache` plus step hooks, session lifecycle and tier
//!   reports. Built: disabled, radix, radix + sessions (`radixkv-session`), HiCache over the
//!   HostSim backend (`radixkv-hicache`), HiCache + sessions, and a model with Mamba layers
//!   (a Jamba-like hybrid) on every cache kind, with or without sessions (a session slot
//!   keeps its running state across turns), or sliding-window layers
//!   (Gemma-like) on the disabled and radix caches, with or without sessions (a session slot
//!   keeps its window KV across turns) and under a host tier, with or without sessions (the
//!   window KV is backed up and loaded back with its KV; a session slot keeps its window KV
//!   across turns there too, and a demoted session's window comes back from the host), or both
//!   kinds in one model (full attention, sliding window and Mamba layers: one tree carries both
//!   components, admission needs room in each of the three pools; under a host tier too, with
//!   or without sessions: the window KV and the states are backed up and loaded back with their
//!   KV, and a demoted session's next turn loads its KV, window and state back from the host).
//! - **Mamba state slots** (models with `M` layers): the slot pool holds
//!   `pools.mamba_bytes / slot bytes` slots, at least 2 (a budget for fewer is a
//!   [`ManagerError::Config`]: a hit holds the cached state and the request's copy); or
//!   `pools.total_bytes` gives the KV and the state pool one budget, split by the Mamba
//!   policy's own rule ([`split`]). Every running request holds one slot of its own
//!   ([`Admitted::mamba_slot`]); a hit is usable only up to the deepest cached state, and the
//!   engine copies that state into the request's slot before its first forward
//!   ([`Admitted::mamba_cow`]). Where a slot can be spared, a request also gets a tracking
//!   slot ([`Admitted::mamba_track`], [`KvCacheManager::mamba_track`]) in which the engine
//!   keeps the state at the last page boundary, so that a finish off a page boundary still
//!   leaves its state (at the computed length floored to a page). Admission needs KV room
//!   *and* a slot
//!   ([`WaitReason::NoStateSlot`]); [`KvCacheManager::mamba_accounting`] and the `mamba_*`
//!   metrics say where every slot is. A session turn served from its slot continues in the
//!   slot the previous turn left (same [`Admitted::mamba_slot`], no copy); idle sessions'
//!   held states count as request-held slots and are demoted when a request finds none free.
//! - **Sliding-window KV** (models with `S` layers): the SWA page pool holds
//!   `pools.swa_bytes / (page_size × SWA KV bytes per token)` pages, the window comes from the
//!   geometry. A running request owns SWA pages beside its full-KV row; admission needs
//!   full-KV room *and* SWA room for the pages it may own at its peak
//!   ([`WaitReason::NoWindowRoom`], [`NeverReason::WindowPoolTooSmall`]); [`KvCacheManager::decode`]
//!   and [`KvCacheManager::chunk_done`] free the window pages that slid out (the
//!   `swa_pages_slid_out` counter); [`KvCacheManager::swa_accounting`] and the `swa_*` metrics
//!   say where every page is.
//! - **Bring your own device**: the host tier copies KV through a
//!   [`radixkv_hicache::DeviceBackend`]. By default it is HostSim; an engine hands the manager
//!   its own (its GPU backend, or any wrapper) with [`ManagerBuilder::device_backend`], and
//!   the tier ([`factory::Tiered`]) runs over it. That backend's pools must hold the model's
//!   KV in the configured device pool (layers, bytes per token per layer, page size, pages),
//!   and the cache must have a host tier; otherwise [`ManagerError::Backend`] says what does
//!   not fit. With the crate feature `cuda`, `backend = { type = "cuda", device = N }` makes
//!   the manager build `radixkv_hicache::cuda::CudaBackend` itself, allocating the device pool
//!   in the model's geometry (without the feature it is [`ManagerError::FeatureOff`]); an engine
//!   that owns its KV memory wraps it (`CudaBackend::from_device_regions`) and hands it over.
//! - **Modeled vs simulated bytes**: the built-in HostSim really copies bytes, so its pools use
//!   a tiny [`config::SimGeometry`]; every reported byte (step loads, transfers, the cost
//!   model's transfer time) is *modeled*: pages × the model's page bytes. Over an engine's own
//!   backend the two agree.
//! - **Sessions**: a request carrying a session id opens it (streaming) on arrival, or call
//!   [`KvCacheManager::open_session`]; [`KvCacheManager::close_session`] releases it and says
//!   whether the close was deferred to a turn in flight. Idle TTLs run on the manager's clock,
//!   which the scheduler sets ([`KvCacheManager::set_time_ms`]). On a manager configured
//!   without sessions, a session-tagged request and every session call are refused
//!   ([`ManagerError::SessionsOff`]), never silently ignored.
//! - **Lifecycle**: `arrive` → `admit` (match, temporary lock, budget check, load-back, lock) →
//!   `extend` per prefill chunk (allocation evicts as needed) → `chunk_done` (the chunk enters
//!   the cache at once) → `decode` per token (out of memory → `retract`) → `finish` / `abort`.
//!   A step is: form the batch (`admit`, `extend`, `decode`), `begin_step` (starts every queued
//!   host load; its handle says what the forward must wait for, per layer), the forward,
//!   `chunk_done` / `finish`, `end_step` (acks, KV events, transfer counts; debug builds audit
//!   every invariant there). An admission made while a step is open starts its load at once and
//!   joins that step's handle when the step began with loads of its own; in a step that began
//!   with nothing to load (most steps, whose handle then shares nothing with the manager), an
//!   admission that needs a load waits for the next step
//!   ([`WaitReason::OpenStepLoadsNothing`]). No order of calls leaves a load behind a handle
//!   that says there is nothing to wait for.
//! - **Verdicts**: `admit` answers [`Admission::Ready`], [`Admission::Wait`] (not now) or
//!   [`Admission::Never`] (larger than the whole device pool: reject it, waiting would never end).
//! - **Retraction keeps what was computed**: `retract` caches the request's computed,
//!   page-aligned KV (prompt and output) before releasing it, so its re-admission hits it; a
//!   retracted session turn's session is demoted, so the memory is really freed.
//! - **Budgets**: admission sees `free + evictable − reserved` tokens, where every admitted
//!   request reserves its remaining prompt plus a clipped output budget until it allocates them.
//! - **Observability**: [`Metrics`] (counters and gauges, Prometheus text export), `tracing`
//!   spans at `debug` level (a `kv_request` span per request from `arrive` to `finish` /
//!   `abort`, carrying the engine's [`Request::engine_id`], and a `kv_step` span per step; see
//!   the [`KvCacheManager`] docs), KV events for routers. Events wait in a bounded buffer
//!   ([`ManagerConfig::event_capacity`]) until [`KvCacheManager::take_events`] drains them;
//!   past it they are dropped and counted (`kv_events_dropped`), and a router that sees the
//!   count move must resync its view of the cache.
//! - **Reset**: [`KvCacheManager::reset`] drops every cached KV on every tier (only with no
//!   request registered, else [`ManagerError::Busy`]) and reports `AllBlocksCleared`.
//! - **Page-table upload**: [`KvCacheManager::pages_as_u32`] is a request's row of pages as
//!   `&[u32]`, a view of the same memory (`PageId` is `#[repr(transparent)]` over `u32`).
//! - **Back-pressure**: an admission that needs a host-tier load while the tier already holds
//!   its limit of pending loads ([`HostTier::max_pending_ops`]) waits
//!   ([`WaitReason::TransfersBusy`]).
//!
//! ## Threading model
//! The manager is synchronous and single-owner: every call takes `&mut self` and returns when
//! its bookkeeping is done; host-tier copies complete on the backend and are applied at step
//! boundaries. [`KvCacheManager`] is `Send`
//! (checked at compile time), not `Sync`: one scheduler thread owns it and makes every call,
//! in step order. A [`StepHandle`] is `Send + Sync`, so the thread that runs the forward may
//! wait on it while the scheduler forms the next batch.
//!
//! An async server keeps it that way: its tasks never share the manager (no
//! `Arc<Mutex<KvCacheManager>>` locked from many tasks, no guard held across an `.await`).
//! Request handlers send their requests over an `mpsc` channel to one dedicated scheduler
//! task (or thread, e.g. `tokio::task::spawn_blocking` when the forward blocks) that owns the
//! manager; each step it drains the channel, runs `arrive` / `admit` / `begin_step` /
//! `extend` / `decode` / `end_step` / `finish`, and answers each request through the
//! `oneshot` channel that came with it. `examples/tokio_server.rs` is such a loop (run it
//! with `cargo run -p radixkv-scheduler-api --example tokio_server`).
//!
//! ## The replay tool
//! The reference continuous-batching scheduler, the trace readers, the offline analysis, the
//! plots and the `radixkv` binary live in their own crate, `radixkv-replay`
//! (`scheduler_api/replay/`), so that an engine embedding this crate compiles none of their
//! dependencies.
//!
//! ## Errors
//! Every bad input (impossible configuration, out-of-order lifecycle call, unknown request)
//! and every exhausted resource returns a typed [`ManagerError`]; nothing reachable from the
//! public API panics.
//! The error enums of every radixkv crate are `#[non_exhaustive]` (match them with a wildcard
//! arm). A session refusal keeps its type whichever call reports it: [`ManagerError::Session`]
//! carries the session crate's `SessionError`.

#![warn(missing_docs)]

mod builder;
pub mod config;
pub mod error;
pub mod factory;
pub mod geometry;
mod manager;
pub mod metrics;
mod request;
mod sessions;
pub mod split;
mod storage;
mod table;
mod tiered;

pub use builder::ManagerBuilder;
pub use config::{
    CacheKind, HostLayout, HostTier, MambaPolicyKind, ManagerConfig, ModelGeometry, PoolBudgets,
    PrefetchStopPolicy, Preset, SessionBudget, StorageBackendKind, StorageTier, WritePolicy,
};
pub use error::{BackendMismatch, ManagerError, Result, StallCause};
pub use manager::{
    Admission, Admitted, KvCacheManager, MambaCheckpoints, NeverReason, ReqId, Request, StepHandle,
    StepSummary, TokenSource, TokenSourceError, TokenStorage, WaitReason,
};
pub use metrics::Metrics;
pub use radixkv_radix::{
    CheckpointKind, ComponentAccounting, MambaCheckpoint, MambaCow, MambaTrack, PageHash,
    PageHasher, PageHashes,
};
pub use radixkv_session::CloseOutcome;
pub use sessions::SimClock;
