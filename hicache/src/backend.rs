//! The device abstraction: a paged KV pool on the device, two copy streams (load and write)
//! that execute submitted copies in order, and events that complete when everything submitted
//! before them on their stream is done.
//!
//! The contract matches CUDA streams and events, so the controller cannot tell
//! [`HostSim`](crate::HostSim) from a GPU backend: `enqueue_copy` returns at once, and the
//! only way to learn that bytes arrived is an event recorded after the copy.

use std::ops::Range;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use radixkv_radix::PageId;

use crate::controller::PoolName;
use crate::error::{HiCacheError, Result};
use crate::geometry::{HostLayout, KvGeometry};

/// Which copy stream an operation runs on. Loads and writes use separate streams so a
/// backup never delays a load the forward pass waits for.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum StreamKind {
    /// Host → device (load-back).
    Load,
    /// Device → host (backup).
    Write,
}

/// Direction of a copy.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Device pages to host pages.
    DeviceToHost,
    /// Host pages to device pages.
    HostToDevice,
}

/// A run of `pages` consecutive device pages paired with as many consecutive host pages.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PageRun {
    /// First device page.
    pub device: u32,
    /// First host page.
    pub host: u32,
    /// Number of pages (≥ 1).
    pub pages: u32,
}

/// One submitted copy: the given runs, for the layers in `layers`.
#[derive(Clone, Debug)]
pub struct PageCopy {
    /// Direction.
    pub direction: Direction,
    /// Layers to copy (a single layer for pipelined loads, all layers for backups).
    pub layers: Range<usize>,
    /// The page runs (shared between the per-layer copies of one transfer).
    pub runs: Arc<[PageRun]>,
    /// The host pool's memory.
    pub host: Arc<HostMemory>,
}

impl PageCopy {
    /// A copy of `runs` over `layers` between the device and `host`, in `direction`.
    pub fn new(
        host: &Arc<HostMemory>,
        direction: Direction,
        layers: Range<usize>,
        runs: &[PageRun],
    ) -> Self {
        PageCopy {
            direction,
            layers,
            runs: runs.into(),
            host: host.clone(),
        }
    }
}

/// The bytes of an extra pool of `slots` items of `item_bytes` (what every backend allocates
/// for [`DeviceBackend::register_extra_pool`] and a [`SlotMemory`] holds).
///
/// # Errors
/// [`HiCacheError::Config`] for an empty pool or a size that overflows.
pub(crate) fn extra_pool_bytes(pool: PoolName, slots: u32, item_bytes: usize) -> Result<usize> {
    (slots as usize)
        .checked_mul(item_bytes)
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            HiCacheError::Config(format!(
                "extra pool {pool:?}: {slots} slots of {item_bytes} bytes is empty or too large"
            ))
        })
}

/// Whether a pool registered as `slots` × `item_bytes` may be registered again as `want_slots`
/// × `want_bytes`: `Ok` for the same sizes (registration is idempotent), a
/// [`HiCacheError::Config`] for others.
pub(crate) fn same_extra_pool(
    pool: PoolName,
    (slots, item_bytes): (usize, usize),
    (want_slots, want_bytes): (u32, usize),
) -> Result<()> {
    if slots == want_slots as usize && item_bytes == want_bytes {
        Ok(())
    } else {
        Err(HiCacheError::Config(format!(
            "extra pool {pool:?} is registered with other sizes"
        )))
    }
}

/// One submitted copy of extra-pool slots (Mamba state, SWA KV, ...): each run moves `pages`
/// consecutive slots of `item_bytes` each between the device-side buffer of `pool` and `host`.
/// An extra-pool item has no layers, so the copy is one contiguous span per run on both sides.
#[derive(Clone, Debug)]
pub struct SlotCopy {
    /// Direction.
    pub direction: Direction,
    /// The pool (the backend resolves its device-side buffer).
    pub pool: PoolName,
    /// Slot runs: `device` and `host` are first slots, `pages` is the slot count.
    pub runs: Arc<[PageRun]>,
    /// The pool's host-side buffer.
    pub host: Arc<SlotMemory>,
}

/// Completion handle of everything submitted to a stream before it was recorded.
pub trait CopyEvent: Clone + Send + Sync + 'static {
    /// True once the copies before the event are done (successfully or not).
    fn is_complete(&self) -> bool;
    /// Blocks until the event completes. Every event completes, even when the stream dies
    /// before reaching it, so this never blocks forever.
    ///
    /// # Errors
    /// [`HiCacheError::Transfer`] when a copy before the event failed;
    /// [`HiCacheError::StreamClosed`] when the stream's worker exited before reaching it.
    fn wait(&self) -> Result<()>;
}

/// A device with a paged KV pool and two asynchronous copy streams.
///
/// Implementations: [`HostSim`](crate::HostSim) (ordinary memory, worker threads) and, with the
/// `cuda` feature, `cuda::CudaBackend` (device memory, asynchronous memcpys on two streams,
/// CUDA events; the host pool's buffer is registered as pinned memory). Backends allocate (or
/// wrap) the device pool when they are constructed.
pub trait DeviceBackend: Send + Sync + 'static {
    /// The stream event type.
    type Event: CopyEvent;
    /// Short name (`"hostsim"`, `"cuda"`).
    fn name(&self) -> &'static str;
    /// Geometry of the device pool.
    fn geometry(&self) -> KvGeometry;
    /// Pages in the device pool.
    fn device_pages(&self) -> usize;
    /// Makes `host` usable as a copy source and target (pins it on CUDA). Idempotent.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] when its geometry differs from the device's.
    fn register_host(&self, host: &Arc<HostMemory>) -> Result<()>;
    /// Submits a copy to `stream`; returns without waiting for it (it may block while the
    /// stream's queue is full).
    ///
    /// # Errors
    /// Out-of-range pages or layers, a refused submission ([`HiCacheError::Transfer`]: nothing
    /// is submitted, a retry may succeed) or a dead stream ([`HiCacheError::StreamClosed`]).
    fn enqueue_copy(&self, stream: StreamKind, copy: PageCopy) -> Result<()>;
    /// Records an event on `stream` after everything submitted so far.
    ///
    /// # Errors
    /// A refused submission ([`HiCacheError::Transfer`]) or a dead stream
    /// ([`HiCacheError::StreamClosed`]).
    fn record_event(&self, stream: StreamKind) -> Result<Self::Event>;
    /// Allocates the device-side buffer of an extra pool: `slots` items of `item_bytes` bytes.
    /// Idempotent for the same sizes.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] for zero sizes or a pool registered with other sizes.
    fn register_extra_pool(&self, pool: PoolName, slots: u32, item_bytes: usize) -> Result<()>;
    /// Submits an extra-pool copy to `stream`, ordered with the KV copies submitted there (an
    /// event recorded after both covers both); returns without waiting for it.
    ///
    /// # Errors
    /// Unregistered pool, out-of-range slots, mismatched item size (nothing is submitted then)
    /// or a dead stream.
    fn enqueue_slot_copy(&self, stream: StreamKind, copy: SlotCopy) -> Result<()>;
    /// Synchronously reads one slot of an extra pool's device-side buffer.
    ///
    /// # Errors
    /// Unregistered pool, out-of-range slot, wrong buffer size.
    fn read_extra_slot(&self, pool: PoolName, slot: u32, out: &mut [u8]) -> Result<()>;
    /// Synchronously writes one slot of an extra pool's device-side buffer (what the model
    /// does when it updates the state).
    ///
    /// # Errors
    /// Unregistered pool, out-of-range slot, wrong buffer size.
    fn write_extra_slot(&self, pool: PoolName, slot: u32, data: &[u8]) -> Result<()>;
    /// Synchronously reads one page of one layer of the device pool (tests, debugging and
    /// engines without kernels of their own).
    ///
    /// # Errors
    /// Out-of-range layer or page, wrong buffer size.
    fn read_device_page(&self, layer: usize, page: PageId, out: &mut [u8]) -> Result<()>;
    /// Synchronously writes one page of one layer of the device pool (what the forward pass
    /// does when it computes KV).
    ///
    /// # Errors
    /// Out-of-range layer or page, wrong buffer size.
    fn write_device_page(&self, layer: usize, page: PageId, data: &[u8]) -> Result<()>;
}

/// The bytes of a host pool: one buffer in the chosen [`HostLayout`].
///
/// Shared between the cache thread and the stream workers. The lock makes concurrent access
/// sound; the page allocator's protocol (a page is never read and written by two live
/// operations) is what makes the contents meaningful.
#[derive(Debug)]
pub struct HostMemory {
    geometry: KvGeometry,
    pages: usize,
    layout: HostLayout,
    bytes: RwLock<crate::host_pool::PageAligned>,
}

impl HostMemory {
    /// A zeroed host buffer of `pages` pages.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] for zero pages or a size that overflows;
    /// [`HiCacheError::AllocFailed`] when the allocator refuses the pool.
    pub fn new(geometry: KvGeometry, pages: usize, layout: HostLayout) -> Result<Self> {
        geometry.validate()?;
        if pages == 0 || pages > u32::MAX as usize {
            return Err(HiCacheError::Config(format!(
                "host pool of {pages} pages must be in 1..=u32::MAX"
            )));
        }
        let n = geometry.pool_bytes(pages)?;
        Ok(HostMemory {
            geometry,
            pages,
            layout,
            bytes: RwLock::new(crate::host_pool::PageAligned::zeroed(n, "host pool")?),
        })
    }

    /// The geometry.
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    /// Pages in the buffer.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// The layout.
    pub fn layout(&self) -> HostLayout {
        self.layout
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.pages * self.geometry.page_bytes()
    }

    fn check(&self, layer: usize, page: u32, len: usize) -> Result<usize> {
        if layer >= self.geometry.layers {
            return Err(HiCacheError::LayerOutOfRange {
                layer,
                layers: self.geometry.layers,
            });
        }
        if page as usize >= self.pages {
            return Err(HiCacheError::HostPageOutOfRange(page));
        }
        let want = self.geometry.page_bytes_per_layer();
        if len != want {
            return Err(HiCacheError::BufferSize {
                expected: want,
                got: len,
            });
        }
        Ok(self
            .layout
            .offset(&self.geometry, self.pages, layer, page as usize))
    }

    /// Reads one page of one layer.
    ///
    /// # Errors
    /// Out-of-range layer or page, wrong buffer size.
    pub fn read_page(&self, layer: usize, page: u32, out: &mut [u8]) -> Result<()> {
        let o = self.check(layer, page, out.len())?;
        out.copy_from_slice(&self.read()[o..o + out.len()]);
        Ok(())
    }

    /// Writes one page of one layer (fills a host page from outside the controller).
    ///
    /// # Errors
    /// Out-of-range layer or page, wrong buffer size.
    pub fn write_page(&self, layer: usize, page: u32, data: &[u8]) -> Result<()> {
        let o = self.check(layer, page, data.len())?;
        self.write()[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, crate::host_pool::PageAligned> {
        self.bytes.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, crate::host_pool::PageAligned> {
        self.bytes.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Start of the buffer, for a device backend's DMA (the allocation never moves). Taken
    /// through the write lock so the pointer may be written through.
    #[cfg(feature = "cuda")]
    pub(crate) fn dma_ptr(&self) -> *mut u8 {
        self.write().as_mut_ptr()
    }
}

/// A flat buffer of fixed-size slots: the host side of an extra pool, and the device side of
/// one in [`HostSim`](crate::HostSim).
#[derive(Debug)]
pub struct SlotMemory {
    pool: PoolName,
    slots: usize,
    item_bytes: usize,
    bytes: RwLock<crate::host_pool::PageAligned>,
}

impl SlotMemory {
    /// A zeroed buffer of `slots` items of `item_bytes` bytes.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] for zero sizes or a size that overflows;
    /// [`HiCacheError::AllocFailed`] when the allocator refuses the pool.
    pub fn new(pool: PoolName, slots: u32, item_bytes: usize) -> Result<Self> {
        let n = extra_pool_bytes(pool, slots, item_bytes)?;
        Ok(SlotMemory {
            pool,
            slots: slots as usize,
            item_bytes,
            bytes: RwLock::new(crate::host_pool::PageAligned::zeroed(n, "extra pool")?),
        })
    }

    /// The pool.
    pub fn pool(&self) -> PoolName {
        self.pool
    }

    /// Slots in the buffer.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes of one slot.
    pub fn item_bytes(&self) -> usize {
        self.item_bytes
    }

    fn check(&self, slot: u32, len: usize) -> Result<usize> {
        if slot as usize >= self.slots {
            return Err(HiCacheError::HostPageOutOfRange(slot));
        }
        if len != self.item_bytes {
            return Err(HiCacheError::BufferSize {
                expected: self.item_bytes,
                got: len,
            });
        }
        Ok(slot as usize * self.item_bytes)
    }

    /// Reads one slot.
    ///
    /// # Errors
    /// Out-of-range slot, wrong buffer size.
    pub fn read_slot(&self, slot: u32, out: &mut [u8]) -> Result<()> {
        let o = self.check(slot, out.len())?;
        out.copy_from_slice(&self.read()[o..o + out.len()]);
        Ok(())
    }

    /// Writes one slot.
    ///
    /// # Errors
    /// Out-of-range slot, wrong buffer size.
    pub fn write_slot(&self, slot: u32, data: &[u8]) -> Result<()> {
        let o = self.check(slot, data.len())?;
        self.write()[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }

    /// Checks that every run lies inside this buffer on the given side.
    pub(crate) fn check_runs(&self, runs: &[PageRun], device_side: bool) -> Result<()> {
        for r in runs {
            let first = if device_side { r.device } else { r.host };
            let end = first as usize + r.pages as usize;
            if r.pages == 0 || end > self.slots {
                return Err(HiCacheError::HostPageOutOfRange(
                    end.saturating_sub(1) as u32
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, crate::host_pool::PageAligned> {
        self.bytes.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, crate::host_pool::PageAligned> {
        self.bytes.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Start of the buffer, for a device backend's DMA (see [`HostMemory`]'s).
    #[cfg(feature = "cuda")]
    pub(crate) fn dma_ptr(&self) -> *mut u8 {
        self.write().as_mut_ptr()
    }

    /// Size in bytes.
    #[cfg(feature = "cuda")]
    pub(crate) fn len_bytes(&self) -> usize {
        self.slots * self.item_bytes
    }
}

/// Checks that every run of `copy` lies inside a device pool of `device_pages` pages, the host
/// buffer and the geometry. Backends call it before accepting a copy.
///
/// # Errors
/// The first out-of-range page or layer.
pub fn validate_copy(geometry: &KvGeometry, device_pages: usize, copy: &PageCopy) -> Result<()> {
    if copy.host.geometry() != *geometry {
        return Err(HiCacheError::Config(
            "host pool geometry differs from the device's".into(),
        ));
    }
    if copy.layers.end > geometry.layers || copy.layers.start > copy.layers.end {
        return Err(HiCacheError::LayerOutOfRange {
            layer: copy.layers.end.saturating_sub(1),
            layers: geometry.layers,
        });
    }
    for r in copy.runs.iter() {
        let dev_end = r.device as usize + r.pages as usize;
        if r.pages == 0 || dev_end > device_pages {
            return Err(HiCacheError::DevicePageOutOfRange(PageId(
                dev_end.saturating_sub(1) as u32,
            )));
        }
        let host_end = r.host as usize + r.pages as usize;
        if host_end > copy.host.pages() {
            return Err(HiCacheError::HostPageOutOfRange(
                host_end.saturating_sub(1) as u32
            ));
        }
    }
    Ok(())
}
