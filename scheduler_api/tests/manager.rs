//! The KvCacheManager lifecycle, budgets, errors and metrics.

use radixkv_scheduler_api::{Admission, KvCacheManager, ManagerError, Request, WaitReason};

fn manager(device_tokens: usize, page: usize) -> KvCacheManager {
    KvCacheManager::builder()
        .device_tokens(device_tokens)
        .page_size(page)
        .max_rows(8)
        .build()
        .unwrap()
}

fn ready(kv: &mut KvCacheManager, id: radixkv_scheduler_api::ReqId) -> usize {
    match kv.admit(id).unwrap() {
        Admission::Ready(a) => a.extend_tokens,
        Admission::Wait(w) => panic!("expected admission, got {w:?}"),
    }
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
fn metrics_export_as_prometheus_text() {
    let mut kv = manager(4096, 4);
    run_to_end(&mut kv, (0..40).collect(), 3);
    run_to_end(&mut kv, (0..41).collect(), 3);
    let text = kv.metrics().to_prometheus();
    assert!(text.contains("radixkv_requests_total{event=\"finished\"} 2"));
    assert!(text.contains("radixkv_hit_tokens_total{tier=\"device\"} 40"));
    assert!(text.contains("radixkv_pool_tokens{state=\"total\"} 4096"));
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
fn config_files_build_managers_and_name_missing_crates() {
    let cfg = radixkv_scheduler_api::ManagerConfig::from_toml_str(
        "device_tokens = 8192\n[cache]\nkind = \"hi_cache\"\nhost_tokens = 32768\n",
    )
    .unwrap();
    let e = KvCacheManager::new(cfg).unwrap_err().to_string();
    assert!(e.contains("radixkv-hicache"), "{e}");
    let cfg = radixkv_scheduler_api::ManagerConfig::from_toml_str(
        "device_tokens = 8192\neviction = \"slru\"\n",
    )
    .unwrap();
    let kv = KvCacheManager::new(cfg).unwrap();
    assert_eq!(kv.accounting().total, 8192);
}
