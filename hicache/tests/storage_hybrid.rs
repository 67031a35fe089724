//! The storage tier (L3) under a hybrid tree: stored pages carry the Mamba state that ends at
//! them and their window KV, and a prefetch brings them back as host-only components that the
//! host tier's load-back takes to the device. Byte-exact round trips device → host → store →
//! a new cache over the same store → host → device (both host layouts, the in-memory store and
//! the file store), and the component rules on stored hits: never past the deepest stored
//! state (Mamba), never without a full stored window (SWA).

mod common;

use std::sync::Arc;

use common::hybrid::{MambaSetup, Setup, SwaSetup, build_with, serve};
use common::*;
use radixkv_hicache::storage::{FileStore, FileStoreConfig, MemStore, StorageBackend};
use radixkv_hicache::{HiRadixCache, HostLayout, HostSim, PoolName, PrefetchStatus, StorageConfig};
use radixkv_radix::{KeyRef, KvIdentity, PrefixCache};

fn identity() -> KvIdentity {
    KvIdentity::new("hybrid-test-model", "3 layers x 8 bytes + components")
}

/// A hybrid cache of `s` over `store`, every prefetch eligible (threshold one token) and
/// waited for.
fn cached(s: &Setup, store: Arc<dyn StorageBackend>) -> HiRadixCache<HostSim> {
    build_with(s, |cfg| {
        let mut st = StorageConfig::new(store, identity());
        st.prefetch_threshold_tokens = 1;
        st.stop = radixkv_hicache::PrefetchStop::WaitComplete;
        st.tier.batch_pages = 3;
        cfg.storage = Some(st);
    })
}

/// The audits, and no host page, host state or host window page outside the tree.
fn no_leaks(c: &HiRadixCache<HostSim>) {
    c.check_invariants().unwrap();
    let tree = c.device_cache().tree();
    assert_eq!(c.controller().host().used(), tree.host_page_count());
    if let Ok(a) = c.controller().extra_host(PoolName::Mamba) {
        assert_eq!(a.used(), tree.mamba_host_states().unwrap().len());
    }
    if let Ok(a) = c.controller().extra_host(PoolName::Swa) {
        assert_eq!(a.used(), tree.swa_host_page_count());
    }
}

fn setups() -> [(&'static str, Setup); 3] {
    [
        ("mamba", Setup::mamba()),
        ("swa", Setup::swa()),
        ("both", Setup::both()),
    ]
}

/// Device → host → store, then a new cache over the store (device and host cold): the
/// prefetch brings the KV, the window pages and the state back to the host as host-only
/// nodes, and the host tier's load-back takes all three to the device in one operation;
/// `serve` checks every byte of the KV, of the window pages and of the state the request
/// copies. `open` makes the store; called twice, it must give the same store (a restart).
fn round_trip(name: &str, s: &Setup, open: &dyn Fn() -> Arc<dyn StorageBackend>) {
    let p = s.page_size;
    let t = tokens(5, 6 * p);
    {
        let mut a = cached(s, open());
        let (m, _) = serve(&mut a, &t);
        assert_eq!(m.prefix_len, 0);
        a.flush().unwrap();
        a.wait_storage().unwrap();
        let st = a.stats();
        assert_eq!(st.backup_pages_written, 6, "{name}: {st:?}");
        if s.mamba.is_some() {
            assert_eq!(st.mamba_states_backed_up, 1, "{name}: {st:?}");
        }
        if s.swa.is_some() {
            assert_eq!(st.swa_pages_backed_up, 6, "{name}: {st:?}");
        }
        no_leaks(&a);
    }
    // A restarted server: a new cache over the same store.
    let mut b = cached(s, open());
    let mut longer = t.clone();
    longer.extend(tokens(6, 2 * p + 1));
    let hit = prefetch_all(&mut b, 1, &longer);
    assert_eq!(hit, 6 * p, "{name}: {:?}", b.stats());
    let st = b.stats();
    assert_eq!(st.prefetch_pages_loaded, 6, "{name}: {st:?}");
    assert_eq!(st.prefetch_pages_unusable, 0, "{name}: {st:?}");
    no_leaks(&b);
    let tree = b.device_cache().tree();
    if s.mamba.is_some() {
        assert_eq!(tree.mamba_host_states().unwrap().len(), 1, "{name}");
    }
    if let Some(w) = &s.swa {
        // Only the window before the end is kept on the host.
        assert_eq!(tree.swa_host_page_count(), w.window_pages, "{name}");
    }
    let before = b.stats();
    let (m, loaded) = serve(&mut b, &longer);
    assert_eq!(
        (m.prefix_len, m.host_hit_len, loaded),
        (0, 6 * p, 6 * p),
        "{name}"
    );
    b.flush().unwrap();
    let st = b.stats();
    assert_eq!(
        st.loads_acked,
        before.loads_acked + 1,
        "{name}: one operation"
    );
    if s.mamba.is_some() {
        assert_eq!(
            st.mamba_states_loaded,
            before.mamba_states_loaded + 1,
            "{name}"
        );
    }
    if s.swa.is_some() {
        assert!(st.swa_pages_loaded > before.swa_pages_loaded, "{name}");
    }
    b.flush().unwrap();
    b.wait_storage().unwrap();
    no_leaks(&b);
    // Clearing the host of the same cache works the same way.
    b.reset().unwrap();
    assert_eq!(b.controller().host().used(), 0);
    assert!(prefetch_all(&mut b, 2, &longer) >= 6 * p, "{name}");
    let (m, _) = serve(&mut b, &longer);
    assert!(m.host_hit_len >= 6 * p, "{name}");
    b.flush().unwrap();
    no_leaks(&b);
}

#[test]
fn mem_store_round_trip_with_components_is_byte_exact() {
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        for page_size in [1, 4] {
            for (name, s) in setups() {
                let s = Setup {
                    layout,
                    page_size,
                    ..s
                };
                let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
                round_trip(name, &s, &|| store.clone());
            }
        }
    }
}

#[test]
fn file_store_round_trip_with_components_survives_a_restart() {
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        for (name, s) in setups() {
            let s = Setup { layout, ..s };
            let dir = TempDir::new(name);
            let path = dir.0.clone();
            round_trip(name, &s, &|| {
                Arc::new(FileStore::open_blocking(FileStoreConfig::new(&path)).unwrap())
            });
        }
    }
}

/// Stored pages past the deepest stored state are fetched but not used: the hit ends at the
/// state, and the state the request copies is that one's.
#[test]
fn a_stored_hit_never_goes_past_the_deepest_stored_state() {
    for both in [false, true] {
        let s = Setup {
            // One host slot: the longer request's state finds none and is left out of the
            // backup (counted), so its pages reach the store without it.
            mamba: Some(MambaSetup {
                host_slots: Some(1),
                ..Default::default()
            }),
            swa: both.then(SwaSetup::default),
            ..Setup::mamba()
        };
        let p = s.page_size;
        let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
        let t = tokens(9, 6 * p);
        let mut a = cached(&s, store.clone());
        serve(&mut a, &t[..3 * p]);
        a.flush().unwrap();
        serve(&mut a, &t);
        a.flush().unwrap();
        a.wait_storage().unwrap();
        let st = a.stats();
        assert_eq!(st.backup_pages_written, 6, "{st:?}");
        assert_eq!(st.mamba_host_full, 1, "{st:?}");
        no_leaks(&a);

        let mut b = cached(&s, store.clone());
        let mut longer = t.clone();
        longer.push(1);
        let hit = prefetch_all(&mut b, 1, &longer);
        assert_eq!(hit, 3 * p, "both={both}: {:?}", b.stats());
        let st = b.stats();
        assert_eq!(
            (st.prefetch_pages_loaded, st.prefetch_pages_unusable),
            (3, 3),
            "{st:?}"
        );
        no_leaks(&b);
        // `serve` checks the state the request copies is the one after 3 pages.
        let (m, loaded) = serve(&mut b, &longer);
        assert_eq!((m.host_hit_len, loaded), (3 * p, 3 * p), "both={both}");
        b.flush().unwrap();
        no_leaks(&b);
    }
}

/// Stored pages whose window KV did not reach the store are not usable where the window
/// before the end needs them: the hit ends where a full stored window precedes it.
#[test]
fn a_stored_hit_needs_a_full_stored_window() {
    let s = Setup {
        // Two host window pages: the first request's window fills them, so the extension's
        // pages are backed up (and stored) without their window KV.
        swa: Some(SwaSetup {
            host_pages: Some(2),
            ..Default::default()
        }),
        ..Setup::swa()
    };
    let p = s.page_size;
    let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
    let t = tokens(11, 6 * p);
    let mut a = cached(&s, store.clone());
    serve(&mut a, &t[..2 * p]);
    a.flush().unwrap();
    serve(&mut a, &t);
    a.flush().unwrap();
    a.wait_storage().unwrap();
    let st = a.stats();
    assert_eq!(st.backup_pages_written, 6, "{st:?}");
    assert_eq!((st.swa_pages_backed_up, st.swa_host_full), (2, 1), "{st:?}");
    no_leaks(&a);

    // The reading cache has room for every fetched page's window KV.
    let roomy = Setup::swa();
    let mut b = cached(&roomy, store.clone());
    let mut longer = t.clone();
    longer.push(1);
    let hit = prefetch_all(&mut b, 1, &longer);
    assert_eq!(hit, 2 * p, "{:?}", b.stats());
    assert_eq!(b.stats().prefetch_pages_unusable, 4);
    no_leaks(&b);
    let (m, loaded) = serve(&mut b, &longer);
    assert_eq!((m.host_hit_len, loaded), (2 * p, 2 * p));
    b.flush().unwrap();
    no_leaks(&b);

    // A window of stored window KV that does not start at the root: the first two pages
    // are stored without it, the next two with it (window two pages), so the hit may end
    // after page four, and not after page one.
    let store2: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
    let u = tokens(12, 4 * p);
    let mut c = cached(&s, store2.clone());
    // Host window pages full of another prompt's window: the first backup stores none.
    serve(&mut c, &tokens(13, 2 * p));
    c.flush().unwrap();
    serve(&mut c, &u[..2 * p]);
    c.flush().unwrap();
    // Storage backups protect their nodes from host eviction until they complete.
    c.wait_storage().unwrap();
    // Room again: the other prompt's host copies go (device eviction of the least recently
    // used leaf, then host eviction), while the first pages of `u` stay on the device.
    assert_eq!(c.evict(2 * p), 2 * p);
    assert_eq!(c.evict_host(2 * p), 2 * p);
    serve(&mut c, &u);
    c.flush().unwrap();
    c.wait_storage().unwrap();
    no_leaks(&c);
    let st = c.stats();
    assert_eq!(
        (st.backup_pages_written, st.swa_pages_backed_up),
        (6, 4),
        "{st:?}"
    );
    let mut d = cached(&roomy, store2);
    let mut v = u.clone();
    v.push(3);
    assert_eq!(prefetch_all(&mut d, 1, &v), 4 * p, "{:?}", d.stats());
    let (m, _) = serve(&mut d, &v);
    assert_eq!(m.host_hit_len, 4 * p);
    d.flush().unwrap();
    no_leaks(&d);
}

/// An aborted or cut-short prefetch of a hybrid tree returns every reserved host page, state
/// slot and window page.
#[test]
fn aborted_hybrid_prefetches_leak_nothing() {
    let s = Setup::both();
    let p = s.page_size;
    let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
    let t = tokens(21, 6 * p);
    let mut a = cached(&s, store.clone());
    serve(&mut a, &t);
    a.flush().unwrap();
    a.wait_storage().unwrap();
    let mut b = cached(&s, store);
    let mut longer = t.clone();
    longer.push(2);
    assert!(b.prefetch(1, KeyRef::new(&longer)));
    b.wait_storage().unwrap();
    b.check_invariants().unwrap();
    assert!(b.abort_prefetch(1).unwrap());
    no_leaks(&b);
    assert_eq!(b.controller().host().used(), 0);
    assert!(b.prefetch(2, KeyRef::new(&longer)));
    b.wait_storage().unwrap();
    assert_eq!(
        b.terminate_prefetch(2).unwrap(),
        PrefetchStatus::Done { tokens: 6 * p }
    );
    no_leaks(&b);
}

/// The same round trip through a Redis server: the one `RADIXKV_REDIS_URL` names (`.ci/run`
/// starts one), each store under a key prefix of its own, its pages expiring after ten
/// minutes. Without the variable it returns at once (the sentinel of `tests/storage_redis.rs`
/// reports Redis skips).
#[cfg(feature = "redis")]
#[test]
fn redis_store_round_trip_with_components_is_byte_exact() {
    use radixkv_hicache::storage::{RedisConfig, RedisStore};
    let Some(url) = std::env::var("RADIXKV_REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        println!("skipped: RADIXKV_REDIS_URL is not set");
        return;
    };
    // The client's connection runs on this runtime for the whole test.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        for (name, s) in setups() {
            let s = Setup { layout, ..s };
            let prefix = format!(
                "radixkv-test-hybrid-{}-{nanos}-{name}-{layout:?}:",
                std::process::id()
            );
            let cfg = RedisConfig::new(&url)
                .with_key_prefix(prefix)
                .with_ttl(std::time::Duration::from_secs(600));
            let store: Arc<dyn StorageBackend> =
                Arc::new(rt.block_on(RedisStore::connect(cfg)).expect("connect"));
            round_trip(name, &s, &|| store.clone());
        }
    }
}

/// A stored hit that extends a prefix the tree holds: the prefetch starts at the tree's match
/// (a backed-up node with its own state and window), and the loaded part goes below it.
#[test]
fn a_stored_hit_extends_a_cached_prefix() {
    for (name, s) in setups() {
        let p = s.page_size;
        let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
        let t = tokens(31, 6 * p);
        let mut a = cached(&s, store.clone());
        serve(&mut a, &t);
        a.flush().unwrap();
        a.wait_storage().unwrap();
        // Another server computed the first half itself.
        let mut b = cached(&s, store);
        serve(&mut b, &t[..3 * p]);
        b.flush().unwrap();
        b.wait_storage().unwrap();
        let mut longer = t.clone();
        longer.push(5);
        assert_eq!(
            prefetch_all(&mut b, 1, &longer),
            3 * p,
            "{name}: {:?}",
            b.stats()
        );
        no_leaks(&b);
        let (m, loaded) = serve(&mut b, &longer);
        assert_eq!(
            (m.prefix_len, m.host_hit_len, loaded),
            (3 * p, 3 * p, 3 * p),
            "{name}"
        );
        b.flush().unwrap();
        no_leaks(&b);
    }
}

/// Ranks of one model for [`two_ranks_agree_on_a_hybrid_hit_or_keep_nothing`]: every
/// reduction waits for both ranks.
#[derive(Debug, Default)]
struct Pair {
    state: std::sync::Mutex<(u64, usize, u64, u64)>,
    cv: std::sync::Condvar,
}

#[derive(Debug)]
struct PairRank(Arc<Pair>);

impl PairRank {
    fn reduce(&self, v: u64, f: fn(u64, u64) -> u64) -> u64 {
        let g = &self.0;
        let mut s = g.state.lock().unwrap();
        // (generation, arrived, accumulator, result)
        let generation = s.0;
        s.2 = if s.1 == 0 { v } else { f(s.2, v) };
        s.1 += 1;
        if s.1 == 2 {
            s.3 = s.2;
            s.1 = 0;
            s.0 += 1;
            g.cv.notify_all();
            return s.3;
        }
        while s.0 == generation {
            s = g.cv.wait(s).unwrap();
        }
        s.3
    }
}

impl radixkv_hicache::Consensus for PairRank {
    fn min(&self, v: u64) -> u64 {
        self.reduce(v, u64::min)
    }
    fn max(&self, v: u64) -> u64 {
        self.reduce(v, u64::max)
    }
}

/// Two ranks, each over its own store, prefetch the same prompt: where their stores put the
/// state at the same page both keep the same hit; where one rank's store has it elsewhere
/// (its deeper state found no host slot at backup), the ranks disagree on where the hit may
/// end and both keep nothing, so their trees stay identical.
#[test]
fn two_ranks_agree_on_a_hybrid_hit_or_keep_nothing() {
    let p = Setup::both().page_size;
    let t = tokens(41, 6 * p);
    for same in [true, false] {
        let stores: Vec<Arc<dyn StorageBackend>> = (0..2)
            .map(|rank| {
                let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
                let short = !same && rank == 1;
                let s = Setup {
                    mamba: Some(MambaSetup {
                        host_slots: short.then_some(1),
                        ..Default::default()
                    }),
                    ..Setup::both()
                };
                let mut a = cached(&s, store.clone());
                if short {
                    serve(&mut a, &t[..3 * p]);
                    a.flush().unwrap();
                }
                serve(&mut a, &t);
                a.flush().unwrap();
                a.wait_storage().unwrap();
                store
            })
            .collect();
        let pair = Arc::new(Pair::default());
        let mut longer = t.clone();
        longer.push(9);
        let handles: Vec<_> = stores
            .into_iter()
            .map(|store| {
                let pair = pair.clone();
                let longer = longer.clone();
                std::thread::spawn(move || {
                    let mut b = build_with(&Setup::both(), |cfg| {
                        let mut st = StorageConfig::new(store, identity());
                        st.prefetch_threshold_tokens = 1;
                        st.stop = radixkv_hicache::PrefetchStop::WaitComplete;
                        cfg.storage = Some(st);
                        cfg.consensus = Arc::new(PairRank(pair));
                    });
                    let hit = prefetch_all(&mut b, 1, &longer);
                    no_leaks(&b);
                    let tree = b.device_cache().tree();
                    let shape = (
                        hit,
                        tree.host_page_count(),
                        tree.mamba_host_states().unwrap().len(),
                        tree.swa_host_page_count(),
                        b.stats().prefetch_pages_unusable,
                    );
                    // Both ranks serve the prompt (the same calls, so the same reductions):
                    // `serve` checks the bytes of whatever state and window the hit loads.
                    serve(&mut b, &longer);
                    b.flush().unwrap();
                    no_leaks(&b);
                    shape
                })
            })
            .collect();
        let got: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(got[0], got[1], "same={same}");
        if same {
            assert_eq!(got[0].0, 6 * p);
        } else {
            assert_eq!((got[0].0, got[0].1, got[0].4), (0, 0, 6));
        }
    }
}

/// A state that reaches the host after its page was stored (a checkpoint at a later split:
/// here a request ending inside a stored path) is still added to the store: the page is
/// written again with the state's section, so a new cache over the store hits up to it.
#[test]
fn a_state_that_reaches_the_host_late_is_added_to_the_store() {
    let s = Setup::mamba();
    let p = s.page_size;
    let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
    let t = tokens(11, 6 * p);
    let mut a = cached(&s, store.clone());
    serve(&mut a, &t);
    a.flush().unwrap();
    a.wait_storage().unwrap();
    assert_eq!(a.stats().backup_pages_written, 6, "{:?}", a.stats());
    // Ends at 3 pages, inside the stored path: the split's upper node gets the state.
    serve(&mut a, &t[..3 * p]);
    a.flush().unwrap();
    a.wait_storage().unwrap();
    let st = a.stats();
    // The checkpoints the shorter request left inside the stored path (at its end, and the
    // baseline's one at the last whole page of its input), backed up without KV.
    let late = st.mamba_states_backed_up - 1;
    assert!(late >= 1, "{st:?}");
    assert_eq!(
        (st.backup_pages_written, st.backup_pages_skipped),
        (6 + late, 0),
        "each late state's page is written again: {st:?}"
    );
    no_leaks(&a);

    let mut b = cached(&s, store.clone());
    let mut diverging = t[..3 * p].to_vec();
    diverging.extend(tokens(12, 2 * p));
    let hit = prefetch_all(&mut b, 1, &diverging);
    assert_eq!(hit, 3 * p, "{:?}", b.stats());
    // `serve` checks that the state the request copies is the one after 3 pages.
    let (m, loaded) = serve(&mut b, &diverging);
    assert_eq!((m.host_hit_len, loaded), (3 * p, 3 * p));
    b.flush().unwrap();
    b.wait_storage().unwrap();
    no_leaks(&b);
}

/// Window KV that reaches the host after its pages were stored without it (here the first
/// backup found no free host window page, and the node's host copy went before a
/// recomputation backed the node up again, window included) is added to the store: the
/// backup reads the stored pages back and writes them again with their window sections (a
/// stored state kept), so a new cache over the store gets a usable hit there. A stored page
/// that has every section already is not written again.
#[test]
fn a_window_that_reaches_the_host_late_is_added_to_the_store() {
    for (name, base) in [("swa", Setup::swa()), ("both", Setup::both())] {
        let s = Setup {
            // Two host window pages: the first prompt's window fills them.
            swa: Some(SwaSetup {
                host_pages: Some(2),
                ..Default::default()
            }),
            ..base.clone()
        };
        let p = s.page_size;
        let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
        let t = tokens(11, 2 * p);
        let mut a = cached(&s, store.clone());
        serve(&mut a, &tokens(13, 2 * p));
        a.flush().unwrap();
        serve(&mut a, &t);
        a.flush().unwrap();
        a.wait_storage().unwrap();
        let st = a.stats();
        assert_eq!(st.backup_pages_written, 4, "{name}: {st:?}");
        assert_eq!(
            (st.swa_pages_backed_up, st.swa_host_full),
            (2, 1),
            "{name}: `t` is stored without its window: {st:?}"
        );
        // Both prompts leave the device and the host.
        assert_eq!(a.evict(4 * p), 4 * p, "{name}");
        assert_eq!(a.evict_host(4 * p), 4 * p, "{name}");
        assert_eq!(a.controller().host().used(), 0, "{name}");
        // Recomputed, and backed up to the host with its window this time.
        let (m, _) = serve(&mut a, &t);
        assert_eq!(m.prefix_len + m.host_hit_len, 0, "{name}");
        a.flush().unwrap();
        a.wait_storage().unwrap();
        let st = a.stats();
        assert_eq!(st.swa_pages_backed_up, 4, "{name}: {st:?}");
        assert_eq!(
            (st.backup_pages_written, st.backup_pages_skipped),
            (6, 0),
            "{name}: both stored pages are written again with their window: {st:?}"
        );
        no_leaks(&a);
        // Once more: the stored pages have their window now, nothing is written.
        assert_eq!(a.evict(2 * p), 2 * p, "{name}");
        assert_eq!(a.evict_host(2 * p), 2 * p, "{name}");
        serve(&mut a, &t);
        a.flush().unwrap();
        a.wait_storage().unwrap();
        let st = a.stats();
        assert_eq!(
            (st.backup_pages_written, st.backup_pages_skipped),
            (6, 2),
            "{name}: {st:?}"
        );
        no_leaks(&a);

        // A new cache over the store: the stored window makes the hit usable.
        let mut b = cached(&base, store.clone());
        let mut longer = t.clone();
        longer.push(1);
        let hit = prefetch_all(&mut b, 1, &longer);
        assert_eq!(hit, 2 * p, "{name}: {:?}", b.stats());
        assert_eq!(b.stats().prefetch_pages_unusable, 0, "{name}");
        no_leaks(&b);
        // `serve` checks every byte of the KV, of the window pages and of the state.
        let (m, loaded) = serve(&mut b, &longer);
        assert_eq!((m.host_hit_len, loaded), (2 * p, 2 * p), "{name}");
        b.flush().unwrap();
        b.wait_storage().unwrap();
        no_leaks(&b);
    }
}

/// The storage engine alone: a backup that gives a stored page a section it lacks writes the
/// page again with it and keeps the stored page's other sections (so a late window never
/// drops a stored state, nor a late state a stored window); one that gives only sections
/// the stored pages have writes nothing; a rewrite writes every page, keeping the stored
/// sections it does not give. Checked byte by byte on the stored pages.
#[test]
fn a_late_section_is_merged_into_the_stored_page() {
    use radixkv_hicache::storage::{Completion, PageFormat, SectionSource, StorageTier};
    use radixkv_hicache::{HostMemory, KvGeometry, SlotMemory};
    use radixkv_radix::{KeySeed, Namespace};

    let g = KvGeometry::new(LAYERS, 4, BYTES_PER_TOKEN).unwrap();
    let format =
        PageFormat::new(g, &identity(), &[(PoolName::Mamba, 16), (PoolName::Swa, 8)]).unwrap();
    let store = Arc::new(MemStore::new());
    let mut tier = StorageTier::new(
        store.clone(),
        format.clone(),
        identity(),
        Default::default(),
    )
    .unwrap();
    let host = Arc::new(HostMemory::new(g, 2, HostLayout::PageFirst).unwrap());
    let kv = |pg: usize, l: usize| vec![(1 + l + 3 * pg) as u8; g.page_bytes_per_layer()];
    for pg in 0..2 {
        for l in 0..LAYERS {
            host.write_page(l, pg as u32, &kv(pg, l)).unwrap();
        }
    }
    let mamba = Arc::new(SlotMemory::new(PoolName::Mamba, 1, 16).unwrap());
    mamba.write_slot(0, &[7; 16]).unwrap();
    let swa = Arc::new(SlotMemory::new(PoolName::Swa, 2, 8).unwrap());
    swa.write_slot(0, &[8; 8]).unwrap();
    swa.write_slot(1, &[9; 8]).unwrap();
    let sec = |memory: &Arc<SlotMemory>, page: usize, slot: u32| SectionSource {
        page,
        memory: memory.clone(),
        slot,
    };
    let t = tokens(3, 8);
    let ns = Namespace::DEFAULT;
    let keys = KeySeed::new(&ns, &identity()).chain(&t, 4);
    let mut run = |rewrite: bool, sections: Vec<SectionSource>| -> (usize, usize, usize) {
        let pages = vec![0, 1];
        if rewrite {
            tier.rewrite_with_sections(&ns, t.clone(), 0, host.clone(), pages, sections)
        } else {
            tier.backup_with_sections(&ns, t.clone(), 0, host.clone(), pages, sections)
        }
        .unwrap();
        match tier.wait_one() {
            Some(Completion::Backup {
                written,
                skipped,
                failed,
                ..
            }) => (written, skipped, failed),
            other => panic!("{other:?}"),
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let stored = |want: [(Option<u8>, Option<u8>); 2]| {
        let got = rt.block_on(store.get(&keys)).unwrap();
        for (i, bytes) in got.iter().enumerate() {
            let d = format.decode(&keys[i], bytes.as_deref().unwrap()).unwrap();
            let all: Vec<u8> = (0..LAYERS).flat_map(|l| kv(i, l)).collect();
            assert_eq!(d.kv, &all[..], "page {i}");
            let item = |pool: PoolName| {
                d.sections
                    .iter()
                    .find(|(p, _)| *p == pool)
                    .map(|(_, b)| b.to_vec())
            };
            let (m, w) = want[i];
            assert_eq!(item(PoolName::Mamba), m.map(|b| vec![b; 16]), "page {i}");
            assert_eq!(item(PoolName::Swa), w.map(|b| vec![b; 8]), "page {i}");
        }
    };
    // Page 0 with its window.
    assert_eq!(run(false, vec![sec(&swa, 0, 0)]), (2, 0, 0));
    stored([(None, Some(8)), (None, None)]);
    // A state for page 1: page 0 is skipped, page 1 written again.
    assert_eq!(run(false, vec![sec(&mamba, 1, 0)]), (1, 1, 0));
    stored([(None, Some(8)), (Some(7), None)]);
    // A state for page 0 and a window for page 1: both written again, both keep theirs.
    assert_eq!(
        run(false, vec![sec(&mamba, 0, 0), sec(&swa, 1, 1)]),
        (2, 0, 0)
    );
    stored([(Some(7), Some(8)), (Some(7), Some(9))]);
    // Nothing new: nothing written.
    assert_eq!(
        run(false, vec![sec(&swa, 0, 0), sec(&mamba, 1, 0)]),
        (0, 2, 0)
    );
    // A rewrite without sections writes both pages and keeps every stored section.
    assert_eq!(run(true, Vec::new()), (2, 0, 0));
    stored([(Some(7), Some(8)), (Some(7), Some(9))]);
}
