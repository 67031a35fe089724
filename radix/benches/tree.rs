//! Radix tree benchmarks with the fixed shapes of the design issue (page size 16, token ids from
//! a seeded RNG):
//! - `match/2048`: match a fully cached 2048-token prompt in a tree of 1024 chains of 2048
//!   tokens sharing a 1024-token root (reported per matched page: 128 pages);
//! - `insert/2048`: insert a new 2048-token chain sharing that root (per new page: 64 pages),
//!   measured in the steady state of a full cache (see `bench_insert`);
//! - `evict/{1K,100K,1M}`: evict 1,000 leaves from a root with that many single-page evictable
//!   leaves (per evicted leaf);
//! - `match_fanout/{3,6,12}`: match a random root-to-leaf path in a tree whose every inner node
//!   has that many single-page children (tens of thousands of leaves; per matched page): the
//!   child lookup below the root, inline list or table, is the whole cost.
//! - `mamba/match_2048`: `match/2048`'s shape with the Mamba component and a state at the end
//!   of every chain (per matched page: the walk back to the deepest state is included);
//! - `mamba/alloc_evict`: allocate a request slot from a full pool of 1,024 unlocked states
//!   (evicting the least recently used one) and store it back as a state (per slot).
//!
//! Each group builds its tree the first time it runs, so a filtered run (`-- evict/1M`) builds
//! only what it measures. Criterion reports time per iteration; the per-page/per-leaf figures are that time divided by
//! the element count, which criterion prints as throughput (elements/s).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use radixkv_radix::{
    InsertOptions, KeyRef, NodeId, PageId, PolicyKind, PrefixCache, RadixCache, RadixConfig,
};
use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng as _, SeedableRng};

const P: usize = 16;
const CHAINS: usize = 1024;
const ROOT_LEN: usize = 1024;
const CHAIN_LEN: usize = 2048;

/// Token ids below 32,000 (a typical vocabulary) from a seeded SplitMix64 stream.
struct Rng(SplitMix64);
impl Rng {
    fn new(seed: u64) -> Self {
        Rng(SplitMix64::seed_from_u64(seed))
    }
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| (self.0.next_u64() % 32_000) as u32)
            .collect()
    }
}

fn cache_config(pages: usize, policy: PolicyKind) -> RadixConfig {
    RadixConfig {
        page_size: P,
        total_pages: pages,
        max_rows: 16,
        policy,
        events: false,
        event_capacity: radixkv_radix::EventBuffer::DEFAULT_CAPACITY,
        disabled: false,
        mamba_slots: None,
        swa: None,
        mamba_policy: Default::default(),
        mamba_track: true,
        event_page_keys: None,
    }
}

fn cache(pages: usize, policy: PolicyKind) -> RadixCache {
    RadixCache::new(cache_config(pages, policy)).unwrap()
}

fn mamba_cache(pages: usize, slots: u32) -> RadixCache {
    RadixCache::new(RadixConfig {
        mamba_slots: Some(slots),
        // The figures in the README are the baseline's (LRU, one slot per request).
        mamba_policy: radixkv_radix::MambaPolicy::Sglang,
        ..cache_config(pages, PolicyKind::Lru)
    })
    .unwrap()
}

/// Inserts `tokens`; returns the node that ends them.
fn insert(c: &mut RadixCache, tokens: &[u32]) -> NodeId {
    let pages = c.pools_mut().pages.alloc(tokens.len() / P).unwrap();
    let r = c
        .insert(KeyRef::new(tokens), &pages, InsertOptions::default())
        .unwrap();
    c.pools_mut().pages.free(&r.duplicates).unwrap();
    r.last_node
}

/// Pages of [`chains`]' tree, with a slack of one root: each insert allocates the whole chain
/// before its duplicates are freed.
const CHAINS_PAGES: usize = 2 * ROOT_LEN / P + CHAINS * (CHAIN_LEN - ROOT_LEN) / P;

/// 1024 chains of 2048 tokens sharing a 1024-token root, in `c` (of [`CHAINS_PAGES`] pages).
/// Returns the root tokens, each chain's tokens and the node that ends it.
fn chains_in(c: &mut RadixCache, rng: &mut Rng) -> (Vec<u32>, Vec<Vec<u32>>, Vec<NodeId>) {
    let root = rng.tokens(ROOT_LEN);
    let mut all = Vec::with_capacity(CHAINS);
    let mut ends = Vec::with_capacity(CHAINS);
    for _ in 0..CHAINS {
        let mut t = root.clone();
        t.extend(rng.tokens(CHAIN_LEN - ROOT_LEN));
        ends.push(insert(c, &t));
        all.push(t);
    }
    (root, all, ends)
}

/// [`chains_in`] a fresh KV-only LRU cache.
fn chains(rng: &mut Rng) -> (RadixCache, Vec<u32>, Vec<Vec<u32>>) {
    let mut c = cache(CHAINS_PAGES, PolicyKind::Lru);
    let (root, all, _) = chains_in(&mut c, rng);
    (c, root, all)
}

fn bench_match(cr: &mut Criterion) {
    let mut tree = None;
    let mut out: Vec<PageId> = Vec::with_capacity(CHAIN_LEN / P);
    let mut g = cr.benchmark_group("match");
    g.throughput(Throughput::Elements((CHAIN_LEN / P) as u64));
    let mut i = 0usize;
    g.bench_function("2048", |b| {
        let (c, _, all) = tree.get_or_insert_with(|| chains(&mut Rng::new(1)));
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
    let new_pages = (CHAIN_LEN - ROOT_LEN) / P;
    // MRU, so the untimed clean-up after each batch evicts exactly the chains the batch added
    // and the tree returns to its 1024-chain shape: every batch measures inserts into the same
    // tree, in the steady state of a full cache (edge buffers recycled by eviction).
    let setup = || {
        let mut rng = Rng::new(2);
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
        (rng, root, c)
    };
    let mut tree = None;
    let mut g = cr.benchmark_group("insert");
    g.throughput(Throughput::Elements(new_pages as u64));
    g.bench_function("2048", |b| {
        let (rng, root, c) = tree.get_or_insert_with(setup);
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

/// Matches a random leaf path in a complete tree of fan-out `k` with single-page edges, about
/// 2^16 leaves deep enough to not fit in cache.
fn bench_match_fanout(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("match_fanout");
    for k in [3usize, 6, 12] {
        let depth = (65_536f64.ln() / (k as f64).ln()).floor() as usize;
        let leaves = k.pow(depth as u32);
        // The page of child `c` at level `l`, the same under every parent of that level.
        let mut rng = Rng::new(7);
        let pages: Vec<Vec<Vec<u32>>> = (0..depth)
            .map(|_| (0..k).map(|_| rng.tokens(P)).collect())
            .collect();
        let path = |mut leaf: usize| {
            let mut t = Vec::with_capacity(depth * P);
            for level in &pages {
                t.extend_from_slice(&level[leaf % k]);
                leaf /= k;
            }
            t
        };
        let mut tree = None;
        let mut out: Vec<PageId> = Vec::with_capacity(depth);
        let mut i = 0usize;
        g.throughput(Throughput::Elements(depth as u64));
        g.bench_function(BenchmarkId::from_parameter(k), |b| {
            let (c, probes) = tree.get_or_insert_with(|| {
                let mut c = cache(depth * (leaves + 1), PolicyKind::Lru);
                for leaf in 0..leaves {
                    insert(&mut c, &path(leaf));
                }
                let probes: Vec<Vec<u32>> = (0..4096).map(|i| path((i * 7919) % leaves)).collect();
                (c, probes)
            });
            b.iter(|| {
                out.clear();
                i = (i + 1) % probes.len();
                let m = c.match_prefix_into(KeyRef::new(black_box(&probes[i])), &mut out);
                debug_assert_eq!(m.device_len, depth * P);
                black_box(m);
            })
        });
    }
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
        let mut tree = None;
        g.bench_function(BenchmarkId::from_parameter(label), |b| {
            let (rng, c) = tree.get_or_insert_with(|| {
                let mut rng = Rng::new(3);
                let mut c = cache(leaves + K, PolicyKind::Lru);
                for _ in 0..leaves {
                    insert(&mut c, &rng.tokens(P));
                }
                (rng, c)
            });
            b.iter_custom(|iters| {
                time_evictions(iters, c, K, |c, n| {
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
        let mut rng = Rng::new(5);
        let mut fill = move |c: &mut RadixCache, n: usize| {
            for i in 0..n {
                let t = rng.tokens(P);
                insert(c, &t);
                if i % 3 == 0 {
                    insert(c, &t);
                }
            }
        };
        let mut tree = None;
        g.bench_function(BenchmarkId::from_parameter(policy.name()), |b| {
            let c = tree.get_or_insert_with(|| {
                let mut c = cache(100_000 + K, policy);
                fill(&mut c, 100_000);
                c
            });
            b.iter_custom(|iters| time_evictions(iters, c, K, &mut fill))
        });
    }
    g.finish();
}

/// The Mamba component: a match cut back to the deepest state, and slot allocation under
/// pressure.
fn bench_mamba(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("mamba");
    let setup = || {
        let mut c = mamba_cache(CHAINS_PAGES, CHAINS as u32);
        // A split keeps a node's id on its lower half, so every end stays valid.
        let (_, all, ends) = chains_in(&mut c, &mut Rng::new(1));
        let (tree, _) = c.parts_mut();
        for &end in &ends {
            let slot = tree.alloc_mamba_slot().unwrap();
            tree.insert_mamba_state(end, slot).unwrap();
        }
        (c, all, ends)
    };
    let mut tree = None;
    let mut out: Vec<PageId> = Vec::with_capacity(CHAIN_LEN / P);
    let mut i = 0usize;
    g.throughput(Throughput::Elements((CHAIN_LEN / P) as u64));
    g.bench_function("match_2048", |b| {
        let (c, all, _) = tree.get_or_insert_with(setup);
        b.iter(|| {
            out.clear();
            i = (i + 7919) % CHAINS;
            let m = c.match_prefix(KeyRef::new(black_box(&all[i])), &mut out);
            debug_assert_eq!(m.as_ref().map(|m| m.device_len), Ok(CHAIN_LEN));
            black_box(m).ok();
        })
    });
    g.throughput(Throughput::Elements(1));
    let mut fresh = None;
    let mut k = 0usize;
    g.bench_function("alloc_evict", |b| {
        let (c, _, ends) = fresh.get_or_insert_with(setup);
        let (t, _) = c.parts_mut();
        b.iter(|| {
            // The pool is full and nothing touches the states but this loop, so the victim is
            // always the state stored longest ago: `ends[k]`, which gets the slot back.
            let slot = t.alloc_mamba_slot().unwrap();
            let node = ends[k];
            k = (k + 1) % CHAINS;
            debug_assert_eq!(t.mamba_state(node), Ok(None));
            black_box(t.insert_mamba_state(node, slot)).ok();
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    targets = bench_match, bench_insert, bench_evict, bench_evict_policies, bench_match_fanout,
        bench_mamba
}
criterion_main!(benches);
