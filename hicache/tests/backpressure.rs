//! The controller's limit on pending operations: what happens when it is reached. A backup
//! that cannot be queued is skipped and counted (the prefix stays device-only); a load-back
//! is never skipped silently: `begin_request` says `Busy` and changes nothing.

mod common;

use std::sync::Arc;

use common::*;
use radixkv_hicache::{
    HiCacheError, HostLayout, HostPool, HostSim, HostSimConfig, HybridCacheController, KvGeometry,
    StreamKind,
};
use radixkv_radix::{CacheError, PageAllocator, PageId, PrefixCache, RadixKey, RequestKv};

#[test]
fn controller_refuses_past_its_limit_and_allocates_nothing() {
    let g = KvGeometry::new(LAYERS, 2, BYTES_PER_TOKEN).unwrap();
    let dev = Arc::new(HostSim::new(g, 8, HostSimConfig::default()).unwrap());
    let pool = HostPool::new(g, 8, HostLayout::LayerFirst).unwrap();
    let mut ctrl = HybridCacheController::new(dev, pool, &[]).unwrap();
    assert!(ctrl.set_max_pending_ops(0).is_err());
    ctrl.set_max_pending_ops(1).unwrap();
    let host = ctrl
        .write(&[PageId(0)], 0, Vec::new())
        .unwrap()
        .host_pages
        .clone();
    assert_eq!(
        ctrl.write(&[PageId(1)], 0, Vec::new()).unwrap_err(),
        HiCacheError::QueueFull {
            stream: StreamKind::Write,
            limit: 1
        }
    );
    assert_eq!(ctrl.host().used(), 1, "the refused write allocated nothing");
    // Started and not yet acknowledged still counts; the ack frees the slot.
    ctrl.start_writing().unwrap();
    assert!(!ctrl.has_room(StreamKind::Write));
    ctrl.wait_all().unwrap();
    assert_eq!(ctrl.poll_acks().writes.len(), 1);
    assert!(ctrl.has_room(StreamKind::Write));
    // Loads have their own limit.
    let mut alloc = PageAllocator::new(8).unwrap();
    ctrl.load(&host, &mut alloc, Vec::new()).unwrap();
    let free = alloc.available();
    assert!(matches!(
        ctrl.load(&host, &mut alloc, Vec::new()),
        Err(HiCacheError::QueueFull {
            stream: StreamKind::Load,
            ..
        })
    ));
    assert_eq!(
        alloc.available(),
        free,
        "the refused load allocated nothing"
    );
    ctrl.write(&[PageId(2)], 0, Vec::new()).unwrap();
}

#[test]
fn a_backup_that_cannot_be_queued_is_skipped_and_counted() {
    let mut c = gated_cache(32, 1);
    let (a, b) = (tokens(1, 9), tokens(2, 9));
    serve(&mut c, &a).unwrap(); // A's backup is held in flight by the gate
    serve(&mut c, &b).unwrap(); // B's finds the write side full
    assert_eq!(c.stats().backups_skipped_queue_full, 1);
    c.backend().gate().unwrap().open();
    c.flush().unwrap();
    assert_eq!(c.stats().writes_acked, 1);
    assert_eq!(c.host_tokens(), 8, "only A is on the host");
    c.check_invariants().unwrap();
    // B was left device-only: evicted, it is gone; A comes back from the host, byte-exact.
    c.evict(100);
    assert_eq!(serve(&mut c, &b).unwrap().host_hit, 0);
    assert_eq!(serve(&mut c, &a).unwrap().loaded, 8);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
}

#[test]
fn a_load_that_cannot_be_queued_is_busy_and_changes_nothing() {
    let mut c = gated_cache(32, 1);
    c.backend().gate().unwrap().open();
    let (a, b) = (tokens(1, 9), tokens(2, 9));
    demote_to_host(&mut c, &a);
    demote_to_host(&mut c, &b);
    let mut ra = begin(&mut c, &a);
    assert_eq!(ra.prefix_len, 8, "A's load is queued");
    let mut rb = RequestKv::new(RadixKey::new(b.clone()));
    assert_eq!(c.match_request(&mut rb).unwrap().host_hit_len, 8);
    let (avail, protected, rows) = (
        c.pools().pages.available(),
        c.protected_tokens(),
        c.pools().rows.live(),
    );
    assert!(matches!(c.begin_request(&mut rb), Err(CacheError::Busy(_))));
    assert_eq!(c.stats().load_back_queue_full, 1);
    assert_eq!(
        (
            c.pools().pages.available(),
            c.protected_tokens(),
            c.pools().rows.live()
        ),
        (avail, protected, rows),
        "nothing allocated, locked or evicted"
    );
    assert!(rb.row.is_none() && rb.lock.is_none());
    c.check_invariants().unwrap();
    // A's load completes and is acknowledged at the step; then B's load is accepted.
    c.start_loading().unwrap().unwrap();
    c.flush().unwrap();
    c.begin_request(&mut rb).unwrap();
    assert_eq!(rb.prefix_len, 8);
    let step = c.start_loading().unwrap().unwrap();
    wait_layers(&c, step.producer);
    finish_loaded(&mut c, &mut ra, &a);
    finish_loaded(&mut c, &mut rb, &b);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
}
