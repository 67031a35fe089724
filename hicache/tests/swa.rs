//! Sliding-window KV on the host tier: byte-exact round trips of KV and window pages through
//! HostSim (both host layouts, page sizes 1 and 16), failed backups and loads without leaks,
//! host SWA page exhaustion, and random traffic with the audits after every step.

mod common;

use std::sync::Arc;

use common::hybrid::{
    Setup, SwaSetup, build, random_traffic, read_window, scribble, serve, window_bytes,
};
use common::*;
use radixkv_hicache::{
    HiCacheConfig, HiCacheError, HiRadixCache, HostLayout, HostSim, HostSimConfig, HostSize,
    KvGeometry, PoolName, StreamKind, WritePolicy,
};
use radixkv_radix::{FinishKind, PrefixCache, RadixConfig, RadixKey, RequestKv, SwaConfig};

/// Scribbles over every device SWA page: a load that did not copy would be caught.
fn scribble_windows(c: &HiRadixCache<HostSim>, pages: u32) {
    scribble(c, PoolName::Swa, pages);
}

fn round_trip(page_size: usize, layout: HostLayout) {
    let p = page_size;
    let mut c = build(&Setup {
        page_size: p,
        device_pages: 12,
        layout,
        swa: Some(SwaSetup {
            pages: 12,
            ..Default::default()
        }),
        ..Setup::swa()
    });
    let a = tokens(1, 4 * p);
    let (m, _) = serve(&mut c, &a);
    assert_eq!(m.prefix_len, 0);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.stats().swa_pages_backed_up, 4, "{:?}", c.stats());
    // Off the device entirely: KV demoted, the window pages go with it (the cascade), the
    // host copies stay.
    c.evict(usize::MAX / 2);
    c.check_invariants().unwrap();
    assert_eq!(c.device_cache().swa_accounting().unwrap().evictable, 0);
    scribble_windows(&c, 12);
    let mut b = a.clone();
    b.push(7);
    let (m, loaded) = serve(&mut c, &b);
    assert_eq!((m.prefix_len, m.host_hit_len, loaded), (0, 4 * p, 4 * p));
    // The window (two pages) falls inside A's node: its window pages come back whole.
    assert_eq!(c.stats().swa_pages_loaded, 4, "{:?}", c.stats());
    c.flush().unwrap();
    c.check_invariants().unwrap();

    // Only the window pages go (the KV stays on device): the load brings back the window
    // alone, in an operation without KV pages.
    c.device_cache_evict_swa();
    scribble_windows(&c, 12);
    let mut probe = RequestKv::new(RadixKey::new(b.clone()));
    let m = c.match_request(&mut probe).unwrap();
    // A match leaves at least one token to compute: A's pages.
    let whole = (b.len() - 1) / p * p;
    assert_eq!((m.prefix_len, m.host_hit_len), (0, whole));
    let loaded_before = c.stats().loaded_tokens;
    let (_, loaded) = serve(&mut c, &b);
    assert_eq!(loaded, whole);
    assert_eq!(c.stats().loaded_tokens, loaded_before, "no KV was loaded");
    // The request's window lock split A's node at the window's start: only the lower part's
    // window pages come back.
    assert_eq!(c.stats().swa_pages_loaded, 6, "{:?}", c.stats());
    c.flush().unwrap();
    c.check_invariants().unwrap();
}

/// Test helper: tombstones every unlocked device window page.
trait EvictSwa {
    fn device_cache_evict_swa(&mut self);
}

impl EvictSwa for HiRadixCache<HostSim> {
    fn device_cache_evict_swa(&mut self) {
        let freed = self.evict_swa(usize::MAX);
        assert!(freed > 0);
        self.check_invariants().unwrap();
    }
}

#[test]
fn round_trip_layer_first_page_1() {
    round_trip(1, HostLayout::LayerFirst);
}

#[test]
fn round_trip_layer_first_page_16() {
    round_trip(16, HostLayout::LayerFirst);
}

#[test]
fn round_trip_page_first_page_1() {
    round_trip(1, HostLayout::PageFirst);
}

#[test]
fn round_trip_page_first_page_16() {
    round_trip(16, HostLayout::PageFirst);
}

#[test]
fn config_errors_are_typed() {
    let g = KvGeometry::new(LAYERS, 4, BYTES_PER_TOKEN).unwrap();
    let backend = Arc::new(HostSim::new(g, 8, HostSimConfig::default()).unwrap());
    let radix = RadixConfig {
        page_size: 4,
        total_pages: 8,
        swa: Some(SwaConfig {
            window: 8,
            pages: 4,
        }),
        ..Default::default()
    };
    let bad = [
        HiCacheConfig {
            radix: radix.clone(),
            ..Default::default()
        },
        HiCacheConfig {
            radix: radix.clone(),
            swa_page_bytes: Some(0),
            ..Default::default()
        },
        HiCacheConfig {
            radix: radix.clone(),
            swa_page_bytes: Some(8),
            swa_host_pages: Some(0),
            ..Default::default()
        },
        // Both components: each pool still needs its item size.
        HiCacheConfig {
            radix: RadixConfig {
                mamba_slots: Some(4),
                ..radix.clone()
            },
            swa_page_bytes: Some(8),
            ..Default::default()
        },
    ];
    for cfg in bad {
        assert!(matches!(
            HiRadixCache::new(cfg, backend.clone()),
            Err(HiCacheError::Config(_))
        ));
    }
    // The default host share: 4 SWA pages × (16 host pages / 8 device pages).
    let c = HiRadixCache::new(
        HiCacheConfig {
            radix,
            host_size: HostSize::Pages(16),
            swa_page_bytes: Some(8),
            ..Default::default()
        },
        backend,
    )
    .unwrap();
    assert_eq!(c.controller().extra_host(PoolName::Swa).unwrap().total(), 8);
}

/// A backup whose copy fails takes its window pages' host copies down with the KV's.
#[test]
fn failed_backup_undoes_the_window_too() {
    let mut c = build(&Setup::swa());
    let a = tokens(1, 16);
    c.backend().fail_next_copies(StreamKind::Write, 2);
    serve(&mut c, &a);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert!(c.stats().failed_writes >= 1, "{:?}", c.stats());
    assert_eq!(c.host_swa_pages(), 0, "the failed window copies are freed");
    assert_eq!(c.host_tokens(), 0);
    let mut b = a.clone();
    b.push(1);
    let (m, _) = serve(&mut c, &b);
    assert_eq!(m.prefix_len, 16);
    c.flush().unwrap();
    c.check_invariants().unwrap();
}

/// A load whose copy fails is repaired (KV and window again) at the next step; one that
/// cannot be repaired is demoted. Either way the audits hold and no SWA page leaks.
#[test]
fn failed_load_is_repaired_with_its_window() {
    let mut c = build(&Setup::swa());
    let a = tokens(1, 16);
    serve(&mut c, &a);
    c.flush().unwrap();
    c.evict(usize::MAX / 2);
    scribble_windows(&c, 16);
    let mut b = a.clone();
    b.push(3);
    let mut r = RequestKv::new(RadixKey::new(b.clone()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    assert_eq!(r.prefix_len, 16);
    // Fail the window copy (submitted first) and a layer.
    c.backend().fail_next_copies(StreamKind::Load, 2);
    let step = c.start_loading().unwrap().unwrap();
    let counter = c.layer_counter().clone();
    counter.set_consumer(step.producer);
    assert!(counter.wait_until(0).is_err());
    c.step().unwrap();
    assert_eq!(c.stats().repaired_loads, 1, "{:?}", c.stats());
    for (j, &pg) in r.swa_pages.iter().enumerate() {
        let end = r.swa_evicted_len + (j + 1) * 4;
        assert_eq!(read_window(&c, pg), window_bytes(&b[..end]));
    }
    check_pages(&**c.backend(), &row_prefix(&c, &r), &hashes(&b, 4)[..4]);
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    c.flush().unwrap();
    c.check_invariants().unwrap();

    // Unrepairable: the repair fails too, so the load is demoted once unlocked.
    c.evict(usize::MAX / 2);
    let mut r = RequestKv::new(RadixKey::new(b.clone()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    c.backend().fail_next_copies(StreamKind::Load, 100);
    let step = c.start_loading().unwrap().unwrap();
    c.layer_counter().set_consumer(step.producer);
    assert!(c.layer_counter().wait_until(0).is_err());
    assert!(c.step().is_err(), "the repair fails too");
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    assert!(c.step().is_err());
    assert_eq!(c.stats().demoted_failed_loads, 1, "{:?}", c.stats());
    c.check_invariants().unwrap();
    let mut probe = RequestKv::new(RadixKey::new(b.clone()));
    let m = c.match_request(&mut probe).unwrap();
    assert_eq!((m.prefix_len, m.host_hit_len), (0, 16), "host-only again");
    let acc = c.device_cache().swa_accounting().unwrap();
    assert_eq!(acc.request_owned, 0, "no SWA page leaked: {acc:?}");
}

/// With host SWA pages for one node's window, the second backup host-evicts the first
/// (host-only) leaf, or backs up its KV without the window pages when nothing can go.
#[test]
fn host_swa_exhaustion_degrades_to_kv_only() {
    let mut c = build(&Setup {
        swa: Some(SwaSetup {
            host_pages: Some(2),
            ..Default::default()
        }),
        ..Setup::swa()
    });
    let a = tokens(1, 8);
    let b = tokens(2, 8);
    serve(&mut c, &a);
    c.flush().unwrap();
    assert_eq!(c.host_swa_pages(), 2);
    // A is still on device, so its host pages cannot be host-evicted: B goes without.
    serve(&mut c, &b);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.stats().swa_host_full, 1, "{:?}", c.stats());
    assert_eq!(c.host_swa_pages(), 2);
    // B's KV is on the host, its window is not: off the device, B is no host hit.
    c.evict(usize::MAX / 2);
    let mut probe = RequestKv::new(RadixKey::new(b.clone()));
    let m = c.match_request(&mut probe).unwrap();
    assert_eq!((m.prefix_len, m.host_hit_len), (0, 0));
    // A third backup host-evicts a host-only leaf holding host window pages.
    let d = tokens(3, 8);
    serve(&mut c, &d);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert!(c.stats().swa_host_pages_evicted >= 2, "{:?}", c.stats());
    // D round-trips with its window.
    c.evict(usize::MAX / 2);
    scribble_windows(&c, 16);
    let mut d2 = d.clone();
    d2.push(9);
    let (_, loaded) = serve(&mut c, &d2);
    assert_eq!(loaded, 8);
    c.flush().unwrap();
    c.check_invariants().unwrap();
}

/// Window pages being backed up are pinned until the ack; without the pin (a deliberate
/// breakage) the audit of the SWA locks against the KV locks, or the bytes, catch it.
#[test]
fn window_pages_being_backed_up_are_pinned() {
    let mut c = build(&Setup::swa());
    let a = tokens(1, 16);
    serve(&mut c, &a);
    // The backup is queued or in flight: its window pages cannot be tombstoned.
    let before = c.device_cache().swa_accounting().unwrap();
    assert_eq!(before.evictable, 0, "{before:?}");
    assert_eq!(before.protected, 4, "{before:?}");
    assert_eq!(c.evict_swa(usize::MAX), 0);
    c.flush().unwrap();
    let after = c.device_cache().swa_accounting().unwrap();
    assert_eq!((after.evictable, after.protected), (4, 0), "{after:?}");
    c.check_invariants().unwrap();
}

/// Random traffic over shared prefixes, with device and SWA evictions and failing backup and
/// load copies, every write policy: the audits hold after every step and every reused page
/// and window page holds the right bytes (checked inside the shared `serve`).
#[test]
fn random_traffic_keeps_windows_and_audits() {
    let mut repaired = 0;
    for (seed, policy, p) in [
        (1u64, WritePolicy::WriteThrough, 4),
        (2, WritePolicy::WriteBack, 1),
        (3, WritePolicy::WriteThroughSelective { hits: 2 }, 4),
        (4, WritePolicy::WriteThrough, 2),
    ] {
        let setup = Setup {
            page_size: p,
            device_pages: 24,
            policy,
            swa: Some(SwaSetup {
                pages: 20,
                host_pages: Some(24),
                ..Default::default()
            }),
            ..Setup::swa()
        };
        let out = random_traffic(seed, &setup, 300);
        let (hits, st) = (out.hits, out.stats);
        assert!(hits > 20, "seed {seed}: {hits} hits, {st:?}");
        assert!(st.swa_pages_loaded > 0, "seed {seed}: {st:?}");
        assert!(st.swa_pages_backed_up > 0, "seed {seed}: {st:?}");
        assert!(st.failed_writes > 0, "seed {seed}: {st:?}");
        assert_eq!(st.failed_loads, st.repaired_loads, "seed {seed}: {st:?}");
        repaired += st.repaired_loads;
    }
    assert!(repaired > 0, "no load failed and was repaired");
}
