//! Radix tree benchmarks with the fixed shapes of the design issue (page size 16, token ids from
//! a seeded RNG):
//! - `match/2048`: match a fully cached 2048-token prompt in a tree of 1024 chains of 2048
//!   tokens sharing a 1024-token root (reported per matched page: 128 pages);
//! - `insert/2048`: insert a new 2048-token chain sharing that root (per new page: 64 pages),
//!   measured in the steady state of a full cache (see `bench_insert`);
//! - `evict/{1K,100K,1M}`: evict 1,000 leaves from a root with that many single-page evictable
//!   leaves (per evicted leaf).
//!
//! Criterion reports time per iteration; the per-page/per-leaf figures are that time divided by
//! the element count, which criterion prints as throughput (elements/s).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use radixkv_radix::{
    InsertOptions, KeyRef, PageId, PolicyKind, PrefixCache, RadixCache, RadixConfig,
};

const P: usize = 16;
const CHAINS: usize = 1024;
const ROOT_LEN: usize = 1024;
const CHAIN_LEN: usize = 2048;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % 32_000) as u32
    }
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.next()).collect()
    }
}

fn cache(pages: usize, policy: PolicyKind) -> RadixCache {
    RadixCache::new(RadixConfig {
        page_size: P,
        total_pages: pages,
        max_rows: 16,
        policy,
        events: false,
        event_capacity: radixkv_radix::EventBuffer::DEFAULT_CAPACITY,
        disabled: false,
    })
    .unwrap()
}

fn insert(c: &mut RadixCache, tokens: &[u32]) {
    let pages = c.pools_mut().pages.alloc(tokens.len() / P).unwrap();
    let r = c
        .insert(KeyRef::new(tokens), &pages, InsertOptions::default())
        .unwrap();
    c.pools_mut().pages.free(&r.duplicates).unwrap();
}

/// 1024 chains of 2048 tokens sharing a 1024-token root.
fn chains(rng: &mut Rng) -> (RadixCache, Vec<u32>, Vec<Vec<u32>>) {
    let root = rng.tokens(ROOT_LEN);
    // Slack of one root: each insert allocates the whole chain before its duplicates are freed.
    let mut c = cache(
        2 * ROOT_LEN / P + CHAINS * (CHAIN_LEN - ROOT_LEN) / P,
        PolicyKind::Lru,
    );
    let mut all = Vec::with_capacity(CHAINS);
    for _ in 0..CHAINS {
        let mut t = root.clone();
        t.extend(rng.tokens(CHAIN_LEN - ROOT_LEN));
        insert(&mut c, &t);
        all.push(t);
    }
    (c, root, all)
}

fn bench_match(cr: &mut Criterion) {
    let mut rng = Rng(1);
    let (mut c, _, all) = chains(&mut rng);
    let mut out: Vec<PageId> = Vec::with_capacity(CHAIN_LEN / P);
    let mut g = cr.benchmark_group("match");
    g.throughput(Throughput::Elements((CHAIN_LEN / P) as u64));
    let mut i = 0usize;
    g.bench_function("2048", |b| {
        b.iter(|| {
            out.clear();
            i = (i + 7919) % CHAINS;
            let m = c.match_prefix_into(KeyRef::new(black_box(&all[i])), &mut out);
            debug_assert_eq!(m.device_len, CHAIN_LEN);
            black_box(m);
        })
    });
    g.finish();
}

fn bench_insert(cr: &mut Criterion) {
    const BATCH: u64 = 256;
    let mut rng = Rng(2);
    let new_pages = (CHAIN_LEN - ROOT_LEN) / P;
    // MRU, so the untimed clean-up after each batch evicts exactly the chains the batch added
    // and the tree returns to its 1024-chain shape: every batch measures inserts into the same
    // tree, in the steady state of a full cache (edge buffers recycled by eviction).
    let root = rng.tokens(ROOT_LEN);
    let mut c = cache(
        2 * ROOT_LEN / P + (CHAINS + BATCH as usize) * CHAIN_LEN / P,
        PolicyKind::Mru,
    );
    for _ in 0..CHAINS {
        let mut t = root.clone();
        t.extend(rng.tokens(CHAIN_LEN - ROOT_LEN));
        insert(&mut c, &t);
    }
    let mut g = cr.benchmark_group("insert");
    g.throughput(Throughput::Elements(new_pages as u64));
    g.bench_function("2048", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(BATCH);
                left -= n;
                let work: Vec<(Vec<u32>, Vec<PageId>)> = (0..n)
                    .map(|_| {
                        let mut t = root.clone();
                        t.extend(rng.tokens(CHAIN_LEN - ROOT_LEN));
                        let pg = c.pools_mut().pages.alloc(CHAIN_LEN / P).unwrap();
                        (t, pg)
                    })
                    .collect();
                let mut dups = Vec::with_capacity(n as usize);
                let start = Instant::now();
                for (t, pg) in &work {
                    let r = c
                        .insert(KeyRef::new(t), pg, InsertOptions::default())
                        .unwrap();
                    dups.push(r.duplicates);
                }
                total += start.elapsed();
                for d in dups {
                    c.pools_mut().pages.free(&d).unwrap();
                }
                let evicted = c.evict(n as usize * new_pages * P);
                assert_eq!(evicted, n as usize * new_pages * P);
            }
            total
        })
    });
    g.finish();
}

/// Evicts `k` single-page leaves per iteration (timed) and refills them with `refill`
/// (untimed), so every iteration sees the same leaf count.
fn time_evictions(
    iters: u64,
    c: &mut RadixCache,
    k: usize,
    mut refill: impl FnMut(&mut RadixCache, usize),
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let start = Instant::now();
        let freed = c.evict(k * P);
        total += start.elapsed();
        assert_eq!(freed, k * P);
        refill(c, k);
    }
    total
}

fn bench_evict(cr: &mut Criterion) {
    const K: usize = 1000;
    let mut g = cr.benchmark_group("evict");
    g.throughput(Throughput::Elements(K as u64));
    g.sample_size(20);
    for (label, leaves) in [("1K", 1_000usize), ("100K", 100_000), ("1M", 1_000_000)] {
        let mut rng = Rng(3);
        let mut c = cache(leaves + K, PolicyKind::Lru);
        for _ in 0..leaves {
            insert(&mut c, &rng.tokens(P));
        }
        g.bench_function(BenchmarkId::from_parameter(label), |b| {
            b.iter_custom(|iters| {
                time_evictions(iters, &mut c, K, |c, n| {
                    for _ in 0..n {
                        insert(c, &rng.tokens(P));
                    }
                })
            })
        });
    }
    g.finish();
}

/// Eviction cost per policy at 100K leaves, a third of which were reused (so the
/// frequency-aware policies order more than one class).
fn bench_evict_policies(cr: &mut Criterion) {
    const K: usize = 1000;
    let mut g = cr.benchmark_group("evict_policy");
    g.throughput(Throughput::Elements(K as u64));
    g.sample_size(20);
    for policy in [
        PolicyKind::Lru,
        PolicyKind::Reuse,
        PolicyKind::Slru,
        PolicyKind::Sieve,
    ] {
        let mut rng = Rng(5);
        let mut c = cache(100_000 + K, policy);
        let mut fill = move |c: &mut RadixCache, n: usize| {
            for i in 0..n {
                let t = rng.tokens(P);
                insert(c, &t);
                if i % 3 == 0 {
                    insert(c, &t);
                }
            }
        };
        fill(&mut c, 100_000);
        g.bench_function(BenchmarkId::from_parameter(policy.name()), |b| {
            b.iter_custom(|iters| time_evictions(iters, &mut c, K, &mut fill))
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    targets = bench_match, bench_insert, bench_evict, bench_evict_policies
}
criterion_main!(benches);
