//! The reference continuous-batching scheduler: FCFS admission under the manager's budget,
//! chunked prefill under a per-step prefill token budget, one decode token per running
//! request per step, retraction of the youngest request on decode out-of-memory. Time is
//! simulated by the [`CostModel`]; the manager's CPU time is measured around its calls (see
//! [`super::cpu`]).

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ahash::HashMap;

use radixkv_radix::{Namespace, PageHasher, PageHashes, TokenId, pages_for};
use serde::Serialize;

use super::cost::CostModel;
use super::cpu::{CpuClock, Phase};
use super::ideal::IdealCache;
use super::load::{self, Arrivals, LoadMeter, LoadReport};
use super::memory::MemoryUse;
use super::report::{
    CpuBreakdown, CpuWaits, MambaReport, MemoReport, OccupancySample, Report, SwaReport, quantile,
};
use crate::trace::{HashMemo, MemoLedger, PageHashing, Trace};
use radixkv_scheduler_api::config::{CacheKind, MambaPolicyKind, ManagerConfig};
use radixkv_scheduler_api::error::{ManagerError, Result, StallCause};
use radixkv_scheduler_api::{
    Admission, KvCacheManager, ReqId, Request, TokenSource, TokenSourceError, WaitReason,
};

/// Scheduler and simulation parameters.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimConfig {
    /// The manager under test.
    pub manager: ManagerConfig,
    /// Simulated costs.
    pub cost: CostModel,
    /// Prefill tokens per step (the chunk size of chunked prefill).
    pub prefill_budget: usize,
    /// Maximum running requests (the decode batch).
    pub max_running: usize,
    /// Audit every invariant of the manager and its cache every this many steps (0: only the
    /// final audit, plus the manager's own per-step audit in debug builds). A violation ends
    /// the replay with [`ManagerError::Invariant`].
    pub check_invariants_every: u64,
    /// Fail the replay with [`ManagerError::Invariant`] as soon as the resident memory has
    /// grown by more than this many MiB since warm-up (see [`super::MemoryUse::warm_kib`]),
    /// or by the end. Where the platform does not report memory, asking for it is an error.
    pub max_rss_growth_mib: Option<u64>,
    /// How arrivals are timed: the workload's own times, or its conversations' starts spread
    /// by a factor, or spread for a target load of the simulated GPU (see [`Arrivals`]).
    pub arrivals: Arrivals,
    /// Whether the prompts carry match hashes, as an engine that keeps them would hand them
    /// over ([`radixkv_scheduler_api::TokenSource::fill_page_hashes`]).
    pub page_hashes: PageHashMode,
    /// Running requests keep their whole prompts. By default the replay has the manager drop
    /// a running request's prompt tokens that the tree holds for it wherever its cache allows
    /// ([`ManagerConfig::release_cached_prompts`]: radix or HiCache, sessions or not, without
    /// Mamba or sliding-window layers), so that the running prompts are held once.
    pub keep_running_prompts: bool,
}

/// How the replay's prompts carry match hashes (see [`radixkv_radix::page_hash`]). Hashing is
/// the engine's work: its time is reported apart and not counted as the manager's CPU.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PageHashMode {
    /// No hashes: every match compares tokens.
    Off,
    /// Each prompt hashed whole when it is admitted.
    Whole,
    /// Hashes kept per conversation and extended turn by turn: a turn hashes only the pages
    /// its conversation's kept prompts did not have. Prompts outside a conversation carry
    /// none (an engine with nothing to extend; on Mooncake's short, session-less prompts
    /// hashing each whole prompt cost more than the match it saved).
    #[default]
    Conversation,
}

impl PageHashMode {
    /// Every mode.
    pub const ALL: [PageHashMode; 3] = [Self::Off, Self::Whole, Self::Conversation];

    /// The mode's name (`off`, `whole`, `conversation`).
    pub fn name(self) -> &'static str {
        match self {
            PageHashMode::Off => "off",
            PageHashMode::Whole => "whole",
            PageHashMode::Conversation => "conversation",
        }
    }

    /// The mode named `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            manager: ManagerConfig::default(),
            cost: CostModel::default(),
            prefill_budget: 8192,
            max_running: 256,
            check_invariants_every: 0,
            max_rss_growth_mib: None,
            arrivals: Arrivals::Trace,
            page_hashes: PageHashMode::default(),
            keep_running_prompts: false,
        }
    }
}

#[derive(Debug)]
struct Job {
    index: usize,
    id: ReqId,
    generated: u32,
    prefill_left: usize,
    first_admitted: bool,
    role: Role,
    output: Vec<TokenId>,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Role {
    Idle,
    Prefill,
    Decode,
}

/// A trace request's prompt source that clocks its fills: generating a prompt's tokens from
/// its block ids stands in for the engine handing over a prompt buffer, and is not the
/// manager's CPU, so the replay takes it out of the phase whose call filled it.
#[derive(Debug)]
struct TimedSource {
    inner: Arc<dyn TokenSource>,
    /// Nanoseconds of fills and hashing, taken out of the manager's CPU.
    fill_ns: Arc<AtomicU64>,
    /// Of those, nanoseconds of hashing (the engine's share, reported).
    hash_ns: Arc<AtomicU64>,
}

impl TokenSource for TimedSource {
    fn len(&self) -> usize {
        self.inner.len()
    }

    fn fill(&self, out: &mut Vec<TokenId>) -> std::result::Result<(), TokenSourceError> {
        let t0 = Instant::now();
        let r = self.inner.fill(out);
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.fill_ns.fetch_add(ns, Ordering::Relaxed);
        r
    }

    fn fill_page_hashes(
        &self,
        hasher: &PageHasher,
        namespace: &Namespace,
        tokens: &[TokenId],
        out: &mut PageHashes,
    ) {
        let (t0, had) = (Instant::now(), out.len());
        self.inner.fill_page_hashes(hasher, namespace, tokens, out);
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.fill_ns.fetch_add(ns, Ordering::Relaxed);
        if out.len() > had {
            // Hashing time is reported only where a source hashed (not the empty call).
            self.hash_ns.fetch_add(ns, Ordering::Relaxed);
        }
    }
}

/// What a step's forward does to the running requests (see `Sim::forward`).
#[derive(Default)]
struct Forward {
    /// Requests whose prefill chunk it commits.
    chunked: Vec<ReqId>,
    /// Arrival times (µs) of the requests whose first token it emits.
    first_tokens: Vec<f64>,
    /// Requests it finishes, with their sessions.
    done: Vec<(ReqId, Option<u64>)>,
}

/// Observes replay progress (a progress bar, or nothing).
pub trait Progress {
    /// `n` more requests finished (called only after a step that finished some).
    fn advance(&mut self, n: u64);
}

impl Progress for () {
    fn advance(&mut self, _n: u64) {}
}

/// Replays `trace` under `cfg` and reports.
///
/// # Errors
/// [`ManagerError::Trace`] for a trace without requests (as the trace readers refuse one),
/// [`ManagerError::PoolTooSmall`] when some request can never fit,
/// [`ManagerError::Stalled`] when the replay cannot progress although every request fits (a
/// request is refused and nothing running could free memory), configuration errors, and any
/// error of the manager (which would be a bug).
///
/// `trace` is lent (`&trace`) or given (`trace`): a replay whose load control spreads the
/// conversations ([`SimConfig::arrivals`]) retimes a given trace in place and copies a lent
/// one.
pub fn replay<'t>(
    trace: impl Into<Cow<'t, Trace>>,
    cfg: &SimConfig,
    progress: &mut dyn Progress,
) -> Result<Report> {
    let (timed, load, ideal) = load::retime(trace.into(), cfg)?;
    let ideal = ideal.unwrap_or_else(|| ideal_hits(&timed, cfg.manager.model.page_size));
    replay_with_ideal(&timed, cfg, &ideal, load, progress)
}

/// [`replay`] of a trace already timed by [`load::retime`] (`load` says how), with its
/// infinite-cache ideal already computed by [`ideal_hits`] (at `cfg`'s page size), so that a
/// comparison computes both once and every configuration reports the same figures.
pub(super) fn replay_with_ideal(
    trace: &Trace,
    cfg: &SimConfig,
    ideal: &[u64],
    load: LoadReport,
    progress: &mut dyn Progress,
) -> Result<Report> {
    let started = Instant::now();
    if ideal.len() != trace.requests.len() {
        return Err(ManagerError::Config(format!(
            "the ideal covers {} requests, the trace has {}",
            ideal.len(),
            trace.requests.len()
        )));
    }
    if trace.requests.is_empty() {
        return Err(ManagerError::Trace {
            path: trace.name.clone(),
            line: 0,
            message: "the trace has no requests".into(),
        });
    }
    check_fits(trace, &cfg.manager)?;
    if cfg.prefill_budget == 0 || cfg.max_running == 0 {
        return Err(ManagerError::Config(
            "prefill budget and max running requests must be positive".into(),
        ));
    }
    let memory = MemoryUse::start(trace.requests.len() as u64);
    if cfg.max_rss_growth_mib.is_some() && memory.is_none() {
        return Err(ManagerError::Config(
            "a resident-memory limit needs a platform that reports resident memory".into(),
        ));
    }
    let mut kv = KvCacheManager::new(cfg.manager.clone())?;
    if !cfg.keep_running_prompts && kv.can_release_cached_prompts() {
        kv.set_release_cached_prompts(true)?;
    }
    // Requests left per session: the last one's finish closes the session.
    let turns_left = if cfg.manager.sessions.is_some() {
        TurnsLeft::of(trace)
    } else {
        TurnsLeft::default()
    };
    let mut sim = Sim {
        turns_left,
        decode_batch: Vec::new(),
        trace,
        cfg,
        ideal_hits: ideal,
        waiting: VecDeque::new(),
        running: Vec::new(),
        now_us: 0.0,
        cpu: CpuClock::new(),
        fill_ns: Arc::default(),
        hash_ns: Arc::default(),
        hash_memos: HashMemos::of(trace, &cfg.manager),
        room_waits: 0,
        ttft_ms: Vec::with_capacity(trace.requests.len()),
        report: Report {
            config: cfg.manager.label(),
            effective_config: cfg.clone(),
            trace: trace.name.clone(),
            page_bytes: cfg.manager.model.page_bytes(),
            ..Default::default()
        },
        sample_every: 1,
        last_finish_us: 0.0,
        memory,
        finished: 0,
        meter: LoadMeter::default(),
    };
    sim.report.load = load;
    sim.run(&mut kv, progress)?;
    // Nothing runs any more: let every transfer land and every session go.
    sim.cpu.tick();
    sim.settle(&mut kv)?;
    let t0 = Instant::now();
    kv.close_all_sessions()?;
    sim.cpu.add(Phase::Complete, t0);
    sim.cpu.tick();
    if let Some(m) = &mut sim.memory {
        m.finish();
        m.check_growth(cfg.max_rss_growth_mib, &cfg.manager.label())?;
    }
    sim.finish(&kv, started)
}

/// FLOPs of prefilling the positions `range` (0-based, so position `p` attends to `p + 1`
/// tokens) given everything before them; 0 without the model's compute shape.
fn chunk_flops(
    model: &radixkv_scheduler_api::ModelGeometry,
    range: &std::ops::Range<usize>,
) -> f64 {
    let upto = |n: usize| model.prefill_flops(n as u64).map_or(0.0, |f| f as f64);
    (upto(range.end) - upto(range.start)).max(0.0)
}

/// The infinite-cache ideal of every request, at pages of `page_size` tokens. First
/// admissions happen in arrival order (the queue is FCFS and only already-admitted requests
/// are pushed back to its front), so the ideal is computed in a pass of its own before the
/// replay, over the trace's blocks (no tokens are generated for it).
///
/// The ideal is a property of the trace, not of the configuration: a turn of a conversation
/// may also reuse its conversation's unaligned history (as a streaming session does), whether
/// or not the configuration under test has sessions. So it bounds every configuration, and
/// every row of a comparison reports the same figure (a configuration without sessions can
/// then reach only the page-aligned part of it).
///
/// A trace whose conversations share no block ([`Trace::conversations_disjoint`], the agentic
/// reader's) is followed one conversation at a time: a request can reuse only its own
/// conversation's earlier requests, so the hits are those of the pass in arrival order, and
/// the ideal holds one conversation's blocks at a time instead of the whole trace's (on the
/// whole agentic trace that set was the replay's peak heap, 28 MB while it grew).
pub(super) fn ideal_hits(trace: &Trace, page_size: usize) -> Vec<u64> {
    if trace.conversations_disjoint {
        return ideal_hits_by_conversation(trace, page_size);
    }
    let mut ideal = IdealCache::new(page_size);
    let mut left = TurnsLeft::of(trace);
    trace
        .requests
        .iter()
        .map(|r| match r.session {
            Some(s) => {
                let hit = ideal.admit_turn(s, r);
                if left.over(s) {
                    ideal.close_session(s);
                }
                hit
            }
            None => ideal.admit(r),
        })
        .collect()
}

/// [`ideal_hits`] of a trace whose conversations share no block: each conversation's
/// requests in arrival order, against an ideal cache that holds that conversation alone.
fn ideal_hits_by_conversation(trace: &Trace, page_size: usize) -> Vec<u64> {
    let mut order: Vec<usize> = (0..trace.requests.len()).collect();
    // Stable: a conversation's requests keep their arrival order.
    order.sort_by_key(|&i| trace.requests[i].session);
    let mut hits = vec![0; trace.requests.len()];
    let mut ideal = IdealCache::new(page_size);
    let mut current = None;
    for i in order {
        let r = &trace.requests[i];
        if r.session != current {
            ideal.clear();
            current = r.session;
        }
        hits[i] = match r.session {
            Some(s) => ideal.admit_turn(s, r),
            None => ideal.admit(r),
        };
    }
    hits
}

/// Requests left per conversation (session) of a trace: the replay closes a session, and the
/// ideal forgets a conversation's history, once its last request is over; counted down at
/// arrivals instead, it says when a conversation's hash memo is no longer needed
/// ([`HashMemos`]).
#[derive(Default)]
struct TurnsLeft(HashMap<u64, u32>);

impl TurnsLeft {
    /// Every conversation of `trace` with all its requests to come.
    fn of(trace: &Trace) -> Self {
        let mut left = HashMap::default();
        for s in trace.requests.iter().filter_map(|r| r.session) {
            *left.entry(s).or_default() += 1;
        }
        TurnsLeft(left)
    }

    /// A request of session `s` is over: whether it was that conversation's last (a session
    /// this does not count is never over).
    fn over(&mut self, s: u64) -> bool {
        let Some(n) = self.0.get_mut(&s) else {
            return false;
        };
        *n -= 1;
        if *n > 0 {
            return false;
        }
        self.0.remove(&s);
        true
    }
}

/// The hash memo of each conversation with requests still to arrive
/// ([`PageHashMode::Conversation`]): a memo leaves the map when its conversation's last
/// request arrives (that request's source keeps it while it needs it), so the memos held are
/// those of the conversations in progress.
///
/// The memos hold at most as many bytes as the pools' bookkeeping ([`HashMemos::bound`]):
/// past it, [`HashMemos::enforce`] drops the least recently used memos' prompts, and those
/// conversations' next turns hash their whole prompts. An engine keeps hashes for what it
/// may serve soon, not for every conversation it has seen: at saturation, with every
/// conversation of the agentic trace live, unbounded memos were most of the replay's memory
/// (41 MB, against pools whose bookkeeping is 4.5 MB).
#[derive(Default)]
struct HashMemos {
    memos: HashMap<u64, Arc<Mutex<HashMemo>>>,
    /// Requests of each conversation still to arrive.
    arrivals_left: TurnsLeft,
    /// What every memo holds, counted by the memos themselves.
    ledger: Arc<MemoLedger>,
    /// Every memo made, so that those whose conversations have all arrived are held to the
    /// bound too (dead ones are pruned as they are found).
    all: Vec<Weak<Mutex<HashMemo>>>,
    /// Bytes of hashes the memos may hold in all.
    bound: usize,
    /// The most bytes the memos held after an enforcement, and the memos forgotten.
    peak: usize,
    forgotten: u64,
}

impl HashMemos {
    fn of(trace: &Trace, m: &ManagerConfig) -> Self {
        HashMemos {
            memos: HashMap::default(),
            arrivals_left: TurnsLeft::of(trace),
            bound: Self::bound(m),
            ..Default::default()
        }
    }

    /// The pools' bookkeeping in bytes: a token id per token and a page id per page of the
    /// device and host pools.
    fn bound(m: &ManagerConfig) -> usize {
        let host = match &m.cache {
            CacheKind::HiCache(h) => h.host_tokens,
            CacheKind::Radix | CacheKind::Disabled => 0,
        };
        let tokens = m.device_tokens.saturating_add(host);
        let ids = std::mem::size_of::<TokenId>();
        let pages = tokens / m.model.page_size.max(1);
        tokens.saturating_add(pages).saturating_mul(ids)
    }

    /// The memo of conversation `s` for a request of it that arrives now.
    fn arrive(&mut self, s: u64) -> Arc<Mutex<HashMemo>> {
        let (ledger, all) = (&self.ledger, &mut self.all);
        let memo = self
            .memos
            .entry(s)
            .or_insert_with(|| {
                let m = Arc::new(Mutex::new(HashMemo::counted(ledger.clone())));
                all.push(Arc::downgrade(&m));
                m
            })
            .clone();
        if self.arrivals_left.over(s) {
            self.memos.remove(&s);
        }
        memo
    }

    /// Holds the memos to the bound (after the manager's calls that hash: the memos grow
    /// only there).
    fn enforce(&mut self) {
        if self.ledger.bytes() > self.bound {
            self.forget_least_recent();
        }
        self.peak = self.peak.max(self.ledger.bytes());
    }

    /// Forgets the least recently used memos until what they hold is within the bound.
    fn forget_least_recent(&mut self) {
        self.all.retain(|w| w.strong_count() > 0);
        let mut by_use: Vec<(u64, Arc<Mutex<HashMemo>>)> = self
            .all
            .iter()
            .filter_map(Weak::upgrade)
            .map(|m| {
                let t = HashMemo::lock(&m).last_use();
                (t, m)
            })
            .collect();
        by_use.sort_unstable_by_key(|(t, _)| *t);
        for (_, m) in by_use {
            if self.ledger.bytes() <= self.bound {
                break;
            }
            let mut memo = HashMemo::lock(&m);
            if memo.held() > 0 {
                memo.forget();
                self.forgotten += 1;
            }
        }
    }
}

/// The outcome of an allocation the scheduler may see refused: its value when it succeeded, the
/// refusal when the device is out of memory (the step goes on without it).
///
/// # Errors
/// Any other error, which ends the replay.
fn out_of_memory<T>(r: Result<T>) -> Result<std::result::Result<T, StallCause>> {
    match r {
        Ok(v) => Ok(Ok(v)),
        Err(ManagerError::OutOfMemory { needed, available }) => {
            Ok(Err(StallCause::OutOfMemory { needed, available }))
        }
        Err(e) => Err(e),
    }
}

/// Rejects a trace with a request that could never be admitted.
fn check_fits(trace: &Trace, m: &ManagerConfig) -> Result<()> {
    let p = m.model.page_size.max(1);
    let capacity = m.device_pages() * p;
    for (index, r) in trace.requests.iter().enumerate() {
        let whole = pages_for((r.prompt_len + u64::from(r.output_len)) as usize, p) * p;
        let admit = r.prompt_len as usize + (r.output_len as usize).min(m.reserve_clip_tokens) + p;
        let needed = whole.max(admit);
        if needed > capacity {
            return Err(ManagerError::PoolTooSmall {
                index,
                needed,
                capacity,
            });
        }
    }
    Ok(())
}

struct Sim<'a> {
    turns_left: TurnsLeft,
    decode_batch: Vec<(usize, ReqId, TokenId)>,
    trace: &'a Trace,
    cfg: &'a SimConfig,
    /// Per request, what the infinite cache reuses at its first admission.
    ideal_hits: &'a [u64],
    waiting: VecDeque<Job>,
    running: Vec<Job>,
    now_us: f64,
    cpu: CpuClock,
    /// Nanoseconds the prompt sources spent filling tokens (see [`TimedSource`]).
    fill_ns: Arc<AtomicU64>,
    /// Nanoseconds the prompt sources spent hashing pages (see [`TimedSource`]).
    hash_ns: Arc<AtomicU64>,
    /// The conversations' hash memos ([`PageHashMode::Conversation`]).
    hash_memos: HashMemos,
    /// Consecutive steps in which nothing ran because the head of the queue waited for
    /// write-back evictions in flight (their acks land at the end of the step).
    room_waits: u32,
    ttft_ms: Vec<f64>,
    report: Report,
    sample_every: u64,
    last_finish_us: f64,
    /// Resident memory readings (`None` where the platform gives none).
    memory: Option<MemoryUse>,
    /// Requests finished so far.
    finished: u64,
    /// The measured load, per window of simulated time.
    meter: LoadMeter,
}

impl Sim<'_> {
    fn run(&mut self, kv: &mut KvCacheManager, progress: &mut dyn Progress) -> Result<()> {
        let reqs = &self.trace.requests;
        let mut next = 0;
        loop {
            while next < reqs.len() && reqs[next].arrival_us as f64 <= self.now_us {
                let r = &reqs[next];
                let room = r.output_len as usize;
                // Lazy: the manager generates the tokens when it admits the request, so a
                // backlog costs its segments, not its prompts.
                let source = TimedSource {
                    inner: r.prompt_source_with(self.hashing_for(r.session)),
                    fill_ns: self.fill_ns.clone(),
                    hash_ns: self.hash_ns.clone(),
                };
                let mut q = Request::lazy(Arc::new(source)).max_new_tokens(room);
                // Conversations are sessions only when the configuration has them.
                q.session = r.session.filter(|_| self.cfg.manager.sessions.is_some());
                // A storage tier's prefetch fills the prompt at arrival: not manager CPU.
                let t0 = Instant::now();
                let id = kv.arrive(q)?;
                self.cpu.add(Phase::Arrive, t0);
                self.fills_out_of(Phase::Arrive);
                self.waiting.push_back(Job {
                    index: next,
                    id,
                    generated: 0,
                    prefill_left: 0,
                    first_admitted: false,
                    role: Role::Idle,
                    output: Vec::new(),
                });
                next += 1;
            }
            if self.running.is_empty() && self.waiting.is_empty() {
                if next == reqs.len() {
                    return Ok(());
                }
                self.now_us = self.now_us.max(reqs[next].arrival_us as f64);
                continue;
            }
            let finished = self.step(kv)?;
            if finished > 0 {
                progress.advance(finished);
                self.finished += finished;
                if let Some(m) = &mut self.memory {
                    m.on_progress(self.finished);
                    m.check_growth(self.cfg.max_rss_growth_mib, &self.report.config)?;
                }
            }
        }
    }

    /// One scheduler step; returns the number of requests that finished or were dropped.
    fn step(&mut self, kv: &mut KvCacheManager) -> Result<u64> {
        kv.set_time_ms((self.now_us / 1e3) as u64);
        let mut budget = self.cfg.prefill_budget;
        let mut prefill_tokens = 0;
        // FLOPs of the step's prefill chunks (0 without the model's compute shape).
        let mut prefill_flops = 0.0;
        let model = &self.cfg.manager.model;

        // The first refusal of the step (trace index, cause): what a stall reports.
        let mut refused: Option<(usize, StallCause)> = None;

        // Chunks of requests already prefilling, oldest first. The clock starts at the first
        // manager call: most steps have no chunk to continue. A chunk that finds no memory is
        // refused for this step; any other error is a bug and ends the replay.
        let mut t0 = None;
        for job in self.running.iter_mut().filter(|j| j.prefill_left > 0) {
            let take = job.prefill_left.min(budget);
            if take == 0 {
                break;
            }
            t0.get_or_insert_with(Instant::now);
            let range = match out_of_memory(kv.extend(job.id, take))? {
                Ok(range) => range,
                Err(cause) => {
                    refused.get_or_insert((job.index, cause));
                    break;
                }
            };
            prefill_flops += chunk_flops(model, &range);
            job.prefill_left -= take;
            job.role = Role::Prefill;
            budget -= take;
            prefill_tokens += take;
        }
        if let Some(t0) = t0 {
            self.cpu.add(Phase::Extend, t0);
        }

        // Admission, FCFS: the head of the queue blocks the rest, except a request whose
        // prefetch from the storage tier is still loading, which is passed over (as SGLang
        // does) and keeps its place in the queue.
        let mut dropped = 0;
        let mut prefetching = Vec::new();
        let mut storage_tokens = 0;
        while budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(job) = self.waiting.front_mut() else {
                break;
            };
            let id = job.id;
            let t0 = Instant::now();
            let adm = kv.admit(id)?;
            let a = match adm {
                Admission::Ready(a) => a,
                Admission::Wait(WaitReason::Prefetching) => {
                    self.cpu.add(Phase::Admit, t0);
                    self.fills_out_of(Phase::Admit);
                    if let Some(job) = self.waiting.pop_front() {
                        prefetching.push(job);
                    }
                    continue;
                }
                Admission::Wait(reason) => {
                    self.cpu.add(Phase::Admit, t0);
                    refused.get_or_insert((job.index, StallCause::Admission(reason)));
                    self.fills_out_of(Phase::Admit);
                    break;
                }
                Admission::Never(_) => {
                    // Waiting would wait forever: drop it, as a server rejects it.
                    self.cpu.add(Phase::Admit, t0);
                    self.fills_out_of(Phase::Admit);
                    if let Some(job) = self.waiting.pop_front() {
                        kv.abort(id)?;
                        self.report.never_fit += 1;
                        dropped += 1;
                        self.turn_over(kv, self.trace.requests[job.index].session)?;
                    }
                    continue;
                }
            };
            // The first chunk is allocated right away: the admission's closing clock read
            // opens the extend's.
            let take = a.extend_tokens.min(budget);
            let t1 = self.cpu.lap(Phase::Admit, t0);
            let extended = (take > 0).then(|| out_of_memory(kv.extend(id, take)));
            self.cpu.add(Phase::Extend, t1);
            self.fills_out_of(Phase::Admit);
            let Some(mut job) = self.waiting.pop_front() else {
                break;
            };
            let ok = match extended.transpose()? {
                Some(Ok(range)) => {
                    prefill_flops += chunk_flops(model, &range);
                    true
                }
                Some(Err(cause)) => {
                    refused.get_or_insert((job.index, cause));
                    false
                }
                None => false,
            };
            storage_tokens += a.storage_tokens;
            if !job.first_admitted {
                // Infinite-cache ideal and per-tier hits at the first admission; the output
                // goes with the job, which a retraction later in this step may send back to
                // the queue.
                job.first_admitted = true;
                let r = &self.trace.requests[job.index];
                job.output = r.output_tokens();
                self.report.ideal_hit_tokens += self.ideal_hits[job.index];
                self.report.hit_tokens_device += a.device_tokens as u64;
                self.report.hit_tokens_host += a.host_tokens as u64;
                self.report.hit_tokens_storage += a.storage_tokens as u64;
                self.report.kv_match_tokens += a.kv_match_tokens as u64;
                self.report.prompt_tokens += r.prompt_len;
                if let (Some(saved), Some(all)) = (
                    model.prefill_flops(a.cached_tokens() as u64),
                    model.prefill_flops(r.prompt_len),
                ) {
                    let f = self.report.prefill_flops.get_or_insert_default();
                    f.saved += saved as f64;
                    f.prompt += all as f64;
                }
            }
            job.prefill_left = a.extend_tokens;
            if ok {
                job.prefill_left -= take;
                job.role = Role::Prefill;
                budget -= take;
                prefill_tokens += take;
            }
            self.running.push(job);
        }
        let prefetch_waits = prefetching.len();
        for job in prefetching.into_iter().rev() {
            self.waiting.push_front(job);
        }

        // One decode token per request past its prefill. The batch is listed first and the
        // manager calls run in one timed loop, so the figure is the manager's, not the
        // simulator's bookkeeping.
        let mut decode_seqs = 0;
        let mut from = 0;
        let mut batch = std::mem::take(&mut self.decode_batch);
        loop {
            batch.clear();
            for (j, job) in self.running.iter().enumerate().skip(from) {
                if job.prefill_left == 0 && job.generated > 0 && job.role == Role::Idle {
                    batch.push((j, job.id, job.output[job.generated as usize - 1]));
                }
            }
            let mut failed = None;
            if !batch.is_empty() {
                let t0 = Instant::now();
                for (k, &(_, id, token)) in batch.iter().enumerate() {
                    match kv.decode(id, token) {
                        Ok(_) => {}
                        Err(ManagerError::OutOfMemory { needed, available }) => {
                            let index = self.running[batch[k].0].index;
                            let cause = StallCause::OutOfMemory { needed, available };
                            refused.get_or_insert((index, cause));
                            failed = Some(k);
                            break;
                        }
                        Err(e) => return Err(e),
                    }
                }
                self.cpu.add(Phase::Decode, t0);
            }
            let ok = failed.unwrap_or(batch.len());
            for &(j, _, _) in &batch[..ok] {
                self.running[j].role = Role::Decode;
            }
            decode_seqs += ok;
            let Some(k) = failed else {
                break;
            };
            // Retract the youngest request; if that is the one that failed, it waits.
            let j = batch[k].0;
            let victim = self.running.len() - 1;
            let t0 = Instant::now();
            self.retract(kv, victim)?;
            self.cpu.add(Phase::Decode, t0);
            if victim == j {
                break;
            }
            from = j;
        }
        self.decode_batch = batch;

        let tiered = matches!(self.cfg.manager.cache, CacheKind::HiCache(_));
        // Transfers never outlive a step (see the end of the step), so when nothing could run
        // no copy holds pages any more.
        // A request waiting for its prefetch makes progress too: the step's end applies the
        // store's answers.
        let idle = prefill_tokens == 0 && decode_seqs == 0 && dropped == 0 && prefetch_waits == 0;
        // The head of the queue waits for write-back evictions whose acks this step applies
        // (the replay drains every copy at the end of the step): the room is there at the next
        // step, so an idle step is progress once. Twice in a row would be a stall.
        let room_in_flight = matches!(
            refused,
            Some((_, StallCause::Admission(WaitReason::RoomInFlight { .. })))
        );
        self.room_waits = if idle && room_in_flight {
            self.room_waits + 1
        } else {
            0
        };
        let stuck = idle && !(room_in_flight && self.room_waits == 1);

        // What the forward does (which chunks commit, who gets a token, who is done) is
        // worked out before the step's manager calls, so that they run as one timed region
        // from `begin_step` to `end_step` — unless nothing could run: the retraction below
        // changes the batch, so it is worked out after it.
        let mut forward = Forward::default();
        if !stuck {
            self.forward(&mut forward);
        }

        // The batch is formed: its loads start now, before the forward.
        let t0 = Instant::now();
        let step = kv.begin_step();
        let load_bytes = step.load_bytes();
        let span = step.span().clone();
        let _entered = span.enter();
        if stuck {
            // Nothing could run: free memory by retracting the youngest, or give up. (A step
            // that dropped a request made progress.) Every request fits the pool (checked
            // before the replay), so giving up is a stall, reported with the refusal behind it.
            if self.running.len() > 1 {
                let victim = self.running.len() - 1;
                self.retract(kv, victim)?;
            } else {
                let (index, cause) = refused.unwrap_or_else(|| {
                    let index = self
                        .running
                        .first()
                        .or(self.waiting.front())
                        .map_or(0, |j| j.index);
                    (index, StallCause::NoProgress)
                });
                let r = &self.trace.requests[index];
                return Err(ManagerError::Stalled {
                    index,
                    needed: (r.prompt_len + u64::from(r.output_len)) as usize,
                    capacity: kv.accounting().total,
                    cause,
                });
            }
            self.forward(&mut forward);
        }
        // What the pool holds during the forward, for the load meter.
        let a = kv.accounting();

        // The forward is over: commit chunks, emit tokens, finish.
        for &id in &forward.chunked {
            kv.chunk_done(id)?;
        }
        for &(id, session) in &forward.done {
            kv.finish(id)?;
            self.turn_over(kv, session)?;
        }
        drop(_entered);
        kv.end_step(step)?;
        // A replay has no router to publish to, but drains the events every step as a real
        // scheduler would, so they cost what they cost in production and never pile up.
        drop(kv.take_events());
        self.cpu.add(Phase::Complete, t0);
        // The step's interval ends here, before the drain's wait.
        self.cpu.tick();

        // The forward's simulated time.
        let prefill_us = if model.compute.is_some() {
            self.cfg.cost.prefill_us_of_flops(prefill_flops)
        } else {
            self.cfg.cost.prefill_us(prefill_tokens)
        };
        let page = model.page_size.max(1) as u64;
        let storage_bytes = (storage_tokens as u64 / page).saturating_mul(self.report.page_bytes);
        let dt = self.cfg.cost.storage_us(storage_bytes)
            + self
                .cfg
                .cost
                .step_us_of(prefill_us, decode_seqs, load_bytes);
        let busy = prefill_us + decode_seqs as f64 * self.cfg.cost.decode_us_per_seq;
        self.meter
            .step(self.now_us, dt, busy, a.protected + a.request_owned);
        self.now_us += dt;
        self.report.recomputed_tokens += prefill_tokens as u64;
        for &arrival in &forward.first_tokens {
            self.ttft_ms.push((self.now_us - arrival) / 1e3);
        }

        if tiered {
            // Every copy of a step completes within it (the cost model charged its time), so
            // the replay waits for them here: acks then land at the same simulated instant
            // in every run, whatever the host threads' speed, and the replay is deterministic.
            self.settle(kv)?;
        }
        let done = forward.done;
        let finished = done.len() as u64;
        if finished > 0 {
            self.last_finish_us = self.now_us;
            self.running.retain(|j| !done.iter().any(|d| d.0 == j.id));
        }
        self.sample(kv);
        let every = self.cfg.check_invariants_every;
        if every > 0 && self.report.steps.is_multiple_of(every) {
            kv.check_invariants()?;
            self.report.invariant_checks += 1;
        }
        // Dropped requests are over too (for the progress bar and the memory readings).
        Ok(finished + dropped)
    }

    /// The forward's outcome for the running requests (their roles go back to idle): the
    /// chunks it commits, the arrival times of the requests whose first token it emits, and
    /// the requests it finishes.
    fn forward(&mut self, out: &mut Forward) {
        for job in &mut self.running {
            match std::mem::replace(&mut job.role, Role::Idle) {
                Role::Idle => {}
                Role::Prefill => {
                    out.chunked.push(job.id);
                    if job.prefill_left == 0 && job.generated == 0 {
                        job.generated = 1;
                        let arrival = self.trace.requests[job.index].arrival_us as f64;
                        out.first_tokens.push(arrival);
                    }
                }
                Role::Decode => job.generated += 1,
            }
            let out_len = self.trace.requests[job.index].output_len;
            if job.prefill_left == 0 && job.generated >= out_len {
                out.done
                    .push((job.id, self.trace.requests[job.index].session));
                self.report.output_tokens += u64::from(out_len);
            }
        }
    }

    /// Lets every started copy complete, then applies the acks. The wait is not manager CPU
    /// (the copies run on the backend's streams, and a serving scheduler never blocks on
    /// them): untimed, in an interval of its own (call after a tick). Applying the acks is (a
    /// serving scheduler's next poll would do it): the drain's region joins the next interval,
    /// where a wait in it is taken out of the longest region, as in every interval.
    fn settle(&mut self, kv: &mut KvCacheManager) -> Result<()> {
        kv.wait_transfers();
        self.cpu.tick();
        let t0 = Instant::now();
        kv.drain()?;
        self.cpu.add(Phase::Complete, t0);
        Ok(())
    }

    /// A request of `session` is over (finished or dropped): the session closes after its
    /// last turn.
    fn turn_over(&mut self, kv: &mut KvCacheManager, session: Option<u64>) -> Result<()> {
        if let Some(s) = session
            && self.turns_left.over(s)
        {
            kv.close_session(s)?;
        }
        Ok(())
    }

    /// How the prompt of a request of conversation `session` (if any) arriving now gives
    /// its match hashes.
    fn hashing_for(&mut self, session: Option<u64>) -> PageHashing {
        match (self.cfg.page_hashes, session) {
            (PageHashMode::Off, _) => PageHashing::Off,
            (PageHashMode::Conversation, Some(s)) => {
                PageHashing::Conversation(self.hash_memos.arrive(s))
            }
            (PageHashMode::Conversation, None) => PageHashing::Off,
            (PageHashMode::Whole, _) => PageHashing::Whole,
        }
    }

    /// Moves the prompt fills timed since the last call (inside the call of `phase` just
    /// timed) out of `phase`: they are not the manager's CPU.
    fn fills_out_of(&mut self, phase: Phase) {
        let ns = self.fill_ns.swap(0, Ordering::Relaxed);
        if ns > 0 {
            self.cpu.fill(phase, ns);
            // The memos grow only where a source hashed, inside the call just timed.
            self.hash_memos.enforce();
        }
    }

    fn retract(&mut self, kv: &mut KvCacheManager, victim: usize) -> Result<()> {
        let mut job = self.running.remove(victim);
        kv.retract(job.id)?;
        job.role = Role::Idle;
        job.prefill_left = 0;
        self.report.retractions += 1;
        self.waiting.push_front(job);
        Ok(())
    }

    /// Records occupancy, halving the resolution whenever the series gets long.
    fn sample(&mut self, kv: &KvCacheManager) {
        self.report.steps += 1;
        self.report.token_storage_peak.observe(&kv.token_storage());
        if !self.report.steps.is_multiple_of(self.sample_every) {
            return;
        }
        let a = kv.accounting();
        let total = a.total.max(1) as f64;
        let mamba = kv.mamba_accounting().map(|m| {
            let slots = m.total.max(1) as f64;
            (
                (m.protected + m.request_owned) as f64 / slots,
                m.evictable as f64 / slots,
            )
        });
        let swa = kv.swa_accounting().map(|s| {
            let pages = s.total.max(1) as f64;
            (
                (s.protected + s.request_owned) as f64 / pages,
                s.evictable as f64 / pages,
            )
        });
        self.report.occupancy.push(OccupancySample {
            t_s: self.now_us / 1e6,
            in_use: (a.protected + a.request_owned + a.session_held) as f64 / total,
            cached: a.evictable as f64 / total,
            mamba_in_use: mamba.map(|m| m.0),
            mamba_cached: mamba.map(|m| m.1),
            swa_in_use: swa.map(|m| m.0),
            swa_cached: swa.map(|m| m.1),
        });
        if self.report.occupancy.len() >= 2048 {
            let kept: Vec<_> = self.report.occupancy.iter().step_by(2).copied().collect();
            self.report.occupancy = kept;
            self.sample_every *= 2;
        }
    }

    fn finish(mut self, kv: &KvCacheManager, started: Instant) -> Result<Report> {
        let a = kv.accounting();
        let m = kv.metrics();
        let r = &mut self.report;
        r.requests = self.trace.requests.len() as u64;
        r.counters = m.counters;
        // After the drain and the session closes, everything is free or evictable cache.
        r.leaked_tokens =
            (a.protected + a.request_owned + a.session_held + kv.reserved_tokens()) as u64;
        r.accounting_balanced = a.balanced();
        if let Some(acc) = kv.mamba_accounting() {
            r.accounting_balanced &= acc.balanced();
            let slot_bytes = self
                .cfg
                .manager
                .model
                .checked_mamba_slot_bytes()
                .unwrap_or(0);
            r.mamba = Some(MambaReport {
                policy: self
                    .cfg
                    .manager
                    .mamba_policy_kind()
                    .map_or("", MambaPolicyKind::name),
                slots: acc.total as u64,
                slot_bytes,
                states_stored: m.counters.mamba_states_stored,
                state_hits: m.counters.mamba_state_hits,
                states_evicted: m.counters.mamba_states_evicted,
                checkpoints_skipped: m.counters.mamba_checkpoints_skipped,
                cached_at_end: (acc.evictable + acc.protected) as u64,
                leaked_slots: (acc.request_owned + acc.protected) as u64,
            });
        }
        if let Some(acc) = kv.swa_accounting() {
            r.accounting_balanced &= acc.balanced();
            let model = &self.cfg.manager.model;
            let page_bytes = model
                .checked_swa_bytes_per_token()
                .and_then(|b| b.checked_mul(model.page_size as u64))
                .unwrap_or(0);
            r.swa = Some(SwaReport {
                window: model.sliding_window.map_or(0, u64::from),
                pages: acc.total as u64,
                page_bytes,
                pages_slid_out: m.counters.swa_pages_slid_out,
                cached_at_end: (acc.evictable + acc.protected) as u64,
                leaked_pages: (acc.request_owned + acc.protected) as u64,
            });
        }
        r.open_sessions_at_end = kv.open_sessions() as u64;
        self.ttft_ms.sort_by(f64::total_cmp);
        r.ttft_p50_ms = quantile(&self.ttft_ms, 0.5);
        r.ttft_p99_ms = quantile(&self.ttft_ms, 0.99);
        let first = self
            .trace
            .requests
            .first()
            .map_or(0.0, |q| q.arrival_us as f64);
        r.sim_duration_s = ((self.last_finish_us - first) / 1e6).max(1e-9);
        (r.load.compute, r.load.memory) = self.meter.loads(a.total);
        r.throughput_tok_s = r.output_tokens as f64 / r.sim_duration_s;
        r.throughput_req_s = r.requests as f64 / r.sim_duration_s;
        let per = |d: Duration| d.as_secs_f64() * 1e6 / (r.requests.max(1) as f64);
        let c = &self.cpu;
        r.cache_cpu_us_per_request = per(c.manager_total());
        r.cache_cpu_breakdown = CpuBreakdown {
            arrive_us: per(c.total(Phase::Arrive)),
            admit_us: per(c.total(Phase::Admit)),
            extend_us: per(c.total(Phase::Extend)),
            decode_us: per(c.total(Phase::Decode)),
            complete_us: per(c.total(Phase::Complete)),
        };
        r.cache_cpu_clock = c.kind().to_string();
        r.page_hash_us_per_request =
            per(Duration::from_nanos(self.hash_ns.load(Ordering::Relaxed)));
        if self.cfg.page_hashes == PageHashMode::Conversation {
            let m = &self.hash_memos;
            r.page_hash_memos = Some(MemoReport {
                bound_bytes: m.bound,
                peak_bytes: m.peak,
                forgotten: m.forgotten,
            });
        }
        let (steps, waited) = c.waits();
        r.cache_cpu_waits = CpuWaits {
            regions: steps,
            removed_s: waited.as_secs_f64(),
        };
        r.wall_s = started.elapsed().as_secs_f64();
        r.derive_ratios();
        r.memory = self.memory;
        kv.check_invariants()?;
        r.invariant_checks += 1;
        Ok(self.report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::test_memo::{hashed, turn};

    fn hash(r: &crate::trace::TraceRequest, memo: Arc<Mutex<HashMemo>>, hasher: &PageHasher) {
        let out = hashed(r, &memo, hasher);
        assert_eq!(out.len(), r.prompt_len as usize / hasher.page_size());
    }

    /// An agentic trace, through the agentic reader, of `conversations` conversations whose
    /// turns grow their history, branch into sub-agents on a shared head, and end in unhashed
    /// tails; the conversations start 1 s apart, so their turns interleave.
    fn agentic_jsonl(conversations: u64) -> Trace {
        use std::fmt::Write;
        let mut text = String::new();
        let mut rng = crate::trace::Rng::new(7);
        let mut next = |n: u64| rng.range(0, n - 1);
        for _ in 0..conversations {
            let mut history: Vec<u64> = (0..1 + next(4)).collect();
            let mut fresh = 100;
            let mut entries = Vec::new();
            for turn in 0..6 + next(6) {
                // Most turns extend the history; some cut it back first (an edited turn).
                if next(4) == 0 {
                    history.truncate(1 + next(history.len() as u64) as usize);
                }
                for _ in 0..1 + next(3) {
                    history.push(fresh);
                    fresh += 1;
                }
                let ids = |h: &[u64]| format!("{h:?}");
                let tail = next(64);
                let mut entry = format!(
                    r#"{{"t":{turn},"in":{},"out":{},"hash_ids":{}}}"#,
                    history.len() as u64 * 64 + tail,
                    1 + next(50),
                    ids(&history)
                );
                if next(3) == 0 {
                    // A sub-agent on the conversation's first blocks.
                    let mut sub = history[..1].to_vec();
                    sub.push(10_000 + fresh);
                    fresh += 1;
                    entry = format!(
                        r#"{entry},{{"t":{turn}.5,"type":"subagent","requests":[{{"t":0,"in":{},"out":3,"hash_ids":{}}}]}}"#,
                        sub.len() * 64,
                        ids(&sub)
                    );
                }
                entries.push(entry);
            }
            writeln!(
                text,
                r#"{{"block_size":64,"requests":[{}]}}"#,
                entries.join(",")
            )
            .unwrap();
        }
        let opts = crate::trace::ReadOptions {
            conversation_gap_s: 1.0,
            ..Default::default()
        };
        crate::trace::decode_trace(
            text.as_bytes(),
            crate::trace::Compression::None,
            "agentic",
            crate::trace::TraceFormat::Weka,
            &opts,
        )
        .unwrap()
    }

    #[test]
    fn the_ideal_of_disjoint_conversations_one_at_a_time_is_the_ideal_in_arrival_order() {
        let disjoint = agentic_jsonl(12);
        assert!(
            disjoint.conversations_disjoint,
            "the agentic reader says so"
        );
        let sessions: std::collections::HashSet<_> =
            disjoint.requests.iter().map(|r| r.session).collect();
        assert_eq!(sessions.len(), 12);
        // The conversations' turns interleave in arrival order.
        let switches = disjoint
            .requests
            .windows(2)
            .filter(|w| w[0].session != w[1].session)
            .count();
        assert!(switches > 12, "{switches} switches between conversations");
        let mut whole = disjoint.clone();
        whole.conversations_disjoint = false;
        for page_size in [1, 16, 64] {
            let by_conversation = ideal_hits(&disjoint, page_size);
            let in_arrival_order = ideal_hits(&whole, page_size);
            assert_eq!(by_conversation, in_arrival_order, "page size {page_size}");
            assert!(by_conversation.iter().filter(|&&h| h > 0).count() > 24);
        }
    }

    #[test]
    fn the_memos_are_held_to_their_bound_by_forgetting_the_least_recently_used() {
        let mut m = ManagerConfig {
            device_tokens: 1 << 14,
            ..Default::default()
        };
        m.model.page_size = 16;
        let trace = Trace {
            name: "t".into(),
            // Conversation 1 has two turns, the others three.
            requests: (0..3)
                .flat_map(|s| [turn(s, 8), turn(s, 9), turn(s, 10)])
                .filter(|r| r.session != Some(1) || r.prompt_len < 10 * 512)
                .collect(),
            conversations_disjoint: false,
        };
        let mut memos = HashMemos::of(&trace, &m);
        // The pools' bookkeeping: 16K token ids and 1K page ids.
        assert_eq!(memos.bound, ((1 << 14) + (1 << 10)) * 4);
        let hasher = KvCacheManager::new(m.clone()).unwrap().page_hasher();
        let chunk = PageHashes::CHUNK * std::mem::size_of::<radixkv_radix::PageHash>();
        // Three conversations of one chunk each (4,096 tokens, 256 pages) fit.
        for s in 0..3 {
            hash(&turn(s, 8), memos.arrive(s), &hasher);
            memos.enforce();
        }
        assert_eq!((memos.ledger.bytes(), memos.forgotten), (3 * chunk, 0));
        // Under a bound of two chunks, the least recently used conversation (0) is forgotten.
        memos.bound = 2 * chunk;
        memos.enforce();
        assert_eq!((memos.ledger.bytes(), memos.forgotten), (2 * chunk, 1));
        assert_eq!(memos.peak, 3 * chunk);
        let held = |memos: &HashMemos, s: u64| HashMemo::lock(&memos.memos[&s]).held();
        assert_eq!(
            (held(&memos, 0), held(&memos, 1), held(&memos, 2)),
            (0, chunk, chunk)
        );
        // Conversation 1's last turn arrives: its memo leaves the map but still counts, and
        // is forgotten in its turn once the least recently used.
        let last = memos.arrive(1);
        assert!(!memos.memos.contains_key(&1));
        hash(&turn(2, 9), memos.arrive(2), &hasher);
        memos.enforce();
        assert!(memos.ledger.bytes() <= memos.bound);
        assert_eq!(HashMemo::lock(&last).held(), 0, "the least recently used");
        assert_eq!(memos.forgotten, 2);
        // Dropped with its last request, a memo takes its count back.
        drop(last);
        let before = memos.ledger.bytes();
        let two = memos.memos.remove(&2).unwrap();
        let had = HashMemo::lock(&two).held();
        drop(two);
        assert_eq!(memos.ledger.bytes(), before - had);
    }
}
