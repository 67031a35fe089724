//! The `DeviceBackend` contract, byte-exactly, on every backend present: merged page runs in
//! both directions and both host layouts (page sizes 1 and 16), per-layer events, refused
//! out-of-range copies, extra-pool registration and the synchronous accessors. `hostsim::*`
//! always runs; `cuda::*` runs with the `cuda` feature on a machine with a GPU (without one,
//! `cuda_tests_ran_or_were_skipped` says so and checks that the missing driver is a typed
//! error).

mod common;

use std::sync::Arc;

use common::backends::{Factory, for_each_backend};
use common::*;
use radixkv_hicache::{
    CopyEvent, DeviceBackend, Direction, HiCacheError, HostLayout, HostMemory, KvGeometry,
    PageCopy, PageRun, PoolName, StreamKind,
};
use radixkv_radix::PageId;

for_each_backend! {
    merged_runs_layer_first_page_1 => merged_runs_copy_byte_exactly(HostLayout::LayerFirst, 1),
    merged_runs_layer_first_page_16 => merged_runs_copy_byte_exactly(HostLayout::LayerFirst, 16),
    merged_runs_page_first_page_1 => merged_runs_copy_byte_exactly(HostLayout::PageFirst, 1),
    merged_runs_page_first_page_16 => merged_runs_copy_byte_exactly(HostLayout::PageFirst, 16),
    invalid_copies_are_refused_and_queue_nothing => invalid_copies_are_refused_and_queue_nothing(),
    extra_pools_register_once_and_check_their_slots => extra_pools_register_once_and_check_their_slots(),
    device_page_accessors_check_their_arguments => device_page_accessors_check_their_arguments(),
    a_load_exposes_one_event_per_layer => a_load_exposes_one_event_per_layer(),
}

const PAGES: usize = 16;

fn geometry(page_size: usize) -> KvGeometry {
    KvGeometry::new(LAYERS, page_size, BYTES_PER_TOKEN).unwrap()
}

fn run(device: u32, host: u32, pages: u32) -> PageRun {
    PageRun {
        device,
        host,
        pages,
    }
}

fn host_page(host: &HostMemory, layer: usize, page: u32) -> Vec<u8> {
    let mut buf = vec![0u8; host.geometry().page_bytes_per_layer()];
    host.read_page(layer, page, &mut buf).unwrap();
    buf
}

/// Device → host with several runs (one of them continuing another on both sides, so it
/// merges), one event for all layers; then host → device into other pages, one copy and one
/// event per layer as a pipelined load does. Every byte is checked, and the pages no run
/// names are checked untouched.
fn merged_runs_copy_byte_exactly<F: Factory>(layout: HostLayout, page_size: usize) {
    let Some(dev) = F::make(geometry(page_size), PAGES) else {
        return;
    };
    check_merged_runs(&*dev, layout);
}

fn check_merged_runs<B: DeviceBackend>(dev: &B, layout: HostLayout) {
    let g = dev.geometry();
    let page_size = g.page_size;
    let name = dev.name();
    let host = Arc::new(HostMemory::new(g, PAGES, layout).unwrap());
    dev.register_host(&host).unwrap();
    dev.register_host(&host).unwrap(); // idempotent
    let pages: Vec<PageId> = (0..PAGES as u32).map(PageId).collect();
    let hs: Vec<u64> = (0..PAGES as u64).map(|i| mix(i + 500)).collect();
    write_pages(dev, &pages, &hs);
    let out = [run(2, 5, 4), run(6, 9, 1), run(9, 0, 1), run(12, 11, 3)];
    dev.enqueue_copy(
        StreamKind::Write,
        PageCopy::new(&host, Direction::DeviceToHost, 0..LAYERS, &out),
    )
    .unwrap();
    let ev = dev.record_event(StreamKind::Write).unwrap();
    ev.wait().unwrap();
    assert!(ev.is_complete());
    let mut named = [false; PAGES];
    for r in &out {
        for i in 0..r.pages {
            named[(r.host + i) as usize] = true;
            for l in 0..LAYERS {
                assert_eq!(
                    host_page(&host, l, r.host + i),
                    page_bytes(&g, hs[(r.device + i) as usize], l),
                    "{name} {layout:?} p{page_size}: host page {} layer {l}",
                    r.host + i
                );
            }
        }
    }
    let zero = vec![0u8; g.page_bytes_per_layer()];
    for (p, _) in named.iter().enumerate().filter(|(_, n)| !**n) {
        for l in 0..LAYERS {
            assert_eq!(
                host_page(&host, l, p as u32),
                zero,
                "host page {p} was not named"
            );
        }
    }
    // Back into pages 0.. of a zeroed device region: clear them first.
    for p in 0..9u32 {
        for l in 0..LAYERS {
            dev.write_device_page(l, PageId(p), &zero).unwrap();
        }
    }
    let back = [run(0, 5, 4), run(4, 9, 1), run(5, 11, 3)];
    let mut events = Vec::new();
    for l in 0..LAYERS {
        dev.enqueue_copy(
            StreamKind::Load,
            PageCopy::new(&host, Direction::HostToDevice, l..l + 1, &back),
        )
        .unwrap();
        events.push(dev.record_event(StreamKind::Load).unwrap());
    }
    for e in &events {
        e.wait().unwrap();
    }
    let want: Vec<u64> = [2, 3, 4, 5, 6, 12, 13, 14].map(|d| hs[d]).to_vec();
    let dst: Vec<PageId> = (0..8).map(PageId).collect();
    check_pages(dev, &dst, &want);
    // Page 8 was cleared and named by no run: still zero.
    let mut buf = vec![1u8; g.page_bytes_per_layer()];
    dev.read_device_page(1, PageId(8), &mut buf).unwrap();
    assert_eq!(buf, zero);
}

fn invalid_copies_are_refused_and_queue_nothing<F: Factory>() {
    let g = geometry(2);
    let Some(dev) = F::make(g, PAGES) else { return };
    let host = Arc::new(HostMemory::new(g, 8, HostLayout::LayerFirst).unwrap());
    let w = StreamKind::Write;
    let d2h = Direction::DeviceToHost;
    let e = dev
        .enqueue_copy(w, PageCopy::new(&host, d2h, 0..LAYERS, &[run(15, 0, 2)]))
        .unwrap_err();
    assert_eq!(e, HiCacheError::DevicePageOutOfRange(PageId(16)));
    let e = dev
        .enqueue_copy(w, PageCopy::new(&host, d2h, 0..LAYERS, &[run(0, 7, 2)]))
        .unwrap_err();
    assert_eq!(e, HiCacheError::HostPageOutOfRange(8));
    let e = dev
        .enqueue_copy(w, PageCopy::new(&host, d2h, 0..LAYERS + 1, &[run(0, 0, 1)]))
        .unwrap_err();
    assert!(matches!(e, HiCacheError::LayerOutOfRange { .. }), "{e:?}");
    let e = dev
        .enqueue_copy(w, PageCopy::new(&host, d2h, 0..LAYERS, &[run(0, 0, 0)]))
        .unwrap_err();
    assert!(matches!(e, HiCacheError::DevicePageOutOfRange(_)), "{e:?}");
    let other = Arc::new(HostMemory::new(geometry(4), 8, HostLayout::LayerFirst).unwrap());
    assert!(matches!(
        dev.register_host(&other),
        Err(HiCacheError::Config(_))
    ));
    assert!(matches!(
        dev.enqueue_copy(w, PageCopy::new(&other, d2h, 0..LAYERS, &[run(0, 0, 1)])),
        Err(HiCacheError::Config(_))
    ));
    // Nothing was queued: the host buffer is still zero after an event.
    dev.write_device_page(0, PageId(0), &vec![7u8; g.page_bytes_per_layer()])
        .unwrap();
    dev.record_event(w).unwrap().wait().unwrap();
    assert!(host_page(&host, 0, 0).iter().all(|&b| b == 0));
}

fn extra_pools_register_once_and_check_their_slots<F: Factory>() {
    let Some(dev) = F::make(geometry(2), PAGES) else {
        return;
    };
    dev.register_extra_pool(PoolName::Mamba, 4, 24).unwrap();
    dev.register_extra_pool(PoolName::Mamba, 4, 24).unwrap(); // idempotent
    assert!(matches!(
        dev.register_extra_pool(PoolName::Mamba, 5, 24),
        Err(HiCacheError::Config(_))
    ));
    assert!(matches!(
        dev.register_extra_pool(PoolName::Swa, 0, 24),
        Err(HiCacheError::Config(_))
    ));
    let mut out = vec![1u8; 24];
    dev.read_extra_slot(PoolName::Mamba, 3, &mut out).unwrap();
    assert_eq!(out, vec![0u8; 24], "a new pool is zeroed");
    let data: Vec<u8> = (0..24).map(|i| (mix(i) & 0xff) as u8).collect();
    dev.write_extra_slot(PoolName::Mamba, 2, &data).unwrap();
    dev.read_extra_slot(PoolName::Mamba, 2, &mut out).unwrap();
    assert_eq!(out, data);
    assert_eq!(
        dev.read_extra_slot(PoolName::Mamba, 4, &mut out),
        Err(HiCacheError::HostPageOutOfRange(4))
    );
    assert_eq!(
        dev.write_extra_slot(PoolName::Mamba, 0, &data[..8]),
        Err(HiCacheError::BufferSize {
            expected: 24,
            got: 8
        })
    );
    assert_eq!(
        dev.read_extra_slot(PoolName::Swa, 0, &mut out),
        Err(HiCacheError::UnknownPool(PoolName::Swa))
    );
}

fn device_page_accessors_check_their_arguments<F: Factory>() {
    let g = geometry(16);
    let Some(dev) = F::make(g, PAGES) else { return };
    let mut buf = vec![0u8; g.page_bytes_per_layer()];
    assert_eq!(
        dev.read_device_page(LAYERS, PageId(0), &mut buf),
        Err(HiCacheError::LayerOutOfRange {
            layer: LAYERS,
            layers: LAYERS
        })
    );
    assert_eq!(
        dev.write_device_page(0, PageId(PAGES as u32), &buf),
        Err(HiCacheError::DevicePageOutOfRange(PageId(PAGES as u32)))
    );
    assert!(matches!(
        dev.read_device_page(0, PageId(0), &mut buf[1..]),
        Err(HiCacheError::BufferSize { .. })
    ));
    assert_eq!((dev.name(), dev.device_pages()), (F::NAME, PAGES));
    assert_eq!(dev.geometry(), g);
}

/// Says whether the CUDA tests ran. Without a driver or device, the backend must refuse with
/// the typed [`HiCacheError::NoDevice`], never panic.
#[cfg(feature = "cuda")]
#[test]
fn cuda_tests_ran_or_were_skipped() {
    use radixkv_hicache::cuda::{CudaBackend, CudaConfig, probe};
    let made = CudaBackend::new(geometry(2), 4, CudaConfig::default());
    match probe() {
        Ok(info) => {
            use radixkv_hicache::cuda::CopyMethod;
            let b = made.expect("the driver sees a device, so the backend opens");
            eprintln!(
                "CUDA: driver version {}, {} device(s): the cuda::* tests ran on the GPU \
                 ({} host buffers pinned so far); batched copy call: {}, copy kernel: {} \
                 (cuda_batched::* / cuda_kernel::* skip where absent)",
                info.driver_version,
                info.devices,
                b.host_buffers().1,
                if b.has_method(CopyMethod::Batched) {
                    "yes"
                } else {
                    "no"
                },
                match b.kernel_spans_per_launch() {
                    Some(n) => format!("yes, {n} spans per launch"),
                    None => "no".into(),
                },
            );
        }
        Err(e) => {
            assert!(matches!(e, HiCacheError::NoDevice(_)), "{e:?}");
            assert!(matches!(made, Err(HiCacheError::NoDevice(_))), "{made:?}");
            assert!(
                std::env::var_os("RADIXKV_REQUIRE_GPU").is_none(),
                "RADIXKV_REQUIRE_GPU is set but there is no GPU: {e}"
            );
            eprintln!("CUDA GPU TESTS SKIPPED: {e}. The cuda::* tests returned without running.");
        }
    }
}

/// CUDA only: under `CopyMethod::Auto`, a page-first copy of single pages (many short spans)
/// goes to the kernel, else to the batched call, not as one memcpy per span; with
/// `kernel_max_span` under its spans, it goes to the batched call where the driver has it.
#[cfg(feature = "cuda")]
#[test]
fn cuda_auto_sends_short_spans_to_the_kernel_or_the_batched_call() {
    use radixkv_hicache::cuda::{CopyMethod, CudaBackend, CudaConfig, probe};
    if probe().is_err() {
        return; // the sentinel reports the skip
    }
    let g = geometry(1);
    let copy = |dev: &CudaBackend| {
        let host = Arc::new(HostMemory::new(g, PAGES, HostLayout::PageFirst).unwrap());
        let runs: Vec<PageRun> = (0..8).map(|i| run(2 * i, 15 - 2 * i, 1)).collect();
        dev.enqueue_copy(
            StreamKind::Write,
            PageCopy::new(&host, Direction::DeviceToHost, 0..LAYERS, &runs),
        )
        .unwrap();
        dev.record_event(StreamKind::Write).unwrap().wait().unwrap();
    };
    let dev = CudaBackend::new(g, PAGES, CudaConfig::default()).unwrap();
    copy(&dev);
    let c = dev.copy_counts();
    if dev.has_method(CopyMethod::Kernel) {
        assert_eq!((c.kernel, c.memcpy, c.batched), (1, 0, 0), "{c:?}");
    } else if dev.has_method(CopyMethod::Batched) {
        assert_eq!((c.batched, c.memcpy, c.kernel), (1, 0, 0), "{c:?}");
    } else {
        eprintln!("neither the copy kernel nor the batched call is available: memcpys only");
        assert_eq!(c.memcpy, 1, "{c:?}");
    }
    let cfg = CudaConfig {
        kernel_max_span: 1,
        ..Default::default()
    };
    let dev = CudaBackend::new(g, PAGES, cfg).unwrap();
    copy(&dev);
    let c = dev.copy_counts();
    if dev.has_method(CopyMethod::Batched) {
        assert_eq!((c.batched, c.memcpy, c.kernel), (1, 0, 0), "{c:?}");
    } else if dev.has_method(CopyMethod::Kernel) {
        // Without the batched call, spans this short still go to the kernel.
        assert_eq!((c.kernel, c.memcpy, c.batched), (1, 0, 0), "{c:?}");
    } else {
        assert_eq!(c.memcpy, 1, "{c:?}");
    }
}

/// CUDA only: an event goes back to the backend's pool when its last clone is dropped, not
/// before, and is recorded again (and completes again) for the next copy; the pool is capped.
#[cfg(feature = "cuda")]
#[test]
fn cuda_events_are_reused_once_every_clone_is_gone() {
    use radixkv_hicache::cuda::{CudaBackend, CudaConfig, EVENT_POOL_MAX, probe};
    if probe().is_err() {
        return; // the sentinel reports the skip
    }
    let dev = CudaBackend::new(geometry(1), PAGES, CudaConfig::default()).unwrap();
    let first = dev.record_event(StreamKind::Load).unwrap();
    first.wait().unwrap();
    let held = first.clone();
    drop(first);
    assert_eq!(dev.idle_events(), 0, "a clone still holds the event");
    drop(held);
    assert_eq!(dev.idle_events(), 1);
    // Recorded again, behind a copy: it completes once the copy has.
    let again = dev.record_event(StreamKind::Write).unwrap();
    assert_eq!(dev.idle_events(), 0, "the idle event was recorded again");
    again.wait().unwrap();
    assert!(again.is_complete());
    drop(again);
    check_merged_runs(&dev, HostLayout::PageFirst);
    let many: Vec<_> = (0..EVENT_POOL_MAX + 8)
        .map(|_| dev.record_event(StreamKind::Load).unwrap())
        .collect();
    drop(many);
    assert_eq!(dev.idle_events(), EVENT_POOL_MAX, "the pool is capped");
}

/// CUDA only: host buffers left pageable (as when the driver refuses to pin them) copy the
/// same bytes, and are counted as unpinned.
#[cfg(feature = "cuda")]
#[test]
fn cuda_pageable_host_buffers_copy_byte_exactly() {
    use radixkv_hicache::cuda::{CudaBackend, CudaConfig, probe};
    if probe().is_err() {
        return; // the sentinel reports the skip
    }
    let cfg = CudaConfig {
        pin_host: false,
        ..Default::default()
    };
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        let dev = CudaBackend::new(geometry(16), PAGES, cfg.clone()).unwrap();
        check_merged_runs(&dev, layout);
        assert_eq!(dev.host_buffers(), (1, 0));
        assert_eq!(dev.pin_failures(), 0, "pinning was not asked for");
    }
    let dev = CudaBackend::new(geometry(16), PAGES, CudaConfig::default()).unwrap();
    check_merged_runs(&dev, HostLayout::LayerFirst);
    assert_eq!(dev.host_buffers().0, 1);
    assert_eq!(dev.host_buffers().1 as u64 + dev.pin_failures(), 1);
}

/// CUDA only: a pool the engine owns, with K and V of each layer in separate buffers and a
/// gap after every page, copies byte-exactly through `from_device_regions`.
#[cfg(feature = "cuda")]
#[test]
fn cuda_engine_owned_split_regions_copy_byte_exactly() {
    use radixkv_hicache::cuda::cudarc::driver::result;
    use radixkv_hicache::cuda::{CudaBackend, CudaConfig, DeviceRegion, probe};
    if probe().is_err() {
        return; // the sentinel reports the skip
    }
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        for page_size in [1, 16] {
            let g = geometry(page_size);
            let half = g.page_bytes_per_layer() / 2;
            let stride = (half + 64) as u64;
            let ctx = radixkv_hicache::cuda::cudarc::driver::CudaContext::new(0).unwrap();
            ctx.bind_to_thread().unwrap();
            let buf_bytes = stride as usize * PAGES;
            // SAFETY: plain allocations, freed after the backend is dropped.
            let bufs: Vec<u64> = (0..2 * LAYERS)
                .map(|_| unsafe { result::malloc_sync(buf_bytes) }.unwrap())
                .collect();
            let regions: Vec<Vec<DeviceRegion>> = (0..LAYERS)
                .map(|l| {
                    vec![
                        DeviceRegion {
                            base: bufs[2 * l],
                            page_stride: stride,
                            bytes: half,
                        },
                        DeviceRegion {
                            base: bufs[2 * l + 1],
                            page_stride: stride,
                            bytes: g.page_bytes_per_layer() - half,
                        },
                    ]
                })
                .collect();
            {
                // SAFETY: the buffers are device memory of device 0's primary context, large
                // enough for every page, disjoint, and outlive the backend (freed below).
                let dev = unsafe {
                    CudaBackend::from_device_regions(g, PAGES, regions, CudaConfig::default())
                }
                .unwrap();
                // The engine's buffers are not zeroed: clear the pages the check reads.
                let zero = vec![0u8; g.page_bytes_per_layer()];
                for p in 0..PAGES as u32 {
                    for l in 0..LAYERS {
                        dev.write_device_page(l, PageId(p), &zero).unwrap();
                    }
                }
                check_merged_runs(&dev, layout);
            }
            ctx.bind_to_thread().unwrap();
            for b in bufs {
                // SAFETY: allocated above; the backend that used it is gone.
                unsafe { result::free_sync(b) }.unwrap();
            }
        }
    }
}

/// A `libcuda` that is not the driver (a stub, or another library under that name) is found
/// by the loader but lacks the driver API: `probe` must say `NoDevice`, not panic in cudarc.
/// Runs itself in a child process whose library path holds a copy of a library this process
/// already loaded (the GCC runtime) under the driver's names.
#[cfg(all(feature = "cuda", target_os = "linux"))]
#[test]
fn a_library_without_the_driver_api_is_no_device_not_a_panic() {
    const NAME: &str = "a_library_without_the_driver_api_is_no_device_not_a_panic";
    const CHILD: &str = "RADIXKV_STUB_LIBCUDA_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let e = radixkv_hicache::cuda::probe().unwrap_err();
        assert!(
            matches!(&e, HiCacheError::NoDevice(m) if m.contains("lacks the driver API")),
            "{e:?}"
        );
        println!("stub libcuda refused: {e}");
        return;
    }
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let lib = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("/libgcc_s.so"))
        .expect("a Rust test binary loads the GCC runtime");
    let dir = std::env::temp_dir().join(format!("radixkv-stub-libcuda-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["libcuda.so", "libcuda.so.1"] {
        std::fs::copy(lib, dir.join(name)).unwrap();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("LD_LIBRARY_PATH", &dir)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && stdout.contains("stub libcuda refused")
            && stdout.contains("1 passed"),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The events a forward pass (or an engine's compute stream) waits on: every layer of a
/// started load has its own, and they complete once the load is done.
fn a_load_exposes_one_event_per_layer<F: Factory>() {
    use radixkv_hicache::{HostPool, HybridCacheController};
    use radixkv_radix::PageAllocator;
    let g = geometry(4);
    let Some(dev) = F::make(g, PAGES) else { return };
    let host = HostPool::new(g, 8, HostLayout::LayerFirst).unwrap();
    let mut ctrl = HybridCacheController::new(dev.clone(), host, &[]).unwrap();
    let src: Vec<PageId> = [1u32, 2, 7].map(PageId).to_vec();
    let hs: Vec<u64> = (0..3).map(|i| mix(i + 900)).collect();
    write_pages(&*dev, &src, &hs);
    let host_pages = ctrl.write(&src, 0, Vec::new()).unwrap().host_pages.clone();
    ctrl.start_writing().unwrap().unwrap();
    ctrl.wait_all().unwrap();
    ctrl.poll_acks();
    let mut alloc = PageAllocator::new(PAGES).unwrap();
    let _held = alloc.alloc(8).unwrap(); // the load lands on pages 8..
    let dst = ctrl
        .load(&host_pages, &mut alloc, Vec::new())
        .unwrap()
        .device_pages
        .clone();
    let step = ctrl.start_loading().unwrap().unwrap();
    let counter = ctrl.layer_counter().clone();
    for l in 0..LAYERS {
        let evs = counter.layer_events(step.producer, l);
        assert_eq!(evs.len(), 1, "layer {l}");
        evs[0].wait().unwrap();
        assert!(evs[0].is_complete() && counter.is_layer_done(step.producer, l));
    }
    assert!(counter.layer_events(step.producer, LAYERS).is_empty());
    ctrl.wait_all().unwrap();
    check_pages(&*dev, &dst, &hs);
}
