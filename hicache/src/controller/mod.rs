//! [`HybridCacheController`]: queues device↔host operations, merges them into few large copies,
//! pipelines loads layer by layer and reports completions as acks.
//!
//! The controller never touches the tree. `write`/`load` allocate the target pages (host pages
//! for a backup, device pages for a load, plus slots of every extra pool — all or nothing) and
//! queue a [`CacheOperation`]. `start_writing`/`start_loading` merge everything queued into one
//! transfer: adjacent (device, host) page pairs coalesce into [`PageRun`]s (see
//! [`merge_runs`]), so many small operations become few large copies. Completions come back through
//! [`HybridCacheController::poll_acks`], which the cache calls at step boundaries.
//!
//! Extra pools (Mamba state, SWA KV) ride in the same operation as [`PoolTransfer`]s with their
//! own indices. Each registered pool has a host-side [`SlotMemory`] here and a device-side
//! buffer in the backend, both of its own item size; a merged transfer moves the KV runs and the
//! extra pools' slot runs on the same stream before the same completion event, so an ack (or a
//! layer event of a load) covers every pool. Allocation across all pools is all or nothing.
//! A pool's device slots may belong to the caller ([`SlotOwner::Caller`]: `HiRadixCache`'s
//! Mamba pool, whose device slots are the tree's): a load then names its target slots and the
//! controller allocates only host slots.
//!
//! A failed copy is reported in [`Acks::failed_writes`] / [`Acks::failed_loads`], never as a
//! completed operation; its pages stay allocated and the owner decides what to do with them.
//!
//! # Back-pressure and refused submissions
//! At most [`HybridCacheController::max_pending_ops`] operations per direction are pending
//! (queued, or started and not yet returned by `poll_acks`); `write`/`load` beyond that return
//! [`HiCacheError::QueueFull`] and allocate nothing, so a slow or stuck stream bounds the
//! controller's memory instead of growing it. When the backend refuses a submission
//! ([`HiCacheError::Transfer`] from `enqueue_copy`/`record_event`), the operations go back to
//! the queue and the next `start_*` retries them. When the stream is closed
//! ([`HiCacheError::StreamClosed`]: its worker exited), a retry can never succeed, so the
//! operations are reported as failed at the next `poll_acks` instead of waiting forever.

use std::collections::VecDeque;
use std::sync::Arc;

use radixkv_radix::{CacheError, PageAllocator, PageId};

use crate::backend::{
    CopyEvent, DeviceBackend, Direction, PageCopy, PageRun, SlotCopy, SlotMemory, StreamKind,
};
use crate::error::{HiCacheError, Result};
use crate::host_pool::{HostPool, SlotAllocator};
use crate::layer_counter::{LayerDoneCounter, wait_all};

mod ops;
pub(crate) use ops::{RunBuilder, radix_sort_by_key};

pub use ops::{
    Acks, CacheOperation, ExtraPoolSpec, LoadStep, OpId, PoolName, PoolTransfer,
    SORT_RUNS_FROM_PAGES, SORT_RUNS_UP_TO, SlotOwner, TransferStats, merge_runs,
};

/// Default of [`HybridCacheController::max_pending_ops`]: operations per direction queued or
/// in flight before `write`/`load` refuse more.
pub const DEFAULT_MAX_PENDING_OPS: usize = 4096;

#[derive(Debug)]
struct ExtraPool {
    name: PoolName,
    owner: SlotOwner,
    host: SlotAllocator,
    device: SlotAllocator,
    host_mem: Arc<SlotMemory>,
}

/// One started transfer: its events (one per layer for a pipelined load), its operations, and
/// whether it is known to have failed regardless of the events (partial submission).
struct InFlight<E> {
    events: Vec<E>,
    ids: Vec<OpId>,
    failed: bool,
}

impl<E: CopyEvent> InFlight<E> {
    fn new(events: Vec<E>, ids: Vec<OpId>) -> Self {
        InFlight {
            events,
            ids,
            failed: false,
        }
    }

    /// Operations whose (possibly partial) submission can never complete: reported as failed
    /// once the events of the submitted part are done.
    fn failed(events: Vec<E>, ops: &[CacheOperation]) -> Self {
        InFlight {
            events,
            ids: ops.iter().map(|o| o.id).collect(),
            failed: true,
        }
    }

    /// Events complete in stream order, so the last one decides completion.
    fn is_complete(&self) -> bool {
        self.events.last().is_none_or(CopyEvent::is_complete)
    }

    /// True when the transfer is known to have failed, complete or not: only part of it was
    /// submitted, or an event it already reached (a finished layer of a load) reports a failed
    /// copy. Never blocks: only completed events are asked for their outcome.
    fn failure_known(&self) -> bool {
        self.failed
            || self
                .events
                .iter()
                .take_while(|e| e.is_complete())
                .any(|e| e.wait().is_err())
    }

    fn wait(&self) -> Result<()> {
        let mut res = wait_all(&self.events);
        if self.failed && res.is_ok() {
            res = Err(HiCacheError::Transfer(
                "transfer only partly submitted".into(),
            ));
        }
        res
    }
}

/// [`HiCacheError::Config`] for a pending-operation limit of 0.
pub(crate) fn check_max_pending_ops(limit: usize) -> Result<()> {
    if limit == 0 {
        return Err(HiCacheError::Config(
            "the controller must allow at least one pending operation".into(),
        ));
    }
    Ok(())
}

/// Merges, submits and tracks device↔host transfers. See the module docs.
pub struct HybridCacheController<B: DeviceBackend> {
    backend: Arc<B>,
    host: HostPool,
    extra: Vec<ExtraPool>,
    write_queue: Vec<CacheOperation>,
    load_queue: Vec<CacheOperation>,
    write_acks: VecDeque<InFlight<B::Event>>,
    load_acks: VecDeque<InFlight<B::Event>>,
    layers: Arc<LayerDoneCounter<B::Event>>,
    next_op: OpId,
    /// Host pages ([`PoolName::Kv`]) or extra-pool host slots to free once every load issued
    /// up to the given op id has completed.
    deferred_host: Vec<(OpId, PoolName, Vec<u32>)>,
    last_load: OpId,
    max_pending: usize,
    /// Operations queued or in flight, not yet returned by `poll_acks`: (writes, loads).
    pending: (usize, usize),
    /// [`RunBuilder`]'s buffer between merges, at the room of the largest merge so far.
    run_buffer: Vec<PageRun>,
}

impl<B: DeviceBackend> std::fmt::Debug for HybridCacheController<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridCacheController")
            .field("backend", &self.backend.name())
            .field("host_pages", &self.host.total())
            .field("queued_writes", &self.write_queue.len())
            .field("queued_loads", &self.load_queue.len())
            .finish()
    }
}

impl<B: DeviceBackend> HybridCacheController<B> {
    /// A controller over `backend` with the host pool `host` and the given extra pools.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] when the host pool's geometry differs from the device's or an
    /// extra pool is listed twice or is [`PoolName::Kv`].
    pub fn new(backend: Arc<B>, host: HostPool, extra: &[ExtraPoolSpec]) -> Result<Self> {
        // Everything is checked and allocated before the backend registers anything (its
        // registrations outlive a controller that fails to build).
        let mut pools: Vec<ExtraPool> = Vec::with_capacity(extra.len());
        for s in extra {
            if s.name == PoolName::Kv || pools.iter().any(|p| p.name == s.name) {
                return Err(HiCacheError::Config(format!(
                    "extra pool {:?} is the KV pool or listed twice",
                    s.name
                )));
            }
            pools.push(ExtraPool {
                name: s.name,
                owner: s.device_owner,
                host: SlotAllocator::new(s.host_slots),
                device: SlotAllocator::new(s.device_slots),
                host_mem: Arc::new(SlotMemory::new(s.name, s.host_slots, s.item_bytes)?),
            });
        }
        backend.register_host(host.memory())?;
        for s in extra {
            backend.register_extra_pool(s.name, s.device_slots, s.item_bytes)?;
        }
        let layers = Arc::new(LayerDoneCounter::new(backend.geometry().layers));
        Ok(HybridCacheController {
            backend,
            host,
            extra: pools,
            write_queue: Vec::new(),
            load_queue: Vec::new(),
            run_buffer: Vec::new(),
            write_acks: VecDeque::new(),
            load_acks: VecDeque::new(),
            layers,
            next_op: 1,
            deferred_host: Vec::new(),
            last_load: 0,
            max_pending: DEFAULT_MAX_PENDING_OPS,
            pending: (0, 0),
        })
    }

    /// Sets the limit on pending operations per direction (see the module docs). Operations
    /// already pending are kept even above a lower limit; new ones wait until it is met.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] for 0.
    pub fn set_max_pending_ops(&mut self, limit: usize) -> Result<()> {
        check_max_pending_ops(limit)?;
        self.max_pending = limit;
        Ok(())
    }

    /// Operations per direction that may be queued or in flight at once.
    pub fn max_pending_ops(&self) -> usize {
        self.max_pending
    }

    /// Operations queued or in flight and not yet acknowledged: (writes, loads).
    pub fn pending(&self) -> (usize, usize) {
        self.pending
    }

    /// True when a `write` (for [`StreamKind::Write`]) or `load` (for [`StreamKind::Load`])
    /// would be accepted by the pending-operations limit now.
    pub fn has_room(&self, stream: StreamKind) -> bool {
        let n = match stream {
            StreamKind::Write => self.pending.0,
            StreamKind::Load => self.pending.1,
        };
        n < self.max_pending
    }

    fn check_room(&self, stream: StreamKind) -> Result<()> {
        if self.has_room(stream) {
            Ok(())
        } else {
            Err(HiCacheError::QueueFull {
                stream,
                limit: self.max_pending,
            })
        }
    }

    /// The device backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// The host pool.
    pub fn host(&self) -> &HostPool {
        &self.host
    }

    /// The per-layer load counter (share it with the forward pass).
    pub fn layer_counter(&self) -> &Arc<LayerDoneCounter<B::Event>> {
        &self.layers
    }

    /// Frees host pages (host eviction, or a backup the cache dropped).
    ///
    /// # Errors
    /// Double free or out of range; nothing freed then.
    pub fn free_host(&mut self, pages: &[u32]) -> Result<()> {
        self.host.free(pages)
    }

    /// Frees host pages once every load queued or in flight now has completed, so a load that
    /// still reads them never races a backup that reuses them. Frees at once when no load is
    /// outstanding.
    ///
    /// # Errors
    /// Double free or out of range (checked now); nothing freed then.
    pub fn free_host_after_loads(&mut self, pages: Vec<u32>) -> Result<()> {
        self.host.check_free(&pages)?;
        if self.oldest_outstanding_load().is_none() {
            return self.host.free(&pages);
        }
        self.deferred_host
            .push((self.last_load, PoolName::Kv, pages));
        Ok(())
    }

    /// Frees host slots of an extra pool like [`HybridCacheController::free_host_after_loads`]:
    /// once every load queued or in flight now has completed (at once when none is).
    ///
    /// # Errors
    /// Unknown pool, double free or out of range (checked now); nothing freed then.
    pub fn free_extra_host_after_loads(&mut self, name: PoolName, slots: Vec<u32>) -> Result<()> {
        let i = self.extra_index(name)?;
        self.extra[i].host.check_free(&slots)?;
        if self.oldest_outstanding_load().is_none() {
            return self.extra[i].host.free(&slots);
        }
        self.deferred_host.push((self.last_load, name, slots));
        Ok(())
    }

    /// Host pages waiting in [`HybridCacheController::free_host_after_loads`].
    pub fn deferred_host_pages(&self) -> usize {
        self.deferred_extra_slots(PoolName::Kv)
    }

    /// Host slots of `name` waiting in
    /// [`HybridCacheController::free_extra_host_after_loads`] (host pages for
    /// [`PoolName::Kv`]).
    pub fn deferred_extra_slots(&self, name: PoolName) -> usize {
        self.deferred_host
            .iter()
            .filter(|(_, n, _)| *n == name)
            .map(|(_, _, p)| p.len())
            .sum()
    }

    fn oldest_outstanding_load(&self) -> Option<OpId> {
        let queued = self.load_queue.iter().map(|o| o.id);
        let flying = self.load_acks.iter().flat_map(|t| t.ids.iter().copied());
        queued.chain(flying).min()
    }

    fn release_deferred(&mut self) {
        if self.deferred_host.is_empty() {
            return;
        }
        let oldest = self.oldest_outstanding_load();
        let host = &mut self.host;
        let extra = &mut self.extra;
        self.deferred_host.retain(|(mark, name, pages)| {
            if oldest.is_some_and(|o| o <= *mark) {
                return true;
            }
            let freed = match name {
                PoolName::Kv => host.free(pages),
                n => match extra.iter_mut().find(|p| p.name == *n) {
                    Some(p) => p.host.free(pages),
                    None => Err(HiCacheError::UnknownPool(*n)),
                },
            };
            if let Err(e) = freed {
                tracing::error!(error = %e, "deferred host pages were freed twice");
            }
            false
        });
    }

    /// The host-side buffer of an extra pool (for tests and inspection).
    ///
    /// # Errors
    /// [`HiCacheError::UnknownPool`].
    pub fn extra_memory(&self, name: PoolName) -> Result<&Arc<SlotMemory>> {
        Ok(&self.extra_pool(name)?.host_mem)
    }

    /// The host-side slot allocator of an extra pool (for audits).
    ///
    /// # Errors
    /// [`HiCacheError::UnknownPool`].
    pub fn extra_host(&self, name: PoolName) -> Result<&SlotAllocator> {
        Ok(&self.extra_pool(name)?.host)
    }

    /// Copies host pages to device pages (all layers), and the extra-pool slots of `extra`
    /// (host to device, pairwise), on the load stream and waits: the synchronous repair of a
    /// failed load, whose host copy is intact.
    ///
    /// # Errors
    /// Mismatched lengths, unknown pools, out-of-range pages or slots, or the copy failed
    /// again.
    pub fn reload_now(
        &mut self,
        host_pages: &[u32],
        device_pages: &[PageId],
        extra: &[PoolTransfer],
    ) -> Result<()> {
        if host_pages.len() != device_pages.len() {
            return Err(HiCacheError::BufferSize {
                expected: host_pages.len(),
                got: device_pages.len(),
            });
        }
        for t in extra {
            if t.host_indices.len() != t.device_indices.len() {
                return Err(HiCacheError::BufferSize {
                    expected: t.host_indices.len(),
                    got: t.device_indices.len(),
                });
            }
            let p = self.extra_pool(t.name)?;
            let pairs = t
                .device_indices
                .iter()
                .copied()
                .zip(t.host_indices.iter().copied());
            let copy = SlotCopy {
                direction: Direction::HostToDevice,
                pool: t.name,
                runs: merge_runs(pairs).into(),
                host: p.host_mem.clone(),
            };
            self.backend.enqueue_slot_copy(StreamKind::Load, copy)?;
        }
        let pairs = device_pages.iter().zip(host_pages).map(|(d, &h)| (d.0, h));
        let copy = PageCopy {
            direction: Direction::HostToDevice,
            layers: 0..self.backend.geometry().layers,
            runs: merge_runs(pairs).into(),
            host: self.host.memory().clone(),
        };
        self.backend.enqueue_copy(StreamKind::Load, copy)?;
        self.backend.record_event(StreamKind::Load)?.wait()
    }

    /// Frees every host page and extra-pool slot (cache reset). Waits for in-flight copies.
    ///
    /// # Errors
    /// A failed copy (the pools are reset anyway).
    pub fn reset(&mut self) -> Result<()> {
        let r = self.wait_all();
        self.write_queue.clear();
        self.load_queue.clear();
        self.write_acks.clear();
        self.load_acks.clear();
        self.deferred_host.clear();
        self.pending = (0, 0);
        self.host.reset();
        for p in &mut self.extra {
            p.host.reset();
            p.device.reset();
        }
        r
    }

    /// Free slots of an extra pool: (host, device). The device part is 0 for a pool whose
    /// device slots the caller owns ([`SlotOwner::Caller`]): the controller allocates none.
    ///
    /// # Errors
    /// [`HiCacheError::UnknownPool`].
    pub fn extra_available(&self, name: PoolName) -> Result<(usize, usize)> {
        let p = self.extra_pool(name)?;
        let device = match p.owner {
            SlotOwner::Controller => p.device.available(),
            SlotOwner::Caller => 0,
        };
        Ok((p.host.available(), device))
    }

    /// Frees slots of an extra pool.
    ///
    /// # Errors
    /// Unknown pool, double free, device slots of a pool whose device slots the caller owns;
    /// nothing freed then.
    pub fn free_extra(&mut self, name: PoolName, host: &[u32], device: &[u32]) -> Result<()> {
        let i = self.extra_index(name)?;
        let p = &mut self.extra[i];
        if p.owner == SlotOwner::Caller && !device.is_empty() {
            return Err(HiCacheError::Config(format!(
                "the device slots of extra pool {name:?} are the caller's to free"
            )));
        }
        p.device.check_free(device)?;
        p.host.free(host)?;
        p.device.free(device)
    }

    fn extra_index(&self, name: PoolName) -> Result<usize> {
        self.extra
            .iter()
            .position(|p| p.name == name)
            .ok_or(HiCacheError::UnknownPool(name))
    }

    fn extra_pool(&self, name: PoolName) -> Result<&ExtraPool> {
        Ok(&self.extra[self.extra_index(name)?])
    }

    fn fresh_id(&mut self) -> OpId {
        let id = self.next_op;
        self.next_op += 1;
        id
    }

    /// Queues a backup of `device_pages` (all layers) and allocates the host pages it writes to,
    /// plus host slots for every extra pool in `extra` (whose `device_indices` the caller
    /// fills). Allocation is atomic: if any pool is full, everything rolls back.
    ///
    /// # Errors
    /// [`HiCacheError::QueueFull`], [`HiCacheError::HostFull`], [`HiCacheError::ExtraPoolFull`],
    /// unknown pools, out-of-range device pages; nothing is allocated or queued then.
    pub fn write(
        &mut self,
        device_pages: &[PageId],
        priority: i32,
        extra: Vec<PoolTransfer>,
    ) -> Result<&CacheOperation> {
        self.write_reusing(device_pages, &[], priority, extra)
    }

    /// [`HybridCacheController::write`] into host pages that are allocated already and that
    /// the caller gives up (a host-tier eviction that made room for this backup): the backup
    /// writes to the first of them (as many as it has device pages) and to newly allocated
    /// pages after them, and the rest of `reused` is freed. The pages go from one owner to the
    /// next without leaving the allocator, so the backup that follows a host eviction does
    /// not free and allocate again every page it writes. `reused` must be allocated, each
    /// page once, and held by nothing else (debug builds check that each is allocated).
    ///
    /// # Errors
    /// As `write`; every page of `reused` is freed then (nothing else allocated or queued).
    pub(crate) fn write_reusing(
        &mut self,
        device_pages: &[PageId],
        reused: &[u32],
        priority: i32,
        mut extra: Vec<PoolTransfer>,
    ) -> Result<&CacheOperation> {
        debug_assert!(
            reused.iter().all(|&h| self.host.is_used(h)),
            "a reused host page is not allocated"
        );
        let (take, rest) = reused.split_at(reused.len().min(device_pages.len()));
        if let Err(e) = self.host.free(rest) {
            let _ = self.host.free(take);
            return Err(e);
        }
        let mut host_pages = Vec::with_capacity(device_pages.len());
        host_pages.extend_from_slice(take);
        let queued = self.check_room(StreamKind::Write).and_then(|()| {
            let n = self.backend.device_pages();
            if let Some(&p) = device_pages.iter().find(|p| p.index() >= n) {
                return Err(HiCacheError::DevicePageOutOfRange(p));
            }
            self.host
                .alloc_into(device_pages.len() - take.len(), &mut host_pages)?;
            if let Err(e) = self.alloc_extra(&mut extra, Direction::DeviceToHost) {
                self.host.free(&host_pages[take.len()..])?;
                return Err(e);
            }
            Ok(())
        });
        if let Err(e) = queued {
            self.host.free(take)?;
            return Err(e);
        }
        let id = self.fresh_id();
        self.pending.0 += 1;
        self.write_queue.push(CacheOperation {
            id,
            device_pages: device_pages.to_vec(),
            host_pages,
            priority,
            extra,
        });
        Ok(self.write_queue.last().expect("just pushed"))
    }

    /// Queues a load of `host_pages` (all layers, pipelined per layer) into device pages it
    /// allocates from `device`, plus device slots for every extra pool in `extra` (whose
    /// `host_indices` the caller fills). Atomic like [`HybridCacheController::write`]. The
    /// caller evicts before calling if the device is short; this never evicts.
    ///
    /// # Errors
    /// [`HiCacheError::QueueFull`], [`HiCacheError::DeviceFull`],
    /// [`HiCacheError::ExtraPoolFull`], unknown pools, host pages that are not allocated;
    /// nothing is allocated or queued then.
    pub fn load(
        &mut self,
        host_pages: &[u32],
        device: &mut PageAllocator,
        mut extra: Vec<PoolTransfer>,
    ) -> Result<&CacheOperation> {
        self.check_room(StreamKind::Load)?;
        if let Some(&h) = host_pages.iter().find(|&&h| !self.host.is_used(h)) {
            return Err(HiCacheError::HostPageOutOfRange(h));
        }
        if device.total() != self.backend.device_pages() {
            return Err(HiCacheError::Config(
                "device allocator does not match the backend's pool".into(),
            ));
        }
        let device_pages = device.alloc(host_pages.len()).map_err(|e| match e {
            CacheError::OutOfPages { needed, available } => {
                HiCacheError::DeviceFull { needed, available }
            }
            other => HiCacheError::Cache(other),
        })?;
        if let Err(e) = self.alloc_extra(&mut extra, Direction::HostToDevice) {
            device.free(&device_pages)?;
            return Err(e);
        }
        let id = self.fresh_id();
        self.pending.1 += 1;
        self.last_load = id;
        self.load_queue.push(CacheOperation {
            id,
            device_pages,
            host_pages: host_pages.to_vec(),
            priority: 0,
            extra,
        });
        Ok(self.load_queue.last().expect("just pushed"))
    }

    /// Allocates the target side of every extra transfer, all or nothing.
    fn alloc_extra(&mut self, extra: &mut [PoolTransfer], dir: Direction) -> Result<()> {
        let mut done = 0;
        let mut res = Ok(());
        for t in extra.iter_mut() {
            let i = match self.extra_index(t.name) {
                Ok(i) => i,
                Err(e) => {
                    res = Err(e);
                    break;
                }
            };
            let p = &mut self.extra[i];
            if dir == Direction::HostToDevice && p.owner == SlotOwner::Caller {
                // The caller names the target slots: check them, allocate nothing.
                if let Err(e) = check_caller_slots(p, t) {
                    res = Err(e);
                    break;
                }
                done += 1;
                continue;
            }
            let (src_pool, dst_pool, src, dst) = match dir {
                Direction::DeviceToHost => (
                    &p.device,
                    &mut p.host,
                    &t.device_indices,
                    &mut t.host_indices,
                ),
                Direction::HostToDevice => (
                    &p.host,
                    &mut p.device,
                    &t.host_indices,
                    &mut t.device_indices,
                ),
            };
            if let Some(&s) = src.iter().find(|&&s| s as usize >= src_pool.total()) {
                res = Err(HiCacheError::HostPageOutOfRange(s));
                break;
            }
            match dst_pool.alloc(src.len()) {
                Some(v) => *dst = v,
                None => {
                    res = Err(HiCacheError::ExtraPoolFull {
                        pool: t.name,
                        needed: src.len(),
                        available: dst_pool.available(),
                    });
                    break;
                }
            }
            done += 1;
        }
        if res.is_err() {
            for t in &mut extra[..done] {
                if let Ok(i) = self.extra_index(t.name) {
                    let p = &mut self.extra[i];
                    if dir == Direction::HostToDevice && p.owner == SlotOwner::Caller {
                        continue;
                    }
                    let (pool, dst) = match dir {
                        Direction::DeviceToHost => (&mut p.host, &mut t.host_indices),
                        Direction::HostToDevice => (&mut p.device, &mut t.device_indices),
                    };
                    // These slots were allocated just above, so freeing cannot fail.
                    let _ = pool.free(dst);
                    dst.clear();
                }
            }
        }
        res
    }

    /// True when nothing is queued, in flight or unacknowledged, and no host page waits for
    /// earlier loads to be freed (the poll that acknowledges the last load frees those): a
    /// step boundary (`poll_acks`) would change nothing.
    pub fn is_idle(&self) -> bool {
        self.pending == (0, 0) && self.deferred_host.is_empty()
    }

    /// Operations queued and not started: (writes, loads).
    pub fn queued(&self) -> (usize, usize) {
        (self.write_queue.len(), self.load_queue.len())
    }

    /// Transfers started and not yet acknowledged: (writes, loads).
    pub fn in_flight(&self) -> (usize, usize) {
        (self.write_acks.len(), self.load_acks.len())
    }

    fn merge(&mut self, ops: &[CacheOperation]) -> (Arc<[PageRun]>, TransferStats) {
        let pages = ops.iter().map(|o| o.device_pages.len()).sum();
        let mut builder = RunBuilder::reusing(std::mem::take(&mut self.run_buffer), pages);
        for op in ops {
            builder.extend(
                op.device_pages
                    .iter()
                    .zip(&op.host_pages)
                    .map(|(d, &h)| (d.0, h)),
            );
        }
        let runs = builder.finish_shared();
        self.run_buffer = builder.into_buffer();
        let mut stats = TransferStats {
            ops: ops.len(),
            pages,
            runs: runs.len(),
            bytes: pages * self.backend.geometry().page_bytes(),
        };
        for p in &self.extra {
            let slots: usize = ops
                .iter()
                .flat_map(|o| o.extra.iter().filter(|t| t.name == p.name))
                .map(|t| t.device_indices.len())
                .sum();
            stats.bytes += slots * p.host_mem.item_bytes();
        }
        (runs, stats)
    }

    /// One slot copy per extra pool that `ops` move, with its slot pairs merged into runs.
    fn merge_extra(&mut self, ops: &[CacheOperation], direction: Direction) -> Vec<SlotCopy> {
        let mut out = Vec::new();
        for p in &self.extra {
            let moved = || {
                ops.iter()
                    .flat_map(|o| o.extra.iter().filter(|t| t.name == p.name))
            };
            let slots = moved().map(|t| t.device_indices.len()).sum();
            if slots == 0 {
                continue;
            }
            let mut runs = RunBuilder::with_capacity(slots);
            for t in moved() {
                runs.extend(
                    t.device_indices
                        .iter()
                        .copied()
                        .zip(t.host_indices.iter().copied()),
                );
            }
            out.push(SlotCopy {
                direction,
                pool: p.name,
                runs: runs.finish().into(),
                host: p.host_mem.clone(),
            });
        }
        out
    }

    /// Merges every queued backup into one device→host transfer (all layers, plus every extra
    /// pool the operations move) on the write stream. Returns `None` when nothing was queued.
    ///
    /// # Errors
    /// The backend refused the copy: the operations stay queued for the next call. A closed
    /// stream ([`HiCacheError::StreamClosed`]): the operations are reported as failed by the
    /// next [`HybridCacheController::poll_acks`].
    pub fn start_writing(&mut self) -> Result<Option<TransferStats>> {
        if self.write_queue.is_empty() {
            return Ok(None);
        }
        let ops = std::mem::take(&mut self.write_queue);
        let (runs, stats) = self.merge(&ops);
        let extra = self.merge_extra(&ops, Direction::DeviceToHost);
        let _span =
            tracing::debug_span!("start_writing", ops = stats.ops, runs = stats.runs).entered();
        let copy = PageCopy {
            direction: Direction::DeviceToHost,
            layers: 0..self.backend.geometry().layers,
            runs,
            host: self.host.memory().clone(),
        };
        let submitted = self
            .backend
            .enqueue_copy(StreamKind::Write, copy)
            .and_then(|()| {
                extra
                    .into_iter()
                    .try_for_each(|c| self.backend.enqueue_slot_copy(StreamKind::Write, c))
            })
            .and_then(|()| self.backend.record_event(StreamKind::Write));
        let ev = match submitted {
            Ok(ev) => ev,
            Err(e @ HiCacheError::StreamClosed(_)) => {
                self.write_acks
                    .push_back(InFlight::failed(Vec::new(), &ops));
                return Err(e);
            }
            Err(e) => {
                // Copies already submitted only rewrite the same host pages; a retry redoes them.
                self.write_queue = ops;
                return Err(e);
            }
        };
        self.write_acks
            .push_back(InFlight::new(vec![ev], ops.iter().map(|o| o.id).collect()));
        Ok(Some(stats))
    }

    /// Reports every queued (not started) backup as failed at the next
    /// [`HybridCacheController::poll_acks`], for a caller that cannot wait for a retry of a
    /// refused submission (write-back eviction frees the source pages right after).
    pub fn fail_queued_writes(&mut self) {
        if !self.write_queue.is_empty() {
            let ops = std::mem::take(&mut self.write_queue);
            self.write_acks
                .push_back(InFlight::failed(Vec::new(), &ops));
        }
    }

    /// Merges every queued load into one host→device transfer, submitted layer by layer on the
    /// load stream with one event per layer in a fresh producer slot of the layer counter.
    /// Extra pools the operations move are copied first, so every layer's event also covers
    /// them.
    ///
    /// The batch also waits for loads of earlier batches that are not acknowledged yet: their
    /// pages are in the tree already, so a request of this batch may have matched them. Call it
    /// once per batch, before its forward, even when the batch queued no load. Returns `None`
    /// when nothing was queued and no load is in flight.
    ///
    /// # Errors
    /// The backend refused a copy, or the producer slot's previous batch failed. The operations
    /// stay queued when nothing was submitted (the batch that needs them must not run: their
    /// device pages hold no KV yet). When part of them was submitted or the stream is closed,
    /// [`HybridCacheController::poll_acks`] reports them as failed once the submitted part is
    /// done. A load of an earlier batch known to have failed that way also fails this batch
    /// (its pages are garbage until the next step boundary repairs them).
    pub fn start_loading(&mut self) -> Result<Option<LoadStep>> {
        if self.load_acks.iter().any(|t| t.failed) {
            return Err(HiCacheError::Transfer(
                "a load of an earlier batch failed to submit; repaired at the next step".into(),
            ));
        }
        if self.load_queue.is_empty() {
            // An earlier load that completed with a failure is not nothing to wait for: its
            // pages are garbage until the step boundary repairs them, and a request of this
            // batch may have matched them. Its events make the batch's layer waits fail.
            if self
                .load_acks
                .iter()
                .all(|t| t.is_complete() && !t.failure_known())
            {
                return Ok(None);
            }
            let producer = self.layers.update_producer()?;
            self.wait_for_earlier_loads(producer);
            return Ok(Some(LoadStep {
                producer,
                stats: TransferStats::default(),
            }));
        }
        let ops = std::mem::take(&mut self.load_queue);
        let (runs, stats) = self.merge(&ops);
        let extra = self.merge_extra(&ops, Direction::HostToDevice);
        let _span =
            tracing::debug_span!("start_loading", ops = stats.ops, runs = stats.runs).entered();
        let producer = match self.layers.update_producer() {
            Ok(p) => p,
            Err(e) => {
                self.load_queue = ops;
                return Err(e);
            }
        };
        self.wait_for_earlier_loads(producer);
        if let Err(e) = extra
            .into_iter()
            .try_for_each(|c| self.backend.enqueue_slot_copy(StreamKind::Load, c))
        {
            if matches!(e, HiCacheError::StreamClosed(_)) {
                self.load_acks.push_back(InFlight::failed(Vec::new(), &ops));
            } else {
                // Only extra slots the operations own were written; nothing is reported yet.
                self.load_queue = ops;
            }
            return Err(e);
        }
        let layers = self.backend.geometry().layers;
        let mut events = Vec::with_capacity(layers);
        for layer in 0..layers {
            let copy = PageCopy {
                direction: Direction::HostToDevice,
                layers: layer..layer + 1,
                runs: runs.clone(),
                host: self.host.memory().clone(),
            };
            let ev = self
                .backend
                .enqueue_copy(StreamKind::Load, copy)
                .and_then(|()| self.backend.record_event(StreamKind::Load));
            match ev {
                Ok(ev) => {
                    self.layers.add_event(producer, layer, ev.clone());
                    events.push(ev);
                }
                Err(e) if layer == 0 && !matches!(e, HiCacheError::StreamClosed(_)) => {
                    self.load_queue = ops;
                    return Err(e);
                }
                Err(e) => {
                    // Part of the transfer is in flight and the rest never will be (or the
                    // stream is gone): report the loads as failed once the submitted part is
                    // done, never as loaded.
                    tracing::error!(error = %e, "pipelined load submission failed mid-way");
                    self.load_acks.push_back(InFlight::failed(events, &ops));
                    return Err(e);
                }
            }
        }
        self.load_acks
            .push_back(InFlight::new(events, ops.iter().map(|o| o.id).collect()));
        Ok(Some(LoadStep { producer, stats }))
    }

    /// Makes `producer`'s layers wait for every unacknowledged load as well (its events report
    /// its own failure, which a later transfer's events would not).
    fn wait_for_earlier_loads(&self, producer: usize) {
        for t in &self.load_acks {
            for (layer, ev) in t.events.iter().enumerate() {
                self.layers.add_event(producer, layer, ev.clone());
            }
        }
    }

    /// Pops the completed transfers, oldest first (a transfer completes only after every older
    /// one on its stream). Also frees deferred host pages whose loads are all done.
    pub fn poll_acks(&mut self) -> Acks {
        let mut acks = Acks::default();
        drain_done(
            &mut self.write_acks,
            &mut acks.writes,
            &mut acks.failed_writes,
        );
        drain_done(&mut self.load_acks, &mut acks.loads, &mut acks.failed_loads);
        self.pending.0 -= acks.writes.len() + acks.failed_writes.len();
        self.pending.1 -= acks.loads.len() + acks.failed_loads.len();
        self.release_deferred();
        acks
    }

    /// Started transfers complete now, counted from the oldest on each stream up to the first
    /// incomplete one: (backups, loads). What [`HybridCacheController::poll_acks_upto`] may
    /// pop; ranks reduce these counts (minimum) before popping, so all apply the same acks.
    pub fn ready_transfers(&self) -> (usize, usize) {
        let ready =
            |q: &VecDeque<InFlight<B::Event>>| q.iter().take_while(|t| t.is_complete()).count();
        (ready(&self.write_acks), ready(&self.load_acks))
    }

    /// Like [`HybridCacheController::poll_acks`], but pops at most `writes` backup transfers
    /// and `loads` load transfers (oldest first; a transfer may carry several operations).
    pub fn poll_acks_upto(&mut self, writes: usize, loads: usize) -> Acks {
        let mut acks = Acks::default();
        drain_done_upto(
            &mut self.write_acks,
            writes,
            &mut acks.writes,
            &mut acks.failed_writes,
        );
        drain_done_upto(
            &mut self.load_acks,
            loads,
            &mut acks.loads,
            &mut acks.failed_loads,
        );
        self.pending.0 -= acks.writes.len() + acks.failed_writes.len();
        self.pending.1 -= acks.loads.len() + acks.failed_loads.len();
        self.release_deferred();
        acks
    }

    /// Allocates `n` host pages outside any transfer (the storage tier fetches into them).
    ///
    /// # Errors
    /// [`HiCacheError::HostFull`]; nothing allocated then.
    pub fn alloc_host(&mut self, n: usize) -> Result<Vec<u32>> {
        self.host.alloc(n)
    }

    /// Allocates `n` host slots of extra pool `name` outside any transfer (the storage tier
    /// fetches stored components into them).
    ///
    /// # Errors
    /// [`HiCacheError::UnknownPool`]; [`HiCacheError::ExtraPoolFull`] (nothing allocated).
    pub fn alloc_extra_host(&mut self, name: PoolName, n: usize) -> Result<Vec<u32>> {
        let i = self.extra_index(name)?;
        let host = &mut self.extra[i].host;
        host.alloc(n).ok_or(HiCacheError::ExtraPoolFull {
            pool: name,
            needed: n,
            available: host.available(),
        })
    }

    /// True when a started transfer that is not complete yet is already known to have failed:
    /// a load whose finished layer reported a failed copy (the forward pass that waited for
    /// that layer got the error) or that was only partly submitted. `poll_acks` reports such a
    /// transfer only once it is complete; [`HiRadixCache::step`](crate::HiRadixCache::step)
    /// waits for it so that it can repair the load at once. Never blocks.
    ///
    /// Only loads can be: a backup is one event (nothing of it is known before it completes),
    /// and a backup known to have failed at submission has no event and is complete.
    pub fn has_failing_transfers(&self) -> bool {
        self.load_acks
            .iter()
            .any(|t| !t.is_complete() && t.failure_known())
    }

    /// Blocks until every started backup is complete (queued ones are not started; loads are
    /// not waited for).
    ///
    /// # Errors
    /// The first failed backup copy.
    pub fn wait_writes(&self) -> Result<()> {
        let mut res = Ok(());
        for t in &self.write_acks {
            res = res.and(t.wait());
        }
        res
    }

    /// Blocks until every started transfer is complete (queued ones are not started).
    ///
    /// # Errors
    /// The first failed copy.
    pub fn wait_all(&self) -> Result<()> {
        let mut res = Ok(());
        for t in self.write_acks.iter().chain(&self.load_acks) {
            res = res.and(t.wait());
        }
        res
    }
}

/// Checks a load's caller-named device slots: one per host slot, in range and distinct; the
/// host slots allocated.
fn check_caller_slots(p: &ExtraPool, t: &PoolTransfer) -> Result<()> {
    if t.device_indices.len() != t.host_indices.len() {
        return Err(HiCacheError::BufferSize {
            expected: t.host_indices.len(),
            got: t.device_indices.len(),
        });
    }
    if let Some(&h) = t.host_indices.iter().find(|&&h| !p.host.is_used(h)) {
        return Err(HiCacheError::HostPageOutOfRange(h));
    }
    let mut seen = t.device_indices.clone();
    seen.sort_unstable();
    let dup = seen.windows(2).any(|w| w[0] == w[1]);
    match seen.last() {
        Some(&d) if d as usize >= p.device.total() || dup => Err(HiCacheError::Config(format!(
            "device slot {d} of extra pool {:?} is out of range or named twice",
            p.name
        ))),
        _ => Ok(()),
    }
}

fn drain_done<E: CopyEvent>(
    q: &mut VecDeque<InFlight<E>>,
    done: &mut Vec<OpId>,
    failed: &mut Vec<OpId>,
) {
    drain_done_upto(q, usize::MAX, done, failed);
}

fn drain_done_upto<E: CopyEvent>(
    q: &mut VecDeque<InFlight<E>>,
    mut max: usize,
    done: &mut Vec<OpId>,
    failed: &mut Vec<OpId>,
) {
    while max > 0 && q.front().is_some_and(InFlight::is_complete) {
        max -= 1;
        let t = q.pop_front().expect("checked");
        if t.wait().is_err() {
            failed.extend(t.ids);
        } else {
            done.extend(t.ids);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{HostLayout, HostSim, HostSimConfig, KvGeometry};

    fn controller(pages: usize) -> HybridCacheController<HostSim> {
        let g = KvGeometry::new(2, 2, 4).unwrap();
        let dev = Arc::new(HostSim::new(g, pages, HostSimConfig::default()).unwrap());
        let pool = HostPool::new(g, pages, HostLayout::LayerFirst).unwrap();
        HybridCacheController::new(dev, pool, &[]).unwrap()
    }

    #[test]
    fn a_backup_writes_to_the_reused_pages_first_and_frees_the_rest() {
        let mut c = controller(8);
        // Host pages held by an earlier backup, now given up by a host eviction.
        let held = c.host.alloc(5).unwrap();
        let dev = [PageId(0), PageId(1), PageId(2)];
        let op = c.write_reusing(&dev, &held[..2], 0, Vec::new()).unwrap();
        assert_eq!(&op.host_pages[..2], &held[..2]);
        assert_eq!(op.host_pages.len(), 3);
        assert!(!held.contains(&op.host_pages[2]), "a fresh page after them");
        // 5 held: 2 reused, 3 still held; 1 fresh.
        assert_eq!(c.host().used(), 6);
        // More reused pages than device pages: the excess is freed, nothing is allocated.
        let op = c
            .write_reusing(&[PageId(3)], &held[2..], 0, Vec::new())
            .unwrap();
        assert_eq!(op.host_pages, [held[2]]);
        assert_eq!(c.host().used(), 4);
        for p in &held[3..] {
            assert!(!c.host().is_used(*p), "excess page {p} still held");
        }
    }

    #[test]
    fn a_refused_reusing_backup_frees_every_reused_page() {
        let mut c = controller(8);
        let held = c.host.alloc(4).unwrap();
        // Out of range: refused before anything is queued.
        let err = c
            .write_reusing(&[PageId(0), PageId(99)], &held[..3], 0, Vec::new())
            .unwrap_err();
        assert_eq!(err, HiCacheError::DevicePageOutOfRange(PageId(99)));
        assert_eq!(c.host().used(), 1, "the three reused pages are freed");
        assert_eq!(c.queued(), (0, 0));
        // The host is short of fresh pages: refused, and the reused ones are freed too.
        let rest = c.host.alloc(7).unwrap();
        let err = c
            .write_reusing(
                &[PageId(0), PageId(1), PageId(2)],
                &rest[..1],
                0,
                Vec::new(),
            )
            .unwrap_err();
        assert!(matches!(err, HiCacheError::HostFull { .. }), "{err:?}");
        assert_eq!(c.host().used(), 7);
        assert_eq!(c.queued(), (0, 0));
    }
}
