//! Bounded memory at the facade: the KV event buffer holds at most its capacity and counts
//! what it drops, and a full host-tier load queue makes admission wait instead of failing or
//! silently skipping the load.

mod common;

use common::admitted;
use radixkv_radix::{KvEvent, KvEventBatch};
use radixkv_scheduler_api::{
    Admission, CacheKind, HostTier, KvCacheManager, ReqId, Request, WaitReason, WritePolicy,
};

/// Prefill in one step, no decode, finish.
fn serve(kv: &mut KvCacheManager, tokens: Vec<u32>) -> radixkv_scheduler_api::Admitted {
    let id = kv.arrive(Request::new(tokens).max_new_tokens(1)).unwrap();
    let a = admitted(kv, id);
    run(kv, id, a.extend_tokens);
    a
}

fn run(kv: &mut KvCacheManager, id: ReqId, extend: usize) {
    kv.extend(id, extend).unwrap();
    let step = kv.begin_step();
    for l in 0..kv.config().model.layers {
        step.wait_layer(l).unwrap();
    }
    kv.end_step(step).unwrap();
    kv.chunk_done(id).unwrap();
    kv.finish(id).unwrap();
    kv.check_invariants().unwrap();
}

/// A device-only manager whose KV event buffer holds four events.
fn manager_with_four_events() -> KvCacheManager {
    KvCacheManager::builder()
        .device_tokens(4096)
        .page_size(4)
        .events(true)
        .event_capacity(4)
        .build()
        .unwrap()
}

fn prompt(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| seed * 1000 + i).collect()
}

#[test]
fn event_buffer_is_bounded_and_drops_are_counted_and_exported() {
    let mut kv = manager_with_four_events();
    // Nobody drains: ten distinct prompts store at least ten blocks.
    for s in 0..10 {
        serve(&mut kv, prompt(s, 16));
    }
    // A step end collects what the last request left in the cache.
    let step = kv.begin_step();
    kv.end_step(step).unwrap();
    let dropped = kv.events_dropped();
    let m = kv.metrics();
    assert!(dropped > 0);
    assert_eq!(
        dropped,
        m.counters.kv_events - 4,
        "all but four collected were dropped"
    );
    assert_eq!(m.counters.kv_events_dropped, dropped);
    assert!(
        m.to_openmetrics()
            .contains(&format!("radixkv_kv_events_dropped_total {dropped}\n")),
        "exported"
    );
    let held = kv.take_events();
    assert_eq!(held.len(), 4, "the buffer holds its capacity, no more");
    assert!(
        matches!(held[0], KvEvent::BlockStored { .. }),
        "the oldest kept"
    );
    // A consumer that drains every step loses nothing.
    for s in 10..20 {
        serve(&mut kv, prompt(s, 16));
        assert!(!kv.take_events().is_empty());
        assert_eq!(kv.events_dropped(), dropped);
    }
}

#[test]
fn batch_sequence_numbers_have_a_gap_exactly_where_events_were_dropped() {
    let mut kv = manager_with_four_events();
    let mut next = 0;
    // Drained after every request: consecutive numbers.
    for s in 0..5 {
        serve(&mut kv, prompt(s, 16));
        let b = kv.take_event_batch();
        assert!(!b.events.is_empty());
        assert_eq!(b.seq, next, "no drop, no gap");
        assert!(b.timestamp_ms > 0);
        next = b.next_seq();
    }
    // `take_events` shares the numbering: mixing the two opens no gap.
    serve(&mut kv, prompt(5, 16));
    next += kv.take_events().len() as u64;
    assert_eq!(kv.events_dropped(), 0);
    // Nobody drains for a while: the buffer drops, and the next batch skips exactly as many
    // numbers as were dropped.
    for s in 6..16 {
        serve(&mut kv, prompt(s, 16));
    }
    let step = kv.begin_step();
    kv.end_step(step).unwrap();
    let lost = kv.events_dropped();
    assert!(lost > 0);
    let b = kv.take_event_batch();
    assert_eq!(b.seq, next + lost, "the gap is the drop count");
    // What a publisher sends survives the wire.
    let json = serde_json::to_vec(&b).unwrap();
    assert_eq!(serde_json::from_slice::<KvEventBatch>(&json).unwrap(), b);
    let msgpack = rmp_serde::to_vec_named(&b).unwrap();
    assert_eq!(rmp_serde::from_slice::<KvEventBatch>(&msgpack).unwrap(), b);
    // Back to draining every request: no gap again.
    next = b.next_seq();
    serve(&mut kv, prompt(20, 16));
    let b = kv.take_event_batch();
    assert_eq!((b.seq, kv.events_dropped()), (next, lost));
    // An empty batch keeps the place.
    let empty = kv.take_event_batch();
    assert!(empty.events.is_empty());
    assert_eq!(empty.seq, b.next_seq());
}

#[test]
fn zero_event_capacity_is_refused() {
    let r = KvCacheManager::builder()
        .events(true)
        .event_capacity(0)
        .build();
    assert!(r.is_err());
}

#[test]
fn an_admission_that_needs_a_load_waits_while_the_load_queue_is_full() {
    let host = HostTier {
        max_pending_ops: 1,
        ..HostTier::ratio(128, 8.0).write_policy(WritePolicy::WriteThrough)
    };
    let mut kv = KvCacheManager::builder()
        .device_tokens(128)
        .page_size(4)
        .max_rows(8)
        .cache(CacheKind::HiCache(host))
        .build()
        .unwrap();
    let (a, b) = (prompt(1, 16), prompt(2, 16));
    for t in [&a, &b] {
        serve(&mut kv, t.clone());
        kv.drain().unwrap();
    }
    // Other traffic pushes both off the device; their backups keep them on the host.
    for s in 10..20 {
        serve(&mut kv, prompt(s, 16));
        kv.drain().unwrap();
    }
    let extend = |t: &[u32]| {
        let mut t = t.to_vec();
        t.extend([7, 8, 9, 10]);
        t
    };
    let ra = kv
        .arrive(Request::new(extend(&a)).max_new_tokens(1))
        .unwrap();
    let rb = kv
        .arrive(Request::new(extend(&b)).max_new_tokens(1))
        .unwrap();
    let first = admitted(&mut kv, ra);
    assert_eq!(first.host_tokens, 16, "A's load is queued: {first:?}");
    // B needs a load too, and the one pending load fills the queue: B waits, holding nothing.
    let before = kv.accounting();
    let waits = kv.metrics().counters.admission_waits;
    assert_eq!(
        kv.admit(rb).unwrap(),
        Admission::Wait(WaitReason::TransfersBusy)
    );
    assert_eq!(
        kv.accounting(),
        before,
        "a waiting admission changes nothing"
    );
    assert_eq!(kv.metrics().counters.admission_waits, waits + 1);
    // The step runs A's load; its ack at the step's end frees the queue, and B gets its load.
    run(&mut kv, ra, first.extend_tokens);
    let second = admitted(&mut kv, rb);
    assert_eq!(second.host_tokens, 16, "{second:?}");
    run(&mut kv, rb, second.extend_tokens);
    kv.drain().unwrap();
    let acc = kv.accounting();
    assert_eq!(acc.protected + acc.request_owned, 0, "{acc:?}");
    assert!(acc.balanced());
}
