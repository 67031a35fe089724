//! Streaming sessions on a sliding-window model (the Gemma-like preset) under a host tier: a
//! session's slot keeps the window KV of its last turn across turns as on the device-only
//! cache; demotion hands its KV and window KV to the tree, which backs both up; once they
//! have left the device, the session's next turn loads both back and continues there; close
//! frees what the slot holds. Every pool balances after each call and nothing is left behind.

mod common;

use common::turns::{admit, drained, expire, next, start, turn};
use common::{balanced, gemma, gemma_swa_page_bytes, session_budget};
use radixkv_scheduler_api::{
    Admission, HostTier, KvCacheManager, Request, SessionBudget, WritePolicy,
};

/// A Gemma-like manager over a host tier of `ratio` × the device: `device_tokens` full-KV
/// tokens, `swa_pages` SWA pages, sessions on, audited at every step.
fn manager(device_tokens: usize, swa_pages: u64, ratio: f64) -> KvCacheManager {
    let budget = SessionBudget {
        max_held_tokens: device_tokens / 2,
        per_session_cap_tokens: device_tokens / 2,
        ..session_budget()
    };
    manager_with(device_tokens, swa_pages, ratio, budget)
}

fn manager_with(
    device_tokens: usize,
    swa_pages: u64,
    ratio: f64,
    sessions: SessionBudget,
) -> KvCacheManager {
    let mut host = HostTier::ratio(device_tokens, ratio);
    host.load_back_min_tokens = 4;
    let mut kv = KvCacheManager::builder()
        .model(gemma())
        .device_tokens(device_tokens)
        .max_rows(8)
        .swa_bytes(swa_pages * gemma_swa_page_bytes())
        .host_tier(host)
        .sessions(sessions)
        .build()
        .unwrap();
    kv.set_check_every_step(true);
    kv
}

#[test]
fn turns_continue_in_the_held_window_and_demotion_and_close_hand_it_back() {
    let mut kv = manager(1024, 64, 2.0);
    let t1: Vec<u32> = (0..30).collect();
    let a1 = turn(&mut kv, Some(7), t1.clone(), 6);
    assert_eq!(a1.cached_tokens(), 0);
    // The idle session owns the window past its prefill's insert.
    assert_eq!(kv.metrics().gauges.held_sessions, 1);
    assert!(kv.swa_accounting().unwrap().request_owned > 0);
    // Turn 2 continues at the whole held length (30 + 5 computed), from the session's window,
    // while the backup of turn 1's prefill may still be in flight.
    let t2 = next(&t1, 6, 100..110);
    let a2 = turn(&mut kv, Some(7), t2.clone(), 4);
    assert_eq!((a2.device_tokens, a2.host_tokens), (35, 0));
    // The TTL demotes the idle session: its KV and window go to the tree (and are backed
    // up), so the next turn matches the history's page-aligned end there.
    expire(&mut kv);
    assert_eq!(kv.swa_accounting().unwrap().request_owned, 0);
    let t3 = next(&t2, 4, 200..203);
    let a3 = turn(&mut kv, Some(7), t3.clone(), 3);
    assert_eq!((a3.device_tokens, a3.host_tokens), (48, 0), "{a3:?}");
    // And the turn after the demotion is a session turn again.
    let t4 = next(&t3, 3, 300..302);
    let a4 = turn(&mut kv, Some(7), t4, 2);
    assert_eq!(a4.device_tokens, t3.len() + 2);
    kv.close_session(7).unwrap();
    drained(&mut kv);
}

/// The demoted session's KV and window KV are backed up with the tree's; other traffic then
/// evicts both from the device (the host keeps them). The session's next turn loads both
/// back from the host, hits them, and its slot carries on for the turn after.
#[test]
fn a_demoted_session_window_comes_back_from_the_host() {
    let mut kv = manager(64, 16, 4.0);
    // Session 7: 10 prompt tokens and 2 decoded, 12 computed (a page end).
    let t1: Vec<u32> = (0..10).collect();
    turn(&mut kv, Some(7), t1.clone(), 3);
    assert_eq!(kv.metrics().gauges.held_sessions, 1);
    expire(&mut kv);
    kv.drain().unwrap();
    balanced(&kv);
    // Two long requests push the demoted history off the device (its KV and window KV stay
    // on the host).
    turn(&mut kv, None, (100..140).collect(), 1);
    kv.drain().unwrap();
    turn(&mut kv, None, (200..240).collect(), 1);
    kv.drain().unwrap();
    balanced(&kv);
    // Turn 2 extends the history: the 12 computed tokens come back from the host.
    let t2 = next(&t1, 3, 50..53);
    let a2 = turn(&mut kv, Some(7), t2.clone(), 3);
    assert_eq!((a2.device_tokens, a2.host_tokens), (0, 12), "{a2:?}");
    assert_eq!(kv.metrics().counters.hit_tokens_host, 12);
    assert_eq!(
        kv.metrics().gauges.held_sessions,
        1,
        "the turn is held again"
    );
    // Turn 3 continues in the slot (15 prompt + 2 decoded = 17 computed).
    let t3 = next(&t2, 3, 60..61);
    let a3 = turn(&mut kv, Some(7), t3, 1);
    assert_eq!((a3.device_tokens, a3.host_tokens), (17, 0), "{a3:?}");
    kv.close_session(7).unwrap();
    drained(&mut kv);
}

/// A session held across other traffic on a small device: the pressure evicts and backs up
/// the tree around it (never the window its slot locks), and its next turn still continues
/// in place.
#[test]
fn a_held_session_keeps_its_window_while_traffic_moves_the_tree_to_the_host() {
    let mut kv = manager(128, 32, 4.0);
    let t1: Vec<u32> = (0..18).collect();
    turn(&mut kv, Some(3), t1.clone(), 4);
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
    kv.close_session(3).unwrap();
    drained(&mut kv);
}

#[test]
fn admission_counts_the_idle_windows_and_allocation_demotes_them() {
    let mut kv = manager(1024, 24, 2.0);
    turn(&mut kv, Some(7), (0..30).collect(), 6);
    kv.drain().unwrap();
    // The session owns the window pages past its prefill (tokens 28..35: 2 pages).
    assert_eq!(kv.swa_accounting().unwrap().request_owned, 2);
    // A prompt of one page more than free + evictable: it fits only with the session's
    // window, which admission counts and the allocation demotes.
    let a = kv.swa_accounting().unwrap();
    let room = a.free + a.evictable;
    let len = (4 * room + 1) as u32;
    let id = kv
        .arrive(Request::new((5_000..5_000 + len).collect()).max_new_tokens(1))
        .unwrap();
    let adm = admit(&mut kv, id);
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

#[test]
fn a_cap_on_held_window_pages_demotes_and_close_frees_under_the_host_tier() {
    let mut kv = manager_with(
        1024,
        64,
        2.0,
        SessionBudget {
            max_held_window_pages: Some(1),
            ..session_budget()
        },
    );
    turn(&mut kv, Some(1), (0..30).collect(), 6);
    turn(&mut kv, Some(2), (1_000..1_030).collect(), 6);
    assert!(kv.metrics().gauges.held_sessions <= 1);
    // A close while the session's turn runs: the slot is freed at the turn's end.
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
    kv.close_session(1).unwrap();
    drained(&mut kv);
}

/// Nothing runs and the window pool is short by what an idle session's slot locks: admission
/// demotes the session, whose KV and window KV then go to the tree and are backed up
/// (write-through). The backup pins the demoted window until its ack, but a short allocation
/// completes pinned backups first, so the request is admitted at once (as on the device-only
/// cache) rather than waiting for a step that nothing running would bring.
#[test]
fn a_demotion_whose_backup_pins_the_window_admits_at_once() {
    let mut host = HostTier::ratio(1024, 2.0).write_policy(WritePolicy::WriteThrough);
    host.load_back_min_tokens = 4;
    let mut kv = KvCacheManager::builder()
        .model(gemma())
        .device_tokens(1024)
        .swa_bytes(24 * gemma_swa_page_bytes())
        .host_tier(host)
        .sessions(session_budget())
        .build()
        .unwrap();
    kv.set_check_every_step(true);
    // The session's prompt (7 pages) is in the tree and backed up; its slot locks the 2
    // window pages before the prompt's end and owns the 2 past it.
    turn(&mut kv, Some(7), (0..30).collect(), 6);
    kv.drain().unwrap();
    balanced(&kv);
    let a = kv.swa_accounting().unwrap();
    assert_eq!(
        (a.free, a.evictable, a.protected, a.request_owned),
        (15, 5, 2, 2),
        "{a:?}"
    );
    // 90 new tokens and 1 output: a peak of 24 window pages, the whole pool once the session
    // is demoted (its lock released, its own page past the prompt inserted).
    let id = kv
        .arrive(Request::new((5_000..5_090).collect()).max_new_tokens(1))
        .unwrap();
    let Admission::Ready(adm) = kv.admit(id).unwrap() else {
        panic!(
            "the demoted session's window is room: {:?}",
            kv.swa_accounting()
        );
    };
    assert_eq!(
        kv.metrics().gauges.held_sessions,
        0,
        "the session was demoted"
    );
    balanced(&kv);
    kv.extend(id, adm.extend_tokens).unwrap();
    balanced(&kv);
    let s = kv.begin_step();
    kv.chunk_done(id).unwrap();
    kv.end_step(s).unwrap();
    kv.finish(id).unwrap();
    balanced(&kv);
    kv.close_session(7).unwrap();
    drained(&mut kv);
}
