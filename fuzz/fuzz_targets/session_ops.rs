//! `SessionAwareCache<RadixCache>` under arbitrary scheduler actions: sessions opened, closed
//! (also while a turn runs), demoted; streaming turns that extend their history or do not,
//! concurrent turns, ordinary requests in flight alongside, aborts, retracts, speculative
//! overshoot, budget and per-session caps under allocation pressure, idle TTLs on a manual
//! clock, and calls that must be refused.
//!
//! The driver ([`radixkv_fuzz::driver`]) checks every hit against the KV oracle, what each
//! session's slot holds against its model, the event shadow, and `check_invariants` after
//! every action; at teardown every session closes and nothing may be left held.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use radixkv_fuzz::driver::{Driver, DriverOp};
use radixkv_fuzz::kv::KvModel;
use radixkv_radix::{PolicyKind, RadixCache, RadixConfig};
use radixkv_session::SessionConfig;

#[derive(Arbitrary, Debug)]
struct Setup {
    page_size: u8,
    pages: u8,
    rows: u8,
    policy: u8,
    budget_pages: u8,
    cap_pages: u8,
    ttl: Option<u8>,
    events: bool,
}

#[derive(Arbitrary, Debug)]
struct Input {
    setup: Setup,
    ops: Vec<DriverOp>,
}

fuzz_target!(|input: Input| {
    let s = &input.setup;
    let p = 1 + usize::from(s.page_size % 4);
    let pages = 8 + usize::from(s.pages % 56);
    let inner = RadixCache::new(RadixConfig {
        page_size: p,
        total_pages: pages,
        max_rows: 2 + usize::from(s.rows % 8),
        policy: PolicyKind::ALL[usize::from(s.policy) % PolicyKind::ALL.len()],
        events: s.events,
        disabled: false,
        ..Default::default()
    })
    .expect("a small cache");
    let cfg = SessionConfig {
        max_held_tokens: usize::from(s.budget_pages) * p,
        max_session_tokens: usize::from(s.cap_pages).max(1) * p,
        idle_ttl: s.ttl.map(u64::from),
        max_held_state_slots: usize::MAX,
        max_held_window_pages: usize::MAX,
    };
    let mut d = Driver::new(inner, cfg, KvModel::new(pages, p), s.events);
    for op in &input.ops {
        d.step(op);
        d.audit();
    }
    d.teardown();
});
