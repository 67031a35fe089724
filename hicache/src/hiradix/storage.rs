//! The storage tier (L3) under the host tier: backups of acknowledged host copies to a store,
//! and prefetches from the store into the host pool (see the module docs of `hiradix`,
//! "Storage tier").

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use radixkv_radix::{KeyRef, KvIdentity, Namespace, NodeId, PrefixCache, TokenId, align_down};

use super::{HiRadixCache, PendingWrite};
use crate::backend::DeviceBackend;
use crate::error::{HiCacheError, Result};
use crate::storage::{Completion, JobGate, JobId, StorageBackend, StorageTier, TierOptions};

/// Default [`StorageConfig::prefetch_threshold_tokens`].
pub const DEFAULT_PREFETCH_THRESHOLD_TOKENS: usize = 256;

/// When a prefetch may end (see [`HiRadixCache::check_prefetch`]). Whatever the policy, a
/// prefetch whose pages have all arrived ends, and one whose fetch stopped short on some rank
/// (a missing or corrupt page, a store error) ends on every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PrefetchStop {
    /// End at the first check: take what has arrived.
    BestEffort,
    /// End only when the fetch has finished (every hit page arrived, or the fetch stopped).
    WaitComplete,
    /// End when the fetch has finished or after `min(max, base + per_1k_tokens × tokens /
    /// 1024)` since the prefetch started, `tokens` being the tokens asked for.
    Timeout {
        /// Fixed part of the deadline (default 2 s).
        base: Duration,
        /// Part per 1024 tokens asked for (default 0.1 s).
        per_1k_tokens: Duration,
        /// Cap of the deadline (default 30 s).
        max: Duration,
    },
}

impl Default for PrefetchStop {
    fn default() -> Self {
        PrefetchStop::Timeout {
            base: Duration::from_secs(2),
            per_1k_tokens: Duration::from_millis(100),
            max: Duration::from_secs(30),
        }
    }
}

impl PrefetchStop {
    /// The deadline of a prefetch of `tokens` tokens under [`PrefetchStop::Timeout`] (`None`
    /// under the other policies).
    pub fn deadline(&self, tokens: usize) -> Option<Duration> {
        match *self {
            PrefetchStop::Timeout {
                base,
                per_1k_tokens,
                max,
            } => {
                let per = per_1k_tokens.as_secs_f64() * tokens as f64 / 1024.0;
                let d = base.as_secs_f64() + per;
                Some(Duration::from_secs_f64(d.min(max.as_secs_f64()).max(0.0)))
            }
            _ => None,
        }
    }
}

/// The storage tier of a [`HiRadixCache`] ([`crate::HiCacheConfig::storage`]).
#[derive(Clone)]
pub struct StorageConfig {
    /// The store (shared: several caches may use one).
    pub store: Arc<dyn StorageBackend>,
    /// The model and KV layout: part of every page key and stored-page header, so a store
    /// shared by several models never mixes their pages.
    pub identity: KvIdentity,
    /// Prefetches shorter than this many tokens (after page alignment) are not started, and
    /// a storage hit shorter than it is not loaded. Default
    /// [`DEFAULT_PREFETCH_THRESHOLD_TOKENS`]; at least one page.
    pub prefetch_threshold_tokens: usize,
    /// Most tokens reserved by prefetches at once (`None`: half the host pool). A prefetch
    /// that would pass it is not started.
    pub prefetch_cap_tokens: Option<usize>,
    /// When a prefetch may end.
    pub stop: PrefetchStop,
    /// Batch size, concurrency, per-operation timeout and runtime of the engine.
    pub tier: TierOptions,
}

impl StorageConfig {
    /// A storage tier over `store` for `identity`, with the default settings.
    pub fn new(store: Arc<dyn StorageBackend>, identity: KvIdentity) -> Self {
        StorageConfig {
            store,
            identity,
            prefetch_threshold_tokens: DEFAULT_PREFETCH_THRESHOLD_TOKENS,
            prefetch_cap_tokens: None,
            stop: PrefetchStop::default(),
            tier: TierOptions::default(),
        }
    }
}

impl fmt::Debug for StorageConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StorageConfig")
            .field("store", &self.store.name())
            .field("identity", &self.identity)
            .field("prefetch_threshold_tokens", &self.prefetch_threshold_tokens)
            .field("prefetch_cap_tokens", &self.prefetch_cap_tokens)
            .field("stop", &self.stop)
            .field("tier", &self.tier)
            .finish()
    }
}

/// Where a request's prefetch stands ([`HiRadixCache::check_prefetch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchStatus {
    /// The request has no prefetch (none was started, or its end was reported already).
    None,
    /// Still loading: keep the request waiting and check again after the next step.
    Pending,
    /// Ended: `tokens` tokens found in storage were loaded into the host tier and entered the
    /// tree as host-only KV (0: nothing). Match the request again: the host hit includes them
    /// and `begin_request` loads them back.
    Done {
        /// Tokens the storage tier contributed.
        tokens: usize,
    },
}

/// A backup to the store in flight.
#[derive(Debug)]
struct BackupJob {
    job: JobId,
    gate: JobGate,
    /// The deepest node backed up: protected from host eviction until the completion.
    node: NodeId,
    /// The host pages read, sorted.
    pages: Vec<u32>,
}

#[derive(Debug)]
enum Phase {
    /// Asking the store for the longest stored prefix.
    Query(JobId),
    /// Fetching the hit into reserved host pages.
    Fetch { gate: JobGate, host: Vec<u32> },
    /// Ended before any page was reserved (a hit below the threshold, no host room, or a
    /// termination during the query); reported by the next check.
    Ended,
}

#[derive(Debug)]
struct Prefetch {
    /// The node the loaded KV goes under (backed up, or the root), protected from host
    /// eviction while the prefetch runs.
    anchor: NodeId,
    /// Tokens of the key up to the anchor's end.
    offset: usize,
    namespace: Namespace,
    /// The key from the root to the end of the pages asked for.
    tokens: Vec<TokenId>,
    /// Pages counted against the prefetch cap.
    reserved: usize,
    started: Instant,
    phase: Phase,
}

/// The storage tier's state inside a [`HiRadixCache`].
pub(super) struct StorageState {
    tier: StorageTier,
    threshold: usize,
    cap_pages: usize,
    stop: PrefetchStop,
    occupied: usize,
    backups: VecDeque<BackupJob>,
    queries: VecDeque<(JobId, u64)>,
    prefetches: HashMap<u64, Prefetch>,
    results: HashMap<JobId, Completion>,
    /// Nodes protected from host eviction, with their protection count.
    protected: HashMap<NodeId, u32>,
}

impl fmt::Debug for StorageState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StorageState")
            .field("tier", &self.tier)
            .field("backups", &self.backups.len())
            .field("prefetches", &self.prefetches.len())
            .finish()
    }
}

impl StorageState {
    pub(super) fn new(
        cfg: StorageConfig,
        format: crate::storage::PageFormat,
        page_size: usize,
        host_pages: usize,
    ) -> Result<Self> {
        let threshold = cfg.prefetch_threshold_tokens.max(1).div_ceil(page_size) * page_size;
        let cap_pages = match cfg.prefetch_cap_tokens {
            Some(t) => t / page_size,
            None => host_pages / 2,
        };
        if let PrefetchStop::Timeout {
            base,
            per_1k_tokens,
            max,
        } = cfg.stop
            && (base > max || per_1k_tokens > max)
        {
            return Err(HiCacheError::Config(
                "prefetch timeout: base and per-1K part must not exceed the cap".into(),
            ));
        }
        Ok(StorageState {
            tier: StorageTier::new(cfg.store, format, cfg.identity, cfg.tier)?,
            threshold,
            cap_pages,
            stop: cfg.stop,
            occupied: 0,
            backups: VecDeque::new(),
            queries: VecDeque::new(),
            prefetches: HashMap::new(),
            results: HashMap::new(),
            protected: HashMap::new(),
        })
    }

    fn protect(&mut self, n: NodeId) {
        *self.protected.entry(n).or_default() += 1;
    }

    fn unprotect(&mut self, n: NodeId) {
        if let Some(c) = self.protected.get_mut(&n) {
            *c -= 1;
            if *c == 0 {
                self.protected.remove(&n);
            }
        }
    }

    /// Host pages reserved by prefetches (allocated, not in the tree).
    pub(super) fn reserved_host_pages(&self) -> usize {
        self.prefetches
            .values()
            .map(|p| match &p.phase {
                Phase::Fetch { host, .. } => host.len(),
                _ => 0,
            })
            .sum()
    }
}

impl<B: DeviceBackend> HiRadixCache<B> {
    /// True when the storage tier is configured.
    pub fn has_storage(&self) -> bool {
        self.storage.is_some()
    }

    /// The storage engine, if configured (its store, format and jobs in flight).
    pub fn storage_tier(&self) -> Option<&StorageTier> {
        self.storage.as_ref().map(|s| &s.tier)
    }

    /// True when `n` may not be host-evicted now (a storage backup reads it, or a prefetch
    /// will insert below it).
    pub(super) fn host_protected(&self, n: NodeId) -> bool {
        self.storage
            .as_ref()
            .is_some_and(|s| s.protected.contains_key(&n))
    }

    /// Host pages held by prefetches (see `check_invariants`).
    pub(super) fn storage_reserved_pages(&self) -> usize {
        self.storage.as_ref().map_or(0, |s| s.reserved_host_pages())
    }

    /// Queues the storage backup of an acknowledged host copy: per path of the backup's nodes
    /// (including the parts split off them since), one job that writes the pages the store
    /// lacks. The deepest node of each job is protected from host eviction until its
    /// completion.
    pub(super) fn queue_storage_backup(&mut self, w: &PendingWrite) {
        let Some(st) = self.storage.as_mut() else {
            return;
        };
        let tree = self.inner.tree();
        let p = tree.page_size();
        let mut ends: Vec<(usize, NodeId)> = w
            .nodes
            .iter()
            .filter_map(|&n| tree.depth_tokens(n).ok().map(|d| (d, n)))
            .collect();
        // Deepest first: a path takes in the ancestors it shares with shallower ends.
        ends.sort_unstable_by(|a, b| b.cmp(a));
        let mut seen = std::collections::HashSet::new();
        let host_mem = self.ctrl.host().memory().clone();
        for (_, end) in ends {
            let mut nodes = Vec::new();
            let mut n = end;
            while let Ok(Some(h)) = tree.host_pages(n) {
                if h.first().is_none_or(|pg| w.host.binary_search(pg).is_err()) || !seen.insert(n) {
                    break;
                }
                nodes.push(n);
                match tree.parent(n) {
                    Ok(Some(parent)) => n = parent,
                    _ => break,
                }
            }
            let Some(&top) = nodes.last() else {
                continue;
            };
            nodes.reverse();
            // The key from the root to the end of the path.
            let mut segs = Vec::new();
            let mut m = end;
            while m != tree.root() {
                segs.push(tree.node_key(m).unwrap_or(&[]));
                match tree.parent(m) {
                    Ok(Some(parent)) => m = parent,
                    _ => break,
                }
            }
            let tokens: Vec<TokenId> = segs.iter().rev().flat_map(|s| s.iter().copied()).collect();
            let first =
                tree.depth_tokens(top).unwrap_or(0) - tree.node_key(top).map_or(0, <[u32]>::len);
            let pages: Vec<u32> = nodes
                .iter()
                .flat_map(|&x| {
                    tree.host_pages(x)
                        .ok()
                        .flatten()
                        .unwrap_or(&[])
                        .iter()
                        .copied()
                })
                .collect();
            let Ok(ns) = tree.namespace(end) else {
                continue;
            };
            match st
                .tier
                .backup(ns, tokens, first / p, host_mem.clone(), pages.clone())
            {
                Ok((job, gate)) => {
                    let mut pages = pages;
                    pages.sort_unstable();
                    st.protect(end);
                    st.backups.push_back(BackupJob {
                        job,
                        gate,
                        node: end,
                        pages,
                    });
                }
                Err(e) => {
                    debug_assert!(false, "a backup path's pages do not cover its key: {e}");
                }
            }
        }
    }

    /// Stops the storage backups reading any of `pages` (their host copies are being dropped):
    /// once this returns no task reads them, so they may be freed.
    pub(super) fn cancel_backups_reading(&mut self, pages: &[u32]) {
        let Some(st) = self.storage.as_mut() else {
            return;
        };
        for b in &st.backups {
            if pages.iter().any(|p| b.pages.binary_search(p).is_ok()) {
                b.gate.cancel();
            }
        }
    }

    /// Stops every storage job and forgets them (cache reset): no task touches host memory
    /// once this returns.
    pub(super) fn storage_reset(&mut self) {
        let Some(st) = self.storage.as_mut() else {
            return;
        };
        for b in st.backups.drain(..) {
            b.gate.cancel();
        }
        for (_, pf) in st.prefetches.drain() {
            if let Phase::Fetch { gate, .. } = pf.phase {
                gate.cancel();
            }
        }
        st.queries.clear();
        st.results.clear();
        st.protected.clear();
        st.occupied = 0;
    }

    /// The storage tier's part of a step boundary: takes the completions that arrived,
    /// applies the backups and queries that every rank has completed (in submission order),
    /// and starts the fetches of the hits.
    pub(super) fn storage_step(&mut self) -> Result<()> {
        let Some(st) = self.storage.as_mut() else {
            return Ok(());
        };
        for c in st.tier.poll() {
            Self::take_completion(st, &mut self.stats, c);
        }
        let ready = st
            .backups
            .iter()
            .take_while(|b| st.results.contains_key(&b.job))
            .count();
        let agreed = self.consensus.min(ready as u64) as usize;
        for _ in 0..agreed.min(ready) {
            let Some(b) = st.backups.pop_front() else {
                break;
            };
            st.unprotect(b.node);
            if let Some(Completion::Backup {
                written,
                skipped,
                failed,
                ..
            }) = st.results.remove(&b.job)
            {
                self.stats.storage_backups += 1;
                self.stats.backup_pages_written += written as u64;
                self.stats.backup_pages_skipped += skipped as u64;
                self.stats.backup_pages_failed += failed as u64;
            }
        }
        let ready = st
            .queries
            .iter()
            .take_while(|(j, _)| st.results.contains_key(j))
            .count();
        let agreed = self.consensus.min(ready as u64) as usize;
        for _ in 0..agreed.min(ready) {
            let Some(st) = self.storage.as_mut() else {
                break;
            };
            let Some((job, rid)) = st.queries.pop_front() else {
                break;
            };
            let keys = match st.results.remove(&job) {
                Some(Completion::Query { keys, .. }) => keys,
                _ => Vec::new(),
            };
            let hit = self.consensus.min(keys.len() as u64) as usize;
            self.start_fetch(rid, keys, hit)?;
        }
        Ok(())
    }

    fn take_completion(st: &mut StorageState, stats: &mut super::HiCacheStats, c: Completion) {
        match c {
            Completion::Fetch { corrupt: true, .. } => stats.prefetch_pages_corrupt += 1,
            Completion::Query { job, .. } if st.queries.iter().any(|&(j, _)| j == job) => {
                st.results.insert(job, c);
            }
            Completion::Backup { job, .. } if st.backups.iter().any(|b| b.job == job) => {
                st.results.insert(job, c);
            }
            // A job of a revoked prefetch or from before a reset.
            _ => {}
        }
    }

    /// Reserves host pages for the agreed `hit` pages of `rid`'s query and starts their fetch;
    /// revokes the prefetch when the hit is below the threshold or the host has no room.
    fn start_fetch(
        &mut self,
        rid: u64,
        mut keys: Vec<radixkv_radix::PageKey>,
        hit: usize,
    ) -> Result<()> {
        let p = self.page_size();
        let Some(st) = self.storage.as_mut() else {
            return Ok(());
        };
        let threshold = st.threshold;
        let Some(pf) = st.prefetches.get(&rid) else {
            return Ok(());
        };
        let reserved = pf.reserved;
        keys.truncate(hit);
        let mut n = keys.len();
        if n * p >= threshold {
            let free = self.ctrl.host().available();
            if free < n {
                self.evict_host((n - free) * p);
            }
            n = n.min(self.ctrl.host().available());
        }
        let Some(st) = self.storage.as_mut() else {
            return Ok(());
        };
        st.occupied -= reserved.min(st.occupied);
        if n * p < threshold || n == 0 {
            if let Some(pf) = st.prefetches.get_mut(&rid) {
                pf.phase = Phase::Ended;
                pf.reserved = 0;
                let anchor = pf.anchor;
                st.unprotect(anchor);
            }
            self.stats.prefetches_revoked += 1;
            return Ok(());
        }
        keys.truncate(n);
        let host = self.ctrl.alloc_host(n)?;
        let mem = self.ctrl.host().memory().clone();
        let Some(st) = self.storage.as_mut() else {
            return self.ctrl.free_host(&host);
        };
        let (_, gate) = st.tier.fetch(keys, mem, host.clone())?;
        st.occupied += n;
        if let Some(pf) = st.prefetches.get_mut(&rid) {
            pf.reserved = n;
            pf.phase = Phase::Fetch { gate, host };
        }
        Ok(())
    }

    /// Starts a prefetch for request `rid` (an id the caller chooses, unique among its
    /// prefetches) of `key`: the whole pages after the part the tree holds (on device or
    /// host), up to the key's last token (which is always computed), are looked up in the
    /// store in the background. Returns `false` when none was started: no storage tier, a
    /// prefetch of `rid` exists already, the tree's match does not end at a backed-up node,
    /// fewer tokens than the threshold are left, or the prefetch cap is reached.
    ///
    /// Call on every rank in the same order (the decision depends only on the tree).
    pub fn prefetch(&mut self, rid: u64, key: KeyRef<'_>) -> bool {
        let p = self.page_size();
        let tree = self.inner.tree();
        let Some(st) = self.storage.as_mut() else {
            return false;
        };
        if st.prefetches.contains_key(&rid) {
            return false;
        }
        let walk = tree.tier_walk(key);
        let anchor = walk.nodes.last().copied().unwrap_or(tree.root());
        if anchor != tree.root() && !tree.host_pages(anchor).is_ok_and(|h| h.is_some()) {
            return false;
        }
        let Ok(offset) = tree.depth_tokens(anchor) else {
            return false;
        };
        let end = align_down(key.tokens.len().saturating_sub(1), p);
        if end <= offset || end - offset < st.threshold {
            return false;
        }
        let want = (end - offset) / p;
        if st.occupied + want > st.cap_pages {
            return false;
        }
        let tokens = key.tokens[..end].to_vec();
        let job = st
            .tier
            .query(key.namespace, tokens.clone(), offset / p, want);
        if anchor != tree.root() {
            st.protect(anchor);
        }
        st.occupied += want;
        st.queries.push_back((job, rid));
        st.prefetches.insert(
            rid,
            Prefetch {
                anchor,
                offset,
                namespace: key.namespace.clone(),
                tokens,
                reserved: want,
                started: Instant::now(),
                phase: Phase::Query(job),
            },
        );
        self.stats.prefetches_started += 1;
        true
    }

    /// Checks `rid`'s prefetch and ends it when its stop policy allows (on every rank alike:
    /// the decision and the loaded length pass through the consensus hook). Call on every rank
    /// in the same order, e.g. once per waiting request per scheduling pass.
    ///
    /// # Errors
    /// Internal errors of the host pool (a bug).
    pub fn check_prefetch(&mut self, rid: u64) -> Result<PrefetchStatus> {
        let Some(st) = self.storage.as_ref() else {
            return Ok(PrefetchStatus::None);
        };
        let Some(pf) = st.prefetches.get(&rid) else {
            return Ok(PrefetchStatus::None);
        };
        let (can_end, short, timed_out) = match &pf.phase {
            Phase::Ended => (true, false, false),
            Phase::Query(_) => (st.stop == PrefetchStop::BestEffort, false, false),
            Phase::Fetch { gate, host } => {
                let g = gate.state();
                let complete = g.done >= host.len();
                let late = st
                    .stop
                    .deadline(pf.tokens.len() - pf.offset)
                    .is_some_and(|d| pf.started.elapsed() >= d);
                let can = complete
                    || match st.stop {
                        PrefetchStop::BestEffort => true,
                        PrefetchStop::WaitComplete => g.finished,
                        PrefetchStop::Timeout { .. } => g.finished || late,
                    };
                (
                    can,
                    g.finished && !complete,
                    late && !g.finished && !complete,
                )
            }
        };
        // Both reductions run on every rank, every time.
        let any_short = self.consensus.max(u64::from(short)) == 1;
        let all_can = self.consensus.min(u64::from(can_end)) == 1;
        if !(any_short || all_can) {
            return Ok(PrefetchStatus::Pending);
        }
        if timed_out {
            self.stats.prefetch_timeouts += 1;
        }
        self.end_prefetch(rid, true)
            .map(|t| PrefetchStatus::Done { tokens: t })
    }

    /// Ends `rid`'s prefetch now, keeping what every rank has loaded (it enters the tree as
    /// host-only KV): for a scheduler that admits the request without waiting longer. Returns
    /// its status ([`PrefetchStatus::None`] when it has none).
    ///
    /// # Errors
    /// As [`HiRadixCache::check_prefetch`].
    pub fn terminate_prefetch(&mut self, rid: u64) -> Result<PrefetchStatus> {
        if !self
            .storage
            .as_ref()
            .is_some_and(|s| s.prefetches.contains_key(&rid))
        {
            return Ok(PrefetchStatus::None);
        }
        self.end_prefetch(rid, true)
            .map(|t| PrefetchStatus::Done { tokens: t })
    }

    /// Ends `rid`'s prefetch and drops what it loaded (the request was aborted): its host
    /// pages return to the pool at once, the fetch writing them having been stopped first.
    /// Returns `false` when it had none.
    ///
    /// # Errors
    /// As [`HiRadixCache::check_prefetch`].
    pub fn abort_prefetch(&mut self, rid: u64) -> Result<bool> {
        if !self
            .storage
            .as_ref()
            .is_some_and(|s| s.prefetches.contains_key(&rid))
        {
            return Ok(false);
        }
        self.end_prefetch(rid, false).map(|_| true)
    }

    /// Ends a prefetch: stops its fetch, agrees on the loaded length (minimum over ranks),
    /// inserts that prefix as host-only KV under the anchor (with `keep`) and frees the rest.
    fn end_prefetch(&mut self, rid: u64, keep: bool) -> Result<usize> {
        let p = self.page_size();
        let Some(st) = self.storage.as_mut() else {
            return Ok(0);
        };
        let Some(pf) = st.prefetches.remove(&rid) else {
            return Ok(0);
        };
        st.occupied -= pf.reserved.min(st.occupied);
        if pf.anchor != self.inner.tree().root() {
            st.unprotect(pf.anchor);
        }
        let (gate, host) = match pf.phase {
            Phase::Query(job) => {
                // Its completion is ignored when it arrives.
                st.queries.retain(|&(j, _)| j != job);
                self.stats.prefetches_revoked += 1;
                return Ok(0);
            }
            Phase::Ended => return Ok(0),
            Phase::Fetch { gate, host } => (gate, host),
        };
        // After this the fetch writes nothing more: every page of `host` may be freed.
        let local = gate.cancel().min(host.len());
        let agreed = if keep {
            (self.consensus.min(local as u64) as usize).min(local)
        } else {
            0
        };
        let mut unused = Vec::new();
        if agreed > 0 {
            let end = pf.offset + agreed * p;
            let key = KeyRef::with_namespace(&pf.tokens[..end], &pf.namespace);
            let (tree, _) = self.inner.parts_mut();
            match tree.insert_host_only(pf.anchor, pf.offset, key, &host[..agreed], &mut unused) {
                Ok(r) => {
                    if r.added_len > 0
                        && let Ok(m) = tree.meta(r.last_node)
                    {
                        self.host_leaves.push(r.last_node, m);
                    }
                }
                // The anchor lost its host copy or went (a failed backup above it).
                Err(_) => unused.extend_from_slice(&host[..agreed]),
            }
        }
        unused.extend_from_slice(&host[agreed..]);
        self.stats.prefetch_pages_loaded += agreed as u64;
        self.stats.prefetch_pages_revoked += (host.len() - agreed) as u64;
        self.stats.storage_hit_tokens += (agreed * p) as u64;
        self.ctrl.free_host(&unused)?;
        Ok(agreed * p)
    }

    /// Waits until every storage job has completed and applies them (as a step would),
    /// including the fetches the completed queries start: for tests and shutdown, never on a
    /// serving scheduler thread. Prefetches are not ended (check them after). Under several
    /// ranks, call it on every rank at the same point: the ranks loop until none has a job in
    /// flight.
    ///
    /// # Errors
    /// As [`HiRadixCache::step`].
    pub fn wait_storage(&mut self) -> Result<()> {
        loop {
            let busy = match self.storage.as_mut() {
                None => false,
                Some(st) => {
                    while let Some(c) = st.tier.wait_one() {
                        Self::take_completion(st, &mut self.stats, c);
                    }
                    self.storage_step()?;
                    self.storage
                        .as_ref()
                        .is_some_and(|s| s.tier.in_flight() > 0)
                }
            };
            if self.consensus.max(u64::from(busy)) == 0 {
                return Ok(());
            }
        }
    }
}
