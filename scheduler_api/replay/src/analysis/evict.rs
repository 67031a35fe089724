//! Block-level eviction simulation over a prefix tree of blocks.
//!
//! The cache holds at most `capacity` blocks; a block is only ever cached with its whole
//! prefix, so the cached blocks form a tree and only leaves (no cached child) are evicted, as
//! in the radix cache. One tick per request. A request first counts its hit (the leading
//! cached blocks), then touches every hit block and inserts its missing ones, evicting before
//! each insert. The block being extended is held out of the leaf set while its child goes in,
//! so a request never evicts its own path.

use std::collections::BTreeSet;

use radixkv_radix::{EvictionPolicy, LeafToken, NodeId, NodeMeta, PolicyKind};
use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng, SeedableRng};

use super::blocks::{Blocks, NONE};

/// Which leaf goes first.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Victims {
    /// Least recently used leaf.
    Lru,
    /// Belady: the leaf whose next use is furthest (never-used-again first).
    Belady,
    /// Leaves never used again first, then least recently used.
    OracleLru,
    /// As [`Victims::OracleLru`], but the reuse bit comes from a predictor that is right with
    /// probability `permille / 1000`. Its errors are per request (every block a request
    /// touches gets the same wrong answer), as a per-conversation predictor's would be, and
    /// seeded, so the figure is reproducible.
    PredictedLru {
        /// Accuracy in thousandths.
        permille: u16,
    },
    /// A policy shipped in `radixkv-radix`, driven through its `EvictionPolicy` trait.
    Shipped(PolicyKind),
}

/// What a policy achieved.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct SimOutcome {
    pub hit_blocks: u64,
    pub hit_tokens: u64,
    pub evictions: u64,
}

/// Per-node state the orderings read.
#[derive(Copy, Clone, Debug, Default)]
struct NodeState {
    last_access: u64,
    created: u64,
    hit_count: u32,
    /// Next request that accesses the node, [`NONE`] for never.
    next_use: u32,
    /// What the predictor of [`Victims::PredictedLru`] said at the last access.
    predicted_reuse: bool,
}

/// The evictable leaves in some order.
trait Leaves {
    fn insert(&mut self, node: u32, st: &NodeState);
    fn remove(&mut self, node: u32);
    fn touch(&mut self, node: u32, st: &NodeState);
    fn pop(&mut self) -> Option<u32>;
    fn holds(&self, node: u32) -> bool;
}

/// Leaves ordered by a key (smallest first, ties by node).
struct KeyedLeaves {
    key: fn(&NodeState) -> (u64, u64),
    set: BTreeSet<(u64, u64, u32)>,
    held: Vec<Option<(u64, u64)>>,
}

impl Leaves for KeyedLeaves {
    fn insert(&mut self, node: u32, st: &NodeState) {
        let k = (self.key)(st);
        self.set.insert((k.0, k.1, node));
        self.held[node as usize] = Some(k);
    }

    fn remove(&mut self, node: u32) {
        if let Some(k) = self.held[node as usize].take() {
            self.set.remove(&(k.0, k.1, node));
        }
    }

    fn touch(&mut self, node: u32, st: &NodeState) {
        self.remove(node);
        self.insert(node, st);
    }

    fn pop(&mut self) -> Option<u32> {
        let (_, _, node) = self.set.pop_first()?;
        self.held[node as usize] = None;
        Some(node)
    }

    fn holds(&self, node: u32) -> bool {
        self.held[node as usize].is_some()
    }
}

/// A shipped policy: measures the real code, not a re-implementation of it.
struct ShippedLeaves {
    policy: Box<dyn EvictionPolicy>,
    held: Vec<Option<LeafToken>>,
}

fn meta(st: &NodeState) -> NodeMeta {
    NodeMeta {
        last_access: st.last_access,
        created: st.created,
        hit_count: st.hit_count,
        priority: 0,
    }
}

impl Leaves for ShippedLeaves {
    fn insert(&mut self, node: u32, st: &NodeState) {
        let t = self.policy.insert(NodeId::detached(node), &meta(st));
        self.held[node as usize] = Some(t);
    }

    fn remove(&mut self, node: u32) {
        if let Some(t) = self.held[node as usize].take() {
            self.policy.remove(NodeId::detached(node), t);
        }
    }

    fn touch(&mut self, node: u32, st: &NodeState) {
        if let Some(t) = self.held[node as usize] {
            let t = self.policy.touch(NodeId::detached(node), t, &meta(st));
            self.held[node as usize] = Some(t);
        }
    }

    fn pop(&mut self) -> Option<u32> {
        let id = self.policy.pop()?;
        let node = id.index();
        self.held[node] = None;
        Some(node as u32)
    }

    fn holds(&self, node: u32) -> bool {
        self.held[node as usize].is_some()
    }
}

fn leaves(victims: Victims, nodes: usize) -> Box<dyn Leaves> {
    let keyed = |key: fn(&NodeState) -> (u64, u64)| {
        Box::new(KeyedLeaves {
            key,
            set: BTreeSet::new(),
            held: vec![None; nodes],
        }) as Box<dyn Leaves>
    };
    match victims {
        Victims::Lru => keyed(|s| (s.last_access, 0)),
        // Never used again maps to 0; a later next use to a smaller key.
        Victims::Belady => keyed(|s| (u64::from(NONE - s.next_use), s.last_access)),
        Victims::OracleLru => keyed(|s| (u64::from(s.next_use != NONE), s.last_access)),
        Victims::PredictedLru { .. } => keyed(|s| (u64::from(s.predicted_reuse), s.last_access)),
        Victims::Shipped(kind) => Box::new(ShippedLeaves {
            policy: kind.build(),
            held: vec![None; nodes],
        }),
    }
}

/// Replays `b` through a cache of `capacity` blocks (at least 1) evicting by `victims`.
/// `prompt_lens[i]` caps request `i`'s token hit.
pub(super) fn simulate(
    b: &Blocks,
    prompt_lens: &[u64],
    capacity: usize,
    victims: Victims,
) -> SimOutcome {
    let n = b.unique();
    let mut set = leaves(victims, n);
    let mut st = vec![NodeState::default(); n];
    let mut cached = vec![false; n];
    let mut children = vec![0u32; n];
    let mut count = 0usize;
    let mut out = SimOutcome::default();
    let block = u64::from(b.block_tokens);
    let wrong_if_above = match victims {
        Victims::PredictedLru { permille } => u64::from(permille.min(1000)),
        _ => 1000,
    };
    for (i, &len) in prompt_lens.iter().enumerate() {
        let tick = i as u64 + 1;
        let chain = b.chain(i);
        let next = b.next_of(i);
        let wrong = splitmix64(i as u64) % 1000 >= wrong_if_above;
        let predict = |nx: u32| (nx != NONE) != wrong;
        let hit = chain.iter().take_while(|&&x| cached[x as usize]).count();
        out.hit_blocks += hit as u64;
        out.hit_tokens += (hit as u64 * block).min(len);
        for (&x, &nx) in chain[..hit].iter().zip(next) {
            let s = &mut st[x as usize];
            s.last_access = tick;
            s.hit_count = s.hit_count.saturating_add(1);
            s.next_use = nx;
            s.predicted_reuse = predict(nx);
            if set.holds(x) {
                set.touch(x, s);
            }
        }
        let mut parent = if hit == 0 { NONE } else { chain[hit - 1] };
        for (&x, &nx) in chain[hit..].iter().zip(&next[hit..]) {
            // Hold the block being extended out of the leaf set while room is made.
            if parent != NONE {
                set.remove(parent);
            }
            while count >= capacity {
                let Some(v) = set.pop() else { break };
                out.evictions += 1;
                cached[v as usize] = false;
                count -= 1;
                let p = b.parent[v as usize];
                if p != NONE {
                    children[p as usize] -= 1;
                    if children[p as usize] == 0 && p != parent {
                        set.insert(p, &st[p as usize]);
                    }
                }
            }
            if count >= capacity {
                // The request's own path fills the cache: its remaining blocks stay out.
                if parent != NONE && children[parent as usize] == 0 {
                    set.insert(parent, &st[parent as usize]);
                }
                break;
            }
            st[x as usize] = NodeState {
                last_access: tick,
                created: tick,
                hit_count: 0,
                next_use: nx,
                predicted_reuse: predict(nx),
            };
            cached[x as usize] = true;
            count += 1;
            if parent != NONE {
                children[parent as usize] += 1;
            }
            set.insert(x, &st[x as usize]);
            parent = x;
        }
    }
    out
}

/// A fixed pseudo-random function of `x`: the first draw of a SplitMix64 stream seeded by `x`.
fn splitmix64(x: u64) -> u64 {
    SplitMix64::seed_from_u64(x).next_u64()
}
