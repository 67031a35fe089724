//! Allocators of the device pools: pages of the KV pool and rows of the request pool.
//!
//! Every page is in exactly one state: `Free` (in the allocator), `Tree` (owned by a tree node)
//! or `Owned` (allocated to a request, a session or a caller, not yet given to the tree). The
//! state byte per page is what makes double frees, frees of tree pages and inserts of free pages
//! typed errors instead of silent corruption, and what the invariant checker audits.

use crate::error::{CacheError, Result};
use crate::types::{PageId, RowId};

/// An empty vector with room for exactly `capacity` elements, or [`CacheError::Config`] naming
/// `what` when the allocator refuses the memory.
///
/// Pools and tables sized from configuration are allocated through this: an infallible
/// allocation of a size the machine cannot provide aborts the whole process, which an engine
/// embedding the cache cannot catch. Other crates of the workspace use it for their pools too.
///
/// # Errors
/// [`CacheError::Config`] when `capacity` elements cannot be allocated.
pub fn try_with_capacity<T>(capacity: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(capacity).map_err(|e| {
        CacheError::Config(format!(
            "cannot allocate {what}: {capacity} entries of {} bytes ({e})",
            size_of::<T>()
        ))
    })?;
    Ok(v)
}

/// `len` copies of `value`, allocated fallibly like [`try_with_capacity`] (the memory is
/// written, so it is committed at once rather than on first use).
///
/// # Errors
/// [`CacheError::Config`] when `len` elements cannot be allocated.
pub fn try_filled<T: Clone>(len: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = try_with_capacity(len, what)?;
    v.resize(len, value);
    Ok(v)
}

/// Ownership state of one device page.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum PageState {
    /// In the allocator's free list.
    Free = 0,
    /// Allocated to a request, a session or a caller.
    Owned = 1,
    /// Owned by a tree node.
    Tree = 2,
}

/// Page allocator of one device pool: a LIFO free list plus one state byte per page.
///
/// Pages freed together come back in the order they were freed in: a free pushes its list
/// last page first, so the next allocation pops it first page first. A node's pages, allocated
/// as one ascending run, are evicted and reallocated as that run again, and a transfer of them
/// is one copy instead of one per page. (Pushing in list order handed them out descending,
/// which no copy can merge: every other reuse of a range was page by page. On the agentic
/// replay with a host tier that halved the runs of the transfers, 4.48M to 2.17M.)
///
/// `alloc` and `free` are all-or-nothing: on error nothing changed.
#[derive(Debug, Clone)]
pub struct PageAllocator {
    free: Vec<PageId>,
    state: Vec<PageState>,
    tree_pages: usize,
}

impl PageAllocator {
    /// A pool of `total` pages, all free. Pages are handed out in ascending order at first.
    ///
    /// # Errors
    /// [`CacheError::Config`] for a size outside `1..=u32::MAX` or one whose tables cannot be
    /// allocated.
    pub fn new(total: usize) -> Result<Self> {
        if total == 0 || total > u32::MAX as usize {
            return Err(CacheError::Config(format!(
                "page pool size {total} must be in 1..=u32::MAX"
            )));
        }
        let mut free = try_with_capacity(total, "the page pool's free list")?;
        free.extend((0..total as u32).rev().map(PageId));
        Ok(PageAllocator {
            free,
            state: try_filled(total, PageState::Free, "the page pool's state table")?,
            tree_pages: 0,
        })
    }

    /// Total pages in the pool.
    pub fn total(&self) -> usize {
        self.state.len()
    }

    /// Pages currently free.
    #[inline]
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Pages currently owned by the tree.
    pub fn tree_pages(&self) -> usize {
        self.tree_pages
    }

    /// Pages allocated and not owned by the tree (requests, sessions, callers).
    pub fn owned_pages(&self) -> usize {
        self.total() - self.free.len() - self.tree_pages
    }

    /// State of `page`.
    ///
    /// # Errors
    /// [`CacheError::PageOutOfRange`] for a page outside the pool.
    pub fn state(&self, page: PageId) -> Result<PageState> {
        self.state
            .get(page.index())
            .copied()
            .ok_or(CacheError::PageOutOfRange(page))
    }

    /// Appends `n` freshly allocated pages to `out`.
    ///
    /// # Errors
    /// [`CacheError::OutOfPages`] when fewer than `n` pages are free; nothing is allocated then.
    pub fn alloc_into(&mut self, n: usize, out: &mut Vec<PageId>) -> Result<()> {
        if n > self.free.len() {
            return Err(CacheError::OutOfPages {
                needed: n,
                available: self.free.len(),
            });
        }
        let start = self.free.len() - n;
        // The free list is a stack; take its top in pop order so fresh pools hand out ascending ids.
        let taken = &self.free[start..];
        for &p in taken {
            self.state[p.index()] = PageState::Owned;
        }
        out.extend(taken.iter().rev());
        self.free.truncate(start);
        Ok(())
    }

    /// Allocates `n` pages.
    ///
    /// # Errors
    /// See [`PageAllocator::alloc_into`].
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageId>> {
        // Checked before reserving: `n` is the caller's and may be anything.
        if n > self.free.len() {
            return Err(CacheError::OutOfPages {
                needed: n,
                available: self.free.len(),
            });
        }
        let mut v = Vec::with_capacity(n);
        self.alloc_into(n, &mut v)?;
        Ok(v)
    }

    /// Returns owned pages to the free list.
    ///
    /// # Errors
    /// [`CacheError::PageOutOfRange`] or [`CacheError::PageState`] (double free, a tree page, or a
    /// page listed twice); nothing is freed then.
    pub fn free(&mut self, pages: &[PageId]) -> Result<()> {
        self.transition(
            pages,
            PageState::Owned,
            PageState::Free,
            "owned (double free?)",
        )?;
        self.free.extend(pages.iter().rev());
        Ok(())
    }

    /// Moves every page of `pages` from `from` to `to`, or none of them. A page listed twice is
    /// caught because its second occurrence is already in state `to`.
    fn transition(
        &mut self,
        pages: &[PageId],
        from: PageState,
        to: PageState,
        expected: &'static str,
    ) -> Result<()> {
        for (i, &p) in pages.iter().enumerate() {
            let ok = matches!(self.state.get(p.index()), Some(s) if *s == from);
            if !ok {
                for &q in &pages[..i] {
                    self.state[q.index()] = from;
                }
                return Err(match self.state.get(p.index()) {
                    None => CacheError::PageOutOfRange(p),
                    Some(_) => CacheError::PageState { page: p, expected },
                });
            }
            self.state[p.index()] = to;
        }
        Ok(())
    }

    /// Marks owned pages as tree-owned (the tree adopts them). All or nothing.
    pub(crate) fn adopt_into_tree(&mut self, pages: &[PageId]) -> Result<()> {
        self.transition(
            pages,
            PageState::Owned,
            PageState::Tree,
            "owned (only owned pages, each once, can enter the tree)",
        )?;
        self.tree_pages += pages.len();
        Ok(())
    }

    /// Frees pages that the tree released (eviction, reset). Trusted internal path.
    pub(crate) fn free_tree_pages(&mut self, pages: &[PageId]) {
        for &p in pages {
            debug_assert_eq!(self.state[p.index()], PageState::Tree, "{p:?}");
            self.state[p.index()] = PageState::Free;
        }
        self.tree_pages -= pages.len();
        self.free.extend(pages.iter().rev());
    }

    /// Hands tree-owned pages back to a caller (a tiered cache demoting a node keeps nothing).
    pub(crate) fn release_from_tree(&mut self, pages: &[PageId]) {
        for &p in pages {
            debug_assert_eq!(self.state[p.index()], PageState::Tree, "{p:?}");
            self.state[p.index()] = PageState::Owned;
        }
        self.tree_pages -= pages.len();
    }

    /// Marks owned pages as tree-owned, for tiered caches that hand pages to the tree through
    /// the tier API (load-back). All or nothing.
    ///
    /// # Errors
    /// [`CacheError::PageOutOfRange`] or [`CacheError::PageState`] when a page is not owned or
    /// listed twice; nothing changes then.
    pub fn mark_tree_owned(&mut self, pages: &[PageId]) -> Result<()> {
        self.adopt_into_tree(pages)
    }

    /// Frees pages the tree released (a tiered cache's own eviction loop). Checked and all or
    /// nothing, unlike the internal path.
    ///
    /// # Errors
    /// [`CacheError::PageOutOfRange`] or [`CacheError::PageState`] when a page is not
    /// tree-owned or listed twice; nothing changes then.
    pub fn free_released_tree_pages(&mut self, pages: &[PageId]) -> Result<()> {
        self.transition(
            pages,
            PageState::Tree,
            PageState::Free,
            "tree-owned (released by the tree)",
        )?;
        self.tree_pages -= pages.len();
        self.free.extend(pages.iter().rev());
        Ok(())
    }

    /// Iterates over the free list (for invariant checks).
    pub fn free_pages(&self) -> &[PageId] {
        &self.free
    }
}

/// Who holds a request-pool row.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum RowHolder {
    /// A running (or waiting) request.
    Request,
    /// A streaming session between turns (its KV is "session held").
    Session,
}

#[derive(Debug, Clone)]
struct RowSlot {
    generation: u32,
    live: bool,
    holder: RowHolder,
    /// Page table: page `i` holds token positions `[i*P, (i+1)*P)`.
    pages: Vec<PageId>,
    /// Leading pages owned by the tree (the request holds a lock on them instead).
    protected: usize,
}

/// The request-to-token pool: one row (a page table) per running request or held session.
///
/// A row records which of its leading pages belong to the tree (`protected`); the rest are owned
/// by the holder. That split is what the invariant checker and the session accounting read.
#[derive(Debug, Clone)]
pub struct RowPool {
    rows: Vec<RowSlot>,
    free: Vec<u32>,
    capacity: usize,
    live: usize,
    /// The page-table room a released row keeps for its next request, at most (see
    /// [`RowPool::release`]).
    retain_pages: usize,
}

impl RowPool {
    /// A pool of at most `capacity` rows. Rows are allocated as they are first used, and a
    /// released row keeps all its page table's room for the next request
    /// ([`RowPool::for_pool`] bounds it).
    ///
    /// # Errors
    /// [`CacheError::Config`] for a capacity outside `1..=u32::MAX`.
    pub fn new(capacity: usize) -> Result<Self> {
        if capacity == 0 || capacity > u32::MAX as usize {
            return Err(CacheError::Config(format!(
                "row pool capacity {capacity} must be in 1..=u32::MAX"
            )));
        }
        Ok(RowPool {
            rows: Vec::new(),
            free: Vec::new(),
            capacity,
            live: 0,
            retain_pages: usize::MAX,
        })
    }

    /// A pool of at most `capacity` rows over a KV pool of `pool_pages` pages: a released row
    /// keeps room for at most its share of the pool's pages (`pool_pages / capacity`, at least
    /// one), so that the page tables of rows not in use hold at most one entry per pool page in
    /// all, whatever lengths the requests before had.
    ///
    /// # Errors
    /// As [`RowPool::new`].
    pub fn for_pool(capacity: usize, pool_pages: usize) -> Result<Self> {
        let mut rows = Self::new(capacity)?;
        rows.retain_pages = (pool_pages / capacity).max(1);
        Ok(rows)
    }

    /// Maximum number of rows.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Rows in use.
    pub fn live(&self) -> usize {
        self.live
    }

    /// Rows still available.
    #[inline]
    pub fn available(&self) -> usize {
        self.capacity - self.live
    }

    /// `Ok` when a row is available: callers that prepare a request's KV before allocating
    /// its row check first, so that running out of rows changes nothing.
    ///
    /// # Errors
    /// [`CacheError::OutOfRows`] when all rows are in use.
    pub fn ensure_available(&self) -> Result<()> {
        if self.live >= self.capacity {
            return Err(CacheError::OutOfRows {
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Allocates an empty row held by a request.
    ///
    /// # Errors
    /// [`CacheError::OutOfRows`] when all rows are in use.
    pub fn alloc(&mut self) -> Result<RowId> {
        self.ensure_available()?;
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.rows.push(RowSlot {
                    generation: 0,
                    live: false,
                    holder: RowHolder::Request,
                    pages: Vec::new(),
                    protected: 0,
                });
                (self.rows.len() - 1) as u32
            }
        };
        let slot = &mut self.rows[idx as usize];
        slot.live = true;
        slot.holder = RowHolder::Request;
        slot.protected = 0;
        debug_assert!(slot.pages.is_empty());
        self.live += 1;
        Ok(RowId {
            idx,
            generation: slot.generation,
        })
    }

    #[inline]
    fn slot(&self, id: RowId) -> Result<&RowSlot> {
        match self.rows.get(id.index()) {
            Some(s) if s.live && s.generation == id.generation => Ok(s),
            _ => Err(CacheError::StaleRow(id)),
        }
    }

    #[inline]
    fn slot_mut(&mut self, id: RowId) -> Result<&mut RowSlot> {
        match self.rows.get_mut(id.index()) {
            Some(s) if s.live && s.generation == id.generation => Ok(s),
            _ => Err(CacheError::StaleRow(id)),
        }
    }

    /// The page table of `row`.
    ///
    /// # Errors
    /// [`CacheError::StaleRow`].
    #[inline]
    pub fn pages(&self, row: RowId) -> Result<&[PageId]> {
        Ok(&self.slot(row)?.pages)
    }

    /// Number of leading tree-owned pages of `row`.
    pub fn protected_pages(&self, row: RowId) -> Result<usize> {
        Ok(self.slot(row)?.protected)
    }

    /// Who holds `row`.
    pub fn holder(&self, row: RowId) -> Result<RowHolder> {
        Ok(self.slot(row)?.holder)
    }

    /// Changes who holds `row` (sessions take rows over between turns and lend them back).
    pub fn set_holder(&mut self, row: RowId, holder: RowHolder) -> Result<()> {
        self.slot_mut(row)?.holder = holder;
        Ok(())
    }

    /// Mutable access to the page table and its protected count (crate-internal: callers must
    /// keep page states consistent).
    #[inline]
    pub(crate) fn parts_mut(&mut self, row: RowId) -> Result<(&mut Vec<PageId>, &mut usize)> {
        let s = self.slot_mut(row)?;
        Ok((&mut s.pages, &mut s.protected))
    }

    /// Starts a request on `row`: its page table gets the matched `prefix` (tree-owned, so
    /// protected) and room for `pages` pages in all at once, so that the request's chunks and
    /// decode never regrow it (growing by doubling, a running request's table held up to
    /// twice its pages).
    pub(crate) fn start(&mut self, row: RowId, prefix: &[PageId], pages: usize) -> Result<()> {
        let s = self.slot_mut(row)?;
        s.pages.reserve_exact(pages.saturating_sub(s.pages.len()));
        s.pages.extend_from_slice(prefix);
        s.protected = prefix.len();
        Ok(())
    }

    /// Releases a row whose owned pages were already freed. Its protected pages stay in the tree.
    /// The row keeps its page table's room for the next request, up to its share of the pool
    /// ([`RowPool::for_pool`]): a row that once served a long request would otherwise hold
    /// that request's room for the rest of the run (on the Mooncake replay, the rows' tables
    /// held ten entries per pool page).
    pub(crate) fn release(&mut self, row: RowId) -> Result<()> {
        let retain = self.retain_pages;
        let s = self.slot_mut(row)?;
        if s.pages.len() != s.protected {
            return Err(CacheError::InvalidRequestState(
                "row still owns pages; free them before releasing the row",
            ));
        }
        s.pages.clear();
        if s.pages.capacity() > retain {
            s.pages.shrink_to(retain);
        }
        s.protected = 0;
        s.live = false;
        s.generation = s.generation.wrapping_add(1);
        self.live -= 1;
        self.free.push(row.idx);
        Ok(())
    }

    /// Iterates over live rows: (id, holder, pages, protected).
    pub fn iter(&self) -> impl Iterator<Item = (RowId, RowHolder, &[PageId], usize)> + '_ {
        self.rows
            .iter()
            .enumerate()
            .filter(|(_, s)| s.live)
            .map(|(i, s)| {
                (
                    RowId {
                        idx: i as u32,
                        generation: s.generation,
                    },
                    s.holder,
                    s.pages.as_slice(),
                    s.protected,
                )
            })
    }
}

/// The device-side pools a cache manages: the KV page pool and the request pool.
#[derive(Debug, Clone)]
pub struct DevicePools {
    /// Tokens per page.
    pub page_size: usize,
    /// The KV page allocator.
    pub pages: PageAllocator,
    /// The request-to-token pool.
    pub rows: RowPool,
}

impl DevicePools {
    /// Pools of `total_pages` pages of `page_size` tokens and `max_rows` request rows.
    ///
    /// # Errors
    /// [`CacheError::Config`] for a zero size, a pool whose token count overflows `usize`, or
    /// one that cannot be allocated.
    pub fn new(page_size: usize, total_pages: usize, max_rows: usize) -> Result<Self> {
        if page_size == 0 {
            return Err(CacheError::Config("page size must be at least 1".into()));
        }
        // Every token count of the pool (accounting, available tokens) is derived from this
        // product, so it must fit once for all of them to fit.
        if total_pages.checked_mul(page_size).is_none() {
            return Err(CacheError::Config(format!(
                "a pool of {total_pages} pages of {page_size} tokens overflows the token count"
            )));
        }
        Ok(DevicePools {
            page_size,
            pages: PageAllocator::new(total_pages)?,
            rows: RowPool::for_pool(max_rows, total_pages)?,
        })
    }

    /// Total token capacity of the KV pool.
    pub fn total_tokens(&self) -> usize {
        self.pages.total() * self.page_size
    }

    /// Pages owned by rows held by sessions and not currently lent (session-held KV).
    pub fn session_held_pages(&self) -> usize {
        self.rows
            .iter()
            .filter(|(_, h, _, _)| *h == RowHolder::Session)
            .map(|(_, _, p, prot)| p.len() - prot)
            .sum()
    }

    /// Frees the owned pages of `row` from page index `from` on (never below its protected
    /// pages) and truncates the row there.
    pub fn truncate_row(&mut self, row: RowId, from: usize) -> Result<()> {
        let (pages, protected) = self.rows.parts_mut(row)?;
        let from = from.max(*protected).min(pages.len());
        self.pages.free(&pages[from..])?;
        pages.truncate(from);
        Ok(())
    }

    /// Frees every owned page of `row` and releases it. Its tree pages stay in the tree (the
    /// caller releases the lock that protected them).
    pub fn release_row(&mut self, row: RowId) -> Result<()> {
        self.truncate_row(row, 0)?;
        self.rows.release(row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The room a row's page table keeps between requests.
    fn room(pools: &DevicePools, row: RowId) -> usize {
        pools.rows.rows[row.index()].pages.capacity()
    }

    #[test]
    fn a_released_row_keeps_at_most_its_share_of_the_pool() {
        // 64 pages over 4 rows: a share of 16 pages a row.
        let mut pools = DevicePools::new(16, 64, 4).unwrap();
        let long = pools.rows.alloc().unwrap();
        let (pages, _) = pools.rows.parts_mut(long).unwrap();
        pools.pages.alloc_into(60, pages).unwrap();
        assert!(room(&pools, long) >= 60);
        pools.release_row(long).unwrap();
        assert_eq!(pools.pages.available(), 64);
        // The free list is a stack: the next request gets the same row, with the share left.
        let next = pools.rows.alloc().unwrap();
        assert_eq!(next.index(), long.index());
        assert!(room(&pools, next) <= 16, "kept {}", room(&pools, next));
        // A short request's room is kept whole for the next one.
        let (pages, _) = pools.rows.parts_mut(next).unwrap();
        pools.pages.alloc_into(8, pages).unwrap();
        let kept = room(&pools, next);
        pools.release_row(next).unwrap();
        let again = pools.rows.alloc().unwrap();
        assert_eq!(room(&pools, again), kept);
    }

    #[test]
    fn pages_freed_together_come_back_in_their_order() {
        let mut a = PageAllocator::new(64).unwrap();
        let first = a.alloc(8).unwrap();
        assert_eq!(first, (0..8).map(PageId).collect::<Vec<_>>());
        let second = a.alloc(8).unwrap();
        // Every path that frees a list hands it back in the same order.
        a.free(&second).unwrap();
        assert_eq!(a.alloc(8).unwrap(), second);
        a.adopt_into_tree(&second).unwrap();
        a.free_tree_pages(&second);
        assert_eq!(a.alloc(8).unwrap(), second);
        a.adopt_into_tree(&second).unwrap();
        a.free_released_tree_pages(&second).unwrap();
        // Two lists freed one after the other come back most recent first, each in order,
        // and an allocation that takes part of a list takes its head.
        a.free(&first).unwrap();
        assert_eq!(a.alloc(3).unwrap(), first[..3]);
        assert_eq!(a.alloc(7).unwrap(), [&first[3..], &second[..2]].concat());
        assert_eq!(a.alloc(6).unwrap(), second[2..]);
    }
}
