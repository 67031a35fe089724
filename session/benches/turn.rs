//! Cost of a session turn against a plain tree match of the same history length (page size 16,
//! histories of 8K, 32K and 128K tokens):
//! - `session_turn/N`: restore (match from the slot: validate the key, lend the row, return the
//!   page indices) + one new token computed + save (the slot takes the row back);
//! - `history_check/N`: the part of the restore that compares the new key with the history
//!   (a memcmp of N tokens; the rest of the restore is O(pages) index copying);
//! - `tree_match/N`: `match_request` of the same key against a radix cache holding the history
//!   as one cached chain (no lock, no row);
//! - `tree_turn/N`: the same plain turn through the radix cache (match, lock, row, one new
//!   token, insert on finish).
//!
//! The session's history grows by one token per iteration; each criterion sample starts from a
//! fresh session so it never outgrows the pool (the rebuild is not timed).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use radixkv_radix::{
    FinishKind, PrefixCache, RadixCache, RadixConfig, RadixKey, RequestKv, SessionTag, TokenId,
};
use radixkv_session::{ManualClock, SessionAwareCache, SessionConfig};

const P: usize = 16;
const SIZES: [usize; 3] = [8 << 10, 32 << 10, 128 << 10];
/// Pool room for the growth of one sample (one token per iteration).
const SLACK_TOKENS: usize = 1 << 21;

fn radix(history: usize) -> RadixCache {
    RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: (2 * history + SLACK_TOKENS) / P,
        max_rows: 8,
        ..Default::default()
    })
    .unwrap()
}

fn tokens(n: usize) -> Vec<TokenId> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 32_000)
        .collect()
}

/// Runs a request to completion with every token but the last computed.
fn run<C: PrefixCache>(c: &mut C, req: &mut RequestKv) {
    c.match_request(req).unwrap();
    c.begin_request(req).unwrap();
    let todo = req.key.len() - 1 - req.committed_len;
    c.alloc_tokens(req, todo).unwrap();
    req.commit(todo).unwrap();
    c.cache_finished_req(req, FinishKind::Finished).unwrap();
}

type Sessions = SessionAwareCache<RadixCache, ManualClock>;

/// A session whose first turn of `n` tokens is held in its slot.
fn session(n: usize) -> (Sessions, RequestKv) {
    let mut c = SessionAwareCache::with_clock(
        radix(n),
        SessionConfig::with_budget(usize::MAX),
        ManualClock::new(0),
    );
    c.open(1, true, None).unwrap();
    let mut req = RequestKv::new(RadixKey::new(tokens(n)));
    req.session = Some(SessionTag {
        id: 1,
        streaming: true,
    });
    run(&mut c, &mut req);
    (c, req)
}

fn bench(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("turn");
    g.sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for n in SIZES {
        g.bench_with_input(BenchmarkId::new("session_turn", n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let (mut c, mut req) = session(n);
                let start = Instant::now();
                for i in 0..iters {
                    // Turn N+1 = turn N's tokens + one new token: it computes turn N's last
                    // token (never computed during decode); its own last one stays pending.
                    req.append_tokens(&[i as TokenId]);
                    let m = c.match_request(&mut req).unwrap();
                    black_box(&req.prefix_pages);
                    c.begin_request(&mut req).unwrap();
                    let todo = req.key.len() - 1 - m.prefix_len;
                    c.alloc_tokens(&mut req, todo).unwrap();
                    req.commit(todo).unwrap();
                    c.cache_finished_req(&mut req, FinishKind::Finished)
                        .unwrap();
                }
                start.elapsed()
            });
        });
        g.bench_with_input(BenchmarkId::new("history_check", n), &n, |b, &n| {
            let (c, mut req) = session(n);
            req.append_tokens(&[1]);
            b.iter(|| black_box(c.validate_turn(&req)).unwrap());
        });
        g.bench_with_input(BenchmarkId::new("tree_match", n), &n, |b, &n| {
            let mut c = radix(n);
            let mut first = RequestKv::new(RadixKey::new(tokens(n + 1)));
            run(&mut c, &mut first);
            let mut req = RequestKv::new(RadixKey::new(tokens(n + 1)));
            b.iter(|| black_box(c.match_request(&mut req).unwrap()));
        });
        g.bench_with_input(BenchmarkId::new("tree_turn", n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let mut c = radix(n);
                let mut req = RequestKv::new(RadixKey::new(tokens(n)));
                run(&mut c, &mut req);
                let start = Instant::now();
                for i in 0..iters {
                    req.append_tokens(&[i as TokenId]);
                    run(&mut c, &mut req);
                }
                start.elapsed()
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
