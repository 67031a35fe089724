//! Mamba states on the host tier: byte-exact round trips of KV and states through HostSim
//! (both host layouts, page sizes 1 and 16), failed backups and loads without leaks, host
//! slot exhaustion, and random traffic with the audits after every step.

mod common;

use std::sync::Arc;

use common::hybrid::{
    MambaSetup, STATE_BYTES, Setup, build, random_traffic, read_state, serve, state_bytes,
};
use common::*;
use radixkv_hicache::{
    DeviceBackend, HiCacheConfig, HiCacheError, HiRadixCache, HostLayout, HostSim, HostSimConfig,
    HostSize, KvGeometry, PoolName, StreamKind, WritePolicy,
};
use radixkv_radix::{
    CacheError, FinishKind, MambaPolicy, PrefixCache, RadixConfig, RadixKey, RequestKv,
};

fn round_trip(page_size: usize, layout: HostLayout) {
    let p = page_size;
    let mut c = build(&Setup {
        page_size: p,
        device_pages: 12,
        layout,
        ..Setup::mamba()
    });
    let a = tokens(1, 4 * p);
    let (m, _) = serve(&mut c, &a);
    assert_eq!(m.prefix_len, 0);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.stats().mamba_states_backed_up, 1, "{:?}", c.stats());
    assert_eq!(c.host_mamba_states(), 1);
    // Off the device entirely: KV demoted, the device state goes with it (the cascade), the
    // host copy stays.
    c.evict(usize::MAX / 2);
    c.check_invariants().unwrap();
    assert_eq!(c.device_cache().mamba_accounting().unwrap().evictable, 0);
    // Scribble over every device slot: a load that did not copy would be caught.
    for s in 0..8 {
        c.backend()
            .write_extra_slot(PoolName::Mamba, s, &[0xEE; STATE_BYTES])
            .unwrap();
    }
    let mut b = a.clone();
    b.push(7);
    let (m, loaded) = serve(&mut c, &b);
    assert_eq!((m.prefix_len, m.host_hit_len, loaded), (0, 4 * p, 4 * p));
    assert_eq!(c.stats().mamba_states_loaded, 1);
    c.flush().unwrap();
    c.check_invariants().unwrap();

    // Only the device state goes (its KV stays on device): the load brings back the state
    // alone, in an operation without KV pages.
    c.evict_mamba_states(usize::MAX);
    c.check_invariants().unwrap();
    for s in 0..8 {
        c.backend()
            .write_extra_slot(PoolName::Mamba, s, &[0xDD; STATE_BYTES])
            .unwrap();
    }
    let mut probe = RequestKv::new(RadixKey::new(b.clone()));
    let m = c.match_request(&mut probe).unwrap();
    assert_eq!((m.prefix_len, m.host_hit_len), (0, 4 * p));
    let loaded_before = c.stats().loaded_tokens;
    let (_, loaded) = serve(&mut c, &b);
    assert_eq!(loaded, 4 * p);
    assert_eq!(c.stats().loaded_tokens, loaded_before, "no KV was loaded");
    assert_eq!(c.stats().mamba_states_loaded, 2);
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

#[test]
fn config_errors_are_typed() {
    let g = KvGeometry::new(LAYERS, 4, BYTES_PER_TOKEN).unwrap();
    let backend = Arc::new(HostSim::new(g, 8, HostSimConfig::default()).unwrap());
    let radix = RadixConfig {
        page_size: 4,
        total_pages: 8,
        mamba_slots: Some(4),
        ..Default::default()
    };
    let bad = [
        HiCacheConfig {
            radix: radix.clone(),
            ..Default::default()
        },
        HiCacheConfig {
            radix: radix.clone(),
            mamba_state_bytes: Some(0),
            ..Default::default()
        },
        HiCacheConfig {
            radix: radix.clone(),
            mamba_state_bytes: Some(8),
            mamba_host_slots: Some(0),
            ..Default::default()
        },
        // Refused after the pools' specs are built, with another slot count than the valid
        // config below: the backend must not have registered the state pool (a registration
        // outlives the refused cache, and another size is refused).
        HiCacheConfig {
            radix: RadixConfig {
                mamba_slots: Some(6),
                ..radix.clone()
            },
            mamba_state_bytes: Some(8),
            max_pending_ops: 0,
            ..Default::default()
        },
        HiCacheConfig {
            radix: RadixConfig {
                mamba_slots: Some(6),
                max_rows: 0,
                ..radix.clone()
            },
            mamba_state_bytes: Some(8),
            ..Default::default()
        },
    ];
    for cfg in bad {
        let r = HiRadixCache::new(cfg, backend.clone());
        assert!(
            matches!(
                r,
                Err(HiCacheError::Config(_) | HiCacheError::Cache(CacheError::Config(_)))
            ),
            "{r:?}"
        );
    }
    // The default host share: 4 slots × (16 host pages / 8 device pages).
    let c = HiRadixCache::new(
        HiCacheConfig {
            radix,
            host_size: HostSize::Pages(16),
            mamba_state_bytes: Some(8),
            ..Default::default()
        },
        backend,
    )
    .unwrap();
    assert_eq!(
        c.controller().extra_host(PoolName::Mamba).unwrap().total(),
        8
    );
}

/// A backup whose copy fails takes its state's host copy down with the KV's: nothing leaks,
/// nothing is served from it.
#[test]
fn failed_backup_undoes_the_state_too() {
    let mut c = build(&Setup::mamba());
    let a = tokens(1, 16);
    c.backend().fail_next_copies(StreamKind::Write, 2);
    serve(&mut c, &a);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert!(c.stats().failed_writes >= 1, "{:?}", c.stats());
    assert_eq!(c.host_mamba_states(), 0, "the failed state copy is freed");
    assert_eq!(c.host_tokens(), 0);
    // The prefix is still served from the device, with its state.
    let mut b = a.clone();
    b.push(1);
    let (m, _) = serve(&mut c, &b);
    assert_eq!(m.prefix_len, 16);
    c.flush().unwrap();
    c.check_invariants().unwrap();
}

/// A load whose copy fails is repaired (KV and state again) at the next step; one that cannot
/// be repaired is demoted. Either way the audits hold and no slot leaks.
#[test]
fn failed_load_is_repaired_with_its_state() {
    let mut c = build(&Setup::mamba());
    let a = tokens(1, 16);
    serve(&mut c, &a);
    c.flush().unwrap();
    c.evict(usize::MAX / 2);
    let mut b = a.clone();
    b.push(3);
    let mut r = RequestKv::new(RadixKey::new(b.clone()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    assert_eq!(r.prefix_len, 16);
    // Fail the state copy (submitted first) and a layer.
    c.backend().fail_next_copies(StreamKind::Load, 2);
    let step = c.start_loading().unwrap().unwrap();
    let counter = c.layer_counter().clone();
    counter.set_consumer(step.producer);
    assert!(counter.wait_until(0).is_err());
    c.step().unwrap();
    assert_eq!(c.stats().repaired_loads, 1, "{:?}", c.stats());
    let cow = r.mamba_cow.unwrap();
    assert_eq!(read_state(&c, cow.src), state_bytes(&b[..16]));
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
    // Unlocked now: the next step retries the repair (still failing: its error is returned)
    // and demotes the load (KV back to host-only, the device state dropped).
    assert!(c.step().is_err());
    assert_eq!(c.stats().demoted_failed_loads, 1, "{:?}", c.stats());
    c.check_invariants().unwrap();
    let mut probe = RequestKv::new(RadixKey::new(b.clone()));
    let m = c.match_request(&mut probe).unwrap();
    assert_eq!((m.prefix_len, m.host_hit_len), (0, 16), "host-only again");
    let a_dev = c.device_cache().mamba_accounting().unwrap();
    assert_eq!(a_dev.request_owned, 0, "no slot leaked: {a_dev:?}");
}

/// With one host slot for two states, the second backup makes room by host-evicting the
/// first (host-only) leaf, or backs up its KV without the state when nothing can go.
#[test]
fn host_slot_exhaustion_degrades_to_kv_only() {
    let mut c = build(&Setup {
        mamba: Some(MambaSetup {
            host_slots: Some(1),
            ..Default::default()
        }),
        ..Setup::mamba()
    });
    let a = tokens(1, 8);
    let b = tokens(2, 8);
    serve(&mut c, &a);
    c.flush().unwrap();
    assert_eq!(c.host_mamba_states(), 1);
    // A is still on device, so its host state cannot be host-evicted: B's goes without one.
    serve(&mut c, &b);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.stats().mamba_host_full, 1, "{:?}", c.stats());
    assert_eq!(c.host_mamba_states(), 1);
    // Demote both; a third backup host-evicts the host-only leaf holding the slot.
    c.evict(usize::MAX / 2);
    let d = tokens(3, 8);
    serve(&mut c, &d);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert!(c.stats().mamba_host_evicted >= 1, "{:?}", c.stats());
    assert_eq!(c.stats().mamba_states_backed_up, 2);
    // D round-trips with its state.
    c.evict(usize::MAX / 2);
    let mut d2 = d.clone();
    d2.push(9);
    let (_, loaded) = serve(&mut c, &d2);
    assert_eq!(loaded, 8);
    c.flush().unwrap();
    c.check_invariants().unwrap();
}

/// Random traffic over shared prefixes, with device and Mamba evictions and failing backup
/// and load copies, every write policy: the audits hold after every step and every reused state and
/// page holds the right bytes (checked inside the shared `serve`).
#[test]
fn random_traffic_keeps_states_and_audits() {
    let mut repaired = 0;
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
            ..Setup::mamba()
        };
        let out = random_traffic(seed, &setup, 300);
        let (hits, st) = (out.hits, out.stats);
        assert!(hits > 20, "seed {seed}: {hits} hits, {st:?}");
        assert!(st.mamba_states_loaded > 0, "seed {seed}: {st:?}");
        assert!(st.mamba_states_backed_up > 0, "seed {seed}: {st:?}");
        assert!(st.failed_writes > 0, "seed {seed}: {st:?}");
        assert_eq!(st.failed_loads, st.repaired_loads, "seed {seed}: {st:?}");
        repaired += st.repaired_loads;
    }
    assert!(repaired > 0, "no load failed and was repaired");
}

/// A state whose backup is in flight stays locked on device until the ack: a Mamba eviction
/// cannot free (and a later request reuse) the slot the copy still reads, so the host copy
/// holds the right bytes.
#[test]
fn a_state_being_backed_up_is_not_evicted_before_the_ack() {
    let mut c = build(&Setup {
        gated: true,
        ..Setup::mamba()
    });
    let gate = c.backend().gate().unwrap().clone();
    let a = tokens(1, 8);
    serve(&mut c, &a);
    assert_eq!(
        c.controller().pending().0,
        1,
        "the backup is held by the gate"
    );
    c.evict_mamba_states(usize::MAX);
    // Another request runs meanwhile and writes its own states (into a freed slot, if any).
    serve(&mut c, &tokens(2, 8));
    gate.open();
    c.flush().unwrap();
    c.check_invariants().unwrap();
    c.evict(usize::MAX / 2);
    let mut a2 = a.clone();
    a2.push(5);
    // The load-back checks the state's bytes against A's.
    let (_, loaded) = serve(&mut c, &a2);
    assert_eq!(loaded, 8);
    c.flush().unwrap();
    c.check_invariants().unwrap();
}

/// A load-back whose KV finds no device pages (a running request owns them) is abandoned
/// before anything is attached: the device Mamba slot taken for it goes back, the host copies
/// stay, and the request proceeds without the hit.
#[test]
fn a_load_that_cannot_get_its_pages_leaks_no_state_slot() {
    let mut c = build(&Setup {
        device_pages: 8,
        mamba: Some(MambaSetup {
            slots: 6,
            ..Default::default()
        }),
        ..Setup::mamba()
    });
    let a = tokens(1, 16);
    serve(&mut c, &a);
    c.flush().unwrap();
    c.evict(usize::MAX / 2);
    // X owns 6 of the 8 pages while it runs.
    let mut x = RequestKv::new(RadixKey::new(tokens(9, 24)));
    c.match_request(&mut x).unwrap();
    c.begin_request(&mut x).unwrap();
    c.alloc_tokens(&mut x, 24).unwrap();
    let held = c.device_cache().mamba_accounting().unwrap().request_owned;
    let mut b = a.clone();
    b.push(1);
    let mut r = RequestKv::new(RadixKey::new(b));
    let m = c.match_request(&mut r).unwrap();
    assert_eq!((m.prefix_len, m.host_hit_len), (0, 16));
    c.begin_request(&mut r).unwrap();
    assert_eq!(r.prefix_len, 0, "the load was abandoned");
    assert!(r.mamba_cow.is_none());
    assert_eq!(c.stats().load_back_device_full, 1, "{:?}", c.stats());
    assert_eq!(c.stats().mamba_states_loaded, 0);
    c.check_invariants().unwrap();
    c.check_request(&r).unwrap();
    let acc = c.device_cache().mamba_accounting().unwrap();
    assert_eq!(acc.request_owned, held + r.mamba_slots_held(), "{acc:?}");
    assert_eq!(c.host_mamba_states(), 1, "the host copy stays");
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    c.cache_finished_req(&mut x, FinishKind::Aborted).unwrap();
    c.check_invariants().unwrap();
    assert_eq!(
        c.device_cache().mamba_accounting().unwrap().request_owned,
        0
    );
}
