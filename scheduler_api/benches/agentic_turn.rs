//! The manager's cost of one agentic turn against its cached history.
//!
//! `turn/<cache>/<history>`: a conversation whose first `history` tokens (32K, 128K or 512K)
//! are cached on the device sends a turn of those tokens plus 1K new ones; the timed work is
//! the turn's whole life in the manager: `arrive`, `admit` (the match of the history), the
//! prefill allocation of the new tokens (`extend`), the step around it
//! (`begin_step` / `chunk_done` / `end_step`) and `finish` (the insert of the new tokens).
//! Building the turn's token vector (with room for the output) is not timed (a scheduler has it
//! from its tokenizer). Each
//! turn adds a 1K branch below the history, so the 1M-token device pool fills and the
//! oldest branches are evicted: the steady state of a full cache.
//!
//! `radix`: the radix cache with LRU eviction. `hicache`: a 4M-token host tier under it,
//! write-back (the host copies of each turn complete, untimed, before the next one). The
//! `+hashes` variants hand the turn's match hashes over (`Request::page_hashes`): the
//! history's are computed once and each turn extends them by its new pages, untimed, as an
//! engine that keeps its conversations' hashes does.
//!
//! The goal (issue 13): a cost flat in the history apart from the walk over its pages, i.e.
//! nothing proportional to the history but the comparison of the turn's tokens against the
//! cached pages.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use radixkv_radix::Namespace;
use radixkv_scheduler_api::{
    Admission, HostTier, KvCacheManager, PageHashes, Request, WaitReason, WritePolicy,
};

const DEVICE: usize = 1 << 20;
const NEW: u32 = 1024;
const HISTORIES: [u32; 3] = [32 << 10, 128 << 10, 512 << 10];

fn manager(hicache: bool) -> KvCacheManager {
    let mut b = KvCacheManager::builder()
        .page_size(16)
        .device_tokens(DEVICE);
    if hicache {
        b = b.host_tier(HostTier::ratio(DEVICE, 4.0).write_policy(WritePolicy::WriteBack));
    }
    let mut kv = b.build().expect("manager");
    kv.set_check_every_step(false);
    kv
}

/// Runs one turn of `tokens` through the manager (prefill of everything not cached, one
/// step, finish); returns the time spent in the manager. An admission that waits for the room
/// its write-back eviction frees (HiCache) waits, untimed, for the copies, as a scheduler
/// waits a step, and is admitted again.
fn turn(kv: &mut KvCacheManager, tokens: Vec<u32>, hashes: PageHashes) -> Duration {
    let start = Instant::now();
    let id = kv
        .arrive(Request::new(tokens).page_hashes(hashes).max_new_tokens(1))
        .expect("arrive");
    let mut spent = Duration::ZERO;
    let mut clock = start;
    let a = loop {
        match kv.admit(id).expect("admit") {
            Admission::Ready(a) => break a,
            Admission::Wait(WaitReason::RoomInFlight { .. }) => {
                spent += clock.elapsed();
                kv.drain().expect("drain");
                clock = Instant::now();
            }
            other => panic!("the bench's pool holds every turn: {other:?}"),
        }
    };
    kv.extend(id, a.extend_tokens).expect("extend");
    let step = kv.begin_step();
    kv.chunk_done(id).expect("chunk_done");
    kv.finish(id).expect("finish");
    kv.end_step(step).expect("end_step");
    spent + clock.elapsed()
}

fn bench_turn(c: &mut Criterion) {
    let mut g = c.benchmark_group("turn");
    g.sample_size(20);
    g.warm_up_time(Duration::from_secs(2));
    g.measurement_time(Duration::from_secs(5));
    for (hicache, hashed) in [(false, false), (false, true), (true, false), (true, true)] {
        let cache = match (hicache, hashed) {
            (false, false) => "radix",
            (false, true) => "radix+hashes",
            (true, false) => "hicache",
            (true, true) => "hicache+hashes",
        };
        for history in HISTORIES {
            g.bench_with_input(BenchmarkId::new(cache, history), &history, |b, &history| {
                b.iter_custom(|iters| {
                    let mut kv = manager(hicache);
                    let hasher = kv.page_hasher();
                    let ns = Namespace::DEFAULT;
                    // The history: token values no turn's new tokens use.
                    let base: Vec<u32> = (0..history).map(|t| t | 1 << 31).collect();
                    let mut base_hashes = PageHashes::new();
                    if hashed {
                        hasher.extend_chain(&ns, &base, &mut base_hashes);
                    }
                    turn(&mut kv, base.clone(), base_hashes.clone());
                    kv.drain().expect("drain");
                    let mut fresh = 0u32;
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        // Room for the output token, as a scheduler that knows
                        // `max_new_tokens` leaves (else `arrive` grows the vector: a copy).
                        let mut tokens = Vec::with_capacity((history + NEW + 1) as usize);
                        tokens.extend_from_slice(&base);
                        tokens.extend(fresh..fresh + NEW);
                        fresh += NEW;
                        // The history's hashes are shared with the turn's (a clone).
                        let mut hashes = PageHashes::new();
                        if hashed {
                            hashes = base_hashes.clone();
                            hasher.extend_chain(&ns, &tokens, &mut hashes);
                        }
                        spent += turn(&mut kv, tokens, hashes);
                        kv.drain().expect("drain");
                    }
                    spent
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench_turn);
criterion_main!(benches);
