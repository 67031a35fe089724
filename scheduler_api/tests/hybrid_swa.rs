//! A sliding-window model (the Gemma-like preset, 5:1 local:global) through the manager: the
//! SWA pool sized from its byte budget, admission that needs full-KV room and SWA room, decode
//! that frees the window pages sliding out, sessions under a host tier building, bad budgets, and
//! the `swa_*` metrics.

mod common;

use common::{admitted, balanced, gemma, gemma_swa_page_bytes, session_budget, step};
use radixkv_scheduler_api::{
    Admission, CacheKind, HostTier, KvCacheManager, ManagerConfig, ManagerError, ModelGeometry,
    NeverReason, ReqId, Request, WaitReason,
};

/// A Gemma-like radix manager of 1024 device tokens and `pages` SWA pages.
fn manager(pages: u64) -> KvCacheManager {
    KvCacheManager::builder()
        .model(gemma())
        .device_tokens(1024)
        .swa_bytes(pages * gemma_swa_page_bytes())
        .build()
        .unwrap()
}

/// Arrives, admits and prefills `tokens` in one chunk.
fn prefill(kv: &mut KvCacheManager, tokens: Vec<u32>, max_new: usize) -> ReqId {
    let r = kv
        .arrive(Request::new(tokens).max_new_tokens(max_new))
        .unwrap();
    let a = admitted(kv, r);
    kv.extend(r, a.extend_tokens).unwrap();
    let s = kv.begin_step();
    kv.chunk_done(r).unwrap();
    kv.end_step(s).unwrap();
    r
}

#[test]
fn the_swa_pool_is_sized_from_its_budget() {
    let kv = manager(64);
    let a = kv.swa_accounting().unwrap();
    assert_eq!((a.total, a.free), (64, 64));
    let g = kv.metrics().gauges;
    assert_eq!((g.swa_pages_total, g.swa_pages_free), (64, 64));
    // A budget that is not a whole number of pages rounds down.
    let kv = KvCacheManager::builder()
        .model(gemma())
        .device_tokens(1024)
        .swa_bytes(10 * gemma_swa_page_bytes() + gemma_swa_page_bytes() / 2)
        .build()
        .unwrap();
    assert_eq!(kv.swa_accounting().unwrap().total, 10);
    // A dense model has no SWA pool.
    let kv = KvCacheManager::builder()
        .device_tokens(1024)
        .build()
        .unwrap();
    assert!(kv.swa_accounting().is_none());
    assert_eq!(kv.metrics().gauges.swa_pages_total, 0);
    assert!(!kv.metrics().to_openmetrics().contains("swa_pages"));
}

#[test]
fn decode_frees_the_window_pages_that_slide_out() {
    let mut kv = manager(64);
    let r = prefill(&mut kv, (0..16).collect(), 32);
    balanced(&kv);
    // The prompt is in the tree; the request keeps (locked) only the window before its end.
    let a = kv.swa_accounting().unwrap();
    assert_eq!(a.request_owned, 0, "{a:?}");
    // The window of 8 tokens is locked (with the rest of the node that holds it).
    assert!(a.protected >= 2, "{a:?}");
    assert_eq!(
        a.protected + a.evictable,
        4,
        "the prompt's 4 pages are cached: {a:?}"
    );
    let mut peak_owned = 0;
    for i in 0..20 {
        kv.decode(r, 1000 + i).unwrap();
        step(&mut kv);
        let a = kv.swa_accounting().unwrap();
        peak_owned = peak_owned.max(a.request_owned);
        balanced(&kv);
    }
    // Committed 35 tokens: the window of the next token starts at 24, so the request's own
    // pages of [16, 24) slid out and were freed; its tree pages of [8, 16) were released.
    let m = kv.metrics();
    assert_eq!(m.counters.swa_pages_slid_out, 2);
    assert!(peak_owned <= 8 / 4 + 2, "owned {peak_owned} pages at most");
    let a = kv.swa_accounting().unwrap();
    assert_eq!(
        a.protected, 0,
        "the prompt's window is no longer locked: {a:?}"
    );
    let text = m.to_openmetrics();
    assert!(text.contains("swa_pages_slid_out"), "{text}");
    assert!(
        text.contains("swa_pages{state=\"request_owned\"}"),
        "{text}"
    );
    kv.finish(r).unwrap();
    let a = kv.swa_accounting().unwrap();
    assert_eq!((a.request_owned, a.protected), (0, 0), "{a:?}");
    balanced(&kv);
    // The same conversation again hits past the prompt: the window before the hit is live.
    let mut next: Vec<u32> = (0..16).collect();
    next.extend((0..20).map(|i| 1000 + i));
    next.extend([7, 7, 7, 7]);
    let r2 = kv.arrive(Request::new(next).max_new_tokens(4)).unwrap();
    let adm = admitted(&mut kv, r2);
    // The finish cached all 36 tokens (the last decode token committed with it).
    assert_eq!(adm.device_tokens, 36, "{adm:?}");
    kv.abort(r2).unwrap();
    balanced(&kv);
}

#[test]
fn the_swa_locks_go_at_the_decode_where_the_window_passes_the_cached_prefix() {
    let mut kv = manager(64);
    let first = prefill(&mut kv, (0..16).collect(), 1);
    kv.finish(first).unwrap();
    // 16 cached tokens, then 4 more: the chunk caches 20, and the request locks the window
    // KV of [12, 20) until the window of its next token starts at 20.
    let mut prompt: Vec<u32> = (0..16).collect();
    prompt.extend([50, 51, 52, 53]);
    let r = prefill(&mut kv, prompt, 32);
    assert!(kv.swa_accounting().unwrap().protected > 0);
    for i in 0..16 {
        // `decode` commits the tokens before `pos` and slides before it allocates `pos`.
        let pos = kv.decode(r, 2000 + i).unwrap();
        let window_start = pos / 4 * 4 - 8;
        let a = kv.swa_accounting().unwrap();
        assert_eq!(
            a.protected == 0,
            window_start >= 20,
            "SWA locks at token {pos} (window from {window_start}): {a:?}"
        );
        // The full-KV locks stay while the request runs.
        assert!(kv.accounting().protected >= 20);
        step(&mut kv);
        balanced(&kv);
    }
    kv.finish(r).unwrap();
    balanced(&kv);
}

#[test]
fn admission_waits_for_swa_room() {
    // 6 SWA pages. A request with a long output may take its prompt's pages (2, kept locked
    // while its window covers them), its window (2 pages) and the pages around its ends: 6.
    let mut kv = manager(6);
    let a = prefill(&mut kv, (0..8).collect(), 64);
    let b = kv
        .arrive(Request::new((100..108).collect()).max_new_tokens(64))
        .unwrap();
    match kv.admit(b).unwrap() {
        Admission::Wait(WaitReason::NoWindowRoom { needed, available }) => {
            assert_eq!(needed, 6 * 4);
            assert!(available < needed, "{available}");
        }
        other => panic!("expected a wait for SWA room, got {other:?}"),
    }
    // The full-KV pool has plenty of room: only the SWA pool is short.
    assert!(kv.available_tokens() > 512);
    // 4 pages are free, enough for a short request (3 pages at its peak), but the running
    // one may still take them as it decodes: its claim counts.
    let a_now = kv.swa_accounting().unwrap();
    assert_eq!(a_now.free, 4, "{a_now:?}");
    let c = kv
        .arrive(Request::new((200..204).collect()).max_new_tokens(1))
        .unwrap();
    assert!(
        matches!(
            kv.admit(c).unwrap(),
            Admission::Wait(WaitReason::NoWindowRoom { needed: 12, .. })
        ),
        "the running request's claim is counted"
    );
    kv.abort(c).unwrap();
    // A decoding request stays within its peak, however long it runs.
    for i in 0..40 {
        kv.decode(a, 500 + i).unwrap();
        step(&mut kv);
        let s = kv.swa_accounting().unwrap();
        assert!(s.request_owned + s.protected <= 6, "{s:?}");
    }
    assert!(kv.metrics().counters.swa_pages_slid_out > 0);
    kv.finish(a).unwrap();
    // A finished request frees its claim: the waiting one is admitted.
    let adm = admitted(&mut kv, b);
    assert_eq!(adm.extend_tokens, 8);
    kv.extend(b, 8).unwrap();
    step(&mut kv);
    kv.abort(b).unwrap();
    balanced(&kv);
}

#[test]
fn a_prompt_larger_than_the_swa_pool_is_never_admitted() {
    let mut kv = manager(3);
    let r = kv
        .arrive(Request::new((0..64).collect()).max_new_tokens(4))
        .unwrap();
    match kv.admit(r).unwrap() {
        Admission::Never(NeverReason::WindowPoolTooSmall { needed, capacity }) => {
            assert_eq!(capacity, 3 * 4);
            assert!(needed > capacity);
        }
        other => panic!("expected never, got {other:?}"),
    }
    kv.abort(r).unwrap();
    balanced(&kv);
}

#[test]
fn the_disabled_cache_slides_too() {
    let mut cfg = ManagerConfig {
        cache: CacheKind::Disabled,
        device_tokens: 1024,
        ..Default::default()
    };
    cfg.model = gemma();
    cfg.pools.swa_bytes = Some(16 * gemma_swa_page_bytes());
    let mut kv = KvCacheManager::new(cfg).unwrap();
    let r = prefill(&mut kv, (0..16).collect(), 16);
    // Nothing is cached: the request's own pages before the window went at the chunk's end.
    let a = kv.swa_accounting().unwrap();
    assert_eq!(
        (a.request_owned, a.evictable, a.protected),
        (2, 0, 0),
        "{a:?}"
    );
    assert_eq!(kv.metrics().counters.swa_pages_slid_out, 2);
    for i in 0..12 {
        kv.decode(r, 50 + i).unwrap();
        step(&mut kv);
        assert!(kv.swa_accounting().unwrap().request_owned <= 4);
    }
    kv.finish(r).unwrap();
    let a = kv.swa_accounting().unwrap();
    assert_eq!(a.free, a.total, "{a:?}");
    balanced(&kv);
}

#[test]
fn a_host_tier_builds_with_and_without_sessions() {
    let base = || {
        let mut c = ManagerConfig {
            device_tokens: 1024,
            ..Default::default()
        };
        c.model = gemma();
        c
    };
    // Under a host tier the model builds, without sessions (tests/hybrid_hicache.rs) and with
    // them (tests/swa_sessions_hicache.rs). (A model with both sliding-window and Mamba layers
    // builds on the device-only caches: tests/hybrid_swa_mamba.rs.)
    let hi = ManagerConfig {
        cache: CacheKind::HiCache(HostTier::ratio(1024, 2.0)),
        ..base()
    };
    assert!(KvCacheManager::new(hi.clone()).is_ok());
    let hi_sessions = ManagerConfig {
        sessions: Some(session_budget()),
        ..hi
    };
    let mut kv = KvCacheManager::new(hi_sessions).expect("sessions under a host tier build");
    assert!(kv.swa_accounting().is_some());
    kv.open_session(1, true, None).unwrap();
    kv.close_session(1).unwrap();
}

#[test]
fn bad_swa_budgets_and_windows_are_config_errors() {
    let build = |m: ModelGeometry, bytes: Option<u64>| {
        let mut b = KvCacheManager::builder().model(m).device_tokens(1024);
        if let Some(bytes) = bytes {
            b = b.swa_bytes(bytes);
        }
        b.build()
    };
    // A budget that fits no page.
    let e = build(gemma(), Some(gemma_swa_page_bytes() - 1))
        .err()
        .unwrap();
    assert!(matches!(e, ManagerError::Config(_)), "{e:?}");
    assert!(e.to_string().contains("SWA"), "{e}");
    // Zero bytes.
    let e = build(gemma(), Some(0)).err().unwrap();
    assert!(matches!(e, ManagerError::Config(_)), "{e:?}");
    // Too many pages for a pool to address.
    let e = build(gemma(), Some(u64::MAX)).err().unwrap();
    assert!(matches!(e, ManagerError::Config(_)), "{e:?}");
    // A window that is not a whole number of pages.
    let mut m = gemma();
    m.sliding_window = Some(6);
    let e = build(m, Some(16 * gemma_swa_page_bytes())).err().unwrap();
    assert!(matches!(e, ManagerError::Config(_)), "{e:?}");
    assert!(e.to_string().contains("multiple of the page size"), "{e}");
    // An SWA budget on a model without sliding-window layers.
    let e = build(ModelGeometry::default(), Some(1 << 20))
        .err()
        .unwrap();
    assert!(matches!(e, ManagerError::Config(_)), "{e:?}");
}
