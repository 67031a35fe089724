//! HostSim on its own: checked pool sizes, bounded stream queues, the copy gate, and what a
//! dead stream worker leaves behind (every event completes with an error, later submissions
//! are refused).

mod common;

use std::sync::Arc;

use common::*;
use radixkv_hicache::{
    CopyEvent, DeviceBackend, Direction, HiCacheError, HostLayout, HostMemory, HostSim,
    HostSimConfig, KvGeometry, PageCopy, PageRun, StreamKind,
};
use radixkv_radix::PageId;

fn gated(capacity: usize) -> HostSimConfig {
    HostSimConfig {
        gated: true,
        stream_capacity: capacity,
        ..Default::default()
    }
}

/// A device of 8 pages over 3 layers, a host buffer of 8 pages, and a copy of `pages` device
/// pages to the same host pages.
fn rig(cfg: HostSimConfig) -> (Arc<HostSim>, Arc<HostMemory>, KvGeometry) {
    let g = KvGeometry::new(LAYERS, 2, BYTES_PER_TOKEN).unwrap();
    let dev = Arc::new(HostSim::new(g, 8, cfg).unwrap());
    let host = Arc::new(HostMemory::new(g, 8, HostLayout::LayerFirst).unwrap());
    dev.register_host(&host).unwrap();
    (dev, host, g)
}

fn copy(host: &Arc<HostMemory>, direction: Direction, first: u32, pages: u32) -> PageCopy {
    PageCopy {
        direction,
        layers: 0..LAYERS,
        runs: vec![PageRun {
            device: first,
            host: first,
            pages,
        }]
        .into(),
        host: host.clone(),
    }
}

fn host_page(host: &HostMemory, g: &KvGeometry, page: u32, layer: usize) -> Vec<u8> {
    let mut buf = vec![0u8; g.page_bytes_per_layer()];
    host.read_page(layer, page, &mut buf).unwrap();
    buf
}

#[test]
fn pool_size_that_overflows_is_a_typed_error() {
    // 2^62 bytes per page and layer fit a usize; four pages do not.
    let g = KvGeometry::new(1, 1 << 31, 1 << 31).unwrap();
    let e = HostSim::new(g, 4, HostSimConfig::default()).unwrap_err();
    assert!(matches!(e, HiCacheError::Config(_)), "{e:?}");
}

#[test]
fn pool_larger_than_memory_is_a_typed_error() {
    // 2^50 bytes: representable, but more than any address space holds.
    let g = KvGeometry::new(1, 1 << 20, 1 << 20).unwrap();
    let e = HostSim::new(g, 1 << 10, HostSimConfig::default()).unwrap_err();
    assert!(
        matches!(e, HiCacheError::AllocFailed { bytes, .. } if bytes == 1 << 50),
        "{e:?}"
    );
    // So is a layer table too large to allocate.
    let g = KvGeometry {
        layers: usize::MAX,
        page_size: 1,
        bytes_per_token_layer: 1,
    };
    assert!(HostSim::new(g, 1, HostSimConfig::default()).is_err());
}

#[test]
fn zero_stream_capacity_is_refused() {
    let g = KvGeometry::new(1, 1, 1).unwrap();
    let cfg = HostSimConfig {
        stream_capacity: 0,
        ..Default::default()
    };
    assert!(matches!(
        HostSim::new(g, 1, cfg),
        Err(HiCacheError::Config(_))
    ));
}

#[test]
fn a_full_stream_queue_blocks_the_submitter_until_the_worker_makes_room() {
    let (dev, host, g) = rig(gated(2));
    let pages: Vec<PageId> = (0..8).map(PageId).collect();
    let hs: Vec<u64> = (0..8).map(|i| mix(i + 40)).collect();
    write_pages(&*dev, &pages, &hs);
    // The worker takes copy 0 and parks at the gate; copies 1 and 2 fill the queue.
    for p in 0..3 {
        dev.enqueue_copy(
            StreamKind::Write,
            copy(&host, Direction::DeviceToHost, p, 1),
        )
        .unwrap();
        if p == 0 {
            dev.wait_settled(StreamKind::Write);
        }
    }
    assert_eq!(dev.blocked_submissions(StreamKind::Write), 0);
    // The event does not fit: its submission waits for room instead of growing the queue.
    let d = dev.clone();
    let submitter = std::thread::spawn(move || d.record_event(StreamKind::Write));
    let d = dev.clone();
    within("the blocked submission being counted", 10, move || {
        while d.blocked_submissions(StreamKind::Write) == 0 {
            std::thread::yield_now();
        }
    });
    dev.gate().unwrap().release_on(StreamKind::Write, 3);
    let ev = within("the blocked submission", 10, move || {
        submitter.join().unwrap()
    })
    .unwrap();
    within("the event", 10, move || ev.wait()).unwrap();
    for p in 0..3u32 {
        for l in 0..LAYERS {
            assert_eq!(
                host_page(&host, &g, p, l),
                page_bytes(&g, hs[p as usize], l)
            );
        }
    }
}

#[test]
fn a_dead_worker_completes_every_pending_event_with_an_error() {
    let (dev, host, g) = rig(gated(16));
    let pages: Vec<PageId> = (0..8).map(PageId).collect();
    let hs: Vec<u64> = (0..8).map(|i| mix(i + 7)).collect();
    write_pages(&*dev, &pages, &hs);
    let w = StreamKind::Write;
    dev.enqueue_copy(w, copy(&host, Direction::DeviceToHost, 0, 2))
        .unwrap();
    let first = dev.record_event(w).unwrap();
    dev.enqueue_copy(w, copy(&host, Direction::DeviceToHost, 2, 2))
        .unwrap();
    let second = dev.record_event(w).unwrap();
    // The worker dies at the first copy, with both events still queued behind it.
    dev.inject_worker_panic(w);
    dev.gate().unwrap().release_on(w, 1);
    for ev in [first, second] {
        let r = within("wait() on an event of a dead stream", 10, move || ev.wait());
        assert_eq!(r, Err(HiCacheError::StreamClosed(w)));
    }
    assert!(dev.is_stream_closed(w));
    // Later submissions are refused with the same typed error, never queued.
    assert_eq!(
        dev.enqueue_copy(w, copy(&host, Direction::DeviceToHost, 4, 1)),
        Err(HiCacheError::StreamClosed(w))
    );
    assert!(matches!(
        dev.record_event(w),
        Err(HiCacheError::StreamClosed(StreamKind::Write))
    ));
    // The other stream is unaffected.
    assert!(!dev.is_stream_closed(StreamKind::Load));
    for p in 0..8u32 {
        host.write_page(0, p, &page_bytes(&g, hs[p as usize], 0))
            .unwrap();
    }
    let l = StreamKind::Load;
    let load = PageCopy {
        layers: 0..1,
        ..copy(&host, Direction::HostToDevice, 0, 8)
    };
    dev.gate().unwrap().release_on(l, 1);
    dev.enqueue_copy(l, load).unwrap();
    let ev = dev.record_event(l).unwrap();
    within("a load on the live stream", 10, move || ev.wait()).unwrap();
    let mut buf = vec![0u8; g.page_bytes_per_layer()];
    dev.read_device_page(0, PageId(5), &mut buf).unwrap();
    assert_eq!(buf, page_bytes(&g, hs[5], 0));
}

#[test]
fn hang_detector_catches_a_worker_exit_without_the_guard() {
    // Negative control for the test above: with the exit guard disabled, an event queued
    // behind the dying copy never completes, and the hang detector must say so.
    let cfg = HostSimConfig {
        unguarded_worker_exit: true,
        ..gated(16)
    };
    let (dev, host, _) = rig(cfg);
    let w = StreamKind::Write;
    dev.enqueue_copy(w, copy(&host, Direction::DeviceToHost, 0, 1))
        .unwrap();
    let ev = dev.record_event(w).unwrap();
    dev.inject_worker_panic(w);
    dev.gate().unwrap().release_on(w, 1);
    assert!(
        run_within(2, move || ev.wait()).is_none(),
        "the unguarded event completed: the hang detector proves nothing"
    );
}

#[test]
fn refused_submissions_are_transient_and_queue_nothing() {
    let (dev, host, g) = rig(HostSimConfig::default());
    let pages: Vec<PageId> = (0..8).map(PageId).collect();
    let hs: Vec<u64> = (0..8).map(|i| mix(i + 99)).collect();
    write_pages(&*dev, &pages, &hs);
    let w = StreamKind::Write;
    dev.refuse_next_submissions(w, 2);
    assert!(matches!(
        dev.enqueue_copy(w, copy(&host, Direction::DeviceToHost, 0, 4)),
        Err(HiCacheError::Transfer(_))
    ));
    assert!(matches!(
        dev.record_event(w),
        Err(HiCacheError::Transfer(_))
    ));
    // Nothing was queued: an event recorded now completes without the refused copy.
    let ev = dev.record_event(w).unwrap();
    within("an event after refusals", 10, move || ev.wait()).unwrap();
    assert_eq!(
        host_page(&host, &g, 0, 0),
        vec![0u8; g.page_bytes_per_layer()]
    );
    assert!(!dev.is_stream_closed(w));
}

#[test]
fn a_gate_opened_when_waited_holds_copies_until_someone_waits() {
    let (dev, host, g) = rig(gated(16));
    let pages: Vec<PageId> = (0..2).map(PageId).collect();
    let hs: Vec<u64> = (0..2).map(|i| mix(i + 3)).collect();
    write_pages(&*dev, &pages, &hs);
    let w = StreamKind::Write;
    dev.gate().unwrap().open_when_waited();
    dev.enqueue_copy(w, copy(&host, Direction::DeviceToHost, 0, 2))
        .unwrap();
    let ev = dev.record_event(w).unwrap();
    dev.wait_settled(w);
    assert!(dev.is_held(w) && !ev.is_complete(), "nobody waited yet");
    within("a wait that opens the gate", 10, move || ev.wait()).unwrap();
    assert_eq!(host_page(&host, &g, 1, 2), page_bytes(&g, hs[1], 2));
    // Open from then on: a later copy runs without a wait.
    dev.enqueue_copy(w, copy(&host, Direction::DeviceToHost, 0, 1))
        .unwrap();
    dev.wait_settled(w);
    assert!(!dev.is_held(w));
}
