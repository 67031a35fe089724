//! The one place where a cache is built from a [`ManagerConfig`], and the small seam
//! ([`ManagedCache`]) through which tiered and session caches report what the manager cannot
//! see through [`PrefixCache`] alone.
//!
//! Wiring a new cache kind means: implement [`ManagedCache`] for it (every method has a default
//! that is right for a device-only cache without sessions) and construct it in
//! [`build_cache`]. Built here today:
//!
//! | config                          | cache                                              |
//! |---------------------------------|----------------------------------------------------|
//! | `disabled`, `radix`             | `RadixCache`                                       |
//! | `radix` + sessions              | `SessionAwareCache<RadixCache, SimClock>`          |
//! | `hicache`                       | [`Tiered`]: `HiRadixCache<HostSim>`                |
//! | `hicache` + sessions            | `SessionAwareCache<Tiered, SimClock>`              |
//!
//! The CUDA backend and the hybrid (Mamba / SWA) pools are still [`ManagerError::NotWired`];
//! the storage tier (L3) exists in no crate yet and is [`ManagerError::NotImplemented`].

use std::sync::Arc;

use radixkv_radix::{CacheError, PrefixCache, RadixCache, RadixConfig, RequestKv};
use radixkv_session::{CloseOutcome, SessionAwareCache, SessionConfig};

use crate::config::{CacheKind, DeviceBackend, ManagerConfig};
use crate::error::{ManagerError, Result};
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
    /// Called at the end of a step: applies completion acks (releasing the locks that
    /// protected transferring nodes) and returns the step's traffic.
    ///
    /// # Errors
    /// A failed copy that could not be repaired.
    fn on_end_step(&mut self) -> Result<StepTransfers> {
        Ok(StepTransfers::default())
    }
    /// Starts everything queued, waits for every transfer and applies its ack (end of a
    /// replay, shutdown). Returns the traffic not reported by a step yet.
    ///
    /// # Errors
    /// A failed copy.
    fn drain(&mut self) -> Result<StepTransfers> {
        Ok(StepTransfers::default())
    }
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
}

impl ManagedCache for RadixCache {}

/// Builds the cache a configuration describes, with a fresh session clock at 0.
///
/// # Errors
/// As [`build_cache_with_clock`].
pub fn build_cache(cfg: &ManagerConfig) -> Result<Box<dyn ManagedCache>> {
    build_cache_with_clock(cfg, SimClock::default())
}

/// Builds the cache a configuration describes; sessions read their idle TTLs from `clock`
/// (milliseconds).
///
/// # Errors
/// [`ManagerError::Config`] for an impossible configuration, including a device pool whose
/// tables this machine cannot allocate; [`ManagerError::NotImplemented`] for a storage tier;
/// [`ManagerError::NotWired`] for the CUDA backend and hybrid pools; [`ManagerError::Tier`]
/// when the simulated backend or the host pool cannot be allocated.
pub fn build_cache_with_clock(
    cfg: &ManagerConfig,
    clock: SimClock,
) -> Result<Box<dyn ManagedCache>> {
    cfg.validate()?;
    if let DeviceBackend::Cuda { .. } = cfg.backend {
        return Err(ManagerError::NotWired {
            kind: "cuda backend",
            needs: "radixkv-hicache (feature `cuda`)",
        });
    }
    if cfg.model.mamba.is_some() || cfg.model.swa.is_some() {
        return Err(ManagerError::NotWired {
            kind: "hybrid pools (mamba / swa)",
            needs: "radixkv-hicache",
        });
    }
    let radix = RadixConfig {
        page_size: cfg.model.page_size,
        total_pages: cfg.device_pages(),
        max_rows: cfg.max_rows,
        policy: cfg.eviction.0,
        events: cfg.events,
        event_capacity: cfg.event_capacity,
        disabled: matches!(cfg.cache, CacheKind::Disabled),
    };
    let sessions = cfg.sessions.as_ref().map(|b| SessionConfig {
        max_held_tokens: b.max_held_tokens,
        max_session_tokens: b.per_session_cap_tokens,
        idle_ttl: Some(b.idle_ttl_ms),
    });
    // The radix pools' only failure is an impossible size: say so as a config error.
    let device = |radix| {
        RadixCache::new(radix).map_err(|e| match e {
            CacheError::Config(m) => ManagerError::Config(m),
            e => e.into(),
        })
    };
    Ok(match (&cfg.cache, sessions) {
        (CacheKind::Disabled | CacheKind::Radix, None) => Box::new(device(radix)?),
        (CacheKind::Disabled | CacheKind::Radix, Some(s)) => {
            Box::new(SessionAwareCache::with_clock(device(radix)?, s, clock))
        }
        (CacheKind::HiCache(h), None) => Box::new(Tiered::new(cfg, h, radix)?),
        (CacheKind::HiCache(h), Some(s)) => Box::new(SessionAwareCache::with_clock(
            Tiered::new(cfg, h, radix)?,
            s,
            clock,
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HostTier, MambaPool, SessionBudget, WritePolicy};

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
    fn cuda_and_hybrid_pools_name_their_crate() {
        let cuda = ManagerConfig {
            backend: DeviceBackend::Cuda { device: 0 },
            ..base()
        };
        let e = build_cache(&cuda).err().unwrap().to_string();
        assert!(e.contains("cuda"), "{e}");
        let mut hybrid = base();
        hybrid.model.mamba = Some(MambaPool {
            slots: 4,
            bytes_per_slot: 64,
        });
        let e = build_cache(&hybrid).err().unwrap().to_string();
        assert!(e.contains("radixkv-hicache"), "{e}");
    }
}
