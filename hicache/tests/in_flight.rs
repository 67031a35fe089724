//! A prefix whose load-back is still in flight is already in the tree, so a request of a later
//! batch can match it as a device hit: that batch must wait for the load too, even when it
//! loads nothing itself.

mod common;

use common::*;
use radixkv_hicache::{DEFAULT_MAX_PENDING_OPS, StreamKind};
use radixkv_radix::{FinishKind, PrefixCache, RadixKey, RequestKv};

#[test]
fn a_batch_that_matched_a_loading_prefix_waits_for_its_load() {
    let mut c = gated_cache(16, DEFAULT_MAX_PENDING_OPS);
    let gate = c.backend().gate().unwrap().clone();
    let a: Vec<u32> = (100..109).collect();
    gate.open();
    demote_to_host(&mut c, &a);
    gate.close();
    // Batch 1 loads A back, then drops the request before its forward ran.
    let mut r1 = begin(&mut c, &a);
    c.start_loading().unwrap().expect("batch 1 loads A");
    c.cache_finished_req(&mut r1, FinishKind::Aborted).unwrap();
    // Batch 2 finds A on the device while its copy is still held.
    let mut r2 = RequestKv::new(RadixKey::new(a.clone()));
    let m = c.match_request(&mut r2).unwrap();
    assert_eq!((m.prefix_len, m.host_hit_len), (8, 0));
    c.begin_request(&mut r2).unwrap();
    let step = c
        .start_loading()
        .unwrap()
        .expect("batch 2 loads nothing but must wait for batch 1's load");
    let counter = c.layer_counter().clone();
    counter.set_consumer(step.producer);
    assert!(!counter.is_layer_done(step.producer, 0));
    gate.release_on(StreamKind::Load, LAYERS as u64);
    wait_layers(&c, step.producer);
    finish_loaded(&mut c, &mut r2, &a);
    gate.open();
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
    // With nothing in flight, a batch that loads nothing has nothing to wait for.
    assert!(c.start_loading().unwrap().is_none());
}

#[test]
fn a_failed_load_of_an_earlier_batch_fails_a_later_batch_that_matched_it() {
    let mut c = gated_cache(16, DEFAULT_MAX_PENDING_OPS);
    let gate = c.backend().gate().unwrap().clone();
    let (a, b) = (tokens(1, 9), tokens(2, 9));
    gate.open();
    demote_to_host(&mut c, &a);
    demote_to_host(&mut c, &b);
    gate.close();
    // Batch 1 loads A, whose first layer copy will fail, and drops its request.
    let mut r1 = begin(&mut c, &a);
    c.start_loading().unwrap().expect("batch 1 loads A");
    c.cache_finished_req(&mut r1, FinishKind::Aborted).unwrap();
    c.backend().fail_next_copies(StreamKind::Load, 1);
    // Batch 2 matches A on the device and loads B itself: its own copies succeed, but it read
    // A's pages, so it must learn that they hold garbage.
    let mut r2 = begin(&mut c, &a);
    let mut r3 = begin(&mut c, &b);
    let step = c.start_loading().unwrap().expect("batch 2 loads B");
    gate.open();
    let counter = c.layer_counter().clone();
    counter.set_consumer(step.producer);
    assert!(
        counter.wait_until(0).is_err(),
        "A's failed layer reaches batch 2"
    );
    // The step boundary repairs A from its intact host copy; the batch can then run.
    c.step().unwrap();
    finish_loaded(&mut c, &mut r2, &a);
    finish_loaded(&mut c, &mut r3, &b);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
    assert_eq!(c.stats().repaired_loads, 1);
}
