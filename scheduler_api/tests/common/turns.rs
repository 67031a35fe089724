//! A session-turn driver shared by the session tests over a host tier: admission that waits
//! out in-flight transfers, one turn's prefill, decode and finish with every pool audited after
//! each call, the idle-TTL demotion of every session, and the final check that nothing is held.

use radixkv_scheduler_api::{Admission, Admitted, KvCacheManager, ReqId, Request};

use super::{balanced, session_budget, step};

/// Admits `id`; a wait is answered by draining the transfers in flight (a backup may still
/// pin window pages or a state) and trying again.
pub fn admit(kv: &mut KvCacheManager, id: ReqId) -> Admitted {
    for _ in 0..4 {
        match kv.admit(id).unwrap() {
            Admission::Ready(a) => return a,
            Admission::Wait(_) => {
                kv.drain().unwrap();
                balanced(kv);
            }
            Admission::Never(n) => panic!("never admissible: {n:?}"),
        }
    }
    panic!("still waiting after the transfers drained");
}

/// Arrives, admits and prefills one request (of `session`, if any) in one step.
pub fn start(
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
    let a = admit(kv, id);
    assert_eq!(
        a.mamba_slot.is_some(),
        kv.mamba_accounting().is_some(),
        "a running request holds a state slot where the model has Mamba layers"
    );
    balanced(kv);
    kv.extend(id, a.extend_tokens).unwrap();
    balanced(kv);
    let s = kv.begin_step();
    kv.chunk_done(id).unwrap();
    kv.end_step(s).unwrap();
    balanced(kv);
    (id, a)
}

/// One turn (or a request without a session): prefill, `out − 1` decode steps (tokens 9000,
/// 9001, …), finish.
pub fn turn(kv: &mut KvCacheManager, session: Option<u64>, tokens: Vec<u32>, out: u32) -> Admitted {
    let (id, a) = start(kv, session, tokens, out);
    for t in 0..out.saturating_sub(1) {
        kv.decode(id, 9_000 + t).unwrap();
        step(kv);
        balanced(kv);
    }
    kv.finish(id).unwrap();
    balanced(kv);
    a
}

/// `tokens` followed by the `out − 1` fed-back outputs of `turn` and `more`.
pub fn next(tokens: &[u32], out: u32, more: std::ops::Range<u32>) -> Vec<u32> {
    let mut t = tokens.to_vec();
    t.extend((0..out - 1).map(|i| 9_000 + i));
    t.extend(more);
    t
}

/// Demotes every idle session through the idle TTL (the clock moves past it, one step).
pub fn expire(kv: &mut KvCacheManager) {
    let now = kv.time_ms();
    kv.set_time_ms(now + session_budget().idle_ttl_ms + 1);
    step(kv);
    balanced(kv);
    assert_eq!(
        kv.metrics().gauges.held_sessions,
        0,
        "every session demoted"
    );
}

/// Nothing held: no session, request, transfer or lock holds a page of any pool (the SWA
/// pool, which these models have, and the state slots where the model has Mamba layers).
pub fn drained(kv: &mut KvCacheManager) {
    kv.drain().unwrap();
    balanced(kv);
    let a = kv.accounting();
    assert_eq!(a.session_held + a.protected + a.request_owned, 0, "{a:?}");
    let s = kv.swa_accounting().unwrap();
    assert_eq!(s.protected + s.request_owned, 0, "{s:?}");
    if let Some(m) = kv.mamba_accounting() {
        assert_eq!(m.protected + m.request_owned, 0, "{m:?}");
    }
}
