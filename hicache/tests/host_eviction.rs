//! Host eviction follows the configured policy family; host `BlockStored` events wait for the
//! backup's ack.

mod common;

use std::sync::Arc;

use common::*;
use radixkv_hicache::{
    HiCacheConfig, HiRadixCache, HostLayout, HostSim, HostSimConfig, HostSize, KvGeometry,
    WritePolicy,
};
use radixkv_radix::{
    FinishKind, KvEvent, Medium, PolicyKind, PrefixCache, RadixConfig, RadixKey, RequestKv,
};

fn cache_with(
    policy: PolicyKind,
    host_policy: Option<PolicyKind>,
    sim: HostSimConfig,
) -> HiRadixCache<HostSim> {
    let g = KvGeometry::new(LAYERS, 2, BYTES_PER_TOKEN).unwrap();
    let backend = Arc::new(HostSim::new(g, 16, sim).unwrap());
    let cfg = HiCacheConfig {
        radix: RadixConfig {
            page_size: 2,
            total_pages: 16,
            max_rows: 16,
            events: true,
            policy,
            ..Default::default()
        },
        host_size: HostSize::Ratio(2.0),
        host_layout: HostLayout::PageFirst,
        write_policy: WritePolicy::WriteThrough,
        host_policy,
        load_back_min_tokens: 1,
        ..Default::default()
    };
    HiRadixCache::new(cfg, backend).unwrap()
}

fn toks(seed: u32) -> Vec<u32> {
    (0..5).map(|i| seed * 1000 + i).collect()
}

/// Serves `t` with request priority `prio`, writing its KV.
fn serve_prio(c: &mut HiRadixCache<HostSim>, t: &[u32], prio: i32) {
    let h = hashes(t, 2);
    let mut r = RequestKv::new(RadixKey::new(t.to_vec()));
    r.priority = prio;
    c.match_request(&mut r).unwrap();
    c.begin_request(&mut r).unwrap();
    let rest = t.len() - r.prefix_len;
    c.alloc_tokens(&mut r, rest).unwrap();
    let pages = c.pools().rows.pages(r.row.unwrap()).unwrap().to_vec();
    let first = r.prefix_len / 2;
    write_pages(&**c.backend(), &pages[first..2], &h[first..2]);
    r.commit(rest).unwrap();
    c.cache_finished_req(&mut r, FinishKind::Finished).unwrap();
}

fn on_host(c: &mut HiRadixCache<HostSim>, t: &[u32]) -> bool {
    let mut r = RequestKv::new(RadixKey::new(t.to_vec()));
    c.match_request(&mut r).unwrap().host_hit_len > 0
}

/// Three host-only prefixes: A reused most but accessed first, B used once, C reused once
/// and accessed last. Evicts one prefix's worth from the host and returns which survive.
fn survivors_after_one_host_eviction(
    policy: PolicyKind,
    host_policy: Option<PolicyKind>,
    prio: [i32; 3],
) -> [bool; 3] {
    let mut c = cache_with(policy, host_policy, HostSimConfig::default());
    let (a, b, cc) = (toks(1), toks(2), toks(3));
    for _ in 0..3 {
        serve_prio(&mut c, &a, prio[0]);
    }
    serve_prio(&mut c, &b, prio[1]);
    serve_prio(&mut c, &cc, prio[2]);
    serve_prio(&mut c, &cc, prio[2]);
    c.flush().unwrap();
    assert_eq!(c.evict(100), 12, "all three demoted");
    assert_eq!(c.host_tokens(), 12);
    assert_eq!(c.evict_host(4), 4, "exactly one prefix leaves the host");
    c.check_invariants().unwrap();
    assert_eq!(c.host_policy(), host_policy.unwrap_or(policy));
    [
        on_host(&mut c, &a),
        on_host(&mut c, &b),
        on_host(&mut c, &cc),
    ]
}

#[test]
fn host_eviction_uses_the_configured_policy_family() {
    // LRU: A was accessed least recently.
    assert_eq!(
        survivors_after_one_host_eviction(PolicyKind::Lru, None, [0; 3]),
        [false, true, true]
    );
    // LFU: B was reused least, although A is older.
    assert_eq!(
        survivors_after_one_host_eviction(PolicyKind::Lfu, None, [0; 3]),
        [true, false, true]
    );
    // Priority: the lowest priority goes first, whatever its recency or reuse.
    assert_eq!(
        survivors_after_one_host_eviction(PolicyKind::Priority, None, [5, 3, 0]),
        [true, true, false]
    );
    // The host tier's own policy wins over the device tier's: LFU on the host under an LRU
    // device evicts B, as LFU alone does.
    assert_eq!(
        survivors_after_one_host_eviction(PolicyKind::Lru, Some(PolicyKind::Lfu), [0; 3]),
        [true, false, true]
    );
    // MRU: the most recently used goes first.
    assert_eq!(
        survivors_after_one_host_eviction(PolicyKind::Mru, None, [0; 3]),
        [true, true, false]
    );
}

fn host_events(c: &mut HiRadixCache<HostSim>) -> Vec<(&'static str, Medium)> {
    c.take_events()
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored { medium, .. } => Some(("stored", *medium)),
            KvEvent::BlockRemoved { medium, .. } => Some(("removed", *medium)),
            KvEvent::AllBlocksCleared => None,
        })
        .collect()
}

#[test]
fn host_stored_event_waits_for_the_backup_ack() {
    let sim = HostSimConfig {
        gated: true,
        ..Default::default()
    };
    let mut c = cache_with(PolicyKind::Lru, None, sim);
    serve_prio(&mut c, &toks(1), 0);
    // The backup is queued and submitted, but its copy is held: no host event yet.
    assert_eq!(host_events(&mut c), vec![("stored", Medium::Device)]);
    c.step().unwrap();
    assert!(host_events(&mut c).is_empty(), "copy still in flight");
    assert_eq!(c.unacked_backup_pages(), 2);
    c.backend().gate().unwrap().open();
    c.flush().unwrap();
    assert_eq!(host_events(&mut c), vec![("stored", Medium::Host)]);
    assert_eq!(c.unacked_backup_pages(), 0);
    // Demotion and load-back still report in order after the ack.
    c.evict(100);
    serve(&mut c, &toks(1)).unwrap();
    c.flush().unwrap();
    assert_eq!(
        host_events(&mut c),
        vec![("removed", Medium::Device), ("stored", Medium::Device)]
    );
    c.check_invariants().unwrap();
}

#[test]
fn a_radix_config_with_mamba_slots_is_refused_until_the_tiered_cache_supports_them() {
    let g = KvGeometry::new(LAYERS, 2, BYTES_PER_TOKEN).unwrap();
    let backend = Arc::new(HostSim::new(g, 16, HostSimConfig::default()).unwrap());
    let cfg = HiCacheConfig {
        radix: RadixConfig {
            page_size: 2,
            total_pages: 16,
            mamba_slots: Some(4),
            ..Default::default()
        },
        ..Default::default()
    };
    assert!(matches!(
        HiRadixCache::new(cfg, backend),
        Err(radixkv_hicache::HiCacheError::Config(_))
    ));
}

#[test]
fn a_radix_config_with_sliding_window_layers_is_refused_until_the_tiered_cache_supports_them() {
    let g = KvGeometry::new(LAYERS, 2, BYTES_PER_TOKEN).unwrap();
    let backend = Arc::new(HostSim::new(g, 16, HostSimConfig::default()).unwrap());
    let cfg = HiCacheConfig {
        radix: RadixConfig {
            page_size: 2,
            total_pages: 16,
            swa: Some(radixkv_radix::SwaConfig {
                window: 4,
                pages: 16,
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    assert!(matches!(
        HiRadixCache::new(cfg, backend),
        Err(radixkv_hicache::HiCacheError::Config(_))
    ));
}
