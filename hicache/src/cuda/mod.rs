//! [`CudaBackend`]: the [`DeviceBackend`] of NVIDIA GPUs, through the CUDA driver API
//! ([`cudarc`], loaded at run time: building needs no CUDA toolkit, running needs the driver).
//!
//! Same semantics as [`HostSim`](crate::HostSim): `enqueue_copy` returns once the copies are
//! queued on the stream, and an event recorded after them completes when they are done.
//!
//! - **Device pools.** Allocated by the backend ([`CudaBackend::new`]: one allocation per
//!   layer, zeroed) or wrapping the engine's own KV memory ([`CudaBackend::from_device_regions`]:
//!   per layer one or more [`DeviceRegion`]s with a page stride, e.g. the K and V buffers of a
//!   paged pool). Extra pools (Mamba states, SWA KV) are allocated by
//!   [`DeviceBackend::register_extra_pool`] or wrapped with [`CudaBackend::wrap_extra_pool`].
//! - **Host pool.** [`DeviceBackend::register_host`] page-locks the host pool's existing
//!   allocation (`cuMemHostRegister`, portable, not write-combined, so the CPU reads it at
//!   full speed). When the driver refuses, the buffer stays pageable: copies still work (the
//!   driver stages them) and [`CudaBackend::pin_failures`] counts it. Extra pools' host
//!   buffers are registered the first time a copy names them.
//! - **Streams.** A load stream and a write stream, both non-blocking and separate from the
//!   engine's compute stream, and a third one for the synchronous page and slot accessors.
//! - **Copies.** Each copy is planned into contiguous spans (adjacent pages of a run merge
//!   when both sides are contiguous: layer-first host layouts give one span per run and
//!   layer; page-first ones one per page and layer) and submitted by one of three methods
//!   ([`CopyMethod`], [`CudaConfig::copy_method`]): one asynchronous memcpy per span; one
//!   `cuMemcpyBatchAsync` for the whole copy (used only when the driver reports CUDA 12.8 or
//!   later and exports the call, checked when the backend opens); or a small gather/scatter
//!   kernel, compiled with NVRTC when the backend opens (`libnvrtc` is loaded at run time
//!   like the driver; without it the kernel is simply not available), that copies up to
//!   1,360 spans per launch (160 before CUDA 12.1) between device memory and the pinned host
//!   buffer's device mapping. Copies are planned and submitted layer by layer, so the device
//!   starts on the first layer while the next ones are planned. The default,
//!   [`CopyMethod::Auto`], sends copies of a few spans as memcpys, copies of short spans
//!   (under [`CudaConfig::kernel_max_span`] on average: single pages, page-first layouts,
//!   short runs) to the kernel and longer ones to the batched call;
//!   [`CudaBackend::copy_counts`] says what it picked. The `gpu_check` example measures
//!   every method against one large memcpy; the README has its figures on an H200, from
//!   which the defaults were set.
//! - **Events.** [`CudaCopyEvent`] wraps a CUDA event recorded on the stream.
//!   `is_complete` queries it (write completion is checked at step boundaries, no polling
//!   thread); the engine's compute stream can wait on a layer's load on the device with
//!   [`CudaCopyEvent::make_stream_wait`] (the events of a batch's layer come from
//!   [`LayerDoneCounter::layer_events`](crate::LayerDoneCounter::layer_events)).
//! - **Errors.** A missing driver library, a driver without devices or a wrong ordinal is
//!   [`HiCacheError::NoDevice`] (the library is looked for before any driver function is
//!   called: cudarc would panic otherwise); failed setup calls are [`HiCacheError::Driver`];
//!   an out-of-memory allocation is [`HiCacheError::AllocFailed`]; a failed copy or event is
//!   [`HiCacheError::Transfer`]. A copy whose memcpys were only partly queued fails the next
//!   event of its stream, so its bytes are never acknowledged.
//!
//! Tests can fail copies as [`HostSim::fail_next_copies`](crate::HostSim::fail_next_copies)
//! does ([`CudaBackend::fail_next_copies`]: the destination is poisoned on the stream, the next
//! event fails). Not here: HostSim's refusals, dead-worker hooks and copy gate (the tests that
//! need them run on HostSim only).

mod method;
mod plan;

pub use cudarc;
pub use method::{AUTO_MEMCPY_MIN_SPAN, AUTO_MIN_SPANS, CopyMethod, DEFAULT_KERNEL_MAX_SPAN};
pub use plan::DeviceRegion;

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError, result, sys};
use radixkv_radix::PageId;

use crate::backend::{
    CopyEvent, DeviceBackend, Direction, HostMemory, PageCopy, SlotCopy, SlotMemory, StreamKind,
    validate_copy,
};
use crate::controller::PoolName;
use crate::error::{HiCacheError, Result};
use crate::geometry::KvGeometry;
use crate::hostsim::POISON_BYTE;
use method::{Have, Route};
use plan::Span;

/// What [`probe`] found.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CudaDriverInfo {
    /// The driver's CUDA version, as the driver reports it (e.g. 12080 for 12.8).
    pub driver_version: i32,
    /// Devices the driver sees.
    pub devices: usize,
}

/// Looks for the CUDA driver and its devices without panicking.
///
/// # Errors
/// [`HiCacheError::NoDevice`] when the driver library is not installed (checked before any
/// driver function is called), when it fails to initialise, or when it sees no device;
/// [`HiCacheError::Driver`] when a query fails.
pub fn probe() -> Result<CudaDriverInfo> {
    probe_with(driver_library_present)
}

fn driver_library_present() -> bool {
    // SAFETY: loads and unloads the driver library by its usual names, running only its
    // initialisers; no function of it is called.
    unsafe { sys::is_culib_present() }
}

/// Every driver function the backend calls (through cudarc, which panics on a missing one).
const REQUIRED_DRIVER_FUNCTIONS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemsetD8_v2",
    "cuMemsetD8Async",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemHostGetDevicePointer_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuLaunchHostFunc",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// [`probe`] with the library check injected (tests drive the missing-library path on any
/// machine).
pub(crate) fn probe_with(library_present: impl FnOnce() -> bool) -> Result<CudaDriverInfo> {
    if !library_present() {
        return Err(HiCacheError::NoDevice(
            "the CUDA driver library (libcuda) is not installed or not on the library path".into(),
        ));
    }
    // cudarc panics when a function is missing from the library (a stub, a foreign or a very
    // old `libcuda`): that is no usable driver either. Look every function the backend calls
    // up first, and keep any panic of the first call from unwinding into the caller.
    // SAFETY: the library is present (checked above), so `culib` loads it without panicking;
    // looking symbols up calls nothing.
    let missing: Vec<&str> = REQUIRED_DRIVER_FUNCTIONS
        .iter()
        .filter(|name| unsafe {
            sys::culib()
                .get::<*const std::ffi::c_void>(name.as_bytes())
                .is_err()
        })
        .copied()
        .collect();
    if !missing.is_empty() {
        return Err(HiCacheError::NoDevice(format!(
            "the CUDA driver library lacks the driver API (missing: {})",
            missing.join(", ")
        )));
    }
    let init = std::panic::catch_unwind(result::init).map_err(|_| {
        HiCacheError::NoDevice("the CUDA driver library lacks the driver API (cuInit)".into())
    })?;
    init.map_err(|e| HiCacheError::NoDevice(format!("cuInit failed: {}", describe(e))))?;
    let mut version = 0;
    // SAFETY: the library is present and initialised; the out-pointer is valid.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| driver("cuDriverGetVersion", e))?;
    let devices = result::device::get_count().map_err(|e| driver("cuDeviceGetCount", e))?;
    if devices <= 0 {
        return Err(HiCacheError::NoDevice(
            "the CUDA driver sees no device".into(),
        ));
    }
    Ok(CudaDriverInfo {
        driver_version: version,
        devices: devices as usize,
    })
}

fn describe(e: DriverError) -> String {
    match (e.error_name(), e.error_string()) {
        (Ok(n), Ok(s)) => format!("{} ({})", n.to_string_lossy(), s.to_string_lossy()),
        _ => format!("{:?}", e.0),
    }
}

fn driver(call: &'static str, e: DriverError) -> HiCacheError {
    HiCacheError::Driver {
        call,
        error: describe(e),
    }
}

fn transfer(call: &str, e: DriverError) -> HiCacheError {
    HiCacheError::Transfer(format!("{call} failed: {}", describe(e)))
}

/// Options of a [`CudaBackend`].
#[derive(Clone, Debug)]
pub struct CudaConfig {
    /// Device ordinal (default 0). The backend uses the device's primary context, the one
    /// engines built on the CUDA runtime use.
    pub ordinal: usize,
    /// Page-lock host buffers (default true). False leaves them pageable (slower copies that
    /// the driver stages; for comparisons).
    pub pin_host: bool,
    /// How copies are submitted (default [`CopyMethod::Auto`]).
    pub copy_method: CopyMethod,
    /// Under [`CopyMethod::Auto`], copies whose spans average fewer bytes than this go to the
    /// kernel, longer ones to the batched call (default [`DEFAULT_KERNEL_MAX_SPAN`]; see
    /// [`CopyMethod::Auto`] for machines without one of them).
    pub kernel_max_span: usize,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            ordinal: 0,
            pin_host: true,
            copy_method: CopyMethod::Auto,
            kernel_max_span: DEFAULT_KERNEL_MAX_SPAN,
        }
    }
}

/// Copies a [`CudaBackend`] submitted, per route ([`CudaBackend::copy_counts`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct CopyCounts {
    /// Copies submitted as one memcpy per span.
    pub memcpy: u64,
    /// Copies submitted as one batched call.
    pub batched: u64,
    /// Copies submitted as kernel launches.
    pub kernel: u64,
}

/// A completion event of a [`CudaBackend`] stream: a CUDA event recorded after the copies
/// submitted before it.
#[derive(Clone, Debug)]
pub struct CudaCopyEvent {
    event: Arc<Recorded>,
    /// Set when a copy before the event was only partly queued: the event fails.
    failed: Option<Arc<str>>,
}

/// Most idle CUDA events a backend keeps for reuse.
pub const EVENT_POOL_MAX: usize = 1024;

/// The idle CUDA events of a backend.
type EventPool = Mutex<Vec<CudaEvent>>;

/// One recording of a CUDA event, shared by the clones of its [`CudaCopyEvent`] (the
/// controller's transfer and the layer counter hold one each). When the last one goes, the
/// event goes back to its backend's pool: a pipelined load records an event per layer, and
/// creating and destroying each was two driver calls of the five a layer cost.
#[derive(Debug)]
struct Recorded {
    event: ManuallyDrop<CudaEvent>,
    /// The driver reported the event complete without error. A recording completes once,
    /// so later queries and waits need no driver call (the failure check, the acks and the
    /// layer waits each asked the driver before).
    done: AtomicBool,
    pool: Weak<EventPool>,
}

impl Drop for Recorded {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is never used again.
        let event = unsafe { ManuallyDrop::take(&mut self.event) };
        if let Some(pool) = self.pool.upgrade() {
            let mut idle = lock(&pool);
            if idle.len() < EVENT_POOL_MAX {
                idle.push(event);
            }
        }
        // Otherwise (a full pool, or a backend already gone) the event is destroyed here.
    }
}

impl CudaCopyEvent {
    /// The driver's event handle, valid while this event (or a clone) lives: do not destroy
    /// it, and do not use it after the last clone is dropped (the backend records it again).
    pub fn cu_event(&self) -> sys::CUevent {
        self.event.event.cu_event()
    }

    /// Makes `stream` (the engine's compute stream) wait on the device for the copies before
    /// this event, without blocking the CPU. A partly queued copy (see
    /// [`CudaCopyEvent::failed`]) is not visible to the device: check it, or the error of
    /// [`CopyEvent::wait`] at the step boundary, before trusting the bytes.
    ///
    /// # Errors
    /// [`HiCacheError::Transfer`] when the driver refuses the wait.
    pub fn make_stream_wait(&self, stream: &CudaStream) -> Result<()> {
        stream
            .wait(&self.event.event)
            .map_err(|e| transfer("cuStreamWaitEvent", e))
    }

    /// Like [`CudaCopyEvent::make_stream_wait`] for a raw stream handle of the engine.
    ///
    /// # Safety
    /// `stream` must be a live stream of the same context (the device's primary context).
    ///
    /// # Errors
    /// [`HiCacheError::Transfer`] when the driver refuses the wait.
    pub unsafe fn make_raw_stream_wait(&self, stream: sys::CUstream) -> Result<()> {
        self.event
            .event
            .context()
            .bind_to_thread()
            .map_err(|e| transfer("cuCtxSetCurrent", e))?;
        // SAFETY: the caller guarantees the stream; the event lives as long as `self`.
        unsafe {
            result::stream::wait_event(
                stream,
                self.event.event.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| transfer("cuStreamWaitEvent", e))
    }

    /// The failure known when the event was recorded (a copy before it was only partly
    /// queued), if any.
    pub fn failed(&self) -> Option<&str> {
        self.failed.as_deref()
    }
}

impl CopyEvent for CudaCopyEvent {
    fn is_complete(&self) -> bool {
        let r = &self.event;
        if r.done.load(Ordering::Acquire) {
            return true;
        }
        match r.event.try_is_complete() {
            Ok(true) => {
                r.done.store(true, Ordering::Release);
                true
            }
            Ok(false) => false,
            // An error is a completion too (the failure is reported by `wait`).
            Err(_) => true,
        }
    }

    fn wait(&self) -> Result<()> {
        let r = &self.event;
        if !r.done.load(Ordering::Acquire) {
            r.event
                .synchronize()
                .map_err(|e| transfer("cuEventSynchronize", e))?;
            r.done.store(true, Ordering::Release);
        }
        match &self.failed {
            Some(f) => Err(HiCacheError::Transfer(f.to_string())),
            None => Ok(()),
        }
    }
}

/// The device side of an extra pool.
#[derive(Debug)]
struct ExtraPool {
    pool: PoolName,
    slots: u32,
    item_bytes: usize,
    base: u64,
    stride: u64,
    /// Allocated by the backend (freed on drop) or the engine's.
    owned: bool,
}

/// What keeps a registered host buffer alive while the backend may copy into it.
#[derive(Debug)]
#[allow(dead_code)] // held for its drop only
enum Keep {
    Kv(Arc<HostMemory>),
    Slots(Arc<SlotMemory>),
}

#[derive(Debug)]
struct HostBuffer {
    ptr: usize,
    pinned: bool,
    /// The buffer's address in the device's address space (pinned buffers only).
    mapped: Option<u64>,
    _keep: Keep,
}

/// A registered host buffer's start, on the host and (when pinned) as the device sees it.
#[derive(Copy, Clone, Debug)]
struct HostAddr {
    host: u64,
    mapped: Option<u64>,
}

/// The CUDA device backend. See the module docs.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    load: Arc<CudaStream>,
    write: Arc<CudaStream>,
    sync: Arc<CudaStream>,
    geometry: KvGeometry,
    pages: usize,
    regions: Vec<Vec<DeviceRegion>>,
    /// Device allocations of the KV pool made by the backend (freed on drop).
    owned: Vec<u64>,
    extra: RwLock<Vec<ExtraPool>>,
    hosts: Mutex<Vec<HostBuffer>>,
    pin_failures: AtomicU64,
    cfg: CudaConfig,
    /// Per stream (load, write): a copy was only partly queued (or failed by injection)
    /// since the last event.
    failed: [Mutex<Option<String>>; 2],
    /// Per stream: copies still to fail (fault injection).
    faults: [AtomicU32; 2],
    /// The driver has the batched copy call.
    batched: bool,
    /// The gather/scatter kernel, when it compiled.
    kernel: Option<CopyKernel>,
    /// Copies submitted per [`Route`].
    routed: [AtomicU64; 3],
    /// Idle events, recorded again by `record_event`.
    events: Arc<EventPool>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.cfg.ordinal)
            .field("geometry", &self.geometry)
            .field("pages", &self.pages)
            .field("copy_method", &self.cfg.copy_method)
            .field("have", &self.have())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Allocates `bytes` of zeroed device memory in the current context.
fn alloc_zeroed(bytes: usize, what: &'static str) -> Result<u64> {
    // SAFETY: plain allocation in the current context; the memory is zeroed before use.
    let ptr = unsafe { result::malloc_sync(bytes) }.map_err(|e| {
        if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            HiCacheError::AllocFailed { what, bytes }
        } else {
            driver("cuMemAlloc", e)
        }
    })?;
    // SAFETY: `ptr` is a fresh allocation of `bytes` bytes.
    if let Err(e) = unsafe { result::memset_d8_sync(ptr, 0, bytes) } {
        // SAFETY: freed once, nothing uses it.
        let _ = unsafe { result::free_sync(ptr) };
        return Err(driver("cuMemsetD8", e));
    }
    Ok(ptr)
}

impl CudaBackend {
    /// A backend on device `cfg.ordinal` with a zeroed pool of `pages` pages that it
    /// allocates (one allocation per layer).
    ///
    /// # Errors
    /// [`HiCacheError::NoDevice`] without a driver or device; [`HiCacheError::Config`] for zero
    /// or too many pages or an overflowing size; [`HiCacheError::AllocFailed`] when the device
    /// memory is short (nothing stays allocated); [`HiCacheError::Driver`] for other failures.
    pub fn new(geometry: KvGeometry, pages: usize, cfg: CudaConfig) -> Result<Self> {
        check_pages(&geometry, pages)?;
        let streams = open(&cfg)?;
        let layer_bytes = geometry.page_bytes_per_layer() * pages;
        let pbl = geometry.page_bytes_per_layer();
        let mut owned = Vec::with_capacity(geometry.layers);
        let mut regions = Vec::with_capacity(geometry.layers);
        for _ in 0..geometry.layers {
            match alloc_zeroed(layer_bytes, "CUDA device pool layer") {
                Ok(ptr) => {
                    owned.push(ptr);
                    regions.push(vec![DeviceRegion {
                        base: ptr,
                        page_stride: pbl as u64,
                        bytes: pbl,
                    }]);
                }
                Err(e) => {
                    for &p in &owned {
                        // SAFETY: allocated above, used by nothing yet.
                        let _ = unsafe { result::free_sync(p) };
                    }
                    return Err(e);
                }
            }
        }
        Ok(Self::assemble(
            streams, geometry, pages, regions, owned, cfg,
        ))
    }

    /// A backend over KV memory the engine owns: `regions[layer]` lists where each layer's
    /// pages live (one region for a packed layer, e.g. K then V for split buffers; the host
    /// copy of a page holds the regions' bytes back to back in this order).
    ///
    /// # Safety
    /// For the backend's whole life, every region must be device memory of the primary
    /// context of device `cfg.ordinal`, valid from `base` to
    /// `base + (pages - 1) × page_stride + bytes`; the spans of different (layer, page,
    /// region) must not overlap; and the engine must not free or reuse that memory while the
    /// backend exists. The backend reads and writes it on its own streams, ordered with the
    /// engine's kernels only through the events it returns.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] when the regions do not describe `geometry` (a layer count
    /// other than `geometry.layers`, a layer whose region bytes do not add up to
    /// `page_bytes_per_layer`, a stride smaller than its bytes, an address range that
    /// overflows); otherwise as [`CudaBackend::new`].
    pub unsafe fn from_device_regions(
        geometry: KvGeometry,
        pages: usize,
        regions: Vec<Vec<DeviceRegion>>,
        cfg: CudaConfig,
    ) -> Result<Self> {
        check_pages(&geometry, pages)?;
        check_regions(&geometry, pages, &regions)?;
        let streams = open(&cfg)?;
        Ok(Self::assemble(
            streams,
            geometry,
            pages,
            regions,
            Vec::new(),
            cfg,
        ))
    }

    fn assemble(
        Streams {
            ctx,
            load,
            write,
            sync,
            batched,
            kernel,
        }: Streams,
        geometry: KvGeometry,
        pages: usize,
        regions: Vec<Vec<DeviceRegion>>,
        owned: Vec<u64>,
        cfg: CudaConfig,
    ) -> Self {
        CudaBackend {
            ctx,
            load,
            write,
            sync,
            geometry,
            pages,
            regions,
            owned,
            extra: RwLock::new(Vec::new()),
            hosts: Mutex::new(Vec::new()),
            pin_failures: AtomicU64::new(0),
            cfg,
            failed: [Mutex::new(None), Mutex::new(None)],
            faults: [AtomicU32::new(0), AtomicU32::new(0)],
            batched,
            kernel,
            routed: Default::default(),
            events: Arc::default(),
        }
    }

    /// Makes an extra pool's device side the engine's buffer at `base`: slot `s` is
    /// `item_bytes` bytes at `base + s × slot_stride`.
    ///
    /// # Safety
    /// As [`CudaBackend::from_device_regions`]: device memory of the same context, valid for
    /// every slot, not overlapping other pools, kept alive for the backend's life.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] for zero sizes, a stride below `item_bytes`, an overflowing
    /// range or a pool already registered.
    pub unsafe fn wrap_extra_pool(
        &self,
        pool: PoolName,
        base: u64,
        slots: u32,
        item_bytes: usize,
        slot_stride: u64,
    ) -> Result<()> {
        if slots == 0 || item_bytes == 0 || slot_stride < item_bytes as u64 {
            return Err(HiCacheError::Config(format!(
                "extra pool {pool:?}: {slots} slots of {item_bytes} bytes every {slot_stride} bytes"
            )));
        }
        (u64::from(slots) - 1)
            .checked_mul(slot_stride)
            .and_then(|o| o.checked_add(item_bytes as u64))
            .and_then(|o| o.checked_add(base))
            .ok_or_else(|| HiCacheError::Config(format!("extra pool {pool:?} overflows")))?;
        let mut pools = self.extra.write().unwrap_or_else(|e| e.into_inner());
        if pools.iter().any(|p| p.pool == pool) {
            return Err(HiCacheError::Config(format!(
                "extra pool {pool:?} is already registered"
            )));
        }
        pools.push(ExtraPool {
            pool,
            slots,
            item_bytes,
            base,
            stride: slot_stride,
            owned: false,
        });
        Ok(())
    }

    /// Fault injection (tests): the next `n` copies submitted to `stream` (a KV copy or an
    /// extra-pool copy each) fail as a device error would: instead of its bytes, the copy
    /// writes [`POISON_BYTE`] over its destination, in stream order, and
    /// the next event recorded on the stream fails with [`HiCacheError::Transfer`] (the
    /// semantics of [`HostSim::fail_next_copies`](crate::HostSim::fail_next_copies)).
    pub fn fail_next_copies(&self, stream: StreamKind, n: u32) {
        self.faults[stream_index(stream)].fetch_add(n, Ordering::SeqCst);
    }

    /// Whether the next copy on `kind` is to fail (fault injection); takes that fault.
    fn take_fault(&self, kind: StreamKind) -> bool {
        self.faults[stream_index(kind)]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    /// Fails a copy of `spans` by injection: poisons its destination and fails the stream's
    /// next event.
    fn inject_fault(
        &self,
        kind: StreamKind,
        dir: Direction,
        host: HostAddr,
        spans: &[Span],
        what: &str,
    ) -> Result<()> {
        self.poison(kind, dir, host.host, spans)?;
        lock(&self.failed[stream_index(kind)])
            .get_or_insert_with(|| format!("injected fault in {what} copy"));
        Ok(())
    }

    /// Counts one copy submitted by `route`.
    fn count(&self, route: Route) {
        self.routed[route.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Overwrites the destination of `spans` with [`POISON_BYTE`] in `kind`'s stream order:
    /// device spans with a memset, host spans with a host function run by the stream.
    fn poison(&self, kind: StreamKind, dir: Direction, host: u64, spans: &[Span]) -> Result<()> {
        self.bind()?;
        let stream = self.stream(kind).cu_stream();
        match dir {
            Direction::HostToDevice => {
                for s in spans {
                    // SAFETY: a planned span inside the device pool.
                    unsafe { result::memset_d8_async(s.device, POISON_BYTE, s.len, stream) }
                        .map_err(|e| transfer("cuMemsetD8Async", e))?;
                }
                Ok(())
            }
            Direction::DeviceToHost => {
                let targets: Box<Vec<(usize, usize)>> = Box::new(
                    spans
                        .iter()
                        .map(|s| ((host + s.host as u64) as usize, s.len))
                        .collect(),
                );
                let arg = Box::into_raw(targets);
                // SAFETY: the callback takes ownership of `arg` once; the spans lie in a
                // registered host buffer that outlives the stream's work (see `drop`).
                let r = unsafe {
                    result::stream::launch_host_function(stream, fill_poison, arg.cast())
                };
                r.map_err(|e| {
                    // SAFETY: not launched, so still ours.
                    drop(unsafe { Box::from_raw(arg) });
                    transfer("cuLaunchHostFunc", e)
                })
            }
        }
    }

    /// CUDA events kept for reuse: a [`CudaCopyEvent`]'s event comes back here when its last
    /// clone is dropped (at most [`EVENT_POOL_MAX`]), and `record_event` records one of these
    /// again before it creates a new one.
    pub fn idle_events(&self) -> usize {
        lock(&self.events).len()
    }

    /// Copies submitted so far, per route (under [`CopyMethod::Auto`] this shows what the
    /// backend picked).
    pub fn copy_counts(&self) -> CopyCounts {
        let n = |r: Route| self.routed[r.index()].load(Ordering::Relaxed);
        CopyCounts {
            memcpy: n(Route::Memcpy),
            batched: n(Route::Batched),
            kernel: n(Route::Kernel),
        }
    }

    /// Whether this backend can submit copies with `method` here: always for
    /// [`CopyMethod::Auto`] and [`CopyMethod::Memcpy`]; for [`CopyMethod::Batched`] when the
    /// driver has the batched call (CUDA 12.8 and later); for [`CopyMethod::Kernel`] when
    /// the kernel compiled and loaded (only tried under `Auto` and `Kernel`).
    pub fn has_method(&self, method: CopyMethod) -> bool {
        match method {
            CopyMethod::Auto | CopyMethod::Memcpy => true,
            CopyMethod::Batched => self.batched,
            CopyMethod::Kernel => self.kernel.is_some(),
        }
    }

    /// Spans one launch of the copy kernel copies (1,360 where the driver and NVRTC are of
    /// CUDA 12.1 or later, else 160), or `None` without the kernel.
    pub fn kernel_spans_per_launch(&self) -> Option<usize> {
        self.kernel.as_ref().map(|k| k.spans)
    }

    /// The methods besides memcpys this backend has, for [`method::choose`].
    fn have(&self) -> Have {
        Have {
            batched: self.batched,
            kernel: self.kernel.is_some(),
        }
    }

    /// Host buffers the driver refused to page-lock (they are used pageable).
    pub fn pin_failures(&self) -> u64 {
        self.pin_failures.load(Ordering::Relaxed)
    }

    /// Host buffers registered with the backend and how many of them are page-locked.
    pub fn host_buffers(&self) -> (usize, usize) {
        let h = lock(&self.hosts);
        (h.len(), h.iter().filter(|b| b.pinned).count())
    }

    /// The context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream of `kind` (the engine may order its own work after the backend's copies
    /// with events, never by submitting to these streams).
    pub fn stream(&self, kind: StreamKind) -> &Arc<CudaStream> {
        match kind {
            StreamKind::Load => &self.load,
            StreamKind::Write => &self.write,
        }
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| transfer("cuCtxSetCurrent", e))
    }

    /// Registers (page-locks) a host buffer once; returns its start.
    fn host_buffer(
        &self,
        ptr: *mut u8,
        len: usize,
        keep: impl FnOnce() -> Keep,
    ) -> Result<HostAddr> {
        let mut hosts = lock(&self.hosts);
        if let Some(h) = hosts.iter().find(|h| h.ptr == ptr as usize) {
            return Ok(HostAddr {
                host: ptr as u64,
                mapped: h.mapped,
            });
        }
        let mut pinned = false;
        let mut mapped = None;
        if self.cfg.pin_host {
            self.bind()?;
            // SAFETY: `ptr..ptr + len` is one live heap allocation, kept alive by `keep` until
            // it is unregistered in `drop`.
            let r = unsafe {
                sys::cuMemHostRegister_v2(
                    ptr.cast(),
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                )
            };
            match r {
                sys::CUresult::CUDA_SUCCESS => {
                    pinned = true;
                    let mut dev: sys::CUdeviceptr = 0;
                    // SAFETY: `ptr` was registered with the device-map flag just above.
                    match unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr.cast(), 0) } {
                        sys::CUresult::CUDA_SUCCESS => mapped = Some(dev),
                        e => tracing::warn!(
                            error = %describe(DriverError(e)),
                            "a pinned host buffer has no device mapping; the copy kernel will not use it"
                        ),
                    }
                }
                e => {
                    self.pin_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        bytes = len,
                        error = %describe(DriverError(e)),
                        "could not page-lock a host buffer; copies use pageable memory"
                    );
                }
            }
        }
        hosts.push(HostBuffer {
            ptr: ptr as usize,
            pinned,
            mapped,
            _keep: keep(),
        });
        Ok(HostAddr {
            host: ptr as u64,
            mapped,
        })
    }

    fn kv_host(&self, host: &Arc<HostMemory>) -> Result<HostAddr> {
        self.host_buffer(host.dma_ptr(), host.len_bytes(), || Keep::Kv(host.clone()))
    }

    /// Queues `spans` on `kind`'s stream by the route [`CudaConfig::copy_method`] picks. A
    /// failure after part of the copy may have been queued fails the stream's next event.
    fn submit(
        &self,
        kind: StreamKind,
        dir: Direction,
        host: HostAddr,
        spans: &[Span],
    ) -> Result<Route> {
        self.bind()?;
        let route = method::choose(
            self.cfg.copy_method,
            spans,
            self.have(),
            host.mapped.is_some(),
            self.cfg.kernel_max_span,
        );
        let stream = self.stream(kind).cu_stream();
        let r =
            match (route, &self.kernel, host.mapped) {
                (Route::Batched, ..) => self.submit_batched(stream, dir, host.host, spans),
                (Route::Kernel, Some(k), Some(mapped)) => match k.spans {
                    method::KERNEL_SPANS_LARGE => Self::submit_kernel::<
                        { method::KERNEL_SPANS_LARGE },
                    >(
                        k.function(dir), stream, dir, mapped, spans
                    ),
                    _ => Self::submit_kernel::<{ method::KERNEL_SPANS_SMALL }>(
                        k.function(dir),
                        stream,
                        dir,
                        mapped,
                        spans,
                    ),
                },
                _ => Self::submit_memcpys(stream, dir, host.host, spans),
            };
        match r {
            Ok(()) => Ok(route),
            Err((queued_some, err)) => {
                if queued_some {
                    lock(&self.failed[stream_index(kind)]).get_or_insert_with(|| err.to_string());
                }
                Err(err)
            }
        }
    }

    /// One asynchronous memcpy per span. On failure: whether earlier spans were queued.
    fn submit_memcpys(
        stream: sys::CUstream,
        dir: Direction,
        host: u64,
        spans: &[Span],
    ) -> std::result::Result<(), (bool, HiCacheError)> {
        for (i, s) in spans.iter().enumerate() {
            let h = (host + s.host as u64) as *mut u8;
            // SAFETY: the spans were planned from validated runs inside the device regions
            // and the registered host buffer, which outlive the copies (see `drop`).
            let r = unsafe {
                match dir {
                    Direction::HostToDevice => {
                        sys::cuMemcpyHtoDAsync_v2(s.device, h.cast_const().cast(), s.len, stream)
                    }
                    Direction::DeviceToHost => {
                        sys::cuMemcpyDtoHAsync_v2(h.cast(), s.device, s.len, stream)
                    }
                }
            };
            r.result()
                .map_err(|e| (i > 0, transfer("cuMemcpyAsync", e)))?;
        }
        Ok(())
    }

    /// One `cuMemcpyBatchAsync` for all spans (the driver reads the arrays during the call).
    fn submit_batched(
        &self,
        stream: sys::CUstream,
        dir: Direction,
        host: u64,
        spans: &[Span],
    ) -> std::result::Result<(), (bool, HiCacheError)> {
        if spans.is_empty() {
            return Ok(());
        }
        let (mut dsts, mut srcs, mut sizes) = (Vec::new(), Vec::new(), Vec::new());
        method::batch_arrays(dir, host, spans, &mut dsts, &mut srcs, &mut sizes);
        let device = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.cfg.ordinal as i32,
        };
        let on_host = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        };
        let (src_loc, dst_loc) = match dir {
            Direction::HostToDevice => (on_host, device),
            Direction::DeviceToHost => (device, on_host),
        };
        let mut attrs = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: src_loc,
            dstLocHint: dst_loc,
            flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
        };
        let mut attr_at = [0usize];
        let mut fail_at = usize::MAX;
        // SAFETY: the driver has the call (checked when the backend opened); the arrays hold
        // `spans.len()` entries and are read during the call; the addresses are planned spans
        // inside the device regions and the registered host buffer (see `submit_memcpys`).
        let r = unsafe {
            sys::cuMemcpyBatchAsync(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                spans.len(),
                &mut attrs,
                attr_at.as_mut_ptr(),
                1,
                &mut fail_at,
                stream,
            )
        };
        // The driver may have queued the copies before the one that failed: fail the event.
        r.result()
            .map_err(|e| (true, transfer("cuMemcpyBatchAsync", e)))
    }

    /// The gather/scatter kernel built for `N` spans per launch; `mapped` is the host
    /// buffer's device address.
    fn submit_kernel<const N: usize>(
        f: &CudaFunction,
        stream: sys::CUstream,
        dir: Direction,
        mapped: u64,
        spans: &[Span],
    ) -> std::result::Result<(), (bool, HiCacheError)> {
        method::kernel_launches(dir, mapped, spans, |i, l| {
            let mut param: *mut std::ffi::c_void = (&l.batch as *const method::KernelBatch<N>)
                .cast_mut()
                .cast();
            // SAFETY: the function takes one parameter, the `KernelBatch` struct by value,
            // which the driver copies during the call; the spans lie inside the device
            // regions and the registered, mapped host buffer (see `submit_memcpys`).
            let r = unsafe {
                sys::cuLaunchKernel(
                    f.cu_function(),
                    l.columns,
                    l.rows,
                    1,
                    method::KERNEL_THREADS,
                    1,
                    1,
                    0,
                    stream,
                    &mut param,
                    std::ptr::null_mut(),
                )
            };
            r.result()
                .map_err(|e| (i > 0, transfer("cuLaunchKernel", e)))
        })
    }

    fn extra_pool<T>(&self, pool: PoolName, f: impl FnOnce(&ExtraPool) -> Result<T>) -> Result<T> {
        let pools = self.extra.read().unwrap_or_else(|e| e.into_inner());
        let p = pools
            .iter()
            .find(|p| p.pool == pool)
            .ok_or(HiCacheError::UnknownPool(pool))?;
        f(p)
    }

    /// A synchronous copy of one span on the accessor stream.
    fn copy_sync(&self, dir: Direction, device: u64, host: *mut u8, len: usize) -> Result<()> {
        self.bind()?;
        let stream = self.sync.cu_stream();
        // SAFETY: `device..device + len` was checked by the caller; `host` is a live buffer of
        // `len` bytes that the caller holds until the stream is synchronised below.
        let r = unsafe {
            match dir {
                Direction::HostToDevice => {
                    sys::cuMemcpyHtoDAsync_v2(device, host.cast_const().cast(), len, stream)
                }
                Direction::DeviceToHost => {
                    sys::cuMemcpyDtoHAsync_v2(host.cast(), device, len, stream)
                }
            }
        };
        r.result().map_err(|e| transfer("cuMemcpyAsync", e))?;
        self.sync
            .synchronize()
            .map_err(|e| transfer("cuStreamSynchronize", e))
    }

    fn page_check(&self, layer: usize, page: PageId, len: usize) -> Result<()> {
        let g = &self.geometry;
        if layer >= g.layers {
            return Err(HiCacheError::LayerOutOfRange {
                layer,
                layers: g.layers,
            });
        }
        if page.index() >= self.pages {
            return Err(HiCacheError::DevicePageOutOfRange(page));
        }
        if len != g.page_bytes_per_layer() {
            return Err(HiCacheError::BufferSize {
                expected: g.page_bytes_per_layer(),
                got: len,
            });
        }
        Ok(())
    }

    fn slot_check(p: &ExtraPool, slot: u32, len: usize) -> Result<u64> {
        if slot >= p.slots {
            return Err(HiCacheError::HostPageOutOfRange(slot));
        }
        if len != p.item_bytes {
            return Err(HiCacheError::BufferSize {
                expected: p.item_bytes,
                got: len,
            });
        }
        Ok(p.base + u64::from(slot) * p.stride)
    }
}

/// Host function of an injected D2H fault: fills the spans with [`POISON_BYTE`].
unsafe extern "C" fn fill_poison(arg: *mut std::ffi::c_void) {
    // SAFETY: `arg` is the boxed span list `poison` leaked for this one call.
    let targets = unsafe { Box::from_raw(arg.cast::<Vec<(usize, usize)>>()) };
    for (ptr, len) in targets.iter() {
        // SAFETY: each span lies in a live registered host buffer (see `poison`).
        unsafe { std::ptr::write_bytes(*ptr as *mut u8, POISON_BYTE, *len) };
    }
}

fn stream_index(kind: StreamKind) -> usize {
    match kind {
        StreamKind::Load => 0,
        StreamKind::Write => 1,
    }
}

fn check_pages(geometry: &KvGeometry, pages: usize) -> Result<()> {
    geometry.validate()?;
    if pages == 0 || pages > u32::MAX as usize {
        return Err(HiCacheError::Config(format!(
            "device pool of {pages} pages must be in 1..=u32::MAX"
        )));
    }
    geometry.pool_bytes(pages)?;
    Ok(())
}

pub(crate) fn check_regions(
    g: &KvGeometry,
    pages: usize,
    regions: &[Vec<DeviceRegion>],
) -> Result<()> {
    let bad = |why: String| Err(HiCacheError::Config(format!("device regions: {why}")));
    if regions.len() != g.layers {
        return bad(format!("{} layers for {}", regions.len(), g.layers));
    }
    for (l, layer) in regions.iter().enumerate() {
        let total: usize = layer.iter().map(|r| r.bytes).sum();
        if layer.is_empty() || total != g.page_bytes_per_layer() {
            return bad(format!(
                "layer {l} has {total} bytes per page, the geometry {}",
                g.page_bytes_per_layer()
            ));
        }
        for r in layer {
            let end = (pages as u64 - 1)
                .checked_mul(r.page_stride)
                .and_then(|o| o.checked_add(r.bytes as u64))
                .and_then(|o| o.checked_add(r.base));
            if r.bytes == 0 || r.page_stride < r.bytes as u64 || end.is_none() {
                return bad(format!(
                    "layer {l}: region {r:?} is empty, overlaps itself or overflows"
                ));
            }
        }
    }
    Ok(())
}

/// The context and the three streams a backend runs on, and the copy methods it has.
struct Streams {
    ctx: Arc<CudaContext>,
    load: Arc<CudaStream>,
    write: Arc<CudaStream>,
    sync: Arc<CudaStream>,
    batched: bool,
    kernel: Option<CopyKernel>,
}

/// The loaded copy kernel and the spans its parameter block holds.
struct CopyKernel {
    /// Host → device and device → host ([`method::KERNEL_NAMES`]).
    functions: [CudaFunction; 2],
    spans: usize,
}

impl CopyKernel {
    fn function(&self, dir: Direction) -> &CudaFunction {
        match dir {
            Direction::HostToDevice => &self.functions[0],
            Direction::DeviceToHost => &self.functions[1],
        }
    }
}

/// The first driver version with `cuMemcpyBatchAsync` (CUDA 12.8).
const BATCHED_MIN_DRIVER: i32 = 12080;

/// Finds the driver and the device, creates the context and the three streams, and sets up
/// the copy methods `cfg` may use.
fn open(cfg: &CudaConfig) -> Result<Streams> {
    let info = probe()?;
    if cfg.ordinal >= info.devices {
        return Err(HiCacheError::NoDevice(format!(
            "device {} asked for, the driver sees {}",
            cfg.ordinal, info.devices
        )));
    }
    let ctx = CudaContext::new(cfg.ordinal).map_err(|e| driver("cuDevicePrimaryCtxRetain", e))?;
    let stream = || ctx.new_stream().map_err(|e| driver("cuStreamCreate", e));
    let (load, write, sync) = (stream()?, stream()?, stream()?);
    let unavailable = |method: CopyMethod, why: String| HiCacheError::CopyMethodUnavailable {
        method: method.name(),
        why,
    };
    let batched = batched_call(info.driver_version);
    if cfg.copy_method == CopyMethod::Batched
        && let Err(why) = &batched
    {
        return Err(unavailable(CopyMethod::Batched, why.clone()));
    }
    if cfg.copy_method == CopyMethod::Kernel && !cfg.pin_host {
        return Err(unavailable(
            CopyMethod::Kernel,
            "the kernel reads pinned host buffers, and pin_host is false".into(),
        ));
    }
    let kernel = match cfg.copy_method {
        CopyMethod::Auto | CopyMethod::Kernel => copy_kernel(&ctx, info.driver_version),
        _ => Err("not asked for".into()),
    };
    if cfg.copy_method == CopyMethod::Kernel
        && let Err(why) = &kernel
    {
        return Err(unavailable(CopyMethod::Kernel, why.clone()));
    }
    if cfg.copy_method == CopyMethod::Auto
        && let Err(why) = &kernel
    {
        tracing::info!(%why, "the CUDA copy kernel is not available; short-span copies use the batched call or memcpys");
    }
    Ok(Streams {
        ctx,
        load,
        write,
        sync,
        batched: batched.is_ok(),
        kernel: kernel.ok(),
    })
}

/// Whether the driver has `cuMemcpyBatchAsync`: its version says CUDA 12.8 or later and the
/// library exports the call (cudarc would panic on a missing one).
fn batched_call(driver_version: i32) -> std::result::Result<(), String> {
    if driver_version < BATCHED_MIN_DRIVER {
        return Err(format!(
            "the driver supports CUDA {}.{}; the batched call needs 12.8",
            driver_version / 1000,
            driver_version % 1000 / 10
        ));
    }
    // SAFETY: the library is loaded (the probe found it); looking a symbol up calls nothing.
    let found = unsafe {
        sys::culib()
            .get::<*const std::ffi::c_void>(b"cuMemcpyBatchAsync")
            .is_ok()
    };
    if found {
        Ok(())
    } else {
        Err("the driver library does not export cuMemcpyBatchAsync".into())
    }
}

/// Compiles the gather/scatter kernel with NVRTC for the device of `ctx` and loads it: the
/// large one where the driver takes its parameter block (CUDA 12.1 and later) and NVRTC
/// compiles it, else the small one.
fn copy_kernel(
    ctx: &Arc<CudaContext>,
    driver_version: i32,
) -> std::result::Result<CopyKernel, String> {
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| format!("could not read the compute capability: {}", describe(e)))?;
    let cc = (major * 10 + minor).max(0) as u32;
    let load = |spans: usize| -> std::result::Result<CopyKernel, String> {
        let (ptx, _) = compile_copy_kernel(cc, spans)?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| format!("could not load the copy kernel: {}", describe(e)))?;
        let function = |dir: Direction| {
            let name = method::kernel_name(dir);
            module
                .load_function(name)
                .map_err(|e| format!("the copy kernel has no entry point {name}: {}", describe(e)))
        };
        Ok(CopyKernel {
            functions: [
                function(Direction::HostToDevice)?,
                function(Direction::DeviceToHost)?,
            ],
            spans,
        })
    };
    if driver_version >= method::KERNEL_LARGE_MIN_DRIVER {
        match load(method::KERNEL_SPANS_LARGE) {
            Ok(k) => return Ok(k),
            Err(why) => {
                tracing::info!(%why, "the large copy kernel is not available; using the small one")
            }
        }
    }
    load(method::KERNEL_SPANS_SMALL)
}

/// Compiles the gather/scatter kernel for `spans` spans per launch to PTX with NVRTC (no GPU
/// needed) for the oldest architecture of [`method::KERNEL_ARCHES`] that a device of compute
/// capability `device_cc` (major × 10 + minor) runs and this NVRTC accepts; returns the PTX
/// and that architecture.
pub(crate) fn compile_copy_kernel(
    device_cc: u32,
    spans: usize,
) -> std::result::Result<(cudarc::nvrtc::Ptx, &'static str), String> {
    use cudarc::nvrtc;
    // SAFETY: loads and unloads the NVRTC library by its usual names; calls none of it.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        return Err("NVRTC (libnvrtc) is not installed or not on the library path".into());
    }
    let source = method::kernel_source(spans);
    let mut refusals = Vec::new();
    for &(arch, cc) in method::KERNEL_ARCHES.iter().filter(|a| a.1 <= device_cc) {
        // cudarc panics when an NVRTC function is missing from the library: keep that from
        // unwinding into the caller.
        let compiled = std::panic::catch_unwind(|| {
            nvrtc::compile_ptx_with_opts(
                &source,
                nvrtc::CompileOptions {
                    name: Some("radixkv_copy_spans.cu".into()),
                    arch: Some(arch),
                    ..Default::default()
                },
            )
        })
        .map_err(|_| "the NVRTC library lacks a function cudarc calls".to_string())?;
        match compiled {
            Ok(ptx) => return Ok((ptx, arch)),
            Err(e) => refusals.push(format!("{arch} (compute capability {cc}): {e}")),
        }
    }
    if refusals.is_empty() {
        return Err(format!(
            "the device (compute capability {device_cc}) is older than the kernel's oldest architecture"
        ));
    }
    Err(format!(
        "NVRTC could not compile the copy kernel for {}",
        refusals.join("; ")
    ))
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Everything queued must finish before its memory goes.
        let _ = self.ctx.bind_to_thread();
        for s in [&self.load, &self.write, &self.sync] {
            let _ = s.synchronize();
        }
        for h in lock(&self.hosts).drain(..) {
            if h.pinned {
                // SAFETY: registered by `host_buffer`, still alive (held by `h`).
                let _ = unsafe { sys::cuMemHostUnregister(h.ptr as *mut _) };
            }
        }
        let pools = std::mem::take(&mut *self.extra.write().unwrap_or_else(|e| e.into_inner()));
        for p in pools.iter().filter(|p| p.owned) {
            // SAFETY: allocated by `register_extra_pool`; no copy is queued any more.
            let _ = unsafe { result::free_sync(p.base) };
        }
        for &p in &self.owned {
            // SAFETY: allocated by `new`; no copy is queued any more.
            let _ = unsafe { result::free_sync(p) };
        }
    }
}

impl DeviceBackend for CudaBackend {
    type Event = CudaCopyEvent;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    fn device_pages(&self) -> usize {
        self.pages
    }

    fn register_host(&self, host: &Arc<HostMemory>) -> Result<()> {
        if host.geometry() != self.geometry {
            return Err(HiCacheError::Config(
                "host pool geometry differs from the device's".into(),
            ));
        }
        self.kv_host(host).map(|_| ())
    }

    fn enqueue_copy(&self, stream: StreamKind, copy: PageCopy) -> Result<()> {
        validate_copy(&self.geometry, self.pages, &copy)?;
        let host = self.kv_host(&copy.host)?;
        let mut spans = Vec::new();
        if self.take_fault(stream) {
            plan::page_copy_spans(&self.geometry, &self.regions, &copy, &mut spans);
            let what = match copy.direction {
                Direction::DeviceToHost => "DeviceToHost",
                Direction::HostToDevice => "HostToDevice",
            };
            return self.inject_fault(stream, copy.direction, host, &spans, what);
        }
        // Planned and submitted layer by layer, so that the device starts on the first layer
        // while the next ones are planned (a backup of every layer of 8,192 single pages is
        // 65,536 spans). Counted once, as the first layer's route.
        let mut route = None;
        for layer in copy.layers.clone() {
            plan::page_copy_layer_spans(&self.geometry, &self.regions, &copy, layer, &mut spans);
            match self.submit(stream, copy.direction, host, &spans) {
                Ok(r) => {
                    route.get_or_insert(r);
                }
                Err(e) => {
                    if route.is_some() {
                        // Earlier layers are queued: the stream's next event fails.
                        lock(&self.failed[stream_index(stream)])
                            .get_or_insert_with(|| e.to_string());
                    }
                    return Err(e);
                }
            }
        }
        if let Some(r) = route {
            self.count(r);
        }
        Ok(())
    }

    fn record_event(&self, stream: StreamKind) -> Result<CudaCopyEvent> {
        self.bind()?;
        let idle = lock(&self.events).pop();
        let event = match idle {
            Some(e) => e,
            None => self
                .ctx
                .new_event(None)
                .map_err(|e| transfer("cuEventCreate", e))?,
        };
        // A refused recording drops the event (destroyed, not pooled).
        event
            .record(self.stream(stream))
            .map_err(|e| transfer("cuEventRecord", e))?;
        let failed = lock(&self.failed[stream_index(stream)]).take();
        Ok(CudaCopyEvent {
            event: Arc::new(Recorded {
                event: ManuallyDrop::new(event),
                done: AtomicBool::new(false),
                pool: Arc::downgrade(&self.events),
            }),
            failed: failed.map(Arc::from),
        })
    }

    fn register_extra_pool(&self, pool: PoolName, slots: u32, item_bytes: usize) -> Result<()> {
        let mut pools = self.extra.write().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pools.iter().find(|p| p.pool == pool) {
            return crate::backend::same_extra_pool(
                pool,
                (p.slots as usize, p.item_bytes),
                (slots, item_bytes),
            );
        }
        let bytes = crate::backend::extra_pool_bytes(pool, slots, item_bytes)?;
        self.bind()?;
        let base = alloc_zeroed(bytes, "CUDA extra pool")?;
        pools.push(ExtraPool {
            pool,
            slots,
            item_bytes,
            base,
            stride: item_bytes as u64,
            owned: true,
        });
        Ok(())
    }

    fn enqueue_slot_copy(&self, stream: StreamKind, copy: SlotCopy) -> Result<()> {
        let mut spans = Vec::new();
        self.extra_pool(copy.pool, |p| {
            if copy.host.item_bytes() != p.item_bytes || copy.host.pool() != copy.pool {
                return Err(HiCacheError::Config(format!(
                    "host buffer does not match extra pool {:?}",
                    copy.pool
                )));
            }
            for r in copy.runs.iter() {
                let end = r.device as usize + r.pages as usize;
                if r.pages == 0 || end > p.slots as usize {
                    return Err(HiCacheError::HostPageOutOfRange(
                        end.saturating_sub(1) as u32
                    ));
                }
            }
            copy.host.check_runs(&copy.runs, false)?;
            plan::slot_copy_spans(p.base, p.stride, p.item_bytes, &copy.runs, &mut spans);
            Ok(())
        })?;
        let host = self.host_buffer(copy.host.dma_ptr(), copy.host.len_bytes(), || {
            Keep::Slots(copy.host.clone())
        })?;
        let what = format!("{:?}", copy.pool);
        if self.take_fault(stream) {
            return self.inject_fault(stream, copy.direction, host, &spans, &what);
        }
        let route = self.submit(stream, copy.direction, host, &spans)?;
        self.count(route);
        Ok(())
    }

    fn read_extra_slot(&self, pool: PoolName, slot: u32, out: &mut [u8]) -> Result<()> {
        let at = self.extra_pool(pool, |p| Self::slot_check(p, slot, out.len()))?;
        self.copy_sync(Direction::DeviceToHost, at, out.as_mut_ptr(), out.len())
    }

    fn write_extra_slot(&self, pool: PoolName, slot: u32, data: &[u8]) -> Result<()> {
        let at = self.extra_pool(pool, |p| Self::slot_check(p, slot, data.len()))?;
        // The driver only reads `data` for a host-to-device copy.
        self.copy_sync(
            Direction::HostToDevice,
            at,
            data.as_ptr().cast_mut(),
            data.len(),
        )
    }

    fn read_device_page(&self, layer: usize, page: PageId, out: &mut [u8]) -> Result<()> {
        self.page_check(layer, page, out.len())?;
        let mut o = 0;
        for r in &self.regions[layer] {
            let at = r.base + page.index() as u64 * r.page_stride;
            self.copy_sync(Direction::DeviceToHost, at, out[o..].as_mut_ptr(), r.bytes)?;
            o += r.bytes;
        }
        Ok(())
    }

    fn write_device_page(&self, layer: usize, page: PageId, data: &[u8]) -> Result<()> {
        self.page_check(layer, page, data.len())?;
        let mut o = 0;
        for r in &self.regions[layer] {
            let at = r.base + page.index() as u64 * r.page_stride;
            // The driver only reads `data` for a host-to-device copy.
            self.copy_sync(
                Direction::HostToDevice,
                at,
                data[o..].as_ptr().cast_mut(),
                r.bytes,
            )?;
            o += r.bytes;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's source compiles (NVRTC runs on the CPU: no GPU needed). CI installs NVRTC
    /// for this; elsewhere the test says that it skipped.
    #[test]
    fn the_copy_kernel_compiles_with_nvrtc() {
        // SAFETY: only loads and unloads the library.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            assert!(
                std::env::var_os("RADIXKV_REQUIRE_NVRTC").is_none(),
                "RADIXKV_REQUIRE_NVRTC is set but libnvrtc is not on the library path"
            );
            eprintln!("NVRTC KERNEL COMPILE CHECK SKIPPED: libnvrtc is not on the library path");
            return;
        }
        check_kernel_ptx(
            method::KERNEL_SPANS_SMALL,
            std::mem::size_of::<method::KernelBatch<{ method::KERNEL_SPANS_SMALL }>>(),
        );
        check_kernel_ptx(
            method::KERNEL_SPANS_LARGE,
            std::mem::size_of::<method::KernelBatch<{ method::KERNEL_SPANS_LARGE }>>(),
        );
    }

    /// Compiles the kernel for `spans` spans and checks its PTX (its parameter is `size`
    /// bytes); assembles it with `RADIXKV_PTXAS` when that is set.
    fn check_kernel_ptx(spans: usize, size: usize) {
        let (ptx, arch) = compile_copy_kernel(u32::MAX, spans).unwrap();
        let ptx = ptx.to_src();
        for name in method::KERNEL_NAMES {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "no entry point {name} in:\n{ptx}"
            );
        }
        // The oldest architecture this NVRTC accepts (compute_70 up to CUDA 12, compute_75
        // from CUDA 13), and the PTX targets it.
        assert!(arch == "compute_70" || arch == "compute_75", "{arch}");
        let target = arch.replace("compute_", ".target sm_");
        assert!(ptx.contains(&target), "no `{target}` in:\n{ptx}");
        // One parameter of exactly the Rust struct's size.
        assert!(
            ptx.contains(&format!("[{size}]")),
            "the kernel's parameter is not {size} bytes:\n{ptx}"
        );
        eprintln!(
            "NVRTC compiled the copy kernel for {spans} spans for {arch} ({} bytes of PTX)",
            ptx.len()
        );
        if std::env::var_os("RADIXKV_PRINT_PTX").is_some() {
            eprintln!("{ptx}");
        }
        // With NVIDIA's PTX assembler at hand (`RADIXKV_PTXAS`), the PTX must also assemble
        // for the oldest architecture, Ampere and Hopper without spilling to local memory.
        let Some(ptxas) = std::env::var_os("RADIXKV_PTXAS") else {
            eprintln!("RADIXKV_PTXAS is not set: the PTX was not assembled for a device");
            return;
        };
        let file =
            std::env::temp_dir().join(format!("radixkv-copy-{}-{spans}.ptx", std::process::id()));
        std::fs::write(&file, &ptx).unwrap();
        let oldest = arch.replace("compute_", "sm_");
        for arch in [oldest.as_str(), "sm_80", "sm_90"] {
            let out = std::process::Command::new(&ptxas)
                .arg(format!("-arch={arch}"))
                .arg("-v")
                .arg(&file)
                .arg("-o")
                .arg(file.with_extension(format!("{arch}.cubin")))
                .output()
                .unwrap();
            let log = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "ptxas {arch} failed:\n{log}");
            // Each entry point's report: no stack frame, no spills.
            let frames: Vec<&str> = log.lines().filter(|l| l.contains("stack frame")).collect();
            assert_eq!(frames.len(), method::KERNEL_NAMES.len(), "{log}");
            assert!(
                frames.iter().all(|l| l
                    .contains("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")),
                "the kernel uses local memory on {arch}:\n{log}"
            );
            eprintln!(
                "ptxas {arch}, {spans} spans: {}",
                log.lines().find(|l| l.contains("registers")).unwrap_or("")
            );
            let _ = std::fs::remove_file(file.with_extension(format!("{arch}.cubin")));
        }
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn a_missing_driver_library_is_a_typed_error_not_a_panic() {
        let e = probe_with(|| false).unwrap_err();
        assert!(matches!(e, HiCacheError::NoDevice(_)), "{e:?}");
    }

    #[test]
    fn regions_that_do_not_describe_the_geometry_are_refused() {
        let g = KvGeometry::new(2, 4, 8).unwrap();
        let ok = |base| DeviceRegion {
            base,
            page_stride: 32,
            bytes: 32,
        };
        assert!(check_regions(&g, 10, &[vec![ok(0)], vec![ok(4096)]]).is_ok());
        // One layer missing.
        assert!(check_regions(&g, 10, &[vec![ok(0)]]).is_err());
        // K and V halves that add up, and halves that do not.
        let half = |base, bytes| DeviceRegion {
            base,
            page_stride: 64,
            bytes,
        };
        let kv = vec![half(0, 16), half(8192, 16)];
        assert!(check_regions(&g, 10, &[kv.clone(), kv.clone()]).is_ok());
        assert!(check_regions(&g, 10, &[kv.clone(), vec![half(0, 16)]]).is_err());
        // A stride below the bytes, an empty layer, an address range that overflows.
        let tight = DeviceRegion {
            base: 0,
            page_stride: 16,
            bytes: 32,
        };
        assert!(check_regions(&g, 10, &[vec![ok(0)], vec![tight]]).is_err());
        assert!(check_regions(&g, 10, &[vec![ok(0)], vec![]]).is_err());
        assert!(check_regions(&g, 10, &[vec![ok(0)], vec![ok(u64::MAX - 64)]]).is_err());
    }
}
