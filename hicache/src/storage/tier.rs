//! [`StorageTier`]: the engine that moves pages between the host pool and a
//! [`StorageBackend`] without ever blocking the scheduler thread.
//!
//! The scheduler thread submits jobs and drains their [`Completion`]s at step boundaries
//! ([`StorageTier::poll`]); each job runs as one task on a tokio runtime (the tier's own small
//! multi-thread runtime, or the embedder's through [`TierOptions::runtime`]). At most
//! [`TierOptions::concurrency`] jobs talk to the store at once (a semaphore), every store
//! operation is bounded by [`TierOptions::op_timeout`], and every job reports exactly one
//! completion, also when it fails, times out, is cancelled or panics — so nothing waits
//! forever and nothing is lost.
//!
//! # Jobs
//! - **Backup** ([`StorageTier::backup`]): computes the page keys of a prefix, asks the store
//!   how many of the pages to write it holds already (the longest stored prefix), reads the
//!   others from the host pool, encodes them ([`PageFormat`]) and puts them in batches; with
//!   [`StorageTier::backup_with_sections`] the pages also carry extra-pool items read from
//!   the host slots named ([`SectionSource`]), and a stored page the job gives a section it
//!   lacks is read back and written again with it (its other sections kept).
//! - **Query** ([`StorageTier::query`]): the longest stored prefix of a key chain, batch by
//!   batch (stopping at the first short batch); it reports the keys found.
//! - **Fetch** ([`StorageTier::fetch`]): gets pages into reserved host pages, in order. Each
//!   page is decoded and checked first; a missing or corrupt page (or a failed batch) ends the
//!   fetch there, so what was fetched is always a prefix of the chain. With
//!   [`StorageTier::fetch_with_sections`] the sections the pages carry are written into the
//!   host slots named ([`SectionTarget`]), under the gate with the page's KV, and the gate
//!   records per page which it wrote ([`JobGate::sections_done`]). A damaged page
//!   ([`PageError::is_damage`](super::PageError::is_damage)) is removed from the store
//!   ([`StorageBackend::discard_damaged`]), so it costs one miss, not one per later lookup.
//!
//! # Reading and writing host memory: the [`JobGate`]
//! A backup reads, and a fetch writes, the host pool's memory from a runtime thread. Each such
//! access is one page, made while holding the job's gate; [`JobGate::cancel`] takes the same
//! lock, so once it returns the task never touches host memory again and the caller may free
//! or reuse the job's host pages at once (it waits for at most one page copy). A fetch counts a
//! page as done under the gate, after its bytes are written, so [`JobGate::cancel`] returns
//! exactly the prefix of pages that hold their KV.
//!
//! Why read the host pages inside the task rather than on the scheduler thread: a page of a
//! real model is megabytes (all layers), so copying a backup's pages out on the scheduler thread
//! would cost it milliseconds per request; inside the task the copy overlaps the scheduler's
//! work and the gate keeps it safe.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use radixkv_radix::{KeySeed, KvIdentity, Namespace, PageKey, TokenId};
use smallvec::SmallVec;
use tokio::runtime::{Handle, Runtime};
use tokio::sync::Semaphore;

use super::backend::{StorageBackend, StoreError};
use super::page::PageFormat;
use crate::backend::{HostMemory, SlotMemory};
use crate::controller::PoolName;
use crate::error::{HiCacheError, Result};

/// Namespaces whose key seed a [`StorageTier`] keeps.
pub const SEED_CACHE_LIMIT: usize = 4096;

/// Tuning of a [`StorageTier`].
#[derive(Clone, Debug)]
pub struct TierOptions {
    /// Pages per store operation (exists, get, put). Default 128.
    pub batch_pages: usize,
    /// Jobs that talk to the store at once. Default 4.
    pub concurrency: usize,
    /// Deadline of one store operation; an operation past it fails with
    /// [`StoreError::Timeout`]. Default 5 s.
    pub op_timeout: Duration,
    /// The runtime to run jobs on (its time driver must be enabled). `None`: the tier starts
    /// its own multi-thread runtime of [`TierOptions::worker_threads`] threads.
    pub runtime: Option<Handle>,
    /// Worker threads of the tier's own runtime (ignored with [`TierOptions::runtime`]).
    /// Default 2.
    pub worker_threads: usize,
}

impl Default for TierOptions {
    fn default() -> Self {
        TierOptions {
            batch_pages: 128,
            concurrency: 4,
            op_timeout: Duration::from_secs(5),
            runtime: None,
            worker_threads: 2,
        }
    }
}

/// A job's number, unique within its [`StorageTier`], increasing in submission order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(pub u64);

/// How a job ended. Every submitted job reports exactly one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// A backup ended.
    Backup {
        /// The job.
        job: JobId,
        /// Pages written now.
        written: usize,
        /// Pages the store held already (not written again).
        skipped: usize,
        /// Pages not written (a store error or timeout, a page the store refused, a
        /// cancellation).
        failed: usize,
    },
    /// A query ended.
    Query {
        /// The job.
        job: JobId,
        /// The keys of the longest stored prefix of the queried chain.
        keys: Vec<PageKey>,
        /// The query stopped at an error or timeout (the keys found before it still count).
        failed: bool,
    },
    /// A fetch ended.
    Fetch {
        /// The job.
        job: JobId,
        /// Pages written to the host pool, from the first.
        loaded: usize,
        /// The fetch ended at a page that failed its checks (counted as a miss).
        corrupt: bool,
        /// The fetch ended at a page the store no longer had.
        missing: bool,
        /// The fetch ended at a store error or timeout.
        failed: bool,
    },
}

impl Completion {
    /// The job this completion ends.
    pub fn job(&self) -> JobId {
        match self {
            Completion::Backup { job, .. }
            | Completion::Query { job, .. }
            | Completion::Fetch { job, .. } => *job,
        }
    }
}

/// What a job's gate records (see [`JobGate`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GateState {
    /// The job was cancelled: it touches no host memory any more.
    pub cancelled: bool,
    /// Pages done: fetched into the host pool (a fetch) or read from it (a backup).
    pub done: usize,
    /// The task has ended (whatever the reason).
    pub finished: bool,
}

/// What a gate guards: the progress, and for a fetch with [`SectionTarget`]s, which
/// sections each page done wrote.
#[derive(Debug, Default)]
struct GateInner {
    state: GateState,
    /// Per page done: bit `i` set when the page carried the section of target `i` and the
    /// fetch wrote it.
    sections: Vec<u8>,
}

/// The lock a job holds while it touches one host page, with its progress; the scheduler's
/// handle to stop it (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct JobGate(Arc<Mutex<GateInner>>);

impl JobGate {
    fn lock(&self) -> MutexGuard<'_, GateInner> {
        // The fields are plain values, each written whole: a panic cannot leave them torn.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops the job: once this returns, its task never reads or writes host memory again, so
    /// its host pages may be freed. Returns the pages done until then. Waits for at most one
    /// page copy in progress.
    pub fn cancel(&self) -> usize {
        let mut g = self.lock();
        g.state.cancelled = true;
        g.state.done
    }

    /// The job's progress now.
    pub fn state(&self) -> GateState {
        self.lock().state
    }

    /// For a fetch: per page done (from the first), a bit mask of the [`SectionTarget`]s
    /// (bit `i` for the `i`-th target given to [`StorageTier::fetch_with_sections`]) whose
    /// section the page carried and the fetch wrote. Empty for other jobs. Read it after
    /// [`JobGate::cancel`] to know what the pages the cancel returned brought.
    pub fn sections_done(&self) -> Vec<u8> {
        self.lock().sections.clone()
    }
}

/// An extra-pool item a backed-up page carries in its stored form
/// ([`StorageTier::backup_with_sections`]): the item in `slot` of `memory` (the host side of
/// the pool [`SlotMemory::pool`] names) goes into the section of the `page`-th page backed up.
#[derive(Clone, Debug)]
pub struct SectionSource {
    /// The page, as an index into the backup's `pages`.
    pub page: usize,
    /// The host side of the extra pool.
    pub memory: Arc<SlotMemory>,
    /// The slot holding the item.
    pub slot: u32,
}

/// Where a fetch writes the extra-pool sections of the pages it gets
/// ([`StorageTier::fetch_with_sections`]). A section whose pool has no target is checked
/// with its page and ignored.
#[derive(Clone, Debug)]
pub enum SectionTarget {
    /// Every page carrying the section writes it into the one `slot`: the slot ends up holding
    /// the section of the deepest such page fetched (Mamba states: only the deepest counts).
    Latest {
        /// The host side of the extra pool.
        memory: Arc<SlotMemory>,
        /// The slot.
        slot: u32,
    },
    /// The section of the page `first + j` goes into `slots[j]`; pages before `first` have no
    /// target (sliding-window KV: only the window before the end counts).
    PerPage {
        /// The host side of the extra pool.
        memory: Arc<SlotMemory>,
        /// The first page (an index into the fetch's keys) with a target.
        first: usize,
        /// One slot per page from `first` on.
        slots: Vec<u32>,
    },
}

impl SectionTarget {
    fn memory(&self) -> &Arc<SlotMemory> {
        match self {
            SectionTarget::Latest { memory, .. } | SectionTarget::PerPage { memory, .. } => memory,
        }
    }

    /// The slot page `i`'s section goes to, if any.
    fn slot_for(&self, i: usize) -> Option<u32> {
        match self {
            SectionTarget::Latest { slot, .. } => Some(*slot),
            SectionTarget::PerPage { first, slots, .. } => {
                i.checked_sub(*first).and_then(|j| slots.get(j).copied())
            }
        }
    }
}

/// Sends its message when dropped: a task that ends any way (returns, panics, is dropped by a
/// runtime shutdown) reports exactly one completion.
struct Reply {
    tx: Sender<Completion>,
    msg: Option<Completion>,
}

impl Reply {
    /// Reports `msg` (replacing the failure reported should the task end early).
    fn send(mut self, msg: Completion) {
        self.msg = Some(msg);
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if let Some(m) = self.msg.take() {
            // The receiver is gone only when the tier is: nobody waits for this any more.
            let _ = self.tx.send(m);
        }
    }
}

/// The pages of one backup job (`keys[i]` is read from host page `pages[i]`) and the extra-pool
/// items they carry (`sections`, sorted by page).
struct JobPages<'a> {
    keys: &'a [PageKey],
    host: &'a HostMemory,
    pages: &'a [u32],
    sections: &'a [SectionSource],
    format: &'a PageFormat,
    gate: &'a JobGate,
}

/// Sections of a stored page that a rewrite keeps: (pool, item bytes).
type KeptSections = Vec<(PoolName, Vec<u8>)>;

impl JobPages<'_> {
    /// The sections the job gives page `i`.
    fn sections_of(&self, i: usize) -> &[SectionSource] {
        let start = self.sections.partition_point(|s| s.page < i);
        &self.sections[start..self.sections.partition_point(|s| s.page <= i)]
    }

    fn has_sections(&self, i: usize) -> bool {
        !self.sections_of(i).is_empty()
    }

    /// Whether page `i`, stored as `stored` (`None`: gone since the lookup), is written again,
    /// and with which of its stored sections (those of pools the job does not give it):
    /// `None` when the stored page has every section the job gives it already (and `rewrite`
    /// is off). A stored page that fails its checks is replaced by the job's page.
    fn merge(&self, i: usize, stored: Option<&[u8]>, rewrite: bool) -> Option<KeptSections> {
        let mine = self.sections_of(i);
        let Some(Ok(d)) = stored.map(|b| self.format.decode(&self.keys[i], b)) else {
            return Some(Vec::new());
        };
        let gives = |pool: PoolName| mine.iter().any(|s| s.memory.pool() == pool);
        let lacks = mine
            .iter()
            .any(|s| !d.sections.iter().any(|&(q, _)| q == s.memory.pool()));
        if !(rewrite || lacks) {
            return None;
        }
        Some(
            d.sections
                .iter()
                .filter(|&&(q, _)| !gives(q))
                .map(|&(q, b)| (q, b.to_vec()))
                .collect(),
        )
    }

    /// Reads the pages `todo` (index, stored sections kept) from the host, each under the
    /// gate, encodes them and puts them as one batch. Returns the pages stored and whether the
    /// job must stop (cancelled, a host read or an encoding failed, the put failed or timed
    /// out); a job that stops before the put puts nothing of the batch.
    async fn put(
        &self,
        store: &dyn StorageBackend,
        opts: &TierOptions,
        todo: Vec<(usize, KeptSections)>,
    ) -> (usize, bool) {
        if todo.is_empty() {
            return (0, false);
        }
        let g = self.format.geometry();
        let layer_bytes = g.page_bytes_per_layer();
        let mut kv = vec![0u8; self.format.kv_bytes()];
        let mut items: Vec<Vec<u8>> = Vec::new();
        let mut batch = Vec::with_capacity(todo.len());
        for (i, keep) in todo {
            let mine = self.sections_of(i);
            items.resize_with(mine.len(), Vec::new);
            {
                let mut st = self.gate.lock();
                if st.state.cancelled {
                    return (0, true);
                }
                for l in 0..g.layers {
                    let out = &mut kv[l * layer_bytes..(l + 1) * layer_bytes];
                    if self.host.read_page(l, self.pages[i], out).is_err() {
                        return (0, true);
                    }
                }
                for (s, buf) in mine.iter().zip(items.iter_mut()) {
                    buf.resize(s.memory.item_bytes(), 0);
                    if s.memory.read_slot(s.slot, buf).is_err() {
                        return (0, true);
                    }
                }
                st.state.done += 1;
            }
            let parts: SmallVec<[(PoolName, &[u8]); 2]> = mine
                .iter()
                .zip(&items)
                .map(|(s, b)| (s.memory.pool(), b.as_slice()))
                .chain(keep.iter().map(|(q, b)| (*q, b.as_slice())))
                .collect();
            let mut bytes = Vec::new();
            if self
                .format
                .encode(&self.keys[i], &kv, &parts, &mut bytes)
                .is_err()
            {
                return (0, true);
            }
            batch.push((self.keys[i], bytes));
        }
        let len = batch.len();
        match timed(opts.op_timeout, store.put_owned(batch)).await {
            Ok(stored) => (stored.iter().take(len).filter(|&&b| b).count(), false),
            Err(_) => (0, true),
        }
    }
}

/// How many of `keys`, from the first, the store holds, asked in batches of
/// `opts.batch_pages` (each under the operation timeout) until the first gap; and whether a
/// batch failed (the count then stops before it).
/// What one backup job writes (the arguments of [`StorageTier::backup_with_sections`]).
struct BackupSpec {
    tokens: Vec<TokenId>,
    first_page: usize,
    host: Arc<HostMemory>,
    pages: Vec<u32>,
    sections: Vec<SectionSource>,
}

impl BackupSpec {
    fn new(
        tokens: Vec<TokenId>,
        first_page: usize,
        host: Arc<HostMemory>,
        pages: Vec<u32>,
        sections: Vec<SectionSource>,
    ) -> Self {
        BackupSpec {
            tokens,
            first_page,
            host,
            pages,
            sections,
        }
    }
}

async fn stored_prefix(
    store: &dyn StorageBackend,
    keys: &[PageKey],
    opts: &TierOptions,
) -> (usize, bool) {
    let mut found = 0;
    for chunk in keys.chunks(opts.batch_pages) {
        match timed(opts.op_timeout, store.exists_prefix(chunk)).await {
            Ok(n) => {
                found += n.min(chunk.len());
                if n < chunk.len() {
                    return (found, false);
                }
            }
            Err(_) => return (found, true),
        }
    }
    (found, false)
}

/// `f`'s result, or [`StoreError::Timeout`] once `d` has passed.
async fn timed<T>(
    d: Duration,
    f: impl Future<Output = std::result::Result<T, StoreError>>,
) -> std::result::Result<T, StoreError> {
    match tokio::time::timeout(d, f).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::Timeout),
    }
}

/// The storage tier's engine: a store, the page format of one model, a key seed per
/// namespace, and the runtime its jobs run on. See the module docs.
pub struct StorageTier {
    store: Arc<dyn StorageBackend>,
    format: Arc<PageFormat>,
    identity: KvIdentity,
    seeds: HashMap<Namespace, KeySeed>,
    /// The tier's own runtime (`None` with an embedder's handle). Shut down in the background
    /// on drop.
    runtime: Option<Runtime>,
    handle: Handle,
    sem: Arc<Semaphore>,
    opts: TierOptions,
    tx: Sender<Completion>,
    rx: Receiver<Completion>,
    next: u64,
    in_flight: usize,
}

impl std::fmt::Debug for StorageTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StorageTier")
            .field("store", &self.store.name())
            .field("in_flight", &self.in_flight)
            .field("opts", &self.opts)
            .finish()
    }
}

impl Drop for StorageTier {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            // Tasks stop at their next await; one blocked in a store call is abandoned, not
            // waited for (it holds only its own references).
            rt.shutdown_background();
        }
    }
}

impl StorageTier {
    /// An engine over `store` for pages of `format`, keyed for the model and layout
    /// `identity` (the identity `format` was made with).
    ///
    /// # Errors
    /// [`HiCacheError::Config`] for a zero batch size, concurrency, timeout or thread count, or
    /// when the runtime cannot be started.
    pub fn new(
        store: Arc<dyn StorageBackend>,
        format: PageFormat,
        identity: KvIdentity,
        opts: TierOptions,
    ) -> Result<Self> {
        if opts.batch_pages == 0 || opts.concurrency == 0 || opts.op_timeout.is_zero() {
            return Err(HiCacheError::Config(
                "storage tier: batch size, concurrency and operation timeout must be non-zero"
                    .into(),
            ));
        }
        let (runtime, handle) = match &opts.runtime {
            Some(h) => (None, h.clone()),
            None => {
                if opts.worker_threads == 0 {
                    return Err(HiCacheError::Config(
                        "storage tier: the runtime needs at least one worker thread".into(),
                    ));
                }
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(opts.worker_threads)
                    .thread_name("radixkv-storage")
                    .enable_all()
                    .build()
                    .map_err(|e| {
                        HiCacheError::Config(format!("storage tier: cannot start a runtime: {e}"))
                    })?;
                let h = rt.handle().clone();
                (Some(rt), h)
            }
        };
        let (tx, rx) = channel();
        Ok(StorageTier {
            store,
            format: Arc::new(format),
            identity,
            seeds: HashMap::new(),
            runtime,
            handle,
            sem: Arc::new(Semaphore::new(opts.concurrency)),
            opts,
            tx,
            rx,
            next: 0,
            in_flight: 0,
        })
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn StorageBackend> {
        &self.store
    }

    /// The page format.
    pub fn format(&self) -> &PageFormat {
        &self.format
    }

    /// The options.
    pub fn options(&self) -> &TierOptions {
        &self.opts
    }

    /// Jobs submitted whose completion has not been returned yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The key seed of `namespace` (cached; the cache is cleared past
    /// [`SEED_CACHE_LIMIT`] namespaces, so a namespace per request cannot grow it forever).
    pub fn seed(&mut self, namespace: &Namespace) -> KeySeed {
        if self.seeds.len() >= SEED_CACHE_LIMIT && !self.seeds.contains_key(namespace) {
            self.seeds.clear();
        }
        *self
            .seeds
            .entry(namespace.clone())
            .or_insert_with(|| KeySeed::new(namespace, &self.identity))
    }

    fn job(&mut self) -> (JobId, Reply) {
        let id = JobId(self.next);
        self.next += 1;
        self.in_flight += 1;
        let reply = Reply {
            tx: self.tx.clone(),
            msg: None,
        };
        (id, reply)
    }

    /// Backs up the pages `first_page..` of the whole pages of `tokens` (the key from the
    /// root, in `namespace`), whose KV is in the host pages `pages` of `host` (one per page,
    /// in order): writes those the store lacks. The pages must stay allocated until the job's
    /// completion is polled or its gate cancelled.
    ///
    /// # Errors
    /// [`HiCacheError::BufferSize`] when `pages` does not cover the pages to back up.
    pub fn backup(
        &mut self,
        namespace: &Namespace,
        tokens: Vec<TokenId>,
        first_page: usize,
        host: Arc<HostMemory>,
        pages: Vec<u32>,
    ) -> Result<(JobId, JobGate)> {
        self.backup_with_sections(namespace, tokens, first_page, host, pages, Vec::new())
    }

    /// [`StorageTier::backup`], where the pages listed in `sections` also carry those
    /// extra-pool items (each read from host memory under the gate, like the page's KV). The
    /// slots must stay allocated like the pages.
    ///
    /// A page the store holds already is still written when the job gives it a section the
    /// stored page lacks (window KV or a state that reached the host after the page was
    /// stored without it): the job reads the stored page back and writes the page again with
    /// the job's sections plus the stored sections of the other pools, so a rewrite never
    /// drops a section. A stored page that fails its checks is replaced. A stored page with
    /// every section the job gives it is skipped, as is a stored page the job gives none.
    ///
    /// # Errors
    /// [`HiCacheError::BufferSize`] when `pages` does not cover the pages to back up or a
    /// section names a page past them; [`HiCacheError::Config`] for a section of a pool the
    /// format does not carry, or a page given two sections of one pool.
    pub fn backup_with_sections(
        &mut self,
        namespace: &Namespace,
        tokens: Vec<TokenId>,
        first_page: usize,
        host: Arc<HostMemory>,
        pages: Vec<u32>,
        sections: Vec<SectionSource>,
    ) -> Result<(JobId, JobGate)> {
        let spec = BackupSpec::new(tokens, first_page, host, pages, sections);
        self.spawn_backup(namespace, spec, false)
    }

    /// [`StorageTier::backup_with_sections`] that writes every page, stored or not (a stored
    /// page keeps its sections of the pools the job does not give it, as there). The
    /// completion counts no page as skipped.
    ///
    /// # Errors
    /// As [`StorageTier::backup_with_sections`].
    pub fn rewrite_with_sections(
        &mut self,
        namespace: &Namespace,
        tokens: Vec<TokenId>,
        first_page: usize,
        host: Arc<HostMemory>,
        pages: Vec<u32>,
        sections: Vec<SectionSource>,
    ) -> Result<(JobId, JobGate)> {
        let spec = BackupSpec::new(tokens, first_page, host, pages, sections);
        self.spawn_backup(namespace, spec, true)
    }

    /// Queues a backup job; with `rewrite` it writes every page, stored or not.
    fn spawn_backup(
        &mut self,
        namespace: &Namespace,
        spec: BackupSpec,
        rewrite: bool,
    ) -> Result<(JobId, JobGate)> {
        let BackupSpec {
            tokens,
            first_page,
            host,
            pages,
            mut sections,
        } = spec;
        let p = self.format.geometry().page_size;
        let total = tokens.len() / p;
        if first_page > total || pages.len() != total - first_page {
            return Err(HiCacheError::BufferSize {
                got: pages.len(),
                expected: total.saturating_sub(first_page),
            });
        }
        sections.sort_by_key(|s| s.page);
        for (i, s) in sections.iter().enumerate() {
            if s.page >= pages.len() {
                return Err(HiCacheError::BufferSize {
                    got: s.page + 1,
                    expected: pages.len(),
                });
            }
            let pool = s.memory.pool();
            if self.format.section_bytes(pool) != Some(s.memory.item_bytes()) {
                return Err(HiCacheError::Config(format!(
                    "stored pages carry no {pool:?} section of {} bytes",
                    s.memory.item_bytes()
                )));
            }
            if sections[..i]
                .iter()
                .any(|o| o.page == s.page && o.memory.pool() == pool)
            {
                return Err(HiCacheError::Config(format!(
                    "page {} is given two {pool:?} sections",
                    s.page
                )));
            }
        }
        let seed = self.seed(namespace);
        let (job, mut reply) = self.job();
        reply.msg = Some(Completion::Backup {
            job,
            written: 0,
            skipped: 0,
            failed: pages.len(),
        });
        let gate = JobGate::default();
        let task_gate = gate.clone();
        let (store, format, sem, opts) = (
            self.store.clone(),
            self.format.clone(),
            self.sem.clone(),
            self.opts.clone(),
        );
        self.handle.spawn(async move {
            let _permit = sem.acquire_owned().await;
            let mut keys = Vec::with_capacity(total);
            seed.extend_chain(None, &tokens, p, &mut keys);
            let job_pages = JobPages {
                keys: &keys[first_page..],
                host: &host,
                pages: &pages,
                sections: &sections,
                format: &format,
                gate: &task_gate,
            };
            let n = job_pages.keys.len();
            // On a failed lookup, writing everything is the safe answer; the puts will tell.
            let present = stored_prefix(&*store, job_pages.keys, &opts).await.0;
            let (mut written, mut skipped) = (0, 0);
            // Stored pages this job may complete: those it gives a section (all of them when
            // rewriting). Each is read back and written again, keeping the sections of the
            // stored page that the job does not give, unless the stored page has every
            // section the job gives already.
            let check: Vec<usize> = (0..present)
                .filter(|&i| rewrite || job_pages.has_sections(i))
                .collect();
            skipped += present - check.len();
            let mut stopped = false;
            for chunk in check.chunks(opts.batch_pages.max(1)) {
                let ks: Vec<PageKey> = chunk.iter().map(|&i| job_pages.keys[i]).collect();
                // A failed read leaves the rest unchecked (counted as failed); the pages the
                // store lacks are still written.
                let Ok(got) = timed(opts.op_timeout, store.get(&ks)).await else {
                    break;
                };
                let mut todo = Vec::with_capacity(chunk.len());
                for (j, &i) in chunk.iter().enumerate() {
                    let stored = got.get(j).and_then(Option::as_deref);
                    match job_pages.merge(i, stored, rewrite) {
                        Some(keep) => todo.push((i, keep)),
                        None => skipped += 1,
                    }
                }
                let (w, stop) = job_pages.put(&*store, &opts, todo).await;
                written += w;
                if stop {
                    stopped = true;
                    break;
                }
            }
            // The pages the store lacks.
            let mut at = present;
            while !stopped && at < n {
                let end = (at + opts.batch_pages.max(1)).min(n);
                let todo = (at..end).map(|i| (i, Vec::new())).collect();
                let (w, stop) = job_pages.put(&*store, &opts, todo).await;
                written += w;
                stopped = stop;
                at = end;
            }
            task_gate.lock().state.finished = true;
            reply.send(Completion::Backup {
                job,
                written,
                skipped,
                failed: n - skipped - written,
            });
        });
        Ok((job, gate))
    }

    /// Finds how many whole pages of `tokens` (the key from the root, in `namespace`), from
    /// page `first_page` on, the store holds as a prefix: at most `max_pages`.
    pub fn query(
        &mut self,
        namespace: &Namespace,
        tokens: Vec<TokenId>,
        first_page: usize,
        max_pages: usize,
    ) -> JobId {
        let p = self.format.geometry().page_size;
        let seed = self.seed(namespace);
        let (job, mut reply) = self.job();
        reply.msg = Some(Completion::Query {
            job,
            keys: Vec::new(),
            failed: true,
        });
        let (store, sem, opts) = (self.store.clone(), self.sem.clone(), self.opts.clone());
        self.handle.spawn(async move {
            let _permit = sem.acquire_owned().await;
            let mut keys = Vec::with_capacity(tokens.len() / p);
            seed.extend_chain(None, &tokens, p, &mut keys);
            let end = keys.len().min(first_page.saturating_add(max_pages));
            let keys = &keys[first_page.min(end)..end];
            let (found, failed) = stored_prefix(&*store, keys, &opts).await;
            reply.send(Completion::Query {
                job,
                keys: keys[..found].to_vec(),
                failed,
            });
        });
        job
    }

    /// Fetches the pages of `keys` into the host pages `pages` of `host` (one per key, in
    /// order), checking each. The pages must stay allocated until the job's completion is
    /// polled or its gate cancelled.
    ///
    /// # Errors
    /// [`HiCacheError::BufferSize`] when `pages` and `keys` differ in length.
    pub fn fetch(
        &mut self,
        keys: Vec<PageKey>,
        host: Arc<HostMemory>,
        pages: Vec<u32>,
    ) -> Result<(JobId, JobGate)> {
        self.fetch_with_sections(keys, host, pages, Vec::new())
    }

    /// [`StorageTier::fetch`], writing the extra-pool sections the pages carry into `targets`
    /// (at most 8; a pool named once), under the gate with the page's KV: the gate's
    /// [`JobGate::sections_done`] tells which page wrote which. A page may carry any subset of
    /// the format's sections; a section without a target is ignored. The slots must stay
    /// allocated like the pages.
    ///
    /// # Errors
    /// [`HiCacheError::BufferSize`] when `pages` and `keys` differ in length;
    /// [`HiCacheError::Config`] for more than 8 targets, a pool named twice or a pool the
    /// format does not carry (with that item size).
    pub fn fetch_with_sections(
        &mut self,
        keys: Vec<PageKey>,
        host: Arc<HostMemory>,
        pages: Vec<u32>,
        targets: Vec<SectionTarget>,
    ) -> Result<(JobId, JobGate)> {
        if keys.len() != pages.len() {
            return Err(HiCacheError::BufferSize {
                got: pages.len(),
                expected: keys.len(),
            });
        }
        if targets.len() > 8 {
            return Err(HiCacheError::Config(
                "a fetch takes at most 8 section targets".into(),
            ));
        }
        for (i, t) in targets.iter().enumerate() {
            let pool = t.memory().pool();
            if self.format.section_bytes(pool) != Some(t.memory().item_bytes())
                || targets[..i].iter().any(|o| o.memory().pool() == pool)
            {
                return Err(HiCacheError::Config(format!(
                    "a fetch target for {pool:?} that the page format does not carry, or \
                     named twice"
                )));
            }
        }
        let (job, mut reply) = self.job();
        reply.msg = Some(Completion::Fetch {
            job,
            loaded: 0,
            corrupt: false,
            missing: false,
            failed: true,
        });
        let gate = JobGate::default();
        let task_gate = gate.clone();
        let (store, format, sem, opts) = (
            self.store.clone(),
            self.format.clone(),
            self.sem.clone(),
            self.opts.clone(),
        );
        self.handle.spawn(async move {
            let _permit = sem.acquire_owned().await;
            let g = format.geometry();
            let layer_bytes = g.page_bytes_per_layer();
            let (mut loaded, mut corrupt, mut missing, mut failed) = (0, false, false, false);
            let mut damaged = None;
            'batches: for (b, chunk) in keys.chunks(opts.batch_pages).enumerate() {
                if task_gate.state().cancelled {
                    break;
                }
                let got = match timed(opts.op_timeout, store.get(chunk)).await {
                    Ok(v) if v.len() == chunk.len() => v,
                    _ => {
                        failed = true;
                        break;
                    }
                };
                for (j, bytes) in got.iter().enumerate() {
                    let i = b * opts.batch_pages + j;
                    let Some(bytes) = bytes else {
                        missing = true;
                        break 'batches;
                    };
                    let page = match format.decode(&keys[i], bytes) {
                        Ok(d) => d,
                        Err(e) => {
                            corrupt = true;
                            damaged = e.is_damage().then_some(keys[i]);
                            break 'batches;
                        }
                    };
                    let mut st = task_gate.lock();
                    if st.state.cancelled {
                        break 'batches;
                    }
                    for l in 0..g.layers {
                        let data = &page.kv[l * layer_bytes..(l + 1) * layer_bytes];
                        if host.write_page(l, pages[i], data).is_err() {
                            failed = true;
                            break 'batches;
                        }
                    }
                    let mut wrote = 0u8;
                    for (t, target) in targets.iter().enumerate() {
                        let pool = target.memory().pool();
                        let (Some(slot), Some(&(_, data))) = (
                            target.slot_for(i),
                            page.sections.iter().find(|(p, _)| *p == pool),
                        ) else {
                            continue;
                        };
                        if target.memory().write_slot(slot, data).is_err() {
                            failed = true;
                            break 'batches;
                        }
                        wrote |= 1 << t;
                    }
                    st.sections.push(wrote);
                    st.state.done += 1;
                    loaded += 1;
                }
            }
            if let Some(key) = damaged {
                // One miss, not a miss on every later lookup. Best effort: a failure leaves
                // the page to fail its checks again.
                let _ = timed(opts.op_timeout, store.discard_damaged(&[key])).await;
            }
            task_gate.lock().state.finished = true;
            reply.send(Completion::Fetch {
                job,
                loaded,
                corrupt,
                missing,
                failed,
            });
        });
        Ok((job, gate))
    }

    /// The completions that arrived, without waiting.
    pub fn poll(&mut self) -> Vec<Completion> {
        let out: Vec<Completion> = self.rx.try_iter().collect();
        self.in_flight -= out.len().min(self.in_flight);
        out
    }

    /// Waits for the next completion; `None` when no job is in flight. For shutdown and tests:
    /// a scheduler thread polls instead. Every store operation is bounded by the operation
    /// timeout, so this returns.
    pub fn wait_one(&mut self) -> Option<Completion> {
        if self.in_flight == 0 {
            return None;
        }
        let c = self.rx.recv().ok()?;
        self.in_flight -= 1;
        Some(c)
    }
}
