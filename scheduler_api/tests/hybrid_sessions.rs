//! Streaming sessions on a hybrid Transformer–Mamba model (the Jamba-like preset) through the
//! manager: a session's slot keeps the running Mamba state, so each turn continues at the
//! whole held length in the same state slot (no copy on write), and closing, demotion and a
//! request short of a state slot hand the held state back.

mod common;

use common::{admitted, balanced, jamba, session_budget, step};
use radixkv_scheduler_api::{Admitted, KvCacheManager, MambaPolicyKind, ReqId, Request};

fn manager(slots: u64, policy: MambaPolicyKind) -> KvCacheManager {
    let slot = jamba().checked_mamba_slot_bytes().unwrap();
    KvCacheManager::builder()
        .model(jamba())
        .device_tokens(1024)
        .max_rows(8)
        .mamba_bytes(slots * slot)
        .mamba_policy(policy)
        .sessions(session_budget())
        .build()
        .unwrap()
}

/// Arrives, admits and prefills one request (of `session`, if any) in one step.
fn start(
    kv: &mut KvCacheManager,
    session: Option<u64>,
    tokens: Vec<u32>,
    out: u32,
) -> (ReqId, Admitted) {
    let mut r = Request::new(tokens).max_new_tokens(out as usize);
    if let Some(s) = session {
        r = r.session(s);
    }
    let id = kv.arrive(r).unwrap();
    let a = admitted(kv, id);
    kv.extend(id, a.extend_tokens).unwrap();
    step(kv);
    kv.chunk_done(id).unwrap();
    balanced(kv);
    (id, a)
}

/// One turn: prefill, `out − 1` decode steps (tokens 9000, 9001, …), finish.
fn turn(kv: &mut KvCacheManager, session: u64, tokens: Vec<u32>, out: u32) -> Admitted {
    let (id, a) = start(kv, Some(session), tokens, out);
    for t in 0..out.saturating_sub(1) {
        kv.decode(id, 9_000 + t).unwrap();
        step(kv);
        balanced(kv);
    }
    kv.finish(id).unwrap();
    balanced(kv);
    a
}

#[test]
fn three_turns_continue_in_the_held_state_slot_and_close_frees_it() {
    for policy in [MambaPolicyKind::Sglang, MambaPolicyKind::Marconi] {
        let mut kv = manager(8, policy);
        let t1: Vec<u32> = (0..10).collect();
        let a1 = turn(&mut kv, 7, t1.clone(), 3);
        assert_eq!(a1.cached_tokens(), 0);
        let slot = a1.mamba_slot.expect("a running state slot");
        // Turn 1's chunk handed its tracking slot to the tree (the state at 8) and took a
        // fresh one, which the idle session holds.
        let handed = a1.mamba_track.expect("a tracking slot").slot;
        // The idle session holds the running state (a request-held slot of the pool).
        assert!(kv.mamba_accounting().unwrap().request_owned >= 1);
        // Turn 2 extends turn 1 (prompt + both fed-back outputs): it continues at the whole
        // held length, in the same slot, with no copy.
        let mut t2 = t1.clone();
        t2.extend([9_000, 9_001, 50, 51, 52]);
        let a2 = turn(&mut kv, 7, t2.clone(), 3);
        assert_eq!(a2.device_tokens, 12, "{policy:?}");
        assert_eq!(a2.mamba_slot, Some(slot));
        assert_eq!(a2.mamba_cow, None);
        // The turn keeps tracking in the slot the session held, from the held length (12
        // computed) on.
        let track = a2.mamba_track.expect("the session's tracking slot");
        assert_eq!(track.pos, 12, "{policy:?}");
        assert!(track.slot != slot && track.slot != handed, "{policy:?}");
        // Turn 3: 17 held tokens, not page-aligned, and no state in the tree there: still the
        // whole length (a tree match would stop at a cached state).
        let mut t3 = t2.clone();
        t3.extend([9_000, 9_001, 60, 61]);
        let a3 = turn(&mut kv, 7, t3, 2);
        assert_eq!(a3.device_tokens, 17, "{policy:?}");
        assert_eq!(a3.mamba_slot, Some(slot));
        assert_eq!(a3.mamba_cow, None);
        // Session turns stay in the session's row (no chunk insert): the slot travels on.
        assert_eq!(a3.mamba_track.map(|t| t.slot), Some(track.slot));
        kv.close_session(7).unwrap();
        kv.drain().unwrap();
        balanced(&kv);
        let m = kv.mamba_accounting().unwrap();
        assert_eq!(m.request_owned, 0, "close freed the held state: {m:?}");
        let a = kv.accounting();
        assert_eq!(a.session_held + a.protected + a.request_owned, 0, "{a:?}");
    }
}

#[test]
fn a_request_short_of_a_state_slot_demotes_an_idle_session() {
    // Two state slots; session 7's idle slot holds one.
    let mut kv = manager(2, MambaPolicyKind::Sglang);
    turn(&mut kv, 7, (0..10).collect(), 3);
    assert_eq!(kv.mamba_accounting().unwrap().request_owned, 1);
    // One request takes the free slot; the next finds none free and demotes the session
    // rather than wait for it.
    let (a, _) = start(&mut kv, None, (100..110).collect(), 2);
    let (b, adm) = start(&mut kv, None, (200..210).collect(), 2);
    assert!(adm.mamba_slot.is_some());
    assert_eq!(
        kv.metrics().gauges.held_sessions,
        0,
        "session 7 was demoted"
    );
    kv.finish(a).unwrap();
    kv.finish(b).unwrap();
    balanced(&kv);
    // Its demoted state (12 tokens, ending a page) went to the tree as evictable cache and
    // was evicted there for `b`'s slot: the next turn matches the tree, which has no state to
    // continue from, and starts over; it becomes the session's slot again.
    let mut t2: Vec<u32> = (0..10).collect();
    t2.extend([9_000, 9_001, 50]);
    let a2 = turn(&mut kv, 7, t2, 2);
    assert_eq!(a2.device_tokens, 0);
    assert_eq!(kv.metrics().gauges.held_sessions, 1);
    kv.close_session(7).unwrap();
    kv.drain().unwrap();
    balanced(&kv);
    assert_eq!(kv.mamba_accounting().unwrap().request_owned, 0);
}

#[test]
fn demoting_a_session_off_a_page_boundary_stores_the_tracked_state_and_close_frees_it() {
    for policy in [MambaPolicyKind::Sglang, MambaPolicyKind::Marconi] {
        // Three slots. Session 7's turn: 10 prompt tokens (the chunk hands the state at 8 to
        // the tree from the tracking slot and takes a fresh one), three decoded, 13 computed
        // (no page end); its idle slot holds the running state and the fresh tracking slot.
        let mut kv = manager(3, policy);
        let (t1, _) = start(&mut kv, Some(7), (0..10).collect(), 4);
        let track = kv.mamba_track(t1).unwrap().expect("a fresh tracking slot");
        assert_eq!(track.pos, 8, "{policy:?}");
        for t in 0..3 {
            kv.decode(t1, 9_000 + t).unwrap();
            step(&mut kv);
        }
        kv.finish(t1).unwrap();
        balanced(&kv);
        let m = kv.mamba_accounting().unwrap();
        assert_eq!((m.request_owned, m.evictable), (2, 1), "{policy:?}");
        // r takes the last obtainable slot (evicting the chunk's state; no spare left for
        // tracking); q finds none and demotes the session: its KV goes to the tree with the
        // tracked state at floor(13, 4) = 12, and q gets the freed running slot.
        let (r, ar) = start(&mut kv, None, (100..110).collect(), 1);
        assert_eq!(ar.mamba_track, None, "{policy:?}");
        let (q, _) = start(&mut kv, None, (200..210).collect(), 1);
        let m = kv.metrics();
        assert_eq!(m.counters.mamba_tracked_stored, 1, "{policy:?}");
        kv.finish(r).unwrap();
        kv.finish(q).unwrap();
        balanced(&kv);
        // A request on the first 12 tokens hits the stored state, copied from that slot.
        let mut tokens: Vec<u32> = (0..10).collect();
        tokens.extend([9_000, 9_001]);
        tokens.extend(300..306);
        let (id, a) = start(&mut kv, None, tokens, 1);
        assert_eq!(a.device_tokens, 12, "{policy:?}");
        assert_eq!(a.mamba_cow.map(|c| c.src), Some(track.slot));
        kv.finish(id).unwrap();
        // Closing an idle session releases its KV and frees both of its state slots.
        turn(&mut kv, 8, (400..410).collect(), 2);
        kv.close_session(8).unwrap();
        kv.close_session(7).unwrap();
        kv.drain().unwrap();
        balanced(&kv);
        assert_eq!(
            kv.mamba_accounting().unwrap().request_owned,
            0,
            "{policy:?}"
        );
    }
}
