//! Counters, gauges and histograms of a [`crate::KvCacheManager`], readable as a struct and
//! exportable as OpenMetrics text (which Prometheus scrapes).
//!
//! Every value is measured where it happens; nothing is exported that the manager does not
//! observe. The histograms are the quantities that decide time to first token: how much of a
//! prompt was matched, how many pages a step loaded back from the host tier and how long the
//! forward blocked on them, and how many bytes a step moved between tiers.

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
    /// Prompt tokens the device KV matched, once per request at its first admission: equal to
    /// [`Counters::hit_tokens_device`] on a KV-only model; on a model with Mamba layers it also
    /// counts the matched KV past the deepest cached state, which is not usable.
    pub kv_match_tokens: u64,
    /// Mamba states the cache stored in the tree (checkpoints of every kind), as the cache
    /// counts them ([`radixkv_radix::MambaStats`]).
    pub mamba_states_stored: u64,
    /// Admissions that began on a cached Mamba state (a copy on write).
    pub mamba_state_hits: u64,
    /// Cached Mamba states evicted (for a slot, explicitly, or with their node's KV).
    pub mamba_states_evicted: u64,
    /// Checkpoints the Mamba policy did not take (admission refused them, or no slot).
    pub mamba_checkpoints_skipped: u64,
    /// Request-end Mamba states stored from a request's tracking slot (it finished off a page
    /// boundary; see [`Admitted::mamba_track`](crate::Admitted::mamba_track)); also counted in
    /// [`Counters::mamba_states_stored`].
    pub mamba_tracked_stored: u64,
    /// Admissions that got no tracking slot because none could be spared (such a request
    /// leaves a request-end state only where its computed length ends a page).
    pub mamba_tracks_skipped: u64,
    /// Sliding-window KV pages that running requests freed as their window slid past them
    /// (during decode, or between prefill chunks).
    pub swa_pages_slid_out: u64,
    /// Storage tier: prompt tokens of admitted requests that their prefetch brought from the
    /// store (once per request, at its first admission; also counted in
    /// [`Counters::hit_tokens_host`], the tier they were loaded back from).
    pub hit_tokens_storage: u64,
    /// Storage tier: admission attempts that waited for a prefetch
    /// ([`WaitReason::Prefetching`](crate::WaitReason::Prefetching); also counted in
    /// [`Counters::admission_waits`]).
    pub prefetch_waits: u64,
    /// Storage tier: tokens prefetches loaded from the store into the tree (as host KV).
    pub storage_loaded_tokens: u64,
    /// Storage tier: prefetches started (at arrival).
    pub prefetches_started: u64,
    /// Storage tier: prefetches that ended with nothing to load (the store's hit was below
    /// the threshold, the host had no room, the store failed, or it was ended during its
    /// lookup).
    pub prefetches_revoked: u64,
    /// Storage tier: prefetches ended by their timeout before every page arrived.
    pub prefetch_timeouts: u64,
    /// Storage tier: pages reserved for prefetches and returned unused (not arrived when the
    /// prefetch ended, or the request was aborted).
    pub prefetch_pages_revoked: u64,
    /// Storage tier: stored pages that failed their checks when fetched (each a miss).
    pub prefetch_pages_corrupt: u64,
    /// Storage tier: pages written to the store by backups.
    pub backup_pages_written: u64,
    /// Storage tier: pages a backup found in the store already.
    pub backup_pages_skipped: u64,
    /// Storage tier: pages a backup could not write (store error, timeout, refusal).
    pub backup_pages_failed: u64,
    /// Storage tier: store operations that failed (the store's own count).
    pub store_errors: u64,
}

impl Counters {
    pub(crate) fn set_storage(&mut self, st: &radixkv_hicache::HiCacheStats, store_errors: u64) {
        self.storage_loaded_tokens = st.storage_hit_tokens;
        self.prefetches_started = st.prefetches_started;
        self.prefetches_revoked = st.prefetches_revoked;
        self.prefetch_timeouts = st.prefetch_timeouts;
        self.prefetch_pages_revoked = st.prefetch_pages_revoked;
        self.prefetch_pages_corrupt = st.prefetch_pages_corrupt;
        self.backup_pages_written = st.backup_pages_written;
        self.backup_pages_skipped = st.backup_pages_skipped;
        self.backup_pages_failed = st.backup_pages_failed;
        self.store_errors = store_errors;
    }

    pub(crate) fn set_mamba(&mut self, st: &radixkv_radix::MambaStats) {
        let t = st.total();
        self.mamba_states_stored = t.stored;
        self.mamba_state_hits = t.hits;
        self.mamba_states_evicted = t.evicted;
        self.mamba_checkpoints_skipped = t.skipped;
        self.mamba_tracked_stored = st.tracked_stored;
        self.mamba_tracks_skipped = st.tracks_skipped;
    }
}

/// Point-in-time values.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Gauges {
    /// Device pool capacity in tokens: the sum of the five pool states below.
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
    /// Tokens reserved by admitted requests and not yet allocated (a claim on free and
    /// evictable tokens, not a pool state of its own).
    pub reserved_tokens: usize,
    /// Tokens resident on the host tier.
    pub host_tokens: usize,
    /// Requests waiting for admission.
    pub waiting_requests: usize,
    /// Admitted, unfinished requests.
    pub running_requests: usize,
    /// Sessions holding KV.
    pub held_sessions: usize,
    /// Mamba state slots in the pool (0 on a model without Mamba layers): the sum of the four
    /// slot states below.
    pub mamba_slots_total: usize,
    /// Free Mamba slots.
    pub mamba_slots_free: usize,
    /// Mamba slots held by running requests (each holds one).
    pub mamba_slots_request_owned: usize,
    /// Cached Mamba states no request has locked: evictable.
    pub mamba_slots_evictable: usize,
    /// Cached Mamba states locked by a request that copies from them.
    pub mamba_slots_protected: usize,
    /// Pages of the sliding-window KV pool (0 on a model without sliding-window layers): the
    /// sum of the four page states below.
    pub swa_pages_total: usize,
    /// Free SWA pages.
    pub swa_pages_free: usize,
    /// SWA pages owned by running requests (their window past their cached prefix).
    pub swa_pages_request_owned: usize,
    /// Cached window KV pages no request has locked: evictable (tombstoned first when the SWA
    /// pool is short; the nodes keep their full KV).
    pub swa_pages_evictable: usize,
    /// Cached window KV pages locked by running requests.
    pub swa_pages_protected: usize,
}

impl Gauges {
    pub(crate) fn set_mamba(&mut self, a: &radixkv_radix::ComponentAccounting) {
        self.mamba_slots_total = a.total;
        self.mamba_slots_free = a.free;
        self.mamba_slots_request_owned = a.request_owned;
        self.mamba_slots_evictable = a.evictable;
        self.mamba_slots_protected = a.protected;
    }

    pub(crate) fn set_swa(&mut self, a: &radixkv_radix::ComponentAccounting) {
        self.swa_pages_total = a.total;
        self.swa_pages_free = a.free;
        self.swa_pages_request_owned = a.request_owned;
        self.swa_pages_evictable = a.evictable;
        self.swa_pages_protected = a.protected;
    }

    pub(crate) fn set_pool(&mut self, a: &PoolAccounting) {
        self.pool_total_tokens = a.total;
        self.pool_free_tokens = a.free;
        self.pool_evictable_tokens = a.evictable;
        self.pool_protected_tokens = a.protected;
        self.pool_session_held_tokens = a.session_held;
        self.pool_request_owned_tokens = a.request_owned;
    }
}

/// The most finite buckets a [`Histogram`] has.
const MAX_BOUNDS: usize = 12;

/// A fixed-bucket histogram of integer observations (tokens, pages, bytes, nanoseconds).
///
/// Fixed-size storage keeps [`Metrics`] `Copy`: a snapshot is a plain copy, taken without
/// allocation on the scheduler thread.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Histogram {
    /// Inclusive upper bounds of the finite buckets, ascending.
    bounds: &'static [u64],
    /// Observations per bucket (not cumulative); the one past the last bound is `+Inf`.
    counts: [u64; MAX_BOUNDS + 1],
    sum: u64,
    count: u64,
}

impl Histogram {
    /// An empty histogram with the given finite bucket bounds (ascending, at most 12; extra
    /// ones are ignored).
    const fn new(bounds: &'static [u64]) -> Self {
        let bounds = if bounds.len() > MAX_BOUNDS {
            bounds.split_at(MAX_BOUNDS).0
        } else {
            bounds
        };
        Histogram {
            bounds,
            counts: [0; MAX_BOUNDS + 1],
            sum: 0,
            count: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, v: u64) {
        // The bounds below `v`, counted without a branch per bound: at most 12 of them, and
        // a manager observes two a step (a binary search's unpredictable branches cost more).
        let i = self
            .bounds
            .iter()
            .map(|&b| usize::from(b < v))
            .sum::<usize>();
        self.counts[i] += 1;
        self.sum = self.sum.saturating_add(v);
        self.count += 1;
    }

    /// Records `n` observations of 0 (the first bucket: every bound is at least 0).
    pub(crate) fn observe_zeros(&mut self, n: u64) {
        self.counts[0] += n;
        self.count += n;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of the observations (saturating).
    pub fn sum(&self) -> u64 {
        self.sum
    }

    /// `(upper bound, observations at or below it)` per bucket, cumulative as Prometheus
    /// reads them; the last bound is `None` (`+Inf`) and its count is [`Histogram::count`].
    pub fn cumulative(&self) -> impl Iterator<Item = (Option<u64>, u64)> + '_ {
        let bounds = self.bounds.iter().map(|&b| Some(b)).chain([None]);
        bounds.zip(&self.counts).scan(0u64, |acc, (b, &c)| {
            *acc += c;
            Some((b, *acc))
        })
    }
}

/// Token counts from a miss to a very long shared prefix.
const TOKEN_BOUNDS: &[u64] = &[0, 16, 64, 256, 1024, 4096, 16_384, 65_536, 262_144];
/// Pages per step, one page to a long prompt's worth.
const PAGE_BOUNDS: &[u64] = &[1, 4, 16, 64, 256, 1024, 4096, 16_384];
/// 64 KiB to 64 GiB in powers of 4.
const BYTE_BOUNDS: &[u64] = &[
    1 << 16,
    1 << 18,
    1 << 20,
    1 << 22,
    1 << 24,
    1 << 26,
    1 << 28,
    1 << 30,
    1 << 32,
    1 << 34,
    1 << 36,
];
/// 10 µs to 5 s, in nanoseconds.
const WAIT_NS_BOUNDS: &[u64] = &[
    10_000,
    100_000,
    1_000_000,
    5_000_000,
    10_000_000,
    50_000_000,
    100_000_000,
    500_000_000,
    1_000_000_000,
    5_000_000_000,
];

/// The histograms, each recorded by the manager where its quantity happens.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Histograms {
    /// Prompt tokens reused from any tier, once per request at its first admission (a
    /// retracted request re-matching its own pages is not reuse).
    pub match_tokens: Histogram,
    /// Pages a step loads back from the host tier, per step that loads any.
    pub step_load_pages: Histogram,
    /// Nanoseconds the forward blocked in [`crate::StepHandle::wait_layer`], summed over the
    /// layers, per step that loads any page.
    pub step_load_wait_ns: Histogram,
    /// Bytes loaded host → device whose transfer was acknowledged at a step's end, per step,
    /// with a host tier only (what [`crate::KvCacheManager::drain`] acknowledges outside a
    /// step is in the counters only).
    pub step_load_bytes: Histogram,
    /// Bytes written device → host, acknowledged as [`Histograms::step_load_bytes`].
    pub step_write_bytes: Histogram,
}

impl Default for Histograms {
    fn default() -> Self {
        Histograms {
            match_tokens: Histogram::new(TOKEN_BOUNDS),
            step_load_pages: Histogram::new(PAGE_BOUNDS),
            step_load_wait_ns: Histogram::new(WAIT_NS_BOUNDS),
            step_load_bytes: Histogram::new(BYTE_BOUNDS),
            step_write_bytes: Histogram::new(BYTE_BOUNDS),
        }
    }
}

/// Counters, gauges and histograms together.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Metrics {
    /// Monotonic counters.
    pub counters: Counters,
    /// Current values.
    pub gauges: Gauges,
    /// Distributions of the quantities that decide time to first token.
    pub histograms: Histograms,
}

/// The media type of [`Metrics::to_openmetrics`]'s text, for an HTTP `Content-Type` header.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Writes OpenMetrics text: each family's `# TYPE`, `# HELP` and (when it has one) `# UNIT`
/// lines, then its samples.
struct Writer {
    out: String,
}

impl Writer {
    fn header(&mut self, name: &str, kind: &str, unit: &str, help: &str) {
        let _ = writeln!(self.out, "# TYPE radixkv_{name} {kind}");
        if !unit.is_empty() {
            let _ = writeln!(self.out, "# UNIT radixkv_{name} {unit}");
        }
        let _ = writeln!(self.out, "# HELP radixkv_{name} {help}");
    }

    fn sample(&mut self, name: &str, suffix: &str, labels: &str, v: impl std::fmt::Display) {
        if labels.is_empty() {
            let _ = writeln!(self.out, "radixkv_{name}{suffix} {v}");
        } else {
            let _ = writeln!(self.out, "radixkv_{name}{suffix}{{{labels}}} {v}");
        }
    }

    /// A counter family `name` (samples `name_total`).
    fn counter(&mut self, name: &str, unit: &str, help: &str, samples: &[(&str, u64)]) {
        self.header(name, "counter", unit, help);
        for (labels, v) in samples {
            self.sample(name, "_total", labels, v);
        }
    }

    fn gauge(&mut self, name: &str, unit: &str, help: &str, samples: &[(&str, usize)]) {
        self.header(name, "gauge", unit, help);
        for (labels, v) in samples {
            self.sample(name, "", labels, v);
        }
    }

    /// A histogram family; each observation is divided by `scale` on export (nanoseconds
    /// recorded, seconds exported).
    fn histogram(&mut self, name: &str, unit: &str, help: &str, hs: &[(&str, &Histogram)]) {
        self.header(name, "histogram", unit, help);
        let scale = if unit == "seconds" { 1e9 } else { 1.0 };
        let num = |v: u64| {
            if scale == 1.0 {
                v.to_string()
            } else {
                (v as f64 / scale).to_string()
            }
        };
        for (labels, h) in hs {
            let sep = if labels.is_empty() { "" } else { "," };
            for (bound, n) in h.cumulative() {
                let le = bound.map_or_else(|| "+Inf".to_string(), num);
                self.sample(name, "_bucket", &format!("{labels}{sep}le=\"{le}\""), n);
            }
            self.sample(name, "_count", labels, h.count());
            self.sample(name, "_sum", labels, num(h.sum()));
        }
    }
}

impl Metrics {
    /// Token hit ratio over admitted prompts, all tiers.
    pub fn hit_ratio(&self) -> f64 {
        let c = &self.counters;
        ratio(c.hit_tokens_device + c.hit_tokens_host, c.prompt_tokens)
    }

    /// The metrics as OpenMetrics 1.0 text (serve it as [`OPENMETRICS_CONTENT_TYPE`]), every
    /// name prefixed with `radixkv_`, ending with `# EOF`.
    ///
    /// The device pool's `radixkv_pool_tokens{state}` samples add up to
    /// `radixkv_pool_capacity_tokens`; reservations are a separate gauge because they are a
    /// claim on free and evictable tokens, not a state of their own.
    pub fn to_openmetrics(&self) -> String {
        let c = &self.counters;
        let g = &self.gauges;
        let h = &self.histograms;
        let mut w = Writer {
            out: String::with_capacity(8192),
        };
        w.counter(
            "requests",
            "",
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
        w.counter(
            "prompt_tokens",
            "tokens",
            "Prompt tokens of admitted requests.",
            &[("", c.prompt_tokens)],
        );
        w.counter(
            "hit_tokens",
            "tokens",
            "Prompt tokens reused from a cache tier.",
            &[
                ("tier=\"device\"", c.hit_tokens_device),
                ("tier=\"host\"", c.hit_tokens_host),
            ],
        );
        w.counter(
            "storage_hit_tokens",
            "tokens",
            "Prompt tokens the storage tier prefetched into the host tier (also in hit_tokens tier=host).",
            &[("", c.hit_tokens_storage)],
        );
        w.counter(
            "storage_prefetches",
            "",
            "Storage-tier prefetches, by outcome.",
            &[
                ("event=\"started\"", c.prefetches_started),
                ("event=\"revoked\"", c.prefetches_revoked),
                ("event=\"timed_out\"", c.prefetch_timeouts),
                ("event=\"admission_wait\"", c.prefetch_waits),
            ],
        );
        w.counter(
            "storage_pages",
            "pages",
            "Storage-tier pages, by outcome.",
            &[
                ("event=\"backup_written\"", c.backup_pages_written),
                ("event=\"backup_skipped\"", c.backup_pages_skipped),
                ("event=\"backup_failed\"", c.backup_pages_failed),
                ("event=\"prefetch_revoked\"", c.prefetch_pages_revoked),
                ("event=\"prefetch_corrupt\"", c.prefetch_pages_corrupt),
            ],
        );
        w.counter(
            "store_errors",
            "",
            "Store operations of the storage tier that failed.",
            &[("", c.store_errors)],
        );
        w.counter(
            "allocated_tokens",
            "tokens",
            "Tokens allocated on the device, by phase.",
            &[
                ("phase=\"extend\"", c.extend_tokens),
                ("phase=\"decode\"", c.decode_tokens),
            ],
        );
        w.counter(
            "evicted_tokens",
            "tokens",
            "Cached device tokens evicted to make room.",
            &[("", c.evicted_tokens)],
        );
        w.counter(
            "out_of_memory",
            "",
            "Allocations that failed after eviction.",
            &[("", c.out_of_memory)],
        );
        w.counter(
            "transfer_pages",
            "pages",
            "Pages moved between tiers.",
            &[
                ("direction=\"load\"", c.transfers.pages_loaded),
                ("direction=\"write\"", c.transfers.pages_written),
            ],
        );
        w.counter(
            "transfer_bytes",
            "bytes",
            "Bytes moved between tiers (pages times the model's page bytes).",
            &[
                ("direction=\"load\"", c.transfers.bytes_loaded),
                ("direction=\"write\"", c.transfers.bytes_written),
            ],
        );
        w.counter("steps", "", "Scheduler steps.", &[("", c.steps)]);
        w.counter(
            "session_demotions",
            "",
            "Idle sessions demoted to make room for an admission.",
            &[("", c.session_demotions)],
        );
        w.counter(
            "kv_events",
            "",
            "KV events collected from the cache for routers.",
            &[("", c.kv_events)],
        );
        w.counter(
            "kv_events_dropped",
            "",
            "KV events dropped because the event buffer was full; a router that sees this grow must resync.",
            &[("", c.kv_events_dropped)],
        );
        w.gauge(
            "pool_tokens",
            "tokens",
            "Device pool tokens by state; the states add up to the capacity.",
            &[
                ("state=\"free\"", g.pool_free_tokens),
                ("state=\"evictable\"", g.pool_evictable_tokens),
                ("state=\"protected\"", g.pool_protected_tokens),
                ("state=\"session_held\"", g.pool_session_held_tokens),
                ("state=\"request_owned\"", g.pool_request_owned_tokens),
            ],
        );
        w.gauge(
            "pool_capacity_tokens",
            "tokens",
            "Device pool capacity.",
            &[("", g.pool_total_tokens)],
        );
        w.gauge(
            "reserved_tokens",
            "tokens",
            "Tokens reserved by admitted requests and not yet allocated.",
            &[("", g.reserved_tokens)],
        );
        w.gauge(
            "host_tokens",
            "tokens",
            "Tokens resident on the host tier.",
            &[("", g.host_tokens)],
        );
        w.gauge(
            "tracked_requests",
            "",
            "Requests the manager tracks, by state.",
            &[
                ("state=\"waiting\"", g.waiting_requests),
                ("state=\"running\"", g.running_requests),
            ],
        );
        w.gauge(
            "held_sessions",
            "",
            "Sessions holding KV.",
            &[("", g.held_sessions)],
        );
        if g.mamba_slots_total > 0 {
            w.counter(
                "kv_match_tokens",
                "tokens",
                "Prompt tokens the device KV matched, usable or not (past the deepest Mamba state).",
                &[("", c.kv_match_tokens)],
            );
            w.counter(
                "mamba_states",
                "",
                "Cached Mamba states by event.",
                &[
                    ("event=\"stored\"", c.mamba_states_stored),
                    ("event=\"hit\"", c.mamba_state_hits),
                    ("event=\"evicted\"", c.mamba_states_evicted),
                    ("event=\"skipped\"", c.mamba_checkpoints_skipped),
                ],
            );
            w.counter(
                "mamba_tracking",
                "",
                "Mamba tracking slots: request-end states stored from one, admissions without one.",
                &[
                    ("event=\"stored\"", c.mamba_tracked_stored),
                    ("event=\"skipped\"", c.mamba_tracks_skipped),
                ],
            );
            w.gauge(
                "mamba_slots",
                "",
                "Mamba state slots by state; the states add up to the capacity.",
                &[
                    ("state=\"free\"", g.mamba_slots_free),
                    ("state=\"request_owned\"", g.mamba_slots_request_owned),
                    ("state=\"evictable\"", g.mamba_slots_evictable),
                    ("state=\"protected\"", g.mamba_slots_protected),
                ],
            );
            w.gauge(
                "mamba_slot_capacity",
                "",
                "Mamba state slots in the pool.",
                &[("", g.mamba_slots_total)],
            );
        }
        if g.swa_pages_total > 0 {
            w.counter(
                "swa_pages_slid_out",
                "pages",
                "Sliding-window KV pages freed as request windows slid past them.",
                &[("", c.swa_pages_slid_out)],
            );
            w.gauge(
                "swa_pages",
                "pages",
                "Sliding-window KV pages by state; the states add up to the capacity.",
                &[
                    ("state=\"free\"", g.swa_pages_free),
                    ("state=\"request_owned\"", g.swa_pages_request_owned),
                    ("state=\"evictable\"", g.swa_pages_evictable),
                    ("state=\"protected\"", g.swa_pages_protected),
                ],
            );
            w.gauge(
                "swa_page_capacity",
                "pages",
                "Pages in the sliding-window KV pool.",
                &[("", g.swa_pages_total)],
            );
        }
        w.histogram(
            "prefix_match_tokens",
            "tokens",
            "Prompt tokens reused from any tier, per request at its first admission.",
            &[("", &h.match_tokens)],
        );
        w.histogram(
            "step_load_pages",
            "pages",
            "Pages loaded back from the host tier, per step that loads any.",
            &[("", &h.step_load_pages)],
        );
        w.histogram(
            "step_load_wait_seconds",
            "seconds",
            "Time the forward blocked waiting for loaded layers, per step that loads any.",
            &[("", &h.step_load_wait_ns)],
        );
        w.histogram(
            "step_transfer_bytes",
            "bytes",
            "Bytes moved between tiers per step.",
            &[
                ("direction=\"load\"", &h.step_load_bytes),
                ("direction=\"write\"", &h.step_write_bytes),
            ],
        );
        w.out.push_str("# EOF\n");
        w.out
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
    fn histogram_buckets_are_inclusive_and_cumulative() {
        let mut h = Histogram::new(&[1, 4, 16]);
        for v in [0, 1, 2, 4, 5, 100] {
            h.observe(v);
        }
        let c: Vec<_> = h.cumulative().collect();
        assert_eq!(
            c,
            vec![(Some(1), 2), (Some(4), 4), (Some(16), 5), (None, 6)]
        );
        assert_eq!((h.count(), h.sum()), (6, 112));
    }

    #[test]
    fn seconds_are_exported_from_nanoseconds() {
        let mut m = Metrics::default();
        m.histograms.step_load_wait_ns.observe(2_000_000);
        let t = m.to_openmetrics();
        assert!(
            t.contains("radixkv_step_load_wait_seconds_bucket{le=\"0.005\"} 1\n"),
            "{t}"
        );
        assert!(t.contains("radixkv_step_load_wait_seconds_bucket{le=\"0.001\"} 0\n"));
        assert!(t.contains("radixkv_step_load_wait_seconds_sum 0.002\n"));
        assert!(t.contains("# UNIT radixkv_step_load_wait_seconds seconds\n"));
    }
}
