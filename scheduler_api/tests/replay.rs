//! End-to-end replays of small slices of every trace format through the reference scheduler,
//! checking the report's invariants.

use std::path::PathBuf;

use radixkv_radix::PolicyKind;
use radixkv_scheduler_api::config::Eviction;
use radixkv_scheduler_api::sim::{
    CompareOutcome, Report, SimConfig, compare, compare_configs, replay,
};
use radixkv_scheduler_api::trace::{ReadOptions, SyntheticChat, Trace, TraceFormat, read_trace};
use radixkv_scheduler_api::{CacheKind, HostTier, SessionBudget, WritePolicy};

fn traces() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces")
}

fn slice(rel: &str, format: TraceFormat, limit: usize) -> Trace {
    let opts = ReadOptions {
        limit: Some(limit),
        ..Default::default()
    };
    read_trace(&traces().join(rel), format, &opts).expect("trace slice reads")
}

fn sim(device_tokens: usize, page_size: usize) -> SimConfig {
    let mut cfg = SimConfig::default();
    cfg.manager.device_tokens = device_tokens;
    cfg.manager.model.page_size = page_size;
    cfg
}

/// Invariants every report must satisfy.
fn check(r: &Report, trace: &Trace) {
    let n = trace.requests.len() as u64;
    assert_eq!(r.requests, n);
    assert_eq!(r.counters.finished, n, "every request finishes");
    assert_eq!(r.prompt_tokens, trace.prompt_tokens());
    let hits = r.hit_tokens_device + r.hit_tokens_host + r.hit_tokens_storage;
    assert!(
        hits <= r.ideal_hit_tokens,
        "hit {hits} exceeds the infinite-cache ideal {}",
        r.ideal_hit_tokens
    );
    assert!(r.hit_ratio.overall <= r.ideal_hit_ratio + 1e-12);
    let tiers = r.hit_ratio.device + r.hit_ratio.host + r.hit_ratio.storage;
    assert!(
        (tiers - r.hit_ratio.overall).abs() < 1e-9,
        "tiers sum to overall"
    );
    assert!(r.achieved_over_ideal <= 1.0 + 1e-12);
    assert_eq!(
        r.counters.transfers.bytes_loaded,
        r.counters.transfers.pages_loaded * r.page_bytes
    );
    assert_eq!(
        r.counters.transfers.bytes_written,
        r.counters.transfers.pages_written * r.page_bytes
    );
    // After the drain and the session closes: no lock, no owner, no session holds a page.
    assert_eq!(r.leaked_tokens, 0, "no pages leaked at the end");
    assert_eq!(r.open_sessions_at_end, 0);
    assert!(r.accounting_balanced);
    if r.retractions == 0 {
        assert_eq!(r.recomputed_tokens, r.prompt_tokens - hits);
    } else {
        assert!(r.recomputed_tokens >= r.prompt_tokens - hits);
    }
    let outputs: u64 = trace.requests.iter().map(|q| u64::from(q.output_len)).sum();
    assert_eq!(r.output_tokens, outputs);
    assert!(r.ttft_p50_ms > 0.0 && r.ttft_p50_ms <= r.ttft_p99_ms);
    assert!(!r.occupancy.is_empty());
}

#[test]
fn mooncake_slice_respects_the_report_invariants() {
    let t = slice(
        "mooncake/conversation_trace.jsonl",
        TraceFormat::Mooncake,
        80,
    );
    let r = replay(&t, &sim(128 << 10, 16), &mut ()).unwrap();
    check(&r, &t);
    // Every Mooncake conversation request starts with the shared block 0.
    assert!(r.hit_ratio.device > 0.0);
}

#[test]
fn mooncake_slice_under_memory_pressure_evicts_and_stays_consistent() {
    let t = slice(
        "mooncake/conversation_trace.jsonl",
        TraceFormat::Mooncake,
        60,
    );
    let max_req = t
        .requests
        .iter()
        .map(|q| q.prompt_len + u64::from(q.output_len))
        .max()
        .unwrap() as usize;
    // Barely larger than the largest request: eviction and admission waits are constant.
    let r = replay(&t, &sim(max_req + 8192, 16), &mut ()).unwrap();
    check(&r, &t);
    assert!(r.counters.evicted_tokens > 0);
    assert!(r.counters.admission_waits > 0);
}

#[test]
fn every_eviction_policy_replays_a_slice() {
    let t = slice(
        "mooncake/conversation_trace.jsonl",
        TraceFormat::Mooncake,
        40,
    );
    for p in PolicyKind::ALL {
        let mut cfg = sim(96 << 10, 16);
        cfg.manager.eviction = Eviction(p);
        let r = replay(&t, &cfg, &mut ()).unwrap();
        check(&r, &t);
        assert_eq!(r.config, format!("radix-{}", p.name()));
    }
}

#[test]
fn disabled_cache_recomputes_everything() {
    let t = slice(
        "mooncake/conversation_trace.jsonl",
        TraceFormat::Mooncake,
        40,
    );
    let mut cfg = sim(96 << 10, 16);
    cfg.manager.cache = CacheKind::Disabled;
    let r = replay(&t, &cfg, &mut ()).unwrap();
    check(&r, &t);
    assert_eq!(r.hit_ratio.overall, 0.0);
    assert_eq!(r.recomputed_tokens, r.prompt_tokens);
    assert!(r.ideal_hit_ratio > 0.0);
}

#[test]
fn agentic_slice_reuses_within_conversations() {
    // The first conversation, cut to its first 8 requests (each of them is 70K-100K tokens).
    let opts = ReadOptions {
        limit: Some(1),
        max_requests: Some(8),
        ..Default::default()
    };
    let t = read_trace(
        &traces().join("weka_claude_code/weka_claude_code_traces.jsonl.gz"),
        TraceFormat::Weka,
        &opts,
    )
    .unwrap();
    assert_eq!(t.requests.len(), 8);
    assert!(t.requests.iter().all(|q| q.session.is_some()));
    let r = replay(&t, &sim(256 << 10, 64), &mut ()).unwrap();
    check(&r, &t);
    assert!(
        r.hit_ratio.overall > 0.5,
        "multi-turn agentic reuse is high, got {}",
        r.hit_ratio.overall
    );
}

#[test]
fn azure_slice_has_no_reuse_and_no_ideal() {
    let t = slice(
        "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
        TraceFormat::Azure,
        150,
    );
    let r = replay(&t, &sim(64 << 10, 16), &mut ()).unwrap();
    check(&r, &t);
    assert_eq!(r.ideal_hit_tokens, 0);
    assert_eq!(r.hit_tokens_device, 0);
    // Arrivals follow the trace's timestamps.
    assert!(t.requests.last().unwrap().arrival_us > 10_000_000);
}

#[test]
fn synthetic_chat_reuses_system_prompts_and_history() {
    let t = SyntheticChat {
        conversations: 25,
        ..Default::default()
    }
    .generate();
    let r = replay(&t, &sim(64 << 10, 16), &mut ()).unwrap();
    check(&r, &t);
    assert!(r.hit_ratio.overall > 0.3, "{}", r.hit_ratio.overall);
    // The same seed gives the same report (wall-clock fields aside).
    let again = replay(&t, &sim(64 << 10, 16), &mut ()).unwrap();
    assert_eq!(again.hit_tokens_device, r.hit_tokens_device);
    assert_eq!(again.ttft_p99_ms, r.ttft_p99_ms);
}

#[test]
fn a_request_larger_than_the_pool_is_a_typed_error() {
    let t = slice(
        "mooncake/conversation_trace.jsonl",
        TraceFormat::Mooncake,
        5,
    );
    let e = replay(&t, &sim(4096, 16), &mut ()).unwrap_err();
    assert!(e.to_string().contains("device pool holds only"), "{e}");
}

#[test]
fn every_compare_configuration_runs() {
    let t = SyntheticChat {
        conversations: 3,
        ..Default::default()
    }
    .generate();
    let base = sim(32 << 10, 16);
    let configs = compare_configs(&base.manager);
    let outcomes = compare(&t, &base, &configs, &mut |_| Box::new(()), &mut |_| {}).unwrap();
    assert_eq!(outcomes.len(), configs.len());
    for o in &outcomes {
        match o {
            CompareOutcome::Ran(r) => check(r, &t),
            CompareOutcome::Skipped { config, reason } => panic!("{config} skipped: {reason}"),
        }
    }
    assert!(configs.len() > 2 * PolicyKind::ALL.len() + 4);
    let labels: std::collections::HashSet<String> = configs.iter().map(|c| c.label()).collect();
    assert_eq!(
        labels.len(),
        configs.len(),
        "labels must tell configurations apart"
    );
}

fn hicache(device: usize, host: usize, w: WritePolicy) -> SimConfig {
    let mut cfg = sim(device, 16);
    cfg.manager.cache = CacheKind::HiCache(HostTier {
        host_tokens: host,
        max_pending_ops: radixkv_hicache::DEFAULT_MAX_PENDING_OPS,
        write_policy: w,
        eviction: None,
        storage: None,
    });
    cfg
}

#[test]
fn hicache_slices_respect_the_invariants_under_every_write_policy() {
    // A Mooncake slice (little reuse this early in the trace) and a synthetic chat whose
    // history outgrows a small device pool, so that the host tier serves hits.
    let moon = slice(
        "mooncake/conversation_trace.jsonl",
        TraceFormat::Mooncake,
        60,
    );
    let chat = SyntheticChat {
        conversations: 8,
        ..Default::default()
    }
    .generate();
    for w in [
        WritePolicy::WriteThrough,
        WritePolicy::WriteThroughSelective { hits: 2 },
        WritePolicy::WriteBack,
    ] {
        let r = replay(&moon, &hicache(128 << 10, 512 << 10, w.clone()), &mut ()).unwrap();
        check(&r, &moon);
        assert!(r.config.starts_with("hicache-lru-"));
        let r = replay(&chat, &hicache(32 << 10, 128 << 10, w.clone()), &mut ()).unwrap();
        check(&r, &chat);
        assert!(
            r.counters.transfers.pages_written > 0,
            "{w:?} backs something up"
        );
        assert!(r.hit_tokens_host > 0, "{w:?}: the host tier serves hits");
        assert!(r.counters.transfers.pages_loaded > 0);
    }
}

#[test]
fn hicache_replays_are_deterministic() {
    // HostSim copies run on worker threads; the replay completes them within their step, so
    // two runs agree on every counter and simulated time, not only on the hit ratio.
    let chat = SyntheticChat {
        conversations: 8,
        ..Default::default()
    }
    .generate();
    for w in [WritePolicy::WriteThrough, WritePolicy::WriteBack] {
        let cfg = hicache(32 << 10, 128 << 10, w);
        let a = replay(&chat, &cfg, &mut ()).unwrap();
        let b = replay(&chat, &cfg, &mut ()).unwrap();
        assert!(a.counters.transfers.pages_written > 0);
        assert_eq!(a.counters, b.counters);
        assert_eq!(
            (a.hit_tokens_device, a.hit_tokens_host, a.recomputed_tokens),
            (b.hit_tokens_device, b.hit_tokens_host, b.recomputed_tokens)
        );
        assert_eq!(a.ttft_p99_ms, b.ttft_p99_ms);
        assert_eq!(a.sim_duration_s, b.sim_duration_s);
    }
}

#[test]
fn sessions_over_radix_and_hicache_replay_multi_turn_chat() {
    let t = SyntheticChat {
        conversations: 6,
        ..Default::default()
    }
    .generate();
    let budget = SessionBudget {
        max_held_tokens: 16 << 10,
        ..Default::default()
    };
    let mut radix = sim(64 << 10, 16);
    radix.manager.sessions = Some(budget.clone());
    let mut hi = hicache(64 << 10, 256 << 10, WritePolicy::WriteThrough);
    hi.manager.sessions = Some(budget);
    for cfg in [radix, hi] {
        let r = replay(&t, &cfg, &mut ()).unwrap();
        check(&r, &t);
        assert!(r.config.ends_with("+sessions"));
        assert!(r.hit_ratio.overall > 0.5, "{}", r.hit_ratio.overall);
    }
}

#[test]
fn agentic_slice_with_sessions() {
    let opts = ReadOptions {
        limit: Some(1),
        max_requests: Some(6),
        ..Default::default()
    };
    let t = read_trace(
        &traces().join("weka_claude_code/weka_claude_code_traces.jsonl.gz"),
        TraceFormat::Weka,
        &opts,
    )
    .unwrap();
    let mut cfg = sim(256 << 10, 64);
    cfg.manager.sessions = Some(SessionBudget {
        max_held_tokens: 128 << 10,
        ..Default::default()
    });
    let r = replay(&t, &cfg, &mut ()).unwrap();
    check(&r, &t);
    assert!(r.hit_ratio.overall > 0.5, "{}", r.hit_ratio.overall);
}

/// The whole Mooncake conversation trace (12,031 requests). Release builds only: in debug
/// builds the per-step invariant audit makes it take minutes.
#[cfg(not(debug_assertions))]
#[test]
fn full_mooncake_conversation_trace() {
    let t = read_trace(
        &traces().join("mooncake/conversation_trace.jsonl"),
        TraceFormat::Mooncake,
        &ReadOptions::default(),
    )
    .unwrap();
    assert_eq!(t.requests.len(), 12_031);
    let r = replay(&t, &sim(1 << 20, 16), &mut ()).unwrap();
    check(&r, &t);
    assert!(
        (r.ideal_hit_ratio - 0.3736).abs() < 0.002,
        "{}",
        r.ideal_hit_ratio
    );
    assert!(r.hit_ratio.overall > 0.03);
    println!("{r}");
}

/// The whole Mooncake conversation trace through HiCache, 1M device + 4M host tokens,
/// write-back (the tiers stay nearly disjoint: about 5M tokens of cache). Release builds only.
#[cfg(not(debug_assertions))]
#[test]
fn full_mooncake_conversation_trace_with_hicache() {
    let t = read_trace(
        &traces().join("mooncake/conversation_trace.jsonl"),
        TraceFormat::Mooncake,
        &ReadOptions::default(),
    )
    .unwrap();
    let cfg = hicache(1 << 20, 4 << 20, WritePolicy::WriteBack);
    let r = replay(&t, &cfg, &mut ()).unwrap();
    check(&r, &t);
    assert!(r.hit_tokens_host > 0);
    assert!(r.hit_ratio.overall > 0.1, "{}", r.hit_ratio.overall);
    println!("{r}");
}
