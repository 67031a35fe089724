//! The model geometry: what each layer of the model keeps per token or per request, the pools
//! that follow from it, built-in presets, and FLOPs per token.
//!
//! A model declares its layers as a pattern of letters repeated over `layers`:
//!
//! | letter | layer                   | keeps                                         | pool                     |
//! |--------|-------------------------|-----------------------------------------------|--------------------------|
//! | `A`    | full attention          | K and V of every token                        | full-attention KV pages  |
//! | `S`    | sliding-window attention| K and V of the last `sliding_window` tokens   | SWA KV pages             |
//! | `M`    | Mamba (SSM)             | one conv state + one SSM state per sequence   | Mamba state slots        |
//!
//! `layer_pattern = "MMMMAMMM"` with `layers = 32` is a Jamba-style 1:7 attention:Mamba model
//! (the pattern repeats 4 times), `layer_pattern = "SSSSSA"` with `layers = 48` a Gemma-3-style
//! 5:1 local:global one. Without a pattern every layer is full attention (a dense model).
//!
//! The pools follow from the layers ([`Pools`]): full-attention KV pages of
//! `kv_bytes_per_token_per_layer × A layers` bytes per token, SWA KV pages of
//! `kv_bytes_per_token_per_layer × S layers` bytes per token, and Mamba slots of
//! `(mamba_conv_state_bytes + mamba_ssm_state_bytes) × M layers` bytes (one slot holds the
//! states of every Mamba layer of one sequence). Each pool has its own budget
//! ([`PoolBudgets`](crate::config::PoolBudgets)).
//!
//! FLOPs ([`ComputeShape`]) count a multiply-add as 2 FLOPs:
//!
//! - a full-attention layer, for the token at position `ctx` (it attends to `ctx` tokens,
//!   itself included): `2·h·d·(2·q + 2·kv)` for the Q, K, V and O projections plus `4·q·d·ctx`
//!   for the scores (QKᵀ) and their weighted sum (·V), where `h` is the hidden size, `q` and
//!   `kv` the query and KV heads and `d` the head dim;
//! - a sliding-window layer: the same with `min(ctx, window)` instead of `ctx`;
//! - a Mamba (Mamba-1) layer, independent of `ctx`: `2·h·2·di` (in_proj) `+ 2·di·d_conv`
//!   (causal conv) `+ 2·di·(r + 2·n)` (x_proj) `+ 2·r·di` (dt_proj) `+ 6·di·n` (selective
//!   scan: decay, input and output multiply-adds per state element) `+ 2·di·h` (out_proj),
//!   where `di` is the inner width, `n` the state size and `r` the dt rank;
//! - the feed-forward blocks (MLP or the active MoE experts), a constant per token.
//!
//! Norms, activations, embeddings, the LM head and MoE routers are left out. Prefilling a
//! prefix of `L` tokens costs the sum over positions `1..=L` ([`ModelGeometry::prefill_flops`]):
//! what a cache hit of `L` tokens saves.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{ManagerError, Result};

/// What one layer of the model is.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Full attention (`A`): keeps the K and V of every token.
    Attention,
    /// Sliding-window attention (`S`): attends to the last `sliding_window` tokens only.
    SlidingWindow,
    /// A Mamba (SSM) layer (`M`): a fixed-size conv and SSM state per sequence.
    Mamba,
}

impl LayerKind {
    /// The letter of the kind in a [`LayerPattern`].
    pub fn letter(self) -> char {
        match self {
            LayerKind::Attention => 'A',
            LayerKind::SlidingWindow => 'S',
            LayerKind::Mamba => 'M',
        }
    }

    /// The kind a letter names (`A`, `S` or `M`).
    pub fn from_letter(c: char) -> Option<Self> {
        match c {
            'A' => Some(LayerKind::Attention),
            'S' => Some(LayerKind::SlidingWindow),
            'M' => Some(LayerKind::Mamba),
            _ => None,
        }
    }
}

/// The kinds of a run of layers, repeated over the model's layers; written as letters
/// (`"MMMMAMMM"`, see [`LayerKind`]). Never empty.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct LayerPattern(Vec<LayerKind>);

impl LayerPattern {
    /// A pattern of these kinds.
    ///
    /// # Errors
    /// [`ManagerError::Config`] for an empty pattern.
    pub fn new(kinds: Vec<LayerKind>) -> Result<Self> {
        if kinds.is_empty() {
            return Err(ManagerError::Config(
                "layer_pattern is empty: it needs at least one layer".into(),
            ));
        }
        Ok(LayerPattern(kinds))
    }

    /// Parses letters (`A`, `S`, `M`).
    ///
    /// # Errors
    /// [`ManagerError::Config`] naming an unknown letter and its position, or for an empty
    /// pattern.
    pub fn parse(s: &str) -> Result<Self> {
        let kinds = s
            .chars()
            .enumerate()
            .map(|(i, c)| {
                LayerKind::from_letter(c).ok_or_else(|| {
                    ManagerError::Config(format!(
                        "layer_pattern {s:?}: unknown layer kind {c:?} at position {i} \
                         (A: full attention, S: sliding window, M: Mamba)"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Self::new(kinds)
    }

    /// The kinds, in order.
    pub fn kinds(&self) -> &[LayerKind] {
        &self.0
    }

    /// Layers of the pattern (at least 1).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false: a pattern is never empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// How many layers of `kind` the first `layers` layers of the repeated pattern hold.
    fn count_in(&self, kind: LayerKind, layers: u32) -> u64 {
        let len = self.0.len() as u64;
        let per = self.0.iter().filter(|&&k| k == kind).count() as u64;
        let layers = u64::from(layers);
        let rest = (layers % len) as usize;
        let tail = self.0[..rest].iter().filter(|&&k| k == kind).count() as u64;
        (layers / len) * per + tail
    }
}

impl fmt::Display for LayerPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|k| write!(f, "{}", k.letter()))
    }
}

impl TryFrom<String> for LayerPattern {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        LayerPattern::parse(&s).map_err(|e| match e {
            ManagerError::Config(m) => m,
            e => e.to_string(),
        })
    }
}

impl From<LayerPattern> for String {
    fn from(p: LayerPattern) -> String {
        p.to_string()
    }
}

/// Layers of each kind.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerCounts {
    /// Full-attention layers.
    pub attention: u64,
    /// Sliding-window layers.
    pub sliding_window: u64,
    /// Mamba layers.
    pub mamba: u64,
}

/// A built-in model geometry (`preset = "jamba-like"` in `[model]`, `--model jamba-like` on
/// `radixkv`). Sizes from the models' published configurations (the `config.json` of
/// `ai21labs/Jamba-v0.1` and of Gemma-3-12B), in bf16 (2 bytes per value, states included).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// The default dense model: Llama-3-8B-like, 32 full-attention layers of 8 KV heads × 128
    /// dims (4096 KV bytes per token per layer).
    Dense,
    /// Jamba-v0.1-like 1:7 attention:Mamba: 32 layers, attention at every 8th layer from layer
    /// 4 (`"MMMMAMMM"` × 4: 4 attention, 28 Mamba); hidden 4096, 32 query / 8 KV heads × 128
    /// dims; Mamba-1 with expand 2 (inner width 8192), d_state 16, d_conv 4, dt rank 256.
    /// Per Mamba layer: conv state 8192 × (4 − 1) × 2 = 49152 bytes, SSM state 8192 × 16 × 2 =
    /// 262144 bytes.
    JambaLike,
    /// Gemma-3-12B-like 5:1 local:global: 48 layers (`"SSSSSA"` × 8: 40 sliding-window with a
    /// 1024-token window, 8 full attention); hidden 3840, 16 query / 8 KV heads × 256 dims
    /// (8192 KV bytes per token per layer).
    GemmaLike,
}

impl Preset {
    /// Every preset.
    pub const ALL: [Preset; 3] = [Preset::Dense, Preset::JambaLike, Preset::GemmaLike];

    /// The preset's name (`"dense"`, `"jamba-like"`, `"gemma-like"`).
    pub fn name(self) -> &'static str {
        match self {
            Preset::Dense => "dense",
            Preset::JambaLike => "jamba-like",
            Preset::GemmaLike => "gemma-like",
        }
    }

    /// The preset a name names.
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }

    /// The preset's geometry, with pages of 16 tokens.
    pub fn geometry(self) -> ModelGeometry {
        const BF16: u64 = 2;
        match self {
            Preset::Dense => ModelGeometry::default(),
            Preset::JambaLike => {
                let (hidden, inner, d_state, d_conv) = (4096, 8192, 16, 4);
                ModelGeometry {
                    layers: 32,
                    layer_pattern: Some(LayerPattern(pattern("MMMMAMMM"))),
                    // 8 KV heads × 128 dims × (K, V) × bf16.
                    kv_bytes_per_token_per_layer: 8 * 128 * 2 * BF16,
                    page_size: 16,
                    sliding_window: None,
                    // The conv state keeps the last d_conv − 1 inputs of every inner channel.
                    mamba_conv_state_bytes: Some(inner * (d_conv - 1) * BF16),
                    mamba_ssm_state_bytes: Some(inner * d_state * BF16),
                    compute: Some(ComputeShape {
                        hidden_size: hidden,
                        attention_heads: 32,
                        kv_heads: 8,
                        head_dim: 128,
                        // SwiGLU (3 matrices) of 4096 × 14336: 16 dense layers, 16 MoE layers
                        // with 2 of 16 experts active = 48 MLPs per token.
                        ffn_flops_per_token: 48 * 2 * 3 * hidden * 14336,
                        mamba: Some(MambaShape {
                            d_inner: inner,
                            d_state,
                            d_conv,
                            dt_rank: 256,
                        }),
                    }),
                }
            }
            Preset::GemmaLike => {
                let hidden = 3840;
                ModelGeometry {
                    layers: 48,
                    layer_pattern: Some(LayerPattern(pattern("SSSSSA"))),
                    // 8 KV heads × 256 dims × (K, V) × bf16.
                    kv_bytes_per_token_per_layer: 8 * 256 * 2 * BF16,
                    page_size: 16,
                    sliding_window: Some(1024),
                    mamba_conv_state_bytes: None,
                    mamba_ssm_state_bytes: None,
                    compute: Some(ComputeShape {
                        hidden_size: hidden,
                        attention_heads: 16,
                        kv_heads: 8,
                        head_dim: 256,
                        // GeGLU (3 matrices) of 3840 × 15360 in each of the 48 layers.
                        ffn_flops_per_token: 48 * 2 * 3 * hidden * 15360,
                        mamba: None,
                    }),
                }
            }
        }
    }
}

/// The kinds of a pattern known to be well formed (the presets').
fn pattern(s: &str) -> Vec<LayerKind> {
    s.chars().filter_map(LayerKind::from_letter).collect()
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The dimensions FLOPs are counted from (see the [module docs](self) for the formulas).
/// Optional in a geometry: without one, FLOPs are unknown.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeShape {
    /// Hidden size (model width).
    pub hidden_size: u64,
    /// Query heads of an attention layer.
    pub attention_heads: u64,
    /// KV heads of an attention layer.
    pub kv_heads: u64,
    /// Dimension of one head.
    pub head_dim: u64,
    /// FLOPs of all feed-forward blocks (MLP, active MoE experts) for one token, whole model.
    #[serde(default)]
    pub ffn_flops_per_token: u64,
    /// The Mamba layers' dimensions: present exactly when the model has Mamba layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mamba: Option<MambaShape>,
}

/// The dimensions of a Mamba-1 layer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MambaShape {
    /// Inner width (expand × hidden size).
    pub d_inner: u64,
    /// SSM state size per inner channel.
    pub d_state: u64,
    /// Causal conv kernel width.
    pub d_conv: u64,
    /// Rank of the Δ (dt) projection.
    pub dt_rank: u64,
}

impl ComputeShape {
    /// FLOPs of one attention layer for the token at position `ctx` (attending to `ctx` tokens,
    /// itself included): projections plus `4·q·d·ctx`. Saturates at `u128::MAX`.
    pub fn attention_flops_per_token(&self, ctx: u64) -> u128 {
        self.attention_projection_flops()
            .saturating_add(self.attention_score_flops().saturating_mul(u128::from(ctx)))
    }

    /// FLOPs of one Mamba layer per token (independent of the position); `None` without
    /// [`ComputeShape::mamba`]. Saturates at `u128::MAX`.
    pub fn mamba_flops_per_token(&self) -> Option<u128> {
        let m = self.mamba.as_ref()?;
        let (h, di, n, k, r) = (
            u128::from(self.hidden_size),
            u128::from(m.d_inner),
            u128::from(m.d_state),
            u128::from(m.d_conv),
            u128::from(m.dt_rank),
        );
        let terms = [
            2 * h * 2 * di,       // in_proj: x and the gate z
            2 * di * k,           // causal conv
            2 * di * (r + 2 * n), // x_proj: dt, B, C
            2 * r * di,           // dt_proj
            6 * di * n,           // selective scan
            2 * di * h,           // out_proj
        ];
        Some(terms.iter().fold(0u128, |a, &t| a.saturating_add(t)))
    }

    /// Q, K, V and O projections of one attention layer for one token.
    fn attention_projection_flops(&self) -> u128 {
        let (h, d) = (u128::from(self.hidden_size), u128::from(self.head_dim));
        let heads = 2 * u128::from(self.attention_heads) + 2 * u128::from(self.kv_heads);
        (2 * h * d).saturating_mul(heads)
    }

    /// QKᵀ and ·V of one attention layer per attended token.
    fn attention_score_flops(&self) -> u128 {
        4 * u128::from(self.attention_heads) * u128::from(self.head_dim)
    }

    fn validate(&self, has_mamba: bool) -> Result<()> {
        let bad = |m: String| Err(ManagerError::Config(m));
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("attention_heads", self.attention_heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return bad(format!("compute.{name} must be positive"));
            }
        }
        match (&self.mamba, has_mamba) {
            (None, true) => bad(
                "the model has Mamba layers (M) but compute has no mamba dimensions: its \
                 FLOPs would be unknown"
                    .into(),
            ),
            (Some(_), false) => bad(
                "compute.mamba is set but the model has no Mamba layer (M) in layer_pattern".into(),
            ),
            (Some(m), true) => {
                for (name, v) in [
                    ("d_inner", m.d_inner),
                    ("d_state", m.d_state),
                    ("d_conv", m.d_conv),
                    ("dt_rank", m.dt_rank),
                ] {
                    if v == 0 {
                        return bad(format!("compute.mamba.{name} must be positive"));
                    }
                }
                Ok(())
            }
            (None, false) => Ok(()),
        }
    }
}

/// Model geometry: the kind of every layer and what each kind keeps, and how KV is paged.
///
/// These are the *modeled* bytes: the cost model's transfer times and every byte count in the
/// metrics and the replay report derive from them (pages × [`ModelGeometry::page_bytes`]). The
/// HostSim backend allocates and copies a much smaller
/// [`SimGeometry`](crate::config::SimGeometry) instead.
///
/// In TOML (`[model]`) every key is optional; `preset = "jamba-like"` (or `"gemma-like"`,
/// `"dense"`) starts from a [`Preset`] and the keys given override it. Serialized, a geometry
/// writes every key and no preset.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ModelSpec", into = "ModelSpec")]
pub struct ModelGeometry {
    /// Layers of every kind (the unit of layer-pipelined loads).
    pub layers: u32,
    /// The kinds of the layers, repeated over `layers` (a whole number of times); `None`:
    /// every layer is full attention.
    pub layer_pattern: Option<LayerPattern>,
    /// KV bytes per token of one attention layer, full or sliding-window (K and V, all KV
    /// heads).
    pub kv_bytes_per_token_per_layer: u64,
    /// Tokens per page of the KV pools (at least 1).
    pub page_size: usize,
    /// Window of the sliding-window layers in tokens: set exactly when there are some.
    pub sliding_window: Option<u32>,
    /// Conv state bytes of one Mamba layer for one sequence: set exactly when there are Mamba
    /// layers.
    pub mamba_conv_state_bytes: Option<u64>,
    /// SSM state bytes of one Mamba layer for one sequence: set exactly when there are Mamba
    /// layers.
    pub mamba_ssm_state_bytes: Option<u64>,
    /// Dimensions for FLOPs ([`ModelGeometry::flops_per_token`]); `None`: FLOPs unknown.
    pub compute: Option<ComputeShape>,
}

impl Default for ModelGeometry {
    /// A Llama-3-8B-like dense geometry: 32 layers, 8 KV heads × 128 dims × 2 (K, V) × 2 bytes.
    fn default() -> Self {
        ModelGeometry {
            layers: 32,
            layer_pattern: None,
            kv_bytes_per_token_per_layer: 4096,
            page_size: 16,
            sliding_window: None,
            mamba_conv_state_bytes: None,
            mamba_ssm_state_bytes: None,
            compute: None,
        }
    }
}

impl ModelGeometry {
    /// Layers of each kind (a pattern that does not divide `layers` is cut short at the end;
    /// [`ModelGeometry::validate`] refuses one).
    pub fn layer_counts(&self) -> LayerCounts {
        match &self.layer_pattern {
            None => LayerCounts {
                attention: u64::from(self.layers),
                ..Default::default()
            },
            Some(p) => LayerCounts {
                attention: p.count_in(LayerKind::Attention, self.layers),
                sliding_window: p.count_in(LayerKind::SlidingWindow, self.layers),
                mamba: p.count_in(LayerKind::Mamba, self.layers),
            },
        }
    }

    /// True when the model has sliding-window or Mamba layers.
    pub fn is_hybrid(&self) -> bool {
        let c = self.layer_counts();
        c.sliding_window > 0 || c.mamba > 0
    }

    /// Full-attention KV bytes of one token across the full-attention layers. Saturates at
    /// `u64::MAX` for a geometry that [`ModelGeometry::validate`] refuses.
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.kv_bytes_per_token_per_layer
            .saturating_mul(self.layer_counts().attention)
    }

    /// Full-attention KV bytes of one page (saturating, like [`Self::kv_bytes_per_token`]).
    pub fn page_bytes(&self) -> u64 {
        self.kv_bytes_per_token()
            .saturating_mul(self.page_size as u64)
    }

    /// Full-attention KV bytes of `pages` pages, or `None` when that overflows `u64`.
    pub fn checked_pool_bytes(&self, pages: usize) -> Option<u64> {
        self.checked_page_bytes(self.layer_counts().attention)?
            .checked_mul(u64::try_from(pages).ok()?)
    }

    /// SWA KV bytes of one token across the sliding-window layers (0 without any), or `None`
    /// when that overflows.
    pub fn checked_swa_bytes_per_token(&self) -> Option<u64> {
        self.kv_bytes_per_token_per_layer
            .checked_mul(self.layer_counts().sliding_window)
    }

    /// Bytes of one Mamba slot: the conv and SSM states of every Mamba layer (0 without any),
    /// or `None` when that overflows.
    pub fn checked_mamba_slot_bytes(&self) -> Option<u64> {
        let per_layer = self
            .mamba_conv_state_bytes
            .unwrap_or(0)
            .checked_add(self.mamba_ssm_state_bytes.unwrap_or(0))?;
        per_layer.checked_mul(self.layer_counts().mamba)
    }

    /// Bytes of one page of `layers` KV layers.
    fn checked_page_bytes(&self, layers: u64) -> Option<u64> {
        self.kv_bytes_per_token_per_layer
            .checked_mul(layers)?
            .checked_mul(u64::try_from(self.page_size).ok()?)
    }

    /// Checks the geometry: non-zero sizes, a pattern that tiles the layers, at least one
    /// full-attention layer, the window exactly when there are sliding-window layers, state
    /// bytes exactly when there are Mamba layers, and page and slot bytes that fit `u64`.
    ///
    /// # Errors
    /// [`ManagerError::Config`] naming the first problem.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ManagerError::Config(m));
        let p = self.page_size;
        if p == 0 {
            return bad("page size must be at least 1 token (got 0)".into());
        }
        if self.layers == 0 {
            return bad("the model must have at least one layer".into());
        }
        // A pattern is never empty (`LayerPattern::new` refuses one), so this divides.
        if let Some(pat) = &self.layer_pattern
            && u64::from(self.layers) % pat.len() as u64 != 0
        {
            return bad(format!(
                "layers = {} is not a whole number of repeats of layer_pattern {:?} ({} layers)",
                self.layers,
                pat.to_string(),
                pat.len()
            ));
        }
        let counts = self.layer_counts();
        if counts.attention == 0 {
            return bad(
                "the model has no full-attention layer (A in layer_pattern): the prefix tree \
                 indexes full-attention KV"
                    .into(),
            );
        }
        if self.kv_bytes_per_token_per_layer == 0 {
            return bad("KV bytes per token per layer must be positive".into());
        }
        if self.checked_pool_bytes(1).is_none() {
            return bad(format!(
                "a page of the model ({} bytes per token per layer × {} full-attention layers × \
                 {p} tokens) overflows a 64-bit byte count",
                self.kv_bytes_per_token_per_layer, counts.attention
            ));
        }
        match (self.sliding_window, counts.sliding_window > 0) {
            (None, true) => {
                return bad("the model has sliding-window layers (S) but no sliding_window".into());
            }
            (Some(0), true) => {
                return bad("sliding_window must be at least 1 token (got 0)".into());
            }
            (Some(w), false) => {
                return bad(format!(
                    "sliding_window = {w} is set but no layer is a sliding-window layer (S in \
                     layer_pattern)"
                ));
            }
            _ => {}
        }
        if counts.sliding_window > 0 && self.checked_page_bytes(counts.sliding_window).is_none() {
            return bad(format!(
                "an SWA page ({} bytes per token per layer × {} sliding-window layers × {p} \
                 tokens) overflows a 64-bit byte count",
                self.kv_bytes_per_token_per_layer, counts.sliding_window
            ));
        }
        for (name, v) in [
            ("mamba_conv_state_bytes", self.mamba_conv_state_bytes),
            ("mamba_ssm_state_bytes", self.mamba_ssm_state_bytes),
        ] {
            match (v, counts.mamba > 0) {
                (None, true) => {
                    return bad(format!("the model has Mamba layers (M) but no {name}"));
                }
                (Some(0), true) => return bad(format!("{name} must be positive (got 0)")),
                (Some(b), false) => {
                    return bad(format!(
                        "{name} = {b} is set but no layer is a Mamba layer (M in layer_pattern)"
                    ));
                }
                _ => {}
            }
        }
        if self.checked_mamba_slot_bytes().is_none() {
            return bad(format!(
                "a Mamba slot ({} Mamba layers × their conv and SSM state bytes) overflows a \
                 64-bit byte count",
                counts.mamba
            ));
        }
        if let Some(c) = &self.compute {
            c.validate(counts.mamba > 0)?;
        }
        Ok(())
    }

    /// FLOPs of the whole model for the token at position `ctx` (1-based: it attends to `ctx`
    /// tokens), feed-forward blocks included; `None` without [`ModelGeometry::compute`].
    /// Saturates at `u128::MAX`.
    pub fn flops_per_token(&self, ctx: u64) -> Option<u128> {
        let window = u64::from(self.sliding_window.unwrap_or(0));
        self.flops_of(1, u128::from(ctx), u128::from(ctx.min(window)))
    }

    /// FLOPs of prefilling `len` tokens from nothing: the sum of
    /// [`ModelGeometry::flops_per_token`] over positions `1..=len`, in closed form. It is what a
    /// cache hit of `len` tokens saves. `None` without [`ModelGeometry::compute`]. Saturates.
    pub fn prefill_flops(&self, len: u64) -> Option<u128> {
        let l = u128::from(len);
        let w = u128::from(self.sliding_window.unwrap_or(0));
        // Σ_{p=1..L} p, and Σ_{p=1..L} min(p, w).
        let triangle = |x: u128| x.saturating_mul(x.saturating_add(1)) / 2;
        let attended_window = if l <= w {
            triangle(l)
        } else {
            triangle(w).saturating_add((l - w).saturating_mul(w))
        };
        self.flops_of(l, triangle(l), attended_window)
    }

    /// FLOPs of `tokens` tokens that together attend to `attended_full` tokens in each
    /// full-attention layer and `attended_window` in each sliding-window layer: what every
    /// token costs (projections, Mamba layers, feed-forward) plus the scores per attended
    /// token. `None` without [`ModelGeometry::compute`]. Saturates.
    fn flops_of(&self, tokens: u128, attended_full: u128, attended_window: u128) -> Option<u128> {
        let c = self.compute.as_ref()?;
        let n = self.layer_counts();
        let proj = c.attention_projection_flops().saturating_mul(tokens);
        let score = c.attention_score_flops();
        let full = proj.saturating_add(score.saturating_mul(attended_full));
        let swa = proj.saturating_add(score.saturating_mul(attended_window));
        let mamba = if n.mamba > 0 {
            c.mamba_flops_per_token()?.saturating_mul(tokens)
        } else {
            0
        };
        Some(sum(&[
            full.saturating_mul(u128::from(n.attention)),
            swa.saturating_mul(u128::from(n.sliding_window)),
            mamba.saturating_mul(u128::from(n.mamba)),
            u128::from(c.ffn_flops_per_token).saturating_mul(tokens),
        ]))
    }
}

fn sum(v: &[u128]) -> u128 {
    v.iter().fold(0u128, |a, &b| a.saturating_add(b))
}

/// `[model]` as written: a preset and the keys that override it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    preset: Option<Preset>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    layers: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    layer_pattern: Option<LayerPattern>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kv_bytes_per_token_per_layer: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    page_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sliding_window: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mamba_conv_state_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mamba_ssm_state_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    compute: Option<ComputeShape>,
}

impl TryFrom<ModelSpec> for ModelGeometry {
    type Error = String;
    fn try_from(s: ModelSpec) -> std::result::Result<Self, String> {
        let mut g = s.preset.map(Preset::geometry).unwrap_or_default();
        if let Some(v) = s.layers {
            g.layers = v;
        }
        if let Some(v) = s.layer_pattern {
            g.layer_pattern = Some(v);
        }
        if let Some(v) = s.kv_bytes_per_token_per_layer {
            g.kv_bytes_per_token_per_layer = v;
        }
        if let Some(v) = s.page_size {
            g.page_size = v;
        }
        if let Some(v) = s.sliding_window {
            g.sliding_window = Some(v);
        }
        if let Some(v) = s.mamba_conv_state_bytes {
            g.mamba_conv_state_bytes = Some(v);
        }
        if let Some(v) = s.mamba_ssm_state_bytes {
            g.mamba_ssm_state_bytes = Some(v);
        }
        if let Some(v) = s.compute {
            g.compute = Some(v);
        }
        Ok(g)
    }
}

impl From<ModelGeometry> for ModelSpec {
    fn from(g: ModelGeometry) -> Self {
        ModelSpec {
            preset: None,
            layers: Some(g.layers),
            layer_pattern: g.layer_pattern,
            kv_bytes_per_token_per_layer: Some(g.kv_bytes_per_token_per_layer),
            page_size: Some(g.page_size),
            sliding_window: g.sliding_window,
            mamba_conv_state_bytes: g.mamba_conv_state_bytes,
            mamba_ssm_state_bytes: g.mamba_ssm_state_bytes,
            compute: g.compute,
        }
    }
}

/// A paged KV pool derived from the geometry and a byte budget.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PagedPool {
    /// Bytes of one token (all layers of the pool's kind).
    pub bytes_per_token: u64,
    /// Bytes of one page.
    pub page_bytes: u64,
    /// Pages.
    pub pages: u64,
    /// Tokens (`pages × page_size`).
    pub tokens: u64,
    /// Bytes (`pages × page_bytes`, at most the budget).
    pub bytes: u64,
}

/// The Mamba state pool: fixed-size slots, one per sequence state.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SlotPool {
    /// Bytes of one slot (conv and SSM states of every Mamba layer).
    pub slot_bytes: u64,
    /// Slots.
    pub slots: u64,
    /// Bytes (`slots × slot_bytes`, at most the budget).
    pub bytes: u64,
}

/// The device pools a configuration derives ([`ManagerConfig::pools`](crate::ManagerConfig::pools)).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Pools {
    /// Full-attention KV: the pool the prefix tree indexes.
    pub full: PagedPool,
    /// KV of the sliding-window layers, when there are some.
    pub swa: Option<PagedPool>,
    /// Window of the sliding-window layers in tokens, when there are some.
    pub sliding_window: Option<u32>,
    /// Mamba states, when there are Mamba layers.
    pub mamba: Option<SlotPool>,
}

impl Pools {
    /// Bytes of every pool together (saturating).
    pub fn total_bytes(&self) -> u64 {
        self.full
            .bytes
            .saturating_add(self.swa.map_or(0, |p| p.bytes))
            .saturating_add(self.mamba.map_or(0, |p| p.bytes))
    }
}

/// A paged pool of `budget` bytes with pages of `page_size` tokens of `bytes_per_token`.
pub(crate) fn paged_pool(
    what: &str,
    budget: u64,
    bytes_per_token: u64,
    page_size: usize,
) -> Result<PagedPool> {
    let overflow = || ManagerError::Config(format!("the {what} pool overflows a 64-bit count"));
    let page_tokens = u64::try_from(page_size).map_err(|_| overflow())?;
    let page_bytes = bytes_per_token
        .checked_mul(page_tokens)
        .ok_or_else(overflow)?;
    let pages = units_in_budget(what, budget, page_bytes, "page", "pages")?;
    Ok(PagedPool {
        bytes_per_token,
        page_bytes,
        pages,
        tokens: pages.checked_mul(page_tokens).ok_or_else(overflow)?,
        bytes: pages.checked_mul(page_bytes).ok_or_else(overflow)?,
    })
}

/// The fewest slots a Mamba state pool may have: a hit holds the cached state and the
/// request's copy of it.
pub(crate) const MIN_MAMBA_SLOTS: u64 = 2;

/// A slot pool of `budget` bytes with slots of `slot_bytes`: at least 2 slots, since a Mamba
/// hit keeps the cached state and copies it into a slot of the request's own (a one-slot pool
/// could never serve a hit).
pub(crate) fn slot_pool(budget: u64, slot_bytes: u64) -> Result<SlotPool> {
    let slots = units_in_budget("Mamba", budget, slot_bytes, "state slot", "slots")?;
    if slots < MIN_MAMBA_SLOTS {
        return Err(ManagerError::Config(format!(
            "the Mamba pool budget of {budget} bytes holds {slots} state slot of {slot_bytes} \
             bytes; it needs at least {MIN_MAMBA_SLOTS} (a hit keeps the cached state and \
             copies it into the request's own slot)"
        )));
    }
    Ok(SlotPool {
        slot_bytes,
        slots,
        // slots ≤ budget / slot_bytes, so this is at most the budget.
        bytes: slots.saturating_mul(slot_bytes),
    })
}

/// How many units of `unit_bytes` the `what` pool's `budget` holds: at least one, and no more
/// than a pool can address (32-bit ids).
fn units_in_budget(
    what: &str,
    budget: u64,
    unit_bytes: u64,
    unit: &str,
    units: &str,
) -> Result<u64> {
    let n = budget.checked_div(unit_bytes).unwrap_or(0);
    if n == 0 {
        return Err(ManagerError::Config(format!(
            "the {what} pool budget of {budget} bytes fits no {unit} of {unit_bytes} bytes"
        )));
    }
    if n > u64::from(u32::MAX) {
        return Err(ManagerError::Config(format!(
            "the {what} pool of {n} {units} is more than the {} {units} a pool can address",
            u32::MAX
        )));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(g: &ModelGeometry) -> String {
        match g.validate() {
            Err(ManagerError::Config(m)) => m,
            other => panic!("expected a config error for {g:?}, got {other:?}"),
        }
    }

    #[test]
    fn patterns_parse_print_and_count() {
        let p = LayerPattern::parse("MMMMAMMM").unwrap();
        assert_eq!(p.len(), 8);
        assert_eq!(p.to_string(), "MMMMAMMM");
        assert_eq!(p.count_in(LayerKind::Attention, 32), 4);
        assert_eq!(p.count_in(LayerKind::Mamba, 32), 28);
        // Cut short: the first 5 layers of "MMMMA" hold the attention layer.
        assert_eq!(p.count_in(LayerKind::Attention, 5), 1);
        assert_eq!(p.count_in(LayerKind::Attention, 4), 0);
        let e = LayerPattern::parse("MMXA").unwrap_err().to_string();
        assert!(e.contains("'X'") && e.contains("position 2"), "{e}");
        assert!(
            LayerPattern::parse("")
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
        assert!(LayerPattern::new(vec![]).is_err());
    }

    #[test]
    fn presets_have_the_published_shapes() {
        let j = Preset::JambaLike.geometry();
        j.validate().unwrap();
        assert_eq!(
            j.layer_counts(),
            LayerCounts {
                attention: 4,
                sliding_window: 0,
                mamba: 28
            }
        );
        assert_eq!(j.kv_bytes_per_token(), 4 * 4096);
        assert_eq!(j.checked_mamba_slot_bytes(), Some(28 * (49_152 + 262_144)));
        let g = Preset::GemmaLike.geometry();
        g.validate().unwrap();
        assert_eq!(
            g.layer_counts(),
            LayerCounts {
                attention: 8,
                sliding_window: 40,
                mamba: 0
            }
        );
        assert_eq!(g.kv_bytes_per_token(), 8 * 8192);
        assert_eq!(g.checked_swa_bytes_per_token(), Some(40 * 8192));
        assert_eq!(Preset::Dense.geometry(), ModelGeometry::default());
        assert!(!ModelGeometry::default().is_hybrid() && j.is_hybrid() && g.is_hybrid());
        for p in Preset::ALL {
            assert_eq!(Preset::from_name(p.name()), Some(p));
        }
        assert_eq!(Preset::from_name("llama"), None);
    }

    #[test]
    fn each_bad_geometry_is_a_config_error_naming_it() {
        let jamba = Preset::JambaLike.geometry();
        let gemma = Preset::GemmaLike.geometry();
        let mut g = jamba.clone();
        g.layers = 0;
        assert!(err(&g).contains("at least one layer"));
        let mut g = jamba.clone();
        g.layers = 30;
        assert!(err(&g).contains("whole number of repeats"), "{}", err(&g));
        let mut g = jamba.clone();
        g.layer_pattern = Some(LayerPattern::parse("MMMM").unwrap());
        assert!(err(&g).contains("no full-attention layer"));
        let mut g = gemma.clone();
        g.sliding_window = Some(0);
        assert!(err(&g).contains("sliding_window must be at least 1"));
        g.sliding_window = None;
        assert!(err(&g).contains("no sliding_window"));
        let mut g = jamba.clone();
        g.sliding_window = Some(512);
        assert!(err(&g).contains("no layer is a sliding-window layer"));
        let mut g = jamba.clone();
        g.mamba_ssm_state_bytes = Some(0);
        assert!(err(&g).contains("mamba_ssm_state_bytes must be positive"));
        g.mamba_ssm_state_bytes = None;
        assert!(err(&g).contains("no mamba_ssm_state_bytes"));
        let mut g = jamba.clone();
        g.mamba_conv_state_bytes = Some(0);
        assert!(err(&g).contains("mamba_conv_state_bytes must be positive"));
        let mut g = gemma.clone();
        g.mamba_conv_state_bytes = Some(64);
        assert!(err(&g).contains("no layer is a Mamba layer"));
        let mut g = jamba.clone();
        g.kv_bytes_per_token_per_layer = 0;
        assert!(err(&g).contains("KV bytes per token per layer must be positive"));
        let mut g = jamba.clone();
        g.page_size = 0;
        assert!(err(&g).contains("page size"));
        // Overflow: a slot, an SWA page, a full page.
        let mut g = jamba.clone();
        g.mamba_ssm_state_bytes = Some(u64::MAX / 2);
        assert!(err(&g).contains("Mamba slot") && err(&g).contains("overflows"));
        let mut g = gemma.clone();
        g.kv_bytes_per_token_per_layer = u64::MAX / 64;
        assert!(err(&g).contains("overflows"), "{}", err(&g));
        // Compute dimensions: zero, missing or stray Mamba dimensions.
        let mut g = jamba.clone();
        g.compute.as_mut().unwrap().head_dim = 0;
        assert!(err(&g).contains("compute.head_dim"));
        let mut g = jamba.clone();
        g.compute.as_mut().unwrap().mamba = None;
        assert!(err(&g).contains("no mamba dimensions"));
        let mut g = jamba.clone();
        g.compute.as_mut().unwrap().mamba.as_mut().unwrap().d_state = 0;
        assert!(err(&g).contains("compute.mamba.d_state"));
        let mut g = gemma.clone();
        g.compute.as_mut().unwrap().mamba = jamba.compute.clone().unwrap().mamba;
        assert!(err(&g).contains("compute.mamba is set"));
    }

    #[test]
    fn flops_by_hand() {
        // h = 8, 2 query heads, 1 KV head, d = 4: projections 2·8·4·(4 + 2) = 384, scores
        // 4·2·4 = 32 per attended token.
        let shape = ComputeShape {
            hidden_size: 8,
            attention_heads: 2,
            kv_heads: 1,
            head_dim: 4,
            ffn_flops_per_token: 1000,
            mamba: Some(MambaShape {
                d_inner: 16,
                d_state: 4,
                d_conv: 4,
                dt_rank: 2,
            }),
        };
        assert_eq!(shape.attention_flops_per_token(1), 384 + 32);
        assert_eq!(shape.attention_flops_per_token(10), 384 + 320);
        // 2·8·2·16 + 2·16·4 + 2·16·(2 + 8) + 2·2·16 + 6·16·4 + 2·16·8
        // = 512 + 128 + 320 + 64 + 384 + 256 = 1664.
        assert_eq!(shape.mamba_flops_per_token(), Some(1664));
        let g = ModelGeometry {
            layers: 4,
            layer_pattern: Some(LayerPattern::parse("MSMA").unwrap()),
            kv_bytes_per_token_per_layer: 16,
            page_size: 4,
            sliding_window: Some(3),
            mamba_conv_state_bytes: Some(1),
            mamba_ssm_state_bytes: Some(1),
            compute: Some(shape),
        };
        g.validate().unwrap();
        // At ctx 10: full layer 704, window layer min(10, 3) → 384 + 96 = 480, 2 Mamba layers
        // 3328, FFN 1000.
        assert_eq!(g.flops_per_token(10), Some(704 + 480 + 3328 + 1000));
        // The closed form is the sum over positions, inside and past the window.
        for len in [0u64, 1, 2, 3, 4, 7, 50] {
            let brute: u128 = (1..=len).map(|p| g.flops_per_token(p).unwrap()).sum();
            assert_eq!(g.prefill_flops(len), Some(brute), "len {len}");
        }
        assert_eq!(ModelGeometry::default().flops_per_token(1), None);
        assert_eq!(ModelGeometry::default().prefill_flops(1), None);
    }

    #[test]
    fn preset_flops_by_hand() {
        // Jamba-like at ctx 1000. Attention layer: 2·4096·128·(64 + 16) = 83_886_080
        // projections + 4·32·128·1000 = 16_384_000 scores. Mamba layer: 2·4096·2·8192
        // (134_217_728) + 2·8192·4 (65_536) + 2·8192·(256 + 32) (4_718_592) + 2·256·8192
        // (4_194_304) + 6·8192·16 (786_432) + 2·8192·4096 (67_108_864) = 211_091_456.
        let j = Preset::JambaLike.geometry();
        let c = j.compute.as_ref().unwrap();
        assert_eq!(c.attention_flops_per_token(1000), 83_886_080 + 16_384_000);
        assert_eq!(c.mamba_flops_per_token(), Some(211_091_456));
        let ffn = 48u128 * 2 * 3 * 4096 * 14336;
        assert_eq!(
            j.flops_per_token(1000),
            Some(4 * (83_886_080 + 16_384_000) + 28 * 211_091_456 + ffn)
        );
        // Gemma-like at ctx 4096: global layers attend to 4096 tokens, local ones to 1024.
        // Projections 2·3840·256·(32 + 16) = 94_371_840; scores 4·16·256 = 16_384 per token.
        let g = Preset::GemmaLike.geometry();
        let ffn = 48u128 * 2 * 3 * 3840 * 15360;
        assert_eq!(
            g.flops_per_token(4096),
            Some(8 * (94_371_840 + 16_384 * 4096) + 40 * (94_371_840 + 16_384 * 1024) + ffn)
        );
        // Beyond the window a longer prefix adds the same per-token cost to local layers.
        let a = g.prefill_flops(3000).unwrap();
        let b = g.prefill_flops(3001).unwrap();
        assert_eq!(b - a, g.flops_per_token(3001).unwrap());
    }

    #[test]
    fn pools_from_budgets() {
        let p = paged_pool("SWA", 10_000, 100, 16).unwrap();
        assert_eq!(
            (p.page_bytes, p.pages, p.tokens, p.bytes),
            (1600, 6, 96, 9600)
        );
        let e = paged_pool("SWA", 1599, 100, 16).unwrap_err().to_string();
        assert!(e.contains("fits no page of 1600 bytes"), "{e}");
        let e = paged_pool("SWA", u64::MAX, 1, 1).unwrap_err().to_string();
        assert!(e.contains("can address"), "{e}");
        assert!(paged_pool("SWA", 1, u64::MAX, 2).is_err());
        let s = slot_pool(1000, 300).unwrap();
        assert_eq!((s.slots, s.bytes), (3, 900));
        assert!(
            slot_pool(299, 300)
                .unwrap_err()
                .to_string()
                .contains("fits no state slot")
        );
        assert_eq!(slot_pool(600, 300).unwrap().slots, 2);
        let e = slot_pool(599, 300).unwrap_err().to_string();
        assert!(
            e.contains("holds 1 state slot") && e.contains("at least 2"),
            "{e}"
        );
        assert!(
            slot_pool(u64::MAX, 1)
                .unwrap_err()
                .to_string()
                .contains("can address")
        );
    }
}
