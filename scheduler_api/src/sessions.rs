//! Sessions as the manager drives them: the manager-owned simulated clock that the session
//! layer reads its idle TTLs from, and [`ManagedCache`] for `SessionAwareCache` over any
//! managed cache (radix or HiCache).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use radixkv_radix::RequestKv;
use radixkv_session::{Clock, CloseOutcome, SessionAwareCache};

use crate::error::Result;
use crate::factory::{ManagedCache, StepLoads, StepTransfers};

/// The manager's clock in milliseconds. It moves only when the scheduler says so
/// ([`crate::KvCacheManager::set_time_ms`]); a replay sets it to the simulated time, a live
/// scheduler to its own monotonic time. Clones share the same time.
#[derive(Clone, Debug, Default)]
pub struct SimClock(Arc<AtomicU64>);

impl SimClock {
    /// Sets the time; a time earlier than the current one is ignored (the clock is monotonic).
    pub fn set_ms(&self, ms: u64) {
        self.0.fetch_max(ms, Ordering::Relaxed);
    }

    /// The current time.
    pub fn now_ms(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Clock for SimClock {
    fn now(&self) -> u64 {
        self.now_ms()
    }
}

impl<C: ManagedCache> ManagedCache for SessionAwareCache<C, SimClock> {
    fn on_begin_step(&mut self) -> Result<StepLoads> {
        self.inner_mut().on_begin_step()
    }

    fn starts_loads(&self) -> bool {
        self.inner().starts_loads()
    }

    fn on_end_step(&mut self) -> Result<StepTransfers> {
        let t = self.inner_mut().on_end_step()?;
        self.reap()?;
        Ok(t)
    }

    fn drain(&mut self) -> Result<StepTransfers> {
        self.inner_mut().drain()
    }

    fn wait_transfers(&self) {
        self.inner().wait_transfers();
    }

    fn prepare_room(&mut self, tokens: usize) -> bool {
        self.inner_mut().prepare_room(tokens)
    }

    fn evicted_at_acks(&self) -> u64 {
        self.inner().evicted_at_acks()
    }

    fn open_session(&mut self, id: u64, streaming: bool, ttl_ms: Option<u64>) -> Result<()> {
        Ok(self.open(id, streaming, ttl_ms)?)
    }

    fn has_session(&self, id: u64) -> bool {
        self.session_info(id).is_some()
    }

    fn session_turn_ok(&self, req: &RequestKv) -> bool {
        self.validate_turn(req).is_ok()
    }

    fn close_session(&mut self, id: u64) -> Result<CloseOutcome> {
        Ok(self.close(id)?)
    }

    fn demote_session(&mut self, id: u64) -> Result<bool> {
        Ok(self.demote(id)?)
    }

    fn reap_sessions(&mut self) -> Result<()> {
        self.reap()?;
        Ok(())
    }

    fn open_sessions(&self) -> usize {
        SessionAwareCache::open_sessions(self)
    }

    fn held_sessions(&self) -> usize {
        self.held_rows()
    }

    fn host_tokens(&self) -> usize {
        self.inner().host_tokens()
    }

    fn mamba_accounting(&self) -> Option<radixkv_radix::ComponentAccounting> {
        self.inner().mamba_accounting()
    }

    fn evict_mamba_states(&mut self, n: usize) -> usize {
        self.inner_mut().evict_mamba_states(n)
    }

    fn mamba_stats(&self) -> Option<radixkv_radix::MambaStats> {
        self.inner().mamba_stats()
    }

    fn swa_accounting(&self) -> Option<radixkv_radix::ComponentAccounting> {
        self.inner().swa_accounting()
    }

    fn swa_window(&self) -> Option<usize> {
        self.inner().swa_window()
    }

    fn swa_available_locked(
        &mut self,
        node: Option<radixkv_radix::NodeId>,
    ) -> Result<Option<usize>> {
        self.inner_mut().swa_available_locked(node)
    }

    fn session_held_window_pages(&self) -> usize {
        self.held_window_pages()
    }
    fn storage_prefetch(&mut self, rid: u64, req: &RequestKv) -> bool {
        self.inner_mut().storage_prefetch(rid, req)
    }

    fn check_prefetch(&mut self, rid: u64) -> Result<radixkv_hicache::PrefetchStatus> {
        self.inner_mut().check_prefetch(rid)
    }

    fn abort_prefetch(&mut self, rid: u64) -> Result<bool> {
        self.inner_mut().abort_prefetch(rid)
    }

    fn tier_stats(&self) -> Option<radixkv_hicache::HiCacheStats> {
        self.inner().tier_stats()
    }

    fn store_errors(&self) -> u64 {
        self.inner().store_errors()
    }

    fn has_storage(&self) -> bool {
        self.inner().has_storage()
    }

    fn wait_storage(&mut self) -> Result<()> {
        self.inner_mut().wait_storage()
    }
}
