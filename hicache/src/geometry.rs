//! KV pool geometry and host-pool layouts: where the bytes of one (layer, page) live.

use crate::error::{HiCacheError, Result};

/// Shape of a paged KV pool. Dtype-agnostic: only bytes are counted.
///
/// A device pool is layer-major: layer `l` is one contiguous region of `pages` pages, and a page
/// of a layer is `page_size × bytes_per_token_layer` contiguous bytes (K and V together).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Transformer layers.
    pub layers: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Bytes of one token's KV in one layer (K and V, all heads).
    pub bytes_per_token_layer: usize,
}

impl KvGeometry {
    /// A geometry; every field must be non-zero.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] for a zero field or a page too large to address.
    pub fn new(layers: usize, page_size: usize, bytes_per_token_layer: usize) -> Result<Self> {
        if layers == 0 || page_size == 0 || bytes_per_token_layer == 0 {
            return Err(HiCacheError::Config(
                "layers, page size and bytes per token must be non-zero".into(),
            ));
        }
        page_size
            .checked_mul(bytes_per_token_layer)
            .and_then(|b| b.checked_mul(layers))
            .ok_or_else(|| HiCacheError::Config("page size overflows".into()))?;
        Ok(KvGeometry {
            layers,
            page_size,
            bytes_per_token_layer,
        })
    }

    /// Checks a geometry built field by field (the fields are public) like [`KvGeometry::new`].
    ///
    /// # Errors
    /// As [`KvGeometry::new`].
    pub fn validate(&self) -> Result<()> {
        KvGeometry::new(self.layers, self.page_size, self.bytes_per_token_layer).map(|_| ())
    }

    /// Bytes of one page in one layer (of a validated geometry: [`KvGeometry::new`] checks that
    /// this and [`KvGeometry::page_bytes`] fit).
    #[inline]
    pub fn page_bytes_per_layer(&self) -> usize {
        self.page_size * self.bytes_per_token_layer
    }

    /// Bytes of one page over all layers.
    #[inline]
    pub fn page_bytes(&self) -> usize {
        self.page_bytes_per_layer() * self.layers
    }

    /// Bytes of a pool of `pages` pages. Every product is checked, so a geometry built field
    /// by field that [`KvGeometry::validate`] would refuse is an error here too, not a wrap.
    ///
    /// # Errors
    /// [`HiCacheError::Config`] on overflow.
    pub fn pool_bytes(&self, pages: usize) -> Result<usize> {
        self.page_size
            .checked_mul(self.bytes_per_token_layer)
            .and_then(|b| b.checked_mul(self.layers))
            .and_then(|b| b.checked_mul(pages))
            .ok_or_else(|| HiCacheError::Config(format!("a pool of {pages} pages overflows")))
    }

    /// Byte offset of (`layer`, `page`) in a layer-major pool of `pages` pages.
    #[inline]
    pub(crate) fn layer_major_offset(&self, pages: usize, layer: usize, page: usize) -> usize {
        (layer * pages + page) * self.page_bytes_per_layer()
    }
}

/// How the host pool orders its bytes. With the `serde` feature it (de)serializes as
/// `"layer_first"` / `"page_first"`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum HostLayout {
    /// `[layer][page][page bytes]`, like the device pool: a run of pages in one layer is one
    /// contiguous copy. Best for per-layer loads.
    #[default]
    LayerFirst,
    /// `[page][layer][page bytes]`: all layers of a page are contiguous, so a whole page is
    /// one contiguous object; per-layer copies touch one strided chunk per page.
    PageFirst,
}

impl HostLayout {
    /// Byte offset of (`layer`, `page`) in a host pool of `pages` pages.
    #[inline]
    pub fn offset(self, g: &KvGeometry, pages: usize, layer: usize, page: usize) -> usize {
        match self {
            HostLayout::LayerFirst => g.layer_major_offset(pages, layer, page),
            HostLayout::PageFirst => (page * g.layers + layer) * g.page_bytes_per_layer(),
        }
    }

    /// True when consecutive pages of one layer are adjacent in memory.
    #[inline]
    pub fn pages_contiguous_per_layer(self) -> bool {
        matches!(self, HostLayout::LayerFirst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_tile_the_pool_exactly_once() {
        let g = KvGeometry::new(3, 2, 5).unwrap();
        for layout in [HostLayout::LayerFirst, HostLayout::PageFirst] {
            let mut seen = vec![false; g.pool_bytes(4).unwrap()];
            for l in 0..3 {
                for p in 0..4 {
                    let o = layout.offset(&g, 4, l, p);
                    for b in &mut seen[o..o + g.page_bytes_per_layer()] {
                        assert!(!*b, "{layout:?} overlaps at layer {l} page {p}");
                        *b = true;
                    }
                }
            }
            assert!(seen.iter().all(|b| *b));
        }
        assert!(KvGeometry::new(0, 1, 1).is_err());
    }

    #[test]
    fn overflowing_geometries_and_pools_are_errors() {
        let big = usize::MAX / 2 + 1;
        assert!(KvGeometry::new(2, 1, big).is_err());
        assert!(KvGeometry::new(big, 2, 1).is_err());
        // Fields set directly, bypassing `new`: `pool_bytes` checks every product itself.
        let g = KvGeometry {
            layers: 2,
            page_size: 1,
            bytes_per_token_layer: big,
        };
        assert!(g.validate().is_err());
        assert!(g.pool_bytes(1).is_err());
        let g = KvGeometry::new(2, 4, 8).unwrap();
        assert_eq!(g.pool_bytes(3), Ok(192));
        assert!(g.pool_bytes(usize::MAX / 32).is_err());
    }
}
