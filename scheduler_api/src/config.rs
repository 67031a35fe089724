//! Typed configuration of a [`crate::KvCacheManager`]: model geometry, pool sizes, the cache
//! kind and its tiers, sessions and the device backend. Readable from TOML or JSON.
//!
//! Every kind the product has is describable here, even the ones not wired into
//! [`crate::factory::build_cache`] yet (sliding-window layers under a host tier with sessions
//! or with Mamba layers as well, see [`crate::geometry`]) or not built at all (the CUDA
//! backend):
//! the factory, not the config, decides what can be built, and says what is missing. The
//! storage tier (L3, [`StorageTier`]) is built for every model: under Mamba or sliding-window
//! layers its stored pages carry the Mamba states and window KV too.
//!
//! Two geometries: [`ModelGeometry`] is the real model's (the *modeled* bytes every report
//! and the cost model use); [`SimGeometry`] is what the HostSim backend really allocates and
//! copies, kept tiny so that a 1M + 4M token replay fits in a few tens of MB.

use std::path::Path;

pub use radixkv_hicache::{HostLayout, WritePolicy};
use radixkv_radix::PolicyKind;
use serde::{Deserialize, Serialize};

use crate::error::{ManagerError, Result};
pub use crate::geometry::{
    ComputeShape, LayerCounts, LayerKind, LayerPattern, MambaShape, ModelGeometry, PagedPool,
    Pools, Preset, SlotPool,
};

/// A commented example of a manager configuration in TOML, naming every key with its default
/// and valid values: the same text the README shows and `radixkv config --example` prints.
/// It parses ([`ManagerConfig::from_toml_str`]) and builds a manager (a HiCache with sessions).
pub const EXAMPLE_TOML: &str = include_str!("../config.example.toml");

/// Byte budgets of the device pools a hybrid model adds to the full-attention KV pool (whose
/// size is `device_tokens`). Pages and slots are derived from them
/// ([`ManagerConfig::pools`]); a budget for a pool the model does not have is refused.
///
/// For a model with Mamba layers (and no sliding-window layers) `total_bytes` instead gives
/// the KV pool and the Mamba pool one budget, which the Mamba policy's own rule splits
/// ([`crate::split`]; [`ManagerConfig::apply_total_bytes`] sets `device_tokens` from it).
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolBudgets {
    /// Bytes of the sliding-window KV pool (default: the full-attention pool's bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swa_bytes: Option<u64>,
    /// Bytes of the Mamba state slot pool (default: the full-attention pool's bytes); at least
    /// two slots' worth (a hit holds the cached state and the request's copy of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mamba_bytes: Option<u64>,
    /// Total device bytes of the full-attention KV pool and the Mamba state pool together,
    /// split by the Mamba policy's rule ([`crate::split`]): the SGLang-style baseline by
    /// `mamba_full_memory_ratio`, the Marconi-style default by `running_requests`. The KV
    /// pool's `device_tokens` and the Mamba pool then follow from it, so neither
    /// `device_tokens` nor `mamba_bytes` may be given with it. Models with Mamba layers and
    /// no sliding-window layers only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<u64>,
    /// The SGLang-style split's state bytes over KV bytes (SGLang's
    /// `--mamba-full-memory-ratio`; default
    /// [`SGLANG_MAMBA_FULL_MEMORY_RATIO`](crate::split::SGLANG_MAMBA_FULL_MEMORY_RATIO),
    /// 0.9). Needs `total_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mamba_full_memory_ratio: Option<f64>,
    /// The running requests the Marconi-style split provisions
    /// [`MARCONI_SLOTS_PER_REQUEST`](crate::split::MARCONI_SLOTS_PER_REQUEST) state slots
    /// each for (default: `max_rows`). Needs `total_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_requests: Option<usize>,
}

impl PoolBudgets {
    /// True when no budget is given (every pool takes its default).
    pub fn is_unset(&self) -> bool {
        self.swa_bytes.is_none()
            && self.mamba_bytes.is_none()
            && self.total_bytes.is_none()
            && self.mamba_full_memory_ratio.is_none()
            && self.running_requests.is_none()
    }
}

/// Which prefix cache backs the manager.
// A configuration value, built once: the host tier's size (its storage section) costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum CacheKind {
    /// No reuse at all: every prompt is recomputed (the baseline).
    Disabled,
    /// Device-only radix cache.
    #[default]
    Radix,
    /// Device + host tiers (`kind = "hicache"`).
    #[serde(rename = "hicache")]
    HiCache(HostTier),
}

/// The host tier (L2) of a hierarchical cache: every knob of the HiCache host tier the
/// manager builds (`radixkv_hicache::HiCacheConfig`). The host sides of the hybrid pools
/// (Mamba state slots, sliding-window KV pages) are the host tier's share of the device pools,
/// as for the KV, and are not set here.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostTier {
    /// Host pool capacity in tokens (at least one page).
    pub host_tokens: usize,
    /// Backups and loads, per direction, the tier holds queued or in flight (at least 1).
    /// Past it a backup is skipped (the prefix stays device-only) and an admission that needs
    /// a load waits ([`WaitReason::TransfersBusy`](crate::WaitReason::TransfersBusy)).
    #[serde(default = "default_max_pending_ops")]
    pub max_pending_ops: usize,
    /// When device pages are written to the host: `"write_through"` (the default),
    /// `"write_through_selective"` (after 2 hits) or `"write_through_selective:N"` (after `N`
    /// hits, at least 1), `"write_back"`.
    #[serde(default = "default_write_policy")]
    pub write_policy: WritePolicy,
    /// Eviction policy of the host tier (absent: the device tier's `eviction`).
    #[serde(default)]
    pub eviction: Option<Eviction>,
    /// Byte order of the host pool: `"page_first"` (the default: all layers of a page
    /// contiguous) or `"layer_first"` (like the device pool: a run of pages in one layer is
    /// one copy).
    #[serde(default = "default_host_layout")]
    pub host_layout: HostLayout,
    /// Host hits shorter than this many tokens (rounded up to whole pages) are recomputed
    /// instead of loaded back (default 10: one page at most page sizes).
    #[serde(default = "default_load_back_min_tokens")]
    pub load_back_min_tokens: usize,
    /// A host hit longer than this many tokens is not loaded back at all (the request
    /// recomputes it); absent: no limit. At least one page and at least
    /// `load_back_min_tokens` (rounded up to whole pages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_back_quota_tokens: Option<usize>,
    /// The storage tier (L3) under the host pool (`[cache.storage]`; absent: none). See
    /// [`StorageTier`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<StorageTier>,
}

impl HostTier {
    /// A host tier `ratio` times the size of a `device_tokens` pool, write-through, every other
    /// knob at its default.
    pub fn ratio(device_tokens: usize, ratio: f64) -> Self {
        HostTier {
            host_tokens: (device_tokens as f64 * ratio.max(0.0)) as usize,
            max_pending_ops: default_max_pending_ops(),
            write_policy: default_write_policy(),
            eviction: None,
            host_layout: default_host_layout(),
            load_back_min_tokens: default_load_back_min_tokens(),
            load_back_quota_tokens: None,
            storage: None,
        }
    }

    /// The same tier with another write policy.
    pub fn write_policy(mut self, p: WritePolicy) -> Self {
        self.write_policy = p;
        self
    }

    /// The same tier with its own eviction policy.
    pub fn eviction(mut self, p: PolicyKind) -> Self {
        self.eviction = Some(Eviction(p));
        self
    }

    /// The same tier with another host pool layout.
    pub fn host_layout(mut self, l: HostLayout) -> Self {
        self.host_layout = l;
        self
    }

    /// The same tier with another load-back minimum (tokens).
    pub fn load_back_min_tokens(mut self, n: usize) -> Self {
        self.load_back_min_tokens = n;
        self
    }

    /// The same tier with a load-back quota (tokens; `None`: no limit).
    pub fn load_back_quota_tokens(mut self, n: Option<usize>) -> Self {
        self.load_back_quota_tokens = n;
        self
    }

    /// The same tier with another limit of pending transfers per direction.
    pub fn max_pending_ops(mut self, n: usize) -> Self {
        self.max_pending_ops = n;
        self
    }

    /// The same tier with a storage tier (L3) under it (`None`: none).
    pub fn storage(mut self, s: Option<StorageTier>) -> Self {
        self.storage = s;
        self
    }

    /// Checks the tier's knobs against a pool of `page_size`-token pages.
    fn validate(&self, page_size: usize) -> Result<()> {
        let bad = |m: String| Err(ManagerError::Config(m));
        if self.host_tokens < page_size {
            return bad(format!(
                "host pool of {} tokens is smaller than one page of {page_size} tokens",
                self.host_tokens
            ));
        }
        if let WritePolicy::WriteThroughSelective { hits: 0 } = self.write_policy {
            return bad("write_through_selective needs a hit threshold of at least 1".into());
        }
        if self.max_pending_ops == 0 {
            return bad("the host tier must allow at least one pending transfer".into());
        }
        if let Some(q) = self.load_back_quota_tokens {
            let min_pages = self.load_back_min_tokens.div_ceil(page_size).max(1);
            let floor = min_pages.saturating_mul(page_size);
            if q < floor {
                return bad(format!(
                    "load_back_quota_tokens = {q} is below {floor} (one page and \
                     load_back_min_tokens, in whole pages): nothing would ever be loaded back"
                ));
            }
        }
        Ok(())
    }
}

fn default_max_pending_ops() -> usize {
    radixkv_hicache::DEFAULT_MAX_PENDING_OPS
}

fn default_write_policy() -> WritePolicy {
    WritePolicy::WriteThrough
}

fn default_host_layout() -> HostLayout {
    radixkv_hicache::HiCacheConfig::default().host_layout
}

fn default_load_back_min_tokens() -> usize {
    radixkv_hicache::HiCacheConfig::default().load_back_min_tokens
}

/// The storage tier (L3) below the host pool (`[cache.storage]`): a store of KV pages that
/// outlives the process and may be shared by several servers. Pages that reach the host tier
/// are backed up to it in the background; a request whose prefix beyond the device and host
/// match is in the store has it prefetched into the host tier before admission (see
/// [`KvCacheManager::arrive`](crate::KvCacheManager::arrive) and
/// [`WaitReason::Prefetching`](crate::WaitReason::Prefetching)). Mapped onto
/// `radixkv_hicache::StorageConfig`.
///
/// For models with Mamba or sliding-window layers the stored pages also carry the Mamba state
/// that ends at them and their window KV (see `radixkv_hicache`'s storage tier docs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageTier {
    /// Where the pages are kept.
    pub backend: StorageBackendKind,
    /// The model's name (or any string naming its weights): part of every page key with the
    /// KV layout, so that models sharing a store never read each other's pages. Required, not
    /// empty; two deployments of different weights with the same geometry must name them apart.
    pub model_id: String,
    /// Storage hits shorter than this many tokens (rounded up to whole pages) are not
    /// prefetched (default 256).
    #[serde(default = "default_prefetch_threshold_tokens")]
    pub prefetch_threshold_tokens: usize,
    /// Most tokens that prefetches may hold reserved in the host pool at once (default: half
    /// the host pool). At least one page and at most `host_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch_cap_tokens: Option<usize>,
    /// When a waiting request's prefetch ends and the request is admitted (default: a
    /// timeout of 2 s + 0.1 s per 1K tokens, at most 30 s).
    #[serde(default)]
    pub stop: PrefetchStopPolicy,
    /// Pages per store operation (default 128, at least 1).
    #[serde(default = "default_batch_pages")]
    pub batch_pages: usize,
    /// Storage jobs talking to the store at once (default 4, at least 1).
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Deadline of one store operation in milliseconds (default 5000, at least 1); an
    /// operation past it fails, and the tier degrades to recomputation.
    #[serde(default = "default_op_timeout_ms")]
    pub op_timeout_ms: u64,
    /// Threads of the tier's own tokio runtime (default 2, at least 1).
    #[serde(default = "default_worker_threads")]
    pub worker_threads: usize,
}

impl StorageTier {
    /// A storage tier over `backend` for model `model_id`, every other knob at its default.
    pub fn new(backend: StorageBackendKind, model_id: impl Into<String>) -> Self {
        StorageTier {
            backend,
            model_id: model_id.into(),
            prefetch_threshold_tokens: default_prefetch_threshold_tokens(),
            prefetch_cap_tokens: None,
            stop: PrefetchStopPolicy::default(),
            batch_pages: default_batch_pages(),
            concurrency: default_concurrency(),
            op_timeout_ms: default_op_timeout_ms(),
            worker_threads: default_worker_threads(),
        }
    }

    /// The same tier with another stop policy.
    pub fn stop(mut self, s: PrefetchStopPolicy) -> Self {
        self.stop = s;
        self
    }

    /// The same tier with another prefetch threshold (tokens).
    pub fn prefetch_threshold_tokens(mut self, n: usize) -> Self {
        self.prefetch_threshold_tokens = n;
        self
    }

    /// The same tier with a prefetch cap (tokens; `None`: half the host pool).
    pub fn prefetch_cap_tokens(mut self, n: Option<usize>) -> Self {
        self.prefetch_cap_tokens = n;
        self
    }

    /// The same tier with another store operation deadline (milliseconds).
    pub fn op_timeout_ms(mut self, ms: u64) -> Self {
        self.op_timeout_ms = ms;
        self
    }

    /// Checks the tier's knobs against a pool of `page_size`-token pages and a host pool of
    /// `host_tokens` tokens.
    fn validate(&self, page_size: usize, host_tokens: usize) -> Result<()> {
        let bad = |m: String| Err(ManagerError::Config(m));
        if self.model_id.trim().is_empty() {
            return bad("cache.storage.model_id must name the model (it keys every page)".into());
        }
        if self.prefetch_threshold_tokens == 0 {
            return bad("cache.storage.prefetch_threshold_tokens must be at least 1".into());
        }
        if let Some(c) = self.prefetch_cap_tokens
            && (c < page_size || c > host_tokens)
        {
            return bad(format!(
                "cache.storage.prefetch_cap_tokens = {c} must be between one page \
                 ({page_size} tokens) and host_tokens ({host_tokens})"
            ));
        }
        for (name, v) in [
            ("batch_pages", self.batch_pages),
            ("concurrency", self.concurrency),
            ("worker_threads", self.worker_threads),
        ] {
            if v == 0 {
                return bad(format!("cache.storage.{name} must be at least 1"));
            }
        }
        if self.op_timeout_ms == 0 {
            return bad("cache.storage.op_timeout_ms must be at least 1".into());
        }
        if let PrefetchStopPolicy::Timeout {
            base_ms,
            per_1k_tokens_ms,
            max_ms,
        } = self.stop
            && (base_ms > max_ms || per_1k_tokens_ms > max_ms)
        {
            return bad(format!(
                "cache.storage.stop: base_ms ({base_ms}) and per_1k_tokens_ms \
                 ({per_1k_tokens_ms}) must not exceed max_ms ({max_ms})"
            ));
        }
        match &self.backend {
            StorageBackendKind::File {
                dir,
                capacity_tokens,
                ..
            } => {
                if dir.as_os_str().is_empty() {
                    return bad("cache.storage.backend.dir must name a directory".into());
                }
                check_capacity(*capacity_tokens, page_size)?;
            }
            StorageBackendKind::Memory { capacity_tokens } => {
                check_capacity(*capacity_tokens, page_size)?;
            }
            StorageBackendKind::Redis { url, .. } => {
                if url.trim().is_empty() {
                    return bad("cache.storage.backend.url must name the Redis server".into());
                }
                if !cfg!(feature = "redis") {
                    return Err(ManagerError::FeatureOff {
                        what: "cache.storage.backend type = \"redis\"",
                        feature: "redis",
                    });
                }
            }
            StorageBackendKind::Engine => {}
        }
        Ok(())
    }
}

fn check_capacity(capacity: Option<usize>, page_size: usize) -> Result<()> {
    match capacity {
        Some(c) if c < page_size => Err(ManagerError::Config(format!(
            "cache.storage.backend.capacity_tokens = {c} is less than one page of {page_size} \
             tokens"
        ))),
        _ => Ok(()),
    }
}

fn default_prefetch_threshold_tokens() -> usize {
    radixkv_hicache::DEFAULT_PREFETCH_THRESHOLD_TOKENS
}

fn default_batch_pages() -> usize {
    radixkv_hicache::storage::TierOptions::default().batch_pages
}

fn default_concurrency() -> usize {
    radixkv_hicache::storage::TierOptions::default().concurrency
}

fn default_op_timeout_ms() -> u64 {
    radixkv_hicache::storage::TierOptions::default()
        .op_timeout
        .as_millis() as u64
}

fn default_worker_threads() -> usize {
    radixkv_hicache::storage::TierOptions::default().worker_threads
}

/// Where a storage tier keeps its pages (`[cache.storage.backend]`, `type = ...`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum StorageBackendKind {
    /// Segment files in a directory (`radixkv_hicache::storage::FileStore`): pages appended
    /// with checksummed records (a torn or damaged record is a miss, never wrong KV), an index
    /// rebuilt at open so a restarted server finds its pages, least recently used segments
    /// evicted past the capacity.
    File {
        /// The store's directory (created if missing).
        dir: std::path::PathBuf,
        /// Most tokens of KV kept (whole pages; absent: no cap). At least one page.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        capacity_tokens: Option<usize>,
        /// How much of a write reaches the disk before it counts as stored: `"never"` (the
        /// default: no fsync; a torn page reads back as a miss), `"pages"`,
        /// `"pages_and_dirs"`.
        #[serde(default)]
        sync: radixkv_hicache::storage::FileSync,
    },
    /// Process memory (`radixkv_hicache::storage::MemStore`): gone with the process; for tests
    /// and for sharing between managers of one process.
    Memory {
        /// Most tokens of KV kept (whole pages; absent: no cap). At least one page.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        capacity_tokens: Option<usize>,
    },
    /// A Redis server or cluster (`radixkv_hicache::storage::RedisStore`; cargo feature
    /// `redis` of this crate, refused with [`ManagerError::FeatureOff`] without it). Its
    /// capacity is the server's (`maxmemory` and its eviction policy).
    Redis {
        /// `redis://host:port[/db]`; with `cluster`, nodes of the cluster separated by commas.
        url: String,
        /// `url` names nodes of a Redis Cluster (default false).
        #[serde(default)]
        cluster: bool,
        /// Prepended to every page's key (default `"radixkv:"`).
        #[serde(default = "default_key_prefix")]
        key_prefix: String,
    },
    /// The engine's own store, handed to
    /// [`ManagerBuilder::storage_backend`](crate::ManagerBuilder::storage_backend); building
    /// without one is a [`ManagerError::Config`].
    Engine,
}

fn default_key_prefix() -> String {
    "radixkv:".into()
}

/// When a waiting request's prefetch ends (`[cache.storage.stop]`, `policy = ...`): the
/// policies of `radixkv_hicache::PrefetchStop`, with SGLang's semantics. Whatever the policy, a
/// prefetch whose pages have all arrived ends, and so does one whose fetch stopped short.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case", deny_unknown_fields)]
pub enum PrefetchStopPolicy {
    /// Admit at once with what has arrived. (Written `{}`: a struct variant, so that a key
    /// it does not take is refused rather than ignored.)
    BestEffort {},
    /// Keep the request waiting until the fetch has finished.
    WaitComplete {},
    /// Keep it waiting until the fetch has finished or `min(max_ms, base_ms + per_1k_tokens_ms
    /// × tokens / 1024)` has passed since the prefetch started.
    Timeout {
        /// Fixed part of the deadline (default 2000).
        #[serde(default = "default_timeout_base_ms")]
        base_ms: u64,
        /// Part per 1024 tokens prefetched (default 100).
        #[serde(default = "default_timeout_per_1k_ms")]
        per_1k_tokens_ms: u64,
        /// Cap of the deadline (default 30000).
        #[serde(default = "default_timeout_max_ms")]
        max_ms: u64,
    },
}

impl Default for PrefetchStopPolicy {
    fn default() -> Self {
        PrefetchStopPolicy::Timeout {
            base_ms: default_timeout_base_ms(),
            per_1k_tokens_ms: default_timeout_per_1k_ms(),
            max_ms: default_timeout_max_ms(),
        }
    }
}

impl PrefetchStopPolicy {
    /// The library's policy.
    pub fn to_hicache(self) -> radixkv_hicache::PrefetchStop {
        use std::time::Duration;
        match self {
            PrefetchStopPolicy::BestEffort {} => radixkv_hicache::PrefetchStop::BestEffort,
            PrefetchStopPolicy::WaitComplete {} => radixkv_hicache::PrefetchStop::WaitComplete,
            PrefetchStopPolicy::Timeout {
                base_ms,
                per_1k_tokens_ms,
                max_ms,
            } => radixkv_hicache::PrefetchStop::Timeout {
                base: Duration::from_millis(base_ms),
                per_1k_tokens: Duration::from_millis(per_1k_tokens_ms),
                max: Duration::from_millis(max_ms),
            },
        }
    }
}

fn default_timeout_base_ms() -> u64 {
    2000
}

fn default_timeout_per_1k_ms() -> u64 {
    100
}

fn default_timeout_max_ms() -> u64 {
    30_000
}

/// Bounds on the KV that streaming sessions may hold between turns.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionBudget {
    /// Total tokens all idle sessions may hold.
    pub max_held_tokens: usize,
    /// An idle session is demoted after this long (milliseconds of the caller's clock).
    pub idle_ttl_ms: u64,
    /// Tokens one session may hold.
    pub per_session_cap_tokens: usize,
    /// Sliding-window pages all idle sessions may own (the window KV each keeps for its next
    /// turn), for a model with sliding-window layers; over it the least recently used are
    /// demoted. Left out, the SWA pool bounds them: an allocation short of window pages
    /// demotes idle sessions owning some either way. More than the SWA pool, or set for a
    /// model without sliding-window layers, is a [`ManagerError::Config`].
    pub max_held_window_pages: Option<u64>,
}

impl Default for SessionBudget {
    fn default() -> Self {
        SessionBudget {
            max_held_tokens: 256 << 10,
            idle_ttl_ms: 300_000,
            per_session_cap_tokens: 128 << 10,
            max_held_window_pages: None,
        }
    }
}

/// The geometry the HostSim backend really allocates and copies, as opposed to the *modeled*
/// geometry of [`ModelGeometry`].
///
/// HostSim moves real bytes. At a real model's KV size (e.g. 128 KiB per token), a replay with
/// 1M device and 4M host tokens would need hundreds of GB, so the simulated pools use this tiny
/// geometry instead (by default 2 layers × 4 bytes per token per layer: 8 MB per million
/// tokens). It only decides how much memory the simulation touches: every byte count the
/// manager reports (step load bytes, transferred bytes, the cost model's transfer time) is
/// *modeled* bytes, `pages × ModelGeometry::page_bytes()`. Layer `i` of the modeled forward
/// waits for simulated layer `i × sim layers / model layers`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimGeometry {
    /// Layers of the simulated pools (at least 1).
    pub layers: u32,
    /// Bytes per token per layer of the simulated pools (at least 1).
    pub bytes_per_token_per_layer: u32,
}

impl Default for SimGeometry {
    fn default() -> Self {
        SimGeometry {
            layers: 2,
            bytes_per_token_per_layer: 4,
        }
    }
}

/// Which built-in device backend the factory builds for a host tier (`backend = { type =
/// "host_sim" }` in TOML). Not to be confused with the trait
/// [`radixkv_hicache::DeviceBackend`] that every backend implements: an engine with a backend
/// of its own hands it to [`ManagerBuilder::device_backend`](crate::ManagerBuilder::device_backend),
/// and that backend takes the place of the one named here.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum BackendKind {
    /// HostSim: plain host memory with GPU-like stream semantics (tests, simulation), sized by
    /// [`ManagerConfig::sim_geometry`].
    #[default]
    HostSim,
    /// A CUDA device: `radixkv_hicache::cuda::CudaBackend` allocates the device pool in the
    /// model's geometry (`model`: layers, KV bytes per token per layer, page size) on device
    /// `device`. Needs the crate feature `cuda` (else [`ManagerError::FeatureOff`]) and a host tier
    /// (else [`ManagerError::Backend`]); a machine without a driver or device gives
    /// [`ManagerError::Tier`] with `HiCacheError::NoDevice`. A backend handed to the builder
    /// takes its place.
    Cuda {
        /// Device ordinal.
        device: u32,
        /// How copies are submitted (`copy_method = "auto"`, the default; `"memcpy"`,
        /// `"batched"`, `"kernel"`): `radixkv_hicache::cuda::CopyMethod`. A method the
        /// machine lacks is refused when the manager is built (`ManagerError::Tier` with
        /// `HiCacheError::CopyMethodUnavailable`).
        #[serde(default)]
        copy_method: CudaCopyMethod,
    },
}

/// The copy method of the built-in CUDA backend, by name (`radixkv_hicache::cuda::CopyMethod`
/// without needing the `cuda` feature to parse a configuration).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CudaCopyMethod {
    /// Per copy: memcpys for few or long spans, the kernel or the batched call for many short
    /// ones.
    #[default]
    Auto,
    /// One memcpy per span.
    Memcpy,
    /// The driver's batched copy call (CUDA 12.8 and later).
    Batched,
    /// The NVRTC gather/scatter kernel.
    Kernel,
}

/// An eviction policy by name, (de)serialized as its short name (`"lru"`, `"sieve"`, ...).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Eviction(pub PolicyKind);

impl TryFrom<String> for Eviction {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        PolicyKind::from_name(&s)
            .map(Eviction)
            .ok_or_else(|| format!("unknown eviction policy {s:?}; known: {}", policy_names()))
    }
}

impl From<Eviction> for String {
    fn from(e: Eviction) -> String {
        e.0.name().to_string()
    }
}

/// The names of every built-in eviction policy, comma separated.
pub fn policy_names() -> String {
    PolicyKind::ALL.map(|p| p.name()).join(", ")
}

/// Everything a [`crate::KvCacheManager`] is built from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ManagerConfig {
    /// Model geometry and page size.
    pub model: ModelGeometry,
    /// Device KV pool capacity in tokens (rounded down to whole pages): the full-attention KV
    /// pool.
    pub device_tokens: usize,
    /// Byte budgets of the other device pools of a hybrid model (see [`PoolBudgets`]).
    #[serde(skip_serializing_if = "PoolBudgets::is_unset")]
    pub pools: PoolBudgets,
    /// Request-pool rows: running requests plus held sessions.
    pub max_rows: usize,
    /// The cache kind and its tiers.
    pub cache: CacheKind,
    /// Eviction policy of the device tier.
    pub eviction: Eviction,
    /// Sessions on (with their budget) or off.
    pub sessions: Option<SessionBudget>,
    /// The built-in device backend of the host tier (see [`BackendKind`]).
    pub backend: BackendKind,
    /// What the HostSim backend really allocates per token (see [`SimGeometry`]); reported
    /// bytes are always modeled bytes from [`ModelGeometry`]. Unused with a backend handed to
    /// the builder, whose geometry must be the model's.
    pub sim_geometry: SimGeometry,
    /// Record KV events for a router.
    pub events: bool,
    /// KV events held until [`crate::KvCacheManager::take_events`] drains them (at least 1);
    /// past that, new events are dropped and counted in
    /// [`Counters::kv_events_dropped`](crate::metrics::Counters::kv_events_dropped), and the
    /// router must resync (see [`EventBuffer`](radixkv_radix::EventBuffer)).
    pub event_capacity: usize,
    /// KV events also carry each page's 256-bit storage key (`page_keys`, `parent_key`): the
    /// key the storage tier stores the page under, so a router or a peer reading the same store
    /// can name it (see [the events docs](radixkv_radix::events#page-keys)). Needs `events`
    /// and a `[cache.storage]` section, whose `model_id` and the KV layout seed the chain.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub event_page_keys: bool,
    /// Output tokens reserved per request at admission are clipped to this (SGLang's
    /// `CLIP_MAX_NEW_TOKENS`): reserving a request's whole `max_new_tokens` starves admission.
    pub reserve_clip_tokens: usize,
    /// How the cache of a model with Mamba layers admits and evicts states
    /// (`mamba_policy = "marconi"` or `"sglang"`; see [`MambaPolicyKind`]). Left out: Marconi.
    /// Refused on a model without Mamba layers, where it would mean nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mamba_policy: Option<MambaPolicyKind>,
    /// A running lazy request ([`crate::Request::lazy`]) keeps only the prompt tokens past
    /// its cached prefix: once its last prefill chunk is in (`chunk_done`), the prompt tokens
    /// the tree holds on the request's locked path are dropped
    /// ([`radixkv_radix::RequestKv::drop_cached_prefix`]), so a running prompt is held once,
    /// by the tree, instead of also by the request. [`crate::KvCacheManager::tokens`] then
    /// refuses such a request (its source has the prompt;
    /// [`crate::KvCacheManager::held_tokens`] gives what it holds). A retracted request fills its
    /// prompt from its source again, as any waiting lazy request. Needs a cache whose
    /// inserts start at the request's lock (`cache = "radix"` or `"hicache"`, with or without
    /// sessions, but without Mamba or sliding-window layers); refused with any other. Off by
    /// default.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub release_cached_prompts: bool,
}

/// The Mamba state policy of a cache ([`ManagerConfig::mamba_policy`]), built from the model's
/// geometry into a [`radixkv_radix::MambaPolicy`] ([`ManagerConfig::radix_mamba_policy`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MambaPolicyKind {
    /// Marconi-style (the default): states at chunk ends, branch points and request ends under
    /// hit-driven admission, eviction by recency plus prefill FLOPs saved per byte, with the
    /// FLOPs, slot bytes and KV bytes per token from the model's geometry. Needs
    /// `[model.compute]`.
    #[default]
    Marconi,
    /// The SGLang-style baseline: SGLang's caching points (every prefill chunk's end, the
    /// branching point, the request end; see `radixkv_radix::mamba_policy`), least recently
    /// used eviction.
    Sglang,
}

impl MambaPolicyKind {
    /// Both policies.
    pub const ALL: [MambaPolicyKind; 2] = [MambaPolicyKind::Marconi, MambaPolicyKind::Sglang];

    /// The policy's name (`"marconi"`, `"sglang"`).
    pub fn name(self) -> &'static str {
        match self {
            MambaPolicyKind::Marconi => "marconi",
            MambaPolicyKind::Sglang => "sglang",
        }
    }

    /// The policy a name names.
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }
}

impl Default for ManagerConfig {
    fn default() -> Self {
        ManagerConfig {
            model: ModelGeometry::default(),
            device_tokens: 1 << 20,
            pools: PoolBudgets::default(),
            max_rows: 512,
            cache: CacheKind::Radix,
            eviction: Eviction::default(),
            sessions: None,
            backend: BackendKind::HostSim,
            sim_geometry: SimGeometry::default(),
            events: false,
            event_capacity: radixkv_radix::EventBuffer::DEFAULT_CAPACITY,
            event_page_keys: false,
            reserve_clip_tokens: 4096,
            mamba_policy: None,
            release_cached_prompts: false,
        }
    }
}

impl ManagerConfig {
    /// Parses a TOML document.
    ///
    /// # Errors
    /// [`ManagerError::Config`] naming the bad field.
    pub fn from_toml_str(s: &str) -> Result<Self> {
        let mut c: ManagerConfig =
            toml::from_str(s).map_err(|e| ManagerError::Config(format!("TOML config: {e}")))?;
        if c.pools.total_bytes.is_some() {
            let table: toml::Table =
                toml::from_str(s).map_err(|e| ManagerError::Config(format!("TOML config: {e}")))?;
            c.apply_total_bytes_unless_given(table.contains_key("device_tokens"))?;
        }
        c.validate()?;
        Ok(c)
    }

    /// Parses a JSON document.
    ///
    /// # Errors
    /// [`ManagerError::Config`] naming the bad field.
    pub fn from_json_str(s: &str) -> Result<Self> {
        let mut c: ManagerConfig = serde_json::from_str(s)
            .map_err(|e| ManagerError::Config(format!("JSON config: {e}")))?;
        if c.pools.total_bytes.is_some() {
            let doc: serde_json::Value = serde_json::from_str(s)
                .map_err(|e| ManagerError::Config(format!("JSON config: {e}")))?;
            c.apply_total_bytes_unless_given(doc.get("device_tokens").is_some())?;
        }
        c.validate()?;
        Ok(c)
    }

    /// [`ManagerConfig::apply_total_bytes`] for a document without `device_tokens`; one that
    /// gives it too must give the split's (as `radixkv config` prints it), else it is refused.
    fn apply_total_bytes_unless_given(&mut self, device_tokens_given: bool) -> Result<()> {
        if !device_tokens_given {
            return self.apply_total_bytes().map(|_| ());
        }
        match self.hybrid_split()? {
            Some(s) if s.kv_tokens != self.device_tokens => Err(ManagerError::Config(format!(
                "device_tokens = {} and pools.total_bytes are both given, and the split of the \
                 total sets a KV pool of {} tokens (leave device_tokens out)",
                self.device_tokens, s.kv_tokens
            ))),
            _ => Ok(()),
        }
    }

    /// The split of [`PoolBudgets::total_bytes`] by the effective Mamba policy's rule
    /// (`None` without a total; see [`crate::split`]): [`SplitRule::Sglang`] with
    /// `mamba_full_memory_ratio` for the baseline, [`SplitRule::Marconi`] with
    /// `running_requests` (default `max_rows`) for the default.
    ///
    /// [`SplitRule::Sglang`]: crate::split::SplitRule::Sglang
    /// [`SplitRule::Marconi`]: crate::split::SplitRule::Marconi
    ///
    /// # Errors
    /// [`ManagerError::Config`] for an invalid geometry, a model without Mamba layers, a
    /// Mamba budget given as well, or a split knob without a total (or for the other policy);
    /// [`ManagerError::NotImplemented`] for a model with sliding-window layers;
    /// [`ManagerError::Split`] for a total the rule cannot split.
    pub fn hybrid_split(&self) -> Result<Option<crate::split::HybridSplit>> {
        use crate::split::{MARCONI_SLOTS_PER_REQUEST, SGLANG_MAMBA_FULL_MEMORY_RATIO, SplitRule};
        let bad = |m: &str| Err(ManagerError::Config(m.into()));
        let b = &self.pools;
        let Some(total) = b.total_bytes else {
            if b.mamba_full_memory_ratio.is_some() || b.running_requests.is_some() {
                return bad(
                    "pools.mamba_full_memory_ratio and pools.running_requests split \
                     pools.total_bytes, which is not given",
                );
            }
            return Ok(None);
        };
        self.model.validate()?;
        let n = self.model.layer_counts();
        if n.mamba == 0 {
            return bad("pools.total_bytes is set but the model has no Mamba layer");
        }
        if n.sliding_window > 0 {
            return Err(ManagerError::NotImplemented {
                what: "pools.total_bytes for a model with sliding-window layers (give \
                       device_tokens and the per-pool budgets)",
            });
        }
        if b.mamba_bytes.is_some() {
            return bad(
                "pools.mamba_bytes and pools.total_bytes are both given: the split of the \
                 total sets the Mamba pool",
            );
        }
        let rule = match self.mamba_policy_kind().unwrap_or_default() {
            MambaPolicyKind::Sglang => {
                if b.running_requests.is_some() {
                    return bad(
                        "pools.running_requests sizes the Marconi split; the sglang policy \
                         splits by pools.mamba_full_memory_ratio",
                    );
                }
                SplitRule::Sglang {
                    mamba_full_memory_ratio: b
                        .mamba_full_memory_ratio
                        .unwrap_or(SGLANG_MAMBA_FULL_MEMORY_RATIO),
                }
            }
            MambaPolicyKind::Marconi => {
                if b.mamba_full_memory_ratio.is_some() {
                    return bad(
                        "pools.mamba_full_memory_ratio is the sglang policy's split; the \
                         marconi split is sized by pools.running_requests",
                    );
                }
                SplitRule::Marconi {
                    running_requests: b.running_requests.unwrap_or(self.max_rows),
                    slots_per_request: MARCONI_SLOTS_PER_REQUEST,
                }
            }
        };
        let slot = self.model.checked_mamba_slot_bytes().ok_or_else(|| {
            ManagerError::Config("a Mamba slot overflows a 64-bit byte count".into())
        })?;
        Ok(Some(crate::split::split_total(
            total,
            self.model.page_bytes(),
            self.model.page_size,
            slot,
            rule,
        )?))
    }

    /// Sets `device_tokens` from the split of [`PoolBudgets::total_bytes`] (see
    /// [`ManagerConfig::hybrid_split`]) and returns the split; without a total, changes
    /// nothing. Call it after the model, the Mamba policy and the split knobs are final:
    /// [`ManagerConfig::validate`] refuses a total whose split disagrees with
    /// `device_tokens`. The TOML and JSON readers call it.
    ///
    /// # Errors
    /// As [`ManagerConfig::hybrid_split`].
    pub fn apply_total_bytes(&mut self) -> Result<Option<crate::split::HybridSplit>> {
        let split = self.hybrid_split()?;
        if let Some(s) = split {
            self.device_tokens = s.kv_tokens;
        }
        Ok(split)
    }

    /// Reads a `.toml` or `.json` file (by extension; anything else is read as TOML).
    ///
    /// # Errors
    /// [`ManagerError::Io`] or [`ManagerError::Config`].
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ManagerError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        if path.extension().is_some_and(|e| e == "json") {
            Self::from_json_str(&text)
        } else {
            Self::from_toml_str(&text)
        }
    }

    /// Pages in the device pool.
    pub fn device_pages(&self) -> usize {
        self.device_tokens
            .checked_div(self.model.page_size)
            .unwrap_or(0)
    }

    /// Checks that the configuration is possible: non-zero sizes, pool page counts the
    /// allocators can address, and every byte count the manager derives (modeled page and pool
    /// bytes, simulated pool bytes) representable without wrapping.
    ///
    /// # Errors
    /// [`ManagerError::FeatureOff`] for a Redis store in a build without the `redis` feature;
    /// [`ManagerError::Config`] with the first impossible value.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ManagerError::Config(m));
        self.model.validate()?;
        let p = self.model.page_size;
        if self.device_tokens < p {
            return bad(format!(
                "device pool of {} tokens is smaller than one page of {p} tokens",
                self.device_tokens
            ));
        }
        self.check_pool("device", self.device_pages())?;
        if self.max_rows == 0 || self.max_rows > u32::MAX as usize {
            return bad(format!(
                "max_rows must be in 1..={} (got {})",
                u32::MAX,
                self.max_rows
            ));
        }
        if self.sim_geometry.layers == 0 || self.sim_geometry.bytes_per_token_per_layer == 0 {
            return bad(
                "the simulated geometry needs at least 1 layer and 1 byte per token".into(),
            );
        }
        if let CacheKind::HiCache(h) = &self.cache {
            h.validate(p)?;
            self.check_pool("host", h.host_tokens / p)?;
            if let Some(s) = &h.storage {
                s.validate(p, h.host_tokens)?;
            }
        }
        if let Some(s) = self.hybrid_split()?
            && s.kv_tokens != self.device_tokens
        {
            return bad(format!(
                "device_tokens = {} but pools.total_bytes splits to a KV pool of {} tokens \
                 (leave device_tokens out, or call ManagerConfig::apply_total_bytes)",
                self.device_tokens, s.kv_tokens
            ));
        }
        self.pools()?;
        if let (Some(p), None) = (self.mamba_policy, self.mamba_policy_kind()) {
            return bad(format!(
                "mamba_policy = {:?} is set but the model has no Mamba layer (M in layer_pattern)",
                p.name()
            ));
        }
        if self.event_capacity == 0 {
            return bad("the KV event buffer must hold at least one event (event_capacity)".into());
        }
        if self.event_page_keys {
            if !self.events {
                return bad("event_page_keys = true needs events = true".into());
            }
            if !matches!(&self.cache, CacheKind::HiCache(h) if h.storage.is_some()) {
                return bad(
                    "event_page_keys = true needs a [cache.storage] section: its model_id and \
                     the KV layout seed the page keys, as the storage tier keys its pages"
                        .into(),
                );
            }
        }
        if let Some(s) = &self.sessions {
            if s.max_held_tokens > self.device_tokens {
                return bad(format!(
                    "sessions may hold {} tokens but the device pool has only {}",
                    s.max_held_tokens, self.device_tokens
                ));
            }
            if s.per_session_cap_tokens == 0 {
                return bad("per-session cap must be positive".into());
            }
            if let Some(w) = s.max_held_window_pages {
                match self.pools()?.swa {
                    None => {
                        return bad(format!(
                            "sessions.max_held_window_pages = {w} is set but the model has no \
                             sliding-window layer"
                        ));
                    }
                    Some(pool) if w > pool.pages => {
                        return bad(format!(
                            "sessions may hold {w} window pages but the SWA pool has only {}",
                            pool.pages
                        ));
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(())
    }

    /// The device pools this configuration derives: the full-attention KV pool of
    /// [`ManagerConfig::device_pages`] pages, and for a hybrid model the SWA KV pool and the
    /// Mamba slot pool from their budgets ([`PoolBudgets`]; a budget left out is the
    /// full-attention pool's bytes; under `pools.total_bytes` the Mamba budget is the split's,
    /// [`ManagerConfig::hybrid_split`]). Counts come from checked arithmetic.
    ///
    /// # Errors
    /// [`ManagerError::Config`] for an invalid geometry, a budget for a pool the model does not
    /// have, a budget that fits no page or fewer than 2 Mamba slots, or a count that overflows
    /// or that a pool cannot address; the errors of [`ManagerConfig::hybrid_split`].
    pub fn pools(&self) -> Result<Pools> {
        self.model.validate()?;
        let m = &self.model;
        let n = m.layer_counts();
        let pages = u64::try_from(self.device_pages()).unwrap_or(u64::MAX);
        let full_budget = m.page_bytes().checked_mul(pages).ok_or_else(|| {
            ManagerError::Config("the device pool overflows a 64-bit byte count".into())
        })?;
        let full = crate::geometry::paged_pool(
            "full-attention",
            full_budget,
            m.kv_bytes_per_token(),
            m.page_size,
        )?;
        let budget = |given: Option<u64>, name: &str, has: bool, layer: &str| match (given, has) {
            (Some(b), false) => Err(ManagerError::Config(format!(
                "pools.{name} = {b} is set but the model has no {layer} layer"
            ))),
            (b, _) => Ok(b.unwrap_or(full.bytes)),
        };
        let swa_budget = budget(
            self.pools.swa_bytes,
            "swa_bytes",
            n.sliding_window > 0,
            "sliding-window",
        )?;
        let mamba_budget = match self.hybrid_split()? {
            Some(s) => s.mamba_bytes,
            None => budget(self.pools.mamba_bytes, "mamba_bytes", n.mamba > 0, "Mamba")?,
        };
        let swa = if n.sliding_window > 0 {
            let per_token = m.checked_swa_bytes_per_token().ok_or_else(|| {
                ManagerError::Config("SWA bytes per token overflow a 64-bit byte count".into())
            })?;
            Some(crate::geometry::paged_pool(
                "SWA",
                swa_budget,
                per_token,
                m.page_size,
            )?)
        } else {
            None
        };
        let mamba = if n.mamba > 0 {
            let slot = m.checked_mamba_slot_bytes().ok_or_else(|| {
                ManagerError::Config("a Mamba slot overflows a 64-bit byte count".into())
            })?;
            Some(crate::geometry::slot_pool(mamba_budget, slot)?)
        } else {
            None
        };
        Ok(Pools {
            full,
            swa,
            sliding_window: m.sliding_window.filter(|_| n.sliding_window > 0),
            mamba,
        })
    }

    /// The effective Mamba policy of a model with Mamba layers (`None` without any):
    /// [`ManagerConfig::mamba_policy`], Marconi when left out.
    pub fn mamba_policy_kind(&self) -> Option<MambaPolicyKind> {
        (self.model.layer_counts().mamba > 0).then(|| self.mamba_policy.unwrap_or_default())
    }

    /// The radix cache's Mamba policy for this configuration (`None` without Mamba layers).
    /// Marconi's parameters come from the geometry: the slot bytes, the full-attention KV bytes
    /// per token, and the FLOP curve of [`ModelGeometry::prefill_flops`] (exact for a model
    /// without sliding-window layers: linear plus quadratic attention terms); the rest are
    /// [`radixkv_radix::MarconiParams`]'s defaults.
    ///
    /// # Errors
    /// [`ManagerError::Config`] for a policy on a model without Mamba layers, and for Marconi
    /// on a model without `[model.compute]` (it weighs states by the FLOPs they save; the
    /// factory refuses to build such a cache, while [`ManagerConfig::validate`] accepts the
    /// description).
    pub fn radix_mamba_policy(&self) -> Result<Option<radixkv_radix::MambaPolicy>> {
        use radixkv_radix::{FlopCurve, MambaPolicy, MarconiParams};
        let Some(kind) = self.mamba_policy_kind() else {
            return match self.mamba_policy {
                Some(p) => Err(ManagerError::Config(format!(
                    "mamba_policy = {:?} is set but the model has no Mamba layer (M in \
                     layer_pattern)",
                    p.name()
                ))),
                None => Ok(None),
            };
        };
        Ok(Some(match kind {
            MambaPolicyKind::Sglang => MambaPolicy::Sglang,
            MambaPolicyKind::Marconi => {
                let m = &self.model;
                let (Some(f1), Some(f2)) = (m.prefill_flops(1), m.prefill_flops(2)) else {
                    return Err(ManagerError::Config(
                        "mamba_policy = \"marconi\" weighs states by the prefill FLOPs they \
                         save, but the model has no [model.compute] (add it, or choose \
                         mamba_policy = \"sglang\")"
                            .into(),
                    ));
                };
                // F(L) = a·L + b·L² through F(1) = a + b and F(2) = 2a + 4b.
                let (f1, f2) = (f1 as f64, f2 as f64);
                let per_token_sq = ((f2 - 2.0 * f1) / 2.0).max(0.0);
                let slot_bytes = m.checked_mamba_slot_bytes().ok_or_else(|| {
                    ManagerError::Config("a Mamba slot overflows a 64-bit byte count".into())
                })?;
                let params = MarconiParams {
                    flops: FlopCurve {
                        per_token: f1 - per_token_sq,
                        per_token_sq,
                    },
                    slot_bytes,
                    kv_bytes_per_token: m.kv_bytes_per_token(),
                    ..MarconiParams::default()
                };
                params
                    .validate()
                    .map_err(|e| ManagerError::Config(format!("mamba_policy: {e}")))?;
                MambaPolicy::Marconi(params)
            }
        }))
    }

    /// Checks a pool of `pages` pages: addressable by the page allocators (32-bit page ids),
    /// its modeled bytes (every transfer count is at most a pool's worth per step) and, for
    /// HiCache, its simulated bytes fit.
    fn check_pool(&self, tier: &str, pages: usize) -> Result<()> {
        let bad = |m: String| Err(ManagerError::Config(m));
        if pages > u32::MAX as usize {
            return bad(format!(
                "the {tier} pool of {pages} pages is more than the {} pages a pool can address",
                u32::MAX
            ));
        }
        if self.model.checked_pool_bytes(pages).is_none() {
            return bad(format!(
                "the {tier} pool of {pages} pages of {} modeled bytes overflows a 64-bit byte count",
                self.model.page_bytes()
            ));
        }
        let sim = &self.sim_geometry;
        let sim_bytes = (sim.layers as usize)
            .checked_mul(sim.bytes_per_token_per_layer as usize)
            .and_then(|b| b.checked_mul(self.model.page_size))
            .and_then(|b| b.checked_mul(pages));
        if matches!(self.cache, CacheKind::HiCache(_)) && sim_bytes.is_none() {
            return bad(format!(
                "the simulated {tier} pool of {pages} pages overflows the address space"
            ));
        }
        Ok(())
    }

    /// A short label of the cache configuration (`radix-lru`, `hicache-lru+4x`, ...).
    pub fn label(&self) -> String {
        let mut s = match &self.cache {
            CacheKind::Disabled => return "disabled".into(),
            CacheKind::Radix => match self.mamba_policy_kind() {
                Some(p) => format!("radix-{}+mamba-{}", self.eviction.0.name(), p.name()),
                None => format!("radix-{}", self.eviction.0.name()),
            },
            CacheKind::HiCache(h) => {
                let policies = match h.eviction {
                    Some(Eviction(p)) if p != self.eviction.0 => {
                        format!("{}/{}", self.eviction.0.name(), p.name())
                    }
                    _ => self.eviction.0.name().to_string(),
                };
                format!(
                    "hicache-{policies}-{}+host{}",
                    h.write_policy.short_name(),
                    human_tokens(h.host_tokens)
                )
            }
        };
        if self.sessions.is_some() {
            s.push_str("+sessions");
        }
        s
    }
}

/// `1048576` → `1M`, `4096` → `4K`.
pub fn human_tokens(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_roundtrip_and_validation() {
        let text = r#"
            device_tokens = 65536
            eviction = "sieve"
            [model]
            page_size = 32
            [cache]
            kind = "hicache"
            host_tokens = 262144
            write_policy = "write_through_selective:2"
        "#;
        let c = ManagerConfig::from_toml_str(text).unwrap();
        assert_eq!(c.eviction.0, PolicyKind::Sieve);
        assert_eq!(c.device_pages(), 2048);
        assert!(matches!(c.cache, CacheKind::HiCache(ref h) if h.host_tokens == 262144));
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(ManagerConfig::from_json_str(&json).unwrap(), c);
    }

    #[test]
    fn host_tier_takes_its_own_eviction_policy() {
        let text = r#"
            eviction = "lru"
            [cache]
            kind = "hicache"
            host_tokens = 262144
            write_policy = "write_back"
            eviction = "reuse"
        "#;
        let c = ManagerConfig::from_toml_str(text).unwrap();
        let CacheKind::HiCache(h) = &c.cache else {
            panic!("not a hicache config: {c:?}");
        };
        assert_eq!(h.eviction, Some(Eviction(PolicyKind::Reuse)));
        assert_eq!(c.label(), "hicache-lru/reuse-wb+host256K");
        let same = ManagerConfig {
            cache: CacheKind::HiCache(h.clone().eviction(PolicyKind::Lru)),
            ..c.clone()
        };
        assert_eq!(same.label(), "hicache-lru-wb+host256K");
        let bad = text.replace("\"reuse\"", "\"nope\"");
        assert!(ManagerConfig::from_toml_str(&bad).is_err());
    }

    #[test]
    fn impossible_configs_are_rejected() {
        let mut c = ManagerConfig::default();
        c.model.page_size = 0;
        assert!(c.validate().unwrap_err().to_string().contains("page size"));
        let c = ManagerConfig {
            cache: CacheKind::HiCache(HostTier::ratio(8, 1.0)),
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("host pool"));
        assert!(ManagerConfig::from_toml_str("eviction = \"nope\"").is_err());
        assert!(ManagerConfig::from_toml_str("bogus_field = 1").is_err());
    }

    #[test]
    fn geometry_products_that_overflow_are_refused() {
        // The review's case: each factor is valid, their product wraps.
        let mut c = ManagerConfig::default();
        c.model.kv_bytes_per_token_per_layer = u64::MAX;
        c.model.layers = u32::MAX;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("overflows a 64-bit byte count"), "{e}");
        assert_eq!(c.model.page_bytes(), u64::MAX, "saturates, never wraps");
        // A page fits, the device pool of such pages does not.
        let mut c = ManagerConfig::default();
        c.model.kv_bytes_per_token_per_layer = 1 << 40;
        c.model.layers = 1;
        c.model.page_size = 1 << 10;
        c.device_tokens = 1 << 24;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("device pool") && e.contains("overflows"), "{e}");
        // The same for the host tier.
        let mut c = ManagerConfig::default();
        c.model.kv_bytes_per_token_per_layer = 1 << 30;
        c.device_tokens = 1 << 10;
        c.cache = CacheKind::HiCache(HostTier::ratio(1 << 30, 1.0));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("host pool") && e.contains("overflows"), "{e}");
        // Page counts past what a pool can address, and row counts.
        let c = ManagerConfig {
            device_tokens: usize::MAX,
            ..Default::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("can address"), "{e}");
        let c = ManagerConfig {
            max_rows: u32::MAX as usize + 1,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("max_rows"));
        // A simulated pool that overflows the address space.
        let mut c = ManagerConfig {
            cache: CacheKind::HiCache(HostTier::ratio(1 << 20, 4.0)),
            ..Default::default()
        };
        c.sim_geometry.bytes_per_token_per_layer = u32::MAX;
        c.sim_geometry.layers = u32::MAX;
        c.model.page_size = 1 << 16;
        c.model.kv_bytes_per_token_per_layer = 1;
        c.model.layers = 1;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("simulated"), "{e}");
        ManagerConfig::default().validate().unwrap();
    }

    #[test]
    fn the_storage_section_is_read_checked_and_refused_where_not_built() {
        let toml = r#"
            [cache]
            kind = "hicache"
            host_tokens = 262144
            [cache.storage]
            model_id = "llama-3-8b"
            backend = { type = "file", dir = "kv-store", capacity_tokens = 33554432, sync = "pages" }
            prefetch_threshold_tokens = 512
            prefetch_cap_tokens = 65536
            stop = { policy = "wait_complete" }
            op_timeout_ms = 750
        "#;
        let c = ManagerConfig::from_toml_str(toml).unwrap();
        let CacheKind::HiCache(h) = &c.cache else {
            panic!("{c:?}")
        };
        let want = StorageTier::new(
            StorageBackendKind::File {
                dir: "kv-store".into(),
                capacity_tokens: Some(1 << 25),
                sync: radixkv_hicache::storage::FileSync::Pages,
            },
            "llama-3-8b",
        )
        .prefetch_threshold_tokens(512)
        .prefetch_cap_tokens(Some(65536))
        .stop(PrefetchStopPolicy::WaitComplete {})
        .op_timeout_ms(750);
        assert_eq!(h.storage.as_ref(), Some(&want));
        // Both formats round-trip it.
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(ManagerConfig::from_json_str(&json).unwrap(), c);
        assert_eq!(
            ManagerConfig::from_toml_str(&toml::to_string(&c).unwrap()).unwrap(),
            c
        );
        // Defaults: SGLang's timeout policy, a 256-token threshold, half the host pool.
        let c = ManagerConfig::from_json_str(
            r#"{"cache": {"kind": "hicache", "host_tokens": 262144,
                "storage": {"model_id": "m", "backend": {"type": "memory"}}}}"#,
        )
        .unwrap();
        let CacheKind::HiCache(h) = &c.cache else {
            panic!("{c:?}")
        };
        let s = h.storage.as_ref().unwrap();
        assert_eq!(s.prefetch_threshold_tokens, 256);
        assert_eq!(s.prefetch_cap_tokens, None);
        assert_eq!(
            s.stop.to_hicache(),
            radixkv_hicache::PrefetchStop::default()
        );
        // Each bad value is a config error naming its field.
        let refused = |from: &str, to: &str, says: &str| {
            let e = ManagerConfig::from_toml_str(&toml.replace(from, to)).unwrap_err();
            assert!(
                matches!(e, ManagerError::Config(_)) && e.to_string().contains(says),
                "{from} -> {to}: {e}"
            );
        };
        refused("\"llama-3-8b\"", "\" \"", "model_id");
        refused("model_id = \"llama-3-8b\"", "", "model_id");
        refused(
            "prefetch_threshold_tokens = 512",
            "prefetch_threshold_tokens = 0",
            "prefetch_threshold_tokens",
        );
        refused(
            "prefetch_cap_tokens = 65536",
            "prefetch_cap_tokens = 300000",
            "prefetch_cap_tokens",
        );
        refused(
            "prefetch_cap_tokens = 65536",
            "prefetch_cap_tokens = 8",
            "prefetch_cap_tokens",
        );
        refused(
            "capacity_tokens = 33554432",
            "capacity_tokens = 15",
            "capacity_tokens",
        );
        refused("dir = \"kv-store\"", "dir = \"\"", "dir");
        refused("op_timeout_ms = 750", "op_timeout_ms = 0", "op_timeout_ms");
        refused("op_timeout_ms = 750", "concurrency = 0", "concurrency");
        refused("op_timeout_ms = 750", "batch_pages = 0", "batch_pages");
        refused(
            "op_timeout_ms = 750",
            "worker_threads = 0",
            "worker_threads",
        );
        refused(
            "{ policy = \"wait_complete\" }",
            "{ policy = \"timeout\", base_ms = 40000 }",
            "max_ms",
        );
        refused(
            "{ policy = \"wait_complete\" }",
            "{ policy = \"wait_complete\", base_ms = 1 }",
            "unknown field",
        );
        refused(
            "{ policy = \"wait_complete\" }",
            "\"sometimes\"",
            "PrefetchStopPolicy",
        );
        refused("sync = \"pages\"", "sync = \"always\"", "unknown variant");
        // A capacity means nothing to Redis (its server's maxmemory decides): refused.
        refused(
            "type = \"file\", dir = \"kv-store\", capacity_tokens = 33554432, sync = \"pages\"",
            "type = \"redis\", url = \"redis://cache:6379\", capacity_tokens = 1024",
            "unknown field",
        );
        let redis = toml.replace(
            "type = \"file\", dir = \"kv-store\", capacity_tokens = 33554432, sync = \"pages\"",
            "type = \"redis\", url = \"redis://cache:6379\", cluster = true",
        );
        match ManagerConfig::from_toml_str(&redis) {
            Ok(c) if cfg!(feature = "redis") => {
                let CacheKind::HiCache(h) = &c.cache else {
                    panic!("{c:?}")
                };
                assert!(matches!(
                    h.storage.as_ref().unwrap().backend,
                    StorageBackendKind::Redis { cluster: true, .. }
                ));
            }
            Err(e @ ManagerError::FeatureOff { .. }) if !cfg!(feature = "redis") => {
                assert!(e.to_string().contains("`redis` cargo feature"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        // Built under Mamba and sliding-window layers too (the stored pages carry the states
        // and the window KV).
        for preset in ["jamba-like", "gemma-like"] {
            let text = format!("[model]\npreset = \"{preset}\"\n{toml}");
            let c = ManagerConfig::from_toml_str(&text).unwrap_or_else(|e| panic!("{preset}: {e}"));
            c.validate().unwrap();
        }
        let mut tier = HostTier::ratio(1 << 20, 4.0);
        tier.storage = Some(StorageTier::new(
            StorageBackendKind::Memory {
                capacity_tokens: None,
            },
            "m",
        ));
        let mut c = ManagerConfig {
            cache: CacheKind::HiCache(tier),
            ..Default::default()
        };
        c.model = Preset::JambaLike.geometry();
        c.validate().unwrap();
        // Without one, a host tier serializes without a storage key.
        let c = ManagerConfig {
            cache: CacheKind::HiCache(HostTier::ratio(1 << 20, 4.0)),
            ..Default::default()
        };
        c.validate().unwrap();
        assert!(!serde_json::to_string(&c).unwrap().contains("storage"));
    }

    #[test]
    fn one_spelling_for_the_kind_and_plain_string_write_policies() {
        let c = ManagerConfig::from_toml_str(
            "[cache]\nkind = \"hicache\"\nhost_tokens = 65536\nwrite_policy = \"write_back\"\n",
        )
        .unwrap();
        let CacheKind::HiCache(h) = &c.cache else {
            panic!("{c:?}")
        };
        assert_eq!(h.write_policy, WritePolicy::WriteBack);
        // Defaults: write-through, page-first host layout, the tier's load-back minimum.
        let c = ManagerConfig::from_toml_str("[cache]\nkind = \"hicache\"\nhost_tokens = 65536\n")
            .unwrap();
        assert_eq!(
            c.cache,
            CacheKind::HiCache(HostTier {
                host_tokens: 65536,
                ..HostTier::ratio(0, 0.0)
            })
        );
        let CacheKind::HiCache(h) = &c.cache else {
            panic!("{c:?}")
        };
        assert_eq!(h.write_policy, WritePolicy::WriteThrough);
        assert_eq!(h.host_layout, HostLayout::PageFirst);
        // Selective: the bare name means 2 hits, `:N` names them; JSON writes the same string.
        for (name, hits) in [
            ("write_through_selective", 2),
            ("write_through_selective:5", 5),
        ] {
            let t = format!(
                "[cache]\nkind = \"hicache\"\nhost_tokens = 65536\nwrite_policy = \"{name}\"\n"
            );
            let c = ManagerConfig::from_toml_str(&t).unwrap();
            let CacheKind::HiCache(h) = &c.cache else {
                panic!("{c:?}")
            };
            assert_eq!(h.write_policy, WritePolicy::WriteThroughSelective { hits });
            let json = serde_json::to_string(&c).unwrap();
            assert!(
                json.contains(&format!("\"write_through_selective:{hits}\"")),
                "{json}"
            );
        }
        // The old spellings are refused, not silently mapped.
        for old in [
            "[cache]\nkind = \"hi_cache\"\nhost_tokens = 65536\n",
            "[cache]\nkind = \"hicache\"\nhost_tokens = 65536\nwrite_policy = { policy = \"write_back\" }\n",
            "[cache]\nkind = \"hicache\"\nhost_tokens = 65536\nwrite_policy = \"sometimes\"\n",
            "[cache]\nkind = \"hicache\"\nhost_tokens = 65536\nwrite_policy = \"write_through_selective:0\"\n",
        ] {
            assert!(
                matches!(
                    ManagerConfig::from_toml_str(old),
                    Err(ManagerError::Config(_))
                ),
                "{old}"
            );
        }
    }

    #[test]
    fn every_host_tier_knob_is_read_and_checked() {
        let text = r#"
            [model]
            page_size = 16
            [cache]
            kind = "hicache"
            host_tokens = 65536
            max_pending_ops = 8
            host_layout = "layer_first"
            load_back_min_tokens = 64
            load_back_quota_tokens = 4096
        "#;
        let c = ManagerConfig::from_toml_str(text).unwrap();
        let CacheKind::HiCache(h) = &c.cache else {
            panic!("{c:?}")
        };
        assert_eq!(
            *h,
            HostTier::ratio(65536, 1.0)
                .max_pending_ops(8)
                .host_layout(HostLayout::LayerFirst)
                .load_back_min_tokens(64)
                .load_back_quota_tokens(Some(4096))
        );
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(ManagerConfig::from_json_str(&json).unwrap(), c);
        let refused = |from: &str, to: &str, says: &str| {
            let e = ManagerConfig::from_toml_str(&text.replace(from, to)).unwrap_err();
            assert!(
                matches!(e, ManagerError::Config(_)) && e.to_string().contains(says),
                "{from} -> {to}: {e}"
            );
        };
        refused(
            "max_pending_ops = 8",
            "max_pending_ops = 0",
            "pending transfer",
        );
        refused(
            "\"layer_first\"",
            "\"diagonal\"",
            "expected `layer_first` or `page_first`",
        );
        // The quota must admit at least one load: a page, and the minimum in whole pages.
        refused(
            "load_back_quota_tokens = 4096",
            "load_back_quota_tokens = 8",
            "load_back_quota",
        );
        refused(
            "load_back_quota_tokens = 4096",
            "load_back_quota_tokens = 63",
            "below 64",
        );
        let ok = text.replace(
            "load_back_quota_tokens = 4096",
            "load_back_quota_tokens = 64",
        );
        ManagerConfig::from_toml_str(&ok).unwrap();
    }

    #[test]
    fn the_example_parses_builds_and_is_the_readme_s() {
        let c = ManagerConfig::from_toml_str(EXAMPLE_TOML).unwrap();
        // The defaults its comments name are the defaults.
        let d = ManagerConfig::default();
        assert_eq!(c.device_tokens, d.device_tokens);
        assert_eq!(c.max_rows, d.max_rows);
        assert_eq!(c.eviction, d.eviction);
        assert_eq!(c.reserve_clip_tokens, d.reserve_clip_tokens);
        assert_eq!(c.event_capacity, d.event_capacity);
        assert_eq!(c.model, d.model);
        assert_eq!(c.sim_geometry, d.sim_geometry);
        assert_eq!(c.sessions, Some(SessionBudget::default()));
        let CacheKind::HiCache(h) = &c.cache else {
            panic!("the example configures a host tier: {c:?}")
        };
        let defaults = HostTier::ratio(0, 0.0);
        assert_eq!(h.write_policy, defaults.write_policy);
        assert_eq!(h.host_layout, defaults.host_layout);
        assert_eq!(h.max_pending_ops, defaults.max_pending_ops);
        assert!(c.events);
        let kv = crate::KvCacheManager::new(c).unwrap();
        assert_eq!(kv.accounting().total, 1 << 20);
        assert_eq!(kv.open_sessions(), 0);
        // Its storage section, uncommented, is valid as written (every value its default but
        // the model, the backend and the cap).
        let keys = [
            "[cache.storage]",
            "model_id",
            "backend",
            "prefetch_",
            "stop",
            "batch_pages",
            "concurrency",
            "op_timeout_ms",
            "worker_threads",
            "event_page_keys",
        ];
        let storage: String = EXAMPLE_TOML
            .lines()
            .map(|l| match l.strip_prefix("# ") {
                Some(k) if keys.iter().any(|p| k.starts_with(p)) => format!("{k}\n"),
                _ => format!("{l}\n"),
            })
            .collect();
        let c = ManagerConfig::from_toml_str(&storage).unwrap();
        let CacheKind::HiCache(h) = &c.cache else {
            panic!("{c:?}")
        };
        let s = h.storage.as_ref().expect("the example's storage section");
        assert_eq!(s.stop, PrefetchStopPolicy::default());
        assert_eq!(s.prefetch_threshold_tokens, 256);
        assert!(matches!(s.backend, StorageBackendKind::File { .. }));
        assert!(c.event_page_keys);
        let readme = include_str!("../../README.md");
        assert!(
            readme.contains(&format!("```toml\n{EXAMPLE_TOML}```")),
            "README.md must show scheduler_api/config.example.toml verbatim in a toml block"
        );
    }

    #[test]
    fn derived_pools_of_both_presets_match_hand_computed_sizes() {
        // Jamba-like, default budgets: 2^20 tokens / 16 = 65536 full-attention pages of
        // 4 layers × 4096 B × 16 tokens = 262144 B: 16 GiB. A Mamba slot is 28 layers ×
        // (49152 + 262144) B = 8716288 B; the default Mamba budget (the full pool's 16 GiB)
        // holds 17179869184 / 8716288 = 1971 slots (17179803648 B).
        let mut c = ManagerConfig::from_toml_str("[model]\npreset = \"jamba-like\"\n").unwrap();
        let p = c.pools().unwrap();
        assert_eq!(
            p.full,
            PagedPool {
                bytes_per_token: 16384,
                page_bytes: 262_144,
                pages: 65536,
                tokens: 1 << 20,
                bytes: 17_179_869_184,
            }
        );
        assert_eq!(p.swa, None);
        assert_eq!(p.sliding_window, None);
        assert_eq!(
            p.mamba,
            Some(SlotPool {
                slot_bytes: 8_716_288,
                slots: 1971,
                bytes: 17_179_803_648,
            })
        );
        assert_eq!(p.total_bytes(), 17_179_869_184 + 17_179_803_648);
        // A budget of 1 GiB: 123 slots.
        c.pools.mamba_bytes = Some(1 << 30);
        assert_eq!(c.pools().unwrap().mamba.unwrap().slots, 123);
        // Gemma-like: 8 global layers × 8192 B = 65536 B per token, pages of 1 MiB, 64 GiB.
        // 40 local layers × 8192 B = 327680 B per token, SWA pages of 5242880 B; the default
        // budget (64 GiB) holds 13107 of them (209712 tokens, 68718428160 B); 8 GiB 1638.
        let mut c = ManagerConfig::from_toml_str("[model]\npreset = \"gemma-like\"\n").unwrap();
        let p = c.pools().unwrap();
        assert_eq!(
            (
                p.full.bytes_per_token,
                p.full.page_bytes,
                p.full.pages,
                p.full.bytes
            ),
            (65536, 1_048_576, 65536, 68_719_476_736)
        );
        assert_eq!(
            p.swa,
            Some(PagedPool {
                bytes_per_token: 327_680,
                page_bytes: 5_242_880,
                pages: 13107,
                tokens: 209_712,
                bytes: 68_718_428_160,
            })
        );
        assert_eq!(p.sliding_window, Some(1024));
        assert_eq!(p.mamba, None);
        c.pools.swa_bytes = Some(8 << 30);
        assert_eq!(c.pools().unwrap().swa.unwrap().pages, 1638);
        // The dense default: the full-attention pool only, as before.
        let p = ManagerConfig::default().pools().unwrap();
        assert_eq!(
            (p.full.pages, p.full.bytes),
            (65536, 65536 * 16 * 32 * 4096)
        );
        assert!(p.swa.is_none() && p.mamba.is_none());
    }

    #[test]
    fn the_model_section_reads_presets_patterns_and_overrides() {
        // A preset with a key overridden; it serializes to every key and reads back the same.
        let c = ManagerConfig::from_toml_str(
            "[model]\npreset = \"gemma-like\"\npage_size = 32\nsliding_window = 512\n",
        )
        .unwrap();
        let mut want = Preset::GemmaLike.geometry();
        want.page_size = 32;
        want.sliding_window = Some(512);
        assert_eq!(c.model, want);
        let text = toml::to_string(&c).unwrap();
        assert!(text.contains("layer_pattern = \"SSSSSA\""), "{text}");
        assert!(!text.contains("preset"), "{text}");
        assert_eq!(ManagerConfig::from_toml_str(&text).unwrap(), c);
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(ManagerConfig::from_json_str(&json).unwrap(), c);
        // A pattern written out: the Jamba-like preset, without the FLOPs dimensions.
        let c = ManagerConfig::from_toml_str(
            r#"
            [model]
            layers = 32
            layer_pattern = "MMMMAMMM"
            kv_bytes_per_token_per_layer = 4096
            mamba_conv_state_bytes = 49152
            mamba_ssm_state_bytes = 262144
            [pools]
            mamba_bytes = 1073741824
            "#,
        )
        .unwrap();
        assert_eq!(
            c.model,
            ModelGeometry {
                compute: None,
                ..Preset::JambaLike.geometry()
            }
        );
        assert_eq!(c.pools().unwrap().mamba.unwrap().slots, 123);
        // The dense keys keep their meaning: every layer is full attention.
        let c = ManagerConfig::from_toml_str("[model]\nlayers = 8\n").unwrap();
        assert_eq!(c.model.layer_counts().attention, 8);
        assert_eq!(c.model.page_bytes(), 8 * 4096 * 16);
        // Refused: unknown presets and letters, and keys no layer uses.
        for (text, says) in [
            ("[model]\npreset = \"llama\"\n", "unknown variant"),
            (
                "[model]\nlayer_pattern = \"MAX\"\nlayers = 3\n",
                "unknown layer kind",
            ),
            ("[model]\nlayer_pattern = \"\"\n", "empty"),
            (
                "[model]\nsliding_window = 128\n",
                "no layer is a sliding-window",
            ),
            (
                "[model]\nmamba_ssm_state_bytes = 128\n",
                "no layer is a Mamba",
            ),
            (
                "[model]\nlayer_pattern = \"SSSSSA\"\n",
                "whole number of repeats",
            ),
            ("[pools]\nmamba_bytes = 1024\n", "no Mamba layer"),
            ("[pools]\nswa_bytes = 1024\n", "no sliding-window layer"),
            (
                "[model]\npreset = \"jamba-like\"\n[pools]\nmamba_bytes = 8716287\n",
                "fits no state slot of 8716288 bytes",
            ),
            (
                "[model]\npreset = \"jamba-like\"\n[pools]\nmamba_bytes = 17432575\n",
                "holds 1 state slot of 8716288 bytes; it needs at least 2",
            ),
            (
                "[model]\npreset = \"gemma-like\"\n[pools]\nswa_bytes = 5242879\n",
                "fits no page of 5242880 bytes",
            ),
            (
                "[model]\npreset = \"jamba-like\"\n[pools]\nmamba_bytes = 18446744073709551615\n",
                "slots a pool can address",
            ),
            ("[pools]\nbogus = 1\n", "unknown field"),
        ] {
            match ManagerConfig::from_toml_str(text) {
                Err(ManagerError::Config(m)) => assert!(m.contains(says), "{text}: {m}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn write_policy_names() {
        assert_eq!(
            WritePolicy::from_name("write_through_selective:3"),
            Some(WritePolicy::WriteThroughSelective { hits: 3 })
        );
        assert_eq!(
            WritePolicy::from_name("write-back"),
            Some(WritePolicy::WriteBack)
        );
        assert_eq!(WritePolicy::from_name("sometimes"), None);
    }

    #[test]
    fn a_total_budget_is_split_by_each_policys_rule() {
        use crate::split::SplitError;
        let jamba = "[model]\npreset = \"jamba-like\"\n";
        // Top-level keys come before the tables.
        let doc = |top: &str, pools: &str| format!("{top}{jamba}[pools]\n{pools}");
        let slot = Preset::JambaLike
            .geometry()
            .checked_mamba_slot_bytes()
            .unwrap();
        let total = 32u64 << 30;
        // The baseline: SGLang's 0.9 ratio.
        let c = ManagerConfig::from_toml_str(&doc(
            "mamba_policy = \"sglang\"\n",
            &format!("total_bytes = {total}\n"),
        ))
        .unwrap();
        let p = c.pools().unwrap();
        let slots = p.mamba.unwrap().slots as u64;
        assert_eq!(slots, ((total as f64 * 0.9 / 1.9) / slot as f64) as u64);
        assert_eq!(
            c.device_tokens,
            c.hybrid_split().unwrap().unwrap().kv_tokens
        );
        assert!(p.full.bytes + slots * slot <= total);
        assert!(total - p.full.bytes - slots * slot < c.model.page_bytes());
        // The default (Marconi): 4 slots per running request (max_rows, or the knob).
        let c = ManagerConfig::from_toml_str(&doc(
            "max_rows = 100\n",
            &format!("total_bytes = {total}\n"),
        ))
        .unwrap();
        assert_eq!(c.pools().unwrap().mamba.unwrap().slots, 400);
        let c = ManagerConfig::from_toml_str(&format!(
            "{jamba}[pools]\ntotal_bytes = {total}\nrunning_requests = 256\n"
        ))
        .unwrap();
        assert_eq!(c.pools().unwrap().mamba.unwrap().slots, 1024);
        let kv = c.pools().unwrap().full.bytes;
        assert_eq!(
            kv,
            (total - 1024 * slot) / c.model.page_bytes() * c.model.page_bytes()
        );
        // A JSON document splits the same way.
        let j = ManagerConfig::from_json_str(
            &serde_json::to_string(&serde_json::json!({
                "model": {"preset": "jamba-like"},
                "pools": {"total_bytes": total, "running_requests": 256}
            }))
            .unwrap(),
        )
        .unwrap();
        assert_eq!(j.device_tokens, c.device_tokens);
        // The configuration as printed (device_tokens with the total) reads back.
        let back = ManagerConfig::from_toml_str(&toml::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        // Refused, typed: a zero total, one too small for the running batch, and knobs that
        // do not belong.
        let e = ManagerConfig::from_toml_str(&format!("{jamba}[pools]\ntotal_bytes = 0\n"));
        assert!(
            matches!(e, Err(ManagerError::Split(SplitError::ZeroTotal))),
            "{e:?}"
        );
        let e =
            ManagerConfig::from_toml_str(&format!("{jamba}[pools]\ntotal_bytes = 1073741824\n"));
        assert!(
            matches!(
                e,
                Err(ManagerError::Split(SplitError::TooSmall {
                    slots: 2048,
                    ..
                }))
            ),
            "512 rows × 4 slots do not fit 1 GiB: {e:?}"
        );
        let e = ManagerConfig::from_toml_str(&format!(
            "{jamba}[pools]\ntotal_bytes = {}\nrunning_requests = {}\n",
            i64::MAX,
            i64::MAX
        ));
        assert!(
            matches!(e, Err(ManagerError::Split(SplitError::Overflow { .. }))),
            "{e:?}"
        );
        for (text, says) in [
            (
                doc(
                    "device_tokens = 4096\n",
                    &format!("total_bytes = {total}\n"),
                ),
                "both given, and the split",
            ),
            (
                format!("{jamba}[pools]\ntotal_bytes = {total}\nmamba_bytes = {total}\n"),
                "both given",
            ),
            (
                format!("[pools]\ntotal_bytes = {total}\n"),
                "no Mamba layer",
            ),
            (
                format!("{jamba}[pools]\nrunning_requests = 8\n"),
                "which is not given",
            ),
            (
                format!("{jamba}[pools]\ntotal_bytes = {total}\nmamba_full_memory_ratio = 0.5\n"),
                "the sglang policy's split",
            ),
            (
                doc(
                    "mamba_policy = \"sglang\"\n",
                    &format!("total_bytes = {total}\nrunning_requests = 8\n"),
                ),
                "sizes the Marconi split",
            ),
        ] {
            match ManagerConfig::from_toml_str(&text) {
                Err(ManagerError::Config(m)) => assert!(m.contains(says), "{text}: {m}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        let gemma = format!("[model]\npreset = \"gemma-like\"\n[pools]\ntotal_bytes = {total}\n");
        assert!(matches!(
            ManagerConfig::from_toml_str(&gemma),
            Err(ManagerError::Config(_))
        ));
        // A configuration built in code whose device_tokens disagrees with the split is
        // refused until the split is applied.
        let mut c = ManagerConfig {
            model: Preset::JambaLike.geometry(),
            ..Default::default()
        };
        c.pools.total_bytes = Some(total);
        assert!(matches!(c.validate(), Err(ManagerError::Config(m)) if m.contains("splits to")));
        let s = c.apply_total_bytes().unwrap().unwrap();
        assert_eq!(s.mamba_slots, 4 * 512);
        c.validate().unwrap();
    }
}
