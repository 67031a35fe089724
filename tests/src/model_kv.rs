//! Model KV on a simulated device or in a plain slot memory: tests write, for every token
//! position they "compute", a value derived from the whole token prefix up to it (as a forward
//! pass would), and read served prefixes back (from a device, byte for byte). A page that holds another prefix's KV, a stale load or
//! a poisoned copy shows up as a mismatch at a named position.

use std::sync::Arc;

use radixkv_hicache::DeviceBackend;
use radixkv_radix::{PageId, TokenId, pages_for};

/// Bytes of one token's KV in one layer: the model value.
pub const TOKEN_BYTES: usize = 8;

/// The model value of every position of `tokens`: a hash of the prefix up to it.
pub fn prefix_values(tokens: &[TokenId]) -> Vec<u64> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    tokens
        .iter()
        .map(|&t| {
            h = (h ^ u64::from(t) ^ 0x100)
                .wrapping_mul(0x0100_0000_01b3)
                .rotate_left(7);
            h
        })
        .collect()
}

/// The bytes a position of model value `value` holds in `layer`.
pub fn slot_bytes(value: u64, layer: usize) -> [u8; TOKEN_BYTES] {
    (value ^ (layer as u64).wrapping_mul(0xff51_afd7_ed55_8ccd)).to_le_bytes()
}

/// Memory that holds model KV: written where a test "computes", read back where a cache
/// serves a prefix.
pub trait KvModel {
    /// Writes the model KV of positions `from..tokens.len()` into `pages`.
    ///
    /// # Panics
    /// When `pages` do not cover `tokens` or the memory refuses a page (a test failure).
    fn write(&mut self, pages: &[PageId], from: usize, tokens: &[TokenId]);

    /// Checks that `pages` hold the model KV of every position of `tokens`.
    ///
    /// # Errors
    /// The first position holding other KV, as a message starting with `what`.
    fn verify(&self, pages: &[PageId], tokens: &[TokenId], what: &str) -> Result<(), String>;
}

/// Fails when `pages` are too few to hold `len` tokens.
fn check_cover(pages: &[PageId], len: usize, page_size: usize, what: &str) -> Result<(), String> {
    if pages.len() < pages_for(len, page_size) {
        return Err(format!("{what}: {} pages for {len} tokens", pages.len()));
    }
    Ok(())
}

/// A device whose geometry stores [`TOKEN_BYTES`] per token and layer.
pub struct ModelDevice<B> {
    /// The backend holding the device pool (shared with the cache under test).
    pub backend: Arc<B>,
    /// Tokens per page.
    pub page_size: usize,
    /// Layers.
    pub layers: usize,
}

impl<B: DeviceBackend> KvModel for ModelDevice<B> {
    /// Read-modify-write of partly written pages.
    fn write(&mut self, pages: &[PageId], from: usize, tokens: &[TokenId]) {
        let p = self.page_size;
        let values = prefix_values(tokens);
        let mut buf = vec![0u8; p * TOKEN_BYTES];
        for (i, (chunk, &page)) in values.chunks(p).zip(pages).enumerate().skip(from / p) {
            for layer in 0..self.layers {
                self.backend
                    .read_device_page(layer, page, &mut buf)
                    .unwrap();
                for (k, &v) in chunk.iter().enumerate() {
                    if i * p + k >= from {
                        buf[k * TOKEN_BYTES..(k + 1) * TOKEN_BYTES]
                            .copy_from_slice(&slot_bytes(v, layer));
                    }
                }
                self.backend.write_device_page(layer, page, &buf).unwrap();
            }
        }
    }

    fn verify(&self, pages: &[PageId], tokens: &[TokenId], what: &str) -> Result<(), String> {
        let p = self.page_size;
        check_cover(pages, tokens.len(), p, what)?;
        let values = prefix_values(tokens);
        let mut buf = vec![0u8; p * TOKEN_BYTES];
        for (i, (chunk, &page)) in values.chunks(p).zip(pages).enumerate() {
            for layer in 0..self.layers {
                self.backend
                    .read_device_page(layer, page, &mut buf)
                    .map_err(|e| format!("{what}: reading {page:?}: {e}"))?;
                for (k, &v) in chunk.iter().enumerate() {
                    if buf[k * TOKEN_BYTES..(k + 1) * TOKEN_BYTES] != slot_bytes(v, layer) {
                        return Err(format!(
                            "{what}: position {} (page {page:?}, layer {layer}) holds foreign KV",
                            i * p + k
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Device memory without a backend: one model value per KV slot (0: never written), for caches
/// that only hand out page ids.
pub struct SlotMemory {
    values: Vec<u64>,
    page_size: usize,
}

impl SlotMemory {
    /// Memory for `pages` pages of `page_size` slots, none written.
    pub fn new(pages: usize, page_size: usize) -> Self {
        SlotMemory {
            values: vec![0; pages * page_size],
            page_size,
        }
    }

    fn slot(&self, pages: &[PageId], i: usize) -> usize {
        pages[i / self.page_size].index() * self.page_size + i % self.page_size
    }
}

impl KvModel for SlotMemory {
    fn write(&mut self, pages: &[PageId], from: usize, tokens: &[TokenId]) {
        for (i, v) in prefix_values(tokens).into_iter().enumerate().skip(from) {
            let slot = self.slot(pages, i);
            self.values[slot] = v;
        }
    }

    fn verify(&self, pages: &[PageId], tokens: &[TokenId], what: &str) -> Result<(), String> {
        check_cover(pages, tokens.len(), self.page_size, what)?;
        for (i, want) in prefix_values(tokens).into_iter().enumerate() {
            if self.values.get(self.slot(pages, i)) != Some(&want) {
                return Err(format!("{what}: position {i} holds foreign KV"));
            }
        }
        Ok(())
    }
}
