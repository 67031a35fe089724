//! Every bad input of the public API returns its exact typed error and leaves the cache
//! unchanged: same accounting, same match results, invariants intact.

use radixkv_radix::{
    CacheError, DevicePools, EvictionPolicy, FinishKind, InsertOptions, KeyRef, LeafToken,
    Namespace, NodeId, NodeMeta, PageAllocator, PageId, PageState, PolicyKind, PoolAccounting,
    PrefixCache, RadixCache, RadixConfig, RadixKey, RadixTree, RequestKv, RowPool,
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

#[test]
fn overflowing_sizes_are_errors_and_change_nothing() {
    let (mut c, mut req) = populated();
    let lengths = |r: &RequestKv| (r.committed_len, r.allocated_len, r.key.len());
    let before = lengths(&req);
    // 10 committed + (MAX - 3) wraps to 6 in release and overflows in debug: refused as what it
    // is, a commit past the allocated slots.
    assert_eq!(
        req.commit(usize::MAX - 3),
        Err(CacheError::InvalidRequestState(
            "commit past the allocated slots or the key"
        ))
    );
    assert_eq!(lengths(&req), before);
    unchanged(
        &mut c,
        CacheError::SizeOverflow("alloc_tokens: allocated_len + n overflows usize"),
        |c| c.alloc_tokens(&mut req, usize::MAX - 5),
    );
    assert_eq!(lengths(&req), before);
    c.check_request(&req).unwrap();
    // Counts that cannot overflow but can never be met.
    let free = c.pools().pages.available();
    let out_of_pages = CacheError::OutOfPages {
        needed: usize::MAX,
        available: free,
    };
    unchanged(&mut c, out_of_pages.clone(), |c| c.alloc_pages(usize::MAX));
    unchanged(&mut c, out_of_pages.clone(), |c| c.make_room(usize::MAX));
    unchanged(&mut c, out_of_pages.clone(), |c| {
        c.pools_mut().pages.alloc(usize::MAX)
    });
    let row_pages = c.pools().rows.pages(req.row.unwrap()).unwrap().len();
    let huge = CacheError::OutOfPages {
        needed: (req.allocated_len + usize::MAX / 2).div_ceil(P) - row_pages,
        available: free,
    };
    unchanged(&mut c, huge, |c| c.alloc_tokens(&mut req, usize::MAX / 2));
    unchanged(&mut c, out_of_pages, |c| {
        c.pools_mut().pages.alloc_into(usize::MAX, &mut Vec::new())
    });
    // Truncating past the end of a row frees nothing.
    unchanged(&mut c, CacheError::EmptyKey, |c| {
        c.pools_mut().truncate_row(req.row.unwrap(), usize::MAX)?;
        Err::<(), _>(CacheError::EmptyKey)
    });
    assert_eq!(lengths(&req), before);
    c.cache_finished_req(&mut req, FinishKind::Finished)
        .unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn pool_sizes_that_overflow_or_cannot_be_allocated() {
    // The token count of the pool overflows.
    assert!(matches!(
        DevicePools::new(usize::MAX / 2, 4, 1),
        Err(CacheError::Config(m)) if m.contains("overflows")
    ));
    for (pages, rows) in [(u32::MAX as usize + 1, 1), (1, u32::MAX as usize + 1)] {
        assert!(matches!(
            DevicePools::new(1, pages, rows),
            Err(CacheError::Config(_))
        ));
    }
    // Fallible allocation: a size no allocator grants is an error, not an abort.
    let e = radixkv_radix::try_with_capacity::<u64>(usize::MAX / 4, "a test table").unwrap_err();
    assert!(
        matches!(&e, CacheError::Config(m) if m.contains("cannot allocate a test table")),
        "{e}"
    );
    assert_eq!(
        radixkv_radix::try_with_capacity::<u8>(16, "x")
            .unwrap()
            .capacity(),
        16
    );
}

#[test]
fn request_lengths_past_the_row_fail_the_audit() {
    let (c, mut req) = populated();
    c.check_request(&req).unwrap();
    // What a wrapped `allocated_len` looked like: past what the row's pages hold.
    let row_tokens = c.pools().rows.pages(req.row.unwrap()).unwrap().len() * P;
    req.allocated_len = row_tokens + 1;
    let e = c.check_request(&req).unwrap_err().to_string();
    assert!(e.contains("allocated"), "{e}");
    // And a committed length past the allocation (a wrapped allocation going back to 0).
    req.allocated_len = 0;
    let e = c.check_request(&req).unwrap_err().to_string();
    assert!(e.contains("committed"), "{e}");
    // A request that never began holds nothing.
    let mut fresh = RequestKv::new(RadixKey::new(SHARED.to_vec()));
    c.check_request(&fresh).unwrap();
    fresh.allocated_len = 4;
    assert!(c.check_request(&fresh).is_err());
}

/// Answers a policy must never give, shared between a test and the [`Liar`] the tree owns.
#[derive(Debug, Default)]
struct Lies {
    /// Returned by the next pops, before any true answer.
    queue: std::collections::VecDeque<NodeId>,
    /// Returned by every pop once the queue is empty.
    forever: Option<NodeId>,
}

/// An LRU policy that answers `pop` with the lies it is told to tell.
#[derive(Debug)]
struct Liar {
    inner: Box<dyn EvictionPolicy>,
    lies: std::sync::Arc<std::sync::Mutex<Lies>>,
}

impl EvictionPolicy for Liar {
    fn name(&self) -> &'static str {
        "liar"
    }
    fn insert(&mut self, node: NodeId, meta: &NodeMeta) -> LeafToken {
        self.inner.insert(node, meta)
    }
    fn remove(&mut self, node: NodeId, token: LeafToken) {
        self.inner.remove(node, token);
    }
    fn pop(&mut self) -> Option<NodeId> {
        let mut lies = self.lies.lock().unwrap();
        lies.queue
            .pop_front()
            .or(lies.forever)
            .or_else(|| self.inner.pop())
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn clear(&mut self) {
        self.inner.clear();
    }
}

#[test]
fn a_lying_eviction_policy_is_a_typed_error_and_corrupts_nothing() {
    let lies = std::sync::Arc::new(std::sync::Mutex::new(Lies::default()));
    let liar = Liar {
        inner: PolicyKind::Lru.build(),
        lies: lies.clone(),
    };
    let mut t = RadixTree::with_policy(P, Box::new(liar), false).unwrap();
    let put = |t: &mut RadixTree, key: &[u32], first: u32| {
        let mut pages: Vec<PageId> = (first..first + (key.len() / P) as u32)
            .map(PageId)
            .collect();
        t.insert(
            KeyRef::new(key),
            &mut pages,
            &mut Vec::new(),
            InsertOptions::default(),
        )
        .unwrap()
        .last_node
    };
    // An inner node [1;4] with leaves [2;4] and [3;4]; a locked leaf [7;4]; a leaf [8;4] that
    // is evicted, leaving a stale handle.
    let a = put(&mut t, &[1, 1, 1, 1, 2, 2, 2, 2], 0);
    put(&mut t, &[1, 1, 1, 1, 3, 3, 3, 3], 2);
    let locked = put(&mut t, &[7; 4], 4);
    let receipt = t.inc_lock_ref(locked).unwrap();
    let gone = put(&mut t, &[8; 4], 5);
    t.evict_device(gone, &mut Vec::new()).unwrap();
    let mut out = Vec::new();
    let inner = t.match_prefix(KeyRef::new(&[1; 4]), &mut out).last_device;
    assert_ne!(inner, a);
    t.check().unwrap();
    let evictable = t.evictable_tokens();
    assert_eq!((evictable, t.evictable_leaves()), (12, 2));

    let bad = [gone, NodeId::detached(10_000), t.root(), inner, locked];
    for lie in bad {
        lies.lock().unwrap().queue.push_back(lie);
        assert_eq!(
            t.try_pop_victim(),
            Err(CacheError::PolicyFault {
                policy: "liar",
                node: lie
            })
        );
        // The policy was rebuilt from the tree: nothing lost, nothing evicted.
        t.check().unwrap();
        assert_eq!((t.evictable_tokens(), t.evictable_leaves()), (12, 2));
    }
    // A victim handed out twice: the second answer is a lie too.
    let v = t.try_pop_victim().unwrap().unwrap();
    lies.lock().unwrap().queue.push_back(v);
    assert_eq!(
        t.try_pop_victim(),
        Err(CacheError::PolicyFault {
            policy: "liar",
            node: v
        })
    );
    t.check().unwrap();
    // `pop_victim` skips one lie (the rebuilt policy answers truly) and keeps the fault.
    lies.lock().unwrap().queue.push_back(gone);
    let v = t.pop_victim().unwrap();
    assert_eq!(t.evict_device(v, &mut Vec::new()), Ok(4));
    assert_eq!(
        t.take_policy_fault(),
        Some(CacheError::PolicyFault {
            policy: "liar",
            node: gone
        })
    );
    assert_eq!(t.take_policy_fault(), None);
    t.check().unwrap();
    // A policy that always lies stops eviction: nothing is released, the fault is kept.
    lies.lock().unwrap().forever = Some(inner);
    let mut out = Vec::new();
    assert_eq!(t.evict(usize::MAX, &mut out), 0);
    assert!(out.is_empty());
    assert!(t.take_policy_fault().is_some());
    t.check().unwrap();
    // Told the truth again, eviction frees exactly what is unlocked.
    lies.lock().unwrap().forever = None;
    assert_eq!(t.evict(usize::MAX, &mut out), 8);
    assert_eq!((out.len(), t.evictable_tokens()), (2, 0));
    t.dec_lock_ref(receipt).unwrap();
    t.check().unwrap();
}
