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
use crate::controller::PoolName;
use crate::error::{HiCacheError, Result};
use crate::storage::{
    Completion, JobGate, JobId, SectionSource, SectionTarget, StorageBackend, StorageTier,
    TierOptions,
};

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
    /// The host extra-pool slots read (Mamba states, window pages), sorted.
    extra: Vec<(PoolName, u32)>,
}

#[derive(Debug)]
enum Phase {
    /// Asking the store for the longest stored prefix.
    Query(JobId),
    /// Fetching the hit into reserved host pages (and, for a tree with components, reserved
    /// host extra-pool slots).
    Fetch {
        gate: JobGate,
        host: Vec<u32>,
        extra: Reserved,
    },
    /// Ended before any page was reserved (a hit below the threshold, no host room, or a
    /// termination during the query); reported by the next check.
    Ended,
}

/// The host extra-pool slots a hybrid tree's fetch writes the stored components into.
#[derive(Debug, Default)]
struct Reserved {
    /// The one host Mamba slot (the deepest stored state fetched ends up there) and its bit
    /// in the gate's section masks.
    mamba: Option<(u32, u8)>,
    /// Host SWA pages for the fetched pages `first..` (the tail of the hit), and their bit.
    swa: Option<(usize, Vec<u32>, u8)>,
}

impl Reserved {
    fn count(&self, pool: PoolName) -> usize {
        match pool {
            PoolName::Mamba => usize::from(self.mamba.is_some()),
            PoolName::Swa => self.swa.as_ref().map_or(0, |(_, v, _)| v.len()),
            _ => 0,
        }
    }
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

    /// Ends prefetch `rid` before it fetches anything: it holds no reservation and no longer
    /// protects its anchor (the caller counts the revocation).
    fn end_prefetch(&mut self, rid: u64) {
        if let Some(pf) = self.prefetches.get_mut(&rid) {
            pf.phase = Phase::Ended;
            pf.reserved = 0;
            let anchor = pf.anchor;
            self.unprotect(anchor);
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

    /// Host slots of extra pool `pool` reserved by prefetches (allocated, not in the tree).
    pub(super) fn reserved_extra(&self, pool: PoolName) -> usize {
        self.prefetches
            .values()
            .map(|p| match &p.phase {
                Phase::Fetch { extra, .. } => extra.count(pool),
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

    /// Host slots of extra pool `pool` held by prefetches (see the component audits).
    pub(super) fn storage_reserved_extra(&self, pool: PoolName) -> usize {
        self.storage.as_ref().map_or(0, |s| s.reserved_extra(pool))
    }

    /// Queues the storage backup of an acknowledged host copy: per path of the backup's nodes
    /// (including the parts split off them since), one job that writes the pages the store
    /// lacks, and the stored ones it gives a state or window page they lack (see
    /// [`StorageTier::backup_with_sections`]). The deepest node of each job is protected from
    /// host eviction until its completion.
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
        let mamba_mem = if self.mamba {
            self.ctrl.extra_memory(PoolName::Mamba).ok().cloned()
        } else {
            None
        };
        let swa_mem = if self.swa {
            self.ctrl.extra_memory(PoolName::Swa).ok().cloned()
        } else {
            None
        };
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
            let tokens = key_from_root(tree, end);
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
            // The components the path's host copies hold: a node's state goes with the last
            // page of its key (the state after that page's last token), its window KV page by
            // page.
            let mut sections = Vec::new();
            let mut base = 0;
            for &x in &nodes {
                let len = tree.host_pages(x).ok().flatten().map_or(0, <[u32]>::len);
                if let Some(mem) = &mamba_mem
                    && len > 0
                    && let Ok(Some(h)) = tree.mamba_host_state(x)
                {
                    sections.push(SectionSource {
                        page: base + len - 1,
                        memory: mem.clone(),
                        slot: h,
                    });
                }
                if let Some(mem) = &swa_mem
                    && let Ok(Some(hs)) = tree.swa_host_pages(x)
                {
                    for (j, &h) in hs.iter().enumerate().take(len) {
                        sections.push(SectionSource {
                            page: base + j,
                            memory: mem.clone(),
                            slot: h,
                        });
                    }
                }
                base += len;
            }
            let mut extra: Vec<(PoolName, u32)> =
                sections.iter().map(|x| (x.memory.pool(), x.slot)).collect();
            extra.sort_unstable();
            match st.tier.backup_with_sections(
                ns,
                tokens,
                first / p,
                host_mem.clone(),
                pages.clone(),
                sections,
            ) {
                Ok((job, gate)) => {
                    let mut pages = pages;
                    pages.sort_unstable();
                    st.protect(end);
                    st.backups.push_back(BackupJob {
                        job,
                        gate,
                        node: end,
                        pages,
                        extra,
                    });
                }
                Err(e) => {
                    debug_assert!(false, "a backup path's pages do not cover its key: {e}");
                }
            }
        }
        // States that reached the host after their node's pages (a checkpoint at a later
        // split, backed up without its KV): the node's last page is backed up again with the
        // state's section (and its window page, if on the host); the job writes it again
        // when the stored page lacks the state, so that the store gains the checkpoint.
        let Some(mem) = &mamba_mem else {
            return;
        };
        for &(n, h) in &w.states {
            if seen.contains(&n) || !matches!(tree.mamba_host_state(n), Ok(Some(x)) if x == h) {
                continue;
            }
            let Some(&last) = tree.host_pages(n).ok().flatten().and_then(<[u32]>::last) else {
                continue;
            };
            let (Ok(depth), Ok(ns)) = (tree.depth_tokens(n), tree.namespace(n)) else {
                continue;
            };
            if depth == 0 || depth % p != 0 {
                continue;
            }
            let tokens = key_from_root(tree, n);
            let mut sections = vec![SectionSource {
                page: 0,
                memory: mem.clone(),
                slot: h,
            }];
            let mut extra = vec![(PoolName::Mamba, h)];
            if let Some(swa) = &swa_mem
                && let Ok(Some(&w)) = tree.swa_host_pages(n).map(|x| x.and_then(<[u32]>::last))
            {
                sections.push(SectionSource {
                    page: 0,
                    memory: swa.clone(),
                    slot: w,
                });
                // After the Mamba slot: `extra` stays sorted (Mamba < Swa).
                extra.push((PoolName::Swa, w));
                debug_assert!(extra.is_sorted());
            }
            match st.tier.backup_with_sections(
                ns,
                tokens,
                depth / p - 1,
                host_mem.clone(),
                vec![last],
                sections,
            ) {
                Ok((job, gate)) => {
                    st.protect(n);
                    st.backups.push_back(BackupJob {
                        job,
                        gate,
                        node: n,
                        pages: vec![last],
                        extra,
                    });
                }
                Err(e) => debug_assert!(false, "a late state's page does not fit its key: {e}"),
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

    /// Stops the storage backups reading any of the host `slots` of extra pool `pool` (a host
    /// state or window page being dropped): once this returns no task reads them.
    pub(super) fn cancel_backups_reading_extra(&mut self, pool: PoolName, slots: &[u32]) {
        let Some(st) = self.storage.as_mut() else {
            return;
        };
        for b in &st.backups {
            if slots
                .iter()
                .any(|&h| b.extra.binary_search(&(pool, h)).is_ok())
            {
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
            st.end_prefetch(rid);
            self.stats.prefetches_revoked += 1;
            return Ok(());
        }
        keys.truncate(n);
        let Some(extra) = self.reserve_components(n) else {
            // A Mamba tree without a host slot for the state: the KV alone is no hit.
            let Some(st) = self.storage.as_mut() else {
                return Ok(());
            };
            st.end_prefetch(rid);
            self.stats.prefetches_revoked += 1;
            return Ok(());
        };
        let host = match self.ctrl.alloc_host(n) {
            Ok(h) => h,
            Err(e) => {
                self.free_reserved(&extra);
                return Err(e);
            }
        };
        let mem = self.ctrl.host().memory().clone();
        let mut targets = Vec::new();
        if let Some((slot, _)) = extra.mamba
            && let Ok(memory) = self.ctrl.extra_memory(PoolName::Mamba)
        {
            targets.push(SectionTarget::Latest {
                memory: memory.clone(),
                slot,
            });
        }
        if let Some((first, slots, _)) = &extra.swa
            && let Ok(memory) = self.ctrl.extra_memory(PoolName::Swa)
        {
            targets.push(SectionTarget::PerPage {
                memory: memory.clone(),
                first: *first,
                slots: slots.clone(),
            });
        }
        let Some(st) = self.storage.as_mut() else {
            self.free_reserved(&extra);
            return self.ctrl.free_host(&host);
        };
        let (_, gate) = match st
            .tier
            .fetch_with_sections(keys, mem, host.clone(), targets)
        {
            Ok(v) => v,
            Err(e) => {
                self.free_reserved(&extra);
                self.ctrl.free_host(&host)?;
                return Err(e);
            }
        };
        st.occupied += n;
        if let Some(pf) = st.prefetches.get_mut(&rid) {
            pf.reserved = n;
            pf.phase = Phase::Fetch { gate, host, extra };
        }
        Ok(())
    }

    /// Reserves the host extra-pool slots a fetch of `n` pages writes the stored components
    /// into: one host Mamba slot (`None` when none can be freed: a Mamba tree's hit needs its
    /// state), and host SWA pages for as many of the last pages as can be had (host-evicting
    /// for at least one window's worth first).
    fn reserve_components(&mut self, n: usize) -> Option<Reserved> {
        let mut r = Reserved::default();
        let mut bit = 0u8;
        if self.mamba {
            if self.mamba_host_free() == 0 {
                self.evict_host_leaves(0, 1);
            }
            let slot = self.alloc_extra_host(PoolName::Mamba, 1)?;
            r.mamba = Some((slot[0], bit));
            bit += 1;
        }
        if self.swa {
            let need = self.window_pages().min(n);
            let free = self.swa_host_free();
            if free < need {
                self.evict_host_leaves_for(0, 0, need - free, None);
            }
            let k = self.swa_host_free().min(n);
            if k > 0
                && let Some(slots) = self.alloc_extra_host(PoolName::Swa, k)
            {
                r.swa = Some((n - k, slots, bit));
            }
        }
        Some(r)
    }

    /// Host slots of an extra pool outside any transfer (a fetch writes into them).
    fn alloc_extra_host(&mut self, pool: PoolName, n: usize) -> Option<Vec<u32>> {
        self.ctrl.alloc_extra_host(pool, n).ok()
    }

    /// Frees reserved host extra-pool slots (none of them in the tree).
    fn free_reserved(&mut self, r: &Reserved) {
        if let Some((slot, _)) = r.mamba
            && let Err(e) = self.ctrl.free_extra(PoolName::Mamba, &[slot], &[])
        {
            debug_assert!(false, "a reserved host Mamba slot was not allocated: {e}");
        }
        if let Some((_, slots, _)) = &r.swa
            && let Err(e) = self.ctrl.free_extra(PoolName::Swa, slots, &[])
        {
            debug_assert!(false, "reserved host SWA pages were not allocated: {e}");
        }
    }

    /// Pages of the SWA window (0 without the SWA component).
    fn window_pages(&self) -> usize {
        let p = self.page_size();
        self.inner.tree().swa_window().map_or(0, |w| w.div_ceil(p))
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
            Phase::Fetch { gate, host, .. } => {
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
        let (gate, host, extra) = match pf.phase {
            Phase::Query(job) => {
                // Its completion is ignored when it arrives.
                st.queries.retain(|&(j, _)| j != job);
                self.stats.prefetches_revoked += 1;
                return Ok(0);
            }
            Phase::Ended => return Ok(0),
            Phase::Fetch { gate, host, extra } => (gate, host, extra),
        };
        // After this the fetch writes nothing more: every page of `host` may be freed.
        let local = gate.cancel().min(host.len());
        let agreed = if keep {
            (self.consensus.min(local as u64) as usize).min(local)
        } else {
            0
        };
        // With components, the hit ends where the tree's rules allow a match to end, which
        // every rank must find alike.
        let (end, swa_from) = if keep && (self.mamba || self.swa) {
            let sections = gate.sections_done();
            let mine = self.component_end(pf.anchor, &extra, agreed, &sections);
            let lo = self.consensus.min(mine as u64) as usize;
            let hi = self.consensus.max(mine as u64) as usize;
            let end = if lo == hi { lo.min(agreed) } else { 0 };
            (end, end.saturating_sub(self.window_pages()))
        } else {
            (agreed, agreed)
        };
        self.stats.prefetch_pages_unusable += (agreed - end) as u64;
        let mut unused = Vec::new();
        let mut used_mamba = false;
        let mut used_swa: Vec<u32> = Vec::new();
        let mut reached = 0;
        // Host pages `..accounted` are in the tree or in `unused`.
        let mut accounted = 0;
        if end > 0 {
            // Without the SWA component one node; with it, the window before the end gets a
            // node of its own that holds the stored window KV.
            let parts = if self.swa && swa_from > 0 {
                vec![(0, swa_from, false), (swa_from, end, true)]
            } else {
                vec![(0, end, self.swa)]
            };
            let mut node = pf.anchor;
            for (a, b, with_swa) in parts {
                accounted = b;
                let key = KeyRef::with_namespace(&pf.tokens[..pf.offset + b * p], &pf.namespace);
                let (tree, _) = self.inner.parts_mut();
                let r = match tree.insert_host_only(
                    node,
                    pf.offset + a * p,
                    key,
                    &host[a..b],
                    &mut unused,
                ) {
                    Ok(r) => r,
                    // The anchor lost its host copy or went (a failed backup above it).
                    Err(_) => {
                        unused.extend_from_slice(&host[a..b]);
                        break;
                    }
                };
                if r.added_len > 0
                    && let Ok(m) = tree.meta(r.last_node)
                {
                    self.host_leaves.push(r.last_node, m);
                }
                if tree.depth_tokens(r.last_node).ok() != Some(pf.offset + b * p) {
                    // Stopped at device-only KV: `insert_host_only` took the rest of `a..b`.
                    break;
                }
                if with_swa
                    && r.added_len > 0
                    && let Some((first, slots, _)) = &extra.swa
                {
                    let from = b - r.added_len / p;
                    let pages: Option<Vec<u32>> = (from..b)
                        .map(|i| i.checked_sub(*first).and_then(|j| slots.get(j).copied()))
                        .collect();
                    if let Some(pages) = pages
                        && tree
                            .restore_swa_host_pages(r.last_node, pages.clone())
                            .is_ok()
                    {
                        used_swa = pages;
                    }
                }
                node = r.last_node;
                reached = b;
            }
            if reached == end
                && let Some((slot, _)) = extra.mamba
            {
                let (tree, _) = self.inner.parts_mut();
                used_mamba = tree.restore_mamba_host_state(node, slot).is_ok();
            }
        }
        unused.extend_from_slice(&host[accounted..]);
        // The reserved component slots the tree did not take.
        let mut rest = Reserved::default();
        if let Some(m) = extra.mamba.filter(|_| !used_mamba) {
            rest.mamba = Some(m);
        }
        if let Some((first, slots, bit)) = extra.swa {
            used_swa.sort_unstable();
            let left: Vec<u32> = slots
                .into_iter()
                .filter(|h| used_swa.binary_search(h).is_err())
                .collect();
            if !left.is_empty() {
                rest.swa = Some((first, left, bit));
            }
        }
        self.free_reserved(&rest);
        self.stats.prefetch_pages_loaded += end as u64;
        self.stats.prefetch_pages_revoked += (host.len() - agreed) as u64;
        self.stats.storage_hit_tokens += (end * p) as u64;
        self.ctrl.free_host(&unused)?;
        Ok(end * p)
    }

    /// Where this rank's fetch lets a hybrid tree's hit end (pages from the prefetch's
    /// offset; 0: nowhere), within the `agreed` pages: with the Mamba component, exactly at
    /// the deepest fetched page that carried a state (the reserved slot holds that state
    /// only, so a deeper state fetched past `agreed` leaves none); with the SWA component,
    /// where the window before the end is covered by fetched window pages (the last
    /// [`HiRadixCache::window_pages`] pages, or all of them down to the anchor when the
    /// anchor's own window KV, live or on the host, covers the rest).
    fn component_end(
        &self,
        anchor: NodeId,
        extra: &Reserved,
        agreed: usize,
        sections: &[u8],
    ) -> usize {
        let has = |bit: u8, i: usize| sections.get(i).is_some_and(|m| m & (1 << bit) != 0);
        let wp = self.window_pages();
        let window_ok = |e: usize| -> bool {
            let Some((_, _, bit)) = extra.swa else {
                return false;
            };
            let s = e.saturating_sub(wp);
            if e == 0 || !(s..e).all(|i| has(bit, i)) {
                return false;
            }
            if e - s >= wp {
                return true;
            }
            // The window reaches past the fetched pages: the anchor's side must cover it.
            let p = self.page_size();
            let (covered, to_root) = self.window_above(anchor);
            let w = self.inner.tree().swa_window().unwrap_or(0);
            to_root || covered + e * p >= w
        };
        if self.mamba {
            let Some((_, bit)) = extra.mamba else {
                return 0;
            };
            let Some(last) = (0..sections.len()).rev().find(|&i| has(bit, i)) else {
                return 0;
            };
            let e = last + 1;
            if e > agreed || (self.swa && !window_ok(e)) {
                return 0;
            }
            return e;
        }
        (1..=agreed).rev().find(|&e| window_ok(e)).unwrap_or(0)
    }

    /// Tokens of window KV (live on device or on the host) right above the end of `node`, and
    /// whether that run goes up to the root.
    fn window_above(&self, node: NodeId) -> (usize, bool) {
        let tree = self.inner.tree();
        let w = tree.swa_window().unwrap_or(0);
        let mut covered = 0;
        let mut n = node;
        while n != tree.root() {
            let live = tree.swa_pages(n).is_ok_and(|x| x.is_some())
                || tree.swa_host_pages(n).is_ok_and(|x| x.is_some());
            if !live {
                return (covered, false);
            }
            covered += tree.node_key(n).map_or(0, <[u32]>::len);
            if covered >= w {
                return (covered, false);
            }
            match tree.parent(n) {
                Ok(Some(parent)) => n = parent,
                _ => return (covered, false),
            }
        }
        (covered, true)
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

/// The tokens of the key from the root to the end of `n`.
fn key_from_root(tree: &radixkv_radix::RadixTree, n: NodeId) -> Vec<TokenId> {
    let mut segs = Vec::new();
    let mut m = n;
    while m != tree.root() {
        segs.push(tree.node_key(m).unwrap_or(&[]));
        match tree.parent(m) {
            Ok(Some(parent)) => m = parent,
            _ => break,
        }
    }
    segs.iter().rev().flat_map(|s| s.iter().copied()).collect()
}
