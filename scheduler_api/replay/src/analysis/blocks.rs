//! One pass over the trace that names every block by its prefix chain and records, per block
//! access, what every later figure needs: who created the block, whether it existed before,
//! and when the same block is accessed next.

use ahash::{HashMap, HashMapExt};

use crate::trace::{TAG_OUTPUT, Trace};
use radixkv_scheduler_api::error::{ManagerError, Result};

/// "No node" / "no request": the root's parent, a block never accessed again.
pub(super) const NONE: u32 = u32::MAX;

/// The trace as chains of interned block nodes.
#[derive(Debug, Default)]
pub(super) struct Blocks {
    /// Tokens per block.
    pub block_tokens: u32,
    /// Request `i`'s chain is `nodes[offsets[i]..offsets[i + 1]]`, root side first.
    pub offsets: Vec<usize>,
    /// Every request's chain, concatenated.
    pub nodes: Vec<u32>,
    /// Per access (parallel to `nodes`): index of the next request that accesses the same
    /// node, or [`NONE`].
    pub next_access: Vec<u32>,
    /// Per node: the node one block shorter, or [`NONE`] for a first block.
    pub parent: Vec<u32>,
    /// Per node: the request that created it.
    pub creator: Vec<u32>,
    /// Per node: requests that accessed it.
    pub accesses: Vec<u32>,
    /// Per request: leading blocks that existed before it (the infinite-cache hit).
    pub ideal_hit: Vec<u32>,
    /// Gaps between consecutive accesses of the same block, in seconds.
    pub reuse_gaps_s: Vec<f64>,
}

impl Blocks {
    /// The chain of request `i`.
    pub fn chain(&self, i: usize) -> &[u32] {
        &self.nodes[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Next accesses parallel to [`Self::chain`].
    pub fn next_of(&self, i: usize) -> &[u32] {
        &self.next_access[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Distinct blocks.
    pub fn unique(&self) -> usize {
        self.parent.len()
    }
}

/// Whether a segment carries a trace's hash-block ids: untagged ids. Tagged ones are
/// unhashed per-request tokens, outputs, or the synthetic generator's variable-length
/// messages, none of which are fixed-size blocks.
fn hashed(first: u64) -> bool {
    first < TAG_OUTPUT
}

/// Builds the block chains; `None` when no request carries prefix information.
///
/// # Errors
/// [`ManagerError::Config`] when the trace mixes block sizes or has more blocks than the
/// analysis can index (2³² − 1).
pub(super) fn build(trace: &Trace) -> Result<Option<Blocks>> {
    let mut block_tokens = None;
    for s in trace.requests.iter().flat_map(|r| &r.prompt) {
        if !hashed(s.first) {
            continue;
        }
        match block_tokens {
            None => block_tokens = Some(s.block),
            Some(b) if b != s.block => {
                return Err(ManagerError::Config(format!(
                    "the trace mixes blocks of {b} and {} tokens; the analysis needs one block size",
                    s.block
                )));
            }
            Some(_) => {}
        }
    }
    let Some(block_tokens) = block_tokens else {
        return Ok(None);
    };
    let too_many = || ManagerError::Config("the trace has more than 2^32 - 1 blocks".into());
    let n = trace.requests.len();
    if n >= NONE as usize {
        return Err(too_many());
    }
    let mut b = Blocks {
        block_tokens,
        offsets: Vec::with_capacity(n + 1),
        ideal_hit: Vec::with_capacity(n),
        ..Default::default()
    };
    b.offsets.push(0);
    let mut index: HashMap<(u32, u64), u32> = HashMap::with_capacity(n * 8);
    let mut last_seen_us: Vec<u64> = Vec::new();
    for (i, r) in trace.requests.iter().enumerate() {
        let i = i as u32;
        let mut parent = NONE;
        let mut hit = 0u32;
        let mut fresh = false;
        for s in r.prompt.iter().filter(|s| hashed(s.first)) {
            let count = s.len.div_ceil(u64::from(s.block.max(1)));
            for k in 0..count {
                let id = s.first.wrapping_add(k);
                let next = b.parent.len() as u32;
                let node = *index.entry((parent, id)).or_insert(next);
                if node == next {
                    if next == NONE {
                        return Err(too_many());
                    }
                    b.parent.push(parent);
                    b.creator.push(i);
                    b.accesses.push(0);
                    last_seen_us.push(r.arrival_us);
                    fresh = true;
                } else {
                    // A chain is a path: once a block is new, so is everything after it.
                    if !fresh {
                        hit += 1;
                    }
                    let gap = r.arrival_us.saturating_sub(last_seen_us[node as usize]);
                    b.reuse_gaps_s.push(gap as f64 / 1e6);
                    last_seen_us[node as usize] = r.arrival_us;
                }
                b.accesses[node as usize] += 1;
                b.nodes.push(node);
                parent = node;
            }
        }
        b.ideal_hit.push(hit);
        b.offsets.push(b.nodes.len());
    }
    // Next accesses, by one backward pass.
    b.next_access = vec![NONE; b.nodes.len()];
    let mut next_use = vec![NONE; b.parent.len()];
    for i in (0..n).rev() {
        for at in b.offsets[i]..b.offsets[i + 1] {
            let node = b.nodes[at] as usize;
            b.next_access[at] = next_use[node];
            next_use[node] = i as u32;
        }
    }
    Ok(Some(b))
}

/// Conversation structure inferred from the chains.
#[derive(Debug)]
pub(super) struct Conversations {
    /// Per request: 1 for a first turn, the parent's turn + 1 otherwise.
    pub turn: Vec<u32>,
    /// Per request: arrival of its first child, if it has one.
    pub first_child_us: Vec<Option<u64>>,
}

/// A request's parent is the earlier request that created the deepest block it hit, when it
/// hit at least two blocks (one shared system-prompt block alone says nothing).
pub(super) fn conversations(trace: &Trace, b: &Blocks) -> Conversations {
    let n = trace.requests.len();
    let mut turn = vec![1u32; n];
    let mut first_child_us = vec![None; n];
    for i in 0..n {
        let hit = b.ideal_hit[i] as usize;
        if hit < 2 {
            continue;
        }
        let p = b.creator[b.chain(i)[hit - 1] as usize] as usize;
        turn[i] = turn[p].saturating_add(1);
        // Requests are sorted by arrival: the first child seen is the earliest.
        first_child_us[p].get_or_insert(trace.requests[i].arrival_us);
    }
    Conversations {
        turn,
        first_child_us,
    }
}
