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
    HostLayout, HostPool, HostSim, HostSimConfig, HybridCacheController, KvGeometry,
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
    r.device.free(&dev).unwrap();
}

fn bytes() -> usize {
    TOTAL_PAGES * LAYERS * PAGE_SIZE * BYTES_PER_TOKEN
}

fn memcpy_round(src: &[u8], dst: &mut [u8]) {
    dst.copy_from_slice(black_box(src));
    black_box(dst);
}

fn median(mut f: impl FnMut(), n: usize) -> Duration {
    let mut v: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    v.sort();
    v[n / 2]
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

    // Ratios to memcpy from medians measured back to back in this run.
    println!(
        "\nmerged transfer throughput vs memcpy ({} MiB per round, medians of 15):",
        bytes() >> 20
    );
    let base = median(|| memcpy_round(&src, &mut dst), 15);
    let gbps = |d: Duration| bytes() as f64 / d.as_secs_f64() / 1e9;
    println!("  memcpy                       {:6.2} GB/s", gbps(base));
    for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
        let mut r = rig(layout);
        for op_pages in [1, 64] {
            let w = median(|| write_round(&mut r, op_pages), 15);
            let l = median(|| load_round(&mut r, op_pages), 15);
            for (dir, d) in [("write", w), ("load", l)] {
                println!(
                    "  {dir:5} {layout:?} {op_pages:2}-page ops {:6.2} GB/s  ratio {:.2}",
                    gbps(d),
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
