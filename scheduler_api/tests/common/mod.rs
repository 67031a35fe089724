//! Shared by the manager's integration tests: the preset geometries they shrink, a session
//! budget, one empty step, admission that must succeed and the pool audit.

// Each test file compiles this module on its own and uses only some of it.
#![allow(dead_code)]

pub mod turns;

use radixkv_scheduler_api::{
    Admission, Admitted, KvCacheManager, ModelGeometry, Preset, ReqId, SessionBudget,
};

/// Admits `id`, which must not have to wait (or be refused for good).
pub fn admitted(kv: &mut KvCacheManager, id: ReqId) -> Admitted {
    match kv.admit(id).unwrap() {
        Admission::Ready(a) => a,
        other => panic!("expected admission, got {other:?}"),
    }
}

/// The Gemma-like geometry with pages of 4 tokens and a window of 8 tokens (2 pages).
pub fn gemma() -> ModelGeometry {
    let mut m = Preset::GemmaLike.geometry();
    m.page_size = 4;
    m.sliding_window = Some(8);
    m
}

/// Bytes of one SWA page of [`gemma`].
pub fn gemma_swa_page_bytes() -> u64 {
    gemma().checked_swa_bytes_per_token().unwrap() * 4
}

/// The Jamba-like geometry with pages of 4 tokens.
pub fn jamba() -> ModelGeometry {
    let mut m = Preset::JambaLike.geometry();
    m.page_size = 4;
    m
}

/// A session budget of 512 held tokens (512 per session), a 60 s idle TTL and no cap on
/// held window pages.
pub fn session_budget() -> SessionBudget {
    SessionBudget {
        max_held_tokens: 512,
        idle_ttl_ms: 60_000,
        per_session_cap_tokens: 512,
        max_held_window_pages: None,
    }
}

/// One empty step (the forward of what was allocated since the last one).
pub fn step(kv: &mut KvCacheManager) {
    let s = kv.begin_step();
    kv.end_step(s).unwrap();
}

/// Every pool the manager has (full KV, and the SWA and Mamba pools where the model has
/// them) balances, and the manager's audit passes.
pub fn balanced(kv: &KvCacheManager) {
    assert!(kv.accounting().balanced(), "{:?}", kv.accounting());
    if let Some(s) = kv.swa_accounting() {
        assert!(s.balanced(), "{s:?}");
    }
    if let Some(m) = kv.mamba_accounting() {
        assert!(m.balanced(), "{m:?}");
    }
    kv.check_invariants().unwrap();
}
