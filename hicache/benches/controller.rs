//! Controller throughput: merged device↔host transfers built from 1-page and 64-page
//! operations, against a plain `memcpy` of the same bytes in the same run.
//!
//! Each iteration moves `TOTAL_PAGES` pages (all layers): queue the operations, start one
//! merged transfer, wait for it, drain the acks and release the pages again. Criterion reports
//! bytes/s; the summary at the end prints median-based ratios to memcpy.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use radixkv_hicache::{
    DeviceBackend, HostLayout, HostPool, HostSim, HostSimConfig, HybridCacheController, KvGeometry,
};
use radixkv_radix::{PageAllocator, PageId};

const LAYERS: usize = 8;
const PAGE_SIZE: usize = 16;
/// 256 bytes per token per layer: 4 KiB per page per layer, 32 KiB per page.
const BYTES_PER_TOKEN: usize = 256;
const TOTAL_PAGES: usize = 1024;

struct Rig {
    ctrl: HybridCacheController<HostSim>,
    device: PageAllocator,
    resident_host: Vec<u32>,
}

fn rig(layout: HostLayout) -> Rig {
    let g = KvGeometry::new(LAYERS, PAGE_SIZE, BYTES_PER_TOKEN).unwrap();
    let dev = Arc::new(HostSim::new(g, TOTAL_PAGES * 2, HostSimConfig::default()).unwrap());
    // Touch every device page: an untouched zeroed allocation reads as the shared zero page,
    // which would make backups look faster than any real copy.
    let fill = vec![0x5au8; g.page_bytes_per_layer()];
    for l in 0..LAYERS {
        for p in 0..TOTAL_PAGES * 2 {
            dev.write_device_page(l, PageId(p as u32), &fill).unwrap();
        }
    }
    let host = HostPool::new(g, TOTAL_PAGES * 2, layout).unwrap();
    let mut ctrl = HybridCacheController::new(dev, host, &[]).unwrap();
    // Host pages that loads read from, backed up once.
    let src: Vec<PageId> = (0..TOTAL_PAGES as u32).map(PageId).collect();
    let resident_host = ctrl.write(&src, 0, Vec::new()).unwrap().host_pages.clone();
    ctrl.start_writing().unwrap();
    ctrl.wait_all().unwrap();
    ctrl.poll_acks();
    let mut device = PageAllocator::new(TOTAL_PAGES * 2).unwrap();
    device.alloc(TOTAL_PAGES).unwrap();
    Rig {
        ctrl,
        device,
        resident_host,
    }
}

fn write_round(r: &mut Rig, op_pages: usize) {
    let mut host = Vec::with_capacity(TOTAL_PAGES);
    for start in (0..TOTAL_PAGES).step_by(op_pages) {
        let pages: Vec<PageId> = (start..start + op_pages)
            .map(|p| PageId(p as u32))
            .collect();
        host.extend_from_slice(&r.ctrl.write(&pages, 0, Vec::new()).unwrap().host_pages);
    }
    r.ctrl.start_writing().unwrap();
    r.ctrl.wait_all().unwrap();
    black_box(r.ctrl.poll_acks());
    r.ctrl.free_host(&host).unwrap();
}

fn load_round(r: &mut Rig, op_pages: usize) {
    let mut dev = Vec::with_capacity(TOTAL_PAGES);
    for chunk in r.resident_host.chunks(op_pages) {
        let op = r.ctrl.load(chunk, &mut r.device, Vec::new()).unwrap();
        dev.extend_from_slice(&op.device_pages);
    }
    r.ctrl.start_loading().unwrap();
    r.ctrl.wait_all().unwrap();
    black_box(r.ctrl.poll_acks());
    // The allocator is a stack: free in reverse so the next round gets the same ascending
    // pages (and the same merged runs) as this one, instead of a reversed, unmergeable order.
    dev.reverse();
    r.device.free(&dev).unwrap();
}

fn bytes() -> usize {
    TOTAL_PAGES * LAYERS * PAGE_SIZE * BYTES_PER_TOKEN
}

fn memcpy_round(src: &[u8], dst: &mut [u8]) {
    dst.copy_from_slice(black_box(src));
    black_box(dst);
}

const ROUNDS: usize = 21;

/// Times `op` and a memcpy of the same bytes alternately, `ROUNDS` times each, and returns
/// (median op time, median memcpy time). Interleaving makes both medians see the same load on
/// a shared machine, so their ratio is stable even when absolute speeds drift.
fn paired_medians(mut op: impl FnMut(), src: &[u8], dst: &mut [u8]) -> (Duration, Duration) {
    let time = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        f();
        t.elapsed()
    };
    let (mut a, mut b) = (Vec::with_capacity(ROUNDS), Vec::with_capacity(ROUNDS));
    for _ in 0..ROUNDS {
        a.push(time(&mut op));
        b.push(time(&mut || memcpy_round(src, dst)));
    }
    a.sort();
    b.sort();
    (a[ROUNDS / 2], b[ROUNDS / 2])
}

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("controller");
    g.throughput(Throughput::Bytes(bytes() as u64));
    g.sample_size(10).measurement_time(Duration::from_secs(2));
    let src = vec![7u8; bytes()];
    let mut dst = vec![0u8; bytes()];
    g.bench_function("memcpy", |b| b.iter(|| memcpy_round(&src, &mut dst)));
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        let mut r = rig(layout);
        for op_pages in [1, 64] {
            let name = format!("{layout:?}/{op_pages}p");
            g.bench_with_input(BenchmarkId::new("write", &name), &op_pages, |b, &n| {
                b.iter(|| write_round(&mut r, n))
            });
            g.bench_with_input(BenchmarkId::new("load", &name), &op_pages, |b, &n| {
                b.iter(|| load_round(&mut r, n))
            });
        }
    }
    g.finish();

    // Ratios to memcpy from medians of interleaved rounds (see `paired_medians`).
    println!(
        "\nmerged transfer throughput vs memcpy ({} MiB per round, medians of {ROUNDS} \
         interleaved rounds):",
        bytes() >> 20
    );
    let gbps = |d: Duration| bytes() as f64 / d.as_secs_f64() / 1e9;
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        let mut r = rig(layout);
        for op_pages in [1, 64] {
            let w = paired_medians(|| write_round(&mut r, op_pages), &src, &mut dst);
            let l = paired_medians(|| load_round(&mut r, op_pages), &src, &mut dst);
            for (dir, (d, base)) in [("write", w), ("load", l)] {
                println!(
                    "  {dir:5} {layout:?} {op_pages:2}-page ops {:6.2} GB/s  memcpy {:6.2} GB/s  \
                     ratio {:.2}",
                    gbps(d),
                    gbps(base),
                    base.as_secs_f64() / d.as_secs_f64()
                );
            }
        }
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    benches(&mut c);
    c.final_summary();
}
