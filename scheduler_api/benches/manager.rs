//! The manager's per-token cost on the decode hot path.
//!
//! `decode/32`: 32 running requests (64-token prompts, page size 16, device-only radix cache),
//! each decoding one token per step, every step bracketed by `begin_step` / `end_step` as a
//! scheduler does; reported per decoded token. A round decodes 512 tokens per request; between
//! rounds (untimed) the requests are aborted and fresh ones admitted and prefilled, so the pool
//! never fills and no decode evicts. The per-step invariant audit is off, as in release builds.
//!
//! Run it with and without a `tracing` subscriber in mind: none is installed here, which is the
//! case of an engine that has not enabled `debug` for `radixkv_scheduler_api`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use radixkv_scheduler_api::{Admission, KvCacheManager, ReqId, Request};

const BATCH: usize = 32;
const PROMPT: u32 = 64;
const ROUND: usize = 512;

/// Admits and prefills a fresh batch; returns its handles.
fn fresh_batch(kv: &mut KvCacheManager, round: u32) -> Vec<ReqId> {
    let mut ids = Vec::with_capacity(BATCH);
    for i in 0..BATCH as u32 {
        let base = (round * BATCH as u32 + i) * PROMPT;
        let r = kv
            .arrive(Request::new((base..base + PROMPT).collect()).max_new_tokens(ROUND))
            .expect("arrive");
        let Ok(Admission::Ready(a)) = kv.admit(r) else {
            panic!("the bench's pool holds every request");
        };
        kv.extend(r, a.extend_tokens).expect("extend");
        ids.push(r);
    }
    let step = kv.begin_step();
    for &r in &ids {
        kv.chunk_done(r).expect("chunk_done");
    }
    kv.end_step(step).expect("end_step");
    ids
}

fn bench_decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode");
    g.throughput(Throughput::Elements(1));
    g.bench_function(format!("{BATCH}"), |b| {
        b.iter_custom(|iters| {
            let mut kv = KvCacheManager::builder()
                .page_size(16)
                .device_tokens(4 * BATCH * (PROMPT as usize + ROUND))
                .build()
                .expect("manager");
            kv.set_check_every_step(false);
            let mut round = 0;
            let mut ids = fresh_batch(&mut kv, round);
            let mut decoded_in_round = 0;
            let mut done = 0u64;
            let mut spent = Duration::ZERO;
            while done < iters {
                if decoded_in_round == ROUND {
                    for &r in &ids {
                        kv.abort(r).expect("abort");
                    }
                    round += 1;
                    ids = fresh_batch(&mut kv, round);
                    decoded_in_round = 0;
                }
                let start = Instant::now();
                let step = kv.begin_step();
                for (i, &r) in ids.iter().enumerate() {
                    black_box(kv.decode(r, i as u32).expect("decode"));
                }
                kv.end_step(step).expect("end_step");
                spent += start.elapsed();
                decoded_in_round += 1;
                done += BATCH as u64;
            }
            // `iters` decodes were asked for; the last step may have done a few more.
            spent.mul_f64(iters as f64 / done as f64)
        })
    });
    g.finish();
}

criterion_group!(benches, bench_decode);
criterion_main!(benches);
