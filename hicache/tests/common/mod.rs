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
pub fn check_pages<B: DeviceBackend>(b: &B, pages: &[PageId], hashes: &[u64]) {
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
