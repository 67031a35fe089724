//! Hybrid models under a host tier. The Jamba-like preset (Transformer–Mamba): a request's
//! state is backed up with its KV, both leave the device, and a later request loads both back
//! and copies the loaded state on write; a demoted session's state comes back the same way.
//! The Gemma-like preset (sliding-window layers): a request's window KV is backed up with its
//! KV, both leave the device, and a later request loads both back and hits. A model with all
//! three kinds of layers (one tree with both components): the KV, the window KV and the state
//! leave the device together and one load brings all three back. Every pool balances
//! throughout and nothing is left behind.

mod common;

use common::{admitted, balanced, gemma, gemma_swa_page_bytes, jamba, session_budget, step};
use radixkv_scheduler_api::config::LayerPattern;
use radixkv_scheduler_api::{
    HostTier, KvCacheManager, MambaPolicyKind, ModelGeometry, ReqId, Request,
};

fn manager() -> KvCacheManager {
    let slot = jamba().checked_mamba_slot_bytes().unwrap();
    let mut host = HostTier::ratio(64, 4.0);
    host.load_back_min_tokens = 4;
    KvCacheManager::builder()
        .model(jamba())
        .device_tokens(64)
        .mamba_bytes(8 * slot)
        .mamba_policy(MambaPolicyKind::Sglang)
        .host_tier(host)
        .build()
        .unwrap()
}

/// Admits and prefills `tokens` in one chunk, then finishes the request.
fn run(kv: &mut KvCacheManager, tokens: Vec<u32>) -> radixkv_scheduler_api::Admitted {
    let r: ReqId = kv.arrive(Request::new(tokens).max_new_tokens(1)).unwrap();
    let a = admitted(kv, r);
    kv.extend(r, a.extend_tokens).unwrap();
    let step = kv.begin_step();
    kv.chunk_done(r).unwrap();
    kv.end_step(step).unwrap();
    kv.finish(r).unwrap();
    kv.check_invariants().unwrap();
    let acc = kv.mamba_accounting().unwrap();
    assert!(acc.balanced() && acc.request_owned == 0, "{acc:?}");
    a
}

#[test]
fn a_state_demoted_to_the_host_is_loaded_back_with_its_kv() {
    let mut kv = manager();
    let a = run(&mut kv, (0..12).collect());
    assert_eq!(a.device_tokens, 0);
    kv.drain().unwrap();
    // Two long requests push A off the device (its KV and state stay on the host).
    run(&mut kv, (100..140).collect());
    run(&mut kv, (200..240).collect());
    kv.drain().unwrap();
    let d = run(&mut kv, (0..16).collect());
    assert_eq!((d.device_tokens, d.host_tokens), (0, 12), "{d:?}");
    let cow = d.mamba_cow.expect("the loaded state is copied on write");
    assert_eq!(Some(cow.dst), d.mamba_slot);
    kv.drain().unwrap();
    kv.check_invariants().unwrap();
    let m = kv.metrics();
    assert_eq!(m.counters.mamba_state_hits, 1, "{:?}", m.counters);
}

/// A streaming session over the host tier: demoting its idle slot inserts its KV with its
/// state, which is backed up; once the state has left the device, the session's next turn
/// loads it back (with no KV to load) and continues there.
#[test]
fn a_demoted_session_state_comes_back_from_the_host() {
    let slot = jamba().checked_mamba_slot_bytes().unwrap();
    let mut host = HostTier::ratio(1024, 2.0);
    host.load_back_min_tokens = 4;
    let mut kv = KvCacheManager::builder()
        .model(jamba())
        .device_tokens(1024)
        .max_rows(8)
        .mamba_bytes(2 * slot)
        .mamba_policy(MambaPolicyKind::Sglang)
        .host_tier(host)
        .sessions(session_budget())
        .build()
        .unwrap();
    // Session 7: 10 prompt tokens and 2 decoded, 12 computed (a page end); its idle slot
    // holds the running state.
    let r = kv
        .arrive(Request::new((0..10).collect()).session(7).max_new_tokens(3))
        .unwrap();
    let a = admitted(&mut kv, r);
    kv.extend(r, a.extend_tokens).unwrap();
    step(&mut kv);
    kv.chunk_done(r).unwrap();
    for t in 0..2 {
        kv.decode(r, 9_000 + t).unwrap();
        step(&mut kv);
    }
    kv.finish(r).unwrap();
    assert_eq!(kv.metrics().gauges.held_sessions, 1);
    // Two other requests need both slots: the second demotes the session (its KV and state go
    // to the tree and are backed up).
    let x = kv.arrive(Request::new((100..110).collect())).unwrap();
    let ax = admitted(&mut kv, x);
    kv.extend(x, ax.extend_tokens).unwrap();
    let y = kv.arrive(Request::new((200..210).collect())).unwrap();
    let mut ready = None;
    for _ in 0..3 {
        match kv.admit(y).unwrap() {
            radixkv_scheduler_api::Admission::Ready(a) => {
                ready = Some(a);
                break;
            }
            // A backup in flight may still pin the demoted state: let it complete.
            _ => kv.drain().map(|_| ()).unwrap(),
        }
    }
    let ay = ready.expect("y is admitted once the backups are done");
    kv.extend(y, ay.extend_tokens).unwrap();
    assert_eq!(
        kv.metrics().gauges.held_sessions,
        0,
        "session 7 was demoted"
    );
    step(&mut kv);
    kv.finish(x).unwrap();
    kv.finish(y).unwrap();
    kv.drain().unwrap();
    kv.check_invariants().unwrap();
    // The device state went for y's slot; its host copy brings it back for the next turn.
    let mut t2: Vec<u32> = (0..10).collect();
    t2.extend([9_000, 9_001, 50]);
    let r2 = kv
        .arrive(Request::new(t2).session(7).max_new_tokens(1))
        .unwrap();
    let a2 = admitted(&mut kv, r2);
    assert_eq!((a2.device_tokens, a2.host_tokens), (0, 12), "{a2:?}");
    assert!(a2.mamba_cow.is_some());
    kv.extend(r2, a2.extend_tokens).unwrap();
    step(&mut kv);
    kv.chunk_done(r2).unwrap();
    kv.finish(r2).unwrap();
    kv.close_session(7).unwrap();
    kv.drain().unwrap();
    kv.check_invariants().unwrap();
    let acc = kv.mamba_accounting().unwrap();
    assert!(acc.balanced() && acc.request_owned == 0, "{acc:?}");
}

fn gemma_manager() -> KvCacheManager {
    let mut host = HostTier::ratio(64, 4.0);
    host.load_back_min_tokens = 4;
    KvCacheManager::builder()
        .model(gemma())
        .device_tokens(64)
        .swa_bytes(16 * gemma_swa_page_bytes())
        .host_tier(host)
        .build()
        .unwrap()
}

/// Admits and prefills `tokens` in one chunk, then finishes the request, auditing every pool
/// after each call.
fn run_swa(kv: &mut KvCacheManager, tokens: Vec<u32>) -> radixkv_scheduler_api::Admitted {
    let r: ReqId = kv.arrive(Request::new(tokens).max_new_tokens(1)).unwrap();
    let mut ready = None;
    for _ in 0..3 {
        match kv.admit(r).unwrap() {
            radixkv_scheduler_api::Admission::Ready(a) => {
                ready = Some(a);
                break;
            }
            // A backup in flight may still pin the window pages of the previous request: let
            // it complete (the transfers run on the simulated backend's own thread).
            _ => kv.drain().map(|_| ()).unwrap(),
        }
    }
    let a = ready.expect("admitted once the backups are done");
    balanced(kv);
    kv.extend(r, a.extend_tokens).unwrap();
    balanced(kv);
    let step = kv.begin_step();
    kv.chunk_done(r).unwrap();
    kv.end_step(step).unwrap();
    balanced(kv);
    kv.finish(r).unwrap();
    balanced(kv);
    let acc = kv.swa_accounting().unwrap();
    assert_eq!(acc.request_owned, 0, "{acc:?}");
    a
}

#[test]
fn window_kv_demoted_to_the_host_is_loaded_back_with_its_kv() {
    let mut kv = gemma_manager();
    assert_eq!(kv.swa_accounting().unwrap().total, 16);
    let a = run_swa(&mut kv, (0..12).collect());
    assert_eq!(a.device_tokens + a.host_tokens, 0);
    kv.drain().unwrap();
    balanced(&kv);
    // Two long requests push A off the device (its KV and window KV stay on the host).
    run_swa(&mut kv, (100..140).collect());
    run_swa(&mut kv, (200..240).collect());
    kv.drain().unwrap();
    balanced(&kv);
    let d = run_swa(&mut kv, (0..16).collect());
    assert_eq!((d.device_tokens, d.host_tokens), (0, 12), "{d:?}");
    kv.drain().unwrap();
    balanced(&kv);
    // A hit again, now from the device: the loaded KV and window KV stayed (the last token
    // is always computed, so the match stops at the page before it).
    let e = run_swa(&mut kv, (0..16).collect());
    assert_eq!((e.device_tokens, e.host_tokens), (12, 0), "{e:?}");
    kv.drain().unwrap();
    balanced(&kv);
    let m = kv.metrics();
    assert_eq!(m.counters.hit_tokens_host, 12, "{:?}", m.counters);
    let swa = kv.swa_accounting().unwrap();
    assert_eq!((swa.request_owned, swa.protected), (0, 0), "{swa:?}");
    let full = kv.accounting();
    assert_eq!((full.protected, full.request_owned), (0, 0), "{full:?}");
}

/// 8 layers: 1 full attention, 4 sliding-window (window 8 tokens, 2 pages), 3 Mamba.
fn three_kinds() -> ModelGeometry {
    ModelGeometry {
        layers: 8,
        layer_pattern: Some(LayerPattern::parse("SMSASMSM").unwrap()),
        kv_bytes_per_token_per_layer: 1024,
        page_size: 4,
        sliding_window: Some(8),
        mamba_conv_state_bytes: Some(1024),
        mamba_ssm_state_bytes: Some(4096),
        compute: None,
    }
}

fn three_kinds_manager() -> KvCacheManager {
    let m = three_kinds();
    let swa_page = m.checked_swa_bytes_per_token().unwrap() * 4;
    let slot = m.checked_mamba_slot_bytes().unwrap();
    let mut host = HostTier::ratio(64, 4.0);
    host.load_back_min_tokens = 4;
    let mut kv = KvCacheManager::builder()
        .model(m)
        .device_tokens(64)
        .swa_bytes(16 * swa_page)
        .mamba_bytes(8 * slot)
        .mamba_policy(MambaPolicyKind::Sglang)
        .host_tier(host)
        .build()
        .unwrap();
    kv.set_check_every_step(true);
    kv
}

/// A model with sliding-window and Mamba layers under the host tier: a request's KV, window
/// KV and state are backed up together, leave the device, and a later request loads all
/// three back, hits there and copies the loaded state on write.
#[test]
fn window_kv_and_state_demoted_to_the_host_are_loaded_back_with_their_kv() {
    let mut kv = three_kinds_manager();
    assert!(kv.swa_accounting().is_some() && kv.mamba_accounting().is_some());
    let a = run_swa(&mut kv, (0..12).collect());
    assert_eq!(a.device_tokens + a.host_tokens, 0);
    kv.drain().unwrap();
    balanced(&kv);
    // Two long requests push A off the device (its KV, window KV and state stay on the host).
    run_swa(&mut kv, (100..140).collect());
    run_swa(&mut kv, (200..240).collect());
    kv.drain().unwrap();
    balanced(&kv);
    let d = run_swa(&mut kv, (0..16).collect());
    assert_eq!((d.device_tokens, d.host_tokens), (0, 12), "{d:?}");
    let cow = d.mamba_cow.expect("the loaded state is copied on write");
    assert_eq!(Some(cow.dst), d.mamba_slot);
    kv.drain().unwrap();
    balanced(&kv);
    // A hit again, now from the device: the loaded KV, window KV and state stayed.
    let e = run_swa(&mut kv, (0..16).collect());
    assert_eq!((e.device_tokens, e.host_tokens), (12, 0), "{e:?}");
    assert!(e.mamba_cow.is_some());
    kv.drain().unwrap();
    balanced(&kv);
    let m = kv.metrics();
    assert_eq!(m.counters.hit_tokens_host, 12, "{:?}", m.counters);
    assert_eq!(m.counters.mamba_state_hits, 2, "{:?}", m.counters);
    let swa = kv.swa_accounting().unwrap();
    assert_eq!((swa.request_owned, swa.protected), (0, 0), "{swa:?}");
    let slots = kv.mamba_accounting().unwrap();
    assert_eq!((slots.request_owned, slots.protected), (0, 0), "{slots:?}");
    let full = kv.accounting();
    assert_eq!((full.protected, full.request_owned), (0, 0), "{full:?}");
}
