//! A conformance suite every [`StorageBackend`] passes, written once: include it in a test
//! file with `#[path = "common/storage.rs"] mod storage_suite;` and call [`conformance`] (any
//! store, empty or shared) and [`conformance_cap`] (a store with a byte cap) on the store.
#![allow(dead_code)]

use radixkv_hicache::KvGeometry;
use radixkv_hicache::storage::{PageFormat, StorageBackend, StoreStats};
use radixkv_radix::{KeySeed, KvIdentity, Namespace, PageKey};

/// What the suite may assume of the store under test.
#[derive(Clone, Copy, Debug)]
pub struct Suite {
    /// Mixed into every key, so several runs (or tests sharing one server) never meet.
    pub seed: u64,
    /// The store's `pages` and `bytes` count exactly the pages it holds (a store shared with
    /// other writers, or one that cannot tell, says `false`).
    pub exact_sizes: bool,
    /// Under a cap, the store evicts exactly the least recently used page (an approximate
    /// LRU says `false`; the suite then checks only the cap and the newest page).
    pub exact_lru: bool,
}

impl Suite {
    /// Exact sizes and exact LRU, keys mixed with `seed`.
    pub fn exact(seed: u64) -> Self {
        Suite {
            seed,
            exact_sizes: true,
            exact_lru: true,
        }
    }

    /// The `i`th key of this run.
    pub fn key(&self, i: u64) -> PageKey {
        let mut h = blake3::Hasher::new();
        h.update(b"radixkv store suite");
        h.update(&self.seed.to_le_bytes());
        h.update(&i.to_le_bytes());
        PageKey(*h.finalize().as_bytes())
    }
}

/// `len` bytes that depend on `tag` at every position (so a page read from the wrong key or
/// offset never matches).
pub fn pattern(tag: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut h = blake3::Hasher::new();
    h.update(&tag.to_le_bytes());
    let mut reader = h.finalize_xof();
    out.resize(len, 0);
    reader.fill(&mut out);
    out
}

/// The counters that grow, as a difference `after - before`.
fn delta(before: StoreStats, after: StoreStats) -> (u64, u64, u64, u64) {
    (
        after.get_pages - before.get_pages,
        after.get_hits - before.get_hits,
        after.put_pages - before.put_pages,
        after.put_bytes - before.put_bytes,
    )
}

/// A page format and a chain of keys for encoded pages.
pub fn page_format() -> (PageFormat, KeySeed) {
    let id = KvIdentity::new("suite-model", "suite-layout");
    let g = KvGeometry::new(2, 4, 16).expect("a valid geometry");
    let f = PageFormat::new(g, &id, &[]).expect("a valid format");
    (f, KeySeed::new(&Namespace::DEFAULT, &id))
}

/// The store semantics every store has: prefixes with gaps, replace, delete, empty and
/// duplicate batches, counters, large pages, many pages per batch, concurrent batches and
/// encoded pages that decode after the round trip. The store need not be empty.
pub async fn conformance(store: &dyn StorageBackend, suite: &Suite) {
    let k = |i: u64| suite.key(i);
    let start = store.stats();

    // Empty batches.
    assert_eq!(store.exists_prefix(&[]).await.unwrap(), 0);
    assert!(store.get(&[]).await.unwrap().is_empty());
    assert!(store.put(&[]).await.unwrap().is_empty());
    assert_eq!(store.delete(&[]).await.unwrap(), 0);

    // A chain with a gap at 3.
    let pages: Vec<(PageKey, Vec<u8>)> = [0u64, 1, 2, 4]
        .iter()
        .map(|&i| (k(i), pattern(suite.seed ^ i, 100 + i as usize)))
        .collect();
    assert_eq!(store.put(&pages).await.unwrap(), [true; 4]);
    let chain: Vec<PageKey> = (0..6).map(k).collect();
    assert_eq!(
        store.exists_prefix(&chain).await.unwrap(),
        3,
        "stops at the gap"
    );
    assert_eq!(store.exists_prefix(&[k(3), k(0)]).await.unwrap(), 0);
    assert_eq!(store.exists_prefix(&[k(4)]).await.unwrap(), 1);
    let got = store.get(&chain).await.unwrap();
    assert_eq!(got.len(), 6);
    for (i, g) in got.iter().enumerate() {
        let want = pages.iter().find(|(key, _)| *key == k(i as u64));
        assert_eq!(g.as_ref(), want.map(|(_, b)| b), "page {i}");
    }
    // Duplicate keys in a batch each get their page.
    let dup = store.get(&[k(1), k(1)]).await.unwrap();
    assert_eq!(dup, [Some(pages[1].1.clone()), Some(pages[1].1.clone())]);
    let after = store.stats();
    let put_bytes: u64 = pages.iter().map(|(_, b)| b.len() as u64).sum();
    assert_eq!(delta(start, after), (8, 6, 4, put_bytes));
    if suite.exact_sizes {
        assert_eq!(after.pages - start.pages, 4);
        assert_eq!(after.bytes - start.bytes, put_bytes);
    }

    // Replace with a page of another length.
    let new1 = pattern(suite.seed ^ 0xabc, 37);
    assert_eq!(store.put(&[(k(1), new1.clone())]).await.unwrap(), [true]);
    assert_eq!(store.get(&[k(1)]).await.unwrap(), [Some(new1.clone())]);
    if suite.exact_sizes {
        let s = store.stats();
        assert_eq!(s.pages - start.pages, 4, "a replace adds no page");
        assert_eq!(s.bytes - start.bytes, put_bytes - 101 + 37);
    }

    // Delete: present keys count once, absent ones not at all.
    assert_eq!(store.delete(&[k(1), k(1), k(3)]).await.unwrap(), 1);
    assert_eq!(store.exists_prefix(&chain).await.unwrap(), 1);
    assert_eq!(store.get(&[k(1)]).await.unwrap(), [None]);
    assert_eq!(store.delete(&[k(0), k(2), k(4)]).await.unwrap(), 3);
    assert_eq!(store.exists_prefix(&chain).await.unwrap(), 0);
    if suite.exact_sizes {
        let s = store.stats();
        assert_eq!((s.pages, s.bytes), (start.pages, start.bytes));
    }

    // Discarding damaged pages: removed like a delete (present keys count once).
    let before = store.stats();
    store
        .put(&[(k(5), pattern(suite.seed ^ 5, 64))])
        .await
        .unwrap();
    assert_eq!(store.discard_damaged(&[k(5), k(5), k(6)]).await.unwrap(), 1);
    assert_eq!(store.get(&[k(5)]).await.unwrap(), [None]);
    assert_eq!(store.exists_prefix(&[k(5)]).await.unwrap(), 0);
    let after = store.stats();
    assert_eq!(
        after.damaged_pages - before.damaged_pages,
        1,
        "a discard is counted"
    );
    if suite.exact_sizes {
        assert_eq!((after.pages, after.bytes), (before.pages, before.bytes));
    }

    // Large pages, several per batch.
    let big: Vec<(PageKey, Vec<u8>)> = (10..13)
        .map(|i| (k(i), pattern(suite.seed ^ i, (4 << 20) + i as usize)))
        .collect();
    assert_eq!(store.put(&big).await.unwrap(), [true; 3]);
    let keys: Vec<PageKey> = big.iter().map(|(key, _)| *key).collect();
    let got = store.get(&keys).await.unwrap();
    for ((_, want), g) in big.iter().zip(&got) {
        assert!(g.as_ref() == Some(want), "a large page came back different");
    }
    assert_eq!(store.delete(&keys).await.unwrap(), 3);

    // Many pages per batch.
    let many: Vec<(PageKey, Vec<u8>)> = (100..228)
        .map(|i| (k(i), pattern(suite.seed ^ i, 256)))
        .collect();
    assert_eq!(store.put(&many).await.unwrap(), vec![true; 128]);
    let keys: Vec<PageKey> = many.iter().map(|(key, _)| *key).collect();
    assert_eq!(store.exists_prefix(&keys).await.unwrap(), 128);
    let got = store.get(&keys).await.unwrap();
    assert!(
        got.iter()
            .zip(&many)
            .all(|(g, (_, want))| g.as_ref() == Some(want))
    );

    // Concurrent batches on disjoint keys.
    let batch = |base: u64| -> Vec<(PageKey, Vec<u8>)> {
        (0..16)
            .map(|i| (k(base + i), pattern(suite.seed ^ (base + i), 512)))
            .collect()
    };
    let (a, b, c) = (batch(1000), batch(2000), batch(3000));
    let (ra, rb, rc) = tokio::join!(store.put(&a), store.put(&b), store.put(&c));
    assert_eq!(
        (ra.unwrap(), rb.unwrap(), rc.unwrap()),
        (vec![true; 16], vec![true; 16], vec![true; 16])
    );
    let ka: Vec<PageKey> = a.iter().map(|(key, _)| *key).collect();
    let kb: Vec<PageKey> = b.iter().map(|(key, _)| *key).collect();
    let (ga, gb, _) = tokio::join!(store.get(&ka), store.get(&kb), store.delete(&ka));
    // The delete may run before, during or after the get of `a`: each page is whole or gone.
    for (g, (_, want)) in ga.unwrap().iter().zip(&a) {
        assert!(g.is_none() || g.as_ref() == Some(want));
    }
    assert!(
        gb.unwrap()
            .iter()
            .zip(&b)
            .all(|(g, (_, want))| g.as_ref() == Some(want))
    );

    // Encoded pages round-trip and decode.
    let (fmt, seed) = page_format();
    let mut encoded = Vec::new();
    let mut key = seed.first(&[suite.seed as u32, 1, 2, 3]);
    for i in 0..8u32 {
        let kv = pattern(u64::from(i) ^ suite.seed, fmt.kv_bytes());
        let mut out = Vec::new();
        fmt.encode(&key, &kv, &[], &mut out).unwrap();
        encoded.push((key, out, kv));
        key = key.next(&[i, i + 1, i + 2, i + 3]);
    }
    let to_put: Vec<(PageKey, Vec<u8>)> = encoded.iter().map(|(k, b, _)| (*k, b.clone())).collect();
    assert_eq!(store.put(&to_put).await.unwrap(), vec![true; 8]);
    let keys: Vec<PageKey> = encoded.iter().map(|(k, _, _)| *k).collect();
    for ((key, _, kv), got) in encoded.iter().zip(store.get(&keys).await.unwrap()) {
        let got = got.expect("stored");
        assert_eq!(fmt.decode(key, &got).unwrap().kv, &kv[..]);
    }

    // Leave the store as it was.
    let mut all: Vec<PageKey> = keys;
    all.extend(many.iter().map(|(key, _)| *key));
    all.extend(kb);
    all.extend(c.iter().map(|(key, _)| *key));
    store.delete(&all).await.unwrap();
    if suite.exact_sizes {
        let s = store.stats();
        assert_eq!((s.pages, s.bytes), (start.pages, start.bytes));
    }
}

/// The cap of a store made with `cap` bytes (at least 4000) and empty, which counts
/// `per_page` bytes against it for each page besides the page's own (a file store's record
/// header): a page that cannot fit is refused, the store never holds more than the cap, the
/// newest page always stays, evictions are counted, and (with `exact_lru`) the least recently
/// used page goes first.
pub async fn conformance_cap(store: &dyn StorageBackend, cap: u64, per_page: u64, suite: &Suite) {
    assert!(cap >= 4000 && per_page < 500);
    let k = |i: u64| suite.key(1_000_000 + i);
    // Four pages fill the cap.
    let page = (cap / 4 - per_page) as usize;
    let start = store.stats();

    assert_eq!(
        store
            .put(&[(k(99), pattern(99, (cap - per_page) as usize + 1))])
            .await
            .unwrap(),
        [false],
        "a page over the cap is refused"
    );
    let four: Vec<(PageKey, Vec<u8>)> = (0..4).map(|i| (k(i), pattern(i, page))).collect();
    assert_eq!(store.put(&four).await.unwrap(), [true; 4]);
    let keys: Vec<PageKey> = (0..4).map(k).collect();
    assert_eq!(store.exists_prefix(&keys).await.unwrap(), 4);
    // Use page 0: page 1 is now the least recently used.
    assert_eq!(store.get(&[k(0)]).await.unwrap(), [Some(four[0].1.clone())]);
    assert_eq!(
        store.put(&[(k(4), pattern(4, page))]).await.unwrap(),
        [true]
    );
    let s = store.stats();
    assert!(
        s.evicted_pages > start.evicted_pages,
        "an eviction is counted"
    );
    assert_eq!(store.get(&[k(4)]).await.unwrap(), [Some(pattern(4, page))]);
    if suite.exact_lru {
        let got = store.get(&[k(0), k(1), k(2), k(3)]).await.unwrap();
        assert!(got[0].is_some(), "the page just used stays");
        assert!(got[1].is_none(), "the least recently used page goes");
        assert!(got[2].is_some() && got[3].is_some());
    }
    if suite.exact_sizes {
        assert!(s.bytes <= cap);
    }
    for i in 5..40 {
        let len = page / 2 + (i as usize * 37) % page;
        assert_eq!(store.put(&[(k(i), pattern(i, len))]).await.unwrap(), [true]);
        assert_eq!(
            store.get(&[k(i)]).await.unwrap(),
            [Some(pattern(i, len))],
            "the newest page stays"
        );
        if suite.exact_sizes {
            assert!(store.stats().bytes <= cap, "over the cap after page {i}");
        }
    }
    let all: Vec<PageKey> = (0..40).map(k).collect();
    store.delete(&all).await.unwrap();
}
