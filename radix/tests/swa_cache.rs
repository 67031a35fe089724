//! `RadixCache` with sliding-window (SWA) layers: a request's life with the window rule of a
//! match, window locks, tombstones and their revival, the slide during decode, abort,
//! allocation from both pools or neither, and typed errors for bad configurations.

use radixkv_radix::{
    CacheError, ComponentAccounting, FinishKind, PageState, PrefixCache, RadixCache, RadixConfig,
    RadixKey, RequestKv, SwaConfig, TokenId,
};

const P: usize = 4;
const WINDOW: usize = 8;

fn config(kv_pages: usize, swa_pages: usize) -> RadixConfig {
    RadixConfig {
        page_size: P,
        total_pages: kv_pages,
        max_rows: 8,
        swa: Some(SwaConfig {
            window: WINDOW,
            pages: swa_pages,
        }),
        ..Default::default()
    }
}

fn cache(kv_pages: usize, swa_pages: usize) -> RadixCache {
    RadixCache::new(config(kv_pages, swa_pages)).unwrap()
}

fn swa(c: &RadixCache) -> ComponentAccounting {
    c.swa_accounting().unwrap()
}

fn audit(c: &RadixCache, running: &[&RequestKv]) {
    c.check_invariants().unwrap();
    assert!(swa(c).balanced());
    for r in running {
        c.check_request(r).unwrap();
    }
}

/// Matches and begins a request over `tokens`, then prefills the rest of them in one chunk.
fn run(c: &mut RadixCache, tokens: &[TokenId]) -> RequestKv {
    let mut r = RequestKv::new(RadixKey::new(tokens.to_vec()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    audit(c, &[&r]);
    let n = tokens.len() - r.committed_len;
    c.alloc_tokens(&mut r, n).unwrap();
    r.commit(n).unwrap();
    audit(c, &[&r]);
    r
}

/// One decode step: a new token, its slots in both pools, its KV computed, the window slid.
/// Returns the SWA pages the slide freed.
fn decode(c: &mut RadixCache, r: &mut RequestKv, token: TokenId) -> usize {
    r.append_tokens(&[token]);
    c.alloc_tokens(r, 1).unwrap();
    r.commit(1).unwrap();
    let freed = c.slide_window(r).unwrap();
    audit(c, &[r]);
    freed
}

fn finish(c: &mut RadixCache, r: &mut RequestKv) {
    c.cache_finished_req(r, FinishKind::Finished).unwrap();
    audit(c, &[]);
}

fn usable(c: &mut RadixCache, tokens: &[TokenId]) -> usize {
    let mut r = RequestKv::new(RadixKey::new(tokens.to_vec()));
    c.match_request(&mut r).unwrap().prefix_len
}

/// The node of `c`'s tree that ends the device match of `tokens` (exactly).
fn node_at(c: &mut RadixCache, tokens: &[TokenId]) -> radixkv_radix::NodeId {
    let m = c.match_prefix_into(radixkv_radix::KeyRef::new(tokens), &mut Vec::new());
    assert_eq!(m.device_len, tokens.len());
    m.last_device
}

/// A chain of three 8-token nodes `[0, 8) → [8, 16) → [16, 24)`, built by three requests.
fn chain(c: &mut RadixCache) -> Vec<TokenId> {
    let toks: Vec<TokenId> = (0..24).collect();
    for end in [8, 16, 24] {
        let mut r = run(c, &toks[..end]);
        finish(c, &mut r);
    }
    toks
}

#[test]
fn a_match_ends_only_after_a_full_live_window_and_begin_locks_just_that_window() {
    let mut c = cache(64, 64);
    let toks = chain(&mut c);
    assert_eq!(
        (swa(&c).evictable, swa(&c).request_owned),
        (6, 0),
        "every page's window KV is cached once"
    );
    let mut long = toks.clone();
    long.extend([90, 91, 92, 93]);
    assert_eq!(usable(&mut c, &long), 24);

    // The request that hits 24 tokens holds the tree's window pages of [16, 24) only, locked.
    let mut b = RequestKv::new(RadixKey::new(long.clone()));
    c.match_request(&mut b).unwrap();
    c.begin_request(&mut b).unwrap();
    assert_eq!((b.prefix_len, b.swa_evicted_len), (24, 16));
    let last = node_at(&mut c, &toks);
    assert_eq!(
        c.tree().swa_pages(last).unwrap(),
        Some(&b.swa_pages[..]),
        "the table starts with the tree's window pages"
    );
    assert!(b.lock.as_ref().unwrap().locks_swa_window());
    let a = swa(&c);
    assert_eq!(
        (a.protected, a.evictable),
        (2, 4),
        "only the window before the match end is locked"
    );
    audit(&c, &[&b]);
    // The locked window survives SWA pressure; the rest of the chain does not.
    assert_eq!(c.evict_swa(100), 4);
    assert_eq!(swa(&c).protected, 2);
    assert_eq!(
        c.tree().device_tokens(),
        24,
        "tombstoning window KV keeps the full KV"
    );
    audit(&c, &[&b]);
    c.cache_finished_req(&mut b, FinishKind::Aborted).unwrap();
    audit(&c, &[]);

    // [0, 16) are tombstones now: 24 is usable (its window [16, 24) is live), 16 is not, and
    // 8 is not either (its window [0, 8) is gone).
    assert_eq!(usable(&mut c, &long), 24);
    assert_eq!(usable(&mut c, &toks[..17]), 0);
    // Tombstone the last node too: nothing is usable although the full KV of 24 is cached.
    let (tree, _) = c.parts_mut();
    tree.evict_swa_node(last).unwrap();
    audit(&c, &[]);
    assert_eq!(usable(&mut c, &long), 0);
    assert_eq!(c.tree().device_tokens(), 24);
}

#[test]
fn a_later_request_revives_tombstones_and_a_stale_match_is_redone_at_begin() {
    let mut c = cache(64, 64);
    let toks = chain(&mut c);
    let mid = node_at(&mut c, &toks[..16]);
    let (tree, _) = c.parts_mut();
    tree.evict_swa_node(mid).unwrap();
    let mut long = toks.clone();
    long.extend([90, 91, 92, 93]);
    // The window before 24 is still live, before 16 it is not.
    assert_eq!(usable(&mut c, &long), 24);
    assert_eq!(usable(&mut c, &toks[..20]), 8);

    // Match, then the window is tombstoned before begin: begin matches again (8 tokens).
    let mut r = RequestKv::new(RadixKey::new(long.clone()));
    assert_eq!(c.match_request(&mut r).unwrap().prefix_len, 24);
    let last = node_at(&mut c, &toks);
    let (tree, _) = c.parts_mut();
    tree.evict_swa_node(last).unwrap();
    c.begin_request(&mut r).unwrap();
    assert_eq!(
        (r.prefix_len, r.swa_evicted_len, r.swa_pages.len()),
        (8, 0, 2)
    );
    audit(&c, &[&r]);
    c.alloc_tokens(&mut r, 20).unwrap();
    r.commit(20).unwrap();
    audit(&c, &[&r]);
    let before = swa(&c);
    finish(&mut c, &mut r);
    // Its window pages of [8, 24) revived the two tombstones and [24, 28) is a new node: every
    // page it owned was adopted.
    assert_eq!(c.tree().swa_pages(mid).unwrap().map(<[_]>::len), Some(2));
    assert_eq!(c.tree().swa_pages(last).unwrap().map(<[_]>::len), Some(2));
    let after = swa(&c);
    assert_eq!(after.evictable, 2 + 2 + 2 + 1);
    assert_eq!(after.request_owned, 0);
    assert_eq!(after.free, before.free + before.request_owned - 5);
    assert_eq!(usable(&mut c, &toks[..20]), 16);
    let mut longer = long.clone();
    longer.push(7);
    assert_eq!(usable(&mut c, &longer), 28);
}

#[test]
fn decode_frees_the_window_kv_that_slid_out_and_drops_the_window_lock_early() {
    let mut c = cache(64, 64);
    let toks: Vec<TokenId> = (0..16).collect();
    let mut a = run(&mut c, &toks);
    finish(&mut c, &mut a);
    let mut prompt = toks.clone();
    prompt.push(16);
    let mut b = run(&mut c, &prompt);
    assert_eq!((b.prefix_len, b.swa_evicted_len), (16, 8));
    assert_eq!(
        swa(&c).protected,
        2,
        "only the window before 16: the node of 4 pages is split at its start"
    );
    assert_eq!(
        swa(&c).evictable,
        2,
        "the KV before the window stays evictable"
    );
    assert_eq!(
        c.slide_window(&mut b).unwrap(),
        0,
        "the window still needs [8, 16)"
    );
    // Decode to 24 computed tokens: the window [16, 24) no longer reads the cached prefix.
    let mut freed = 0;
    for t in 17..24 {
        freed += decode(&mut c, &mut b, t);
    }
    assert_eq!(freed, 0, "the pages that left the window were the tree's");
    assert_eq!(b.swa_evicted_len, 16);
    assert!(!b.lock.as_ref().unwrap().locks_swa_window());
    assert_eq!(swa(&c).protected, 0, "the window lock was released early");
    assert_eq!(
        c.tree().lock_ref(b.lock.as_ref().unwrap().anchor()),
        Ok(1),
        "the full-KV lock stays"
    );
    // Decode 8 more: the request's own pages of [16, 24) slide out and are freed.
    let owned = swa(&c).request_owned;
    for t in 24..32 {
        freed += decode(&mut c, &mut b, t);
    }
    assert_eq!(freed, 2);
    assert_eq!(b.swa_evicted_len, 24);
    assert_eq!(swa(&c).request_owned, owned + 2 - 2);
    finish(&mut c, &mut b);
    // The slid-out tokens [16, 24) are a tombstone in the tree: 32 is usable, 24 is not.
    let mut next = b.key.tokens.clone();
    next.push(99);
    assert_eq!(next.len(), 33);
    assert_eq!(usable(&mut c, &next), 32);
    assert_eq!(usable(&mut c, &next[..25]), 16);
    assert_eq!(c.tree().device_tokens(), 32);
}

#[test]
fn chunked_prefill_keeps_only_the_window_and_abort_frees_everything() {
    let mut c = cache(64, 64);
    let toks: Vec<TokenId> = (0..40).collect();
    let mut r = RequestKv::new(RadixKey::new(toks.clone()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    for chunk in [12, 12, 10] {
        c.alloc_tokens(&mut r, chunk).unwrap();
        r.commit(chunk).unwrap();
        c.cache_unfinished_req(&mut r).unwrap();
        audit(&c, &[&r]);
        // The table keeps the window before the cached end and the request's own tail.
        assert_eq!(r.swa_evicted_len, r.cache_protected_len - WINDOW);
        assert!(r.lock.as_ref().unwrap().locks_swa_window());
    }
    assert_eq!(r.cache_protected_len, 32);
    assert_eq!(swa(&c).protected, 2);
    // Another request can use what the chunks cached while this one runs.
    assert_eq!(usable(&mut c, &toks[..33]), 32);
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    audit(&c, &[]);
    let (kv, w) = (c.accounting(), swa(&c));
    assert_eq!((kv.request_owned, kv.protected, kv.evictable), (0, 0, 32));
    assert_eq!((w.request_owned, w.protected, w.evictable), (0, 0, 8));
    assert_eq!(w.free, 64 - 8);
}

#[test]
fn allocation_takes_from_both_pools_or_from_neither() {
    // SWA pool short: a typed error naming it, and the full-KV pool is untouched.
    let mut c = cache(64, 4);
    let mut r = RequestKv::new(RadixKey::new((0..40).collect()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    let kv_before = c.accounting();
    assert_eq!(
        c.alloc_tokens(&mut r, 20),
        Err(CacheError::OutOfComponentPages {
            component: "swa",
            needed: 5,
            available: 4
        })
    );
    assert_eq!(c.accounting(), kv_before);
    assert_eq!((r.allocated_len, r.swa_pages.len()), (0, 0));
    audit(&c, &[&r]);
    c.alloc_tokens(&mut r, 16).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    audit(&c, &[]);

    // Full-KV pool short: OutOfPages, and the SWA pool is untouched.
    let mut c = cache(4, 64);
    let mut r = RequestKv::new(RadixKey::new((0..40).collect()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    let swa_before = swa(&c);
    assert!(matches!(
        c.alloc_tokens(&mut r, 20),
        Err(CacheError::OutOfPages { needed: 5, .. })
    ));
    assert_eq!(swa(&c), swa_before);
    assert_eq!((r.allocated_len, r.swa_pages.len()), (0, 0));
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    audit(&c, &[]);
}

#[test]
fn pressure_on_one_pool_evicts_with_the_cascade_rules() {
    // SWA pressure tombstones cached window KV and keeps its full KV.
    let mut c = cache(64, 6);
    let toks: Vec<TokenId> = (0..16).collect();
    let mut a = run(&mut c, &toks);
    finish(&mut c, &mut a);
    let mut b = run(
        &mut c,
        &[
            50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65,
        ],
    );
    assert_eq!(c.tree().device_tokens(), 16, "the full KV stays");
    assert_eq!(
        usable(
            &mut c,
            &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
        ),
        0
    );
    c.cache_finished_req(&mut b, FinishKind::Aborted).unwrap();
    audit(&c, &[]);

    // Full-KV pressure evicts a cached leaf, and its window KV with it.
    let mut c = cache(6, 64);
    let mut a = run(&mut c, &toks);
    finish(&mut c, &mut a);
    assert_eq!(swa(&c).evictable, 4);
    let mut b = run(
        &mut c,
        &[
            50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65,
        ],
    );
    assert_eq!(c.tree().device_tokens(), 0);
    let w = swa(&c);
    assert_eq!(
        (w.evictable, w.free, w.request_owned),
        (0, 60, 4),
        "the cascade"
    );
    c.cache_finished_req(&mut b, FinishKind::Aborted).unwrap();
    audit(&c, &[]);
    // And a plain evict does the same.
    let mut a = run(&mut c, &toks);
    finish(&mut c, &mut a);
    assert_eq!(c.evict(100), 16);
    assert_eq!(swa(&c).free, 64);
    audit(&c, &[]);
}

#[test]
fn bad_swa_configurations_are_typed_errors() {
    let with = |page_size: usize, window: usize, pages: usize, mamba: Option<u32>| {
        RadixCache::new(RadixConfig {
            page_size,
            total_pages: 16,
            swa: Some(SwaConfig { window, pages }),
            mamba_slots: mamba,
            ..Default::default()
        })
    };
    for (p, w, n, m, what) in [
        (4, 0, 8, None, "window 0"),
        (4, 6, 8, None, "window not a multiple of the page size"),
        (4, 8, 0, None, "no SWA pages"),
        (4, 8, u32::MAX as usize + 1, None, "too many SWA pages"),
        (
            4,
            6,
            8,
            Some(4),
            "SWA with Mamba, window not a multiple of the page size",
        ),
    ] {
        assert!(
            matches!(with(p, w, n, m), Err(CacheError::Config(_))),
            "{what}"
        );
    }
    // Both components in one tree are a valid configuration.
    let both = with(4, 8, 8, Some(4)).unwrap();
    assert!(both.mamba_accounting().is_some() && both.swa_accounting().is_some());
    let c = with(4, 8, 8, None).unwrap();
    assert!(c.has_state_slots() && c.has_window_state());
    assert_eq!(c.swa_window(), Some(8));
    assert_eq!(swa(&c).total, 8);
}

#[test]
fn slide_window_is_a_no_op_without_swa_and_an_error_without_a_row() {
    let mut kv_only = RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: 16,
        ..Default::default()
    })
    .unwrap();
    assert!(!kv_only.has_state_slots());
    assert_eq!(kv_only.swa_accounting(), None);
    let mut r = RequestKv::new(RadixKey::new((0..8).collect()));
    assert_eq!(kv_only.slide_window(&mut r), Ok(0));
    let mut c = cache(16, 16);
    assert!(matches!(
        c.slide_window(&mut r),
        Err(CacheError::InvalidRequestState(_))
    ));
    // A request's own SWA page handed to the wrong place is caught by the request audit.
    let mut r = run(&mut c, &(0..8).collect::<Vec<_>>());
    let pg = r.swa_pages[0];
    assert_eq!(c.tree().swa_pool().unwrap().state(pg), Ok(PageState::Owned));
    r.swa_pages.swap(0, 1);
    c.check_request(&r).unwrap();
    r.swa_pages.pop();
    assert!(c.check_request(&r).is_err());
    r.swa_pages.push(pg);
    r.swa_pages.swap(0, 1);
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    audit(&c, &[]);
}

#[test]
fn a_disabled_cache_still_runs_requests_with_window_kv() {
    let mut c = RadixCache::new(RadixConfig {
        disabled: true,
        ..config(16, 16)
    })
    .unwrap();
    let toks: Vec<TokenId> = (0..20).collect();
    let mut a = run(&mut c, &toks);
    assert_eq!(a.swa_pages.len(), 5);
    for t in 20..30 {
        decode(&mut c, &mut a, t);
    }
    assert_eq!(a.swa_evicted_len, 20);
    finish(&mut c, &mut a);
    let w = swa(&c);
    assert_eq!((w.free, w.evictable), (16, 0));
    assert_eq!(usable(&mut c, &toks), 0);
}

#[test]
fn a_tree_level_insert_caches_no_window_kv_until_a_request_revives_it() {
    let mut c = cache(32, 32);
    let toks: Vec<TokenId> = (0..16).collect();
    let pages = c.alloc_pages(4).unwrap();
    let r = c
        .insert(
            radixkv_radix::KeyRef::new(&toks),
            &pages,
            Default::default(),
        )
        .unwrap();
    assert_eq!(r.adopted_len, 16);
    assert_eq!(c.tree().swa_pages(r.last_node).unwrap(), None);
    audit(&c, &[]);
    let mut longer = toks.clone();
    longer.push(16);
    assert_eq!(usable(&mut c, &longer), 0, "full KV without window KV");
    // A request over the same tokens recomputes them and its window KV revives the node.
    let mut a = run(&mut c, &longer);
    assert_eq!(a.prefix_len, 0);
    finish(&mut c, &mut a);
    assert_eq!(swa(&c).evictable, 4);
    assert_eq!(usable(&mut c, &longer), 16);
}

/// The sliding-window component reads a request's whole key, so the cache refuses one that
/// dropped its cached prefix (`drop_cached_prefix`): a chunk insert is refused with nothing
/// changed, and the finish releases the request without inserting it, leaking nothing.
#[test]
fn a_key_without_its_cached_prefix_is_refused_and_released() {
    let mut c = cache(32, 32);
    assert!(!c.takes_windowed_keys());
    let history: Vec<TokenId> = (0..16).collect();
    let mut first = run(&mut c, &history);
    c.cache_finished_req(&mut first, FinishKind::Finished)
        .unwrap();
    let mut prompt = history.clone();
    prompt.extend(100..106);
    let mut r = RequestKv::new(RadixKey::new(prompt));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    assert!(r.drop_cached_prefix(usize::MAX) > 0);
    c.alloc_tokens(&mut r, 6).unwrap();
    r.commit(6).unwrap();
    assert!(matches!(
        c.cache_unfinished_req(&mut r),
        Err(CacheError::InvalidRequestState(_))
    ));
    assert!(matches!(
        c.cache_finished_req(&mut r, FinishKind::Finished),
        Err(CacheError::InvalidRequestState(_))
    ));
    assert_eq!((r.row, r.lock.is_none()), (None, true));
    audit(&c, &[]);
    assert_eq!(c.protected_tokens(), 0);
    assert_eq!(c.pools().rows.available(), 8);
}
