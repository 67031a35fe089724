//! The KV-content oracle.
//!
//! A forward pass writes, for position `i` of a request, KV that depends on the namespace and
//! every token up to `i`. The oracle writes such a value ([`prefix_values`]) into each slot it
//! "computes" and, on every hit, checks that each reused slot holds the value of the hit's own
//! prefix. Sharing a page between different prefixes, reusing a freed page, or a load-back that
//! copied the wrong host page all show up as a mismatch.

use std::ops::Range;
use std::sync::Arc;

use radixkv_hicache::{DeviceBackend, PoolName};
use radixkv_radix::{Namespace, PageId, PrefixCache, RequestKv, TokenId};

/// Token slots addressed by (page, offset in the page).
pub trait KvStore {
    /// Writes one slot.
    fn store(&mut self, page: PageId, offset: usize, value: u64);
    /// Reads one slot (0: never written).
    fn load(&self, page: PageId, offset: usize) -> u64;
}

/// The value of every position of `tokens` in `ns`: a running hash, never 0.
pub fn prefix_values(ns: &Namespace, tokens: &[TokenId]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in ns.name().bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    tokens
        .iter()
        .map(|&t| {
            h = (h ^ u64::from(t) ^ 0x1_0000_0000)
                .wrapping_mul(0x0100_0000_01b3)
                .rotate_left(29);
            h | 1
        })
        .collect()
}

/// The pages of `req`'s row in `cache` (page `i` holds positions `i*P .. (i+1)*P`).
///
/// # Panics
/// When `req` holds no live row (a harness bug).
pub fn row_pages<'a, C: PrefixCache + ?Sized>(cache: &'a C, req: &RequestKv) -> &'a [PageId] {
    let row = req.row.expect("a running request has a row");
    cache
        .pools()
        .rows
        .pages(row)
        .expect("a running request's row is live")
}

/// "Computes" positions `range` of `tokens`: writes their values into the slots `pages` hold
/// for them (page `i` holds positions `i*P .. (i+1)*P`).
///
/// # Panics
/// When `pages` does not cover `range` or `tokens` is shorter than it (a harness bug).
pub fn write_kv(
    store: &mut impl KvStore,
    page_size: usize,
    pages: &[PageId],
    ns: &Namespace,
    tokens: &[TokenId],
    range: Range<usize>,
) {
    if range.is_empty() {
        return;
    }
    let values = prefix_values(ns, &tokens[..range.end]);
    for i in range {
        store.store(pages[i / page_size], i % page_size, values[i]);
    }
}

/// Checks that the first `len` positions reachable through `pages` hold the KV of
/// `tokens[..len]` in `ns`.
///
/// # Errors
/// The first position that holds other KV.
pub fn check_kv(
    store: &impl KvStore,
    page_size: usize,
    pages: &[PageId],
    ns: &Namespace,
    tokens: &[TokenId],
    len: usize,
) -> Result<(), String> {
    if len > tokens.len() || len.div_ceil(page_size) > pages.len() {
        return Err(format!(
            "a hit of {len} tokens with {} tokens and {} pages",
            tokens.len(),
            pages.len()
        ));
    }
    let values = prefix_values(ns, &tokens[..len]);
    for (i, want) in values.iter().enumerate() {
        let page = pages[i / page_size];
        let got = store.load(page, i % page_size);
        if got != *want {
            return Err(format!(
                "position {i} (page {page:?}) holds foreign KV ({got:#x}, want {want:#x})"
            ));
        }
    }
    Ok(())
}

/// Model device memory: one `u64` per token slot.
#[derive(Debug, Clone)]
pub struct KvModel {
    page_size: usize,
    slots: Vec<u64>,
}

impl KvModel {
    /// Zeroed memory for a pool of `pages` pages of `page_size` tokens.
    pub fn new(pages: usize, page_size: usize) -> Self {
        KvModel {
            page_size,
            slots: vec![0; pages * page_size],
        }
    }
}

impl KvStore for KvModel {
    fn store(&mut self, page: PageId, offset: usize, value: u64) {
        self.slots[page.index() * self.page_size + offset] = value;
    }

    fn load(&self, page: PageId, offset: usize) -> u64 {
        self.slots[page.index() * self.page_size + offset]
    }
}

/// The device pool of a real [`DeviceBackend`] (e.g. `HostSim`) as a [`KvStore`]: each slot
/// is 8 bytes per layer, layer `l` holding the value mixed with `l`, so a copy that moved only
/// some layers, or poison from a failed copy, reads back as a mismatch.
#[derive(Debug)]
pub struct BackendKv<B: DeviceBackend> {
    backend: Arc<B>,
}

impl<B: DeviceBackend> BackendKv<B> {
    /// A view of `backend`'s device pool, whose geometry must have 8 bytes per token and layer.
    ///
    /// # Panics
    /// For another token size (a harness bug).
    pub fn new(backend: Arc<B>) -> Self {
        assert_eq!(backend.geometry().bytes_per_token_layer, 8);
        BackendKv { backend }
    }

    fn layer_value(value: u64, layer: usize) -> u64 {
        value ^ (layer as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    fn page(&self, layer: usize, page: PageId) -> Vec<u8> {
        let mut buf = vec![0u8; self.backend.geometry().page_bytes_per_layer()];
        self.backend
            .read_device_page(layer, page, &mut buf)
            .expect("reading a device page the cache handed out");
        buf
    }
}

impl<B: DeviceBackend> KvStore for BackendKv<B> {
    fn store(&mut self, page: PageId, offset: usize, value: u64) {
        for layer in 0..self.backend.geometry().layers {
            let mut buf = self.page(layer, page);
            buf[offset * 8..offset * 8 + 8]
                .copy_from_slice(&Self::layer_value(value, layer).to_le_bytes());
            self.backend
                .write_device_page(layer, page, &buf)
                .expect("writing a device page the cache handed out");
        }
    }

    fn load(&self, page: PageId, offset: usize) -> u64 {
        let read = |layer| {
            let buf = self.page(layer, page);
            let bytes: [u8; 8] = buf[offset * 8..offset * 8 + 8].try_into().unwrap_or([0; 8]);
            Self::layer_value(u64::from_le_bytes(bytes), layer)
        };
        let v = read(0);
        // Layers that disagree cannot hold any prefix's KV: report a value no prefix has.
        if (1..self.backend.geometry().layers).all(|l| read(l) == v) {
            v
        } else {
            0
        }
    }
}

/// The Mamba state after `tokens` in `ns` (a running state of the whole prefix, never 0 and
/// never a KV value of it).
pub fn state_value(ns: &Namespace, tokens: &[TokenId]) -> u64 {
    let last = prefix_values(ns, tokens).last().copied();
    let empty = prefix_values(ns, &[0x5eed]).last().copied().unwrap_or(1);
    (last.unwrap_or(empty) ^ 0x6d61_6d62_6100_0000) | 1
}

/// Mamba state slots addressed by slot index, as the engine's state pool.
pub trait StateStore {
    /// Writes the state held by `slot`.
    fn write_state(&mut self, slot: u32, value: u64);
    /// Reads the state `slot` holds (0: never written, or poisoned).
    fn read_state(&self, slot: u32) -> u64;
}

/// Model state memory: one `u64` per slot.
#[derive(Debug, Clone)]
pub struct StateModel(Vec<u64>);

impl StateModel {
    /// Zeroed memory for `slots` slots.
    pub fn new(slots: usize) -> Self {
        StateModel(vec![0; slots])
    }
}

impl StateStore for StateModel {
    fn write_state(&mut self, slot: u32, value: u64) {
        self.0[slot as usize] = value;
    }

    fn read_state(&self, slot: u32) -> u64 {
        self.0[slot as usize]
    }
}

/// The Mamba slot pool of a real [`DeviceBackend`] (e.g. `HostSim`): every byte of a slot's
/// item is written (the value repeated), so a copy that moved part of a state, or the poison of
/// a failed copy, reads back as 0.
#[derive(Debug)]
pub struct BackendStates<B: DeviceBackend> {
    backend: Arc<B>,
    item_bytes: usize,
}

impl<B: DeviceBackend> BackendStates<B> {
    /// A view of `backend`'s device Mamba pool, of `item_bytes` per slot (a multiple of 8).
    ///
    /// # Panics
    /// When `item_bytes` is not a positive multiple of 8 (a harness bug).
    pub fn new(backend: Arc<B>, item_bytes: usize) -> Self {
        assert!(item_bytes > 0 && item_bytes.is_multiple_of(8));
        BackendStates {
            backend,
            item_bytes,
        }
    }
}

impl<B: DeviceBackend> StateStore for BackendStates<B> {
    fn write_state(&mut self, slot: u32, value: u64) {
        let buf: Vec<u8> = (0..self.item_bytes / 8)
            .flat_map(|i| (value ^ i as u64).to_le_bytes())
            .collect();
        self.backend
            .write_extra_slot(PoolName::Mamba, slot, &buf)
            .expect("writing a Mamba slot the cache handed out");
    }

    fn read_state(&self, slot: u32) -> u64 {
        let mut buf = vec![0u8; self.item_bytes];
        self.backend
            .read_extra_slot(PoolName::Mamba, slot, &mut buf)
            .expect("reading a Mamba slot the cache handed out");
        let word = |i: usize| {
            let b: [u8; 8] = buf[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]);
            u64::from_le_bytes(b) ^ i as u64
        };
        let v = word(0);
        if (1..self.item_bytes / 8).all(|i| word(i) == v) {
            v
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_depend_on_the_whole_prefix_and_the_namespace() {
        let a = prefix_values(&Namespace::DEFAULT, &[1, 2, 3]);
        let b = prefix_values(&Namespace::DEFAULT, &[0, 2, 3]);
        let c = prefix_values(&Namespace::new("t"), &[1, 2, 3]);
        assert_ne!(a[2], b[2]);
        assert_ne!(a[2], c[2]);
        assert!(a.iter().all(|&v| v != 0));
    }

    #[test]
    fn a_hit_on_foreign_kv_is_caught() {
        let mut m = KvModel::new(4, 2);
        let pages = [PageId(3), PageId(1)];
        let ns = Namespace::DEFAULT;
        write_kv(&mut m, 2, &pages, &ns, &[5, 6, 7], 0..3);
        assert!(check_kv(&m, 2, &pages, &ns, &[5, 6, 7, 8], 3).is_ok());
        assert!(check_kv(&m, 2, &pages, &ns, &[5, 9, 7], 3).is_err());
        assert!(check_kv(&m, 2, &[PageId(1), PageId(3)], &ns, &[5, 6], 2).is_err());
    }
}
