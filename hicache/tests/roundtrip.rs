//! Byte-exact round trips: KV written on device, evicted to host, loaded back, compared.
//! Written once against `DeviceBackend`; runs on HostSim and, with the `cuda` feature and a
//! GPU, on the CUDA backend (`hostsim::*` and `cuda::*` tests).

mod common;

use common::backends::{Factory, for_each_backend};
use common::*;
use radixkv_hicache::{
    DeviceBackend, HostLayout, HostPool, HostSize, HybridCacheController, KvGeometry, WritePolicy,
};
use radixkv_radix::{PageAllocator, PageId, PrefixCache, RadixKey, RequestKv};

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 1000 + i).collect()
}

fn cache_round_trip<F: Factory>(page_size: usize, layout: HostLayout) {
    // Room for one request of 4 pages (+1 for the unaligned tail) at a time.
    let p = page_size;
    let g = KvGeometry::new(LAYERS, p, BYTES_PER_TOKEN).unwrap();
    let Some(dev) = F::make(g, 6) else { return };
    let mut c = cache_on(dev, HostSize::Ratio(4.0), layout, WritePolicy::WriteThrough);
    let a = tokens(1, 4 * p + 1);
    let b = tokens(2, 4 * p + 1);
    assert_eq!(serve(&mut c, &a).unwrap().device_hit, 0);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    // B evicts A from the device; A stays on the host.
    serve(&mut c, &b).unwrap();
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert!(c.stats().demoted_tokens >= 4 * p as u64, "{:?}", c.stats());
    let mut probe = RequestKv::new(RadixKey::new(a.clone()));
    let m = c.match_request(&mut probe).unwrap();
    assert_eq!((m.prefix_len, m.host_hit_len), (0, 4 * p));
    // A again: loaded back from the host and byte-checked inside `serve`.
    let s = serve(&mut c, &a).unwrap();
    assert_eq!(s.loaded, 4 * p);
    c.flush().unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.stats().loaded_tokens, 4 * p as u64);
    // And B round-trips too.
    assert_eq!(serve(&mut c, &b).unwrap().loaded, 4 * p);
    c.flush().unwrap();
    c.check_invariants().unwrap();
}

for_each_backend! {
    round_trip_layer_first_page_1 => cache_round_trip(1, HostLayout::LayerFirst),
    round_trip_layer_first_page_16 => cache_round_trip(16, HostLayout::LayerFirst),
    round_trip_page_first_page_1 => cache_round_trip(1, HostLayout::PageFirst),
    round_trip_page_first_page_16 => cache_round_trip(16, HostLayout::PageFirst),
    controller_round_trip_scattered_pages => controller_round_trip_scattered_pages(),
}

/// Controller-level round trip with scattered pages: device → host → other device pages.
fn controller_round_trip_scattered_pages<F: Factory>() {
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        for p in [1, 16] {
            let g = KvGeometry::new(4, p, 12).unwrap();
            let Some(dev) = F::make(g, 32) else { return };
            let host = HostPool::new(g, 16, layout).unwrap();
            let mut ctrl = HybridCacheController::new(dev.clone(), host, &[]).unwrap();
            let src: Vec<PageId> = [3u32, 4, 9, 1, 2, 17].map(PageId).to_vec();
            let hs: Vec<u64> = (0..src.len() as u64).map(|i| mix(i + 77)).collect();
            write_pages(&*dev, &src, &hs);
            let host_pages = ctrl
                .write(&src[..3], 0, Vec::new())
                .unwrap()
                .host_pages
                .clone();
            let more = ctrl
                .write(&src[3..], 0, Vec::new())
                .unwrap()
                .host_pages
                .clone();
            let st = ctrl.start_writing().unwrap().unwrap();
            assert_eq!((st.ops, st.pages), (2, 6));
            ctrl.wait_all().unwrap();
            assert_eq!(ctrl.poll_acks().writes.len(), 2);
            let mut alloc = PageAllocator::new(32).unwrap();
            // Skip the source pages so the load lands elsewhere.
            let _hold = alloc.alloc(31).unwrap();
            alloc.free(&_hold[20..]).unwrap();
            let all_host: Vec<u32> = host_pages.iter().chain(&more).copied().collect();
            let dst = ctrl
                .load(&all_host, &mut alloc, Vec::new())
                .unwrap()
                .device_pages
                .clone();
            assert!(dst.iter().all(|d| !src.contains(d)));
            let step = ctrl.start_loading().unwrap().unwrap();
            ctrl.layer_counter().wait_layer(step.producer, 3).unwrap();
            ctrl.wait_all().unwrap();
            check_pages(&*dev, &dst, &hs);
            assert_eq!(ctrl.poll_acks().loads.len(), 1);
            assert_eq!(dev.name(), F::NAME);
        }
    }
}
