//! Controller: merging, pipelined loads, atomic multi-pool allocation.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use radixkv_hicache::{
    DeviceBackend, ExtraPoolSpec, HiCacheError, HostLayout, HostPool, HostSim, HostSimConfig,
    HybridCacheController, KvGeometry, PoolName, PoolTransfer, SlotOwner, merge_runs,
};
use radixkv_radix::{PageAllocator, PageId};

fn setup(
    layers: usize,
    device: usize,
    host: usize,
    cfg: HostSimConfig,
    extra: &[ExtraPoolSpec],
) -> (Arc<HostSim>, HybridCacheController<HostSim>) {
    let g = KvGeometry::new(layers, 4, 16).unwrap();
    let dev = Arc::new(HostSim::new(g, device, cfg).unwrap());
    let pool = HostPool::new(g, host, HostLayout::LayerFirst).unwrap();
    let ctrl = HybridCacheController::new(dev.clone(), pool, extra).unwrap();
    (dev, ctrl)
}

/// The minimal number of runs for a pairing, by brute force: a pair starts a new run unless
/// its predecessor pair (device − 1, host − 1) is also in the set.
fn minimal_runs(pairs: &[(u32, u32)]) -> usize {
    pairs
        .iter()
        .filter(|&&(d, h)| !(d > 0 && h > 0 && pairs.contains(&(d - 1, h - 1))))
        .count()
}

#[test]
fn single_page_ops_merge_into_minimal_runs() {
    // Device pages in three separated blocks, queued in a scrambled order, one page per op.
    let mut device: Vec<u32> = (0..20).chain(40..50).chain(60..62).collect();
    let n = device.len();
    for i in 0..n {
        device.swap(i, (mix(i as u64) % n as u64) as usize);
    }
    let (dev, mut ctrl) = setup(2, 64, 64, HostSimConfig::default(), &[]);
    let hs: Vec<u64> = (0..64).map(mix).collect();
    let all: Vec<PageId> = (0..64).map(PageId).collect();
    write_pages(&*dev, &all, &hs);
    let mut pairs = Vec::new();
    for &d in &device {
        let op = ctrl.write(&[PageId(d)], 0, Vec::new()).unwrap();
        pairs.push((d, op.host_pages[0]));
    }
    let stats = ctrl.start_writing().unwrap().unwrap();
    assert_eq!(stats.ops, n);
    assert_eq!(stats.pages, n);
    assert_eq!(stats.runs, minimal_runs(&pairs));
    assert_eq!(merge_runs(pairs.iter().copied()).len(), stats.runs);
    ctrl.wait_all().unwrap();
    assert_eq!(
        ctrl.poll_acks().writes.len(),
        n,
        "one ack per merged operation"
    );

    // Loading those host pages back in device order makes the pairing contiguous again: the
    // host pages were allocated in queue order, so sort them by their source device page.
    pairs.sort();
    let host: Vec<u32> = pairs.iter().map(|p| p.1).collect();
    let mut alloc = PageAllocator::new(64).unwrap();
    let mut loaded = Vec::new();
    for &h in &host {
        loaded.push(
            ctrl.load(&[h], &mut alloc, Vec::new())
                .unwrap()
                .device_pages[0],
        );
    }
    let lpairs: Vec<(u32, u32)> = loaded.iter().zip(&host).map(|(d, &h)| (d.0, h)).collect();
    let step = ctrl.start_loading().unwrap().unwrap();
    assert_eq!(step.stats.ops, n);
    assert_eq!(step.stats.runs, minimal_runs(&lpairs));
    ctrl.wait_all().unwrap();
    let expect: Vec<u64> = pairs.iter().map(|p| hs[p.0 as usize]).collect();
    check_pages(&*dev, &loaded, &expect);
}

#[test]
fn contiguous_single_page_ops_become_one_run() {
    let (_dev, mut ctrl) = setup(2, 64, 64, HostSimConfig::default(), &[]);
    for d in 0..64 {
        ctrl.write(&[PageId(d)], 0, Vec::new()).unwrap();
    }
    let s = ctrl.start_writing().unwrap().unwrap();
    assert_eq!((s.ops, s.pages, s.runs), (64, 64, 1));
    assert!(ctrl.start_writing().unwrap().is_none(), "queue drained");
}

#[test]
fn pipelined_load_completes_layer_by_layer() {
    let layers = 4;
    let cfg = HostSimConfig {
        gated: true,
        ..Default::default()
    };
    let (dev, mut ctrl) = setup(layers, 16, 16, cfg, &[]);
    let gate = dev.gate().unwrap().clone();
    let src: Vec<PageId> = (0..8).map(PageId).collect();
    let hs: Vec<u64> = (0..8).map(|i| mix(i + 5)).collect();
    write_pages(&*dev, &src, &hs);
    let host = ctrl.write(&src, 0, Vec::new()).unwrap().host_pages.clone();
    ctrl.start_writing().unwrap();
    gate.release(1);
    ctrl.wait_all().unwrap();

    let mut alloc = PageAllocator::new(16).unwrap();
    alloc.alloc(8).unwrap(); // the sources stay allocated
    let dst = ctrl
        .load(&host, &mut alloc, Vec::new())
        .unwrap()
        .device_pages
        .clone();
    let step = ctrl.start_loading().unwrap().unwrap();
    let counter = ctrl.layer_counter().clone();
    counter.set_consumer(step.producer);
    assert!(!counter.is_layer_done(step.producer, 0), "held by the gate");
    gate.release(1);
    counter.wait_until(0).unwrap();
    // Layer 0 is usable while the last layer has not even started copying.
    assert!(counter.is_layer_done(step.producer, 0));
    assert!(!counter.is_layer_done(step.producer, layers - 1));
    assert!(
        ctrl.poll_acks().loads.is_empty(),
        "the load is acked only as a whole"
    );
    let g = KvGeometry::new(layers, 4, 16).unwrap();
    let mut buf = vec![0u8; g.page_bytes_per_layer()];
    for (i, &d) in dst.iter().enumerate() {
        dev.read_device_page(0, d, &mut buf).unwrap();
        assert_eq!(buf, page_bytes(&g, hs[i], 0));
    }
    gate.release((layers - 1) as u64);
    counter.wait_until(layers - 1).unwrap();
    ctrl.wait_all().unwrap();
    assert_eq!(ctrl.poll_acks().loads.len(), 1);
    check_pages(&*dev, &dst, &hs);
}

#[test]
fn consumer_after_wait_until_always_sees_loaded_bytes() {
    let layers = 6;
    let cfg = HostSimConfig {
        per_copy_delay: Duration::from_millis(3),
        ..Default::default()
    };
    let (dev, mut ctrl) = setup(layers, 32, 32, cfg, &[]);
    let g = KvGeometry::new(layers, 4, 16).unwrap();
    for round in 0..3u64 {
        let src: Vec<PageId> = (0..8).map(PageId).collect();
        let hs: Vec<u64> = (0..8).map(|i| mix(i + 100 * round)).collect();
        write_pages(&*dev, &src, &hs);
        let host = ctrl.write(&src, 0, Vec::new()).unwrap().host_pages.clone();
        ctrl.start_writing().unwrap();
        ctrl.wait_all().unwrap();
        let mut alloc = PageAllocator::new(32).unwrap();
        alloc.alloc(8).unwrap();
        let dst = ctrl
            .load(&host, &mut alloc, Vec::new())
            .unwrap()
            .device_pages
            .clone();
        // Poison the targets so a premature read cannot pass by accident.
        for &d in &dst {
            for l in 0..layers {
                dev.write_device_page(l, d, &vec![0xAB; g.page_bytes_per_layer()])
                    .unwrap();
            }
        }
        let step = ctrl.start_loading().unwrap().unwrap();
        let counter = ctrl.layer_counter().clone();
        let dev2 = dev.clone();
        let consumer = std::thread::spawn(move || {
            counter.set_consumer(step.producer);
            let mut buf = vec![0u8; g.page_bytes_per_layer()];
            for l in 0..layers {
                counter.wait_until(l).unwrap();
                for (i, &d) in dst.iter().enumerate() {
                    dev2.read_device_page(l, d, &mut buf).unwrap();
                    assert_eq!(buf, page_bytes(&g, hs[i], l), "layer {l} read too early");
                }
            }
        });
        consumer.join().unwrap();
        ctrl.wait_all().unwrap();
        assert_eq!(ctrl.poll_acks().loads.len(), 1);
        ctrl.free_host(&host).unwrap();
        assert_eq!(ctrl.host().used(), 0);
    }
}

#[test]
fn extra_pool_failure_rolls_back_every_pool() {
    let extra = [
        ExtraPoolSpec {
            name: PoolName::Mamba,
            host_slots: 4,
            device_slots: 4,
            item_bytes: 24,
            device_owner: SlotOwner::Controller,
        },
        ExtraPoolSpec {
            name: PoolName::Swa,
            host_slots: 2,
            device_slots: 2,
            item_bytes: 40,
            device_owner: SlotOwner::Controller,
        },
    ];
    let (_dev, mut ctrl) = setup(2, 16, 16, HostSimConfig::default(), &extra);
    let t = |name, dev: Vec<u32>| PoolTransfer {
        name,
        host_indices: Vec::new(),
        device_indices: dev,
    };
    // Mamba fits, SWA does not: nothing at all may stay allocated.
    let e = ctrl
        .write(
            &[PageId(0), PageId(1)],
            0,
            vec![
                t(PoolName::Mamba, vec![0, 1]),
                t(PoolName::Swa, vec![0, 1, 0]),
            ],
        )
        .unwrap_err();
    assert!(matches!(
        e,
        HiCacheError::ExtraPoolFull {
            pool: PoolName::Swa,
            ..
        }
    ));
    assert_eq!(ctrl.host().used(), 0);
    assert_eq!(ctrl.extra_available(PoolName::Mamba).unwrap(), (4, 4));
    assert_eq!(ctrl.queued(), (0, 0));
    // An unknown pool also rolls back.
    let e = ctrl
        .write(
            &[PageId(0)],
            0,
            vec![t(PoolName::Mamba, vec![0]), t(PoolName::Draft, vec![0])],
        )
        .unwrap_err();
    assert_eq!(e, HiCacheError::UnknownPool(PoolName::Draft));
    assert_eq!(ctrl.extra_available(PoolName::Mamba).unwrap(), (4, 4));
    // A fitting operation allocates every pool.
    let op = ctrl
        .write(
            &[PageId(0)],
            0,
            vec![t(PoolName::Mamba, vec![3]), t(PoolName::Swa, vec![1])],
        )
        .unwrap();
    assert_eq!(op.extra[0].host_indices.len(), 1);
    let (host, mamba_host) = (op.host_pages.clone(), op.extra[0].host_indices.clone());
    assert_eq!(ctrl.extra_available(PoolName::Swa).unwrap(), (1, 2));
    ctrl.start_writing().unwrap();
    ctrl.wait_all().unwrap();

    // Load side: the device KV pages roll back when an extra pool cannot allocate.
    let mut alloc = PageAllocator::new(16).unwrap();
    let load = |name, host: Vec<u32>| PoolTransfer {
        name,
        host_indices: host,
        device_indices: Vec::new(),
    };
    let e = ctrl
        .load(
            &host,
            &mut alloc,
            vec![
                load(PoolName::Mamba, mamba_host.clone()),
                load(PoolName::Swa, vec![0, 1, 0]),
            ],
        )
        .unwrap_err();
    assert!(matches!(e, HiCacheError::ExtraPoolFull { .. }));
    assert_eq!(alloc.available(), 16, "device pages rolled back");
    assert_eq!(ctrl.extra_available(PoolName::Mamba).unwrap(), (3, 4));
    let op = ctrl
        .load(
            &host,
            &mut alloc,
            vec![load(PoolName::Mamba, mamba_host.clone())],
        )
        .unwrap();
    let mamba_dev = op.extra[0].device_indices.clone();
    assert_eq!(alloc.available(), 15);
    ctrl.free_extra(PoolName::Mamba, &mamba_host, &mamba_dev)
        .unwrap();
    assert!(
        ctrl.free_extra(PoolName::Mamba, &mamba_host, &mamba_dev)
            .is_err()
    );
    assert_eq!(ctrl.extra_available(PoolName::Mamba).unwrap(), (4, 4));
}

#[test]
fn host_full_and_device_full_leave_nothing_allocated() {
    let (_dev, mut ctrl) = setup(2, 8, 4, HostSimConfig::default(), &[]);
    let pages: Vec<PageId> = (0..5).map(PageId).collect();
    let e = ctrl.write(&pages, 0, Vec::new()).unwrap_err();
    assert_eq!(
        e,
        HiCacheError::HostFull {
            needed: 5,
            available: 4
        }
    );
    assert_eq!((ctrl.host().used(), ctrl.queued()), (0, (0, 0)));
    assert!(matches!(
        ctrl.write(&[PageId(8)], 0, Vec::new()),
        Err(HiCacheError::DevicePageOutOfRange(_))
    ));
    let host = ctrl
        .write(&pages[..4], 0, Vec::new())
        .unwrap()
        .host_pages
        .clone();
    let mut alloc = PageAllocator::new(8).unwrap();
    alloc.alloc(6).unwrap();
    let e = ctrl.load(&host, &mut alloc, Vec::new()).unwrap_err();
    assert_eq!(
        e,
        HiCacheError::DeviceFull {
            needed: 4,
            available: 2
        }
    );
    assert_eq!(alloc.available(), 2);
    // Loading a host page that is not allocated is refused.
    ctrl.free_host(&host[3..]).unwrap();
    assert_eq!(
        ctrl.load(&host[3..], &mut alloc, Vec::new()).unwrap_err(),
        HiCacheError::HostPageOutOfRange(host[3])
    );
    assert_eq!(alloc.available(), 2);
}

#[test]
fn producer_ring_wraps_and_keeps_batches_apart() {
    let (dev, mut ctrl) = setup(2, 16, 16, HostSimConfig::default(), &[]);
    let src = [PageId(0)];
    write_pages(&*dev, &src, &[mix(1)]);
    let host = ctrl.write(&src, 0, Vec::new()).unwrap().host_pages.clone();
    ctrl.start_writing().unwrap();
    ctrl.wait_all().unwrap();
    let mut alloc = PageAllocator::new(16).unwrap();
    alloc.alloc(1).unwrap();
    let mut producers = Vec::new();
    for _ in 0..4 {
        let d = ctrl
            .load(&host, &mut alloc, Vec::new())
            .unwrap()
            .device_pages
            .clone();
        let step = ctrl.start_loading().unwrap().unwrap();
        producers.push(step.producer);
        ctrl.layer_counter().wait_layer(step.producer, 1).unwrap();
        check_pages(&*dev, &d, &[mix(1)]);
    }
    assert_eq!(producers, vec![0, 1, 2, 0]);
    assert!(ctrl.start_loading().unwrap().is_none());
    ctrl.wait_all().unwrap();
    assert_eq!(ctrl.poll_acks().loads.len(), 4);
}
