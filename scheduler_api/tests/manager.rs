//! The KvCacheManager lifecycle, budgets, errors and metrics.

mod common;

use common::admitted;

use radixkv_scheduler_api::{
    Admission, Admitted, HostTier, KvCacheManager, ManagerError, NeverReason, ReqId, Request,
    SessionBudget, WaitReason, WritePolicy,
};

fn manager(device_tokens: usize, page: usize) -> KvCacheManager {
    KvCacheManager::builder()
        .device_tokens(device_tokens)
        .page_size(page)
        .max_rows(8)
        .build()
        .unwrap()
}

/// Admits `id` and returns how many tokens its prefill extends.
fn ready(kv: &mut KvCacheManager, id: ReqId) -> usize {
    admitted(kv, id).extend_tokens
}

/// Extends `id` by `extend` tokens and finishes it within one step, then drains the transfers.
fn finish_in_one_step(kv: &mut KvCacheManager, id: ReqId, extend: usize) {
    kv.extend(id, extend).unwrap();
    let step = kv.begin_step();
    kv.chunk_done(id).unwrap();
    kv.finish(id).unwrap();
    kv.end_step(step).unwrap();
    kv.drain().unwrap();
}

/// Runs a request to completion in one prefill step and `out` decode steps.
fn run_to_end(kv: &mut KvCacheManager, tokens: Vec<u32>, out: u32) -> usize {
    let id = kv
        .arrive(Request::new(tokens).max_new_tokens(out as usize))
        .unwrap();
    let step = kv.begin_step();
    let extend = ready(kv, id);
    let cached = kv.tokens(id).unwrap().len() - extend;
    kv.extend(id, extend).unwrap();
    kv.end_step(step).unwrap();
    kv.chunk_done(id).unwrap();
    for t in 0..out.saturating_sub(1) {
        let step = kv.begin_step();
        kv.decode(id, 1_000_000 + t).unwrap();
        kv.end_step(step).unwrap();
    }
    kv.finish(id).unwrap();
    kv.check_invariants().unwrap();
    cached
}

#[test]
fn second_request_reuses_the_first_ones_prefix_and_output() {
    let mut kv = manager(4096, 4);
    assert_eq!(run_to_end(&mut kv, (0..40).collect(), 9), 0);
    // The next turn: the first prompt, its fed-back outputs, and new tokens.
    let mut next: Vec<u32> = (0..40).collect();
    next.extend((0..8).map(|t| 1_000_000 + t));
    next.extend(500..520);
    assert_eq!(run_to_end(&mut kv, next, 3), 48);
    let m = kv.metrics();
    assert_eq!(m.counters.finished, 2);
    assert_eq!(m.counters.hit_tokens_device, 48);
    assert_eq!(m.counters.prompt_tokens, 40 + 68);
    assert_eq!(m.gauges.pool_request_owned_tokens, 0);
    assert_eq!(m.gauges.pool_protected_tokens, 0);
    assert!(m.gauges.pool_evictable_tokens >= 48);
}

#[test]
fn admission_waits_when_the_budget_is_short_and_holds_nothing() {
    let mut kv = manager(256, 16);
    let a = kv
        .arrive(Request::new((0..150).collect()).max_new_tokens(50))
        .unwrap();
    let b = kv
        .arrive(Request::new((1000..1150).collect()).max_new_tokens(50))
        .unwrap();
    let ext = ready(&mut kv, a);
    assert_eq!(kv.reserved_tokens(), 200);
    let before = kv.accounting();
    match kv.admit(b).unwrap() {
        Admission::Wait(WaitReason::NoRoom { needed, available }) => {
            assert_eq!(needed, 150 + 50 + 16);
            assert!(available < needed);
        }
        other => panic!("expected a wait, got {other:?}"),
    }
    assert_eq!(
        kv.accounting(),
        before,
        "a rejected admission holds nothing"
    );
    kv.extend(a, ext).unwrap();
    assert_eq!(kv.reserved_tokens(), 50);
    kv.chunk_done(a).unwrap();
    kv.finish(a).unwrap();
    assert_eq!(kv.reserved_tokens(), 0);
    // Now b fits (a's cache is evictable).
    ready(&mut kv, b);
    assert_eq!(kv.metrics().counters.admission_waits, 1);
    kv.abort(b).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn decode_out_of_memory_leaves_state_unchanged_and_retract_frees() {
    let mut kv = manager(48, 16);
    let a = kv
        .arrive(Request::new((0..15).collect()).max_new_tokens(1))
        .unwrap();
    let b = kv
        .arrive(Request::new((100..115).collect()).max_new_tokens(1))
        .unwrap();
    // Both fit the admission budget (15 + 1 + one page each of 48 tokens).
    let ea = ready(&mut kv, a);
    let eb = ready(&mut kv, b);
    kv.extend(a, ea).unwrap();
    kv.extend(b, eb).unwrap();
    kv.chunk_done(a).unwrap();
    kv.chunk_done(b).unwrap();
    // Decoding past the reserved output exhausts the pool: a takes the last page.
    kv.decode(a, 7).unwrap();
    kv.decode(b, 7).unwrap();
    kv.decode(a, 8).unwrap();
    let before = kv.accounting();
    assert_eq!(before.free, 0);
    let tokens_before = kv.tokens(b).unwrap().len();
    let e = kv.decode(b, 8).unwrap_err();
    assert!(matches!(e, ManagerError::OutOfMemory { .. }), "{e}");
    assert_eq!(kv.accounting(), before);
    assert_eq!(kv.tokens(b).unwrap().len(), tokens_before);
    kv.retract(a).unwrap();
    kv.decode(b, 8).unwrap();
    // The retracted request keeps its tokens and can be admitted again.
    assert_eq!(kv.tokens(a).unwrap().len(), 17);
    kv.finish(b).unwrap();
    assert!(matches!(kv.admit(a).unwrap(), Admission::Ready(_)));
    let m = kv.metrics();
    assert_eq!(m.counters.retracted, 1);
    assert_eq!(m.counters.out_of_memory, 1);
    kv.abort(a).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.accounting().request_owned, 0);
}

#[test]
fn lifecycle_misuse_is_a_typed_error() {
    let mut kv = manager(1024, 16);
    assert!(matches!(
        kv.arrive(Request::new(vec![])),
        Err(ManagerError::Lifecycle { .. })
    ));
    let a = kv.arrive(Request::new((0..20).collect())).unwrap();
    assert!(matches!(
        kv.extend(a, 4),
        Err(ManagerError::Lifecycle { .. })
    ));
    assert!(matches!(kv.finish(a), Err(ManagerError::Lifecycle { .. })));
    let ext = ready(&mut kv, a);
    assert!(kv.admit(a).is_err());
    assert!(kv.extend(a, ext + 1).is_err(), "extend past the prompt");
    assert!(
        kv.decode(a, 1).is_err(),
        "decode before the prompt is allocated"
    );
    kv.abort(a).unwrap();
    assert!(matches!(kv.abort(a), Err(ManagerError::UnknownRequest(_))));
    kv.check_invariants().unwrap();
}

#[test]
fn overflowing_counts_are_typed_errors_and_change_nothing() {
    let cfg = radixkv_scheduler_api::ManagerConfig {
        device_tokens: 1024,
        reserve_clip_tokens: usize::MAX,
        ..Default::default()
    };
    let mut kv = KvCacheManager::builder().config(cfg).build().unwrap();
    // An output budget no pool can hold: it arrives (the token buffer's room is only a hint)
    // and is never admitted, with the needed tokens saturated instead of wrapped.
    let greedy = kv
        .arrive(Request::new((0..20).collect()).max_new_tokens(usize::MAX))
        .unwrap();
    match kv.admit(greedy).unwrap() {
        Admission::Never(NeverReason::PoolTooSmall { needed, .. }) => {
            assert_eq!(needed, usize::MAX)
        }
        other => panic!("{other:?}"),
    }
    let a = kv
        .arrive(Request::new((100..120).collect()).max_new_tokens(4))
        .unwrap();
    let ext = ready(&mut kv, a);
    kv.extend(a, ext - 4).unwrap();
    let before = (kv.accounting(), kv.reserved_tokens());
    for n in [usize::MAX, usize::MAX - 5, 5] {
        assert!(
            matches!(
                kv.extend(a, n),
                Err(ManagerError::Lifecycle {
                    what: "extend past the prompt",
                    ..
                })
            ),
            "{n}"
        );
        assert_eq!((kv.accounting(), kv.reserved_tokens()), before);
    }
    kv.check_invariants().unwrap();
    kv.extend(a, 4).unwrap();
    kv.abort(a).unwrap();
    kv.abort(greedy).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.accounting().request_owned, 0);
}

/// Parses `text` with a Prometheus text parser and checks what that parser lets through but
/// OpenMetrics requires: metadata per family (`# TYPE`, `# HELP`, a `# UNIT` that the name
/// ends with), samples named after their family's type and grouped under it, no name shared
/// between families, cumulative histogram buckets, `# EOF` at the end.
fn parse_openmetrics(text: &str) -> prometheus_parse::Scrape {
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    assert_eq!(text.lines().last(), Some("# EOF"));
    assert_eq!(text.matches("# EOF").count(), 1);
    let mut families: Vec<(String, String)> = Vec::new();
    let mut helped = std::collections::HashSet::new();
    let mut sample_names = std::collections::HashSet::new();
    for line in text.lines().filter(|l| *l != "# EOF") {
        let words: Vec<&str> = line.splitn(4, ' ').collect();
        match words[..] {
            ["#", "TYPE", name, kind] => {
                assert!(
                    families.iter().all(|(f, _)| f != name),
                    "family {name} twice"
                );
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
                families.push((name.to_string(), kind.to_string()));
            }
            ["#", "HELP", name, _] | ["#", "UNIT", name, _] => {
                let (family, _) = families.last().expect("metadata before any TYPE");
                assert_eq!(family, name, "metadata of {name} outside its family");
                if words[1] == "HELP" {
                    helped.insert(name.to_string());
                } else {
                    assert!(name.ends_with(&format!("_{}", words[3])), "{line}");
                }
            }
            _ => {
                assert!(!line.starts_with('#'), "unknown metadata: {line}");
                let name = line.split(['{', ' ']).next().unwrap();
                let (family, kind) = families.last().expect("sample before any TYPE");
                let suffixes: &[&str] = match kind.as_str() {
                    "counter" => &["_total"],
                    "gauge" => &[""],
                    _ => &["_bucket", "_count", "_sum"],
                };
                assert!(
                    suffixes.iter().any(|s| format!("{family}{s}") == name),
                    "{name} is not a sample of {kind} {family}"
                );
                sample_names.insert(name.to_string());
            }
        }
    }
    for (f, _) in &families {
        assert!(helped.contains(f), "{f} has no HELP");
        assert!(f.starts_with("radixkv_"), "{f}");
    }
    // A family's name is never another family's sample name (a counter `x` exports `x_total`,
    // so a gauge `x_total` would collide).
    for (f, kind) in &families {
        assert!(
            kind == "gauge" || !sample_names.contains(f),
            "family {f} collides with a sample name"
        );
    }
    for s in &scrape.samples {
        match &s.value {
            prometheus_parse::Value::Histogram(buckets) => {
                assert!(
                    buckets
                        .windows(2)
                        .all(|w| w[0].less_than < w[1].less_than && w[0].count <= w[1].count),
                    "{} buckets are not cumulative: {buckets:?}",
                    s.metric
                );
                assert!(buckets.last().unwrap().less_than.is_infinite());
                let count = value(&scrape, &format!("{}_count", s.metric), |l| {
                    **l == *s.labels
                });
                assert_eq!(buckets.last().unwrap().count, count, "{}", s.metric);
            }
            // The parser types samples by their exact name; OpenMetrics names the family.
            prometheus_parse::Value::Untyped(_) => assert!(
                ["_total", "_count", "_sum"]
                    .iter()
                    .any(|x| s.metric.ends_with(x)),
                "{} has no type",
                s.metric
            ),
            _ => {}
        }
    }
    // The pool's states add up to its capacity.
    let states: f64 = scrape
        .samples
        .iter()
        .filter(|s| s.metric == "radixkv_pool_tokens")
        .map(|s| match s.value {
            prometheus_parse::Value::Gauge(v) => v,
            ref v => panic!("{v:?}"),
        })
        .sum();
    let capacity = plain(&scrape, "radixkv_pool_capacity_tokens");
    assert!(capacity > 0.0);
    assert_eq!(states, capacity);
    scrape
}

/// The value of the sample `metric` whose labels satisfy `pick`.
fn value(
    scrape: &prometheus_parse::Scrape,
    metric: &str,
    pick: impl Fn(&prometheus_parse::Labels) -> bool,
) -> f64 {
    let s = scrape
        .samples
        .iter()
        .find(|s| s.metric == metric && pick(&s.labels))
        .unwrap_or_else(|| panic!("no sample {metric}"));
    match s.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => v,
        ref v => panic!("{metric}: {v:?}"),
    }
}

/// The value of the unlabeled sample `metric`.
fn plain(scrape: &prometheus_parse::Scrape, metric: &str) -> f64 {
    value(scrape, metric, |l| l.is_empty())
}

fn labeled(scrape: &prometheus_parse::Scrape, metric: &str, key: &str, val: &str) -> f64 {
    value(scrape, metric, |l| l.get(key) == Some(val))
}

#[test]
fn metrics_export_as_valid_openmetrics() {
    let mut kv = manager(4096, 4);
    run_to_end(&mut kv, (0..40).collect(), 3);
    run_to_end(&mut kv, (0..41).collect(), 3);
    let m = kv.metrics();
    let scrape = parse_openmetrics(&m.to_openmetrics());
    let requests = "radixkv_requests_total";
    assert_eq!(labeled(&scrape, requests, "event", "finished"), 2.0);
    assert_eq!(
        labeled(&scrape, "radixkv_hit_tokens_total", "tier", "device"),
        40.0
    );
    let capacity = plain(&scrape, "radixkv_pool_capacity_tokens");
    assert_eq!(capacity, 4096.0);
    // Both requests' match lengths, in the buckets they fall in.
    assert_eq!(m.histograms.match_tokens.count(), 2);
    assert_eq!(m.histograms.match_tokens.sum(), 40);
    let matched = scrape
        .samples
        .iter()
        .find(|s| s.metric == "radixkv_prefix_match_tokens")
        .unwrap();
    let prometheus_parse::Value::Histogram(b) = &matched.value else {
        panic!("{matched:?}")
    };
    let at = |le: f64| b.iter().find(|x| x.less_than == le).unwrap().count;
    assert_eq!((at(0.0), at(16.0), at(64.0)), (1.0, 1.0, 2.0));
    // A device-only cache measures no transfers, so its transfer histograms stay empty.
    assert_eq!(m.histograms.step_load_bytes.count(), 0);
    assert_eq!(m.histograms.step_load_pages.count(), 0);
}

#[test]
fn kv_events_are_drained_for_routers() {
    let mut kv = KvCacheManager::builder()
        .device_tokens(1024)
        .page_size(4)
        .events(true)
        .build()
        .unwrap();
    run_to_end(&mut kv, (0..17).collect(), 1);
    let events = kv.take_events();
    assert!(!events.is_empty());
    assert!(kv.take_events().is_empty(), "drained once");
    assert!(kv.metrics().counters.kv_events > 0);
}

#[test]
fn config_files_build_every_wired_kind() {
    let cfg = radixkv_scheduler_api::ManagerConfig::from_toml_str(
        "device_tokens = 8192\n[cache]\nkind = \"hicache\"\nhost_tokens = 32768\n",
    )
    .unwrap();
    let kv = KvCacheManager::new(cfg).unwrap();
    assert_eq!(kv.accounting().total, 8192);
    assert_eq!(kv.config().label(), "hicache-lru-wt+host32K");
    let cfg = radixkv_scheduler_api::ManagerConfig::from_toml_str(
        "device_tokens = 8192\neviction = \"slru\"\n[sessions]\nmax_held_tokens = 2048\n",
    )
    .unwrap();
    let kv = KvCacheManager::new(cfg).unwrap();
    assert_eq!(kv.accounting().total, 8192);
    assert_eq!(kv.config().label(), "radix-slru+sessions");
}

fn session_manager(hicache: bool) -> KvCacheManager {
    let mut b = KvCacheManager::builder()
        .device_tokens(256)
        .page_size(4)
        .max_rows(8)
        .sessions(SessionBudget {
            max_held_tokens: 128,
            idle_ttl_ms: 1_000,
            per_session_cap_tokens: 128,
            max_held_window_pages: None,
        });
    if hicache {
        b = b.host_tier(HostTier::ratio(256, 4.0));
    }
    b.build().unwrap()
}

/// Arrives, admits and prefills one turn of `session` (output budget `out`) in one step,
/// leaving it running.
fn start_turn(
    kv: &mut KvCacheManager,
    session: u64,
    tokens: Vec<u32>,
    out: u32,
) -> (ReqId, Admitted) {
    let id = kv
        .arrive(
            Request::new(tokens)
                .session(session)
                .max_new_tokens(out as usize),
        )
        .unwrap();
    let a = admitted(kv, id);
    kv.extend(id, a.extend_tokens).unwrap();
    let step = kv.begin_step();
    for layer in 0..kv.config().model.layers {
        step.wait_layer(layer).unwrap();
    }
    kv.end_step(step).unwrap();
    kv.chunk_done(id).unwrap();
    (id, a)
}

/// One turn of `session`: prefill in one step, `out − 1` decode steps, finish.
fn turn(kv: &mut KvCacheManager, session: u64, tokens: Vec<u32>, out: u32) -> Admitted {
    let (id, a) = start_turn(kv, session, tokens, out);
    for t in 0..out.saturating_sub(1) {
        kv.decode(id, 9_000 + t).unwrap();
        let step = kv.begin_step();
        kv.end_step(step).unwrap();
    }
    kv.finish(id).unwrap();
    kv.check_invariants().unwrap();
    a
}

#[test]
fn sessions_open_on_arrival_serve_the_next_turn_and_release_on_close() {
    for hicache in [false, true] {
        let mut kv = session_manager(hicache);
        let first: Vec<u32> = (0..10).collect();
        assert_eq!(turn(&mut kv, 7, first, 3).cached_tokens(), 0);
        assert_eq!(kv.open_sessions(), 1);
        assert!(kv.accounting().session_held > 0, "the slot holds turn 1");
        assert_eq!(kv.metrics().gauges.held_sessions, 1);
        // Turn 2 extends turn 1 (prompt + both fed-back outputs) and reuses it unaligned.
        let mut next: Vec<u32> = (0..10).collect();
        next.extend([9_000, 9_001, 50, 51, 52]);
        assert_eq!(turn(&mut kv, 7, next, 2).device_tokens, 12);
        // A turn that does not extend the history runs as an ordinary request.
        assert_eq!(turn(&mut kv, 7, (100..120).collect(), 2).cached_tokens(), 0);
        kv.close_session(7).unwrap();
        assert_eq!(kv.open_sessions(), 0);
        kv.drain().unwrap();
        let a = kv.accounting();
        assert_eq!(a.session_held + a.protected + a.request_owned, 0, "{a:?}");
        assert_eq!(a.free + a.evictable, a.total);
        assert!(matches!(kv.close_session(7), Err(ManagerError::Session(_))));
    }
}

#[test]
fn a_turn_arriving_during_a_deferred_close_runs_untagged_and_the_session_closes() {
    for hicache in [false, true] {
        let mut kv = session_manager(hicache);
        turn(&mut kv, 7, (0..10).collect(), 2);
        // Turn 2 borrows the session's slot, so the close waits for it; the close succeeds
        // now and is not repeated later.
        let mut next: Vec<u32> = (0..10).collect();
        next.extend([9_000, 50]);
        let (second, _) = start_turn(&mut kv, 7, next.clone(), 4);
        kv.close_session(7).unwrap();
        assert_eq!(kv.open_sessions(), 1, "deferred");
        // A turn of the closing session runs as an ordinary request.
        next.push(51);
        let (late, _) = start_turn(&mut kv, 7, next, 4);
        kv.finish(second).unwrap();
        assert_eq!(kv.open_sessions(), 0, "the deferred close completed");
        kv.finish(late).unwrap();
        assert_eq!(
            kv.accounting().session_held,
            0,
            "the late turn held no slot"
        );
        kv.close_all_sessions().unwrap();
        assert!(matches!(kv.close_session(7), Err(ManagerError::Session(_))));
        // After the close, a turn of the same id opens the session afresh.
        turn(&mut kv, 7, (0..10).collect(), 2);
        assert_eq!(kv.open_sessions(), 1);
        assert!(kv.accounting().session_held > 0);
        kv.close_session(7).unwrap();
        assert_eq!(kv.open_sessions(), 0);
        kv.drain().unwrap();
        kv.check_invariants().unwrap();
        let a = kv.accounting();
        assert_eq!(a.free + a.evictable, a.total, "{a:?}");
    }
}

#[test]
fn session_ttl_runs_on_the_manager_clock() {
    let mut kv = session_manager(false);
    kv.open_session(3, true, Some(50)).unwrap();
    assert!(kv.open_session(3, true, None).is_err());
    turn(&mut kv, 3, (0..10).collect(), 2);
    assert!(kv.accounting().session_held > 0);
    kv.set_time_ms(49);
    let step = kv.begin_step();
    kv.end_step(step).unwrap();
    assert!(kv.accounting().session_held > 0, "not expired yet");
    kv.set_time_ms(10);
    assert_eq!(kv.time_ms(), 49, "the clock never goes back");
    kv.set_time_ms(60);
    let step = kv.begin_step();
    kv.end_step(step).unwrap();
    assert_eq!(
        kv.accounting().session_held,
        0,
        "expired: demoted to the tree"
    );
    assert_eq!(kv.open_sessions(), 1, "demotion keeps the session open");
    kv.close_all_sessions().unwrap();
    assert_eq!(kv.open_sessions(), 0);
    let plain = manager(4096, 4);
    let mut plain = plain;
    assert!(matches!(
        plain.open_session(1, true, None),
        Err(ManagerError::SessionsOff { session: 1 })
    ));
}

#[test]
fn a_session_tag_on_a_manager_without_sessions_is_refused() {
    let mut kv = manager(4096, 4);
    let mut req = Request::new((0..12).collect()).max_new_tokens(4);
    req.session = Some(5);
    assert_eq!(
        kv.arrive(req.clone()),
        Err(ManagerError::SessionsOff { session: 5 })
    );
    assert_eq!(kv.metrics().counters.arrived, 0, "nothing was registered");
    assert_eq!(
        kv.close_session(5),
        Err(ManagerError::SessionsOff { session: 5 })
    );
    // The same request untagged runs.
    req.session = None;
    let r = kv.arrive(req).unwrap();
    assert!(matches!(kv.admit(r).unwrap(), Admission::Ready(_)));
}

#[test]
fn session_refusals_keep_their_type_through_cache_errors() {
    use radixkv_radix::{CacheError, SessionFault};
    use radixkv_session::SessionError;
    let e = ManagerError::from(CacheError::Session(SessionFault::NotExtending {
        id: 3,
        history_len: 40,
    }));
    assert_eq!(
        e,
        ManagerError::Session(SessionError::NotExtending {
            id: 3,
            history_len: 40
        })
    );
    assert_eq!(
        ManagerError::from(CacheError::Session(SessionFault::Busy(3))),
        ManagerError::Session(SessionError::Busy(3))
    );
    // Other cache errors stay cache errors.
    assert_eq!(
        ManagerError::from(CacheError::EmptyKey),
        ManagerError::Cache(CacheError::EmptyKey)
    );
}

/// A write-through HiCache manager whose 64-token device pool holds one 41-token request.
fn small_write_through_manager() -> KvCacheManager {
    KvCacheManager::builder()
        .device_tokens(64)
        .page_size(4)
        .max_rows(4)
        .host_tier(HostTier::ratio(64, 4.0).write_policy(WritePolicy::WriteThrough))
        .build()
        .unwrap()
}

#[test]
fn hicache_loads_back_host_hits_and_counts_modeled_bytes() {
    let mut kv = small_write_through_manager();
    let page_bytes = kv.config().model.page_bytes();
    let a: Vec<u32> = (0..41).collect();
    let run = |kv: &mut KvCacheManager, tokens: Vec<u32>| {
        let id = kv.arrive(Request::new(tokens).max_new_tokens(1)).unwrap();
        let adm = admitted(kv, id);
        kv.extend(id, adm.extend_tokens).unwrap();
        let step = kv.begin_step();
        let loads = (step.load_pages(), step.load_bytes());
        for layer in 0..kv.config().model.layers {
            step.wait_layer(layer).unwrap();
            assert!(step.is_layer_done(layer));
        }
        kv.end_step(step).unwrap();
        kv.chunk_done(id).unwrap();
        kv.finish(id).unwrap();
        kv.drain().unwrap();
        kv.check_invariants().unwrap();
        (adm, loads)
    };
    run(&mut kv, a.clone());
    // Another 41 tokens do not fit beside the first: the first is demoted to the host.
    run(&mut kv, (1000..1041).collect());
    let (adm, (pages, bytes)) = run(&mut kv, a);
    assert_eq!(adm.host_tokens, 40, "{adm:?}");
    assert_eq!(pages, 10);
    assert_eq!(bytes, 10 * page_bytes, "modeled, not simulated, bytes");
    let m = kv.metrics();
    assert_eq!(m.counters.hit_tokens_host, 40);
    assert_eq!(m.counters.transfers.pages_loaded, 10);
    assert_eq!(
        m.counters.transfers.bytes_loaded,
        m.counters.transfers.pages_loaded * page_bytes
    );
    assert_eq!(
        m.counters.transfers.bytes_written,
        m.counters.transfers.pages_written * page_bytes
    );
    assert!(m.gauges.host_tokens >= 80);
    let a = kv.accounting();
    assert_eq!(a.free + a.evictable, a.total);
    // One step loaded 10 pages; every step of a tiered cache records what it moved.
    let h = &m.histograms;
    assert_eq!(
        (h.step_load_pages.count(), h.step_load_pages.sum()),
        (1, 10)
    );
    assert_eq!(h.step_load_wait_ns.count(), 1);
    assert_eq!(h.step_load_bytes.count(), m.counters.steps);
    // Transfers acked by `drain` (outside any step) are in the counters only.
    assert!(h.step_load_bytes.sum() <= m.counters.transfers.bytes_loaded);
    assert!(h.step_write_bytes.sum() <= m.counters.transfers.bytes_written);
    assert_eq!((h.match_tokens.count(), h.match_tokens.sum()), (3, 40));
    let scrape = parse_openmetrics(&m.to_openmetrics());
    let hit = labeled(&scrape, "radixkv_hit_tokens_total", "tier", "host");
    assert_eq!(hit, 40.0);
    let loads = plain(&scrape, "radixkv_step_load_pages_sum");
    assert_eq!(loads, 10.0);
    // Steps that move nothing count as zeros in both byte histograms.
    for _ in 0..3 {
        let s = kv.begin_step();
        kv.end_step(s).unwrap();
    }
    let later = kv.metrics();
    let first_bucket =
        |h: &radixkv_scheduler_api::metrics::Histogram| h.cumulative().next().map(|b| b.1);
    for (before, after) in [
        (&h.step_load_bytes, &later.histograms.step_load_bytes),
        (&h.step_write_bytes, &later.histograms.step_write_bytes),
    ] {
        assert_eq!(after.count(), later.counters.steps);
        assert_eq!(after.count(), before.count() + 3);
        assert_eq!(after.sum(), before.sum());
        assert_eq!(first_bucket(after), first_bucket(before).map(|n| n + 3));
    }
}

/// A HiCache manager whose host tier holds the first 40 tokens of `(0..41)` after a second
/// request pushed them off the device (as in the test above).
fn manager_with_host_copy() -> (KvCacheManager, Vec<u32>) {
    let mut kv = small_write_through_manager();
    let a: Vec<u32> = (0..41).collect();
    for tokens in [a.clone(), (1000..1041).collect()] {
        let id = kv.arrive(Request::new(tokens).max_new_tokens(1)).unwrap();
        let n = ready(&mut kv, id);
        finish_in_one_step(&mut kv, id, n);
    }
    (kv, a)
}

/// Waits for every layer of `step` and checks that it covers `pages` pages of load.
fn wait_covers(kv: &KvCacheManager, step: &radixkv_scheduler_api::StepHandle, pages: u64) {
    assert_eq!(step.load_pages(), pages);
    assert_eq!(step.load_bytes(), pages * kv.config().model.page_bytes());
    for layer in 0..kv.config().model.layers {
        step.wait_layer(layer).unwrap();
        assert!(step.is_layer_done(layer));
    }
}

#[test]
fn documented_order_host_hit_is_loaded_by_the_step_it_runs_in() {
    let (mut kv, a) = manager_with_host_copy();
    // Form the batch, then begin the step: the step starts the load and its wait covers it.
    let id = kv.arrive(Request::new(a).max_new_tokens(1)).unwrap();
    let adm = admitted(&mut kv, id);
    assert_eq!(adm.host_tokens, 40, "{adm:?}");
    kv.extend(id, adm.extend_tokens).unwrap();
    let step = kv.begin_step();
    wait_covers(&kv, &step, 10);
    kv.chunk_done(id).unwrap();
    let s = kv.end_step(step).unwrap();
    assert_eq!(
        s.transfers.pages_loaded, 10,
        "the load completed within its step"
    );
    kv.finish(id).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn an_admission_inside_a_step_that_loads_nothing_waits_for_the_next_step() {
    let (mut kv, a) = manager_with_host_copy();
    // The order the old rustdoc example used: the step is open before the admission. This
    // step began with nothing to load, so its handle waits for nothing: a load started now
    // could not join it, and the admission waits instead of running unloaded.
    let step = kv.begin_step();
    assert_eq!((step.load_pages(), step.load_bytes()), (0, 0));
    let id = kv.arrive(Request::new(a).max_new_tokens(1)).unwrap();
    let before = kv.accounting();
    assert_eq!(
        kv.admit(id).unwrap(),
        Admission::Wait(WaitReason::OpenStepLoadsNothing)
    );
    assert_eq!(kv.accounting(), before, "a waiting admission holds nothing");
    assert_eq!((step.load_pages(), step.load_bytes()), (0, 0));
    kv.end_step(step).unwrap();
    // Admitted before the next step begins: that step starts its load and waits for it.
    let adm = admitted(&mut kv, id);
    assert_eq!(adm.host_tokens, 40, "{adm:?}");
    kv.extend(id, adm.extend_tokens).unwrap();
    let step = kv.begin_step();
    wait_covers(&kv, &step, 10);
    kv.chunk_done(id).unwrap();
    let s = kv.end_step(step).unwrap();
    assert_eq!(s.transfers.pages_loaded, 10);
    kv.finish(id).unwrap();
    kv.check_invariants().unwrap();
}

/// A HiCache manager whose host tier holds the first 20 tokens of `(0..21)` and the first 12
/// of `(1000..1013)`, pushed off the device by a longer request.
fn manager_with_two_host_copies() -> (KvCacheManager, Vec<u32>, Vec<u32>) {
    let mut kv = small_write_through_manager();
    let (a, b): (Vec<u32>, Vec<u32>) = ((0..21).collect(), (1000..1013).collect());
    for tokens in [a.clone(), b.clone(), (2000..2041).collect()] {
        let id = kv.arrive(Request::new(tokens).max_new_tokens(1)).unwrap();
        let n = ready(&mut kv, id);
        finish_in_one_step(&mut kv, id, n);
    }
    (kv, a, b)
}

#[test]
fn admission_inside_an_open_step_joins_that_steps_loads() {
    let (mut kv, a, b) = manager_with_two_host_copies();
    // The first is admitted before the step, which starts its load...
    let first = kv.arrive(Request::new(a).max_new_tokens(1)).unwrap();
    let adm = admitted(&mut kv, first);
    assert_eq!(adm.host_tokens, 20, "{adm:?}");
    kv.extend(first, adm.extend_tokens).unwrap();
    let step = kv.begin_step();
    assert_eq!(step.load_pages(), 5);
    // ...and the second, admitted while that step is open, starts its own load at once and
    // joins the step: the handle waits for both.
    let second = kv.arrive(Request::new(b).max_new_tokens(1)).unwrap();
    let adm = admitted(&mut kv, second);
    assert_eq!(adm.host_tokens, 12, "{adm:?}");
    kv.extend(second, adm.extend_tokens).unwrap();
    wait_covers(&kv, &step, 8);
    kv.chunk_done(first).unwrap();
    kv.chunk_done(second).unwrap();
    let s = kv.end_step(step).unwrap();
    assert_eq!(
        s.transfers.pages_loaded, 8,
        "both loads started and completed in this step"
    );
    // The next step has nothing left to load.
    let next = kv.begin_step();
    assert_eq!((next.load_pages(), next.load_bytes()), (0, 0));
    kv.finish(first).unwrap();
    kv.finish(second).unwrap();
    kv.end_step(next).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn a_step_handle_still_held_keeps_its_load_set_from_the_next_step() {
    let (mut kv, a, b) = manager_with_two_host_copies();
    let first = kv.arrive(Request::new(a).max_new_tokens(1)).unwrap();
    let adm = admitted(&mut kv, first);
    kv.extend(first, adm.extend_tokens).unwrap();
    let step1 = kv.begin_step();
    wait_covers(&kv, &step1, 5);
    // A later loading step begun while the first one's handle is still held (a stale handle:
    // another step began meanwhile) gets a set of its own: the manager reuses a set only once
    // no handle holds it.
    let step2 = kv.begin_step();
    let second = kv.arrive(Request::new(b).max_new_tokens(1)).unwrap();
    assert_eq!(
        kv.admit(second).unwrap(),
        Admission::Wait(WaitReason::OpenStepLoadsNothing)
    );
    kv.end_step(step2).unwrap();
    let adm = admitted(&mut kv, second);
    kv.extend(second, adm.extend_tokens).unwrap();
    let step3 = kv.begin_step();
    wait_covers(&kv, &step3, 3);
    wait_covers(&kv, &step1, 5);
    kv.chunk_done(first).unwrap();
    kv.chunk_done(second).unwrap();
    kv.end_step(step3).unwrap();
    wait_covers(&kv, &step1, 5);
    kv.end_step(step1).unwrap();
    // A handle dropped without `end_step` gives its set back as well; a step that loads
    // nothing has none.
    drop(kv.begin_step());
    let next = kv.begin_step();
    assert_eq!((next.load_pages(), next.load_bytes()), (0, 0));
    kv.end_step(next).unwrap();
    kv.finish(first).unwrap();
    kv.finish(second).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn a_request_larger_than_the_pool_is_never_admitted_and_holds_nothing() {
    let mut kv = manager(64, 4);
    // 60 prompt tokens + 1 output + one page > 64: no eviction or finish can make room.
    let big = kv
        .arrive(Request::new((0..60).collect()).max_new_tokens(1))
        .unwrap();
    let before = kv.accounting();
    assert_eq!(
        kv.admit(big).unwrap(),
        Admission::Never(NeverReason::PoolTooSmall {
            needed: 65,
            capacity: 64
        })
    );
    assert_eq!(kv.accounting(), before);
    assert_eq!(kv.reserved_tokens(), 0);
    assert_eq!(kv.metrics().gauges.waiting_requests, 1);
    kv.abort(big).unwrap();
    // One that only has to wait for room is told to wait, not never.
    let a = kv
        .arrive(Request::new((100..140).collect()).max_new_tokens(1))
        .unwrap();
    let n = ready(&mut kv, a);
    kv.extend(a, n).unwrap();
    let b = kv
        .arrive(Request::new((200..240).collect()).max_new_tokens(1))
        .unwrap();
    assert!(matches!(
        kv.admit(b).unwrap(),
        Admission::Wait(WaitReason::NoRoom { .. })
    ));
    kv.check_invariants().unwrap();
}

/// Admits and prefills `id`, then decodes `out` tokens (one step each), leaving it running.
fn prefill_and_decode(kv: &mut KvCacheManager, id: ReqId, out: u32) {
    let n = ready(kv, id);
    kv.extend(id, n).unwrap();
    let step = kv.begin_step();
    kv.chunk_done(id).unwrap();
    kv.end_step(step).unwrap();
    for t in 0..out {
        kv.decode(id, 5000 + t).unwrap();
        let step = kv.begin_step();
        kv.end_step(step).unwrap();
    }
}

#[test]
fn retract_caches_the_computed_kv_and_readmission_hits_it() {
    for hicache in [false, true] {
        let mut b = KvCacheManager::builder()
            .device_tokens(256)
            .page_size(4)
            .max_rows(4);
        if hicache {
            b = b.host_tier(HostTier::ratio(256, 2.0));
        }
        let mut kv = b.build().unwrap();
        let id = kv
            .arrive(Request::new((0..10).collect()).max_new_tokens(16))
            .unwrap();
        // 10 prompt + 7 decoded tokens, all computed (their steps ended).
        prefill_and_decode(&mut kv, id, 7);
        kv.retract(id).unwrap();
        assert_eq!(kv.accounting().request_owned, 0, "hicache {hicache}");
        // 17 computed, 16 page-aligned: cached (a host backup may still lock it).
        let acc = kv.accounting();
        assert_eq!(acc.evictable + acc.protected, 16, "{acc:?}");
        let a = admitted(&mut kv, id);
        assert_eq!(a.cached_tokens(), 16, "hicache {hicache}: {a:?}");
        assert_eq!(a.extend_tokens, 1);
        finish_in_one_step(&mut kv, id, 1);
        kv.check_invariants().unwrap();
    }
}

#[test]
fn retract_caches_the_last_decoded_token_once_its_step_ended() {
    let mut kv = manager(256, 4);
    let id = kv
        .arrive(Request::new((0..10).collect()).max_new_tokens(16))
        .unwrap();
    // 16 computed: the last decoded token's step ended, though no later call committed it.
    prefill_and_decode(&mut kv, id, 6);
    kv.retract(id).unwrap();
    assert_eq!(kv.accounting().evictable, 16);
    kv.abort(id).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn retract_does_not_cache_tokens_whose_forward_has_not_run() {
    let mut kv = manager(256, 4);
    let id = kv
        .arrive(Request::new((0..10).collect()).max_new_tokens(16))
        .unwrap();
    prefill_and_decode(&mut kv, id, 5);
    // 15 computed; this step's decode token is allocated but its forward never runs.
    kv.decode(id, 77).unwrap();
    kv.retract(id).unwrap();
    assert_eq!(
        kv.accounting().evictable,
        12,
        "15 computed, 12 page-aligned"
    );
    let a = admitted(&mut kv, id);
    assert_eq!(a.cached_tokens(), 12, "{a:?}");
    kv.abort(id).unwrap();
    kv.check_invariants().unwrap();
}

#[test]
fn retracted_session_turn_frees_its_row_and_readmission_hits_its_kv() {
    for hicache in [false, true] {
        let mut kv = session_manager(hicache);
        // The first turn leaves a session slot; the second runs in it (lent) and is retracted.
        turn(&mut kv, 7, (0..12).collect(), 4);
        let mut t2: Vec<u32> = (0..12).collect();
        t2.extend(9_000..9_003);
        t2.extend(300..309);
        let id = kv
            .arrive(Request::new(t2).session(7).max_new_tokens(16))
            .unwrap();
        prefill_and_decode(&mut kv, id, 6);
        let held_before = kv.metrics().gauges.held_sessions;
        assert_eq!(held_before, 0, "the slot is lent to the running turn");
        kv.retract(id).unwrap();
        let acc = kv.accounting();
        assert_eq!(acc.request_owned + acc.session_held, 0, "{acc:?}");
        let a = admitted(&mut kv, id);
        // 24 prompt + 6 decoded = 30 computed; 28 page-aligned (page 4).
        assert_eq!(a.cached_tokens(), 28, "hicache {hicache}: {a:?}");
        finish_in_one_step(&mut kv, id, a.extend_tokens);
        kv.close_all_sessions().unwrap();
        kv.check_invariants().unwrap();
    }
}

#[test]
fn reset_drops_every_cached_kv_and_says_so() {
    use radixkv_radix::KvEvent;
    let budget = SessionBudget {
        max_held_tokens: 1024,
        ..Default::default()
    };
    let builders = [
        ("radix", KvCacheManager::builder()),
        (
            "radix + sessions",
            KvCacheManager::builder().sessions(budget.clone()),
        ),
        (
            "hicache",
            KvCacheManager::builder()
                .host_tier(HostTier::ratio(4096, 2.0).write_policy(WritePolicy::WriteThrough)),
        ),
        (
            "hicache + sessions",
            KvCacheManager::builder()
                .host_tier(HostTier::ratio(4096, 2.0).write_policy(WritePolicy::WriteThrough))
                .sessions(budget),
        ),
    ];
    for (name, b) in builders {
        let mut kv = b
            .device_tokens(4096)
            .page_size(4)
            .max_rows(8)
            .events(true)
            .build()
            .unwrap();
        let sessions = kv.config().sessions.is_some();
        let prompt: Vec<u32> = (0..40).collect();
        let mut req = Request::new(prompt.clone()).max_new_tokens(4);
        req.session = sessions.then_some(1);
        let r = kv.arrive(req).unwrap();
        let n = ready(&mut kv, r);
        // A request is registered: no reset, and nothing changes.
        let before = kv.accounting();
        assert_eq!(
            kv.reset(),
            Err(ManagerError::Busy { requests: 1 }),
            "{name}"
        );
        assert_eq!(kv.accounting(), before, "{name}");
        finish_in_one_step(&mut kv, r, n);
        let cached = kv.accounting();
        // In the tree, or (a session's first turn) locked by the session's slot.
        assert_eq!(
            cached.evictable + cached.protected + cached.session_held,
            40,
            "{name}: {cached:?}"
        );
        if name.starts_with("hicache") {
            assert!(kv.metrics().gauges.host_tokens > 0, "{name}: backed up");
        }
        kv.take_events();

        kv.reset().unwrap();
        let a = kv.accounting();
        assert_eq!(a.free, a.total, "{name}: {a:?}");
        assert!(a.balanced(), "{name}");
        assert_eq!(kv.metrics().gauges.host_tokens, 0, "{name}");
        assert!(
            kv.take_events().contains(&KvEvent::AllBlocksCleared),
            "{name}"
        );
        assert_eq!(kv.open_sessions(), usize::from(sessions), "{name}");
        kv.check_invariants().unwrap();
        // The same prompt misses now, on every tier.
        let r = kv.arrive(Request::new(prompt).max_new_tokens(4)).unwrap();
        let a = admitted(&mut kv, r);
        assert_eq!(a.cached_tokens(), 0, "{name}: {a:?}");
        assert_eq!(a.extend_tokens, 40, "{name}");
        kv.abort(r).unwrap();
        if sessions {
            kv.close_session(1).unwrap();
        }
    }
}

#[test]
fn a_request_s_row_reads_as_a_u32_page_table() {
    let mut kv = manager(4096, 4);
    let r = kv
        .arrive(Request::new((0..10).collect()).max_new_tokens(4))
        .unwrap();
    assert!(matches!(
        kv.pages_as_u32(r),
        Err(ManagerError::Lifecycle { .. })
    ));
    let n = ready(&mut kv, r);
    kv.extend(r, n).unwrap();
    let pages: Vec<u32> = kv.pages(r).unwrap().iter().map(|p| p.0).collect();
    assert_eq!(pages.len(), 3, "10 tokens on 4-token pages");
    let table = kv.pages_as_u32(r).unwrap();
    assert_eq!(table, &pages[..]);
    assert_eq!(
        table.as_ptr().cast(),
        kv.pages(r).unwrap().as_ptr(),
        "a view of the row, not a copy"
    );
    kv.abort(r).unwrap();
    assert!(matches!(
        kv.pages_as_u32(r),
        Err(ManagerError::UnknownRequest(_))
    ));
}

/// Sessions over a host tier: demoting an idle session puts its KV into the tree, where a
/// write-through backup locks it until the copy is acknowledged. A request that needs the
/// session's pages is admitted and allocated all the same (the backup is completed, then the
/// KV evicted); it used to fail out of memory although the pool was large enough.
#[test]
fn sessions_over_hicache_allocate_through_a_demoted_sessions_pending_backup() {
    for policy in [
        WritePolicy::WriteThrough,
        WritePolicy::WriteThroughSelective { hits: 1 },
        WritePolicy::WriteBack,
    ] {
        let mut kv = KvCacheManager::builder()
            .device_tokens(256)
            .page_size(4)
            .max_rows(8)
            .sessions(SessionBudget {
                max_held_tokens: 128,
                idle_ttl_ms: 1_000_000,
                per_session_cap_tokens: 128,
                max_held_window_pages: None,
            })
            .host_tier(HostTier::ratio(256, 4.0).write_policy(policy))
            .build()
            .unwrap();
        // Two turns of session 1: the second one's KV stays in the session's row.
        let t1: Vec<u32> = (0..40).collect();
        turn(&mut kv, 1, t1.clone(), 2);
        let mut t2 = t1.clone();
        t2.extend([9_000, 9_001]);
        t2.extend(100..170);
        turn(&mut kv, 1, t2, 2);
        kv.drain().unwrap();
        let held = kv.accounting().session_held;
        assert!(held > 64, "{policy}: {:?}", kv.accounting());
        // A request that needs more than the free pages: the session must give its KV up.
        let big: Vec<u32> = (50_000..50_200).collect();
        let free = kv.accounting().free;
        assert!(big.len() > free, "{policy}");
        let id = kv
            .arrive(Request::new(big.clone()).max_new_tokens(1))
            .unwrap();
        let a = admitted(&mut kv, id);
        assert_eq!(a.extend_tokens, big.len(), "{policy}");
        kv.extend(id, a.extend_tokens)
            .unwrap_or_else(|e| panic!("{policy}: {e}"));
        assert_eq!(kv.accounting().session_held, 0, "{policy}: demoted");
        kv.check_invariants().unwrap();
        let step = kv.begin_step();
        kv.chunk_done(id).unwrap();
        kv.finish(id).unwrap();
        kv.end_step(step).unwrap();
        kv.close_all_sessions().unwrap();
        kv.drain().unwrap();
        kv.check_invariants().unwrap();
        let acc = kv.accounting();
        assert_eq!(acc.free + acc.evictable, acc.total, "{policy}: {acc:?}");
        assert_eq!(kv.reserved_tokens(), 0);
    }
}

/// The host-tier cache the factory builds forwards `make_room` to the tiered cache, whose
/// override completes the backups pinning device KV: without the forwarding the trait's
/// default would only evict, and fail while the KV waits for its backup.
#[test]
fn the_tiered_cache_forwards_make_room_to_the_tiered_override() {
    use radixkv_radix::{FinishKind, RadixKey, RequestKv};
    let cfg = radixkv_scheduler_api::ManagerConfig {
        device_tokens: 64,
        cache: radixkv_scheduler_api::CacheKind::HiCache(HostTier::ratio(64, 4.0)),
        ..Default::default()
    };
    let mut c = radixkv_scheduler_api::factory::build_cache(&cfg).unwrap();
    let p = c.page_size();
    let tokens: Vec<u32> = (0..48).collect();
    let mut r = RequestKv::new(RadixKey::new(tokens.clone()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    c.alloc_tokens(&mut r, tokens.len()).unwrap();
    r.commit(tokens.len()).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    // Written through: the KV is in the tree, locked until its backup is acknowledged.
    assert_eq!(c.evictable_tokens(), 0);
    assert_eq!(c.available_tokens(), 64);
    c.make_room(64 / p).unwrap();
    assert_eq!(c.pools().pages.available(), 64 / p);
    c.check_invariants().unwrap();
}

/// Idle sessions keep request-pool rows. A request that finds no free row demotes idle
/// sessions (least recently used first) instead of waiting for a row forever; a turn served
/// from its own session's slot needs no new row at all; and with nothing idle to demote, a
/// request still waits.
#[test]
fn a_request_waiting_for_a_row_demotes_idle_sessions() {
    for hicache in [false, true] {
        let mut b = KvCacheManager::builder()
            .device_tokens(256)
            .page_size(4)
            .max_rows(2)
            .sessions(SessionBudget {
                max_held_tokens: 128,
                idle_ttl_ms: 1_000_000,
                per_session_cap_tokens: 128,
                max_held_window_pages: None,
            });
        if hicache {
            b = b.host_tier(HostTier::ratio(256, 4.0));
        }
        let mut kv = b.build().unwrap();
        let s1: Vec<u32> = (0..20).collect();
        let s2: Vec<u32> = (100..120).collect();
        turn(&mut kv, 1, s1.clone(), 2);
        turn(&mut kv, 2, s2.clone(), 2);
        assert_eq!(kv.metrics().gauges.held_sessions, 2, "both rows held");
        // An ordinary request: session 1, the least recently used, gives its row up.
        let r3 = kv
            .arrive(Request::new((500..520).collect()).max_new_tokens(2))
            .unwrap();
        let a = admitted(&mut kv, r3);
        assert_eq!(a.extend_tokens, 20);
        assert_eq!(kv.metrics().gauges.held_sessions, 1, "hicache {hicache}");
        assert_eq!(kv.metrics().counters.session_demotions, 1);
        // Session 2's next turn is served from its own row, though none is free.
        let mut t2 = s2.clone();
        t2.extend([9_000, 9_001, 130, 131]);
        let r4 = kv
            .arrive(Request::new(t2).session(2).max_new_tokens(2))
            .unwrap();
        let a = admitted(&mut kv, r4);
        assert_eq!(
            a.device_tokens, 21,
            "hicache {hicache}: from the session's slot"
        );
        // Session 1's next turn needs a new row, and nothing idle is left to demote.
        let mut t1 = s1.clone();
        t1.extend([9_000, 9_001, 30]);
        let r5 = kv
            .arrive(Request::new(t1).session(1).max_new_tokens(2))
            .unwrap();
        assert_eq!(
            kv.admit(r5).unwrap(),
            Admission::Wait(WaitReason::NoRow),
            "hicache {hicache}"
        );
        kv.abort(r3).unwrap();
        kv.abort(r4).unwrap();
        // A row is free again: session 1's turn is admitted (its KV went to the tree).
        let a = admitted(&mut kv, r5);
        assert!(a.cached_tokens() >= 20, "hicache {hicache}: {a:?}");
        kv.abort(r5).unwrap();
        kv.close_all_sessions().unwrap();
        kv.drain().unwrap();
        kv.check_invariants().unwrap();
        let acc = kv.accounting();
        assert_eq!(acc.free + acc.evictable, acc.total, "{acc:?}");
    }
}

/// A session turn lent its slot at the match gives it back when its admission must wait for
/// room: a waiting request holding its session's row and KV could be demoted by nothing, so
/// waiting turns of several sessions blocked each other (the replay stalled with nothing
/// running). Once room is back, the turn is still served from the slot.
#[test]
fn a_waiting_session_turn_gives_its_slot_back() {
    for hicache in [false, true] {
        let mut kv = session_manager(hicache);
        let s1: Vec<u32> = (0..40).collect();
        turn(&mut kv, 1, s1.clone(), 2);
        let held = kv.accounting().session_held;
        assert!(held > 0);
        // A request fills most of the pool and keeps running.
        let big = kv
            .arrive(Request::new((1_000..1_180).collect()).max_new_tokens(4))
            .unwrap();
        let a = admitted(&mut kv, big);
        kv.extend(big, a.extend_tokens).unwrap();
        // Session 1's next turn does not fit: it waits, and its slot is idle again.
        let mut t2 = s1.clone();
        t2.extend([9_000, 9_001]);
        t2.extend(200..240);
        let r = kv
            .arrive(Request::new(t2).session(1).max_new_tokens(8))
            .unwrap();
        assert!(
            matches!(
                kv.admit(r).unwrap(),
                Admission::Wait(WaitReason::NoRoom { .. })
            ),
            "hicache {hicache}"
        );
        assert_eq!(kv.metrics().gauges.held_sessions, 1, "hicache {hicache}");
        assert_eq!(kv.accounting().session_held, held, "hicache {hicache}");
        kv.check_invariants().unwrap();
        // The big request goes; the turn is admitted from its session's slot.
        kv.abort(big).unwrap();
        let a = admitted(&mut kv, r);
        assert_eq!(a.device_tokens, 41, "hicache {hicache}: {a:?}");
        assert_eq!(kv.metrics().gauges.held_sessions, 0, "lent again");
        kv.abort(r).unwrap();
        kv.close_all_sessions().unwrap();
        kv.drain().unwrap();
        kv.check_invariants().unwrap();
        let acc = kv.accounting();
        assert_eq!(acc.free + acc.evictable, acc.total, "{acc:?}");
    }
}

/// A replay stall names the blocked request, its size, the pool and the refusal behind it.
#[test]
fn stall_errors_name_the_request_and_the_refusal() {
    use radixkv_scheduler_api::StallCause;
    let e = ManagerError::Stalled {
        index: 7,
        needed: 900,
        capacity: 4096,
        cause: StallCause::Admission(WaitReason::NoRoom {
            needed: 500,
            available: 12,
        }),
    };
    let m = e.to_string();
    assert!(
        m.contains("request 7") && m.contains("900") && m.contains("4096"),
        "{m}"
    );
    assert!(m.contains("500 tokens needed, 12 available"), "{m}");
    let oom = StallCause::OutOfMemory {
        needed: 64,
        available: 3,
    };
    assert!(oom.to_string().contains("64 tokens"), "{oom}");
    assert!(
        StallCause::Admission(WaitReason::NoRow)
            .to_string()
            .contains("row")
    );
    assert!(
        !m.contains("holds only"),
        "not a pool-too-small message: {m}"
    );
}

/// A HiCache manager (256 device tokens, pages of 4) whose device holds 240 tokens of cached
/// KV from three finished requests (under write-back, none of it backed up).
fn device_full_of_cached_kv(policy: WritePolicy) -> KvCacheManager {
    let mut kv = KvCacheManager::builder()
        .device_tokens(256)
        .page_size(4)
        .max_rows(8)
        .host_tier(HostTier::ratio(256, 4.0).write_policy(policy))
        .build()
        .unwrap();
    for i in 0..3u32 {
        let t: Vec<u32> = (i * 1000..i * 1000 + 80).collect();
        let id = kv.arrive(Request::new(t).max_new_tokens(1)).unwrap();
        let n = ready(&mut kv, id);
        finish_in_one_step(&mut kv, id, n);
    }
    kv
}

/// Write-back eviction is asynchronous: an admission that needs the room of cached KV without
/// a host copy starts its backup and waits ([`WaitReason::RoomInFlight`]) instead of waiting
/// for the copy; the victims stay on the device (pinned) until the ack, which a later step
/// applies, and then the request is admitted and allocates without waiting. The write-through
/// policies evict at once, as before.
#[test]
fn write_back_eviction_waits_a_step_at_admission_not_in_the_allocation() {
    for policy in [WritePolicy::WriteBack, WritePolicy::WriteThrough] {
        let mut kv = device_full_of_cached_kv(policy);
        let before = kv.accounting();
        let big: Vec<u32> = (50_000..50_120).collect();
        assert!(big.len() > before.free, "{policy}: {before:?}");
        let id = kv
            .arrive(Request::new(big.clone()).max_new_tokens(1))
            .unwrap();
        let evicted_before = kv.metrics().counters.evicted_tokens;
        let first = kv.admit(id).unwrap();
        if policy == WritePolicy::WriteBack {
            let Admission::Wait(WaitReason::RoomInFlight { needed }) = first else {
                panic!("{policy}: expected a wait for the write-back, got {first:?}");
            };
            assert!(needed > before.free, "{policy}");
            // The victims are still on the device, pinned by their backups.
            let pinned = kv.accounting();
            assert!(pinned.protected > before.protected, "{pinned:?}");
            kv.check_invariants().unwrap();
            // The ack arrives at a later step; then the room is free.
            let step = kv.begin_step();
            kv.end_step(step).unwrap();
            kv.drain().unwrap();
            assert!(kv.accounting().free >= needed, "{:?}", kv.accounting());
            let a = admitted(&mut kv, id);
            assert_eq!(a.extend_tokens, big.len());
        } else {
            let Admission::Ready(a) = first else {
                panic!("{policy}: write-through evicts at once, got {first:?}");
            };
            assert_eq!(a.extend_tokens, big.len());
        }
        kv.extend(id, big.len())
            .unwrap_or_else(|e| panic!("{policy}: {e}"));
        assert!(
            kv.metrics().counters.evicted_tokens > evicted_before,
            "{policy}: evictions are counted"
        );
        let step = kv.begin_step();
        kv.chunk_done(id).unwrap();
        kv.finish(id).unwrap();
        kv.end_step(step).unwrap();
        kv.drain().unwrap();
        kv.check_invariants().unwrap();
        let acc = kv.accounting();
        assert_eq!(acc.free + acc.evictable, acc.total, "{policy}: {acc:?}");
        assert_eq!(kv.reserved_tokens(), 0);
    }
}

#[test]
fn a_device_only_step_waits_for_nothing_and_a_stale_handle_leaves_the_open_step_open() {
    let mut kv = manager(256, 4);
    let stale = kv.begin_step();
    let open = kv.begin_step();
    // A device-only cache loads nothing: every layer is ready at once.
    wait_covers(&kv, &open, 0);
    wait_covers(&kv, &stale, 0);
    kv.end_step(stale).unwrap();
    // Allocated while `open` is still open: its forward computes them.
    let id = kv
        .arrive(Request::new((0..10).collect()).max_new_tokens(4))
        .unwrap();
    let extend = ready(&mut kv, id);
    kv.extend(id, extend).unwrap();
    kv.end_step(open).unwrap();
    assert!(kv.take_events().is_empty(), "events are off");
    kv.retract(id).unwrap();
    assert_eq!(
        kv.accounting().evictable,
        8,
        "the open step ended: 10 computed, 8 page-aligned (ending an older handle must not \
         end the open step)"
    );
    kv.abort(id).unwrap();
    kv.check_invariants().unwrap();
}

/// `wait_transfers` completes the copies in flight and applies none of their acks: a
/// write-back victim stays on the device (pinned) until the next poll frees it.
#[test]
fn wait_transfers_completes_the_copies_and_leaves_their_acks_to_the_next_poll() {
    let mut kv = device_full_of_cached_kv(WritePolicy::WriteBack);
    let id = kv
        .arrive(Request::new((50_000..50_120).collect()).max_new_tokens(1))
        .unwrap();
    let Admission::Wait(WaitReason::RoomInFlight { needed }) = kv.admit(id).unwrap() else {
        panic!("expected a wait for the write-back");
    };
    let (pinned, evicted) = (kv.accounting(), kv.metrics().counters.evicted_tokens);
    assert!(pinned.free < needed, "{pinned:?}");
    // The backups complete, but their victims are demoted only when the acks are applied.
    kv.wait_transfers();
    assert_eq!(kv.accounting(), pinned);
    assert_eq!(kv.metrics().counters.evicted_tokens, evicted);
    kv.check_invariants().unwrap();
    kv.drain().unwrap();
    let freed = kv.accounting();
    assert!(freed.free >= needed, "{freed:?}");
    assert!(freed.protected < pinned.protected, "{freed:?}");
    assert!(kv.metrics().counters.evicted_tokens > evicted);
    // Nothing in flight: the wait returns at once and changes nothing.
    kv.wait_transfers();
    assert_eq!(kv.accounting(), freed);
    kv.check_invariants().unwrap();
}
