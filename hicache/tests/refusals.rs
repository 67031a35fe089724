//! A backend that refuses a submission (`enqueue_copy` / `record_event` return an error) must
//! not lose the operations: the controller re-queues them and the next start retries, and no
//! KV is ever served from a copy that did not happen. And a request the cache refuses (no
//! row left) changes nothing.

mod common;

use std::sync::Arc;

use common::hybrid::{self, Setup, build};
use common::*;
use radixkv_hicache::{
    HiCacheError, HiRadixCache, HostLayout, HostPool, HostSim, HostSimConfig, HostSize,
    HybridCacheController, KvGeometry, StreamKind, WritePolicy,
};
use radixkv_radix::{
    CacheError, FinishKind, PageAllocator, PageId, PrefixCache, RadixKey, RequestKv,
};

fn controller() -> (Arc<HostSim>, HybridCacheController<HostSim>, KvGeometry) {
    let g = KvGeometry::new(LAYERS, 2, BYTES_PER_TOKEN).unwrap();
    let dev = Arc::new(HostSim::new(g, 16, HostSimConfig::default()).unwrap());
    let pool = HostPool::new(g, 16, HostLayout::PageFirst).unwrap();
    let ctrl = HybridCacheController::new(dev.clone(), pool, &[]).unwrap();
    (dev, ctrl, g)
}

fn check_host(ctrl: &HybridCacheController<HostSim>, g: &KvGeometry, host: &[u32], hs: &[u64]) {
    let mut buf = vec![0u8; g.page_bytes_per_layer()];
    for (&h, &x) in host.iter().zip(hs) {
        for l in 0..LAYERS {
            ctrl.host().memory().read_page(l, h, &mut buf).unwrap();
            assert!(buf == page_bytes(g, x, l), "host page {h} layer {l}");
        }
    }
}

#[test]
fn controller_requeues_a_refused_backup_and_retries_it() {
    let (dev, mut ctrl, g) = controller();
    let src: Vec<PageId> = (0..6).map(PageId).collect();
    let hs: Vec<u64> = (0..6).map(|i| mix(i + 3)).collect();
    write_pages(&*dev, &src, &hs);
    let a = ctrl.write(&src[..3], 0, Vec::new()).unwrap().clone();
    let b = ctrl.write(&src[3..], 0, Vec::new()).unwrap().clone();
    dev.refuse_next_submissions(StreamKind::Write, 1);
    assert!(matches!(
        ctrl.start_writing(),
        Err(HiCacheError::Transfer(_))
    ));
    assert_eq!(ctrl.queued(), (2, 0), "both backups are queued again");
    assert_eq!(ctrl.in_flight(), (0, 0));
    let stats = ctrl
        .start_writing()
        .unwrap()
        .expect("the retry submits them");
    assert_eq!(stats.ops, 2);
    ctrl.wait_all().unwrap();
    let acks = ctrl.poll_acks();
    assert_eq!(acks.writes, vec![a.id, b.id]);
    assert!(!acks.has_failures());
    assert_eq!(ctrl.pending(), (0, 0));
    let host: Vec<u32> = a.host_pages.iter().chain(&b.host_pages).copied().collect();
    check_host(&ctrl, &g, &host, &hs);
}

#[test]
fn controller_requeues_a_refused_load_and_retries_it() {
    let (dev, mut ctrl, g) = controller();
    let src: Vec<PageId> = (0..4).map(PageId).collect();
    let hs: Vec<u64> = (0..4).map(|i| mix(i + 11)).collect();
    write_pages(&*dev, &src, &hs);
    let host = ctrl.write(&src, 0, Vec::new()).unwrap().host_pages.clone();
    ctrl.start_writing().unwrap();
    ctrl.wait_all().unwrap();
    assert_eq!(ctrl.poll_acks().writes.len(), 1);
    let mut alloc = PageAllocator::new(16).unwrap();
    alloc.alloc(4).unwrap(); // the sources stay allocated
    let op = ctrl.load(&host, &mut alloc, Vec::new()).unwrap().clone();
    dev.refuse_next_submissions(StreamKind::Load, 1);
    assert!(matches!(
        ctrl.start_loading(),
        Err(HiCacheError::Transfer(_))
    ));
    assert_eq!(ctrl.queued(), (0, 1), "the load is queued again");
    let step = ctrl.start_loading().unwrap().expect("the retry submits it");
    ctrl.layer_counter().set_consumer(step.producer);
    for l in 0..LAYERS {
        ctrl.layer_counter().wait_until(l).unwrap();
    }
    ctrl.wait_all().unwrap();
    assert_eq!(ctrl.poll_acks().loads, vec![op.id]);
    check_pages(&*dev, &op.device_pages, &hs);
    let _ = g;
}

fn hi(policy: WritePolicy) -> HiRadixCache<HostSim> {
    cache(2, 16, HostSize::Ratio(2.0), HostLayout::PageFirst, policy)
}

/// Everything is settled and nothing leaks: no lock, no unacknowledged backup, no row, every
/// device page free or in the tree.
fn settled(c: &mut HiRadixCache<HostSim>) {
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0, "a transfer lock leaked");
    assert_eq!(c.unacked_backup_pages(), 0);
    assert_eq!(c.controller().pending(), (0, 0));
    let p = c.pools();
    assert_eq!(p.rows.live(), 0);
    assert_eq!(p.pages.available() + p.pages.tree_pages(), p.pages.total());
}

#[test]
fn refused_backup_is_retried_at_the_next_step() {
    let mut c = hi(WritePolicy::WriteThrough);
    let a = tokens(1, 9);
    c.backend().refuse_next_submissions(StreamKind::Write, 1);
    // The refusal is not the request's failure: it finishes normally.
    serve(&mut c, &a).unwrap();
    assert_eq!(c.stats().refused_submissions, 1);
    assert_eq!(c.controller().queued().0, 1, "the backup waits for a retry");
    assert!(c.protected_tokens() > 0, "still pinned until its ack");
    c.step().unwrap();
    settled(&mut c);
    assert_eq!(c.stats().writes_acked, 1);
    assert_eq!(c.host_tokens(), 8);
    // The retried copy is the real KV: demote A and load it back byte for byte.
    c.evict(100);
    assert_eq!(serve(&mut c, &a).unwrap().loaded, 8);
    settled(&mut c);
}

#[test]
fn refused_write_back_evicts_without_backup_and_serves_no_wrong_kv() {
    let mut c = hi(WritePolicy::WriteBack);
    let a = tokens(1, 9);
    serve(&mut c, &a).unwrap();
    // A synchronous eviction of A backs it up first, and that submission is refused.
    c.backend().refuse_next_submissions(StreamKind::Write, 1);
    c.evict(100);
    let s = c.stats();
    assert_eq!(s.refused_submissions, 1);
    assert_eq!(s.demoted_tokens, 0, "{s:?}");
    assert!(s.dropped_without_backup >= 8, "{s:?}");
    c.step().unwrap();
    settled(&mut c);
    // A is recomputed, never loaded from a host copy taken after its pages were reused.
    let served = serve(&mut c, &a).unwrap();
    assert_eq!((served.host_hit, served.loaded), (0, 0));
    settled(&mut c);
}

#[test]
fn refused_async_write_back_is_retried_and_serves_the_right_kv() {
    let mut c = hi(WritePolicy::WriteBack);
    let a = tokens(1, 9);
    serve(&mut c, &a).unwrap();
    // B needs A's pages: its allocation evicts A asynchronously (A stays pinned until the
    // ack), the submission is refused, and the allocation, which cannot wait a step,
    // completes the write-back, retrying the submission first.
    c.backend().refuse_next_submissions(StreamKind::Write, 1);
    let b = tokens(2, 29);
    serve(&mut c, &b).unwrap();
    let s = c.stats();
    assert_eq!(s.refused_submissions, 1);
    assert_eq!(s.write_backs_async, 1, "{s:?}");
    assert_eq!(s.backups_awaited_for_room, 1, "{s:?}");
    assert_eq!(s.dropped_without_backup, 0, "{s:?}");
    assert!(s.demoted_tokens >= 8, "{s:?}");
    c.step().unwrap();
    settled(&mut c);
    // A comes back from its host copy, byte for byte (`serve` checks the bytes).
    let served = serve(&mut c, &a).unwrap();
    assert_eq!(served.loaded, 8);
    settled(&mut c);
}

#[test]
fn reset_of_an_idle_cache_succeeds_while_the_backend_refuses_backups() {
    // Found by fuzzing (hicache_ops): a backup refused at submission stays queued, and a reset
    // that drained the tier first failed on the refusal, so an idle cache could not be reset.
    let mut c = hi(WritePolicy::WriteThrough);
    c.backend().refuse_next_submissions(StreamKind::Write, 3);
    serve(&mut c, &tokens(1, 9)).unwrap();
    assert_eq!(c.controller().queued().0, 1, "the backup waits for a retry");
    // Everything is discarded, so the queued backup is dropped instead of retried.
    c.reset().unwrap();
    settled(&mut c);
    assert_eq!(c.host_tokens(), 0);
    assert_eq!(c.pools().pages.tree_pages(), 0);
    // The cache works afterwards, and the next backup (the refusals used up) lands.
    let a = tokens(2, 9);
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    c.evict(100);
    assert_eq!(serve(&mut c, &a).unwrap().loaded, 8);
    settled(&mut c);
}

/// A write-through cache with `a` (9 tokens) host-only, a request begun on it (its 8-token
/// load-back queued) and the next load submission refused.
fn host_hit_with_a_refused_load() -> (HiRadixCache<HostSim>, Vec<u32>, RequestKv) {
    let mut c = hi(WritePolicy::WriteThrough);
    let a = tokens(1, 9);
    demote_to_host(&mut c, &a);
    let r = begin(&mut c, &a);
    assert_eq!(r.prefix_len, 8);
    c.backend().refuse_next_submissions(StreamKind::Load, 1);
    (c, a, r)
}

#[test]
fn refused_load_is_retried_and_the_batch_is_told_not_to_run() {
    let (mut c, a, mut r) = host_hit_with_a_refused_load();
    assert!(matches!(c.start_loading(), Err(HiCacheError::Transfer(_))));
    assert_eq!(c.controller().queued().1, 1);
    // The step boundary does not lose it either.
    c.step().unwrap();
    let step = c
        .start_loading()
        .unwrap()
        .expect("the retry starts the load");
    let counter = c.layer_counter().clone();
    counter.set_consumer(step.producer);
    for l in 0..LAYERS {
        counter.wait_until(l).unwrap();
    }
    check_pages(&**c.backend(), &row_prefix(&c, &r), &hashes(&a, 2)[..4]);
    c.alloc_tokens(&mut r, 1).unwrap();
    r.commit(1).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    settled(&mut c);
    assert_eq!(c.stats().loads_acked, 1);
}

/// A reset while a load-back waits for the retry of its refused submission is refused as
/// `Busy` (the load holds its lock until its ack) and drops nothing; the load then completes.
/// (Found by fuzzing `hicache_ops`: the reset returned the refusal's own error.)
#[test]
fn reset_with_a_refused_load_queued_is_busy() {
    let (mut c, a, mut r) = host_hit_with_a_refused_load();
    let host = c.host_tokens();
    assert_eq!(
        c.reset(),
        Err(CacheError::Busy(
            "a load-back waits for the retry of its refused submission"
        ))
    );
    assert_eq!(c.controller().queued().1, 1, "the load waits for a retry");
    assert_eq!(c.host_tokens(), host);
    c.check_invariants().unwrap();
    c.flush().unwrap();
    check_pages(&**c.backend(), &row_prefix(&c, &r), &hashes(&a, 2)[..4]);
    c.alloc_tokens(&mut r, 1).unwrap();
    r.commit(1).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    settled(&mut c);
    c.reset().unwrap();
    settled(&mut c);
    // The same once the request is gone: its load keeps its lock until the retry's ack.
    demote_to_host(&mut c, &a);
    let mut r = begin(&mut c, &a);
    c.backend().refuse_next_submissions(StreamKind::Load, 1);
    assert!(c.start_loading().is_err());
    c.cache_finished_req(&mut r, FinishKind::Aborted).unwrap();
    c.backend().refuse_next_submissions(StreamKind::Load, 1);
    assert!(matches!(c.reset(), Err(CacheError::Busy(_))));
    assert!(c.protected_tokens() > 0, "the queued load's lock");
    c.check_invariants().unwrap();
    c.step().unwrap();
    c.reset().unwrap();
    settled(&mut c);
}

/// Out of request rows, a host hit's `begin_request` is refused before its load-back is
/// queued: no device page is taken, nothing is queued and the prefix stays on the host. (It
/// once queued the load and then failed on the row.)
#[test]
fn begin_out_of_rows_queues_no_load_back() {
    let mut c = cache(
        2,
        128,
        HostSize::Pages(64),
        HostLayout::PageFirst,
        WritePolicy::WriteThrough,
    );
    let t = tokens(1, 17);
    demote_to_host(&mut c, &t);
    let mut held: Vec<RequestKv> = (0..c.pools().rows.capacity() as u32)
        .map(|i| begin(&mut c, &tokens(100 + i, 2)))
        .collect();
    let mut r = RequestKv::new(RadixKey::new(t.clone()));
    c.match_request(&mut r).unwrap();
    assert_eq!((r.prefix_len, r.host_hit_len), (0, 16));
    let footprint = |c: &HiRadixCache<HostSim>| {
        (
            c.pools().pages.available(),
            c.controller().queued(),
            c.controller().pending(),
            c.stats().loaded_tokens,
            c.host_tokens(),
            c.device_cache().tree().device_tokens(),
        )
    };
    let before = footprint(&c);
    assert!(matches!(
        c.begin_request(&mut r),
        Err(CacheError::OutOfRows { .. })
    ));
    assert_eq!(footprint(&c), before);
    assert!(r.row.is_none() && r.lock.is_none());
    assert_eq!((r.prefix_len, r.host_hit_len), (0, 16));
    c.check_invariants().unwrap();
    // Once a row is free the same request begins, loads its prefix back and reads it exact.
    for mut h in held.drain(..) {
        c.cache_finished_req(&mut h, FinishKind::Aborted).unwrap();
    }
    c.begin_request(&mut r).unwrap();
    assert_eq!(c.stats().loaded_tokens, 16);
    c.flush().unwrap();
    finish_loaded(&mut c, &mut r, &t);
    settled(&mut c);
}

/// A KV-only tree takes a key that dropped the prefix its lock covers
/// (`RequestKv::drop_cached_prefix`): the host tier's walks (the events' pre-insert walk and
/// the write-through backups) start at the lock anchor, and the cache ends exactly as with the
/// whole key: the same events, the same backups, the same host hit, nothing held.
#[test]
fn a_key_without_its_cached_prefix_is_walked_from_its_lock_anchor() {
    let history: Vec<u32> = (0..16).collect();
    let mut prompt = history.clone();
    prompt.extend(100..106);
    let decoded: Vec<u32> = (200..206).collect();
    let mut whole = prompt.clone();
    whole.extend(&decoded);
    let mut seen = Vec::new();
    for release in [false, true] {
        let mut c = cache(
            4,
            32,
            HostSize::Ratio(2.0),
            HostLayout::PageFirst,
            WritePolicy::WriteThrough,
        );
        assert!(c.takes_windowed_keys());
        let rows = c.pools().rows.available();
        serve(&mut c, &history).unwrap();
        c.flush().unwrap();
        c.take_events();
        let mut r = begin(&mut c, &prompt);
        assert_eq!(r.prefix_len, 16);
        c.alloc_tokens(&mut r, 6).unwrap();
        r.commit(6).unwrap();
        c.cache_unfinished_req(&mut r).unwrap();
        if release {
            // The lock now ends at token 20: the key keeps its last partial page.
            assert_eq!(r.drop_cached_prefix(usize::MAX), 20);
            assert_eq!((r.key_start, r.key.len()), (20, 2));
        }
        c.check_request(&r).unwrap();
        r.append_tokens(&decoded);
        c.alloc_tokens(&mut r, 6).unwrap();
        r.commit(6).unwrap();
        c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
        assert_eq!((r.row, r.lock.is_none()), (None, true));
        c.flush().unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.protected_tokens(), 0);
        assert_eq!(c.pools().rows.available(), rows);
        let mut events: Vec<String> = c.take_events().iter().map(|e| format!("{e:?}")).collect();
        // The same events, in whatever order the copies' acks let them come.
        events.sort();
        // Everything was backed up: off the device, the whole sequence is a host hit.
        c.evict(usize::MAX / 2);
        let mut m = RequestKv::new(RadixKey::new(whole.clone()));
        let hit = c.match_request(&mut m).unwrap();
        seen.push((events, c.stats().backed_up_tokens, hit.host_hit_len));
    }
    assert_eq!(seen[0], seen[1]);
    assert_eq!((seen[1].1, seen[1].2), (28, 24), "{:?}", seen[1]);
}

/// A windowed key that does not reach back to its lock anchor (it dropped tokens past the
/// anchor's end) cannot be walked: its finish is refused with a typed error and releases the
/// request, leaking nothing.
#[test]
fn a_key_that_starts_past_its_lock_anchor_is_refused_and_released() {
    let mut c = cache(
        4,
        32,
        HostSize::Ratio(2.0),
        HostLayout::PageFirst,
        WritePolicy::WriteThrough,
    );
    let rows = c.pools().rows.available();
    let history: Vec<u32> = (0..16).collect();
    serve(&mut c, &history).unwrap();
    let mut prompt = history.clone();
    prompt.extend(100..110);
    let mut r = begin(&mut c, &prompt);
    assert_eq!(r.drop_cached_prefix(usize::MAX), 16);
    // Four tokens past the anchor's end go too, as no correct caller drops them.
    r.key.tokens.drain(..4);
    r.key_start += 4;
    c.alloc_tokens(&mut r, 10).unwrap();
    r.commit(10).unwrap();
    finish_is_refused_and_released(&mut c, &mut r, rows);
}

/// The Mamba and SWA components read a request's whole key: such a cache refuses a key that
/// dropped its cached prefix, and its finish releases it, leaking nothing.
#[test]
fn a_key_without_its_cached_prefix_is_refused_with_a_mamba_or_swa_component() {
    for setup in [Setup::mamba(), Setup::swa()] {
        let mut c = build(&setup);
        assert!(!c.takes_windowed_keys());
        let p = c.page_size();
        let rows = c.pools().rows.available();
        let history = tokens(7, 4 * p);
        hybrid::serve(&mut c, &history);
        let mut prompt = history.clone();
        prompt.extend(tokens(8, p + 2));
        let mut r = begin(&mut c, &prompt);
        assert!(r.drop_cached_prefix(usize::MAX) > 0);
        c.alloc_tokens(&mut r, p + 2).unwrap();
        r.commit(p + 2).unwrap();
        assert!(matches!(
            c.cache_unfinished_req(&mut r),
            Err(CacheError::InvalidRequestState(_))
        ));
        assert!(matches!(
            c.match_request(&mut RequestKv {
                key_start: 1,
                ..RequestKv::new(RadixKey::new(vec![1, 2, 3]))
            }),
            Err(CacheError::InvalidRequestState(_))
        ));
        finish_is_refused_and_released(&mut c, &mut r, rows);
    }
}

/// `r`'s finish is refused with a typed error and still releases it: no row or lock left,
/// nothing protected, every one of the cache's `rows` back, the invariants whole.
fn finish_is_refused_and_released(c: &mut HiRadixCache<HostSim>, r: &mut RequestKv, rows: usize) {
    assert!(matches!(
        c.cache_finished_req(r, FinishKind::Finished),
        Err(CacheError::InvalidRequestState(_))
    ));
    assert_eq!((r.row, r.lock.is_none()), (None, true));
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
    assert_eq!(c.pools().rows.available(), rows);
}
