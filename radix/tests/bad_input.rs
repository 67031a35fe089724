//! Every bad input of the public API returns its exact typed error and leaves the cache
//! unchanged: same accounting, same match results, invariants intact.

use radixkv_radix::{
    CacheError, DevicePools, FinishKind, InsertOptions, KeyRef, Namespace, PageAllocator, PageId,
    PageState, PoolAccounting, PrefixCache, RadixCache, RadixConfig, RadixKey, RequestKv, RowPool,
};

const P: usize = 4;
const SHARED: [u32; 8] = [1, 2, 3, 4, 5, 6, 7, 8];
const OTHER: [u32; 8] = [1, 2, 3, 4, 9, 9, 9, 9];

fn cache(total_pages: usize, max_rows: usize) -> RadixCache {
    RadixCache::new(RadixConfig {
        page_size: P,
        total_pages,
        max_rows,
        events: true,
        ..Default::default()
    })
    .unwrap()
}

fn insert(c: &mut RadixCache, tokens: &[u32], ns: &Namespace) {
    let pages = c.alloc_pages(tokens.len() / P).unwrap();
    let r = c
        .insert(
            KeyRef::with_namespace(tokens, ns),
            &pages,
            InsertOptions::default(),
        )
        .unwrap();
    c.pools_mut().pages.free(&r.duplicates).unwrap();
}

/// A cache with two cached sequences (one also in a named namespace) and one running request.
fn populated() -> (RadixCache, RequestKv) {
    let mut c = cache(16, 2);
    insert(&mut c, &SHARED, &Namespace::DEFAULT);
    insert(&mut c, &OTHER, &Namespace::DEFAULT);
    insert(&mut c, &SHARED, &Namespace::new("t"));
    let mut req = RequestKv::new(RadixKey::new(vec![1, 2, 3, 4, 5, 6, 7, 8, 0, 0]));
    c.match_request(&mut req).unwrap();
    c.begin_request(&mut req).unwrap();
    c.alloc_tokens(&mut req, 2).unwrap();
    req.commit(2).unwrap();
    c.take_events();
    (c, req)
}

/// What must not change: accounting, lock and row counts, and what every probe key matches.
#[derive(Debug, PartialEq)]
struct Snapshot {
    acc: PoolAccounting,
    locks: usize,
    rows: usize,
    matches: Vec<(usize, Vec<PageId>)>,
}

fn snapshot(c: &mut RadixCache) -> Snapshot {
    c.check_invariants().unwrap();
    assert!(c.accounting().balanced());
    let mut matches = Vec::new();
    for ns in [Namespace::DEFAULT, Namespace::new("t")] {
        for key in [
            &SHARED[..],
            &OTHER[..],
            &[1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0],
        ] {
            let mut out = Vec::new();
            let m = c
                .match_prefix(KeyRef::with_namespace(key, &ns), &mut out)
                .unwrap();
            matches.push((m.device_len, out));
        }
    }
    Snapshot {
        acc: c.accounting(),
        locks: c.tree().outstanding_locks(),
        rows: c.pools().rows.live(),
        matches,
    }
}

/// Runs `f` on the cache, checks it returned `expected` and changed nothing observable.
fn unchanged<T: std::fmt::Debug>(
    c: &mut RadixCache,
    expected: CacheError,
    f: impl FnOnce(&mut RadixCache) -> Result<T, CacheError>,
) {
    let before = snapshot(c);
    let got = f(c);
    assert_eq!(got.unwrap_err(), expected);
    assert!(c.take_events().is_empty(), "a failed call emitted events");
    assert_eq!(snapshot(c), before);
}

#[test]
fn empty_keys() {
    let (mut c, _req) = populated();
    unchanged(&mut c, CacheError::EmptyKey, |c| {
        c.match_prefix(KeyRef::new(&[]), &mut Vec::new())
    });
    unchanged(&mut c, CacheError::EmptyKey, |c| {
        c.insert(KeyRef::new(&[]), &[], InsertOptions::default())
    });
}

#[test]
fn misaligned_and_mismatched_inserts() {
    let (mut c, _req) = populated();
    let pages = c.alloc_pages(2).unwrap();
    unchanged(
        &mut c,
        CacheError::Misaligned {
            len: 6,
            page_size: P,
        },
        |c| c.insert(KeyRef::new(&[7; 6]), &pages, InsertOptions::default()),
    );
    let err = CacheError::LengthMismatch {
        tokens: 12,
        pages: 2,
        page_size: P,
    };
    unchanged(&mut c, err, |c| {
        c.insert(KeyRef::new(&[7; 12]), &pages, InsertOptions::default())
    });
    // Extending a cached key with too few pages fails too, before touching the cached part.
    let err = CacheError::LengthMismatch {
        tokens: 12,
        pages: 1,
        page_size: P,
    };
    unchanged(&mut c, err, |c| {
        c.insert(
            KeyRef::new(&[1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0]),
            &pages[..1],
            InsertOptions::default(),
        )
    });
    // The pages are still the caller's.
    for &pg in &pages {
        assert_eq!(c.pools().pages.state(pg), Ok(PageState::Owned));
    }
    c.pools_mut().pages.free(&pages).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn inserting_free_tree_or_repeated_pages() {
    let (mut c, _req) = populated();
    let free = *c.pools().pages.free_pages().last().unwrap();
    let err = CacheError::PageState {
        page: free,
        expected: "owned (only owned pages, each once, can enter the tree)",
    };
    unchanged(&mut c, err, |c| {
        c.insert(KeyRef::new(&[5; 4]), &[free], InsertOptions::default())
    });
    let mut out = Vec::new();
    c.match_prefix(KeyRef::new(&SHARED), &mut out).unwrap();
    let tree_page = out[0];
    let mine = c.alloc_pages(1).unwrap()[0];
    // A tree page given for a new key: rejected even after a valid owned page.
    let err = CacheError::PageState {
        page: tree_page,
        expected: "owned (only owned pages, each once, can enter the tree)",
    };
    unchanged(&mut c, err, |c| {
        c.insert(
            KeyRef::new(&[5; 8]),
            &[mine, tree_page],
            InsertOptions::default(),
        )
    });
    // The same owned page twice.
    let err = CacheError::PageState {
        page: mine,
        expected: "owned (only owned pages, each once, can enter the tree)",
    };
    unchanged(&mut c, err, |c| {
        c.insert(
            KeyRef::new(&[5; 8]),
            &[mine, mine],
            InsertOptions::default(),
        )
    });
    let outside = PageId(10_000);
    unchanged(&mut c, CacheError::PageOutOfRange(outside), |c| {
        c.insert(KeyRef::new(&[5; 4]), &[outside], InsertOptions::default())
    });
    assert_eq!(c.pools().pages.state(mine), Ok(PageState::Owned));
    c.pools_mut().pages.free(&[mine]).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn double_free_and_freeing_tree_pages() {
    let (mut c, _req) = populated();
    let pages = c.alloc_pages(2).unwrap();
    c.pools_mut().pages.free(&pages[..1]).unwrap();
    let err = CacheError::PageState {
        page: pages[0],
        expected: "owned (double free?)",
    };
    // All or nothing: the valid second page is not freed either.
    unchanged(&mut c, err.clone(), |c| c.pools_mut().pages.free(&pages));
    let err2 = CacheError::PageState {
        page: pages[1],
        expected: "owned (double free?)",
    };
    unchanged(&mut c, err2, |c| {
        c.pools_mut().pages.free(&[pages[1], pages[1]])
    });
    let mut out = Vec::new();
    c.match_prefix(KeyRef::new(&SHARED), &mut out).unwrap();
    let tree_err = CacheError::PageState {
        page: out[1],
        expected: "owned (double free?)",
    };
    unchanged(&mut c, tree_err, |c| c.pools_mut().pages.free(&out[1..]));
    unchanged(&mut c, CacheError::PageOutOfRange(PageId(16)), |c| {
        c.pools_mut().pages.free(&[PageId(16)])
    });
    c.pools_mut().pages.free(&pages[1..]).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn stale_node_ids() {
    let (mut c, mut req) = populated();
    // OTHER's second page is an unlocked leaf: evict everything evictable and keep its handle.
    let mut out = Vec::new();
    let m = c.match_prefix(KeyRef::new(&OTHER), &mut out).unwrap();
    assert_eq!(m.device_len, 8);
    let node = m.last_device;
    c.evict(usize::MAX);
    c.take_events();
    assert!(!c.tree().contains(node));
    unchanged(&mut c, CacheError::StaleNode(node), |c| {
        c.inc_lock_ref(node)
    });
    // Recreating the same content gives a new handle; the old one stays stale.
    insert(&mut c, &OTHER, &Namespace::DEFAULT);
    c.take_events();
    unchanged(&mut c, CacheError::StaleNode(node), |c| {
        c.inc_lock_ref(node)
    });
    // After a reset every handle is stale, the root excepted.
    c.cache_finished_req(&mut req, FinishKind::Aborted).unwrap();
    let m = c.match_prefix(KeyRef::new(&SHARED), &mut out).unwrap();
    c.reset().unwrap();
    c.take_events();
    unchanged(&mut c, CacheError::StaleNode(m.last_device), |c| {
        c.inc_lock_ref(m.last_device)
    });
}

#[test]
fn receipts_from_another_cache() {
    let (mut c, _req) = populated();
    let mut other = cache(4, 1);
    let foreign = other.inc_lock_ref(other.tree().root()).unwrap();
    unchanged(&mut c, CacheError::StaleReceipt, |c| {
        c.dec_lock_ref(foreign)
    });
    // A receipt of `c` is rejected by `other` and `other` is unchanged too.
    let mut out = Vec::new();
    let m = c.match_prefix(KeyRef::new(&OTHER), &mut out).unwrap();
    let mine = c.inc_lock_ref(m.last_device).unwrap();
    let before = other.accounting();
    assert_eq!(other.dec_lock_ref(mine), Err(CacheError::StaleReceipt));
    assert_eq!(other.accounting(), before);
    assert_eq!(other.tree().outstanding_locks(), 1);
    // The rejected receipt was consumed: `c`'s lock stays until a reset is possible.
    assert_eq!(c.tree().outstanding_locks(), 2);
    assert_eq!(
        c.reset(),
        Err(CacheError::Busy("request rows hold cached pages"))
    );
}

#[test]
fn reset_while_busy() {
    let (mut c, mut req) = populated();
    unchanged(
        &mut c,
        CacheError::Busy("request rows hold cached pages"),
        |c| c.reset(),
    );
    c.cache_finished_req(&mut req, FinishKind::Finished)
        .unwrap();
    c.take_events();
    let mut out = Vec::new();
    let m = c.match_prefix(KeyRef::new(&OTHER), &mut out).unwrap();
    let receipt = c.inc_lock_ref(m.last_device).unwrap();
    unchanged(
        &mut c,
        CacheError::Busy("lock receipts are outstanding"),
        |c| c.reset(),
    );
    c.dec_lock_ref(receipt).unwrap();
    // A request that matched nothing still holds a row and a root lock.
    let mut fresh = RequestKv::new(RadixKey::new(vec![42; 9]));
    c.begin_request(&mut fresh).unwrap();
    c.alloc_tokens(&mut fresh, 9).unwrap();
    unchanged(
        &mut c,
        CacheError::Busy("lock receipts are outstanding"),
        |c| c.reset(),
    );
    c.cache_finished_req(&mut fresh, FinishKind::Aborted)
        .unwrap();
    c.reset().unwrap();
    let a = c.accounting();
    assert_eq!(a.free, a.total);
}

#[test]
fn page_exhaustion() {
    let mut alloc = PageAllocator::new(3).unwrap();
    let got = alloc.alloc(2).unwrap();
    assert_eq!(
        alloc.alloc(2),
        Err(CacheError::OutOfPages {
            needed: 2,
            available: 1
        })
    );
    assert_eq!((alloc.available(), alloc.owned_pages()), (1, 2));
    alloc.free(&got).unwrap();
    assert_eq!(alloc.available(), 3);

    // Through the cache: everything cached is locked by the running request or a receipt, so
    // eviction cannot help.
    let (mut c, mut req) = populated();
    let mut out = Vec::new();
    let m = c.match_prefix(KeyRef::new(&OTHER), &mut out).unwrap();
    let r1 = c.inc_lock_ref(m.last_device).unwrap();
    let m = c
        .match_prefix(
            KeyRef::with_namespace(&SHARED, &Namespace::new("t")),
            &mut out,
        )
        .unwrap();
    let r2 = c.inc_lock_ref(m.last_device).unwrap();
    assert_eq!(c.evictable_tokens(), 0);
    let free = c.pools().pages.available();
    let err = CacheError::OutOfPages {
        needed: free + 1,
        available: free,
    };
    unchanged(&mut c, err, |c| c.alloc_pages(free + 1));
    let (alloc_before, committed_before) = (req.allocated_len, req.committed_len);
    let err = CacheError::OutOfPages {
        needed: free + 1,
        available: free,
    };
    // The request has 2 tokens in its last page (2 free slots), so `4 * free + 3` more tokens
    // need `free + 1` new pages.
    unchanged(&mut c, err, |c| c.alloc_tokens(&mut req, 4 * free + 3));
    assert_eq!(
        (req.allocated_len, req.committed_len),
        (alloc_before, committed_before)
    );
    // One token less fits exactly.
    c.alloc_tokens(&mut req, 4 * free + 2).unwrap();
    assert_eq!(c.pools().pages.available(), 0);
    c.dec_lock_ref(r1).unwrap();
    c.dec_lock_ref(r2).unwrap();
    c.cache_finished_req(&mut req, FinishKind::Aborted).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn row_exhaustion() {
    let mut rows = RowPool::new(1).unwrap();
    let row = rows.alloc().unwrap();
    assert_eq!(rows.alloc(), Err(CacheError::OutOfRows { capacity: 1 }));
    assert_eq!(rows.live(), 1);
    assert_eq!(rows.pages(row).map(<[_]>::len), Ok(0));

    let (mut c, _req) = populated();
    let mut second = RequestKv::new(RadixKey::new(OTHER.to_vec()));
    c.match_request(&mut second).unwrap();
    c.begin_request(&mut second).unwrap();
    let mut third = RequestKv::new(RadixKey::new(SHARED.to_vec()));
    c.match_request(&mut third).unwrap();
    assert_eq!(third.prefix_len, 4);
    unchanged(&mut c, CacheError::OutOfRows { capacity: 2 }, |c| {
        c.begin_request(&mut third)
    });
    assert!(third.row.is_none() && third.lock.is_none());
    // The match survives: once a row frees up, begin succeeds with it.
    c.cache_finished_req(&mut second, FinishKind::Aborted)
        .unwrap();
    c.begin_request(&mut third).unwrap();
    assert_eq!(third.cache_protected_len, 4);
    c.check_invariants().unwrap();
}

#[test]
fn request_state_misuse() {
    let (mut c, mut req) = populated();
    // Commit past the allocation.
    let err = CacheError::InvalidRequestState("commit past the allocated slots or the key");
    assert_eq!(req.commit(1), Err(err.clone()));
    assert_eq!(req.committed_len, 10);

    let mut fresh = RequestKv::new(RadixKey::new(SHARED.to_vec()));
    unchanged(
        &mut c,
        CacheError::InvalidRequestState("alloc_tokens before begin_request"),
        |c| c.alloc_tokens(&mut fresh, 4),
    );
    unchanged(
        &mut c,
        CacheError::InvalidRequestState("cache_unfinished_req without a row"),
        |c| c.cache_unfinished_req(&mut fresh),
    );
    unchanged(
        &mut c,
        CacheError::InvalidRequestState("match_request on a request that already holds KV"),
        |c| c.match_request(&mut req),
    );
    unchanged(
        &mut c,
        CacheError::InvalidRequestState("begin_request called twice"),
        |c| c.begin_request(&mut req),
    );
    assert_eq!(fresh.commit(1), Err(err));
    // Commit past the key even with slots allocated.
    c.begin_request(&mut fresh).unwrap();
    c.alloc_tokens(&mut fresh, 8).unwrap();
    assert_eq!(
        fresh.commit(9),
        Err(CacheError::InvalidRequestState(
            "commit past the allocated slots or the key"
        ))
    );
    c.cache_finished_req(&mut fresh, FinishKind::Aborted)
        .unwrap();
    c.cache_finished_req(&mut req, FinishKind::Aborted).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn stale_rows() {
    let (mut c, mut req) = populated();
    let row = req.row.unwrap();
    c.cache_finished_req(&mut req, FinishKind::Aborted).unwrap();
    c.take_events();
    assert_eq!(c.pools().rows.pages(row), Err(CacheError::StaleRow(row)));
    unchanged(&mut c, CacheError::StaleRow(row), |c| {
        c.pools_mut().release_row(row)
    });
    unchanged(&mut c, CacheError::StaleRow(row), |c| {
        c.pools_mut().truncate_row(row, 0)
    });
    // A request whose row went stale behind its back cannot allocate or cache.
    let mut ghost = RequestKv::new(RadixKey::new(SHARED.to_vec()));
    ghost.row = Some(row);
    unchanged(&mut c, CacheError::StaleRow(row), |c| {
        c.alloc_tokens(&mut ghost, 1)
    });
}

#[test]
fn disabled_cache_refuses_inserts() {
    let mut c = RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: 4,
        disabled: true,
        ..Default::default()
    })
    .unwrap();
    let pages = c.alloc_pages(1).unwrap();
    let before = c.accounting();
    assert_eq!(
        c.insert(KeyRef::new(&[1; 4]), &pages, InsertOptions::default()),
        Err(CacheError::InvalidRequestState("the cache is disabled"))
    );
    assert_eq!(c.accounting(), before);
    assert_eq!(c.pools().pages.state(pages[0]), Ok(PageState::Owned));
}

#[test]
fn impossible_configurations() {
    for (p, pages, rows) in [(0, 4, 1), (4, 0, 1), (4, 4, 0)] {
        let r = RadixCache::new(RadixConfig {
            page_size: p,
            total_pages: pages,
            max_rows: rows,
            ..Default::default()
        });
        assert!(
            matches!(r, Err(CacheError::Config(_))),
            "{p} {pages} {rows}"
        );
    }
    assert!(matches!(
        DevicePools::new(0, 1, 1),
        Err(CacheError::Config(_))
    ));
    assert!(matches!(PageAllocator::new(0), Err(CacheError::Config(_))));
    assert!(matches!(RowPool::new(0), Err(CacheError::Config(_))));
}

#[test]
fn failed_allocation_evicts_nothing() {
    // Eviction could free some pages but not enough: the allocation fails up front instead of
    // flushing every evictable prefix for nothing.
    let (mut c, mut req) = populated();
    let free = c.pools().pages.available();
    let evictable_pages = c.evictable_tokens() / P;
    assert_eq!((free, evictable_pages), (10, 3));
    let n = free + evictable_pages + 1;
    let err = CacheError::OutOfPages {
        needed: n,
        available: free,
    };
    unchanged(&mut c, err.clone(), |c| c.alloc_pages(n));
    // The request's last page has 2 free slots.
    unchanged(&mut c, err, |c| c.alloc_tokens(&mut req, 4 * (n - 1) + 3));
    assert_eq!(req.allocated_len, 10);
    // Exactly what eviction can provide succeeds, evicting everything evictable.
    let pages = c.alloc_pages(n - 1).unwrap();
    assert_eq!(pages.len(), n - 1);
    assert_eq!(c.evictable_tokens(), 0);
    c.pools_mut().pages.free(&pages).unwrap();
    c.check_invariants().unwrap();
}
