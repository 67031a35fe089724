//! [`Tiered`]: the HiCache kind as the manager drives it — a `HiRadixCache` over a
//! [`DeviceBackend`], plus the conversion of its traffic into *modeled* bytes.
//!
//! Two ways to get the backend:
//! - [`Tiered::new`] builds the default, HostSim. HostSim really allocates and copies its
//!   pools, so they use the tiny [`SimGeometry`](crate::config::SimGeometry), not the model's:
//!   everything reported (step load bytes, transfer bytes) is pages × the model's page bytes,
//!   and layer `i` of the modeled forward waits for simulated layer
//!   `i × sim layers / model layers`. Pages, not bytes, are what the two geometries share.
//! - [`Tiered::with_backend`] takes the engine's own backend. Its pools are the real ones, so
//!   its geometry must *be* the model's (layers, bytes per token per layer, page size) and its
//!   device pool the configured one; a backend that differs is refused with
//!   [`ManagerError::Backend`](crate::ManagerError::Backend) before anything is built. Modeled
//!   and real bytes then agree, and layer `i` waits for the backend's layer `i`.

use std::sync::Arc;

use radixkv_hicache::storage::StorageBackend;
use radixkv_hicache::{
    CopyEvent, DeviceBackend, HiCacheConfig, HiCacheStats, HiRadixCache, HostSim, HostSimConfig,
    HostSize, KvGeometry, LayerDoneCounter, PrefetchStatus,
};
use radixkv_radix::{
    DevicePools, FinishKind, InsertOptions, InsertResult, InvariantViolation, KeyRef, KvEvent,
    LockReceipt, NodeId, PageId, PoolAccounting, PrefixCache, RadixConfig, RequestKv, RequestMatch,
    TreeMatch,
};

use crate::config::{HostTier, ManagerConfig};
use crate::error::{BackendMismatch, ManagerError, Result};
use crate::factory::{LayerWait, ManagedCache, StepLoads, StepTransfers};

/// HiCache (device + host tiers) over the device backend `B` (HostSim unless the engine hands
/// the manager its own). See the module docs.
pub struct Tiered<B: DeviceBackend = HostSim> {
    cache: HiRadixCache<B>,
    page_size: u64,
    modeled_page_bytes: u64,
    model_layers: u32,
    /// Layers of the backend's pools (the simulated ones for HostSim, the model's otherwise).
    backend_layers: u32,
    /// Tier counters already reported by a step: tokens loaded, tokens backed up.
    seen: (u64, u64),
    /// What the storage tier's store needs alive (the Redis client's runtime): declared
    /// after `cache`, so dropped after it.
    _keepalive: crate::storage::Keepalive,
}

impl<B: DeviceBackend> std::fmt::Debug for Tiered<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tiered")
            .field("backend", &self.cache.backend().name())
            .field("cache", &self.cache)
            .field("modeled_page_bytes", &self.modeled_page_bytes)
            .finish()
    }
}

impl Tiered<HostSim> {
    /// A HiCache for `cfg` with host tier `host` and device tier `radix`, over a HostSim of
    /// `cfg.sim_geometry`.
    ///
    /// # Errors
    /// [`ManagerError::Tier`] when the simulated pools cannot be built.
    pub fn new(cfg: &ManagerConfig, host: &HostTier, radix: RadixConfig) -> Result<Self> {
        Self::new_with_store(cfg, host, radix, None)
    }

    /// [`Tiered::new`] with the engine's store for a storage tier of `type = "engine"`.
    pub(crate) fn new_with_store(
        cfg: &ManagerConfig,
        host: &HostTier,
        radix: RadixConfig,
        store: Option<Arc<dyn StorageBackend>>,
    ) -> Result<Self> {
        let sim = &cfg.sim_geometry;
        let geometry = KvGeometry::new(
            sim.layers as usize,
            radix.page_size,
            sim.bytes_per_token_per_layer as usize,
        )?;
        let device = Arc::new(HostSim::new(
            geometry,
            radix.total_pages,
            HostSimConfig::default(),
        )?);
        Self::over(
            cfg,
            host,
            radix,
            device,
            sim.layers,
            SIM_MAMBA_STATE_BYTES,
            SIM_SWA_PAGE_BYTES,
            store,
        )
    }
}

/// Bytes of one Mamba state slot in HostSim's simulated buffers: like its KV pools, a token
/// size, not the model's (an 8 MiB Jamba state per slot would make the simulation allocate
/// gigabytes). The slot counts are the model's.
pub(crate) const SIM_MAMBA_STATE_BYTES: usize = 64;

/// Bytes of one sliding-window KV page in HostSim's simulated buffers: a token size like the
/// Mamba slots (see [`SIM_MAMBA_STATE_BYTES`]), not the model's page bytes. The page counts
/// are the model's.
pub(crate) const SIM_SWA_PAGE_BYTES: usize = 64;

impl<B: DeviceBackend> Tiered<B> {
    /// A HiCache for `cfg` with host tier `host` and device tier `radix`, over the engine's
    /// own `backend`, whose device pool must match the model and the configured pool.
    ///
    /// # Errors
    /// [`ManagerError::Backend`] when the backend's geometry (layers, bytes per token per
    /// layer, page size) differs from `cfg.model` or its device pool from `radix`'s;
    /// [`ManagerError::Tier`] when the host pool cannot be built.
    pub fn with_backend(
        cfg: &ManagerConfig,
        host: &HostTier,
        radix: RadixConfig,
        backend: Arc<B>,
    ) -> Result<Self> {
        Self::with_backend_and_store(cfg, host, radix, backend, None)
    }

    /// [`Tiered::with_backend`] with the engine's store for a storage tier of `type =
    /// "engine"`.
    pub(crate) fn with_backend_and_store(
        cfg: &ManagerConfig,
        host: &HostTier,
        radix: RadixConfig,
        backend: Arc<B>,
        store: Option<Arc<dyn StorageBackend>>,
    ) -> Result<Self> {
        check_geometry(cfg, &radix, backend.as_ref())?;
        let state_bytes = match cfg.pools()?.mamba {
            Some(p) => usize::try_from(p.slot_bytes).map_err(|_| {
                ManagerError::Config(format!(
                    "a Mamba state of {} bytes is more than this machine can address",
                    p.slot_bytes
                ))
            })?,
            None => 0,
        };
        let swa_page_bytes = match cfg.pools()?.swa {
            Some(p) => usize::try_from(p.page_bytes).map_err(|_| {
                ManagerError::Config(format!(
                    "an SWA page of {} bytes is more than this machine can address",
                    p.page_bytes
                ))
            })?,
            None => 0,
        };
        Self::over(
            cfg,
            host,
            radix,
            backend,
            cfg.model.layers,
            state_bytes,
            swa_page_bytes,
            store,
        )
    }

    /// The cache over `device`, whose pools have `backend_layers` layers and, with Mamba
    /// slots, Mamba state slots of `state_bytes`, with sliding-window layers, window KV pages
    /// of `swa_page_bytes` (host copies of both: the host tier's share of the device slots
    /// and pages, as for the KV); with a storage tier under the host tier when `host` names
    /// one (over the engine's `store` for `type = "engine"`).
    #[allow(clippy::too_many_arguments)]
    fn over(
        cfg: &ManagerConfig,
        host: &HostTier,
        mut radix: RadixConfig,
        device: Arc<B>,
        backend_layers: u32,
        state_bytes: usize,
        swa_page_bytes: usize,
        store: Option<Arc<dyn StorageBackend>>,
    ) -> Result<Self> {
        let page_size = radix.page_size;
        // A hybrid model's stored pages carry its Mamba states and window KV.
        let mut sections = Vec::new();
        if radix.mamba_slots.is_some() {
            sections.push((radixkv_hicache::PoolName::Mamba, state_bytes));
        }
        if radix.swa.is_some() {
            sections.push((radixkv_hicache::PoolName::Swa, swa_page_bytes));
        }
        let (storage, keepalive) = match &host.storage {
            Some(s) => {
                let g = device.geometry();
                if cfg.event_page_keys {
                    // The events' keys are the store's: the same identity seeds both chains.
                    radix.event_page_keys = Some(crate::storage::identity(
                        &s.model_id,
                        &cfg.model,
                        &g,
                        &sections,
                    ));
                }
                let (c, k) = crate::storage::open(s, &cfg.model, &g, &sections, store)?;
                (Some(c), k)
            }
            None if store.is_some() => {
                return Err(ManagerError::Config(
                    "a store was handed to ManagerBuilder::storage_backend but the \
                     configuration has no [cache.storage] section"
                        .into(),
                ));
            }
            None => (None, None),
        };
        let mamba_state_bytes = radix.mamba_slots.map(|_| state_bytes);
        let swa_page_bytes = radix.swa.map(|_| swa_page_bytes);
        let hc = HiCacheConfig {
            radix,
            host_size: HostSize::Pages(host.host_tokens / page_size),
            host_layout: host.host_layout,
            write_policy: host.write_policy,
            host_policy: host.eviction.map(|e| e.0),
            load_back_min_tokens: host.load_back_min_tokens,
            load_back_quota_tokens: host.load_back_quota_tokens,
            max_pending_ops: host.max_pending_ops,
            mamba_state_bytes,
            swa_page_bytes,
            storage,
            ..Default::default()
        };
        Ok(Tiered {
            cache: HiRadixCache::new(hc, device)?,
            page_size: page_size as u64,
            modeled_page_bytes: cfg.model.page_bytes(),
            model_layers: cfg.model.layers,
            backend_layers,
            seen: (0, 0),
            _keepalive: keepalive,
        })
    }

    /// The wrapped tiered cache (read-only); its [`HiRadixCache::backend`] is the backend.
    pub fn hicache(&self) -> &HiRadixCache<B> {
        &self.cache
    }

    /// The tier's counters of tokens loaded and tokens backed up. Only these two are kept
    /// between steps: keeping the whole stats struct copied it twice a step, which showed in
    /// the agentic replay's profile.
    fn transfer_counters(&self) -> (u64, u64) {
        let s = self.cache.stats();
        (s.loaded_tokens, s.backed_up_tokens)
    }

    /// Traffic since the last report, in pages and modeled bytes.
    fn transfers_since_last(&mut self) -> StepTransfers {
        let (now_loaded, now_written) = self.transfer_counters();
        if (now_loaded, now_written) == self.seen {
            // Most steps move nothing (and the divisions below are two of their costliest
            // instructions).
            return StepTransfers::default();
        }
        let pages = |tokens: u64| tokens / self.page_size;
        let loaded = pages(now_loaded - self.seen.0);
        let written = pages(now_written - self.seen.1);
        self.seen = (now_loaded, now_written);
        StepTransfers {
            pages_loaded: loaded,
            bytes_loaded: loaded.saturating_mul(self.modeled_page_bytes),
            pages_written: written,
            bytes_written: written.saturating_mul(self.modeled_page_bytes),
        }
    }
}

/// Checks that an engine's backend holds the model's KV in the configured device pool: the
/// same layers, bytes per token per layer and page size as `cfg.model`, and `radix`'s pages.
fn check_geometry<B: DeviceBackend>(
    cfg: &ManagerConfig,
    radix: &RadixConfig,
    backend: &B,
) -> Result<()> {
    let g = backend.geometry();
    let m = &cfg.model;
    let mismatch = if u64::try_from(g.layers) != Ok(u64::from(m.layers)) {
        BackendMismatch::Layers {
            backend: g.layers,
            model: m.layers,
        }
    } else if u64::try_from(g.bytes_per_token_layer) != Ok(m.kv_bytes_per_token_per_layer) {
        BackendMismatch::BytesPerTokenPerLayer {
            backend: g.bytes_per_token_layer,
            model: m.kv_bytes_per_token_per_layer,
        }
    } else if g.page_size != radix.page_size {
        BackendMismatch::PageSize {
            backend: g.page_size,
            model: radix.page_size,
        }
    } else if backend.device_pages() != radix.total_pages {
        BackendMismatch::DevicePages {
            backend: backend.device_pages(),
            config: radix.total_pages,
        }
    } else {
        return Ok(());
    };
    Err(ManagerError::Backend {
        backend: backend.name(),
        mismatch,
    })
}

/// The per-layer wait of one started load, mapping modeled layers onto the backend's.
struct ProducerWait<E: CopyEvent> {
    counter: Arc<LayerDoneCounter<E>>,
    producer: usize,
    model_layers: u32,
    backend_layers: u32,
}

impl<E: CopyEvent> std::fmt::Debug for ProducerWait<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProducerWait")
            .field("producer", &self.producer)
            .finish()
    }
}

impl<E: CopyEvent> ProducerWait<E> {
    fn backend_layer(&self, layer: u32) -> usize {
        let l = u64::from(layer.min(self.model_layers.saturating_sub(1)));
        (l * u64::from(self.backend_layers) / u64::from(self.model_layers.max(1))) as usize
    }
}

impl<E: CopyEvent> LayerWait for ProducerWait<E> {
    fn wait_layer(&self, layer: u32) -> Result<()> {
        Ok(self
            .counter
            .wait_layer(self.producer, self.backend_layer(layer))?)
    }

    fn is_layer_done(&self, layer: u32) -> bool {
        self.counter
            .is_layer_done(self.producer, self.backend_layer(layer))
    }
}

impl<B: DeviceBackend> ManagedCache for Tiered<B> {
    fn on_begin_step(&mut self) -> Result<StepLoads> {
        let Some(step) = self.cache.start_loading()? else {
            return Ok(StepLoads::default());
        };
        let pages = step.stats.pages as u64;
        Ok(StepLoads {
            pages,
            bytes: pages.saturating_mul(self.modeled_page_bytes),
            wait: Some(Arc::new(ProducerWait {
                counter: self.cache.layer_counter().clone(),
                producer: step.producer,
                model_layers: self.model_layers,
                backend_layers: self.backend_layers,
            })),
        })
    }

    fn on_end_step(&mut self) -> Result<StepTransfers> {
        self.cache.step()?;
        Ok(self.transfers_since_last())
    }

    fn prepare_room(&mut self, tokens: usize) -> bool {
        self.cache.prepare_room(tokens)
    }

    fn evicted_at_acks(&self) -> u64 {
        self.cache.stats().write_back_demoted_tokens
    }

    fn drain(&mut self) -> Result<StepTransfers> {
        self.cache.flush()?;
        // Backups to the store follow the host backups the flush applied.
        self.cache.wait_storage()?;
        Ok(self.transfers_since_last())
    }

    fn wait_transfers(&self) {
        self.cache.wait_transfers();
    }

    fn host_tokens(&self) -> usize {
        self.cache.host_tokens()
    }

    fn mamba_accounting(&self) -> Option<radixkv_radix::ComponentAccounting> {
        self.cache.device_cache().mamba_accounting()
    }

    fn evict_mamba_states(&mut self, n: usize) -> usize {
        self.cache.evict_mamba_states(n)
    }

    fn mamba_stats(&self) -> Option<radixkv_radix::MambaStats> {
        self.cache.device_cache().mamba_stats()
    }

    fn swa_accounting(&self) -> Option<radixkv_radix::ComponentAccounting> {
        self.cache.device_cache().swa_accounting()
    }

    fn swa_window(&self) -> Option<usize> {
        self.cache.device_cache().swa_window()
    }

    fn swa_available_locked(
        &mut self,
        node: Option<radixkv_radix::NodeId>,
    ) -> Result<Option<usize>> {
        Ok(self.cache.swa_available_locked(node)?)
    }
    fn storage_prefetch(&mut self, rid: u64, req: &RequestKv) -> bool {
        self.cache.prefetch(rid, req.key_ref())
    }

    fn check_prefetch(&mut self, rid: u64) -> Result<PrefetchStatus> {
        Ok(self.cache.check_prefetch(rid)?)
    }

    fn abort_prefetch(&mut self, rid: u64) -> Result<bool> {
        Ok(self.cache.abort_prefetch(rid)?)
    }

    fn tier_stats(&self) -> Option<HiCacheStats> {
        Some(self.cache.stats())
    }

    fn store_errors(&self) -> u64 {
        self.cache
            .storage_tier()
            .map_or(0, |t| t.store().stats().errors)
    }

    fn has_storage(&self) -> bool {
        self.cache.has_storage()
    }

    fn wait_storage(&mut self) -> Result<()> {
        Ok(self.cache.wait_storage()?)
    }
}

// Every method, defaulted ones included, goes to the tiered cache: it overrides some defaults
// (eviction demotes to the host), so the trait's defaults must not run on the wrapper.
impl<B: DeviceBackend> PrefixCache for Tiered<B> {
    fn page_size(&self) -> usize {
        self.cache.page_size()
    }

    fn page_hasher(&self) -> radixkv_radix::PageHasher {
        self.cache.page_hasher()
    }
    fn pools(&self) -> &DevicePools {
        self.cache.pools()
    }
    fn pools_mut(&mut self) -> &mut DevicePools {
        self.cache.pools_mut()
    }
    fn has_state_slots(&self) -> bool {
        self.cache.has_state_slots()
    }
    fn has_window_state(&self) -> bool {
        self.cache.has_window_state()
    }
    fn sliding_window(&self) -> Option<usize> {
        self.cache.sliding_window()
    }
    fn takes_windowed_keys(&self) -> bool {
        self.cache.takes_windowed_keys()
    }
    fn restore_key(&self, req: &mut RequestKv) -> radixkv_radix::Result<()> {
        self.cache.restore_key(req)
    }
    fn check_parked(
        &self,
        req: &RequestKv,
        lock: Option<&radixkv_radix::LockReceipt>,
    ) -> std::result::Result<(), InvariantViolation> {
        self.cache.check_parked(req, lock)
    }
    fn truncate_request(&mut self, req: &mut RequestKv, len: usize) -> radixkv_radix::Result<()> {
        self.cache.truncate_request(req, len)
    }
    fn check_request(&self, req: &RequestKv) -> std::result::Result<(), InvariantViolation> {
        self.cache.check_request(req)
    }
    fn match_prefix(
        &mut self,
        key: KeyRef<'_>,
        out: &mut Vec<PageId>,
    ) -> radixkv_radix::Result<TreeMatch> {
        self.cache.match_prefix(key, out)
    }
    fn insert(
        &mut self,
        key: KeyRef<'_>,
        pages: &[PageId],
        opts: InsertOptions,
    ) -> radixkv_radix::Result<InsertResult> {
        self.cache.insert(key, pages, opts)
    }
    fn evict(&mut self, tokens: usize) -> usize {
        self.cache.evict(tokens)
    }
    fn inc_lock_ref(&mut self, node: NodeId) -> radixkv_radix::Result<LockReceipt> {
        self.cache.inc_lock_ref(node)
    }
    fn dec_lock_ref(&mut self, receipt: LockReceipt) -> radixkv_radix::Result<()> {
        self.cache.dec_lock_ref(receipt)
    }
    fn evictable_tokens(&self) -> usize {
        self.cache.evictable_tokens()
    }
    fn protected_tokens(&self) -> usize {
        self.cache.protected_tokens()
    }
    fn session_held_tokens(&self) -> usize {
        self.cache.session_held_tokens()
    }
    fn take_events(&mut self) -> Vec<KvEvent> {
        self.cache.take_events()
    }
    fn events_dropped(&self) -> u64 {
        self.cache.events_dropped()
    }
    fn reset(&mut self) -> radixkv_radix::Result<()> {
        self.cache.reset()?;
        self.seen = self.transfer_counters();
        Ok(())
    }
    fn check_invariants(&self) -> std::result::Result<(), InvariantViolation> {
        self.cache.check_invariants()
    }
    fn match_request(&mut self, req: &mut RequestKv) -> radixkv_radix::Result<RequestMatch> {
        self.cache.match_request(req)
    }
    fn begin_request(&mut self, req: &mut RequestKv) -> radixkv_radix::Result<()> {
        self.cache.begin_request(req)
    }
    fn alloc_tokens(&mut self, req: &mut RequestKv, n: usize) -> radixkv_radix::Result<()> {
        self.cache.alloc_tokens(req, n)
    }
    fn cache_unfinished_req(&mut self, req: &mut RequestKv) -> radixkv_radix::Result<()> {
        self.cache.cache_unfinished_req(req)
    }
    fn cache_finished_req(
        &mut self,
        req: &mut RequestKv,
        kind: FinishKind,
    ) -> radixkv_radix::Result<()> {
        self.cache.cache_finished_req(req, kind)
    }
    fn slide_window(&mut self, req: &mut RequestKv) -> radixkv_radix::Result<usize> {
        self.cache.slide_window(req)
    }
    fn alloc_pages(&mut self, n: usize) -> radixkv_radix::Result<Vec<PageId>> {
        self.cache.alloc_pages(n)
    }
    fn make_room(&mut self, n: usize) -> radixkv_radix::Result<()> {
        self.cache.make_room(n)
    }
    fn available_tokens(&self) -> usize {
        self.cache.available_tokens()
    }
    fn available_tokens_if_locked(&mut self, node: NodeId) -> radixkv_radix::Result<usize> {
        self.cache.available_tokens_if_locked(node)
    }
    fn accounting(&self) -> PoolAccounting {
        self.cache.accounting()
    }
}
