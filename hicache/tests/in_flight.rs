//! A prefix whose load-back is still in flight is already in the tree, so a request of a later
//! batch can match it as a device hit: that batch must wait for the load too, even when it
//! loads nothing itself.

mod common;

use common::*;
use radixkv_hicache::{DEFAULT_MAX_PENDING_OPS, StreamKind};
use radixkv_radix::{CacheError, FinishKind, PrefixCache, RadixKey, RequestKv};

/// A request of a later batch that finds `a` (8 tokens cached) on the device and loads
/// nothing itself, begun; its batch's load step (`why` it must have one), whose layers the
/// layer counter now reports.
fn later_batch_on_device(
    c: &mut radixkv_hicache::HiRadixCache<radixkv_hicache::HostSim>,
    a: &[u32],
    why: &str,
) -> (RequestKv, radixkv_hicache::LoadStep) {
    let mut r = RequestKv::new(RadixKey::new(a.to_vec()));
    let m = c.match_request(&mut r).unwrap();
    assert_eq!((m.prefix_len, m.host_hit_len), (8, 0));
    c.begin_request(&mut r).unwrap();
    let step = c.start_loading().unwrap().expect(why);
    c.layer_counter().set_consumer(step.producer);
    (r, step)
}

/// Flushes `c` and checks the end state of a failed-load scenario: invariants, no lock left,
/// exactly one load repaired.
fn drained_after_one_repair(c: &mut radixkv_hicache::HiRadixCache<radixkv_hicache::HostSim>) {
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
    assert_eq!(c.stats().repaired_loads, 1);
}

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
    let (mut r2, step) = later_batch_on_device(
        &mut c,
        &a,
        "batch 2 loads nothing but must wait for batch 1's load",
    );
    let counter = c.layer_counter().clone();
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
    drained_after_one_repair(&mut c);
}

/// Write-through backups lock the KV they copy until their ack. When the device can only make
/// room by evicting that KV, `make_room` completes the backups first (instead of failing with
/// out-of-pages while the KV is merely waiting for a copy), and `available_tokens` counts it.
#[test]
fn make_room_completes_the_backups_that_pin_device_kv() {
    let mut c = gated_cache(8, DEFAULT_MAX_PENDING_OPS);
    let gate = c.backend().gate().unwrap().clone();
    let a = tokens(1, 12);
    serve(&mut c, &a).unwrap();
    // A's six pages are in the tree, locked by their backup, which the gate holds.
    assert_eq!(c.unacked_backup_pages(), 6);
    assert_eq!(c.evictable_tokens(), 0);
    assert_eq!(c.backup_pinned_tokens(), 12);
    assert_eq!(c.available_tokens(), 16, "free + evictable + backup-pinned");
    // Nine pages cannot be made free even by completing the backup: nothing is waited for or
    // changed.
    assert!(matches!(
        c.alloc_pages(9),
        Err(CacheError::OutOfPages { needed: 9, .. })
    ));
    assert_eq!(c.stats().backups_awaited_for_room, 0);
    assert_eq!(c.unacked_backup_pages(), 6);
    // Eight pages: the backup is completed (the gate opens only when something waits for it),
    // acknowledged, and A is demoted to the host.
    gate.open_when_waited();
    let (mut c, pages) = within("alloc_pages", 60, move || {
        let r = c.alloc_pages(8);
        (c, r)
    });
    let pages = pages.expect("completing the backup frees A's pages");
    assert_eq!(pages.len(), 8);
    let s = c.stats();
    assert_eq!(s.backups_awaited_for_room, 1);
    assert_eq!((s.writes_acked, s.failed_writes), (1, 0));
    assert_eq!(s.demoted_tokens, 12);
    assert_eq!(c.unacked_backup_pages(), 0);
    c.pools_mut().pages.free(&pages).unwrap();
    c.check_invariants().unwrap();
    // The backup was completed, not dropped: A comes back from the host.
    let mut r = RequestKv::new(RadixKey::new(a.clone()));
    let m = c.match_request(&mut r).unwrap();
    assert_eq!((m.prefix_len, m.host_hit_len), (0, 10));
}

/// Only KV that nothing but a backup locks counts as backup-pinned: a request's lock on the
/// same path keeps it out, and `make_room` does not wait for a backup that would not free
/// enough.
#[test]
fn backup_pinned_tokens_leave_out_kv_locked_by_a_request() {
    let mut c = gated_cache(8, DEFAULT_MAX_PENDING_OPS);
    let gate = c.backend().gate().unwrap().clone();
    let a = tokens(1, 12);
    serve(&mut c, &a).unwrap();
    // A request reuses A's first ten tokens (the match splits A into 10 + 2 tokens).
    let mut r = begin(&mut c, &a);
    assert_eq!(r.prefix_len, 10);
    assert_eq!(c.backup_pinned_tokens(), 2, "only A's unshared tail");
    assert_eq!(c.available_tokens(), 4 + 2);
    // Four pages would need A's head, which the request holds: no wait, out of pages.
    assert!(matches!(
        c.alloc_pages(4),
        Err(CacheError::OutOfPages { .. })
    ));
    assert_eq!(c.stats().backups_awaited_for_room, 0);
    gate.open_when_waited();
    let (mut c, pages) = within("alloc_pages", 60, move || {
        let r = c.alloc_pages(3);
        (c, r)
    });
    let pages = pages.expect("completing the backup frees A's tail");
    assert_eq!(c.stats().backups_awaited_for_room, 1);
    c.pools_mut().pages.free(&pages).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
}

/// Fails one layer of a load-back of `a` begun by a request, and waits until every copy of
/// that load is done: the load is complete, failed and not acknowledged yet (no step boundary
/// since). Returns the request, which still holds `a`'s nodes.
fn load_with_a_failed_layer(
    c: &mut radixkv_hicache::HiRadixCache<radixkv_hicache::HostSim>,
    a: &[u32],
) -> RequestKv {
    let gate = c.backend().gate().unwrap().clone();
    gate.open();
    demote_to_host(c, a);
    let r1 = begin(c, a);
    c.backend().fail_next_copies(StreamKind::Load, 1);
    let step = c.start_loading().unwrap().expect("the request loads A");
    let counter = c.layer_counter().clone();
    counter.set_consumer(step.producer);
    assert!(
        counter.wait_until(0).is_err(),
        "the first layer's copy failed"
    );
    c.backend().wait_settled(StreamKind::Load);
    r1
}

#[test]
fn a_later_batch_that_matched_a_load_known_to_have_failed_is_told_so() {
    let mut c = gated_cache(16, DEFAULT_MAX_PENDING_OPS);
    let a = tokens(7, 9);
    let mut r1 = load_with_a_failed_layer(&mut c, &a);
    c.cache_finished_req(&mut r1, FinishKind::Aborted).unwrap();
    // Before any step boundary, a later batch matches A on the device: its pages are garbage
    // until the boundary repairs them, so the batch must not find nothing to wait for.
    let (mut r2, _) = later_batch_on_device(
        &mut c,
        &a,
        "batch 2 loads nothing but read a failed load's pages",
    );
    let counter = c.layer_counter().clone();
    assert!(
        counter.wait_until(0).is_err(),
        "the failure reaches batch 2"
    );
    // The boundary repairs A from its host copy; then the batch reads the right bytes.
    c.step().unwrap();
    assert!(c.start_loading().unwrap().is_none());
    finish_loaded(&mut c, &mut r2, &a);
    drained_after_one_repair(&mut c);
}

#[test]
fn a_failed_load_whose_repair_fails_too_fails_every_batch_until_it_is_repaired() {
    let mut c = gated_cache(16, DEFAULT_MAX_PENDING_OPS);
    let a = tokens(8, 9);
    let mut r1 = load_with_a_failed_layer(&mut c, &a);
    // The repair's copy fails as well, and the request still holds A's nodes: they can be
    // neither repaired nor demoted, and their pages stay garbage.
    c.backend().fail_next_copies(StreamKind::Load, 1);
    assert!(c.step().is_err(), "the repair failed");
    for _ in 0..2 {
        assert!(
            c.start_loading().is_err(),
            "a batch may read the unrepaired pages: it must not run"
        );
    }
    // A reset meanwhile is refused as for any KV a request holds (its drain retries the
    // repair twice, which fails both times), and drops nothing.
    c.backend().fail_next_copies(StreamKind::Load, 2);
    let before = c.host_tokens();
    assert!(
        matches!(c.reset(), Err(CacheError::Busy(_))),
        "reset with an unrepaired load held by a request"
    );
    assert_eq!(c.host_tokens(), before);
    // The next boundary repairs it; batches run again, on the right bytes.
    c.step().unwrap();
    assert!(c.start_loading().unwrap().is_none());
    finish_loaded(&mut c, &mut r1, &a);
    drained_after_one_repair(&mut c);
}
