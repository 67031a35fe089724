//! The simulated device memory of [`HostSim`](super::HostSim) and the copies its stream
//! workers execute.

use std::sync::RwLock;

use crate::backend::{Direction, PageCopy, SlotCopy, SlotMemory};
use crate::error::{HiCacheError, Result};
use crate::geometry::KvGeometry;

/// Byte a failed copy leaves in its destination: a failed transfer is garbage, never stale
/// but plausible bytes, so a test that consumes it cannot pass by accident.
pub const POISON_BYTE: u8 = 0xA5;

/// The simulated device memory: one lock per layer, so a consumer reading layer `i` never
/// waits for the copy of layer `i + 1`.
#[derive(Debug)]
pub(super) struct DeviceMem {
    pub(super) geometry: KvGeometry,
    pub(super) pages: usize,
    pub(super) layers: Vec<RwLock<Box<[u8]>>>,
}

impl DeviceMem {
    /// A zeroed pool of `pages` pages per layer.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] when the size overflows, [`HiCacheError::AllocFailed`] when
    /// the memory cannot be had; nothing is kept allocated then.
    pub(super) fn new(geometry: KvGeometry, pages: usize) -> Result<Self> {
        geometry.validate()?;
        // The whole pool first: it bounds every per-layer product below.
        geometry.pool_bytes(pages)?;
        let layer_bytes = geometry
            .page_bytes_per_layer()
            .checked_mul(pages)
            .ok_or_else(|| HiCacheError::Config(format!("a pool of {pages} pages overflows")))?;
        let what = "device pool layer table";
        let mut layers = radixkv_radix::try_with_capacity(geometry.layers, what).map_err(|_| {
            HiCacheError::AllocFailed {
                what,
                bytes: geometry
                    .layers
                    .saturating_mul(size_of::<RwLock<Box<[u8]>>>()),
            }
        })?;
        for _ in 0..geometry.layers {
            layers.push(RwLock::new(crate::host_pool::zeroed_bytes(
                layer_bytes,
                "device pool layer",
            )?));
        }
        Ok(DeviceMem {
            geometry,
            pages,
            layers,
        })
    }

    /// Executes `c`; with `poison` the destination is overwritten with [`POISON_BYTE`] instead.
    pub(super) fn execute(&self, c: &PageCopy, poison: bool) {
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
pub(super) fn execute_slots(c: &SlotCopy, dev: &SlotMemory, poison: bool) {
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
