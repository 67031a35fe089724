//! Admission and eviction of Mamba state checkpoints, selectable per cache
//! ([`RadixConfig::mamba_policy`](crate::RadixConfig::mamba_policy)).
//!
//! A Mamba state is a point checkpoint (the recurrent state after one position), so a cache of
//! them has to decide *where* a request leaves one behind (admission) and *which* one to drop
//! when the slot pool is full (eviction). Two policies:
//!
//! - [`MambaPolicy::Sglang`], the baseline: the caching points of SGLang's `MambaRadixCache`
//!   under `--mamba-scheduler-strategy extra_buffer` (the "V2" path, which pages larger than
//!   one token require), as SGLang's `main` has it in 2026 (`mem_cache/mamba_radix_cache.py`
//!   and `_mamba_radix_cache_v2_req_prepare_for_extend` in `managers/schedule_batch.py`, with
//!   `mamba_branching_seqlen`), mapped onto this crate's request lifecycle:
//!   - every running request holds a slot for its running state and, where one can be spared,
//!     a *tracking* slot ([`MambaTrack`], SGLang's ping-pong track buffer) into which the
//!     engine copies the state at the last page boundary it passed;
//!   - after each prefill chunk (`cache_unfinished_req`, which SGLang also calls after the
//!     last one, before decode) the tracking slot, holding the state at the chunk's end
//!     floored to a page, is handed to the tree as the state of the inserted key's end
//!     ([`CheckpointKind::PromptEnd`]; the last chunk's is the prompt's end) and the request
//!     takes a fresh tracking slot (SGLang donates the track slot and allocates a new one);
//!   - where the request's KV match went past the deepest cached state, the *branching point*
//!     (SGLang's `mamba_branching_seqlen`: the KV match length) is checkpointed
//!     ([`CheckpointKind::Branch`], through [`RequestKv::mamba_checkpoints`]); the chunk that
//!     stores it hands over no chunk-end state (SGLang tracks one state per extend, and the
//!     branching point replaces the extend's end);
//!   - at request end the state at the computed length floored to a page (the running state
//!     where the computed length ends a page, else the tracked one, unless that is still the
//!     last chunk's end, already handed over) becomes the state of the inserted key
//!     ([`CheckpointKind::RequestEnd`]);
//!   - states are evicted least recently used.
//!
//!   Where this differs from SGLang it favours the baseline: SGLang tracks at multiples of
//!   its `mamba_cache_chunk_size` (the larger of the kernel's chunk, 64, and the page) from
//!   the cached prefix and skips extends shorter than that, and during decode it tracks only
//!   every `mamba_track_interval` (256) tokens, so its request-end state lies up to 255
//!   tokens before the end; here every position is floored to a page (16 tokens in the
//!   replay). SGLang's default `no_buffer` strategy ("V1", page size 1 only) copies the live
//!   state at every chunk end and stores it at the finish, at `len(tokens)`: the same
//!   positions without the branching point.
//! - [`MambaPolicy::Marconi`], the default, after Marconi (MLSys 2025), extended with the
//!   baseline's caching points. Admission: checkpoints where reuse is likely —
//!   - [`CheckpointKind::Branch`]: where the request's key leaves a cached path at a branch
//!     point (the match ends inside an edge, or at a node whose path continues elsewhere) and
//!     no state is there yet. Other requests share the path up to there, so the next one that
//!     diverges from it hits the state. Found when the request begins, from the tree alone (no
//!     insert needed: the match already splits the edge). With
//!     [`MarconiParams::match_end`] (default off) also the baseline's branching point, the
//!     KV match length where it passed the deepest cached state (the end of a cached prompt
//!     whose state is gone or never existed, which a request extending it is no branch of).
//!   - [`CheckpointKind::PromptEnd`]: with [`MarconiParams::chunk_end`] (default on) the end of
//!     every prefill chunk, handed over from the tracking slot as the baseline does (the one
//!     kind of state the traces reward: a later turn's prompt extends an earlier prompt);
//!     optionally ([`MarconiParams::prompt_end`], off) the end of the prompt through a
//!     checkpoint slot of its own.
//!   - [`CheckpointKind::RequestEnd`] (optional): the end of input + output floored to a
//!     page, for the next turn (from the running or the tracking slot, like the baseline's;
//!     without chunk-end states hit-driven admission judges it when the request begins, so
//!     that a refused one holds no tracking slot; with them, at the finish).
//!
//!   The engine receives the branch and prompt-end checkpoints as
//!   [`RequestKv::mamba_checkpoints`]: a slot per position into which the forward pass copies
//!   its running state when it passes there; the cache stores them in the tree when the KV up
//!   to the position is inserted (a chunk or the finish) and frees them when the request ends
//!   before (abort, or a finish short of the position). Eviction: the unlocked state of lowest
//!   utility `recency + alpha · efficiency / max efficiency`, where recency is normalised to
//!   `[0, 1]` over the candidates and `efficiency = (F(L) − F(A)) / (slot_bytes +
//!   kv_bytes_per_token · (L − A))`: the prefill FLOPs ([`FlopCurve`]) the state saves beyond
//!   its nearest ancestor with a state (depth `A`, 0 when none), per byte the state pins (its
//!   slot and the KV that only it makes usable).
//!
//! Beyond Marconi:
//! - *Hit-driven admission* ([`MarconiParams::min_hit_ratio`]): once 64 states of a kind were
//!   stored, a kind whose states were hit fewer than `min_hit_ratio` times per stored state is
//!   admitted only one time in 16 (the samples keep measuring it); by default
//!   ([`MarconiParams::judge_when_full`]) only while no slot is free, since a state admitted
//!   into a free slot evicts nothing.
//! - *Batched eviction*: when a request needs a slot and none is free, the
//!   `max(1, slots / 64)` lowest-utility states are evicted in one scan of the candidates.
//! - *Mamba-aware KV eviction* ([`MarconiParams::dead_end_kv_first`], on by default): under
//!   KV pressure, device leaves that carry no state (KV past the last state on its path,
//!   which no match can use) are evicted before leaves that end at a live state, each group
//!   in the KV eviction policy's order ([`RadixTree::evict`](crate::RadixTree::evict)). The
//!   policy keeps the two groups as [`LeafClass`](crate::LeafClass)es and a leaf changes
//!   class when its state appears or goes, so a victim costs what it costs without the
//!   preference (`O(1)` or `O(log n)`) and the policy's own record of a leaf (SIEVE's
//!   visited bit and queue place) is kept.
//!
//! The engine's side of a handed-over tracking slot: [`RequestKv::mamba_track`] names a new
//! slot after a `cache_unfinished_req` that handed the old one to the tree; the engine reads
//! it again after every chunk (the old slot is the tree's from then on).
//!
//! Tracking slots ([`RadixConfig::mamba_track`], on by default) serve both policies: a request
//! takes one at `begin_request` only while another slot stays obtainable (else it runs without,
//! counted in [`MambaStats::tracks_skipped`], and leaves a request-end state only where its
//! computed length ends a page). A running request holds at most
//! [`RequestKv::MAX_MAMBA_SLOTS`] slots (see [`RequestKv::mamba_slot`]).
//!
//! [`RadixConfig::mamba_track`]: crate::RadixConfig::mamba_track
//! [`RequestKv::MAX_MAMBA_SLOTS`]: crate::RequestKv::MAX_MAMBA_SLOTS
//! [`RequestKv::mamba_slot`]: crate::RequestKv::mamba_slot
//!
//! [`RequestKv::mamba_checkpoints`]: crate::RequestKv::mamba_checkpoints
//!
//! ## Measured
//! The replay of real traces through the manager decides the defaults; its table is in the
//! README ("Hybrid models: the Mamba component"). On Mooncake and the weka agentic trace
//! at the default pools both policies reach nearly the KV match (the KV pool, not the state
//! policy, bounds the hit there), and the default is at or above the baseline on every run;
//! with a 16× smaller Mamba pool it is 1.00–1.11× the baseline. At equal *total* bytes, each
//! policy splitting them by its own rule (the scheduler API's `split` module), the default's
//! larger KV pool lifts Mooncake to 1.17× and weka to 1.02× the baseline (the README's table). What each change brought
//! there (each switched off alone from a setting with the KV-match-end checkpoint on and a
//! 0.5 hit threshold): chunk-end states are what the traces reward (without them Marconi
//! stays at 0.043 of the baseline's 0.051 on Mooncake and 0.838 of 0.903 on weka),
//! hit-driven admission judging every slot refused states the free slots had room for (0.875
//! on weka), and the KV-match-end checkpoint changed nothing measurable (chunk ends already
//! cover the cached prompt ends it targets) while it holds a slot per request, so it is off;
//! a 0.25 threshold beat 0.5 with the small pool on weka (0.897 against 0.891).
//!
//! `cargo run --release -p radixkv-radix --example mamba_policy` (the traffic of
//! `radix/tests/common/mamba_traffic.rs`, which drives whole prefills without chunk inserts,
//! so the baseline's states here are its request ends and branching points only; page 16,
//! segment lengths drawn to the token, so a request ends on a page boundary one time in 16;
//! 4 requests running at a time, the same slot count for every column, KV pool 8192 / 16384
//! pages). *Chat*: 400 conversations, 48 open at a time, 2–8 turns over 8 system prompts of
//! 256–1024 tokens, user messages and outputs of 32–256 tokens. *Agentic*: 100 tasks, 24
//! open, 4–16 steps over 2 tool prefixes of 3–4K tokens, task descriptions of 128–512, tool
//! calls of 16–64 and results of 32–384 tokens. Usable token hit ratio (hit tokens ending at
//! a state per prompt token; the ideal is the KV-only match with an unbounded pool), median of
//! three seeds (the runs are deterministic per seed), in brackets the median and range of the
//! ratio to the baseline with tracking slots (the "sglang" column); "no tracking" runs with
//! [`RadixConfig::mamba_track`] off:
//!
//! | workload | slots | ideal | sglang | sglang, no tracking | marconi (default) | marconi, no tracking | no hit-driven admission | + prompt end | alpha 0 |
//! | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
//! | chat | 16 | 0.899 | 0.141 | 0.257 (1.82×, 1.78–1.96) | 0.257 (1.80×, 1.79–1.96) | 0.456 (3.24×, 3.23–3.44) | 0.257 (1.80×, 1.79–1.96) | 0.226 (1.57×, 1.55–1.73) | 0.238 (1.72×, 1.68–1.81) |
//! | chat | 32 | 0.899 | 0.372 | 0.486 (1.32×, 1.31–1.34) | 0.546 (1.47×, 1.46–1.47) | 0.493 (1.34×, 1.33–1.35) | 0.546 (1.47×, 1.46–1.47) | 0.526 (1.41×, 1.41–1.43) | 0.491 (1.32×, 1.32–1.33) |
//! | chat | 64 | 0.899 | 0.642 | 0.643 (1.00×, 1.00–1.00) | 0.740 (1.15×, 1.15–1.15) | 0.501 (0.78×, 0.77–0.78) | 0.740 (1.15×, 1.15–1.15) | 0.726 (1.12×, 1.11–1.13) | 0.703 (1.09×, 1.08–1.10) |
//! | chat | 128 | 0.899 | 0.824 | 0.732 (0.89×, 0.88–0.89) | 0.832 (1.01×, 1.00–1.01) | 0.502 (0.61×, 0.61–0.61) | 0.832 (1.01×, 1.00–1.01) | 0.800 (0.97×, 0.96–0.99) | 0.837 (1.02×, 1.01–1.02) |
//! | agentic | 16 | 0.952 | 0.510 | 0.708 (1.37×, 1.27–1.43) | 0.772 (1.51×, 1.40–1.53) | 0.748 (1.45×, 1.31–1.52) | 0.772 (1.51×, 1.40–1.53) | 0.718 (1.41×, 1.29–1.43) | 0.697 (1.36×, 1.25–1.41) |
//! | agentic | 32 | 0.952 | 0.804 | 0.818 (1.02×, 1.02–1.06) | 0.878 (1.09×, 1.07–1.14) | 0.753 (0.94×, 0.91–0.98) | 0.878 (1.09×, 1.07–1.14) | 0.856 (1.06×, 1.06–1.12) | 0.840 (1.04×, 1.04–1.08) |
//! | agentic | 64 | 0.952 | 0.910 | 0.886 (0.97×, 0.97–0.98) | 0.925 (1.02×, 1.01–1.02) | 0.753 (0.82×, 0.82–0.83) | 0.925 (1.02×, 1.01–1.02) | 0.918 (1.01×, 1.00–1.01) | 0.919 (1.01×, 1.00–1.01) |
//! | agentic | 128 | 0.952 | 0.949 | 0.906 (0.96×, 0.95–0.96) | 0.942 (0.99×, 0.99–0.99) | 0.753 (0.79×, 0.79–0.79) | 0.942 (0.99×, 0.99–0.99) | 0.938 (0.99×, 0.99–0.99) | 0.949 (1.00×, 1.00–1.00) |
//!
//! The default is 1.02–1.80× the baseline here except on agentic at 128 slots (0.99×, where
//! every request-end state fits and the baseline's pure recency order keeps slightly more of
//! them than the FLOP-weighted one). Tracking slots cost most at 16 slots: each of the 4
//! running requests holds one, and Marconi without them reaches 0.456 on chat (3.24× the
//! tracked baseline) against the default's 0.257; with larger pools tracking pays (chat 64:
//! 0.740 against 0.502). Hit-driven admission never judges here (a slot is free whenever a
//! checkpoint is planned: the spare-slot rule), so that column equals the default. These are
//! synthetic shapes; the replay of the real traces decides the defaults.

use crate::cache::RequestKv;
use crate::error::{CacheError, Result};
use crate::tree::RadixTree;
use crate::tree::mamba::MambaInsert;
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
    /// Keep the state at the end of every prefill chunk (the prompt's end, floored to a page,
    /// for the last one) from the tracking slot, as [`CheckpointKind::PromptEnd`] — the
    /// baseline's chunk states, under hit-driven admission. Needs tracking slots.
    pub chunk_end: bool,
    /// Also checkpoint where the KV match went past the deepest cached state (the KV match
    /// length, as [`CheckpointKind::Branch`]; the baseline's branching point): the end of a
    /// cached prompt whose state is gone, or that never had one.
    pub match_end: bool,
    /// Hit-driven admission judges a checkpoint only while no slot is free (one admitted
    /// into a free slot evicts no other state).
    pub judge_when_full: bool,
    /// Mamba-aware KV eviction: under KV pressure, evict *dead-end* KV first — device leaves
    /// that carry no Mamba state, whose tokens no match can use (a match is usable only up
    /// to the deepest state) — in the KV eviction policy's order, and only then leaves that
    /// end at a live state. See [`crate::RadixTree::dead_end_leaves`].
    pub dead_end_kv_first: bool,
}

impl Default for MarconiParams {
    /// `alpha` 1.5, the default [`FlopCurve`], a Jamba-like state slot (about 16 MiB: 28 Mamba
    /// layers of 8192 channels × 16 states, f32, plus the conv state) and 4 attention layers
    /// of 8 KV heads × 128, bf16 (16 KiB per token); request-end and chunk-end states on,
    /// KV-match-end and prompt-end checkpoints off, hit-driven admission at 0.25 judging only
    /// a full pool (the best of the settings measured by the replay; see the module docs).
    fn default() -> Self {
        MarconiParams {
            alpha: 1.5,
            flops: FlopCurve::default(),
            slot_bytes: 16 << 20,
            kv_bytes_per_token: 16 << 10,
            prompt_end: false,
            output_end: true,
            min_hit_ratio: 0.25,
            chunk_end: true,
            match_end: false,
            judge_when_full: true,
            dead_end_kv_first: true,
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
    /// The SGLang-style baseline: SGLang's caching points (every prefill chunk's end, its
    /// branching point, the request end; see the module docs), LRU eviction.
    Sglang,
    /// Marconi-style admission (branch points, chunk, prompt and request ends, judged by
    /// their hits) and FLOP-per-byte aware eviction.
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
    /// The end of a prefill chunk (the last one's is the prompt's end), floored to a page.
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

/// A running request's *tracking* slot (hybrid models; [`RadixConfig::mamba_track`]): a copy
/// of the request's running state at the last page boundary its forward pass has reached, so
/// that a request whose computed length does not end a page can still leave a request-end
/// state behind, at that length floored to a page.
///
/// The engine's contract: after every forward step of the request (a prefill chunk or a
/// decode step), the tracking slot holds the running state after token `b − 1`, where `b` is
/// the last page boundary at or below the request's computed length (a boundary passed inside
/// a chunk: the state there, which kernels that write intermediate states produce in the same
/// pass; no boundary passed yet: the state at the cached prefix, i.e. the copy-on-write
/// source or the initial state). The cache keeps [`MambaTrack::pos`] at that boundary (it
/// updates it from the computed length at every `cache_unfinished_req` and at the finish) and,
/// at a finish whose computed length does not end a page, stores the slot as the
/// [`CheckpointKind::RequestEnd`] state at `pos` and frees the running slot; at a finish that
/// ends a page it stores the running slot and frees this one; an abort frees both. Where the
/// policy keeps chunk-end states, `cache_unfinished_req` hands the slot to the tree as the
/// state at the chunk's end and gives the request a fresh one at the same `pos` (the engine
/// fills it from its next forward step on; a finish before one frees it unread).
///
/// [`RadixConfig::mamba_track`]: crate::RadixConfig::mamba_track
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MambaTrack {
    /// The state slot the engine keeps the tracked state in.
    pub slot: u32,
    /// The page boundary whose state the slot holds: page-aligned, at most the computed
    /// length, at least the cached prefix at `begin_request`.
    pub pos: usize,
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
    /// Requests that ran without a tracking slot ([`MambaTrack`]) because none could be had
    /// without taking the last obtainable slot: they leave a request-end state only where
    /// their computed length ends a page.
    pub tracks_skipped: u64,
    /// [`CheckpointKind::RequestEnd`] states stored from a tracking slot (the request ended
    /// off a page boundary); also counted in that kind's `stored`.
    pub tracked_stored: u64,
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

/// Checkpoints one request holds at most (see [`RequestKv::mamba_slot`]).
const MAX_CHECKPOINTS: usize = 2;

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
    /// Give running requests a tracking slot ([`MambaTrack`]) where the policy keeps
    /// request-end states.
    track: bool,
    /// Per kind: how many checkpoints hit-driven admission judged (see [`admit`]).
    samples: [u64; 3],
}

impl MambaAdmission {
    pub(crate) fn new(policy: MambaPolicy, track: bool) -> Result<Self> {
        policy.validate()?;
        Ok(MambaAdmission {
            policy,
            track,
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
        if params.judge_when_full && tree.mamba_accounting().is_ok_and(|a| a.free > 0) {
            return true;
        }
        let ok = admit(params, stats.kind(kind), &mut self.samples[kind.index()]);
        if !ok {
            tree.mamba_count_skip(kind);
        }
        ok
    }

    /// Whether the policy keeps request-end states (the baseline always; Marconi with
    /// [`MarconiParams::output_end`]).
    fn keeps_request_end(&self) -> bool {
        match self.policy {
            MambaPolicy::Sglang => true,
            MambaPolicy::Marconi(p) => p.output_end,
        }
    }

    /// Whether the policy keeps chunk-end states (the baseline always; Marconi with
    /// [`MarconiParams::chunk_end`]).
    fn keeps_chunk_ends(&self) -> bool {
        match self.policy {
            MambaPolicy::Sglang => true,
            MambaPolicy::Marconi(p) => p.chunk_end,
        }
    }

    /// A slot for an optional use (a checkpoint or a tracking slot): only while at least one
    /// more stays obtainable (free or evictable) for a request that needs its running slot.
    fn spare_slot(tree: &mut RadixTree) -> Option<u32> {
        let obtainable = tree.mamba_accounting().map_or(0, |a| a.free + a.evictable);
        if obtainable >= 2 {
            tree.alloc_mamba_slot().ok()
        } else {
            None
        }
    }

    /// After `begin_request`: the checkpoints the forward pass of `req` takes (Marconi only),
    /// each with a slot of its own, then its tracking slot (where the policy keeps request-end
    /// states and tracking is on). A checkpoint or tracking slot that cannot have a slot
    /// without taking the last one a new request could get is skipped (counted), never an
    /// error.
    pub(crate) fn plan(&mut self, tree: &mut RadixTree, req: &mut RequestKv) {
        self.plan_checkpoints(tree, req);
        // Hit-driven admission judges the request-end state here, before a slot is held for
        // it (unless chunk-end states need the slot anyway: then the finish judges it); a
        // tracked request's state is stored at its finish without being judged again.
        let wanted = if self.keeps_chunk_ends() {
            true
        } else {
            self.keeps_request_end() && self.admit(tree, CheckpointKind::RequestEnd)
        };
        if self.track && wanted {
            match Self::spare_slot(tree) {
                Some(slot) => {
                    req.mamba_track = Some(MambaTrack {
                        slot,
                        pos: req.cache_protected_len,
                    });
                }
                None => {
                    if let Some(st) = tree.mamba_stats_mut() {
                        st.tracks_skipped += 1;
                    }
                }
            }
        }
    }

    fn plan_checkpoints(&mut self, tree: &mut RadixTree, req: &mut RequestKv) {
        let Some(params) = self.policy.marconi().copied() else {
            // The baseline's branching point (SGLang's `mamba_branching_seqlen`): where the
            // KV match went past the deepest cached state, the state there is tracked by the
            // chunk that reaches it.
            let pos = align_down(req.kv_match_len, tree.page_size());
            if pos > req.prefix_len && pos > req.cache_protected_len {
                match Self::spare_slot(tree) {
                    Some(slot) => req.mamba_checkpoints.push(MambaCheckpoint {
                        pos,
                        slot,
                        kind: CheckpointKind::Branch,
                    }),
                    None => tree.mamba_count_skip(CheckpointKind::Branch),
                }
            }
            return;
        };
        let p = tree.page_size();
        let from = req.cache_protected_len;
        let branch = tree.mamba_branch_point(req.key_ref());
        let prompt_end = if params.prompt_end {
            align_down(req.key.len(), p)
        } else {
            0
        };
        let match_end = if params.match_end && req.kv_match_len > req.prefix_len {
            align_down(req.kv_match_len, p)
        } else {
            0
        };
        let mut want = [
            (branch, CheckpointKind::Branch),
            (match_end, CheckpointKind::Branch),
            (prompt_end, CheckpointKind::PromptEnd),
        ];
        want.sort_by_key(|w| w.0);
        let mut last = from;
        for (pos, kind) in want {
            if pos <= last {
                continue;
            }
            if req.mamba_checkpoints.len() >= MAX_CHECKPOINTS {
                tree.mamba_count_skip(kind);
                continue;
            }
            if !self.admit(tree, kind) {
                continue;
            }
            match Self::spare_slot(tree) {
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
                .mamba_node_at(req.key.as_ref().with_hashes(&req.page_hashes), c.pos)
                .and_then(|node| tree.insert_mamba_state_as(node, c.slot, c.kind));
            if let Err(e) = stored {
                let freed = tree.free_mamba_slot(c.slot);
                result = result.and(Err::<(), _>(e)).and(freed);
            }
        }
        result
    }

    /// After a prefill chunk whose KV was inserted up to `aligned` tokens (ending at `node`)
    /// and whose due checkpoints were stored (`checkpoint_taken`: at least one was): under
    /// the baseline, the request's tracking slot, which holds the state at `aligned` (the
    /// [`MambaTrack`] contract), becomes the [`CheckpointKind::PromptEnd`] state of `node`
    /// (SGLang's `cache_unfinished_req`), unless the chunk already stored a checkpoint (SGLang
    /// tracks one state per extend: a branching point inside the extend replaces its end), and
    /// the request gets a fresh tracking slot, positioned at `aligned`, that the engine fills
    /// from its next forward step on (none when no slot can be spared: the request then runs
    /// untracked, counted in [`MambaStats::tracks_skipped`]). Marconi keeps the slot.
    ///
    /// # Errors
    /// The state insert's error (the request keeps its tracking slot then).
    pub(crate) fn after_chunk(
        &mut self,
        tree: &mut RadixTree,
        req: &mut RequestKv,
        node: NodeId,
        aligned: usize,
        checkpoint_taken: bool,
    ) -> Result<()> {
        let one_per_extend = matches!(self.policy, MambaPolicy::Sglang);
        if !self.keeps_chunk_ends() || (one_per_extend && checkpoint_taken) {
            return Ok(());
        }
        let Some(t) = req.mamba_track else {
            return Ok(());
        };
        if !self.admit(tree, CheckpointKind::PromptEnd) {
            return Ok(());
        }
        // Stored, or freed as a duplicate: either way the request no longer holds the slot.
        tree.insert_mamba_state_as(node, t.slot, CheckpointKind::PromptEnd)?;
        req.mamba_track = match Self::spare_slot(tree) {
            Some(slot) => Some(MambaTrack { slot, pos: aligned }),
            None => {
                if let Some(st) = tree.mamba_stats_mut() {
                    st.tracks_skipped += 1;
                }
                None
            }
        };
        Ok(())
    }

    /// Whether the finish must free the tracking slot instead of storing it: under the
    /// baseline when the computed length floored to a page (`aligned`, not the computed length
    /// itself) is still the last chunk's end (`protected`). The state there was handed over at
    /// that chunk (or the chunk stored a checkpoint instead, and SGLang tracks no second state
    /// for it), and a tracking slot replaced at that chunk may not have been written yet.
    pub(crate) fn drops_track_at_finish(&self, aligned: usize, protected: usize) -> bool {
        self.keeps_chunk_ends() && aligned <= protected
    }

    /// Frees the slots of every checkpoint the request still holds (it ended before them).
    pub(crate) fn free_checkpoints(tree: &mut RadixTree, req: &mut RequestKv) -> Result<()> {
        let mut result = Ok(());
        for c in req.mamba_checkpoints.drain(..) {
            result = result.and(tree.free_mamba_slot(c.slot));
        }
        result
    }

    /// At request end: the request's running slot `running` and its tracking slot `track`.
    /// Where the computed length ends a page (`at_page`) the running state is the state at
    /// the end of `end` (the node ending the inserted key, `None` when nothing was inserted)
    /// and the tracking slot is freed; otherwise the tracked state is (its position is the
    /// computed length floored to a page, where `end` ends) and the running slot is freed.
    /// That state becomes the [`CheckpointKind::RequestEnd`] state of `end` where the policy
    /// keeps it (hit-driven admission judged a tracked request at its begin, an untracked one
    /// here); otherwise it is freed too. Every slot is released, errors or not.
    pub(crate) fn finish_state(
        &mut self,
        tree: &mut RadixTree,
        running: u32,
        track: Option<u32>,
        end: Option<NodeId>,
        at_page: bool,
    ) -> Result<()> {
        let (state, spare) = if at_page {
            (Some(running), track)
        } else {
            (track, Some(running))
        };
        let mut result = match spare {
            Some(s) => tree.free_mamba_slot(s),
            None => Ok(()),
        };
        let Some(slot) = state else {
            return result;
        };
        let keep = self.keeps_request_end();
        let stored = match end {
            Some(node)
                if keep
                    && ((track.is_some() && !self.keeps_chunk_ends())
                        || self.admit(tree, CheckpointKind::RequestEnd)) =>
            {
                match tree.insert_mamba_state_as(node, slot, CheckpointKind::RequestEnd) {
                    Ok(MambaInsert::Stored) => {
                        if !at_page && let Some(st) = tree.mamba_stats_mut() {
                            st.tracked_stored += 1;
                        }
                        Ok(())
                    }
                    Ok(MambaInsert::AlreadyCached | MambaInsert::WindowTombstone) => Ok(()),
                    // Nothing changed: the request still holds the slot.
                    Err(e) => tree.free_mamba_slot(slot).and(Err(e)),
                }
            }
            _ => tree.free_mamba_slot(slot),
        };
        result = result.and(stored);
        result
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
