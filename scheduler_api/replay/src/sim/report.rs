//! The replay report: what one configuration achieved on one trace.

use std::fmt;

use serde::Serialize;

use super::load::LoadReport;
use super::memory::MemoryUse;
use super::scheduler::{PageHashMode, SimConfig};
use radixkv_scheduler_api::config::{CacheKind, StorageBackendKind, WritePolicy, human_tokens};
use radixkv_scheduler_api::metrics::{Counters, ratio};

/// The version of [`ReportFile`]'s layout, written as its `schema_version`. It changes when a
/// field is renamed, removed or changes meaning; new fields may appear without a change.
pub const REPORT_SCHEMA_VERSION: u32 = 1;

/// What `report.json` and `radixkv replay --json` hold: the same shape for one run and for a
/// `--compare` of many.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReportFile {
    /// [`REPORT_SCHEMA_VERSION`].
    pub schema_version: u32,
    /// One report per configuration that ran, in the order they ran.
    pub runs: Vec<Report>,
}

impl ReportFile {
    /// The file of `runs`, at the current schema version.
    pub fn new(runs: Vec<Report>) -> Self {
        ReportFile {
            schema_version: REPORT_SCHEMA_VERSION,
            runs,
        }
    }
}

/// Token hit ratios per tier.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct TierRatios {
    /// Device tier.
    pub device: f64,
    /// Host tier.
    pub host: f64,
    /// Of the host tier's, what the storage tier prefetched into it.
    pub storage: f64,
    /// All tiers.
    pub overall: f64,
}

/// One occupancy sample of the device pool.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct OccupancySample {
    /// Simulated time (seconds).
    pub t_s: f64,
    /// Fraction of the pool held by running requests (locked or owned).
    pub in_use: f64,
    /// Fraction of the pool holding evictable cache.
    pub cached: f64,
    /// Models with Mamba layers: fraction of the state slots held by running requests or
    /// locked by them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mamba_in_use: Option<f64>,
    /// Models with Mamba layers: fraction of the state slots holding evictable cached states.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mamba_cached: Option<f64>,
    /// Models with sliding-window layers: fraction of the SWA pages owned by running requests
    /// or locked by them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swa_in_use: Option<f64>,
    /// Models with sliding-window layers: fraction of the SWA pages holding evictable window
    /// KV.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swa_cached: Option<f64>,
}

/// Prefill FLOPs of the prompts at their first admission, from the model's compute shape.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct PrefillFlops {
    /// FLOPs of prefilling every prompt from nothing.
    pub prompt: f64,
    /// FLOPs the cache hits saved: the prefill of each reused prefix.
    pub saved: f64,
}

impl PrefillFlops {
    /// `saved / prompt` (0 without prompts).
    pub fn saved_fraction(&self) -> f64 {
        if self.prompt > 0.0 {
            self.saved / self.prompt
        } else {
            0.0
        }
    }
}

/// The Mamba state pool of a replay (models with Mamba layers).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MambaReport {
    /// The Mamba policy (`"marconi"`, `"sglang"`).
    pub policy: &'static str,
    /// Slots in the pool.
    pub slots: u64,
    /// Modeled bytes of one slot (the states of every Mamba layer).
    pub slot_bytes: u64,
    /// States the cache stored as checkpoints.
    pub states_stored: u64,
    /// First admissions that reused a cached state.
    pub state_hits: u64,
    /// Cached states dropped to make room.
    pub states_evicted: u64,
    /// Checkpoints the policy did not take (admission refused them, or no slot).
    pub checkpoints_skipped: u64,
    /// Cached states left at the end.
    pub cached_at_end: u64,
    /// Slots still held by a request or locked at the end (must be 0).
    pub leaked_slots: u64,
}

/// The sliding-window KV pool of a replay (models with sliding-window layers).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SwaReport {
    /// The sliding window in tokens.
    pub window: u64,
    /// Pages in the SWA pool.
    pub pages: u64,
    /// Modeled bytes of one SWA page (every sliding-window layer).
    pub page_bytes: u64,
    /// Pages running requests freed as their window slid past them.
    pub pages_slid_out: u64,
    /// Pages of cached window KV left at the end.
    pub cached_at_end: u64,
    /// Pages still owned by a request or locked at the end (must be 0).
    pub leaked_pages: u64,
}

/// Cache-manager CPU time per request, by lifecycle phase (µs; the clock is
/// [`Report::cache_cpu_clock`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct CpuBreakdown {
    /// `arrive`.
    pub arrive_us: f64,
    /// `admit` (match, temporary lock, budget, lock).
    pub admit_us: f64,
    /// `extend` (prefill allocation with eviction).
    pub extend_us: f64,
    /// `decode` (one token allocation per step).
    pub decode_us: f64,
    /// `begin_step`, `chunk_done`, `finish`, `end_step`, `take_events`.
    pub complete_us: f64,
}

/// The conversations' hash memos over a replay (see `page_hashes = "conversation"`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MemoReport {
    /// Bytes of hashes the memos may hold in all: the pools' bookkeeping (a token id per
    /// token and a page id per page of the device and host pools).
    pub bound_bytes: usize,
    /// The most bytes they held once held to the bound (whole chunks of hashes, a chunk
    /// shared by a conversation's prompts counted once).
    pub peak_bytes: usize,
    /// Memos forgotten to stay within the bound (their conversations' next turns hashed
    /// their whole prompts).
    pub forgotten: u64,
}

/// The time the replay thread did not run (waited for a core, or blocked) inside the
/// manager's timed calls, found by the thread's CPU clock and taken out of the figures.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct CpuWaits {
    /// Timed calls a wait was taken out of (at most one a step).
    pub regions: u64,
    /// The time taken out (s).
    pub removed_s: f64,
}

/// The result of replaying one trace under one configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// Configuration label.
    pub config: String,
    /// Everything the replay ran with: the manager's configuration as built (pool sizes, model
    /// geometry, cache kind and tiers, sessions, ...), the scheduler's limits and the cost
    /// model, with every default filled in.
    pub effective_config: SimConfig,
    /// Trace name.
    pub trace: String,
    /// Requests replayed.
    pub requests: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens reused per tier (first admission of each request).
    pub hit_tokens_device: u64,
    /// See `hit_tokens_device`.
    pub hit_tokens_host: u64,
    /// Of `hit_tokens_host`, the tokens the storage tier prefetched into the host tier.
    pub hit_tokens_storage: u64,
    /// Prompt tokens the device KV matched at the first admission, usable or not: equal to
    /// `hit_tokens_device` on a KV-only model; on a model with Mamba layers the usable hit
    /// stops at the deepest cached state, and this says how much deeper the KV went.
    pub kv_match_tokens: u64,
    /// `kv_match_tokens / prompt_tokens`.
    pub kv_match_ratio: f64,
    /// Prefill FLOPs of the prompts and what the hits saved (`None` without `[model.compute]`).
    pub prefill_flops: Option<PrefillFlops>,
    /// The Mamba state pool (`None` on a model without Mamba layers).
    pub mamba: Option<MambaReport>,
    /// The sliding-window KV pool (`None` on a model without sliding-window layers).
    pub swa: Option<SwaReport>,
    /// Token hit ratios.
    pub hit_ratio: TierRatios,
    /// Tokens an infinite cache would have reused.
    pub ideal_hit_tokens: u64,
    /// The infinite-cache token hit ratio.
    pub ideal_hit_ratio: f64,
    /// `hit_ratio.overall / ideal_hit_ratio` (1 when the ideal is 0).
    pub achieved_over_ideal: f64,
    /// Prefill tokens computed, re-prefills after retraction included.
    pub recomputed_tokens: u64,
    /// Output tokens generated.
    pub output_tokens: u64,
    /// Retractions (decode out of memory).
    pub retractions: u64,
    /// Requests dropped unserved because the manager said they can never be admitted
    /// ([`Admission::Never`](radixkv_scheduler_api::Admission::Never)): a retracted request whose decoded
    /// tokens plus its remaining output reservation outgrew the pool.
    pub never_fit: u64,
    /// Modeled bytes of one KV page (all layers, the model's geometry; the simulated backend
    /// copies far fewer, see `SimGeometry`).
    pub page_bytes: u64,
    /// Simulated time to first token, median (ms).
    pub ttft_p50_ms: f64,
    /// Simulated time to first token, 99th percentile (ms).
    pub ttft_p99_ms: f64,
    /// Simulated time from first arrival to last finish (s).
    pub sim_duration_s: f64,
    /// How arrivals were timed, and the load they put on the simulated GPU.
    pub load: LoadReport,
    /// Output tokens per simulated second.
    pub throughput_tok_s: f64,
    /// Requests per simulated second.
    pub throughput_req_s: f64,
    /// Scheduler steps.
    pub steps: u64,
    /// CPU time of the replay thread inside the cache manager's calls, per request (µs):
    /// the calls are timed with the monotonic clock, and the time the thread did not run in
    /// them (found by its CPU clock) is taken out; see [`Report::cache_cpu_clock`].
    pub cache_cpu_us_per_request: f64,
    /// The same, by lifecycle phase.
    pub cache_cpu_breakdown: CpuBreakdown,
    /// `"thread"`: the figures above are the thread's CPU time (waits taken out); `"wall"`:
    /// the platform has no thread CPU clock, and they are wall-clock time, waits included.
    pub cache_cpu_clock: String,
    /// The waits taken out of the figures above.
    pub cache_cpu_waits: CpuWaits,
    /// Time the prompt sources spent hashing pages, per request (µs; how they hashed:
    /// `effective_config.page_hashes`): the engine's work, not counted in the manager's CPU
    /// above.
    pub page_hash_us_per_request: f64,
    /// The conversations' hash memos (`page_hashes = "conversation"` only).
    pub page_hash_memos: Option<MemoReport>,
    /// Wall-clock time of the whole replay (s).
    pub wall_s: f64,
    /// Device tokens still locked or owned after every request finished (must be 0).
    pub leaked_tokens: u64,
    /// Sessions still open after the replay closed every conversation's session (must be 0).
    pub open_sessions_at_end: u64,
    /// The pool accounting balanced at the end.
    pub accounting_balanced: bool,
    /// Invariant audits the replay ran, the final one included (see
    /// `SimConfig::check_invariants_every`).
    pub invariant_checks: u64,
    /// Resident memory of the process during the replay (`None` where the platform does not
    /// report it).
    pub memory: Option<MemoryUse>,
    /// The most token storage the manager's requests held, read from
    /// [`KvCacheManager::token_storage`](radixkv_scheduler_api::KvCacheManager::token_storage)
    /// at the end of every step: the replay submits its requests lazily, so the waiting ones
    /// hold at most the tokens of the one the scheduler tried last.
    pub token_storage_peak: TokenStoragePeak,
    /// Device pool occupancy over time.
    pub occupancy: Vec<OccupancySample>,
    /// Manager counters at the end.
    pub counters: Counters,
}

/// Per field, the largest value of the manager's
/// [`TokenStorage`](radixkv_scheduler_api::TokenStorage) at any step end of a replay (each
/// field on its own: they need not come from the same step).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TokenStoragePeak {
    /// Requests waiting.
    pub waiting_requests: u64,
    /// Waiting requests holding their prompt's tokens.
    pub waiting_materialised: u64,
    /// Bytes of token storage held by waiting requests.
    pub waiting_bytes: u64,
    /// Bytes of token storage held by running requests.
    pub running_bytes: u64,
}

impl TokenStoragePeak {
    /// Raises each field to `t`'s where it is larger.
    pub(crate) fn observe(&mut self, t: &radixkv_scheduler_api::TokenStorage) {
        let max = |a: &mut u64, b: usize| *a = (*a).max(b as u64);
        max(&mut self.waiting_requests, t.waiting_requests);
        max(&mut self.waiting_materialised, t.waiting_materialised);
        max(&mut self.waiting_bytes, t.waiting_bytes);
        max(&mut self.running_bytes, t.running_bytes);
    }
}

impl Report {
    /// Fills the ratios from the token counts.
    pub(crate) fn derive_ratios(&mut self) {
        let p = self.prompt_tokens;
        let d = self.hit_tokens_device;
        let h = self.hit_tokens_host;
        self.hit_ratio = TierRatios {
            device: ratio(d, p),
            host: ratio(h, p),
            storage: ratio(self.hit_tokens_storage, p),
            overall: ratio(d + h, p),
        };
        self.ideal_hit_ratio = ratio(self.ideal_hit_tokens, p);
        self.kv_match_ratio = ratio(self.kv_match_tokens, p);
        self.achieved_over_ideal = if self.ideal_hit_tokens == 0 {
            1.0
        } else {
            ratio(d + h, self.ideal_hit_tokens)
        };
    }

    /// The host tier, if the configuration has one.
    fn host_tier(&self) -> Option<&radixkv_scheduler_api::config::HostTier> {
        match &self.effective_config.manager.cache {
            CacheKind::HiCache(t) => Some(t),
            _ => None,
        }
    }

    /// Header of the comparison table. Figures that are the same in every row (requests, the
    /// ideal, output throughput) are not columns: the caller prints them once.
    pub fn table_header() -> String {
        Self::table_header_for(false)
    }

    /// [`Report::table_header`], with the `kv match` and `saved` columns of a model with Mamba
    /// layers when `hybrid` (its rows, [`Report::table_row`], carry them).
    pub fn table_header_for(hybrid: bool) -> String {
        let mut h = Self::base_header();
        if hybrid {
            h.push_str(&format!(" {:>8} {:>7}", "kv match", "saved"));
        }
        h
    }

    fn base_header() -> String {
        format!(
            "{:<34} {:>7} {:>7} {:>7} {:>7} {:>12} {:>10} {:>9} {:>9} {:>8}",
            "config",
            "hit",
            "device",
            "host",
            "/ideal",
            "recomputed",
            "xfer",
            "TTFT p50",
            "TTFT p99",
            "cpu µs/r"
        )
    }

    /// One row of the comparison table (`-` where the configuration has no host tier). A model
    /// with Mamba layers adds the KV match ratio (usable or not) and the share of prefill FLOPs
    /// the hits saved (`-` without the model's compute shape).
    pub fn table_row(&self) -> String {
        let mut row = self.base_row();
        if self.mamba.is_some() {
            let saved = self.prefill_flops.map_or("-".into(), |f| {
                format!("{:.1}%", 100.0 * f.saved_fraction())
            });
            row.push_str(&format!(" {:>8.4} {:>7}", self.kv_match_ratio, saved));
        }
        row
    }

    fn base_row(&self) -> String {
        let t = &self.counters.transfers;
        let (host, xfer) = match self.host_tier() {
            Some(_) => (
                format!("{:.4}", self.hit_ratio.host),
                fmt_bytes(t.bytes_loaded.saturating_add(t.bytes_written)),
            ),
            None => ("-".into(), "-".into()),
        };
        format!(
            "{:<34} {:>7.4} {:>7.4} {:>7} {:>7.3} {:>12} {:>10} {:>7.1}ms {:>7.1}ms {:>8.2}",
            self.config,
            self.hit_ratio.overall,
            self.hit_ratio.device,
            host,
            self.achieved_over_ideal,
            fmt_count(self.recomputed_tokens),
            xfer,
            self.ttft_p50_ms,
            self.ttft_p99_ms,
            self.cache_cpu_us_per_request
        )
    }
}

/// A byte count in binary units: `0 B`, `2 MiB`, `333.6 GiB`.
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 || v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[unit])
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// A count with thousands separators: `15,205,203`.
pub fn fmt_count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A pool of `tokens` in pages of `page_size` tokens of `page_bytes` each, as the report and
/// the comparison's header print it: `1M tokens (65,536 pages, 128 GiB modeled)`.
pub fn fmt_pool(tokens: usize, page_size: usize, page_bytes: u64) -> String {
    let pages = tokens.checked_div(page_size).unwrap_or(0) as u64;
    format!(
        "{} tokens ({} pages, {} modeled)",
        human_tokens(tokens),
        fmt_count(pages),
        fmt_bytes(pages.saturating_mul(page_bytes))
    )
}

fn write_policy_name(w: &WritePolicy) -> String {
    match w {
        WritePolicy::WriteThrough => "write-through".into(),
        WritePolicy::WriteThroughSelective { hits } => {
            format!("selective write-through (after {hits} hits)")
        }
        WritePolicy::WriteBack => "write-back".into(),
    }
}

impl Report {
    /// The mean occupancy over the run of the KV pool and one extra pool (`pool` names it;
    /// `extra` reads its in-use and cached shares from a sample).
    fn write_occupancy(
        &self,
        f: &mut fmt::Formatter<'_>,
        pool: &str,
        extra: impl Fn(&OccupancySample) -> (Option<f64>, Option<f64>),
    ) -> fmt::Result {
        let n = self.occupancy.len().max(1) as f64;
        let mean = |get: &dyn Fn(&OccupancySample) -> f64| {
            100.0 * self.occupancy.iter().map(get).sum::<f64>() / n
        };
        writeln!(
            f,
            "pool occupancy   mean over the run: KV pages {:.1}% in use + {:.1}% cached; \
             {pool} {:.1}% in use + {:.1}% cached",
            mean(&|o| o.in_use),
            mean(&|o| o.cached),
            mean(&|o| extra(o).0.unwrap_or(0.0)),
            mean(&|o| extra(o).1.unwrap_or(0.0))
        )
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.hit_ratio;
        let sim = &self.effective_config;
        let m = &sim.manager;
        let model = &m.model;
        let host = self.host_tier();
        writeln!(f, "trace            {}", self.trace)?;
        writeln!(f, "config           {}", self.config)?;
        writeln!(
            f,
            "model            {} layers, {} of KV per token (modeled), pages of {} tokens = {}",
            model.layers,
            fmt_bytes(model.kv_bytes_per_token()),
            model.page_size,
            fmt_bytes(self.page_bytes)
        )?;
        writeln!(
            f,
            "device pool      {}, eviction {}",
            fmt_pool(m.device_tokens, model.page_size, self.page_bytes),
            m.eviction.0.name()
        )?;
        if let Some(h) = host {
            let policy = h.eviction.map_or(m.eviction.0, |e| e.0);
            writeln!(
                f,
                "host pool        {}, {}, eviction {}",
                fmt_pool(h.host_tokens, model.page_size, self.page_bytes),
                write_policy_name(&h.write_policy),
                policy.name()
            )?;
        }
        if let Some(s) = &m.sessions {
            writeln!(
                f,
                "sessions         hold at most {} tokens ({} per session), idle for at most {} s",
                fmt_count(s.max_held_tokens as u64),
                fmt_count(s.per_session_cap_tokens as u64),
                s.idle_ttl_ms as f64 / 1e3
            )?;
        }
        if let Some(st) = host.and_then(|h| h.storage.as_ref()) {
            let cap = |c: &Option<usize>| match c {
                Some(t) => fmt_pool(*t, model.page_size, self.page_bytes),
                None => "no cap".into(),
            };
            let backend = match &st.backend {
                StorageBackendKind::File {
                    dir,
                    capacity_tokens,
                    ..
                } => format!("file store {} ({})", dir.display(), cap(capacity_tokens)),
                StorageBackendKind::Memory { capacity_tokens } => {
                    format!("memory store ({})", cap(capacity_tokens))
                }
                StorageBackendKind::Redis { url, .. } => format!("redis store {url}"),
                StorageBackendKind::Engine => "the engine's store".into(),
            };
            writeln!(
                f,
                "storage tier     {backend}, read at {} GB/s (charged in TTFT), prefetch from {} tokens",
                sim.cost.storage_gbps,
                fmt_count(st.prefetch_threshold_tokens as u64)
            )?;
        }
        writeln!(
            f,
            "scheduler        at most {} running, {} prefill tokens per step{}",
            sim.max_running,
            fmt_count(sim.prefill_budget as u64),
            if host.is_some() {
                format!(", host link {} GB/s", sim.cost.transfer_gbps)
            } else {
                String::new()
            }
        )?;
        writeln!(
            f,
            "requests         {} ({} prompt tokens, {} output tokens)",
            fmt_count(self.requests),
            fmt_count(self.prompt_tokens),
            fmt_count(self.output_tokens)
        )?;
        if host.is_some() {
            writeln!(
                f,
                "token hit ratio  {:.4} overall (device {:.4}, host {:.4})",
                r.overall, r.device, r.host
            )?;
        } else {
            writeln!(f, "token hit ratio  {:.4}", r.overall)?;
        }
        writeln!(
            f,
            "ideal (∞ cache)  {:.4}   achieved/ideal {:.3}",
            self.ideal_hit_ratio, self.achieved_over_ideal
        )?;
        if host.is_some_and(|h| h.storage.is_some()) {
            let c = &self.counters;
            writeln!(
                f,
                "storage hits     {} tokens, {:.4} of prompt tokens (part of the host hits)",
                fmt_count(self.hit_tokens_storage),
                r.storage
            )?;
            writeln!(
                f,
                "prefetches       {} started, {} with nothing to load, {} timed out, {} \
                 admission waits; {} pages returned unused, {} corrupt",
                fmt_count(c.prefetches_started),
                fmt_count(c.prefetches_revoked),
                fmt_count(c.prefetch_timeouts),
                fmt_count(c.prefetch_waits),
                fmt_count(c.prefetch_pages_revoked),
                fmt_count(c.prefetch_pages_corrupt)
            )?;
            writeln!(
                f,
                "storage backups  {} pages written, {} found stored, {} failed; {} store errors",
                fmt_count(c.backup_pages_written),
                fmt_count(c.backup_pages_skipped),
                fmt_count(c.backup_pages_failed),
                fmt_count(c.store_errors)
            )?;
        }
        if let Some(mamba) = &self.mamba {
            writeln!(
                f,
                "usable vs match  usable hit {:.4}, KV match {:.4} (the KV matched past the \
                 deepest cached state is not usable)",
                r.device, self.kv_match_ratio
            )?;
            writeln!(
                f,
                "mamba states     {}: {} slots of {} ({} modeled); stored {}, hit {}, evicted \
                 {}, skipped {}, {} cached at the end",
                mamba.policy,
                fmt_count(mamba.slots),
                fmt_bytes(mamba.slot_bytes),
                fmt_bytes(mamba.slots.saturating_mul(mamba.slot_bytes)),
                fmt_count(mamba.states_stored),
                fmt_count(mamba.state_hits),
                fmt_count(mamba.states_evicted),
                fmt_count(mamba.checkpoints_skipped),
                fmt_count(mamba.cached_at_end)
            )?;
            self.write_occupancy(f, "Mamba slots", |o| (o.mamba_in_use, o.mamba_cached))?;
        }
        if let Some(swa) = &self.swa {
            writeln!(
                f,
                "swa pool         window {} tokens: {} pages of {} ({} modeled); {} pages slid \
                 out of request windows, {} cached at the end",
                swa.window,
                fmt_count(swa.pages),
                fmt_bytes(swa.page_bytes),
                fmt_bytes(swa.pages.saturating_mul(swa.page_bytes)),
                fmt_count(swa.pages_slid_out),
                fmt_count(swa.cached_at_end)
            )?;
            self.write_occupancy(f, "SWA pages", |o| (o.swa_in_use, o.swa_cached))?;
        }
        if let Some(fl) = &self.prefill_flops {
            writeln!(
                f,
                "prefill FLOPs    {:.3e} saved of {:.3e} ({:.1}%)",
                fl.saved,
                fl.prompt,
                100.0 * fl.saved_fraction()
            )?;
        }
        writeln!(
            f,
            "recomputed       {} tokens; evicted {} tokens; {} retractions",
            fmt_count(self.recomputed_tokens),
            fmt_count(self.counters.evicted_tokens),
            self.retractions
        )?;
        if self.never_fit > 0 {
            writeln!(
                f,
                "dropped          {} requests that can never fit the device pool",
                self.never_fit
            )?;
        }
        if host.is_some() {
            let t = &self.counters.transfers;
            writeln!(
                f,
                "transfers        loaded {} pages ({} modeled), written {} pages ({} modeled)",
                fmt_count(t.pages_loaded),
                fmt_bytes(t.bytes_loaded),
                fmt_count(t.pages_written),
                fmt_bytes(t.bytes_written)
            )?;
        }
        writeln!(
            f,
            "TTFT (simulated) p50 {:.1} ms, p99 {:.1} ms",
            self.ttft_p50_ms, self.ttft_p99_ms
        )?;
        writeln!(f, "load             {}", self.load)?;
        writeln!(
            f,
            "throughput       {:.0} output tok/s, {:.2} req/s over {:.1} s simulated ({} steps)",
            self.throughput_tok_s,
            self.throughput_req_s,
            self.sim_duration_s,
            fmt_count(self.steps)
        )?;
        let b = &self.cache_cpu_breakdown;
        write!(
            f,
            "cache manager    {:.2} µs CPU per request (arrive {:.2}, admit {:.2}, extend {:.2}, \
             decode {:.2}, chunk/finish/step {:.2}; {} clock, {:.2} s of waits taken out); \
             replay wall time {:.2} s",
            self.cache_cpu_us_per_request,
            b.arrive_us,
            b.admit_us,
            b.extend_us,
            b.decode_us,
            b.complete_us,
            self.cache_cpu_clock,
            self.cache_cpu_waits.removed_s,
            self.wall_s
        )?;
        match self.effective_config.page_hashes {
            PageHashMode::Off => {}
            m if self.page_hash_us_per_request == 0.0 => write!(
                f,
                "\npage hashes      {}: no prompt carried any (none belongs to a conversation)",
                m.name()
            )?,
            m => write!(
                f,
                "\npage hashes      {}: the engine spent {:.2} µs per request hashing pages \
                 (not in the manager's CPU)",
                m.name(),
                self.page_hash_us_per_request
            )?,
        }
        if let Some(m) = &self.page_hash_memos
            && m.peak_bytes > 0
        {
            write!(
                f,
                "; the conversations' memos held at most {} of hashes (bound {}: the pools' \
                 bookkeeping), {} forgotten",
                fmt_bytes(m.peak_bytes as u64),
                fmt_bytes(m.bound_bytes as u64),
                m.forgotten
            )?;
        }
        write!(
            f,
            "\nleak check       {} tokens{} still held after the drain, {} sessions open, \
             accounting {}; invariant audits: {}",
            self.leaked_tokens,
            self.mamba.map_or(String::new(), |m| format!(
                " and {} Mamba slots",
                m.leaked_slots
            )) + &self.swa.map_or(String::new(), |s| format!(
                " and {} SWA pages",
                s.leaked_pages
            )),
            self.open_sessions_at_end,
            if self.accounting_balanced {
                "balanced"
            } else {
                "NOT BALANCED"
            },
            self.invariant_checks
        )?;
        let ts = &self.token_storage_peak;
        write!(
            f,
            "\ntoken storage    peak {} waiting ({} holding tokens, {:.1} MiB), {:.1} MiB running",
            ts.waiting_requests,
            ts.waiting_materialised,
            ts.waiting_bytes as f64 / 1048576.0,
            ts.running_bytes as f64 / 1048576.0
        )?;
        if let Some(m) = &self.memory {
            let mib = |kib: u64| kib as f64 / 1024.0;
            write!(
                f,
                "\nmemory (RSS)     start {:.1} MiB, after warm-up {:.1}, end {:.1}, process peak \
                 {:.1}; growth after warm-up {:+.1} MiB",
                mib(m.start_kib),
                mib(m.warm_kib()),
                mib(m.end_kib),
                mib(m.peak_kib),
                m.growth_after_warmup_kib() as f64 / 1024.0
            )?;
        }
        Ok(())
    }
}

/// The `q`-quantile (nearest rank) of sorted values; 0 for none.
pub(crate) fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_ratios() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
        let mut r = Report {
            prompt_tokens: 100,
            hit_tokens_device: 30,
            hit_tokens_host: 10,
            ideal_hit_tokens: 50,
            ..Default::default()
        };
        r.derive_ratios();
        assert!((r.hit_ratio.overall - 0.4).abs() < 1e-12);
        assert!((r.achieved_over_ideal - 0.8).abs() < 1e-12);
    }

    #[test]
    fn sizes_print_in_binary_units_and_counts_grouped() {
        assert_eq!(fmt_bytes(0), "0 B");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(2 << 20), "2 MiB");
        assert_eq!(fmt_bytes(128 << 30), "128 GiB");
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
        assert_eq!(fmt_bytes(u64::MAX), "16 EiB");
        assert_eq!(fmt_count(0), "0");
        assert_eq!(fmt_count(999), "999");
        assert_eq!(fmt_count(1000), "1,000");
        assert_eq!(fmt_count(15_205_203), "15,205,203");
    }

    #[test]
    fn a_tier_that_does_not_exist_is_not_printed() {
        let mut r = Report {
            config: "hicache".into(),
            ..Default::default()
        };
        r.page_bytes = r.effective_config.manager.model.page_bytes();
        let text = r.to_string();
        assert!(text.contains("device pool      1M tokens (65,536 pages, 128 GiB modeled)"));
        assert!(!text.contains("host"), "{text}");
        assert!(!text.contains("transfers"), "{text}");
        assert!(!text.contains("sessions  "), "{text}");
        r.effective_config.manager.cache =
            CacheKind::HiCache(radixkv_scheduler_api::config::HostTier::ratio(1 << 20, 4.0));
        r.page_bytes = r.effective_config.manager.model.page_bytes();
        let text = r.to_string();
        assert!(
            text.contains("host pool        4M tokens (262,144 pages, 512 GiB modeled)"),
            "{text}"
        );
        assert!(text.contains("transfers"), "{text}");
        assert!(r.table_row().split_whitespace().nth(3) != Some("-"));
        let radix = Report {
            config: "radix-lru".into(),
            ..Default::default()
        };
        assert_eq!(radix.table_row().split_whitespace().nth(3), Some("-"));
        assert_eq!(radix.table_row().split_whitespace().nth(6), Some("-"));
    }
}
