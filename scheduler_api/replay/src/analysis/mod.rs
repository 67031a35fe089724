//! Offline trace analysis for capacity planning: how much could *any* eviction policy reuse on
//! this trace, and why the online ones fall short (`radixkv analyze`).
//!
//! The analysis works at the trace's own block granularity (512 tokens for Mooncake, 64 for
//! the agentic traces): a *block* is one hash id of a request's chain, identified by its whole
//! prefix chain, so equal ids under different prefixes are different blocks. Traces without
//! prefix information (Azure) get only the length and arrival figures.
//!
//! ## The figures
//! - **Requests, blocks**: total blocks = Σ chain lengths; unique blocks = distinct chains.
//! - **Infinite-cache ideal**: a cache that keeps every block ever seen hits, for each request,
//!   the leading blocks of its chain that existed before it. Block hit ratio = hit blocks /
//!   total blocks; token hit ratio = Σ min(hit blocks × block tokens, input length) / Σ input
//!   length, the definition [`crate::sim::IdealCache`] uses (on the Mooncake conversation
//!   trace both give 0.3736).
//! - **Never reused**: the fraction of blocks that no request after their creator touches.
//!   On chat traces this is what bounds every policy: a cache full of such blocks holds
//!   nothing useful, and a policy can only tell them apart from the others by guessing.
//! - **Reuse gap** (p10 / p50 / p90 / p99, seconds; nearest rank): time between consecutive
//!   accesses of the same block, over every reuse.
//! - **Conversations**: a request's *parent* is the earlier request that created the deepest
//!   block it hit, counted only when it hit at least two blocks (a shared system-prompt block
//!   alone links nothing). The turn of a request without parent is 1, otherwise its parent's
//!   turn + 1. *P(continue)* per turn is the fraction of that turn's requests that become a
//!   parent. The *hazard table* bins the time from a request's arrival to its first child's:
//!   per bin `[a, b)` seconds, *at risk* counts the requests with no child before `a` whose
//!   arrival is at least `b` before the trace's last arrival (so the whole bin is observed),
//!   and *P* is the fraction of them whose first child arrives within the bin. A flat P across
//!   turns and ages means that whether a conversation goes on cannot be read from its history.
//! - **Policies per capacity** (capacity in blocks = capacity tokens / block tokens, rounded
//!   down): a block-level replay of the trace through a prefix tree of cached blocks that
//!   evicts leaves only (see the `evict` module), one tick per request, reporting the token
//!   hit ratio (same definition as the ideal), the block hit ratio and the ratio to the ideal
//!   token hit ratio, for
//!   - `lru`: least recently used leaf first;
//!   - `belady`: the leaf whose next use is furthest first, never-used-again first (offline
//!     optimum: no policy beats it);
//!   - `oracle+lru`: leaves never used again first, then LRU — an LRU that is told, for free,
//!     the one bit "will this block ever be reused";
//!   - `predictedNN+lru`: as `oracle+lru` with the bit from a predictor that is right NN% of
//!     the time, wrong for whole requests at once (seeded) — how good a reuse predictor must
//!     be to close the gap. On chat traces the trivial predictor "never reused" is already
//!     right for about 70% of requests, so only accuracies well above that mean anything;
//!   - `reuse`: the shipped [`radixkv_radix::ReuseCreditPolicy`] itself, driven through its
//!     [`radixkv_radix::EvictionPolicy`] trait (`hit_count` counts the requests that hit the
//!     block while it was cached).
//!
//!   When `oracle+lru` is close to `belady` and far above `lru`, the gap is the reuse bit: a
//!   policy gains only as much as it can predict which blocks will be reused.
//!
//! ```
//! use radixkv_replay::analysis::analyze;
//! use radixkv_replay::trace::{Segment, Trace, TraceRequest};
//!
//! // Two requests over 4-token blocks; the second extends the first's blocks 0, 1 with 2.
//! let req = |at: u64, blocks: u64| TraceRequest {
//!     arrival_us: at,
//!     prompt: vec![Segment { first: 0, block: 4, len: 4 * blocks }],
//!     prompt_len: 4 * blocks,
//!     output_len: 1,
//!     output_id: 0,
//!     session: None,
//! };
//! let trace = Trace {
//!     name: "tiny".into(),
//!     requests: vec![req(0, 2), req(1_000_000, 3)],
//!     conversations_disjoint: false,
//! };
//! let a = analyze(&trace, &[8])?;
//! let p = a.prefix.expect("hash blocks");
//! assert_eq!((p.total_blocks, p.unique_blocks, p.ideal_hit_blocks), (5, 3, 2));
//! assert_eq!(p.ideal_token_hit_ratio, 8.0 / 20.0);
//! assert_eq!(p.turns[1].requests, 1); // the second request is a second turn
//! # Ok::<(), radixkv_scheduler_api::ManagerError>(())
//! ```

mod blocks;
mod evict;
mod report;

use radixkv_radix::PolicyKind;
use serde::Serialize;

use crate::trace::Trace;
use radixkv_scheduler_api::error::{ManagerError, Result};
use radixkv_scheduler_api::metrics::ratio;

use blocks::Conversations;
use evict::{Victims, simulate};

/// Capacities analysed when none is given: 1M tokens (a device pool) and 5M (1M device + 4M
/// host).
pub const DEFAULT_CAPACITIES: [u64; 2] = [1 << 20, 5 << 20];

/// Upper bounds (seconds) of the continuation hazard bins; the first starts at 0.
pub const HAZARD_BINS_S: [u64; 16] = [
    10, 20, 30, 45, 60, 90, 120, 180, 240, 300, 400, 500, 700, 1000, 1500, 2000,
];

/// Turns 1 to this − 1 get a row each; the last row holds this turn and later ones.
pub const TURN_ROWS: u32 = 10;

/// Everything `radixkv analyze` reports about one trace.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Analysis {
    /// Trace name.
    pub trace: String,
    /// Requests.
    pub requests: u64,
    /// Σ input (prompt) tokens.
    pub input_tokens: u64,
    /// Σ output tokens.
    pub output_tokens: u64,
    /// Input length per request (tokens).
    pub input_len: Quantiles,
    /// Output length per request (tokens).
    pub output_len: Quantiles,
    /// Last arrival minus first (seconds).
    pub duration_s: f64,
    /// Requests per second over the duration (0 when it is 0).
    pub arrival_rate: f64,
    /// The block figures; `None` when the trace carries no prefix information.
    pub prefix: Option<PrefixAnalysis>,
}

/// Quantiles (nearest rank) and mean of a sample; all 0 for an empty one.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct Quantiles {
    /// Values.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// 10th percentile.
    pub p10: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Quantiles {
    /// Quantiles of `values` (sorted in place).
    pub fn of(values: &mut [f64]) -> Self {
        if values.is_empty() {
            return Quantiles::default();
        }
        values.sort_by(f64::total_cmp);
        let q = |p: f64| crate::sim::quantile(values, p);
        Quantiles {
            count: values.len() as u64,
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p10: q(0.10),
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
        }
    }
}

/// The figures that need hash blocks.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PrefixAnalysis {
    /// Tokens per block.
    pub block_tokens: u32,
    /// Σ blocks over every request's chain.
    pub total_blocks: u64,
    /// Distinct blocks (distinct prefix chains).
    pub unique_blocks: u64,
    /// Blocks an infinite cache hits.
    pub ideal_hit_blocks: u64,
    /// Tokens an infinite cache hits.
    pub ideal_hit_tokens: u64,
    /// `ideal_hit_blocks / total_blocks`.
    pub ideal_block_hit_ratio: f64,
    /// `ideal_hit_tokens / input_tokens`.
    pub ideal_token_hit_ratio: f64,
    /// Fraction of the unique blocks that no later request touches.
    pub never_reused_fraction: f64,
    /// Seconds between consecutive accesses of a block.
    pub reuse_gap_s: Quantiles,
    /// P(continue) per turn.
    pub turns: Vec<TurnRow>,
    /// The continuation hazard per age bin.
    pub hazard: Vec<HazardRow>,
    /// Simulated policies per capacity.
    pub capacities: Vec<CapacityResult>,
}

/// One turn's row.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TurnRow {
    /// `"1"` … `"9"`, `"10+"`.
    pub turn: String,
    /// Requests at this turn.
    pub requests: u64,
    /// Of those, requests that became a parent.
    pub continued: u64,
    /// `continued / requests`.
    pub p_continue: f64,
}

/// One age bin of the hazard table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HazardRow {
    /// Bin start (seconds since the request's arrival).
    pub from_s: u64,
    /// Bin end (exclusive).
    pub to_s: u64,
    /// Requests observed over the whole bin with no child before it.
    pub at_risk: u64,
    /// Of those, requests whose first child arrived within the bin.
    pub continued: u64,
    /// `continued / at_risk`.
    pub p_continue: f64,
}

/// The policies at one capacity.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CapacityResult {
    /// Capacity in tokens, as asked.
    pub capacity_tokens: u64,
    /// Capacity in blocks (tokens / block tokens).
    pub capacity_blocks: u64,
    /// One row per policy.
    pub policies: Vec<PolicyResult>,
}

/// One policy at one capacity.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyResult {
    /// `lru`, `belady`, `oracle+lru` or `reuse`.
    pub policy: String,
    /// Blocks hit.
    pub hit_blocks: u64,
    /// Tokens hit.
    pub hit_tokens: u64,
    /// `hit_blocks / total_blocks`.
    pub block_hit_ratio: f64,
    /// `hit_tokens / input_tokens`.
    pub token_hit_ratio: f64,
    /// `token_hit_ratio / ideal_token_hit_ratio` (1 when the ideal is 0).
    pub of_ideal: f64,
    /// Blocks evicted.
    pub evictions: u64,
}

/// The simulated policies, in report order.
const POLICIES: [(&str, Victims); 8] = [
    ("lru", Victims::Lru),
    ("belady", Victims::Belady),
    ("oracle+lru", Victims::OracleLru),
    ("predicted95+lru", Victims::PredictedLru { permille: 950 }),
    ("predicted90+lru", Victims::PredictedLru { permille: 900 }),
    ("predicted80+lru", Victims::PredictedLru { permille: 800 }),
    ("predicted70+lru", Victims::PredictedLru { permille: 700 }),
    ("reuse", Victims::Shipped(PolicyKind::Reuse)),
];

/// Analyses `trace`, simulating the policies at each of `capacities_tokens`.
///
/// # Errors
/// [`ManagerError::Config`] for a capacity of 0 tokens or of less than one block, and for a
/// trace whose hashed segments mix block sizes or that has more than 2³² − 1 blocks.
pub fn analyze(trace: &Trace, capacities_tokens: &[u64]) -> Result<Analysis> {
    if let Some(&c) = capacities_tokens.iter().find(|&&c| c == 0) {
        return Err(ManagerError::Config(format!(
            "capacity {c} tokens: a capacity must be positive"
        )));
    }
    let reqs = &trace.requests;
    let input_tokens: u64 = reqs.iter().map(|r| r.prompt_len).sum();
    let output_tokens: u64 = reqs.iter().map(|r| u64::from(r.output_len)).sum();
    let first = reqs.first().map_or(0, |r| r.arrival_us);
    let last = reqs.iter().map(|r| r.arrival_us).max().unwrap_or(0);
    let duration_s = last.saturating_sub(first) as f64 / 1e6;
    let mut inputs: Vec<f64> = reqs.iter().map(|r| r.prompt_len as f64).collect();
    let mut outputs: Vec<f64> = reqs.iter().map(|r| f64::from(r.output_len)).collect();
    let prefix = match blocks::build(trace)? {
        Some(b) => Some(prefix_analysis(trace, &b, input_tokens, capacities_tokens)?),
        None => None,
    };
    Ok(Analysis {
        trace: trace.name.clone(),
        requests: reqs.len() as u64,
        input_tokens,
        output_tokens,
        input_len: Quantiles::of(&mut inputs),
        output_len: Quantiles::of(&mut outputs),
        duration_s,
        arrival_rate: if duration_s > 0.0 {
            reqs.len() as f64 / duration_s
        } else {
            0.0
        },
        prefix,
    })
}

fn prefix_analysis(
    trace: &Trace,
    b: &blocks::Blocks,
    input_tokens: u64,
    capacities_tokens: &[u64],
) -> Result<PrefixAnalysis> {
    let block = u64::from(b.block_tokens);
    for &c in capacities_tokens {
        if c < block {
            return Err(ManagerError::Config(format!(
                "capacity {c} tokens is less than one block of {block} tokens"
            )));
        }
    }
    let prompt_lens: Vec<u64> = trace.requests.iter().map(|r| r.prompt_len).collect();
    let ideal_hit_blocks: u64 = b.ideal_hit.iter().map(|&h| u64::from(h)).sum();
    let ideal_hit_tokens: u64 = b
        .ideal_hit
        .iter()
        .zip(&prompt_lens)
        .map(|(&h, &len)| (u64::from(h) * block).min(len))
        .sum();
    let total_blocks = b.nodes.len() as u64;
    let ideal_token_hit_ratio = ratio(ideal_hit_tokens, input_tokens);
    let never = b.accesses.iter().filter(|&&a| a == 1).count() as u64;
    let mut gaps = b.reuse_gaps_s.clone();
    let conv = blocks::conversations(trace, b);
    let mut capacities = Vec::with_capacity(capacities_tokens.len());
    for &c in capacities_tokens {
        let blocks_cap = c / block;
        // Beyond the unique block count every policy behaves like the infinite cache.
        let cap = usize::try_from(blocks_cap).unwrap_or(usize::MAX);
        let policies = POLICIES
            .iter()
            .map(|&(name, victims)| {
                let o = simulate(b, &prompt_lens, cap, victims);
                let token_hit_ratio = ratio(o.hit_tokens, input_tokens);
                PolicyResult {
                    policy: name.to_string(),
                    hit_blocks: o.hit_blocks,
                    hit_tokens: o.hit_tokens,
                    block_hit_ratio: ratio(o.hit_blocks, total_blocks),
                    token_hit_ratio,
                    of_ideal: if ideal_hit_tokens == 0 {
                        1.0
                    } else {
                        ratio(o.hit_tokens, ideal_hit_tokens)
                    },
                    evictions: o.evictions,
                }
            })
            .collect();
        capacities.push(CapacityResult {
            capacity_tokens: c,
            capacity_blocks: blocks_cap,
            policies,
        });
    }
    Ok(PrefixAnalysis {
        block_tokens: b.block_tokens,
        total_blocks,
        unique_blocks: b.unique() as u64,
        ideal_hit_blocks,
        ideal_hit_tokens,
        ideal_block_hit_ratio: ratio(ideal_hit_blocks, total_blocks),
        ideal_token_hit_ratio,
        never_reused_fraction: ratio(never, b.unique() as u64),
        reuse_gap_s: Quantiles::of(&mut gaps),
        turns: turn_rows(&conv),
        hazard: hazard_rows(trace, &conv),
        capacities,
    })
}

fn turn_rows(conv: &Conversations) -> Vec<TurnRow> {
    let rows = TURN_ROWS as usize;
    let mut requests = vec![0u64; rows];
    let mut continued = vec![0u64; rows];
    for (&t, child) in conv.turn.iter().zip(&conv.first_child_us) {
        let row = (t.clamp(1, TURN_ROWS) - 1) as usize;
        requests[row] += 1;
        continued[row] += u64::from(child.is_some());
    }
    (0..rows)
        .map(|r| TurnRow {
            turn: if r + 1 == rows {
                format!("{}+", r + 1)
            } else {
                (r + 1).to_string()
            },
            requests: requests[r],
            continued: continued[r],
            p_continue: ratio(continued[r], requests[r]),
        })
        .collect()
}

fn hazard_rows(trace: &Trace, conv: &Conversations) -> Vec<HazardRow> {
    let end = trace
        .requests
        .iter()
        .map(|r| r.arrival_us)
        .max()
        .unwrap_or(0);
    let mut from = 0u64;
    let mut rows = Vec::with_capacity(HAZARD_BINS_S.len());
    for &to in &HAZARD_BINS_S {
        let (a, b) = (from * 1_000_000, to * 1_000_000);
        let mut at_risk = 0u64;
        let mut continued = 0u64;
        for (r, child) in trace.requests.iter().zip(&conv.first_child_us) {
            if r.arrival_us.saturating_add(b) > end {
                continue;
            }
            let gap = child.map(|c| c.saturating_sub(r.arrival_us));
            if gap.is_some_and(|g| g < a) {
                continue;
            }
            at_risk += 1;
            continued += u64::from(gap.is_some_and(|g| g < b));
        }
        rows.push(HazardRow {
            from_s: from,
            to_s: to,
            at_risk,
            continued,
            p_continue: ratio(continued, at_risk),
        });
        from = to;
    }
    rows
}

#[cfg(test)]
mod tests;
