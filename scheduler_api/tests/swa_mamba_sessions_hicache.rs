//! Streaming sessions on a model with all three kinds of layers (full attention, sliding
//! window and Mamba) under a host tier: a session's slot keeps the window KV and the running
//! state of its last turn across turns as on the device-only cache; demotion (idle TTL or the
//! held-token budget) hands its KV, window KV and state to the tree, which backs all three up;
//! once they have left the device, the session's next turn loads all three back, copies the
//! loaded state on write and continues there; close frees what the slot holds. Every pool
//! balances after each call and nothing is left behind.

mod common;

use common::turns::{drained, expire, next, start, turn};
use common::{balanced, session_budget};
use radixkv_scheduler_api::config::LayerPattern;
use radixkv_scheduler_api::{
    HostTier, KvCacheManager, MambaPolicyKind, ModelGeometry, SessionBudget,
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

/// A three-kind manager over a host tier of `ratio` × the device: `device_tokens` full-KV
/// tokens, `swa_pages` SWA pages, `slots` state slots, sessions on, audited at every step.
fn manager(
    device_tokens: usize,
    swa_pages: u64,
    slots: u64,
    ratio: f64,
    sessions: SessionBudget,
) -> KvCacheManager {
    let m = three_kinds();
    let swa_page = m.checked_swa_bytes_per_token().unwrap() * 4;
    let slot = m.checked_mamba_slot_bytes().unwrap();
    let mut host = HostTier::ratio(device_tokens, ratio);
    host.load_back_min_tokens = 4;
    let mut kv = KvCacheManager::builder()
        .model(m)
        .device_tokens(device_tokens)
        .max_rows(8)
        .swa_bytes(swa_pages * swa_page)
        .mamba_bytes(slots * slot)
        .mamba_policy(MambaPolicyKind::Sglang)
        .host_tier(host)
        .sessions(sessions)
        .build()
        .unwrap();
    kv.set_check_every_step(true);
    kv
}

/// [`session_budget`] shrunk to half the device.
fn half(device_tokens: usize) -> SessionBudget {
    SessionBudget {
        max_held_tokens: device_tokens / 2,
        per_session_cap_tokens: device_tokens / 2,
        ..session_budget()
    }
}

#[test]
fn turns_continue_in_the_held_slot_and_demotion_and_close_hand_it_back() {
    let mut kv = manager(1024, 64, 8, 2.0, session_budget());
    let t1: Vec<u32> = (0..30).collect();
    let a1 = turn(&mut kv, Some(7), t1.clone(), 6);
    assert_eq!(a1.cached_tokens(), 0);
    // The idle session owns its window past the prefill's insert and its running state.
    assert_eq!(kv.metrics().gauges.held_sessions, 1);
    assert!(kv.swa_accounting().unwrap().request_owned > 0);
    assert!(kv.mamba_accounting().unwrap().request_owned >= 1);
    // Turn 2 continues at the whole held length (30 + 5 computed) in the session's own state
    // slot (no copy) and window, while the backup of turn 1's prefill may still be in flight.
    let t2 = next(&t1, 6, 100..110);
    let a2 = turn(&mut kv, Some(7), t2.clone(), 4);
    assert_eq!((a2.device_tokens, a2.host_tokens), (35, 0), "{a2:?}");
    assert_eq!(a2.mamba_slot, a1.mamba_slot);
    assert_eq!(a2.mamba_cow, None);
    // The TTL demotes the idle session: its KV, window and state go to the tree (and are
    // backed up), so the next turn matches the history's page-aligned end there and copies
    // the cached state on write.
    expire(&mut kv);
    assert_eq!(kv.swa_accounting().unwrap().request_owned, 0);
    assert_eq!(kv.mamba_accounting().unwrap().request_owned, 0);
    let t3 = next(&t2, 4, 200..203);
    let a3 = turn(&mut kv, Some(7), t3.clone(), 3);
    assert_eq!((a3.device_tokens, a3.host_tokens), (48, 0), "{a3:?}");
    assert!(a3.mamba_cow.is_some(), "{a3:?}");
    // And the turn after the demotion is a session turn again.
    let t4 = next(&t3, 3, 300..302);
    let a4 = turn(&mut kv, Some(7), t4, 2);
    assert_eq!(a4.device_tokens, t3.len() + 2);
    assert_eq!(a4.mamba_cow, None);
    kv.close_session(7).unwrap();
    drained(&mut kv);
}

/// The demoted session's KV, window KV and state are backed up with the tree's; other traffic
/// then evicts all three from the device (the host keeps them). The session's next turn loads
/// them back from the host, hits there, copies the loaded state on write, and its slot
/// carries on for the turn after.
#[test]
fn a_demoted_session_window_and_state_come_back_from_the_host() {
    let mut kv = manager(64, 16, 8, 4.0, half(64));
    // Session 7: 10 prompt tokens and 2 decoded, 12 computed (a page end).
    let t1: Vec<u32> = (0..10).collect();
    turn(&mut kv, Some(7), t1.clone(), 3);
    assert_eq!(kv.metrics().gauges.held_sessions, 1);
    expire(&mut kv);
    kv.drain().unwrap();
    balanced(&kv);
    // Two long requests push the demoted history off the device (its KV, window KV and state
    // stay on the host).
    turn(&mut kv, None, (100..140).collect(), 1);
    kv.drain().unwrap();
    turn(&mut kv, None, (200..240).collect(), 1);
    kv.drain().unwrap();
    balanced(&kv);
    // Turn 2 extends the history: the 12 computed tokens come back from the host with their
    // window and state.
    let hits = kv.metrics().counters.mamba_state_hits;
    let t2 = next(&t1, 3, 50..53);
    let a2 = turn(&mut kv, Some(7), t2.clone(), 3);
    assert_eq!((a2.device_tokens, a2.host_tokens), (0, 12), "{a2:?}");
    let cow = a2.mamba_cow.expect("the loaded state is copied on write");
    assert_eq!(Some(cow.dst), a2.mamba_slot);
    let m = kv.metrics();
    assert_eq!(m.counters.hit_tokens_host, 12);
    assert_eq!(m.counters.mamba_state_hits, hits + 1, "{:?}", m.counters);
    assert_eq!(m.gauges.held_sessions, 1, "the turn is held again");
    // Turn 3 continues in the slot (15 prompt + 2 decoded = 17 computed), in its own state.
    let t3 = next(&t2, 3, 60..61);
    let a3 = turn(&mut kv, Some(7), t3, 1);
    assert_eq!((a3.device_tokens, a3.host_tokens), (17, 0), "{a3:?}");
    assert_eq!((a3.mamba_slot, a3.mamba_cow), (a2.mamba_slot, None));
    kv.close_session(7).unwrap();
    drained(&mut kv);
}

/// The held-token budget demotes the least recently used idle session when another one is
/// held; the demoted one's next turn hits its demoted history in the tree.
#[test]
fn the_held_budget_demotes_a_session_whose_next_turn_hits_the_tree() {
    let budget = SessionBudget {
        max_held_tokens: 4,
        per_session_cap_tokens: 4,
        ..session_budget()
    };
    let mut kv = manager(1024, 64, 8, 2.0, budget);
    let t1: Vec<u32> = (0..30).collect();
    turn(&mut kv, Some(1), t1.clone(), 3);
    assert_eq!(kv.metrics().gauges.held_sessions, 1);
    turn(&mut kv, Some(2), (1_000..1_030).collect(), 3);
    kv.drain().unwrap();
    balanced(&kv);
    assert_eq!(kv.metrics().gauges.held_sessions, 1, "the budget holds one");
    // Session 1 was demoted (30 + 2 computed, 32: a page end) and hits its history in the tree.
    let t2 = next(&t1, 3, 70..73);
    let a = turn(&mut kv, Some(1), t2, 2);
    assert_eq!(a.device_tokens + a.host_tokens, 32, "{a:?}");
    assert!(a.mamba_cow.is_some(), "{a:?}");
    kv.close_session(1).unwrap();
    kv.close_session(2).unwrap();
    drained(&mut kv);
}

/// A session held across other traffic on a small device: the pressure evicts and backs up
/// the tree around it (never the window or the state its slot holds), and its next turn
/// still continues in place.
#[test]
fn a_held_session_keeps_its_window_and_state_while_traffic_moves_the_tree_to_the_host() {
    let mut kv = manager(128, 32, 4, 4.0, half(128));
    let t1: Vec<u32> = (0..18).collect();
    let a1 = turn(&mut kv, Some(3), t1.clone(), 4);
    for i in 0..4u32 {
        let base = 1_000 * (i + 1);
        turn(&mut kv, None, (base..base + 30).collect(), 2);
        balanced(&kv);
    }
    kv.drain().unwrap();
    balanced(&kv);
    let m = kv.metrics();
    assert_eq!(m.gauges.held_sessions, 1, "still held");
    assert!(
        m.counters.evicted_tokens > 0 && m.gauges.host_tokens > 0,
        "{m:?}"
    );
    let t2 = next(&t1, 4, 70..75);
    let a2 = turn(&mut kv, Some(3), t2, 2);
    assert_eq!((a2.device_tokens, a2.host_tokens), (21, 0), "{a2:?}");
    assert_eq!((a2.mamba_slot, a2.mamba_cow), (a1.mamba_slot, None));
    kv.close_session(3).unwrap();
    drained(&mut kv);
}

/// A close while the session's turn runs frees the slot at the turn's end; a close of an idle
/// session frees at once.
#[test]
fn close_frees_the_window_and_the_state_under_the_host_tier() {
    let mut kv = manager(1024, 64, 8, 2.0, session_budget());
    turn(&mut kv, Some(1), (0..30).collect(), 6);
    turn(&mut kv, Some(2), (1_000..1_030).collect(), 6);
    assert_eq!(kv.metrics().gauges.held_sessions, 2);
    let (id, _) = start(
        &mut kv,
        Some(2),
        next(&(1_000..1_030).collect::<Vec<_>>(), 6, 0..3),
        2,
    );
    kv.close_session(2).unwrap();
    balanced(&kv);
    kv.finish(id).unwrap();
    balanced(&kv);
    assert_eq!(kv.metrics().gauges.held_sessions, 1);
    kv.close_session(1).unwrap();
    assert_eq!(kv.metrics().gauges.held_sessions, 0);
    drained(&mut kv);
}
