//! The replay report: what one configuration achieved on one trace.

use std::fmt;

use serde::Serialize;

use super::memory::MemoryUse;
use radixkv_scheduler_api::metrics::{Counters, ratio};

/// Token hit ratios per tier.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct TierRatios {
    /// Device tier.
    pub device: f64,
    /// Host tier.
    pub host: f64,
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
}

/// Cache-manager CPU time per request, by lifecycle phase (µs).
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
    /// `chunk_done`, `finish`, `begin_step` / `end_step`.
    pub complete_us: f64,
}

/// The result of replaying one trace under one configuration.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// Configuration label.
    pub config: String,
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
    /// Output tokens per simulated second.
    pub throughput_tok_s: f64,
    /// Requests per simulated second.
    pub throughput_req_s: f64,
    /// Scheduler steps.
    pub steps: u64,
    /// Wall-clock CPU time inside the cache manager per request (µs).
    pub cache_cpu_us_per_request: f64,
    /// The same, by lifecycle phase.
    pub cache_cpu_breakdown: CpuBreakdown,
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
    /// Device pool occupancy over time.
    pub occupancy: Vec<OccupancySample>,
    /// Manager counters at the end.
    pub counters: Counters,
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
            overall: ratio(d + h, p),
        };
        self.ideal_hit_ratio = ratio(self.ideal_hit_tokens, p);
        self.achieved_over_ideal = if self.ideal_hit_tokens == 0 {
            1.0
        } else {
            ratio(d + h, self.ideal_hit_tokens)
        };
    }

    /// Header of the comparison table.
    pub fn table_header() -> String {
        format!(
            "{:<34} {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>12} {:>10} {:>10} {:>10} {:>9} {:>8}",
            "config",
            "requests",
            "hit",
            "device",
            "host",
            "ideal",
            "/ideal",
            "recomputed",
            "xfer GB",
            "TTFT p50",
            "TTFT p99",
            "tok/s",
            "cpu µs/r"
        )
    }

    /// One row of the comparison table.
    pub fn table_row(&self) -> String {
        format!(
            "{:<34} {:>8} {:>7.4} {:>7.4} {:>7.4} {:>7.4} {:>7.3} {:>12} {:>10.1} {:>8.1}ms {:>8.1}ms {:>9.0} {:>8.2}",
            self.config,
            self.requests,
            self.hit_ratio.overall,
            self.hit_ratio.device,
            self.hit_ratio.host,
            self.ideal_hit_ratio,
            self.achieved_over_ideal,
            self.recomputed_tokens,
            (self.counters.transfers.bytes_loaded + self.counters.transfers.bytes_written) as f64
                / 1e9,
            self.ttft_p50_ms,
            self.ttft_p99_ms,
            self.throughput_tok_s,
            self.cache_cpu_us_per_request
        )
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.hit_ratio;
        writeln!(f, "trace            {}", self.trace)?;
        writeln!(f, "config           {}", self.config)?;
        writeln!(
            f,
            "requests         {} ({} prompt tokens, {} output tokens)",
            self.requests, self.prompt_tokens, self.output_tokens
        )?;
        writeln!(
            f,
            "token hit ratio  {:.4} overall (device {:.4}, host {:.4})",
            r.overall, r.device, r.host
        )?;
        writeln!(
            f,
            "ideal (∞ cache)  {:.4}   achieved/ideal {:.3}",
            self.ideal_hit_ratio, self.achieved_over_ideal
        )?;
        writeln!(
            f,
            "recomputed       {} tokens; evicted {} tokens; {} retractions",
            self.recomputed_tokens, self.counters.evicted_tokens, self.retractions
        )?;
        if self.never_fit > 0 {
            writeln!(
                f,
                "dropped          {} requests that can never fit the device pool",
                self.never_fit
            )?;
        }
        let t = &self.counters.transfers;
        writeln!(
            f,
            "transfers        {} pages / {} modeled bytes loaded, {} pages / {} modeled bytes written",
            t.pages_loaded, t.bytes_loaded, t.pages_written, t.bytes_written
        )?;
        writeln!(
            f,
            "TTFT (simulated) p50 {:.1} ms, p99 {:.1} ms",
            self.ttft_p50_ms, self.ttft_p99_ms
        )?;
        writeln!(
            f,
            "throughput       {:.0} output tok/s, {:.2} req/s over {:.1} s simulated ({} steps)",
            self.throughput_tok_s, self.throughput_req_s, self.sim_duration_s, self.steps
        )?;
        let b = &self.cache_cpu_breakdown;
        write!(
            f,
            "cache manager    {:.2} µs CPU per request (arrive {:.2}, admit {:.2}, extend {:.2}, \
             decode {:.2}, chunk/finish/step {:.2}); replay wall time {:.2} s",
            self.cache_cpu_us_per_request,
            b.arrive_us,
            b.admit_us,
            b.extend_us,
            b.decode_us,
            b.complete_us,
            self.wall_s
        )?;
        write!(
            f,
            "\nleak check       {} tokens still held after the drain, {} sessions open, \
             accounting {}; {} invariant audits",
            self.leaked_tokens,
            self.open_sessions_at_end,
            if self.accounting_balanced {
                "balanced"
            } else {
                "NOT BALANCED"
            },
            self.invariant_checks
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
}
