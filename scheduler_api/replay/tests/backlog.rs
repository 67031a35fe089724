//! Memory bounded by the cache, not the queue: a slice of the real agentic trace replayed
//! with a deep backlog (its conversations at their saturating trace timing, one request
//! running at a time) keeps, at the end of every step, at most one waiting request's tokens
//! in the manager — the one the scheduler tried last — whatever the length of the queue.
//! Read through the manager's own accounting (`KvCacheManager::token_storage`, which the
//! replay reads every step into `Report::token_storage_peak`).
//!
//! Needs the real agentic trace (`$RADIXKV_TRACES`, see `common`): skipped with a message
//! without it, and failed when `CI=true` (CI must run it).

mod common;

use radixkv_replay::sim::{Arrivals, SimConfig, replay};
use radixkv_replay::trace::{ReadOptions, TraceFormat, read_trace};

#[test]
fn an_agentic_backlog_holds_no_waiting_prompts() {
    let test = "backlog::an_agentic_backlog_holds_no_waiting_prompts";
    let Some(path) = common::real_trace(common::WEKA, test) else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{test}: the agentic trace is required under CI"
        );
        return;
    };
    let opts = ReadOptions {
        limit: Some(16),
        max_requests: Some(32),
        ..Default::default()
    };
    let trace = read_trace(&path, TraceFormat::Weka, &opts).expect("the trace reads");
    assert_eq!(trace.requests.len(), 32);
    let mut cfg = SimConfig::default();
    cfg.manager.device_tokens = 1 << 20;
    cfg.manager.model.page_size = 64;
    // Saturating: every conversation at the trace's own 2 s spacing and one request running
    // at a time, so most of the slice queues.
    cfg.arrivals = Arrivals::Scale(1.0);
    cfg.max_running = 1;
    let r = replay(&trace, &cfg, &mut ()).expect("the replay runs");
    assert_eq!(r.counters.finished, 32);
    let peak = r.token_storage_peak;
    eprintln!("{test}: {peak:?}, {} retractions", r.retractions);
    assert!(
        peak.waiting_requests >= 10,
        "the backlog must be deep: {peak:?}"
    );
    // Only the head the scheduler tried last holds its tokens.
    assert!(peak.waiting_materialised <= 1, "{peak:?}");
    // ... so the waiting requests hold at most the largest request's tokens (with the room
    // for its output), plus the outputs of retracted requests.
    let token = std::mem::size_of::<u32>() as u64;
    let largest = trace
        .requests
        .iter()
        .map(|q| q.prompt_len + u64::from(q.output_len))
        .max()
        .unwrap();
    let max_output = trace.requests.iter().map(|q| q.output_len).max().unwrap();
    let bound = token * (largest + r.retractions * u64::from(max_output));
    assert!(peak.waiting_bytes <= bound, "{peak:?} > {bound}");
    // Owned prompts would have held the whole queue's: several times more.
    let queue: u64 = trace.requests.iter().map(|q| q.prompt_len).sum::<u64>() * token;
    assert!(peak.waiting_bytes * 4 < queue, "{peak:?} vs {queue}");
    assert!(peak.running_bytes > 0);
}
