//! A prefix whose load-back is still in flight is already in the tree, so a request of a later
//! batch can match it as a device hit: that batch must wait for the load too, even when it
//! loads nothing itself.

mod common;

use std::sync::Arc;

use common::*;
use radixkv_hicache::{
    HiCacheConfig, HiRadixCache, HostSim, HostSimConfig, KvGeometry, StreamKind, WritePolicy,
};
use radixkv_radix::{FinishKind, PrefixCache, RadixConfig, RadixKey, RequestKv};

#[test]
fn a_batch_that_matched_a_loading_prefix_waits_for_its_load() {
    let g = KvGeometry::new(LAYERS, 2, BYTES_PER_TOKEN).unwrap();
    let sim = HostSimConfig {
        gated: true,
        ..Default::default()
    };
    let backend = Arc::new(HostSim::new(g, 16, sim).unwrap());
    let mut c = HiRadixCache::new(
        HiCacheConfig {
            radix: RadixConfig {
                page_size: 2,
                total_pages: 16,
                max_rows: 8,
                ..Default::default()
            },
            write_policy: WritePolicy::WriteThrough,
            load_back_min_tokens: 1,
            ..Default::default()
        },
        backend,
    )
    .unwrap();
    let gate = c.backend().gate().unwrap().clone();
    let a: Vec<u32> = (100..109).collect();
    gate.open();
    serve(&mut c, &a).unwrap();
    c.flush().unwrap();
    c.evict(100);
    gate.close();
    // Batch 1 loads A back, then drops the request before its forward ran.
    let mut r1 = RequestKv::new(RadixKey::new(a.clone()));
    c.match_request(&mut r1).unwrap();
    c.begin_request(&mut r1).unwrap();
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
    for l in 0..LAYERS {
        counter.wait_until(l).unwrap();
    }
    check_pages(&**c.backend(), &r2.prefix_pages, &hashes(&a, 2)[..4]);
    c.alloc_tokens(&mut r2, 1).unwrap();
    r2.commit(1).unwrap();
    c.cache_finished_req(&mut r2, FinishKind::Finished).unwrap();
    gate.open();
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.protected_tokens(), 0);
    // With nothing in flight, a batch that loads nothing has nothing to wait for.
    assert!(c.start_loading().unwrap().is_none());
}
