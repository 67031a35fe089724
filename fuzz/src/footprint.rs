//! What an error must leave unchanged: every page's owner and every row's contents.

use radixkv_radix::{PageId, PoolAccounting, PrefixCache, RowHolder, RowId};

/// Where every device page is, as far as the public API of a [`PrefixCache`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Footprint {
    /// The five-way split of the pool.
    pub accounting: PoolAccounting,
    /// Free pages.
    pub free_pages: usize,
    /// Tree-owned pages.
    pub tree_pages: usize,
    /// Every live row with its holder, pages and protected prefix.
    pub rows: Vec<(RowId, RowHolder, Vec<PageId>, usize)>,
}

/// The footprint of `cache` now.
pub fn footprint<C: PrefixCache + ?Sized>(cache: &C) -> Footprint {
    let pools = cache.pools();
    Footprint {
        accounting: cache.accounting(),
        free_pages: pools.pages.available(),
        tree_pages: pools.pages.tree_pages(),
        rows: pools
            .rows
            .iter()
            .map(|(row, holder, pages, protected)| (row, holder, pages.to_vec(), protected))
            .collect(),
    }
}

/// Asserts that `a` describes an idle pool: nothing protected, owned by a request or held by
/// a session, and every page free or evictable.
pub fn assert_idle(a: &PoolAccounting) {
    assert_eq!(
        (a.protected, a.request_owned, a.session_held),
        (0, 0, 0),
        "leak: {a:?}"
    );
    assert_eq!(a.free + a.evictable, a.total, "leak: {a:?}");
}
