//! Admission and eviction of Mamba state checkpoints, selectable per cache
//! ([`RadixConfig::mamba_policy`](crate::RadixConfig::mamba_policy)).
//!
//! A Mamba state is a point checkpoint (the recurrent state after one position), so a cache of
//! them has to decide *where* a request leaves one behind (admission) and *which* one to drop
//! when the slot pool is full (eviction). Two policies:
//!
//! - [`MambaPolicy::Sglang`], the baseline (the rule of SGLang's Mamba radix cache): every
//!   running request holds one slot for its running state; at request end that state becomes
//!   the checkpoint of the inserted key where the computed length ends a page (a node boundary;
//!   a tracking slot that keeps the state at the last page boundary during decode is not
//!   modelled, so an unaligned end leaves no state); states are evicted least recently used.
//! - [`MambaPolicy::Marconi`], the default, after Marconi (MLSys 2025). Admission: checkpoints
//!   only where reuse is likely —
//!   - [`CheckpointKind::Branch`]: where the request's key leaves a cached path at a branch
//!     point (the match ends inside an edge, or at a node whose path continues elsewhere) and
//!     no state is there yet. Other requests share the path up to there, so the next one that
//!     diverges from it hits the state. Found when the request begins, from the tree alone (no
//!     insert needed: the match already splits the edge).
//!   - [`CheckpointKind::PromptEnd`] (optional): the end of the prompt, floored to a page.
//!   - [`CheckpointKind::RequestEnd`] (optional): the end of input + output, for the next
//!     turn (stored, like the baseline's, only where the computed length ends a page).
//!
//!   The engine receives the first two as [`RequestKv::mamba_checkpoints`]: a slot per
//!   position into which the forward pass copies its running state when it passes there; the
//!   cache stores them in the tree when the KV up to the position is inserted (a chunk or the
//!   finish) and frees them when the request ends before (abort, or a finish short of the
//!   position). Eviction: the unlocked state of lowest utility
//!   `recency + alpha · efficiency / max efficiency`, where recency is normalised to `[0, 1]`
//!   over the candidates and `efficiency = (F(L) − F(A)) / (slot_bytes + kv_bytes_per_token ·
//!   (L − A))`: the prefill FLOPs ([`FlopCurve`]) the state saves beyond its nearest ancestor
//!   with a state (depth `A`, 0 when none), per byte the state pins (its slot and the KV that
//!   only it makes usable).
//!
//! Beyond Marconi:
//! - *Hit-driven admission* ([`MarconiParams::min_hit_ratio`]): once 64 states of a kind were
//!   stored, a kind whose states were hit fewer than `min_hit_ratio` times per stored state is
//!   admitted only one time in 16 (the samples keep measuring it).
//! - *Batched eviction*: when a request needs a slot and none is free, the
//!   `max(1, slots / 64)` lowest-utility states are evicted in one scan of the candidates.
//!
//! [`RequestKv::mamba_checkpoints`]: crate::RequestKv::mamba_checkpoints
//!
//! ## Measured
//! Filled in by the synthetic comparison (see the `mamba_policy` example).

use crate::cache::RequestKv;
use crate::error::{CacheError, Result};
use crate::tree::RadixTree;
use crate::types::{NodeId, align_down};

/// Prefill FLOPs of a prefix as a function of its length `L`:
/// `per_token · L + per_token_sq · L²` (linear layers and the state update are linear in `L`;
/// attention over the prefix is quadratic).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlopCurve {
    /// FLOPs per token (MLP, projections, Mamba layers).
    pub per_token: f64,
    /// FLOPs per token pair (the attention layers' score and value products).
    pub per_token_sq: f64,
}

impl FlopCurve {
    /// The prefill FLOPs of a prefix of `len` tokens.
    #[inline]
    pub fn flops(&self, len: usize) -> f64 {
        let l = len as f64;
        self.per_token * l + self.per_token_sq * l * l
    }
}

impl Default for FlopCurve {
    /// A Jamba-like shape: 2 FLOPs per parameter per token for about 12B active parameters,
    /// and 4 attention layers of width 4096 (`4 · layers · width` per token pair).
    fn default() -> Self {
        FlopCurve {
            per_token: 2.4e10,
            per_token_sq: 4.0 * 4.0 * 4096.0,
        }
    }
}

/// Parameters of [`MambaPolicy::Marconi`] (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MarconiParams {
    /// Weight of the FLOP efficiency against recency in the eviction utility (≥ 0; 0 is
    /// plain LRU order).
    pub alpha: f64,
    /// Prefill FLOPs by prefix length.
    pub flops: FlopCurve,
    /// Bytes of one state slot (all Mamba layers).
    pub slot_bytes: u64,
    /// KV bytes per token (all attention layers).
    pub kv_bytes_per_token: u64,
    /// Checkpoint the state at the end of the prompt (floored to a page).
    pub prompt_end: bool,
    /// Keep the state at the end of input + output (where it ends a page) for the next turn.
    pub output_end: bool,
    /// Hit-driven admission: after 64 stored states of a kind, a kind with fewer hits per
    /// stored state than this is admitted one time in 16. 0 turns it off. In `[0, 1]`.
    pub min_hit_ratio: f64,
}

impl Default for MarconiParams {
    /// `alpha` 1.5, the default [`FlopCurve`], a Jamba-like state slot (about 16 MiB: 28 Mamba
    /// layers of 8192 channels × 16 states, f32, plus the conv state) and 4 attention layers
    /// of 8 KV heads × 128, bf16 (16 KiB per token); both end checkpoints on; hit-driven
    /// admission at 0.05.
    fn default() -> Self {
        MarconiParams {
            alpha: 1.5,
            flops: FlopCurve::default(),
            slot_bytes: 16 << 20,
            kv_bytes_per_token: 16 << 10,
            prompt_end: true,
            output_end: true,
            min_hit_ratio: 0.05,
        }
    }
}

impl MarconiParams {
    /// Checks every parameter.
    ///
    /// # Errors
    /// [`CacheError::PolicyParam`] for a negative, NaN or infinite `alpha` or FLOP
    /// coefficient, a FLOP curve that is zero everywhere, a zero `slot_bytes`, or a
    /// `min_hit_ratio` outside `[0, 1]`.
    pub fn validate(&self) -> Result<()> {
        let finite_non_negative = |param: &'static str, v: f64| {
            if v.is_nan() {
                Err(CacheError::PolicyParam {
                    param,
                    reason: "is NaN",
                })
            } else if v.is_infinite() {
                Err(CacheError::PolicyParam {
                    param,
                    reason: "is infinite",
                })
            } else if v < 0.0 {
                Err(CacheError::PolicyParam {
                    param,
                    reason: "is negative",
                })
            } else {
                Ok(())
            }
        };
        finite_non_negative("alpha", self.alpha)?;
        finite_non_negative("flops.per_token", self.flops.per_token)?;
        finite_non_negative("flops.per_token_sq", self.flops.per_token_sq)?;
        finite_non_negative("min_hit_ratio", self.min_hit_ratio)?;
        if self.flops.per_token == 0.0 && self.flops.per_token_sq == 0.0 {
            return Err(CacheError::PolicyParam {
                param: "flops",
                reason: "is zero for every length",
            });
        }
        if self.slot_bytes == 0 {
            return Err(CacheError::PolicyParam {
                param: "slot_bytes",
                reason: "is zero",
            });
        }
        if self.min_hit_ratio > 1.0 {
            return Err(CacheError::PolicyParam {
                param: "min_hit_ratio",
                reason: "is above 1",
            });
        }
        Ok(())
    }

    /// The FLOPs a state at depth `len` saves beyond an ancestor state at depth `ancestor`,
    /// per byte it pins (the module docs' efficiency; `ancestor < len`).
    #[inline]
    pub fn efficiency(&self, len: usize, ancestor: usize) -> f64 {
        let saved = self.flops.flops(len) - self.flops.flops(ancestor);
        let tokens = len.saturating_sub(ancestor) as f64;
        saved / (self.slot_bytes as f64 + self.kv_bytes_per_token as f64 * tokens)
    }
}

/// How a cache with the Mamba component admits and evicts states (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MambaPolicy {
    /// The SGLang-style baseline: a checkpoint at every request end, LRU eviction.
    Sglang,
    /// Marconi-style admission (branch points, prompt and request ends) and FLOP-per-byte
    /// aware eviction.
    Marconi(MarconiParams),
}

impl Default for MambaPolicy {
    /// [`MambaPolicy::Marconi`] with [`MarconiParams::default`].
    fn default() -> Self {
        MambaPolicy::Marconi(MarconiParams::default())
    }
}

impl MambaPolicy {
    /// Checks the parameters ([`MarconiParams::validate`]; the baseline has none).
    ///
    /// # Errors
    /// [`CacheError::PolicyParam`].
    pub fn validate(&self) -> Result<()> {
        match self {
            MambaPolicy::Sglang => Ok(()),
            MambaPolicy::Marconi(p) => p.validate(),
        }
    }

    /// The Marconi parameters (`None` for the baseline).
    pub fn marconi(&self) -> Option<&MarconiParams> {
        match self {
            MambaPolicy::Sglang => None,
            MambaPolicy::Marconi(p) => Some(p),
        }
    }

    /// A short name for reports (`"sglang"`, `"marconi"`).
    pub fn name(&self) -> &'static str {
        match self {
            MambaPolicy::Sglang => "sglang",
            MambaPolicy::Marconi(_) => "marconi",
        }
    }
}

/// Why a state was checkpointed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CheckpointKind {
    /// Where the request's key leaves a cached path at a branch point.
    Branch = 0,
    /// The end of the prompt (floored to a page).
    PromptEnd = 1,
    /// The end of input + output (the request's running state at its finish).
    RequestEnd = 2,
}

impl CheckpointKind {
    /// Every kind, in index order.
    pub const ALL: [CheckpointKind; 3] = [
        CheckpointKind::Branch,
        CheckpointKind::PromptEnd,
        CheckpointKind::RequestEnd,
    ];

    /// The kind's index in [`MambaStats::kinds`].
    #[inline]
    pub fn index(self) -> usize {
        self as usize
    }

    pub(crate) fn from_index(i: u8) -> CheckpointKind {
        match i {
            0 => CheckpointKind::Branch,
            1 => CheckpointKind::PromptEnd,
            _ => CheckpointKind::RequestEnd,
        }
    }

    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            CheckpointKind::Branch => "branch",
            CheckpointKind::PromptEnd => "prompt_end",
            CheckpointKind::RequestEnd => "request_end",
        }
    }
}

/// A position where the engine must copy the request's running Mamba state into `slot` during
/// the forward pass (after computing token `pos − 1`, before token `pos`). The slot is the
/// request's until the cache stores it in the tree (at the insert that covers `pos`) or frees
/// it (the request ended first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MambaCheckpoint {
    /// Tokens before the checkpoint (page-aligned, past the request's cached prefix).
    pub pos: usize,
    /// The state slot to copy into.
    pub slot: u32,
    /// Why it is taken.
    pub kind: CheckpointKind,
}

/// Counters of one [`CheckpointKind`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KindStats {
    /// States stored in the tree.
    pub stored: u64,
    /// Requests that began on a state of this kind (copy on write).
    pub hits: u64,
    /// Tokens those hits reused.
    pub hit_tokens: u64,
    /// States evicted (slot pressure, explicit, or with their KV).
    pub evicted: u64,
    /// Checkpoints not taken: refused by hit-driven admission, or no slot could be had.
    pub skipped: u64,
}

/// Mamba state counters per [`CheckpointKind`] (see [`crate::RadixCache::mamba_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MambaStats {
    /// Indexed by [`CheckpointKind::index`].
    pub kinds: [KindStats; 3],
}

impl MambaStats {
    /// The counters of `kind`.
    pub fn kind(&self, kind: CheckpointKind) -> &KindStats {
        &self.kinds[kind.index()]
    }

    pub(crate) fn kind_mut(&mut self, kind: CheckpointKind) -> &mut KindStats {
        &mut self.kinds[kind.index()]
    }

    /// Totals over every kind.
    pub fn total(&self) -> KindStats {
        self.kinds
            .iter()
            .fold(KindStats::default(), |a, k| KindStats {
                stored: a.stored + k.stored,
                hits: a.hits + k.hits,
                hit_tokens: a.hit_tokens + k.hit_tokens,
                evicted: a.evicted + k.evicted,
                skipped: a.skipped + k.skipped,
            })
    }
}

/// Stored states of a kind after which hit-driven admission judges it.
pub(crate) const ADMISSION_WARMUP: u64 = 64;
/// One admission in this many for a kind judged rarely hit.
pub(crate) const ADMISSION_SAMPLE: u64 = 16;
/// Slot-pressure eviction takes `max(1, slots / EVICTION_BATCH_DIV)` states per scan.
pub(crate) const EVICTION_BATCH_DIV: usize = 64;

/// Whether hit-driven admission admits one more checkpoint of a kind with these counters;
/// `sample` counts the kind's refusals-or-samples so far (advanced here when judged).
pub(crate) fn admit(params: &MarconiParams, k: &KindStats, sample: &mut u64) -> bool {
    if params.min_hit_ratio <= 0.0 || k.stored < ADMISSION_WARMUP {
        return true;
    }
    if k.hits as f64 >= params.min_hit_ratio * k.stored as f64 {
        return true;
    }
    *sample += 1;
    (*sample).is_multiple_of(ADMISSION_SAMPLE)
}

/// The per-cache side of a [`MambaPolicy`]: which checkpoints a request takes and what
/// happens to its slots at a chunk and at its end ([`crate::RadixCache`] calls it; eviction
/// order is the tree's, set by [`RadixTree::set_mamba_policy`]).
#[derive(Debug)]
pub(crate) struct MambaAdmission {
    policy: MambaPolicy,
    /// Per kind: how many checkpoints hit-driven admission judged (see [`admit`]).
    samples: [u64; 3],
}

impl MambaAdmission {
    pub(crate) fn new(policy: MambaPolicy) -> Result<Self> {
        policy.validate()?;
        Ok(MambaAdmission {
            policy,
            samples: [0; 3],
        })
    }

    pub(crate) fn policy(&self) -> &MambaPolicy {
        &self.policy
    }

    /// Whether a checkpoint of `kind` is admitted now (always under the baseline).
    fn admit(&mut self, tree: &mut RadixTree, kind: CheckpointKind) -> bool {
        let Some(params) = self.policy.marconi() else {
            return true;
        };
        let Ok(stats) = tree.mamba_stats() else {
            return false;
        };
        let ok = admit(params, stats.kind(kind), &mut self.samples[kind.index()]);
        if !ok {
            tree.mamba_count_skip(kind);
        }
        ok
    }

    /// After `begin_request`: the checkpoints the forward pass of `req` takes (Marconi only),
    /// each with a slot of its own. A checkpoint that cannot have a slot without taking the
    /// last one a new request could get is skipped (counted), never an error.
    pub(crate) fn plan(&mut self, tree: &mut RadixTree, req: &mut RequestKv) {
        let Some(params) = self.policy.marconi().copied() else {
            return;
        };
        let p = tree.page_size();
        let from = req.cache_protected_len;
        let branch = tree.mamba_branch_point(req.key.as_ref());
        let prompt_end = if params.prompt_end {
            align_down(req.key.len(), p)
        } else {
            0
        };
        let mut want = [
            (branch, CheckpointKind::Branch),
            (prompt_end, CheckpointKind::PromptEnd),
        ];
        want.sort_by_key(|w| w.0);
        let mut last = from;
        for (pos, kind) in want {
            if pos <= last {
                continue;
            }
            if !self.admit(tree, kind) {
                continue;
            }
            let obtainable = tree.mamba_accounting().map_or(0, |a| a.free + a.evictable);
            let slot = if obtainable >= 2 {
                tree.alloc_mamba_slot().ok()
            } else {
                None
            };
            match slot {
                Some(slot) => {
                    req.mamba_checkpoints
                        .push(MambaCheckpoint { pos, slot, kind });
                    last = pos;
                }
                None => tree.mamba_count_skip(kind),
            }
        }
    }

    /// Stores the request's checkpoints at positions up to `upto` (KV inserted and on device
    /// up to there) and removes them from the request. A checkpoint that cannot be stored has
    /// its slot freed; the first error is returned after every one was handled.
    pub(crate) fn store_checkpoints(
        &mut self,
        tree: &mut RadixTree,
        req: &mut RequestKv,
        upto: usize,
    ) -> Result<()> {
        let due = req.mamba_checkpoints.partition_point(|c| c.pos <= upto);
        let mut result = Ok(());
        for c in req.mamba_checkpoints.drain(..due) {
            let stored = tree
                .mamba_node_at(req.key.as_ref(), c.pos)
                .and_then(|node| tree.insert_mamba_state_as(node, c.slot, c.kind));
            if let Err(e) = stored {
                let freed = tree.free_mamba_slot(c.slot);
                result = result.and(Err::<(), _>(e)).and(freed);
            }
        }
        result
    }

    /// Frees the slots of every checkpoint the request still holds (it ended before them).
    pub(crate) fn free_checkpoints(tree: &mut RadixTree, req: &mut RequestKv) -> Result<()> {
        let mut result = Ok(());
        for c in req.mamba_checkpoints.drain(..) {
            result = result.and(tree.free_mamba_slot(c.slot));
        }
        result
    }

    /// At request end: the running state `slot` becomes the [`CheckpointKind::RequestEnd`]
    /// state of `end` (the node ending the inserted key, `None` when nothing was inserted)
    /// where the policy keeps it and the computed length ends a page (`aligned`); otherwise
    /// it is freed.
    pub(crate) fn finish_state(
        &mut self,
        tree: &mut RadixTree,
        slot: u32,
        end: Option<NodeId>,
        aligned: bool,
    ) -> Result<()> {
        let keep = match self.policy {
            MambaPolicy::Sglang => true,
            MambaPolicy::Marconi(p) => p.output_end,
        };
        match end {
            Some(node) if aligned && keep && self.admit(tree, CheckpointKind::RequestEnd) => {
                match tree.insert_mamba_state_as(node, slot, CheckpointKind::RequestEnd) {
                    Ok(_) => Ok(()),
                    // Nothing changed: the request still holds the slot.
                    Err(e) => tree.free_mamba_slot(slot).and(Err(e)),
                }
            }
            _ => tree.free_mamba_slot(slot),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn efficiency_counts_only_the_flops_beyond_the_ancestor() {
        let p = MarconiParams {
            flops: FlopCurve {
                per_token: 1.0,
                per_token_sq: 1.0,
            },
            slot_bytes: 10,
            kv_bytes_per_token: 1,
            ..MarconiParams::default()
        };
        // F(8) = 72, F(0) = 0: 72 / (10 + 8).
        assert_eq!(p.efficiency(8, 0), 4.0);
        // F(8) − F(4) = 72 − 20 = 52 over 10 + 4 bytes.
        assert!((p.efficiency(8, 4) - 52.0 / 14.0).abs() < 1e-12);
    }

    #[test]
    fn hit_driven_admission_samples_a_rarely_hit_kind() {
        let p = MarconiParams::default();
        let mut sample = 0;
        let young = KindStats {
            stored: ADMISSION_WARMUP - 1,
            ..KindStats::default()
        };
        assert!(admit(&p, &young, &mut sample), "not judged before warm-up");
        let cold = KindStats {
            stored: 100,
            hits: 1,
            ..KindStats::default()
        };
        let admitted = (0..32).filter(|_| admit(&p, &cold, &mut sample)).count();
        assert_eq!(admitted, 2, "one in 16");
        let hot = KindStats {
            stored: 100,
            hits: 50,
            ..KindStats::default()
        };
        assert!(admit(&p, &hot, &mut sample));
        let off = MarconiParams {
            min_hit_ratio: 0.0,
            ..p
        };
        assert!(admit(&off, &cold, &mut sample));
    }
}
