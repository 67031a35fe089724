//! A model with all three kinds of layers — full attention, sliding-window attention and
//! Mamba — through the manager: one radix tree carries both extra components, so a hit is
//! usable only where a Mamba state and a full live window precede its end; admission needs
//! room in each pool (full KV, SWA pages, a state slot) and waits, typed, for the one that is
//! short; sessions keep the running state and the window across turns; every pool balances
//! and nothing is left held at the end.

mod common;

use common::turns::turn;
use common::{admitted, balanced, session_budget};
use radixkv_scheduler_api::config::LayerPattern;
use radixkv_scheduler_api::{
    Admission, KvCacheManager, MambaPolicyKind, ModelGeometry, ReqId, Request, WaitReason,
};

/// 8 layers: 1 full attention, 4 sliding-window (window 8 tokens, 2 pages), 3 Mamba.
fn three_kinds() -> ModelGeometry {
    ModelGeometry {
        layers: 8,
        layer_pattern: Some(LayerPattern::parse("SMSASMSM").unwrap()),
        kv_bytes_per_token_per_layer: 1024,
        page_size: 4,
        sliding_window: Some(8),
        mamba_conv_state_bytes: Some(1024),
        mamba_ssm_state_bytes: Some(4096),
        compute: None,
    }
}

fn slot_bytes() -> u64 {
    three_kinds().checked_mamba_slot_bytes().unwrap()
}

fn swa_page_bytes() -> u64 {
    three_kinds().checked_swa_bytes_per_token().unwrap() * 4
}

fn manager(swa_pages: u64, slots: u64, sessions: bool) -> KvCacheManager {
    let mut b = KvCacheManager::builder()
        .model(three_kinds())
        .device_tokens(1024)
        .max_rows(8)
        .swa_bytes(swa_pages * swa_page_bytes())
        .mamba_bytes(slots * slot_bytes())
        .mamba_policy(MambaPolicyKind::Sglang);
    if sessions {
        b = b.sessions(session_budget());
    }
    let mut kv = b.build().unwrap();
    kv.set_check_every_step(true);
    kv
}

fn drained(kv: &mut KvCacheManager) {
    kv.drain().unwrap();
    balanced(kv);
    let a = kv.accounting();
    assert_eq!(a.session_held + a.protected + a.request_owned, 0, "{a:?}");
    let s = kv.swa_accounting().unwrap();
    assert_eq!(s.protected + s.request_owned, 0, "{s:?}");
    let m = kv.mamba_accounting().unwrap();
    assert_eq!(m.protected + m.request_owned, 0, "{m:?}");
}

#[test]
fn a_hit_needs_a_cached_state_and_every_pool_balances() {
    let mut kv = manager(64, 8, false);
    let prompt: Vec<u32> = (0..20).collect();
    assert_eq!(turn(&mut kv, None, prompt.clone(), 1).device_tokens, 0);
    // The request-end state at 20 (a page end) and its window are cached: the same prompt
    // plus more hits there.
    let mut more = prompt.clone();
    more.extend(100..106);
    assert_eq!(turn(&mut kv, None, more.clone(), 1).device_tokens, 20);
    // A prompt that shares only the first 16 tokens: the KV matches 16, but no state is
    // cached there, so nothing is usable (the radix tests cover the window side and the
    // cascade: tests/hybrid_model.rs).
    let mut fork: Vec<u32> = (0..16).collect();
    fork.extend(700..710);
    assert_eq!(turn(&mut kv, None, fork, 1).device_tokens, 0);
    drained(&mut kv);
}

#[test]
fn admission_waits_for_the_short_pool() {
    // Two state slots, two running requests: a third waits for a slot (the SWA and full-KV
    // pools have room).
    let mut kv = manager(64, 2, false);
    let mut ids = Vec::new();
    for base in [0u32, 100] {
        let r = kv
            .arrive(Request::new((base..base + 12).collect()).max_new_tokens(4))
            .unwrap();
        let adm = admitted(&mut kv, r);
        kv.extend(r, adm.extend_tokens).unwrap();
        ids.push(r);
    }
    let c = kv
        .arrive(Request::new((200..212).collect()).max_new_tokens(4))
        .unwrap();
    assert!(matches!(
        kv.admit(c).unwrap(),
        Admission::Wait(WaitReason::NoStateSlot)
    ));
    balanced(&kv);
    for r in ids {
        finish_running(&mut kv, r);
    }
    let adm = admitted(&mut kv, c);
    kv.extend(c, adm.extend_tokens).unwrap();
    finish_running(&mut kv, c);
    // Few SWA pages: a prompt longer than the SWA room waits for window room.
    let mut kv = manager(6, 8, false);
    let a = kv
        .arrive(Request::new((0..16).collect()).max_new_tokens(2))
        .unwrap();
    let adm = admitted(&mut kv, a);
    kv.extend(a, adm.extend_tokens).unwrap();
    let b = kv
        .arrive(Request::new((100..112).collect()).max_new_tokens(2))
        .unwrap();
    assert!(matches!(
        kv.admit(b).unwrap(),
        Admission::Wait(WaitReason::NoWindowRoom { .. })
    ));
    balanced(&kv);
    finish_running(&mut kv, a);
    drained(&mut kv);
}

fn finish_running(kv: &mut KvCacheManager, id: ReqId) {
    let s = kv.begin_step();
    kv.chunk_done(id).unwrap();
    kv.end_step(s).unwrap();
    kv.finish(id).unwrap();
    balanced(kv);
}

#[test]
fn sessions_keep_the_state_and_the_window_across_turns() {
    let mut kv = manager(64, 8, true);
    let t1: Vec<u32> = (0..30).collect();
    turn(&mut kv, Some(7), t1.clone(), 6);
    // The idle session holds its running state and its window.
    assert!(kv.mamba_accounting().unwrap().request_owned >= 1);
    assert!(kv.swa_accounting().unwrap().request_owned >= 1);
    let mut t2 = t1.clone();
    t2.extend((0..5).map(|i| 9_000 + i));
    t2.extend(100..110);
    // Turn 2 continues at the whole held length (35 computed), not cut back to a cached state.
    assert_eq!(turn(&mut kv, Some(7), t2.clone(), 3).device_tokens, 35);
    kv.close_session(7).unwrap();
    drained(&mut kv);
}
