//! The host pool (L2): one buffer in a [`HostLayout`] plus a page allocator that detects
//! double frees.

use std::sync::Arc;

use crate::backend::HostMemory;
use crate::error::{HiCacheError, Result};
use crate::geometry::{HostLayout, KvGeometry};

/// A zeroed buffer of `bytes` bytes, or [`HiCacheError::AllocFailed`] when the allocator
/// refuses it: a pool larger than the machine must not abort the process (radix's
/// [`try_filled`](radixkv_radix::try_filled), with this crate's typed error).
pub(crate) fn zeroed_bytes(bytes: usize, what: &'static str) -> Result<Box<[u8]>> {
    radixkv_radix::try_filled(bytes, 0u8, what)
        .map(Vec::into_boxed_slice)
        .map_err(|_| HiCacheError::AllocFailed { what, bytes })
}

/// Alignment of [`PageAligned`] buffers: a memory page.
pub(crate) const PAGE_ALIGN: usize = 4096;

/// A zeroed heap buffer that starts on a memory page, for the host pools a device copies to
/// and from: a buffer from the ordinary allocator starts a few bytes into a page, so every
/// page-sized span of it straddles two pages (on an H200, the copy kernel's device → host
/// writes into such a buffer ran at 0.66–0.87× of a memcpy, against 0.90–0.95× into an aligned
/// one).
pub(crate) struct PageAligned {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: `PageAligned` owns its allocation exclusively, like a `Box<[u8]>`.
unsafe impl Send for PageAligned {}
// SAFETY: shared access only reads through `&[u8]`.
unsafe impl Sync for PageAligned {}

impl PageAligned {
    /// `bytes` zeroed bytes, or [`HiCacheError::AllocFailed`] when the allocator refuses.
    pub(crate) fn zeroed(bytes: usize, what: &'static str) -> Result<Self> {
        if bytes == 0 {
            return Ok(PageAligned {
                ptr: std::ptr::NonNull::dangling(),
                len: 0,
            });
        }
        let layout = std::alloc::Layout::from_size_align(bytes, PAGE_ALIGN)
            .map_err(|_| HiCacheError::AllocFailed { what, bytes })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        std::ptr::NonNull::new(ptr)
            .map(|ptr| PageAligned { ptr, len: bytes })
            .ok_or(HiCacheError::AllocFailed { what, bytes })
    }
}

impl std::ops::Deref for PageAligned {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self` (or is dangling
        // with `len == 0`).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PageAligned {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PageAligned {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with this very layout.
            unsafe {
                std::alloc::dealloc(
                    self.ptr.as_ptr(),
                    std::alloc::Layout::from_size_align_unchecked(self.len, PAGE_ALIGN),
                )
            };
        }
    }
}

impl std::fmt::Debug for PageAligned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageAligned({} bytes)", self.len)
    }
}

/// How large the host pool is.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum HostSize {
    /// At most this many bytes (rounded down to whole pages).
    Bytes(u64),
    /// This multiple of the device pool (rounded up to whole pages).
    Ratio(f64),
    /// Exactly this many pages.
    Pages(usize),
}

impl HostSize {
    /// Pages of a host pool for a device pool of `device_pages` pages.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] when the result is zero pages or the ratio is not a positive
    /// finite number.
    pub fn pages(self, geometry: &KvGeometry, device_pages: usize) -> Result<usize> {
        geometry.validate()?;
        let n = match self {
            HostSize::Bytes(b) => (b / geometry.page_bytes() as u64) as usize,
            HostSize::Ratio(r) if r.is_finite() && r > 0.0 => {
                (device_pages as f64 * r).ceil() as usize
            }
            HostSize::Ratio(r) => {
                return Err(HiCacheError::Config(format!(
                    "host ratio {r} must be positive"
                )));
            }
            HostSize::Pages(p) => p,
        };
        if n == 0 {
            return Err(HiCacheError::Config(format!(
                "host size {self:?} gives zero pages"
            )));
        }
        Ok(n)
    }
}

/// The word of [`SlotAllocator`]'s used bitmap that holds `slot`, and its bit there.
fn used_bit(slot: u32) -> (usize, u64) {
    (slot as usize / 64, 1 << (slot % 64))
}

/// A slot allocator with a LIFO free list and a used bitmap: `alloc` and `free` are all or
/// nothing, and a double free or a foreign slot is an error instead of corruption.
///
/// Slots never handed out are not listed: they are the range `fresh..total`, handed out in
/// ascending order after every freed slot (the order an eagerly filled LIFO list would give).
/// So the bookkeeping grows with the slots in use, and a pool sized from configuration costs
/// nothing to set up however large it is.
#[derive(Debug, Clone)]
pub struct SlotAllocator {
    /// Freed slots, reused first (LIFO).
    free: Vec<u32>,
    /// Per slot below `fresh`, a bit: allocated or not (a bit, not a byte: a 4M-token host
    /// pool's 262,144 pages then take 32 KiB, which stays in cache while frees and loads
    /// check scattered slots).
    used: Vec<u64>,
    /// Slots `fresh..total` have never been handed out.
    fresh: u32,
    total: u32,
}

impl SlotAllocator {
    /// `total` slots, all free; fresh allocations come out in ascending order so that
    /// consecutive allocations are contiguous.
    pub fn new(total: u32) -> Self {
        SlotAllocator {
            free: Vec::new(),
            used: Vec::new(),
            fresh: 0,
            total,
        }
    }

    /// Total slots.
    pub fn total(&self) -> usize {
        self.total as usize
    }

    /// Free slots.
    pub fn available(&self) -> usize {
        self.free.len() + (self.total - self.fresh) as usize
    }

    /// Allocated slots.
    pub fn used(&self) -> usize {
        self.total() - self.available()
    }

    /// True when `slot` is allocated.
    pub fn is_used(&self, slot: u32) -> bool {
        let (w, bit) = used_bit(slot);
        self.used.get(w).is_some_and(|&x| x & bit != 0)
    }

    /// Allocates `n` slots, or none when fewer are free (`None`).
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        let mut out = Vec::new();
        self.alloc_into(n, &mut out).then_some(out)
    }

    /// Appends `n` newly allocated slots to `out`; false (and nothing appended) when fewer
    /// are free.
    pub fn alloc_into(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        if n > self.available() {
            return false;
        }
        let from = out.len();
        out.reserve(n);
        let reused = n.min(self.free.len());
        let start = self.free.len() - reused;
        out.extend(self.free[start..].iter().rev());
        self.free.truncate(start);
        // `n - reused <= total - fresh`, checked above, so this stays within `total`.
        let fresh_end = self.fresh + (n - reused) as u32;
        out.extend(self.fresh..fresh_end);
        self.used.resize((fresh_end as usize).div_ceil(64), 0);
        self.fresh = fresh_end;
        for &s in &out[from..] {
            self.set_used(s, true);
        }
        true
    }

    /// Marks slot `s` (below `fresh`) allocated or free.
    fn set_used(&mut self, s: u32, used: bool) {
        let (w, bit) = used_bit(s);
        if used {
            self.used[w] |= bit;
        } else {
            self.used[w] &= !bit;
        }
    }

    /// What freeing `s` would be: `None` when it is allocated.
    fn free_error(&self, s: u32) -> Option<HiCacheError> {
        if s >= self.total {
            Some(HiCacheError::HostPageOutOfRange(s))
        } else if !self.is_used(s) {
            Some(HiCacheError::DoubleFree(s))
        } else {
            None
        }
    }

    /// Frees `slots`.
    ///
    /// # Errors
    /// [`HiCacheError::HostPageOutOfRange`] or [`HiCacheError::DoubleFree`] (also for a slot
    /// listed twice); nothing is freed then.
    pub fn free(&mut self, slots: &[u32]) -> Result<()> {
        for (i, &s) in slots.iter().enumerate() {
            if let Some(e) = self.free_error(s) {
                for &q in &slots[..i] {
                    self.set_used(q, true);
                }
                return Err(e);
            }
            self.set_used(s, false);
        }
        self.free.extend(slots.iter().rev());
        Ok(())
    }

    /// Checks that [`SlotAllocator::free`] of `slots` would succeed, without freeing.
    ///
    /// # Errors
    /// As `free`.
    pub fn check_free(&self, slots: &[u32]) -> Result<()> {
        let mut sorted = slots.to_vec();
        sorted.sort_unstable();
        for (i, &s) in sorted.iter().enumerate() {
            if let Some(e) = self.free_error(s) {
                return Err(e);
            }
            if i > 0 && sorted[i - 1] == s {
                return Err(HiCacheError::DoubleFree(s));
            }
        }
        Ok(())
    }

    /// Frees every slot.
    pub fn reset(&mut self) {
        self.free.clear();
        self.used.clear();
        self.fresh = 0;
    }
}

/// The host KV pool: its memory and its page allocator.
#[derive(Debug)]
pub struct HostPool {
    mem: Arc<HostMemory>,
    alloc: SlotAllocator,
}

impl HostPool {
    /// A zeroed host pool.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] for an impossible size.
    pub fn new(geometry: KvGeometry, pages: usize, layout: HostLayout) -> Result<Self> {
        let mem = Arc::new(HostMemory::new(geometry, pages, layout)?);
        // `HostMemory::new` refuses more pages than 32-bit page ids address; say so here too
        // rather than truncate.
        let total = u32::try_from(pages).map_err(|_| {
            HiCacheError::Config(format!("host pool of {pages} pages is too large"))
        })?;
        Ok(HostPool {
            mem,
            alloc: SlotAllocator::new(total),
        })
    }

    /// The memory (shared with the streams).
    pub fn memory(&self) -> &Arc<HostMemory> {
        &self.mem
    }

    /// Total pages.
    pub fn total(&self) -> usize {
        self.alloc.total()
    }

    /// Free pages.
    pub fn available(&self) -> usize {
        self.alloc.available()
    }

    /// Allocated pages.
    pub fn used(&self) -> usize {
        self.alloc.used()
    }

    /// True when `page` is allocated.
    pub fn is_used(&self, page: u32) -> bool {
        self.alloc.is_used(page)
    }

    /// Allocates `n` pages.
    ///
    /// # Errors
    /// [`HiCacheError::HostFull`]; nothing allocated then.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        self.alloc_into(n, &mut out)?;
        Ok(out)
    }

    /// Appends `n` newly allocated pages to `out`.
    ///
    /// # Errors
    /// [`HiCacheError::HostFull`]; nothing allocated or appended then.
    pub fn alloc_into(&mut self, n: usize, out: &mut Vec<u32>) -> Result<()> {
        if self.alloc.alloc_into(n, out) {
            Ok(())
        } else {
            Err(HiCacheError::HostFull {
                needed: n,
                available: self.alloc.available(),
            })
        }
    }

    /// Frees pages.
    ///
    /// # Errors
    /// Double free or out of range; nothing freed then.
    pub fn free(&mut self, pages: &[u32]) -> Result<()> {
        self.alloc.free(pages)
    }

    /// Checks that [`HostPool::free`] of `pages` would succeed, without freeing.
    ///
    /// # Errors
    /// As `free`.
    pub fn check_free(&self, pages: &[u32]) -> Result<()> {
        self.alloc.check_free(pages)
    }

    /// Frees every page.
    pub fn reset(&mut self) {
        self.alloc.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_aligned_buffers_start_on_a_page_and_are_zeroed() {
        for n in [0usize, 1, 4095, 4096, 4097, 3 << 20] {
            let mut b = PageAligned::zeroed(n, "test").unwrap();
            assert_eq!(b.len(), n);
            assert!(b.iter().all(|&x| x == 0));
            if n > 0 {
                assert_eq!(b.as_ptr() as usize % PAGE_ALIGN, 0, "{n} bytes");
                b[n - 1] = 7;
                assert_eq!(b[n - 1], 7);
            }
        }
        let g = KvGeometry::new(2, 16, 100).unwrap();
        let m = crate::HostMemory::new(g, 3, HostLayout::PageFirst).unwrap();
        assert_eq!(m.read().as_ptr() as usize % PAGE_ALIGN, 0);
    }

    #[test]
    fn double_free_and_foreign_pages_are_errors_and_change_nothing() {
        let g = KvGeometry::new(2, 4, 8).unwrap();
        let mut p = HostPool::new(g, 8, HostLayout::PageFirst).unwrap();
        let a = p.alloc(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        assert!(matches!(
            p.alloc(6),
            Err(HiCacheError::HostFull {
                needed: 6,
                available: 5
            })
        ));
        p.free(&a[..1]).unwrap();
        assert_eq!(p.free(&[a[1], a[0]]), Err(HiCacheError::DoubleFree(0)));
        assert!(p.is_used(a[1]), "rolled back");
        assert_eq!(p.free(&[a[1], a[1]]), Err(HiCacheError::DoubleFree(1)));
        assert_eq!(p.free(&[99]), Err(HiCacheError::HostPageOutOfRange(99)));
        assert_eq!(p.used(), 2);
        p.free(&a[1..]).unwrap();
        assert_eq!(p.available(), 8);
    }

    #[test]
    fn slots_come_out_freed_first_then_fresh_ascending() {
        let mut a = SlotAllocator::new(6);
        assert_eq!(a.alloc(3), Some(vec![0, 1, 2]));
        a.free(&[1, 0]).unwrap();
        // Freed slots in LIFO order, then the never-used ones in ascending order.
        assert_eq!(a.alloc(4), Some(vec![1, 0, 3, 4]));
        assert_eq!((a.available(), a.used()), (1, 5));
        assert_eq!(a.alloc(2), None);
        assert_eq!(a.free(&[5]), Err(HiCacheError::DoubleFree(5)));
        assert_eq!(a.free(&[6]), Err(HiCacheError::HostPageOutOfRange(6)));
        assert_eq!(a.check_free(&[2, 2]), Err(HiCacheError::DoubleFree(2)));
        assert_eq!(a.check_free(&[5]), Err(HiCacheError::DoubleFree(5)));
        a.check_free(&[2, 3]).unwrap();
        a.reset();
        assert_eq!(a.alloc(6), Some((0..6).collect()));
        // The largest pool costs nothing until used.
        let mut huge = SlotAllocator::new(u32::MAX);
        assert_eq!(huge.available(), u32::MAX as usize);
        assert_eq!(huge.alloc(2), Some(vec![0, 1]));
        assert!(!huge.is_used(u32::MAX - 1));
    }

    #[test]
    fn pools_the_allocator_refuses_are_typed_errors_not_aborts() {
        // 2^20 pages of 2^40 bytes: the size fits in usize, no allocator grants it.
        let g = KvGeometry::new(1, 1, 1 << 40).unwrap();
        let refused = |r: Result<()>, pool: &str| match r {
            Err(HiCacheError::AllocFailed { what, bytes }) => {
                assert_eq!(what, pool);
                assert_eq!(bytes, 1 << 60);
            }
            other => panic!("{other:?}"),
        };
        refused(
            HostPool::new(g, 1 << 20, HostLayout::LayerFirst).map(|_| ()),
            "host pool",
        );
        refused(
            crate::HostSim::new(g, 1 << 20, crate::HostSimConfig::default()).map(|_| ()),
            "device pool layer",
        );
        refused(
            crate::backend::SlotMemory::new(crate::PoolName::Mamba, 1 << 20, 1 << 40).map(|_| ()),
            "extra pool",
        );
    }

    #[test]
    fn sizes_in_bytes_ratio_and_pages() {
        let g = KvGeometry::new(2, 4, 8).unwrap(); // 64 bytes per page
        assert_eq!(HostSize::Bytes(640).pages(&g, 1).unwrap(), 10);
        assert_eq!(HostSize::Ratio(2.5).pages(&g, 3).unwrap(), 8);
        assert!(HostSize::Bytes(63).pages(&g, 1).is_err());
        assert!(HostSize::Ratio(f64::NAN).pages(&g, 1).is_err());
        assert_eq!(HostSize::Pages(3).pages(&g, 1).unwrap(), 3);
        let zero = KvGeometry {
            bytes_per_token_layer: 0,
            ..g
        };
        assert!(HostSize::Bytes(640).pages(&zero, 1).is_err());
    }
}
