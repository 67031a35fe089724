//! Unit tests: every path of the session layer, with invariants checked after each step.

use radixkv_radix::{
    CacheError, FinishKind, KeyRef, MambaPolicy, Namespace, PageId, PrefixCache, RadixCache,
    RadixConfig, RadixKey, RequestKv, RequestMatch, RowHolder, SessionTag, TokenId,
};

use crate::{
    CloseOutcome, ManualClock, ReapReport, SessionAwareCache, SessionConfig, SessionError,
};

const P: usize = 4;

type Cache = SessionAwareCache<RadixCache, ManualClock>;

fn cache_with(pages: usize, cfg: SessionConfig) -> (Cache, ManualClock) {
    let inner = RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: pages,
        max_rows: 16,
        ..Default::default()
    })
    .unwrap();
    let clock = ManualClock::new(0);
    (
        SessionAwareCache::with_clock(inner, cfg, clock.clone()),
        clock,
    )
}

/// A Mamba cache without tracking slots (one running slot per request; see
/// `tracking_slots_travel_with_the_session_slot` for tracking).
fn mamba_cache(slots: u32, policy: MambaPolicy, cfg: SessionConfig) -> (Cache, ManualClock) {
    mamba_cache_with(slots, policy, false, cfg)
}

fn mamba_cache_with(
    slots: u32,
    policy: MambaPolicy,
    track: bool,
    cfg: SessionConfig,
) -> (Cache, ManualClock) {
    let inner = RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: 64,
        max_rows: 16,
        mamba_slots: Some(slots),
        mamba_policy: policy,
        mamba_track: track,
        ..Default::default()
    })
    .unwrap();
    let clock = ManualClock::new(0);
    (
        SessionAwareCache::with_clock(inner, cfg, clock.clone()),
        clock,
    )
}

fn cache() -> (Cache, ManualClock) {
    cache_with(64, SessionConfig::with_budget(1 << 20))
}

fn ok(c: &Cache) {
    c.check_invariants().unwrap();
    assert!(c.accounting().balanced(), "{:?}", c.accounting());
    if let Some(a) = c.inner().mamba_accounting() {
        assert!(a.balanced(), "{a:?}");
        // Idle sessions' states are request-held slots of the pool (never tree-held).
        assert!(a.request_owned >= c.held_state_slots(), "{a:?}");
    }
}

fn req(id: Option<u64>, tokens: Vec<TokenId>) -> RequestKv {
    RequestKv {
        session: id.map(|id| SessionTag {
            id,
            streaming: true,
        }),
        ..RequestKv::new(RadixKey::new(tokens))
    }
}

/// Runs a turn up to (not including) its finish: match, begin, prefill, decode `generated` tokens.
/// The last generated token's KV is not computed, as in a real decode loop.
fn start(c: &mut Cache, r: &mut RequestKv, generated: &[TokenId]) -> RequestMatch {
    let m = c.match_request(r).unwrap();
    c.begin_request(r).unwrap();
    let todo = r.key.len() - r.committed_len;
    c.alloc_tokens(r, todo).unwrap();
    r.commit(todo).unwrap();
    r.append_tokens(generated);
    if generated.len() > 1 {
        c.alloc_tokens(r, generated.len() - 1).unwrap();
        r.commit(generated.len() - 1).unwrap();
    }
    ok(c);
    m
}

/// Matches and begins a turn, then prefills its first `n` tokens as one chunk: the tree holds
/// their whole pages, locked for the turn.
fn chunk(c: &mut Cache, r: &mut RequestKv, n: usize) {
    c.match_request(r).unwrap();
    c.begin_request(r).unwrap();
    c.alloc_tokens(r, n).unwrap();
    r.commit(n).unwrap();
    c.cache_unfinished_req(r).unwrap();
}

fn turn(c: &mut Cache, r: &mut RequestKv, generated: &[TokenId]) -> RequestMatch {
    let m = start(c, r, generated);
    c.cache_finished_req(r, FinishKind::Finished).unwrap();
    ok(c);
    assert!(r.row.is_none() && r.lock.is_none() && !r.kv_lent);
    m
}

fn extend(prev: &RequestKv, more: std::ops::Range<TokenId>) -> Vec<TokenId> {
    let mut t = prev.key.tokens.clone();
    t.extend(more);
    t
}

fn session_pages(c: &Cache, id: u64) -> Vec<PageId> {
    let row = c.sessions[&id].slot.as_ref().unwrap().row;
    c.pools().rows.pages(row).unwrap().to_vec()
}

/// Nothing is held by anyone: every page is free or in the tree, unlocked; no rows.
fn assert_drained(c: &Cache) {
    ok(c);
    let a = c.accounting();
    assert_eq!(a.free + a.evictable, a.total, "{a:?}");
    assert_eq!(c.pools().rows.live(), 0);
    assert_eq!(c.session_held_tokens(), 0);
}

#[test]
fn first_turn_is_saved_and_second_turn_restores_it() {
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    let m1 = turn(&mut c, &mut t1, &[100, 101, 102]);
    assert!(!m1.from_session);
    // 12 committed tokens (10 prompt + 2 decoded): 3 owned pages held by the session.
    assert_eq!(c.session_held_tokens(), 12);
    assert_eq!(c.held_rows(), 1);
    assert_eq!(c.accounting().session_held, 12);
    let info = c.session_info(1).unwrap();
    assert_eq!((info.history_len, info.slot_committed_len), (13, Some(12)));
    let saved = session_pages(&c, 1);

    let mut t2 = req(Some(1), extend(&t1, 200..205));
    let m2 = c.match_request(&mut t2).unwrap();
    assert!(m2.from_session);
    assert_eq!(m2.prefix_len, 12);
    assert_eq!(t2.prefix_pages, saved);
    assert!(t2.kv_lent && t2.lock.is_none());
    // Lent: the row counts as the request's, not the session's.
    assert_eq!(c.session_held_tokens(), 0);
    assert_eq!(c.held_rows(), 0);
    ok(&c);
    c.begin_request(&mut t2).unwrap();
    let todo = t2.key.len() - t2.committed_len;
    c.alloc_tokens(&mut t2, todo).unwrap();
    t2.commit(todo).unwrap();
    t2.append_tokens(&[300]);
    c.cache_finished_req(&mut t2, FinishKind::Finished).unwrap();
    ok(&c);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, Some(18));
    assert_eq!(c.session_held_tokens(), 20);
    assert_eq!(&session_pages(&c, 1)[..3], &saved[..]);
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn a_finished_turn_that_kept_no_kv_still_sets_the_history() {
    // Found by the session model test: a first turn finished before any token was committed
    // left nothing for the slot, and the history stayed empty, so any later turn "extended" it.
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), vec![5]);
    c.match_request(&mut t1).unwrap();
    c.begin_request(&mut t1).unwrap();
    c.cache_finished_req(&mut t1, FinishKind::Finished).unwrap();
    ok(&c);
    let info = c.session_info(1).unwrap();
    assert_eq!((info.history_len, info.slot_committed_len), (1, None));
    let bad = req(Some(1), vec![6, 7]);
    assert_eq!(
        c.validate_turn(&bad),
        Err(SessionError::NotExtending {
            id: 1,
            history_len: 1
        })
    );
    assert_eq!(c.validate_turn(&req(Some(1), vec![5, 7])), Ok(()));
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn a_turn_that_does_not_extend_is_a_typed_error_and_the_session_is_unchanged() {
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    turn(&mut c, &mut t1, &[100, 101]);
    let before = c.session_info(1).unwrap();
    let held = c.session_held_tokens();

    let mut bad = req(Some(1), (0..20).collect());
    assert_eq!(
        c.validate_turn(&bad),
        Err(SessionError::NotExtending {
            id: 1,
            history_len: 12
        })
    );
    let e = c.match_request(&mut bad).unwrap_err();
    assert!(matches!(e, CacheError::Session(_)));
    // Through the cache trait the reason keeps its type, and converts back.
    assert_eq!(
        e,
        CacheError::Session(radixkv_radix::SessionFault::NotExtending {
            id: 1,
            history_len: 12
        })
    );
    assert_eq!(
        SessionError::from(e),
        SessionError::NotExtending {
            id: 1,
            history_len: 12
        }
    );
    assert!(bad.row.is_none() && !bad.kv_lent);
    // Same tokens in another namespace do not extend either.
    let mut other_ns = RequestKv {
        key: RadixKey::with_namespace(extend(&t1, 0..3), Namespace::new("t")),
        ..req(Some(1), vec![])
    };
    assert!(c.match_request(&mut other_ns).is_err());
    assert_eq!(c.session_info(1).unwrap(), before);
    assert_eq!(c.session_held_tokens(), held);
    ok(&c);

    let mut good = req(Some(1), extend(&t1, 0..3));
    assert!(turn(&mut c, &mut good, &[7]).from_session);
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn lending_is_idempotent_and_a_second_request_is_busy() {
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    turn(&mut c, &mut t1, &[100, 101]);
    let mut t2 = req(Some(1), extend(&t1, 50..60));
    let a = c.match_request(&mut t2).unwrap();
    let pages = t2.prefix_pages.clone();
    // Admission rejected it: it matches again and gets the same answer.
    let b = c.match_request(&mut t2).unwrap();
    assert_eq!(a, b);
    assert_eq!(t2.prefix_pages, pages);
    ok(&c);
    let mut other = req(Some(1), extend(&t1, 50..60));
    assert_eq!(c.validate_turn(&other), Err(SessionError::Busy(1)));
    assert!(c.match_request(&mut other).is_err());
    assert!(other.row.is_none());
    // A lent session is never demoted.
    assert_eq!(c.demote(1), Ok(false));
    c.begin_request(&mut t2).unwrap();
    c.cache_finished_req(&mut t2, FinishKind::Aborted).unwrap();
    ok(&c);
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn abort_mid_turn_rolls_back_to_the_previous_turn() {
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    turn(&mut c, &mut t1, &[100, 101, 102]);
    let saved = session_pages(&c, 1);
    let held = c.session_held_tokens();
    let free = c.pools().pages.available();

    let mut t2 = req(Some(1), extend(&t1, 200..230));
    start(&mut c, &mut t2, &[1, 2, 3]);
    assert!(c.pools().pages.available() < free);
    c.cache_finished_req(&mut t2, FinishKind::Aborted).unwrap();
    ok(&c);
    assert!(t2.row.is_none() && !t2.kv_lent);
    assert_eq!(c.pools().pages.available(), free);
    assert_eq!(c.session_held_tokens(), held);
    assert_eq!(session_pages(&c, 1), saved);
    assert_eq!(c.session_info(1).unwrap().history_len, 13);
    // The same turn can be retried (a retract re-queues it) and hits the full history.
    let mut retry = req(Some(1), extend(&t1, 200..230));
    let m = turn(&mut c, &mut retry, &[1]);
    assert!(m.from_session);
    assert_eq!(m.prefix_len, 12);
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn retract_then_rematch_of_the_same_request() {
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..9).collect());
    turn(&mut c, &mut t1, &[100, 101]);
    let mut t2 = req(Some(1), extend(&t1, 20..40));
    let first = start(&mut c, &mut t2, &[5, 6, 7]);
    // Retract: the scheduler frees the request's KV and re-queues it with its tokens so far.
    c.cache_finished_req(&mut t2, FinishKind::Aborted).unwrap();
    ok(&c);
    let again = c.match_request(&mut t2).unwrap();
    assert_eq!(again, first);
    c.cache_finished_req(&mut t2, FinishKind::Aborted).unwrap();
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn overshoot_past_the_committed_length_is_trimmed() {
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    start(&mut c, &mut t1, &[100, 101]);
    // Speculative decoding allocated 9 draft slots that were not accepted.
    c.alloc_tokens(&mut t1, 9).unwrap();
    assert_eq!(t1.allocated_len, 20);
    c.cache_finished_req(&mut t1, FinishKind::Finished).unwrap();
    ok(&c);
    assert_eq!(c.session_held_tokens(), 12);
    // A retract retry can leave committed one past the (len − 1) key: the match trims it.
    let mut same = req(Some(1), t1.key.tokens.clone());
    let m = c.match_request(&mut same).unwrap();
    assert_eq!(m.prefix_len, 11);
    assert_eq!(same.prefix_pages.len(), 3);
    c.cache_finished_req(&mut same, FinishKind::Aborted)
        .unwrap();
    ok(&c);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, Some(11));
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn a_match_below_the_protected_prefix_falls_back_to_the_tree() {
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    // Turn 1 publishes its 8-token prompt in the tree (as after a prefill chunk).
    let mut t1 = req(Some(1), (0..8).collect());
    chunk(&mut c, &mut t1, 8);
    assert_eq!(t1.cache_protected_len, 8);
    t1.append_tokens(&[100]);
    c.cache_finished_req(&mut t1, FinishKind::Finished).unwrap();
    ok(&c);
    assert_eq!(c.session_held_tokens(), 0);
    // A cap on the reusable prefix (e.g. logprobs from token 4) cannot reuse the row in place.
    let mut t2 = req(Some(1), extend(&t1, 0..4));
    t2.max_prefix_len = Some(4);
    let m = c.match_request(&mut t2).unwrap();
    assert!(!m.from_session);
    assert_eq!(m.prefix_len, 4);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, None);
    ok(&c);
    turn_rest(&mut c, &mut t2);
    c.close(1).unwrap();
    assert_drained(&c);
}

/// Finishes a matched turn.
fn turn_rest(c: &mut Cache, r: &mut RequestKv) {
    c.begin_request(r).unwrap();
    let todo = r.key.len() - r.committed_len;
    c.alloc_tokens(r, todo).unwrap();
    r.commit(todo).unwrap();
    c.cache_finished_req(r, FinishKind::Finished).unwrap();
    ok(c);
}

#[test]
fn close_idle_releases_everything_and_close_unknown_is_an_error() {
    let (mut c, _) = cache();
    assert_eq!(c.close(9), Err(SessionError::Unknown(9)));
    c.open(1, true, None).unwrap();
    assert_eq!(c.open(1, true, None), Err(SessionError::AlreadyOpen(1)));
    let mut t1 = req(Some(1), (0..30).collect());
    turn(&mut c, &mut t1, &[1, 2]);
    assert_eq!(c.close(1), Ok(CloseOutcome::Closed));
    assert_eq!(c.open_sessions(), 0);
    assert_drained(&c);
    // Closed sessions are unknown: their streaming turns are rejected.
    let mut late = req(Some(1), extend(&t1, 0..2));
    assert_eq!(c.validate_turn(&late), Err(SessionError::Unknown(1)));
    assert!(c.match_request(&mut late).is_err());
    assert_eq!(c.close(1), Err(SessionError::Unknown(1)));
}

#[test]
fn close_during_a_turn_is_deferred_to_its_end() {
    for kind in [FinishKind::Finished, FinishKind::Aborted] {
        let (mut c, _) = cache();
        c.open(1, true, None).unwrap();
        let mut t1 = req(Some(1), (0..10).collect());
        turn(&mut c, &mut t1, &[100, 101]);
        let mut t2 = req(Some(1), extend(&t1, 20..30));
        start(&mut c, &mut t2, &[5, 6]);
        assert_eq!(c.close(1), Ok(CloseOutcome::Deferred));
        assert_eq!(c.close(1), Ok(CloseOutcome::Deferred));
        assert!(c.session_info(1).unwrap().closing);
        let mut other = req(Some(1), extend(&t2, 0..2));
        assert_eq!(c.validate_turn(&other), Err(SessionError::Closing(1)));
        assert!(c.match_request(&mut other).is_err());
        ok(&c);
        c.cache_finished_req(&mut t2, kind).unwrap();
        assert_eq!(c.open_sessions(), 0);
        assert_drained(&c);
        // A finished turn is cached like an ordinary request; an aborted one is freed.
        let mut probe = Vec::new();
        let hit = c
            .match_prefix(KeyRef::new(&t2.key.tokens), &mut probe)
            .unwrap()
            .device_len;
        match kind {
            FinishKind::Finished => assert_eq!(hit, 20),
            FinishKind::Aborted => assert_eq!(hit, 0),
        }
    }
}

#[test]
fn non_streaming_and_sessionless_requests_pass_through() {
    let (mut c, _) = cache();
    c.open(2, false, None).unwrap();
    let mut a = req(None, (0..10).collect());
    assert!(!turn(&mut c, &mut a, &[1]).from_session);
    let mut b = req(Some(2), (0..10).collect());
    let m = turn(&mut c, &mut b, &[1]);
    assert!(!m.from_session);
    assert_eq!(m.prefix_len, 8);
    // A request tagged non-streaming for a streaming session passes through as well.
    c.open(3, true, None).unwrap();
    let mut n = RequestKv {
        session: Some(SessionTag {
            id: 3,
            streaming: false,
        }),
        ..RequestKv::new(RadixKey::new((0..10).collect()))
    };
    turn(&mut c, &mut n, &[1]);
    assert_eq!(c.session_info(2).unwrap().slot_committed_len, None);
    assert_eq!(c.session_info(3).unwrap().slot_committed_len, None);
    assert_drained(&c);
}

#[test]
fn ttl_expiry_demotes_and_the_next_turn_matches_the_tree() {
    let cfg = SessionConfig {
        idle_ttl: Some(100),
        ..SessionConfig::with_budget(1 << 20)
    };
    let (mut c, clock) = cache_with(64, cfg);
    c.open(1, true, None).unwrap();
    c.open(2, true, Some(1000)).unwrap();
    let mut a = req(Some(1), (0..10).collect());
    turn(&mut c, &mut a, &[100, 101]);
    let mut b = req(Some(2), (500..510).collect());
    turn(&mut c, &mut b, &[100, 101]);
    clock.advance(99);
    assert_eq!(c.reap(), Ok(ReapReport::default()));
    clock.advance(1);
    assert_eq!(
        c.reap(),
        Ok(ReapReport {
            expired: 1,
            over_budget: 0
        })
    );
    ok(&c);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, None);
    assert_eq!(c.session_info(2).unwrap().slot_committed_len, Some(11));
    assert_eq!(c.session_held_tokens(), 12);
    // Demoted KV is ordinary cache: the next turn hits its aligned history through the tree.
    let mut a2 = req(Some(1), extend(&a, 0..5));
    let m = turn(&mut c, &mut a2, &[9, 9]);
    assert!(!m.from_session);
    assert_eq!(m.prefix_len, 8);
    // ... and becomes the slot again.
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, Some(18));
    c.close(1).unwrap();
    c.close(2).unwrap();
    assert_drained(&c);
}

#[test]
fn over_budget_demotes_the_least_recently_used_idle_session() {
    let (mut c, clock) = cache_with(64, SessionConfig::with_budget(24));
    for id in 1..=2 {
        c.open(id, true, None).unwrap();
        let mut r = req(
            Some(id),
            (id as u32 * 1000..id as u32 * 1000 + 10).collect(),
        );
        turn(&mut c, &mut r, &[1, 2]);
        clock.advance(1);
    }
    assert_eq!(c.session_held_tokens(), 24);
    c.open(3, true, None).unwrap();
    let mut r = req(Some(3), (3000..3010).collect());
    turn(&mut c, &mut r, &[1, 2]);
    assert!(c.session_held_tokens() <= 24);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, None);
    assert!(c.session_info(2).unwrap().slot_committed_len.is_some());
    assert!(c.session_info(3).unwrap().slot_committed_len.is_some());
    // Tightening the budget takes effect at the next reap.
    c.set_config(SessionConfig::with_budget(0));
    assert_eq!(c.reap().unwrap().over_budget, 2);
    assert_eq!(c.held_rows(), 0);
    for id in 1..=3 {
        c.close(id).unwrap();
    }
    assert_drained(&c);
}

#[test]
fn a_turn_over_the_per_session_cap_is_demoted_at_once() {
    let cfg = SessionConfig {
        max_session_tokens: 8,
        ..SessionConfig::with_budget(1 << 20)
    };
    let (mut c, _) = cache_with(64, cfg);
    c.open(1, true, None).unwrap();
    let mut small = req(Some(1), (0..6).collect());
    turn(&mut c, &mut small, &[1, 2]);
    assert_eq!(c.session_held_tokens(), 8);
    let mut big = req(Some(1), extend(&small, 10..20));
    turn(&mut c, &mut big, &[1, 2]);
    assert_eq!(c.session_held_tokens(), 0);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, None);
    assert_eq!(c.session_info(1).unwrap().history_len, 20);
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn allocation_pressure_demotes_idle_sessions_but_never_lent_ones() {
    // 16 pages of 4 tokens.
    let (mut c, _) = cache_with(16, SessionConfig::with_budget(1 << 20));
    c.open(1, true, None).unwrap();
    c.open(2, true, None).unwrap();
    let mut a = req(Some(1), (0..22).collect());
    turn(&mut c, &mut a, &[1, 2, 3]); // 24 committed: 6 pages
    let mut b = req(Some(2), (100..122).collect());
    turn(&mut c, &mut b, &[1, 2, 3]);
    assert_eq!(c.pools().pages.available(), 4);
    assert_eq!(c.available_tokens(), 16 + 48);
    // Lend session 2; a plain request then needs more than is free: session 1 is demoted.
    let mut b2 = req(Some(2), extend(&b, 0..2));
    c.match_request(&mut b2).unwrap();
    let mut x = req(None, (900..940).collect());
    c.match_request(&mut x).unwrap();
    c.begin_request(&mut x).unwrap();
    c.alloc_tokens(&mut x, 40).unwrap();
    ok(&c);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, None);
    assert!(c.session_info(2).unwrap().lent);
    // Nothing idle is left: the next allocation fails cleanly and the lent slot survives.
    let free = c.pools().pages.available();
    let err = c.alloc_pages(free + 1);
    assert!(matches!(err, Err(CacheError::OutOfPages { .. })));
    assert_eq!(c.pools().pages.available(), free);
    assert!(c.session_info(2).unwrap().lent);
    c.cache_finished_req(&mut x, FinishKind::Aborted).unwrap();
    c.cache_finished_req(&mut b2, FinishKind::Aborted).unwrap();
    ok(&c);
    c.close(1).unwrap();
    c.close(2).unwrap();
    assert_drained(&c);
}

#[test]
fn explicit_demotion_keeps_shared_prefixes_cached() {
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..16).collect());
    turn(&mut c, &mut t1, &[1, 2, 3, 4, 5]);
    assert_eq!(c.demote(1), Ok(true));
    assert_eq!(c.demote(1), Ok(false));
    assert_eq!(c.demote(5), Err(SessionError::Unknown(5)));
    ok(&c);
    // Another user sending the same conversation hits it in the tree.
    let mut other = req(None, t1.key.tokens.clone());
    let m = turn(&mut c, &mut other, &[1]);
    assert_eq!(m.prefix_len, 20);
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn the_invariant_check_sees_session_rows() {
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    turn(&mut c, &mut t1, &[1, 2]);
    let row = c.sessions[&1].slot.as_ref().unwrap().row;
    // A caller that flips the holder behind the session layer's back is caught.
    c.pools_mut()
        .rows
        .set_holder(row, RowHolder::Request)
        .unwrap();
    assert!(c.check_invariants().is_err());
    c.pools_mut()
        .rows
        .set_holder(row, RowHolder::Session)
        .unwrap();
    ok(&c);
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn overflowing_counts_are_errors_with_an_idle_session_present() {
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    turn(&mut c, &mut t1, &[100, 101, 102]);
    let before = (c.accounting(), c.session_held_tokens());
    // The retry path multiplies the missing pages by the page size: it must not overflow.
    assert!(matches!(
        c.alloc_pages(usize::MAX),
        Err(CacheError::OutOfPages { .. })
    ));
    let mut r = req(None, (50..60).collect());
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    // usize::MAX tokens are 2^62 pages, and 2^62 pages of 4 tokens overflow.
    assert!(matches!(
        c.alloc_tokens(&mut r, usize::MAX),
        Err(CacheError::OutOfPages { .. })
    ));
    c.alloc_tokens(&mut r, 10).unwrap();
    assert_eq!(
        c.alloc_tokens(&mut r, usize::MAX),
        Err(CacheError::SizeOverflow(
            "alloc_tokens: allocated_len + n overflows usize"
        ))
    );
    assert_eq!(r.allocated_len, 10);
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    assert_eq!((c.accounting(), c.session_held_tokens()), before);
    ok(&c);
}

#[test]
fn sessions_open_over_mamba_and_sliding_window_caches() {
    let (mut c, _) = mamba_cache(4, MambaPolicy::Sglang, SessionConfig::with_budget(1 << 20));
    assert!(c.has_state_slots() && !c.has_window_state());
    assert_eq!(c.sliding_window(), None);
    c.open(1, true, None).unwrap();
    ok(&c);
    let (mut c, _) = swa_cache(64, SessionConfig::with_budget(1 << 20));
    assert!(c.has_state_slots() && c.has_window_state());
    assert_eq!(c.sliding_window(), Some(W));
    c.open(1, true, None).unwrap();
    // Requests outside sessions still run, and the window slides through the session layer.
    let mut r = RequestKv::new(RadixKey::new((0..(W + 3 * P) as u32 + 1).collect()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    c.alloc_tokens(&mut r, W + 3 * P + 1).unwrap();
    r.commit(W + 3 * P + 1).unwrap();
    assert_eq!(c.slide_window(&mut r).unwrap(), 3);
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    ok(&c);
    c.close(1).unwrap();
    assert_swa_drained(&c);
}

// ----- Sliding-window layers: a session slot keeps the window across turns -----

/// The sliding window of the SWA tests: two pages.
const W: usize = 2 * P;

fn swa_cache(swa_pages: usize, cfg: SessionConfig) -> (Cache, ManualClock) {
    let inner = RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: 64,
        max_rows: 16,
        swa: Some(radixkv_radix::SwaConfig {
            window: W,
            pages: swa_pages,
        }),
        ..Default::default()
    })
    .unwrap();
    let clock = ManualClock::new(0);
    (
        SessionAwareCache::with_clock(inner, cfg, clock.clone()),
        clock,
    )
}

fn swa(c: &Cache) -> radixkv_radix::ComponentAccounting {
    c.inner().swa_accounting().unwrap()
}

/// `ok` plus the window pool: balanced, and idle sessions' window pages are request-owned.
fn swa_ok(c: &Cache) {
    ok(c);
    let a = swa(c);
    assert!(a.balanced(), "{a:?}");
    assert!(a.request_owned >= c.held_window_pages(), "{a:?}");
}

/// Nothing is held: both pools are free or unlocked tree KV, no rows, no session pages.
fn assert_swa_drained(c: &Cache) {
    assert_drained(c);
    let a = swa(c);
    assert_eq!(a.free + a.evictable, a.total, "{a:?}");
    assert_eq!(c.held_window_pages(), 0);
}

/// `start` with the slides a decode loop makes: after each computed token the window that
/// left is freed (the manager slides before every decode allocation).
fn swa_start(c: &mut Cache, r: &mut RequestKv, generated: &[TokenId]) -> RequestMatch {
    let m = c.match_request(r).unwrap();
    c.begin_request(r).unwrap();
    let todo = r.key.len() - r.committed_len;
    c.alloc_tokens(r, todo).unwrap();
    r.commit(todo).unwrap();
    c.cache_unfinished_req(r).unwrap();
    c.slide_window(r).unwrap();
    swa_ok(c);
    c.check_request(r).unwrap();
    for (i, &t) in generated.iter().enumerate() {
        r.append_tokens(&[t]);
        if i + 1 < generated.len() {
            c.alloc_tokens(r, 1).unwrap();
            r.commit(1).unwrap();
            c.slide_window(r).unwrap();
        }
    }
    swa_ok(c);
    c.check_request(r).unwrap();
    m
}

fn swa_turn(c: &mut Cache, r: &mut RequestKv, generated: &[TokenId]) -> RequestMatch {
    let m = swa_start(c, r, generated);
    c.cache_finished_req(r, FinishKind::Finished).unwrap();
    swa_ok(c);
    assert!(r.row.is_none() && r.lock.is_none() && r.swa_pages.is_empty() && !r.kv_lent);
    m
}

fn slot_window(c: &Cache, id: u64) -> (usize, Vec<PageId>) {
    let sl = c.sessions[&id].slot.as_ref().unwrap();
    (sl.swa_evicted_len, sl.swa_pages.clone())
}

#[test]
fn a_swa_turn_continues_from_the_held_window_without_a_refill() {
    let (mut c, _) = swa_cache(64, SessionConfig::with_budget(1 << 20));
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..30).collect());
    swa_turn(&mut c, &mut t1, &[100, 101, 102, 103, 104, 105]);
    // The slot holds the window before its committed end (35 tokens), and only that: the
    // pages that slid out were freed by the slides.
    let committed = c.session_info(1).unwrap().slot_committed_len.unwrap();
    assert_eq!(committed, 35);
    let (evicted, pages) = slot_window(&c, 1);
    assert!(
        evicted > 0 && evicted <= align_down(committed) - W,
        "{evicted}"
    );
    assert_eq!(evicted / P + pages.len(), committed.div_ceil(P));
    assert!(c.held_window_pages() > 0 && c.held_window_pages() <= pages.len());
    // Turn 2 is lent the row and the window as they are: no tree walk, no re-prefill of the
    // window, and the request holds exactly the slot's window pages.
    let mut t2 = req(Some(1), extend(&t1, 200..210));
    let m = c.match_request(&mut t2).unwrap();
    assert!(m.from_session);
    assert_eq!(m.prefix_len, committed);
    assert_eq!((t2.swa_evicted_len, t2.swa_pages.clone()), (evicted, pages));
    assert_eq!(
        c.held_window_pages(),
        0,
        "lent pages are the running turn's"
    );
    c.begin_request(&mut t2).unwrap();
    c.check_request(&t2).unwrap();
    swa_ok(&c);
    let todo = t2.key.len() - t2.committed_len;
    c.alloc_tokens(&mut t2, todo).unwrap();
    t2.commit(todo).unwrap();
    c.cache_unfinished_req(&mut t2).unwrap();
    assert!(
        c.slide_window(&mut t2).unwrap() > 0,
        "the old window slides out"
    );
    c.check_request(&t2).unwrap();
    t2.append_tokens(&[7]);
    c.cache_finished_req(&mut t2, FinishKind::Finished).unwrap();
    swa_ok(&c);
    let (evicted2, _) = slot_window(&c, 1);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, Some(46));
    assert!(evicted2 > evicted);
    // Demotion hands the window to the tree: the history's page-aligned end is matchable
    // again (its window is live), the session holds nothing and its next turn matches there.
    assert!(c.demote(1).unwrap());
    swa_ok(&c);
    assert_eq!(c.held_window_pages(), 0);
    assert_eq!(c.session_held_tokens(), 0);
    let mut t3 = req(Some(1), extend(&t2, 300..305));
    let m = swa_turn(&mut c, &mut t3, &[8, 9]);
    assert!(!m.from_session);
    assert_eq!(m.prefix_len, align_down(46));
    // A second turn after the demotion is lent the new slot again.
    let mut t4 = req(Some(1), extend(&t3, 400..402));
    let m = swa_turn(&mut c, &mut t4, &[1]);
    assert!(m.from_session);
    c.close(1).unwrap();
    assert_swa_drained(&c);
}

fn align_down(n: usize) -> usize {
    n / P * P
}

#[test]
fn an_aborted_swa_turn_rolls_back_or_drops_a_slot_whose_window_slid_out() {
    // Rolled back: the turn allocated but its window stayed behind the slot's end.
    let (mut c, _) = swa_cache(64, SessionConfig::with_budget(1 << 20));
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..28).collect());
    swa_turn(&mut c, &mut t1, &[100, 101]);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, Some(29));
    let before = (slot_window(&c, 1), swa(&c), c.accounting());
    let mut t2 = req(Some(1), extend(&t1, 200..201));
    swa_start(&mut c, &mut t2, &[]);
    c.cache_finished_req(&mut t2, FinishKind::Aborted).unwrap();
    swa_ok(&c);
    assert_eq!((slot_window(&c, 1), swa(&c), c.accounting()), before);
    // Dropped: the aborted turn computed past a window and slid the slot's window out. The
    // slot's KV becomes cache (its end's window is gone: a tombstone there), the session
    // keeps its history without a slot, and its next turn matches the tree.
    let mut t2 = req(Some(1), extend(&t1, 200..240));
    swa_start(&mut c, &mut t2, &[]);
    assert!(t2.swa_evicted_len > align_down(29) - W);
    c.cache_finished_req(&mut t2, FinishKind::Aborted).unwrap();
    swa_ok(&c);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, None);
    assert_eq!(c.session_info(1).unwrap().history_len, 30);
    assert_eq!(c.held_window_pages(), 0);
    assert_eq!(swa(&c).request_owned, 0);
    let mut t3 = req(Some(1), extend(&t1, 500..504));
    let m = swa_turn(&mut c, &mut t3, &[1, 2]);
    assert!(!m.from_session);
    c.close(1).unwrap();
    assert_swa_drained(&c);
}

#[test]
fn closing_a_swa_session_frees_its_window_idle_or_deferred() {
    let (mut c, _) = swa_cache(64, SessionConfig::with_budget(1 << 20));
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..30).collect());
    swa_turn(&mut c, &mut t1, &[100, 101]);
    assert!(c.held_window_pages() > 0);
    assert_eq!(c.close(1), Ok(CloseOutcome::Closed));
    assert_swa_drained(&c);
    for kind in [FinishKind::Finished, FinishKind::Aborted] {
        let (mut c, _) = swa_cache(64, SessionConfig::with_budget(1 << 20));
        c.open(1, true, None).unwrap();
        let mut t1 = req(Some(1), (0..30).collect());
        swa_turn(&mut c, &mut t1, &[100, 101]);
        let mut t2 = req(Some(1), extend(&t1, 200..230));
        swa_start(&mut c, &mut t2, &[5, 6]);
        assert_eq!(c.close(1), Ok(CloseOutcome::Deferred));
        swa_ok(&c);
        c.cache_finished_req(&mut t2, kind).unwrap();
        assert_eq!(c.open_sessions(), 0);
        assert_swa_drained(&c);
    }
}

#[test]
fn held_windows_are_capped_and_never_keep_a_request_from_window_pages() {
    // The cap: over `max_held_window_pages` the least recently used idle session is demoted.
    let cfg = SessionConfig {
        max_held_window_pages: 1,
        ..SessionConfig::with_budget(1 << 20)
    };
    let (mut c, clock) = swa_cache(64, cfg);
    for id in [1, 2] {
        c.open(id, true, None).unwrap();
        let mut t = req(
            Some(id),
            (id as u32 * 1000..id as u32 * 1000 + 30).collect(),
        );
        swa_turn(&mut c, &mut t, &[1, 2]);
        clock.advance(1);
    }
    assert!(c.held_window_pages() <= 1);
    assert_eq!(
        c.session_info(1).unwrap().slot_committed_len,
        None,
        "LRU demoted"
    );
    assert!(c.session_info(2).unwrap().slot_committed_len.is_some());
    for id in [1, 2] {
        c.close(id).unwrap();
    }
    assert_swa_drained(&c);
    // The pool: a request short of window pages demotes idle sessions that own some.
    let (mut c, _) = swa_cache(12, SessionConfig::with_budget(1 << 20));
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..30).collect());
    swa_turn(&mut c, &mut t1, &[100, 101]);
    let held = c.held_window_pages();
    assert!(held > 0);
    let a = swa(&c);
    // One page more than free + evictable: only the session's page makes it fit.
    let len = ((a.free + a.evictable + 1) * P) as u32;
    assert!(held >= 1);
    let mut other = RequestKv::new(RadixKey::new((5000..5000 + len).collect()));
    c.match_request(&mut other).unwrap();
    c.begin_request(&mut other).unwrap();
    let n = other.key.len();
    c.alloc_tokens(&mut other, n).unwrap();
    swa_ok(&c);
    assert_eq!(c.held_window_pages(), 0);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, None);
    c.cache_finished_req(&mut other, FinishKind::Aborted)
        .unwrap();
    // Even all held windows are not enough: nothing is demoted, the allocation fails typed.
    let mut t2 = req(Some(1), extend(&t1, 0..3));
    swa_turn(&mut c, &mut t2, &[1]);
    let held = c.held_window_pages();
    let mut huge = RequestKv::new(RadixKey::new((9000..9000 + 64 * P as u32).collect()));
    c.match_request(&mut huge).unwrap();
    c.begin_request(&mut huge).unwrap();
    let n = huge.key.len();
    assert!(matches!(
        c.alloc_tokens(&mut huge, n),
        Err(CacheError::OutOfComponentPages {
            component: "swa",
            ..
        })
    ));
    assert_eq!(c.held_window_pages(), held);
    swa_ok(&c);
    c.cache_finished_req(&mut huge, FinishKind::Aborted)
        .unwrap();
    c.close(1).unwrap();
    assert_swa_drained(&c);
}

/// A request short of window pages and of full KV demotes no session when their window pages
/// would cover the first but nothing covers the second: the allocation fails with the
/// sessions as they were (it once demoted them for the window and then failed on full KV).
#[test]
fn a_window_shortage_demotes_nothing_when_full_kv_cannot_be_found_either() {
    let (mut c, _) = swa_cache(12, SessionConfig::with_budget(1 << 20));
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    swa_turn(&mut c, &mut t1, &[100, 101]);
    let held = c.held_window_pages();
    assert!(held > 0);
    // A running request takes the rest of the full-KV pool, one page at a time, sliding its
    // window as a decode loop does.
    let mut big = RequestKv::new(RadixKey::new(Vec::new()));
    c.match_request(&mut big).unwrap();
    c.begin_request(&mut big).unwrap();
    while c.pools().pages.available() > 0 {
        big.append_tokens(&[7; P]);
        c.alloc_tokens(&mut big, P).unwrap();
        big.commit(P).unwrap();
        c.slide_window(&mut big).unwrap();
    }
    swa_ok(&c);
    let a = swa(&c);
    let need = a.free + a.evictable + 1;
    assert!(
        need <= a.free + a.evictable + held,
        "the windows would cover it"
    );
    assert!(
        c.inner().available_tokens() + c.session_held_tokens() < need * P,
        "nothing covers its full KV"
    );
    let mut other = RequestKv::new(RadixKey::new((5000..5000 + (need * P) as u32).collect()));
    c.match_request(&mut other).unwrap();
    c.begin_request(&mut other).unwrap();
    let before = (c.accounting(), swa(&c), c.held_window_pages());
    assert!(matches!(
        c.alloc_tokens(&mut other, need * P),
        Err(CacheError::OutOfComponentPages { .. } | CacheError::OutOfPages { .. })
    ));
    assert_eq!((c.accounting(), swa(&c), c.held_window_pages()), before);
    assert!(c.session_info(1).unwrap().slot_committed_len.is_some());
    swa_ok(&c);
    for r in [&mut other, &mut big] {
        c.cache_finished_req(r, FinishKind::Aborted).unwrap();
    }
    c.close(1).unwrap();
    assert_swa_drained(&c);
}

// ----- Mamba: a session slot keeps the running state across turns -----

fn mamba(c: &Cache) -> radixkv_radix::ComponentAccounting {
    c.inner().mamba_accounting().unwrap()
}

fn policies() -> [MambaPolicy; 2] {
    [MambaPolicy::Sglang, MambaPolicy::default()]
}

#[test]
fn a_mamba_turn_continues_from_the_held_state_without_a_copy_or_a_cut_back() {
    for policy in policies() {
        let (mut c, _) = mamba_cache(8, policy, SessionConfig::with_budget(1 << 20));
        c.open(1, true, None).unwrap();
        let mut t1 = req(Some(1), (0..10).collect());
        start(&mut c, &mut t1, &[100, 101]);
        let running = t1.mamba_slot.unwrap();
        let checkpoints = t1.mamba_checkpoints.len();
        c.check_request(&t1).unwrap();
        c.cache_finished_req(&mut t1, FinishKind::Finished).unwrap();
        ok(&c);
        // The slot holds the running state after the 11 committed tokens (and the turn's
        // checkpoints, all at or below them); none of them is in the tree.
        assert_eq!(c.held_mamba_slots(), 1);
        assert_eq!(c.held_state_slots(), 1 + checkpoints);
        assert_eq!(mamba(&c).request_owned, 1 + checkpoints, "{policy:?}");
        assert_eq!(mamba(&c).evictable + mamba(&c).protected, 0);
        // The tree alone has no state to continue from: a plain request matches nothing.
        let mut plain = req(None, extend(&t1, 0..3));
        assert_eq!(c.match_request(&mut plain).unwrap().prefix_len, 0);
        // Turn 2 continues at the whole held length (11, not page-aligned), in the same slot.
        let mut t2 = req(Some(1), extend(&t1, 200..203));
        let m = c.match_request(&mut t2).unwrap();
        assert!(m.from_session);
        assert_eq!(m.prefix_len, 11);
        assert_eq!(t2.mamba_slot, Some(running));
        assert_eq!(t2.mamba_cow, None, "no copy");
        assert_eq!(
            c.held_state_slots(),
            checkpoints,
            "the running state is lent"
        );
        c.begin_request(&mut t2).unwrap();
        let todo = t2.key.len() - t2.committed_len;
        c.alloc_tokens(&mut t2, todo).unwrap();
        t2.commit(todo).unwrap();
        c.check_request(&t2).unwrap();
        ok(&c);
        t2.append_tokens(&[300]);
        c.cache_finished_req(&mut t2, FinishKind::Finished).unwrap();
        ok(&c);
        assert_eq!(c.session_info(1).unwrap().slot_committed_len, Some(15));
        assert_eq!(
            c.sessions[&1].slot.as_ref().unwrap().mamba_slot,
            Some(running)
        );
        // Turn 3 again from the slot.
        let mut t3 = req(Some(1), extend(&t2, 400..402));
        assert_eq!(turn(&mut c, &mut t3, &[5]).prefix_len, 15);
        assert_eq!(t3.mamba_slot, None);
        // Close frees everything the slot held: no state stays request-held.
        c.close(1).unwrap();
        assert_eq!(mamba(&c).request_owned, 0, "{policy:?}");
        assert_eq!(mamba(&c).free, mamba(&c).total - mamba(&c).evictable);
        assert_drained(&c);
    }
}

#[test]
fn demotion_stores_a_page_aligned_state_and_frees_an_unaligned_one() {
    let (mut c, _) = mamba_cache(8, MambaPolicy::Sglang, SessionConfig::with_budget(1 << 20));
    // Session 1 ends at 12 committed tokens (a page boundary): its state is stored there.
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    turn(&mut c, &mut t1, &[100, 101, 102]);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, Some(12));
    assert_eq!(c.demote(1), Ok(true));
    ok(&c);
    assert_eq!(c.held_state_slots(), 0);
    let a = mamba(&c);
    assert_eq!((a.request_owned, a.evictable), (0, 1), "{a:?}");
    // The next turn continues from the stored state through the tree.
    let mut t2 = req(Some(1), extend(&t1, 200..203));
    let m = turn(&mut c, &mut t2, &[1]);
    assert!(!m.from_session);
    assert_eq!(m.prefix_len, 12);
    // Session 2 ends at 11 committed tokens: no node ends there, so its state is freed.
    c.open(2, true, None).unwrap();
    let mut u1 = req(Some(2), (1000..1010).collect());
    turn(&mut c, &mut u1, &[100, 101]);
    let before = mamba(&c);
    assert_eq!(c.demote(2), Ok(true));
    ok(&c);
    let after = mamba(&c);
    assert_eq!(after.request_owned, before.request_owned - 1);
    assert_eq!(after.free, before.free + 1, "{before:?} → {after:?}");
    c.close(1).unwrap();
    c.close(2).unwrap();
    assert_eq!(mamba(&c).request_owned, 0);
    assert_drained(&c);
}

#[test]
fn marconi_checkpoints_held_by_a_slot_are_stored_on_demotion() {
    let marconi = MambaPolicy::Marconi(radixkv_radix::MarconiParams {
        prompt_end: true,
        ..Default::default()
    });
    let (mut c, _) = mamba_cache(8, marconi, SessionConfig::with_budget(1 << 20));
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    start(&mut c, &mut t1, &[100, 101]);
    // The prompt-end checkpoint at 8 (the 10-token prompt floored to a page).
    assert_eq!(
        t1.mamba_checkpoints
            .iter()
            .map(|x| x.pos)
            .collect::<Vec<_>>(),
        vec![8]
    );
    c.cache_finished_req(&mut t1, FinishKind::Finished).unwrap();
    assert_eq!(c.held_state_slots(), 2);
    c.demote(1).unwrap();
    ok(&c);
    // The checkpoint went to the tree; the running state (11 tokens, unaligned) was freed.
    let a = mamba(&c);
    assert_eq!((a.request_owned, a.evictable), (0, 1), "{a:?}");
    let mut other = req(None, extend(&t1, 0..2));
    assert_eq!(c.match_request(&mut other).unwrap().prefix_len, 8);
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn an_aborted_lent_turn_that_ran_drops_the_stale_state_and_demotes() {
    let (mut c, _) = mamba_cache(8, MambaPolicy::Sglang, SessionConfig::with_budget(1 << 20));
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    turn(&mut c, &mut t1, &[100, 101, 102]);
    // Lent and given back before anything ran (an admission wait): the state is intact.
    let mut t2 = req(Some(1), extend(&t1, 200..203));
    assert!(c.match_request(&mut t2).unwrap().from_session);
    c.cache_finished_req(&mut t2, FinishKind::Aborted).unwrap();
    ok(&c);
    assert_eq!(c.held_mamba_slots(), 1);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, Some(12));
    // Lent, run and retracted: the running state moved past the slot's tokens, so it is freed
    // and the KV goes to the tree without a state.
    let mut t2 = req(Some(1), extend(&t1, 200..203));
    start(&mut c, &mut t2, &[]);
    c.cache_finished_req(&mut t2, FinishKind::Aborted).unwrap();
    ok(&c);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, None);
    assert_eq!(c.held_state_slots(), 0);
    let a = mamba(&c);
    assert_eq!(
        (a.request_owned, a.evictable + a.protected),
        (0, 0),
        "{a:?}"
    );
    // The retried turn runs through the tree (no state there: from scratch) and becomes the
    // slot again.
    let mut t2 = req(Some(1), extend(&t1, 200..203));
    assert_eq!(turn(&mut c, &mut t2, &[1]).prefix_len, 0);
    assert_eq!(c.held_mamba_slots(), 1);
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn held_states_are_capped_and_never_keep_a_new_request_from_a_slot() {
    // The cap: at most one held state slot; the least recently used session is demoted.
    let cfg = SessionConfig {
        max_held_state_slots: 1,
        ..SessionConfig::with_budget(1 << 20)
    };
    let (mut c, clock) = mamba_cache(8, MambaPolicy::Sglang, cfg);
    for id in [1, 2] {
        c.open(id, true, None).unwrap();
        let mut t = req(Some(id), (id as u32 * 100..id as u32 * 100 + 10).collect());
        turn(&mut c, &mut t, &[1, 2]);
        clock.advance(1);
    }
    assert_eq!(c.held_state_slots(), 1);
    assert_eq!(c.session_info(1).unwrap().slot_committed_len, None);
    assert!(c.session_info(2).unwrap().slot_committed_len.is_some());
    c.close(1).unwrap();
    c.close(2).unwrap();
    assert_drained(&c);

    // Pressure: two slots, both held by idle sessions; a new request demotes the older one.
    let (mut c, clock) = mamba_cache(2, MambaPolicy::Sglang, SessionConfig::with_budget(1 << 20));
    for id in [1, 2] {
        c.open(id, true, None).unwrap();
        let mut t = req(Some(id), (id as u32 * 100..id as u32 * 100 + 10).collect());
        turn(&mut c, &mut t, &[1, 2]);
        clock.advance(1);
    }
    assert_eq!((mamba(&c).free, c.held_state_slots()), (0, 2));
    let mut r = req(None, (5000..5010).collect());
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    ok(&c);
    assert!(r.mamba_slot.is_some());
    assert_eq!(
        c.session_info(1).unwrap().slot_committed_len,
        None,
        "LRU demoted"
    );
    assert!(c.session_info(2).unwrap().slot_committed_len.is_some());
    // Every slot running or held, none idle to demote: a typed error, nothing changes.
    let mut s = req(None, (6000..6010).collect());
    c.match_request(&mut s).unwrap();
    c.demote(2).unwrap();
    let mut q = req(None, (7000..7010).collect());
    c.match_request(&mut q).unwrap();
    c.begin_request(&mut q).unwrap();
    assert!(matches!(
        c.begin_request(&mut s),
        Err(CacheError::OutOfStateSlots { .. })
    ));
    ok(&c);
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    c.cache_finished_req(&mut q, FinishKind::Aborted).unwrap();
    c.cache_finished_req(&mut s, FinishKind::Aborted).unwrap();
    c.close(1).unwrap();
    c.close(2).unwrap();
    assert_eq!(mamba(&c).request_owned, 0);
    assert_drained(&c);
}

#[test]
fn the_request_audit_reaches_the_inner_caches_mamba_check() {
    let (mut c, _) = mamba_cache(4, MambaPolicy::Sglang, SessionConfig::with_budget(1 << 20));
    let mut r = req(None, (0..10).collect());
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    c.check_request(&r).unwrap();
    let own = r.mamba_slot.take();
    // A running request without its Mamba slot is caught through the session layer.
    assert!(c.check_request(&r).is_err());
    r.mamba_slot = own;
    // So is an idle session slot whose state the pool does not hold for a request.
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    turn(&mut c, &mut t1, &[1, 2]);
    let held = c.sessions[&1].slot.as_ref().unwrap().mamba_slot;
    c.sessions
        .get_mut(&1)
        .unwrap()
        .slot
        .as_mut()
        .unwrap()
        .mamba_slot = Some(3);
    assert!(c.check_invariants().is_err());
    c.sessions
        .get_mut(&1)
        .unwrap()
        .slot
        .as_mut()
        .unwrap()
        .mamba_slot = held;
    ok(&c);
    c.close(1).unwrap();
    assert_drained(&c);
}

#[test]
fn a_deferred_close_caches_or_frees_the_state_of_the_turn_in_flight() {
    for abort in [false, true] {
        let (mut c, _) = mamba_cache(8, MambaPolicy::Sglang, SessionConfig::with_budget(1 << 20));
        c.open(1, true, None).unwrap();
        let mut t1 = req(Some(1), (0..10).collect());
        turn(&mut c, &mut t1, &[100, 101]);
        // Turn 2 is lent the slot; the close waits for it.
        let mut t2 = req(Some(1), extend(&t1, 200..202));
        start(&mut c, &mut t2, &[1, 2, 3]);
        assert_eq!(t2.committed_len, 16, "ends a page");
        assert_eq!(c.close(1), Ok(CloseOutcome::Deferred));
        let kind = if abort {
            FinishKind::Aborted
        } else {
            FinishKind::Finished
        };
        c.cache_finished_req(&mut t2, kind).unwrap();
        ok(&c);
        assert_eq!(c.open_sessions(), 0);
        let a = mamba(&c);
        // Finished: cached like an ordinary finish (the state ends a page: stored). Aborted:
        // freed with the KV.
        assert_eq!(a.request_owned, 0, "{a:?}");
        assert_eq!(a.evictable, usize::from(!abort), "{a:?}");
        assert_drained(&c);
    }
}

#[test]
fn tracking_slots_travel_with_the_session_slot() {
    let (mut c, _) = mamba_cache_with(
        8,
        MambaPolicy::Sglang,
        true,
        SessionConfig::with_budget(1 << 20),
    );
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..10).collect());
    start(&mut c, &mut t1, &[100, 101]);
    let track = t1.mamba_track.expect("a tracking slot");
    c.cache_finished_req(&mut t1, FinishKind::Finished).unwrap();
    ok(&c);
    // The slot holds the running state and the tracking slot; turn 2 is lent both.
    assert_eq!(c.held_state_slots(), 2);
    assert_eq!(mamba(&c).request_owned, 2);
    let mut t2 = req(Some(1), extend(&t1, 200..203));
    assert!(c.match_request(&mut t2).unwrap().from_session);
    assert_eq!(t2.mamba_track.map(|t| t.slot), Some(track.slot));
    c.cache_finished_req(&mut t2, FinishKind::Aborted).unwrap();
    ok(&c);
    // Demotion at 11 tokens (unaligned): the tracking slot's state is stored at 8 and the
    // running state freed, as a finish does.
    assert_eq!(c.demote(1), Ok(true));
    ok(&c);
    let a = mamba(&c);
    assert_eq!((a.request_owned, a.evictable), (0, 1), "{a:?}");
    let mut other = req(None, extend(&t1, 0..2));
    assert_eq!(c.match_request(&mut other).unwrap().prefix_len, 8);
    // Close of a slot holding both frees both.
    let mut t2 = req(Some(1), extend(&t1, 200..203));
    turn(&mut c, &mut t2, &[1]);
    assert_eq!(c.held_state_slots(), 2);
    c.close(1).unwrap();
    assert_eq!(mamba(&c).request_owned, 0);
    assert_drained(&c);
}

/// A turn's match hashes let the extension check skip the pages they cover: the next turn is
/// compared with the history only past the last page the previous turn hashed.
#[test]
fn turns_with_match_hashes_check_only_the_unhashed_tail_of_the_history() {
    let (mut c, _) = cache();
    let hasher = c.page_hasher();
    let hashed = |tokens: Vec<TokenId>| {
        let mut r = req(Some(1), tokens);
        r.page_hashes = hasher.hashes(&Namespace::DEFAULT, &r.key.tokens);
        r
    };
    c.open(1, true, None).unwrap();
    let mut t1 = hashed((0..10).collect());
    assert_eq!(t1.page_hashes.len(), 2);
    turn(&mut c, &mut t1, &[100, 101]);
    // History: 10 prompt tokens + 2 decoded; the hash covers its first 2 pages.
    assert_eq!(
        c.sessions[&1].history_hash,
        Some((2, t1.page_hashes.get(1).unwrap()))
    );
    let mut t2 = hashed(extend(&t1, 200..209));
    assert_eq!(c.validate_turn(&t2), Ok(()));
    let m2 = turn(&mut c, &mut t2, &[300, 301]);
    assert!(m2.from_session);
    assert_eq!(c.sessions[&1].history_hash.map(|(k, _)| k), Some(5));
    // A turn that differs past the hashed pages: the tail comparison catches it.
    let mut bad_tail = t2.key.tokens.clone();
    bad_tail[21] = 7;
    let bad = hashed(bad_tail);
    assert!(matches!(
        c.validate_turn(&bad),
        Err(SessionError::NotExtending { .. })
    ));
    // A turn whose hashes claim the history's first pages while its tokens differ there
    // (hashes that are not its chain): release builds trust the hashes; debug builds compare
    // the whole history and refuse it.
    let mut lying = req(Some(1), t2.key.tokens.clone());
    lying.key.tokens[1] = 9999;
    lying.page_hashes = t2.page_hashes.clone();
    let verdict = c.validate_turn(&lying);
    if cfg!(debug_assertions) {
        assert!(matches!(verdict, Err(SessionError::NotExtending { .. })));
    } else {
        assert_eq!(verdict, Ok(()));
    }
    // A turn without hashes is compared in full, as before.
    assert_eq!(
        c.validate_turn(&req(Some(1), extend(&t2, 400..401))),
        Ok(())
    );
    c.close(1).unwrap();
    assert_drained(&c);
}

/// A turn may run without the prompt tokens the tree holds for it
/// (`RequestKv::drop_cached_prefix`, the manager's `release_cached_prompts`): an unlent turn's
/// finish gets its whole key back from the tree (`PrefixCache::restore_key`), a lent turn's
/// reads only the tokens past the history, and the session ends exactly as with whole keys:
/// the same histories, the same held KV, the same hits of the next turns.
#[test]
fn turns_without_their_cached_prefix_make_the_same_histories() {
    let mut seen = Vec::new();
    for release in [false, true] {
        let (mut c, _) = cache();
        assert!(c.takes_windowed_keys());
        c.open(1, true, None).unwrap();
        // An unlent first turn, prefilled as one chunk: the tree holds its whole pages, locked.
        let mut t1 = req(Some(1), (0..30).collect());
        chunk(&mut c, &mut t1, 30);
        let dropped = if release {
            t1.drop_cached_prefix(30)
        } else {
            0
        };
        assert_eq!(dropped, if release { 28 } else { 0 });
        t1.append_tokens(&[100, 101]);
        c.alloc_tokens(&mut t1, 1).unwrap();
        t1.commit(1).unwrap();
        c.cache_finished_req(&mut t1, FinishKind::Finished).unwrap();
        ok(&c);
        let h1 = c.sessions[&1].history.tokens.clone();
        // A lent second turn drops its slot's cached prefix (the first turn's 28 tokens).
        let mut t2 = req(Some(1), h1.iter().copied().chain(40..50).collect());
        let m2 = start(&mut c, &mut t2, &[200, 201]);
        assert!(m2.from_session && t2.kv_lent);
        let dropped = if release {
            t2.drop_cached_prefix(t2.key_len())
        } else {
            0
        };
        assert_eq!(dropped, if release { 28 } else { 0 });
        c.cache_finished_req(&mut t2, FinishKind::Finished).unwrap();
        ok(&c);
        let h2 = c.sessions[&1].history.tokens.clone();
        let held = c.session_held_tokens();
        // A third turn continues the history in the session's row.
        let mut t3 = req(Some(1), h2.iter().copied().chain(60..64).collect());
        let m3 = turn(&mut c, &mut t3, &[300]);
        assert_eq!(c.close(1), Ok(CloseOutcome::Closed));
        assert_drained(&c);
        seen.push((h1, h2, held, m3.prefix_len, m3.from_session));
    }
    assert_eq!(seen[0], seen[1]);
    let (h1, h2, ..) = &seen[1];
    assert_eq!(h1[..], (0..30).chain([100, 101]).collect::<Vec<_>>()[..]);
    assert_eq!(h2.len(), 32 + 10 + 2);
}

/// An unlent turn whose key lacks a prefix its lock does not cover (a caller's doing) cannot
/// get it back: its finish is refused and releases the turn, leaking nothing; the session
/// keeps its history. Aborted, such a turn is released without a restore.
#[test]
fn a_turn_whose_prefix_cannot_be_restored_is_refused_and_released() {
    let (mut c, _) = cache();
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..30).collect());
    start(&mut c, &mut t1, &[1]);
    assert!(!t1.kv_lent && t1.lock.is_some());
    // Nothing was cached for it (no chunk insert): its lock is on the root's path.
    t1.key_start = 8;
    t1.key.tokens.drain(..8);
    assert!(matches!(
        c.cache_finished_req(&mut t1, FinishKind::Finished),
        Err(CacheError::InvalidRequestState(_))
    ));
    assert!(t1.row.is_none() && t1.lock.is_none() && !t1.kv_lent);
    assert!(c.sessions[&1].history.is_empty());
    ok(&c);
    // An abort reads no key: the same turn aborted is released without a restore.
    let mut t2 = req(Some(1), (0..30).collect());
    start(&mut c, &mut t2, &[1]);
    t2.key_start = 8;
    t2.key.tokens.drain(..8);
    c.cache_finished_req(&mut t2, FinishKind::Aborted).unwrap();
    assert!(t2.row.is_none() && t2.lock.is_none());
    assert!(c.sessions[&1].history.is_empty());
    ok(&c);
    assert_eq!(c.close(1), Ok(CloseOutcome::Closed));
    assert_drained(&c);
}

/// A session over a cache that reads whole keys (Mamba layers here) refuses a turn whose key
/// lacks its leading tokens at its finish, releasing it as an abort and leaking nothing.
#[test]
fn a_turn_without_its_cached_prefix_is_refused_over_a_cache_that_reads_whole_keys() {
    let (mut c, _) = mamba_cache(
        8,
        MambaPolicy::default(),
        SessionConfig::with_budget(1 << 20),
    );
    assert!(!c.takes_windowed_keys());
    c.open(1, true, None).unwrap();
    let mut t1 = req(Some(1), (0..30).collect());
    turn(&mut c, &mut t1, &[1, 2]);
    let mut t2 = req(Some(1), extend(&t1, 0..8));
    start(&mut c, &mut t2, &[3]);
    t2.key_start = 1;
    t2.key.tokens.remove(0);
    assert!(matches!(
        c.cache_finished_req(&mut t2, FinishKind::Finished),
        Err(CacheError::InvalidRequestState(_))
    ));
    assert!(t2.row.is_none() && t2.lock.is_none() && !t2.kv_lent);
    ok(&c);
    assert_eq!(c.close(1), Ok(CloseOutcome::Closed));
    assert_drained(&c);
}
