//! The request lifecycle of `RadixCache`, one rule per test: what a match may reuse, what a
//! prefill chunk, a finish, an abort and a retract do to the tree and the pools, eviction under
//! pressure, KV events, and each eviction policy's order.

use radixkv_radix::events::{chain_hashes, namespace_seed};
use radixkv_radix::{
    CacheError, FinishKind, InsertOptions, KeyRef, KeySeed, KvEvent, KvIdentity, Medium, Namespace,
    NodeId, PageId, PageKey, PolicyKind, PrefixCache, RadixCache, RadixConfig, RadixKey, RadixTree,
    RequestKv, TokenId,
};

fn cache_with(page_size: usize, total_pages: usize, policy: PolicyKind) -> RadixCache {
    RadixCache::new(RadixConfig {
        page_size,
        total_pages,
        max_rows: 8,
        policy,
        events: true,
        event_capacity: radixkv_radix::EventBuffer::DEFAULT_CAPACITY,
        disabled: false,
        mamba_slots: None,
        ..Default::default()
    })
    .unwrap()
}

fn cache(page_size: usize, total_pages: usize) -> RadixCache {
    cache_with(page_size, total_pages, PolicyKind::Lru)
}

fn check(c: &RadixCache) {
    c.check_invariants().unwrap();
    assert!(c.accounting().balanced(), "{:?}", c.accounting());
}

/// Runs a whole request over `tokens`: match, begin, compute everything, finish.
fn run(c: &mut RadixCache, tokens: &[TokenId], kind: FinishKind) -> usize {
    let mut r = RequestKv::new(RadixKey::new(tokens.to_vec()));
    let prefix = c.match_request(&mut r).unwrap().prefix_len;
    c.begin_request(&mut r).unwrap();
    let rest = tokens.len() - r.allocated_len;
    c.alloc_tokens(&mut r, rest).unwrap();
    r.commit(rest).unwrap();
    c.cache_finished_req(&mut r, kind).unwrap();
    check(c);
    prefix
}

fn matched(c: &mut RadixCache, tokens: &[TokenId]) -> (usize, Vec<PageId>) {
    let mut out = Vec::new();
    let m = c.match_prefix(KeyRef::new(tokens), &mut out).unwrap();
    (m.device_len, out)
}

fn request(tokens: &[TokenId]) -> RequestKv {
    RequestKv::new(RadixKey::new(tokens.to_vec()))
}

fn seq(n: u32) -> Vec<TokenId> {
    (0..n).collect()
}

#[test]
fn match_reuses_at_most_len_minus_one_tokens() {
    let mut c = cache(4, 32);
    run(&mut c, &seq(8), FinishKind::Finished);
    // The whole prompt is cached, but one token must be recomputed: that costs a page.
    assert_eq!(
        c.match_request(&mut request(&seq(8))).unwrap().prefix_len,
        4
    );
    assert_eq!(
        c.match_request(&mut request(&seq(9))).unwrap().prefix_len,
        8
    );
    assert_eq!(
        c.match_request(&mut request(&seq(1))).unwrap().prefix_len,
        0
    );
    // match_prefix has no such rule.
    assert_eq!(matched(&mut c, &seq(8)).0, 8);

    let mut c = cache(1, 32);
    run(&mut c, &seq(5), FinishKind::Finished);
    assert_eq!(
        c.match_request(&mut request(&seq(5))).unwrap().prefix_len,
        4
    );
    assert_eq!(
        c.match_request(&mut request(&seq(6))).unwrap().prefix_len,
        5
    );
}

#[test]
fn max_prefix_len_caps_the_match() {
    let mut c = cache(4, 32);
    run(&mut c, &seq(16), FinishKind::Finished);
    for (cap, expected) in [(0, 0), (3, 0), (5, 4), (8, 8), (100, 16)] {
        let mut r = request(&seq(20));
        r.max_prefix_len = Some(cap);
        assert_eq!(
            c.match_request(&mut r).unwrap().prefix_len,
            expected,
            "cap {cap}"
        );
        assert_eq!(r.prefix_pages.len() * 4, expected);
        // begin_request honours the same cap.
        c.begin_request(&mut r).unwrap();
        assert_eq!(r.cache_protected_len, expected);
        c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    }
    check(&c);
}

#[test]
fn chunked_prefill_shares_each_chunk_at_once() {
    let mut c = cache(4, 32);
    let prompt = seq(16);
    let mut a = request(&prompt);
    c.match_request(&mut a).unwrap();
    c.begin_request(&mut a).unwrap();
    // Chunk 1: 6 tokens, of which one page is complete.
    c.alloc_tokens(&mut a, 6).unwrap();
    a.commit(6).unwrap();
    c.cache_unfinished_req(&mut a).unwrap();
    assert_eq!((a.cache_protected_len, a.prefix_len), (4, 4));
    assert_eq!(c.protected_tokens(), 4);
    check(&c);

    // A concurrent request with the same prompt shares the first chunk immediately.
    let mut b = request(&prompt);
    assert_eq!(c.match_request(&mut b).unwrap().prefix_len, 4);
    c.begin_request(&mut b).unwrap();

    // Chunk 2 of A: up to 12 tokens, three pages in the tree.
    c.alloc_tokens(&mut a, 6).unwrap();
    a.commit(6).unwrap();
    c.cache_unfinished_req(&mut a).unwrap();
    assert_eq!(a.cache_protected_len, 12);
    let (len, tree_pages) = matched(&mut c, &prompt);
    assert_eq!(len, 12);
    let row_a = c.pools().rows.pages(a.row.unwrap()).unwrap().to_vec();
    assert_eq!(&row_a[..3], &tree_pages[..]);

    // B computed pages 1 and 2 itself (it matched only one): they are duplicates, freed on
    // its next cache_unfinished_req, and its row now points at A's pages.
    c.alloc_tokens(&mut b, 8).unwrap();
    b.commit(8).unwrap();
    let free_before = c.pools().pages.available();
    c.cache_unfinished_req(&mut b).unwrap();
    assert_eq!(c.pools().pages.available(), free_before + 2);
    let row_b = c.pools().rows.pages(b.row.unwrap()).unwrap().to_vec();
    assert_eq!(&row_b[..3], &tree_pages[..]);
    assert_eq!(b.cache_protected_len, 12);
    check(&c);

    c.cache_finished_req(&mut b, FinishKind::Finished).unwrap();
    c.alloc_tokens(&mut a, 4).unwrap();
    a.commit(4).unwrap();
    c.cache_finished_req(&mut a, FinishKind::Finished).unwrap();
    assert_eq!(matched(&mut c, &prompt).0, 16);
    assert_eq!(c.protected_tokens(), 0);
    assert_eq!(c.evictable_tokens(), 16);
    check(&c);
}

#[test]
fn finish_inserts_the_aligned_prefix_and_frees_the_tail() {
    let mut c = cache(4, 16);
    let mut r = request(&seq(10));
    c.begin_request(&mut r).unwrap();
    c.alloc_tokens(&mut r, 10).unwrap();
    r.commit(10).unwrap();
    assert_eq!(c.pools().pages.available(), 13);
    // Decode: two more tokens, one of them allocated but never committed.
    r.append_tokens(&[10, 11]);
    c.alloc_tokens(&mut r, 2).unwrap();
    r.commit(1).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    // 11 committed tokens: two pages cached, the third (partial) page freed.
    let a = c.accounting();
    assert_eq!((a.evictable, a.protected, a.request_owned), (8, 0, 0));
    assert_eq!(c.pools().pages.available(), 14);
    assert_eq!(c.pools().rows.live(), 0);
    assert!(r.row.is_none() && r.lock.is_none() && r.committed_len == 0);
    assert_eq!(matched(&mut c, &seq(12)).0, 8);
    check(&c);
}

#[test]
fn abort_inserts_nothing_and_frees_everything_it_owned() {
    let mut c = cache(4, 16);
    run(&mut c, &seq(8), FinishKind::Finished);
    let mut r = request(&seq(20));
    assert_eq!(c.match_request(&mut r).unwrap().prefix_len, 8);
    c.begin_request(&mut r).unwrap();
    c.alloc_tokens(&mut r, 12).unwrap();
    r.commit(12).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    assert_eq!(matched(&mut c, &seq(20)).0, 8);
    let a = c.accounting();
    assert_eq!((a.evictable, a.protected, a.request_owned), (8, 0, 0));
    assert_eq!(c.pools().pages.available(), 14);
    assert!(
        c.take_events()
            .iter()
            .all(|e| matches!(e, KvEvent::BlockStored { .. }))
    );
    check(&c);
}

#[test]
fn retract_keeps_cached_chunks_and_rematches_them() {
    let mut c = cache(4, 16);
    let prompt = seq(14);
    let mut r = request(&prompt);
    c.begin_request(&mut r).unwrap();
    c.alloc_tokens(&mut r, 10).unwrap();
    r.commit(10).unwrap();
    c.cache_unfinished_req(&mut r).unwrap();
    let chunk_pages = c.pools().rows.pages(r.row.unwrap()).unwrap()[..2].to_vec();
    // Retract (memory pressure): the request gives everything back but its cached chunk stays.
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    assert_eq!(c.pools().rows.live(), 0);
    assert_eq!(c.protected_tokens(), 0);
    assert_eq!(c.evictable_tokens(), 8);
    check(&c);
    // Re-admitted, it matches the chunk again and resumes from there.
    assert_eq!(c.match_request(&mut r).unwrap().prefix_len, 8);
    assert_eq!(r.prefix_pages, chunk_pages);
    c.begin_request(&mut r).unwrap();
    assert_eq!((r.committed_len, r.allocated_len), (8, 8));
    c.alloc_tokens(&mut r, 6).unwrap();
    r.commit(6).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    assert_eq!(matched(&mut c, &prompt).0, 12);
    check(&c);
}

#[test]
fn disabled_mode_shares_nothing() {
    let mut c = RadixCache::new(RadixConfig {
        page_size: 4,
        total_pages: 16,
        events: true,
        disabled: true,
        ..Default::default()
    })
    .unwrap();
    assert!(c.is_disabled());
    for _ in 0..3 {
        let mut r = request(&seq(10));
        assert_eq!(c.match_request(&mut r).unwrap().prefix_len, 0);
        c.begin_request(&mut r).unwrap();
        c.alloc_tokens(&mut r, 10).unwrap();
        r.commit(10).unwrap();
        c.cache_unfinished_req(&mut r).unwrap();
        assert_eq!(r.cache_protected_len, 0);
        c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
        check(&c);
    }
    assert_eq!(matched(&mut c, &seq(10)).0, 0);
    let a = c.accounting();
    assert_eq!(a.free, a.total);
    assert!(c.take_events().is_empty());
}

#[test]
fn allocation_pressure_never_evicts_a_locked_path() {
    for policy in PolicyKind::ALL {
        let mut c = cache_with(4, 10, policy);
        let locked: Vec<TokenId> = seq(8);
        run(&mut c, &locked, FinishKind::Finished);
        let mut holder = request(&[locked.as_slice(), &[99, 99]].concat());
        assert_eq!(c.match_request(&mut holder).unwrap().prefix_len, 8);
        c.begin_request(&mut holder).unwrap();
        let (_, locked_pages) = matched(&mut c, &locked);
        // Fill the rest of the pool with other cached prefixes.
        for t in 0..4u32 {
            run(&mut c, &[100 + t; 8], FinishKind::Finished);
        }
        assert_eq!(c.pools().pages.available(), 0);
        // A large request needs every unlocked page.
        let mut big = request(&[7; 32]);
        c.begin_request(&mut big).unwrap();
        c.alloc_tokens(&mut big, 32).unwrap();
        assert_eq!(c.evictable_tokens(), 0, "{policy:?}");
        assert_eq!(
            matched(&mut c, &locked),
            (8, locked_pages.clone()),
            "{policy:?}"
        );
        // One page more cannot be had without the locked path.
        assert!(c.alloc_tokens(&mut big, 1).is_err());
        assert_eq!(matched(&mut c, &locked), (8, locked_pages), "{policy:?}");
        c.cache_finished_req(&mut big, FinishKind::Aborted).unwrap();
        c.cache_finished_req(&mut holder, FinishKind::Aborted)
            .unwrap();
        check(&c);
    }
}

#[test]
fn begin_rematches_when_the_match_went_stale() {
    let mut c = cache(4, 32);
    run(&mut c, &seq(12), FinishKind::Finished);
    // Fully stale: everything the match used is evicted before begin.
    let mut r = request(&seq(13));
    assert_eq!(c.match_request(&mut r).unwrap().prefix_len, 12);
    c.evict(usize::MAX);
    c.begin_request(&mut r).unwrap();
    assert_eq!((r.prefix_len, r.cache_protected_len), (0, 0));
    assert!(r.prefix_pages.is_empty());
    check(&c);
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();

    // Partly stale: another request holds the first page, the rest is evicted.
    run(&mut c, &seq(12), FinishKind::Finished);
    let mut holder = request(&seq(5));
    c.match_request(&mut holder).unwrap();
    c.begin_request(&mut holder).unwrap();
    let mut r = request(&seq(13));
    assert_eq!(c.match_request(&mut r).unwrap().prefix_len, 12);
    c.evict(usize::MAX);
    c.begin_request(&mut r).unwrap();
    assert_eq!(r.cache_protected_len, 4);
    let (_, pages) = matched(&mut c, &seq(4));
    assert_eq!(r.prefix_pages, pages);
    assert_eq!(c.pools().rows.pages(r.row.unwrap()).unwrap(), &pages[..]);
    check(&c);
    // Still valid: begin keeps the match as is.
    let mut s = request(&seq(13));
    assert_eq!(c.match_request(&mut s).unwrap().prefix_len, 4);
    c.begin_request(&mut s).unwrap();
    assert_eq!(s.prefix_pages, pages);
    for mut q in [r, s, holder] {
        c.cache_finished_req(&mut q, FinishKind::Aborted).unwrap();
    }
    check(&c);
}

fn hashes(ns: &Namespace, tokens: &[TokenId], p: usize) -> Vec<u64> {
    let mut out = Vec::new();
    chain_hashes(namespace_seed(ns), tokens, p, &mut out);
    out
}

#[test]
fn kv_events_follow_the_lifecycle() {
    let mut c = cache(2, 32);
    let ns = Namespace::new("tenant");
    let first: Vec<TokenId> = vec![5, 6, 7, 8, 9];
    let mut r = RequestKv::new(RadixKey::with_namespace(first.clone(), ns.clone()));
    c.begin_request(&mut r).unwrap();
    c.alloc_tokens(&mut r, 5).unwrap();
    r.commit(5).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    let h = hashes(&ns, &[5, 6, 7, 8, 9, 10], 2);
    assert_eq!(
        c.take_events(),
        vec![KvEvent::BlockStored {
            page_hashes: h[..2].to_vec(),
            parent_hash: None,
            token_ids: vec![5, 6, 7, 8],
            page_size: 2,
            namespace: ns.clone(),
            medium: Medium::Device,
            page_keys: vec![],
            parent_key: None,
        }]
    );
    // An extension stores only its new page, chained to the cached one.
    let mut r = RequestKv::new(RadixKey::with_namespace(
        vec![5, 6, 7, 8, 9, 10, 11],
        ns.clone(),
    ));
    assert_eq!(c.match_request(&mut r).unwrap().prefix_len, 4);
    c.begin_request(&mut r).unwrap();
    c.alloc_tokens(&mut r, 3).unwrap();
    r.commit(3).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    assert_eq!(
        c.take_events(),
        vec![KvEvent::BlockStored {
            page_hashes: vec![h[2]],
            parent_hash: Some(h[1]),
            token_ids: vec![9, 10],
            page_size: 2,
            namespace: ns.clone(),
            medium: Medium::Device,
            page_keys: vec![],
            parent_key: None,
        }]
    );
    // The same tokens in the default namespace hash differently.
    run(&mut c, &[5, 6, 7], FinishKind::Finished);
    let ev = c.take_events();
    let default_hash = hashes(&Namespace::DEFAULT, &[5, 6], 2);
    assert!(
        matches!(&ev[..], [KvEvent::BlockStored { page_hashes, namespace, .. }]
        if *page_hashes == default_hash && namespace.is_default())
    );
    assert_ne!(default_hash[0], h[0]);
    // Eviction reports leaves first; an aborted request reports nothing.
    run(&mut c, &[40, 41, 42], FinishKind::Aborted);
    assert!(c.take_events().is_empty());
    assert_eq!(c.evict(8), 8);
    let removed: Vec<u64> = c
        .take_events()
        .into_iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved {
                page_hashes,
                namespace,
                medium: Medium::Device,
                ..
            } => {
                // Each removal names the namespace its pages were stored in.
                let want = if page_hashes.iter().all(|x| default_hash.contains(x)) {
                    Namespace::DEFAULT
                } else {
                    ns.clone()
                };
                assert_eq!(namespace, want, "{page_hashes:x?}");
                page_hashes
            }
            other => panic!("{other:?}"),
        })
        .collect();
    let mut all = h.clone();
    all.extend(&default_hash);
    assert_eq!(removed.len(), 4);
    assert!(removed.iter().all(|x| all.contains(x)));
    // A child page is always removed before its parent.
    let pos = |x: u64| removed.iter().position(|&y| y == x).unwrap();
    assert!(pos(h[2]) < pos(h[1]));
    c.reset().unwrap();
    assert_eq!(c.take_events(), vec![KvEvent::AllBlocksCleared]);
}

#[test]
fn kv_events_carry_the_storage_page_keys_when_asked() {
    let id = KvIdentity::new("model@rev", "layout");
    let mut c = RadixCache::new(RadixConfig {
        page_size: 2,
        total_pages: 32,
        events: true,
        event_page_keys: Some(id.clone()),
        ..Default::default()
    })
    .unwrap();
    let ns = Namespace::new("tenant");
    let keys = KeySeed::new(&ns, &id).chain(&[1, 2, 3, 4, 5, 6, 7, 8], 2);
    let seq = |t: &[TokenId]| RadixKey::with_namespace(t.to_vec(), ns.clone());
    // A first sequence of three pages (and a partial one), then one that splits it after its
    // first page and grows a branch of its own.
    for tokens in [&[1, 2, 3, 4, 5, 6, 7][..], &[1, 2, 9, 9, 9]] {
        let mut r = RequestKv::new(seq(tokens));
        c.match_request(&mut r).unwrap();
        c.begin_request(&mut r).unwrap();
        let n = tokens.len() - r.allocated_len;
        c.alloc_tokens(&mut r, n).unwrap();
        r.commit(n).unwrap();
        c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
        c.check_invariants().unwrap();
    }
    let branch = KeySeed::new(&ns, &id).chain(&[1, 2, 9, 9], 2);
    let ev = c.take_events();
    let stored: Vec<_> = ev
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored {
                page_keys,
                parent_key,
                page_hashes,
                ..
            } => {
                assert_eq!(page_keys.len(), page_hashes.len());
                (page_keys.clone(), *parent_key)
            }
            other => panic!("{other:?}"),
        })
        .collect();
    // The keys are the storage chain's, and a branch chains from the page it hangs under.
    assert_eq!(
        stored,
        vec![(keys[..3].to_vec(), None), (vec![branch[1]], Some(keys[0]))]
    );
    assert_ne!(branch[1], keys[1]);
    // Keys travel as hex; a tree without keys leaves the fields out.
    let json = serde_json::to_value(&ev[1]).unwrap();
    assert_eq!(json["parent_key"], keys[0].to_hex());
    assert_eq!(json["page_keys"][0], branch[1].to_hex());
    let back: KvEvent = serde_json::from_value(json).unwrap();
    assert_eq!(back, ev[1]);
    let mut plain = cache(2, 8);
    run(&mut plain, &[1, 2], FinishKind::Finished);
    let json = serde_json::to_value(&plain.take_events()[0]).unwrap();
    assert!(
        json.get("page_keys").is_none() && json.get("parent_key").is_none(),
        "{json}"
    );
    // Removals name the keys of the removed pages: every stored page, once.
    assert_eq!(c.evict(8), 8);
    let mut removed: Vec<PageKey> = c
        .take_events()
        .into_iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved { page_keys, .. } => page_keys,
            other => panic!("{other:?}"),
        })
        .collect();
    removed.sort();
    let mut want = vec![keys[0], keys[1], keys[2], branch[1]];
    want.sort();
    assert_eq!(removed, want);
}

#[test]
fn event_page_keys_are_refused_without_events_or_on_a_used_tree() {
    let id = KvIdentity::new("m", "l");
    let err = RadixCache::new(RadixConfig {
        events: false,
        event_page_keys: Some(id.clone()),
        ..Default::default()
    })
    .unwrap_err();
    assert!(matches!(err, CacheError::Config(_)), "{err:?}");
    let mut t = RadixTree::new(2, PolicyKind::Lru, true).unwrap();
    let mut replaced = Vec::new();
    t.insert(
        KeyRef::new(&[1, 2]),
        &mut [PageId(0)],
        &mut replaced,
        InsertOptions::default(),
    )
    .unwrap();
    let err = t.set_event_page_keys(Some(id)).unwrap_err();
    assert!(matches!(err, CacheError::Config(_)), "{err:?}");
    assert!(t.event_page_keys().is_none());
}

fn insert_leaf(c: &mut RadixCache, t: TokenId, priority: i32) -> NodeId {
    let pages = c.alloc_pages(1).unwrap();
    let opts = InsertOptions {
        priority,
        chunked: false,
    };
    let r = c.insert(KeyRef::new(&[t; 4]), &pages, opts).unwrap();
    c.pools_mut().pages.free(&r.duplicates).unwrap();
    r.last_node
}

/// Inserts three one-page leaves A, B, C (priorities 1, 2, 0), re-inserts A twice (two reuse
/// hits) and matches C; returns the order in which single-leaf evictions remove them.
fn eviction_order(policy: PolicyKind) -> Vec<char> {
    let mut c = cache_with(4, 16, policy);
    let a = insert_leaf(&mut c, 1, 1);
    let b = insert_leaf(&mut c, 2, 2);
    let cc = insert_leaf(&mut c, 3, 0);
    insert_leaf(&mut c, 1, 0);
    insert_leaf(&mut c, 1, 0);
    matched(&mut c, &[3; 4]);
    check(&c);
    let mut order = Vec::new();
    while c.evict(1) > 0 {
        for (id, name) in [(a, 'A'), (b, 'B'), (cc, 'C')] {
            if !c.tree().contains(id) && !order.contains(&name) {
                order.push(name);
            }
        }
        check(&c);
    }
    order
}

#[test]
fn each_policy_evicts_in_its_order() {
    let expected = [
        // Oldest access first: B (insert), A (re-insert), C (match).
        (PolicyKind::Lru, "BAC"),
        (PolicyKind::Mru, "CAB"),
        // Fewest reuse hits first, ties by recency.
        (PolicyKind::Lfu, "BCA"),
        (PolicyKind::Fifo, "ABC"),
        (PolicyKind::Filo, "CBA"),
        // Lowest priority first.
        (PolicyKind::Priority, "CAB"),
        // A was reused twice: protected behind the probationary B and C.
        (PolicyKind::Slru, "BCA"),
        // A and C were visited: the hand spares each once.
        (PolicyKind::Sieve, "BAC"),
        // Nothing evicted yet, so no residence time to credit: LRU order.
        (PolicyKind::Reuse, "BAC"),
    ];
    assert_eq!(expected.len(), PolicyKind::ALL.len());
    for (policy, order) in expected {
        let got: String = eviction_order(policy).into_iter().collect();
        assert_eq!(got, order, "{policy:?}");
    }
}

#[test]
fn reinsert_updates_the_policy_order() {
    // Raising a leaf's priority (or reuse count) by re-inserting it must reorder it for
    // eviction, not only change its stored metadata.
    let mut c = cache_with(4, 16, PolicyKind::Priority);
    let a = insert_leaf(&mut c, 1, 0);
    let b = insert_leaf(&mut c, 2, 1);
    insert_leaf(&mut c, 1, 5);
    assert_eq!(c.tree().meta(a).unwrap().priority, 5);
    assert_eq!(c.evict(1), 4);
    assert!(
        c.tree().contains(a),
        "the priority-5 leaf was evicted before the priority-1 one"
    );
    assert!(!c.tree().contains(b));
    check(&c);
}

#[test]
fn a_row_is_given_room_for_its_whole_key_at_begin_and_never_regrows() {
    let mut c = cache(4, 256);
    // A cached prefix of 8 tokens, then a request over 40 prompt tokens with room for 24
    // output tokens in its key's buffer: 64 tokens, 16 pages.
    run(&mut c, &seq(8), FinishKind::Finished);
    let mut tokens = Vec::with_capacity(64);
    tokens.extend(seq(40));
    let mut r = RequestKv::new(RadixKey::new(tokens));
    assert_eq!(c.match_request(&mut r).unwrap().prefix_len, 8);
    c.begin_request(&mut r).unwrap();
    let row = r.row.unwrap();
    let table = c.pools().rows.pages(row).unwrap().as_ptr();
    assert_eq!(c.pools().rows.pages(row).unwrap().len(), 2);
    // The prompt in two chunks, then decode to the end of the key's room: the page table is
    // the one allocation it got at begin.
    for n in [16, 16] {
        c.alloc_tokens(&mut r, n).unwrap();
        r.commit(n).unwrap();
        c.cache_unfinished_req(&mut r).unwrap();
    }
    for t in 0..24 {
        r.key.tokens.push(1000 + t);
        c.alloc_tokens(&mut r, 1).unwrap();
        r.commit(1).unwrap();
    }
    assert_eq!(r.key.tokens.capacity(), 64, "the key itself did not grow");
    assert_eq!(c.pools().rows.pages(row).unwrap().len(), 16);
    assert_eq!(c.pools().rows.pages(row).unwrap().as_ptr(), table);
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    check(&c);
}

/// A request that drops the tokens the tree holds for it (`drop_cached_prefix`) after its
/// admission and after a chunk runs and finishes exactly as one that keeps its whole key: the
/// same tree, the same pages, the same accounting. What it holds falls to its uncached tokens.
#[test]
fn a_request_without_its_cached_prefix_finishes_as_one_with_its_whole_key() {
    let (mut whole, mut window) = (cache(4, 64), cache(4, 64));
    let history = seq(24);
    for c in [&mut whole, &mut window] {
        run(c, &history, FinishKind::Finished);
    }
    let mut prompt = history.clone();
    prompt.extend(100..110);
    let mut reqs = Vec::new();
    for (c, drop) in [(&mut whole, false), (&mut window, true)] {
        let mut r = request(&prompt);
        r.key.tokens.reserve_exact(3);
        assert_eq!(c.match_request(&mut r).unwrap().prefix_len, 24);
        // Nothing to drop before the request holds its lock.
        assert_eq!(r.drop_cached_prefix(usize::MAX), 0);
        c.begin_request(&mut r).unwrap();
        if drop {
            assert_eq!(r.drop_cached_prefix(usize::MAX), 24);
            assert_eq!((r.key_start, r.key.len(), r.key_len()), (24, 10, 34));
            // Its room for the output stays.
            assert!(r.key.tokens.capacity() >= 13);
        }
        c.alloc_tokens(&mut r, 10).unwrap();
        r.commit(10).unwrap();
        c.cache_unfinished_req(&mut r).unwrap();
        assert_eq!(r.cache_protected_len, 32);
        if drop {
            // Never past `upto`: a caller keeps what no source could give back.
            assert_eq!(r.drop_cached_prefix(30), 6);
            assert_eq!(r.drop_cached_prefix(usize::MAX), 2);
            assert_eq!(r.key.tokens, vec![108, 109]);
        }
        for t in [7, 8, 9] {
            r.append_tokens(&[t]);
            c.alloc_tokens(&mut r, 1).unwrap();
            r.commit(1).unwrap();
        }
        c.check_request(&r).unwrap();
        check(c);
        c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
        check(c);
        reqs.push(r);
    }
    let mut seq_all = prompt.clone();
    seq_all.extend([7, 8, 9]);
    assert_eq!(
        matched(&mut whole, &seq_all),
        matched(&mut window, &seq_all)
    );
    assert_eq!(matched(&mut window, &seq_all).0, 36);
    assert_eq!(whole.accounting(), window.accounting());
    assert_eq!(whole.tree().node_count(), window.tree().node_count());

    // A key without its leading tokens cannot be matched or begun again.
    let r = &mut reqs[1];
    assert_eq!(r.key_start, 32);
    assert!(matches!(
        window.match_request(r),
        Err(CacheError::InvalidRequestState(_))
    ));
    assert!(matches!(
        window.begin_request(r),
        Err(CacheError::InvalidRequestState(_))
    ));
    check(&window);
}
