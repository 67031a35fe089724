//! Shared helpers: deterministic KV bytes derived from the token prefix, and a request driver
//! that checks the bytes of every cache hit.
#![allow(dead_code)]

use std::sync::Arc;

use radixkv_hicache::{
    DeviceBackend, HiCacheConfig, HiRadixCache, HostLayout, HostSim, HostSimConfig, HostSize,
    KvGeometry, WritePolicy,
};
use radixkv_radix::events::{chain_hashes, namespace_seed};
use radixkv_radix::{FinishKind, PageId, PrefixCache, RadixConfig, RadixKey, RequestKv};
use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng, SeedableRng};

pub mod backends;
pub mod hybrid;

/// A fresh directory for one test (its name, the process and the time make it unique),
/// removed when dropped.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir =
            std::env::temp_dir().join(format!("radixkv-{name}-{}-{nanos}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Prefetches `tokens` for request `rid` from the storage tier, waits for the store and ends
/// the prefetch; returns the storage hit in tokens.
pub fn prefetch_all<B: DeviceBackend>(c: &mut HiRadixCache<B>, rid: u64, tokens: &[u32]) -> usize {
    assert!(
        c.prefetch(rid, radixkv_radix::KeyRef::new(tokens)),
        "prefetch not started"
    );
    c.wait_storage().unwrap();
    match c.check_prefetch(rid).unwrap() {
        radixkv_hicache::PrefetchStatus::Done { tokens } => tokens,
        other => panic!("a waited-for prefetch is {other:?}"),
    }
}

pub const LAYERS: usize = 3;
pub const BYTES_PER_TOKEN: usize = 8;

/// A fixed pseudo-random function of `z`: the first draw of a SplitMix64 stream seeded by `z`.
pub fn mix(z: u64) -> u64 {
    SplitMix64::seed_from_u64(z).next_u64()
}

/// The KV bytes of one page in one layer: a function of the page's chain hash (so the same
/// prefix always has the same KV, as in a real model) and the layer.
pub fn page_bytes(g: &KvGeometry, hash: u64, layer: usize) -> Vec<u8> {
    let mut out = vec![0; g.page_bytes_per_layer()];
    SplitMix64::seed_from_u64(hash ^ (layer as u64).wrapping_mul(0x1234_5678_9abc_def1))
        .fill_bytes(&mut out);
    out
}

/// Chain hash of every whole page of `tokens`.
pub fn hashes(tokens: &[u32], page_size: usize) -> Vec<u64> {
    let mut h = Vec::new();
    let whole = tokens.len() - tokens.len() % page_size;
    chain_hashes(
        namespace_seed(&Default::default()),
        &tokens[..whole],
        page_size,
        &mut h,
    );
    h
}

pub fn write_pages<B: DeviceBackend>(b: &B, pages: &[PageId], hashes: &[u64]) {
    let g = b.geometry();
    for (&p, &h) in pages.iter().zip(hashes) {
        for l in 0..g.layers {
            b.write_device_page(l, p, &page_bytes(&g, h, l)).unwrap();
        }
    }
}

/// Panics with a description if any page does not hold its expected bytes.
/// The device pages of a begun request's prefix: `begin_request` moves them from
/// `RequestKv::prefix_pages` into the request's row.
pub fn row_prefix<B: DeviceBackend>(c: &HiRadixCache<B>, r: &RequestKv) -> Vec<PageId> {
    let rows = &c.pools().rows;
    let row = r.row.expect("a begun request");
    let pages = rows.pages(row).unwrap();
    pages[..rows.protected_pages(row).unwrap()].to_vec()
}

pub fn check_pages<B: DeviceBackend>(b: &B, pages: &[PageId], hashes: &[u64]) {
    assert_eq!(pages.len(), hashes.len(), "pages to check against their KV");
    let g = b.geometry();
    let mut buf = vec![0u8; g.page_bytes_per_layer()];
    for (i, (&p, &h)) in pages.iter().zip(hashes).enumerate() {
        for l in 0..g.layers {
            b.read_device_page(l, p, &mut buf).unwrap();
            assert!(
                buf == page_bytes(&g, h, l),
                "page {i} ({p:?}) layer {l} holds the wrong KV"
            );
        }
    }
}

pub fn cache(
    page_size: usize,
    device_pages: usize,
    host: HostSize,
    layout: HostLayout,
    policy: WritePolicy,
) -> HiRadixCache<HostSim> {
    let g = KvGeometry::new(LAYERS, page_size, BYTES_PER_TOKEN).unwrap();
    let backend = Arc::new(HostSim::new(g, device_pages, HostSimConfig::default()).unwrap());
    cache_on(backend, host, layout, policy)
}

/// [`cache`] over any backend (its geometry gives the page size, its pool the device pages).
pub fn cache_on<B: DeviceBackend>(
    backend: Arc<B>,
    host: HostSize,
    layout: HostLayout,
    policy: WritePolicy,
) -> HiRadixCache<B> {
    let page_size = backend.geometry().page_size;
    let device_pages = backend.device_pages();
    HiRadixCache::new(
        HiCacheConfig {
            radix: RadixConfig {
                page_size,
                total_pages: device_pages,
                max_rows: 16,
                events: true,
                ..Default::default()
            },
            host_size: host,
            host_layout: layout,
            write_policy: policy,
            load_back_min_tokens: 1,
            ..Default::default()
        },
        backend,
    )
    .unwrap()
}

/// `n` tokens no other seed shares.
pub fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 1000 + i).collect()
}

/// A write-through cache (page size 2, events on, load-back from one token) over a gated
/// backend: copies run only when released through the gate.
pub fn gated_cache(device_pages: usize, max_pending_ops: usize) -> HiRadixCache<HostSim> {
    let g = KvGeometry::new(LAYERS, 2, BYTES_PER_TOKEN).unwrap();
    let sim = HostSimConfig {
        gated: true,
        ..Default::default()
    };
    let backend = Arc::new(HostSim::new(g, device_pages, sim).unwrap());
    HiRadixCache::new(
        HiCacheConfig {
            radix: RadixConfig {
                page_size: 2,
                total_pages: device_pages,
                max_rows: 8,
                events: true,
                ..Default::default()
            },
            write_policy: WritePolicy::WriteThrough,
            load_back_min_tokens: 1,
            max_pending_ops,
            ..Default::default()
        },
        backend,
    )
    .unwrap()
}

/// Serves `tokens`, waits for its backup and evicts it from the device: it is host-only then.
pub fn demote_to_host<B: DeviceBackend>(c: &mut HiRadixCache<B>, tokens: &[u32]) {
    serve(c, tokens).unwrap();
    c.flush().unwrap();
    c.evict(usize::MAX / 2);
}

/// Matches and begins a request for `tokens` (a host hit is queued for load-back).
pub fn begin<B: DeviceBackend>(c: &mut HiRadixCache<B>, tokens: &[u32]) -> RequestKv {
    let mut r = RequestKv::new(RadixKey::new(tokens.to_vec()));
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    r
}

/// The forward of a begun request whose loads are done: checks the bytes of its whole
/// prefix, computes the rest and finishes it.
pub fn finish_loaded<B: DeviceBackend>(c: &mut HiRadixCache<B>, r: &mut RequestKv, tokens: &[u32]) {
    let p = c.page_size();
    let h = hashes(tokens, p);
    check_pages(&**c.backend(), &r.prefix_pages, &h[..r.prefix_pages.len()]);
    let rest = tokens.len() - r.prefix_len;
    c.alloc_tokens(r, rest).unwrap();
    r.commit(rest).unwrap();
    c.cache_finished_req(r, FinishKind::Finished).unwrap();
}

/// Waits for every layer of a started load step, as a forward pass does.
pub fn wait_layers<B: DeviceBackend>(c: &HiRadixCache<B>, producer: usize) {
    let counter = c.layer_counter();
    counter.set_consumer(producer);
    for l in 0..counter.layers() {
        counter.wait_until(l).unwrap();
    }
}

/// What one request saw.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    pub device_hit: usize,
    pub host_hit: usize,
    pub loaded: usize,
}

/// Runs one request to completion: match, begin (load-back), wait for the load, check the
/// bytes of the whole reused prefix, compute and write the rest, finish. Returns `None` when
/// the device could not hold the request (nothing leaked then).
pub fn serve<B: DeviceBackend>(c: &mut HiRadixCache<B>, tokens: &[u32]) -> Option<Served> {
    let p = c.page_size();
    let h = hashes(tokens, p);
    let mut req = RequestKv::new(RadixKey::new(tokens.to_vec()));
    let m = c.match_request(&mut req).unwrap();
    if let Err(e) = c.begin_request(&mut req) {
        panic!("begin_request failed: {e}");
    }
    let loaded = req.prefix_len - m.prefix_len;
    if let Some(step) = c.start_loading().unwrap() {
        let counter = c.layer_counter().clone();
        counter.set_consumer(step.producer);
        for l in 0..LAYERS {
            counter.wait_until(l).unwrap();
        }
    }
    let prefix_pages = req.prefix_pages.clone();
    check_pages(&**c.backend(), &prefix_pages, &h[..prefix_pages.len()]);
    let rest = tokens.len() - req.prefix_len;
    if c.alloc_tokens(&mut req, rest).is_err() {
        c.cache_finished_req(&mut req, FinishKind::Aborted).unwrap();
        return None;
    }
    let row = req.row.unwrap();
    let pages = c.pools().rows.pages(row).unwrap().to_vec();
    let first_new = req.prefix_len / p;
    let whole = tokens.len() / p;
    write_pages(
        &**c.backend(),
        &pages[first_new..whole],
        &h[first_new..whole],
    );
    req.commit(rest).unwrap();
    c.cache_finished_req(&mut req, FinishKind::Finished)
        .unwrap();
    Some(Served {
        device_hit: m.prefix_len,
        host_hit: m.host_hit_len,
        loaded,
    })
}

/// Runs `f` on its own thread and returns its result, failing the test if it has not returned
/// within `secs` seconds. A hang detector, not a performance assertion: the operations it
/// guards take microseconds, and the limit is there only so a hang fails instead of blocking
/// the test run forever.
pub fn within<T: Send + 'static>(
    what: &str,
    secs: u64,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    match run_within(secs, f) {
        Some(v) => v,
        None => panic!("hang: {what} did not return within {secs} s"),
    }
}

/// Like [`within`], but returns `None` on a hang (the stuck thread is left behind).
pub fn run_within<T: Send + 'static>(
    secs: u64,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(v) => Some(v),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
        // The guarded call panicked: fail with its message.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match h.join() {
            Err(payload) => std::panic::resume_unwind(payload),
            Ok(()) => unreachable!("the thread sends before it returns"),
        },
    }
}
