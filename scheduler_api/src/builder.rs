//! [`ManagerBuilder`]: builds a [`KvCacheManager`] from code instead of a config file.

use crate::config::{CacheKind, Eviction, HostTier, ManagerConfig, ModelGeometry, SessionBudget};
use crate::error::Result;
use crate::manager::KvCacheManager;

/// Builder of a [`KvCacheManager`].
#[derive(Clone, Debug, Default)]
pub struct ManagerBuilder {
    cfg: ManagerConfig,
}

impl ManagerBuilder {
    /// Starts from a whole configuration.
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

    /// Builds the manager.
    ///
    /// # Errors
    /// [`ManagerError::Config`](crate::ManagerError::Config) or [`ManagerError::NotWired`](crate::ManagerError::NotWired).
    pub fn build(self) -> Result<KvCacheManager> {
        KvCacheManager::new(self.cfg)
    }
}
