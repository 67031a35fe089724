//! Streaming sessions on a sliding-window model (the Gemma-like preset) through the manager:
//! a session's slot keeps the window KV of its last turn (and the frontier before it), so the
//! next turn continues at the whole held length without re-prefilling the window; demotion
//! hands the window to the tree, close frees it, and admission counts the windows idle
//! sessions hold (an allocation short of window pages demotes them).

mod common;

use common::turns::{drained, next, turn};
use common::{balanced, gemma, gemma_swa_page_bytes, session_budget, step};
use radixkv_scheduler_api::{
    Admission, KvCacheManager, ManagerConfig, ManagerError, ModelGeometry, NeverReason, Request,
    SessionBudget,
};

fn manager(swa_pages: u64) -> KvCacheManager {
    let mut kv = KvCacheManager::builder()
        .model(gemma())
        .device_tokens(1024)
        .max_rows(8)
        .swa_bytes(swa_pages * gemma_swa_page_bytes())
        .sessions(session_budget())
        .build()
        .unwrap();
    kv.set_check_every_step(true);
    kv
}

#[test]
fn turns_continue_in_the_held_window_and_demotion_and_close_hand_it_back() {
    let mut kv = manager(64);
    let t1: Vec<u32> = (0..30).collect();
    let a1 = turn(&mut kv, Some(7), t1.clone(), 6);
    assert_eq!(a1.cached_tokens(), 0);
    // The idle session owns the window past its prefill's insert: request-owned SWA pages
    // that no running request owns.
    assert_eq!(kv.metrics().gauges.held_sessions, 1);
    let held = kv.swa_accounting().unwrap().request_owned;
    assert!(held > 0);
    // Turn 2 continues at the whole held length (30 + 5 computed), from the session's window.
    let t2 = next(&t1, 6, 100..110);
    let a2 = turn(&mut kv, Some(7), t2.clone(), 4);
    assert_eq!(a2.device_tokens, 35);
    // The TTL demotes the idle session: its window goes to the tree, so the next turn matches
    // the history's page-aligned end there (its window is live).
    kv.set_time_ms(session_budget().idle_ttl_ms + 1);
    step(&mut kv);
    balanced(&kv);
    assert_eq!(kv.metrics().gauges.held_sessions, 0);
    assert_eq!(kv.swa_accounting().unwrap().request_owned, 0);
    let t3 = next(&t2, 4, 200..203);
    let a3 = turn(&mut kv, Some(7), t3.clone(), 3);
    assert_eq!(
        a3.device_tokens, 48,
        "the demoted history's page-aligned 48 of 48 tokens"
    );
    // And the turn after the demotion is a session turn again.
    let t4 = next(&t3, 3, 300..302);
    let a4 = turn(&mut kv, Some(7), t4, 2);
    assert_eq!(a4.device_tokens, t3.len() + 2);
    kv.close_session(7).unwrap();
    drained(&mut kv);
}

#[test]
fn admission_counts_the_idle_windows_and_allocation_demotes_them() {
    let mut kv = manager(24);
    turn(&mut kv, Some(7), (0..30).collect(), 6);
    // The session owns the window pages past its prefill (tokens 28..35: 2 pages).
    assert_eq!(kv.swa_accounting().unwrap().request_owned, 2);
    // A prompt of one page more than free + evictable (its SWA peak: one more page, for its
    // unaligned end): it fits only with the session's window, which admission counts and the
    // allocation demotes.
    let a = kv.swa_accounting().unwrap();
    let room = a.free + a.evictable;
    let len = (4 * room + 1) as u32;
    let id = kv
        .arrive(Request::new((5_000..5_000 + len).collect()).max_new_tokens(1))
        .unwrap();
    let Admission::Ready(adm) = kv.admit(id).unwrap() else {
        panic!("the idle session's window counts as room");
    };
    kv.extend(id, adm.extend_tokens).unwrap();
    balanced(&kv);
    assert_eq!(
        kv.metrics().gauges.held_sessions,
        0,
        "the session was demoted"
    );
    let s = kv.begin_step();
    kv.chunk_done(id).unwrap();
    kv.end_step(s).unwrap();
    kv.finish(id).unwrap();
    balanced(&kv);
    kv.close_session(7).unwrap();
    drained(&mut kv);
}

/// A turn that can never fit the window pool holds nothing when told so: the session's slot,
/// lent to the turn at its match, goes back to the session (it once stayed lent), and the
/// session's next turn continues from it.
#[test]
fn a_never_admissible_turn_gives_its_sessions_slot_back() {
    let mut kv = manager(24);
    let t1: Vec<u32> = (0..30).collect();
    turn(&mut kv, Some(7), t1.clone(), 6);
    assert_eq!(kv.metrics().gauges.held_sessions, 1);
    let huge = next(&t1, 6, 1_000..1_200);
    let id = kv
        .arrive(Request::new(huge).session(7).max_new_tokens(1))
        .unwrap();
    assert!(matches!(
        kv.admit(id).unwrap(),
        Admission::Never(NeverReason::WindowPoolTooSmall { .. })
    ));
    balanced(&kv);
    assert_eq!(
        kv.metrics().gauges.held_sessions,
        1,
        "the slot is the idle session's again"
    );
    kv.abort(id).unwrap();
    balanced(&kv);
    let a2 = turn(&mut kv, Some(7), next(&t1, 6, 100..104), 2);
    assert_eq!(
        a2.device_tokens, 35,
        "the next turn continues from the slot"
    );
    kv.close_session(7).unwrap();
    drained(&mut kv);
}

#[test]
fn a_cap_on_held_window_pages_demotes_and_a_bad_cap_is_a_config_error() {
    let mut kv = KvCacheManager::builder()
        .model(gemma())
        .device_tokens(1024)
        .swa_bytes(64 * gemma_swa_page_bytes())
        .sessions(SessionBudget {
            max_held_window_pages: Some(1),
            ..session_budget()
        })
        .build()
        .unwrap();
    turn(&mut kv, Some(1), (0..30).collect(), 6);
    turn(&mut kv, Some(2), (1_000..1_030).collect(), 6);
    assert!(kv.metrics().gauges.held_sessions <= 1);
    for s in [1, 2] {
        kv.close_session(s).unwrap();
    }
    drained(&mut kv);
    // More than the SWA pool, or a cap for a model without sliding-window layers: refused.
    for (model, cap, what) in [
        (gemma(), 65, "SWA pool has only 64"),
        (ModelGeometry::default(), 1, "no sliding-window layer"),
    ] {
        let mut cfg = ManagerConfig {
            device_tokens: 1024,
            sessions: Some(SessionBudget {
                max_held_window_pages: Some(cap),
                ..session_budget()
            }),
            ..Default::default()
        };
        if model.sliding_window.is_some() {
            cfg.pools.swa_bytes = Some(64 * gemma_swa_page_bytes());
        }
        cfg.model = model;
        match KvCacheManager::new(cfg) {
            Err(ManagerError::Config(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("{what}: {other:?}"),
        }
    }
}
