//! Failed copies: a failed backup leaves the node device-only; a failed load is never
//! reported as a load and never leaves wrong KV in the tree. The tests of injected copy
//! failures run on every backend (`hostsim::*`, `cuda::*`); those that also need HostSim's
//! copy gate or refusals run on HostSim only.

mod common;

use common::backends::{Factory, FailCopies, for_each_backend};
use common::*;
use radixkv_hicache::{
    DEFAULT_MAX_PENDING_OPS, DeviceBackend, HiCacheError, HiRadixCache, HostLayout, HostSize,
    KvGeometry, POISON_BYTE, StreamKind, WritePolicy,
};
use radixkv_radix::{FinishKind, KvEvent, Medium, PrefixCache, RadixKey, RequestKv};

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 1000 + i).collect()
}

fn host_hit(c: &mut impl PrefixCache, t: &[u32]) -> (usize, usize) {
    let mut r = RequestKv::new(RadixKey::new(t.to_vec()));
    let m = c.match_request(&mut r).unwrap();
    (m.prefix_len, m.host_hit_len)
}

for_each_backend! {
    failed_backup_leaves_the_node_device_only => failed_backup_leaves_the_node_device_only(),
    failed_load_is_repaired_and_not_reported_as_loaded => failed_load_is_repaired_and_not_reported_as_loaded(),
    unrepairable_load_is_demoted_back_to_the_host => unrepairable_load_is_demoted_back_to_the_host(),
    reset_demotes_failed_loads_whose_repairs_fail => reset_demotes_failed_loads_whose_repairs_fail(),
}

/// A write-through cache of page size 2 over 16 device pages of `F`'s backend.
fn cache_of<F: Factory>(layout: HostLayout) -> Option<HiRadixCache<F::B>> {
    let g = KvGeometry::new(LAYERS, 2, BYTES_PER_TOKEN).unwrap();
    let dev = F::make(g, 16)?;
    Some(cache_on(
        dev,
        HostSize::Ratio(2.0),
        layout,
        WritePolicy::WriteThrough,
    ))
}

fn host_event_balance<B: DeviceBackend>(c: &mut HiRadixCache<B>) -> (usize, usize) {
    let mut n = (0, 0);
    for e in c.take_events() {
        match e {
            KvEvent::BlockStored {
                medium: Medium::Host,
                ..
            } => n.0 += 1,
            KvEvent::BlockRemoved {
                medium: Medium::Host,
                ..
            } => n.1 += 1,
            _ => {}
        }
    }
    n
}

fn failed_backup_leaves_the_node_device_only<F: Factory>() {
    let Some(mut c) = cache_of::<F>(HostLayout::PageFirst) else {
        return;
    };
    c.backend().fail_next_copies(StreamKind::Write, 1);
    let a = toks(1, 9);
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    let s = c.stats();
    assert_eq!((s.failed_writes, s.writes_acked), (1, 0));
    assert_eq!(c.host_tokens(), 0, "host pages freed");
    assert_eq!(c.protected_tokens(), 0, "lock released");
    assert_eq!(host_event_balance(&mut c), (0, 0), "never reported");
    c.check_invariants().unwrap();
    // Device-only: eviction drops it instead of demoting it to a garbage host copy.
    assert_eq!(c.evict(100), 8);
    assert_eq!(host_hit(&mut c, &a), (0, 0));
    // The next backup works and round-trips byte-exactly.
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    assert_eq!(c.host_tokens(), 8);
    c.evict(100);
    assert_eq!(serve(&mut c, &a).unwrap().loaded, 8);
    c.flush().unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn failed_backup_drops_backups_below_it() {
    let mut c = gated_cache(32, DEFAULT_MAX_PENDING_OPS);
    let a = toks(1, 9);
    let ab = toks(1, 17);
    // A's backup is held in flight; AB's backup of the tail queues behind it.
    serve(&mut c, &a).unwrap();
    serve(&mut c, &ab).unwrap();
    c.backend().fail_next_copies(StreamKind::Write, 1);
    c.backend().gate().unwrap().open();
    c.flush().unwrap();
    let s = c.stats();
    assert_eq!((s.failed_writes, s.writes_acked), (1, 1), "{s:?}");
    assert_eq!(s.dropped_backup_tokens, 16);
    assert_eq!(c.host_tokens(), 0, "the tail's good backup had to go too");
    let (stored, removed) = host_event_balance(&mut c);
    assert_eq!(
        (stored, removed),
        (1, 1),
        "the tail was reported, then removed"
    );
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
    // Nothing garbage is ever loaded: after eviction nothing is on the host.
    c.evict(100);
    assert_eq!(host_hit(&mut c, &ab), (0, 0));
    c.check_invariants().unwrap();
}

/// Demotes A to the host, then begins a request for it whose load is started; returns the
/// request (holding its row and lock) and whether waiting for every layer failed.
fn begin_loaded<B: DeviceBackend>(c: &mut HiRadixCache<B>, a: &[u32]) -> (RequestKv, bool) {
    serve(c, a).unwrap();
    c.flush().unwrap();
    c.evict(100);
    let mut r = RequestKv::new(RadixKey::new(a.to_vec()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    assert_eq!(r.prefix_len, 8, "the load-back extended the prefix");
    let step = c.start_loading().unwrap().unwrap();
    let counter = c.layer_counter().clone();
    counter.set_consumer(step.producer);
    let mut failed = false;
    for l in 0..LAYERS {
        if let Err(e) = counter.wait_until(l) {
            assert!(matches!(e, HiCacheError::Transfer(_)));
            failed = true;
        }
    }
    (r, failed)
}

fn finish<B: DeviceBackend>(c: &mut HiRadixCache<B>, r: &mut RequestKv, tokens: &[u32]) {
    // Only a partial page is left to compute: no whole page of new KV to write.
    c.alloc_tokens(r, tokens.len() - r.prefix_len).unwrap();
    r.commit(tokens.len() - r.prefix_len).unwrap();
    c.cache_finished_req(r, FinishKind::Finished).unwrap();
}

fn failed_load_is_repaired_and_not_reported_as_loaded<F: Factory>() {
    let Some(mut c) = cache_of::<F>(HostLayout::PageFirst) else {
        return;
    };
    let a = toks(1, 9);
    c.backend().fail_next_copies(StreamKind::Load, 1);
    let (mut r, failed) = begin_loaded(&mut c, &a);
    assert!(failed, "the forward pass is told");
    // Layer 0 holds garbage until the repair.
    let g = c.backend().geometry();
    let mut buf = vec![0u8; g.page_bytes_per_layer()];
    let prefix = row_prefix(&c, &r);
    c.backend()
        .read_device_page(0, prefix[0], &mut buf)
        .unwrap();
    assert!(buf.iter().all(|&b| b == POISON_BYTE));
    let acks = c.step().unwrap();
    assert!(acks.loads.is_empty() && acks.failed_loads.len() == 1);
    let s = c.stats();
    assert_eq!((s.loads_acked, s.failed_loads, s.repaired_loads), (0, 1, 1));
    check_pages(&**c.backend(), &prefix, &hashes(&a, 2)[..4]);
    finish(&mut c, &mut r, &a);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
}

fn unrepairable_load_is_demoted_back_to_the_host<F: Factory>() {
    let Some(mut c) = cache_of::<F>(HostLayout::LayerFirst) else {
        return;
    };
    let a = toks(1, 9);
    // Every layer fails, and so do the repairs at the next two steps.
    c.backend()
        .fail_next_copies(StreamKind::Load, LAYERS as u32 + 2);
    let (mut r, failed) = begin_loaded(&mut c, &a);
    assert!(failed);
    let free_before = c.pools().pages.available();
    assert!(matches!(c.step(), Err(HiCacheError::Transfer(_))));
    assert_eq!(
        c.stats().demoted_failed_loads,
        0,
        "still used by the request"
    );
    // The scheduler aborts the request; the next step demotes the garbage pages.
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    assert!(matches!(c.step(), Err(HiCacheError::Transfer(_))));
    assert_eq!(c.stats().demoted_failed_loads, 1);
    assert!(
        c.pools().pages.available() >= free_before + 4,
        "the loaded pages went back to the allocator"
    );
    assert_eq!(
        host_hit(&mut c, &a),
        (0, 8),
        "host-only again, not on device"
    );
    c.check_invariants().unwrap();
    // Faults are exhausted: a fresh request loads the intact host copy byte-exactly.
    assert_eq!(serve(&mut c, &a).unwrap().loaded, 8);
    c.step().unwrap();
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
}

/// A reset drains the tier, repairing failed loads or demoting them to the host. Two failed
/// loads, one above the other: the first drain's repairs fail, and the upper load cannot be
/// demoted while the lower one's nodes are on device below it (the lower one can). The second
/// drain's repair fails too, and demotes the upper load. Nothing is left to repair, so the
/// reset goes through. (Found by fuzzing `hicache_ops`: the reset returned the last repair's
/// error, folded into an invalid request state, though its load had been demoted.)
fn reset_demotes_failed_loads_whose_repairs_fail<F: Factory>() {
    let Some(mut c) = cache_of::<F>(HostLayout::PageFirst) else {
        return;
    };
    let a = toks(1, 9);
    let ab: Vec<u32> = a[..8].iter().copied().chain(toks(2, 9)).collect();
    serve(&mut c, &ab).unwrap();
    c.flush().unwrap();
    c.evict(100);
    // r1 loads A's 8 host tokens back; r2, begun after it, loads the 8 host tokens below.
    let mut r1 = begin(&mut c, &a);
    let mut r2 = begin(&mut c, &ab);
    assert_eq!((r1.prefix_len, r2.prefix_len), (8, 16));
    // The merged load fails at every layer; the first drain's two repairs and the second
    // drain's one fail too.
    c.backend()
        .fail_next_copies(StreamKind::Load, LAYERS as u32 + 3);
    let step = c.start_loading().unwrap().unwrap();
    let counter = c.layer_counter().clone();
    counter.set_consumer(step.producer);
    assert!((0..LAYERS).any(|l| counter.wait_until(l).is_err()));
    // The scheduler aborts both before a step reports the failure.
    c.cache_finished_req(&mut r1, FinishKind::Aborted).unwrap();
    c.cache_finished_req(&mut r2, FinishKind::Aborted).unwrap();
    c.reset().unwrap();
    let s = c.stats();
    assert_eq!(
        (s.failed_loads, s.repaired_loads, s.demoted_failed_loads),
        (2, 0, 2),
        "{s:?}"
    );
    assert_eq!(c.protected_tokens(), 0);
    assert_eq!(c.host_tokens(), 0);
    assert_eq!(c.pools().pages.tree_pages(), 0);
    assert_eq!(host_hit(&mut c, &ab), (0, 0));
    c.check_invariants().unwrap();
    // The faults are used up, and the cache works after the reset: a backup and its load-back
    // round-trip byte-exactly.
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    c.evict(100);
    assert_eq!(serve(&mut c, &a).unwrap().loaded, 8);
    c.flush().unwrap();
    c.check_invariants().unwrap();
}

/// The forward pass stops at the first failed layer, and the step boundary comes while the
/// load's later layers are still being copied. That step must not return `Ok` before it
/// repaired the load: the batch is re-run on its pages after an `Ok`.
#[test]
fn step_right_after_a_failed_layer_repairs_the_load_still_in_flight() {
    let mut c = gated_cache(16, DEFAULT_MAX_PENDING_OPS);
    let gate = c.backend().gate().unwrap().clone();
    let a = toks(1, 9);
    gate.open();
    demote_to_host(&mut c, &a);
    gate.close();
    c.backend().fail_next_copies(StreamKind::Load, 1);
    let mut r = begin(&mut c, &a);
    assert_eq!(r.prefix_len, 8, "the load-back extended the prefix");
    let step = c.start_loading().unwrap().expect("A is loaded back");
    let counter = c.layer_counter().clone();
    counter.set_consumer(step.producer);
    // Layer 0's copy runs and fails; the later layers stay held.
    gate.release_on(StreamKind::Load, 1);
    assert!(matches!(
        counter.wait_until(0),
        Err(HiCacheError::Transfer(_))
    ));
    assert!(!counter.is_layer_done(step.producer, 1));
    // Held copies run only once somebody waits for them: a step that returns without
    // waiting finds the load still held, with layer 0 still garbage.
    gate.open_when_waited();
    let acks = c.step().expect("the repair's copy does not fail");
    check_pages(&**c.backend(), &row_prefix(&c, &r), &hashes(&a, 2)[..4]);
    assert_eq!(acks.failed_loads.len(), 1, "{acks:?}");
    assert!(acks.loads.is_empty(), "never reported as loaded");
    let s = c.stats();
    assert_eq!((s.loads_acked, s.failed_loads, s.repaired_loads), (0, 1, 1));
    // The re-run batch has nothing left to wait for and reads the repaired KV.
    assert!(c.start_loading().unwrap().is_none());
    finish_loaded(&mut c, &mut r, &a);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
}

#[test]
fn failed_backup_above_a_refused_backup_reports_no_host_removal() {
    let mut c = gated_cache(32, DEFAULT_MAX_PENDING_OPS);
    let a = toks(1, 9);
    let ab = toks(1, 17);
    // A's backup is held in flight; the tail's backup is refused at the insert and at the
    // step's retry, so it is still queued (never copied, never reported) when A's fails.
    serve(&mut c, &a).unwrap();
    c.backend().refuse_next_submissions(StreamKind::Write, 2);
    serve(&mut c, &ab).unwrap();
    c.backend().fail_next_copies(StreamKind::Write, 1);
    c.backend().gate().unwrap().open();
    c.backend().wait_settled(StreamKind::Write);
    // The step's retry is refused; then it applies A's failed ack.
    let _ = c.step();
    assert_eq!(
        c.stats().failed_writes,
        2,
        "the queued tail is undone with A"
    );
    let (stored, removed) = host_event_balance(&mut c);
    assert_eq!(
        (stored, removed),
        (0, 0),
        "neither backup was reported stored, so neither may be reported removed"
    );
    c.flush().unwrap();
    let (stored, removed) = host_event_balance(&mut c);
    assert_eq!(stored, removed, "no host removal without its store");
    assert_eq!(c.host_tokens(), 0, "both backups were undone");
    assert_eq!(c.protected_tokens(), 0);
    c.check_invariants().unwrap();
}
