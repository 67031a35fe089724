//! [`HostSim`]: a [`DeviceBackend`] whose "device" pool is ordinary memory and whose streams
//! are worker threads, with the asynchronous semantics of a GPU.
//!
//! Each stream is one thread that executes submitted copies strictly in submission order; an
//! event recorded on a stream completes when the worker reaches it, i.e. after every copy
//! submitted before it. Tests can slow copies down ([`HostSimConfig::per_copy_delay`]) or hold
//! them until released ([`CopyGate`]) to observe overlap deterministically.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use radixkv_radix::PageId;

use crate::backend::{
    CopyEvent, DeviceBackend, Direction, HostMemory, PageCopy, SlotCopy, SlotMemory, StreamKind,
    validate_copy,
};
use crate::controller::PoolName;
use crate::error::{HiCacheError, Result};
use crate::geometry::KvGeometry;

/// Options of a [`HostSim`].
#[derive(Clone, Debug, Default)]
pub struct HostSimConfig {
    /// Sleep before executing each submitted copy (a per-layer copy of a pipelined load is one
    /// copy), to make overlap observable.
    pub per_copy_delay: Duration,
    /// Hold every copy until a permit is released through [`HostSim::gate`].
    pub gated: bool,
}

/// Permits that let held copies run one at a time (see [`HostSimConfig::gated`]).
#[derive(Clone, Debug)]
pub struct CopyGate(Arc<(Mutex<GateState>, Condvar)>);

#[derive(Debug)]
struct GateState {
    permits: u64,
    open: bool,
}

impl CopyGate {
    fn new() -> Self {
        CopyGate(Arc::new((
            Mutex::new(GateState {
                permits: 0,
                open: false,
            }),
            Condvar::new(),
        )))
    }

    /// Lets `n` more copies run.
    pub fn release(&self, n: u64) {
        let (m, cv) = &*self.0;
        m.lock().unwrap_or_else(|e| e.into_inner()).permits += n;
        cv.notify_all();
    }

    /// Lets every copy run from now on.
    pub fn open(&self) {
        let (m, cv) = &*self.0;
        m.lock().unwrap_or_else(|e| e.into_inner()).open = true;
        cv.notify_all();
    }

    fn acquire(&self) {
        let (m, cv) = &*self.0;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        while !g.open && g.permits == 0 {
            g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if !g.open {
            g.permits -= 1;
        }
    }
}

/// `None` until the stream reaches the event, then the outcome of the copies before it.
type EventSlot = Mutex<Option<Result<(), String>>>;

/// Completion event of a [`HostSim`] stream.
#[derive(Clone, Debug)]
pub struct SimEvent(Arc<(EventSlot, Condvar)>);

impl SimEvent {
    fn new() -> Self {
        SimEvent(Arc::new((Mutex::new(None), Condvar::new())))
    }

    fn complete(&self, r: Result<(), String>) {
        let (m, cv) = &*self.0;
        *m.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        cv.notify_all();
    }
}

impl CopyEvent for SimEvent {
    fn is_complete(&self) -> bool {
        self.0.0.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn wait(&self) -> Result<()> {
        let (m, cv) = &*self.0;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match &*g {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) => return Err(HiCacheError::Transfer(e.clone())),
                None => g = cv.wait(g).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }
}

enum Cmd {
    Copy(PageCopy),
    Slots(SlotCopy, Arc<SlotMemory>),
    Record(SimEvent),
}

/// Byte a failed copy leaves in its destination: a failed transfer is garbage, never stale
/// but plausible bytes, so a test that consumes it cannot pass by accident.
pub const POISON_BYTE: u8 = 0xA5;

/// The simulated device memory: one lock per layer, so a consumer reading layer `i` never
/// waits for the copy of layer `i + 1`.
#[derive(Debug)]
struct DeviceMem {
    geometry: KvGeometry,
    pages: usize,
    layers: Vec<RwLock<Box<[u8]>>>,
}

impl DeviceMem {
    /// Executes `c`; with `poison` the destination is overwritten with [`POISON_BYTE`] instead.
    fn execute(&self, c: &PageCopy, poison: bool) {
        let g = &self.geometry;
        let pbl = g.page_bytes_per_layer();
        let layout = c.host.layout();
        let host_pages = c.host.pages();
        // Consecutive pages of one layer are adjacent in the host buffer for a layer-first
        // layout, and for a page-first one with a single layer: then a run is one memcpy.
        let contiguous = layout.pages_contiguous_per_layer() || g.layers == 1;
        for layer in c.layers.clone() {
            let dev_lock = &self.layers[layer];
            // Lock order is always device layer(s), then host buffer.
            match c.direction {
                Direction::DeviceToHost => {
                    let dev = dev_lock.read().unwrap_or_else(|e| e.into_inner());
                    let mut host = c.host.write();
                    for r in c.runs.iter() {
                        copy_run(
                            contiguous,
                            r.pages as usize,
                            pbl,
                            |i| r.device as usize * pbl + i * pbl,
                            |i| layout.offset(g, host_pages, layer, r.host as usize + i),
                            &dev,
                            &mut host,
                            poison,
                        );
                    }
                }
                Direction::HostToDevice => {
                    let mut dev = dev_lock.write().unwrap_or_else(|e| e.into_inner());
                    let host = c.host.read();
                    for r in c.runs.iter() {
                        copy_run(
                            contiguous,
                            r.pages as usize,
                            pbl,
                            |i| layout.offset(g, host_pages, layer, r.host as usize + i),
                            |i| r.device as usize * pbl + i * pbl,
                            &host,
                            &mut dev,
                            poison,
                        );
                    }
                }
            }
        }
    }
}

/// Executes an extra-pool copy: one contiguous span per run on both sides.
fn execute_slots(c: &SlotCopy, dev: &SlotMemory, poison: bool) {
    let item = dev.item_bytes();
    let spans = |from: &[u8], to: &mut [u8], src_dev: bool| {
        for r in c.runs.iter() {
            let (s, d) = if src_dev {
                (r.device, r.host)
            } else {
                (r.host, r.device)
            };
            let len = r.pages as usize * item;
            copy_run(
                true,
                1,
                len,
                |_| s as usize * item,
                |_| d as usize * item,
                from,
                to,
                poison,
            );
        }
    };
    // Lock order is always device, then host.
    match c.direction {
        Direction::DeviceToHost => {
            let src = dev.read();
            spans(&src, &mut c.host.write(), true);
        }
        Direction::HostToDevice => {
            let mut dst = dev.write();
            spans(&c.host.read(), &mut dst, false);
        }
    }
}

/// Copies a run of `n` pages of `pbl` bytes: one `memcpy` when both sides are contiguous,
/// else one per page. With `poison` the destination is filled with [`POISON_BYTE`].
#[inline]
#[allow(clippy::too_many_arguments)]
fn copy_run(
    contiguous: bool,
    n: usize,
    pbl: usize,
    src_at: impl Fn(usize) -> usize,
    dst_at: impl Fn(usize) -> usize,
    src: &[u8],
    dst: &mut [u8],
    poison: bool,
) {
    let (chunks, len) = if contiguous { (1, n * pbl) } else { (n, pbl) };
    for i in 0..chunks {
        let (s, d) = (src_at(i), dst_at(i));
        let out = &mut dst[d..d + len];
        if poison {
            out.fill(POISON_BYTE);
        } else {
            out.copy_from_slice(&src[s..s + len]);
        }
    }
}

struct Stream {
    /// Copies still to fail (fault injection).
    faults: Arc<AtomicU32>,
    tx: Mutex<Option<Sender<Cmd>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

/// The host-memory device backend. See the module docs.
pub struct HostSim {
    mem: Arc<DeviceMem>,
    load: Stream,
    write: Stream,
    gate: Option<CopyGate>,
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
    /// [`HiCacheError::Config`] for zero pages or a size that overflows or cannot be
    /// allocated; thread spawn failure.
    pub fn new(geometry: KvGeometry, pages: usize, cfg: HostSimConfig) -> Result<Self> {
        geometry.validate()?;
        if pages == 0 || pages > u32::MAX as usize {
            return Err(HiCacheError::Config(format!(
                "device pool of {pages} pages must be in 1..=u32::MAX"
            )));
        }
        let layer_bytes = geometry.page_bytes_per_layer() * pages;
        geometry.pool_bytes(pages)?;
        let mem = Arc::new(DeviceMem {
            geometry,
            pages,
            layers: (0..geometry.layers)
                .map(|_| {
                    crate::host_pool::zeroed_bytes(layer_bytes, "the simulated device pool")
                        .map(RwLock::new)
                })
                .collect::<Result<_>>()?,
        });
        let gate = cfg.gated.then(CopyGate::new);
        let spawn = |name: &str| -> Result<Stream> {
            let (tx, rx) = channel();
            let mem = mem.clone();
            let gate = gate.clone();
            let delay = cfg.per_copy_delay;
            let faults = Arc::new(AtomicU32::new(0));
            let f = faults.clone();
            let worker = std::thread::Builder::new()
                .name(format!("hostsim-{name}"))
                .spawn(move || worker(rx, mem, gate, delay, f))
                .map_err(|e| HiCacheError::Transfer(format!("spawning a stream: {e}")))?;
            Ok(Stream {
                faults,
                tx: Mutex::new(Some(tx)),
                worker: Mutex::new(Some(worker)),
            })
        };
        Ok(HostSim {
            load: spawn("load")?,
            write: spawn("write")?,
            mem,
            gate,
            extra: RwLock::new(Vec::new()),
        })
    }

    /// Fault injection: the next `n` copies executed on `stream` fail. A failed copy fills its
    /// destination with [`POISON_BYTE`] and fails the next event recorded on the stream (the
    /// event of a pipelined load's layer, or of a whole backup), as a device error would.
    pub fn fail_next_copies(&self, stream: StreamKind, n: u32) {
        self.stream(stream).faults.fetch_add(n, Ordering::SeqCst);
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

    fn send(&self, s: StreamKind, cmd: Cmd) -> Result<()> {
        let tx = self.stream(s).tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.as_ref()
            .and_then(|tx| tx.send(cmd).ok())
            .ok_or_else(|| HiCacheError::Transfer(format!("{s:?} stream is gone")))
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

fn worker(
    rx: Receiver<Cmd>,
    mem: Arc<DeviceMem>,
    gate: Option<CopyGate>,
    delay: Duration,
    faults: Arc<AtomicU32>,
) {
    // The first failure since the last event; the next event reports it (sticky until then,
    // like a CUDA stream error).
    let mut failed: Option<String> = None;
    let take_fault = || {
        faults
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    };
    for cmd in rx {
        match cmd {
            Cmd::Copy(c) => {
                if let Some(g) = &gate {
                    g.acquire();
                }
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                let _span = tracing::trace_span!("hostsim_copy", layers = ?c.layers).entered();
                let poison = take_fault();
                mem.execute(&c, poison);
                if poison {
                    failed
                        .get_or_insert_with(|| format!("injected fault in {:?} copy", c.direction));
                }
            }
            Cmd::Slots(c, dev) => {
                let poison = take_fault();
                execute_slots(&c, &dev, poison);
                if poison {
                    failed.get_or_insert_with(|| format!("injected fault in {:?} copy", c.pool));
                }
            }
            Cmd::Record(ev) => ev.complete(failed.take().map_or(Ok(()), Err)),
        }
    }
}

impl Drop for HostSim {
    fn drop(&mut self) {
        if let Some(g) = &self.gate {
            g.open();
        }
        for s in [&self.load, &self.write] {
            // Closing the channel ends the worker after it drains what was submitted.
            s.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(h) = s.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
                let _ = h.join();
            }
        }
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
        self.send(stream, Cmd::Copy(copy))
    }

    fn record_event(&self, stream: StreamKind) -> Result<SimEvent> {
        let ev = SimEvent::new();
        self.send(stream, Cmd::Record(ev.clone()))?;
        Ok(ev)
    }

    fn register_extra_pool(&self, pool: PoolName, slots: u32, item_bytes: usize) -> Result<()> {
        let mut pools = self.extra.write().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = pools.iter().find(|m| m.pool() == pool) {
            return if m.slots() == slots as usize && m.item_bytes() == item_bytes {
                Ok(())
            } else {
                Err(HiCacheError::Config(format!(
                    "extra pool {pool:?} is registered with other sizes"
                )))
            };
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
        self.send(stream, Cmd::Slots(copy, dev))
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
