//! The value of sessions: under memory pressure from non-session traffic, a session's next turn
//! hits its whole history with sessions on, and loses it with sessions off (plain radix cache,
//! where the idle conversation is ordinary LRU cache and gets evicted).

use radixkv_radix::{
    FinishKind, PrefixCache, RadixCache, RadixConfig, RadixKey, RequestKv, SessionTag, TokenId,
};
use radixkv_session::{ManualClock, SessionAwareCache, SessionConfig};

const P: usize = 16;
const PAGES: usize = 64; // 1024 tokens

fn radix() -> RadixCache {
    RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: PAGES,
        max_rows: 8,
        ..Default::default()
    })
    .unwrap()
}

/// Runs one request to completion; returns the matched prefix length.
fn run<C: PrefixCache>(c: &mut C, req: &mut RequestKv, generated: &[TokenId]) -> usize {
    let m = c.match_request(req).unwrap();
    c.begin_request(req).unwrap();
    let todo = req.key.len() - req.committed_len;
    c.alloc_tokens(req, todo).unwrap();
    req.commit(todo).unwrap();
    // The prompt is published at the end of prefill, as a chunked-prefill scheduler does.
    c.cache_unfinished_req(req).unwrap();
    req.append_tokens(generated);
    c.alloc_tokens(req, generated.len() - 1).unwrap();
    req.commit(generated.len() - 1).unwrap();
    c.cache_finished_req(req, FinishKind::Finished).unwrap();
    c.check_invariants().unwrap();
    m.prefix_len
}

/// Turn 1 of a 300-token conversation, then 40 unrelated 200-token requests (8000 tokens of
/// traffic through a 1024-token pool), then turn 2. Returns (turn 2 prefix, turn 1 committed).
fn scenario<C: PrefixCache>(c: &mut C) -> (usize, usize) {
    let tag = Some(SessionTag {
        id: 1,
        streaming: true,
    });
    let mut t1 = RequestKv {
        session: tag,
        ..RequestKv::new(RadixKey::new((0..290).collect()))
    };
    run(c, &mut t1, &(5000..5010).collect::<Vec<_>>());
    let committed = t1.key.len() - 1;
    for i in 0..40u32 {
        let base = 10_000 + i * 1000;
        let mut other = RequestKv::new(RadixKey::new((base..base + 190).collect()));
        run(c, &mut other, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
    }
    let mut tokens = t1.key.tokens.clone();
    tokens.extend(7000..7020);
    let mut t2 = RequestKv {
        session: tag,
        ..RequestKv::new(RadixKey::new(tokens))
    };
    (run(c, &mut t2, &[1, 2]), committed)
}

#[test]
fn sessions_keep_the_history_that_plain_caching_loses_under_pressure() {
    let mut on = SessionAwareCache::with_clock(
        radix(),
        SessionConfig::with_budget(512),
        ManualClock::new(0),
    );
    on.open(1, true, None).unwrap();
    let (hit_on, committed) = scenario(&mut on);
    assert_eq!(
        hit_on, committed,
        "sessions on: the whole history is reused"
    );
    assert_eq!(committed, 299);

    let mut off = radix();
    let (hit_off, _) = scenario(&mut off);
    assert_eq!(
        hit_off, 0,
        "sessions off: the idle conversation was evicted"
    );

    on.close(1).unwrap();
    on.check_invariants().unwrap();
    let a = on.accounting();
    assert_eq!(a.free + a.evictable, a.total);
}
