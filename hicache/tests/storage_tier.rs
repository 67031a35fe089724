//! The storage tier (L3) under the host tier: byte-exact round trips through a store,
//! namespace isolation, faults (a store down, hung, or returning corrupt pages), prefetch
//! termination racing the fetch, and several ranks agreeing through the consensus hook.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use radixkv_hicache::storage::{
    MemStore, PageFormat, StorageBackend, StorageTier, StoreError, StoreFuture, StoreStats,
    TierOptions,
};
use radixkv_hicache::{
    Consensus, HiCacheConfig, HiRadixCache, HostLayout, HostMemory, HostSim, HostSimConfig,
    HostSize, KvGeometry, PrefetchStatus, PrefetchStop, StorageConfig, StreamKind, WritePolicy,
};
use radixkv_radix::{
    KeyRef, KeySeed, KvIdentity, Namespace, PageKey, PrefixCache, RadixConfig, RadixKey, RequestKv,
};
use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng, SeedableRng};

fn identity() -> KvIdentity {
    KvIdentity::new("test-model", "3 layers x 8 bytes")
}

/// What a [`TestStore`] does to the operations it passes to its inner store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Mode {
    #[default]
    Healthy,
    /// Every operation fails at once.
    Down,
    /// Every operation sleeps far past any test timeout (so the tier's timeout ends it).
    Hung,
    /// Every operation waits until the mode changes, then proceeds as that mode says.
    Paused,
}

/// A store wrapper for faults: a mode, random delays, and pages to corrupt on `get`.
#[derive(Debug)]
struct TestStore {
    inner: MemStore,
    mode: Mutex<Mode>,
    /// Up to this many microseconds of random delay per operation (0: none).
    max_delay_us: u64,
    rng: Mutex<SplitMix64>,
    /// Keys whose bytes `get` returns with one byte flipped.
    corrupt: Mutex<Vec<PageKey>>,
    gets: AtomicU64,
    /// While set, `get` waits (the other operations go on).
    hold_gets: AtomicBool,
}

impl TestStore {
    fn new(seed: u64, max_delay_us: u64) -> Self {
        TestStore {
            inner: MemStore::new(),
            mode: Mutex::new(Mode::Healthy),
            max_delay_us,
            rng: Mutex::new(SplitMix64::seed_from_u64(seed)),
            corrupt: Mutex::new(Vec::new()),
            gets: AtomicU64::new(0),
            hold_gets: AtomicBool::new(false),
        }
    }

    fn set_mode(&self, m: Mode) {
        *self.mode.lock().unwrap() = m;
    }

    async fn before(&self) -> Result<(), StoreError> {
        let delay = if self.max_delay_us > 0 {
            self.rng.lock().unwrap().next_u64() % self.max_delay_us
        } else {
            0
        };
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        let mut mode = *self.mode.lock().unwrap();
        while mode == Mode::Paused {
            tokio::time::sleep(Duration::from_millis(1)).await;
            mode = *self.mode.lock().unwrap();
        }
        match mode {
            Mode::Healthy | Mode::Paused => Ok(()),
            Mode::Down => Err(StoreError::Unavailable("test store down".into())),
            Mode::Hung => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Err(StoreError::Timeout)
            }
        }
    }
}

impl StorageBackend for TestStore {
    fn name(&self) -> &'static str {
        "test"
    }

    fn exists_prefix<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            self.before().await?;
            self.inner.exists_prefix(keys).await
        })
    }

    fn get<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, Vec<Option<Vec<u8>>>> {
        Box::pin(async move {
            while self.hold_gets.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            self.before().await?;
            self.gets.fetch_add(keys.len() as u64, Ordering::Relaxed);
            let mut got = self.inner.get(keys).await?;
            let bad = self.corrupt.lock().unwrap().clone();
            for (k, v) in keys.iter().zip(&mut got) {
                if let Some(b) = v.as_mut().filter(|_| bad.contains(k)) {
                    let last = b.len() - 1;
                    b[last] ^= 0x5a;
                }
            }
            Ok(got)
        })
    }

    fn put<'a>(&'a self, pages: &'a [(PageKey, Vec<u8>)]) -> StoreFuture<'a, Vec<bool>> {
        Box::pin(async move {
            self.before().await?;
            self.inner.put(pages).await
        })
    }

    fn delete<'a>(&'a self, keys: &'a [PageKey]) -> StoreFuture<'a, usize> {
        Box::pin(async move {
            self.before().await?;
            self.inner.delete(keys).await
        })
    }

    fn stats(&self) -> StoreStats {
        self.inner.stats()
    }
}

struct Setup {
    page_size: usize,
    layout: HostLayout,
    device_pages: usize,
    host_pages: usize,
    stop: PrefetchStop,
    op_timeout: Duration,
    copy_delay: Duration,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            page_size: 4,
            layout: HostLayout::PageFirst,
            device_pages: 64,
            host_pages: 256,
            stop: PrefetchStop::WaitComplete,
            op_timeout: Duration::from_secs(5),
            copy_delay: Duration::ZERO,
        }
    }
}

fn cached(
    s: &Setup,
    store: Arc<dyn StorageBackend>,
    consensus: Option<Arc<dyn Consensus>>,
) -> HiRadixCache<HostSim> {
    let g = KvGeometry::new(LAYERS, s.page_size, BYTES_PER_TOKEN).unwrap();
    let sim = HostSimConfig {
        per_copy_delay: s.copy_delay,
        ..Default::default()
    };
    let backend = Arc::new(HostSim::new(g, s.device_pages, sim).unwrap());
    let mut storage = StorageConfig::new(store, identity());
    storage.prefetch_threshold_tokens = 1;
    storage.stop = s.stop;
    storage.tier.op_timeout = s.op_timeout;
    storage.tier.batch_pages = 3;
    let mut cfg = HiCacheConfig {
        radix: RadixConfig {
            page_size: s.page_size,
            total_pages: s.device_pages,
            max_rows: 16,
            events: true,
            ..Default::default()
        },
        host_size: HostSize::Pages(s.host_pages),
        host_layout: s.layout,
        write_policy: WritePolicy::WriteThrough,
        load_back_min_tokens: 1,
        storage: Some(storage),
        ..Default::default()
    };
    if let Some(c) = consensus {
        cfg.consensus = c;
    }
    HiRadixCache::new(cfg, backend).unwrap()
}

/// Serves `tokens` (write-through), waits for the host backup and the storage backup.
fn serve_and_store(c: &mut HiRadixCache<HostSim>, tokens: &[u32]) {
    serve(c, tokens).expect("the device holds the request");
    c.flush().unwrap();
    c.wait_storage().unwrap();
}

/// The host pool's pages are exactly the tree's plus those prefetches hold (the audit) and,
/// with no prefetch open, exactly the tree's.
fn no_leaks(c: &HiRadixCache<HostSim>) {
    c.check_invariants().unwrap();
    let tree_pages = c.device_cache().tree().host_page_count();
    let used = c.controller().host().used();
    assert_eq!(used, tree_pages, "host pages outside the tree");
}

#[test]
fn round_trip_through_the_store_is_byte_exact() {
    for page_size in [1, 16] {
        for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
            let s = Setup {
                page_size,
                layout,
                device_pages: 1024 / page_size,
                host_pages: 2048 / page_size,
                ..Default::default()
            };
            let store = Arc::new(TestStore::new(1, 0));
            let t = tokens(7, 96 + page_size / 2);
            let pages = t.len() / page_size;
            let mut a = cached(&s, store.clone(), None);
            serve_and_store(&mut a, &t);
            let st = a.stats();
            assert_eq!(
                st.backup_pages_written, pages as u64,
                "{page_size} {layout:?}"
            );
            assert_eq!(store.stats().pages, pages as u64);
            no_leaks(&a);

            // A new cache over the same store (a restarted server): device and host cold.
            let mut b = cached(&s, store.clone(), None);
            let mut longer = t.clone();
            longer.extend(tokens(8, 2 * page_size));
            let hit = prefetch_all(&mut b, 1, &longer);
            assert_eq!(hit, pages * page_size, "{page_size} {layout:?}");
            assert_eq!(b.stats().storage_hit_tokens, hit as u64);
            assert_eq!(b.stats().prefetch_pages_loaded, pages as u64);
            no_leaks(&b);
            // The request takes the host tier's load-back path; `serve` checks every byte of
            // the reused prefix on the device.
            let served = serve(&mut b, &longer).unwrap();
            assert_eq!((served.device_hit, served.host_hit), (0, hit));
            assert_eq!(served.loaded, hit);
            b.flush().unwrap();
            b.wait_storage().unwrap();
            // The loaded pages came from the store: only the new ones are backed up.
            let st = b.stats();
            assert_eq!(
                (st.backup_pages_written, st.backup_pages_skipped),
                ((longer.len() / page_size - pages) as u64, 0)
            );
            no_leaks(&b);
            // A third server computing the same prompt writes nothing: the store has it all.
            let mut c = cached(&s, store.clone(), None);
            serve_and_store(&mut c, &t);
            let st = c.stats();
            assert_eq!(
                (st.backup_pages_written, st.backup_pages_skipped),
                (0, pages as u64)
            );

            // Clearing the host of the same cache works the same way.
            b.reset().unwrap();
            assert_eq!(b.controller().host().used(), 0);
            let hit2 = prefetch_all(&mut b, 2, &longer);
            assert_eq!(hit2, (longer.len() - 1) / page_size * page_size);
            serve(&mut b, &longer).unwrap();
            b.flush().unwrap();
            no_leaks(&b);
        }
    }
}

#[test]
fn namespaces_never_load_each_others_pages() {
    let s = Setup::default();
    let store = Arc::new(TestStore::new(2, 0));
    let t = tokens(3, 40);
    let mut a = cached(&s, store.clone(), None);
    serve_and_store(&mut a, &t);
    let written = store.stats().pages;
    assert_eq!(written, 10);

    let mut b = cached(&s, store.clone(), None);
    let other = Namespace::new("tenant-b");
    assert!(b.prefetch(1, KeyRef::with_namespace(&t, &other)));
    b.wait_storage().unwrap();
    assert_eq!(
        b.check_prefetch(1).unwrap(),
        PrefetchStatus::Done { tokens: 0 }
    );
    assert_eq!(store.gets.load(Ordering::Relaxed), 0, "nothing fetched");
    assert_eq!(b.stats().prefetches_revoked, 1);
    no_leaks(&b);
    // The keys differ; the default namespace finds its pages.
    let seed_a = KeySeed::new(&Namespace::DEFAULT, &identity());
    let seed_b = KeySeed::new(&other, &identity());
    assert_ne!(seed_a.chain(&t, 4), seed_b.chain(&t, 4));
    assert_eq!(prefetch_all(&mut b, 2, &t), 36);
    // A tenant-b request does not match the default namespace's host KV either.
    let mut r = RequestKv::new(RadixKey {
        tokens: t.clone(),
        namespace: other,
    });
    let m = b.match_request(&mut r).unwrap();
    assert_eq!((m.prefix_len, m.host_hit_len), (0, 0));
}

#[test]
fn a_store_down_or_hung_degrades_to_recomputation() {
    for mode in [Mode::Down, Mode::Hung] {
        let s = Setup {
            op_timeout: Duration::from_millis(30),
            ..Default::default()
        };
        let store = Arc::new(TestStore::new(3, 0));
        store.set_mode(mode);
        let mut a = within("backups against a failing store", 60, move || {
            let mut a = cached(&s, store.clone(), None);
            let t = tokens(4, 40);
            serve_and_store(&mut a, &t);
            let st = a.stats();
            assert_eq!(st.backup_pages_written, 0);
            assert_eq!(st.backup_pages_failed, 10, "{mode:?}");
            // A prefetch finds nothing and is revoked; the request recomputes.
            let mut longer = t.clone();
            longer.extend(tokens(5, 20));
            assert_eq!(prefetch_all(&mut a, 1, &longer), 0);
            assert_eq!(a.stats().prefetches_revoked, 1);
            store.set_mode(Mode::Healthy);
            a
        });
        no_leaks(&a);
        // Everything the cache held is still served from device and host.
        a.evict(usize::MAX / 2);
        let served = serve(&mut a, &tokens(4, 40)).unwrap();
        assert_eq!(served.host_hit, 36);
        a.flush().unwrap();
        no_leaks(&a);
    }
}

#[test]
fn a_store_failing_mid_fetch_keeps_the_fetched_prefix_only() {
    let s = Setup::default();
    let store = Arc::new(TestStore::new(4, 0));
    let t = tokens(6, 48);
    let mut a = cached(&s, store.clone(), None);
    serve_and_store(&mut a, &t);
    // Page 5's stored bytes come back corrupted: the hit ends before it.
    let keys = KeySeed::new(&Namespace::DEFAULT, &identity()).chain(&t, 4);
    store.corrupt.lock().unwrap().push(keys[5]);
    let mut b = cached(&s, store.clone(), None);
    let hit = prefetch_all(&mut b, 1, &t);
    assert_eq!(hit, 5 * 4);
    let st = b.stats();
    assert_eq!(st.prefetch_pages_corrupt, 1);
    assert_eq!(st.prefetch_pages_loaded, 5);
    assert_eq!(st.prefetch_pages_revoked, 11 - 5);
    no_leaks(&b);
    // The five pages hold the right KV (checked by `serve`), the rest is recomputed.
    let served = serve(&mut b, &t).unwrap();
    assert_eq!(served.host_hit, 20);
    b.flush().unwrap();
    no_leaks(&b);
}

/// With no copy queued or in flight, a step still polls the storage tier: the backups an ack
/// queued complete through steps alone (a single-rank step with nothing to do returns at
/// once, but only without a storage tier).
#[test]
fn steps_alone_complete_storage_backups_when_no_copy_is_in_flight() {
    let s = Setup::default();
    let store = Arc::new(TestStore::new(1, 0));
    let mut a = cached(&s, store, None);
    let t = tokens(11, 64);
    serve(&mut a, &t).unwrap();
    a.flush().unwrap();
    assert!(a.controller().is_idle(), "the host backup was acknowledged");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while a.stats().storage_backups == 0 && std::time::Instant::now() < deadline {
        a.step().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        a.stats().storage_backups > 0,
        "steps never completed the storage backup: {:?}",
        a.stats()
    );
    no_leaks(&a);
}

#[test]
fn storage_backups_protect_their_host_pages_from_host_eviction() {
    // A hung store: the backup job stays in flight, so its pages stay protected.
    let s = Setup {
        op_timeout: Duration::from_secs(60),
        host_pages: 10,
        ..Default::default()
    };
    let store = Arc::new(TestStore::new(5, 0));
    store.set_mode(Mode::Hung);
    let mut a = cached(&s, store.clone(), None);
    let t = tokens(9, 40);
    serve(&mut a, &t).unwrap();
    a.flush().unwrap();
    a.step().unwrap();
    a.evict(usize::MAX / 2);
    assert_eq!(a.host_tokens(), 40);
    assert_eq!(a.evict_host(40), 0, "protected while the store backup runs");
    assert_eq!(a.host_tokens(), 40);
    // Once the store answers (here: the reset cancels the job), the pages are free again.
    a.reset().unwrap();
    no_leaks(&a);
}

/// A reset refused because a request holds KV changes nothing: a prefetch whose fetch is in
/// flight keeps its host pages and completes afterwards with the right KV. (The reset once
/// dropped the storage tier's state before the tree refused, leaking the prefetch's pages;
/// the `tier_ops` fuzz target found it.)
#[test]
fn a_refused_reset_keeps_prefetches_and_their_host_pages() {
    let s = Setup::default();
    let store = Arc::new(TestStore::new(6, 0));
    let t = tokens(12, 48);
    serve_and_store(&mut cached(&s, store.clone(), None), &t);
    let mut b = cached(&s, store.clone(), None);
    let held = tokens(13, 40);
    serve(&mut b, &held).unwrap();
    b.flush().unwrap();
    // This request's row holds cached device pages: a reset must be refused.
    let mut r = begin(&mut b, &held);
    assert_eq!(r.prefix_len, 36);
    store.hold_gets.store(true, Ordering::Relaxed);
    assert!(b.prefetch(1, KeyRef::new(&t)));
    let outside_tree = |c: &HiRadixCache<HostSim>| {
        c.controller().host().used() - c.device_cache().tree().host_page_count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while outside_tree(&b) == 0 && std::time::Instant::now() < deadline {
        b.step().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(outside_tree(&b), 11, "the fetch reserved its 11 host pages");
    assert!(b.reset().is_err(), "a request holds KV");
    b.check_invariants().unwrap();
    assert_eq!(
        outside_tree(&b),
        11,
        "the refused reset kept the reservation"
    );
    assert_eq!(b.check_prefetch(1).unwrap(), PrefetchStatus::Pending);
    store.hold_gets.store(false, Ordering::Relaxed);
    let hit = loop {
        match b.check_prefetch(1).unwrap() {
            PrefetchStatus::Done { tokens } => break tokens,
            PrefetchStatus::Pending => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the prefetch never ended"
                );
                b.step().unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
            PrefetchStatus::None => panic!("the refused reset dropped the prefetch"),
        }
    };
    assert_eq!(hit, 44);
    finish_loaded(&mut b, &mut r, &held);
    // `serve` checks every byte of the prefix the prefetch brought.
    assert_eq!(serve(&mut b, &t).unwrap().host_hit, 44);
    b.flush().unwrap();
    b.wait_storage().unwrap();
    no_leaks(&b);
    b.reset().unwrap();
    no_leaks(&b);
    assert_eq!(b.controller().host().used(), 0);
}

#[test]
fn a_node_split_while_its_storage_backup_runs_stays_consistent() {
    let s = Setup::default();
    let store = Arc::new(TestStore::new(7, 0));
    store.set_mode(Mode::Paused);
    let mut a = cached(&s, store.clone(), None);
    let t = tokens(12, 40);
    serve(&mut a, &t).unwrap();
    a.flush().unwrap();
    a.step().unwrap();
    assert_eq!(a.storage_tier().unwrap().in_flight(), 1);
    // A request sharing the first 20 tokens splits the node being backed up.
    let mut other = t[..20].to_vec();
    other.extend(tokens(13, 20));
    serve(&mut a, &other).unwrap();
    a.flush().unwrap();
    a.step().unwrap();
    a.evict(usize::MAX / 2);
    // Only the other request's own leaf may go: the split-off head has a protected child.
    a.evict_host(usize::MAX / 2);
    assert_eq!(
        a.device_cache().tree().tier_walk(KeyRef::new(&t)).host_len,
        40,
        "the protected path stays on the host"
    );
    a.check_invariants().unwrap();
    store.set_mode(Mode::Healthy);
    a.wait_storage().unwrap();
    assert_eq!(a.stats().storage_backups, 2);
    assert_eq!(store.stats().pages, 10 + 5);
    // The pages stored under the split node's keys are the right ones.
    let mut b = cached(&s, store.clone(), None);
    assert_eq!(prefetch_all(&mut b, 1, &t), 36);
    serve(&mut b, &t).unwrap();
    // The match ends inside the node of `t`, so the prefetch starts at the root; the shared
    // 20 tokens are on the host already and keep their pages.
    let before = b.controller().host().used();
    assert_eq!(prefetch_all(&mut b, 2, &other), 36);
    assert_eq!(b.controller().host().used(), before + 4);
    serve(&mut b, &other).unwrap();
    b.flush().unwrap();
    no_leaks(&b);
    a.evict_host(usize::MAX / 2);
    no_leaks(&a);
    assert_eq!(a.host_tokens(), 0, "unprotected once the backups completed");
}

#[test]
fn engine_cancel_stops_writes_at_the_returned_prefix() {
    // Direct test of the gate: after `cancel` returns n, pages n.. are never written.
    let g = KvGeometry::new(LAYERS, 2, BYTES_PER_TOKEN).unwrap();
    let store = Arc::new(TestStore::new(6, 400));
    let format = PageFormat::new(g, &identity(), &[]).unwrap();
    let seed = KeySeed::new(&Namespace::DEFAULT, &identity());
    let t = tokens(11, 64);
    let keys = seed.chain(&t, 2);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut kv = vec![0u8; format.kv_bytes()];
    let mut pages = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        for (j, b) in kv.iter_mut().enumerate() {
            *b = (i * 7 + j) as u8 | 1;
        }
        let mut out = Vec::new();
        format.encode(k, &kv, &[], &mut out).unwrap();
        pages.push((*k, out));
    }
    rt.block_on(store.put(&pages)).unwrap();
    let mut rng = SplitMix64::seed_from_u64(99);
    let opts = TierOptions {
        batch_pages: 2,
        ..Default::default()
    };
    let mut tier = StorageTier::new(store.clone(), format.clone(), identity(), opts).unwrap();
    for round in 0..150 {
        let host = Arc::new(HostMemory::new(g, keys.len(), HostLayout::PageFirst).unwrap());
        let slots: Vec<u32> = (0..keys.len() as u32).rev().collect();
        let (_, gate) = tier
            .fetch(keys.clone(), host.clone(), slots.clone())
            .unwrap();
        std::thread::sleep(Duration::from_micros(rng.next_u64() % 2000));
        let n = gate.cancel();
        let c = within("a cancelled fetch ends", 30, move || {
            let c = tier.wait_one().expect("one job in flight");
            (tier, c)
        });
        tier = c.0;
        assert_eq!(
            gate.state().done,
            n,
            "round {round}: a page counted after cancel"
        );
        let per_layer = g.page_bytes_per_layer();
        let mut buf = vec![0u8; per_layer];
        for (i, &slot) in slots.iter().enumerate() {
            for l in 0..LAYERS {
                host.read_page(l, slot, &mut buf).unwrap();
                if i < n {
                    let want: Vec<u8> = (0..per_layer)
                        .map(|j| (i * 7 + l * per_layer + j) as u8 | 1)
                        .collect();
                    assert_eq!(buf, want, "round {round}: page {i} of the done prefix");
                } else {
                    assert!(
                        buf.iter().all(|&b| b == 0),
                        "round {round}: page {i} written after cancel returned {n}"
                    );
                }
            }
        }
    }
}

#[test]
fn prefetch_termination_races_leave_no_leak_and_no_wrong_kv() {
    // Random interleavings of steps, checks, terminations and aborts against a store with
    // random delays; every loaded prefix is checked byte by byte by `serve`.
    for seed in 0..6u64 {
        let s = Setup {
            stop: PrefetchStop::Timeout {
                base: Duration::from_micros(300),
                per_1k_tokens: Duration::ZERO,
                max: Duration::from_millis(1),
            },
            device_pages: 256,
            host_pages: 256,
            ..Default::default()
        };
        let store = Arc::new(TestStore::new(seed, 0));
        let prompts: Vec<Vec<u32>> = (0..6).map(|i| tokens(20 + i, 60)).collect();
        let mut warm = cached(&s, store.clone(), None);
        for p in &prompts {
            serve_and_store(&mut warm, p);
        }
        drop(warm);
        let slow = Arc::new(TestStore {
            max_delay_us: 800,
            ..TestStore::new(seed, 0)
        });
        // The slow store holds the same pages.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let seed_keys = KeySeed::new(&Namespace::DEFAULT, &identity());
        for p in &prompts {
            let keys = seed_keys.chain(p, 4);
            let got = rt.block_on(store.inner.get(&keys)).unwrap();
            let pages: Vec<(PageKey, Vec<u8>)> = keys
                .into_iter()
                .zip(got)
                .map(|(k, v)| (k, v.unwrap()))
                .collect();
            rt.block_on(slow.inner.put(&pages)).unwrap();
        }
        let mut c = cached(&s, slow.clone(), None);
        let mut rng = SplitMix64::seed_from_u64(seed);
        let mut open: Vec<u64> = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            assert!(c.prefetch(i as u64, KeyRef::new(p)));
            open.push(i as u64);
        }
        while !open.is_empty() {
            std::thread::sleep(Duration::from_micros(rng.next_u64() % 700));
            c.step().unwrap();
            let k = (rng.next_u64() as usize) % open.len();
            let rid = open[k];
            let status = match rng.next_u64() % 4 {
                0 => {
                    assert!(c.abort_prefetch(rid).unwrap());
                    Some(0)
                }
                1 => match c.terminate_prefetch(rid).unwrap() {
                    PrefetchStatus::Done { tokens } => Some(tokens),
                    other => panic!("{other:?}"),
                },
                _ => match c.check_prefetch(rid).unwrap() {
                    PrefetchStatus::Done { tokens } => Some(tokens),
                    PrefetchStatus::Pending => None,
                    PrefetchStatus::None => panic!("an open prefetch is unknown"),
                },
            };
            c.check_invariants().unwrap();
            if let Some(t) = status {
                open.swap_remove(k);
                assert_eq!(c.check_prefetch(rid).unwrap(), PrefetchStatus::None);
                let served = serve(&mut c, &prompts[rid as usize]).unwrap();
                assert!(served.device_hit + served.host_hit >= t.min(56));
                c.flush().unwrap();
            }
        }
        c.wait_storage().unwrap();
        c.step().unwrap();
        no_leaks(&c);
        let st = c.stats();
        assert_eq!(st.prefetches_started, 6);
    }
}

/// An all-reduce over `n` threads: each call blocks until every rank made its call of the same
/// round, then returns the reduced value. Panics when the ranks call different reductions in
/// one round (their call orders diverged).
#[derive(Debug)]
struct Group {
    n: usize,
    state: Mutex<Round>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct Round {
    generation: u64,
    arrived: usize,
    op: Option<bool>,
    acc: u64,
    result: u64,
    calls: u64,
}

#[derive(Debug)]
struct Rank(Arc<Group>);

impl Rank {
    fn reduce(&self, v: u64, is_min: bool) -> u64 {
        let g = &self.0;
        let mut s = g.state.lock().unwrap();
        let generation = s.generation;
        match s.op {
            None => {
                s.op = Some(is_min);
                s.acc = v;
            }
            Some(op) => {
                assert_eq!(op, is_min, "ranks called different reductions in one round");
                s.acc = if is_min { s.acc.min(v) } else { s.acc.max(v) };
            }
        }
        s.arrived += 1;
        if s.arrived == g.n {
            s.result = s.acc;
            s.arrived = 0;
            s.op = None;
            s.generation += 1;
            s.calls += 1;
            g.cv.notify_all();
            return s.result;
        }
        while s.generation == generation {
            s = g.cv.wait(s).unwrap();
        }
        s.result
    }
}

impl Consensus for Rank {
    fn min(&self, value: u64) -> u64 {
        self.reduce(value, true)
    }
    fn max(&self, value: u64) -> u64 {
        self.reduce(value, false)
    }
}

/// What must be identical across ranks.
#[derive(Debug, PartialEq, Eq)]
struct Fingerprint {
    host_pages: Vec<(String, u32)>,
    device_pages: Vec<u32>,
    walks: Vec<(usize, usize)>,
    nodes: usize,
    events: Vec<radixkv_radix::KvEvent>,
    stats: [u64; 10],
    served: Vec<(usize, usize)>,
}

/// What must be identical across ranks, read off a settled cache: its tree over `prompts`,
/// its events, what it served and the given counters.
fn fingerprint(
    c: &mut HiRadixCache<HostSim>,
    prompts: &[Vec<u32>],
    served: Vec<(usize, usize)>,
    stats: [u64; 10],
) -> Fingerprint {
    c.check_invariants().unwrap();
    let tree = c.device_cache().tree();
    let mut host_pages = Vec::new();
    tree.for_each_host_page(|n, h| host_pages.push((format!("{n:?}"), h)));
    host_pages.sort();
    let mut device_pages = Vec::new();
    tree.for_each_device_page(|p| device_pages.push(p.0));
    device_pages.sort_unstable();
    let walks = prompts
        .iter()
        .map(|p| {
            let w = tree.tier_walk(KeyRef::new(p));
            (w.device_len, w.host_len)
        })
        .collect();
    let nodes = tree.node_count();
    Fingerprint {
        host_pages,
        device_pages,
        walks,
        nodes,
        events: c.take_events(),
        stats,
        served,
    }
}

/// One rank of [`ranks_agree`]: `seed` picks the rank (`seed % 10`) and its timing draws.
fn run_rank(seed: u64, group: Arc<Group>, prompts: Arc<Vec<Vec<u32>>>) -> Fingerprint {
    let rank = seed % 10;
    // Odd rounds wait for complete fetches (each rank's store finishes at its own time);
    // even rounds take what arrived within 2 ms.
    let stop = if (seed / 10) % 2 == 1 {
        PrefetchStop::WaitComplete
    } else {
        PrefetchStop::Timeout {
            base: Duration::from_millis(2),
            per_1k_tokens: Duration::ZERO,
            max: Duration::from_millis(2),
        }
    };
    let s = Setup {
        stop,
        copy_delay: Duration::from_micros(rank * 400),
        device_pages: 256,
        host_pages: 512,
        ..Default::default()
    };
    let store = Arc::new(TestStore::new(1000 + seed, 1500));
    let consensus: Arc<dyn Consensus> = Arc::new(Rank(group));
    let mut c = cached(&s, store, Some(consensus));
    // Warm this rank's store, then start over cold.
    for p in prompts.iter() {
        serve(&mut c, p).unwrap();
        c.step().unwrap();
    }
    c.flush().unwrap();
    c.wait_storage().unwrap();
    c.reset().unwrap();
    c.take_events();
    // The same script on every rank; only the timing differs.
    let mut jitter = SplitMix64::seed_from_u64(seed ^ 0xfeed);
    let mut script = SplitMix64::seed_from_u64(42);
    let mut open: Vec<u64> = Vec::new();
    let mut served = Vec::new();
    // Prompt 0 is waited for: its whole stored prefix loads.
    assert!(c.prefetch(0, KeyRef::new(&prompts[0])));
    c.wait_storage().unwrap();
    let PrefetchStatus::Done { tokens: t } = c.check_prefetch(0).unwrap() else {
        panic!("a waited-for prefetch must end");
    };
    assert_eq!(t, 48);
    let r = serve(&mut c, &prompts[0]).unwrap();
    served.push((t, r.host_hit));
    for (i, p) in prompts.iter().enumerate().skip(1) {
        if c.prefetch(i as u64, KeyRef::new(p)) {
            open.push(i as u64);
        }
    }
    while !open.is_empty() {
        std::thread::sleep(Duration::from_micros(jitter.next_u64() % 300));
        c.step().unwrap();
        let k = (script.next_u64() as usize) % open.len();
        let rid = open[k];
        let status = if script.next_u64() % 7 == 0 {
            c.abort_prefetch(rid).unwrap();
            Some(0)
        } else {
            match c.check_prefetch(rid).unwrap() {
                PrefetchStatus::Done { tokens } => Some(tokens),
                _ => None,
            }
        };
        if let Some(t) = status {
            open.swap_remove(k);
            let r = serve(&mut c, &prompts[rid as usize]).unwrap();
            served.push((t, r.host_hit));
            c.step().unwrap();
        }
    }
    c.flush().unwrap();
    c.wait_storage().unwrap();
    let st = c.stats();
    fingerprint(
        &mut c,
        &prompts,
        served,
        [
            st.storage_hit_tokens,
            st.prefetches_started,
            st.prefetches_revoked,
            st.prefetch_pages_loaded,
            st.prefetch_pages_revoked,
            st.storage_backups,
            st.backup_pages_written + st.backup_pages_skipped + st.backup_pages_failed,
            st.writes_acked,
            st.loads_acked,
            st.loaded_tokens,
        ],
    )
}

#[test]
fn ranks_with_independent_timing_take_identical_decisions() {
    // Several rounds: a divergence shows only under some timings.
    for round in 0..4 {
        ranks_agree(round);
    }
}

fn ranks_agree(round: u64) {
    let prompts = (0..8)
        .map(|i| {
            // Shared prefixes: pairs of prompts share their first half.
            let mut t = tokens(50 + i / 2, 24);
            t.extend(tokens(70 + i, 28 + 4 * (i as usize % 3)));
            t
        })
        .collect();
    let (prints, group) = run_ranks(prompts, move |r, g, p| run_rank(r + 10 * round, g, p));
    assert!(
        prints[0].stats[0] > 0,
        "the scenario must load something from storage"
    );
    assert!(!prints[0].events.is_empty());
    for (r, p) in prints.iter().enumerate().skip(1) {
        assert_identical(r, p, &prints[0]);
    }
    assert!(group.state.lock().unwrap().calls > 0);
}

/// Runs `rank` for ranks 0, 1 and 2 on threads over one [`Group`] and `prompts`; returns what
/// each returned, in rank order, and the group.
fn run_ranks<T: Send + 'static>(
    prompts: Vec<Vec<u32>>,
    rank: impl Fn(u64, Arc<Group>, Arc<Vec<Vec<u32>>>) -> T + Send + Sync + Copy + 'static,
) -> (Vec<T>, Arc<Group>) {
    const RANKS: usize = 3;
    let group = Arc::new(Group {
        n: RANKS,
        state: Mutex::new(Round::default()),
        cv: Condvar::new(),
    });
    let prompts = Arc::new(prompts);
    let handles: Vec<_> = (0..RANKS as u64)
        .map(|r| {
            let (g, p) = (group.clone(), prompts.clone());
            std::thread::spawn(move || rank(r, g, p))
        })
        .collect();
    let out = within("the ranks finish", 60, move || {
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (out, group)
}

/// Rank `r`'s fingerprint equals rank 0's, part by part.
fn assert_identical(r: usize, p: &Fingerprint, first: &Fingerprint) {
    assert_eq!(p.served, first.served, "rank {r} served differently");
    assert_eq!(p.stats, first.stats, "rank {r} accounting");
    assert_eq!(p.walks, first.walks, "rank {r} tree");
    assert_eq!(p.host_pages, first.host_pages, "rank {r} host pages");
    assert_eq!(p.device_pages, first.device_pages, "rank {r} device pages");
    assert_eq!(p.nodes, first.nodes);
    assert_eq!(p.events, first.events, "rank {r} events");
}

/// One rank of [`ranks_agree_on_failed_backups`]: rank 0 fails the backup copy of prompt 1,
/// rank 1 that of prompt 4, rank 2 none; each rank's copies run at their own pace. Returns what
/// must be identical across ranks.
fn run_failing_rank(
    rank: u64,
    group: Arc<Group>,
    prompts: Arc<Vec<Vec<u32>>>,
) -> (Fingerprint, u64) {
    let s = Setup {
        copy_delay: Duration::from_micros(rank * 300),
        device_pages: 40,
        host_pages: 512,
        ..Default::default()
    };
    let consensus: Arc<dyn Consensus> = Arc::new(Rank(group));
    let mut c = cached(&s, Arc::new(MemStore::new()), Some(consensus));
    let mut served = Vec::new();
    // Twice over the prompts: the second pass finds the device prefixes evicted (40 pages hold
    // three prompts) and loads them back from the host, where the backups that failed on any
    // rank must be missing on every rank.
    for pass in 0..2 {
        for (i, p) in prompts.iter().enumerate() {
            if pass == 0 && (i == 1 || i == 4) {
                // Every rank settles its copies first (a collective: all ranks flush here), so
                // the fault hits this prompt's backup and not a slower rank's earlier one.
                c.flush().unwrap();
                if i as u64 == 1 + 3 * rank {
                    c.backend().fail_next_copies(StreamKind::Write, 1);
                }
            }
            let r = serve(&mut c, p).expect("the device holds the request");
            served.push((r.device_hit, r.host_hit));
            c.step().unwrap();
        }
    }
    c.flush().unwrap();
    c.wait_storage().unwrap();
    let st = c.stats();
    let stats = [
        st.failed_transfers,
        st.failed_writes,
        st.writes_acked,
        st.loads_acked,
        st.loaded_tokens,
        st.storage_backups,
        st.backup_pages_written + st.backup_pages_skipped + st.backup_pages_failed,
        0,
        0,
        0,
    ];
    (
        fingerprint(&mut c, &prompts, served, stats),
        st.failed_writes,
    )
}

#[test]
fn ranks_agree_on_failed_backups() {
    let prompts = (0..8)
        .map(|i| {
            let mut t = tokens(150 + i / 2, 24);
            t.extend(tokens(170 + i, 28));
            t
        })
        .collect();
    let (prints, _) = run_ranks(prompts, run_failing_rank);
    // Both ranks' failures count on every rank: each backup that failed anywhere is undone
    // everywhere.
    assert_eq!(prints[0].1, 2, "{:?}", prints[0].0.stats);
    assert!(prints[0].0.served.iter().any(|&(_, host)| host > 0));
    for (r, (p, _)) in prints.iter().enumerate().skip(1) {
        assert_identical(r, p, &prints[0].0);
    }
}

/// Serves `tokens` like [`serve`], but a load-back copy may fail: the forward pass waits for
/// every layer (a failed one reports an error), then the cache steps — on every rank, failed
/// here or not, as a collective — which agrees on the failures and repairs the load before
/// the prefix's bytes are checked. Returns what it served and whether a layer failed here.
fn serve_through_failed_loads(c: &mut HiRadixCache<HostSim>, tokens: &[u32]) -> (Served, bool) {
    let p = c.page_size();
    let h = hashes(tokens, p);
    let mut req = RequestKv::new(RadixKey::new(tokens.to_vec()));
    let m = c.match_request(&mut req).unwrap();
    c.begin_request(&mut req).unwrap();
    let loaded = req.prefix_len - m.prefix_len;
    let mut failed = false;
    if let Some(step) = c.start_loading().unwrap() {
        let counter = c.layer_counter().clone();
        counter.set_consumer(step.producer);
        for l in 0..LAYERS {
            failed |= counter.wait_until(l).is_err();
        }
    }
    c.step().unwrap();
    let prefix = row_prefix(c, &req);
    check_pages(&**c.backend(), &prefix, &h[..prefix.len()]);
    let rest = tokens.len() - req.prefix_len;
    c.alloc_tokens(&mut req, rest)
        .expect("the device holds the request");
    let pages = c.pools().rows.pages(req.row.unwrap()).unwrap().to_vec();
    let (first_new, whole) = (req.prefix_len / p, tokens.len() / p);
    write_pages(
        &**c.backend(),
        &pages[first_new..whole],
        &h[first_new..whole],
    );
    req.commit(rest).unwrap();
    c.cache_finished_req(&mut req, radixkv_radix::FinishKind::Finished)
        .unwrap();
    let served = Served {
        device_hit: m.prefix_len,
        host_hit: m.host_hit_len,
        loaded,
    };
    (served, failed)
}

/// One rank of [`ranks_agree_on_failed_loads`]: every prompt is served twice, and the second
/// pass finds the device prefixes evicted and loads them back from the host. Rank 0 fails
/// the load-back copy of prompt 2 in that pass, rank 1 that of prompt 5, rank 2 none; each
/// rank's copy delay and pauses between requests are drawn from its own seed. Returns what
/// must be identical across ranks and the failed loads this rank saw itself.
fn run_failing_load_rank(
    rank: u64,
    group: Arc<Group>,
    prompts: Arc<Vec<Vec<u32>>>,
) -> (Fingerprint, u64) {
    let mut draw = SplitMix64::seed_from_u64(0x10ad ^ (rank + 1).wrapping_mul(0x9e37_79b9));
    let s = Setup {
        copy_delay: Duration::from_micros(draw.next_u64() % 600),
        device_pages: 40,
        host_pages: 512,
        ..Default::default()
    };
    let consensus: Arc<dyn Consensus> = Arc::new(Rank(group));
    let mut c = cached(&s, Arc::new(MemStore::new()), Some(consensus));
    let mut served = Vec::new();
    let mut seen_here = 0;
    for pass in 0..2 {
        for (i, p) in prompts.iter().enumerate() {
            let target = pass == 1 && (i == 2 || i == 5);
            if target {
                // Every rank settles its copies first (a collective), so the fault hits this
                // prompt's load-back.
                c.flush().unwrap();
                if i as u64 == 2 + 3 * rank {
                    c.backend().fail_next_copies(StreamKind::Load, 1);
                }
            }
            let (r, failed) = serve_through_failed_loads(&mut c, p);
            if target {
                assert!(r.loaded > 0, "rank {rank}: prompt {i} loads from the host");
            }
            seen_here += u64::from(failed);
            served.push((r.device_hit, r.host_hit));
            std::thread::sleep(Duration::from_micros(draw.next_u64() % 300));
            c.step().unwrap();
        }
    }
    c.flush().unwrap();
    c.wait_storage().unwrap();
    let st = c.stats();
    let stats = [
        st.failed_transfers,
        st.failed_loads,
        st.repaired_loads,
        st.demoted_failed_loads,
        st.loads_acked,
        st.loaded_tokens,
        st.writes_acked,
        st.failed_writes,
        st.storage_backups,
        st.backup_pages_written + st.backup_pages_skipped + st.backup_pages_failed,
    ];
    (fingerprint(&mut c, &prompts, served, stats), seen_here)
}

#[test]
fn ranks_agree_on_failed_loads() {
    let prompts = (0..8)
        .map(|i| {
            let mut t = tokens(250 + i / 2, 24);
            t.extend(tokens(270 + i, 28));
            t
        })
        .collect();
    let (prints, _) = run_ranks(prompts, run_failing_load_rank);
    // Each rank saw its own fault only (rank 2 none) ...
    let seen: Vec<u64> = prints.iter().map(|(_, n)| *n).collect();
    assert_eq!(seen, [1, 1, 0]);
    // ... yet both count on every rank: each load that failed anywhere is repaired everywhere.
    let st = &prints[0].0.stats;
    assert_eq!((st[1], st[2], st[3]), (2, 2, 0), "{st:?}");
    assert!(prints[0].0.served.iter().any(|&(_, host)| host > 0));
    for (r, (p, _)) in prints.iter().enumerate().skip(1) {
        assert_identical(r, p, &prints[0].0);
    }
}

#[test]
fn storage_settings_that_cannot_work_are_refused() {
    let g = KvGeometry::new(LAYERS, 4, BYTES_PER_TOKEN).unwrap();
    let build = |f: &dyn Fn(&mut HiCacheConfig)| {
        let backend = Arc::new(HostSim::new(g, 16, HostSimConfig::default()).unwrap());
        let mut cfg = HiCacheConfig {
            radix: RadixConfig {
                page_size: 4,
                total_pages: 16,
                ..Default::default()
            },
            storage: Some(StorageConfig::new(Arc::new(MemStore::new()), identity())),
            ..Default::default()
        };
        f(&mut cfg);
        HiRadixCache::new(cfg, backend).map(|_| ())
    };
    build(&|_| {}).unwrap();
    // Mamba states travel in the stored pages (tests/storage_hybrid.rs); extra pools the
    // cache moves nothing in do not.
    build(&|c| {
        c.radix.mamba_slots = Some(4);
        c.mamba_state_bytes = Some(8);
    })
    .unwrap();
    assert!(
        build(&|c| {
            c.extra_pools = vec![radixkv_hicache::ExtraPoolSpec {
                name: radixkv_hicache::PoolName::Indexer,
                device_slots: 4,
                host_slots: 4,
                item_bytes: 8,
                device_owner: radixkv_hicache::SlotOwner::Controller,
            }];
        })
        .is_err()
    );
    for f in [
        |c: &mut HiCacheConfig| c.storage.as_mut().unwrap().tier.batch_pages = 0,
        |c: &mut HiCacheConfig| c.storage.as_mut().unwrap().tier.concurrency = 0,
        |c: &mut HiCacheConfig| c.storage.as_mut().unwrap().tier.op_timeout = Duration::ZERO,
        |c: &mut HiCacheConfig| c.storage.as_mut().unwrap().tier.worker_threads = 0,
        |c: &mut HiCacheConfig| {
            c.storage.as_mut().unwrap().stop = PrefetchStop::Timeout {
                base: Duration::from_secs(5),
                per_1k_tokens: Duration::ZERO,
                max: Duration::from_secs(1),
            }
        },
    ] {
        assert!(build(&f).is_err());
    }
    // The default deadline: 2 s + 0.1 s per 1K tokens, at most 30 s.
    let stop = PrefetchStop::default();
    assert_eq!(stop.deadline(0), Some(Duration::from_secs(2)));
    assert_eq!(stop.deadline(10_240), Some(Duration::from_secs(3)));
    assert_eq!(stop.deadline(10_000_000), Some(Duration::from_secs(30)));
    assert_eq!(PrefetchStop::WaitComplete.deadline(100), None);
    // Without a storage tier the prefetch API answers "none".
    let backend = Arc::new(HostSim::new(g, 16, HostSimConfig::default()).unwrap());
    let mut plain = HiRadixCache::new(
        HiCacheConfig {
            radix: RadixConfig {
                page_size: 4,
                total_pages: 16,
                ..Default::default()
            },
            ..Default::default()
        },
        backend,
    )
    .unwrap();
    assert!(!plain.prefetch(1, KeyRef::new(&tokens(1, 400))));
    assert_eq!(plain.check_prefetch(1).unwrap(), PrefetchStatus::None);
    assert!(!plain.abort_prefetch(1).unwrap());
}

#[test]
fn prefetches_respect_threshold_cap_and_duplicates() {
    let s = Setup {
        host_pages: 40,
        ..Default::default()
    };
    let store = Arc::new(TestStore::new(8, 0));
    let g = KvGeometry::new(LAYERS, 4, BYTES_PER_TOKEN).unwrap();
    let backend = Arc::new(HostSim::new(g, s.device_pages, HostSimConfig::default()).unwrap());
    let mut storage = StorageConfig::new(store.clone(), identity());
    storage.prefetch_threshold_tokens = 30; // 8 pages
    let mut c = HiRadixCache::new(
        HiCacheConfig {
            radix: RadixConfig {
                page_size: 4,
                total_pages: s.device_pages,
                ..Default::default()
            },
            host_size: HostSize::Pages(40),
            storage: Some(storage),
            ..Default::default()
        },
        backend,
    )
    .unwrap();
    // 28 tokens to look up (7 pages): under the threshold.
    assert!(!c.prefetch(1, KeyRef::new(&tokens(1, 29))));
    // 32 tokens (8 pages): started; the same request again is not.
    assert!(c.prefetch(1, KeyRef::new(&tokens(1, 33))));
    assert!(!c.prefetch(1, KeyRef::new(&tokens(1, 33))));
    // The cap is half the host pool, 20 pages: 8 + 8 fit, 8 more do not.
    assert!(c.prefetch(2, KeyRef::new(&tokens(2, 33))));
    assert!(!c.prefetch(3, KeyRef::new(&tokens(3, 33))));
    // Ending one frees its share of the cap (an empty store: nothing loads).
    c.wait_storage().unwrap();
    assert_eq!(
        c.check_prefetch(1).unwrap(),
        PrefetchStatus::Done { tokens: 0 }
    );
    assert!(c.prefetch(3, KeyRef::new(&tokens(3, 33))));
    assert_eq!(c.stats().prefetches_started, 3);
    assert!(c.abort_prefetch(2).unwrap());
    assert!(c.abort_prefetch(3).unwrap());
    c.wait_storage().unwrap();
    assert_eq!(c.controller().host().used(), 0);
    c.check_invariants().unwrap();
}

#[test]
fn file_store_round_trip_survives_a_restart() {
    use radixkv_hicache::storage::{FileStore, FileStoreConfig};
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        let dir = TempDir::new("restart");
        let s = Setup {
            page_size: 16,
            layout,
            device_pages: 64,
            host_pages: 128,
            ..Default::default()
        };
        let t = tokens(31, 200);
        {
            let store = Arc::new(FileStore::open_blocking(FileStoreConfig::new(&dir.0)).unwrap());
            let mut a = cached(&s, store, None);
            serve_and_store(&mut a, &t);
            assert_eq!(a.stats().backup_pages_written, 12);
        }
        // A new process: a new store over the same directory, a new cache.
        let store = Arc::new(FileStore::open_blocking(FileStoreConfig::new(&dir.0)).unwrap());
        let mut b = cached(&s, store, None);
        assert_eq!(prefetch_all(&mut b, 1, &t), 192, "{layout:?}");
        let served = serve(&mut b, &t).unwrap();
        assert_eq!(served.host_hit, 192);
        b.flush().unwrap();
        no_leaks(&b);
    }
}

#[test]
fn a_damaged_stored_page_is_one_counted_miss_and_is_removed() {
    use radixkv_hicache::storage::{FileStore, FileStoreConfig};
    let dir = TempDir::new("damaged");
    let s = Setup {
        page_size: 16,
        device_pages: 64,
        host_pages: 128,
        ..Default::default()
    };
    let t = tokens(37, 200);
    let open = || Arc::new(FileStore::open_blocking(FileStoreConfig::new(&dir.0)).unwrap());
    let mut keys = Vec::new();
    KeySeed::new(&Namespace::DEFAULT, &identity()).extend_chain(None, &t, 16, &mut keys);
    assert_eq!(keys.len(), 12);
    let store = open();
    let mut a = cached(&s, store.clone(), None);
    serve_and_store(&mut a, &t);
    assert_eq!(a.stats().backup_pages_written, 12);
    drop(a);

    // Damage page 5: stored again with one byte of its KV flipped (a store that hands back
    // damaged bytes; the file store's own checksum would turn damage on disk into a plain
    // miss).
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let stored_5 = |store: &FileStore| rt.block_on(store.exists_prefix(&keys[5..6])).unwrap() == 1;
    let mut bytes = rt.block_on(store.get(&keys[5..6])).unwrap()[0]
        .take()
        .unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    assert_eq!(rt.block_on(store.put(&[(keys[5], bytes)])).unwrap(), [true]);

    // A cold cache loads the pages before it, counts the damaged one as a miss, and the
    // store drops it.
    let mut b = cached(&s, store.clone(), None);
    assert_eq!(prefetch_all(&mut b, 1, &t), 5 * 16);
    assert_eq!(b.stats().prefetch_pages_corrupt, 1);
    assert!(!stored_5(&store), "the damaged page is still stored");
    let st = store.stats();
    assert_eq!((st.damaged_pages, st.pages), (1, 11));
    b.flush().unwrap();
    no_leaks(&b);
    drop(b);

    // The next cold cache (a restarted store too) stops before it without another miss.
    let store = open();
    assert_eq!(store.stats().pages, 11);
    let mut c = cached(&s, store.clone(), None);
    assert_eq!(prefetch_all(&mut c, 2, &t), 5 * 16);
    assert_eq!(c.stats().prefetch_pages_corrupt, 0);
    // Serving the request backs the missing pages up again, whole.
    let served = serve(&mut c, &t).unwrap();
    assert_eq!(served.host_hit, 5 * 16);
    c.flush().unwrap();
    c.wait_storage().unwrap();
    assert!(stored_5(&store), "the page was not written again");
    no_leaks(&c);
    drop(c);
    let mut d = cached(&s, store, None);
    assert_eq!(prefetch_all(&mut d, 3, &t), 192);
    assert_eq!(d.stats().prefetch_pages_corrupt, 0);
}

/// Damage on disk (a byte of a segment file flipped under the store) costs one counted miss
/// whether the file store checks its reads or leaves that to the tier: with
/// `payload_checksums` the store's XXH3 turns the page into a miss, without it the tier's decode
/// (the page format's checksum) does and discards the page through the store. Either way no
/// wrong KV is loaded and the page leaves the store.
#[test]
fn damage_on_disk_is_one_counted_miss_with_or_without_store_checksums() {
    use radixkv_hicache::storage::{FileStore, FileStoreConfig};
    for payload_checksums in [true, false] {
        let dir = TempDir::new("disk-damage");
        let s = Setup {
            page_size: 16,
            device_pages: 64,
            host_pages: 128,
            ..Default::default()
        };
        let t = tokens(41, 200);
        let open = || {
            Arc::new(
                FileStore::open_blocking(
                    FileStoreConfig::new(&dir.0).with_payload_checksums(payload_checksums),
                )
                .unwrap(),
            )
        };
        let mut keys = Vec::new();
        KeySeed::new(&Namespace::DEFAULT, &identity()).extend_chain(None, &t, 16, &mut keys);
        {
            let mut a = cached(&s, open(), None);
            serve_and_store(&mut a, &t);
            assert_eq!(a.stats().backup_pages_written, 12);
        }
        // A new process finds page 5 damaged in its segment file.
        let store = open();
        let (path, off, len) = store.page_location(&keys[5]).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[(off + len / 2) as usize] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let mut b = cached(&s, store.clone(), None);
        assert_eq!(
            prefetch_all(&mut b, 1, &t),
            5 * 16,
            "payload_checksums {payload_checksums}"
        );
        // The tier counts a page it had to reject; the store's rejection is a plain miss.
        assert_eq!(
            b.stats().prefetch_pages_corrupt,
            u64::from(!payload_checksums),
            "payload_checksums {payload_checksums}"
        );
        let st = store.stats();
        assert_eq!(
            (st.damaged_pages, st.pages),
            (1, 11),
            "payload_checksums {payload_checksums}"
        );
        let served = serve(&mut b, &t).unwrap();
        assert_eq!(served.host_hit, 5 * 16);
        b.flush().unwrap();
        no_leaks(&b);
    }
}

#[test]
fn random_store_faults_never_serve_wrong_kv_or_leak() {
    use radixkv_hicache::storage::{FaultConfig, FaultStore};
    let s = Setup {
        op_timeout: Duration::from_millis(40),
        device_pages: 256,
        host_pages: 256,
        ..Default::default()
    };
    let store = Arc::new(FaultStore::new(MemStore::new(), FaultConfig::seeded(1)).unwrap());
    let prompts: Vec<Vec<u32>> = (0..10).map(|i| tokens(40 + i, 64)).collect();
    let mut warm = cached(&s, store.clone(), None);
    for p in &prompts {
        serve_and_store(&mut warm, p);
    }
    drop(warm);
    for seed in 0..4 {
        store
            .set_config(FaultConfig {
                seed,
                error: 0.1,
                hang: 0.05,
                partial: 0.2,
                corrupt: 0.05,
                slow: 0.2,
                slow_ms: 5,
            })
            .unwrap();
        let mut c = cached(&s, store.clone(), None);
        for (i, p) in prompts.iter().enumerate() {
            // Half the prompts extend a prefix already served, so backups and prefetches mix.
            let rid = i as u64;
            if c.prefetch(rid, KeyRef::new(p)) {
                c.wait_storage().unwrap();
                assert!(matches!(
                    c.check_prefetch(rid).unwrap(),
                    PrefetchStatus::Done { .. }
                ));
            }
            // `serve` checks every reused byte on the device.
            serve(&mut c, p).unwrap();
            c.step().unwrap();
            c.check_invariants().unwrap();
        }
        c.flush().unwrap();
        c.wait_storage().unwrap();
        no_leaks(&c);
        let st = c.stats();
        assert_eq!(st.prefetches_started, 10);
        assert!(st.storage_hit_tokens <= 10 * 60);
    }
}
