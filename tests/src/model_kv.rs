//! Model KV on a simulated device: tests write, for every token position they "compute", a
//! value derived from the whole token prefix up to it (as a forward pass would), and read
//! served prefixes back byte for byte. A page that holds another prefix's KV, a stale load or
//! a poisoned copy shows up as a mismatch at a named position.

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

/// A device whose geometry stores [`TOKEN_BYTES`] per token and layer.
pub struct ModelDevice<'a, B> {
    /// The backend holding the device pool.
    pub backend: &'a B,
    /// Tokens per page.
    pub page_size: usize,
    /// Layers.
    pub layers: usize,
}

impl<B: DeviceBackend> ModelDevice<'_, B> {
    /// Writes the model KV of positions `from..tokens.len()` into `pages` (read-modify-write
    /// of partly written pages).
    ///
    /// # Panics
    /// When the backend refuses a page (a test failure).
    pub fn write(&self, pages: &[PageId], from: usize, tokens: &[TokenId]) {
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

    /// Checks that `pages` hold the model KV of the first `len` positions of `tokens`.
    ///
    /// # Errors
    /// The first position holding other bytes, as a message starting with `what`.
    pub fn verify(
        &self,
        pages: &[PageId],
        len: usize,
        tokens: &[TokenId],
        what: &str,
    ) -> Result<(), String> {
        let p = self.page_size;
        if pages.len() < pages_for(len, p) {
            return Err(format!("{what}: {} pages for {len} tokens", pages.len()));
        }
        let values = prefix_values(&tokens[..len]);
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
