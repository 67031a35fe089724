//! The values the scheduler exchanges with [`crate::KvCacheManager`]: requests and their
//! handles, admission outcomes, and the per-step handle with its per-layer load wait.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use radixkv_radix::{
    CheckpointKind, MambaCheckpoint, MambaCow, MambaTrack, Namespace, PageHasher, PageHashes,
    RequestKv, TokenId,
};

use crate::error::Result;
use crate::factory::{LayerWait, StepTransfers};

/// Where a lazily submitted request's prompt tokens come from ([`Request::lazy`]).
///
/// A request that arrives with a source holds no tokens while it waits: the manager asks the
/// source for them when it tries to admit the request (and when something needs them earlier:
/// a storage tier's prefetch at [`KvCacheManager::arrive`](crate::KvCacheManager::arrive),
/// which fills them, hashes them and drops them at once). So the memory of a backlog is the
/// sources' (an engine's shared prompt buffer, a trace's block ids), not the manager's.
///
/// A source must give the same tokens every time it is asked (a request may be asked again
/// after a wait or a retraction), exactly [`TokenSource::len`] of them.
pub trait TokenSource: Send + Sync + std::fmt::Debug {
    /// The prompt's length in tokens (fixed; at least one for a request that can arrive).
    fn len(&self) -> usize;

    /// True when the prompt has no tokens (such a request is refused at arrival).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the prompt's [`TokenSource::len`] tokens to `out` (whose other contents it
    /// leaves alone).
    ///
    /// # Errors
    /// Whatever keeps the source from producing them (a prompt evicted from an engine-side
    /// store, say). The manager reports it as
    /// [`ManagerError::TokenSource`](crate::ManagerError::TokenSource), and as the same error
    /// when the source appends another number of tokens than it said; the request then
    /// holds nothing and waits (abort it).
    fn fill(&self, out: &mut Vec<TokenId>) -> std::result::Result<(), TokenSourceError>;

    /// Appends the match hashes of the prompt's leading whole pages under `hasher` in the
    /// request's `namespace` to `out` (empty; see [`radixkv_radix::page_hash`]), given the
    /// `tokens` [`TokenSource::fill`] just produced. A source that keeps its prompts' hashes
    /// (extending them as a conversation grows, say: a clone of [`PageHashes`] shares them)
    /// hands them over here, and the manager then matches the cached prefix one
    /// tree node at a time instead of one token at a time. The default gives none (the match
    /// compares tokens).
    ///
    /// They must be `hasher`'s chain over `tokens`' pages (as many leading pages as the
    /// source has). Debug builds check them and refuse others
    /// ([`ManagerError::TokenSource`](crate::ManagerError::TokenSource)); release builds trust
    /// them.
    fn fill_page_hashes(
        &self,
        hasher: &PageHasher,
        namespace: &Namespace,
        tokens: &[TokenId],
        out: &mut PageHashes,
    ) {
        let _ = (hasher, namespace, tokens, out);
    }
}

/// Why a [`TokenSource`] could not produce its tokens (a message for the engine's logs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenSourceError(pub String);

impl std::fmt::Display for TokenSourceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TokenSourceError {}

/// A prompt shared with the engine ([`Request::shared`]): the manager copies it out at
/// admission and keeps nothing of it while the request waits.
impl TokenSource for Arc<[TokenId]> {
    fn len(&self) -> usize {
        <[TokenId]>::len(self)
    }

    fn fill(&self, out: &mut Vec<TokenId>) -> std::result::Result<(), TokenSourceError> {
        out.extend_from_slice(self);
        Ok(())
    }
}

/// What the requests registered with a manager hold in token storage
/// ([`KvCacheManager::token_storage`](crate::KvCacheManager::token_storage)): the bytes of
/// their token vectors (capacity, not length), so that a scheduler (or a test) can check that
/// a backlog costs the tokens' sources, not the manager.
///
/// A waiting request holds tokens when it arrived with them ([`Request::new`]), and a lazy
/// one ([`Request::lazy`]) only while it is the last lazy request an admission attempt
/// materialised and it still waits (at most one such request at a time: the head of a FCFS
/// queue, retried every step, is not materialised again at every try), or while it holds a
/// session's KV lent to it (a turn of a session whose close waits for it). A lazy request that
/// was retracted keeps the tokens it decoded (they are in no source) and nothing of its
/// prompt.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenStorage {
    /// Requests waiting (arrived or retracted, not admitted).
    pub waiting_requests: usize,
    /// Of those, requests holding their prompt's tokens.
    pub waiting_materialised: usize,
    /// Of those, lazy requests holding their prompt's tokens (at most one, unless turns hold
    /// session KV lent to them while their session's close waits).
    pub waiting_lazy_materialised: usize,
    /// Bytes of token storage held by waiting requests: materialised prompts (and their
    /// decoded tokens) and the decoded tokens retracted lazy requests keep.
    pub waiting_bytes: usize,
    /// Bytes of token storage held by running requests (prompt and decoded tokens, with the
    /// room reserved for the decoded ones).
    pub running_bytes: usize,
}

/// A request as the scheduler submits it.
///
/// Its prompt is either owned ([`Request::new`]: [`Request::tokens`], kept by the manager
/// from arrival to the end) or given by a [`TokenSource`] ([`Request::lazy`],
/// [`Request::shared`]: [`Request::source`], materialised only when the manager tries to admit
/// the request), never both.
#[derive(Clone, Debug, Default)]
pub struct Request {
    /// Prompt tokens (at least one), or empty when [`Request::source`] gives them.
    pub tokens: Vec<TokenId>,
    /// Match hashes of [`Request::tokens`]' leading whole pages (optional; see
    /// [`KvCacheManager::page_hasher`](crate::KvCacheManager::page_hasher) and
    /// [`radixkv_radix::page_hash`]). A lazy request's come from its source
    /// ([`TokenSource::fill_page_hashes`]), so this must be empty for one.
    pub page_hashes: PageHashes,
    /// Where the prompt's tokens come from, for a request that does not own them (then
    /// [`Request::tokens`] must be empty, or arrival refuses the request).
    pub source: Option<Arc<dyn TokenSource>>,
    /// Tenant / LoRA / cache-salt namespace.
    pub namespace: Namespace,
    /// The streaming session this request continues, if any (opened on first use; a turn
    /// arriving while the session's close is deferred runs untagged, see
    /// [`KvCacheManager::close_session`](crate::KvCacheManager::close_session)).
    pub session: Option<u64>,
    /// Priority (for the priority eviction policy).
    pub priority: i32,
    /// Maximum output tokens (drives the admission reservation).
    pub max_new_tokens: usize,
    /// Optional cap on the reusable prefix (e.g. a logprob start position).
    pub max_prefix_len: Option<usize>,
    /// The engine's own id for the request (its `rid`), if it has one: attached to the
    /// request's `tracing` span and named by every [`ManagerError`](crate::ManagerError) about
    /// the request, so logs and errors speak the engine's ids. The manager never interprets it
    /// (it need not be unique); without one, messages name the manager's handle ([`ReqId`]).
    pub engine_id: Option<String>,
}

impl Request {
    /// A request for `tokens` in the default namespace. The manager keeps them from arrival
    /// on, waiting included; see [`Request::lazy`] for a request that holds nothing while it
    /// waits.
    pub fn new(tokens: Vec<TokenId>) -> Self {
        Request {
            tokens,
            ..Default::default()
        }
    }

    /// A request whose prompt `source` gives, in the default namespace: the manager holds none
    /// of its tokens while it waits and fills them from `source` when it tries to admit it
    /// (see [`TokenSource`] and [`TokenStorage`]). Admission, hits and events are those of
    /// [`Request::new`] with the same tokens.
    pub fn lazy(source: Arc<dyn TokenSource>) -> Self {
        Request {
            source: Some(source),
            ..Default::default()
        }
    }

    /// A request for a prompt the engine keeps (`Arc<[TokenId]>`): [`Request::lazy`] over it,
    /// so that the manager copies the tokens only at admission.
    pub fn shared(tokens: Arc<[TokenId]>) -> Self {
        Request::lazy(Arc::new(tokens))
    }

    /// The prompt's length in tokens (from the source for a lazy request).
    pub fn prompt_len(&self) -> usize {
        self.source.as_ref().map_or(self.tokens.len(), |s| s.len())
    }

    /// Sets the namespace.
    pub fn namespace(mut self, ns: Namespace) -> Self {
        self.namespace = ns;
        self
    }

    /// Sets the session.
    pub fn session(mut self, id: u64) -> Self {
        self.session = Some(id);
        self
    }

    /// Sets the output budget.
    pub fn max_new_tokens(mut self, n: usize) -> Self {
        self.max_new_tokens = n;
        self
    }

    /// Sets the match hashes of the prompt's leading pages (see [`Request::page_hashes`]).
    pub fn page_hashes(mut self, hashes: impl Into<PageHashes>) -> Self {
        self.page_hashes = hashes.into();
        self
    }

    /// Sets the engine's id for the request (see [`Request::engine_id`]).
    pub fn engine_id(mut self, id: impl Into<String>) -> Self {
        self.engine_id = Some(id.into());
        self
    }
}

/// Handle to a request inside one manager. Never reused.
///
/// It displays as `#slot` or, once its slot has been reused, `#slot.generation` (the raw
/// [`ReqId::get`] packs both into one number). Give requests an
/// [`engine_id`](Request::engine_id) to see the engine's own ids in spans and errors instead.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReqId(pub(crate) u64);

impl ReqId {
    /// The raw id: the slot in the low 32 bits, its generation in the high 32.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for ReqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (slot, generation) = (self.0 & u64::from(u32::MAX), self.0 >> 32);
        if generation == 0 {
            write!(f, "#{slot}")
        } else {
            write!(f, "#{slot}.{generation}")
        }
    }
}

/// Outcome of [`KvCacheManager::admit`](crate::KvCacheManager::admit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Admitted: locked, row allocated, reservation taken.
    Ready(Admitted),
    /// Not admitted now; nothing is held. Try again at a later step.
    Wait(WaitReason),
    /// Can never be admitted by this manager, whatever finishes or is evicted; nothing is held.
    /// Abort the request (or reject it upstream): waiting would wait forever.
    Never(NeverReason),
}

/// Why a request can never be admitted.
///
/// An outcome rather than a [`ManagerError`](crate::ManagerError): the call was made right and
/// changed nothing, like a [`Admission::Wait`], and a scheduler decides per request what to do
/// (reject it to its client, keep serving the others), which a `?` on an error would not.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum NeverReason {
    /// Its admission budget exceeds the whole device pool: the tokens not yet on the device,
    /// the clipped output reservation and one page, plus the device prefix it would lock, are
    /// more than the pool holds even with everything else evicted. (A request-pool row has no
    /// length limit of its own: the pool is the only bound.)
    PoolTooSmall {
        /// Tokens the admission needs, its matched device prefix included.
        needed: usize,
        /// Device pool capacity in tokens.
        capacity: usize,
    },
    /// Models with sliding-window layers: the SWA KV the request holds at its peak (its first
    /// prefill chunk, or its window and the pages past it while it decodes) is more than the
    /// whole SWA pool.
    WindowPoolTooSmall {
        /// SWA tokens (pages × page size) the request may hold at its peak.
        needed: usize,
        /// SWA pool capacity in tokens.
        capacity: usize,
    },
}

/// The Mamba checkpoints of one admission ([`Admitted::mamba_checkpoints`]), held inline so
/// that an admission allocates nothing for them. Derefs to `&[MambaCheckpoint]`. Holds at most
/// [`RequestKv::MAX_MAMBA_SLOTS`] (a request's checkpoints are among the slots it holds, which
/// `check_request` bounds by that).
#[derive(Clone, Copy)]
pub struct MambaCheckpoints {
    len: u8,
    items: [MambaCheckpoint; RequestKv::MAX_MAMBA_SLOTS],
}

impl MambaCheckpoints {
    const UNUSED: MambaCheckpoint = MambaCheckpoint {
        pos: 0,
        slot: 0,
        kind: CheckpointKind::Branch,
    };

    /// The first [`RequestKv::MAX_MAMBA_SLOTS`] checkpoints of `all` (all of them for a
    /// request that passes `check_request`).
    pub fn from_slice(all: &[MambaCheckpoint]) -> Self {
        let mut c = MambaCheckpoints::default();
        for (dst, src) in c.items.iter_mut().zip(all) {
            *dst = *src;
            c.len += 1;
        }
        c
    }
}

impl Default for MambaCheckpoints {
    fn default() -> Self {
        MambaCheckpoints {
            len: 0,
            items: [Self::UNUSED; RequestKv::MAX_MAMBA_SLOTS],
        }
    }
}

impl std::ops::Deref for MambaCheckpoints {
    type Target = [MambaCheckpoint];

    fn deref(&self) -> &[MambaCheckpoint] {
        &self.items[..usize::from(self.len)]
    }
}

impl std::fmt::Debug for MambaCheckpoints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl PartialEq for MambaCheckpoints {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for MambaCheckpoints {}

/// What an admission reused and what remains to compute.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Admitted {
    /// Tokens reused from the device tier.
    pub device_tokens: usize,
    /// Tokens reused from the host tier (loaded back this step).
    pub host_tokens: usize,
    /// Of [`Admitted::host_tokens`], those the storage tier prefetched into the host tier for
    /// this request (read from the store before this admission; 0 without a storage tier).
    pub storage_tokens: usize,
    /// Tokens that must be computed (prefill).
    pub extend_tokens: usize,
    /// How far the device KV match went (at least [`Admitted::device_tokens`]). On a model with
    /// Mamba layers the usable prefix stops at the deepest cached state; when the KV matched
    /// deeper, the forward pass should checkpoint the request's state at this length so that
    /// the next request on the path hits there. Equal to `device_tokens` on other models.
    pub kv_match_tokens: usize,
    /// The request's own Mamba state slot (models with Mamba layers): the forward pass reads
    /// and writes the request's recurrent state there. `None` on other models.
    pub mamba_slot: Option<u32>,
    /// A Mamba hit's copy on write: the engine copies the cached state `src` into the
    /// request's slot `dst` (= [`Admitted::mamba_slot`]) before the request's first forward.
    /// `None` on a miss (the slot starts from the zero state) and on other models.
    pub mamba_cow: Option<MambaCow>,
    /// The checkpoints the request's forward pass takes (branch points, see
    /// [`KvCacheManager::mamba_checkpoints`](crate::KvCacheManager::mamba_checkpoints)): when it
    /// passes position `pos` the engine copies the running state into `slot`. Empty on other
    /// models. Held inline (no allocation per admission); it
    /// derefs to a slice.
    pub mamba_checkpoints: MambaCheckpoints,
    /// The request's tracking slot (models with Mamba layers, where the policy keeps
    /// request-end states and a slot could be spared; see [`MambaTrack`] for the engine's
    /// contract): after every forward step the engine keeps in `slot` the running state at
    /// the last page boundary at or below the computed length. At admission `pos` is the
    /// cached prefix (the tracked state is the copy-on-write source or the zero state until a
    /// boundary is passed); it moves as chunks are cached, see
    /// [`KvCacheManager::mamba_track`](crate::KvCacheManager::mamba_track). A finish that does
    /// not end a page stores this state, at the computed length floored to a page, for the
    /// next request on the path. `None` on other models, without a spare slot, and with the
    /// disabled cache. A session turn served from its session's slot continues in the
    /// tracking slot the previous turn left (same slot, `pos` at its computed length floored
    /// to a page). Where the policy keeps chunk-end states, each chunk hands the slot to the
    /// tree and the request continues with a fresh one
    /// ([`KvCacheManager::mamba_track`](crate::KvCacheManager::mamba_track)).
    pub mamba_track: Option<MambaTrack>,
}

impl Admitted {
    /// Tokens reused from any tier.
    pub fn cached_tokens(&self) -> usize {
        self.device_tokens + self.host_tokens
    }
}

/// Why an admission must wait.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum WaitReason {
    /// The admission budget is short.
    NoRoom {
        /// Tokens the request needs (extend + clipped output + one page).
        needed: usize,
        /// Tokens available for admission after the temporary lock.
        available: usize,
    },
    /// Every request-pool row is in use.
    NoRow,
    /// The room the request needs is being freed by a host tier's write-back eviction: its
    /// victims are copied to the host first and leave the device at the copies' acks, which a
    /// later step applies. Admission budget was enough ([`WaitReason::NoRoom`] otherwise).
    RoomInFlight {
        /// Tokens the request needs (extend + clipped output + one page).
        needed: usize,
    },
    /// The request needs a load from the host tier, and the tier already holds its limit of
    /// pending loads (`HiCacheConfig::max_pending_ops`); they complete by the next step.
    TransfersBusy,
    /// The request needs a load from the host tier, and it is admitted while a step is open
    /// that began with nothing to load: that step's handle waits for no load, so one started
    /// now could not join it. Admit it before the next
    /// [`KvCacheManager::begin_step`](crate::KvCacheManager::begin_step) (the documented order:
    /// form the batch, then begin the step), which starts its load. Nothing is held meanwhile.
    OpenStepLoadsNothing,
    /// Models with Mamba layers: every Mamba state slot is held by a running request or by a
    /// cached state a running request has locked, so the request cannot get its own slot (a
    /// hit also keeps the state it copies from). A running request holds its running slot
    /// and, taken only while another slot stays obtainable for the next admission, up to
    /// three optional ones (its tracking slot, [`Admitted::mamba_track`], and its branch
    /// checkpoints; `RequestKv::MAX_MAMBA_SLOTS` in all): a request that waits here
    /// is never kept out by an optional slot taken after the last admission. A slot frees
    /// when a running request finishes (or a checkpoint is stored by its chunk).
    NoStateSlot,
    /// Models with sliding-window layers: the SWA KV pool is short. The request needs SWA
    /// pages for what it allocates before its window slides (see
    /// [`KvCacheManager::admit`](crate::KvCacheManager::admit)); free and evictable window KV,
    /// less what running requests may still take, is less.
    NoWindowRoom {
        /// SWA tokens (pages × page size) the request may hold at its peak.
        needed: usize,
        /// SWA tokens available for it.
        available: usize,
    },
    /// Storage tier: the request's prefix past the device and host match is being prefetched
    /// from the store (started by [`KvCacheManager::arrive`](crate::KvCacheManager::arrive)),
    /// and the stop policy (`[cache.storage] stop`: `wait_complete`, or `timeout` before its
    /// deadline) keeps it waiting until the pages have arrived. Nothing is held for it but the
    /// host pages the prefetch reserved; steps ([`KvCacheManager::end_step`](crate::KvCacheManager::end_step))
    /// move the prefetch on, and a later admission takes what arrived as a host hit.
    /// [`KvCacheManager::abort`](crate::KvCacheManager::abort) ends the prefetch and frees its pages.
    Prefetching,
}

/// One scheduler step, from [`KvCacheManager::begin_step`](crate::KvCacheManager::begin_step) to [`KvCacheManager::end_step`](crate::KvCacheManager::end_step).
///
/// The handle covers every load the step's requests need: the loads queued by admissions
/// before `begin_step`, which it starts, and those of admissions made while the step is open,
/// which start at once and join it when the step began with loads of its own. So a request
/// admitted at any point up to the forward is waited for by [`StepHandle::wait_layer`]; read
/// the load figures and start the forward after the step's last admission. In a step that
/// began with nothing to load (most steps), the handle shares nothing with the manager, and an
/// admission that needs a load waits for the next step
/// ([`WaitReason::OpenStepLoadsNothing`]).
#[derive(Debug)]
pub struct StepHandle {
    pub(crate) index: u64,
    pub(crate) layers: u32,
    /// The step's loads, shared with the manager while the step is open; `None` for a step
    /// that began with nothing to load and for a cache that never loads
    /// ([`ManagedCache::starts_loads`](crate::ManagedCache::starts_loads)): such steps cost no
    /// shared set.
    pub(crate) loads: Option<Arc<StepLoadSet>>,
    /// Nanoseconds spent blocked in `wait_layer` (atomic: the forward may wait from another
    /// thread than the scheduler's), for the load-wait histogram.
    pub(crate) waited_ns: AtomicU64,
    pub(crate) span: tracing::Span,
}

/// The loads a step covers, shared between its handle and the manager (which adds the loads of
/// admissions made while the step is open).
#[derive(Debug, Default)]
pub(crate) struct StepLoadSet {
    pages: AtomicU64,
    bytes: AtomicU64,
    waits: Mutex<Vec<Arc<dyn LayerWait>>>,
}

impl StepLoadSet {
    /// Adds a started load (or the failing wait of loads that could not be started).
    pub(crate) fn add(&self, pages: u64, bytes: u64, wait: Option<Arc<dyn LayerWait>>) {
        // Most steps load nothing: no atomic read-modify-write for them.
        if pages > 0 {
            self.pages.fetch_add(pages, Ordering::Relaxed);
        }
        if bytes > 0 {
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        if let Some(w) = wait {
            self.locked_waits().push(w);
        }
    }

    /// Empties a set nobody else holds, for the next step (`Arc::get_mut` proves that no
    /// handle or admission can still see it).
    pub(crate) fn reset(&mut self) {
        *self.pages.get_mut() = 0;
        *self.bytes.get_mut() = 0;
        self.waits
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Modeled bytes added so far.
    pub(crate) fn load_bytes_now(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The waits so far, locked (never held across a blocking wait).
    fn locked_waits(&self) -> std::sync::MutexGuard<'_, Vec<Arc<dyn LayerWait>>> {
        self.waits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The waits so far, copied out so that nobody blocks while holding the lock.
    fn waits(&self) -> Vec<Arc<dyn LayerWait>> {
        self.locked_waits().clone()
    }
}

impl StepHandle {
    /// The step number.
    pub fn index(&self) -> u64 {
        self.index
    }

    /// Modeled bytes this step's forward waits for (host → device loads started by this step):
    /// pages × the model's page bytes, whatever the backend really copies. Grows when a request
    /// is admitted while the step is open.
    pub fn load_bytes(&self) -> u64 {
        self.loads.as_ref().map_or(0, |l| l.load_bytes_now())
    }

    /// Pages whose load this step started.
    pub fn load_pages(&self) -> u64 {
        self.loads
            .as_ref()
            .map_or(0, |l| l.pages.load(Ordering::Relaxed))
    }

    /// Blocks until layer `layer`'s share of this step's loads is on the device (the
    /// backend's real per-layer completion events). Returns at once when nothing was loaded.
    ///
    /// # Errors
    /// [`ManagerError::Tier`](crate::ManagerError::Tier) when the layer's copy failed: the batch must not read it;
    /// `end_step` repairs the KV (or reports that it could not).
    pub fn wait_layer(&self, layer: u32) -> Result<()> {
        let Some(loads) = &self.loads else {
            return Ok(());
        };
        let waits = loads.waits();
        if waits.is_empty() {
            return Ok(());
        }
        let start = std::time::Instant::now();
        let r = waits.iter().try_for_each(|w| w.wait_layer(layer));
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.waited_ns.fetch_add(ns, Ordering::Relaxed);
        r
    }

    /// Nanoseconds spent blocked in [`StepHandle::wait_layer`] so far.
    pub(crate) fn waited_ns(&self) -> u64 {
        self.waited_ns.load(Ordering::Relaxed)
    }

    /// True when layer `layer`'s load is complete (or there is none).
    pub fn is_layer_done(&self, layer: u32) -> bool {
        // A non-blocking poll: no need to copy the waits out of the lock.
        self.loads
            .as_ref()
            .is_none_or(|l| l.locked_waits().iter().all(|w| w.is_layer_done(layer)))
    }

    /// Bytes layer `layer`'s forward waits for: loads are issued layer by layer, so layer `i`
    /// only waits for its own share.
    pub fn layer_load_bytes(&self, layer: u32) -> u64 {
        if layer >= self.layers {
            return 0;
        }
        self.load_bytes() / u64::from(self.layers)
    }

    /// The step's `tracing` span (enter it around the step's work).
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }
}

/// What a step moved between tiers.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct StepSummary {
    /// Host↔device traffic of the step (zero for a device-only cache).
    pub transfers: StepTransfers,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cleared_step_load_set_is_empty_again() {
        /// A layer wait that never completes.
        #[derive(Debug)]
        struct Stuck;
        impl LayerWait for Stuck {
            fn wait_layer(&self, _: u32) -> Result<()> {
                Err(crate::ManagerError::Storage("stuck".into()))
            }
            fn is_layer_done(&self, _: u32) -> bool {
                false
            }
        }
        let totals = |s: &StepLoadSet| {
            (
                s.pages.load(Ordering::Relaxed),
                s.load_bytes_now(),
                s.waits().len(),
            )
        };
        let mut set = StepLoadSet::default();
        set.reset();
        assert_eq!(totals(&set), (0, 0, 0));
        set.add(3, 300, Some(Arc::new(Stuck)));
        set.add(2, 0, None);
        assert_eq!(totals(&set), (5, 300, 1));
        set.reset();
        assert_eq!(totals(&set), (0, 0, 0));
        // A wait added with no pages (an earlier load's, or a refusal's) is cleared too, and
        // so again after a reset.
        for _ in 0..2 {
            set.add(0, 0, Some(Arc::new(Stuck)));
            assert_eq!(totals(&set), (0, 0, 1));
            set.reset();
            assert_eq!(totals(&set), (0, 0, 0));
        }
    }

    #[test]
    fn mamba_checkpoints_hold_a_request_s_checkpoints_inline() {
        let c = |pos, slot| MambaCheckpoint {
            pos,
            slot,
            kind: CheckpointKind::PromptEnd,
        };
        let empty = MambaCheckpoints::default();
        assert!(empty.is_empty());
        assert_eq!(format!("{empty:?}"), "[]");
        let two = MambaCheckpoints::from_slice(&[c(16, 3), c(32, 5)]);
        assert_eq!(&*two, &[c(16, 3), c(32, 5)]);
        assert_eq!(two[1].slot, 5);
        assert_eq!(two, MambaCheckpoints::from_slice(&[c(16, 3), c(32, 5)]));
        assert_ne!(two, MambaCheckpoints::from_slice(&[c(16, 3)]));
        assert_eq!(format!("{two:?}"), format!("{:?}", [c(16, 3), c(32, 5)]));
        // More than a request can hold: the first MAX_MAMBA_SLOTS (check_request refuses such
        // a request).
        let many: Vec<_> = (0..9).map(|i| c(16 * (i + 1), i as u32)).collect();
        let capped = MambaCheckpoints::from_slice(&many);
        assert_eq!(&*capped, &many[..RequestKv::MAX_MAMBA_SLOTS]);
    }
}
