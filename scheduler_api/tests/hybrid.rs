//! A hybrid Transformer–Mamba model (the Jamba-like preset) through the manager: slot pool
//! sizing, admission that needs KV room and a state slot, the copy on write of a hit, a model
//! with sliding-window layers too under a host tier, and the `mamba_*` metrics.

mod common;

use common::{admitted, balanced, jamba};
use radixkv_scheduler_api::{
    Admission, CacheKind, CheckpointKind, HostTier, KvCacheManager, MambaPolicyKind, ManagerConfig,
    ManagerError, Preset, ReqId, Request, WaitReason,
};

fn slot_bytes() -> u64 {
    jamba().checked_mamba_slot_bytes().unwrap()
}

/// A Jamba-like manager of 1024 device tokens and `slots` state slots under the SGLang-style
/// baseline (a running slot and a tracking slot per running request; states at every chunk
/// end, the branching point and the request end).
fn manager(slots: u64) -> KvCacheManager {
    manager_with(slots, MambaPolicyKind::Sglang)
}

fn manager_with(slots: u64, policy: MambaPolicyKind) -> KvCacheManager {
    KvCacheManager::builder()
        .model(jamba())
        .device_tokens(1024)
        .mamba_bytes(slots * slot_bytes())
        .mamba_policy(policy)
        .build()
        .unwrap()
}

/// Arrives, admits and prefills `tokens` in one chunk; returns the handle and the admission.
fn prefill(kv: &mut KvCacheManager, tokens: Vec<u32>) -> (ReqId, radixkv_scheduler_api::Admitted) {
    let r = kv.arrive(Request::new(tokens).max_new_tokens(4)).unwrap();
    let a = admitted(kv, r);
    kv.extend(r, a.extend_tokens).unwrap();
    let step = kv.begin_step();
    kv.chunk_done(r).unwrap();
    kv.end_step(step).unwrap();
    (r, a)
}

#[test]
fn a_hit_copies_the_cached_state_into_the_requests_own_slot() {
    let mut kv = manager(8);
    assert_eq!(kv.mamba_accounting().unwrap().total, 8);
    // First request: a miss with a fresh slot of its own.
    let (a, adm) = prefill(&mut kv, (0..12).collect());
    assert_eq!(adm.device_tokens, 0);
    assert_eq!(adm.kv_match_tokens, 0);
    assert!(adm.mamba_cow.is_none());
    let slot_a = adm.mamba_slot.expect("a running request holds a slot");
    assert_eq!(kv.mamba_slot(a).unwrap(), Some(slot_a));
    // Its running slot and its tracking slot.
    assert!(adm.mamba_track.is_some());
    assert_eq!(kv.mamba_accounting().unwrap().request_owned, 2);
    // 12 tokens end a page: its state is stored as the checkpoint of the inserted key.
    kv.finish(a).unwrap();
    let acc = kv.mamba_accounting().unwrap();
    assert_eq!((acc.request_owned, acc.evictable), (0, 1), "{acc:?}");
    assert_eq!(kv.metrics().counters.mamba_states_stored, 1);

    // Same 12 tokens and more: the state is usable, copied into a new slot.
    let (b, adm) = prefill(&mut kv, (0..16).collect());
    assert_eq!(adm.device_tokens, 12);
    assert_eq!(adm.kv_match_tokens, 12);
    assert_eq!(adm.extend_tokens, 4);
    let cow = adm.mamba_cow.expect("a hit copies the cached state");
    assert_eq!(Some(cow.dst), adm.mamba_slot);
    assert_ne!(cow.src, cow.dst);
    // The copy has run once a chunk is done; the source state is unlocked again.
    assert_eq!(kv.mamba_cow(b).unwrap(), None);
    balanced(&kv);
    kv.finish(b).unwrap();

    // A request that shares only the first 8 tokens: the KV matches 8 tokens but no state ends
    // there, so nothing is usable and the forward should checkpoint at 8.
    let mut tokens: Vec<u32> = (0..8).collect();
    tokens.extend(100..110);
    let (c, adm) = prefill(&mut kv, tokens);
    assert_eq!(adm.device_tokens, 0);
    assert_eq!(adm.kv_match_tokens, 8);
    assert!(adm.mamba_cow.is_none());
    kv.finish(c).unwrap();

    let m = kv.metrics();
    assert_eq!(m.counters.mamba_state_hits, 1);
    assert_eq!(m.counters.hit_tokens_device, 12);
    assert_eq!(m.counters.kv_match_tokens, 12 + 8);
    assert_eq!(m.gauges.mamba_slots_request_owned, 0);
    assert_eq!(
        m.gauges.mamba_slots_free + m.gauges.mamba_slots_evictable,
        8,
        "no slot leaks: {:?}",
        kv.mamba_accounting()
    );
    balanced(&kv);
}

#[test]
fn admission_waits_for_a_state_slot_and_evicts_a_cached_state_for_one() {
    let mut kv = manager(2);
    let (a, _) = prefill(&mut kv, (0..8).collect());
    let (b, _) = prefill(&mut kv, (50..58).collect());
    // Both slots are held by running requests: the third waits, holding nothing.
    let c = kv.arrive(Request::new((90..98).collect())).unwrap();
    let (pool, slots) = (kv.accounting(), kv.mamba_accounting());
    assert_eq!(
        kv.admit(c).unwrap(),
        Admission::Wait(WaitReason::NoStateSlot)
    );
    assert_eq!(kv.mamba_slot(c).unwrap(), None);
    assert_eq!(kv.accounting(), pool, "the wait holds no KV");
    assert_eq!(kv.mamba_accounting(), slots, "nor a slot");
    balanced(&kv);
    // a finishes and caches its state; c's admission evicts it (the LRU unlocked state).
    kv.finish(a).unwrap();
    assert_eq!(kv.mamba_accounting().unwrap().evictable, 1);
    let adm = admitted(&mut kv, c);
    assert!(adm.mamba_slot.is_some() && adm.mamba_cow.is_none());
    let m = kv.metrics();
    assert_eq!(m.counters.mamba_states_evicted, 1);
    assert_eq!(m.counters.admission_waits, 1);
    kv.abort(c).unwrap();
    kv.finish(b).unwrap();
    let acc = kv.mamba_accounting().unwrap();
    assert_eq!((acc.request_owned, acc.evictable, acc.free), (0, 1, 1));
    balanced(&kv);
}

#[test]
fn the_disabled_cache_gives_every_request_a_slot_and_keeps_no_state() {
    let mut kv = KvCacheManager::builder()
        .model(jamba())
        .device_tokens(1024)
        .cache(CacheKind::Disabled)
        .mamba_bytes(4 * slot_bytes())
        .build()
        .unwrap();
    for _ in 0..3 {
        let (r, adm) = prefill(&mut kv, (0..12).collect());
        assert_eq!((adm.device_tokens, adm.kv_match_tokens), (0, 0));
        assert!(adm.mamba_slot.is_some());
        kv.finish(r).unwrap();
    }
    let acc = kv.mamba_accounting().unwrap();
    assert_eq!((acc.free, acc.evictable), (4, 0), "{acc:?}");
    assert_eq!(kv.metrics().counters.mamba_states_stored, 0);
    balanced(&kv);
}

#[test]
fn retract_caches_the_state_at_a_page_end_and_the_request_hits_it_again() {
    let mut kv = manager(4);
    let (r, _) = prefill(&mut kv, (0..8).collect());
    kv.retract(r).unwrap();
    assert_eq!(kv.mamba_slot(r).unwrap(), None);
    assert_eq!(kv.mamba_accounting().unwrap().evictable, 1);
    let adm = admitted(&mut kv, r);
    // max_match_len is len − 1 = 7: the 4-token page is the deepest aligned prefix, which has
    // no state (the state is at 8), so nothing is usable.
    assert_eq!(adm.device_tokens, 0);
    assert_eq!(adm.kv_match_tokens, 4);
    kv.abort(r).unwrap();
    balanced(&kv);
}

#[test]
fn swa_and_mamba_layers_build_under_a_host_tier() {
    // (Sessions are wired: see `hybrid_sessions.rs`; the host tier: `hybrid_hicache.rs`.)
    // Sliding-window and Mamba layers in one model under a host tier build too: one tree
    // carries both components and the host tier moves both with their KV.
    let mut both = Preset::JambaLike.geometry();
    both.layers = 8;
    both.layer_pattern =
        Some(radixkv_scheduler_api::config::LayerPattern::parse("SMSASMSM").unwrap());
    both.sliding_window = Some(64);
    let kv = KvCacheManager::builder()
        .model(both)
        .device_tokens(4096)
        .host_tier(HostTier::ratio(4096, 2.0))
        .build()
        .unwrap();
    assert!(kv.swa_accounting().is_some(), "the SWA pool");
    assert!(kv.mamba_accounting().is_some(), "the Mamba pool");
}

#[test]
fn bad_mamba_budgets_are_typed_config_errors() {
    let slot = slot_bytes();
    for (budget, says) in [
        (slot - 1, "fits no state slot"),
        (0, "fits no state slot"),
        // A hit holds the cached state and the request's copy: one slot could never serve it.
        (slot, "at least 2"),
        (2 * slot - 1, "at least 2"),
        (u64::MAX, "more than"),
    ] {
        let e = KvCacheManager::builder()
            .model(jamba())
            .device_tokens(1024)
            .mamba_bytes(budget)
            .build()
            .err()
            .unwrap();
        match e {
            ManagerError::Config(m) => assert!(m.contains(says), "{budget}: {m}"),
            e => panic!("{budget}: expected a config error, got {e:?}"),
        }
    }
    // A Mamba budget for a model without Mamba layers is refused, not ignored.
    let e = KvCacheManager::builder()
        .device_tokens(1024)
        .mamba_bytes(slot)
        .build()
        .err()
        .unwrap();
    assert!(
        matches!(&e, ManagerError::Config(m) if m.contains("no Mamba layer")),
        "{e:?}"
    );
    // Two slots exactly is a pool.
    assert_eq!(manager(2).mamba_accounting().unwrap().total, 2);
}

#[test]
fn openmetrics_exports_the_mamba_slots_and_state_counters() {
    let mut kv = manager(4);
    let (a, _) = prefill(&mut kv, (0..8).collect());
    kv.finish(a).unwrap();
    let (b, _) = prefill(&mut kv, (0..12).collect());
    let text = kv.metrics().to_openmetrics();
    for line in [
        // b's running slot and its (fresh) tracking slot.
        "radixkv_mamba_slots{state=\"free\"} 0\n",
        "radixkv_mamba_slots{state=\"request_owned\"} 2\n",
        // The chunk-end states at 8 (a's) and 12 (b's); the copied one is unlocked once b's
        // first chunk is done.
        "radixkv_mamba_slots{state=\"evictable\"} 2\n",
        "radixkv_mamba_slots{state=\"protected\"} 0\n",
        "radixkv_mamba_slot_capacity 4\n",
        "radixkv_mamba_states_total{event=\"stored\"} 2\n",
        "radixkv_mamba_states_total{event=\"hit\"} 1\n",
        "radixkv_mamba_states_total{event=\"evicted\"} 0\n",
        "radixkv_mamba_states_total{event=\"skipped\"} 0\n",
        "radixkv_kv_match_tokens_total 8\n",
        // a ended a page: its running state was its chunk's (already stored), and the
        // tracking slots were handed over at the chunks, not at a finish.
        "radixkv_mamba_tracking_total{event=\"stored\"} 0\n",
        "radixkv_mamba_tracking_total{event=\"skipped\"} 0\n",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    kv.finish(b).unwrap();
    // A KV-only model exports no Mamba family.
    let dense = KvCacheManager::builder()
        .device_tokens(1024)
        .build()
        .unwrap();
    assert!(dense.mamba_accounting().is_none());
    assert!(!dense.metrics().to_openmetrics().contains("mamba"));
}

#[test]
fn marconi_is_the_default_and_hands_the_engine_its_checkpoints() {
    // Left out, the policy is Marconi, named in the label.
    let kv = KvCacheManager::builder()
        .model(jamba())
        .device_tokens(1024)
        .mamba_bytes(8 * slot_bytes())
        .build()
        .unwrap();
    assert_eq!(kv.config().label(), "radix-lru+mamba-marconi");
    let mut kv = manager_with(8, MambaPolicyKind::Marconi);
    // A first request leaves its state at its end (12 tokens end a page).
    let (a, adm) = prefill(&mut kv, (0..12).collect());
    assert!(
        adm.mamba_checkpoints.is_empty(),
        "nothing cached to branch from"
    );
    kv.finish(a).unwrap();
    assert_eq!(kv.metrics().counters.mamba_states_stored, 1);
    // A request that leaves the cached path after 8 tokens: no state there, so nothing is
    // usable, and the engine is told to checkpoint its state at the branch point, in a slot
    // of its own beside the running state's.
    let mut tokens: Vec<u32> = (0..8).collect();
    tokens.extend(100..110);
    let r = kv.arrive(Request::new(tokens).max_new_tokens(2)).unwrap();
    let adm = admitted(&mut kv, r);
    assert_eq!((adm.device_tokens, adm.kv_match_tokens), (0, 8));
    assert_eq!(adm.mamba_checkpoints.len(), 1, "{adm:?}");
    let c = adm.mamba_checkpoints[0];
    assert_eq!((c.pos, c.kind), (8, CheckpointKind::Branch));
    assert_ne!(Some(c.slot), adm.mamba_slot);
    assert_eq!(kv.mamba_checkpoints(r).unwrap(), &adm.mamba_checkpoints[..]);
    // Running, branch checkpoint and tracking slots.
    assert_eq!(kv.mamba_accounting().unwrap().request_owned, 3);
    kv.extend(r, adm.extend_tokens).unwrap();
    let step = kv.begin_step();
    kv.chunk_done(r).unwrap();
    kv.end_step(step).unwrap();
    // The chunk inserted the KV past 8: the checkpoint is the tree's now, and so is the
    // state at the chunk's end (16) from the tracking slot.
    assert!(kv.mamba_checkpoints(r).unwrap().is_empty());
    assert_eq!(kv.metrics().counters.mamba_states_stored, 3);
    kv.finish(r).unwrap();
    balanced(&kv);
    // A third request on the same 8 tokens hits the branch-point state.
    let mut tokens: Vec<u32> = (0..8).collect();
    tokens.extend(200..210);
    let (n, adm) = prefill(&mut kv, tokens);
    assert_eq!(adm.device_tokens, 8);
    assert!(adm.mamba_cow.is_some());
    kv.finish(n).unwrap();
    assert_eq!(kv.metrics().counters.mamba_state_hits, 1);
    assert_eq!(kv.mamba_accounting().unwrap().request_owned, 0);
    balanced(&kv);
}

#[test]
fn mamba_policy_is_a_typed_config_key() {
    let jamba = "[model]\npreset = \"jamba-like\"\n";
    for (name, kind) in [
        ("marconi", MambaPolicyKind::Marconi),
        ("sglang", MambaPolicyKind::Sglang),
    ] {
        let c =
            ManagerConfig::from_toml_str(&format!("mamba_policy = \"{name}\"\n{jamba}")).unwrap();
        assert_eq!(c.mamba_policy, Some(kind));
        assert_eq!(c.label(), format!("radix-lru+mamba-{name}"));
    }
    let e = ManagerConfig::from_toml_str(&format!("mamba_policy = \"lru\"\n{jamba}")).unwrap_err();
    assert!(
        matches!(&e, ManagerError::Config(m) if m.contains("marconi") && m.contains("sglang")),
        "{e:?}"
    );
    // On a model without Mamba layers the key would mean nothing: refused.
    let e = ManagerConfig::from_toml_str("mamba_policy = \"sglang\"\n").unwrap_err();
    assert!(
        matches!(&e, ManagerError::Config(m) if m.contains("no Mamba layer")),
        "{e:?}"
    );
    // Marconi weighs states by FLOPs: a Mamba model without a compute shape must say so.
    let mut model = jamba_geometry_without_compute();
    model.page_size = 4;
    let e = KvCacheManager::builder()
        .model(model.clone())
        .device_tokens(4096)
        .build()
        .unwrap_err();
    assert!(
        matches!(&e, ManagerError::Config(m) if m.contains("[model.compute]")),
        "{e:?}"
    );
    // The baseline needs no FLOPs.
    assert!(
        KvCacheManager::builder()
            .model(model)
            .device_tokens(4096)
            .mamba_policy(MambaPolicyKind::Sglang)
            .build()
            .is_ok()
    );
}

fn jamba_geometry_without_compute() -> radixkv_scheduler_api::ModelGeometry {
    radixkv_scheduler_api::ModelGeometry {
        compute: None,
        ..Preset::JambaLike.geometry()
    }
}

/// Decodes `n` tokens (one step each) for a running request.
fn decode(kv: &mut KvCacheManager, r: ReqId, n: u32) {
    for i in 0..n {
        let step = kv.begin_step();
        kv.decode(r, 1000 + i).unwrap();
        kv.end_step(step).unwrap();
    }
}

#[test]
fn the_tracking_slot_is_handed_to_the_engine_and_follows_the_chunks() {
    for policy in MambaPolicyKind::ALL {
        let mut kv = manager_with(8, policy);
        let r = kv
            .arrive(Request::new((0..10).collect()).max_new_tokens(4))
            .unwrap();
        let adm = admitted(&mut kv, r);
        let t = adm
            .mamba_track
            .expect("a spare slot: the request tracks its state");
        assert_eq!(t.pos, 0, "{policy:?}: nothing cached, the zero state");
        assert_ne!(Some(t.slot), adm.mamba_slot);
        assert_eq!(kv.mamba_track(r).unwrap(), Some(t));
        // Two chunks: 6 tokens (boundary 4 passed), then 4 more (boundary 8). Each hands the
        // tracked state to the tree (the state at the chunk's end) and the request goes on
        // with a fresh tracking slot, which the engine reads again.
        let mut last = t;
        for (i, (n, pos)) in [(6, 4), (4, 8)].into_iter().enumerate() {
            kv.extend(r, n).unwrap();
            let step = kv.begin_step();
            kv.chunk_done(r).unwrap();
            kv.end_step(step).unwrap();
            let now = kv.mamba_track(r).unwrap().unwrap();
            assert_eq!(now.pos, pos, "{policy:?}");
            assert_ne!(now.slot, last.slot, "{policy:?}: a fresh slot");
            assert_ne!(Some(now.slot), adm.mamba_slot);
            assert_eq!(
                kv.mamba_accounting().unwrap().evictable,
                i + 1,
                "{policy:?}"
            );
            last = now;
        }
        kv.check_invariants().unwrap();
        kv.finish(r).unwrap();
        assert_eq!(kv.mamba_track(r).ok().flatten(), None);
        let acc = kv.mamba_accounting().unwrap();
        assert_eq!(acc.request_owned, 0, "{policy:?}: no slot leaks: {acc:?}");
        balanced(&kv);
    }
    // A model without Mamba layers hands over none.
    let mut dense = KvCacheManager::builder()
        .device_tokens(1024)
        .build()
        .unwrap();
    let r = dense.arrive(Request::new((0..10).collect())).unwrap();
    assert_eq!(admitted(&mut dense, r).mamba_track, None);
    assert_eq!(dense.mamba_track(r).unwrap(), None);
}

#[test]
fn an_unaligned_finish_stores_the_tracked_state_at_the_page_floor_and_the_next_request_hits_it() {
    for policy in MambaPolicyKind::ALL {
        let mut kv = manager_with(8, policy);
        // 10 prompt tokens (the chunk hands the state at 8 over) and three decoded: 13
        // computed at the finish, which ends no page.
        let (r, _) = prefill(&mut kv, (0..10).collect());
        let track = kv.mamba_track(r).unwrap().expect("a tracking slot");
        assert_eq!(track.pos, 8);
        decode(&mut kv, r, 3);
        kv.finish(r).unwrap();
        let m = kv.metrics();
        assert_eq!(m.counters.mamba_tracked_stored, 1, "{policy:?}");
        assert_eq!(m.counters.mamba_states_stored, 2, "{policy:?}");
        assert_eq!(m.gauges.mamba_slots_request_owned, 0);
        assert_eq!(
            m.gauges.mamba_slots_evictable, 2,
            "the chunk's state and the tracked one stay"
        );
        balanced(&kv);

        // The next request on the path hits the state at 12 = floor(13, 4) and copies it
        // from the tracking slot.
        let mut tokens: Vec<u32> = (0..10).collect();
        tokens.extend([1000, 1001]);
        tokens.extend(200..206);
        let (n, adm) = prefill(&mut kv, tokens);
        assert_eq!(
            (adm.device_tokens, adm.kv_match_tokens),
            (12, 12),
            "{policy:?}"
        );
        let cow = adm.mamba_cow.expect("a hit copies the cached state");
        assert_eq!(cow.src, track.slot, "the tracked state is the one stored");
        assert_eq!(adm.mamba_track.map(|t| t.pos), Some(12));
        kv.finish(n).unwrap();
        let m = kv.metrics();
        assert_eq!(m.counters.mamba_state_hits, 1);
        assert_eq!(m.counters.hit_tokens_device, 12);
        assert_eq!(m.gauges.mamba_slots_request_owned, 0, "no slot leaks");
        assert_eq!(
            m.gauges.mamba_slots_free + m.gauges.mamba_slots_evictable,
            8
        );
        balanced(&kv);
    }
}

#[test]
fn an_aborted_request_frees_its_tracking_slot_and_stores_nothing() {
    let mut kv = manager(4);
    let (r, adm) = prefill(&mut kv, (0..10).collect());
    assert!(adm.mamba_track.is_some());
    assert_eq!(kv.mamba_accounting().unwrap().request_owned, 2);
    kv.abort(r).unwrap();
    // The chunk's state (at 8) stays; the abort stores nothing more.
    let acc = kv.mamba_accounting().unwrap();
    assert_eq!(
        (acc.request_owned, acc.free, acc.evictable),
        (0, 3, 1),
        "{acc:?}"
    );
    assert_eq!(kv.metrics().counters.mamba_tracked_stored, 0);
    balanced(&kv);
}

#[test]
fn tracking_slots_are_only_taken_while_another_request_can_still_get_a_slot() {
    // 3 slots: a takes its running slot and a tracking slot (one stays free), b only its
    // running slot (taking the last would leave none), and c waits for a slot.
    let mut kv = manager(3);
    let (a, adm_a) = prefill(&mut kv, (0..10).collect());
    assert!(adm_a.mamba_track.is_some());
    let (b, adm_b) = prefill(&mut kv, (50..60).collect());
    assert_eq!(adm_b.mamba_track, None, "no spare slot");
    assert_eq!(kv.metrics().counters.mamba_tracks_skipped, 1);
    let c = kv.arrive(Request::new((90..98).collect())).unwrap();
    let slots = kv.mamba_accounting();
    assert_eq!(
        kv.admit(c).unwrap(),
        Admission::Wait(WaitReason::NoStateSlot)
    );
    assert_eq!(kv.mamba_accounting(), slots, "the wait holds no slot");
    assert_eq!(slots.unwrap().request_owned, 3);
    // a finishes off a page, past its chunk's end (13 computed): its tracked state is
    // stored, its running slot freed; c runs (evicting nothing: a slot is free).
    decode(&mut kv, a, 3);
    kv.finish(a).unwrap();
    assert_eq!(kv.metrics().counters.mamba_tracked_stored, 1);
    let adm_c = admitted(&mut kv, c);
    assert!(adm_c.mamba_slot.is_some());
    kv.finish(b).unwrap();
    kv.finish(c).unwrap();
    let acc = kv.mamba_accounting().unwrap();
    assert_eq!(acc.request_owned, 0, "{acc:?}");
    balanced(&kv);
}
