//! [`ManagerBuilder`]: builds a [`KvCacheManager`] from code instead of a config file.

use std::sync::Arc;

use radixkv_hicache::DeviceBackend;
use radixkv_hicache::storage::StorageBackend;

use crate::config::{
    CacheKind, Eviction, HostTier, MambaPolicyKind, ManagerConfig, ModelGeometry, PoolBudgets,
    SessionBudget,
};
use crate::error::Result;
use crate::factory::GivenBackend;
use crate::manager::KvCacheManager;

/// Builder of a [`KvCacheManager`]: a [`ManagerConfig`] set field by field, and optionally the
/// engine's own device backend for the host tier ([`ManagerBuilder::device_backend`]).
///
/// ```
/// use std::sync::Arc;
/// use radixkv_hicache::{HostSim, HostSimConfig, KvGeometry};
/// use radixkv_scheduler_api::{HostTier, KvCacheManager, ModelGeometry};
///
/// let model = ModelGeometry {
///     layers: 4,
///     kv_bytes_per_token_per_layer: 64,
///     page_size: 16,
///     ..Default::default()
/// };
/// // The engine's backend: here a HostSim, in a real engine its GPU backend. Its pools hold
/// // the model's KV in the configured device pool (1024 tokens = 64 pages of 16).
/// let geometry = KvGeometry::new(4, 16, 64)?;
/// let backend = Arc::new(HostSim::new(geometry, 64, HostSimConfig::default())?);
/// let kv = KvCacheManager::builder()
///     .model(model)
///     .device_tokens(1024)
///     .host_tier(HostTier::ratio(1024, 4.0))
///     .device_backend(backend.clone()) // the engine keeps its handle for its forward pass
///     .build()?;
/// assert_eq!(kv.accounting().total, 1024);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default)]
pub struct ManagerBuilder {
    cfg: ManagerConfig,
    backend: Option<GivenBackend>,
    store: Option<Arc<dyn StorageBackend>>,
}

impl std::fmt::Debug for ManagerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagerBuilder")
            .field("cfg", &self.cfg)
            .field("backend", &self.backend)
            .field("store", &self.store.as_ref().map(|s| s.name()))
            .finish()
    }
}

impl ManagerBuilder {
    /// Starts from a whole configuration (a device backend given before is kept).
    pub fn config(mut self, cfg: ManagerConfig) -> Self {
        self.cfg = cfg;
        self
    }

    /// Model geometry.
    pub fn model(mut self, m: ModelGeometry) -> Self {
        self.cfg.model = m;
        self
    }

    /// Tokens per page.
    pub fn page_size(mut self, p: usize) -> Self {
        self.cfg.model.page_size = p;
        self
    }

    /// Device pool capacity in tokens.
    pub fn device_tokens(mut self, n: usize) -> Self {
        self.cfg.device_tokens = n;
        self
    }

    /// Byte budgets of the pools a hybrid model adds to the full-attention KV pool (see
    /// [`PoolBudgets`]); checked when the manager is built.
    pub fn pool_budgets(mut self, b: PoolBudgets) -> Self {
        self.cfg.pools = b;
        self
    }

    /// Bytes of the Mamba state slot pool (models with Mamba layers): it holds
    /// `bytes / slot bytes` slots, one per running request or cached state. A budget that fits
    /// no slot, one on a model without Mamba layers, or more slots than a pool can address is
    /// refused when the manager is built ([`ManagerError::Config`](crate::ManagerError::Config)).
    ///
    /// ```
    /// use radixkv_scheduler_api::{KvCacheManager, Preset};
    ///
    /// let model = Preset::JambaLike.geometry();
    /// let slot = model.checked_mamba_slot_bytes().unwrap();
    /// let kv = KvCacheManager::builder()
    ///     .model(model)
    ///     .device_tokens(1 << 16)
    ///     .mamba_bytes(64 * slot)
    ///     .build()?;
    /// assert_eq!(kv.mamba_accounting().unwrap().total, 64);
    /// # Ok::<(), radixkv_scheduler_api::ManagerError>(())
    /// ```
    pub fn mamba_bytes(mut self, bytes: u64) -> Self {
        self.cfg.pools.mamba_bytes = Some(bytes);
        self
    }

    /// Bytes of the sliding-window KV pool (models with sliding-window layers; `[pools]
    /// swa_bytes`, default the full-attention pool's bytes): its pages are the budget over
    /// `page_size ×` [`ModelGeometry::checked_swa_bytes_per_token`](crate::ModelGeometry::checked_swa_bytes_per_token).
    ///
    /// ```
    /// use radixkv_scheduler_api::{KvCacheManager, Preset};
    ///
    /// let model = Preset::GemmaLike.geometry();
    /// let page = model.checked_swa_bytes_per_token().unwrap() * model.page_size as u64;
    /// let kv = KvCacheManager::builder()
    ///     .model(model)
    ///     .device_tokens(1 << 16)
    ///     .swa_bytes(512 * page)
    ///     .build()?;
    /// assert_eq!(kv.swa_accounting().unwrap().total, 512);
    /// # Ok::<(), radixkv_scheduler_api::ManagerError>(())
    /// ```
    pub fn swa_bytes(mut self, bytes: u64) -> Self {
        self.cfg.pools.swa_bytes = Some(bytes);
        self
    }

    /// The Mamba state policy (models with Mamba layers; Marconi when not set). Setting one
    /// on a model without Mamba layers is refused when the manager is built.
    pub fn mamba_policy(mut self, p: MambaPolicyKind) -> Self {
        self.cfg.mamba_policy = Some(p);
        self
    }

    /// Request-pool rows.
    pub fn max_rows(mut self, n: usize) -> Self {
        self.cfg.max_rows = n;
        self
    }

    /// The cache kind.
    pub fn cache(mut self, k: CacheKind) -> Self {
        self.cfg.cache = k;
        self
    }

    /// A host tier (turns the cache into HiCache). Every knob of the tier is a setter of
    /// [`HostTier`], checked when the manager is built:
    ///
    /// ```
    /// use radixkv_scheduler_api::{HostLayout, HostTier, KvCacheManager, ManagerError, WritePolicy};
    ///
    /// let tier = HostTier::ratio(4096, 4.0)
    ///     .write_policy(WritePolicy::WriteThroughSelective { hits: 3 })
    ///     .host_layout(HostLayout::LayerFirst)
    ///     .load_back_min_tokens(32)
    ///     .load_back_quota_tokens(Some(2048))
    ///     .max_pending_ops(64);
    /// let kv = KvCacheManager::builder().device_tokens(4096).host_tier(tier.clone()).build()?;
    /// assert_eq!(kv.config().label(), "hicache-lru-wts3+host16K");
    /// // A quota below the load-back minimum could never load anything: refused.
    /// let bad = KvCacheManager::builder()
    ///     .device_tokens(4096)
    ///     .host_tier(tier.load_back_quota_tokens(Some(16)))
    ///     .build();
    /// assert!(matches!(bad, Err(ManagerError::Config(_))));
    /// # Ok::<(), ManagerError>(())
    /// ```
    pub fn host_tier(mut self, h: HostTier) -> Self {
        self.cfg.cache = CacheKind::HiCache(h);
        self
    }

    /// Sessions with a budget.
    pub fn sessions(mut self, b: SessionBudget) -> Self {
        self.cfg.sessions = Some(b);
        self
    }

    /// Eviction policy.
    pub fn eviction(mut self, p: radixkv_radix::PolicyKind) -> Self {
        self.cfg.eviction = Eviction(p);
        self
    }

    /// Record KV events.
    pub fn events(mut self, on: bool) -> Self {
        self.cfg.events = on;
        self
    }

    /// KV events held until drained (see [`ManagerConfig::event_capacity`]).
    pub fn event_capacity(mut self, n: usize) -> Self {
        self.cfg.event_capacity = n;
        self
    }

    /// KV events carry the storage tier's page keys (see [`ManagerConfig::event_page_keys`]).
    pub fn event_page_keys(mut self, on: bool) -> Self {
        self.cfg.event_page_keys = on;
        self
    }

    /// Running lazy requests keep only the prompt tokens past their cached prefix (see
    /// [`ManagerConfig::release_cached_prompts`]).
    pub fn release_cached_prompts(mut self, on: bool) -> Self {
        self.cfg.release_cached_prompts = on;
        self
    }

    /// The engine's own device backend for the host tier, instead of the built-in one the
    /// configuration names ([`ManagerConfig::backend`]; HostSim by default). Any
    /// [`DeviceBackend`] will do — HostSim, an engine's GPU backend, a wrapper around either.
    /// It is shared (`Arc`) because the engine keeps using it: its forward pass reads and
    /// writes the pages the manager hands out.
    ///
    /// Checked by [`ManagerBuilder::build`]: the configuration must have a host tier (a
    /// device-only cache never copies KV), and the backend's pools must hold the model's KV in
    /// the configured device pool — the same layers, KV bytes per token per layer and page
    /// size as [`ManagerConfig::model`], and [`ManagerConfig::device_pages`] pages. The
    /// simulated geometry ([`ManagerConfig::sim_geometry`]) is not used.
    pub fn device_backend<B: DeviceBackend>(mut self, backend: Arc<B>) -> Self {
        self.backend = Some(GivenBackend::new(backend));
        self
    }

    /// The engine's own store for the storage tier (L3), instead of one the configuration
    /// opens: any [`StorageBackend`] (a wrapper around a built-in store, a store of the
    /// engine's). The host tier's `[cache.storage]` section must say
    /// `backend = { type = "engine" }`, and its other knobs (prefetch threshold, cap, stop
    /// policy, model id) apply; a store given for any other configuration is refused by
    /// [`ManagerBuilder::build`] ([`ManagerError::Config`](crate::ManagerError::Config)).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use radixkv_hicache::storage::MemStore;
    /// use radixkv_scheduler_api::{HostTier, KvCacheManager, StorageBackendKind, StorageTier};
    ///
    /// let store = Arc::new(MemStore::new()); // shared: several managers may use it
    /// let tier = HostTier::ratio(4096, 4.0)
    ///     .storage(Some(StorageTier::new(StorageBackendKind::Engine, "my-model")));
    /// let kv = KvCacheManager::builder()
    ///     .device_tokens(4096)
    ///     .host_tier(tier)
    ///     .storage_backend(store)
    ///     .build()?;
    /// assert!(kv.has_storage());
    /// # Ok::<(), radixkv_scheduler_api::ManagerError>(())
    /// ```
    pub fn storage_backend(mut self, store: Arc<dyn StorageBackend>) -> Self {
        self.store = Some(store);
        self
    }

    /// Builds the manager.
    ///
    /// # Errors
    /// As [`KvCacheManager::new`]; with a device backend, also
    /// [`ManagerError::Backend`](crate::ManagerError::Backend) when the configuration has no
    /// host tier or the backend's geometry or device pool differs from the configuration's;
    /// with a store, [`ManagerError::Config`](crate::ManagerError::Config) unless the
    /// configuration's storage tier says `type = "engine"` (and without one, when it does).
    pub fn build(self) -> Result<KvCacheManager> {
        KvCacheManager::build(self.cfg, self.backend.as_ref(), self.store)
    }
}
