//! Cross-checks of the simulator on random conversation traces: the keyed LRU against the
//! shipped one, and the offline bounds against every policy.

use radixkv_radix::PolicyKind;

use super::blocks::build;
use super::evict::{Victims, simulate};
use crate::trace::{Rng, Segment, Trace, TraceRequest};

/// Conversations whose turns extend the previous turn's blocks, over a few shared first
/// blocks, with random lengths, interleaved by arrival.
fn random_trace(seed: u64, conversations: u64) -> Trace {
    let mut rng = Rng::new(seed);
    let mut requests = Vec::new();
    let mut next_id = 100u64;
    for c in 0..conversations {
        let mut ids = vec![rng.range(0, 3)];
        let mut at = rng.range(0, 1_000) * 1_000_000;
        for _ in 0..rng.range(1, 6) {
            for _ in 0..rng.range(1, 4) {
                ids.push(next_id);
                next_id += 1;
            }
            let len = ids.len() as u64 * 16 - rng.range(0, 15);
            let mut prompt = Vec::new();
            for &id in &ids {
                prompt.push(Segment {
                    first: id,
                    block: 16,
                    len: 16,
                });
            }
            prompt.last_mut().unwrap().len = 16 - (ids.len() as u64 * 16 - len);
            requests.push(TraceRequest {
                arrival_us: at,
                prompt,
                prompt_len: len,
                output_len: 1,
                output_id: c,
                session: None,
            });
            at += rng.range(1, 300) * 1_000_000;
        }
    }
    Trace {
        name: "random".into(),
        requests,
        conversations_disjoint: false,
    }
    .finish()
}

#[test]
fn keyed_lru_equals_the_shipped_lru_and_belady_bounds_every_policy() {
    let (mut lru_total, mut belady_total) = (0, 0);
    for seed in 0..4 {
        let t = random_trace(seed, 60);
        let b = build(&t).unwrap().expect("hash blocks");
        let lens: Vec<u64> = t.requests.iter().map(|r| r.prompt_len).collect();
        let ideal: u64 = b.ideal_hit.iter().map(|&h| u64::from(h)).sum();
        for cap in [1, 3, 10, 40, 100, b.unique()] {
            let lru = simulate(&b, &lens, cap, Victims::Lru);
            let shipped = simulate(&b, &lens, cap, Victims::Shipped(PolicyKind::Lru));
            assert_eq!(lru, shipped, "seed {seed} cap {cap}");
            let belady = simulate(&b, &lens, cap, Victims::Belady);
            assert!(belady.hit_blocks <= ideal);
            lru_total += lru.hit_blocks;
            belady_total += belady.hit_blocks;
            for v in [
                Victims::OracleLru,
                Victims::PredictedLru { permille: 700 },
                Victims::Shipped(PolicyKind::Reuse),
                Victims::Shipped(PolicyKind::Sieve),
            ] {
                let o = simulate(&b, &lens, cap, v);
                assert!(
                    o.hit_blocks <= belady.hit_blocks,
                    "{v:?} beats Belady: seed {seed} cap {cap}"
                );
            }
            // A predictor that is always right is the oracle.
            assert_eq!(
                simulate(&b, &lens, cap, Victims::PredictedLru { permille: 1000 }),
                simulate(&b, &lens, cap, Victims::OracleLru)
            );
            if cap == b.unique() {
                assert_eq!(belady.hit_blocks, ideal);
                assert_eq!(lru.hit_blocks, ideal);
                assert_eq!(lru.evictions, 0);
            } else {
                assert!(lru.evictions > 0, "cap {cap} of {} evicts", b.unique());
            }
        }
    }
    // The small capacities are tight enough for the future to matter.
    assert!(lru_total < belady_total, "{lru_total} vs {belady_total}");
}
