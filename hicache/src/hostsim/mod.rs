//! [`HostSim`]: a [`DeviceBackend`] whose "device" pool is ordinary memory and whose streams
//! are worker threads, with the asynchronous semantics of a GPU.
//!
//! Each stream is one thread that executes submitted copies strictly in submission order; an
//! event recorded on a stream completes when the worker reaches it, i.e. after every copy
//! submitted before it. Tests can slow copies down ([`HostSimConfig::per_copy_delay`]) or hold
//! them until released ([`CopyGate`]) to choose the point at which each copy completes.
//!
//! # Limits and failures
//! - **Back-pressure.** A stream queues at most [`HostSimConfig::stream_capacity`] commands (a
//!   copy, an extra-pool copy or an event each); a submission beyond that blocks until the
//!   worker makes room, as a full GPU launch queue blocks the launching thread
//!   ([`HostSim::blocked_submissions`] counts them). The controller's own limit on pending
//!   operations keeps a cache far below it.
//! - **A dead worker.** If a stream's worker exits (it panicked), every event still queued
//!   on it completes with [`HiCacheError::StreamClosed`], an event recorded later is refused
//!   with the same error, and so is every later copy: `wait` never blocks forever.
//! - **Fault injection.** [`HostSim::fail_next_copies`] (a copy fails: poisoned bytes, a failed
//!   event) and [`HostSim::refuse_next_submissions`] (the submission itself is refused).

mod mem;
mod stream;

use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use radixkv_radix::PageId;

use crate::backend::{
    DeviceBackend, HostMemory, PageCopy, SlotCopy, SlotMemory, StreamKind, validate_copy,
};
use crate::controller::PoolName;
use crate::error::{HiCacheError, Result};
use crate::geometry::KvGeometry;
use mem::DeviceMem;
pub use mem::POISON_BYTE;
use stream::{Cmd, SimSync, Stream, WorkerOptions};
pub use stream::{CopyGate, SimEvent};

/// Commands a stream queues by default before a submission blocks.
pub const DEFAULT_STREAM_CAPACITY: usize = 4096;

/// Options of a [`HostSim`].
#[derive(Clone, Debug)]
pub struct HostSimConfig {
    /// Sleep before executing each submitted copy (a per-layer copy of a pipelined load is one
    /// copy), to make overlap observable.
    pub per_copy_delay: Duration,
    /// Hold every copy until a permit is released through [`HostSim::gate`].
    pub gated: bool,
    /// Commands (copies and events) a stream queues before a submission blocks (≥ 1; default
    /// [`DEFAULT_STREAM_CAPACITY`]).
    pub stream_capacity: usize,
    /// Test hook, not a setting: a worker that exits leaves its queued events pending forever
    /// (the failure mode the exit guard prevents), so tests can show that their hang
    /// detector catches it.
    #[doc(hidden)]
    pub unguarded_worker_exit: bool,
}

impl Default for HostSimConfig {
    fn default() -> Self {
        HostSimConfig {
            per_copy_delay: Duration::ZERO,
            gated: false,
            stream_capacity: DEFAULT_STREAM_CAPACITY,
            unguarded_worker_exit: false,
        }
    }
}

/// The host-memory device backend. See the module docs.
pub struct HostSim {
    mem: Arc<DeviceMem>,
    load: Stream,
    write: Stream,
    gate: Option<CopyGate>,
    sync: Arc<SimSync>,
    extra: RwLock<Vec<Arc<SlotMemory>>>,
}

impl std::fmt::Debug for HostSim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSim")
            .field("geometry", &self.mem.geometry)
            .field("pages", &self.mem.pages)
            .finish()
    }
}

impl HostSim {
    /// A simulated device with a zeroed pool of `pages` pages and two stream workers.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] for zero pages, a zero stream capacity or an overflowing size;
    /// [`HiCacheError::AllocFailed`] when the pool cannot be allocated; thread spawn failure.
    pub fn new(geometry: KvGeometry, pages: usize, cfg: HostSimConfig) -> Result<Self> {
        if pages == 0 || pages > u32::MAX as usize {
            return Err(HiCacheError::Config(format!(
                "device pool of {pages} pages must be in 1..=u32::MAX"
            )));
        }
        if cfg.stream_capacity == 0 {
            return Err(HiCacheError::Config(
                "a HostSim stream must queue at least one command".into(),
            ));
        }
        let mem = Arc::new(DeviceMem::new(geometry, pages)?);
        let sync = SimSync::new(cfg.gated);
        let opts = WorkerOptions {
            capacity: cfg.stream_capacity,
            delay: cfg.per_copy_delay,
            unguarded: cfg.unguarded_worker_exit,
        };
        let load = Stream::spawn(StreamKind::Load, mem.clone(), sync.clone(), &opts)?;
        let write = match Stream::spawn(StreamKind::Write, mem.clone(), sync.clone(), &opts) {
            Ok(w) => w,
            Err(e) => {
                load.shut_down();
                return Err(e);
            }
        };
        Ok(HostSim {
            load,
            write,
            mem,
            gate: cfg.gated.then(|| CopyGate(sync.clone())),
            sync,
            extra: RwLock::new(Vec::new()),
        })
    }

    /// Fault injection: the next `n` copies executed on `stream` fail. A failed copy fills its
    /// destination with [`POISON_BYTE`] and fails the next event recorded on the stream (the
    /// event of a pipelined load's layer, or of a whole backup), as a device error would.
    pub fn fail_next_copies(&self, stream: StreamKind, n: u32) {
        self.stream(stream)
            .faults
            .copies
            .fetch_add(n, Ordering::SeqCst);
    }

    /// Fault injection: the next `n` submissions to `stream` (a copy, an extra-pool copy or an
    /// event) are refused with [`HiCacheError::Transfer`] and not queued, as a device that
    /// cannot take a launch right now refuses it. Refusals are transient: the submission after
    /// them is accepted.
    pub fn refuse_next_submissions(&self, stream: StreamKind, n: u32) {
        self.stream(stream)
            .faults
            .refusals
            .fetch_add(n, Ordering::SeqCst);
    }

    /// Test hook: the worker of `stream` dies (panics) when it reaches its next copy, after
    /// the gate lets that copy through.
    #[doc(hidden)]
    pub fn inject_worker_panic(&self, stream: StreamKind) {
        self.stream(stream)
            .faults
            .panics
            .fetch_add(1, Ordering::SeqCst);
    }

    /// True once the worker of `stream` has exited: every submission to it fails with
    /// [`HiCacheError::StreamClosed`].
    pub fn is_stream_closed(&self, stream: StreamKind) -> bool {
        self.stream(stream).is_closed()
    }

    /// True when the worker of `stream` holds a copy that waits for a gate permit.
    pub fn is_held(&self, stream: StreamKind) -> bool {
        self.sync.is_held(stream)
    }

    /// Submissions to `stream` that found its queue full and waited for room.
    pub fn blocked_submissions(&self, stream: StreamKind) -> u64 {
        self.stream(stream).blocked_submissions()
    }

    /// Blocks until `stream` can make no progress on its own: everything submitted is done,
    /// or its worker holds a copy that waits for a gate permit, or the worker has exited.
    /// With a gate, this makes "release one copy, then observe" deterministic.
    pub fn wait_settled(&self, stream: StreamKind) {
        self.sync.wait_settled(stream);
    }

    fn extra_pool(&self, pool: PoolName) -> Result<Arc<SlotMemory>> {
        self.extra
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|m| m.pool() == pool)
            .cloned()
            .ok_or(HiCacheError::UnknownPool(pool))
    }

    /// The copy gate, when the backend was built with [`HostSimConfig::gated`].
    pub fn gate(&self) -> Option<&CopyGate> {
        self.gate.as_ref()
    }

    fn stream(&self, s: StreamKind) -> &Stream {
        match s {
            StreamKind::Load => &self.load,
            StreamKind::Write => &self.write,
        }
    }

    fn page_offset(&self, layer: usize, page: PageId, len: usize) -> Result<usize> {
        let g = &self.mem.geometry;
        if layer >= g.layers {
            return Err(HiCacheError::LayerOutOfRange {
                layer,
                layers: g.layers,
            });
        }
        if page.index() >= self.mem.pages {
            return Err(HiCacheError::DevicePageOutOfRange(page));
        }
        if len != g.page_bytes_per_layer() {
            return Err(HiCacheError::BufferSize {
                expected: g.page_bytes_per_layer(),
                got: len,
            });
        }
        Ok(page.index() * len)
    }
}

impl Drop for HostSim {
    fn drop(&mut self) {
        if let Some(g) = &self.gate {
            g.open();
        }
        // Closing the channel ends the worker after it drains what was submitted.
        self.load.shut_down();
        self.write.shut_down();
    }
}

impl DeviceBackend for HostSim {
    type Event = SimEvent;

    fn name(&self) -> &'static str {
        "hostsim"
    }

    fn geometry(&self) -> KvGeometry {
        self.mem.geometry
    }

    fn device_pages(&self) -> usize {
        self.mem.pages
    }

    fn register_host(&self, host: &Arc<HostMemory>) -> Result<()> {
        if host.geometry() != self.mem.geometry {
            return Err(HiCacheError::Config(
                "host pool geometry differs from the device's".into(),
            ));
        }
        Ok(())
    }

    fn enqueue_copy(&self, stream: StreamKind, copy: PageCopy) -> Result<()> {
        validate_copy(&self.mem.geometry, self.mem.pages, &copy)?;
        self.stream(stream).submit(Cmd::Copy(copy))
    }

    fn record_event(&self, stream: StreamKind) -> Result<SimEvent> {
        self.stream(stream).record()
    }

    fn register_extra_pool(&self, pool: PoolName, slots: u32, item_bytes: usize) -> Result<()> {
        let mut pools = self.extra.write().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = pools.iter().find(|m| m.pool() == pool) {
            return crate::backend::same_extra_pool(
                pool,
                (m.slots(), m.item_bytes()),
                (slots, item_bytes),
            );
        }
        pools.push(Arc::new(SlotMemory::new(pool, slots, item_bytes)?));
        Ok(())
    }

    fn enqueue_slot_copy(&self, stream: StreamKind, copy: SlotCopy) -> Result<()> {
        let dev = self.extra_pool(copy.pool)?;
        if copy.host.item_bytes() != dev.item_bytes() || copy.host.pool() != copy.pool {
            return Err(HiCacheError::Config(format!(
                "host buffer does not match extra pool {:?}",
                copy.pool
            )));
        }
        dev.check_runs(&copy.runs, true)?;
        copy.host.check_runs(&copy.runs, false)?;
        self.stream(stream).submit(Cmd::Slots(copy, dev))
    }

    fn read_extra_slot(&self, pool: PoolName, slot: u32, out: &mut [u8]) -> Result<()> {
        self.extra_pool(pool)?.read_slot(slot, out)
    }

    fn write_extra_slot(&self, pool: PoolName, slot: u32, data: &[u8]) -> Result<()> {
        self.extra_pool(pool)?.write_slot(slot, data)
    }

    fn read_device_page(&self, layer: usize, page: PageId, out: &mut [u8]) -> Result<()> {
        let o = self.page_offset(layer, page, out.len())?;
        let l = self.mem.layers[layer]
            .read()
            .unwrap_or_else(|e| e.into_inner());
        out.copy_from_slice(&l[o..o + out.len()]);
        Ok(())
    }

    fn write_device_page(&self, layer: usize, page: PageId, data: &[u8]) -> Result<()> {
        let o = self.page_offset(layer, page, data.len())?;
        let mut l = self.mem.layers[layer]
            .write()
            .unwrap_or_else(|e| e.into_inner());
        l[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }
}
