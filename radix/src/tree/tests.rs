use super::*;
use crate::page_hash::PageHashes;
use crate::types::RadixKey;

fn pages(range: std::ops::Range<u32>) -> Vec<PageId> {
    range.map(PageId).collect()
}

fn tree(p: usize) -> RadixTree {
    RadixTree::new(p, PolicyKind::Lru, true).unwrap()
}

fn ins(t: &mut RadixTree, toks: &[u32], pg: &mut [PageId]) -> (TreeInsert, Vec<PageId>) {
    let mut rep = Vec::new();
    let r = t
        .insert(KeyRef::new(toks), pg, &mut rep, InsertOptions::default())
        .unwrap();
    t.check().unwrap();
    (r, rep)
}

/// A seeded xorshift draw below `n`, for the randomized tests.
fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |n| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    }
}

fn matched(t: &mut RadixTree, toks: &[u32]) -> (TreeMatch, Vec<PageId>) {
    let mut out = Vec::new();
    let m = t.match_prefix(KeyRef::new(toks), &mut out);
    t.check().unwrap();
    (m, out)
}

#[test]
fn insert_then_match_whole_and_partial() {
    let mut t = tree(2);
    let mut pg = pages(0..4);
    let (r, rep) = ins(&mut t, &[1, 2, 3, 4, 5, 6, 7, 8], &mut pg);
    assert_eq!((r.prefix_len, r.adopted_len), (0, 8));
    assert!(rep.is_empty());
    assert_eq!(t.evictable_tokens(), 8);

    let (m, out) = matched(&mut t, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(m.device_len, 8);
    assert_eq!(out, pages(0..4));
    // Partial match inside the edge splits at a page boundary.
    let (m, out) = matched(&mut t, &[1, 2, 3, 4, 9, 9]);
    assert_eq!(m.device_len, 4);
    assert_eq!(out, pages(0..2));
    assert_eq!(t.node_count(), 3);
    // A mismatch inside the first page matches nothing.
    let (m, out) = matched(&mut t, &[1, 9, 3, 4]);
    assert_eq!(m.device_len, 0);
    assert!(out.is_empty());
    assert_eq!(m.last_device, t.root());
    // The partial last page of a key is ignored.
    let (m, _) = matched(&mut t, &[1, 2, 3]);
    assert_eq!(m.device_len, 2);
}

#[test]
fn duplicates_are_reported_and_canonicalised() {
    let mut t = tree(2);
    ins(&mut t, &[1, 2, 3, 4], &mut pages(0..2));
    let mut pg = vec![PageId(10), PageId(11), PageId(12)];
    let (r, rep) = ins(&mut t, &[1, 2, 3, 4, 5, 6], &mut pg);
    assert_eq!(r.prefix_len, 4);
    assert_eq!(r.adopted_len, 2);
    assert_eq!(rep, vec![PageId(10), PageId(11)]);
    assert_eq!(pg, vec![PageId(0), PageId(1), PageId(12)]);
    assert_eq!(t.evictable_tokens(), 6);
}

#[test]
fn bad_inserts_leave_the_tree_unchanged() {
    let mut t = tree(2);
    let mut rep = Vec::new();
    let o = InsertOptions::default();
    assert_eq!(
        t.insert(KeyRef::new(&[]), &mut [], &mut rep, o),
        Err(CacheError::EmptyKey)
    );
    assert!(matches!(
        t.insert(KeyRef::new(&[1, 2, 3]), &mut pages(0..2), &mut rep, o),
        Err(CacheError::Misaligned { .. })
    ));
    assert!(matches!(
        t.insert(KeyRef::new(&[1, 2, 3, 4]), &mut pages(0..1), &mut rep, o),
        Err(CacheError::LengthMismatch { .. })
    ));
    assert_eq!(t.node_count(), 1);
    t.check().unwrap();
}

#[test]
fn locks_protect_the_path_and_receipts_are_checked() {
    let mut t = tree(1);
    ins(&mut t, &[1, 2, 3], &mut pages(0..3));
    ins(&mut t, &[1, 2, 4], &mut pages(3..6));
    let (m, _) = matched(&mut t, &[1, 2, 3]);
    let r = t.inc_lock_ref(m.last_device).unwrap();
    t.check().unwrap();
    assert_eq!(t.protected_tokens(), 3); // [1,2] and [3]
    assert_eq!(t.evictable_tokens(), 1); // [4]
    let mut out = Vec::new();
    // Only the unlocked leaf can go.
    assert_eq!(t.evict(100, &mut out), 1);
    assert_eq!(out, vec![PageId(5)]);
    t.check().unwrap();
    t.dec_lock_ref(r).unwrap();
    assert_eq!(t.protected_tokens(), 0);
    assert_eq!(t.evict(100, &mut out), 3);
    assert_eq!(t.node_count(), 1);
    t.check().unwrap();
}

#[test]
fn a_paths_unlocked_tokens_are_what_its_lock_would_protect() {
    let mut t = tree(1);
    ins(&mut t, &[1, 2, 3], &mut pages(0..3));
    ins(&mut t, &[1, 2, 4, 5], &mut pages(3..7));
    ins(&mut t, &[1, 2, 4, 6], &mut pages(7..11));
    let (a, _) = matched(&mut t, &[1, 2, 3]);
    let (b, _) = matched(&mut t, &[1, 2, 4, 5]);
    // Nothing locked: the whole path of each leaf.
    assert_eq!(t.unlocked_device_tokens_on_path(a.last_device).unwrap(), 3);
    assert_eq!(t.unlocked_device_tokens_on_path(b.last_device).unwrap(), 4);
    // [1, 2] locked through `a`: only what lies below it counts for `b`, and nothing for `a`.
    let ra = t.inc_lock_ref(a.last_device).unwrap();
    assert_eq!(t.unlocked_device_tokens_on_path(a.last_device).unwrap(), 0);
    let before = t.evictable_tokens();
    let unlocked = t.unlocked_device_tokens_on_path(b.last_device).unwrap();
    assert_eq!(unlocked, 2, "[4] and [5]");
    let rb = t.inc_lock_ref(b.last_device).unwrap();
    assert_eq!(before - t.evictable_tokens(), unlocked);
    t.dec_lock_ref(rb).unwrap();
    t.dec_lock_ref(ra).unwrap();
    // The root holds nothing; a stale handle is an error.
    assert_eq!(t.unlocked_device_tokens_on_path(t.root()).unwrap(), 0);
    let mut out = Vec::new();
    t.evict(100, &mut out);
    assert!(t.unlocked_device_tokens_on_path(b.last_device).is_err());
    t.check().unwrap();
}

#[test]
fn receipts_from_other_trees_or_after_reset_are_stale() {
    let mut a = tree(1);
    let mut b = tree(1);
    ins(&mut a, &[1, 2], &mut pages(0..2));
    let (m, _) = matched(&mut a, &[1, 2]);
    let r = a.inc_lock_ref(m.last_device).unwrap();
    assert_eq!(b.dec_lock_ref(r), Err(CacheError::StaleReceipt));
    // The receipt was consumed by the failed call; the lock is still held by `a`.
    assert_eq!(a.outstanding_locks(), 1);
    let mut out = Vec::new();
    assert!(matches!(a.reset(&mut out), Err(CacheError::Busy(_))));
    a.check().unwrap();
}

#[test]
fn stale_node_handles_are_errors() {
    let mut t = tree(1);
    ins(&mut t, &[1, 2], &mut pages(0..2));
    let (m, _) = matched(&mut t, &[1, 2]);
    let mut out = Vec::new();
    t.evict(2, &mut out);
    assert_eq!(
        t.inc_lock_ref(m.last_device).unwrap_err(),
        CacheError::StaleNode(m.last_device)
    );
    // A new node in the reused slot does not answer to the old handle.
    ins(&mut t, &[7, 8], &mut pages(0..2));
    assert!(!t.contains(m.last_device));
}

#[test]
fn split_keeps_lock_anchor_valid() {
    let mut t = tree(1);
    ins(&mut t, &[1, 2, 3, 4], &mut pages(0..4));
    let (m, _) = matched(&mut t, &[1, 2, 3, 4]);
    let r = t.inc_lock_ref(m.last_device).unwrap();
    // Split the locked edge from another request.
    ins(&mut t, &[1, 2, 9], &mut pages(4..7));
    assert_eq!(t.protected_tokens(), 4);
    t.dec_lock_ref(r).unwrap();
    assert_eq!(t.protected_tokens(), 0);
    assert_eq!(t.evictable_tokens(), 5);
}

#[test]
fn namespaces_never_share_nodes() {
    let mut t = tree(1);
    let a = Namespace::new("a");
    let b = Namespace::new("b");
    let mut rep = Vec::new();
    t.insert(
        KeyRef::with_namespace(&[1, 2, 3], &a),
        &mut pages(0..3),
        &mut rep,
        InsertOptions::default(),
    )
    .unwrap();
    let mut out = Vec::new();
    let m = t.match_prefix(KeyRef::with_namespace(&[1, 2, 3], &b), &mut out);
    assert_eq!(m.device_len, 0);
    let m = t.match_prefix(KeyRef::new(&[1, 2, 3]), &mut out);
    assert_eq!(m.device_len, 0);
    let m = t.match_prefix(KeyRef::with_namespace(&[1, 2, 3], &a), &mut out);
    assert_eq!(m.device_len, 3);
    // Same tokens in another namespace are a separate subtree.
    t.insert(
        KeyRef::with_namespace(&[1, 2, 3], &b),
        &mut pages(3..6),
        &mut rep,
        InsertOptions::default(),
    )
    .unwrap();
    assert!(rep.is_empty());
    assert_eq!(t.evictable_tokens(), 6);
    t.check().unwrap();
    let _ = RadixKey::new(vec![]);
}

#[test]
fn many_children_spill_to_a_map_and_evict_cleanly() {
    let mut t = tree(2);
    for i in 0..100u32 {
        ins(&mut t, &[0, 0, i, i], &mut pages(i * 2..i * 2 + 2));
    }
    ins(&mut t, &[5, 5], &mut pages(300..301));
    for i in (0..100u32).step_by(7) {
        let (m, _) = matched(&mut t, &[0, 0, i, i]);
        assert_eq!(m.device_len, 4, "{i}");
    }
    let mut out = Vec::new();
    let n = t.evict(120, &mut out);
    assert!(n >= 120);
    t.check().unwrap();
    t.evict(usize::MAX, &mut out);
    assert_eq!(t.node_count(), 1);
    // [0, 0] is shared: 1 + 100 leaves + [5, 5].
    assert_eq!(out.len(), 102);
    t.check().unwrap();
}

#[test]
fn events_report_store_remove_and_clear() {
    let mut t = tree(2);
    ins(&mut t, &[1, 2, 3, 4], &mut pages(0..2));
    ins(&mut t, &[1, 2, 3, 4, 5, 6], &mut pages(2..5));
    let ev = t.take_events();
    assert_eq!(ev.len(), 2);
    let (
        KvEvent::BlockStored {
            page_hashes: h1,
            parent_hash: None,
            ..
        },
        KvEvent::BlockStored {
            page_hashes: h2,
            parent_hash: Some(ph),
            token_ids,
            ..
        },
    ) = (&ev[0], &ev[1])
    else {
        panic!("unexpected events {ev:?}");
    };
    assert_eq!(h1.len(), 2);
    assert_eq!(*ph, h1[1]);
    assert_eq!(h2.len(), 1);
    assert_eq!(token_ids, &vec![5, 6]);
    let mut out = Vec::new();
    t.evict(2, &mut out);
    assert_eq!(
        t.take_events(),
        vec![KvEvent::BlockRemoved {
            page_hashes: h2.clone(),
            namespace: Namespace::DEFAULT,
            medium: Medium::Device,
            page_keys: vec![],
        }]
    );
    t.reset(&mut out).unwrap();
    assert_eq!(t.take_events(), vec![KvEvent::AllBlocksCleared]);
    assert!(t.take_events().is_empty());
}

#[test]
fn split_preserves_event_hash_chain() {
    let mut t = tree(1);
    ins(&mut t, &[1, 2, 3], &mut pages(0..3));
    let first = t.take_events();
    let KvEvent::BlockStored {
        page_hashes: full, ..
    } = &first[0]
    else {
        panic!()
    };
    ins(&mut t, &[1, 2, 9], &mut pages(3..6));
    let ev = t.take_events();
    let KvEvent::BlockStored {
        page_hashes,
        parent_hash,
        ..
    } = &ev[0]
    else {
        panic!()
    };
    assert_eq!(*parent_hash, Some(full[1]));
    assert_eq!(page_hashes.len(), 1);
}

#[test]
fn priority_propagates_as_max() {
    let mut t = RadixTree::new(1, PolicyKind::Priority, false).unwrap();
    let mut rep = Vec::new();
    t.insert(
        KeyRef::new(&[1, 2]),
        &mut pages(0..2),
        &mut rep,
        InsertOptions {
            priority: 5,
            chunked: false,
        },
    )
    .unwrap();
    t.insert(
        KeyRef::new(&[3, 4]),
        &mut pages(2..4),
        &mut rep,
        InsertOptions {
            priority: 1,
            chunked: false,
        },
    )
    .unwrap();
    let mut out = Vec::new();
    t.evict(1, &mut out);
    assert_eq!(out, pages(2..4));
}

#[test]
fn lru_evicts_least_recent_leaf_first() {
    let mut t = tree(1);
    ins(&mut t, &[1], &mut pages(0..1));
    ins(&mut t, &[2], &mut pages(1..2));
    ins(&mut t, &[3], &mut pages(2..3));
    matched(&mut t, &[1]);
    let mut out = Vec::new();
    t.evict(2, &mut out);
    assert_eq!(out, pages(1..3));
}

#[test]
fn common_pages_rounds_down() {
    assert_eq!(common_pages(&[1, 2, 3, 4], &[1, 2, 3, 5], 2), 2);
    assert_eq!(common_pages(&[1, 2, 3, 4], &[1, 2, 3, 4, 5], 2), 4);
    assert_eq!(common_pages(&[1; 40], &[1; 40], 1), 40);
    let mut b = vec![1u32; 40];
    b[33] = 0;
    assert_eq!(common_pages(&[1; 40], &b, 1), 33);
    assert_eq!(common_pages(&[1; 40], &b, 16), 32);
}

#[test]
fn insert_from_anchor_skips_the_cached_prefix() {
    let mut t = tree(2);
    ins(&mut t, &[1, 2, 3, 4], &mut pages(0..2));
    let (m, _) = matched(&mut t, &[1, 2, 3, 4, 5, 6]);
    assert_eq!(m.device_len, 4);
    let mut rep = Vec::new();
    let o = InsertOptions::default();
    // The anchor must end exactly at the offset.
    let mut pg = vec![PageId(0), PageId(1), PageId(7)];
    assert!(matches!(
        t.insert_from(
            m.last_device,
            2,
            KeyRef::new(&[1, 2, 3, 4, 5, 6]),
            &mut pg,
            &mut rep,
            o
        ),
        Err(CacheError::InvalidRequestState(_))
    ));
    let r = t
        .insert_from(
            m.last_device,
            4,
            KeyRef::new(&[1, 2, 3, 4, 5, 6]),
            &mut pg,
            &mut rep,
            o,
        )
        .unwrap();
    assert_eq!((r.prefix_len, r.adopted_len), (4, 2));
    assert!(rep.is_empty());
    t.check().unwrap();
    let (m2, out) = matched(&mut t, &[1, 2, 3, 4, 5, 6]);
    assert_eq!(m2.device_len, 6);
    assert_eq!(out, vec![PageId(0), PageId(1), PageId(7)]);
    // The anchor's ancestors were counted as reused.
    assert_eq!(t.meta(m.last_device).unwrap().hit_count, 1);
}

/// Two trees built by the same requests: one inserts each key whole from the root
/// (`insert`), the other only the key's tokens past the request's anchor (`insert_tail`, the
/// key without its cached prefix). Every node, its pages, whether it knows its end hash (what later
/// matches by hash accept) and the results must agree, splits of the anchor's children
/// included; each tree's audit checks every end hash is its path's chain.
#[test]
fn an_insert_of_the_tail_builds_the_tree_an_insert_of_the_whole_key_builds() {
    let p = 2;
    let mut a = tree(p);
    let mut b = tree(p);
    // Each tree has its own hasher: each gets its own chain of the same pages.
    let (hasher_a, hasher_b) = (a.page_hasher(), b.page_hasher());
    let ns = Namespace::default();
    let mut rnd = xorshift(0x2545_f491_4f6c_dd1d);
    let mut next_page = 0u32;
    let (mut below_root, mut learned) = (0, 0);
    for _ in 0..2000 {
        // A small alphabet, so that keys share prefixes and split each other's nodes.
        let len = p * (1 + rnd(10) as usize);
        let key: Vec<u32> = (0..len).map(|_| rnd(2) as u32).collect();
        if rnd(6) == 0 {
            let n = rnd(8) as usize;
            let (mut oa, mut ob) = (Vec::new(), Vec::new());
            assert_eq!(a.evict(n, &mut oa), b.evict(n, &mut ob));
            assert_eq!(oa, ob);
            continue;
        }
        // Hashes for some of the key's pages (an engine hashes its prompt, not its output).
        let n = rnd(len as u64 / p as u64 + 1) as usize;
        let (mut hashes, mut hashes_b) = (hasher_a.hashes(&ns, &key), hasher_b.hashes(&ns, &key));
        hashes.truncate(n);
        hashes_b.truncate(n);
        // The request's match, cut back to some page of it: its lock anchor.
        let mut out = Vec::new();
        let m = a.match_prefix(KeyRef::new(&key).with_hashes(&hashes), &mut out);
        let mut anchor = m.last_device;
        let mut offset = m.device_len.min(len - p);
        while a.depth_tokens(anchor).unwrap() > offset {
            anchor = a.parent(anchor).unwrap().unwrap_or(a.root());
        }
        offset = a.depth_tokens(anchor).unwrap();
        let mut out_b = Vec::new();
        let m_b = b.match_prefix(KeyRef::new(&key).with_hashes(&hashes_b), &mut out_b);
        assert_eq!((m, &out), (m_b, &out_b));
        let mut pg: Vec<PageId> = out[..offset / p].to_vec();
        pg.extend((0..(len - offset) as u32 / p as u32).map(|i| PageId(next_page + i)));
        next_page += (len - offset) as u32;
        let mut pg_b = pg.clone();
        let (mut ra, mut rb) = (Vec::new(), Vec::new());
        let o = InsertOptions::default();
        let whole = KeyRef::new(&key).with_hashes(&hashes);
        let x = a.insert(whole, &mut pg, &mut ra, o).unwrap();
        let tail = KeyRef::new(&key[offset..]);
        let y = b
            .insert_tail(
                anchor,
                offset,
                tail,
                &hashes_b,
                &mut pg_b[offset / p..],
                &mut rb,
                o,
            )
            .unwrap();
        assert_eq!((x, ra, &pg), (y, rb, &pg_b), "key {key:?} from {offset}");
        below_root += usize::from(offset > 0);
        for ((i, n), (j, o)) in a.nodes.iter().zip(b.nodes.iter()) {
            assert_eq!(i, j);
            // The same nodes know their end hash (each tree's audit checks its chain).
            assert_eq!(
                (n.parent, &n.key[..], &n.pages[..], n.end_hash != 0),
                (o.parent, &o.key[..], &o.pages[..], o.end_hash != 0),
                "node {i}"
            );
        }
        learned = learned.max(a.nodes.iter().filter(|(_, n)| n.end_hash != 0).count());
        a.check().unwrap();
        b.check().unwrap();
    }
    assert!(
        below_root > 500 && learned > 10,
        "{below_root} below the root, {learned} hashes"
    );

    // The anchor must end at the offset, and the tail must be whole pages with their pages.
    let mut t = tree(2);
    let (r, _) = ins(&mut t, &[1, 2, 3, 4], &mut pages(0..2));
    let mut rep = Vec::new();
    let o = InsertOptions::default();
    let none = PageHashes::new();
    let tail = KeyRef::new(&[5, 6]);
    let mut pg = pages(7..8);
    assert!(matches!(
        t.insert_tail(r.last_node, 2, tail, &none, &mut pg, &mut rep, o),
        Err(CacheError::InvalidRequestState(_))
    ));
    assert!(matches!(
        t.insert_tail(
            r.last_node,
            4,
            KeyRef::new(&[5]),
            &none,
            &mut pg,
            &mut rep,
            o
        ),
        Err(CacheError::Misaligned { .. })
    ));
    assert!(matches!(
        t.insert_tail(t.root(), 0, KeyRef::new(&[]), &none, &mut [], &mut rep, o),
        Err(CacheError::EmptyKey)
    ));
    let y = t
        .insert_tail(r.last_node, 4, tail, &none, &mut pg, &mut rep, o)
        .unwrap();
    assert_eq!((y.prefix_len, y.adopted_len), (4, 2));
    t.check().unwrap();
    assert_eq!(
        matched(&mut t, &[1, 2, 3, 4, 5, 6]).1,
        vec![PageId(0), PageId(1), PageId(7)]
    );
}

/// Two trees built by the same operations: one matches (and tier-walks) every key from the
/// root, the other from a hint on the key's path (an earlier match of a prefix of it). The
/// results, the splits and the access order (which the evictions read back) must agree.
#[test]
fn hinted_walks_equal_the_walks_from_the_root() {
    let mut a = tree(2);
    let mut b = tree(2);
    let mut rnd = xorshift(0x9e37_79b9_7f4a_7c15);
    let (mut next_page, mut next_host) = (0u32, 0u32);
    let (mut hinted, mut host_hits) = (0, 0);
    for _ in 0..3000 {
        // A small alphabet, so that keys share prefixes and split each other's nodes.
        let len = 2 * (1 + rnd(10) as usize);
        let key: Vec<u32> = (0..len).map(|_| rnd(2) as u32).collect();
        match rnd(5) {
            0 => {
                let mut pg: Vec<PageId> =
                    (0..len as u32 / 2).map(|i| PageId(next_page + i)).collect();
                next_page += len as u32 / 2;
                let mut pg_b = pg.clone();
                let (mut ra, mut rb) = (Vec::new(), Vec::new());
                let o = InsertOptions::default();
                let x = a.insert(KeyRef::new(&key), &mut pg, &mut ra, o).unwrap();
                let y = b.insert(KeyRef::new(&key), &mut pg_b, &mut rb, o).unwrap();
                assert_eq!((x, ra), (y, rb));
            }
            1 => {
                let n = rnd(8) as usize;
                let (mut oa, mut ob) = (Vec::new(), Vec::new());
                assert_eq!(a.evict(n, &mut oa), b.evict(n, &mut ob));
                assert_eq!(oa, ob, "the access order differs");
            }
            2 => {
                // Back the key's path up, then demote its deepest node: host-only KV.
                let walk = a.tier_walk(KeyRef::new(&key));
                for &n in &walk.nodes {
                    if a.host_pages(n).unwrap().is_none() && a.on_device(n).unwrap() {
                        let k = a.device_pages(n).unwrap().len() as u32;
                        let host: Vec<u32> = (next_host..next_host + k).collect();
                        next_host += k;
                        a.set_host_pages(n, host.clone()).unwrap();
                        b.set_host_pages(n, host).unwrap();
                    }
                }
                if let Some(&last) = walk.nodes.last() {
                    let (mut oa, mut ob) = (Vec::new(), Vec::new());
                    let x = a.evict_device(last, &mut oa);
                    let y = b.evict_device(last, &mut ob);
                    assert_eq!((x, oa), (y, ob));
                }
            }
            _ => {
                let k = 2 * rnd(len as u64 / 2 + 1) as usize;
                let (mut oa, mut ob) = (Vec::new(), Vec::new());
                let h = a.match_prefix(KeyRef::new(&key[..k]), &mut oa);
                assert_eq!(h, b.match_prefix(KeyRef::new(&key[..k]), &mut ob));
                let (mut oa, mut ob) = (Vec::new(), Vec::new());
                let x = a.match_prefix(KeyRef::new(&key), &mut oa);
                let y = b.match_prefix_from(h.last_node, KeyRef::new(&key), &mut ob);
                assert_eq!((x, oa), (y, ob), "key {key:?} hint at {k}");
                hinted += usize::from(h.last_node != b.root());
                host_hits += usize::from(x.host_len > 0);
                let depth = b.depth_tokens(h.last_node).unwrap();
                assert_eq!(
                    a.tier_walk(KeyRef::new(&key)),
                    b.tier_walk_from(h.last_node, depth, KeyRef::new(&key))
                );
                // And from the anchor with only the tokens past it (a released prompt's key).
                let tail = KeyRef::new(&key[depth..]);
                let no_hashes = crate::page_hash::PageHashes::new();
                assert_eq!(
                    a.tier_walk(KeyRef::new(&key)),
                    b.tier_walk_tail(h.last_node, depth, tail, &no_hashes)
                        .unwrap()
                );
            }
        }
        a.check().unwrap();
        b.check().unwrap();
    }
    assert!(
        hinted > 100 && host_hits > 10,
        "{hinted} hinted, {host_hits} host hits"
    );

    // Hints that cannot be on the key's path are ignored: a stale node, one deeper than the
    // key, one whose last page differs from the key's at its depth.
    let mut t = tree(2);
    let (r, _) = ins(&mut t, &[1, 2, 3, 4, 5, 6], &mut pages(0..3));
    let deep = r.last_node;
    ins(&mut t, &[7, 8], &mut pages(3..4));
    let (other, _) = matched(&mut t, &[7, 8]);
    let mut out = Vec::new();
    let m = t.match_prefix_from(deep, KeyRef::new(&[1, 2, 3, 4]), &mut out);
    assert_eq!((m.device_len, out.len()), (4, 2), "deeper than the key");
    out.clear();
    let m = t.match_prefix_from(other.last_node, KeyRef::new(&[1, 2, 3, 4]), &mut out);
    assert_eq!((m.device_len, out.len()), (4, 2), "another branch");
    // The same tokens in another namespace: the key's own path, not the hint's pages.
    let x = Namespace::new("x");
    let mut rep = Vec::new();
    let in_x = t
        .insert(
            KeyRef::with_namespace(&[1, 2, 3, 4], &x),
            &mut pages(10..12),
            &mut rep,
            InsertOptions::default(),
        )
        .unwrap()
        .last_node;
    out.clear();
    let m = t.match_prefix_from(in_x, KeyRef::new(&[1, 2, 3, 4]), &mut out);
    assert_eq!((m.device_len, out), (4, pages(0..2)), "another namespace");
    let mut out = Vec::new();
    let mut freed = Vec::new();
    t.evict(100, &mut freed);
    ins(&mut t, &[1, 2, 3, 4], &mut pages(4..6));
    assert!(!t.contains(deep));
    out.clear();
    let m = t.match_prefix_from(deep, KeyRef::new(&[1, 2, 3, 4, 5, 6]), &mut out);
    assert_eq!((m.device_len, out.len()), (4, 2), "stale");
    // A tail walk has no whole key to fall back on: a stale anchor, one that does not end at
    // the offset, and one in another namespace are errors.
    let no_hashes = crate::page_hash::PageHashes::new();
    assert!(matches!(
        t.tier_walk_tail(deep, 4, KeyRef::new(&[5, 6]), &no_hashes),
        Err(CacheError::StaleNode(_))
    ));
    let (four, _) = matched(&mut t, &[1, 2, 3, 4]);
    assert!(matches!(
        t.tier_walk_tail(four.last_node, 2, KeyRef::new(&[3, 4]), &no_hashes),
        Err(CacheError::InvalidRequestState(_))
    ));
    let ns = Namespace::new("other");
    assert!(matches!(
        t.tier_walk_tail(
            four.last_node,
            4,
            KeyRef::with_namespace(&[5, 6], &ns),
            &no_hashes
        ),
        Err(CacheError::InvalidRequestState(_))
    ));
    let walk = t
        .tier_walk_tail(four.last_node, 4, KeyRef::new(&[5, 6]), &no_hashes)
        .unwrap();
    assert_eq!(walk, t.tier_walk(KeyRef::new(&[1, 2, 3, 4, 5, 6])));
    assert_eq!(walk.device_len, 4);
    t.check().unwrap();
}

#[test]
fn recycled_page_lists_are_held_to_a_sixteenth_of_the_token_bound() {
    let mut pool = BufferPool::default();
    for _ in 0..1000 {
        pool.recycle(Vec::with_capacity(4096), Vec::with_capacity(4096));
    }
    let tokens = Recycled::<TokenId, 0>::MAX_ELEMENTS;
    assert_eq!(pool.tokens.elements, tokens);
    assert_eq!(pool.pages.elements, tokens >> 4);
    // Reuse takes a kept list of the right size back out of the count.
    let v = pool.pages(&[PageId(1); 3000]);
    assert_eq!(v.capacity(), 4096);
    assert_eq!(pool.pages.elements, (tokens >> 4) - 4096);
}

#[test]
fn recycled_buffers_are_found_by_size_whatever_order_they_were_freed_in() {
    let mut pool = Recycled::<TokenId, 0>::default();
    for cap in [100, 5000, 300, 40_000] {
        pool.put(Vec::with_capacity(cap));
    }
    assert_eq!((pool.buffers, pool.elements), (4, 45_400));
    // Each edge finds the buffer of its size, not only the last one freed.
    assert_eq!(pool.take(&[7; 90]).capacity(), 100);
    assert_eq!(pool.take(&[7; 2600]).capacity(), 5000);
    // A long edge's buffer is kept too (up to a quarter of the bound).
    assert_eq!(pool.take(&[7; 30_000]).capacity(), 40_000);
    // A buffer more than twice the edge is left for a longer one.
    let small = pool.take(&[7; 100]);
    assert_eq!(small.capacity(), 100, "a new buffer, exactly the edge");
    assert_eq!((pool.buffers, pool.elements), (1, 300));
    assert_eq!(small, vec![7; 100]);
    // Past a quarter of the bound, a buffer is not kept.
    pool.put(Vec::with_capacity(
        Recycled::<TokenId, 0>::MAX_ELEMENTS / 4 + 1,
    ));
    assert_eq!(pool.buffers, 1);
}

#[test]
fn a_host_leaf_evicted_gives_its_token_buffer_to_the_next_edge() {
    let mut t = tree(2);
    let key: Vec<TokenId> = (0..64).collect();
    let root = t.root();
    let host: Vec<u32> = (0..32).collect();
    let r = t
        .insert_host_only(root, 0, KeyRef::new(&key), &host, &mut Vec::new())
        .unwrap();
    let before = t.bufs.tokens.elements;
    let mut freed = Vec::new();
    assert_eq!(t.evict_host_leaf(r.last_node, &mut freed).unwrap(), 64);
    assert_eq!(freed, host);
    assert_eq!(t.bufs.tokens.elements, before + 64);
    // The next edge of that size takes it.
    let other: Vec<TokenId> = (100..164).collect();
    ins(&mut t, &other, &mut pages(0..32));
    assert_eq!(t.bufs.tokens.elements, before);
    t.check().unwrap();
}
