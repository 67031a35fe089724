//! Counters and gauges of a [`crate::KvCacheManager`], readable as a struct and exportable in
//! the Prometheus text exposition format.

use std::fmt::Write as _;

use radixkv_radix::PoolAccounting;

use crate::factory::StepTransfers;

/// Monotonic counters since the manager was built.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    /// Requests that arrived.
    pub arrived: u64,
    /// Admissions that succeeded (a retracted request is admitted again).
    pub admitted: u64,
    /// Admission attempts that had to wait (no room or no row).
    pub admission_waits: u64,
    /// Requests finished normally.
    pub finished: u64,
    /// Requests aborted.
    pub aborted: u64,
    /// Requests retracted (decode out of memory).
    pub retracted: u64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: u64,
    /// Prompt tokens reused from the device tier.
    pub hit_tokens_device: u64,
    /// Prompt tokens reused from the host tier (loaded back).
    pub hit_tokens_host: u64,
    /// Tokens allocated for prefill (recomputed).
    pub extend_tokens: u64,
    /// Tokens allocated for decode.
    pub decode_tokens: u64,
    /// Cached tokens evicted from the device tier to make room.
    pub evicted_tokens: u64,
    /// Allocations that failed even after eviction.
    pub out_of_memory: u64,
    /// Traffic between tiers (pages and modeled bytes, by direction).
    pub transfers: StepTransfers,
    /// Scheduler steps.
    pub steps: u64,
    /// KV events collected from the cache for routers.
    pub kv_events: u64,
    /// KV events dropped because the bounded event buffer was full (nobody drained it in
    /// time). A router that sees this move must resync its view of the cache.
    pub kv_events_dropped: u64,
    /// Idle sessions demoted by the manager to admit a request nothing else could make room
    /// for.
    pub session_demotions: u64,
}

/// Point-in-time values.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Gauges {
    /// Device pool capacity in tokens.
    pub pool_total_tokens: usize,
    /// Free device tokens.
    pub pool_free_tokens: usize,
    /// Cached, unlocked device tokens.
    pub pool_evictable_tokens: usize,
    /// Cached, locked device tokens.
    pub pool_protected_tokens: usize,
    /// Device tokens held by idle sessions.
    pub pool_session_held_tokens: usize,
    /// Device tokens owned by running requests.
    pub pool_request_owned_tokens: usize,
    /// Tokens reserved by admitted requests and not yet allocated.
    pub reserved_tokens: usize,
    /// Tokens resident on the host tier.
    pub host_tokens: usize,
    /// Requests waiting for admission.
    pub waiting_requests: usize,
    /// Admitted, unfinished requests.
    pub running_requests: usize,
    /// Sessions holding KV.
    pub held_sessions: usize,
}

impl Gauges {
    pub(crate) fn set_pool(&mut self, a: &PoolAccounting) {
        self.pool_total_tokens = a.total;
        self.pool_free_tokens = a.free;
        self.pool_evictable_tokens = a.evictable;
        self.pool_protected_tokens = a.protected;
        self.pool_session_held_tokens = a.session_held;
        self.pool_request_owned_tokens = a.request_owned;
    }
}

/// Counters and gauges together.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Metrics {
    /// Monotonic counters.
    pub counters: Counters,
    /// Current values.
    pub gauges: Gauges,
}

impl Metrics {
    /// Token hit ratio over admitted prompts, all tiers.
    pub fn hit_ratio(&self) -> f64 {
        let c = &self.counters;
        ratio(c.hit_tokens_device + c.hit_tokens_host, c.prompt_tokens)
    }

    /// The metrics in the Prometheus text exposition format (version 0.0.4), every name
    /// prefixed with `radixkv_`.
    pub fn to_prometheus(&self) -> String {
        let c = &self.counters;
        let g = &self.gauges;
        let mut out = String::with_capacity(4096);
        let mut family = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
            let _ = writeln!(out, "# HELP radixkv_{name} {help}");
            let _ = writeln!(out, "# TYPE radixkv_{name} {kind}");
            for (labels, v) in samples {
                if labels.is_empty() {
                    let _ = writeln!(out, "radixkv_{name} {v}");
                } else {
                    let _ = writeln!(out, "radixkv_{name}{{{labels}}} {v}");
                }
            }
        };
        family(
            "requests_total",
            "counter",
            "Request lifecycle events.",
            &[
                ("event=\"arrived\"", c.arrived),
                ("event=\"admitted\"", c.admitted),
                ("event=\"admission_wait\"", c.admission_waits),
                ("event=\"finished\"", c.finished),
                ("event=\"aborted\"", c.aborted),
                ("event=\"retracted\"", c.retracted),
            ],
        );
        family(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            &[("", c.prompt_tokens)],
        );
        family(
            "hit_tokens_total",
            "counter",
            "Prompt tokens reused from a cache tier.",
            &[
                ("tier=\"device\"", c.hit_tokens_device),
                ("tier=\"host\"", c.hit_tokens_host),
            ],
        );
        family(
            "allocated_tokens_total",
            "counter",
            "Tokens allocated on the device, by phase.",
            &[
                ("phase=\"extend\"", c.extend_tokens),
                ("phase=\"decode\"", c.decode_tokens),
            ],
        );
        family(
            "evicted_tokens_total",
            "counter",
            "Cached device tokens evicted to make room.",
            &[("", c.evicted_tokens)],
        );
        family(
            "out_of_memory_total",
            "counter",
            "Allocations that failed after eviction.",
            &[("", c.out_of_memory)],
        );
        family(
            "transfer_pages_total",
            "counter",
            "Pages moved between tiers.",
            &[
                ("direction=\"load\"", c.transfers.pages_loaded),
                ("direction=\"write\"", c.transfers.pages_written),
            ],
        );
        family(
            "transfer_bytes_total",
            "counter",
            "Bytes moved between tiers.",
            &[
                ("direction=\"load\"", c.transfers.bytes_loaded),
                ("direction=\"write\"", c.transfers.bytes_written),
            ],
        );
        family(
            "steps_total",
            "counter",
            "Scheduler steps.",
            &[("", c.steps)],
        );
        family(
            "session_demotions_total",
            "counter",
            "Idle sessions demoted to make room for an admission.",
            &[("", c.session_demotions)],
        );
        family(
            "kv_events_total",
            "counter",
            "KV events collected from the cache for routers.",
            &[("", c.kv_events)],
        );
        family(
            "kv_events_dropped_total",
            "counter",
            "KV events dropped because the event buffer was full; a router that sees this grow must resync.",
            &[("", c.kv_events_dropped)],
        );
        family(
            "pool_tokens",
            "gauge",
            "Device pool tokens by state.",
            &[
                ("state=\"total\"", g.pool_total_tokens as u64),
                ("state=\"free\"", g.pool_free_tokens as u64),
                ("state=\"evictable\"", g.pool_evictable_tokens as u64),
                ("state=\"protected\"", g.pool_protected_tokens as u64),
                ("state=\"session_held\"", g.pool_session_held_tokens as u64),
                (
                    "state=\"request_owned\"",
                    g.pool_request_owned_tokens as u64,
                ),
                ("state=\"reserved\"", g.reserved_tokens as u64),
            ],
        );
        family(
            "host_tokens",
            "gauge",
            "Tokens resident on the host tier.",
            &[("", g.host_tokens as u64)],
        );
        family(
            "requests",
            "gauge",
            "Requests by state.",
            &[
                ("state=\"waiting\"", g.waiting_requests as u64),
                ("state=\"running\"", g.running_requests as u64),
            ],
        );
        family(
            "held_sessions",
            "gauge",
            "Sessions holding KV.",
            &[("", g.held_sessions as u64)],
        );
        out
    }
}

/// `num / den`, 0 when `den` is 0.
pub fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_has_help_type_and_samples() {
        let mut m = Metrics::default();
        m.counters.hit_tokens_device = 42;
        m.gauges.pool_free_tokens = 7;
        let t = m.to_prometheus();
        assert!(t.contains("# TYPE radixkv_hit_tokens_total counter"));
        assert!(t.contains("radixkv_hit_tokens_total{tier=\"device\"} 42"));
        assert!(t.contains("radixkv_pool_tokens{state=\"free\"} 7"));
        // Every sample line belongs to a family announced before it.
        for line in t.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            assert!(t.contains(&format!("# TYPE {name} ")), "{name}");
        }
    }
}
