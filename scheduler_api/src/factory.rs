//! The one place where a cache is built from a [`ManagerConfig`], and the small seam
//! ([`ManagedCache`]) through which tiered and session caches report what the manager cannot
//! see through [`PrefixCache`] alone.
//!
//! Wiring a new cache kind means: implement [`ManagedCache`] for it (every method has a default
//! that is right for a device-only cache) and construct it in [`build_cache`].

use radixkv_radix::{PrefixCache, RadixCache, RadixConfig};

use crate::config::{CacheKind, DeviceBackend, ManagerConfig};
use crate::error::{ManagerError, Result};

/// Host↔device traffic of one step, as reported by a tiered cache.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct StepTransfers {
    /// Pages loaded host → device.
    pub pages_loaded: u64,
    /// Bytes loaded host → device.
    pub bytes_loaded: u64,
    /// Pages written device → host.
    pub pages_written: u64,
    /// Bytes written device → host.
    pub bytes_written: u64,
    /// Pages fetched storage → host.
    pub pages_prefetched: u64,
    /// Bytes fetched storage → host.
    pub bytes_prefetched: u64,
}

impl StepTransfers {
    /// Adds another step's traffic.
    pub fn add(&mut self, o: &StepTransfers) {
        self.pages_loaded += o.pages_loaded;
        self.bytes_loaded += o.bytes_loaded;
        self.pages_written += o.pages_written;
        self.bytes_written += o.bytes_written;
        self.pages_prefetched += o.pages_prefetched;
        self.bytes_prefetched += o.bytes_prefetched;
    }
}

/// A [`PrefixCache`] as the manager drives it: the trait plus step hooks and tier reports.
///
/// The defaults describe a device-only cache (no loads, no transfers, no sessions); tiered and
/// session caches override what applies to them.
pub trait ManagedCache: PrefixCache + Send {
    /// Called at the start of a scheduler step: start queued loads. Returns the bytes that the
    /// step's forward must wait for, layer by layer.
    fn on_begin_step(&mut self) -> u64 {
        0
    }
    /// Called at the end of a step: apply completion acks; returns the step's traffic.
    fn on_end_step(&mut self) -> StepTransfers {
        StepTransfers::default()
    }
    /// Closes a session, releasing what it holds. A cache without sessions holds nothing.
    ///
    /// # Errors
    /// Session-layer errors.
    fn close_session(&mut self, _id: u64) -> Result<()> {
        Ok(())
    }
    /// Tokens resident on the host tier.
    fn host_tokens(&self) -> usize {
        0
    }
    /// Sessions currently holding KV.
    fn held_sessions(&self) -> usize {
        0
    }
}

impl ManagedCache for RadixCache {}

/// Builds the cache a configuration describes.
///
/// # Errors
/// [`ManagerError::Config`] for an impossible configuration, [`ManagerError::NotWired`] for a
/// kind whose crate this build does not include.
pub fn build_cache(cfg: &ManagerConfig) -> Result<Box<dyn ManagedCache>> {
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
    if cfg.sessions.is_some() {
        return Err(ManagerError::NotWired {
            kind: "sessions",
            needs: "radixkv-session",
        });
    }
    let radix = RadixConfig {
        page_size: cfg.model.page_size,
        total_pages: cfg.device_pages(),
        max_rows: cfg.max_rows,
        policy: cfg.eviction.0,
        events: cfg.events,
        disabled: matches!(cfg.cache, CacheKind::Disabled),
    };
    match &cfg.cache {
        CacheKind::Disabled | CacheKind::Radix => Ok(Box::new(RadixCache::new(radix)?)),
        CacheKind::HiCache(_) => Err(ManagerError::NotWired {
            kind: "hi_cache",
            needs: "radixkv-hicache",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HostTier, SessionBudget};

    #[test]
    fn builds_radix_and_names_missing_crates() {
        let cfg = ManagerConfig {
            device_tokens: 4096,
            ..Default::default()
        };
        let c = build_cache(&cfg).unwrap();
        assert_eq!(c.accounting().total, 4096);
        let hi = ManagerConfig {
            cache: CacheKind::HiCache(HostTier::ratio(4096, 2.0)),
            ..cfg.clone()
        };
        let e = build_cache(&hi).err().unwrap().to_string();
        assert!(e.contains("radixkv-hicache"), "{e}");
        let s = ManagerConfig {
            sessions: Some(SessionBudget {
                max_held_tokens: 1024,
                ..Default::default()
            }),
            ..cfg
        };
        let e = build_cache(&s).err().unwrap().to_string();
        assert!(e.contains("radixkv-session"), "{e}");
    }
}
