//! Time source of the session layer. Idle TTLs and LRU order read a [`Clock`] instead of the
//! wall clock so that tests (and replays) drive time explicitly.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A monotonic tick source. The unit is the caller's choice; TTLs are in the same unit.
pub trait Clock {
    /// The current tick. Must never go backwards.
    fn now(&self) -> u64;
}

/// Milliseconds since the clock was created, from [`Instant`].
#[derive(Debug, Clone)]
pub struct SystemClock {
    start: Instant,
}

impl SystemClock {
    /// A clock starting at tick 0 now.
    pub fn new() -> Self {
        SystemClock {
            start: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// A clock that only moves when told to. Clones share the same time, so a test keeps one clone
/// and hands the other to the cache.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    ticks: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at tick `start`.
    pub fn new(start: u64) -> Self {
        ManualClock {
            ticks: Arc::new(AtomicU64::new(start)),
        }
    }

    /// Moves time forward by `ticks` (saturating).
    pub fn advance(&self, ticks: u64) {
        let _ = self
            .ticks
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                Some(t.saturating_add(ticks))
            });
    }
}

impl Clock for ManualClock {
    fn now(&self) -> u64 {
        self.ticks.load(Ordering::Relaxed)
    }
}
