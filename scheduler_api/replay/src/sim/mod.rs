//! The reference scheduler and its simulation: cost model, infinite-cache ideal, replay,
//! report, and the comparison of several configurations on one trace.

mod cost;
mod cpu;
mod ideal;
mod load;
mod memory;
mod report;
mod scheduler;

pub use cost::CostModel;
pub use ideal::IdealCache;
pub use load::{Arrivals, LoadEstimate, LoadReport};
pub use memory::{MemoryUse, RssSample};
pub(crate) use report::quantile;
pub use report::{
    CpuBreakdown, CpuWaits, MambaReport, MemoReport, OccupancySample, PrefillFlops,
    REPORT_SCHEMA_VERSION, Report, ReportFile, SwaReport, TierRatios, TokenStoragePeak, fmt_bytes,
    fmt_count, fmt_pool,
};
pub use scheduler::{PageHashMode, Progress, SimConfig, replay};

use radixkv_radix::PolicyKind;

use crate::trace::Trace;
use radixkv_scheduler_api::config::{
    CacheKind, Eviction, HostTier, MambaPolicyKind, ManagerConfig, SessionBudget, WritePolicy,
};
use radixkv_scheduler_api::error::{ManagerError, Result};

/// The configurations `--compare` runs: no cache, the radix cache under every eviction
/// policy, radix (base policy) + sessions, HiCache with a host tier 4× the device pool under
/// each write policy, HiCache write-back under every other policy, and HiCache + sessions; for a
/// model with Mamba layers, also the base radix row under the other Mamba policy. Kinds this
/// build cannot construct are reported
/// as skipped by [`compare`], not dropped silently.
pub fn compare_configs(base: &ManagerConfig) -> Vec<ManagerConfig> {
    let sessions = Some(SessionBudget {
        max_held_tokens: base.device_tokens / 4,
        ..Default::default()
    });
    let tier = |w: WritePolicy| HostTier::ratio(base.device_tokens, 4.0).write_policy(w);
    let host = |w: WritePolicy| CacheKind::HiCache(tier(w));
    let mut out = vec![ManagerConfig {
        cache: CacheKind::Disabled,
        sessions: None,
        ..base.clone()
    }];
    for p in PolicyKind::ALL {
        out.push(ManagerConfig {
            cache: CacheKind::Radix,
            eviction: Eviction(p),
            sessions: None,
            ..base.clone()
        });
    }
    // A model with Mamba layers: the base radix row under the other Mamba policy too, at the
    // same pool bytes, or under a total budget (`pools.total_bytes`) at the same total split
    // by that policy's own rule (the other rule's knob dropped; a split that fails leaves a
    // configuration that `compare` reports as skipped, with the reason).
    if let Some(kind) = base.mamba_policy_kind() {
        for other in MambaPolicyKind::ALL.into_iter().filter(|&p| p != kind) {
            let mut c = ManagerConfig {
                cache: CacheKind::Radix,
                sessions: None,
                mamba_policy: Some(other),
                ..base.clone()
            };
            if c.pools.total_bytes.is_some() {
                match other {
                    MambaPolicyKind::Sglang => c.pools.running_requests = None,
                    MambaPolicyKind::Marconi => c.pools.mamba_full_memory_ratio = None,
                }
                let _ = c.apply_total_bytes();
            }
            out.push(c);
        }
    }
    out.push(ManagerConfig {
        cache: CacheKind::Radix,
        sessions: sessions.clone(),
        ..base.clone()
    });
    for w in [
        WritePolicy::WriteThrough,
        WritePolicy::WriteThroughSelective { hits: 2 },
        WritePolicy::WriteBack,
    ] {
        out.push(ManagerConfig {
            cache: host(w),
            sessions: None,
            ..base.clone()
        });
    }
    // Every policy on both tiers, and the base policy on the device with Reuse on the host
    // (write-back: the variant that holds the most distinct tokens).
    if base.eviction.0 != PolicyKind::Reuse {
        out.push(ManagerConfig {
            cache: CacheKind::HiCache(tier(WritePolicy::WriteBack).eviction(PolicyKind::Reuse)),
            sessions: None,
            ..base.clone()
        });
    }
    for p in PolicyKind::ALL
        .into_iter()
        .filter(|&p| p != base.eviction.0)
    {
        out.push(ManagerConfig {
            cache: host(WritePolicy::WriteBack),
            eviction: Eviction(p),
            sessions: None,
            ..base.clone()
        });
    }
    out.push(ManagerConfig {
        cache: host(WritePolicy::WriteThrough),
        sessions,
        ..base.clone()
    });
    out
}

/// One configuration's outcome in a comparison.
#[derive(Debug)]
pub enum CompareOutcome {
    /// The replay ran.
    Ran(Box<Report>),
    /// The configuration needs a crate this build does not wire in.
    Skipped {
        /// Configuration label.
        config: String,
        /// Why.
        reason: String,
    },
}

/// Replays `trace` under every configuration; `on_done` sees each outcome as it completes.
///
/// The infinite-cache ideal is computed once per page size and shared by every replay, so all
/// configurations with the same page size report the same `ideal_hit_tokens`. `trace` is
/// lent or given, as to [`replay`].
///
/// # Errors
/// The first error other than a not-wired cache kind.
pub fn compare<'t>(
    trace: impl Into<std::borrow::Cow<'t, Trace>>,
    base: &SimConfig,
    configs: &[ManagerConfig],
    progress: &mut dyn FnMut(&ManagerConfig) -> Box<dyn Progress>,
    on_done: &mut dyn FnMut(&CompareOutcome),
) -> Result<Vec<CompareOutcome>> {
    let mut out = Vec::with_capacity(configs.len());
    // Every configuration shares the base's pool and costs, so one timing serves them all.
    let (timed, load, ideal) = load::retime(trace.into(), base)?;
    let trace = &*timed;
    let mut ideals: Vec<(usize, Vec<u64>)> = Vec::new();
    if let Some(i) = ideal {
        ideals.push((base.manager.model.page_size, i));
    }
    for m in configs {
        let cfg = SimConfig {
            manager: m.clone(),
            ..base.clone()
        };
        let page_size = m.model.page_size;
        let i = match ideals.iter().position(|(p, _)| *p == page_size) {
            Some(i) => i,
            None => {
                ideals.push((page_size, scheduler::ideal_hits(trace, page_size)));
                ideals.len() - 1
            }
        };
        let mut p = progress(m);
        let outcome =
            match scheduler::replay_with_ideal(trace, &cfg, &ideals[i].1, load, p.as_mut()) {
                Ok(r) => CompareOutcome::Ran(Box::new(r)),
                Err(e @ ManagerError::NotWired { .. }) => CompareOutcome::Skipped {
                    config: m.label(),
                    reason: e.to_string(),
                },
                Err(e) => return Err(e),
            };
        on_done(&outcome);
        out.push(outcome);
    }
    Ok(out)
}
