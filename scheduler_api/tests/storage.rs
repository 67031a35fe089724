//! The storage tier (L3) through the manager: a request whose prefix is only in the store is
//! prefetched at arrival and hits (waiting for it under `wait_complete`, not under
//! `best_effort`); an abort while prefetching leaves nothing behind; a store that is down
//! degrades to recomputation with counters that say so; a store opened from the config (file,
//! memory) and the engine's own store both serve a restarted manager; KV events can carry the
//! keys the store holds the pages under.

mod common;

use std::sync::Arc;

use common::{admitted, balanced, step};
use radixkv_hicache::storage::{FaultConfig, FaultStore, MemStore, StorageBackend};
use radixkv_radix::{KvEvent, Medium, Namespace};
use radixkv_scheduler_api::{
    Admission, Admitted, HostTier, KvCacheManager, ManagerError, PrefetchStopPolicy, ReqId,
    Request, StorageBackendKind, StorageTier, WaitReason,
};

const PAGE: usize = 4;

fn tier(backend: StorageBackendKind, stop: PrefetchStopPolicy) -> HostTier {
    HostTier::ratio(256, 4.0)
        .load_back_min_tokens(PAGE)
        .storage(Some(
            StorageTier::new(backend, "test-model")
                .prefetch_threshold_tokens(PAGE)
                .stop(stop),
        ))
}

/// A manager (256 device tokens, 1024 host tokens, pages of 4) over the engine's `store`.
fn manager(store: Arc<dyn StorageBackend>, stop: PrefetchStopPolicy) -> KvCacheManager {
    KvCacheManager::builder()
        .page_size(PAGE)
        .device_tokens(256)
        .host_tier(tier(StorageBackendKind::Engine, stop))
        .storage_backend(store)
        .build()
        .unwrap()
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 100_000 + i).collect()
}

/// Admits `id`, stepping while it waits for its prefetch; returns the admission and how many
/// times it waited.
fn admit_after_prefetch(kv: &mut KvCacheManager, id: ReqId) -> (Admitted, usize) {
    let mut waits = 0;
    loop {
        match kv.admit(id).unwrap() {
            Admission::Ready(a) => return (a, waits),
            Admission::Wait(WaitReason::Prefetching) => {
                waits += 1;
                step(kv);
            }
            other => panic!("{other:?}"),
        }
    }
}

/// Prefills and finishes an admitted request in one step.
fn prefill_and_finish(kv: &mut KvCacheManager, id: ReqId, a: &Admitted) {
    kv.extend(id, a.extend_tokens).unwrap();
    let s = kv.begin_step();
    kv.chunk_done(id).unwrap();
    kv.end_step(s).unwrap();
    kv.finish(id).unwrap();
    step(kv);
    balanced(kv);
}

/// Serves `t` on `kv` and waits until its KV is in the store.
fn serve_and_store(kv: &mut KvCacheManager, t: &[u32]) {
    let r = kv
        .arrive(Request::new(t.to_vec()).max_new_tokens(1))
        .unwrap();
    let (a, _) = admit_after_prefetch(kv, r);
    prefill_and_finish(kv, r, &a);
    kv.drain().unwrap();
    balanced(kv);
}

/// Once every transfer is done, nothing is held for requests, and the host pool holds exactly
/// the tree's pages (the audit counts prefetch reservations; with none open, there are none).
fn nothing_leaked(kv: &mut KvCacheManager) {
    kv.drain().unwrap();
    balanced(kv);
    let a = kv.accounting();
    assert_eq!((a.request_owned, a.protected), (0, 0), "{a:?}");
    assert_eq!(kv.reserved_tokens(), 0);
}

#[test]
fn a_prefix_only_in_the_store_is_prefetched_and_hits() {
    let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
    let t = tokens(1, 64);
    let mut a = manager(store.clone(), PrefetchStopPolicy::WaitComplete {});
    serve_and_store(&mut a, &t);
    let m = a.metrics().counters;
    assert_eq!(m.backup_pages_written, 16, "{m:?}");
    assert_eq!(store.stats().pages, 16);

    // wait_complete: a restarted manager (device and host cold) waits for the pages, then
    // takes them as a host hit.
    let mut longer = t.clone();
    longer.extend(tokens(2, 8));
    let mut b = manager(store.clone(), PrefetchStopPolicy::WaitComplete {});
    let r = b
        .arrive(Request::new(longer.clone()).max_new_tokens(1))
        .unwrap();
    assert_eq!(b.metrics().counters.prefetches_started, 1);
    let (adm, waits) = admit_after_prefetch(&mut b, r);
    // The lookup runs in the background and a step applies it: the first admission waits.
    assert!(waits >= 1);
    assert_eq!((adm.device_tokens, adm.host_tokens), (0, 64));
    assert_eq!(adm.extend_tokens, 8);
    let m = b.metrics().counters;
    assert_eq!(m.hit_tokens_storage, 64, "{m:?}");
    assert_eq!(m.storage_loaded_tokens, 64);
    assert_eq!(m.prefetch_waits, waits as u64);
    prefill_and_finish(&mut b, r, &adm);
    b.drain().unwrap();
    // Only the new pages are written: the store had the others.
    assert_eq!(b.metrics().counters.backup_pages_written, 2);
    nothing_leaked(&mut b);

    // best_effort: admitted at once, with what has arrived — nothing, before any step.
    let mut c = manager(store.clone(), PrefetchStopPolicy::BestEffort {});
    let r = c
        .arrive(Request::new(longer.clone()).max_new_tokens(1))
        .unwrap();
    let adm = admitted(&mut c, r);
    assert_eq!((adm.device_tokens, adm.host_tokens), (0, 0));
    let m = c.metrics().counters;
    assert_eq!(
        (m.prefetches_started, m.prefetches_revoked),
        (1, 1),
        "{m:?}"
    );
    assert_eq!((m.hit_tokens_storage, m.prefetch_waits), (0, 0));
    prefill_and_finish(&mut c, r, &adm);
    nothing_leaked(&mut c);
    // ... and, once the pages have arrived, takes them without waiting: all 17 whole pages
    // before the last token, which `b` stored.
    let mut d = manager(store, PrefetchStopPolicy::BestEffort {});
    let r = d.arrive(Request::new(longer).max_new_tokens(1)).unwrap();
    d.wait_storage().unwrap();
    let adm = admitted(&mut d, r);
    assert_eq!((adm.device_tokens, adm.host_tokens), (0, 68));
    assert_eq!(d.metrics().counters.hit_tokens_storage, 68);
    prefill_and_finish(&mut d, r, &adm);
    nothing_leaked(&mut d);
}

#[test]
fn an_abort_while_prefetching_leaks_nothing() {
    let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
    let t = tokens(3, 128);
    let mut a = manager(store.clone(), PrefetchStopPolicy::WaitComplete {});
    serve_and_store(&mut a, &t);
    // Aborted during the lookup, while the fetch may be running, and once every page has
    // arrived (reserved host pages, not in the tree yet).
    for case in ["lookup", "fetch", "arrived"] {
        let mut b = manager(store.clone(), PrefetchStopPolicy::WaitComplete {});
        let r = b.arrive(Request::new(t.clone()).max_new_tokens(1)).unwrap();
        if case != "lookup" {
            step(&mut b);
        }
        if case == "arrived" {
            b.wait_storage().unwrap();
            assert_eq!(
                b.metrics().gauges.host_tokens,
                124,
                "reserved for the fetch"
            );
        }
        b.abort(r).unwrap();
        assert_eq!(
            b.metrics().gauges.host_tokens,
            0,
            "{case}: pages left reserved"
        );
        nothing_leaked(&mut b);
        // Completions of the aborted jobs change nothing when they arrive.
        b.wait_storage().unwrap();
        step(&mut b);
        assert_eq!(b.metrics().gauges.host_tokens, 0, "{case}");
        let m = b.metrics().counters;
        assert_eq!(
            (m.prefetches_started, m.hit_tokens_storage),
            (1, 0),
            "{case}"
        );
        nothing_leaked(&mut b);
    }
}

#[test]
fn a_store_that_is_down_degrades_to_recomputation() {
    let fault = Arc::new(FaultStore::new(MemStore::new(), FaultConfig::seeded(7)).unwrap());
    let store: Arc<dyn StorageBackend> = fault.clone();
    let t = tokens(4, 64);
    let mut a = manager(store.clone(), PrefetchStopPolicy::WaitComplete {});
    serve_and_store(&mut a, &t);
    assert_eq!(a.metrics().counters.backup_pages_written, 16);
    fault.set_down(true);
    let mut b = manager(store, PrefetchStopPolicy::WaitComplete {});
    let r = b.arrive(Request::new(t.clone()).max_new_tokens(1)).unwrap();
    let (adm, _) = admit_after_prefetch(&mut b, r);
    // The lookup failed: the whole prompt is computed.
    assert_eq!((adm.device_tokens, adm.host_tokens), (0, 0));
    assert_eq!(adm.extend_tokens, 64);
    prefill_and_finish(&mut b, r, &adm);
    b.drain().unwrap();
    let m = b.metrics().counters;
    assert_eq!(
        (m.prefetches_started, m.prefetches_revoked),
        (1, 1),
        "{m:?}"
    );
    assert_eq!(m.hit_tokens_storage, 0);
    // Its backups could not be written either, and say so.
    assert_eq!(m.backup_pages_written, 0);
    assert!(m.backup_pages_failed > 0, "{m:?}");
    assert!(fault.counts().down > 0);
    nothing_leaked(&mut b);
    // Up again: the next manager finds the pages the first one stored.
    fault.set_down(false);
    let mut c = manager(fault, PrefetchStopPolicy::WaitComplete {});
    let r = c.arrive(Request::new(t).max_new_tokens(1)).unwrap();
    let (adm, _) = admit_after_prefetch(&mut c, r);
    assert_eq!(adm.host_tokens, 60, "the last token is always computed");
    prefill_and_finish(&mut c, r, &adm);
    nothing_leaked(&mut c);
}

#[test]
fn a_file_store_from_the_config_serves_a_restarted_manager() {
    let dir = std::env::temp_dir().join(format!("radixkv-storage-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let backend = StorageBackendKind::File {
        dir: dir.clone(),
        capacity_tokens: Some(1 << 12),
        sync: Default::default(),
    };
    let build = || {
        KvCacheManager::builder()
            .page_size(PAGE)
            .device_tokens(256)
            .host_tier(tier(backend.clone(), PrefetchStopPolicy::default()))
            .build()
            .unwrap()
    };
    let t = tokens(5, 64);
    let mut a = build();
    assert!(a.has_storage());
    serve_and_store(&mut a, &t);
    drop(a);
    let mut b = build();
    let r = b.arrive(Request::new(t).max_new_tokens(1)).unwrap();
    let (adm, _) = admit_after_prefetch(&mut b, r);
    assert_eq!(adm.host_tokens, 60);
    prefill_and_finish(&mut b, r, &adm);
    nothing_leaked(&mut b);
    drop(b);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_engine_store_and_the_config_must_agree() {
    let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
    let memory = StorageBackendKind::Memory {
        capacity_tokens: None,
    };
    // A store handed over for a config that names another backend, or that has no storage
    // section; and an engine backend without a store.
    for (host, store) in [
        (
            tier(memory, PrefetchStopPolicy::default()),
            Some(store.clone()),
        ),
        (HostTier::ratio(256, 4.0), Some(store.clone())),
        (
            tier(StorageBackendKind::Engine, PrefetchStopPolicy::default()),
            None,
        ),
    ] {
        let mut b = KvCacheManager::builder()
            .page_size(PAGE)
            .device_tokens(256)
            .host_tier(host);
        if let Some(s) = store {
            b = b.storage_backend(s);
        }
        match b.build() {
            Err(ManagerError::Config(m)) => assert!(m.contains("storage"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
    // A device-only cache with a store: refused too.
    let r = KvCacheManager::builder()
        .device_tokens(256)
        .storage_backend(store)
        .build();
    assert!(matches!(r, Err(ManagerError::Config(_))), "{r:?}");
}

#[test]
fn kv_events_carry_the_keys_the_store_holds_its_pages_under() {
    let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
    let mut kv = KvCacheManager::builder()
        .page_size(PAGE)
        .device_tokens(256)
        .host_tier(tier(
            StorageBackendKind::Engine,
            PrefetchStopPolicy::WaitComplete {},
        ))
        .storage_backend(store.clone())
        .events(true)
        .event_page_keys(true)
        .build()
        .unwrap();
    let t = tokens(3, 64);
    let tenant = Namespace::new("tenant-b");
    let mut keys = Vec::new();
    for ns in [Namespace::DEFAULT, tenant] {
        let r = kv
            .arrive(Request::new(t.clone()).namespace(ns).max_new_tokens(1))
            .unwrap();
        let (a, _) = admit_after_prefetch(&mut kv, r);
        prefill_and_finish(&mut kv, r, &a);
        kv.drain().unwrap();
        let mut stored = Vec::new();
        for ev in kv.take_events() {
            if let KvEvent::BlockStored {
                page_keys,
                page_hashes,
                medium: Medium::Device,
                ..
            } = ev
            {
                assert_eq!(page_keys.len(), page_hashes.len());
                stored.extend(page_keys);
            }
        }
        assert_eq!(stored.len(), 16);
        keys.push(stored);
    }
    // Every key an event named is a key the store holds a page under, and the two
    // namespaces' pages have different keys.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for k in &keys {
        assert_eq!(rt.block_on(store.exists_prefix(k)).unwrap(), 16);
    }
    assert!(keys[0].iter().all(|k| !keys[1].contains(k)));
    assert_eq!(store.stats().pages, 32);
    nothing_leaked(&mut kv);
}

#[test]
fn event_page_keys_need_events_and_a_storage_tier() {
    let build = |events: bool, storage: bool| {
        let mut b = KvCacheManager::builder()
            .page_size(PAGE)
            .device_tokens(256)
            .events(events)
            .event_page_keys(true);
        if storage {
            b = b.host_tier(tier(
                StorageBackendKind::Memory {
                    capacity_tokens: None,
                },
                PrefetchStopPolicy::BestEffort {},
            ));
        } else {
            b = b.host_tier(HostTier::ratio(256, 4.0));
        }
        b.build()
    };
    for (events, storage) in [(false, true), (true, false)] {
        let e = build(events, storage).unwrap_err();
        assert!(
            matches!(&e, ManagerError::Config(m) if m.contains("event_page_keys")),
            "{e:?}"
        );
    }
    assert!(build(true, true).is_ok());
}

/// A hybrid model (Mamba and sliding-window layers beside full attention; or one of them)
/// with a storage tier: the stored pages carry the request-end state and the window KV, so a
/// restarted manager's second pass over the same prompt gets them as a storage hit, with the
/// state and the window loaded back with the KV.
#[test]
fn hybrid_models_with_a_storage_tier_hit_in_the_store_on_a_second_pass() {
    use radixkv_scheduler_api::config::LayerPattern;
    use radixkv_scheduler_api::{MambaPolicyKind, ModelGeometry};
    for pattern in ["SMSASMSM", "AMMM", "SSSA"] {
        let p = LayerPattern::parse(pattern).unwrap();
        let mamba = pattern.contains('M');
        let swa = pattern.contains('S');
        let model = ModelGeometry {
            layers: pattern.len() as u32,
            layer_pattern: Some(p),
            kv_bytes_per_token_per_layer: 1024,
            page_size: PAGE,
            sliding_window: swa.then_some(8),
            mamba_conv_state_bytes: mamba.then_some(1024),
            mamba_ssm_state_bytes: mamba.then_some(4096),
            compute: None,
        };
        let store: Arc<dyn StorageBackend> = Arc::new(MemStore::new());
        let build = || {
            let mut b = KvCacheManager::builder()
                .model(model.clone())
                .device_tokens(1024)
                .max_rows(8)
                .host_tier(
                    HostTier::ratio(1024, 4.0)
                        .load_back_min_tokens(PAGE)
                        .storage(Some(
                            StorageTier::new(StorageBackendKind::Engine, "hybrid-test-model")
                                .prefetch_threshold_tokens(PAGE)
                                .stop(PrefetchStopPolicy::WaitComplete {}),
                        )),
                )
                .storage_backend(store.clone());
            if swa {
                let page = model.checked_swa_bytes_per_token().unwrap() * PAGE as u64;
                b = b.swa_bytes(64 * page);
            }
            if mamba {
                let slot = model.checked_mamba_slot_bytes().unwrap();
                b = b
                    .mamba_bytes(8 * slot)
                    .mamba_policy(MambaPolicyKind::Sglang);
            }
            b.build().unwrap()
        };
        let t = tokens(7, 64);
        let mut a = build();
        assert!(a.has_storage(), "{pattern}");
        serve_and_store(&mut a, &t);
        let m = a.metrics().counters;
        assert_eq!(m.backup_pages_written, 16, "{pattern}: {m:?}");
        drop(a);

        // A restarted manager, device and host cold: the prompt's 64 tokens come from the
        // store (the state after them and the window before them with them).
        let mut b = build();
        let mut longer = t.clone();
        longer.extend(tokens(8, 8));
        let r = b.arrive(Request::new(longer).max_new_tokens(1)).unwrap();
        let (adm, _) = admit_after_prefetch(&mut b, r);
        assert_eq!(
            (adm.device_tokens, adm.host_tokens),
            (0, 64),
            "{pattern}: {:?}",
            b.metrics().counters
        );
        let m = b.metrics().counters;
        assert_eq!(m.hit_tokens_storage, 64, "{pattern}: {m:?}");
        prefill_and_finish(&mut b, r, &adm);
        nothing_leaked(&mut b);
    }
}
