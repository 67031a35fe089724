//! The hybrid-model harness shared by the Mamba, SWA and combined (SWA + Mamba) host-tier
//! tests: one setup naming the components a tree carries, one request driver playing the
//! engine for every component (it checks the bytes of every reused page, window page and
//! state, and writes what a forward pass would), and one random-traffic loop.

use std::sync::Arc;

use radixkv_hicache::{
    DeviceBackend, HiCacheConfig, HiCacheStats, HiRadixCache, HostLayout, HostSim, HostSimConfig,
    HostSize, KvGeometry, PoolName, StreamKind, WritePolicy,
};
use radixkv_radix::{
    FinishKind, MambaPolicy, PageId, PrefixCache, RadixConfig, RadixKey, RequestKv, RequestMatch,
    SwaConfig,
};
use rand_xoshiro::SplitMix64;
use rand_xoshiro::rand_core::{Rng, SeedableRng};

use super::{BYTES_PER_TOKEN, LAYERS, check_pages, hashes, mix, write_pages};

/// Bytes of one Mamba state slot.
pub const STATE_BYTES: usize = 48;
/// Bytes of one window page.
pub const SWA_BYTES: usize = 40;

/// A function of `prefix` and `seed`, `n` bytes long.
fn prefix_bytes(prefix: &[u32], seed: u64, n: usize) -> Vec<u8> {
    let mut h = seed;
    for &t in prefix {
        h = mix(h ^ u64::from(t));
    }
    let mut out = vec![0; n];
    SplitMix64::seed_from_u64(h ^ prefix.len() as u64).fill_bytes(&mut out);
    out
}

/// The state after the tokens of `prefix`: a function of the prefix, as in a real model.
pub fn state_bytes(prefix: &[u32]) -> Vec<u8> {
    prefix_bytes(prefix, 0xcbf2_9ce4_8422_2325, STATE_BYTES)
}

/// The window KV of the page ending at `prefix.len()`: a function of the prefix.
pub fn window_bytes(prefix: &[u32]) -> Vec<u8> {
    prefix_bytes(prefix, 0x8422_2325_cbf2_9ce4, SWA_BYTES)
}

/// The Mamba component of a [`Setup`].
#[derive(Clone, Debug)]
pub struct MambaSetup {
    pub slots: u32,
    pub host_slots: Option<u32>,
    pub policy: MambaPolicy,
}

impl Default for MambaSetup {
    fn default() -> Self {
        MambaSetup {
            slots: 8,
            host_slots: None,
            policy: MambaPolicy::Sglang,
        }
    }
}

/// The SWA component of a [`Setup`].
#[derive(Clone, Debug)]
pub struct SwaSetup {
    pub window_pages: usize,
    pub pages: usize,
    pub host_pages: Option<u32>,
}

impl Default for SwaSetup {
    fn default() -> Self {
        SwaSetup {
            window_pages: 2,
            pages: 16,
            host_pages: None,
        }
    }
}

/// A tiered cache over HostSim with the components given.
#[derive(Clone, Debug)]
pub struct Setup {
    pub page_size: usize,
    pub device_pages: usize,
    pub layout: HostLayout,
    pub policy: WritePolicy,
    pub gated: bool,
    pub mamba: Option<MambaSetup>,
    pub swa: Option<SwaSetup>,
}

impl Setup {
    /// Page size 4, 16 device pages, write-through, no component.
    pub fn kv_only() -> Self {
        Setup {
            page_size: 4,
            device_pages: 16,
            layout: HostLayout::PageFirst,
            policy: WritePolicy::WriteThrough,
            gated: false,
            mamba: None,
            swa: None,
        }
    }

    /// With the Mamba component (8 slots).
    pub fn mamba() -> Self {
        Setup {
            mamba: Some(MambaSetup::default()),
            ..Setup::kv_only()
        }
    }

    /// With the SWA component (a two-page window, 16 SWA pages).
    pub fn swa() -> Self {
        Setup {
            swa: Some(SwaSetup::default()),
            ..Setup::kv_only()
        }
    }

    /// With both components in one tree.
    pub fn both() -> Self {
        Setup {
            mamba: Some(MambaSetup::default()),
            swa: Some(SwaSetup::default()),
            ..Setup::kv_only()
        }
    }
}

pub fn build(s: &Setup) -> HiRadixCache<HostSim> {
    build_with(s, |_| {})
}

/// [`build`] with `f` applied to the configuration last (e.g. to add a storage tier).
pub fn build_with(s: &Setup, f: impl FnOnce(&mut HiCacheConfig)) -> HiRadixCache<HostSim> {
    let g = KvGeometry::new(LAYERS, s.page_size, BYTES_PER_TOKEN).unwrap();
    let sim = HostSimConfig {
        gated: s.gated,
        ..Default::default()
    };
    let backend = Arc::new(HostSim::new(g, s.device_pages, sim).unwrap());
    let m = s.mamba.as_ref();
    let w = s.swa.as_ref();
    let mut cfg = HiCacheConfig {
        radix: RadixConfig {
            page_size: s.page_size,
            total_pages: s.device_pages,
            max_rows: 8,
            events: true,
            mamba_slots: m.map(|m| m.slots),
            mamba_policy: m.map_or(MambaPolicy::Sglang, |m| m.policy),
            swa: w.map(|w| SwaConfig {
                window: w.window_pages * s.page_size,
                pages: w.pages,
            }),
            ..Default::default()
        },
        host_size: HostSize::Ratio(4.0),
        host_layout: s.layout,
        write_policy: s.policy,
        load_back_min_tokens: 1,
        mamba_state_bytes: m.map(|_| STATE_BYTES),
        mamba_host_slots: m.and_then(|m| m.host_slots),
        swa_page_bytes: w.map(|_| SWA_BYTES),
        swa_host_pages: w.and_then(|w| w.host_pages),
        ..Default::default()
    };
    f(&mut cfg);
    HiRadixCache::new(cfg, backend).unwrap()
}

pub fn read_state<B: DeviceBackend>(c: &HiRadixCache<B>, slot: u32) -> Vec<u8> {
    let mut out = vec![0; STATE_BYTES];
    c.backend()
        .read_extra_slot(PoolName::Mamba, slot, &mut out)
        .unwrap();
    out
}

pub fn read_window<B: DeviceBackend>(c: &HiRadixCache<B>, page: PageId) -> Vec<u8> {
    let mut out = vec![0; SWA_BYTES];
    c.backend()
        .read_extra_slot(PoolName::Swa, page.0, &mut out)
        .unwrap();
    out
}

/// Scribbles over the first `n` device slots of `pool`: a load that did not copy would be
/// caught.
pub fn scribble(c: &HiRadixCache<HostSim>, pool: PoolName, n: u32) {
    let bytes = if pool == PoolName::Mamba {
        STATE_BYTES
    } else {
        SWA_BYTES
    };
    for s in 0..n {
        c.backend()
            .write_extra_slot(pool, s, &vec![0xEE; bytes])
            .unwrap();
    }
}

/// The engine's side of one request with the Mamba component: after its forward, every slot
/// it holds has the state its contract asks for (running: at the computed length; tracking:
/// at the last page boundary; checkpoints: at their positions).
fn write_states<B: DeviceBackend>(c: &HiRadixCache<B>, r: &RequestKv) {
    let b = c.backend();
    let t = &r.key.tokens;
    let p = c.page_size();
    if let Some(s) = r.mamba_slot {
        b.write_extra_slot(PoolName::Mamba, s, &state_bytes(&t[..r.committed_len]))
            .unwrap();
    }
    if let Some(tr) = r.mamba_track {
        let at = r.committed_len - r.committed_len % p;
        b.write_extra_slot(PoolName::Mamba, tr.slot, &state_bytes(&t[..at]))
            .unwrap();
    }
    for ck in &r.mamba_checkpoints {
        if ck.pos <= r.committed_len {
            b.write_extra_slot(PoolName::Mamba, ck.slot, &state_bytes(&t[..ck.pos]))
                .unwrap();
        }
    }
}

/// One request end to end: match, begin (load-back), wait for the loads (a failed one is
/// repaired by the next step), check the bytes of the reused KV, of the window pages of the
/// prefix (SWA) and of the state it copies on write (Mamba), compute the rest, write what the
/// forward pass writes and finish. Returns what the match and the load gave.
pub fn serve(c: &mut HiRadixCache<HostSim>, tokens: &[u32]) -> (RequestMatch, usize) {
    let p = c.page_size();
    let mamba = c.device_cache().mamba_accounting().is_some();
    let swa = c.device_cache().swa_accounting().is_some();
    let h = hashes(tokens, p);
    let mut r = RequestKv::new(RadixKey::new(tokens.to_vec()));
    let m = c.match_request(&mut r).unwrap();
    let before = c.stats();
    c.begin_request(&mut r).unwrap();
    c.check_request(&r).unwrap();
    // A host hit is loaded whole, unless a counted degradation left it out: a match never
    // reports a host hit that a load cannot make usable.
    let after = c.stats();
    let degraded = |s: &HiCacheStats| {
        s.load_back_device_full + s.mamba_load_back_no_slot + s.swa_load_back_no_pages
    };
    // Loaded or not, the device prefix the match reported is kept: a declined load changes
    // nothing the prefix depends on.
    assert!(
        r.prefix_len >= m.prefix_len,
        "the {}-token device prefix shrank to {} at begin: {after:?}",
        m.prefix_len,
        r.prefix_len
    );
    assert!(
        m.host_hit_len == 0
            || r.prefix_len == m.prefix_len + m.host_hit_len
            || degraded(&after) > degraded(&before),
        "a {}-token host hit after {} device tokens was not loaded ({} usable): {after:?}",
        m.host_hit_len,
        m.prefix_len,
        r.prefix_len
    );
    if let Some(step) = c.start_loading().unwrap() {
        let counter = c.layer_counter().clone();
        counter.set_consumer(step.producer);
        if (0..counter.layers()).any(|l| counter.wait_until(l).is_err()) {
            // A failed load: the next step repairs it (KV, window, state) before it returns
            // `Ok`.
            c.step().unwrap();
        }
    }
    check_pages(&**c.backend(), &r.prefix_pages, &h[..r.prefix_pages.len()]);
    let from_page = r.swa_evicted_len / p;
    if swa {
        assert_eq!(r.swa_pages.len(), r.prefix_len / p - from_page);
        for (j, &pg) in r.swa_pages.iter().enumerate() {
            let end = (from_page + j + 1) * p;
            assert_eq!(
                read_window(c, pg),
                window_bytes(&tokens[..end]),
                "window page ending at {end} of a {}-token hit holds the wrong bytes",
                r.prefix_len
            );
        }
    }
    if mamba {
        if r.prefix_len > 0 {
            let cow = r.mamba_cow.expect("a hit copies its state");
            let src = read_state(c, cow.src);
            assert_eq!(
                src,
                state_bytes(&tokens[..r.prefix_len]),
                "the state of the {}-token hit holds the wrong bytes",
                r.prefix_len
            );
            c.backend()
                .write_extra_slot(PoolName::Mamba, cow.dst, &src)
                .unwrap();
        } else {
            assert!(r.mamba_cow.is_none());
        }
    }
    let rest = tokens.len() - r.prefix_len;
    let from = r.prefix_len;
    c.alloc_tokens(&mut r, rest).unwrap();
    let row = r.row.unwrap();
    let pages = c.pools().rows.pages(row).unwrap().to_vec();
    let whole = tokens.len() / p;
    write_pages(&**c.backend(), &pages[from / p..whole], &h[from / p..whole]);
    if swa {
        for k in from / p..whole {
            let pg = r.swa_pages[k - from_page];
            c.backend()
                .write_extra_slot(PoolName::Swa, pg.0, &window_bytes(&tokens[..(k + 1) * p]))
                .unwrap();
        }
    }
    r.commit(rest).unwrap();
    if mamba {
        write_states(c, &r);
    }
    let loaded = r.prefix_len - m.prefix_len;
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
    c.check_invariants().unwrap();
    (m, loaded)
}

/// What [`random_traffic`] saw.
#[derive(Debug)]
pub struct TrafficOutcome {
    /// Requests that reused a prefix (device or loaded).
    pub hits: usize,
    /// Loads that brought back window pages alone: no KV and no state (with both
    /// components, a node whose device state stayed while window KV in its window went).
    pub window_only_loads: usize,
    /// The cache's counters at the end.
    pub stats: HiCacheStats,
}

/// Random traffic over shared prefixes, with device evictions, evictions of the components'
/// device copies (Mamba states, window KV), failing backup and load copies, steps and
/// flushes: the audits hold after every step and every reused page, window page and state
/// holds the right bytes (checked inside [`serve`]). Six conversations over two shared stems;
/// a request is a prefix of one of them.
pub fn random_traffic(seed: u64, setup: &Setup, steps: usize) -> TrafficOutcome {
    let p = setup.page_size;
    let mut c = build(setup);
    let mut rng = SplitMix64::seed_from_u64(seed);
    let convs: Vec<Vec<u32>> = (0..6u32)
        .map(|k| {
            let mut t: Vec<u32> = (0..(2 * p) as u32).map(|i| (k % 2) * 100 + i).collect();
            t.extend((0..(6 * p) as u32).map(|i| k * 10_000 + i));
            t
        })
        .collect();
    let mut hits = 0;
    let mut window_only_loads = 0;
    let mut load_faults = 0;
    for step in 0..steps {
        let conv = &convs[(rng.next_u32() % 6) as usize];
        let len = 2 + rng.next_u32() as usize % (conv.len() - 1);
        let t = conv[..len].to_vec();
        let before = c.stats();
        let (m, loaded) = serve(&mut c, &t);
        let after = c.stats();
        hits += usize::from(m.prefix_len + loaded > 0);
        if loaded > 0
            && after.loaded_tokens == before.loaded_tokens
            && after.mamba_states_loaded == before.mamba_states_loaded
            && after.swa_pages_loaded > before.swa_pages_loaded
        {
            window_only_loads += 1;
        }
        match rng.next_u32() % 7 {
            // The next load copy fails: repaired at the next step. (One fault at a time: two
            // would fail the repair's copy too.)
            6 if c.stats().failed_loads == load_faults => {
                load_faults += 1;
                c.backend().fail_next_copies(StreamKind::Load, 1);
            }
            6 => {}
            5 => {
                // The next backup copy fails: undone (KV and components) at its ack.
                c.backend().fail_next_copies(StreamKind::Write, 1);
            }
            0 => {
                c.evict((rng.next_u32() % 16) as usize);
            }
            1 => {
                // With both components, either one's device copies go.
                let mamba = match (setup.mamba.is_some(), setup.swa.is_some()) {
                    (true, true) => rng.next_u32() % 2 == 0,
                    (m, _) => m,
                };
                if mamba {
                    c.evict_mamba_states(1 + (rng.next_u32() % 3) as usize);
                } else if setup.swa.is_some() {
                    c.evict_swa(1 + (rng.next_u32() % 4) as usize);
                }
            }
            2 => {
                c.flush().unwrap();
            }
            _ => {
                c.step().unwrap();
            }
        }
        c.check_invariants()
            .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
    }
    c.flush().unwrap();
    c.check_invariants().unwrap();
    TrafficOutcome {
        hits,
        window_only_loads,
        stats: c.stats(),
    }
}
