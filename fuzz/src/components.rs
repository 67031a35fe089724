//! The hybrid components of a fuzzed tiered cache (Mamba state slots, sliding-window layers),
//! sized from the few input bytes that `hicache_ops` and `tier_ops` decode for them. `tier_ops`
//! decodes these structs; `hicache_ops` decodes its own (with a byte or two more, kept so that
//! its inputs decode as they did) and hands theirs over.

use arbitrary::Arbitrary;
use radixkv_hicache::HiCacheConfig;
use radixkv_radix::{MambaPolicy, MarconiParams, RadixConfig, SwaConfig};

/// The Mamba component's bytes.
#[derive(Arbitrary, Clone, Copy, Debug)]
pub struct MambaBytes {
    pub slots: u8,
    pub host_slots: Option<u8>,
    pub state_words: u8,
    pub marconi: bool,
}

/// The sliding-window component's bytes.
#[derive(Arbitrary, Clone, Copy, Debug)]
pub struct SwaBytes {
    pub window_pages: u8,
    pub pages: u8,
    pub host_pages: Option<u8>,
    pub page_words: u8,
}

/// Bytes of one Mamba state: 8 to 32.
pub fn state_bytes(m: &MambaBytes) -> usize {
    8 * (1 + usize::from(m.state_words % 4))
}

/// Bytes of one window page (all sliding-window layers): 8 to 32.
pub fn window_page_bytes(w: &SwaBytes) -> usize {
    8 * (1 + usize::from(w.page_words % 4))
}

/// `cfg` (pages of `page_size` tokens) with the components asked for: 2 to 13 device state
/// slots and 1 to 16 host ones (or the default), a window of 1 to 4 pages over 4 to 43 device
/// window pages and 1 to 32 host ones (or the default).
pub fn with_components(
    cfg: HiCacheConfig,
    page_size: usize,
    mamba: Option<&MambaBytes>,
    swa: Option<&SwaBytes>,
) -> HiCacheConfig {
    let cfg = match mamba {
        None => cfg,
        Some(m) => HiCacheConfig {
            radix: RadixConfig {
                mamba_slots: Some(2 + u32::from(m.slots % 12)),
                mamba_policy: if m.marconi {
                    MambaPolicy::Marconi(MarconiParams::default())
                } else {
                    MambaPolicy::Sglang
                },
                ..cfg.radix
            },
            mamba_state_bytes: Some(state_bytes(m)),
            mamba_host_slots: m.host_slots.map(|n| 1 + u32::from(n % 16)),
            ..cfg
        },
    };
    match swa {
        None => cfg,
        Some(w) => HiCacheConfig {
            radix: RadixConfig {
                swa: Some(SwaConfig {
                    window: page_size * (1 + usize::from(w.window_pages % 4)),
                    pages: 4 + usize::from(w.pages % 40),
                }),
                ..cfg.radix
            },
            swa_page_bytes: Some(window_page_bytes(w)),
            swa_host_pages: w.host_pages.map(|n| 1 + u32::from(n % 32)),
            ..cfg
        },
    }
}
