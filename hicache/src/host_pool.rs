//! The host pool (L2): one buffer in a [`HostLayout`] plus a page allocator that detects
//! double frees.

use std::sync::Arc;

use crate::backend::HostMemory;
use crate::error::{HiCacheError, Result};
use crate::geometry::{HostLayout, KvGeometry};

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

/// A slot allocator with a LIFO free list and a used bitmap: `alloc` and `free` are all or
/// nothing, and a double free or a foreign slot is an error instead of corruption.
#[derive(Debug, Clone)]
pub struct SlotAllocator {
    free: Vec<u32>,
    used: Vec<bool>,
}

impl SlotAllocator {
    /// `total` slots, all free; fresh allocations come out in ascending order so that
    /// consecutive allocations are contiguous.
    pub fn new(total: u32) -> Self {
        SlotAllocator {
            free: (0..total).rev().collect(),
            used: vec![false; total as usize],
        }
    }

    /// Total slots.
    pub fn total(&self) -> usize {
        self.used.len()
    }

    /// Free slots.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Allocated slots.
    pub fn used(&self) -> usize {
        self.total() - self.free.len()
    }

    /// True when `slot` is allocated.
    pub fn is_used(&self, slot: u32) -> bool {
        self.used.get(slot as usize).copied().unwrap_or(false)
    }

    /// Allocates `n` slots, or none when fewer are free (`None`).
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let start = self.free.len() - n;
        let out: Vec<u32> = self.free[start..].iter().rev().copied().collect();
        for &s in &out {
            self.used[s as usize] = true;
        }
        self.free.truncate(start);
        Some(out)
    }

    /// Frees `slots`.
    ///
    /// # Errors
    /// [`HiCacheError::HostPageOutOfRange`] or [`HiCacheError::DoubleFree`] (also for a slot
    /// listed twice); nothing is freed then.
    pub fn free(&mut self, slots: &[u32]) -> Result<()> {
        for (i, &s) in slots.iter().enumerate() {
            let err = match self.used.get(s as usize) {
                None => Some(HiCacheError::HostPageOutOfRange(s)),
                Some(false) => Some(HiCacheError::DoubleFree(s)),
                Some(true) => None,
            };
            if let Some(e) = err {
                for &q in &slots[..i] {
                    self.used[q as usize] = true;
                }
                return Err(e);
            }
            self.used[s as usize] = false;
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
            match self.used.get(s as usize) {
                None => return Err(HiCacheError::HostPageOutOfRange(s)),
                Some(false) => return Err(HiCacheError::DoubleFree(s)),
                Some(true) if i > 0 && sorted[i - 1] == s => {
                    return Err(HiCacheError::DoubleFree(s));
                }
                Some(true) => {}
            }
        }
        Ok(())
    }

    /// Frees every slot.
    pub fn reset(&mut self) {
        let total = self.used.len() as u32;
        self.free = (0..total).rev().collect();
        self.used.iter_mut().for_each(|u| *u = false);
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
        Ok(HostPool {
            mem,
            alloc: SlotAllocator::new(pages as u32),
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
        self.alloc.alloc(n).ok_or(HiCacheError::HostFull {
            needed: n,
            available: self.alloc.available(),
        })
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
