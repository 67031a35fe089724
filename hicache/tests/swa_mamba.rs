//! Sliding-window KV and Mamba states in one tree on the host tier: byte-exact round trips of
//! KV, window pages and states through HostSim in one operation each way (both host layouts,
//! page sizes 1 and 16), failed backups and loads without leaks, host shortages of either
//! pool, and random traffic with the audits after every step (the harness the Mamba and SWA
//! tests share, `common::hybrid`).

mod common;

use std::sync::Arc;

use common::hybrid::{
    MambaSetup, Setup, SwaSetup, build, random_traffic, read_state, read_window, scribble, serve,
    state_bytes, window_bytes,
};
use common::*;
use radixkv_hicache::{
    HiCacheConfig, HiRadixCache, HostLayout, HostSim, HostSimConfig, HostSize, KvGeometry,
    PoolName, StreamKind, WritePolicy,
};
use radixkv_radix::{
    FinishKind, MambaPolicy, PrefixCache, RadixConfig, RadixKey, RequestKv, SwaConfig,
};

/// Scribbles over every device slot and SWA page of a [`Setup::both`]-sized cache.
fn scribble_all(c: &HiRadixCache<HostSim>) {
    scribble(c, PoolName::Mamba, 8);
    scribble(c, PoolName::Swa, 12);
}

fn probe(c: &mut HiRadixCache<HostSim>, t: &[u32]) -> (usize, usize) {
    let mut r = RequestKv::new(RadixKey::new(t.to_vec()));
    let m = c.match_request(&mut r).unwrap();
    (m.prefix_len, m.host_hit_len)
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
        ..Setup::both()
    });
    let a = tokens(1, 4 * p);
    let (m, _) = serve(&mut c, &a);
    assert_eq!(m.prefix_len, 0);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    // One operation backed up the KV, the four window pages and the state.
    let st = c.stats();
    assert_eq!(st.writes_acked, 1, "{st:?}");
    assert_eq!(st.backed_up_tokens, 4 * p as u64, "{st:?}");
    assert_eq!(st.swa_pages_backed_up, 4, "{st:?}");
    assert_eq!(st.mamba_states_backed_up, 1, "{st:?}");
    assert_eq!((c.host_swa_pages(), c.host_mamba_states()), (4, 1));

    // Off the device entirely: the window pages and the state go with the KV (the cascade),
    // the host copies stay; one load brings all three back.
    c.evict(usize::MAX / 2);
    c.check_invariants().unwrap();
    assert_eq!(c.device_cache().swa_accounting().unwrap().evictable, 0);
    assert_eq!(c.device_cache().mamba_accounting().unwrap().evictable, 0);
    scribble_all(&c);
    let mut b = a.clone();
    b.push(7);
    let loads = c.stats().loads_acked;
    let (m, loaded) = serve(&mut c, &b);
    assert_eq!((m.prefix_len, m.host_hit_len, loaded), (0, 4 * p, 4 * p));
    c.flush().unwrap();
    let st = c.stats();
    assert_eq!(st.loads_acked, loads + 1, "one operation: {st:?}");
    assert_eq!(st.swa_pages_loaded, 4, "{st:?}");
    assert_eq!(st.mamba_states_loaded, 1, "{st:?}");
    c.check_invariants().unwrap();

    // Only the window KV goes: tombstoning a node's window drops its unlocked state too
    // (SWA before Mamba), so the load brings back the window pages and the state, no KV.
    assert!(c.evict_swa(usize::MAX) > 0);
    c.check_invariants().unwrap();
    scribble_all(&c);
    let whole = (b.len() - 1) / p * p;
    assert_eq!(probe(&mut c, &b), (0, whole));
    let before = c.stats();
    let (_, loaded) = serve(&mut c, &b);
    assert_eq!(loaded, whole);
    let st = c.stats();
    assert_eq!(st.loaded_tokens, before.loaded_tokens, "no KV was loaded");
    assert_eq!(st.mamba_states_loaded, before.mamba_states_loaded + 1);
    // The request's window lock split A's node at the window's start: only the lower part's
    // window pages come back.
    assert_eq!(st.swa_pages_loaded, before.swa_pages_loaded + 2, "{st:?}");
    c.flush().unwrap();
    c.check_invariants().unwrap();

    // Only the state goes: its window is live, so the load brings the state alone.
    assert!(c.evict_mamba_states(usize::MAX) > 0);
    c.check_invariants().unwrap();
    scribble(&c, PoolName::Mamba, 8);
    assert_eq!(probe(&mut c, &b), (0, whole));
    let before = c.stats();
    let (_, loaded) = serve(&mut c, &b);
    assert_eq!(loaded, whole);
    let st = c.stats();
    assert_eq!(st.loaded_tokens, before.loaded_tokens, "no KV was loaded");
    assert_eq!(
        st.swa_pages_loaded, before.swa_pages_loaded,
        "no window page"
    );
    assert_eq!(st.mamba_states_loaded, before.mamba_states_loaded + 1);
    c.flush().unwrap();
    c.check_invariants().unwrap();
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

/// A tree with both components builds under the host tier, with both extra pools.
#[test]
fn both_pools_are_registered() {
    let g = KvGeometry::new(LAYERS, 4, BYTES_PER_TOKEN).unwrap();
    let backend = Arc::new(HostSim::new(g, 8, HostSimConfig::default()).unwrap());
    let c = HiRadixCache::new(
        HiCacheConfig {
            radix: RadixConfig {
                page_size: 4,
                total_pages: 8,
                mamba_slots: Some(4),
                swa: Some(SwaConfig {
                    window: 8,
                    pages: 4,
                }),
                ..Default::default()
            },
            host_size: HostSize::Pages(16),
            mamba_state_bytes: Some(8),
            swa_page_bytes: Some(8),
            ..Default::default()
        },
        backend,
    )
    .unwrap();
    let ctrl = c.controller();
    assert_eq!(ctrl.extra_host(PoolName::Mamba).unwrap().total(), 8);
    assert_eq!(ctrl.extra_host(PoolName::Swa).unwrap().total(), 8);
}

/// A backup whose copy fails takes the host copies of its window pages and its state down
/// with its KV's.
#[test]
fn failed_backup_undoes_window_and_state() {
    let mut c = build(&Setup::both());
    let a = tokens(1, 16);
    c.backend().fail_next_copies(StreamKind::Write, 3);
    serve(&mut c, &a);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert!(c.stats().failed_writes >= 1, "{:?}", c.stats());
    assert_eq!(c.host_tokens(), 0);
    assert_eq!((c.host_swa_pages(), c.host_mamba_states()), (0, 0));
    let mut b = a.clone();
    b.push(1);
    let (m, _) = serve(&mut c, &b);
    assert_eq!(m.prefix_len, 16, "still served from the device");
    c.flush().unwrap();
    c.check_invariants().unwrap();
}

/// A load whose copies fail is repaired (KV, window pages and state again) at the next step;
/// one that cannot be repaired is demoted. Either way the audits hold and nothing leaks.
#[test]
fn failed_load_is_repaired_with_window_and_state() {
    let mut c = build(&Setup::both());
    let a = tokens(1, 16);
    serve(&mut c, &a);
    c.flush().unwrap();
    c.evict(usize::MAX / 2);
    scribble_all(&c);
    let mut b = a.clone();
    b.push(3);
    let mut r = RequestKv::new(RadixKey::new(b.clone()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    assert_eq!(r.prefix_len, 16);
    // Fail the state copy and the window copy (both submitted first) and a layer.
    c.backend().fail_next_copies(StreamKind::Load, 3);
    let step = c.start_loading().unwrap().unwrap();
    let counter = c.layer_counter().clone();
    counter.set_consumer(step.producer);
    assert!(counter.wait_until(0).is_err());
    c.step().unwrap();
    assert_eq!(c.stats().repaired_loads, 1, "{:?}", c.stats());
    let cow = r.mamba_cow.unwrap();
    assert_eq!(read_state(&c, cow.src), state_bytes(&b[..16]));
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
    assert_eq!(probe(&mut c, &b), (0, 16), "host-only again");
    let swa = c.device_cache().swa_accounting().unwrap();
    let mamba = c.device_cache().mamba_accounting().unwrap();
    assert_eq!(swa.request_owned, 0, "no SWA page leaked: {swa:?}");
    assert_eq!(mamba.request_owned, 0, "no slot leaked: {mamba:?}");
}

/// Too few host slots or host SWA pages: the backup degrades (each shortage counted) and a
/// host hit never ends where the host lacks a component the match needs.
#[test]
fn host_shortages_degrade_and_no_hit_ends_without_a_component() {
    for (slots, swa_pages) in [(Some(1), None), (None, Some(2))] {
        let mut c = build(&Setup {
            mamba: Some(MambaSetup {
                host_slots: slots,
                ..Default::default()
            }),
            swa: Some(SwaSetup {
                host_pages: swa_pages,
                ..Default::default()
            }),
            ..Setup::both()
        });
        let a = tokens(1, 8);
        let b = tokens(2, 8);
        serve(&mut c, &a);
        serve(&mut c, &b);
        c.flush().unwrap();
        c.check_invariants().unwrap();
        let st = c.stats();
        let short = if slots.is_some() {
            st.mamba_host_full
        } else {
            st.swa_host_full
        };
        assert_eq!(short, 1, "{slots:?} {swa_pages:?}: {st:?}");
        assert_eq!(c.host_tokens(), 16, "both KV backed up: {st:?}");
        // B's KV is on the host without one of its components: no host hit ends there.
        c.evict(usize::MAX / 2);
        c.check_invariants().unwrap();
        assert_eq!(probe(&mut c, &b), (0, 0), "{slots:?} {swa_pages:?}");
        // A has all three and round-trips.
        scribble_all(&c);
        let mut a2 = a.clone();
        a2.push(9);
        let (m, loaded) = serve(&mut c, &a2);
        assert_eq!((m.host_hit_len, loaded), (8, 8));
        c.flush().unwrap();
        c.check_invariants().unwrap();
    }
}

/// Random traffic over shared prefixes with device evictions, evictions of window KV and of
/// states, failing copies both ways, every write policy and both Mamba policies: the audits
/// hold after every step, every reused page, window page and state holds its prefix's bytes,
/// and loads of every shape happen — KV with both components, and window pages alone for a
/// node whose device state stayed.
#[test]
fn random_traffic_keeps_windows_states_and_audits() {
    let mut repaired = 0;
    let mut window_only = 0;
    for (seed, policy, mp, p) in [
        (1u64, WritePolicy::WriteThrough, MambaPolicy::Sglang, 4),
        (2, WritePolicy::WriteBack, MambaPolicy::Sglang, 1),
        (
            3,
            WritePolicy::WriteThroughSelective { hits: 2 },
            MambaPolicy::default(),
            4,
        ),
        (4, WritePolicy::WriteThrough, MambaPolicy::default(), 2),
        (5, WritePolicy::WriteThrough, MambaPolicy::Sglang, 2),
    ] {
        let setup = Setup {
            page_size: p,
            device_pages: 24,
            policy,
            mamba: Some(MambaSetup {
                slots: 10,
                host_slots: Some(6),
                policy: mp,
            }),
            swa: Some(SwaSetup {
                window_pages: 2,
                pages: 20,
                host_pages: Some(24),
            }),
            ..Setup::both()
        };
        let out = random_traffic(seed, &setup, 300);
        let st = out.stats;
        assert!(out.hits > 20, "seed {seed}: {} hits, {st:?}", out.hits);
        assert!(st.mamba_states_loaded > 0, "seed {seed}: {st:?}");
        assert!(st.swa_pages_loaded > 0, "seed {seed}: {st:?}");
        assert!(st.mamba_states_backed_up > 0, "seed {seed}: {st:?}");
        assert!(st.swa_pages_backed_up > 0, "seed {seed}: {st:?}");
        assert!(st.failed_writes > 0, "seed {seed}: {st:?}");
        assert_eq!(st.failed_loads, st.repaired_loads, "seed {seed}: {st:?}");
        repaired += st.repaired_loads;
        window_only += out.window_only_loads;
    }
    assert!(repaired > 0, "no load failed and was repaired");
    assert!(window_only > 0, "no load brought window pages alone");
}

/// A load-back declined for want of a state slot leaves the request the device prefix it
/// matched: the load never evicts that prefix's own state for its slot and then gives up (a
/// CI run of the session model found this; the request then reused nothing). Once a slot
/// frees, the same load goes ahead and supersedes that state. For both a Mamba-only tree and
/// one with both components.
#[test]
fn a_load_declined_for_a_slot_keeps_the_device_prefix() {
    for setup in [Setup::mamba(), Setup::both()] {
        let mut c = build(&Setup {
            mamba: Some(MambaSetup {
                slots: 2,
                ..Default::default()
            }),
            ..setup.clone()
        });
        let a = tokens(1, 8);
        let mut ab = a.clone();
        ab.extend(tokens(2, 8));
        serve(&mut c, &a);
        serve(&mut c, &ab);
        c.flush().unwrap();
        // B's node (a leaf) leaves the device with its state; A keeps its state there.
        assert_eq!(c.evict(8), 8);
        c.check_invariants().unwrap();
        let mut abx = ab.clone();
        abx.push(5);
        assert_eq!(probe(&mut c, &abx), (8, 8), "{setup:?}");
        // A running request takes the free slot: A's state is the only one left to evict.
        let mut other = RequestKv::new(RadixKey::new(tokens(3, 4)));
        c.match_request(&mut other).unwrap();
        c.begin_request(&mut other).unwrap();
        let before = c.stats();
        let mut r = RequestKv::new(RadixKey::new(abx.clone()));
        assert_eq!(c.match_request(&mut r).unwrap().prefix_len, 8);
        let e = c.begin_request(&mut r).unwrap_err();
        assert!(
            matches!(e, radixkv_radix::CacheError::OutOfStateSlots { .. }),
            "{setup:?}: {e:?}"
        );
        let st = c.stats();
        assert_eq!(
            st.mamba_load_back_no_slot,
            before.mamba_load_back_no_slot + 1,
            "{st:?}"
        );
        c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
        c.check_invariants().unwrap();
        assert_eq!(probe(&mut c, &abx), (8, 8), "{setup:?}: A's state survived");
        // The slot frees: the load goes ahead, and the request's own slot takes A's state.
        c.cache_finished_req(&mut other, FinishKind::Aborted)
            .unwrap();
        let (m, loaded) = serve(&mut c, &abx);
        assert_eq!(
            (m.prefix_len, m.host_hit_len, loaded),
            (8, 8, 8),
            "{setup:?}"
        );
        c.flush().unwrap();
        c.check_invariants().unwrap();
    }
}
