//! [`KvCacheManager`]: the facade a continuous-batching scheduler embeds.
//!
//! The scheduler drives one lifecycle per request and never touches the tree, the pools or a
//! tier controller directly:
//!
//! ```text
//! arrive ─► admit ─► extend ─► chunk_done ─┬─► decode ─┬─► finish
//!   ▲         │  (match, temporary lock,   │  (per step)├─► abort
//!   │         │   budget, lock, load-back) └────────────┴─► retract ─┐
//!   │         └─► Wait (no room / no row): try again next step       │
//!   └───────────────────────────────────────────────────────────────┘
//! ```
//!
//! A token's KV counts as computed (committed) once the forward of the step that allocated it
//! is over, which the manager learns from the next call on that request (`chunk_done`, the next
//! `decode`, `finish`). Each step is bracketed by [`KvCacheManager::begin_step`] (starts queued
//! loads, opens a `tracing` span) and [`KvCacheManager::end_step`] (drains acks, KV events and
//! transfer counts; in debug builds, audits every invariant).
//!
//! Tracing, all at `debug` level (`trace` for admission waits): a `kv_request` span per request
//! from `arrive` to `finish` / `abort` (fields `id`, the handle; `engine_id`,
//! [`Request::engine_id`]; `prompt_tokens`, `max_new_tokens`, `session`; `outcome` recorded at
//! the end) with `admitted` and `retracted` events inside it, and a `kv_step` span per step from
//! `begin_step` to `end_step` (fields `step`, `load_bytes`) ending with a `step ended` event.
//! Nothing is recorded per decode token.

use std::ops::Range;
use std::sync::Arc;

use ahash::HashSet;
use radixkv_radix::{
    CacheError, ComponentAccounting, EventBuffer, FinishKind, KvEvent, KvEventBatch,
    MambaCheckpoint, MambaCow, MambaTrack, Namespace, PageHasher, PageHashes, PageId,
    PoolAccounting, RadixKey, RequestKv, SessionTag, TokenId,
};

use crate::CloseOutcome;
use crate::builder::ManagerBuilder;
use crate::config::ManagerConfig;
use crate::error::{ManagerError, Result};
use crate::factory::{
    GivenBackend, LayerWait, ManagedCache, StepLoads, StepTransfers, build_cache_with_store,
};
use crate::metrics::Metrics;
use crate::request::StepLoadSet;
pub use crate::request::{
    Admission, Admitted, MambaCheckpoints, NeverReason, ReqId, Request, StepHandle, StepSummary,
    TokenSource, TokenSourceError, TokenStorage, WaitReason,
};
use crate::sessions::SimClock;
use crate::table::Table;
use radixkv_hicache::storage::StorageBackend;
use radixkv_hicache::{HostSim, PrefetchStatus};

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Phase {
    Waiting,
    Running,
}

#[derive(Debug)]
struct Tracked {
    kv: RequestKv,
    phase: Phase,
    prompt_len: usize,
    max_new: usize,
    /// Tokens reserved at admission and not yet allocated.
    reserved: usize,
    admitted_before: bool,
    /// Token slots the request's row covers as of the last allocation (0: unknown). Decode
    /// tokens below it are bookkeeping only (see [`ManagedCache::page_granular`]).
    row_capacity: usize,
    /// The step whose forward computes the request's latest allocation.
    alloc_step: u64,
    /// The engine's id for the request ([`Request::engine_id`]).
    engine_id: Option<String>,
    /// Models with sliding-window layers: the SWA pages the request may own at its peak, as
    /// admission counted them (see [`swa_peak_pages`]); 0 otherwise.
    swa_peak: usize,
    /// A storage prefetch started at arrival has not ended yet.
    prefetching: bool,
    /// A lazy request's prompt ([`Request::lazy`]): while it waits, `kv.key.tokens` is empty
    /// unless `materialised`.
    source: Option<Arc<dyn TokenSource>>,
    /// A lazy request's tokens are in `kv.key.tokens` (always true of an owned request).
    materialised: bool,
    /// A lazy request's decoded tokens while it waits unmaterialised after a retraction
    /// (they are in no source).
    decoded: Vec<TokenId>,
    /// What this request counts in the manager's token storage totals.
    share: TokenShare,
    /// Tokens the request's prefetch loaded from the storage tier.
    storage_loaded: usize,
    /// The request's `kv_request` span, from `arrive` to `finish` / `abort` (closed when the
    /// entry is dropped). Disabled spans cost nothing but this field.
    span: tracing::Span,
}

impl Tracked {
    /// A lifecycle error about this request, naming it by the engine's id.
    #[cold]
    fn lifecycle(&self, id: ReqId, what: &'static str) -> ManagerError {
        ManagerError::Lifecycle {
            id: id.0,
            engine_id: self.engine_id.clone(),
            what,
        }
    }
}

/// The scheduler facade over one prefix cache. See the module docs for the lifecycle.
///
/// ```
/// use radixkv_scheduler_api::{Admission, KvCacheManager, Request};
///
/// let mut kv = KvCacheManager::builder().device_tokens(4096).page_size(4).build()?;
/// let r = kv.arrive(Request::new((0..10).collect()).max_new_tokens(4))?;
/// // Step 1: form the batch, start the step (and its loads), run the forward, commit.
/// let Admission::Ready(a) = kv.admit(r)? else { unreachable!() };
/// kv.extend(r, a.extend_tokens)?;
/// let step = kv.begin_step();
/// for layer in 0..kv.config().model.layers {
///     step.wait_layer(layer)?; // then run this layer of the forward
/// }
/// kv.chunk_done(r)?;
/// kv.end_step(step)?;
/// // Step 2: one decode token.
/// kv.decode(r, 99)?;
/// let step = kv.begin_step();
/// // ... forward ...
/// kv.finish(r)?;
/// kv.end_step(step)?;
/// assert_eq!(kv.accounting().request_owned, 0);
/// # Ok::<(), radixkv_scheduler_api::ManagerError>(())
/// ```
pub struct KvCacheManager {
    cache: Box<dyn ManagedCache>,
    cfg: ManagerConfig,
    requests: Table<Tracked>,
    reserved_total: usize,
    /// Sum of the running requests' `swa_peak`: the SWA pages admission promised them.
    swa_peak_total: usize,
    waiting: usize,
    running: usize,
    metrics: Metrics,
    /// Events drained from the cache at step ends, held (bounded) until `take_events`.
    events: EventBuffer,
    /// Events handed out so far: with [`Self::events_dropped`] beside it, the sequence number
    /// of the next one (see [`KvEventBatch`]).
    events_handed_out: u64,
    step: u64,
    check_every_step: bool,
    clock: SimClock,
    /// The cache's [`ManagedCache::page_granular`], read once.
    page_granular: bool,
    /// Sessions this manager opened and has not closed.
    sessions_open: HashSet<u64>,
    /// Per open session, when a turn of it last arrived or finished (a sequence number).
    session_use: ahash::HashMap<u64, u64>,
    use_seq: u64,
    /// A failure to start loads (in `begin_step`, which cannot fail, or in an admission
    /// inside an open step), reported by the next `end_step`.
    step_error: Option<ManagerError>,
    /// A step is open (between `begin_step` and `end_step`): the one numbered `step`.
    step_open: bool,
    /// The load set of the last step that loaded, kept for the next one: a set no handle
    /// holds any more is emptied and reused, so loading steps cost no allocation.
    step_loads: Option<Arc<StepLoadSet>>,
    /// The open step's handle shares `step_loads`: the step loads, and an admission made
    /// meanwhile joins it. A step that began with nothing to load shares no set (its handle
    /// and the manager then move no reference count: most steps), and an admission that
    /// needs a load waits for the next step instead ([`WaitReason::OpenStepLoadsNothing`]).
    step_shares_loads: bool,
    /// Ended steps of a cache with a host tier that moved no bytes either way, not yet in
    /// the `step_load_bytes` / `step_write_bytes` histograms (`metrics` adds them).
    idle_tier_steps: u64,
    /// The cache's [`ManagedCache::starts_loads`], read once.
    starts_loads: bool,
    /// The last step ended: its forward is over.
    ended_step: u64,
    /// The sliding window in tokens when the cache has the SWA component (read once).
    swa_window: Option<usize>,
    /// The cache has a storage tier (read once).
    has_storage: bool,
    /// Token storage of the waiting requests, the sum of their shares' bytes.
    waiting_token_bytes: usize,
    /// Token storage of the running requests, the sum of their shares' bytes.
    running_token_bytes: usize,
    /// Waiting requests holding their prompt's tokens (owned ones, and lazy ones
    /// materialised).
    waiting_materialised: usize,
    /// Of those, lazy ones.
    waiting_lazy_materialised: usize,
    /// The lazy waiting request whose tokens the last admission attempt materialised (its
    /// table slot): the next lazy request materialised drops them.
    materialised_slot: Option<u64>,
}

// The threading model (crate docs): the manager moves to the one thread or task that owns it,
// and a step's handle may be waited on from the thread that runs the forward.
const _: () = {
    const fn send<T: Send>() {}
    const fn send_sync<T: Send + Sync>() {}
    send::<KvCacheManager>();
    send_sync::<StepHandle>();
};

impl std::fmt::Debug for KvCacheManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCacheManager")
            .field("config", &self.cfg.label())
            .field("requests", &self.requests.len())
            .field("accounting", &self.cache.accounting())
            .finish()
    }
}

impl KvCacheManager {
    /// A builder with the default configuration.
    pub fn builder() -> ManagerBuilder {
        ManagerBuilder::default()
    }

    /// A manager for `cfg`, its host tier (if any) over the built-in backend `cfg.backend`
    /// names; [`ManagerBuilder::device_backend`] gives it the engine's own.
    ///
    /// # Errors
    /// As [`build_cache_with_clock`](crate::factory::build_cache_with_clock):
    /// [`ManagerError::Config`], [`ManagerError::Backend`], [`ManagerError::Tier`],
    /// [`ManagerError::FeatureOff`] (CUDA or Redis in a build without them), and for a storage
    /// tier [`ManagerError::Storage`].
    pub fn new(cfg: ManagerConfig) -> Result<Self> {
        Self::build(cfg, None, None)
    }

    /// A manager for `cfg`, its host tier over `backend` when one is given.
    pub(crate) fn build(
        cfg: ManagerConfig,
        backend: Option<&GivenBackend>,
        store: Option<Arc<dyn StorageBackend>>,
    ) -> Result<Self> {
        let clock = SimClock::default();
        let cache = match backend {
            Some(b) => b.build_cache(&cfg, clock.clone(), store)?,
            None => build_cache_with_store::<HostSim>(&cfg, clock.clone(), None, store)?,
        };
        if cfg.release_cached_prompts && !cache.takes_windowed_keys() {
            return Err(ManagerError::Config(RELEASE_REFUSED.into()));
        }
        let has_storage = cache.has_storage();
        let page_granular = cache.page_granular();
        let starts_loads = cache.starts_loads();
        let swa_window = cache.swa_window();
        let events = EventBuffer::new(cfg.event_capacity)?;
        Ok(KvCacheManager {
            cache,
            cfg,
            requests: Table::default(),
            reserved_total: 0,
            swa_peak_total: 0,
            waiting: 0,
            running: 0,
            metrics: Metrics::default(),
            events,
            events_handed_out: 0,
            step: 0,
            check_every_step: cfg!(debug_assertions),
            clock,
            page_granular,
            sessions_open: HashSet::default(),
            session_use: Default::default(),
            use_seq: 0,
            step_error: None,
            step_open: false,
            step_loads: None,
            step_shares_loads: false,
            idle_tier_steps: 0,
            starts_loads,
            ended_step: 0,
            swa_window,
            has_storage,
            waiting_token_bytes: 0,
            running_token_bytes: 0,
            waiting_materialised: 0,
            waiting_lazy_materialised: 0,
            materialised_slot: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ManagerConfig {
        &self.cfg
    }

    /// Sets the manager's clock (milliseconds, monotonic: an earlier time is ignored). Session
    /// idle TTLs are measured on it; a replay sets the simulated time, a live scheduler its
    /// own monotonic time.
    pub fn set_time_ms(&mut self, ms: u64) {
        self.clock.set_ms(ms);
    }

    /// The manager's clock (milliseconds).
    pub fn time_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Turns the per-step invariant audit on or off (on by default in debug builds only).
    pub fn set_check_every_step(&mut self, on: bool) {
        self.check_every_step = on;
    }

    /// The hasher of the match hashes requests may carry ([`Request::page_hashes`],
    /// [`TokenSource::fill_page_hashes`]; see [`radixkv_radix::page_hash`]). Its seed is
    /// drawn at random when the manager is built: hashes are for this manager only.
    pub fn page_hasher(&self) -> PageHasher {
        self.cache.page_hasher()
    }

    /// Where every device token is.
    pub fn accounting(&self) -> PoolAccounting {
        self.cache.accounting()
    }

    /// Tokens available for admission: free + evictable − reserved (never negative).
    pub fn available_tokens(&self) -> usize {
        self.cache
            .available_tokens()
            .saturating_sub(self.reserved_total)
    }

    /// Tokens reserved by admitted requests and not yet allocated.
    pub fn reserved_tokens(&self) -> usize {
        self.reserved_total
    }

    /// Counters and current gauges.
    pub fn metrics(&self) -> Metrics {
        let mut m = self.metrics;
        m.histograms
            .step_load_bytes
            .observe_zeros(self.idle_tier_steps);
        m.histograms
            .step_write_bytes
            .observe_zeros(self.idle_tier_steps);
        m.gauges.set_pool(&self.cache.accounting());
        m.gauges.reserved_tokens = self.reserved_total;
        m.gauges.host_tokens = self.cache.host_tokens();
        m.gauges.waiting_requests = self.waiting;
        m.gauges.running_requests = self.running;
        m.gauges.held_sessions = self.cache.held_sessions();
        m.counters.kv_events_dropped = self.events_dropped();
        if let Some(a) = self.cache.mamba_accounting() {
            m.gauges.set_mamba(&a);
        }
        if let Some(st) = self.cache.mamba_stats() {
            m.counters.set_mamba(&st);
        }
        if let Some(a) = self.cache.swa_accounting() {
            m.gauges.set_swa(&a);
        }
        if self.has_storage
            && let Some(st) = self.cache.tier_stats()
        {
            m.counters.set_storage(&st, self.cache.store_errors());
        }
        m
    }

    /// True when the cache has a storage tier (L3) under its host tier.
    pub fn has_storage(&self) -> bool {
        self.has_storage
    }

    /// Waits until every storage-tier job in flight (backups, prefetch lookups and loads) has
    /// completed and applies them, as steps would: for shutdown, tests and the end of a
    /// replay, never on a serving scheduler's step path (it blocks on the store). Prefetches
    /// are not ended: the next admission of their requests ends them. Without a storage tier
    /// it does nothing.
    ///
    /// # Errors
    /// As [`Self::end_step`]'s tier errors.
    pub fn wait_storage(&mut self) -> Result<()> {
        self.cache.wait_storage()
    }

    /// Where every page of the sliding-window KV pool is (free, owned by running requests,
    /// cached and evictable, cached and locked); `None` on a model without sliding-window
    /// layers.
    pub fn swa_accounting(&self) -> Option<ComponentAccounting> {
        self.cache.swa_accounting()
    }

    /// Where every Mamba state slot is (free, held by running requests, cached and evictable,
    /// cached and locked); `None` on a model without Mamba layers.
    pub fn mamba_accounting(&self) -> Option<ComponentAccounting> {
        self.cache.mamba_accounting()
    }

    /// The Mamba state slot a running request holds (the forward pass reads and writes its
    /// recurrent state there); `None` on a model without Mamba layers and for a waiting
    /// request.
    ///
    /// # Errors
    /// Unknown request.
    pub fn mamba_slot(&self, id: ReqId) -> Result<Option<u32>> {
        self.requests
            .get(id.0)
            .map(|t| t.kv.mamba_slot)
            .ok_or(ManagerError::UnknownRequest(id.0))
    }

    /// The copy on write a running request's first forward still needs (the cached state
    /// `src` into the request's slot `dst`), as [`Admitted::mamba_cow`] said; `None` once a
    /// chunk is done (the copy has run by then), on a miss, and on other models.
    ///
    /// # Errors
    /// Unknown request.
    pub fn mamba_cow(&self, id: ReqId) -> Result<Option<MambaCow>> {
        self.requests
            .get(id.0)
            .map(|t| t.kv.mamba_cow)
            .ok_or(ManagerError::UnknownRequest(id.0))
    }

    /// The checkpoints a running request's forward pass takes (branch points; see
    /// `radixkv_radix::mamba_policy`): at each
    /// position the engine copies the request's running state into the checkpoint's slot. The
    /// cache stores them as the KV reaching them is inserted; the list shrinks as they are.
    /// Empty on other models and for a waiting request.
    ///
    /// # Errors
    /// Unknown request.
    pub fn mamba_checkpoints(&self, id: ReqId) -> Result<&[MambaCheckpoint]> {
        self.requests
            .get(id.0)
            .map(|t| t.kv.mamba_checkpoints.as_slice())
            .ok_or(ManagerError::UnknownRequest(id.0))
    }

    /// A running request's tracking slot ([`Admitted::mamba_track`]; `None` on a model without
    /// Mamba layers, for a waiting request, and for one that got no spare slot). Its `pos` is
    /// the page boundary whose state `slot` holds: the cached prefix at admission, then the
    /// computed length floored to a page after each [`KvCacheManager::chunk_done`] (the cache
    /// moves it when it inserts the chunk; decode steps do not move it, the finish floors the
    /// final computed length itself). A `chunk_done` that hands the tracked state to the tree
    /// (chunk-end states: the baseline policy, and Marconi's default) replaces the slot with a
    /// fresh one (or `None`), so the engine reads this again after every `chunk_done`;
    /// whatever `pos` says, each forward step (chunk or
    /// decode) must leave in `slot` the state at the last page boundary at or below the
    /// request's computed length (see [`MambaTrack`]); `pos` is what the cache will assume.
    ///
    /// # Errors
    /// Unknown request.
    pub fn mamba_track(&self, id: ReqId) -> Result<Option<MambaTrack>> {
        self.requests
            .get(id.0)
            .map(|t| t.kv.mamba_track)
            .ok_or(ManagerError::UnknownRequest(id.0))
    }

    /// Drains the KV events collected at step ends (empty unless events are enabled).
    ///
    /// Events wait here, at most [`ManagerConfig::event_capacity`] of them, until drained;
    /// drain them every step. Past the capacity new events are dropped and counted
    /// ([`KvCacheManager::events_dropped`], `radixkv_kv_events_dropped_total`): when that count
    /// moved since the last drain, the stream has a gap and the router must resync its view of
    /// this cache (see [`EventBuffer`]).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        // Without events the cache is built without its buffer and this one is never fed:
        // there is nothing to take, and no number to use up (a scheduler drains every step).
        if !self.cfg.events {
            return Vec::new();
        }
        self.take_numbered_events().1
    }

    /// Drains the KV events as one batch for a publisher: stamped with the wall clock and
    /// numbered so that a router sees a gap in the sequence exactly when events were dropped
    /// (see [`KvEventBatch`]). Numbering is shared with [`Self::take_events`], so the two can
    /// be mixed without opening a gap.
    pub fn take_event_batch(&mut self) -> KvEventBatch {
        let (seq, events) = self.take_numbered_events();
        let timestamp_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        KvEventBatch {
            timestamp_ms,
            seq,
            events,
        }
    }

    /// The events to hand out and the sequence number of the first: every event handed out or
    /// dropped before it has used up a number.
    fn take_numbered_events(&mut self) -> (u64, Vec<KvEvent>) {
        let mut out = self.events.take();
        // Events since the last step end are handed over now, not held: no bound applies.
        out.extend(self.take_cache_events());
        let seq = self.events_handed_out.saturating_add(self.events_dropped());
        self.events_handed_out = self.events_handed_out.saturating_add(out.len() as u64);
        (seq, out)
    }

    /// The events the cache recorded since the last take, counted in `kv_events`.
    fn take_cache_events(&mut self) -> Vec<KvEvent> {
        let ev = self.cache.take_events();
        self.metrics.counters.kv_events += ev.len() as u64;
        ev
    }

    /// With events on, moves the cache's events into the bounded buffer (step end, reset).
    fn buffer_cache_events(&mut self) {
        if self.cfg.events {
            let ev = self.take_cache_events();
            self.events.extend(ev);
        }
    }

    /// KV events dropped since the manager was built, by its own buffer or the cache's,
    /// because nobody drained them in time.
    pub fn events_dropped(&self) -> u64 {
        self.events.dropped() + self.cache.events_dropped()
    }

    /// Audits the cache, its pools and the manager's own bookkeeping.
    ///
    /// # Errors
    /// [`ManagerError::Invariant`] naming the first violated invariant.
    pub fn check_invariants(&self) -> Result<()> {
        self.cache.check_invariants()?;
        let a = self.cache.accounting();
        if !a.balanced() {
            return Err(inv(format!("pool accounting does not balance: {a:?}")));
        }
        let reserved: usize = self.requests.values().map(|t| t.reserved).sum();
        if reserved != self.reserved_total {
            return Err(inv(format!(
                "reservations sum to {reserved} but the total says {}",
                self.reserved_total
            )));
        }
        let mut swa_peak = 0;
        for t in self.requests.values() {
            self.cache.check_request(&t.kv)?;
            if t.phase == Phase::Running {
                swa_peak += t.swa_peak;
                let own = own_swa_pages(&t.kv, self.cfg.model.page_size.max(1));
                if own > t.swa_peak {
                    return Err(inv(format!(
                        "a running request owns {own} SWA pages, past its admitted peak of {}",
                        t.swa_peak
                    )));
                }
            }
        }
        // Waiting token storage: every request's share is current and the totals sum them;
        // of the lazy requests, only the one tried last holds its tokens while it waits
        // (besides turns holding lent session KV, which keep theirs).
        let (mut waiting, mut running, mut materialised, mut lazy, mut lazy_unlent) =
            (0, 0, 0, 0, 0);
        for t in self.requests.values() {
            let share = TokenShare::of(t);
            if share != t.share {
                return Err(inv(format!(
                    "a request's token storage share is {:?}, counted as {:?}",
                    share, t.share
                )));
            }
            if share.running {
                running += share.bytes;
            } else {
                waiting += share.bytes;
            }
            materialised += usize::from(share.materialised);
            if share.materialised && share.lazy {
                lazy += 1;
                lazy_unlent += usize::from(!t.kv.kv_lent);
            }
        }
        let totals = (
            self.waiting_token_bytes,
            self.running_token_bytes,
            self.waiting_materialised,
            self.waiting_lazy_materialised,
        );
        if (waiting, running, materialised, lazy) != totals || lazy_unlent > 1 {
            return Err(inv(format!(
                "token storage: {waiting} bytes waiting, {running} running, {materialised} \
                 waiting materialised ({lazy} lazy, {lazy_unlent} without lent KV) but the \
                 totals say {totals:?}"
            )));
        }
        if swa_peak != self.swa_peak_total {
            return Err(inv(format!(
                "SWA peaks sum to {swa_peak} but the total says {}",
                self.swa_peak_total
            )));
        }
        let running = self
            .requests
            .values()
            .filter(|t| t.phase == Phase::Running)
            .count();
        if running != self.running || self.requests.len() != self.running + self.waiting {
            return Err(inv(format!(
                "request counts drifted: {running} running of {} (gauges {} / {})",
                self.requests.len(),
                self.running,
                self.waiting
            )));
        }
        Ok(())
    }

    // ----- lifecycle -----

    /// Registers a request; it waits until [`Self::admit`] succeeds.
    ///
    /// A request with owned tokens ([`Request::new`]) keeps them while it waits; a lazy one
    /// ([`Request::lazy`], [`Request::shared`]) holds none: its tokens are filled from its
    /// [`TokenSource`] by [`Self::admit`] (see [`TokenStorage`] for what waiting requests
    /// hold). With a storage tier, arrival starts the request's prefetch, which needs its
    /// tokens: a lazy request's are filled for it and dropped before `arrive` returns.
    ///
    /// # Errors
    /// [`ManagerError::Lifecycle`] for an empty prompt or for a request with both tokens and
    /// a source; [`ManagerError::SessionsOff`] for a request tagged with a session on a
    /// manager without sessions; [`ManagerError::TokenSource`] when a storage tier's prefetch
    /// needs a lazy request's tokens and its source fails (the request is not registered).
    pub fn arrive(&mut self, req: Request) -> Result<ReqId> {
        // A drained backlog gives its records' room back (before any handle is named).
        self.requests.compact();
        let prompt_len = req.prompt_len();
        let refuse = |engine_id, what| ManagerError::Lifecycle {
            id: self.requests.next_handle(),
            engine_id,
            what,
        };
        if prompt_len == 0 {
            return Err(refuse(req.engine_id, "empty prompt"));
        }
        if req.source.is_some() && !req.tokens.is_empty() {
            return Err(refuse(req.engine_id, "both tokens and a token source"));
        }
        if req.source.is_some() && !req.page_hashes.is_empty() {
            return Err(refuse(
                req.engine_id,
                "page hashes with a token source (the source gives them)",
            ));
        }
        if let Err(what) = check_page_hashes(
            &self.cache.page_hasher(),
            &req.namespace,
            &req.tokens,
            &req.page_hashes,
        ) {
            return Err(refuse(req.engine_id, what));
        }
        let source = req.source;
        let mut tokens = req.tokens;
        // A storage tier's prefetch (below) needs a lazy request's tokens: filled first, so
        // that a failing source leaves nothing registered (no session opened either).
        let mut prefetch_tokens = None;
        if self.has_storage
            && let Some(src) = &source
        {
            let id = self.requests.next_handle();
            prefetch_tokens = Some(fill_tokens(src.as_ref(), &[], 0, id, &req.engine_id)?);
        }
        if source.is_none() {
            // Decoded tokens are appended one by one on the hot path: make room once, here
            // (free when the caller already left room). Only a hint: a request never holds
            // more tokens than the device pool, and a reservation the allocator refuses is
            // just skipped. (A lazy request gets its room when it is materialised.)
            let _ = tokens.try_reserve(req.max_new_tokens.min(self.cfg.device_tokens));
        }
        let mut kv = RequestKv::new(RadixKey::with_namespace(tokens, req.namespace));
        kv.page_hashes = req.page_hashes;
        kv.max_prefix_len = req.max_prefix_len;
        kv.priority = req.priority;
        // Only a session layer gives the tag a meaning: without one, a tag is refused rather
        // than ignored. A session is opened (streaming) the first time one of its requests
        // arrives. A turn of a session whose close is still deferred (the cache knows it, this
        // manager closed it) runs untagged: the session is on its way out, and a turn arriving
        // after the close completes opens it afresh.
        if let (None, Some(session)) = (&self.cfg.sessions, req.session) {
            return Err(ManagerError::SessionsOff { session });
        }
        let closing = |sid| !self.sessions_open.contains(&sid) && self.cache.has_session(sid);
        if let Some(sid) = req.session.filter(|&s| !closing(s)) {
            if !self.sessions_open.contains(&sid) {
                self.cache.open_session(sid, true, None)?;
                self.sessions_open.insert(sid);
            }
            self.use_seq += 1;
            self.session_use.insert(sid, self.use_seq);
            kv.session = Some(SessionTag {
                id: sid,
                streaming: true,
            });
        }
        // Closed when the request leaves the table (finish, abort): its duration is the
        // request's whole stay, waits and retractions included.
        let span = tracing::debug_span!(
            "kv_request",
            id = %ReqId(self.requests.next_handle()),
            engine_id = req.engine_id.as_deref(),
            prompt_tokens = prompt_len,
            max_new_tokens = req.max_new_tokens,
            session = kv.session.map(|s| s.id),
            outcome = tracing::field::Empty,
        );
        let id = self.requests.insert(Tracked {
            kv,
            phase: Phase::Waiting,
            prompt_len,
            max_new: req.max_new_tokens,
            reserved: 0,
            admitted_before: false,
            row_capacity: 0,
            alloc_step: 0,
            engine_id: req.engine_id,
            swa_peak: 0,
            prefetching: false,
            storage_loaded: 0,
            materialised: source.is_none(),
            source,
            decoded: Vec::new(),
            share: TokenShare::default(),
            span,
        });
        self.waiting += 1;
        self.metrics.counters.arrived += 1;
        // With a storage tier: the prefix past what the device and host hold is looked up in
        // the store now, and loaded into the host tier in the background while it waits. (A
        // lazy request's tokens are lent to the lookup and dropped again.)
        if self.has_storage
            && let Some(t) = self.requests.get_mut(id)
        {
            if let Some(tokens) = prefetch_tokens {
                t.kv.key.tokens = tokens;
            }
            t.prefetching = self.cache.storage_prefetch(id, &t.kv);
            if !t.materialised {
                t.kv.key.tokens = Vec::new();
            }
        }
        self.recount_tokens(id);
        Ok(ReqId(id))
    }

    /// Tries to admit a waiting request: match, temporary lock, budget check, load-back, lock.
    ///
    /// Idle sessions give way: when no request-pool row is free, idle sessions are demoted
    /// (least recently used first) until one is; when nothing runs and the budget is short,
    /// they are demoted until the request fits. A session turn served from its session's slot
    /// that must wait for room hands the slot back until its next admission.
    ///
    /// A lazy request ([`Request::lazy`]) has its tokens filled from its source first (once
    /// its admission budget could ever fit the pool), and dropped again when the next lazy
    /// request is tried while it still waits: of the lazy requests, only the one tried last
    /// holds tokens while waiting, so a scheduler retrying the head of its queue every step
    /// fills them once, and a backlog holds none (see [`TokenStorage`]).
    ///
    /// # Errors
    /// Unknown or already running request; cache errors (nothing is held then);
    /// [`ManagerError::TokenSource`] when a lazy request's source fails (it stays waiting,
    /// holding nothing).
    pub fn admit(&mut self, id: ReqId) -> Result<Admission> {
        let t = self
            .requests
            .get_mut(id.0)
            .ok_or(ManagerError::UnknownRequest(id.0))?;
        if t.phase != Phase::Waiting {
            return Err(t.lifecycle(id, "admit on a running request"));
        }
        if t.source.is_some() {
            if !t.materialised {
                // What `admit_materialised` refuses first, without the tokens: a request that
                // can never fit is not filled.
                let len = t.prompt_len.saturating_add(t.decoded.len());
                let output_left = t
                    .max_new
                    .saturating_sub(t.decoded.len())
                    .min(self.cfg.reserve_clip_tokens);
                let capacity = self.cache.pools().total_tokens();
                let page = self.cfg.model.page_size;
                if let Some(never) = never_fits(len, output_left, page, capacity) {
                    tracing::debug!(parent: &t.span, ?never, "never admissible");
                    return Ok(Admission::Never(never));
                }
            }
            // Only the lazy request tried last keeps its tokens while it waits.
            if let Some(prev) = self.materialised_slot.take()
                && prev != id.0
                && let Some(p) = self.requests.get_mut(prev)
            {
                dematerialise(p);
                self.recount_tokens(prev);
            }
            let device_tokens = self.cfg.device_tokens;
            let hasher = self.cache.page_hasher();
            let Some(t) = self.requests.get_mut(id.0) else {
                return Err(ManagerError::UnknownRequest(id.0));
            };
            materialise(t, id, device_tokens, &hasher)?;
            self.materialised_slot = Some(id.0);
        }
        let r = self.admit_materialised(id);
        if self
            .requests
            .get(id.0)
            .is_none_or(|t| t.phase != Phase::Waiting)
            && self.materialised_slot == Some(id.0)
        {
            self.materialised_slot = None;
        }
        self.recount_tokens(id.0);
        r
    }

    /// [`Self::admit`] of a waiting request whose tokens are materialised.
    fn admit_materialised(&mut self, id: ReqId) -> Result<Admission> {
        let page = self.cfg.model.page_size;
        let clip = self.cfg.reserve_clip_tokens;
        let t = self
            .requests
            .get_mut(id.0)
            .ok_or(ManagerError::UnknownRequest(id.0))?;
        // `admit` checked the phase; filling or dropping tokens does not change it.
        debug_assert_eq!(t.phase, Phase::Waiting);
        let len = t.kv.key_len();
        let generated = len - t.prompt_len;
        let output_left = t.max_new.saturating_sub(generated).min(clip);
        let capacity = self.cache.pools().total_tokens();
        if let Some(never) = never_fits(len, output_left, page, capacity) {
            tracing::debug!(parent: &t.span, ?never, "never admissible");
            return Ok(Admission::Never(never));
        }
        // A prefetch from the storage tier ends here when its stop policy allows (what arrived
        // is host-only KV in the tree, which the match below takes as a host hit); until then
        // the request waits.
        if t.prefetching {
            match self.cache.check_prefetch(id.0)? {
                PrefetchStatus::Pending => {
                    self.metrics.counters.admission_waits += 1;
                    self.metrics.counters.prefetch_waits += 1;
                    tracing::trace!(parent: &t.span, "admission waits: prefetching");
                    return Ok(Admission::Wait(WaitReason::Prefetching));
                }
                PrefetchStatus::Done { tokens } => {
                    t.prefetching = false;
                    t.storage_loaded = tokens;
                }
                PrefetchStatus::None => t.prefetching = false,
            }
        }
        // A turn its session cannot serve (another turn in flight, history not extended) runs
        // as an ordinary request rather than failing.
        if t.kv.session.is_some() && !t.kv.kv_lent && !self.cache.session_turn_ok(&t.kv) {
            t.kv.session = None;
        }
        // (A Mamba hit needs two slots, the cached state and the request's copy: the config
        // refuses a pool of fewer.)
        let mut m = self.cache.match_request(&mut t.kv)?;
        // A session turn served from its slot has its row from the match; anything else needs
        // a free one. Idle sessions keep rows that only their next turn would use, so when
        // none is free they are demoted (least recently used first, the request's own session
        // never: its slot is what the match just declined or lent) until one is.
        if t.kv.row.is_none() && self.cache.pools().rows.available() == 0 {
            let demoted = self.cache.held_sessions() > 0
                && demote_idle_sessions(
                    self.cache.as_mut(),
                    &self.sessions_open,
                    &self.session_use,
                    &mut self.metrics.counters.session_demotions,
                    t.kv.session.map(|s| s.id),
                    |cache| Ok(cache.pools().rows.available() > 0),
                )?;
            if self.cache.pools().rows.available() == 0 {
                self.metrics.counters.admission_waits += 1;
                tracing::trace!(parent: &t.span, "admission waits: no row");
                return Ok(Admission::Wait(WaitReason::NoRow));
            }
            if demoted {
                // Demotion inserted into the tree: match again so the handles are current.
                m = self.cache.match_request(&mut t.kv)?;
            }
        }
        // Saturating: `output_left` comes from the caller and the config, and a sum past
        // `usize::MAX` can only wait.
        let mut needed = (len - m.prefix_len)
            .saturating_add(output_left)
            .saturating_add(page);
        let mut available = admission_available(self.cache.as_mut(), &t.kv, self.reserved_total)?;
        if needed > available && self.running == 0 && !self.sessions_open.is_empty() {
            // Nothing runs, so nothing will free memory by finishing: idle sessions are all
            // that stands in the way. Their slots keep their first turn's prefix locked, which
            // the session budget does not count, so demote them (least recently used first;
            // their KV stays in the tree as evictable cache) until the request fits.
            let reserved_total = self.reserved_total;
            demote_idle_sessions(
                self.cache.as_mut(),
                &self.sessions_open,
                &self.session_use,
                &mut self.metrics.counters.session_demotions,
                t.kv.session.map(|s| s.id),
                |cache| Ok(needed <= admission_available(cache, &t.kv, reserved_total)?),
            )?;
            // Demotion inserted into the tree: match again so the handles are current.
            m = self.cache.match_request(&mut t.kv)?;
            needed = (len - m.prefix_len)
                .saturating_add(output_left)
                .saturating_add(page);
            available = admission_available(self.cache.as_mut(), &t.kv, self.reserved_total)?;
        }
        if needed > available {
            self.metrics.counters.admission_waits += 1;
            tracing::trace!(parent: &t.span, needed, available, "admission waits: no room");
            give_back_lent_slot(self.cache.as_mut(), &self.sessions_open, &mut t.kv)?;
            return Ok(Admission::Wait(WaitReason::NoRoom { needed, available }));
        }
        if m.host_hit_len > 0 && self.step_open && !self.step_shares_loads {
            // A load started now would join no handle: the open step waits for no load.
            self.metrics.counters.admission_waits += 1;
            tracing::trace!(parent: &t.span, "admission waits: the open step loads nothing");
            give_back_lent_slot(self.cache.as_mut(), &self.sessions_open, &mut t.kv)?;
            return Ok(Admission::Wait(WaitReason::OpenStepLoadsNothing));
        }
        let mut swa_peak = 0;
        if let Some(window) = self.swa_window {
            let extend = len - m.prefix_len;
            // A turn lent its session's slot already owns the slot's window pages: they count
            // in its peak, and are not what the running requests own.
            let lent = if t.kv.kv_lent {
                own_swa_pages(&t.kv, page)
            } else {
                0
            };
            swa_peak = lent.saturating_add(swa_peak_pages(extend, output_left, window, page));
            let a = self.cache.swa_accounting().unwrap_or_default();
            if swa_peak > a.total {
                tracing::debug!(parent: &t.span, swa_peak, "never admissible: SWA pool");
                give_back_lent_slot(self.cache.as_mut(), &self.sessions_open, &mut t.kv)?;
                return Ok(Admission::Never(NeverReason::WindowPoolTooSmall {
                    needed: swa_peak.saturating_mul(page),
                    capacity: a.total.saturating_mul(page),
                }));
            }
            // What running requests may still take beyond the SWA pages they own now (no
            // running request owns more than its peak: `check_invariants`). Request-owned
            // pages also count the idle sessions' windows and this turn's lent one.
            let held = self.cache.session_held_window_pages();
            let running_owned = a.request_owned.saturating_sub(held).saturating_sub(lent);
            let claimed = self.swa_peak_total.saturating_sub(running_owned);
            // Read under a temporary lock of the window KV before the match's end, as the
            // admission will lock it.
            let t = self
                .requests
                .get(id.0)
                .ok_or(ManagerError::UnknownRequest(id.0))?;
            let free = self
                .cache
                .swa_available_locked(t.kv.last_node)?
                .unwrap_or(a.free + a.evictable);
            // Idle sessions' windows are demoted when an allocation is short of window pages.
            let available = free.saturating_add(held).saturating_sub(claimed);
            if swa_peak - lent > available && self.running == 0 {
                // Nothing runs to free window pages: idle sessions stand in the way (their
                // slots' locks keep the window of their cached prefix, which their held pages
                // do not count). Demote the least recently used other one and try again.
                let demoted = demote_idle_sessions(
                    self.cache.as_mut(),
                    &self.sessions_open,
                    &self.session_use,
                    &mut self.metrics.counters.session_demotions,
                    t.kv.session.map(|s| s.id),
                    |_| Ok(true),
                )?;
                if demoted {
                    // Each retry follows a demotion: at most one per open session.
                    return self.admit(id);
                }
            }
            if swa_peak - lent > available {
                self.metrics.counters.admission_waits += 1;
                tracing::trace!(parent: &t.span, swa_peak, available, "admission waits: SWA room");
                if let Some(t) = self.requests.get_mut(id.0) {
                    give_back_lent_slot(self.cache.as_mut(), &self.sessions_open, &mut t.kv)?;
                }
                return Ok(Admission::Wait(WaitReason::NoWindowRoom {
                    needed: (swa_peak - lent).saturating_mul(page),
                    available: available.saturating_mul(page),
                }));
            }
        }
        let Some(t) = self.requests.get_mut(id.0) else {
            return Err(ManagerError::UnknownRequest(id.0));
        };
        // Last, once nothing else makes it wait: a write-back eviction frees its victims only
        // at their copies' acks, so start it now, under a temporary lock of the matched prefix
        // (never a victim), and wait a step if the room is not free yet rather than have the
        // allocation wait for the copy.
        let cached_before = self.cache.evictable_tokens() + self.cache.protected_tokens();
        let ready = match t.kv.last_node {
            Some(node) => {
                let receipt = self.cache.inc_lock_ref(node)?;
                let ready = self.cache.prepare_room(needed);
                self.cache.dec_lock_ref(receipt)?;
                ready
            }
            None => self.cache.prepare_room(needed),
        };
        // It changes the tree only by evicting (backed-up victims are demoted at once).
        let cached_after = self.cache.evictable_tokens() + self.cache.protected_tokens();
        self.metrics.counters.evicted_tokens += cached_before.saturating_sub(cached_after) as u64;
        if !ready {
            self.metrics.counters.admission_waits += 1;
            tracing::trace!(parent: &t.span, needed, "admission waits: write-back in flight");
            give_back_lent_slot(self.cache.as_mut(), &self.sessions_open, &mut t.kv)?;
            return Ok(Admission::Wait(WaitReason::RoomInFlight { needed }));
        }
        match self.cache.begin_request(&mut t.kv) {
            Ok(()) => {}
            // Every Mamba slot is held by a running request or a locked state: nothing was
            // held or changed; a finishing request frees one.
            Err(CacheError::OutOfStateSlots { .. }) => {
                self.metrics.counters.admission_waits += 1;
                tracing::trace!(parent: &t.span, "admission waits: no state slot");
                return Ok(Admission::Wait(WaitReason::NoStateSlot));
            }
            // The host tier's load queue is full: nothing was held or changed, and the loads
            // in flight are acknowledged at the next step.
            Err(CacheError::Busy(_)) => {
                self.metrics.counters.admission_waits += 1;
                tracing::trace!(parent: &t.span, "admission waits: transfers busy");
                return Ok(Admission::Wait(WaitReason::TransfersBusy));
            }
            Err(e) => return Err(e.into()),
        }
        // The matched pages are in the request's row now: their list is not kept while it
        // runs (at saturation, the running requests' lists were 2.1 MB of the agentic
        // replay's peak heap).
        t.kv.prefix_pages = Vec::new();
        if self.step_open
            && self.step_shares_loads
            && let Some(set) = &self.step_loads
        {
            // Admitted inside an open step: its load starts now and joins that step, so the
            // step's handle waits for it (see `begin_step`).
            let set = set.clone();
            self.start_loads(&set);
        }
        let forward_step = self.forward_step();
        let Some(t) = self.requests.get_mut(id.0) else {
            return Err(ManagerError::UnknownRequest(id.0));
        };
        let device = m.prefix_len.min(t.kv.prefix_len);
        let kv_match = t.kv.kv_match_len.max(device);
        let host = t.kv.prefix_len.saturating_sub(m.prefix_len);
        // What the prefetch loaded counts once, at the admission that takes it.
        let storage = std::mem::take(&mut t.storage_loaded).min(host);
        let extend = len - t.kv.prefix_len;
        t.reserved = extend + output_left;
        t.swa_peak = swa_peak;
        self.swa_peak_total += swa_peak;
        t.phase = Phase::Running;
        t.row_capacity = 0;
        self.reserved_total += t.reserved;
        self.waiting -= 1;
        self.running += 1;
        let c = &mut self.metrics.counters;
        c.admitted += 1;
        // Hits count once per request (its first admission): a retracted request re-matching
        // its own pages is not reuse.
        if !t.admitted_before {
            t.admitted_before = true;
            c.prompt_tokens += t.prompt_len as u64;
            c.hit_tokens_device += device as u64;
            c.hit_tokens_host += host as u64;
            c.hit_tokens_storage += storage as u64;
            c.kv_match_tokens += kv_match as u64;
            let h = &mut self.metrics.histograms;
            h.match_tokens.observe((device + host) as u64);
        }
        tracing::debug!(
            parent: &t.span,
            step = forward_step,
            device_hit = device,
            host_hit = host,
            extend_tokens = extend,
            "admitted"
        );
        Ok(Admission::Ready(Admitted {
            device_tokens: device,
            host_tokens: host,
            storage_tokens: storage,
            extend_tokens: extend,
            kv_match_tokens: kv_match,
            mamba_slot: t.kv.mamba_slot,
            mamba_cow: t.kv.mamba_cow,
            mamba_checkpoints: MambaCheckpoints::from_slice(&t.kv.mamba_checkpoints),
            mamba_track: t.kv.mamba_track,
        }))
    }

    /// Allocates slots for the next `n` prompt tokens (one prefill chunk), evicting as needed.
    /// Returns the token positions allocated.
    ///
    /// # Errors
    /// [`ManagerError::OutOfMemory`] (nothing allocated), or a request that is not running or
    /// has fewer than `n` unallocated prompt tokens.
    pub fn extend(&mut self, id: ReqId, n: usize) -> Result<Range<usize>> {
        let forward_step = self.forward_step();
        let t = running_mut(&mut self.requests, id)?;
        let start = t.kv.allocated_len;
        if n > t.kv.key_len().saturating_sub(start) {
            return Err(t.lifecycle(id, "extend past the prompt"));
        }
        alloc(
            self.cache.as_mut(),
            self.cfg.model.page_size,
            self.page_granular,
            &mut self.metrics,
            &mut self.reserved_total,
            t,
            n,
        )?;
        t.alloc_step = forward_step;
        self.metrics.counters.extend_tokens += n as u64;
        Ok(start..start + n)
    }

    /// The forward of the last chunk is done: commits it and inserts the computed pages so
    /// concurrent requests can share them at once (`cache_unfinished_req`).
    ///
    /// # Errors
    /// A request that is not running; cache errors.
    pub fn chunk_done(&mut self, id: ReqId) -> Result<()> {
        let t = running_mut(&mut self.requests, id)?;
        commit_pending(&mut t.kv)?;
        // Inserting may rewrite the row; the next allocation asks the cache again.
        t.row_capacity = 0;
        self.cache.cache_unfinished_req(&mut t.kv)?;
        if self.swa_window.is_some() {
            let freed = slide(self.cache.as_mut(), &mut t.kv)?;
            self.metrics.counters.swa_pages_slid_out += freed as u64;
        }
        // Once the prompt is all in, when the tokens left to copy are the last partial page
        // and the output room: released after every chunk, a long prompt's uncached rest was
        // copied at each one (+45 µs a request on the agentic replay), and released at the
        // admission too, once more (+3 µs).
        if self.cfg.release_cached_prompts
            && t.kv.committed_len >= t.prompt_len
            && release_cached_prompt(t)
        {
            self.recount_tokens(id.0);
        }
        Ok(())
    }

    /// Appends a sampled token and allocates its slot (evicting as needed). Returns the slot's
    /// token position.
    ///
    /// # Errors
    /// [`ManagerError::OutOfMemory`]: nothing changed; retract a request and retry.
    pub fn decode(&mut self, id: ReqId, token: TokenId) -> Result<usize> {
        let forward_step = self.forward_step();
        let t = running_mut(&mut self.requests, id)?;
        commit_pending(&mut t.kv)?;
        if t.kv.allocated_len < t.kv.key_len() {
            return Err(t.lifecycle(id, "decode before the prompt is allocated"));
        }
        if self.swa_window.is_some() {
            let freed = slide(self.cache.as_mut(), &mut t.kv)?;
            self.metrics.counters.swa_pages_slid_out += freed as u64;
        }
        let pos = t.kv.allocated_len;
        let capacity = t.kv.key.tokens.capacity();
        t.kv.key.tokens.push(token);
        if t.kv.key.tokens.capacity() != capacity {
            // Past the room reserved at arrival (or materialisation): the vector moved.
            let grown = (t.kv.key.tokens.capacity() - capacity) * std::mem::size_of::<TokenId>();
            t.share.bytes += grown;
            self.running_token_bytes += grown;
        }
        t.alloc_step = forward_step;
        // The common case, checked here so that it makes no call and moves no `Result`.
        if self.page_granular && alloc_in_place(&mut self.reserved_total, t, 1) {
            self.metrics.counters.decode_tokens += 1;
            return Ok(pos);
        }
        let r = alloc(
            self.cache.as_mut(),
            self.cfg.model.page_size,
            self.page_granular,
            &mut self.metrics,
            &mut self.reserved_total,
            t,
            1,
        );
        if r.is_err() {
            t.kv.key.tokens.pop();
        }
        r?;
        self.metrics.counters.decode_tokens += 1;
        Ok(t.kv.allocated_len - 1)
    }

    /// The device pages of a request's row (page `i` holds positions `[i*P, (i+1)*P)`).
    ///
    /// # Errors
    /// Unknown request or a request without a row.
    pub fn pages(&self, id: ReqId) -> Result<&[PageId]> {
        let t = self
            .requests
            .get(id.0)
            .ok_or(ManagerError::UnknownRequest(id.0))?;
        let Some(row) = t.kv.row else {
            return Err(t.lifecycle(id, "no row (not running)"));
        };
        Ok(self.cache.pools().rows.pages(row)?)
    }

    /// [`Self::pages`] as the `u32` page indices a kernel's page table holds, without a copy
    /// (see [`PageId::as_u32_slice`]): upload this slice as the request's row.
    ///
    /// # Errors
    /// As [`Self::pages`].
    pub fn pages_as_u32(&self, id: ReqId) -> Result<&[u32]> {
        self.pages(id).map(PageId::as_u32_slice)
    }

    /// Whether this manager's cache lets running lazy requests drop the prompt tokens the tree
    /// holds for them ([`ManagerConfig::release_cached_prompts`]).
    pub fn can_release_cached_prompts(&self) -> bool {
        self.cache.takes_windowed_keys()
    }

    /// Turns [`ManagerConfig::release_cached_prompts`] on or off from the next admission or
    /// chunk on (a running request that dropped its prompt already keeps it dropped).
    ///
    /// # Errors
    /// [`ManagerError::Config`] turning it on where [`Self::can_release_cached_prompts`] is
    /// false.
    pub fn set_release_cached_prompts(&mut self, on: bool) -> Result<()> {
        if on && !self.can_release_cached_prompts() {
            return Err(ManagerError::Config(RELEASE_REFUSED.into()));
        }
        self.cfg.release_cached_prompts = on;
        Ok(())
    }

    /// Tokens of the request so far (prompt, then prompt + decoded tokens).
    ///
    /// # Errors
    /// Unknown request; a lazy request ([`Request::lazy`]) waiting without its tokens
    /// ([`ManagerError::Lifecycle`]: they are in its source until an admission fills them),
    /// or running without its cached prefix ([`ManagerConfig::release_cached_prompts`]).
    pub fn tokens(&self, id: ReqId) -> Result<&[TokenId]> {
        let t = self.holding_tokens(id)?;
        if t.kv.key_start > 0 {
            return Err(t.lifecycle(
                id,
                "a running lazy request holds only its tokens past its cached prefix",
            ));
        }
        Ok(t.kv.key.tokens.as_slice())
    }

    /// The tokens the request holds and the position of the first: all of them from 0, or,
    /// for a running request that released its cached prefix
    /// ([`ManagerConfig::release_cached_prompts`]), those past it (what a forward still
    /// reads: the prompt's last partial page and the decoded tokens).
    ///
    /// # Errors
    /// Unknown request; a waiting lazy request without its tokens
    /// ([`ManagerError::Lifecycle`]).
    pub fn held_tokens(&self, id: ReqId) -> Result<(usize, &[TokenId])> {
        let t = self.holding_tokens(id)?;
        Ok((t.kv.key_start, t.kv.key.tokens.as_slice()))
    }

    /// Request `id`, which holds tokens (not a waiting lazy request without them).
    fn holding_tokens(&self, id: ReqId) -> Result<&Tracked> {
        let t = self
            .requests
            .get(id.0)
            .ok_or(ManagerError::UnknownRequest(id.0))?;
        if !t.materialised {
            return Err(t.lifecycle(id, "a waiting lazy request holds no tokens"));
        }
        Ok(t)
    }

    /// Finishes a request: its KV enters the cache (or its session), its lock and row go.
    ///
    /// # Errors
    /// Unknown or waiting request; cache errors (the request is released as far as possible).
    pub fn finish(&mut self, id: ReqId) -> Result<()> {
        let mut t = self.take(id)?;
        if t.phase != Phase::Running {
            let e = t.lifecycle(id, "finish on a waiting request");
            self.requests.restore(id.0, t);
            return Err(e);
        }
        self.forget(id, &t);
        t.span.record("outcome", "finished");
        if let Some(tag) = t.kv.session {
            self.use_seq += 1;
            self.session_use.insert(tag.id, self.use_seq);
        }
        let committed = commit_pending(&mut t.kv);
        let r = self
            .cache
            .cache_finished_req(&mut t.kv, FinishKind::Finished);
        self.metrics.counters.finished += 1;
        committed.and(r.map_err(Into::into))
    }

    /// Aborts a request in any state; nothing it computed is cached.
    ///
    /// # Errors
    /// Unknown request; cache errors.
    pub fn abort(&mut self, id: ReqId) -> Result<()> {
        let mut t = self.take(id)?;
        self.forget(id, &t);
        t.span.record("outcome", "aborted");
        self.metrics.counters.aborted += 1;
        // A prefetch still loading for it stops, and its host pages return to the pool.
        let prefetch = if t.prefetching {
            self.cache.abort_prefetch(id.0).map(|_| ())
        } else {
            Ok(())
        };
        let r = self
            .cache
            .cache_finished_req(&mut t.kv, FinishKind::Aborted);
        prefetch?;
        Ok(r?)
    }

    /// Retracts a running request (decode out of memory): its computed KV (prompt and output,
    /// page-aligned) enters the cache, as at a finish, and its lock, row and reservation go;
    /// it waits again with its tokens so far, and a later [`Self::admit`] matches what was
    /// cached, so only the unaligned tail is computed again (unless it was evicted meanwhile;
    /// with a host tier it may come back from the host). Tokens allocated for a step whose
    /// forward has not ended are not cached: they were never computed.
    ///
    /// A turn of a session ends as far as it got: the session keeps that history but is
    /// demoted at once (its KV goes to the tree as evictable cache, its row is released), so
    /// that the retraction frees memory rather than moving it into the session's slot.
    ///
    /// # Errors
    /// Unknown or waiting request; cache errors.
    pub fn retract(&mut self, id: ReqId) -> Result<()> {
        let ended = self.ended_step;
        let t = running_mut(&mut self.requests, id)?;
        self.reserved_total -= t.reserved;
        t.reserved = 0;
        self.swa_peak_total -= t.swa_peak;
        t.swa_peak = 0;
        t.phase = Phase::Waiting;
        t.row_capacity = 0;
        self.running -= 1;
        self.waiting += 1;
        self.metrics.counters.retracted += 1;
        tracing::debug!(parent: &t.span, step = self.step, tokens = t.kv.key_len(), "retracted");
        // The forward that computes the latest allocation is over: the manager would learn it
        // at the request's next call, which is this one.
        let committed = if t.alloc_step <= ended {
            commit_pending(&mut t.kv)
        } else {
            Ok(())
        };
        let lent_session = t.kv.session.filter(|_| t.kv.kv_lent).map(|s| s.id);
        // A turn that does not hold its session's row finishes through the tree, not into a
        // new session slot: untag it for the call, and tag it again for its next admission.
        let tag = if lent_session.is_none() {
            t.kv.session.take()
        } else {
            None
        };
        let cached = self
            .cache
            .cache_finished_req(&mut t.kv, FinishKind::Finished);
        if tag.is_some() {
            t.kv.session = tag;
        }
        cached?;
        // A session whose close was deferred to this turn is gone already: its slot went to
        // the tree with the turn's end.
        if let Some(sid) = lent_session
            && self.cache.has_session(sid)
            && self.cache.demote_session(sid)?
        {
            self.metrics.counters.session_demotions += 1;
        }
        // A lazy request waits again holding only what it decoded (its prompt is in its
        // source).
        if let Some(t) = self.requests.get_mut(id.0) {
            dematerialise(t);
        }
        self.recount_tokens(id.0);
        committed
    }

    /// What the requests hold in token storage, waiting and running (see [`TokenStorage`]).
    /// Kept as requests move: a call costs nothing but the copy (a scheduler or a replay may
    /// read it every step).
    pub fn token_storage(&self) -> TokenStorage {
        TokenStorage {
            waiting_requests: self.waiting,
            waiting_materialised: self.waiting_materialised,
            waiting_lazy_materialised: self.waiting_lazy_materialised,
            waiting_bytes: self.waiting_token_bytes,
            running_bytes: self.running_token_bytes,
        }
    }

    /// Brings request `slot`'s share of the token storage totals up to date (nothing once it
    /// is gone).
    fn recount_tokens(&mut self, slot: u64) {
        let Some(t) = self.requests.get_mut(slot) else {
            return;
        };
        let old = std::mem::take(&mut t.share);
        let new = TokenShare::of(t);
        t.share = new;
        self.uncount_tokens(old);
        if new.running {
            self.running_token_bytes += new.bytes;
        } else {
            self.waiting_token_bytes += new.bytes;
        }
        self.waiting_materialised += usize::from(new.materialised);
        self.waiting_lazy_materialised += usize::from(new.materialised && new.lazy);
    }

    /// Takes `share` out of the token storage totals.
    fn uncount_tokens(&mut self, share: TokenShare) {
        if share.running {
            self.running_token_bytes -= share.bytes;
        } else {
            self.waiting_token_bytes -= share.bytes;
        }
        self.waiting_materialised -= usize::from(share.materialised);
        self.waiting_lazy_materialised -= usize::from(share.materialised && share.lazy);
    }

    /// Closes a session: whatever KV it holds is released to the cache. While a turn of it
    /// is running the close is deferred to that turn's end ([`CloseOutcome::Deferred`]);
    /// turns of the session arriving meanwhile run as ordinary requests (untagged), and one
    /// arriving after the close opens the session afresh.
    ///
    /// # Errors
    /// [`ManagerError::SessionsOff`] on a manager without sessions; session-layer errors
    /// ([`ManagerError::Session`] for a session that is not open).
    pub fn close_session(&mut self, session: u64) -> Result<CloseOutcome> {
        let outcome = self.cache.close_session(session);
        // The session layer forgets a session whose release fails in the inner cache (only
        // "not open" leaves it as it was): so does the manager, or its demotions would keep
        // asking for a session the layer no longer knows.
        if !matches!(
            outcome,
            Err(ManagerError::SessionsOff { .. }
                | ManagerError::Session(radixkv_session::SessionError::Unknown(_)))
        ) {
            self.sessions_open.remove(&session);
            self.session_use.remove(&session);
        }
        outcome
    }

    /// Drops every cached KV, on every tier (the device pool and the host tier), as after a
    /// weight update or when a router asks for a clean slate. Open sessions stay open but lose
    /// their KV (it is demoted to the tree, then dropped with it): their next turn recomputes.
    /// With events on, the cache reports [`KvEvent::AllBlocksCleared`], which supersedes
    /// every event not drained yet. Counters keep counting (they never go backwards); the
    /// pools are all free afterwards.
    ///
    /// # Errors
    /// [`ManagerError::Busy`] while any request is registered, running or waiting (nothing
    /// changes then); a cache error if a host transfer cannot be completed.
    pub fn reset(&mut self) -> Result<()> {
        if self.requests.len() > 0 {
            return Err(ManagerError::Busy {
                requests: self.requests.len(),
            });
        }
        demote_idle_sessions(
            self.cache.as_mut(),
            &self.sessions_open,
            &self.session_use,
            &mut self.metrics.counters.session_demotions,
            None,
            |_| Ok(false),
        )?;
        self.cache.reset()?;
        self.buffer_cache_events();
        Ok(())
    }

    /// Opens a session explicitly (requests carrying an unknown session id open it as a
    /// streaming session on arrival). `ttl_ms` overrides the configured idle TTL.
    ///
    /// # Errors
    /// [`ManagerError::SessionsOff`] when sessions are off; [`ManagerError::Session`] when it
    /// is already open.
    pub fn open_session(
        &mut self,
        session: u64,
        streaming: bool,
        ttl_ms: Option<u64>,
    ) -> Result<()> {
        self.cache.open_session(session, streaming, ttl_ms)?;
        self.sessions_open.insert(session);
        Ok(())
    }

    /// Closes every session this manager has open (shutdown, end of a replay).
    ///
    /// # Errors
    /// The first session-layer error (the other sessions are still closed).
    pub fn close_all_sessions(&mut self) -> Result<()> {
        self.session_use.clear();
        let mut ids: Vec<u64> = self.sessions_open.drain().collect();
        ids.sort_unstable();
        let mut first = Ok(());
        for id in ids {
            if let Err(e) = self.cache.close_session(id)
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        first
    }

    /// Open sessions.
    pub fn open_sessions(&self) -> usize {
        self.cache.open_sessions()
    }

    /// Waits for every transfer in flight and applies its ack (shutdown, end of a replay):
    /// afterwards no page is locked by a transfer. With a storage tier it also waits for every
    /// storage job ([`Self::wait_storage`]; it blocks on the store, so a serving scheduler
    /// calls it only at shutdown).
    ///
    /// # Errors
    /// A failed copy.
    pub fn drain(&mut self) -> Result<StepTransfers> {
        let acked = self.cache.evicted_at_acks();
        let t = self.cache.drain()?;
        self.count_acked_evictions(acked);
        self.count_transfers(&t);
        Ok(t)
    }

    /// Blocks until every transfer started so far (loads and host backups) has completed, and
    /// applies nothing: queued transfers stay queued, and the acks, a failed copy's included,
    /// are applied by the next call that polls them (`end_step`, `drain`, an allocation).
    ///
    /// For a harness that needs the copies done at a known point (a deterministic replay, a
    /// test) without charging the wait to the call that applies them: the `radixkv` replay
    /// waits here after every step, then times `drain`'s ack work as the manager's. A serving
    /// scheduler never needs it: its forward waits per layer ([`StepHandle::wait_layer`]), and
    /// backups complete in the background. A cache without a host tier has nothing to wait for.
    pub fn wait_transfers(&self) {
        self.cache.wait_transfers();
    }

    /// Counts the evictions applied with acks since the cumulative count was `before` (the
    /// allocation path counts those it waits for itself).
    fn count_acked_evictions(&mut self, before: u64) {
        let n = self.cache.evicted_at_acks().saturating_sub(before);
        self.metrics.counters.evicted_tokens += n;
    }

    /// Starts a step, once its batch is formed and before its forward: every load queued so
    /// far (host hits of the batch's admissions) starts, and the handle says what the forward
    /// waits for.
    ///
    /// The documented order is: form the batch (`admit`, `extend`, `decode`), `begin_step`,
    /// run the forward (waiting per layer on the handle), `chunk_done` / `finish`, `end_step`.
    /// An admission made while the step is open is not left behind: its load starts at once
    /// and joins this step's handle, so no request can be served by a step whose
    /// [`StepHandle::wait_layer`] does not cover its load. Read the handle's load figures and
    /// start the forward after the step's last admission.
    ///
    /// If the loads cannot be started (the backend refused them), every
    /// [`StepHandle::wait_layer`] of this step returns the error, so the forward never reads
    /// device pages the loads did not fill; the loads stay queued and start with a later step,
    /// and `end_step` reports the error.
    pub fn begin_step(&mut self) -> StepHandle {
        self.step += 1;
        self.step_open = true;
        // A cache that never loads has nothing to start and nothing for the handle to wait
        // for: its steps share no set (no reference counts to move every step).
        self.step_shares_loads = false;
        let loads = if self.starts_loads {
            self.begin_loads()
        } else {
            None
        };
        StepHandle {
            index: self.step,
            layers: self.cfg.model.layers,
            waited_ns: Default::default(),
            span: tracing::debug_span!(
                "kv_step",
                step = self.step,
                load_bytes = loads.as_ref().map_or(0, |l| l.load_bytes_now())
            ),
            loads,
        }
    }

    /// The step whose forward computes what is allocated now: the open one, or the next.
    fn forward_step(&self) -> u64 {
        self.step + u64::from(!self.step_open)
    }

    /// Starts the queued loads for the step `begin_step` opens: the set its handle waits on,
    /// or `None` when it starts none and waits for no earlier load (the handle then waits for
    /// nothing, and no reference count moves).
    fn begin_loads(&mut self) -> Option<Arc<StepLoadSet>> {
        let l = self.start_queued_loads();
        if l.pages == 0 && l.bytes == 0 && l.wait.is_none() {
            return None;
        }
        // The last loading step's set when its handle is gone (end_step took it, or the
        // caller dropped it): nobody can see it then, and it starts empty again. Only loading
        // steps get here, so `get_mut`'s atomics are no per-step cost.
        let set = match self.step_loads.take() {
            Some(mut set) => match Arc::get_mut(&mut set) {
                Some(s) => {
                    s.reset();
                    set
                }
                None => Arc::default(),
            },
            None => Arc::default(),
        };
        set.add(l.pages, l.bytes, l.wait);
        self.step_loads = Some(set.clone());
        self.step_shares_loads = true;
        Some(set)
    }

    /// Starts every queued load and adds it to `set`; a refusal makes `set`'s waits fail.
    fn start_loads(&mut self, set: &StepLoadSet) {
        let l = self.start_queued_loads();
        set.add(l.pages, l.bytes, l.wait);
    }

    /// The cache's loads started now, or, when they could not be started, a wait that fails
    /// every layer (the error is kept for `end_step`).
    fn start_queued_loads(&mut self) -> StepLoads {
        self.cache.on_begin_step().unwrap_or_else(|e| {
            let wait: Arc<dyn LayerWait> = Arc::new(LoadsNotStarted(e.clone()));
            self.step_error.get_or_insert(e);
            StepLoads {
                pages: 0,
                bytes: 0,
                wait: Some(wait),
            }
        })
    }

    fn count_transfers(&mut self, t: &StepTransfers) {
        self.metrics.counters.transfers.add(t);
    }

    /// Ends a step: drains acks, KV events and transfer counts; audits invariants in debug
    /// builds.
    ///
    /// # Errors
    /// [`ManagerError::Invariant`] when the audit fails.
    pub fn end_step(&mut self, step: StepHandle) -> Result<StepSummary> {
        let _g = step.span.enter();
        // The step's forward is over: what it allocated is computed, and later admissions
        // belong to the next step.
        if self.step_open && step.index == self.step {
            self.step_open = false;
            self.ended_step = self.ended_step.max(step.index);
        }
        // Acks are applied even after a failed `begin_step`: the transfers that did start
        // still complete, and their locks must be released.
        let step_error = self.step_error.take();
        let acked = self.cache.evicted_at_acks();
        let transfers = match self.cache.on_end_step() {
            Ok(t) => t,
            Err(e) => return Err(step_error.unwrap_or(e)),
        };
        self.count_acked_evictions(acked);
        self.count_transfers(&transfers);
        let load_pages = step.load_pages();
        tracing::debug!(
            load_pages,
            bytes_loaded = transfers.bytes_loaded,
            bytes_written = transfers.bytes_written,
            running = self.running,
            waiting = self.waiting,
            "step ended"
        );
        let h = &mut self.metrics.histograms;
        if load_pages > 0 {
            h.step_load_pages.observe(load_pages);
            h.step_load_wait_ns.observe(step.waited_ns());
        }
        if self.starts_loads {
            if transfers.bytes_loaded == 0 && transfers.bytes_written == 0 {
                // Most steps move nothing: counted here, added to both histograms when the
                // metrics are read (two observations a step touched four cache lines).
                self.idle_tier_steps += 1;
            } else {
                h.step_load_bytes.observe(transfers.bytes_loaded);
                h.step_write_bytes.observe(transfers.bytes_written);
            }
        }
        self.metrics.counters.steps += 1;
        self.buffer_cache_events();
        if self.check_every_step {
            self.check_invariants()?;
        }
        // The handle goes with this call; the manager's reference to its set stays for the
        // next step (see `step_loads`).
        drop(_g);
        drop(step);
        if let Some(e) = step_error {
            return Err(e);
        }
        Ok(StepSummary { transfers })
    }

    fn take(&mut self, id: ReqId) -> Result<Tracked> {
        self.requests
            .remove(id.0)
            .ok_or(ManagerError::UnknownRequest(id.0))
    }

    /// Drops a removed request's share of the manager's totals.
    fn forget(&mut self, id: ReqId, t: &Tracked) {
        self.uncount_tokens(t.share);
        if self.materialised_slot == Some(id.0) {
            self.materialised_slot = None;
        }
        self.reserved_total -= t.reserved;
        match t.phase {
            Phase::Running => {
                self.running -= 1;
                self.swa_peak_total -= t.swa_peak;
            }
            Phase::Waiting => self.waiting -= 1,
        }
    }
}

/// The per-layer wait of a step whose loads could not be started: every layer fails, so the
/// forward never reads the pages those loads were to fill.
#[derive(Debug)]
struct LoadsNotStarted(ManagerError);

impl LayerWait for LoadsNotStarted {
    fn wait_layer(&self, _layer: u32) -> Result<()> {
        Err(self.0.clone())
    }

    fn is_layer_done(&self, _layer: u32) -> bool {
        // Complete, unsuccessfully: `wait_layer` says how.
        true
    }
}

/// A turn lent its session's slot at the match that leaves admission without running (it
/// waits, or can never run) gives the slot back: held by a waiting request, the slot's row and
/// KV could be demoted by nothing, and waiting turns of several sessions could then block each
/// other for good; `Never` promises that nothing is held. The next admission lends it again.
/// (A session whose close waits for this turn keeps it lent: giving it back would complete
/// the close and drop the KV.)
///
/// # Errors
/// Cache errors from the give-back.
fn give_back_lent_slot(
    cache: &mut dyn ManagedCache,
    sessions_open: &HashSet<u64>,
    kv: &mut RequestKv,
) -> Result<()> {
    if kv.kv_lent && kv.session.is_some_and(|s| sessions_open.contains(&s.id)) {
        cache.cache_finished_req(kv, FinishKind::Aborted)?;
    }
    Ok(())
}

/// Demotes the open sessions' idle slots, least recently used first and never `except`'s
/// (the admitting request's own session), until `enough` holds after a demotion; counts each
/// demotion in `demotions`. Returns whether any slot was demoted.
///
/// # Errors
/// Cache errors from a demotion or from `enough`.
fn demote_idle_sessions(
    cache: &mut dyn ManagedCache,
    sessions_open: &HashSet<u64>,
    session_use: &ahash::HashMap<u64, u64>,
    demotions: &mut u64,
    except: Option<u64>,
    mut enough: impl FnMut(&mut dyn ManagedCache) -> Result<bool>,
) -> Result<bool> {
    let mut order: Vec<(u64, u64)> = sessions_open
        .iter()
        .filter(|&&s| Some(s) != except)
        .map(|&s| (session_use.get(&s).copied().unwrap_or(0), s))
        .collect();
    order.sort_unstable();
    let mut demoted = false;
    for (_, sid) in order {
        if cache.demote_session(sid)? {
            *demotions += 1;
            demoted = true;
            if enough(cache)? {
                break;
            }
        }
    }
    Ok(demoted)
}

/// Admission budget for a matched request. Locking the matched path takes it out of
/// `evictable`, so the budget is read as if under the lock the real admission will take
/// ([`PrefixCache::available_tokens_if_locked`](radixkv_radix::PrefixCache::available_tokens_if_locked)).
fn admission_available(
    cache: &mut dyn ManagedCache,
    kv: &RequestKv,
    reserved_total: usize,
) -> Result<usize> {
    let a = match kv.last_node {
        Some(node) => cache.available_tokens_if_locked(node)?,
        None => cache.available_tokens(),
    };
    Ok(a.saturating_sub(reserved_total))
}

/// Why a request of `len` tokens with `output_left` output tokens still to reserve can never
/// be admitted, if it cannot: its admission needs the tokens not on the device, the clipped
/// output reservation and a page, beside the device prefix it locks, and with everything else
/// finished and evicted the pool (`capacity` tokens) still holds fewer. A retracted request's
/// figure only changes by what it decoded, so it is checked at every admission.
fn never_fits(len: usize, output_left: usize, page: usize, capacity: usize) -> Option<NeverReason> {
    let needed = len.saturating_add(output_left).saturating_add(page);
    (needed > capacity).then_some(NeverReason::PoolTooSmall { needed, capacity })
}

/// The SWA pages a request may take at its peak beyond what its admission locks: what the
/// radix cache allocates for it, and the nodes of its own inserts that its window lock keeps.
/// Every allocation takes as many SWA pages as full-KV pages, so a request never takes more
/// than its extend and output pages (and one for an unaligned start). Its prefill pages go
/// to the tree at each chunk end, where the lock on the window before its end holds the
/// nodes that window lies in (whole nodes: at most its extend pages); at every decode step
/// the pages that left the window are freed, so past its prefill it owns at most the window
/// and the two pages around its ends, and its prefill's nodes are unlocked once the window
/// has left them.
pub(crate) fn swa_peak_pages(
    extend: usize,
    output_left: usize,
    window: usize,
    page: usize,
) -> usize {
    let all = extend.saturating_add(output_left).div_ceil(page) + 1;
    let windowed = extend
        .div_ceil(page)
        .saturating_add(window / page)
        .saturating_add(2);
    all.min(windowed)
}

/// The SWA pages `kv` owns itself: its SWA table past the tree's window pages of its cached
/// prefix (see `RequestKv::swa_pages`).
fn own_swa_pages(kv: &RequestKv, page: usize) -> usize {
    let tree_held = kv.cache_protected_len.saturating_sub(kv.swa_evicted_len) / page;
    kv.swa_pages.len().saturating_sub(tree_held)
}

/// Frees the window KV of `kv` that slid out of the window and releases its SWA locks once the
/// window has passed its cached prefix: `PrefixCache::slide_window`, which alone decides what
/// slid out (a request without a row has nothing to slide). Returns the pages freed.
#[inline]
fn slide(cache: &mut dyn ManagedCache, kv: &mut RequestKv) -> Result<usize> {
    if kv.row.is_none() {
        return Ok(0);
    }
    Ok(cache.slide_window(kv)?)
}

/// What one request counts in the manager's token storage totals.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
struct TokenShare {
    bytes: usize,
    /// Counted in the running total (else the waiting one).
    running: bool,
    /// Waiting with its prompt's tokens.
    materialised: bool,
    lazy: bool,
}

impl TokenShare {
    /// `t`'s share as it is now.
    fn of(t: &Tracked) -> Self {
        let running = t.phase == Phase::Running;
        TokenShare {
            bytes: token_bytes(t),
            running,
            materialised: !running && t.materialised,
            lazy: t.source.is_some(),
        }
    }
}

/// Bytes of token storage `t` holds: its token vector and a lazy request's decoded tokens
/// kept aside (capacities).
fn token_bytes(t: &Tracked) -> usize {
    (t.kv.key.tokens.capacity() + t.decoded.capacity()) * std::mem::size_of::<TokenId>()
        + t.kv.page_hashes.bytes()
}

/// Refuses match hashes for `tokens` in `ns` that cover more than its whole pages, and, in
/// debug builds, hashes that are not `hasher`'s chain over them (release builds trust them:
/// checking reads the whole prompt, which is what the hashes save).
fn check_page_hashes(
    hasher: &PageHasher,
    ns: &Namespace,
    tokens: &[TokenId],
    hashes: &PageHashes,
) -> std::result::Result<(), &'static str> {
    if hashes.len() > tokens.len() / hasher.page_size() {
        return Err("more page hashes than the prompt has whole pages");
    }
    if cfg!(debug_assertions) && !hashes.is_empty() {
        let want = hasher.hashes(ns, &tokens[..hashes.len() * hasher.page_size()]);
        if want != *hashes {
            return Err("page hashes that are not the prompt's chain under the cache's hasher");
        }
    }
    Ok(())
}

/// A lazy request's tokens from `source`, then `decoded`, with room for `room` more; `id` and
/// `engine_id` name the request in the error.
///
/// # Errors
/// [`ManagerError::TokenSource`] when the source fails or gives another number of tokens than
/// its `len`.
fn fill_tokens(
    source: &dyn TokenSource,
    decoded: &[TokenId],
    room: usize,
    id: u64,
    engine_id: &Option<String>,
) -> Result<Vec<TokenId>> {
    let err = |message| ManagerError::TokenSource {
        id,
        engine_id: engine_id.clone(),
        message,
    };
    let len = source.len();
    let mut tokens = Vec::new();
    // Only a hint, as at arrival: a source announcing an impossible length gets no room.
    let _ = tokens.try_reserve_exact(len.saturating_add(decoded.len()).saturating_add(room));
    source.fill(&mut tokens).map_err(|e| err(e.0))?;
    if tokens.len() != len {
        return Err(err(format!(
            "gave {} tokens, announced {len}",
            tokens.len()
        )));
    }
    tokens.extend_from_slice(decoded);
    Ok(tokens)
}

/// Fills a waiting lazy request's tokens from its source (its prompt, then what it decoded
/// before a retraction), with room for the rest of its output; nothing for a request whose
/// tokens are there.
///
/// # Errors
/// As [`fill_tokens`]; the request is unchanged then.
fn materialise(
    t: &mut Tracked,
    id: ReqId,
    device_tokens: usize,
    hasher: &PageHasher,
) -> Result<()> {
    let Some(src) = t.source.as_ref().filter(|_| !t.materialised) else {
        return Ok(());
    };
    let room = t.max_new.saturating_sub(t.decoded.len()).min(device_tokens);
    let tokens = fill_tokens(src.as_ref(), &t.decoded, room, id.0, &t.engine_id)?;
    let prompt = &tokens[..t.prompt_len];
    let mut hashes = PageHashes::new();
    src.fill_page_hashes(hasher, &t.kv.key.namespace, prompt, &mut hashes);
    check_page_hashes(hasher, &t.kv.key.namespace, prompt, &hashes).map_err(|what| {
        ManagerError::TokenSource {
            id: id.0,
            engine_id: t.engine_id.clone(),
            message: what.to_string(),
        }
    })?;
    t.kv.key.tokens = tokens;
    t.kv.page_hashes = hashes;
    t.decoded = Vec::new();
    t.materialised = true;
    Ok(())
}

/// Drops a waiting lazy request's tokens, keeping only what it decoded (in no source), with
/// the match it made with them (the next admission matches again). A request that holds KV
/// (a session turn lent its session's KV whose close waits for it) keeps them: its key
/// describes that KV.
fn dematerialise(t: &mut Tracked) {
    let kv = &t.kv;
    if t.source.is_none()
        || !t.materialised
        || t.phase != Phase::Waiting
        || kv.row.is_some()
        || kv.lock.is_some()
        || kv.kv_lent
        || kv.mamba_slot.is_some()
    {
        return;
    }
    let tokens = std::mem::take(&mut t.kv.key.tokens);
    // A released prompt was dropped up to its length at most: the decoded tokens are all here.
    let decoded_from = t.prompt_len.saturating_sub(t.kv.key_start);
    t.kv.key_start = 0;
    t.kv.page_hashes = PageHashes::new();
    t.decoded = tokens
        .get(decoded_from..)
        .map_or_else(Vec::new, <[TokenId]>::to_vec);
    let kv = &mut t.kv;
    kv.prefix_pages = Vec::new();
    kv.prefix_len = 0;
    kv.host_hit_len = 0;
    kv.last_node = None;
    kv.load_anchor = None;
    kv.kv_match_len = 0;
    t.materialised = false;
}

/// Why [`ManagerConfig::release_cached_prompts`] is refused.
const RELEASE_REFUSED: &str = "release_cached_prompts needs a cache whose inserts start at \
     the request's lock: cache = \"radix\" or \"hicache\" (sessions or not) without Mamba \
     or sliding-window layers";

/// [`ManagerConfig::release_cached_prompts`]: drops a running lazy request's prompt tokens
/// that the tree holds on its locked path (never a decoded token: those are in no source).
/// Returns whether any were dropped.
fn release_cached_prompt(t: &mut Tracked) -> bool {
    t.source.is_some() && t.kv.drop_cached_prefix(t.prompt_len) > 0
}

fn inv(msg: String) -> ManagerError {
    ManagerError::Invariant(radixkv_radix::InvariantViolation(msg))
}

fn running_mut(reqs: &mut Table<Tracked>, id: ReqId) -> Result<&mut Tracked> {
    // Not `ok_or`: its eagerly built error is dropped on every call, and this runs per decode
    // token.
    let Some(t) = reqs.get_mut(id.0) else {
        return Err(ManagerError::UnknownRequest(id.0));
    };
    if t.phase != Phase::Running {
        return Err(t.lifecycle(id, "not running (admit it first)"));
    }
    Ok(t)
}

/// Everything allocated so far was computed by the forward that just ended.
fn commit_pending(kv: &mut RequestKv) -> Result<()> {
    let n = kv.allocated_len.min(kv.key_len()) - kv.committed_len;
    Ok(kv.commit(n)?)
}

/// Allocates `n` slots for `t`, counting evictions and consuming its reservation.
/// Allocates `n` slots inside the pages the row already has, if they fit: most decode tokens
/// do, and with a page-granular cache that is bookkeeping only, no cache call. Returns false
/// (changing nothing) when new pages are needed.
#[inline]
fn alloc_in_place(reserved_total: &mut usize, t: &mut Tracked, n: usize) -> bool {
    if t.kv.allocated_len + n > t.row_capacity {
        return false;
    }
    t.kv.allocated_len += n;
    let used = n.min(t.reserved);
    t.reserved -= used;
    *reserved_total -= used;
    true
}

fn alloc(
    cache: &mut dyn ManagedCache,
    page_size: usize,
    in_place: bool,
    metrics: &mut Metrics,
    reserved_total: &mut usize,
    t: &mut Tracked,
    n: usize,
) -> Result<()> {
    if in_place && alloc_in_place(reserved_total, t, n) {
        return Ok(());
    }
    // Eviction is only possible when the allocation needs new pages and the free ones may not
    // cover them.
    let p = page_size;
    let have = t.kv.allocated_len;
    let new_pages = (have + n).div_ceil(p) - have.div_ceil(p);
    let may_evict = new_pages > 0 && cache.pools().pages.available() < new_pages + 1;
    let cached_before = if may_evict {
        cache.evictable_tokens() + cache.protected_tokens()
    } else {
        0
    };
    if let Err(e) = cache.alloc_tokens(&mut t.kv, n) {
        metrics.counters.out_of_memory += 1;
        return Err(match e {
            radixkv_radix::CacheError::OutOfPages { .. } => ManagerError::OutOfMemory {
                needed: n,
                available: cache.available_tokens(),
            },
            // The sliding-window pool is the short one: nothing was allocated in either.
            radixkv_radix::CacheError::OutOfComponentPages {
                component: "swa",
                available,
                ..
            } => ManagerError::OutOfMemory {
                needed: n,
                available: available.saturating_mul(page_size),
            },
            e => e.into(),
        });
    }
    if in_place && let Some(row) = t.kv.row {
        t.row_capacity = cache
            .pools()
            .rows
            .pages(row)
            .map_or(0, |pages| pages.len() * p);
    }
    if may_evict {
        // Allocation changes the tree only by evicting.
        let cached_after = cache.evictable_tokens() + cache.protected_tokens();
        metrics.counters.evicted_tokens += cached_before.saturating_sub(cached_after) as u64;
    }
    let used = n.min(t.reserved);
    t.reserved -= used;
    *reserved_total -= used;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_request_keeps_no_list_of_its_matched_pages() {
        let mut kv = KvCacheManager::builder()
            .device_tokens(4096)
            .page_size(4)
            .build()
            .unwrap();
        let serve = |kv: &mut KvCacheManager, tokens: Vec<TokenId>| {
            let r = kv.arrive(Request::new(tokens).max_new_tokens(1)).unwrap();
            let Admission::Ready(a) = kv.admit(r).unwrap() else {
                panic!("admitted")
            };
            kv.extend(r, a.extend_tokens).unwrap();
            (r, a)
        };
        let (first, _) = serve(&mut kv, (0..64).collect());
        let step = kv.begin_step();
        kv.chunk_done(first).unwrap();
        kv.finish(first).unwrap();
        kv.end_step(step).unwrap();
        // The second request reuses the first's 64 tokens: 16 pages, in its row.
        let (second, a) = serve(&mut kv, (0..100).collect());
        assert_eq!(a.device_tokens, 64);
        let t = kv.requests.get(second.0).unwrap();
        assert_eq!(t.kv.prefix_len, 64);
        assert_eq!(
            t.kv.prefix_pages.capacity(),
            0,
            "the match's page list is gone"
        );
        assert_eq!(kv.pages(second).unwrap().len(), 25);
        kv.abort(second).unwrap();
        kv.check_invariants().unwrap();
    }
}
