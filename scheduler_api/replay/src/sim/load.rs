//! How hard a workload drives the simulated GPU, and the arrival timing that sets it.
//!
//! A replay measures a cache only while the simulated server keeps up with its arrivals: past
//! that, requests queue for hours and the figures describe the queue. Two resources bound
//! the server, and the load is the busier of the two:
//!
//! - **compute**: prefill of the tokens the cache does not supply plus each sequence's share of
//!   decode, per unit of time;
//! - **KV memory**: the share of the device pool the running requests hold.
//!
//! **Estimated** before the replay from the trace alone: each request runs as if alone from its
//! arrival (prefill of what the infinite-cache ideal does not reuse, then one decode step per
//! output token at the fixed step cost), holding its tokens meanwhile. That gives the load
//! offered at every instant; averaged over one-minute windows, the estimate is the level that
//! 99 % of the offered work sees at most (a busy stretch counts however quiet the rest of the
//! trace is: an agentic trace's last conversation may run for a day after the others ended, so
//! a mean over the whole span says nothing). Running alone is the fastest a request can run, so the measured memory load can
//! come out higher than the estimate, and the compute estimate assumes ideal hits.
//!
//! **Timing**: a conversation keeps its own timing (its turns' offsets from its first request,
//! which include its user's or agent's think time), and the *arrival scale* `s` spreads the
//! conversations' starts (`s > 1`: further apart); a request outside any conversation is a
//! conversation of its own. `--load` searches the scale whose estimate is the target.
//!
//! **Measured** during the replay with the same statistic over the steps that ran (see
//! [`LoadReport`]).

use std::borrow::Cow;

use ahash::HashMap;
use serde::Serialize;

use super::SimConfig;
use crate::trace::Trace;
use radixkv_scheduler_api::error::{ManagerError, Result};

/// How a replay times its arrivals.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arrivals {
    /// The workload's own arrival times.
    #[default]
    Trace,
    /// The conversations' starts spread by this factor around the first arrival (`> 1`:
    /// further apart, `< 1`: closer); each conversation keeps its own timing.
    Scale(f64),
    /// Spread so that the estimated load of the simulated GPU is this (see the module docs):
    /// `0.7` keeps a server busy but not saturated.
    Load(f64),
}

impl Arrivals {
    /// Checks the factor or the load: positive and finite.
    ///
    /// # Errors
    /// [`ManagerError::Config`] naming the value.
    pub fn validate(&self) -> Result<()> {
        match *self {
            Arrivals::Trace => Ok(()),
            Arrivals::Scale(s) if s.is_finite() && s > 0.0 => Ok(()),
            Arrivals::Load(l) if l.is_finite() && l > 0.0 => Ok(()),
            Arrivals::Scale(s) => Err(ManagerError::Config(format!(
                "the arrival scale must be a positive number, not {s}"
            ))),
            Arrivals::Load(l) => Err(ManagerError::Config(format!(
                "the target load must be a positive number, not {l}"
            ))),
        }
    }
}

/// The window the offered load is averaged over (µs).
const WINDOW_US: f64 = 60e6;
/// The share of the work whose window load the load figures bound.
const WORK_QUANTILE: f64 = 0.99;
/// The arrival scales `--load` searches between.
const SCALE_RANGE: (f64, f64) = (1e-4, 1e4);

/// What each request asks of the simulated GPU, run alone: the input of the load estimate.
#[derive(Clone, Debug)]
pub struct LoadEstimate {
    /// Per request: its arrival at the workload's timing (µs), its conversation's start (µs),
    /// its residence running alone (µs), its compute time (µs) and the tokens it holds.
    jobs: Vec<Job>,
    /// Tokens of the device KV pool.
    pool_tokens: f64,
}

#[derive(Copy, Clone, Debug)]
struct Job {
    arrival_us: f64,
    start_us: f64,
    residence_us: f64,
    compute_us: f64,
    held: f64,
}

/// The first arrival of each conversation of `trace` (requests outside one: their own).
fn starts(trace: &Trace) -> Vec<f64> {
    let mut first: HashMap<u64, u64> = HashMap::default();
    for r in &trace.requests {
        if let Some(s) = r.session {
            let e = first.entry(s).or_insert(r.arrival_us);
            *e = (*e).min(r.arrival_us);
        }
    }
    trace
        .requests
        .iter()
        .map(|r| r.session.map_or(r.arrival_us, |s| first[&s]) as f64)
        .collect()
}

/// `arrival` with its conversation's `start` spread by `scale` around `origin`.
fn spread(arrival: f64, start: f64, origin: f64, scale: f64) -> f64 {
    origin + (start - origin) * scale + (arrival - start)
}

impl LoadEstimate {
    /// Estimates `trace` under `cfg`, with `ideal` the per-request infinite-cache hits.
    pub fn of(trace: &Trace, cfg: &SimConfig, ideal: &[u64]) -> Self {
        let cost = &cfg.cost;
        let model = &cfg.manager.model;
        let step_us = cost.decode_step_us + cost.decode_us_per_seq;
        let jobs = trace
            .requests
            .iter()
            .zip(ideal)
            .zip(starts(trace))
            .map(|((r, &hit), start_us)| {
                let hit = hit.min(r.prompt_len);
                let prefill_us = if model.compute.is_some() {
                    let flops = |n: u64| model.prefill_flops(n).map_or(0.0, |f| f as f64);
                    cost.prefill_us_of_flops((flops(r.prompt_len) - flops(hit)).max(0.0))
                } else {
                    cost.prefill_us((r.prompt_len - hit) as usize)
                };
                let out = f64::from(r.output_len);
                Job {
                    arrival_us: r.arrival_us as f64,
                    start_us,
                    residence_us: (prefill_us + out * step_us).max(1.0),
                    compute_us: prefill_us + out * cost.decode_us_per_seq,
                    held: r.prompt_len as f64 + out / 2.0,
                }
            })
            .collect();
        LoadEstimate {
            jobs,
            pool_tokens: cfg.manager.device_tokens.max(1) as f64,
        }
    }

    /// The estimated (compute, memory) loads with the conversations' starts spread by `scale`:
    /// each the level that 99 % of its offered work sees at most, over one-minute windows.
    pub fn at(&self, scale: f64) -> (f64, f64) {
        let origin = self.jobs.first().map_or(0.0, |j| j.arrival_us);
        // Each request offers its compute rate and its share of the pool while it runs.
        let mut events: Vec<(f64, f64, f64)> = Vec::with_capacity(2 * self.jobs.len());
        for j in &self.jobs {
            let t = spread(j.arrival_us, j.start_us, origin, scale);
            let rate = j.compute_us / j.residence_us;
            let share = j.held / self.pool_tokens;
            events.push((t, rate, share));
            events.push((t + j.residence_us, -rate, -share));
        }
        events.sort_by(|a, b| a.0.total_cmp(&b.0));
        // Integrate both piecewise-constant loads per window.
        let mut windows: Vec<(f64, f64)> = Vec::new();
        let (mut rate, mut share) = (0.0, 0.0);
        let Some(&(t0, ..)) = events.first() else {
            return (0.0, 0.0);
        };
        let mut t = t0;
        for &(at, dr, ds) in &events {
            while t < at {
                let w = ((t - t0) / WINDOW_US) as usize;
                let end = (t0 + (w + 1) as f64 * WINDOW_US).min(at);
                if windows.len() <= w {
                    windows.resize(w + 1, (0.0, 0.0));
                }
                windows[w].0 += rate * (end - t) / WINDOW_US;
                windows[w].1 += share * (end - t) / WINDOW_US;
                t = end;
            }
            rate += dr;
            share += ds;
        }
        (
            work_quantile(windows.iter().map(|w| w.0).collect()),
            work_quantile(windows.iter().map(|w| w.1).collect()),
        )
    }

    /// The busier resource's estimated load at `scale`.
    fn load_at(&self, scale: f64) -> f64 {
        let (c, m) = self.at(scale);
        c.max(m)
    }

    /// The arrival scale whose estimated load is `load`, searched between 10⁻⁴ and 10⁴: the
    /// largest scale (the conversations' starts spread the most) is `Err` with the load it
    /// still gives when that is above the target (one conversation alone is that busy); the
    /// smallest scale when even that stays below the target.
    pub fn scale_for(&self, load: f64) -> std::result::Result<f64, f64> {
        let (mut lo, mut hi) = (SCALE_RANGE.0.ln(), SCALE_RANGE.1.ln());
        let floor = self.load_at(hi.exp());
        if floor > load {
            return Err(floor);
        }
        if self.load_at(SCALE_RANGE.0) <= load {
            return Ok(SCALE_RANGE.0);
        }
        // The load falls as the scale grows: bisect on the logarithm of the scale.
        for _ in 0..60 {
            let mid = f64::midpoint(lo, hi);
            if self.load_at(mid.exp()) > load {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok(hi.exp())
    }
}

/// The level that `WORK_QUANTILE` of the work in `loads` (per-window mean loads, each window's
/// work being its load) sees at most.
fn work_quantile(mut loads: Vec<f64>) -> f64 {
    loads.sort_by(f64::total_cmp);
    let total: f64 = loads.iter().sum();
    if total <= 0.0 {
        return 0.0;
    }
    let mut seen = 0.0;
    for &l in &loads {
        seen += l;
        if seen >= WORK_QUANTILE * total {
            return l;
        }
    }
    loads.last().copied().unwrap_or(0.0)
}

/// How the replay timed its arrivals and how hard it drove the simulated GPU.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize)]
pub struct LoadReport {
    /// The factor the conversations' starts were spread by (1: the workload's own timing).
    pub arrival_scale: f64,
    /// The load asked for (`--load`), if the scale was picked for one.
    pub target_load: Option<f64>,
    /// Estimated compute load at that scale (see the module docs).
    pub estimated_compute: f64,
    /// Estimated KV-memory load at that scale.
    pub estimated_memory: f64,
    /// Measured compute load: the prefill and per-sequence decode time of the steps that ran,
    /// per one-minute window; the level that 99 % of that time sees at most.
    pub compute: f64,
    /// Measured KV-memory load: the device pool's share held by requests (locked or owned),
    /// per one-minute window; the level that 99 % of the held token-time sees at most.
    pub memory: f64,
}

/// The measured side of [`LoadReport`]: what the replay's steps did, per one-minute window of
/// simulated time.
#[derive(Debug, Default)]
pub(super) struct LoadMeter {
    origin: Option<f64>,
    /// Per window: compute time (µs) and held token-time (token·µs).
    windows: Vec<(f64, f64)>,
}

impl LoadMeter {
    /// A step that started at `t_us` and took `dt_us`, with `compute_us` of prefill and
    /// per-sequence decode, while requests held `held` device tokens (charged to the window the
    /// step started in: steps are far shorter than a window).
    pub(super) fn step(&mut self, t_us: f64, dt_us: f64, compute_us: f64, held: usize) {
        let origin = *self.origin.get_or_insert(t_us);
        let w = ((t_us - origin).max(0.0) / WINDOW_US) as usize;
        if self.windows.len() <= w {
            self.windows.resize(w + 1, (0.0, 0.0));
        }
        self.windows[w].0 += compute_us;
        self.windows[w].1 += held as f64 * dt_us;
    }

    /// The measured (compute, memory) loads on a pool of `pool_tokens`.
    pub(super) fn loads(&self, pool_tokens: usize) -> (f64, f64) {
        let pool = pool_tokens.max(1) as f64;
        (
            work_quantile(self.windows.iter().map(|w| w.0 / WINDOW_US).collect()),
            work_quantile(
                self.windows
                    .iter()
                    .map(|w| w.1 / (pool * WINDOW_US))
                    .collect(),
            ),
        )
    }
}

impl std::fmt::Display for LoadReport {
    /// `compute 0.12, KV memory 0.68 of the simulated GPU (estimated ...; ...)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "compute {:.2}, KV memory {:.2} of the simulated GPU (busiest minutes; estimated \
             {:.2} / {:.2}",
            self.compute, self.memory, self.estimated_compute, self.estimated_memory
        )?;
        let scale = scale_text(self.arrival_scale);
        match self.target_load {
            // `scale_for`'s smallest scale: even the starts packed that close stay under the
            // target (the conversations' own timing bounds the load).
            Some(l) if self.arrival_scale == SCALE_RANGE.0 => write!(
                f,
                "; conversation starts packed ×{scale}, the closest the load control goes, \
                 and the load stays under {l})"
            ),
            Some(l) => write!(f, "; conversation starts spread ×{scale} for load {l})"),
            None if self.arrival_scale == 1.0 => write!(f, "; the workload's own timing)"),
            None => write!(f, "; conversation starts spread ×{scale})"),
        }
    }
}

/// An arrival scale with three decimals, or in scientific notation when those would show
/// nothing (`scale_for` goes down to 10⁻⁴).
fn scale_text(scale: f64) -> String {
    if scale >= 0.01 {
        format!("{scale:.3}")
    } else {
        format!("{scale:.1e}")
    }
}

/// `trace` timed as `cfg.arrivals` asks (as given when that is its own timing), the report's
/// estimate fields, and, for a trace left as given, its infinite-cache ideal at `cfg`'s page
/// size (the estimate needed it; a retimed trace's order, and so its ideal, may differ). A
/// retiming rewrites an owned trace's arrivals in place; a borrowed one is copied first.
///
/// # Errors
/// [`ManagerError::Config`] for a bad factor or load, or a target load that no spread of the
/// conversations reaches.
pub(super) fn retime<'t>(
    trace: Cow<'t, Trace>,
    cfg: &SimConfig,
) -> Result<(Cow<'t, Trace>, LoadReport, Option<Vec<u64>>)> {
    cfg.arrivals.validate()?;
    let ideal = super::scheduler::ideal_hits(&trace, cfg.manager.model.page_size);
    let est = LoadEstimate::of(&trace, cfg, &ideal);
    let (scale, target_load) = match cfg.arrivals {
        Arrivals::Trace => (1.0, None),
        Arrivals::Scale(s) => (s, None),
        Arrivals::Load(l) => {
            let s = est.scale_for(l).map_err(|floor| {
                ManagerError::Config(format!(
                    "a load of {l} is out of reach: with the conversations' starts spread \
                     {}× the busiest stretches still load the simulated GPU {floor:.2}",
                    SCALE_RANGE.1
                ))
            })?;
            (s, Some(l))
        }
    };
    let (c, m) = est.at(scale);
    let report = LoadReport {
        arrival_scale: scale,
        target_load,
        estimated_compute: c,
        estimated_memory: m,
        ..Default::default()
    };
    if scale == 1.0 {
        return Ok((trace, report, Some(ideal)));
    }
    let origin = trace.requests.first().map_or(0, |r| r.arrival_us) as f64;
    let starts = starts(&trace);
    // A borrowed trace is copied here; an owned one (a whole agentic trace is a few MB of
    // requests and segments) is retimed where it is.
    let mut timed = trace.into_owned();
    for (r, start) in timed.requests.iter_mut().zip(starts) {
        r.arrival_us = spread(r.arrival_us as f64, start, origin, scale).max(0.0) as u64;
    }
    // Stable: requests of one conversation keep their order.
    timed.requests.sort_by_key(|r| r.arrival_us);
    Ok((Cow::Owned(timed), report, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Segment, TraceRequest};

    /// Requests at `arrivals_s` (seconds), each in conversation `session[i]`.
    fn trace(arrivals_s: &[u64], sessions: &[Option<u64>], prompt: u64, output: u32) -> Trace {
        Trace {
            name: "t".into(),
            requests: arrivals_s
                .iter()
                .zip(sessions)
                .enumerate()
                .map(|(i, (&a, &session))| TraceRequest {
                    arrival_us: a * 1_000_000,
                    prompt: vec![Segment {
                        first: i as u64 * 1000,
                        block: 16,
                        len: prompt,
                    }],
                    prompt_len: prompt,
                    output_len: output,
                    output_id: 1 << 60 | i as u64,
                    session,
                })
                .collect(),
            conversations_disjoint: false,
        }
    }

    fn cfg(arrivals: Arrivals) -> SimConfig {
        let mut c = SimConfig {
            arrivals,
            ..SimConfig::default()
        };
        c.manager.device_tokens = 100_000;
        c
    }

    #[test]
    fn one_request_alone_offers_its_cost_for_its_residence() {
        // One request every 10 minutes: each window sees at most one.
        let t = trace(&[0, 600, 1200], &[None; 3], 50_000, 1000);
        let c = cfg(Arrivals::Trace);
        let e = LoadEstimate::of(&t, &c, &[0; 3]);
        let cost = c.cost;
        let residence =
            cost.prefill_us(50_000) + 1000.0 * (cost.decode_step_us + cost.decode_us_per_seq);
        assert!(
            residence < WINDOW_US,
            "the test needs a request shorter than a window"
        );
        let compute = cost.prefill_us(50_000) + 1000.0 * cost.decode_us_per_seq;
        let (cl, ml) = e.at(1.0);
        // The busiest windows hold one whole request.
        assert!((cl - compute / WINDOW_US).abs() < 1e-9, "{cl}");
        let share = (50_000.0 + 500.0) / 100_000.0;
        assert!((ml - share * residence / WINDOW_US).abs() < 1e-9, "{ml}");
        // What the ideal reuses is not recomputed.
        let (cl2, _) = LoadEstimate::of(&t, &c, &[40_000; 3]).at(1.0);
        assert!(cl2 < cl);
    }

    #[test]
    fn the_scale_for_a_load_gives_that_load_and_spreads_only_starts() {
        // Twenty conversations of three turns 30 s apart, all starting within 20 s.
        let mut at = Vec::new();
        let mut sess = Vec::new();
        for c in 0..20u64 {
            for k in 0..3 {
                at.push(c + 30 * k);
                sess.push(Some(c));
            }
        }
        let mut order: Vec<usize> = (0..at.len()).collect();
        order.sort_by_key(|&i| at[i]);
        let at: Vec<u64> = order.iter().map(|&i| at[i]).collect();
        let sess: Vec<Option<u64>> = order.iter().map(|&i| sess[i]).collect();
        let t = trace(&at, &sess, 20_000, 200);
        let c = cfg(Arrivals::Load(0.3));
        let e = LoadEstimate::of(&t, &c, &[0; 60]);
        assert!(e.load_at(1.0) > 0.3, "the test needs an overloaded trace");
        let s = e.scale_for(0.3).unwrap();
        assert!(s > 1.0);
        assert!((e.load_at(s) - 0.3).abs() < 1e-3, "{}", e.load_at(s));
        let (timed, report, ideal) = retime((&t).into(), &c).unwrap();
        assert!(ideal.is_none(), "a retimed trace needs its own ideal");
        assert_eq!((report.arrival_scale, report.target_load), (s, Some(0.3)));
        // Each conversation keeps its turns 30 s apart; the starts are spread by the scale.
        for conv in 0..20u64 {
            let times: Vec<u64> = timed
                .requests
                .iter()
                .filter(|r| r.session == Some(conv))
                .map(|r| r.arrival_us)
                .collect();
            assert_eq!(times.len(), 3);
            assert_eq!(times[1] - times[0], 30_000_000, "conversation {conv}");
            assert_eq!(times[2] - times[1], 30_000_000, "conversation {conv}");
            let want = (conv as f64 * 1e6 * s) as u64;
            assert!(times[0].abs_diff(want) <= 1, "{} vs {want}", times[0]);
        }
        assert!(
            timed
                .requests
                .windows(2)
                .all(|w| w[0].arrival_us <= w[1].arrival_us)
        );
    }

    #[test]
    fn a_given_trace_is_retimed_in_place_and_a_lent_one_copied_the_same() {
        let at: Vec<u64> = (0..30).collect();
        let sess: Vec<Option<u64>> = (0..30).map(|i| Some(i % 10)).collect();
        let t = trace(&at, &sess, 20_000, 200);
        let c = cfg(Arrivals::Scale(3.0));
        let (lent, ..) = retime((&t).into(), &c).unwrap();
        assert!(matches!(lent, Cow::Owned(_)));
        assert_ne!(
            lent.requests, t.requests,
            "the scale must move some arrivals"
        );
        let given = t.clone();
        let buffer = given.requests.as_ptr();
        let (given, ..) = retime(given.into(), &c).unwrap();
        // The same requests in the same order, in the very list that was given: not a copy.
        assert_eq!(given.requests, lent.requests);
        assert_eq!(given.requests.as_ptr(), buffer);
    }

    #[test]
    fn a_conversation_too_busy_alone_makes_a_load_out_of_reach() {
        // One conversation whose turns overlap: no spread of starts thins it out.
        let t = trace(&[0, 1, 2, 3], &[Some(7); 4], 90_000, 2000);
        let c = cfg(Arrivals::Load(0.1));
        let e = LoadEstimate::of(&t, &c, &[0; 4]);
        assert!(e.scale_for(0.1).is_err());
        assert!(matches!(
            retime((&t).into(), &c),
            Err(ManagerError::Config(_))
        ));
        // Its own timing still replays, borrowed and unchanged.
        let (timed, r, ideal) = retime((&t).into(), &cfg(Arrivals::Trace)).unwrap();
        assert_eq!(ideal.map(|i| i.len()), Some(4));
        assert!(matches!(timed, Cow::Borrowed(_)));
        assert_eq!((r.arrival_scale, r.target_load), (1.0, None));
    }

    #[test]
    fn the_report_says_when_the_starts_cannot_be_packed_closer() {
        let report = |scale: f64| LoadReport {
            arrival_scale: scale,
            target_load: Some(0.7),
            estimated_compute: 0.29,
            estimated_memory: 0.35,
            ..Default::default()
        };
        let at_floor = report(SCALE_RANGE.0).to_string();
        assert!(
            at_floor.contains(
                "packed ×1.0e-4, the closest the load control goes, and the load stays under 0.7"
            ),
            "{at_floor}"
        );
        let spread = report(4.4871).to_string();
        assert!(spread.ends_with("spread ×4.487 for load 0.7)"), "{spread}");
        let small = LoadReport {
            arrival_scale: 0.002,
            ..Default::default()
        };
        assert!(small.to_string().ends_with("spread ×2.0e-3)"), "{small}");
    }

    #[test]
    fn bad_scales_and_loads_are_config_errors() {
        for a in [
            Arrivals::Scale(0.0),
            Arrivals::Scale(-1.0),
            Arrivals::Scale(f64::NAN),
            Arrivals::Load(0.0),
            Arrivals::Load(f64::INFINITY),
        ] {
            assert!(
                matches!(a.validate(), Err(ManagerError::Config(_))),
                "{a:?}"
            );
        }
        assert!(
            Arrivals::Load(1.5).validate().is_ok(),
            "overload can be asked for"
        );
    }
}
