//! The one place where a cache is built from a [`ManagerConfig`], and the small seam
//! ([`ManagedCache`]) through which tiered and session caches report what the manager cannot
//! see through [`PrefixCache`] alone.
//!
//! Wiring a new cache kind means: implement [`ManagedCache`] for it (every method has a default
//! that is right for a device-only cache without sessions) and construct it in
//! [`build_cache`]. Built here today:
//!
//! | config                              | cache                                          |
//! |-------------------------------------|------------------------------------------------|
//! | `disabled`, `radix`                 | `RadixCache`                                   |
//! | `disabled`, `radix`, Mamba layers   | `RadixCache` with its Mamba state slot pool    |
//! | `disabled`, `radix`, SWA layers     | `RadixCache` with its SWA page pool            |
//! | `disabled`, `radix`, SWA + Mamba    | `RadixCache` with both pools, one tree         |
//! | `radix` + sessions (Mamba or SWA layers too) | `SessionAwareCache<RadixCache, SimClock>` |
//! | `hicache` (SWA and/or Mamba layers too) | [`Tiered`]: `HiRadixCache<HostSim>`        |
//! | `hicache` + the engine's backend B  | `Tiered<B>`: `HiRadixCache<B>`                 |
//! | `hicache` + sessions                | `SessionAwareCache<Tiered<_>, SimClock>`       |
//!
//! **Device backends.** A host tier needs a [`DeviceBackend`] to copy KV between the device
//! pool and the host pool. [`build_cache`] builds the one the config names
//! ([`BackendKind`]): HostSim over the small simulated geometry
//! ([`SimGeometry`](crate::config::SimGeometry)), or with the crate feature `cuda`
//! `radixkv_hicache::cuda::CudaBackend` over a device pool it allocates in the model's
//! geometry (`backend = { type = "cuda", device = N }`). An engine hands its own backend to
//! [`build_cache_with_backend`] (or [`ManagerBuilder::device_backend`](crate::ManagerBuilder::device_backend));
//! it takes the place of the one the config names, and its geometry must be the model's (see
//! [`Tiered::with_backend`]). A backend with a device-only cache is refused
//! ([`BackendMismatch::NoHostTier`]): nothing would ever use it.
//!
//! A model with Mamba layers builds on the device-only caches
//! (slots: the `pools.mamba_bytes` budget over the slot bytes, see [`ManagerConfig::pools`]),
//! with or without sessions, and so does a model with sliding-window layers (SWA pages: the
//! `pools.swa_bytes` budget over a page of SWA KV; the window from the geometry; a session
//! slot keeps its window KV across turns), and so does a model with both kinds of layers (one
//! tree carries both components); Mamba layers also build under a host tier (`HiRadixCache`
//! moves the states with their KV; HostSim's simulated state slots are 64 bytes each, like its
//! token-sized KV pools, while an engine's backend holds the model's), and so do
//! sliding-window layers (`HiRadixCache` moves the window KV with its KV; HostSim's simulated
//! window pages are 64 bytes each, an engine's backend holds the model's), with sessions too (a
//! session slot keeps its window KV across turns; demotion hands it to the tree, which backs
//! it up), and both kinds in one model (one tree, both components moved with their KV in one
//! operation), with sessions too (a session slot keeps its window KV and running state across
//! turns; demotion hands both to the tree). A storage tier (L3) under the host tier
//! (`[cache.storage]`) is built for every model (under Mamba or sliding-window layers its
//! stored pages carry the states and window KV too): the store the section names is opened
//! here, or the engine's own is taken ([`build_cache_with_store`]).

use std::sync::Arc;

use radixkv_hicache::storage::StorageBackend;
use radixkv_hicache::{DeviceBackend, HiCacheStats, HostSim, PrefetchStatus};
use radixkv_radix::{
    CacheError, ComponentAccounting, MambaPolicy, MambaStats, NodeId, PrefixCache, RadixCache,
    RadixConfig, RequestKv, SwaConfig,
};
use radixkv_session::{CloseOutcome, SessionAwareCache, SessionConfig};

use crate::config::{BackendKind, CacheKind, ManagerConfig};
use crate::error::{BackendMismatch, ManagerError, Result};
use crate::sessions::SimClock;
pub use crate::tiered::Tiered;

/// Host↔device traffic of one step, as reported by a tiered cache. Bytes are *modeled* bytes
/// (`pages × ModelGeometry::page_bytes()`), never the simulated backend's.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StepTransfers {
    /// Pages loaded host → device.
    pub pages_loaded: u64,
    /// Modeled bytes loaded host → device.
    pub bytes_loaded: u64,
    /// Pages written device → host.
    pub pages_written: u64,
    /// Modeled bytes written device → host.
    pub bytes_written: u64,
}

impl StepTransfers {
    /// Adds another step's traffic. Saturates rather than wraps: `validate` bounds one step's
    /// bytes by a pool's, but a long enough run could still sum past `u64::MAX`.
    pub fn add(&mut self, o: &StepTransfers) {
        self.pages_loaded = self.pages_loaded.saturating_add(o.pages_loaded);
        self.bytes_loaded = self.bytes_loaded.saturating_add(o.bytes_loaded);
        self.pages_written = self.pages_written.saturating_add(o.pages_written);
        self.bytes_written = self.bytes_written.saturating_add(o.bytes_written);
    }
}

/// Waits for one started, layer-pipelined load (the real per-layer completion events).
pub trait LayerWait: Send + Sync + std::fmt::Debug {
    /// Blocks until the load of modeled layer `layer` is on the device.
    ///
    /// # Errors
    /// [`ManagerError::Tier`] when that layer's copy failed: the batch must not read it (the
    /// next step boundary repairs or demotes the KV).
    fn wait_layer(&self, layer: u32) -> Result<()>;
    /// True when modeled layer `layer`'s load is complete (or there is none).
    fn is_layer_done(&self, layer: u32) -> bool;
}

/// What a step's forward must wait for, as [`ManagedCache::on_begin_step`] reports it.
#[derive(Clone, Debug, Default)]
pub struct StepLoads {
    /// Pages whose load started.
    pub pages: u64,
    /// Modeled bytes of those pages.
    pub bytes: u64,
    /// The per-layer wait of the started load (`None` when nothing was loaded).
    pub wait: Option<Arc<dyn LayerWait>>,
}

/// A [`PrefixCache`] as the manager drives it: the trait plus step hooks, session lifecycle
/// and tier reports.
///
/// The defaults describe a device-only cache without sessions (no loads, no transfers, no
/// sessions); tiered and session caches override what applies to them.
pub trait ManagedCache: PrefixCache + Send {
    /// Called once the step's batch is formed, before its forward: starts queued loads and
    /// says what the forward waits for, layer by layer.
    ///
    /// # Errors
    /// The backend refused the copy.
    fn on_begin_step(&mut self) -> Result<StepLoads> {
        Ok(StepLoads::default())
    }
    /// False only for a cache whose [`ManagedCache::on_begin_step`] never starts a load nor
    /// fails (a device-only cache): the manager then never calls it, and its steps share no
    /// load set with their handles (no allocation, no atomic counts). True by default, so that a
    /// cache overriding `on_begin_step` is asked.
    fn starts_loads(&self) -> bool {
        true
    }
    /// Called at the end of a step: applies completion acks (releasing the locks that
    /// protected transferring nodes) and returns the step's traffic.
    ///
    /// # Errors
    /// A failed copy that could not be repaired.
    fn on_end_step(&mut self) -> Result<StepTransfers> {
        Ok(StepTransfers::default())
    }
    /// Before an admission that needs `tokens` device tokens (under a temporary lock of its
    /// matched prefix): starts freeing them without waiting. `false` when they arrive only at
    /// the acks of copies in flight (a host tier's write-back eviction): the admission waits
    /// ([`WaitReason::RoomInFlight`](crate::WaitReason::RoomInFlight)) and the room is there
    /// after a later step. The default (eviction is immediate) does nothing.
    fn prepare_room(&mut self, _tokens: usize) -> bool {
        true
    }
    /// Device tokens evicted so far when copies' acks were applied (a host tier's write-back
    /// victims, demoted at their acks), cumulative. 0 by default: eviction is immediate.
    fn evicted_at_acks(&self) -> u64 {
        0
    }
    /// Starts everything queued, waits for every transfer and applies its ack (end of a
    /// replay, shutdown). Returns the traffic not reported by a step yet.
    ///
    /// # Errors
    /// A failed copy.
    fn drain(&mut self) -> Result<StepTransfers> {
        Ok(StepTransfers::default())
    }
    /// Blocks until every transfer started so far has completed, applying nothing (see
    /// [`KvCacheManager::wait_transfers`](crate::KvCacheManager::wait_transfers)). The default
    /// has no transfers.
    fn wait_transfers(&self) {}
    /// Opens a session (`ttl_ms`: idle TTL overriding the configured one).
    ///
    /// # Errors
    /// [`ManagerError::SessionsOff`] for a cache without sessions; session-layer errors.
    fn open_session(&mut self, id: u64, _streaming: bool, _ttl_ms: Option<u64>) -> Result<()> {
        Err(ManagerError::SessionsOff { session: id })
    }
    /// True when session `id` is open.
    fn has_session(&self, _id: u64) -> bool {
        false
    }
    /// True when `req` may run as the next turn of its streaming session (or has none). A
    /// turn that may not (another turn of the session is in flight, or it does not extend the
    /// session's history) must run as an ordinary request instead.
    fn session_turn_ok(&self, _req: &RequestKv) -> bool {
        true
    }
    /// Closes a session, releasing what it holds (deferred to the end of a turn in flight).
    ///
    /// # Errors
    /// [`ManagerError::SessionsOff`] for a cache without sessions; session-layer errors.
    fn close_session(&mut self, id: u64) -> Result<CloseOutcome> {
        Err(ManagerError::SessionsOff { session: id })
    }
    /// Demotes idle session `id` now (its KV goes to the tree, its slot, row and lock are
    /// released; the session stays open). Returns false when it held nothing idle.
    ///
    /// # Errors
    /// Session-layer errors.
    fn demote_session(&mut self, _id: u64) -> Result<bool> {
        Ok(false)
    }
    /// Applies the session TTL and budget (demotes expired and over-budget idle sessions).
    ///
    /// # Errors
    /// Session-layer errors.
    fn reap_sessions(&mut self) -> Result<()> {
        Ok(())
    }
    /// Open sessions.
    fn open_sessions(&self) -> usize {
        0
    }
    /// Sessions currently holding KV (idle slots).
    fn held_sessions(&self) -> usize {
        0
    }
    /// Tokens resident on the host tier.
    fn host_tokens(&self) -> usize {
        0
    }
    /// True when allocating token slots inside pages a request's row already has needs no
    /// work from the cache (only `allocated_len` moves), so the manager may skip the
    /// `alloc_tokens` call for them — most decode tokens. A cache with per-token state (a
    /// sliding-window pool that frees as it slides) must return false.
    fn page_granular(&self) -> bool {
        true
    }
    /// Where every Mamba state slot is; `None` for a cache without the Mamba component.
    fn mamba_accounting(&self) -> Option<ComponentAccounting> {
        None
    }
    /// Evicts up to `n` unlocked cached Mamba states (their KV stays); returns how many went.
    /// 0 for a cache without the Mamba component.
    fn evict_mamba_states(&mut self, _n: usize) -> usize {
        0
    }
    /// The Mamba state counters per checkpoint kind; `None` without the Mamba component.
    fn mamba_stats(&self) -> Option<MambaStats> {
        None
    }
    /// Where every page of the sliding-window (SWA) KV pool is; `None` for a cache without
    /// the SWA component.
    fn swa_accounting(&self) -> Option<ComponentAccounting> {
        None
    }
    /// The sliding window in tokens; `None` for a cache without the SWA component.
    fn swa_window(&self) -> Option<usize> {
        None
    }
    /// SWA pages free or evictable while the window KV before `node`'s end is locked, as the
    /// admission of a request matched there locks it (locks hold whole nodes, so this can be
    /// more than the window); `None` for a cache without the SWA component. Nothing changes.
    ///
    /// # Errors
    /// Releasing the temporary lock failed (a bug).
    fn swa_available_locked(&mut self, _node: Option<NodeId>) -> Result<Option<usize>> {
        Ok(None)
    }
    /// SWA pages idle sessions own (request-owned in [`ManagedCache::swa_accounting`], but
    /// no running request's: an allocation short of window pages demotes those sessions, so
    /// admission may count on them). 0 for a cache without sessions or the SWA component.
    fn session_held_window_pages(&self) -> usize {
        0
    }
    /// Starts a storage-tier prefetch for request `rid` (unique among the live requests) of
    /// `req`'s key: the whole pages past the device and host match are looked up in the store
    /// in the background (see `HiRadixCache::prefetch`). Returns whether one started (never
    /// without a storage tier).
    fn storage_prefetch(&mut self, _rid: u64, _req: &RequestKv) -> bool {
        false
    }
    /// Checks `rid`'s prefetch and ends it when its stop policy allows: what arrived enters
    /// the tree as host-only KV (see `HiRadixCache::check_prefetch`).
    ///
    /// # Errors
    /// Host-pool errors (a bug).
    fn check_prefetch(&mut self, _rid: u64) -> Result<PrefetchStatus> {
        Ok(PrefetchStatus::None)
    }
    /// Ends `rid`'s prefetch and drops what it loaded (the request is gone). Returns whether
    /// it had one.
    ///
    /// # Errors
    /// Host-pool errors (a bug).
    fn abort_prefetch(&mut self, _rid: u64) -> Result<bool> {
        Ok(false)
    }
    /// The host and storage tiers' counters; `None` for a cache without a host tier.
    fn tier_stats(&self) -> Option<HiCacheStats> {
        None
    }
    /// Store operations that failed (the store's own count); 0 without a storage tier.
    fn store_errors(&self) -> u64 {
        0
    }
    /// True when the cache has a storage tier.
    fn has_storage(&self) -> bool {
        false
    }
    /// Waits until every storage job in flight has completed and applies them (end of a
    /// replay, shutdown, tests; never on a serving scheduler's step path).
    ///
    /// # Errors
    /// As [`ManagedCache::on_end_step`].
    fn wait_storage(&mut self) -> Result<()> {
        Ok(())
    }
}

impl ManagedCache for RadixCache {
    fn starts_loads(&self) -> bool {
        false
    }

    fn mamba_accounting(&self) -> Option<ComponentAccounting> {
        RadixCache::mamba_accounting(self)
    }

    fn evict_mamba_states(&mut self, n: usize) -> usize {
        self.parts_mut().0.evict_mamba(n)
    }

    fn mamba_stats(&self) -> Option<MambaStats> {
        RadixCache::mamba_stats(self)
    }

    fn swa_accounting(&self) -> Option<ComponentAccounting> {
        RadixCache::swa_accounting(self)
    }

    fn swa_window(&self) -> Option<usize> {
        RadixCache::swa_window(self)
    }

    fn swa_available_locked(&mut self, node: Option<NodeId>) -> Result<Option<usize>> {
        let tree = self.parts_mut().0;
        // A window that is a tombstone (a stale match) locks nothing: the admission matches
        // again then.
        let receipt = match node {
            Some(n) if n != tree.root() => tree.inc_lock_ref_swa(n).ok(),
            _ => None,
        };
        let a = RadixCache::swa_accounting(self);
        if let Some(r) = receipt {
            self.parts_mut().0.dec_lock_ref(r)?;
        }
        Ok(a.map(|a| a.free + a.evictable))
    }
}

/// Builds the cache a configuration describes, with a fresh session clock at 0.
///
/// # Errors
/// As [`build_cache_with_clock`].
pub fn build_cache(cfg: &ManagerConfig) -> Result<Box<dyn ManagedCache>> {
    build_cache_with_clock(cfg, SimClock::default())
}

/// Builds the cache a configuration describes; sessions read their idle TTLs from `clock`
/// (milliseconds). A host tier runs over the built-in backend `cfg.backend` names.
///
/// # Errors
/// [`ManagerError::Config`] for an impossible configuration, including a device pool whose
/// tables this machine cannot allocate; [`ManagerError::Backend`] for `backend = cuda` without
/// a host tier, [`ManagerError::FeatureOff`] for it in a build without the `cuda` feature; [`ManagerError::Tier`] when the backend (HostSim, or CUDA: `NoDevice` without a
/// driver or device) or the host pool cannot be allocated.
pub fn build_cache_with_clock(
    cfg: &ManagerConfig,
    clock: SimClock,
) -> Result<Box<dyn ManagedCache>> {
    build::<HostSim>(cfg, clock, None, None)
}

/// Builds the cache a configuration describes over the engine's own device `backend`, which
/// takes the place of the built-in one `cfg.backend` names (so `cuda` is accepted here). The
/// cache must have a host tier, and the backend's device pool must hold the model's KV in the
/// configured pool: the layers, bytes per token per layer and page size of `cfg.model`, and
/// `cfg.device_pages()` pages. The caller keeps its own `Arc` to read and write the pages its
/// forward pass uses.
///
/// # Errors
/// [`ManagerError::Backend`] for a cache without a host tier or a backend whose geometry or
/// device pool differs; otherwise as [`build_cache_with_clock`] (the host pool is allocated in
/// the backend's geometry).
pub fn build_cache_with_backend<B: DeviceBackend>(
    cfg: &ManagerConfig,
    clock: SimClock,
    backend: Arc<B>,
) -> Result<Box<dyn ManagedCache>> {
    build(cfg, clock, Some(backend), None)
}

/// Builds the cache a configuration describes, its host tier over the engine's `backend` when
/// given (else the built-in one), its storage tier over the engine's `store` when given (the
/// configuration's `[cache.storage]` must then say `backend = { type = "engine" }`).
///
/// # Errors
/// As [`build_cache_with_backend`]; [`ManagerError::Config`] for a store without a storage
/// section of `type = "engine"` or the reverse; [`ManagerError::Storage`] when the store the
/// configuration names cannot be opened or reached.
pub fn build_cache_with_store<B: DeviceBackend>(
    cfg: &ManagerConfig,
    clock: SimClock,
    backend: Option<Arc<B>>,
    store: Option<Arc<dyn StorageBackend>>,
) -> Result<Box<dyn ManagedCache>> {
    build(cfg, clock, backend, store)
}

/// A device backend handed to [`ManagerBuilder::device_backend`](crate::ManagerBuilder::device_backend),
/// its type erased so that the builder stays one type.
#[derive(Clone)]
pub(crate) struct GivenBackend {
    name: &'static str,
    build: Arc<BuildOver>,
}

/// [`build_cache_with_backend`] over one backend.
type BuildOver = dyn Fn(&ManagerConfig, SimClock, Option<Arc<dyn StorageBackend>>) -> Result<Box<dyn ManagedCache>>
    + Send
    + Sync;

impl GivenBackend {
    pub(crate) fn new<B: DeviceBackend>(backend: Arc<B>) -> Self {
        GivenBackend {
            name: backend.name(),
            build: Arc::new(move |cfg, clock, store| {
                build(cfg, clock, Some(backend.clone()), store)
            }),
        }
    }

    /// [`build_cache_with_backend`] over this backend.
    pub(crate) fn build_cache(
        &self,
        cfg: &ManagerConfig,
        clock: SimClock,
        store: Option<Arc<dyn StorageBackend>>,
    ) -> Result<Box<dyn ManagedCache>> {
        (self.build)(cfg, clock, store)
    }
}

impl std::fmt::Debug for GivenBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("GivenBackend").field(&self.name).finish()
    }
}

/// Builds the cache of `cfg`, its host tier over `backend` when one is given, else over the
/// built-in backend the config names.
fn build<B: DeviceBackend>(
    cfg: &ManagerConfig,
    clock: SimClock,
    backend: Option<Arc<B>>,
    store: Option<Arc<dyn StorageBackend>>,
) -> Result<Box<dyn ManagedCache>> {
    cfg.validate()?;
    if store.is_some() && !matches!(&cfg.cache, CacheKind::HiCache(h) if h.storage.is_some()) {
        return Err(ManagerError::Config(
            "a store was handed to ManagerBuilder::storage_backend but the configuration has \
             no [cache.storage] section (a storage tier lives under a host tier)"
                .into(),
        ));
    }
    match (&backend, &cfg.cache) {
        (Some(b), CacheKind::Disabled | CacheKind::Radix) => {
            return Err(ManagerError::Backend {
                backend: b.name(),
                mismatch: BackendMismatch::NoHostTier,
            });
        }
        (None, CacheKind::Disabled | CacheKind::Radix)
            if matches!(cfg.backend, BackendKind::Cuda { .. }) =>
        {
            return Err(ManagerError::Backend {
                backend: "cuda",
                mismatch: BackendMismatch::NoHostTier,
            });
        }
        (None, CacheKind::HiCache(_)) => {
            if let BackendKind::Cuda {
                device,
                copy_method,
            } = cfg.backend
            {
                return built_in_cuda(cfg, clock, device, copy_method, store);
            }
        }
        _ => {}
    }
    let pools = cfg.pools()?;
    let mamba_slots = match pools.mamba {
        None => None,
        Some(p) => Some(u32::try_from(p.slots).map_err(|_| {
            ManagerError::Config(format!(
                "the Mamba pool of {} slots is more than a pool can address",
                p.slots
            ))
        })?),
    };
    let radix = RadixConfig {
        page_size: cfg.model.page_size,
        total_pages: cfg.device_pages(),
        max_rows: cfg.max_rows,
        policy: cfg.eviction.0,
        events: cfg.events,
        event_capacity: cfg.event_capacity,
        // Set by the tiered cache from the storage tier's identity (`Tiered::over`).
        event_page_keys: None,
        disabled: matches!(cfg.cache, CacheKind::Disabled),
        // The disabled cache keeps no state, so it plans no checkpoints (the baseline policy).
        mamba_slots,
        mamba_policy: match cfg.radix_mamba_policy()? {
            Some(_) if matches!(cfg.cache, CacheKind::Disabled) => MambaPolicy::Sglang,
            Some(p) => p,
            None => MambaPolicy::default(),
        },
        // Each request gets a tracking slot where one can be spared; the manager hands it to
        // the engine (`Admitted::mamba_track`, `KvCacheManager::mamba_track`), which keeps the
        // state at the last page boundary in it (a session slot keeps it across turns). The
        // disabled cache stores no state.
        mamba_track: !matches!(cfg.cache, CacheKind::Disabled),
        swa: match (pools.swa, pools.sliding_window) {
            (Some(p), Some(w)) => Some(SwaConfig {
                window: usize::try_from(w).map_err(|_| {
                    ManagerError::Config(format!("the sliding window of {w} tokens is too long"))
                })?,
                pages: usize::try_from(p.pages).map_err(|_| {
                    ManagerError::Config(format!(
                        "the SWA pool of {} pages is more than a pool can address",
                        p.pages
                    ))
                })?,
            }),
            _ => None,
        },
    };
    let sessions = cfg.sessions.as_ref().map(|b| SessionConfig {
        max_held_tokens: b.max_held_tokens,
        max_session_tokens: b.per_session_cap_tokens,
        idle_ttl: Some(b.idle_ttl_ms),
        // Held states are bounded by the pool: a request short of a slot demotes idle sessions,
        // and so are held window pages unless capped (an allocation short of window pages
        // demotes idle sessions owning some).
        max_held_state_slots: usize::MAX,
        max_held_window_pages: b
            .max_held_window_pages
            .map_or(usize::MAX, |w| usize::try_from(w).unwrap_or(usize::MAX)),
    });
    Ok(match (&cfg.cache, backend) {
        // The radix pools' only failure is an impossible size: say so as a config error.
        (CacheKind::Disabled | CacheKind::Radix, _) => {
            let device = RadixCache::new(radix).map_err(|e| match e {
                CacheError::Config(m) => ManagerError::Config(m),
                e => e.into(),
            })?;
            with_sessions(device, sessions, clock)
        }
        (CacheKind::HiCache(h), None) => with_sessions(
            Tiered::new_with_store(cfg, h, radix, store)?,
            sessions,
            clock,
        ),
        (CacheKind::HiCache(h), Some(b)) => with_sessions(
            Tiered::with_backend_and_store(cfg, h, radix, b, store)?,
            sessions,
            clock,
        ),
    })
}

/// The host tier over a [`radixkv_hicache::cuda::CudaBackend`] on device `device` that
/// allocates the device pool in the model's geometry (`cfg.model`: its layers, KV bytes per
/// token per layer and page size; `cfg.device_pages()` pages), with the Mamba and
/// sliding-window pools the cache registers. The engine reaches the pool through
/// [`crate::KvCacheManager`]'s cache (`Tiered::hicache().backend()`), or builds the backend
/// over its own memory and hands it to the builder instead.
#[cfg(feature = "cuda")]
fn built_in_cuda(
    cfg: &ManagerConfig,
    clock: SimClock,
    device: u32,
    copy_method: crate::config::CudaCopyMethod,
    store: Option<Arc<dyn StorageBackend>>,
) -> Result<Box<dyn ManagedCache>> {
    use crate::config::CudaCopyMethod as M;
    use radixkv_hicache::KvGeometry;
    use radixkv_hicache::cuda::{CopyMethod, CudaBackend, CudaConfig};
    let m = &cfg.model;
    let bytes = usize::try_from(m.kv_bytes_per_token_per_layer).map_err(|_| {
        ManagerError::Config(
            "the model's KV bytes per token per layer do not fit this machine".into(),
        )
    })?;
    let geometry = KvGeometry::new(m.layers as usize, m.page_size, bytes)?;
    let backend = CudaBackend::new(
        geometry,
        cfg.device_pages(),
        CudaConfig {
            ordinal: device as usize,
            copy_method: match copy_method {
                M::Auto => CopyMethod::Auto,
                M::Memcpy => CopyMethod::Memcpy,
                M::Batched => CopyMethod::Batched,
                M::Kernel => CopyMethod::Kernel,
            },
            ..CudaConfig::default()
        },
    )?;
    build(cfg, clock, Some(Arc::new(backend)), store)
}

/// Without the `cuda` feature the built-in CUDA backend is not compiled in:
/// [`ManagerError::FeatureOff`] says so, never a silent fallback to HostSim.
#[cfg(not(feature = "cuda"))]
fn built_in_cuda(
    _cfg: &ManagerConfig,
    _clock: SimClock,
    _device: u32,
    _copy_method: crate::config::CudaCopyMethod,
    _store: Option<Arc<dyn StorageBackend>>,
) -> Result<Box<dyn ManagedCache>> {
    Err(ManagerError::FeatureOff {
        what: "the built-in CUDA backend (`backend = { type = \"cuda\" }`; an engine may \
               instead hand its own DeviceBackend to ManagerBuilder::device_backend)",
        feature: "cuda",
    })
}

/// `cache`, wrapped in a session layer reading `clock` when `sessions` is on.
fn with_sessions<C: ManagedCache + 'static>(
    cache: C,
    sessions: Option<SessionConfig>,
    clock: SimClock,
) -> Box<dyn ManagedCache> {
    match sessions {
        None => Box::new(cache),
        Some(s) => Box::new(SessionAwareCache::with_clock(cache, s, clock)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HostTier, Preset, SessionBudget, WritePolicy};

    fn base() -> ManagerConfig {
        ManagerConfig {
            device_tokens: 4096,
            ..Default::default()
        }
    }

    #[test]
    fn builds_every_wired_kind() {
        let c = build_cache(&base()).unwrap();
        assert_eq!(c.accounting().total, 4096);
        assert_eq!(c.open_sessions(), 0);
        for w in [
            WritePolicy::WriteThrough,
            WritePolicy::WriteThroughSelective { hits: 2 },
            WritePolicy::WriteBack,
        ] {
            let hi = ManagerConfig {
                cache: CacheKind::HiCache(HostTier::ratio(4096, 2.0).write_policy(w)),
                ..base()
            };
            let mut c = build_cache(&hi).unwrap();
            assert_eq!(c.accounting().total, 4096);
            assert_eq!(c.host_tokens(), 0);
            let loads = c.on_begin_step().unwrap();
            assert_eq!(loads.pages, 0);
            assert!(loads.wait.is_none());
            assert_eq!(c.on_end_step().unwrap(), StepTransfers::default());
            assert_eq!(
                c.open_session(1, true, None),
                Err(ManagerError::SessionsOff { session: 1 }),
                "no sessions here"
            );
            assert_eq!(
                c.close_session(1),
                Err(ManagerError::SessionsOff { session: 1 })
            );
        }
        let budget = SessionBudget {
            max_held_tokens: 1024,
            ..Default::default()
        };
        for cache in [
            CacheKind::Radix,
            CacheKind::HiCache(HostTier::ratio(4096, 2.0)),
        ] {
            let s = ManagerConfig {
                cache,
                sessions: Some(budget.clone()),
                ..base()
            };
            let mut c = build_cache(&s).unwrap();
            c.open_session(9, true, None).unwrap();
            assert!(c.has_session(9));
            assert_eq!(c.open_sessions(), 1);
            assert!(matches!(
                c.open_session(9, true, None),
                Err(ManagerError::Session(_))
            ));
            c.close_session(9).unwrap();
            assert!(!c.has_session(9));
            assert!(c.close_session(9).is_err());
        }
    }

    #[test]
    fn cuda_needs_its_feature_or_a_device_and_hybrid_models_build_on_every_cache() {
        let cuda = ManagerConfig {
            backend: BackendKind::Cuda {
                device: 0,
                copy_method: Default::default(),
            },
            cache: CacheKind::HiCache(HostTier::ratio(4096, 2.0)),
            ..base()
        };
        match build_cache(&cuda) {
            // Without the feature: an error naming it, never HostSim instead.
            Err(ManagerError::FeatureOff { feature, .. }) if !cfg!(feature = "cuda") => {
                assert_eq!(feature, "cuda");
            }
            // With it, on a machine without a driver or device: the backend's typed error.
            Err(ManagerError::Tier(radixkv_hicache::HiCacheError::NoDevice(_)))
                if cfg!(feature = "cuda") => {}
            // With a device, the tier runs over it.
            Ok(c) if cfg!(feature = "cuda") => assert_eq!(c.accounting().total, 4096),
            Ok(_) => panic!("a cuda backend was built without the cuda feature"),
            Err(e) => panic!("unexpected: {e:?}"),
        }
        // A cache without a host tier has nothing for a device backend to copy.
        let radix = ManagerConfig {
            backend: BackendKind::Cuda {
                device: 0,
                copy_method: Default::default(),
            },
            cache: CacheKind::Radix,
            ..base()
        };
        assert!(matches!(
            build_cache(&radix),
            Err(ManagerError::Backend {
                backend: "cuda",
                mismatch: BackendMismatch::NoHostTier
            })
        ));
        // A sliding-window model builds on every cache kind, with sessions too, its SWA pool
        // sized from its budget. A Mamba model builds on every cache kind, with sessions too.
        let kinds = [
            (CacheKind::Radix, "radixkv-radix"),
            (CacheKind::Disabled, "radixkv-radix"),
            (
                CacheKind::HiCache(HostTier::ratio(4096, 2.0)),
                "radixkv-hicache",
            ),
        ];
        for (cache, _) in kinds.clone() {
            let hicache = matches!(cache, CacheKind::HiCache(_));
            let mut swa = ManagerConfig { cache, ..base() };
            swa.model = Preset::GemmaLike.geometry();
            let pools = swa.pools().unwrap();
            let c = build_cache(&swa).unwrap_or_else(|e| panic!("{hicache}: {e:?}"));
            let a = c.swa_accounting().expect("the SWA component");
            assert_eq!(a.total as u64, pools.swa.unwrap().pages);
            assert_eq!(c.swa_window(), Some(1024));
            swa.sessions = Some(SessionBudget {
                max_held_tokens: swa.device_tokens / 4,
                ..Default::default()
            });
            let mut c = build_cache(&swa).unwrap_or_else(|e| panic!("{hicache}: {e:?}"));
            assert!(c.swa_accounting().is_some(), "the SWA component");
            c.open_session(1, true, None)
                .expect("sessions open over sliding-window layers");
            // Both kinds of layers: one tree carries both, on every cache kind (the host tier
            // moves both with their KV).
            let mut both = ManagerConfig {
                cache: swa.cache.clone(),
                ..base()
            };
            both.model = Preset::JambaLike.geometry();
            both.model.layer_pattern =
                Some(crate::geometry::LayerPattern::parse("SMSASMSM").unwrap());
            both.model.layers = 8;
            both.model.sliding_window = Some(64);
            let c = build_cache(&both).unwrap_or_else(|e| panic!("{hicache}: {e:?}"));
            assert!(c.swa_accounting().is_some() && c.mamba_accounting().is_some());
            // With sessions too, on every cache kind (a session slot keeps its window KV and
            // running state; under a host tier demotion hands both to the tree).
            both.sessions = swa.sessions.clone();
            let mut c = build_cache(&both).unwrap_or_else(|e| panic!("{hicache}: {e:?}"));
            assert!(c.swa_accounting().is_some() && c.mamba_accounting().is_some());
            c.open_session(1, true, None)
                .expect("sessions open over sliding-window and Mamba layers");
        }
        for (cache, _) in kinds {
            let hicache = matches!(cache, CacheKind::HiCache(_));
            let mut mamba = ManagerConfig { cache, ..base() };
            mamba.model = Preset::JambaLike.geometry();
            // Every cache kind carries the Mamba component, the host tier included.
            let c = build_cache(&mamba).unwrap_or_else(|e| panic!("{hicache}: {e:?}"));
            let a = c.mamba_accounting().expect("the Mamba component");
            assert_eq!(a.total as u64, mamba.pools().unwrap().mamba.unwrap().slots);
            mamba.sessions = Some(SessionBudget {
                max_held_tokens: mamba.device_tokens / 4,
                ..Default::default()
            });
            let mut c = build_cache(&mamba).unwrap_or_else(|e| panic!("{hicache}: {e:?}"));
            assert!(c.mamba_accounting().is_some(), "the Mamba component");
            c.open_session(1, true, None)
                .expect("sessions open over Mamba");
        }
    }
}
